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

import ast

from ..lang.expr import BinOp, Call, Expr, Name, map_children, substitute, unparse
from ..lang.names import fresh
from ..runtime.helpers import _decay_matrix
from .exprs import P_ATOM, P_MUL, ExprEmitter
from .prestep import split_pre
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
        self.free: set = set()   # chunk-step locals with no batch axis (params, C, [C, C] constants)
        self.spec = writer.spec
        self.model = self.spec.model

    # ------------------------------------------------------------ lowering
    def _lower(self, L, em, e: Expr, scope: dict, taken: set, on_site, xbase: str = "x",
               layout: str = "B, H, C") -> Expr:
        """``e`` with the model applications inlined and every linear site replaced by a
        local that ``on_site(kind, state, x_name, a_expr)`` binds (it emits the lines)."""
        model, sites = self.model, self.form.sites

        def bind(x: Expr, base: str, comment: str) -> Name:
            if isinstance(x, Name):
                return x
            name = fresh(base, taken)
            shape = self.w.env.infer(x, scope=scope)
            L(f"{name} = {em.with_scope(**scope).emit(x)}",
              shape_text(layout, shape) + f": {comment}")
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

    # ------------------------------------------------------------ the tapped loss (no closed form)
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
            L('"""' + "The inner loss of all C tokens of a chunk at once (head-major), at the chunk-start state "
              + ", ".join(f"{s} [B, H, {', '.join(spec.state[s].shape)}]" for s in states) + ",")
            L("with each linear layer's output shifted by a tap " + ", ".join(
                f"{taps[s]} [B, H, C, {self._site_shape(s)[0]}]" for s in states) + " (zeros): the")
            L("gradient with respect to a tap is every token's gradient with respect to that layer's output.")
            L("Returns (the loss summed over tokens, batch and heads, the inputs of the layers " +
              ", ".join(f"@ {s}" for s in states if form.sites[s] == "matmul") + ").")
            L('"""')
            names = params_head_major(w, L, used_names(spec, spec.loss))
            em = w.emitter(names=names)
            scope: dict = {}
            xs: dict = {}

            def on_site(kind, s, x, a):
                y = fresh(f"y_{s}", taken)
                shape = self._site_shape(s)
                if kind == "matmul":
                    xs[s] = x.id
                    L(f"{y} = {x.id} @ {s} + {taps[s]}", shape_text("B, H, C", shape) + f": the layer @ {s}")
                else:
                    code = em.with_scope(**scope)._emit(a)
                    L(f"{y} = {code.text} + {s}.unsqueeze(-2) + {taps[s]}", shape_text("B, H, C", shape) + f": + {s}")
                scope[y] = shape
                return y

            e = self._lower(L, em, spec.loss, scope, taken, on_site, xbase="xk", layout="B, H, C")
            self.x_names = xs
            code = em.with_scope(**scope)._emit(e)
            aux = [xs[s] for s in states if s in xs and xs[s] not in inputs]
            L(f"return {code.at(P_ATOM)}.sum(), ({', '.join(aux)}{',' if len(aux) == 1 else ''})")
        L()

    # ------------------------------------------------------------ the chunk's gradients
    def closed_grads(self, L, em, starts, taken) -> tuple[dict, dict]:
        """Every token's deltas at the chunk-start state from the plan's closed-form gradient
        program, head-major; returns (state -> layer input, state -> delta)."""
        cg = self.form.grad
        taken |= {st.name for st in cg.forward + cg.backward}
        names = dict(em.names)
        names.update({s: starts.get(s, s) for s in self.spec.state})
        scope: dict = {}
        L("# every token's gradient at the chunk-start state, in closed form (memspec.schedule.backprop)")
        for st in cg.forward + cg.backward:
            if st.kind in ("layer", "back"):
                x = names.get(st.value.id, st.value.id)
                S = names[st.state]
                text = f"{x} @ {S}" if st.kind == "layer" else f"{x} @ {S}.transpose(-2, -1)"
                what = f"the layer @ {st.state}" if st.kind == "layer" else f"the loss's gradient w.r.t. {st.like}"
            else:
                sub = ExprEmitter(self.spec, names=names, like=em.like, attr=self.w.attr,
                                  helpers=self.w.helpers, scope=scope)
                if st.kind == "bias":
                    text = f"{sub._emit(st.value).text} + {names[st.state]}.unsqueeze(-2)"
                    what = f"+ {st.state}"
                else:
                    code = sub._emit(st.value)
                    text = code.text if code.rank == len(st.shape) else \
                        f"{sub._lift(code, len(st.shape))}.expand_as({st.like})"
                    what = f"the loss's gradient w.r.t. {st.like}" if st.like else ""
            L(f"{st.name} = {text}", shape_text("B, H, C", st.shape) + (f": {what}" if what else ""))
            scope[st.name] = st.shape
        xk = {site.state: site.input for site in cg.sites if site.input}
        dd = {site.state: site.delta for site in cg.sites}
        return xk, dd

    def tapped_grads(self, L, starts, taken, first) -> tuple[dict, dict]:
        """Every token's deltas by one torch.func.grad of ``_chunk_loss`` (no closed form)."""
        w, spec = self.w, self.spec
        states = list(self.form.sites)
        dz = {s: fresh(f"delta_{s}", taken) for s in states}
        xnames = {s: fresh(self.x_names[s], taken) for s in states
                  if s in self.x_names and self.x_names[s] not in self.loss_inputs}
        zeros = [f"{first}.new_zeros({first}.shape[:3] + ({w.dim_sizes([spec.state[s].shape[-1]])},))"
                 for s in states]
        argnums = tuple(range(len(states)))
        an = f"({argnums[0]},)" if len(argnums) == 1 else repr(argnums)
        lhs_d = ", ".join(dz[s] for s in states) + ("," if len(states) == 1 else "")
        lhs_x = ", ".join(xnames.values()) + ("," if len(xnames) == 1 else "")
        lhs = f"({lhs_d}), ({lhs_x})" if xnames else f"({lhs_d}), _"
        args = zeros + [starts.get(s, s) for s in states] + self.loss_inputs
        L(f"{lhs} = torch.func.grad(self._chunk_loss, argnums={an}, has_aux=True)(")
        L(f"    {', '.join(args)})", "each token's gradient w.r.t. each layer's output, and the layers' inputs")
        xk = {s: xnames.get(s, self.x_names[s]) for s in states if s in self.x_names}
        return xk, dz

    # ------------------------------------------------------------ the chunk step
    def chunk_step(self, L):
        w, spec, form = self.w, self.spec, self.form
        rec = form.recurrence
        taken = set(w.spec_names) | set(getattr(self, "taps", {}).values())
        starts = {s: fresh(f"{s}_start", taken) for s in shadow_plan(w)[1]}
        inputs = chunk_inputs(w)
        first = inputs[0]   # a [B, H, C, ...] input: the batch, chunk length, dtype and device
        head = len(L.lines)
        L(f"def _chunk_step(self, {', '.join(list(starts.values()) + w.states + inputs)}):")
        with L.indent():
            L('"""' + "One mini-batch chunk of C tokens in the dual form, head-major: " + ", ".join(
                shape_text("B, H, C", w.shape(Name(x))) .replace("[", f"{x} [", 1) for x in inputs) + ";")
            if starts:
                L(", ".join(starts.values()) + ": the chunk-start state the gradients are taken at;")
            L(", ".join(w.states) + ": the state before the chunk's first token [B, H, ...].")
            L("Each state after token i is a combination of the states before the chunk and the")
            L("tokens' gradients (outer products x_j^T delta_j): no per-token state is formed.")
            L("Returns (o " + shape_text("B, H, C", w.read_shape()) + ", the state after the chunk).")
            L('"""')
            used = direct_names(spec)
            names = params_head_major(w, L, used)
            self.free |= set(names.values())
            em = w.emitter(names=names, like=first)
            states = list(form.sites)
            if form.grad is not None:
                xk, dd = self.closed_grads(L, em, starts, taken)
            else:
                xk, dd = self.tapped_grads(L, starts, taken, first)
            # token-local scalar coefficients, head-major [B, H, C]
            coef_cache: dict = {}
            numbers: set = set()     # the codes of coefficients that are Python numbers

            def _is_number(text: str) -> bool:
                return text in numbers or _is_literal(text)

            def coef(e: Expr, base: str = "coef") -> str:
                """Code of a token-local scalar [B, H, C] (a number: its literal)."""
                key = unparse(e)
                if key not in coef_cache:
                    code = em._emit(e)
                    if code.number:
                        numbers.add(code.at(P_MUL))
                    if code.number or isinstance(e, Name):
                        coef_cache[key] = code.at(P_MUL)
                    else:
                        name = fresh(base, taken)
                        L(f"{name} = {code.text}", f"[B, H, C]: {key}")
                        coef_cache[key] = name
                return coef_cache[key]

            decays: dict = {}
            C = fresh("C", taken)

            def decay(e: Expr, s: str) -> tuple[str, str]:
                """(L, P) of the decay ``e`` of ``s``'s recurrence: L [C, C] or [B, H, C, C], P a
                number or [B, H, C]."""
                key = unparse(e)
                if key not in decays:
                    c = coef(e, f"{s}_decay")
                    if _is_literal(c) and float(c) == 1.0:
                        Ln = fresh("causal", taken)
                        self.free.add(Ln)
                        L(f"{Ln} = torch.ones({C}, {C}, dtype={first}.dtype, device={first}.device).tril()",
                          "[C, C]: the weights of a decay of 1 (a running sum)")
                        decays[key] = (Ln, "1")
                    else:
                        w.need(_decay_matrix)
                        base = c if c.isidentifier() else s
                        Ln, Pn = fresh(f"L_{base}", taken), fresh(f"P_{base}", taken)
                        if _is_number(c):
                            self.free |= {Ln, Pn}
                            L(f"{Ln}, {Pn} = _decay_matrix({first}.new_full(({C},), {c}))",
                              f"[C, C], [C]: decay weights of {key}")
                        else:
                            L(f"{Ln}, {Pn} = _decay_matrix({c})", f"[B, H, C, C], [B, H, C]: decay weights of {key}")
                        decays[key] = (Ln, Pn)
                return decays[key]

            if any(_is_number_decay(rec.coeff[s].get(("prev", s)), em) for s in rec.order):
                self.free.add(C)
                L(f"{C} = {first}.shape[2]")
            reps: dict = {}
            shifted: dict = {}
            emitted: dict = {}   # right-hand side -> the local that holds it

            def times(c: str, v: str) -> str:
                if c == "1":
                    return v
                if v == "1":
                    return c
                return f"{c} * {v}"

            def assign(name: str, rhs: str, comment: str) -> str:
                """Bind ``name`` to ``rhs``, or reuse the local computed the same way earlier."""
                if _is_number(rhs):
                    return rhs
                if rhs.isidentifier():
                    return rhs
                if rhs not in emitted:
                    L(f"{name} = {rhs}", comment)
                    emitted[rhs] = name
                return emitted[rhs]

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
                    if v == "1" and r0 == r:
                        out.vec[r0] = "1"
                        continue
                    name = fresh(f"a_{r}_{r0}_before", taken)
                    src = f"{v}[..., :-1]" if v is not None and v != "1" else \
                        f"{first}.new_full({first}.shape[:2] + ({first}.shape[2] - 1,), {1.0 if v == '1' else 0.0})"
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
                    c = coef(cf)
                    for r0, v in rep.vec.items():
                        x_vec.setdefault(r0, []).append(times(c, v))
                    for g, m in rep.mat.items():
                        x_mat.setdefault(g, []).append(
                            m if c == "1" else (f"{c} * {m}" if _is_number(c) else f"{c}[..., None] * {m}"))
                for g, cf in form.grad_terms[s].items():
                    x_diag.setdefault(g, []).append(coef(cf))
                d = coeffs.get(("prev", s))
                rep = _Rep()
                if d is not None:
                    Ln, Pn = decay(d, s)
                for r0 in [r for r in w.states if r in x_vec or (r == s and d is not None)]:
                    name = fresh(f"a_{s}_{r0}", taken)
                    parts = []
                    if d is None:
                        parts.append(_sum(x_vec[r0]))
                    else:
                        if r0 == s:
                            parts.append(Pn)
                        if r0 in x_vec:
                            xv = group(x_vec[r0])
                            parts.append(f"{Ln}.sum(-1) * {xv}" if _is_number(xv.strip("()"))
                                         else f"({Ln} @ {xv}.unsqueeze(-1)).squeeze(-1)")
                    rep.vec[r0] = assign(name, _sum(parts),
                                         f"[B, H, C]: coefficient of {r0} (chunk start) in {s} after each token")
                for g in [t for t in form.targets if t in x_mat or t in x_diag]:
                    name = fresh(f"M_{s}_{g}", taken)
                    parts = []
                    if d is None:
                        if g in x_mat:
                            parts.append(_sum(x_mat[g]))
                        for c in x_diag.get(g, []):
                            parts.append(f"torch.diag_embed({first}.new_ones({first}.shape[:3]) * {c})"
                                         if _is_number(c) else f"torch.diag_embed({c})")
                    else:
                        if g in x_mat:
                            parts.append(f"{Ln} @ {group(x_mat[g])}")
                        for c in x_diag.get(g, []):
                            parts.append(f"{c} * {Ln}" if _is_number(c) else f"{Ln} * {c}.unsqueeze(-2)")
                    rep.mat[g] = assign(name, _sum(parts),
                                        f"[B, H, C, C]: weights of the gradients of {g} in {s} after each token")
                reps[s] = rep
            # the read: every token with its own state, through the linear sites
            read_reps = {s: (reps[s] if spec.order == "write_read" else shift(s)) for s in states}
            scope: dict = {}

            def on_site(kind, s, x, a):
                rep = read_reps[s]
                y = fresh(f"yq_{s}", taken)
                shape = self._site_shape(s)
                if kind == "matmul":
                    vec = [f"{x.id} @ {r0}" if v == "1" else f"{v}.unsqueeze(-1) * ({x.id} @ {r0})"
                           for r0, v in rep.vec.items()]
                    mat = {(m, dd[g]): f"{x.id} @ {xk[g]}.transpose(-2, -1)" for g, m in rep.mat.items()}
                    # held back one step: a bias added next folds its gradient terms into these
                    pending[y] = (vec, mat, shape_text("B, H, C", shape) + f": each token's own {s} applied, in dual form",
                                  (x.id, list(rep.vec.items())))
                else:
                    vec = [f"{r0}.unsqueeze(-2)" if v == "1" else f"{v}.unsqueeze(-1) * {r0}.unsqueeze(-2)"
                           for r0, v in rep.vec.items()]
                    if isinstance(a, Name) and a.id in pending:   # (x @ W + b): one product per gradient
                        avec, amat, _, _ = pending.pop(a.id)
                        scores = dict(amat)
                        for g, m in rep.mat.items():
                            key = (m, dd[g])
                            scores[key] = f"{scores[key]} + 1" if key in scores else None
                        terms = avec + vec + [f"{weighted(sc, m)} @ {d}" if sc else f"{m} @ {d}"
                                              for (m, d), sc in scores.items()]
                        L(f"{y} = {_sum(terms)}", shape_text("B, H, C", shape) + f": each token's own layer and {s}, in dual form")
                    else:
                        flush()
                        code = em.with_scope(**scope)._emit(a)
                        terms = vec + [f"{m} @ {dd[g]}" for g, m in rep.mat.items()]
                        L(f"{y} = {code.text} + {_sum(terms)}", shape_text("B, H, C", shape) + f": + each token's own {s}")
                scope[y] = shape
                return y

            pending: dict = {}

            def weighted(sc: str, m: str) -> str:
                """``(sc) * m``; bound to a local when the scores read only the inputs (then
                ``_chunk_pre`` computes it once for all full chunks)."""
                text = f"({sc}) * {m}"
                if {n.id for n in ast.walk(ast.parse(sc)) if isinstance(n, ast.Name)} <= set(inputs):
                    return assign(fresh("scores", taken), text, "[B, H, C, C]: weighted scores of the inputs alone")
                return f"({text})"

            def flush(rename=None):
                for y, (vec, mat, comment, (x, xvec)) in list(pending.items()):
                    target = (rename or {}).get(y, y)
                    if x in inputs:
                        # the layer's input is an input: its rows scaled by the coefficients read no
                        # state (_chunk_pre computes them once), and the scale is on the narrower side
                        terms = [f"{x} @ {r0}" if v == "1" else
                                 assign(fresh(f"{x}_{r0}", taken), f"{v}.unsqueeze(-1) * {x}",
                                        shape_text("B, H, C", self.w.shape(Name(x)))
                                        + f": {x} weighted by the coefficient of {r0}") + f" @ {r0}"
                                 for r0, v in xvec] + [f"{weighted(sc, m)} @ {d}" for (m, d), sc in mat.items()]
                        L(f"{target} = {_sum(terms) if terms else 'torch.zeros_like(' + first + ')'}", comment)
                        continue
                    terms = vec + [f"{weighted(sc, m)} @ {d}" for (m, d), sc in mat.items()]
                    L(f"{target} = {_sum(terms) if terms else 'torch.zeros_like(' + first + ')'}", comment)
                pending.clear()

            def Lf(*args, **kw):   # every other line of the read comes after the held-back products
                flush()
                L(*args, **kw)

            e = self._lower(Lf, em, spec.read, scope, taken, on_site, xbase="xq", layout="B, H, C")
            if isinstance(e, Name) and e.id in pending:   # the read is a layer's output: o is that line
                flush(rename={e.id: "o"})
            else:
                flush()
                L(f"o = {em.with_scope(**scope).emit(e)}", shape_text("B, H, C", w.read_shape()))
            # the state after the chunk: row C of every representation
            finals = []
            last_rows: dict = {}
            for s in w.states:
                rep = reps[s]
                rank = len(spec.state[s].shape)
                lift = "[..., -1" + ", None" * rank + "]"
                terms = [r0 if v == "1" else f"{v}{lift} * {r0}" for r0, v in rep.vec.items()]
                for g, m in rep.mat.items():
                    if xk.get(g) in inputs:   # the layer's input weighted (no state: by _chunk_pre)
                        kw = assign(fresh(f"{xk[g]}_last_{m}", taken), f"{m}[..., -1, :, None] * {xk[g]}",
                                    shape_text("B, H, C", w.shape(Name(xk[g])))
                                    + f": {xk[g]} weighted for the state after the chunk")
                        terms.append(f"{kw}.transpose(-2, -1) @ {dd[g]}")
                        continue
                    key = (m, dd[g])
                    if key not in last_rows:
                        uses = sum(1 for r in w.states for g2, m2 in reps[r].mat.items() if (m2, dd[g2]) == key)
                        text = f"{m}[..., -1, :, None] * {dd[g]}"
                        if uses > 1:
                            last_rows[key] = fresh(f"last_{g}", taken)
                            L(f"{last_rows[key]} = {text}",
                              f"[B, H, C, {spec.state[g].shape[-1]}]: the gradients of {g} weighted for the state after the chunk")
                        else:
                            last_rows[key] = f"({text})"
                    weights = last_rows[key]
                    terms.append(f"{xk[g]}.transpose(-2, -1) @ {weights}" if g in xk else f"{weights}.sum(-2)")
                name = fresh(f"{s}_end", taken)
                L(f"{name} = {_sum(terms) if terms else f'torch.zeros_like({s})'}",
                  f"[B, H, {', '.join(spec.state[s].shape)}]")
                finals.append(name)
            L(f"return o, {tuple_text(finals)}")
        L()
        lines = L.lines[head:]
        del L.lines[head:]
        self.pre = split_pre(w, self.free, L, lines, list(starts.values()) + w.states, inputs)


