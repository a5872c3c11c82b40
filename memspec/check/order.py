"""The order checks: what each formula may use at its place in a token step (a gate only its
logit, constants, dims and params; the model its argument and states; a let no state and no
later let), and no cycle within a step."""
from __future__ import annotations

import networkx as nx

from ..lang.errors import Collector
from ..lang.expr import Call, Name
from ..lang.shapes import ShapeEnv, let_order
from .context import CheckContext, quoted


def gates(cx: CheckContext) -> None:
    spec = cx.spec
    allowed = {"dim", "constant", "param"}
    env = None
    for n, gt in spec.gates.items():
        if len(gt.shape) > 1:
            cx.d.error(f"gate {quoted(n)} has shape [{', '.join(gt.shape)}]; a gate is a scalar or a vector per "
                       "head", spec.span("gates", n, "shape") or cx.span("gates", n),
                       hint="a per-channel gate has one dim, e.g. shape: [d_k]", code="E-shape")
        elif all(d in spec.dims for d in gt.shape):
            env = env or ShapeEnv.from_spec(spec)
            got = env.infer(gt.formula, context="gate", scope=env.gate_scope(n), diags=Collector())
            want = tuple(gt.shape)
            if got is not None and got not in ((), want):
                decl = f"declared with shape [{', '.join(want)}]" if want else "a scalar per head"
                cx.d.error(f"the formula of gate {quoted(n)} has shape [{', '.join(got)}], but the gate is {decl}",
                           gt.formula.span or cx.span("gates", n),
                           hint=(f"declare it with shape: [{', '.join(got)}]" if len(got) == 1 else
                                 "a gate formula computes one value per head (and channel)"),
                           code="E-shape")
        for x in gt.formula.walk():
            if isinstance(x, Name) and x.id != "logit":
                kind = cx.first_kind.get(x.id)
                if kind is not None and kind not in allowed:
                    cx.d.error(f"gate {quoted(n)} uses the {kind} {quoted(x.id)}; a gate formula may use only logit, "
                               "constants, dims and params", x.span,
                               hint="a gate is computed from the layer input: a formula of logit = x·w + bias",
                               code="E-order")
            if isinstance(x, Call) and spec.model is not None and x.fn == spec.model.name:
                cx.d.error(f"gate {quoted(n)} applies the model {x.fn}; a gate formula may use only logit, "
                           "constants, dims and params", x.fn_span or x.span, code="E-order")


def model_scope(cx: CheckContext) -> None:
    """The model is f(u; state): its argument, states, params, constants and dims."""
    m = cx.spec.model
    if m is None:
        return
    allowed = {"dim", "constant", "param", "state"}
    for x in m.body.walk():
        if isinstance(x, Name) and x.id != m.arg:
            kind = cx.first_kind.get(x.id)
            if kind is not None and kind not in allowed:
                cx.d.error(f"the model uses the {kind} {quoted(x.id)}; a model may use only its argument "
                           f"{quoted(m.arg)}, states, params, constants and dims", x.span,
                           hint=f"pass it in as the argument, e.g. {m.name}({x.id}), or use it in the loss",
                           code="E-order")


def lets(cx: CheckContext) -> None:
    spec = cx.spec
    names = list(spec.let)
    pos = {n: i for i, n in enumerate(names)}
    in_cycle = set(names) - set(let_order(spec.let))
    for n, e in spec.let.items():
        for x in e.walk():
            if not isinstance(x, Name):
                continue
            kind = cx.first_kind.get(x.id)
            if kind == "state":
                cx.d.error(f"let {quoted(n)} reads the state {quoted(x.id)}; lets are computed before the update",
                           x.span, hint="use the state in the model, an update statement or the read",
                           code="E-order")
            elif kind == "let" and x.id in pos and pos[x.id] > pos[n] and n not in in_cycle:
                cx.d.error(f"let {quoted(n)} uses the let {quoted(x.id)}, which is defined later", x.span,
                           hint=f"move {x.id} above {n}", code="E-order")


def cycles(cx: CheckContext) -> None:
    g = cx.g
    for comp in nx.strongly_connected_components(g):
        if len(comp) == 1:
            (only,) = comp
            if not g.has_edge(only, only):
                continue
        owners = [n for n in g.nodes if n in comp and g.nodes[n]["role"] == "let" and "/" not in n]
        if not owners:
            owners = [n for n in g.nodes if n in comp]
        names = [o.split(":", 1)[1] if o.startswith("let:") else o for o in owners]
        first = owners[0]
        sp = g.nodes[first].get("span")
        chain = " -> ".join(names + [names[0]])
        cx.d.error(f"cycle within a step: {chain}", sp,
                   hint="a let cannot depend on itself, directly or through other lets", code="E-cycle")
