"""The additive kernel with one log decay per key channel (GLA, RWKV-6, HGRN-2), and causal
robustness of every additive path: against the token loop, float64, and flash-linear-attention.

``S_t = Diag(exp(log_gamma_t)) S_{t-1} + outer(k_t, v_t)``, ``o_t = q_t @ S_t`` (inclusive) or
``q_t @ S_{t-1}`` (exclusive), ``log_gamma`` ``[B, T, H, K]``.
"""
from __future__ import annotations

import pytest
import torch

from memspec.runtime.additive import chunk_additive, recurrent_additive

from close import assert_same_function
from peers import fla_naive


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def make(B, T, H, K, V, dtype=torch.float32, seed=0, log_decay=(-0.7, 0.0)):
    """q, k, v, per-channel log decays uniform in log_decay, S0."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=g, dtype=dtype)
    k = torch.randn(B, T, H, K, generator=g, dtype=dtype)
    v = torch.randn(B, T, H, V, generator=g, dtype=dtype)
    lo, hi = log_decay
    lg = lo + (hi - lo) * torch.rand(B, T, H, K, generator=g, dtype=dtype)
    S0 = torch.randn(B, H, K, V, generator=g, dtype=dtype)
    return q, k, v, lg, S0


def grads(out, inputs, seed=1):
    """Gradients of a fixed random projection of (o, S_T) with respect to inputs."""
    o, S = out
    g = torch.Generator().manual_seed(seed)
    w_o = torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.dtype)
    w_s = torch.randn(S.shape, generator=g, dtype=torch.float64).to(S.dtype)
    return torch.autograd.grad((o * w_o).sum() + (S * w_s).sum(), inputs)


def check_against_float64(args, chunk, inclusive, tol, group=None):
    """Kernel (float32) vs the token loop in float64 on the same values: o, S_T and the gradients
    of q, k, v, log_gamma and S0."""
    ins = [x.clone().requires_grad_() for x in args]
    ins64 = [x.detach().double().requires_grad_() for x in args]
    got = chunk_additive(*ins, chunk, inclusive=inclusive, group=group)
    ref = recurrent_additive(*ins64, inclusive)
    assert got[0].shape == ref[0].shape and got[1].shape == ref[1].shape
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.float32
    assert rel(got[0], ref[0]) <= tol, "outputs"
    assert rel(got[1], ref[1]) <= tol, "final state"
    for name, gg, gr in zip("q k v log_gamma S0".split(), grads(got, ins), grads(ref, ins64)):
        assert torch.isfinite(gg).all(), name
        assert rel(gg, gr) <= tol, name


@pytest.mark.parametrize("T", [1, 63, 64, 65, 200])
@pytest.mark.parametrize("chunk", [16, 64])
@pytest.mark.parametrize("inclusive", [True, False])
def test_channel_matches_recurrent(T, chunk, inclusive):
    """Both read orders, T below, at and above a chunk, a padded tail: outputs, final state and
    every input gradient equal the float64 token loop."""
    check_against_float64(make(2, T, 2, 5, 3, seed=T), chunk, inclusive, 1e-5)


@pytest.mark.parametrize("group", [1, 2, 3, None])
@pytest.mark.parametrize("inclusive", [True, False])
def test_channel_groups(group, inclusive):
    """Chunks batched G at a time (full groups, a partial group, a padded tail: T = 7 C + 3)."""
    check_against_float64(make(2, 7 * 8 + 3, 3, 4, 6, seed=2), 8, inclusive, 1e-5, group=group)


def test_channel_chunk_rounded_to_a_power_of_two():
    """Any chunk size gives the same numbers: 12 runs as 8, 100 as 64 (halved level by level)."""
    q, k, v, lg, S0 = make(1, 130, 2, 4, 4, seed=3)
    ref = recurrent_additive(q, k, v, lg, S0)
    for chunk in (12, 100, 3, 1):
        o, S = chunk_additive(q, k, v, lg, S0, chunk)
        assert rel(o, ref[0]) <= 1e-5 and rel(S, ref[1]) <= 1e-5
    assert torch.allclose(chunk_additive(q, k, v, lg, S0, 100)[0], chunk_additive(q, k, v, lg, S0, 64)[0],
                          rtol=0, atol=1e-6)


def test_channel_state_only_zero_state_and_tuple_values():
    q, k, v, lg, S0 = make(2, 37, 2, 4, 5, seed=4)
    o, S = chunk_additive(None, k, v, lg, None, 8)
    _, S_ref = recurrent_additive(q, k, v, lg, None)
    assert o is None and rel(S, S_ref) <= 1e-5
    ones = torch.ones(2, 37, 2, 1)
    S0_full = torch.cat([S0, torch.zeros(2, 2, 4, 1)], dim=-1)
    o, S = chunk_additive(q, k, (v, ones), lg, S0_full, 8)
    o_ref, S_ref = recurrent_additive(q, k, torch.cat([v, ones], dim=-1), lg, S0_full)
    assert o.shape == (2, 37, 2, 6) and rel(o, o_ref) <= 1e-5 and rel(S, S_ref) <= 1e-5


def test_channel_empty_sequence():
    """T = 0: an empty output and the initial state unchanged (zeros when S0 is None)."""
    q, k, v, lg, S0 = make(2, 0, 3, 4, 5)
    o, S = chunk_additive(q, k, v, lg, S0, 16)
    assert o.shape == (2, 0, 3, 5) and torch.equal(S, S0)
    o, S = chunk_additive(None, k, v, lg, None, 16)
    assert o is None and torch.equal(S, torch.zeros(2, 3, 4, 5))
    o, S = recurrent_additive(q, k, v, lg, S0)
    assert o.shape == (2, 0, 3, 5) and torch.equal(S, S0)


@pytest.mark.parametrize("inclusive", [True, False])
def test_channel_gradcheck_float64(inclusive):
    """T = 7 with chunk 4: a full chunk and a padded tail of 3 tokens."""
    args = [x.requires_grad_() for x in make(1, 7, 2, 3, 2, dtype=torch.float64, seed=5)]

    def f(q, k, v, lg, S0):
        return chunk_additive(q, k, v, lg, S0, 4, inclusive=inclusive)
    assert torch.autograd.gradcheck(f, args, eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("decays", ["uniform", "all", "mixed"])
@pytest.mark.parametrize("inclusive", [True, False])
def test_channel_extreme_decays_match_float64(decays, inclusive):
    """Log decays down to -20 per token with chunk 64 (-1280 over a chunk): outputs, state and
    gradients finite and equal to the float64 token loop."""
    q, k, v, lg, S0 = make(2, 130, 2, 8, 6, seed=6)
    g = torch.Generator().manual_seed(7)
    if decays == "uniform":
        lg = -20 * torch.rand(lg.shape, generator=g)
    elif decays == "all":
        lg = torch.full_like(lg, -20.0)
    else:  # channels switch between forgetting at once and keeping
        lg = torch.where(torch.rand(lg.shape, generator=g) < 0.5, -20.0, -0.01 * torch.rand(lg.shape, generator=g))
    check_against_float64((q, k, v, lg, S0), 64, inclusive, 1e-5)



@pytest.mark.parametrize("inclusive", [True, False])
@pytest.mark.parametrize("probes", [True, False])
def test_channel_packed_documents_extreme_decays(inclusive, probes):
    """Packed documents (one of a single token, one ending inside a chunk) with log decays of -40,
    0 and -inf per token: outputs, final states and gradients equal the float64 token loop run on
    each document from its own initial state."""
    from memspec.runtime.varlen import _Documents
    offsets = [0, 37, 38, 101, 160]
    q, k, v, lg, _ = make(1, offsets[-1], 2, 6, 5, seed=40)
    r = torch.rand(lg.shape, generator=torch.Generator().manual_seed(41))
    lg = torch.where(r < 0.3, -40.0, torch.where(r < 0.4, 0.0, -r))
    S0 = torch.randn(len(offsets) - 1, 2, 6, 5, generator=torch.Generator().manual_seed(42))
    ins = [x.clone().requires_grad_() for x in (q, k, v, lg, S0)]
    o, S = chunk_additive(ins[0] if probes else None, *ins[1:], 16, inclusive=inclusive,
                          documents=_Documents(torch.tensor(offsets)))
    loss = (S * torch.randn(S.shape, generator=torch.Generator().manual_seed(43))).sum()
    loss = loss + (o.square().sum() if probes else 0)
    got = torch.autograd.grad(loss, ins if probes else ins[1:])
    ins64 = [x.detach().double().requires_grad_() for x in (q, k, v, lg, S0)]
    outs, states = [], []
    for i, (a, b) in enumerate(zip(offsets[:-1], offsets[1:])):
        o_i, S_i = recurrent_additive(*(x[:, a:b] for x in ins64[:4]), ins64[4][i:i + 1], inclusive)
        outs.append(o_i)
        states.append(S_i)
    o_ref, S_ref = torch.cat(outs, 1), torch.cat(states)
    loss = (S_ref * torch.randn(S.shape, generator=torch.Generator().manual_seed(43)).double()).sum()
    loss = loss + (o_ref.square().sum() if probes else 0)
    want = torch.autograd.grad(loss, ins64 if probes else ins64[1:])
    assert rel(S, S_ref) <= 1e-5 and (o is None) != probes and (not probes or rel(o, o_ref) <= 1e-5)
    for g, w in zip(got, want):
        assert torch.isfinite(g).all() and rel(g, w) <= 1e-5

def test_channel_zero_decay_is_exact():
    """A decay of exactly 0 (log decay -inf) erases those rows of the state, as in the loop."""
    q, k, v, lg, S0 = make(2, 70, 2, 4, 3, seed=8)
    g = torch.Generator().manual_seed(9)
    lg = torch.where(torch.rand(lg.shape, generator=g) < 0.1, float("-inf"), lg)
    for inclusive in (True, False):
        got = chunk_additive(q, k, v, lg, S0, 16, inclusive=inclusive)
        ref = recurrent_additive(*(x.double() for x in (q, k, v, lg, S0)), inclusive)
        assert torch.isfinite(got[0]).all() and torch.isfinite(got[1]).all()
        assert rel(got[0], ref[0]) <= 1e-5 and rel(got[1], ref[1]) <= 1e-5


def test_channel_without_autograd_leaves_inputs_alone():
    """Without autograd the factors are updated in place: never an input's memory (B = H = 1, where
    a chunk block can be a view of k), and the same numbers as with autograd."""
    for B, H in ((1, 1), (2, 3)):
        q, k, v, lg, S0 = make(B, 37, H, 4, 3, seed=10)
        saved = [x.clone() for x in (q, k, v, lg, S0)]
        for qq in (q, None):
            for inclusive in (True, False):
                with torch.no_grad():
                    o, S = chunk_additive(qq, k, v, lg, S0, 8, inclusive=inclusive)
                assert all(torch.equal(x, y) for x, y in zip((q, k, v, lg, S0), saved))
                k_ = k.clone().requires_grad_()
                o_g, S_g = chunk_additive(qq, k_, v, lg, S0, 8, inclusive=inclusive)
                assert_same_function(S, S_g.detach())
                if qq is not None:
                    assert_same_function(o, o_g.detach())


def test_channel_under_torch_func():
    """torch.func.grad and vmap (over each input, with and without autograd) agree with the loop."""
    q, k, v, lg, _ = make(1, 11, 2, 3, 4, seed=11)
    for inclusive in (True, False):
        for i in (0, 3):
            def loss(fn, i=i):
                def f(x):
                    args = [q, k, v, lg]
                    args[i] = x
                    return fn(*args, None, *(() if fn is recurrent_additive else (4,)), inclusive=inclusive)[0].square().sum()
                return f
            x = (q, k, v, lg)[i]
            assert rel(torch.func.grad(loss(chunk_additive))(x), torch.func.grad(loss(recurrent_additive))(x)) <= 1e-5
        for i in range(4):
            g = torch.Generator().manual_seed(12 + i)
            xs = torch.randn((3,) + (q, k, v, lg)[i].shape[1:], generator=g)
            xs = -xs.abs() if i == 3 else xs

            def one(x, i=i):
                args = [q, k, v, lg]
                args[i] = x[None]
                return chunk_additive(*args, None, 4, inclusive=inclusive)[0][0]
            for grad_mode in (True, False):
                with torch.set_grad_enabled(grad_mode):
                    assert rel(torch.func.vmap(one)(xs), torch.stack([one(x) for x in xs])) <= 1e-6


# --------------------------------------------------------------- causality with non-finite inputs
NONFINITE = [float("nan"), float("inf"), float("-inf")]


@pytest.mark.parametrize("decay, which", [(d, w) for d in ("none", "head", "channel")
                                          for w in ("q", "k", "v", "log_gamma") if d != "none" or w != "log_gamma"])
@pytest.mark.parametrize("inclusive", [True, False])
def test_nonfinite_token_stays_causal(decay, which, inclusive):
    """A NaN or inf in token 10's inputs (chunk 8, groups of 2 chunks: token 10 is inside a chunk
    and a group) leaves the outputs of tokens 0-9 exactly those of the clean run; no output the
    token loop makes non-finite comes out finite.  Per channel, the non-finite entries of the
    outputs and final state are exactly the loop's (a log decay of -inf is a decay of 0 there);
    per head, log decays must be finite, and a bad log decay may also spoil o_10 of an exclusive
    read."""
    B, T, H, K, V = 2, 40, 2, 4, 3
    q, k, v, lg, S0 = make(B, T, H, K, V, seed=13)
    lg = {"none": None, "head": lg[..., 0], "channel": lg}[decay]
    clean = chunk_additive(q, k, v, lg, S0, 8, inclusive=inclusive, group=2)
    for bad in NONFINITE:
        args = {"q": q.clone(), "k": k.clone(), "v": v.clone(), "log_gamma": None if lg is None else lg.clone()}
        args[which][:, 10] = bad
        args = (args["q"], args["k"], args["v"], args["log_gamma"], S0)
        o, S = chunk_additive(*args, 8, inclusive=inclusive, group=2)
        assert torch.equal(o[:, :10], clean[0][:, :10]), bad
        o_ref, S_ref = recurrent_additive(*args, inclusive)
        assert not (torch.isfinite(o) & ~torch.isfinite(o_ref)).any(), bad
        assert not (torch.isfinite(S) & ~torch.isfinite(S_ref)).any(), bad
        both = torch.isfinite(o) & torch.isfinite(o_ref)
        assert torch.allclose(o[both], o_ref[both], rtol=1e-4, atol=1e-4)
        if decay == "channel":
            assert torch.equal(torch.isfinite(o), torch.isfinite(o_ref)), bad
            assert torch.equal(torch.isfinite(S), torch.isfinite(S_ref)), bad


# ------------------------------------------------------------ flash-linear-attention's references
def scaled(q):
    """The peers scale q by 1 / sqrt(K) inside (fla's default ``scale``); memspec takes q as given."""
    return q * q.shape[-1] ** -0.5


@pytest.mark.parametrize("T", [64, 100])
def test_peer_gla(T):
    """fla ``gla/naive.py: naive_recurrent_gla``: inputs [B, T, H, D] (it transposes to head-first
    itself), ``gk`` per-channel log decays [B, T, H, K], ``h = h * exp(gk_t) + k_t v_t^T`` then
    ``o_t = (q_t / sqrt(K)) h`` (inclusive read), initial and final state [B, H, K, V]."""
    peer = fla_naive("gla")
    q, k, v, gk, S0 = make(2, T, 3, 16, 8, seed=20)
    o_ref, S_ref = peer.naive_recurrent_gla(q, k, v, gk, initial_state=S0, output_final_state=True)
    o, S = chunk_additive(scaled(q), k, v, gk, S0, 64)
    assert rel(o, o_ref) <= 1e-4 and rel(S, S_ref) <= 1e-4


def test_peer_simple_gla():
    """fla ``simple_gla/naive.py: naive_recurrent_simple_gla``: [B, T, H, D] inputs, one log decay
    per head ``g`` [B, T, H] (RetNet / Mamba-2's scalar decay), ``scale`` defaults to 1 / sqrt(K),
    inclusive read.  The per-head log decay given as K equal channels gives the same numbers."""
    peer = fla_naive("simple_gla")
    q, k, v, lg, S0 = make(2, 100, 3, 16, 8, seed=21)
    g = lg[..., 0]
    o_ref, S_ref = peer.naive_recurrent_simple_gla(q, k, v, g, initial_state=S0, output_final_state=True)
    o, S = chunk_additive(scaled(q), k, v, g, S0, 64)
    assert rel(o, o_ref) <= 1e-4 and rel(S, S_ref) <= 1e-4
    o, S = chunk_additive(scaled(q), k, v, g[..., None].expand_as(k), S0, 64)
    assert rel(o, o_ref) <= 1e-4 and rel(S, S_ref) <= 1e-4


def test_peer_rwkv6():
    """fla ``rwkv6/recurrent_naive.py: naive_recurrent_rwkv6``: head-first [B, H, T, D] inputs,
    ``w`` per-channel log decays, bonus ``u`` [H, K]:
    ``o_t = (q_t / sqrt(K)) (h + u * k_t v_t^T)`` with h the state *before* token t, then
    ``h = h * exp(w_t) + k_t v_t^T``.  memspec: the exclusive read of the kernel, plus the
    token-local bonus ``((q / sqrt(K)) * u * k).sum() v`` computed outside it."""
    peer = fla_naive("rwkv6", "recurrent_naive.py")
    q, k, v, w, S0 = make(2, 100, 3, 16, 8, seed=22)
    u = torch.randn(3, 16, generator=torch.Generator().manual_seed(23))
    hf = [x.transpose(1, 2).contiguous() for x in (q, k, v, w)]
    o_ref, S_ref = peer.naive_recurrent_rwkv6(*hf, u, initial_state=S0, output_final_state=True)
    o, S = chunk_additive(scaled(q), k, v, w, S0, 64, inclusive=False)
    o = o + (scaled(q) * u * k).sum(-1, keepdim=True) * v
    assert rel(o, o_ref.transpose(1, 2)) <= 1e-4 and rel(S, S_ref) <= 1e-4


def test_peer_hgrn2_as_gla():
    """HGRN-2: ``S_t = Diag(g_t) S_{t-1} + outer(1 - g_t, v_t)``, ``o_t = q_t S_t``: the GLA form
    with the key tied to the forget gate, ``k = 1 - exp(log g)``, against fla's
    ``naive_recurrent_gla`` with that key (HGRN-2's own fla layer calls the GLA kernels)."""
    peer = fla_naive("gla")
    q, _, v, log_g, S0 = make(2, 100, 3, 16, 8, seed=24, log_decay=(-3.0, 0.0))
    k = 1 - torch.exp(log_g)
    o_ref, S_ref = peer.naive_recurrent_gla(q, k, v, log_g, initial_state=S0, output_final_state=True)
    o, S = chunk_additive(scaled(q), k, v, log_g, S0, 64)
    assert rel(o, o_ref) <= 1e-4 and rel(S, S_ref) <= 1e-4


# ------------------------------------------------------------------ specialised kernels (codegen)
@pytest.mark.parametrize("inclusive", [True, False])
@pytest.mark.parametrize("state_only", [False, True])
def test_channel_specialised_equals_general(inclusive, state_only):
    """The kernel specialised the way a generated module carries it (memspec.codegen.specialise:
    constant arguments bound, decided branches dropped) gives the general kernel's numbers bit for
    bit with per-channel decays; bound to per-head decays (per_channel=False) or to none, no
    per-channel code is left, and bound to per_channel=True no per-head code."""
    from memspec.codegen.context import kernel_functions, phase_sources, runtime_source
    from memspec.codegen.specialise import specialise

    consts = {"inclusive": inclusive, "group": None} | ({"q": None} if state_only else {})
    q, k, v, lg, S0 = make(2, 37, 2, 5, 3, dtype=torch.float64, seed=30)
    want = chunk_additive(None if state_only else q, k, v, lg, S0, 8, inclusive=inclusive)
    for extra in ({}, {"per_channel": True}):
        ns = {"torch": torch}
        src = specialise(chunk_additive, **consts, **extra)
        own = [runtime_source(f) for f in kernel_functions(chunk_additive, src)]   # its family's functions
        for part in phase_sources([src] + own) + own:   # and the shared phases it calls
            exec(part, ns)
        exec(compile(src, "<specialised>", "exec"), ns)
        got = ns["chunk_additive"](*([] if state_only else [q]), k, v, lg, S0, 8)
        assert (got[0] is None) == state_only and torch.equal(got[1], want[1])
        if not state_only:
            assert torch.equal(got[0], want[0])
    assert "cumsum" not in src and "tril" not in src                 # per_channel=True: no per-head path
    for extra in ({"per_channel": False}, {"log_gamma": None, "per_channel": None}):
        src = specialise(chunk_additive, **consts, **extra)
        assert not any(name in src for name in ("gam_t", "inplace", "KE", "QF", "levels", "channel ="))
