"""The canonical printed forms of a :class:`~memspec.spec.Spec`: YAML and `.mem`.

``to_yaml(spec)`` and ``to_mem(spec)`` are the stable printed form of the spec IR
(what ``memspec fmt`` prints).  Both are deterministic and round-trip exactly::

    to_yaml(loads(to_yaml(s), "yaml")) == to_yaml(s)
    to_mem(loads(to_mem(s), "mem")) == to_mem(s)
    loads(to_yaml(s), "yaml") == loads(to_mem(s), "mem") == s

Rules of the canonical form:

* sections in :class:`Spec` field order; a field equal to its default is omitted
  (a gate always shows its formula; its shape when it has one, its bias only when it is not 0);
* expressions printed with :func:`memspec.expr.unparse` (minimal parentheses);
* shorthand where the language has one: a view as ``q: d_k``, a gate with the
  default bias as ``eta: sigmoid(logit)``, a wiring with default sizes and options as ``wiring: mac``;
* YAML: block mappings, shapes as flow lists ``[d_k, d_v]``, floats always with a
  ``.`` (``1.0e-06``) so that YAML reads them back as numbers, a string quoted only
  when it would not read back as the same string plain (single quotes, or double
  quotes with escapes for non-printable characters).  Every emitted scalar is
  checked to reload to itself;
* long prose (description, cite) as a folded block scalar ``>-`` of lines of at most
  88 characters when that reads back exactly;
* ``extends`` is resolved: the printed spec is the merged one.

A spec whose names are not identifiers (possible from YAML, rejected later by
``memspec check``) cannot be written as `.mem`: :func:`to_mem` raises a located
:class:`~memspec.errors.SpecError` instead of printing text that would not parse.
"""
from __future__ import annotations

import json
import math
import re
from functools import lru_cache

import yaml

from .errors import Diagnostic, Span, SpecError, json_printable
from .limits import quote
from .expr import format_number, unparse
from .spec import Gate, Param, Spec, State, Wiring

__all__ = ["to_yaml", "to_mem"]

_DEFAULT_GATE = Gate()
_DEFAULT_WIRING = Wiring()
_WIRING_FIELDS = tuple(f for f in Wiring.model_fields if f != "kind")   # in the model's order
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


# ------------------------------------------------------------------ YAML scalars
def _loads_yaml(text: str):
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return _Unreadable


class _Unreadable:  # sentinel: the candidate text is not valid YAML
    pass


_PLAIN_BAD_START = set("-?:,[]{}#&*!|>'\"%@`")


def _plain_ok(s: str, where: str) -> bool:
    if not s or s != s.strip() or not all(c.isprintable() for c in s):
        return False
    if s[0] in _PLAIN_BAD_START or ": " in s or " #" in s or s.endswith(":"):
        return False
    if where == "flow" and any(c in s for c in ",[]{}"):
        return False
    return _reloads(s, s, where)


def _reloads(text: str, value: str, where: str) -> bool:
    if where == "key":
        return _loads_yaml(f"{text}: 1\n") == {value: 1}
    if where == "flow":
        return _loads_yaml(f"k: [{text}]\n") == {"k": [value]}
    return _loads_yaml(f"k: {text}\n") == {"k": value}


def _double_quoted(s: str) -> str:
    out = []
    for c in s:
        if c == "\\":
            out.append("\\\\")
        elif c == '"':
            out.append('\\"')
        elif c == "\n":
            out.append("\\n")
        elif c == "\t":
            out.append("\\t")
        elif c.isprintable():
            out.append(c)
        elif ord(c) < 0x100:
            out.append(f"\\x{ord(c):02x}")
        elif ord(c) < 0x10000:
            out.append(f"\\u{ord(c):04x}")
        else:
            out.append(f"\\U{ord(c):08x}")
    return '"' + "".join(out) + '"'


