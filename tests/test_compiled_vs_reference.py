"""Every shipped spec x every schedule its compiled module admits, against memspec.reference.

Small sizes (B=2, H=2, d_k=4, d_v=5, hidden=6, T=10, chunk 4: T is not a multiple of the
chunk), eager modules (compile=False); the torch.compile path is tested in test_codegen.py.
"""
from __future__ import annotations

import pytest
import torch

from _compiled_harness import (SPEC_FILES, call, initial_state, inputs, load, make,
                               reference_run, rel_err, small_dims)

CASES = []
for _path in SPEC_FILES:
    _spec = load(_path)
    for _sched in make(_spec, small_dims(_spec)).SCHEDULES:
        CASES.append((_path, _sched))
IDS = [f"{p.split('/')[-1][:-5]}-{s}" for p, s in CASES]


def _setup(path, dtype, T=10, requires_grad=False):
    spec = load(path)
    dims = small_dims(spec)
    m = make(spec, dims, dtype=dtype)
    ins = inputs(spec, m, T=T, dtype=dtype, requires_grad=requires_grad)
    st = initial_state(spec, m, dtype=dtype)
    return spec, dims, m, ins, st


def test_every_shipped_spec_has_cases():
    assert len(SPEC_FILES) >= 10
    names = {p for p, _ in CASES}
    assert names == set(SPEC_FILES)
    assert {s for _, s in CASES} >= {"online", "minibatch", "cache", "delta", "additive", "dplr", "momentum",
                                     "apply_update"}


@pytest.mark.parametrize("path,schedule", CASES, ids=IDS)
def test_outputs_and_state_match_reference(path, schedule):
    spec, dims, m, ins, st = _setup(path, torch.float32)
    with torch.no_grad():
        o, fs = call(m, spec, ins, dict(st), schedule)
        ro, rs = reference_run(spec, m, dims, schedule, st, ins)
    assert o.shape == ro.shape
    assert rel_err(o, ro) <= 1e-4
    assert set(rs) <= set(fs)
    for n in rs:
        assert rel_err(fs[n], rs[n]) <= 1e-4, n


@pytest.mark.parametrize("path,schedule", CASES, ids=IDS)
def test_gradients_match_reference(path, schedule):
    spec, dims, m, ins, st = _setup(path, torch.float32, requires_grad=True)
    g = torch.Generator().manual_seed(5)
    params = list(m.parameters())
    wrt = list(ins.values()) + params
    o, fs = call(m, spec, ins, dict(st), schedule)
    w_o = torch.randn(o.shape, generator=g)
    ws = {n: torch.randn(t.shape, generator=g) for n, t in fs.items() if n in spec.state}

    def scalar(out, states):
        return (out * w_o).sum() + sum((states[n] * w).sum() for n, w in ws.items())

    mine = torch.autograd.grad(scalar(o, fs), wrt, allow_unused=True)
    ro, rs = reference_run(spec, m, dims, schedule, st, ins)
    ref = torch.autograd.grad(scalar(ro, rs), wrt, allow_unused=True)
    checked = 0
    for a, b in zip(mine, ref):
        if b is None or float(b.norm()) == 0.0:
            assert a is None or float(a.abs().max()) <= 1e-6
            continue
        assert a is not None
        assert rel_err(a, b) <= 1e-4
        checked += 1
    assert checked >= len(ins)   # every view and gate has a nonzero gradient


GRADCHECK = ["deltanet", "gated_deltanet", "linear_attention", "softmax_attention", "sliding_window_attention",
             "softmax_attention_qknorm", "sliding_window_attention_qknorm",
             "mesa", "titans", "ttt_linear", "ttt_mlp", "moneta", "yaad", "longhorn",
             "gla", "rwkv6", "hgrn2", "retention", "mamba2", "kda", "gdn2", "comba", "rwkv7", "gated_deltaproduct",
             "momentum_deltanet", "deltanet_textbook", "omeganet", "lact", "hope_cms", "gated_deltanet_channel",
             # MLP memories through Newton-Schulz or a softmax: a minute each on 2 cores; their gradients
             # are also checked against the reference's in test_gradients_match_reference
             pytest.param("atlas", marks=pytest.mark.slow), pytest.param("memora", marks=pytest.mark.slow),
             pytest.param("titans_muon", marks=pytest.mark.slow)]


@pytest.mark.parametrize("name", GRADCHECK)
def test_gradcheck_float64(name):
    path = f"specs/{name}.yaml"
    if path not in SPEC_FILES:
        pytest.skip("spec not shipped")
    spec = load(path)
    dims = {k: v for k, v in {"d_model": 4, "heads": 1, "d_k": 2, "d_v": 3, "hidden": 3}.items() if k in spec.dims}
    m = make(spec, dims, chunk=2, dtype=torch.float64)
    ins = inputs(spec, m, B=1, T=3, dtype=torch.float64, requires_grad=True)
    params = [p for p in m.parameters()]
    names = list(ins)

    for schedule in m.SCHEDULES:
        def f(*args):
            d = dict(zip(names, args[:len(names)]))
            st = m.init_state(1, dtype=torch.float64)
            o, fs = call(m, spec, d, st, schedule)
            return (o,) + tuple(fs[n] for n in spec.state if not spec.state[n].cache)

        assert torch.autograd.gradcheck(f, tuple(ins[n] for n in names) + tuple(params), eps=1e-6, atol=1e-5,
                                        rtol=1e-4), schedule


