"""Family ``dplr``: a transition that is diagonal plus low rank on the key side, run as the
program's own rank-one sub-steps ``S <- Diag(d) S + a (bᵀ S) + outer(k, v)`` -- exact in the
chunked WY / UT form generalised to these transitions (one triangular solve per chunk over
the chunk's rank-one factors).

This covers what the delta family does not: a decay per key channel (Kimi Delta Attention,
GDN-2, RWKV-7), an asymmetric rank one (Comba's feedback key ``p != k``, RWKV-7's removal
key), several rank-one steps per token in order (DeltaProduct), and the rank-R transition of
one statement (its terms all read the state before the token).

The sub-steps come from the update program in its own order (:mod:`.transition` keeps each
statement's map): consecutive statements merge while the merged transition keeps at most one
rank-one term (a decay merges into the step next to it: ``(I - beta k kᵀ) Diag(g) = Diag(g)
- beta k (g * k)ᵀ``); the decay may only act on the first sub-step of a token.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..lang.expr import BinOp, Expr, Name
from ..lang.normalize import canon
from .algebra import ONE, Algebra, NotAdmitted, is_num, mul, simplify, txt
from .delta import grad_reasons
from .polynomial import Probe, find_probes
from .ranges import check_decay
from .transition import (Affine, apply, collect, describe, diagonal, join_terms, normal_form, one_state, ratio,
                         scaled_text, side_text, split_scalar, vec_text, without_factor)


@dataclass(frozen=True)
class DplrStep:
    """``S <- S + a (bᵀ S) + outer(k, v)`` after the first sub-step's decay: ``a`` and ``b`` the
    rank-one term (``a`` None: none), ``k`` and ``v`` the write.  As the plan's ``a_form`` and
    ``b_form`` say, ``a`` is the vector or the scalar ``c`` of ``a = c k``, and ``b`` the vector,
    the scalar ``c`` of ``b = c k``, or None for ``b = k``."""

    a: Expr | None
    b: Expr | None
    k: Expr
    v: Expr


@dataclass(frozen=True)
class DplrPlan:
    """``decay``: the first sub-step's ``d`` (a scalar, or a ``[d_k]`` vector per key channel;
    None: 1); ``steps`` in order; ``simultaneous``: the rank-one terms of one statement, all
    reading the state before the token (``S <- Diag(d) S + sum_r a_r (b_rᵀ S) + sum_r outer(k_r,
    v_r)``) instead of steps in order; ``read_after_decay``: the first sub-step reads the state
    after the decay (``S <- Diag(d) S + a (bᵀ Diag(d) S) + ...``: the error at the decayed memory,
    as the statements wrote it, with ``d`` divided out of ``a`` or ``b``); ``a_form`` / ``b_form``:
    how the steps give ``a`` and ``b`` (``vector``, ``scalar`` times the step's key, or ``key``
    itself)."""

    state: str
    decay: Expr | None
    steps: tuple[DplrStep, ...]
    simultaneous: bool
    read_after_decay: bool
    a_form: str
    b_form: str
    probes: tuple[Probe, ...]
    read: Expr
    inclusive: bool


# chunk_dplr halves a chunk with per-channel decays level by level (a power of two): 32 tokens measured
# fastest on CPU (KDA / GDN-2 / RWKV-7 memories, forward and forward + backward, 2-12 % faster than 16 or 64)
CHANNEL_CHUNK = 32


def preferred_chunk(alg: Algebra, plan: DplrPlan):
    """(chunk, reason) for a per-channel decay; None (the default chunk) otherwise."""
    if plan.decay is None or not alg.shape(plan.decay):
        return None
    return CHANNEL_CHUNK, (f"the decay is per key channel: chunks of {CHANNEL_CHUNK} tokens, halved level by level "
                           f"(ask for another size with schedule: chunk(N))")


def substeps(alg: Algebra, S: str, statements) -> list[Affine]:
    """The program's statements of ``S`` merged into sub-steps of at most one rank-one term."""
    steps: list[Affine] = []
    for st in statements:
        m = st.value
        if steps and _rank(steps[-1]) + _rank(m) <= 1:
            merged = apply(m.terms, {S: steps[-1]}, False)
            steps[-1] = collect(alg, Affine(merged.terms, merged.incs + m.incs, False))
        else:
            steps.append(m)
    return steps


