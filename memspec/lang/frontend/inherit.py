"""What a spec takes from the files it ``extends``, said where it matters.

A problem found in a setting the spec inherited is located in the file that wrote it;
:func:`mark_inherited` adds which spec inherits it and how to override it, so that the
author of a variant knows the fix belongs in the variant, not in the shipped file.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Iterable

from ..errors import Diagnostic, Span

_SINGULAR = {"gates": "gate", "views": "view", "state": "state", "params": "param", "let": "let",
             "dims": "dim", "constants": "constant"}


def own_file(spec) -> str | None:
    """The spec's own file as its spans name it (None for a spec not loaded from a file)."""
    from . import display_path

    return display_path(Path(spec.path)) if spec.path else None


def field_at(spec, span: Span) -> tuple | None:
    """The field of ``spec`` whose source holds ``span``: the one whose key or value is written
    last at or before it in the same file (an error inside an expression points into the
    field's text)."""
    best, where = None, None
    for path, s in [*spec._key_spans.items(), *spec._spans.items()]:
        if not path or s.file != span.file or (s.line, s.col) > (span.line, span.col):
            continue
        if where is None or (s.line, s.col) > where or ((s.line, s.col) == where and len(path) < len(best)):
            best, where = path, (s.line, s.col)
    return best


def override_text(path: tuple) -> str:
    """How a variant overrides the field at ``path`` (``schedule``, ``gate eta``, ...)."""
    section = str(path[0])
    if len(path) > 1 and section in _SINGULAR:
        return f"{_SINGULAR[section]} {path[1]}"
    return section


def _example(path: tuple, mem: bool) -> str:
    if path == ("schedule",):
        return " (e.g. `schedule auto`)" if mem else " (e.g. `schedule: auto`)"
    if len(path) > 1 and path[0] in _SINGULAR:
        drop = f"drop {_SINGULAR[path[0]]} {path[1]}" if mem else f"{path[0]}: {{{path[1]}: null}}"
        return f", or remove it there (`{drop}`)"
    return ""


def mark_inherited(spec, diags: Iterable[Diagnostic]) -> list[Diagnostic]:
    """``diags`` with every one located in a file the spec extends saying so: the setting is
    inherited from that file, and the spec's own file overrides it by defining it."""
    own = own_file(spec)
    out = []
    for d in diags:
        path = field_at(spec, d.span) if own and d.span is not None and d.span.file != own else None
        if path is None:
            out.append(d)
            continue
        what = override_text(path)
        fix = f"to override the inherited {what}, define it in {own}{_example(path, own.endswith('.mem'))}"
        out.append(dataclasses.replace(
            d, message=f"{d.message} ({own} inherits {what} from {d.span.file} through extends)",
            hint=f"{d.hint}; {fix}" if d.hint else fix))
    return out


def inherited_metadata(spec) -> list[tuple[str, str]]:
    """``(field, file)`` for ``description`` and ``cite`` when the spec takes them from a file it
    extends: text about its base, which a variant usually departs from (``memspec check`` says so)."""
    own = own_file(spec)
    out = []
    for key in ("description", "cite"):
        span = spec.span(key)
        if own and getattr(spec, key) and span is not None and span.file != own:
            out.append((key, span.file))
    return out
