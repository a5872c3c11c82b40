"""The reference interpreter: the seed text's worked examples, schedules, gradients, caches.

Worked examples are from ``../shared/seeds/002_*.txt`` (§2.4, §3.2-3.4, §4.5, §4.7,
§5.2); each test quotes the numbers of the text and recomputes them with
``memspec.reference.run``.
"""
from __future__ import annotations

import math
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import memspec
from memspec import reference as R

from close import assert_same_function

D64 = torch.float64


def spec_of(text: str) -> memspec.Spec:
    return memspec.loads(textwrap.dedent(text), "yaml")


def seq(rows, H: int = 1, dtype=D64) -> torch.Tensor:
    """Token rows ``[T, D]`` -> a view ``[1, T, H, D]`` (same values in every head)."""
    x = torch.tensor(rows, dtype=dtype)
    return x[None, :, None, :].expand(1, x.shape[0], H, x.shape[1]).clone()


def gate(values, H: int = 1, dtype=D64) -> torch.Tensor:
    """Token values ``[T]`` -> a gate ``[1, T, H]``."""
    x = torch.tensor(values, dtype=dtype)
    return x[None, :, None].expand(1, x.shape[0], H).clone()


def mat(rows, dtype=D64) -> torch.Tensor:
    """A matrix as a one-sequence, one-head state ``[1, 1, m, n]``."""
    return torch.tensor(rows, dtype=dtype)[None, None]


# ---------------------------------------------------------------- specs
LINEAR_ATTENTION = """\
name: linear_attention_identity
dims: {d_k: 2, d_v: 2}
views: {q: d_k, k: d_k, v: d_v}
state:
  S: {shape: [d_k, d_v], init: zeros}
  c: {shape: [d_k], init: zeros}
update:
  - S = S + outer(k, v)
  - c = c + k
read: (q @ S) / (q @ c)
"""

DELTA = """\
name: delta
dims: {d_k: 2, d_v: 2}
views: {q: d_k, k: d_k, v: d_v}
gates: {eta: sigmoid(logit)}
state:
  W: {shape: [d_k, d_v], init: zeros}
model: f(u) = u @ W
loss: 0.5 * sum((f(k) - v)^2)
update:
  - W = W - eta * grad(loss, W)
read: f(q)
"""

SCALAR_MEMORY = """\
name: scalar
dims: {d: 1}
views: {q: d, k: d, v: d}
constants: {eta: 0.5}
state:
  w: {shape: [d, d], init: zeros}
model: f(u) = u @ w
loss: 0.5 * sum((f(k) - v)^2)
update:
  - w = w - eta * grad(loss, w)
read: f(q)
"""

TITANS_SCALAR = """\
name: titans_scalar
dims: {d: 1}
views: {q: d, k: d, v: d}
gates: {eta: sigmoid(logit), mu: sigmoid(logit), alpha: sigmoid(logit)}
state:
  W: {shape: [d, d], init: zeros}
  U: {shape: [d, d], init: zeros}
model: f(u) = u @ W
loss: 0.5 * sum((f(k) - v)^2)
update:
  - U = mu * U - eta * grad(loss, W)
  - W = (1 - alpha) * W + U
read: f(q)
"""

TITANS_MLP = """\
name: titans_mlp
dims: {d_k: 3, hidden: 4, d_v: 3}
views: {q: d_k, k: d_k, v: d_v}
gates: {eta: sigmoid(logit), mu: sigmoid(logit), alpha: sigmoid(logit)}
state:
  W1: {shape: [d_k, hidden], init: learned(normal(0.5))}
  b1: {shape: [hidden], init: zeros}
  W2: {shape: [hidden, d_v], init: zeros}
  U1: {shape: [d_k, hidden], init: zeros}
  Ub: {shape: [hidden], init: zeros}
  U2: {shape: [hidden, d_v], init: zeros}
model: f(u) = gelu(u @ W1 + b1) @ W2
loss: 0.5 * sum((f(k) - v)^2)
update:
  - U1 = mu * U1 - eta * grad(loss, W1)
  - Ub = mu * Ub - eta * grad(loss, b1)
  - U2 = mu * U2 - eta * grad(loss, W2)
  - W1 = (1 - alpha) * W1 + U1
  - b1 = (1 - alpha) * b1 + Ub
  - W2 = (1 - alpha) * W2 + U2
read: f(q)
"""


def mlp_inputs(B=2, T=6, H=2, seed=0, dtype=D64):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    return dict(
        q=r(B, T, H, 3), k=r(B, T, H, 3), v=r(B, T, H, 3),
        eta=torch.sigmoid(r(B, T, H)) * 0.5, mu=torch.sigmoid(r(B, T, H)),
        alpha=torch.sigmoid(r(B, T, H)) * 0.2,
    ), {"W1": r(H, 3, 4) * 0.5}


