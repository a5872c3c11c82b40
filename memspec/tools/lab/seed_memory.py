"""Neural memory stream (``seed-memory``): the seed snippet's experiment, from specs.

The seed snippet (``../shared/seeds/000_*.txt``) writes 16 random unit key/value
pairs (d = 32), each four times in a random order, into a two-layer GELU MLP memory
(128 hidden units, W1 unit-variance noise, the rest zero: the empty memory
retrieves 0) with momentum; it reports the retrieval MSE over the 16 pairs before
and after the stream: 0.0312 -> 0.0023.

Here the memory is ``specs/lab/seed_titans.yaml`` through ``specs/lab/seed_memory.yaml``
(the same memory reading before each write, so that one token is one retrieval
probe), and two variants by ``extends``: ``seed_memory_no_momentum`` (mu = 0) and
``seed_memory_forget`` (every tensor keeps 1 - alpha of itself per token).  The
random numbers are the snippet's: with ``torch.manual_seed(seed)`` the keys, the
values, the order and W1 are drawn in the snippet's order, and W1 is passed in as
the initial state.

Backend: the compiled module (``memspec.build.build_memory(spec, compile=False)``) when
the compiler is available, else the reference interpreter; the table says which.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .common import Result, Table, as_tokens, expand_state, load_spec, run_spec

NAME = "seed-memory"
SUMMARY = "the seed snippet's neural memory stream: retrieval MSE before/after, with momentum off and forgetting on"

D, HIDDEN, PAIRS, REPEATS = 32, 128, 16, 4
VARIANTS = [("seed snippet (momentum 0.5)", "seed_memory"),
            ("momentum off (mu = 0)", "seed_memory_no_momentum"),
            ("forgetting on (alpha = 0.01)", "seed_memory_forget")]
SNIPPET = (0.0312, 0.0023)  # reported by the seed snippet (seed 0)


def snippet_data(seed: int = 0):
    """The snippet's keys ``[16, 32]``, values ``[16, 32]``, order ``[64]`` and W1 ``[32, 128]``.

    Drawn exactly as the snippet draws them after ``torch.manual_seed(seed)``, without
    disturbing the caller's random state.
    """
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        keys = F.normalize(torch.randn(PAIRS, D), dim=-1)
        values = F.normalize(torch.randn(PAIRS, D), dim=-1)
        order = torch.randperm(PAIRS * REPEATS) % PAIRS
        memory = nn.Sequential(nn.Linear(D, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, D))
        with torch.no_grad():
            memory[0].weight.normal_(0, 1.0)
        w1 = memory[0].weight.detach().T.clone()  # nn.Linear stores [out, in]; the spec's W1 is [d_k, hidden]
    return keys, values, order, w1


def initial_state(spec, w1: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every state of the spec at zero, except W1 = the snippet's unit-variance draw."""
    from ...reference import init_state

    with torch.random.fork_rng():
        state = init_state(spec, 1, 1)
    state = {k: torch.zeros_like(v) for k, v in state.items()}
    state["W1"] = w1[None, None].to(state["W1"].dtype)
    return state


def backend(spec, compiled: bool = True) -> tuple[Callable, str]:
    """``forward(state, q=, k=, v=) -> (o, state)`` of the compiled module, else of the interpreter."""
    if compiled:
        from ...pipeline.build import build_memory

        memory = build_memory(spec, compile=False)

        def forward(state, **views):
            return memory(**views, state=state, schedule="online")

        return forward, "compiled module"

    def interpret(state, **views):
        return run_spec(spec, state=state, **views)

    return interpret, "reference interpreter"


def retrieval_mse(forward, state, keys, values) -> float:
    """Mean squared error of reading every key (one probe token per batch row, read before write)."""
    n = keys.shape[0]
    q = keys.reshape(n, 1, 1, -1)
    with torch.no_grad():
        out, _ = forward(expand_state(state, n), q=q, k=q, v=values.reshape(n, 1, 1, -1))
    return float(((out[:, 0, 0] - values) ** 2).mean())


def stream(spec_name: str, seed: int = 0, *, compiled: bool = True):
    """Run one variant over the snippet's stream; returns before, after, online errors, backend."""
    spec = load_spec(spec_name)
    keys, values, order, w1 = snippet_data(seed)
    forward, label = backend(spec, compiled)
    state0 = initial_state(spec, w1)
    before = retrieval_mse(forward, state0, keys, values)
    ks, vs = as_tokens(keys[order]), as_tokens(values[order])
    with torch.no_grad():
        out, state = forward({k: v.clone() for k, v in state0.items()}, q=ks, k=ks, v=vs)
    online = ((out[0, :, 0] - values[order]) ** 2).mean(-1)  # each token's retrieval before its write
    after = retrieval_mse(forward, state, keys, values)
    return before, after, online, label


def run(seed: int = 0) -> Result:
    table = Table(["variant", "MSE empty", "MSE after stream", "after / before"])
    values, curves, labels = {}, {}, set()
    for label, spec_name in VARIANTS:
        before, after, online, how = stream(spec_name, seed)
        labels.add(how)
        values[spec_name] = {"before": before, "after": after}
        curves[label] = online
        table.add(label, before, after, after / before)
    if seed == 0:
        table.add("(seed snippet, reported)", SNIPPET[0], SNIPPET[1], SNIPPET[1] / SNIPPET[0])
    values["backend"] = ", ".join(sorted(labels))

    def plot(plt):
        fig, ax = plt.subplots(figsize=(7, 3.5))
        for label, err in curves.items():
            ax.plot(err.numpy(), label=label)
        ax.set_yscale("log")
        ax.set_xlabel("token of the stream")
        ax.set_ylabel("retrieval MSE of the token's key before its write")
        ax.set_title("neural memory stream (each pair recurs 4x)")
        ax.legend(fontsize=8)
        return fig

    return Result(
        name=NAME,
        title=(f"seed-memory: retrieval MSE over the {PAIRS} pairs, empty memory -> after the {PAIRS * REPEATS}-token "
               f"stream (seed {seed}; run by the {values['backend']})"),
        tables=[("", table)],
        values=values,
        notes=["Momentum carries each surprise into the following steps; with forgetting on, early pairs fade."],
        plot=plot,
    )
