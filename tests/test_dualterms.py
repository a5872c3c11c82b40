"""The dual form's term objects (memspec.codegen.dualterms): the writer's decisions -- a factor 1
vanishes, a number scales without broadcasting, equal terms are one value, what a term reads --
are made on them, and their text comes out with the parentheses the operators need."""
from __future__ import annotations

from pathlib import Path

import torch

from memspec.codegen.dualchunk import constant_value
from memspec.codegen.dualterms import ONE, Call, Group, Op, Post, Ref, Sum, local, matmul, mul, number, scaled
from memspec.lang.expr import parse_expr
from memspec.pipeline.build import load_checked

X, Y, Z, c = local("x"), local("y"), local("z"), local("c")


def test_factor_one_vanishes_and_numbers_scale():
    assert mul(ONE, X) is X and mul(X, ONE) is X
    assert mul(number(1.0), X) is X                     # 1.0 is one too (its value, not its text)
    assert mul(number(0.5), X).render() == "0.5 * x"
    assert scaled(c, X).render() == "c.unsqueeze(-1) * x"
    assert scaled(number(-0.5), X).render() == "-0.5 * x"
    assert scaled(ONE, X) is X
    assert Ref("self.lr", is_number=True).number and not Ref("self.lr", is_number=True).one


def test_equal_terms_are_one_value_and_names_are_read_off_the_structure():
    a = Op("*", Group(matmul(X, Post(Y, ".transpose(-2, -1)"))), Z)
    b = Op("*", Group(matmul(local("x"), Post(local("y"), ".transpose(-2, -1)"))), local("z"))
    assert a == b and hash(a) == hash(b) and len({a: 1, b: 2}) == 1
    assert a.names == {"x", "y", "z"}
    assert Sum.of(matmul(X, Y), ONE).names == {"x", "y"}            # a number reads nothing
    assert Call("F.pad", (X, Ref("(1, 0)")), (("value", number(0.0)),)).names == {"x"}


def test_text_has_the_parentheses_the_operators_need():
    assert matmul(X, Op("*", c, Y)).render() == "x @ (c * y)"
    assert Post(Sum.of(X, Y), ".unsqueeze(-1)").render() == "(x + y).unsqueeze(-1)"
    assert Op("*", Post(c, ".unsqueeze(-1)"), matmul(X, Y)).render() == "c.unsqueeze(-1) * (x @ y)"
    assert Sum.of(Sum.of(X, Y), Z).render() == "x + y + z"      # flattened, left to right
    assert Sum.of(X) is X
    assert matmul(Group(Op("*", Group(Sum.of(matmul(X, Y), ONE)), Z)), c).render() == "((x @ y + 1) * z) @ c"
    assert Call("F.pad", (Post(X, "[..., :-1]"), Ref("(1, 0)")), (("value", number(1.0)),)).render() \
        == "F.pad(x[..., :-1], (1, 0), value=1.0)"


def test_the_rendered_text_computes_what_the_terms_say():
    g = torch.Generator().manual_seed(0)
    env = {n: torch.randn(3, 3, generator=g, dtype=torch.float64) for n in "xyz"}
    env["c"] = torch.randn(3, generator=g, dtype=torch.float64)
    t = Sum.of(scaled(c, matmul(X, Y)), matmul(Group(Op("*", Group(Sum.of(matmul(X, Z), ONE)), Y)), Z))
    got = eval(t.render(), {}, dict(env))
    x, y, z, cc = env["x"], env["y"], env["z"], env["c"]
    torch.testing.assert_close(got, cc.unsqueeze(-1) * (x @ y) + ((x @ z + 1) * y) @ z, rtol=1e-12, atol=1e-12)


def test_constant_value_folds_numbers_and_constants_only():
    spec = load_checked(Path(__file__).resolve().parent.parent / "specs" / "titans.yaml").spec
    assert constant_value(spec, parse_expr("1 - 0")) == 1.0
    assert constant_value(spec, parse_expr("2 * 0.25")) == 0.5
    assert constant_value(spec, parse_expr("1 - eta")) is None          # a gate: no value now
    assert constant_value(spec, parse_expr("d_k")) is None              # a dim: set at build time