# ======================================================= §2.4 linear attention
def test_linear_attention_read_of_the_seed():
    spec = spec_of(LINEAR_ATTENTION)
    # k1 = (1,1), k2 = (1,2); v1 = (2,0), v2 = (0,3); q = (1,1)
    out, st = R.run(spec, q=seq([[1, 1], [1, 1]]), k=seq([[1, 1], [1, 2]]), v=seq([[2, 0], [0, 3]]))
    assert st["S"][0, 0].tolist() == [[2.0, 3.0], [2.0, 6.0]]   # S_2
    assert st["c"][0, 0].tolist() == [2.0, 3.0]                 # c_2
    z = out[0, 1, 0]
    assert torch.allclose(z, torch.tensor([0.8, 1.8], dtype=D64), atol=1e-15, rtol=0)
    # and the direct normalised average 2(2,0)+3(0,3) over 2+3
    assert torch.allclose(z, (2 * torch.tensor([2.0, 0]) + 3 * torch.tensor([0.0, 3])).double() / 5)
    # first token: only (k1, v1) is stored, so the read is v1
    assert out[0, 0, 0].tolist() == [2.0, 0.0]


# ============================================================ §3.2-3.3 delta rule
def test_delta_correction_gives_the_seed_matrix():
    spec = spec_of(DELTA)
    # writes (1,0)->(1,0), (0,1)->(0,1), then (1,0) must now return (0,1); eta = 1
    k = seq([[1, 0], [0, 1], [1, 0]])
    v = seq([[1, 0], [0, 1], [0, 1]])
    out, st = R.run(spec, q=k, k=k, v=v, eta=gate([1, 1, 1]))
    assert st["W"][0, 0].tolist() == [[0.0, 1.0], [0.0, 1.0]]
    assert out[0, 2, 0].tolist() == [0.0, 1.0]  # the corrected key now reads (0, 1)
    # the gradient of that third write is k^T e = [[1,-1],[0,0]] (W_new = W_old - g)
    _, st2 = R.run(spec, q=k[:, :2], k=k[:, :2], v=v[:, :2], eta=gate([1, 1]))
    assert st2["W"][0, 0].tolist() == [[1.0, 0.0], [0.0, 1.0]]
    g = st2["W"] - st["W"]
    assert g[0, 0].tolist() == [[1.0, -1.0], [0.0, 0.0]]
    # and the other key (0,1) still reads (0,1)
    probe = torch.tensor([0.0, 1.0], dtype=D64)[None, None]
    assert R.apply_model(spec, st, probe)[0, 0].tolist() == [0.0, 1.0]


@pytest.mark.parametrize("eta,kvec", [(1.0, (1.0, 0.0)), (0.3, (0.6, 0.8)), (0.5, (1.0, 2.0)),
                                      (1.5, (0.2, -0.7)), (0.05, (3.0, 1.0))])
def test_error_shrink_factor(eta, kvec):
    """§3.3: e_new = (1 - eta ||k||^2) e_old for the linear half-square loss."""
    spec = spec_of(DELTA)
    g = torch.Generator().manual_seed(1)
    W0 = torch.randn(1, 1, 2, 2, generator=g, dtype=D64)
    k = torch.tensor(kvec, dtype=D64)
    v = torch.randn(2, generator=g, dtype=D64)
    _, st = R.run(spec, state={"W": W0}, q=seq([kvec]), k=seq([kvec]), v=v[None, None, None],
                  eta=gate([eta]))
    e_old = k @ W0[0, 0] - v
    e_new = k @ st["W"][0, 0] - v
    factor = 1 - eta * float(k @ k)
    assert torch.allclose(e_new, factor * e_old, atol=1e-12, rtol=0)


# ================================================================ §3.4 interference
@pytest.mark.parametrize("eta", [1.0, 0.5])
def test_overlap_interference_of_key_08_06(eta):
    spec = spec_of(DELTA)
    W3 = mat([[0.0, 1.0], [0.0, 1.0]])   # the memory after the delta correction
    k4, v4 = (0.8, 0.6), (1.0, 0.0)
    _, st = R.run(spec, state={"W": W3}, q=seq([k4]), k=seq([k4]), v=seq([v4]), eta=gate([eta]))
    # by hand: v_hat = k4 W3 = (0, 0.8 + 0.6) = (0, 1.4); correction v - v_hat = (1, -1.4)
    correction = (1.0 - 0.0, 0.0 - 1.4)
    for probe, overlap in (((1.0, 0.0), 0.8), ((0.0, 1.0), 0.6)):
        p = torch.tensor(probe, dtype=D64)[None, None]
        dz = R.apply_model(spec, st, p) - R.apply_model(spec, {"W": W3}, p)
        expected = torch.tensor([eta * overlap * c for c in correction], dtype=D64)
        assert torch.allclose(dz[0, 0], expected, atol=1e-12, rtol=0)
        assert overlap != 0 and dz.abs().sum() > 0  # neither probe is protected


# ============================================================ §4.7 two-token schedules
def test_two_token_schedules_online_and_minibatch():
    spec = spec_of(SCALAR_MEMORY)
    ones = seq([[1.0], [1.0]])
    v = seq([[1.0], [3.0]])
    out, st = R.run(spec, q=ones, k=ones, v=v)
    assert out[0, :, 0, 0].tolist() == [0.5, 1.75]     # g1 = -1, w1 = 0.5; g2 = -2.5, w2 = 1.75
    assert st["w"].item() == 1.75
    out, st = R.run(spec, q=ones, k=ones, v=v, schedule=("minibatch", 2))
    assert st["w"].item() == 2.0                        # both gradients at w0: -1, -3
    assert out[0, :, 0, 0].tolist() == [0.5, 2.0]       # the first read uses only its prefix
    out1, st1 = R.run(spec, q=ones, k=ones, v=v, schedule="minibatch(2)")
    assert torch.equal(out1, out)


