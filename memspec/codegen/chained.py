"""Emitter of the ``chained`` family: a read that chains probes of additive states (gated slot
attention's ``softmax(q @ K̃) @ Ṽ``), one chunked pass per stage of the chain.

The generated ``_forward_chunk`` runs the passes in dependency order: for each stage, the probe
vectors of every token (token-local values, or token-local functions of the earlier stages'
probe outputs, over the whole sequence at once), then one kernel call per probe and increment
term -- :func:`memspec.runtime.additive.chunk_additive` for a state decayed on its rows (a scalar
or one decay per key channel), :func:`memspec.runtime.chained.chunk_value_decay` for one decayed
on its columns (the output channels of its probe) -- and finally the read of the last outputs."""
from __future__ import annotations

from ..lang.expr import Name, Num, rewrite
from ..runtime.additive import chunk_additive
from ..runtime.chained import _value_decay_reads, chunk_value_decay
from .calls import KernelCall
from . import chunked
from .chunked import fmt_shape
from .context import Emitter


def kernels(plan) -> list:
    """The kernels the plan's states need, in order: rows (or no decay) -> chunk_additive,
    columns -> chunk_value_decay."""
    out = [chunk_additive] if any(st.side == "rows" for st in plan.states) else []
    return out + ([chunk_value_decay] if any(st.side == "columns" for st in plan.states) else [])


def emit(ctx, L) -> None:
    sv = ctx.views + ctx.gates
    plan = ctx.plans["chained"]
    L(f"def _forward_chunk(self, {', '.join(sv + ['state'])}):")
    with L.indent():
        stages = max(p.stage for p in plan.probes) + 1
        L('"""' + f"The exact chained form over chunks of self.chunk tokens: {stages} passes, each probing the")
        L("states for every token with vectors made from the previous pass's probes." + '"""')
        em = ctx.emitter()
        ctx.lets(L, em, "B, T, H")
        for line in chunked.forward_lines(ctx.spec, body, plan, em, ctx.decision.let_forms, lets=False,
                                          taken=tuple(sorted(ctx.spec_names))):
            L.block(line)
    L()
    for kernel in kernels(plan):
        ctx.need_kernel(kernel)
        if kernel is chunk_value_decay:
            ctx.need(_value_decay_reads)


def body(w, spec, plan, state_in, state_out, chunk, probe_names, probe_shapes) -> None:
    """The passes: per stage, the probe vectors, then the kernel calls; every state's final value
    from the first call that carries it."""
    w.lines.append("# chained chunked schedule (exact): every state additive, the read a chain of probes p @ S "
                   "whose vectors may read earlier probes: one chunked pass per stage")
    state_in = dict(state_in)
    for st in plan.states:
        if st.transposed:   # probed on its columns (S @ p = p @ Sᵀ): the kernels run on Sᵀ
            rows, cols = spec.state[st.name].shape
            name = w.fresh(f"{st.name}_t")
            w.lines.append(f"{name} = {state_in[st.name]}.transpose(-1, -2)  # [B, H, {cols}, {rows}]: "
                           f"{st.name} is probed on its columns, the kernels run on {st.name}ᵀ")
            state_in[st.name] = name
    decays = [st.decay for st in plan.states]
    logs: dict = {}   # decay -> the code of its log, bound once for the states that share it
    coef = {st.name: _coefficients(w, st, logs, decays.count(st.decay) > 1) for st in plan.states}
    finals: dict = {st.name: [] for st in plan.states}
    last = max(p.stage for p in plan.probes)
    for stage in range(last + 1):
        w.lines.append(f"# pass {stage + 1} of {last + 1}"
                       + (": probe vectors from the previous passes' probes, every token at once" if stage else ""))
        em = w.em.with_scope(**probe_shapes)
        for i, p in enumerate(x for x in plan.probes if x.stage == stage):
            st = next(s for s in plan.states if s.name == p.state)
            vec = rewrite(p.vector, lambda n: Name(probe_names.get(n.id, n.id)) if isinstance(n, Name) else None)
            if stage == 0:
                pc = w.value(vec, f"{p.state}_query", vector=True)
            else:
                pc = w.fresh(f"{p.state}_query")
                e = w.fold(vec)
                w.lines.append(f"{pc} = {em.emit(e)}  # {fmt_shape(em.shape(e))}")
            out = _calls(w, spec, st, coef[st.name], pc, state_in, state_out, chunk, plan.inclusive, finals)
            probe_names[p.name] = out
            probe_shapes[out] = () if st.vector else (_width(spec, st),)
    for st in plan.states:
        if not finals[st.name]:   # a state no probe reads: its final value only
            _calls(w, spec, st, coef[st.name], "None", state_in, state_out, chunk, plan.inclusive, finals)
        if finals[st.name] != [state_out[st.name]]:
            total = " + ".join(finals[st.name])
            if st.transposed:
                total = f"({total})" if len(finals[st.name]) > 1 else total
                total += ".transpose(-1, -2)"
            w.lines.append(f"{state_out[st.name]} = {total}{'.squeeze(-1)' if st.vector else ''}  "
                           f"# [B, H, {', '.join(spec.state[st.name].shape)}]")