@lru_cache(maxsize=4096)
def yaml_str(s: str, where: str = "value") -> str:
    """``s`` as a YAML scalar (``where``: value, key or flow) that reads back as ``s``."""
    if _plain_ok(s, where):
        return s
    if all(c.isprintable() for c in s):
        single = "'" + s.replace("'", "''") + "'"
        if _reloads(single, s, where):
            return single
    double = _double_quoted(s)
    if _reloads(double, s, where):
        return double
    raise ValueError(f"cannot write {s!r} as a YAML scalar")  # pragma: no cover - escapes cover all text


_FOLD_WIDTH = 88


def yaml_text(s: str, indent: str = "  ") -> str:
    """Long prose (description, cite) as a folded block scalar ``>-`` when it reads back
    exactly (single spaces between words, printable, one line); else as :func:`yaml_str`."""
    if len(s) <= _FOLD_WIDTH or not all(c.isprintable() for c in s) or "  " in s or s != s.strip():
        return yaml_str(s)
    lines, cur = [], ""
    for word in s.split(" "):
        if cur and len(cur) + 1 + len(word) > _FOLD_WIDTH:
            lines.append(cur)
            cur = word
        else:
            cur = f"{cur} {word}" if cur else word
    lines.append(cur)
    text = ">-\n" + "\n".join(indent + ln for ln in lines)
    if _loads_yaml(f"k: {text}\n") == {"k": s}:
        return text
    return yaml_str(s)


def yaml_float(v: float) -> str:
    """A float YAML reads back as the same float (PyYAML needs a '.' in ``1.0e-06``)."""
    v = float(v)
    if math.isnan(v):
        return ".nan"
    if math.isinf(v):
        return ".inf" if v > 0 else "-.inf"
    r = repr(v)
    if "e" in r:
        mant, exp = r.split("e")
        if "." not in mant:
            mant += ".0"
        if exp[0] not in "+-":
            exp = "+" + exp
        r = f"{mant}e{exp}"
    return r


def _yaml_init(v) -> str:
    return yaml_float(v) if isinstance(v, (int, float)) else yaml_str(v)


# ---------------------------------------------------------------------- to_yaml
def _gate_is_short(g: Gate) -> bool:
    return g.bias == _DEFAULT_GATE.bias and not g.shape


