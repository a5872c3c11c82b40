"""The dataflow graph of one token step: ``lower(spec) -> networkx.DiGraph``.

One node per operation.  State enters as ``state_in:W`` (its value before the token)
and leaves as ``state_out:W`` (after it), so one token step is a DAG and every
cross-step edge goes from ``state_out:W`` of token t to ``state_in:W`` of token t+1.
Each update statement makes a new SSA version of its target; the expressions of a
statement (and the inner loss of its ``grad``) read the versions current at that
statement, exactly as the reference interpreter evaluates them.

Node ids (stable: adding an unrelated statement or declaration does not rename
other nodes):

==========================  ===================================================
``input:x``                 the layer input of the token, ``[d_model]``
``dim:d_k``                 a dim (integer scalar)
``const:lam``               a constant
``view:q``                  a view (a projection of x)
``logit:eta``               the logit ``x·w + bias`` of gate ``eta`` (if used)
``gate:eta``                a gate's value
``param:ln_w``              a learned outer-loop parameter
``let:kn``                  a let
``state_in:W``              state W before the token
``update:W#1``              the 1st assignment to W in the update program
                            (``#2`` the 2nd, ...), i.e. SSA version 1 of W
``loss@update:U#1``         the inner loss, evaluated at the state versions
                            current at statement ``U#1``
``grad:W@update:U#1``       grad(loss, W) inside statement ``U#1``
``temp:g``                  the per-token temporary ``g`` (an update statement
                            whose target is not a declared name: an SSA value
                            of this token only, never carried to the next one)
``read``                    the read expression's value
``output``                  the token's output o_t
``state_out:W``             state W after the token (its last version)
``<owner>/e``               the root operation of an owner's expression
``<owner>/e.1.0``           sub-expression by child index path (``.1`` is the
                            second operand, ``.1.0`` its first, ...), e.g.
                            ``update:W#1/e.0`` or ``loss@update:U#1/e.1``
==========================  ===================================================

Node attributes: ``op`` (``view``, ``gate``, ``add``, ``matmul``, ``sigmoid``,
``apply`` (the model), ``grad``, ``update``, ``num``, ...), ``role`` (``input``,
``dim``, ``const``, ``view``, ``gate``, ``param``, ``let``, ``state``, ``model``,
``loss``, ``grad``, ``update``, ``temp``, ``read``, ``output``), ``shape`` (a tuple of dim
names, ``None`` where inference failed), ``span`` (the :class:`~memspec.errors.Span`
it came from, or ``None``), ``label`` (short readable text) and ``args`` (the ids of
its inputs in operand order; edges carry no order).

``graph.graph["spec"]`` is the spec, ``graph.graph["diagnostics"]`` the problems
found while typing the expressions (lowering never raises; see
:func:`memspec.checks.check`).  ``render(graph, "text" | "dot" | "mermaid")`` prints
a stable, deterministic form.
"""
from __future__ import annotations

import re
from typing import Optional

import networkx as nx

from ..lang.errors import Collector
from ..lang.expr import BinOp, Call, Expr, Name, Neg, Num, Transpose, format_number, unparse
from ..lang.fmt import mem_constant
from ..lang.shapes import ShapeEnv, fmt_shape

_BINOPS = {"+": "add", "-": "sub", "*": "mul", "/": "div", "@": "matmul", "^": "pow"}
_SECTION_PREFIX = {"dim": "dim", "constant": "const", "view": "view", "gate": "gate",
                   "param": "param", "let": "let"}
MAX_LABEL = 48


def _short(text: str, n: int = MAX_LABEL) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"


