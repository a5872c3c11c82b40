"""The chunk algebra of the dual form's ``_chunk_step`` (:mod:`memspec.codegen.dual`).

:class:`ChunkAlgebra` solves the update program's recurrences over a chunk: each state after
token i is ``S_i = sum_R a[S, R]_i R_0 + sum_g sum_j M[S, g]_{i, j} grad_g_j`` with coefficient
vectors ``a`` ``[B, H, C]`` and lower-triangular weights ``M`` ``[B, H, C, C]`` (products of the
decay matrices of ``_decay_matrix``).  :class:`DualRead` then evaluates the read through every
linear layer with these sums (attention-like ``[C, C]`` products) and writes the state after
the chunk, row C of the same sums.

Values are :mod:`.dualterms` objects: which coefficients are 1 or numbers, and which products
were bound before, is decided on them; each line's text is rendered once, when it is written.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..lang.expr import Expr, Name, Num, substitute, unparse
from ..lang.names import fresh
from ..lang.spec import Spec
from ..runtime.helpers import _decay_matrix
from ..runtime.rows import _block_scan, _row_scan
from ..schedule.algebra import simplify
from .dualterms import (
    ONE,
    Call,
    Group,
    Op,
    Post,
    Ref,
    Sum,
    Term,
    local,
    matmul,
    method,
    mul,
    number,
    scaled,
)
from .exprs import P_ADD, P_ATOM
from .prestep import expr_reads
from .text import shape_text


@dataclass
class Rep:
    """A state after each token of a chunk: ``vec`` chunk-start state -> its coefficient
    ``[B, H, C]``, ``mat`` gradient target -> the weights ``[B, H, C, C]`` of its gradients."""

    vec: dict = field(default_factory=dict)
    mat: dict = field(default_factory=dict)


def constant_value(spec: Spec, e: Expr) -> float | None:
    """The value of ``e`` when it is made of numbers and the spec's constants alone, else None."""
    consts = {n: v for n, v in spec.constants.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    if any(isinstance(n, Name) and n.id not in consts for n in e.walk()):
        return None
    folded = simplify(substitute(e, {n: Num(v) for n, v in consts.items()}))
    return float(folded.value) if isinstance(folded, Num) else None


class ChunkAlgebra:
    """The representations :class:`Rep` of every state after each token of a chunk, written as
    the locals of ``_chunk_step`` (their lines through ``L``)."""

    def __init__(self, writer, L, em, taken: set, first: str, inputs: list):
        self.w, self.form, self.spec = writer.w, writer.form, writer.spec
        self.free = writer.free   # chunk-step locals with no batch axis
        self.L, self.em, self.taken = L, em, taken
        self.first, self.inputs = first, inputs
        self.coefs: dict = {}     # expression -> its coefficient term
        self.decays: dict = {}    # expression -> (L, P) of that decay
        self.bound: dict = {}     # term -> the local that holds it
        self.reps: dict = {}      # state -> Rep after each token
        self.shifted: dict = {}   # state -> Rep before each token
        self.chan: dict = {}      # local -> its channel axis (a decay per row: DualForm.rows)
        self.C = fresh("C", taken)
        rec = self.form.recurrence
        if any(self.number_decay(rec.coeff[s].get(("prev", s))) for s in rec.order):
            self.free.add(self.C)
            L(f"{self.C} = {first}.shape[2]", targets=(self.C,), reads=(first,))

    def is_chan(self, t: Term) -> bool:
        """Does ``t`` carry a channel axis: coefficients ``[B, H, d, C]``, weights ``[B, H, d, C, C]``
        (one factor per row of a state that decays per channel)?"""
        return bool(t.names & self.chan.keys())

    def chan_dim(self, t: Term) -> str:
        """The channel axis of ``t`` (one of its channel locals')."""
        return next(self.chan[n] for n in sorted(t.names) if n in self.chan)

    def up(self, t: Term, mat: bool, chan: bool) -> Term:
        """``t`` (a coefficient, or with ``mat`` weights) in the channel layout when ``chan``: a
        scalar one gains the channel axis (it broadcasts over the rows)."""
        if not chan or t.number or self.is_chan(t):
            return t
        return Post(t, ".unsqueeze(-3)" if mat else ".unsqueeze(-2)")

    def aligned(self, terms: list, mat: bool) -> list:
        """``terms`` all in the channel layout when one of them is."""
        chan = any(self.is_chan(t) for t in terms)
        return [self.up(t, mat, chan) for t in terms]

    def number_decay(self, d) -> bool:
        """Whether a decay expression is a plain number (its weights need the chunk size C)."""
        return d is not None and self.em._emit(d).number

    # ------------------------------------------------------------ leaves
    def coef(self, e: Expr, base: str = "coef") -> Term:
        """A token-local scalar ``[B, H, C]`` (a number: its code; a name: itself; else a local)."""
        if e not in self.coefs:
            code = self.em._emit(e)
            shape = self.w.env.infer(e)
            if shape is not None and len(shape) == 1:   # one factor per row: channel-major
                name = fresh(base, self.taken)
                self.L(f"{name} = {code.at(P_ATOM)}.transpose(-2, -1)", f"[B, H, {shape[0]}, C]: {unparse(e)}",
                       targets=(name,), reads=expr_reads(self.em, e))
                self.chan[name] = shape[0]
                self.coefs[e] = local(name)
            elif code.number:
                self.coefs[e] = Ref(code.text, code.prec, is_number=True, value=constant_value(self.spec, e))
            elif isinstance(e, Name):
                self.coefs[e] = local(code.text)
            else:
                name = fresh(base, self.taken)
                self.L(f"{name} = {code.text}", f"[B, H, C]: {unparse(e)}", targets=(name,),
                       reads=expr_reads(self.em, e))
                self.coefs[e] = local(name)
        return self.coefs[e]

    def bind(self, name: str, term: Term, comment: str, plain: bool = False) -> Term:
        """``term`` bound to the local ``name``, or the local that already holds it (a leaf or a
        number is used as it is); ``plain``: a term in the inputs' layout, whatever it reads."""
        if term.number or isinstance(term, Ref):
            return term
        if term not in self.bound:
            if self.is_chan(term) and not plain:
                self.chan[name] = self.chan_dim(term)
                comment = comment.replace("[B, H, ", f"[B, H, {self.chan[name]}, ", 1)
            self.L(f"{name} = {term.render()}", comment, targets=(name,), reads=term.names)
            self.bound[term] = local(name)
        return self.bound[term]

    def decay(self, e: Expr, s: str) -> tuple[Term, Term]:
        """(L, P) of the decay ``e`` of ``s``'s recurrence: L ``[C, C]`` or ``[B, H, C, C]``, P a
        number or ``[B, H, C]``."""
        if e in self.decays:
            return self.decays[e]
        c, first, C = self.coef(e, f"{s}_decay"), self.first, self.C
        if c.one:
            Ln = fresh("causal", self.taken)
            self.free.add(Ln)
            ones = Post(Call("torch.ones", (local(C), local(C)), (("dtype", method(first, "dtype")),
                                                                    ("device", method(first, "device")))), ".tril()")
            self.L(f"{Ln} = {ones.render()}", "[C, C]: the weights of a decay of 1 (a running sum)",
                   targets=(Ln,), reads=ones.names)
            self.decays[e] = (local(Ln), ONE)
            return self.decays[e]
        self.w.need(_decay_matrix)
        base = c.code if isinstance(c, Ref) and c.local else s
        Ln, Pn = fresh(f"L_{base}", self.taken), fresh(f"P_{base}", self.taken)
        if c.number:
            self.free |= {Ln, Pn}
            size = Ref(f"({C},)", reads=frozenset({C}))
            weights = Call("_decay_matrix", (Call(method(first, "new_full"), (size, c)),))
            self.L(f"{Ln}, {Pn} = {weights.render()}", f"[C, C], [C]: decay weights of {unparse(e)}",
                   targets=(Ln, Pn), reads=weights.names)
        else:
            weights = Call("_decay_matrix", (c,))
            head = f"B, H, {self.chan_dim(c)}" if self.is_chan(c) else "B, H"
            self.L(f"{Ln}, {Pn} = {weights.render()}", f"[{head}, C, C], [{head}, C]: decay weights of {unparse(e)}",
                   targets=(Ln, Pn), reads=weights.names)
            if self.is_chan(c):
                self.chan[Ln] = self.chan[Pn] = self.chan_dim(c)
        self.decays[e] = (local(Ln), local(Pn))
        return self.decays[e]

    # ------------------------------------------------------------ the recurrences
    def shift(self, r: str) -> Rep:
        """The representation of ``r`` before each token (after the previous one)."""
        if r in self.shifted:
            return self.shifted[r]
        rep, first, out = self.reps[r], self.first, Rep()
        vec = dict(rep.vec)
        vec.setdefault(r, None)
        for r0, v in vec.items():
            if v is not None and v.one and r0 == r:
                out.vec[r0] = ONE
                continue
            name = fresh(f"a_{r}_{r0}_before", self.taken)
            if v is not None and not v.one:
                src = Post(v, "[..., :-1]")
            else:
                size = Ref(f"{first}.shape[:2] + ({first}.shape[2] - 1,)", P_ADD, reads=frozenset({first}))
                src = Call(method(first, "new_full"), (size, number(1.0 if v is not None else 0.0)))
            pad = Call("F.pad", (src, Ref("(1, 0)")), (("value", number(1.0 if r0 == r else 0.0)),))
            head = f"B, H, {self.chan_dim(src)}" if self.is_chan(src) else "B, H"
            self.L(f"{name} = {pad.render()}", f"[{head}, C]: coefficient of {r0} in {r} before each token",
                   targets=(name,), reads=pad.names)
            if self.is_chan(src):
                self.chan[name] = self.chan_dim(src)
            out.vec[r0] = local(name)
        for g, m in rep.mat.items():
            name = fresh(f"M_{r}_{g}_before", self.taken)
            pad = Call("F.pad", (Post(m, "[..., :-1, :]"), Ref("(0, 0, 1, 0)")))
            head = f"B, H, {self.chan_dim(m)}" if self.is_chan(m) else "B, H"
            self.L(f"{name} = {pad.render()}", f"[{head}, C, C]: weights of the gradients of {g} in {r} before each "
                   "token", targets=(name,), reads=pad.names)
            if self.is_chan(m):
                self.chan[name] = self.chan_dim(m)
            out.mat[g] = local(name)
        self.shifted[r] = out
        return out

    def solve(self) -> None:
        """Every state's representation after each token, in the recurrence's order."""
        for s in self.form.recurrence.order:
            self.reps[s] = self.state_rep(s, *self.inflow(s))

    def inflow(self, s: str) -> tuple[dict, dict, dict]:
        """What flows into ``s`` at each token besides its own decay: chunk-start state -> terms,
        gradient target -> weight terms, gradient target -> the coefficients of its own gradient."""
        x_vec: dict = {}
        x_mat: dict = {}
        x_diag: dict = {}
        for (when, r), cf in self.form.recurrence.coeff[s].items():
            if when == "prev" and r == s:
                continue
            rep = self.reps[r] if when == "cur" else self.shift(r)
            c = self.coef(cf)
            for r0, v in rep.vec.items():
                x_vec.setdefault(r0, []).append(mul(*self.aligned([c, v], False)))
            for g, m in rep.mat.items():
                chan = self.is_chan(c) or self.is_chan(m)
                x_mat.setdefault(g, []).append(scaled(self.up(c, False, chan), self.up(m, True, chan), "[..., None]"))
        for g, cf in self.form.grad_terms[s].items():
            x_diag.setdefault(g, []).append(self.coef(cf))
        return x_vec, x_mat, x_diag

    def state_rep(self, s: str, x_vec: dict, x_mat: dict, x_diag: dict) -> Rep:
        """``s`` after each token: its own decay ``d`` (L, P) applied to what flows in."""
        d = self.form.recurrence.coeff[s].get(("prev", s))
        if d is not None and self.is_chan(self.coef(d, f"{s}_decay")):
            return self.row_rep(s, self.coef(d, f"{s}_decay"), x_vec, x_mat, x_diag)
        rep = Rep()
        Ln, Pn = self.decay(d, s) if d is not None else (None, None)
        for r0 in [r for r in self.w.states if r in x_vec or (r == s and d is not None)]:
            name = fresh(f"a_{s}_{r0}", self.taken)
            parts = []
            if d is None:
                parts.append(Sum.of(*self.aligned(x_vec[r0], False)))
            else:
                if r0 == s:
                    parts.append(Pn)
                if r0 in x_vec:
                    xv = Sum.of(*self.aligned(x_vec[r0], False))
                    chan = self.is_chan(Ln) or self.is_chan(xv)
                    column = Post(self.up(xv, False, chan), ".unsqueeze(-1)")
                    parts.append(Op("*", Post(Ln, ".sum(-1)"), xv) if xv.number
                                 else Post(matmul(self.up(Ln, True, chan), column), ".squeeze(-1)"))
            rep.vec[r0] = self.bind(name, Sum.of(*self.aligned(parts, False)),
                                    f"[B, H, C]: coefficient of {r0} (chunk start) in {s} after each token")
        ones = Call(method(self.first, "new_ones"), (method(self.first, "shape[:3]"),))
        for g in [t for t in self.form.targets if t in x_mat or t in x_diag]:
            name = fresh(f"M_{s}_{g}", self.taken)
            parts = []
            if d is None:
                if g in x_mat:
                    parts.append(Sum.of(*self.aligned(x_mat[g], True)))
                parts += [Call("torch.diag_embed", (Op("*", ones, c) if c.number else c,)) for c in x_diag.get(g, [])]
            else:
                if g in x_mat:
                    xm = Sum.of(*self.aligned(x_mat[g], True))
                    chan = self.is_chan(Ln) or self.is_chan(xm)
                    parts.append(matmul(self.up(Ln, True, chan), self.up(xm, True, chan)))
                for c in x_diag.get(g, []):
                    chan = self.is_chan(Ln) or self.is_chan(c)
                    parts.append(Op("*", c, Ln) if c.number else
                                 Op("*", self.up(Ln, True, chan), Post(self.up(c, False, chan), ".unsqueeze(-2)")))
            rep.mat[g] = self.bind(name, Sum.of(*self.aligned(parts, True)),
                                   f"[B, H, C, C]: weights of the gradients of {g} in {s} after each token")
        return rep


    def row_rep(self, s: str, a: Term, x_vec: dict, x_mat: dict, x_diag: dict) -> Rep:
        """``s`` after each token when it decays per row (``a`` ``[B, H, d, C]``): what flows in
        accumulated token by token, ``_row_scan`` (exact products of decays; no ``[C, C]`` decay
        matrix per channel is formed)."""
        self.w.need(_row_scan)
        rep = Rep()
        P = fresh(f"P_{a.code if isinstance(a, Ref) and a.local else s}", self.taken)
        self.L(f"{P} = torch.cumprod({a.render()}, dim=-1)", f"[B, H, {self.chan_dim(a)}, C]: products of the "
               f"decays of {s}", targets=(P,), reads=a.names)
        self.chan[P] = self.chan_dim(a)
        for r0 in [r for r in self.w.states if r in x_vec or r == s]:
            parts = [local(P)] if r0 == s else []
            if r0 in x_vec:
                xv = Sum.of(*self.aligned(x_vec[r0], False))
                parts.append(Call("_row_scan", (a, self.up(xv, False, True), Ref("-1"))))
            rep.vec[r0] = self.bind(fresh(f"a_{s}_{r0}", self.taken), Sum.of(*self.aligned(parts, False)),
                                    f"[B, H, C]: coefficient of {r0} (chunk start) in {s} after each token")
        for g in [t for t in self.form.targets if t in x_mat or t in x_diag]:
            parts = list(self.aligned(x_mat.get(g, []), True))
            ones = Call(method(self.first, "new_ones"), (method(self.first, "shape[:3]"),))
            parts += [Call("torch.diag_embed", (Op("*", ones, c) if c.number else c,)) for c in x_diag.get(g, [])]
            inflow = Sum.of(*[self.up(p, True, True) for p in parts])
            rep.mat[g] = self.bind(fresh(f"M_{s}_{g}", self.taken), Call("_row_scan", (a, inflow, Ref("-2"))),
                                   f"[B, H, C, C]: weights of the gradients of {g} in {s} after each token")
        return rep


@dataclass
class _Layer:
    """A layer's output in dual form, held back one line: a bias added next folds its gradient
    terms into the same products."""

    vec: list          # the chunk-start states' terms
    mat: dict          # (weights, delta) -> the scores of the inputs
    comment: str
    x: str             # the layer's input
    xvec: list         # (chunk-start state, coefficient)
    cols: bool = False   # the state scales its columns per channel: ``vec`` holds every term


class DualRead:
    """The read of every token with its own state, through the linear sites, and the state
    after the chunk (row C of every representation)."""

    def __init__(self, alg: ChunkAlgebra, xk: dict, dd: dict):
        self.alg, self.xk, self.dd = alg, xk, dd
        self.L, self.taken, self.inputs, self.first = alg.L, alg.taken, alg.inputs, alg.first
        self.pending: dict = {}   # output local -> _Layer
        self.scope: dict = {}
        self.reps: dict = {}
        self.starts = {s: s for s in alg.w.states}   # state -> the local of its value at the start (of a block)
        self.last_rows: dict = {}

    def emit(self, lower, spec: Spec, sites, out: str = "o") -> None:
        """``o = ...`` (or ``out``): the read, its model applications lowered by ``lower`` with
        every linear site in dual form."""
        alg = self.alg
        self.reps = {s: (alg.reps[s] if spec.order == "write_read" else alg.shift(s)) for s in sites}
        e = lower(self.line, alg.em, spec.read, self.scope, self.taken, self.site, xbase="xq", layout="B, H, C")
        if isinstance(e, Name) and e.id in self.pending:   # the read is a layer's output: o is that line
            self.flush(rename={e.id: out})
        else:
            self.flush()
            em = alg.em.with_scope(**self.scope)
            self.L(f"{out} = {em.emit(e)}", shape_text("B, H, C", alg.w.read_shape()), targets=(out,),
                   reads=expr_reads(em, e))

    def line(self, *args, **kw) -> None:
        """Every other line of the read comes after the held-back products."""
        self.flush()
        self.L(*args, **kw)

    def site(self, kind: str, s: str, x, a) -> str:
        """The output of the linear site of ``s`` (``x @ s`` or ``a + s``) for every token."""
        rep, dd = self.reps[s], self.dd
        y = fresh(f"yq_{s}", self.taken)
        shape = (self.alg.spec.state[s].shape[-1],)
        if kind == "matmul":
            X, cols = local(self.loc(x.id)), s in self.alg.form.cols
            vec = [self.start_read(X, v, local(self.starts[r0]), cols) for r0, v in rep.vec.items()]
            mat = {}
            for g, m in rep.mat.items():
                if cols and self.alg.is_chan(m):   # weights per output channel: no [C, C] scores to share
                    vec.append(self.column_terms(X, local(self.xk[g]), m, local(dd[g])))
                else:
                    mat[(m, dd[g])] = self.channel_scores(X, local(self.xk[g]), m) if self.alg.is_chan(m) \
                        else matmul(X, Post(local(self.xk[g]), ".transpose(-2, -1)"))
            self.pending[y] = _Layer(vec, mat, shape_text("B, H, C", shape) + f": each token's own {s} applied, in "
                                     "dual form", self.loc(x.id), list(rep.vec.items()), cols)
        else:
            vec = [scaled(v, Post(local(self.starts[r0]), ".unsqueeze(-2)")) for r0, v in rep.vec.items()]
            if isinstance(a, Name) and a.id in self.pending:   # (x @ W + b): one product per gradient
                layer = self.pending.pop(a.id)
                scores = dict(layer.mat)
                for g, m in rep.mat.items():
                    key = (m, dd[g])
                    scores[key] = Sum.of(scores[key], ONE) if key in scores else None
                terms = Sum.of(*layer.vec, *vec, *[matmul(self.weighted(sc, m) if sc else m, local(d))
                                                  for (m, d), sc in scores.items()])
                self.L(f"{y} = {terms.render()}", shape_text("B, H, C", shape)
                       + f": each token's own layer and {s}, in dual form", targets=(y,), reads=terms.names)
            else:
                self.flush()
                em = self.alg.em.with_scope(**self.scope)
                code = em._emit(a)
                terms = Sum.of(Ref(code.text, code.prec, reads=frozenset(expr_reads(em, a))), *vec,
                               *[matmul(m, local(dd[g])) for g, m in rep.mat.items()])
                self.L(f"{y} = {terms.render()}", shape_text("B, H, C", shape) + f": + each token's own {s}",
                       targets=(y,), reads=terms.names)
        self.scope[y] = shape
        return y

    def loc(self, n: str) -> str:
        """The local that holds the spec's name ``n`` (in blocks: its folded value)."""
        return self.alg.em.names.get(n, n)

    def shape(self, local_name: str) -> tuple:
        """The shape of a local that is a spec name's value (a view, gate or let)."""
        back = {v: k for k, v in self.alg.em.names.items()}
        return self.alg.w.shape(Name(back.get(local_name, local_name)))

    def rows(self, v: Term, x: Term) -> Term:
        """``x`` ``[B, H, C, d]`` with each row scaled by the per-channel coefficient ``v`` ``[B, H, d, C]``."""
        return Op("*", x, Post(v, ".transpose(-2, -1)"))

    def start_read(self, x: Term, v: Term, start: Term, cols: bool) -> Term:
        """Each token's input ``x`` ``[B, H, C, d_in]`` through a chunk-start state scaled by its
        coefficient ``v``: a number or ``[B, H, C]``, or per channel ``[B, H, d, C]`` on the state's
        rows (``x`` scaled before the product) or columns (the product scaled after)."""
        if not self.alg.is_chan(v):
            return scaled(v, matmul(x, start))
        if cols:
            return self.rows(v, Group(matmul(x, start)))
        return matmul(Group(self.rows(v, x)), start)

    def column_terms(self, x: Term, xk: Term, m: Term, d: Term) -> Term:
        """The gradients' part of a layer whose state scales its columns per channel: ``sum_j
        (x_i . xk_j) m[c, i, j] d[j, c]`` ``[B, H, C, d_out]`` for the inputs ``x``, ``xk`` ``[B, H, C,
        d_in]``, the deltas ``d`` ``[B, H, C, d_out]`` and the weights ``m`` ``[B, H, d_out, C, C]``
        (one per output channel: the scores weighted per channel, then summed over the tokens j)."""
        scores = Post(Group(matmul(x, Post(xk, ".transpose(-2, -1)"))), ".unsqueeze(-3)")
        weighted = Op("*", Op("*", m, scores), Post(d, ".transpose(-2, -1).unsqueeze(-2)"))
        return Post(Group(weighted), ".sum(-1).transpose(-2, -1)")

    def channel_scores(self, x: Term, xk: Term, m: Term) -> Term:
        """The scores of the inputs ``x`` and ``xk`` ``[B, H, C, d]`` weighted per channel by ``m``
        ``[B, H, d, C, C]``: ``sum_c x[i, c] m[c, i, j] xk[j, c]`` ``[B, H, C, C]``, one product of a
        row of ``x`` by the weighted keys ``[d, C]`` per token (``m`` token-major: ``_row_scan``)."""
        weighted = Op("*", Post(m, ".transpose(-3, -2)"), Post(xk, ".transpose(-2, -1).unsqueeze(-3)"))
        return Post(Group(matmul(Post(x, ".unsqueeze(-2)"), weighted)), ".squeeze(-2)")

    def weighted(self, sc: Term, m: Term) -> Term:
        """``(sc) * m``; bound to a local when the scores read only the inputs (then
        ``_chunk_pre`` computes it once for all full chunks).  Weights per channel are already
        in ``sc`` (:meth:`channel_scores`)."""
        if self.alg.is_chan(m):   # (the weights read no state: the scores do when the inputs do)
            if sc.names - m.names <= set(self.inputs):
                return self.alg.bind(fresh("scores", self.taken), sc, "[B, H, C, C]: scores of the inputs alone, "
                                     "weighted per channel", plain=True)
            return sc
        t = Op("*", Group(sc), m)
        if sc.names <= set(self.inputs):
            return self.alg.bind(fresh("scores", self.taken), t, "[B, H, C, C]: weighted scores of the inputs alone")
        return Group(t)

    def flush(self, rename=None) -> None:
        """Write the held-back layer outputs."""
        for y, layer in list(self.pending.items()):
            target = (rename or {}).get(y, y)
            if layer.x in self.inputs and not layer.cols:
                # the layer's input is an input: its rows scaled by the coefficients read no
                # state (_chunk_pre computes them once), and the scale is on the narrower side
                x = local(layer.x)
                terms = [matmul(x if v.one else self.alg.bind(
                    fresh(f"{layer.x}_{r0}", self.taken), self.rows(v, x) if self.alg.is_chan(v) else scaled(v, x),
                    shape_text("B, H, C", self.shape(layer.x)) + f": {layer.x} weighted by the "
                    f"coefficient of {r0}", plain=True), local(self.starts[r0])) for r0, v in layer.xvec]
            else:
                terms = list(layer.vec)
            terms += [matmul(self.weighted(sc, m), local(d)) for (m, d), sc in layer.mat.items()]
            value = Sum.of(*terms) if terms else Call("torch.zeros_like", (local(self.first),))
            self.L(f"{target} = {value.render()}", layer.comment, targets=(target,), reads=value.names)
        self.pending.clear()

    # ------------------------------------------------------------ the state after the chunk
    def finals(self) -> list:
        """Write each state after the chunk (row C of its representation); returns their locals."""
        alg = self.alg
        finals = []
        for s in alg.w.states:
            shape = alg.spec.state[s].shape
            terms = [self.start_term(s, r0, v) for r0, v in alg.reps[s].vec.items()] + self.gradient_terms(s)
            name = fresh(f"{s}_end", self.taken)
            value = Sum.of(*terms) if terms else Call("torch.zeros_like", (local(s),))
            self.L(f"{name} = {value.render()}", f"[B, H, {', '.join(shape)}]", targets=(name,), reads=value.names)
            finals.append(name)
        return finals

    def start_term(self, s: str, r0: str, v: Term) -> Term:
        """The state ``r0`` at the start times its coefficient ``v`` in ``s`` after the last token."""
        shape = self.alg.spec.state[s].shape
        chan = self.alg.is_chan(v)   # one factor per row (or column): that axis is the channel axis
        if chan and s in self.alg.form.cols:
            return scaled(v, local(self.starts[r0]), "[..., None, :, -1]")
        lift = "[..., -1" + ", None" * (len(shape) - chan) + "]"
        return scaled(v, local(self.starts[r0]), lift)

    def outer_sum(self, x: Term, w: Term) -> Term:
        """``x^T w`` summed over the chunk's rows, by ``_outer_sum`` (both gradients row-major)."""
        self.alg.w.helpers.add("_outer_sum")
        return Call("_outer_sum", (x, w))

    def gradient_terms(self, s: str) -> list:
        """The gradients' terms of ``s`` after the last token (row C of its weights)."""
        alg, xk, dd = self.alg, self.xk, self.dd
        terms = []
        for g, m in alg.reps[s].mat.items():
            if alg.is_chan(m) and s in alg.form.cols:   # one weight per column: the deltas weighted per channel
                w = Op("*", Post(m, "[..., -1, :].transpose(-2, -1)"), local(dd[g]))
                terms.append(self.outer_sum(local(xk[g]), w))
                continue
            if alg.is_chan(m):   # one weight per row: the layer's input weighted per channel
                w = Op("*", Post(m, "[..., -1, :].transpose(-2, -1)"), local(xk[g]))
                w = alg.bind(fresh(f"{xk[g]}_last_{m.code}", self.taken), w, shape_text(
                    "B, H, C", self.shape(xk[g])) + f": {xk[g]} weighted per channel for the state after the "
                    "chunk", plain=True) if xk[g] in self.inputs else w
                terms.append(self.outer_sum(w, local(dd[g])))
                continue
            last = Post(m, "[..., -1, :, None]")
            if xk.get(g) in self.inputs:   # the layer's input weighted (no state: by _chunk_pre)
                kw = alg.bind(fresh(f"{xk[g]}_last_{m.code}", self.taken), Op("*", last, local(xk[g])),
                              shape_text("B, H, C", self.shape(xk[g]))
                              + f": {xk[g]} weighted for the state after the chunk")
                terms.append(self.outer_sum(kw, local(dd[g])))
                continue
            key = (m, dd[g])
            if key not in self.last_rows:
                self.last_rows[key] = self.last_row(key, g, Op("*", last, local(dd[g])))
            weights = self.last_rows[key]
            terms.append(self.outer_sum(local(xk[g]), weights) if g in xk
                         else Post(weights, ".sum(-2)"))
        return terms

    def block_passing(self, heads: Term) -> list:
        """In blocks (the chunk's tokens folded ``[B, H * nb, block, ...]``, each block's start
        states the "chunk start" of its representations): each state at every block's end, its
        coefficients' last rows times the states at the block's start plus its gradients' part,
        solved over the blocks in the recurrence's order (``_block_scan`` for its own decay); the
        states at every block's start become the reads' (``self.starts``).  Returns the final
        states' locals."""
        alg, L, taken = self.alg, self.L, self.taken
        alg.w.need(_block_scan)
        unfold = f".unflatten(1, ({heads.render()}, -1))"
        starts: dict = {}
        finals: dict = {}
        for s in alg.form.recurrence.order:   # each state after those that flow into it
            shape, cols = alg.spec.state[s].shape, s in alg.form.cols
            own, inflow = None, []
            for r0, v in alg.reps[s].vec.items():
                if not v.number:
                    name = fresh(f"a_{s}_{r0}_block", taken)
                    t = Post(v, "[..., -1]" + unfold + (".unsqueeze(-2)" if cols and alg.is_chan(v) else ""))
                    head = (f"B, H, nb, 1, {alg.chan_dim(v)}" if cols else f"B, H, nb, {alg.chan_dim(v)}") \
                        if alg.is_chan(v) else "B, H, nb"
                    L(f"{name} = {t.render()}", f"[{head}]: coefficient of {r0} (block start) in {s} at the block's "
                      "end", targets=(name,), reads=t.names | heads.names)
                    v = local(name)
                if r0 == s:
                    own = v
                else:
                    chan = alg.is_chan(alg.reps[s].vec[r0])   # (on columns it is [B, H, nb, 1, d] already)
                    lift = "" if chan and cols else ", None" * (len(shape) - chan)
                    inflow.append(local(starts[r0]) if v.one else
                                  Op("*", v if v.number or not lift else Post(v, f"[...{lift}]"), local(starts[r0])))
            terms = self.gradient_terms(s)
            if terms:
                name = fresh(f"G_{s}", taken)
                t = Post(Group(Sum.of(*terms)), unfold)
                L(f"{name} = {t.render()}", f"[B, H, nb, {', '.join(shape)}]: the gradients' part of {s} at each "
                  "block's end", targets=(name,), reads=t.names | heads.names)
                inflow.append(local(name))
            nb = f"{self.first}.shape[1] // {heads.render()}"   # blocks per chunk
            zeros = Call("torch.zeros_like", (Post(local(s), f".unsqueeze(2).expand(-1, -1, {nb}, *{s}.shape[2:])"),))
            x = Sum.of(*inflow) if inflow else zeros
            starts[s], finals[s] = fresh(f"{s}_starts", taken), fresh(f"{s}_end", taken)
            dims = ", ".join(shape)
            comment = f"[B, H, nb, {dims}], [B, H, {dims}]: {s} at each block's start, and after the chunk"
            if own is not None:
                value = Call("_block_scan", (own, x, local(self.starts[s])))
                L(f"{starts[s]}, {finals[s]} = {value.render()}", comment, targets=(starts[s], finals[s]),
                  reads=value.names | heads.names | {self.first})
            else:   # no decay of its own: each block's end is what flows in
                ends = fresh(f"{s}_ends", taken)
                L(f"{ends} = {x.render()}", f"[B, H, nb, {', '.join(shape)}]: {s} at each block's end", targets=(ends,),
                  reads=x.names | heads.names | {self.first})
                L(f"{starts[s]}, {finals[s]} = torch.cat([{self.starts[s]}.unsqueeze(2), {ends}[:, :, :-1]], dim=2), "
                  f"{ends}[:, :, -1]", comment, targets=(starts[s], finals[s]), reads=(self.starts[s], ends))
        blocks = {s: fresh(f"{s}_blocks", taken) for s in alg.w.states}
        for s in alg.w.states:
            L(f"{blocks[s]} = {starts[s]}.flatten(1, 2)", f"[B, H * nb, {', '.join(alg.spec.state[s].shape)}]: {s} "
              "at each block's start, folded", targets=(blocks[s],), reads=(starts[s],))
        self.starts = dict(blocks)
        return [finals[s] for s in alg.w.states]

    def last_row(self, key: tuple, g: str, weighted: Term) -> Term:
        """The gradients of ``g`` weighted for the state after the chunk: a local when more than
        one state reads them."""
        alg = self.alg
        uses = sum(1 for r in alg.w.states for g2, m2 in alg.reps[r].mat.items() if (m2, self.dd[g2]) == key)
        if uses < 2:
            return weighted
        name = fresh(f"last_{g}", self.taken)
        self.L(f"{name} = {weighted.render()}", f"[B, H, C, {alg.spec.state[g].shape[-1]}]: the gradients of {g} "
               "weighted for the state after the chunk", targets=(name,), reads=weighted.names)
        return local(name)


__all__ = ["ChunkAlgebra", "DualRead", "Rep", "constant_value"]
