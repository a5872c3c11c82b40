"""Per-token temporaries in the update program: `g = grad(loss, W)` binds a value of
this token, visible to the later update statements only (docs/language.md)."""
from __future__ import annotations

import torch
import pytest

import memspec
from memspec import reference
from memspec.checks import check
from memspec.codegen import minibatch_recurrence
from memspec.schedule import analyse

from _compiled_harness import call, inputs, initial_state, make, reference_run, rel_err

TWO = """
name: two
dims: {d_model: 8, heads: 2, d_k: 3, hidden: 4}
views: {q: d_k, k: d_k, v: d_k}
gates: {eta: sigmoid(logit)}
state:
  W1: {shape: [d_k, hidden], init: normal(0.3)}
  W2: {shape: [hidden, d_k], init: normal(0.3)}
model: f(u) = tanh(u @ W1) @ W2
loss: 0.5 * sum((f(k) - v)^2)
update:
UPDATE
read: f(q)
"""
SIMULTANEOUS = """  - g1 = grad(loss, W1)
  - g2 = grad(loss, W2)
  - W1 = W1 - eta * g1
  - W2 = W2 - eta * g2"""
SEQUENTIAL = """  - W1 = W1 - eta * grad(loss, W1)
  - W2 = W2 - eta * grad(loss, W2)"""


def two(update: str, extra: str = "") -> memspec.Spec:
    return memspec.loads(TWO.replace("UPDATE", update) + extra, "yaml")


def by_hand(W1, W2, k, v, eta, simultaneous: bool):
    """One token of the two-tensor model with plain autograd, [d_k, hidden] / [hidden, d_k]."""
    def loss(a, b):
        return 0.5 * ((torch.tanh(k @ a) @ b - v) ** 2).sum()
    a, b = W1.clone().requires_grad_(True), W2.clone().requires_grad_(True)
    g1, g2 = torch.autograd.grad(loss(a, b), (a, b))
    W1n = W1 - eta * g1
    if not simultaneous:
        a2, b2 = W1n.clone(), W2.clone().requires_grad_(True)
        (g2,) = torch.autograd.grad(loss(a2, b2), (b2,))
    return W1n, W2 - eta * g2


def test_reference_simultaneous_and_sequential_gradients_by_hand():
    torch.manual_seed(0)
    B, T, H, d, h = 1, 3, 1, 3, 4
    W1, W2 = torch.randn(B, H, d, h, dtype=torch.float64), torch.randn(B, H, h, d, dtype=torch.float64)
    ins = {n: torch.randn(B, T, H, d, dtype=torch.float64) for n in "qkv"}
    ins["eta"] = torch.full((B, T, H), 0.7, dtype=torch.float64)
    results = {}
    for name, upd, simul in (("sim", SIMULTANEOUS, True), ("seq", SEQUENTIAL, False)):
        spec = two(upd)
        _, got = reference.run(spec, state={"W1": W1, "W2": W2}, **ins)
        a, b = W1[0, 0], W2[0, 0]
        for t in range(T):
            a, b = by_hand(a, b, ins["k"][0, t, 0], ins["v"][0, t, 0], 0.7, simul)
        torch.testing.assert_close(got["W1"][0, 0], a)
        torch.testing.assert_close(got["W2"][0, 0], b)
        results[name] = got
    # the two orders are different programs: W1 agrees (its gradient comes first), W2 does not
    assert (results["sim"]["W2"] - results["seq"]["W2"]).abs().max() > 1e-3


