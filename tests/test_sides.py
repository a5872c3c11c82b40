"""Side symmetry: a memory written on the value side of its state (``C <- C + outer(v, k)``
read ``C @ q``, the delta rule ``C + eta outer(v - C k, k)``, a right-multiplied decay) gets the
family and the chunk schedule of its row-written twin, runs the family's kernel on ``Cᵀ``
and keeps the declared layout; a state used on both sides (fla's gated Oja rule) stays online
with the true reason."""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

import memspec
from memspec.schedule import analyse, explain

from _compiled_harness import call, initial_state, inputs, make, reference_run, rel_err, small_dims
from close import assert_same_function

SPECS = Path(__file__).resolve().parent.parent / "specs"
VARIANTS = SPECS / "variants"


def mem(text: str):
    return memspec.loads(textwrap.dedent(text), "mem")


HEAD = """
memory m
dims { d_model = 8, heads = 2, d_k = 6, d_v = 5 }
view q : d_k
view k : d_k
view v : d_v
gate eta = sigmoid(logit)
gate alpha = sigmoid(logit) bias -2.0
let qn = l2norm(q)
let kn = l2norm(k)
"""

ROW_DELTA = HEAD + """
state W : [d_k, d_v] = zeros
update { W = (1 - alpha) * W
         W = W + eta * outer(kn, v - kn @ W) }
read = qn @ W
"""

# the same gated delta rule written on the value side of C = Wᵀ, several ways
COLUMN_DELTA = {
    "inline": """
        state C : [d_v, d_k] = zeros
        update { C = (1 - alpha) * C
                 C = C + eta * outer(v - C @ kn, kn) }
        read = C @ qn
    """,
    "temporaries": """
        state C : [d_v, d_k] = zeros
        update { C = C * (1 - alpha)
                 err = v - C @ kn
                 step = eta * err
                 C = C + outer(step, kn) }
        read = C @ qn
    """,
    "gradient": """
        state C : [d_v, d_k] = zeros
        model f(u) = C @ u
        loss = 0.5 * sum((f(kn) - v)^2)
        update { C = (1 - alpha) * C
                 C = C - eta * grad(loss, C) }
        read = f(qn)
    """,
    "transposes": """
        state C : [d_v, d_k] = zeros
        update { C = ((1 - alpha) * C.T).T
                 C = (C.T + eta * outer(kn, v - kn @ C.T)).T }
        read = qn @ C.T
    """,
    "renamed": """
        state Mem : [d_v, d_k] = zeros
        update { Mem = (1 - alpha) * Mem
                 Mem = Mem + eta * outer(v - Mem @ kn, kn) }
        read = Mem @ qn
    """,
}


def test_column_delta_rules_get_the_row_decision():
    row = analyse(mem(ROW_DELTA))
    assert row.family == "delta" and row.transposed == ()
    for name, body in COLUMN_DELTA.items():
        d = analyse(mem(HEAD + textwrap.dedent(body)))
        assert d.family == row.family and d.chunk == row.chunk, name
        # (a gradient write admits mini-batch learning too, written on either side)
        assert tuple(f for f in d.admits if f != "minibatch") == row.admits, name
        state = "Mem" if name == "renamed" else "C"
        assert d.transposed == (state,), name
        assert "transposed" in d.orientation and "value side" in d.orientation, name
        for field in ("k", "v", "beta", "gamma", "rho"):
            assert str(getattr(d.plan, field)) == str(getattr(row.plan, field)), (name, field)
        assert [str(p.vector) for p in d.plan.probes] == [str(p.vector) for p in row.plan.probes]


def test_right_multiplied_per_channel_decay_is_the_additive_family_transposed():
    row = analyse(mem(HEAD + """
        gate a : [d_k] = sigmoid(logit) bias 2.0
        state S : [d_k, d_v] = zeros
        update { S = diag(a) @ S + outer(k, v) }
        read = q @ S
    """))
    col = analyse(mem(HEAD + """
        gate a : [d_k] = sigmoid(logit) bias 2.0
        state C : [d_v, d_k] = zeros
        update { C = C @ diag(a) + outer(v, k) }
        read = C @ q
    """))
    assert row.family == col.family == "additive"
    assert col.transposed == ("C",) and col.chunk == row.chunk
    (rs,), (cs,) = row.plan.states, col.plan.states
    assert str(rs.gamma) == str(cs.gamma) == "a"
    assert [tuple(map(str, t)) for t in rs.terms] == [tuple(map(str, t)) for t in cs.terms] == [("k", "v")]


