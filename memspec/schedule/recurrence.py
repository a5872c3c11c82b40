"""The update program of one token as linear recurrences (what the mini-batch schedule and its
dual form solve in closed form).

With every ``grad(...)`` held fixed as a token-local input, each state after a token is
``S_t = sum coeff[S][(when, R)] * R_when + rest[S]`` with token-local scalar
coefficients; :func:`minibatch_recurrence` extracts that form statement by statement
(temporaries substituted where they are used) or raises :class:`NotRecurrence`.

The ``term_*`` helpers build coefficient expressions where ``None`` means zero.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..lang.expr import BinOp, Call, Expr, Name, Neg, Num, rewrite, substitute, unparse
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
    coefficients (or vectors: a row scaling ``diag(c) @ R``, one factor per row of R, or for the
    states in ``cols`` a column scaling ``R @ diag(c)``, one factor per column),
    where ``(\"prev\", R)`` is R after the previous token and ``(\"cur\", R)`` is R after
    this token (used when a statement reads a state that an earlier statement of the token
    finished writing, e.g. Titans' ``W = (1 - alpha) * W + U``).
    The diagonal term ``(\"prev\", S)`` is the decay of S.

    ``order`` lists the states so that each one depends (off the diagonal) only on
    states before it: the recurrences are solved one after the other.  ``grads`` are
    the distinct ``grad(...)`` calls (each taken at the chunk-start state in the
    mini-batch schedule)."""

    order: tuple
    coeff: dict
    rest: dict
    grads: tuple
    inputs: dict = field(default_factory=dict)
    mirror: dict = field(default_factory=dict)
    cols: frozenset = field(default=frozenset(), repr=False)   # (explain writes them as S @ diag(c))


def _factor(e: Expr, local, scalar, vector):
    """``e`` as a token-local factor times a term: ``(c, X, lift, side)`` for ``c * X`` / ``X * c``
    (c a scalar, side None), a row scaling ``diag(c) @ X`` (side ``"row"``) or a column scaling
    ``X @ diag(c)`` (side ``"col"``; c a vector: coefficients one factor per row or column), with
    ``lift`` the same factor applied to X's rest; None if ``e`` is neither."""
    if isinstance(e, BinOp) and e.op == "*":
        for s, t in ((e.left, e.right), (e.right, e.left)):
            if local(s) and scalar(s):
                return s, t, lambda rest, s=s: term_mul(s, rest), None
    if not (isinstance(e, BinOp) and e.op == "@"):
        return None
    for d, t, side in ((e.left, e.right, "row"), (e.right, e.left, "col")):
        if isinstance(d, Call) and d.fn == "diag" and len(d.args) == 1 and local(d.args[0]) and not local(t) \
                and vector(d.args[0]):
            def lift(rest, d=d, side=side):
                if rest is None:
                    return None
                return BinOp("@", d, rest) if side == "row" else BinOp("@", rest, d)
            return d.args[0], t, lift, side
    return None


def input_name(when: str, state: str) -> str:
    """The placeholder, in a :class:`Recurrence`'s ``rest``, of ``state``'s value before (``prev``)
    or after (``cur``) the token: a sequence the chunk step has already solved."""
    return f"_{when}_{state}"


