"""Diagnostics: located errors and warnings with a caret under the offending span.

Every phase reports problems as :class:`Diagnostic` values carrying a :class:`Span`
into the spec's own file.  A phase collects all of them and raises one
:class:`SpecError`; the CLI renders them as::

    specs/bad.yaml:7:12: error: unknown name 'etaa'
        W = W - etaa * grad(loss, W)
                ^~~~
    hint: did you mean 'eta'?
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Iterable, Sequence

from .limits import MAX_MESSAGE_CHARS


@dataclass(frozen=True)
class Span:
    """A region of a source file: 1-based line and column, end exclusive."""

    file: str
    line: int
    col: int
    end_line: int | None = None
    end_col: int | None = None

    def shifted(self, dline: int, dcol: int) -> "Span":
        return Span(self.file, self.line + dline, self.col + dcol, self.end_line, self.end_col)


@dataclass(frozen=True)
class Diagnostic:
    severity: str  # "error" | "warning"
    message: str
    span: Span | None = None
    hint: str | None = None
    code: str = "E"

    def render(self, sources: dict[str, str] | None = None) -> str:
        return render_diagnostic(self, sources)


class SpecError(Exception):
    """One or more errors in a spec.  ``diagnostics`` holds all of them."""

    def __init__(self, diagnostics: Sequence[Diagnostic]):
        self.diagnostics = list(diagnostics)
        super().__init__(self.render())

    def render(self, sources: dict[str, str] | None = None) -> str:
        return "\n".join(d.render(sources) for d in self.diagnostics)


class Collector:
    """Accumulates diagnostics of one phase; ``raise_if_errors`` raises them all at once."""

    def __init__(self) -> None:
        self.items: list[Diagnostic] = []

    def error(self, message: str, span: Span | None = None, hint: str | None = None, code: str = "E") -> None:
        self.items.append(Diagnostic("error", message, span, hint, code))

    def warning(self, message: str, span: Span | None = None, hint: str | None = None, code: str = "W") -> None:
        self.items.append(Diagnostic("warning", message, span, hint, code))

    def extend(self, diags: Iterable[Diagnostic]) -> None:
        self.items.extend(diags)

    @property
    def errors(self) -> list[Diagnostic]:
        return [d for d in self.items if d.severity == "error"]

    @property
    def warnings(self) -> list[Diagnostic]:
        return [d for d in self.items if d.severity == "warning"]

    def raise_if_errors(self) -> None:
        if self.errors:
            raise SpecError(sorted_diagnostics(self.items))


def sorted_diagnostics(diags: Iterable[Diagnostic]) -> list[Diagnostic]:
    def key(d: Diagnostic):
        s = d.span
        return (s.file, s.line, s.col) if s else ("", 0, 0)

    return sorted(diags, key=key)


def did_you_mean(name: str, candidates: Iterable[str]) -> str | None:
    match = difflib.get_close_matches(name, sorted(set(candidates)), n=1, cutoff=0.6)
    return f"did you mean '{match[0]}'?" if match else None


_SOURCE_CACHE: dict[str, str] = {}


def remember_source(path: str, text: str) -> None:
    """Keep a file's text so that diagnostics can quote its lines."""
    _SOURCE_CACHE[path] = text


def _source_line(file: str, line: int, sources: dict[str, str] | None) -> str | None:
    text = (sources or {}).get(file)
    if text is None:
        text = _SOURCE_CACHE.get(file)
    if text is None:  # a file read by another process: the same bounded, regular-file-only read
        from .source import read_text

        text = read_text(file)
        if text is None:
            return None
    lines = text.splitlines()
    if 1 <= line <= len(lines):
        return lines[line - 1]
    return None


MAX_QUOTED_LINE = 200


def printable(text: str) -> str:
    """``text`` safe to print on a terminal: every character that is not printable (control
    characters such as ESC, line and paragraph separators, bidi overrides, lone surrogates)
    is written as its escape (``\\x1b``, ``\\u2028``); spaces stay."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)


def json_printable(text: str) -> str:
    """JSON text with every non-printable character but the newline written as a ``\\uXXXX``
    escape (astral ones as a surrogate pair): the same JSON value, safe on a terminal."""
    if text.isprintable():
        return text

    def esc(ch: str) -> str:
        if ch == "\n" or ch.isprintable():
            return ch
        o = ord(ch)
        if o > 0xFFFF:
            o -= 0x10000
            return f"\\u{0xD800 + (o >> 10):04x}\\u{0xDC00 + (o & 0x3FF):04x}"
        return f"\\u{o:04x}"

    return "".join(esc(ch) for ch in text)


def _bounded(text: str) -> str:
    text = printable(text)
    if len(text) > MAX_MESSAGE_CHARS:
        return text[:MAX_MESSAGE_CHARS] + f"… ({len(text)} characters)"
    return text


def render_diagnostic(d: Diagnostic, sources: dict[str, str] | None = None) -> str:
    out = []
    s = d.span
    if s is not None:
        out.append(f"{printable(s.file)}:{s.line}:{s.col}: {d.severity}: {_bounded(d.message)}")
        src = _source_line(s.file, s.line, sources)
        if src is not None:
            src = src.replace("\t", " ")
            start = max(s.col - 1, 0)
            # Very long lines (junk input) are cut around the caret.
            offset = 0
            if len(src) > MAX_QUOTED_LINE:
                offset = max(0, start - MAX_QUOTED_LINE // 2)
                src = src[offset : offset + MAX_QUOTED_LINE]
                start -= offset
            src = "".join(ch if ch.isprintable() else "?" for ch in src)
            width = 1
            if s.end_line == s.line and s.end_col is not None and s.end_col > s.col:
                width = s.end_col - s.col
            width = max(1, min(width, len(src) - start)) if start < len(src) else 1
            out.append("    " + src)
            out.append("    " + " " * start + "^" + "~" * (width - 1))
    else:
        out.append(f"{d.severity}: {_bounded(d.message)}")
    if d.hint:
        out.append(f"    hint: {_bounded(d.hint)}")
    return "\n".join(out)
