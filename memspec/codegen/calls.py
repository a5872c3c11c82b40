"""Calls of the runtime kernels, kept as structure until the module's text is written.

A family's body writes each kernel call as a :class:`KernelCall` (its arguments by parameter
name: code, or a constant); the module frame adds arguments to it (the packed documents), then
binds every parameter that all calls of a kernel pass the same constant (:func:`bound_constants`)
-- the kernel's source is specialised to them (:func:`memspec.codegen.specialise.specialise`) and
each call is written without them (:meth:`KernelCall.text`).  No generated text is read back.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class Code:
    """An argument that is an expression of the generated code (its text)."""

    text: str


def _constant(value) -> bool:
    """A value a kernel can be specialised to: None, a bool or a string."""
    return value is None or isinstance(value, (bool, str))


@dataclass(frozen=True)
class KernelCall:
    """``targets = fn(args...)  # comment``.

    ``args``: (parameter name, value, written as a keyword) in the order written; a value is a
    :class:`Code` or a Python constant (None, bool, int, float, str: written with ``repr``)."""

    targets: str
    fn: Callable
    args: tuple = ()
    comment: str | None = None

    @classmethod
    def of(cls, targets: str, fn: Callable, positional: list, keywords: dict | None = None,
           comment: str | None = None) -> "KernelCall":
        """A call with ``positional`` code texts (the text ``None`` is the constant None: an absent
        input) bound to ``fn``'s parameters in order, then ``keywords`` (name -> a constant, or a
        code text wrapped in :class:`Code`)."""
        names = list(inspect.signature(fn).parameters)
        if len(positional) > len(names):
            raise TypeError(f"{fn.__name__} takes {len(names)} arguments, the call writes {len(positional)}")
        args = tuple((n, None if t == "None" else Code(t), False) for n, t in zip(names, positional))
        return cls(targets, fn, args, comment).with_keywords(**(keywords or {}))

    def with_keywords(self, **keywords) -> "KernelCall":
        """The same call with more keyword arguments (values as in :meth:`of`)."""
        names = inspect.signature(self.fn).parameters
        for n in keywords:
            if n not in names:
                raise TypeError(f"{self.fn.__name__} has no parameter {n!r}")
        extra = tuple((n, None if v == Code("None") else v, True) for n, v in keywords.items())
        return KernelCall(self.targets, self.fn, self.args + extra, self.comment)

    def passed(self) -> dict:
        """Parameter name -> the value this call passes."""
        return {n: v for n, v, _ in self.args}

    def text(self, bound=frozenset()) -> str:
        """The call as one line of code, without the parameters in ``bound``."""
        parts = []
        for n, v, keyword in self.args:
            if n in bound:
                continue
            written = v.text if isinstance(v, Code) else repr(v)
            parts.append(f"{n}={written}" if keyword else written)
        line = f"{self.targets} = {self.fn.__name__}({', '.join(parts)})"
        return line + (f"  # {self.comment}" if self.comment else "")


@dataclass
class Placed:
    """A kernel call at an indentation level of the generated lines."""

    level: int
    call: KernelCall
    bound: frozenset = field(default_factory=frozenset)

    def text(self) -> str:
        return "    " * self.level + self.call.text(self.bound)


def bound_constants(fn: Callable, calls: list) -> dict:
    """The parameters of ``fn`` that every one of ``calls`` (:class:`KernelCall`) passes the same
    constant (None, a bool, a string), or that none passes and whose default is such a constant:
    name -> value ({} when nothing calls it)."""
    if not calls:
        return {}
    consts = {}
    for name, p in inspect.signature(fn).parameters.items():
        values = set()
        for c in calls:
            passed = c.passed()
            if name not in passed:
                values.add(("default", p.default) if p.default is not inspect.Parameter.empty else ("none",))
            elif not isinstance(passed[name], Code) and _constant(passed[name]):
                values.add(("const", passed[name]))
            else:
                values.add(("expr",))
        if len(values) == 1:
            (kind, *v), = values
            if kind in ("const", "default") and _constant(v[0]):
                consts[name] = v[0]
    return consts
