"""Shape inference in named dims.

A shape is a tuple of dim names, without the batch and head axes: ``()`` is a scalar,
``("d_k",)`` a vector of width ``d_k``, ``("d_k", "d_v")`` a matrix.  A cache state
declared ``[d_k]`` holds a growing list of vectors; its runtime shape is
``(CACHE_AXIS, "d_k")`` (printed ``[n, d_k]``), where the leading axis is the cache
length.

Usage (the compiler writes shape comments this way)::

    env = ShapeEnv.from_spec(spec)
    env.infer(parse_expr("outer(k, v)"))      # -> ("d_k", "d_v")
    env.infer(spec.read)                       # -> ("d_v",)
    env.of("W")                                # shape of a declared name

``infer`` raises :class:`~memspec.errors.SpecError` with located diagnostics on a bad
expression, or, when given a :class:`~memspec.errors.Collector`, records them there
and returns ``None`` for the parts it could not type.  The rules are those of
``docs/language.md``: numpy trailing broadcasting on named dims for elementwise
operators, the ``@`` table (row-vector convention), ``.T`` on rank 2 only, reductions
to ``()``, ``grad(loss, W)`` -> shape of ``W``, ``attend``/``append`` over caches,
``eye(d)`` with a dim name, ``softmax(x, d)`` and ``sum``/``mean``/``norm(x, d)`` over the
axis named ``d``, ``newton_schulz(X, steps)`` on a matrix, and model application ``f(x)``
typed by substituting the argument's shape into the model body (``f(K)`` of a cache
``[n, d]`` applies the model to each row: ``[n, *out]``).

Context-dependent names: ``logit`` exists only in gate formulas, the model's
argument only inside the model, ``loss`` only as the first argument of ``grad``.
Pass ``context`` ("gate", "let", "model", "loss", "update", "read") to get the
rules of that place (``grad`` only in updates, ``logit`` only in gates); the default
``None`` is permissive and is what code generators want.

Size: the shape rule of every construct in one class (``_fn_*``), with its located
errors; the rules share the context and the diagnostics, and read as one table.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .errors import Collector, Span, SpecError, did_you_mean
from .limits import MAX_NS_STEPS
from .expr import FUNCTIONS, ELEMENTWISE_FUNCTIONS, BinOp, Call, Expr, Name, Neg, Num, Transpose, is_diag, unparse

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


@dataclass
class ShapeEnv:
    """The shapes of every name of a spec, and inference for its expressions."""

    spec: object
    names: dict = field(default_factory=dict)       # name -> Shape | None (None: could not infer)
    kinds: dict = field(default_factory=dict)       # name -> "dim" | "constant" | "view" | ...
    diagnostics: list = field(default_factory=list)  # problems found while typing the lets
    cache_axis: str = CACHE_AXIS
    temps: dict = field(default_factory=dict)       # temporary -> index of its (first) update statement

    # ------------------------------------------------------------ building
    @classmethod
    def from_spec(cls, spec) -> "ShapeEnv":
        """Shapes of dims (``()``), constants (``()``), views (``(dim,)``), gates (``()`` or their shape),
        params and states (their declared shapes; caches get a leading
        :data:`CACHE_AXIS`), and lets (inferred in dependency order; a let in a cycle
        or with a bad expression gets ``None`` and a diagnostic in ``diagnostics``)."""
        env = cls(spec=spec)
        axis = CACHE_AXIS if CACHE_AXIS not in spec.dims else CACHE_AXIS + "_cache"
        env.cache_axis = axis
        for n in spec.dims:
            env._declare(n, (), "dim")
        for n in spec.constants:
            env._declare(n, (), "constant")
        for n, v in spec.views.items():
            env._declare(n, (v.dim,), "view")
        for n, g in spec.gates.items():
            env._declare(n, tuple(g.shape), "gate")
        for n, p in spec.params.items():
            env._declare(n, tuple(p.shape), "param")
        for n, s in spec.state.items():
            env._declare(n, ((axis,) if s.cache else ()) + tuple(s.shape), "state")
        for n in spec.let:
            env._declare(n, None, "let")
        if spec.model is not None:
            env.kinds.setdefault(spec.model.name, "model")
        # update targets that are no declared name are per-token temporaries
        not_temp = {"loss", "logit"} | ({spec.model.name, spec.model.arg} if spec.model is not None else set())
        for i, st in enumerate(spec.update):
            t = st.target
            if t not in env.kinds and t not in env.temps and t not in not_temp:
                env.temps[t] = i
        for t in env.temps:
            env.kinds[t] = "temp"
            env.names[t] = None
        env._infer_lets()
        env._infer_temps()
        return env

    def _declare(self, name: str, shape, kind: str) -> None:
        # the first declaration wins; duplicates are reported by the checks.  A shape
        # naming an undeclared dim is unknown (reported once, by the checks).
        if shape is not None and any(d not in self.spec.dims and d != self.cache_axis for d in shape):
            shape = None
        if name not in self.kinds:
            self.names[name] = shape
            self.kinds[name] = kind

    def _infer_lets(self) -> None:
        spec = self.spec
        order = let_order(spec.let)
        diags = Collector()
        for n in order:
            if self.kinds.get(n) != "let":
                continue
            self.names[n] = self.infer(spec.let[n], context="let", diags=diags)
        self.diagnostics = diags.items

    def _infer_temps(self) -> None:
        """Shapes of the temporaries, each typed with the temporaries assigned before it."""
        scope: dict = {}
        for i, st in enumerate(self.spec.update):
            if self.temps.get(st.target) == i:
                scope[st.target] = self.infer(st.value, context="update", scope=scope, diags=Collector())
                self.names[st.target] = scope[st.target]

    def temp_scope(self, index: int) -> dict:
        """The temporaries visible to update statement ``index`` (name -> shape)."""
        return {t: self.names[t] for t, i in self.temps.items() if i < index}

    # ------------------------------------------------------------ queries
    def of(self, name: str) -> Optional[Shape]:
        """The shape of a declared name (``KeyError`` if not declared)."""
        return self.names[name]

    def kind(self, name: str) -> Optional[str]:
        return self.kinds.get(name)

    def is_cache(self, name: str) -> bool:
        st = self.spec.state.get(name)
        return self.kinds.get(name) == "state" and st is not None and st.cache

    @property
    def model(self):
        return self.spec.model

    def gate_scope(self, name: str) -> dict:
        """The names a gate formula sees besides the spec's: ``logit``, with the gate's shape."""
        shape = self.names.get(name)
        return {"logit": shape if shape is not None else ()}

    def loss_shape(self, diags: Collector | None = None) -> Optional[Shape]:
        """The shape of the loss expression (should be ``()``)."""
        if self.spec.loss is None:
            return None
        return self.infer(self.spec.loss, context="loss", diags=diags if diags is not None else Collector())

    def model_output(self, arg_shape: Shape, diags: Collector | None = None) -> Optional[Shape]:
        """The model's output shape for an input of ``arg_shape``."""
        m = self.spec.model
        if m is None:
            return None
        return self.infer(m.body, context="model", scope={m.arg: arg_shape},
                          diags=diags if diags is not None else Collector())

    def infer(self, expr: Expr, *, context: Optional[str] = None, scope: dict | None = None,
              diags: Collector | None = None, record: dict | None = None) -> Optional[Shape]:
        """The shape of ``expr``.

        ``scope`` adds names (e.g. ``{"logit": ()}`` or the model argument);
        ``record``, when given, receives ``id(node) -> shape`` for every sub-expression.
        Without ``diags`` a problem raises :class:`SpecError`; with it, problems are
        collected and ``None`` stands for an unknown shape.
        """
        own = diags is None
        col = Collector() if own else diags
        scope = dict(scope or {})
        if context == "gate":
            scope.setdefault("logit", ())
        ctx = _Ctx(context, scope, col, record)
        shape = self._infer(expr, ctx)
        if own and col.errors:
            raise SpecError(col.items)
        return shape

    # ------------------------------------------------------------ inference
    def _note(self, e: Expr, shape, ctx: _Ctx):
        if ctx.record is not None:
            ctx.record[id(e)] = shape
        return shape

    def _infer(self, e: Expr, ctx: _Ctx) -> Optional[Shape]:
        if isinstance(e, Num):
            return self._note(e, (), ctx)
        if isinstance(e, Name):
            return self._note(e, self._name(e, ctx), ctx)
        if isinstance(e, Neg):
            return self._note(e, self._infer(e.operand, ctx), ctx)
        if isinstance(e, Transpose):
            return self._note(e, self._transpose(e, ctx), ctx)
        if isinstance(e, BinOp):
            return self._note(e, self._binop(e, ctx), ctx)
        if isinstance(e, Call):
            return self._note(e, self._call(e, ctx), ctx)
        ctx.diags.error(f"not an expression: {e!r}", getattr(e, "span", None), code="E-expr")
        return None

    def _name(self, e: Name, ctx: _Ctx) -> Optional[Shape]:
        n = e.id
        if n in ctx.scope:
            return ctx.scope[n]
        if self.kinds.get(n) == "temp" and ctx.context is not None:
            self._temp_out_of_scope(e, ctx)
            return None
        if n in self.names:
            if isinstance(self.spec.constants.get(n), tuple) and self.kinds.get(n) == "constant":
                ctx.diags.error(f"the constant '{n}' is a Newton-Schulz coefficient schedule, not a number", e.span,
                                hint=f"only newton_schulz(X, {n}) takes it", code="E-shape")
                return None
            return self.names[n]
        if self.kinds.get(n) == "model":
            ctx.diags.error(f"the model '{n}' is a function; apply it to an input", e.span,
                            hint=f"write {n}(q) or {n}(k)", code="E-unknown-name")
            return None
        if n == "logit":
            ctx.diags.error("'logit' is only defined inside gate formulas", e.span,
                            hint="logit = x·w + bias is the input of a gate formula", code="E-unknown-name")
            return None
        if n == "loss":
            ctx.diags.error("'loss' can only be used as grad(loss, W)", e.span,
                            hint="the loss is a scalar of the inner model; its gradient drives the update",
                            code="E-unknown-name")
            return None
        m = self.spec.model
        if m is not None and n == m.arg:
            ctx.diags.error(f"'{n}' is the model's argument and only exists inside the model", e.span,
                            hint=f"apply the model instead, e.g. {m.name}(k)", code="E-unknown-name")
            return None
        if n in FUNCTIONS:
            ctx.diags.error(f"'{n}' is a function; call it with arguments", e.span,
                            hint=f"{n}: {FUNCTIONS[n][2]}", code="E-unknown-name")
            return None
        cands = [c for c in list(self.names) + list(ctx.scope) if _plain(c)]
        ctx.diags.error(f"unknown name '{n}'", e.span, hint=did_you_mean(n, cands),
                        code="E-unknown-name")
        return None

    _PLACES = {"gate": "a gate formula", "let": "a let", "model": "the model", "loss": "the loss",
               "read": "the read"}

    def _temp_out_of_scope(self, e: Name, ctx: _Ctx) -> None:
        n = e.id
        st = self.spec.update[self.temps[n]]
        tsp = st.target_span or st.span
        if ctx.context != "update":
            where = self._PLACES.get(ctx.context, "this expression")
            ctx.diags.error(f"'{n}' is a temporary of the update program; it is not visible in {where}", e.span,
                            hint="a temporary is visible only to later update statements of the same token; "
                                 "write the expression here, or declare a state", code="E-temp-scope")
            return
        inside = (tsp is not None and e.span is not None and st.span is not None and e.span.line == st.span.line
                  and e.span.file == st.span.file and e.span.col > tsp.col)
        if inside:
            states = [s for s in self.spec.state if _plain(s)]
            ctx.diags.error(f"'{n}' is not a state: this statement binds the temporary '{n}', which has no value "
                            "before it", e.span,
                            hint=did_you_mean(n, states) or "to carry a value from token to token, declare it "
                                                            "under state", code="E-temp-later")
            return
        line = f" at line {tsp.line}" if tsp is not None else ""
        ctx.diags.error(f"the temporary '{n}' is only available later: it is assigned{line}", e.span,
                        hint=f"update statements run in order; move `{n} = ...` above its first use",
                        code="E-temp-later")

    def _transpose(self, e: Transpose, ctx: _Ctx) -> Optional[Shape]:
        s = self._infer(e.operand, ctx)
        if s is None:
            return None
        if len(s) != 2:
            hint = ("write outer(a, b) for the outer product aᵀb of two vectors" if len(s) == 1
                    else "transpose a matrix [m, n]")
            ctx.diags.error(f"'.T' needs a matrix (rank 2), got {fmt_shape(s)}", e.span, hint=hint, code="E-shape")
            return None
        return (s[1], s[0])

    def _binop(self, e: BinOp, ctx: _Ctx) -> Optional[Shape]:
        if e.op == "@" and (is_diag(e.left) or is_diag(e.right)):
            return self._diag_matmul(e, ctx)
        a = self._infer(e.left, ctx)
        b = self._infer(e.right, ctx)
        if a is None or b is None:
            return None
        if e.op == "@":
            if len(a) == 0 or len(b) == 0:
                ctx.diags.error(f"shape mismatch in '@': {fmt_shape(a)} @ {fmt_shape(b)}", e.span,
                                hint="'@' multiplies vectors and matrices; scale by a scalar with '*'",
                                code="E-shape")
                return None
            out = matmul_shape(a, b)
            if out is None:
                if len(a) > 2 or len(b) > 2:
                    hint = "'@' takes vectors [n] and matrices [m, n] only"
                elif len(a) == 1 and len(b) == 1:
                    hint = "a vector product [n] @ [n] needs equal dims; write outer(a, b) for [m] x [n] -> [m, n]"
                else:
                    hint = f"the inner dims must agree: {a[-1]} vs {b[0]}"
                    if len(b) == 2 and b[1] == a[-1]:
                        hint += " (transpose the right side with .T?)"
                ctx.diags.error(f"shape mismatch in '@': {fmt_shape(a)} @ {fmt_shape(b)}", e.span,
                                hint=hint, code="E-shape")
            return out
        out = broadcast(a, b)
        if out is None:
            ctx.diags.error(f"shape mismatch in '{e.op}': {fmt_shape(a)} and {fmt_shape(b)}", e.span,
                            hint=_row_scaling_hint(e, a, b) or
                            "elementwise operators need equal shapes, or trailing dims that match"
                            " (a scalar broadcasts to anything)",
                            code="E-shape")
        return out

    def _diag_matmul(self, e: BinOp, ctx: _Ctx) -> Optional[Shape]:
        """``diag(a) @ X`` (scales the rows of X by a) and ``X @ diag(b)`` (its columns): the
        diagonal matrix is never formed, so ``diag`` is only an operand of ``@``."""
        if is_diag(e.left) and is_diag(e.right):
            for side in (e.left, e.right):
                self._diag_arg(side, ctx)
            ctx.diags.error("diag(a) @ diag(b) multiplies two diagonal matrices", e.span,
                            hint=f"write diag({unparse(e.left.args[0])} * {unparse(e.right.args[0])}) @ X "
                                 "to scale by both", code="E-shape")
            return None
        left = is_diag(e.left)
        d = self._diag_arg(e.left if left else e.right, ctx)
        x = self._infer(e.right if left else e.left, ctx)
        if d is None or x is None:
            return None
        if len(x) not in (1, 2):
            ctx.diags.error(f"shape mismatch in '@': diag({fmt_shape(d)}) @ {fmt_shape(x)}" if left else
                            f"shape mismatch in '@': {fmt_shape(x)} @ diag({fmt_shape(d)})", e.span,
                            hint="diag(a) scales a vector or a matrix", code="E-shape")
            return None
        axis = x[0] if left else x[-1]
        if axis != d[0]:
            which = "rows" if left else "columns"
            hint = f"a diag([{d[0]}]) scales the {which} of a {fmt_shape(x)} value, which has {axis} {which}"
            if len(x) == 2 and (x[-1] if left else x[0]) == d[0]:
                hint += (f"; to scale its columns write {unparse(e.right)} @ diag({unparse(e.left.args[0])})" if left
                         else f"; to scale its rows write diag({unparse(e.right.args[0])}) @ {unparse(e.left)}")
            ctx.diags.error(f"shape mismatch in '@': diag({fmt_shape(d)}) @ {fmt_shape(x)}" if left else
                            f"shape mismatch in '@': {fmt_shape(x)} @ diag({fmt_shape(d)})", e.span, hint=hint,
                            code="E-shape")
            return None
        if ctx.record is not None:
            self._note(e.left if left else e.right, (d[0], d[0]), ctx)
        return x

    def _diag_arg(self, e: Call, ctx: _Ctx) -> Optional[Shape]:
        if len(e.args) != 1:
            ctx.diags.error(f"diag takes 1 argument, got {len(e.args)}", e.span,
                            hint="diag(a): " + FUNCTIONS["diag"][2], code="E-arity")
            for a in e.args:
                self._infer(a, ctx)
            return None
        d = self._infer(e.args[0], ctx)
        if d is not None and len(d) != 1:
            ctx.diags.error(f"diag(a) needs a vector, got {fmt_shape(d)}", e.args[0].span or e.span,
                            hint="diag(a) of a vector [n] is the diagonal [n, n] matrix", code="E-shape")
            return None
        return d

    # ------------------------------------------------------------ calls
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
                cands = list(FUNCTIONS) + ([m.name] if m is not None else [])
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
        a, b = (self._infer(x, ctx) for x in e.args)
        if a is None or b is None:
            return None
        if len(a) != 2 or a[0] != a[1]:
            ctx.diags.error(f"solve(A, B) needs a square matrix A, got {fmt_shape(a)}", e.args[0].span or e.span,
                            hint="A is [n, n]; B is [n] or [n, m]", code="E-shape")
            return None
        if len(b) not in (1, 2) or b[0] != a[0]:
            ctx.diags.error(f"shape mismatch in solve: A is {fmt_shape(a)}, B is {fmt_shape(b)}",
                            e.args[1].span or e.span, hint=f"B must be [{a[0]}] or [{a[0]}, m]", code="E-shape")
            return None
        return b

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
    "normalize": "l2norm(x) normalises over the last axis",
}


