"""memspec diff: exact edit lists, normalisation, rendering and the CLI."""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

import memspec
from memspec.tools import cli
from memspec.tools.diff import (Added, Changed, Removed, align, collapse, diff, graph_diff, render_dot,
                          render_json, render_markdown, render_text)
from memspec.lang.expr import parse_expr
from memspec.lang.normalize import canon, skeleton

HERE = Path(__file__).resolve().parent
D = HERE / "diff_specs"

@pytest.fixture(autouse=True)
def _at_repo_root(monkeypatch):
    # spans name files relative to the working directory
    monkeypatch.chdir(HERE.parent)


# ------------------------------------------------------------ normalisation
EQUAL = [
    ("a*b", "b*a"),
    ("x - y", "x + (-1)*y"),
    ("-x", "(-1)*x"),
    ("0.5*sum(e^2)", "sum(e^2)/2"),
    ("(a + b) + c", "c + (b + a)"),
    ("a*(b*c)", "(c*a)*b"),
    ("W - eta*grad(loss, W)", "-(grad(loss, W)*eta) + W"),
    ("(2*a) @ b", "2*(a @ b)"),
    ("a @ (b @ c)", "(a @ b) @ c"),
    ("x.T.T", "x"),
    ("x + x", "2*x"),
    ("2*3*x", "6*x"),
    ("x / 4", "0.25*x"),
    ("(1 - alpha)*W", "W*(-alpha + 1)"),
    ("sqrt(4)*x", "2*x"),
    ("x^1", "x"),
]
DIFFERENT = [
    ("a @ b", "b @ a"),          # @ is not commutative
    ("(1 - a)*W", "W - a*W"),    # products are not distributed
    ("x - y", "y - x"),
    ("a / b", "b / a"),
    ("x^2", "x^3"),
]


@pytest.mark.parametrize("x,y", EQUAL)
def test_normal_form_equal(x, y):
    assert canon(parse_expr(x)) == canon(parse_expr(y))


@pytest.mark.parametrize("x,y", DIFFERENT)
def test_normal_form_different(x, y):
    assert canon(parse_expr(x)) != canon(parse_expr(y))


def test_skeleton_numbers():
    sk1, n1 = skeleton(canon(parse_expr("0.5*sum((f(k) - v)^2)")))
    sk2, n2 = skeleton(canon(parse_expr("sum((v*(-1) + f(k))^2) / 4")))
    assert sk1 == sk2
    assert (n1, n2) == ([0.5, 1.0, -1.0, 2.0], [0.25, 1.0, -1.0, 2.0])


def test_align_prefers_equal_statements():
    # inserting a decay statement before the delta write is one insertion
    assert align(["W"], ["W", "W"], lambda i, j: j == 1) == [("added", None, 0), ("matched", 0, 1)]
    assert align(["U", "W"], ["W"], lambda i, j: False) == [("removed", 0, None), ("matched", 1, 0)]
    assert align([], ["S"], lambda i, j: True) == [("added", None, 0)]


# ------------------------------------------------------- exact edit lists
def test_reformatted_spec_is_equal():
    # spacing, reordered commutative operands, x - y as x + (-1)*y, 0.5*.. as ../2,
    # another model name and argument, YAML vs .mem, lets and dims in another order
    assert diff(D / "deltanet.yaml", D / "deltanet_reformatted.mem") == []
    assert diff(D / "deltanet_reformatted.mem", D / "deltanet.yaml") == []


def test_linear_attention_to_deltanet():
    assert diff(D / "linear_attention.yaml", D / "deltanet.yaml") == [
        Changed("meta", ("name",), "linear_attention", "deltanet"),
        Changed("meta", ("cite",), "Katharopoulos et al., Transformers are RNNs (2020), §3.2",
                "Schlag, Irie & Schmidhuber, Linear Transformers Are Secretly Fast Weight Programmers (2021), §4.2"),
        Added("gates", ("gates", "eta"), None, "sigmoid(logit)"),
        Removed("state", ("state", "S"), "[d_k, d_v] = zeros", None),
        Removed("state", ("state", "z"), "[d_k] = zeros", None),       # the normaliser
        Added("state", ("state", "W"), None, "[d_k, d_v] = zeros"),
        Removed("let", ("let", "pk"), "elu(k) + 1", None),
        Removed("let", ("let", "pq"), "elu(q) + 1", None),
        Added("let", ("let", "kn"), None, "l2norm(k)"),
        Added("let", ("let", "qn"), None, "l2norm(q)"),
        Added("model", ("model",), None, "f(u) = u @ W"),
        Added("loss", ("loss",), None, "0.5 * sum((f(kn) - v)^2)"),   # none -> squared error
        Removed("update", ("update", 0), "S = S + outer(pk, v)", None),
        Removed("update", ("update", 1), "z = z + pk", None),
        Added("update", ("update", 0), None, "W = W - eta * grad(loss, W)"),
        Changed("read", ("read",), "pq @ S / (pq @ z)", "f(qn)"),
        Changed("schedule", ("schedule", "derived"), "additive chunk 64, exact", "delta chunk 64, exact"),
    ]


