"""The reference interpreter: run a spec token by token with PyTorch.

This is the numerical oracle every compiled schedule is tested against, so it
favours clarity over speed: it walks the spec's expression AST directly, one token
at a time, with exactly the semantics of ``docs/language.md`` ("Semantics of one
token").  It never looks at the graph or shape modules; shapes are read off the
tensors as they flow.

Layout (shared by every phase)::

    views   [B, T, H, D]       one tensor per view, D = the view's dim
    gates   [B, T, H]          already computed gate values (not logits); [B, T, H, d] per channel
    state   [B, H, *shape]     a cache state is [B, H, n, *shape] (n grows)
    params  [H, *shape]        learned outer-loop tensors (and learned initial states)
    output  [B, T, H, *read_shape]

Inside the interpreter every value carries the leading ``[B, H]`` axes (numbers
are ``[1, 1]`` tensors, params ``[1, H, ...]``), so the *named* part of a value is
``tensor.shape[2:]`` and elementwise operators broadcast numpy-style on those
trailing named axes.

``grad(loss, W)`` is ``torch.autograd.grad`` with ``create_graph=True`` at the
current values of all states (under ``("minibatch", C)``: at the chunk-start
values, carried through the token's own earlier statements; see :func:`_step`),
inside ``torch.enable_grad()`` so that it also works under ``torch.no_grad()``.
The result stays differentiable for the outer loop: gradients flow into views,
gates, params and learned initial states.

Public API: :func:`run`, :func:`init_state`, :func:`apply_model`.

Size: one interpreter for the whole language -- the token semantics of every construct
(``eval_*``, ``fn_*``) side by side, which the tests pin together; split by construct it
would scatter the one definition of the language's meaning.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
import torch.nn.functional as F

from .lang.blocks import block_statements, frequencies
from .lang.errors import Collector, did_you_mean
from .lang.expr import Assign, BinOp, Call, Expr, Name, Neg, Num, Transpose, is_diag, unparse
from .lang.shapes import ShapeEnv
from .lang.spec import Spec, parse_init

LAYERNORM_EPS = 1e-5   # layernorm(x[, w, b]): over the last axis
NORM_EPS = 1e-6        # rmsnorm / l2norm: inside the square root
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)   # newton_schulz: Muon's quintic iteration
NS_EPS = 1e-7          # newton_schulz: X / (|X|_F + NS_EPS)

__all__ = ["run", "init_state", "apply_model", "document_bounds", "newton_schulz", "LAYERNORM_EPS", "NORM_EPS",
           "NS_COEFFICIENTS", "NS_EPS"]


def newton_schulz(X: torch.Tensor, steps) -> torch.Tensor:
    """The quintic Newton-Schulz iteration of Muon on the last two axes of ``X``:
    ``X_0 = X / (|X|_F + 1e-7)``, then ``steps`` times ``A = X X^T``,
    ``X <- a X + (b A + c A A) X`` with ``(a, b, c) = (3.4445, -4.7750, 2.0315)``; or, with
    ``steps`` a coefficient schedule (a tuple of ``(a, b, c)`` triples), one step per triple.

    On ``X = U S V^T`` it maps each singular value ``s`` (of ``X_0``) through
    ``p(s) = a s + b s^3 + c s^5`` ``steps`` times and keeps ``U`` and ``V``: an approximate
    orthogonalisation ``~ U V^T`` (the singular values end up near 1, not at 1).

    A tall ``X`` (more rows than columns) is iterated as ``X^T`` and transposed back: the same
    map (``X X^T X = X (X^T X)``), on the smaller Gram matrix, as the compiled helper does --
    the iteration multiplies tiny singular values by up to 3.4 a step, so the two must
    round alike to agree in float32."""
    schedule = steps if isinstance(steps, tuple) else (NS_COEFFICIENTS,) * steps
    tall = X.shape[-2] > X.shape[-1]
    if tall:
        X = X.transpose(-1, -2)
    X = X / (torch.linalg.matrix_norm(X, keepdim=True) + NS_EPS)
    for a, b, c in schedule:
        A = X @ X.transpose(-1, -2)
        X = a * X + (b * A + c * (A @ A)) @ X
    return X.transpose(-1, -2) if tall else X


# ===================================================================== shapes
def _with_dims(spec: Spec, dims: dict[str, int] | None) -> Spec:
    return spec.with_dims(**dims) if dims else spec


def _dim_size(spec: Spec, name: str) -> int:
    if name.isdigit():
        return int(name)
    if name not in spec.dims:
        hint = did_you_mean(name, spec.dims)
        raise ValueError(f"unknown dim {name!r}" + (f"; {hint}" if hint else "")
                         + f" (this spec has dims {sorted(spec.dims)})")
    return spec.dims[name]


def _sizes(spec: Spec, shape: list[str]) -> tuple[int, ...]:
    return tuple(_dim_size(spec, d) for d in shape)


def _notation(names: list[str]) -> str:
    return "[" + ", ".join(names) + "]"


def _expected(names: list[str], sizes: list[int | str]) -> str:
    """``[B, T, H, d_k] = [2, 5, 1, 4]``."""
    return f"{_notation(names)} = {_notation([str(s) for s in sizes])}"


def _named(x: torch.Tensor) -> tuple[int, ...]:
    """The named part of a value's shape (everything after ``[B, H]``)."""
    return tuple(x.shape[2:])


