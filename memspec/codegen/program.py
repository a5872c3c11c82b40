"""The update program as emitted statements: gradients first, then each statement.

Shared by the per-token step of the online schedule and the materialising mini-batch
chunk step (which replays a token's statements on the chunk-start state).  Which
gradients are computed together before which statement is the online plan's
``grad_groups`` (:mod:`memspec.schedule.online`).
"""
from __future__ import annotations

from ..lang.expr import BinOp, Call, Name, Transpose, rewrite, unparse
from ..lang.names import fresh
from ..schedule.algebra import ONE, is_num
from .exprs import P_ATOM
from .text import shape_text


def grad_target(ctx, c: Call) -> str:
    """The state ``grad(loss, W)`` (or ``grad(loss)``: the model's first state) differentiates."""
    if len(c.args) == 2:
        return c.args[1].id
    return ctx.spec.model_states()[0]


def grad_call_line(ctx, L, group, taken: set, where: str, em=None) -> dict:
    """Emit ``grad_W1, grad_W2 = torch.func.grad(self.inner_loss, argnums=...)(...)``, or the
    group's closed-form gradient program where the plan has one; returns ``unparse(call) -> local``."""
    targets = []
    for c in group:
        t = grad_target(ctx, c)
        if t not in targets:
            targets.append(t)
    cg = ctx.closed_grads.get(tuple(unparse(c) for c in group))
    if cg is not None and em is not None:
        outs = closed_grad_lines(ctx, L, em, cg, targets, taken, where)
        return {unparse(c): outs[grad_target(ctx, c)] for c in group}
    window = window_closed(ctx, targets)
    if window is not None and em is not None and not em.rows:
        outs = window_grad_lines(ctx, L, window, targets, taken, where)
        return {unparse(c): outs[grad_target(ctx, c)] for c in group}
    argnums = tuple(ctx.loss_args.index(t) for t in targets)
    outs = {t: fresh(f"grad_{t}", taken) for t in targets}
    lhs = ", ".join(outs[t] for t in targets) + ("," if len(targets) == 1 else "")
    an = f"({argnums[0]},)" if len(argnums) == 1 else repr(argnums)
    L(f"{lhs} = torch.func.grad(self.inner_loss, argnums={an})({', '.join(ctx.loss_args)})", where)
    return {unparse(c): outs[grad_target(ctx, c)] for c in group}


def window_closed(ctx, targets):
    """The window loss of the mini-batch plan (:class:`memspec.schedule.window.WindowLoss`) when
    its row loss has a closed-form gradient for every target, else None."""
    plan = ctx.plans.get("minibatch")
    window = getattr(plan, "window", None)
    if window is None or window.closed is None or not all(window.closed.of(t) for t in targets):
        return None
    return window


def window_grad_lines(ctx, L, window, targets, taken: set, where: str) -> dict:
    """A window loss's gradients at the current state: the row loss's closed-form program over the
    caches' rows at once (rows mode, a cache [B, H, n, ...] as the rows), each gradient the sum
    of its rows' outer products as one product ``x^T delta``; returns target -> local."""
    names = {row: cache for cache, row in window.rows.items()}
    scope = {row: tuple(ctx.spec.state[cache].shape) for cache, row in window.rows.items()}
    em = ctx.emitter(rows=True, names=names).with_scope(**scope)
    closed_grad_lines(ctx, L, em, window.closed, targets, taken, f"{where}, every row of the window",
                      prefix="B, H, n")
    outs = {}
    for t in targets:
        outs[t] = fresh(f"grad_{t}", taken)
        L(f"{outs[t]} = {weighted_grad_sum(ctx, em, window.closed, t, ONE)}",
          shape_text("B, H", ctx.spec.state[t].shape) + f": grad(loss, {t}), summed over the rows")
    return outs


def live_steps(cg, targets) -> list:
    """The steps of ``cg`` that the gradients of ``targets`` need (a forward value no adjoint
    reads, e.g. the output of a layer the loss is linear in, is not computed)."""
    need = set()
    for t in targets:
        for site in cg.of(t):
            need |= {site.delta} | ({site.input} if site.input else set())
    live = []
    for st in reversed(cg.forward + cg.backward):
        if st.name in need:
            live.append(st)
            need |= {n.id for n in st.value.walk() if isinstance(n, Name)}
    return live[::-1]