def _row_scaling_hint(e: BinOp, a: Shape, b: Shape) -> Optional[str]:
    """For ``g * S`` with ``g [n]`` and ``S [n, m]``: how to scale the rows instead."""
    if e.op not in "*/":
        return None
    for vec, mat, v_e, m_e in ((a, b, e.left, e.right), (b, a, e.right, e.left)):
        if len(vec) == 1 and len(mat) == 2 and vec[0] == mat[0] and vec[0] != mat[1]:
            g, S = unparse(v_e), unparse(m_e)
            if _prec_needs_parens(m_e):
                S = f"({S})"
            if e.op == "/":
                g = f"1 / {g}" if isinstance(v_e, (Name, Num, Call)) else f"1 / ({g})"
            return (f"'{e.op}' broadcasts on the trailing axis ({mat[1]}); to scale the rows ({vec[0]}) of {S} by "
                    f"{unparse(v_e)}, write diag({g}) @ {S} (the papers' Diag({unparse(v_e)}) {S})")
    return None


def _prec_needs_parens(e: Expr) -> bool:
    return isinstance(e, (BinOp, Neg)) and not (isinstance(e, BinOp) and e.op == "@")


def _plain(name: str) -> bool:
    """Only plain identifiers are offered as did-you-mean suggestions."""
    return isinstance(name, str) and name.isidentifier() and not name.startswith("_")


