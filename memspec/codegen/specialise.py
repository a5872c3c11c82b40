"""Specialising runtime functions to the arguments a module always passes.

A kernel of :mod:`memspec.runtime` handles every case its family admits (no decay, scalar
decay, inclusive or exclusive reads, ...); a generated module calls it with some arguments
fixed by the spec (``log_gamma=None`` for DeltaNet, ``inclusive=True`` ...).
:func:`specialise` returns the function's source with those parameters bound: they leave
the signature, every ``if`` whose test is then decided keeps only the branch that runs, a
decided conditional expression keeps its branch, and a local assigned once from decided
values is folded into its uses.  The rest of the source -- comments, layout, names -- is
kept line for line (a comment right above a statement that folds away goes with it), so
the specialised kernel reads like the hand-written one with the cases this module cannot
reach taken out.  Then what the folding left dead goes (:func:`drop_dead`: an assignment never
read or overwritten before it is read, a local function never called, when evaluating it has no
effect), and the docstring's ``Args:`` section loses the entries of the bound parameters.

Only what is provably decided is folded (constants, strings included, ``is None`` /
``is not None``, ``not``, ``and`` / ``or`` with a decided prefix, ``==`` / ``!=`` between
constants); a parameter or local that is assigned in a loop, a branch or a nested function
is never folded.  The tests run every specialisation of every kernel against the general one.
"""
from __future__ import annotations

import ast
import inspect
import keyword
import re
import textwrap

from .tidy import drop_dead, drop_documented

UNKNOWN = object()


def specialise(fn, **consts) -> str:
    """The source of ``fn`` with the parameters ``consts`` bound to those constants."""
    return specialise_source(source(fn), consts)


def source(fn) -> str:
    """The source of ``fn`` as a generated module carries it: a docstring reference to a function
    of its own module that ``fn`` does not use (so that the module does not carry it either) names
    it with its module (``:func:`memspec.runtime.dplr.recurrent_dplr```)."""
    src = textwrap.dedent(inspect.getsource(fn))
    module = inspect.getmodule(fn)
    if module is None:
        return src
    used = {n.id for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Name)}

    def qualify(m):
        name = m.group(2)
        other = getattr(module, name, None)
        if name == fn.__name__ or name in used or not inspect.isfunction(other) \
                or other.__module__ != module.__name__:
            return m.group(0)
        return f"{m.group(1)}{module.__name__}.{name}`"
    return re.sub(r"(:func:`)(\w+)`", qualify, src)


def specialise_source(src: str, consts: dict) -> str:
    tree = ast.parse(src)
    fdef = tree.body[0]
    if not isinstance(fdef, ast.FunctionDef):
        raise TypeError("specialise takes a function")
    params = [a.arg for a in fdef.args.posonlyargs + fdef.args.args + fdef.args.kwonlyargs]
    unknown = sorted(set(consts) - set(params))
    if unknown:
        raise TypeError(f"{fdef.name} has no parameter {', '.join(unknown)}")
    if not consts:
        return src
    assigned = _assigned_counts(fdef)
    bound = [p for p in consts if assigned.get(p, 0)]
    if bound:
        raise TypeError(f"{fdef.name} reassigns {', '.join(bound)}; it cannot be specialised on it")
    w = _Writer(src.split("\n"), assigned)
    env = dict(consts)
    out = "\n".join(w.header(fdef, consts) + w.body(fdef.body, env, drop_docstring_note=consts)) + "\n"
    out = drop_dead(out)
    left = sorted({n.id for n in ast.walk(ast.parse(out)) if isinstance(n, ast.Name)} & set(consts))
    if left:   # a use the folder did not reach (e.g. inside a loop over a tuple of parameters)
        raise TypeError(f"{fdef.name}: {', '.join(left)} still read after specialising; write each use "
                        f"as a test the folder reads (`if {left[0]} is not None:`) or a direct expression")
    return out


