"""apply_update's speed path: the inputs split once at the calls' bounds (one backward node per
input, not a full-length gradient per call), and the column normalisation's helpers written so
that torch.compile computes their factors once per column.

With chunk 4 a group is 8 chunks (32 tokens).  A call from inside a chunk over 70 tokens runs a
piece to the chunk boundary, groups, whole chunks and a last piece; its outputs, states and
gradients are those of the same tokens fed in calls of at most one chunk (each its own slice),
and its outputs and states those of the reference interpreter.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from _compiled_harness import call, initial_state, inputs, load, make, reference_run, small_dims  # noqa: E402

from close import assert_same_function  # noqa: E402

from memspec.pipeline.build import source as generated_source  # noqa: E402

from memspec.runtime.helpers import (  # noqa: E402
    _column_norms2, _l2norm_columns, _norm_axis, _outer_sum, _renorm_columns, _renorm_kept, _silu_backward,
)

STATES = ("W0", "W1", "W2")


def _lact():
    spec = load("specs/lact.yaml")
    dims = small_dims(spec)
    return spec, dims, make(spec, dims, chunk=4)


def _run(m, spec, ins, st, bounds):
    state, outs = dict(st), []
    for a, b in bounds:
        o, state = call(m, spec, {n: t[:, a:b] for n, t in ins.items()}, state, "apply_update")
        outs.append(o)
    return torch.cat(outs, 1), state


@pytest.mark.parametrize("B", [1, 2])
def test_one_call_over_pieces_groups_and_chunks_gives_the_chunk_by_chunk_gradients(B):
    spec, _, m = _lact()
    ins, st = inputs(spec, m, B=B, T=75, requires_grad=True), initial_state(spec, m, B=B)
    # one call after 5 tokens: 3 to the boundary, 64 in two groups, a chunk and a piece of 3
    split = [(0, 5), (5, 75)]
    small = [(0, 4), (4, 5), (5, 8)] + [(a, min(a + 4, 75)) for a in range(8, 75, 4)]
    results = []
    for bounds in (split, small):
        o, state = _run(m, spec, ins, st, bounds)
        loss = o.square().sum() + sum(state[n].square().sum() for n in STATES)
        results.append((o, state, torch.autograd.grad(loss, list(ins.values()) + list(m.parameters()))))
    (o1, s1, g1), (o2, s2, g2) = results
    torch.testing.assert_close(o1, o2, rtol=1e-12, atol=1e-12)
    for n in STATES:
        torch.testing.assert_close(s1[n], s2[n], rtol=1e-12, atol=1e-12)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_one_call_from_inside_a_chunk_is_the_reference():
    spec, dims, m = _lact()
    ins, st = inputs(spec, m, T=75), initial_state(spec, m)
    with torch.no_grad():
        o, state = _run(m, spec, ins, st, [(0, 5), (5, 75)])
        ro, rs = reference_run(spec, m, dims, "apply_update", st, ins)
    torch.testing.assert_close(o, ro, rtol=1e-10, atol=1e-12)
    for n in STATES:
        torch.testing.assert_close(state[n], rs[n], rtol=1e-10, atol=1e-12)


def _backward_nodes(t) -> list:
    seen, todo, names = set(), [t.grad_fn], []
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.append(type(fn).__name__)
        todo += [f for f, _ in fn.next_functions]
    return names


def test_the_inputs_are_split_once_not_sliced_per_call():
    """T = 75 from position 0 is two groups, two chunks and a piece (5 calls): each of the six
    prepared inputs (v, three step sizes, qn, kn) is split once; no call slices the sequence."""
    spec, _, m = _lact()
    ins = inputs(spec, m, B=1, T=75, requires_grad=True)
    o, _ = call(m, spec, ins, None, "apply_update")
    names = _backward_nodes(o)
    assert names.count("SplitWithSizesBackward0") == 6
    assert "SliceBackward0" not in names


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
def test_column_helpers_are_the_plain_formulas(dtype, tol):
    x = torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x[0, :, 2] = 0.0                                     # a zero column
    want_cols = x / torch.sqrt(x.square().sum(-2, keepdim=True) + 1e-6)
    want_norm = torch.linalg.vector_norm(x, dim=-2)
    torch.testing.assert_close(_l2norm_columns(x.to(dtype)).double(), want_cols, rtol=tol, atol=tol)
    torch.testing.assert_close(_norm_axis(x.to(dtype), -2).double(), want_norm, rtol=tol, atol=tol)


def test_norm_axis_has_a_zero_gradient_at_a_zero_vector():
    x = torch.zeros(2, 4, 3, dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(_norm_axis(x, -2).sum(), x)
    assert torch.isfinite(g).all()
    torch.testing.assert_close(g, torch.zeros_like(g), rtol=0, atol=0)


def test_column_helpers_gradcheck():
    x = torch.randn(2, 4, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64,
                    requires_grad=True)
    assert torch.autograd.gradcheck(_l2norm_columns, (x,))
    assert torch.autograd.gradcheck(lambda t: _norm_axis(t, -2), (x,))


def _renorm_inputs():
    g = torch.Generator().manual_seed(2)
    x, like = (torch.randn(2, 4, 3, generator=g, dtype=torch.float64) for _ in range(2))
    like[1, :, 0] = 0.0   # a zero column: its norm reads the floor, its gradient 0
    return x.requires_grad_(), like.requires_grad_()


def test_renorm_columns_is_the_spec_expression():
    """_renorm_columns(x, like) = l2norm(x.T).T * norm(like, d) (the two helpers the expression
    compiled to before), eagerly and in torch.compile's form, with gradients (float64)."""
    x, like = _renorm_inputs()
    want = _l2norm_columns(x) * _norm_axis(like, -2).unsqueeze(-2)
    assert_same_function(_renorm_columns(x, like), want)
    wg = torch.autograd.grad(want.square().sum(), (x, like))
    for got, w in zip(torch.autograd.grad(_renorm_columns(x, like).square().sum(), (x, like)), wg):
        assert_same_function(got, w)
        assert torch.isfinite(got).all()
    assert torch.autograd.gradcheck(_renorm_columns, _renorm_inputs())


