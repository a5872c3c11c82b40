"""The closed-form backward of the per-key-channel additive kernel (``_AdditiveChannel``): its
gradients against the plain path's (autograd through the groups, which the kernel runs under
torch.func's transforms: ``torch.func.vjp``) and against the float64 token loop, over the kernel's
options (read order, chunk, groups, padded tails, value pieces, packed documents, bfloat16 inputs,
log decays of -40, 0 and -inf); float64 gradcheck and gradgradcheck (second derivatives: the plain
path, differentiated in the graph); a generated module carries the function.
"""
from __future__ import annotations

import pytest
import torch

from memspec.runtime.additive import chunk_additive, recurrent_additive
from memspec.runtime.varlen import _Documents

from close import TOLERANCE, assert_same_function


def assert_same_gradient(actual, expected, msg=None):
    """Gradients from the two paths at the dtype's tolerance (:data:`close.TOLERANCE`), the absolute
    one relative to the gradient's largest entry: an entry is a sum of many terms of that size (the
    log decays': over the pairs of a chunk and the tokens after it), so either path's rounding is a
    few ulps of it, not of the entry."""
    rtol, atol = TOLERANCE[expected.dtype]
    scale = max(1.0, expected.abs().max().item()) if expected.numel() else 1.0
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol * scale, msg=msg)


def make(B, T, H, K, V, dtype=torch.float32, seed=0, decays="uniform"):
    """q, k, v, per-channel log decays, S0; ``decays``: "uniform" in (-0.7, 0), "extreme" (-40, 0,
    -inf and mild ones mixed), "strong" (all -40)."""
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, T, H, K, generator=g), torch.randn(B, T, H, K, generator=g)
    v = torch.randn(B, T, H, V, generator=g)
    r = torch.rand(B, T, H, K, generator=g)
    lg = {"uniform": -0.7 * r,
          "extreme": torch.where(r < 0.3, -40.0, torch.where(r < 0.4, 0.0, torch.where(r < 0.5, float("-inf"), -r))),
          "strong": torch.full_like(r, -40.0)}[decays]
    S0 = torch.randn(B, H, K, V, generator=g)
    return [x.to(dtype) for x in (q, k, v, lg, S0)]


