"""The dual form with per-channel decays on a state's value side (``W @ diag(c)``: its columns,
the layer's output channels; ``DualForm.cols``): specs/variants/titans_value_forget.yaml and
update programs that mix the sides across states, against the reference interpreter, which runs
the same mini-batch semantics token by token.

On the columns, token j's gradient ``x_jᵀ δ_j`` reaches token i's state with one product of
decays per output channel c, so a read is ``sum_j (x_i . x_j) m[c, i, j] δ_j[c]``: the weights
scale the deltas, where on the rows they scale the inputs (tests/test_dual_channel.py).
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
SPEC = memspec.load(ROOT / "specs/variants/titans_value_forget.yaml")
DIMS = {"heads": 2, "d_k": 4, "d_v": 3, "hidden": 5}


def memory(chunk=2 * BLOCK, spec=SPEC, dims=DIMS, seed=0):
    torch.manual_seed(seed)
    m = build_memory(spec, compile=False, chunk=chunk, **dims).double()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(p + 0.3 * torch.randn_like(p))
    return m


def inputs(m, B=2, T=2 * 2 * BLOCK + 11, seed=1, log_decay=None):
    """Views, gates (scalar ones in [0.1, 0.5] or [0.3, 0.9], per-channel forget gates in [0.02,
    0.62]; ``log_decay``: some channels keep ``exp(log_decay)`` at some tokens)."""
    g = torch.Generator().manual_seed(seed)
    H, dt = m.heads, torch.float64
    out = {v: torch.randn(B, T, H, getattr(m, d), generator=g, dtype=dt) for v, d in m.VIEWS.items()}
    for n, dims in m.GATES.items():
        size = tuple(getattr(m, d) for d in dims)
        if not size:
            lo = 0.3 if n == "mu" else 0.1
            out[n] = lo + 0.5 * torch.rand(B, T, H, generator=g, dtype=dt)
            continue
        out[n] = 0.02 + 0.6 * torch.rand(B, T, H, *size, generator=g, dtype=dt)
        if log_decay is not None:
            keep = torch.where(torch.rand(B, T, H, *size, generator=g) < 0.3, torch.tensor(log_decay, dtype=dt),
                               torch.log1p(-out[n]))
            out[n] = -torch.expm1(keep)
    return out


def state(m, spec=SPEC, B=2, seed=2):
    g = torch.Generator().manual_seed(seed)
    st = m.init_state(B, dtype=torch.float64, generator=g)
    return {n: (t if spec.state[n].learned else t + 0.1 * torch.randn(t.shape, generator=g, dtype=torch.float64))
            for n, t in st.items()}


def call(m, ins, st=None, **kw):
    return m(*[ins[v] for v in m.VIEWS], **{g: ins[g] for g in m.GATES}, state=st, schedule="minibatch", **kw)


def reference(m, spec, ins, st):
    dims = {d: getattr(m, d) for d in ("heads", "d_k", "d_v", "hidden")}
    return reference_run(spec, state=dict(st), schedule=("minibatch", m.chunk), dims=dims, params={}, **ins)


def _variant(update: list, schedule: str = "minibatch(16)", order: bool = False) -> memspec.Spec:
    """specs/variants/titans_value_forget.yaml with another update program (gates alpha_h [hidden],
    alpha_v [d_v] and, added here, alpha_k [d_k])."""
    text = (ROOT / "specs/variants/titans_value_forget.yaml").read_text()
    head, _, _ = text.partition("update:\n")
    head = head.replace("state:\n", "  alpha_k:\n    formula: sigmoid(logit)\n    shape: [d_k]\n    bias: -4.0\n"
                                    "state:\n", 1)
    body = "update:\n" + "".join(f"  - {u}\n" for u in update) + "read: f(qn)\nschedule: " + schedule + "\n" \
        + ("order: read_write\n" if order else "")
    return memspec.loads(head + body, "yaml")


def test_explain_keeps_the_dual_form_on_the_columns():
    plan = analyse(SPEC)
    assert plan.family == "minibatch" and plan.chunk == 64
    form = analyse_dual(SPEC)
    assert form.rows == {"W1": "hidden", "W2": "d_v"} and form.cols == {"W1", "W2"}
    text = explain(SPEC)
    assert "per-channel decays of W1 (one factor per hidden, on its columns), W2 (one factor per d_v, on its " \
           "columns)" in text
    assert "no dual form" not in text


def _match(spec, m, T, grads=True):
    ins = inputs(m, T=T)
    if grads:
        for x in ins.values():
            x.requires_grad_(True)
    st = state(m, spec)
    o, fs = call(m, ins, dict(st))
    ro, rs = reference(m, spec, ins, st)
    assert_same_function(o, ro)
    for n in spec.state:
        assert_same_function(fs[n], rs[n], msg=n)
    if not grads:
        return
    g = torch.Generator().manual_seed(5)
    w_o = torch.randn(o.shape, generator=g, dtype=o.dtype)
    ws = {n: torch.randn(fs[n].shape, generator=g, dtype=o.dtype) for n in spec.state}
    wrt = list(ins.values()) + list(m.parameters())

    def scalar(out, states):
        return (out * w_o).sum() + sum((states[n] * w).sum() for n, w in ws.items())

    mine = torch.autograd.grad(scalar(o, fs), wrt, allow_unused=True)
    ref = torch.autograd.grad(scalar(ro, rs), wrt, allow_unused=True)
    for a, b in zip(mine, ref):
        if b is None:
            assert a is None or float(a.abs().max()) == 0
            continue
        assert float(b.abs().max()) > 0
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("chunk,T", [(2 * BLOCK, 2 * 2 * BLOCK + 11), (4 * BLOCK, 4 * BLOCK + 5), (7, 16)],
                         ids=["2-blocks", "4-blocks", "no-whole-block"])
def test_outputs_states_and_gradients_match_reference(chunk, T):
    _match(SPEC, memory(chunk), T)


@pytest.mark.parametrize("update,cols", [
    (["U1 = mu * U1 - eta * grad(loss, W1)", "U2 = mu * U2 - eta * grad(loss, W2)",
      "W1 = diag(1 - alpha_k) @ W1 + U1", "W2 = W2 @ diag(1 - alpha_v) + U2"], {"W2"}),
    (["U1 = U1 @ diag(1 - alpha_h) - eta * grad(loss, W1)", "U2 = mu * U2 - grad(loss, W2) @ diag(eta * alpha_v)",
      "W1 = W1 + U1", "W2 = (1 - mu) * W2 + U2"], {"U1", "U2", "W1", "W2"}),
    (["g1 = grad(loss, W1)", "U1 = mu * U1 - eta * g1", "U2 = mu * U2 - eta * grad(loss, W2)",
      "W1 = (W1 + U1 - g1) @ diag(1 - alpha_h)", "W2 = W2 @ diag(1 - alpha_v) + U2 @ diag(1 - alpha_v)"],
     {"W1", "W2"}),
], ids=["rows-and-columns-on-two-layers", "momentum-on-columns-flows-into-the-memory", "decayed-steps"])
@pytest.mark.parametrize("order", ["write_read", "read_write"])
def test_update_programs_on_the_columns_match_reference(update, cols, order):
    """The side flows with the weights: a state fed by a column-scaled momentum is on its columns
    too; two layers may use different sides.  Each token reads its own state (write_read) or
    the state before it (read_write)."""
    spec = _variant(update, order=order == "read_write")
    form = analyse_dual(spec)
    assert form.cols == cols
    assert "no dual form" not in explain(spec)
    _match(spec, memory(2 * BLOCK, spec=spec), 2 * 2 * BLOCK + 11)


def test_both_sides_on_one_state_is_not_dual():
    """A state scaled on its rows and its columns has no dual form (nor the materialising step,
    which scales by scalars); explain names the state and both sides."""
    update = ["U1 = mu * U1 - eta * grad(loss, W1)", "U2 = mu * U2 - eta * grad(loss, W2)",
              "W1 = diag(1 - alpha_k) @ W1 @ diag(1 - alpha_h) + U1", "W2 = W2 @ diag(1 - alpha_v) + U2"]
    spec = _variant(update, schedule="auto")
    assert analyse(spec).family == "online"
    assert "minibatch: the per-channel factors of W1 scale both its rows (`diag(c) @ W1`) and its columns" \
        in explain(spec)
    with pytest.raises(memspec.SpecError):
        analyse(_variant(update))


def test_gradcheck_tiny():
    dims = {"heads": 1, "d_k": 2, "d_v": 2, "hidden": 3}
    m = memory(2 * BLOCK, dims=dims)
    ins = inputs(m, B=1, T=2 * BLOCK + 3)
    st = state(m, B=1)
    names = ["k", "alpha_h", "alpha_v", "mu"]

    def f(*xs):
        o, fs = call(m, {**ins, **dict(zip(names, xs))}, dict(st))
        return o, fs["W1"], fs["W2"]

    assert torch.autograd.gradcheck(f, [ins[n].clone().requires_grad_(True) for n in names], eps=1e-6, atol=1e-6)


def test_causal_and_streaming():
    m = memory()
    ins = inputs(m)
    st = state(m)
    with torch.no_grad():
        o, fs = call(m, ins, dict(st))
        for t in (5, BLOCK + 3, 2 * BLOCK + 1):
            moved = {n: x.clone() for n, x in ins.items()}
            for n, x in moved.items():
                x[:, t:] = x[:, t:].flip(1) if n in m.VIEWS else x[:, t:] * 0.5
            o2, _ = call(m, moved, dict(st))
            # the past of a changed future: float64's tolerance (a leak would be of order one)
            assert_same_function(o2[:, :t], o[:, :t], msg=str(t))
            assert not torch.allclose(o2[:, t:], o[:, t:])
        outs, s, a = [], dict(st), 0
        for n in (9, 2 * BLOCK, 1, ins["q"].shape[1] - 9 - 2 * BLOCK - 1):
            op, s = call(m, {k: x[:, a:a + n] for k, x in ins.items()}, s)
            outs.append(op)
            a += n
    assert_same_function(torch.cat(outs, dim=1), o)
    for n in SPEC.state:
        assert_same_function(s[n], fs[n], msg=n)


def test_finite_and_exact_for_log_decays_down_to_minus_40():
    m = memory()
    ins = inputs(m, log_decay=-40.0)
    st = state(m)
    with torch.no_grad():
        o, fs = call(m, ins, dict(st))
        ro, rs = reference(m, SPEC, ins, st)
    assert torch.isfinite(o).all()
    assert_same_function(o, ro)
    for n in SPEC.state:
        assert_same_function(fs[n], rs[n], msg=n)


def test_equal_channels_give_titans():
    """Every channel's forget gate equal to one scalar: the numbers of specs/titans.yaml."""
    titans = memspec.load(ROOT / "specs/titans.yaml")
    m = memory()
    t = memory(spec=titans)
    t.load_state_dict(m.state_dict())
    ins = inputs(m)
    alpha = ins["alpha_h"][..., 0]
    ins["alpha_h"] = alpha.unsqueeze(-1).expand_as(ins["alpha_h"]).contiguous()
    ins["alpha_v"] = alpha.unsqueeze(-1).expand_as(ins["alpha_v"]).contiguous()
    st = state(m)
    with torch.no_grad():
        o, fs = call(m, ins, dict(st))
        to, ts = t(ins["q"], ins["k"], ins["v"], eta=ins["eta"], mu=ins["mu"], alpha=alpha, state=dict(st),
                   schedule="minibatch")
    assert_same_function(o, to)
    for n in SPEC.state:
        assert_same_function(fs[n], ts[n], msg=n)