def test_shipped_column_specs_get_their_twins_schedule():
    for col, row in (("linear_attention_column", "linear_attention"), ("deltanet_column", "deltanet")):
        dc = analyse(memspec.load((SPECS if col == "deltanet_column" else VARIANTS) / f"{col}.yaml"))
        dr = analyse(memspec.load(SPECS / f"{row}.yaml"))
        assert (dc.family, dc.chunk, dc.exact) == (dr.family, dr.chunk, dr.exact), col
        assert dc.schedules == dr.schedules or set(dc.schedules) - set(dr.schedules) == set(), col
        assert dc.transposed and not dr.transposed


def test_explain_prints_the_orientation_and_no_false_reason():
    text = explain(memspec.load(VARIANTS / "linear_attention_column.yaml"))
    assert "orientation: transposed (the state C is read on its value side" in text
    assert "Cᵀ <- T(Cᵀ) + W with T = I; W = kf vᵀ" in text
    assert "the read needs the full state of every token" not in text
    row = explain(memspec.load(SPECS / "linear_attention.yaml"))
    assert "orientation" not in row
    # a linear gradient write read as W @ q: additive on Wᵀ, never "needs the full state"
    d = mem("""
        memory m
        dims { d_k = 6, d_v = 5 }
        view q : d_v
        view k : d_k
        view v : d_v
        gate eta = sigmoid(logit)
        state W : [d_k, d_v] = zeros
        model f(u) = u @ W
        loss = -sum(f(k) * v)
        update { W = W - eta * grad(loss, W) }
        read = W @ q
    """)
    assert analyse(d).family == "additive"
    assert "the read needs the full state" not in explain(d)


def test_a_state_used_on_both_sides_stays_with_the_true_reason():
    # a key-side transition read on the value side: no key-side kernel takes both sides (the oja
    # family does, on the transpose)
    both = mem(HEAD + """
        state C : [d_k, d_v] = zeros
        update { C = (1 - alpha) * C
                 C = C + eta * outer(kn, v - kn @ C) }
        read = C @ v
    """)
    d = analyse(both)
    assert d.transposed == () and d.family == "oja" and d.plan.transposed
    assert d.orientation.startswith("as declared (the state C is used on the key side (kn knᵀ C")
    assert "value side (C @ v)" in d.orientation
    text = explain(both)
    assert "the read needs the full state of every token" not in text
    oja = analyse(memspec.load(SPECS / "gated_oja.yaml"))
    assert oja.family == "oja" and oja.transposed == () and not oja.plan.transposed
    assert "used on the key side (q @ S) and on the value side (S Diag(g)" in oja.orientation


# ------------------------------------------------------------------ compiled modules
OJA_VALUE_READ = """
memory oja_value_read
dims { d_model = 8, heads = 2, d_k = 4, d_v = 5 }
view k : d_k
view v : d_v
view u : d_v
gate beta = sigmoid(logit)
gate g : [d_v] = exp(-softplus(logit)) bias 2.0
state S : [d_k, d_v] = zeros
update { S = S @ diag(g)
         S = S + beta * outer(k - S @ v, v) }
read = S @ u
"""

MOMENTUM_COLUMN = """
memory momentum_column
dims { d_model = 8, heads = 2, d_k = 4, d_v = 5 }
view q : d_k
view k : d_k
view v : d_v
gate eta = sigmoid(logit) bias -2.0
gate mu = sigmoid(logit) bias 2.0
gate alpha = sigmoid(logit) bias -4.0
state W : [d_v, d_k] = zeros
state U : [d_v, d_k] = zeros
let qn = l2norm(q)
let kn = l2norm(k)
model f(u) = W @ u
loss = 0.5 * sum((f(kn) - v)^2)
update { U = mu * U - eta * grad(loss, W)
         W = (1 - alpha) * W + U }
read = f(qn)
"""

COMPILED = {
    "linear_attention_column": lambda: memspec.load(VARIANTS / "linear_attention_column.yaml"),
    "deltanet_column": lambda: memspec.load(SPECS / "deltanet_column.yaml"),
    "gated_column_delta": lambda: mem(HEAD + textwrap.dedent(COLUMN_DELTA["temporaries"])),
    "oja_value_read": lambda: mem(OJA_VALUE_READ),
    "momentum_column": lambda: mem(MOMENTUM_COLUMN),   # two states, both transposed
}
FAMILY = {"linear_attention_column": "additive", "deltanet_column": "delta", "gated_column_delta": "delta",
          "oja_value_read": "dplr", "momentum_column": "momentum"}