class _Lowering:
    def __init__(self, spec):
        self.spec = spec
        self.g = nx.DiGraph()
        self.env = ShapeEnv.from_spec(spec)
        self.diags = Collector()
        self.diags.extend(self.env.diagnostics)
        self.current: dict[str, str] = {}  # state -> id of its current version
        self.records: dict[int, tuple] = {}

    # ------------------------------------------------------------ helpers
    def add(self, nid: str, op: str, role: str, shape, span, label: str, args=(), **extra) -> str:
        args = tuple(a for a in args if a is not None)
        self.g.add_node(nid, op=op, role=role, shape=shape, span=span, label=label, args=args, **extra)
        return nid  # edges are added at the end, when every node exists (lets may refer forward)

    def binding(self, name: str, scope: dict) -> Optional[str]:
        if name in scope:
            return scope[name]
        kind = self.env.kind(name)
        if kind == "state":
            return self.current.get(name)
        if kind in _SECTION_PREFIX:
            return f"{_SECTION_PREFIX[kind]}:{name}"
        return None

    def typed(self, expr: Expr, context: str, report: bool = True, scope: dict | None = None) -> None:
        """Infer the shapes of an owner expression once; remember them per AST node."""
        rec: dict = {}
        self.env.infer(expr, context=context, diags=self.diags if report else Collector(), record=rec,
                       scope=scope)
        self.records.update(rec)

    def shape_of(self, e: Expr):
        return self.records.get(id(e))

    # ------------------------------------------------------------ expressions
    def expr(self, e: Expr, owner: str, path: str, role: str, scope: dict) -> Optional[str]:
        """Lower ``e``; return the id of the node holding its value (None if unknown)."""
        nid = f"{owner}/e{path}"
        shape = self.shape_of(e)
        span = e.span
        if isinstance(e, Name):
            return self.binding(e.id, scope)
        if isinstance(e, Num):
            return self.add(nid, "num", role, (), span, format_number(e.value), value=e.value)
        if isinstance(e, BinOp):
            a = self.expr(e.left, owner, path + ".0", role, scope)
            b = self.expr(e.right, owner, path + ".1", role, scope)
            return self.add(nid, _BINOPS[e.op], role, shape, span, e.op, (a, b))
        if isinstance(e, Neg):
            a = self.expr(e.operand, owner, path + ".0", role, scope)
            return self.add(nid, "neg", role, shape, span, "-", (a,))
        if isinstance(e, Transpose):
            a = self.expr(e.operand, owner, path + ".0", role, scope)
            return self.add(nid, "transpose", role, shape, span, ".T", (a,))
        if isinstance(e, Call):
            return self.call(e, owner, path, role, scope, nid, shape)
        return None

    def call(self, e: Call, owner, path, role, scope, nid, shape) -> Optional[str]:
        m = self.spec.model
        if e.fn == "grad" and role == "update":
            return self.grad(e, owner, scope, shape)
        if m is not None and e.fn == m.name:
            a = [self.expr(x, owner, f"{path}.{i}", role, scope) for i, x in enumerate(e.args)]
            reads = []
            for n in dict.fromkeys(x.id for x in m.body.walk() if isinstance(x, Name) and x.id != m.arg):
                reads.append(self.binding(n, scope))
            return self.add(nid, "apply", "model", shape, e.span, _short(unparse(e), 32), (*a, *reads),
                            model=m.name)
        if e.fn == "eye":
            args = []
        else:
            args = [self.expr(a, owner, f"{path}.{i}", role, scope) for i, a in enumerate(e.args)]
        return self.add(nid, e.fn, role, shape, e.span, e.fn, args)

    def grad(self, e: Call, owner: str, scope: dict, shape) -> Optional[str]:
        spec = self.spec
        if len(e.args) == 2 and isinstance(e.args[1], Name):
            target = e.args[1].id
        elif len(e.args) == 1 and len(spec.model_states()) == 1:
            target = spec.model_states()[0]
        else:
            target = "?"
        loss = self.loss_instance(owner)
        nid = f"grad:{target}@{owner}"
        at = self.current.get(target) if self.env.kind(target) == "state" else None
        return self.add(nid, "grad", "grad", shape, e.span, f"grad(loss, {target})", (loss, at), wrt=target)

    def loss_instance(self, owner: str) -> Optional[str]:
        spec = self.spec
        if spec.loss is None:
            return None
        lid = f"loss@{owner}"
        if lid in self.g:
            return lid
        root = self.expr(spec.loss, lid, "", "loss", {})
        return self.add(lid, "loss", "loss", self.shape_of(spec.loss), spec.loss.span,
                        _short("loss = " + unparse(spec.loss)), (root,))

    # ------------------------------------------------------------ the step
    def run(self) -> nx.DiGraph:
        spec, env, g = self.spec, self.env, self.g
        g.graph["spec"] = spec
        g.graph["name"] = spec.name
        d_model = ("d_model",) if "d_model" in spec.dims else None
        self.add("input:x", "input", "input", d_model, None, "x")
        for n in spec.dims:
            self.add(f"dim:{n}", "dim", "dim", (), spec.key_span("dims", n), f"{n} = {spec.dims[n]}",
                     value=spec.dims[n])
        for n, c in spec.constants.items():
            self.add(f"const:{n}", "const", "const", (), spec.key_span("constants", n), f"{n} = {mem_constant(c) if isinstance(c, tuple) else format_number(c)}",
                     value=c)
        for n, v in spec.views.items():
            self.add(f"view:{n}", "view", "view", (v.dim,), spec.key_span("views", n), f"{n} = x·W_{n}",
                     ("input:x",))
        for n, p in spec.params.items():
            self.add(f"param:{n}", "param", "param", tuple(p.shape), spec.key_span("params", n),
                     f"param {n} = {p.init}")
        for n, gt in spec.gates.items():
            owner = f"gate:{n}"
            gscope = env.gate_scope(n)
            self.typed(gt.formula, "gate", scope=gscope)
            scope = {}
            if any(isinstance(x, Name) and x.id == "logit" for x in gt.formula.walk()):
                scope["logit"] = self.add(f"logit:{n}", "logit", "gate", gscope["logit"], spec.key_span("gates", n),
                                          _logit_label(n, gt.bias), ("input:x",), bias=gt.bias)
            root = self.expr(gt.formula, owner, "", "gate", scope)
            self.add(owner, "gate", "gate", env.names.get(n), spec.key_span("gates", n),
                     _short(f"{n} = {unparse(gt.formula)}"), (root,))
        for n, s in spec.state.items():
            self.current[n] = self.add(f"state_in:{n}", "state_in", "state", env.names.get(n),
                                       spec.key_span("state", n), f"{n} (before)")
        for n, e in spec.let.items():
            self.typed(e, "let", report=False)  # already reported by ShapeEnv.from_spec
        for n, e in spec.let.items():
            owner = f"let:{n}"
            root = self.expr(e, owner, "", "let", {})
            self.add(owner, "let", "let", env.names.get(n), spec.key_span("let", n), _short(f"{n} = {unparse(e)}"),
                     (root,))
        if spec.loss is not None:
            self.typed(spec.loss, "loss")
        if spec.read is not None:
            self.typed(spec.read, "read")
        if spec.order == "read_write":
            self.read()
        self.updates()
        if spec.order == "write_read":
            self.read()
        for n in spec.state:
            self.add(f"state_out:{n}", "state_out", "state", env.names.get(n), spec.key_span("state", n),
                     f"{n} (after)", (self.current.get(n),))
        for nid in list(g.nodes):
            for a in g.nodes[nid]["args"]:
                if a in g:
                    g.add_edge(a, nid)
        g.graph["diagnostics"] = self.diags.items
        return g

    def updates(self) -> None:
        """The update statements in order: each temporary's and state's new version a node."""
        spec, env = self.spec, self.env
        versions: dict[str, int] = {}
        temp_shapes: dict = {}   # the temporaries bound so far (name -> shape) ...
        temp_nodes: dict = {}    # ... and their nodes
        for i, st in enumerate(spec.update):
            self.typed(st.value, "update", scope=dict(temp_shapes))
            versions[st.target] = versions.get(st.target, 0) + 1
            v = versions[st.target]
            temp = env.kind(st.target) == "temp"
            if temp:
                owner = f"temp:{st.target}" + (f"#{v}" if v > 1 else "")
            else:
                owner = f"update:{st.target}#{v}"
            root = self.expr(st.value, owner, "", "update", dict(temp_nodes))
            if temp:
                shape = self.shape_of(st.value)
                self.add(owner, "temp", "temp", shape, st.span, _short(str(st)), (root,), target=st.target,
                         version=v, index=i, target_span=st.target_span)
                if v == 1:
                    temp_nodes[st.target], temp_shapes[st.target] = owner, shape
                continue
            self.add(owner, "update", "update", env.names.get(st.target) if env.kind(st.target) == "state" else None,
                     st.span, _short(str(st)), (root,), target=st.target, version=v,
                     index=i, target_span=st.target_span)
            if env.kind(st.target) == "state":
                self.current[st.target] = owner

    def read(self) -> None:
        spec = self.spec
        root = self.expr(spec.read, "read", "", "read", {})
        self.add("read", "read", "read", self.shape_of(spec.read), spec.read.span,
                 _short("read = " + unparse(spec.read)), (root,))
        self.add("output", "output", "output", self.shape_of(spec.read), spec.read.span, "o", ("read",))


