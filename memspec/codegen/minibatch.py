"""Emitter of the ``minibatch`` family.

``_forward_minibatch`` runs chunks of ``self.chunk`` tokens (the compiled chunk step for
full chunks, eagerly for a partial one; a call that ends inside a chunk returns the
chunk-start state so that streaming gives the same numbers as one call).  The chunk step
is the *dual form* (:mod:`.dual`) when the plan has one; otherwise it materialises:
``_token_grads`` replays one token's statements on the chunk-start state and takes each
``grad(...)`` there (memspec.reference's rule, so chunk 1 equals online), vmapped over the
chunk's tokens, and ``_chunk_step`` solves the plan's recurrences with the gradients held
fixed (decays through ``_linear_scan``, no decay through ``cumsum``); each token then
reads its own state.  Where every state is a plain scan of its own (no window loss, block
update or mirror step), ``_chunk_step`` does the gradients, the solves and the reads in
blocks of a few tokens (``_chunk_block``, sized by ``_block_tokens`` so that a block's
per-token states stay in cache), each block from the state after the one before.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from ..lang.expr import BinOp, Call, Name, Neg, substitute, unparse
from ..lang.names import fresh
from ..runtime.helpers import (_block_tokens, _decay_matrix, _finite_prefix, _linear_scan, _recomputed, _recomputing, _where_ok,
                               _window_band, _window_sums)
from ..schedule.algebra import is_num
from ..schedule.recurrence import input_name, term_add, term_mul
from . import dual
from .window import cache_rows, emit_dual as emit_window_dual
from .exprs import ExprEmitter
from .online import block_sums_in, block_sums_out
from .program import assign_line, closed_grad_lines, emit_updates, grad_target, shadow_plan, summed
from .text import Lines, shape_text, tuple_text
from .context import Emitter


@dataclass(frozen=True)
class TokenGrads:
    """What ``_token_grads`` takes and returns: its inputs after the start states, the start
    states, its returned gradient locals, and per statement ``unparse(grad call) -> local``."""

    inputs: list
    starts: list
    locals: list
    maps: list


@dataclass
class _Forward:
    """The locals of ``_forward_minibatch`` (fresh names, taken in a fixed order) and what the
    pieces that write it share."""

    ctx: object
    plan: object
    taken: set
    starts: dict   # state -> the local of its chunk-start value
    C: str
    t: str
    n: str
    pos: str
    outs: str
    o_c: str
    T: str
    ok: str
    bpos: str
    sizes: str
    pre: Optional[tuple] = None   # the dual form's (pre inputs, pre outputs, core inputs)
    seq: list = field(default_factory=list)   # the chunk step's inputs over the whole sequence
    pieces: dict = field(default_factory=dict)   # input -> the local of its chunks
    chunk_args: dict = field(default_factory=dict)   # input -> the loop's local of one chunk

    @classmethod
    def named(cls, ctx, plan) -> "_Forward":
        """The names of the method's locals, fresh against the spec's names."""
        taken = ctx.taken()
        starts = {s: fresh(f"{s}_start", taken) for s in chunk_starts(ctx)}
        names = [fresh(x, taken) for x in ("C", "t", "n", "pos", "outputs", "o_c", "T", "ok", "bpos", "sizes")]
        return cls(ctx, plan, taken, starts, *names)

    @property
    def sv(self) -> list:
        """The views and gates: the method's sequence arguments."""
        return self.ctx.views + self.ctx.gates

    @property
    def head_major(self) -> bool:
        """The dual form runs head-major [B, H, C, ...]."""
        return self.plan.dual is not None

    @property
    def axis(self) -> int:
        """The time axis of the chunk step's inputs and outputs."""
        return 2 if self.head_major else 1

    @property
    def carried(self) -> list:
        """What the loop carries from chunk to chunk: the states and the open blocks' sums."""
        return self.ctx.states + [a.name for a in self.ctx.accs]


def emit(ctx, L) -> None:
    """``_forward_minibatch`` and the chunk methods it calls: the dual form's, the window dual
    form's, or the materialising ``_token_grads`` (or the window's row gradients) and ``_chunk_step``."""
    plan = ctx.plans["minibatch"]
    f = _Forward.named(ctx, plan)
    if f.head_major:   # the chunk methods first: the loop calls them as they came out
        methods = Lines()
        methods.level = L.level
        f.pre = dual.emit(ctx, plan.dual, methods).pre
    forward_method(ctx, L, f)
    if f.head_major:
        L.lines.extend(methods.lines)
        return
    if plan.window is not None and plan.window.dual is not None:
        emit_window_dual(ctx, L, plan)
        return
    grads = window_grads(ctx, L, plan.window) if plan.window is not None else token_grads(ctx, L)
    chunk_step(ctx, L, plan, grads)


