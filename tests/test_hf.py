"""memspec.hf: a spec as a transformers causal LM; `memspec export`; generation through the cache."""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from close import assert_same_function
from transformers.utils import logging as hf_logging

import memspec.hf as H
from memspec.hf import export
from memspec.hf.folder import ALLOWED_IMPORTS
from memspec.tools.cli import main
from memspec.tools.nn import MemoryLM
from memspec.tools.train import TrainConfig, load_spec, model_dims

hf_logging.disable_progress_bar()
ROOT = Path(__file__).resolve().parent.parent
SPECS = ROOT / "specs"
VOCAB = 32
# one spec per schedule family, and a wired one
FAMILIES = {"cache": "softmax_attention", "additive": "linear_attention", "delta": "deltanet", "dplr": "kda",
            "momentum": "momentum_deltanet", "minibatch": "titans", "online": "omeganet", "scan": "hgrn",
            "solve": "mesa", "chained": "gsa", "oja": "gated_oja", "wired": "titans_mac"}


def dims(name: str) -> dict:
    """Tiny build-time dims: width 16, 2 heads of 8, chunks of 4 (a prompt spans several), MAC segments of 4."""
    spec = load_spec(str(SPECS / f"{name}.yaml"))
    extra = {k: v for k, v in {"hidden": 8, "chunk": 4}.items() if k in spec.dims or k == "chunk"}
    out = model_dims(spec, TrainConfig(d_model=16, heads=2, dims=extra))
    if spec.wiring.kind == "mac":
        out.update(segment=4, persistent=2)
    elif spec.wiring.kind in ("mag", "mal"):
        out.update(window=4, persistent=2)
    return out


def model(name: str, layers: int = 2, dtype=torch.float64, seed: int = 0) -> H.MemspecForCausalLM:
    torch.manual_seed(seed)
    m = H.from_spec(SPECS / f"{name}.yaml", VOCAB, 16, layers, **dims(name))
    return m.to(dtype).eval()


def greedy_by_full_forwards(m, prompt: torch.Tensor, n: int) -> torch.Tensor:
    seq = prompt
    for _ in range(n):
        nxt = m(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
    return seq


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_generation_through_the_cache_equals_full_forwards(family):
    m = model(FAMILIES[family])
    prompt = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1))   # 0 is the pad
    out = m.generate(prompt, max_new_tokens=7, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 13)
    assert torch.equal(out, greedy_by_full_forwards(m, prompt, 7))