def params_head_major(ctx, L, used) -> dict:
    """Bind each per-head param ``[H, *shape]`` the code uses as a local ``[H, 1, *shape]``
    (it then broadcasts against head-major ``[B, H, C, *shape]``); returns the emitter names."""
    names = {}
    for p, prm in ctx.spec.params.items():
        if p in used:
            r = len(prm.shape)
            L(f"{p} = self.{ctx.attr.get(p, p)}.unsqueeze({-r - 1})",
              f"[H, 1{''.join(', ' + str(d) for d in prm.shape)}]: per head, head-major")
            names[p] = p
    return names


def used_names(spec, *exprs, follow_lets=True) -> set:
    """The names the expressions read (through the model's body, and the lets' values)."""
    seen, todo = set(), list(exprs)
    while todo:
        e = todo.pop()
        for n in e.walk():
            if isinstance(n, Name) and n.id not in seen:
                seen.add(n.id)
                if follow_lets and n.id in spec.let:
                    todo.append(spec.let[n.id])
            if isinstance(n, Call) and spec.model is not None and n.fn == spec.model.name:
                todo.append(spec.model.body)
    return seen


def direct_names(spec) -> set:
    """The names the chunk step's own expressions read (the loss, the read, the update), lets not followed."""
    return used_names(spec, spec.loss, spec.read, *[st.value for st in spec.update], follow_lets=False)


