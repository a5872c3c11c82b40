"""Emitter of the ``apply_update`` family (:mod:`memspec.schedule.apply_update`): LaCT's chunks.

``_forward_apply_update`` cuts the stream into chunks of ``self.chunk`` tokens at positions
0, C, 2C, ... (the compiled ``_update_step`` for a whole chunk, eagerly for a piece of one);
a call that ends inside a chunk returns its position and the chunk's running gradient sums
as ``state['every.pos']`` and ``state['every.<state>.<k>']``.  Every token of a chunk reads the
held state (apply); the chunk's weighted gradients add to the sums, and at the chunk's last
token the update statements run once with the sums (update).

With every summed gradient in closed form the step is products of the chunk's rows: the lets
of its rows (``_update_step``), then ``_rows_step``: ``_rows_read`` (the read) and
``_rows_learn`` (the gradient program and the weighted sums as ``[C, d] @ [d, h]`` products,
the update); ``_update_chunks`` runs a group of whole chunks in one compiled call, their lets at
once.  Under autograd a call's last whole chunk runs its read and its update as two calls
(``_read_fn``, ``_learn_fn``; :func:`splits_last`).  Otherwise ``_update_step`` takes one
``torch.func.grad`` of ``_update_loss`` per weight.
"""
from __future__ import annotations

from ..lang.expr import Name, unparse
from ..lang.names import fresh
from .exprs import CodegenError
from .online import block_sums_in, block_sums_out
from .program import assign_line, closed_grad_lines, live_steps, summed, weighted_grad_sum
from .text import shape_text, tuple_text
from .context import Emitter


def emit(ctx, L) -> None:
    plan = ctx.plans["apply_update"]
    accs = ctx.block_accs(plan.blocks)
    cgs = rows_grads(ctx, plan)
    if cgs is not None:
        parts = step_parts(ctx, plan, cgs)
        raw, lets, rows = parts["step"]
        step = "_rows_step" if lets else "_update_step"
        kept = kept_norms(ctx, plan, accs)
        forward(ctx, L, accs, rows=True, kept=kept, parts=parts)
        if lets:
            lets_step(ctx, L, accs, kept, raw, lets, rows)
        rows_chunk_step(ctx, L, accs, kept, parts, step)
        rows_read(ctx, L, parts["read"][2])
        rows_learn(ctx, L, plan, accs, kept, cgs, parts["learn"][2])
        whole_chunks(ctx, L, accs, kept, raw, lets, rows, step)
        if splits_last(ctx):
            last_chunk(ctx, L, accs, kept, parts)
        return
    forward(ctx, L, accs, rows=False)
    chunk_loss(ctx, L)
    chunk_step(ctx, L, plan, accs)


def rows_grads(ctx, plan):
    """target -> its closed-form gradient program when the chunk step can run as products of the
    chunk's rows (every summed gradient in closed form, the model and the read written for
    vectors), else None (the chunk step takes ``torch.func.grad`` of the weighted chunk loss)."""
    targets = [t for wg in plan.weights for t in wg.targets]
    cgs = {}
    for t in targets:
        cg = next((cg for cg in ctx.closed_grads.values() if cg.of(t)), None)
        if cg is None:
            return None
        cgs[t] = cg
    try:
        ctx.emitter(rows=True).emit(ctx.spec.read)
    except CodegenError:
        return None
    return cgs


def kept_norms(ctx, plan, accs) -> dict:
    """state -> the local of its squared column norms, for each state that its update statement
    (the only one assigning it) renormalises to its own column norms (weight normalisation,
    ``S = l2norm(X.T).T * norm(S, d)``): the result's norms follow from the step's
    (``_renorm_kept``), so a call carries them from chunk to chunk instead of measuring the state
    again at every chunk."""
    spec, taken = ctx.spec, ctx.taken()
    kept = {}
    for b in plan.blocks:
        value, scope = summed(spec.update[b.index].value, [a for a in accs if a.index == b.index])
        operands = ctx.emitter().with_scope(**scope).renorm_operands(value)
        if operands is not None and operands[1] == Name(b.target) \
                and sum(st.target == b.target for st in spec.update) == 1:
            kept[b.target] = fresh(f"norm2_{b.target}", taken)
    return kept