def cotangents(o, S, seed=1):
    """Random gradients of o and S_T, bfloat16 numbers in the outputs' dtypes (the same values at
    every precision)."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(x.shape, generator=g).to(torch.bfloat16).to(x.dtype) for x in (o, S))


def both(args, chunk, **kw):
    """(the closed form's gradients, the plain path's) of a random projection of (o, S_T) with
    respect to every input in ``args`` (q, k, v, log_gamma, S0; v may be a tuple of pieces)."""
    def f(*xs):
        return chunk_additive(*xs, chunk, **kw)
    ins = [tuple(x.clone().requires_grad_() for x in a) if isinstance(a, tuple) else a.clone().requires_grad_()
           for a in args]
    o, S = f(*ins)
    w = cotangents(o, S)
    flat = [x for a in ins for x in (a if isinstance(a, tuple) else (a,))]
    got = torch.autograd.grad((o, S), flat, w)
    (o_ref, S_ref), vjp = torch.func.vjp(f, *args)                  # (torch.func: the plain path)
    assert_same_function(o, o_ref)
    assert_same_function(S, S_ref)
    want = [x for a in vjp(w)
            for x in (a if isinstance(a, tuple) else (a,))]
    return got, want


def test_closed_form_is_used_under_autograd():
    """Under autograd the outputs' backward is the closed form's; without autograd, under torch.func
    or with state only, the plain path runs."""
    q, k, v, lg, S0 = make(1, 20, 2, 4, 3)
    o, S = chunk_additive(q, k.requires_grad_(), v, lg, S0, 8)
    assert type(o.grad_fn).__name__ == "_AdditiveChannelBackward"
    assert "_AdditiveChannel" not in type(chunk_additive(None, k, v, lg, S0, 8)[1].grad_fn).__name__


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("inclusive", [True, False])
@pytest.mark.parametrize("T, chunk, group", [(1, 4, None), (7, 4, None), (64, 16, 1), (100, 16, 3), (130, 64, None),
                                             (37, 1, 2), (50, 2, None)])
def test_gradients_equal_the_plain_path(dtype, inclusive, T, chunk, group):
    """Full chunks, a padded tail, one token, chunks of 1 and 2 (levels 0 and 1 only), groups of 1 and
    3 chunks (a partial group): every input's gradient equals the plain path's at the dtype's
    tolerance."""
    args = make(2, T, 3, 5, 4, dtype=dtype, seed=T + chunk)
    got, want = both(args, chunk, inclusive=inclusive, group=group)
    for name, g, w in zip("q k v log_gamma S0".split(), got, want):
        assert g.dtype == dtype, name
        assert_same_gradient(g, w, msg=name)


@pytest.mark.parametrize("inclusive", [True, False])
@pytest.mark.parametrize("decays", ["extreme", "strong"])
def test_extreme_decays(inclusive, decays):
    """Log decays of -40, 0 and -inf (and all -40 over chunks of 64: -2560 a chunk): finite gradients,
    equal to the plain path's and to the float64 token loop's, entry by entry where the plain path is
    (the log decays' gradients are sums over the pairs that span a token, never differences: a gradient
    of 1e-18 is not lost in the rounding of larger ones); a decay of 0 has gradient 0."""
    args = make(2, 130, 2, 8, 6, seed=6, decays=decays)
    got, want = both(args, 64, inclusive=inclusive)
    ins64 = [x.double().requires_grad_() for x in args]
    o, S = recurrent_additive(*ins64, inclusive)
    ref = torch.autograd.grad((o, S), ins64, [w.double() for w in cotangents(o.float(), S.float())])
    for name, g, w, r in zip("q k v log_gamma S0".split(), got, want, ref):
        assert torch.isfinite(g).all(), name
        assert_same_gradient(g, w, msg=name)
        torch.testing.assert_close(g.double(), r, rtol=1e-4, atol=1e-5, msg=name)
    lg = args[3]
    assert (got[3][lg == float("-inf")] == 0).all()
    if decays == "strong":   # every log-decay gradient is tiny: relative accuracy, not only absolute
        small = want[3].abs() > 1e-30
        assert ((got[3] - want[3]).abs()[small] <= 1e-4 * want[3].abs()[small]).all()


@pytest.mark.parametrize("inclusive", [True, False])
def test_value_pieces_and_missing_gradients(inclusive):
    """Values as a tuple of pieces get one gradient each; inputs that do not require gradients get none
    and the others are unchanged; no S0."""
    q, k, v, lg, _ = make(1, 45, 2, 4, 5, seed=20)
    ones = torch.ones(1, 45, 2, 1)
    got, want = both((q, k, (v, ones), lg, torch.zeros(1, 2, 4, 6)), 8, inclusive=inclusive)
    assert got[2].shape == v.shape and got[3].shape == ones.shape
    for g, w in zip(got, want):
        assert_same_gradient(g, w)
    lg_ = lg.clone().requires_grad_()
    o, S = chunk_additive(q, k, (v, ones), lg_, None, 8, inclusive=inclusive)
    g_lg, = torch.autograd.grad((o, S), [lg_], cotangents(o, S))
    assert_same_gradient(g_lg, got[4])


@pytest.mark.parametrize("inclusive", [True, False])
def test_packed_documents(inclusive):
    """Packed documents (a single-token one, an empty one, one ending inside a chunk) with extreme
    decays: gradients equal the plain path's, and the float64 token loop's run on each document from
    its own initial state (an empty document passes its final state's gradient to its initial state)."""
    offsets = [0, 37, 38, 38, 101, 160]
    q, k, v, lg, _ = make(1, offsets[-1], 2, 6, 5, seed=40, decays="extreme")
    S0 = torch.randn(len(offsets) - 1, 2, 6, 5, generator=torch.Generator().manual_seed(42))
    docs = _Documents(torch.tensor(offsets))
    got, want = both((q, k, v, lg, S0), 16, inclusive=inclusive, documents=docs)
    for g, w in zip(got, want):
        assert torch.isfinite(g).all()
        assert_same_gradient(g, w)
    ins64 = [x.double().requires_grad_() for x in (q, k, v, lg, S0)]
    outs, states = [], []
    for i, (a, b) in enumerate(zip(offsets[:-1], offsets[1:])):
        o_i, S_i = recurrent_additive(*(x[:, a:b] for x in ins64[:4]), ins64[4][i:i + 1], inclusive)
        outs.append(o_i)
        states.append(S_i)
    o, S = torch.cat(outs, 1), torch.cat(states)
    ref = torch.autograd.grad((o, S), ins64, [w.double() for w in cotangents(o.float(), S.float())])
    for g, r in zip(got, ref):
        torch.testing.assert_close(g.double(), r, rtol=1e-4, atol=1e-5)
    assert_same_function(got[4][2], cotangents(o.float(), S.float())[1][2])   # the empty document


def test_bfloat16_inputs():
    """bfloat16 inputs: float32 arithmetic inside, and each gradient rounded to bfloat16 once: equal to
    the float32 gradients of the same values at bfloat16's tolerance.  (The plain path sums each
    input's gradient from its several uses in bfloat16, rounding each piece: it differs from both by
    more, so it is not the reference here.)"""
    args = make(1, 70, 2, 8, 8, dtype=torch.bfloat16, seed=50)
    got, _ = both(args, 16)
    want, _ = both([x.float() for x in args], 16)
    for g, w in zip(got, want):
        assert g.dtype == torch.bfloat16
        assert_same_gradient(g, w.to(torch.bfloat16))


@pytest.mark.parametrize("inclusive", [True, False])
@pytest.mark.parametrize("packed", [False, True])
def test_gradcheck_and_gradgradcheck_float64(inclusive, packed):
    """float64 gradcheck of the closed form; gradgradcheck: a differentiable backward runs the plain
    path in the graph, so second derivatives are the plain path's."""
    B, offsets = (1, [0, 5, 11]) if packed else (2, None)
    q, k, v, lg, S0 = make(B, 11, 2, 3, 2, dtype=torch.float64, seed=60, decays="extreme")
    lg = lg.clamp_min(-3.0)   # (finite differences of exp at -40 are below float64's resolution)
    if packed:
        S0 = torch.randn(2, 2, 3, 2, dtype=torch.float64)
    docs = _Documents(torch.tensor(offsets)) if packed else None
    args = [x.requires_grad_() for x in (q, k, v, lg, S0)]

    def f(*xs):
        return chunk_additive(*xs, 4, inclusive=inclusive, documents=docs)
    assert torch.autograd.gradcheck(f, args, eps=1e-6, atol=1e-7)
    assert torch.autograd.gradgradcheck(f, args, eps=1e-6, atol=1e-6)


def test_generated_module_carries_the_closed_form():
    """gla's generated module carries the autograd function and its backward's functions, and its
    layer's gradients flow through it."""
    from memspec.pipeline.build import build, source

    text = source("specs/gla.yaml")
    assert "class _AdditiveChannel(torch.autograd.Function):" in text
    assert "def _channel_backward(" in text and "def _channel_levels(" in text
    layer = build("specs/gla.yaml", compile=False, d_model=32, heads=2, d_k=8, d_v=8, chunk=8)
    x = torch.randn(1, 40, 32, requires_grad=True)
    y = layer(x)
    y = y[0] if isinstance(y, tuple) else y
    y.square().sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
