"""The shape vocabulary and the shape rules of the language's functions.

The vocabulary (:data:`Shape`, :data:`CACHE_AXIS`, :func:`fmt_shape`, :func:`broadcast`,
:func:`matmul_shape`, :func:`steps_value`) is shared by :mod:`.shapes`, which re-exports it.

:class:`FunctionRules` holds the rule of every call: ``f(args)`` of a built-in function (its
arity, then ``_fn_<name>`` or the elementwise / reduction default) and the application of the
spec's model, each with its located errors (``docs/language.md`` states the rules).  It is a
mixin of :class:`~memspec.lang.shapes.ShapeEnv`: its methods type their arguments with the
environment's ``_infer`` under the same context (:class:`_Ctx`), and read its ``spec``,
``kinds``, ``names``, ``cache_axis``, ``is_cache`` and ``_diag_arg``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .errors import Collector, Span, did_you_mean
from .limits import MAX_CG_STEPS, MAX_NS_STEPS
from .expr import FUNCTIONS, ELEMENTWISE_FUNCTIONS, Call, Expr, Name, Num, unparse

Shape = tuple  # tuple[str, ...]

CACHE_AXIS = "n"
"""The leading axis of a cache state (its current length), as printed in shapes."""

REDUCTIONS = frozenset({"sum", "mean", "norm"})

def steps_value(e: Expr, constants=None):
    """The iterations of ``newton_schulz(X, steps)``: an integer literal in 1..MAX_NS_STEPS (Muon's
    one triple each step), or the name of a constant holding a coefficient schedule (a tuple of
    ``(a, b, c)`` triples, one per step); None when it is neither."""
    if isinstance(e, Num) and float(e.value).is_integer() and 1 <= float(e.value) <= MAX_NS_STEPS:
        return int(e.value)
    if isinstance(e, Name) and constants is not None and isinstance(constants.get(e.id), tuple):
        return constants[e.id]
    return None


def cg_steps(e: Expr, constants=None):
    """The iterations of ``cg(A, B, steps)``: an integer literal in 1..MAX_CG_STEPS, or the name of a
    constant holding one; None when it is neither."""
    v = e.value if isinstance(e, Num) else constants.get(e.id) if isinstance(e, Name) and constants else None
    if isinstance(v, (int, float)) and not isinstance(v, bool) and float(v).is_integer() \
            and 1 <= float(v) <= MAX_CG_STEPS:
        return int(v)
    return None


def fmt_shape(shape: Optional[Shape]) -> str:
    """``("d_k", "d_v")`` -> ``"[d_k, d_v]"``; ``()`` -> ``"[]"``; unknown -> ``"[?]"``."""
    if shape is None:
        return "[?]"
    return "[" + ", ".join(shape) + "]"


def broadcast(a: Shape, b: Shape) -> Optional[Shape]:
    """Numpy trailing broadcasting on named dims (no size-1 axes): align from the right,
    every aligned pair must name the same dim.  ``None`` when they do not broadcast."""
    out = []
    for i in range(1, max(len(a), len(b)) + 1):
        x = a[-i] if i <= len(a) else None
        y = b[-i] if i <= len(b) else None
        if x is not None and y is not None and x != y:
            return None
        out.append(x if x is not None else y)
    return tuple(reversed(out))


def matmul_shape(a: Shape, b: Shape) -> Optional[Shape]:
    """The ``@`` table: ``[n]@[n,m]->[m]``, ``[m,n]@[n,p]->[m,p]``, ``[m,n]@[n]->[m]``,
    ``[n]@[n]->[]``.  ``None`` when the inner dims disagree or a rank is not 1 or 2."""
    if len(a) not in (1, 2) or len(b) not in (1, 2):
        return None
    inner_a = a[-1]
    inner_b = b[0]
    if inner_a != inner_b:
        return None
    return tuple(a[:-1]) + tuple(b[1:])


@dataclass
class _Ctx:
    context: Optional[str]
    scope: dict
    diags: Collector
    record: Optional[dict]
    model_stack: tuple = ()


class FunctionRules:
    """The shape rules of calls, a mixin of :class:`~memspec.lang.shapes.ShapeEnv` (it uses the
    environment's ``_infer``, ``spec``, ``kinds``, ``names``, ``cache_axis``, ``is_cache`` and
    ``_diag_arg``)."""

    def _call(self, e: Call, ctx: _Ctx) -> Optional[Shape]:
        fn = e.fn
        span = e.fn_span or e.span
        m = self.spec.model
        if m is not None and fn == m.name:
            return self._apply_model(e, ctx)
        if fn not in FUNCTIONS:
            kind = self.kinds.get(fn)
            if kind is not None:
                ctx.diags.error(f"'{fn}' is a {kind}, not a function", span,
                                hint="names of the spec are values; functions are " + _fn_examples(),
                                code="E-unknown-function")
            else:
                # functions that take this many arguments (a one-argument call is no misspelt cg(A, B, steps))
                cands = [f for f, (lo, hi, _) in FUNCTIONS.items() if lo <= len(e.args) <= hi] + \
                    ([m.name] if m is not None else [])
                hint = _FUNCTION_HINTS.get(fn) or did_you_mean(fn, cands)
                if hint is None and m is not None and len(e.args) == 1:
                    hint = f"the model is {m.name}({m.arg}); other functions are " + _fn_examples()
                ctx.diags.error(f"unknown function '{fn}'", span,
                                hint=hint or "functions are " + _fn_examples(),
                                code="E-unknown-function")
            for a in e.args:
                self._infer(a, ctx)
            return None
        lo, hi, desc = FUNCTIONS[fn]
        if not lo <= len(e.args) <= hi:
            want = str(lo) if lo == hi else f"{lo} to {hi}"
            noun = "argument" if (lo == hi == 1) else "arguments"
            ctx.diags.error(f"{fn} takes {want} {noun}, got {len(e.args)}", e.span,
                            hint=f"{fn}: {desc}", code="E-arity")
            for a in e.args:
                if not (fn == "grad" and isinstance(a, Name) and a.id == "loss"):
                    self._infer(a, ctx)
            return None
        handler = getattr(self, "_fn_" + fn, None)
        if handler is not None:
            return handler(e, ctx)
        shapes = [self._infer(a, ctx) for a in e.args]
        if fn in ELEMENTWISE_FUNCTIONS:
            return shapes[0]
        if fn in REDUCTIONS:
            return () if shapes[0] is not None else None
        raise AssertionError(f"no shape rule for {fn}")  # pragma: no cover - FUNCTIONS and rules in sync

    def _elementwise_n(self, e: Call, ctx: _Ctx) -> Optional[Shape]:
        shapes = [self._infer(a, ctx) for a in e.args]
        if any(s is None for s in shapes):
            return None
        out = shapes[0]
        for s in shapes[1:]:
            nxt = broadcast(out, s)
            if nxt is None:
                ctx.diags.error(f"shape mismatch in {e.fn}: " + " and ".join(fmt_shape(s) for s in shapes), e.span,
                                hint="the arguments must have equal shapes, or trailing dims that match",
                                code="E-shape")
                return None
            out = nxt
        return out

    _fn_clamp = _elementwise_n
    _fn_min = _elementwise_n
    _fn_max = _elementwise_n
    _fn_huber = _elementwise_n

    def _last_axis(self, e: Call, ctx: _Ctx, x: Optional[Shape]) -> bool:
        if x is not None and len(x) == 0:
            ctx.diags.error(f"{e.fn} needs a vector or matrix (it works over the last axis), got a scalar []",
                            e.args[0].span or e.span, code="E-shape")
            return False
        return x is not None

    def _norm_weights(self, e: Call, ctx: _Ctx) -> Optional[Shape]:
        shapes = [self._infer(a, ctx) for a in e.args]
        x = shapes[0]
        if not self._last_axis(e, ctx, x):
            return None
        ok = True
        for a, s in zip(e.args[1:], shapes[1:]):
            if s is None:
                ok = False
            elif s not in ((), (x[-1],)):
                ctx.diags.error(f"shape mismatch in {e.fn}: the weight has shape {fmt_shape(s)}, expected "
                                f"{fmt_shape((x[-1],))} (the last axis of {fmt_shape(x)})", a.span or e.span,
                                hint=f"declare it as a param of shape [{x[-1]}]", code="E-shape")
                ok = False
        return x if ok else None

    _fn_layernorm = _norm_weights
    _fn_rmsnorm = _norm_weights

    def axis_of(self, e: Call, x: Shape, ctx: _Ctx) -> Optional[int]:
        """The position in ``x`` of the axis named by ``e``'s second argument (a dim name that
        occurs once in ``x``), or None after a located error."""
        a = e.args[1]
        if isinstance(a, Name) and self.kinds.get(a.id) == "dim":
            hits = [i for i, d in enumerate(x) if d == a.id]
            if len(hits) == 1:
                return hits[0]
            if not hits:
                ctx.diags.error(f"{e.fn}({unparse(e.args[0])}, {a.id}): {fmt_shape(x)} has no axis {a.id}",
                                a.span or e.span, hint=f"the axes of {unparse(e.args[0])} are "
                                + (", ".join(x) if x else "none (it is a scalar)"), code="E-shape")
            else:
                ctx.diags.error(f"{e.fn}({unparse(e.args[0])}, {a.id}) is ambiguous: {fmt_shape(x)} has "
                                f"{len(hits)} axes named {a.id}", a.span or e.span,
                                hint="give the two axes their own dims (e.g. d_in and d_out of equal size)",
                                code="E-shape")
            return None
        if isinstance(a, Name) and a.id not in self.kinds and a.id not in ctx.scope:
            self._infer(a, ctx)  # unknown name, with a did-you-mean
            return None
        ctx.diags.error(f"the axis of {e.fn}(x, d) is the name of a dim, got '{unparse(a)}'", a.span or e.span,
                        hint=f"e.g. {e.fn}({unparse(e.args[0])}, {x[-1] if x else 'd_k'})" +
                             (f"; dims: {', '.join(self.spec.dims)}" if self.spec.dims else ""),
                        code="E-shape")
        return None

    def _reduction(self, e: Call, ctx: _Ctx) -> Optional[Shape]:
        x = self._infer(e.args[0], ctx)
        if len(e.args) == 1:
            return () if x is not None else None
        if x is None:
            return None
        i = self.axis_of(e, x, ctx)
        return None if i is None else tuple(x[:i]) + tuple(x[i + 1:])

    _fn_sum = _reduction
    _fn_mean = _reduction
    _fn_norm = _reduction

    def _fn_softmax(self, e: Call, ctx: _Ctx) -> Optional[Shape]:
        x = self._infer(e.args[0], ctx)
        if x is None:
            return None
        return x if self.axis_of(e, x, ctx) is not None else None

    def _fn_newton_schulz(self, e: Call, ctx: _Ctx) -> Optional[Shape]:
        x = self._infer(e.args[0], ctx)
        steps = e.args[1]
        ok = True
        if steps_value(steps, self.spec.constants) is None:
            ctx.diags.error(f"newton_schulz(X, steps) takes a number of steps (an integer from 1 to "
                            f"{MAX_NS_STEPS}) or a constant holding (a, b, c) coefficients per step, got "
                            f"'{unparse(steps)}'", steps.span or e.span,
                            hint="Muon uses 5: newton_schulz(X, 5); a schedule: constants: {ns: [[a, b, c], ...]} "
                                 "and newton_schulz(X, ns)", code="E-shape")
            ok = False
        if x is not None and len(x) != 2:
            ctx.diags.error(f"newton_schulz(X, steps) orthogonalises a matrix, got {fmt_shape(x)}",
                            e.args[0].span or e.span, hint="X is [m, n] (a state or a gradient of one)",
                            code="E-shape")
            return None
        return x if ok else None

    def _fn_l2norm(self, e: Call, ctx: _Ctx) -> Optional[Shape]:
        x = self._infer(e.args[0], ctx)
        return x if self._last_axis(e, ctx, x) else None

    def _fn_outer(self, e: Call, ctx: _Ctx) -> Optional[Shape]:
        a, b = (self._infer(x, ctx) for x in e.args)
        if a is None or b is None:
            return None
        if len(a) != 1 or len(b) != 1:
            ctx.diags.error(f"outer(a, b) needs two vectors, got {fmt_shape(a)} and {fmt_shape(b)}", e.span,
                            hint="outer: [m], [n] -> [m, n]", code="E-shape")
            return None
        return (a[0], b[0])

    def _fn_solve(self, e: Call, ctx: _Ctx) -> Optional[Shape]:
        a, b = (self._infer(x, ctx) for x in e.args[:2])   # (and cg(A, B, steps))
        if a is None or b is None:
            return None
        call = "solve(A, B)" if e.fn == "solve" else "cg(A, B, steps)"
        if len(a) != 2 or a[0] != a[1]:
            ctx.diags.error(f"{call} needs a square matrix A, got {fmt_shape(a)}", e.args[0].span or e.span,
                            hint="A is [n, n]; B is [n] or [n, m]", code="E-shape")
            return None
        if len(b) not in (1, 2) or b[0] != a[0]:
            ctx.diags.error(f"shape mismatch in {e.fn}: A is {fmt_shape(a)}, B is {fmt_shape(b)}",
                            e.args[1].span or e.span, hint=f"B must be [{a[0]}] or [{a[0]}, m]", code="E-shape")
            return None
        return b

    def _fn_cg(self, e: Call, ctx: _Ctx) -> Optional[Shape]:
        steps = e.args[2]
        ok = cg_steps(steps, self.spec.constants) is not None
        if not ok:
            ctx.diags.error(f"cg(A, B, steps) takes a number of steps, an integer from 1 to {MAX_CG_STEPS} (or a "
                            f"constant holding one), got '{unparse(steps)}'", steps.span or e.span,
                            hint="conjugate gradients runs exactly that many iterations from x = 0: MesaNet's "
                                 "kernels use 30, cg(H + lam * eye(d_k), q, 30)", code="E-shape")
        shape = self._fn_solve(e, ctx)
        return shape if ok else None

    def _fn_diag(self, e: Call, ctx: _Ctx) -> Optional[Shape]:
        d = self._diag_arg(e, ctx)
        if d is None:
            return None
        a = unparse(e.args[0])
        ctx.diags.error(f"diag({a}) is only allowed as an operand of '@'", e.span,
                        hint=f"diag({a}) @ S scales the rows of S (the papers' Diag({a}) S), S @ diag({a}) its "
                             f"columns; the diagonal matrix itself is never formed", code="E-shape")
        return None

    def _fn_eye(self, e: Call, ctx: _Ctx) -> Optional[Shape]:
        a = e.args[0]
        if isinstance(a, Name) and self.kinds.get(a.id) == "dim":
            return (a.id, a.id)
        if isinstance(a, Name) and a.id not in self.kinds and a.id not in ctx.scope:
            self._infer(a, ctx)  # unknown name, with a did-you-mean
            return None
        ctx.diags.error(f"eye(d) takes a dim name, got '{unparse(a)}'", a.span or e.span,
                        hint="write eye(d_k) for the [d_k, d_k] identity" +
                             (f"; dims: {', '.join(self.spec.dims)}" if self.spec.dims else ""),
                        code="E-shape")
        return None

    def _fn_grad(self, e: Call, ctx: _Ctx) -> Optional[Shape]:
        span = e.fn_span or e.span
        if ctx.context not in (None, "update"):
            ctx.diags.error("grad(...) is only allowed in update statements", span,
                            hint="the gradient of the inner loss drives the update; the read and the loss use the "
                                 "state itself", code="E-grad")
            return None
        first = e.args[0]
        if not (isinstance(first, Name) and first.id == "loss"):
            ctx.diags.error(f"the first argument of grad must be 'loss', got '{unparse(first)}'",
                            first.span or span, hint="declare the inner loss as `loss` and write grad(loss, W)",
                            code="E-grad")
            return None
        spec = self.spec
        if spec.loss is None:
            ctx.diags.error("grad(loss, ...) but the spec declares no loss", span,
                            hint="add a loss, e.g. `loss: 0.5 * sum((f(k) - v)^2)`", code="E-grad")
            return None
        if len(e.args) == 1:
            states = spec.model_states()
            if len(states) != 1:
                if states:
                    ctx.diags.error(f"grad(loss) is ambiguous: the model reads {len(states)} states "
                                    f"({', '.join(states)})", span,
                                    hint="name the state: " + " or ".join(f"grad(loss, {s})" for s in states),
                                    code="E-grad")
                else:
                    ctx.diags.error("grad(loss) needs a model that reads a state", span,
                                    hint="name the state: grad(loss, W)", code="E-grad")
                return None
            target = states[0]
        else:
            w = e.args[1]
            if not isinstance(w, Name):
                ctx.diags.error(f"grad(loss, W) is taken with respect to a state, got '{unparse(w)}'",
                                w.span or span, hint="the second argument is the name of a state", code="E-grad")
                return None
            kind = self.kinds.get(w.id)
            if kind is None:
                return self._infer(w, ctx)  # unknown name, with did-you-mean
            if kind != "state":
                kind = "temporary" if kind == "temp" else kind
                ctx.diags.error(f"grad(loss, {w.id}) is taken with respect to a state; '{w.id}' is a {kind}",
                                w.span or span,
                                hint=("states: " + ", ".join(spec.state)) if spec.state else "declare a state",
                                code="E-grad")
                return None
            if self.is_cache(w.id):
                ctx.diags.error(f"grad(loss, {w.id}): '{w.id}' is a cache, which is appended to, not learned",
                                w.span or span, code="E-grad")
                return None
            target = w.id
        return self.names.get(target)

    def _fn_attend(self, e: Call, ctx: _Ctx) -> Optional[Shape]:
        q, K, V, scale = e.args
        ok = True
        for arg in (K, V):
            if not (isinstance(arg, Name) and self.is_cache(arg.id)):
                if isinstance(arg, Name) and arg.id not in self.kinds and arg.id not in ctx.scope:
                    self._infer(arg, ctx)
                else:
                    caches = [n for n, s in self.spec.state.items() if s.cache]
                    ctx.diags.error(f"attend(q, K, V, scale) reads cache states; '{unparse(arg)}' is not a cache",
                                    arg.span or e.span,
                                    hint=("caches: " + ", ".join(caches)) if caches else
                                    "declare one, e.g. `K: {shape: [d_k], cache: true}`", code="E-cache")
                ok = False
        sq = self._infer(q, ctx)
        ss = self._infer(scale, ctx)
        if not ok or sq is None or ss is None:
            return None
        sk, sv = self.names[K.id], self.names[V.id]
        if sk is None or sv is None:
            return None
        if len(sq) != 1 or sq[0] != sk[-1]:
            ctx.diags.error(f"shape mismatch in attend: the query is {fmt_shape(sq)}, the keys are {fmt_shape(sk)}",
                            q.span or e.span, hint=f"the query must be [{sk[-1]}]", code="E-shape")
            return None
        if ss != ():
            ctx.diags.error(f"attend: the scale must be a scalar, got {fmt_shape(ss)}", scale.span or e.span,
                            hint="e.g. d_k^(-0.5)", code="E-shape")
            return None
        return tuple(sv[1:])

    def _fn_append(self, e: Call, ctx: _Ctx) -> Optional[Shape]:
        K, k = e.args
        if not (isinstance(K, Name) and self.is_cache(K.id)):
            if isinstance(K, Name) and K.id not in self.kinds and K.id not in ctx.scope:
                self._infer(K, ctx)
            else:
                ctx.diags.error(f"append(K, k) pushes onto a cache state; '{unparse(K)}' is not a cache",
                                K.span or e.span, hint="declare the state with `cache: true`", code="E-cache")
            self._infer(k, ctx)
            return None
        sK = self.names[K.id]
        sk = self._infer(k, ctx)
        if sk is None or sK is None:
            return None
        if tuple(sk) != tuple(sK[1:]):
            ctx.diags.error(f"shape mismatch in append: cache '{K.id}' holds {fmt_shape(sK[1:])}, got {fmt_shape(sk)}",
                            k.span or e.span, code="E-shape")
            return None
        return sK

    def _apply_model(self, e: Call, ctx: _Ctx) -> Optional[Shape]:
        m = self.spec.model
        span = e.fn_span or e.span
        if len(e.args) != 1:
            ctx.diags.error(f"the model {m.name} takes 1 argument, got {len(e.args)}", e.span,
                            hint=f"the model is {m}", code="E-arity")
            for a in e.args:
                self._infer(a, ctx)
            return None
        if m.name in ctx.model_stack or ctx.context == "model":
            ctx.diags.error(f"the model {m.name} cannot call itself", span, code="E-cycle")
            return None
        if ctx.context == "let":
            ctx.diags.error(f"a let cannot apply the model {m.name}: lets are computed before the update",
                            span, hint="apply the model in the loss or the read", code="E-order")
            self._infer(e.args[0], ctx)
            return None
        if ctx.context == "gate":
            self._infer(e.args[0], ctx)
            return None  # reported by the checks (a gate uses only logit, constants, dims, params)
        a = self._infer(e.args[0], ctx)
        if a is None:
            return None
        rows = len(a) >= 2 and a[0] == self.cache_axis   # f(K) over a cache [n, d]: f of each row
        if rows:
            a = tuple(a[1:])
        sub = Collector()
        outer = {k: v for k, v in ctx.scope.items() if self.kinds.get(k) != "temp"}
        inner = _Ctx("model", {**outer, m.arg: a}, sub, None,
                     ctx.model_stack + (m.name,))
        out = self._infer(m.body, inner)
        if rows and out is not None:
            out = (self.cache_axis,) + tuple(out)
        for d in sub.items:
            if d.code == "E-shape":
                ctx.diags.error(f"applying {m.name} to {unparse(e.args[0])} {fmt_shape(a)}: {d.message}", e.span,
                                hint=f"the model is {m}; the error is at {_where(d.span)}", code="E-shape")
            else:
                ctx.diags.items.append(d)
        return out if not sub.errors else None



_FUNCTION_HINTS = {
    "msign": "the matrix sign (Muon's orthogonalisation) is newton_schulz(X, 5)",
    "muon": "Muon's orthogonalisation of an update is newton_schulz(X, 5)",
    "orthogonalize": "write newton_schulz(X, 5)",
    "logsumexp": "write log(sum(exp(x), d))",
    "transpose": "write A.T",
    "matmul": "write a @ b",
    "dot": "write a @ b for vectors",
    "pow": "write a^b",
    "square": "write x^2",
    "inv": "write solve(A, B) for A^-1 B",
    "inverse": "write solve(A, B) for A^-1 B",
    "conjugate_gradients": "write cg(A, B, steps)",
    "normalize": "l2norm(x) normalises over the last axis",
}



def _where(span: Span | None) -> str:
    return f"{span.file}:{span.line}:{span.col}" if span else "?"


def _fn_examples() -> str:
    return "sum, mean, sqrt, exp, sigmoid, layernorm, outer, grad, attend, ... (see docs/language.md)"
