"""Wiring (MAC / MAG / MAL): order retrieve -> attend -> update, causality by perturbation,
streaming equality, sliding-window attention against an explicit softmax."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from memspec.runtime.wiring import MAC, MAG, MAL, SlidingWindowAttention, source, wrap


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


def make(kind, seed=0, **kw):
    torch.manual_seed(seed)
    layer = TinyDeltaLayer(D)
    if kind == "mac":
        m = MAC(layer, D, segment=kw.get("segment", 4), persistent=2, heads=2)
    elif kind == "mag":
        m = MAG(layer, D, window=kw.get("window", 3), persistent=2, heads=2)
    else:
        m = MAL(layer, D, window=kw.get("window", 3), persistent=2, heads=2)
    return m.double()


def x_of(B=2, T=13, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, D, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("kind", ["mac", "mag", "mal"])
def test_causality_by_perturbation(kind):
    m = make(kind)
    x = x_of()
    y = m(x)
    for t in range(x.shape[1]):
        x2 = x.clone()
        x2[:, t:] += torch.randn_like(x2[:, t:])
        y2 = m(x2)
        assert torch.equal(y[:, :t], y2[:, :t]), f"{kind}: outputs before {t} changed"
        assert not torch.allclose(y[:, t], y2[:, t])


@pytest.mark.parametrize("kind", ["mac", "mag", "mal"])
@pytest.mark.parametrize("splits", [[13], [1] * 13, [3, 7, 3], [5, 1, 2, 5], [4, 4, 4, 1]])
def test_streaming_equals_one_call(kind, splits):
    m = make(kind)
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
    B, T, Dm = x.shape
    h = att.heads
    q, k, v = att.split(att.wq(x)), att.split(att.wk(x)), att.split(att.wv(x))
    pk, pv = att.split(att.wk(att.persistent[None])), att.split(att.wv(att.persistent[None]))
    out = torch.zeros(B, h, T, Dm // h, dtype=x.dtype)
    for t in range(T):
        lo = max(0, t - window + 1)
        K = torch.cat([pk.expand(B, -1, -1, -1), k[:, :, lo:t + 1]], 2)
        V = torch.cat([pv.expand(B, -1, -1, -1), v[:, :, lo:t + 1]], 2)
        w = torch.softmax(torch.einsum("bhd,bhnd->bhn", q[:, :, t], K) / math.sqrt(Dm // h), -1)
        out[:, :, t] = torch.einsum("bhn,bhnd->bhd", w, V)
    return att.wo(out.transpose(1, 2).reshape(B, T, Dm))


@pytest.mark.parametrize("window,persistent", [(1, 0), (3, 2), (20, 1)])
def test_sliding_window_matches_explicit_softmax(window, persistent):
    torch.manual_seed(0)
    att = SlidingWindowAttention(D, 2, window, persistent).double()
    x = x_of(T=9)
    y, st = att(x)
    torch.testing.assert_close(y, naive_window_attention(att, x, window), rtol=1e-10, atol=1e-12)
    assert st["k"].shape[2] == min(window - 1, 9)


def test_wrap_and_source():
    layer = TinyDeltaLayer(D)
    assert wrap(layer, "none", D) is layer
    assert isinstance(wrap(layer, "mac", D, segment=8), MAC)
    assert isinstance(wrap(layer, "mal", D, window=8), MAL)
    with pytest.raises(ValueError, match="unknown wiring"):
        wrap(layer, "max", D)
    src = source()
    assert "memspec" not in src.replace("# memspec", "")
    ns = {}
    exec("import torch\nfrom torch import nn\nimport torch.nn.functional as F\n" + src, ns)
    assert {"MAC", "MAG", "MAL", "SlidingWindowAttention"} <= set(ns)