@pytest.mark.slow
def test_renorm_columns_compiled_form():
    x, like = _renorm_inputs()
    compiled = torch.compile(_renorm_columns, dynamic=False)
    assert_same_function(compiled(x, like), _l2norm_columns(x) * _norm_axis(like, -2).unsqueeze(-2))


def test_outer_sum_gradients_are_the_products_and_row_major():
    """_outer_sum(x, d) = x^T d with the gradients of the plain product, both formed row-major
    (the plain product's backward leaves the transposed operand's gradient transposed)."""
    g = torch.Generator().manual_seed(3)
    x, d = (torch.randn(2, 3, 7, n, generator=g, dtype=torch.float64) for n in (4, 5))
    x.requires_grad_(), d.requires_grad_()
    got = _outer_sum(x, d)
    want = x.transpose(-2, -1) @ d
    assert_same_function(got, want)
    up = torch.randn(want.shape, generator=g, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad((got * up).sum(), (x, d)), torch.autograd.grad((want * up).sum(), (x, d))):
        assert_same_function(a, b)
        assert a.is_contiguous()
    with torch.no_grad():
        assert_same_function(_outer_sum(x, d), want)
    assert torch.autograd.gradcheck(_outer_sum, (x, d))
    assert torch.autograd.gradgradcheck(_outer_sum, (x, d))


def _silu_expression(g, x):
    s = torch.sigmoid(x)
    return g * (s * (1 + x * (1 - s)))


def test_silu_backward_is_silus_derivative_with_two_orders_of_gradients():
    """_silu_backward(g, x) = g * silu'(x): the value autograd gives for silu's vector-Jacobian
    product, with the expression's first and second gradients (float64; aten's fused kernel has
    no derivative, the helper's backward supplies them)."""
    gen = torch.Generator().manual_seed(4)
    g, x = (torch.randn(2, 5, 6, generator=gen, dtype=torch.float64) * 3 for _ in range(2))
    g.requires_grad_(), x.requires_grad_()
    xs = x.detach().requires_grad_()
    (autograd_vjp,) = torch.autograd.grad(torch.nn.functional.silu(xs), xs, g.detach())
    with torch.no_grad():
        assert_same_function(_silu_backward(g, x), autograd_vjp)
    got = _silu_backward(g, x)
    assert_same_function(got, _silu_expression(g, x))
    up = torch.randn(got.shape, generator=gen, dtype=torch.float64)
    pairs = zip(torch.autograd.grad((got * up).sum(), (g, x)),
                torch.autograd.grad((_silu_expression(g, x) * up).sum(), (g, x)))
    for a, b in pairs:
        assert_same_function(a, b)
    small = (g[0, :2, :3].detach().requires_grad_(), x[0, :2, :3].detach().requires_grad_())
    assert torch.autograd.gradcheck(_silu_backward, small)
    assert torch.autograd.gradgradcheck(_silu_backward, small)


