"""`.mem` frontend: parse the spec language (`grammars/memspec.lark`) into a RawSpec.

A `.mem` file is a sequence of declarations::

    memory deltanet
    dims { d_model = 64, heads = 2, d_k = 32, d_v = 32 }
    view q : d_k
    gate eta = sigmoid(logit)
    state W : [d_k, d_v] = zeros
    model f(u) = u @ W
    loss = 0.5 * sum((f(k) - v)^2)
    update { W = W - eta * grad(loss, W) }
    read = f(q)
"""
from __future__ import annotations

import json

from lark import Token
from lark.exceptions import UnexpectedInput

from ..errors import Collector, Span
from ..limits import quote
from ..expr import ExprBuilder, SourcePos, limit_problems, parse_error_diagnostic, parser
from .raw import RawSpec

_SINGLE = {
    "memory_decl": "name",
    "description_decl": "description",
    "cite_decl": "cite",
    "extends_decl": "extends",
    "loss_decl": "loss",
    "read_decl": "read",
    "order_decl": "order",
    "schedule_decl": "schedule",
    "wiring_decl": "wiring",
    "model_decl": "model",
    "update_decl": "update",
    "dims_decl": "dims",
}
_DROP_KINDS = {"view": "views", "gate": "gates", "state": "state", "param": "params", "let": "let",
               "const": "constants", "dim": "dims"}


STRING_ESCAPES = '\\" \\\\ \\/ \\b \\f \\n \\r \\t \\uXXXX'


class _BadString(Exception):
    def __init__(self, offset: int, message: str):
        super().__init__(message)
        self.offset, self.message = offset, message


def _unquote(tok: Token) -> str:
    """The text of a STRING token: JSON's escapes (what ``memspec fmt`` writes), nothing else."""
    s = str(tok)
    try:
        return json.loads(s, strict=False)
    except json.JSONDecodeError as err:
        i = err.pos if s[err.pos:err.pos + 1] == "\\" else max(0, err.pos - 1)
        j = i + 2
        while s[i + 1:i + 2] == "u" and j < i + 6 and j < len(s) and s[j] in "0123456789abcdefABCDEF":
            j += 1
        esc = s[i:j]
        raise _BadString(i, f"invalid escape {esc} in a string") from None
    except RecursionError:  # pragma: no cover - a STRING token is flat
        raise _BadString(0, "invalid string") from None


def _number(tok: Token):
    s = str(tok)
    try:
        return int(s)
    except ValueError:
        return float(s)


def _init_text(t) -> str | float:
    if t.data == "init_number":
        return _number(t.children[0].children[0])
    name = str(t.children[0])
    args = [a for a in t.children[1:] if a is not None]
    if not args:
        return name
    return f"{name}({', '.join(str(_init_text(a)) for a in args)})"


def read_mem(text: str, file: str, diags: Collector) -> RawSpec | None:
    """Parse ``text`` (the `.mem` language) into a RawSpec; problems go to ``diags``."""
    pos = SourcePos(file)
    tree = _parse(text, pos, diags)
    if tree is None:
        return None
    if not tree.children:
        diags.error("empty spec: no declarations", Span(file, 1, 1),
                    hint="a .mem spec starts with `memory NAME` and declares at least state and read")
        return None
    return _MemReader(pos, diags).read(tree.children)


def _parse(text: str, pos: SourcePos, diags: Collector):
    """The file's parse tree with its expressions built, or None after reporting a syntax
    error or a broken limit (checked before the recursive expression builder runs)."""
    try:
        tree = parser("start").parse(text)
    except UnexpectedInput as err:
        diags.extend([parse_error_diagnostic(err, text, pos, ".mem file")])
        return None
    problems = limit_problems(tree, pos)
    if problems:
        diags.extend(problems)
        return None
    return ExprBuilder(pos).transform(tree)


