"""Structural normal form of expressions, for comparing specs by meaning, not by text.

``canon(e)`` maps an expression to a hashable tuple such that formatting and the
usual algebraic rewrites give the same value:

* ``+`` and ``*`` are commutative and associative: chains are flattened and their
  operands sorted (``a*b`` == ``b*a``, ``(a+b)+c`` == ``a+(b+c)``);
* ``x - y`` == ``x + (-1)*y`` and ``-x`` == ``(-1)*x``;
* constants fold: ``0.5*sum(e^2)`` == ``sum(e^2)/2`` (division by a constant is
  multiplication by its inverse), ``2*3*x`` == ``6*x``, ``x + x`` == ``2*x``;
* a scalar coefficient moves out of a matrix product or a transpose
  (``(2*a) @ b`` == ``2*(a @ b)``), ``@`` chains are flattened (it is associative)
  but never reordered, and ``x.T.T`` == ``x``;
* the inner model's name and argument are renamed to fixed placeholders, so
  ``f(u) = u @ W`` and ``g(x) = x @ W`` (with calls renamed) compare equal.

Products are not distributed over sums: ``(1 - a)*W`` and ``W - a*W`` differ.

``skeleton(t)`` replaces every number of a normal form by ``"#"`` and returns the
numbers in order, so that two expressions that differ only in constants can be
reported as changed constants.
"""
from __future__ import annotations

import math
from typing import Any, Callable

from .expr import BinOp, Call, Expr, Name, Neg, Num, Transpose

Canon = tuple
MODEL = "<model>"
ARG = "<arg>"

_FOLD: dict[str, Callable[[float], float]] = {
    "sqrt": math.sqrt, "exp": math.exp, "log": math.log, "abs": abs,
    "tanh": math.tanh, "sign": lambda v: float((v > 0) - (v < 0)),
    "relu": lambda v: max(v, 0.0),
}


def _num(v: float) -> float:
    """Round away float noise so that 0.1*3 == 0.3; never returns -0.0."""
    r = float(f"{float(v):.12g}")
    return 0.0 if r == 0 else r


Poly = dict  # factors tuple -> coefficient; () is the constant term


def _key(t: Any) -> str:
    return repr(t)


def _const(p: Poly) -> float | None:
    """The value of a constant polynomial, else None."""
    if all(k == () for k in p):
        return p.get((), 0.0)
    return None


def _add(p: Poly, q: Poly, s: float = 1.0) -> Poly:
    out = dict(p)
    for k, c in q.items():
        out[k] = _num(out.get(k, 0.0) + s * c)
    return {k: c for k, c in out.items() if c != 0}


def _scale(p: Poly, c: float) -> Poly:
    return {k: _num(v * c) for k, v in p.items() if _num(v * c) != 0}


def _atom(t: Canon) -> Poly:
    if t[0] == "num":
        return {(): t[1]} if t[1] != 0 else {}
    if t[0] == "prod":  # a product canon back into a single term
        return {tuple(t[2]): t[1]}
    return {(t,): 1.0}


def _term(p: Poly) -> tuple[float, Canon] | None:
    """A single-term polynomial as (coefficient, canon of the factors with coefficient 1)."""
    if len(p) == 1:
        (k, c), = p.items()
        if k:
            return c, canon_poly({k: 1.0})
    return None


def _mul(p: Poly, q: Poly) -> Poly:
    cp, cq = _const(p), _const(q)
    if cp is not None:
        return _scale(q, cp)
    if cq is not None:
        return _scale(p, cq)
    tp, tq = _term(p), _term(q)
    # sums stay whole (no distribution): they become one factor
    fp = list(next(iter(p))) if tp else [canon_poly(p)]
    fq = list(next(iter(q))) if tq else [canon_poly(q)]
    c = (p[next(iter(p))] if tp else 1.0) * (q[next(iter(q))] if tq else 1.0)
    return {tuple(sorted(fp + fq, key=_key)): _num(c)}


def canon_poly(p: Poly) -> Canon:
    p = {k: c for k, c in p.items() if c != 0}
    if not p:
        return ("num", 0.0)
    c = _const(p)
    if c is not None:
        return ("num", _num(c))
    if len(p) == 1:
        (k, coef), = p.items()
        if coef == 1 and len(k) == 1:
            return k[0]
        return ("prod", coef, tuple(sorted(k, key=_key)))
    terms = tuple(sorted(((c, tuple(sorted(k, key=_key))) for k, c in p.items()), key=lambda t: _key(t[1])))
    return ("sum", terms)


