"""Semantic diff of two specs: typed edits by component, and graph edits.

``diff(a, b)`` compares two memories (``Spec`` values or spec paths, YAML or `.mem`
in any mix; ``extends`` is resolved by the loader) and returns a list of
:class:`Added` / :class:`Removed` / :class:`Changed` edits, each with the
component it belongs to, a path into the spec, the old and new value (readable
text, numbers for constants and dims) and the source spans of both sides.

Expressions are compared through :func:`memspec.normalize.canon`, so formatting and
the usual algebraic rewrites never show up as a change; when two expressions
differ only in their numbers, each differing number is reported as a changed
constant (path ``(..., "const")``, or ``(..., "const", i)`` when several differ).

The update program is aligned statement by statement (targets must agree, equal
right-hand sides are preferred), so inserting a decay statement in front of a
delta write is one ``Added`` edit, not a cascade.

``graph_diff(a, b)`` compares the dataflow graphs of :func:`memspec.graph.lower`:
nodes and edges added, removed, or with changed attributes (op, shape, label, role).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Iterable

from ..lang.errors import Span, json_printable, printable
from ..lang.expr import Expr, FunDef, format_number, unparse
from ..lang.fmt import value_text
from ..lang.normalize import Normalizer, skeleton
from ..lang.spec import WIRING_OPTIONS, Gate, Param, Spec, State, View, Wiring

COMPONENTS = (
    "meta", "dims", "constants", "views", "gates", "params", "state", "let",
    "model", "loss", "update", "read", "order", "schedule", "wiring", "graph",
)


# ------------------------------------------------------------------ edits
@dataclass(frozen=True)
class Edit:
    """One difference between two specs.  Spans never take part in equality."""

    component: str
    path: tuple
    old: Any = None
    new: Any = None
    old_span: Span | None = field(default=None, compare=False, repr=False)
    new_span: Span | None = field(default=None, compare=False, repr=False)
    kind: ClassVar[str] = "edit"

    def where(self) -> str:
        """The path as dotted text: ``gates.alpha``, ``update[1]``, ``loss.const``;
        graph edits read ``node update:W#1`` and ``edge gate:eta -> update:W#1``."""
        if self.component == "graph" and self.path and self.path[0] in ("node", "edge"):
            return f"{self.path[0]} " + " -> ".join(str(p) for p in self.path[1:])
        out = ""
        for p in self.path:
            if isinstance(p, int):
                out += f"[{p}]"
            else:
                out += ("." if out else "") + str(p)
        return out

    def to_json(self) -> dict:
        def sp(s: Span | None):
            return None if s is None else {"file": s.file, "line": s.line, "col": s.col}

        return {
            "kind": self.kind, "component": self.component, "path": list(self.path),
            "old": _jsonable(self.old), "new": _jsonable(self.new),
            "old_span": sp(self.old_span), "new_span": sp(self.new_span),
        }


@dataclass(frozen=True)
class Added(Edit):
    kind: ClassVar[str] = "added"


@dataclass(frozen=True)
class Removed(Edit):
    kind: ClassVar[str] = "removed"


@dataclass(frozen=True)
class Changed(Edit):
    kind: ClassVar[str] = "changed"


def _jsonable(v: Any) -> Any:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return str(v)


# ------------------------------------------------------------ describing
# the wiring parameters each kind uses (memspec.wiring): MAC cuts segments, MAG and
# MAL run sliding-window attention; all have persistent tokens and the attention's
# qk_norm; then each kind's own options (memspec.lang.spec.WIRING_OPTIONS)
WIRING_FIELDS = {"none": (), **{kind: (cut, "persistent", "qk_norm") + WIRING_OPTIONS[kind]
                                 for kind, cut in (("mac", "segment"), ("mag", "window"), ("mal", "window"))}}


def shape_text(shape: Iterable[str]) -> str:
    return "[" + ", ".join(shape) + "]"