def forward_method(ctx, L, f: _Forward) -> None:
    """``_forward_minibatch``: the inputs masked (and laid out), the carried state, the chunk
    lengths and pieces, the loop over the chunks and the outputs with the state after them."""
    L(f"def _forward_minibatch(self, {', '.join(f.sv + ['state'])}):")
    with L.indent():
        L('"""' + "Mini-batch: chunks of `self.chunk` tokens; every gradient of a chunk at its start state.")
        L()
        L("Full chunks run the compiled chunk step; a partial chunk (at the start, continuing a chunk")
        L("begun by an earlier call, or at the end) runs it eagerly.  A call that ends inside a chunk")
        L("returns the chunk-start state and position as state['minibatch.<name>'] and")
        L("state['minibatch.pos'] (an int), so that streaming in pieces gives the same numbers as one call.")
        L('"""')
        L(f"{f.C}, {f.T} = self.chunk, {ctx.first}.shape[1]")
        masked_inputs(ctx, L, f)
        carried_state(ctx, L, f)
        chunk_pieces(L, f)
        pre_names = batched_pre(L, f) if f.pre is not None else None
        L(f"{f.outs} = []")
        if ctx.flags:
            L(f"{f.t} = 0")
        chunk_loop(ctx, L, f, pre_names)
        forward_return(ctx, L, f)
    L()


def masked_inputs(ctx, L, f: _Forward) -> None:
    """The inputs zeroed from the first non-finite token on (``f.ok``: the tokens before it);
    for the dual form laid out head-major, with the lets over the whole sequence (``f.seq``)."""
    sv = f.sv
    L(f"{f.ok} = _finite_prefix({', '.join(sv)})",
      "[B, T, H]: the tokens before the first non-finite input (of each batch row and head)")
    L(f"{', '.join(sv)} = {', '.join(f'_where_ok({f.ok}, {x}, 0.0)' for x in sv)}",
      "masked by where: a later nan or inf cannot reach earlier tokens through a chunk's products")
    ctx.need(_finite_prefix)
    ctx.need(_where_ok)
    f.seq = sv
    if f.head_major:
        one = ',' if len(sv) == 1 else ''
        L(f"{', '.join(sv)}{one} = (x.transpose(1, 2).contiguous() for x in ({', '.join(sv)}{one}))",
          "head-major [B, H, T, ...], once")
        f.seq = dual.sequence_inputs(ctx, L)   # the lets once over the whole sequence


def carried_state(ctx, L, f: _Forward) -> None:
    """The state the loop starts from: the states, the open blocks' sums (nested chunks), the
    position in a chunk begun by an earlier call and that chunk's start state."""
    cur = ctx.states
    L(f"{', '.join(cur)} = {', '.join(f'state[{s!r}].contiguous()' for s in cur)}",
      "(an expanded initial state would compile a second graph)")
    if ctx.accs:   # block updates (states with `every`): nested chunks
        blocks = tuple(ctx.flags)
        L(f"if any(b % {f.C} for b in {blocks!r}):")
        L(f"    raise ValueError(f\"the chunk {{{f.C}}} must divide the blocks {blocks!r} of the block updates \"")
        L("                     \"(nested chunks)\")")
        block_sums_in(ctx, L, f.bpos, ctx.accs)
    L(f"{f.pos} = state.get(\"minibatch.pos\", 0)", "a Python int: no device sync when decoding")
    if f.starts:
        L(f"{', '.join(f.starts.values())} = "
          f"{', '.join(f'state.get({chr(34)}minibatch.{s}{chr(34)}, {s})' for s in f.starts)}")


def chunk_pieces(L, f: _Forward) -> None:
    """The chunk lengths (the rest of a chunk begun earlier, full chunks, a partial last one)
    and every sequence input split into its chunks (``f.pieces``; the loop's ``f.chunk_args``)."""
    t, seq = f.t, f.seq
    L(f"{f.sizes} = []", "chunk lengths: the rest of a chunk begun earlier, full chunks, a partial last one")
    L(f"{t} = 0")
    L(f"while {t} < {f.T}:")
    with L.indent():
        L(f"{f.sizes}.append(min({f.C} - ({f.pos} + {t}) % {f.C}, {f.T} - {t}))")
        L(f"{t} += {f.sizes}[-1]")
    f.pieces = {x: fresh(f"{x}_chunks", f.taken) for x in seq}
    L(f"({', '.join(f.pieces.values())}{',' if len(seq) == 1 else ''}) = "
      f"(x.split({f.sizes}, dim={f.axis}) for x in ({', '.join(seq)}{',' if len(seq) == 1 else ''}))",
      "views, not copies (one concatenation of their gradients when training)")
    f.chunk_args = {x: fresh(f"{x}_c", f.taken) for x in seq}


