"""Code generation: a :class:`~memspec.spec.Spec` -> the text of ``compiled/<name>.py``.

Two public pieces:

* :class:`ExprEmitter` turns one expression AST into a line of torch code.
* :func:`generate` writes the whole standalone module (``<Name>Memory`` and
  ``<Name>Layer``) for a :class:`~memspec.schedule.ScheduleDecision`.

Layout of emitted tensors
-------------------------
Every tensor in generated code has leading *prefix* axes followed by its named
trailing shape (the shape written in the spec):

* one token:            ``[B, H, *shape]``     (views ``[B, H, d]``, gates ``[B, H]``)
* all tokens at once:   ``[B, T, H, *shape]``  (views ``[B, T, H, d]``, gates ``[B, T, H]``)
* per-token states of a chunk: ``[B, C, H, *shape]``

The heads axis is always the *last* prefix axis, so learned per-head params
``[H, *shape]`` broadcast against any prefix.  Every rule of the emitter acts on
the trailing named axes only (negative dims, ``unsqueeze(-r-1)``), so the same code
is correct for every prefix: that is what makes token-local expressions
vectorisable over time for free.

Using the emitter (e.g. from ``codegen_chunked``)::

    from memspec.codegen import ExprEmitter
    em = ExprEmitter(spec)                       # names: locals, self.<param>, self.<dim>
    em.emit(parse_expr("l2norm(k)"))             # 'l2norm(k)'  (a helper in the module)
    em.emit(parse_expr("eta * outer(k, v)"))     # 'eta[..., None, None] * (k.unsqueeze(-1) * v.unsqueeze(-2))'
    em.shape(parse_expr("outer(k, v)"))          # ('d_k', 'd_v')
    em.helpers                                   # {'l2norm'}: module-level helpers the code calls
    ExprEmitter(spec, names={"W": "W_seq"})      # write a spec name as another local

Generated module (``generate``)
------------------------------
``<Name>Memory.forward(*views, **gates, state=None, schedule="auto")`` validates its
inputs and dispatches to one schedule method:

* ``_forward_online``: ``_token_step`` (one token, pure function of tensors; wrapped
  in ``torch.compile(dynamic=False)`` when ``compile=True`` and the spec has no cache)
  in a Python loop over T -- never a compiled loop over T;
* ``_forward_minibatch``: ``_chunk_step`` per chunk (compiled for full chunks; a
  partial chunk runs eagerly).  When the spec admits it (:mod:`memspec.dual`), the chunk
  step is the *dual form* written by :mod:`memspec.codegen_dual` (gradients of linear
  layers as outer products, reads as masked [C, C] products, no per-token state);
  otherwise ``_token_grads`` replays one token's statements on the
  chunk-start state and takes each ``grad(...)`` there (memspec.reference's rule, so
  chunk 1 equals online); it is vmapped over the chunk's tokens.  The update program,
  with the gradients held fixed, is solved as linear recurrences
  (:func:`minibatch_recurrence`): decays through ``_linear_scan`` (decay matrix from one
  cumprod), no decay through ``cumsum``; each token then reads its own state;
* ``_forward_cache``: ``scaled_dot_product_attention`` over ``[cache | new tokens]``
  with a causal (windowed) mask;
* ``_forward_chunk``: the exact additive / delta forms, whose body comes from
  :func:`memspec.codegen_chunked.emit_chunked_forward` (lets already bound as
  ``[B, T, H, ...]`` locals) and whose kernels from ``kernel_sources``.

``helpers`` collects the names of the module-level helper functions that emitted
code calls (``layernorm``, ``rmsnorm``, ``l2norm``, ``huber``, ``attend``);
:func:`helper_source` gives their source.  They are named after the language's
functions, which a spec can never use as identifiers, so they never collide.
"""
from __future__ import annotations

import keyword
from dataclasses import dataclass, field
from typing import Optional

from ..lang.expr import BinOp, Call, Expr, Name, Neg, Num, Transpose, format_number, rewrite, substitute, unparse
from ..lang.shapes import ShapeEnv

# Python precedence levels of emitted code (higher binds tighter).
P_ADD, P_MUL, P_NEG, P_POW, P_ATOM = 1, 2, 3, 4, 9

LAYERNORM_EPS = 1e-5
NORM_EPS = 1e-6

HELPERS: dict[str, str] = {
    "layernorm": '''\
def layernorm(x, weight=None, bias=None):
    """LayerNorm over the last axis (eps 1e-5), then optional weight and bias."""
    mu = x.mean(-1, keepdim=True)
    var = (x - mu).square().mean(-1, keepdim=True)
    y = (x - mu) / torch.sqrt(var + 1e-5)
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y
''',
    "rmsnorm": '''\
def rmsnorm(x, weight=None):
    """x / sqrt(mean(x^2) + 1e-6) over the last axis, times an optional weight."""
    y = x / torch.sqrt(x.square().mean(-1, keepdim=True) + 1e-6)
    return y if weight is None else y * weight
''',
    "l2norm": '''\
def l2norm(x):
    """x / sqrt(sum(x^2) + 1e-6) over the last axis."""
    return x / torch.sqrt(x.square().sum(-1, keepdim=True) + 1e-6)
''',
    "huber": '''\
def huber(x, delta):
    """Elementwise Huber penalty: x^2/2 where |x| <= delta, else delta * (|x| - delta/2)."""
    ax = x.abs()
    return torch.where(ax <= delta, 0.5 * x * x, delta * (ax - 0.5 * delta))
''',
    "attend": '''\
def attend(q, K, V, scale):
    """softmax(scale * K q) V over a cache: q [..., d], K [..., n, d], V [..., n, e] -> [..., e];
    scale a number or [..., 1]."""
    scores = (K @ q.unsqueeze(-1)).squeeze(-1) * scale
    return (torch.softmax(scores, dim=-1).unsqueeze(-2) @ V).squeeze(-2)
''',
    "append": '''\
def append(cache, item, window=None):
    """Push item [..., d] onto cache [..., n, d]; keep the last `window` entries."""
    out = torch.cat([cache, item.unsqueeze(-2)], dim=-2)
    return out if window is None else out[..., -window:, :]
''',
}

_TORCH_ELEMENTWISE = {
    "sqrt": "torch.sqrt", "exp": "torch.exp", "log": "torch.log", "abs": "torch.abs",
    "sign": "torch.sign", "sigmoid": "torch.sigmoid", "softplus": "F.softplus",
    "tanh": "torch.tanh", "relu": "torch.relu", "gelu": "F.gelu", "silu": "F.silu", "elu": "F.elu",
}
_MATH_ELEMENTWISE = {"sqrt": "math.sqrt", "exp": "math.exp", "log": "math.log", "abs": "abs", "tanh": "math.tanh"}


def helper_source(names) -> str:
    """Source of the module-level helpers ``names`` (sorted, blank-line separated)."""
    return "\n\n".join(HELPERS[n] for n in sorted(names))


class CodegenError(ValueError):
    """An expression the generator cannot emit (the checks should have caught it)."""


