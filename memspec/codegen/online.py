"""Emitter of the ``online`` family: ``_forward_online`` (a Python loop over tokens) and
``_token_step`` (one token, a pure function of tensors, compiled once when compile=True:
never a compiled loop over T)."""
from __future__ import annotations

from ..lang.names import fresh
from .program import emit_updates
from .text import shape_text, tuple_text


def emit(ctx, L) -> None:
    taken = ctx.taken()
    sv = ctx.views + ctx.gates
    L(f"def _forward_online(self, {', '.join(sv + ['state'])}):")
    with L.indent():
        L('"""' + "Token by token: the per-token step (compiled once when compile=True) in a Python loop." + '"""')
        L(f"{', '.join(ctx.states)} = {', '.join(f'state[{s!r}]' for s in ctx.states)}")
        outs = fresh("outputs", taken)
        t = fresh("t", taken)
        o_t = fresh("o_t", taken)
        L(f"{outs} = []")
        L(f"for {t} in range({ctx.first}.shape[1]):")
        with L.indent():
            args = ctx.states + [f"{x}[:, {t}]" for x in sv]
            L(f"{o_t}, {tuple_text(ctx.states)} = self._token_fn({', '.join(args)})")
            L(f"{outs}.append({o_t})")
        L(f"return torch.stack({outs}, dim=1), {{{', '.join(f'{s!r}: {s}' for s in ctx.states)}}}")
    L()
    token_step(ctx, L)


def token_step(ctx, L) -> None:
    spec = ctx.spec
    taken = ctx.taken()
    L(f"def _token_step(self, {', '.join(ctx.states + ctx.views + ctx.gates)}):")
    with L.indent():
        L('"""' + "One token: " + ", ".join(f"{v} [B, H, {spec.views[v].dim}]" for v in ctx.views)
          + "".join(f", {g} [B, H]" for g in ctx.gates) + ";")
        L("the state tensors [B, H, ...] -> (o " + shape_text("B, H", ctx.read_shape())
          + ", the new state tensors).")
        L('"""')
        em = ctx.emitter()
        ctx.lets(L, em, "B, H")
        o = "o"
        if spec.order == "read_write":
            L(f"{o} = {em.emit(spec.read)}", shape_text("B, H", ctx.read_shape()) + " (read before the write)")
        emit_updates(ctx, L, em, taken, "at the current state")
        if spec.order == "write_read":
            L(f"{o} = {em.emit(spec.read)}", shape_text("B, H", ctx.read_shape()))
        L(f"return {o}, {tuple_text(ctx.states)}")
    L()
