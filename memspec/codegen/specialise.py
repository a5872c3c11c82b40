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

A kernel's private functions (its phases) are specialised with it (:func:`specialise_calls`): each
to the constant arguments every call of it passes, read in the specialised sources of its callers,
and the writer itself writes each call of such a function without those arguments
(:func:`specialise_source`'s ``drop``), its other arguments through the same path as any folded
expression -- wherever the call stands: nested in an expression, spread over lines, in a loop's
header, in another phase.  Text is written once, by the writer; nothing it wrote is read back and
edited.
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


def source(fn, carried=None) -> str:
    """The source of ``fn`` as a generated module carries it: a docstring reference to a function
    (or class) of its own module that ``fn`` does not use (so that the module does not carry it either) -- or,
    given the names ``carried``, one the module does not carry -- names it with its module
    (``:func:`memspec.runtime.dplr.recurrent_dplr```)."""
    src = textwrap.dedent(inspect.getsource(fn))
    module = inspect.getmodule(fn)
    if module is None:
        return src
    used = {n.id for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Name)} if carried is None else carried

    def qualify(m):
        name = m.group(2)
        other = getattr(module, name, None)
        if name == fn.__name__ or name in used or not (inspect.isfunction(other) or inspect.isclass(other)) \
                or other.__module__ != module.__name__:
            return m.group(0)
        return f"{m.group(1)}{module.__name__}.{name}`"
    return re.sub(r"(:(?:func|class):`)(\w+)`", qualify, src)


def specialise_source(src: str, consts: dict, drop: dict | None = None) -> str:
    """The source ``src`` of one function with the parameters ``consts`` bound to those constants,
    and every call of a function in ``drop`` (function -> the names of the parameters its specialised
    copy no longer has) written without those arguments.  With nothing bound the docstring, the
    signature and the statements without such a call stay as written, and nothing is tidied away."""
    tree = ast.parse(src)
    fdef = tree.body[0]
    if not isinstance(fdef, ast.FunctionDef) and not (isinstance(fdef, ast.ClassDef) and not consts):
        raise TypeError("specialise takes a function (or a class, with nothing bound)")
    params = [a.arg for a in fdef.args.posonlyargs + fdef.args.args + fdef.args.kwonlyargs] if consts else []
    unknown = sorted(set(consts) - set(params))
    if unknown:
        raise TypeError(f"{fdef.name} has no parameter {', '.join(unknown)}")
    drop = {f.__name__: (inspect.signature(f), frozenset(names)) for f, names in (drop or {}).items() if names}
    if not consts and not any(_dropped_call(n, drop) for n in ast.walk(fdef)):
        return src
    assigned = _assigned_counts(fdef)
    bound = [p for p in consts if assigned.get(p, 0)]
    if bound:
        raise TypeError(f"{fdef.name} reassigns {', '.join(bound)}; it cannot be specialised on it")
    w = _Writer(src.split("\n"), assigned, drop)
    env = dict(consts)
    head = w.header(fdef, consts) if consts else w.lines[w._first_line(fdef) - 1:w._first_line(fdef.body[0]) - 1]
    out = "\n".join(head + w.body(fdef.body, env, drop_docstring_note=consts or None)) + "\n"
    if not consts:   # only calls lost constant arguments: nothing folded, nothing left dead
        return out
    out = drop_dead(out)
    left = sorted({n.id for n in ast.walk(ast.parse(out)) if isinstance(n, ast.Name)} & set(consts))
    if left:   # a use the folder did not reach (e.g. inside a loop over a tuple of parameters)
        raise TypeError(f"{fdef.name}: {', '.join(left)} still read after specialising; write each use "
                        f"as a test the folder reads (`if {left[0]} is not None:`) or a direct expression")
    return out