def step_parts(ctx, plan, cgs) -> dict:
    """The rows chunk step's inputs, whole (``"step"``) and for its two halves (``"read"``: the
    read of the held state; ``"learn"``: the gradient sums and the update): for each (the views and
    gates it reads, in that order; the lets it computes from them, in dependency order; the inputs
    of its products: the views and gates they read themselves, then those lets)."""
    spec = ctx.spec
    learn = [wg.weight for wg in plan.weights] + [spec.update[b.index].value for b in plan.blocks]
    names = set()
    for cg in dict.fromkeys(cgs.values()):
        steps = live_steps(cg, [t for t, g in cgs.items() if g is cg])
        learn += [st.value for st in steps]
        names |= {x for site in cg.sites for x in (site.input, site.delta) if x}
    parts = {"read": _inputs_of(ctx, [spec.read], set()), "learn": _inputs_of(ctx, learn, names)}
    parts["step"] = _inputs_of(ctx, [spec.read] + learn, names)
    return parts


def _inputs_of(ctx, exprs, names: set) -> tuple[list, list, list]:
    """(views and gates, lets, product inputs) of the expressions ``exprs`` and the further
    ``names`` they read: as :func:`step_parts`."""
    spec = ctx.spec
    names = names | _names(ctx, exprs)
    direct = set(names)
    for name in reversed(ctx.let_order()):   # the lets the step reads, and theirs
        if name in names:
            names |= {x.id for x in spec.let[name].walk() if isinstance(x, Name)}
    lets = [n for n in ctx.let_order() if n in names]
    return ([n for n in ctx.views + ctx.gates if n in names], lets,
            [n for n in ctx.views + ctx.gates if n in direct] + lets)


def splits_last(ctx) -> bool:
    """Does a call under autograd run its last whole chunk as two graphs (read, then update)?
    With ``order: read_write`` (no row reads the updated state) the call's final state then has
    its own backward node: a caller that drops it (a training step's output) never runs the
    update's backward, where one graph's backward would run it on zero gradients."""
    return ctx.spec.order == "read_write"


def forward(ctx, L, accs, rows: bool, kept=None, parts=None) -> None:
    """``_forward_apply_update``: the rows chunk step's calls (``rows``: with the carried norms
    ``kept`` and the step's inputs ``parts``, :func:`step_parts`), else the token chunk step's."""
    taken = ctx.taken()
    c, T, pos = (fresh(x, taken) for x in ("C", "T", "pos"))
    L(f"def _forward_apply_update(self, {', '.join(ctx.views + ctx.gates + ['state'])}):")
    with L.indent():
        L('"""' + "Apply, then update: chunks of `self.chunk` tokens at positions 0, C, 2C, ... of the stream.")
        L()
        L("Every token of a chunk reads the state the previous chunk left; the state updates once, at")
        L("the chunk's last token, with the chunk's summed gradient terms.  A call that ends inside a")
        L("chunk returns its position and running sums as state['every.pos'] (an int) and")
        L("state['every.<state>.<k>'], so that streaming in pieces gives the same numbers as one call.")
        L('"""')
        L(f"{c}, {T} = self.chunk, {ctx.first}.shape[1]")
        L(f"{', '.join(ctx.states)} = {', '.join(f'state[{s!r}]' for s in ctx.states)}")
        if rows:   # a chunk's sums so far (None: no token of the chunk yet)
            L(f"{pos} = state.get(\"every.pos\", 0)", "a Python int: the position in the chunks")
            for a in accs:
                L(f"{a.name} = state.get({a.key!r})", f"the chunk's sum of {unparse(a.term)} so far, or None")
            for s, n in kept.items():
                ctx.helpers.add("_column_norms2")
                L(f"{n} = _column_norms2({s})", f"{s}'s squared column norms, carried from chunk to chunk")
            outs = rows_calls(ctx, L, accs, kept, parts, taken, (c, T, pos))
        else:
            block_sums_in(ctx, L, pos, accs)
            outs = token_calls(ctx, L, accs, ctx.views + ctx.gates, taken, (c, T, pos))
        L(f"state = {{{', '.join(f'{s!r}: {s}' for s in ctx.states)}}}")
        block_sums_out(ctx, L, pos, accs, c)
        L(f"return torch.cat({outs}, dim=1), state")
    L()


