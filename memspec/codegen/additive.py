"""Emitter of the ``additive`` family: ``S <- Diag(gamma) S + outer(a, b)`` (``gamma`` a scalar per head, or one decay per key channel) through
:func:`memspec.runtime.additive.chunk_additive`, one kernel call per linear probe of each
state (single-term states with the same decay, key and probes share one call, their
values side by side)."""
from __future__ import annotations

from ..lang.expr import Name, Num
from ..runtime.additive import chunk_additive
from .calls import Code, KernelCall
from . import chunked
from .context import Emitter

KERNEL = chunk_additive


def emit(ctx, L) -> None:
    chunked.emit_forward(ctx, L, body, KERNEL)


def per_channel(plan, emitter) -> bool:
    """Does some state of the plan decay per key channel (a vector gamma)?"""
    return any(decays_per_channel(st, emitter) for st in plan.states)


def decays_per_channel(st, emitter) -> bool:
    """Does the state decay per key channel (its kernel call says so: the specialised kernel then
    carries only the branch of its decay)?"""
    return st.gamma is not None and bool(emitter.shape(st.gamma))


def body(w, spec, plan, state_in, state_out, chunk, probe_names, probe_shapes) -> None:
    per_channel_decay = per_channel(plan, w.em)
    decay = "Diag(gamma) S" if per_channel_decay else "gamma * S"
    w.lines.append(f"# additive chunked schedule (exact): S <- {decay} + outer(a, b); "
                   "the read sees the state only through probes p @ S")
    if any(st.log_input is not None for st in plan.states):
        w.lines.append("# an exponential input weight exp(x) outer(a, b) goes to the kernel as x: it carries a max "
                       "stabiliser m and returns exp(-m) p for each probe p")
    done = set()
    for group in _shared_calls(plan):
        _emit_shared(w, spec, plan, group, state_in, state_out, chunk, probe_names, probe_shapes)
        done |= {st.name for st in group}
    for st in plan.states:
        if st.name in done:
            continue
        S = st.name
        lg = w.log_decay(st.gamma, f"{S}_log_gamma")
        li = w.value(st.log_input, f"{S}_log_input", vector=False) if st.log_input is not None else None
        probes = [p for p in plan.probes if p.state == S]
        pcodes = [w.value(p.vector, f"{S}_probe{i}", vector=True) for i, p in enumerate(probes)] or ["None"]
        S0 = state_in[S] + (".unsqueeze(-1)" if st.vector else "")
        finals = []
        outs: dict[int, list[str]] = {i: [] for i in range(len(probes))}
        for ti, (a, b) in enumerate(st.terms):
            ac = w.value(a, f"{S}_a" if len(st.terms) == 1 else f"{S}_a{ti}", vector=True)
            if st.vector:
                if isinstance(b, Num) and float(b.value) == 1.0:
                    bc = f"torch.ones_like({ac}[..., :1])"
                else:
                    bc = w.value(b, f"{S}_b" if len(st.terms) == 1 else f"{S}_b{ti}", vector=False)
                    bc = f"{bc}.unsqueeze(-1)"
            else:
                bc = w.value(b, f"{S}_b" if len(st.terms) == 1 else f"{S}_b{ti}", vector=True)
            init = S0 if ti == 0 else "None"
            for pi, pc in enumerate(pcodes):
                o_name = w.fresh(f"{S}_read{pi}" if len(st.terms) == 1 else f"{S}_read{pi}_{ti}") \
                    if pc != "None" else "_"
                s_name = w.fresh(f"{S}_T{ti}") if pi == 0 else "_"
                m_name = (w.fresh(f"{S}_m") if pi == 0 and pc != "None" else "_") if li else None
                w.lines.append(KernelCall.of(f"{o_name}, {s_name}{f', {m_name}' if li else ''}", chunk_additive,
                                             [pc, ac, bc, lg, init, chunk],
                                             dict(inclusive=plan.inclusive, per_channel=decays_per_channel(st, w.em),
                                                  **({"log_input": Code(li)} if li else {}))))
                if pc != "None":
                    outs[pi].append(o_name)
                if li and pi == 0 and pc != "None":
                    stab = m_name
                if pi == 0:
                    finals.append(s_name)
        total = " + ".join(finals) if finals else S0
        w.lines.append(f"{state_out[S]} = {total}{'.squeeze(-1)' if st.vector else ''}  "
                       f"# [B, H, {', '.join(spec.state[S].shape)}]")
        for pi, p in enumerate(probes):
            name = w.fresh(f"{S}_probe_out{pi}" if len(probes) > 1 else f"{S}_probe_out")
            w.lines.append(f"{name} = {' + '.join(outs[pi])}{'.squeeze(-1)' if st.vector else ''}")
            probe_names[p.name] = name
            probe_shapes[name] = () if st.vector else (spec.state[S].shape[1],)
            if li:
                w.stab_of[name] = stab
    for n in spec.state:
        if n not in {s.name for s in plan.states}:
            w.lines.append(f"{state_out[n]} = {state_in[n]}")
    _stabilised_probes(w, plan, probe_names, probe_shapes)


