"""The dual form with per-channel decays (memspec.schedule.dual ``DualForm.rows``): Titans'
memory with a forget gate per row of each layer, ``W = diag(1 - alpha) @ W + U``
(specs/titans_channel_forget.yaml), keeps its mini-batch dual form.

The chunk runs in blocks of ``BLOCK`` tokens (exact per-channel weights inside a block, the
states carried from block to block); these tests use chunks of 2 and 4 blocks (and a partial
chunk, one block) against the reference interpreter, which runs the same mini-batch semantics
token by token.
"""
from pathlib import Path

import pytest
import torch
from close import assert_same_function

import memspec
from memspec.pipeline.build import build_memory
from memspec.reference import run as reference_run
from memspec.schedule import analyse, explain
from memspec.schedule.dual import BLOCK, analyse_dual

ROOT = Path(__file__).resolve().parent.parent
SPEC = memspec.load(ROOT / "specs/titans_channel_forget.yaml")
DIMS = {"heads": 2, "d_k": 4, "d_v": 3, "hidden": 5}


def memory(chunk=2 * BLOCK, dtype=torch.float64, seed=0, spec=SPEC, dims=DIMS):
    torch.manual_seed(seed)
    m = build_memory(spec, compile=False, chunk=chunk, **dims).to(dtype)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(p + 0.3 * torch.randn_like(p))
    return m


def inputs(m, B=2, T=2 * 2 * BLOCK + 11, dtype=torch.float64, seed=1, log_decay=None):
    """Views, step and momentum gates, and per-channel forget gates (``log_decay``: every
    channel keeps ``exp(log_decay)`` where given as a number)."""
    g = torch.Generator().manual_seed(seed)
    H = m.heads
    out = {v: torch.randn(B, T, H, getattr(m, d), generator=g, dtype=dtype) for v, d in m.VIEWS.items()}
    out["eta"] = 0.1 + 0.4 * torch.rand(B, T, H, generator=g, dtype=dtype)
    out["mu"] = 0.3 + 0.6 * torch.rand(B, T, H, generator=g, dtype=dtype)
    for n, d in (("alpha_k", m.d_k), ("alpha_h", m.hidden)):
        out[n] = 0.02 + 0.6 * torch.rand(B, T, H, d, generator=g, dtype=dtype)
        if log_decay is not None:   # a few channels forget almost everything at some tokens
            keep = torch.where(torch.rand(B, T, H, d, generator=g) < 0.3, torch.tensor(log_decay, dtype=dtype),
                               torch.log1p(-out[n]))
            out[n] = -torch.expm1(keep)
    return out


def state(m, B=2, dtype=torch.float64, seed=2):
    g = torch.Generator().manual_seed(seed)
    st = m.init_state(B, dtype=dtype, generator=g)
    return {n: (t if SPEC.state[n].learned else t + 0.1 * torch.randn(t.shape, generator=g, dtype=dtype))
            for n, t in st.items()}


def call(m, ins, st=None, schedule="minibatch", **kw):
    return m(*[ins[v] for v in m.VIEWS], **{g: ins[g] for g in m.GATES}, state=st, schedule=schedule, **kw)


def reference(m, ins, st):
    dims = {d: getattr(m, d) for d in ("heads", "d_k", "d_v", "hidden")}
    return reference_run(SPEC, state=dict(st), schedule=("minibatch", m.chunk), dims=dims, params={}, **ins)


def test_explain_keeps_the_dual_form_with_per_channel_decays():
    plan = analyse(SPEC)
    assert plan.family == "minibatch" and plan.chunk == 64
    form = analyse_dual(SPEC)
    assert form.rows == {"W1": "d_k", "W2": "hidden"}
    text = explain(SPEC)
    assert "dual form: the model's states enter only through W1 (linear layer x @ W1)" in text
    assert "per-channel decays of W1 (one factor per d_k), W2 (one factor per hidden)" in text
    assert "no dual form" not in text
    # the same memory written in .mem gets the same plan
    assert analyse(memspec.load(ROOT / "specs/titans_channel_forget.mem")) == plan
    # titans (a scalar forget gate) has no per-channel rows: its chunk is not in blocks
    assert analyse_dual(memspec.load(ROOT / "specs/titans.yaml")).rows == {}


@pytest.mark.parametrize("chunk,T", [(2 * BLOCK, 2 * 2 * BLOCK + 11), (4 * BLOCK, 4 * BLOCK + 5), (7, 16)],
                         ids=["2-blocks", "4-blocks", "no-whole-block"])
