"""Tidying a specialised function's source: what constant folding left dead goes, and its
docstring documents only the parameters it still has.

:func:`drop_dead` removes whole statements (by their lines, so the rest keeps its layout and
comments): an assignment whose names are never read, or that is overwritten further on in its block
before any read, when evaluating its value has no effect (:data:`PURE_CALLS` and the local functions
made of such calls), and a function defined inside and never used.  :func:`drop_documented` takes
the entries of bound parameters out of a docstring's ``Args:`` section.
"""
from __future__ import annotations

import ast
import re

# ---------------------------------------------------------------------------- docstrings
_ARGS_HEADER = re.compile(r"^(\s*)(Args|Arguments|Parameters):\s*$")
_ENTRY = re.compile(r"^(\s*)([\w`*]+(?:\s*,\s*[\w`*]+)*):(\s|$)")


def drop_documented(lines: list, bound: set) -> list:
    """Docstring ``lines`` without what their ``Args:`` section says of the parameters ``bound``:
    an entry (``name: ...`` one step in, with its deeper continuation lines) of bound names only
    goes; an entry of several names (``a, b, c: ...``) loses the bound ones."""
    out: list = []
    header = entry = None      # the Args section's indentation, its entries'
    dropping = False
    for line in lines:
        indent = len(line) - len(line.lstrip())
        m = _ARGS_HEADER.match(line)
        if m:
            header, entry, dropping = len(m.group(1)), None, False
            out.append(line)
            continue
        if header is not None and line.strip():
            if indent <= header:
                header, dropping = None, False
            else:
                entry = indent if entry is None else entry
                e = _ENTRY.match(line) if indent == entry else None
                if e:
                    names = [x.strip() for x in e.group(2).split(",")]
                    kept = [x for x in names if x.strip("`*") not in bound]
                    dropping = not kept
                    if kept and len(kept) < len(names):
                        line = line[:indent] + ", ".join(kept) + line[e.end(2):]
                elif indent == entry:
                    dropping = False
        if dropping and line.strip():
            continue
        if dropping and not line.strip():
            dropping = False
        out.append(line)
    return out


# ---------------------------------------------------------------------------- dead assignments
# calls whose only effect is their value (the kernels' torch and helper calls; in-place methods
# end in ``_`` and are never among them)
PURE_CALLS = frozenset((
    "len", "range", "min", "max", "int", "float", "bool", "abs", "round", "divmod", "zip", "enumerate",
    "list", "tuple", "dict", "set", "sorted", "any", "all",
    "arange", "exp", "log", "where", "cumsum", "zeros", "ones", "full", "cat", "stack", "isfinite",
    "promote_types", "zeros_like", "ones_like", "pad", "tril", "triu", "matmul", "bmm", "baddbmm",
    "reshape", "view", "unbind", "split", "repeat_interleave", "transpose", "permute", "contiguous",
    "unsqueeze", "squeeze", "sum", "mean", "prod", "flip", "diagonal", "clamp", "clamp_min", "clamp_max",
    "to", "new_zeros", "new_ones", "new_empty", "new_full", "expand", "flatten", "index_select",
    "items", "keys", "values", "get"))


def _pure(e, local_pure: set, local: frozenset = frozenset()) -> bool:
    """Has evaluating ``e`` no effect but its value (no call outside :data:`PURE_CALLS` and the
    pure local functions ``local_pure``, no assignment expression, no generator)?  A call of a
    name bound in the function (``local``) is pure only when it is one of ``local_pure``."""
    for n in ast.walk(e):
        if isinstance(n, (ast.NamedExpr, ast.Await, ast.Yield, ast.YieldFrom, ast.GeneratorExp)):
            return False
        if isinstance(n, ast.Call):
            f = n.func
            if isinstance(f, ast.Name):
                ok = f.id in local_pure if f.id in local else f.id in PURE_CALLS
            else:
                ok = isinstance(f, ast.Attribute) and f.attr in PURE_CALLS
            if not ok:
                return False
    return True


def _pure_functions(fdef) -> set:
    """The functions defined in ``fdef`` whose body only binds locals to pure values and returns."""
    defs = [n for n in ast.walk(fdef) if isinstance(n, ast.FunctionDef) and n is not fdef]
    local = _local_names(fdef)
    pure: set = set()
    changed = True
    while changed:
        changed = False
        for d in defs:
            if d.name in pure:
                continue
            body = d.body[1:] if d.body and isinstance(d.body[0], ast.Expr) \
                and isinstance(d.body[0].value, ast.Constant) else d.body
            if all(_pure_stmt(s, pure, local) for s in body):
                pure.add(d.name)
                changed = True
    return pure