@pytest.mark.parametrize("name", sorted(COMPILED))
def test_compiled_matches_reference_outputs_states_gradients(name):
    spec = COMPILED[name]()
    d = analyse(spec)
    assert d.family == FAMILY[name] and d.transposed
    dims = small_dims(spec)
    m = make(spec, dims, dtype=torch.float64)
    for n, st in spec.state.items():   # the declared layout everywhere
        assert m.STATE[n] == tuple(st.shape)
    ins = inputs(spec, m, T=11, dtype=torch.float64, requires_grad=True)
    st = initial_state(spec, m, dtype=torch.float64)
    wrt = list(ins.values())
    g = torch.Generator().manual_seed(4)
    assert d.family in m.SCHEDULES
    for schedule in m.SCHEDULES:   # each against the reference's run of the same schedule
        ro, rs = reference_run(spec, m, dims, schedule, st, ins)
        if schedule == m.SCHEDULES[0]:
            w_o = torch.randn(ro.shape, generator=g, dtype=torch.float64)
            ws = {n: torch.randn(t.shape, generator=g, dtype=torch.float64) for n, t in rs.items()}

        def scalar(o, s):
            return (o * w_o).sum() + sum((s[n] * w).sum() for n, w in ws.items())

        ref = torch.autograd.grad(scalar(ro, rs), wrt)
        o, fs = call(m, spec, ins, dict(st), schedule)
        assert_same_function(o, ro)
        for n in rs:
            assert fs[n].shape == rs[n].shape
            assert_same_function(fs[n], rs[n])
        for a, b in zip(torch.autograd.grad(scalar(o, fs), wrt), ref):
            assert_same_function(a, b)


@pytest.mark.parametrize("name", sorted(COMPILED))
def test_gradcheck_float64_chunked_schedule(name):
    spec = COMPILED[name]()
    dims = {k: v for k, v in {"d_model": 4, "heads": 1, "d_k": 2, "d_v": 3}.items() if k in spec.dims}
    m = make(spec, dims, chunk=2, dtype=torch.float64)
    ins = inputs(spec, m, B=1, T=5, dtype=torch.float64, requires_grad=True)
    st = {n: t.requires_grad_() for n, t in initial_state(spec, m, B=1, dtype=torch.float64).items()}
    names, states = list(ins), list(st)

    def f(*xs):
        o, s = call(m, spec, dict(zip(names, xs)), dict(zip(states, xs[len(names):])), FAMILY[name])
        return (o,) + tuple(s[n] for n in spec.state)

    assert torch.autograd.gradcheck(f, tuple(ins.values()) + tuple(st.values()))


@pytest.mark.parametrize("name", sorted(COMPILED))
def test_streaming_step_and_causality(name):
    spec = COMPILED[name]()
    m = make(spec, small_dims(spec), dtype=torch.float32)
    sched = FAMILY[name]
    ins = inputs(spec, m, T=13, dtype=torch.float32)
    st = initial_state(spec, m, dtype=torch.float32)
    with torch.no_grad():
        o, fs = call(m, spec, ins, dict(st), sched)
        cut = 6
        o1, s1 = call(m, spec, {k: x[:, :cut] for k, x in ins.items()}, dict(st), sched)
        o2, s2 = call(m, spec, {k: x[:, cut:] for k, x in ins.items()}, s1, sched)
        assert_same_function(torch.cat([o1, o2], 1), o)
        s = dict(st)
        outs = []
        for t in range(13):
            y, s = m.step(*[ins[v][:, t] for v in spec.views], **{g: ins[g][:, t] for g in spec.gates}, state=s)
            outs.append(y)
        torch.testing.assert_close(torch.stack(outs, 1), o, rtol=1e-4, atol=1e-5)
        for n in spec.state:
            assert_same_function(s2[n], fs[n])
            torch.testing.assert_close(s[n], fs[n], rtol=1e-4, atol=1e-5)
        bad = {k: x.clone() for k, x in ins.items()}
        first = next(iter(spec.views))
        bad[first][:, 7] = float("nan")
        ob, _ = call(m, spec, bad, dict(st), sched)
        assert torch.equal(ob[:, :7], o[:, :7])


