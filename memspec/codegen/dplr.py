"""Emitter of the ``dplr`` family: R rank-one sub-steps per token,
``S <- Diag(d) S + a (bᵀ S) + outer(k, v)`` (the decay on the first), through
:func:`memspec.runtime.dplr.chunk_dplr` (the WY / UT form generalised: one triangular solve
per chunk over its C R rank-one factors), one kernel call per linear probe.

The plan (:class:`memspec.schedule.dplr.DplrPlan`) gives each step's ``a`` / ``b`` in the
kernel's form: a scalar ``c`` meaning ``c k`` (``a_form`` / ``b_form`` ``"scalar"``), a vector,
or for ``b`` nothing at all (``"key"``: ``b = k``).  R > 1 steps are stacked on a sub-step axis
``[B, T, H, R, ...]``; a step that only writes gets ``a = 0``.
"""
from __future__ import annotations

from ..lang.expr import Num
from ..runtime.dplr import chunk_dplr, pair_index
from .calls import KernelCall
from . import chunked
from .context import Emitter

KERNEL = chunk_dplr


def emit(ctx, L) -> None:
    chunked.emit_forward(ctx, L, body, KERNEL)
    plan = ctx.plans[ctx.default]
    if plan.decay is not None and ctx.shape(plan.decay):   # a per-channel decay: its pairs by index
        ctx.need(pair_index)


def body(w, spec, plan, state_in, state_out, chunk, probe_names, probe_shapes) -> None:
    S = plan.state
    R = len(plan.steps)
    how = "together, reading the state before the token" if plan.simultaneous else "in order"
    if plan.decay is None:
        decay, update = "no decay", f"{S} <- {S} + a (bᵀ {S}) + outer(k, v)"
    else:
        seen = "after" if plan.read_after_decay else "before"
        decay = f"the decay d on the first, its read {seen} the decay"
        update = f"{S} <- Diag(d) {S} + a (bᵀ {S}) + outer(k, v)"
    w.lines.append(f"# dplr chunked schedule (exact): {R} rank-one sub-step{'s' if R > 1 else ''} per token {how}, "
                   f"{update}, {decay}; WY / UT form, one triangular solve per chunk")
    lg = w.log_decay(plan.decay, f"{S}_log_decay")
    decay_form = "none" if plan.decay is None else ("channel" if w.em.shape(plan.decay) else "scalar")
    suffix = [f"{r + 1}" if R > 1 else "" for r in range(R)]
    ks = [w.value(st.k, f"{S}_k{suffix[r]}", vector=True) for r, st in enumerate(plan.steps)]
    vs = [w.value(st.v, f"{S}_v{suffix[r]}", vector=True) for r, st in enumerate(plan.steps)]
    vec_a = plan.a_form == "vector"
    dk, dv = spec.state[S].shape
    a_s = [_factor(w, st.a, f"{S}_a{suffix[r]}", vec_a, ks[r], dk) for r, st in enumerate(plan.steps)]
    if plan.b_form == "key":
        b_s = None
    else:
        vec_b = plan.b_form == "vector"
        # a step with no rank-one term reads nothing: its b is never used (its a is 0)
        b_s = [_factor(w, st.b, f"{S}_b{suffix[r]}", vec_b, ks[r], dk, missing=1.0) for r, st in enumerate(plan.steps)]
    if R > 1:
        kc = _stack(w, ks, f"{S}_k", f"{R}, {dk}")
        vc = _stack(w, vs, f"{S}_v", f"{R}, {dv}")
        ac = _stack(w, a_s, f"{S}_a", f"{R}, {dk}" if vec_a else f"{R}")
        bc = "None" if b_s is None else _stack(w, b_s, f"{S}_b", f"{R}, {dk}" if plan.b_form == "vector" else f"{R}")
    else:
        kc, vc, ac = ks[0], vs[0], a_s[0]
        bc = "None" if b_s is None else b_s[0]
    pcodes = [w.value(p.vector, f"{S}_probe{i}", vector=True) for i, p in enumerate(plan.probes)] or ["None"]
    for pi, pc in enumerate(pcodes):
        o_name = w.fresh(f"{S}_probe_out{pi}" if len(pcodes) > 1 else f"{S}_probe_out") if pc != "None" else "_"
        s_name = state_out[S] if pi == 0 else "_"
        w.lines.append(KernelCall.of(f"{o_name}, {s_name}", chunk_dplr, [pc, kc, vc, ac, bc, lg, state_in[S], chunk],
                                     dict(inclusive=plan.inclusive, simultaneous=plan.simultaneous,
                                          read_after_decay=plan.read_after_decay, a_form=plan.a_form,
                                          b_form=plan.b_form, decay_form=decay_form)))
        if pc != "None":
            probe_names[plan.probes[pi].name] = o_name
            probe_shapes[o_name] = (spec.state[S].shape[1],)


def _factor(w, x, base: str, vector: bool, k: str, dk: str, missing: float = 0.0) -> str:
    """Code of one step's ``a`` or ``b``: ``[B, T, H, K]`` (vector) or ``[B, T, H]`` (the scalar
    times the step's key); a step without one gets the constant ``missing``."""
    if x is None:
        x = Num(missing)
        if vector:
            name = w.fresh(base)
            w.lines.append(f"{name} = torch.full_like({k}, {missing})  # [B, T, H, {dk}]: this step has none")
            return name
    return w.value(x, base, vector=vector)


def _stack(w, codes: list[str], base: str, dims: str) -> str:
    name = w.fresh(base)
    w.lines.append(f"{name} = torch.stack([{', '.join(codes)}], dim=3)  # [B, T, H, {dims}]: the sub-steps in order")
    return name


EMITTER = Emitter(family="dplr", emit=emit, forward_method="_forward_chunk",
                  schedule_text="diagonal-plus-low-rank chunked form (WY / UT), chunk {chunk} (exact)",
                  kernel=True, packed=True)
