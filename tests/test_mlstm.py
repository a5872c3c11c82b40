"""xLSTM's mLSTM (specs/mlstm.yaml) and the additive kernel's exact log decays.

The mLSTM's input gate is exponential: its chunked schedule passes the preactivation to
``chunk_additive`` as a log input weight and the kernel carries a max stabiliser, so the
outputs stay finite and exact for preactivations far beyond float32's exp range.  Checked
against the reference interpreter (outputs, states, gradients, float64), gradcheck, causality,
streaming, extreme gates against a float64 token loop written here, and mlstm-kernels' native
PyTorch functions (the optional ``peers`` extra).  The last tests pin the log decays: a decay
of exactly 0 zeroes the past exactly, decays down to exp(-40) per token match the online
schedule.
"""
from __future__ import annotations

import pytest
import torch

import memspec
import memspec.lang.fmt
from memspec.runtime.additive import chunk_additive, recurrent_additive
from _compiled_harness import ROOT, call, make, reference_run
from close import assert_same_function

SPEC = memspec.load(ROOT / "specs" / "mlstm.yaml")
DIMS = {"d_model": 8, "heads": 2, "d_k": 4, "d_v": 5}


def _inputs(B=2, T=11, H=2, K=4, V=5, dtype=torch.float64, seed=1, ig_scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return {"q": torch.randn(B, T, H, K, generator=g, dtype=dtype),
            "k": torch.randn(B, T, H, K, generator=g, dtype=dtype),
            "v": torch.randn(B, T, H, V, generator=g, dtype=dtype),
            "ig": ig_scale * torch.randn(B, T, H, generator=g, dtype=dtype),
            "fg": 2.0 + 2.0 * torch.randn(B, T, H, generator=g, dtype=dtype)}


def _state(B=2, H=2, K=4, V=5, dtype=torch.float64, seed=2):
    g = torch.Generator().manual_seed(seed)
    return {"C": 0.3 * torch.randn(B, H, K, V, generator=g, dtype=dtype),
            "n": 0.3 * torch.randn(B, H, K, generator=g, dtype=dtype)}


def token_loop(q, k, v, ig, fg, C, n):
    """The paper's mLSTM, unstabilised, token by token in float64: C <- f C + i k v^T / sqrt(d),
    n <- f n + i k / sqrt(d), h = (q C) / max(|q n|, 1), i = exp(ig), f = sigmoid(fg)."""
    q, k, v, ig, fg, C, n = (x.double() for x in (q, k, v, ig, fg, C, n))
    scale = k.shape[-1] ** -0.5
    outs = []
    for t in range(q.shape[1]):
        f, i = torch.sigmoid(fg[:, t])[..., None], torch.exp(ig[:, t])[..., None]   # [B, H, 1]
        C = f[..., None] * C + (i * scale * k[:, t])[..., :, None] * v[:, t][..., None, :]
        n = f * n + i * scale * k[:, t]
        num = torch.einsum("bhk,bhkv->bhv", q[:, t], C)
        den = torch.einsum("bhk,bhk->bh", q[:, t], n).abs().clamp_min(1.0)
        outs.append(num / den[..., None])
    return torch.stack(outs, 1), {"C": C, "n": n}


def test_explain_picks_the_stabilised_chunked_form():
    from memspec.schedule import analyse
    d = analyse(SPEC)
    assert d.family == "additive" and d.exact
    text = " ".join(d.reasons)
    assert "exponential input weight exp(ig)" in text and "max stabiliser" in text


def test_explain_notes_an_exponential_gate_formula():
    """``gate ig = exp(logit)`` is computed in the layer, before the memory: explain says that it
    overflows float32 and how to write it so that the kernel stabilises it."""
    from memspec.schedule import analyse
    text = memspec.lang.fmt.to_mem(SPEC).replace("gate ig = logit", "gate ig = exp(logit)")
    text = text.replace("exp(ig) / sqrt(d_k)", "ig / sqrt(d_k)")
    reasons = " ".join(analyse(memspec.loads(text, "mem")).reasons)
    assert "the gate ig = exp(logit) in the increment of C is computed before the memory" in reasons
    assert "max stabiliser" not in reasons


@pytest.mark.parametrize("chunk", [1, 3, 4, 64])
@pytest.mark.parametrize("schedule", ["additive", "online"])
def test_compiled_equals_reference(schedule, chunk):
    m = make(SPEC, DIMS, chunk=chunk)
    ins, st = _inputs(), _state()
    o_ref, s_ref = reference_run(SPEC, m, DIMS, "online", st, ins)
    o, s = call(m, SPEC, ins, state=st, schedule=schedule)
    assert_same_function(o, o_ref)
    for name in ("C", "n"):
        assert_same_function(s[name], s_ref[name])
    o_loop, s_loop = token_loop(*(ins[x] for x in ("q", "k", "v", "ig", "fg")), st["C"], st["n"])
    assert_same_function(o, o_loop)
    assert_same_function(s["C"], s_loop["C"])


@pytest.mark.parametrize("schedule", ["additive", "online"])
def test_gradients_equal_reference(schedule):
    m = make(SPEC, DIMS, chunk=4)
    ins, st = _inputs(T=9), _state()
    w = torch.randn(2, 9, 2, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(5))

    def grads(fn):
        xs = {n: x.clone().requires_grad_(True) for n, x in {**ins, **st}.items()}
        o, s = fn({n: xs[n] for n in ins}, {n: xs[n] for n in st})
        ((o * w).sum() + s["C"].sum() + s["n"].pow(2).sum()).backward()
        return {n: x.grad for n, x in xs.items()}

    got = grads(lambda i, s: call(m, SPEC, i, state=s, schedule=schedule))
    want = grads(lambda i, s: reference_run(SPEC, m, DIMS, "online", s, i))
    for n in want:
        assert_same_function(got[n], want[n], msg=n)


def test_gradcheck_chunked():
    m = make(SPEC, {**DIMS, "d_k": 3, "d_v": 2}, chunk=3)
    ins, st = _inputs(B=1, T=7, K=3, V=2, ig_scale=2.0), _state(B=1, K=3, V=2)
    names = list(ins) + list(st)

    def fn(*xs):
        i = dict(zip(names, xs))
        o, s = call(m, SPEC, {n: i[n] for n in ins}, state={n: i[n] for n in st}, schedule="additive")
        return o, s["C"], s["n"]

    xs = tuple(x.clone().requires_grad_(True) for x in (*ins.values(), *st.values()))
    assert torch.autograd.gradcheck(fn, xs, eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("schedule", ["additive", "online"])
def test_causal(schedule):
    m = make(SPEC, DIMS, chunk=4)
    ins, st = _inputs(T=12), _state()
    o, _ = call(m, SPEC, ins, state=st, schedule=schedule)
    later = {n: x.clone() for n, x in ins.items()}
    for n in later:
        later[n][:, 6:] = torch.randn_like(later[n][:, 6:]) * 50
    later["v"][0, 8, 0, 0] = float("nan")
    later["ig"][1, 7, 1] = 300.0
    o2, _ = call(m, SPEC, later, state=st, schedule=schedule)
    assert torch.equal(o[:, :6], o2[:, :6])


@pytest.mark.parametrize("schedule", ["additive", "online"])
def test_streaming_two_calls_equal_one(schedule):
    m = make(SPEC, DIMS, chunk=4)
    ins, st = _inputs(T=13), _state()
    o, s = call(m, SPEC, ins, state=st, schedule=schedule)
    o1, s1 = call(m, SPEC, {n: x[:, :6] for n, x in ins.items()}, state=st, schedule=schedule)
    o2, s2 = call(m, SPEC, {n: x[:, 6:] for n, x in ins.items()}, state=s1, schedule=schedule)
    assert_same_function(torch.cat([o1, o2], 1), o)
    for name in s:
        assert_same_function(s2[name], s[name])


def _extreme(dtype):
    ins = _inputs(T=40, dtype=dtype, seed=3, ig_scale=60.0)
    ins["ig"][0, 3, 0], ins["ig"][1, 17, 1], ins["ig"][0, 30, 1] = 200.0, -200.0, 180.0
    ins["ig"][1, 20:26, 0] = -200.0
    ins["fg"][0, 10, 0], ins["fg"][1, 5, 1], ins["fg"][0, 31, 1] = -200.0, 200.0, -40.0
    return ins


def test_extreme_gates_float64_schedules_agree():
    """Preactivations of +-200: exp(200) is finite in float64, so the stabilised online step,
    the stabilised chunked form and the unstabilised token loop all compute the same function."""
    m = make(SPEC, DIMS, chunk=8)
    ins = _extreme(torch.float64)
    want, s_want = token_loop(*(ins[x] for x in ("q", "k", "v", "ig", "fg")),
                              torch.zeros(2, 2, 4, 5, dtype=torch.float64), torch.zeros(2, 2, 4, dtype=torch.float64))
    for schedule in ("additive", "online"):
        o, s = call(m, SPEC, ins, schedule=schedule)
        assert torch.isfinite(o).all()
        assert_same_function(o, want, msg=schedule)
        torch.testing.assert_close(s["C"], s_want["C"], rtol=1e-12, atol=0.0, msg=schedule)


@pytest.mark.parametrize("chunk", [4, 16, 64])
def test_extreme_gates_float32_chunked_finite_and_exact(chunk):
    """In float32 exp(200) overflows: the chunked form keeps the input gate in log space and
    carries the stabiliser, so its outputs are finite and equal the float64 loop."""
    m = make(SPEC, DIMS, chunk=chunk, dtype=torch.float32)
    ins = _extreme(torch.float64)
    want, _ = token_loop(*(ins[x] for x in ("q", "k", "v", "ig", "fg")),
                         torch.zeros(2, 2, 4, 5, dtype=torch.float64), torch.zeros(2, 2, 4, dtype=torch.float64))
    o, _ = call(m, SPEC, {n: x.float() for n, x in ins.items()}, schedule="additive")
    assert torch.isfinite(o).all()
    torch.testing.assert_close(o.double(), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("scale", [200.0, 300.0])
def test_extreme_gates_float32_online_finite_and_exact(scale):
    """The online step carries the states as exp(-m) times their value with the max stabiliser m:
    in float32 its outputs and gradients at preactivations of +-200 and +-300 are finite and equal
    the float64 loop's (the unstabilised step gives NaN once exp(ig) overflows)."""
    m = make(SPEC, DIMS, chunk=8, dtype=torch.float32)
    ins = _extreme(torch.float64)
    ins["ig"] = ins["ig"] * (scale / 200.0)
    ins = {n: x.float().requires_grad_(True) for n, x in ins.items()}
    o, _ = call(m, SPEC, ins, schedule="online")
    ref = {n: x.detach().double().requires_grad_(True) for n, x in ins.items()}
    zeros = torch.zeros(2, 2, 4, 5, dtype=torch.float64), torch.zeros(2, 2, 4, dtype=torch.float64)
    want, _ = token_loop(*(ref[x] for x in ("q", "k", "v", "ig", "fg")), *zeros)
    assert torch.isfinite(o).all()
    torch.testing.assert_close(o.double(), want, rtol=1e-4, atol=1e-5)
    o.sum().backward()
    want.sum().backward()
    for n in ins:
        assert torch.isfinite(ins[n].grad).all(), n
        assert float((ins[n].grad.double() - ref[n].grad).norm() / ref[n].grad.norm()) < 1e-4, n


def test_online_state_goes_out_at_its_true_scale():
    """The stabiliser lives inside a call: the state that goes out is exp(m) times the carried one,
    so streaming in pieces through the online schedule gives the one-call numbers (float64)."""
    m = make(SPEC, DIMS, chunk=8)
    ins, s0 = _inputs(T=13, ig_scale=6.0), _state()
    whole, s_whole = call(m, SPEC, ins, state=s0, schedule="online")
    first, s_mid = call(m, SPEC, {n: x[:, :6] for n, x in ins.items()}, state=s0, schedule="online")
    second, s_end = call(m, SPEC, {n: x[:, 6:] for n, x in ins.items()}, state=s_mid, schedule="online")
    assert_same_function(torch.cat([first, second], 1), whole)
    for n in ("C", "n"):
        assert_same_function(s_end[n], s_whole[n], msg=n)
    want, s_want = token_loop(*(ins[x] for x in ("q", "k", "v", "ig", "fg")), s0["C"], s0["n"])
    assert_same_function(whole, want)
    assert_same_function(s_whole["C"], s_want["C"])


def test_compile_keeps_the_stabilised_kernel_in_one_call():
    """compile=True runs other chunked forwards in compiled slices that pass the state at its true
    scale; the stabilised kernel stays one eager call, so extreme gates stay finite past a slice."""
    from memspec.pipeline.build import build_memory
    ins = {n: x.float() for n, x in _inputs(B=1, T=300, dtype=torch.float32, seed=6, ig_scale=50.0).items()}
    outs = [build_memory(ROOT / "specs" / "mlstm.yaml", compile=c, chunk=16, heads=2, d_k=4, d_v=5)(
        ins["q"], ins["k"], ins["v"], ig=ins["ig"], fg=ins["fg"])[0] for c in (True, False)]
    assert torch.isfinite(outs[0]).all()
    assert_same_function(outs[0], outs[1])


def test_extreme_gates_float32_gradients_finite_and_exact():
    """The stabilisers are constants to autograd: the float32 gradients at gates of +-200 are
    finite and equal the float64 loop's."""
    m = make(SPEC, DIMS, chunk=8, dtype=torch.float32)
    ins = {n: x.float().requires_grad_(True) for n, x in _extreme(torch.float64).items()}
    call(m, SPEC, ins, schedule="additive")[0].sum().backward()
    ref = {n: x.detach().double().requires_grad_(True) for n, x in ins.items()}
    zeros = torch.zeros(2, 2, 4, 5, dtype=torch.float64), torch.zeros(2, 2, 4, dtype=torch.float64)
    token_loop(*(ref[x] for x in ("q", "k", "v", "ig", "fg")), *zeros)[0].sum().backward()
    for n in ins:
        assert torch.isfinite(ins[n].grad).all(), n
        assert float((ins[n].grad.double() - ref[n].grad).norm() / ref[n].grad.norm()) < 1e-4, n


def test_kernel_log_input_against_token_loop():
    """chunk_additive with log input weights (scaled outputs exp(-m) o, true-scale state) equals
    recurrent_additive, exclusive reads and packed documents included."""
    from memspec.runtime.varlen import _Documents
    g = torch.Generator().manual_seed(4)
    B, T, H, K, V = 1, 29, 2, 3, 4
    q, k = (torch.randn(B, T, H, K, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=g, dtype=torch.float64)
    lg = torch.nn.functional.logsigmoid(3 * torch.randn(B, T, H, generator=g, dtype=torch.float64))
    lg[0, 4, 0], lg[0, 11, 1] = float("-inf"), -40.0
    li = 80 * torch.randn(B, T, H, generator=g, dtype=torch.float64)
    S0 = torch.randn(B, H, K, V, generator=g, dtype=torch.float64)
    for inclusive in (True, False):
        want, S_want = recurrent_additive(q, k, v, lg, S0, inclusive=inclusive, log_input=li)
        for chunk, group in ((4, None), (5, 1), (64, None)):
            o, S, m = chunk_additive(q, k, v, lg, S0, chunk, inclusive=inclusive, group=group, log_input=li)
            assert (o.abs() <= 1e3).all()           # scaled: no exp(li) in the outputs
            torch.testing.assert_close(o * torch.exp(m)[..., None], want, rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(S, S_want, rtol=1e-10, atol=0.0)
    cu = torch.tensor([0, 7, 7, 20, 29])
    S0s = torch.randn(4, H, K, V, generator=g, dtype=torch.float64)
    o, S, m = chunk_additive(q, k, v, lg, S0s, 4, documents=_Documents(cu), log_input=li)
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        want, S_want = recurrent_additive(q[:, a:b], k[:, a:b], v[:, a:b], lg[:, a:b], S0s[i:i + 1],
                                          log_input=li[:, a:b])
        torch.testing.assert_close(o[:, a:b] * torch.exp(m[:, a:b])[..., None], want, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(S[i:i + 1], S_want, rtol=1e-10, atol=0.0)


TWO_SCALES = """
memory two_scales
dims { d_model = 8, heads = 2, d_k = 4, d_v = 5 }
view q : d_k
view k : d_k
view u : d_k
view v : d_v
gate ig = logit
gate jg = logit
gate fg = logit
state C : [d_k, d_v] = zeros
state n : [d_k] = zeros
update {
  C = sigmoid(fg) * C + exp(ig) * outer(k, v)
  n = n + exp(jg) * u
}
read = q @ C / max(abs(q @ n), 1) + 0.5 * (q @ C)
"""


def test_two_stabilised_calls_share_one_scale():
    """Two kernel calls (different keys and input gates) carry two stabilisers: the probes are
    brought to their maximum, and a read of degree 1 in the probes (the + 0.5 q C term) gets its
    factor exp(m) once, at the end."""
    spec = memspec.loads(TWO_SCALES, "mem")
    dims = {"d_model": 8, "heads": 2, "d_k": 4, "d_v": 5}
    m = make(spec, dims, chunk=4)
    g = torch.Generator().manual_seed(0)
    ins = {n: torch.randn(2, 13, 2, 5 if n == "v" else 4, generator=g, dtype=torch.float64) for n in "qkuv"}
    ins.update({n: 3 * torch.randn(2, 13, 2, generator=g, dtype=torch.float64) for n in ("ig", "jg", "fg")})
    st = {"C": torch.randn(2, 2, 4, 5, generator=g, dtype=torch.float64),
          "n": torch.randn(2, 2, 4, generator=g, dtype=torch.float64)}
    o_ref, s_ref = reference_run(spec, m, dims, "online", st, ins)
    o, s = call(m, spec, ins, state=st, schedule="additive")
    assert_same_function(o, o_ref)
    for name in s:
        assert_same_function(s[name], s_ref[name])


# ---- exact log decays (no floor at 1e-30): a decay of 0 and decays of exp(-40) per token

GATED_HEAD = """
memory gated_head
dims { d_model = 8, heads = 2, d_k = 4, d_v = 5 }
view q : d_k
view k : d_k
view v : d_v
gate f = sigmoid(logit)
state S : [d_k, d_v] = zeros
update {
  S = f * S + outer(k, v)
}
read = q @ S
"""


@pytest.mark.parametrize("spec_name", ["gla", "gated_head", "mlstm"])
def test_zero_and_tiny_decays_match_online(spec_name):
    """A huge state (1e30) behind a decay of exactly 0 must vanish exactly (a floor of 1e-30 on
    the decay left 1e0 of it), and decays of exp(-40) per token equal the online step's."""
    spec = memspec.loads(GATED_HEAD, "mem") if spec_name == "gated_head" else memspec.load(
        ROOT / "specs" / f"{spec_name}.yaml")
    m = make(spec, DIMS, chunk=4)
    g = torch.Generator().manual_seed(7)
    B, T, H = 2, 14, 2
    ins = {n: 0.5 * torch.randn(B, T, H, getattr(m, view.dim), generator=g, dtype=torch.float64)
           for n, view in spec.views.items()}
    st = {n: 1e30 * torch.randn(B, H, *(getattr(m, d) for d in decl.shape), generator=g, dtype=torch.float64)
          for n, decl in spec.state.items()}
    if spec_name == "gla":            # decay 1 - alpha per key channel: 0, and exp(-40)
        alpha = 0.1 + 0.3 * torch.rand(B, T, H, m.d_k, generator=g, dtype=torch.float64)
        alpha[0, 2], alpha[1, 5, 1] = 1.0, 1.0
        ins["alpha"] = alpha
    elif spec_name == "gated_head":   # the decay is the gate's value: 0, and exp(-40) for 3 tokens
        f = 0.5 + 0.4 * torch.rand(B, T, H, generator=g, dtype=torch.float64)
        f[0, 2], f[1, 5, 1], f[1, 1:4, 0] = 0.0, 0.0, torch.exp(torch.tensor(-40.0, dtype=torch.float64))
        ins["f"] = f
    else:                             # log sigmoid(fg): -inf, and -40
        ins["ig"] = torch.randn(B, T, H, generator=g, dtype=torch.float64)
        fg = 2.0 + torch.randn(B, T, H, generator=g, dtype=torch.float64)
        fg[0, 2], fg[1, 5, 1], fg[1, 1:4, 0] = float("-inf"), float("-inf"), -40.0
        ins["fg"] = fg
    o_on, s_on = call(m, spec, ins, state=st, schedule="online")
    o, s = call(m, spec, ins, state=st, schedule=m.DEFAULT_SCHEDULE)
    rows = [(0, slice(2, None), slice(None)), (1, slice(5, None), 1)]   # after the decays of 0
    for b, t, h in rows:
        assert torch.isfinite(o_on[b, t, h]).all()
        assert o_on[b, t, h].abs().max() < 1e3            # the 1e30 state is gone exactly
        assert_same_function(o[b, t, h], o_on[b, t, h])
    for name in s:
        torch.testing.assert_close(s[name], s_on[name], rtol=1e-12, atol=0.0)
    assert_same_function(o[1, :, 0] / 1e30, o_on[1, :, 0] / 1e30)


# ---- the peer: mlstm-kernels' native PyTorch functions (optional extra `peers`)

def _peer_inputs(B=1, H=2, T=64, K=8, V=6, seed=9, ig_scale=4.0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, K, generator=g) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=g)
    ig = ig_scale * torch.randn(B, T, H, generator=g)
    fg = 3.0 + 2.0 * torch.randn(B, T, H, generator=g)
    return q, k, v, ig, fg


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("ig_scale", [4.0, 60.0])
def test_against_mlstm_kernels(ig_scale):
    """mlstm-kernels 2.0.6 scales q (not k) by 1/sqrt(d): the same outputs; its states are the
    stabilised exp(-m) C sqrt(d), exp(-m) n sqrt(d) and m.  eps = 0: its default adds 1e-6 to the
    denominator, a different function."""
    pytest.importorskip("mlstm_kernels")
    from mlstm_kernels.torch.chunkwise.native import mlstm_chunkwise__native_autograd
    from mlstm_kernels.torch.recurrent.native_sequence import mlstm_recurrent_sequence__native_fw
    q, k, v, ig, fg = _peer_inputs(ig_scale=ig_scale)
    K = q.shape[-1]
    m = make(SPEC, {"d_model": 8, "heads": 2, "d_k": K, "d_v": v.shape[-1]}, chunk=16, dtype=torch.float32)
    o, s = call(m, SPEC, {"q": q, "k": k, "v": v, "ig": ig, "fg": fg}, schedule="additive")
    args = [x.transpose(1, 2).contiguous() for x in (q, k, v, ig, fg)]   # [B, H, T, ...]
    peer_r, (c_r, n_r, m_r) = mlstm_recurrent_sequence__native_fw(*args, return_last_states=True, eps=0.0)
    peer_c = mlstm_chunkwise__native_autograd(*args, eps=0.0, chunk_size=16)
    assert _rel(o, peer_r.transpose(1, 2)) <= 1e-4
    assert _rel(o, peer_c.transpose(1, 2)) <= 1e-4
    if ig_scale < 10:   # the true-scale state is finite: compare it with the peer's stabilised one
        scale = torch.exp(m_r.double()).view(1, 2, 1, 1) * K ** -0.5
        assert _rel(s["C"], c_r.double() * scale) <= 1e-4
        assert _rel(s["n"], n_r.double() * scale[..., 0]) <= 1e-4


def test_benchmark_script_times_the_same_function(capsys):
    """benchmarks/mlstm.py at small sizes, one round: its self-check (online and the peer, when
    installed, equal the chunked form) passes and it prints its ratios."""
    import importlib.util
    threads = torch.get_num_threads()
    spec = importlib.util.spec_from_file_location("bench_mlstm", ROOT / "benchmarks" / "mlstm.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    try:
        assert mod.main(["--T", "96", "--D", "16", "--chunk", "32", "--repeat", "1", "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    assert "memspec online / memspec chunked" in capsys.readouterr().out


def test_online_stabiliser_needs_one_shared_input_weight():
    """One stabiliser serves states that share their decay and exponential input weight: with a
    second input gate on the normaliser, the online step computes exp as written and explain
    says why (the chunked kernel still stabilises each state on its own)."""
    from memspec.lang.frontend import loads
    from memspec.schedule import analyse, explain
    text = (ROOT / "specs" / "mlstm.yaml").read_text(encoding="utf-8")
    text = text.replace("gates:\n  ig: logit\n", "gates:\n  ig: logit\n  ig2: logit\n")
    text = text.replace("exp(ig) / sqrt(d_k) * k", "exp(ig2) / sqrt(d_k) * k")
    assert "ig2" in text and "exp(ig2)" in text
    two = loads(text)
    d = analyse(two)
    assert d.family == "additive" and d.plans["online"].stabiliser is None
    assert "the online step computes the exponential input weight as written" in explain(two)
    assert "decays or input weights differ" in explain(two)
    one = analyse(SPEC).plans["online"].stabiliser
    assert one is not None and [s.name for s in one.states] == ["C", "n"]
    assert "the online step carries the same stabiliser" in explain(SPEC)