def test_deltanet_to_gated_deltanet():
    edits = diff(D / "deltanet.yaml", D / "gated_deltanet.yaml")
    assert edits == [
        Changed("meta", ("name",), "deltanet", "gated_deltanet"),
        Changed("meta", ("cite",),
                "Schlag, Irie & Schmidhuber, Linear Transformers Are Secretly Fast Weight Programmers (2021), §4.2",
                "Yang, Kautz & Hatamizadeh, Gated Delta Networks (2025), §3"),
        Added("gates", ("gates", "alpha"), None, "sigmoid(logit) bias -4"),
        Added("update", ("update", 0), None, "W = (1 - alpha) * W"),
    ]
    # both sides' source positions
    gate, decay = edits[2], edits[3]
    assert gate.old_span is None
    assert (gate.new_span.file, gate.new_span.line, gate.new_span.col) == ("tests/diff_specs/gated_deltanet.yaml", 7, 3)
    assert decay.new_span.line == 16 and decay.new_span.col == 5


def test_ttt_mlp_to_titans():
    assert diff(D / "ttt_mlp.yaml", D / "titans.yaml") == [
        Changed("meta", ("name",), "ttt_mlp", "titans"),
        Changed("meta", ("cite",), "Sun et al., Learning to (Learn at Test Time) (2024), §2",
                "Behrouz, Zhong & Mirrokni, Titans: Learning to Memorize at Test Time (2025), §3.1"),
        Added("dims", ("dims", "d_v"), None, 4),
        Changed("views", ("views", "v", "dim"), "d_k", "d_v"),
        Added("gates", ("gates", "mu"), None, "sigmoid(logit)"),                 # momentum gate
        Added("gates", ("gates", "alpha"), None, "sigmoid(logit) bias -4"),      # forget gate
        Removed("params", ("params", "ln_w"), "[d_k] = ones", None),
        Removed("params", ("params", "ln_b"), "[d_k] = zeros", None),
        Changed("state", ("state", "W1", "init"), "learned(normal(0.02))", "normal(0.02)"),
        Changed("state", ("state", "W2", "shape"), "[hidden, d_k]", "[hidden, d_v]"),
        Changed("state", ("state", "W2", "init"), "learned(normal(0.02))", "normal(0.02)"),
        Added("state", ("state", "U1"), None, "[d_k, hidden] = zeros"),          # momentum states
        Added("state", ("state", "U2"), None, "[hidden, d_v] = zeros"),
        Changed("model", ("model",), "f(u) = u + layernorm(gelu(u @ W1) @ W2, ln_w, ln_b)",
                "f(u) = silu(u @ W1) @ W2"),
        Changed("loss", ("loss",), "0.5 * sum((f(k) - (v - k))^2)", "0.5 * sum((f(k) - v)^2)"),
        Added("update", ("update", 0), None, "U1 = mu * U1 - eta * grad(loss, W1)"),
        Added("update", ("update", 1), None, "U2 = mu * U2 - eta * grad(loss, W2)"),
        Changed("update", ("update", 2), "W1 = W1 - eta * grad(loss, W1)", "W1 = (1 - alpha) * W1 + U1"),
        Changed("update", ("update", 3), "W2 = W2 - eta * grad(loss, W2)", "W2 = (1 - alpha) * W2 + U2"),
        Changed("wiring", ("wiring",), "none", "mac(segment = 64, persistent = 4, qk_norm = true, write = attention, output = gated)"),
    ]