def rows_calls(ctx, L, accs, kept, parts, taken, names) -> str:
    """The rows chunk step's calls over the stream: the calls' token counts first (groups of whole
    chunks from a chunk boundary, one compiled call each; else to the next chunk boundary), then every
    input split once at those bounds (one backward node per input, where a slice per call costs a
    full-length gradient each), the calls in order; under autograd the last whole chunk's read and
    update as two calls (:func:`splits_last`).  Returns the list of outputs' name."""
    c, T, pos = names
    sv = parts["step"][0]
    carried = _carried(ctx, accs, kept)
    held = ctx.states + list(kept.values())   # what a group of whole chunks carries
    t, n, p, group, sizes, i = (fresh(x, taken) for x in ("t", "n", "p", "group", "sizes", "i"))
    outs, o_c = fresh("outputs", taken), fresh("o_c", taken)
    piece = {x: fresh(f"{x}_c", taken) for x in sv}
    pieces = list(piece.values())
    L(f"{group} = min(8, 256 // {c}) * {c}", "whole chunks, this many tokens per call of _chunks_fn")
    L(f"{sizes}, {t}, {p} = [], 0, {pos}", "the calls' token counts")
    L(f"while {t} < {T}:")
    with L.indent():
        L(f"{n} = {group} if {p} == 0 and {c} < {group} <= {T} - {t} else min({c} - {p}, {T} - {t})")
        L(f"{sizes}.append({n})")
        L(f"{t}, {p} = {t} + {n}, ({p} + {n}) % {c}")
    L(f"{outs} = []")
    split = splits_last(ctx)
    each = f"{', '.join(pieces)}{',' if len(pieces) == 1 else ''}"
    head = f"{i}, ({each})" if split else each
    L(f"for {head} in {'enumerate(' if split else ''}zip(*(x.split({sizes}, dim=1) "
      f"for x in {tuple_text(sv)})){')' if split else ''}:")
    with L.indent():
        L(f"{n} = {pieces[0]}.shape[1]")
        L(f"if {n} > {c}:", "a group of whole chunks (their sums start and end empty)")
        with L.indent():
            L(f"{o_c}, {tuple_text(held)} = self._chunks_fn({', '.join(held + pieces)})")
            L(f"{outs} += {o_c}", "each chunk's outputs: one concatenation at the end")
        if split:
            L(f"elif {n} == {c} and {pos} == 0 and {i} == len({sizes}) - 1 and torch.is_grad_enabled():")
            with L.indent():
                L("# the last chunk under autograd, its update a graph of its own: a caller that drops")
                L("# the final state never runs that graph's backward")
                read = _read_states(ctx) + [piece[x] for x in parts["read"][0]]
                L(f"{outs}.append(self._read_fn({', '.join(read)}))")
                L(f"{tuple_text(held)} = self._learn_fn({', '.join(held + [piece[x] for x in parts['learn'][0]])})")
        L("else:")
        with L.indent():
            L(f"fn = self._update_fn if {n} == {c} else self._update_step", "static shapes: one compiled chunk size")
            L(f"{o_c}, {tuple_text(carried)} = fn({', '.join(carried + pieces + [f'{pos} + {n} == {c}'])})")
            L(f"{outs}.append({o_c})")
        L(f"{pos} = ({pos} + {n}) % {c}")
    return outs


