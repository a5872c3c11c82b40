"""`memspec fmt`: the canonical printed forms of a spec (memspec.lang.fmt.to_yaml / to_mem).

Golden outputs for tricky inputs (quoting, negative numbers, nested parentheses, unary
minus, ^ precedence), exact round trips, extends with null removal, and the CLI.
"""
from __future__ import annotations

import random

import pytest
import yaml

import memspec
from memspec.tools.cli import main
from memspec.lang.errors import SpecError
from memspec.lang.expr import BinOp, Call, Name, Neg, Num, Transpose, parse_expr, unparse
from memspec.lang.fmt import to_mem, to_yaml, yaml_float, yaml_str, yaml_text
from memspec.lang.spec import Wiring

TRICKY = '# comments and flow style are not kept: fmt prints the canonical form\nname: tricky\ndescription: "Quoting: a \': \' and a \' #\' need quotes"\ndims: {d_k: 4, d_v: 3}\nconstants: {eps: 1e-6, neg: -0.25, big: 1.0e+20, p: 3}\nviews: {q: d_k, k: d_k, v: d_v}\ngates:\n  eta: sigmoid(logit)\n  alpha: {formula: sigmoid(logit), bias: -4}\n  mu: -logit\n  beta: {formula: "1 - exp(-softplus(logit))", bias: 2}\nstate:\n  W: {shape: [d_k, d_v], init: learned}\n  U: {shape: [d_k, d_v], init: normal(1)}\nlet:\n  kn: ((l2norm(k)))\n  s: -(kn @ kn)\n  t: (-s)^2\n  u: -s^2\n  w: 2^3^s\n  x2: (2^3)^s\n  y: s - (s - 1)\n  z: (s - s) - 1\n  r: d_k^(-0.5) * -s\nmodel: f(a) = a @ W\nloss: 0.5 * sum((f(kn) - v)^2)\nupdate:\n  - U = mu * U - eta * grad(loss, W)\n  - W = (1 - alpha) * W + U\nread: (f(q) * r + t + u + w + x2 + y + z) * beta\norder: read_write\nschedule: minibatch( 8 )\nwiring: {kind: mag, window: 16}\n'

TRICKY_YAML = "name: tricky\ndescription: 'Quoting: a '': '' and a '' #'' need quotes'\ndims:\n  d_k: 4\n  d_v: 3\nconstants:\n  eps: 1.0e-06\n  neg: -0.25\n  big: 1.0e+20\n  p: 3.0\nviews:\n  q: d_k\n  k: d_k\n  v: d_v\ngates:\n  eta: sigmoid(logit)\n  alpha:\n    formula: sigmoid(logit)\n    bias: -4.0\n  mu: '-logit'\n  beta:\n    formula: 1 - exp(-softplus(logit))\n    bias: 2.0\nstate:\n  W:\n    shape: [d_k, d_v]\n    init: learned(normal(0.02))\n  U:\n    shape: [d_k, d_v]\n    init: normal(1.0)\nlet:\n  kn: l2norm(k)\n  s: '-(kn @ kn)'\n  t: (-s)^2\n  u: '-s^2'\n  w: 2^3^s\n  x2: (2^3)^s\n  y: s - (s - 1)\n  z: s - s - 1\n  r: d_k^-0.5 * -s\nmodel: f(a) = a @ W\nloss: 0.5 * sum((f(kn) - v)^2)\nupdate:\n  - U = mu * U - eta * grad(loss, W)\n  - W = (1 - alpha) * W + U\nread: (f(q) * r + t + u + w + x2 + y + z) * beta\norder: read_write\nschedule: minibatch(8)\nwiring:\n  kind: mag\n  window: 16\n"

