"""Interval arithmetic on expressions: a decay the chunk forms take the log of must be
provably >= 0 (gates are bounded through their formulas)."""
from __future__ import annotations

import math

from ..lang.expr import BinOp, Call, Expr, Name, Neg, Num
from .algebra import Algebra, NotAdmitted, txt


# ----------------------------------------------------------- value ranges
INF = float("inf")
RANGES = {"sigmoid": (0.0, 1.0), "softplus": (0.0, INF), "relu": (0.0, INF), "abs": (0.0, INF),
           "sqrt": (0.0, INF), "norm": (0.0, INF), "tanh": (-1.0, 1.0), "sign": (-1.0, 1.0),
           "elu": (-1.0, INF), "gelu": (-0.2, INF), "silu": (-0.3, INF)}


def value_range(alg: Algebra, e: Expr, logit=(-INF, INF)) -> tuple[float, float]:
    """An interval containing every value of ``e`` (interval arithmetic; gates through their formula)."""
    def mul(a, b):
        prods = []
        for x in a:
            for y in b:
                prods.append(0.0 if (x == 0 or y == 0) else x * y)
        return min(prods), max(prods)

    if isinstance(e, Num):
        return float(e.value), float(e.value)
    if isinstance(e, Name):
        spec = alg.spec
        if e.id == "logit":
            return logit
        if e.id in spec.constants:
            return float(spec.constants[e.id]), float(spec.constants[e.id])
        if e.id in spec.dims:
            return 1.0, INF
        if e.id in spec.gates:
            return value_range(alg, spec.gates[e.id].formula)
        if e.id in alg.lets:
            return value_range(alg, alg.lets[e.id])
        return -INF, INF
    if isinstance(e, Neg):
        lo, hi = value_range(alg, e.operand, logit)
        return -hi, -lo
    if isinstance(e, BinOp):
        a, b = value_range(alg, e.left, logit), value_range(alg, e.right, logit)
        if e.op == "+":
            return a[0] + b[0], a[1] + b[1]
        if e.op == "-":
            return a[0] - b[1], a[1] - b[0]
        if e.op == "*":
            if e.left == e.right:
                lo, hi = mul(a, a)
                return max(lo, 0.0), hi
            return mul(a, b)
        if e.op == "/" and (b[0] > 0 or b[1] < 0):
            inv = (1.0 / b[1] if b[1] != INF else 0.0, 1.0 / b[0] if b[0] != -INF else 0.0)
            return mul(a, tuple(sorted(inv)))
        if e.op == "^" and isinstance(e.right, Num) and float(e.right.value) % 2 == 0:
            return 0.0, INF
        return -INF, INF
    if isinstance(e, Call):
        if e.fn == "exp":
            lo, hi = value_range(alg, e.args[0], logit)
            return (math.exp(lo) if lo != -INF else 0.0), (math.exp(hi) if hi < 700 else INF)
        if e.fn in ("sigmoid", "tanh"):
            return RANGES[e.fn]
        if e.fn in RANGES:
            return RANGES[e.fn]
        if e.fn == "clamp":
            lo, hi = value_range(alg, e.args[1], logit)[0], value_range(alg, e.args[2], logit)[1]
            return lo, hi
        if e.fn in ("min", "max"):
            a, b = value_range(alg, e.args[0], logit), value_range(alg, e.args[1], logit)
            f = min if e.fn == "min" else max
            return f(a[0], b[0]), f(a[1], b[1])
        if e.fn in ("sum", "mean") and isinstance(e.args[0], BinOp) and e.args[0].op in "*^":
            inner = value_range(alg, e.args[0], logit)
            return (0.0, INF) if inner[0] >= 0 else (-INF, INF)
    return -INF, INF


def check_decay(alg: Algebra, gamma: Expr | None, where: str) -> str | None:
    """A reason line when the decay is provably >= 0, else raise NotAdmitted (the chunk form takes its log)."""
    if gamma is None:
        return None
    lo, hi = value_range(alg, gamma)
    if lo < 0:
        raise NotAdmitted(f"the decay {txt(gamma)} {where} is not provably >= 0 (the chunk form takes its log)")
    return f"the decay {txt(gamma)} {where} lies in [{fmt_bound(lo)}, {fmt_bound(hi)}]"


def fmt_bound(x: float) -> str:
    return "inf" if x == INF else format(x, "g")
