"""Exponential input weights and their max stabiliser (xLSTM's m state).

A running sum whose one increment carries a scalar factor ``exp(x)`` -- xLSTM's mLSTM,
``C_t = f_t C_{t-1} + exp(i_t) k_t v_tᵀ``, with the input gate written as its preactivation --
overflows float32 once ``exp(x)`` passes 3.4e38 (x > 88), although its reads (a ratio of two
such sums) stay of order one.  Beck et al. 2024 (§2.2) carry the states scaled by ``exp(-m)``
with a stabiliser ``m``:

    m_t = max(log f_t + m_{t-1}, x_t)
    S̃_t = exp(log f_t + m_{t-1} - m_t) S̃_{t-1} + exp(x_t - m_t) A_t

so that ``S̃_t = exp(-m_t) S_t`` exactly (by induction), every factor is at most 1, and a read
homogeneous in the probes of the states reads the same from ``S̃`` (the probe-free terms scaled
by ``exp(-m)``).  This module finds that structure on the normal form: the chunked kernel of the
additive family and the per-token step of the online family both carry it.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..lang.blocks import block_statements, frequencies
from ..lang.expr import BinOp, Call, Expr, Num
from .algebra import Algebra, NotAdmitted, is_num, simplify, txt
from .polynomial import Probe, find_probes
from .transition import diagonal, normal_form


@dataclass(frozen=True)
class StabilisedState:
    """``S_t = gamma_t S_{t-1} + exp(x_t) sum_i outer(a_i, b_i)`` (matrix) or ``+ exp(x_t) b * a``
    (vector): ``terms`` are the ``(a, b)`` without the factor."""

    name: str
    terms: tuple[tuple[Expr, Expr], ...]
    vector: bool


@dataclass(frozen=True)
class Stabiliser:
    """Every state a running sum with the same scalar decay ``gamma`` and the same exponential
    input weight ``exp(log_input)``, read through the linear probes ``probes`` (``read`` with
    each replaced by its name): one stabiliser m serves them all."""

    gamma: Expr
    log_input: Expr
    states: tuple[StabilisedState, ...]
    probes: tuple[Probe, ...]
    read: Expr


def exp_weight(alg: Algebra, terms) -> tuple[Expr, tuple] | None:
    """``(x, terms without the factor)`` when a state's one increment ``outer(a, b)`` has a
    scalar factor ``exp(x)`` in ``a`` or ``b`` (a product), else None."""
    if len(terms) != 1:
        return None
    a, b = terms[0]
    for side in (1, 0):
        found = _take_exp(alg, (a, b)[side])
        if found is not None:
            x, rest = found
            return x, ((rest, b) if side == 0 else (a, rest),)
    return None


def _take_exp(alg: Algebra, e: Expr) -> tuple[Expr, Expr] | None:
    """``(x, e / exp(x))`` for a factor ``exp(x)`` of the product ``e`` with ``x`` a scalar."""
    if isinstance(e, Call) and e.fn == "exp" and alg.rank(e.args[0]) == 0:
        return e.args[0], Num(1)
    if isinstance(e, BinOp) and e.op in ("*", "/"):
        for i, part in enumerate((e.left, e.right) if e.op == "*" else (e.left,)):
            found = _take_exp(alg, part)
            if found is not None:
                x, rest = found
                other = e.right if i == 0 else e.left
                if e.op == "/":
                    return x, BinOp("/", rest, e.right)
                return x, other if is_num(rest, 1) else BinOp("*", rest, other) if i == 0 else BinOp("*", other, rest)
    return None


def find_stabiliser(alg: Algebra) -> tuple[Stabiliser | None, str]:
    """The stabiliser of a memory whose every state is a running sum with one scalar decay and
    one exponential input weight, both shared by all states, read through linear probes -- or
    None and the reason it does not apply."""
    spec = alg.spec
    if block_statements(spec, frequencies(spec)):
        return None, "a state updates once per block"
    try:
        nf = normal_form(alg)
    except NotAdmitted as err:
        return None, str(err)
    shared: dict = {}   # the printed (decay, input weight) -> the pair
    states = []
    for n in alg.states:
        m = nf.maps[n]
        if any(t.state != n or t.left.kind not in ("I", "diag") or t.right.kind not in ("I", "vec")
               for t in m.terms):
            return None, f"the update of {n} is not a running sum of its own rows"
        gamma = diagonal(m.terms)
        if gamma is None or alg.rank(gamma) != 0 or is_num(simplify(gamma), 0):
            return None, f"the decay of {n} is not a token-local scalar"
        weighted = exp_weight(alg, tuple(m.incs))
        if weighted is None:
            return None, f"the increment of {n} has no exponential input weight exp(x)"
        log_input, terms = weighted
        gamma = simplify(gamma)
        shared[txt(gamma), txt(log_input)] = (gamma, log_input)
        states.append(StabilisedState(n, terms, m.vector))
    if len(shared) != 1:
        return None, "the states' decays or input weights differ (one stabiliser serves one pair)"
    try:
        read, probes = find_probes(alg, alg.inline(spec.read), set(alg.states))
    except NotAdmitted as err:
        return None, str(err)
    (gamma, log_input), = shared.values()
    return Stabiliser(gamma, log_input, tuple(states), tuple(probes), read), ""
