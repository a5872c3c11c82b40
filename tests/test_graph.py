"""Shape inference (memspec.lang.shapes) and the dataflow graph of one token step (memspec.check.graph)."""
from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

import networkx as nx
import pytest

import memspec
from memspec.tools.cli import main
from memspec.lang.errors import Collector, SpecError
from memspec.lang.expr import parse_expr
from memspec.check.graph import lower, node_order, render
from memspec.lang.shapes import CACHE_AXIS, ShapeEnv, broadcast, fmt_shape, matmul_shape

ROOT = Path(__file__).resolve().parent.parent
VALID = ROOT / "tests" / "bad_specs" / "valid"
UPDATE = os.environ.get("MEMSPEC_UPDATE_GOLDEN") == "1"

BASE = """name: shapes
dims: {d_model: 8, heads: 2, d_k: 4, d_v: 3, hidden: 5}
constants: {lam: 0.5}
views: {q: d_k, k: d_k, v: d_v}
gates: {eta: sigmoid(logit)}
params:
  ln_w: {shape: [d_v], init: ones}
state:
  W1: {shape: [d_k, hidden]}
  W2: {shape: [hidden, d_v]}
  K: {shape: [d_k], cache: true}
  V: {shape: [d_v], cache: true}
let:
  kn: l2norm(k)
  s: sum(kn * q)
model: f(u) = layernorm(gelu(u @ W1) @ W2, ln_w)
loss: 0.5 * sum((f(kn) - v)^2)
update:
  - W1 = W1 - eta * grad(loss, W1)
  - W2 = W2 - eta * grad(loss, W2)
  - K = append(K, kn)
  - V = append(V, v)
read: f(q) + attend(q, K, V, d_k^(-0.5))
"""


@pytest.fixture(scope="module")
def env():
    return ShapeEnv.from_spec(memspec.loads(BASE))


# ---------------------------------------------------------------- shapes
def test_declared_shapes(env):
    assert env.of("d_k") == () and env.of("lam") == () and env.of("eta") == ()
    assert env.of("q") == ("d_k",) and env.of("v") == ("d_v",)
    assert env.of("ln_w") == ("d_v",)
    assert env.of("W1") == ("d_k", "hidden")
    assert env.of("K") == (CACHE_AXIS, "d_k") and CACHE_AXIS == "n"
    assert env.of("kn") == ("d_k",) and env.of("s") == ()


@pytest.mark.parametrize("text,shape", [
    ("1", ()),
    ("k @ W1", ("hidden",)),
    ("W1 @ W2", ("d_k", "d_v")),
    ("W2 @ v", ("hidden",)),
    ("q @ k", ()),
    ("W1.T", ("hidden", "d_k")),
    ("outer(k, v)", ("d_k", "d_v")),
    ("sum(W1)", ()), ("mean(k)", ()), ("norm(W2)", ()),
    ("sigmoid(W1) * 2", ("d_k", "hidden")),
    ("v + outer(k, v)", ("d_k", "d_v")),  # trailing broadcasting
    ("eta * W1 - lam", ("d_k", "hidden")),
    ("-k^2", ("d_k",)),
    ("f(k)", ("d_v",)),
    ("f(kn) - v", ("d_v",)),
    ("grad(loss, W2)", ("hidden", "d_v")),
    ("eye(d_k)", ("d_k", "d_k")),
    ("solve(eye(d_k) + outer(k, k), q)", ("d_k",)),
    ("solve(eye(d_k), outer(k, v))", ("d_k", "d_v")),
    ("attend(q, K, V, 1.0)", ("d_v",)),
    ("append(K, k)", ("n", "d_k")),
    ("K @ q", ("n",)),
    ("layernorm(v, ln_w, ln_w)", ("d_v",)),
    ("rmsnorm(v, ln_w)", ("d_v",)), ("l2norm(W1)", ("d_k", "hidden")),
    ("clamp(k, 0, 1)", ("d_k",)), ("max(k, 0)", ("d_k",)), ("huber(v - 1, 0.5)", ("d_v",)),
    ("d_k^(-0.5)", ()),
    # axes by name, Newton-Schulz, the model applied to each row of a cache
    ("sum(W1, d_k)", ("hidden",)), ("mean(W1, hidden)", ("d_k",)), ("norm(W2, hidden)", ("d_v",)),
    ("softmax(W1, hidden)", ("d_k", "hidden")), ("softmax(k, d_k)", ("d_k",)),
    ("newton_schulz(W1, 5)", ("d_k", "hidden")), ("newton_schulz(outer(k, v), 1)", ("d_k", "d_v")),
    ("f(K)", ("n", "d_v")), ("sum((f(K) - V)^2)", ()),
])
def test_infer(env, text, shape):
    assert env.infer(parse_expr(text)) == shape