def test_temporary_is_not_carried_to_the_next_token():
    """`d = k @ W; W = W + outer(k, v - d)` is the plain delta rule, each token its own d."""
    spec = memspec.loads("""
name: t
dims: {d_model: 8, heads: 1, d_k: 3, d_v: 2}
views: {q: d_k, k: d_k, v: d_v}
state: {W: {shape: [d_k, d_v]}}
update:
  - d = k @ W
  - W = W + 0.5 * outer(k, v - d)
read: q @ W
""", "yaml")
    torch.manual_seed(1)
    ins = {"q": torch.randn(1, 4, 1, 3), "k": torch.randn(1, 4, 1, 3), "v": torch.randn(1, 4, 1, 2)}
    out, st = reference.run(spec, **ins)
    W = torch.zeros(3, 2)
    for t in range(4):
        k, v = ins["k"][0, t, 0], ins["v"][0, t, 0]
        W = W + 0.5 * torch.outer(k, v - k @ W)
        torch.testing.assert_close(out[0, t, 0], ins["q"][0, t, 0] @ W)
    torch.testing.assert_close(st["W"][0, 0], W)
    assert set(st) == {"W"}   # the temporary is not state


MOMENTUM = """  - g = grad(loss, W2)
  - h = grad(loss, W1)
  - U = 0.9 * U - eta * g
  - m = 0.5 * U
  - W1 = (1 - 0.1 * eta) * W1 - eta * h
  - W2 = W2 + m + U"""


def momentum_spec():
    """Temporaries holding gradients, and one (m) that depends on a state written before it."""
    t = TWO.replace("UPDATE", MOMENTUM).replace("state:\n", "state:\n  U: {shape: [hidden, d_k]}\n")
    return memspec.loads(t, "yaml")


@pytest.mark.parametrize("which", ["simultaneous", "momentum"])
@pytest.mark.parametrize("schedule", ["online", "minibatch"])
def test_compiled_matches_reference(which, schedule):
    spec = two(SIMULTANEOUS) if which == "simultaneous" else momentum_spec()
    dims = {"d_model": 8, "heads": 2, "d_k": 3, "hidden": 4}
    m = make(spec, dims, chunk=3)
    ins = inputs(spec, m, T=7)
    st = initial_state(spec, m)
    want_o, want_s = reference_run(spec, m, dims, schedule, st, ins)
    got_o, got_s = call(m, spec, ins, state=dict(st), schedule=schedule)
    assert rel_err(got_o, want_o) < 1e-10
    for n in spec.state:
        assert rel_err(got_s[n], want_s[n]) < 1e-10


def test_minibatch_differs_from_online_and_chunk_one_is_online():
    spec = two(SIMULTANEOUS)
    B, T, H = 1, 6, 2
    torch.manual_seed(3)
    ins = {n: 0.7 * torch.randn(B, T, H, 3, dtype=torch.float64) for n in "qkv"}
    ins["eta"] = torch.full((B, T, H), 0.5, dtype=torch.float64)
    st = {"W1": 0.5 * torch.randn(B, H, 3, 4, dtype=torch.float64), "W2": 0.5 * torch.randn(B, H, 4, 3, dtype=torch.float64)}
    on, _ = reference.run(spec, state=st, **ins)
    mb1, _ = reference.run(spec, state=st, schedule=("minibatch", 1), **ins)
    mb3, _ = reference.run(spec, state=st, schedule=("minibatch", 3), **ins)
    torch.testing.assert_close(mb1, on)
    assert (mb3 - on).abs().max() > 1e-4


def test_minibatch_recurrence_sees_through_temporaries():
    rec = minibatch_recurrence(momentum_spec())
    assert rec.order == ("U", "W1", "W2")
    # W2 <- W2 + 1.5 U_new: U is finished (written before), so its coefficient is on ("cur", U)
    assert set(rec.coeff["W2"]) == {("prev", "W2"), ("cur", "U")}
    assert memspec.expr.unparse(rec.coeff["W2"][("cur", "U")]) == "0.5 + 1"
    assert memspec.expr.unparse(rec.rest["U"]) == "-(eta * grad(loss, W2))"
    assert sorted(memspec.expr.unparse(g) for g in rec.grads) == ["grad(loss, W1)", "grad(loss, W2)"]