def test_minibatch_with_a_shorter_last_chunk_matches_a_hand_loop():
    spec = spec_of(DELTA)
    g = torch.Generator().manual_seed(3)
    T, C = 5, 2
    q, k, v = (torch.randn(1, T, 1, 2, generator=g, dtype=D64) for _ in range(3))
    eta = torch.rand(1, T, 1, generator=g, dtype=D64)
    out, st = R.run(spec, q=q, k=k, v=v, eta=eta, schedule=("minibatch", C))
    W = torch.zeros(2, 2, dtype=D64)
    reads = []
    for t in range(T):
        if t % C == 0:
            W0 = W.clone()
        kt, vt = k[0, t, 0], v[0, t, 0]
        W = W - eta[0, t, 0] * torch.outer(kt, kt @ W0 - vt)
        reads.append(q[0, t, 0] @ W)
    assert torch.allclose(out[0, :, 0], torch.stack(reads), atol=1e-12, rtol=0)
    assert torch.allclose(st["W"][0, 0], W, atol=1e-12, rtol=0)
    online, _ = R.run(spec, q=q, k=k, v=v, eta=eta)
    assert not torch.allclose(online, out)  # a different schedule, not the same numbers


# ================================================================ §5.2 Titans step
def test_titans_scalar_step():
    spec = spec_of(TITANS_SCALAR)
    # W = 2, U = 0.2; with k = 1 the gradient of 0.5 (kW - v)^2 is W - v = -0.4 for v = 2.4
    out, st = R.run(spec, state={"W": mat([[2.0]]), "U": mat([[0.2]])},
                    q=seq([[1.0]]), k=seq([[1.0]]), v=seq([[2.4]]),
                    mu=gate([0.5]), eta=gate([0.1]), alpha=gate([0.1]))
    assert st["U"].item() == pytest.approx(0.14, abs=1e-14)   # 0.5(0.2) - 0.1(-0.4)
    assert st["W"].item() == pytest.approx(1.94, abs=1e-14)   # 0.9(2) + 0.14
    assert out.item() == pytest.approx(1.94, abs=1e-14)


# ============================================================= §4.5 beta gradient
def test_beta_gradient_through_the_write():
    spec = spec_of(SCALAR_MEMORY)   # eta = 1/2, w0 = 0
    beta = torch.tensor([[[[0.7]]]], dtype=D64, requires_grad=True)
    ones = seq([[1.0]])
    out, _ = R.run(spec, q=ones, k=ones, v=beta)
    z = out[0, 0, 0, 0]
    assert z.item() == pytest.approx(0.35, abs=1e-15)          # z = beta / 2
    (dz,) = torch.autograd.grad(z, beta)
    assert dz.item() == 0.5                                    # dz/dbeta = 1/2
    out2, _ = R.run(spec, q=ones, k=ones, v=beta.detach() + 0.1)
    assert (out2 - out).item() == pytest.approx(0.05, abs=1e-12)


def test_grad_works_under_no_grad():
    spec = spec_of(TITANS_MLP)
    inputs, params = mlp_inputs()
    ref, ref_state = R.run(spec, params=params, **inputs)
    with torch.no_grad():
        out, st = R.run(spec, params=params, **inputs)
    assert not out.requires_grad
    assert torch.allclose(out, ref.detach(), atol=1e-12, rtol=0)
    assert torch.allclose(st["W2"], ref_state["W2"], atol=1e-12, rtol=0)


# ============================================================== schedules
def test_minibatch_of_one_equals_online_exactly():
    spec = spec_of(TITANS_MLP)
    inputs, params = mlp_inputs(T=7)
    online, s_on = R.run(spec, params=params, **inputs)
    mb1, s_mb = R.run(spec, params=params, schedule=("minibatch", 1), **inputs)
    assert_same_function(mb1, online)
    for name in s_on:
        assert_same_function(s_mb[name], s_on[name])
    mb3, _ = R.run(spec, params=params, schedule=("minibatch", 3), **inputs)
    assert_same_function(mb3[:, :1], online[:, :1])    # the first token of a chunk is online
    assert not torch.allclose(mb3, online)


GATED_TWO_STATES = """\
name: gated_two
dims: {d_k: 2, d_v: 2}
views: {q: d_k, k: d_k, v: d_v}
gates: {eta: sigmoid(logit), alpha: sigmoid(logit)}
state:
  W: {shape: [d_k, d_v], init: zeros}
  b: {shape: [d_v], init: zeros}
model: f(u) = u @ W + b
loss: 0.5 * sum((f(k) - v)^2)
update:
  - W = (1 - alpha) * W
  - W = W - eta * grad(loss, W)
  - b = b - eta * grad(loss, b)
read: f(q)
"""


