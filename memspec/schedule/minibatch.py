"""Family ``minibatch``: gradient writes whose update program, with each ``grad(...)`` held as a
token-local input, is a chain of linear recurrences with token-local scalar coefficients.
Inside a chunk every gradient is taken at the chunk-start state: an approximation of
online learning (chunk 1 equals it), used only when a spec asks for it.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..lang.blocks import NotBlockwise, block_statements, frequencies
from ..lang.expr import BinOp, Call, Expr, Name, rewrite, substitute, unparse
from ..lang.shapes import ShapeEnv
from .algebra import (ZERO, Algebra, NotAdmitted, all_updates, compose_all, drop_grads, is_num,
                      replace_grads, simplify)
from .dual import DualForm, NotDual, analyse_dual
from .online import loss_states, written_before_a_gradient
from .polynomial import linear_form
from .recurrence import NotRecurrence, Recurrence, input_name, minibatch_recurrence
from .window import WindowLoss, analyse_window, window_dual


@dataclass(frozen=True)
class MinibatchPlan:
    """The update program as linear recurrences: ``new[S] = sum_R coef[S][R] * old[R] + rest[S]``.

    ``grads`` maps the placeholder names used in ``rest`` to the original ``grad(...)`` calls
    (evaluated at the chunk-start states in the mini-batch schedule).  ``recurrence`` is the
    same program statement by statement (:class:`.recurrence.Recurrence`, each statement's
    gradients the placeholders of ``grad_sites``: name -> (statement index, call)), which the
    materialising chunk step solves; ``dual`` is the dual form when the spec admits it
    (:mod:`.dual`), else ``no_dual`` says why not; ``window``: a window loss over caches, its
    row-by-row form (:mod:`.window`), whose per-row gradients make every token's.  ``how``: the
    reasons' lines that say how a chunk runs (nested blocks, the window's form, the dual form or
    why not), which ``explain`` shows for a spec that may ask for mini-batch."""

    coef: dict
    rest: dict
    grads: dict
    chunk: int
    recurrence: Recurrence
    grad_sites: dict
    dual: DualForm | None
    no_dual: str | None
    window: WindowLoss | None = None
    how: tuple = field(default=(), repr=False)   # (text for explain, not part of the printed plan)


def analyse_minibatch(alg: Algebra, chunk: int) -> tuple[MinibatchPlan, list[str]]:
    table: dict = {}
    updates = [(t, replace_grads(e, alg, table)) for t, e in all_updates(alg)]
    if not table:
        raise NotAdmitted("the update takes no gradient (mini-batch learning needs gradient writes)")
    window = analyse_window(alg) if alg.caches else None
    if window is not None:
        _window_gradients_at_start(alg)
    blocks = _blocks(alg, chunk)
    grads = {name: call for name, call in table.values()}
    reasons = []
    how = []                     # the lines of reasons that say how a chunk runs
    linear_err = None            # why the whole token is not one linear program (if it is not)
    try:
        if blocks or window is not None:
            raise NotAdmitted("block updates or a window loss")
        coef, rest = _linear_program(alg, updates)
    except NotAdmitted as err:   # inputs that are functions of solved states, mirror steps, blocks
        linear_err = err
        held = {b.index for b in blocks} | ({i for i, _ in window.caches.values()} if window else set())
        recurrence, sites = _statement_recurrence(alg, held)
        coef, rest = {}, {}
        reasons += _recurrence_reasons(alg, recurrence, sites, {b.target for b in blocks})
        for b in blocks:
            how.append(f"{b.target} updates every {b.every} tokens, a multiple of the chunk {chunk} (nested "
                       f"chunks): it holds through each chunk, the chunk adds its tokens' "
                       + ", ".join(unparse(t) for t in b.terms) + " to the block's sums, and the chunk that "
                       f"ends a block applies `{unparse(alg.spec.update[b.index].value)}` with them")
        reasons += how
    else:
        for n in alg.states:
            total: Expr = ZERO
            for k, v in coef[n].items():
                total = BinOp("+", total, BinOp("*", v, Name(k)))
            txt = gtxt(simplify(BinOp("+", total, rest[n])), grads)
            reasons.append(f"update of {n} is a linear recurrence with token-local scalar coefficients "
                           f"when each grad(...) is held fixed: {n} <- {txt}")
        recurrence, sites = _statement_recurrence(alg)
    reasons.append("mini-batch: inside a chunk every grad(...) is taken at the chunk-start state, "
                   "the recurrences run token by token (an approximation of online learning; "
                   "chunk 1 equals online)")
    if window is not None:
        wdual, why_not = window_dual(alg, window, recurrence, sites)
        window = replace(window, dual=wdual)
        lines = window.describe() + (wdual.describe() if wdual is not None else
                                     [f"no banded dual form ({why_not}): each chunk materialises every token's state"])
        reasons += lines
        how += lines
    try:
        if blocks:
            raise NotDual(f"{', '.join(b.target for b in blocks)} update once per block")
        if window is not None:
            raise NotDual("the loss reads caches")
        dual, no_dual = analyse_dual(alg.spec), None
        lines = dual.describe()
    except NotDual as err:
        dual, no_dual = None, str(err)
        # (a window loss said above how its chunks run)
        muon = any(isinstance(c, Call) and c.fn == "newton_schulz" for st in alg.spec.update for c in st.value.walk())
        blocked = "" if blocks or recurrence.mirror else (
            ", in blocks of a few tokens, each block's steps batched over its tokens"
            + (" (one Newton-Schulz iteration for all of them)" if muon else ""))
        lines = [] if window is not None else [f"no dual form ({err}): each chunk materialises every token's "
                                               f"state{blocked}"]
    if dual is None and row_scaled(alg.spec, recurrence):
        # a row or column scaling (diag(c) @ S, S @ diag(c)) runs only in the dual form (the materialising
        # step scales by scalars)
        raise NotAdmitted(f"{linear_err} (and no dual form: {no_dual})") if linear_err else NotAdmitted(no_dual)
    reasons += lines
    how += lines
    return MinibatchPlan(coef, rest, grads, chunk, recurrence, sites, dual, no_dual, window, tuple(how)), reasons


def _window_gradients_at_start(alg: Algebra) -> None:
    """With a window loss every gradient of a chunk is at the chunk-start learned states: no
    statement before a gradient may change a learned state the loss reads."""
    spec = alg.spec
    hit = written_before_a_gradient(spec, set(loss_states(spec)) - alg.caches)
    if hit is not None:
        raise NotAdmitted(f"{spec.update[hit[0]].target} changes before a gradient of the window loss is taken")


def _linear_program(alg: Algebra, updates) -> tuple[dict, dict]:
    """The whole token's update as ``new[S] = sum_R coef[S][R] old[R] + rest[S]`` (each grad held
    fixed), solvable one state after another; raises NotAdmitted."""
    final = compose_all(alg, updates)
    coef, rest = {}, {}
    for n in alg.states:
        e = final.get(n, Name(n))
        c, r = linear_form(alg, e, set(alg.states), "the states")
        if any(alg.depends(x) for x in c.values()) or alg.depends(r):
            raise NotAdmitted(f"the update of {n} is not a linear recurrence with token-local coefficients")
        coef[n] = {k: simplify(v) for k, v in c.items() if not is_num(simplify(v), 0)}
        rest[n] = simplify(r)
    # the scans solve the recurrences one state after another: off-diagonal dependencies must be acyclic
    done: list[str] = []
    pending = list(alg.states)
    while pending:
        ready = [n for n in pending if all(r == n or r in done for r in coef[n])]
        if not ready:
            raise NotAdmitted(f"the recurrences of {', '.join(pending)} feed each other's previous values "
                              f"(a coupled system, not a chain of scalar recurrences)")
        done.append(ready[0])
        pending.remove(ready[0])
    return coef, rest


def _blocks(alg: Algebra, chunk: int) -> tuple:
    """The block statements (states with ``every C``) the chunk step can run: C a multiple of the
    chunk, gradients taken before any block statement that changes what the loss reads, and no
    other state's statement reading a block state."""
    spec = alg.spec
    try:
        blocks = block_statements(spec, frequencies(spec))
    except NotBlockwise as err:
        raise NotAdmitted(str(err)) from None
    if not blocks:
        return ()
    off = sorted({b.every for b in blocks if b.every % chunk})
    if off:
        raise NotAdmitted(f"a block of {', '.join(map(str, off))} tokens is not a whole number of chunks of {chunk}")
    slow = {b.target for b in blocks}
    hit = written_before_a_gradient(spec, slow & set(loss_states(spec)))
    if hit is not None:
        raise NotAdmitted(f"a gradient is taken after {spec.update[hit[0]].target}'s block update in the token "
                          "(take the gradients first)")
    for i, st in enumerate(spec.update):
        if i in {b.index for b in blocks}:
            continue
        no_grads = drop_grads(st.value)
        used = {n.id for n in no_grads.walk() if isinstance(n, Name)} & slow
        if used:
            raise NotAdmitted(f"`{st}` reads {', '.join(sorted(used))}, which updates once per block")
    return blocks