def batched_pre(L, f: _Forward) -> tuple:
    """The dual form's state-independent part for every full chunk at once; returns the locals
    ``(i, per_full, pre_c)``: the loop's chunk index, full chunk -> its part, one chunk's part."""
    pre_in = f.pre[0]
    full, batched, per_full, i, pre_c = (fresh(x, f.taken) for x in ("full", "pre", "pre_full", "i", "pre_c"))
    L(f"{full} = [{i} for {i}, {f.n} in enumerate({f.sizes}) if {f.n} == {f.C}]", "the full chunks")
    L(f"{batched} = self._chunk_pre(*(torch.cat([x[{i}] for {i} in {full}]) for x in "
      f"{tuple_text([f.pieces[x] for x in pre_in])})) if {full} else ()",
      "what reads no state, for every full chunk at once (stacked on the batch axis)")
    L(f"{per_full} = dict(zip({full}, zip(*(x.unflatten(0, (len({full}), -1)).unbind(0) for x in {batched}))))")
    return i, per_full, pre_c


def chunk_loop(ctx, L, f: _Forward, pre_names: Optional[tuple]) -> None:
    """The loop over the chunks: a new chunk's start state, the compiled step for a full chunk
    (eagerly for a partial one) from the carried state, its output kept, the position advanced."""
    n, c, pos, carried, chunk_args = f.n, f.C, f.pos, f.carried, f.chunk_args
    starts = list(f.starts.values())
    if pre_names is not None:
        i, per_full, pre_c = pre_names
        L(f"for {i}, ({n}, {', '.join(chunk_args.values())}) in enumerate(zip({f.sizes}, {', '.join(f.pieces.values())})):")
    else:
        L(f"for {n}, {', '.join(chunk_args.values())} in zip({f.sizes}, {', '.join(f.pieces.values())}):")
    with L.indent():
        if starts:
            L(f"if {pos} == 0:")
            L(f"    {', '.join(starts)} = {', '.join(f.starts)}", "a new chunk starts here")
        if pre_names is not None:
            pre_in, _, core_in = f.pre
            L(f"if {n} == {c}:", "static shapes: one compiled chunk size")
            L(f"    fn, {pre_c} = self._chunk_fn, {per_full}[{i}]")
            L("else:", "a partial chunk: eagerly, with its own state-independent part")
            L(f"    fn, {pre_c} = self._chunk_step, self._chunk_pre({', '.join(chunk_args[x] for x in pre_in)})")
            args = starts + carried + [chunk_args[x] for x in core_in] + [f"*{pre_c}"]
        else:
            L(f"fn = self._chunk_fn if {n} == {c} else self._chunk_step", "static shapes: one compiled chunk size")
            recompute_lines(ctx, L, f.plan, f.T)
            args = starts + carried + list(chunk_args.values())
            args += [f"({f.bpos} + {f.t} + {n}) % {flag} == 0" for flag in ctx.flags]
        L(f"{f.o_c}, {tuple_text(carried)} = fn({', '.join(args)})")
        L(f"{f.outs}.append({f.o_c})")
        L(f"{pos} = ({pos} + {n}) % {c}")
        if ctx.flags:
            L(f"{f.t} += {n}", "the next chunk's offset in this call")


def forward_return(ctx, L, f: _Forward) -> None:
    """The state after the call (not finite after a non-finite input; a chunk begun but not
    finished: its start state and position) and the chunks' outputs joined."""
    cur, nan = ctx.states, 'float("nan")'
    L(f"{', '.join(cur)} = {', '.join(f'_where_ok({f.ok}[:, -1], {x}, {nan})' for x in cur)}",
      "after a non-finite input the state is not finite, as token by token")
    L(f"state = {{{', '.join(f'{s!r}: {s}' for s in cur)}}}")
    if ctx.accs:
        block_sums_out(ctx, L, f"({f.bpos} + {f.T})", ctx.accs, ctx.block_period)
    L(f"if {f.pos}:")
    with L.indent():
        L(f"state[\"minibatch.pos\"] = {f.pos}")
        for s, v in f.starts.items():
            L(f"state[\"minibatch.{s}\"] = {v}")
    o = "o"   # a reserved local name (lang.names)
    L(f"{o} = {f.outs}[0] if len({f.outs}) == 1 else torch.cat({f.outs}, dim={f.axis})", "(decoding: no copy)")
    L(f"return _where_ok({f.ok}, {o}.transpose(1, 2), {nan}), state" if f.head_major
      else f"return _where_ok({f.ok}, {o}, {nan}), state")


def recompute_lines(ctx, L, plan, T: str) -> None:
    """Under the `checkpoint` option, the chunk step ``fn`` wrapped so that the backward recomputes it."""
    if recomputes(ctx, plan):
        ctx.need(_recomputing)
        ctx.need(_recomputed)
        L(f"if _recomputing(self.checkpoint, {T}):")
        L("    fn = _recomputed(fn)", "the backward recomputes the chunk: its per-token states are not kept")


