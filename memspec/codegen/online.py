"""Emitter of the ``online`` family: ``_forward_online`` (a Python loop over tokens) and
``_token_step`` (one token, a pure function of tensors, compiled once when compile=True:
never a compiled loop over T)."""
from __future__ import annotations

from ..lang.expr import BinOp, Call, Name, rewrite, unparse
from ..lang.names import fresh
from ..runtime.helpers import _recomputed, _recomputing
from .chunked import closed_log, stabilised_read
from .program import emit_updates, grad_target, window_closed
from .text import shape_text, tuple_text
from .context import Emitter

SEGMENT = 64   # tokens per recomputed segment of the online loop (the `checkpoint` option)


def emit(ctx, L) -> None:
    taken = ctx.taken()
    sv = ctx.views + ctx.gates
    carried = ctx.carried()
    L(f"def _forward_online(self, {', '.join(sv + ['state'])}):")
    with L.indent():
        if ctx.accs:
            L('"""' + "Token by token: the per-token step (compiled once when compile=True) in a Python loop.")
            L()
            L("Block updates: the running sums of the open blocks and the position come in and go out")
            L("as state['every.<state>.<k>'] and state['every.pos'] (an int), so that streaming in")
            L("pieces gives the same numbers as one call.")
            L('"""')
        else:
            L('"""' + "Token by token: the per-token step (compiled once when compile=True) in a Python loop." + '"""')
        L(f"{', '.join(ctx.states)} = {', '.join(f'state[{s!r}].contiguous()' for s in ctx.states)}",
          "(an expanded initial state would compile a second graph)")
        if ctx.stab:
            first = ctx.states[0]
            L(f"{ctx.stab} = {first}.new_zeros({first}.shape[:2])",
              "[B, H] the stabiliser: the states come in at their true scale")
        pos = fresh("pos", taken)
        if ctx.accs:
            block_sums_in(ctx, L, pos, ctx.accs)
        outs = fresh("outputs", taken)
        seg = recomputes(ctx, None)
        if seg:
            T, t0, o_s, run, step = (fresh(x, taken) for x in ("T", "t0", "o_s", "run", "step"))
            ctx.need(_recomputing)
            ctx.need(_recomputed)
            L(f"{T} = {ctx.first}.shape[1]")
            L(f"{step} = {SEGMENT} if _recomputing(self.checkpoint, {T}) else {T}",
              f"segments of {SEGMENT} tokens, each recomputed in the backward")
            L(f"{run} = _recomputed(self._online_tokens) if {step} < {T} else self._online_tokens")
            L(f"{outs} = []")
            L(f"for {t0} in range(0, {T}, {step}):")
            with L.indent():
                args = carried + [f"{x}[:, {t0}:{t0} + {step}]" for x in sv] + ([f"{pos} + {t0}"] if ctx.flags else [])
                L(f"{o_s}, {tuple_text(carried)} = {run}({', '.join(args)})")
                L(f"{outs}.append({o_s})")
            L(f"o = {outs}[0] if len({outs}) == 1 else torch.cat({outs}, dim=1)", "(decoding: no copy)")
        else:
            L(f"{outs} = []")
            token_loop(ctx, L, taken, outs, pos)
            L(f"o = {outs}[0].unsqueeze(1) if len({outs}) == 1 else torch.stack({outs}, dim=1)", "(decoding: no copy)")
        o = "o"   # a reserved local name (lang.names)
        if ctx.stab:
            L("# the states at their true scale (exp(m) times the carried ones)")
            for n in ctx.states:
                L(f"{n} = {n} * torch.exp({ctx.stab})[{', '.join(['...'] + ['None'] * len(ctx.spec.state[n].shape))}]")
        if ctx.accs:
            L(f"state = {{{', '.join(f'{s!r}: {s}' for s in ctx.states)}}}")
            block_sums_out(ctx, L, f"({pos} + {ctx.first}.shape[1])", ctx.accs, ctx.block_period)
            L(f"return {o}, state")
        else:
            L(f"return {o}, {{{', '.join(f'{s!r}: {s}' for s in ctx.states)}}}")
    L()
    if seg:
        segment_method(ctx, L, sv, carried)
    token_step(ctx, L)


