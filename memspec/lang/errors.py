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
from pathlib import Path
from typing import Iterable, Sequence


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
    if text is None:
        try:
            text = Path(file).read_text(encoding="utf-8", errors="replace")
        except OSError:
            return None
    lines = text.splitlines()
    if 1 <= line <= len(lines):
        return lines[line - 1]
    return None


MAX_QUOTED_LINE = 200


def render_diagnostic(d: Diagnostic, sources: dict[str, str] | None = None) -> str:
    out = []
    s = d.span
    if s is not None:
        out.append(f"{s.file}:{s.line}:{s.col}: {d.severity}: {d.message}")
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
        out.append(f"{d.severity}: {d.message}")
    if d.hint:
        out.append(f"    hint: {d.hint}")
    return "\n".join(out)