def _dropped_call(node, drop: dict) -> bool:
    """Is ``node`` a call of a function of ``drop`` (name -> (signature, dropped parameters))?"""
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in drop


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
    """Writes one function's specialised source: the statements it keeps, line for line, with each
    decided sub-expression (and each call of a function in ``drop``) written anew in its place."""

    def __init__(self, lines: list, assigned: dict, drop: dict | None = None):
        self.lines = lines
        self.assigned = assigned
        self.drop = drop or {}    # function name -> (its signature, the parameters its calls lose)

    # -------------------------------------------------------------- text of nodes
    def seg(self, node) -> str:
        """The source of an expression node (one or more lines joined as they are; columns count
        UTF-8 bytes, as :func:`ast.get_source_segment` reads them)."""
        first, last = node.lineno - 1, node.end_lineno - 1
        if first == last:
            return self.lines[first].encode()[node.col_offset:node.end_col_offset].decode()
        return "\n".join([self.lines[first].encode()[node.col_offset:].decode()] + self.lines[first + 1:last]
                         + [self.lines[last].encode()[:node.end_col_offset].decode()])

    def _expr(self, e: ast.expr, env: dict) -> str:
        if _dropped_call(e, self.drop):
            return self._call(e, env)
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

    def _call(self, c: ast.Call, env: dict) -> str:
        """A call of a function of ``drop``, written without the arguments of its dropped
        parameters; the others in the order written, each through :meth:`_expr`."""
        name = c.func.id
        sig, dropped = self.drop[name]
        if any(isinstance(a, ast.Starred) for a in c.args) or any(k.arg is None for k in c.keywords):
            raise TypeError(f"a call of {name} unpacks its arguments: its parameters cannot be dropped")
        try:
            bound = sig.bind(*c.args, **{k.arg: k.value for k in c.keywords})
        except TypeError as err:
            raise TypeError(f"a call of {name} does not fit its signature: {err}") from None
        param = {id(node): p for p, node in bound.arguments.items()}
        parts = [self._arg(a, env) for a in c.args if param[id(a)] not in dropped]
        parts += [f"{k.arg}={self._arg(k.value, env)}" for k in c.keywords if k.arg not in dropped]
        return f"{name}({', '.join(parts)})"

    def _arg(self, e: ast.expr, env: dict) -> str:
        """An argument of a call written anew: parentheses around it are a call's own."""
        text = self._expr(e, env) if self._touched(e, env) else self.seg(e)
        grouped = text.startswith("(") and text.endswith(")") and _balanced(text[1:-1])
        return text[1:-1] if grouped and not isinstance(e, (ast.Tuple, ast.GeneratorExp)) else text

    def _paren(self, node, text: str) -> str:
        atomic = isinstance(node, (ast.Name, ast.Constant, ast.Call, ast.Attribute, ast.Subscript))
        return text if atomic else f"({text})"

    def _substitute(self, e: ast.expr, env: dict) -> str:
        """The source of ``e`` with decided sub-expressions replaced (by column, right to left)."""
        text = self.seg(e)
        edits = [(sub, self._expr(sub, inner), _atomic(sub, inner)) for sub, inner in self._decided_children(e, env)]
        if not edits:
            return text
        base_line, base_col = e.lineno, e.col_offset
        src_lines = text.split("\n")

        def offset(line, col):
            if line == base_line:
                return col - base_col
            return sum(len(ln) + 1 for ln in src_lines[:line - base_line]) + col

        for sub, rep, atomic in sorted(edits, key=lambda x: (x[0].lineno, x[0].col_offset), reverse=True):
            a, b = offset(sub.lineno, sub.col_offset), offset(sub.end_lineno, sub.end_col_offset)
            a, b = _unwrap(text, a, b, atomic)
            text = text[:a] + rep + text[b:]
        return text

    def _decided_children(self, e, env: dict) -> list:
        """(node, env) for the outermost sub-expressions of ``e`` (an expression, or a statement's
        parts) that fold, hold a decided conditional or are a call of a function of ``drop`` (inside a
        lambda: under ``env`` less its parameters)."""
        out = []
        for child in ast.iter_child_nodes(e):
            if isinstance(child, ast.Lambda):
                a = child.args
                own = {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg] if x}
                out += self._decided(child.body, {k: v for k, v in env.items() if k not in own})
            elif isinstance(child, ast.expr):
                out += self._decided(child, env)
            elif isinstance(child, (ast.keyword, ast.comprehension, ast.withitem, ast.arg)):
                out += self._decided_children(child, env)
        return out

    def _decided(self, e: ast.expr, env: dict) -> list:
        """[(e, env)] when :meth:`_expr` writes ``e`` anew, else its decided sub-expressions."""
        if not self._touched(e, env):
            return []
        if _dropped_call(e, self.drop) or fold(e, env) is not UNKNOWN or isinstance(e, (ast.IfExp, ast.BoolOp)):
            return [(e, env)]
        return self._decided_children(e, env)

    def _touched(self, e, env: dict) -> bool:
        """Does ``e`` read a decided name or call a function of ``drop``?"""
        return any(isinstance(n, ast.Name) and n.id in env and isinstance(n.ctx, ast.Load)
                   or _dropped_call(n, self.drop) for n in ast.walk(e))

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
        if not self._touched(node, env):
            return [_dedent(ln, dedent) for ln in lines]
        tops = self._decided_children(node, env)
        return [_dedent(ln, dedent) for ln in self._rewrite(lines, node.lineno, tops, getattr(node, "value", None))]

    def _rewrite(self, lines: list, first: int, tops: list, whole=None) -> list:
        """``lines`` (from line ``first``) with each (node, env) of ``tops`` written anew in its place
        (by position, last first); ``whole``, a statement's whole value, needs no parentheses."""
        text = "\n".join(lines)
        for sub, env in sorted(tops, key=lambda s: (s[0].lineno, s[0].col_offset), reverse=True):
            rep = self._expr(sub, env)
            if sub is whole and rep.startswith("(") and rep.endswith(")") and _balanced(rep[1:-1]):
                rep = rep[1:-1]
            a = _offset(lines, first, sub.lineno, sub.col_offset)
            b = _offset(lines, first, sub.end_lineno, sub.end_col_offset)
            a, b = _unwrap(text, a, b, _atomic(sub, env))
            text = text[:a] + rep + text[b:]
        return text.split("\n")

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
        """A loop, with, try or nested def: its header as written (but for the calls of functions of
        ``drop``), its bodies specialised."""
        out: list = []
        blocks = [b for b in ("body", "orelse", "handlers", "finalbody") if getattr(node, b, None)]
        first_body = getattr(node, blocks[0])
        start = self._first_line(node)
        head = self.lines[start - 1:self._first_line(first_body[0]) - 1]
        calls = [(c, env) for e in _header(node) for c in ast.walk(e) if _dropped_call(c, self.drop)]
        calls = [(c, e) for c, e in calls if not any(o is not c and _within(c, o) for o, _ in calls)]
        out += [_dedent(ln, dedent) for ln in self._rewrite(head, start, calls)]
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