TRICKY_MEM = 'memory tricky\ndescription "Quoting: a \': \' and a \' #\' need quotes"\n\ndims { d_k = 4, d_v = 3 }\nconst eps = 1e-06\nconst neg = -0.25\nconst big = 1e+20\nconst p = 3.0\n\nview q : d_k\nview k : d_k\nview v : d_v\n\ngate eta = sigmoid(logit)\ngate alpha = sigmoid(logit) bias -4.0\ngate mu = -logit\ngate beta = 1 - exp(-softplus(logit)) bias 2.0\n\nstate W : [d_k, d_v] = learned(normal(0.02))\nstate U : [d_k, d_v] = normal(1.0)\n\nlet kn = l2norm(k)\nlet s = -(kn @ kn)\nlet t = (-s)^2\nlet u = -s^2\nlet w = 2^3^s\nlet x2 = (2^3)^s\nlet y = s - (s - 1)\nlet z = s - s - 1\nlet r = d_k^-0.5 * -s\n\nmodel f(a) = a @ W\nloss = 0.5 * sum((f(kn) - v)^2)\nupdate {\n  U = mu * U - eta * grad(loss, W)\n  W = (1 - alpha) * W + U\n}\nread = (f(q) * r + t + u + w + x2 + y + z) * beta\norder read_write\nschedule minibatch(8)\nwiring mag(window = 16)\n'


@pytest.fixture
def tricky(tmp_path):
    p = tmp_path / "tricky.yaml"
    p.write_text(TRICKY)
    return p


def test_golden_yaml_and_mem(tricky):
    spec = memspec.load(tricky)
    assert to_yaml(spec) == TRICKY_YAML
    assert to_mem(spec) == TRICKY_MEM


def test_round_trips_are_exact(tricky):
    spec = memspec.load(tricky)
    from_yaml = memspec.loads(TRICKY_YAML, "yaml")
    from_mem = memspec.loads(TRICKY_MEM, "mem")
    assert from_yaml == spec == from_mem
    assert to_yaml(from_yaml) == TRICKY_YAML and to_mem(from_mem) == TRICKY_MEM
    assert to_yaml(from_mem) == TRICKY_YAML and to_mem(from_yaml) == TRICKY_MEM


@pytest.mark.parametrize("text, printed", [
    ("-(a + b)", "-(a + b)"),
    ("(-a)^2", "(-a)^2"),
    ("-a^2", "-a^2"),
    ("-(a^2)", "-a^2"),
    ("a^b^c", "a^b^c"),
    ("a^(b^c)", "a^b^c"),
    ("(a^b)^c", "(a^b)^c"),
    ("a^-b", "a^-b"),
    ("d_k^(-0.5)", "d_k^-0.5"),
    ("a - (b - c)", "a - (b - c)"),
    ("(a - b) - c", "a - b - c"),
    ("a / (b * c)", "a / (b * c)"),
    ("(a / b) * c", "a / b * c"),
    ("a * -b", "a * -b"),
    ("--a", "--a"),
    ("((((a))))", "a"),
    ("(a @ B).T", "(a @ B).T"),
    ("-B.T", "-B.T"),
    ("(-B).T", "(-B).T"),
    ("sum((f(k) - v)^2)", "sum((f(k) - v)^2)"),
    ("1e-6 * a", "1e-06 * a"),
    ("2.50 + 007", "2.5 + 7"),
    ("(2).T", "(2).T"),
    ("(2.5).T", "(2.5).T"),
    ("1e999 * a", "1e999 * a"),
])
def test_expressions_print_canonically_in_both_formats(text, printed):
    spec = memspec.loads(f"name: e\nlet:\n  x: {yaml_str(text)}\nread: x\n", "yaml")
    assert unparse(spec.let["x"]) == printed
    y, m = to_yaml(spec), to_mem(spec)
    assert f"let x = {printed}\n" in m
    assert yaml.safe_load(y)["let"]["x"] == printed  # quoted exactly when needed
    assert memspec.loads(y, "yaml") == spec == memspec.loads(m, "mem")