def describe(entry: Any) -> Any:
    """A readable one-line value for an entry of a spec section."""
    if isinstance(entry, View):
        return entry.dim
    if isinstance(entry, Gate):
        s = unparse(entry.formula)
        if entry.shape:
            s = f"{shape_text(entry.shape)} = {s}"
        return s if not entry.bias else f"{s} bias {format_number(_pretty(entry.bias))}"
    if isinstance(entry, Param):
        init = entry.init if isinstance(entry.init, str) else format_number(entry.init)
        return f"{shape_text(entry.shape)} = {init}"
    if isinstance(entry, State):
        if entry.cache:
            return f"cache {shape_text(entry.shape)}" + (f" window {entry.window}" if entry.window else "")
        return f"{shape_text(entry.shape)} = {entry.init}" + (f" every {entry.every}" if entry.every else "")
    if isinstance(entry, Wiring):
        if entry.kind == "none":
            return "none"
        args = ", ".join(f"{f} = {value_text(getattr(entry, f))}" for f in WIRING_FIELDS[entry.kind])
        return f"{entry.kind}({args})"
    if isinstance(entry, (Expr, FunDef)):
        return str(entry)
    return _pretty(entry)


def schedule_text(decision: Any) -> str:
    s = decision.family
    if decision.chunk:
        s += f" chunk {decision.chunk}"
    return s + (", exact" if decision.exact else ", approximate")


def derived_schedule(spec: Spec) -> Any:
    """The schedule decision of a (checked) spec."""
    from ..pipeline.build import decide

    return decide(spec)


# --------------------------------------------------------------- the diff
def _as_spec(x: Spec | str | Path) -> Spec:
    """A spec as given, or loaded from a path and verified (raises ``SpecError``)."""
    if isinstance(x, Spec):
        return x
    from ..pipeline.build import load_checked

    return load_checked(x).spec


def _span(spec: Spec, path: tuple, node: Any = None) -> Span | None:
    sp = getattr(node, "span", None)
    if sp is not None:
        return sp
    p = tuple(path)
    while p:
        s = spec.key_span(*p) if len(p) == len(path) else spec.span(*p)
        if s is not None:
            return s
        p = p[:-1]
    return spec.span()


