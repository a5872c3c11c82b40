"""Mini-batch chunks solved in blocks of tokens (``_chunk_block``; ``_block_tokens`` sizes the blocks).

A chunk without a dual form takes its tokens' gradients at the chunk-start state and solves the
states token by token; the generated chunk step does that in blocks of a few tokens, each block
from the state after the one before, so that a block's per-token states stay in cache.  At the
tests' small sizes the rule gives one block per chunk, so the blocks are forced here (1 token,
3 tokens: blocks that do not divide the chunk) and compared with the reference interpreter
(outputs, final states), with one block per chunk (gradients, also through the recomputing
backward), in float64 gradcheck, and in streaming.
"""
from __future__ import annotations

import sys

import pytest
import torch

from _compiled_harness import call, initial_state, inputs, load, make, reference_run, rel_err, small_dims
from close import assert_same_function

# the specs whose chunk step solves in blocks: Newton-Schulz on every token's momentum, and a
# mirror step read through softmax (a state driven by another's sequence)
SPECS = ["specs/titans_muon.yaml", "specs/memora.yaml"]
CHUNK, T = 8, 19   # a partial chunk at the end


def _with_blocks(m, monkeypatch, n):
    """Force the generated module's blocks to ``n`` tokens (None: one block per chunk)."""
    module = sys.modules[type(m).__module__]
    assert hasattr(module, "_block_tokens"), "the chunk step solves in blocks"
    monkeypatch.setattr(module, "_block_tokens", (lambda C, floats: C) if n is None else (lambda C, floats: n))


def _setup(path, B=2, requires_grad=False):
    spec = load(path)
    dims = small_dims(spec)
    m = make(spec, dims, chunk=CHUNK)
    ins = inputs(spec, m, B=B, T=T, requires_grad=requires_grad)
    st = initial_state(spec, m, B=B)
    return spec, dims, m, ins, st


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("path", SPECS)
def test_blocks_match_the_reference(path, n, monkeypatch):
    spec, dims, m, ins, st = _setup(path)
    _with_blocks(m, monkeypatch, n)
    with torch.no_grad():
        o, final = call(m, spec, ins, dict(st), "minibatch")
        ro, rfinal = reference_run(spec, m, dims, "minibatch", st, ins)
    assert_same_function(o, ro)
    for name in spec.state:
        assert_same_function(final[name], rfinal[name], msg=name)


@pytest.mark.parametrize("checkpoint", [False, True])
@pytest.mark.parametrize("path", SPECS)
def test_block_gradients_match_one_block(path, checkpoint, monkeypatch):
    spec, dims, m, ins, st = _setup(path, requires_grad=True)
    m.checkpoint = checkpoint
    leaves = list(ins.values()) + list(m.parameters())

    def grads(n):
        _with_blocks(m, monkeypatch, n)
        for t in leaves:
            t.grad = None
        o, final = call(m, spec, ins, dict(st), "minibatch")
        w = torch.linspace(-1, 1, o.numel(), dtype=o.dtype).reshape(o.shape)
        ((o * w).sum() + sum((final[s] * final[s]).sum() for s in spec.state)).backward()
        return [t.grad.clone() for t in leaves]

    # (norm-relative: Newton-Schulz amplifies the rounding of a gradient's few entries near zero)
    for got, want in zip(grads(3), grads(None)):
        assert rel_err(got, want) <= 1e-10


def test_blocks_gradcheck_float64(monkeypatch):
    spec, dims, m, ins, st = _setup("specs/titans_muon.yaml", B=1)
    _with_blocks(m, monkeypatch, 3)
    names = ["k", "eta1"]
    inputs64 = {k: v.detach().clone() for k, v in ins.items()}

    def fn(*xs):
        o, final = call(m, spec, {**inputs64, **dict(zip(names, xs))}, dict(st), "minibatch")
        return o, final["W2"]

    xs = tuple(inputs64[k].clone().requires_grad_(True) for k in names)
    assert torch.autograd.gradcheck(fn, xs, eps=1e-6, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("path", SPECS)
def test_blocks_stream(path, monkeypatch):
    spec, dims, m, ins, st = _setup(path)
    _with_blocks(m, monkeypatch, 3)
    with torch.no_grad():
        whole, final = call(m, spec, ins, dict(st), "minibatch")
        outs, state = [], dict(st)
        for a, b in ((0, 5), (5, 13), (13, T)):
            o, state = call(m, spec, {k: v[:, a:b] for k, v in ins.items()}, state, "minibatch")
            outs.append(o)
    assert_same_function(torch.cat(outs, dim=1), whole)
    for name in spec.state:
        assert_same_function(state[name], final[name], msg=name)


def test_block_rule():
    """About 2^18 floats of one state sequence per block; at least one token, at most the chunk."""
    from memspec.runtime.helpers import _block_tokens

    assert _block_tokens(64, 4 * 64 * 128) == 8          # titans_muon's [64, 128] states, 4 heads
    assert _block_tokens(64, 2 * 4 * 64 * 128) == 4      # two batch rows
    assert _block_tokens(64, 64) == 64                   # small states: the whole chunk
    assert _block_tokens(64, 1 << 20) == 1
    assert _block_tokens(5, 16) == 5


def test_explain_says_blocks():
    from memspec.pipeline.build import decide

    spec = load("specs/titans_muon.yaml")
    text = "\n".join(decide(spec).reasons)
    assert "in blocks of a few tokens" in text and "one Newton-Schulz iteration for all of them" in text