def _header(node) -> list:
    """The expressions written in a compound statement's header (what a loop iterates, a while's
    test, a with's items, a nested def's decorators and defaults)."""
    if isinstance(node, ast.For):
        return [node.target, node.iter]
    if isinstance(node, ast.While):
        return [node.test]
    if isinstance(node, ast.With):
        return [e for i in node.items for e in (i.context_expr, i.optional_vars) if e is not None]
    if isinstance(node, ast.FunctionDef):
        return node.decorator_list + node.args.defaults + [d for d in node.args.kw_defaults if d is not None]
    return []


def _within(inner, outer) -> bool:
    """Does node ``outer``'s span hold node ``inner``'s?"""
    return (outer.lineno, outer.col_offset) <= (inner.lineno, inner.col_offset) and \
        (inner.end_lineno, inner.end_col_offset) <= (outer.end_lineno, outer.end_col_offset)


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


def specialise_calls(kernel, consts: dict, reach) -> list:
    """The sources a generated module carries for ``kernel`` called with the constant arguments
    ``consts``: the kernel specialised to them, then the private functions of its module it calls,
    in their order in the module.  ``reach(source)`` names the functions a (specialised) source
    calls that the module carries this way; a function they call is reached in turn.

    Each function is specialised to the constant arguments every call of it passes, read in the
    specialised sources of its callers (:func:`constant_arguments`), and every call of it -- in the
    kernel and in the other functions, several calls, calls nested in expressions or spread over
    lines alike -- is written without those arguments by the specialiser itself
    (:func:`specialise_source`'s ``drop``).  A function also named other than in calls (passed on as
    a value), one that calls itself, directly or through others, and what only such a one reaches,
    stay general, as does a class (an autograd function: only its calls lose constant arguments)."""
    general: dict = {}

    def original(fn) -> str:
        if fn not in general:
            general[fn] = source(fn)
        return general[fn]

    first = specialise_source(original(kernel), consts)   # what the calls pass, once the kernel is folded
    texts, bound, reached, uses = {kernel: first}, {kernel: dict(consts)}, {kernel: reach(first)}, {}
    ordered, cyclic = _callers_first(reached[kernel], lambda fn: reach(original(fn)))
    for fn in ordered + cyclic * len(cyclic):   # a cycle: each pass over it reaches one more at least
        callers = [c for c in reached if fn in reached[c]]
        if fn in bound or not callers:   # not (yet) reached from what specialising kept
            continue
        for c in callers:
            uses.setdefault(c, _uses(texts[c]))
        calls = [n for c in callers for n in uses[c][0].get(fn.__name__, [])]
        named = sum(uses[c][1].get(fn.__name__, 0) for c in callers)
        bound[fn] = constant_arguments(fn, calls) if fn not in cyclic and len(calls) == named \
            and not inspect.isclass(fn) else {}
        texts[fn] = specialise_source(original(fn), bound[fn])
        reached[fn] = reach(texts[fn])
    drop = {fn: frozenset(b) for fn, b in bound.items() if fn is not kernel and b}
    own = sorted((fn for fn in bound if fn is not kernel), key=_first_line)
    # a docstring's reference to a function of the module that specialising left uncarried names its module
    carried = {fn.__name__ for fn in bound} | {n for c, t in texts.items() for n in uses.setdefault(c, _uses(t))[1]}
    out = []
    for fn in [kernel] + own:
        text = source(fn, carried)
        out.append(specialise_source(text, bound[fn], drop)
                   if text != original(fn) or any(g in drop for g in reached[fn]) else texts[fn])
    return out


