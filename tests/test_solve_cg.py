"""The language's ``cg(A, B, steps)`` (a fixed number of conjugate-gradient steps from x = 0, the
MesaNet paper's solver) and the solve family running it: a 2x2 system by hand, the reference
interpreter's ``cg``, the module's helper and the chunked kernel against one another (1 step, 2
steps, K steps against the exact solve), a per-dimension regulariser ``Diag(lam)``, the kernel's
float64 gradcheck (differentiated through the iterations), specs/variants/mesa_cg.yaml compiled on
every admitted schedule against the reference (outputs, states, gradients, params included),
causality, streaming, step, packed documents, the decision and its refusals, and bad step counts
(located errors, no traceback)."""
from __future__ import annotations

import contextlib
import io
import textwrap
from pathlib import Path

import pytest
import torch

import memspec
from memspec.reference import conjugate_gradients
from memspec.runtime.solve import cg, chunk_solve
from memspec.schedule import analyse, explain
from memspec.tools.cli import main

from _compiled_harness import call, make, reference_run
from _compiled_harness import inputs as harness_inputs
from close import assert_same_function

ROOT = Path(__file__).resolve().parent.parent
VARIANT = ROOT / "specs" / "variants" / "mesa_cg.yaml"


# ------------------------------------------------------------------ cg by hand
# A = [[4, 1], [1, 3]], b = [1, 2], from x0 = 0:
#   r0 = p0 = [1, 2], r0.r0 = 5, A p0 = [6, 7], p0.A p0 = 20, alpha0 = 5/20 = 1/4
#   x1 = [1/4, 1/2], r1 = [1, 2] - [6, 7]/4 = [-1/2, 1/4], r1.r1 = 5/16, beta1 = (5/16)/5 = 1/16
#   p1 = r1 + p0/16 = [-7/16, 3/8], A p1 = [-11/8, 11/16], p1.A p1 = 77/128 + 33/128 = 55/64
#   alpha1 = (5/16)/(55/64) = 4/11, x2 = [1/4 - 7/44, 1/2 + 3/22] = [1/11, 7/11] = A^-1 b (det 11)
A22 = torch.tensor([[4.0, 1.0], [1.0, 3.0]], dtype=torch.float64)
B22 = torch.tensor([1.0, 2.0], dtype=torch.float64)
BY_HAND = {1: [1 / 4, 1 / 2], 2: [1 / 11, 7 / 11], 3: [1 / 11, 7 / 11]}


@pytest.mark.parametrize("steps", [1, 2, 3])
def test_two_by_two_by_hand(steps):
    want = torch.tensor(BY_HAND[steps], dtype=torch.float64)
    ref = conjugate_gradients(A22.reshape(1, 1, 2, 2), B22.reshape(1, 1, 2, 1), steps).reshape(2)
    helper = cg(A22, B22.unsqueeze(-1), steps).squeeze(-1)
    # the kernel: one token, H_0 = A - I (no write, no decay), lam = 1
    q = B22.reshape(1, 1, 1, 2)
    x, _ = chunk_solve(q, torch.zeros_like(q), torch.zeros(1, 1, 1, dtype=torch.float64), None,
                       (A22 - torch.eye(2, dtype=torch.float64)).reshape(1, 1, 2, 2), 1.0, 1, steps=steps, fixed=True)
    for got in (ref, helper, x.reshape(2)):
        torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-15)


def test_a_zero_right_hand_side_stops_at_once_without_nan_gradients():
    """A zero column has converged at once: it stays at 0 and its divisions are by 1."""
    A = (A22 * 1.0).requires_grad_()
    Bm = torch.stack([B22, torch.zeros(2, dtype=torch.float64)], -1).requires_grad_()   # [2, 2]: a zero column
    x = conjugate_gradients(A, Bm, 4)
    # exactly 0 (tolerance 0): the column never moves, so no rounding can enter it
    torch.testing.assert_close(x[:, 1], torch.zeros(2, dtype=torch.float64), rtol=0.0, atol=0.0)
    gA, gB = torch.autograd.grad(x.sum(), (A, Bm))
    assert torch.isfinite(gA).all() and torch.isfinite(gB).all()
    assert_same_function(cg(A, Bm, 4), x)


