"""The solve family (a read p @ solve(H + lam I, G) of an additive state: the mesa layer): the
chunked conjugate-gradient kernel against its token loop (both paths: conjugate gradients for a
symmetric initial state, the direct solve for one that is not), the decision (the shipped spec, the
same memory written other ways, refusals with their algebra), compiled modules against the reference
interpreter and the online schedule (outputs, states, gradients, gradcheck, causality, streaming,
step, packed documents), float32 against online at the solver's tolerance, and fla's MesaNet
references."""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

import memspec
from memspec.runtime.solve import _solve_tolerance, chunk_solve, recurrent_solve
from memspec.schedule import analyse, explain

from _compiled_harness import call, make, reference_run, rel_err
from _compiled_harness import inputs as harness_inputs
from close import assert_same_function
from peers import fla_naive

SPECS = Path(__file__).resolve().parent.parent / "specs"


# ------------------------------------------------------------------ the kernel
def kernel_inputs(B, T, H, K, *, dtype=torch.float64, seed=0, symmetric=True, log_lo=-0.3):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=g, dtype=dtype)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g, dtype=dtype), dim=-1)
    beta = torch.rand(B, T, H, generator=g, dtype=dtype)
    lg = log_lo * torch.rand(B, T, H, generator=g, dtype=dtype)
    M = torch.randn(B, H, K, K, generator=g, dtype=dtype)
    P = M @ M.transpose(-1, -2)
    H0 = 0.15 * (P + P.transpose(-1, -2)) if symmetric else 0.2 * M   # symmetric PSD, or any matrix
    return q, k, beta, lg, H0


def weighted(x, S, seed=9):
    g = torch.Generator().manual_seed(seed)
    return (x * torch.randn(x.shape, generator=g, dtype=x.dtype)).sum() + \
        (S * torch.randn(S.shape, generator=g, dtype=S.dtype)).sum()


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("T,C,inclusive", [(37, 16, True), (50, 16, False), (64, 64, True), (5, 8, True),
                                           (1, 4, False), (29, 12, True)])