def token_calls(ctx, L, accs, sv, taken, names) -> str:
    """The chunk step's calls over the stream (tokens [B, T, H, ...]): to the next chunk boundary
    each.  Returns the list of outputs' name."""
    c, T, pos = names
    carried = _carried(ctx, accs, {})
    t, n = fresh("t", taken), fresh("n", taken)
    outs, o_c = fresh("outputs", taken), fresh("o_c", taken)
    L(f"{outs} = []")
    L(f"{t} = 0")
    L(f"while {t} < {T}:")
    with L.indent():
        L(f"{n} = min({c} - {pos}, {T} - {t})")
        L(f"fn = self._update_fn if {n} == {c} else self._update_step", "static shapes: one compiled chunk size")
        args = carried + [f"{x}[:, {t}:{t} + {n}]" for x in sv] + [f"{pos} + {n} == {c}"]
        L(f"{o_c}, {tuple_text(carried)} = fn({', '.join(args)})")
        L(f"{outs}.append({o_c})")
        L(f"{t}, {pos} = {t} + {n}, ({pos} + {n}) % {c}")
    return outs


def whole_chunks(ctx, L, accs, kept, raw, lets, rows, step) -> None:
    """``_update_chunks``: whole chunks from a chunk boundary, the group's lets at once (fewer,
    larger kernels than a chunk's), then one ``step`` each -- under ``compile`` one graph for the
    group (the loop unrolls over its few chunks), so that one call's overhead serves several
    chunks."""
    held = ctx.states + list(kept.values())
    L(f"def _update_chunks(self, {', '.join(held + raw)}):")
    with L.indent():
        L('"""' + "Whole chunks from a chunk boundary, as in _update_step (their sums start empty and")
        L("end with each chunk).  Returns (each chunk's o " + shape_text("B, C, H", ctx.read_shape())
          + f" in a list, the state{' and its norms' if kept else ''} after them).")
        L('"""')
        let_lines(ctx, L, lets, "B, n, H", "the group's rows")
        taken = ctx.taken() | set(ctx.states)
        pieces = [fresh(f"{x}_c", taken) for x in rows]
        L("outputs = []")
        L(f"for {', '.join(pieces)}{',' if len(pieces) == 1 else ''} in zip(*(x.split(self.chunk, dim=1) "
          f"for x in {tuple_text(rows)})):")
        with L.indent():
            args, outs = _whole_chunk(ctx, accs, kept)
            L(f"o, {tuple_text(outs)} = self.{step}({', '.join(args + pieces + ['True'])})")
            L("outputs.append(o)")
        L(f"return outputs, {tuple_text(held)}")
    L()


def let_lines(ctx, L, lets, prefix: str, rows: str) -> None:
    """The lets of token-major rows ``[B, n, H, ...]`` (token-local: any layout of rows)."""
    em = ctx.emitter(rows=True)
    for name in lets:
        L(f"{name} = {em.emit(ctx.spec.let[name])}", shape_text(prefix, ctx.shape(Name(name))) + f": {rows}")


def lets_step(ctx, L, accs, kept, raw, lets, rows) -> None:
    """``_update_step`` of a spec with lets: the lets of the piece's rows, then ``_rows_step``."""
    carried = _carried(ctx, accs, kept)
    last = fresh("last", ctx.taken())
    shapes = _rows_text(ctx, raw)
    step_header(ctx, L, "_update_step", carried + raw + [last], accs, last, shapes, "B, C, H", kept)
    with L.indent():
        let_lines(ctx, L, lets, "B, C, H", "the piece's rows")
        L(f"return self._rows_step({', '.join(carried + rows + [last])})")
    L()