class _MemReader:
    """Collects the declarations of one `.mem` file into a RawSpec: the values into nested
    dicts (the shape a YAML spec has), and where each value and its name sit in the file.
    One method per kind of declaration, each called with the declaration's children and span."""

    def __init__(self, pos: SourcePos, diags: Collector):
        self.pos, self.file, self.diags = pos, pos.file, diags
        self.raw = RawSpec(file=pos.file)
        self.raw.spans[()] = Span(pos.file, 1, 1)
        self.data: dict = {}

    def read(self, decls) -> RawSpec:
        """The RawSpec of ``decls`` (the file's declarations, in order)."""
        for item in decls:
            span = self.pos.of_meta(item.meta) or Span(self.file, 1, 1)
            handler = self._HANDLERS.get(item.data)
            if handler is None:  # pragma: no cover - grammar and transformer are kept in sync
                self.diags.error(f"unsupported declaration {item.data}", span)
                continue
            handler(self, item.data, item.children, span)
        self.raw.data = self.data
        return self.raw

    # ------------------------------------------------------------ recording
    def _put(self, path: tuple, value, span: Span, key_span: Span | None = None):
        """Store ``value`` at ``path`` of the data with its spans; a second declaration of the
        same item is an error (a ``drop`` may repeat)."""
        d = self.data
        for k in path[:-1]:
            d = d.setdefault(k, {})
        if path[-1] in d and path[0] != "drop":
            what = " ".join(str(p) for p in path)
            self.diags.error(f"duplicate declaration of {what}", key_span or span,
                             hint="each item may be declared once; use `drop` and redeclare in a variant")
            return
        d[path[-1]] = value
        self.raw.spans[path] = span
        if key_span is not None:
            self.raw.key_spans[path] = key_span

    def _text_of(self, tok: Token) -> str | None:
        """The text of a string literal, or None after pointing at an invalid escape in it."""
        try:
            return _unquote(tok)
        except _BadString as err:
            sp = self.pos.of_token(tok)
            col = sp.col + err.offset
            self.diags.error(err.message, Span(self.file, sp.line, col, sp.line, col + 2),
                             hint=f"strings use the escapes {STRING_ESCAPES}")
            return None

    def _dim_spans(self, path: tuple, shape) -> None:
        """The span of each dim name of a written shape, at ``path + (i,)``."""
        for i, t in enumerate(x for x in shape.children if x is not None):
            self.raw.spans[path + (i,)] = self.pos.of_token(t)

    # ------------------------------------------------------------ header
    def _word(self, kind, ch, span):
        """``memory NAME`` / ``order NAME``."""
        self._put((_SINGLE[kind],), str(ch[0]), self.pos.of_token(ch[0]))

    def _string(self, kind, ch, span):
        """``description "..."`` / ``cite "..."``."""
        text = self._text_of(ch[0])
        if text is not None:
            self._put((_SINGLE[kind],), text, self.pos.of_token(ch[0]))

    def _extends(self, kind, ch, span):
        """``extends "FILE"``: kept apart from the data (the variant is merged onto its parent)."""
        if self.raw.extends is not None:
            self.diags.error("duplicate extends", span)
        text = self._text_of(ch[0])
        if text is not None:
            self.raw.extends, self.raw.extends_span = text, self.pos.of_token(ch[0])

    def _dims(self, kind, ch, span):
        """``dims { NAME = INT, ... }``: all dims in one block."""
        pos, raw = self.pos, self.raw
        dims = {}
        raw.spans[("dims",)] = span
        for e in ch:
            if e is None:
                continue
            name = str(e.children[0])
            if name in dims:
                self.diags.error(f"duplicate dim {quote(name)}", pos.of_token(e.children[0]))
                continue
            dims[name] = int(str(e.children[1]))
            raw.spans[("dims", name)] = pos.of_token(e.children[1])
            raw.key_spans[("dims", name)] = pos.of_token(e.children[0])
        if "dims" in self.data:
            self.diags.error("duplicate declaration of dims", span, hint="declare all dims in one block")
        self.data["dims"] = dims

    def _constant(self, kind, ch, span):
        """``const NAME = NUMBER``, or a Newton-Schulz schedule ``[(a, b, c), ...]``."""
        name, pos = ch[0], self.pos
        if ch[1].data == "coefficients":
            rows = [[_number(x.children[0]) for x in t.children] for t in ch[1].children]
            first = ch[1].children[0].children[0].children[0]
            self._put(("constants", str(name)), rows, pos.of_token(first), pos.of_token(name))
        else:
            self._put(("constants", str(name)), _number(ch[1].children[0]), pos.of_token(ch[1].children[0]),
                      pos.of_token(name))

    # ------------------------------------------------------------ inputs and state
    def _view(self, kind, ch, span):
        """``view NAME : DIM``."""
        self._put(("views", str(ch[0])), {"dim": str(ch[1])}, span, self.pos.of_token(ch[0]))
        self.raw.spans[("views", str(ch[0]), "dim")] = self.pos.of_token(ch[1])

    def _gate(self, kind, ch, span):
        """``gate NAME [: [DIMS]] = FORMULA [bias NUMBER]``."""
        name, shape, formula, bias = str(ch[0]), ch[1], ch[2], ch[3]
        g = {"formula": formula}
        if shape is not None:
            g["shape"] = [str(t) for t in shape.children if t is not None]
        if bias is not None:
            g["bias"] = float(_number(bias.children[0].children[0]))
        self._put(("gates", name), g, span, self.pos.of_token(ch[0]))
        self.raw.spans[("gates", name, "formula")] = formula.span
        if shape is not None:
            self.raw.spans[("gates", name, "shape")] = self.pos.of_meta(shape.meta) or span
            self._dim_spans(("gates", name, "shape"), shape)

    def _param(self, kind, ch, span):
        """``param NAME : [DIMS] = INIT``."""
        name, pos = str(ch[0]), self.pos
        shape = [str(t) for t in ch[1].children if t is not None]
        self._put(("params", name), {"shape": shape, "init": _init_text(ch[2])}, span, pos.of_token(ch[0]))
        self.raw.spans[("params", name, "shape")] = pos.of_meta(ch[1].meta) or span
        self.raw.spans[("params", name, "init")] = pos.of_meta(ch[2].meta) or span

    def _state_tensor(self, kind, ch, span):
        """``state NAME : [DIMS] = INIT [every N]``."""
        name, pos, raw = str(ch[0]), self.pos, self.raw
        shape = [str(t) for t in ch[1].children if t is not None]
        entry = {"shape": shape, "init": _init_text(ch[2])}
        if ch[3] is not None:
            entry["every"] = int(str(ch[3].children[0]))
            raw.spans[("state", name, "every")] = pos.of_meta(ch[3].meta) or span
        self._put(("state", name), entry, span, pos.of_token(ch[0]))
        raw.spans[("state", name, "shape")] = pos.of_meta(ch[1].meta) or span
        raw.spans[("state", name, "init")] = pos.of_meta(ch[2].meta) or span
        self._dim_spans(("state", name, "shape"), ch[1])

    def _state_cache(self, kind, ch, span):
        """``state NAME : cache [DIMS] [window N]``."""
        name, pos, raw = str(ch[0]), self.pos, self.raw
        shape = [str(t) for t in ch[1].children if t is not None]
        entry = {"shape": shape, "cache": True}
        if ch[2] is not None:
            entry["window"] = int(str(ch[2].children[0]))
            raw.spans[("state", name, "window")] = pos.of_meta(ch[2].meta) or span
        self._put(("state", name), entry, span, pos.of_token(ch[0]))
        raw.spans[("state", name, "shape")] = pos.of_meta(ch[1].meta) or span
        self._dim_spans(("state", name, "shape"), ch[1])

    # ------------------------------------------------------------ algebra
    def _let(self, kind, ch, span):
        """``let NAME = EXPR``."""
        self._put(("let", str(ch[0])), ch[1], ch[1].span or span, self.pos.of_token(ch[0]))

    def _formula(self, kind, ch, span):
        """``model f(u) = ...``, ``loss = ...``, ``read = ...``: one parsed formula each."""
        self._put((_SINGLE[kind],), ch[0], ch[0].span or span)

    def _update(self, kind, ch, span):
        """``update { STATE = EXPR ... }``: the statements in order."""
        stmts = [c for c in ch if c is not None]
        self._put(("update",), stmts, span)
        for i, s in enumerate(stmts):
            self.raw.spans[("update", i)] = s.span or span

    # ------------------------------------------------------------ settings
    def _schedule(self, kind, ch, span):
        """``schedule NAME[(N)]``, kept as the text YAML would hold."""
        sv = ch[0]
        nm, n = str(sv.children[0]), sv.children[1]
        self._put(("schedule",), f"{nm}({n})" if n is not None else nm, self.pos.of_meta(sv.meta) or span)

    def _wiring(self, kind, ch, span):
        """``wiring KIND { KEY = VALUE ... }``: integers, true / false, or names."""
        pos, raw = self.pos, self.raw
        w = {"kind": str(ch[0])}
        raw.spans[("wiring", "kind")] = pos.of_token(ch[0])
        for a in ch[1:]:
            if a is None:
                continue
            k, value = str(a.children[0]), a.children[1]
            if value.type == "INT":
                w[k] = int(str(value))
            else:                                   # an option: true / false, or a name
                w[k] = {"true": True, "false": False}.get(str(value), str(value))
            raw.spans[("wiring", k)] = pos.of_token(a.children[1])
            raw.key_spans[("wiring", k)] = pos.of_token(a.children[0])
        self._put(("wiring",), w, span)

    def _drop(self, kind, ch, span):
        """``drop KIND NAME``: a variant removes an item it inherits (marked None)."""
        what, name = str(ch[0]), str(ch[1])
        section = _DROP_KINDS.get(what)
        if section is None:
            self.diags.error(f"cannot drop a {quote(what)}", self.pos.of_token(ch[0]),
                             hint="drop one of: " + ", ".join(sorted(_DROP_KINDS)))
            return
        self.data.setdefault(section, {})[name] = None
        self.raw.spans[(section, name)] = span

    _HANDLERS = {
        "memory_decl": _word, "order_decl": _word,
        "description_decl": _string, "cite_decl": _string,
        "extends_decl": _extends, "dims_decl": _dims, "const_decl": _constant,
        "view_decl": _view, "gate_decl": _gate, "param_decl": _param,
        "state_tensor": _state_tensor, "state_cache": _state_cache,
        "let_decl": _let, "model_decl": _formula, "loss_decl": _formula, "read_decl": _formula,
        "update_decl": _update, "schedule_decl": _schedule, "wiring_decl": _wiring, "drop_decl": _drop,
    }
