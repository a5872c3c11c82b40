"""The momentum family (memspec.schedule.momentum, codegen.momentum): two states coupled linearly by a
triangular 2x2 block decay plus one rank one, decided from the composed normal form however the
spec writes it, and the compiled chunked schedule against the token-by-token reference."""
from __future__ import annotations

import textwrap

import pytest
import torch

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
