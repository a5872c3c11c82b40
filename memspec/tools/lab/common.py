"""Shared plumbing of the lab: loading the lab's specs, running them, probing a state,
rendering tables and (optionally) saving plots.

Every experiment computes through memspec: a spec from ``specs/lab/`` run by the
reference interpreter (:func:`memspec.reference.run`), or for ``seed-memory`` the
compiled module.  Layout as everywhere in memspec: views ``[B, T, H, D]``, gates
``[B, T, H]``, states ``[B, H, ...]``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ...lang.frontend import load
from ...lang.spec import Spec

SPEC_ROOT = Path(__file__).resolve().parents[3] / "specs"
LAB_SPECS = SPEC_ROOT / "lab"


def load_spec(name: str) -> Spec:
    """A spec of the lab by file stem, e.g. ``load_spec("decayed_ls")``."""
    return load(LAB_SPECS / f"{name}.yaml")


def run_spec(spec: Spec, *, state: dict | None = None, params: dict | None = None, **inputs: torch.Tensor):
    """Run ``spec`` online, token by token, with the reference interpreter.

    ``inputs`` are views ``[B, T, H, D]`` and gates ``[B, T, H]``; returns
    ``(outputs [B, T, H, d_out], final_state {name: [B, H, ...]})``.
    """
    from ...reference import run

    return run(spec, state=state, schedule="online", params=params, **inputs)


def expand_state(state: dict[str, torch.Tensor], n: int) -> dict[str, torch.Tensor]:
    """Copy a batch-1 state ``[1, H, ...]`` to ``n`` independent batch rows ``[n, H, ...]``."""
    return {k: v.expand(n, *v.shape[1:]).clone() for k, v in state.items()}


def probe(spec: Spec, state: dict[str, torch.Tensor], queries: torch.Tensor, *, params: dict | None = None,
          **others: torch.Tensor) -> torch.Tensor:
    """Read a memory at ``queries [N, d_q]`` without changing it: ``-> [N, d_out]``.

    The spec must read before it writes (``order: read_write``): each query is
    one token of its own batch row, started from a copy of ``state``; its output
    is the read of that state.  Views other than ``q`` (the token's own write,
    which is discarded) default to zeros of their width.
    """
    if spec.order != "read_write":
        raise ValueError(f"probe needs a read_write spec; {spec.name} is {spec.order}")
    n = queries.shape[0]
    views = {"q": queries.reshape(n, 1, 1, -1)}
    for name, view in spec.views.items():
        if name != "q" and name not in others:
            views[name] = queries.new_zeros(n, 1, 1, spec.dims[view.dim])
    views.update({k: v.expand(n, *v.shape[1:]) if v.shape[0] == 1 else v for k, v in others.items()})
    out, _ = run_spec(spec, state=expand_state(state, n), params=params, **views)
    return out[:, 0, 0]


def as_tokens(a: torch.Tensor) -> torch.Tensor:
    """``[T, D]`` (or ``[T]``) -> one sequence, one head: ``[1, T, 1, D]``."""
    if a.dim() == 1:
        a = a[:, None]
    return a[None, :, None, :]


# ----------------------------------------------------------------- results
@dataclass
class Table:
    """A small text table: a header row and rows of cells (numbers are formatted)."""

    columns: Sequence[str]
    rows: list[Sequence[Any]] = field(default_factory=list)
    digits: int = 4

    def add(self, *cells: Any) -> None:
        self.rows.append(cells)

    def _cell(self, v: Any) -> str:
        if isinstance(v, bool):
            return str(v)
        if isinstance(v, int):
            return str(v)
        if isinstance(v, float):
            if v != 0 and (abs(v) < 10 ** -self.digits or abs(v) >= 1e5):
                return f"{v:.{self.digits - 1}e}"
            return f"{v:.{self.digits}f}"
        return str(v)

    def render(self) -> str:
        cells = [list(self.columns)] + [[self._cell(v) for v in r] for r in self.rows]
        widths = [max(len(r[i]) for r in cells) for i in range(len(self.columns))]

        def line(r):
            return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()

        sep = "  ".join("-" * w for w in widths)
        return "\n".join([line(cells[0]), sep] + [line(r) for r in cells[1:]])

    def markdown(self) -> str:
        head = "| " + " | ".join(self.columns) + " |"
        rule = "|" + "|".join("---" for _ in self.columns) + "|"
        body = ["| " + " | ".join(self._cell(v) for v in r) + " |" for r in self.rows]
        return "\n".join([head, rule] + body)


@dataclass
class Result:
    """What an experiment returns: tables to print, numbers for tests, an optional plot."""

    name: str
    title: str
    tables: list[tuple[str, Table]]
    values: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    plot: Callable[[Any], Any] | None = None  # plot(pyplot) -> figure

    def render(self) -> str:
        out = [self.title, ""]
        for caption, table in self.tables:
            if caption:
                out.append(caption)
            out.append(table.render())
            out.append("")
        out.extend(self.notes)
        return "\n".join(out).rstrip() + "\n"


def matplotlib_pyplot():
    """``matplotlib.pyplot`` with a file backend, or None when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_plot(result: Result, out: Path) -> Path | None:
    """Save ``result``'s plot to ``out/<name>.png``; None (no-op) without matplotlib."""
    if result.plot is None:
        return None
    plt = matplotlib_pyplot()
    if plt is None:
        return None
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{result.name}.png"
    fig = result.plot(plt)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def mean_last(errors: torch.Tensor, n: int) -> float:
    return float(errors[-n:].mean())


def log_grid(lo: float, hi: float, n: int) -> torch.Tensor:
    return torch.logspace(math.log10(lo), math.log10(hi), n, dtype=torch.float64)
