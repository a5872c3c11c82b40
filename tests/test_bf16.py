"""bfloat16: under bf16 inputs or autocast the memory's states and their sums stay float32 (fla's
convention), the output comes back in the inputs' dtype; ``state_dtype`` keeps another dtype.

Tolerance: the bf16 output of a memory, against float64 on the same (bf16-rounded) inputs, is
within 5e-3 in relative Frobenius norm (measured 1.5-1.8e-3 at T = 37: the rounding of the
output to bf16, 2^-9 relative at most per entry); its final state, float32, within 1e-5
(measured about 2e-7).  States kept in bf16 measured 1.9e-3 to 1.4e-2 on the same inputs.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from memspec.pipeline.build import build
from memspec.tools.nn import MemoryLM
from memspec.tools.train import TrainConfig, load_spec, model_dims

SPECS = Path(__file__).resolve().parent.parent / "specs"
FAMILIES = {"cache": "softmax_attention", "additive": "linear_attention", "delta": "deltanet", "dplr": "kda",
            "momentum": "momentum_deltanet", "minibatch": "titans", "online": "omeganet", "wired": "titans_mac",
            "scan": "hgrn", "solve": "mesa", "chained": "gsa", "oja": "gated_oja"}
SHIPPED = sorted(p.stem for p in SPECS.glob("*.yaml"))


def dims(name: str) -> dict:
    """Width 16, 2 heads of 8, chunks of 8 (T = 37 spans several), MAC segments / MAG, MAL windows of 8."""
    spec = load_spec(str(SPECS / f"{name}.yaml"))
    extra = {k: v for k, v in {"hidden": 8, "chunk": 8}.items() if k in spec.dims or k == "chunk"}
    out = model_dims(spec, TrainConfig(d_model=16, heads=2, dims=extra))
    if spec.wiring.kind == "mac":
        out.update(segment=8, persistent=2)
    elif spec.wiring.kind in ("mag", "mal"):
        out.update(window=8, persistent=2)
    return out


def memory_inputs(name: str, T: int = 37):
    """The spec's memory (float64) and the views / gates its layer gives it for a random x (its first call)."""
    torch.manual_seed(0)
    layer = build(SPECS / f"{name}.yaml", compile=False, d_model=16, **dims(name)).double()
    seen = []

    def keep(module, args, kwargs):
        if not seen:
            seen.append((args, {k: v for k, v in kwargs.items() if torch.is_tensor(v)}))   # views, gates

    handle = layer.memory.register_forward_pre_hook(keep, with_kwargs=True)
    layer(torch.randn(2, T, 16, dtype=torch.float64))
    handle.remove()
    return layer.memory, seen[0]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_bf16_states_are_float32_and_the_output_is_close_to_float64(family):
    memory, (args, kwargs) = memory_inputs(FAMILIES[family])
    args16 = [a.to(torch.bfloat16) for a in args]
    kwargs16 = {k: v.to(torch.bfloat16) for k, v in kwargs.items()}
    o64, s64 = memory(*[a.double() for a in args16], **{k: v.double() for k, v in kwargs16.items()})
    memory.float()
    o, s = memory(*args16, **kwargs16)
    assert o.dtype == torch.bfloat16
    floats = {k: v for k, v in s.items() if torch.is_tensor(v) and v.is_floating_point()}
    assert floats and all(v.dtype == torch.float32 for v in floats.values())
    assert rel(o, o64) < 5e-3
    for k, v in floats.items():
        if v.numel():
            assert rel(v, s64[k]) < 1e-5, k
    # decoding continues from the float32 state with a bf16 token
    one = [a[:, :1] for a in args16]
    out, state = memory.step(*one, **{k: v[:, :1] for k, v in kwargs16.items()}, state=s)
    assert out.dtype == torch.bfloat16 and all(state[k].dtype == torch.float32 for k in floats)


def test_state_dtype_keeps_another_dtype():
    memory, (args, kwargs) = memory_inputs("deltanet")
    memory.float().state_dtype = torch.bfloat16
    o, s = memory(*[a.to(torch.bfloat16) for a in args], **{k: v.to(torch.bfloat16) for k, v in kwargs.items()})
    assert o.dtype == s["W"].dtype == torch.bfloat16
    memory.state_dtype = None
    o, s = memory(*args, **kwargs)                               # float64 inputs: float64 all along
    assert o.dtype == s["W"].dtype == torch.float64


@pytest.mark.parametrize("name", SHIPPED)
def test_training_under_autocast_keeps_float32_states(name):
    torch.manual_seed(0)
    lm = MemoryLM(SPECS / f"{name}.yaml", vocab_size=32, d_model=16, n_layers=1, **dims(name))
    states = []
    lm.blocks[0].mixer.memory.register_forward_hook(lambda m, args, out: states.append(out[1]))
    x = torch.randint(0, 32, (2, 21))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = lm(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, 32), x[:, 1:].reshape(-1))
    loss.backward()
    assert logits.dtype == torch.bfloat16 and torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in lm.parameters() if p.grad is not None)
    floats = [v for st in states for v in st.values() if torch.is_tensor(v) and v.is_floating_point()]
    assert floats and all(v.dtype == torch.float32 for v in floats)


def test_hf_model_in_bf16_generates_with_float32_states():
    transformers = pytest.importorskip("transformers")
    assert transformers
    import memspec.hf as H

    torch.manual_seed(0)
    model = H.from_spec(SPECS / "gated_deltanet.yaml", 32, 16, 2, **dims("gated_deltanet")).to(torch.bfloat16).eval()
    out = model(torch.tensor([[1, 2, 3, 4]]))
    assert out.logits.dtype == torch.bfloat16
    (_, states), = out.cache.groups
    assert all(st["mixer"]["W"].dtype == torch.float32 for st in states)
    assert model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False, pad_token_id=0).shape == (1, 7)
