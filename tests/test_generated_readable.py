"""The generated modules read like hand-written code: no local is assigned and then never read
(or overwritten before it is read), and no function's docstring documents a parameter the
function lacks.  The modules are compiled afresh from specs/*.yaml into a temporary folder."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SPECS = sorted((ROOT / "specs").glob("*.yaml"))
FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef)
EXITS = (ast.Return, ast.Continue, ast.Break, ast.Raise, ast.Try, ast.Yield, ast.YieldFrom)


# ------------------------------------------------------------------ unused locals
def _own_walk(node):
    """The nodes of ``node``'s body, not those of the functions and classes nested in it."""
    todo = list(ast.iter_child_nodes(node))
    while todo:
        n = todo.pop()
        yield n
        if not isinstance(n, FUNCS + (ast.ClassDef,)):
            todo.extend(ast.iter_child_nodes(n))


def _loads(node) -> set:
    """Every name read anywhere in ``node`` (nested functions, lambdas and comprehensions
    included: a closure's read counts)."""
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def _assigned_names(stmt) -> list:
    """The names a plain assignment binds, when every target is a name or a tuple of names."""
    if isinstance(stmt, ast.Assign):
        targets = stmt.targets
    elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
        targets = [stmt.target]
    else:
        return []
    names = []
    for t in targets:
        elts = t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t]
        if not all(isinstance(e, ast.Name) for e in elts):
            return []
        names.append([e.id for e in elts])
    return names


def _blocks(fn):
    """Every statement list of ``fn`` (its body and the bodies of its compound statements)."""
    yield fn.body
    for n in _own_walk(fn):
        for field in ("body", "orelse", "finalbody"):
            block = getattr(n, field, None)
            if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                yield block
        for h in getattr(n, "handlers", []) or []:
            yield h.body


def unused_assignments(fn) -> list:
    """``(line, name, why)`` for each local of ``fn`` assigned and never read, or overwritten in
    the same block before any read, and each function defined in ``fn`` and never used.  Tuple targets count only when no name of the tuple is read;
    ``_`` and loop variables are never reported."""
    declared = {name for n in _own_walk(fn) if isinstance(n, (ast.Global, ast.Nonlocal)) for name in n.names}
    read = _loads(fn)
    found = []
    for n in _own_walk(fn):
        if isinstance(n, FUNCS) and n.name not in read:
            found.append((n.lineno, n.name, "a function defined and never called"))
        for group in _assigned_names(n):
            names = [x for x in group if x != "_" and x not in declared]
            if names and not any(x in read for x in group):
                found.append((n.lineno, ", ".join(names), "never read"))
    for block in _blocks(fn):
        for i, stmt in enumerate(block):
            groups = _assigned_names(stmt)
            if len(groups) != 1 or len(groups[0]) != 1 or groups[0][0] in ("_",) or groups[0][0] in declared:
                continue
            name = groups[0][0]
            for later in block[i + 1:]:
                if any(isinstance(x, EXITS) for x in [later, *_own_walk(later)]):
                    break
                later_groups = _assigned_names(later)
                if later_groups and any(g == [name] for g in later_groups) and name not in _loads(later.value):
                    found.append((stmt.lineno, name, f"overwritten on line {later.lineno} before it is read"))
                    break
                if name in _loads(later) or isinstance(later, FUNCS + (ast.ClassDef,)):
                    break
    return sorted(set(found))


# ------------------------------------------------------------------ docstrings
ARGS_HEADER = re.compile(r"^(\s*)(Args|Arguments|Parameters):\s*$")
ENTRY = re.compile(r"^([\w\s,*`]+?):(\s|$)")


