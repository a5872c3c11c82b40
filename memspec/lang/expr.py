"""The expression language: AST, parser (lark, `grammars/memspec.lark`) and printer.

Expressions are the only way a spec says what a memory computes: models, losses,
update statements, reads and gate formulas.  They are parsed, never `eval`-ed.

AST nodes are frozen dataclasses.  Each carries the :class:`~memspec.errors.Span`
it came from; spans never take part in equality, so the same expression written
in YAML and in `.mem` compares equal.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from typing import Callable, Iterator, Optional, Union

from lark import Lark, Token, Transformer, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from .errors import Diagnostic, Span, SpecError
from .limits import MAX_EXPR_CHARS, MAX_EXPR_DEPTH, MAX_NUMBER_CHARS, quote

GRAMMAR_RESOURCE = ("memspec.lang", "memspec.lark")
"""The grammar as package data: ``grammars/memspec.lark`` of the repository, linked into the
package (``memspec/lang/memspec.lark``) and shipped in the wheel (pyproject's package-data)."""

# name -> (min args, max args, description).  The fixed whitelist of functions.
FUNCTIONS: dict[str, tuple[int, int, str]] = {
    "sum": (1, 2, "sum(x): of all entries -> scalar; sum(x, d): over the axis named d"),
    "mean": (1, 2, "mean(x): of all entries -> scalar; mean(x, d): over the axis named d"),
    "sqrt": (1, 1, "elementwise square root"),
    "exp": (1, 1, "elementwise exponential"),
    "log": (1, 1, "elementwise natural logarithm"),
    "abs": (1, 1, "elementwise absolute value"),
    "sign": (1, 1, "elementwise sign"),
    "sigmoid": (1, 1, "elementwise logistic sigmoid"),
    "softplus": (1, 1, "elementwise softplus"),
    "tanh": (1, 1, "elementwise tanh"),
    "relu": (1, 1, "elementwise ReLU"),
    "gelu": (1, 1, "elementwise GELU (erf form)"),
    "silu": (1, 1, "elementwise SiLU"),
    "elu": (1, 1, "elementwise ELU"),
    "layernorm": (1, 3, "layernorm(x[, weight, bias]) over the last axis"),
    "rmsnorm": (1, 2, "rmsnorm(x[, weight]) over the last axis"),
    "l2norm": (1, 1, "x / ||x|| over the last axis"),
    "outer": (2, 2, "outer(a, b): [m] x [n] -> [m, n]"),
    "norm": (1, 2, "norm(x): Euclidean norm of all entries -> scalar; norm(x, d): over the axis named d"),
    "softmax": (2, 2, "softmax(x, d): exp(x) normalised over the axis named d"),
    "newton_schulz": (2, 2, "newton_schulz(X, steps): the quintic Newton-Schulz iteration on X / |X|_F "
                            "(Muon's orthogonalisation, ~ U V^T of X = U S V^T)"),
    "clamp": (3, 3, "clamp(x, lo, hi) elementwise"),
    "min": (2, 2, "elementwise minimum"),
    "max": (2, 2, "elementwise maximum"),
    "huber": (2, 2, "huber(x, delta): elementwise Huber penalty"),
    "solve": (2, 2, "solve(A, B) = A^-1 B for square A"),
    "cg": (3, 3, "cg(A, B, steps): steps iterations of conjugate gradients on A X = B from X = 0 (each column "
                 "of B its own iteration; a column whose residual reaches the rounding level of b stops)"),
    "eye": (1, 1, "eye(d): identity matrix [d, d]"),
    "diag": (1, 1, "diag(a) @ X scales the rows of X by the vector a, X @ diag(a) its columns (only an operand "
                   "of @: the diagonal matrix is never formed)"),
    "grad": (1, 2, "grad(loss, W): gradient of the scalar loss w.r.t. state W"),
    "attend": (4, 4, "attend(q, K, V, scale): softmax(scale * K q) V over a cache"),
    "append": (2, 2, "append(K, k): push k onto cache K"),
}

ELEMENTWISE_FUNCTIONS = frozenset(
    "sqrt exp log abs sign sigmoid softplus tanh relu gelu silu elu".split()
)


# --------------------------------------------------------------------- AST
@dataclass(frozen=True)
class Expr:
    span: Span | None = field(default=None, compare=False, repr=False, kw_only=True)

    def children(self) -> tuple["Expr", ...]:
        return ()

    def walk(self) -> Iterator["Expr"]:
        yield self
        for c in self.children():
            yield from c.walk()

    def __str__(self) -> str:
        return unparse(self)


@dataclass(frozen=True)
class Num(Expr):
    value: Union[int, float] = 0

    def __eq__(self, other):  # 1 == 1.0 on purpose; bool/int distinction does not arise
        return isinstance(other, Num) and float(self.value) == float(other.value)

    def __hash__(self):
        return hash(float(self.value))


@dataclass(frozen=True)
class Name(Expr):
    id: str = ""


@dataclass(frozen=True)
class BinOp(Expr):
    op: str = "+"  # one of + - * / @ ^
    left: Expr = None  # type: ignore[assignment]
    right: Expr = None  # type: ignore[assignment]

    def children(self):
        return (self.left, self.right)


@dataclass(frozen=True)
class Neg(Expr):
    operand: Expr = None  # type: ignore[assignment]

    def children(self):
        return (self.operand,)


@dataclass(frozen=True)
class Transpose(Expr):
    operand: Expr = None  # type: ignore[assignment]

    def children(self):
        return (self.operand,)


@dataclass(frozen=True)
class Call(Expr):
    fn: str = ""
    args: tuple[Expr, ...] = ()
    fn_span: Span | None = field(default=None, compare=False, repr=False)

    def children(self):
        return self.args


@dataclass(frozen=True)
class Assign:
    """One update statement ``target = value``."""

    target: str
    value: Expr
    span: Span | None = field(default=None, compare=False, repr=False)
    target_span: Span | None = field(default=None, compare=False, repr=False)

    def __str__(self) -> str:
        return f"{self.target} = {unparse(self.value)}"


@dataclass(frozen=True)
class FunDef:
    """The inner model ``f(u) = body``."""

    name: str
    arg: str
    body: Expr
    span: Span | None = field(default=None, compare=False, repr=False)
    name_span: Span | None = field(default=None, compare=False, repr=False)
    arg_span: Span | None = field(default=None, compare=False, repr=False)

    def __str__(self) -> str:
        return f"{self.name}({self.arg}) = {unparse(self.body)}"


def names_in(e: Expr) -> list[Name]:
    return [n for n in e.walk() if isinstance(n, Name)]


def calls_in(e: Expr) -> list[Call]:
    return [n for n in e.walk() if isinstance(n, Call)]


def is_diag(e: Expr) -> bool:
    """Is ``e`` a ``diag(a)`` call (a row / column scaling operand of ``@``)?"""
    return isinstance(e, Call) and e.fn == "diag"


# ----------------------------------------------------------------- printer
_PREC = {"+": 1, "-": 1, "*": 2, "/": 2, "@": 2, "neg": 3, "^": 4, "post": 5, "atom": 6}


def _prec(e: Expr) -> int:
    if isinstance(e, BinOp):
        return _PREC[e.op]
    if isinstance(e, Neg):
        return _PREC["neg"]
    if isinstance(e, Transpose):
        return _PREC["post"]
    if isinstance(e, Num) and (float(e.value) < 0):
        return _PREC["neg"]
    return _PREC["atom"]


def format_number(v: Union[int, float]) -> str:
    if isinstance(v, bool):
        v = int(v)
    if isinstance(v, int):
        return str(v)
    r = repr(float(v))
    if r in ("inf", "-inf"):  # `1e999` parses to inf; print it so that it parses back
        return r.replace("inf", "1e999")
    return r


def unparse(e: Expr) -> str:
    """Canonical text of an expression with minimal parentheses."""
    if isinstance(e, Num):
        return format_number(e.value)
    if isinstance(e, Name):
        return e.id
    if isinstance(e, Call):
        return f"{e.fn}({', '.join(unparse(a) for a in e.args)})"
    if isinstance(e, Transpose):
        inner = unparse(e.operand)
        if _prec(e.operand) < _PREC["post"] or isinstance(e.operand, Num):  # `2.T` would lex as `2.` `T`
            inner = f"({inner})"
        return f"{inner}.T"
    if isinstance(e, Neg):
        inner = unparse(e.operand)
        if _prec(e.operand) < _PREC["neg"]:
            inner = f"({inner})"
        return f"-{inner}"
    if isinstance(e, BinOp):
        p = _PREC[e.op]
        left, right = unparse(e.left), unparse(e.right)
        if e.op == "^":  # right-associative; operand must bind tighter than ^ on the left
            if _prec(e.left) <= p:
                left = f"({left})"
            if _prec(e.right) < _PREC["neg"]:
                right = f"({right})"
        else:  # left-associative
            if _prec(e.left) < p:
                left = f"({left})"
            if _prec(e.right) <= p:
                right = f"({right})"
        if e.op == "^":
            return f"{left}^{right}"
        return f"{left} {e.op} {right}"
    raise TypeError(f"not an expression: {e!r}")


# ------------------------------------------------------------------ parser
@lru_cache(maxsize=None)
def grammar_text() -> str:
    package, name = GRAMMAR_RESOURCE
    return resources.files(package).joinpath(name).read_text(encoding="utf-8")


@lru_cache(maxsize=None)
def parser(start: str) -> Lark:
    return Lark(
        grammar_text(),
        parser="lalr",
        lexer="contextual",
        start=start,
        propagate_positions=True,
        maybe_placeholders=True,
    )


class SourcePos:
    """Maps positions inside a parsed string to positions in the spec file.

    ``line``/``col`` is where the string's first character sits in the file; for
    multi-line text, later lines start at column ``cont_col`` (1 for `.mem` files).
    """

    def __init__(self, file: str, line: int = 1, col: int = 1, cont_col: int = 1):
        self.file, self.line, self.col, self.cont_col = file, line, col, cont_col

    def at(self, line: int, col: int, end_line: int | None = None, end_col: int | None = None) -> Span:
        def tr(ln: int, c: int) -> tuple[int, int]:
            if ln == 1:
                return self.line, self.col + c - 1
            return self.line + ln - 1, self.cont_col + c - 1

        fl, fc = tr(line, col)
        if end_line is not None and end_col is not None:
            el, ec = tr(end_line, end_col)
        else:
            el, ec = None, None
        return Span(self.file, fl, fc, el, ec)

    def of_meta(self, meta) -> Span | None:
        if getattr(meta, "empty", True):
            return None
        return self.at(meta.line, meta.column, meta.end_line, meta.end_column)

    def of_token(self, tok: Token) -> Span:
        return self.at(tok.line, tok.column, tok.end_line, tok.end_column)


def _number(text: str) -> Union[int, float]:
    t = text
    if all(ch.isdigit() for ch in t):
        return int(t)
    return float(t)


@v_args(meta=True)
class ExprBuilder(Transformer):
    """lark tree -> AST, with spans mapped through a :class:`SourcePos`."""

    def __init__(self, pos: SourcePos):
        super().__init__()
        self.pos = pos

    def _s(self, meta):
        return self.pos.of_meta(meta)

    def number(self, meta, ch):
        return Num(_number(str(ch[0])), span=self._s(meta))

    def name(self, meta, ch):
        return Name(str(ch[0]), span=self._s(meta))

    def call(self, meta, ch):
        fn = ch[0]
        args = tuple(a for a in ch[1:] if a is not None)
        return Call(str(fn), args, fn_span=self.pos.of_token(fn), span=self._s(meta))

    def _bin(self, op, meta, ch):
        return BinOp(op, ch[0], ch[1], span=self._s(meta))

    def add(self, meta, ch):
        return self._bin("+", meta, ch)

    def sub(self, meta, ch):
        return self._bin("-", meta, ch)

    def mul(self, meta, ch):
        return self._bin("*", meta, ch)

    def div(self, meta, ch):
        return self._bin("/", meta, ch)

    def matmul(self, meta, ch):
        return self._bin("@", meta, ch)

    def pow(self, meta, ch):
        return self._bin("^", meta, ch)

    def neg(self, meta, ch):
        return Neg(ch[0], span=self._s(meta))

    def transpose(self, meta, ch):
        return Transpose(ch[0], span=self._s(meta))

    def stmt(self, meta, ch):
        return Assign(str(ch[0]), ch[1], span=self._s(meta), target_span=self.pos.of_token(ch[0]))

    def fundef(self, meta, ch):
        return FunDef(
            str(ch[0]), str(ch[1]), ch[2], span=self._s(meta),
            name_span=self.pos.of_token(ch[0]), arg_span=self.pos.of_token(ch[1]),
        )


_EXPECT_NAMES = {
    "NAME": "a name",
    "NUMBER": "a number",
    "INT": "an integer",
    "SIGNED_NUMBER": "a number",
    "STRING": 'a "string"',
    "LPAR": "'('",
    "RPAR": "')'",
    "LSQB": "'['",
    "RSQB": "']'",
    "LBRACE": "'{'",
    "RBRACE": "'}'",
    "COMMA": "','",
    "EQUAL": "'='",
    "COLON": "':'",
    "PLUS": "'+'",
    "MINUS": "'-'",
    "STAR": "'*'",
    "SLASH": "'/'",
    "CIRCUMFLEX": "'^'",
    "AT": "'@'",
    "TRANSPOSE": "'.T'",
    "SEMICOLON": "';'",
}


def describe_expected(expected) -> str:
    names = []
    for e in sorted(expected):
        if e.startswith("__ANON") or e == "$END":
            continue
        names.append(_EXPECT_NAMES.get(e, repr(e.lower()) if e.isupper() else e))
    names = sorted(set(names))
    if not names:
        return ""
    if len(names) > 6:
        names = names[:6] + ["..."]
    return "expected " + ", ".join(names)


def parse_error_diagnostic(err: UnexpectedInput, text: str, pos: SourcePos, what: str) -> Diagnostic:
    """Turn a lark error into a located diagnostic."""
    line = getattr(err, "line", 1) or 1
    col = getattr(err, "column", 1) or 1
    if isinstance(err, UnexpectedToken):
        tok = err.token
        if tok.type == "$END":
            lines = text.splitlines() or [""]
            line, col = len(lines), len(lines[-1]) + 1
            msg = f"unexpected end of {what}"
            width = 1
        else:
            msg = f"unexpected {quote(str(tok))} in {what}"
            width = max(1, len(str(tok)))
        hint = describe_expected(err.expected) or None
        span = pos.at(line, col, line, col + width)
    elif isinstance(err, UnexpectedCharacters):
        ch = text[err.pos_in_stream] if err.pos_in_stream < len(text) else "?"
        msg = f"unexpected character {ch!r} in {what}"
        hint = None
        if ch in "=;:{}[]" and what == "expression":
            hint = "an expression cannot contain statements"
        elif ch == ".":
            hint = "the only '.' suffix is '.T' (transpose)"
        elif ch == "*":
            hint = "powers are written a^b"
        span = pos.at(line, col, line, col + 1)
    elif isinstance(err, UnexpectedEOF):
        lines = text.splitlines() or [""]
        msg = f"unexpected end of {what}"
        hint = describe_expected(err.expected) or None
        span = pos.at(len(lines), len(lines[-1]) + 1)
    else:  # pragma: no cover - lark has no other public error kinds
        msg, hint, span = f"cannot parse {what}", None, pos.at(line, col)
    return Diagnostic("error", msg, span, hint, code="E-parse")


EXPR_RULES = frozenset({"add", "sub", "mul", "div", "matmul", "pow", "neg", "transpose", "call", "number", "name"})
_NUMBER_TOKENS = frozenset({"NUMBER", "SIGNED_NUMBER", "INT"})
_EXPR_HOLDERS = frozenset({"let_decl", "gate_decl", "read_decl", "loss_decl", "stmt", "fundef"})


def limit_problems(tree, pos: SourcePos) -> list[Diagnostic]:
    """The limits of :mod:`memspec.lang.limits` on a parse tree, checked without recursion
    (before the recursive transformer and every later phase see it): expression length
    and nesting depth, number-literal length."""
    out: list[Diagnostic] = []
    stack = [(tree, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, Token):
            if node.type in _NUMBER_TOKENS and len(node) > MAX_NUMBER_CHARS:
                out.append(Diagnostic("error", f"number too long ({len(node)} characters; at most {MAX_NUMBER_CHARS})",
                                      pos.of_token(node), code="E-limit"))
            continue
        if node is None:
            continue
        if node.data in _EXPR_HOLDERS and not node.meta.empty and \
                node.meta.end_pos - node.meta.start_pos > MAX_EXPR_CHARS:   # `.mem`: parentheses count too
            out.append(Diagnostic("error", f"expression too long ({node.meta.end_pos - node.meta.start_pos} "
                                           f"characters; at most {MAX_EXPR_CHARS})",
                                  pos.at(node.meta.line, node.meta.column), code="E-limit",
                                  hint="name parts of it with let"))
            continue
        if node.data in EXPR_RULES:
            depth += 1
            if depth > MAX_EXPR_DEPTH:
                out.append(Diagnostic("error", f"expression nested too deeply (more than {MAX_EXPR_DEPTH} levels "
                                               f"of operators and calls)",
                                      pos.of_meta(node.meta) or pos.at(1, 1), code="E-limit",
                                      hint="name parts of it with let"))
                continue
        stack.extend((c, depth) for c in node.children)
    return out


def _parse(text: str, start: str, pos: SourcePos | None, what: str):
    pos = pos or SourcePos("<expr>")
    if len(text) > MAX_EXPR_CHARS:
        raise SpecError([Diagnostic("error", f"{what} too long ({len(text)} characters; at most {MAX_EXPR_CHARS})",
                                    pos.at(1, 1), "name parts of it with let", code="E-limit")])
    try:
        tree = parser(start).parse(text)
    except UnexpectedInput as err:
        raise SpecError([parse_error_diagnostic(err, text, pos, what)]) from None
    problems = limit_problems(tree, pos)
    if problems:
        raise SpecError(problems)
    return ExprBuilder(pos).transform(tree)


def parse_expr(text: str, pos: SourcePos | None = None) -> Expr:
    """Parse one expression, e.g. ``"0.5 * sum((f(k) - v)^2)"``."""
    return _parse(text, "expr", pos, "expression")


def parse_stmt(text: str, pos: SourcePos | None = None) -> Assign:
    """Parse one update statement, e.g. ``"W = W - eta * grad(loss, W)"``."""
    return _parse(text, "stmt", pos, "update statement")


def parse_fundef(text: str, pos: SourcePos | None = None) -> FunDef:
    """Parse the model definition, e.g. ``"f(u) = u @ W"``."""
    return _parse(text, "fundef", pos, "model definition")


def map_children(e: Expr, f: Callable[[Expr], Expr]) -> Expr:
    """``e`` rebuilt with ``f`` applied to each direct child (leaves are returned as they are)."""
    if isinstance(e, BinOp):
        return BinOp(e.op, f(e.left), f(e.right), span=e.span)
    if isinstance(e, Neg):
        return Neg(f(e.operand), span=e.span)
    if isinstance(e, Transpose):
        return Transpose(f(e.operand), span=e.span)
    if isinstance(e, Call):
        return Call(e.fn, tuple(f(a) for a in e.args), fn_span=e.fn_span, span=e.span)
    return e


def rewrite(e: Expr, visit: Callable[[Expr], Optional[Expr]]) -> Expr:
    """Top-down rewrite: where ``visit(node)`` returns an expression it replaces the node
    (not visited further); where it returns None the node's children are rewritten."""
    out = visit(e)
    if out is not None:
        return out
    return map_children(e, lambda c: rewrite(c, visit))


def substitute(e: Expr, mapping: dict[str, Expr]) -> Expr:
    """Replace free names by expressions (used to inline the model and lets)."""
    return rewrite(e, lambda n: mapping.get(n.id) if isinstance(n, Name) else None)
