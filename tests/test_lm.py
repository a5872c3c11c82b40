"""MemoryLM: token-by-token decoding with carried state equals the full forward."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import memspec
from memspec.tools.nn import Block, MemoryLM
from memspec.runtime.wiring import MAC, MAG, MAL

DELTANET = """
name: tiny_delta
dims: {heads: 2, d_k: 4, d_v: 4}
views: {q: d_k, k: d_k, v: d_v}
gates:
  eta: {formula: sigmoid(logit)}
state:
  W: {shape: [d_k, d_v], init: zeros}
let:
  kn: l2norm(k)
model: f(u) = u @ W
loss: 0.5 * sum((f(kn) - v)^2)
update:
  - W = W - eta * grad(loss, W)
read: f(q)
wiring: {kind: WIRING, segment: 3, window: 4, persistent: 2}
"""


class StandInDelta(nn.Module):
    """DeltaNet with the compiled Layer's interface: used when memspec.pipeline.build is unavailable."""

    def __init__(self, d_model: int, heads: int = 2, d: int = 4):
        super().__init__()
        self.h, self.d = heads, d
        self.proj = nn.Linear(d_model, 3 * heads * d, bias=False)
        self.we = nn.Linear(d_model, heads)
        self.wo = nn.Linear(heads * d, d_model, bias=False)

    def forward(self, x, state=None, return_state=False):
        B, T, _ = x.shape
        q, k, v = self.proj(x).view(B, T, 3, self.h, self.d).unbind(2)
        k = nn.functional.normalize(k, dim=-1)
        eta = torch.sigmoid(self.we(x))
        S = state["W"] if state is not None else x.new_zeros(B, self.h, self.d, self.d)
        outs = []
        for t in range(T):
            err = torch.einsum("bhi,bhij->bhj", k[:, t], S) - v[:, t]
            S = S - eta[:, t, :, None, None] * torch.einsum("bhi,bhj->bhij", k[:, t], err)
            outs.append(torch.einsum("bhi,bhij->bhj", q[:, t], S))
        y = self.wo(torch.stack(outs, 1).reshape(B, T, -1))
        return (y, {"W": S}) if return_state else y


def lm_for(wiring: str, *, real: bool = False):
    spec = memspec.loads(DELTANET.replace("WIRING", wiring))
    torch.manual_seed(0)
    make = None if real else (lambda s, d: StandInDelta(d))
    return MemoryLM(spec, vocab_size=11, d_model=8, n_layers=2, make_layer=make, mlp_ratio=2)


def has_build() -> bool:
    try:
        from memspec.pipeline.build import build  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("wiring", ["none", "mac", "mag", "mal"])
def test_decode_token_by_token_equals_forward(wiring):
    lm = lm_for(wiring)
    tokens = torch.randint(0, 11, (2, 10), generator=torch.Generator().manual_seed(3))
    full = lm(tokens)
    state, steps = None, []
    for t in range(tokens.shape[1]):
        logits, state = lm(tokens[:, t:t + 1], state=state, return_state=True)
        steps.append(logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)
    kind = {"none": StandInDelta, "mac": MAC, "mag": MAG, "mal": MAL}[wiring]
    assert all(isinstance(b.mixer, kind) for b in lm.blocks)


@pytest.mark.skipif(not has_build(), reason="memspec.pipeline.build not available yet")
@pytest.mark.parametrize("wiring", ["none", "mac"])
def test_decode_equals_forward_compiled_layer(wiring):
    lm = lm_for(wiring, real=True)
    tokens = torch.randint(0, 11, (2, 7), generator=torch.Generator().manual_seed(4))
    full = lm(tokens)
    _, state = lm(tokens[:, :3], return_state=True)
    steps = [full[:, :3]]
    for t in range(3, 7):
        logits, state = lm(tokens[:, t:t + 1], state=state, return_state=True)
        steps.append(logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)


def test_generate_is_greedy_continuation():
    lm = lm_for("mal")
    prompt = torch.randint(0, 11, (2, 4), generator=torch.Generator().manual_seed(5))
    out = lm.generate(prompt, max_new_tokens=5)
    assert out.shape == (2, 9) and torch.equal(out[:, :4], prompt)
    # every generated token is the argmax of the full forward over what came before
    logits = lm(out[:, :-1])
    torch.testing.assert_close(out[:, 4:], logits[:, 3:].argmax(-1), rtol=0, atol=0)


def test_block_and_tied_head():
    lm = lm_for("none")
    assert lm.head.weight is lm.embed.weight
    assert isinstance(lm.blocks[0], Block) and len(lm.blocks) == 2
    # gradients reach the memory's projections through the inner updates
    tokens = torch.randint(0, 11, (2, 6), generator=torch.Generator().manual_seed(6))
    lm(tokens).logsumexp(-1).sum().backward()
    g = lm.blocks[0].mixer.we.weight.grad
    assert g is not None and g.abs().sum() > 0


@pytest.mark.skipif(not has_build(), reason="memspec.pipeline.build not available yet")
@pytest.mark.parametrize("name", ["titans_mac", "titans_mag", "titans_mal"])
def test_titans_wirings_decode_equals_forward(name):
    """The shipped Titans wirings (mini-batch memory, chunk 4 here) stream exactly through MemoryLM."""
    from pathlib import Path

    spec = memspec.load(str(Path(__file__).resolve().parents[1] / "specs" / f"{name}.yaml"))
    w = spec.wiring.model_copy(update={"segment": 3, "window": 4, "persistent": 2})
    spec = spec.model_copy(update={"wiring": w})
    torch.manual_seed(0)
    lm = MemoryLM(spec, vocab_size=11, d_model=8, n_layers=1, heads=2, d_k=4, d_v=4, hidden=4, chunk=4)
    tokens = torch.randint(0, 11, (2, 9), generator=torch.Generator().manual_seed(7))
    full = lm(tokens)
    state, steps = None, []
    for a, b in [(0, 2), (2, 3), (3, 7), (7, 9)]:
        logits, state = lm(tokens[:, a:b], state=state, return_state=True)
        steps.append(logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)