def test_decoding_runs_the_step_schedule_one_token_at_a_time():
    m = model("deltanet", layers=1)
    memory = m.blocks[0].mixer.memory
    seen = []
    memory.register_forward_pre_hook(lambda mod, args, kw: seen.append((args[0].shape[1], kw.get("schedule"))),
                                     with_kwargs=True)
    m.generate(torch.tensor([[1, 2, 3, 4, 5]]), max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert seen[0] == (5, None)                                            # the prompt: the default schedule
    assert seen[1:] == [(1, memory.STEP_SCHEDULE)] * 2                      # then step()'s, one token per call
    assert memory.STEP_SCHEDULE == "online" and memory.DEFAULT_SCHEDULE == "delta"


def test_sampling_through_the_cache_equals_sampling_with_full_forwards():
    m = model("gated_deltanet")
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    torch.manual_seed(7)
    cached = m.generate(prompt, max_new_tokens=8, do_sample=True, top_k=0, pad_token_id=0)
    torch.manual_seed(7)
    full = m.generate(prompt, max_new_tokens=8, do_sample=True, top_k=0, pad_token_id=0, use_cache=False)
    torch.manual_seed(8)
    other = m.generate(prompt, max_new_tokens=8, do_sample=True, top_k=0, pad_token_id=0)
    assert torch.equal(cached, full)
    assert not torch.equal(cached, other)


@pytest.mark.parametrize("name", ["deltanet", "softmax_attention", "titans_mac"])
def test_batched_generation_with_left_padding_equals_one_by_one(name):
    m = model(name)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, VOCAB, (1, n), generator=g) for n in (6, 3, 6, 5)]
    width = max(p.shape[1] for p in prompts)
    batch = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(batch)
    for i, p in enumerate(prompts):
        batch[i, width - p.shape[1]:], mask[i, width - p.shape[1]:] = p, 1
    out = m.generate(batch, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    for i, p in enumerate(prompts):
        alone = m.generate(p, max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(out[i, width - p.shape[1]:], alone[0])
    # a padded row's logits at its tokens are its own, whatever the other rows hold
    logits = m(batch, attention_mask=mask, use_cache=False).logits
    assert_same_function(logits[1, 3:], m(prompts[1], use_cache=False).logits[0])
    assert torch.equal(logits[1, :3], torch.zeros_like(logits[1, :3]))


def test_attention_mask_errors():
    m = model("deltanet", layers=1)
    x = torch.randint(0, VOCAB, (2, 4))
    with pytest.raises(ValueError, match="only left padding"):
        m(x, attention_mask=torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]))
    with pytest.raises(ValueError, match=r"expected \[batch, past \+ new tokens\] = \[2, 4\]"):
        m(x, attention_mask=torch.ones(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="no token"):
        m(x, attention_mask=torch.tensor([[0, 0, 0, 0], [1, 1, 1, 1]]))
    with pytest.raises(ValueError, match="exactly one of input_ids"):
        m()


def test_cache_holds_every_block_state_and_reorders_rows():
    m = model("titans_mac")
    x = torch.randint(0, VOCAB, (3, 6), generator=torch.Generator().manual_seed(3))
    out = m(x[:, :5])
    cache = out.cache
    assert isinstance(cache, H.MemspecCache) and cache.get_seq_length() == 5 and len(cache) == 2
    (rows, states), = cache.groups
    assert rows.tolist() == [0, 1, 2] and all(set(s) == {"mixer", "conv"} for s in states)
    assert {"mem", "start", "hk", "hv", "xk", "xv"} <= set(states[0]["mixer"])   # the MAC attention's keys too
    cache.reorder_cache(torch.tensor([2, 2, 0]))
    step = m(x[:, 5:6], cache=cache).logits[:, -1]
    full = m(x[[2, 2, 0]][:, :5].clone(), use_cache=False)
    expected = m(torch.cat([x[[2, 2, 0], :5], x[:, 5:6]], 1), use_cache=False).logits[:, -1]
    assert full.logits.shape == (3, 5, VOCAB)
    assert_same_function(step, expected)


def test_labels_give_the_shifted_causal_loss():
    m = model("linear_attention", dtype=torch.float32)
    x = torch.randint(0, VOCAB, (2, 7))
    labels = x.clone()
    labels[0, :3] = -100
    out = m(x, labels=labels)
    expected = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1),
                                                 ignore_index=-100)
    assert_same_function(out.loss, expected)
    out.loss.backward()
    assert m.blocks[0].mixer.q_proj.weight.grad is not None


def test_a_memory_lm_becomes_the_same_model():
    torch.manual_seed(0)
    d = dims("gla")
    lm = MemoryLM(SPECS / "gla.yaml", vocab_size=VOCAB, d_model=16, n_layers=2, **d).double()
    m = H.from_memory_lm(lm, **d).double()
    x = torch.randint(0, VOCAB, (2, 9))
    assert_same_function(m(x, use_cache=False).logits, lm(x))   # the HF model's own block loop
    assert m.head.weight is m.embed.weight


def test_save_load_round_trip_is_exact(tmp_path):
    m = model("kda", dtype=torch.float32)
    m.save_pretrained(tmp_path)
    loaded = H.MemspecForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.spec == m.config.spec and loaded.config.layer_dims == m.config.layer_dims
    a, b = m.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    x = torch.randint(0, VOCAB, (2, 9))
    assert torch.equal(loaded(x).logits, m(x).logits)


LOADER = """
import sys
class NoMemspec:
    def find_spec(self, name, path=None, target=None):
        if name == "memspec" or name.startswith("memspec."):
            raise ImportError("memspec is not installed here")
sys.meta_path.insert(0, NoMemspec())
sys.path = [p for p in sys.path if p.rstrip("/") not in (ROOT, "")]
import torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
x = torch.load(sys.argv[2])
out = {"logits": model(x, use_cache=False).logits,
       "generated": model.generate(x, max_new_tokens=5, do_sample=False, pad_token_id=0),
       "memspec_modules": [k for k in sys.modules if k.split(".")[0] == "memspec"]}
torch.save(out, sys.argv[3])
"""