@pytest.mark.parametrize("path,schedule", CASES, ids=IDS)
def test_causality_bit_for_bit(path, schedule):
    spec, dims, m, ins, st = _setup(path, torch.float64, T=9)
    t = 5
    with torch.no_grad():
        o, _ = call(m, spec, ins, dict(st), schedule)
        g = torch.Generator().manual_seed(9)
        moved = {n: x.clone() for n, x in ins.items()}
        for x in moved.values():
            x[:, t:] += torch.rand(x[:, t:].shape, generator=g, dtype=x.dtype)
        o2, _ = call(m, spec, moved, dict(st), schedule)
    assert torch.equal(o[:, :t], o2[:, :t])
    assert not torch.equal(o[:, t:], o2[:, t:])


@pytest.mark.parametrize("path,schedule", CASES, ids=IDS)
def test_streaming_and_step(path, schedule):
    spec, dims, m, ins, st = _setup(path, torch.float64)
    with torch.no_grad():
        o, fs = call(m, spec, ins, dict(st), schedule)
        pieces, state, start = [], dict(st), 0
        for n in (3, 4, 2, 1):   # split points 3, 7, 9: not multiples of the chunk (4)
            part = {k: x[:, start:start + n] for k, x in ins.items()}
            op, state = call(m, spec, part, state, schedule)
            pieces.append(op)
            start += n
        assert rel_err(torch.cat(pieces, dim=1), o) <= 1e-12
        for n in spec.state:
            assert rel_err(state[n], fs[n]) <= 1e-12
        if schedule == m.STEP_SCHEDULE or (schedule != "minibatch" and m.STEP_SCHEDULE == "online"):
            state, outs = dict(st), []
            for i in range(ins[spec_first(spec)].shape[1]):
                tok = {k: x[:, i] for k, x in ins.items()}
                ot, state = m.step(*[tok[v] for v in spec.views], **{g: tok[g] for g in spec.gates}, state=state)
                outs.append(ot)
            assert rel_err(torch.stack(outs, dim=1), o) <= 1e-12


def spec_first(spec):
    return next(iter(spec.views))


@pytest.mark.parametrize("path", [p for p in SPEC_FILES if "minibatch" in make(load(p), small_dims(load(p))).SCHEDULES])
def test_minibatch_chunk_1_is_online(path):
    spec = load(path)
    dims = small_dims(spec)
    m = make(spec, dims, chunk=1, dtype=torch.float64)
    ins = inputs(spec, m, T=6)
    st = initial_state(spec, m)
    with torch.no_grad():
        a, sa = call(m, spec, ins, dict(st), "minibatch")
        b, sb = call(m, spec, ins, dict(st), "online")
    assert rel_err(a, b) <= 1e-12
    for n in spec.state:
        assert rel_err(sa[n], sb[n]) <= 1e-12


def test_T_equals_1_and_single_batch():
    for path in ("specs/titans.yaml", "specs/deltanet.yaml", "specs/softmax_attention.yaml"):
        spec = load(path)
        dims = small_dims(spec)
        m = make(spec, dims, dtype=torch.float64)
        ins = inputs(spec, m, B=1, T=1)
        st = initial_state(spec, m, B=1)
        for schedule in m.SCHEDULES:
            with torch.no_grad():
                o, fs = call(m, spec, ins, dict(st), schedule)
                ro, rs = reference_run(spec, m, dims, schedule, st, ins)
            assert o.shape == (1, 1, 2, 5)
            assert rel_err(o, ro) <= 1e-12


GATED_SCALE = """
name: gated_scale_attention
dims: {d_model: 8, heads: 3, d_k: 4, d_v: 5}
views: {q: d_k, k: d_k, v: d_v}
gates: {beta: 4 * sigmoid(logit)}
state:
  K: {shape: [d_k], cache: true, window: 6}
  V: {shape: [d_v], cache: true, window: 6}
update:
  - K = append(K, k)
  - V = append(V, v)
read: attend(q, K, V, beta)
"""


@pytest.mark.parametrize("which", ["softmax_attention_qknorm", "sliding_window_attention_qknorm", "gated"])
def test_cache_family_with_a_tensor_scale_is_exact(which):
    """A learned per-head temperature (the q/k-normalised specs) or a per-token gate as
    the scale of attend: the compiled module keeps the exact cache family (the scale
    multiplies the query before scaled_dot_product_attention), equal to its own online
    step and to the reference, across heads with very different temperatures and with
    a carried cache."""
    import memspec
    spec = memspec.loads(GATED_SCALE) if which == "gated" else load(f"specs/{which}.yaml")
    dims = {"d_model": 8, "heads": 3, "d_k": 4, "d_v": 5}
    m = make(spec, dims)
    assert m.DEFAULT_SCHEDULE == "cache" and set(m.SCHEDULES) == {"cache", "online"}
    if which != "gated":
        with torch.no_grad():
            m.tau.copy_(torch.tensor([0.25, 1.0, 6.0], dtype=torch.float64))
    ins = inputs(spec, m, T=9)
    first = {n: t[:, :4] for n, t in ins.items()}
    rest = {n: t[:, 4:] for n, t in ins.items()}
    st = initial_state(spec, m)
    with torch.no_grad():
        o1, s1 = call(m, spec, first, dict(st), "cache")
        o2, s2 = call(m, spec, rest, s1, "cache")
        online, s_on = call(m, spec, ins, dict(st), "online")
        ro, rs = reference_run(spec, m, dims, "online", st, ins)
    o = torch.cat([o1, o2], 1)
    assert rel_err(o, ro) <= 1e-12 and rel_err(online, ro) <= 1e-12
    for n in spec.state:
        assert rel_err(s2[n], rs[n]) <= 1e-12 and rel_err(s_on[n], rs[n]) <= 1e-12
    # the heads' temperatures matter: one shared scale gives other outputs
    if which != "gated":
        with torch.no_grad():
            m.tau.fill_(1.0)
            assert rel_err(call(m, spec, ins, dict(st), "cache")[0], ro) > 1e-3
