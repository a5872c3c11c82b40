"""Family ``delta``: a linear model ``f(u) = u @ W``, a loss quadratic in the model output and
one gradient step with a token-local scalar step size and optional scalar decays before /
after it -- the (gated) delta rule, exact in the WY / UT chunked form.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..lang.expr import BinOp, Call, Expr, Name, Neg, substitute, unparse
from .algebra import ONE, ZERO, Algebra, NotAdmitted, add, is_num, mul, replace_grads, simplify, state_updates, txt
from .polynomial import (NONLIN, Probe, degree, describe_degree, find_probes, linear_form, nonlinear_site,
                         probe_form, symbolic_grad)
from .ranges import check_decay


@dataclass(frozen=True)
class DeltaPlan:
    """``W_t = gamma_t W_{t-1} + outer(k_t, beta_t (v_t - rho_t k_t @ W_{t-1}))``.

    ``rho`` is the decay the error term sees: ``gamma`` (gradient at the decayed
    memory, the gated delta rule) unless a decay is written in the same statement as
    the gradient; ``None`` means rho = gamma.  ``gamma`` None means no decay."""

    state: str
    k: Expr
    v: Expr
    beta: Expr
    gamma: Expr | None
    rho: Expr | None
    probes: tuple[Probe, ...]
    read: Expr
    inclusive: bool


def analyse_delta(alg: Algebra) -> tuple[DeltaPlan, list[str]]:
    spec = alg.spec
    if alg.model is None or spec.loss is None:
        raise NotAdmitted("the spec has no inner model and loss")
    ms = spec.model_states()
    if len(ms) != 1:
        raise NotAdmitted(f"the model reads {len(ms)} states ({', '.join(ms)}); the delta form needs one matrix")
    W = ms[0]
    if set(alg.states) != {W}:
        raise NotAdmitted(f"the spec has states besides the model's {W}: "
                          + ", ".join(sorted(set(alg.states) - {W})))
    if len(alg.states[W].shape) != 2 or alg.states[W].cache:
        raise NotAdmitted(f"the model's state {W} is not a matrix")
    reasons = []
    alg.shapes.setdefault(alg.model.arg, (alg.states[W].shape[0],))
    body = substitute(alg.model.body, {k: v for k, v in alg.lets.items() if k != alg.model.arg})
    d = degree(alg, body, {W})
    mtxt = str(alg.model)
    if d != {1} and d != {0, 1}:
        site = nonlinear_site(alg, body, {W})
        raise NotAdmitted(f"the model {mtxt} is {describe_degree(d)} in {W}"
                          + (f" ({txt(site)})" if site is not None and NONLIN in d else ""))
    if probe_form(alg, body, W) in (None,) or probe_form(alg, body, W)[0] is None:
        raise NotAdmitted(f"the model {mtxt} is linear in {W} but not of the form p(u) @ {W} + r(u)")
    reasons.append(f"model {mtxt} is linear in {W}")
    loss = alg.loss()
    gf = symbolic_grad(alg, loss, W)
    if gf.scale is None:
        raise NotAdmitted(f"the loss {txt(loss)} is not quadratic in {W}")
    reasons.append(f"loss is quadratic in the model output: {unparse(spec.loss)}, "
                   f"so grad(loss, {W}) = {gf.text}")
    # the update program: decays (c * W) and exactly one gradient step c * W + d * grad
    pre, post, step = [], [], None
    for tgt, e in state_updates(alg):
        if tgt != W:
            raise NotAdmitted(f"the update writes {tgt}, not only {W}")
        table: dict = {}
        e2 = replace_grads(e, alg, table)
        gnames = {v[0] for v in table.values()}
        if any(alg.grad_target(call) != W for _, call in table.values()):
            raise NotAdmitted("a gradient is taken with respect to another state")
        coef, rest = linear_form(alg, e2, {W} | gnames, f"{W} and grad(loss, {W})")
        if not is_num(simplify(rest), 0):
            raise NotAdmitted(f"the update of {W} adds {txt(rest)} besides the gradient step")
        c = simplify(coef.get(W, ZERO))
        dg = ZERO
        for g in gnames:
            dg = add(dg, coef.get(g, ZERO))
        if alg.depends(c) or alg.depends(dg) or not alg.is_scalar(c) or not alg.is_scalar(dg):
            raise NotAdmitted(f"the coefficients of the update of {W} are not token-local scalars")
        if is_num(dg, 0):
            (post if step is not None else pre).append(c)
        elif step is not None:
            raise NotAdmitted(f"the update of {W} takes two gradient steps per token")
        else:
            step = (c, dg)
    if step is None:
        raise NotAdmitted(f"the update of {W} takes no gradient step")
    c, dg = step
    g_pre = ONE
    for x in pre:
        g_pre = mul(g_pre, x)
    g_post = ONE
    for x in post:
        g_post = mul(g_post, x)
    # W' = g_post * (c * g_pre * W + dg * scale * outer(p, g_pre * p@W + r))
    #    = gamma W + outer(p, beta (v - rho p@W)),  gamma = g_post c g_pre, rho = g_pre g_post,
    #      beta = -dg * scale, v = g_post * (-r)
    gamma = simplify(mul(mul(g_post, c), g_pre))
    rho = simplify(mul(g_pre, g_post))
    beta = simplify(Neg(mul(dg, gf.scale)))
    v = simplify(mul(g_post, Neg(gf.r)))
    if is_num(gamma, 0):
        raise NotAdmitted(f"the update of {W} has decay 0")
    decay_lines = [r for r in (check_decay(alg, None if is_num(gamma, 1) else gamma, f"of {W}"),
                               check_decay(alg, None if rho in (gamma, ONE) else rho,
                                            "seen by the error term")) if r]
    btxt = txt(beta)
    G = Call("grad", (Name("loss"), Name(W)))
    stmt = BinOp("+", BinOp("*", c, Name(W)), BinOp("*", dg, G))
    reasons.append(f"one gradient step {W} <- {txt(stmt)} with a token-local scalar step size")
    if pre:
        reasons.append(f"decay {txt(g_pre)} before the gradient step: the gradient is taken at the decayed memory")
    if post:
        reasons.append(f"decay {txt(g_post)} after the gradient step: same recurrence with the target rescaled, "
                       f"v = {txt(v)}")
    if not is_num(c, 1):
        reasons.append(f"decay {txt(c)} in the gradient statement: the gradient is taken at the undecayed memory")
    Wp = Name(f"{W}_prev")
    rec_e = BinOp("+", BinOp("*", gamma, Wp), Call("outer", (Name("k"), BinOp("*", Name("beta"), BinOp(
        "-", Name("v"), BinOp("*", rho, BinOp("@", Name("k"), Wp)))))))
    rec = f"{W} <- {txt(rec_e)} with k = {txt(gf.p)}, v = {txt(v)}, beta = {btxt}"
    reasons.append(("gated delta rule: " if not is_num(gamma, 1) else "delta rule: ") + rec)
    reasons += decay_lines
    read, probes = find_probes(alg, alg.inline(spec.read), {W})
    reasons.append("the read is a function of the linear probes "
                   + ", ".join(txt(BinOp("@", p.vector, Name(p.state))) for p in probes) if probes
                   else "the read does not use the state")
    reasons.append("exact chunk form: WY / UT representation of the product of (I - beta_t k_t^T k_t), "
                   "one unit-lower-triangular solve per chunk")
    plan = DeltaPlan(W, gf.p, v, beta, None if is_num(gamma, 1) else gamma,
                     None if rho == gamma else rho, tuple(probes), read, spec.order == "write_read")
    return plan, reasons
