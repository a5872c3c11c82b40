"""The lab: each experiment's qualitative result, and the specs checked against closed forms."""
from __future__ import annotations

import json
import math

import pytest
import torch

from memspec.tools.cli import main
from memspec.tools.lab import REGISTRY, common, experiment
from memspec.tools.lab import bandwidth, characters, drift, interference


# ------------------------------------------------------------------ interference
def test_interference_matches_the_textbook_by_hand():
    r = interference.run()
    d, a = r.values["delta"], r.values["additive"]
    # rows: after write 1..4; columns: probe (1,0), probe (0,1), key (0.8,0.6)
    # Delta, eta = 1: write 3 (the correction) turns row 1 from (1,0) into (0,1) (textbook 3.3).
    assert d[1][:2] == [[1, 0], [0, 1]]
    assert d[2][:2] == [[0, 1], [0, 1]]
    # Write 4: k4 = (0.8, 0.6), prediction k4 W = (0, 1.4), correction v4 - k4 W = (1, -1.4);
    # each probe q moves by (q . k4) * (1, -1.4): 0.8 * (1, -1.4) and 0.6 * (1, -1.4).
    assert d[2][2] == pytest.approx([0.0, 1.4])
    assert d[3][0] == pytest.approx([0.8, 1 - 1.12])
    assert d[3][1] == pytest.approx([0.6, 1 - 0.84])
    assert d[3][2] == pytest.approx([1.0, 0.0], abs=1e-9)  # |k4| = 1, eta = 1: the new key is stored exactly
    # Additive: W = sum k^T v; nothing is replaced.
    assert a[2][:2] == [[1, 1], [0, 1]]
    assert a[3][0] == pytest.approx([1.8, 1.0])
    assert a[3][1] == pytest.approx([0.6, 1.0])
    assert a[3][2] == pytest.approx([0.8 * 1.8 + 0.6 * 0.6, 1.4])
    assert "(+0.80, -0.12)" in r.render()


# ------------------------------------------------------------------------ drift
def test_uniform_ls_spec_is_the_exact_ridge_solve():
    x, y, _ = drift.make_stream(3, 40)
    pred = drift.predictions("uniform_ls", x, y)
    for t in (1, 5, 39):
        H = x[:t].T @ x[:t] + 1e-3 * torch.eye(drift.D, dtype=x.dtype)
        w = torch.linalg.solve(H, x[:t].T @ y[:t])
        assert float(pred[t]) == pytest.approx(float(x[t] @ w), rel=1e-3, abs=1e-4)
    assert float(pred[0]) == 0.0  # nothing seen yet: predicts 0


def test_implicit_step_spec_is_longhorns_closed_form():
    x, y, _ = drift.make_stream(4, 30)
    pred = drift.predictions("implicit_step", x, y)
    w, eta = torch.zeros(drift.D, dtype=x.dtype), 0.1
    for t in range(30):
        assert float(pred[t]) == pytest.approx(float(x[t] @ w), abs=1e-5)
        w = w - eta / (1 + eta * x[t] @ x[t]) * x[t] * (x[t] @ w - y[t])


def test_drift_ordering_and_ratios():
    r = drift.run(seed=0)
    dr, st = r.values["drifting"], r.values["stationary"]
    u, d, i = dr["uniform LS"], dr["decayed LS"], dr["implicit step"]
    # the seed's notes: 0.99 / 0.29 / 0.30 -- uniform goes stale, decay and the implicit step track
    assert u > 2.5 * d and u > 2.5 * i
    assert 0.8 < i / d < 1.25
    assert u == pytest.approx(0.99, abs=0.15) and d == pytest.approx(0.29, abs=0.06) and i == pytest.approx(0.30, abs=0.06)
    # stationary: uniform least squares wins, forgetting costs efficiency
    assert st["uniform LS"] < st["decayed LS"] < st["implicit step"]
    assert st["uniform LS"] > drift.NOISE**2 * 0.9  # nobody beats the noise floor by much


def test_drift_ordering_holds_for_another_seed():
    r = drift.run(seed=1, steps=1000)
    dr, st = r.values["drifting"], r.values["stationary"]
    assert dr["uniform LS"] > 1.5 * max(dr["decayed LS"], dr["implicit step"])
    assert st["uniform LS"] < min(st["decayed LS"], st["implicit step"])


