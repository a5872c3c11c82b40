"""The oja family (a state transformed on its value side, read on its key side): its kernel against
its token loop, the gated Oja rule's module against the reference interpreter and against a float64
token loop of flash-linear-attention's recurrence (written here), its analysis and explain."""
from __future__ import annotations

import itertools
import textwrap
from pathlib import Path

import pytest
import torch
from _compiled_harness import call, initial_state, inputs, make, reference_run, rel_err, small_dims
from close import assert_same_function

import memspec
from memspec.pipeline.build import build_memory
from memspec.runtime.oja import chunk_oja, recurrent_oja
from memspec.schedule import analyse, explain

ROOT = Path(__file__).resolve().parent.parent
OJA = ROOT / "specs" / "gated_oja.yaml"


def oja_inputs(B, T, H, K, V, *, dtype=torch.float64, seed=0, decay="channel", log_lo=-3.0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, K, generator=g, dtype=dtype) for _ in range(2))
    v = 0.5 * torch.randn(B, T, H, V, generator=g, dtype=dtype)
    beta = torch.rand(B, T, H, generator=g, dtype=dtype)
    shape = {"channel": (B, T, H, V), "scalar": (B, T, H)}.get(decay)
    lg = None if shape is None else log_lo * torch.rand(shape, generator=g, dtype=dtype)
    S0 = torch.randn(B, H, K, V, generator=g, dtype=dtype)
    return q, k, v, beta, lg, S0


def fla_loop(q, k, v, beta, gv, h0):
    """flash-linear-attention's gated Oja recurrence (fused_recurrent_oja_fwd_kernel, scale 1, no
    l2norm), float64, one token at a time: h *= exp(gv); h += beta (k - h v) vᵀ; o = q h."""
    q, k, v, beta, gv, h = (x.double() for x in (q, k, v, beta, gv, h0))
    outs = []
    for t in range(q.shape[1]):
        h = h * torch.exp(gv[:, t])[:, :, None, :]                                   # [B, H, K, V]
        err = beta[:, t, :, None] * (k[:, t] - (h * v[:, t, :, None, :]).sum(-1))     # [B, H, K]
        h = h + err[..., None] * v[:, t, :, None, :]
        outs.append((h * q[:, t, ..., None]).sum(-2))                                  # [B, H, V]
    return torch.stack(outs, 1), h


