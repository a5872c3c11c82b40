"""The shipped linear-in-state specs against flash-linear-attention's pure-PyTorch recurrences.

Each test runs one spec through memspec.reference (the oracle) and through its compiled module
(every schedule it admits), maps the same random inputs to the peer's conventions, runs the
peer's token-by-token reference (``fla/ops/<op>/naive.py``, loaded by file path by
:mod:`peers`) and compares outputs and final states in float32 (relative error <= 1e-4).

Conventions of the peers, matched here (each test says which it uses):

* layouts: most references take ``[B, T, H, D]``; ``naive_recurrent_rwkv6``,
  ``naive_retention``, ``dplr_recurrence`` and ``delta_rule_recurrence`` are head-first
  ``[B, H, T, D]``;
* decays are *log* decays (``gk``, ``g``, ``w``), memspec's gates are the forgotten part
  ``alpha`` (the memory keeps ``1 - alpha``): the peer gets ``log(1 - alpha)``;
* the peers scale the query by ``d_k^-1/2`` (some fixed, some through ``scale``); the
  specs do not: a fixed scale is undone by feeding ``q * sqrt(d_k)``, a ``scale`` argument
  is set to 1;
* the peers do not normalise keys and queries: the l2-normalised inputs are computed here
  with memspec's l2norm (``x / sqrt(sum(x^2) + 1e-6)``) and fed to the peer;
* Comba: the recurrent reference reads the error ``v - p S`` after the decay (its chunked
  reference reads it before; the spec follows the recurrent one).
"""
from __future__ import annotations

import math

import pytest
import torch

import memspec
from memspec import reference
from memspec.pipeline.build import build_memory
from peers import fla_naive

from _compiled_harness import ROOT, rel_err

B, T, H, K, V = 2, 11, 2, 8, 6
TOL = 1e-4


