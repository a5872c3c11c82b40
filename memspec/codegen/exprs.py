"""Expressions -> torch code: :class:`ExprEmitter` turns one expression AST into a line of torch.

Layout of emitted tensors: every tensor in generated code has leading *prefix* axes
followed by its named trailing shape (the shape written in the spec):

* one token:            ``[B, H, *shape]``     (views ``[B, H, d]``, gates ``[B, H]``)
* all tokens at once:   ``[B, T, H, *shape]``  (views ``[B, T, H, d]``, gates ``[B, T, H]``)
* per-token states of a chunk: ``[B, C, H, *shape]``

The heads axis is always the *last* prefix axis, so learned per-head params
``[H, *shape]`` broadcast against any prefix.  Every rule of the emitter acts on the
trailing named axes only (negative dims, ``unsqueeze(-r-1)``), so the same code is correct
for every prefix: that is what makes token-local expressions vectorisable over time for
free.  Usage::

    em = ExprEmitter(spec)                       # names: locals, self.<param>, self.<dim>
    em.emit(parse_expr("l2norm(k)"))             # 'l2norm(k)'  (a helper in the module)
    em.emit(parse_expr("eta * outer(k, v)"))     # 'eta[..., None, None] * (k.unsqueeze(-1) * v.unsqueeze(-2))'
    em.shape(parse_expr("outer(k, v)"))          # ('d_k', 'd_v')
    em.helpers                                   # {'l2norm'}: module-level helpers the code calls
    ExprEmitter(spec, names={"W": "W_seq"})      # write a spec name as another local

**Rows** (``rows=True``): the tokens of a chunk that share one held state, head-major.  Every
token-local value (views, gates, lets, temporaries) is ``[B, H, C, *shape]``: its rows are the
chunk's tokens; states, params and numbers have no row axis (``[B, H, *shape]``, ``[H, *shape]``).
A vector times a held matrix is then one product of the rows, ``x @ W`` (``[B, H, C, d] @
[B, H, d, h]``), never a per-token broadcast of the weights; a held value meeting a row value in
any other operation gains the row axis (``.unsqueeze(-r - 1)``); the model is applied inline.

``helpers`` collects the names of the :mod:`memspec.runtime.helpers` functions that
emitted code calls (``layernorm``, ``rmsnorm``, ``l2norm``, ``huber``, ``attend``,
``append``); they are named after the language's functions, which a spec can never use
as identifiers, so they never collide.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..lang.expr import BinOp, Call, Expr, Name, Neg, Num, Transpose, is_diag, substitute, unparse
from ..lang.shape_rules import cg_steps
from ..lang.shapes import ShapeEnv, steps_value
from .text import inert

# Python precedence levels of emitted code (higher binds tighter).
P_ADD, P_MUL, P_NEG, P_POW, P_ATOM = 1, 2, 3, 4, 9

_TORCH_ELEMENTWISE = {
    "sqrt": "torch.sqrt", "exp": "torch.exp", "log": "torch.log", "abs": "torch.abs",
    "sign": "torch.sign", "sigmoid": "torch.sigmoid", "softplus": "F.softplus",
    "tanh": "torch.tanh", "relu": "torch.relu", "gelu": "F.gelu", "silu": "F.silu", "elu": "F.elu",
}
DERIVATIVE_HELPERS = ("_layernorm_grad", "_rmsnorm_grad", "_l2norm_grad", "_gelu_backward", "_silu_backward")
_MATH_ELEMENTWISE = {"sqrt": "math.sqrt", "exp": "math.exp", "log": "math.log", "abs": "abs", "tanh": "math.tanh"}


class CodegenError(ValueError):
    """An expression the generator cannot emit (the checks should have caught it)."""


@dataclass
class Code:
    text: str
    prec: int = P_ATOM
    rank: int = 0            # rank of the named (trailing) shape
    number: bool = False     # a plain Python number (dims, constants, literals)
    row: bool = False        # rows mode: has the row axis before its named shape

    def at(self, prec: int) -> str:
        """The text, parenthesised if it binds looser than ``prec``."""
        return self.text if self.prec >= prec else f"({self.text})"


@dataclass
class ExprEmitter:
    """Emits torch code for memspec expressions (see the module docstring).

    Args:
        spec: the spec whose names the expressions use.
        names: spec name -> code for it (overrides the defaults: views, gates,
            lets and states are locals of the same name; params ``self.<param>``;
            dims ``self.<dim>``; constants their literal value).
        grads: ``unparse(call)`` of a call -> code of its value, computed by the caller
            (every ``grad(...)``; also e.g. ``attend(...)`` over a whole sequence).
        model: format string of a model application with ``{u}`` the input and
            ``{states}`` the model's states, e.g. ``"self.f({u}, {states})"``.
        like: code of a tensor in scope whose dtype and device ``eye(d)`` uses.
        self_name: how the generated code refers to the module (``self``).
        rows: token-local values carry a row axis after the heads (see the module docstring).
    """

    spec: object
    names: dict = field(default_factory=dict)
    grads: dict = field(default_factory=dict)
    model: Optional[str] = None
    like: Optional[str] = None
    self_name: str = "self"
    attr: dict = field(default_factory=dict)
    helpers: set = field(default_factory=set)
    scope: dict = field(default_factory=dict)     # extra name -> shape (e.g. the model argument)
    rows: bool = False

    def __post_init__(self):
        self.env = ShapeEnv.from_spec(self.spec)

    # ------------------------------------------------------------ shapes
    def shape(self, e: Expr) -> tuple:
        """The named shape of ``e`` (tuple of dim names; ``()`` for a scalar)."""
        s = self.env.infer(e, scope=self.scope)
        if s is None:
            raise CodegenError(f"cannot infer the shape of `{unparse(e)}`")
        return tuple(s)

    def with_scope(self, **shapes) -> "ExprEmitter":
        """A copy that knows extra local names (e.g. the model argument) with shapes."""
        new = ExprEmitter(self.spec, dict(self.names), dict(self.grads), self.model, self.like,
                          self.self_name, self.attr, self.helpers, {**self.scope, **shapes}, self.rows)
        return new

    # ------------------------------------------------------------ public
    def emit(self, e: Expr) -> str:
        """Torch code for ``e`` (a Python expression string)."""
        return self._emit(e).text

    # ------------------------------------------------------------ names
    def _name(self, e: Name) -> Code:
        n = e.id
        spec = self.spec
        rank = len(self.shape(e))
        row = self.rows and n not in spec.state and n not in spec.params   # rows mode: token-local
        if n in self.names:
            is_num = n in spec.dims or n in spec.constants
            return Code(self.names[n], P_ATOM, rank, number=is_num, row=row and not is_num)
        if n in self.scope:
            return Code(n, P_ATOM, rank, row=row)
        if n in spec.dims:
            return Code(f"{self.self_name}.{self.attr.get(n, n)}", P_ATOM, 0, number=True)
        if n in spec.constants:
            return self._num(spec.constants[n])
        if n in spec.params:
            return Code(f"{self.self_name}.{self.attr.get(n, n)}", P_ATOM, rank)
        return Code(n, P_ATOM, rank, row=row)

    @staticmethod
    def _num(v) -> Code:
        text = inert(v)   # a literal: repr, or float("inf") / float("nan") (never a bare inf)
        neg = text.startswith("-")
        return Code(text, P_NEG if neg else P_ATOM, 0, number=True)

    # ------------------------------------------------------------ walk
    def _emit(self, e: Expr) -> Code:
        if isinstance(e, Num):
            return self._num(e.value)
        if isinstance(e, Name):
            return self._name(e)
        if isinstance(e, Neg):
            x = self._emit(e.operand)
            return Code(f"-{x.at(P_NEG)}", P_NEG, x.rank, x.number, x.row)
        if isinstance(e, Transpose) and isinstance(e.operand, Call) and e.operand.fn == "l2norm" \
                and isinstance(e.operand.args[0], Transpose):   # l2norm(x.T).T: x's columns, no transposes
            x = self._emit(e.operand.args[0].operand)
            self.helpers.add("_l2norm_columns")
            return Code(f"_l2norm_columns({x.text})", P_ATOM, x.rank, row=x.row)
        if isinstance(e, Transpose):
            x = self._emit(e.operand)
            return Code(f"{x.at(P_ATOM)}.transpose(-2, -1)", P_ATOM, x.rank, row=x.row)
        if isinstance(e, BinOp):
            return self._binop(e)
        if isinstance(e, Call):
            return self._call(e)
        raise CodegenError(f"not an expression: {e!r}")

    @staticmethod
    def _lift(x: Code, rank: int) -> str:
        """``x`` (rank r) with singleton axes inserted after the prefix to reach ``rank``."""
        if x.number or x.rank >= rank:
            return x.at(P_ATOM) if not x.number else x.text
        k = rank - x.rank
        if x.rank == 0:
            return f"{x.at(P_ATOM)}[..., {', '.join(['None'] * k)}]"
        return x.at(P_ATOM) + f".unsqueeze({-x.rank - 1})" * k

    @staticmethod
    def _rowed(xs: list[Code]) -> list[Code]:
        """Rows mode: when one of ``xs`` has the row axis, the held tensors among them gain it."""
        if not any(x.row for x in xs):
            return xs
        return [x if x.row or x.number else Code(f"{x.at(P_ATOM)}.unsqueeze({-x.rank - 1})", P_ATOM, x.rank, row=True)
                for x in xs]

    def _aligned(self, xs: list[Code]) -> tuple[list[str], int]:
        """Texts of ``xs`` lifted to a common rank (numpy trailing broadcasting)."""
        rank = max(x.rank for x in xs)
        out = []
        for x in xs:
            out.append(self._lift(x, rank) if x.rank < rank and not x.number else None)
        return out, rank

    def _binop(self, e: BinOp) -> Code:
        if e.op == "@" and (is_diag(e.left) or is_diag(e.right)):
            return self._diag_matmul(e)
        if e.op == "@" and isinstance(e.right, Call) and e.right.fn == "solve" \
                and len(self.shape(e.left)) == 1 and len(self.shape(e.right.args[1])) == 2:
            # v @ solve(A, B) = (v A^-1) @ B: one right-hand side (a row) instead of B's columns
            v, A, B = self._rowed([self._emit(e.left), self._emit(e.right.args[0]), self._emit(e.right.args[1])])
            return Code(f"(torch.linalg.solve({A.text}, {v.at(P_ATOM)}.unsqueeze(-2), left=False) @ {B.at(P_MUL + 1)})"
                        f".squeeze(-2)", P_ATOM, 1, row=v.row)
        if e.op == "*" and (renorm := self._renorm_columns(e)) is not None:
            return renorm
        a, b = self._emit(e.left), self._emit(e.right)
        if e.op == "@":
            return self._matmul(a, b, e)
        a, b = self._rowed([a, b])
        number = a.number and b.number
        (la, lb), rank = self._aligned([a, b])
        prec = {"+": P_ADD, "-": P_ADD, "*": P_MUL, "/": P_MUL, "^": P_POW}[e.op]
        op = "**" if e.op == "^" else e.op
        if e.op == "^":
            left = la if la is not None else a.at(P_POW + 1)
            right = lb if lb is not None else b.at(P_NEG)
        else:
            left = la if la is not None else a.at(prec)
            right = lb if lb is not None else b.at(prec + 1)
        return Code(f"{left} {op} {right}", prec, rank, number, a.row or b.row)

    def renorm_operands(self, e: Expr) -> Optional[tuple]:
        """(X, Y) when ``e`` is ``l2norm(X.T).T * norm(Y, axis)`` (either order; Y shaped as the
        matrix X, the norm over its first axis: weight normalisation), else None."""
        if not (isinstance(e, BinOp) and e.op == "*"):
            return None
        for cols, norm in ((e.left, e.right), (e.right, e.left)):
            if not (isinstance(cols, Transpose) and isinstance(cols.operand, Call) and cols.operand.fn == "l2norm"
                    and isinstance(cols.operand.args[0], Transpose) and isinstance(norm, Call)
                    and norm.fn == "norm" and len(norm.args) == 2):
                continue
            x = cols.operand.args[0].operand
            if len(self.shape(x)) == 2 and self.shape(norm.args[0]) == self.shape(x) and self._axis(norm) == -2:
                return x, norm.args[0]
        return None

    def _renorm_columns(self, e: BinOp) -> Optional[Code]:
        """Weight normalisation (:meth:`renorm_operands`) as one helper call, or None."""
        if (operands := self.renorm_operands(e)) is None:
            return None
        xc, yc = self._rowed([self._emit(x) for x in operands])
        self.helpers.add("_renorm_columns")
        return Code(f"_renorm_columns({xc.text}, {yc.text})", P_ATOM, 2, row=xc.row)

    def _diag_matmul(self, e: BinOp) -> Code:
        """``diag(d) @ X`` scales the rows of X, ``X @ diag(d)`` its columns (no diagonal matrix)."""
        left = is_diag(e.left)
        d, x = self._rowed([self._emit((e.left if left else e.right).args[0]), self._emit(e.right if left else e.left)])
        dt = f"{d.at(P_ATOM)}.unsqueeze({-1 if left else -2})" if x.rank == 2 else d.at(P_MUL)
        return Code(f"{dt} * {x.at(P_MUL + 1)}" if left else f"{x.at(P_MUL)} * {dt}", P_MUL, x.rank, row=x.row)

    def _matmul(self, a: Code, b: Code, e: Expr) -> Code:
        ra, rb = a.rank, b.rank
        if a.row and not b.row and (ra, rb) == (1, 2):   # rows times a held matrix: one product
            return Code(f"{a.at(P_MUL)} @ {b.at(P_MUL + 1)}", P_MUL, 1, row=True)
        if b.row and not a.row and (ra, rb) == (2, 1):   # a held matrix times each row: rows @ A^T
            return Code(f"{b.at(P_MUL)} @ {a.at(P_ATOM)}.transpose(-2, -1)", P_MUL, 1, row=True)
        if a.row != b.row:
            a, b = self._rowed([a, b])
        row = a.row
        if ra == 1 and rb == 2:
            return Code(f"({a.at(P_ATOM)}.unsqueeze(-2) @ {b.at(P_MUL + 1)}).squeeze(-2)", P_ATOM, 1, row=row)
        if ra == 2 and rb == 2:
            return Code(f"{a.at(P_MUL)} @ {b.at(P_MUL + 1)}", P_MUL, 2, row=row)
        if ra == 2 and rb == 1:
            return Code(f"({a.at(P_MUL)} @ {b.at(P_ATOM)}.unsqueeze(-1)).squeeze(-1)", P_ATOM, 1, row=row)
        if ra == 1 and rb == 1:
            return Code(f"({a.at(P_MUL)} * {b.at(P_MUL + 1)}).sum(-1)", P_ATOM, 0, row=row)
        raise CodegenError(f"`{unparse(e)}`: @ needs vectors or matrices (ranks {ra} and {rb})")

    # ------------------------------------------------------------ calls
    def _call(self, e: Call) -> Code:
        """A call: the model applied, a value the caller computed, or the function's own emitter."""
        if self.spec.model is not None and e.fn == self.spec.model.name:
            return self._model_call(e)
        if unparse(e) in self.grads:  # computed by the caller (grad(...), attend(...) over a sequence)
            return Code(self.grads[unparse(e)], P_ATOM, len(self.shape(e)), row=self.rows)
        if e.fn == "grad":
            raise CodegenError(f"`{unparse(e)}` has no precomputed value here")
        if e.fn == "append":
            raise CodegenError("append(K, k) is only allowed as a statement `K = append(K, k)`")
        emit = self._CALLS.get(e.fn)
        if emit is None:
            raise CodegenError(f"unknown function {e.fn!r}")
        return emit(self, e)

    def _elementwise(self, e: Call) -> Code:
        """``exp(x)``, ``sigmoid(x)``, ...: torch's function; on a plain number, math's (or torch's on a scalar)."""
        fn, x = e.fn, self._emit(e.args[0])
        if x.number:
            if fn in _MATH_ELEMENTWISE:
                return Code(f"{_MATH_ELEMENTWISE[fn]}({x.text})", P_ATOM, 0, number=True)
            return Code(f"{_TORCH_ELEMENTWISE[fn]}(torch.tensor({x.text})).item()", P_ATOM, 0, number=True)
        return Code(f"{_TORCH_ELEMENTWISE[fn]}({x.text})", P_ATOM, x.rank, row=x.row)

    def _reduction(self, e: Call) -> Code:
        """``sum`` / ``mean`` / ``norm`` over one named axis (``sum(x, d)``) or over all of x's axes."""
        fn, x = e.fn, self._emit(e.args[0])
        if len(e.args) == 2:
            dim = self._axis(e)
            if fn == "norm" and dim != -1:   # a strided vector_norm is 2-3x slower than the sum of squares
                self.helpers.add("_norm_axis")
                return Code(f"_norm_axis({x.text}, {dim})", P_ATOM, x.rank - 1, row=x.row)
            if fn == "norm":
                return Code(f"torch.linalg.vector_norm({x.text}, dim={dim})", P_ATOM, x.rank - 1, row=x.row)
            return Code(f"{x.at(P_ATOM)}.{fn}({dim})", P_ATOM, x.rank - 1, row=x.row)
        if x.rank == 0:
            if fn == "norm":
                return Code(f"abs({x.text})" if x.number else f"{x.at(P_ATOM)}.abs()", P_ATOM, 0, x.number, x.row)
            return x
        dims = "-1" if x.rank == 1 else "(" + ", ".join(str(-i) for i in range(x.rank, 0, -1)) + ")"
        if fn == "norm":
            return Code(f"torch.linalg.vector_norm({x.text}, dim={dims})", P_ATOM, 0, row=x.row)
        return Code(f"{x.at(P_ATOM)}.{fn}({dims})", P_ATOM, 0, row=x.row)

    def _softmax(self, e: Call) -> Code:
        """``softmax(x, d)``: over x's axis ``d``."""
        x = self._emit(e.args[0])
        return Code(f"torch.softmax({x.text}, dim={self._axis(e)})", P_ATOM, x.rank, row=x.row)

    def _newton_schulz(self, e: Call) -> Code:
        """``newton_schulz(X, steps)``: the helper, with a step count or a coefficient schedule (with
        the autograd function of its closed-form backward, :mod:`memspec.runtime.muon`)."""
        x = self._emit(e.args[0])
        self.helpers.add(e.fn)
        steps = steps_value(e.args[1], self.spec.constants)
        if isinstance(steps, tuple):   # a coefficient schedule: one (a, b, c) per step
            steps = inert(tuple(tuple(float(v) for v in row) for row in steps))
        return Code(f"newton_schulz({x.text}, {steps})", P_ATOM, 2, row=x.row)

    def _helper(self, e: Call) -> Code:
        """``layernorm`` / ``rmsnorm`` (the shape of their first argument) and the closed-form
        gradients' derivatives (:mod:`memspec.schedule.backprop`; the largest argument's shape):
        the module-level helper of the same name."""
        xs = self._rowed([self._emit(a) for a in e.args])
        self.helpers.add(e.fn)
        rank = xs[0].rank if e.fn in ("layernorm", "rmsnorm") else max(x.rank for x in xs)
        return Code(f"{e.fn}({', '.join(x.text for x in xs)})", P_ATOM, rank, row=xs[0].row)

    def _l2norm(self, e: Call) -> Code:
        """``l2norm(x)``: the helper."""
        x = self._emit(e.args[0])
        self.helpers.add(e.fn)
        return Code(f"l2norm({x.text})", P_ATOM, x.rank, row=x.row)

    def _outer(self, e: Call) -> Code:
        """``outer(a, b)``: a broadcast product, never a materialised ``torch.outer``."""
        a, b = self._rowed([self._emit(e.args[0]), self._emit(e.args[1])])
        return Code(f"{a.at(P_ATOM)}.unsqueeze(-1) * {b.at(P_ATOM)}.unsqueeze(-2)", P_MUL, 2, row=a.row)

    def _huber(self, e: Call) -> Code:
        """``huber(...)``: the helper, its arguments lifted to a common rank."""
        xs = self._rowed([self._emit(a) for a in e.args])
        texts, rank = self._aligned(xs)
        self.helpers.add(e.fn)
        return Code(f"huber({', '.join(t if t is not None else x.text for t, x in zip(texts, xs))})",
                    P_ATOM, rank, row=any(x.row for x in xs))

    def _min_max(self, e: Call) -> Code:
        """``min(a, b)`` / ``max(a, b)``: Python's on numbers, a clamp against a number,
        ``torch.minimum`` / ``torch.maximum`` on two tensors."""
        fn = e.fn
        a, b = self._rowed([self._emit(e.args[0]), self._emit(e.args[1])])
        row = a.row or b.row
        if a.number and b.number:
            return Code(f"{fn}({a.text}, {b.text})", P_ATOM, 0, True)
        if a.number or b.number:
            t, n = (b, a) if a.number else (a, b)
            kw = "max" if fn == "min" else "min"
            return Code(f"{t.at(P_ATOM)}.clamp({kw}={n.text})", P_ATOM, t.rank, row=row)
        (la, lb), rank = self._aligned([a, b])
        torch_fn = "torch.minimum" if fn == "min" else "torch.maximum"
        return Code(f"{torch_fn}({la or a.text}, {lb or b.text})", P_ATOM, rank, row=row)

    def _clamp(self, e: Call) -> Code:
        """``clamp(x, lo, hi)``: Python's min / max on numbers, else two tensor clamps."""
        x, lo, hi = self._rowed([self._emit(a) for a in e.args])
        if x.number and lo.number and hi.number:
            return Code(f"min(max({x.text}, {lo.text}), {hi.text})", P_ATOM, 0, True)
        texts, rank = self._aligned([x, lo, hi])
        tx = texts[0] or (f"torch.as_tensor({x.text})" if x.number else x.at(P_ATOM))
        tlo, thi = (t or c.text for t, c in zip(texts[1:], (lo, hi)))
        return Code(f"{tx}.clamp(min={tlo}).clamp(max={thi})", P_ATOM, rank, row=x.row or lo.row or hi.row)

    def _solve(self, e: Call) -> Code:
        """``solve(A, B)``: ``torch.linalg.solve``, a vector B as one column."""
        A, B = self._rowed([self._emit(e.args[0]), self._emit(e.args[1])])
        if B.rank == 1:
            return Code(f"torch.linalg.solve({A.text}, {B.at(P_ATOM)}.unsqueeze(-1)).squeeze(-1)", P_ATOM, 1,
                        row=B.row)
        return Code(f"torch.linalg.solve({A.text}, {B.text})", P_ATOM, 2, row=B.row)

    def _cg(self, e: Call) -> Code:
        """``cg(A, B, steps)``: the helper (:func:`memspec.runtime.solve.cg`), a vector B as one column."""
        A, B = self._rowed([self._emit(e.args[0]), self._emit(e.args[1])])
        self.helpers.add(e.fn)
        steps = cg_steps(e.args[2], self.spec.constants)
        if B.rank == 1:
            return Code(f"cg({A.text}, {B.at(P_ATOM)}.unsqueeze(-1), {steps}).squeeze(-1)", P_ATOM, 1, row=B.row)
        return Code(f"cg({A.text}, {B.text}, {steps})", P_ATOM, 2, row=B.row)

    def _eye(self, e: Call) -> Code:
        """``eye(d)``: ``torch.eye`` in the dtype and device of the tensor ``like``."""
        d = self._emit(e.args[0])
        like = self.like
        if like is None:
            raise CodegenError("eye(d) needs a tensor in scope for its dtype and device")
        return Code(f"torch.eye({d.text}, dtype={like}.dtype, device={like}.device)", P_ATOM, 2)

    def _attend(self, e: Call) -> Code:
        """``attend(q, K, V, scale)``: the helper; a tensor scale ``[..., H]`` is passed as ``[..., H, 1]``."""
        if self.rows:
            raise CodegenError("attend(...) has no rows form")
        xs = [self._emit(a) for a in e.args]
        self.helpers.add(e.fn)
        texts = [x.text for x in xs[:3]]
        scale = xs[3]                    # a number, or a tensor [..., H] (a param, a gate)
        texts.append(scale.text if scale.number else f"{scale.at(P_ATOM)}.unsqueeze(-1)")
        return Code(f"attend({', '.join(texts)})", P_ATOM, len(self.shape(e)))

    # the language's functions (and the derivative helpers of closed-form gradients) -> their emitters
    _CALLS = {**dict.fromkeys(_TORCH_ELEMENTWISE, _elementwise), **dict.fromkeys(("sum", "mean", "norm"), _reduction),
              "softmax": _softmax, "newton_schulz": _newton_schulz,
              **dict.fromkeys(("layernorm", "rmsnorm", *DERIVATIVE_HELPERS), _helper),
              "l2norm": _l2norm, "outer": _outer, "huber": _huber, "min": _min_max, "max": _min_max,
              "clamp": _clamp, "solve": _solve, "cg": _cg, "eye": _eye, "attend": _attend}

    def _axis(self, e: Call) -> int:
        """The axis named by ``e``'s second argument, as a negative dim of its first argument."""
        x = self.shape(e.args[0])
        return list(x).index(e.args[1].id) - len(x)

    def _model_call(self, e: Call) -> Code:
        spec = self.spec
        if self.rows:   # the model inline: its products are products of the rows
            if len(self.shape(e.args[0])) != 1:
                raise CodegenError(f"`{unparse(e)}`: rows apply the model to vectors only")
            return self._emit(substitute(spec.model.body, {spec.model.arg: e.args[0]}))
        u = self._emit(e.args[0])
        arg = self.shape(e.args[0])
        shape = self.shape(e)
        states = [self.names.get(s, s) for s in spec.model_states()]
        rows = len(arg) >= 2 and arg[0] == self.env.cache_axis
        text_u = u.text
        if rows:   # f of each row of a cache [.., H, n, *row]: the rows become a prefix axis before H
            r = len(arg) - 1
            text_u = f"{u.at(P_ATOM)}.transpose({-r - 2}, {-r - 1})"
            states = [f"{st}.unsqueeze({-len(spec.state[s].shape) - 2})"
                      for st, s in zip(states, spec.model_states())]
        fmt = self.model or (self.self_name + ".{fn}({u}, {states})")
        text = fmt.format(fn=self.attr.get(spec.model.name, spec.model.name), u=text_u, states=", ".join(states))
        if rows:
            r = len(shape) - 1
            text = f"{text}.transpose({-r - 2}, {-r - 1})"
        return Code(text, P_ATOM, len(shape))
