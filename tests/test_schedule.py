"""Schedule analysis: decisions from the algebra, forced schedules, explain, chunked emission."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import memspec
from memspec import reference
from memspec.lang.errors import SpecError
from memspec.schedule import AdditivePlan, MinibatchPlan, CachePlan, analyse, explain

from close import assert_same_function

ROOT = Path(__file__).resolve().parent.parent
SPECS = ROOT / "specs"

# the family the seed text would name for each paper memory
PAPER_FAMILIES = {
    "linear_attention": "additive",
    "deltanet": "delta",
    "gated_deltanet": "delta",
    "gated_deltanet_channel": "delta",  # beta per value channel: a delta rule per column
    "longhorn": "delta",
    "ttt_linear": "minibatch",
    "ttt_mlp": "minibatch",
    "titans": "minibatch",
    "titans_channel_forget": "minibatch",   # a forget gate per row of each layer: the dual form in blocks
    "moneta": "minibatch",
    "yaad": "minibatch",
    "mesa": "solve",
    "softmax_attention": "cache",
    "sliding_window_attention": "cache",
    # linear in the state: decided on the normal form S_t = T_t(S_{t-1}) + W_t
    "retention": "additive",
    "mamba2": "additive",
    "deltanet_textbook": "delta",
    "gla": "additive",                  # a decay per key channel: the per-channel additive kernel
    "rwkv6": "additive",                # + the bonus read q . (u * k) v, token-local (exclusive read)
    "hgrn2": "additive",
    "kda": "dplr",                      # the gated delta rule with a decay per key channel
    "gdn2": "dplr",
    "comba": "dplr",                    # an asymmetric rank one: the error read at p, written at k
    "rwkv7": "dplr",
    "gated_deltaproduct": "dplr",       # two rank-one steps per token, in order
    "momentum_deltanet": "momentum",    # two states coupled linearly, triangularly: the exact chunked form
}


def mem(text: str):
    return memspec.loads(textwrap.dedent(text), "mem")


DELTA_HEAD = """
memory m
dims { d_k = 6, d_v = 5 }
view q : d_k
view k : d_k
view v : d_v
gate eta = sigmoid(logit)
gate alpha = sigmoid(logit) bias -2.0
state W : [d_k, d_v] = zeros
model f(u) = u @ W
"""


@pytest.mark.parametrize("name", sorted(PAPER_FAMILIES))
@pytest.mark.parametrize("fmt", ["yaml", "mem"])
def test_paper_specs_get_the_seed_family(name, fmt):
    path = SPECS / f"{name}.{fmt}"
    if not path.exists():
        pytest.skip(f"{path.name} not shipped")
    d = analyse(memspec.load(path))
    assert d.family == PAPER_FAMILIES[name]
    assert "online" in d.admits
    assert d.exact == (d.family != "minibatch")
    text = explain(memspec.load(path))
    assert text.splitlines()[0].startswith(f"{name}: {'mini-batch' if d.family == 'minibatch' else d.family}")


def test_linear_attention_plan():
    s = mem("""
        memory la
        dims { d_k = 4, d_v = 3 }
        view q : d_k
        view k : d_k
        view v : d_v
        let qf = elu(q) + 1
        let kf = elu(k) + 1
        state S : [d_k, d_v] = zeros
        state z : [d_k] = zeros
        update {
          S = S + outer(kf, v)
          z = z + kf
        }
        read = (qf @ S) / (qf @ z + 1e-6)
    """)
    d = analyse(s)
    assert (d.family, d.exact, d.chunk, d.admits) == ("additive", True, 64, ("additive", "scan", "online"))
    plan = d.plan
    assert isinstance(plan, AdditivePlan) and plan.inclusive
    assert [(st.name, st.gamma, st.vector) for st in plan.states] == [("S", None, False), ("z", None, True)]
    assert [str(p.vector) for p in plan.probes] == ["elu(q) + 1", "elu(q) + 1"]
    assert [p.state for p in plan.probes] == ["S", "z"]
    assert any("update of S is affine in S" in r and "outer(kf, v)" in r for r in d.reasons)
    assert any("linear probes qf @ S, qf @ z" in r for r in d.reasons)


GATED_VARIANTS = {
    # decay, then gradient at the decayed memory (the gated delta rule)
    "gated": """
        loss = 0.5 * sum((f(k) - v)^2)
        update { W = (1 - alpha) * W
                 W = W - eta * grad(loss, W) }
        read = f(q)
    """,
    # renamed everything, x - y written as x + (-1)*y, decay written as W - alpha*W
    "renamed": """
        loss = sum((f(k) + (-1) * v)^2) / 2
        update { W = W - alpha * W
                 W = W + (-1) * eta * grad(loss, W) }
        read = f(q)
    """,
}


def renamed(text: str) -> str:
    return (text.replace("W", "Mem").replace("f(", "g(").replace("eta", "lr").replace("alpha", "forget")
            .replace("q", "query").replace(" k ", " key ").replace("(k)", "(key)").replace("k :", "key :"))


def test_rewritten_and_renamed_variants_get_the_same_decision():
    base = analyse(mem(DELTA_HEAD + GATED_VARIANTS["gated"]))
    other = analyse(mem(renamed(DELTA_HEAD + GATED_VARIANTS["renamed"])))
    assert base.family == other.family == "delta"
    assert base.admits == other.admits == ("delta", "dplr", "minibatch", "online")
    pb, po = base.plan, other.plan
    assert str(pb.beta) == "eta" and str(po.beta) == "lr"
    assert str(pb.gamma) == "1 - alpha" and str(po.gamma) == "1 - forget"
    assert pb.rho is None and po.rho is None        # gradient at the decayed memory


def test_decay_after_rescales_the_target():
    d = analyse(mem(DELTA_HEAD + """
        loss = 0.5 * sum((f(k) - v)^2)
        update { W = W - eta * grad(loss, W)
                 W = (1 - alpha) * W }
        read = f(q)
    """))
    assert d.family == "delta"
    assert str(d.plan.v) == "(1 - alpha) * v"
    assert str(d.plan.gamma) == "1 - alpha" and d.plan.rho is None
    assert any("target rescaled" in r for r in d.reasons)


def test_decay_in_the_gradient_statement_uses_rho_one():
    d = analyse(mem(DELTA_HEAD + """
        loss = 0.5 * sum((f(k) - v)^2)
        update { W = (1 - alpha) * W - eta * grad(loss, W) }
        read = f(q)
    """))
    assert d.family == "delta"
    assert str(d.plan.gamma) == "1 - alpha" and str(d.plan.rho) == "1"
    assert str(d.plan.v) == "v" and str(d.plan.beta) == "eta"


def test_mean_loss_and_longhorn_step():
    d = analyse(mem(DELTA_HEAD + """
        loss = mean((f(k) - v)^2)
        let beta = eta / (1 + eta * sum(k * k))
        update { W = W - beta * grad(loss, W) }
        read = f(q)
    """))
    assert d.family == "delta"
    assert str(d.plan.beta) == "eta / (1 + eta * sum(k * k)) * (2 * (1 / d_v))"


def test_linear_loss_is_additive():
    """A Hebbian write: grad of a loss linear in the model output does not depend on W."""
    d = analyse(mem(DELTA_HEAD + """
        loss = -sum(f(k) * v)
        update { W = (1 - alpha) * W - eta * grad(loss, W) }
        read = f(q)
    """))
    assert d.family == "additive"
    st = d.plan.states[0]
    assert str(st.gamma) == "1 - alpha"
    assert [(str(a), str(b)) for a, b in st.terms] == [("k", "eta * v")]


def test_nonlinear_model_is_minibatch_and_forced_chunk_is_located_error():
    text = DELTA_HEAD.replace("model f(u) = u @ W", "model f(u) = gelu(u @ W)") + """
        loss = 0.5 * sum((f(k) - v)^2)
        update { W = W - eta * grad(loss, W) }
        read = f(q)
        schedule chunk(32)
    """
    with pytest.raises(SpecError) as ei:
        analyse(memspec.loads(textwrap.dedent(text), "mem", file="bad.mem"))
    (diag,) = ei.value.diagnostics
    assert diag.span is not None and diag.span.file == "bad.mem"
    assert "needs an exact chunk form" in diag.message
    assert "not polynomial in W (gelu(u @ W))" in diag.hint and "minibatch(N)" in diag.hint
    auto = analyse(mem(text.replace("schedule chunk(32)", "")))
    # auto picks only exact schedules: online, with the approximate mini-batch admitted (asked for by name)
    assert auto.family == "online" and auto.exact and auto.chunk is None
    assert auto.admits == ("minibatch", "online") and auto.schedules == ("minibatch", "online")
    assert isinstance(auto.plans["minibatch"], MinibatchPlan) and auto.plans["minibatch"].chunk == 64
    assert "ask for it with `schedule: minibatch(N)`" in explain(mem(text.replace("schedule chunk(32)", "")))
    asked = analyse(mem(text.replace("schedule chunk(32)", "schedule minibatch(64)")))
    assert asked.family == "minibatch" and not asked.exact and asked.chunk == 64


def test_forced_schedules():
    la = DELTA_HEAD + """
        loss = 0.5 * sum((f(k) - v)^2)
        update { W = W - eta * grad(loss, W) }
        read = f(q)
    """
    d = analyse(mem(la + "schedule chunk(16)"))
    assert (d.family, d.chunk, d.exact) == ("delta", 16, True)
    assert d.reasons[0] == "forced by schedule chunk(16)"
    d = analyse(mem(la + "schedule minibatch(8)"))
    assert (d.family, d.chunk, d.exact) == ("minibatch", 8, False) and d.plan.chunk == 8
    d = analyse(mem(la + "schedule online"))
    assert (d.family, d.chunk) == ("online", None)
    hebb = """
        memory h
        dims { d_k = 4 }
        view k : d_k
        state S : [d_k, d_k] = zeros
        update { S = S + outer(k, k) }
        read = k @ S
        schedule minibatch(4)
    """
    with pytest.raises(SpecError) as ei:
        analyse(mem(hebb))
    assert "needs gradient writes" in ei.value.diagnostics[0].message


def test_titans_recurrences():
    d = analyse(mem("""
        memory t
        dims { d_k = 4, d_v = 4, hid = 8 }
        view q : d_k
        view k : d_k
        view v : d_v
        gate eta = sigmoid(logit)
        gate mu = sigmoid(logit)
        gate alpha = sigmoid(logit)
        state W1 : [d_k, hid] = normal(0.1)
        state W2 : [hid, d_v] = zeros
        state U1 : [d_k, hid] = zeros
        state U2 : [hid, d_v] = zeros
        model f(u) = silu(u @ W1) @ W2
        loss = sum((f(k) - v)^2)
        update {
          U1 = mu * U1 - eta * grad(loss, W1)
          U2 = mu * U2 - eta * grad(loss, W2)
          W1 = (1 - alpha) * W1 + U1
          W2 = (1 - alpha) * W2 + U2
        }
        read = f(q)
        schedule minibatch(64)
    """))
    assert d.family == "minibatch" and d.admits == ("minibatch", "online")
    coef = d.plan.coef
    assert {k: str(v) for k, v in coef["W1"].items()} == {"W1": "1 - alpha", "U1": "mu"}
    assert {k: str(v) for k, v in coef["U2"].items()} == {"U2": "mu"}
    assert any("W1 <- (1 - alpha) * W1 + mu * U1 - eta * grad(loss, W1)" in r for r in d.reasons)


def test_cache_and_windows():
    d = analyse(mem("""
        memory sm
        dims { d_k = 4, d_v = 3 }
        view q : d_k
        view k : d_k
        view v : d_v
        state K : cache [d_k] window 16
        state V : cache [d_v] window 16
        update { K = append(K, k)
                 V = append(V, v) }
        read = attend(q, K, V, 1 / sqrt(d_k))
    """))
    assert d.family == "cache" and d.exact and d.chunk is None
    assert isinstance(d.plan, CachePlan) and d.plan.windows == {"K": 16, "V": 16}


MESA_HEAD = """
        memory me
        dims { d_k = 4, d_v = 3 }
        const lam = 1.0
        view q : d_k
        view k : d_k
        view v : d_v
        state H : [d_k, d_k] = zeros
        state G : [d_k, d_v] = zeros
