"""Emission of the exact chunked schedules (additive and delta families).

The generator framework (:mod:`memspec.codegen`) calls two functions:

* :func:`kernel_sources` -- the source of the kernel(s) the module needs, copied
  from :mod:`memspec.runtime.additive` / :mod:`memspec.runtime.delta` with ``inspect.getsource`` (plain torch functions);
* :func:`emit_chunked_forward` -- the body lines of a forward pass over all T
  tokens at once: the token-local values the plan needs (vectorised over time with
  the framework's :class:`~memspec.codegen.ExprEmitter`), one kernel call per
  linear probe of each state, and the read computed from the probe outputs.

Contract of the emitted lines (they run inside ``forward``):

* in scope: every view ``[B, T, H, D]`` and gate ``[B, T, H]`` as a local of its spec
  name, ``self.<param>`` / ``self.<dim>`` as the emitter writes them, and the
  incoming state tensors ``[B, H, *shape]`` under the codes of ``state_in``;
* the lets ``[B, T, H, ...]`` are locals too (the framework binds them first), or,
  with ``lets=True``, the emitted lines bind them;
* they bind the output ``out`` ``[B, T, H, *read_shape]`` and the final states under
  ``state_out`` (default ``<S>_new``) and, with ``ret=True`` (default), end with
  ``return o, {"S": S_new, ...}``.
"""
from __future__ import annotations

import inspect

from ..runtime import additive, delta
from ..lang.expr import Expr, Name, Num, rewrite
from ..schedule.decide import AdditivePlan, DeltaPlan, ScheduleDecision, simplify

KERNELS = {"additive": (additive.chunk_additive,), "delta": (delta.chunk_delta,)}
LOG_FLOOR = 1e-30   # decays are clamped to >= 1e-30 before the log: log_gamma >= -69


def kernel_sources(decision: ScheduleDecision) -> str:
    """Source of the kernels the decision's family calls (empty for other families)."""
    names = KERNELS.get(decision.family, ())
    return "\n\n".join(inspect.getsource(fn) for fn in names)


def _fmt_shape(shape) -> str:
    return "[" + ", ".join(("B", "T", "H") + tuple(shape)) + "]"


class _Writer:
    def __init__(self, spec, emitter, taken):
        self.spec = spec
        self.em = emitter
        self.lines: list[str] = []
        self.taken = set(taken)
        self.taken |= set(spec.views) | set(spec.gates) | set(spec.let) | set(spec.state) | set(spec.params)
        self.taken |= {"torch", "nn", "F", "math", "self", "state", "schedule", "x", "o"}
        # the lets, inlined, for folding plan expressions back into readable let names
        from ..schedule.decide import Algebra
        self.alg = Algebra(spec)
        self.let_of = [(inl, n) for n, inl in self.alg.lets.items()]
        self.first_view = next(iter(spec.views), None)

    def fresh(self, base: str) -> str:
        name, i = base, 2
        while name in self.taken:
            name, i = f"{base}_{i}", i + 1
        self.taken.add(name)
        return name

    def fold(self, e: Expr) -> Expr:
        """Replace subexpressions equal to a let's (inlined) value by the let's name."""
        def visit(n: Expr) -> Expr | None:
            for inl, name in self.let_of:
                if n == inl:
                    return Name(name)
            return None

        return rewrite(e, visit)

    def per_token(self, e: Expr) -> bool:
        """Does ``e`` vary per token (uses a view, gate or let)?"""
        tok = set(self.spec.views) | set(self.spec.gates) | set(self.spec.let)
        return any(isinstance(n, Name) and n.id in tok for n in e.walk())

    def value(self, e: Expr, base: str, *, vector: bool) -> str:
        """Code of a token-local value ``[B, T, H]`` (scalar) or ``[B, T, H, d]`` (vector);
        a plain name is used as is, anything else is bound to a fresh local."""
        e = self.fold(simplify(e))
        c = self.em._emit(e)
        code = c.text
        shape = self.em.shape(e)
        if not self.per_token(e):  # a number, a dim or a param [H, ...]: broadcast over [B, T, H]
            ref = self.first_view
            if vector:
                code = f"torch.as_tensor({code}, dtype={ref}.dtype).expand(*{ref}.shape[:3], -1)"
            elif c.number:
                code = f"torch.full_like({ref}[..., 0], {code})"
            else:
                code = f"{c.at(9)}.expand({ref}.shape[:3])"
        if isinstance(e, Name) and self.per_token(e):
            return code
        name = self.fresh(base)
        self.lines.append(f"{name} = {code}  # {_fmt_shape(shape)}")
        return name

    def log_decay(self, gamma: Expr | None, base: str) -> str:
        if gamma is None:
            return "None"
        g = self.value(gamma, base.replace("log_", ""), vector=False)
        name = self.fresh(base)
        self.lines.append(f"{name} = torch.log({g}.clamp(min={LOG_FLOOR}))  # [B, T, H]")
        return name


