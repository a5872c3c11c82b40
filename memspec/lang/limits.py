"""Every limit memspec puts on its input, in one place (docs/language.md, "Limits").

A spec is small text written by a person; these bounds are far above any real spec and
keep every phase fast and within memory on any input, hostile or not.  Each is enforced
with a located error that names the limit.
"""
from __future__ import annotations

MAX_SPEC_BYTES = 65_536
"""A spec file (YAML or `.mem`), read as a regular file only; checked while reading."""

MAX_EXTENDS_CHAIN = 16
"""Files in one chain of ``extends`` (a spec, its base, the base's base, ...)."""

MAX_EXPR_CHARS = 4_000
"""Characters of one expression, update statement or model definition."""

MAX_EXPR_DEPTH = 64
"""Nesting depth of one expression (operators, calls, parentheses, unary minus)."""

MAX_INLINED_DEPTH = 128
"""Nesting depth of an expression once lets, temporaries, earlier update statements, the
loss and the model are inlined (as the schedule analysis and the generator inline them)."""

MAX_INLINED_NODES = 20_000
"""Nodes of an expression once inlined the same way (``b2 = b1 * b1`` doubles with each let)."""

MAX_NUMBER_CHARS = 100
"""Characters of one number literal (YAML or `.mem`)."""

MAX_SIZE = 2**31 - 1
"""Any integer size: a dim, a chunk size, a cache window, a wiring segment, window or
persistent-token count."""

MAX_NAME_CHARS = 64
"""Characters of a name: the spec's name, a dim, constant, view, gate, param, state, let,
temporary, the model and its argument."""

MAX_TENSOR_BYTES = 2**34
"""Bytes of one parameter or state tensor (float32, batch 1), 16 GiB."""

MAX_TOTAL_BYTES = 2**36
"""Bytes of all parameters and the state of one sequence together (float32), 64 GiB."""

MAX_QUOTED_CHARS = 60
"""Characters of an offending value quoted in a message (the rest is elided)."""

MAX_MESSAGE_CHARS = 1_000
"""Characters of one diagnostic's message or hint (a backstop: values are quoted short)."""


def quote(value, limit: int = MAX_QUOTED_CHARS) -> str:
    """``repr(value)`` for a message, at most about ``limit`` characters: a longer value is cut
    and says how long it was (``'aaaa…' (800000 characters)``).  ``repr`` escapes control
    characters, so the quote is one inert line."""
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:limit]!r}… ({len(value)} characters)"
    text = repr(value)
    if len(text) > limit + 2:
        return text[:limit] + "…"
    return text


def clip(text: str, limit: int = MAX_QUOTED_CHARS) -> str:
    """``text`` cut to about ``limit`` characters for a message (no quotes added)."""
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters)"

MAX_NS_STEPS = 20
"""The most Newton-Schulz steps ``newton_schulz(X, steps)`` takes (and the longest coefficient schedule)."""

MAX_CG_STEPS = 1000
"""The most conjugate-gradient steps ``cg(A, B, steps)`` takes."""
