"""The momentum family (memspec.schedule.momentum, codegen.momentum): two states coupled linearly by a
triangular 2x2 block decay plus one rank one, decided from the composed normal form however the
spec writes it, and the compiled chunked schedule against the token-by-token reference."""
from __future__ import annotations

import textwrap

import pytest
import torch
from close import assert_same_function

import memspec
from memspec import reference
from memspec.pipeline.build import build_memory
from memspec.schedule import analyse, explain

HEAD = """
memory m
dims { d_k = 4, d_v = 3, heads = 2 }
view q : d_k
view k : d_k
view v : d_v
gate eta = sigmoid(logit) bias -1.0
gate mu = sigmoid(logit) bias 1.0
gate alpha = sigmoid(logit) bias -2.0
state W : [d_k, d_v] = zeros
state U : [d_k, d_v] = zeros
let kn = l2norm(k)
model f(u) = u @ W
loss = 0.5 * sum((f(kn) - v)^2)
"""

GRAD = """update {
  U = mu * U - eta * grad(loss, W)
  W = (1 - alpha) * W + U
}
read = f(l2norm(q))
"""

VARIANTS = {
    # the error written out instead of grad(...)
    "explicit": """update {
  U = mu * U + eta * outer(kn, v - kn @ W)
  W = (1 - alpha) * W + U
}
read = f(l2norm(q))
""",
    # the error as a temporary of the token, the decay written as a subtraction
    "temporaries": """update {
  e = kn @ W - v
  U = mu * U - outer(eta * kn, e)
  W = W - alpha * W + U
}
read = l2norm(q) @ W
""",
}

# the momentum negated: M = -U (fla's sign), the same memory W
NEGATED = """update {
  U = mu * U + eta * grad(loss, W)
  W = (1 - alpha) * W - U
}
read = f(l2norm(q))
"""


def mem(text: str):
    return memspec.loads(textwrap.dedent(text), "mem")


