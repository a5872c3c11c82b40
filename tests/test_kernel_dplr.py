"""The diagonal-plus-low-rank kernel: chunked vs token loop (outputs, final state, every
gradient), hand-computed values, extreme decays, non-finite inputs, and the peers.

The recurrence (memspec.runtime.dplr): sub-step r of token t is
``S <- Diag(d) S + a (b^T S) + outer(k, v)``, b reading the state before the sub-step, the decay
on sub-step 0 only.  Each peer test says how the peer's equations map onto it.
"""
from __future__ import annotations

import inspect
import math

import pytest
import torch

from memspec.runtime.dplr import chunk_dplr, recurrent_dplr
from memspec.runtime.momentum import chunk_momentum_delta, recurrent_momentum_delta

from close import assert_same_function
from peers import fla_naive


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def make(B, T, H, R, K, V, *, a_kind="scalar", b_kind="vec", decay="scalar", dtype=torch.float32, seed=0,
         squeeze=False, lo=0.5):
    """Random inputs in the kernel's layout: q [B, T, H, K], k, b [B, T, H, R, K], v [B, T, H, R, V],
    a [B, T, H, R] (scalar: a k) or [B, T, H, R, K], log decay [B, T, H] / [B, T, H, K] / None with
    decays in [lo, 1], S0 [B, H, K, V].  squeeze: R = 1 without the R axis."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=g, dtype=dtype)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, R, K, generator=g, dtype=dtype), dim=-1)
    v = torch.randn(B, T, H, R, V, generator=g, dtype=dtype)
    if a_kind == "scalar":
        a = -torch.rand(B, T, H, R, generator=g, dtype=dtype)           # a delta rule's -beta
    else:
        a = 0.4 * torch.nn.functional.normalize(torch.randn(B, T, H, R, K, generator=g, dtype=dtype), dim=-1)
    if b_kind == "vec":
        b = torch.nn.functional.normalize(torch.randn(B, T, H, R, K, generator=g, dtype=dtype), dim=-1)
    elif b_kind == "scalar":
        b = 0.5 + 0.5 * torch.rand(B, T, H, R, generator=g, dtype=dtype)
    else:
        b = None
    shape = {"scalar": (B, T, H), "channel": (B, T, H, K)}.get(decay)
    lg = None if shape is None else torch.log(lo + (1 - lo) * torch.rand(*shape, generator=g, dtype=dtype))
    S0 = torch.randn(B, H, K, V, generator=g, dtype=dtype)
    if squeeze:
        assert R == 1
        k, v, b = k[:, :, :, 0], v[:, :, :, 0], (b[:, :, :, 0] if b is not None else None)
        a = a[:, :, :, 0]
    return q, k, v, a, b, lg, S0


def grads(out, inputs, seed=1):
    """Gradients of a fixed random projection of (o, S_T)."""
    o, S = out
    g = torch.Generator().manual_seed(seed)
    w_o = torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.dtype)
    w_s = torch.randn(S.shape, generator=g, dtype=torch.float64).to(S.dtype)
    return torch.autograd.grad((o * w_o).sum() + (S * w_s).sum(), inputs)


def check_against_recurrent(inputs, chunk, inclusive=True, simultaneous=False, after=False, tol=1e-4, **kw):
    """Chunked vs token loop on the outputs, the final state and every input's gradient."""
    leaves = [x.clone().requires_grad_() if x is not None else None for x in inputs]
    used = [x for x in leaves if x is not None]
    ref = recurrent_dplr(*leaves, inclusive, simultaneous, after)
    got = chunk_dplr(*leaves, chunk, inclusive=inclusive, simultaneous=simultaneous, read_after_decay=after, **kw)
    q, k, v = leaves[:3]
    assert got[0].shape == (k.shape[0], k.shape[1], k.shape[2], v.shape[-1]) and got[1].shape == ref[1].shape
    assert got[0].dtype == ref[0].dtype and got[1].dtype == ref[1].dtype
    assert rel(got[0], ref[0]) <= tol, ("o", rel(got[0], ref[0]))
    assert rel(got[1], ref[1]) <= tol, ("S", rel(got[1], ref[1]))
    for i, (gr, gg) in enumerate(zip(grads(ref, used), grads(got, used))):
        assert torch.isfinite(gg).all()
        assert rel(gg, gr) <= tol, (i, rel(gg, gr))


# ---------------------------------------------------------------- chunked vs token loop

@pytest.mark.parametrize("R", [1, 2, 3])
@pytest.mark.parametrize("decay,after", [(None, False), ("scalar", False), ("scalar", True),
                                         ("channel", False), ("channel", True)])
@pytest.mark.parametrize("inclusive", [True, False])
@pytest.mark.parametrize("a_kind", ["scalar", "vec"])
def test_chunk_matches_recurrent(R, decay, after, inclusive, a_kind):
    """Chunk 16 over T = 37 (a partial tail chunk), B = H = 2, K != V; b as vectors; the reads of
    sub-step 0 before or after the decay."""
    inputs = make(2, 37, 2, R, 5, 3, a_kind=a_kind, b_kind="vec", decay=decay, seed=R)
    check_against_recurrent(inputs, 16, inclusive, after=after)


