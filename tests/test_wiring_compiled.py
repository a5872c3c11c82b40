"""The spec's wiring compiled into the generated Layer: ``memspec.pipeline.build`` of a Titans
MAC / MAG / MAL spec returns the wired layer (the wiring classes copied into the
standalone module), causal by perturbation and streaming exactly."""
from __future__ import annotations

import ast
import importlib.util
import inspect
from pathlib import Path

import pytest
import torch

import memspec
from memspec.runtime import wiring
from memspec.pipeline.build import build
from memspec.tools.nn import MemoryLM

ROOT = Path(__file__).resolve().parents[1]
KINDS = {"titans_mac": "MAC", "titans_mag": "MAG", "titans_mal": "MAL"}
DIMS = dict(d_model=8, heads=2, d_k=4, d_v=4, hidden=4, chunk=4)


def small_spec(name):
    """The shipped spec with a short segment / window, so that a few tokens cross several."""
    spec = memspec.load(str(ROOT / "specs" / f"{name}.yaml"))
    w = spec.wiring.model_copy(update={"segment": 3, "window": 4, "persistent": 2})
    return spec.model_copy(update={"wiring": w})


def wired(name, seed=0, **options):
    torch.manual_seed(seed)
    return build(small_spec(name), compile=False, **DIMS, **options).double()


# the spec's options (the paper's forms) and the other value of each, passed to build
OPTIONED = [("titans_mac", {}), ("titans_mac", {"write": "input", "output": "additive", "qk_norm": False}),
            ("titans_mag", {}), ("titans_mag", {"gate": "convex", "qk_norm": False}),
            ("titans_mal", {}), ("titans_mal", {"residual": False, "qk_norm": False})]
OPTIONED_IDS = [n + "".join(f"-{k}={v}" for k, v in o.items()) for n, o in OPTIONED]