def test_outputs_states_and_gradients_match_reference(chunk, T):
    m = memory(chunk)
    ins = inputs(m, T=T)
    for x in ins.values():
        x.requires_grad_(True)
    st = state(m)
    o, fs = call(m, ins, dict(st))
    ro, rs = reference(m, ins, st)
    assert_same_function(o, ro)
    for n in SPEC.state:
        assert_same_function(fs[n], rs[n], msg=n)
    g = torch.Generator().manual_seed(5)
    w_o = torch.randn(o.shape, generator=g, dtype=o.dtype)
    ws = {n: torch.randn(fs[n].shape, generator=g, dtype=o.dtype) for n in SPEC.state}
    wrt = list(ins.values()) + list(m.parameters())

    def scalar(out, states):
        return (out * w_o).sum() + sum((states[n] * w).sum() for n, w in ws.items())

    mine = torch.autograd.grad(scalar(o, fs), wrt)
    ref = torch.autograd.grad(scalar(ro, rs), wrt)
    for a, b in zip(mine, ref):
        assert float(b.abs().max()) > 0
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_gradcheck_tiny():
    dims = {"heads": 1, "d_k": 2, "d_v": 2, "hidden": 3}
    m = memory(BLOCK + BLOCK, dims=dims)
    ins = inputs(m, B=1, T=2 * BLOCK + 3)
    st = state(m, B=1)
    names = ["k", "alpha_k", "alpha_h", "mu"]

    def f(*xs):
        o, fs = call(m, {**ins, **dict(zip(names, xs))}, dict(st))
        return o, fs["W1"], fs["W2"]

    assert torch.autograd.gradcheck(f, [ins[n].clone().requires_grad_(True) for n in names], eps=1e-6, atol=1e-6)


def test_causal():
    m = memory()
    ins = inputs(m)
    st = state(m)
    with torch.no_grad():
        o, _ = call(m, ins, dict(st))
        for t in (5, BLOCK, BLOCK + 3, 2 * BLOCK + 1):
            moved = {n: x.clone() for n, x in ins.items()}
            for n, x in moved.items():
                x[:, t:] = x[:, t:].flip(1) if n in m.VIEWS else x[:, t:] * 0.5
            o2, _ = call(m, moved, dict(st))
            assert torch.equal(o2[:, :t], o[:, :t]), t
            assert not torch.allclose(o2[:, t:], o[:, t:])


def test_streaming_in_pieces_equals_one_call():
    m = memory()
    ins = inputs(m)
    st = state(m)
    with torch.no_grad():
        o, fs = call(m, ins, dict(st))
        outs, s, a = [], dict(st), 0
        for n in (9, 2 * BLOCK, 1, 30, ins["q"].shape[1] - 9 - 2 * BLOCK - 1 - 30):
            piece = {k: x[:, a:a + n] for k, x in ins.items()}
            op, s = call(m, piece, s)
            outs.append(op)
            a += n
    assert_same_function(torch.cat(outs, dim=1), o)
    for n in SPEC.state:
        assert_same_function(s[n], fs[n], msg=n)


@pytest.mark.parametrize("lengths", [[2 * BLOCK + 5, 7, 2 * 2 * BLOCK], [2 * BLOCK, 2 * 2 * BLOCK, 2 * BLOCK]],
                         ids=["mixed", "whole-chunks"])
def test_packed_documents_equal_documents_alone(lengths):
    """Outputs always; the final states where every document ends on a chunk boundary (a
    document that ends inside a chunk keeps its chunk-start state for streaming, which a packed
    call leaves out: tests/test_varlen.py)."""
    m = memory()
    ins = inputs(m, B=1, T=sum(lengths))
    st = state(m, B=len(lengths))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    with torch.no_grad():
        o, packed = call(m, ins, dict(st), cu_seqlens=cu)
        for i, n in enumerate(lengths):
            a = int(cu[i])
            piece = {k: x[:, a:a + n] for k, x in ins.items()}
            oi, fi = call(m, piece, {k: t[i:i + 1] for k, t in st.items()})
            assert_same_function(o[:, a:a + n], oi)
            if all(n % m.chunk == 0 for n in lengths):
                for s in SPEC.state:
                    assert_same_function(packed[s][i:i + 1], fi[s], msg=s)


