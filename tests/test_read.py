"""The read-only call of generated modules: ``Memory.read(views, state=...)`` and
``Layer.read(x, state)`` (used by MAC's retrieval) equal the read inside ``forward``."""
from pathlib import Path

import pytest
import torch

import memspec
from memspec.pipeline.build import build, build_memory

ROOT = Path(__file__).resolve().parent.parent
SPECS = sorted(p.stem for p in (ROOT / "specs").glob("*.yaml"))
DIMS = {"d_k": 4, "d_v": 4, "hidden": 6, "heads": 2, "d_model": 8}


def small(name):
    spec = memspec.load(ROOT / f"specs/{name}.yaml")
    return spec, {k: v for k, v in DIMS.items() if k in spec.dims or k == "heads"}


@pytest.mark.parametrize("name", SPECS)
def test_read_equals_the_read_inside_forward(name):
    spec, dims = small(name)
    torch.manual_seed(0)
    mem = build_memory(spec, compile=False, **{k: v for k, v in dims.items() if k != "d_model"}).double()
    if not hasattr(mem, "read"):
        assert any(st.cache for st in spec.state.values()) or spec.gates, name
        pytest.skip("the read needs a gate or a cache")
    B, T, H = 2, 5, dims["heads"]
    views = {v: torch.randn(B, T, H, getattr(mem, spec.views[v].dim), dtype=torch.float64) for v in spec.views}
    gates = {g: 0.5 * torch.rand(B, T, H, *(getattr(mem, d) for d in gt.shape), dtype=torch.float64)
             for g, gt in spec.gates.items()}
    state = mem.init_state(B, dtype=torch.float64)
    used = [v for v in mem.read.__code__.co_varnames[1:mem.read.__code__.co_argcount]]
    for t in range(T):
        one = {v: x[:, t:t + 1] for v, x in views.items()}
        o, new = mem(*one.values(), **{g: x[:, t:t + 1] for g, x in gates.items()}, state=state, schedule="online")
        seen = new if spec.order == "write_read" else state
        r = mem.read(*(one[v] for v in used), state=seen)
        torch.testing.assert_close(r, o, rtol=1e-12, atol=1e-12)
        state = new


def test_layer_read_and_mac_retrieval_use_no_write():
    torch.manual_seed(0)
    layer = build("specs/titans_mac.yaml", compile=False, d_model=8, heads=2, d_k=4, d_v=4, hidden=6,
                  chunk=4, segment=3, persistent=1).double()
    x = torch.randn(2, 7, 8, dtype=torch.float64)
    inner = layer.layer
    st = inner.memory.init_state(2, dtype=torch.float64)
    _, st = inner(x[:, :3], state=st, return_state=True)
    r = inner.read(x[:, 3:6], st)
    # every token reads the same state: reversing the tokens reverses the reads
    r_again = inner.read(x[:, 3:6].flip(1), st).flip(1)
    torch.testing.assert_close(r, r_again)            # token-wise: order inside the call is irrelevant
    assert layer.retrieve(x[:, 3:6], st).shape == (2, 3, 8)
    torch.testing.assert_close(layer.retrieve(x[:, 3:6], st), r)