class _Differ:
    def __init__(self, a: Spec, b: Spec):
        self.a, self.b = a, b
        self.na = Normalizer(a.model.name if a.model else None)
        self.nb = Normalizer(b.model.name if b.model else None)
        self.edits: list[Edit] = []

    # -- emitting
    def added(self, comp, path, new, node=None):
        self.edits.append(Added(comp, path, None, new, None, _span(self.b, path, node)))

    def removed(self, comp, path, old, node=None):
        self.edits.append(Removed(comp, path, old, None, _span(self.a, path, node), None))

    def changed(self, comp, path, old, new, nodes=(None, None), span_path=None):
        sp = span_path or path
        self.edits.append(Changed(comp, path, old, new,
                                  _span(self.a, sp, nodes[0]), _span(self.b, sp, nodes[1])))

    # -- values
    def value(self, comp, path, old, new):
        if old != new:
            self.changed(comp, path, old, new)

    def expr(self, comp, path, ea, eb, *, na=None, nb=None, texts=None, nodes=None) -> None:
        """Compare two expressions (either may be None) and emit edits.

        ``texts`` are the old/new values shown for a structural change (default: the
        expressions), ``nodes`` the AST values whose spans locate the edit.
        """
        na, nb = na or self.na, nb or self.nb
        ta, tb = texts or (None if ea is None else str(ea), None if eb is None else str(eb))
        xa, xb = nodes or (ea, eb)
        if ea is None and eb is None:
            return
        if ea is None:
            self.added(comp, path, tb, xb)
            return
        if eb is None:
            self.removed(comp, path, ta, xa)
            return
        ca, cb = na.canon(ea), nb.canon(eb)
        if ca == cb:
            return
        (ska, nums_a), (skb, nums_b) = skeleton(ca), skeleton(cb)
        if ska == skb:
            diffs = [i for i, (x, y) in enumerate(zip(nums_a, nums_b)) if x != y]
            for i in diffs:
                p = path + (("const",) if len(diffs) == 1 else ("const", i))
                self.changed(comp, p, _pretty(nums_a[i]), _pretty(nums_b[i]), (xa, xb), span_path=path)
            return
        self.changed(comp, path, ta, tb, (xa, xb))

    def section(self, comp: str, key: str, fields_fn):
        da, db = getattr(self.a, key), getattr(self.b, key)
        for name in list(da) + [n for n in db if n not in da]:
            path = (key, name)
            if name not in db:
                self.removed(comp, path, describe(da[name]))
            elif name not in da:
                self.added(comp, path, describe(db[name]))
            else:
                fields_fn(path, da[name], db[name])

    # -- the components, in order
    def run(self) -> list[Edit]:
        a, b = self.a, self.b
        for f in ("name", "description", "cite"):
            self.value("meta", (f,), getattr(a, f), getattr(b, f))
        self.section("dims", "dims", lambda p, x, y: self.value("dims", p, x, y))
        self.section("constants", "constants",
                     lambda p, x, y: self.value("constants", p, _pretty(x), _pretty(y)))
        self.section("views", "views", lambda p, x, y: self.value("views", p + ("dim",), x.dim, y.dim))
        self.section("gates", "gates", self._gate)
        self.section("params", "params", self._param)
        self.section("state", "state", self._state)
        self.section("let", "let", lambda p, x, y: self.expr("let", p, x, y))
        self._model()
        self.expr("loss", ("loss",), a.loss, b.loss)
        self._update()
        self.expr("read", ("read",), a.read, b.read)
        self.value("order", ("order",), a.order, b.order)
        self._schedule()
        self._wiring()
        return self.edits

    def _gate(self, p, x: Gate, y: Gate):
        self.expr("gates", p + ("formula",), x.formula, y.formula)
        self.value("gates", p + ("shape",), shape_text(x.shape), shape_text(y.shape))
        self.value("gates", p + ("bias",), _pretty(x.bias), _pretty(y.bias))

    def _param(self, p, x: Param, y: Param):
        self.value("params", p + ("shape",), shape_text(x.shape), shape_text(y.shape))
        self.value("params", p + ("init",), x.init, y.init)

    def _state(self, p, x: State, y: State):
        if x.cache != y.cache:
            self.changed("state", p, describe(x), describe(y))
            return
        self.value("state", p + ("shape",), shape_text(x.shape), shape_text(y.shape))
        self.value("state", p + ("init",), x.init, y.init)
        self.value("state", p + ("window",), x.window, y.window)
        self.value("state", p + ("every",), x.every, y.every)

    def _model(self):
        ma, mb = self.a.model, self.b.model
        if ma is None or mb is None:
            if ma is not mb:
                (self.added("model", ("model",), str(mb), mb) if ma is None
                 else self.removed("model", ("model",), str(ma), ma))
            return
        # the argument is renamed to a placeholder on each side
        self.expr("model", ("model",), ma.body, mb.body, na=Normalizer(ma.name, ma.arg),
                  nb=Normalizer(mb.name, mb.arg), texts=(str(ma), str(mb)), nodes=(ma, mb))

    def _update(self):
        ua, ub = self.a.update, self.b.update
        ca = [self.na.canon(s.value) for s in ua]
        cb = [self.nb.canon(s.value) for s in ub]
        for op, i, j in align(
            [s.target for s in ua], [s.target for s in ub], lambda i, j: ca[i] == cb[j]
        ):
            if op == "removed":
                self.removed("update", ("update", i), str(ua[i]), ua[i])
            elif op == "added":
                self.added("update", ("update", j), str(ub[j]), ub[j])
            else:
                sa, sb = ua[i], ub[j]
                self.expr("update", ("update", j), sa.value, sb.value,
                          texts=(str(sa), str(sb)), nodes=(sa, sb))

    def _schedule(self):
        self.value("schedule", ("schedule", "declared"), self.a.schedule, self.b.schedule)
        da, db = derived_schedule(self.a), derived_schedule(self.b)
        self.value("schedule", ("schedule", "derived"), schedule_text(da), schedule_text(db))

    def _wiring(self):
        # only the parameters the wiring kind uses take part; a change of kind is one edit
        wa, wb = self.a.wiring, self.b.wiring
        if wa.kind != wb.kind:
            self.changed("wiring", ("wiring",), describe(wa), describe(wb), span_path=("wiring", "kind"))
            return
        for f in WIRING_FIELDS[wa.kind]:
            self.value("wiring", ("wiring", f), getattr(wa, f), getattr(wb, f))