def compiled_methods(ctx, plan) -> list:
    """The rows chunk step's further compiled methods: the groups of whole chunks; with
    :func:`splits_last`, the last chunk's read and its update."""
    cgs = rows_grads(ctx, plan)
    if cgs is None:
        return []
    more = [("_chunks_fn", "_update_chunks", False, "groups of whole chunks")]
    if splits_last(ctx):
        read = "_read_chunk" if step_parts(ctx, plan, cgs)["read"][1] else "_rows_read"
        more += [("_read_fn", read, False, "last chunk's read"),
                 ("_learn_fn", "_learn_chunk", False, "last chunk's update")]
    return more


def rows_chunk_step(ctx, L, accs, kept, parts, name) -> None:
    """The chunk step as products of the chunk's rows: the read of every row at the held state
    (:func:`rows_read`), then the rows' learning (:func:`rows_learn`); ``write_read``: the last
    row reads the updated state anew."""
    taken = ctx.taken()
    carried = _carried(ctx, accs, kept)
    last = fresh("last", taken)
    inputs = parts["step"][2]
    shapes = _rows_text(ctx, inputs)
    step_header(ctx, L, name, carried + inputs + [last], accs, last, shapes, "B, C, H", kept)
    with L.indent():
        read = _read_states(ctx) + parts["read"][2]
        L(f"o = self._rows_read({', '.join(read)})", shape_text("B, C, H", ctx.read_shape()) + ": apply")
        L(f"{tuple_text(carried)} = self._rows_learn({', '.join(carried + parts['learn'][2] + [last])})")
        if ctx.spec.order == "write_read":   # the chunk's last token reads after the update
            L(f"if {last}:", "the last row reads the new state")
            with L.indent():
                one = _read_states(ctx) + [f"{x}[:, -1:]" for x in parts["read"][2]]
                L(f"o = torch.cat([o[:, :-1], self._rows_read({', '.join(one)})], dim=1)")
        L(f"return o, {tuple_text(carried)}")
    L()


def rows_read(ctx, L, inputs) -> None:
    """``_rows_read``: every row of a chunk reads the held state, as products of the rows
    (head-major views: the rows of a head one matrix); the output token-major again (one
    concatenation of the chunks' outputs is then the sequence's)."""
    states = _read_states(ctx)
    L(f"def _rows_read(self, {', '.join(states + inputs)}):")
    with L.indent():
        shapes = _rows_text(ctx, inputs)
        L('"""' + f"The outputs of a chunk's rows {shapes}, each read at the held state "
          + ", ".join(states) + " [B, H, ...]: o " + shape_text("B, C, H", ctx.read_shape()) + '."""')
        _head_major(L, inputs)
        L(f"o = {ctx.emitter(rows=True).emit(ctx.spec.read)}", shape_text("B, H, C", ctx.read_shape()))
        L("return o.transpose(1, 2)", "token-major again")
    L()