def chunk_inputs(ctx) -> list:
    """The chunk step's per-token inputs: the views and gates it reads itself, then the lets
    (computed once over the whole sequence by :func:`sequence_inputs`)."""
    used = direct_names(ctx.spec)
    return [x for x in ctx.views + ctx.gates if x in used] + [n for n in ctx.let_order() if n in used]


def sequence_inputs(ctx, L) -> list:
    """Emit the lets over the whole head-major sequence (token-local: the same numbers as per
    chunk, once); returns the chunk step's inputs (:func:`chunk_inputs`)."""
    spec = ctx.spec
    if ctx.let_order():
        names = params_head_major(ctx, L, used_names(spec, *[spec.let[n] for n in spec.let]))
        ctx.lets(L, ctx.emitter(names=names), "B, H, T")
    return chunk_inputs(ctx)


def _is_literal(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _is_number_decay(d, em) -> bool:
    """Whether a decay expression is a plain number (its weights need the chunk size C)."""
    return d is not None and em._emit(d).number


def emit(ctx, form, L) -> DualWriter:
    """Emit the dual-form ``_chunk_step`` (and ``_chunk_pre``, its state-independent part,
    when it has one; ``_chunk_loss`` when the plan has no closed-form gradient) of the Memory
    class; returns the writer (its ``pre``: see :meth:`DualWriter.split`)."""
    d = DualWriter(ctx, form)
    if form.grad is None:
        d.loss_method(L)
    d.chunk_step(L)
    return d
