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

Two modules: this one holds the environment (the names of a spec and their shapes) and the
rules of names, operators, ``.T`` and ``diag(a) @ X``; :mod:`.shape_rules` holds the shape
vocabulary re-exported here (:data:`Shape`, :data:`CACHE_AXIS`, :func:`fmt_shape`,
:func:`broadcast`, :func:`matmul_shape`, :func:`steps_value`) and the rules of calls
(``_call``, ``_fn_*``, model application) as :class:`~memspec.lang.shape_rules.FunctionRules`,
a mixin of :class:`ShapeEnv`: all rules share one context and one list of diagnostics.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .errors import Collector, SpecError, did_you_mean
from .expr import FUNCTIONS, BinOp, Call, Expr, Name, Neg, Num, Transpose, is_diag, unparse
from .shape_rules import (CACHE_AXIS, FunctionRules, Shape, _Ctx, broadcast, fmt_shape, matmul_shape,
                          steps_value)


@dataclass
class ShapeEnv(FunctionRules):
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


__all__ = ["CACHE_AXIS", "Shape", "ShapeEnv", "broadcast", "fmt_shape", "let_order", "matmul_shape",
           "steps_value"]