def _pretty(v: Any) -> Any:
    """Numbers as ints when integral, so edits read ``0.5 -> 1`` rather than ``1.0``."""
    if isinstance(v, float) and v.is_integer() and abs(v) < 1e15:
        return int(v)
    return v


def align(ta: list[str], tb: list[str], same) -> list[tuple[str, int | None, int | None]]:
    """Align two statement lists by target (a minimum-cost edit script).

    Matching two statements with the same target costs 0 when ``same(i, j)``, else 1;
    adding or removing one costs 1.5.  Returns ``("removed", i, None)``,
    ``("added", None, j)`` and ``("matched", i, j)`` in program order.
    """
    n, m = len(ta), len(tb)
    INF = float("inf")
    cost = [[INF] * (m + 1) for _ in range(n + 1)]
    cost[n][m] = 0.0
    for i in range(n, -1, -1):
        for j in range(m, -1, -1):
            if i == n and j == m:
                continue
            best = INF
            if i < n:
                best = min(best, 1.5 + cost[i + 1][j])
            if j < m:
                best = min(best, 1.5 + cost[i][j + 1])
            if i < n and j < m and ta[i] == tb[j]:
                best = min(best, (0.0 if same(i, j) else 1.0) + cost[i + 1][j + 1])
            cost[i][j] = best
    out: list[tuple[str, int | None, int | None]] = []
    i = j = 0
    while i < n or j < m:
        if i < n and j < m and ta[i] == tb[j] and \
                cost[i][j] == (0.0 if same(i, j) else 1.0) + cost[i + 1][j + 1]:
            out.append(("matched", i, j))
            i, j = i + 1, j + 1
        elif i < n and cost[i][j] == 1.5 + cost[i + 1][j]:
            out.append(("removed", i, None))
            i += 1
        else:
            out.append(("added", None, j))
            j += 1
    return out


def diff(a: Spec | str | Path, b: Spec | str | Path, *, graph: bool = False) -> list[Edit]:
    """Typed edits turning spec ``a`` into spec ``b`` (empty when they mean the same).

    With ``graph=True`` the edits of :func:`graph_diff` follow the semantic ones.
    """
    sa, sb = _as_spec(a), _as_spec(b)
    edits = _Differ(sa, sb).run()
    if graph:
        edits += graph_diff(sa, sb)
    return edits


# ------------------------------------------------------------ graph edits
GRAPH_ATTRS = ("op", "shape", "label", "role")


def node_text(attrs: dict) -> str:
    parts = [str(attrs.get("op", "?"))]
    shape = attrs.get("shape")
    if shape is not None:
        parts.append(shape_text(shape) if isinstance(shape, (list, tuple)) else str(shape))
    label = attrs.get("label")
    if label and label != attrs.get("op"):
        parts.append(f"'{label}'")
    return " ".join(parts)


def graph_edits(ga, gb) -> list[Edit]:
    """Node and edge edits between two networkx digraphs (ids are the stable node ids)."""
    out: list[Edit] = []

    def sp(g, n):
        return g.nodes[n].get("span")

    for n in ga.nodes:
        if n not in gb:
            out.append(Removed("graph", ("node", n), node_text(ga.nodes[n]), None, sp(ga, n), None))
    for n in gb.nodes:
        if n not in ga:
            out.append(Added("graph", ("node", n), None, node_text(gb.nodes[n]), None, sp(gb, n)))
        else:
            xa = {k: ga.nodes[n].get(k) for k in GRAPH_ATTRS}
            xb = {k: gb.nodes[n].get(k) for k in GRAPH_ATTRS}
            if xa != xb:
                out.append(Changed("graph", ("node", n), node_text(ga.nodes[n]), node_text(gb.nodes[n]),
                                   sp(ga, n), sp(gb, n)))

    def etext(g, u, v):
        d = {k: x for k, x in g.edges[u, v].items() if k != "span"}
        return ", ".join(f"{k}={d[k]}" for k in sorted(d))

    for u, v in ga.edges:
        if not gb.has_edge(u, v):
            out.append(Removed("graph", ("edge", u, v), etext(ga, u, v), None))
    for u, v in gb.edges:
        if not ga.has_edge(u, v):
            out.append(Added("graph", ("edge", u, v), None, etext(gb, u, v)))
        elif etext(ga, u, v) != etext(gb, u, v):
            out.append(Changed("graph", ("edge", u, v), etext(ga, u, v), etext(gb, u, v)))
    return out