def _assigned_counts(node) -> dict:
    """name -> how many times it is bound anywhere inside ``node`` (targets, loops, withs, defs)."""
    counts: dict = {}
    for n in ast.walk(node):
        if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)):
            counts[n.id] = counts.get(n.id, 0) + 1
        elif isinstance(n, (ast.FunctionDef, ast.Lambda)) and n is not node:
            for a in n.args.posonlyargs + n.args.args + n.args.kwonlyargs:
                counts[a.arg] = counts.get(a.arg, 0) + 1
            if isinstance(n, ast.FunctionDef):
                counts[n.name] = counts.get(n.name, 0) + 1
    return counts


def fold(e: ast.expr, env: dict):
    """The constant value of ``e`` under ``env``, or UNKNOWN."""
    if isinstance(e, ast.Constant):
        return e.value
    if isinstance(e, ast.Name):
        return env.get(e.id, UNKNOWN)
    if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.Not):
        v = fold(e.operand, env)
        return UNKNOWN if v is UNKNOWN else (not v)
    if isinstance(e, ast.BoolOp):
        for x in e.values:
            v = fold(x, env)
            if v is UNKNOWN:
                return UNKNOWN
            if isinstance(e.op, ast.And) and not v:
                return v
            if isinstance(e.op, ast.Or) and v:
                return v
        return v
    if isinstance(e, ast.Compare) and len(e.ops) == 1:
        a, b = fold(e.left, env), fold(e.comparators[0], env)
        if a is UNKNOWN or b is UNKNOWN:
            return UNKNOWN
        op = e.ops[0]
        if isinstance(op, ast.Is):
            return a is b
        if isinstance(op, ast.IsNot):
            return a is not b
        if isinstance(op, ast.Eq):
            return a == b
        if isinstance(op, ast.NotEq):
            return a != b
    if isinstance(e, ast.IfExp):
        t = fold(e.test, env)
        if t is not UNKNOWN:
            return fold(e.body if t else e.orelse, env)
    return UNKNOWN


def _atomic(e: ast.expr, env: dict) -> bool:
    """Does ``e`` fold to a literal, or to one of its branches that needs no parentheses?"""
    if fold(e, env) is not UNKNOWN:
        return True
    if isinstance(e, ast.IfExp) and fold(e.test, env) is not UNKNOWN:
        inner = e.body if fold(e.test, env) else e.orelse
        return isinstance(inner, (ast.Name, ast.Constant, ast.Call, ast.Attribute, ast.Subscript)) or _atomic(inner, env)
    return False


def _unwrap(text: str, a: int, b: int, atomic: bool) -> tuple[int, int]:
    """The span ``text[a:b]`` widened over the parentheses around it when what replaces it is
    atomic (``("lam" if x else "lamp")`` -> ``'lam'``), unless they are a call's."""
    if atomic and a >= 1 and b < len(text) and text[a - 1] == "(" and text[b] == ")":
        before = text[:a - 1].rstrip()
        word = before.split()[-1] if before.split() else ""
        call = bool(before) and (before[-1] in "_)]" or before[-1].isalnum()) and not keyword.iskeyword(word)
        if not call:
            return a - 1, b + 1
    return a, b


def _is_bool(e: ast.expr) -> bool:
    """Is ``e`` surely a bool (a comparison, a ``not``, a chain of those)?"""
    if isinstance(e, (ast.Compare, ast.UnaryOp)) and not (isinstance(e, ast.UnaryOp) and not isinstance(e.op, ast.Not)):
        return True
    return isinstance(e, ast.BoolOp) and all(_is_bool(x) for x in e.values)


