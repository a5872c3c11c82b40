"""The chained family (a read that chains probes of additive states: gated slot attention): the
value-decay kernel against its token loop, the decision (the shipped spec, the same memory written
other ways, refusals with their algebra), compiled modules against the reference interpreter
(outputs, states, gradients, gradcheck, causality, streaming, step) and against fla's
naive_recurrent_gsa."""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

import memspec
from memspec.runtime.chained import chunk_value_decay, recurrent_value_decay
from memspec.schedule import analyse, explain

from _compiled_harness import call, initial_state, make, reference_run, rel_err
from _compiled_harness import inputs as harness_inputs
from close import assert_same_function
from peers import fla_naive

SPECS = Path(__file__).resolve().parent.parent / "specs"


# ------------------------------------------------------------------ the kernel
def kernel_inputs(B, T, H, K, V, *, dtype=torch.float64, seed=0, log_lo=-3.0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, K, generator=g, dtype=dtype) for _ in range(2))
    w = torch.randn(B, T, H, V, generator=g, dtype=dtype)
    lg = log_lo * torch.rand(B, T, H, V, generator=g, dtype=dtype)
    S0 = torch.randn(B, H, K, V, generator=g, dtype=dtype)
    return q, k, w, lg, S0


def loop(q, k, w, lg, S0, inclusive=True):
    """S_t = S_{t-1} Diag(exp(lg_t)) + outer(k_t, w_t), o_t = q_t @ S_t, written here."""
    S, outs = S0, []
    for t in range(k.shape[1]):
        new = S * torch.exp(lg[:, t])[:, :, None, :] + torch.einsum("bhk,bhv->bhkv", k[:, t], w[:, t])
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], new if inclusive else S))
        S = new
    return torch.stack(outs, 1), S


@pytest.mark.parametrize("T,C,inclusive", [(37, 16, True), (50, 16, False), (64, 64, True), (5, 8, True),
                                           (100, 32, False), (1, 4, True), (29, 12, True)])
def test_value_decay_kernel_matches_the_loop(T, C, inclusive):
    xs = [x.requires_grad_() for x in kernel_inputs(2, T, 3, 4, 5)]
    got, ref = chunk_value_decay(*xs, C, inclusive=inclusive), loop(*xs, inclusive=inclusive)
    for a, b in zip(got, ref):
        assert_same_function(a, b)
    g = torch.Generator().manual_seed(9)
    wo, ws = torch.randn(ref[0].shape, generator=g, dtype=torch.float64), torch.randn(ref[1].shape, generator=g,
                                                                                       dtype=torch.float64)
    for a, b in zip(torch.autograd.grad((got[0] * wo).sum() + (got[1] * ws).sum(), xs),
                    torch.autograd.grad((ref[0] * wo).sum() + (ref[1] * ws).sum(), xs)):
        assert_same_function(a, b)
    for a, b in zip(recurrent_value_decay(*xs, inclusive=inclusive), ref):
        assert_same_function(a, b)


def test_value_decay_kernel_extreme_decays_stay_finite_and_exact():
    """Log decays down to -40 per token: float32 finite, equal to the float64 loop (gradients too)."""
    xs = kernel_inputs(1, 90, 2, 4, 6, log_lo=-40.0, seed=3)
    x32 = [x.float().requires_grad_() for x in xs]
    o, S = chunk_value_decay(*x32, 64)
    ro, rS = loop(*xs)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert rel_err(o, ro) <= 1e-5 and rel_err(S, rS) <= 1e-5
    grads = torch.autograd.grad(o.sum() + S.sum(), x32)
    assert all(torch.isfinite(gr).all() for gr in grads)


def test_value_decay_kernel_gradcheck_causality_streaming():
    xs = [x.requires_grad_() for x in kernel_inputs(1, 11, 2, 2, 3)]
    assert torch.autograd.gradcheck(lambda *z: chunk_value_decay(*z, 4), xs)
    assert torch.autograd.gradcheck(lambda *z: chunk_value_decay(*z, 4, inclusive=False), xs)
    q, k, w, lg, S0 = kernel_inputs(1, 40, 2, 3, 4, dtype=torch.float32)
    o, S = chunk_value_decay(q, k, w, lg, S0, 16)
    for bad_input in range(4):   # a NaN in token 19 of any input reaches no earlier output
        bad = [x.clone() for x in (q, k, w, lg)]
        bad[bad_input][:, 19] = float("nan")
        ob, _ = chunk_value_decay(*bad, S0, 16)
        assert torch.equal(ob[:, :19], o[:, :19]) and torch.isnan(ob[:, 19:]).any()
    o1, S1 = chunk_value_decay(q[:, :13], k[:, :13], w[:, :13], lg[:, :13], S0, 16)
    o2, S2 = chunk_value_decay(q[:, 13:], k[:, 13:], w[:, 13:], lg[:, 13:], S1, 16)
    assert_same_function(torch.cat([o1, o2], 1), o)
    assert_same_function(S2, S)
    none, S_only = chunk_value_decay(None, k, w, lg, S0, 16)
    assert none is None
    assert_same_function(S_only, S)   # the state-only path (no reads) against the full call
    empty, S_empty = chunk_value_decay(q[:, :0], k[:, :0], w[:, :0], lg[:, :0], S0, 16)
    assert empty.shape == (1, 0, 2, 4) and torch.equal(S_empty, S0)


