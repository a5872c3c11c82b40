"""Wiring (MAC / MAG / MAL): order retrieve -> attend -> update, causality by perturbation,
streaming equality (every option), sliding-window attention against an explicit softmax,
the normalisation-off attention equal to plain SDPA, each option computing its formula."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memspec.runtime.wiring import MAC, MAG, MAL, Attention, SlidingWindowAttention, source, wrap

from close import assert_same_function


class TinyDeltaLayer(nn.Module):
    """A hand-written DeltaNet layer with the compiled Layer's interface (token loop)."""

    def __init__(self, d_model: int, heads: int = 2, d: int = 4):
        super().__init__()
        self.h, self.d = heads, d
        self.wq = nn.Linear(d_model, heads * d, bias=False)
        self.wk = nn.Linear(d_model, heads * d, bias=False)
        self.wv = nn.Linear(d_model, heads * d, bias=False)
        self.we = nn.Linear(d_model, heads)
        self.wo = nn.Linear(heads * d, d_model, bias=False)

    def forward(self, x, state=None, return_state=False):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.h, self.d)
        k = nn.functional.normalize(self.wk(x).view(B, T, self.h, self.d), dim=-1)
        v = self.wv(x).view(B, T, self.h, self.d)
        eta = torch.sigmoid(self.we(x))
        S = state["S"] if state is not None else x.new_zeros(B, self.h, self.d, self.d)
        outs = []
        for t in range(T):
            kt, vt, qt = k[:, t], v[:, t], q[:, t]
            err = torch.einsum("bhi,bhij->bhj", kt, S) - vt
            S = S - eta[:, t, :, None, None] * torch.einsum("bhi,bhj->bhij", kt, err)
            outs.append(torch.einsum("bhi,bhij->bhj", qt, S))
        o = torch.stack(outs, 1).reshape(B, T, self.h * self.d) if outs else x.new_zeros(B, 0, self.h * self.d)
        y = self.wo(o)
        return (y, {"S": S}) if return_state else y


D = 8


def make(kind, seed=0, segment=4, window=3, **options):
    torch.manual_seed(seed)
    layer = TinyDeltaLayer(D)
    if kind == "mac":
        m = MAC(layer, D, segment=segment, persistent=2, heads=2, **options)
    elif kind == "mag":
        m = MAG(layer, D, window=window, persistent=2, heads=2, **options)
    else:
        m = MAL(layer, D, window=window, persistent=2, heads=2, **options)
    return m.double()


# every wiring with every value of each of its options (the first of each kind: the defaults)
VARIANTS = [
    ("mac", {}), ("mac", {"write": "input"}), ("mac", {"output": "additive"}),
    ("mac", {"write": "input", "output": "additive", "qk_norm": False}),
    ("mag", {}), ("mag", {"gate": "convex"}), ("mag", {"gate": "convex", "qk_norm": False}),
    ("mal", {}), ("mal", {"residual": False}), ("mal", {"residual": False, "qk_norm": False}),
]
VARIANT_IDS = [k + "".join(f"-{o}={v}" for o, v in opts.items()) for k, opts in VARIANTS]