def _rank(m: Affine) -> int:
    return sum(t.left.kind == "outer" for t in m.terms)


def analyse_dplr(alg: Algebra) -> tuple[DplrPlan, list[str]]:
    spec = alg.spec
    nf = normal_form(alg)
    S, m = one_state(alg, nf, "diagonal-plus-low-rank")
    reasons = grad_reasons(alg)
    reasons.append("normal form: " + describe(nf, alg)[0])
    if not any(t.left.kind == "outer" for t in m.terms):
        raise NotAdmitted(f"the transition of {S} has no rank-one term: it is additive")
    parts = substeps(alg, S, [st for st in nf.statements if st.target == S])
    simultaneous = len(parts) == 1 and _rank(parts[0]) > 1
    if not simultaneous and any(_rank(p) > 1 for p in parts):
        raise NotAdmitted(f"a statement of {S} has {max(_rank(p) for p in parts)} rank-one terms and the token "
                          f"takes further steps: the sub-steps of a token are rank one, in order")
    decay = None
    steps: list[DplrStep] = []
    for r, part in enumerate(parts):
        d = diagonal(part.terms)
        d = ONE if d is None else simplify(d)
        if r == 0:
            if is_num(d, 0):
                raise NotAdmitted(f"the update of {S} has decay 0")
            decay = None if is_num(d, 1) else d
        elif not is_num(d, 1):
            raise NotAdmitted(f"sub-step {r + 1} of {S} decays it again (Diag({txt(d)})): the kernel decays the "
                              f"state once per token, on its first sub-step")
        steps += _steps(alg, S, part, r)
    after = False
    if decay is not None and steps and steps[0].a is not None:
        decayed = _read_after_decay(alg, steps[0], decay)
        if decayed is not None:
            after = True
            steps[0] = decayed
    reasons.append(_substep_text(alg, S, decay, steps, simultaneous, after))
    reasons += [x for x in (check_decay(alg, decay, f"of {S}"),) if x]
    if decay is not None:
        reasons.append("a departure the kernel makes: a log decay below -40 per token counts as -40 (the past then "
                       "weighs e^-40 = 4e-18 instead of less: different from online only where the state is over "
                       "1e11 times the new terms)")
    read, probes = find_probes(alg, alg.inline(spec.read), {S})
    reasons.append("the read is a function of the linear probes "
                   + ", ".join(txt(BinOp("@", p.vector, Name(p.state))) for p in probes) if probes
                   else "the read does not use the state")
    reasons.append("exact chunk form: the WY / UT representation of the product of the chunk's "
                   "diagonal-plus-rank-one transitions, one triangular solve per chunk over its "
                   f"{'token' if len(steps) == 1 else f'{len(steps)} sub-steps per token'}")
    a_form, b_form = step_forms(alg, steps)
    steps = [DplrStep(_in_form(alg, st.a, st.k, a_form), _in_form(alg, st.b, st.k, b_form), st.k, st.v)
             for st in steps]
    return DplrPlan(S, decay, tuple(steps), simultaneous, after, a_form, b_form, tuple(probes), read,
                    spec.order == "write_read"), reasons


