"""Newton-Schulz's closed-form backward (memspec.runtime.muon): the autograd function against
autograd through the plain iterations (the reference interpreter's ``newton_schulz``).

Square, tall, wide and batched matrices, Muon's triple and a coefficient schedule, the zero
matrix; float64 gradcheck and second derivatives (gradgradcheck, torch.func.grad inside an outer
backward), float32 agreement, torch.func.grad and vmap; and a spec whose inner loss runs through
newton_schulz (the generated code takes torch.func.grad through it, vmapped over a chunk's tokens)
against the reference interpreter.
"""
from __future__ import annotations

import warnings

import pytest
import torch

from _compiled_harness import call, initial_state, inputs, load, make, reference_run, rel_err, small_dims
from close import assert_same_function

import memspec
from memspec.pipeline.build import source
from memspec.reference import newton_schulz as plain
from memspec.runtime import muon

DT = torch.float64
# the LaCT authors' per-iteration coefficients (Moonlight's Muon)
LACT_NS = ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
           (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012))
SHAPES = [(3, 5), (5, 3), (4, 4), (2, 3, 4, 6), (2, 7, 3)]   # wide, tall, square, batched
STEPS = [1, 5, LACT_NS]
STEP_IDS = ["1", "5", "schedule"]


def _rand(*shape, seed=0, dtype=DT):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _grad(fn, X, steps, g):
    """d <fn(X, steps), g> / dX by autograd."""
    X = X.detach().clone().requires_grad_(True)
    return torch.autograd.grad((fn(X, steps) * g).sum(), X)[0]


@pytest.mark.parametrize("steps", STEPS, ids=STEP_IDS)
@pytest.mark.parametrize("shape", SHAPES)
def test_gradcheck_float64(shape, steps):
    X = _rand(*shape, seed=1).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: muon.newton_schulz(x, steps), (X,))


@pytest.mark.parametrize("steps", STEPS, ids=STEP_IDS)
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_and_gradient_are_the_plain_iterations(shape, steps):
    X, g = _rand(*shape, seed=2), _rand(*shape, seed=3)
    with torch.no_grad():
        assert_same_function(muon.newton_schulz(X, steps), plain(X, steps))
    Xg = X.clone().requires_grad_(True)
    assert_same_function(muon.newton_schulz(Xg, steps), plain(X, steps))   # the autograd function's forward
    assert_same_function(_grad(muon.newton_schulz, X, steps, g), _grad(plain, X, steps, g))


def test_the_zero_matrix_as_the_plain_iterations():
    # the output is 0; each step is then linear, X' = a X, so the gradient is (prod a) g / 1e-7
    X, g = torch.zeros(2, 3, 5, dtype=DT), _rand(2, 3, 5, seed=4)
    out = muon.newton_schulz(X.clone().requires_grad_(True), 5)
    assert float(out.detach().abs().max()) == 0.0
    got = _grad(muon.newton_schulz, X, 5, g)
    assert_same_function(got, _grad(plain, X, 5, g))
    assert_same_function(got, 3.4445 ** 5 * g / 1e-7)
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("shape", [(4, 64, 128), (4, 128, 64), (8, 16, 16)])
def test_float32_as_accurate_as_the_plain_iterations(shape):
    X, g = _rand(*shape, seed=5), _rand(*shape, seed=6)
    truth = _grad(plain, X, 5, g)
    got = _grad(muon.newton_schulz, X.float(), 5, g.float())
    assert got.dtype == torch.float32
    assert rel_err(got, truth) <= 1e-5                                            # measured 2-3e-6
    assert rel_err(got, _grad(plain, X.float(), 5, g.float())) <= 1e-5           # plain float32: the same error
    assert rel_err(muon.newton_schulz(X.float(), 5), plain(X, 5)) <= 1e-5


@pytest.mark.parametrize("steps", [2, LACT_NS[:3]], ids=["2", "schedule"])
@pytest.mark.parametrize("shape", [(3, 4), (4, 3), (2, 3, 3)])
def test_second_derivatives(shape, steps):
    X = _rand(*shape, seed=7).requires_grad_(True)
    assert torch.autograd.gradgradcheck(lambda x: muon.newton_schulz(x, steps), (X,))


