"""Three characters (``characters``): three estimators on one noisy 1-D regression stream.

The stream: ``x ~ U(-3, 3)``, ``y = sin(1.5 x) + 0.3 * noise``, 100 tokens.

* ``kernel_smoother`` -- softmax attention over a cache as a Nadaraya-Watson
  estimator.  Views built from x: ``q = [x, 1]``, ``k = [x, -x^2/2]``, ``v = y``;
  with scale ``1/sigma^2`` the attention weight of a past token is proportional to
  ``exp(-(x - x_j)^2 / (2 sigma^2))``  (sigma = 0.1).
* ``delta_rule``      -- one pass of the delta rule on 30 Gaussian bump features of
  x (centres on [-3, 3], width = spacing), eta = 0.1.
* ``uniform_ls``      -- the batch least-squares solve over the same features
  (``H = sum phi phi^T``, ``G = sum phi y``, read ``phi (H + 1e-3 I)^-1 G``): after the
  whole stream, its read is the batch solve.

Each memory is run over the stream, then its final state is probed on a grid.
Printed per estimator: the mean squared error against the true function on the
grid, the mean squared residual at the data points, the roughness (mean squared
second derivative of the fit on the grid) and the amplitude (std of the fit over
std of the truth, on the grid).  Characters: the kernel smoother is faithful and
ragged, the one-pass delta rule smooth and shallow, the batch solve threads the
noise (smallest residual, roughest fit).
"""
from __future__ import annotations

import torch

from .common import Result, Table, as_tokens, load_spec, probe, run_spec

NAME = "characters"
SUMMARY = "three characters: kernel smoother vs one-pass delta rule vs batch least squares on a 1-D stream"

N = 100
NOISE = 0.3
LO, HI = -3.0, 3.0
FEATURES = 30
GRID = 301


def truth(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(1.5 * x)


def make_stream(seed: int, n: int = N):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, generator=g, dtype=torch.float64) * (HI - LO) + LO
    y = truth(x) + NOISE * torch.randn(n, generator=g, dtype=torch.float64)
    return x, y


def bumps(x: torch.Tensor, r: int = FEATURES) -> torch.Tensor:
    """Gaussian bump features ``[N, r]``: centres evenly on [LO, HI], width = their spacing."""
    centres = torch.linspace(LO, HI, r, dtype=x.dtype)
    width = (HI - LO) / (r - 1)
    return torch.exp(-((x[:, None] - centres) ** 2) / (2 * width**2))


def smoother_views(x: torch.Tensor):
    """Nadaraya-Watson as attention: ``q = [x, 1]``, ``k = [x, -x^2/2]``."""
    return torch.stack([x, torch.ones_like(x)], -1), torch.stack([x, -0.5 * x**2], -1)


def fit(which: str, x: torch.Tensor, y: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """Stream ``(x, y)`` through the memory ``which``, then read it at ``at``: ``-> [len(at)]``."""
    x, y, at = x.float(), y.float(), at.float()
    if which == "kernel smoother":
        spec = load_spec("kernel_smoother")
        q, k = smoother_views(x)
        qa, _ = smoother_views(at)
    else:
        spec = load_spec("delta_rule" if which == "one-pass delta" else "uniform_ls").with_dims(d_k=FEATURES)
        q = k = bumps(x)
        qa = bumps(at)
    _, state = run_spec(spec, q=as_tokens(q), k=as_tokens(k), v=as_tokens(y))
    return probe(spec, state, qa)[:, 0].double()


ESTIMATORS = ["kernel smoother", "one-pass delta", "batch solve"]


def roughness(f: torch.Tensor, h: float) -> float:
    return float(((f[2:] - 2 * f[1:-1] + f[:-2]) / h**2).pow(2).mean())


def run(seed: int = 0) -> Result:
    x, y = make_stream(seed)
    grid = torch.linspace(LO, HI, GRID, dtype=torch.float64)
    h = (HI - LO) / (GRID - 1)
    tg = truth(grid)
    table = Table(["estimator", "MSE vs truth", "residual on data", "roughness", "amplitude"])
    values: dict[str, dict[str, float]] = {}
    fits = {}
    for which in ESTIMATORS:
        both = fit(which, x, y, torch.cat([grid, x]))
        fg, fx = both[:GRID], both[GRID:]
        fits[which] = fg
        values[which] = {
            "mse_truth": float(((fg - tg) ** 2).mean()),
            "residual": float(((fx - y) ** 2).mean()),
            "roughness": roughness(fg, h),
            "amplitude": float(fg.std() / tg.std()),
        }
        v = values[which]
        table.add(which, v["mse_truth"], v["residual"], v["roughness"], v["amplitude"])
    table.add("(truth)", 0.0, float(((truth(x) - y) ** 2).mean()), roughness(tg, h), 1.0)

    def plot(plt):
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.scatter(x.numpy(), y.numpy(), s=10, c="0.6", label="data")
        ax.plot(grid.numpy(), tg.numpy(), "k--", lw=1, label="truth")
        for which, fg in fits.items():
            ax.plot(grid.numpy(), fg.numpy(), label=which)
        ax.set_xlabel("x")
        ax.set_ylabel("y")
        ax.set_title("three characters")
        ax.legend(fontsize=8)
        return fig

    return Result(
        name=NAME,
        title=(f"characters: {N} noisy samples of sin(1.5 x) (noise std {NOISE}), fits read on a {GRID}-point grid "
               f"(seed {seed})"),
        tables=[("", table)],
        values=values,
        notes=["kernel smoother (sigma 0.1): faithful, ragged.  one-pass delta (eta 0.1): smooth, shallow.",
               f"batch solve ({FEATURES} bumps, lam 1e-3): threads the noise (smallest residual, roughest fit)."],
        plot=plot,
    )