# ------------------------------------------------------------------ the decision
GSA_WAYS = {   # the same memory: plain, with temporaries, with lets (the column decay as @ diag()), renamed
    "plain": ("""
        update {
          K = K * (1 - alpha) + outer(k, alpha)
          V = diag(1 - alpha) @ V + outer(alpha, v)
        }
        read = softmax(d_k^-0.5 * (q @ K), m) @ V"""),
    "temporaries": ("""
        update {
          a = outer(k, alpha)
          K = K * (1 - alpha)
          K = K + a
          V = diag(1 - alpha) @ V + outer(alpha, v)
        }
        read = softmax(d_k^-0.5 * (q @ K), m) @ V"""),
    "lets": ("""
        let keep = 1 - alpha
        let qs = d_k^-0.5 * q
        update {
          K = K @ diag(keep) + outer(k, alpha)
          V = diag(keep) @ V + outer(alpha, v)
        }
        read = softmax(qs @ K, m) @ V"""),
    "renamed": ("""
        update {
          Keys = Keys * (1 - alpha) + outer(k, alpha)
          Vals = diag(1 - alpha) @ Vals + outer(alpha, v)
        }
        read = softmax((q @ Keys) * d_k^-0.5, m) @ Vals"""),
}


def gsa_text(body: str, *, states=("K", "V"), extra: str = "") -> str:
    Kn, Vn = states
    return textwrap.dedent(f"""
        memory gsa_way
        dims {{ d_model = 16, heads = 2, d_k = 4, d_v = 5, m = 3 }}
        view q : d_k
        view k : d_k
        view v : d_v
        gate alpha : [m] = 1 - sigmoid(logit)^(1 / 8)
        state {Kn} : [d_k, m] = zeros
        state {Vn} : [m, d_v] = zeros
        {extra}""") + textwrap.dedent(body) + "\n"


def way(name: str):
    return memspec.loads(gsa_text(GSA_WAYS[name], states=("Keys", "Vals") if name == "renamed" else ("K", "V")), "mem")


def test_gsa_is_chained_exact_and_explained_truly():
    ds = [analyse(memspec.load(SPECS / f"gsa.{fmt}")) for fmt in ("yaml", "mem")]
    assert ds[0].family == ds[1].family == "chained" and ds[0].exact and ds[0].chunk == 64
    assert ds[0].plan == ds[1].plan
    assert ds[0].admits == ("chained", "scan", "online") and ds[0].schedules == ("chained", "online")
    assert [(p.state, p.stage) for p in ds[0].plan.probes] == [("K", 0), ("V", 1)]
    assert [(s.name, s.side) for s in ds[0].plan.states] == [("K", "columns"), ("V", "rows")]
    text = explain(memspec.load(SPECS / "gsa.yaml"))
    assert "gsa: chained (exact multi-pass chunked form" in text
    assert "only the read couples the states" in text and "pass 2:" in text
    for false in ("coupled linearly", "would only batch", "needs the full state"):
        assert false not in text
    assert "coupled linearly" not in dict(ds[0].rejected)["delta"]


@pytest.mark.parametrize("name", [n for n in GSA_WAYS if n != "plain"])
def test_gsa_written_other_ways_gets_the_same_decision_and_numbers(name):
    base, spec = way("plain"), way(name)
    d, d0 = analyse(spec), analyse(base)
    assert d.family == d0.family == "chained" and d.exact and d.admits == d0.admits
    assert [(s.side, p.stage) for s, p in zip(d.plan.states, d.plan.probes)] == [("columns", 0), ("rows", 1)]
    assert d.plan.inclusive and len(d.plan.probes) == 2
    outs = []
    for s in (base, spec):
        m = make(s, {"heads": 2, "d_k": 4, "d_v": 5, "m": 3}, dtype=torch.float64)
        ins = harness_inputs(s, m, T=9)
        o, fs = call(m, s, ins, initial_state(s, m), "chained")
        outs.append((o, list(fs.values())))
    assert_same_function(outs[1][0], outs[0][0])
    for a, b in zip(outs[1][1], outs[0][1]):
        assert_same_function(a, b)