def collapse(g):
    """The graph of top-level operations: every sub-expression node ``owner/e.1.0`` is
    merged into its owner (``update:W#1``, ``loss@update:W#1``, ``read``, ...), and an
    edge joins two owners when any of their nodes are joined."""
    import networkx as nx

    def owner(n: str) -> str:
        return str(n).split("/", 1)[0]

    out = nx.DiGraph()
    for n, d in g.nodes(data=True):
        if owner(n) == n:
            out.add_node(n, **{k: v for k, v in d.items() if k != "args"})
    for n in g.nodes:  # owners that only exist as sub-expressions
        if owner(n) not in out:
            out.add_node(owner(n), op="expr", role=None, label=None, shape=None, span=g.nodes[n].get("span"))
    for u, v in g.edges:
        ou, ov = owner(u), owner(v)
        if ou != ov:
            out.add_edge(ou, ov)
    return out


def lower_graph(spec: Spec, *, detail: bool = False):
    """The dataflow graph of :func:`memspec.graph.lower`, collapsed to top-level
    operations unless ``detail``."""
    from ..check.graph import lower  # imported lazily: the diff itself needs no graph

    g = lower(spec)
    return g if detail else collapse(g)


def graph_diff(a: Spec | str | Path, b: Spec | str | Path, *, detail: bool = False) -> list[Edit]:
    """Graph edits between the dataflow graphs of two specs: nodes and edges added,
    removed or changed.  By default sub-expression nodes are merged into the statement,
    loss, read, ... they belong to (see :func:`collapse`); ``detail=True`` compares
    every operation node."""
    return graph_edits(lower_graph(_as_spec(a), detail=detail), lower_graph(_as_spec(b), detail=detail))


# -------------------------------------------------------------- rendering
ANSI = {"added": "\x1b[32m", "removed": "\x1b[31m", "changed": "\x1b[33m", "bold": "\x1b[1m", "reset": "\x1b[0m"}
SIGN = {"added": "+", "removed": "-", "changed": "~"}


def source_line(span: Span | None) -> str | None:
    """``file:line: text`` of the line a span starts on (None when unknown)."""
    if span is None:
        return None
    from ..lang.errors import _source_line

    text = _source_line(span.file, span.line, None)
    return f"{span.file}:{span.line}: {text.strip() if text is not None else ''}".rstrip()


MAX_TEXT = 100


def _short(v: Any) -> str:
    s = " ".join(value_text(v).split())
    return s if len(s) <= MAX_TEXT else s[: MAX_TEXT - 1] + "…"


def _summary(e: Edit) -> str:
    if e.component == "graph" and e.path[:1] == ("edge",) and not (e.old or e.new):
        return e.where()
    if isinstance(e, Added):
        return f"{e.where()}: {_short(e.new)}"
    if isinstance(e, Removed):
        return f"{e.where()}: {_short(e.old)}"
    return f"{e.where()}: {_short(e.old)} -> {_short(e.new)}"


def _grouped(edits: list[Edit]) -> list[tuple[str, list[Edit]]]:
    out: dict[str, list[Edit]] = {}
    for e in edits:
        out.setdefault(e.component, []).append(e)
    return [(c, out[c]) for c in COMPONENTS if c in out] + \
        [(c, v) for c, v in out.items() if c not in COMPONENTS]