def _stabilised_probes(w, plan, probe_names, probe_shapes) -> None:
    """Probes from stabilised kernel calls (``exp(-m) p``, one m per call): one stabiliser for
    all of them (their maximum), and the read evaluated at that scale; a read that also uses
    probes of unstabilised states gets every probe at its true scale."""
    outs = [probe_names[p.name] for p in plan.probes]
    scaled = [o for o in outs if o in w.stab_of]
    if not scaled:
        return

    def times(o, factor):   # a probe output [B, T, H(, d)] times a factor [B, T, H]
        return f"{o} = {o} * {factor}{'[..., None]' if probe_shapes[o] else ''}"

    if len(scaled) < len(outs):
        for o in scaled:
            w.lines.append(times(o, f"torch.exp({w.stab_of[o]})") + "  # at its true scale")
        return
    ms = list(dict.fromkeys(w.stab_of[o] for o in scaled))
    m = ms[0]
    if len(ms) > 1:
        m = w.fresh("m_all")
        both = ms[0]
        for other in ms[1:]:
            both = f"torch.maximum({both}, {other})"
        w.lines.append(f"{m} = {both}  # [B, T, H] one stabiliser for every probe")
        for o in scaled:
            w.lines.append(times(o, f"torch.exp({w.stab_of[o]} - {m})"))
    inv = w.fresh("inv_scale")
    w.lines.append(f"{inv} = torch.exp(-{m})  # [B, T, H] the probes' scale: the read sees exp(-m) p")
    probe_shapes[inv] = ()
    w.read_scale = (set(scaled), inv)


def _shared_calls(plan) -> list[list]:
    """Groups of single-term states with the same decay, the same key ``a`` and the same probe
    vectors: one kernel call serves them all, their values concatenated on the last axis
    (e.g. linear attention's numerator S and normaliser z)."""
    groups: list[list] = []
    keys: list = []
    for st in plan.states:
        if len(st.terms) != 1:
            continue
        key = (st.gamma, st.log_input, st.terms[0][0], tuple(p.vector for p in plan.probes if p.state == st.name))
        if key in keys:
            groups[keys.index(key)].append(st)
        else:
            keys.append(key)
            groups.append([st])
    return [g for g in groups if len(g) > 1]