@dataclass
class Code:
    text: str
    prec: int = P_ATOM
    rank: int = 0            # rank of the named (trailing) shape
    number: bool = False     # a plain Python number (dims, constants, literals)

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
                          self.self_name, self.attr, self.helpers, {**self.scope, **shapes})
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
        if n in self.names:
            is_num = n in spec.dims or n in spec.constants
            return Code(self.names[n], P_ATOM, rank, number=is_num)
        if n in self.scope:
            return Code(n, P_ATOM, rank)
        if n in spec.dims:
            return Code(f"{self.self_name}.{self.attr.get(n, n)}", P_ATOM, 0, number=True)
        if n in spec.constants:
            return self._num(spec.constants[n])
        if n in spec.params:
            return Code(f"{self.self_name}.{self.attr.get(n, n)}", P_ATOM, rank)
        return Code(n, P_ATOM, rank)

    @staticmethod
    def _num(v) -> Code:
        text = format_number(v)
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
            return Code(f"-{x.at(P_NEG)}", P_NEG, x.rank, x.number)
        if isinstance(e, Transpose):
            x = self._emit(e.operand)
            return Code(f"{x.at(P_ATOM)}.transpose(-2, -1)", P_ATOM, x.rank)
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

    def _aligned(self, xs: list[Code]) -> tuple[list[str], int]:
        """Texts of ``xs`` lifted to a common rank (numpy trailing broadcasting)."""
        rank = max(x.rank for x in xs)
        out = []
        for x in xs:
            out.append(self._lift(x, rank) if x.rank < rank and not x.number else None)
        return out, rank

    def _binop(self, e: BinOp) -> Code:
        a, b = self._emit(e.left), self._emit(e.right)
        if e.op == "@":
            return self._matmul(a, b, e)
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
        return Code(f"{left} {op} {right}", prec, rank, number)

    def _matmul(self, a: Code, b: Code, e: Expr) -> Code:
        ra, rb = a.rank, b.rank
        if ra == 1 and rb == 2:
            return Code(f"({a.at(P_ATOM)}.unsqueeze(-2) @ {b.at(P_MUL + 1)}).squeeze(-2)", P_ATOM, 1)
        if ra == 2 and rb == 2:
            return Code(f"{a.at(P_MUL)} @ {b.at(P_MUL + 1)}", P_MUL, 2)
        if ra == 2 and rb == 1:
            return Code(f"({a.at(P_MUL)} @ {b.at(P_ATOM)}.unsqueeze(-1)).squeeze(-1)", P_ATOM, 1)
        if ra == 1 and rb == 1:
            return Code(f"({a.at(P_MUL)} * {b.at(P_MUL + 1)}).sum(-1)", P_ATOM, 0)
        raise CodegenError(f"`{unparse(e)}`: @ needs vectors or matrices (ranks {ra} and {rb})")

    # ------------------------------------------------------------ calls
    def _call(self, e: Call) -> Code:
        fn, args = e.fn, e.args
        spec = self.spec
        if spec.model is not None and fn == spec.model.name:
            return self._model_call(e)
        if unparse(e) in self.grads:  # computed by the caller (grad(...), attend(...) over a sequence)
            return Code(self.grads[unparse(e)], P_ATOM, len(self.shape(e)))
        if fn == "grad":
            raise CodegenError(f"`{unparse(e)}` has no precomputed value here")
        if fn in _TORCH_ELEMENTWISE:
            x = self._emit(args[0])
            if x.number:
                if fn in _MATH_ELEMENTWISE:
                    return Code(f"{_MATH_ELEMENTWISE[fn]}({x.text})", P_ATOM, 0, number=True)
                return Code(f"{_TORCH_ELEMENTWISE[fn]}(torch.tensor({x.text})).item()", P_ATOM, 0, number=True)
            return Code(f"{_TORCH_ELEMENTWISE[fn]}({x.text})", P_ATOM, x.rank)
        if fn in ("sum", "mean", "norm"):
            x = self._emit(args[0])
            if x.rank == 0:
                if fn == "norm":
                    return Code(f"abs({x.text})" if x.number else f"{x.at(P_ATOM)}.abs()", P_ATOM, 0, x.number)
                return x
            dims = "-1" if x.rank == 1 else "(" + ", ".join(str(-i) for i in range(x.rank, 0, -1)) + ")"
            if fn == "norm":
                return Code(f"torch.linalg.vector_norm({x.text}, dim={dims})", P_ATOM, 0)
            return Code(f"{x.at(P_ATOM)}.{fn}({dims})", P_ATOM, 0)
        if fn in ("layernorm", "rmsnorm"):
            xs = [self._emit(a) for a in args]
            self.helpers.add(fn)
            return Code(f"{fn}({', '.join(x.text for x in xs)})", P_ATOM, xs[0].rank)
        if fn == "l2norm":
            x = self._emit(args[0])
            self.helpers.add(fn)
            return Code(f"l2norm({x.text})", P_ATOM, x.rank)
        if fn == "outer":
            a, b = self._emit(args[0]), self._emit(args[1])
            return Code(f"{a.at(P_ATOM)}.unsqueeze(-1) * {b.at(P_ATOM)}.unsqueeze(-2)", P_MUL, 2)
        if fn == "huber":
            xs = [self._emit(a) for a in args]
            texts, rank = self._aligned(xs)
            self.helpers.add(fn)
            return Code(f"huber({', '.join(t if t is not None else x.text for t, x in zip(texts, xs))})",
                        P_ATOM, rank)
        if fn in ("min", "max"):
            a, b = self._emit(args[0]), self._emit(args[1])
            if a.number and b.number:
                return Code(f"{fn}({a.text}, {b.text})", P_ATOM, 0, True)
            if a.number or b.number:
                t, n = (b, a) if a.number else (a, b)
                kw = "max" if fn == "min" else "min"
                return Code(f"{t.at(P_ATOM)}.clamp({kw}={n.text})", P_ATOM, t.rank)
            (la, lb), rank = self._aligned([a, b])
            torch_fn = "torch.minimum" if fn == "min" else "torch.maximum"
            return Code(f"{torch_fn}({la or a.text}, {lb or b.text})", P_ATOM, rank)
        if fn == "clamp":
            x, lo, hi = (self._emit(a) for a in args)
            if x.number and lo.number and hi.number:
                return Code(f"min(max({x.text}, {lo.text}), {hi.text})", P_ATOM, 0, True)
            texts, rank = self._aligned([x, lo, hi])
            tx = texts[0] or (f"torch.as_tensor({x.text})" if x.number else x.at(P_ATOM))
            tlo, thi = (t or c.text for t, c in zip(texts[1:], (lo, hi)))
            return Code(f"{tx}.clamp(min={tlo}).clamp(max={thi})", P_ATOM, rank)
        if fn == "solve":
            A, B = self._emit(args[0]), self._emit(args[1])
            if B.rank == 1:
                return Code(f"torch.linalg.solve({A.text}, {B.at(P_ATOM)}.unsqueeze(-1)).squeeze(-1)", P_ATOM, 1)
            return Code(f"torch.linalg.solve({A.text}, {B.text})", P_ATOM, 2)
        if fn == "eye":
            d = self._emit(args[0])
            like = self.like
            if like is None:
                raise CodegenError("eye(d) needs a tensor in scope for its dtype and device")
            return Code(f"torch.eye({d.text}, dtype={like}.dtype, device={like}.device)", P_ATOM, 2)
        if fn == "attend":
            xs = [self._emit(a) for a in args]
            self.helpers.add(fn)
            texts = [x.text for x in xs[:3]]
            scale = xs[3]                    # a number, or a tensor [..., H] (a param, a gate)
            texts.append(scale.text if scale.number else f"{scale.at(P_ATOM)}.unsqueeze(-1)")
            return Code(f"attend({', '.join(texts)})", P_ATOM, len(self.shape(e)))
        if fn == "append":
            raise CodegenError("append(K, k) is only allowed as a statement `K = append(K, k)`")
        raise CodegenError(f"unknown function {fn!r}")

    def _model_call(self, e: Call) -> Code:
        spec = self.spec
        u = self._emit(e.args[0])
        states = ", ".join(self.names.get(s, s) for s in spec.model_states())
        fmt = self.model or (self.self_name + ".{fn}({u}, {states})")
        text = fmt.format(fn=self.attr.get(spec.model.name, spec.model.name), u=u.text, states=states)
        return Code(text, P_ATOM, len(self.shape(e)))


# Names the generated code binds itself at module level or as locals; a spec
# identifier can never be one of these (checks.RESERVED_NAMES) -- listed here too
# so that the generator can pick fresh local names that never collide.
GENERATED_NAMES = frozenset({"torch", "nn", "F", "math", "warnings", "self", "state", "schedule", "x", "o"})


def fresh(base: str, taken: set) -> str:
    """``base`` or ``base_2``, ``base_3``, ... -- the first not in ``taken`` (then taken)."""
    name, i = base, 2
    while name in taken or keyword.iskeyword(name):
        name = f"{base}_{i}"
        i += 1
    taken.add(name)
    return name


# ======================================================================
# The update program as linear recurrences (the mini-batch schedule)
# ======================================================================
def _is_num(e, v=None) -> bool:
    return isinstance(e, Num) and (v is None or float(e.value) == float(v))


def _add(a, b):
    if a is None or _is_num(a, 0):
        return b
    if b is None or _is_num(b, 0):
        return a
    if isinstance(b, Neg):
        return BinOp("-", a, b.operand)
    return BinOp("+", a, b)


def _neg(a):
    if a is None:
        return None
    if isinstance(a, Neg):
        return a.operand
    if isinstance(a, Num):
        return Num(-a.value)
    return Neg(a)


def _mul(a, b):
    if a is None or b is None or _is_num(a, 0) or _is_num(b, 0):
        return None
    if _is_num(a, 1):
        return b
    if _is_num(b, 1):
        return a
    if _is_num(a, -1):
        return _neg(b)
    if isinstance(a, Neg):
        return _neg(_mul(a.operand, b))
    return BinOp("*", a, b)


def _div(a, b):
    if a is None:
        return None
    if _is_num(b, 1):
        return a
    return BinOp("/", a, b)


@dataclass
class _Affine:
    """``sum_S coeffs[S] * S_{t-1} + rest``: coefficients are token-local scalars."""

    coeffs: dict
    rest: Optional[Expr]


def _replace_calls(e: Expr, table: dict) -> Expr:
    """``e`` with every call whose ``unparse`` is a key of ``table`` replaced by its value."""
    return rewrite(e, lambda n: table.get(unparse(n)) if isinstance(n, Call) else None)


def _parse_call(text: str) -> Expr:
    from ..lang.expr import parse_expr
    return parse_expr(text)


class NotRecurrence(Exception):
    """The update program is not a set of linear recurrences (``str`` says why)."""


@dataclass(frozen=True)
class Recurrence:
    """The update program of one token, with every ``grad(...)`` held fixed, as
    ``S_t = sum coeff[S][(when, R)] * R_when + rest[S]`` with token-local scalar
    coefficients, where ``(\"prev\", R)`` is R after the previous token and
    ``(\"cur\", R)`` is R after this token (used when a statement reads a state that
    an earlier statement of the token finished writing, e.g. Titans' ``W = (1 - alpha) * W + U``).
    The diagonal term ``(\"prev\", S)`` is the decay of S.

    ``order`` lists the states so that each one depends (off the diagonal) only on
    states before it: the recurrences are solved one after the other.  ``grads`` are
    the distinct ``grad(...)`` calls (each taken at the chunk-start state in the
    mini-batch schedule)."""

    order: tuple
    coeff: dict
    rest: dict
    grads: tuple


def minibatch_recurrence(spec, values=None, scope=None) -> Recurrence:
    """Extract the :class:`Recurrence` of ``spec``'s update program, or raise
    :class:`NotRecurrence` (then the spec does not admit the mini-batch schedule).

    ``values`` (optional) replaces the right-hand sides of the update statements, e.g.
    with each ``grad(...)`` already replaced by a placeholder name whose shape is in
    ``scope``; the placeholders are token-local inputs."""
    env = ShapeEnv.from_spec(spec)
    values = [st.value for st in spec.update] if values is None else list(values)
    states = list(spec.state)
    model = spec.model.name if spec.model is not None else None
    grads: dict = {}
    last = {stmt.target: i for i, stmt in enumerate(spec.update)}
    temps: dict = {}   # temporary -> its _Affine (a token-local input when it has no coefficients)

    def local(e: Expr) -> bool:
        """Token-local: no state, no model application outside grad(...)."""
        if isinstance(e, Call) and e.fn == "grad":
            return True
        if isinstance(e, Name) and (e.id in spec.state or (e.id in temps and temps[e.id].coeffs)):
            return False
        if isinstance(e, Call) and (e.fn == model or e.fn == "append"):
            return False
        return all(local(c) for c in e.children())

    def scalar(e: Expr) -> bool:
        shape = env.infer(e, scope=scope)
        return shape is not None and tuple(shape) == ()

    def negated(v: _Affine) -> _Affine:
        return _Affine({k: _neg(c) for k, c in v.coeffs.items()}, _neg(v.rest))

    def walk(e: Expr, cur: dict, i: int) -> _Affine:
        if local(e):
            for c in e.walk():
                if isinstance(c, Call) and c.fn == "grad":
                    grads.setdefault(unparse(c), c)
            pure = {t: v.rest if v.rest is not None else Num(0) for t, v in temps.items() if not v.coeffs}
            return _Affine({}, substitute(e, pure) if pure else e)
        if isinstance(e, Name):
            if e.id in temps:
                return _Affine(dict(temps[e.id].coeffs), temps[e.id].rest)
            if e.id != spec.update[i].target and last.get(e.id, i) < i:
                return _Affine({("cur", e.id): Num(1)}, None)   # finished earlier in this token
            v = cur[e.id]
            return _Affine(dict(v.coeffs), v.rest)
        if isinstance(e, Neg):
            return negated(walk(e.operand, cur, i))
        if isinstance(e, BinOp) and e.op in "+-":
            a, b = walk(e.left, cur, i), walk(e.right, cur, i)
            if e.op == "-":
                b = negated(b)
            coeffs = dict(a.coeffs)
            for k, c in b.coeffs.items():
                coeffs[k] = _add(coeffs.get(k), c)
            return _Affine({k: c for k, c in coeffs.items() if c is not None}, _add(a.rest, b.rest))
        if isinstance(e, BinOp) and e.op == "*":
            for s, t in ((e.left, e.right), (e.right, e.left)):
                if local(s) and scalar(s):
                    v = walk(t, cur, i)
                    return _Affine({k: _mul(s, c) for k, c in v.coeffs.items()}, _mul(s, v.rest))
        if isinstance(e, BinOp) and e.op == "/" and local(e.right) and scalar(e.right):
            v = walk(e.left, cur, i)
            return _Affine({k: _div(c, e.right) for k, c in v.coeffs.items()}, _div(v.rest, e.right))
        raise NotRecurrence(f"`{unparse(e)}` is not a token-local scalar times a state")

    cur = {s: _Affine({("prev", s): Num(1)}, None) for s in states}
    for i, stmt in enumerate(spec.update):
        if stmt.target not in spec.state:   # a per-token temporary: substituted where it is used
            if stmt.target not in temps:
                temps[stmt.target] = walk(values[i], cur, i)
            continue
        if spec.state[stmt.target].cache:
            raise NotRecurrence(f"state {stmt.target} is a cache")
        cur[stmt.target] = walk(values[i], cur, i)
    if not grads and scope is None:
        raise NotRecurrence("the update takes no gradient")
    coeff = {s: {k: c for k, c in cur[s].coeffs.items() if c is not None} for s in states}
    order: list = []
    pending = list(states)
    while pending:
        ready = [s for s in pending if all(r == s or r in order for _, r in coeff[s])]
        if not ready:
            raise NotRecurrence(f"states {', '.join(pending)} feed each other within a token")
        order.append(ready[0])
        pending.remove(ready[0])
    return Recurrence(tuple(order), coeff, {s: cur[s].rest for s in states}, tuple(grads.values()))