def rows_learn(ctx, L, plan, accs, kept, cgs, inputs) -> None:
    """``_rows_learn``: the loss's closed-form gradient program over the rows at the held state
    (head-major views), each summed, weighted gradient as one product ``x^T (weight * delta)``
    added to the chunk's sums, and at the chunk's last row the update statements."""
    spec = ctx.spec
    taken = ctx.taken()
    carried = _carried(ctx, accs, kept)
    last = fresh("last", taken)
    L(f"def _rows_learn(self, {', '.join(carried + inputs + [last])}):")
    with L.indent():
        shapes = _rows_text(ctx, inputs)
        L('"""' + f"A chunk's (or a piece's) rows {shapes} learnt from at the held state: their "
          f"weighted gradient sums added to the chunk's; {last}: does the piece end the chunk (then the "
          "update runs).  Returns the state, sums" + (" and norms" if kept else "") + " after it (as taken).")
        L('"""')
        em = ctx.emitter(rows=True)
        _head_major(L, inputs)
        done = []   # the loss's gradient program over the rows, once per distinct program
        for cg in cgs.values():
            if cg not in done:
                done.append(cg)
                mine = [x for x, g in cgs.items() if g is cg]
                closed_grad_lines(ctx, L, em, cg, mine, taken, "the rows at the held state", prefix="B, H, C")
        sums: dict = {}
        for i, wg in enumerate(plan.weights):
            for s in wg.targets:
                sums[(i, s)] = fresh(f"sum_{s}", taken)
                L(f"{sums[(i, s)]} = {weighted_grad_sum(ctx, em, cgs[s], s, wg.weight)}",
                  shape_text("B, H", spec.state[s].shape) + f": sum_t {unparse(wg.weight)} grad(loss, {s})_t")
        for a in accs:
            k = [x for x in accs if x.index == a.index].index(a)
            refs = [(sign, sums[(i, s)]) for sign, i, s in plan.terms[(a.index, k)]]
            L(f"{a.name} = {_sum_text(refs)} if {a.name} is None else {a.name} {_signed(refs)}",
              shape_text("B, H", a.shape) + f": + sum_t {unparse(a.term)}")
        update_lines(ctx, L, plan, accs, last, rows=True, kept=kept)
        L(f"return {tuple_text(carried)}")
    L()


def last_chunk(ctx, L, accs, kept, parts) -> None:
    """With :func:`splits_last`: the last whole chunk's read (``_read_chunk``, when the read
    needs lets; else ``_rows_read`` itself is compiled) and its update (``_learn_chunk``), each
    one compiled graph."""
    held = ctx.states + list(kept.values())
    raw, lets, rows = parts["read"]
    if lets:
        L(f"def _read_chunk(self, {', '.join(_read_states(ctx) + raw)}):")
        with L.indent():
            L('"""' + "A call's last whole chunk, its read alone: its lets, then _rows_read." + '"""')
            let_lines(ctx, L, lets, "B, C, H", "the chunk's rows")
            L(f"return self._rows_read({', '.join(_read_states(ctx) + rows)})")
        L()
    raw, lets, rows = parts["learn"]
    L(f"def _learn_chunk(self, {', '.join(held + raw)}):")
    with L.indent():
        L('"""' + "A call's last whole chunk, its update alone (its sums start empty): its lets, then")
        L("_rows_learn.  Returns the state" + (" and its norms" if kept else "") + " after it.")
        L('"""')
        let_lines(ctx, L, lets, "B, C, H", "the chunk's rows")
        args, outs = _whole_chunk(ctx, accs, kept)
        L(f"{tuple_text(outs)} = self._rows_learn({', '.join(args + rows + ['True'])})")
        L(f"return {tuple_text(held)}")
    L()


def step_header(ctx, L, name: str, params: list, accs, last: str, inputs: str, prefix: str,
                kept=None) -> None:
    """``def <name>(...)`` and its docstring (the body follows, indented)."""
    L(f"def {name}(self, {', '.join(params)}):")
    with L.indent():
        L('"""' + f"A chunk (or a piece of one) of C tokens, {inputs};")
        L(", ".join(ctx.states) + ": the state every token of the chunk reads [B, H, ...]; "
          + ", ".join(a.name for a in accs) + ": the chunk's gradient sums so far;")
        if kept:
            L(", ".join(kept.values()) + ": the squared column norms of " + ", ".join(kept) + ";")
        L(f"{last}: does this piece end the chunk.  Returns (o " + shape_text(prefix, ctx.read_shape())
          + f", the state, sums{' and norms' if kept else ''} after it).")
        L('"""')