def _uses(text: str) -> tuple[dict, dict]:
    """The calls in ``text`` of a plain name (name -> its ``ast.Call`` nodes), and how often each
    name is read at all."""
    calls: dict = {}
    names: dict = {}
    for n in ast.walk(ast.parse(text)):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name):
            calls.setdefault(n.func.id, []).append(n)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load):
            names[n.id] = names.get(n.id, 0) + 1
    return calls, names


def _callers_first(start: list, calls_of) -> tuple[list, list]:
    """The functions ``start`` and what they call (``calls_of(fn)``, read in its general source),
    each after every one that calls it; then those on a cycle of calls and what they reach, in their
    order in the module."""
    calls, todo = {}, list(start)
    while todo:
        fn = todo.pop()
        if fn not in calls:
            calls[fn] = list(dict.fromkeys(calls_of(fn)))   # itself too, when it recurses
            todo += calls[fn]
    waiting = {fn: sum(fn in callees for callees in calls.values()) for fn in calls}
    ready = sorted((fn for fn, n in waiting.items() if n == 0), key=_first_line)
    ordered = []
    while ready:
        fn = ready.pop(0)
        ordered.append(fn)
        for g in calls[fn]:
            waiting[g] -= 1
            if waiting[g] == 0:
                ready.append(g)
    rest = sorted(set(calls) - set(ordered), key=_first_line)
    return ordered, rest


def _first_line(fn) -> int:
    """The line a function (or class) starts at in its module."""
    return fn.__code__.co_firstlineno if inspect.isfunction(fn) else inspect.getsourcelines(fn)[1]


def constant_arguments(fn, calls: list) -> dict:
    """The parameters of ``fn`` that every call of ``calls`` (``ast.Call`` nodes) passes the same
    constant (None, True, False, a string) -- or none passes and their default is such a constant --
    with those constants; none when no call is given or one unpacks its arguments."""
    sig = inspect.signature(fn)
    if not calls or any(isinstance(a, ast.Starred) for c in calls for a in c.args) \
            or any(k.arg is None for c in calls for k in c.keywords):
        return {}
    per_call = [sig.bind(*c.args, **{k.arg: k.value for k in c.keywords}).arguments for c in calls]
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
    return consts