def minibatch_recurrence(spec, values=None, scope=None, inputs: bool = False) -> Recurrence:
    """Extract the :class:`Recurrence` of ``spec``'s update program, or raise
    :class:`NotRecurrence` (then the spec does not admit the mini-batch schedule).

    ``values`` (optional) replaces the right-hand sides of the update statements, e.g.
    with each ``grad(...)`` already replaced by a placeholder name whose shape is in
    ``scope``; the placeholders are token-local inputs.

    With ``inputs``, the materialising chunk step's extensions are admitted too:

    * a term that is a non-linear function of *other* states, e.g. Atlas' Muon step
      ``newton_schulz(S, 5)`` of a momentum ``S`` finished earlier in the token, is an input
      of the recurrence (a function of a sequence solved before): in ``rest`` each such state
      is the placeholder :func:`input_name` (``_cur_S``, or ``_prev_S`` for its value before
      the token), and ``inputs[target]`` lists ``(when, S)``;
    * a mirror-descent step ``S = c * softmax(a * log(S) + X, d)`` (a, c token-local scalars,
      X not reading S) is a linear recurrence of its logits ``Z = a Z + X`` with
      ``S = c * softmax(Z, d)`` (softmax ignores the shift a log c - a logsumexp(Z, d) that
      log S adds to Z along d): ``coeff``/``rest`` hold the recurrence of Z, ``mirror[S]`` is
      ``(c, d)``."""
    x = _Extraction(spec, scope, inputs)
    values = [st.value for st in spec.update] if values is None else list(values)
    for i in range(len(spec.update)):
        x.statement(i, values[i])
    if not x.grads and scope is None:
        raise NotRecurrence("the update takes no gradient")
    states = list(spec.state)
    coeff = {s: {k: c for k, c in x.cur[s].coeffs.items() if c is not None} for s in states}
    return Recurrence(_solve_order(states, coeff, x.used_inputs), coeff, {s: x.cur[s].rest for s in states},
                      tuple(x.grads.values()), {s: tuple(sorted(v)) for s, v in x.used_inputs.items() if v},
                      x.mirror, _column_states(states, coeff, x.sides))


def _column_states(states: list, coeff: dict, sides: dict) -> frozenset:
    """The states whose per-channel coefficients scale their columns.  A state inherits the side
    of every state that flows into it (its weights carry their factors); :class:`NotRecurrence`
    if a state's factors would scale both its rows and its columns."""
    side = {s: set(sides.get(s, ())) for s in states}
    changed = True
    while changed:   # the sides flow along the coefficients (a fixpoint: the graph may have cycles)
        changed = False
        for s in states:
            for _, r in coeff[s]:
                if not side[r] <= side[s]:
                    side[s] |= side[r]
                    changed = True
    for s in states:
        if len(side[s]) > 1:
            raise NotRecurrence(f"the per-channel factors of {s} scale both its rows (`diag(c) @ {s}`) and its "
                                f"columns (`{s} @ diag(c)`)")
    return frozenset(s for s in states if side[s] == {"col"})


def _solve_order(states: list, coeff: dict, used_inputs: dict) -> tuple:
    """The states in an order where each one depends (off the diagonal, and through its inputs)
    only on states before it; :class:`NotRecurrence` if some feed each other within a token."""
    order: list = []
    pending = list(states)
    while pending:
        ready = [s for s in pending if all(r == s or r in order for _, r in coeff[s])
                 and all(r in order for _, r in used_inputs[s])]
        if not ready:
            if any(w == "prev" and r != s and r in pending for s in pending for w, r in coeff[s]):
                raise NotRecurrence(f"the recurrences of {', '.join(pending)} feed each other's previous values "
                                    "(a coupled system, not a chain of scalar recurrences)")
            raise NotRecurrence(f"states {', '.join(pending)} feed each other within a token")
        order.append(ready[0])
        pending.remove(ready[0])
    return tuple(order)


def _negated(v: _Affine) -> _Affine:
    """``-v``: every coefficient and the rest negated."""
    return _Affine({k: term_neg(c) for k, c in v.coeffs.items()}, term_neg(v.rest))