def render_text(edits: list[Edit], *, color: bool = False, heading: str | None = None) -> str:
    """One block per component; each edit with both sides' source lines."""
    def c(kind: str, s: str) -> str:
        return f"{ANSI[kind]}{s}{ANSI['reset']}" if color else s

    # spec text is made printable before memspec's own colour codes are added
    lines: list[str] = []
    if heading:
        lines.append(c("bold", "\n".join(printable(h) for h in heading.split("\n"))))
    for comp, es in _grouped(edits):
        lines.append(c("bold", comp))
        for e in es:
            lines.append("  " + c(e.kind, f"{SIGN[e.kind]} {printable(_summary(e))}"))
            a, b = source_line(e.old_span), source_line(e.new_span)
            if a:
                lines.append("      " + c("removed", "- " + printable(a)))
            if b:
                lines.append("      " + c("added", "+ " + printable(b)))
    return "\n".join(lines) + ("\n" if lines else "")


def _md(s: Any) -> str:
    return printable(_short(s)).replace("|", "\\|")


def render_markdown(edits: list[Edit], *, heading: str | None = None) -> str:
    out: list[str] = []
    if heading:
        out += [f"### {' '.join(printable(h) for h in heading.split(chr(10)))}", ""]
    if not edits:
        return "\n".join(out + ["No differences.", ""])
    out += ["| | component | path | old | new | where |", "|---|---|---|---|---|---|"]
    for e in edits:
        where = " → ".join(f"{printable(s.file)}:{s.line}" for s in (e.old_span, e.new_span) if s is not None)
        old = f"`{_md(e.old)}`" if e.old is not None else ""
        new = f"`{_md(e.new)}`" if e.new is not None else ""
        out.append(f"| {SIGN[e.kind]} | {e.component} | `{_md(e.where())}` | {old} | {new} | {where} |")
    return "\n".join(out) + "\n"


def render_json(edits: list[Edit], graph: list[Edit] | None = None) -> str:
    import json

    doc: dict[str, Any] = {"equal": not edits, "edits": [e.to_json() for e in edits]}
    if graph is not None:
        doc["graph"] = [e.to_json() for e in graph]
    return json_printable(json.dumps(doc, indent=2, ensure_ascii=False)) + "\n"


def _dot_id(s: Any) -> str:
    return '"' + printable(str(s)).replace("\\", "\\\\").replace('"', '\\"') + '"'


DOT_COLORS = {"added": "#2e7d32", "removed": "#c62828", "changed": "#ef6c00", "same": "#444444"}
DOT_FILL = {"added": "#e8f5e9", "removed": "#ffebee", "changed": "#fff3e0", "same": "#ffffff"}


def render_dot(ga, gb, *, title: str = "diff") -> str:
    """The union of two dataflow graphs: added nodes/edges green, removed red (dashed),
    changed orange, shared ones grey."""
    lines = [f"digraph {_dot_id(title)} {{", "  rankdir=TB;",
             '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10];',
             '  edge [fontname="Helvetica", fontsize=9];']
    nodes = list(ga.nodes) + [n for n in gb.nodes if n not in ga]
    for n in nodes:
        if n not in gb:
            st, text = "removed", node_text(ga.nodes[n])
        elif n not in ga:
            st, text = "added", node_text(gb.nodes[n])
        else:
            same = all(ga.nodes[n].get(k) == gb.nodes[n].get(k) for k in GRAPH_ATTRS)
            st = "same" if same else "changed"
            text = node_text(gb.nodes[n]) if same else f"{node_text(ga.nodes[n])} → {node_text(gb.nodes[n])}"
        style = ', style="rounded,filled,dashed"' if st == "removed" else ""
        label = printable(f"{n}\\n{text}").replace('"', '\\"')
        lines.append(f'  {_dot_id(n)} [label="{label}", color="{DOT_COLORS[st]}", '
                     f'fillcolor="{DOT_FILL[st]}"{style}];')
    edges = list(ga.edges) + [e for e in gb.edges if not ga.has_edge(*e)]
    for u, v in edges:
        st = "removed" if not gb.has_edge(u, v) else "added" if not ga.has_edge(u, v) else "same"
        style = ", style=dashed" if st == "removed" else ""
        lines.append(f"  {_dot_id(u)} -> {_dot_id(v)} [color=\"{DOT_COLORS[st]}\"{style}];")
    lines.append("}")
    return "\n".join(lines) + "\n"
