"""The phases the exact chunked kernels share (memspec.runtime.phases): the groups of chunks, the
chunk-major layout and back, and the state passing over chunks (packed documents included)."""
from __future__ import annotations

import pytest
import torch

from memspec.runtime.phases import (_chunk_groups, _chunk_major, _group_size, _join_chunks, _pass_states,
                                    _split_groups, _stacked, _token_major)
from memspec.runtime.varlen import _Documents

from close import assert_same_function


@pytest.mark.parametrize("T,C,G", [(37, 8, 2), (32, 8, 3), (5, 8, 4), (64, 16, 64)])
@pytest.mark.parametrize("tail", [None, "power of two", "chunk"])
def test_groups_cover_the_sequence(T, C, G, tail):
    groups = _chunk_groups(T, C, G, tail)
    assert sum(n * c for n, c, _ in groups) == T
    assert all(n <= G and c == C == cp for n, c, cp in groups if c == C)
    if T % C:
        n, c, cp = groups[-1]
        r = T % C
        assert (n, c) == (1, r) and cp == {None: r, "power of two": 1 << (r - 1).bit_length(), "chunk": C}[tail]
        assert cp >= c


def test_group_size():
    cpu, meta = torch.device("cpu"), torch.device("meta")
    assert _group_size(10, 1 << 15, None, cpu) == 4              # temporaries near 2^17 floats
    assert _group_size(3, 1 << 10, None, cpu) == 3               # at most the chunks
    assert _group_size(0, 1 << 10, None, cpu) == 1 and _group_size(5, 1 << 30, None, cpu) == 1
    assert _group_size(100, 1, None, meta) == 64 and _group_size(100, 1, 7, cpu) == 7


@pytest.mark.parametrize("tail", [None, "power of two", "chunk"])
def test_layout_round_trip(tail):
    """Every token laid out chunk-major (a tail padded with the given value) and back, in place."""
    B, T, H, D, C = 2, 29, 3, 5, 8
    x = torch.randn(B, T, H, D, dtype=torch.float64)
    groups = _chunk_groups(T, C, 2, tail)
    parts = []
    for (n, c, cp), xp in zip(groups, _split_groups(x, groups)):
        y = _chunk_major(xp, n, cp, value=7.0)                     # [n, B, H, cp, D]
        assert y.shape == (n, B, H, cp, D)
        assert torch.equal(y[0, 1, 2, :c], xp[1, :c, 2]) and bool((y[..., c:, :] == 7.0).all())
        parts.append(_token_major(y.reshape(n * B * H, cp, D), B, H, c))
    assert torch.equal(_join_chunks(parts), x)
    assert _split_groups(None, groups) == [None] * len(groups)


def test_pass_states_applies_each_map_in_order():
    """S_{j+1} = M_j S_j + D_j, the starts and the per-chunk values as a loop computes them."""
    g = torch.Generator().manual_seed(0)
    n, BH, K, V = 5, 3, 4, 2
    M = torch.randn(n, BH, K, K, generator=g, dtype=torch.float64)
    D = torch.randn(n, BH, K, V, generator=g, dtype=torch.float64)
    S0 = torch.randn(BH, K, V, generator=g, dtype=torch.float64)
    S, starts, xs = _pass_states(lambda j, S: (M[j] @ S + D[j], S.sum()), n, S0)
    want = S0
    for j in range(n):
        assert_same_function(starts[j], want)   # the shared loop against this one (float64)
        assert_same_function(xs[j], want.sum())
        want = M[j] @ want + D[j]
    assert_same_function(S, want)
    assert torch.equal(_stacked(starts), torch.stack(starts).reshape(n * BH, K, V))
    assert _stacked(starts[:1]) is starts[0]


def test_pass_states_restarts_at_each_document():
    """Packed documents: each enters its own initial state and leaves its final one (at the true scale
    given by ``true_state``); a later document never sees an earlier one's state."""
    C, H, K, V = 4, 2, 3, 2
    lengths = [6, 4, 1]                                            # 2 + 1 + 1 chunks
    docs = _Documents(torch.tensor([0, 6, 10, 11])).for_kernel(C, torch.arange(3.0).view(3, 1, 1, 1).expand(3, H, K, V))
    n = docs.T // C
    assert n == 4 and sum(-(-x // C) for x in lengths) == n
    S, starts, _ = _pass_states(lambda j, S: (S + 10.0, None), n, torch.full((H, K, V), -1.0), docs,
                                true_state=lambda j, S: 2 * S)
    assert [float(s[0, 0, 0]) for s in starts] == [0.0, 10.0, 1.0, 2.0]
    assert docs.final()[:, 0, 0, 0].tolist() == [40.0, 22.0, 24.0]   # 2 (initial + 10 per chunk)