def test_titans_mac_to_mag_is_wiring_only():
    assert diff(D / "titans.yaml", D / "titans_mag.yaml") == [
        Changed("wiring", ("wiring",), "mac(segment = 64, persistent = 4, qk_norm = true, write = attention, output = gated)", "mag(window = 64, persistent = 4, qk_norm = true, gate = normalized)"),
    ]


def test_extends_variant_shows_exactly_its_overrides():
    edits = diff(D / "titans.yaml", D / "titans_huber.yaml")
    assert edits == [
        Changed("meta", ("name",), "titans", "titans_huber"),
        Added("constants", ("constants", "delta"), None, 1),
        Changed("loss", ("loss",), "0.5 * sum((f(k) - v)^2)", "sum(huber(f(k) - v, delta))"),
    ]
    # the new side points into the five-line variant, the old side into the base
    assert {e.new_span.file for e in edits} == {"tests/diff_specs/titans_huber.yaml"}
    assert [e.new_span.line for e in edits] == [2, 3, 4]
    assert edits[2].old_span.file == "tests/diff_specs/titans.yaml" and edits[2].old_span.line == 15


BASE = textwrap.dedent("""\
    name: m
    dims: {d_k: 4, d_v: 4}
    views: {q: d_k, k: d_k, v: d_v}
    gates: {eta: sigmoid(logit)}
    state: {W: {shape: [d_k, d_v]}}
    model: f(u) = u @ W
    loss: 0.5 * sum((f(k) - v)^2)
    update:
      - W = W - eta * grad(loss, W)
    read: f(q)
    """)


def _variant(**repl) -> memspec.Spec:
    text = BASE
    for old, new in repl.items():
        text = text.replace(old.replace("_SP_", " "), new)
    return memspec.loads(text)


def test_changed_constant_is_a_constant_edit():
    a = memspec.loads(BASE)
    b = memspec.loads(BASE.replace("0.5 * sum", "0.25 * sum"))
    assert diff(a, b) == [Changed("loss", ("loss", "const"), 0.5, 0.25)]
    c = memspec.loads(BASE.replace("(f(k) - v)^2", "(f(k) - 2*v)^3"))
    assert diff(a, c) == [Changed("loss", ("loss", "const", 2), -1, -2),
                          Changed("loss", ("loss", "const", 3), 2, 3),
                          # a cubic loss is no longer the delta rule; auto takes only exact schedules
                          Changed("schedule", ("schedule", "derived"), "delta chunk 64, exact",
                                  "online, exact")]
    d = memspec.loads(BASE.replace("W - eta", "W + eta"))
    assert diff(a, d) == [Changed("update", ("update", 0, "const"), -1, 1)]


def test_field_level_edits():
    a = memspec.loads(BASE)
    b = memspec.loads(BASE.replace("{eta: sigmoid(logit)}", "{eta: {formula: sigmoid(logit), bias: -2}}")
                      .replace("{W: {shape: [d_k, d_v]}}", "{W: {shape: [d_k, d_v], init: learned}}")
                      .replace("d_v: 4}", "d_v: 8}")
                      .replace("read: f(q)", "read: f(q)\norder: read_write\nschedule: chunk(64)"))
    assert diff(a, b) == [
        Changed("dims", ("dims", "d_v"), 4, 8),
        Changed("gates", ("gates", "eta", "bias"), 0, -2),
        Changed("state", ("state", "W", "init"), "zeros", "learned(normal(0.02))"),
        Changed("order", ("order",), "write_read", "read_write"),
        Changed("schedule", ("schedule", "declared"), "auto", "chunk(64)"),
    ]


def test_edits_are_typed_values():
    e = Changed("loss", ("loss", "const"), 0.5, 0.25)
    assert e.kind == "changed" and Added.kind == "added" and Removed.kind == "removed"
    assert e.where() == "loss.const"
    assert Added("update", ("update", 0), None, "x").where() == "update[0]"
    assert e != Added("loss", ("loss", "const"), 0.5, 0.25)   # the type is part of the edit
    with pytest.raises(Exception):
        e.old = 1  # frozen