@pytest.mark.parametrize("T", [1, 63, 64, 65, 200])
@pytest.mark.parametrize("decay", ["scalar", "channel"])
@pytest.mark.parametrize("R", [1, 2])
def test_lengths_at_chunk_64(T, decay, R):
    """T = 1, one short chunk, exactly one chunk, one plus a one-token tail, several with a tail."""
    inputs = make(1, T, 2, R, 8, 8, a_kind="scalar", b_kind="k", decay=decay, seed=T)
    check_against_recurrent(inputs, 64, inclusive=True, after=True)


@pytest.mark.parametrize("b_kind", ["k", "scalar", "vec"])
@pytest.mark.parametrize("a_kind", ["scalar", "vec"])
@pytest.mark.parametrize("decay", [None, "channel"])
def test_b_forms(b_kind, a_kind, decay):
    """b = k (None), b = scalar * k, b a vector; a = scalar * k or a vector; R = 2, exclusive read."""
    inputs = make(2, 29, 2, 2, 4, 6, a_kind=a_kind, b_kind=b_kind, decay=decay, seed=11)
    check_against_recurrent(inputs, 8, inclusive=False)


@pytest.mark.parametrize("R", [2, 3])
@pytest.mark.parametrize("decay", [None, "scalar", "channel"])
@pytest.mark.parametrize("a_kind", ["scalar", "vec"])
def test_simultaneous(R, decay, a_kind):
    """R rank-1 terms in one step (a sum, all reading the state before the token)."""
    inputs = make(1, 27, 2, R, 5, 4, a_kind=a_kind, decay=decay, seed=5)
    for inclusive, after in ((True, False), (False, decay is not None)):
        check_against_recurrent(inputs, 8, inclusive, simultaneous=True, after=after)


def test_simultaneous_differs_from_sequential():
    """The two orders are different recurrences (the test above could not pass with either for both)."""
    q, k, v, a, b, lg, S0 = make(1, 5, 1, 2, 3, 3, a_kind="vec", seed=2)
    seq = recurrent_dplr(q, k, v, a, b, lg, S0, True, False)[1]
    sim = recurrent_dplr(q, k, v, a, b, lg, S0, True, True)[1]
    assert rel(sim, seq) > 1e-3


@pytest.mark.parametrize("group", [1, 2, 3, None])
@pytest.mark.parametrize("chunk", [1, 2, 6, 16])
def test_groups_and_chunks(group, chunk):
    """Chunks batched G at a time and any chunk size give the token loop's numbers (T = 45:
    a per-channel chunk is rounded down to a power of two, 6 -> 4, and a tail padded to one)."""
    inputs = make(2, 7 * 6 + 3, 2, 2, 4, 5, a_kind="vec", decay="channel", seed=3)
    check_against_recurrent(inputs, chunk, True, group=group)


@pytest.mark.parametrize("decay", ["scalar", "channel"])
def test_read_after_decay_is_b_times_decay(decay):
    """read_after_decay is the same recurrence as b <- d * b on sub-step 0 (both kernels)."""
    q, k, v, a, b, lg, S0 = make(1, 30, 2, 2, 4, 4, a_kind="vec", decay=decay, seed=16)
    d = torch.exp(lg) if decay == "channel" else torch.exp(lg)[..., None]
    b_pre = torch.cat([(d * b[:, :, :, 0])[:, :, :, None], b[:, :, :, 1:]], dim=3)
    for fn in (recurrent_dplr, lambda *x, **kw: chunk_dplr(*x[:7], 8, **kw)):
        o1, S1 = fn(q, k, v, a, b, lg, S0, read_after_decay=True)
        o2, S2 = fn(q, k, v, a, b_pre, lg, S0)
        assert rel(o1, o2) <= 1e-5 and rel(S1, S2) <= 1e-5


def test_without_r_axis_equals_r_1():
    q, k, v, a, b, lg, S0 = make(1, 21, 2, 1, 4, 4, decay="channel", seed=4)
    o5, S5 = chunk_dplr(q, k, v, a, b, lg, S0, 8)
    o4, S4 = chunk_dplr(q, k[:, :, :, 0], v[:, :, :, 0], a[:, :, :, 0], b[:, :, :, 0], lg, S0, 8)
    assert_same_function(o5, o4)
    assert_same_function(S5, S4)
    check_against_recurrent(make(1, 21, 2, 1, 4, 4, decay="channel", seed=4, squeeze=True), 8)


def test_state_only_and_zero_state():
    q, k, v, a, b, lg, _ = make(1, 19, 2, 2, 4, 3, a_kind="vec", decay="channel", seed=6)
    o, S = chunk_dplr(None, k, v, a, b, lg, None, 8)
    _, S_ref = recurrent_dplr(q, k, v, a, b, lg, None)
    assert o is None and rel(S, S_ref) <= 1e-5
    o, S = recurrent_dplr(None, k, v, a, b, lg, None)
    assert o is None and rel(S, S_ref) <= 1e-6


def test_empty_sequence():
    q, k, v, a, b, lg, S0 = make(1, 0, 2, 2, 3, 4, decay="channel")
    for fn in (chunk_dplr, recurrent_dplr):
        o, S = fn(q, k, v, a, b, lg, S0, 8) if fn is chunk_dplr else fn(q, k, v, a, b, lg, S0)
        assert o.shape == (1, 0, 2, 4) and torch.equal(S, S0)