@pytest.mark.parametrize("body,why", [
    ("""
     update {
       K = K * (1 - alpha) + outer(k, alpha)
       V = diag(1 - alpha) @ V + outer(alpha, v - alpha @ V)
     }
     read = softmax(q @ K, m) @ V""", "rank-one term"),
    ("""
     update {
       K = diag(b) @ K * (1 - alpha) + outer(k, alpha)
       V = diag(1 - alpha) @ V + outer(alpha, v)
     }
     read = softmax(q @ K, m) @ V""", "scales its rows and its columns"),
    ("""
     update {
       K = K * (1 - alpha) + outer(k, alpha)
       V = diag(1 - alpha) @ V + outer(alpha, v)
     }
     read = softmax(q @ K, m) @ tanh(V)""", "other than through a linear probe"),
    ("""
     update {
       K = K * (1 - alpha) + outer(k, alpha)
       V = diag(1 - alpha) @ V + outer(alpha, v)
     }
     read = tanh(q @ K) * (alpha @ V @ v)""", "no probe vector reads another probe"),
])
def test_what_is_not_a_chain_of_additive_probes_is_refused_with_its_algebra(body, why):
    extra = "gate b : [d_k] = sigmoid(logit)" if "diag(b)" in body else ""
    d = analyse(memspec.loads(gsa_text(body, extra=extra), "mem"))
    assert d.family != "chained" and why in dict(d.rejected)["chained"], dict(d.rejected)["chained"]


def test_the_paper_orientation_is_the_same_memory_transposed():
    """The paper's K~ [m, d_k] decayed on its rows and read K~ q: the kernels run on K~ᵀ, the same
    plan as the shipped orientation's, the same outputs, the key state transposed."""
    paper, plain = memspec.loads(VARIANTS["paper_orientation"], "mem"), way("plain")
    d, d0 = analyse(paper), analyse(plain)
    assert d.family == "chained" and [(s.name, s.side, s.transposed) for s in d.plan.states] == \
        [("K", "columns", True), ("V", "rows", False)]
    assert [p.columns for p in d.plan.probes] == [True, False]
    assert [(s.decay, s.terms) for s in d.plan.states] == [(s.decay, s.terms) for s in d0.plan.states]
    assert "the read probes K on its columns (K @ p): the kernels run on Kᵀ" in explain(paper)
    mp, m0 = make(paper, DIMS), make(plain, DIMS)
    ins = harness_inputs(paper, mp, T=9)
    st = initial_state(paper, mp)
    outs = [call(mp, paper, ins, dict(st), "chained"),
            call(m0, plain, ins, {"K": st["K"].transpose(-1, -2), "V": st["V"]}, "chained")]
    assert_same_function(outs[0][0], outs[1][0])
    assert_same_function(outs[0][1]["K"], outs[1][1]["K"].transpose(-1, -2))
    assert_same_function(outs[0][1]["V"], outs[1][1]["V"])


def test_shipped_decisions_do_not_change():
    for name, family in (("linear_attention", "additive"), ("gla", "additive"), ("deltanet", "delta"),
                         ("hgrn", "scan"), ("mamba", "scan"), ("momentum_deltanet", "momentum")):
        d = analyse(memspec.load(SPECS / f"{name}.yaml"))
        assert d.family == family and "chained" not in d.admits
        assert "chained:" not in explain(memspec.load(SPECS / f"{name}.yaml"))


# ------------------------------------------------------------------ compiled modules vs the reference
VARIANTS = {   # beyond the shipped spec: read before write, a vector normaliser, three stages
    "read_write": gsa_text("""
        update {
          K = K * (1 - alpha) + outer(k, alpha)
          V = diag(1 - alpha) @ V + outer(alpha, v)
        }
        read = softmax(d_k^-0.5 * (q @ K), m) @ V
        order read_write"""),
    "normalised": gsa_text("""
        update {
          K = K * (1 - alpha) + outer(k, alpha)
          V = diag(1 - alpha) @ V + outer(alpha, v) + outer(alpha, v) * 0.5
          z = (1 - alpha) * z + alpha
        }
        read = (softmax(q @ K, m) @ V) / (1 + softmax(q @ K, m) @ z)""", extra="state z : [m] = zeros"),
    "three_stages": gsa_text("""
        update {
          K = K * (1 - alpha) + outer(k, alpha)
          V = diag(1 - alpha) @ V + outer(alpha, v)
          W = e * W + outer(v, v)
        }
        read = tanh(softmax(q @ K, m) @ V) @ W""", extra="state W : [d_v, d_v] = zeros\ngate e : [] = sigmoid(logit)"),
}
VARIANTS["paper_orientation"] = gsa_text("""
        update {
          K = diag(1 - alpha) @ K + outer(alpha, k)
          V = diag(1 - alpha) @ V + outer(alpha, v)
        }
        read = V.T @ softmax(d_k^-0.5 * (K @ q), m)""").replace("state K : [d_k, m]", "state K : [m, d_k]")