def test_kernel_matches_the_token_loop(T, C, inclusive, symmetric):
    xs = [x.requires_grad_() for x in kernel_inputs(2, T, 3, 6, symmetric=symmetric)]
    got = chunk_solve(*xs, 0.7, C, inclusive=inclusive)
    ref = recurrent_solve(*xs, 0.7, inclusive=inclusive)
    # float64 conjugate gradients stops at a relative residual of 1e-12: the error is that times the
    # condition number (below 10 here)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    for a, b in zip(torch.autograd.grad(weighted(*got), xs), torch.autograd.grad(weighted(*ref), xs)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_kernel_without_decay_and_from_zeros():
    q, k, beta, _, _ = kernel_inputs(1, 40, 2, 5)
    for a, b in zip(chunk_solve(q, k, beta, None, None, 0.5, 8), recurrent_solve(q, k, beta, None, None, 0.5)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_kernel_gradcheck_both_paths():
    for symmetric in (True, False):
        xs = [x.requires_grad_() for x in kernel_inputs(1, 9, 2, 3, symmetric=symmetric)]
        assert torch.autograd.gradcheck(lambda *z: chunk_solve(*z, 0.5, 4), xs)
        assert torch.autograd.gradcheck(lambda *z: chunk_solve(*z, 0.5, 4, inclusive=False), xs)


def test_kernel_group_size_changes_nothing_and_zero_rows_solve_at_once():
    """A converged token stops moving, so grouping the chunks otherwise gives the same numbers; a zero
    right-hand side gives x = 0 (no 0 / 0)."""
    q, k, beta, lg, H0 = kernel_inputs(1, 70, 2, 6)
    q[:, 10] = 0.0
    x, S = chunk_solve(q, k, beta, lg, H0, 1.0, 8)
    for group in (1, 3):
        xg, Sg = chunk_solve(q, k, beta, lg, H0, 1.0, 8, group=group)
        torch.testing.assert_close(xg, x, rtol=1e-12, atol=1e-12)
        assert_same_function(Sg, S)
    assert torch.equal(x[:, 10], torch.zeros_like(x[:, 10]))


def test_kernel_causality_and_streaming():
    q, k, beta, lg, H0 = kernel_inputs(1, 40, 2, 4, dtype=torch.float32)
    x, S = chunk_solve(q, k, beta, lg, H0, 1.0, 16)
    for i in range(4):   # a NaN in token 19 of any input reaches no earlier output
        bad = [t.clone() for t in (q, k, beta, lg)]
        bad[i][:, 19] = float("nan")
        xb, _ = chunk_solve(*bad, H0, 1.0, 16)
        assert torch.equal(xb[:, :19], x[:, :19]) and torch.isnan(xb[:, 19:]).any()
    x1, S1 = chunk_solve(q[:, :13], k[:, :13], beta[:, :13], lg[:, :13], H0, 1.0, 16)
    assert torch.equal(S1, S1.transpose(-1, -2))   # the state stays symmetric: the next call's CG path
    x2, S2 = chunk_solve(q[:, 13:], k[:, 13:], beta[:, 13:], lg[:, 13:], S1, 1.0, 16)
    torch.testing.assert_close(torch.cat([x1, x2], 1), x, rtol=1e-5, atol=1e-6)
    assert_same_function(S2, S)
    empty, S_empty = chunk_solve(q[:, :0], k[:, :0], beta[:, :0], lg[:, :0], H0, 1.0, 16)
    assert empty.shape == (1, 0, 2, 4) and torch.equal(S_empty, H0)


def test_float32_matches_the_float64_solution_to_the_tolerance_times_the_condition_number():
    """The claim explain makes: exact to the solver's tolerance.  At the mesa layer's working point
    (l2-normalised keys, write weights sigmoid(N(0, 1)), decays near 0.98, lam = 1, T = 512, d = 32),
    float32 conjugate gradients stops at a relative residual of 1e-6; its error against the float64
    solution is at most that times the condition number of the systems, as is online's float32 solve
    (LU) at float32 rounding."""
    g = torch.Generator().manual_seed(3)
    B, T, H, K = 1, 512, 2, 32
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g, dtype=torch.float64), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g, dtype=torch.float64), dim=-1)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=g, dtype=torch.float64))
    lg = torch.log(1 - torch.sigmoid(torch.randn(B, T, H, generator=g, dtype=torch.float64) - 4.0))
    x64, S64 = recurrent_solve(q, k, beta, lg, None, 1.0)
    H_all = torch.linalg.eigvalsh(S64)   # (the last state: the systems' scale at this working point)
    kappa = float((H_all.max() + 1.0) / (H_all.clamp_min(0).min() + 1.0))
    x32, S32 = chunk_solve(*(t.float() for t in (q, k, beta, lg)), None, 1.0, 64)
    per_token = ((x32.double() - x64).norm(dim=-1) / x64.norm(dim=-1)).max().item()
    assert per_token <= 4 * _solve_tolerance(torch.float32) * kappa, (per_token, kappa)
    xo, _ = recurrent_solve(*(t.float() for t in (q, k, beta, lg)), None, 1.0)
    assert rel_err(x32, xo) <= 4 * _solve_tolerance(torch.float32) * kappa