class Normalizer:
    """Normal forms relative to one spec (its model name and argument)."""

    def __init__(self, model_name: str | None = None, arg: str | None = None):
        self.model_name, self.arg = model_name, arg

    def canon(self, e: Expr) -> Canon:
        return canon_poly(self.poly(e))

    def poly(self, e: Expr) -> Poly:
        if isinstance(e, Num):
            v = _num(e.value)
            return {(): v} if v != 0 else {}
        if isinstance(e, Name):
            return {(("name", ARG if e.id == self.arg and self.arg else e.id),): 1.0}
        if isinstance(e, Neg):
            return _scale(self.poly(e.operand), -1.0)
        if isinstance(e, BinOp):
            if e.op == "+":
                return _add(self.poly(e.left), self.poly(e.right))
            if e.op == "-":
                return _add(self.poly(e.left), self.poly(e.right), -1.0)
            if e.op == "*":
                return _mul(self.poly(e.left), self.poly(e.right))
            if e.op == "/":
                num, den = self.poly(e.left), self.poly(e.right)
                c = _const(den)
                if c is not None and c != 0:
                    return _scale(num, 1.0 / c)
                return _mul(num, _atom(("inv", canon_poly(den))))
            if e.op == "^":
                base, ex = self.poly(e.left), self.poly(e.right)
                cb, ce = _const(base), _const(ex)
                if cb is not None and ce is not None:
                    try:
                        return {(): _num(cb ** ce)} if _num(cb ** ce) != 0 else {}
                    except (OverflowError, ZeroDivisionError, ValueError):
                        pass
                if ce == 1:
                    return base
                return _atom(("pow", canon_poly(base), canon_poly(ex)))
            if e.op == "@":
                return self._matmul(e)
        if isinstance(e, Transpose):
            p = self.poly(e.operand)
            t = _term(p)
            coef, inner = (t if t else (1.0, canon_poly(p)))
            if inner[0] == "T":
                return _scale(_atom(inner[1]), coef)
            return _scale(_atom(("T", inner)), coef)
        if isinstance(e, Call):
            fn = MODEL if (self.model_name and e.fn == self.model_name) else e.fn
            args = [self.poly(a) for a in e.args]
            if fn in _FOLD and len(args) == 1 and _const(args[0]) is not None:
                try:
                    v = _num(_FOLD[fn](_const(args[0])))
                    return {(): v} if v != 0 else {}
                except (ValueError, OverflowError):
                    pass
            return _atom(("call", fn, tuple(canon_poly(a) for a in args)))
        raise TypeError(f"not an expression: {e!r}")

    def _matmul(self, e: BinOp) -> Poly:
        ops: list[Expr] = []

        def flat(x: Expr) -> None:
            if isinstance(x, BinOp) and x.op == "@":
                flat(x.left)
                flat(x.right)
            else:
                ops.append(x)

        flat(e)
        coef, canons = 1.0, []
        for o in ops:
            p = self.poly(o)
            t = _term(p)
            if t:  # a scalar coefficient moves out of the product (it is bilinear)
                coef *= t[0]
                canons.append(t[1])
            else:
                canons.append(canon_poly(p))
        flat_canons: list[Canon] = []
        for c in canons:  # (a @ b) lifted out of a coefficient is itself a chain
            flat_canons.extend(c[1] if c[0] == "matmul" else (c,))
        return _scale(_atom(("matmul", tuple(flat_canons))), coef)


def canon(e: Expr, model_name: str | None = None, arg: str | None = None) -> Canon:
    """The normal form of one expression (see the module docstring)."""
    return Normalizer(model_name, arg).canon(e)


def skeleton(t: Any) -> tuple[Any, list[float]]:
    """``t`` with every number replaced by ``"#"``, and the numbers in order."""
    nums: list[float] = []

    def go(x: Any) -> Any:
        if isinstance(x, float):
            nums.append(x)
            return "#"
        if isinstance(x, tuple):
            return tuple(go(y) for y in x)
        return x

    return go(t), nums
