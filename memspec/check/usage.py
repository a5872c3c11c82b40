"""The usage checks of a valid graph: every state written and reaching the output, nothing
declared and never used, tensors small enough to allocate, ``log`` of a state that starts
positive."""
from __future__ import annotations

import networkx as nx

from ..lang.errors import did_you_mean
from ..lang.expr import Call, Name
from ..lang.spec import parse_init
from .context import SECTIONS, CheckContext, quoted
from .sizes import size_problems

LAYER_DIMS = frozenset({"d_model", "heads"})


def states(cx: CheckContext) -> None:
    spec, g = cx.spec, cx.g
    written = {st.target for st in spec.update}
    for n in spec.state:
        if n in cx.bad_names or cx.first_kind.get(n) != "state":
            continue
        if n not in written:
            temps = [t for t in written if t not in spec.state and cx.first_kind.get(t) is None]
            near = did_you_mean(n, temps)
            hint = (f"the update assigns the temporary {near[len('did you mean '):-1]}: a typo for {n}?"
                    if near else f"add an update statement `{n} = ...`; a learned tensor that the memory does not "
                                 "change is a param")
            cx.d.error(f"state {quoted(n)} is never written", cx.span("state", n), hint=hint,
                       code="E-state-unwritten")
    if cx.expression_errors():
        return  # the graph is incomplete; what reaches the output is not known
    reach = {n: nx.descendants(g, f"state_in:{n}") for n in spec.state if f"state_in:{n}" in g}
    live = {n for n, r in reach.items() if "output" in r}
    changed = True
    while changed:
        changed = False
        for n, r in reach.items():
            if n not in live and any(f"state_out:{m}" in r for m in live):
                live.add(n)
                changed = True
    for n in spec.state:
        if n in live or n in cx.bad_names or cx.first_kind.get(n) != "state" or n not in reach:
            continue
        succ = set(g.successors(f"state_in:{n}")) - {f"state_out:{n}"}
        named = any(isinstance(x, Name) and x.id == n for e in cx.all_exprs() for x in e.walk())
        if not succ and named:
            # a per-token temporary (e.g. g = grad(loss, W); W = W - eta * g): legal, but carried for nothing
            cx.d.warning(f"state {quoted(n)} is overwritten before it is read: its value from the previous token "
                         "is never used", cx.span("state", n),
                         hint=f"for a per-token temporary, remove the state declaration: an update "
                              f"statement `{n} = ...` without a state binds a temporary",
                         code="W-state-temporary")
        elif not succ:
            cx.d.error(f"state {quoted(n)} is never read", cx.span("state", n),
                       hint="use it in the model, an update or the read, or remove it", code="E-state-unread")
        else:
            cx.d.error(f"state {quoted(n)} is never read by the output: its value does not reach the read",
                       cx.span("state", n),
                       hint="use it in the model or the read (directly or through another state), or remove it",
                       code="E-state-unread")


def unused(cx: CheckContext) -> None:
    spec, g = cx.spec, cx.g
    prefix = {"constant": "const", "view": "view", "gate": "gate", "param": "param", "let": "let"}
    for section, word in SECTIONS:
        if word in ("dim", "state"):
            continue
        for n in getattr(spec, section):
            nid = f"{prefix[word]}:{n}"
            if n in cx.bad_names or cx.first_kind.get(n) != word or nid not in g:
                continue
            if g.out_degree(nid) == 0:
                cx.d.warning(f"{word} {quoted(n)} is never used", cx.span(section, n),
                             hint="remove it, or use it", code="W-unused")
    used_dims = set(LAYER_DIMS)
    for v in spec.views.values():
        used_dims.add(v.dim)
    for sec in (spec.params, spec.state):
        for x in sec.values():
            used_dims.update(x.shape)
    for e in cx.all_exprs():
        used_dims.update(x.id for x in e.walk() if isinstance(x, Name))
    for n in spec.dims:
        if n not in used_dims and n not in cx.bad_names and cx.first_kind.get(n) == "dim":
            cx.d.warning(f"dim {quoted(n)} is never used", cx.span("dims", n), hint="remove it, or use it",
                         code="W-unused")
    for nid in g.nodes:
        a = g.nodes[nid]
        if a["role"] == "temp" and a.get("version") == 1 and g.out_degree(nid) == 0:
            t = a["target"]
            cx.d.warning(f"the temporary {quoted(t)} is never used", a.get("target_span") or a.get("span"),
                         hint="a temporary is visible only to later update statements; use it there, "
                              "or remove it", code="W-temp-unused")
    if spec.model is not None and not any(g.nodes[n]["op"] == "apply" for n in g.nodes):
        cx.d.warning(f"the model {spec.model.name} is never applied", spec.model.name_span or spec.model.span,
                     hint=f"apply it in the loss or the read, e.g. {spec.model.name}(q)", code="W-unused")
    if spec.loss is not None and not any(g.nodes[n]["op"] == "loss" for n in g.nodes):
        cx.d.warning("the loss is never used: no update statement takes grad(loss, ...)", spec.loss.span,
                     hint="remove it, or write an update like W = W - eta * grad(loss, W)", code="W-unused")


def sizes(cx: CheckContext) -> None:
    """Parameters and state that could not be allocated (memspec.check.sizes)."""
    for message, path in size_problems(cx.spec):
        cx.d.error(message, cx.span(*path) or cx.span("dims"),
                   hint="lower the dims (memspec.build(spec, d_k=...) sets them at build time)", code="E-size")


def log_states(cx: CheckContext) -> None:
    """``log(S)`` needs S > 0 from the first token on."""
    spec = cx.spec
    for e in cx.all_exprs():
        for c in e.walk():
            if isinstance(c, Call) and c.fn == "log" and c.args and isinstance(c.args[0], Name) \
                    and c.args[0].id in spec.state:
                st = spec.state[c.args[0].id]
                init = st.init if isinstance(st.init, str) else str(st.init)
                if isinstance(st.init, str):   # (a validated spec: the init parses)
                    d = parse_init(st.init)
                    nonpositive = d["kind"] in ("zeros", "eye", "normal") or (
                        d["kind"] == "uniform" and d["lo"] <= 0)
                else:
                    nonpositive = float(st.init) <= 0
                if nonpositive:
                    cx.d.warning(f"log({c.args[0].id}) of a state initialised with {init}, which has zero or "
                                 "negative entries: log gives -inf or NaN at the first token",
                                 c.span or cx.span("state", c.args[0].id),
                                 hint="start it positive, e.g. init: ones or learned(uniform(0.5, 1.5))",
                                 code="W-log-state")