def recomputes(ctx, plan) -> bool:
    """Can the chunk step run under ``torch.utils.checkpoint``: it materialises every token's state
    (no dual form) and takes no ``torch.func.grad`` (which saved-tensor hooks do not support)?"""
    if plan.dual is not None:
        return False
    if plan.window is not None:
        return plan.window.dual is None and plan.window.closed is not None
    groups = [g for g in ctx.grad_groups if g]
    return all(ctx.closed_grads.get(tuple(unparse(c) for c in g)) is not None for g in groups)


def chunk_starts(ctx) -> list:
    """The states whose chunk-start values the gradients are taken at (with a window loss, the
    learned states the loss reads: its caches are always up to date)."""
    plan = ctx.plans["minibatch"]
    if plan.window is not None:
        return [s for s in ctx.loss_states if s not in plan.window.caches]
    return shadow_plan(ctx)[1]


def window_grads(ctx, L, window) -> TokenGrads:
    """``_row_loss``: the loss of one row of the window (the chunk step takes each row's gradient
    once and sums the rows of every token's window)."""
    spec = ctx.spec
    starts = chunk_starts(ctx)
    rows = [window.rows[c] for c in window.caches]
    scope = {window.rows[c]: tuple(spec.state[c].shape) for c in window.caches}
    em = ctx.emitter().with_scope(**scope)
    # per statement, its gradient calls -> the local of their target's window sum
    maps = [{unparse(c): f"grad_{grad_target(ctx, c)}" for c in st.value.walk()
             if isinstance(c, Call) and c.fn == "grad"} for st in spec.update]
    used = {local for mp in maps for local in mp.values()}
    targets = [s for s in ctx.states if f"grad_{s}" in used]     # the row gradients, in state order
    row_text = ", ".join(f"{r} [B, H{''.join(', ' + d for d in scope[r])}]" for r in rows)
    if window.closed is not None:
        L(f"def _row_grads(self, {', '.join(starts + rows)}):")
        with L.indent():
            L('"""' + f"The closed-form gradients of one row's loss, {unparse(window.row_loss)}:")
            L(f"the states [B, H, ...] and one row of each cache ({row_text}) -> (" + ", ".join(
                f"grad(loss, {t}) " + shape_text("B, H", spec.state[t].shape) for t in targets) + ").")
            L('"""')
            outs = closed_grad_lines(ctx, L, em, window.closed, targets, ctx.taken() | set(rows),
                                     "the row at the chunk-start state")
            L(f"return {tuple_text([outs[t] for t in targets])}")
        L()
    else:
        L(f"def _row_loss(self, {', '.join(starts + rows)}):")
        with L.indent():
            L('"""' + f"The loss of one row of the window, {unparse(window.row_loss)}, summed over batch and heads:")
            L(f"the states [B, H, ...] and one row of each cache ({row_text}) -> a scalar.")
            L('"""')
            L(f"return {em._emit(window.row_loss).at(9)}.sum()")
        L()
    locals_ = [f"grad_{t}" for t in targets]
    cumulative = {}
    out = []
    for mp in maps:
        cumulative.update(mp)
        out.append(dict(cumulative))
    return TokenGrads(targets, starts, locals_, out)


def window_rows(ctx, L, em, plan, grads: TokenGrads, starts: dict, locals_: list, taken: set) -> dict:
    """Every token's gradients from the rows of its window; returns cache -> its new value."""
    spec, window = ctx.spec, plan.window
    c = window.window
    rows, new = cache_rows(spec, L, em, window, taken)
    row_g = [fresh(f"{g}_rows", taken) for g in grads.inputs]
    in_dims = ["None"] * len(grads.starts) + ["1"] * len(window.caches)
    if window.closed is not None:
        fn = "self._row_grads"
    else:
        argnums = tuple(grads.starts.index(t) for t in grads.inputs)
        an = f"({argnums[0]},)" if len(argnums) == 1 else repr(argnums)
        fn = f"torch.func.grad(self._row_loss, argnums={an})"
    L(f"{', '.join(row_g)}{',' if len(row_g) == 1 else ''} = torch.func.vmap({fn}, "
      f"in_dims=({', '.join(in_dims)}), out_dims=1)("
      f"{', '.join([starts[s] for s in grads.starts] + [rows[k] for k in window.caches])})",
      "[B, R, H, ...]: each row's gradient at the chunk start")
    ctx.need(_window_band)
    ctx.need(_window_sums)
    for g, loc in zip(row_g, locals_):
        L(f"{loc} = _window_sums({g}, {ctx.first}.shape[1], {c})", "[B, C, H, ...]: each token sums its window")
    return new