def test_column_linear_attention_is_row_linear_attention_with_the_state_transposed():
    col_spec = memspec.load(VARIANTS / "linear_attention_column.yaml")
    row_spec = memspec.load(SPECS / "linear_attention.yaml")
    dims = small_dims(row_spec)
    col, row = make(col_spec, dims, chunk=4), make(row_spec, dims, chunk=4)
    assert col.SCHEDULES == row.SCHEDULES and col.DEFAULT_SCHEDULE == row.DEFAULT_SCHEDULE == "additive"
    ins = inputs(row_spec, row, T=15)
    st = initial_state(row_spec, row)
    col_st = {"C": st["S"].transpose(-1, -2).contiguous(), "z": st["z"]}
    assert col.init_state(2)["C"].shape == (2, 2, dims["d_v"], dims["d_k"])
    for schedule in row.SCHEDULES:
        ro, rs = call(row, row_spec, ins, dict(st), schedule)
        co, cs = call(col, col_spec, ins, dict(col_st), schedule)
        assert_same_function(co, ro)
        assert cs["C"].shape == (2, 2, dims["d_v"], dims["d_k"])
        assert_same_function(cs["C"].transpose(-1, -2), rs["S"])
        assert_same_function(cs["z"], rs["z"])


def test_column_deltanet_is_deltanet_with_the_state_transposed():
    col_spec = memspec.load(SPECS / "deltanet_column.yaml")
    row_spec = memspec.load(SPECS / "deltanet.yaml")
    dims = small_dims(row_spec)
    col, row = make(col_spec, dims, chunk=4), make(row_spec, dims, chunk=4)
    ins = inputs(row_spec, row, T=15)
    st = initial_state(row_spec, row)
    assert col.DEFAULT_SCHEDULE == row.DEFAULT_SCHEDULE == "delta"
    for schedule in col.SCHEDULES:   # (the row spec's gradient write carries mini-batch too)
        ro, rs = call(row, row_spec, ins, dict(st), schedule)
        co, cs = call(col, col_spec, ins, {"C": st["W"].transpose(-1, -2)}, schedule)
        assert_same_function(co, ro)
        assert_same_function(cs["C"].transpose(-1, -2), rs["W"])


# ------------------------------------------------------------------ the gated Oja rule against fla's recurrence
def oja_loop(q, k, v, g, beta, h0):
    """fla's fused_recurrent_oja_fwd_kernel (fla/ops/gated_oja_rule/fused_recurrent.py) as a float64
    token loop, with gv = log g, a head-wise beta, scale 1 and no l2norm inside (the spec's
    conventions): h *= exp(gv)[None, :]; h += beta (k - h v) vᵀ; o = q h."""
    q, k, v, g, beta, h = (x.double() for x in (q, k, v, g, beta, h0))
    outs = []
    for t in range(q.shape[1]):
        h = h * g[:, t, :, None, :]
        err = beta[:, t, :, None] * (k[:, t] - torch.einsum("bhkv,bhv->bhk", h, v[:, t]))
        h = h + err[..., :, None] * v[:, t, :, None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], h))
    return torch.stack(outs, 1), h


def test_gated_oja_matches_the_fla_recurrence():
    spec = memspec.load(SPECS / "gated_oja.yaml")
    dims = {"d_model": 16, "heads": 2, "d_k": 6, "d_v": 7}
    m = make(spec, dims, dtype=torch.float32)
    gen = torch.Generator().manual_seed(3)
    B, T, H = 2, 40, 2
    q, k = (0.5 * torch.randn(B, T, H, 6, generator=gen) for _ in range(2))
    v = torch.nn.functional.normalize(torch.randn(B, T, H, 7, generator=gen), dim=-1)
    g = torch.exp(-torch.rand(B, T, H, 7, generator=gen) * 0.3)
    beta = torch.rand(B, T, H, generator=gen)
    h0 = 0.1 * torch.randn(B, H, 6, 7, generator=gen)
    ro, rh = oja_loop(q, k, v, g, beta, h0)
    for schedule in m.SCHEDULES:
        o, s = m(q, k, v, beta=beta, g=g, state={"S": h0}, schedule=schedule)
        assert rel_err(o, ro) <= 1e-4 and rel_err(s["S"], rh) <= 1e-4


