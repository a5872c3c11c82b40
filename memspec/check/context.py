"""What every check of the verifier shares: the spec, its graph, the diagnostics collected so far,
and the facts the declaration checks learn for the later ones (names that are no safe
identifier, names declared twice, the section that declares each name)."""
from __future__ import annotations

from typing import Iterable, Optional

import networkx as nx

from ..lang.errors import Collector, Span
from ..lang.expr import Expr
from ..lang.limits import MAX_QUOTED_CHARS, quote

# section key in the spec -> the word used in messages
SECTIONS = (
    ("dims", "dim"),
    ("constants", "constant"),
    ("views", "view"),
    ("gates", "gate"),
    ("params", "param"),
    ("state", "state"),
    ("let", "let"),
)

# the codes of diagnostics after which the graph is incomplete
EXPRESSION_CODES = frozenset({"E-unknown-name", "E-unknown-function", "E-arity", "E-shape", "E-grad",
                              "E-cache", "E-cycle", "E-unknown-dim"})


class CheckContext:
    """One verification: the spec, its graph, the diagnostics, and what the checks learn."""

    def __init__(self, spec, graph: nx.DiGraph):
        self.spec = spec
        self.g = graph
        self.d = Collector()
        self.bad_names: set[str] = set()   # declared names that are not safe identifiers
        self.dup_names: set[str] = set()   # names declared in two sections
        self.first_kind: dict[str, str] = {}   # name -> the word of the section that declares it first

    def span(self, *path) -> Optional[Span]:
        return self.spec.key_span(*path) or self.spec.span(*path)

    def other_exprs(self) -> Iterable[tuple[str, Expr]]:
        """Every expression outside the update statements, with where it stands (``gate eta``)."""
        spec = self.spec
        for n, gt in spec.gates.items():
            yield f"gate {n}", gt.formula
        for n, e in spec.let.items():
            yield f"let {n}", e
        if spec.model is not None:
            yield "the model", spec.model.body
        if spec.loss is not None:
            yield "the loss", spec.loss
        yield "the read", spec.read

    def all_exprs(self) -> Iterable[Expr]:
        """Every expression of the spec, the update statements' included."""
        for _, e in self.other_exprs():
            yield e
        for st in self.spec.update:
            yield st.value

    def expression_errors(self) -> bool:
        """Whether an expression failed to type: the graph is then incomplete."""
        return any(d.severity == "error" and d.code in EXPRESSION_CODES for d in self.d.items)


def quoted(name: str) -> str:
    """A name quoted for messages; odd names are shown with their escapes."""
    if isinstance(name, str) and name.isprintable() and "'" not in name and len(name) <= MAX_QUOTED_CHARS:
        return f"'{name}'"
    return quote(name)