def x_of(B=2, T=11, seed=1):
    return torch.randn(B, T, DIMS["d_model"], generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_build_titans_mac_is_the_wired_layer():
    layer = build("specs/titans_mac.yaml", compile=False, **DIMS)
    cls = type(layer)
    assert cls.__name__ == "TitansMacLayer"
    bases = {c.__name__: c for c in cls.__mro__}
    assert "MAC" in bases and bases["MAC"] is not wiring.MAC          # the generated module's own copy
    # the generated module's source holds the MAC class exactly as memspec.runtime.wiring writes it
    module_text = inspect.getsource(inspect.getmodule(cls))
    assert inspect.getsource(wiring.MAC) in module_text
    assert inspect.getsource(wiring.Attention) in module_text
    assert "class SlidingWindowAttention" not in module_text          # only what MAC needs
    assert type(layer.layer).__name__ == "TitansMacMemoryLayer"
    assert type(layer.memory).__name__ == "TitansMacMemory" and layer.memory is layer.layer.memory
    assert layer.segment == 128 and layer.attn.n_persistent == 16     # the spec's wiring
    assert layer.attn.heads == 2 and layer.d_model == 8
    names = {n for n, _ in layer.named_parameters()}
    assert "attn.persistent" in names and "layer.q_proj.weight" in names


def test_build_takes_the_wiring_sizes():
    mac = build("specs/titans_mac.yaml", compile=False, segment=5, persistent=0, attn_heads=1, **DIMS)
    assert mac.segment == 5 and mac.attn.n_persistent == 0 and mac.attn.heads == 1
    mag = build("specs/titans_mag.yaml", compile=False, window=7, persistent=3, **DIMS)
    assert mag.attn.n_persistent == 3
    assert any(getattr(m, "window", None) == 7 for m in mag.modules())
    with pytest.raises(ValueError, match="unknown dims window.*and chunk, segment, persistent, attn_heads"):
        build("specs/titans_mac.yaml", compile=False, window=7, **DIMS)
    with pytest.raises(ValueError, match="unknown dims segment"):
        build("specs/titans.yaml", compile=False, segment=7, **DIMS)


def test_build_takes_the_wiring_options():
    mac = build("specs/titans_mac.yaml", compile=False, write="input", output="additive", qk_norm=False, **DIMS)
    assert (mac.write, mac.output, mac.attn.qk_norm) == ("input", "additive", False)
    spec_default = build("specs/titans_mac.yaml", compile=False, **DIMS)
    assert (spec_default.write, spec_default.output, spec_default.attn.qk_norm) == ("attention", "gated", True)
    assert build("specs/titans_mag.yaml", compile=False, gate="convex", **DIMS).gate_form == "convex"
    assert build("specs/titans_mal.yaml", compile=False, residual=False, **DIMS).residual is False
    with pytest.raises(ValueError, match="unknown dims gate"):
        build("specs/titans_mal.yaml", compile=False, gate="convex", **DIMS)
    with pytest.raises(ValueError, match="wiring option write: Input should be 'attention' or 'input'"):
        build("specs/titans_mac.yaml", compile=False, write="both", **DIMS)
    with pytest.raises(ValueError, match="wiring option residual: expected true or false"):
        build("specs/titans_mal.yaml", compile=False, residual="no", **DIMS)


@pytest.mark.parametrize("name,options", OPTIONED, ids=OPTIONED_IDS)
def test_wired_layer_is_causal_by_perturbation(name, options):
    layer = wired(name, **options)
    x = x_of()
    y = layer(x)
    assert y.shape == x.shape
    for t in (1, 4, 7):
        x2 = x.clone()
        x2[:, t:] += torch.randn(x2[:, t:].shape, generator=torch.Generator().manual_seed(t), dtype=x.dtype)
        y2 = layer(x2)
        assert torch.equal(y2[:, :t], y[:, :t]), (name, t)
        assert (y2[:, t:] - y[:, t:]).abs().max() > 1e-6                 # the perturbation reaches later outputs


@pytest.mark.parametrize("name,options", OPTIONED, ids=OPTIONED_IDS)
@pytest.mark.parametrize("split", [5, 1, 7])
def test_wired_layer_streams_exactly(name, options, split):
    layer = wired(name, **options)
    x = x_of()
    full = layer(x)
    a, st = layer(x[:, :split], return_state=True)
    b = layer(x[:, split:], state=st)
    torch.testing.assert_close(torch.cat([a, b], 1), full, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", sorted(KINDS))
def test_generated_file_is_standalone_and_wired(name, tmp_path):
    path = ROOT / "compiled" / f"{name}.py"
    text = path.read_text(encoding="utf-8")
    imported = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            imported |= {n.name.split(".")[0] for n in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module.split(".")[0])
    assert imported <= {"torch", "math", "time", "warnings"} and "torch" in imported
    kind = KINDS[name]
    cname = "".join(p.capitalize() for p in name.split("_"))
    assert f"class {cname}Layer({kind}):" in text and f"class {kind}(nn.Module):" in text
    assert inspect.getsource(getattr(wiring, kind)) in text
    # a copy of the file, loaded outside memspec, builds the same layer as memspec.pipeline.build
    copy = tmp_path / f"{name}_copy.py"
    copy.write_text(text, encoding="utf-8")
    spec = importlib.util.spec_from_file_location(f"{name}_copy", copy)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch.manual_seed(0)
    ours = getattr(mod, f"{cname}Layer")(**DIMS).double()
    torch.manual_seed(0)
    ref = build(f"specs/{name}.yaml", compile=False, **DIMS).double()
    assert type(ours).__name__ == type(ref).__name__
    x = x_of(T=9)
    torch.testing.assert_close(ours(x), ref(x), rtol=0, atol=0)


def test_memory_lm_does_not_wrap_twice():
    torch.manual_seed(0)
    lm = MemoryLM(small_spec("titans_mal"), vocab_size=11, d_model=8, n_layers=1, heads=2, d_k=4, d_v=4,
                  hidden=4, chunk=4)
    mixer = lm.blocks[0].mixer
    assert type(mixer).__name__ == "TitansMalLayer"
    assert type(mixer.layer).__name__ == "TitansMalMemoryLayer"
    assert sum(1 for m in lm.modules() if type(m).__name__ == "SlidingWindowAttention") == 1