def test_streaming_split():
    """One call equals two calls with the carried state, split off the chunk grid."""
    q, k, v, a, b, lg, S0 = make(1, 50, 2, 2, 4, 5, a_kind="vec", decay="channel", seed=7)
    o, S = chunk_dplr(q, k, v, a, b, lg, S0, 16)
    o1, S1 = chunk_dplr(q[:, :21], k[:, :21], v[:, :21], a[:, :21], b[:, :21], lg[:, :21], S0, 16)
    o2, S2 = chunk_dplr(q[:, 21:], k[:, 21:], v[:, 21:], a[:, 21:], b[:, 21:], lg[:, 21:], S1, 16)
    assert rel(torch.cat([o1, o2], 1), o) <= 1e-5 and rel(S2, S) <= 1e-5


def test_causal():
    """Changing token 20's inputs leaves outputs 0..19 bit-for-bit unchanged up to rounding."""
    q, k, v, a, b, lg, S0 = make(1, 40, 2, 2, 4, 4, a_kind="vec", decay="channel", seed=8)
    o = chunk_dplr(q, k, v, a, b, lg, S0, 16)[0]
    k2, v2, a2, b2, lg2 = (x.clone() for x in (k, v, a, b, lg))
    for x in (k2, v2, a2, b2):
        x[:, 20] += 1.0
    lg2[:, 20] -= 1.0
    o2 = chunk_dplr(q, k2, v2, a2, b2, lg2, S0, 16)[0]
    assert (o2[:, :20] - o[:, :20]).abs().max() <= 1e-6 and (o2[:, 20:] - o[:, 20:]).abs().max() > 1e-3


@pytest.mark.parametrize("a_kind", ["scalar", "vec"])
@pytest.mark.parametrize("decay", ["scalar", "channel"])
def test_gradcheck_float64(a_kind, decay):
    q, k, v, a, b, lg, S0 = make(1, 5, 1, 2, 3, 2, a_kind=a_kind, decay=decay, dtype=torch.float64)
    args = [x.clone().requires_grad_() for x in (q, k, v, a, b, lg, S0)]
    f = lambda q, k, v, a, b, lg, S0: chunk_dplr(q, k, v, a, b, lg, S0, 2)  # noqa: E731
    assert torch.autograd.gradcheck(f, args, eps=1e-6, atol=1e-6)
    f = lambda q, k, v, a, b, lg, S0: chunk_dplr(q, k, v, a, b, lg, S0, 4, inclusive=False, simultaneous=True)  # noqa: E731
    assert torch.autograd.gradcheck(f, args, eps=1e-6, atol=1e-6)


# ---------------------------------------------------------------- hand-computed values

def test_recurrent_one_token_by_hand():
    """One token, K = V = 2, R = 2, per-channel decay d = (1/2, 1/4) on sub-step 0.
    S0 = [[1, 2], [3, 4]].
    Sub-step 0: b0 = (1, 0): u = b0 S0 = (1, 2); Diag(d) S0 = [[.5, 1], [.75, 1]];
      a0 = (0, 1): + outer(a0, u) = [[0, 0], [1, 2]]; k0 = (1, 1), v0 = (1, 0): + [[1, 0], [1, 0]]
      -> S = [[1.5, 1], [2.75, 3]].
    Sub-step 1 (no decay): b1 = (0, 1): u = (2.75, 3); a1 = (-1, 0): - [[2.75, 3], [0, 0]];
      k1 = (0, 2), v1 = (0, 1): + [[0, 0], [0, 2]] -> S = [[-1.25, -2], [2.75, 5]].
    q = (1, 1): o = (1.5, 3) inclusive, (4, 6) = q S0 exclusive."""
    S0 = torch.tensor([[1.0, 2.0], [3.0, 4.0]]).view(1, 1, 2, 2)
    k = torch.tensor([[1.0, 1.0], [0.0, 2.0]]).view(1, 1, 1, 2, 2)
    v = torch.tensor([[1.0, 0.0], [0.0, 1.0]]).view(1, 1, 1, 2, 2)
    a = torch.tensor([[0.0, 1.0], [-1.0, 0.0]]).view(1, 1, 1, 2, 2)
    b = torch.tensor([[1.0, 0.0], [0.0, 1.0]]).view(1, 1, 1, 2, 2)
    lg = torch.log(torch.tensor([0.5, 0.25])).view(1, 1, 1, 2)
    q = torch.ones(1, 1, 1, 2)
    want = torch.tensor([[-1.25, -2.0], [2.75, 5.0]])
    for fn in (recurrent_dplr, lambda *x: chunk_dplr(*x[:7], 4, **dict(zip(("inclusive", "simultaneous"), x[7:])))):
        o, S = fn(q, k, v, a, b, lg, S0, True)
        assert torch.allclose(S.view(2, 2), want) and torch.allclose(o.view(2), torch.tensor([1.5, 3.0]))
        o, _ = fn(q, k, v, a, b, lg, S0, False)
        assert torch.allclose(o.view(2), torch.tensor([4.0, 6.0]))
    # simultaneous: both reads see S0: u0 = (1, 2), u1 = (3, 4);
    # Diag(d) S0 + outer(a0, u0) + outer(a1, u1) + outer(k0, v0) + outer(k1, v1)
    # = [[.5, 1], [.75, 1]] + [[0, 0], [1, 2]] - [[3, 4], [0, 0]] + [[1, 0], [1, 0]] + [[0, 0], [0, 2]]
    want = torch.tensor([[-1.5, -3.0], [2.75, 5.0]])
    for fn in (recurrent_dplr, lambda *x: chunk_dplr(*x[:7], 4, **dict(zip(("inclusive", "simultaneous"), x[7:])))):
        _, S = fn(q, k, v, a, b, lg, S0, True, True)
        assert torch.allclose(S.view(2, 2), want)