class _Writer:
    def __init__(self, lines: list, assigned: dict):
        self.lines = lines
        self.assigned = assigned

    # -------------------------------------------------------------- text of nodes
    def seg(self, node) -> str:
        """The source of an expression node (one or more lines joined as they are)."""
        return ast.get_source_segment("\n".join(self.lines), node)

    def _expr(self, e: ast.expr, env: dict) -> str:
        v = fold(e, env)
        if v is not UNKNOWN and isinstance(v, (bool, int, float, str, type(None))):
            return repr(v)
        if isinstance(e, ast.IfExp):
            t = fold(e.test, env)
            if t is not UNKNOWN:
                inner = e.body if t else e.orelse
                text = self._expr(inner, env)
                return text if fold(inner, env) is not UNKNOWN else self._paren(inner, text)
        if isinstance(e, ast.BoolOp):
            kept = []
            stop = UNKNOWN    # a decided operand that ends the chain (False in an and, True in an or)
            for x in e.values:
                v = fold(x, env)
                if v is UNKNOWN:
                    kept.append(x)
                elif isinstance(e.op, ast.And) and v:
                    continue          # True and x -> x
                elif isinstance(e.op, ast.Or) and not v:
                    continue          # False or x -> x
                else:
                    stop = v
                    break
            if stop is not UNKNOWN:
                if all(_is_bool(x) for x in kept):   # x and False -> False, x or True -> True
                    return repr(stop)
                op = " and " if isinstance(e.op, ast.And) else " or "
                return op.join([self._paren(x, self._expr(x, env)) for x in kept] + [repr(stop)])
            if len(kept) == 1 and len(kept) != len(e.values):
                return self._paren(kept[0], self._expr(kept[0], env))
        return self._substitute(e, env)

    def _paren(self, node, text: str) -> str:
        atomic = isinstance(node, (ast.Name, ast.Constant, ast.Call, ast.Attribute, ast.Subscript))
        return text if atomic else f"({text})"

    def _substitute(self, e: ast.expr, env: dict) -> str:
        """The source of ``e`` with decided sub-expressions replaced (by column, right to left)."""
        text = self.seg(e)
        edits = []
        for sub in self._decided_children(e, env):
            edits.append((sub, self._expr(sub, env)))
        if not edits:
            return text
        base_line, base_col = e.lineno, e.col_offset
        src_lines = text.split("\n")

        def offset(line, col):
            if line == base_line:
                return col - base_col
            return sum(len(ln) + 1 for ln in src_lines[:line - base_line]) + col

        for sub, rep in sorted(edits, key=lambda x: (x[0].lineno, x[0].col_offset), reverse=True):
            a, b = offset(sub.lineno, sub.col_offset), offset(sub.end_lineno, sub.end_col_offset)
            a, b = _unwrap(text, a, b, _atomic(sub, env))
            text = text[:a] + rep + text[b:]
        return text

    def _decided_children(self, e: ast.expr, env: dict):
        """The outermost sub-expressions of ``e`` that fold or hold a decided conditional."""
        out = []
        for child in ast.iter_child_nodes(e):
            if not isinstance(child, ast.expr):
                continue
            if isinstance(child, (ast.Lambda,)):
                continue
            if self._touched(child, env):
                if fold(child, env) is not UNKNOWN or isinstance(child, (ast.IfExp, ast.BoolOp)):
                    out.append(child)
                else:
                    out.extend(self._decided_children(child, env))
        return out

    def _touched(self, e: ast.expr, env: dict) -> bool:
        return any(isinstance(n, ast.Name) and n.id in env and isinstance(n.ctx, ast.Load) for n in ast.walk(e))

    # -------------------------------------------------------------- statements
    def header(self, fdef: ast.FunctionDef, consts: dict) -> list:
        args = fdef.args
        keep = ast.arguments(posonlyargs=[], args=[], vararg=args.vararg, kwonlyargs=[], kw_defaults=[],
                             kwarg=args.kwarg, defaults=[])
        positional = args.posonlyargs + args.args
        defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
        for a, d in zip(positional, defaults):
            if a.arg not in consts:
                keep.args.append(a)
                if d is not None:
                    keep.defaults.append(d)
                elif keep.defaults:
                    raise TypeError("a parameter without a default after one with a default")
        for a, d in zip(args.kwonlyargs, args.kw_defaults):
            if a.arg not in consts:
                keep.kwonlyargs.append(a)
                keep.kw_defaults.append(d)
        sig = ast.unparse(keep)
        returns = f" -> {ast.unparse(fdef.returns)}" if fdef.returns else ""
        decorators = [f"@{ast.unparse(d)}" for d in fdef.decorator_list]
        return decorators + [f"def {fdef.name}({sig}){returns}:"]

    def gap(self, start: int, end: int) -> list:
        """Lines start..end-1 (1-based): the comments and blank lines between statements."""
        return self.lines[start - 1:end - 1]

    def stmt_lines(self, node) -> list:
        return self.lines[node.lineno - 1:node.end_lineno]

    def body(self, stmts: list, env: dict, dedent: int = 0, drop_docstring_note=None) -> list:
        out: list = []
        prev_end = None
        for i, node in enumerate(stmts):
            start = self._first_line(node)
            gap = [_dedent(ln, dedent) for ln in self.gap(prev_end + 1, start)] if prev_end is not None else []
            lines = self.stmt(node, env, dedent, note=drop_docstring_note if i == 0 else None)
            if not lines:   # a statement folded away takes the comment written right above it along
                while gap and gap[-1].lstrip().startswith("#"):
                    gap.pop()
            out += gap + lines
            prev_end = node.end_lineno
        return out

    def _first_line(self, node) -> int:
        decos = getattr(node, "decorator_list", None)
        return min([node.lineno] + [d.lineno for d in decos]) if decos else node.lineno

    def stmt(self, node, env: dict, dedent: int, note=None) -> list:
        if note is not None and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) \
                and isinstance(node.value.value, str):
            return self.docstring(node, note, dedent)
        if isinstance(node, ast.If):
            t = fold(node.test, env)
            if t is not UNKNOWN:
                branch = node.body if t else node.orelse
                if not branch:
                    return []
                if not t and self._is_elif(node):   # the elif chain goes on as an if
                    return self.stmt(node.orelse[0], env, dedent)
                return self.body(branch, env, dedent + 4)
            return self.if_(node, env, dedent)
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            v = fold(node.value, env)
            if v is not UNKNOWN and self.assigned.get(name) == 1 and isinstance(v, (bool, str, type(None))):
                env[name] = v      # folded into its uses
                return []
        if isinstance(node, (ast.For, ast.While, ast.With, ast.FunctionDef, ast.Try)):
            inner = {k: v for k, v in env.items() if not self._binds(node, k)}
            return self.compound(node, inner, dedent)
        return self.simple(node, env, dedent)

    def _binds(self, node, name: str) -> bool:
        return name in _assigned_counts(node) or (
            isinstance(node, ast.FunctionDef) and name in [a.arg for a in node.args.args + node.args.kwonlyargs])

    def docstring(self, node, consts: dict, dedent: int) -> list:
        lines = [_dedent(ln, dedent) for ln in self.stmt_lines(node)]
        bound = ", ".join(f"{k}={v!r}" for k, v in consts.items())
        last = lines[-1]
        indent = last[:len(last) - len(last.lstrip())] if len(lines) > 1 else \
            " " * (len(lines[0]) - len(lines[0].lstrip()))
        closing = last.rstrip()
        assert closing.endswith('"""'), "docstrings use triple double quotes"
        text = closing[:-3]
        lines = drop_documented(lines[:-1], set(consts)) + lines[-1:]
        if len(lines) == 1:
            return [text.rstrip(), "", f"{indent}Specialised for this module: {bound}.", f'{indent}"""']
        body = lines[:-1] + ([text] if text.strip() else [])
        return body + ["", f"{indent}Specialised for this module: {bound}.", f'{indent}"""']

    def simple(self, node, env: dict, dedent: int) -> list:
        lines = self.stmt_lines(node)
        if not any(self._touched(e, env) for e in ast.walk(node) if isinstance(e, ast.expr)):
            return [_dedent(ln, dedent) for ln in lines]
        # rewrite the decided expressions inside the statement, by position
        text = "\n".join(lines)
        tops = self._decided_children_stmt(node, env)
        whole = getattr(node, "value", None)   # the statement's whole value needs no parentheses
        for sub in sorted(tops, key=lambda s: (s.lineno, s.col_offset), reverse=True):
            rep = self._expr(sub, env)
            if sub is whole and rep.startswith("(") and rep.endswith(")") and _balanced(rep[1:-1]):
                rep = rep[1:-1]
            a = _offset(lines, node.lineno, sub.lineno, sub.col_offset)
            b = _offset(lines, node.lineno, sub.end_lineno, sub.end_col_offset)
            a, b = _unwrap(text, a, b, _atomic(sub, env))
            text = text[:a] + rep + text[b:]
        return [_dedent(ln, dedent) for ln in text.split("\n")]

    def _decided_children_stmt(self, node, env: dict) -> list:
        out = []
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.expr):
                if self._touched(child, env):
                    if fold(child, env) is not UNKNOWN or isinstance(child, (ast.IfExp, ast.BoolOp)):
                        out.append(child)
                    else:
                        out.extend(self._decided_children(child, env))
            elif isinstance(child, (ast.keyword, ast.arg, ast.comprehension)):
                out.extend(self._decided_children_stmt(child, env))
        return out

    def if_(self, node: ast.If, env: dict, dedent: int, chained: bool = False) -> list:
        """An undecided ``if`` (``chained``: an ``elif`` that goes on the chain written before it)."""
        head = "\n".join(self.lines[node.lineno - 1:self._first_line(node.body[0]) - 1])
        if head.lstrip().startswith("elif") and not chained:   # an elif whose chain head was decided false
            head = head.replace("elif", "if", 1)
        test_text = self.seg(node.test)
        new_test = self._expr(node.test, env) if self._touched(node.test, env) else test_text
        out = [_dedent(ln, dedent) for ln in head.replace(test_text, new_test, 1).split("\n")]
        out += self.body(node.body, env, dedent)
        if node.orelse:
            gap = self.gap(node.body[-1].end_lineno + 1, self._first_line(node.orelse[0]))
            if self._is_elif(node):
                sub = node.orelse[0]
                t = fold(sub.test, env)
                out += [_dedent(ln, dedent) for ln in gap]
                if t is True:
                    out.append(_dedent(self._else_line(node, sub), dedent))
                    out += self.body(sub.body, env, dedent)
                elif t is False:
                    if sub.orelse:
                        out += self._elif_rest(sub, env, dedent)
                else:
                    out += self.if_(sub, env, dedent, chained=True)
            else:
                out += [_dedent(ln, dedent) for ln in gap]
                out += self.body(node.orelse, env, dedent)
        return out

    def _is_elif(self, node: ast.If) -> bool:
        return len(node.orelse) == 1 and isinstance(node.orelse[0], ast.If) and \
            self.lines[node.orelse[0].lineno - 1].lstrip().startswith("elif")

    def _else_line(self, node, sub) -> str:
        line = self.lines[sub.lineno - 1]
        indent = line[:len(line) - len(line.lstrip())]
        return f"{indent}else:"

    def _elif_rest(self, sub: ast.If, env: dict, dedent: int) -> list:
        """The ``else`` / ``elif`` part after a decided-false ``elif``, attached to the chain."""
        gap = self.gap(sub.body[-1].end_lineno + 1, self._first_line(sub.orelse[0]))
        return [_dedent(ln, dedent) for ln in gap] + self.body(sub.orelse, env, dedent)

    def compound(self, node, env: dict, dedent: int) -> list:
        """A loop, with, try or nested def: its header as written, its bodies specialised."""
        out: list = []
        blocks = [b for b in ("body", "orelse", "handlers", "finalbody") if getattr(node, b, None)]
        first_body = getattr(node, blocks[0])
        out += [_dedent(ln, dedent) for ln in self.lines[self._first_line(node) - 1:self._first_line(first_body[0]) - 1]]
        prev = None
        for b in blocks:
            stmts = getattr(node, b)
            if prev is not None:
                out += [_dedent(ln, dedent) for ln in self.gap(prev + 1, self._first_line(stmts[0]))]
            if b == "handlers":
                for h in stmts:
                    out += [_dedent(ln, dedent) for ln in self.lines[h.lineno - 1:h.body[0].lineno - 1]]
                    out += self.body(h.body, env, dedent)
            else:
                out += self.body(stmts, env, dedent)
            prev = stmts[-1].end_lineno
        return out


