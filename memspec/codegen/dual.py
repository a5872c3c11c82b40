"""Code generation for the dual form of the mini-batch schedule (see :mod:`memspec.schedule.dual`).

Writes two methods of the Memory class, in place of the materialising
``_token_grads`` / ``_chunk_step`` pair:

* ``_chunk_loss(taps..., states..., inputs...)``: the inner loss of every token of a
  chunk at once, at the chunk-start state, with each linear layer's output shifted by
  a zero *tap*; it returns the loss summed over tokens and the layers' inputs.  One
  ``torch.func.grad`` with respect to the taps gives every token's ``delta`` (gradient
  with respect to the layer output): the gradient of ``x @ W`` is ``x^T delta``.
* ``_chunk_step(starts..., states..., views..., gates...)`` (the same signature as the
  materialising one, so ``_forward_minibatch`` is shared): the recurrences of the update
  program are solved symbolically, each state after token i written as
  ``S_i = sum_R a[S, R]_i R_0 + sum_g sum_j M[S, g]_{i, j} grad_g_j`` with vectors ``a``
  ``[B, H, C]`` and lower-triangular matrices ``M`` ``[B, H, C, C]`` (products of decay
  matrices built by ``_decay_matrix``); the read then evaluates every linear layer as
  ``sum_R a_i (x_i @ R_0) + ((x x_g^T) * M) @ delta_g`` and the chunk's final state is
  row C of the same sums.

Layout: the spec's expressions are emitted in the usual ``[B, C, H, ...]`` prefix
layout; the [C, C] algebra runs head-major, ``[B, H, C, ...]``.
"""
from __future__ import annotations

import re

from ..lang.expr import BinOp, Call, Expr, Name, map_children, substitute, unparse
from ..lang.names import fresh
from ..runtime.helpers import _decay_matrix
from .exprs import P_ATOM, P_MUL
from .program import shadow_plan
from .text import shape_text, tuple_text


def _sum(terms: list) -> str:
    return " + ".join(terms)


class _Rep:
    """A state after each token of a chunk: ``vec`` chunk-start state -> ``[B, H, C]``
    coefficient local, ``mat`` gradient target -> ``[B, H, C, C]`` weights local."""

    def __init__(self, vec=None, mat=None):
        self.vec = dict(vec or {})
        self.mat = dict(mat or {})