def emit_chunked_forward(spec, decision: ScheduleDecision, emitter, *, state_in: dict | None = None,
                         state_out: dict | None = None, out: str = "o", chunk: str = "self.chunk",
                         lets: bool = False, ret: bool = True, taken=()) -> list[str]:
    """Body lines of the chunked forward over all tokens (see the module docstring)."""
    plan = decision.plans.get(decision.family, decision.plan) if decision.family in KERNELS else None
    if not isinstance(plan, (AdditivePlan, DeltaPlan)):
        raise ValueError(f"schedule family {decision.family!r} has no chunked form")
    state_in = {n: state_in[n] if state_in and n in state_in else f'state["{n}"]' for n in spec.state}
    w = _Writer(spec, emitter, taken)
    state_out = {n: (state_out or {}).get(n) or w.fresh(f"{n}_new") for n in spec.state}
    inclusive = plan.inclusive
    if lets and spec.let:
        w.lines.append("# token-local values of all tokens at once")
        for n, e in spec.let.items():
            w.lines.append(f"{n} = {emitter.emit(e)}  # {_fmt_shape(emitter.shape(e))}")
    probe_names: dict[str, str] = {}
    probe_shapes: dict[str, tuple] = {}
    if isinstance(plan, AdditivePlan):
        w.lines.append("# additive chunked schedule (exact): S <- gamma * S + outer(a, b); "
                       "the read sees the state only through probes p @ S")
        done = set()
        for group in _shared_calls(plan):
            _emit_shared(w, spec, plan, group, state_in, state_out, chunk, inclusive, probe_names, probe_shapes)
            done |= {st.name for st in group}
        for st in plan.states:
            if st.name in done:
                continue
            S = st.name
            lg = w.log_decay(st.gamma, f"{S}_log_gamma")
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
                    w.lines.append(f"{o_name}, {s_name} = chunk_additive({pc}, {ac}, {bc}, {lg}, {init}, "
                                   f"{chunk}, inclusive={inclusive})")
                    if pc != "None":
                        outs[pi].append(o_name)
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
        for n in spec.state:
            if n not in {s.name for s in plan.states}:
                w.lines.append(f"{state_out[n]} = {state_in[n]}")
    else:
        W = plan.state
        w.lines.append(f"# delta chunked schedule (exact): {W} <- gamma * {W} + outer(k, beta * (v - rho * k @ {W})),"
                       f" WY / UT form with one triangular solve per chunk")
        lg = w.log_decay(plan.gamma, f"{W}_log_gamma")
        lr = w.log_decay(plan.rho, f"{W}_log_rho") if plan.rho is not None else "None"
        kc = w.value(plan.k, f"{W}_k", vector=True)
        vc = w.value(plan.v, f"{W}_v", vector=True)
        bc = w.value(plan.beta, f"{W}_beta", vector=False)
        pcodes = [w.value(p.vector, f"{W}_probe{i}", vector=True) for i, p in enumerate(plan.probes)] or ["None"]
        for pi, pc in enumerate(pcodes):
            o_name = w.fresh(f"{W}_probe_out{pi}" if len(pcodes) > 1 else f"{W}_probe_out") if pc != "None" else "_"
            s_name = state_out[W] if pi == 0 else "_"
            w.lines.append(f"{o_name}, {s_name} = chunk_delta({pc}, {kc}, {vc}, {bc}, {lg}, {state_in[W]}, {chunk}, "
                           f"log_rho={lr}, inclusive={inclusive})")
            if pc != "None":
                probe_names[plan.probes[pi].name] = o_name
                probe_shapes[o_name] = (spec.state[W].shape[1],)
    read = _rename(plan.read, probe_names)
    read = w.fold(read)
    em = emitter.with_scope(**probe_shapes)
    w.lines.append(f"{out} = {em.emit(read)}  # {_fmt_shape(em.shape(read))}")
    if ret:
        w.lines.append(f"return {out}, {{{', '.join(f'{n!r}: {state_out[n]}' for n in spec.state)}}}")
    return w.lines


def _shared_calls(plan: AdditivePlan) -> list[list]:
    """Groups of single-term states with the same decay, the same key ``a`` and the same probe
    vectors: one kernel call serves them all, their values concatenated on the last axis
    (e.g. linear attention's numerator S and normaliser z)."""
    groups: list[list] = []
    keys: list = []
    for st in plan.states:
        if len(st.terms) != 1:
            continue
        key = (st.gamma, st.terms[0][0], tuple(p.vector for p in plan.probes if p.state == st.name))
        if key in keys:
            groups[keys.index(key)].append(st)
        else:
            keys.append(key)
            groups.append([st])
    return [g for g in groups if len(g) > 1]


def _emit_shared(w, spec, plan, group, state_in, state_out, chunk, inclusive, probe_names, probe_shapes):
    names = "_".join(st.name for st in group)
    first = group[0]
    lg = w.log_decay(first.gamma, f"{names}_log_gamma")
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
        w.lines.append(f"{o_name}, {s_name} = chunk_additive({pc}, {ac}, {bname}, {lg}, {sname}, {chunk}, "
                       f"inclusive={inclusive})")
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
    outs = [state_out[st.name] for st in group]
    w.lines.append(f"{', '.join(outs)} = torch.split({final}, {split}, dim=-1)")
    for st in group:
        if st.vector:
            w.lines.append(f"{state_out[st.name]} = {state_out[st.name]}.squeeze(-1)  # [B, H, "
                           f"{spec.state[st.name].shape[0]}]")


def _rename(e: Expr, names: dict) -> Expr:
    return rewrite(e, lambda n: Name(names.get(n.id, n.id)) if isinstance(n, Name) else None)