@pytest.mark.parametrize("s", [
    "-x", "*a", "@b", "&c", "!d", "[e", "{f", "a: b", "a #b", "yes", "no", "on", "null", "~", "true",
    "1.5", "0x1f", "1e-6", "'q'", '"dq"', " lead", "trail ", "trail:", "%x", "|x", ">x", "?x", ",x",
    "`x", "a,b", "é ü 中", "tab\there", "new\nline", "back\\slash", "nel\x85", "ls\u2028x",
    "bell\x07", "emoji \U0001f600", "",
])
def test_yaml_scalars_reload_to_the_same_string(s):
    for where, doc in [("value", "k: {}\n"), ("key", "{}: 1\n"), ("flow", "k: [{}]\n")]:
        text = yaml_str(s, where)
        got = yaml.safe_load(doc.format(text))
        assert got == ({s: 1} if where == "key" else {"k": [s]} if where == "flow" else {"k": s})
    if s[:1] in set("-*@&![{") or ": " in s or " #" in s:
        assert yaml_str(s)[0] in "'\""


def test_plain_when_possible():
    assert yaml_str("sigmoid(logit)") == "sigmoid(logit)"
    assert yaml_str("0.5 * sum((f(k) - v)^2)") == "0.5 * sum((f(k) - v)^2)"
    assert yaml_str("W = W - eta * grad(loss, W)") == "W = W - eta * grad(loss, W)"
    assert yaml_str("-a") == "'-a'"
    assert yaml_str("it's") == "it's"
    assert yaml_str("a: it's") == "'a: it''s'"
    assert yaml_str("x\ny") == '"x\\ny"'


@pytest.mark.parametrize("v, text", [
    (1e-6, "1.0e-06"), (-1e-6, "-1.0e-06"), (1e20, "1.0e+20"), (3.0, "3.0"), (-0.25, "-0.25"),
    (0.1, "0.1"), (1.5e-300, "1.5e-300"), (float("inf"), ".inf"), (float("-inf"), "-.inf"),
])
def test_yaml_floats_reload_as_the_same_float(v, text):
    assert yaml_float(v) == text
    assert yaml.safe_load(f"k: {text}") == {"k": v}


def test_long_prose_is_folded_and_reloads():
    s = " ".join(f"word{i}: and #{i}" for i in range(40))
    text = yaml_text(s)
    assert text.startswith(">-\n  ") and all(len(line) <= 90 for line in text.splitlines())
    assert yaml.safe_load(f"k: {text}\n") == {"k": s}
    # text that folding would change is quoted instead
    for odd in ["a  b" * 30, "x" * 100 + "\n", " lead" * 30]:
        assert yaml.safe_load(f"k: {yaml_text(odd)}\n") == {"k": odd}


def test_descriptions_with_odd_characters_round_trip():
    desc = 'Quotes " and \' , backslash \\, tab\t, newline\n, é, 中, # and : too, \x07 bell, \u2028'
    spec = memspec.loads("name: d\nread: 1\n", "yaml").model_copy(update={"description": desc, "cite": "§3.1"})
    y, m = to_yaml(spec), to_mem(spec)
    assert memspec.loads(y, "yaml").description == desc
    assert memspec.loads(m, "mem").description == desc
    assert to_yaml(memspec.loads(m, "mem")) == y and to_mem(memspec.loads(y, "yaml")) == m


def test_defaults_are_omitted_and_shorthands_used():
    spec = memspec.loads(
        "name: m\nviews: {k: d}\ngates: {eta: {formula: sigmoid(logit), bias: 0}}\n"
        "params: {z: {shape: [], init: zeros}}\n"
        "state: {W: {shape: [d], init: zeros, cache: false}}\nread: W\norder: write_read\n"
        "schedule: auto\nwiring: {kind: mac, segment: 64, window: 64, persistent: 4}\n", "yaml")
    assert to_yaml(spec) == (
        "name: m\nviews:\n  k: d\ngates:\n  eta: sigmoid(logit)\nparams:\n  z: {}\n"
        "state:\n  W:\n    shape: [d]\nread: W\nwiring: mac\n")
    assert to_mem(spec) == (
        "memory m\n\nview k : d\n\ngate eta = sigmoid(logit)\n\nparam z : [] = zeros\n\n"
        "state W : [d] = zeros\n\nread = W\nwiring mac\n")
    bare = memspec.loads("name: m\nread: 1\n", "yaml")
    assert to_yaml(bare) == "name: m\nread: '1'\n"  # an expression stays a string in YAML
    assert to_mem(bare) == "memory m\n\nread = 1\n"


