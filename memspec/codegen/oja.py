"""Emitter of the ``oja`` family: a state transformed on its value side and read on its key side
(the gated Oja rule), ``S <- S Diag(d) + z wᵀ`` with ``z = c (S' u) + a``, through
:func:`memspec.runtime.oja.chunk_oja` (one triangular solve per chunk, the state passed over
chunks as affine maps, the outputs from each chunk's start state), one kernel call per linear probe.

The plan (:class:`memspec.schedule.oja.OjaPlan`) gives ``w``, ``u`` (None: ``w``), ``c``, ``a`` and
the decay as token-local values; a spec that declares the state transposed (``plan.transposed``)
gets the state transposed into and out of the kernel, in the declared layout outside it.
"""
from __future__ import annotations

from ..lang.names import fresh
from ..runtime.oja import chunk_oja, oja_chunks, oja_constants, oja_decays, oja_outputs, oja_pass, oja_prepare
from ..runtime.varlen import _DocumentChunks, _Documents
from .calls import KernelCall
from . import chunked
from .context import Emitter

KERNEL = chunk_oja


def emit(ctx, L) -> None:
    """``_forward_chunk``: the lets, then the kernel calls; the module carries the kernel and its phases."""
    plan = ctx.plans["oja"]
    sv = ctx.views + ctx.gates
    docs = fresh("documents", set(ctx.spec_names))
    L(f"def _forward_chunk(self, {', '.join(sv + ['state'])}, {docs}=None):")
    with L.indent():
        L('"""' + "The exact oja chunked form over chunks of self.chunk tokens.")
        L()
        L(f"`{docs}`: packed documents (B = 1, state [N, H, ...]), each starting a chunk of the one")
        L("kernel call." + '"""')
        em = ctx.emitter()
        ctx.lets(L, em, "B, T, H")
        for line in chunked.forward_lines(ctx.spec, body, plan, em, ctx.decision.let_forms, lets=False,
                                          taken=tuple(sorted(ctx.spec_names)) + (docs,),
                                          flip=(plan.state,) if plan.transposed else ()):
            L.block(chunked.with_documents(line, docs))
    L()
    for part in (oja_chunks, oja_constants, oja_decays, oja_prepare, oja_pass, oja_outputs):
        ctx.need(part)
    ctx.need_kernel(KERNEL)
    ctx.need(_Documents)
    ctx.need(_DocumentChunks)


def body(w, spec, plan, state_in, state_out, chunk, probe_names, probe_shapes) -> None:
    S = plan.state
    seen = f"{S} Diag(d)" if plan.decay is not None and plan.read_after_decay else S
    u = "w" if plan.u is None else "u"
    w.lines.append(f"# oja chunked schedule (exact): {S} <- {S} Diag(d) + z wᵀ with z = c ({seen}) {u} + a, "
                   f"read through p @ {S}; one triangular solve per chunk, {S} passed over chunks as affine maps")
    lg = w.log_decay(plan.decay, f"{S}_log_decay")
    wc = w.value(plan.w, f"{S}_w", vector=True)
    uc = "None" if plan.u is None else w.value(plan.u, f"{S}_u", vector=True)
    cc = w.value(plan.c, f"{S}_c", vector=False)
    ac = w.value(plan.a, f"{S}_a", vector=True)
    pcodes = [w.value(p.vector, f"{S}_probe{i}", vector=True) for i, p in enumerate(plan.probes)] or ["None"]
    for pi, pc in enumerate(pcodes):
        o_name = w.fresh(f"{S}_probe_out{pi}" if len(pcodes) > 1 else f"{S}_probe_out") if pc != "None" else "_"
        s_name = state_out[S] if pi == 0 else "_"
        w.lines.append(KernelCall.of(f"{o_name}, {s_name}", chunk_oja, [pc, wc, uc, cc, ac, lg, state_in[S], chunk],
                                     dict(inclusive=plan.inclusive, read_after_decay=plan.read_after_decay)))
        if pc != "None":
            probe_names[plan.probes[pi].name] = o_name
            probe_shapes[o_name] = (spec.state[S].shape[1],)


EMITTER = Emitter(family="oja", emit=emit, forward_method="_forward_chunk",
                  schedule_text="oja chunked form (value-side transition, key-side read), chunk {chunk} (exact)",
                  kernel=True, packed=True)