# ------------------------------------------------------------------ the decision
HEAD = """
    memory mesa_way
    dims { d_model = 16, heads = 2, d_k = 4, d_v = 3 }
    const lam = 0.5
    view q : d_k
    view k : d_k
    view v : d_v
    gate eta = sigmoid(logit)
    gate alpha = sigmoid(logit)
    state H : [d_k, d_k] = zeros
    state G : [d_k, d_v] = zeros
"""
WAYS = {   # the same memory: plain, lets and the regulariser first, temporaries
    "plain": """
        update {
          H = (1 - alpha) * H + eta * outer(k, k)
          G = (1 - alpha) * G + eta * outer(k, v)
        }
        read = q @ solve(H + lam * eye(d_k), G)""",
    "lets": """
        let keep = 1 - alpha
        let ks = eta * k
        update {
          H = keep * H + outer(ks, k)
          G = keep * G + outer(ks, v)
        }
        read = q @ solve(lam * eye(d_k) + H, G)""",
    "temporaries": """
        update {
          a = eta * outer(k, k)
          H = (1 - alpha) * H
          H = H + a
          G = (1 - alpha) * G + eta * outer(k, v)
        }
        read = q @ solve(H + eye(d_k) * lam, G)""",
}
VARIANTS = {   # beyond the shipped spec: read before write, a nonlinear read of the probe, no decay
    "read_write": WAYS["plain"] + "\norder read_write",
    "tanh_read": WAYS["plain"].replace("read = q @ solve(H + lam * eye(d_k), G)",
                                       "read = tanh(q @ solve(H + lam * eye(d_k), G)) * 2"),
    "no_decay": """
        update {
          H = H + eta * outer(k, k)
          G = G + outer(k, v)
        }
        read = q @ solve(H + lam * eye(d_k), G)""",
}


def way(body: str):
    return memspec.loads(textwrap.dedent(HEAD) + textwrap.dedent(body) + "\n", "mem")


def test_mesa_is_solve_and_explained_truly():
    ds = [analyse(memspec.load(SPECS / f"mesa.{fmt}")) for fmt in ("yaml", "mem")]
    assert ds[0].family == ds[1].family == "solve" and ds[0].exact and ds[0].chunk == 32
    assert ds[0].plan == ds[1].plan and ds[0].schedules == ("solve", "online")
    text = explain(memspec.load(SPECS / "mesa.yaml"))
    assert "exact to the solver's tolerance (1e-06 in float32, 1e-12 in float64" in text
    assert "at most 64 steps" in text
    for false in ("would only batch", "needs the full state"):
        assert false not in text


@pytest.mark.parametrize("name", list(WAYS) + list(VARIANTS))
def test_the_same_memory_written_other_ways_gets_the_same_decision(name):
    d = analyse(way({**WAYS, **VARIANTS}[name]))
    assert d.family == "solve", dict(d.rejected).get("solve")
    if name in WAYS:
        ref = analyse(way(WAYS["plain"])).plan
        assert (d.plan.state, d.plan.lam, d.plan.probe.name, d.plan.steps) == ("H", 0.5, "G", 4)
        assert d.plan.inclusive == ref.inclusive


@pytest.mark.parametrize("body, why", [
    (WAYS["plain"].replace("eta * outer(k, k)", "outer(k, eta * q)"), "is not symmetric"),
    (WAYS["plain"].replace("eta * outer(k, k)", "(eta - 0.5) * outer(k, k)"), "is not provably >= 0"),
    (WAYS["plain"].replace("lam * eye(d_k)", "eta * eye(d_k)"), "is not a constant > 0"),
    (WAYS["plain"].replace("(1 - alpha) * H", "(1 - alpha) * H @ diag(k)"), "is not a scalar decay"),
    (WAYS["plain"].replace("q @ solve(H + lam * eye(d_k), G)", "q @ solve(H + lam * eye(d_k), G) + q @ H"),
     "a state outside p @ solve"),
])
def test_refusals_say_the_algebra(body, why):
    d = analyse(way(body))
    assert d.family == "online"
    assert why in dict(d.rejected)["solve"], dict(d.rejected)["solve"]