class _Extraction:
    """The update program read statement by statement into affine forms of the states before
    the token: ``cur`` (each state after the statements read so far), the temporaries, the
    distinct ``grad(...)`` calls met, the inputs each state reads and its mirror steps."""

    def __init__(self, spec, scope, inputs: bool):
        self.spec, self.scope, self.inputs = spec, scope, inputs
        self.env = ShapeEnv.from_spec(spec)
        self.model = spec.model.name if spec.model is not None else None
        self.grads: dict = {}
        self.last = {stmt.target: i for i, stmt in enumerate(spec.update)}   # state -> its last statement
        self.temps: dict = {}   # temporary -> its _Affine (a token-local input when it has no coefficients)
        self.used_inputs: dict = {s: set() for s in spec.state}
        self.mirror: dict = {}
        self.sides: dict = {}   # state -> the sides ("row", "col") its statements scale per channel
        self.cur = {s: _Affine({("prev", s): Num(1)}, None) for s in spec.state}

    def statement(self, i: int, value: Expr) -> None:
        """Read statement ``i`` (right-hand side ``value``) into ``cur`` or ``temps``."""
        target = self.spec.update[i].target
        if target not in self.spec.state:   # a per-token temporary: substituted where it is used
            if target not in self.temps:
                self.temps[target] = self.walk(value, i)
            return
        if self.spec.state[target].cache:
            if self.inputs:   # the window of a window loss: the chunk step appends, no recurrence
                return
            raise NotRecurrence(f"state {target} is a cache")
        z = self.mirror_step(value, target, i) if self.inputs else None
        self.cur[target] = z if z is not None else self.walk(value, i)

    def local(self, e: Expr) -> bool:
        """Token-local: no state, no model application outside grad(...)."""
        if isinstance(e, Call) and e.fn == "grad":
            return True
        if isinstance(e, Name) and (e.id in self.spec.state or (e.id in self.temps and self.temps[e.id].coeffs)):
            return False
        if isinstance(e, Call) and (e.fn == self.model or e.fn == "append"):
            return False
        return all(self.local(c) for c in e.children())

    def scalar(self, e: Expr) -> bool:
        """Does ``e`` have shape ``()``?"""
        shape = self.env.infer(e, scope=self.scope)
        return shape is not None and tuple(shape) == ()

    def vector(self, e: Expr) -> bool:
        """Is ``e`` one-dimensional (a row scaling's factors)?"""
        return len(self.env.infer(e, scope=self.scope) or ()) == 1

    def note_grads(self, e: Expr) -> None:
        """Record the ``grad(...)`` calls in ``e`` (the first of equal ones)."""
        for c in e.walk():
            if isinstance(c, Call) and c.fn == "grad":
                self.grads.setdefault(unparse(c), c)

    def note_sides(self, e: Expr, i: int) -> None:
        """Record the sides that the per-channel factors in a token-local term scale (e.g. a step
        size per channel on a gradient, ``diag(c) @ grad(...)``): the state's weights carry them."""
        for n in e.walk():
            if isinstance(n, BinOp) and n.op == "@":
                for d, t, side in ((n.left, n.right, "row"), (n.right, n.left, "col")):
                    if isinstance(d, Call) and d.fn == "diag" and len(self.env.infer(t, scope=self.scope) or ()) == 2:
                        self.sides.setdefault(self.spec.update[i].target, set()).add(side)

    def pure_temps(self) -> dict:
        """The temporaries that are token-local inputs -> their values."""
        return {t: v.rest if v.rest is not None else Num(0) for t, v in self.temps.items() if not v.coeffs}

    def walk(self, e: Expr, i: int) -> _Affine:
        """``e`` (in statement ``i``) as an affine form of the states before the token, or
        :class:`NotRecurrence` saying which term is not a token-local scalar times a state."""
        if self.local(e):
            self.note_grads(e)
            self.note_sides(e, i)
            pure = self.pure_temps()
            return _Affine({}, substitute(e, pure) if pure else e)
        if isinstance(e, Name):
            if e.id in self.temps:   # (its per-channel sides are the reading statement's too)
                self.sides.setdefault(self.spec.update[i].target, set()).update(self.sides.get(e.id, ()))
                return _Affine(dict(self.temps[e.id].coeffs), self.temps[e.id].rest)
            if e.id != self.spec.update[i].target and self.last.get(e.id, i) < i:
                return _Affine({("cur", e.id): Num(1)}, None)   # finished earlier in this token
            v = self.cur[e.id]
            return _Affine(dict(v.coeffs), v.rest)
        if isinstance(e, Neg):
            return _negated(self.walk(e.operand, i))
        if isinstance(e, BinOp) and e.op in "+-":
            a, b = self.walk(e.left, i), self.walk(e.right, i)
            if e.op == "-":
                b = _negated(b)
            coeffs = dict(a.coeffs)
            for k, c in b.coeffs.items():
                coeffs[k] = term_add(coeffs.get(k), c)
            return _Affine({k: c for k, c in coeffs.items() if c is not None}, term_add(a.rest, b.rest))
        factor = _factor(e, self.local, self.scalar, self.vector)
        if factor is not None:   # c * X (c a token-local scalar), diag(c) @ X or X @ diag(c) (per row / column)
            c, t, lift, side = factor
            if side is not None:
                self.sides.setdefault(self.spec.update[i].target, set()).add(side)
            v = self.walk(t, i)
            return _Affine({k: term_mul(c, cf) for k, cf in v.coeffs.items()}, lift(v.rest))
        if isinstance(e, BinOp) and e.op == "/" and self.local(e.right) and self.scalar(e.right):
            v = self.walk(e.left, i)
            return _Affine({k: term_div(c, e.right) for k, c in v.coeffs.items()}, term_div(v.rest, e.right))
        if self.inputs:
            tin = self.token_input(e, i)
            if tin is not None:
                return tin
        raise NotRecurrence(f"`{unparse(e)}` is not a token-local scalar times a state")

    def token_input(self, e: Expr, i: int) -> Optional[_Affine]:
        """``e`` as an input of the recurrence: a function of token-local values and of states
        other than the statement's target, each read as a solved sequence (None if not)."""
        spec, target = self.spec, self.spec.update[i].target
        subst: dict = {}
        for n in e.walk():
            if isinstance(n, Call) and (n.fn == self.model or n.fn == "append"):
                return None
            if isinstance(n, Name) and n.id in self.temps and self.temps[n.id].coeffs:
                return None
            if isinstance(n, Name) and n.id in spec.state:
                if n.id == target or spec.state[n.id].cache:
                    return None
                finished = self.last.get(n.id, -1) < i and n.id in self.last
                if not finished and self.cur[n.id].coeffs != {("prev", n.id): Num(1)}:
                    return None   # written earlier in this token, not finished: not one sequence
                when = "cur" if finished else "prev"
                subst[n.id] = Name(input_name(when, n.id))
                self.used_inputs[target].add((when, n.id))
        if target not in spec.state:
            return None
        self.note_grads(e)
        return _Affine({}, substitute(e, {**self.pure_temps(), **subst}))

    def mirror_step(self, e: Expr, target: str, i: int) -> Optional[_Affine]:
        """``c * softmax(a * log(S) + X, d)``: the recurrence of the logits (None if not)."""
        c, sm = Num(1), e
        if isinstance(e, BinOp) and e.op == "*":
            for s_, t_ in ((e.left, e.right), (e.right, e.left)):
                if isinstance(t_, Call) and t_.fn == "softmax" and self.local(s_) and self.scalar(s_):
                    c, sm = s_, t_
        if not (isinstance(sm, Call) and sm.fn == "softmax" and len(sm.args) == 2):
            return None
        if self.last.get(target) != i or self.cur[target].coeffs != {("prev", target): Num(1)}:
            return None   # the mirror step must be the state's only statement
        logs = [n for n in sm.args[0].walk() if isinstance(n, Call) and n.fn == "log"
                and n.args and isinstance(n.args[0], Name) and n.args[0].id == target]
        if not logs:
            return None
        arg = rewrite(sm.args[0], lambda n: Name(target) if isinstance(n, Call) and n.fn == "log" and n.args
                      and isinstance(n.args[0], Name) and n.args[0].id == target else None)
        try:
            z = self.walk(arg, i)
        except NotRecurrence:
            return None
        if set(z.coeffs) != {("prev", target)}:
            return None
        self.mirror[target] = (c, sm.args[1].id)
        return z
