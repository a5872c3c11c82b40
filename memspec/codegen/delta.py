"""Emitter of the ``delta`` family: ``W <- gamma * W + outer(k, beta * (v - rho * k @ W))``
through :func:`memspec.runtime.delta.chunk_delta` (WY / UT form, one triangular solve per
chunk; with a step size per value channel, one system per value channel), one kernel call per linear
probe."""
from __future__ import annotations

from ..runtime.delta import chunk_delta
from .calls import Code, KernelCall
from . import chunked
from .context import Emitter

KERNEL = chunk_delta


def emit(ctx, L) -> None:
    chunked.emit_forward(ctx, L, body, KERNEL)


def body(w, spec, plan, state_in, state_out, chunk, probe_names, probe_shapes) -> None:
    W = plan.state
    if plan.per_channel:
        w.lines.append(f"# delta chunked schedule (exact): {W} <- gamma * {W} + outer(k, beta * (v - rho * k @ {W})),"
                       f" beta one step per value channel: a delta rule per column of {W}, UT form with one "
                       f"unit-lower-triangular inverse per value channel and chunk")
    else:
        w.lines.append(f"# delta chunked schedule (exact): {W} <- gamma * {W} + outer(k, beta * (v - rho * k @ {W})),"
                       f" WY / UT form with one triangular solve per chunk")
    lg = w.log_decay(plan.gamma, f"{W}_log_gamma")
    lr = w.log_decay(plan.rho, f"{W}_log_rho") if plan.rho is not None else "None"
    kc = w.value(plan.k, f"{W}_k", vector=True)
    vc = w.value(plan.v, f"{W}_v", vector=True)
    bc = w.value(plan.beta, f"{W}_beta", vector=plan.per_channel)
    per_channel = {"per_channel": True} if plan.per_channel else {}
    pcodes = [w.value(p.vector, f"{W}_probe{i}", vector=True) for i, p in enumerate(plan.probes)] or ["None"]
    for pi, pc in enumerate(pcodes):
        o_name = w.fresh(f"{W}_probe_out{pi}" if len(pcodes) > 1 else f"{W}_probe_out") if pc != "None" else "_"
        s_name = state_out[W] if pi == 0 else "_"
        w.lines.append(KernelCall.of(f"{o_name}, {s_name}", chunk_delta, [pc, kc, vc, bc, lg, state_in[W], chunk],
                                     dict(log_rho=Code(lr), inclusive=plan.inclusive, **per_channel)))
        if pc != "None":
            probe_names[plan.probes[pi].name] = o_name
            probe_shapes[o_name] = (spec.state[W].shape[1],)


EMITTER = Emitter(family="delta", emit=emit, forward_method="_forward_chunk",
                  schedule_text="delta rule chunked form (WY / UT), chunk {chunk} (exact)", kernel=True, packed=True)
