"""The update-statement checks: temporaries (named, assigned once, shadowing nothing), the
targets of statements, caches grown only by ``append``, ``grad`` of a scalar loss that depends
on the state, and block updates that sum only gradient terms."""
from __future__ import annotations

from ..lang.blocks import NotBlockwise, block_statements, frequencies
from ..lang.expr import Call, Name
from .context import CheckContext, quoted
from .declarations import identifier_problem


def temporary(cx: CheckContext, st, tsp, temps: dict) -> None:
    """An update target that is no declared name: a per-token temporary."""
    spec, t = cx.spec, st.target
    m = spec.model
    shadowed = {"loss": "the inner loss 'loss'", "logit": "'logit' (the input of gate formulas)"}
    if m is not None:
        shadowed[m.name] = f"the model {quoted(m.name)}"
        shadowed.setdefault(m.arg, f"the model's argument {quoted(m.arg)}")
    if t in shadowed:
        cx.bad_names.add(t)
        cx.d.error(f"the temporary {quoted(t)} would shadow {shadowed[t]}", tsp,
                   hint="give the temporary a name of its own, e.g. g", code="E-temp-shadow")
        return
    prob = identifier_problem(t, cx.spec.name)
    if prob is not None:
        cx.bad_names.add(t)
        cx.d.error(f"temporary name {quoted(t)} {prob[0]}", tsp, hint=prob[1], code="E-identifier")
        return
    if t in temps:
        first = temps[t].target_span or temps[t].span
        where = f" (line {first.line})" if first is not None else ""
        cx.d.error(f"the temporary {quoted(t)} is assigned twice{where}; a temporary is assigned once per token",
                   tsp, hint=f"give the second value a new name (e.g. {t}2), or declare {t} under state "
                             "to update it in place", code="E-temp-twice")
        return
    temps[t] = st


def updates(cx: CheckContext) -> None:
    spec = cx.spec
    temps: dict = {}
    for st in spec.update:
        kind = cx.first_kind.get(st.target)
        tsp = st.target_span or st.span
        if st.target in cx.dup_names:
            continue  # reported as a duplicate
        if kind is None:
            temporary(cx, st, tsp, temps)
            continue
        if kind != "state":
            cx.d.error(f"{quoted(st.target)} is a {kind}; update statements assign states or new temporaries",
                       tsp, hint="a temporary needs a name of its own; a value carried from token to token "
                                 "is declared under state", code="E-target")
            continue
        st_decl = spec.state.get(st.target)
        v = st.value
        is_append = isinstance(v, Call) and v.fn == "append"
        if st_decl is not None and st_decl.cache:
            if not is_append:
                cx.d.error(f"the cache {quoted(st.target)} is only updated as {st.target} = append({st.target}, k)",
                           v.span or st.span, hint="a cache grows by one vector per token", code="E-cache")
            elif v.args and isinstance(v.args[0], Name) and v.args[0].id != st.target:
                cx.d.error(f"append onto {quoted(v.args[0].id)} assigned to {quoted(st.target)}",
                           v.args[0].span or v.span, hint=f"write {st.target} = append({st.target}, k)",
                           code="E-cache")
        # append anywhere but the top of a cache statement
        for x in v.walk():
            if isinstance(x, Call) and x.fn == "append" and not (x is v and st_decl is not None and st_decl.cache):
                if x is v and st_decl is not None and not st_decl.cache:
                    continue  # reported by shapes: not a cache
                cx.d.error("append(K, k) is only allowed as a whole statement K = append(K, k)",
                           x.fn_span or x.span, hint="a cache grows by one vector per token", code="E-cache")
    for where, e in cx.other_exprs():
        for x in e.walk():
            if isinstance(x, Call) and x.fn == "append":
                cx.d.error(f"append(K, k) is only allowed as an update statement K = append(K, k), not in {where}",
                           x.fn_span or x.span, code="E-cache")


def loss_scalar(cx: CheckContext) -> None:
    """grad of a non-scalar loss."""
    spec = cx.spec
    if spec.loss is None or not any(isinstance(x, Call) and x.fn == "grad"
                                    for st in spec.update for x in st.value.walk()):
        return
    shape = next((cx.g.nodes[n]["shape"] for n in cx.g.nodes if cx.g.nodes[n]["op"] == "loss"), ())
    if shape:
        cx.d.error(f"grad needs a scalar loss; the loss has shape [{', '.join(shape)}]", spec.loss.span,
                   hint="reduce it, e.g. sum((f(k) - v)^2) or mean(...)", code="E-grad")


def grad_dependence(cx: CheckContext) -> None:
    spec = cx.spec
    if spec.loss is None:
        return
    used = {x.id for x in spec.loss.walk() if isinstance(x, Name)}
    if spec.model is not None and any(isinstance(x, Call) and x.fn == spec.model.name for x in spec.loss.walk()):
        used |= set(spec.model_states())
    for st in spec.update:
        for x in st.value.walk():
            if (isinstance(x, Call) and x.fn == "grad" and len(x.args) == 2 and isinstance(x.args[1], Name)
                    and x.args[1].id in spec.state and not spec.state[x.args[1].id].cache
                    and x.args[1].id not in used):
                w = x.args[1].id
                cx.d.warning(f"the loss does not depend on {quoted(w)}; grad(loss, {w}) is always zero",
                             x.span, hint="the loss reaches a state through the model or by naming it",
                             code="W-grad-zero")


def blocks(cx: CheckContext) -> None:
    """Block updates (``every C``): each gradient they sum must be written in the statement."""
    spec = cx.spec
    every = frequencies(spec)
    if all(c == 1 for c in every.values()):
        return
    try:
        block_statements(spec, every)
    except NotBlockwise as err:
        cx.d.error(err.problem, cx.span("state", err.target, "every") or cx.span("update"),
                   hint=err.hint, code="E-every")
