"""specs/lab/seed_titans.yaml reproduces the seed snippet (../shared/seeds/000_*.txt).

The snippet trains a two-layer GELU MLP memory online with momentum on a stream of
16 normalised key/value pairs, each recurring 4 times, and prints the retrieval MSE
of the empty memory and after the stream.  Here the snippet's own loop runs (its
data, its initial tensors, ``torch.func.grad`` + ``functional_call``), and the
reference interpreter runs the spec on the same stream from the same initial
tensors; the two retrieval MSEs must agree to 1e-6.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad

import memspec
from memspec import reference as R

SPEC = Path(__file__).resolve().parent.parent / "specs" / "lab" / "seed_titans.yaml"


def snippet():
    """The seed snippet, statement for statement; returns its data, initial params and MSEs."""
    torch.manual_seed(0)
    d_mem, h_mem, num_pairs = 32, 128, 16
    k_pairs = nn.functional.normalize(torch.randn(num_pairs, d_mem), dim=-1)
    v_pairs = nn.functional.normalize(torch.randn(num_pairs, d_mem), dim=-1)
    order = torch.randperm(num_pairs * 4) % num_pairs  # Each pair recurs 4x
    memory = nn.Sequential(nn.Linear(d_mem, h_mem), nn.GELU(), nn.Linear(h_mem, d_mem))
    with torch.no_grad():
        memory[0].weight.normal_(0, 1.0)  # Unit-variance hidden units
        memory[0].bias.zero_()
        memory[2].weight.zero_()  # Start empty: retrieve 0 everywhere
        memory[2].bias.zero_()

    def recall_loss(params, k, v):
        return ((functional_call(memory, params, (k[None],))[0] - v) ** 2).sum()

    grad_fn = grad(recall_loss)

    def retrieval_mse(params):
        with torch.no_grad():
            pred = functional_call(memory, params, (k_pairs,))
            return float(((pred - v_pairs) ** 2).mean())

    params = {name: p.detach().clone() for name, p in memory.named_parameters()}
    initial = {name: p.clone() for name, p in params.items()}
    velocity = {name: torch.zeros_like(p) for name, p in params.items()}
    before = retrieval_mse(params)
    theta, eta = 0.005, 0.5
    for t in order.tolist():
        g = grad_fn(params, k_pairs[t], v_pairs[t])  # Surprise
        for name in params:
            velocity[name] = eta * velocity[name] - theta * g[name]
            params[name] = params[name] + velocity[name]
    after = retrieval_mse(params)
    return dict(k_pairs=k_pairs, v_pairs=v_pairs, order=order, initial=initial,
                final=params, before=before, after=after)


@pytest.fixture(scope="module")
def seed():
    with torch.random.fork_rng():
        return snippet()


def as_state(p: dict) -> dict:
    """nn.Linear parameters -> the spec's row-vector state ``[B=1, H=1, ...]``."""
    return {
        "W1": p["0.weight"].T[None, None], "b1": p["0.bias"][None, None],
        "W2": p["2.weight"].T[None, None], "b2": p["2.bias"][None, None],
    }


def interpreter_mse(spec, state, seed) -> float:
    pred = R.apply_model(spec, state, seed["k_pairs"][None, None])   # [1, 1, 16, 32]
    return float(((pred[0, 0] - seed["v_pairs"]) ** 2).mean())


def test_spec_matches_the_snippet_constants():
    spec = memspec.load(SPEC)
    assert spec.dims["d_k"] == spec.dims["d_v"] == 32 and spec.dims["hidden"] == 128
    assert spec.constants == {"eta": 0.005, "mu": 0.5}
    assert spec.state["W1"].init == "normal(1.0)"
    assert spec == memspec.load(SPEC.with_suffix(".mem"))


def test_seed_titans_retrieval_mse_before_and_after_the_stream(seed):
    spec = memspec.load(SPEC)
    k = seed["k_pairs"][seed["order"]][None, :, None, :]   # [B=1, T=64, H=1, 32]
    v = seed["v_pairs"][seed["order"]][None, :, None, :]
    state0 = as_state(seed["initial"])
    before = interpreter_mse(spec, {**R.init_state(spec, 1, 1), **state0}, seed)
    with torch.no_grad():
        out, final = R.run(spec, state=state0, q=k, k=k, v=v)
    after = interpreter_mse(spec, final, seed)
    print(f"snippet:     retrieval MSE {seed['before']:.7f} -> {seed['after']:.7f}")
    print(f"interpreter: retrieval MSE {before:.7f} -> {after:.7f}")
    assert out.shape == (1, 64, 1, 32)
    assert abs(before - seed["before"]) < 1e-6
    assert abs(after - seed["after"]) < 1e-6
    # the figures the seed prints
    assert f"{seed['before']:.4f}" == "0.0312" and f"{before:.4f}" == "0.0312"
    assert f"{seed['after']:.4f}" == "0.0023" and f"{after:.4f}" == "0.0023"
    assert after < before / 5
    # and the final memory tensors themselves agree
    for name, t in as_state(seed["final"]).items():
        assert torch.allclose(final[name], t, atol=1e-5, rtol=0), name


def test_seed_titans_empty_memory_retrieves_zero(seed):
    spec = memspec.load(SPEC)
    state = {**R.init_state(spec, 1, 1), **as_state(seed["initial"])}
    pred = R.apply_model(spec, state, seed["k_pairs"][None, None])
    assert pred.abs().max() == 0
    # so the MSE of the empty memory is mean(v^2) = 1 / d_v for unit-norm values
    assert interpreter_mse(spec, state, seed) == pytest.approx(1 / 32, abs=1e-7)