def value_text(v) -> str:
    """A field's value as the spec languages write it (``true`` / ``false`` for flags, nothing
    for None)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    return "" if v is None else str(v)


def _wiring_fields(w: Wiring) -> list[tuple[str, str]]:
    """The wiring's fields that differ from their defaults, printed (``true`` / ``false``
    for flags; the option values are plain names, the sizes integers)."""
    out = []
    for f in _WIRING_FIELDS:
        val = getattr(w, f)
        if val != getattr(_DEFAULT_WIRING, f):
            out.append((f, value_text(val)))
    return out


def to_yaml(spec: Spec) -> str:
    """The canonical YAML text of ``spec``."""
    out: list[str] = []
    k = lambda s: yaml_str(s, "key")  # noqa: E731
    v = yaml_str
    flow = lambda names: "[" + ", ".join(yaml_str(n, "flow") for n in names) + "]"  # noqa: E731

    out.append(f"name: {v(spec.name)}")
    if spec.description:
        out.append(f"description: {yaml_text(spec.description)}")
    if spec.cite:
        out.append(f"cite: {yaml_text(spec.cite)}")
    if spec.dims:
        out.append("dims:")
        out += [f"  {k(n)}: {d}" for n, d in spec.dims.items()]
    if spec.constants:
        out.append("constants:")
        out += [f"  {k(n)}: {_yaml_constant(c)}" for n, c in spec.constants.items()]
    if spec.views:
        out.append("views:")
        out += [f"  {k(n)}: {v(view.dim)}" for n, view in spec.views.items()]
    if spec.gates:
        out.append("gates:")
        for n, g in spec.gates.items():
            if _gate_is_short(g):
                out.append(f"  {k(n)}: {v(unparse(g.formula))}")
            else:
                out.append(f"  {k(n)}:")
                out.append(f"    formula: {v(unparse(g.formula))}")
                if g.shape:
                    out.append(f"    shape: {flow(g.shape)}")
                if g.bias != _DEFAULT_GATE.bias:
                    out.append(f"    bias: {yaml_float(g.bias)}")
    if spec.params:
        out.append("params:")
        for n, p in spec.params.items():
            body = []
            if p.shape:
                body.append(f"    shape: {flow(p.shape)}")
            if p.init != Param.model_fields["init"].default:
                body.append(f"    init: {_yaml_init(p.init)}")
            out += [f"  {k(n)}:"] + body if body else [f"  {k(n)}: {{}}"]
    if spec.state:
        out.append("state:")
        for n, s in spec.state.items():
            out.append(f"  {k(n)}:")
            out.append(f"    shape: {flow(s.shape)}")
            if s.init != State.model_fields["init"].default:
                out.append(f"    init: {_yaml_init(s.init)}")
            if s.cache:
                out.append("    cache: true")
            if s.window is not None:
                out.append(f"    window: {s.window}")
            if s.every is not None:
                out.append(f"    every: {s.every}")
    if spec.let:
        out.append("let:")
        out += [f"  {k(n)}: {v(unparse(e))}" for n, e in spec.let.items()]
    if spec.model is not None:
        out.append(f"model: {v(str(spec.model))}")
    if spec.loss is not None:
        out.append(f"loss: {v(unparse(spec.loss))}")
    if spec.update:
        out.append("update:")
        out += [f"  - {v(str(st))}" for st in spec.update]
    out.append(f"read: {v(unparse(spec.read))}")
    if spec.order != "write_read":
        out.append(f"order: {v(spec.order)}")
    if spec.schedule != "auto":
        out.append(f"schedule: {v(spec.schedule)}")
    w = spec.wiring
    if w.kind != "none" or _wiring_fields(w):
        fields = _wiring_fields(w)
        if not fields:
            out.append(f"wiring: {v(w.kind)}")
        else:
            out.append("wiring:")
            out.append(f"  kind: {v(w.kind)}")
            out += [f"  {f}: {n}" for f, n in fields]
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------- to_mem
def _mem_string(s: str) -> str:
    """A `.mem` STRING (JSON's escapes: the frontend reads it with json.loads)."""
    return json_printable(json.dumps(s, ensure_ascii=False))   # no raw control character reaches a terminal


def _mem_number(v) -> str:
    v = float(v) if not isinstance(v, int) else v
    if isinstance(v, float) and not math.isfinite(v):
        raise ValueError(v)
    return format_number(v)


def mem_constant(c) -> str:
    """A constant as .mem writes it: a number, or a coefficient schedule ``[(a, b, c), ...]``."""
    if isinstance(c, tuple):
        return "[" + ", ".join("(" + ", ".join(_mem_number(x) for x in row) + ")" for row in c) + "]"
    return _mem_number(c)


def _yaml_constant(c) -> str:
    """A number, or a coefficient schedule as a YAML flow list ``[[a, b, c], ...]``."""
    if isinstance(c, tuple):
        return "[" + ", ".join("[" + ", ".join(yaml_float(x) for x in row) + "]" for row in c) + "]"
    return yaml_float(c)


def _mem_init(v) -> str:
    return _mem_number(v) if isinstance(v, (int, float)) else v


def _check_mem_names(spec: Spec) -> None:
    """Every name a `.mem` file spells as a bare word must be an identifier."""
    bad: list[Diagnostic] = []

    def need(name: str, what: str, *path) -> None:
        if not _IDENT.fullmatch(name):
            span = spec.key_span(*path) if path else None
            bad.append(Diagnostic(
                "error", f"{what} {quote(name)} is not an identifier and cannot be written in .mem",
                span or (Span(spec.path, 1, 1) if spec.path else None),
                hint="rename it to a plain identifier (letters, digits, _)", code="E-fmt"))

    def number(value, what: str, *path) -> None:
        if isinstance(value, float) and not math.isfinite(value):
            bad.append(Diagnostic(
                "error", f"{what} is {value}, which .mem cannot write",
                spec.span(*path) or (Span(spec.path, 1, 1) if spec.path else None),
                hint="use a finite number", code="E-fmt"))

    for n in spec.dims:
        need(n, "dim", "dims", n)
    for n, c in spec.constants.items():
        need(n, "constant", "constants", n)
        for x in (v for row in c for v in row) if isinstance(c, tuple) else (c,):
            number(x, f"constant {n}", "constants", n)
    for n, view in spec.views.items():
        need(n, "view", "views", n)
        need(view.dim, "dim", "views", n, "dim")
    for n, g in spec.gates.items():
        need(n, "gate", "gates", n)
        number(g.bias, f"bias of gate {n}", "gates", n)
        for d in g.shape:
            need(d, "dim", "gates", n, "shape")
    for n, p in spec.params.items():
        need(n, "param", "params", n)
        for d in p.shape:
            need(d, "dim", "params", n, "shape")
        if isinstance(p.init, float):
            number(p.init, f"init of param {n}", "params", n, "init")
    for n, s in spec.state.items():
        need(n, "state", "state", n)
        for d in s.shape:
            need(d, "dim", "state", n, "shape")
    for n in spec.let:
        need(n, "let", "let", n)
    if bad:
        raise SpecError(bad)


def to_mem(spec: Spec) -> str:
    """The canonical `.mem` text of ``spec`` (parsed by ``grammars/memspec.lark``)."""
    _check_mem_names(spec)
    blocks: list[list[str]] = []

    head = [f"memory {spec.name}"]
    if spec.description:
        head.append(f"description {_mem_string(spec.description)}")
    if spec.cite:
        head.append(f"cite {_mem_string(spec.cite)}")
    blocks.append(head)

    b = []
    if spec.dims:
        b.append("dims { " + ", ".join(f"{n} = {d}" for n, d in spec.dims.items()) + " }")
    b += [f"const {n} = {mem_constant(c)}" for n, c in spec.constants.items()]
    blocks.append(b)
    blocks.append([f"view {n} : {view.dim}" for n, view in spec.views.items()])
    b = []
    for n, g in spec.gates.items():
        shape = f" : [{', '.join(g.shape)}]" if g.shape else ""
        line = f"gate {n}{shape} = {unparse(g.formula)}"
        if g.bias != _DEFAULT_GATE.bias:
            line += f" bias {_mem_number(g.bias)}"
        b.append(line)
    blocks.append(b)
    blocks.append([f"param {n} : [{', '.join(p.shape)}] = {_mem_init(p.init)}" for n, p in spec.params.items()])
    b = []
    for n, s in spec.state.items():
        if s.cache:
            line = f"state {n} : cache [{', '.join(s.shape)}]"
            if s.window is not None:
                line += f" window {s.window}"
        else:
            line = f"state {n} : [{', '.join(s.shape)}] = {_mem_init(s.init)}"
            if s.every is not None:
                line += f" every {s.every}"
        b.append(line)
    blocks.append(b)
    blocks.append([f"let {n} = {unparse(e)}" for n, e in spec.let.items()])

    b = []
    if spec.model is not None:
        b.append(f"model {spec.model}")
    if spec.loss is not None:
        b.append(f"loss = {unparse(spec.loss)}")
    if spec.update:
        b.append("update {")
        b += [f"  {st}" for st in spec.update]
        b.append("}")
    b.append(f"read = {unparse(spec.read)}")
    if spec.order != "write_read":
        b.append(f"order {spec.order}")
    if spec.schedule != "auto":
        b.append(f"schedule {spec.schedule}")
    w = spec.wiring
    fields = _wiring_fields(w)
    if w.kind != "none" or fields:
        args = ", ".join(f"{f} = {n}" for f, n in fields)
        b.append(f"wiring {w.kind}" + (f"({args})" if args else ""))
    blocks.append(b)

    return "\n\n".join("\n".join(x) for x in blocks if x) + "\n"