def _recurrence_reasons(alg: Algebra, rec: Recurrence, sites: dict, held: set = frozenset()) -> list[str]:
    """explain lines for a program solved statement by statement (inputs, mirror steps)."""
    calls = {ph: c for ph, (_, c) in sites.items()}
    out = []
    for s in rec.order:
        if s in alg.caches or s in held:
            continue
        total: Expr = ZERO
        for (when, r), c in rec.coeff[s].items():
            if not row_scaled(alg.spec, rec, c):
                total = BinOp("+", total, BinOp("*", c, Name(r)))
            elif s in rec.cols:
                total = BinOp("+", total, BinOp("@", Name(r), Call("diag", [c])))
            else:
                total = BinOp("+", total, BinOp("@", Call("diag", [c]), Name(r)))
        if rec.rest[s] is not None:
            back = {input_name(w, n): Name(n) for n in alg.states for w in ("prev", "cur")}
            total = BinOp("+", total, substitute(rec.rest[s], {**calls, **back}))
        body = unparse(simplify(total))
        ins = rec.inputs.get(s, ())
        via = (" with " + ", ".join(f"{r} ({'after' if w == 'cur' else 'before'} the token)" for w, r in ins)
               + " read from its solved sequence") if ins else ""
        if s in rec.mirror:
            c, axis = rec.mirror[s]
            body = unparse(simplify(substitute(total, {s: Name("Z")})))
            out.append(f"update of {s} is a mirror-descent step {s} = {unparse(c)} * softmax(Z, {axis}): its logits "
                       f"follow the linear recurrence Z <- {body}{via} (log {s} differs from Z by a shift along "
                       f"{axis}, which softmax ignores)")
        else:
            out.append(f"update of {s}, statement by statement with each grad(...) held fixed: {s} <- {body}{via}")
    return out