def token_grads(ctx, L) -> TokenGrads:
    """The method that computes one token's gradients from the chunk-start state."""
    spec = ctx.spec
    keep, starts, last = shadow_plan(ctx)
    taken = ctx.taken()
    used = set(ctx.loss_args)
    for j in range(last + 1):
        used |= {n.id for n in spec.update[j].value.walk() if isinstance(n, Name)}
    inputs = [n for n in ctx.views + ctx.gates + ctx.let_order() if n in used]
    L(f"def _token_grads(self, {', '.join(starts + inputs)}):")
    with L.indent():
        L('"""' + "One token's gradients for the mini-batch schedule: its update statements replayed on")
        L("the chunk-start state (" + ", ".join(starts) + " [B, H, ...]); each grad(...) taken there.")
        L('"""')
        em = ctx.emitter()
        maps = emit_updates(ctx, L, em, taken, "at the chunk-start state (carried through this token)",
                            keep=keep, stop=last + 1)
        grad_locals = []
        for mp in maps:
            for local in mp.values():
                if local not in grad_locals:
                    grad_locals.append(local)
        L(f"return {tuple_text(grad_locals)}")
    L()
    return TokenGrads(inputs, starts, grad_locals, maps)


def chunk_step(ctx, L, plan, grads: TokenGrads) -> None:
    """``_chunk_step``, materialising: every token's gradients at the chunk-start state (vmapped
    over the chunk), the plan's recurrences solved with them held fixed, the block updates, and
    each token's read of its own state."""
    taken = ctx.taken()
    starts = {s: fresh(f"{s}_start", taken) for s in grads.starts}
    carried = ctx.states + [a.name for a in ctx.accs]
    L(f"def _chunk_step(self, {', '.join(list(starts.values()) + carried + ctx.views + ctx.gates + list(ctx.flags.values()))}):")
    with L.indent():
        chunk_docstring(ctx, L, starts)
        em = ctx.emitter()
        ctx.lets(L, em, "B, C, H")
        # every token's gradients at once: vmap over the chunk's tokens
        locals_ = [fresh(g, taken) for g in grads.locals]
        ren = dict(zip(grads.locals, locals_))
        caches_after = {}
        if plan.window is not None:   # a window loss: the rows' gradients, summed over each window
            caches_after = window_rows(ctx, L, em, plan, grads, starts, locals_, taken)
        elif not in_blocks(ctx, plan):
            vmapped_token_grads(L, grads, starts, locals_)
        if not in_blocks(ctx, plan):
            step = _ChunkSolve.of(ctx, L, plan, grads, ren, taken)
            held = {b.target for b in ctx.blocks} | set(caches_after)
            for s in plan.recurrence.order:
                if s not in held:
                    solve_state(step, plan.recurrence, s)
            block_chunk(ctx, L, grads, ren, step.seq, taken)
            chunk_reads(step, caches_after)
            L()
            return
        body = Lines(level=L.level)   # the block method's body: its tokens' gradients, states and reads
        vmapped_token_grads(body, grads, starts, locals_, "B, n, H")
        step = _ChunkSolve.of(ctx, body, plan, grads, ren, taken)
        step.axes = "B, n, H"
        for s in plan.recurrence.order:
            solve_state(step, plan.recurrence, s)
        chunk_reads(step, {})
        args = block_args(ctx, body)
        block_loop(ctx, L, list(starts.values()), args, taken)
    L()
    block_method(ctx, L, list(starts.values()), body, args)


def in_blocks(ctx, plan) -> bool:
    """Does the chunk step solve its states in blocks of tokens (:func:`_block_tokens`)?  Every
    recurrence a plain scan of its own (no window loss, block update or mirror step)."""
    return plan.window is None and not ctx.blocks and not ctx.accs and not plan.recurrence.mirror


def block_args(ctx, body) -> list:
    """The per-token inputs the block's gradients, solves and reads use (views, gates, lets), in
    that order."""
    text = "\n".join(body.lines)
    return [x for x in ctx.views + ctx.gates + ctx.let_order() if re.search(rf"\b{re.escape(x)}\b", text)]