def x_of(B=2, T=13, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, D, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("kind,options", VARIANTS, ids=VARIANT_IDS)
def test_causality_by_perturbation(kind, options):
    m = make(kind, **options)
    x = x_of()
    y = m(x)
    for t in range(x.shape[1]):
        x2 = x.clone()
        x2[:, t:] += torch.randn_like(x2[:, t:])
        y2 = m(x2)
        assert torch.equal(y[:, :t], y2[:, :t]), f"{kind}: outputs before {t} changed"
        assert not torch.allclose(y[:, t], y2[:, t])


@pytest.mark.parametrize("kind,options", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_token_changes_no_earlier_output(kind, options, bad):
    """A nan or inf in token t's input leaves every output before t as it was (the attention's
    masked weight times a future nan would be nan: keys and values are masked by where)."""
    m = make(kind, **options)
    x = x_of()
    y = m(x)
    for t in range(x.shape[1]):
        x2 = x.clone()
        x2[0, t, 3] = bad
        y2 = m(x2)
        assert torch.equal(y[:, :t], y2[:, :t]), f"{kind}: outputs before {t} changed"
        assert torch.equal(y[1], y2[1]), "another batch row changed"


@pytest.mark.parametrize("kind,options", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("splits", [[13], [1] * 13, [3, 7, 3], [5, 1, 2, 5], [4, 4, 4, 1]])
def test_streaming_equals_one_call(kind, options, splits):
    m = make(kind, **options)
    x = x_of()
    full = m(x)
    state, outs, t = None, [], 0
    for n in splits:
        y, state = m(x[:, t:t + n], state=state, return_state=True)
        outs.append(y)
        t += n
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-12, atol=1e-12)


class Recorder(nn.Module):
    """Wraps a layer and logs every call: (batch size, incoming state, returned state)."""

    def __init__(self, layer):
        super().__init__()
        self.layer, self.calls = layer, []

    def forward(self, x, state=None, return_state=False):
        y, new = self.layer(x, state=state, return_state=True)
        self.calls.append((x.shape[0], state, new))
        return (y, new) if return_state else y


def test_mac_order_retrieve_before_update():
    torch.manual_seed(0)
    rec = Recorder(TinyDeltaLayer(D)).double()
    m = MAC(rec, D, segment=4, persistent=2, heads=2).double()
    B = 2
    m(x_of(B=B, T=12))
    kinds = ["retrieve" if b == B * 4 else "update" for b, _, _ in rec.calls]
    assert kinds == ["retrieve", "update"] * 3
    for s in range(3):
        _, r_state, _ = rec.calls[2 * s]
        _, u_in, u_out = rec.calls[2 * s + 1]
        if s == 0:
            assert r_state is None and u_in is None
        else:
            prev_out = rec.calls[2 * s - 1][2]
            # retrieval reads exactly the state left by the previous segment's update ...
            torch.testing.assert_close(r_state["S"], prev_out["S"].repeat_interleave(4, 0), rtol=0, atol=0)
            # ... and the update starts from it too; the segment's own writes come after.
            assert u_in is prev_out
        assert not torch.allclose(u_out["S"], (u_in or {"S": torch.zeros_like(u_out["S"])})["S"])


class BuggyMAC(MAC):
    """The order reported as a bug in a well-known open implementation: write, then retrieve."""

    def retrieve(self, x, start):
        _, written = self.layer(x, state=start, return_state=True)
        return super().retrieve(x, written)


def test_update_before_retrieve_is_caught():
    torch.manual_seed(0)
    m = BuggyMAC(TinyDeltaLayer(D), D, segment=4, persistent=2, heads=2).double()
    x = x_of()
    y = m(x)
    x2 = x.clone()
    x2[:, 6:] += 1.0          # later tokens of the second segment (positions 4..7)
    y2 = m(x2)
    assert not torch.equal(y[:, 4:6], y2[:, 4:6])   # the bug leaks the future; MAC does not:
    good = MAC(m.layer, D, segment=4, persistent=2, heads=2).double()
    good.attn.load_state_dict(m.attn.state_dict())
    torch.testing.assert_close(good(x)[:, :6], good(x2)[:, :6], rtol=0, atol=0)


def test_mac_memory_carries_earlier_segments():
    m = make("mac")
    x = x_of(T=8)
    h1 = m.retrieve(x[:, 4:8], m(x[:, :4], return_state=True)[1]["start"])
    x2 = x.clone()
    x2[:, :4] += 1.0
    h2 = m.retrieve(x[:, 4:8], m(x2[:, :4], return_state=True)[1]["start"])
    assert (h1 - h2).abs().max() > 1e-3


def naive_window_attention(att, x, window):
    """Token by token: scores q . k / sqrt(dh), or with qk_norm the cosine of q and k times
    gain * sqrt(dh), softmax over [persistent | the last `window` tokens]."""
    B, T, Dm = x.shape
    h, dh = att.heads, Dm // att.heads
    q, k, v = att.split(att.wq(x)), att.split(att.wk(x)), att.split(att.wv(x))
    pk, pv = att.split(att.wk(att.persistent[None])), att.split(att.wv(att.persistent[None]))
    if att.qk_norm:
        unit = lambda t: t / t.norm(dim=-1, keepdim=True)  # noqa: E731
        q, k, pk = unit(q), unit(k), unit(pk)
        temperature = att.qk_gain.view(1, h, 1) * math.sqrt(dh)
    else:
        temperature = 1 / math.sqrt(dh)
    out = torch.zeros(B, h, T, dh, dtype=x.dtype)
    for t in range(T):
        lo = max(0, t - window + 1)
        K = torch.cat([pk.expand(B, -1, -1, -1), k[:, :, lo:t + 1]], 2)
        V = torch.cat([pv.expand(B, -1, -1, -1), v[:, :, lo:t + 1]], 2)
        w = torch.softmax(torch.einsum("bhd,bhnd->bhn", q[:, :, t], K) * temperature, -1)
        out[:, :, t] = torch.einsum("bhn,bhnd->bhd", w, V)
    return att.wo(out.transpose(1, 2).reshape(B, T, Dm))


@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("window,persistent", [(1, 0), (3, 2), (20, 1)])
def test_sliding_window_matches_explicit_softmax(window, persistent, qk_norm):
    torch.manual_seed(0)
    att = SlidingWindowAttention(D, 2, window, persistent, qk_norm=qk_norm).double()
    if qk_norm:
        with torch.no_grad():
            att.qk_gain.copy_(torch.tensor([0.7, 2.5]))   # a learned temperature per head
    x = x_of(T=9)
    y, st = att(x)
    torch.testing.assert_close(y, naive_window_attention(att, x, window), rtol=1e-10, atol=1e-12)
    assert st["k"].shape[2] == min(window - 1, 9)


def test_qk_norm_off_is_plain_sdpa_exactly():
    """Normalisation off: the attention is F.scaled_dot_product_attention of the raw
    projections with its default scale, bit for bit, and has no temperature parameter."""
    torch.manual_seed(0)
    att = Attention(D, heads=2, persistent=3, qk_norm=False).double()
    assert not hasattr(att, "qk_gain") and {n for n, _ in att.named_parameters()} == {
        "wq.weight", "wk.weight", "wv.weight", "wo.weight", "persistent"}
    x = x_of(T=7)
    k, v = att.project_kv(x)
    mask = torch.ones(7, 7, dtype=torch.bool).tril()
    y = att(x, k, v, mask)

    def heads(t):
        return t.view(t.shape[0], t.shape[1], 2, D // 2).transpose(1, 2)

    P = att.persistent.unsqueeze(0).expand(2, -1, -1)
    K = torch.cat([heads(P @ att.wk.weight.T), heads(x @ att.wk.weight.T)], 2)
    V = torch.cat([heads(P @ att.wv.weight.T), heads(x @ att.wv.weight.T)], 2)
    full_mask = torch.cat([torch.ones(7, 3, dtype=torch.bool), mask], 1)
    o = F.scaled_dot_product_attention(heads(x @ att.wq.weight.T), K, V, attn_mask=full_mask)
    expected = o.transpose(1, 2).reshape(2, 7, D) @ att.wo.weight.T
    assert_same_function(y, expected)   # another order of the same sums on another CPU
    # and the normalised attention is a different function of the same weights
    on = Attention(D, heads=2, persistent=3, qk_norm=True).double()
    on.load_state_dict({**att.state_dict(), "qk_gain": torch.ones(2, dtype=torch.float64)})
    assert (on(x, *on.project_kv(x), mask) - y).abs().max() > 1e-3


def test_qk_norm_temperature_is_learned():
    torch.manual_seed(0)
    att = SlidingWindowAttention(D, 2, window=4, persistent=1).double()
    assert att.qk_norm and torch.equal(att.qk_gain, torch.ones(2, dtype=torch.float64))
    y, _ = att(x_of(T=6))
    y.square().sum().backward()
    assert att.qk_gain.grad is not None and (att.qk_gain.grad.abs() > 0).all()


def _pieces(m, x):
    """The memory's reads and the attention's output, computed apart from the wiring."""
    mem, mem_state = m.layer(x, return_state=True)
    attn, _ = m.attn(mem if isinstance(m, MAL) else x)
    return mem, attn


def test_mal_residual_is_memory_plus_attention_of_memory():
    x = x_of()
    m = make("mal")
    mem, attn = _pieces(m, x)
    assert_same_function(m(x), mem + attn)
    bare = make("mal", residual=False)
    assert_same_function(bare(x), _pieces(bare, x)[1])


def test_mag_gate_forms():
    x = x_of()
    m = make("mag")                                  # the paper's normalised product
    with torch.no_grad():                            # learned vector weights, not all ones
        m.norm_attn.weight.uniform_(0.5, 1.5)
        m.norm_mem.weight.uniform_(0.5, 1.5)
    mem, attn = _pieces(m, x)

    def rms(t, w):
        return t / torch.sqrt(t.square().mean(-1, keepdim=True) + torch.finfo(t.dtype).eps) * w

    expected = rms(attn, m.norm_attn.weight) * torch.sigmoid(rms(mem, m.norm_mem.weight))
    torch.testing.assert_close(m(x), expected, rtol=1e-12, atol=1e-12)
    assert not hasattr(m, "gate")
    c = make("mag", gate="convex")
    mem, attn = _pieces(c, x)
    g = torch.sigmoid(c.gate(x))
    assert_same_function(c(x), g * attn + (1 - g) * mem)
    assert not hasattr(c, "norm_attn")


def test_mac_write_and_output_options():
    """One segment (T <= segment): the memory starts empty, so with write="input" the
    memory's reads and final state are the bare layer's over x; with write="attention"
    over the attention output y; output gated is y * sigmoid(m), additive y + m."""
    x = x_of(T=4)
    for write in ("attention", "input"):
        for output in ("gated", "additive"):
            m = make("mac", segment=4, write=write, output=output)
            h = m.retrieve(x, None)
            keys = torch.cat([m.attn.project_kv(h)[0], m.attn.project_kv(x)[0]], 2)
            vals = torch.cat([m.attn.project_kv(h)[1], m.attn.project_kv(x)[1]], 2)
            causal = torch.ones(4, 4, dtype=torch.bool).tril()
            y = m.attn(x, keys, vals, torch.cat([causal, causal], 1))
            mem, mem_state = m.layer(y if write == "attention" else x, return_state=True)
            out, st = m(x, return_state=True)
            assert_same_function(out, y * torch.sigmoid(mem) if output == "gated" else y + mem)
            assert_same_function(st["mem"]["S"], mem_state["S"])


def test_mac_write_option_reaches_the_next_segment():
    """Two segments (T = 8, segment 4): segment 2 retrieves from the memory that segment 1's write
    left (x with write="input", y with write="attention"), attends only within itself, and writes
    on from there; computed here piece by piece from the layer and the attention."""
    x = x_of(T=8)
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    finals = {}
    for write in ("attention", "input"):
        m = make("mac", segment=4, write=write, output="gated")
        mem, outs = None, []
        for x_s in (x[:, :4], x[:, 4:]):
            h = m.retrieve(x_s, mem)
            (hk, hv), (xk, xv) = m.attn.project_kv(h), m.attn.project_kv(x_s)
            y = m.attn(x_s, torch.cat([hk, xk], 2), torch.cat([hv, xv], 2), torch.cat([causal, causal], 1))
            r, mem = m.layer(y if write == "attention" else x_s, state=mem, return_state=True)
            outs.append(y * torch.sigmoid(r))
        out, st = m(x, return_state=True)
        assert_same_function(out, torch.cat(outs, 1))
        assert_same_function(st["mem"]["S"], mem["S"])
        finals[write] = out
    # the two writes give different second segments (through the memory they retrieve from)
    assert (finals["attention"][:, 4:] - finals["input"][:, 4:]).abs().max() > 1e-4


def test_bad_options_are_refused():
    layer = TinyDeltaLayer(D)
    with pytest.raises(ValueError, match="write must be"):
        MAC(layer, D, write="output")
    with pytest.raises(ValueError, match="output must be"):
        MAC(layer, D, output="gate")
    with pytest.raises(ValueError, match="gate must be"):
        MAG(layer, D, gate="product")
    with pytest.raises(ValueError, match="mal has no option write"):
        wrap(layer, "mal", D, write="input")


def test_wrap_and_source():
    layer = TinyDeltaLayer(D)
    assert wrap(layer, "none", D) is layer
    assert isinstance(wrap(layer, "mac", D, segment=8), MAC)
    assert isinstance(wrap(layer, "mal", D, window=8), MAL)
    w = wrap(layer, "mac", D, segment=8, qk_norm=False, write="input", output="additive")
    assert (w.write, w.output, w.attn.qk_norm) == ("input", "additive", False)
    assert wrap(layer, "mag", D, gate="convex").gate_form == "convex"
    assert wrap(layer, "mal", D, residual=False).residual is False
    with pytest.raises(ValueError, match="unknown wiring"):
        wrap(layer, "max", D)
    src = source()
    assert "memspec" not in src.replace("# memspec", "")
    ns = {}
    exec("import torch\nfrom torch import nn\nimport torch.nn.functional as F\n" + src, ns)
    assert {"MAC", "MAG", "MAL", "SlidingWindowAttention"} <= set(ns)


def test_runtime_options_are_the_specs():
    """The runtime (torch only) keeps its own table of each kind's options; it must be the
    spec language's."""
    from memspec.lang.spec import WIRING_OPTIONS
    from memspec.runtime.wiring import OPTIONS

    assert OPTIONS == WIRING_OPTIONS
