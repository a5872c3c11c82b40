"""Line layout of generated source (memspec.codegen.layout): every line within 100 characters,
the AST unchanged, idempotent."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from memspec.codegen import layout as lay

COMPILED = Path(__file__).resolve().parent.parent / "compiled"


@pytest.mark.parametrize("path", sorted(COMPILED.glob("*.py")), ids=lambda p: p.name)
def test_compiled_modules_fit_in_100_columns(path):
    text = path.read_text(encoding="utf-8")
    long = [(i + 1, ln) for i, ln in enumerate(text.split("\n")) if len(ln) > lay.WIDTH]
    assert not long, long[:3]
    assert lay.layout(text) == text


SOURCE = '''
def f(alpha, beta, gamma):
    """A docstring whose single line is much longer than one hundred characters, so that it has to be wrapped."""
    value = some_function(alpha, beta, gamma) + some_function(beta, gamma, alpha) * some_function(gamma, alpha, beta)  # a comment
    pair = alpha * 2, beta * 3, gamma * 4, alpha + beta + gamma, alpha - beta - gamma, alpha * beta * gamma + 1
    table = {"first": alpha, "second": beta, "third": gamma, "fourth": alpha + beta, "fifth": beta + gamma}
    # a comment line that goes on and on beyond the limit of one hundred characters, to be wrapped at words
    return value, pair, table


def some_function(a, b, c):
    return a * 100 + b * 10 + c
'''


def test_long_lines_are_laid_out_with_the_same_ast_and_values():
    out = lay.layout(SOURCE)
    assert all(len(ln) <= lay.WIDTH for ln in out.split("\n")), out
    assert lay._normalised_ast(out) == lay._normalised_ast(SOURCE)
    assert "# a comment\n" in out and out.index("# a comment") < out.index("value = ")
    ns_a, ns_b = {}, {}
    exec(SOURCE, ns_a)
    exec(out, ns_b)
    assert ns_a["f"](1, 2, 3) == ns_b["f"](1, 2, 3)
    assert lay.layout(out) == out


def test_a_layout_that_changes_the_code_is_refused(monkeypatch):
    monkeypatch.setattr(lay, "_layout", lambda text, width: text.replace("* 100", "* 101"))
    with pytest.raises(lay.LayoutError):
        lay.layout(SOURCE)


def test_unbreakable_lines_are_left_alone():
    src = "x = '" + "a" * 150 + "'\n"
    assert lay.layout(src) == src
    ast.parse(lay.layout(src))


OPERATORS = '''
def g(x, groups, state, width_of_the_longest_name_here, another_long_name_for_the_test):
    for j, (first_element, second_element) in enumerate(zip(width_of_the_longest_name_here, another_long_name_for_the_test)):
        x = x + j
    table = {key: value * 2 if isinstance(value, int) else value for key, value in state.items() if key}
    return x.split([nc * c for nc, c, _ in groups], dim=1) if x is not None else [None] * len(groups)
'''


def test_lines_break_at_the_loosest_operator_and_never_in_a_loop_target():
    out = lay.layout(OPERATORS)
    lines = out.split("\n")
    assert all(len(ln) <= lay.WIDTH for ln in lines), out
    assert "    for j, (first_element, second_element) in enumerate(" in out
    # a comprehension breaks before its for, a conditional before its else, not inside an operand
    assert any(ln.strip().startswith("for key, value in state.items()") for ln in lines), out
    assert "    return (x.split([nc * c for nc, c, _ in groups], dim=1) if x is not None" in out
    assert any(ln.strip() == "else [None] * len(groups))" for ln in lines), out
    assert lay._normalised_ast(out) == lay._normalised_ast(OPERATORS)
    assert lay.layout(out) == out


def test_a_value_continued_on_the_next_line_is_not_parenthesised():
    src = ("def h(a, b):\n    return a + b + a + b + a + b + a + b + a + b + a + b + a + b + a + b + a + b + a + b"
           " + a + max(a,\n        b)\n")
    out = lay.layout(src)
    assert lay._normalised_ast(out) == lay._normalised_ast(src)


def test_a_statement_on_several_lines_is_broken_afresh_when_one_is_too_long():
    src = ("def h(nba, rhs):\n"
           "    x = torch.linalg.solve_triangular(nba.transpose(1, 2), rhs.transpose(1, 2), upper=True, left=False,\n"
           "                                      unitriangular=True).transpose(1, 2)   # [n, K + V]\n"
           "    y = f(nba,  # a comment inside: left as it is\n"
           "          rhs, rhs, rhs, rhs, rhs, rhs, rhs, rhs, rhs, rhs, rhs, rhs, rhs, rhs, rhs, rhs, rhs, rhs, rhs)\n"
           "    return x, y\n")
    out = lay.layout(src)
    assert lay._normalised_ast(out) == lay._normalised_ast(src)
    assert ("    # [n, K + V]\n    x = torch.linalg.solve_triangular(nba.transpose(1, 2), rhs.transpose(1, 2), "
            "upper=True,\n            left=False, unitriangular=True).transpose(1, 2)\n") in out, out
    assert "    y = f(nba,  # a comment inside: left as it is\n" in out
    assert lay.layout(out) == out


PARAGRAPHS = '''
def f(x):
    """First line of a docstring that is just a little longer than one hundred characters wide, so it is.
    The second line of the same paragraph, short.

    * an item whose first line runs on past the one hundred column limit by a handful of words here too
      and its hanging line, which continues the item.
    >>> x = 1
    """
    return x
'''


def test_a_docstring_paragraph_with_a_long_line_is_reflowed_as_a_whole():
    out = lay.layout(PARAGRAPHS)
    lines = out.split("\n")
    assert ast.get_docstring(ast.parse(out).body[0]).split() == ast.get_docstring(ast.parse(PARAGRAPHS).body[0]).split()
    first = lines[2:4]   # the paragraph: two lines again, the overflow carried into the second
    assert all(len(ln) <= lay.WIDTH for ln in first) and first[1].startswith("    ") and "short." in first[1]
    item = [ln for ln in lines if "item" in ln or "hanging" in ln]
    assert item[0].startswith("    * an item") and all(ln.startswith("      ") for ln in item[1:])
    assert len(item) == 2 and all(len(ln) <= lay.WIDTH for ln in item)
    assert "    >>> x = 1" in lines   # an example: its own line