@pytest.mark.parametrize("text,message", [
    ("k @ W2", "shape mismatch in '@': [d_k] @ [hidden, d_v]"),
    ("k + v", "shape mismatch in '+': [d_k] and [d_v]"),
    ("W1 * W2", "shape mismatch in '*': [d_k, hidden] and [hidden, d_v]"),
    ("k.T", "'.T' needs a matrix (rank 2), got [d_k]"),
    ("2 @ k", "shape mismatch in '@': [] @ [d_k]"),
    ("f(v)", "applying f to v [d_v]: shape mismatch in '@': [d_v] @ [d_k, hidden]"),
    ("outer(W1, k)", "outer(a, b) needs two vectors, got [d_k, hidden] and [d_k]"),
    ("solve(W1, k)", "solve(A, B) needs a square matrix A, got [d_k, hidden]"),
    ("eye(4)", "eye(d) takes a dim name, got '4'"),
    ("layernorm(k, ln_w)", "the weight has shape [d_v], expected [d_k]"),
    ("attend(q, K, V, k)", "attend: the scale must be a scalar, got [d_k]"),
    ("attend(v, K, V, 1)", "the query is [d_v], the keys are [n, d_k]"),
    ("attend(q, W1, V, 1)", "'W1' is not a cache"),
    ("append(K, v)", "cache 'K' holds [d_k], got [d_v]"),
    ("grad(loss, k)", "'k' is a view"),
    ("grad(loss)", "grad(loss) is ambiguous: the model reads 2 states (W1, W2)"),
    ("grad(k, W1)", "the first argument of grad must be 'loss'"),
    ("etaa", "unknown name 'etaa'"),
    ("logit", "'logit' is only defined inside gate formulas"),
    ("u", "'u' is the model's argument"),
    ("loss", "'loss' can only be used as grad(loss, W)"),
    ("sofplus(k)", "unknown function 'sofplus'"),
    ("W1(k)", "'W1' is a state, not a function"),
    ("sum(k, v, q)", "sum takes 1 to 2 arguments, got 3"),
    ("sum(k, v)", "the axis of sum(x, d) is the name of a dim, got 'v'"),
    ("softmax(k, d_v)", "softmax(k, d_v): [d_k] has no axis d_v"),
    ("newton_schulz(k, 5)", "newton_schulz(X, steps) orthogonalises a matrix, got [d_k]"),
    ("newton_schulz(W1, 0)", "takes a number of steps (an integer from 1 to 20) or a constant holding (a, b, c) coefficients per step, got '0'"),
    ("newton_schulz(W1, eta)", "takes a number of steps (an integer from 1 to 20) or a constant holding (a, b, c) coefficients per step, got 'eta'"),
    ("softmax(W1)", "softmax takes 2 arguments, got 1"),
    ("sum(outer(k, k), d_k)", "sum(outer(k, k), d_k) is ambiguous: [d_k, d_k] has 2 axes named d_k"),
    ("softmax(W1, d_kk)", "unknown name 'd_kk'"),
    ("f(k, v)", "the model f takes 1 argument, got 2"),
])
def test_infer_errors(env, text, message):
    with pytest.raises(SpecError) as ei:
        env.infer(parse_expr(text))
    assert message in str(ei.value)


def test_infer_locates_errors(env):
    with pytest.raises(SpecError) as ei:
        env.infer(parse_expr("q + 2 * (k @ W2)"))
    (d,) = ei.value.diagnostics
    assert (d.span.line, d.span.col, d.span.end_col) == (1, 10, 16)
    assert d.code == "E-shape" and d.message == "shape mismatch in '@': [d_k] @ [hidden, d_v]"
    assert d.hint == "the inner dims must agree: d_k vs hidden"


def test_infer_collects_and_contexts(env):
    col = Collector()
    assert env.infer(parse_expr("k + v + etaa"), diags=col) is None
    assert [d.code for d in col.errors] == ["E-shape", "E-unknown-name"]
    # context rules: grad only in updates; logit only in gates
    with pytest.raises(SpecError, match="only allowed in update statements"):
        env.infer(parse_expr("grad(loss, W1)"), context="read")
    assert env.infer(parse_expr("sigmoid(logit) * lam"), context="gate") == ()
    assert env.infer(parse_expr("grad(loss, W1)"), context="update") == ("d_k", "hidden")
    rec = {}
    e = parse_expr("outer(k, v) * eta")
    env.infer(e, record=rec)
    assert rec[id(e)] == ("d_k", "d_v") and rec[id(e.left)] == ("d_k", "d_v") and rec[id(e.right)] == ()


def test_model_output_and_loss_shape(env):
    assert env.model_output(("d_k",)) == ("d_v",)
    assert env.loss_shape() == ()


