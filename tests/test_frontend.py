"""Frontends: YAML and .mem give equal specs, positions map back to the file, extends merges."""
from __future__ import annotations

import textwrap

import pytest

import memspec
from memspec.lang.errors import SpecError
from memspec.lang.expr import BinOp, Call, Name, Num, parse_expr, unparse

DELTA_YAML = textwrap.dedent(
    """\
    name: delta
    dims: {d_model: 8, heads: 2, d_k: 4, d_v: 3}
    views:
      q: d_k
      k: d_k
      v: d_v
    gates:
      eta: sigmoid(logit)
    state:
      W: {shape: [d_k, d_v], init: zeros}
    model: f(u) = u @ W
    loss: 0.5 * sum((f(k) - v)^2)
    update:
      - W = W - eta * grad(loss, W)
    read: f(q)
    """
)

DELTA_MEM = textwrap.dedent(
    """\
    memory delta
    dims { d_model = 8, heads = 2, d_k = 4, d_v = 3 }
    view q : d_k
    view k : d_k
    view v : d_v
    gate eta = sigmoid(logit)
    state W : [d_k, d_v] = zeros
    model f(u) = u @ W   # the linear inner model
    loss = 0.5 * sum((f(k) - v)^2)
    update {
      W = W - eta * grad(loss, W)
    }
    read = f(q)
    """
)


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_yaml_and_mem_give_equal_specs(tmp_path):
    a = memspec.load(write(tmp_path, "d.yaml", DELTA_YAML))
    b = memspec.load(write(tmp_path, "d.mem", DELTA_MEM))
    assert a == b
    assert a.dims == {"d_model": 8, "heads": 2, "d_k": 4, "d_v": 3}
    assert str(a.update[0]) == "W = W - eta * grad(loss, W)"
    assert a.state["W"].shape == ["d_k", "d_v"]


def test_spans_point_into_the_file(tmp_path):
    a = memspec.load(write(tmp_path, "d.yaml", DELTA_YAML))
    stmt = a.update[0]
    assert (stmt.span.line, stmt.span.col) == (14, 5)
    grad = [n for n in stmt.value.walk() if isinstance(n, Call) and n.fn == "grad"][0]
    line = DELTA_YAML.splitlines()[13]
    assert line[grad.span.col - 1 :].startswith("grad(loss, W)")
    b = memspec.load(write(tmp_path, "d.mem", DELTA_MEM))
    eta = [n for n in b.update[0].value.walk() if isinstance(n, Name) and n.id == "eta"][0]
    assert (eta.span.line, eta.span.col) == (11, 11)


def test_quoted_and_block_expression_columns(tmp_path):
    text = DELTA_YAML.replace("read: f(q)", 'read: "f(q) +* 1"')
    with pytest.raises(SpecError) as e:
        memspec.load(write(tmp_path, "q.yaml", text))
    d = e.value.diagnostics[0]
    assert (d.span.line, d.span.col) == (15, 14)  # the "*"
    text = DELTA_YAML.replace("read: f(q)", "read: |\n  f(q) +\n    * 2")
    with pytest.raises(SpecError) as e:
        memspec.load(write(tmp_path, "b.yaml", text))
    d = e.value.diagnostics[0]
    assert (d.span.line, d.span.col) == (17, 5)


def test_all_errors_are_collected(tmp_path):
    text = DELTA_YAML.replace("gates:", "gatez:").replace("init: zeros", "init: zerros").replace(
        "eta * grad", "eta * * grad"
    )
    with pytest.raises(SpecError) as e:
        memspec.load(write(tmp_path, "bad.yaml", text))
    msgs = [d.message for d in e.value.diagnostics]
    assert len(msgs) == 3
    assert any("unknown field 'gatez'" in m for m in msgs)
    assert any("unknown init 'zerros'" in m for m in msgs)
    assert any("unexpected '*'" in m for m in msgs)
    rendered = e.value.render()
    assert "did you mean 'gates'?" in rendered


def test_extends_merges_and_removes(tmp_path):
    write(tmp_path, "base.yaml", DELTA_YAML.replace("eta: sigmoid(logit)", "eta: sigmoid(logit)\n  alpha: sigmoid(logit)"))
    child = write(
        tmp_path,
        "child.yaml",
        "extends: base.yaml\nname: child\ngates: {alpha: null}\nloss: sum(huber(f(k) - v, 1.0))\n",
    )
    s = memspec.load(child)
    assert s.name == "child"
    assert list(s.gates) == ["eta"]
    assert unparse(s.loss) == "sum(huber(f(k) - v, 1.0))"
    assert s.update == memspec.load(tmp_path / "base.yaml").update
    # spans of inherited fields point at the base file, overrides at the child
    assert s.span("update", 0).file.endswith("base.yaml")
    assert s.loss.span.file.endswith("child.yaml")


def test_mem_extends_with_drop(tmp_path):
    write(tmp_path, "base.mem", DELTA_MEM.replace("gate eta", "gate alpha = sigmoid(logit) bias -3\ngate eta"))
    child = write(tmp_path, "child.mem", 'extends "base.mem"\nmemory child\ndrop gate alpha\n')
    s = memspec.load(child)
    assert list(s.gates) == ["eta"] and s.name == "child"
    base = memspec.load(tmp_path / "base.mem")
    assert base.gates["alpha"].bias == -3.0


def test_extends_cycle_is_an_error(tmp_path):
    write(tmp_path, "a.yaml", "extends: b.yaml\nname: a\n")
    write(tmp_path, "b.yaml", "extends: a.yaml\nname: b\n")
    with pytest.raises(SpecError) as e:
        memspec.load(tmp_path / "a.yaml")
    assert "cycle of extends" in e.value.diagnostics[0].message


def test_yaml_tags_are_refused(tmp_path):
    p = write(tmp_path, "t.yaml", "name: !!python/object:os.system x\nread: q\n")
    with pytest.raises(SpecError) as e:
        memspec.load(p)
    assert "tag" in e.value.diagnostics[0].message


@pytest.mark.parametrize(
    "src",
    ["-x^2", "a - (b - c)", "(a + b).T @ c", "x^2^3", "(x^2)^3", "(-x)^2", "a / (b * c)", "2^-1", "f(k) - v"],
)
def test_unparse_round_trip(src):
    e = parse_expr(src)
    assert parse_expr(unparse(e)) == e


def test_precedence():
    e = parse_expr("-x^2")
    assert e == parse_expr("-(x^2)")
    e = parse_expr("a * b @ c")
    assert e == BinOp("@", BinOp("*", Name(id="a"), Name(id="b")), Name(id="c"))
    assert parse_expr("1") == Num(1.0)