# ------------------------------------------------------------------- characters
def test_kernel_smoother_spec_is_nadaraya_watson():
    x, y = characters.make_stream(5, 30)
    at = torch.tensor([-2.0, 0.1, 1.7], dtype=torch.float64)
    got = characters.fit("kernel smoother", x, y, at)
    w = torch.softmax(-((at[:, None] - x[None]) ** 2) / (2 * 0.1**2), -1)
    assert torch.allclose(got, w @ y, atol=1e-4)


def test_batch_solve_spec_is_batch_least_squares():
    x, y = characters.make_stream(6, 50)
    at = torch.linspace(-3, 3, 7, dtype=torch.float64)
    got = characters.fit("batch solve", x, y, at)
    P = characters.bumps(x)
    w = torch.linalg.solve(P.T @ P + 1e-3 * torch.eye(characters.FEATURES, dtype=P.dtype), P.T @ y)
    assert torch.allclose(got, characters.bumps(at) @ w, atol=2e-3)


def test_three_characters():
    v = characters.run(seed=0).values
    ks, de, bs = v["kernel smoother"], v["one-pass delta"], v["batch solve"]
    # kernel smoother: faithful (closest to the truth), ragged (rougher than the delta rule)
    assert ks["mse_truth"] < de["mse_truth"] < bs["mse_truth"]
    assert ks["roughness"] > 10 * de["roughness"]
    # one-pass delta: smooth (smoothest of the three), shallow (smallest amplitude, worst fit to the data)
    assert de["roughness"] < min(ks["roughness"], bs["roughness"])
    assert de["amplitude"] < 0.9 and de["amplitude"] < min(ks["amplitude"], bs["amplitude"])
    assert de["residual"] > max(ks["residual"], bs["residual"])
    # batch solve: threads the noise -- smallest residual on the data (below the noise variance), roughest fit
    assert bs["residual"] < min(ks["residual"], de["residual"]) and bs["residual"] < characters.NOISE**2
    assert bs["roughness"] > ks["roughness"]


# -------------------------------------------------------------------- bandwidth
def _nw_causal_loss(x, y, sigma):
    T = len(x)
    s = -((x[:, None] - x[None]) ** 2) / (2 * sigma**2)
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(-1), -math.inf)
    p = torch.softmax(s[1:], -1) @ y
    return float(((p - y[1:])[bandwidth.SKIP - 1:] ** 2).mean())


def test_bandwidth_sweep_is_the_causal_nadaraya_watson_loss():
    spec = common.load_spec("kernel_smoother_learned")
    sigmas = torch.tensor([0.1, 0.3], dtype=torch.float64)
    losses = bandwidth.sweep(spec, 0, 60, sigmas)
    x, y = characters.make_stream(1000, 60)
    for s, l in zip(sigmas.tolist(), losses.tolist()):
        assert l == pytest.approx(_nw_causal_loss(x, y, s), rel=1e-4)


def test_learned_bandwidth_lands_on_the_sweep_minimum():
    r = bandwidth.run(seed=0)
    v = r.values
    assert v["sweep_steps_apart"] <= 1.0
    assert abs(math.log(v["learned_sigma"] / v["sweep_sigma"])) <= math.log(v["sweep_ratio"])
    # the minimum is interior (the sweep brackets it) and training moved far from the init sigma = 1
    assert v["sigmas"][0] < v["sweep_sigma"] < v["sigmas"][-1]
    assert v["learned_sigma"] < 0.5


# -------------------------------------------------------------------------- CLI
def test_lab_list(capsys):
    assert main(["lab", "list"]) == 0
    out = capsys.readouterr().out
    assert [line.split()[0] for line in out.splitlines()] == list(REGISTRY)


