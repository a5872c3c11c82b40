"""How large a spec's expressions grow once lets, temporaries, earlier update statements,
the loss and the model are inlined, as the schedule analysis and the generator inline them.

Each expression is bounded when parsed (``MAX_EXPR_DEPTH``), but inlining composes them:
a chain of a thousand lets is a thousand levels deep, and ``b1 = b0 * b0; b2 = b1 * b1; ...``
doubles in size with every let.  :func:`inlined_problems` measures depth and node count
without building anything (sizes are added, never expanded) and reports an expression
past ``MAX_INLINED_DEPTH`` or ``MAX_INLINED_NODES`` before any phase inlines it.
"""
from __future__ import annotations

from ..lang.expr import Call, Expr, Name
from ..lang.limits import MAX_INLINED_DEPTH, MAX_INLINED_NODES
from ..lang.shapes import let_order

Measure = tuple[int, int]   # (depth, nodes) of an expression after inlining


def measure(e: Expr, env: dict[str, Measure], model=None, model_measure: Measure | None = None) -> Measure:
    """(depth, nodes) of ``e`` with every name in ``env`` replaced by what it stands for and
    each application of ``model`` by its body; an explicit stack, no recursion."""
    out: dict[int, Measure] = {}
    stack: list[tuple[Expr, bool]] = [(e, False)]
    while stack:
        node, ready = stack.pop()
        kids = node.children()
        if not ready:
            stack.append((node, True))
            stack.extend((c, False) for c in kids)
            continue
        if isinstance(node, Name):
            d, n = env.get(node.id, (0, 0))
            out[id(node)] = (d + 1, n + 1)
            continue
        sub = [out[id(c)] for c in kids]
        depth = max((d for d, _ in sub), default=0)
        nodes = sum(n for _, n in sub)
        if isinstance(node, Call) and model is not None and model_measure is not None and node.fn == model.name:
            out[id(node)] = (model_measure[0] + depth, model_measure[1] * max(1, nodes))
        else:
            out[id(node)] = (depth + 1, nodes + 1)
    return out[id(e)]


def inlined_problems(spec) -> list[tuple[str, object]]:
    """(message, span) for each expression too deep or too large once inlined."""
    problems: list[tuple[str, object]] = []

    def judge(what: str, m: Measure, span) -> Measure:
        d, n = m
        if d > MAX_INLINED_DEPTH or n > MAX_INLINED_NODES:
            problems.append((f"{what} grows too large once lets, temporaries, earlier statements and the model "
                             f"are inlined ({d} levels deep, {n:,} nodes; at most {MAX_INLINED_DEPTH} levels and "
                             f"{MAX_INLINED_NODES:,} nodes)", span))
            raise _TooLarge
        return m

    try:
        _walk(spec, judge)
    except _TooLarge:   # the first place it grows past the limit: later ones are its echoes
        pass
    return problems


class _TooLarge(Exception):
    pass


def _walk(spec, judge) -> None:
    env: dict[str, Measure] = {}
    for n in let_order(spec.let):
        env[n] = judge(f"let {n}", measure(spec.let[n], env), spec.span("let", n) or spec.let[n].span)
    model, model_m = spec.model, None
    if model is not None:
        model_m = judge("the model", measure(model.body, env), model.span)
    if spec.loss is not None:
        env["loss"] = judge("the loss", measure(spec.loss, env, model, model_m), spec.loss.span)
    read_before = spec.order == "read_write"
    if read_before:
        judge("the read", measure(spec.read, env, model, model_m), spec.read.span)
    for st in spec.update:
        env[st.target] = judge(f"update statement {st.target} = ...", measure(st.value, env, model, model_m),
                               st.span)
        if model is not None and model_m is not None:   # the model reads the states as they are now
            model_m = judge("the model", measure(model.body, env), model.span)
    if not read_before:
        judge("the read", measure(spec.read, env, model, model_m), spec.read.span)