def test_helpers():
    assert broadcast(("a", "b"), ("b",)) == ("a", "b")
    assert broadcast((), ("a",)) == ("a",)
    assert broadcast(("a",), ("b",)) is None
    assert matmul_shape(("m", "n"), ("n",)) == ("m",)
    assert matmul_shape(("n",), ("n", "m")) == ("m",)
    assert matmul_shape(("n",), ("n",)) == ()
    assert matmul_shape(("a", "b", "c"), ("c",)) is None
    assert fmt_shape(("d_k", "d_v")) == "[d_k, d_v]" and fmt_shape(()) == "[]" and fmt_shape(None) == "[?]"


def test_cache_axis_avoids_a_dim_named_n():
    spec = memspec.loads(BASE.replace("hidden: 5}", "hidden: 5, n: 2}"))
    assert ShapeEnv.from_spec(spec).of("K") == ("n_cache", "d_k")


# ---------------------------------------------------------------- graph
@pytest.fixture(scope="module")
def titans():
    return memspec.load(VALID / "titans_small.yaml")


def test_graph_is_a_dag_with_state_in_and_out(titans):
    g = lower(titans)
    assert nx.is_directed_acyclic_graph(g)
    assert g.graph["spec"] is titans and g.graph["diagnostics"] == []
    for s in titans.state:
        assert g.in_degree(f"state_in:{s}") == 0
        assert g.out_degree(f"state_out:{s}") == 0
        assert nx.has_path(g, f"state_in:{s}", f"state_out:{s}")
    # every source is an input, declaration or literal; every sink an output or unused declaration
    for n in g.nodes:
        if g.in_degree(n) == 0:
            assert g.nodes[n]["op"] in ("input", "dim", "const", "param", "state_in", "num"), n
        if g.out_degree(n) == 0:
            assert g.nodes[n]["op"] in ("output", "state_out", "dim"), n


def test_graph_ids_attributes_and_ssa(titans):
    g = lower(titans)
    a = g.nodes["update:U#1"]
    assert a["op"] == "update" and a["role"] == "update" and a["shape"] == ("d_k", "d_v")
    assert a["label"] == "U = mu * U - eta * grad(loss, W)"
    assert a["span"].line == 17 and a["span"].file.endswith("titans_small.yaml")
    # the gradient of U#1 is taken at W before the token, through the loss evaluated there
    grad = g.nodes["grad:W@update:U#1"]
    assert grad["op"] == "grad" and grad["args"] == ("loss@update:U#1", "state_in:W")
    assert g.nodes["loss@update:U#1"]["shape"] == ()
    apply_ = "loss@update:U#1/e.1.0.0.0"
    assert g.nodes[apply_]["op"] == "apply" and g.nodes[apply_]["args"] == ("let:kn", "state_in:W")
    # W#1 reads the new U and the old W; the read sees W#1; state_out takes the last versions
    assert g.nodes["update:W#1/e"]["args"] == ("update:W#1/e.0", "update:U#1")
    assert g.nodes["read/e"]["args"] == ("view:q", "update:W#1")
    assert g.nodes["state_out:W"]["args"] == ("update:W#1",)
    assert g.nodes["state_out:U"]["args"] == ("update:U#1",)
    assert g.nodes["output"]["shape"] == ("d_v",)
    assert g.nodes["gate:alpha"]["args"] == ("gate:alpha/e",)
    assert g.nodes["logit:alpha"]["bias"] == -4.0
    assert g.nodes["view:q"]["span"].line == 4


GATED = """name: gated
dims: {d_model: 8, heads: 1, d_k: 2, d_v: 2}
views: {q: d_k, k: d_k, v: d_v}
gates: {eta: sigmoid(logit), alpha: sigmoid(logit)}
state:
  W: {shape: [d_k, d_v]}
model: f(u) = u @ W
loss: 0.5 * sum((f(k) - v)^2)
update:
  - W = (1 - alpha) * W
  - W = W - eta * grad(loss, W)
read: f(q)
"""


def test_grad_at_the_decayed_memory():
    g = lower(memspec.loads(GATED))
    # gated DeltaNet: the gradient is taken at W#1 (the decayed memory), not at state_in:W
    assert g.nodes["grad:W@update:W#2"]["args"] == ("loss@update:W#2", "update:W#1")
    apply_ = [n for n in g.nodes if n.startswith("loss@update:W#2/") and g.nodes[n]["op"] == "apply"]
    assert apply_ == ["loss@update:W#2/e.1.0.0.0"]
    assert g.nodes[apply_[0]]["args"] == ("view:k", "update:W#1")
    assert g.nodes["update:W#2/e"]["args"] == ("update:W#1", "update:W#2/e.1")
    assert g.nodes["state_out:W"]["args"] == ("update:W#2",)
    assert not any(n.startswith("loss@update:W#1") for n in g.nodes)  # no grad in W#1, no loss instance