@pytest.mark.parametrize("name", sorted(COMPILED))
def test_packed_documents_equal_each_document_alone(name):
    """cu_seqlens through the transposed kernel call: states [N, H, ...] in the declared layout."""
    spec = COMPILED[name]()
    m = make(spec, small_dims(spec), dtype=torch.float64)
    lengths = [3, 7, 1]
    ins = inputs(spec, m, B=1, T=sum(lengths), dtype=torch.float64)
    st = initial_state(spec, m, B=len(lengths), dtype=torch.float64)
    cu = torch.tensor([0, 3, 10, 11])
    o, fs = m(*[ins[v] for v in spec.views], **{g: ins[g] for g in spec.gates}, state=dict(st),
              schedule=FAMILY[name], cu_seqlens=cu)
    for i in range(len(lengths)):
        a, b = int(cu[i]), int(cu[i + 1])
        part = {n: x[:, a:b] for n, x in ins.items()}
        oi, si = call(m, spec, part, {n: t[i:i + 1] for n, t in st.items()}, FAMILY[name])
        assert_same_function(o[:, a:b], oi)
        for n in spec.state:
            assert fs[n].shape == st[n].shape
            assert_same_function(fs[n][i:i + 1], si[n])


def test_scalar_gated_oja_read_on_its_value_side_is_the_delta_rule_transposed():
    """The Oja step S <- a S + beta (k - a S v) vᵀ is the gated delta rule on Sᵀ (key v, value k):
    read on the value side too (S @ u), it gets the delta family; read q @ S, the oja family."""
    body = """
        memory oja
        dims { d_k = 4, d_v = 5 }
        view q : d_k
        view k : d_k
        view v : d_v
        view u : d_v
        gate beta = sigmoid(logit)
        gate a = sigmoid(logit) bias 2.0
        state S : [d_k, d_v] = zeros
        update { S = a * S
                 S = S + beta * outer(k - S @ v, v) }
    """
    d = analyse(mem(body + "    read = S @ u\n"))
    assert d.family == "delta" and d.transposed == ("S",)
    assert (str(d.plan.k), str(d.plan.v), str(d.plan.beta), str(d.plan.gamma)) == ("v", "k", "beta", "a")
    keyside = analyse(mem(body + "    read = q @ S\n"))
    assert keyside.family == "oja" and keyside.transposed == ()
    assert "used on the key side (q @ S) and on the value side" in keyside.orientation


def test_bfloat16_inputs_keep_float32_states_in_the_declared_layout():
    spec = memspec.load(SPECS / "deltanet_column.yaml")
    dims = small_dims(spec)
    m = make(spec, dims, dtype=torch.float32)
    ins = inputs(spec, m, T=9, dtype=torch.float32)
    o32, s32 = call(m, spec, ins)
    o, s = call(m, spec, {k: x.bfloat16() for k, x in ins.items()})
    assert o.dtype == torch.bfloat16 and s["C"].dtype == torch.float32
    assert s["C"].shape == (2, dims["heads"], dims["d_v"], dims["d_k"])
    assert rel_err(o, o32) <= 2e-2 and rel_err(s["C"], s32["C"]) <= 2e-2


LA_HEAD = """
memory la
dims { d_k = 4, d_v = 5 }
const eps = 1e-6
view q : d_k
view k : d_k
view v : d_v
let qf = elu(q) + 1
let kf = elu(k) + 1
state z : [d_k] = zeros
"""


@pytest.mark.parametrize("body", [
    """state C : [d_v, d_k] = zeros
       update { C = C + outer(v, kf)
                z = z + kf }
       read = C @ qf / (qf @ z + eps)""",
    """state C : [d_v, d_k] = zeros
       update { inc = outer(v, kf)
                C = inc + C
                z = z + kf }
       read = (C @ qf) / (z @ qf + eps)""",
    """state C : [d_v, d_k] = zeros
       update { C = (C.T + outer(kf, v)).T
                z = z + kf }
       read = qf @ C.T / (qf @ z + eps)""",
    """state Num : [d_v, d_k] = zeros
       update { Num = Num + outer(v, kf)
                z = z + kf }
       read = Num @ qf / (qf @ z + eps)""",
])
def test_column_linear_attention_written_any_way_gets_linear_attentions_plan(body):
    row = analyse(memspec.load(SPECS / "linear_attention.yaml"))
    d = analyse(mem(LA_HEAD + textwrap.dedent("        " + body)))
    assert (d.family, d.chunk, d.exact) == (row.family, row.chunk, row.exact)
    assert {"additive", "online"} <= set(d.admits)   # (the scan family reads the spec as written)
    assert len(d.transposed) == 1 and "transposed" in d.orientation

    def terms(plan):
        return sorted((st.vector, str(st.gamma), tuple(map(str, t))) for st in plan.states for t in st.terms)

    assert terms(d.plan) == terms(row.plan) == [(False, "None", ("elu(k) + 1", "v")), (True, "None", ("elu(k) + 1", "1"))]
    assert sorted(str(p.vector) for p in d.plan.probes) == sorted(str(p.vector) for p in row.plan.probes)