def test_minibatch_gradient_sees_the_tokens_own_earlier_statements():
    """Mini-batch: grad at the chunk-start state carried through this token's earlier
    statements (here the decay, and W's own step before b's gradient); so C = 1 is
    online learning exactly even when statements precede the gradient."""
    spec = spec_of(GATED_TWO_STATES)
    g = torch.Generator().manual_seed(11)
    T, C = 5, 2
    q, k, v = (torch.randn(1, T, 1, 2, generator=g, dtype=D64) for _ in range(3))
    eta, alpha = (torch.rand(1, T, 1, generator=g, dtype=D64) * 0.5 for _ in range(2))
    inputs = dict(q=q, k=k, v=v, eta=eta, alpha=alpha)

    def by_hand(chunk):
        W, b = torch.zeros(2, 2, dtype=D64), torch.zeros(2, dtype=D64)
        reads = []
        for t in range(T):
            if t % chunk == 0:
                W0, b0 = W.clone(), b.clone()
            kt, vt, et, at = k[0, t, 0], v[0, t, 0], eta[0, t, 0], alpha[0, t, 0]
            Ws = (1 - at) * W0                               # shadow: decay of this token
            gW = torch.outer(kt, kt @ Ws + b0 - vt)
            W = (1 - at) * W - et * gW
            Ws = Ws - et * gW                                # shadow: W's own step
            gb = kt @ Ws + b0 - vt
            b = b - et * gb
            reads.append(q[0, t, 0] @ W + b)
        return torch.stack(reads), W, b

    for chunk in (1, C):
        out, st = R.run(spec, schedule=("minibatch", chunk), **inputs)
        reads, W, b = by_hand(chunk)
        assert torch.allclose(out[0, :, 0], reads, atol=1e-12, rtol=0)
        assert torch.allclose(st["W"][0, 0], W, atol=1e-12, rtol=0)
        assert torch.allclose(st["b"][0, 0], b, atol=1e-12, rtol=0)
    online, s_on = R.run(spec, **inputs)
    mb1, s_mb = R.run(spec, schedule=("minibatch", 1), **inputs)
    assert_same_function(mb1, online)
    assert_same_function(s_mb["b"], s_on["b"])


SHIPPED = sorted((Path(__file__).resolve().parent.parent / "specs").glob("*.yaml"))


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_every_shipped_spec_runs_causally_and_minibatch_one_is_online(path):
    spec = memspec.load(path)
    small = {d: (2 if d == "heads" else 3) for d in spec.dims}
    spec = spec.with_dims(**small)
    B, T, H = 2, 5, small.get("heads", 2)
    g = torch.Generator().manual_seed(12)
    inputs = {n: torch.randn(B, T, H, spec.dims[v.dim], generator=g, dtype=D64) for n, v in spec.views.items()}
    inputs.update({n: torch.rand(B, T, H, *(spec.dims[d] for d in gt.shape), generator=g, dtype=D64) * 0.5
                   for n, gt in spec.gates.items()})
    params = {n: torch.randn(H, *(spec.dims[d] for d in p.shape), generator=g, dtype=D64) * 0.1
              for n, p in spec.params.items() if "normal" in str(p.init)}
    for n, p in spec.params.items():   # a random uniform init: a draw from its own range
        if "uniform" in str(p.init):
            lo, hi = (float(x) for x in str(p.init).split("(")[1].rstrip(")").split(","))
            params[n] = lo + (hi - lo) * torch.rand(H, *(spec.dims[d] for d in p.shape), generator=g, dtype=D64)
    state = R.init_state(spec, B, H, dtype=D64, params=params, generator=g)
    out, _ = R.run(spec, state=state, params=params, **inputs)
    assert out.shape[:3] == (B, T, H) and torch.isfinite(out).all()
    mb1, _ = R.run(spec, state=state, params=params, schedule=("minibatch", 1), **inputs)
    assert_same_function(mb1, out)
    for schedule in ("online", ("minibatch", 2)):
        ref, _ = R.run(spec, state=state, params=params, schedule=schedule, **inputs)
        bumped = {n: torch.cat([x[:, :3], x[:, 3:] * 0.5 + 0.2], dim=1) for n, x in inputs.items()}
        out2, _ = R.run(spec, state=state, params=params, schedule=schedule, **bumped)
        assert torch.equal(out2[:, :3], ref[:, :3])


@pytest.mark.parametrize("schedule", ["online", ("minibatch", 3)])
def test_causality(schedule):
    spec = spec_of(TITANS_MLP)
    inputs, params = mlp_inputs(T=7, seed=5)
    out, _ = R.run(spec, params=params, schedule=schedule, **inputs)
    for t in (1, 4, 6):
        bumped = {n: x.clone() for n, x in inputs.items()}
        for n in bumped:
            bumped[n][:, t:] = bumped[n][:, t:] * 0.5 + 0.3
        out2, _ = R.run(spec, params=params, schedule=schedule, **bumped)
        assert torch.equal(out2[:, :t], out[:, :t])
        assert not torch.allclose(out2[:, t:], out[:, t:])