# ------------------------------------------------------------------ the kernel
def kernel_inputs(B, T, H, K, *, dtype=torch.float64, seed=0, symmetric=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=g, dtype=dtype)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g, dtype=dtype), dim=-1)
    beta = torch.rand(B, T, H, generator=g, dtype=dtype)
    lg = -0.3 * torch.rand(B, T, H, generator=g, dtype=dtype)
    M = torch.randn(B, H, K, K, generator=g, dtype=dtype)
    P = M @ M.transpose(-1, -2)
    H0 = 0.15 * (P + P.transpose(-1, -2)) if symmetric else 0.2 * M
    lam = 0.5 + torch.rand(B, T, H, K, generator=g, dtype=dtype)     # one per token and key channel
    return q, k, beta, lg, H0, lam


def token_loop(q, k, beta, lg, H0, lam, steps, inclusive=True):
    """Every token's matrix formed, then the reference interpreter's cg on it."""
    S, xs = H0, []
    for t in range(q.shape[1]):
        before = S
        S = torch.exp(lg[:, t])[..., None, None] * S + beta[:, t][..., None, None] * (
            k[:, t].unsqueeze(-1) * k[:, t].unsqueeze(-2))
        lam_t = lam[:, t] if torch.is_tensor(lam) else lam * torch.ones_like(q[:, t])
        A = (S if inclusive else before) + torch.diag_embed(lam_t)
        xs.append(conjugate_gradients(A, q[:, t].unsqueeze(-1), steps).squeeze(-1))
    return torch.stack(xs, 1), S


def weighted(x, S, seed=9):
    g = torch.Generator().manual_seed(seed)
    return (x * torch.randn(x.shape, generator=g, dtype=x.dtype)).sum() + \
        (S * torch.randn(S.shape, generator=g, dtype=S.dtype)).sum()


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("steps,T,C,inclusive", [(1, 11, 4, True), (3, 37, 16, False), (5, 29, 12, True)])
def test_kernel_matches_the_token_loop(steps, T, C, inclusive, per_channel, symmetric):
    *xs, lam = kernel_inputs(2, T, 3, 6, symmetric=symmetric)
    lam = lam if per_channel else 0.7
    xs = [x.requires_grad_() for x in xs] + ([lam.requires_grad_()] if per_channel else [])
    args = xs if per_channel else xs + [lam]
    got = chunk_solve(*args, C, inclusive=inclusive, steps=steps, fixed=True)
    ref = token_loop(*args, steps, inclusive=inclusive)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-12)
    for a, b in zip(torch.autograd.grad(weighted(*got), xs), torch.autograd.grad(weighted(*ref), xs)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-11)


def test_kernel_gradcheck_float64():
    """Through the iterations (both paths: chunk-level products, formed matrices), a learned
    regulariser per channel included; and the exact solve with a per-channel regulariser."""
    for symmetric in (True, False):
        xs = [x.requires_grad_() for x in kernel_inputs(1, 9, 2, 3, symmetric=symmetric)]
        assert torch.autograd.gradcheck(lambda *z: chunk_solve(*z, 4, steps=2, fixed=True), xs)
        assert torch.autograd.gradcheck(lambda *z: chunk_solve(*z[:5], 0.6, 4, steps=3, fixed=True,
                                                               inclusive=False), xs[:5])
        assert torch.autograd.gradcheck(lambda *z: chunk_solve(*z, 4), xs)


def test_one_step_is_the_scaled_residual_and_K_steps_the_exact_solve():
    """cg(A, q, 1) = (q.q / q.A q) q; cg(A, q, K) equals the exact solve (K the system's size) to
    float64 rounding times the condition number."""
    q, k, beta, lg, H0, lam = kernel_inputs(1, 20, 2, 5)
    x1, _ = chunk_solve(q, k, beta, lg, H0, lam, 8, steps=1, fixed=True)
    _, S = token_loop(q, k, beta, lg, H0, lam, 1)
    A_last = S + torch.diag_embed(lam[:, -1])
    ql = q[:, -1]
    Aq = (A_last @ ql.unsqueeze(-1)).squeeze(-1)
    want = ((ql * ql).sum(-1) / (ql * Aq).sum(-1)).unsqueeze(-1) * ql
    torch.testing.assert_close(x1[:, -1], want, rtol=1e-12, atol=1e-13)
    xK, _ = chunk_solve(q, k, beta, lg, H0, lam, 8, steps=5, fixed=True)
    exact, _ = chunk_solve(q, k, beta, lg, H0, lam, 8)
    torch.testing.assert_close(xK, exact, rtol=1e-9, atol=1e-10)
    assert (x1 - exact).abs().max() > 1e-2   # one step is not the solve