def _inputs(spec, B=2, T=11, H=2, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    dims = {"d_k": 4, "d_v": 3, "d_p": 4}
    x = {n: torch.randn(B, T, H, dims[spec.views[n].dim], generator=g, dtype=dtype) for n in spec.views}
    for n in spec.gates:
        x[n] = torch.rand(B, T, H, generator=g, dtype=dtype) * 0.8 + 0.1
    st = {n: torch.randn(B, H, 4, 3, generator=g, dtype=dtype) * 0.3 for n in spec.state}
    return x, st


def _run(spec, x, st, schedule, chunk=4):
    m = build_memory(spec, compile=False, chunk=chunk)
    with torch.no_grad():
        return m(*[x[v] for v in spec.views], **{g: x[g] for g in spec.gates}, state=dict(st), schedule=schedule)


def _rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _check_against_reference(spec, x, st, tol=1e-4):
    ro, rs = reference.run(spec, state=dict(st), **x)
    o, fs = _run(spec, x, st, "momentum")
    assert _rel(o, ro) <= tol
    for n in spec.state:
        assert _rel(fs[n], rs[n]) <= tol, n
    return o, fs


def test_momentum_deltanet_is_momentum_with_the_kernels_mapping():
    d = analyse(memspec.load("specs/momentum_deltanet.yaml"))
    assert (d.family, d.exact, d.chunk) == ("momentum", True, 64)
    p = d.plan
    assert (p.state, p.momentum, p.sign) == ("W", "U", -1)
    assert [memspec.lang.expr.unparse(e) for e in (p.k, p.v, p.gamma, p.mu, p.beta, p.eta)] == \
        ["l2norm(k)", "v", "1 - alpha", "mu", "1", "eta"]
    assert p.p is None and p.inclusive


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_a_variant_written_differently_gets_the_same_plan_and_numbers(name):
    base, other = mem(HEAD + GRAD), mem(HEAD + VARIANTS[name])
    a, b = analyse(base), analyse(other)
    assert a.family == b.family == "momentum"
    assert (a.plan.state, a.plan.momentum, a.plan.sign, a.plan.beta, a.plan.eta, a.plan.v) == \
        (b.plan.state, b.plan.momentum, b.plan.sign, b.plan.beta, b.plan.eta, b.plan.v)
    x, st = _inputs(base)
    oa, sa = _check_against_reference(base, x, st)
    ob, sb = _check_against_reference(other, x, st)
    assert _rel(ob, oa) <= 1e-5 and all(_rel(sb[n], sa[n]) <= 1e-5 for n in "WU")


def test_the_momentum_negated_is_the_kernels_sign():
    """U = mu U + eta grad, W = (1 - alpha) W - U is the kernel's own M = U (sign +1); its U is minus
    the first spec's U, its W the same, for the initial state negated likewise."""
    base, neg = mem(HEAD + GRAD), mem(HEAD + NEGATED)
    a, b = analyse(base), analyse(neg)
    assert b.family == "momentum" and (a.plan.sign, b.plan.sign) == (-1, 1)
    assert (b.plan.beta, b.plan.eta) == (a.plan.beta, a.plan.eta)
    x, st = _inputs(base)
    oa, sa = _check_against_reference(base, x, st)
    ob, sb = _check_against_reference(neg, x, {"W": st["W"], "U": -st["U"]})
    assert _rel(ob, oa) <= 1e-5 and _rel(sb["W"], sa["W"]) <= 1e-5 and _rel(-sb["U"], sa["U"]) <= 1e-5


def test_a_second_step_size_and_an_asymmetric_error_read():
    """fla's form with both step sizes and a feedback key p != k: M = mu M + eta outer(kn, p @ W - v),
    W = (1 - alpha) W - beta M (beta a gate, the error read at the view p)."""
    spec = mem(HEAD.replace("view v : d_v", "view v : d_v\nview p : d_k").replace(
        "gate alpha", "gate beta = sigmoid(logit)\ngate alpha") + """update {
  U = mu * U + eta * outer(kn, l2norm(p) @ W - v)
  W = (1 - alpha) * W - beta * U
}
read = f(l2norm(q))
""")
    d = analyse(spec)
    assert d.family == "momentum"
    assert d.plan.sign == 1 and memspec.lang.expr.unparse(d.plan.beta) == "beta"
    assert memspec.lang.expr.unparse(d.plan.p) == "l2norm(p)"
    x, st = _inputs(spec, seed=3)
    _check_against_reference(spec, x, st)


def test_no_decays_and_a_scaled_step_along_the_momentum():
    """gamma = mu = 1 (the kernel is given zero log decays) and W = W + 0.5 U: beta = 0.5."""
    spec = mem(HEAD + """update {
  U = U - eta * grad(loss, W)
  W = W + 0.5 * U
}
read = f(l2norm(q))
""")
    d = analyse(spec)
    assert d.family == "momentum"
    assert d.plan.gamma is None and d.plan.mu is None and float(d.plan.beta.value) == 0.5
    x, st = _inputs(spec, seed=4)
    _check_against_reference(spec, x, st)


def test_the_states_declared_the_other_way_round():
    text = HEAD.replace("state W : [d_k, d_v] = zeros\nstate U : [d_k, d_v] = zeros",
                        "state U : [d_k, d_v] = zeros\nstate W : [d_k, d_v] = zeros")
    a, b = analyse(mem(HEAD + GRAD)), analyse(mem(text + GRAD))
    assert b.family == "momentum" and (b.plan.state, b.plan.momentum) == ("W", "U")
    assert b.plan == a.plan


@pytest.mark.parametrize("update,why", [
    # the memory takes the momentum's write twice as much as its decayed value and correction
    ("U = mu * U - eta * grad(loss, W)\n  W = (1 - alpha) * W + U + eta * outer(kn, v)",
     "in different proportions"),
    # the momentum reads the memory through a scalar: the block decay is not triangular
    ("U = mu * U + 0.1 * W - eta * grad(loss, W)\n  W = (1 - alpha) * W + U", "not triangular"),
    # the memory decays per channel
    ("U = mu * U - eta * grad(loss, W)\n  W = diag(1 - alpha * kn) @ W + U", "per channel"),
    # the memory steps first, along the momentum's previous value, and the gradient is taken at the new memory
    ("W = (1 - alpha) * W + U\n  U = mu * U - eta * grad(loss, W)", "corrects through the memory only"),
])
def test_coupled_states_that_do_not_fit_stay_online_with_the_reason(update, why):
    spec = mem(HEAD + "update {\n  " + update + "\n}\nread = f(l2norm(q))\n")
    d = analyse(spec)
    assert d.family == "online"
    assert why in dict(d.rejected)["momentum"]
    assert "momentum: " in explain(spec, d)


def test_the_read_of_the_momentum_is_not_admitted():
    spec = mem(HEAD + GRAD.replace("read = f(l2norm(q))", "read = l2norm(q) @ W + l2norm(q) @ U"))
    d = analyse(spec)
    assert d.family == "online"
    assert "the read probes the momentum" in dict(d.rejected)["momentum"]


def test_several_probes_and_the_exclusive_read():
    """Two probes of the memory (two kernel calls) and order read_write (o_t reads S_{t-1})."""
    spec = mem(HEAD + "order read_write\n" + GRAD.replace(
        "read = f(l2norm(q))", "read = l2norm(q) @ W + 0.5 * (l2norm(k) @ W)"))
    d = analyse(spec)
    assert d.family == "momentum" and not d.plan.inclusive and len(d.plan.probes) == 2
    x, st = _inputs(spec, seed=5)
    _check_against_reference(spec, x, st)


@pytest.mark.slow
def test_the_chunked_schedule_under_torch_compile_equals_eager():
    from _compiled_harness import call, inputs, make, small_dims

    spec = memspec.load("specs/momentum_deltanet.yaml")
    dims = small_dims(spec)
    eager = make(spec, dims, dtype=torch.float32)
    comp = make(spec, dims, dtype=torch.float32, compile=True)
    comp.load_state_dict(eager.state_dict())
    ins = inputs(spec, eager, T=10, dtype=torch.float32)
    with torch.no_grad():
        a, sa = call(eager, spec, ins, None, "momentum")
        b, sb = call(comp, spec, ins, None, "momentum")
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)
    assert all(torch.allclose(sa[n], sb[n], atol=1e-5, rtol=1e-5) for n in "WU")