def test_delta_rule_by_hand():
    """The seed text's delta correction W1 = W0 + beta k^T (v - k W0) as a = -beta (times k), b = k."""
    k = torch.tensor([1.0, 0.0]).view(1, 1, 1, 2)
    v = torch.tensor([1.0, 0.0]).view(1, 1, 1, 2)
    W0 = torch.tensor([[0.5, 0.0], [0.0, 1.0]]).view(1, 1, 2, 2)
    beta = torch.ones(1, 1, 1)
    o, W1 = chunk_dplr(k, k, v * beta[..., None], -beta, None, None, W0, 4)
    assert torch.allclose(W1.view(2, 2), torch.eye(2)) and torch.allclose(o.view(2), torch.tensor([1.0, 0.0]))


# ---------------------------------------------------------------- numerics

@pytest.mark.parametrize("lo", [-40.0, -20.0, -5.0])
@pytest.mark.parametrize("R", [1, 2])
def test_extreme_channel_decays_match_float64(lo, R):
    """Per-channel log decays uniform in [lo, 0] per token, chunk 64 (cumulative logs down to
    64 lo inside a chunk): float32 chunked equals the float64 token loop; values and gradients
    finite."""
    q, k, v, a, b, _, S0 = make(1, 150, 2, R, 16, 16, a_kind="vec", decay=None, dtype=torch.float64, seed=9)
    g = torch.Generator().manual_seed(10)
    lg = lo * torch.rand(1, 150, 2, 16, generator=g, dtype=torch.float64)
    lg[:, 70:90] *= 1e-3           # a stretch of slow decays after fast ones: small differences of large sums
    ref = recurrent_dplr(q, k, v, a, b, lg, S0)
    f32 = [x.float().requires_grad_() for x in (q, k, v, a, b, lg, S0)]
    got = chunk_dplr(*f32, 64)
    assert rel(got[0], ref[0]) <= 1e-4 and rel(got[1], ref[1]) <= 1e-4
    gs = grads(got, f32)
    assert all(torch.isfinite(x).all() for x in gs)
    f64 = [x.clone().requires_grad_() for x in (q, k, v, a, b, lg, S0)]
    for gg, gr in zip(gs, grads(recurrent_dplr(*f64), f64)):
        assert rel(gg, gr) <= 1e-4


@pytest.mark.parametrize("decay", ["scalar", "channel"])
def test_zero_decays_stay_finite(decay):
    """Decays of exactly 0 (log = -inf, clamped to -80) and of 1 (log 0)."""
    q, k, v, a, b, lg, S0 = make(1, 70, 2, 2, 8, 8, a_kind="vec", decay=decay, seed=12)
    lg = torch.where(torch.rand(lg.shape, generator=torch.Generator().manual_seed(0)) < 0.3, float("-inf"), lg)
    lg[:, :5] = 0.0
    leaves = [x.requires_grad_() for x in (q, k, v, a, b, lg, S0)]
    o, S = chunk_dplr(*leaves, 32)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert all(torch.isfinite(x).all() for x in grads((o, S), leaves))
    ref = recurrent_dplr(*(x.detach() for x in leaves[:5]), lg.detach().clamp_min(-80.0), S0.detach())
    assert rel(o, ref[0]) <= 1e-4 and rel(S, ref[1]) <= 1e-4