@pytest.mark.parametrize("steps", [5, LACT_NS], ids=["5", "schedule"])
def test_torch_func_grad_and_vmap(steps):
    X, g = _rand(3, 4, 6, seed=8), _rand(3, 4, 6, seed=9)
    want = _grad(plain, X, steps, g)
    assert_same_function(torch.func.grad(lambda x: (muon.newton_schulz(x, steps) * g).sum())(X), want)
    per_matrix = torch.func.vmap(torch.func.grad(lambda x, w: (muon.newton_schulz(x, steps) * w).sum()))
    assert_same_function(per_matrix(X, g), want)
    assert_same_function(torch.func.vmap(lambda x: muon.newton_schulz(x, steps))(X), plain(X, steps))
    # one matrix, a batch of output gradients (a chunk's tokens at one state), without vmap's slow fallback
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        shared = torch.func.vmap(torch.func.grad(lambda x, w: (muon.newton_schulz(x, steps) * w).sum()),
                                 in_dims=(None, 0))(X[0], g)
    for i in range(len(g)):
        assert_same_function(shared[i], _grad(plain, X[0], steps, g[i]))


@pytest.mark.parametrize("shape", [(3, 5), (5, 3), (2, 4, 4)])
def test_torch_func_grad_inside_an_outer_backward(shape):
    # an inner gradient through newton_schulz, differentiated again by the outer backward
    X, g = _rand(*shape, seed=10), _rand(*shape, seed=11)

    def outer(ns):
        W = _rand(*shape, seed=12).requires_grad_(True)
        Xr = X.clone().requires_grad_(True)
        inner = torch.func.grad(lambda w: (ns(w + 0.3 * Xr, 3) * g).sum() ** 2)(W)
        return torch.autograd.grad((inner * inner.flip(-1)).sum(), (W, Xr))

    for got, want in zip(outer(muon.newton_schulz), outer(plain)):
        assert rel_err(got, want) <= 1e-10


# a memory whose model reads its state through newton_schulz: the inner gradient goes through it
NS_MODEL = """
name: ns_model
dims: {d_model: 16, heads: 2, d_k: 4, d_v: 5}
views: {q: d_k, k: d_k, v: d_v}
gates: {eta: sigmoid(logit)}
state: {W: {shape: [d_k, d_v]}}
model: f(u) = u @ newton_schulz(W + 0.1, 2)
loss: 0.5 * sum((f(k) - v)^2)
update: ["W = W - eta * grad(loss, W)"]
read: f(q)
"""


@pytest.mark.parametrize("schedule", ["online", "minibatch"])
def test_a_model_through_newton_schulz_matches_the_reference(tmp_path, schedule):
    path = tmp_path / "ns_model.yaml"
    path.write_text(NS_MODEL)
    spec = memspec.load(path)
    text = source(spec)
    assert "class _NewtonSchulz(torch.autograd.Function)" in text and "torch.func.grad" in text
    dims = small_dims(spec)
    m = make(spec, dims, chunk=4)
    ins = inputs(spec, m, B=2, T=9, requires_grad=True)
    st = initial_state(spec, m, B=2)
    o, final = call(m, spec, ins, dict(st), schedule)
    ro, rfinal = reference_run(spec, m, dims, schedule, st, ins)
    assert_same_function(o, ro)
    assert_same_function(final["W"], rfinal["W"])
    w = torch.linspace(-1, 1, o.numel(), dtype=o.dtype).reshape(o.shape)
    got = torch.autograd.grad((o * w).sum() + final["W"].square().sum(), list(ins.values()))
    want = torch.autograd.grad((ro * w).sum() + rfinal["W"].square().sum(), list(ins.values()))
    for name, a, b in zip(ins, got, want):
        assert rel_err(a, b) <= 1e-10, name


def _graph_nodes(t):
    """The names of the autograd nodes behind tensor t."""
    seen, stack = set(), [t.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(n for n, _ in node.next_functions)
    return {type(n).__name__ for n in seen}


@pytest.mark.parametrize("path", ["specs/titans_muon.yaml", "specs/atlas.yaml", "specs/variants/lact_muon.yaml",
                                  "specs/variants/titans_muon_chunked.yaml"])
def test_generated_modules_differentiate_through_the_autograd_function(path):
    spec = load(path)
    assert "class _NewtonSchulz(torch.autograd.Function)" in source(spec)
    dims = small_dims(spec)
    m = make(spec, dims, chunk=4)
    m.checkpoint = False
    ins = inputs(spec, m, B=1, T=9, requires_grad=True)
    o, _ = call(m, spec, ins, initial_state(spec, m, B=1))
    assert "_NewtonSchulzBackward" in _graph_nodes(o)
