"""The scan family (elementwise linear recurrences h <- a * h + b): its kernel against a token loop
written here, its analysis, and the shipped specs (hgrn, rglru, mamba) against the reference
interpreter, fla's naive HGRN and token loops of RG-LRU and Mamba-1 written here."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import memspec
from memspec.runtime.scan import chunk_scan, recurrent_scan
from memspec.schedule import analyse

from close import assert_same_function

SPECS = Path(__file__).resolve().parent.parent / "specs"


def loop(a, b, h0):
    """h_t = a_t * h_{t-1} + b_t, one token at a time (written here, independent of the runtime)."""
    a = a.expand(b.shape)
    h = h0
    hs = []
    for t in range(b.shape[1]):
        h = a[:, t] * h + b[:, t]
        hs.append(h)
    return torch.stack(hs, 1), h


def inputs(B, T, H, S, *, dtype=torch.float32, seed=0, log_lo=-3.0, signed=False, a_shape=None):
    g = torch.Generator().manual_seed(seed)
    shape = (B, T, H) + tuple(S)
    a_shape = shape if a_shape is None else a_shape
    a = torch.exp(log_lo * torch.rand(a_shape, generator=g, dtype=dtype))
    if signed:
        a = a * torch.where(torch.rand(a_shape, generator=g) < 0.5, -1.0, 1.0).to(dtype)
    b = torch.randn(shape, generator=g, dtype=dtype)
    h0 = torch.randn((B, H) + tuple(S), generator=g, dtype=dtype)
    return a, b, h0


def weighted(hs, h, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (hs * torch.randn(hs.shape, generator=g, dtype=hs.dtype)).sum() \
        + (h * torch.randn(h.shape, generator=g, dtype=h.dtype)).sum()


CASES = [  # B, T, H, S, chunk
    (1, 16, 2, (4,), 4),
    (2, 37, 3, (5,), 8),          # T not a multiple of the chunk
    (1, 1, 2, (3,), 4),           # T = 1
    (2, 20, 1, (3, 4), 64),       # a matrix state, chunk larger than T
    (1, 29, 2, (2, 3), 5),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("signed", [False, True])
def test_chunk_scan_matches_loop(case, signed):
    B, T, H, S, C = case
    a, b, h0 = inputs(B, T, H, S, signed=signed)
    xs = [x.requires_grad_() for x in (a, b, h0)]
    ref = loop(*xs)
    got = chunk_scan(*xs, C)
    for x, y in zip(got, ref):
        assert_same_function(x, y)
    for x, y in zip(torch.autograd.grad(weighted(*got), xs), torch.autograd.grad(weighted(*ref), xs)):
        assert_same_function(x, y)
    run = recurrent_scan(*xs)
    for x, y in zip(run, ref):
        assert_same_function(x, y)


@pytest.mark.parametrize("a_shape", [(2, 21, 3, 1, 1), (2, 21, 3, 4, 1), (3, 4, 5), (3, 1, 5)])
def test_chunk_scan_broadcast_decays(a_shape):
    """A scalar per token, one decay per row, a learned decay without batch and time axes."""
    a, b, h0 = inputs(2, 21, 3, (4, 5), a_shape=a_shape)
    ref = loop(a, b, h0)
    for x, y in zip(chunk_scan(a, b, h0, 8), ref):
        assert_same_function(x, y)


def test_chunk_scan_extreme_and_zero_decays():
    """Log decays down to -40 per token, decays of exactly 0 and negative decays: finite, equal to the loop."""
    a, b, h0 = inputs(2, 70, 2, (6,), log_lo=-40.0, signed=True, seed=3)
    a[:, 10] = 0.0
    a[0, 33:40] = -torch.exp(torch.tensor(-40.0))
    xs = [x.requires_grad_() for x in (a, b, h0)]
    got, ref = chunk_scan(*xs, 16), loop(*xs)
    assert all(torch.isfinite(x).all() for x in got)
    for x, y in zip(got, ref):
        assert_same_function(x, y)
    gg, gr = torch.autograd.grad(weighted(*got), xs), torch.autograd.grad(weighted(*ref), xs)
    assert all(torch.isfinite(x).all() for x in gg)
    for x, y in zip(gg, gr):
        assert_same_function(x, y)


def test_chunk_scan_float64_gradcheck():
    a, b, h0 = inputs(1, 11, 2, (2, 3), dtype=torch.float64, signed=True)
    xs = [x.requires_grad_() for x in (a, b, h0)]
    assert torch.autograd.gradcheck(lambda *z: chunk_scan(*z, 4), xs)
    assert torch.autograd.gradcheck(lambda a, b: chunk_scan(a, b, None, 3), xs[:2])


def test_chunk_scan_causal_and_streaming():
    a, b, h0 = inputs(1, 40, 2, (5,), signed=True)
    hs, h = chunk_scan(a, b, h0, 8)
    bad = b.clone()
    bad[:, 19] = float("nan")
    hs_bad, _ = chunk_scan(a, bad, h0, 8)
    assert torch.equal(hs_bad[:, :19], hs[:, :19]) and torch.isnan(hs_bad[:, 19:]).all()
    bad_a = a.clone()
    bad_a[:, 23] = float("inf")
    assert torch.equal(chunk_scan(bad_a, b, h0, 8)[0][:, :23], hs[:, :23])
    first, h1 = chunk_scan(a[:, :13], b[:, :13], h0, 8)
    second, h2 = chunk_scan(a[:, 13:], b[:, 13:], h1, 8)
    assert_same_function(torch.cat([first, second], 1), hs)
    assert_same_function(h2, h)
    empty, h_e = chunk_scan(a[:, :0], b[:, :0], h0, 8)
    assert empty.shape == (1, 0, 2, 5) and torch.equal(h_e, h0)


def test_chunk_scan_bfloat16_keeps_a_float32_state():
    a, b, h0 = inputs(1, 30, 2, (4,))
    hs, h = chunk_scan(a.bfloat16(), b.bfloat16(), h0, 8)
    assert hs.dtype == torch.float32 and h.dtype == torch.float32
    ref_hs, ref_h = loop(a.bfloat16().float(), b.bfloat16().float(), h0)
    assert_same_function(h, ref_h)