@pytest.mark.parametrize("which", ["q", "k", "v", "a", "b", "log_decay"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_token_masked(which, bad):
    """A NaN / inf in token 10's inputs (head 1 only): outputs 0..9, head 0 throughout, and every
    input's gradient of a loss on outputs 0..9 equal the clean run's bit for bit (no future NaN ever
    meets a zero of the causal mask, forward or backward); a bad state input makes every later
    output of head 1 and its final state non-finite, a bad probe only its own output (the
    causality rule for non-finite inputs: masked by torch.where)."""
    names = ["q", "k", "v", "a", "b", "log_decay", "S0"]
    clean = make(1, 40, 2, 2, 8, 8, a_kind="vec", decay="channel", seed=13)
    dirty = [x.clone() for x in clean]
    x = dirty[names.index(which)]
    x[0, 10, 1] = bad                  # head 1 only; head 0 stays clean throughout
    lc = [x.clone().requires_grad_() for x in clean]
    ld = [x.clone().requires_grad_() for x in dirty]
    oc, Sc = chunk_dplr(*lc, 16)
    od, Sd = chunk_dplr(*ld, 16)
    assert torch.equal(od[:, :10], oc[:, :10]) and torch.equal(od[:, :, 0], oc[:, :, 0])
    assert torch.equal(Sd[:, 0], Sc[:, 0])
    if which == "q":
        assert not torch.isfinite(od[:, 10, 1]).any() and torch.equal(od[:, 11:], oc[:, 11:])
        assert torch.equal(Sd, Sc)
    else:
        assert not torch.isfinite(od[:, 10:, 1]).any() and not torch.isfinite(Sd[:, 1]).any()
    gc = torch.autograd.grad(oc[:, :10].square().sum(), lc)
    gd = torch.autograd.grad(od[:, :10].square().sum(), ld)
    for g1, g2 in zip(gc, gd):   # every input's gradient, the bad token's included (0 there)
        assert torch.equal(g1, g2)


def test_float32_stays_float32_and_bfloat16_computed_in_float32():
    inputs = make(1, 33, 2, 2, 8, 8, a_kind="vec", decay="channel", seed=14)
    o, S = chunk_dplr(*inputs, 16)
    assert o.dtype == torch.float32 and S.dtype == torch.float32 and o.is_contiguous()
    ob, Sb = chunk_dplr(*(x.bfloat16() for x in inputs), 16)
    assert ob.dtype == torch.bfloat16 and Sb.dtype == torch.bfloat16
    assert rel(ob.float(), o) < 0.05


def test_under_torch_func():
    """No in-place writes into fresh outputs: torch.func.grad and vmap work."""
    q, k, v, a, b, lg, _ = make(1, 11, 2, 2, 3, 4, a_kind="vec", decay="channel", seed=15)
    g_chunk = torch.func.grad(lambda q: chunk_dplr(q, k, v, a, b, lg, None, 4)[0].square().sum())(q)
    g_loop = torch.func.grad(lambda q: recurrent_dplr(q, k, v, a, b, lg, None)[0].square().sum())(q)
    assert rel(g_chunk, g_loop) <= 1e-5
    qs = torch.randn(3, 11, 2, 3, generator=torch.Generator().manual_seed(8))
    one = lambda q: chunk_dplr(q[None], k, v, a, b, lg, None, 4)[0][0]  # noqa: E731
    assert rel(torch.func.vmap(one)(qs), torch.stack([one(x) for x in qs])) <= 1e-6


def test_kernels_are_standalone():
    """The code generator copies these functions' source (and the shared phases they call): only
    torch, no closures over memspec."""
    from memspec.codegen.context import kernel_functions, phase_sources, runtime_source

    for fn in (chunk_dplr, recurrent_dplr, chunk_momentum_delta, recurrent_momentum_delta):
        src = inspect.getsource(fn)
        assert "memspec" not in src
        assert fn.__doc__ and "[B, T, H" in fn.__doc__
        namespace = {"torch": torch}
        own = [runtime_source(f) for f in kernel_functions(fn, src)]   # the family's functions it calls
        for part in phase_sources([src] + own) + own:
            assert "memspec" not in part
            exec(part, namespace)
        exec(src, namespace)
        assert callable(namespace[fn.__name__])


# ---------------------------------------------------------------- the peers (flash-linear-attention)
# Each peer's recurrent reference (trusted over its chunked one), its layout and defaults
# (scale = 1/sqrt(K) unless given; some head-first [B, H, T, D]) mapped onto
# S <- Diag(d) S + a (b^T S) + outer(k, v).

def peer_inputs(B=2, T=45, H=3, K=16, V=12, seed=20):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=g)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g), dim=-1)
    v = torch.randn(B, T, H, V, generator=g)
    beta = torch.rand(B, T, H, generator=g)
    S0 = torch.randn(B, H, K, V, generator=g)
    return g, q, k, v, beta, S0


def both(q, k, v, a, b, lg, S0, after=False, chunk=16):
    """(recurrent, chunked) results of memspec's kernels on the mapped inputs."""
    return (recurrent_dplr(q, k, v, a, b, lg, S0, read_after_decay=after),
            chunk_dplr(q, k, v, a, b, lg, S0, chunk, read_after_decay=after))


def assert_close_to_peer(ours, o_peer, S_peer, tol=1e-4):
    for o, S in ours:
        assert rel(o, o_peer) <= tol and rel(S, S_peer) <= tol, (rel(o, o_peer), rel(S, S_peer))


def test_peer_gated_delta_rule():
    """naive_recurrent_gated_delta_rule: S <- exp(g) S; S += k (beta (v - k^T S)) with the error read
    after the decay; o = (q / sqrt(K)) S.  Here: log_decay = g, a = -beta (times k), b = None (= k)
    with read_after_decay, v <- beta v, q <- q / sqrt(K); equally b = exp(g) (times k) read before."""
    mod = fla_naive("gated_delta_rule")
    g, q, k, v, beta, S0 = peer_inputs()
    lg = torch.log(0.7 + 0.3 * torch.rand(beta.shape, generator=g))
    o_p, S_p = mod.naive_recurrent_gated_delta_rule(q, k, v, beta, lg, initial_state=S0, output_final_state=True)
    ours = both(q / math.sqrt(q.shape[-1]), k, v * beta[..., None], -beta, None, lg, S0, after=True)
    assert_close_to_peer(ours, o_p, S_p)
    ours = both(q / math.sqrt(q.shape[-1]), k, v * beta[..., None], -beta, torch.exp(lg), lg, S0)
    assert_close_to_peer(ours, o_p, S_p)