# ======================================================================
# The module writer
# ======================================================================
EXACT_CHUNKED = ("additive", "delta")
SCHEDULE_TEXT = {
    "online": "online: one token at a time (exact)",
    "cache": "cache: scaled_dot_product_attention over [past cache | new tokens] with a causal{window} mask (exact)",
    "minibatch": "minibatch({chunk}): gradients of each chunk at the chunk-start state (approximate; chunk 1 "
                 "equals online when no statement writes a state before a gradient reads it)",
    "additive": "additive chunked form, chunk {chunk} (exact)",
    "delta": "delta rule chunked form (WY / UT), chunk {chunk} (exact)",
}


def class_name(name: str) -> str:
    """``gated_deltanet`` -> ``GatedDeltanet``."""
    return "".join(p[:1].upper() + p[1:] for p in name.split("_") if p) or "Spec"


def _fmt_dims(shape) -> str:
    return ", ".join(shape)


class _Lines:
    def __init__(self):
        self.lines: list = []
        self.level = 0

    def __call__(self, text: str = "", comment: str | None = None):
        if not text:
            self.lines.append("")
            return
        line = "    " * self.level + text
        if comment:
            line += "  # " + comment
        self.lines.append(line)

    def block(self, text: str):
        for ln in text.rstrip("\n").split("\n"):
            self.lines.append(("    " * self.level + ln) if ln else "")

    def indent(self):
        self.level += 1
        return self

    def dedent(self):
        self.level -= 1

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.level -= 1


def cache_plan(spec):
    """``(appends, inclusive)`` if ``spec`` is softmax attention over caches: every
    update is ``K = append(K, <token-local>)`` of a cache, the states are all caches,
    the order is write_read; else None."""
    if not spec.state or not all(s.cache for s in spec.state.values()) or spec.order != "write_read":
        return None
    appends = []
    for stmt in spec.update:
        v = stmt.value
        if not (isinstance(v, Call) and v.fn == "append" and isinstance(v.args[0], Name)
                and v.args[0].id == stmt.target):
            return None
        if any(isinstance(n, Name) and n.id in spec.state for n in v.args[1].walk()):
            return None
        appends.append((stmt.target, v.args[1]))
    if len({t for t, _ in appends}) != len(appends) or {t for t, _ in appends} != set(spec.state):
        return None
    for c in spec.read.walk():
        if isinstance(c, Call) and c.fn == "attend":
            q, K, V, scale = c.args
            if not (isinstance(K, Name) and isinstance(V, Name)):
                return None
            if any(isinstance(n, Name) and n.id in spec.state for n in (*q.walk(), *scale.walk())):
                return None
            wK, wV = spec.state[K.id].window, spec.state[V.id].window
            if wK != wV:
                return None
        elif isinstance(c, Name) and c.id in spec.state:
            pass
    # states may only appear as the K, V arguments of attend
    def bad(e, inside=False):
        if isinstance(e, Call) and e.fn == "attend":
            return any(bad(a) for a in (e.args[0], e.args[3]))
        if isinstance(e, Name) and e.id in spec.state:
            return True
        return any(bad(c) for c in e.children())
    if bad(spec.read):
        return None
    return appends


_RUNTIME = '''\
def _check(name, t, axes, sizes, ref=None):
    """Raise ValueError unless `t` is a floating tensor of shape `sizes` (None: any size),
    with the dtype and device of `ref` = (name, tensor) when given."""
    notation = "[" + ", ".join(axes) + "]"
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a tensor {notation}, got {type(t).__name__}")
    want = "[" + ", ".join(a if s is None else str(s) for a, s in zip(axes, sizes)) + "]"
    if t.dim() != len(axes) or any(s is not None and s != n for s, n in zip(sizes, t.shape)):
        raise ValueError(f"{name}: expected {notation} = {want}, got {list(t.shape)}")
    if not t.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point tensor {notation}, got {t.dtype}")
    if ref is not None and t.dtype != ref[1].dtype:
        raise ValueError(f"{name}: dtype {t.dtype} does not match {ref[0]} ({ref[1].dtype})")
    if ref is not None and t.device != ref[1].device:
        raise ValueError(f"{name}: device {t.device} does not match {ref[0]} ({ref[1].device})")
    return t


class _Compiled:
    """`torch.compile(fn, dynamic=False)` (static shapes), compiled at the first call.

    If compilation fails, warns once and runs `fn` eagerly from then on.
    `seconds` is the wall time of the first (compiling) call."""

    def __init__(self, fn):
        self.fn = fn
        self.compiled = torch.compile(fn, dynamic=False)
        self.seconds = None

    def __call__(self, *args):
        if self.compiled is not None:
            try:
                start = time.perf_counter()
                out = self.compiled(*args)
                if self.seconds is None:
                    self.seconds = time.perf_counter() - start
                return out
            except Exception as err:  # a construct torch.compile cannot handle on this machine
                warnings.warn(f"torch.compile failed for {self.fn.__name__} "
                              f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); "
                              f"running it eagerly")
                self.compiled = None
        return self.fn(*args)
'''

_DECAY_MATRIX = '''\
def _decay_matrix(a):
    """The weights of s_i = a_i s_(i-1) + x_i over the C tokens of a chunk: a [B, H, C] ->
    (L [B, H, C, C] with L[i, j] = a_(j+1) ... a_i on and below the diagonal and 0 above it,
     P [B, H, C] with P[i] = a_1 ... a_i), so that s_i = P[i] s_0 + sum_j L[i, j] x_j.
    Built with one cumprod (exact for any a, zeros and negatives included)."""
    C = a.shape[-1]
    idx = torch.arange(C, device=a.device)
    later = idx.unsqueeze(0) > idx.unsqueeze(1)                            # [C, C]: l > j
    Z = torch.where(later, a.unsqueeze(-2), torch.ones_like(a).unsqueeze(-2))  # [B, H, C(j), C(l)]
    L = torch.cumprod(Z, dim=-1).transpose(-2, -1).tril()                  # [B, H, C(i), C(j)]
    return L, torch.cumprod(a, dim=-1)
'''

_LINEAR_SCAN = '''\
def _linear_scan(a, x, s0):
    """s_i = a_i * s_{i-1} + x_i for the tokens i of a chunk, from s0, in closed form.

    a [B, C, H] (or a number), x [B, C, H, *shape], s0 [B, H, *shape] -> [B, C, H, *shape]:
    s_i = P[i] s0 + sum_{j <= i} L[i, j] x_j with the weights of _decay_matrix.
    """
    B, C, H = x.shape[:3]
    if not isinstance(a, torch.Tensor):
        a = torch.full((B, C, H), float(a), dtype=x.dtype, device=x.device)
    L, P = _decay_matrix(a.expand(B, C, H).transpose(1, 2))                # [B, H, C, C], [B, H, C]
    xf = x.transpose(1, 2).reshape(B, H, C, -1)                            # [B, H, C, N]
    s = L @ xf + P.unsqueeze(-1) * s0.reshape(B, H, 1, -1)                 # [B, H, C, N]
    return s.reshape(B, H, C, *s0.shape[2:]).transpose(1, 2)
'''

_CAUSAL_MASK = '''\
def _causal_mask(T, N, window, device):
    """[T, N] boolean: new token i (position N - T + i) may attend to cached position j
    when j <= its position and j > its position - window."""
    pos = torch.arange(N - T, N, device=device).unsqueeze(1)               # [T, 1]
    j = torch.arange(N, device=device).unsqueeze(0)                        # [1, N]
    allowed = j <= pos
    if window is not None:
        allowed = allowed & (j > pos - window)
    return allowed
'''


def _shape_text(prefix: str, shape) -> str:
    return "[" + ", ".join([prefix, *shape]) + "]"


