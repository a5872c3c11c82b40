"""Family ``scan``: ``h_t = a_t ⊙ h_{t-1} + b_t`` -- every state an elementwise linear recurrence
(a vector or a matrix; the decay ``a`` token-local, of any sign, a scalar, per channel or one per
entry; the increment ``b`` token-local) read by any token-local function of the states -- exact in
chunked form: a scan within each chunk vectorised over the chunks, one carry per chunk, every
token's state materialised (HGRN, Griffin's RG-LRU, Mamba-1's selective scan).

Decided on the update program composed over the token (lets, temporaries and the model inlined),
so ``f * h``, ``diag(f) @ h`` and ``h - (1 - f) * h`` are the same decay.  Families that read the
state only through probes (:mod:`.additive`) come first: they never materialise the states.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..lang.expr import BinOp, Call, Expr, Name, Neg, Transpose, is_diag
from .algebra import (ONE, ZERO, Algebra, NotAdmitted, compose, grad_calls, is_num, mul, names_in, simplify,
                      state_updates, txt)
from .ranges import fmt_bound, value_range


@dataclass(frozen=True)
class Factor:
    """One factor of a decay: ``value`` multiplies the state elementwise (``on = "all"``: numpy's
    trailing-axis broadcasting, so a ``[d_v]`` value scales a matrix's columns) or scales its rows
    (``on = "rows"``: ``diag(value) @ S`` of a matrix state)."""

    value: Expr
    on: str


@dataclass(frozen=True)
class ScanState:
    """``S_t = (product of decay) ⊙ S_{t-1} + increment``; ``decay`` empty: no decay."""

    name: str
    decay: tuple[Factor, ...]
    increment: Expr


@dataclass(frozen=True)
class ScanPlan:
    states: tuple[ScanState, ...]
    read: Expr                  # the read, inlined: a token-local function of the states
    inclusive: bool             # write_read: token t reads the state after its own write


def _scale(coef: tuple[Factor, ...] | None, f: Factor, scalar: bool = False) -> tuple[Factor, ...] | None:
    """``coef`` times one more factor: merged into a factor on the same axes when there is one (a
    ``scalar`` into the first factor, whatever its axes)."""
    if coef is None:
        return None
    for i, g in enumerate(coef):
        if g.on == f.on or scalar:
            return coef[:i] + (Factor(mul(g.value, f.value), g.on),) + coef[i + 1:]
    return coef + (f,)


def _apply(f: Factor, e: Expr) -> Expr:
    """The factor applied to a token-local value (the increment of an earlier statement)."""
    if _is(f.value, 1):
        return e
    return simplify(BinOp("@", Call("diag", (f.value,)), e)) if f.on == "rows" else mul(f.value, e)


def _is(e: Expr, v: float) -> bool:
    return is_num(simplify(e), v)


class _Linear:
    """``e = coef ⊙ S + inc`` for one state ``S`` (``coef`` None: ``e`` does not read ``S``)."""

    def __init__(self, alg: Algebra, S: str):
        self.alg, self.S = alg, S
        self.rank = len(alg.states[S].shape)

    def factor(self, value: Expr, rows: bool = False) -> Factor:
        # a scalar scales every entry; a per-channel value on the rows of a vector is elementwise
        return Factor(simplify(value), "rows" if rows and self.rank == 2 and self.alg.rank(value) == 1 else "all")

    def __call__(self, e: Expr):
        alg, S = self.alg, self.S
        others = sorted((names_in(e) & set(alg.states)) - {S})
        if others:
            raise NotAdmitted(f"the update of {S} reads state {', '.join(others)} (the states are coupled): the "
                              f"scan runs each state alone")
        if S not in names_in(e):
            return None, e
        if isinstance(e, Name):
            return (), ZERO
        if isinstance(e, Neg):
            c, i = self(e.operand)
            return _scale(c, Factor(Neg(ONE), "all"), scalar=True), simplify(Neg(i))
        if isinstance(e, BinOp) and e.op in "+-":
            (c1, i1), (c2, i2) = self(e.left), self(e.right)
            if e.op == "-":
                c2 = _scale(c2, Factor(Neg(ONE), "all"), scalar=True)
            return self._add(c1, c2, e), simplify(BinOp(e.op, i1, i2))
        if isinstance(e, BinOp) and e.op in "*/":
            m, x = (e.left, e.right) if S not in names_in(e.left) else (e.right, e.left)
            if S in names_in(m) or (e.op == "/" and x is e.right):
                raise NotAdmitted(f"{txt(e)} is not linear in {S}")
            c, i = self(x)
            f = m if e.op == "*" else BinOp("/", ONE, m)
            return _scale(c, self.factor(f), scalar=alg.rank(f) == 0), mul(f, i)
        if isinstance(e, BinOp) and e.op == "@" and (is_diag(e.left) or is_diag(e.right)):
            left = is_diag(e.left)
            d, x = (e.left.args[0], e.right) if left else (e.right.args[0], e.left)
            if S in names_in(d):
                raise NotAdmitted(f"{txt(e)} is not linear in {S}")
            c, i = self(x)
            f = self.factor(d, rows=left)
            return _scale(c, f, scalar=alg.rank(d) == 0), _apply(f, i) if left else simplify(BinOp("@", i, e.right))
        if isinstance(e, BinOp) and e.op == "@":
            raise NotAdmitted(f"the update of {S} multiplies it by a matrix ({txt(e)}): not elementwise")
        if isinstance(e, Transpose):
            raise NotAdmitted(f"the update of {S} transposes it ({txt(e)}): not elementwise")
        if isinstance(e, Call) and e.fn in ("outer", "sum", "mean"):
            raise NotAdmitted(f"the update of {S} mixes its entries ({txt(e)}): linear, but not elementwise")
        raise NotAdmitted(f"{S} enters {txt(e)} nonlinearly")

    def _add(self, c1, c2, e):
        if c1 is None or c2 is None:
            return c2 if c1 is None else c1
        one1 = _single(c1)
        one2 = _single(c2)
        if one1 is None or one2 is None or (one1.on != one2.on and not (self._scalar(one1) or self._scalar(one2))):
            raise NotAdmitted(f"the update of {self.S} sums decays on different axes ({txt(e)})")
        on = one1.on if not self._scalar(one1) else one2.on
        return (Factor(simplify(BinOp("+", one1.value, one2.value)), on),)

    def _scalar(self, f: Factor) -> bool:
        return self.alg.rank(f.value) == 0


def _single(coef: tuple[Factor, ...]) -> Factor | None:
    if not coef:
        return Factor(ONE, "all")
    return coef[0] if len(coef) == 1 else None


def decay_text(S: str, decay: tuple[Factor, ...]) -> str:
    out = Name(S)
    for f in decay:
        out = BinOp("@", Call("diag", (f.value,)), out) if f.on == "rows" else BinOp("*", f.value, out)
    return txt(out)


def analyse_scan(alg: Algebra) -> tuple[ScanPlan, list[str]]:
    """The scan family: each state's update over the token is ``a ⊙ S + b`` with ``a`` and ``b``
    token-local; the read any token-local function of the states."""
    spec = alg.spec
    if not alg.states:
        raise NotAdmitted("the spec has no state")
    if alg.caches:
        raise NotAdmitted(f"state {', '.join(sorted(alg.caches))} is a cache")
    blocks = sorted(n for n, st in spec.state.items() if st.every and st.every > 1)
    if blocks:
        raise NotAdmitted(f"state {', '.join(blocks)} updates once per block (every C)")
    ups = state_updates(alg)
    for tgt, e in ups:
        if grad_calls(e):
            raise NotAdmitted(f"the update of {tgt} takes a gradient (a scan needs the update written as a ⊙ {tgt} + b)")
    after = compose(alg, ups)
    reasons, states = [], []
    for n in alg.states:
        coef, inc = _Linear(alg, n)(after.get(n, Name(n)))
        if coef is None:
            raise NotAdmitted(f"the update of {n} overwrites it (decay 0): not a recurrence")
        coef = tuple(f for f in coef if not _is(f.value, 1))
        if any(_is(f.value, 0) for f in coef):
            raise NotAdmitted(f"the update of {n} overwrites it (decay 0): not a recurrence")
        inc = simplify(inc)
        rec = decay_text(n, coef) if coef else n
        what = ("no decay" if not coef else "a token-local elementwise decay "
                + " and ".join(("rows " if f.on == "rows" else "") + txt(f.value) for f in coef))
        reasons.append(f"update of {n} is elementwise linear in {n}: {n} <- {rec} + {txt(inc)}, with {what} and an "
                       f"increment {txt(inc)} independent of the state")
        for f in coef:
            lo, hi = value_range(alg, f.value)
            if lo < 0:
                reasons.append(f"the decay {txt(f.value)} of {n} may be negative: the chunk form multiplies decays, "
                               f"it never takes their log")
            else:
                reasons.append(f"the decay {txt(f.value)} of {n} lies in [{fmt_bound(lo)}, {fmt_bound(hi)}]")
        states.append(ScanState(n, coef, inc))
    read = alg.inline(spec.read)
    if grad_calls(read) or any(isinstance(c, Call) and c.fn == "attend" for c in read.walk()):
        raise NotAdmitted(f"the read {txt(read)} takes a gradient or attends (not a token-local function)")
    cubic = next((c for c in read.walk() if isinstance(c, Call) and c.fn in ("solve", "cg", "newton_schulz")
                  and alg.depends(c)), None)
    if cubic is not None:
        raise NotAdmitted(f"the read {txt(cubic)} solves or iterates with the state, cubic in its size per token: "
                          f"a scan would batch only the state materialisation while the per-token read dominates")
    used = sorted(names_in(read) & set(alg.states))
    reasons.append(f"the read {txt(read)} is a token-local function of "
                   + (f"the state{'s' if len(used) > 1 else ''} {', '.join(used)}: evaluated on every token's "
                      f"state, all chunks at once" if used else "no state"))
    if spec.order == "read_write":
        reasons.append("each token reads the state before its own write (order read_write): the states shifted by "
                       "one token")
    reasons.append("exact chunk form: a scan within each chunk, vectorised over the chunks, one carry per chunk; "
                   "only products of decays enter (no division, no log): finite for any decay, of any sign")
    return ScanPlan(tuple(states), read, spec.order == "write_read"), reasons


def hint_applies(spec) -> bool:
    """Is the scan's hint worth printing: a read that does not solve with the state per token?"""
    return not any(isinstance(c, Call) and c.fn in ("solve", "cg", "newton_schulz") for c in spec.read.walk())


VECTOR_CHUNK = 16


def preferred_chunk(alg: Algebra, plan: ScanPlan):
    """(chunk, reason) when every state is a vector; None (the default chunk) otherwise."""
    if any(len(alg.states[st.name].shape) > 1 for st in plan.states):
        return None
    return VECTOR_CHUNK, (f"every state is a vector: chunks of {VECTOR_CHUNK} tokens, about 3 x {VECTOR_CHUNK} "
                          f"elementwise steps per level over log_{VECTOR_CHUNK}(T) levels (ask for another size "
                          f"with schedule: chunk(N))")