# ---------------------------------------------------------------- non-finite inputs (the shared screen)
MOMENTUM_ARGS = ("q", "k", "v", "p", "log_gamma", "log_mu", "beta", "eta", "S0", "M0")


def _kernel_inputs(B=1, T=40, H=2, K=5, V=4, seed=31):
    g = torch.Generator().manual_seed(seed)
    f64 = dict(generator=g, dtype=torch.float64)
    q = torch.randn(B, T, H, K, **f64)
    k, p = (torch.nn.functional.normalize(torch.randn(B, T, H, K, **f64), dim=-1) for _ in range(2))
    v = torch.randn(B, T, H, V, **f64)
    lgam, lmu = (torch.log(0.5 + 0.5 * torch.rand(B, T, H, **f64)) for _ in range(2))
    beta, eta = (torch.rand(B, T, H, **f64) for _ in range(2))
    S0, M0 = (torch.randn(B, H, K, V, **f64) for _ in range(2))
    return [q, k, v, p, lgam, lmu, beta, eta, S0, M0]


def _run_with_grads(args, upto, inclusive=True, **kw):
    """The kernel's outputs and final states, and every input's gradient of a loss on outputs 0..upto-1."""
    from memspec.runtime.momentum import chunk_momentum_delta

    leaves = [x.clone().requires_grad_() for x in args]
    o, S, M = chunk_momentum_delta(*leaves, 16, inclusive=inclusive, **kw)
    w = torch.randn(o[:, :upto].shape, generator=torch.Generator().manual_seed(2), dtype=o.dtype)
    return (o, S, M), torch.autograd.grad((o[:, :upto] * w).sum(), leaves)


@pytest.mark.parametrize("inclusive", [True, False])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("which", MOMENTUM_ARGS[:8])
def test_momentum_a_non_finite_token_reaches_no_earlier_output(which, bad, inclusive):
    """A NaN / inf in token 10's inputs (head 1 only; token 10 inside the first chunk of 16): outputs
    0..9, head 0 throughout, and every input's gradient of a loss on outputs 0..9 equal the clean
    run's at float64's tolerance (two code paths: on CPU the clean run skips the masks; the bad
    token runs as an identity token, cleared by torch.where: no NaN meets a zero of the causal
    masks, forward or backward); a bad state input makes every output of
    head 1 that reads a state at or after it (from 10 inclusive, from 11 exclusive) and both final
    states of head 1 NaN, a bad probe only its own output; the token loop is not finite there
    either."""
    from memspec.runtime.momentum import recurrent_momentum_delta

    if which.startswith("log_") and bad == float("-inf"):
        pytest.skip("a log decay of -inf is a decay of 0: valid (tested below)")
    t = 10
    clean = _kernel_inputs()
    dirty = [x.clone() for x in clean]
    dirty[MOMENTUM_ARGS.index(which)][0, t, 1] = bad
    (oc, Sc, Mc), gc = _run_with_grads(clean, t, inclusive)
    (od, Sd, Md), gd = _run_with_grads(dirty, t, inclusive)
    assert_same_function(od[:, :t], oc[:, :t])
    assert_same_function(od[:, :, 0], oc[:, :, 0])
    assert_same_function(Sd[:, 0], Sc[:, 0])
    assert_same_function(Md[:, 0], Mc[:, 0])
    if which == "q":
        assert torch.isnan(od[:, t, 1]).all()
        assert_same_function(od[:, t + 1:], oc[:, t + 1:])
        assert_same_function(Sd, Sc)
        assert_same_function(Md, Mc)
    else:
        first = t if inclusive else t + 1                          # the first output reading a state after token t
        assert_same_function(od[:, :first], oc[:, :first])
        assert torch.isnan(od[:, first:, 1]).all()
        assert torch.isnan(Sd[:, 1]).all() and torch.isnan(Md[:, 1]).all()
        ref = recurrent_momentum_delta(*dirty, inclusive)
        assert not torch.isfinite(ref[0][:, first:, 1]).all() and not torch.isfinite(ref[1][:, 1]).all()
    for g1, g2 in zip(gc, gd):   # every input's gradient, the bad token's included (0 there)
        assert torch.isfinite(g2).all()
        assert_same_function(g2, g1)
    assert (gd[MOMENTUM_ARGS.index(which)][0, t:] == 0).all()