def test_read_write_order_reads_the_old_state():
    g = lower(memspec.loads(GATED + "order: read_write\n"))
    assert g.nodes["read/e"]["args"] == ("view:q", "state_in:W")
    order = node_order(g)
    assert order.index("read") < order.index("update:W#1")


def test_ids_are_stable_when_an_unrelated_statement_is_added():
    a = lower(memspec.loads(GATED))
    text = GATED.replace("  W: {shape: [d_k, d_v]}\n", "  W: {shape: [d_k, d_v]}\n  z: {shape: [d_k]}\n")
    text = text.replace("update:\n", "update:\n  - z = z + k\n").replace("read: f(q)", "read: f(q) + z @ W")
    b = lower(memspec.loads(text))
    for n in a.nodes:
        if n.startswith(("update:W", "grad:", "loss@", "view:", "gate:", "state_in:W", "state_out:W")):
            assert n in b.nodes, n
            assert a.nodes[n]["op"] == b.nodes[n]["op"] and a.nodes[n]["shape"] == b.nodes[n]["shape"]
    assert "update:z#1" in b.nodes and "update:z#1" not in a.nodes


def test_lower_never_raises_on_a_bad_spec():
    spec = memspec.loads(GATED.replace("f(q)", "f(q) + k @ v @ etaa"))
    g = lower(spec)
    codes = sorted(d.code for d in g.graph["diagnostics"])
    assert codes == ["E-shape", "E-unknown-name"]
    assert g.nodes["read"]["shape"] is None


def test_let_cycle_is_a_graph_cycle():
    text = GATED.replace("\nmodel:", "\nlet:\n  a: b + k\n  b: 2 * a\nmodel:")
    graph, diags = memspec.check(memspec.loads(text))
    assert not nx.is_directed_acyclic_graph(graph)
    assert [d.code for d in diags if d.severity == "error"] == ["E-cycle"]
    assert "cycle within a step: a -> b -> a" in diags[0].message
    render(graph, "text")  # still renders (creation order)


def _golden(name: str, text: str) -> None:
    path = VALID / name
    if UPDATE:
        path.write_text(text, encoding="utf-8")
    assert text == path.read_text(encoding="utf-8")


@pytest.mark.parametrize("fmt,ext", [("text", "txt"), ("dot", "dot"), ("mermaid", "mmd")])
def test_render_golden(titans, fmt, ext):
    text = render(lower(titans), fmt)
    assert text == render(lower(titans), fmt)  # deterministic
    _golden(f"titans_small.graph.{ext}", text)


def test_render_unknown_format(titans):
    with pytest.raises(ValueError, match="unknown graph format"):
        render(lower(titans), "svgz")


def test_cli_graph_golden(monkeypatch):
    monkeypatch.chdir(ROOT)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["graph", "tests/bad_specs/valid/titans_small.yaml", "--format", "text"])
    assert rc == 0
    assert out.getvalue() == (VALID / "titans_small.graph.txt").read_text(encoding="utf-8")
    # the spec has one unused dim: a warning on stderr, the graph still printed
    assert err.getvalue().startswith("tests/bad_specs/valid/titans_small.yaml:3:47: warning: dim 'hidden'")


def test_cli_graph_on_a_bad_spec(monkeypatch):
    monkeypatch.chdir(ROOT)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["graph", "tests/bad_specs/let_cycle.yaml", "--format", "mermaid"])
    assert rc == 1 and out.getvalue() == ""
    assert err.getvalue() == (ROOT / "tests/bad_specs/let_cycle.yaml.err").read_text(encoding="utf-8")


def test_mem_and_yaml_give_the_same_graph():
    y = lower(memspec.loads(GATED))
    m = lower(memspec.loads("""memory gated
dims { d_model = 8, heads = 1, d_k = 2, d_v = 2 }
view q : d_k
view k : d_k
view v : d_v
gate eta = sigmoid(logit)
gate alpha = sigmoid(logit)
state W : [d_k, d_v] = zeros
model f(u) = u @ W
loss = 0.5 * sum((f(k) - v)^2)
update {
  W = (1 - alpha) * W
  W = W - eta * grad(loss, W)
}
read = f(q)
""", "mem"))
    assert list(y.nodes) == list(m.nodes) and set(y.edges) == set(m.edges)
    for n in y.nodes:
        ya, ma = dict(y.nodes[n]), dict(m.nodes[n])
        for k in ("span", "target_span"):
            ya.pop(k, None), ma.pop(k, None)
        assert ya == ma, n