def block_loop(ctx, L, starts: list, args: list, taken: set) -> None:
    """The chunk's tokens in blocks (:func:`_block_tokens`): each block's gradients at the chunk-start
    state (``starts``), its states solved from the state after the block before, its outputs kept,
    the chunk's joined."""
    ctx.need(_block_tokens)
    n, outs, o_b = (fresh(x, taken) for x in ("n", "outputs", "o_b"))
    blocks = {x: fresh(f"{x}_b", taken) for x in args}
    states = tuple_text(ctx.states)
    sizes = ", ".join(f"{s}.numel()" for s in ctx.states)
    L(f"{n} = _block_tokens({ctx.first}.shape[1], {f'max({sizes})' if len(ctx.states) > 1 else sizes})",
      "tokens per block: a block's per-token states stay in cache")
    L(f"{outs} = []")
    L(f"for {', '.join(blocks.values())} in zip(*(x.split({n}, dim=1) for x in ({', '.join(args)}{',' if len(args) == 1 else ''}))):")
    with L.indent():
        L(f"{o_b}, {states} = self._chunk_block({', '.join(starts + ctx.states + list(blocks.values()))})")
        L(f"{outs}.append({o_b})")
    L(f"return {outs}[0] if len({outs}) == 1 else torch.cat({outs}, dim=1), {states}")


def block_method(ctx, L, starts: list, body, args: list) -> None:
    """``_chunk_block``: one block of a chunk's tokens, their gradients at the chunk-start state
    (``starts``), their states solved token by token from the block's start state with the
    gradients held fixed, and each token's read of its own state."""
    spec = ctx.spec
    per_token = [f"{x} [B, n, H, {spec.views[x].dim}]" if x in ctx.views
                 else f"{x} {ctx.gate_text(x, 'B, n, H')}" if x in ctx.gates else x for x in args]
    L(f"def _chunk_block(self, {', '.join(starts + ctx.states + args)}):")
    with L.indent():
        L('"""' + "One block of n tokens of a chunk: " + ", ".join(starts)
          + " [B, H, ...], the chunk-start state the gradients are taken at; " + ", ".join(ctx.states)
          + ", the state before the block's first token; per token: " + ", ".join(per_token)
          + " [B, n, H, ...].")
        L("Returns (o " + shape_text("B, n, H", ctx.read_shape()) + ", the state after the block).")
        L('"""')
    L.lines.extend(body.lines)
    L()


def chunk_docstring(ctx, L, starts: dict) -> None:
    """The docstring of ``_chunk_step``: its arguments (``starts``: state -> chunk-start local)
    and what it returns."""
    spec = ctx.spec
    L('"""' + "One mini-batch chunk of C tokens: " + ", ".join(f"{v} [B, C, H, {spec.views[v].dim}]" for v in ctx.views)
      + "".join(f", {g} {ctx.gate_text(g, 'B, C, H')}" for g in ctx.gates) + ";")
    if starts:
        L(", ".join(starts.values()) + ": the chunk-start state the gradients are taken at;")
    L(", ".join(ctx.states) + ": the state before the chunk's first token [B, H, ...].")
    if ctx.accs:
        L(", ".join(a.name for a in ctx.accs) + ": the open blocks' sums; "
          + ", ".join(f"{f}: does this chunk end a block of {b}" for b, f in ctx.flags.items()) + ".")
    L("Returns (o " + shape_text("B, C, H", ctx.read_shape()) + ", the state after the chunk"
      + (" and the block sums)." if ctx.accs else ")."))
    L('"""')


def vmapped_token_grads(L, grads: TokenGrads, starts: dict, locals_: list, axes: str = "B, C, H") -> None:
    """Every token's gradients (``locals_``, [B, C, H, ...]; ``axes``: a block's [B, n, H, ...]):
    ``_token_grads`` vmapped over the tokens, the chunk-start states shared."""
    in_dims = ["None"] * len(starts) + ["1"] * len(grads.inputs)
    in_dims_txt = f"({', '.join(in_dims)}{',' if len(in_dims) == 1 else ''})"
    L(f"{', '.join(locals_)}{',' if len(locals_) == 1 else ''} = torch.func.vmap(self._token_grads, "
      f"in_dims={in_dims_txt}, out_dims=1)({', '.join(list(starts.values()) + grads.inputs)})",
      f"[{axes}, ...]: every token's gradients")


@dataclass
class _ChunkSolve:
    """What solving the chunk's recurrences shares: each gradient placeholder of the plan ->
    the ``Name`` of its per-token local (``names``), those locals' shapes (``scope``), every
    state's per-token sequence local (``seq``) and, once emitted, its value before each token
    (``prev``)."""

    ctx: object
    L: object
    taken: set
    names: dict
    scope: dict
    seq: dict
    prev: dict = field(default_factory=dict)
    axes: str = "B, C, H"   # the per-token leading axes (a block of n tokens: "B, n, H")

    @classmethod
    def of(cls, ctx, L, plan, grads: TokenGrads, ren: dict, taken: set) -> "_ChunkSolve":
        """The placeholders named by the per-token gradient locals (``ren``: ``grads.locals`` ->
        the chunk step's locals) and a fresh sequence local per state."""
        calls = {unparse(c): c for group in ctx.grad_groups for c in group}
        scope = {ren[local]: ctx.shape(calls[key]) for mp in grads.maps for key, local in mp.items()}
        names = {ph: Name(ren[grads.maps[i][unparse(call)]]) for ph, (i, call) in plan.grad_sites.items()}
        seq = {s: fresh(f"{s}_seq", taken) for s in ctx.states}
        return cls(ctx, L, taken, names, scope, seq)

    def before(self, r: str) -> str:
        """The local of state ``r`` before each token [B, C, H, ...] (emitted on first use)."""
        if r not in self.prev:
            self.prev[r] = fresh(f"{r}_before", self.taken)
            self.L(f"{self.prev[r]} = torch.cat([{r}.unsqueeze(1), {self.seq[r]}[:, :-1]], dim=1)",
                   shape_text(self.axes, self.ctx.spec.state[r].shape) + f": {r} before each token")
        return self.prev[r]


