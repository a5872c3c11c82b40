"""The comparison table: one row per spec, every column derived from the spec's algebra.

``rows(specs)`` reads each spec the way the seed text reads the papers and never
looks at its name:

* **optimizer features** from the update program (:mod:`.features`): retention and
  decay, gradient steps and their step sizes, momentum, forgetting, per-token or constant
  coefficients; the optimizer, the loss window and the update frequency.
* **problem reached** and **main mechanism** from a ladder of derived features:
  a cache (retain entries, read by matching) -> an additive fixed-size summary
  (numerator matrix and normalisation vector when the read divides by a vector
  state) -> a gradient write into a model linear in its state (error-based write)
  -> a model non-linear in its state (an inner learner) -> extras: momentum,
  decay, a non-quadratic inner loss, an implicit key-dependent step, a wiring.
* **costs** per token and head of a write and a read, from the shapes (:mod:`.costs`).
* **schedule** from :func:`memspec.schedule.analyse`.

``render_table(rows, "markdown" | "text" | "csv")`` prints them.
"""
from __future__ import annotations

import csv
import io
from collections import Counter
from dataclasses import dataclass, fields
from typing import Iterable, Optional

from ..lang.errors import printable
from ..lang.fmt import value_text
from ..lang.spec import Spec
from .costs import Coster, cost_text
from .diff import WIRING_FIELDS, derived_schedule
from .features import Feature, Features, features, inline_lets, loss_window, optimizer_kind, update_frequency
from .mathtext import mname, render

# ----------------------------------------------------- problem / mechanism
LEVELS = ("cache", "additive", "error", "learner")


def ladder(spec: Spec, ft: Features) -> tuple[str, str]:
    """(problem reached, main mechanism), from the derived features."""
    if ft.cache:
        level, problem = "cache", "Retain individual key/value entries and read them by matching"
        mech = "explicit key/value cache read by softmax matching"
        if any(s.window for s in spec.state.values()):
            mech += " over a sliding window"
    elif ft.grad_write and ft.model_linear:
        level, problem = "error", "Correct an existing association instead of only adding"
        mech = ("error-based write into fast weights" if ft.loss_kind == "squared error"
                else f"gradient write of a {ft.loss_kind or 'custom'} loss into fast weights")
    elif ft.grad_write:
        level, problem = "learner", "Choose a richer state and learn what its local task should be"
        parts = ["inner learner", "learned views"]
        if ft.learned_init or spec.params:
            parts.append("outer objective")
        mech = ", ".join(parts)
    elif ft.solve_read:
        level, problem = "additive", "Read the least-squares fit of all stored associations"
        mech = "key/value statistics read by " + ("a fixed number of conjugate-gradient steps on the least-squares "
                                                  "system" if ft.cg_read else "an exact least-squares solve")
    else:
        level, problem = "additive", "Avoid scanning a growing list with a suitable similarity"
        ranks = sorted({len(s.shape) for s in spec.state.values()})
        mech = ("recurrent numerator matrix and normalisation vector" if ft.ratio_read and 1 in ranks and 2 in ranks
                else "recurrent additive summary")
    extras = []
    if ft.momentum:
        extras.append("momentum")
    if ft.forget:
        extras.append("decay")
    if ft.implicit_step:
        extras.append("implicit key-dependent step")
    if ft.window:
        extras.append("window loss")
    if level == "learner" and ft.loss_kind not in ("", "squared error", "weighted squared error"):
        extras.append(f"{ft.loss_kind} inner loss")
    wired = spec.wiring.kind != "none"
    if wired:
        extras.append(f"memory-attention wiring ({spec.wiring.kind.upper()})")
    if not extras:
        return problem, _cap(mech)
    if ft.momentum or ft.forget:
        extra_problem = "manage continuing writes" + (" and combine history with local context" if wired else "") \
            + ("; memorise the recent context, not only the current token" if ft.window else "")
    elif wired:
        extra_problem = "combine history with local context"
    elif ft.implicit_step:
        extra_problem = "keep each write stable whatever the key's norm"
    elif ft.window:
        extra_problem = "memorise the recent context, not only the current token"
    else:
        extra_problem = "choose what the inner objective penalises"
    if level == "learner":  # the extras are what is new beyond an inner learner
        return _cap(extra_problem), _cap(", ".join(extras))
    return f"{problem}; {extra_problem}", _cap(", ".join([mech] + extras))


def _cap(s: str) -> str:
    return s[:1].upper() + s[1:]


# -------------------------------------------------------------------- rows
COLUMNS = (
    ("spec", "spec"), ("problem", "problem reached"), ("mechanism", "main mechanism"),
    ("state", "state"), ("write", "write rule"), ("loss", "loss"),
    ("step", "step"), ("momentum", "momentum"), ("forget", "forget"),
    ("optimizer", "optimizer"), ("window", "loss window"), ("frequency", "update frequency"),
    ("read", "read"), ("schedule", "schedule"), ("wiring", "wiring"),
    ("write_cost", "write cost"), ("read_cost", "read cost"), ("cite", "citation"),
)