class ModuleWriter:
    """Writes the module text for one spec and decision (see :func:`generate`)."""

    OWN_ATTRS = ("chunk", "compile", "forward", "step", "init_state", "inner_loss",
                 "VIEWS", "GATES", "STATE", "CACHES", "SCHEDULES", "DEFAULT_SCHEDULE", "STEP_SCHEDULE",
                 "CHUNK_SCHEDULES", "LOSS_STATES")

    def __init__(self, spec, decision, *, source_path=None, source_text=None):
        import torch.nn as nn  # only for the attribute names a module already has

        self.spec = spec
        self.decision = decision
        self.source_path = source_path
        self.source_text = source_text
        self.name = class_name(spec.name)
        self.env = ShapeEnv.from_spec(spec)
        self.helpers: set = set()
        self.module_parts: list = []
        spec_names = set(spec.dims) | set(spec.constants) | set(spec.views) | set(spec.gates) | \
            set(spec.params) | set(spec.state) | set(spec.let)
        if spec.model is not None:
            spec_names |= {spec.model.name, spec.model.arg}
        self.spec_names = spec_names | set(GENERATED_NAMES) | set(HELPERS) | {"loss", "logit"} | \
            {st.target for st in spec.update}   # per-token temporaries are locals of the generated code
        # attribute names on the Memory module
        taken = set(dir(nn.Module)) | set(self.OWN_ATTRS)
        self.attr: dict = {}
        for n in list(spec.dims) + list(spec.params):
            self.attr[n] = fresh(n, taken)
        if "heads" not in spec.dims:
            self.attr["heads"] = "heads"
        self.init_attr = {s: fresh(f"{s}_init", taken) for s, st in spec.state.items() if st.learned}
        if spec.model is not None:
            self.attr[spec.model.name] = fresh(spec.model.name, taken)
        self.views = list(spec.views)
        self.gates = list(spec.gates)
        self.states = list(spec.state)
        self.first = self.views[0] if self.views else None
        self.loss_states = self._loss_states()
        self._plan()

    # ------------------------------------------------------------ analysis
    def _loss_states(self) -> list:
        spec = self.spec
        if spec.loss is None:
            return []
        used = {n.id for n in spec.loss.walk() if isinstance(n, Name)}
        if spec.model is not None and any(isinstance(c, Call) and c.fn == spec.model.name for c in spec.loss.walk()):
            used |= set(spec.model_states())
        return [s for s in self.states if s in used]

    def _plan(self):
        spec, d = self.spec, self.decision
        self.recurrence = None
        self.cache = None
        self.chunked = None
        producible = ["online"]
        try:
            self.recurrence = minibatch_recurrence(spec)
        except NotRecurrence as err:
            self.no_minibatch = str(err)
        admits = tuple(d.admits) if d is not None else ()
        if "cache" in admits or d is None:
            self.cache = cache_plan(spec)
            if self.cache is not None and self._cache_scales_ok():
                producible.append("cache")
            else:
                self.cache = None
        if self.recurrence is not None and ("minibatch" in admits or d is None):
            producible.append("minibatch")
        self.dual = None
        if "minibatch" in producible:
            from ..schedule.dual import NotDual, analyse_dual
            try:
                self.dual = analyse_dual(spec)
            except NotDual:
                pass
        fam = d.family if d is not None else None
        if fam in EXACT_CHUNKED:
            try:
                from . import chunked as codegen_chunked  # noqa: F401
                self.chunked = fam
                producible.append(fam)
            except ImportError:
                self.chunked = None
        order = ["cache", "additive", "delta", "minibatch", "online"]
        self.schedules = [f for f in order if f in producible]
        if fam in self.schedules:
            self.default = fam
        else:
            self.default = next(f for f in self.schedules if f != "minibatch" or d is None) \
                if self.schedules else "online"
        self.step_schedule = "minibatch" if self.default == "minibatch" else "online"
        mb = None
        if d is not None:
            plans = getattr(d, "plans", {}) or {}
            p = plans.get("minibatch")
            mb = getattr(p, "chunk", None)
        if d is not None and d.family == "minibatch" and d.chunk:
            mb = d.chunk
        if mb is None:
            mb = spec.schedule_size if spec.schedule_kind == "minibatch" and spec.schedule_size else 64
        self.mb_chunk = mb
        self.ck_chunk = (d.chunk if d is not None and d.family in EXACT_CHUNKED and d.chunk else 64)
        self.default_chunk = self.ck_chunk if self.default in EXACT_CHUNKED else self.mb_chunk

    def _cache_scales_ok(self) -> bool:
        """Every attend's scale is a number (SDPA's ``scale=``) or a per-token / per-head
        scalar ``[..., H]`` (a learned param, a gate), which multiplies the query."""
        em = self.emitter()
        for c in self.spec.read.walk():
            if isinstance(c, Call) and c.fn == "attend":
                scale = em._emit(c.args[3])
                if not scale.number and scale.rank != 0:
                    return False
        return True

    # ------------------------------------------------------------ helpers
    def emitter(self, **kw) -> ExprEmitter:
        em = ExprEmitter(self.spec, like=self.first, attr=self.attr, helpers=self.helpers, **kw)
        return em

    def shape(self, e) -> tuple:
        return tuple(self.env.infer(e))

    def read_shape(self) -> tuple:
        return self.shape(self.spec.read)

    def dim_sizes(self, shape, obj="self") -> str:
        return ", ".join(f"{obj}.{self.attr.get(d, d)}" for d in shape)

    def _let_order(self) -> list:
        from ..lang.shapes import let_order
        return [n for n in let_order(self.spec.let) if n in self.spec.let]

    def _model_arg_shape(self) -> tuple:
        spec = self.spec
        exprs = [spec.read] + ([spec.loss] if spec.loss is not None else []) + [s.value for s in spec.update]
        for e in exprs:
            for c in e.walk():
                if isinstance(c, Call) and c.fn == spec.model.name:
                    return self.shape(c.args[0])
        return (spec.dims and next(iter(spec.views.values())).dim,) if spec.views else ()

    # ------------------------------------------------------------ module
    def generate(self) -> str:
        L = _Lines()
        self.header(L)
        body = _Lines()
        self.memory_class(body)
        while body.lines and body.lines[-1] == "":
            body.lines.pop()
        body()
        body()
        self.layer_class(body)
        # module-level helpers, only those used
        L("import math")
        L("import time")
        L("import warnings")
        L()
        L("import torch")
        L("import torch.nn.functional as F")
        L("from torch import nn")
        L()
        L()
        wiring = []
        if self.spec.wiring.kind != "none":
            from ..runtime.wiring import source as wiring_source
            wiring = ["# ---- wiring (memspec.wiring, Titans §4): attention around the memory layer ----\n"
                      + wiring_source(self.spec.wiring.kind)]
        for part in [HELPERS[h] for h in sorted(self.helpers)] + [_RUNTIME] + self.module_parts + wiring:
            L.block(part)
            L()
            L()
        text = "\n".join(L.lines + body.lines).rstrip("\n") + "\n"
        return text

    def header(self, L):
        import hashlib

        from .. import __version__
        spec, d = self.spec, self.decision
        src = self.source_path or spec.path or "<memory>"
        L(f"# Generated by memspec {__version__} from {src} -- do not edit.")
        L(f"# Regenerate with: memspec compile {src}")
        try:
            from ..lang.fmt import to_yaml
            canonical = to_yaml(spec)
        except Exception:  # the canonical printer is optional for the hash
            canonical = repr(spec.model_dump())
        L(f"# spec sha256 (canonical resolved form, `memspec fmt --to yaml`): "
          f"{hashlib.sha256(canonical.encode('utf-8')).hexdigest()}")
        if self.source_text is not None:
            L(f"# file sha256: {hashlib.sha256(self.source_text.encode('utf-8')).hexdigest()}")
        fam = d.family if d is not None else self.default
        text = SCHEDULE_TEXT[self.default].format(chunk=self.default_chunk, window=self._window_text())
        L(f"# schedule: {text}")
        if self.dual is not None and "minibatch" in self.schedules:
            L("# mini-batch chunks in dual form: linear-layer gradients are outer products, reads are "
              "masked [C, C] products (memspec.dual)")
        if d is not None:
            exact = "exact" if d.exact else "approximate (mini-batch)"
            L(f"# derived by memspec.schedule.analyse: {fam}, {exact}; admits {', '.join(d.admits)}")
            if fam != self.default:
                L(f"# note: the {fam} form is not available to this generator; the default is {self.default}")
        L(f"# schedules of this module: {', '.join(self.schedules)}")
        if spec.wiring.kind != "none":
            w = spec.wiring
            opts = "".join(f", {k}={_py_literal(v)}" for k, v in w.options().items())
            L(f"# wiring: {w.kind}(segment={w.segment}, persistent={w.persistent}, window={w.window}{opts}) -- "
              f"built here: {self.name}Layer is {w.kind.upper()} around {self.name}MemoryLayer")
        L('"""' + f"{spec.name}: " + (spec.description.split(". ")[0].strip().rstrip(".") + "." if spec.description else "a memspec memory."))
        L()
        if spec.cite:
            L(f"Cite: {spec.cite}")
            L()
        L(f"{self.name}Memory: the memory (views [B, T, H, D], gates [B, T, H], state {{name: [B, H, ...]}}).")
        if spec.wiring.kind == "none":
            L(f"{self.name}Layer: projections of x [B, T, d_model] into views and gates, the memory, the output projection.")
        else:
            L(f"{self.name}MemoryLayer: projections of x [B, T, d_model] into views and gates, the memory, "
              "the output projection.")
            for i, line in enumerate(f"{wiring_text(spec.wiring)}.".split("\n")):
                L(f"{self.name}Layer: the spec's wiring, {line}" if i == 0 else f"    {line}")
        L('"""')

    def _window_text(self) -> str:
        ws = {st.window for st in self.spec.state.values() if st.cache}
        w = next(iter(ws), None) if ws else None
        return f" (window {w})" if w else ""

    # ------------------------------------------------------------ Memory
    def memory_class(self, L):
        spec = self.spec
        n = self.name
        L(f"class {n}Memory(nn.Module):")
        L.indent()
        L('"""' + f"The {spec.name} memory: one spec step per token, or a chunked schedule.")
        L()
        L("Shapes:")
        for v in self.views:
            L(f"    {v}: [B, T, H, {spec.views[v].dim}]")
        for g in self.gates:
            L(f"    {g}: [B, T, H]")
        for s, st in spec.state.items():
            shp = ("n",) + tuple(st.shape) if st.cache else tuple(st.shape)
            extra = " (a cache" + (f" of at most {st.window} entries)" if st.window else ")") if st.cache else ""
            init = " (learned initial value)" if st.learned else ""
            L(f"    state[{s!r}]: [B, H, {_fmt_dims(shp)}]{extra}{init}")
        L(f"    output: [B, T, H{''.join(', ' + x for x in self.read_shape())}]")
        L()
        L(f"Schedules: {', '.join(repr(s) for s in self.schedules)}; \"auto\" is {self.default!r}.")
        L('"""')
        L()
        L(f"VIEWS = {{{', '.join(f'{v!r}: {spec.views[v].dim!r}' for v in self.views)}}}")
        L(f"GATES = ({''.join(f'{g!r}, ' for g in self.gates)})")
        state_items = ", ".join(f"{s!r}: ({''.join(f'{x!r}, ' for x in st.shape)})" for s, st in spec.state.items())
        L(f"STATE = {{{state_items}}}")
        caches = {s: st.window for s, st in spec.state.items() if st.cache}
        L(f"CACHES = {caches!r}")
        L(f"LOSS_STATES = ({''.join(f'{s!r}, ' for s in self.loss_states)})")
        L(f"SCHEDULES = ({''.join(f'{s!r}, ' for s in self.schedules)})")
        L(f"DEFAULT_SCHEDULE = {self.default!r}")
        L(f"STEP_SCHEDULE = {self.step_schedule!r}")
        L()
        self.memory_init(L)
        self.init_state(L)
        self.forward(L)
        self.step(L)
        self.validation(L)
        if spec.model is not None:
            self.model_method(L)
        if spec.loss is not None and self.loss_states is not None and self._has_grads():
            self.loss_method(L)
        if self.read_views() is not None:
            self.read_method(L)
        self.online(L)
        if "minibatch" in self.schedules:
            self.minibatch(L)
        if "cache" in self.schedules:
            self.cache_forward(L)
        if self.chunked:
            self.chunked_forward(L)
        L.dedent()

    def _read_names(self) -> set:
        """Spec names the read uses, lets followed."""
        spec = self.spec
        seen: set = set()
        todo = [spec.read]
        while todo:
            e = todo.pop()
            for n in e.walk():
                if isinstance(n, Name) and n.id not in seen:
                    seen.add(n.id)
                    if n.id in spec.let:
                        todo.append(spec.let[n.id])
                if isinstance(n, Call) and spec.model is not None and n.fn == spec.model.name:
                    for st in spec.model_states():
                        seen.add(st)
        return seen

    def read_views(self):
        """The views a read-only call needs, or None when the read is not a function of the
        views and the state alone (it uses a gate or a temporary, or a state is a cache)."""
        spec = self.spec
        used = self._read_names()
        if any(st.cache for st in spec.state.values()) or used & set(spec.gates) \
                or used & {st.target for st in spec.update if st.target not in spec.state}:
            return None
        views = [v for v in self.views if v in used]
        return views or None

    def read_method(self, L):
        """``read(views..., state=None)``: the read at a fixed state, with no write."""
        spec = self.spec
        views = self.read_views()
        used = self._read_names()
        states = [s for s in self.states if s in used]
        rshape = self.read_shape()
        L(f"def read(self, {', '.join(views)}, *, state=None):")
        with L.indent():
            L('"""' + f"The read {unparse(spec.read)} of a fixed state, with no write (e.g. Titans' retrieval")
            L("M*(q) in MAC): " + ", ".join(f"{v} [B, T, H, {spec.views[v].dim}]" for v in views)
              + "; state {name: [B, H, ...]} (default: init_state).")
            L(f"Every token reads the same state.  Returns {_shape_text('B, T, H', rshape)}.")
            L('"""')
            taken = set(self.spec_names)
            B, T = fresh("B", taken), fresh("T", taken)
            L(f"{B}, {T} = self._check_inputs({{{', '.join(f'{v!r}: {v}' for v in views)}}}, {{}})")
            L(f"state = self._check_state(state, {B}, {views[0]})")
            names = {}
            for st in states:
                names[st] = fresh(f"{st}_all", taken)
                L(f"{names[st]} = state[{st!r}].unsqueeze(1)",
                  _shape_text("B, 1, H", spec.state[st].shape) + ": the same state for every token")
            em = ExprEmitter(spec, names=names, like=views[0], attr=self.attr, helpers=self.helpers)
            for n in self._let_order():
                if n in used:
                    L(f"{n} = {em.emit(spec.let[n])}", _shape_text("B, T, H", self.shape(Name(n))))
            L(f"return {em.emit(spec.read)}", _shape_text("B, T, H", rshape))
        L()

    def _has_grads(self) -> bool:
        return any(isinstance(c, Call) and c.fn == "grad" for s in self.spec.update for c in s.value.walk())

    def _dims_signature(self) -> list:
        spec = self.spec
        sig = []
        if "heads" not in spec.dims:
            sig.append("heads=1")
        for dname, val in spec.dims.items():
            sig.append(f"{dname}={val}")
        return sig

    def memory_init(self, L):
        spec = self.spec
        sig = self._dims_signature()
        L(f"def __init__(self, *, {', '.join(sig)}, chunk={self.default_chunk}, compile=False):")
        with L.indent():
            L('"""' + "Dims as keywords (defaults from the spec); `chunk`: the chunk size of chunked schedules;")
            L("`compile`: torch.compile the per-token and per-chunk step functions (static shapes).")
            L('"""')
            L("super().__init__()")
            names = list(spec.dims) if "heads" in spec.dims else ["heads", *spec.dims]
            for dname in names:
                L(f"self.{self.attr.get(dname, dname)} = {dname}")
            L("self.chunk = chunk")
            L("self.compile = compile")
            H = f"self.{self.attr.get('heads', 'heads')}"
            for p, prm in spec.params.items():
                dims = [f"self.{self.attr.get(x, x)}" for x in prm.shape]
                L(f"self.{self.attr[p]} = nn.Parameter({self._init_code(prm.init, [H], dims)})",
                  f"[H{''.join(', ' + x for x in prm.shape)}]")
            for s, st in spec.state.items():
                if st.learned:
                    dims = [f"self.{self.attr.get(x, x)}" for x in st.shape]
                    inner = st.init[len("learned("):-1]
                    L(f"self.{self.init_attr[s]} = nn.Parameter({self._init_code(inner, [H], dims)})",
                      f"learned initial {s}: [H{''.join(', ' + x for x in st.shape)}]")
            has_cache = any(st.cache for st in spec.state.values())
            tok = "compile and not self.CACHES" if has_cache else "compile"
            L(f"self._token_fn = _Compiled(self._token_step) if {tok} else self._token_step")
            if "minibatch" in self.schedules:
                L("self._chunk_fn = _Compiled(self._chunk_step) if compile else self._chunk_step")
        L()

    def _init_code(self, init, lead: list, dims: list, kw: str = "", generator: str = "") -> str:
        """Code of a tensor [*lead, *dims] for an init: zeros, ones, eye, normal(std) or a number."""
        sizes = ", ".join(lead + dims)
        if isinstance(init, (int, float)):
            return f"torch.full(({sizes},), {float(init)!r}{kw})"
        if init in ("zeros", "ones"):
            return f"torch.{init}({sizes}{kw})"
        if init == "eye":
            d = dims[-1]
            return f"torch.eye({d}{kw}).expand({', '.join(lead)}, {d}, {d}).clone()"
        if init.startswith("normal("):
            std = float(init[len("normal("):-1])
            return f"torch.randn({sizes}{kw}{generator}) * {std!r}"
        raise CodegenError(f"unknown init {init!r}")

    def init_state(self, L):
        spec = self.spec
        L("def init_state(self, batch, device=None, dtype=None, generator=None):")
        with L.indent():
            L('"""' + "The initial state {name: [batch, H, ...]} (learned initial values are parameters;")
            L("caches start empty [batch, H, 0, d]).  `generator` seeds random (normal) inits.")
            L('"""')
            H = f"self.{self.attr.get('heads', 'heads')}"
            L("state = {}")
            for s, st in spec.state.items():
                dims = [f"self.{self.attr.get(x, x)}" for x in st.shape]
                if st.cache:
                    code = f"torch.zeros(batch, {H}, 0, {', '.join(dims)}, device=device, dtype=dtype)"
                elif st.learned:
                    code = f"self.{self.init_attr[s]}.to(device=device, dtype=dtype).expand(batch, {H}{''.join(', ' + x for x in dims)})"
                else:
                    code = self._init_code(st.init, ["batch", H], dims, ", device=device, dtype=dtype",
                                           ", generator=generator")
                L(f"state[{s!r}] = {code}", _shape_text("B, H", (("n",) if st.cache else ()) + tuple(st.shape)))
            L("return state")
        L()

    def _sig(self) -> tuple:
        views = ", ".join(self.views)
        gates = "".join(f"{g}=None, " for g in self.gates)
        return views, gates

    def forward(self, L):
        spec = self.spec
        views, gates = self._sig()
        L(f"def forward(self, {views}, *, {gates}state=None, schedule=\"auto\", **unknown):")
        with L.indent():
            L('"""' + "Run the memory over a sequence.")
            L()
            L("Args:")
            for v in self.views:
                L(f"    {v}: [B, T, H, {spec.views[v].dim}]")
            for g in self.gates:
                L(f"    {g}: [B, T, H] (gate value, after its formula)")
            L("    state: {name: [B, H, ...]} to continue from (default: init_state).")
            L(f"    schedule: \"auto\" ({self.default}) or one of {', '.join(self.schedules)}.")
            L(f"Returns: (o [B, T, H{''.join(', ' + x for x in self.read_shape())}], the final state).")
            L('"""')
            L("if unknown:")
            L(f"    raise ValueError(f\"unknown argument(s) {{', '.join(sorted(unknown))}}: {self.name}Memory.forward "
              f"takes views {', '.join(self.views)}" + (f", gates {', '.join(self.gates)}" if self.gates else "")
              + ", state, schedule\")")
            L(f"{self._locals_bt()} = self._check_inputs({{{', '.join(f'{v!r}: {v}' for v in self.views)}}}, "
              f"{{{', '.join(f'{g!r}: {g}' for g in self.gates)}}})")
            B = self._locals_bt().split(",")[0]
            L(f"state = self._check_state(state, {B}, {self.first})")
            L("if schedule == \"auto\":")
            L("    schedule = self.DEFAULT_SCHEDULE")
            L("if schedule == \"chunk\" and self.DEFAULT_SCHEDULE in (\"additive\", \"delta\"):")
            L("    schedule = self.DEFAULT_SCHEDULE")
            L("if schedule not in self.SCHEDULES:")
            L(f"    raise ValueError(f\"schedule {{schedule!r}} is not admitted by {spec.name}: use \\\"auto\\\" or one of "
              f"{', '.join(self.schedules)}\")")
            args = ", ".join(self.views + self.gates + ["state"])
            for fam, meth in (("minibatch", "_forward_minibatch"), ("cache", "_forward_cache"),
                              (self.chunked, "_forward_chunk")):
                if fam and fam in self.schedules:
                    L(f"if schedule == {fam!r}:")
                    L(f"    return self.{meth}({args})")
            L(f"return self._forward_online({args})")
        L()

    def _locals_bt(self) -> str:
        taken = set(self.spec_names)
        return f"{fresh('B', taken)}, {fresh('T', taken)}"

    def step(self, L):
        views, gates = self._sig()
        L(f"def step(self, {views}, *, {gates}state=None, **unknown):")
        with L.indent():
            L('"""' + "One token (decoding): views [B, H, D] (or [B, 1, H, D]), gates [B, H] (or [B, 1, H]).")
            L()
            L(f"Runs the {self.step_schedule} schedule (the same numbers as forward over the whole sequence).")
            L(f"Returns: (o [B, H{''.join(', ' + x for x in self.read_shape())}], the new state).")
            L('"""')
            for v in self.views:
                L(f"{v} = {v}.unsqueeze(1) if isinstance({v}, torch.Tensor) and {v}.dim() == 3 else {v}")
            for g in self.gates:
                L(f"{g} = {g}.unsqueeze(1) if isinstance({g}, torch.Tensor) and {g}.dim() == 2 else {g}")
            gate_kw = "".join(f"{g}={g}, " for g in self.gates)
            o = fresh("out", set(self.spec_names))
            L(f"{o}, state = self.forward({', '.join(self.views)}, {gate_kw}state=state, schedule=self.STEP_SCHEDULE, **unknown)")
            L(f"return {o}[:, 0], state")
        L()

    def validation(self, L):
        H = f"self.{self.attr.get('heads', 'heads')}"
        L("def _check_inputs(self, views, gates):")
        with L.indent():
            L('"""' + "Views [B, T, H, D] and gates [B, T, H]: shapes, dtypes and devices agree; returns (B, T)." + '"""')
            L("ref = None")
            L("B = T = None")
            L("for name, t in views.items():")
            L("    dim = self.VIEWS[name]")
            L(f"    _check(name, t, [\"B\", \"T\", \"H\", dim], [B, T, {H}, getattr(self, dim)], ref)")
            L("    B, T = t.shape[0], t.shape[1]")
            L("    ref = ref or (name, t)")
            L("for name, t in gates.items():")
            L("    if t is None:")
            L(f"        raise ValueError(f\"missing gate {{name}}: expected [B, T, H] = [{{B}}, {{T}}, {{{H}}}]\")")
            L(f"    _check(name, t, [\"B\", \"T\", \"H\"], [B, T, {H}], ref)")
            L("return B, T")
        L()
        L("def _check_state(self, state, B, like):")
        with L.indent():
            L('"""' + "The state dict (default: init_state): every entry [B, H, ...] of the views' dtype." + '"""')
            L("if state is None:")
            L("    return self.init_state(B, device=like.device, dtype=like.dtype)")
            L("if not isinstance(state, dict):")
            L("    raise ValueError(f\"state: expected a dict of tensors {{name: [B, H, ...]}}, got {type(state).__name__}\")")
            L("extra = [k for k in state if k not in self.STATE and not str(k).startswith(\"minibatch.\")]")
            L("missing = [k for k in self.STATE if k not in state]")
            L("if extra or missing:")
            L("    raise ValueError(f\"state: expected the entries {', '.join(self.STATE)}\"")
            L("                     + (f\"; missing {', '.join(missing)}\" if missing else \"\")")
            L("                     + (f\"; unknown {', '.join(map(str, extra))}\" if extra else \"\"))")
            L("for name, shape in self.STATE.items():")
            L("    cache = [\"n\"] if name in self.CACHES else []")
            L("    sizes = [None] if cache else []")
            L("    _check(f\"state[{name!r}]\", state[name], [\"B\", \"H\", *cache, *shape],")
            L(f"           [B, {H}, *sizes, *(getattr(self, d) for d in shape)], (\"the views\", like))")
            L("return state")
        L()

    # ------------------------------------------------------------ model and loss
    def model_method(self, L):
        spec = self.spec
        m = spec.model
        states = spec.model_states()
        arg = self._model_arg_shape()
        em = self.emitter().with_scope(**{m.arg: arg})
        out = tuple(self.env.model_output(arg) or ())
        L(f"def {self.attr[m.name]}(self, {m.arg}, {', '.join(states)}):")
        with L.indent():
            L('"""' + f"The inner model {m}: {m.arg} [..., H, {_fmt_dims(arg)}] -> [..., H{''.join(', ' + x for x in out)}]")
            L("with the state " + ", ".join(f"{s} [..., H, {_fmt_dims(spec.state[s].shape)}]" for s in states) + ".")
            L('"""')
            L(f"return {em.emit(m.body)}")
        L()

    def loss_method(self, L):
        spec = self.spec
        inputs = self._loss_inputs()
        em = self.emitter()
        self.loss_args = self.loss_states + inputs
        L(f"def inner_loss(self, {', '.join(self.loss_args)}):")
        with L.indent():
            L('"""' + f"The inner loss {unparse(spec.loss)}, summed over batch and heads: one token's")
            L("[B, H, ...] tensors -> a scalar.  Each (b, h) term depends only on its own state, so the")
            L("gradient of the sum is every (b, h)'s own gradient.")
            L('"""')
            code = em._emit(spec.loss)
            L(f"return {code.at(P_ATOM)}.sum()")
        L()

    def _loss_inputs(self) -> list:
        spec = self.spec
        used = {n.id for n in spec.loss.walk() if isinstance(n, Name)}
        if spec.model is not None:
            used |= {n.id for n in spec.model.body.walk() if isinstance(n, Name)} - {spec.model.arg}
        return [n for n in self.views + self.gates + list(spec.let) if n in used]

    # ------------------------------------------------------------ grads
    def _grad_target(self, c: Call) -> str:
        if len(c.args) == 2:
            return c.args[1].id
        return self.spec.model_states()[0]

    def _grad_groups(self) -> list:
        """For each update statement, the grad calls to compute just before it: those it needs
        that are not yet known at the current state values, jointly with every later grad
        that sees the same values (up to and including the first statement that writes a
        state the loss reads)."""
        stmts = self.spec.update

        def calls(stmt):
            return [c for c in stmt.value.walk() if isinstance(c, Call) and c.fn == "grad"]

        groups: list = [[] for _ in stmts]
        known: set = set()
        for i, stmt in enumerate(stmts):
            if any(unparse(c) not in known for c in calls(stmt)):
                group: dict = {}
                for j in range(i, len(stmts)):
                    for c in calls(stmts[j]):
                        group.setdefault(unparse(c), c)
                    if stmts[j].target in self.loss_states:
                        break
                groups[i] = list(group.values())
                known = set(group)
            if stmt.target in self.loss_states:
                known = set()
        return groups

    def _grad_call_line(self, L, group, taken: set, where: str) -> dict:
        """Emit `grad_W1, grad_W2 = torch.func.grad(self.inner_loss, argnums=...)(...)`;
        returns ``unparse(call) -> local``."""
        targets = []
        for c in group:
            t = self._grad_target(c)
            if t not in targets:
                targets.append(t)
        argnums = tuple(self.loss_args.index(t) for t in targets)
        outs = {t: fresh(f"grad_{t}", taken) for t in targets}
        lhs = ", ".join(outs[t] for t in targets) + ("," if len(targets) == 1 else "")
        an = f"({argnums[0]},)" if len(argnums) == 1 else repr(argnums)
        L(f"{lhs} = torch.func.grad(self.inner_loss, argnums={an})({', '.join(self.loss_args)})", where)
        return {unparse(c): outs[self._grad_target(c)] for c in group}

    # ------------------------------------------------------------ online
    def online(self, L):
        taken = set(self.spec_names)
        sv = self.views + self.gates
        L(f"def _forward_online(self, {', '.join(sv + ['state'])}):")
        with L.indent():
            L('"""' + "Token by token: the per-token step (compiled once when compile=True) in a Python loop." + '"""')
            L(f"{', '.join(self.states)} = {', '.join(f'state[{s!r}]' for s in self.states)}")
            outs = fresh("outputs", taken)
            t = fresh("t", taken)
            o_t = fresh("o_t", taken)
            L(f"{outs} = []")
            L(f"for {t} in range({self.first}.shape[1]):")
            with L.indent():
                args = self.states + [f"{x}[:, {t}]" for x in sv]
                L(f"{o_t}, {self._tuple(self.states)} = self._token_fn({', '.join(args)})")
                L(f"{outs}.append({o_t})")
            L(f"return torch.stack({outs}, dim=1), {{{', '.join(f'{s!r}: {s}' for s in self.states)}}}")
        L()
        self.token_step(L)

    def token_step(self, L):
        spec = self.spec
        taken = set(self.spec_names)
        L(f"def _token_step(self, {', '.join(self.states + self.views + self.gates)}):")
        with L.indent():
            L('"""' + "One token: " + ", ".join(f"{v} [B, H, {spec.views[v].dim}]" for v in self.views)
              + "".join(f", {g} [B, H]" for g in self.gates) + ";")
            L("the state tensors [B, H, ...] -> (o " + _shape_text("B, H", self.read_shape())
              + ", the new state tensors).")
            L('"""')
            em = self.emitter()
            self._lets(L, em, "B, H")
            o = "o"
            if spec.order == "read_write":
                L(f"{o} = {em.emit(spec.read)}", _shape_text("B, H", self.read_shape()) + " (read before the write)")
            self._updates(L, em, taken, "at the current state")
            if spec.order == "write_read":
                L(f"{o} = {em.emit(spec.read)}", _shape_text("B, H", self.read_shape()))
            L(f"return {o}, {self._tuple(self.states)}")
        L()

    @staticmethod
    def _tuple(names) -> str:
        return f"({', '.join(names)}{',' if len(names) == 1 else ''})"

    def _updates(self, L, em, taken, where, keep=None, stop=None) -> list:
        """Emit the update statements [0, stop) in order, each preceded by the gradients it
        needs (computed jointly at the same state values).  Assignments only for the
        statement indices in ``keep`` (None: all).  Returns, per statement, the map
        ``unparse(grad call) -> local`` in effect at that statement."""
        spec = self.spec
        groups = self._grad_groups() if self._has_grads() else [[] for _ in spec.update]
        maps = []
        for i, (stmt, group) in enumerate(zip(spec.update, groups)):
            if stop is not None and i >= stop:
                break
            if group:
                em.grads.update(self._grad_call_line(L, group, taken, where))
            maps.append(dict(em.grads))
            if keep is not None and i not in keep:
                continue
            st = spec.state.get(stmt.target)
            v = stmt.value
            if st is None:   # a per-token temporary: a local variable of this token
                L(f"{stmt.target} = {em.emit(v)}",
                  _shape_text("B, H", self.env.names.get(stmt.target) or ()) + ": a temporary of this token")
                continue
            if isinstance(v, Call) and v.fn == "append":
                self.helpers.add("append")
                item = em.emit(v.args[1])
                win = f", {st.window}" if st.window else ""
                L(f"{stmt.target} = append({stmt.target}, {item}{win})",
                  _shape_text("B, H", ("n",) + tuple(st.shape)))
                continue
            code = em._emit(v)
            text = code.text
            if code.number:
                text = f"({text}) * torch.ones_like({stmt.target})"
            elif code.rank < len(st.shape):
                text = f"{em._lift(code, len(st.shape))}.expand_as({stmt.target})"
            L(f"{stmt.target} = {text}", _shape_text("B, H", st.shape))
        return maps

    def _shadow_plan(self):
        """For the mini-batch gradients: (statements to replay, states they start from, last).

        In a chunk, token i's statements are replayed on the chunk-start state (the shadow)
        and each grad(...) is taken there, i.e. at the chunk-start values carried through
        the token's own earlier statements (memspec.reference's rule; C = 1 is online)."""
        spec = self.spec
        last = max(i for i, st in enumerate(spec.update)
                   if any(isinstance(c, Call) and c.fn == "grad" for c in st.value.walk()))
        needed = set(self.loss_states)
        keep = set()
        temps = {st.target for st in spec.update if st.target not in spec.state}
        for j in range(last - 1, -1, -1):
            stmt = spec.update[j]
            if stmt.target in needed:
                keep.add(j)
                needed |= {n.id for n in stmt.value.walk() if isinstance(n, Name)
                           and (n.id in spec.state or n.id in temps)}
        starts = [s for s in self.states if s in needed]
        return keep, starts, last

    def _lets(self, L, em, prefix):
        for n in self._let_order():
            L(f"{n} = {em.emit(self.spec.let[n])}", _shape_text(prefix, self.shape(Name(n))))

    # ------------------------------------------------------------ mini-batch
    def minibatch(self, L):
        taken = set(self.spec_names)
        sv = self.views + self.gates
        starts = {s: fresh(f"{s}_start", taken) for s in self._shadow_plan()[1]}
        cur = self.states
        c = fresh("C", taken)
        t = fresh("t", taken)
        n = fresh("n", taken)
        pos = fresh("pos", taken)
        outs = fresh("outputs", taken)
        o_c = fresh("o_c", taken)
        T = fresh("T", taken)
        L(f"def _forward_minibatch(self, {', '.join(sv + ['state'])}):")
        with L.indent():
            L('"""' + "Mini-batch: chunks of `self.chunk` tokens; every gradient of a chunk at its start state.")
            L()
            L("Full chunks run the compiled chunk step; a partial chunk (at the start, continuing a chunk")
            L("begun by an earlier call, or at the end) runs it eagerly.  A call that ends inside a chunk")
            L("returns the chunk-start state and position as state['minibatch.<name>'] and")
            L("state['minibatch.pos'], so that streaming in pieces gives the same numbers as one call.")
            L('"""')
            L(f"{c}, {T} = self.chunk, {self.first}.shape[1]")
            L(f"{', '.join(cur)} = {', '.join(f'state[{s!r}]' for s in cur)}")
            L(f"{pos} = int(state[\"minibatch.pos\"]) if \"minibatch.pos\" in state else 0")
            if starts:
                L(f"{', '.join(starts.values())} = "
                  f"{', '.join(f'state.get({chr(34)}minibatch.{s}{chr(34)}, {s})' for s in starts)}")
            L(f"{outs} = []")
            L(f"{t} = 0")
            L(f"while {t} < {T}:")
            with L.indent():
                L(f"if {pos} == 0:")
                if starts:
                    L(f"    {', '.join(starts.values())} = {', '.join(starts)}", "a new chunk starts here")
                else:
                    L("    pass")
                L(f"{n} = min({c} - {pos}, {T} - {t})")
                L(f"fn = self._chunk_fn if {n} == {c} else self._chunk_step", "static shapes: one compiled chunk size")
                args = list(starts.values()) + cur + [f"{x}[:, {t}:{t} + {n}]" for x in sv]
                L(f"{o_c}, {self._tuple(cur)} = fn({', '.join(args)})")
                L(f"{outs}.append({o_c})")
                L(f"{t}, {pos} = {t} + {n}, ({pos} + {n}) % {c}")
            L(f"state = {{{', '.join(f'{s!r}: {s}' for s in cur)}}}")
            L(f"if {pos}:")
            with L.indent():
                L(f"state[\"minibatch.pos\"] = torch.tensor({pos})")
                for s, v in starts.items():
                    L(f"state[\"minibatch.{s}\"] = {v}")
            L(f"return torch.cat({outs}, dim=1), state")
        L()
        if self.dual is not None:
            from .dual import write_dual
            write_dual(self, self.dual, L)
            return
        self.shadow_grads(L)
        self.chunk_step(L)

    def shadow_grads(self, L):
        """The method that computes one token's gradients from the chunk-start state."""
        spec = self.spec
        keep, starts, last = self._shadow_plan()
        taken = set(self.spec_names)
        used = set(self.loss_args)
        for j in range(last + 1):
            used |= {n.id for n in spec.update[j].value.walk() if isinstance(n, Name)}
        inputs = [n for n in self.views + self.gates + self._let_order() if n in used]
        self.shadow_inputs = inputs
        self.shadow_starts = starts
        L(f"def _token_grads(self, {', '.join(starts + inputs)}):")
        with L.indent():
            L('"""' + "One token's gradients for the mini-batch schedule: its update statements replayed on")
            L("the chunk-start state (" + ", ".join(starts) + " [B, H, ...]); each grad(...) taken there.")
            L('"""')
            em = self.emitter()
            maps = self._updates(L, em, taken, "at the chunk-start state (carried through this token)",
                                 keep=keep, stop=last + 1)
            self.grad_locals = []
            for mp in maps:
                for key, local in mp.items():
                    if local not in self.grad_locals:
                        self.grad_locals.append(local)
            self.grad_maps = maps
            L(f"return {self._tuple(self.grad_locals)}")
        L()

    def chunk_step(self, L):
        spec = self.spec
        taken = set(self.spec_names)
        starts = {s: fresh(f"{s}_start", taken) for s in self.shadow_starts}
        L(f"def _chunk_step(self, {', '.join(list(starts.values()) + self.states + self.views + self.gates)}):")
        with L.indent():
            L('"""' + "One mini-batch chunk of C tokens: " + ", ".join(f"{v} [B, C, H, {spec.views[v].dim}]" for v in self.views)
              + "".join(f", {g} [B, C, H]" for g in self.gates) + ";")
            if starts:
                L(", ".join(starts.values()) + ": the chunk-start state the gradients are taken at;")
            L(", ".join(self.states) + ": the state before the chunk's first token [B, H, ...].")
            L("Returns (o " + _shape_text("B, C, H", self.read_shape()) + ", the state after the chunk).")
            L('"""')
            em = self.emitter()
            self._lets(L, em, "B, C, H")
            # every token's gradients at once: vmap over the chunk's tokens
            locals_ = [fresh(g, taken) for g in self.grad_locals]
            ren = dict(zip(self.grad_locals, locals_))
            in_dims = ["None"] * len(starts) + ["1"] * len(self.shadow_inputs)
            in_dims_txt = f"({', '.join(in_dims)}{',' if len(in_dims) == 1 else ''})"
            L(f"{', '.join(locals_)}{',' if len(locals_) == 1 else ''} = torch.func.vmap(self._token_grads, "
              f"in_dims={in_dims_txt}, out_dims=1)({', '.join(list(starts.values()) + self.shadow_inputs)})",
              "[B, C, H, ...]: every token's gradients")
            # statement values with each grad(...) replaced by its per-token value
            values, scope = [], {}
            for i, stmt in enumerate(spec.update):
                mp = self.grad_maps[i] if i < len(self.grad_maps) else {}
                values.append(_replace_calls(stmt.value, {k: Name(ren[v]) for k, v in mp.items()}))
                for k, v in mp.items():
                    scope[ren[v]] = self.shape(_parse_call(k))
            rec = minibatch_recurrence(spec, values, scope)
            # the recurrences in solve order
            seq = {s: fresh(f"{s}_seq", taken) for s in self.states}
            prev: dict = {}
            for s in rec.order:
                coeffs = rec.coeff[s]
                shape = tuple(spec.state[s].shape)
                terms = rec.rest[s]
                sc = dict(scope)
                names = {}
                for (when, r), cf in coeffs.items():
                    if when == "prev" and r == s:
                        continue
                    if when == "prev" and r not in prev:
                        prev[r] = fresh(f"{r}_before", taken)
                        L(f"{prev[r]} = torch.cat([{r}.unsqueeze(1), {seq[r]}[:, :-1]], dim=1)",
                          _shape_text("B, C, H", spec.state[r].shape) + f": {r} before each token")
                    ph = f"{r}__{when}"
                    sc[ph] = tuple(spec.state[r].shape)
                    names[ph] = prev[r] if when == "prev" else seq[r]
                    terms = _add(terms, _mul(cf, Name(ph)))
                sub = ExprEmitter(spec, names=names, like=self.first, attr=self.attr,
                                  helpers=self.helpers, scope=sc)
                decay = coeffs.get(("prev", s))
                if terms is None:
                    x = f"torch.zeros_like({s}).unsqueeze(1).expand(-1, {self.first}.shape[1], *{s}.shape[1:])"
                else:
                    xc = sub._emit(terms)
                    if xc.number:
                        x = f"({xc.text}) * torch.ones_like({s}.unsqueeze(1))"
                    elif xc.rank < len(shape):
                        x = f"{sub._lift(xc, len(shape))} * torch.ones_like({s}.unsqueeze(1))"
                    else:
                        x = xc.text
                comment = _shape_text("B, C, H", shape)
                if decay is None:
                    L(f"{seq[s]} = {x}", comment)
                elif _is_num(decay, 1):
                    xs = x if x.isidentifier() else f"({x})"
                    L(f"{seq[s]} = {s}.unsqueeze(1) + {xs}.cumsum(1)", comment + f": {s}_i = {s}_(i-1) + ...")
                else:
                    for part in (_DECAY_MATRIX, _LINEAR_SCAN):
                        if part not in self.module_parts:
                            self.module_parts.append(part)
                    a = sub._emit(decay)
                    L(f"{seq[s]} = _linear_scan({a.text}, {x}, {s})",
                      comment + f": {s}_i = ({unparse(decay)}) {s}_(i-1) + ...")
            # the read of every token with its own state
            if spec.order == "write_read":
                names = {s: seq[s] for s in self.states}
            else:
                for r in self.states:
                    if r not in prev:
                        prev[r] = fresh(f"{r}_before", taken)
                        L(f"{prev[r]} = torch.cat([{r}.unsqueeze(1), {seq[r]}[:, :-1]], dim=1)",
                          _shape_text("B, C, H", spec.state[r].shape))
                names = {s: prev[s] for s in self.states}
            rd = ExprEmitter(spec, names=names, like=self.first, attr=self.attr, helpers=self.helpers)
            L(f"o = {rd.emit(spec.read)}", _shape_text("B, C, H", self.read_shape()) + ": each token reads its own state")
            L(f"return o, {self._tuple([seq[s] + '[:, -1]' for s in self.states])}")
        L()

    # ------------------------------------------------------------ cache
    def cache_forward(self, L):
        spec = self.spec
        taken = set(self.spec_names)
        sv = self.views + self.gates
        L(f"def _forward_cache(self, {', '.join(sv + ['state'])}):")
        with L.indent():
            L('"""' + "Softmax attention over [cached | new] keys and values at once: scaled_dot_product_attention")
            L("with a causal (windowed) mask; the new state is the cache trimmed to its window." + '"""')
            em = self.emitter()
            self._lets(L, em, "B, T, H")
            T = fresh("T", taken)
            L(f"{T} = {self.first}.shape[1]")
            full = {}
            for s, item in self.cache:
                st = spec.state[s]
                full[s] = fresh(f"{s}_all", taken)
                L(f"{full[s]} = torch.cat([state[{s!r}], {em._emit(item).at(P_ATOM)}.transpose(1, 2)], dim=2)",
                  f"[B, H, n + T, {_fmt_dims(st.shape)}]")
            pre = {}
            for c in spec.read.walk():
                if isinstance(c, Call) and c.fn == "attend" and unparse(c) not in pre:
                    q, K, V, scale = c.args
                    win = spec.state[K.id].window
                    mask = fresh("mask", taken)
                    L(f"{mask} = _causal_mask({T}, {full[K.id]}.shape[2], {win}, {self.first}.device)", "[T, n + T]")
                    name = fresh("attended", taken)
                    sc = em._emit(scale)
                    if sc.number:
                        query, sdpa_scale = em._emit(q).at(P_ATOM), sc.text
                    else:                              # softmax(s K q) = softmax(K (s q)): s into the query
                        query, sdpa_scale = f"({em._emit(q).at(P_MUL)} * {sc.at(P_ATOM)}.unsqueeze(-1))", "1.0"
                    L(f"{name} = F.scaled_dot_product_attention({query}.transpose(1, 2), {full[K.id]}, "
                      f"{full[V.id]}, attn_mask={mask}, scale={sdpa_scale}).transpose(1, 2)",
                      _shape_text("B, T, H", self.shape(c)))
                    pre[unparse(c)] = name
            if _CAUSAL_MASK not in self.module_parts:
                self.module_parts.append(_CAUSAL_MASK)
            rd = ExprEmitter(spec, grads=pre, like=self.first, attr=self.attr, helpers=self.helpers)
            rd.precomputed = pre
            L(f"o = {rd.emit(spec.read)}", _shape_text("B, T, H", self.read_shape()))
            items = []
            for s, st in spec.state.items():
                trim = f"[:, :, -{st.window}:]" if st.window else ""
                items.append(f"{s!r}: {full[s]}{trim}")
            L(f"return o, {{{', '.join(items)}}}")
        L()

    # ------------------------------------------------------------ exact chunked families
    def chunked_forward(self, L):
        from . import chunked as codegen_chunked

        spec = self.spec
        sv = self.views + self.gates
        L(f"def _forward_chunk(self, {', '.join(sv + ['state'])}):")
        with L.indent():
            L('"""' + f"The exact {self.chunked} chunked form over chunks of self.chunk tokens." + '"""')
            em = self.emitter()
            self._lets(L, em, "B, T, H")
            for line in codegen_chunked.emit_chunked_forward(spec, self.decision, em, lets=False,
                                                             taken=tuple(sorted(self.spec_names))):
                L.block(line)
        L()
        src = codegen_chunked.kernel_sources(self.decision)
        if src and src not in self.module_parts:
            self.module_parts.append(src)

    # ------------------------------------------------------------ Layer
    def layer_class(self, L):
        spec = self.spec
        n = self.name
        rshape = self.read_shape()
        wired = spec.wiring.kind != "none"
        L(f"class {n}{'MemoryLayer' if wired else 'Layer'}(nn.Module):")
        with L.indent():
            L('"""' + f"x [B, T, d_model] -> projections into views (and gates) -> {n}Memory -> output projection.")
            L()
            for v in self.views:
                L(f"{v} = {v}_proj(x) viewed [B, T, H, {spec.views[v].dim}]")
            for g, gate in spec.gates.items():
                L(f"{g} = {unparse(gate.formula)} with logit = {g}_proj(x) [B, T, H] (bias init {gate.bias!r})")
            if wired:
                L(f"(The bare memory layer: {n}Layer wraps it in the spec's wiring, {spec.wiring.kind}.)")
            L('"""')
            L()
            sig = self._dims_signature()
            if "d_model" not in spec.dims:
                sig.insert(0, "d_model=64")
            L(f"def __init__(self, *, {', '.join(sig)}, chunk={self.default_chunk}, compile=False):")
            with L.indent():
                L("super().__init__()")
                L("self.d_model = d_model")
                L("self.heads = heads")
                for v in self.views:
                    L(f"self.{v}_proj = nn.Linear(d_model, heads * {spec.views[v].dim}, bias=False)")
                for g, gate in spec.gates.items():
                    L(f"self.{g}_proj = nn.Linear(d_model, heads)")
                    L(f"nn.init.constant_(self.{g}_proj.bias, {float(gate.bias)!r})")
                dims = [d for d in spec.dims]
                kw = ", ".join(([] if "heads" in spec.dims else ["heads=heads"]) + [f"{d}={d}" for d in dims])
                L(f"self.memory = {n}Memory({kw}, chunk=chunk, compile=compile)")
                out = " * ".join(["heads", *rshape]) if rshape else "heads"
                L(f"self.o_proj = nn.Linear({out}, d_model, bias=False)")
            L()
            L("def forward(self, x, state=None, return_state=False):")
            with L.indent():
                L('"""' + "x [B, T, d_model] -> y [B, T, d_model] (and the memory's final state if return_state)." + '"""')
                taken = set(self.spec_names)
                B, T = fresh("B", taken), fresh("T", taken)
                mem = "self.memory"
                self._layer_views(L, self.views, B, T)
                for g, gate in spec.gates.items():
                    em = ExprEmitter(spec, names={"logit": "logit"}, like=self.first, attr=self.attr,
                                     helpers=self.helpers, self_name=mem, scope={"logit": ()})
                    L(f"logit = self.{g}_proj(x)", "[B, T, H]")
                    L(f"{g} = {em.emit(gate.formula)}", "[B, T, H]")
                kw = "".join(f"{g}={g}, " for g in self.gates)
                L(f"o, state = self.memory({', '.join(self.views)}, {kw}state=state)",
                  _shape_text("B, T, H", rshape))
                L(f"y = self.o_proj(o.reshape({B}, {T}, -1))", "[B, T, d_model]")
                L("return (y, state) if return_state else y")
            rviews = self.read_views()
            if rviews is not None:
                L()
                L("def read(self, x, state=None):")
                with L.indent():
                    L('"""' + "x [B, T, d_model] -> y [B, T, d_model]: the memory read at a fixed state "
                      "(default: the initial one), with no write." + '"""')
                    self._layer_views(L, rviews, B, T)
                    L(f"o = self.memory.read({', '.join(rviews)}, state=state)", _shape_text("B, T, H", rshape))
                    L(f"return self.o_proj(o.reshape({B}, {T}, -1))", "[B, T, d_model]")
        if wired:
            L()
            L()
            self.wired_layer_class(L)

    def _layer_views(self, L, views, B, T):
        """The Layer's check of x [B, T, d_model] and its projections into ``views``."""
        spec = self.spec
        L("if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != self.d_model:")
        L("    got = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__")
        L("    raise ValueError(f\"x: expected [B, T, d_model] = [B, T, {self.d_model}], got {got}\")")
        L(f"{B}, {T}, _ = x.shape")
        for v in views:
            dim = spec.views[v].dim
            L(f"{v} = self.{v}_proj(x).view({B}, {T}, self.heads, self.memory.{self.attr.get(dim, dim)})",
              f"[B, T, H, {dim}]")

    def wired_layer_class(self, L):
        """``<Name>Layer``: the wiring class of the spec around ``<Name>MemoryLayer``."""
        spec, n, w = self.spec, self.name, self.spec.wiring
        base = w.kind.upper()
        sig = self._dims_signature()
        if "d_model" not in spec.dims:
            sig.insert(0, "d_model=64")
        inner = ", ".join(p.split("=")[0] + "=" + p.split("=")[0] for p in sig)
        extent = f"segment={w.segment}" if w.kind == "mac" else f"window={w.window}"
        L(f"class {n}Layer({base}):")
        with L.indent():
            L('"""' + f"x [B, T, d_model] -> y [B, T, d_model]: {base} around {n}MemoryLayer.")
            L()
            for line in f"{wiring_text(w)}.".split("\n"):
                L(line)
            L()
            L(f"{n}MemoryLayer (projections, {n}Memory, output projection) is ``self.layer``;")
            L(f"``self.memory`` is its {n}Memory.  Attention: ``attn_heads`` heads (default: ``heads``")
            L(f"when it divides d_model, else 1) and {w.persistent} persistent tokens.")
            L("forward(x, state=None, return_state=False); the state carries the memory's state and")
            L("the attention's keys/values (see the wiring class above).")
            L('"""')
            L()
            opts = w.options()
            L(f"def __init__(self, *, {', '.join(sig)}, chunk={self.default_chunk}, compile=False,")
            L(f"             {extent}, persistent={w.persistent}, attn_heads=None,")
            L(f"             {', '.join(f'{k}={_py_literal(v)}' for k, v in opts.items())}):")
            with L.indent():
                L(f"layer = {n}MemoryLayer({inner}, chunk=chunk, compile=compile)")
                L("if attn_heads is None:")
                L("    attn_heads = heads if d_model % heads == 0 else 1")
                L(f"super().__init__(layer, d_model, {extent.split('=')[0]}={extent.split('=')[0]}, "
                  "persistent=persistent, heads=attn_heads,")
                L(f"                 {', '.join(f'{k}={k}' for k in opts)})")
                L("self.d_model = d_model")
                L("self.heads = heads")
            L()
            L("@property")
            L("def memory(self):")
            with L.indent():
                L('"""' + f"The {n}Memory module (inside the memory layer)." + '"""')
                L("return self.layer.memory")