def recurrence_terms(step: _ChunkSolve, rec, s: str) -> tuple:
    """State ``s``'s recurrence with the gradients named: ``(coeffs, terms, sub)``, its coefficients,
    the terms that drive it (the rest, the solved inputs and the other states' terms, read from
    their sequences) or None, and the emitter that reads them."""
    spec, ctx = step.ctx.spec, step.ctx
    coeffs = {k: substitute(cf, step.names) for k, cf in rec.coeff[s].items()}
    terms = substitute(rec.rest[s], step.names) if rec.rest[s] is not None else None
    sc = dict(step.scope)
    sub_names = {}
    for when, r in rec.inputs.get(s, ()):   # functions of sequences solved before s
        ph = input_name(when, r)
        sc[ph] = tuple(spec.state[r].shape)
        sub_names[ph] = step.before(r) if when == "prev" else step.seq[r]
    for (when, r), cf in coeffs.items():
        if when == "prev" and r == s:
            continue
        ph = f"{r}__{when}"
        sc[ph] = tuple(spec.state[r].shape)
        sub_names[ph] = step.before(r) if when == "prev" else step.seq[r]
        terms = term_add(terms, term_mul(cf, Name(ph)))
    sub = ExprEmitter(spec, names=sub_names, like=ctx.first, attr=ctx.attr, helpers=ctx.helpers, scope=sc)
    return coeffs, terms, sub


def driving_text(ctx, sub, terms, s: str, shape: tuple) -> str:
    """The code of the terms that drive ``s`` [B, C, H, ...] (zeros when there are none; a
    number or a lower-rank value broadcast to the state's shape)."""
    if terms is None:
        return f"torch.zeros_like({s}).unsqueeze(1).expand(-1, {ctx.first}.shape[1], *{s}.shape[1:])"
    xc = sub._emit(negated_factor(sub, terms))
    if xc.number:
        return f"({xc.text}) * torch.ones_like({s}.unsqueeze(1))"
    if xc.rank < len(shape):
        return f"{sub._lift(xc, len(shape))} * torch.ones_like({s}.unsqueeze(1))"
    return xc.text


def negated_factor(sub, e):
    """``-(a * b)`` as ``(-a) * b`` when ``a`` has the lower rank (e.g. a gate times a state): the
    same numbers, one pass over the state fewer."""
    if not (isinstance(e, Neg) and isinstance(e.operand, BinOp) and e.operand.op == "*"):
        return e
    a, b = e.operand.left, e.operand.right
    ra, rb = sub._emit(a).rank, sub._emit(b).rank
    if ra < rb:
        return BinOp("*", Neg(a), b)
    return BinOp("*", a, Neg(b)) if rb < ra else e


def solve_state(step: _ChunkSolve, rec, s: str) -> None:
    """The sequence of ``s`` over the chunk: driven alone, a running sum (decay 1) or a linear
    scan; for a mirror-descent step, the scan of its logits and then their softmax."""
    ctx, L, taken = step.ctx, step.L, step.taken
    coeffs, terms, sub = recurrence_terms(step, rec, s)
    shape = tuple(ctx.spec.state[s].shape)
    decay = coeffs.get(("prev", s))
    x = driving_text(ctx, sub, terms, s, shape)
    comment = shape_text(step.axes, shape)
    mirror = rec.mirror.get(s)
    out, start = step.seq[s], s
    if mirror is not None:   # a mirror-descent step: the recurrence of its logits
        out, start = fresh(f"Z_{s}", taken), fresh(f"log_{s}", taken)
        L(f"{start} = torch.log({s})", shape_text("B, H", shape) + f": the logits of {s} before the chunk")
        comment += f": the logits Z of {s}"
    if decay is None:
        L(f"{out} = {x}", comment)
    elif is_num(decay, 1):
        xs = x if x.isidentifier() else f"({x})"
        L(f"{out} = {start}.unsqueeze(1) + {xs}.cumsum(1)", comment + f": {s}_i = {s}_(i-1) + ...")
    else:
        ctx.need(_decay_matrix)
        ctx.need(_linear_scan)
        a = sub._emit(decay)
        L(f"{out} = _linear_scan({a.text}, {x}, {start})",
          comment + f": {s}_i = ({unparse(decay)}) {s}_(i-1) + ...")
    if mirror is not None:
        c, axis = mirror
        dim = list(shape).index(axis) - len(shape)
        cc = sub._emit(substitute(c, step.names))
        one = is_num(c, 1) or (cc.number and float(cc.text) == 1.0)
        scale = "" if one else f"{cc.text if cc.number else sub._lift(cc, len(shape))} * "
        L(f"{step.seq[s]} = {scale}torch.softmax({out}, dim={dim})",
          shape_text(step.axes, shape) + f": {s} = {unparse(c)} * softmax(Z, {axis})")


