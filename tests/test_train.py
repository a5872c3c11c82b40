"""MQAR data, the training loop (learning, logs, checkpoints), compare, the CLI, DDP equivalence."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import memspec
from memspec.tools.cli import main
from memspec.tools.nn import MemoryLM
from memspec.tools.tasks import MQAR, accuracy
from memspec.tools.train import (TrainConfig, compare, json_table, lr_at, markdown_table, summarize, train,
                                 train_or_diverge)

ROOT = Path(__file__).resolve().parents[1]
DELTANET = str(ROOT / "specs" / "deltanet.yaml")
NO_WRITE = str(ROOT / "specs" / "variants" / "deltanet_no_write.yaml")

TINY = TrainConfig(steps=4, batch=8, seq_len=16, pairs=3, vocab=16, d_model=16, layers=1, heads=2,
                   eval_size=16, warmup=2, progress=False)


# ------------------------------------------------------------------ the task
def test_mqar_layout_and_determinism():
    task = MQAR(seq_len=24, pairs=4, vocab_size=21)
    x, y = task.batch(16, seed=7)
    x2, y2 = task.batch(16, seed=7)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(x, task.batch(16, seed=8)[0])
    assert task.n_keys == 10 and task.n_values == 10 and task.chance == 0.1 and task.n_queries == 4
    for row, tgt in zip(x.tolist(), y.tolist()):
        keys, values = row[0:8:2], row[1:8:2]
        assert len(set(keys)) == 4 and all(1 <= k <= 10 for k in keys) and all(11 <= v <= 20 for v in values)
        pairs = dict(zip(keys, values))
        asked = [i for i, t in enumerate(tgt) if t != -100]
        assert len(asked) == 4 and all(i >= 8 for i in asked)
        for i in asked:
            assert row[i] in pairs and tgt[i] == pairs[row[i]] and row[i + 1] == pairs[row[i]]
        assert len({row[i] for i in asked}) == 4                  # each key asked once
        rest = [row[i] for i in range(8, 24) if i not in asked and i - 1 not in asked]
        assert rest == [0] * len(rest)


def test_mqar_gap_puts_every_query_after_the_pad_gap():
    task = MQAR(seq_len=40, pairs=3, vocab_size=16, gap=20)
    assert task.n_queries == 3 and task.max_queries == 3
    x, y = task.batch(32, seed=3)
    assert (x[:, 6:26] == 0).all()                                # the gap is pads
    asked = (y != -100).nonzero()[:, 1]
    assert asked.min() >= 26 and (asked - 26).remainder(2).eq(0).all()
    # with no gap the layout (and the random stream) is the original one
    assert torch.equal(MQAR(seq_len=24, pairs=4, vocab_size=21, gap=0).batch(4, 7)[0],
                       MQAR(seq_len=24, pairs=4, vocab_size=21).batch(4, 7)[0])
    with pytest.raises(ValueError, match="no room for a query after 3 pairs and a gap of 33"):
        MQAR(seq_len=40, pairs=3, gap=33)


def test_seeds_of_runs_give_different_data():
    """torch's CPU generator keeps only a seed's low 32 bits; the run's seed sits in the
    high bits of the batch seeds, so it is folded in: two runs' batches and held-out sets
    differ, and a seed below 2^32 (every batch of run seed 0) draws what it always did."""
    from memspec.tools.tasks import seed32
    from memspec.tools.train import eval_seed, train_seed

    task = MQAR(seq_len=24, pairs=4, vocab_size=21)
    run0, run1 = TrainConfig(seed=0), TrainConfig(seed=1)
    assert not torch.equal(task.batch(8, train_seed(run0, 3))[0], task.batch(8, train_seed(run1, 3))[0])
    assert not torch.equal(task.batch(8, eval_seed(run0))[0], task.batch(8, eval_seed(run1))[0])
    assert seed32(train_seed(run0, 3)) == 3 and seed32(eval_seed(run0)) == 1 << 31
    g = torch.Generator().manual_seed(3)
    assert torch.equal(task.batch(8, 3)[0][:, 0], (torch.rand(8, task.n_keys, generator=g).argsort(1)[:, 0] + 1))
    for r in range(4):                                           # a run's held-out set is no training batch
        cfg = TrainConfig(seed=r)
        assert seed32(eval_seed(cfg)) not in {seed32(train_seed(cfg, s)) for s in range(10_000)}


def test_mqar_rejects_bad_sizes():
    with pytest.raises(ValueError, match="no room"):
        MQAR(seq_len=10, pairs=5)
    with pytest.raises(ValueError, match="too small"):
        MQAR(seq_len=64, pairs=8, vocab_size=12)


def test_accuracy_counts_only_targets():
    logits = torch.zeros(1, 3, 5)
    logits[0, 0, 2] = logits[0, 1, 4] = logits[0, 2, 1] = 1.0
    assert accuracy(logits, torch.tensor([[2, -100, 3]])) == 0.5


def test_lr_schedule():
    cfg = TrainConfig(steps=10, warmup=2, lr=1.0)
    assert [round(lr_at(s, cfg), 6) for s in (0, 1, 2)] == [0.5, 1.0, 1.0]
    assert lr_at(6, cfg) == pytest.approx(0.5)
    assert lr_at(6, replace(cfg, lr_schedule="constant")) == 1.0


# ------------------------------------------------------------------ training
def test_training_smoke_loss_decreases(tmp_path):
    cfg = replace(TINY, steps=40, lr=1e-2, out=str(tmp_path / "run"))
    r = train(DELTANET, cfg)
    assert len(r.losses) == 40
    assert sum(r.losses[-5:]) / 5 < sum(r.losses[:5]) / 5 - 0.3
    log = json.loads((tmp_path / "run" / "log.json").read_text())
    assert [e["loss"] for e in log["log"]] == r.losses and log["accuracy"] == r.accuracy
    assert log["config"]["steps"] == 40 and log["parameters"] == r.parameters
    ck = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)
    spec = memspec.loads(ck["spec_text"])
    assert spec.name == "deltanet" and spec == memspec.load(DELTANET)
    lm = MemoryLM(spec, vocab_size=16, d_model=16, n_layers=1, heads=2, d_k=8, d_v=8)
    lm.load_state_dict(ck["state_dict"])
    x, y = MQAR(seq_len=16, pairs=3, vocab_size=16).batch(4, seed=1)
    with torch.no_grad():
        assert torch.isfinite(lm(x)).all()


LEARN = replace(TINY, steps=300, batch=32, seq_len=24, pairs=4, vocab=24, d_model=32, layers=1, heads=2,
                lr=5e-3, warmup=20, eval_size=128)


def test_mqar_learning_far_above_chance():
    r = train(DELTANET, LEARN)                  # about 15 s on one CPU thread
    assert r.chance < 0.09
    assert r.accuracy > 0.6, r.accuracy          # measured: 0.99
    assert r.losses[-1] < 0.5 * r.losses[0]


TITANS_MQAR = str(ROOT / "specs" / "variants" / "titans_mqar.yaml")


def test_titans_memory_learns_recall_in_its_minibatch_form():
    """The Titans MLP memory (momentum, forgetting, mini-batch gradients at each chunk's
    start, the dual form) trains through its inner updates to far above chance."""
    r = train(TITANS_MQAR, replace(LEARN, dims={"hidden": 32, "chunk": 8}))
    assert r.schedule == "minibatch(8)"
    assert r.accuracy > 0.6, r.accuracy          # measured: 1.00 (the paper configuration, titans.yaml: 0.29)
    assert r.losses[-1] < 0.5 * r.losses[0]


def test_write_disabled_memory_stays_near_chance():
    r = train(NO_WRITE, LEARN)
    assert r.accuracy < 2.5 * r.chance, r.accuracy


def test_compare_table_and_write_disabled_control():
    cfg = replace(TINY, steps=2)
    results = compare([DELTANET, NO_WRITE], cfg)
    table = markdown_table(results)
    lines = table.splitlines()
    assert lines[0] == "| spec | schedule | parameters | accuracy | tokens/s |"
    assert lines[2].startswith("| deltanet | delta(64) |") and lines[3].startswith("| deltanet_no_write | delta(64) |")
    assert results[0].parameters - results[1].parameters == 2 * 16 + 2   # the eta gate: weight [2, 16], bias [2]
    assert lines[-1] == f"chance accuracy: {results[0].chance:.3f}"


class _NaNLayer(torch.nn.Module):
    """A stand-in memory whose output is NaN: every run with it diverges at step 0."""

    def __init__(self, d_model):
        super().__init__()
        self.w = torch.nn.Linear(d_model, d_model)

    def forward(self, x, state=None, return_state=False):
        y = self.w(x) * float("nan")
        return (y, state) if return_state else y


def test_compare_seeds_same_batches_per_seed_and_summary(monkeypatch):
    """Seed-major runs; for each seed every spec sees exactly the same batches (the seeds
    the task is drawn with are recorded per run); mean / min / max over the seeds."""
    drawn = []
    original = MQAR.batch

    def spy(self, n, seed):
        drawn.append(seed)
        return original(self, n, seed)

    monkeypatch.setattr(MQAR, "batch", spy)
    cfg = replace(TINY, steps=3, seed=5)
    results = compare([DELTANET, NO_WRITE], cfg, seeds=2)
    assert [(r.spec, r.seed) for r in results] == [("deltanet", 5), ("deltanet_no_write", 5),
                                                   ("deltanet", 6), ("deltanet_no_write", 6)]
    per_run = [drawn[i * 4:(i + 1) * 4] for i in range(4)]          # 3 steps + 1 evaluation per run
    assert per_run[0] == per_run[1] and per_run[2] == per_run[3] and per_run[0] != per_run[2]
    assert all(r.wall_seconds >= r.seconds > 0 and r.tokens_per_s > 0 for r in results)
    (d, nw) = summarize(results)
    accs = [r.accuracy for r in results if r.spec == "deltanet"]
    assert d.mean == pytest.approx(sum(accs) / 2) and (d.min, d.max) == (min(accs), max(accs))
    table = markdown_table(results).splitlines()
    assert table[0] == "| spec | schedule | parameters | mean accuracy | min | max | per seed | tokens/s | s / run |"
    assert table[2].startswith(f"| deltanet | delta(64) | {d.parameters:,} | {d.mean:.3f} | {d.min:.3f} | "
                               f"{d.max:.3f} | {accs[0]:.3f} / {accs[1]:.3f} |")
    assert table[-1] == f"chance accuracy: {d.chance:.3f}; seeds 5, 6"
    record = json.loads(json_table(results, cfg))
    assert record["seeds"] == [5, 6] and record["config"]["steps"] == 3
    row = record["rows"][0]
    assert row["spec"] == "deltanet" and row["accuracy"]["mean"] == pytest.approx(d.mean)
    assert [r["seed"] for r in row["runs"]] == [5, 6] and [r["accuracy"] for r in row["runs"]] == accs


def test_diverged_run_is_recorded_not_fatal():
    r = train_or_diverge(DELTANET, TINY, make_layer=lambda spec, d: _NaNLayer(d), name="nan")
    assert r.diverged == "loss is nan at step 0" and r.accuracy != r.accuracy
    ok = train(DELTANET, TINY)
    table = markdown_table([r, ok, replace(r, seed=1), replace(ok, seed=1)])
    assert "| nan | delta(64) | 0 | NaN | NaN | NaN | NaN / NaN (seed 0 diverged: loss is nan at step 0; " \
           "seed 1 diverged: loss is nan at step 0) |" in table
    assert json.loads(json_table([r]))["rows"][0]["runs"][0]["diverged"] == "loss is nan at step 0"


# ------------------------------------------------------------------ command line
def test_cli_train_writes_log(tmp_path, capsys):
    out = tmp_path / "cli"
    rc = main(["train", DELTANET, "--steps", "2", "--batch", "4", "--seq-len", "12", "--pairs", "2",
               "--vocab", "12", "--d-model", "8", "--layers", "1", "--heads", "2", "--eval-size", "4",
               "--no-progress", "--out", str(out)])
    assert rc == 0
    assert "deltanet: schedule delta(64)" in capsys.readouterr().out
    log = json.loads((out / "log.json").read_text())
    assert len(log["log"]) == 2 and log["seed"] == 0
    assert log["wall_seconds"] >= log["seconds"] > 0 and log["tokens_per_s"] > 0


def test_cli_compare_seeds_writes_markdown_json_and_run_logs(tmp_path, capsys):
    out = tmp_path / "cmp"
    rc = main(["compare", DELTANET, NO_WRITE, "--seeds", "2", "--seed", "3", "--steps", "2", "--batch", "4",
               "--seq-len", "16", "--pairs", "2", "--gap", "4", "--vocab", "12", "--d-model", "8", "--layers", "1",
               "--heads", "2", "--eval-size", "4", "--no-progress", "--out", str(out),
               "--json", str(tmp_path / "t.json")])
    assert rc == 0
    printed = capsys.readouterr().out
    assert printed == (out / "table.md").read_text() and "seeds 3, 4" in printed
    record = json.loads((out / "table.json").read_text())
    assert record == json.loads((tmp_path / "t.json").read_text())
    assert record["config"]["gap"] == 4 and [r["spec"] for r in record["rows"]] == ["deltanet", "deltanet_no_write"]
    lines = [json.loads(x) for x in (out / "runs.jsonl").read_text().splitlines()]
    assert [(x["spec"], x["seed"]) for x in lines] == [("deltanet", 3), ("deltanet_no_write", 3),
                                                       ("deltanet", 4), ("deltanet_no_write", 4)]
    log = json.loads((out / "deltanet" / "seed4" / "log.json").read_text())
    assert log["seed"] == 4 and log["config"]["gap"] == 4 and log["wall_seconds"] > 0
    assert main(["compare", DELTANET, "--seeds", "0"]) == 2
    assert "--seeds must be >= 1" in capsys.readouterr().err


def test_cli_bad_input_no_traceback(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nviews: {q: d_k}\nread: f(qq)\n")
    assert main(["train", str(bad), "--steps", "1"]) == 1
    err = capsys.readouterr().err
    assert "bad.yaml:" in err and "error" in err and "Traceback" not in err
    assert main(["train", DELTANET, "--seq-len", "8", "--pairs", "8"]) == 2
    assert "no room" in capsys.readouterr().err
    assert main(["train", DELTANET, "--steps", "0"]) == 2
    assert "--steps must be >= 1" in capsys.readouterr().err
    assert main(["compare", DELTANET, str(tmp_path / "missing.yaml")]) == 1
    assert "missing.yaml" in capsys.readouterr().err


# ------------------------------------------------------------------ DDP
def _torchrun_train(spec: str, args: list, out, timeout: int) -> dict:
    """``torchrun --nproc-per-node 2 -m memspec train SPEC ARGS --out OUT`` (one thread per process);
    its log.json."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "memspec", "train", spec, *args, "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "log.json").read_text())