# ------------------------------------------------------------- graph edits
def test_graph_diff_deltanet_to_gated():
    edits = graph_diff(D / "deltanet.yaml", D / "gated_deltanet.yaml")
    nodes = sorted((type(e).__name__, e.path[1]) for e in edits if e.path[0] == "node")
    assert nodes == [
        ("Added", "gate:alpha"), ("Added", "grad:W@update:W#2"), ("Added", "logit:alpha"),
        ("Added", "loss@update:W#2"), ("Added", "update:W#2"),
        ("Changed", "update:W#1"),
        ("Removed", "grad:W@update:W#1"), ("Removed", "loss@update:W#1"),
    ]
    changed = next(e for e in edits if e.path == ("node", "update:W#1"))
    assert changed.old == "update [d_k, d_v] 'W = W - eta * grad(loss, W)'"
    assert changed.new == "update [d_k, d_v] 'W = (1 - alpha) * W'"
    edges = {(type(e).__name__,) + e.path[1:] for e in edges_of(edits)}
    assert ("Added", "gate:alpha", "update:W#1") in edges
    assert ("Added", "update:W#1", "update:W#2") in edges
    assert ("Removed", "update:W#1", "read") in edges
    assert ("Added", "update:W#2", "read") in edges


def edges_of(edits):
    return [e for e in edits if e.path[0] == "edge"]


def test_graph_diff_equal_for_wiring_only_change():
    assert graph_diff(D / "titans.yaml", D / "titans_mag.yaml") == []


def test_collapse_merges_subexpressions():
    import networkx as nx

    g = nx.DiGraph()
    g.add_node("view:k", op="view")
    g.add_node("update:W#1", op="update")
    g.add_node("update:W#1/e", op="add")
    g.add_node("update:W#1/e.0", op="mul")
    g.add_edges_from([("view:k", "update:W#1/e.0"), ("update:W#1/e.0", "update:W#1/e"),
                      ("update:W#1/e", "update:W#1")])
    c = collapse(g)
    assert sorted(c.nodes) == ["update:W#1", "view:k"]
    assert list(c.edges) == [("view:k", "update:W#1")]


def test_render_dot_colours_union():
    from memspec.tools.diff import lower_graph

    ga = lower_graph(memspec.load(D / "deltanet.yaml"))
    gb = lower_graph(memspec.load(D / "gated_deltanet.yaml"))
    dot = render_dot(ga, gb, title="x")
    line = next(l for l in dot.splitlines() if l.startswith('  "gate:alpha" ['))
    assert 'color="#2e7d32"' in line                      # added: green
    line = next(l for l in dot.splitlines() if l.startswith('  "loss@update:W#1" ['))
    assert 'color="#c62828"' in line and "dashed" in line  # removed: red, dashed
    line = next(l for l in dot.splitlines() if l.startswith('  "update:W#1" ['))
    assert 'color="#ef6c00"' in line                      # changed: orange
    assert dot.startswith('digraph "x" {') and dot.rstrip().endswith("}")


# -------------------------------------------------------------- rendering
def test_render_text_plain_and_coloured():
    edits = diff(D / "deltanet.yaml", D / "gated_deltanet.yaml")[2:]
    plain = render_text(edits)
    assert plain == (
        "gates\n"
        "  + gates.alpha: sigmoid(logit) bias -4\n"
        "      + tests/diff_specs/gated_deltanet.yaml:7: alpha: {formula: sigmoid(logit), bias: -4.0}\n"
        "update\n"
        "  + update[0]: W = (1 - alpha) * W\n"
        "      + tests/diff_specs/gated_deltanet.yaml:16: - W = (1 - alpha) * W\n"
    )
    assert "\x1b[" not in plain
    coloured = render_text(edits, color=True)
    assert "\x1b[32m  + gates.alpha" not in coloured and "\x1b[32m+ gates.alpha" in coloured


def test_render_text_shows_both_sides():
    edits = diff(D / "titans.yaml", D / "titans_mag.yaml")
    assert render_text(edits) == (
        "wiring\n"
        "  ~ wiring: mac(segment = 64, persistent = 4, qk_norm = true, write = attention, output = gated) -> mag(window = 64, persistent = 4, qk_norm = true, gate = normalized)\n"
        "      - tests/diff_specs/titans.yaml:23: wiring: {kind: mac, segment: 64, persistent: 4, window: 64}\n"
        "      + tests/diff_specs/titans_mag.yaml:3: wiring: {kind: mag}\n"
    )


