"""Learned bandwidth (``bandwidth``): the kernel smoother's sigma trained by gradient descent
lands where a hand sweep over sigma has its minimum.

The spec ``kernel_smoother_learned`` makes the bandwidth a learned outer-loop
constant: ``params: log_sigma: {shape: []}`` and ``read: attend(q, K, V, exp(-2 *
log_sigma))``.  It reads before it writes, so token t predicts y_t from the strict
past only; the loss is the mean squared prediction error over tokens t >= SKIP
(the first tokens have too little past to say anything).

* Sweep: the loss at SWEEP values of sigma on a log grid, one interpreter run each.
* Learned: ``log_sigma`` trained through the reference interpreter's
  differentiable outputs with ``torch.optim.LBFGS`` (strong-Wolfe line search),
  from the spec's own init (log_sigma = 0, sigma = 1).
"""
from __future__ import annotations

import math

import torch

from .characters import NOISE, make_stream, smoother_views
from .common import Result, Table, as_tokens, load_spec, log_grid, run_spec

NAME = "bandwidth"
SUMMARY = "learned bandwidth: the kernel smoother's sigma trained by gradient descent vs a hand sweep"

TOKENS = 200
SKIP = 10
SWEEP = 21
SIGMA_LO, SIGMA_HI = 0.05, 1.0


def stream_views(seed: int, tokens: int, heads: int = 1):
    x, y = make_stream(seed + 1000, tokens)  # a stream of its own, independent of `characters`
    q, k = smoother_views(x.float())
    rep = lambda a: as_tokens(a).expand(1, tokens, heads, a.shape[-1] if a.dim() > 1 else 1)
    return {"q": rep(q), "k": rep(k), "v": rep(y.float())}, y.float()


def causal_loss(spec, views, y, log_sigma: torch.Tensor) -> torch.Tensor:
    """Mean squared error of each token's prediction from its strict past; one value per head ``[H]``."""
    out, _ = run_spec(spec, params={"log_sigma": log_sigma}, **views)
    err = (out[0, SKIP:, :, 0] - y[SKIP:, None]) ** 2  # [T - SKIP, H]
    return err.mean(0)


def sweep(spec, seed: int, tokens: int, sigmas: torch.Tensor) -> torch.Tensor:
    """The causal loss at each sigma (one interpreter run per value)."""
    views, y = stream_views(seed, tokens)
    with torch.no_grad():
        return torch.cat([causal_loss(spec, views, y, s.log().float().reshape(1)) for s in sigmas]).double()


def learn(spec, seed: int, tokens: int, max_iter: int = 30):
    views, y = stream_views(seed, tokens)
    init = spec.params["log_sigma"].init
    start = float(init) if isinstance(init, (int, float)) else 0.0
    log_sigma = torch.full((1,), start, requires_grad=True)
    opt = torch.optim.LBFGS([log_sigma], lr=1.0, max_iter=max_iter, line_search_fn="strong_wolfe",
                            tolerance_grad=1e-7, tolerance_change=1e-9)
    trace = []

    def closure():
        opt.zero_grad()
        loss = causal_loss(spec, views, y, log_sigma)[0]
        loss.backward()
        trace.append((math.exp(float(log_sigma.detach())), float(loss.detach())))
        return loss

    opt.step(closure)
    return math.exp(float(log_sigma.detach())), trace


def run(seed: int = 0, *, tokens: int = TOKENS) -> Result:
    spec = load_spec("kernel_smoother_learned")
    sigmas = log_grid(SIGMA_LO, SIGMA_HI, SWEEP)
    losses = sweep(spec, seed, tokens, sigmas)
    best = int(losses.argmin())
    learned, trace = learn(spec, seed, tokens)
    step = math.log(float(sigmas[1] / sigmas[0]))
    off = abs(math.log(learned) - math.log(float(sigmas[best]))) / step

    sweep_table = Table(["sigma", "causal MSE", ""])
    for i, (s, l) in enumerate(zip(sigmas.tolist(), losses.tolist())):
        sweep_table.add(s, l, "<- sweep minimum" if i == best else "")
    result_table = Table(["method", "sigma", "causal MSE"])
    result_table.add("hand sweep (argmin)", float(sigmas[best]), float(losses[best]))
    result_table.add(f"learned (LBFGS, {len(trace)} evaluations)", learned, trace[-1][1])
    values = {"sweep_sigma": float(sigmas[best]), "learned_sigma": learned, "sweep_steps_apart": off,
              "sweep_ratio": math.exp(step), "sweep_losses": losses.tolist(), "sigmas": sigmas.tolist(),
              "evaluations": len(trace)}

    def plot(plt):
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(sigmas.numpy(), losses.numpy(), "o-", ms=3, label="hand sweep")
        ax.axvline(learned, color="C3", ls="--", label=f"learned sigma = {learned:.3f}")
        ax.axhline(NOISE**2, color="0.5", lw=0.5, label="noise floor")
        ax.set_xscale("log")
        ax.set_xlabel("sigma")
        ax.set_ylabel("causal prediction MSE")
        ax.set_title("learned bandwidth vs hand sweep")
        ax.legend(fontsize=8)
        return fig

    return Result(
        name=NAME,
        title=(f"bandwidth: kernel smoother on {tokens} tokens, loss = MSE of each prediction from its strict past "
               f"(tokens >= {SKIP}; seed {seed})"),
        tables=[("sweep (log grid, ratio %.3f per step):" % math.exp(step), sweep_table), ("", result_table)],
        values=values,
        notes=[f"learned sigma is {off:.2f} sweep steps from the sweep minimum"],
        plot=plot,
    )
