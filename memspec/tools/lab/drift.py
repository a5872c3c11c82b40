"""Regression that tracks (``drift``).

A linear regression ``y_t = x_t . w*_t + noise`` whose true weights ``w*_t`` take a
random walk.  Three online estimators, each a spec in ``specs/lab/``:

* ``uniform_ls``    -- exact ridge solve over all the past: ``H = H + x x^T``, ``G = G + x y``;
* ``decayed_ls``    -- the same with discount gamma = 0.95: ``H = 0.95 H + x x^T``, ...;
* ``implicit_step`` -- Longhorn's closed-form online step, ``eps = eta / (1 + eta |x|^2)``.

Each spec reads before it writes (``order: read_write``) with query = key = x_t,
so token t predicts y_t from the strict past.  The error is the squared
prediction error ``(y_hat_t - y_t)^2`` averaged over the last 500 steps
(observation noise included: its floor is noise^2 = 0.25).  The same is run on a
stationary stream (no drift), where uniform least squares wins.
"""
from __future__ import annotations

import torch

from .common import Result, Table, as_tokens, load_spec, mean_last, run_spec

NAME = "drift"
SUMMARY = "regression that tracks: uniform vs decayed least squares vs the implicit step under drift"

ESTIMATORS = [("uniform LS", "uniform_ls"), ("decayed LS", "decayed_ls"), ("implicit step", "implicit_step")]
SEED_REPORTED = {"uniform LS": 0.99, "decayed LS": 0.29, "implicit step": 0.30}

D = 4          # input width
STEPS = 1500   # stream length
LAST = 500     # the error is averaged over the last LAST steps
WALK = 0.015   # std of the random walk of each true weight per step
NOISE = 0.5    # observation noise std


def make_stream(seed: int, steps: int = STEPS, *, drift: bool = True, d: int = D):
    """``x [T, d]``, ``y [T]``, true weights ``w [T, d]`` (float64, reproducible from ``seed``)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(steps, d, generator=g, dtype=torch.float64)
    walk = torch.randn(steps, d, generator=g, dtype=torch.float64) * (WALK if drift else 0.0)
    w = torch.randn(d, generator=g, dtype=torch.float64) + walk.cumsum(0)
    y = (x * w).sum(-1) + NOISE * torch.randn(steps, generator=g, dtype=torch.float64)
    return x, y, w


def predictions(spec_name: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One-step-ahead predictions ``[T]`` of the estimator ``spec_name`` on the stream."""
    spec = load_spec(spec_name)
    xs, ys = as_tokens(x.float()), as_tokens(y.float())
    out, _ = run_spec(spec, q=xs, k=xs, v=ys)
    return out[0, :, 0, 0].double()


def run(seed: int = 0, *, steps: int = STEPS, last: int = LAST) -> Result:
    table = Table(["estimator", "drifting", "stationary", "seed notes (drifting)"])
    values: dict[str, dict[str, float]] = {"drifting": {}, "stationary": {}}
    curves = {}
    streams = {case: make_stream(seed, steps, drift=case == "drifting") for case in values}
    for label, spec_name in ESTIMATORS:
        for case, (x, y, _) in streams.items():
            err = (predictions(spec_name, x, y) - y) ** 2
            values[case][label] = mean_last(err, last)
            if case == "drifting":
                curves[label] = err
        table.add(label, values["drifting"][label], values["stationary"][label], SEED_REPORTED[label])

    def plot(plt):
        fig, ax = plt.subplots(figsize=(7, 3.5))
        k = 50
        for label, err in curves.items():
            smooth = torch.nn.functional.avg_pool1d(err[None, None].float(), k, 1)[0, 0]
            ax.plot(range(k - 1, len(err)), smooth.numpy(), label=label)
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel(f"squared prediction error ({k}-step mean)")
        ax.set_title("regression that tracks: drifting weights")
        ax.legend()
        return fig

    return Result(
        name=NAME,
        title=(f"drift: mean squared one-step prediction error over the last {last} of {steps} steps "
               f"(d = {D}, walk {WALK}/step, noise std {NOISE}; seed {seed})"),
        tables=[("", table)],
        values=values,
        notes=["Drifting truth: uniform LS goes stale; decayed LS and the implicit step track.",
               "Stationary truth: uniform LS wins; forgetting costs efficiency."],
        plot=plot,
    )