def test_render_markdown_and_json():
    edits = diff(D / "titans.yaml", D / "titans_mag.yaml")
    md = render_markdown(edits)
    assert md.splitlines() == [
        "| | component | path | old | new | where |",
        "|---|---|---|---|---|---|",
        "| ~ | wiring | `wiring` | `mac(segment = 64, persistent = 4, qk_norm = true, write = attention, output = gated)` | `mag(window = 64, persistent = 4, qk_norm = true, gate = normalized)` | tests/diff_specs/titans.yaml:23 → tests/diff_specs/titans_mag.yaml:3 |",
    ]
    assert render_markdown([]) == "No differences.\n"
    doc = json.loads(render_json(edits))
    assert doc == {"equal": False, "edits": [{
        "kind": "changed", "component": "wiring", "path": ["wiring"],
        "old": "mac(segment = 64, persistent = 4, qk_norm = true, write = attention, output = gated)", "new": "mag(window = 64, persistent = 4, qk_norm = true, gate = normalized)",
        "old_span": {"file": "tests/diff_specs/titans.yaml", "line": 23, "col": 10},
        "new_span": {"file": "tests/diff_specs/titans_mag.yaml", "line": 3, "col": 10}}]}


# --------------------------------------------------------------------- CLI
def run_cli(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_exit_status(capsys, monkeypatch):
    monkeypatch.chdir(HERE.parent)
    rc, out, _ = run_cli(capsys, "diff", "tests/diff_specs/deltanet.yaml", "tests/diff_specs/deltanet_reformatted.mem")
    assert (rc, out) == (0, "")
    rc, out, _ = run_cli(capsys, "diff", "tests/diff_specs/titans.yaml", "tests/diff_specs/titans_mag.yaml")
    assert rc == 1
    assert out.startswith("--- tests/diff_specs/titans.yaml\n+++ tests/diff_specs/titans_mag.yaml\nwiring\n")
    assert "\x1b[" not in out  # not a terminal: plain
    rc, out, err = run_cli(capsys, "diff", "tests/diff_specs/nope.yaml", "tests/diff_specs/titans.yaml")
    assert rc == 2 and out == ""
    assert err.startswith("tests/diff_specs/nope.yaml:1:1: error: no such spec file")
    with pytest.raises(SystemExit) as ex:
        cli.main(["diff", "only_one.yaml"])
    assert ex.value.code == 2


def test_cli_diff_formats(capsys, monkeypatch):
    monkeypatch.chdir(HERE.parent)
    a, b = "tests/diff_specs/deltanet.yaml", "tests/diff_specs/gated_deltanet.yaml"
    rc, out, _ = run_cli(capsys, "diff", a, b, "--format", "json")
    doc = json.loads(out)
    assert rc == 1 and [e["path"] for e in doc["edits"]] == [
        ["name"], ["cite"], ["gates", "alpha"], ["update", 0]]
    assert ["node", "gate:alpha"] in [e["path"] for e in doc["graph"]]
    rc, out, _ = run_cli(capsys, "diff", a, b, "--format", "markdown", "--no-graph")
    assert rc == 1 and out.startswith(f"### `{a}` → `{b}`\n\n| | component |")
    assert "dataflow graph" not in out
    rc, out, _ = run_cli(capsys, "diff", a, b, "--format", "dot")
    assert rc == 1 and out.startswith('digraph "deltanet -> gated_deltanet" {')
    rc, out, _ = run_cli(capsys, "diff", a, b)
    assert "\ngraph\n" in out and "  + node gate:alpha: gate [] 'alpha = sigmoid(logit)'\n" in out


def test_graphviz_missing_says_how_to_install(capsys, monkeypatch):
    import shutil

    monkeypatch.setattr(shutil, "which", lambda name: None)
    rc = cli._graphviz("digraph g {}", "svg", None)
    err = capsys.readouterr().err
    assert rc == 2
    assert "needs the Graphviz `dot` program" in err and "apt install graphviz" in err


# ------------------------------------------------------ the shipped specs
SPECS = HERE.parent / "specs"


def _meta(a: str, b: str) -> list:
    """name / description / cite edits between two shipped specs (their prose differs)."""
    sa, sb = memspec.load(SPECS / f"{a}.yaml"), memspec.load(SPECS / f"{b}.yaml")
    return [Changed("meta", (f,), getattr(sa, f), getattr(sb, f))
            for f in ("name", "description", "cite") if getattr(sa, f) != getattr(sb, f)]


@pytest.mark.parametrize("name", sorted(p.stem for p in SPECS.glob("*.yaml") if p.with_suffix(".mem").exists()))
def test_shipped_yaml_and_mem_are_equal(name):
    assert diff(SPECS / f"{name}.yaml", SPECS / f"{name}.mem") == []


def test_shipped_linear_attention_to_deltanet():
    assert diff(SPECS / "linear_attention.yaml", SPECS / "deltanet.yaml") == _meta("linear_attention", "deltanet") + [
        Removed("constants", ("constants", "eps"), 1e-06, None),
        Added("gates", ("gates", "eta"), None, "sigmoid(logit)"),
        Removed("state", ("state", "S"), "[d_k, d_v] = zeros", None),
        Removed("state", ("state", "z"), "[d_k] = zeros", None),       # the normaliser is gone
        Added("state", ("state", "W"), None, "[d_k, d_v] = zeros"),
        Removed("let", ("let", "qf"), "elu(q) + 1", None),
        Removed("let", ("let", "kf"), "elu(k) + 1", None),
        Added("let", ("let", "qn"), None, "l2norm(q)"),
        Added("let", ("let", "kn"), None, "l2norm(k)"),
        Added("model", ("model",), None, "f(u) = u @ W"),
        Added("loss", ("loss",), None, "0.5 * sum((f(kn) - v)^2)"),   # none -> squared error
        Removed("update", ("update", 0), "S = S + outer(kf, v)", None),
        Removed("update", ("update", 1), "z = z + kf", None),
        Added("update", ("update", 0), None, "W = W - eta * grad(loss, W)"),
        Changed("read", ("read",), "qf @ S / (qf @ z + eps)", "f(qn)"),  # the read changes
        Changed("schedule", ("schedule", "derived"), "additive chunk 64, exact", "delta chunk 64, exact"),
    ]


def test_shipped_deltanet_to_gated_deltanet():
    assert diff(SPECS / "deltanet.yaml", SPECS / "gated_deltanet.yaml") == _meta("deltanet", "gated_deltanet") + [
        Added("gates", ("gates", "alpha"), None, "1 - exp(-softplus(logit)) bias -4"),   # the forget gate
        Added("update", ("update", 0), None, "W = (1 - alpha) * W"),                     # and its decay
    ]


def test_shipped_ttt_mlp_to_titans():
    # The shipped specs differ in more than the mechanism (sizes, gate biases, lets,
    # biases b1/b2, LayerNorm params, the mini-batch size); all of it is listed.
    assert diff(SPECS / "ttt_mlp.yaml", SPECS / "titans.yaml") == _meta("ttt_mlp", "titans") + [
        Changed("dims", ("dims", "hidden"), 256, 128),
        Added("dims", ("dims", "d_v"), None, 64),
        Removed("constants", ("constants", "base_lr"), 0.1, None),
        Changed("views", ("views", "v", "dim"), "d_k", "d_v"),
        Changed("gates", ("gates", "eta", "formula"), "base_lr * sigmoid(logit) / d_k", "sigmoid(logit)"),
        Changed("gates", ("gates", "eta", "bias"), 0, -2),
        Added("gates", ("gates", "mu"), None, "sigmoid(logit) bias 2"),          # momentum gate
        Added("gates", ("gates", "alpha"), None, "sigmoid(logit) bias -4"),      # forget gate
        Removed("params", ("params", "ln_w"), "[d_k] = ones", None),
        Removed("params", ("params", "ln_b"), "[d_k] = zeros", None),
        Removed("state", ("state", "b1"), "[hidden] = learned(zeros)", None),
        Changed("state", ("state", "W2", "shape"), "[hidden, d_k]", "[hidden, d_v]"),
        Removed("state", ("state", "b2"), "[d_k] = learned(zeros)", None),
        Added("state", ("state", "U1"), None, "[d_k, hidden] = zeros"),          # momentum states
        Added("state", ("state", "U2"), None, "[hidden, d_v] = zeros"),
        Added("let", ("let", "qn"), None, "l2norm(silu(q))"),
        Added("let", ("let", "kn"), None, "l2norm(silu(k))"),
        Added("let", ("let", "vs"), None, "silu(v)"),
        Changed("model", ("model",), "f(u) = u + layernorm(gelu(u @ W1 + b1) @ W2 + b2, ln_w, ln_b)",
                "f(u) = l2norm(gelu(u @ W1)) @ W2"),
        Changed("loss", ("loss",), "0.5 * sum((f(k) - v)^2)", "0.5 * sum((f(kn) - vs)^2)"),
        # statements are aligned by target: TTT-MLP's gradient temporaries have no match in Titans
        Removed("update", ("update", 0), "gW1 = grad(loss, W1)", None),
        Removed("update", ("update", 1), "gb1 = grad(loss, b1)", None),
        Removed("update", ("update", 2), "gW2 = grad(loss, W2)", None),
        Removed("update", ("update", 3), "gb2 = grad(loss, b2)", None),
        Added("update", ("update", 0), None, "U1 = mu * U1 - eta * grad(loss, W1)"),
        Added("update", ("update", 1), None, "U2 = mu * U2 - eta * grad(loss, W2)"),
        Changed("update", ("update", 2), "W1 = W1 - eta * gW1", "W1 = (1 - alpha) * W1 + U1"),
        Removed("update", ("update", 5), "b1 = b1 - eta * gb1", None),
        Changed("update", ("update", 3), "W2 = W2 - eta * gW2", "W2 = (1 - alpha) * W2 + U2"),
        Removed("update", ("update", 7), "b2 = b2 - eta * gb2", None),
        Changed("read", ("read",), "f(q)", "f(qn)"),
        Changed("schedule", ("schedule", "declared"), "minibatch(16)", "minibatch(64)"),
        Changed("schedule", ("schedule", "derived"), "minibatch chunk 16, approximate",
                "minibatch chunk 64, approximate"),
    ]


def test_shipped_titans_mac_to_mag_is_wiring_only():
    edits = diff(SPECS / "titans_mac.yaml", SPECS / "titans_mag.yaml")
    assert edits == _meta("titans_mac", "titans_mag") + [
        Changed("wiring", ("wiring",), "mac(segment = 128, persistent = 16, qk_norm = true, write = attention, output = gated)", "mag(window = 128, persistent = 16, qk_norm = true, gate = normalized)"),
    ]
    assert {e.component for e in edits} == {"meta", "wiring"}
    assert graph_diff(SPECS / "titans_mac.yaml", SPECS / "titans_mag.yaml") == []


def test_shipped_reformatted_spec_is_equal(tmp_path):
    (tmp_path / "g.mem").write_text(textwrap.dedent("""\
        # gated DeltaNet, rewritten: other spacing and order, x - y as x + (-1)*y, /2 for 0.5*
        memory gated_deltanet
        description "%s"
        cite "%s"
        dims { d_v = 64, d_k = 64, heads = 4, d_model = 256 }
        view v : d_v
        view k : d_k
        view q : d_k
        gate alpha = (-1)*exp(-softplus(logit)) + 1 bias -4
        gate eta = sigmoid(logit)
        state W : [d_k, d_v] = zeros
        let kn = l2norm(k)
        let qn = l2norm(q)
        model g(z) = z@W
        loss = sum((g(kn) + (-1)*v)^2)/2
        update {
          W = W*(1 + (-1)*alpha)
          W = W + (-1)*(grad(loss, W)*eta)
        }
        read = g(qn)
        """) % tuple(getattr(memspec.load(SPECS / "gated_deltanet.yaml"), f).replace('"', '\\"')
                     for f in ("description", "cite")))
    assert diff(SPECS / "gated_deltanet.yaml", tmp_path / "g.mem") == []


def test_shipped_five_line_variant_shows_exactly_its_overrides(tmp_path):
    # extends stays inside the variant's folder tree: the base is copied next to it
    (tmp_path / "titans.yaml").write_bytes((SPECS / "titans.yaml").read_bytes())
    (tmp_path / "titans_huber.yaml").write_text(textwrap.dedent("""\
        extends: titans.yaml
        name: titans_huber
        constants: {delta: 1.0}
        loss: sum(huber(f(kn) - vs, delta))
        schedule: minibatch(16)
        """))
    edits = diff(SPECS / "titans.yaml", tmp_path / "titans_huber.yaml")
    assert edits == [
        Changed("meta", ("name",), "titans", "titans_huber"),
        Added("constants", ("constants", "delta"), None, 1),
        Changed("loss", ("loss",), "0.5 * sum((f(kn) - vs)^2)", "sum(huber(f(kn) - vs, delta))"),
        Changed("schedule", ("schedule", "declared"), "minibatch(64)", "minibatch(16)"),
        Changed("schedule", ("schedule", "derived"), "minibatch chunk 64, approximate",
                "minibatch chunk 16, approximate"),
    ]
    assert [e.new_span.line for e in edits] == [2, 3, 4, 5, 5]


def test_cli_text_golden(capsys):
    rc, out, _ = run_cli(capsys, "diff", "specs/deltanet.yaml", "specs/gated_deltanet.yaml")
    assert rc == 1
    assert out == (HERE / "golden" / "diff_deltanet_gated_deltanet.txt").read_text(encoding="utf-8")


def test_graph_svg_through_dot(tmp_path, monkeypatch, capsys):
    # a stand-in `dot` on PATH: memspec pipes the DOT text through it and writes the result
    fake = tmp_path / "bin" / "dot"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho \"<svg fmt=$1>\"\ncat >/dev/null\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:/usr/bin:/bin")
    out = tmp_path / "g.svg"
    assert cli.main(["graph", "specs/deltanet.yaml", "--format", "svg", "-o", str(out)]) == 0
    assert out.read_text() == "<svg fmt=-Tsvg>\n"
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert cli.main(["graph", "specs/deltanet.yaml", "--format", "png"]) == 2
    assert "needs the Graphviz `dot` program" in capsys.readouterr().err