class DualWriter:
    """Emits ``_chunk_loss`` and ``_chunk_step`` for a :class:`memspec.dual.DualForm`."""

    def __init__(self, writer, form):
        self.w = writer
        self.form = form
        self.spec = writer.spec
        self.model = self.spec.model

    # ------------------------------------------------------------ lowering
    def _lower(self, L, em, e: Expr, scope: dict, taken: set, on_site, xbase: str = "x") -> Expr:
        """``e`` with the model applications inlined and every linear site replaced by a
        local that ``on_site(kind, state, x_name, a_expr)`` binds (it emits the lines)."""
        model, sites = self.model, self.form.sites

        def bind(x: Expr, base: str, comment: str) -> Name:
            if isinstance(x, Name):
                return x
            name = fresh(base, taken)
            shape = self.w.env.infer(x, scope=scope)
            L(f"{name} = {em.with_scope(**scope).emit(x)}",
              shape_text("B, C, H", shape) + f": {comment}")
            scope[name] = tuple(shape)
            return Name(name)

        def lower(n: Expr) -> Expr:
            if isinstance(n, Call) and n.fn == model.name:
                arg = bind(lower(n.args[0]), model.arg, f"the argument of {model.name}")
                return lower(substitute(model.body, {model.arg: arg}))
            if isinstance(n, BinOp) and n.op == "@" and isinstance(n.right, Name) \
                    and sites.get(n.right.id) == "matmul":
                x = bind(lower(n.left), f"{xbase}_{n.right.id}", f"the input of the layer @ {n.right.id}")
                return Name(on_site("matmul", n.right.id, x, None))
            if isinstance(n, BinOp) and n.op == "+":
                for side, other in ((n.right, n.left), (n.left, n.right)):
                    if isinstance(side, Name) and sites.get(side.id) == "bias":
                        return Name(on_site("bias", side.id, None, lower(other)))
            return map_children(n, lower)

        return lower(e)

    def _site_shape(self, s: str) -> tuple:
        return (self.spec.state[s].shape[-1],)

    # ------------------------------------------------------------ the tapped loss
    def loss_method(self, L):
        w, spec, form = self.w, self.spec, self.form
        taken = set(w.spec_names)
        taps = {s: fresh(f"z_{s}", taken) for s in form.sites}
        states = list(form.sites)
        inputs = w.loss_inputs()
        self.loss_inputs = inputs
        self.taps = taps
        L(f"def _chunk_loss(self, {', '.join(list(taps.values()) + states + inputs)}):")
        with L.indent():
            L('"""' + "The inner loss of all C tokens of a chunk at once, at the chunk-start state "
              + ", ".join(f"{s} [B, H, {', '.join(spec.state[s].shape)}]" for s in states) + ",")
            L("with each linear layer's output shifted by a tap " + ", ".join(
                f"{taps[s]} [B, C, H, {self._site_shape(s)[0]}]" for s in states) + " (zeros): the")
            L("gradient with respect to a tap is every token's gradient with respect to that layer's output.")
            L("Returns (the loss summed over tokens, batch and heads, the inputs of the layers " +
              ", ".join(f"@ {s}" for s in states if form.sites[s] == "matmul") + ").")
            L('"""')
            em = w.emitter()
            scope: dict = {}
            xs: dict = {}

            def on_site(kind, s, x, a):
                y = fresh(f"y_{s}", taken)
                shape = self._site_shape(s)
                if kind == "matmul":
                    xs[s] = x.id
                    L(f"{y} = ({x.id}.transpose(1, 2) @ {s}).transpose(1, 2) + {taps[s]}",
                      shape_text("B, C, H", shape) + f": the layer @ {s} (head-major product)")
                else:
                    code = em.with_scope(**scope)._emit(a)
                    L(f"{y} = {code.text} + {s}.unsqueeze(1) + {taps[s]}", shape_text("B, C, H", shape) + f": + {s}")
                scope[y] = shape
                return y

            e = self._lower(L, em, spec.loss, scope, taken, on_site, xbase="xk")
            self.x_names = xs
            code = em.with_scope(**scope)._emit(e)
            aux = [xs[s] for s in states if s in xs and xs[s] not in inputs]
            L(f"return {code.at(P_ATOM)}.sum(), ({', '.join(aux)}{',' if len(aux) == 1 else ''})")
        L()

    # ------------------------------------------------------------ the chunk step
    def chunk_step(self, L):
        w, spec, form = self.w, self.spec, self.form
        rec = form.recurrence
        taken = set(w.spec_names) | set(self.taps.values())
        starts = {s: fresh(f"{s}_start", taken) for s in shadow_plan(w)[1]}
        first = w.first
        w.need(_decay_matrix)
        L(f"def _chunk_step(self, {', '.join(list(starts.values()) + w.states + w.views + w.gates)}):")
        with L.indent():
            L('"""' + "One mini-batch chunk of C tokens in the dual form: " + ", ".join(
                f"{v} [B, C, H, {spec.views[v].dim}]" for v in w.views)
              + "".join(f", {g} [B, C, H]" for g in w.gates) + ";")
            if starts:
                L(", ".join(starts.values()) + ": the chunk-start state the gradients are taken at;")
            L(", ".join(w.states) + ": the state before the chunk's first token [B, H, ...].")
            L("Each state after token i is a combination of the states before the chunk and the")
            L("tokens' gradients (outer products x_j^T delta_j): no per-token state is formed.")
            L("Returns (o " + shape_text("B, C, H", w.read_shape()) + ", the state after the chunk).")
            L('"""')
            em = w.emitter()
            w.lets(L, em, "B, C, H")
            # every token's layer gradients at the chunk-start state: one backward pass
            states = list(form.sites)
            dz = {s: fresh(f"dz_{s}", taken) for s in states}
            xnames = {s: fresh(self.x_names[s], taken) for s in states
                      if s in self.x_names and self.x_names[s] not in self.loss_inputs}
            zeros = []
            for s in states:
                d = self.spec.state[s].shape[-1]
                zeros.append(f"{first}.new_zeros({first}.shape[:3] + ({w.dim_sizes([d])},))")
            argnums = tuple(range(len(states)))
            an = f"({argnums[0]},)" if len(argnums) == 1 else repr(argnums)
            lhs_d = ", ".join(dz[s] for s in states) + ("," if len(states) == 1 else "")
            lhs_x = ", ".join(xnames.values()) + ("," if len(xnames) == 1 else "")
            lhs = f"({lhs_d}), ({lhs_x})" if xnames else f"({lhs_d}), _"
            args = zeros + [starts.get(s, s) for s in states] + self.loss_inputs
            L(f"{lhs} = torch.func.grad(self._chunk_loss, argnums={an}, has_aux=True)(")
            L(f"    {', '.join(args)})", "each token's gradient w.r.t. each layer's output, and the layers' inputs")
            # head-major factors of the gradients: grad_W_j = xk_W_j^T d_W_j (a bias: d_b_j)
            xk, dd = {}, {}
            for s in states:
                if s in self.x_names:
                    src = xnames.get(s, self.x_names[s])   # an input of the loss, or returned by it
                    xk[s] = fresh(f"{src}_h", taken)
                    L(f"{xk[s]} = {src}.transpose(1, 2)",
                      f"[B, H, C, {spec.state[s].shape[0]}]: inputs of the layer @ {s} at the chunk start")
                dd[s] = fresh(f"d_{s}_h", taken)
                L(f"{dd[s]} = {dz[s]}.transpose(1, 2)",
                  f"[B, H, C, {spec.state[s].shape[-1]}]: " + (f"grad_{s}_j = {xk[s]}_j^T {dd[s]}_j" if s in xk
                                                                 else f"grad_{s}_j = {dd[s]}_j"))
            # token-local scalar coefficients, head-major
            coef_cache: dict = {}
            ones = [None]

            def ones_h() -> str:
                if ones[0] is None:
                    ones[0] = fresh("ones", taken)
                    L(f"{ones[0]} = {first}.new_ones({first}.shape[0], {first}.shape[2], {first}.shape[1])", "[B, H, C]")
                return ones[0]

            def coef(e: Expr) -> tuple[str, bool]:
                """(code, is_number) of a token-local scalar, head-major [B, H, C]."""
                key = unparse(e)
                if key in coef_cache:
                    return coef_cache[key]
                code = em._emit(e)
                if code.number:
                    out = (code.at(P_MUL), True)
                else:
                    base = e.id if isinstance(e, Name) else "coef"
                    name = fresh(f"{base}_h", taken)
                    L(f"{name} = {code.at(P_ATOM)}.transpose(1, 2)", f"[B, H, C]: {key}")
                    out = (name, False)
                coef_cache[key] = out
                return out

            decays: dict = {}

            def decay(e: Expr) -> tuple[str, str]:
                key = unparse(e)
                if key not in decays:
                    c, num = coef(e)
                    a = f"{ones_h()} * {c}" if num else c
                    if num and c == "1":
                        a = ones_h()
                    Ln, Pn = fresh("L", taken), fresh("P", taken)
                    L(f"{Ln}, {Pn} = _decay_matrix({a})",
                      f"[B, H, C, C], [B, H, C]: decay weights of {key}")
                    decays[key] = (Ln, Pn)
                return decays[key]

            reps: dict = {}
            shifted: dict = {}
            emitted: dict = {}   # right-hand side (aliases resolved) -> the local that holds it
            canon: dict = {}     # alias -> the local first computed with the same value

            def assign(name: str, rhs: str, comment: str) -> str:
                """Bind ``name`` to ``rhs``, or alias it to an earlier local computed the same way
                (right-hand sides compared with every alias replaced by its original)."""
                key = re.sub(r"\b\w+\b", lambda m: canon.get(m.group(0), m.group(0)), rhs)
                if key in emitted:
                    L(f"{name} = {emitted[key]}", comment + " (the same weights)")
                    canon[name] = emitted[key]
                else:
                    L(f"{name} = {rhs}", comment)
                    emitted[key] = name
                return name

            def group(terms: list) -> str:
                return terms[0] if len(terms) == 1 and terms[0].isidentifier() else f"({_sum(terms)})"

            def shift(r: str) -> _Rep:
                """The representation of r before each token (after the previous one)."""
                if r in shifted:
                    return shifted[r]
                rep = reps[r]
                out = _Rep()
                vec = dict(rep.vec)
                if r not in vec:
                    vec[r] = None
                for r0, v in vec.items():
                    name = fresh(f"a_{r}_{r0}_before", taken)
                    src = f"{v}[..., :-1]" if v is not None else f"torch.zeros_like({ones_h()}[..., :-1])"
                    L(f"{name} = F.pad({src}, (1, 0), value={1.0 if r0 == r else 0.0})",
                      f"[B, H, C]: coefficient of {r0} in {r} before each token")
                    out.vec[r0] = name
                for g, m in rep.mat.items():
                    name = fresh(f"M_{r}_{g}_before", taken)
                    L(f"{name} = F.pad({m}[..., :-1, :], (0, 0, 1, 0))",
                      f"[B, H, C, C]: weights of the gradients of {g} in {r} before each token")
                    out.mat[g] = name
                shifted[r] = out
                return out

            for s in rec.order:
                coeffs = rec.coeff[s]
                x_vec: dict = {}
                x_mat: dict = {}
                x_diag: dict = {}
                for (when, r), cf in coeffs.items():
                    if when == "prev" and r == s:
                        continue
                    rep = reps[r] if when == "cur" else shift(r)
                    c, num = coef(cf)
                    for r0, v in rep.vec.items():
                        x_vec.setdefault(r0, []).append(v if c == "1" else f"{c} * {v}")
                    for g, m in rep.mat.items():
                        x_mat.setdefault(g, []).append(
                            m if c == "1" else (f"{c} * {m}" if num else f"{c}[..., None] * {m}"))
                for g, cf in form.grad_terms[s].items():
                    x_diag.setdefault(g, []).append(coef(cf))
                d = coeffs.get(("prev", s))
                rep = _Rep()
                if d is not None:
                    Ln, Pn = decay(d)
                for r0 in [r for r in w.states if r in x_vec or (r == s and d is not None)]:
                    name = fresh(f"a_{s}_{r0}", taken)
                    parts = []
                    if d is None:
                        parts.append(_sum(x_vec[r0]))
                    else:
                        if r0 == s:
                            parts.append(Pn)
                        if r0 in x_vec:
                            parts.append(f"({Ln} @ {group(x_vec[r0])}.unsqueeze(-1)).squeeze(-1)")
                    rep.vec[r0] = assign(name, _sum(parts),
                                         f"[B, H, C]: coefficient of {r0} (chunk start) in {s} after each token")
                for g in [t for t in form.targets if t in x_mat or t in x_diag]:
                    name = fresh(f"M_{s}_{g}", taken)
                    parts = []
                    if d is None:
                        if g in x_mat:
                            parts.append(_sum(x_mat[g]))
                        for c, num in x_diag.get(g, []):
                            parts.append(f"torch.diag_embed({ones_h()} * {c})" if num
                                         else f"torch.diag_embed({c})")
                    else:
                        if g in x_mat:
                            parts.append(f"{Ln} @ {group(x_mat[g])}")
                        for c, num in x_diag.get(g, []):
                            parts.append(f"{c} * {Ln}" if num else f"{Ln} * {c}.unsqueeze(-2)")
                    rep.mat[g] = assign(name, _sum(parts),
                                        f"[B, H, C, C]: weights of the gradients of {g} in {s} after each token")
                reps[s] = rep
            # the read: every token with its own state, through the linear sites
            read_reps = {s: (reps[s] if spec.order == "write_read" else shift(s)) for s in states}
            scope: dict = {}

            def on_site(kind, s, x, a):
                rep = read_reps[s]
                y = fresh(f"y_{s}", taken)
                shape = self._site_shape(s)
                if kind == "matmul":
                    xh = fresh(f"{x.id}_h", taken)
                    L(f"{xh} = {x.id}.transpose(1, 2)", f"[B, H, C, {spec.state[s].shape[0]}]")
                    terms = [f"{v}.unsqueeze(-1) * ({xh} @ {r0})" for r0, v in rep.vec.items()]
                    terms += [f"(({xh} @ {xk[g]}.transpose(-2, -1)) * {m}) @ {dd[g]}" for g, m in rep.mat.items()]
                    L(f"{y} = ({_sum(terms) if terms else f'torch.zeros_like({xh})'}).transpose(1, 2)",
                      shape_text("B, C, H", shape) + f": each token's own {s} applied, in dual form")
                else:
                    code = em.with_scope(**scope)._emit(a)
                    terms = [f"{v}.unsqueeze(-1) * {r0}.unsqueeze(-2)" for r0, v in rep.vec.items()]
                    terms += [f"{m} @ {dd[g]}" for g, m in rep.mat.items()]
                    L(f"{y} = {code.text} + ({_sum(terms)}).transpose(1, 2)",
                      shape_text("B, C, H", shape) + f": + each token's own {s}")
                scope[y] = shape
                return y

            e = self._lower(L, em, spec.read, scope, taken, on_site, xbase="xq")
            L(f"o = {em.with_scope(**scope).emit(e)}", shape_text("B, C, H", w.read_shape()))
            # the state after the chunk: row C of every representation
            finals = []
            for s in w.states:
                rep = reps[s]
                rank = len(spec.state[s].shape)
                lift = "[..., -1" + ", None" * rank + "]"
                terms = [f"{v}{lift} * {r0}" for r0, v in rep.vec.items()]
                for g, m in rep.mat.items():
                    weights = f"{m}[..., -1, :, None] * {dd[g]}"
                    terms.append(f"{xk[g]}.transpose(-2, -1) @ ({weights})" if g in xk else f"({weights}).sum(-2)")
                name = fresh(f"{s}_end", taken)
                L(f"{name} = {_sum(terms) if terms else f'torch.zeros_like({s})'}",
                  f"[B, H, {', '.join(spec.state[s].shape)}]")
                finals.append(name)
            L(f"return o, {tuple_text(finals)}")
        L()


def emit(ctx, form, L) -> None:
    """Emit the dual-form ``_chunk_loss`` and ``_chunk_step`` of the Memory class."""
    d = DualWriter(ctx, form)
    d.loss_method(L)
    d.chunk_step(L)
