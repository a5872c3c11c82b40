"""Writing generated source: indented lines, shape comments, class names, and
:func:`inert`, the one function through which a spec's values reach the source."""
from __future__ import annotations

import keyword
import math
import re
import textwrap
from dataclasses import dataclass, replace

from .calls import Placed

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class Statement:
    """One statement as its writer knew it: the locals it binds, the locals and inputs it
    reads, and its lines (the comment lines written just before it first)."""

    lines: tuple
    targets: frozenset
    reads: frozenset
    returns: bool = False


class Lines:
    """The lines of generated source, with an indentation level (4 spaces a level).

    ``Lines(record=True)`` also keeps a :class:`Statement` for every statement written with
    its ``reads`` (``L(text, comment, targets=..., reads=...)``): the writer says what each
    statement binds and reads, so that later passes (:mod:`.prestep`) decide on records, not
    on the text; every other line it is given must then be a comment."""

    def __init__(self, record: bool = False, level: int = 0):
        self.lines: list = []
        self.level = level
        self.records: list | None = [] if record else None
        self._mark = 0   # the first line not yet part of a record

    def __call__(self, text: str = "", comment: str | None = None, *, targets=(), reads=None,
                 returns: bool = False):
        """One line (``text`` may hold several for a statement continued over lines, the
        comment on the last); with ``reads``, a statement binding ``targets``."""
        if not text:
            self.lines.append("")
            return
        pieces = text.split("\n") if reads is not None else [text]
        for k, piece in enumerate(pieces):
            line = "    " * self.level + piece
            if comment and k == len(pieces) - 1:
                line += "  # " + inert(comment, "comment")
            self.lines.append(line)
        if self.records is None:
            return
        if reads is None:
            if not text.startswith("#"):
                raise AssertionError(f"a recorded statement without its reads: {text[:60]!r}")
            return
        lines = tuple(ln for ln in self.lines[self._mark:] if ln.strip())
        self.records.append(Statement(lines, frozenset(targets), frozenset(reads), returns))
        self._mark = len(self.lines)

    def block(self, text):
        """Several lines at the current indentation (blank lines stay blank); a kernel call
        (:class:`memspec.codegen.calls.KernelCall`) stays a structure until the module is written."""
        if not isinstance(text, str):   # (its comment through the one escaping path)
            comment = inert(text.comment, "comment") if text.comment else None
            self.lines.append(Placed(self.level, replace(text, comment=comment)))
            return
        for ln in text.rstrip("\n").split("\n"):
            self.lines.append(("    " * self.level + ln) if ln else "")

    def indent(self):
        """``with L.indent(): ...`` -- one level deeper inside the block."""
        self.level += 1
        return self

    def dedent(self):
        self.level -= 1

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.level -= 1


def shape_text(prefix: str, shape) -> str:
    """``shape_text("B, T, H", ("d_k",))`` -> ``[B, T, H, d_k]`` (a shape comment)."""
    return "[" + ", ".join([prefix, *shape]) + "]"


def dims_text(shape) -> str:
    return ", ".join(shape)


def tuple_text(names) -> str:
    """``(a, b)``, ``(a,)``: a Python tuple of the names."""
    return f"({', '.join(names)}{',' if len(names) == 1 else ''})"


from ..lang.names import class_name  # noqa: E402,F401  (re-exported: the one definition is in lang.names)


# ------------------------------------------------------------------ inert text
INERT_KINDS = ("literal", "comment", "doc", "name")


class UnsafeValue(ValueError):
    """A value the generator was asked to write that cannot be made inert (an internal error:
    the checks admit only values :func:`inert` can write)."""


def inert(value, kind: str = "literal") -> str:
    """The one way a value from a spec reaches generated source, made inert for ``kind``:

    * ``"literal"`` -- a Python literal that evaluates to ``value`` (str, int, float, bool,
      None, and tuples, lists and dicts of them): text through ``repr`` (every non-printable
      character escaped, lone surrogates included); a float is finite ``repr`` or an explicit
      ``float("inf")`` / ``float("-inf")`` / ``float("nan")``, never a bare ``inf``;
    * ``"comment"`` -- one line of a ``#`` comment: every character that is not printable
      (``\\n``, ``\\r``, ``\\x0b``, ``\\x0c``, ``\\x1c``-``\\x1e``, ``\\x85``, ``\\u2028``,
      ``\\u2029``, NUL, other controls, lone surrogates) written as its escape, so the
      comment cannot end early;
    * ``"doc"`` -- text inside a ``\"\"\"`` docstring line: as a comment, and also every
      backslash doubled and every ``"`` escaped, so that no escape sequence forms (``\\N``)
      and the docstring cannot close;
    * ``"name"`` -- an identifier the generated code binds or reads: returned unchanged
      once it is a plain ASCII identifier and no Python keyword, else :class:`UnsafeValue`.
    """
    if kind == "literal":
        return _literal(value)
    if kind == "name":
        if isinstance(value, str) and _IDENT.fullmatch(value) and not keyword.iskeyword(value):
            return value
        raise UnsafeValue(f"not a plain identifier: {value!r:.80}")
    if kind not in ("comment", "doc"):
        raise UnsafeValue(f"unknown kind {kind!r}")
    text = value if isinstance(value, str) else _literal(value)
    out = []
    for ch in text:
        if kind == "doc" and ch == "\\":
            out.append("\\\\")
        elif kind == "doc" and ch == '"':
            out.append('\\"')
        elif ch.isprintable():
            out.append(ch)
        else:
            esc = ascii(ch)[1:-1]        # '\x0b', '\u2028', '\ud800', '\x00'
            out.append(esc.replace("\\", "\\\\") if kind == "doc" else esc)
    return "".join(out)


def _literal(v) -> str:
    if v is None or isinstance(v, (bool, str)):
        return repr(v)
    if isinstance(v, int):
        return repr(int(v))
    if isinstance(v, float):
        if math.isfinite(v):
            return repr(float(v))
        return 'float("nan")' if math.isnan(v) else ('float("inf")' if v > 0 else 'float("-inf")')
    if isinstance(v, tuple):
        items = [_literal(x) for x in v]
        return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    if isinstance(v, list):
        return "[" + ", ".join(_literal(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_literal(k)}: {_literal(x)}" for k, x in v.items()) + "}"
    raise UnsafeValue(f"cannot write a {type(v).__name__} as a literal")


def string_pieces(text: str, column: int, width: int = 100) -> list[str]:
    """``text`` as Python string literals (``repr``: inert, whatever the text holds), split at
    spaces so that each, starting at ``column``, ends within ``width``; written one per line
    inside brackets they concatenate back to ``text``."""
    room = max(20, width - column - 2)
    words = textwrap.wrap(text, room, break_long_words=False, break_on_hyphens=False,
                          drop_whitespace=False, replace_whitespace=False) or [text]
    assert "".join(words) == text
    return [repr(w) for w in words]