def test_invalid_spec_is_trouble_not_a_traceback(capsys):
    rc, out, err = run_cli(capsys, "diff", "specs/deltanet.yaml", "tests/bad_specs/arity.mem")
    assert rc == 2 and out == "" and "tests/bad_specs/arity.mem:" in err and "error:" in err
    with pytest.raises(memspec.SpecError):
        diff("specs/deltanet.yaml", "tests/bad_specs/arity.mem")


def test_exported_from_the_package():
    assert memspec.diff(D / "titans.yaml", D / "titans_mag.yaml") == diff(D / "titans.yaml", D / "titans_mag.yaml")
    assert memspec.graph_diff(D / "titans.yaml", D / "titans_mag.yaml") == []
    a = memspec.load(D / "deltanet.yaml")
    assert memspec.diff(a, a) == []


def test_colour_only_on_a_terminal_without_no_color(capsys, monkeypatch):
    import sys

    args = ["diff", "tests/diff_specs/titans.yaml", "tests/diff_specs/titans_mag.yaml"]
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    rc, out, _ = run_cli(capsys, *args)
    assert rc == 1 and "\x1b[33m  ~ wiring" not in out and "\x1b[33m~ wiring: mac" in out
    monkeypatch.setenv("NO_COLOR", "1")
    rc, out, _ = run_cli(capsys, *args)
    assert rc == 1 and "\x1b[" not in out


