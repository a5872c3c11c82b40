"""Chunked kernels vs token-loop references: outputs, final state, every gradient."""
from __future__ import annotations

import inspect

import pytest
import torch

from memspec.runtime.additive import chunk_additive, recurrent_additive
from memspec.runtime.delta import chunk_delta, recurrent_delta

from close import assert_same_function


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def make(B, T, H, K, V, dtype=torch.float32, seed=0, decay=(0.0, 1.0), normalize=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=g, dtype=dtype)
    k = torch.randn(B, T, H, K, generator=g, dtype=dtype)
    if normalize:
        k = torch.nn.functional.normalize(k, dim=-1)
    v = torch.randn(B, T, H, V, generator=g, dtype=dtype)
    beta = torch.rand(B, T, H, generator=g, dtype=dtype)
    lo, hi = decay
    gamma = lo + (hi - lo) * torch.rand(B, T, H, generator=g, dtype=dtype)
    log_gamma = torch.log(gamma.clamp_min(1e-30))
    S0 = torch.randn(B, H, K, V, generator=g, dtype=dtype)
    return q, k, v, beta, log_gamma, S0


def grads(out, inputs, seed=1):
    o, S = out
    g = torch.Generator().manual_seed(seed)
    w_o = torch.randn(o.shape, generator=g, dtype=o.dtype)
    w_s = torch.randn(S.shape, generator=g, dtype=S.dtype)
    loss = (o * w_o).sum() + (S * w_s).sum()
    return torch.autograd.grad(loss, inputs)


