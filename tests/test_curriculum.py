"""The curriculum's two MQAR settings (docs/training.md, "A curriculum"): with the gap, a
query is beyond the reach of the 2-layer model whose mixers are 16-token sliding-window
attention (plus the 4-tap short convolutions), so sliding-window attention alone cannot
answer it; within the short setting every pair is in its query's window.  Checked by
perturbation on untrained models, exactly; the specs of every row check clean."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import memspec
from memspec.tools.nn import MemoryLM
from memspec.tools.tasks import MQAR

ROOT = Path(__file__).resolve().parents[1]
CURRICULUM = ROOT / "specs" / "curriculum"
FAR = MQAR(seq_len=52, pairs=4, vocab_size=64, gap=36)
NEAR = MQAR(seq_len=16, pairs=4, vocab_size=64)


def _lm(path, seed=0):
    torch.manual_seed(seed)
    spec = memspec.load(str(path))
    dims = {k: v for k, v in dict(heads=2, d_k=8, d_v=8, hidden=8).items() if k in spec.dims}
    return MemoryLM(spec, vocab_size=64, d_model=16, n_layers=2, **dims).double()


def _query_logits_move(lm, task):
    """Whether the logits at the query positions change when the pairs' tokens change."""
    x, y = task.batch(4, seed=0)
    x2 = x.clone()
    x2[:, :2 * task.pairs] = torch.roll(x[:, :2 * task.pairs], 1, dims=0)   # other sequences' pairs
    asked = y != -100
    with torch.no_grad():
        a, b = lm(x)[asked], lm(x2)[asked]
    return (a - b).abs().max().item()


def test_far_setting_is_beyond_sliding_window_reach():
    assert FAR.n_queries == 4
    x, y = FAR.batch(64, seed=1)
    first_query = (y != -100).float().argmax(1)
    # the last value is at 2 pairs - 1 = 7; two layers of (window 16 + 3 convolution taps) reach 36 back
    assert first_query.min().item() - (2 * FAR.pairs - 1) > 2 * (16 - 1 + 3)
    assert _query_logits_move(_lm(CURRICULUM / "swa16.yaml"), FAR) == 0.0


@pytest.mark.parametrize("name", ["deltanet_mal", "deltanet_mag", "deltanet_mac"])
def test_far_setting_reaches_the_memory_in_every_wiring(name):
    """The same window in a wiring: the memory carries the pairs to the queries."""
    assert _query_logits_move(_lm(CURRICULUM / f"{name}.yaml"), FAR) > 1e-6


def test_near_setting_is_within_the_window():
    x, y = NEAR.batch(64, seed=1)
    last_query = (y != -100).nonzero()[:, 1].max().item()
    assert last_query < 16                                   # every key and value in the query's window
    assert _query_logits_move(_lm(CURRICULUM / "swa16.yaml"), NEAR) > 1e-6


@pytest.mark.parametrize("path", sorted(CURRICULUM.glob("*.yaml")), ids=lambda p: p.stem)
def test_curriculum_specs_check_clean(path):
    from memspec.pipeline.build import load_checked

    checked = load_checked(path)
    spec = checked.spec
    assert not checked.warnings
    assert spec.name == path.stem
    if spec.wiring.kind in ("mag", "mal"):
        assert (spec.wiring.window, spec.wiring.persistent) == (16, 4)
    if spec.wiring.kind == "mac":
        assert (spec.wiring.segment, spec.wiring.persistent) == (16, 4)
