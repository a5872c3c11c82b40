"""Emitter of the ``momentum`` family: ``M <- mu * M + eta * outer(k, p @ S - v)``, ``S <- gamma * S
- beta * M`` (a memory and its momentum, the kernel's ``M`` the spec's momentum times the plan's
sign) through :func:`memspec.runtime.momentum.chunk_momentum_delta` (one triangular solve per chunk),
one kernel call per linear probe of the memory."""
from __future__ import annotations

from ..runtime.momentum import chunk_momentum_delta
from .calls import KernelCall
from . import chunked
from .context import Emitter

KERNEL = chunk_momentum_delta


def emit(ctx, L) -> None:
    chunked.emit_forward(ctx, L, body, KERNEL)


def body(w, spec, plan, state_in, state_out, chunk, probe_names, probe_shapes) -> None:
    S, U = plan.state, plan.momentum
    shape = f"[B, H, {', '.join(spec.state[S].shape)}]"
    M = "M" if plan.sign == 1 else "-M"
    w.lines.append(f"# momentum chunked schedule (exact), one triangular solve per chunk, {U} = {M}:")
    w.lines.append(f"# M <- mu * M + eta * outer(k, p @ {S} - v), then {S} <- gamma * {S} - beta * M")
    lg = _log_decay(w, plan.gamma, f"{S}_log_gamma")
    lm = _log_decay(w, plan.mu, f"{U}_log_mu")
    kc = w.value(plan.k, f"{S}_k", vector=True)
    pc_ = w.value(plan.p, f"{S}_p", vector=True) if plan.p is not None else kc
    vc = w.value(plan.v, f"{S}_v", vector=True)
    bc = w.value(plan.beta, f"{S}_beta", vector=False)
    ec = w.value(plan.eta, f"{U}_eta", vector=False)
    if plan.sign == 1:
        M0 = state_in[U]
    else:
        M0 = w.fresh(f"{U}_neg")
        w.lines.append(f"{M0} = -{state_in[U]}  # the kernel's momentum M = -{U}, {shape}")
    pcodes = [w.value(p.vector, f"{S}_probe{i}", vector=True) for i, p in enumerate(plan.probes)] or ["None"]
    M_new = state_out[U] if plan.sign == 1 else w.fresh(f"{U}_neg_new")
    for pi, pc in enumerate(pcodes):
        o_name = w.fresh(f"{S}_probe_out{pi}" if len(pcodes) > 1 else f"{S}_probe_out") if pc != "None" else "_"
        s_names = (state_out[S], M_new) if pi == 0 else ("_", "_")
        w.lines.append(KernelCall.of(f"{o_name}, {s_names[0]}, {s_names[1]}", chunk_momentum_delta,
                                     [pc, kc, vc, pc_, lg, lm, bc, ec, state_in[S], M0, chunk],
                                     dict(inclusive=plan.inclusive)))
        if pc != "None":
            probe_names[plan.probes[pi].name] = o_name
            probe_shapes[o_name] = (spec.state[S].shape[1],)
    if plan.sign != 1:
        w.lines.append(f"{state_out[U]} = -{M_new}  # {shape}")


def _log_decay(w, gamma, base: str) -> str:
    """The log of a decay ``[B, T, H]``; zeros when there is none (the kernel always takes one)."""
    if gamma is not None:
        return w.log_decay(gamma, base)
    name = w.fresh(base)
    w.lines.append(f"{name} = torch.zeros_like({w.first_view}[..., 0])  # [B, T, H]: no decay")
    return name


EMITTER = Emitter(family="momentum", emit=emit, forward_method="_forward_chunk",
                  schedule_text="momentum delta rule chunked form (two coupled states), chunk {chunk} (exact)",
                  kernel=True, packed=True)
