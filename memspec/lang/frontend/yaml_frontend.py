"""YAML frontend: safe-load a spec file into a :class:`RawSpec` that keeps positions.

Only YAML's core scalar types are accepted (no tags that construct objects).  Every
mapping key and value keeps its line and column so that later phases can point
at the spec's own text, including columns inside expression strings.
"""
from __future__ import annotations

import yaml
from yaml.constructor import SafeConstructor

from ..errors import Collector, Span
from ..limits import MAX_NUMBER_CHARS, clip, quote
from ..expr import SourcePos
from .raw import RawSpec

MAX_DEPTH = 32
_CORE_TAGS = {
    "tag:yaml.org,2002:str",
    "tag:yaml.org,2002:int",
    "tag:yaml.org,2002:float",
    "tag:yaml.org,2002:bool",
    "tag:yaml.org,2002:null",
    "tag:yaml.org,2002:map",
    "tag:yaml.org,2002:seq",
}


def _span(node, file: str) -> Span:
    s, e = node.start_mark, node.end_mark
    return Span(file, s.line + 1, s.column + 1, e.line + 1, e.column + 1)


def _text_pos(node, file: str, lines: list[str]) -> SourcePos:
    """Where the characters of a string scalar start in the file."""
    m = node.start_mark
    style = node.style
    if style in ("'", '"'):
        return SourcePos(file, m.line + 1, m.column + 2, cont_col=1)
    if style in ("|", ">"):
        # content starts on the next line, at that line's indentation
        ln = m.line + 1  # 0-based index of next line
        while ln < len(lines) and not lines[ln].strip():
            ln += 1
        indent = len(lines[ln]) - len(lines[ln].lstrip(" ")) if ln < len(lines) else 0
        return SourcePos(file, ln + 1, indent + 1, cont_col=indent + 1)
    return SourcePos(file, m.line + 1, m.column + 1, cont_col=m.column + 1)


class _AliasFound(Exception):
    def __init__(self, mark, what: str):
        super().__init__(what)
        self.mark, self.what = mark, what


class _Loader(yaml.SafeLoader):
    """The safe loader, refusing anchors and aliases before they are composed: an alias
    shares a node, and a few lines of aliases of aliases ("billion laughs") stand for more
    values than memory holds.  A spec never needs them (``extends`` shares between files)."""

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            raise _AliasFound(event.start_mark, f"alias *{event.anchor}")
        if getattr(event, "anchor", None) is not None:
            raise _AliasFound(event.start_mark, f"anchor &{event.anchor}")
        return super().compose_node(parent, index)


_NUMBER_TAGS = {"tag:yaml.org,2002:int", "tag:yaml.org,2002:float"}


def read_yaml(text: str, file: str, diags: Collector) -> RawSpec | None:
    """Parse ``text`` (YAML) into a RawSpec; problems go to ``diags``."""
    node = _compose(text, file, diags)
    if node is None:
        return None
    raw = RawSpec(file=file)
    converter = _Converter(raw, text.splitlines(), diags)
    try:
        data = converter.value(node, (), 0)
    except RecursionError:
        diags.error(f"YAML nesting too deep (limit {MAX_DEPTH} levels)", Span(file, 1, 1))
        return None
    except yaml.YAMLError as err:  # e.g. a malformed timestamp or number
        diags.error(f"YAML error: {err}", Span(file, 1, 1))
        return None
    if not converter.ok:
        return None
    raw.spans[()] = Span(file, 1, 1)
    if "extends" in data:
        ext = data.pop("extends")
        raw.extends_span = raw.spans.get(("extends",))
        if not isinstance(ext, str):
            diags.error("extends must be a file name", raw.extends_span)
            return None
        raw.extends = ext
    raw.data = data
    return raw


def _compose(text: str, file: str, diags: Collector):
    """The YAML node tree of ``text`` when it is a mapping; otherwise None after reporting
    why (a syntax or reader error, an anchor or alias, too deep, empty, not a mapping)."""
    try:
        node = yaml.compose(text, Loader=_Loader)
    except _AliasFound as err:
        m = err.mark
        diags.error(f"YAML anchors and aliases are not allowed in a spec (found {clip(err.what)})",
                    Span(file, m.line + 1, m.column + 1),
                    hint="write the value out; to share a spec's parts use extends")
        return None
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        span = Span(file, mark.line + 1, mark.column + 1) if mark else Span(file, 1, 1)
        problem = err.problem or err.context or "invalid YAML"
        diags.error(f"YAML syntax error: {problem}", span, hint=_yaml_hint(err))
        return None
    except yaml.YAMLError as err:  # reader errors (control characters, bad encoding)
        reason = getattr(err, "reason", None) or "cannot read YAML"
        diags.error(f"YAML error: {reason}", _reader_error_span(err, text, file), hint="a spec is UTF-8 text")
        return None
    except RecursionError:
        diags.error(f"YAML nesting too deep (limit {MAX_DEPTH} levels)", Span(file, 1, 1))
        return None
    if node is None:
        diags.error("empty spec", Span(file, 1, 1), hint="a spec is a mapping with at least name, state and read")
        return None
    if not isinstance(node, yaml.MappingNode):
        kind = "a list" if isinstance(node, yaml.SequenceNode) else "a single value"
        diags.error(f"a spec must be a YAML mapping, got {kind}", _span(node, file),
                    hint="start with `name: my_memory`")
        return None
    return node