@dataclass(frozen=True)
class Row:
    spec: str
    problem: str
    mechanism: str
    state: str
    write: str
    loss: str
    step: str
    momentum: str
    forget: str
    optimizer: str
    window: str
    frequency: str
    read: str
    schedule: str
    wiring: str
    write_cost: str
    read_cost: str
    cite: str


def _feature_text(f: Optional[Feature], states: tuple[str, ...] = ()) -> str:
    if f is None:
        return "—"
    s = f.text + (", per token" if f.per_token else ", constant") + (", per channel" if f.per_channel else "")
    if states:
        s += " (" + ", ".join(mname(x) for x in states) + ")"
    return s


def _state_text(spec: Spec, cache_axis: str) -> str:
    out = []
    for n, s in spec.state.items():
        if s.cache:
            shape = ([f"≤{s.window}"] if s.window else [cache_axis]) + list(s.shape)
            out.append(f"{mname(n)} cache [{', '.join(shape)}]")
        else:
            out.append(f"{mname(n)} [{', '.join(s.shape)}]" + (" learned init" if s.learned else ""))
    return ", ".join(out)


def _schedule_text(spec: Spec) -> str:
    d = derived_schedule(spec)
    s = d.family + (f" chunk {d.chunk}" if d.chunk else "")
    return s + (", exact" if d.exact else ", approximate")


def _wiring_text(spec: Spec) -> str:
    w = spec.wiring
    if w.kind == "none":
        return "none"
    return w.kind.upper() + " (" + ", ".join(f"{f} {value_text(getattr(w, f))}" for f in WIRING_FIELDS[w.kind]) + ")"


def _cite_text(spec: Spec) -> str:
    return spec.cite.split(";")[0].strip()


def row(spec: Spec) -> Row:
    ft = features(spec)
    problem, mech = ladder(spec, ft)
    coster = Coster(spec)
    write_cost: Counter = Counter()
    for st in spec.update:
        write_cost += coster.cost(inline_lets(spec, st.value))
    read_cost = coster.cost(inline_lets(spec, spec.read))
    axis = coster.env.cache_axis
    loss = "—"
    if spec.loss is not None:
        loss = f"{ft.loss_kind}: {render(spec.loss)}"
    step = _feature_text(ft.step)
    if ft.step is not None and ft.step.text in {mname(n) for n in spec.let}:
        name = next(n for n in spec.let if mname(n) == ft.step.text)
        step = f"{ft.step.text} = {render(spec.let[name])}" + step[len(ft.step.text):]
    if ft.step is not None and ft.step_kind == "additive":
        step += " (additive write)"
    return Row(
        spec=spec.name, problem=problem, mechanism=mech,
        state=_state_text(spec, axis),
        write="; ".join(f"{mname(s.target)} {'←' if s.target in spec.state else '='} {render(s.value)}"
                        for s in spec.update) or "—",
        loss=loss,
        step=step,
        momentum=_feature_text(ft.momentum, ft.momentum_states),
        forget=_feature_text(ft.forget, ft.forget_states),
        optimizer=optimizer_kind(spec, ft),
        window=loss_window(spec),
        frequency=update_frequency(spec),
        read=render(spec.read),
        schedule=_schedule_text(spec),
        wiring=_wiring_text(spec),
        write_cost=cost_text(write_cost, spec, axis),
        read_cost=cost_text(read_cost, spec, axis),
        cite=_cite_text(spec),
    )


def rows(specs: Iterable[Spec]) -> list[Row]:
    return [row(s) for s in specs]


# --------------------------------------------------------------- rendering
def render_table(rs: list[Row], fmt: str = "markdown") -> str:
    keys = [k for k, _ in COLUMNS]
    heads = [h for _, h in COLUMNS]
    # spec text (citations, names, formulas) is printed escaped: no terminal control characters
    rs = [Row(**{f.name: printable(getattr(r, f.name)) for f in fields(Row)}) for r in rs]
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(heads)
        for r in rs:
            w.writerow([getattr(r, k) for k in keys])
        return buf.getvalue()
    if fmt == "text":
        width = max(len(h) for h in heads)
        blocks = []
        for r in rs:
            lines = [r.spec]
            for k, h in COLUMNS[1:]:
                lines.append(f"  {h.ljust(width)}  {getattr(r, k)}")
            blocks.append("\n".join(lines))
        return "\n\n".join(blocks) + ("\n" if blocks else "")
    if fmt != "markdown":
        raise ValueError(f"unknown table format {fmt!r}: use markdown, text or csv")

    def cell(s: str) -> str:
        return s.replace("|", "\\|").replace("\n", " ")

    out = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for r in rs:
        out.append("| " + " | ".join(cell(getattr(r, k)) for k in keys) + " |")
    return "\n".join(out) + "\n"