def _emit_shared(w, spec, plan, group, state_in, state_out, chunk, probe_names, probe_shapes):
    names = "_".join(st.name for st in group)
    first = group[0]
    lg = w.log_decay(first.gamma, f"{names}_log_gamma")
    li = w.value(first.log_input, f"{names}_log_input", vector=False) if first.log_input is not None else None
    probes = {st.name: [p for p in plan.probes if p.state == st.name] for st in group}
    pcodes = [w.value(p.vector, f"{names}_probe{i}", vector=True) for i, p in enumerate(probes[first.name])]
    ac = w.value(first.terms[0][0], f"{names}_a", vector=True)
    bcs, inits, widths, wnames = [], [], [], []
    for st in group:
        b = st.terms[0][1]
        if st.vector:
            if isinstance(b, Num) and float(b.value) == 1.0:
                bcs.append(f"torch.ones_like({ac}[..., :1])")
            else:
                bcs.append(w.value(b, f"{st.name}_b", vector=False) + ".unsqueeze(-1)")
            inits.append(f"{state_in[st.name]}.unsqueeze(-1)")
            widths.append("1")
            wnames.append("1")
        else:
            bcs.append(w.value(b, f"{st.name}_b", vector=True))
            inits.append(state_in[st.name])
            widths.append(w.em.emit(Name(spec.state[st.name].shape[1])))
            wnames.append(spec.state[st.name].shape[1])
    bname, sname = w.fresh(f"{names}_b"), w.fresh(f"{names}_0")
    w.lines.append(f"# one kernel call for {', '.join(st.name for st in group)}: same decay, key and probes; "
                   f"values side by side")
    w.lines.append(f"{bname} = ({', '.join(bcs)})  # [B, T, H, {' + '.join(wnames)}] side by side "
                   f"(the kernel concatenates them chunk by chunk)")
    w.lines.append(f"{sname} = torch.cat([{', '.join(inits)}], dim=-1)  # [B, H, {spec.state[first.name].shape[0]}, "
                   f"{' + '.join(wnames)}]")
    split = f"[{', '.join(widths)}]"
    final = w.fresh(f"{names}_T")
    for pi, pc in enumerate(pcodes or ["None"]):
        o_name = w.fresh(f"{names}_read{pi}") if pc != "None" else "_"
        s_name = final if pi == 0 else "_"
        m_name = (w.fresh(f"{names}_m") if pi == 0 and pc != "None" else "_") if li else None
        w.lines.append(KernelCall.of(f"{o_name}, {s_name}{f', {m_name}' if li else ''}", chunk_additive,
                                     [pc, ac, bname, lg, sname, chunk],
                                     dict(inclusive=plan.inclusive, per_channel=decays_per_channel(first, w.em),
                                          **({"log_input": Code(li)} if li else {}))))
        if li and pi == 0 and pc != "None":
            stab = m_name
        if pc != "None":
            outs = [w.fresh(f"{st.name}_probe_out{pi}" if len(pcodes) > 1 else f"{st.name}_probe_out")
                    for st in group]
            w.lines.append(f"{', '.join(outs)} = torch.split({o_name}, {split}, dim=-1)")
            for st, out in zip(group, outs):
                p = probes[st.name][pi]
                if st.vector:
                    w.lines.append(f"{out} = {out}.squeeze(-1)  # [B, T, H]")
                probe_names[p.name] = out
                probe_shapes[out] = () if st.vector else (spec.state[st.name].shape[1],)
                if li:
                    w.stab_of[out] = stab
    outs = [state_out[st.name] for st in group]
    w.lines.append(f"{', '.join(outs)} = torch.split({final}, {split}, dim=-1)")
    for st in group:
        if st.vector:
            w.lines.append(f"{state_out[st.name]} = {state_out[st.name]}.squeeze(-1)  # [B, H, "
                           f"{spec.state[st.name].shape[0]}]")


def stays_eager(ctx, plan) -> bool:
    """Its halving loop over a decay per key channel took 586-745 s to compile on a 2-core CPU
    (gla, slices of 512 tokens) and ran 2x slower after it (README); a stabilised kernel (an
    exponential input weight) would pass the state between compiled slices at its true scale,
    which float32 cannot hold past 3.4e38 where the stabilised call over all tokens stays finite:
    both kernels stay eager, one call over the whole sequence."""
    return per_channel(plan, ctx.emitter()) or any(st.log_input is not None for st in plan.states)


EMITTER = Emitter(family="additive", emit=emit, forward_method="_forward_chunk",
                  schedule_text="additive chunked form, chunk {chunk} (exact)", kernel=True, packed=True,
                  stays_eager=stays_eager)