# ====================================================================== inits
def _init_tensor(init: Any, shape: tuple[int, ...], lead: tuple[int, ...], *, what: str,
                 dtype, device, generator=None, allow_random: bool = True) -> torch.Tensor:
    """A tensor ``[*lead, *shape]`` from an init (number, zeros, ones, eye, normal(std))."""
    if isinstance(init, (int, float)) and not isinstance(init, bool):
        return torch.full((*lead, *shape), float(init), dtype=dtype, device=device)
    d = parse_init(init)
    kind = d["kind"]
    if kind == "zeros":
        return torch.zeros((*lead, *shape), dtype=dtype, device=device)
    if kind == "ones":
        return torch.ones((*lead, *shape), dtype=dtype, device=device)
    if kind == "eye":
        if len(shape) != 2 or shape[0] != shape[1]:
            raise ValueError(f"{what}: init eye needs a square shape [d, d], got {list(shape)}")
        return torch.eye(shape[0], dtype=dtype, device=device).expand(*lead, *shape).clone()
    if not allow_random:
        raise ValueError(
            f"{what} has a random init ({init}); pass its value explicitly "
            f"(params={{'{what.split()[-1]}': tensor}})"
        )
    if kind == "uniform":
        out = torch.rand((*lead, *shape), dtype=dtype, device=device, generator=generator)
        return d["lo"] + (d["hi"] - d["lo"]) * out
    out = torch.randn((*lead, *shape), dtype=dtype, device=device, generator=generator)
    return out * d["std"]


def _params(spec: Spec, given: dict | None, heads: int, dtype, device) -> dict[str, torch.Tensor]:
    """Learned params ``[H, *shape]`` (given, or their deterministic init), checked."""
    given = dict(given or {})
    learned_states = {n for n, s in spec.state.items() if s.learned}
    extra = set(given) - set(spec.params) - learned_states
    if extra:
        raise ValueError(
            f"unexpected params {sorted(extra)}; this spec has params {sorted(spec.params)}"
            + (f" and learned states {sorted(learned_states)}" if learned_states else "")
        )
    out: dict[str, torch.Tensor] = {}
    for name, p in spec.params.items():
        shape = _sizes(spec, p.shape)
        if name in given:
            out[name] = _check_shape(given[name], ["H", *p.shape], [heads, *shape], f"param {name!r}")
        else:
            out[name] = _init_tensor(p.init, shape, (heads,), what=f"param {name}",
                                     dtype=dtype, device=device, allow_random=False)
    for name in learned_states & set(given):
        st = spec.state[name]
        out[name] = _check_shape(given[name], ["H", *st.shape], [heads, *_sizes(spec, st.shape)],
                                 f"learned initial state {name!r}")
    return out


