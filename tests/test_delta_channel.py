"""The gated delta rule with a step size per value channel (``specs/gated_deltanet_channel``):
``W <- gamma W - gamma k kᵀ W Diag(beta) + k (beta ⊙ v)ᵀ`` is d_v scalar-beta delta rules side by
side, one per column of W.  The delta family admits it (beta a vector over the value channels),
and its exact chunked kernel (one unit-lower-triangular inverse per value channel and chunk) is
checked here against a token loop written in this file, the reference interpreter, the module's
online schedule and Gated DeltaNet itself (beta equal across the channels)."""
from __future__ import annotations

import textwrap

import pytest
import torch

import memspec
from memspec.reference import run as reference_run_packed
from memspec.runtime.delta import chunk_delta
from memspec.runtime.varlen import _Documents
from memspec.schedule import analyse, explain

from _compiled_harness import call, initial_state, inputs, load, make, ref_params, reference_run, small_dims
from close import assert_same_function

PATH = "specs/gated_deltanet_channel.yaml"
F64 = torch.float64


def loop(q, k, v, beta, log_gamma, S0, inclusive=True, log_rho=None):
    """The recurrence column by column, token by token: column j of S runs
    ``s_j <- gamma s_j + k beta_j (v_j - rho k . s_j)`` (rho = gamma unless given)."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    S = S0.clone()
    outs = []
    for t in range(T):
        g = torch.exp(log_gamma[:, t]) if log_gamma is not None else torch.ones(B, H, dtype=k.dtype)
        rho = torch.exp(log_rho[:, t]) if log_rho is not None else g
        cols = []
        for j in range(V):
            s = S[..., j]                                                    # [B, H, K]
            err = v[:, t, :, j] - rho * (k[:, t] * s).sum(-1)                # [B, H]
            cols.append(g[..., None] * s + k[:, t] * (beta[:, t, :, j] * err)[..., None])
        S_prev, S = S, torch.stack(cols, dim=-1)
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S if inclusive else S_prev))
    return torch.stack(outs, dim=1), S


def kernel_inputs(B=2, T=21, H=2, K=5, V=4, seed=0, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g, dtype=dtype), dim=-1)
    q = torch.randn(B, T, H, K, generator=g, dtype=dtype)
    v = torch.randn(B, T, H, V, generator=g, dtype=dtype)
    beta = torch.rand(B, T, H, V, generator=g, dtype=dtype)
    log_gamma = -0.5 * torch.rand(B, T, H, generator=g, dtype=dtype)
    S0 = torch.randn(B, H, K, V, generator=g, dtype=dtype)
    return q, k, v, beta, log_gamma, S0


# ------------------------------------------------------------------ the kernel
@pytest.mark.parametrize("chunk", [1, 3, 4, 8, 16, 32])
@pytest.mark.parametrize("inclusive", [True, False])
def test_kernel_equals_the_column_loop(chunk, inclusive):
    q, k, v, beta, lg, S0 = kernel_inputs()
    o_ref, S_ref = loop(q, k, v, beta, lg, S0, inclusive=inclusive)
    for group in (None, 1, 2):
        o, S = chunk_delta(q, k, v, beta, lg, S0, chunk, inclusive=inclusive, group=group, per_channel=True)
        assert_same_function(o, o_ref)
        assert_same_function(S, S_ref)


def test_kernel_without_decay_and_with_its_own_error_decay():
    q, k, v, beta, lg, S0 = kernel_inputs(T=13)
    o_ref, S_ref = loop(q, k, v, beta, None, S0)
    o, S = chunk_delta(q, k, v, beta, None, S0, 4, per_channel=True)
    assert_same_function(o, o_ref)
    assert_same_function(S, S_ref)
    lr = lg * 0.5                                     # the error read at a decay of its own
    o_ref, S_ref = loop(q, k, v, beta, lg, S0, log_rho=lr)
    o, S = chunk_delta(q, k, v, beta, lg, S0, 4, log_rho=lr, per_channel=True)
    assert_same_function(o, o_ref)
    assert_same_function(S, S_ref)


def test_kernel_state_only_and_zero_start():
    _, k, v, beta, lg, _ = kernel_inputs(T=10)
    zero = torch.zeros(2, 2, 5, 4, dtype=F64)
    _, S_ref = loop(torch.zeros_like(k), k, v, beta, lg, zero)
    o, S = chunk_delta(None, k, v, beta, lg, None, 4, per_channel=True)
    assert o is None
    assert_same_function(S, S_ref)


def test_kernel_gradients_equal_the_loop():
    ins = [x.requires_grad_(True) for x in kernel_inputs(B=1, T=11, K=4, V=3)]
    q, k, v, beta, lg, S0 = ins
    o, S = chunk_delta(q, k, v, beta, lg, S0, 4, per_channel=True)
    w_o, w_s = torch.randn_like(o), torch.randn_like(S)
    g = torch.autograd.grad((o * w_o).sum() + (S * w_s).sum(), ins)
    o2, S2 = loop(q, k, v, beta, lg, S0)
    g2 = torch.autograd.grad((o2 * w_o).sum() + (S2 * w_s).sum(), ins)
    for a, b in zip(g, g2):
        assert_same_function(a, b)


def test_kernel_gradcheck():
    q, k, v, beta, lg, S0 = kernel_inputs(B=1, T=5, H=1, K=3, V=2)
    args = [x.requires_grad_(True) for x in (q, k, v, beta, lg, S0)]
    assert torch.autograd.gradcheck(
        lambda *a: chunk_delta(a[0], a[1], a[2], a[3], a[4], a[5], 2, per_channel=True), args)


def test_equal_channels_are_the_scalar_kernel():
    q, k, v, beta, lg, S0 = kernel_inputs(T=19)
    b1 = beta[..., :1]
    o, S = chunk_delta(q, k, v, b1.expand_as(beta), lg, S0, 8, per_channel=True)
    o2, S2 = chunk_delta(q, k, v, b1[..., 0], lg, S0, 8)
    assert_same_function(o, o2)
    assert_same_function(S, S2)


def test_kernel_packed_documents_equal_each_alone():
    lengths = [5, 1, 9, 3]
    q, k, v, beta, lg, _ = kernel_inputs(B=1, T=sum(lengths))
    S0 = torch.randn(len(lengths), 2, 5, 4, dtype=F64)
    cu = torch.tensor([0, 5, 6, 15, 18])
    o, S = chunk_delta(q, k, v, beta, lg, S0, 4, documents=_Documents(cu), per_channel=True)
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        o_i, S_i = loop(q[:, a:b], k[:, a:b], v[:, a:b], beta[:, a:b], lg[:, a:b], S0[i:i + 1])
        assert_same_function(o[:, a:b], o_i)
        assert_same_function(S[i:i + 1], S_i)


def test_kernel_non_finite_beta_poisons_only_what_follows():
    q, k, v, beta, lg, S0 = kernel_inputs(B=1, T=12)
    bad = beta.clone()
    bad[0, 6, 1, 2] = float("nan")
    o, S = chunk_delta(q, k, v, bad, lg, S0, 4, per_channel=True)
    o_ref, _ = loop(q, k, v, beta, lg, S0)
    assert_same_function(o[:, :6], o_ref[:, :6])
    assert torch.isnan(o[0, 6:, 1]).all() and torch.isfinite(o[0, :, 0]).all()
    assert torch.isnan(S[0, 1]).all() and torch.isfinite(S[0, 0]).all()


# ------------------------------------------------------------------ the analysis
def test_explain_states_the_family_and_the_channel_step():
    spec = load(PATH)
    d = analyse(spec)
    assert d.family == "delta" and d.plans["delta"].per_channel and d.chunks["delta"] == 8
    text = explain(spec)
    assert text.splitlines()[0].startswith("gated_deltanet_channel: delta (exact chunked form")
    assert "beta is per value channel (Diag(eta) on the value side of the rank-one term, beta = eta)" in text
    assert "d_v delta rules side by side" in text
    assert not analyse(load("specs/gated_deltanet.yaml")).plans["delta"].per_channel


HEAD = """
memory m
dims { heads = 2, d_k = 4, d_v = 3 }
view q : d_k
view k : d_k
view v : d_v
gate eta : [d_v] = sigmoid(logit)
gate alpha = sigmoid(logit) bias -2.0
state W : [d_k, d_v] = zeros
"""


@pytest.mark.parametrize("update", [
    "W = (1 - alpha) * W\n  W = W + outer(k, eta * (v - k @ W))",              # the error written out
    "W = (1 - alpha) * W\n  W = W - outer(k, (k @ W - v) * eta)",
    "W = (1 - alpha) * (W + outer(k, eta * (v - k @ W)))",                      # the decay after the write
])
def test_written_other_ways_gets_the_channel_delta_rule(update):
    spec = memspec.loads(textwrap.dedent(HEAD) + f"update {{\n  {update}\n}}\nread = q @ W\n", "mem")
    d = analyse(spec)
    assert d.family == "delta" and d.plans["delta"].per_channel
    dims = {"heads": 2, "d_k": 4, "d_v": 3}
    m = make(spec, dims, chunk=3)
    ins = inputs(spec, m, T=8)
    st = initial_state(spec, m)
    o, s = call(m, spec, ins, dict(st), schedule="delta")
    o2, s2 = reference_run(spec, m, dims, "online", st, ins)
    assert_same_function(o, o2)
    assert_same_function(s["W"], s2["W"])


def test_a_scalar_gate_times_a_channel_param_is_the_step():
    spec = memspec.loads(textwrap.dedent(HEAD).replace("gate eta : [d_v]", "gate eta") + "param lr : [d_v] = ones\n"
                         "update {\n  W = (1 - alpha) * W\n  W = W + outer(k, eta * lr * (v - k @ W))\n}\n"
                         "read = q @ W\n", "mem")
    d = analyse(spec)
    assert d.family == "delta" and d.plans["delta"].per_channel
    dims = {"heads": 2, "d_k": 4, "d_v": 3}
    m = make(spec, dims, chunk=3)
    ins = inputs(spec, m, T=8)
    st = initial_state(spec, m)
    o, s = call(m, spec, ins, dict(st), schedule="delta")
    o2, s2 = reference_run(spec, m, dims, "online", st, ins)
    assert_same_function(o, o2)
    assert_same_function(s["W"], s2["W"])


def test_a_decay_per_value_channel_is_not_delta():
    spec = memspec.loads(textwrap.dedent(HEAD) + "update {\n  W = W * eta\n  W = W + outer(k, eta * (v - k @ W))\n}\n"
                         "read = q @ W\n", "mem")
    d = analyse(spec)
    assert d.family != "delta"
    assert "acts on its columns (W Diag(eta))" in dict(d.rejected)["delta"]


def test_a_write_without_the_channel_step_is_not_delta():
    spec = memspec.loads(textwrap.dedent(HEAD) + "update {\n  W = W - outer(k, eta * (k @ W)) + outer(k, v)\n}\n"
                         "read = q @ W\n", "mem")
    d = analyse(spec)
    assert d.family != "delta"
    assert "does not share" in dict(d.rejected)["delta"]


# ------------------------------------------------------------------ the compiled module
def setup(T=11, B=2, chunk=4, seed=1, requires_grad=False):
    spec = load(PATH)
    dims = small_dims(spec)
    m = make(spec, dims, chunk=chunk)
    ins = inputs(spec, m, B=B, T=T, seed=seed, requires_grad=requires_grad)
    st = initial_state(spec, m, B=B, seed=seed + 1)
    return spec, dims, m, ins, st


def test_compiled_chunked_equals_reference_and_online():
    spec, dims, m, ins, st = setup()
    assert m.SCHEDULES[0] == "delta"
    o, s = call(m, spec, ins, dict(st), schedule="delta")
    o_ref, s_ref = reference_run(spec, m, dims, "online", st, ins)
    assert_same_function(o, o_ref)
    assert_same_function(s["W"], s_ref["W"])
    o_on, s_on = call(m, spec, ins, dict(st), schedule="online")
    assert_same_function(o, o_on)
    assert_same_function(s["W"], s_on["W"])


def test_compiled_gradients_equal_reference():
    spec, dims, m, ins, st = setup(T=9, requires_grad=True)
    st = {n: t.detach().clone().requires_grad_(True) for n, t in st.items()}
    leaves = list(ins.values()) + list(st.values())
    o, s = call(m, spec, ins, dict(st), schedule="delta")
    w_o, w_s = torch.randn_like(o), torch.randn_like(s["W"])
    g = torch.autograd.grad((o * w_o).sum() + (s["W"] * w_s).sum(), leaves)
    o2, s2 = reference_run(spec, m, dims, "online", st, ins)
    g2 = torch.autograd.grad((o2 * w_o).sum() + (s2["W"] * w_s).sum(), leaves)
    for a, b in zip(g, g2):
        assert_same_function(a, b)
    o3, s3 = call(m, spec, ins, dict(st), schedule="online")
    g3 = torch.autograd.grad((o3 * w_o).sum() + (s3["W"] * w_s).sum(), leaves)
    for a, b in zip(g, g3):
        assert_same_function(a, b)


def test_compiled_gradcheck_tiny():
    spec = load(PATH)
    dims = {"d_model": 4, "heads": 1, "d_k": 2, "d_v": 3}
    m = make(spec, dims, chunk=2)
    ins = inputs(spec, m, B=1, T=5, requires_grad=True)
    names = list(ins)
    assert torch.autograd.gradcheck(
        lambda *xs: call(m, spec, dict(zip(names, xs)), schedule="delta")[0], [ins[n] for n in names])


def test_causal():
    spec, dims, m, ins, st = setup(T=12)
    o, _ = call(m, spec, ins, dict(st), schedule="delta")
    for t in (0, 5, 11):
        moved = {n: x.clone() for n, x in ins.items()}
        for x in moved.values():
            x[:, t] += 0.7
        o2, _ = call(m, spec, moved, dict(st), schedule="delta")
        assert torch.equal(o2[:, :t], o[:, :t])
        assert not torch.equal(o2[:, t], o[:, t])


def test_streaming_two_calls_are_one():
    spec, dims, m, ins, st = setup(T=13)
    o, s = call(m, spec, ins, dict(st), schedule="delta")
    first = {n: x[:, :6] for n, x in ins.items()}
    rest = {n: x[:, 6:] for n, x in ins.items()}
    o1, s1 = call(m, spec, first, dict(st), schedule="delta")
    o2, s2 = call(m, spec, rest, s1, schedule="delta")
    assert_same_function(torch.cat([o1, o2], dim=1), o)
    assert_same_function(s2["W"], s["W"])


def test_packed_cu_seqlens_equal_each_document_alone():
    lengths = [1, 3, 4, 6, 9, 2]
    spec, dims, m, ins, st = setup(T=sum(lengths), B=len(lengths))
    ins = {n: x[:1] for n, x in ins.items()}
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    o, s = m(*[ins[v] for v in spec.views], **{g: ins[g] for g in spec.gates}, state=dict(st),
             schedule="delta", cu_seqlens=cu)
    o_ref, s_ref = reference_run_packed(spec, state=dict(st), dims=dims, params=ref_params(spec, m), cu_seqlens=cu,
                                        **ins)
    assert_same_function(o, o_ref)
    assert_same_function(s["W"], s_ref["W"])
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        piece = {n: x[:, a:b] for n, x in ins.items()}
        o_i, s_i = call(m, spec, piece, {n: t[i:i + 1] for n, t in st.items()}, schedule="delta")
        assert_same_function(o[:, a:b], o_i)
        assert_same_function(s["W"][i:i + 1], s_i["W"])


def test_equal_channels_are_gated_deltanet():
    spec, dims, m, ins, st = setup(T=14)
    gspec = load("specs/gated_deltanet.yaml")
    gm = make(gspec, dims, chunk=4)
    eta = ins["eta"][..., :1]
    same = dict(ins, eta=eta.expand_as(ins["eta"]))
    o, s = call(m, spec, same, dict(st), schedule="delta")
    o2, s2 = call(gm, gspec, dict(ins, eta=eta[..., 0]), dict(st), schedule="delta")
    assert_same_function(o, o2)
    assert_same_function(s["W"], s2["W"])


def test_float32_chunked_equals_online():
    spec, dims, m, ins, st = setup(T=40)
    m = m.float()
    ins = {n: x.float() for n, x in ins.items()}
    st = {n: x.float() for n, x in st.items()}
    o, s = call(m, spec, ins, dict(st), schedule="delta")
    o2, s2 = call(m, spec, ins, dict(st), schedule="online")
    assert_same_function(o, o2)
    assert_same_function(s["W"], s2["W"])