def _read_after_decay(alg: Algebra, st: DplrStep, decay: Expr) -> DplrStep | None:
    """The first step with its read at the decayed state, ``a (bᵀ Diag(d) S)``: ``d`` divided out of
    ``b`` (a decay per channel) or of ``a``'s scalar (a scalar decay); None when it is no factor
    (the error is read at the state before the decay)."""
    if alg.rank(decay) == 1:
        b = without_factor(st.b, decay)
        return None if b is None else DplrStep(st.a, b, st.k, st.v)
    c, u = split_scalar(alg, st.a)
    c2 = ratio(c, decay)
    return None if c2 is None else DplrStep(simplify(mul(c2, u)), st.b, st.k, st.v)


def _in_form(alg: Algebra, x: Expr | None, k: Expr, form: str) -> Expr | None:
    """``x`` as the kernel takes it: the vector, the scalar ``c`` of ``x = c k``, or None (``x = k``)."""
    if x is None or form == "key":
        return None
    if form == "scalar":
        return split_scalar(alg, x)[0]
    return x


def _steps(alg: Algebra, S: str, part: Affine, r: int) -> list[DplrStep]:
    """The kernel's steps of one merged sub-step: its rank-one terms with the writes (a write with
    no rank-one term of its own, or a second write, is a step of its own: it only adds)."""
    rank1 = [t for t in part.terms if t.left.kind == "outer"]
    writes = list(part.incs)
    if not writes:
        raise NotAdmitted(f"sub-step {r + 1} of {S} writes nothing: every sub-step of the kernel writes an "
                          f"outer(k, v)")
    out = []
    for i, t in enumerate(rank1):
        k, v = writes.pop(0) if writes else (None, None)
        if k is None:
            raise NotAdmitted(f"the rank-one term {side_text(t.left)} of {S} has no write of its own")
        out.append(DplrStep(simplify(mul(t.coef, t.left.u)), t.left.w, k, v))
    for k, v in writes:   # further writes: steps with no rank-one term
        out.append(DplrStep(None, None, k, v))
    return out


def _substep_text(alg: Algebra, S: str, decay, steps: list[DplrStep], simultaneous: bool, after: bool) -> str:
    lines = []
    for r, st in enumerate(steps):
        parts = []
        decayed = S
        if r == 0 and decay is not None:
            decayed = f"Diag({txt(decay)}) {S}" if alg.rank(decay) == 1 else f"{vec_text(decay)} {S}"
        parts.append((1, decayed))
        if st.a is not None:
            c, a = split_scalar(alg, st.a)
            seen = (decayed if alg.rank(decay) == 1 else f"({decayed})") if after and r == 0 else S
            parts.append(scaled_text(c, f"{vec_text(a)} ({vec_text(st.b)}ᵀ {seen})"))
        c, v = split_scalar(alg, st.v)
        parts.append(scaled_text(c, f"{vec_text(st.k)} {vec_text(v)}ᵀ"))
        lines.append(f"{S} <- " + join_terms(parts))
    how = "together (all reading the state before the token)" if simultaneous else "in order"
    return (f"diagonal plus low rank on the key side, {len(steps)} rank-one "
            f"{'step' if len(steps) == 1 else 'steps'} per token {how}: " + "; ".join(lines))


def step_forms(alg: Algebra, steps: tuple[DplrStep, ...]) -> tuple[str, str]:
    """How the kernel takes ``a`` and ``b`` for these steps: ``"scalar"`` when every one is a
    scalar multiple of its step's write key ``k`` (``a = c k``), ``"key"`` for ``b`` equal to ``k``
    in every step (the kernel's ``b = None``), else ``"vector"``."""
    def scalar_of(x: Expr, k: Expr) -> bool:
        s, vec = split_scalar(alg, x)
        return canon(vec) == canon(k)

    with_a = [st for st in steps if st.a is not None]
    a_form = "scalar" if all(scalar_of(st.a, st.k) for st in with_a) else "vector"
    if all(st.b is None or canon(st.b) == canon(st.k) for st in steps):
        b_form = "key"
    elif all(st.b is None or scalar_of(st.b, st.k) for st in steps):
        b_form = "scalar"
    else:
        b_form = "vector"
    return a_form, b_form