# ------------------------------------------------------------------ the rewrite over Sᵀ keeps every value
@pytest.mark.parametrize("name", ["linear_attention", "deltanet", "gated_deltanet", "kda", "momentum_deltanet",
                                  "gla", "rwkv7", "titans", "ttt_mlp", "mesa"])
def test_transposed_spec_is_the_same_memory_with_its_states_transposed(name):
    """``transposed_spec`` run by the reference interpreter: the same outputs, the final states
    the transposes of the original's (the rewrite of every value, model, loss and gradient)."""
    from memspec import reference
    from memspec.schedule.algebra import Algebra
    from memspec.schedule.sides import matrix_states, transposed_spec
    from _compiled_harness import ref_params

    spec = memspec.load(SPECS / f"{name}.yaml")
    flip = matrix_states(Algebra(spec))
    assert flip
    col = transposed_spec(spec, flip)
    for n in flip:
        assert col.state[n].shape == list(reversed(spec.state[n].shape))
    dims = small_dims(spec)
    m = make(spec, dims)
    ins = inputs(spec, m, T=7)
    st = initial_state(spec, m)
    params = ref_params(spec, m)
    ro, rs = reference.run(spec, state=dict(st), dims=dims, params=params, **ins)
    tst = {n: t.transpose(-1, -2) if n in flip else t for n, t in st.items()}
    to, ts = reference.run(col, state=tst, dims=dims, params=params, **ins)
    assert_same_function(to, ro)
    for n in rs:
        assert_same_function(ts[n].transpose(-1, -2) if n in flip else ts[n], rs[n])


@pytest.mark.parametrize("name", ["linear_attention", "retention", "gla", "hgrn2", "mamba2", "rwkv6", "deltanet",
                                  "deltanet_textbook", "gated_deltanet", "longhorn", "kda", "rwkv7", "comba",
                                  "gdn2", "gated_deltaproduct", "momentum_deltanet"])
def test_every_key_side_memory_written_on_its_value_side_gets_the_same_plan(name):
    """Each shipped memory of a key-side family, rewritten over Sᵀ (a column-written twin): the
    same family, chunk and printed plan, its states seen transposed back."""
    from memspec.schedule import render_plan
    from memspec.schedule.algebra import Algebra
    from memspec.schedule.sides import matrix_states, transposed_spec

    spec = memspec.load(SPECS / f"{name}.yaml")
    flip = matrix_states(Algebra(spec))
    row, col = analyse(spec), analyse(transposed_spec(spec, flip))
    assert (col.family, col.chunk, col.exact) == (row.family, row.chunk, row.exact)
    assert col.transposed == flip and row.transposed == ()
    assert render_plan(col.plan) == render_plan(row.plan)


@pytest.mark.parametrize("name", ["gla", "mamba2", "kda", "rwkv7", "comba", "gated_deltaproduct", "momentum_deltanet"])
def test_value_side_twins_compute_what_the_shipped_memories_compute(name):
    """The compiled column-written twin (the kernel on the transposed view) against the shipped
    module, float64, every schedule the twin carries: the same outputs, the states transposed."""
    from memspec.schedule.algebra import Algebra
    from memspec.schedule.sides import matrix_states, transposed_spec

    spec = memspec.load(SPECS / f"{name}.yaml")
    flip = matrix_states(Algebra(spec))
    twin = transposed_spec(spec, flip)
    dims = small_dims(spec)
    row, col = make(spec, dims), make(twin, dims)
    ins = inputs(spec, row, T=11)
    st = initial_state(spec, row)
    col_st = {n: t.transpose(-1, -2) if n in flip else t for n, t in st.items()}
    assert col.DEFAULT_SCHEDULE == row.DEFAULT_SCHEDULE
    for schedule in col.SCHEDULES:
        ro, rs = call(row, spec, ins, dict(st), schedule)
        co, cs = call(col, twin, ins, dict(col_st), schedule)
        assert_same_function(co, ro)
        for n in rs:
            assert_same_function(cs[n].transpose(-1, -2) if n in flip else cs[n], rs[n])