def test_equal_channels_give_titans():
    """Every channel's forget gate equal to one scalar: the numbers of specs/titans.yaml."""
    titans = memspec.load(ROOT / "specs/titans.yaml")
    m = memory(chunk=2 * BLOCK)
    t = memory(chunk=2 * BLOCK, spec=titans)
    t.load_state_dict(m.state_dict())
    ins = inputs(m)
    alpha = ins["alpha_k"][..., 0]
    ins["alpha_k"] = alpha.unsqueeze(-1).expand_as(ins["alpha_k"]).contiguous()
    ins["alpha_h"] = alpha.unsqueeze(-1).expand_as(ins["alpha_h"]).contiguous()
    st = state(m)
    with torch.no_grad():
        o, fs = call(m, ins, dict(st))
        to, ts = t(ins["q"], ins["k"], ins["v"], eta=ins["eta"], mu=ins["mu"], alpha=alpha, state=dict(st),
                   schedule="minibatch")
    assert_same_function(o, to)
    for n in SPEC.state:
        assert_same_function(fs[n], ts[n], msg=n)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_finite_and_exact_for_log_decays_down_to_minus_40(dtype):
    m = memory(dtype=dtype)
    ins = inputs(m, dtype=dtype, log_decay=-40.0)
    st = state(m, dtype=dtype)
    with torch.no_grad():
        o, fs = call(m, ins, dict(st))
        ro, rs = reference(m, ins, st)
    assert torch.isfinite(o).all() and all(torch.isfinite(fs[n]).all() for n in SPEC.state)
    rtol = 1e-10 if dtype == torch.float64 else 1e-4
    torch.testing.assert_close(o, ro, rtol=rtol, atol=rtol)
    for n in SPEC.state:
        torch.testing.assert_close(fs[n], rs[n], rtol=rtol, atol=rtol, msg=n)


def test_no_per_token_state_is_formed():
    """The largest tensor of the blocked dual form (per-channel weights [B, H * nb, d, block,
    block]) stays well below one chunk of per-token weights [B, C, H, d_k, hidden]."""
    from test_dual import _LargestTensor
    dims = {"heads": 2, "d_k": 32, "d_v": 32, "hidden": 64}
    m = memory(chunk=64, dtype=torch.float32, dims=dims)
    ins = inputs(m, B=1, T=64, dtype=torch.float32)
    rec = _LargestTensor()
    with rec, torch.no_grad():
        call(m, ins)
    assert rec.largest <= 1 * 64 * 2 * 32 * 64 / 2, rec.largest


def _variant(update: list, loss: str | None = None, schedule: str = "minibatch(16)"):
    text = (ROOT / "specs/titans_channel_forget.yaml").read_text()
    head, _, _ = text.partition("update:\n")
    body = "update:\n" + "".join(f"  - {u}\n" for u in update) + "read: f(qn)\nschedule: " + schedule + "\n"
    if loss is not None:
        head = head.replace("loss: 0.5 * sum((f(kn) - vs)^2)", f"loss: {loss}")
    return memspec.loads(head + body, "yaml")


def test_per_channel_coefficients_on_other_states_match_reference():
    """A row scaling of the momentum as it enters the memory, diag(1 - alpha_k) @ (W1 + U1):
    per-channel coefficients off the diagonal too (and a scalar forget on W2)."""
    spec = _variant(["U1 = mu * U1 - eta * grad(loss, W1)", "U2 = mu * U2 - eta * grad(loss, W2)",
                     "W1 = diag(1 - alpha_k) @ (W1 + U1)", "W2 = (1 - mu) * W2 + diag(1 - alpha_h) @ U2"])
    form = analyse_dual(spec)
    assert form.rows == {"W1": "d_k", "W2": "hidden"}
    m = memory(chunk=2 * BLOCK, spec=spec)
    ins = inputs(m)
    st = state(m)
    with torch.no_grad():
        o, fs = call(m, ins, dict(st))
        dims = {d: getattr(m, d) for d in ("heads", "d_k", "d_v", "hidden")}
        ro, rs = reference_run(spec, state=dict(st), schedule=("minibatch", m.chunk), dims=dims, params={}, **ins)
    assert_same_function(o, ro)
    for n in spec.state:
        assert_same_function(fs[n], rs[n], msg=n)