def _logit_label(name: str, bias: float) -> str:
    if bias == 0:
        return f"x·w_{name}"
    sign = "-" if bias < 0 else "+"
    return f"x·w_{name} {sign} {format_number(abs(float(bias)))}"


def lower(spec) -> nx.DiGraph:
    """The dataflow graph of one token step of ``spec`` (see the module docstring).

    Never raises on a bad spec: typing problems are in ``graph.graph["diagnostics"]``
    and :func:`memspec.checks.check` reports them with the verifier's own checks.
    """
    return _Lowering(spec).run()


# ------------------------------------------------------------------ rendering
def node_order(graph: nx.DiGraph) -> list[str]:
    """Nodes in a deterministic topological order (ties broken by creation order);
    creation order if the graph has a cycle."""
    index = {n: i for i, n in enumerate(graph.nodes)}
    try:
        return list(nx.lexicographical_topological_sort(graph, key=lambda n: index[n]))
    except (nx.NetworkXUnfeasible, nx.NetworkXError):
        return list(graph.nodes)


def render(graph: nx.DiGraph, fmt: str = "text") -> str:
    """Printed form of a graph: ``text`` (listing in topological order with shapes),
    ``dot`` (Graphviz) or ``mermaid``."""
    if fmt == "text":
        return render_text(graph)
    if fmt == "dot":
        return render_dot(graph)
    if fmt == "mermaid":
        return render_mermaid(graph)
    raise ValueError(f"unknown graph format {fmt!r}: use text, dot or mermaid")