@pytest.mark.parametrize("name", ["deltanet", "titans_mac"])
def test_exported_folder_loads_without_memspec(tmp_path, name):
    torch.manual_seed(0)
    folder = export(SPECS / f"{name}.yaml", tmp_path / "model", vocab_size=VOCAB, d_model=16, n_layers=2,
                    **dims(name))
    assert {p.name for p in folder.iterdir()} >= {"config.json", "modeling_memspec.py", f"{name}.py",
                                                  "model.safetensors"}
    config = json.loads((folder / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_memspec.MemspecForCausalLM"
    for node in ast.walk(ast.parse((folder / "modeling_memspec.py").read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            assert node.module == name                                     # the compiled module next to it
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            assert all(m.split(".")[0] in ALLOWED_IMPORTS for m in mods), mods
    x = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(4))
    torch.save(x, tmp_path / "x.pt")
    here = H.MemspecForCausalLM.from_pretrained(folder).eval()
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": ""}
    script = LOADER.replace("ROOT", repr(str(ROOT)))
    subprocess.run([sys.executable, "-c", script, str(folder), str(tmp_path / "x.pt"), str(tmp_path / "out.pt")],
                   check=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = torch.load(tmp_path / "out.pt")
    assert out["memspec_modules"] == []
    assert_same_function(out["logits"], here(x, use_cache=False).logits)
    assert torch.equal(out["generated"], here.generate(x, max_new_tokens=5, do_sample=False, pad_token_id=0))


def test_export_cli(tmp_path, capsys):
    assert main(["export", str(SPECS / "linear_attention.yaml"), str(tmp_path / "m"), "--d-model", "16",
                 "--heads", "2", "--layers", "1", "--vocab", "40"]) == 0
    assert "from_pretrained" in capsys.readouterr().out
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert (config["vocab_size"], config["hidden_size"], config["num_hidden_layers"]) == (40, 16, 1)
    assert config["layer_dims"] == {"heads": 2, "d_k": 8, "d_v": 8}
    assert main(["export", str(SPECS / "linear_attention.yaml"), str(tmp_path / "m"), "--heads", "3"]) == 2
    assert "not divisible" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\n")
    assert main(["export", str(bad), str(tmp_path / "b")]) == 1


def test_beam_search_reorders_the_cache():
    m = model("deltanet")
    prompt = torch.tensor([[3, 4, 5, 6], [7, 8, 9, 10]])
    beams = m.generate(prompt, max_new_tokens=5, num_beams=3, do_sample=False, pad_token_id=0)
    full = m.generate(prompt, max_new_tokens=5, num_beams=3, do_sample=False, pad_token_id=0, use_cache=False)
    assert torch.equal(beams, full)


def test_a_foreign_cache_is_refused():
    from transformers import DynamicCache

    m = model("deltanet", layers=1)
    with pytest.raises(ValueError, match="expected a MemspecCache"):
        m(torch.tensor([[1, 2]]), cache=DynamicCache())


def test_train_save_hf_writes_the_trained_model(tmp_path):
    from memspec.tools.train import train

    cfg = TrainConfig(task="mqar", steps=3, batch=4, seq_len=24, pairs=4, vocab=VOCAB, d_model=16, heads=2,
                      layers=1, eval_size=4, progress=False, out=str(tmp_path / "run"), save_hf=str(tmp_path / "hf"))
    train(SPECS / "gated_deltanet.yaml", cfg)
    trained = H.MemspecForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert (tmp_path / "hf" / "gated_deltanet.py").exists() and (tmp_path / "hf" / "modeling_memspec.py").exists()
    lm = MemoryLM(SPECS / "gated_deltanet.yaml", vocab_size=VOCAB, d_model=16, n_layers=1, **trained.config.layer_dims)
    lm.load_state_dict(torch.load(tmp_path / "run" / "checkpoint.pt")["state_dict"])
    x = torch.randint(1, VOCAB, (2, 10))
    assert_same_function(trained(x, use_cache=False).logits, lm(x))   # the HF model's own block loop


def _random_initial_state(name: str) -> bool:
    """A state drawn at random at every call (e.g. ``normal(1.0)``): no two forwards agree."""
    return any(str(st.init).startswith(("normal", "uniform")) for st in load_spec(str(SPECS / f"{name}.yaml")).state.values())


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(p.stem for p in SPECS.glob("*.yaml")))
def test_greedy_generation_equals_full_forwards_for_every_shipped_spec(name):
    if _random_initial_state(name):
        pytest.skip(f"{name} draws its initial state at random at every call")
    m = model(name)
    prompt = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1))
    out = m.generate(prompt, max_new_tokens=7, do_sample=False, pad_token_id=0)
    assert torch.equal(out, greedy_by_full_forwards(m, prompt, 7))