def test_a_learned_initial_state_is_refused():
    spec = way(WAYS["plain"])
    text = textwrap.dedent(HEAD).replace("state H : [d_k, d_k] = zeros", "state H : [d_k, d_k] = learned")
    d = analyse(memspec.loads(text + textwrap.dedent(WAYS["plain"]) + "\n", "mem"))
    assert d.family == "online" and "not provably symmetric positive semi-definite" in dict(d.rejected)["solve"]
    assert analyse(spec).family == "solve"


# ------------------------------------------------------------------ compiled modules
DIMS = {"heads": 2, "d_k": 4, "d_v": 3}
ALL = ["mesa"] + list(VARIANTS)


def spec_of(name):
    return memspec.load(SPECS / "mesa.yaml") if name == "mesa" else way(VARIANTS[name])


def symmetric_state(m, B=2, seed=2, dtype=torch.float64):
    """A nonzero initial state the solve schedule runs by conjugate gradients: H symmetric PSD."""
    g = torch.Generator().manual_seed(seed)
    M = torch.randn(B, m.heads, m.d_k, m.d_k, generator=g, dtype=dtype)
    P = M @ M.transpose(-1, -2)
    return {"H": 0.1 * (P + P.transpose(-1, -2)), "G": 0.1 * torch.randn(B, m.heads, m.d_k, m.d_v, generator=g,
                                                                       dtype=dtype)}


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("symmetric", [True, False])
def test_compiled_matches_reference_and_online(name, symmetric):
    spec = spec_of(name)
    dims = {d: n for d, n in DIMS.items() if d in spec.dims}
    m = make(spec, dims, dtype=torch.float64)
    assert m.SCHEDULES == ("solve", "online") and m.DEFAULT_SCHEDULE == "solve"
    ins = harness_inputs(spec, m, T=11, requires_grad=True)
    st = symmetric_state(m)
    if not symmetric:   # any matrix: the kernel's direct solve
        st["H"] = st["H"] + 0.1 * torch.randn(st["H"].shape, generator=torch.Generator().manual_seed(5),
                                              dtype=torch.float64)
    ro, rs = reference_run(spec, m, dims, "online", st, ins)
    wrt = list(ins.values())
    ref = torch.autograd.grad(weighted(ro, rs["H"]) + rs["G"].sum(), wrt, materialize_grads=True)
    for schedule in m.SCHEDULES:
        o, fs = call(m, spec, ins, dict(st), schedule)
        torch.testing.assert_close(o, ro, rtol=1e-10, atol=1e-10, msg=schedule)
        for n in rs:
            torch.testing.assert_close(fs[n], rs[n], rtol=1e-12, atol=1e-12, msg=f"{schedule} {n}")
        for a, b in zip(torch.autograd.grad(weighted(o, fs["H"]) + fs["G"].sum(), wrt, materialize_grads=True), ref):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=schedule)


@pytest.mark.parametrize("name", ALL)
def test_gradcheck_float64_solve_schedule(name):
    spec = spec_of(name)
    dims = {"heads": 1, "d_k": 3, "d_v": 2}
    m = make(spec, dims, chunk=2, dtype=torch.float64)
    ins = harness_inputs(spec, m, B=1, T=5, requires_grad=True)
    st = symmetric_state(m, B=1)
    names = list(ins)

    def f(*xs):
        o, s = call(m, spec, dict(zip(names, xs)), dict(st), "solve")
        return (o,) + tuple(s[n] for n in spec.state)

    assert torch.autograd.gradcheck(f, tuple(ins.values()))


