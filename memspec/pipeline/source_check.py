"""The last gate before generated source is written or imported: parse it and check what
running it would do at import.

``check_source(text, spec)`` parses the module (``ast``) and walks every statement that
runs when the module is imported -- the module's top level and, recursively, class bodies
(function bodies run only when called).  Allowed there:

* imports of ``torch`` (and its submodules) and of the standard library, no ``*``;
* function definitions whose decorators are plain names (``property``), whose defaults
  are constants and whose annotations are names and attributes (``torch.Tensor``);
* class definitions with plain-name bases (``nn.Module``), no keywords (no metaclass);
* assignments of constants (literals: numbers, text, tuples, lists, dicts, ``None``,
  ``float("inf")``) to plain names;
* docstrings, ``pass``.

Anything else (a call, a loop, an ``if``, an assignment of a computed value, an import of
another package) means spec text became code, or the generator is broken: either way an
internal error, :class:`GeneratedSourceError`, raised before anything is written or
executed.  The module's top-level names must not be names the spec declares (the
generator's own names are reserved; this is the backstop).
"""
from __future__ import annotations

import ast
import sys

ALLOWED_IMPORT_ROOTS = frozenset({"torch"}) | frozenset(getattr(sys, "stdlib_module_names", ()))


class GeneratedSourceError(RuntimeError):
    """Generated source that does not parse or would do more than define things at import."""


def _where(node) -> str:
    return f"line {getattr(node, 'lineno', '?')}"


def _dotted(e) -> bool:
    while isinstance(e, ast.Attribute):
        e = e.value
    return isinstance(e, ast.Name)


def _constant(e) -> bool:
    """A literal: constants, containers of constants, -constant, float("inf"/"-inf"/"nan")."""
    if isinstance(e, ast.Constant):
        return True
    if isinstance(e, ast.UnaryOp) and isinstance(e.op, (ast.USub, ast.UAdd)):
        return _constant(e.operand)
    if isinstance(e, (ast.Tuple, ast.List, ast.Set)):
        return all(_constant(x) for x in e.elts)
    if isinstance(e, ast.Dict):
        return all(k is not None and _constant(k) for k in e.keys) and all(_constant(v) for v in e.values)
    if isinstance(e, ast.Call) and isinstance(e.func, ast.Name) and e.func.id == "float" and not e.keywords:
        return (len(e.args) == 1 and isinstance(e.args[0], ast.Constant)
                and e.args[0].value in ("inf", "-inf", "nan"))
    return False


def _annotation(e) -> bool:
    if e is None or isinstance(e, ast.Constant) or _dotted(e):
        return True
    if isinstance(e, ast.Subscript):
        return _annotation(e.value) and _annotation(e.slice)
    if isinstance(e, ast.Tuple):
        return all(_annotation(x) for x in e.elts)
    if isinstance(e, ast.BinOp) and isinstance(e.op, ast.BitOr):
        return _annotation(e.left) and _annotation(e.right)
    return False


def _check_function(node) -> None:
    for d in node.decorator_list:
        if not _dotted(d):
            raise GeneratedSourceError(f"{_where(d)}: decorator {ast.unparse(d)[:80]!r} is not a plain name")
    a = node.args
    for d in list(a.defaults) + [x for x in a.kw_defaults if x is not None]:
        if not _constant(d):
            raise GeneratedSourceError(f"{_where(d)}: default {ast.unparse(d)[:80]!r} of {node.name} is not a constant")
    for arg in a.posonlyargs + a.args + a.kwonlyargs + [x for x in (a.vararg, a.kwarg) if x is not None]:
        if not _annotation(arg.annotation):
            raise GeneratedSourceError(f"{_where(arg)}: annotation of {arg.arg} is not a plain name")
    if not _annotation(node.returns):
        raise GeneratedSourceError(f"{_where(node)}: return annotation of {node.name} is not a plain name")


def _check_body(body: list, where: str) -> list[str]:
    """The names ``body`` binds; raises for any statement that would compute at import."""
    bound: list[str] = []
    for i, node in enumerate(body):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] not in ALLOWED_IMPORT_ROOTS:
                    raise GeneratedSourceError(f"{_where(node)}: import of {alias.name!r} (only torch and the "
                                               f"standard library)")
                bound.append(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            if node.level or not node.module or node.module.split(".")[0] not in ALLOWED_IMPORT_ROOTS:
                raise GeneratedSourceError(f"{_where(node)}: import from {node.module!r} (only torch and the "
                                           f"standard library)")
            for alias in node.names:
                if alias.name == "*":
                    raise GeneratedSourceError(f"{_where(node)}: import *")
                bound.append(alias.asname or alias.name)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            _check_function(node)
            bound.append(node.name)
        elif isinstance(node, ast.ClassDef):
            if node.keywords or not all(_dotted(b) for b in node.bases):
                raise GeneratedSourceError(f"{_where(node)}: class {node.name} with computed bases or keywords")
            for d in node.decorator_list:
                if not _dotted(d):
                    raise GeneratedSourceError(f"{_where(d)}: class decorator is not a plain name")
            _check_body(node.body, f"class {node.name}")
            bound.append(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if not all(isinstance(t, ast.Name) for t in targets):
                raise GeneratedSourceError(f"{_where(node)}: assignment to {ast.unparse(node)[:80]!r}")
            if node.value is None or not _constant(node.value) or \
                    (isinstance(node, ast.AnnAssign) and not _annotation(node.annotation)):
                raise GeneratedSourceError(f"{_where(node)}: {where} assigns a computed value: "
                                           f"{ast.unparse(node)[:80]!r}")
            bound.extend(t.id for t in targets)
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            continue   # a docstring (or a bare string)
        elif isinstance(node, ast.Pass):
            continue
        else:
            raise GeneratedSourceError(f"{_where(node)}: {where} runs {type(node).__name__} at import: "
                                       f"{ast.unparse(node)[:80]!r}")
    return bound


def spec_identifiers(spec) -> set[str]:
    """Every name a spec declares or binds (dims, constants, views, gates, params, states, lets,
    temporaries, the model and its argument)."""
    names = set(spec.dims) | set(spec.constants) | set(spec.views) | set(spec.gates) | set(spec.params) | \
        set(spec.state) | set(spec.let) | {st.target for st in spec.update}
    if spec.model is not None:
        names |= {spec.model.name, spec.model.arg}
    return names


def check_source(text: str, spec=None, filename: str = "<generated>") -> ast.Module:
    """Parse generated module text and check what importing it runs (module docstring);
    raises :class:`GeneratedSourceError`.  With ``spec``, also that no top-level name of the
    module is a name the spec declares."""
    try:
        tree = ast.parse(text, filename=filename)
    except (SyntaxError, ValueError) as err:   # ValueError: NUL bytes
        raise GeneratedSourceError(f"the generated module does not parse: {err}") from None
    bound = _check_body(tree.body, "the module")
    if spec is not None:
        clash = sorted(set(bound) & spec_identifiers(spec))
        if clash:
            raise GeneratedSourceError(f"the generated module's top-level name(s) {', '.join(clash)} are also "
                                       f"names in the spec")
    return tree