def test_peer_delta_rule():
    """delta_rule_recurrence (head-first [B, H, T, D]): S += k (beta (v - k^T S)), o = (q / sqrt(K)) S.
    Here: a = -beta, b = None (= k), v <- beta v, no decay."""
    mod = fla_naive("delta_rule")
    _, q, k, v, beta, S0 = peer_inputs()
    hf = lambda x: x.transpose(1, 2).contiguous()  # noqa: E731
    o_p, S_p = mod.delta_rule_recurrence(hf(q), hf(k), hf(v), hf(beta), initial_state=S0.clone())
    ours = both(q / math.sqrt(q.shape[-1]), k, v * beta[..., None], -beta, None, None, S0)
    assert_close_to_peer(ours, o_p.transpose(1, 2), S_p)


def test_peer_kda():
    """naive_recurrent_kda: S <- Diag(exp(g)) S per key channel; S += (beta k) (v - k^T S)^T with the
    read after the decay; o = (q / sqrt(K)) S.  Here: per-channel log_decay = g, a = -beta,
    b = None (= k) with read_after_decay, v <- beta v; equally b = exp(g) * k read before the decay
    (k^T Diag(d) S = (d * k)^T S)."""
    mod = fla_naive("kda")
    g, q, k, v, beta, S0 = peer_inputs()
    lg = torch.log(0.5 + 0.5 * torch.rand(q.shape, generator=g))
    o_p, S_p = mod.naive_recurrent_kda(q, k, v, lg, beta, initial_state=S0, output_final_state=True)
    ours = both(q / math.sqrt(q.shape[-1]), k, v * beta[..., None], -beta, None, lg, S0, after=True)
    assert_close_to_peer(ours, o_p, S_p)
    ours = both(q / math.sqrt(q.shape[-1]), k, v * beta[..., None], -beta, torch.exp(lg) * k, lg, S0)
    assert_close_to_peer(ours, o_p, S_p)


def test_peer_gdn2():
    """naive_recurrent_gdn2: S <- Diag(exp(g)) S; S += k (w * v - (b_gate * k)^T S)^T, read after the
    decay.  Here: per-channel log_decay = g, a = -1 (times k), b = b_gate * k with read_after_decay,
    v <- w * v."""
    mod = fla_naive("gdn2")
    g, q, k, v, beta, S0 = peer_inputs()
    lg = torch.log(0.5 + 0.5 * torch.rand(q.shape, generator=g))
    b_gate = torch.rand(q.shape, generator=g)
    w = torch.rand(v.shape, generator=g)
    o_p, S_p = mod.naive_recurrent_gdn2(q, k, v, lg, b_gate, w, initial_state=S0, output_final_state=True)
    ours = both(q / math.sqrt(q.shape[-1]), k, w * v, -torch.ones_like(beta), b_gate * k, lg, S0, after=True)
    assert_close_to_peer(ours, o_p, S_p)


def test_peer_comba():
    """naive_recurrent_comba (the recurrent convention: the error p^T S is read AFTER the decay;
    naive_chunk_comba reads it before, so it is not used): S <- exp(g) S;
    S += k (beta (v - p^T S))^T; o = (q / sqrt(K)) S.  Here: log_decay = g (scalar), a = -beta,
    b = p with read_after_decay, v <- beta v."""
    mod = fla_naive("comba")
    g, q, k, v, beta, S0 = peer_inputs()
    p = torch.nn.functional.normalize(torch.randn(q.shape, generator=g), dim=-1)
    lg = torch.log(0.7 + 0.3 * torch.rand(beta.shape, generator=g))
    o_p, S_p = mod.naive_recurrent_comba(q, k, v, p, beta, lg, initial_state=S0, output_final_state=True)
    ours = both(q / math.sqrt(q.shape[-1]), k, v * beta[..., None], -beta, p, lg, S0, after=True)
    assert_close_to_peer(ours, o_p, S_p)


@pytest.mark.parametrize("R", [2, 3])
def test_peer_gated_delta_product(R):
    """naive_recurrent_gated_delta_product: keys, values, betas flattened over (token, step)
    ``[B, T R, H, *]``; S <- exp(g_t) S once per token, then R steps S += k_j (beta_j (v_j - k_j^T S))^T;
    o_t = (q_t * scale) S after the last step.  Here: k, v [B, T, H, R, *]; a = -beta [B, T, H, R];
    b = None (= k) with read_after_decay (step 0 reads after the decay); equally b = scalars times k,
    exp(g_t) on step 0 and 1 on the others, read before; v <- beta v."""
    mod = fla_naive("gated_delta_product")
    g, q, _, _, _, S0 = peer_inputs()
    B, T, H, K = q.shape
    V = S0.shape[-1]
    kf = torch.nn.functional.normalize(torch.randn(B, T * R, H, K, generator=g), dim=-1)
    vf = torch.randn(B, T * R, H, V, generator=g)
    bf = torch.rand(B, T * R, H, generator=g)
    lg = torch.log(0.7 + 0.3 * torch.rand(B, T, H, generator=g))
    o_p, S_p = mod.naive_recurrent_gated_delta_product(q, kf, vf, lg, bf, K ** -0.5, initial_state=S0.clone(),
                                                       output_final_state=True, num_householder=R)
    step = lambda x: x.view(B, T, R, H, *x.shape[3:]).transpose(2, 3)  # noqa: E731  [B, T, H, R, *]
    k, v, beta = step(kf), step(vf), step(bf)
    b = torch.cat([torch.exp(lg)[..., None], torch.ones(B, T, H, R - 1)], dim=-1)
    assert_close_to_peer(both(q * K ** -0.5, k, v * beta[..., None], -beta, b, lg, S0), o_p, S_p)
    assert_close_to_peer(both(q * K ** -0.5, k, v * beta[..., None], -beta, None, lg, S0, after=True), o_p, S_p)