def documented_parameters(doc: str) -> list:
    """The parameter names an ``Args:`` section of ``doc`` describes (entries ``name: ...`` or
    ``a, b, c: ...`` one indentation step in; deeper lines continue an entry)."""
    names = []
    lines = doc.expandtabs().split("\n")
    for i, line in enumerate(lines):
        m = ARGS_HEADER.match(line)
        if not m:
            continue
        header = len(m.group(1))
        entry_indent = None
        for ln in lines[i + 1:]:
            if not ln.strip():
                continue
            indent = len(ln) - len(ln.lstrip())
            if indent <= header:
                break
            if entry_indent is None:
                entry_indent = indent
            if indent != entry_indent:
                continue
            e = ENTRY.match(ln.strip())
            if e:
                names += [x.strip().strip("`*").strip() for x in e.group(1).split(",") if x.strip()]
    return names


def docstring_mismatches(fn) -> list:
    doc = ast.get_docstring(fn, clean=False)
    if not doc:
        return []
    a = fn.args
    params = {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs}
    params |= {x.arg for x in (a.vararg, a.kwarg) if x is not None}
    return [name for name in documented_parameters(doc) if name not in params]


# ------------------------------------------------------------------ the checks themselves
def test_the_checker_finds_dead_assignments_and_keeps_live_ones():
    src = '''
def f(x, y, n):
    """A function.

    Args:
        x: a tensor.
        y, z: two more.
        w: gone.

    Returns:
        r: a result.
    """
    dec = {}
    dec = {"a": x}
    g = [None] * n
    g = [x] * n
    a, b = divmod(n, 3)
    c, d = divmod(n, 2)
    unused = x + 1
    for i in range(n):
        _ = i
        acc = 0
        if i:
            continue
        acc = acc + i
    s = x
    while n:
        s = s * 2
        n -= 1

    def inner():
        return y

    def helper():
        return y
    return dec, g, a, s, acc, inner
'''
    fn = ast.parse(src).body[0]
    found = unused_assignments(fn)
    assert [(name, why.split()[0]) for _, name, why in found] == [
        ("dec", "overwritten"), ("g", "overwritten"), ("c, d", "never"), ("unused", "never"), ("helper", "a")]
    assert docstring_mismatches(fn) == ["z", "w"]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("compiled")
    r = subprocess.run([sys.executable, "-m", "memspec", "compile", *map(str, SPECS), "-o", str(out)],
                       capture_output=True, text=True, cwd=ROOT, check=False)
    assert r.returncode == 0, r.stderr
    files = sorted(out.glob("*.py"))
    assert len(files) == len(SPECS)
    return files


def _functions(path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [n for n in ast.walk(tree) if isinstance(n, FUNCS)]


def test_generated_modules_have_no_unused_assignments(compiled):
    bad = [f"{p.name}:{line} {fn.name}: {name} {why}"
           for p in compiled for fn in _functions(p) for line, name, why in unused_assignments(fn)]
    assert not bad, "\n".join(bad)


def test_generated_docstrings_document_only_their_parameters(compiled):
    bad = [f"{p.name}:{fn.lineno} {fn.name} documents {name}"
           for p in compiled for fn in _functions(p) for name in docstring_mismatches(fn)]
    assert not bad, "\n".join(bad)


def missing_references(text: str) -> list:
    """``(line, name)`` of each ``:func:`` / ``:class:`` / ``:meth:`` reference by a bare name to
    nothing defined in ``text`` (a dotted name points into a package and is left alone)."""
    tree = ast.parse(text)
    defined = {n.name for n in ast.walk(tree) if isinstance(n, FUNCS + (ast.ClassDef,))}
    return [(text[:m.start()].count("\n") + 1, m.group(1))
            for m in re.finditer(r":(?:func|class|meth):`~?([\w.]+)`", text)
            if "." not in m.group(1) and m.group(1) not in defined]


def test_generated_docstrings_refer_to_functions_in_the_file(compiled):
    bad = [f"{p.name}:{line} refers to {name}"
           for p in compiled for line, name in missing_references(p.read_text(encoding="utf-8"))]
    assert not bad, "\n".join(bad)