DIMS = {"heads": 2, "d_k": 4, "d_v": 5, "m": 3}
ALL = ["gsa"] + list(VARIANTS)


def spec_of(name):
    return memspec.loads(VARIANTS[name], "mem") if name in VARIANTS else memspec.load(SPECS / f"{name}.yaml")


@pytest.mark.parametrize("name", ALL)
def test_compiled_matches_reference_outputs_states_gradients(name):
    spec = spec_of(name)
    d = analyse(spec)
    assert d.family == "chained", dict(d.rejected).get("chained")
    m = make(spec, DIMS, dtype=torch.float64)
    assert m.SCHEDULES == ("chained", "online")
    ins = harness_inputs(spec, m, T=11, requires_grad=True)
    st = initial_state(spec, m)
    ro, rs = reference_run(spec, m, DIMS, "online", st, ins)
    wrt = list(ins.values())
    g = torch.Generator().manual_seed(4)
    w_o = torch.randn(ro.shape, generator=g, dtype=torch.float64)
    ws = {n: torch.randn(t.shape, generator=g, dtype=torch.float64) for n, t in rs.items()}

    def scalar(o, s):
        return (o * w_o).sum() + sum((s[n] * w).sum() for n, w in ws.items())

    ref = torch.autograd.grad(scalar(ro, rs), wrt)
    for schedule in m.SCHEDULES:
        o, fs = call(m, spec, ins, dict(st), schedule)
        assert_same_function(o, ro, msg=schedule)
        for n in rs:
            assert_same_function(fs[n], rs[n], msg=f"{schedule} {n}")
        for a, b in zip(torch.autograd.grad(scalar(o, fs), wrt), ref):
            assert_same_function(a, b, msg=schedule)


@pytest.mark.parametrize("name", ALL)
def test_gradcheck_float64_chained_schedule(name):
    spec = spec_of(name)
    dims = {"heads": 1, "d_k": 2, "d_v": 3, "m": 2}
    m = make(spec, dims, chunk=2, dtype=torch.float64)
    ins = harness_inputs(spec, m, B=1, T=5, requires_grad=True)
    st = initial_state(spec, m, B=1)
    names = list(ins)

    def f(*xs):
        o, s = call(m, spec, dict(zip(names, xs)), dict(st), "chained")
        return (o,) + tuple(s[n] for n in spec.state)

    assert torch.autograd.gradcheck(f, tuple(ins.values()))


@pytest.mark.parametrize("name", ALL)
def test_chained_streaming_step_and_causality(name):
    spec = spec_of(name)
    m = make(spec, DIMS, dtype=torch.float32)
    ins = harness_inputs(spec, m, T=13, dtype=torch.float32)
    st = initial_state(spec, m, dtype=torch.float32)
    with torch.no_grad():
        o, fs = call(m, spec, ins, dict(st), "chained")
        o1, s1 = call(m, spec, {k: x[:, :6] for k, x in ins.items()}, dict(st), "chained")
        o2, s2 = call(m, spec, {k: x[:, 6:] for k, x in ins.items()}, s1, "chained")
        assert_same_function(torch.cat([o1, o2], 1), o)
        s, outs = dict(st), []
        for t in range(13):
            y, s = m.step(*[ins[v][:, t] for v in spec.views], **{g: ins[g][:, t] for g in spec.gates}, state=s)
            outs.append(y)
        assert_same_function(torch.stack(outs, 1), o)
        for n in spec.state:
            assert_same_function(s2[n], fs[n])
            assert_same_function(s[n], fs[n])
        for x in list(spec.views) + list(spec.gates):   # a NaN in token 7 reaches no earlier output
            bad = {k: v.clone() for k, v in ins.items()}
            bad[x][:, 7] = float("nan")
            ob, _ = call(m, spec, bad, dict(st), "chained")
            assert torch.equal(ob[:, :7], o[:, :7]), x
        later = {k: v.clone() for k, v in ins.items()}   # a changed future leaves the past alone
        later["q"][:, 9:] += 1.0
        assert torch.equal(call(m, spec, later, dict(st), "chained")[0][:, :9], o[:, :9])