def test_diff_with_graph_appends_graph_edits():
    sem = diff(D / "deltanet.yaml", D / "gated_deltanet.yaml")
    both = diff(D / "deltanet.yaml", D / "gated_deltanet.yaml", graph=True)
    assert both[: len(sem)] == sem
    assert both[len(sem):] == graph_diff(D / "deltanet.yaml", D / "gated_deltanet.yaml")
    assert {e.component for e in both[len(sem):]} == {"graph"}
    detail = graph_diff(D / "deltanet.yaml", D / "gated_deltanet.yaml", detail=True)
    assert len(detail) > len(both) - len(sem)   # every operation node, not only owners


def test_wiring_option_change_is_one_edit_per_option():
    """A change of a wiring option (same kind) is a value edit at wiring.<option>, located
    on both sides; text shows flags as the spec languages write them."""
    edits = diff(D / "titans.yaml", D / "titans_mac_input.yaml")
    assert edits == [
        Changed("wiring", ("wiring", "qk_norm"), True, False),
        Changed("wiring", ("wiring", "write"), "attention", "input"),
        Changed("wiring", ("wiring", "output"), "gated", "additive"),
    ]
    assert [(e.new_span.line, e.new_span.col) for e in edits] == [(3, 42), (3, 10), (3, 24)]
    text = render_text(edits)
    assert "  ~ wiring.qk_norm: true -> false\n" in text
    assert "  ~ wiring.write: attention -> input\n" in text
    assert "  ~ wiring.output: gated -> additive\n" in text
    assert graph_diff(D / "titans.yaml", D / "titans_mac_input.yaml") == []