# ============================================================== gradients
def test_gradients_flow_to_views_gates_and_learned_init():
    spec = spec_of(TITANS_MLP)
    inputs, params = mlp_inputs(B=1, T=4, H=1)
    leaves = {n: x.clone().requires_grad_(True) for n, x in {**inputs, **params}.items()}
    views = {n: leaves[n] for n in inputs}
    out, _ = R.run(spec, params={"W1": leaves["W1"]}, **views)
    grads = torch.autograd.grad(out.square().sum(), list(leaves.values()))
    for name, g in zip(leaves, grads):
        assert g is not None and g.abs().sum() > 0, name


@pytest.mark.parametrize("schedule", ["online", ("minibatch", 2)])
def test_gradcheck_against_finite_differences(schedule):
    spec = spec_of(TITANS_MLP).with_dims(d_k=2, hidden=2, d_v=2)
    g = torch.Generator().manual_seed(7)
    r = lambda *s: torch.randn(*s, generator=g, dtype=D64)  # noqa: E731
    T = 3
    args = (r(1, T, 1, 2), r(1, T, 1, 2), r(1, T, 1, 2),
            torch.sigmoid(r(1, T, 1)) * 0.5, torch.sigmoid(r(1, T, 1)), torch.sigmoid(r(1, T, 1)) * 0.3,
            r(1, 2, 2) * 0.5)
    args = tuple(a.requires_grad_(True) for a in args)

    def f(q, k, v, eta, mu, alpha, W1):
        out, st = R.run(spec, params={"W1": W1}, schedule=schedule,
                        q=q, k=k, v=v, eta=eta, mu=mu, alpha=alpha)
        return out, st["W2"]

    assert torch.autograd.gradcheck(f, args, eps=1e-6, atol=1e-6)


def test_learned_initial_state_is_broadcast_over_batch():
    spec = spec_of(TITANS_MLP)
    W1 = torch.randn(2, 3, 4, dtype=D64)
    st = R.init_state(spec, 3, 2, params={"W1": W1}, dtype=D64)
    assert st["W1"].shape == (3, 2, 3, 4)
    assert torch.equal(st["W1"][2], W1)
    assert st["U2"].shape == (3, 2, 4, 3) and st["U2"].abs().sum() == 0


# ============================================================ order
def test_read_write_versus_write_read():
    text = """\
    name: additive
    dims: {d_k: 3, d_v: 2}
    views: {q: d_k, k: d_k, v: d_v}
    state:
      W: {shape: [d_k, d_v], init: zeros}
    update:
      - W = W + outer(k, v)
    read: q @ W
    """
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(2, 5, 2, 3, generator=g, dtype=D64), torch.randn(2, 5, 2, 3, generator=g, dtype=D64)
    v = torch.randn(2, 5, 2, 2, generator=g, dtype=D64)
    kv = torch.einsum("bthk,bthv->bthkv", k, v).cumsum(1)          # W_t after the write of t
    after = torch.einsum("bthk,bthkv->bthv", q, kv)
    before = torch.einsum("bthk,bthkv->bthv", q, kv - torch.einsum("bthk,bthv->bthkv", k, v))
    wr, _ = R.run(spec_of(text), q=q, k=k, v=v)
    rw, _ = R.run(spec_of(textwrap.dedent(text) + "order: read_write\n"), q=q, k=k, v=v)
    assert torch.allclose(wr, after, atol=1e-12, rtol=0)
    assert torch.allclose(rw, before, atol=1e-12, rtol=0)
    assert rw[:, 0].abs().sum() == 0


def test_update_statements_see_current_values():
    """Gated DeltaNet order: the gradient is taken at the decayed memory."""
    text = DELTA.replace("  - W = W - eta * grad(loss, W)\n",
                         "  - W = 0.5 * W\n  - W = W - eta * grad(loss, W)\n")
    W0 = mat([[1.0, 2.0], [3.0, 4.0]])
    k, v = torch.tensor([1.0, 1.0], dtype=D64), torch.tensor([0.5, -1.0], dtype=D64)
    _, st = R.run(spec_of(text), state={"W": W0}, q=seq([[1, 1]]), k=seq([[1, 1]]),
                  v=seq([[0.5, -1.0]]), eta=gate([0.25]))
    Wd = 0.5 * W0[0, 0]
    expected = Wd - 0.25 * torch.outer(k, k @ Wd - v)
    assert torch.allclose(st["W"][0, 0], expected, atol=1e-14, rtol=0)


# ============================================================== caches
@pytest.mark.parametrize("window", [None, 3])
def test_cache_attend_equals_causal_softmax_attention(window):
    text = """\
    name: softmax_attention
    dims: {d_k: 4, d_v: 3}
    views: {q: d_k, k: d_k, v: d_v}
    state:
      K: {shape: [d_k], cache: true}
      V: {shape: [d_v], cache: true}
    update:
      - K = append(K, k)
      - V = append(V, v)
    read: attend(q, K, V, 1 / sqrt(d_k))
    """
    if window is not None:
        text = text.replace("cache: true}", f"cache: true, window: {window}}}")
    B, T, H = 2, 7, 2
    g = torch.Generator().manual_seed(4)
    q, k = torch.randn(B, T, H, 4, generator=g, dtype=D64), torch.randn(B, T, H, 4, generator=g, dtype=D64)
    v = torch.randn(B, T, H, 3, generator=g, dtype=D64)
    out, st = R.run(spec_of(text), q=q, k=k, v=v)
    i = torch.arange(T)
    mask = i[:, None] >= i[None, :]
    if window is not None:
        mask &= i[:, None] - i[None, :] < window
    ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask).transpose(1, 2)
    assert torch.allclose(out, ref, atol=1e-12, rtol=0)
    n = T if window is None else window
    assert st["K"].shape == (B, H, n, 4)
    assert torch.equal(st["K"], k[:, T - n:].transpose(1, 2))