def test_without_a_dual_form_a_row_scaling_is_not_mini_batch():
    """The materialising chunk step scales by scalars only: a per-channel decay whose memory has
    no dual form (here the loss reads W1 outside the model) is not admitted to mini-batch, and
    explain says why."""
    spec = _variant(["U1 = mu * U1 - eta * grad(loss, W1)", "U2 = mu * U2 - eta * grad(loss, W2)",
                     "W1 = diag(1 - alpha_k) @ W1 + U1", "W2 = diag(1 - alpha_h) @ W2 + U2"],
                    loss="0.5 * sum((f(kn) - vs)^2) + 0.01 * sum(W1 * W1)", schedule="auto")
    plan = analyse(spec)
    assert plan.family == "online"
    text = explain(spec)
    assert "minibatch: diag(1 - alpha_k) @ W1 is linear in the states but not a scalar multiple of it" in text
    assert "no dual form: the loss reads W1 outside the model" in text


def test_chunk_pre_is_local_to_batch_rows():
    """_chunk_pre (the per-channel weights, the blocks' coefficients, the scores of the inputs
    alone) on two chunks stacked on the batch axis gives each chunk's own numbers, and the
    forward calls it once for all full chunks."""
    import inspect
    m = memory(chunk=2 * BLOCK)
    names = list(inspect.signature(m._chunk_pre).parameters)
    g = torch.Generator().manual_seed(3)

    def chunk():   # head-major [B, H, C, ...]
        sizes = {**{v: (getattr(m, d),) for v, d in m.VIEWS.items()},
                 **{n: tuple(getattr(m, d) for d in dg) for n, dg in m.GATES.items()}, "qn": (m.d_k,), "kn": (m.d_k,)}
        return [torch.rand(1, 2, 2 * BLOCK, *sizes[n], generator=g, dtype=torch.float64) for n in names]
    a, b = chunk(), chunk()
    both = m._chunk_pre(*(torch.cat([x, y]) for x, y in zip(a, b)))
    for got, pa, pb in zip(both, m._chunk_pre(*a), m._chunk_pre(*b)):
        assert_same_function(got, torch.cat([pa, pb]))
    calls, real = [], m._chunk_pre

    def spy(*xs):
        calls.append(xs[0].shape[0])
        return real(*xs)
    m._chunk_pre = spy
    with torch.no_grad():
        call(m, inputs(m, T=3 * 2 * BLOCK + 1))
    assert calls == [3 * 2, 2]


def test_bfloat16_inputs_keep_float32_states():
    m = memory(dtype=torch.float32)
    ins = inputs(m, dtype=torch.float32)
    st = state(m, dtype=torch.float32)
    with torch.no_grad():
        o, _ = call(m, ins, dict(st))
        ob, fb = call(m, {k: v.bfloat16() for k, v in ins.items()}, dict(st))
    assert ob.dtype == torch.bfloat16 and all(fb[n].dtype == torch.float32 for n in SPEC.state)
    torch.testing.assert_close(ob.float(), o, rtol=0.05, atol=0.05)


@pytest.mark.slow
def test_compiled_chunk_step_equals_eager():
    m = memory(dtype=torch.float32)
    mc = build_memory(SPEC, compile=True, chunk=m.chunk, **DIMS)
    mc.load_state_dict(m.state_dict())
    ins = inputs(m, dtype=torch.float32)
    st = state(m, dtype=torch.float32)
    with torch.no_grad():
        o, fs = call(m, ins, dict(st))
        oc, fc = call(mc, ins, dict(st))
    assert_same_function(oc, o)
    for n in SPEC.state:
        assert_same_function(fc[n], fs[n], msg=n)


@pytest.mark.slow
def test_per_channel_variant_learns_recall(tmp_path):
    """specs/variants/titans_mqar.yaml (the Titans memory configured for associative recall)
    with a forget gate per row of each layer trains through its inner updates in the dual form
    to far above chance (measured: accuracy 1.00 in about 12 s on one thread)."""
    from dataclasses import replace

    from test_train import LEARN

    from memspec.lang.fmt import to_yaml
    from memspec.tools.train import train
    text = to_yaml(memspec.load(ROOT / "specs/variants/titans_mqar.yaml"))
    gate = "    formula: sigmoid(logit)\n    bias: -4.0\n"
    assert "  alpha:\n" + gate in text
    gates = "  alpha_k:\n    shape: [d_k]\n" + gate + "  alpha_h:\n    shape: [hidden]\n" + gate
    text = (text.replace("  alpha:\n" + gate, gates)
            .replace("W1 = (1 - alpha) * W1 + U1", "W1 = diag(1 - alpha_k) @ W1 + U1")
            .replace("W2 = (1 - alpha) * W2 + U2", "W2 = diag(1 - alpha_h) @ W2 + U2")
            .replace("name: titans_mqar", "name: titans_channel_mqar"))
    path = tmp_path / "titans_channel_mqar.yaml"
    path.write_text(text)
    assert analyse_dual(memspec.load(path)).rows == {"W1": "d_k", "W2": "hidden"}
    r = train(str(path), replace(LEARN, dims={"hidden": 32, "chunk": 8}))
    assert r.schedule == "minibatch(8)"
    assert r.accuracy > 0.6, r.accuracy
    assert r.losses[-1] < 0.5 * r.losses[0]