@pytest.mark.slow
def test_silu_backward_compiled_form():
    gen = torch.Generator().manual_seed(5)
    g, x = (torch.randn(3, 7, generator=gen, dtype=torch.float64) for _ in range(2))
    assert_same_function(torch.compile(_silu_backward, dynamic=False)(g, x), _silu_expression(g, x))


def _carried(x, like):
    """_renorm_kept from like's measured norms: (the result, its carried squared norms)."""
    return _renorm_kept(x, _column_norms2(like))


def test_renorm_kept_is_renorm_columns_and_carries_the_results_norms():
    """_renorm_kept(x, norms of like) = _renorm_columns(x, like), and the norms it returns are the
    result's, measured (a zero column of like included: the floor, a zero gradient), with the
    gradients of measuring them (float64)."""
    x, like = _renorm_inputs()
    got, norms = _carried(x, like)
    want = _renorm_columns(x, like)
    assert_same_function(got, want)
    assert_same_function(norms, _column_norms2(want))
    up = torch.randn(norms.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    measured = (want.square().sum() + (_column_norms2(want) * up).sum(), (x, like))
    carried = (got.square().sum() + (norms * up).sum(), (x, like))
    for a, b in zip(torch.autograd.grad(*carried), torch.autograd.grad(*measured)):
        assert_same_function(a, b)
        assert torch.isfinite(a).all()
    assert torch.autograd.gradcheck(_carried, _renorm_inputs())


@pytest.mark.slow
def test_renorm_kept_compiled_form():
    x, like = _renorm_inputs()
    got, norms = torch.compile(_carried, dynamic=False)(x, like)
    assert_same_function(got, _renorm_columns(x, like))
    assert_same_function(norms, _column_norms2(got))


def test_only_a_state_renormalised_to_its_own_norms_carries_them(tmp_path):
    """W0 and W1 are renormalised to their own column norms: the chunks carry those; W2 to W0's
    (a state it does not own), measured at every chunk.  The module is the reference's, from
    inside a chunk and over groups of whole chunks."""
    path = tmp_path / "lact_borrowed.yaml"
    path.write_text("extends: memspec:lact\nname: lact_borrowed\nupdate:\n"
                    "  - g0 = grad(loss, W0)\n  - g1 = grad(loss, W1)\n  - g2 = grad(loss, W2)\n"
                    "  - W0 = l2norm((W0 - eta0 * g0).T).T * norm(W0, d_k)\n"
                    "  - W1 = l2norm((W1 - eta1 * g1).T).T * norm(W1, hidden)\n"
                    "  - W2 = l2norm((W2 - eta2 * g2).T).T * norm(W0, d_k)\n", encoding="utf-8")
    spec = load(path)
    dims = small_dims(spec)
    m = make(spec, dims, chunk=4)
    source = generated_source(spec)
    assert "W0, norm2_W0 = _renorm_kept(W0 - acc_W0_0, norm2_W0)" in source
    assert "W1, norm2_W1 = _renorm_kept(W1 - acc_W1_0, norm2_W1)" in source
    assert "norm2_W2" not in source and "W2 = _renorm_columns(W2 - acc_W2_0, W0)" in source
    ins, st = inputs(spec, m, T=75), initial_state(spec, m)
    with torch.no_grad():
        o, state = _run(m, spec, ins, st, [(0, 5), (5, 75)])
        ro, rs = reference_run(spec, m, dims, "apply_update", st, ins)
    torch.testing.assert_close(o, ro, rtol=1e-10, atol=1e-12)
    for n in STATES:
        torch.testing.assert_close(state[n], rs[n], rtol=1e-10, atol=1e-12)