def test_ddp_two_processes_match_one(tmp_path):
    """torchrun --nproc-per-node 2 gives the loss curve of one process with the same global batch."""
    args = ["--steps", "4", "--batch", "8", "--seq-len", "16", "--pairs", "3", "--vocab", "16",
            "--d-model", "16", "--layers", "1", "--heads", "2", "--eval-size", "16", "--no-progress"]
    ddp = _torchrun_train(DELTANET, args, tmp_path / "ddp", timeout=300)
    assert ddp["world_size"] == 2
    one = train(DELTANET, replace(TINY, warmup=20))
    torch.testing.assert_close(torch.tensor([e["loss"] for e in ddp["log"]]), torch.tensor(one.losses),
                               rtol=1e-5, atol=1e-6)
    assert abs(ddp["accuracy"] - one.accuracy) < 1e-9


@pytest.mark.slow
def test_ddp_with_recomputed_chunks(tmp_path):
    """Sequences past 256 tokens recompute their per-token states in the backward (the memory's
    checkpoint option): under torchrun the chunks stay non-reentrant, and DDP trains."""
    spec = str(ROOT / "specs" / "hope_cms.yaml")
    args = ["--steps", "2", "--batch", "2", "--seq-len", "300", "--pairs", "3", "--vocab", "16",
            "--d-model", "16", "--layers", "1", "--heads", "2", "--eval-size", "4", "--no-progress",
            "--dim", "d_k=4"]
    log = _torchrun_train(spec, args, tmp_path / "ddp", timeout=600)
    assert log["world_size"] == 2 and all(math.isfinite(e["loss"]) for e in log["log"])
