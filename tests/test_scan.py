"""The scan family (elementwise linear recurrences h <- a * h + b): its kernel against a token loop
written here, its analysis, and the shipped specs (hgrn, rglru, mamba) against the reference
interpreter, fla's naive HGRN and token loops of RG-LRU and Mamba-1 written here."""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

import memspec
from memspec.lang.expr import unparse
from memspec.runtime.scan import chunk_scan, chunk_scan_read, recurrent_scan
from memspec.schedule import analyse, explain

from _compiled_harness import call, initial_state, make, reference_run, rel_err, small_dims
from _compiled_harness import inputs as harness_inputs
from close import assert_same_function
from peers import fla_naive

SPECS = Path(__file__).resolve().parent.parent / "specs"


def loop(a, b, h0):
    """h_t = a_t * h_{t-1} + b_t, one token at a time (written here, independent of the runtime)."""
    a = a.expand(b.shape)
    h = h0
    hs = []
    for t in range(b.shape[1]):
        h = a[:, t] * h + b[:, t]
        hs.append(h)
    return torch.stack(hs, 1), h


def inputs(B, T, H, S, *, dtype=torch.float32, seed=0, log_lo=-3.0, signed=False, a_shape=None):
    g = torch.Generator().manual_seed(seed)
    shape = (B, T, H) + tuple(S)
    a_shape = shape if a_shape is None else a_shape
    a = torch.exp(log_lo * torch.rand(a_shape, generator=g, dtype=dtype))
    if signed:
        a = a * torch.where(torch.rand(a_shape, generator=g) < 0.5, -1.0, 1.0).to(dtype)
    b = torch.randn(shape, generator=g, dtype=dtype)
    h0 = torch.randn((B, H) + tuple(S), generator=g, dtype=dtype)
    return a, b, h0