def test_number_inits_and_cache_windows():
    spec = memspec.loads(
        "name: n\nparams: {a: {shape: [d], init: -0.5}, b: {init: 2}}\n"
        "state: {K: {shape: [d], cache: true, window: 7}, V: {shape: [d], cache: true}}\n"
        "update:\n  - K = append(K, k)\n  - V = append(V, k)\nread: attend(k, K, V, 1)\n", "yaml")
    m = to_mem(spec)
    assert "param a : [d] = -0.5\nparam b : [] = 2.0\n" in m
    assert "state K : cache [d] window 7\nstate V : cache [d]\n" in m
    assert "    init: -0.5\n" in to_yaml(spec) and "    cache: true\n    window: 7\n" in to_yaml(spec)
    assert memspec.loads(m, "mem") == spec == memspec.loads(to_yaml(spec), "yaml")


BASE = """name: base
description: the base memory
dims: {d_k: 4, d_v: 4}
views: {q: d_k, k: d_k, v: d_v}
gates:
  eta: sigmoid(logit)
  alpha: {formula: sigmoid(logit), bias: -3}
state:
  W: {shape: [d_k, d_v]}
let:
  kn: l2norm(k)
model: f(u) = u @ W
loss: 0.5 * sum((f(kn) - v)^2)
update:
  - W = (1 - alpha) * W
  - W = W - eta * grad(loss, W)
read: f(q)
"""

VARIANT_YAML = """extends: base.yaml
name: variant
gates:
  alpha: null
  eta: {bias: 1.5}
let:
  kn: null
loss: 0.5 * sum((f(k) - v)^2)
update:
  - W = W - eta * grad(loss, W)
"""

VARIANT_MEM = """extends "base.yaml"
memory variant
drop gate alpha
drop let kn
gate eta = sigmoid(logit) bias 1.5
loss = 0.5 * sum((f(k) - v)^2)
update { W = W - eta * grad(loss, W) }
"""

RESOLVED_YAML = """name: variant
description: the base memory
dims:
  d_k: 4
  d_v: 4
views:
  q: d_k
  k: d_k
  v: d_v
gates:
  eta:
    formula: sigmoid(logit)
    bias: 1.5
state:
  W:
    shape: [d_k, d_v]
model: f(u) = u @ W
loss: 0.5 * sum((f(k) - v)^2)
update:
  - W = W - eta * grad(loss, W)
read: f(q)
"""


def test_extends_prints_the_resolved_spec_with_nulls_removed(tmp_path):
    (tmp_path / "base.yaml").write_text(BASE)
    (tmp_path / "variant.yaml").write_text(VARIANT_YAML)
    (tmp_path / "variant.mem").write_text(VARIANT_MEM)
    a = memspec.load(tmp_path / "variant.yaml")
    b = memspec.load(tmp_path / "variant.mem")
    assert a == b
    assert to_yaml(a) == RESOLVED_YAML == to_yaml(b)
    m = to_mem(a)
    assert "extends" not in m and "alpha" not in m and "kn" not in m
    assert memspec.loads(m, "mem") == a and to_mem(memspec.loads(m, "mem")) == m


