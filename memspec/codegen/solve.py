"""Emitter of the ``solve`` family: a read ``p @ solve(H + lam I, G)`` or ``cg(H + lam I, p, N) @ G``
of an additive state ``H`` (the mesa layer), in two kernel calls:
:func:`memspec.runtime.solve.chunk_solve` solves every token's system ``x_t (H_t + lam I) = p_t`` by
conjugate gradients over whole chunks (to the solver's tolerance at the dtype's precision, or the
spec's N steps exactly), then :func:`memspec.runtime.additive.chunk_additive` probes ``G`` with the
solutions ``x``.  Both take packed documents in the same call.  ``lam`` is a constant, or a
token-local value (one per key channel: ``Diag(lam)``).
"""
from __future__ import annotations

from ..lang.names import fresh
from ..runtime.additive import chunk_additive
from ..runtime.solve import (_ChunkCG, _ChunkSolve, _cg_rows, _conjugate_gradients, _formed_systems, _solve_matvec,
                             _solve_tolerance, _solve_weights, chunk_solve)
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
        L(f"for every token's system at once ({_solver(plan)}),")
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
    fixed = plan.iterations is not None   # the spec's N steps, or the exact solve to a tolerance
    for part in (_solve_tolerance, _solve_weights, _solve_matvec, _formed_systems,
                 _conjugate_gradients, *((_cg_rows, _ChunkCG) if fixed else (_ChunkSolve,))):
        ctx.need(part)
    for kernel in KERNELS:
        ctx.need_kernel(kernel)
    ctx.need(_Documents)
    ctx.need(_DocumentChunks)


def body(w, spec, plan, state_in, state_out, chunk, probe_names, probe_shapes) -> None:
    """The solve, then the probe of the additive state with its solutions."""
    H, G = plan.state, plan.probe.name
    d = spec.state[H].shape[0]
    w.lines.append(f"# solve chunked schedule ({_solver(plan)}): x_t ({H}_t + lam I) = p_t by "
                   f"conjugate gradients for every token of a chunk at once, then o_t = x_t @ {G}_t")
    shared = plan.decay == plan.probe.decay
    lg = w.log_decay(plan.decay, "log_decay" if shared else f"{H}_log_decay")
    kc = w.value(plan.key, f"{H}_key", vector=True)
    bc = w.value(plan.weight, f"{H}_weight", vector=False)
    pc = w.value(plan.rhs, "rhs", vector=True)
    if isinstance(plan.lam, float):
        lam = repr(plan.lam)
    else:   # a token-local regulariser: [B, T, H] or one per key channel [B, T, H, d]
        lam = w.value(plan.lam, f"{H}_lam", vector=len(w.em.shape(plan.lam)) == 1)
    x = w.fresh("solution")
    w.lines.append(KernelCall.of(f"{x}, {state_out[H]}", chunk_solve, [pc, kc, bc, lg, state_in[H], lam, chunk],
                                 dict(inclusive=plan.inclusive, **_solver_arguments(plan)),
                                 comment=f"[B, T, H, {d}]"))
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


def _solver_arguments(plan) -> dict:
    """``chunk_solve``'s solver arguments: the spec's number of steps, fixed, or none (the exact solve)."""
    return dict(steps=plan.iterations, fixed=True) if plan.iterations is not None else {}


def _solver(plan) -> str:
    """The solver in words: the spec's fixed number of steps, or the exact solve to a tolerance."""
    if plan.iterations is not None:
        return f"conjugate gradients, {plan.iterations} steps (the spec's solver)"
    return "exact to the solver's tolerance at the dtype's precision"


def header(ctx, plan) -> str:
    """The header line of the solver."""
    return f"solver: {_solver(plan)}"


def stays_eager(ctx, plan) -> bool:
    """Conjugate gradients stops when every token has converged (a data-dependent loop): the
    module's ``compile=True`` leaves the chunked forward eager."""
    return True


EMITTER = Emitter(family="solve", emit=emit, forward_method="_forward_chunk",
                  schedule_text="solve chunked form (conjugate gradients over chunks), chunk {chunk}",
                  kernel=True, packed=True, stays_eager=stays_eager, header=header)