def weighted(hs, h, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (hs * torch.randn(hs.shape, generator=g, dtype=hs.dtype)).sum() \
        + (h * torch.randn(h.shape, generator=g, dtype=h.dtype)).sum()


CASES = [  # B, T, H, S, chunk
    (1, 16, 2, (4,), 4),
    (2, 37, 3, (5,), 8),          # T not a multiple of the chunk
    (1, 1, 2, (3,), 4),           # T = 1
    (2, 20, 1, (3, 4), 64),       # a matrix state, chunk larger than T
    (1, 29, 2, (2, 3), 5),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("signed", [False, True])
def test_chunk_scan_matches_loop(case, signed):
    B, T, H, S, C = case
    a, b, h0 = inputs(B, T, H, S, signed=signed)
    xs = [x.requires_grad_() for x in (a, b, h0)]
    ref = loop(*xs)
    got = chunk_scan(*xs, C)
    for x, y in zip(got, ref):
        assert_same_function(x, y)
    for x, y in zip(torch.autograd.grad(weighted(*got), xs), torch.autograd.grad(weighted(*ref), xs)):
        assert_same_function(x, y)
    run = recurrent_scan(*xs)
    for x, y in zip(run, ref):
        assert_same_function(x, y)


@pytest.mark.parametrize("a_shape", [(2, 21, 3, 1, 1), (2, 21, 3, 4, 1), (3, 4, 5), (3, 1, 5)])
def test_chunk_scan_broadcast_decays(a_shape):
    """A scalar per token, one decay per row, a learned decay without batch and time axes."""
    a, b, h0 = inputs(2, 21, 3, (4, 5), a_shape=a_shape)
    ref = loop(a, b, h0)
    for x, y in zip(chunk_scan(a, b, h0, 8), ref):
        assert_same_function(x, y)


def test_chunk_scan_extreme_and_zero_decays():
    """Log decays down to -40 per token, decays of exactly 0 and negative decays: finite, equal to the loop."""
    a, b, h0 = inputs(2, 70, 2, (6,), log_lo=-40.0, signed=True, seed=3)
    a[:, 10] = 0.0
    a[0, 33:40] = -torch.exp(torch.tensor(-40.0))
    xs = [x.requires_grad_() for x in (a, b, h0)]
    got, ref = chunk_scan(*xs, 16), loop(*xs)
    assert all(torch.isfinite(x).all() for x in got)
    for x, y in zip(got, ref):
        assert_same_function(x, y)
    gg, gr = torch.autograd.grad(weighted(*got), xs), torch.autograd.grad(weighted(*ref), xs)
    assert all(torch.isfinite(x).all() for x in gg)
    for x, y in zip(gg, gr):
        assert_same_function(x, y)


def test_chunk_scan_float64_gradcheck():
    a, b, h0 = inputs(1, 11, 2, (2, 3), dtype=torch.float64, signed=True)
    xs = [x.requires_grad_() for x in (a, b, h0)]
    assert torch.autograd.gradcheck(lambda *z: chunk_scan(*z, 4), xs)
    assert torch.autograd.gradcheck(lambda a, b: chunk_scan(a, b, None, 3), xs[:2])


def test_chunk_scan_causal_and_streaming():
    a, b, h0 = inputs(1, 40, 2, (5,), signed=True)
    hs, h = chunk_scan(a, b, h0, 8)
    bad = b.clone()
    bad[:, 19] = float("nan")
    hs_bad, _ = chunk_scan(a, bad, h0, 8)
    assert torch.equal(hs_bad[:, :19], hs[:, :19]) and torch.isnan(hs_bad[:, 19:]).all()
    bad_a = a.clone()
    bad_a[:, 23] = float("inf")
    assert torch.equal(chunk_scan(bad_a, b, h0, 8)[0][:, :23], hs[:, :23])
    first, h1 = chunk_scan(a[:, :13], b[:, :13], h0, 8)
    second, h2 = chunk_scan(a[:, 13:], b[:, 13:], h1, 8)
    assert_same_function(torch.cat([first, second], 1), hs)
    assert_same_function(h2, h)
    empty, h_e = chunk_scan(a[:, :0], b[:, :0], h0, 8)
    assert empty.shape == (1, 0, 2, 5) and torch.equal(h_e, h0)


@pytest.mark.parametrize("T,C,inclusive", [(37, 8, True), (37, 8, False), (5, 8, True), (16, 4, False), (1, 4, True)])
def test_chunk_scan_read_matches_loop(T, C, inclusive):
    """The fused kernel: two states, decays and increments from the inputs per position, a nonlinear read."""
    a, b, h0 = inputs(2, T, 3, (4,), signed=True)
    a2, b2, g0 = inputs(2, T, 3, (2, 4), seed=5)
    xs = [x.requires_grad_() for x in (a, b, a2, b2)]
    h0s = (h0.requires_grad_(), g0.requires_grad_())

    def coefficients(a, b, a2, b2):
        return ((a, b), (a2[..., :1, :], b2))

    def read(h, g, b):
        return torch.tanh(h) * g.sum(-2) + b

    o, (hT, gT) = chunk_scan_read(coefficients, read, tuple(xs), (b,), h0s, C, inclusive=inclusive)
    hs, h_ref = loop(a, b, h0)
    gs, g_ref = loop(a2[..., :1, :], b2, g0)
    if not inclusive:
        hs, gs = torch.cat([h0[:, None], hs[:, :-1]], 1), torch.cat([g0[:, None], gs[:, :-1]], 1)
    ref = read(hs, gs, b)
    assert_same_function(o, ref)
    assert_same_function(hT, h_ref)
    assert_same_function(gT, g_ref)
    got = torch.autograd.grad(weighted(o, hT) + gT.sum(), xs + list(h0s))
    want = torch.autograd.grad(weighted(ref, h_ref) + g_ref.sum(), xs + list(h0s))
    for x, y in zip(got, want):
        assert_same_function(x, y)


@pytest.mark.parametrize("rows", [63, 64])
def test_chunk_scan_read_large_states_token_by_token(rows):
    """From 8,192 floats of state per token the fused kernel runs token by token (63 x 64 x 2
    heads stays chunked, 64 x 64 x 2 does not): both against the loop, outputs, state, gradients."""
    a, b, h0 = inputs(1, 21, 2, (rows, 64), signed=True, dtype=torch.float64)
    xs = [x.requires_grad_() for x in (a, b)]
    h0.requires_grad_()
    q = torch.randn(1, 21, 2, rows, generator=torch.Generator().manual_seed(3), dtype=torch.float64)

    def read(h, q):
        return (q.unsqueeze(-2) @ h).squeeze(-2)

    o, (hT,) = chunk_scan_read(lambda a, b: ((a, b),), read, tuple(xs), (q,), (h0,), 8)
    hs, h_ref = loop(a, b, h0)
    ref = read(hs, q)
    assert_same_function(o, ref)
    assert_same_function(hT, h_ref)
    got = torch.autograd.grad(weighted(o, hT), xs + [h0])
    want = torch.autograd.grad(weighted(ref, h_ref), xs + [h0])
    for x, y in zip(got, want):
        assert_same_function(x, y)


def test_chunk_scan_bfloat16_keeps_a_float32_state():
    a, b, h0 = inputs(1, 30, 2, (4,))
    hs, h = chunk_scan(a.bfloat16(), b.bfloat16(), h0, 8)
    assert hs.dtype == torch.float32 and h.dtype == torch.float32
    ref_hs, ref_h = loop(a.bfloat16().float(), b.bfloat16().float(), h0)
    assert_same_function(h, ref_h)


# ------------------------------------------------------------------ the analysis
SHIPPED = ["hgrn", "rglru", "mamba"]


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_specs_get_the_scan_family(name):
    """YAML and .mem give the same decision; explain states no 'only batch the materialisation' reason."""
    ds = [analyse(memspec.load(SPECS / f"{name}.{fmt}")) for fmt in ("yaml", "mem")]
    assert ds[0].family == ds[1].family == "scan" and ds[0].exact
    assert ds[0].chunk == (64 if name == "mamba" else 16)   # vector states: chunks of 16
    assert ds[0].plan == ds[1].plan
    text = explain(memspec.load(SPECS / f"{name}.yaml"))
    assert "would only batch" not in text and "scan (exact chunked form" in text


HGRN_WAYS = [   # the same memory written other ways: renamed, a temporary, a let, diag(...) @ h, split statements
    "update { h = f * h + (1 - f) * v }",
    "update { h = diag(f) @ h + (1 - f) * v }",
    "update { h = h - (1 - f) * h + (1 - f) * v }",
    "update { u = (1 - f) * v\n h = f * h + u }",
    "update { h = f * h\n h = h + (1 - f) * v }",
]


def hgrn_text(update: str, read: str = "h", order: str = "", state: str = "h") -> str:
    body = textwrap.dedent(f"""
        memory m
        dims {{ d_v = 5 }}
        view v : d_v
        gate f : [d_v] = sigmoid(logit)
        state {state} : [d_v] = zeros
        {update}
        read = {read}
        {order}
    """)
    return body if state == "h" else body.replace(" h ", f" {state} ").replace("(h)", f"({state})")


@pytest.mark.parametrize("update", HGRN_WAYS)
def test_same_memory_any_way_written_same_decision(update):
    specs = [memspec.loads(hgrn_text(u), "mem") for u in (HGRN_WAYS[0], update)]
    assert [analyse(s).family for s in specs] == ["scan", "scan"]
    outs = []
    for spec in specs:
        m = make(spec, small_dims(spec))
        ins = harness_inputs(spec, m, T=9)
        outs.append(call(m, spec, ins, initial_state(spec, m), "scan"))
    assert_same_function(outs[1][0], outs[0][0])
    assert_same_function(outs[1][1]["h"], outs[0][1]["h"])


def test_a_decay_written_as_a_difference_is_one_row_decay():
    text = VARIANTS["rows"].replace("S = e * (diag(g) @ S) * p + outer(k, v)",
                                    "S = S - e * (diag(g) @ S) + outer(k, v)")
    d = analyse(memspec.loads(text, "mem"))
    assert d.family == "scan"
    (f,) = d.plan.states[0].decay
    assert f.on == "rows" and unparse(f.value) == "1 - g * e"
    spec = memspec.loads(text, "mem")
    m = make(spec, small_dims(spec))
    ins, st = harness_inputs(spec, m, T=9), initial_state(spec, m)
    o, fs = call(m, spec, ins, dict(st), "scan")
    ro, rs = reference_run(spec, m, small_dims(spec), "online", st, ins)
    assert_same_function(o, ro)
    assert_same_function(fs["S"], rs["S"])


@pytest.mark.parametrize("update,why", [
    ("update { h = f * h * h + v }", "not linear"),
    ("update { h = tanh(h) + v }", "nonlinearly"),
    ("update { h = h + outer(h, v) }", "not linear"),
])
def test_not_elementwise_linear_is_refused_with_the_algebra(update, why):
    text = hgrn_text(update)
    if "outer" in update:   # a matrix state: S outer ... is not an elementwise map
        text = VARIANTS["rows"].replace("S = e * (diag(g) @ S) * p + outer(k, v)", "S = S + outer(q @ S, v)")
        why = "mixes its entries (outer(q @ S, v)): linear, but not elementwise"
    d = analyse(memspec.loads(text, "mem"))
    assert d.family == "online" and why in dict(d.rejected)["scan"]


# ------------------------------------------------------------------ compiled modules vs the reference
VARIANTS = {   # beyond the shipped specs: a negative decay, a nonlinear read, read before write, row decays
    "signed_tanh_read_write": hgrn_text("update { h = -f * h + v }", read="tanh(h) * v", order="order read_write"),
    "rows": textwrap.dedent("""
        memory m
        dims { d_k = 4, d_v = 5 }
        view q : d_k
        view k : d_k
        view v : d_v
        gate g : [d_k] = sigmoid(logit)
        gate e : [] = sigmoid(logit)
        param p : [d_v] = 0.5
        state S : [d_k, d_v] = zeros
        update { S = e * (diag(g) @ S) * p + outer(k, v) }
        read = q @ tanh(S)
    """),
    "two_states_read_write": textwrap.dedent("""
        memory m
        dims { d_k = 4, d_v = 5 }
        view q : d_k
        view k : d_k
        view v : d_v
        gate g : [d_v] = sigmoid(logit)
        state S : [d_k, d_v] = zeros
        state z : [d_v] = zeros
        update {
          S = g * S + outer(k, v)
          z = -g * z + 1
        }
        read = q @ S / (1 + abs(z))
        order read_write
    """),
}


def spec_of(name):
    return memspec.loads(VARIANTS[name], "mem") if name in VARIANTS else memspec.load(SPECS / f"{name}.yaml")


ALL = SHIPPED + list(VARIANTS)


@pytest.mark.parametrize("name", ALL)
def test_compiled_matches_reference_every_schedule(name):
    spec = spec_of(name)
    assert analyse(spec).family == "scan"
    dims = small_dims(spec)
    m = make(spec, dims, dtype=torch.float32)
    assert m.SCHEDULES == ("scan", "online")
    ins = harness_inputs(spec, m, T=11, dtype=torch.float32, requires_grad=True)
    st = initial_state(spec, m, dtype=torch.float32)
    ro, rs = reference_run(spec, m, dims, "online", st, ins)
    wrt = list(ins.values()) + list(m.parameters())
    g = torch.Generator().manual_seed(4)
    w_o = torch.randn(ro.shape, generator=g)
    ws = {n: torch.randn(t.shape, generator=g) for n, t in rs.items()}

    def scalar(o, s):
        return (o * w_o).sum() + sum((s[n] * w).sum() for n, w in ws.items())

    ref = torch.autograd.grad(scalar(ro, rs), wrt, allow_unused=True)
    for schedule in m.SCHEDULES:
        o, fs = call(m, spec, ins, dict(st), schedule)
        assert rel_err(o, ro) <= 1e-5
        for n in rs:
            assert rel_err(fs[n], rs[n]) <= 1e-5
        mine = torch.autograd.grad(scalar(o, fs), wrt, allow_unused=True)
        for a, b in zip(mine, ref):
            if b is not None and float(b.norm()) > 0:
                assert rel_err(a, b) <= 1e-4


@pytest.mark.parametrize("name", ALL)
def test_gradcheck_float64_scan_schedule(name):
    spec = spec_of(name)
    dims = {k: v for k, v in {"d_model": 4, "heads": 1, "d_k": 2, "d_v": 3}.items() if k in spec.dims}
    m = make(spec, dims, chunk=2, dtype=torch.float64)
    ins = harness_inputs(spec, m, B=1, T=5, dtype=torch.float64, requires_grad=True)
    st = initial_state(spec, m, B=1, dtype=torch.float64)
    names = list(ins)

    def f(*xs):
        o, s = call(m, spec, dict(zip(names, xs)), dict(st), "scan")
        return (o,) + tuple(s[n] for n in spec.state)

    assert torch.autograd.gradcheck(f, tuple(ins.values()))


@pytest.mark.parametrize("name", ALL)
def test_scan_streaming_step_and_causality(name):
    spec = spec_of(name)
    m = make(spec, small_dims(spec), dtype=torch.float32)
    ins = harness_inputs(spec, m, T=13, dtype=torch.float32)
    st = initial_state(spec, m, dtype=torch.float32)
    with torch.no_grad():
        o, fs = call(m, spec, ins, dict(st), "scan")
        cut = 6
        o1, s1 = call(m, spec, {k: x[:, :cut] for k, x in ins.items()}, dict(st), "scan")
        o2, s2 = call(m, spec, {k: x[:, cut:] for k, x in ins.items()}, s1, "scan")
        assert_same_function(torch.cat([o1, o2], 1), o)
        s = dict(st)
        outs = []
        for t in range(ins[next(iter(ins))].shape[1]):
            y, s = m.step(*[ins[v][:, t] for v in spec.views], **{g: ins[g][:, t] for g in spec.gates}, state=s)
            outs.append(y)
        assert_same_function(torch.stack(outs, 1), o)
        for n in spec.state:
            assert_same_function(s2[n], fs[n])
            assert_same_function(s[n], fs[n])
        bad = {k: x.clone() for k, x in ins.items()}
        first = next(iter(spec.views))
        bad[first][:, 7] = float("nan")
        ob, _ = call(m, spec, bad, dict(st), "scan")
        assert torch.equal(ob[:, :7], o[:, :7])


# ------------------------------------------------------------------ peers and token loops written here
def test_hgrn_matches_fla_naive_recurrent_hgrn():
    naive = fla_naive("hgrn").naive_recurrent_hgrn
    spec = memspec.load(SPECS / "hgrn.yaml")
    B, T, H, D = 2, 150, 3, 8
    m = make(spec, {"heads": H, "d_v": D}, chunk=16, dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    v = torch.randn(B, T, H, D, generator=g).requires_grad_()
    f = torch.rand(B, T, H, D, generator=g).clamp(1e-3, 1 - 1e-3).requires_grad_()
    h0 = torch.randn(B, H, D, generator=g)
    x = ((1 - f) * v).reshape(B, T, H * D)
    ro, rh = naive(x, torch.log(f).reshape(B, T, H * D), h0.reshape(B, H * D), True)
    ro, rh = ro.reshape(B, T, H, D), rh.reshape(B, H, D)
    w = torch.randn(ro.shape, generator=g)
    ref = torch.autograd.grad((ro * w).sum() + rh.sum(), (v, f))
    for schedule in m.SCHEDULES:
        o, s = m(v, f=f, state={"h": h0}, schedule=schedule)
        assert rel_err(o, ro) <= 1e-4 and rel_err(s["h"], rh) <= 1e-4
        for a, b in zip(torch.autograd.grad((o * w).sum() + s["h"].sum(), (v, f)), ref):
            assert rel_err(a, b) <= 1e-4


def test_rglru_matches_a_token_loop():
    """Griffin's RG-LRU written here from the paper: a_t = sigmoid(lam)^(c r_t), c = 8."""
    spec = memspec.load(SPECS / "rglru.yaml")
    B, T, H, D = 2, 90, 2, 6
    m = make(spec, {"heads": H, "d_v": D}, chunk=16, dtype=torch.float32)
    g = torch.Generator().manual_seed(8)
    v = torch.randn(B, T, H, D, generator=g)
    r, i = torch.rand(B, T, H, D, generator=g), torch.rand(B, T, H, D, generator=g)
    h = h0 = torch.randn(B, H, D, generator=g)
    lam = m.lam.detach()
    outs = []
    for t in range(T):
        a = torch.sigmoid(lam) ** (8 * r[:, t])
        h = a * h + torch.sqrt(1 - a ** 2) * (i[:, t] * v[:, t])
        outs.append(h)
    ro = torch.stack(outs, 1)
    for schedule in m.SCHEDULES:
        with torch.no_grad():
            o, s = m(v, r=r, i=i, state={"h": h0}, schedule=schedule)
        assert rel_err(o, ro) <= 1e-4 and rel_err(s["h"], h) <= 1e-4


@pytest.mark.parametrize("extreme", [False, True])
def test_mamba_matches_a_token_loop(extreme):
    """Mamba-1's selective scan written here: dA = exp(dt A), h = dA * h + (dt x) B^T, y = C h + D x;
    extreme: A = -1 and dt up to 40, log decays down to -40 per token."""
    spec = memspec.load(SPECS / "mamba.yaml")
    B, T, H, N, D = 2, 70, 2, 4, 5
    m = make(spec, {"heads": H, "d_k": N, "d_v": D}, chunk=16, dtype=torch.float32)
    g = torch.Generator().manual_seed(9)
    if extreme:
        with torch.no_grad():
            m.A_log.zero_()
    C_, B_, x = (torch.randn(B, T, H, n, generator=g) for n in (N, N, D))
    dt = (40.0 if extreme else 0.5) * torch.rand(B, T, H, D, generator=g)
    h = h0 = torch.randn(B, H, N, D, generator=g)
    A = -torch.exp(m.A_log.detach())                                  # [H, N, D]
    outs = []
    for t in range(T):
        dA = torch.exp(dt[:, t, :, None, :] * A)                       # [B, H, N, D]
        h = dA * h + B_[:, t, :, :, None] * (dt[:, t] * x[:, t])[:, :, None, :]
        outs.append((C_[:, t, :, :, None] * h).sum(-2) + m.D.detach() * x[:, t])
    ro = torch.stack(outs, 1)
    for schedule in m.SCHEDULES:
        with torch.no_grad():
            o, s = m(C_, B_, x, dt=dt, state={"h": h0}, schedule=schedule)
        assert torch.isfinite(o).all()
        assert rel_err(o, ro) <= 1e-4 and rel_err(s["h"], h) <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hgrn", "mamba"])
def test_compiled_scan_forward_and_gradients_equal_eager(name):
    """compile=True runs the scan over slices of SLICE_CHUNKS chunks through one compiled graph."""
    from memspec.codegen.module import SLICE_CHUNKS

    spec = memspec.load(SPECS / f"{name}.yaml")
    dims = small_dims(spec)
    eager = make(spec, dims, chunk=4, dtype=torch.float32)
    comp = make(spec, dims, chunk=4, dtype=torch.float32, compile=True)
    comp.load_state_dict(eager.state_dict())
    T = 5 * 4 * SLICE_CHUNKS // 2
    outs = []
    for m in (eager, comp):
        ins = harness_inputs(spec, eager, T=T, dtype=torch.float32, requires_grad=True)
        o, st = m(**ins, schedule="scan")
        loss = (o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum() + sum(s.sum() for s in st.values())
        outs.append((o.detach(), st["h"].detach(), torch.autograd.grad(loss, [*ins.values(), *m.parameters()])))
    assert comp._chunked_fn.compiled is not None
    (a, sa, ga), (b, sb, gb) = outs
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(sb, sa, rtol=1e-4, atol=1e-5)
    for x, y in zip(ga, gb):
        torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-4)
