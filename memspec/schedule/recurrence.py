"""The update program of one token as linear recurrences (what the mini-batch schedule and its
dual form solve in closed form).

With every ``grad(...)`` held fixed as a token-local input, each state after a token is
``S_t = sum coeff[S][(when, R)] * R_when + rest[S]`` with token-local scalar
coefficients; :func:`minibatch_recurrence` extracts that form statement by statement
(temporaries substituted where they are used) or raises :class:`NotRecurrence`.

The ``term_*`` helpers build coefficient expressions where ``None`` means zero.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..lang.expr import BinOp, Call, Expr, Name, Neg, Num, substitute, unparse
from ..lang.shapes import ShapeEnv
from .algebra import is_num


def term_add(a, b):
    if a is None or is_num(a, 0):
        return b
    if b is None or is_num(b, 0):
        return a
    if isinstance(b, Neg):
        return BinOp("-", a, b.operand)
    return BinOp("+", a, b)


def term_neg(a):
    if a is None:
        return None
    if isinstance(a, Neg):
        return a.operand
    if isinstance(a, Num):
        return Num(-a.value)
    return Neg(a)


def term_mul(a, b):
    if a is None or b is None or is_num(a, 0) or is_num(b, 0):
        return None
    if is_num(a, 1):
        return b
    if is_num(b, 1):
        return a
    if is_num(a, -1):
        return term_neg(b)
    if isinstance(a, Neg):
        return term_neg(term_mul(a.operand, b))
    return BinOp("*", a, b)


def term_div(a, b):
    if a is None:
        return None
    if is_num(b, 1):
        return a
    return BinOp("/", a, b)


@dataclass
class _Affine:
    """``sum_S coeffs[S] * S_{t-1} + rest``: coefficients are token-local scalars."""

    coeffs: dict
    rest: Optional[Expr]


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
        return _Affine({k: term_neg(c) for k, c in v.coeffs.items()}, term_neg(v.rest))

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
                coeffs[k] = term_add(coeffs.get(k), c)
            return _Affine({k: c for k, c in coeffs.items() if c is not None}, term_add(a.rest, b.rest))
        if isinstance(e, BinOp) and e.op == "*":
            for s, t in ((e.left, e.right), (e.right, e.left)):
                if local(s) and scalar(s):
                    v = walk(t, cur, i)
                    return _Affine({k: term_mul(s, c) for k, c in v.coeffs.items()}, term_mul(s, v.rest))
        if isinstance(e, BinOp) and e.op == "/" and local(e.right) and scalar(e.right):
            v = walk(e.left, cur, i)
            return _Affine({k: term_div(c, e.right) for k, c in v.coeffs.items()}, term_div(v.rest, e.right))
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