ONE_LAYER = """
name: probe
dims: {d_model: 8, heads: 2, d_k: 3, d_v: 2, hidden: 4}
views: {q: d_k, k: d_k, v: d_v}
gates:
  eta: 0.5 * sigmoid(logit)
  alpha_k: {shape: [d_k], formula: sigmoid(logit)}
  alpha_h: {shape: [hidden], formula: sigmoid(logit)}
state:
  W1: {shape: [d_k, hidden], init: normal(0.5)}
  W2: {shape: [hidden, d_v], init: normal(0.5)}
model: f(u) = tanh(u @ W1) @ W2
loss: 0.5 * sum((f(k) - v)^2)
update:
UPDATE
read: f(q)
schedule: minibatch(16)
"""


@pytest.mark.parametrize("update", [
    ["g1 = grad(loss, W1)", "g2 = grad(loss, W2)",
     "W1 = diag(1 - alpha_k) @ W1 - eta * g1", "W2 = diag(1 - alpha_h) @ W2 - eta * g2"],
    ["g1 = grad(loss, W1)", "g2 = grad(loss, W2)",
     "W1 = diag(1 - alpha_k) @ W1 - g1", "W2 = diag(1 - alpha_h) @ (W2 - eta * g2)"],
    ["g1 = grad(loss, W1)", "g2 = grad(loss, W2)",
     "W1 = (1 - eta) * W1 - diag(alpha_k) @ g1", "W2 = diag(1 - alpha_h) @ W2 - diag(eta * alpha_h) @ g2"],
], ids=["step-in-the-decayed-state", "unit-step-and-decayed-step", "per-channel-steps"])
@pytest.mark.parametrize("order", ["write_read", "read_write"])
def test_gradient_terms_under_a_per_channel_decay_match_reference(update, order):
    """A gradient written straight into a state that decays per row (no momentum): the weights
    of the gradients are the row-wise scan of diagonal ones; read after the write (each token
    its own state) or before it (the state before the token)."""
    text = ONE_LAYER.replace("UPDATE", "".join(f"  - {u}\n" for u in update))
    spec = memspec.loads(text if order == "write_read" else text + "order: read_write\n", "yaml")
    assert analyse(spec).family == "minibatch" and analyse_dual(spec).rows == {"W1": "d_k", "W2": "hidden"}
    assert "no dual form" not in explain(spec)
    torch.manual_seed(0)
    m = build_memory(spec, compile=False, chunk=2 * BLOCK, heads=2, d_k=3, d_v=2, hidden=4).double()
    g = torch.Generator().manual_seed(1)
    T, H = 2 * 2 * BLOCK + 3, 2
    ins = {v: 0.5 * torch.randn(2, T, H, getattr(m, d), generator=g, dtype=torch.float64) for v, d in m.VIEWS.items()}
    ins["eta"] = 0.05 + 0.2 * torch.rand(2, T, H, generator=g, dtype=torch.float64)
    ins["alpha_k"] = 0.02 + 0.5 * torch.rand(2, T, H, 3, generator=g, dtype=torch.float64)
    ins["alpha_h"] = 0.02 + 0.5 * torch.rand(2, T, H, 4, generator=g, dtype=torch.float64)
    st = m.init_state(2, dtype=torch.float64, generator=g)
    with torch.no_grad():
        o, fs = call(m, ins, dict(st))
        dims = {"heads": 2, "d_k": 3, "d_v": 2, "hidden": 4}
        ro, rs = reference_run(spec, state=dict(st), schedule=("minibatch", m.chunk), dims=dims, params={}, **ins)
    assert_same_function(o, ro)
    for n in spec.state:
        assert_same_function(fs[n], rs[n], msg=n)
