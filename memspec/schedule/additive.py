"""Family ``additive``: ``S_t = gamma_t S_{t-1} + A_t`` with a token-local scalar decay and an
increment independent of every state, read through linear probes ``p_t @ S`` -- exact in
chunked form (intra-chunk masked decay-weighted products, inter-chunk state).

Gradients that do not depend on the state (losses linear in a linear model) are
increments too.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..lang.expr import BinOp, Call, Expr, Name, Neg, unparse
from .algebra import (ONE, ZERO, Algebra, NotAdmitted, all_updates, compose_all, grad_calls, is_num, mul,
                      replace_call, simplify, txt)
from .polynomial import Probe, find_probes, linear_form, symbolic_grad
from .ranges import check_decay


@dataclass(frozen=True)
class AdditiveState:
    """``S_t = gamma_t * S_{t-1} + sum_i outer(a_i, b_i)`` (matrix state) or
    ``z_t = gamma_t * z_{t-1} + sum_i b_i * a_i`` (vector state, ``b_i`` a scalar).

    ``gamma`` is None when the state does not decay (gamma = 1)."""

    name: str
    gamma: Expr | None
    terms: tuple[tuple[Expr, Expr], ...]
    vector: bool


@dataclass(frozen=True)
class AdditivePlan:
    states: tuple[AdditiveState, ...]
    probes: tuple[Probe, ...]
    read: Expr                  # the read with every probe replaced by Name(probe.name)
    inclusive: bool             # write_read: token t reads the state after its own write


def outer_terms(alg: Algebra, A: Expr, S: str) -> list[tuple[Expr, Expr]]:
    """Decompose a token-local increment into ``sum_i outer(a_i, b_i)`` (matrix) or ``b_i * a_i``."""
    rank = alg.rank(Name(S))
    if isinstance(A, BinOp) and A.op in "+-" and alg.rank(A.left) == rank and alg.rank(A.right) == rank:
        left = outer_terms(alg, A.left, S)
        right = outer_terms(alg, A.right, S)
        if A.op == "-":
            right = [(a, simplify(Neg(b))) for a, b in right]
        return left + right
    if isinstance(A, Neg) and rank == 2:
        return [(a, simplify(Neg(b))) for a, b in outer_terms(alg, A.operand, S)]
    if is_num(A, 0):
        return []
    if rank == 2:
        if isinstance(A, Call) and A.fn == "outer":
            return [(A.args[0], A.args[1])]
        if isinstance(A, BinOp) and A.op in "*/":
            inner, factor = A.left, A.right
            if A.op == "*" and alg.is_scalar(A.left):
                inner, factor = A.right, A.left
            if alg.is_scalar(factor):
                return [(a, simplify(BinOp("*", factor, b) if A.op == "*" else BinOp("/", b, factor)))
                        for a, b in outer_terms(alg, inner, S)]
        raise NotAdmitted(f"the increment {txt(A)} of {S} is not a sum of outer products")
    if rank == 1:
        if isinstance(A, BinOp) and A.op in "*/" and alg.rank(A) == 1:
            if A.op == "*" and alg.is_scalar(A.left) and alg.rank(A.right) == 1:
                return [(a, mul(b, A.left)) for a, b in outer_terms(alg, A.right, S)]
            if alg.is_scalar(A.right) and alg.rank(A.left) == 1:
                return [(a, simplify(BinOp(A.op, b, A.right))) for a, b in outer_terms(alg, A.left, S)]
        if alg.rank(A) == 1:
            return [(A, ONE)]
    raise NotAdmitted(f"the increment {txt(A)} of {S} has an unsupported shape")


def analyse_additive(alg: Algebra) -> tuple[AdditivePlan, list[str]]:
    spec = alg.spec
    if not alg.states:
        raise NotAdmitted("the spec has no state")
    if alg.caches:
        raise NotAdmitted(f"state {', '.join(sorted(alg.caches))} is a cache")
    for n, s in alg.states.items():
        if len(s.shape) not in (1, 2):
            raise NotAdmitted(f"state {n} has rank {len(s.shape)}; the chunk form needs a vector or a matrix")
    # gradients that do not depend on the state (losses linear in a linear model) are increments
    updates = []
    for tgt, e in all_updates(alg):
        for g in grad_calls(e):
            W = alg.grad_target(g)
            loss = alg.loss()
            if W is None or loss is None:
                raise NotAdmitted(f"the update of {tgt} takes a gradient the analysis cannot derive")
            try:
                gf = symbolic_grad(alg, loss, W)
            except NotAdmitted as err:
                what = (f"the update of {tgt} is not affine in {tgt} with a state-independent increment"
                        if tgt in alg.states else f"the temporary {tgt} is not a state-independent increment")
                raise NotAdmitted(f"{what}: {unparse(g)} of a nonlinear model ({err})") from None
            if gf.scale is not None:
                what = f"the increment of {tgt}" if tgt in alg.states else f"the temporary {tgt}"
                raise NotAdmitted(f"{what} depends on the state: {unparse(g)} = {gf.text}")
            repl = Call("outer", (gf.p, gf.lin)) if gf.p is not None else ZERO
            e = replace_call(e, g, repl)
        updates.append((tgt, e))
    final = compose_all(alg, updates)
    reasons = []
    states = []
    for n, st in alg.states.items():
        if n not in final:
            raise NotAdmitted(f"state {n} is never written")
        coef, rest = linear_form(alg, final[n], set(alg.states), "the states")
        others = sorted(k for k, v in coef.items() if k != n and not is_num(v, 0))
        if others:
            raise NotAdmitted(f"the update of {n} reads state {', '.join(others)} (not independent of the state)")
        gamma = simplify(coef.get(n, ZERO))
        if alg.depends(rest):
            raise NotAdmitted(f"the increment {txt(rest)} of {n} depends on a state")
        if is_num(gamma, 0):
            raise NotAdmitted(f"the update of {n} overwrites it (decay 0): not a recurrence")
        terms = outer_terms(alg, rest, n)
        dr = check_decay(alg, None if is_num(gamma, 1) else gamma, f"of {n}")
        inc: Expr = ZERO
        for a, b in terms:
            inc = BinOp("+", inc, Call("outer", (a, b)) if len(st.shape) == 2 else BinOp("*", b, a))
        rec = txt(BinOp("+", BinOp("*", gamma, Name(n)), inc))
        decay = "no decay" if is_num(gamma, 1) else f"a token-local scalar decay {txt(gamma)}"
        reasons.append(f"update of {n} is affine in {n}: {n} <- {rec}, with {decay} "
                       f"and an increment {txt(inc)} independent of the state")
        if dr:
            reasons.append(dr)
        states.append(AdditiveState(n, None if is_num(gamma, 1) else gamma, tuple(terms), len(st.shape) == 1))
    read, probes = find_probes(alg, alg.inline(spec.read), set(alg.states))
    reasons.append("the read is a function of the linear probes "
                   + ", ".join(txt(BinOp("@", p.vector, Name(p.state))) for p in probes)
                   + " of the states with token-local probe vectors" if probes
                   else "the read does not use the states")
    reasons.append("exact chunk form: intra-chunk masked decay-weighted products + inter-chunk state")
    return AdditivePlan(tuple(states), tuple(probes), read, spec.order == "write_read"), reasons


def additive_states_ok(alg: Algebra) -> bool:
    """Are all state updates additive (even if the read is not a probe)?"""
    try:
        final = compose_all(alg, all_updates(alg))
        for n in alg.states:
            if alg.states[n].cache or n not in final or grad_calls(final[n]):
                return False
            coef, rest = linear_form(alg, final[n], set(alg.states))
            if set(k for k, v in coef.items() if not is_num(v, 0)) - {n} or alg.depends(rest):
                return False
        return True
    except NotAdmitted:
        return False