"""


def test_mesa_solves_by_chunked_conjugate_gradients_exact_to_the_tolerance():
    spec = mem(MESA_HEAD + """
        update { H = H + outer(k, k)
                 G = G + outer(k, v) }
        read = q @ solve(H + lam * eye(d_k), G)
    """)
    d = analyse(spec)
    assert d.family == "solve" and d.exact and d.admits == ("solve", "online")
    text = explain(spec, d)
    assert "exact to the solver's tolerance (1e-06 in float32, 1e-12 in float64" in text
    assert "at most 4 steps" in text


def test_mesa_with_an_indefinite_system_stays_online_with_the_reason():
    d = analyse(mem(MESA_HEAD + """
        update { H = H - outer(k, k)
                 G = G + outer(k, v) }
        read = q @ solve(H + lam * eye(d_k), G)
    """))
    assert d.family == "online" and d.admits == ("online",)
    assert "is not provably >= 0" in dict(d.rejected)["solve"]
    assert any("additive running sums" in r and "solve(H + lam * eye(d_k), G)" in r for r in d.reasons)


def test_cli_explain_and_error(tmp_path):
    good = tmp_path / "g.mem"
    good.write_text(textwrap.dedent(DELTA_HEAD + GATED_VARIANTS["gated"]))
    bad = tmp_path / "b.mem"
    bad.write_text(textwrap.dedent(DELTA_HEAD.replace("u @ W", "tanh(u @ W)") + """
        loss = 0.5 * sum((f(k) - v)^2)
        update { W = W - eta * grad(loss, W) }
        read = f(q)
        schedule chunk(8)
    """))
    r = subprocess.run([sys.executable, "-m", "memspec", "explain", str(good)], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("m: delta") and "gated delta rule" in r.stdout
    r = subprocess.run([sys.executable, "-m", "memspec", "explain", str(bad)], capture_output=True, text=True)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert ":20:" in r.stderr or "error: schedule chunk(8)" in r.stderr
    assert "hint:" in r.stderr


# ------------------------------------------------------- chunked emission vs reference
def _build(spec):
    import inspect

    from memspec.codegen import EMITTERS, ExprEmitter
    from memspec.codegen.chunked import forward_lines
    from memspec.runtime import helpers

    d = analyse(spec)
    em = ExprEmitter(spec)
    family = EMITTERS[d.family].module
    lines = forward_lines(spec, family.body, d.plan, em, d.let_forms, chunk="chunk", lets=True)
    args = ", ".join([*spec.views, *spec.gates])
    body = textwrap.indent("\n".join(x if isinstance(x, str) else x.text() for x in lines), "    ")   # calls: written whole
    helper_src = "\n\n".join(inspect.getsource(getattr(helpers, h)) for h in sorted(em.helpers))
    src = ("import math\nimport torch\nimport torch.nn.functional as F\n\n" + inspect.getsource(family.KERNEL)
           + "\n\n" + helper_src + f"\n\ndef forward(self, {args}, state, chunk):\n{body}\n")
    ns: dict = dict(vars(inspect.getmodule(family.KERNEL)))   # the kernel's phases and private functions
    exec(compile(src, f"<chunked {spec.name}>", "exec"), ns)
    return ns["forward"], src


def _inputs(spec, B=2, T=11, H=2, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    vg = {n: torch.randn(B, T, H, spec.dims[v.dim], generator=g, dtype=dtype) for n, v in spec.views.items()}
    for n in spec.gates:
        vg[n] = torch.sigmoid(torch.randn(B, T, H, generator=g, dtype=dtype))
    st = reference.init_state(spec, B, H, dtype=dtype)
    st = {k: torch.randn(x.shape, generator=g, dtype=dtype) * 0.3 for k, x in st.items()}
    return vg, st


CHUNKED = {
    "linear_attention": """
        memory la
        dims { d_k = 5, d_v = 3 }
        view q : d_k
        view k : d_k
        view v : d_v
        gate alpha = sigmoid(logit)
        let qf = elu(q) + 1
        let kf = elu(k) + 1
        state S : [d_k, d_v] = zeros
        state z : [d_k] = zeros
        update {
          S = (1 - 0.5 * alpha) * S + outer(kf, v)
          z = z - 0.5 * alpha * z + 2 * alpha * kf
        }
        read = (qf @ S) / (qf @ z + 1)
    """,
    "two_decays": """
        memory td
        dims { d_k = 3, d_v = 4 }
        view q : d_k
        view k : d_k
        view v : d_v
        gate alpha = sigmoid(logit)
        state S : [d_k, d_v] = zeros
        state z : [d_k] = zeros
        update {
          S = (1 - alpha) * S + outer(k, v) + outer(q, 2 * v)
          z = z + alpha * k
        }
        read = (q @ S) * (k @ z) + q @ z
    """,
    "read_write": """
        memory rw
        dims { d_k = 4, d_v = 6 }
        view q : d_k
        view k : d_k
        view v : d_v
        gate eta = sigmoid(logit)
        state S : [d_k, d_v] = zeros
        update { S = 0.9 * S + eta * outer(k, v) - outer(q, v) }
        read = tanh(q @ S) + k @ S
        order read_write
    """,
    "gated": DELTA_HEAD + GATED_VARIANTS["gated"],
    "renamed": renamed(DELTA_HEAD + GATED_VARIANTS["renamed"]),
    "decay_after": DELTA_HEAD + """
        loss = 0.5 * sum((f(k) - v)^2)
        let kn = l2norm(k)
        update { W = W - eta * grad(loss, W)
                 W = (1 - alpha) * W }
        read = f(q)
    """,
    "same_statement": DELTA_HEAD + """
        loss = 0.5 * sum((f(l2norm(k)) - v)^2)
        update { W = (1 - alpha) * W - eta * grad(loss, W) }
        read = f(q) * 2
        order read_write
    """,
}


@pytest.mark.parametrize("name", sorted(CHUNKED))
def test_chunked_forward_matches_reference(name):
    spec = mem(CHUNKED[name])
    d = analyse(spec)
    assert d.family in ("additive", "delta")
    fwd, src = _build(spec)
    assert "chunk_" in src
    assert ("one kernel call for S, z" in src) == (name == "linear_attention")
    vg, st = _inputs(spec)
    leaves = [x.requires_grad_() for x in [*vg.values(), *st.values()]]
    o_ref, s_ref = reference.run(spec, state=st, **vg)
    self = type("M", (), dict(spec.dims))()
    for chunk in (4, 64):
        o, s = fwd(self, *vg.values(), st, chunk)
        assert torch.allclose(o, o_ref, rtol=1e-9, atol=1e-10)
        for n in spec.state:
            assert torch.allclose(s[n], s_ref[n], rtol=1e-9, atol=1e-10)
    w = torch.randn(o.shape, dtype=o.dtype, generator=torch.Generator().manual_seed(3))
    loss_ref = (o_ref * w).sum() + sum(x.square().sum() for x in s_ref.values())
    loss = (o * w).sum() + sum(x.square().sum() for x in s.values())
    g_ref = torch.autograd.grad(loss_ref, leaves)
    g = torch.autograd.grad(loss, leaves)
    for a, b in zip(g, g_ref):
        assert torch.allclose(a, b, rtol=1e-8, atol=1e-9)


@pytest.mark.parametrize("name", ["linear_attention", "deltanet", "gated_deltanet", "longhorn"])
def test_shipped_chunked_specs_match_reference(name):
    path = SPECS / f"{name}.yaml"
    if not path.exists():
        pytest.skip("not shipped")
    spec = memspec.load(path).with_dims(d_k=6, d_v=5)
    fwd, _ = _build(spec)
    vg, st = _inputs(spec, T=13, dtype=torch.float32)
    o_ref, s_ref = reference.run(spec, state=st, **vg)
    self = type("M", (), dict(spec.dims))()
    o, s = fwd(self, *vg.values(), st, 4)
    assert ((o - o_ref).norm() / o_ref.norm()).item() <= 1e-5
    for n in spec.state:
        assert ((s[n] - s_ref[n]).norm() / s_ref[n].norm()).item() <= 1e-5


# ------------------------------------------------------------------ bench (fields only)
def test_bench_record_fields(tmp_path):
    from memspec.tools.bench import bench, render

    path = tmp_path / "g.mem"
    path.write_text(textwrap.dedent(DELTA_HEAD + GATED_VARIANTS["gated"]))
    rec = bench([path], T=9, B=1, H=1, D=4, repeat=1)
    assert rec["config"] == {"T": 9, "B": 1, "H": 1, "D": 4, "dtype": "float32", "grad": False,
                             "compile": False, "repeat": 1}
    assert rec["machine"]["bmm_64x64_peak_gflops"] > 0
    by = {r["schedule"]: r for r in rec["results"]}
    assert set(by) == {"delta", "minibatch", "online"}
    for name in ("delta", "online"):
        r = by[name]
        assert r["median_ms"] > 0 and r["tokens_per_s"] == pytest.approx(9 / (r["median_ms"] / 1e3))
        assert r["exact"] is True and r["gflop"] >= 0 and r["peak_mem_mb"] > 0
    assert by["delta"]["chunk"] == 64 and by["online"]["chunk"] is None
    assert by["online"]["speedup_vs_online"] == 1.0
    assert by["delta"]["speedup_vs_online"] == pytest.approx(by["online"]["median_ms"] / by["delta"]["median_ms"])
    assert "delta" in render(rec)
    json.dumps(rec)


def test_bench_times_the_schedules_round_robin(tmp_path, monkeypatch):
    """After each schedule's two warm-up calls, every timed round runs each schedule once, in
    order: a slow spell of the machine falls on all schedules alike (the ratios stay fair); each
    timed call ("t": the clock read before it) follows an untimed call of its own schedule."""
    import memspec.pipeline.build as build
    import memspec.tools.bench as bench_mod
    from memspec.tools.bench import bench_spec
    from memspec.lang.frontend import load

    calls = []
    real = build.build_memory
    clock = bench_mod.time.perf_counter

    class Clock:
        @staticmethod
        def perf_counter():
            calls.append("t")
            return clock()
    monkeypatch.setattr(bench_mod, "time", Clock)

    def recording(*args, **kw):
        memory = real(*args, **kw)
        forward = memory.forward

        def spy(*a, schedule="auto", **k):
            calls.append(schedule)
            return forward(*a, schedule=schedule, **k)
        memory.forward = spy
        return memory
    monkeypatch.setattr(build, "build_memory", recording)
    path = tmp_path / "g.mem"
    path.write_text(textwrap.dedent(DELTA_HEAD + GATED_VARIANTS["gated"]))
    spec = load(path)
    spec = spec[0] if isinstance(spec, tuple) else spec
    recs = bench_spec(spec, T=5, B=1, H=1, D=4, repeat=3, schedules={"delta", "online"})
    assert [r["runs"] for r in recs] == [3, 3]
    # the build (timed), then the warm-up: the first and second call of each schedule, each
    # between two clock reads
    warm = ["t", "t"] + ["t", "delta", "t", "t", "delta", "t", "t", "online", "t", "t", "online", "t"]
    assert calls[:14] == warm
    rounds = calls[14:14 + 3 * 8]
    assert rounds == ["delta", "t", "delta", "t", "online", "t", "online", "t"] * 3


def test_bench_cli_json(tmp_path, capsys):
    from memspec.tools.cli import main

    path = tmp_path / "g.mem"
    path.write_text(textwrap.dedent(DELTA_HEAD + GATED_VARIANTS["gated"]))
    out = tmp_path / "b.json"
    rc = main(["bench", str(path), "--T", "5", "--D", "4", "--H", "1", "--repeat", "1",
               "--schedules", "delta", "--json", str(out)])
    assert rc == 0
    rec = json.loads(out.read_text())
    assert [x["schedule"] for x in rec["results"]] == ["delta"]
    assert "median ms" in capsys.readouterr().out
    assert main(["bench", str(path), "--T", "0"]) == 2
    assert "--T must be >= 1" in capsys.readouterr().err


def test_decay_must_be_provably_nonnegative():
    text = """
        memory d
        dims { d_k = 4 }
        view k : d_k
        gate alpha = sigmoid(logit)
        state S : [d_k, d_k] = zeros
        update { S = (1 - 2 * alpha) * S + outer(k, k) }
        read = k @ S
    """
    d = analyse(mem(text))
    assert d.family == "scan"   # the elementwise scan multiplies decays of any sign, never takes their log
    assert "not provably >= 0" in dict(d.rejected)["additive"]
    d = analyse(mem(text.replace("(1 - 2 * alpha)", "exp(-softplus(alpha))")))
    assert d.family == "additive"
    assert "the decay exp(-softplus(alpha)) of S lies in [0, 1]" in d.reasons


def test_coupled_recurrences_are_not_minibatch():
    spec = mem(DELTA_HEAD.replace("state W : [d_k, d_v] = zeros",
                                  "state W : [d_k, d_v] = zeros\nstate U : [d_k, d_v] = zeros") + """
        loss = 0.5 * sum((f(k) - v)^2)
        update { U = 0.5 * U + 0.1 * W - eta * grad(loss, W)
                 W = W + 0.5 * U }
        read = f(q)
    """)
    d = analyse(spec)
    assert d.family == "online"
    assert "feed each other's previous values" in dict(d.rejected)["minibatch"]
    assert "U reads W through a scalar (0.1 W): the block decay is not triangular" in dict(d.rejected)["momentum"]
    assert dict(d.rejected)["momentum"].startswith("U reads W")   # the read names the memory: W
    assert "the momentum chunked form does not apply (see momentum above)" in explain(spec, d)


def test_the_textbook_delta_rule_gets_deltanets_schedule_and_numbers():
    """§3.3's explicit W + eta outer(kn, v - kn @ W) and DeltaNet's W - eta grad(loss, W): one plan,
    and the compiled modules give bit-identical outputs and states on every schedule they share."""
    from memspec.pipeline.build import build_memory

    a, b = (analyse(memspec.load(SPECS / f"{n}.yaml")) for n in ("deltanet_textbook", "deltanet"))
    assert a.family == b.family == "delta" and a.plan == b.plan
    assert a.normal_form == b.normal_form == ("W <- T(W) + A with T = I - eta kn knᵀ; A = eta kn vᵀ",)
    g = torch.Generator().manual_seed(0)
    x = {n: torch.randn(2, 9, 2, 4, generator=g) for n in "qkv"}
    eta = torch.rand(2, 9, 2, generator=g)
    mods = [build_memory(memspec.load(SPECS / f"{n}.yaml"), compile=False, chunk=4, d_k=4, d_v=4, heads=2)
            for n in ("deltanet_textbook", "deltanet")]
    for schedule in ("delta", "online"):
        (oa, sa), (ob, sb) = (m(x["q"], x["k"], x["v"], eta=eta, schedule=schedule) for m in mods)
        assert_same_function(oa, ob, msg=schedule)
        assert_same_function(sa["W"], sb["W"], msg=schedule)


def test_explain_prints_the_normal_form_in_the_specs_names():
    text = explain(memspec.load(SPECS / "gated_deltanet.yaml"))
    assert ("  normal form (S_t = T_t(S_{t-1}) + W_t, in the states before the token):\n"
            "    W <- T(W) + A with T = (1 - alpha) I - eta * (1 - alpha) kn knᵀ; A = eta kn vᵀ\n") in text
    text = explain(memspec.load(SPECS / "momentum_deltanet.yaml"))
    assert text.startswith("momentum_deltanet: momentum")
    assert "T[W <- U] = mu I" in text and "admits: momentum, minibatch, online" in text
    assert "one joint transition [[1 - alpha, mu], [0, mu]] ⊗ I plus rank-one terms" in text
    assert "but triangular (the momentum feeds the memory, never back)" in text
    assert "momentum delta rule with M = -U: M <- mu * M + outer(k, eta * (p @ W - v)); W <- (1 - alpha) * W - M" \
        in text


# ------------------------------------------------------------------ dplr: one decision however it is written
KDA_HEAD = """
memory m
dims { d_k = 6, d_v = 5 }
view q : d_k
view k : d_k
view v : d_v
gate eta = sigmoid(logit)
gate alpha : [d_k] = sigmoid(logit) bias -2.0
state W : [d_k, d_v] = zeros
"""

KDA_VARIANTS = {
    "grad": """
        model f(u) = u @ W
        loss = 0.5 * sum((f(k) - v)^2)
        update {
          W = diag(1 - alpha) @ W
          W = W - eta * grad(loss, W)
        }
        read = f(q)
    """,
    "explicit": """
        update {
          W = diag(1 - alpha) @ W
          W = W + eta * outer(k, v - k @ W)
        }
        read = q @ W
    """,
    "temporaries": """
        let g = 1 - alpha
        update {
          W = diag(g) @ W
          err = v - k @ W
          W = W + eta * outer(k, err)
        }
        read = q @ W
    """,
    "inline": """
        update {
          W = diag(1 - alpha) @ W + eta * outer(k, v - k @ (diag(1 - alpha) @ W))
        }
        read = q @ W
    """,
}


@pytest.mark.parametrize("variant", sorted(KDA_VARIANTS))
def test_kda_written_four_ways_gets_one_dplr_decision_and_the_same_numbers(variant):
    """The gated delta rule with a decay per key channel (KDA), as grad of the quadratic loss, the
    error written out, through a let and a temporary, or one statement: the same normal form, the
    same dplr plan, and every module gives the numbers of a token loop written here (outputs and
    final state) and of the reference interpreter on its own spec."""
    from memspec.pipeline.build import build_memory

    base_spec = mem(KDA_HEAD + KDA_VARIANTS["grad"])
    spec = mem(KDA_HEAD + KDA_VARIANTS[variant])
    base, d = analyse(base_spec), analyse(spec)
    assert base.family == d.family == "dplr" and d.exact
    assert d.admits == base.admits == ("dplr", "online")
    for x in (d, base):
        assert (x.plan.read_after_decay, x.plan.a_form, x.plan.b_form, len(x.plan.steps)) == (
            True, "scalar", "key", 1)
    g = torch.Generator().manual_seed(0)
    B, T, H = 2, 9, 2
    ins = {"q": torch.randn(B, T, H, 6, generator=g), "k": torch.nn.functional.normalize(
        torch.randn(B, T, H, 6, generator=g), dim=-1), "v": torch.randn(B, T, H, 5, generator=g),
        "eta": torch.rand(B, T, H, generator=g), "alpha": 0.3 * torch.rand(B, T, H, 6, generator=g)}
    # KDA by hand: W <- Diag(1 - alpha_t) W; W <- W + eta_t k_t^T (v_t - k_t W); o_t = q_t W
    W = torch.zeros(B, H, 6, 5)
    hand = []
    for t in range(T):
        q, k, v = ins["q"][:, t], ins["k"][:, t], ins["v"][:, t]
        W = (1 - ins["alpha"][:, t])[..., None] * W
        err = v - torch.einsum("bhi,bhij->bhj", k, W)
        W = W + ins["eta"][:, t, :, None, None] * k[..., :, None] * err[..., None, :]
        hand.append(torch.einsum("bhi,bhij->bhj", q, W))
    hand = torch.stack(hand, 1)
    for sched in ("dplr", "online"):
        m = build_memory(spec, compile=False, chunk=4, heads=H)
        with torch.no_grad():
            o, st = m(ins["q"], ins["k"], ins["v"], eta=ins["eta"], alpha=ins["alpha"], schedule=sched)
        assert torch.allclose(o, hand, atol=1e-5, rtol=1e-4), sched
        assert torch.allclose(st["W"], W, atol=1e-5, rtol=1e-4), sched
    ref = reference.run(spec, **ins)[0]
    assert torch.allclose(ref, hand, atol=1e-5, rtol=1e-4)


COMBA_HEAD = """
memory m
dims { d_k = 6, d_v = 5 }
view q : d_k
view k : d_k
view v : d_v
view p : d_k
gate eta = sigmoid(logit)
gate alpha = sigmoid(logit) bias -2.0
state S : [d_k, d_v] = zeros
"""


@pytest.mark.parametrize("update", [
    "S = (1 - alpha) * S\n  S = S + eta * outer(k, v - p @ S)",
    "e = v - p @ ((1 - alpha) * S)\n  S = (1 - alpha) * S + eta * outer(k, e)",
    "S = (eye(d_k) - eta * outer(k, p)) @ ((1 - alpha) * S) + eta * outer(k, v)",
])
def test_comba_written_three_ways_gets_one_dplr_decision(update):
    """Comba's asymmetric rank one (error read at p, written at k) after a scalar decay, written in
    two statements, with a temporary, or as the transition matrix itself: dplr, the error read after
    the decay, b = p a vector of its own."""
    d = analyse(mem(COMBA_HEAD + "update {\n  " + update + "\n}\nread = q @ S\n"))
    assert d.family == "dplr" and d.admits == ("dplr", "online")
    plan = d.plan
    assert (str(plan.decay), plan.read_after_decay, plan.a_form, plan.b_form) == ("1 - alpha", True, "scalar",
                                                                                    "vector")
    assert [(str(st.a), str(st.b), str(st.k), str(st.v)) for st in plan.steps] == [("-eta", "p", "k", "eta * v")]
    assert "delta" in dict(d.rejected) and "not symmetric" in dict(d.rejected)["delta"]