def chunk_reads(step: _ChunkSolve, caches_after: dict) -> None:
    """Each token's read of its own state (after its write, or before it for read_write) and the
    return of the outputs with the state after the chunk (copies of the last token's)."""
    ctx, L, spec = step.ctx, step.L, step.ctx.spec
    if spec.order == "write_read":
        read_names = {s: step.seq[s] for s in ctx.states}
    else:
        for r in ctx.states:
            if r not in step.prev:
                step.prev[r] = fresh(f"{r}_before", step.taken)
                L(f"{step.prev[r]} = torch.cat([{r}.unsqueeze(1), {step.seq[r]}[:, :-1]], dim=1)",
                  shape_text(step.axes, spec.state[r].shape))
        read_names = {s: step.prev[s] for s in ctx.states}
    rd = ExprEmitter(spec, names=read_names, like=ctx.first, attr=ctx.attr, helpers=ctx.helpers)
    L(f"o = {rd.emit(spec.read)}", shape_text(step.axes, ctx.read_shape()) + ": each token reads its own state")
    # copies: a view of the last token would keep the chunk's per-token states alive
    after = [caches_after[s] if s in caches_after else step.seq[s] + '[:, -1].clone()' for s in ctx.states]
    L(f"return o, {tuple_text(after + [a.name for a in ctx.accs])}")


def block_chunk(ctx, L, grads: TokenGrads, ren: dict, seq: dict, taken: set) -> None:
    """The block updates in a chunk (a whole number of chunks per block): the state holds; the
    chunk adds its tokens' gradient terms to the block's sums; a chunk that ends a block
    applies the statement with the sums at its last token, which (write_read) reads the result."""
    spec = ctx.spec
    temps = {st.target: st.value for st in spec.update if st.target not in spec.state}
    lastnames = {n: f"{n}[:, -1]" for n in ctx.views + ctx.gates + ctx.let_order()}
    for b in ctx.blocks:
        mine = [a for a in ctx.accs if a.index == b.index]
        # the gradients in effect at the statement (after the last gradient: all of them)
        gmap = {key: ren[local] for key, local in grads.maps[min(b.index, len(grads.maps) - 1)].items()}
        em = ctx.emitter(grads=gmap)
        for a in mine:
            term = substitute(a.term, {t: v for t, v in temps.items() if t in {n.id for n in a.term.walk()
                                                                                 if isinstance(n, Name)}})
            L(f"{a.name} = {a.name} + ({em.emit(term)}).sum(1)",
              shape_text("B, H", a.shape) + f": the chunk's sum of {unparse(a.term)}")
        end = fresh(f"{b.target}_end", taken)
        L(f"{end} = {b.target}", f"{b.target} holds through the chunk ...")
        L(f"if {ctx.flags[b.every]}:", f"... and a chunk that ends a block of {b.every} applies its update")
        with L.indent():
            value, scope = summed(spec.update[b.index].value, mine)
            assign_line(L, ctx.emitter(names=dict(lastnames)).with_scope(**scope), end, spec.state[b.target], value)
            for a in mine:
                L(f"{a.name} = torch.zeros_like({a.name})")
        first = ctx.first
        L(f"{seq[b.target]} = torch.cat([{b.target}.unsqueeze(1).expand(-1, {first}.shape[1] - 1, "
          f"*{b.target}.shape[1:]), {end}.unsqueeze(1)], dim=1)",
          shape_text("B, C, H", spec.state[b.target].shape) + f": {b.target} seen by each token")


EMITTER = Emitter(
    family="minibatch", emit=emit, forward_method="_forward_minibatch",
    schedule_text="minibatch({chunk}): each chunk's gradients at its start state (approximate; chunk 1 = online)",
    chunk_step=("_chunk_fn", "_chunk_step"), approximation="mini-batch", state_prefix="minibatch.",
    recomputes=recomputes,
    header=lambda ctx, plan: "mini-batch in dual form (memspec.schedule.dual): outer-product gradients, [C, C] reads"
    if plan.dual is not None else None)