@pytest.mark.parametrize("name", ALL)
def test_streaming_step_and_causality(name):
    spec = spec_of(name)
    dims = {d: n for d, n in DIMS.items() if d in spec.dims}
    m = make(spec, dims, dtype=torch.float32)
    ins = harness_inputs(spec, m, T=13, dtype=torch.float32)
    st = symmetric_state(m, dtype=torch.float32)
    with torch.no_grad():
        o, fs = call(m, spec, ins, dict(st), "solve")
        o1, s1 = call(m, spec, {k: x[:, :6] for k, x in ins.items()}, dict(st), "solve")
        o2, s2 = call(m, spec, {k: x[:, 6:] for k, x in ins.items()}, s1, "solve")
        torch.testing.assert_close(torch.cat([o1, o2], 1), o, rtol=1e-5, atol=1e-5)
        s, outs = dict(st), []
        for t in range(13):
            y, s = m.step(*[ins[v][:, t] for v in spec.views], **{g: ins[g][:, t] for g in spec.gates}, state=s)
            outs.append(y)
        torch.testing.assert_close(torch.stack(outs, 1), o, rtol=1e-5, atol=1e-5)
        for n in spec.state:
            assert_same_function(s2[n], fs[n])
            assert_same_function(s[n], fs[n])
        for x in list(spec.views) + list(spec.gates):   # a NaN in token 7 reaches no earlier output
            bad = {k: v.clone() for k, v in ins.items()}
            bad[x][:, 7] = float("nan")
            ob, _ = call(m, spec, bad, dict(st), "solve")
            assert torch.equal(ob[:, :7], o[:, :7]), x
        later = {k: v.clone() for k, v in ins.items()}   # a changed future leaves the past alone
        later["q"][:, 9:] += 1.0
        assert torch.equal(call(m, spec, later, dict(st), "solve")[0][:, :9], o[:, :9])


def test_packed_documents_run_each_from_its_own_state():
    """cu_seqlens: one call of both kernels over the packed row equals each document alone."""
    spec = spec_of("mesa")
    m = make(spec, DIMS, dtype=torch.float64)
    bounds = [0, 5, 12, 12, 20]
    ins = harness_inputs(spec, m, B=1, T=20)
    st = symmetric_state(m, B=4)
    o, fs = m(*[ins[v] for v in spec.views], **{g: ins[g] for g in spec.gates}, state=dict(st),
              cu_seqlens=torch.tensor(bounds))
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        part = {n: x[:, a:b] for n, x in ins.items()}
        oi, si = call(m, spec, part, {n: s[i:i + 1] for n, s in st.items()}, "online")
        torch.testing.assert_close(o[:, a:b], oi, rtol=1e-10, atol=1e-10)
        for n in spec.state:
            assert_same_function(fs[n][i:i + 1], si[n])


# ------------------------------------------------------------------ the peers
def fla_case(T=128, H=2, K=16, seed=0):
    """Inputs at the mesa layer's working point, in both conventions: memspec's module takes raw q, k
    and the gates eta, alpha; fla takes the normalised q, k, g = log(1 - alpha), beta = eta and one
    regulariser per head and channel, lamb [H, K] = lam."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, T, H, K, generator=g) for _ in range(3))
    eta = torch.sigmoid(torch.randn(1, T, H, generator=g))
    alpha = torch.sigmoid(torch.randn(1, T, H, generator=g) - 4.0)
    return q, k, v, eta, alpha


def test_mesa_matches_fla_naive_mesa_net_exact_and_its_chunked_cg():
    """fla's naive_mesa_net_exact (a token loop and torch.linalg.solve; fla's h_kk is H, h_kv is G, o = x @ h_kv
    with x = (h_kk + diag(lamb))^-1 q): the same function at float32, relative error <= 1e-4 (outputs and both
    final states).  fla's naive_mesa_net_CG (chunked conjugate gradients, a fixed 30 steps, 1e-5 added to
    its denominators) is an approximation: its states are exact (<= 1e-4), its outputs differ from the exact
    solution by about 3e-4 here, and memspec's (run to the solver's tolerance) are closer to it than fla's."""
    peer = fla_naive("mesa_net")
    spec = memspec.load(SPECS / "mesa.yaml")
    H, K = 2, 16
    m = make(spec, {"heads": H, "d_k": K, "d_v": K}, chunk=32, dtype=torch.float32)
    q, k, v, eta, alpha = fla_case(H=H, K=K)
    lamb = torch.full((H, K), spec.constants["lam"])
    qn, kn = (torch.nn.functional.normalize(x, dim=-1) for x in (q, k))
    g = torch.log(1 - alpha)
    with torch.no_grad():
        o, s = m(q, k, v, eta=eta, alpha=alpha)
        ro, rH, rG = peer.naive_mesa_net_exact(qn, kn, v, g, lamb, eta)
        assert rel_err(o, ro) <= 1e-4 and rel_err(s["H"], rH) <= 1e-4 and rel_err(s["G"], rG) <= 1e-4
        co, cH, cG = peer.naive_mesa_net_CG(qn, kn, v, g, lamb, eta, 32)
        assert rel_err(s["H"], cH) <= 1e-4 and rel_err(s["G"], cG) <= 1e-4
        assert rel_err(o, ro) * 10 <= rel_err(co, ro) <= 1e-3