# ------------------------------------------------------------------ the peer
def test_gsa_matches_fla_naive_recurrent_gsa():
    """fla's convention: q scaled by d_k^-1/2 inside the softmax over the slots, the slot gate
    g = log(1 - alpha), the slot write s = alpha, states hk [d_k, m] and hv [m, d_v]."""
    naive = fla_naive("gsa").naive_recurrent_gsa
    spec = memspec.load(SPECS / "gsa.yaml")
    B, T, H, K, V, M = 2, 150, 3, 8, 6, 5
    m = make(spec, {"heads": H, "d_k": K, "d_v": V, "m": M}, chunk=16, dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    q, k = (torch.randn(B, T, H, K, generator=g).requires_grad_() for _ in range(2))
    v = torch.randn(B, T, H, V, generator=g).requires_grad_()
    alpha = torch.rand(B, T, H, M, generator=g).clamp(1e-3, 1 - 1e-3).requires_grad_()
    hk, hv = torch.randn(B, H, K, M, generator=g), torch.randn(B, H, M, V, generator=g)
    ro, (rk, rv) = naive(q, k, v, alpha, torch.log(1 - alpha), None, (hk, hv), True)
    w = torch.randn(ro.shape, generator=g)
    wrt = (q, k, v, alpha)
    ref = torch.autograd.grad((ro * w).sum() + rk.sum() + rv.sum(), wrt)
    for schedule in m.SCHEDULES:
        o, s = m(q, k, v, alpha=alpha, state={"K": hk, "V": hv}, schedule=schedule)
        assert rel_err(o, ro) <= 1e-4 and rel_err(s["K"], rk) <= 1e-4 and rel_err(s["V"], rv) <= 1e-4
        for a, b in zip(torch.autograd.grad((o * w).sum() + s["K"].sum() + s["V"].sum(), wrt), ref):
            assert rel_err(a, b) <= 1e-4


def test_packed_documents_run_each_from_its_own_state():
    """cu_seqlens: each document alone from its own state row, as separate calls (the chained kernels take
    no packed row: the module runs the documents of each length as one batch)."""
    spec = spec_of("gsa")
    m = make(spec, DIMS, dtype=torch.float64)
    bounds = [0, 5, 12, 20]
    ins = harness_inputs(spec, m, B=1, T=20)
    st = initial_state(spec, m, B=3)
    o, fs = m(*[ins[v] for v in spec.views], **{g: ins[g] for g in spec.gates}, state=dict(st),
              cu_seqlens=torch.tensor(bounds))
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        part = {n: x[:, a:b] for n, x in ins.items()}
        oi, si = call(m, spec, part, {n: s[i:i + 1] for n, s in st.items()}, "chained")
        assert_same_function(o[:, a:b], oi)
        for n in spec.state:
            assert_same_function(fs[n][i:i + 1], si[n])


def test_the_benchmark_script_runs_and_checks_its_peers():
    """benchmarks/gsa.py at a tiny size: the chained form, its online schedule and fla's naive recurrence
    agree (exit status 0) and the ratios are printed."""
    import contextlib
    import importlib.util
    import io
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "gsa.py"
    spec = importlib.util.spec_from_file_location("bench_gsa", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    threads = torch.get_num_threads()
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            assert module.main(["--T", "40", "--H", "1", "--D", "8", "--m", "4", "--chunk", "16", "--threads", "1",
                                "--repeat", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    text = out.getvalue()
    assert "memspec online" in text and "x the chained form" in text


@pytest.mark.parametrize("inclusive", [False, True])
def test_the_specialised_value_decay_kernel_equals_the_general_one(inclusive):
    """The kernel as a generated module carries it (``inclusive`` bound): the same function (two
    code paths: compared at the dtype's tolerance)."""
    import inspect
    from memspec.codegen.context import runtime_source
    from memspec.codegen.specialise import specialise
    from memspec.runtime.chained import _value_decay_reads
    from memspec.runtime.phases import _pass_states
    ns = {"torch": torch}
    exec(runtime_source(_value_decay_reads), ns)
    exec(runtime_source(_pass_states), ns)
    exec(specialise(chunk_value_decay, inclusive=inclusive), ns)
    fn = ns["chunk_value_decay"]
    assert "inclusive" not in inspect.signature(fn).parameters
    xs = kernel_inputs(2, 37, 2, 3, 4)
    for a, b in zip(fn(*xs, 8), chunk_value_decay(*xs, 8, inclusive=inclusive)):
        assert_same_function(a, b)