def recomputes(ctx, plan) -> bool:
    """Does the online forward run in segments recomputed in the backward (the `checkpoint`
    option)?  When it is the module's default schedule and its step takes no torch.func.grad
    (which saved-tensor hooks do not support: every gradient in closed form, the spec's or its
    window loss's) and holds no cache that grows without bound."""
    if ctx.default != "online" or any(st.cache and st.window is None for st in ctx.spec.state.values()):
        return False
    return all(ctx.closed_grads.get(tuple(unparse(c) for c in g)) is not None
               or window_closed(ctx, [grad_target(ctx, c) for c in g]) is not None for g in ctx.grad_groups if g)


def token_loop(ctx, L, taken, outs: str, pos: str) -> None:
    """The loop over tokens: each runs the per-token step and appends its output to ``outs``."""
    sv = ctx.views + ctx.gates
    carried = ctx.carried()
    o_t = fresh("o_t", taken)
    per_token = {x: fresh(f"{x}_t", taken) for x in sv}
    tokens = (f"{sv[0]}.unbind(1)" if len(sv) == 1
              else f"zip({', '.join(f'{x}.unbind(1)' for x in sv)})")
    names = ", ".join(per_token.values())
    if ctx.flags:
        t = fresh("t", taken)
        L(f"for {t}, {names if len(sv) == 1 else f'({names})'} in enumerate({tokens}):",
          "views (one stack of their gradients when training)")
    else:
        L(f"for {names} in {tokens}:", "views (one stack of their gradients when training)")
    with L.indent():
        args = carried + list(per_token.values())
        args += [f"({pos} + {t} + 1) % {c} == 0" for c in ctx.flags]
        L(f"{o_t}, {tuple_text(carried)} = self._token_fn({', '.join(args)})")
        L(f"{outs}.append({o_t})")


def segment_method(ctx, L, sv, carried) -> None:
    """``_online_tokens``: the token loop over one segment, a pure function of tensors (and the
    segment's position in the blocks), so that torch.utils.checkpoint can recompute it."""
    taken = ctx.taken() | set(carried)
    outs, pos = fresh("outputs", taken), fresh("pos", taken)
    params = carried + sv + ([pos] if ctx.flags else [])
    L(f"def _online_tokens(self, {', '.join(params)}):")
    with L.indent():
        L('"""' + "A segment of S tokens of the loop (torch.utils.checkpoint recomputes it): the state")
        L(("and the block sums" if ctx.accs else "tensors") + " [B, H, ...], the views and gates [B, S, H, ...]"
          + (f", {pos}: the segment's position in the blocks" if ctx.flags else "") + ";")
        L("-> (o " + shape_text("B, S, H", ctx.read_shape()) + ", the state after the segment).")
        L('"""')
        L(f"{outs} = []")
        token_loop(ctx, L, taken, outs, pos)
        L(f"return torch.stack({outs}, dim=1), {tuple_text(carried)}")
    L()


def block_sums_in(ctx, L, pos: str, accs) -> None:
    """Read the position and the block sums ``accs`` from ``state`` (zeros when a block starts)."""
    L(f"{pos} = state.get(\"every.pos\", 0)", "a Python int: the position in the blocks")
    for a in accs:
        if tuple(a.shape) == tuple(ctx.spec.state[a.target].shape):
            zero = f"torch.zeros_like({a.target})"
        else:
            sizes = ", ".join([f"{ctx.first}.shape[0]", f"{ctx.first}.shape[2]"]
                              + [f"self.{ctx.attr.get(d, d)}" for d in a.shape])
            zero = f"{ctx.first}.new_zeros({sizes})"
        L(f"{a.name} = state[{a.key!r}] if {a.key!r} in state else {zero}",
          f"the block's sum of {unparse(a.term)}")


def block_sums_out(ctx, L, end: str, accs, period) -> None:
    """Write the position and the open blocks' sums into ``state`` (none at a block boundary)."""
    L(f"if {end} % {period}:")
    with L.indent():
        L(f"state[\"every.pos\"] = {end} % {period}")
        for a in accs:
            L(f"state[{a.key!r}] = {a.name}")