def _width(spec, st) -> str:
    """The dim of a matrix state's probe output: its columns, or its rows when it is probed on its columns."""
    return spec.state[st.name].shape[0 if st.transposed else 1]


def _coefficients(w, st, logs: dict, shared: bool) -> tuple[str, list]:
    """Codes of a state's log decay (``"None"``: no decay; ``shared`` by several states: named for
    none of them) and increment terms ``(a, b)``."""
    S = st.name
    if st.decay not in logs:
        logs[st.decay] = w.log_decay(st.decay, "log_decay" if shared else f"{S}_log_decay")
    lg = logs[st.decay]
    terms = []
    for ti, (a, b) in enumerate(st.terms):
        tag = "" if len(st.terms) == 1 else str(ti)
        ac = w.value(a, f"{S}_a{tag}", vector=True)
        if not st.vector:
            bc = w.value(b, f"{S}_b{tag}", vector=True)
        elif isinstance(b, Num) and float(b.value) == 1.0:
            bc = f"torch.ones_like({ac}[..., :1])"
        else:
            bc = w.value(b, f"{S}_b{tag}", vector=False) + ".unsqueeze(-1)"
        terms.append((ac, bc))
    return lg, terms


def _calls(w, spec, st, coef, pc, state_in, state_out, chunk, inclusive, finals) -> str:
    """The kernel calls of one probe (one per increment term); returns the name of its output
    (``"_"`` for none) and adds the final state's parts to ``finals`` the first time."""
    lg, terms = coef
    S = st.name
    kernel = chunk_value_decay if st.side == "columns" else chunk_additive
    S0 = state_in[S] + (".unsqueeze(-1)" if st.vector else "")
    keep = not finals[S]
    one = len(terms) == 1 and not st.vector   # one call: its outputs are the probe and the final state
    shape = f"[B, T, H{'' if st.vector else ', ' + _width(spec, st)}]"
    outs = []
    for ti, (ac, bc) in enumerate(terms):
        o_name = (w.fresh(f"{S}_probe_out" if one else f"{S}_read")) if pc != "None" else "_"
        s_name = (state_out[S] if one and not st.transposed else w.fresh(f"{S}_T")) if keep else "_"
        w.lines.append(KernelCall.of(f"{o_name}, {s_name}", kernel, [pc, ac, bc, lg, S0 if ti == 0 else "None", chunk],
                                     dict(inclusive=inclusive), comment=shape if one and pc != "None" else None))
        outs.append(o_name)
        if keep:
            finals[S].append(s_name)
    if pc == "None":
        return "_"
    if one:
        return outs[0]
    name = w.fresh(f"{S}_probe_out")
    w.lines.append(f"{name} = {' + '.join(outs)}{'.squeeze(-1)' if st.vector else ''}  # {shape}")
    return name


def stays_eager(ctx, plan) -> bool:
    """The value-decay kernel loops over the chunks for the carried state, and compiling it (in
    slices) has not been measured on this project's 2-core CPU: the module's ``compile=True``
    leaves it eager, one call over the whole sequence."""
    return True


EMITTER = Emitter(family="chained", emit=emit, forward_method="_forward_chunk",
                  schedule_text="chained chunked form (one pass per stage of the read's probes), chunk {chunk} (exact)",
                  kernel=True, stays_eager=stays_eager)
