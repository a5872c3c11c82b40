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
from .exprs import P_ADD
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
        self.C = fresh("C", taken)
        rec = self.form.recurrence
        if any(self.number_decay(rec.coeff[s].get(("prev", s))) for s in rec.order):
            self.free.add(self.C)
            L(f"{self.C} = {first}.shape[2]", targets=(self.C,), reads=(first,))

    def number_decay(self, d) -> bool:
        """Whether a decay expression is a plain number (its weights need the chunk size C)."""
        return d is not None and self.em._emit(d).number

    # ------------------------------------------------------------ leaves
    def coef(self, e: Expr, base: str = "coef") -> Term:
        """A token-local scalar ``[B, H, C]`` (a number: its code; a name: itself; else a local)."""
        if e not in self.coefs:
            code = self.em._emit(e)
            if code.number:
                self.coefs[e] = Ref(code.text, code.prec, is_number=True, value=constant_value(self.spec, e))
            elif isinstance(e, Name):
                self.coefs[e] = local(code.text)
            else:
                name = fresh(base, self.taken)
                self.L(f"{name} = {code.text}", f"[B, H, C]: {unparse(e)}", targets=(name,),
                       reads=expr_reads(self.em, e))
                self.coefs[e] = local(name)
        return self.coefs[e]

    def bind(self, name: str, term: Term, comment: str) -> Term:
        """``term`` bound to the local ``name``, or the local that already holds it (a leaf or a
        number is used as it is)."""
        if term.number or isinstance(term, Ref):
            return term
        if term not in self.bound:
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
            self.L(f"{Ln}, {Pn} = {weights.render()}", f"[B, H, C, C], [B, H, C]: decay weights of {unparse(e)}",
                   targets=(Ln, Pn), reads=weights.names)
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
            self.L(f"{name} = {pad.render()}", f"[B, H, C]: coefficient of {r0} in {r} before each token",
                   targets=(name,), reads=pad.names)
            out.vec[r0] = local(name)
        for g, m in rep.mat.items():
            name = fresh(f"M_{r}_{g}_before", self.taken)
            pad = Call("F.pad", (Post(m, "[..., :-1, :]"), Ref("(0, 0, 1, 0)")))
            self.L(f"{name} = {pad.render()}", f"[B, H, C, C]: weights of the gradients of {g} in {r} before each token",
                   targets=(name,), reads=pad.names)
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
                x_vec.setdefault(r0, []).append(mul(c, v))
            for g, m in rep.mat.items():
                x_mat.setdefault(g, []).append(scaled(c, m, "[..., None]"))
        for g, cf in self.form.grad_terms[s].items():
            x_diag.setdefault(g, []).append(self.coef(cf))
        return x_vec, x_mat, x_diag

    def state_rep(self, s: str, x_vec: dict, x_mat: dict, x_diag: dict) -> Rep:
        """``s`` after each token: its own decay ``d`` (L, P) applied to what flows in."""
        d = self.form.recurrence.coeff[s].get(("prev", s))
        rep = Rep()
        Ln, Pn = self.decay(d, s) if d is not None else (None, None)
        for r0 in [r for r in self.w.states if r in x_vec or (r == s and d is not None)]:
            name = fresh(f"a_{s}_{r0}", self.taken)
            parts = []
            if d is None:
                parts.append(Sum.of(*x_vec[r0]))
            else:
                if r0 == s:
                    parts.append(Pn)
                if r0 in x_vec:
                    xv = Sum.of(*x_vec[r0])
                    parts.append(Op("*", Post(Ln, ".sum(-1)"), xv) if xv.number
                                 else Post(matmul(Ln, Post(xv, ".unsqueeze(-1)")), ".squeeze(-1)"))
            rep.vec[r0] = self.bind(name, Sum.of(*parts),
                                    f"[B, H, C]: coefficient of {r0} (chunk start) in {s} after each token")
        ones = Call(method(self.first, "new_ones"), (method(self.first, "shape[:3]"),))
        for g in [t for t in self.form.targets if t in x_mat or t in x_diag]:
            name = fresh(f"M_{s}_{g}", self.taken)
            parts = []
            if d is None:
                if g in x_mat:
                    parts.append(Sum.of(*x_mat[g]))
                parts += [Call("torch.diag_embed", (Op("*", ones, c) if c.number else c,)) for c in x_diag.get(g, [])]
            else:
                if g in x_mat:
                    parts.append(matmul(Ln, Sum.of(*x_mat[g])))
                parts += [Op("*", c, Ln) if c.number else Op("*", Ln, Post(c, ".unsqueeze(-2)"))
                          for c in x_diag.get(g, [])]
            rep.mat[g] = self.bind(name, Sum.of(*parts),
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


class DualRead:
    """The read of every token with its own state, through the linear sites, and the state
    after the chunk (row C of every representation)."""

    def __init__(self, alg: ChunkAlgebra, xk: dict, dd: dict):
        self.alg, self.xk, self.dd = alg, xk, dd
        self.L, self.taken, self.inputs, self.first = alg.L, alg.taken, alg.inputs, alg.first
        self.pending: dict = {}   # output local -> _Layer
        self.scope: dict = {}
        self.reps: dict = {}

    def emit(self, lower, spec: Spec, sites) -> None:
        """``o = ...``: the read, its model applications lowered by ``lower`` with every linear
        site in dual form."""
        alg = self.alg
        self.reps = {s: (alg.reps[s] if spec.order == "write_read" else alg.shift(s)) for s in sites}
        e = lower(self.line, alg.em, spec.read, self.scope, self.taken, self.site, xbase="xq", layout="B, H, C")
        if isinstance(e, Name) and e.id in self.pending:   # the read is a layer's output: o is that line
            self.flush(rename={e.id: "o"})
        else:
            self.flush()
            em = alg.em.with_scope(**self.scope)
            self.L(f"o = {em.emit(e)}", shape_text("B, H, C", alg.w.read_shape()), targets=("o",),
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
            X = local(x.id)
            vec = [scaled(v, matmul(X, local(r0))) for r0, v in rep.vec.items()]
            mat = {(m, dd[g]): matmul(X, Post(local(self.xk[g]), ".transpose(-2, -1)")) for g, m in rep.mat.items()}
            self.pending[y] = _Layer(vec, mat, shape_text("B, H, C", shape) + f": each token's own {s} applied, in dual form",
                                     x.id, list(rep.vec.items()))
        else:
            vec = [scaled(v, Post(local(r0), ".unsqueeze(-2)")) for r0, v in rep.vec.items()]
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

    def weighted(self, sc: Term, m: Term) -> Term:
        """``(sc) * m``; bound to a local when the scores read only the inputs (then
        ``_chunk_pre`` computes it once for all full chunks)."""
        t = Op("*", Group(sc), m)
        if sc.names <= set(self.inputs):
            return self.alg.bind(fresh("scores", self.taken), t, "[B, H, C, C]: weighted scores of the inputs alone")
        return Group(t)

    def flush(self, rename=None) -> None:
        """Write the held-back layer outputs."""
        for y, layer in list(self.pending.items()):
            target = (rename or {}).get(y, y)
            if layer.x in self.inputs:
                # the layer's input is an input: its rows scaled by the coefficients read no
                # state (_chunk_pre computes them once), and the scale is on the narrower side
                x = local(layer.x)
                terms = [matmul(x if v.one else self.alg.bind(
                    fresh(f"{layer.x}_{r0}", self.taken), scaled(v, x),
                    shape_text("B, H, C", self.alg.w.shape(Name(layer.x))) + f": {layer.x} weighted by the "
                    f"coefficient of {r0}"), local(r0)) for r0, v in layer.xvec]
            else:
                terms = list(layer.vec)
            terms += [matmul(self.weighted(sc, m), local(d)) for (m, d), sc in layer.mat.items()]
            value = Sum.of(*terms) if terms else Call("torch.zeros_like", (local(self.first),))
            self.L(f"{target} = {value.render()}", layer.comment, targets=(target,), reads=value.names)
        self.pending.clear()

    # ------------------------------------------------------------ the state after the chunk
    def finals(self) -> list:
        """Write each state after the chunk (row C of its representation); returns their locals."""
        alg, xk, dd = self.alg, self.xk, self.dd
        finals = []
        last_rows: dict = {}
        for s in alg.w.states:
            shape = alg.spec.state[s].shape
            lift = "[..., -1" + ", None" * len(shape) + "]"
            terms = [scaled(v, local(r0), lift) for r0, v in alg.reps[s].vec.items()]
            for g, m in alg.reps[s].mat.items():
                last = Post(m, "[..., -1, :, None]")
                if xk.get(g) in self.inputs:   # the layer's input weighted (no state: by _chunk_pre)
                    kw = alg.bind(fresh(f"{xk[g]}_last_{m.code}", self.taken), Op("*", last, local(xk[g])),
                                  shape_text("B, H, C", alg.w.shape(Name(xk[g])))
                                  + f": {xk[g]} weighted for the state after the chunk")
                    terms.append(matmul(Post(kw, ".transpose(-2, -1)"), local(dd[g])))
                    continue
                key = (m, dd[g])
                if key not in last_rows:
                    last_rows[key] = self.last_row(key, g, Op("*", last, local(dd[g])))
                weights = last_rows[key]
                terms.append(matmul(Post(local(xk[g]), ".transpose(-2, -1)"), weights) if g in xk
                             else Post(weights, ".sum(-2)"))
            name = fresh(f"{s}_end", self.taken)
            value = Sum.of(*terms) if terms else Call("torch.zeros_like", (local(s),))
            self.L(f"{name} = {value.render()}", f"[B, H, {', '.join(shape)}]", targets=(name,), reads=value.names)
            finals.append(name)
        return finals

    def last_row(self, key: tuple, g: str, weighted: Term) -> Term:
        """The gradients of ``g`` weighted for the state after the chunk: a local when more than
        one state reads them."""
        alg = self.alg
        uses = sum(1 for r in alg.w.states for g2, m2 in alg.reps[r].mat.items() if (m2, self.dd[g2]) == key)
        if uses < 2:
            return Group(weighted)
        name = fresh(f"last_{g}", self.taken)
        self.L(f"{name} = {weighted.render()}", f"[B, H, C, {alg.spec.state[g].shape[-1]}]: the gradients of {g} "
               "weighted for the state after the chunk", targets=(name,), reads=weighted.names)
        return local(name)


__all__ = ["ChunkAlgebra", "DualRead", "Rep", "constant_value"]