def _check_shape(t: Any, names: list[str], sizes: list[int], what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{what} must be a tensor {_expected(names, sizes)}, got {type(t).__name__}")
    if list(t.shape) != list(sizes):
        raise ValueError(f"{what} must be {_expected(names, sizes)}, got {list(t.shape)}")
    return t


def init_state(spec: Spec, batch: int, heads: int, *, dims: dict | None = None,
               dtype=torch.float32, device=None, params: dict | None = None,
               generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """Initial state: ``{name: [B, H, *shape]}``; a cache starts empty ``[B, H, 0, *shape]``.

    ``zeros``/``ones``/``eye``/``normal(std)``; a ``learned(...)`` state takes
    ``params[name]`` (``[H, *shape]``, broadcast over the batch) when given, else its
    inner init.  Random inits draw one ``[H, *shape]`` tensor (from ``generator``)
    shared by every sequence of the batch.
    """
    spec = _with_dims(spec, dims)
    params = params or {}
    out: dict[str, torch.Tensor] = {}
    for name, st in spec.state.items():
        shape = _sizes(spec, st.shape)
        if st.cache:
            out[name] = torch.zeros((batch, heads, 0, *shape), dtype=dtype, device=device)
        elif st.learned and name in params:
            p = _check_shape(params[name], ["H", *st.shape], [heads, *shape],
                             f"learned initial state {name!r}")
            out[name] = p.to(dtype=dtype).unsqueeze(0).expand(batch, heads, *shape)
        else:
            per_head = _init_tensor(st.init, shape, (heads,), what=f"state {name}",
                                    dtype=dtype, device=device, generator=generator)
            out[name] = per_head.unsqueeze(0).expand(batch, heads, *shape)
    return out


def _full_state(spec: Spec, given: dict | None, B: int, H: int, dtype, device,
                params: dict) -> dict[str, torch.Tensor]:
    """The given state (checked) completed by ``init_state`` for the missing entries."""
    given = dict(given or {})
    extra = set(given) - set(spec.state)
    if extra:
        raise ValueError(f"unexpected state {sorted(extra)}; this spec has state {sorted(spec.state)}")
    missing = [n for n in spec.state if n not in given]
    defaults = init_state(spec, B, H, dtype=dtype, device=device, params=params) if missing else {}
    out = {}
    for name, st in spec.state.items():
        if name not in given:
            out[name] = defaults[name]
            continue
        t = given[name]
        shape = list(_sizes(spec, st.shape))
        if st.cache:
            if not isinstance(t, torch.Tensor) or t.dim() != 3 + len(shape) \
                    or list(t.shape[:2]) != [B, H] or list(t.shape[3:]) != shape:
                got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"cache state {name!r} must be "
                                 f"{_expected(['B', 'H', 'n', *st.shape], [B, H, 'n', *shape])}, got {got}")
            out[name] = t
        else:
            out[name] = _check_shape(t, ["B", "H", *st.shape], [B, H, *shape], f"state {name!r}")
    return out


# ===================================================================== inputs
def _check_inputs(spec: Spec, inputs: dict) -> tuple[int, int, int, torch.dtype, Any]:
    """Check views ``[B, T, H, D]`` and gates ``[B, T, H, *shape]``; return B, T, H, dtype, device."""
    expected = {n: ["B", "T", "H", v.dim] for n, v in spec.views.items()}
    expected.update({n: ["B", "T", "H", *g.shape] for n, g in spec.gates.items()})
    missing = [n for n in expected if n not in inputs]
    extra = [n for n in inputs if n not in expected]
    problems = []
    if missing:
        problems.append("missing " + ", ".join(f"{n} {_notation(expected[n])}" for n in missing))
    if extra:
        hints = [did_you_mean(n, expected) for n in extra]
        problems.append("unexpected " + ", ".join(extra) + "".join(f" ({h})" for h in hints if h))
    if problems:
        gates = ", ".join(f"{n} {_notation(expected[n])}" for n in spec.gates)
        raise ValueError("; ".join(problems) + f". This spec takes views {list(spec.views)} "
                         f"[B, T, H, D]" + (f" and gates {gates}" if gates else ""))
    if not expected:
        raise ValueError("this spec has no views or gates, so B, T and H cannot be inferred")
    first = next(iter(expected))
    t0 = inputs[first]
    if not isinstance(t0, torch.Tensor) or t0.dim() < 3:
        raise ValueError(f"{first} must be a tensor {_notation(expected[first])}, got "
                         f"{list(t0.shape) if isinstance(t0, torch.Tensor) else type(t0).__name__}")
    B, T, H = t0.shape[:3]
    if not t0.is_floating_point():
        raise ValueError(f"{first} must be a floating-point tensor, got {t0.dtype}")
    if T < 1:
        raise ValueError("the sequence is empty (T = 0); run needs at least one token")
    for name, names in expected.items():
        sizes = [B, T, H] + [_dim_size(spec, d) for d in names[3:]]
        kind = "view" if name in spec.views else "gate"
        _check_shape(inputs[name], names, sizes, f"{kind} {name!r}")
    return B, T, H, t0.dtype, t0.device


def _mode(schedule: Any, spec: Spec) -> tuple[str, int | None]:
    """``("online", None)``, ``("minibatch", C)`` or ``("apply_update", C)``."""
    if schedule == "spec":
        kind = spec.schedule_kind
        if kind in ("minibatch", "apply_update"):
            return kind, spec.schedule_size
        return "online", None
    if isinstance(schedule, (tuple, list)) and len(schedule) == 2 and schedule[0] in ("minibatch", "apply_update"):
        c = schedule[1]
        if isinstance(c, bool) or not isinstance(c, int) or c < 1:
            raise ValueError(f"{schedule[0]} chunk size must be a positive integer, got {c!r}")
        return schedule[0], c
    if isinstance(schedule, str):
        s = schedule.replace(" ", "")
        if s in ("online", "auto") or re.fullmatch(r"chunk\(\d+\)", s):
            return "online", None  # chunked forms of exact schedules compute online learning
        m = re.fullmatch(r"(minibatch|apply_update)\((\d+)\)", s)
        if m and int(m.group(2)) >= 1:
            return m.group(1), int(m.group(2))
    raise ValueError(f"unknown schedule {schedule!r}: use 'online', ('minibatch', C), ('apply_update', C) "
                     f"or 'spec'")


def _frequencies(spec: Spec, mode: tuple[str, int | None]) -> dict[str, int]:
    """Each learned state's update frequency: its ``every`` (1: every token); under
    ``apply_update(C)`` every state updates once per chunk of C tokens."""
    own = frequencies(spec)
    if mode[0] != "apply_update":
        return own
    clash = {n: c for n, c in own.items() if c not in (1, mode[1])}
    if clash:
        raise ValueError(f"apply_update({mode[1]}) updates every state once per chunk, but "
                         + ", ".join(f"{n} updates every {c} tokens" for n, c in clash.items()))
    return {n: mode[1] for n in own}


def _named_axes(spec: Spec) -> tuple[dict[int, int], set[int]]:
    """From the shape rules: ``id(call) -> axis`` (a negative dim) of every ``softmax(x, d)`` and
    ``sum``/``mean``/``norm(x, d)``, and the ids of the model applications to a cache (row-wise)."""
    env = ShapeEnv.from_spec(spec)
    rec: dict = {}
    diags = Collector()
    exprs = [*spec.let.values(), spec.read] + ([spec.loss] if spec.loss is not None else [])
    for e in exprs:
        env.infer(e, record=rec, diags=diags)
    for i, st in enumerate(spec.update):
        env.infer(st.value, scope=env.temp_scope(i), record=rec, diags=diags)
        exprs.append(st.value)
    rowwise: set = set()
    model = spec.model
    if model is not None:
        arg = None
        for e in exprs:
            for c in e.walk():
                if isinstance(c, Call) and c.fn == model.name and c.args and rec.get(id(c.args[0])) is not None:
                    a = tuple(rec[id(c.args[0])])
                    if len(a) >= 2 and a[0] == env.cache_axis:
                        rowwise.add(id(c))
                        a = a[1:]
                    arg = arg if arg is not None else a
        if arg is not None:
            env.infer(model.body, scope={model.arg: arg}, record=rec, diags=diags)
            exprs.append(model.body)
    axes: dict = {}
    for e in exprs:
        for c in e.walk():
            if isinstance(c, Call) and len(c.args) == 2 and c.fn in ("softmax", "sum", "mean", "norm"):
                x, a = rec.get(id(c.args[0])), c.args[1]
                if x is not None and isinstance(a, Name) and list(x).count(a.id) == 1:
                    axes[id(c)] = list(x).index(a.id) - len(x)
    return axes, rowwise


# ================================================================ interpreter
@dataclass
class _Scope:
    """Names visible while evaluating one expression."""

    token: dict[str, torch.Tensor]             # views, gates, lets of this token
    state: dict[str, torch.Tensor]             # current state values
    grad_memo: dict[int, torch.Tensor] | None = None  # mini-batch: grads taken on the shadow
    local: dict[str, torch.Tensor] = field(default_factory=dict)  # the model's argument
    temp: dict[str, torch.Tensor] = field(default_factory=dict)   # this token's temporaries so far
    terms: dict[int, torch.Tensor] | None = None   # a block update: id(gradient term) -> its block sum


class _EvalError(ValueError):
    pass


def _where(e: Expr) -> str:
    s = e.span
    return f"{s.file}:{s.line}:{s.col}: " if s is not None else ""


def _align(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Numpy trailing alignment of the named axes (after the leading [B, H])."""
    while a.dim() < b.dim():
        a = a.unsqueeze(2)
    while b.dim() < a.dim():
        b = b.unsqueeze(2)
    return a, b


def _reduce_dims(x: torch.Tensor) -> tuple[int, ...]:
    return tuple(range(2, x.dim()))


_ELEMENTWISE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sqrt": torch.sqrt,
    "exp": torch.exp,
    "log": torch.log,
    "abs": torch.abs,
    "sign": torch.sign,
    "sigmoid": torch.sigmoid,
    "softplus": F.softplus,
    "tanh": torch.tanh,
    "relu": torch.relu,
    "gelu": lambda x: F.gelu(x, approximate="none"),   # erf form
    "silu": F.silu,
    "elu": lambda x: F.elu(x, alpha=1.0),
}


class _Interpreter:
    """Evaluates a spec's expressions on ``[B, H, ...]`` tensors."""

    def __init__(self, spec: Spec, params: dict[str, torch.Tensor], dtype, device,
                 needs_graph: bool):
        self.spec = spec
        self.dtype, self.device = dtype, device
        self.needs_graph = needs_graph
        self.params = {n: p.unsqueeze(0) for n, p in params.items() if n in spec.params}
        # (a coefficient schedule is no number: only newton_schulz reads it, from the spec)
        self.constants = {n: self.number(v) for n, v in spec.constants.items() if not isinstance(v, tuple)}
        self.dims = {n: self.number(v) for n, v in spec.dims.items()}
        self.axes, self.rowwise = _named_axes(spec)
        self.terms: dict = {}   # statement index -> its gradient terms (block updates; set by run)

    def number(self, v: float) -> torch.Tensor:
        return torch.tensor(float(v), dtype=self.dtype, device=self.device).reshape(1, 1)

    # ------------------------------------------------------------ dispatch
    def eval(self, e: Expr, scope: _Scope) -> torch.Tensor:
        if scope.terms is not None and id(e) in scope.terms:   # a gradient term's block sum
            return scope.terms[id(e)]
        method = getattr(self, "eval_" + type(e).__name__, None)
        if method is None:
            raise _EvalError(f"{_where(e)}cannot evaluate {e!r}")
        try:
            return method(e, scope)
        except (RuntimeError, IndexError) as err:
            raise _EvalError(f"{_where(e)}cannot evaluate `{unparse(e)}`: {err}") from None

    def eval_Num(self, e: Num, scope: _Scope) -> torch.Tensor:
        return self.number(e.value)

    def eval_Name(self, e: Name, scope: _Scope) -> torch.Tensor:
        n = e.id
        for table in (scope.local, scope.temp, scope.token, scope.state, self.params, self.constants, self.dims):
            if n in table:
                return table[n]
        if n == "loss" and self.spec.loss is not None:
            return self.eval(self.spec.loss, scope)
        known = [*scope.local, *scope.temp, *scope.token, *scope.state, *self.params, *self.constants, *self.dims]
        hint = did_you_mean(n, known)
        raise _EvalError(f"{_where(e)}unknown name {n!r}" + (f"; {hint}" if hint else ""))

    def eval_Neg(self, e: Neg, scope: _Scope) -> torch.Tensor:
        return -self.eval(e.operand, scope)

    def eval_Transpose(self, e: Transpose, scope: _Scope) -> torch.Tensor:
        x = self.eval(e.operand, scope)
        if len(_named(x)) != 2:
            raise _EvalError(f"{_where(e)}.T needs a matrix, got shape {list(_named(x))}")
        return x.transpose(-1, -2)

    def eval_BinOp(self, e: BinOp, scope: _Scope) -> torch.Tensor:
        if e.op == "@" and (is_diag(e.left) or is_diag(e.right)):
            return self.diag_matmul(e, scope)
        a, b = self.eval(e.left, scope), self.eval(e.right, scope)
        if e.op == "@":
            return self.matmul(a, b, e)
        a, b = _align(a, b)
        if e.op == "+":
            return a + b
        if e.op == "-":
            return a - b
        if e.op == "*":
            return a * b
        if e.op == "/":
            return a / b
        if e.op == "^":
            return torch.pow(a, b)
        raise _EvalError(f"{_where(e)}unknown operator {e.op!r}")

    def matmul(self, a: torch.Tensor, b: torch.Tensor, e: Expr) -> torch.Tensor:
        """Row-vector convention: [n]@[n,m]->[m], [m,n]@[n,p]->[m,p], [m,n]@[n]->[m], [n]@[n]->[]."""
        ra, rb = len(_named(a)), len(_named(b))
        if ra == 1 and rb == 2:
            return (a.unsqueeze(-2) @ b).squeeze(-2)
        if ra >= 2 and rb == 2:
            return a @ b
        if ra >= 2 and rb == 1:
            return (a @ b.unsqueeze(-1)).squeeze(-1)
        if ra == 1 and rb == 1:
            return (a * b).sum(-1)
        raise _EvalError(f"{_where(e)}@ needs vectors or matrices, got shapes "
                         f"{list(_named(a))} and {list(_named(b))}")

    def diag_matmul(self, e: BinOp, scope: _Scope) -> torch.Tensor:
        """``diag(a) @ X`` scales the rows of X (its first named axis) by a, ``X @ diag(b)`` its
        columns (its last named axis); the diagonal matrix is never formed."""
        left = is_diag(e.left)
        d = self.eval((e.left if left else e.right).args[0], scope)
        x = self.eval(e.right if left else e.left, scope)
        if len(_named(d)) != 1 or len(_named(x)) not in (1, 2):
            raise _EvalError(f"{_where(e)}diag needs a vector and a vector or matrix operand, got shapes "
                             f"{list(_named(d))} and {list(_named(x))}")
        if left and len(_named(x)) == 2:
            return d.unsqueeze(-1) * x
        if not left and len(_named(x)) == 2:
            return x * d.unsqueeze(-2)
        return d * x

    def eval_Call(self, e: Call, scope: _Scope) -> torch.Tensor:
        model = self.spec.model
        if model is not None and e.fn == model.name:
            if len(e.args) != 1:
                raise _EvalError(f"{_where(e)}{model.name} takes one argument")
            return self.apply_model(self.eval(e.args[0], scope), scope, rows=id(e) in self.rowwise)
        method = getattr(self, "fn_" + e.fn, None)
        if method is not None:
            return method(e, scope)
        if e.fn in _ELEMENTWISE:
            return _ELEMENTWISE[e.fn](self.eval(e.args[0], scope))
        raise _EvalError(f"{_where(e)}unknown function {e.fn!r}")

    def apply_model(self, u: torch.Tensor, scope: _Scope, rows: bool = False) -> torch.Tensor:
        """``f(u)`` with the scope's current state; ``rows``: ``u`` is a cache ``[n, d]`` and
        ``f`` is applied to each of its rows (an empty cache gives an empty result)."""
        model = self.spec.model
        if rows:
            if u.shape[2] == 0:
                one = self.apply_model(u.new_zeros(u.shape[:2] + u.shape[3:]), scope)
                return one.new_zeros(one.shape[:2] + (0,) + one.shape[2:])
            return torch.stack([self.apply_model(u[:, :, r], scope) for r in range(u.shape[2])], dim=2)
        inner = replace(scope, local={model.arg: u}, temp={})
        return self.eval(model.body, inner)

    def args(self, e: Call, scope: _Scope) -> list[torch.Tensor]:
        return [self.eval(a, scope) for a in e.args]

    # ------------------------------------------------------- reductions
    def axis(self, e: Call) -> int:
        """The axis named by ``e``'s second argument, as a negative dim (from the shape rules)."""
        if id(e) not in self.axes:
            raise _EvalError(f"{_where(e)}cannot resolve the axis of `{unparse(e)}`")
        return self.axes[id(e)]

    def fn_sum(self, e, scope):
        x = self.eval(e.args[0], scope)
        if len(e.args) == 2:
            return x.sum(dim=self.axis(e))
        return x.sum(dim=_reduce_dims(x)) if x.dim() > 2 else x

    def fn_mean(self, e, scope):
        x = self.eval(e.args[0], scope)
        if len(e.args) == 2:
            return x.mean(dim=self.axis(e))
        return x.mean(dim=_reduce_dims(x)) if x.dim() > 2 else x

    def fn_norm(self, e, scope):
        x = self.eval(e.args[0], scope)
        if len(e.args) == 2:
            return torch.linalg.vector_norm(x, dim=self.axis(e))
        return torch.linalg.vector_norm(x, dim=_reduce_dims(x)) if x.dim() > 2 else x.abs()

    def fn_softmax(self, e, scope):
        """``softmax(x, d)``: ``exp(x) / sum(exp(x), d)`` over the axis named ``d``."""
        return torch.softmax(self.eval(e.args[0], scope), dim=self.axis(e))

    def fn_newton_schulz(self, e, scope):
        x = self.eval(e.args[0], scope)
        if len(_named(x)) != 2:
            raise _EvalError(f"{_where(e)}newton_schulz needs a matrix, got shape {list(_named(x))}")
        steps = e.args[1]
        if isinstance(steps, Name) and isinstance(self.spec.constants.get(steps.id), tuple):
            return newton_schulz(x, self.spec.constants[steps.id])   # a coefficient schedule
        return newton_schulz(x, self.int_arg(steps))

    # ------------------------------------------------------ normalisers
    def fn_layernorm(self, e, scope):
        x, *wb = self.args(e, scope)
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
        y = (x - mu) / torch.sqrt(var + LAYERNORM_EPS)
        if len(wb) >= 1:
            y, w = _align(y, wb[0])
            y = y * w
        if len(wb) == 2:
            y, b = _align(y, wb[1])
            y = y + b
        return y

    def fn_rmsnorm(self, e, scope):
        x, *w = self.args(e, scope)
        y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + NORM_EPS)
        if w:
            y, w0 = _align(y, w[0])
            y = y * w0
        return y

    def fn_l2norm(self, e, scope):
        x = self.eval(e.args[0], scope)
        return x / torch.sqrt((x * x).sum(-1, keepdim=True) + NORM_EPS)

    # ---------------------------------------------------- binary helpers
    def fn_outer(self, e, scope):
        a, b = self.args(e, scope)
        if len(_named(a)) != 1 or len(_named(b)) != 1:
            raise _EvalError(f"{_where(e)}outer needs two vectors, got shapes "
                             f"{list(_named(a))} and {list(_named(b))}")
        return a.unsqueeze(-1) * b.unsqueeze(-2)

    def fn_min(self, e, scope):
        return torch.minimum(*_align(*self.args(e, scope)))

    def fn_max(self, e, scope):
        return torch.maximum(*_align(*self.args(e, scope)))

    def fn_clamp(self, e, scope):
        x, lo, hi = self.args(e, scope)
        x, lo = _align(x, lo)
        x = torch.maximum(x, lo)
        x, hi = _align(x, hi)
        return torch.minimum(x, hi)

    def fn_huber(self, e, scope):
        x, d = _align(*self.args(e, scope))
        ax = x.abs()
        return torch.where(ax <= d, 0.5 * x * x, d * (ax - 0.5 * d))

    def fn_solve(self, e, scope):
        A, b = self.args(e, scope)
        if len(_named(A)) != 2:
            raise _EvalError(f"{_where(e)}solve needs a square matrix first, got {list(_named(A))}")
        if len(_named(b)) == 1:
            return torch.linalg.solve(A, b.unsqueeze(-1)).squeeze(-1)
        return torch.linalg.solve(A, b)

    def fn_diag(self, e, scope):
        raise _EvalError(f"{_where(e)}diag(a) is only allowed as an operand of @")

    def fn_eye(self, e, scope):
        d = self.int_arg(e.args[0])
        return torch.eye(d, dtype=self.dtype, device=self.device).reshape(1, 1, d, d)

    def int_arg(self, a: Expr) -> int:
        if isinstance(a, Num) and float(a.value).is_integer():
            return int(a.value)
        if isinstance(a, Name) and a.id in self.spec.dims:
            return self.spec.dims[a.id]
        raise _EvalError(f"{_where(a)}expected a dim or an integer, got `{unparse(a)}`")

    # --------------------------------------------------------- caches
    def fn_attend(self, e, scope):
        """``softmax(scale * K q) V``: q [d], K [n, d], V [n, e], scale [] -> [e]."""
        q, K, V, scale = self.args(e, scope)
        scores = (K @ q.unsqueeze(-1)).squeeze(-1)                  # [B, H, n]
        if torch.is_tensor(scale) and scale.dim() >= 2:              # per-head scale [B, H]
            scale = scale.unsqueeze(-1)
        scores = scores * scale
        weights = torch.softmax(scores, dim=-1)
        return (weights.unsqueeze(-2) @ V).squeeze(-2)

    def fn_append(self, e, scope):
        raise _EvalError(f"{_where(e)}append(K, k) is only allowed as a statement `K = append(K, k)`")

    # ------------------------------------------------------------ grad
    def grad_target(self, e: Call) -> str:
        if len(e.args) == 2:
            t = e.args[1]
            if not isinstance(t, Name) or t.id not in self.spec.state:
                raise _EvalError(f"{_where(t)}grad(loss, W) needs a state W, got `{unparse(t)}`")
            return t.id
        used = self.spec.model_states()
        if len(used) != 1:
            raise _EvalError(f"{_where(e)}grad(loss) needs a model that reads exactly one state "
                             f"(it reads {used}); write grad(loss, W)")
        return used[0]

    def fn_grad(self, e: Call, scope: _Scope) -> torch.Tensor:
        """d(loss)/dW at the scope's current state values.

        Under mini-batch the statement was first run on the shadow state (see
        :func:`_step`), which recorded this gradient in ``scope.grad_memo``.  The
        loss of each (batch, head) is independent, so summing them before
        ``autograd.grad`` gives every (batch, head) its own gradient.
        """
        memo = scope.grad_memo
        if memo is not None and id(e) in memo:
            return memo[id(e)]
        g = self.gradient(e, scope)
        if memo is not None:
            memo[id(e)] = g
        return g

    def gradient(self, e: Call, scope: _Scope) -> torch.Tensor:
        target = self.grad_target(e)
        base = scope.state
        with torch.enable_grad():
            w = base[target]
            # A fresh node for W: other states (written earlier in this token from W) keep
            # their own path to W, so this is the partial derivative the language defines.
            var = w.clone() if w.requires_grad else w.detach().requires_grad_(True)
            inner = replace(scope, state={**base, target: var}, grad_memo=None)
            loss = self.eval(e.args[0], inner)
            if _named(loss):
                raise _EvalError(f"{_where(e.args[0])}grad needs a scalar loss, got shape "
                                 f"{list(_named(loss))}")
            if not loss.requires_grad:
                return torch.zeros_like(w)
            (g,) = torch.autograd.grad(loss.sum(), var, create_graph=self.needs_graph,
                                       allow_unused=True)
        return torch.zeros_like(w) if g is None else g

    # ------------------------------------------------------- statements
    def step_statement(self, i: int, stmt: Assign, scope: _Scope, block: "Block | None",
                       commit: bool = True) -> None:
        """Statement ``i`` of this token: :meth:`assign`, or for a state updated every C > 1 tokens
        its gradient terms added to the open block's sums (kept when ``commit``) and, at the
        block's last token, the assignment with each term replaced by its sum."""
        every = block.every.get(stmt.target, 1) if block is not None else 1
        if every == 1:
            self.assign(stmt, scope)
            return
        terms = self.terms[i]
        sums = []
        for k, t in enumerate(terms):
            v = self.eval(t, scope)
            sums.append(v if (i, k) not in block.acc else block.acc[(i, k)] + v)
        last = (block.pos + 1) % every == 0
        if commit:
            for k, v in enumerate(sums):
                if last:
                    block.acc.pop((i, k), None)
                else:
                    block.acc[(i, k)] = v
        if last:
            self.assign(stmt, replace(scope, terms={id(t): v for t, v in zip(terms, sums)}))

    def assign(self, stmt: Assign, scope: _Scope) -> None:
        """Run one update statement; it sees (and changes) ``scope.state``, or binds a
        temporary in ``scope.temp`` (a target that is no state)."""
        st = self.spec.state.get(stmt.target)
        if st is None:
            declared = (*self.spec.dims, *self.spec.constants, *self.spec.views, *self.spec.gates,
                        *self.spec.params, *self.spec.let)
            if stmt.target in declared or stmt.target in scope.temp:
                raise _EvalError(f"{_where(stmt)}update target {stmt.target!r} is not a state or a new temporary")
            scope.temp[stmt.target] = self.eval(stmt.value, scope)
            return
        old = scope.state[stmt.target]
        v = stmt.value
        if isinstance(v, Call) and v.fn == "append":
            scope.state[stmt.target] = self.append(st, old, v, scope)
            return
        new = self.eval(v, scope)
        if new.dim() < old.dim():
            new, _ = _align(new, old)
        try:
            new = new.expand(old.shape) if new.shape != old.shape else new
        except RuntimeError:
            raise _EvalError(f"{_where(stmt)}`{stmt}` gives shape {list(_named(new))}, but state "
                             f"{stmt.target} is {_notation(st.shape)} = {list(_named(old))}") from None
        scope.state[stmt.target] = new

    def append(self, st, cache: torch.Tensor, call: Call, scope: _Scope) -> torch.Tensor:
        """``K = append(K, k)``: concatenate along the cache axis, keep the last ``window``."""
        if not st.cache:
            raise _EvalError(f"{_where(call)}append needs a cache state")
        item = self.eval(call.args[1], scope)
        item = item.expand(cache.shape[0], cache.shape[1], *cache.shape[3:])
        out = torch.cat([cache, item.unsqueeze(2)], dim=2)
        if st.window is not None and out.shape[2] > st.window:
            out = out[:, :, -st.window:]
        return out


# ======================================================================== run
def run(spec: Spec, *, state: dict | None = None, schedule: Any = "online",
        dims: dict | None = None, params: dict | None = None, cu_seqlens: torch.Tensor | None = None,
        **views_and_gates: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Run ``spec`` over a sequence, token by token.

    Args:
        state: ``{name: [B, H, *shape]}`` initial state (missing entries from
            :func:`init_state`; a cache is ``[B, H, n, *shape]``).
        schedule: ``"online"`` (also ``"auto"``, ``"chunk(N)"``: the same numbers),
            ``("minibatch", C)`` / ``"minibatch(C)"``, ``("apply_update", C)`` /
            ``"apply_update(C)"``, or ``"spec"`` (the spec's own).
        dims: overrides of the spec's dims.
        params: learned params ``{name: [H, *shape]}`` and learned initial states.
        cu_seqlens: packed documents (flash-linear-attention's convention): B = 1 and integer
            offsets ``[N + 1]`` (0, ..., T); document i is tokens ``cu_seqlens[i]`` to
            ``cu_seqlens[i + 1] - 1`` and runs alone, from its own initial state (``state`` and
            the final state are then ``[N, H, *shape]``; a cache the documents leave at different
            lengths is left out of the final state), its blocks and chunks starting at its own
            first token.
        views_and_gates: each view ``[B, T, H, D]``, each gate ``[B, T, H]`` (``[B, T, H, d]``
            for a gate declared with a shape).

    The sequence starts at position 0 (blocks of ``every C`` states and ``apply_update(C)``
    chunks end at positions C - 1, 2C - 1, ...); the returned state holds each state's
    value, without the updates of a block not yet complete.

    Returns:
        ``(outputs [B, T, H, *read_shape], final_state {name: [B, H, *shape]})``.
    """
    spec = _with_dims(spec, dims)
    if cu_seqlens is not None:
        return _run_documents(spec, state, schedule, params, cu_seqlens, views_and_gates)
    mode = _mode(schedule, spec)
    chunk = mode[1] if mode[0] == "minibatch" else None
    every = _frequencies(spec, mode)
    B, T, H, dtype, device = _check_inputs(spec, views_and_gates)
    params = _params(spec, params, H, dtype, device)
    cur = _full_state(spec, state, B, H, dtype, device, params)
    tensors = [*views_and_gates.values(), *params.values(), *cur.values()]
    needs_graph = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    interp = _Interpreter(spec, params, dtype, device, needs_graph)
    interp.terms = {b.index: list(b.terms) for b in block_statements(spec, every)}
    caches = [n for n, st in spec.state.items() if st.cache]

    outputs: list[torch.Tensor] = []
    chunk_start: dict[str, torch.Tensor] = {}
    acc: dict = {}   # block updates: (statement, term) -> the sum so far of the open block
    for t in range(T):
        if chunk is not None and t % chunk == 0:
            chunk_start = dict(cur)
        token = _token_inputs(spec, views_and_gates, t)
        # mini-batch: gradients at the chunk-start values of the learned states; the caches
        # (the recent keys and values a window loss reads) are always up to date
        shadow = {**chunk_start, **{c: cur[c] for c in caches}} if chunk is not None else None
        outputs.append(_step(interp, token, cur, shadow, B, H, Block(t, every, acc)))
    return torch.stack(outputs, dim=1), dict(cur)


def document_bounds(cu_seqlens: Any, B: int, T: int) -> list[tuple[int, int]]:
    """The ``(start, end)`` of each packed document, from offsets ``[N + 1]`` (checked: a 1-D
    integer tensor from 0 to T, never decreasing, over a batch of one row)."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point() \
            or cu_seqlens.dtype == torch.bool or cu_seqlens.numel() < 2:
        got = (f"{cu_seqlens.dtype} {list(cu_seqlens.shape)}" if isinstance(cu_seqlens, torch.Tensor)
               else type(cu_seqlens).__name__)
        raise ValueError(f"cu_seqlens must be an integer tensor of offsets [N + 1] (0, ..., T), got {got}")
    if B != 1:
        raise ValueError(f"cu_seqlens packs the documents into one row: B must be 1, got B = {B}")
    offsets = [int(x) for x in cu_seqlens.tolist()]
    if offsets[0] != 0 or offsets[-1] != T or any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to T = {T} without decreasing, got {offsets}")
    return list(zip(offsets[:-1], offsets[1:]))


def _run_documents(spec: Spec, state: dict | None, schedule: Any, params: dict | None,
                   cu_seqlens: torch.Tensor, inputs: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`run` over packed documents: each runs alone from row i of ``state`` ``[N, H, ...]``;
    outputs are concatenated along T, final states stacked ``[N, H, ...]``; a cache that the
    documents leave at different lengths (no one ``[N, H, n, ...]`` tensor) is left out."""
    B, T, H, dtype, device = _check_inputs(spec, inputs)
    bounds = document_bounds(cu_seqlens, B, T)
    N = len(bounds)
    full = _full_state(spec, state, N, H, dtype, device, _params(spec, params, H, dtype, device))
    outs, finals = [], []
    for i, (a, b) in enumerate(bounds):
        row = {n: t[i:i + 1] for n, t in full.items()}
        if b == a:
            finals.append(row)
            continue
        o, s = run(spec, state=row, schedule=schedule, params=params,
                   **{n: x[:, a:b] for n, x in inputs.items()})
        outs.append(o)
        finals.append(s)
    final = {}
    for name in full:   # a cache whose documents end at different lengths is left out
        if len({tuple(f[name].shape) for f in finals}) == 1:
            final[name] = torch.cat([f[name] for f in finals], dim=0)
    return torch.cat(outs, dim=1), final


def _token_inputs(spec: Spec, inputs: dict, t: int) -> dict[str, torch.Tensor]:
    """Views ``[B, H, D]`` and gates ``[B, H, *shape]`` of token ``t``."""
    return {n: inputs[n][:, t] for n in (*spec.views, *spec.gates)}


@dataclass
class Block:
    """Where a token sits in the blocks of the block updates: its position, each learned
    state's frequency and the running sums of the open blocks' gradient terms."""

    pos: int
    every: dict
    acc: dict


def _step(interp: _Interpreter, token: dict, state: dict, shadow: dict | None,
          B: int, H: int, block: Block | None = None) -> torch.Tensor:
    """One token: lets, (read), update statements in order, (read).  Mutates ``state``.

    A statement whose target is no state binds a temporary of this token, visible to
    the later statements only (the read, the lets and the next token never see it).

    Online (``shadow is None``) every ``grad`` is taken at the current state.
    Mini-batch: ``shadow`` starts as the chunk-start state and the token's
    statements are replayed on it first; each ``grad`` is taken there (so at the
    chunk-start values, carried through this token's own earlier statements, e.g.
    a decay written before the gradient) and reused by the real statement.  With
    C = 1 the shadow equals the state, so mini-batch(1) is online learning exactly.

    A statement of a state updated every C > 1 tokens (``block``) adds its gradient terms to
    the block's sums and assigns only at the block's last token, with each term replaced by
    its sum (:mod:`memspec.lang.blocks`).
    """
    spec = interp.spec
    scope = _Scope(token=token, state=state)
    for name, expr in spec.let.items():
        token[name] = interp.eval(expr, scope)
    out = None
    if spec.order == "read_write":
        out = interp.eval(spec.read, scope)
    last_grad = max((i for i, st in enumerate(spec.update) if _has_grad(st.value)), default=-1)
    temps: dict = {}          # this token's temporaries (never carried to the next token) ...
    shadow_temps: dict = {}   # ... and those of the replay on the chunk-start state
    for i, stmt in enumerate(spec.update):
        memo = None
        if shadow is not None and i <= last_grad:
            memo = {}
            interp.step_statement(i, stmt, _Scope(token=token, state=shadow, grad_memo=memo, temp=shadow_temps),
                                  block, commit=False)
        interp.step_statement(i, stmt, _Scope(token=token, state=state, grad_memo=memo, temp=temps), block)
    if spec.order == "write_read":
        out = interp.eval(spec.read, scope)
    return out.expand(B, H, *out.shape[2:])


def _has_grad(e: Expr) -> bool:
    return any(isinstance(n, Call) and n.fn == "grad" for n in e.walk())


# ================================================================ apply_model
def apply_model(spec: Spec, state: dict[str, torch.Tensor], u: torch.Tensor,
                dims: dict | None = None, params: dict | None = None) -> torch.Tensor:
    """The inner model ``f(u)`` with a given state (e.g. to measure retrieval MSE).

    ``u`` is ``[B, H, d_in]`` or ``[B, H, N, d_in]`` (N inputs, applied one by
    one); returns ``[B, H, *out]`` or ``[B, H, N, *out]``.
    """
    spec = _with_dims(spec, dims)
    if spec.model is None:
        raise ValueError(f"spec {spec.name!r} has no model")
    if not isinstance(u, torch.Tensor) or u.dim() not in (3, 4):
        got = list(u.shape) if isinstance(u, torch.Tensor) else type(u).__name__
        raise ValueError(f"u must be [B, H, d_in] or [B, H, N, d_in], got {got}")
    missing = [n for n in spec.model_states() if n not in state]
    if missing:
        raise ValueError(f"state is missing {missing}, which the model reads")
    H = u.shape[1]
    params = _params(spec, params, H, u.dtype, u.device)
    needs_graph = torch.is_grad_enabled()
    interp = _Interpreter(spec, params, u.dtype, u.device, needs_graph)
    scope = _Scope(token={}, state=dict(state))
    if u.dim() == 3:
        return interp.apply_model(u, scope)
    return torch.stack([interp.apply_model(u[:, :, n], scope) for n in range(u.shape[2])], dim=2)
