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
def test_compiled_group_slices_equal_the_kernel(name, capsys):
    """Slice by slice with the states threaded (S, and M for the momentum kernel) equals the
    kernel over all tokens, a shorter tail slice included (T = 80 = 2 x 32 + 16)."""
    threads = torch.get_num_threads()
    try:
        rc = script("compiled_group").main([f"specs/{name}.yaml", "--T", "80", "--D", "16", "--slice", "32",
                                            "--repeat", "1", "--no-compile"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert rc == 0, out
    diff = float(out.split("largest relative difference to the eager kernel ")[1].split()[0])
    assert diff < 1e-5


def test_compiled_group_without_the_states_differs():
    """The check can fail: slices that each start from the initial state disagree with the kernel."""
    mod = script("compiled_group")
    from memspec.runtime.additive import chunk_additive
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 64, 2, 8, generator=g) for _ in range(3))
    lg = -torch.rand(1, 64, 2, generator=g)
    S0 = torch.zeros(1, 2, 8, 8)
    o, S = chunk_additive(q, k, v, lg, S0, 16)
    o2, S2 = mod.sliced(chunk_additive, chunk_additive, 32)(q, k, v, lg, S0, 16)
    torch.testing.assert_close(o2, o)
    torch.testing.assert_close(S2, S)

    def forgetful(q, k, v, log_gamma, S0, chunk):
        return chunk_additive(q, k, v, log_gamma, torch.zeros_like(S0), chunk)

    o3, _ = mod.sliced(chunk_additive, forgetful, 32)(q, k, v, lg, S0, 16)
    assert not torch.allclose(o3, o)