def test_lab_run_writes_table_and_numbers_and_skips_plot_without_matplotlib(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(common, "matplotlib_pyplot", lambda: None)
    assert main(["lab", "run", "interference", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "(+0.60, +0.16)" in out
    assert "matplotlib is not installed" in out
    assert (tmp_path / "interference.txt").read_text() in out
    values = json.loads((tmp_path / "interference.json").read_text())
    assert values["delta"][3][0] == pytest.approx([0.8, -0.12])
    assert not (tmp_path / "interference.png").exists()


def test_lab_run_unknown_name_is_a_usage_error(capsys):
    assert main(["lab", "run", "interferance"]) == 2
    err = capsys.readouterr().err
    assert "no experiment 'interferance'" in err and "did you mean 'interference'?" in err
    assert "Traceback" not in err


def test_lab_run_out_is_a_file(tmp_path, capsys):
    f = tmp_path / "f"
    f.write_text("x")
    assert main(["lab", "run", "interference", "--out", str(f)]) == 2
    assert "is a file" in capsys.readouterr().err


def test_every_experiment_module_is_registered():
    for name in REGISTRY:
        mod = experiment(name)
        assert mod.NAME == name and mod.SUMMARY


# ------------------------------------------------------------------ seed-memory
def _snippet_literally(seed=0):
    """The seed snippet's own loop (torch.func), for comparison with the spec."""
    from torch.func import functional_call, grad
    from torch import nn

    from memspec.tools.lab import seed_memory

    keys, values, order, w1 = seed_memory.snippet_data(seed)
    memory = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))
    params = {"0.weight": w1.T.clone(), "0.bias": torch.zeros(128),
              "2.weight": torch.zeros(32, 128), "2.bias": torch.zeros(32)}

    def recall_loss(p, k, v):
        return ((functional_call(memory, p, (k[None],))[0] - v) ** 2).sum()

    grad_fn = grad(recall_loss)
    velocity = {n: torch.zeros_like(p) for n, p in params.items()}
    for t in order.tolist():
        g = grad_fn(params, keys[t], values[t])
        for n in params:
            velocity[n] = 0.5 * velocity[n] - 0.005 * g[n]
            params[n] = params[n] + velocity[n]
    with torch.no_grad():
        return float(((functional_call(memory, params, (keys,)) - values) ** 2).mean())


def test_seed_memory_reproduces_the_snippet():
    from memspec.tools.lab import seed_memory

    r = seed_memory.run(seed=0)
    v = r.values
    base, nomom, forget = v["seed_memory"], v["seed_memory_no_momentum"], v["seed_memory_forget"]
    assert base["before"] == pytest.approx(1 / 32)  # empty memory retrieves 0; |v|^2 = 1 over 32 coordinates
    assert base["after"] == pytest.approx(_snippet_literally(0), rel=1e-4)
    assert round(base["after"], 4) == 0.0023 and base["after"] < base["before"] / 5  # the snippet's assert
    # momentum helps on this stream; forgetting costs recall of pairs that recur
    assert base["after"] < nomom["after"] < nomom["before"] / 5
    assert forget["after"] > 2 * base["after"]
    assert all(x["before"] == pytest.approx(1 / 32) for x in (nomom, forget))
    assert v["backend"] == "compiled module"


def test_seed_memory_compiled_module_agrees_with_the_interpreter():
    from memspec.tools.lab import seed_memory

    b1, a1, online1, how1 = seed_memory.stream("seed_memory_forget", 0, compiled=True)
    b2, a2, online2, how2 = seed_memory.stream("seed_memory_forget", 0, compiled=False)
    assert (how1, how2) == ("compiled module", "reference interpreter")
    assert b1 == pytest.approx(b2) and a1 == pytest.approx(a2, rel=1e-4)
    assert torch.allclose(online1, online2, rtol=1e-4, atol=1e-7)


def test_lab_specs_pass_the_checker():
    from memspec.check.verify import check

    for path in sorted(common.LAB_SPECS.glob("*.yaml")):
        spec = memspec_load(path)
        _, diags = check(spec)
        assert [d.render() for d in diags] == [], path


def memspec_load(path):
    from memspec import load

    return load(path)


@pytest.mark.parametrize("argv", [["lab"], ["lab", "run", "drift", "--seed", "-1"],
                                  ["lab", "run", "drift", "--seed", str(2**70)], ["lab", "run", "drift", "--seed", "x"]])
def test_lab_usage_errors_exit_2_without_traceback(argv, capsys):
    try:
        status = main(argv)
    except SystemExit as e:  # argparse's own usage errors
        status = e.code
    assert status == 2
    assert "Traceback" not in capsys.readouterr().err