def test_cli_fmt_converts_and_writes(tmp_path, capsys, tricky):
    assert main(["fmt", str(tricky), "--to", "mem"]) == 0
    assert capsys.readouterr().out == TRICKY_MEM
    assert main(["fmt", str(tricky)]) == 0
    assert capsys.readouterr().out == TRICKY_YAML
    mem = tmp_path / "t.mem"
    mem.write_text(TRICKY_MEM)
    assert main(["fmt", str(mem), "--to", "yaml"]) == 0
    assert capsys.readouterr().out == TRICKY_YAML
    # -w writes the converted text next to the input, and fmt is then the identity on it
    assert main(["fmt", str(tricky), "--to", "mem", "-w"]) == 0
    capsys.readouterr()
    assert (tmp_path / "tricky.mem").read_text() == TRICKY_MEM
    assert main(["fmt", str(tricky), "-w"]) == 0
    assert tricky.read_text() == TRICKY_YAML


def test_cli_fmt_bad_input_is_located_not_a_traceback(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: b\nread: f(q\n")
    assert main(["fmt", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "bad.yaml:2:" in err and "error:" in err and "Traceback" not in err
    assert main(["fmt", str(tmp_path / "missing.mem")]) == 1
    assert "no such spec file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["fmt", str(bad), "--to", "json"])
    assert exit_.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_to_mem_refuses_names_that_are_not_identifiers(tmp_path, capsys):
    p = tmp_path / "odd.yaml"
    p.write_text("name: odd\nviews:\n  q k: d\nread: 1\n")
    spec = memspec.load(p)
    assert "views:\n  q k: d\n" in to_yaml(spec)  # YAML can still print it
    with pytest.raises(SpecError) as err:
        to_mem(spec)
    d = err.value.diagnostics[0]
    assert d.message == "view 'q k' is not an identifier and cannot be written in .mem"
    assert (d.span.line, d.span.col) == (3, 3)
    assert main(["fmt", str(p), "--to", "mem"]) == 1
    assert "odd.yaml:3:3: error: view 'q k'" in capsys.readouterr().err


def test_infinite_constant_prints_in_yaml_and_is_refused_in_mem(tmp_path):
    p = tmp_path / "inf.yaml"
    p.write_text("name: i\nconstants:\n  big: .inf\nread: big\n")
    spec = memspec.load(p)
    assert "  big: .inf\n" in to_yaml(spec) and memspec.loads(to_yaml(spec), "yaml") == spec
    with pytest.raises(SpecError) as err:
        to_mem(spec)
    d = err.value.diagnostics[0]
    assert d.message == "constant big is inf, which .mem cannot write"
    assert (d.span.line, d.span.col) == (3, 8)


def _random_expr(rng: random.Random, depth: int):
    if depth == 0 or rng.random() < 0.25:
        r = rng.random()
        if r < 0.5:
            return Name(rng.choice(["a", "b", "W", "d_k"]))
        return Num(rng.choice([0, 1, 2, 0.5, 1e-6, 3.25, 1e20, float("inf")]))
    r = rng.random()
    if r < 0.55:
        return BinOp(rng.choice("+-*/@^"), _random_expr(rng, depth - 1), _random_expr(rng, depth - 1))
    if r < 0.7:
        return Neg(_random_expr(rng, depth - 1))
    if r < 0.8:
        return Transpose(_random_expr(rng, depth - 1))
    fn = rng.choice(["sum", "exp", "l2norm", "outer", "huber", "clamp"])
    n = {"outer": 2, "huber": 2, "clamp": 3}.get(fn, 1)
    return Call(fn, tuple(_random_expr(rng, depth - 1) for _ in range(n)))


def test_random_expressions_round_trip_through_both_formats():
    rng = random.Random(0)
    base = memspec.loads("name: r\nread: 1\n", "yaml")
    for _ in range(150):
        e = _random_expr(rng, 4)
        assert parse_expr(unparse(e)) == e
        spec = base.model_copy(update={"read": e, "let": {"x": Neg(e)}})
        y, m = to_yaml(spec), to_mem(spec)
        assert memspec.loads(y, "yaml") == spec == memspec.loads(m, "mem")
        assert to_yaml(memspec.loads(y, "yaml")) == y and to_mem(memspec.loads(m, "mem")) == m


VECTOR_GATES_YAML = (
    "name: vg\ndims:\n  d_k: 4\n  d_v: 3\nviews:\n  q: d_k\n"
    "  k: d_k\n  v: d_v\ngates:\n  alpha:\n    formula: sigmoid(logit)\n    shape: [d_k]\n  eta:\n"
    "    formula: sigmoid(logit)\n    shape: [d_v]\n    bias: -2.0\n  mu: sigmoid(logit)\n"
    "params:\n  u:\n    shape: [d_k]\n    init: ones\nstate:\n  S:\n"
    "    shape: [d_k, d_v]\nupdate:\n  - S = diag(1 - alpha) @ S @ diag(mu * eta) + outer(k, v)\n"
    "read: q @ S + q @ (u * k) * v\norder: read_write\n")
VECTOR_GATES_MEM = (
    "memory vg\n\ndims { d_k = 4, d_v = 3 }\n\nview q : d_k\nview k : d_k\nview v : d_v\n\n"
    "gate alpha : [d_k] = sigmoid(logit)\ngate eta : [d_v] = sigmoid(logit) bias -2.0\ngate mu = sigmoid(logit)\n\n"
    "param u : [d_k] = ones\n\nstate S : [d_k, d_v] = zeros\n\nupdate {\n"
    "  S = diag(1 - alpha) @ S @ diag(mu * eta) + outer(k, v)\n}\nread = q @ S + q @ (u * k) * v\n"
    "order read_write\n")


def test_per_channel_gates_and_diag_print_and_round_trip():
    """A gate with a shape prints its long form (formula, shape, bias when not 0) in YAML and
    `gate g : [d] = ...` in .mem; diag(...) @ S prints as written."""
    spec = memspec.loads(VECTOR_GATES_YAML, "yaml")
    assert spec.gates["alpha"].shape == ["d_k"] and spec.gates["mu"].shape == []
    assert to_yaml(spec) == VECTOR_GATES_YAML
    assert to_mem(spec) == VECTOR_GATES_MEM
    again = memspec.loads(VECTOR_GATES_MEM, "mem")
    assert again == spec
    assert to_yaml(again) == VECTOR_GATES_YAML and to_mem(again) == VECTOR_GATES_MEM


def test_gate_shape_is_part_of_the_spec():
    a = memspec.loads(VECTOR_GATES_YAML, "yaml")
    b = memspec.loads(VECTOR_GATES_YAML.replace("    shape: [d_v]\n", ""), "yaml")
    assert a != b
    assert b.gates["eta"].shape == []


WIRED = {
    "mac": ("wiring:\n  kind: mac\n  segment: 16\n  qk_norm: false\n  write: input\n  output: additive\n",
            "wiring mac(segment = 16, qk_norm = false, write = input, output = additive)\n"),
    "mag": ("wiring:\n  kind: mag\n  window: 8\n  gate: convex\n", "wiring mag(window = 8, gate = convex)\n"),
    "mal": ("wiring:\n  kind: mal\n  residual: false\n", "wiring mal(residual = false)\n"),
}


@pytest.mark.parametrize("kind", sorted(WIRED))
def test_wiring_options_round_trip_in_both_formats(kind):
    """The options print in Wiring field order, only when they differ from the paper's
    default; YAML -> spec -> YAML, .mem -> spec -> .mem and YAML <-> .mem all agree."""
    y_wiring, m_wiring = WIRED[kind]
    head = "name: w\nviews:\n  k: d\nstate:\n  W:\n    shape: [d]\nread: W\n"
    spec = memspec.loads(head + y_wiring, "yaml")
    assert to_yaml(spec) == head + y_wiring
    assert to_mem(spec).endswith("read = W\n" + m_wiring)
    again = memspec.loads(to_mem(spec), "mem")
    assert again == spec and to_yaml(again) == head + y_wiring
    defaults = spec.wiring.model_copy(update={k: v for k, v in Wiring().model_dump().items() if k != "kind"})
    assert to_yaml(spec.model_copy(update={"wiring": defaults})).endswith(f"read: W\nwiring: {kind}\n")
