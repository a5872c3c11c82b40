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
_NAMED = {
    "const_decl": "constants",
    "view_decl": "views",
    "gate_decl": "gates",
    "param_decl": "params",
    "state_tensor": "state",
    "state_cache": "state",
    "let_decl": "let",
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
    pos = SourcePos(file)
    try:
        tree = parser("start").parse(text)
    except UnexpectedInput as err:
        d = parse_error_diagnostic(err, text, pos, ".mem file")
        diags.extend([d])
        return None
    problems = limit_problems(tree, pos)
    if problems:
        diags.extend(problems)
        return None
    tree = ExprBuilder(pos).transform(tree)
    if not tree.children:
        diags.error("empty spec: no declarations", Span(file, 1, 1),
                    hint="a .mem spec starts with `memory NAME` and declares at least state and read")
        return None
    raw = RawSpec(file=file)
    raw.spans[()] = Span(file, 1, 1)
    data: dict = {}

    def put(path: tuple, value, span: Span, key_span: Span | None = None):
        d = data
        for k in path[:-1]:
            d = d.setdefault(k, {})
        if path[-1] in d and path[0] != "drop":
            what = " ".join(str(p) for p in path)
            diags.error(f"duplicate declaration of {what}", key_span or span,
                        hint="each item may be declared once; use `drop` and redeclare in a variant")
            return
        d[path[-1]] = value
        raw.spans[path] = span
        if key_span is not None:
            raw.key_spans[path] = key_span

    def text_of(tok: Token) -> str | None:
        try:
            return _unquote(tok)
        except _BadString as err:
            sp = pos.of_token(tok)
            col = sp.col + err.offset
            diags.error(err.message, Span(file, sp.line, col, sp.line, col + 2),
                        hint=f"strings use the escapes {STRING_ESCAPES}")
            return None

    for item in tree.children:
        kind = item.data
        span = pos.of_meta(item.meta) or Span(file, 1, 1)
        ch = item.children
        if kind in ("memory_decl", "order_decl"):
            put((_SINGLE[kind],), str(ch[0]), pos.of_token(ch[0]))
        elif kind in ("description_decl", "cite_decl"):
            text = text_of(ch[0])
            if text is not None:
                put((_SINGLE[kind],), text, pos.of_token(ch[0]))
        elif kind == "extends_decl":
            if raw.extends is not None:
                diags.error("duplicate extends", span)
            text = text_of(ch[0])
            if text is not None:
                raw.extends, raw.extends_span = text, pos.of_token(ch[0])
        elif kind == "dims_decl":
            dims = {}
            raw.spans[("dims",)] = span
            for e in ch:
                if e is None:
                    continue
                name = str(e.children[0])
                if name in dims:
                    diags.error(f"duplicate dim {quote(name)}", pos.of_token(e.children[0]))
                    continue
                dims[name] = int(str(e.children[1]))
                raw.spans[("dims", name)] = pos.of_token(e.children[1])
                raw.key_spans[("dims", name)] = pos.of_token(e.children[0])
            if "dims" in data:
                diags.error("duplicate declaration of dims", span, hint="declare all dims in one block")
            data["dims"] = dims
        elif kind == "const_decl":
            name = ch[0]
            if ch[1].data == "coefficients":   # a Newton-Schulz schedule: [(a, b, c), ...]
                rows = [[_number(x.children[0]) for x in t.children] for t in ch[1].children]
                first = ch[1].children[0].children[0].children[0]
                put(("constants", str(name)), rows, pos.of_token(first), pos.of_token(name))
            else:
                put(("constants", str(name)), _number(ch[1].children[0]), pos.of_token(ch[1].children[0]),
                    pos.of_token(name))
        elif kind == "view_decl":
            put(("views", str(ch[0])), {"dim": str(ch[1])}, span, pos.of_token(ch[0]))
            raw.spans[("views", str(ch[0]), "dim")] = pos.of_token(ch[1])
        elif kind == "gate_decl":
            name, shape, formula, bias = str(ch[0]), ch[1], ch[2], ch[3]
            g = {"formula": formula}
            if shape is not None:
                g["shape"] = [str(t) for t in shape.children if t is not None]
            if bias is not None:
                g["bias"] = float(_number(bias.children[0].children[0]))
            put(("gates", name), g, span, pos.of_token(ch[0]))
            raw.spans[("gates", name, "formula")] = formula.span
            if shape is not None:
                raw.spans[("gates", name, "shape")] = pos.of_meta(shape.meta) or span
                for i, t in enumerate(x for x in shape.children if x is not None):
                    raw.spans[("gates", name, "shape", i)] = pos.of_token(t)
        elif kind == "param_decl":
            name = str(ch[0])
            shape = [str(t) for t in ch[1].children if t is not None]
            put(("params", name), {"shape": shape, "init": _init_text(ch[2])}, span, pos.of_token(ch[0]))
            raw.spans[("params", name, "shape")] = pos.of_meta(ch[1].meta) or span
            raw.spans[("params", name, "init")] = pos.of_meta(ch[2].meta) or span
        elif kind == "state_tensor":
            name = str(ch[0])
            shape = [str(t) for t in ch[1].children if t is not None]
            entry = {"shape": shape, "init": _init_text(ch[2])}
            if ch[3] is not None:
                entry["every"] = int(str(ch[3].children[0]))
                raw.spans[("state", name, "every")] = pos.of_meta(ch[3].meta) or span
            put(("state", name), entry, span, pos.of_token(ch[0]))
            raw.spans[("state", name, "shape")] = pos.of_meta(ch[1].meta) or span
            raw.spans[("state", name, "init")] = pos.of_meta(ch[2].meta) or span
            for i, t in enumerate(x for x in ch[1].children if x is not None):
                raw.spans[("state", name, "shape", i)] = pos.of_token(t)
        elif kind == "state_cache":
            name = str(ch[0])
            shape = [str(t) for t in ch[1].children if t is not None]
            entry = {"shape": shape, "cache": True}
            if ch[2] is not None:
                entry["window"] = int(str(ch[2].children[0]))
                raw.spans[("state", name, "window")] = pos.of_meta(ch[2].meta) or span
            put(("state", name), entry, span, pos.of_token(ch[0]))
            raw.spans[("state", name, "shape")] = pos.of_meta(ch[1].meta) or span
            for i, t in enumerate(x for x in ch[1].children if x is not None):
                raw.spans[("state", name, "shape", i)] = pos.of_token(t)
        elif kind == "let_decl":
            put(("let", str(ch[0])), ch[1], ch[1].span or span, pos.of_token(ch[0]))
        elif kind == "model_decl":
            put(("model",), ch[0], ch[0].span or span)
        elif kind in ("loss_decl", "read_decl"):
            put((_SINGLE[kind],), ch[0], ch[0].span or span)
        elif kind == "update_decl":
            stmts = [c for c in ch if c is not None]
            put(("update",), stmts, span)
            for i, s in enumerate(stmts):
                raw.spans[("update", i)] = s.span or span
        elif kind == "schedule_decl":
            sv = ch[0]
            nm, n = str(sv.children[0]), sv.children[1]
            put(("schedule",), f"{nm}({n})" if n is not None else nm, pos.of_meta(sv.meta) or span)
        elif kind == "wiring_decl":
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
            put(("wiring",), w, span)
        elif kind == "drop_decl":
            what, name = str(ch[0]), str(ch[1])
            section = _DROP_KINDS.get(what)
            if section is None:
                diags.error(f"cannot drop a {quote(what)}", pos.of_token(ch[0]),
                            hint="drop one of: " + ", ".join(sorted(_DROP_KINDS)))
                continue
            data.setdefault(section, {})[name] = None
            raw.spans[(section, name)] = span
        else:  # pragma: no cover - grammar and transformer are kept in sync
            diags.error(f"unsupported declaration {kind}", span)
    raw.data = data
    return raw
