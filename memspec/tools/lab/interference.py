"""Interference (``interference``): the probe experiment of the textbook's section 3.4.

A bare matrix memory ``f(q) = q W`` (``d_k = d_v = 2``, eta = 1) takes four writes:

1. ``k = (1, 0) -> v = (1, 0)``   builds the first row;
2. ``k = (0, 1) -> v = (0, 1)``   builds the second row;
3. ``k = (1, 0) -> v = (0, 1)``   the correction: replaces the first target;
4. ``k = (0.8, 0.6) -> v = (1, 0)`` an overlapping key.

Two storage rules, each a spec: ``interference_delta`` (``W = W - eta grad``, the
delta correction) and ``interference_additive`` (``W = W + eta k^T v``).  After every
write the memory is probed at ``(1, 0)`` and ``(0, 1)`` (and at the new key).
With the delta rule the correction replaces the first row exactly; the fourth
write then spills into both old probes by ``eta (q . k4)(v4 - k4 W)``, i.e.
0.8 and 0.6 times the correction ``(1, -1.4)``.
"""
from __future__ import annotations

import torch

from .common import Result, Table, as_tokens, load_spec, probe, run_spec

NAME = "interference"
SUMMARY = "textbook section 3.4: delta correction vs additive storage, probe reads around an overlapping key"

WRITES = [((1.0, 0.0), (1.0, 0.0)), ((0.0, 1.0), (0.0, 1.0)), ((1.0, 0.0), (0.0, 1.0)), ((0.8, 0.6), (1.0, 0.0))]
PROBES = [("probe (1,0)", (1.0, 0.0)), ("probe (0,1)", (0.0, 1.0)), ("key (0.8,0.6)", (0.8, 0.6))]
RULES = [("delta", "interference_delta"), ("additive", "interference_additive")]


def probe_reads(spec_name: str) -> list[torch.Tensor]:
    """Probe reads ``[len(PROBES), 2]`` after each of the four writes."""
    spec = load_spec(spec_name)
    queries = torch.tensor([p for _, p in PROBES], dtype=torch.float64)
    state = {"W": torch.zeros(1, 1, 2, 2, dtype=torch.float64)}
    reads = []
    for k, v in WRITES:
        kt = as_tokens(torch.tensor([k], dtype=torch.float64))
        vt = as_tokens(torch.tensor([v], dtype=torch.float64))
        _, state = run_spec(spec, state=state, q=kt, k=kt, v=vt)
        reads.append(probe(spec, state, queries))
    return reads


def _fmt(v: torch.Tensor) -> str:
    return "(" + ", ".join(f"{float(a):+.2f}" for a in v) + ")"


def run(seed: int = 0) -> Result:
    del seed  # deterministic
    values = {}
    table = Table(["storage", "after write", "k -> v"] + [p for p, _ in PROBES])
    for rule, spec_name in RULES:
        reads = probe_reads(spec_name)
        values[rule] = [[[round(float(a), 6) for a in r] for r in step] for step in reads]
        for i, ((k, v), step) in enumerate(zip(WRITES, reads)):
            table.add(rule, i + 1, f"{k} -> {v}", *[_fmt(r) for r in step])

    def plot(plt):
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.5), sharey=True)
        labels = [f"{p}[{j}]" for p, _ in PROBES[:2] for j in range(2)]
        for ax, (rule, _) in zip(axes, RULES):
            before = [x for r in values[rule][2][:2] for x in r]
            after = [x for r in values[rule][3][:2] for x in r]
            xs = torch.arange(len(labels)).numpy()
            ax.bar(xs - 0.2, before, 0.4, label="before write 4")
            ax.bar(xs + 0.2, after, 0.4, label="after write 4")
            ax.set_xticks(xs, labels, rotation=20)
            ax.axhline(0, color="k", lw=0.5)
            ax.set_title(f"{rule} storage, eta = 1")
        axes[0].legend()
        return fig

    return Result(
        name=NAME,
        title="interference: probe reads q W after each write (eta = 1; textbook section 3.4)",
        tables=[("", table)],
        values=values,
        notes=["Delta: write 3 replaces the first row exactly; write 4 (key overlapping both probes by 0.8 and 0.6)",
               "moves both old reads by (q . k4)(v4 - k4 W) = 0.8 and 0.6 times (1, -1.4).",
               "Additive: nothing is replaced; write 3 makes probe (1,0) read (1, 1) and every write piles on."],
        plot=plot,
    )
