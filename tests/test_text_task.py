"""The real-text task: a byte-level LM on the text files of a folder, held out by file."""
from __future__ import annotations

import math
import sysconfig
from pathlib import Path

import pytest
import torch

from memspec.tools.cli import main
from memspec.tools.tasks import TextTask, bits_per_byte, corpus_files, held_out
from memspec.tools.train import TrainConfig, markdown_table, train

SPECS = Path(__file__).resolve().parent.parent / "specs"


@pytest.fixture()
def corpus(tmp_path):
    """Twelve text files (each a distinct repeated marker), a binary file, a hidden folder."""
    for i in range(12):
        sub = tmp_path / ("sub" if i % 2 else "")
        sub.mkdir(exist_ok=True)
        (sub / f"f{i:02d}.txt").write_bytes((f"<file {i:02d}>" * 40).encode())
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01\x02" * 100)
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    return tmp_path


def test_batches_are_deterministic_in_the_seed(corpus):
    task = TextTask(data_dir=corpus, seq_len=16)
    x1, y1 = task.batch(8, 3)
    x2, y2 = task.batch(8, 3)
    x3, _ = task.batch(8, 4)
    assert x1.dtype == y1.dtype == torch.int64 and x1.shape == y1.shape == (8, 16)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not torch.equal(x1, x3)
    assert torch.equal(x1[:, 1:], y1[:, :-1])                     # targets: the next byte
    assert int(x1.min()) >= 0 and int(x1.max()) < 256


def test_split_by_file_never_overlaps(corpus):
    files = corpus_files(corpus)
    assert files == sorted(f"{'sub/' if i % 2 else ''}f{i:02d}.txt" for i in range(12))   # no binary, no hidden
    train_task, test_task = TextTask(data_dir=corpus, split="train"), TextTask(data_dir=corpus, split="test")
    assert test_task.files and train_task.files
    assert not set(train_task.files) & set(test_task.files)
    assert sorted(train_task.files + test_task.files) == files
    train_bytes = bytes(train_task.data.tolist())
    for name in test_task.files:                                     # no held-out marker in the training bytes
        marker = f"<file {name[-6:-4]}>".encode()
        assert marker not in train_bytes
        assert marker in bytes(test_task.data.tolist())
    x, _ = train_task.batch(64, 0)
    for row in x.tolist():
        assert bytes(row) in train_bytes


def test_held_out_is_a_function_of_the_path():
    names = [f"pkg/mod{i}.py" for i in range(2000)]
    picked = [n for n in names if held_out(n, 5)]
    assert picked == [n for n in names if held_out(n, 5)]
    assert 50 < len(picked) < 150                                   # about 5 %
    assert set(picked) <= {n for n in names if held_out(n, 10)}      # a larger share only adds files


def test_default_corpus_is_the_standard_library():
    root = Path(sysconfig.get_paths()["stdlib"])
    task = TextTask(seq_len=32, split="test")
    assert task.files and all(f.endswith(".py") and "site-packages" not in f for f in task.files)
    assert (root / task.files[0]).read_bytes() == bytes(task.data[:(root / task.files[0]).stat().st_size].tolist())
    assert any(f == "os.py" for f in TextTask(seq_len=32).files + task.files)


def test_bad_inputs(corpus, tmp_path):
    with pytest.raises(ValueError, match="not a folder"):
        TextTask(data_dir=tmp_path / "nope")
    with pytest.raises(ValueError, match="split"):
        TextTask(data_dir=corpus, split="valid")
    one = tmp_path / "one"
    one.mkdir()
    (one / "a.txt").write_text("hello")
    with pytest.raises(ValueError, match="at least 2"):
        TextTask(data_dir=one)


def test_bits_per_byte_of_a_uniform_guess_is_8():
    logits = torch.zeros(2, 5, 256)
    y = torch.randint(0, 256, (2, 5))
    assert math.isclose(bits_per_byte(logits, y), 8.0, rel_tol=1e-6)


def test_training_on_text_reports_bits_per_byte(corpus):
    cfg = TrainConfig(task="text", data=str(corpus), steps=4, batch=4, seq_len=16, d_model=32, layers=1,
                      eval_size=8, progress=False, lr=1e-2)
    r = train(SPECS / "deltanet.yaml", cfg)
    assert r.bits_per_byte is not None and 0 < r.bits_per_byte < 9
    assert r.parameters > 256 * 32                                   # the byte embedding
    assert all(math.isfinite(v) for v in r.losses)
    table = markdown_table([r])
    assert "bits per byte" in table and f"{r.bits_per_byte:.3f}" in table


def test_cli(corpus, capsys):
    args = ["train", str(SPECS / "linear_attention.yaml"), "--task", "text", "--data", str(corpus), "--steps", "2",
            "--batch", "2", "--seq-len", "16", "--d-model", "32", "--layers", "1", "--eval-size", "4", "--no-progress"]
    assert main(args) == 0
    assert "bits per byte" in capsys.readouterr().out
    assert main(["train", str(SPECS / "linear_attention.yaml"), "--data", str(corpus)]) == 2
    assert "--data is for the text task" in capsys.readouterr().err
    assert main(args + ["--vocab", "64"]) == 2


def test_compare_on_text_reports_bits_per_byte_per_seed(corpus):
    import json

    from memspec.tools.train import compare, json_table

    cfg = TrainConfig(task="text", data=str(corpus), steps=2, batch=2, seq_len=16, d_model=32, layers=1,
                      eval_size=4, progress=False)
    results = compare([SPECS / "linear_attention.yaml"], cfg, seeds=2)
    assert [r.seed for r in results] == [0, 1] and all(r.bits_per_byte is not None for r in results)
    row = json.loads(json_table(results, cfg))["rows"][0]
    assert row["bits_per_byte"]["min"] == min(r.bits_per_byte for r in results)
    assert [run["bits_per_byte"] for run in row["runs"]] == [r.bits_per_byte for r in results]
    table = markdown_table(results)
    assert "mean bits per byte" in table
    assert " / ".join(f"{r.bits_per_byte:.3f}" for r in results) in table