def _reader_error_span(err: yaml.YAMLError, text: str, file: str) -> Span:
    """Where a reader error (no mark of its own, or a character offset) sits in ``text``."""
    mark = getattr(err, "problem_mark", None)
    pos = getattr(err, "position", None)
    if mark is not None:
        return Span(file, mark.line + 1, mark.column + 1)
    if pos is not None:
        before = text[:pos]
        return Span(file, before.count("\n") + 1, pos - (before.rfind("\n") + 1) + 1)
    return Span(file, 1, 1)


class _Converter:
    """Turns a composed YAML node tree into plain values (dicts, lists, core scalars) and
    records in ``raw`` where each value, each key and each string's characters sit.  Every
    problem is reported; ``ok`` is False after any."""

    def __init__(self, raw: RawSpec, lines: list[str], diags: Collector):
        self.raw, self.file, self.lines, self.diags = raw, raw.file, lines, diags
        self.constructor = SafeConstructor()
        self.ok = True

    def _fail(self, message: str, node, hint: str | None = None) -> None:
        """Report a problem at ``node`` (the value it stands for is dropped)."""
        self.diags.error(message, _span(node, self.file), hint=hint)
        self.ok = False

    def value(self, n, path: tuple, depth: int):
        """The plain value of node ``n`` at ``path``, ``depth`` levels deep (None after a problem)."""
        self.raw.spans[path] = _span(n, self.file)
        if depth > MAX_DEPTH:
            self._fail(f"YAML nesting too deep (limit {MAX_DEPTH} levels)", n)
            return None
        if n.tag not in _CORE_TAGS:
            self._fail(f"YAML tag {quote(n.tag)} is not allowed in a spec", n,
                       hint="specs use plain YAML: mappings, lists, strings and numbers")
            return None
        if isinstance(n, yaml.MappingNode):
            return self._mapping(n, path, depth)
        if isinstance(n, yaml.SequenceNode):
            return [self.value(c, path + (i,), depth + 1) for i, c in enumerate(n.value)]
        return self._scalar(n, path)

    def _mapping(self, n, path: tuple, depth: int) -> dict:
        """A mapping's entries, keyed by plain names, each key once."""
        out = {}
        for kn, vn in n.value:
            key = self._key(kn)
            if key is None:
                continue
            if key in out:
                self._fail(f"duplicate key {quote(key)}", kn, hint="each key may appear once in a mapping")
                continue
            self.raw.key_spans[path + (key,)] = _span(kn, self.file)
            out[key] = self.value(vn, path + (key,), depth + 1)
        return out

    def _key(self, kn) -> str | None:
        """A mapping key as text (a number or boolean key as its text, null as "null"); None
        after reporting a key that is not a plain scalar."""
        if not isinstance(kn, yaml.ScalarNode) or kn.tag not in _CORE_TAGS:
            self._fail("mapping keys must be plain names", kn)
            return None
        try:
            key = self.constructor.construct_object(kn)
        except (ValueError, OverflowError):
            self._fail("mapping keys must be plain names", kn)
            return None
        if not isinstance(key, str):
            key = str(key) if key is not None else "null"
        return key

    def _scalar(self, n, path: tuple):
        """A scalar's value; a string also records where its characters start in the file."""
        if n.tag in _NUMBER_TAGS and len(n.value) > MAX_NUMBER_CHARS:
            self._fail(f"number too long ({len(n.value)} characters; at most {MAX_NUMBER_CHARS})", n)
            return None
        try:
            value = self.constructor.construct_object(n)
        except (ValueError, OverflowError) as err:
            self._fail(f"cannot read this value: {clip(str(err))}", n)
            return None
        if isinstance(value, str):
            self.raw.text_pos[path] = _text_pos(n, self.file, self.lines)
        return value


def _yaml_hint(err) -> str | None:
    p = (err.problem or "") + " " + (err.context or "")
    if "mapping values are not allowed" in p:
        return "quote a value that contains ': '"
    if "found character '\\t'" in p or "\\t" in p:
        return "indent with spaces, not tabs"
    if "found undefined alias" in p or "expected alphabetic or numeric character" in p:
        return "'*' and '&' start YAML aliases; quote an expression that starts with them"
    if "found unexpected end of stream" in p or "while scanning a quoted scalar" in p:
        return "close the quote"
    return None