def _py_literal(v) -> str:
    """A wiring option as Python source: ``True`` / ``False``, an int, or a double-quoted name
    (the options are validated names; json.dumps escapes whatever it is given)."""
    import json

    return repr(v) if isinstance(v, (bool, int)) else json.dumps(str(v))


def wiring_text(w) -> str:
    """What the spec's wiring computes, in words (lines for the generated docstrings)."""
    att = ("attention on l2-normalised queries and keys with a learned temperature" if w.qk_norm
           else "plain scaled dot-product attention")
    if w.kind == "mac":
        wrote = "the attention output y" if w.write == "attention" else "the segment input x"
        read = "memory(y)" if w.write == "attention" else "memory(x)"
        out = f"y * sigmoid({read})" if w.output == "gated" else f"y + {read}"
        return ("MAC, memory as context: per segment, retrieve, attend over [persistent | retrieved | segment],\n"
                f"write {wrote} into the memory, output {out}; {att}")
    if w.kind == "mag":
        mix = ("RMSNorm(attention) * sigmoid(RMSNorm(memory))" if w.gate == "normalized"
               else "g * attention + (1 - g) * memory with a learned gate g")
        return f"MAG, memory as gate: sliding-window attention and the memory on the same input,\nmixed as {mix}; {att}"
    form = "memory(x) + attention(memory(x))" if w.residual else "attention(memory(x))"
    return f"MAL, memory as layer: the memory layer, then sliding-window attention,\n{form}; {att}"


def generate(spec, decision=None, *, source_path=None, source_text=None) -> str:
    """The full text of ``compiled/<spec.name>.py`` (deterministic).

    ``decision`` is a :class:`~memspec.schedule.ScheduleDecision` (from
    ``memspec.schedule.analyse``); ``source_path`` (as written in the header) and
    ``source_text`` (hashed into the header) describe the spec file.
    """
    return ModuleWriter(spec, decision, source_path=source_path, source_text=source_text).generate()