def _statement_recurrence(alg: Algebra, held: set = frozenset()) -> tuple[Recurrence, dict]:
    """The :class:`Recurrence` the materialising chunk step solves: every ``grad(...)`` of
    statement i replaced by a placeholder ``_g<i>_<k>`` (token-local, the gradient's shape),
    so that the same call in two statements (taken at different values) stays two inputs.
    Returns the recurrence and ``placeholder -> (statement index, call)``."""
    spec = alg.spec
    sites: dict = {}
    values = []
    for i, stmt in enumerate(spec.update):
        names: dict = {}
        if i in held:   # a block update: the state holds through the chunk (the chunk step adds the block)
            values.append(Name(stmt.target))
            continue

        def placeholder(c: Expr, i=i, names=names) -> Expr | None:
            if not (isinstance(c, Call) and c.fn == "grad"):
                return None
            key = unparse(c)
            if key not in names:
                names[key] = f"_g{i}_{len(names)}"
                sites[names[key]] = (i, c)
            return Name(names[key])

        values.append(rewrite(stmt.value, placeholder))
    scope = {ph: tuple(spec.state[alg.grad_target(c)].shape) for ph, (_, c) in sites.items()}
    for n, st in spec.state.items():
        for when in ("prev", "cur"):
            scope[input_name(when, n)] = tuple(st.shape)
    try:
        return minibatch_recurrence(spec, values, scope, inputs=True), sites
    except NotRecurrence as err:   # the statement-by-statement form is the general one: its failure is the reason
        raise NotAdmitted(str(err)) from None


def row_scaled(spec, rec: Recurrence, c: Expr | None = None) -> bool:
    """Is the coefficient ``c`` a vector (a row scaling ``diag(c) @ R``, or a column scaling
    ``R @ diag(c)`` for the recurrence's ``cols``), or, without ``c``, has the recurrence one?"""
    env = ShapeEnv.from_spec(spec)
    cs = [c] if c is not None else [cf for s in rec.order for cf in rec.coeff[s].values()]
    return any(len(env.infer(x) or ()) == 1 for x in cs)


def gtxt(e: Expr, grads: dict) -> str:
    return unparse(substitute(e, {k: v for k, v in grads.items()}))