def update_lines(ctx, L, plan, accs, last: str, rows: bool, kept=None) -> None:
    """At the chunk's last token: the update statements once, with the chunk's sums (other
    per-token values: the last token's), the sums reset; write_read (token by token; the rows step
    does it itself): the last token reads anew.
    A state with carried column norms (``kept``) renormalises by them and carries the result's."""
    spec = ctx.spec
    cut = "[:, :, -1]" if rows else "[:, -1]"
    L(f"if {last}:", "update: the statements once, with the chunk's sums (other values: the last token's)")
    with L.indent():
        lastnames = {n: f"{n}{cut}" for n in ctx.views + ctx.gates + ctx.let_order()}
        for b in plan.blocks:
            mine = [a for a in accs if a.index == b.index]
            value, scope = summed(spec.update[b.index].value, mine)
            em = ctx.emitter(names=dict(lastnames)).with_scope(**scope)
            if kept and b.target in kept:
                ctx.helpers.add("_renorm_kept")
                x = em.emit(em.renorm_operands(value)[0])
                L(f"{b.target}, {kept[b.target]} = _renorm_kept({x}, {kept[b.target]})",
                  shape_text("B, H", spec.state[b.target].shape) + ", its squared column norms")
            else:
                assign_line(L, em, b.target, spec.state[b.target], value)
        for a in accs:
            L(f"{a.name} = None" if rows else f"{a.name} = torch.zeros_like({a.name})")
        if spec.order == "write_read" and not rows:   # the last token reads after the update
            lastin = {n: f"{n}[:, -1:]" for n in ctx.views + ctx.gates + ctx.let_order()}
            new = {s: f"{s}.unsqueeze(1)" for s in ctx.states}
            ol = ctx.emitter(names={**lastin, **new})
            L(f"o = torch.cat([o[:, :-1], {ol.emit(spec.read)}], dim=1)", "the last token reads the new state")


def chunk_loss(ctx, L) -> None:
    spec = ctx.spec
    em = ctx.emitter()
    L(f"def _update_loss(self, weight, {', '.join(ctx.loss_args)}):")
    with L.indent():
        L('"""' + f"sum_t weight_t * loss_t over the tokens of a chunk, loss = {unparse(spec.loss)}: the held")
        L("state " + ", ".join(f"{s} [B, 1, H, ...]" for s in ctx.loss_states) + ", the tokens' inputs [B, C, H, ...], "
          "weight [B, C, H]; its")
        L("gradient with respect to a state is the chunk's sum of weight_t grad(loss, state)_t.")
        L('"""')
        code = em._emit(spec.loss)
        L(f"return (weight * {code.at(9)}).sum()")
    L()


def chunk_step(ctx, L, plan, accs) -> None:
    spec = ctx.spec
    taken = ctx.taken()
    carried = _carried(ctx, accs, {})
    last = fresh("last", taken)
    shapes = ", ".join(f"{v} [B, C, H, {spec.views[v].dim}]" for v in ctx.views) \
        + "".join(f", {g} {ctx.gate_text(g, 'B, C, H')}" for g in ctx.gates)
    step_header(ctx, L, "_update_step", carried + ctx.views + ctx.gates + [last], accs, last, shapes, "B, C, H")
    with L.indent():
        em = ctx.emitter()
        ctx.lets(L, em, "B, C, H")
        held = {s: fresh(f"{s}_held", taken) for s in ctx.states}
        for s in ctx.states:
            L(f"{held[s]} = {s}.unsqueeze(1)", shape_text("B, 1, H", spec.state[s].shape) + f": {s} for every token")
        rd = ctx.emitter(names=dict(held))
        L(f"o = {rd.emit(spec.read)}", shape_text("B, C, H", ctx.read_shape()) + ": apply: each token reads the held state")
        # the chunk's sums of weighted gradients: one backward pass of the weighted chunk loss each
        args = [held.get(a, a) for a in ctx.loss_args]
        sums: dict = {}
        for i, wg in enumerate(plan.weights):
            argnums = tuple(1 + ctx.loss_args.index(s) for s in wg.targets)
            outs = [fresh(f"sum_{s}", taken) for s in wg.targets]
            for s, o in zip(wg.targets, outs):
                sums[(i, s)] = o
            an = f"({argnums[0]},)" if len(argnums) == 1 else repr(argnums)
            lhs = ", ".join(outs) + ("," if len(outs) == 1 else "")
            w = em._emit(wg.weight)
            L(f"{lhs} = torch.func.grad(self._update_loss, argnums={an})({w.text}, {', '.join(args)})",
              f"sum_t {unparse(wg.weight)} grad(loss, {', '.join(wg.targets)})_t")
        for a in accs:
            k = [x for x in accs if x.index == a.index].index(a)
            refs = [(sign, f"{sums[(i, s)]}.squeeze(1)") for sign, i, s in plan.terms[(a.index, k)]]
            L(f"{a.name} = {a.name} {_signed(refs)}", shape_text("B, H", a.shape) + f": + sum_t {unparse(a.term)}")
        update_lines(ctx, L, plan, accs, last, rows=False)
        L(f"return o, {tuple_text(carried)}")
    L()


