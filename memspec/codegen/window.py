"""Emitter of the banded dual form of a window loss (:class:`memspec.schedule.window.WindowDual`):
the mini-batch chunk step of a linear memory ``f(u) = u @ W`` learned on the loss of a window
of cached rows (OmegaNet), with no per-token state.

``_row_loss_tap(z, W, rows...)`` is one row's loss with the layer output ``x_r @ W`` shifted by
a zero tap ``z``: its gradient with respect to ``z`` is the row's ``delta_r``, and the row's
gradient with respect to W is ``x_r^T delta_r``.  ``_chunk_step`` takes every row's
``delta`` at the chunk-start state (one vmapped gradient), builds ``N = L diag(-step) band``
(``L``, ``P`` from ``_decay_matrix``, ``band`` the [C, R] windows) and reads
``q_i W_i = P_i (q_i W) + sum_r N[i, r] (q_i . x_r) delta_r`` as a masked [C, R] product;
the state after the chunk is row C of the same sums.  Layout: the spec's expressions in the
``[B, C, H, ...]`` prefix layout, the [C, R] algebra head-major ``[B, H, C, ...]``.
"""
from __future__ import annotations

from ..lang.expr import Call, Name, substitute, unparse
from ..lang.names import fresh
from ..runtime.helpers import _decay_matrix, _window_band
from .text import shape_text, tuple_text


def _model_arg(spec, e):
    return next(c.args[0] for c in e.walk() if isinstance(c, Call) and spec.model is not None
                and c.fn == spec.model.name)


def cache_rows(spec, L, em, window, taken: set) -> tuple[dict, dict]:
    """The lines of a chunk's window rows: each cache's appended items ``<cache>_new``, its rows
    ``<cache>_rows`` ``[B, R, H, ...]`` (the ``window - 1`` rows before the chunk, then the
    chunk's own) and the cache after the chunk ``<cache>_after``.  Returns (rows, after) by cache."""
    c = window.window
    rows, after = {}, {}
    for cache, (_, item) in window.caches.items():
        new = fresh(f"{cache}_new", taken)
        code = em._emit(item)
        rank = len(spec.state[cache].shape)
        L(f"{new} = {code.text if code.rank == rank else em._lift(code, rank)}",
          shape_text("B, C, H", tuple(spec.state[cache].shape)) + f": appended to {cache}")
        rows[cache] = fresh(f"{cache}_rows", taken)
        if c == 1:
            L(f"{rows[cache]} = {new}", "[B, R, H, ...]: the rows of the windows (window 1)")
        else:
            L(f"{rows[cache]} = torch.cat([{cache}.transpose(1, 2)[:, -{c - 1}:], {new}], dim=1)",
              f"[B, R, H, ...]: the {c - 1} rows before the chunk and its own")
        after[cache] = fresh(f"{cache}_after", taken)
        L(f"{after[cache]} = torch.cat([{cache}, {new}.transpose(1, 2)], dim=2)[:, :, -{c}:]",
          f"[B, H, n, ...]: the cache after the chunk (at most {c} entries)")
    return rows, after