def step_expr(st):
    """A gradient step's value as an expression of the language (its state written out)."""
    if st.kind == "layer":
        return BinOp("@", st.value, Name(st.state))
    if st.kind == "bias":
        return BinOp("+", st.value, Name(st.state))
    if st.kind == "back":
        return BinOp("@", st.value, Transpose(Name(st.state)))
    return st.value


def closed_grad_lines(ctx, L, em, cg, targets, taken: set, where: str, prefix: str = "B, H") -> dict:
    """One token's closed-form gradients (a :class:`memspec.schedule.backprop.ClosedGrad`):
    the loss's steps forward, its adjoints backward, then each target's gradient
    ``outer(input, delta)`` (a bias: ``delta``) summed over its sites; returns target -> local.
    With a rows emitter (``em.rows``) the steps are the chunk's rows at once and nothing is
    summed here (:func:`weighted_grad_sum`)."""
    steps = live_steps(cg, targets)
    taken |= {s.name for s in steps}
    scope = {}
    for i, st in enumerate(steps):
        sub = em.with_scope(**scope)
        code = sub._emit(step_expr(st))
        text = code.text if code.rank == len(st.shape) else f"{sub._lift(code, len(st.shape))}.expand_as({st.like})"
        note = where if i == 0 else ("the loss's gradient w.r.t. " + st.like if st.like and st in cg.backward
                                     else "")
        L(f"{st.name} = {text}", shape_text(prefix, st.shape) + (f": {note}" if note else ""))
        scope[st.name] = st.shape
    if em.rows:
        return {}
    outs = {}
    for t in targets:
        terms = []
        for site in cg.of(t):
            terms.append(f"{site.input}.unsqueeze(-1) * {site.delta}.unsqueeze(-2)" if site.input else site.delta)
        if len(terms) == 1 and not cg.of(t)[0].input:
            outs[t] = terms[0]
            continue
        outs[t] = fresh(f"grad_{t}", taken)
        L(f"{outs[t]} = {' + '.join(terms)}", shape_text("B, H", ctx.spec.state[t].shape) + f": grad(loss, {t})")
    return outs


def weighted_grad_sum(ctx, em, cg, target: str, weight) -> str:
    """Rows: ``sum_t weight_t grad(loss, target)_t`` over the chunk's rows, after
    :func:`closed_grad_lines` bound the steps: ``x^T (weight * delta)`` per site (a product
    ``[B, H, d, C] @ [B, H, C, h]``, ``_outer_sum``: its backward forms both gradients row-major),
    a bias site ``sum_t weight_t delta_t``."""
    scope = {st.name: st.shape for st in cg.forward + cg.backward}
    sub = em.with_scope(**scope)
    terms = []
    for site in cg.of(target):
        d = sub._emit(Name(site.delta) if is_num(weight, 1) else BinOp("*", weight, Name(site.delta)))
        if site.input:
            x = sub._emit(Name(site.input))
            em.helpers.add("_outer_sum")
            terms.append(f"_outer_sum({x.text}, {d.text})")
        else:
            terms.append(f"{d.at(P_ATOM)}.sum(-2)")
    return " + ".join(terms)


