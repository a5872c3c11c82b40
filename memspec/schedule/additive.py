"""Family ``additive``: ``S_t = Diag(gamma_t) S_{t-1} + A_t`` -- a token-local decay of the
state's rows (a scalar, or one per key channel: GLA, RWKV-6, HGRN-2) and an increment
independent of every state, read through linear probes ``p_t @ S`` -- exact in chunked form
(intra-chunk decay-weighted products, inter-chunk state).

Decided on the normal form (:mod:`.transition`), so a decay written ``diag(d) @ S``,
``(S.T * d).T`` or in a let is the same decay; gradients that do not depend on the state
(losses linear in a linear model) are increments too.

An increment with an exponential scalar factor ``exp(x) outer(a, b)`` (xLSTM's mLSTM input gate
written as its preactivation, ``exp(ig)``) passes ``x`` to the kernel as a log input weight: the
kernel carries a max stabiliser (:mod:`.stabiliser`), so the factor never overflows.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..lang.expr import BinOp, Call, Expr, Name, rewrite
from .algebra import ZERO, Algebra, NotAdmitted, is_num, simplify, txt
from .polynomial import Probe, find_probes
from .ranges import check_decay
from .stabiliser import exp_weight, find_stabiliser
from .transition import diagonal, normal_form, side_text


@dataclass(frozen=True)
class AdditiveState:
    """``S_t = Diag(gamma_t) S_{t-1} + sum_i outer(a_i, b_i)`` (matrix state) or
    ``z_t = gamma_t * z_{t-1} + sum_i b_i * a_i`` (vector state, ``b_i`` a scalar).

    ``gamma`` is a token-local scalar, or a vector ``[d_k]`` (a decay per key channel: the rows
    of S); None when the state does not decay (gamma = 1)."""

    name: str
    gamma: Expr | None
    terms: tuple[tuple[Expr, Expr], ...]
    vector: bool
    log_input: Expr | None = None   # a single term's exponential factor exp(log_input), taken out of it


@dataclass(frozen=True)
class AdditivePlan:
    states: tuple[AdditiveState, ...]
    probes: tuple[Probe, ...]
    read: Expr                  # the read with every probe replaced by Name(probe.name)
    inclusive: bool             # write_read: token t reads the state after its own write


def analyse_additive(alg: Algebra) -> tuple[AdditivePlan, list[str]]:
    """The additive family from the normal form: every state's transition is a diagonal on its
    own rows, ``T = Diag(gamma)`` (``gamma`` a token-local scalar, or a vector: a decay per key
    channel), and its increment is independent of every state."""
    spec = alg.spec
    nf = normal_form(alg)
    reasons = []
    states = []
    for n, st in alg.states.items():
        m = nf.maps[n]
        for t in m.terms:
            if t.state != n:
                raise NotAdmitted(f"the update of {n} reads state {t.state} (not independent of the state)")
            if t.left.kind == "outer":
                raise NotAdmitted(f"the transition of {n} has a rank-one term {side_text(t.left)} (the state corrects "
                                  f"itself): not an additive running sum")
            if t.right.kind not in ("I", "vec"):
                raise NotAdmitted(f"the decay of {n} acts on its columns ({n} {side_text(t.right)}): the chunk "
                                  f"kernel decays the key axis")
        gamma = diagonal(m.terms)
        if gamma is None or is_num(simplify(gamma), 0):
            raise NotAdmitted(f"the update of {n} overwrites it (decay 0): not a recurrence")
        gamma = simplify(gamma)
        per_channel = alg.rank(gamma) == 1   # chunk_additive takes the log decay [B, T, H, K]
        dr = check_decay(alg, None if is_num(gamma, 1) else gamma, f"of {n}")
        inc: Expr = ZERO
        for a, b in m.incs:
            inc = BinOp("+", inc, Call("outer", (a, b)) if not m.vector else BinOp("*", b, a))
        if is_num(gamma, 1):
            decay = "no decay"
        elif per_channel:
            decay = f"a token-local decay per key channel Diag({txt(gamma)})"
        else:
            decay = f"a token-local scalar decay {txt(gamma)}"
        rec = txt(BinOp("+", BinOp("@", Call("diag", (gamma,)), Name(n)) if per_channel
                        else BinOp("*", gamma, Name(n)), inc))
        reasons.append(f"update of {n} is affine in {n}: {n} <- {rec}, with {decay} "
                       f"and an increment {txt(inc)} independent of the state")
        if dr:
            reasons.append(dr)
        terms, log_input = tuple(m.incs), None
        weighted = exp_weight(alg, terms)
        if weighted is not None and per_channel:
            reasons.append(f"the increment of {n} has an exponential factor exp({txt(weighted[0])}); with a decay "
                           f"per key channel the kernel takes it as it is (not stabilised: it overflows float32 "
                           f"above exp(88))")
        elif weighted is not None:
            log_input, terms = weighted
            reasons.append(f"the increment of {n} has an exponential input weight exp({txt(log_input)}): the kernel "
                           f"keeps it in log space and carries a max stabiliser m (xLSTM's mLSTM: the state between "
                           f"chunks as exp(-m) {n}, each output row scaled by the running max of its own log "
                           f"weights), so no exp overflows and the numbers are the unstabilised function's")
        reasons += _exp_gates(spec, terms, n)
        states.append(AdditiveState(n, None if is_num(gamma, 1) else gamma, terms, m.vector, log_input))
    if any(st.log_input is not None for st in states):
        stab, why = find_stabiliser(alg)
        reasons.append("the online step carries the same stabiliser (one m for every state)" if stab else
                       f"the online step computes the exponential input weight as written (in float32 it overflows "
                       f"above 88): {why}")
    read, probes = find_probes(alg, alg.inline(spec.read), set(alg.states))
    reasons.append("the read is a function of the linear probes "
                   + ", ".join(txt(BinOp("@", p.vector, Name(p.state))) for p in probes)
                   + " of the states with token-local probe vectors" if probes
                   else "the read does not use the states")
    if spec.order == "read_write":
        reasons.append("each token reads the state before its own write (order read_write): the kernel's exclusive "
                       "read, pairs s < t inside a chunk")
    if probes and _has_token_local_term(read, {p.name for p in probes}):
        by = {p.name: BinOp("@", p.vector, Name(p.state)) for p in probes}
        shown = rewrite(read, lambda e: by.get(e.id) if isinstance(e, Name) else None)
        reasons.append(f"the read {txt(shown)} adds token-local terms to the probes (e.g. a bonus for the current "
                       f"token): computed for all tokens at once beside the kernel's probe outputs")
    reasons.append("exact chunk form: intra-chunk masked decay-weighted products + inter-chunk state")
    return AdditivePlan(tuple(states), tuple(probes), read, spec.order == "write_read"), reasons


def _exp_gates(spec, terms, n: str) -> list[str]:
    """A note for each gate in the increment of ``n`` whose formula applies ``exp``: the layer
    computes it before the memory, so in float32 its exp overflows above 88 (inf, then NaN
    outputs) and the kernel cannot stabilise it."""
    used = {x.id for a, b in terms for e in (a, b) for x in e.walk() if isinstance(x, Name)}
    return [f"note: the gate {g} = {txt(spec.gates[g].formula)} in the increment of {n} is computed before the "
            f"memory: in float32 its exp overflows above 88 (inf, then NaN outputs); a gate of its preactivation "
            f"({g} = logit) with exp({g}) in the update runs in the stabilised kernel"
            for g in sorted(used & set(spec.gates))
            if any(isinstance(x, Call) and x.fn == "exp" for x in spec.gates[g].formula.walk())]


def _has_token_local_term(read: Expr, probe_names: set[str]) -> bool:
    """Is the read a sum with a term that reads no probe (``_p0 + q @ (u * k) * v``)?"""
    def terms(e: Expr):
        if isinstance(e, BinOp) and e.op in ("+", "-"):
            return terms(e.left) + terms(e.right)
        return [e]

    return any(not any(isinstance(n, Name) and n.id in probe_names for n in t.walk()) for t in terms(read))


def additive_states_ok(alg: Algebra) -> bool:
    """Are all state updates additive running sums (a diagonal transition on each state's own
    rows, an increment independent of the state), even if the read is not a probe?"""
    try:
        nf = normal_form(alg)
    except NotAdmitted:
        return False
    return all(t.state == n and t.left.kind in ("I", "diag") and t.right.kind in ("I", "vec")
               for n, m in nf.maps.items() for t in m.terms)
