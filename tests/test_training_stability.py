"""Every shipped spec trains: finite outputs at initialisation, finite losses and gradients over a
few outer steps, on real text (bytes of the running Python's standard library) and on MQAR.

Every spec under specs/ is here, variants and curriculum included (the lab's specs are the seed
course's experiments, not memories for a language model).  The budget is tiny (small dims, one
layer, a few AdamW steps); ``benchmarks/stability.py`` runs the larger check (d_model 128, two
layers, 16 windows of 256 bytes) that found the divergences this guards against.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import memspec
from memspec.tools.nn import MemoryLM
from memspec.tools.tasks import MQAR, TextTask

ROOT = Path(__file__).resolve().parent.parent
SPECS = sorted(p.relative_to(ROOT).as_posix() for d in ("specs", "specs/variants", "specs/curriculum")
               for p in (ROOT / d).glob("*.yaml"))
SMALL = {"heads": 2, "d_k": 16, "d_v": 16, "hidden": 32}


def _lm(spec, vocab: int) -> MemoryLM:
    dims = {k: v for k, v in SMALL.items() if k in spec.dims}
    torch.manual_seed(0)
    return MemoryLM(spec, vocab_size=vocab, d_model=32, n_layers=1, **dims)


def _steps(lm, batches) -> list[float]:
    """AdamW steps on the batches; each loss and every gradient must be finite."""
    opt = torch.optim.AdamW(lm.parameters(), lr=3e-3)
    losses = []
    for x, y in batches:
        logits = lm(x)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                                                 ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        bad = [n for n, p in lm.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
        assert math.isfinite(loss.item()) and not bad, (loss.item(), bad[:3])
        losses.append(loss.item())
        opt.step()
    return losses


@pytest.mark.parametrize("path", SPECS)
def test_trains_on_real_text_and_mqar(path):
    spec = memspec.load(ROOT / path)
    text = TextTask(seq_len=128)
    lm = _lm(spec, text.vocab_size)
    x, _ = text.batch(4, seed=0)
    with torch.no_grad():
        assert torch.isfinite(lm(x)).all(), "non-finite outputs at initialisation"
    losses = _steps(lm, [text.batch(4, seed=1 + i) for i in range(3)])
    assert losses[-1] < math.log(256) + 0.5    # learning, not blowing up
    task = MQAR(seq_len=64, pairs=8, vocab_size=64)
    _steps(_lm(spec, task.vocab_size), [task.batch(4, seed=10 + i) for i in range(2)])