def emit_updates(ctx, L, em, taken, where, keep=None, stop=None, blocks=True) -> list:
    """Emit the update statements [0, stop) in order, each preceded by the gradients it
    needs (computed jointly at the same state values).  Assignments only for the
    statement indices in ``keep`` (None: all).  A block statement (``ctx.blocks``, when
    ``blocks``) adds its gradient terms to their running sums and assigns under its
    block's last-token flag.  Returns, per statement, the map ``unparse(grad call) -> local``
    in effect at that statement."""
    spec = ctx.spec
    maps = []
    block_of = {b.index: b for b in ctx.blocks} if blocks else {}
    for i, (stmt, group) in enumerate(zip(spec.update, ctx.grad_groups)):
        if stop is not None and i >= stop:
            break
        if group:
            em.grads.update(grad_call_line(ctx, L, group, taken, where, em))
        maps.append(dict(em.grads))
        if keep is not None and i not in keep:
            continue
        st = spec.state.get(stmt.target)
        v = stmt.value
        if st is None:   # a per-token temporary: a local variable of this token
            L(f"{stmt.target} = {em.emit(v)}",
              shape_text("B, H", ctx.env.names.get(stmt.target) or ()) + ": a temporary of this token")
            continue
        if isinstance(v, Call) and v.fn == "append" and not st.shape:   # a cache of scalars [B, H, n]
            item = em._emit(v.args[1])
            item = f"{stmt.target}.new_full({stmt.target}.shape[:-1], {item.text})" if item.number else item.at(9)
            win = f"[..., -{st.window}:]" if st.window else ""
            L(f"{stmt.target} = torch.cat([{stmt.target}, {item}.unsqueeze(-1)], dim=-1){win}",
              shape_text("B, H", ("n",)))
            continue
        if isinstance(v, Call) and v.fn == "append":
            ctx.helpers.add("append")
            item = em.emit(v.args[1])
            win = f", {st.window}" if st.window else ""
            L(f"{stmt.target} = append({stmt.target}, {item}{win})",
              shape_text("B, H", ("n",) + tuple(st.shape)))
            continue
        if i in block_of:
            block_update(ctx, L, em, block_of[i], stmt)
            continue
        assign_line(L, em, stmt.target, st, v)
    return maps


def assign_line(L, em, target: str, st, value, prefix: str = "B, H") -> None:
    """``target = <value>``, broadcast to the state's shape."""
    code = em._emit(value)
    text = code.text
    if code.number:
        text = f"({text}) * torch.ones_like({target})"
    elif code.rank < len(st.shape):
        text = f"{em._lift(code, len(st.shape))}.expand_as({target})"
    L(f"{target} = {text}", shape_text(prefix, st.shape))


def summed(value, accs) -> tuple:
    """A block statement's value with each gradient term replaced by the name of its running sum
    (:class:`BlockAcc`), and those names' shapes (an emitter scope)."""
    by_term = {unparse(a.term): a.name for a in accs}
    return (rewrite(value, lambda n: Name(by_term[unparse(n)]) if unparse(n) in by_term else None),
            {a.name: a.shape for a in accs})


def block_update(ctx, L, em, b, stmt, prefix: str = "B, H") -> None:
    """A statement of a state updated every C tokens: its gradient terms added to their
    running sums; at the block's last token the statement with each term replaced by its
    sum, and the sums reset."""
    accs = [a for a in ctx.accs if a.index == b.index]
    for a in accs:
        term = em._emit(a.term)
        text = em._lift(term, len(a.shape)) if term.rank < len(a.shape) else term.text
        L(f"{a.name} = {a.name} + {text}", shape_text(prefix, a.shape) + f": the block's sum of {unparse(a.term)}")
    value, scope = summed(stmt.value, accs)
    sub = em.with_scope(**scope)
    L(f"if {ctx.flags[b.every]}:", f"the last token of a block of {b.every}: {stmt.target} takes the block's update")
    with L.indent():
        assign_line(L, sub, stmt.target, ctx.spec.state[stmt.target], value, prefix)
        for a in accs:
            L(f"{a.name} = torch.zeros_like({a.name})")


def shadow_plan(ctx):
    """For the mini-batch gradients: (statements to replay, states they start from, last).

    In a chunk, token i's statements are replayed on the chunk-start state (the shadow)
    and each grad(...) is taken there, i.e. at the chunk-start values carried through
    the token's own earlier statements (memspec.reference's rule; C = 1 is online)."""
    spec = ctx.spec
    last = max(i for i, st in enumerate(spec.update)
               if any(isinstance(c, Call) and c.fn == "grad" for c in st.value.walk()))
    needed = set(ctx.loss_states)
    keep = set()
    temps = {st.target for st in spec.update if st.target not in spec.state}
    for j in range(last - 1, -1, -1):
        stmt = spec.update[j]
        if stmt.target in needed:
            keep.add(j)
            needed |= {n.id for n in stmt.value.walk() if isinstance(n, Name)
                       and (n.id in spec.state or n.id in temps)}
    starts = [s for s in ctx.states if s in needed]
    return keep, starts, last