def test_peer_dplr_recurrence():
    """dplr_recurrence (generalized_delta_rule/dplr, head-first): S <- S * exp(gk) (per key channel)
    + k v^T + beta_fla (alpha_fla^T S_prev), the read on the state before the decay; o = (q / sqrt(K)) S.
    Here: a = beta_fla, b = alpha_fla (vectors), per-channel log_decay = gk.  (RWKV-7's form.)"""
    mod = fla_naive("generalized_delta_rule/dplr")
    g, q, k, v, _, S0 = peer_inputs()
    B, T, H, K = q.shape
    kk = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g), dim=-1)
    alpha = -kk                                                   # RWKV-7: a = -kk, b = kk * iclr
    beta_f = kk * torch.rand(B, T, H, K, generator=g)
    gk = torch.log(0.5 + 0.5 * torch.rand(B, T, H, K, generator=g))
    hf = lambda x: x.transpose(1, 2).contiguous()  # noqa: E731
    o_p, S_p = mod.dplr_recurrence(hf(q), hf(k), hf(v), hf(alpha), hf(beta_f), hf(gk), initial_state=S0.clone())
    ours = both(q / math.sqrt(K), k, v, beta_f, alpha, gk, S0)
    assert_close_to_peer(ours, o_p.transpose(1, 2), S_p)


def _compile_cases():
    from memspec.runtime.delta import chunk_delta
    q, k, v, a, b, lg, S0 = make(1, 40, 2, 2, 8, 8, a_kind="vec", decay="channel", seed=23)
    beta = torch.rand(1, 40, 2, generator=torch.Generator().manual_seed(0))
    return [
        (lambda: chunk_dplr(q, k, v, a, b, lg, S0, 16)),
        (lambda: chunk_dplr(q, k, v, -beta[..., None].expand(-1, -1, -1, 2), None, lg[..., 0], S0, 16,
                            read_after_decay=True)),
        (lambda: chunk_delta(q, k[:, :, :, 0], v[:, :, :, 0], beta, lg[..., 0], S0, 16)),
    ]


def test_compiles_in_one_graph():
    """torch.compile(fullgraph=True) traces both kernels without a graph break: no .item() or
    int(tensor) syncs, nothing data-dependent in Python (aot_eager: the inductor run is slow-marked)."""
    for f in _compile_cases():
        ref = f()
        got = torch.compile(f, backend="aot_eager", fullgraph=True)()
        assert_same_function(got[0], ref[0])   # aot_eager decomposes ops: another order of sums
        assert_same_function(got[1], ref[1])


@pytest.mark.slow
def test_compiles_with_inductor():
    """The inductor backend (the one CUDA uses) compiles both kernels and matches eager."""
    for f in _compile_cases():
        ref = f()
        got = torch.compile(f, backend="inductor", fullgraph=True)()
        assert rel(got[0], ref[0]) <= 1e-5 and rel(got[1], ref[1]) <= 1e-5


# ---------------------------------------------------------------- the momentum delta rule (two coupled states)

def momentum_inputs(B, T, H, K, V, dtype=torch.float32, seed=30):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=g, dtype=dtype)
    k, p = (torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g, dtype=dtype), dim=-1) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=g, dtype=dtype)
    lgam, lmu = (torch.log(0.5 + 0.5 * torch.rand(B, T, H, generator=g, dtype=dtype)) for _ in range(2))
    beta, eta = (torch.rand(B, T, H, generator=g, dtype=dtype) for _ in range(2))
    S0, M0 = (torch.randn(B, H, K, V, generator=g, dtype=dtype) for _ in range(2))
    return q, k, v, p, lgam, lmu, beta, eta, S0, M0


@pytest.mark.parametrize("T", [1, 37, 64, 65])
@pytest.mark.parametrize("inclusive", [True, False])
def test_momentum_chunk_matches_recurrent(T, inclusive):
    """The exact chunked momentum delta rule vs its token loop: outputs, both final states, every
    input's gradient (chunk 16: tails, one chunk, several)."""
    leaves = [x.requires_grad_() for x in momentum_inputs(2, T, 2, 5, 4)]
    ref = recurrent_momentum_delta(*leaves, inclusive)
    got = chunk_momentum_delta(*leaves, 16, inclusive=inclusive)
    for a, b in zip(got, ref):
        assert a.shape == b.shape and rel(a, b) <= 1e-4
    g = torch.Generator().manual_seed(1)
    w = [torch.randn(x.shape, generator=g) for x in ref]
    gr = torch.autograd.grad(sum((x * y).sum() for x, y in zip(ref, w)), leaves)
    gg = torch.autograd.grad(sum((x * y).sum() for x, y in zip(got, w)), leaves)
    for a, b in zip(gg, gr):
        assert torch.isfinite(a).all() and rel(a, b) <= 1e-4