def render_text(graph: nx.DiGraph) -> str:
    order = node_order(graph)
    rows = []
    for n in order:
        a = graph.nodes[n]
        args = ", ".join(a.get("args", ()))
        rows.append((n, a["op"], fmt_shape(a.get("shape")), args, a.get("label", "")))
    w0 = max((len(r[0]) for r in rows), default=0)
    w1 = max((len(r[1]) for r in rows), default=0)
    w2 = max((len(r[2]) for r in rows), default=0)
    name = graph.graph.get("name", "?")
    out = [f"# dataflow graph of {name}: one token step, {graph.number_of_nodes()} nodes, "
           f"{graph.number_of_edges()} edges",
           "# id  op  shape  <- inputs  ; label"]
    for n, op, shape, args, label in rows:
        line = f"{n:<{w0}}  {op:<{w1}}  {shape:<{w2}}"
        if args:
            line += f"  <- {args}"
        if label:
            line += f"  ; {label}"
        out.append(line.rstrip())
    return "\n".join(out) + "\n"


def _dot_quote(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


_DOT_STYLE = {
    "input": 'shape=box, style=filled, fillcolor="#eeeeee"',
    "view": 'shape=box, style=filled, fillcolor="#dbe9f6"',
    "gate": 'shape=box, style=filled, fillcolor="#fde9c9"',
    "param": 'shape=box, style=filled, fillcolor="#e6dcf2"',
    "state": 'shape=box, style="filled,bold", fillcolor="#d5ecd4"',
    "update": 'shape=box, style=filled, fillcolor="#d5ecd4"',
    "grad": 'shape=ellipse, style=filled, fillcolor="#f6d5d5"',
    "loss": 'shape=ellipse, style=filled, fillcolor="#f6d5d5"',
    "model": 'shape=ellipse, style=filled, fillcolor="#fff7c2"',
    "output": 'shape=doublecircle',
}


def render_dot(graph: nx.DiGraph) -> str:
    order = node_order(graph)
    name = graph.graph.get("name", "memory")
    out = [f"digraph {_dot_quote(name)} {{", "  rankdir=TB;",
           '  node [fontname="Helvetica", fontsize=10, shape=ellipse];']
    for n in order:
        a = graph.nodes[n]
        label = f"{a.get('label', n)}\n{a['op']} {fmt_shape(a.get('shape'))}"
        style = _DOT_STYLE.get(a.get("role"), "")
        out.append(f"  {_dot_quote(n)} [label={_dot_quote(label)}{', ' + style if style else ''}];")
    pos = {n: i for i, n in enumerate(order)}
    for u, v in sorted(graph.edges, key=lambda e: (pos[e[1]], pos[e[0]])):
        out.append(f"  {_dot_quote(u)} -> {_dot_quote(v)};")
    out.append("}")
    return "\n".join(out) + "\n"


def _mermaid_ids(order: list[str]) -> dict[str, str]:
    ids: dict[str, str] = {}
    used: set[str] = set()
    for n in order:
        base = re.sub(r"[^A-Za-z0-9]+", "_", n).strip("_") or "n"
        cand, k = base, 2
        while cand in used:
            cand, k = f"{base}_{k}", k + 1
        used.add(cand)
        ids[n] = cand
    return ids


def _mermaid_text(s: str) -> str:
    return (s.replace("&", "#amp;").replace('"', "#quot;").replace("<", "#lt;").replace(">", "#gt;")
            .replace("\n", "<br/>"))


def render_mermaid(graph: nx.DiGraph) -> str:
    order = node_order(graph)
    ids = _mermaid_ids(order)
    out = ["flowchart TD"]
    for n in order:
        a = graph.nodes[n]
        label = _mermaid_text(f"{a.get('label', n)}\n{a['op']} {fmt_shape(a.get('shape'))}")
        out.append(f'  {ids[n]}["{label}"]')
    pos = {n: i for i, n in enumerate(order)}
    for u, v in sorted(graph.edges, key=lambda e: (pos[e[1]], pos[e[0]])):
        out.append(f"  {ids[u]} --> {ids[v]}")
    return "\n".join(out) + "\n"


__all__ = ["lower", "node_order", "render", "render_dot", "render_mermaid", "render_text"]