def _pure_stmt(s, pure: set, local: frozenset) -> bool:
    if isinstance(s, ast.Return):
        return s.value is None or _pure(s.value, pure, local)
    if isinstance(s, ast.Assign):
        return all(isinstance(t, ast.Name) for t in s.targets) and _pure(s.value, pure, local)
    if isinstance(s, ast.If):
        return _pure(s.test, pure, local) and all(_pure_stmt(x, pure, local) for x in s.body + s.orelse)
    return False


def _local_names(fdef) -> frozenset:
    """Every name ``fdef`` or a function inside it binds (parameters, targets, defs)."""
    return frozenset(
        {n.id for n in ast.walk(fdef) if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)}
        | {a.arg for a in ast.walk(fdef) if isinstance(a, ast.arg)}
        | {n.name for n in ast.walk(fdef) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))})


def _targets(stmt) -> list | None:
    """The names a single-target assignment binds (a name or a tuple of names), else None."""
    if not isinstance(stmt, ast.Assign) or len(stmt.targets) != 1:
        return None
    t = stmt.targets[0]
    elts = t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t]
    return [e.id for e in elts] if all(isinstance(e, ast.Name) for e in elts) else None


def _own_blocks(fdef):
    """The statement lists of ``fdef`` (not of the functions or classes defined in it)."""
    todo = [fdef.body]
    while todo:
        block = todo.pop()
        yield block
        for s in block:
            if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            for field in ("body", "orelse", "finalbody"):
                sub = getattr(s, field, None)
                if isinstance(sub, list) and sub:
                    todo.append(sub)
            todo.extend(h.body for h in getattr(s, "handlers", []) or [])


_EXITS = (ast.Return, ast.Continue, ast.Break, ast.Raise, ast.Try)


def _dead(block: list, i: int, reads: set) -> bool:
    """Is ``block[i]`` (an assignment) never read: its names read nowhere in the function, or its
    one name assigned again further on in the block before any read (nothing in between that
    leaves the block early)?"""
    names = _targets(block[i])
    if not any(n in reads for n in names):
        return True
    if len(names) != 1:
        return False
    for later in block[i + 1:]:
        if any(isinstance(x, (*_EXITS, ast.FunctionDef, ast.ClassDef, ast.Lambda))
               for x in ast.walk(later)):
            return False
        if _targets(later) == names and not any(isinstance(x, ast.Name) and x.id == names[0]
                                               for x in ast.walk(later.value)):
            return True
        if any(isinstance(x, ast.Name) and x.id == names[0] for x in ast.walk(later)):
            return False
    return False


def drop_dead(src: str) -> str:
    """``src`` (one function) without its dead assignments: a statement ``x = e`` (or ``a, b = e``)
    whose names are never read, or that is overwritten before any read, goes when evaluating ``e``
    has no effect (:func:`_pure`), and so does a function defined inside and never used, each with a
    comment written right above it that belongs to it alone
    (followed by a blank line or the block's end).  Repeated until none is left (a removal may
    leave the assignments it read dead)."""
    while True:
        lines = src.split("\n")
        fdef = ast.parse(src).body[0]
        reads = {n.id for n in ast.walk(fdef) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        pure, local = _pure_functions(fdef), _local_names(fdef)
        drop: set = set()
        for block in _own_blocks(fdef):
            gone = 0
            for i, s in enumerate(block):
                unused_def = isinstance(s, ast.FunctionDef) and not s.decorator_list and s.name not in reads
                if gone + 1 >= len(block) or not unused_def and (
                        _targets(s) is None or "_" in _targets(s) or not _pure(s.value, pure, local)
                        or not _dead(block, i, reads)):
                    continue
                gone += 1
                drop.update(range(s.lineno, s.end_lineno + 1))
                after = lines[s.end_lineno] if s.end_lineno < len(lines) else ""
                if not after.strip() or i + 1 == len(block):
                    ln = s.lineno - 1
                    while ln >= 1 and lines[ln - 1].lstrip().startswith("#"):
                        drop.add(ln)
                        ln -= 1
        if not drop:
            return src
        kept: list = []
        for i, ln in enumerate(lines, 1):    # a removal leaves no two blank lines in a row
            if i not in drop and not (not ln.strip() and i - 1 in drop and kept and not kept[-1].strip()):
                kept.append(ln)
        src = "\n".join(kept)
