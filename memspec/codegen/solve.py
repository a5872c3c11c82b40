"""Emitter of the ``solve`` family: a read ``p @ solve(H + lam I, G)`` of an additive state ``H``
(the mesa layer), in two kernel calls: :func:`memspec.runtime.solve.chunk_solve` solves every
token's system ``x_t (H_t + lam I) = p_t`` by conjugate gradients over whole chunks (to the
solver's tolerance at the dtype's precision), then :func:`memspec.runtime.additive.chunk_additive`
probes ``G`` with the solutions ``x``.  Both take packed documents in the same call.
"""
from __future__ import annotations

from ..lang.names import fresh
from ..runtime.additive import chunk_additive
from ..runtime.solve import (_ChunkSolve, _conjugate_gradients, _solve_matvec, _solve_tolerance, _solve_weights,
                             chunk_solve)
from ..runtime.varlen import _DocumentChunks, _Documents
from .calls import KernelCall
from . import chunked
from .context import Emitter

KERNELS = (chunk_solve, chunk_additive)


def emit(ctx, L) -> None:
    """``_forward_chunk``: the lets, then the two kernel calls; the module carries the kernels."""
    plan = ctx.plans["solve"]
    sv = ctx.views + ctx.gates
    docs = fresh("documents", set(ctx.spec_names))
    L(f"def _forward_chunk(self, {', '.join(sv + ['state'])}, {docs}=None):")
    with L.indent():
        L('"""' + "The solve chunked form over chunks of self.chunk tokens: conjugate gradients")
        L("for every token's system at once, to the solver's tolerance at the dtype's precision,")
        L(f"then the probe of {plan.probe.name} with the solutions.")
        L()
        L(f"`{docs}`: packed documents (B = 1, state [N, H, ...]), each starting a chunk of")
        L("both kernel calls." + '"""')
        em = ctx.emitter()
        ctx.lets(L, em, "B, T, H")
        for line in chunked.forward_lines(ctx.spec, body, plan, em, ctx.decision.let_forms, lets=False,
                                          taken=tuple(sorted(ctx.spec_names)) + (docs,)):
            L.block(chunked.with_documents(line, docs))
    L()
    for part in (_solve_tolerance, _solve_weights, _solve_matvec, _conjugate_gradients, _ChunkSolve):
        ctx.need(part)
    for kernel in KERNELS:
        ctx.need_kernel(kernel)
    ctx.need(_Documents)
    ctx.need(_DocumentChunks)


def body(w, spec, plan, state_in, state_out, chunk, probe_names, probe_shapes) -> None:
    """The solve, then the probe of the additive state with its solutions."""
    H, G = plan.state, plan.probe.name
    d = spec.state[H].shape[0]
    w.lines.append(f"# solve chunked schedule (exact to the solver's tolerance): x_t ({H}_t + lam I) = p_t by "
                   f"conjugate gradients for every token of a chunk at once, then o_t = x_t @ {G}_t")
    shared = plan.decay == plan.probe.decay
    lg = w.log_decay(plan.decay, "log_decay" if shared else f"{H}_log_decay")
    kc = w.value(plan.key, f"{H}_key", vector=True)
    bc = w.value(plan.weight, f"{H}_weight", vector=False)
    pc = w.value(plan.rhs, "rhs", vector=True)
    x = w.fresh("solution")
    w.lines.append(KernelCall.of(f"{x}, {state_out[H]}", chunk_solve, [pc, kc, bc, lg, state_in[H], repr(plan.lam), chunk],
                                 dict(inclusive=plan.inclusive), comment=f"[B, T, H, {d}]"))
    glg = lg if shared else w.log_decay(plan.probe.decay, f"{G}_log_decay")
    (a, b), = plan.probe.terms
    ac = w.value(a, f"{G}_key", vector=True)
    vc = w.value(b, f"{G}_value", vector=True)
    out = w.fresh(f"{G}_probe_out")
    width = spec.state[G].shape[1]
    w.lines.append(KernelCall.of(f"{out}, {state_out[G]}", chunk_additive, [x, ac, vc, glg, state_in[G], chunk],
                                 dict(inclusive=plan.inclusive), comment=f"[B, T, H, {width}]"))
    probe_names[plan.probe_name] = out
    probe_shapes[out] = (width,)


def stays_eager(ctx, plan) -> bool:
    """Conjugate gradients stops when every token has converged (a data-dependent loop): the
    module's ``compile=True`` leaves the chunked forward eager."""
    return True


EMITTER = Emitter(family="solve", emit=emit, forward_method="_forward_chunk",
                  schedule_text="solve chunked form (conjugate gradients over chunks, exact to the solver's "
                                "tolerance), chunk {chunk}",
                  kernel=True, packed=True, stays_eager=stays_eager)
