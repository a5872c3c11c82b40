"""The benchmark scripts that back the README's speed claims still run and still compute what
they time: their own equality checks (each exits non-zero when a timed form differs from the
module's chunked schedule) at small sizes, one round, no torch.compile."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def script(name):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_floor_minimal_form_equals_the_module(capsys):
    threads = torch.get_num_threads()
    try:
        assert script("floor").main(["--T", "128", "--D", "16", "--chunk", "16", "--group", "4", "--repeat", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    for row in ("online", "chunked", "minimal", "matmuls"):
        assert f"\n{row} " in out


@pytest.mark.parametrize("name", ["retention", "gla", "kda", "momentum_deltanet"])
def test_compiled_group_slices_equal_the_chunked_forward(name, capsys):
    """The script's slices (one chunk each, a shorter tail: T = 80, chunks of 32 or 64), run
    eagerly, equal the module's chunked forward over all tokens (its self-check exits 1 otherwise;
    that the slicing carries the state is tested in test_compiled_chunked.py)."""
    threads = torch.get_num_threads()
    try:
        rc = script("compiled_group").main([f"specs/{name}.yaml", "--T", "80", "--D", "16", "--slice-chunks", "1",
                                            "--repeat", "1", "--no-compile"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert rc == 0, out
    diff = float(out.split("largest relative difference to the eager chunked forward ")[1].split()[0])
    assert diff < 1e-5