# ============================================================ functions
FUNCTION_CASES = {
    "gelu(x)": lambda x: 0.5 * x * (1 + torch.erf(x / math.sqrt(2))),
    "elu(x)": lambda x: torch.where(x > 0, x, torch.exp(x) - 1),
    "softplus(x)": lambda x: torch.log1p(torch.exp(x)),
    "silu(x)": lambda x: x * torch.sigmoid(x),
    "relu(x) + sign(x) + abs(x) + tanh(x)": lambda x: x.clamp(min=0) + x.sign() + x.abs() + x.tanh(),
    "exp(x) + log(abs(x)) + sqrt(abs(x)) + sigmoid(x)":
        lambda x: x.exp() + x.abs().log() + x.abs().sqrt() + 1 / (1 + torch.exp(-x)),
    "layernorm(x)": lambda x: (x - x.mean(-1, keepdim=True))
        / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + 1e-5),
    "layernorm(x, y, 2 * y)": lambda x, y: (x - x.mean(-1, keepdim=True))
        / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + 1e-5) * y + 2 * y,
    "rmsnorm(x, y)": lambda x, y: x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * y,
    "l2norm(x)": lambda x: x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6),
    "huber(x, 0.5)": lambda x: torch.where(x.abs() <= 0.5, x * x / 2, 0.5 * (x.abs() - 0.25)),
    "clamp(x, -0.3, y)": lambda x, y: torch.minimum(torch.maximum(x, torch.tensor(-0.3, dtype=D64)), y),
    "min(x, y) - max(x, y)": lambda x, y: torch.minimum(x, y) - torch.maximum(x, y),
    "x^2 / 2 - -y": lambda x, y: x ** 2 / 2 + y,
    "x * (sum(y) + mean(x) - norm(x)) + g": lambda x, y, g: x * (y.sum(-1, keepdim=True)
        + x.mean(-1, keepdim=True) - x.norm(dim=-1, keepdim=True)) + g[..., None],
    "outer(x, y) @ eye(d) @ y": lambda x, y: torch.einsum("...i,...j,...j->...i", x, y, y),
    "solve(outer(x, x) + eye(d), y)": lambda x, y: torch.linalg.solve(
        torch.einsum("...i,...j->...ij", x, x) + torch.eye(3, dtype=D64), y.unsqueeze(-1)).squeeze(-1),
    "(outer(x, y).T @ x) + x @ outer(y, x)": lambda x, y: torch.einsum("...i,...j,...i->...j", x, y, x)
        + torch.einsum("...i,...i,...j->...j", x, y, x),
}


@pytest.mark.parametrize("expr", list(FUNCTION_CASES))
def test_functions_follow_their_documented_definitions(expr):
    spec = spec_of(f"""\
    name: fn
    dims: {{d: 3}}
    views: {{x: d, y: d}}
    gates: {{g: sigmoid(logit)}}
    read: {expr}
    """)
    gen = torch.Generator().manual_seed(8)
    x, y = torch.randn(2, 4, 2, 3, generator=gen, dtype=D64), torch.randn(2, 4, 2, 3, generator=gen, dtype=D64)
    gv = torch.rand(2, 4, 2, generator=gen, dtype=D64)
    out, _ = R.run(spec, x=x, y=y, g=gv)
    fn = FUNCTION_CASES[expr]
    nargs = fn.__code__.co_argcount
    expected = fn(*(x, y, gv)[:nargs])
    assert out.shape == expected.shape
    assert torch.allclose(out, expected, atol=1e-12, rtol=1e-12)


def test_grad_of_loss_without_w_uses_the_only_model_state():
    a = spec_of(DELTA)
    b = spec_of(DELTA.replace("grad(loss, W)", "grad(loss)"))
    g = torch.Generator().manual_seed(9)
    inp = dict(q=torch.randn(1, 3, 1, 2, generator=g, dtype=D64), k=torch.randn(1, 3, 1, 2, generator=g, dtype=D64),
               v=torch.randn(1, 3, 1, 2, generator=g, dtype=D64), eta=torch.rand(1, 3, 1, generator=g, dtype=D64))
    assert torch.equal(R.run(a, **inp)[0], R.run(b, **inp)[0])


def test_apply_model_on_a_batch_of_inputs():
    spec = spec_of(TITANS_MLP)
    inputs, params = mlp_inputs(B=1, H=2)
    _, st = R.run(spec, params=params, **inputs)
    u = torch.randn(1, 2, 5, 3, dtype=D64)
    many = R.apply_model(spec, st, u)
    assert many.shape == (1, 2, 5, 3)
    W1, b1, W2 = st["W1"], st["b1"], st["W2"]
    by_hand = F.gelu(u @ W1 + b1[:, :, None]) @ W2
    assert torch.allclose(many, by_hand, atol=1e-12, rtol=0)
    assert torch.allclose(R.apply_model(spec, st, u[:, :, 2]), by_hand[:, :, 2], atol=1e-12, rtol=0)


