"""Asymptotic per-token costs of a spec's write and read, from the inferred shapes: ``@`` and
``outer`` cost the product of their dims, elementwise operations the size of their result,
``solve`` ``n^3 + n^2 m``, ``attend`` ``n (d + e)`` over a cache of ``n`` entries, ``f(x)``
its body, ``grad(loss, W)`` the loss (a backward pass costs a small multiple of the
forward); only the dominant terms are kept (for :mod:`.table`)."""
from __future__ import annotations

from collections import Counter

from ..lang.errors import Collector
from ..lang.expr import BinOp, Call, Expr, Name, Neg, is_diag
from ..lang.shape_rules import cg_steps
from ..lang.shapes import ShapeEnv
from ..lang.spec import Spec
from .mathtext import SUPERSCRIPT


def _size(shape) -> Counter:
    return Counter({tuple(sorted(shape or ())): 1})


class Coster:
    """Asymptotic per-token cost of expressions, from their inferred shapes."""

    def __init__(self, spec: Spec):
        self.spec = spec
        self.env = ShapeEnv.from_spec(spec)

    def cost(self, e: Expr, scope: dict | None = None) -> Counter:
        rec: dict = {}
        self.env.infer(e, scope=scope or {}, diags=Collector(), record=rec)
        return self._cost(e, rec, scope or {})

    def _shape(self, e: Expr, rec: dict):
        sh = rec.get(id(e))
        if sh is None and isinstance(e, Name):  # cache arguments are typed by their call
            sh = self.env.names.get(e.id)
        return sh

    def _cost(self, e: Expr, rec: dict, scope: dict) -> Counter:
        out: Counter = Counter()
        for c in e.children():
            out += self._cost(c, rec, scope)
        sh = self._shape(e, rec)
        if isinstance(e, BinOp):
            if e.op == "@" and (is_diag(e.left) or is_diag(e.right)):
                out += _size(sh)   # a row / column scaling: elementwise
            elif e.op == "@":
                a, b = self._shape(e.left, rec), self._shape(e.right, rec)
                if a is not None and b is not None:
                    out += _size(tuple(a) + tuple(b)[1:]) if a and b else _size(a or b)
            else:
                out += _size(sh)
        elif isinstance(e, Neg):
            out += _size(sh)
        elif isinstance(e, Call):
            out += self._call(e, rec, sh, scope)
        return out

    def _call(self, e: Call, rec: dict, sh, scope: dict) -> Counter:
        spec = self.spec
        arg = [self._shape(a, rec) for a in e.args]
        if spec.model is not None and e.fn == spec.model.name:
            return self.cost(spec.model.body, {**scope, spec.model.arg: arg[0] or ()})
        if e.fn == "grad":
            # backward ~ forward: the loss, at the current state
            return self.cost(spec.loss) + _size(sh) if spec.loss is not None else _size(sh)
        if e.fn == "solve" and arg[0]:
            n = arg[0][0]
            m = tuple((arg[1] or ())[1:])
            return _size((n, n, n)) + _size((n, n) + m)
        if e.fn == "cg" and arg[0]:   # one product A p per step
            m = tuple((arg[1] or ())[1:])
            return Counter({tuple(sorted(arg[0] + m)): cg_steps(e.args[2], spec.constants) or 1})
        if e.fn == "attend" and len(arg) == 4 and arg[1] and arg[2]:
            return _size(arg[1]) + _size(arg[2])
        if e.fn in ("sum", "mean", "norm", "layernorm", "rmsnorm", "l2norm", "softmax"):
            return _size(arg[0])
        if e.fn == "newton_schulz" and arg[0] and len(arg[0]) == 2:
            # each step: X X^T (m n m), (A A) (m^3), (.) X (m m n) on the smaller side m
            m, n = arg[0]
            return Counter({tuple(sorted((m, m, n))): 2, tuple(sorted((m, m, m))): 1})
        if e.fn in ("eye", "diag"):   # never formed (diag is the operand of a scaling)
            return Counter()
        if e.fn == "append":  # pushing one vector
            return _size(arg[1])
        return _size(sh)


def dominant(c: Counter) -> list[tuple[str, ...]]:
    """The monomials not dominated by another (``d_k`` is dominated by ``d_k·d_v``)."""
    monos = [m for m in c if c[m]]

    def divides(a, b):
        ca, cb = Counter(a), Counter(b)
        return all(cb[k] >= v for k, v in ca.items())

    keep = [m for m in monos if not any(o != m and divides(m, o) for o in monos)]
    return sorted(set(keep), key=lambda m: (-len(m), m))


def _mono_text(m: tuple[str, ...], order: list[str]) -> str:
    cnt = Counter(m)
    parts = []
    for d in sorted(cnt, key=lambda d: (order.index(d) if d in order else len(order), d)):
        parts.append(d + (str(cnt[d]).translate(SUPERSCRIPT) if cnt[d] > 1 else ""))
    return "·".join(parts) or "1"


def cost_text(c: Counter, spec: Spec, cache_axis: str = "n") -> str:
    """``O(d_k·d_v)``; a factor common to every term is pulled out: ``O(n·(d_k + d_v))``."""
    monos = dominant(c)
    if not monos:
        return "O(1)"
    order = [cache_axis] + list(spec.dims)
    if len(monos) == 1:
        return f"O({_mono_text(monos[0], order)})"
    common = Counter(monos[0])
    for m in monos[1:]:
        common &= Counter(m)
    rest = [tuple((Counter(m) - common).elements()) for m in monos]
    inner = " + ".join(_mono_text(r, order) for r in rest)
    if common:
        return f"O({_mono_text(tuple(common.elements()), order)}·({inner}))"
    return f"O({inner})"
