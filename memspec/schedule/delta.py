"""Family ``delta``: a transition ``T = gamma I - beta rho k kᵀ`` (a token-local scalar decay
plus one symmetric rank one) with the write ``beta k vᵀ`` -- the (gated) delta rule, however it
is written (the gradient step of a quadratic loss of a linear model, or the error written out,
as the seed text's §3.3 writes it), exact in the WY / UT chunked form.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..lang.expr import BinOp, Call, Expr, Name, Neg, unparse
from ..lang.normalize import canon
from .algebra import ONE, ZERO, Algebra, NotAdmitted, grad_calls, is_num, mul, simplify, txt
from .polynomial import Probe, find_probes, symbolic_grad
from .ranges import check_decay
from .transition import describe, normal_form, one_state, ratio, side_text, split_scalar, without_factor

CHANNEL_CHUNK = 8   # a step size per value channel: chunks of 8 tokens keep the per-channel inverses small


@dataclass(frozen=True)
class DeltaPlan:
    """``W_t = gamma_t W_{t-1} + outer(k_t, beta_t (v_t - rho_t k_t @ W_{t-1}))``.

    ``rho`` is the decay the error term sees: ``gamma`` (gradient at the decayed
    memory, the gated delta rule) unless a decay is written in the same statement as
    the gradient; ``None`` means rho = gamma.  ``gamma`` None means no decay.  ``per_channel``:
    ``beta`` is a vector over the value channels (column j of the state runs its own scalar-beta
    delta rule, the keys and decays shared)."""

    state: str
    k: Expr
    v: Expr
    beta: Expr
    gamma: Expr | None
    rho: Expr | None
    probes: tuple[Probe, ...]
    read: Expr
    inclusive: bool
    per_channel: bool = False


def analyse_delta(alg: Algebra) -> tuple[DeltaPlan, list[str]]:
    """The delta family from the normal form ``W <- T(W) + A``: ``T = gamma I - beta rho k kᵀ``
    (a token-local scalar decay plus a symmetric rank one) and ``A = beta k vᵀ`` -- however the
    update is written (``grad`` of a quadratic loss or the error written out).  A rank-one term
    with a diagonal on the value side, ``beta rho k kᵀ W Diag(d)`` with the write ``k (d ⊙ v)ᵀ``,
    is a step size per value channel: d_v scalar-beta delta rules side by side, one per column."""
    spec = alg.spec
    nf = normal_form(alg)
    W, m = one_state(alg, nf, "delta", value_diag=True)
    reasons = grad_reasons(alg)
    reasons.append("normal form: " + describe(nf, alg)[0])
    diag = [t for t in m.terms if t.left.kind in ("I", "diag")]
    rank1 = [t for t in m.terms if t.left.kind == "outer"]
    if any(t.left.kind == "diag" for t in diag):
        raise NotAdmitted(f"the decay of {W} is per channel ({side_text(diag[0].left)}): the delta form has a "
                          f"scalar decay")
    if not rank1:
        raise NotAdmitted(f"the transition of {W} has no rank-one correction: it is additive")
    if len(rank1) > 1:
        raise NotAdmitted(f"the transition of {W} has {len(rank1)} rank-one terms per token: the delta form has one")
    (t1,) = rank1
    k, k2 = t1.left.u, t1.left.w
    if canon(k) != canon(k2):
        raise NotAdmitted(f"the rank-one term {side_text(t1.left)} is not symmetric: the error is read at "
                          f"{txt(k2)}, the write goes to {txt(k)}")
    gamma = simplify(diag[0].coef) if diag else ZERO
    if is_num(gamma, 0):
        raise NotAdmitted(f"the update of {W} has decay 0")
    if len(m.incs) != 1 or canon(m.incs[0][0]) != canon(k):
        raise NotAdmitted(f"the write of {W} is not one outer product at the key {txt(k)}")
    s_b, v_b = split_scalar(alg, m.incs[0][1])
    d, v_b = value_step(W, t1, m.incs[0][1], v_b)       # a step size per value channel, or None
    br = simplify(Neg(t1.coef))                  # beta * rho
    beta = ratio(br, gamma)                      # rho = gamma when it cancels: the error at the decayed memory
    if beta is not None:
        rho = gamma
        scale = ratio(s_b, beta)
    if beta is None or scale is None:
        beta, rho, scale = s_b, ratio(br, s_b), ONE
    if rho is None:
        raise NotAdmitted(f"the step size of the correction ({txt(br)}) and of the write ({txt(s_b)}) do not share "
                          f"a factor the analysis can divide out")
    v = simplify(mul(scale, v_b))
    beta = simplify(mul(beta, d)) if d is not None else beta
    decay_lines = [r for r in (check_decay(alg, None if is_num(gamma, 1) else gamma, f"of {W}"),
                               check_decay(alg, None if canon(rho) in (canon(gamma), canon(ONE)) else rho,
                                           "seen by the error term")) if r]
    Wp = Name(f"{W}_prev")
    rec_e = BinOp("+", BinOp("*", gamma, Wp), Call("outer", (Name("k"), BinOp("*", Name("beta"), BinOp(
        "-", Name("v"), BinOp("*", rho, BinOp("@", Name("k"), Wp)))))))
    rec = f"{W} <- {txt(rec_e)} with k = {txt(k)}, v = {txt(v)}, beta = {txt(beta)}"
    reasons.append(("gated delta rule: " if not is_num(gamma, 1) else "delta rule: ") + rec)
    if d is not None:
        reasons.append(channel_reason(W, t1, beta))
    if canon(rho) == canon(gamma) and not is_num(gamma, 1):
        reasons.append(f"the error is read at the decayed memory (rho = the decay {txt(gamma)})")
    elif not is_num(gamma, 1):
        reasons.append(f"the error is read at the undecayed memory (rho = {txt(rho)})")
    if not is_num(scale, 1):
        reasons.append(f"a decay after the write: the same recurrence with the target rescaled, v = {txt(v)}")
    reasons += decay_lines
    if not is_num(gamma, 1) or not is_num(rho, 1):
        reasons.append("a departure the kernel makes: a log decay below -80 per token counts as -80 (the past then "
                       "weighs e^-80 = 2e-35 instead of less: different from online only where the state is over "
                       "1e28 times the new terms)")
    read, probes = find_probes(alg, alg.inline(spec.read), {W})
    reasons.append("the read is a function of the linear probes "
                   + ", ".join(txt(BinOp("@", p.vector, Name(p.state))) for p in probes) if probes
                   else "the read does not use the state")
    reasons.append(CHANNEL_FORM if d is not None else "exact chunk form: WY / UT representation of the product of "
                   "(I - beta_t k_t^T k_t), one unit-lower-triangular solve per chunk")
    plan = DeltaPlan(W, k, v, beta, None if is_num(gamma, 1) else gamma,
                     None if canon(rho) == canon(gamma) else rho, tuple(probes), read, spec.order == "write_read",
                     per_channel=d is not None)
    return plan, reasons


CHANNEL_FORM = ("exact chunk form: per value channel the UT transform T_j = (I + Diag(beta_j) A)^-1 of the chunk's "
                "decayed k kᵀ (A shared), batched [d_v, C, C] inverses formed for all chunks at once (d_v C^3 per "
                "chunk), the state passed with u = U - T Diag(beta e^R) (K S) column by column")


def value_step(W: str, t1, write: Expr, v_b: Expr) -> tuple[Expr | None, Expr]:
    """``(d, v_b / d)`` for a rank-one term ``k kᵀ W Diag(d)`` (a step size per value channel: the
    write ``v_b`` must share the factor d), ``(None, v_b)`` for one without a value-side factor."""
    if t1.right.kind != "diag":
        return None, v_b
    rest = without_factor(v_b, t1.right.u)
    if rest is None:
        raise NotAdmitted(f"the correction of {W} has a step per value channel ({side_text(t1.right)} on its value "
                          f"side) that the write {txt(write)} does not share")
    return t1.right.u, rest


def channel_reason(W: str, t1, beta: Expr) -> str:
    return (f"beta is per value channel ({side_text(t1.right)} on the value side of the rank-one term, beta = "
            f"{txt(beta)}): column j of {W} runs its own scalar-beta delta rule with step beta_j, the key and the "
            f"decay shared -- d_v delta rules side by side")


def preferred_chunk(alg: Algebra, plan: DeltaPlan):
    """(chunk, reason) for a step size per value channel; None (the default chunk) otherwise."""
    if not plan.per_channel:
        return None
    return CHANNEL_CHUNK, (f"beta is per value channel: chunks of {CHANNEL_CHUNK} tokens keep the per-channel "
                           f"inverses small (C d_v floats per token; ask for another size with schedule: chunk(N))")


def grad_reasons(alg: Algebra) -> list[str]:
    """What the gradients of the program are (a linear model, a quadratic loss), when it takes any."""
    spec = alg.spec
    calls = [c for s in spec.update for c in grad_calls(s.value)]
    if not calls:
        return []
    out = []
    for W in dict.fromkeys(alg.grad_target(c) for c in calls):
        if alg.model is not None and W in spec.model_states():
            out.append(f"model {alg.model} is linear in {W}")
        gf = symbolic_grad(alg, alg.loss(), W)
        kind = "quadratic" if gf.scale is not None else "linear"
        out.append(f"loss is {kind} in the model output: {unparse(spec.loss)}, so grad(loss, {W}) = {gf.text}")
    return out