def test_kernel_group_size_causality_and_streaming():
    q, k, beta, lg, H0, lam = kernel_inputs(1, 40, 2, 4, dtype=torch.float32)
    x, S = chunk_solve(q, k, beta, lg, H0, lam, 16, steps=3, fixed=True)
    for group in (1, 2):
        xg, Sg = chunk_solve(q, k, beta, lg, H0, lam, 16, steps=3, fixed=True, group=group)
        assert_same_function(xg, x)
        assert_same_function(Sg, S)
    for i, t in enumerate((q, k, beta, lg)):   # a NaN in token 19 of any input reaches no earlier output
        bad = [u.clone() for u in (q, k, beta, lg)]
        bad[i][:, 19] = float("nan")
        xb, _ = chunk_solve(*bad, H0, lam, 16, steps=3, fixed=True)
        assert_same_function(xb[:, :19], x[:, :19])   # (a screened run: another code path than the clean one)
        assert torch.isnan(xb[:, 19:]).any()
    x1, S1 = chunk_solve(q[:, :13], k[:, :13], beta[:, :13], lg[:, :13], H0, lam[:, :13], 16, steps=3, fixed=True)
    x2, S2 = chunk_solve(q[:, 13:], k[:, 13:], beta[:, 13:], lg[:, 13:], S1, lam[:, 13:], 16, steps=3, fixed=True)
    assert_same_function(torch.cat([x1, x2], 1), x)
    assert_same_function(S2, S)


# ------------------------------------------------------------------ the decision
def test_mesa_cg_is_solve_with_the_spec_solver_explained():
    spec = memspec.load(VARIANT)
    d = analyse(spec)
    assert d.family == "solve" and d.exact and d.schedules == ("solve", "online")
    assert d.plan.iterations == 30 and str(d.plan.lam) == "softplus(lam_raw) + 0.25"
    text = explain(spec)
    assert "exact: yes (conjugate gradients, 30 steps: the spec's solver, to float rounding)" in text
    assert "conjugate gradients, 30 steps (the spec's solver)" in text
    assert "H + Diag(lam) is symmetric (lam = lam >= 0.25 > 0: positive definite)" in text
    assert "solver's tolerance" not in text
    exact = explain(memspec.load(ROOT / "specs" / "mesa.yaml"))
    assert "yes, to the solver's tolerance (1e-06 in float32, 1e-12 in float64)" in exact
    assert "steps (the spec's solver)" not in exact


HEAD = """
    memory cg_way
    dims { d_model = 16, heads = 2, d_k = 4, d_v = 3 }
    param lam_raw : [d_k] = zeros
    view q : d_k
    view k : d_k
    view v : d_v
    gate eta = sigmoid(logit)
    gate alpha = sigmoid(logit)
    state H : [d_k, d_k] = zeros
    state G : [d_k, d_v] = zeros
    update {
      H = (1 - alpha) * H + eta * outer(k, k)
      G = (1 - alpha) * G + eta * outer(k, v)
    }
"""


def way(read: str):
    return memspec.loads(textwrap.dedent(HEAD) + f"read = {read}\n", "mem")


@pytest.mark.parametrize("read", [
    "cg(H + 0.5 * eye(d_k), q, 3) @ G",
    "cg(eye(d_k) * (softplus(lam_raw) + 0.1) + H, q, 3) @ G",
    "tanh(cg(H + (eta + 0.5) * eye(d_k), q, 2) @ G)",
])
def test_admitted_ways(read):
    d = analyse(way(read))
    assert d.family == "solve", dict(d.rejected).get("solve")
    assert d.plan.iterations in (2, 3)


@pytest.mark.parametrize("read, why", [
    ("q @ cg(H + 0.5 * eye(d_k), G, 3)", "cg on the columns of a state is another iteration"),
    ("cg(H + softplus(lam_raw) * eye(d_k), q, 3) @ G", "is not a constant > 0 or a value provably > 0 (its lower bound is 0"),
    ("cg(H + (eta - 0.5) * eye(d_k), q, 3) @ G", "a value provably > 0 (its lower bound is -0.5"),
])
def test_refusals_say_why(read, why):
    d = analyse(way(read))
    assert d.family == "online"
    assert why in dict(d.rejected)["solve"], dict(d.rejected)["solve"]