def _names(ctx, exprs) -> set:
    """The names the expressions ``exprs`` read, the model's body (which they may call) with them."""
    body = [ctx.spec.model.body] if ctx.spec.model is not None else []
    return {n.id for e in exprs + body for n in e.walk() if isinstance(n, Name)}


def _read_states(ctx) -> list:
    """The states the read (through the model) reads."""
    names = _names(ctx, [ctx.spec.read])
    return [s for s in ctx.states if s in names]


def _rows_text(ctx, names) -> str:
    """``x [B, C, H, d], ...``: the chunk's rows ``names`` with their shapes, for a docstring."""
    return ", ".join(f"{x} " + shape_text("B, C, H", ctx.shape(Name(x))) for x in names)


def _whole_chunk(ctx, accs, kept) -> tuple[list, list]:
    """A whole chunk's call of the rows step from a chunk boundary: (its carried arguments, the
    sums empty; the names its carried results bind, the sums, empty again, dropped)."""
    return (ctx.states + ["None"] * len(accs) + list(kept.values()),
            ctx.states + ["_"] * len(accs) + list(kept.values()))


def _head_major(L, inputs) -> None:
    """Token-major rows [B, C, H, ...] as head-major views [B, H, C, ...]."""
    if not inputs:
        return
    if len(inputs) == 1:
        L(f"{inputs[0]} = {inputs[0]}.transpose(1, 2)", "a head-major view [B, H, C, ...]")
    else:
        L(f"{', '.join(inputs)} = (x.transpose(1, 2) for x in {tuple_text(inputs)})", "head-major views [B, H, C, ...]")


def _carried(ctx, accs, kept: dict) -> list:
    """What the rows chunk step takes and returns besides its rows: the states, the chunk's
    gradient sums so far, the carried column norms."""
    return ctx.states + [a.name for a in accs] + list(kept.values())


def _sum_text(refs: list) -> str:
    """``a``, ``-a``, ``a - b``: the signed sum of ``refs`` [(sign, text)]."""
    return " ".join(("" if i == 0 and sign > 0 else "-" if i == 0 else "+ " if sign > 0 else "- ") + ref
                    for i, (sign, ref) in enumerate(refs))


def _signed(refs: list) -> str:
    """``+ a``, ``- a``, ``+ (a - b)``: the signed sum of ``refs`` [(sign, text)] to add to a local."""
    if len(refs) == 1:
        sign, ref = refs[0]
        return ("+ " if sign > 0 else "- ") + ref
    return f"+ ({_sum_text(refs)})"


EMITTER = Emitter(
    family="apply_update", emit=emit, forward_method="_forward_apply_update",
    schedule_text="apply_update({chunk}): each chunk reads the state the previous chunk left, then every state "
                  "updates once with the chunk's summed gradient terms (approximate; chunk 1 equals online)",
    chunk_step=("_update_fn", "_update_step"), compiled=compiled_methods, approximation="apply-then-update",
    block_sums=True)
