"""Writing generated source: indented lines, shape comments, class names."""
from __future__ import annotations

import textwrap


class Lines:
    """The lines of generated source, with an indentation level (4 spaces a level)."""

    def __init__(self):
        self.lines: list = []
        self.level = 0

    def __call__(self, text: str = "", comment: str | None = None):
        if not text:
            self.lines.append("")
            return
        line = "    " * self.level + text
        if comment:
            line += "  # " + comment
        self.lines.append(line)

    def block(self, text: str):
        """Several lines at the current indentation (blank lines stay blank)."""
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


def class_name(name: str) -> str:
    """``gated_deltanet`` -> ``GatedDeltanet``."""
    return "".join(p[:1].upper() + p[1:] for p in name.split("_") if p) or "Spec"


def string_pieces(text: str, column: int, width: int = 100) -> list[str]:
    """``text`` as Python string literals (``repr``: inert, whatever the text holds), split at
    spaces so that each, starting at ``column``, ends within ``width``; written one per line
    inside brackets they concatenate back to ``text``."""
    room = max(20, width - column - 2)
    words = textwrap.wrap(text, room, break_long_words=False, break_on_hyphens=False,
                          drop_whitespace=False, replace_whitespace=False) or [text]
    assert "".join(words) == text
    return [repr(w) for w in words]