def run_check(text: str, tmp_path, suffix=".mem") -> tuple[int, str]:
    path = tmp_path / f"bad{suffix}"
    path.write_text(text)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["check", str(path)])
    return rc, err.getvalue() + out.getvalue()


@pytest.mark.parametrize("steps, shown", [("0", "'0'"), ("2.5", "'2.5'"), ("1001", "'1001'"), ("eta", "'eta'"),
                                          ("-3", "'-3'")])
def test_bad_step_counts_are_located_errors(steps, shown, tmp_path):
    read = f"cg(H + 0.5 * eye(d_k), q, {steps}) @ G"
    rc, text = run_check(textwrap.dedent(HEAD) + f"read = {read}\n", tmp_path)
    assert rc == 1 and "Traceback" not in text
    line = len(textwrap.dedent(HEAD).splitlines()) + 1
    col = len("read = cg(H + 0.5 * eye(d_k), q, ") + 1
    assert f"bad.mem:{line}:{col}: error: cg(A, B, steps) takes a number of steps, an integer from 1 to 1000" \
           in text, text
    assert shown in text and "^" in text and "hint: conjugate gradients runs exactly that many iterations" in text


def test_bad_shapes_and_arity_are_located_errors(tmp_path):
    rc, text = run_check(textwrap.dedent(HEAD) + "read = cg(H + 0.5 * eye(d_k), v, 3) @ G\n", tmp_path)
    assert rc == 1 and "Traceback" not in text and "shape mismatch in cg: A is [d_k, d_k], B is [d_v]" in text
    rc, text = run_check(textwrap.dedent(HEAD) + "read = cg(H + 0.5 * eye(d_k), q) @ G\n", tmp_path)
    assert rc == 1 and "Traceback" not in text and "cg takes 3 arguments, got 2" in text


# ------------------------------------------------------------------ the compiled variant
DIMS = {"heads": 2, "d_k": 4, "d_v": 3}


def symmetric_state(m, B=2, seed=2, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    M = torch.randn(B, m.heads, m.d_k, m.d_k, generator=g, dtype=dtype)
    P = M @ M.transpose(-1, -2)
    return {"H": 0.1 * (P + P.transpose(-1, -2)),
            "G": 0.1 * torch.randn(B, m.heads, m.d_k, m.d_v, generator=g, dtype=dtype)}


@pytest.mark.parametrize("symmetric", [True, False])
def test_compiled_matches_reference_on_every_schedule(symmetric):
    spec = memspec.load(VARIANT)
    m = make(spec, DIMS, dtype=torch.float64)
    assert m.SCHEDULES == ("solve", "online") and m.DEFAULT_SCHEDULE == "solve"
    ins = harness_inputs(spec, m, T=11, requires_grad=True)
    st = symmetric_state(m)
    if not symmetric:   # any matrix: the kernel's formed systems
        st["H"] = st["H"] + 0.1 * torch.randn(st["H"].shape, generator=torch.Generator().manual_seed(5),
                                              dtype=torch.float64)
    ro, rs = reference_run(spec, m, DIMS, "online", st, ins)
    wrt = list(ins.values()) + [m.lam_raw]
    ref = torch.autograd.grad(weighted(ro, rs["H"]) + rs["G"].sum(), wrt, materialize_grads=True)
    assert ref[-1].abs().sum() > 0   # the learned regulariser gets a gradient
    for schedule in m.SCHEDULES:
        o, fs = call(m, spec, ins, dict(st), schedule)
        torch.testing.assert_close(o, ro, rtol=1e-11, atol=1e-12, msg=schedule)
        for n in rs:
            assert_same_function(fs[n], rs[n], msg=f"{schedule} {n}")
        got = torch.autograd.grad(weighted(o, fs["H"]) + fs["G"].sum(), wrt, materialize_grads=True)
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-11, msg=schedule)


def variant_with(tmp_path, read: str, name: str):
    """specs/variants/mesa_cg.yaml with another read, written next to the test."""
    text = VARIANT.read_text().replace("extends: ../mesa.yaml", "extends: memspec:mesa")
    path = tmp_path / f"{name}.yaml"
    path.write_text(text.replace("read: cg(H + lam * eye(d_k), qn, 30) @ G", f"read: {read}"))
    return memspec.load(path)


