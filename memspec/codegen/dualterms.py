"""Terms of the dual form's chunk algebra (:mod:`memspec.codegen.dualchunk`): the coefficients
``[B, H, C]``, weights ``[B, H, C, C]`` and products the chunk step combines, as objects.

Every decision the writer makes -- is a coefficient 1 (its product vanishes), a Python number
(no batch axes: it scales instead of broadcasting), the same value bound earlier (reuse the
local), read from the chunk's inputs alone (``_chunk_pre`` computes it) -- is made on these
objects; their code text is rendered once, when a line binds one to a local
(:meth:`Term.render`, parentheses from the operators' precedence).
"""
from __future__ import annotations

from dataclasses import dataclass

from .exprs import P_ADD, P_ATOM, P_MUL


class Term:
    """A value of the chunk algebra (frozen dataclasses: equal terms compute the same value)."""

    prec = P_ATOM

    @property
    def names(self) -> frozenset:
        """The locals and inputs the term reads."""
        return frozenset().union(*(t.names for t in self.parts()))

    @property
    def number(self) -> bool:
        """A Python number (no tensor axes)."""
        return False

    @property
    def one(self) -> bool:
        """Exactly 1 (a factor that vanishes)."""
        return False

    def parts(self) -> tuple:
        return ()

    def render(self) -> str:
        raise NotImplementedError

    def at(self, prec: int) -> str:
        """The code, parenthesised if it binds looser than ``prec``."""
        return self.render() if self.prec >= prec else f"({self.render()})"


@dataclass(frozen=True)
class Ref(Term):
    """A leaf: a local or input (``local``), a number (``value`` when known at compile time), or
    a piece of code this package wrote for a fixed construct, with its precedence and the
    locals it reads (``reads``)."""

    code: str
    prec: int = P_ATOM
    local: bool = False
    is_number: bool = False
    value: float | None = None
    reads: frozenset = frozenset()

    @property
    def names(self) -> frozenset:
        return frozenset({self.code}) if self.local else self.reads

    @property
    def number(self) -> bool:
        return self.is_number

    @property
    def one(self) -> bool:
        return self.value is not None and float(self.value) == 1.0

    def render(self) -> str:
        return self.code


def local(name: str) -> Ref:
    """A local (or input) of the generated code."""
    return Ref(name, local=True)


def number(value: float) -> Ref:
    """A float known now: its literal."""
    return Ref(repr(float(value)), is_number=True, value=float(value))


def method(x: str, attr: str) -> Ref:
    """``x.attr`` of the local ``x`` (an attribute, a method to call, an index of it)."""
    return Ref(f"{x}.{attr}", reads=frozenset({x}))


ONE = Ref("1", is_number=True, value=1.0)   # the coefficient of a state in itself, unchanged


@dataclass(frozen=True)
class Sum(Term):
    """``a + b + ...`` (left to right, as written)."""

    terms: tuple
    prec = P_ADD

    @staticmethod
    def of(*terms: Term) -> Term:
        """The sum of ``terms`` (nested sums flattened in order; one term: itself)."""
        flat: list = []
        for t in terms:
            flat.extend(t.terms if isinstance(t, Sum) else (t,))
        return flat[0] if len(flat) == 1 else Sum(tuple(flat))

    def parts(self) -> tuple:
        return self.terms

    @property
    def number(self) -> bool:
        return all(t.number for t in self.terms)

    def render(self) -> str:
        return " + ".join(t.at(P_ADD) for t in self.terms)


@dataclass(frozen=True)
class Op(Term):
    """``left * right`` or ``left @ right``."""

    op: str
    left: Term
    right: Term
    prec = P_MUL

    def parts(self) -> tuple:
        return (self.left, self.right)

    @property
    def number(self) -> bool:
        return self.op == "*" and self.left.number and self.right.number

    def render(self) -> str:
        return f"{self.left.at(P_MUL)} {self.op} {self.right.at(P_MUL + 1)}"


def mul(a: Term, b: Term) -> Term:
    """``a * b``, a factor 1 left out."""
    if a.one:
        return b
    if b.one:
        return a
    return Op("*", a, b)


def matmul(a: Term, b: Term) -> Term:
    return Op("@", a, b)


@dataclass(frozen=True)
class Post(Term):
    """``x`` followed by a method call or an index, e.g. ``x.unsqueeze(-1)``, ``x[..., -1]``."""

    base: Term
    suffix: str

    def parts(self) -> tuple:
        return (self.base,)

    def render(self) -> str:
        return self.base.at(P_ATOM) + self.suffix


@dataclass(frozen=True)
class Group(Term):
    """``(x)``: parentheses kept for the reader (a product of scores and weights)."""

    inner: Term

    def parts(self) -> tuple:
        return (self.inner,)

    def render(self) -> str:
        return f"({self.inner.render()})"


@dataclass(frozen=True)
class Call(Term):
    """``fn(args..., key=value...)``; ``fn`` a function's name or a term (a local's method)."""

    fn: str | Term
    args: tuple = ()
    kwargs: tuple = ()   # (name, term) pairs

    def parts(self) -> tuple:
        head = (self.fn,) if isinstance(self.fn, Term) else ()
        return head + self.args + tuple(t for _, t in self.kwargs)

    def render(self) -> str:
        args = [a.render() for a in self.args] + [f"{k}={t.render()}" for k, t in self.kwargs]
        fn = self.fn.render() if isinstance(self.fn, Term) else self.fn
        return f"{fn}({', '.join(args)})"


def scaled(c: Term, x: Term, axes: str = ".unsqueeze(-1)") -> Term:
    """``c`` (a coefficient ``[B, H, C]`` or a number) times ``x``, whose extra axes after
    ``C`` the coefficient gains with ``axes``."""
    if c.one:
        return x
    return Op("*", c if c.number else Post(c, axes), x)