@pytest.mark.parametrize("group", [1, 2, 3])
def test_momentum_groups_of_chunks_give_the_same_numbers(group):
    """Chunks in groups of G (the last group short, its last chunk a tail): outputs, both states
    and every gradient as with all chunks in one group (the test shapes' default), float64."""
    leaves = [x.requires_grad_() for x in momentum_inputs(2, 69, 2, 5, 4, dtype=torch.float64)]
    one = chunk_momentum_delta(*leaves, 16)
    got = chunk_momentum_delta(*leaves, 16, group=group)
    w = [torch.randn(x.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64) for x in one]
    g1 = torch.autograd.grad(sum((x * y).sum() for x, y in zip(one, w)), leaves)
    gg = torch.autograd.grad(sum((x * y).sum() for x, y in zip(got, w)), leaves)
    for a, b in zip(list(got) + list(gg), list(one) + list(g1)):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)


def test_momentum_gradcheck_float64():
    args = [x.requires_grad_() for x in momentum_inputs(1, 5, 1, 3, 2, dtype=torch.float64)]
    assert torch.autograd.gradcheck(lambda *x: chunk_momentum_delta(*x, 2), args, eps=1e-6, atol=1e-6)


def test_momentum_by_hand():
    """One token, K = V = 1: S0 = 2, M0 = 1, k = p = 1, v = 3, mu = 1/2, gamma = 1/4, eta = 1, beta = 2:
    M = 1/2 + (2 - 3) = -1/2; S = 2/4 - 2 (-1/2) = 3/2; o = q S = 3/2 (q = 1), q S0 = 2 exclusive."""
    one = torch.ones(1, 1, 1, 1)
    args = (one, one, 3 * one, one, torch.log(torch.full((1, 1, 1), 0.25)), torch.log(torch.full((1, 1, 1), 0.5)),
            torch.full((1, 1, 1), 2.0), torch.ones(1, 1, 1), 2 * one, one)
    for fn in (recurrent_momentum_delta, lambda *x: chunk_momentum_delta(*x[:10], 4, **dict(zip(("inclusive",), x[10:])))):
        o, S, M = fn(*args)
        assert torch.allclose(o.view(()), torch.tensor(1.5)) and torch.allclose(S.view(()), torch.tensor(1.5))
        assert torch.allclose(M.view(()), torch.tensor(-0.5))
        assert torch.allclose(fn(*args, False)[0].view(()), torch.tensor(2.0))


def test_peer_momentum_delta_rule():
    """recurrent_momentum_delta_rule_ref: w = -(v - p^T S); M = mu M + (eta k) w; S = alpha S - beta M;
    o = (q / sqrt(K)) S, alpha = exp(log_alpha), mu = exp(log_mu).  Here: log_gamma = log_alpha.
    (fla's chunk_momentum_delta_rule_ref does not match its own recurrent reference: not used.)"""
    mod = fla_naive("momentum_delta_rule")
    q, k, v, p, lgam, lmu, beta, eta, S0, M0 = momentum_inputs(2, 45, 3, 16, 12)
    o_p, (S_p, M_p) = mod.recurrent_momentum_delta_rule_ref(q, k, v, lgam, lmu, p, beta, eta, initial_S=S0,
                                                            initial_M=M0, output_final_state=True)
    K = q.shape[-1]
    for ours in (recurrent_momentum_delta(q / math.sqrt(K), k, v, p, lgam, lmu, beta, eta, S0, M0),
                 chunk_momentum_delta(q / math.sqrt(K), k, v, p, lgam, lmu, beta, eta, S0, M0, 16)):
        assert rel(ours[0], o_p) <= 1e-4 and rel(ours[1], S_p) <= 1e-4 and rel(ours[2], M_p) <= 1e-4


def test_momentum_state_only_and_empty():
    q, k, v, p, lgam, lmu, beta, eta, S0, M0 = momentum_inputs(1, 21, 2, 4, 3)
    _, S_r, M_r = recurrent_momentum_delta(q, k, v, p, lgam, lmu, beta, eta, None, None)
    o, S, M = chunk_momentum_delta(None, k, v, p, lgam, lmu, beta, eta, None, None, 8)
    assert o is None and rel(S, S_r) <= 1e-5 and rel(M, M_r) <= 1e-5
    o, S, M = chunk_momentum_delta(*(x[:, :0] for x in (q, k, v, p, lgam, lmu, beta, eta)), S0, M0, 8)
    assert o.shape == (1, 0, 2, 3) and torch.equal(S, S0) and torch.equal(M, M0)


@pytest.mark.parametrize("R", [1, 2])
@pytest.mark.parametrize("a_kind", ["scalar", "vec"])
def test_without_autograd_equals_with(R, a_kind):
    """Without autograd the per-channel halving updates its factors in place: the same numbers as
    with it (R = 1 makes the columns a strided view of the inputs), for one and several chunks."""
    for T in (8, 45):
        q, k, v, a, b, lg, S0 = make(1, T, 2, R, 4, 3, a_kind=a_kind, decay="channel", seed=3, squeeze=R == 1)
        ref = recurrent_dplr(q, k, v, a, b, lg, S0)
        with torch.no_grad():
            o, S = chunk_dplr(q, k, v, a, b, lg, S0, 4)
        o2, S2 = chunk_dplr(q, k, v, a, b, lg, S0.clone().requires_grad_(), 4)
        assert torch.allclose(o, o2.detach(), rtol=0, atol=1e-6) and torch.allclose(S, S2.detach(), rtol=0, atol=1e-6)
        assert rel(o, ref[0]) <= 1e-5 and rel(S, ref[1]) <= 1e-5