def emit_dual(ctx, L, plan) -> None:
    spec, win = ctx.spec, plan.window
    wd = win.dual
    W = wd.state
    rows = [win.rows[c] for c in win.caches]
    scope = {win.rows[c]: tuple(spec.state[c].shape) for c in win.caches}
    taken = ctx.taken()
    z = fresh("z", taken)
    out = spec.state[W].shape[-1]
    # one row's loss with the layer's output shifted by a tap
    em = ctx.emitter(model="(self.{fn}({u}, {states}) + " + z + ")").with_scope(**scope)
    L(f"def _row_loss_tap(self, {z}, {W}, {', '.join(rows)}):")
    with L.indent():
        L('"""' + f"One row's loss {unparse(win.row_loss)} with the layer's output shifted by the tap {z}")
        L(f"[B, H, {out}] (zeros): its gradient with respect to {z} is the row's delta, summed over batch and heads.")
        L('"""')
        L(f"return {em._emit(win.row_loss).at(9)}.sum()")
    L()
    start = fresh(f"{W}_start", taken)
    L(f"def _chunk_step(self, {', '.join([start] + ctx.states + ctx.views + ctx.gates)}):")
    with L.indent():
        L('"""' + "One mini-batch chunk in the banded dual form: " + ", ".join(
            f"{v} [B, C, H, {spec.views[v].dim}]" for v in ctx.views)
          + "".join(f", {g} {ctx.gate_text(g, 'B, C, H')}" for g in ctx.gates) + ";")
        L(f"{start}: the chunk-start {W} the gradients are taken at; " + ", ".join(ctx.states)
          + ": the state before the chunk.")
        L(f"Every {W}_i is P_i {W} + sum_r N[i, r] x_r^T delta_r over the rows r of the windows: no per-token")
        L("state is formed.  Returns (o " + shape_text("B, C, H", ctx.read_shape()) + ", the state after the chunk).")
        L('"""')
        emc = ctx.emitter()
        ctx.lets(L, emc, "B, C, H")
        c = win.window
        first = ctx.first
        arrays, after = cache_rows(spec, L, emc, win, taken)
        # every row's delta at the chunk start: one vmapped gradient of the tapped row loss
        d = fresh("delta", taken)
        zeros = f"{arrays[next(iter(win.caches))]}.new_zeros({first}.shape[0], " \
                f"{arrays[next(iter(win.caches))]}.shape[1], {first}.shape[2], self.{ctx.attr.get(out, out)})"
        in_dims = ", ".join(["1", "None"] + ["1"] * len(rows))
        L(f"{d} = torch.func.vmap(torch.func.grad(self._row_loss_tap), in_dims=({in_dims}), out_dims=1)(")
        L(f"    {zeros}, {start}, {', '.join(arrays[k] for k in win.caches)})",
          f"[B, R, H, {out}]: each row's gradient with respect to its layer output")
        # the layer inputs of the rows, and of the read
        xr = fresh("x_rows", taken)
        L(f"{xr} = {_emit_rows(ctx, spec, win, arrays)}", f"[B, R, H, {spec.state[W].shape[0]}]: the rows' layer inputs")
        xq = fresh("x_read", taken)
        L(f"{xq} = {emc.emit(_model_arg(spec, spec.read))}", f"[B, C, H, {spec.state[W].shape[0]}]: the read's layer input")
        # head-major factors, decay weights, the window band
        ctx.need(_decay_matrix)
        ctx.need(_window_band)
        xh, dh, qh = fresh("x_h", taken), fresh("d_h", taken), fresh("q_h", taken)
        L(f"{xh}, {dh}, {qh} = {xr}.transpose(1, 2), {d}.transpose(1, 2), {xq}.transpose(1, 2)",
          "[B, H, R, ...], [B, H, R, ...], [B, H, C, ...]")
        a = emc._emit(wd.decay)
        ones = f"{first}.new_ones({first}.shape[0], {first}.shape[2], {first}.shape[1])"
        a_h = (ones if a.text in ("1", "1.0") else f"{ones} * {a.text}") if a.number else f"{a.at(9)}.transpose(1, 2)"
        Ln, Pn = fresh("L", taken), fresh("P", taken)
        L(f"{Ln}, {Pn} = _decay_matrix({a_h})", f"[B, H, C, C], [B, H, C]: decay weights of {unparse(wd.decay)}")
        b = emc._emit(wd.step)
        b_h = f"({ones} * {b.text})" if b.number else f"{b.at(9)}.transpose(1, 2)"
        band, N = fresh("band", taken), fresh("N", taken)
        L(f"{band} = _window_band({first}.shape[1], {xh}.shape[2], {c}, {xh})", "[C, R]: the rows of each token's window")
        L(f"{N} = ({Ln} * -{b_h}.unsqueeze(-2)) @ {band}",
          f"[B, H, C, R]: the weight of row r's gradient in {W} after token i")
        L(f"o = ({Pn}.unsqueeze(-1) * ({qh} @ {W}) + (({qh} @ {xh}.transpose(-2, -1)) * {N}) @ {dh}).transpose(1, 2)",
          shape_text("B, C, H", ctx.read_shape()) + f": q_i @ {W}_i, a masked [C, R] product")
        new_w = fresh(f"{W}_after", taken)
        ctx.helpers.add("_outer_sum")
        L(f"{new_w} = {Pn}[..., -1, None, None] * {W} + _outer_sum({xh}, {N}[..., -1, :, None] * {dh})",
          shape_text("B, H", spec.state[W].shape) + f": {W} after the chunk")
        outs = [new_w if s == W else after[s] for s in ctx.states]
        L(f"return o, {tuple_text(outs)}")
    L()


def _emit_rows(ctx, spec, win, arrays) -> str:
    """The rows' layer inputs: the model's argument in the row loss, its rows as [B, R, H, ...] arrays."""
    arg = _model_arg(spec, win.row_loss)
    back = {win.rows[k]: Name(arrays[k]) for k in win.caches}
    scope = {arrays[k]: tuple(spec.state[k].shape) for k in win.caches}
    return ctx.emitter().with_scope(**scope).emit(substitute(arg, back))