def weighted(o, S, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (o * torch.randn(o.shape, generator=g, dtype=o.dtype)).sum() \
        + (S * torch.randn(S.shape, generator=g, dtype=S.dtype)).sum()


# ------------------------------------------------------------------ the kernel
KERNEL_CASES = [  # T, chunk, sub
    (37, 8, 4),     # T not a multiple of the chunk
    (20, 16, 4),
    (5, 64, 16),    # the chunk larger than T
    (64, 32, 8),
    (1, 4, 4),
]


def check_kernel(T, C, sub, decay, inclusive, after, other_u):
    q, k, v, beta, lg, S0 = oja_inputs(2, T, 3, 4, 5, decay=decay, seed=T + C)
    u = 0.5 * torch.randn_like(v) if other_u else None
    xs = [x.requires_grad_() for x in (q, v, beta, k, S0) + ((lg,) if lg is not None else ())]

    def args():   # (each run its own graph of the derived inputs)
        return xs[0], xs[1], u, -xs[2], xs[2][..., None] * xs[3], xs[5] if lg is not None else None, xs[4]

    ref = recurrent_oja(*args(), inclusive=inclusive, read_after_decay=after)
    got = chunk_oja(*args(), C, sub=sub, inclusive=inclusive, read_after_decay=after)
    for x, y in zip(got, ref):
        assert_same_function(x, y)
    for x, y in zip(torch.autograd.grad(weighted(*got), xs), torch.autograd.grad(weighted(*ref), xs)):
        assert_same_function(x, y)


@pytest.mark.parametrize("T,C,sub", KERNEL_CASES)
@pytest.mark.parametrize("decay", ["channel", "scalar", None])
def test_kernel_matches_loop(T, C, sub, decay):
    """Outputs, final states and gradients of the chunked kernel equal its token loop (float64),
    for every read / correction convention and a correction vector u other than w."""
    for inclusive, after, other_u in itertools.product([True, False], [True, False], [False, True]):
        check_kernel(T, C, sub, decay, inclusive, after, other_u)


def test_kernel_sub_chunk_is_a_free_choice():
    q, k, v, beta, lg, S0 = oja_inputs(1, 50, 2, 3, 6, log_lo=-8.0)
    outs = [chunk_oja(q, v, None, -beta, beta[..., None] * k, lg, S0, 16, sub=s) for s in (1, 2, 4, 8, 16)]
    for o, S in outs[1:]:
        assert_same_function(o, outs[0][0])
        assert_same_function(S, outs[0][1])


def test_kernel_gradcheck():
    q, k, v, beta, lg, S0 = oja_inputs(1, 9, 2, 3, 4)
    xs = [x.requires_grad_() for x in (q, k, v, beta, lg, S0)]
    assert torch.autograd.gradcheck(
        lambda q, k, v, beta, lg, S0: chunk_oja(q, v, None, -beta, beta[..., None] * k, lg, S0, 4, sub=2), xs)


def test_kernel_zero_decays_and_empty_input():
    """A decay of exactly 0 (log -inf) is taken as it is: finite, equal to the loop; T = 0 returns the state."""
    q, k, v, beta, lg, S0 = oja_inputs(1, 30, 2, 3, 4)
    lg[:, 7, :, 1] = float("-inf")
    lg[:, 20] = float("-inf")
    args = (q, v, None, -beta, beta[..., None] * k, lg, S0)
    got, ref = chunk_oja(*args, 8, sub=4), recurrent_oja(*args)
    assert all(torch.isfinite(x).all() for x in got)
    for x, y in zip(got, ref):
        assert_same_function(x, y)
    o, S = chunk_oja(q[:, :0], v[:, :0], None, -beta[:, :0], k[:, :0], lg[:, :0], S0, 8)
    assert o.shape == (1, 0, 2, 4) and torch.equal(S, S0)


# ------------------------------------------------------------------ the gated Oja rule's module
@pytest.fixture(scope="module")
def oja_spec():
    return memspec.load(OJA)


def test_auto_picks_oja_and_explain_says_why(oja_spec):
    d = analyse(oja_spec)
    assert (d.family, d.exact, d.chunk) == ("oja", True, 32)
    assert d.admits == ("oja", "online")
    text = explain(oja_spec)
    assert text.startswith("gated_oja: oja (exact chunked form")
    assert "a transition on the value side only, diagonal plus one rank-one correction: S <- S Diag(g) + z vᵀ with " \
           "z = (-beta) (S Diag(g)) v + (beta * k) (the correction reads the state after the decay)" in text
    assert "the read is a function of the key-side probes q @ S" in text
    assert "the decay g of S lies in [0, 1]" in text
    assert "the decay acts on the value side: chunks of 32 tokens in sub-chunks of 8" in text
    plan = d.plan
    assert (plan.state, plan.u, plan.read_after_decay, plan.transposed, plan.inclusive) == ("S", None, True, False, True)


def test_compiled_equals_reference(oja_spec):
    """Outputs, final states and gradients (inputs and initial state) of the oja schedule equal the
    reference interpreter, float64; T not a multiple of the chunk."""
    dims = small_dims(oja_spec)
    m = make(oja_spec, dims, chunk=4)
    assert m.DEFAULT_SCHEDULE == "oja"
    ins = inputs(oja_spec, m, B=2, T=11, requires_grad=True)
    st = {n: t.detach().clone().requires_grad_(True) for n, t in initial_state(oja_spec, m).items()}
    o, final = call(m, oja_spec, ins, state=dict(st), schedule="oja")
    ro, rfinal = reference_run(oja_spec, m, dims, "online", st, ins)
    assert_same_function(o, ro)
    assert_same_function(final["S"], rfinal["S"])
    leaves = list(ins.values()) + list(st.values())
    got = torch.autograd.grad(weighted(o, final["S"]), leaves)
    ref = torch.autograd.grad(weighted(ro, rfinal["S"]), leaves)
    for x, y in zip(got, ref):
        assert_same_function(x, y)
    o2, final2 = call(m, oja_spec, ins, state=dict(st), schedule="online")
    assert_same_function(o, o2)
    assert_same_function(final["S"], final2["S"])


def test_compiled_gradcheck(oja_spec):
    dims = small_dims(oja_spec)
    m = make(oja_spec, dims, chunk=4)
    ins = inputs(oja_spec, m, B=1, T=6, requires_grad=True)
    st = initial_state(oja_spec, m, B=1)["S"].requires_grad_(True)
    names = list(ins)

    def f(*xs):
        o, final = call(m, oja_spec, dict(zip(names, xs[:-1])), state={"S": xs[-1]}, schedule="oja")
        return o, final["S"]

    assert torch.autograd.gradcheck(f, [*ins.values(), st])


def test_causal_streaming_and_step(oja_spec):
    dims = small_dims(oja_spec)
    m = make(oja_spec, dims, chunk=4)
    ins = inputs(oja_spec, m, B=2, T=13)
    st = initial_state(oja_spec, m)
    o, final = call(m, oja_spec, ins, state=dict(st))
    # causality: changing token 9 leaves every earlier output exactly as it was
    moved = {n: x.clone() for n, x in ins.items()}
    for x in moved.values():
        x[:, 9] = x[:, 9] * 1.5 + 0.1
    o_moved, _ = call(m, oja_spec, moved, state=dict(st))
    assert torch.equal(o_moved[:, :9], o[:, :9]) and not torch.equal(o_moved[:, 9], o[:, 9])
    # streaming: two calls (split inside a chunk) are one
    first = {n: x[:, :6] for n, x in ins.items()}
    rest = {n: x[:, 6:] for n, x in ins.items()}
    o1, mid = call(m, oja_spec, first, state=dict(st))
    o2, end = call(m, oja_spec, rest, state=mid)
    assert_same_function(torch.cat([o1, o2], 1), o)
    assert_same_function(end["S"], final["S"])
    # decoding: step() token by token after a prefill
    state = mid
    for t in range(6, 13):
        o_t, state = m.step(*[ins[v][:, t] for v in oja_spec.views], **{g: ins[g][:, t] for g in oja_spec.gates},
                            state=state)
        assert_same_function(o_t, o[:, t])
    assert_same_function(state["S"], final["S"])


def test_packed_documents_equal_each_alone(oja_spec):
    dims = small_dims(oja_spec)
    m = make(oja_spec, dims, chunk=4)
    lengths = [1, 3, 4, 6, 9, 1, 2]
    ins = inputs(oja_spec, m, B=1, T=sum(lengths), requires_grad=True)
    st = initial_state(oja_spec, m, B=len(lengths))["S"].requires_grad_(True)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    o, final = m(*[ins[v] for v in oja_spec.views], **{g: ins[g] for g in oja_spec.gates}, state={"S": st},
                 cu_seqlens=cu)
    outs, finals, a = [], [], 0
    for i, n in enumerate(lengths):
        piece = {name: x[:, a:a + n] for name, x in ins.items()}
        oi, fi = call(m, oja_spec, piece, state={"S": st[i:i + 1]}, schedule="online")
        outs.append(oi)
        finals.append(fi["S"])
        a += n
    alone, alone_S = torch.cat(outs, 1), torch.cat(finals, 0)
    assert_same_function(o, alone)
    assert_same_function(final["S"], alone_S)
    leaves = [*ins.values(), st]
    for x, y in zip(torch.autograd.grad(weighted(o, final["S"]), leaves),
                    torch.autograd.grad(weighted(alone, alone_S), leaves)):
        assert_same_function(x, y)


def fla_case(T, H, D, log_gate=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(1, T, H, D, generator=g) / D ** 0.5 for _ in range(2))
    v = torch.randn(1, T, H, D, generator=g) / D ** 0.5
    beta = torch.rand(1, T, H, generator=g)
    gv = -torch.nn.functional.softplus(torch.randn(1, T, H, D, generator=g) - 2.0) if log_gate is None \
        else torch.full((1, T, H, D), float(log_gate))
    h0 = 0.1 * torch.randn(1, H, D, D, generator=g)
    return q, k, v, beta, gv, h0


@pytest.mark.parametrize("log_gate", [None, -40.0])
def test_float32_matches_fla_recurrence(log_gate):
    """The compiled module in float32 (chunk 64, T = 300) against a float64 token loop of fla's
    recurrence at relative error <= 1e-4; log gates of -40 per token give finite outputs, states and
    gradients."""
    T, H, D = 300, 2, 32
    memory = build_memory(OJA, compile=False, heads=H, d_k=D, d_v=D)
    q, k, v, beta, gv, h0 = fla_case(T, H, D, log_gate)
    gv.requires_grad_(True)
    o, final = memory(q, k, v, beta=beta, g=torch.exp(gv), state={"S": h0})
    ro, rh = fla_loop(q, k, v, beta, gv, h0)
    assert rel_err(o, ro) <= 1e-4 and rel_err(final["S"], rh) <= 1e-4
    (gg,) = torch.autograd.grad(weighted(o, final["S"]), [gv])
    assert torch.isfinite(gg).all()


def test_extreme_gates_finite_in_kernel():
    """Log gates of -40 per token (the exponents of a chunk reach -2560): finite values and gradients,
    equal to the float64 loop."""
    q, k, v, beta, lg, S0 = oja_inputs(1, 70, 2, 4, 5, dtype=torch.float32, log_lo=-40.0)
    lg = lg.requires_grad_()
    args = (q, v, None, -beta, beta[..., None] * k, lg, S0)
    o, S = chunk_oja(*args, 64)
    ro, rS = recurrent_oja(*(x.double() if x is not None else None for x in args))
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert rel_err(o, ro) <= 1e-5 and rel_err(S, rS) <= 1e-5
    (g,) = torch.autograd.grad(weighted(o, S), [lg])
    assert torch.isfinite(g).all()


# ------------------------------------------------------------------ the analysis
def load_mem(text: str):
    return memspec.loads(textwrap.dedent(text), "mem")


COLUMN_OJA = """
memory oja_column
dims { d_model = 16, heads = 2, d_k = 4, d_v = 5 }
view q : d_k
view k : d_k
view v : d_v
gate beta = sigmoid(logit)
gate g : [d_v] = exp(-softplus(logit))
state C : [d_v, d_k] = zeros
update {
  C = diag(g) @ C
  C = C + beta * outer(v, k - v @ C)
}
read = C @ q
"""


def test_column_written_oja_gets_the_same_schedule_and_numbers(oja_spec):
    """The rule written over Sᵀ (C = Sᵀ, read C @ q) is analysed transposed: the same plan, and its
    module gives the same outputs with the state transposed."""
    col = load_mem(COLUMN_OJA)
    d = analyse(col)
    assert d.family == "oja" and d.plan.transposed
    assert (d.plan.u, d.plan.read_after_decay, d.plan.inclusive) == (None, True, True)
    dims = small_dims(oja_spec)
    m_row = make(oja_spec, dims, chunk=4)
    m_col = make(col, dims, chunk=4)
    ins = inputs(oja_spec, m_row, B=2, T=10)
    S0 = initial_state(oja_spec, m_row)["S"]
    o_row, f_row = call(m_row, oja_spec, ins, state={"S": S0})
    o_col, f_col = call(m_col, col, ins, state={"C": S0.transpose(-1, -2)})
    assert_same_function(o_col, o_row)
    assert_same_function(f_col["C"], f_row["S"].transpose(-1, -2))
    ro, rf = reference_run(col, m_col, dims, "online", {"C": S0.transpose(-1, -2)}, ins)
    assert_same_function(o_col, ro)
    assert_same_function(f_col["C"], rf["C"])


BASE = """
memory oja_variant
dims {{ d_model = 16, heads = 2, d_k = 4, d_v = 5 }}
view q : d_k
view k : d_k
view v : d_v
gate beta = sigmoid(logit)
gate g : [d_v] = exp(-softplus(logit))
state S : [d_k, d_v] = zeros
update {{
{update}
}}
read = {read}
"""

REJECTED = [  # update, read, the oja family's reason
    ("  S = S @ diag(g)\n  S = S + beta * outer(k - S @ v, v) + outer(k, g)", "q @ S",
     "the write k gᵀ of S is not along v, the vector its transition acts with"),
    ("  S = S + beta * outer(k - S @ v, v) + beta * outer(k - S @ g, g)", "q @ S",
     "the transition of S has 2 rank-one terms on its value side; the oja form takes one"),
    ("  S = S @ diag(g) + outer(k, v)", "q @ S",
     "the transition of S has no rank-one term on its value side (a decay alone is additive)"),
    ("  S = S @ diag(g)\n  S = S + beta * outer(k - S @ v, v)", "S @ v",
     "the read uses the state S other than through a linear probe p @ S"),
    ("  S = S @ diag(g)\n  S = S + beta * outer(k - S @ v, v)", "q @ (S * S)",
     "the read uses the state S other than through a linear probe p @ S"),
]


@pytest.mark.parametrize("update,read,why", REJECTED)
def test_rejections_say_why(update, read, why):
    d = analyse(load_mem(BASE.format(update=update, read=read)))
    assert d.family != "oja"
    assert why in dict(d.rejected)["oja"]


def test_correction_before_the_decay_and_a_scalar_decay():
    """The correction reading the state before the decay, and a scalar decay: both admitted, the
    module equals the reference interpreter."""
    for update in ("  S = S @ diag(g) + beta * outer(k - S @ v, v)",
                   "  S = 0.9 * S\n  S = S + beta * outer(k - S @ v, v)"):
        spec = load_mem(BASE.format(update=update, read="q @ S"))
        d = analyse(spec)
        assert d.family == "oja"
        assert d.plan.read_after_decay == ("0.9" in update)
        dims = small_dims(spec)
        m = make(spec, dims, chunk=4)
        ins = inputs(spec, m, B=2, T=9)
        st = initial_state(spec, m)
        o, final = call(m, spec, ins, state=dict(st))
        ro, rf = reference_run(spec, m, dims, "online", st, ins)
        assert_same_function(o, ro)
        assert_same_function(final["S"], rf["S"])


def test_bfloat16_inputs_keep_a_float32_state():
    """bfloat16 inputs: the state and the kernel's sums stay float32, the output is bfloat16 and close
    to the float64 run of the same (rounded) inputs."""
    T, H, D = 70, 2, 16
    memory = build_memory(OJA, compile=False, heads=H, d_k=D, d_v=D)
    q, k, v, beta, gv, h0 = fla_case(T, H, D)
    xs = [x.to(torch.bfloat16) for x in (q, k, v, beta, torch.exp(gv))]
    o, s = memory(*xs[:3], beta=xs[3], g=xs[4], state={"S": h0})
    assert o.dtype == torch.bfloat16 and s["S"].dtype == torch.float32
    o64, s64 = memory.double()(*[x.double() for x in xs[:3]], beta=xs[3].double(), g=xs[4].double(),
                               state={"S": h0.double()})
    assert rel_err(o, o64) < 5e-3 and rel_err(s["S"], s64["S"]) < 1e-5


# ------------------------------------------------------------------ non-finite inputs
def _oja_args(T, seed=3):
    q, k, v, beta, lg, S0 = oja_inputs(1, T, 2, 4, 5, seed=seed)
    return [q, v, None, -beta, beta[..., None] * k, lg, S0]


@pytest.mark.parametrize("where", ["w", "c", "a", "decay"])
def test_a_non_finite_token_reaches_no_earlier_output(where):
    """A NaN or inf at token 9 (inside the third chunk of 4) leaves every earlier output as it was
    and makes every later output, and the final state, NaN -- as the token loop makes them."""
    T, t = 20, 9
    clean = _oja_args(T)
    dirty = [None if x is None else x.clone() for x in clean]
    slot = {"w": 1, "c": 3, "a": 4, "decay": 5}[where]
    dirty[slot][:, t, 1] = float("nan") if where != "decay" else float("inf")
    o0, S0 = chunk_oja(*clean, 4)
    o1, S1 = chunk_oja(*dirty, 4)
    torch.testing.assert_close(o1[:, :t], o0[:, :t], rtol=1e-12, atol=1e-12)
    assert torch.isfinite(o1[:, :, 0]).all()                                 # the other head is untouched
    assert torch.isnan(o1[:, t:, 1]).all() and torch.isnan(S1[:, 1]).all() and torch.isfinite(S1[:, 0]).all()
    ref, _ = recurrent_oja(*dirty)
    assert not torch.isfinite(ref[:, t:, 1]).any()                          # the loop's outputs are not finite either


def test_a_non_finite_probe_poisons_only_its_own_output():
    args = _oja_args(20)
    o0, S0 = chunk_oja(*args, 4)
    args[0] = args[0].clone()
    args[0][:, 6, 0, 2] = float("nan")
    o1, S1 = chunk_oja(*args, 4)
    assert torch.isnan(o1[:, 6, 0]).all()
    keep = torch.ones(20, dtype=torch.bool)
    keep[6] = False
    torch.testing.assert_close(o1[:, keep], o0[:, keep], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(S1, S0, rtol=1e-12, atol=1e-12)


def test_a_decay_of_zero_is_valid_and_gradients_before_a_bad_token_are_finite():
    args = _oja_args(20)
    args[5] = args[5].clone()
    args[5][:, 5] = float("-inf")                                            # decay 0: the state forgets
    o, S = chunk_oja(*args, 4)
    ref, S_ref = recurrent_oja(*args)
    assert_same_function(o, ref)
    assert_same_function(S, S_ref)
    leaves = [args[i].detach().requires_grad_() for i in (0, 1, 3, 4)]
    args[0], args[1], args[3], args[4] = leaves
    args[4] = args[4].detach().clone()
    args[4][:, 12, 0] = float("nan")
    args[4].requires_grad_()
    o, _ = chunk_oja(*args, 4)
    grads = torch.autograd.grad(o[:, :12].sum(), leaves[:3] + [args[4]])
    assert all(torch.isfinite(g).all() for g in grads)
    assert (grads[-1][:, 12:] == 0).all()                                    # the bad token and later writes: no gradient


def test_a_non_finite_token_stays_in_its_document():
    from memspec.runtime.varlen import _Documents

    T, cu = 21, torch.tensor([0, 6, 15, 21])
    args = _oja_args(T)
    args[6] = torch.randn(3, 2, 4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    args[1] = args[1].clone()
    args[1][:, 9] = float("nan")                                             # token 3 of the second document
    o, S = chunk_oja(*args, 4, documents=_Documents(cu))
    assert torch.isfinite(o[:, :9]).all() and torch.isnan(o[:, 9:15]).all() and torch.isfinite(o[:, 15:]).all()
    assert torch.isfinite(S[0]).all() and torch.isnan(S[1]).all() and torch.isfinite(S[2]).all()
    for (a, b), S_doc, S_init in zip(((0, 6), (15, 21)), (S[0], S[2]), (args[6][0], args[6][2])):
        piece = [None if x is None else x[:, a:b] for x in args[:6]]
        o_doc, S_alone = chunk_oja(*piece, S_init[None], 4)
        assert_same_function(o[:, a:b], o_doc)
        assert_same_function(S_doc[None], S_alone)
