"""The raw spec tree both frontends produce before validation, with source positions."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import Span
from ..expr import SourcePos

Path_ = tuple  # a path into the raw tree: ("gates", "eta", "formula")


@dataclass
class RawSpec:
    """Nested dicts/lists of plain values (or already-parsed AST for `.mem`).

    ``spans[path]`` is where a value sits in its file, ``key_spans[path]`` where its key
    sits, and ``text_pos[path]`` maps character offsets inside a string value to file
    positions (used to point into expressions written as YAML strings).
    """

    file: str
    data: dict = field(default_factory=dict)
    spans: dict[Path_, Span] = field(default_factory=dict)
    key_spans: dict[Path_, Span] = field(default_factory=dict)
    text_pos: dict[Path_, SourcePos] = field(default_factory=dict)
    extends: str | None = None
    extends_span: Span | None = None

    def span_of(self, path: Path_) -> Span | None:
        """The span of ``path`` or of its nearest ancestor that has one."""
        p = tuple(path)
        while p:
            if p in self.spans:
                return self.spans[p]
            p = p[:-1]
        return self.spans.get((), Span(self.file, 1, 1))

    def key_span_of(self, path: Path_) -> Span | None:
        p = tuple(path)
        while p:
            if p in self.key_spans:
                return self.key_spans[p]
            p = p[:-1]
        return self.span_of(path)


def _drop_prefix(d: dict, prefix: Path_) -> None:
    for k in [k for k in d if k[: len(prefix)] == prefix]:
        del d[k]


def merge_raw(base: RawSpec, over: RawSpec) -> RawSpec:
    """``extends``: the override's keys replace the base's; mappings merge key by key,
    lists and scalars are replaced whole, and ``null`` removes a base entry."""
    out = RawSpec(
        file=over.file,
        data={},
        spans=dict(base.spans),
        key_spans=dict(base.key_spans),
        text_pos=dict(base.text_pos),
    )

    def merge(b: Any, o: Any, path: Path_) -> Any:
        if isinstance(b, dict) and isinstance(o, dict):
            res = dict(b)
            for k, v in o.items():
                sub = path + (k,)
                if v is None:
                    res.pop(k, None)
                    for d in (out.spans, out.key_spans, out.text_pos):
                        _drop_prefix(d, sub)
                elif k in res:
                    res[k] = merge(res[k], v, sub)
                else:
                    res[k] = v
                    _copy_prefix(over, out, sub)
            return res
        for d in (out.spans, out.key_spans, out.text_pos):
            _drop_prefix(d, path)
        _copy_prefix(over, out, path)
        return o

    data = dict(base.data)
    for k, v in over.data.items():
        if v is None:
            data.pop(k, None)
            for d in (out.spans, out.key_spans, out.text_pos):
                _drop_prefix(d, (k,))
        elif k in data:
            data[k] = merge(data[k], v, (k,))
        else:
            data[k] = v
            _copy_prefix(over, out, (k,))
    out.data = data
    out.spans[()] = over.spans.get((), Span(over.file, 1, 1))
    return out


def _copy_prefix(src: RawSpec, dst: RawSpec, prefix: Path_) -> None:
    for name in ("spans", "key_spans", "text_pos"):
        s, d = getattr(src, name), getattr(dst, name)
        for k, v in s.items():
            if k[: len(prefix)] == prefix:
                d[k] = v