# ================================================================ errors
def test_input_errors_name_the_expected_shape():
    spec = spec_of(DELTA)
    q = torch.zeros(1, 3, 1, 2)
    ok = dict(q=q, k=q, v=q, eta=torch.zeros(1, 3, 1))
    with pytest.raises(ValueError, match=r"missing k \[B, T, H, d_k\]"):
        R.run(spec, q=q, v=q, eta=ok["eta"])
    with pytest.raises(ValueError, match=r"unexpected kk \(did you mean 'k'\?\)"):
        R.run(spec, **ok, kk=q)
    with pytest.raises(ValueError, match=r"view 'v' must be \[B, T, H, d_v\] = \[1, 3, 1, 2\], got \[1, 3, 1, 5\]"):
        R.run(spec, **{**ok, "v": torch.zeros(1, 3, 1, 5)})
    with pytest.raises(ValueError, match=r"gate 'eta' must be \[B, T, H\] = \[1, 3, 1\], got \[1, 3, 1, 1\]"):
        R.run(spec, **{**ok, "eta": torch.zeros(1, 3, 1, 1)})
    with pytest.raises(ValueError, match=r"view 'k' must be \[B, T, H, d_k\] = \[1, 3, 1, 2\], got \[2, 3, 1, 2\]"):
        R.run(spec, **{**ok, "k": torch.zeros(2, 3, 1, 2)})
    with pytest.raises(ValueError, match=r"state 'W' must be \[B, H, d_k, d_v\] = \[1, 1, 2, 2\], got \[1, 2, 2\]"):
        R.run(spec, state={"W": torch.zeros(1, 2, 2)}, **ok)
    with pytest.raises(ValueError, match=r"unknown schedule"):
        R.run(spec, schedule="sometimes", **ok)
    with pytest.raises(ValueError, match=r"unexpected state \['Z'\]"):
        R.run(spec, state={"Z": q}, **ok)


def test_random_param_init_needs_a_value():
    text = DELTA.replace("model: f(u) = u @ W", "params:\n  P: {shape: [d_k, d_v], init: normal(0.1)}\n"
                         "model: f(u) = u @ (W + P)")
    spec = spec_of(text)
    q = torch.zeros(1, 2, 1, 2)
    with pytest.raises(ValueError, match=r"param P has a random init \(normal\(0.1\)\); pass its value"):
        R.run(spec, q=q, k=q, v=q, eta=torch.zeros(1, 2, 1))
    with pytest.raises(ValueError, match=r"param 'P' must be \[H, d_k, d_v\] = \[1, 2, 2\], got \[2, 2\]"):
        R.run(spec, q=q, k=q, v=q, eta=torch.zeros(1, 2, 1), params={"P": torch.zeros(2, 2)})
    out, _ = R.run(spec, q=q + 1, k=q + 1, v=q, eta=torch.zeros(1, 2, 1),
                   params={"P": torch.ones(1, 2, 2)})
    assert out[0, 0, 0].tolist() == [2.0, 2.0]   # (1,1) @ (0 + ones)


def test_dims_override():
    spec = spec_of(DELTA)
    q = torch.zeros(1, 2, 1, 4)
    out, st = R.run(spec, dims={"d_k": 4, "d_v": 4}, q=q, k=q, v=q, eta=torch.zeros(1, 2, 1))
    assert out.shape == (1, 2, 1, 4) and st["W"].shape == (1, 1, 4, 4)


def test_init_state_kinds():
    spec = spec_of("""\
    name: inits
    dims: {d: 3, e: 2}
    views: {q: d}
    params:
      c: {shape: [e], init: 0.25}
    state:
      Z: {shape: [d, e], init: zeros}
      O: {shape: [e], init: ones}
      I: {shape: [d, d], init: eye}
      N: {shape: [d, e], init: normal(2.0)}
      L: {shape: [d], init: learned(ones)}
      K: {shape: [d], cache: true, window: 4}
    read: q @ I + sum(O * c) + sum(L)
    """)
    st = R.init_state(spec, 2, 3, generator=torch.Generator().manual_seed(0))
    assert st["Z"].shape == (2, 3, 3, 2) and st["Z"].abs().sum() == 0
    assert st["O"].shape == (2, 3, 2) and bool((st["O"] == 1).all())
    assert torch.equal(st["I"][1, 2], torch.eye(3))
    again = R.init_state(spec, 2, 3, generator=torch.Generator().manual_seed(0))
    assert torch.equal(st["N"], again["N"])
    expected = torch.randn(3, 3, 2, generator=torch.Generator().manual_seed(0)) * 2.0
    assert torch.equal(st["N"][0], expected) and torch.equal(st["N"][1], expected)  # shared by the batch
    assert st["K"].shape == (2, 3, 0, 3)
    assert bool((st["L"] == 1).all())
    L = torch.arange(9.0).reshape(3, 3)
    assert torch.equal(R.init_state(spec, 2, 3, params={"L": L})["L"][1], L)
    out, _ = R.run(spec, q=torch.ones(2, 1, 3, 3), params={"L": L})
    # q @ I = (1,1,1); sum(O * c) = 2 * 0.25; sum(L) per head = 3, 12, 21
    assert out[0, 0, :, 0].tolist() == [1 + 0.5 + 3, 1 + 0.5 + 12, 1 + 0.5 + 21]