def _l2n(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _rand(*shape, seed, lo=None, hi=None):
    g = torch.Generator().manual_seed(seed)
    if lo is None:
        return 0.5 * torch.randn(*shape, generator=g)
    return lo + (hi - lo) * torch.rand(*shape, generator=g)


def _ours(name, ins, state=None, params=None):
    """(reference outputs and state, [(schedule, outputs, state) of the compiled module])."""
    spec = memspec.load(ROOT / "specs" / f"{name}.yaml")
    dims = {"d_k": K, "d_v": V, "heads": H}
    ref = reference.run(spec, state=dict(state or {}), dims=dims, params=params, **ins)
    m = build_memory(spec, compile=False, chunk=4, **dims)
    with torch.no_grad():
        for n, p in (params or {}).items():
            if n in spec.params:
                getattr(m, n).copy_(p)
    full = m.init_state(B)
    full.update(state or {})
    runs = []
    for schedule in m.SCHEDULES:
        if schedule == "minibatch":
            continue   # approximate: compared with the reference's own mini-batch elsewhere
        with torch.no_grad():
            o, st = m(*[ins[v] for v in spec.views], **{g: ins[g] for g in spec.gates},
                      state=dict(full), schedule=schedule)
        runs.append((schedule, o, st))
    return ref, runs


def _compare(ref, runs, peer_o, peer_states: dict):
    ro, rs = ref
    assert rel_err(ro, peer_o) <= TOL
    for n, s in peer_states.items():
        assert rel_err(rs[n], s) <= TOL, n
    for schedule, o, st in runs:
        assert rel_err(o, peer_o) <= TOL, schedule
        for n, s in peer_states.items():
            assert rel_err(st[n], s) <= TOL, (schedule, n)


def _qkv(seed):
    return {"q": _rand(B, T, H, K, seed=seed), "k": _rand(B, T, H, K, seed=seed + 1),
            "v": _rand(B, T, H, V, seed=seed + 2)}


def test_gla_matches_naive_recurrent_gla():
    """naive_recurrent_gla: [B, T, H, D], gk = log decay per key channel, q scaled by K^-1/2
    inside (fixed): fed q * sqrt(K)."""
    x = _qkv(0)
    alpha = _rand(B, T, H, K, seed=10, lo=0.02, hi=0.4)
    S0 = _rand(B, H, K, V, seed=11)
    ref, runs = _ours("gla", {**x, "alpha": alpha}, {"S": S0})
    gla = fla_naive("gla")
    o, S = gla.naive_recurrent_gla(x["q"] * math.sqrt(K), x["k"], x["v"], torch.log(1 - alpha),
                                   initial_state=S0, output_final_state=True)
    _compare(ref, runs, o, {"S": S})


def test_hgrn2_matches_naive_recurrent_gla_with_the_tied_key():
    """HGRN2 is GLA with the key tied to the forget gate (k = 1 - f = alpha): naive_recurrent_gla
    with k = alpha, gk = log(1 - alpha), q * sqrt(K)."""
    x = _qkv(20)
    alpha = _rand(B, T, H, K, seed=21, lo=0.02, hi=0.6)
    S0 = _rand(B, H, K, V, seed=22)
    ref, runs = _ours("hgrn2", {"q": x["q"], "v": x["v"], "alpha": alpha}, {"S": S0})
    gla = fla_naive("gla")
    o, S = gla.naive_recurrent_gla(x["q"] * math.sqrt(K), alpha, x["v"], torch.log(1 - alpha),
                                   initial_state=S0, output_final_state=True)
    _compare(ref, runs, o, {"S": S})


def test_rwkv6_matches_naive_recurrent_rwkv6():
    """naive_recurrent_rwkv6: head-first [B, H, T, D], w = log decay, u [H, K], o_t = q_t (S_{t-1}
    + Diag(u) k_t^T v_t) (read before the write); scale = 1."""
    x = _qkv(30)
    alpha = _rand(B, T, H, K, seed=31, lo=0.02, hi=0.5)
    u = _rand(H, K, seed=32)
    S0 = _rand(B, H, K, V, seed=33)
    ref, runs = _ours("rwkv6", {**x, "alpha": alpha}, {"S": S0}, params={"u": u})
    rw = fla_naive("rwkv6", "recurrent_naive.py")
    hf = lambda t: t.transpose(1, 2).contiguous()  # noqa: E731
    o, S = rw.naive_recurrent_rwkv6(hf(x["q"]), hf(x["k"]), hf(x["v"]), hf(torch.log(1 - alpha)), u, scale=1.0,
                                    initial_state=S0, output_final_state=True)
    _compare(ref, runs, o.transpose(1, 2), {"S": S})


def test_retention_matches_naive_retention_with_the_papers_decays():
    """naive_retention: head-first, zero initial state, fixed gamma_h = 1 - 2^(-5-h), q scaled
    by K^-1/2 inside: the spec's per-head lam is set to logit(gamma_h), q fed * sqrt(K)."""
    x = _qkv(40)
    gamma = 1 - 2.0 ** (-5.0 - torch.arange(H, dtype=torch.float32))
    lam = torch.log(gamma / (1 - gamma))
    ref, runs = _ours("retention", x, params={"lam": lam})
    ret = fla_naive("retention")
    hf = lambda t: t.transpose(1, 2).contiguous()  # noqa: E731
    o = ret.naive_retention(hf(x["q"]) * math.sqrt(K), hf(x["k"]), hf(x["v"]))
    _compare(ref, runs, o.transpose(1, 2), {})


def test_mamba2_matches_naive_recurrent_simple_gla():
    """SSD as simple GLA: naive_recurrent_simple_gla ([B, T, H, D], g = log decay [B, T, H],
    scale = 1) with g = -dt exp(A_log), v = dt x; the skip D x is added to its output."""
    x = _qkv(50)
    eta = _rand(B, T, H, seed=51, lo=0.05, hi=1.5)
    A_log = _rand(H, seed=52)
    D = _rand(H, seed=53)
    S0 = _rand(B, H, K, V, seed=54)
    ref, runs = _ours("mamba2", {**x, "eta": eta}, {"S": S0}, params={"A_log": A_log, "D": D})
    sg = fla_naive("simple_gla")
    o, S = sg.naive_recurrent_simple_gla(x["q"], x["k"], x["v"] * eta[..., None], -eta * torch.exp(A_log),
                                         scale=1.0, initial_state=S0, output_final_state=True)
    _compare(ref, runs, o + D[:, None] * x["v"], {"S": S})


def test_kda_matches_naive_recurrent_kda():
    """naive_recurrent_kda: [B, T, H, D], g = log decay per key channel, beta [B, T, H],
    scale = 1; decay first, then the delta step at the decayed state; l2-normalised q, k fed."""
    x = _qkv(60)
    eta = _rand(B, T, H, seed=61, lo=0.05, hi=0.9)
    alpha = _rand(B, T, H, K, seed=62, lo=0.02, hi=0.4)
    W0 = _rand(B, H, K, V, seed=63)
    ref, runs = _ours("kda", {**x, "eta": eta, "alpha": alpha}, {"W": W0})
    kda = fla_naive("kda")
    o, S = kda.naive_recurrent_kda(_l2n(x["q"]), _l2n(x["k"]), x["v"], torch.log(1 - alpha), eta, scale=1.0,
                                   initial_state=W0, output_final_state=True)
    _compare(ref, runs, o, {"W": S})


def test_gdn2_matches_naive_recurrent_gdn2():
    """naive_recurrent_gdn2: [B, T, H, D], g = log decay [B, T, H, K], erase gate b [B, T, H, K],
    write gate w [B, T, H, V], scale = 1; l2-normalised q, k fed."""
    x = _qkv(70)
    eta_k = _rand(B, T, H, K, seed=71, lo=0.05, hi=0.9)
    eta_v = _rand(B, T, H, V, seed=72, lo=0.05, hi=0.9)
    alpha = _rand(B, T, H, K, seed=73, lo=0.02, hi=0.4)
    S0 = _rand(B, H, K, V, seed=74)
    ref, runs = _ours("gdn2", {**x, "eta_k": eta_k, "eta_v": eta_v, "alpha": alpha}, {"S": S0})
    gdn2 = fla_naive("gdn2")
    o, S = gdn2.naive_recurrent_gdn2(_l2n(x["q"]), _l2n(x["k"]), x["v"], torch.log(1 - alpha), eta_k, eta_v,
                                     scale=1.0, initial_state=S0, output_final_state=True)
    _compare(ref, runs, o, {"S": S})


def test_comba_matches_naive_recurrent_comba():
    """naive_recurrent_comba (the recurrent reference: error read after the decay): [B, T, H, D],
    g = log decay [B, T, H], scale = 1; l2-normalised q, k, p fed."""
    x = _qkv(80)
    p = _rand(B, T, H, K, seed=81)
    eta = _rand(B, T, H, seed=82, lo=0.05, hi=0.9)
    alpha = _rand(B, T, H, seed=83, lo=0.02, hi=0.4)
    S0 = _rand(B, H, K, V, seed=84)
    ref, runs = _ours("comba", {**x, "p": p, "eta": eta, "alpha": alpha}, {"S": S0})
    comba = fla_naive("comba")
    o, S = comba.naive_recurrent_comba(_l2n(x["q"]), _l2n(x["k"]), x["v"], _l2n(p), eta, torch.log(1 - alpha),
                                       scale=1.0, initial_state=S0, output_final_state=True)
    _compare(ref, runs, o, {"S": S})


def test_rwkv7_matches_dplr_recurrence():
    """dplr_recurrence: head-first, S_t = Diag(exp(gk)) S + k^T v + beta (alpha S) (both terms at
    S_{t-1}), q scaled by K^-1/2 inside: alpha = kh, beta = -eta * kh, gk = log(1 - alpha), q fed
    * sqrt(K); kh = l2norm(k * xi)."""
    x = _qkv(90)
    eta = _rand(B, T, H, K, seed=91, lo=0.05, hi=0.9)
    alpha = _rand(B, T, H, K, seed=92, lo=0.02, hi=0.4)
    xi = 1 + 0.3 * _rand(H, K, seed=93)
    S0 = _rand(B, H, K, V, seed=94)
    ref, runs = _ours("rwkv7", {**x, "eta": eta, "alpha": alpha}, {"S": S0}, params={"xi": xi})
    dplr = fla_naive("generalized_delta_rule/dplr")
    kh = _l2n(x["k"] * xi)
    hf = lambda t: t.transpose(1, 2).contiguous()  # noqa: E731
    o, S = dplr.dplr_recurrence(hf(x["q"]) * math.sqrt(K), hf(x["k"]), hf(x["v"]), hf(kh), hf(-eta * kh),
                                hf(torch.log(1 - alpha)), initial_state=S0.clone())
    _compare(ref, runs, o.transpose(1, 2), {"S": S})


def test_gated_deltaproduct_matches_naive_recurrent_gated_delta_product():
    """naive_recurrent_gated_delta_product with num_householder = 2: keys, values and betas
    interleaved per token ([B, 2T, H, D], step j of token i at 2i + j), g = log decay [B, T, H]
    applied once before the steps, scale = 1; l2-normalised q, k1, k2 fed."""
    q = _rand(B, T, H, K, seed=100)
    ks = [_rand(B, T, H, K, seed=101 + j) for j in range(2)]
    vs = [_rand(B, T, H, V, seed=103 + j) for j in range(2)]
    etas = [_rand(B, T, H, seed=105 + j, lo=0.05, hi=0.9) for j in range(2)]
    alpha = _rand(B, T, H, seed=107, lo=0.02, hi=0.4)
    S0 = _rand(B, H, K, V, seed=108)
    ins = {"q": q, "k1": ks[0], "v1": vs[0], "k2": ks[1], "v2": vs[1], "eta1": etas[0], "eta2": etas[1],
           "alpha": alpha}
    ref, runs = _ours("gated_deltaproduct", ins, {"S": S0})
    gdp = fla_naive("gated_delta_product")
    inter = lambda a, b: torch.stack([a, b], dim=2).flatten(1, 2)  # noqa: E731  [B, 2T, H, ...]
    o, S = gdp.naive_recurrent_gated_delta_product(
        _l2n(q), inter(_l2n(ks[0]), _l2n(ks[1])), inter(vs[0], vs[1]), torch.log(1 - alpha),
        inter(etas[0], etas[1]), scale=1.0, initial_state=S0.clone(), output_final_state=True, num_householder=2)
    _compare(ref, runs, o, {"S": S})


def test_momentum_deltanet_matches_recurrent_momentum_delta_rule_ref():
    """recurrent_momentum_delta_rule_ref: M = mu M + eta k (p S - v)^T, S = alpha S - beta M
    ([B, T, H, D], log_alpha and log_mu log decays, scale = 1).  The spec's U = mu U - eta grad,
    W = (1 - alpha) W + U is it with p = k = l2norm(k), beta = 1, M = -U, log_alpha =
    log(1 - alpha)."""
    x = _qkv(110)
    eta = _rand(B, T, H, seed=111, lo=0.05, hi=0.9)
    mu = _rand(B, T, H, seed=112, lo=0.1, hi=0.9)
    alpha = _rand(B, T, H, seed=113, lo=0.02, hi=0.4)
    W0, U0 = _rand(B, H, K, V, seed=114), _rand(B, H, K, V, seed=115)
    ref, runs = _ours("momentum_deltanet", {**x, "eta": eta, "mu": mu, "alpha": alpha}, {"W": W0, "U": U0})
    mom = fla_naive("momentum_delta_rule")
    kn = _l2n(x["k"])
    o, st = mom.recurrent_momentum_delta_rule_ref(
        _l2n(x["q"]), kn, x["v"], torch.log(1 - alpha), torch.log(mu), kn, beta=torch.ones_like(eta), eta=eta,
        scale=1.0, initial_S=W0, initial_M=-U0, output_final_state=True)
    _compare(ref, runs, o, {"W": st[0], "U": -st[1]})


def test_deltanet_textbook_matches_delta_rule_recurrence():
    """delta_rule_recurrence: head-first, q scaled by K^-1/2 inside (fed q * sqrt(K)); the
    l2-normalised keys and queries fed."""
    x = _qkv(120)
    eta = _rand(B, T, H, seed=121, lo=0.05, hi=0.9)
    W0 = _rand(B, H, K, V, seed=122)
    ref, runs = _ours("deltanet_textbook", {**x, "eta": eta}, {"W": W0})
    dr = fla_naive("delta_rule")
    hf = lambda t: t.transpose(1, 2).contiguous()  # noqa: E731
    o, S = dr.delta_rule_recurrence(hf(_l2n(x["q"])) * math.sqrt(K), hf(_l2n(x["k"])), hf(x["v"]), hf(eta),
                                    initial_state=W0.clone())
    _compare(ref, runs, o.transpose(1, 2), {"W": S})