def test_momentum_a_non_finite_token_without_probes_poisons_the_final_states_only_of_its_head():
    from memspec.runtime.momentum import chunk_momentum_delta

    args = _kernel_inputs(B=2)
    _, S, M = chunk_momentum_delta(None, *args[1:], 16)
    args[1][1, 33, 0, 2] = float("nan")                            # batch row 1, head 0, token 33 (the tail chunk)
    o, S1, M1 = chunk_momentum_delta(None, *args[1:], 16)
    assert o is None and torch.isnan(S1[1, 0]).all() and torch.isnan(M1[1, 0]).all()
    keep = torch.ones(2, 2, dtype=torch.bool)
    keep[1, 0] = False
    assert_same_function(S1[keep], S[keep])
    assert_same_function(M1[keep], M[keep])


def test_momentum_a_decay_of_zero_is_valid():
    """Log decays of -inf (the state or the momentum forgets everything) are no bad tokens: the
    outputs, both states and every gradient are finite and equal the token loop's (-80 for -inf)."""
    from memspec.runtime.momentum import chunk_momentum_delta, recurrent_momentum_delta

    args = _kernel_inputs(T=37)
    args[4][0, 5], args[5][0, 20] = float("-inf"), float("-inf")
    leaves = [x.requires_grad_() for x in args]
    got = chunk_momentum_delta(*leaves, 16)
    ref = recurrent_momentum_delta(*(x.detach().clamp_min(-80.0) if i in (4, 5) else x.detach()
                                     for i, x in enumerate(leaves)))
    for a, b in zip(got, ref):
        assert torch.isfinite(a).all()
        assert_same_function(a, b)
    grads = torch.autograd.grad(sum(x.square().sum() for x in got), leaves)
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("with_probes", [True, False])
def test_momentum_a_non_finite_token_stays_in_its_document(with_probes):
    """Packed documents (chunks of 16: each document laid out from a chunk): a NaN in token 3 of the
    second document makes that document's outputs from token 3 on and its final states NaN; the
    outputs before it, and the other documents' outputs and states, are those of each document
    alone (the gradients of the outputs before the bad token too)."""
    from memspec.runtime.momentum import chunk_momentum_delta
    from memspec.runtime.varlen import _Documents

    T, cu, t = 45, torch.tensor([0, 7, 27, 45]), 10
    args = _kernel_inputs(T=T)
    g = torch.Generator().manual_seed(7)
    args[8], args[9] = (torch.randn(3, 2, 5, 4, generator=g, dtype=torch.float64) for _ in range(2))
    if not with_probes:
        args[0] = None
    args[3] = args[3].clone()
    args[3][:, t] = float("nan")                                     # p at token 3 of the second document
    leaves = [x if x is None else x.clone().requires_grad_() for x in args]
    o, S, M = chunk_momentum_delta(*leaves, 16, documents=_Documents(cu))
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        piece = [x if x is None else x[:, a:b] for x in args[:8]]
        if n == 1:
            piece = [x if x is None else x[:, :t - a] for x in piece]   # the clean part before the bad token
        o_doc, S_doc, M_doc = chunk_momentum_delta(*piece, args[8][n:n + 1], args[9][n:n + 1], 16)
        if with_probes:
            assert_same_function(o[:, a:a + o_doc.shape[1]], o_doc)
        if n == 1:
            assert torch.isnan(S[n]).all() and torch.isnan(M[n]).all()
            assert o is None or torch.isnan(o[:, t:b]).all()
        else:
            assert_same_function(S[n], S_doc[0])
            assert_same_function(M[n], M_doc[0])
    if with_probes:
        grads = torch.autograd.grad(o[:, :t].sum() + o[:, 27:].sum() + S[2].sum(), [x for x in leaves if x is not None])
        assert all(torch.isfinite(gr).all() for gr in grads)
        assert (grads[3][:, t:27] == 0).all()                      # the bad token and its document's later ones