CASES = [  # B, T, H, K, V, chunk
    (1, 16, 2, 4, 4, 4),
    (2, 37, 3, 5, 7, 8),      # T not a multiple of the chunk, d_k != d_v
    (1, 1, 2, 3, 6, 4),       # T = 1
    (2, 20, 1, 6, 3, 64),     # chunk larger than T
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("decayed", [False, True])
@pytest.mark.parametrize("inclusive", [True, False])
def test_chunk_additive_matches_recurrent(case, decayed, inclusive):
    B, T, H, K, V, C = case
    q, k, v, _, lg, S0 = make(B, T, H, K, V, decay=(0.5, 1.0))
    inputs = [x.requires_grad_() for x in (q, k, v, lg, S0)]
    q, k, v, lg, S0 = inputs
    lg_arg = lg if decayed else None
    ref = recurrent_additive(q, k, v, lg_arg, S0, inclusive)
    got = chunk_additive(q, k, v, lg_arg, S0, C, inclusive=inclusive)
    assert got[0].shape == (B, T, H, V) and got[1].shape == (B, H, K, V)
    assert rel(got[0], ref[0]) <= 1e-4
    assert rel(got[1], ref[1]) <= 1e-4
    used = inputs if decayed else [q, k, v, S0]
    for gr, gg in zip(grads(ref, used), grads(got, used)):
        assert rel(gg, gr) <= 1e-4



@pytest.mark.parametrize("group", [1, 2, 3, 5, None])
@pytest.mark.parametrize("decayed", [False, True])
@pytest.mark.parametrize("inclusive", [True, False])
def test_chunk_additive_groups(group, decayed, inclusive):
    """Chunks batched G at a time: full groups, a partial group and a tail chunk (T = 7 C + 3)
    all give the token loop's outputs, final state and gradients."""
    B, T, H, K, V, C = 2, 7 * 4 + 3, 2, 3, 5, 4
    q, k, v, _, lg, S0 = make(B, T, H, K, V, decay=(0.3, 1.0), seed=3)
    inputs = [x.requires_grad_() for x in (q, k, v, lg, S0)]
    q, k, v, lg, S0 = inputs
    lg_arg = lg if decayed else None
    ref = recurrent_additive(q, k, v, lg_arg, S0, inclusive)
    got = chunk_additive(q, k, v, lg_arg, S0, C, inclusive=inclusive, group=group)
    assert got[0].shape == (B, T, H, V) and got[1].shape == (B, H, K, V)
    assert rel(got[0], ref[0]) <= 1e-5
    assert rel(got[1], ref[1]) <= 1e-5
    used = inputs if decayed else [q, k, v, S0]
    for gr, gg in zip(grads(ref, used), grads(got, used)):
        assert rel(gg, gr) <= 1e-4


def test_chunk_additive_more_chunks_per_group_than_chunk_size():
    """C = 2 and 40 chunks: the default group holds more chunks than a chunk has tokens."""
    q, k, v, _, lg, S0 = make(1, 81, 1, 2, 3, decay=(0.5, 1.0), seed=4)
    for lg_arg in (None, lg):
        ref = recurrent_additive(q, k, v, lg_arg, S0)
        got = chunk_additive(q, k, v, lg_arg, S0, 2)
        assert rel(got[0], ref[0]) <= 1e-5 and rel(got[1], ref[1]) <= 1e-5
        _, S = chunk_additive(None, k, v, lg_arg, S0, 2)
        assert rel(S, ref[1]) <= 1e-5


@pytest.mark.parametrize("decayed", [False, True])
def test_chunk_additive_tuple_values(decayed):
    """v given as a tuple of pieces equals v given as their concatenation: outputs, state, gradients."""
    q, k, v, _, lg, S0 = make(2, 23, 2, 4, 6, decay=(0.5, 1.0), seed=6)
    ones = torch.ones(2, 23, 2, 1)
    inputs = [x.requires_grad_() for x in (q, k, v, lg, S0)]
    q, k, v, lg, S0 = inputs
    S0_full = torch.cat([S0, torch.zeros(2, 2, 4, 1)], dim=-1)
    lg_arg = lg if decayed else None
    ref = chunk_additive(q, k, torch.cat([v, ones], dim=-1), lg_arg, S0_full, 4, group=2)
    got = chunk_additive(q, k, (v, ones), lg_arg, S0_full, 4, group=2)
    assert got[0].shape == (2, 23, 2, 7) and got[1].shape == (2, 2, 4, 7)
    assert_same_function(got[0], ref[0])
    assert_same_function(got[1], ref[1])
    rec = recurrent_additive(q, k, torch.cat([v, ones], dim=-1), lg_arg, S0_full)
    assert rel(got[0], rec[0]) <= 1e-5 and rel(got[1], rec[1]) <= 1e-5
    used = inputs if decayed else [q, k, v, S0]
    for gr, gg in zip(grads(ref, used), grads(got, used)):
        assert_same_function(gg, gr)

def test_chunk_additive_empty_sequence():
    """T = 0: an empty output and the initial state unchanged (zeros when S0 is None)."""
    q, k, v, _, lg, S0 = make(2, 0, 3, 4, 5)
    o, S = chunk_additive(q, k, v, lg, S0, 8)
    assert o.shape == (2, 0, 3, 5) and torch.equal(S, S0)
    o, S = chunk_additive(q, k, (v, v[..., :1]), None, None, 8)
    assert o.shape == (2, 0, 3, 6) and torch.equal(S, torch.zeros(2, 3, 4, 6))

def test_chunk_additive_float32_stays_float32_and_groups_agree():
    """No float64 detour for float32 inputs; G = 1 (chunk by chunk) and the default G give the same
    numbers up to rounding at the benchmark's shape class (B=1, H=4, T=4 C + 5)."""
    q, k, v, _, lg, S0 = make(1, 4 * 16 + 5, 4, 16, 16, decay=(0.8, 1.0), seed=5)
    for lg_arg in (None, lg):
        o1, S1 = chunk_additive(q, k, v, lg_arg, S0, 16, group=1)
        o2, S2 = chunk_additive(q, k, v, lg_arg, S0, 16)
        assert o2.dtype == torch.float32 and S2.dtype == torch.float32
        assert rel(o2, o1) <= 1e-6 and rel(S2, S1) <= 1e-6

@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("mode", ["plain", "gated", "rho"])
@pytest.mark.parametrize("inclusive", [True, False])
def test_chunk_delta_matches_recurrent(case, mode, inclusive):
    B, T, H, K, V, C = case
    q, k, v, beta, lg, S0 = make(B, T, H, K, V, decay=(0.5, 1.0))
    lr = lg * 0.5
    inputs = [x.requires_grad_() for x in (q, k, v, beta, lg, lr, S0)]
    q, k, v, beta, lg, lr, S0 = inputs
    lg_arg = lg if mode != "plain" else None
    lr_arg = lr if mode == "rho" else None
    ref = recurrent_delta(q, k, v, beta, lg_arg, S0, lr_arg, inclusive)
    got = chunk_delta(q, k, v, beta, lg_arg, S0, C, log_rho=lr_arg, inclusive=inclusive)
    assert got[0].shape == (B, T, H, V) and got[1].shape == (B, H, K, V)
    assert rel(got[0], ref[0]) <= 1e-4
    assert rel(got[1], ref[1]) <= 1e-4
    used = [q, k, v, beta, S0] + ([lg] if lg_arg is not None else []) + ([lr] if lr_arg is not None else [])
    for gr, gg in zip(grads(ref, used), grads(got, used)):
        assert rel(gg, gr) <= 1e-4


@pytest.mark.parametrize("group", [1, 2, 3, 5, None])
@pytest.mark.parametrize("mode", ["plain", "gated", "rho"])
@pytest.mark.parametrize("inclusive", [True, False])
def test_chunk_delta_groups(group, mode, inclusive):
    """Chunks batched G at a time: full groups, a partial group and a tail chunk (T = 7 C + 3),
    B > 1, H > 1, K != V: outputs, final state and every gradient equal the token loop's."""
    B, T, H, K, V, C = 2, 7 * 4 + 3, 2, 3, 5, 4
    q, k, v, beta, lg, S0 = make(B, T, H, K, V, decay=(0.3, 1.0), seed=3)
    lr = lg * 0.7
    inputs = [x.requires_grad_() for x in (q, k, v, beta, lg, lr, S0)]
    q, k, v, beta, lg, lr, S0 = inputs
    lg_arg = lg if mode != "plain" else None
    lr_arg = lr if mode == "rho" else None
    ref = recurrent_delta(q, k, v, beta, lg_arg, S0, lr_arg, inclusive)
    got = chunk_delta(q, k, v, beta, lg_arg, S0, C, log_rho=lr_arg, inclusive=inclusive, group=group)
    assert got[0].shape == (B, T, H, V) and got[1].shape == (B, H, K, V)
    assert rel(got[0], ref[0]) <= 1e-5
    assert rel(got[1], ref[1]) <= 1e-5
    used = [q, k, v, beta, S0] + ([lg] if lg_arg is not None else []) + ([lr] if lr_arg is not None else [])
    for gr, gg in zip(grads(ref, used), grads(got, used)):
        assert rel(gg, gr) <= 1e-4


def test_chunk_delta_log_rho_without_log_gamma():
    """A decay that only the error term sees (log_gamma None, log_rho given)."""
    q, k, v, beta, lg, S0 = make(1, 23, 2, 4, 3, decay=(0.5, 1.0), seed=6)
    ref = recurrent_delta(q, k, v, beta, None, S0, lg)
    for group in (1, None):
        got = chunk_delta(q, k, v, beta, None, S0, 8, log_rho=lg, group=group)
        assert rel(got[0], ref[0]) <= 1e-5 and rel(got[1], ref[1]) <= 1e-5


def test_chunk_delta_many_chunks_and_state_only():
    """C = 2 and 40 chunks (more chunks per group than tokens per chunk); state only."""
    q, k, v, beta, lg, S0 = make(1, 81, 1, 2, 3, decay=(0.5, 1.0), seed=4)
    for lg_arg in (None, lg):
        ref = recurrent_delta(q, k, v, beta, lg_arg, S0)
        got = chunk_delta(q, k, v, beta, lg_arg, S0, 2)
        assert rel(got[0], ref[0]) <= 1e-5 and rel(got[1], ref[1]) <= 1e-5
        o, S = chunk_delta(None, k, v, beta, lg_arg, S0, 2)
        assert o is None and rel(S, ref[1]) <= 1e-5


def test_chunk_delta_float32_stays_float32_and_groups_agree():
    """No float64 detour for float32 inputs; G = 1 and the default G agree at the benchmark's
    shape class (B=1, H=4, T=4 C + 5); the output is a contiguous [B, T, H, V] tensor."""
    q, k, v, beta, lg, S0 = make(1, 4 * 16 + 5, 4, 16, 16, decay=(0.8, 1.0), seed=5)
    for lg_arg in (None, lg):
        o1, S1 = chunk_delta(q, k, v, beta, lg_arg, S0, 16, group=1)
        o2, S2 = chunk_delta(q, k, v, beta, lg_arg, S0, 16)
        assert o2.dtype == torch.float32 and S2.dtype == torch.float32
        assert o2.is_contiguous()
        assert rel(o2, o1) <= 1e-6 and rel(S2, S1) <= 1e-6


def test_chunk_delta_empty_sequence():
    q, k, v, beta, lg, S0 = make(1, 0, 2, 3, 4)
    o, S = chunk_delta(q, k, v, beta, lg, S0, 8)
    assert o.shape == (1, 0, 2, 4) and torch.equal(S, S0)


def test_chunk_delta_under_torch_func():
    """No in-place writes into fresh outputs: torch.func.grad and vmap work and agree with the loop."""
    q, k, v, beta, lg, _ = make(1, 11, 2, 3, 4, decay=(0.8, 1.0), seed=7)
    qs = torch.randn(3, 11, 2, 3, generator=torch.Generator().manual_seed(8))

    def loss(fn):
        return lambda q: fn(q, k, v, beta, lg, None)[0].square().sum()

    g_chunk = torch.func.grad(lambda q: chunk_delta(q, k, v, beta, lg, None, 4)[0].square().sum())(q)
    g_loop = torch.func.grad(loss(recurrent_delta))(q)
    assert rel(g_chunk, g_loop) <= 1e-5
    one = lambda q: chunk_delta(q[None], k, v, beta, lg, None, 4)[0][0]  # noqa: E731
    batched = torch.func.vmap(one)(qs)
    assert rel(batched, torch.stack([one(x) for x in qs])) <= 1e-6


def test_delta_rule_hand_example():
    """The seed text's delta correction: W1 = W0 + eta k^T (v - k W0)."""
    k = torch.tensor([1.0, 0.0]).view(1, 1, 1, 2)
    v = torch.tensor([1.0, 0.0]).view(1, 1, 1, 2)
    W0 = torch.tensor([[0.5, 0.0], [0.0, 1.0]]).view(1, 1, 2, 2)
    beta = torch.tensor([1.0]).view(1, 1, 1)
    o, W1 = chunk_delta(k, k, v, beta, None, W0, 4)
    assert torch.allclose(W1.view(2, 2), torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
    assert torch.allclose(o.view(2), torch.tensor([1.0, 0.0]))


def test_linear_attention_hand_example():
    """Seed text: S_2 = [[2, 3], [2, 6]] and q S_2 = (4, 9) for q = (1, 1)."""
    k = torch.tensor([[1.0, 1.0], [1.0, 2.0]]).view(1, 2, 1, 2)
    v = torch.tensor([[2.0, 0.0], [0.0, 3.0]]).view(1, 2, 1, 2)
    q = torch.ones(1, 2, 1, 2)
    o, S = chunk_additive(q, k, v, None, None, 2)
    assert torch.equal(S.view(2, 2), torch.tensor([[2.0, 3.0], [2.0, 6.0]]))
    assert torch.equal(o[0, 1, 0], torch.tensor([4.0, 9.0]))


@pytest.mark.parametrize("decay", [(0.0, 1e-6), (1.0 - 1e-7, 1.0), (0.0, 1.0)])
def test_extreme_decays_no_nan(decay):
    B, T, H, K, V, C = 1, 70, 2, 8, 8, 32
    q, k, v, beta, lg, S0 = make(B, T, H, K, V, decay=decay)
    lg = lg.clamp_min(-60.0)  # gamma = 0 enters as a large negative log decay
    for x in (q, k, v, beta, lg, S0):
        x.requires_grad_()
    for fn, args in ((chunk_delta, (q, k, v, beta, lg, S0, C)), (chunk_additive, (q, k, v, lg, S0, C))):
        o, S = fn(*args)
        assert torch.isfinite(o).all() and torch.isfinite(S).all()
        gs = torch.autograd.grad(o.square().sum() + S.square().sum(), [q, k, v, lg, S0])
        assert all(torch.isfinite(g).all() for g in gs)
    ref = recurrent_delta(q, k, v, beta, lg, S0)
    got = chunk_delta(q, k, v, beta, lg, S0, C)
    assert rel(got[0], ref[0]) <= 1e-4 and rel(got[1], ref[1]) <= 1e-4


def test_streaming_split():
    """One call equals two calls with the carried state, split off the chunk grid."""
    q, k, v, beta, lg, S0 = make(1, 50, 2, 4, 5, decay=(0.8, 1.0))
    o, S = chunk_delta(q, k, v, beta, lg, S0, 16)
    o1, S1 = chunk_delta(q[:, :21], k[:, :21], v[:, :21], beta[:, :21], lg[:, :21], S0, 16)
    o2, S2 = chunk_delta(q[:, 21:], k[:, 21:], v[:, 21:], beta[:, 21:], lg[:, 21:], S1, 16)
    assert rel(torch.cat([o1, o2], 1), o) <= 1e-5 and rel(S2, S) <= 1e-5
    o, S = chunk_additive(q, k, v, lg, S0, 16)
    o1, S1 = chunk_additive(q[:, :21], k[:, :21], v[:, :21], lg[:, :21], S0, 16)
    o2, S2 = chunk_additive(q[:, 21:], k[:, 21:], v[:, 21:], lg[:, 21:], S1, 16)
    assert rel(torch.cat([o1, o2], 1), o) <= 1e-5 and rel(S2, S) <= 1e-5


def test_state_only_and_zero_initial_state():
    q, k, v, beta, lg, _ = make(1, 19, 2, 4, 3)
    o, S = chunk_delta(None, k, v, beta, lg, None, 8)
    _, S_ref = recurrent_delta(q, k, v, beta, lg, None)
    assert o is None and rel(S, S_ref) <= 1e-5
    o, S = chunk_additive(None, k, v, lg, None, 8)
    _, S_ref = recurrent_additive(q, k, v, lg, None)
    assert o is None and rel(S, S_ref) <= 1e-5


def test_bfloat16_inputs_computed_in_float32():
    q, k, v, beta, lg, S0 = make(1, 33, 2, 8, 8, decay=(0.9, 1.0))
    ref = chunk_delta(q, k, v, beta, lg, S0, 16)
    got = chunk_delta(*(x.bfloat16() for x in (q, k, v, beta, lg, S0)), 16)
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.bfloat16
    assert rel(got[0].float(), ref[0]) < 0.05


@pytest.mark.parametrize("fn", ["additive", "delta"])
def test_gradcheck_float64(fn):
    B, T, H, K, V, C = 1, 5, 1, 3, 2, 2
    q, k, v, beta, lg, S0 = make(B, T, H, K, V, dtype=torch.float64, decay=(0.5, 1.0))
    if fn == "additive":
        args = [q, k, v, lg, S0]
        f = lambda q, k, v, lg, S0: chunk_additive(q, k, v, lg, S0, C)  # noqa: E731
    else:
        lr = lg * 0.3
        args = [q, k, v, beta, lg, S0, lr]
        f = lambda q, k, v, b, lg, S0, lr: chunk_delta(q, k, v, b, lg, S0, C, log_rho=lr)  # noqa: E731
    args = [a.clone().requires_grad_() for a in args]
    assert torch.autograd.gradcheck(f, args, eps=1e-6, atol=1e-6)


def test_kernels_are_standalone():
    """The code generator copies these functions' source (and the shared phases they call): only
    torch, no closures over memspec."""
    from memspec.codegen.context import phase_sources

    for fn in (chunk_additive, chunk_delta, recurrent_additive, recurrent_delta):
        src = inspect.getsource(fn)
        assert "memspec" not in src
        assert fn.__doc__ and "[B, T, H" in fn.__doc__
        namespace = {"torch": torch}
        for part in phase_sources([src]):
            assert "memspec" not in part
            exec(part, namespace)
        exec(src, namespace)
        assert callable(namespace[fn.__name__])


@pytest.mark.parametrize("which", ["q", "k", "v", "beta", "log_gamma", "log_rho"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_chunk_delta_non_finite_token_masked(which, bad):
    """A NaN / inf in token 10's inputs (head 1 only): outputs 0..9, head 0 throughout, and every
    input's gradient of a loss on outputs 0..9 equal the clean run's bit for bit (no future NaN ever
    meets a zero of the causal mask, forward or backward); a bad state input makes every later
    output of head 1 and its final state non-finite, a bad probe only its own output (the
    causality rule for non-finite inputs)."""
    names = ["q", "k", "v", "beta", "log_gamma", "S0", "log_rho"]
    q, k, v, beta, lg, S0 = make(1, 40, 2, 8, 8, decay=(0.5, 1.0), seed=21)
    clean = [q, k, v, beta, lg, S0, lg * 0.5]
    dirty = [x.clone() for x in clean]
    dirty[names.index(which)][0, 10, 1] = bad
    if which in ("log_gamma", "log_rho") and bad == float("-inf"):
        pytest.skip("a log decay of -inf is a decay of 0: valid (clamped), tested below")
    lc = [x.clone().requires_grad_() for x in clean]
    ld = [x.clone().requires_grad_() for x in dirty]
    run = lambda x: chunk_delta(*x[:6], 16, log_rho=x[6])  # noqa: E731
    (oc, Sc), (od, Sd) = run(lc), run(ld)
    assert torch.equal(od[:, :10], oc[:, :10]) and torch.equal(od[:, :, 0], oc[:, :, 0])
    assert torch.equal(Sd[:, 0], Sc[:, 0])
    if which == "q":
        assert not torch.isfinite(od[:, 10, 1]).any() and torch.equal(od[:, 11:], oc[:, 11:]) and torch.equal(Sd, Sc)
    else:
        assert not torch.isfinite(od[:, 10:, 1]).any() and not torch.isfinite(Sd[:, 1]).any()
    gc = torch.autograd.grad(oc[:, :10].square().sum(), lc)
    gd = torch.autograd.grad(od[:, :10].square().sum(), ld)
    for g1, g2 in zip(gc, gd):   # every input's gradient, the bad token's included (0 there)
        assert torch.equal(g1, g2)


def test_chunk_delta_zero_decay():
    """gamma = 0 (log -inf) empties the state: finite, and equal to the token loop with the decay
    clamped to exp(-80)."""
    q, k, v, beta, lg, S0 = make(1, 40, 2, 4, 4, decay=(0.5, 1.0), seed=22)
    lg[:, 7] = float("-inf")
    leaves = [x.requires_grad_() for x in (q, k, v, beta, lg, S0)]
    o, S = chunk_delta(*leaves, 16)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert all(torch.isfinite(g).all() for g in torch.autograd.grad(o.square().sum() + S.square().sum(), leaves))
    ref = recurrent_delta(q, k, v, beta, lg.detach().clamp_min(-80.0), S0)
    assert rel(o, ref[0]) <= 1e-5 and rel(S, ref[1]) <= 1e-5