def test_the_read_is_the_spec_solver_not_the_exact_solve(tmp_path):
    """30 steps on a 4 x 4 system are past convergence (the exact solve to rounding); 2 steps are
    not: the module computes the spec's function, not the solve's."""
    exact_spec = variant_with(tmp_path, "qn @ solve(H + lam * eye(d_k), G)", "exact")
    two = variant_with(tmp_path, "cg(H + lam * eye(d_k), qn, 2) @ G", "two")
    m = make(memspec.load(VARIANT), DIMS, dtype=torch.float64)
    ins = harness_inputs(exact_spec, m, T=9)
    st = symmetric_state(m)
    exact, _ = reference_run(exact_spec, m, DIMS, "online", st, ins)
    with torch.no_grad():
        o30 = call(m, memspec.load(VARIANT), ins, dict(st))[0]
        m2 = make(two, DIMS, dtype=torch.float64)
        o2 = call(m2, two, ins, dict(st))[0]
        r2, _ = reference_run(two, m2, DIMS, "online", st, ins)
    torch.testing.assert_close(o30, exact.detach(), rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(o2, r2.detach(), rtol=1e-11, atol=1e-12)
    assert (o2 - exact).abs().max() > 1e-3


def test_gradcheck_float64_module():
    spec = memspec.load(VARIANT)
    dims = {"heads": 1, "d_k": 3, "d_v": 2}
    m = make(spec, dims, chunk=2, dtype=torch.float64)
    ins = harness_inputs(spec, m, B=1, T=5, requires_grad=True)
    st = symmetric_state(m, B=1)
    names = list(ins)

    def f(*xs):
        o, s = call(m, spec, dict(zip(names, xs)), dict(st), "solve")
        return (o,) + tuple(s[n] for n in spec.state)

    assert torch.autograd.gradcheck(f, tuple(ins.values()))


def test_streaming_step_causality_and_packing():
    spec = memspec.load(VARIANT)
    m = make(spec, DIMS, dtype=torch.float32)
    ins = harness_inputs(spec, m, T=13, dtype=torch.float32)
    st = symmetric_state(m, dtype=torch.float32)
    with torch.no_grad():
        o, fs = call(m, spec, ins, dict(st), "solve")
        o1, s1 = call(m, spec, {k: x[:, :6] for k, x in ins.items()}, dict(st), "solve")
        o2, s2 = call(m, spec, {k: x[:, 6:] for k, x in ins.items()}, s1, "solve")
        assert_same_function(torch.cat([o1, o2], 1), o)
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
            assert_same_function(ob[:, :7], o[:, :7], msg=x)   # (screened: another code path than the clean run)
        later = {k: v.clone() for k, v in ins.items()}   # a changed future leaves the past alone
        later["q"][:, 9:] += 1.0
        assert_same_function(call(m, spec, later, dict(st), "solve")[0][:, :9], o[:, :9])   # (float64's tolerance)
    m64 = make(spec, DIMS, dtype=torch.float64)
    bounds = [0, 5, 12, 12, 20]
    ins = harness_inputs(spec, m64, B=1, T=20)
    st = symmetric_state(m64, B=4)
    o, fs = m64(*[ins[v] for v in spec.views], **{g: ins[g] for g in spec.gates}, state=dict(st),
                cu_seqlens=torch.tensor(bounds))
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        oi, si = call(m64, spec, {n: x[:, a:b] for n, x in ins.items()}, {n: s[i:i + 1] for n, s in st.items()},
                      "online")
        torch.testing.assert_close(o[:, a:b], oi, rtol=1e-11, atol=1e-12)
        for n in spec.state:
            assert_same_function(fs[n][i:i + 1], si[n])


def test_bfloat16_inputs_solve_in_float32():
    """bfloat16 inputs: the states and the iteration run in float32 (its rounding-level stop at
    float32's epsilon), the output is bfloat16, within bfloat16's rounding of the float64 read."""
    spec = memspec.load(VARIANT)
    m = make(spec, {"heads": 2, "d_k": 16, "d_v": 8}, chunk=16, dtype=torch.float32)
    ins = harness_inputs(spec, m, T=40, dtype=torch.float32)
    with torch.no_grad():
        ob, sb = call(m, spec, {n: x.bfloat16() for n, x in ins.items()})
        ref, _ = call(m.double(), spec, {n: x.bfloat16().double() for n, x in ins.items()}, schedule="online")
    assert ob.dtype == torch.bfloat16 and sb["H"].dtype == torch.float32
    assert float((ob.double() - ref).norm() / ref.norm()) <= 2e-2