def _balanced(text: str) -> bool:
    """``text`` has no bracket that closes before it opens (so ``(text)`` may drop its parentheses)."""
    depth = 0
    for ch in text:
        depth += (ch in "([{") - (ch in ")]}")
        if depth < 0:
            return False
    return depth == 0


def _offset(lines: list, first: int, line: int, col: int) -> int:
    return sum(len(ln) + 1 for ln in lines[:line - first]) + col


def _dedent(line: str, n: int) -> str:
    if not n or not line.strip():
        return line if line.strip() else ""
    assert line[:n].strip() == "", f"cannot dedent {line!r} by {n}"
    return line[n:]


def specialise_calls(code: str, fn) -> tuple[str, str]:
    """Specialise ``fn`` to the constant arguments every call of it in ``code`` passes: ``code``
    is a (specialised) runtime kernel's source, ``fn`` one of the private functions it calls --
    library source, read as the specialiser reads it; the generated module's own kernel calls stay
    structures until it is written (:mod:`memspec.codegen.calls`).

    A parameter is bound when every call passes the same constant (None, True, False, a string)
    for it, or none passes it and its default is such a constant.  Returns ``(code, source)``:
    the code with those arguments taken out of every call, and the specialised source of
    ``fn`` (its general source when nothing is bound or nothing calls it)."""
    sig = inspect.signature(fn)
    tree = ast.parse(code)
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
             and n.func.id == fn.__name__]
    if not calls or any(isinstance(a, ast.Starred) for c in calls for a in c.args) \
            or any(k.arg is None for c in calls for k in c.keywords):
        return code, source(fn)
    per_call = []
    for c in calls:
        bound = sig.bind(*c.args, **{k.arg: k.value for k in c.keywords})
        per_call.append(bound.arguments)
    consts: dict = {}
    for name, p in sig.parameters.items():
        values = set()
        for args in per_call:
            node = args.get(name, UNKNOWN)
            if node is UNKNOWN:
                values.add(("default", p.default) if p.default is not inspect.Parameter.empty else ("none",))
            elif isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (bool, str))):
                values.add(("const", node.value))
            else:
                values.add(("expr",))
        if len(values) == 1:
            (kind, *v), = values
            if kind in ("const", "default") and (v[0] is None or isinstance(v[0], (bool, str))):
                consts[name] = v[0]
    if not consts:
        return code, source(fn)
    lines = code.split("\n")
    for c, args in sorted(zip(calls, per_call), key=lambda x: (x[0].lineno, x[0].col_offset), reverse=True):
        kept = []   # positions shift with the parameters the specialised signature drops
        for name, node in args.items():
            if name in consts:
                continue
            text = ast.get_source_segment(code, node)
            kept.append(f"{name}={text}" if any(k.arg == name for k in c.keywords) else text)
        new = f"{fn.__name__}({', '.join(kept)})"
        a = _offset(lines, 1, c.lineno, c.col_offset)
        b = _offset(lines, 1, c.end_lineno, c.end_col_offset)
        code = code[:a] + new + code[b:]
        lines = code.split("\n")
    return code, specialise(fn, **consts)