def test_module_float32_matches_online_to_the_tolerance_times_the_condition_number():
    """The module's default schedule in float32 against its online schedule in float64, at the bound
    explain states (the solver's tolerance times the systems' condition number), beside online's own
    float32 error; bfloat16 inputs solve in float32 and return bfloat16."""
    spec = memspec.load(SPECS / "mesa.yaml")
    m = make(spec, {"heads": 2, "d_k": 32, "d_v": 16}, chunk=32, dtype=torch.float32)
    q, k, v, eta, alpha = fla_case(T=300, H=2, K=32, seed=4)
    v = v[..., :16]
    with torch.no_grad():
        o, s = m(q, k, v, eta=eta, alpha=alpha)
        o32, _ = m(q, k, v, eta=eta, alpha=alpha, schedule="online")
        ref, rs = m.double()(q.double(), k.double(), v.double(), eta=eta.double(), alpha=alpha.double(),
                             schedule="online")
        m.float()
        ev = torch.linalg.eigvalsh(rs["H"])
        kappa = float((ev.max() + 1.0) / (ev.clamp_min(0).min() + 1.0))
        bound = 4 * _solve_tolerance(torch.float32) * kappa
        assert rel_err(o, ref) <= bound and rel_err(o32, ref) <= bound, (rel_err(o, ref), rel_err(o32, ref), kappa)
        ob, _ = m(q.bfloat16(), k.bfloat16(), v.bfloat16(), eta=eta.bfloat16(), alpha=alpha.bfloat16())
        assert ob.dtype == torch.bfloat16 and rel_err(ob, ref) <= 2e-2


def test_compile_option_keeps_the_solve_eager_and_equal():
    """compile=True compiles the token step only; the conjugate-gradient loop (a data-dependent
    stop) stays eager, with the same numbers."""
    spec = memspec.load(SPECS / "mesa.yaml")
    eager = make(spec, DIMS, dtype=torch.float64)
    compiled = make(spec, DIMS, dtype=torch.float64, compile=True)
    ins = harness_inputs(spec, eager, T=9)
    st = symmetric_state(eager)
    assert_same_function(call(compiled, spec, ins, dict(st))[0], call(eager, spec, ins, dict(st))[0])


def test_the_benchmark_script_runs_and_checks_its_peers(capsys):
    """benchmarks/mesa.py at a tiny size: the solve form, its online schedule and fla's references run,
    the solve form within 1e-4 of the float64 online schedule (exit status 0)."""
    import importlib.util
    path = SPECS.parent / "benchmarks" / "mesa.py"
    module_spec = importlib.util.spec_from_file_location("bench_mesa", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    threads = torch.get_num_threads()
    try:
        assert module.main(["--T", "64", "--H", "1", "--D", "8", "--chunk", "16", "--fla-chunk", "16", "--threads", "1",
                            "--repeat", "1", "--exact"]) == 0
    finally:
        torch.set_num_threads(threads)
    text = capsys.readouterr().out
    assert "memspec online" in text and "x the solve form" in text