def test_a_shape_error_inside_an_expression_is_located():
    spec = spec_of("""\
    name: bad
    dims: {d: 3, e: 2}
    views: {q: d, v: e}
    read: q @ v
    """)
    with pytest.raises(ValueError, match=r"<string>:4:7: cannot evaluate `q @ v`"):
        R.run(spec, q=torch.ones(1, 2, 1, 3), v=torch.ones(1, 2, 1, 2))
    spec = spec_of(DELTA.replace("read: f(q)", "read: f(qq)"))
    q = torch.zeros(1, 2, 1, 2)
    with pytest.raises(ValueError, match=r"unknown name 'qq'; did you mean 'q'\?"):
        R.run(spec, q=q, k=q, v=q, eta=torch.zeros(1, 2, 1))


# ============================================== per-channel gates and diagonal scaling
PER_CHANNEL = """\
name: pc
dims: {d_k: 3, d_v: 2}
views: {q: d_k, k: d_k, v: d_v}
gates:
  alpha: {formula: sigmoid(logit), shape: [d_k]}
  eta: {formula: sigmoid(logit), shape: [d_v]}
state:
  S: {shape: [d_k, d_v]}
update:
  - S = diag(1 - alpha) @ S @ diag(eta) + outer(k, v)
read: q @ S
"""


def test_per_channel_gates_scale_rows_and_columns():
    """diag(a) @ S scales row i of S by a_i, S @ diag(b) column j by b_j: token by token,
    S_t[i, j] = (1 - alpha_t[i]) S_{t-1}[i, j] eta_t[j] + k_t[i] v_t[j]."""
    spec = spec_of(PER_CHANNEL)
    g = torch.Generator().manual_seed(0)
    B, T, H = 2, 4, 3
    x = {n: torch.randn(B, T, H, d, generator=g, dtype=D64) for n, d in (("q", 3), ("k", 3), ("v", 2))}
    alpha = torch.rand(B, T, H, 3, generator=g, dtype=D64)
    eta = torch.rand(B, T, H, 2, generator=g, dtype=D64)
    S0 = torch.randn(B, H, 3, 2, generator=g, dtype=D64)
    out, st = R.run(spec, state={"S": S0}, alpha=alpha, eta=eta, **x)
    S = S0.clone()
    for t in range(T):
        for i in range(3):
            for j in range(2):
                S[..., i, j] = (1 - alpha[:, t, :, i]) * S[..., i, j] * eta[:, t, :, j] \
                    + x["k"][:, t, :, i] * x["v"][:, t, :, j]
        o = torch.einsum("bhk,bhkv->bhv", x["q"][:, t], S)
        assert torch.allclose(out[:, t], o, atol=1e-12, rtol=0)
    assert torch.allclose(st["S"], S, atol=1e-12, rtol=0)


@pytest.mark.parametrize("written", ["diag(1 - alpha) @ S", "(S.T * (1 - alpha)).T", "S.T.T - diag(alpha) @ S",
                                     "(diag(1 - alpha) @ S.T.T)"])
def test_row_scaling_written_any_way_gives_the_same_numbers(written):
    spec = spec_of(PER_CHANNEL.replace("diag(1 - alpha) @ S @ diag(eta)", written))
    base = spec_of(PER_CHANNEL.replace("diag(1 - alpha) @ S @ diag(eta)", "diag(1 - alpha) @ S"))
    g = torch.Generator().manual_seed(1)
    x = {n: torch.randn(1, 3, 2, d, generator=g, dtype=D64) for n, d in (("q", 3), ("k", 3), ("v", 2))}
    gates = {"alpha": torch.rand(1, 3, 2, 3, generator=g, dtype=D64), "eta": torch.rand(1, 3, 2, 2, generator=g,
                                                                                        dtype=D64)}
    a, sa = R.run(spec, **x, **gates)
    b, sb = R.run(base, **x, **gates)
    assert torch.allclose(a, b, atol=1e-12, rtol=0) and torch.allclose(sa["S"], sb["S"], atol=1e-12, rtol=0)


def test_per_channel_gate_input_shape_is_checked():
    spec = spec_of(PER_CHANNEL)
    q = torch.zeros(1, 2, 1, 3)
    ok = dict(q=q, k=q, v=torch.zeros(1, 2, 1, 2), alpha=torch.zeros(1, 2, 1, 3), eta=torch.zeros(1, 2, 1, 2))
    with pytest.raises(ValueError, match=r"gate 'alpha' must be \[B, T, H, d_k\] = \[1, 2, 1, 3\], got \[1, 2, 1\]"):
        R.run(spec, **{**ok, "alpha": torch.zeros(1, 2, 1)})
    with pytest.raises(ValueError, match=r"missing eta \[B, T, H, d_v\]"):
        R.run(spec, **{k: v for k, v in ok.items() if k != "eta"})