def token_step(ctx, L) -> None:
    spec = ctx.spec
    taken = ctx.taken()
    carried = ctx.carried()
    flags = list(ctx.flags.values())
    L(f"def _token_step(self, {', '.join(carried + ctx.views + ctx.gates + flags)}):")
    with L.indent():
        L('"""' + "One token: " + ", ".join(f"{v} [B, H, {spec.views[v].dim}]" for v in ctx.views)
          + "".join(f", {g} {ctx.gate_text(g, 'B, H')}" for g in ctx.gates) + ";")
        if ctx.accs:
            L("the block sums " + ", ".join(a.name for a in ctx.accs) + "; "
              + ", ".join(f"{f}: is this the last token of a block of {c}" for c, f in ctx.flags.items()) + ";")
        L("the state tensors [B, H, ...] -> (o " + shape_text("B, H", ctx.read_shape())
          + ", the new state tensors" + (" and block sums)." if ctx.accs else ")."))
        if ctx.stab:
            L(f"The states come and go as exp(-{ctx.stab}) times their value, {ctx.stab} [B, H] their max stabiliser.")
        L('"""')
        em = ctx.emitter()
        ctx.lets(L, em, "B, H")
        if ctx.stab:
            stabilised_step(ctx, L, em, taken)
            L()
            return
        o = "o"
        if spec.order == "read_write":
            L(f"{o} = {em.emit(spec.read)}", shape_text("B, H", ctx.read_shape()) + " (read before the write)")
        emit_updates(ctx, L, em, taken, "at the current state")
        if spec.order == "write_read":
            L(f"{o} = {em.emit(spec.read)}", shape_text("B, H", ctx.read_shape()))
        L(f"return {o}, {tuple_text(carried)}")
    L()


def stabilised_step(ctx, L, em, taken) -> None:
    """The body of a step that carries its states scaled by exp(-m) (xLSTM's max stabiliser,
    :mod:`memspec.schedule.stabiliser`): the new m, each state's scaled decay and input weight
    (both at most 1), the updates, then the read of the scaled probes (:func:`.chunked.stabilised_read`)."""
    st, m, spec = ctx.stabiliser, ctx.stab, ctx.spec
    names = {}
    for x in ("log_f", "log_i", "m_new", "f_s", "i_s", "inv_scale"):
        names[x] = fresh(x, taken)
        taken.add(names[x])
    lf, li, m_new, f, w, inv = names.values()
    L(f"{lf} = {em.emit(closed_log(st.gamma) or Call('log', (st.gamma,)))}", "[B, H] the log decay")
    L(f"{li} = {em.emit(st.log_input)}", "[B, H] the log input weight")
    o = "o"
    if spec.order == "read_write":
        L(f"{o} = {stabilised_probe_read(ctx, L, em, taken, m, inv)}",
          shape_text("B, H", ctx.read_shape()) + " (read before the write)")
    L(f"{m_new} = torch.maximum({lf} + {m}, {li})", "[B, H] the stabiliser")
    L(f"{f} = torch.exp({lf} + {m} - {m_new})", "[B, H] the decay and the input weight at the new scale")
    L(f"{w} = torch.exp({li} - {m_new})")
    scaled = em.with_scope(**{f: (), w: ()})
    for s in st.states:
        inc = None
        for a, b in s.terms:
            term = BinOp("*", b, a) if s.vector else Call("outer", (a, b))
            inc = term if inc is None else BinOp("+", inc, term)
        update = BinOp("+", BinOp("*", Name(f), Name(s.name)), BinOp("*", Name(w), inc))
        L(f"{s.name} = {scaled.emit(update)}", shape_text("B, H", spec.state[s.name].shape))
    if spec.order == "write_read":
        L(f"{o} = {stabilised_probe_read(ctx, L, em, taken, m_new, inv)}", shape_text("B, H", ctx.read_shape()))
    L(f"return {o}, {tuple_text([s.name for s in st.states] + [m_new])}")


def stabilised_probe_read(ctx, L, em, taken, m: str, inv: str) -> str:
    """Bind the probes of the scaled states and exp(-m); -> the read's code in them."""
    shapes = {}
    for p in ctx.stabiliser.probes:
        name = fresh(f"p_{p.state}", taken)
        taken.add(name)
        shape = tuple(ctx.spec.state[p.state].shape[1:])
        shapes[p.name] = (name, shape)
        L(f"{name} = {em.emit(BinOp('@', p.vector, Name(p.state)))}",
          shape_text("B, H", shape) + f": exp(-m) times the probe of {p.state}")
    L(f"{inv} = torch.exp(-{m})", "[B, H] the probes' scale")
    read = rewrite(ctx.stabiliser.read, lambda e: Name(shapes[e.id][0]) if isinstance(e, Name) and e.id in shapes
                   else None)
    read = stabilised_read(read, {n for n, _ in shapes.values()}, inv)
    return em.with_scope(**{n: sh for n, sh in shapes.values()}, **{inv: ()}).emit(read)


EMITTER = Emitter(family="online", emit=emit, forward_method="_forward_online",
                  schedule_text="online: one token at a time (exact)", recomputes=recomputes)