def _where(span: Span | None) -> str:
    return f"{span.file}:{span.line}:{span.col}" if span else "?"


def _fn_examples() -> str:
    return "sum, mean, sqrt, exp, sigmoid, layernorm, outer, grad, attend, ... (see docs/language.md)"


def let_order(lets: dict) -> list:
    """Lets in dependency order (each after the lets it uses); lets in a cycle are left out.

    A depth-first walk written with an explicit stack (a chain of thousands of lets must not
    exhaust Python's recursion): the order is the recursive walk's, dependencies visited in
    the order they occur, a let that reaches a cycle left out with the cycle."""
    deps = {n: [x.id for x in e.walk() if isinstance(x, Name) and x.id in lets] for n, e in lets.items()}
    done: list = []
    state: dict = {}
    for root in lets:
        if state.get(root) in ("done", "busy", "cycle"):
            continue
        state[root] = "busy"
        stack = [(root, iter(deps[root]))]
        while stack:
            n, it = stack[-1]
            failed = state[n] == "cycle"
            child = None
            if not failed:
                for d in it:
                    st = state.get(d)
                    if st == "done":
                        continue
                    if st in ("busy", "cycle"):
                        failed = True
                        break
                    child = d
                    break
            if failed:
                state[n] = "cycle"
                stack.pop()
                if stack:
                    state[stack[-1][0]] = "cycle"   # all(...) stops at the first failed dependency
                continue
            if child is not None:
                state[child] = "busy"
                stack.append((child, iter(deps[child])))
                continue
            state[n] = "done"
            done.append(n)
            stack.pop()
    return done


__all__ = ["CACHE_AXIS", "Shape", "ShapeEnv", "broadcast", "fmt_shape", "let_order", "matmul_shape"]
