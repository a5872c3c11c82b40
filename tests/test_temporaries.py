"""Per-token temporaries in the update program: `g = grad(loss, W)` binds a value of
this token, visible to the later update statements only (docs/language.md)."""
from __future__ import annotations

import torch
import pytest

import memspec
from memspec import reference
from memspec.check.verify import check
from memspec.schedule.recurrence import minibatch_recurrence
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


DECAY_FIRST = """
name: dd
dims: {d_model: 8, heads: 2, d_k: 3, d_v: 3}
views: {q: d_k, k: d_k, v: d_v}
gates: {eta: sigmoid(logit), alpha: sigmoid(logit)}
state: {W: {shape: [d_k, d_v]}}
model: f(u) = u @ W
loss: 0.5 * sum((f(k) - v)^2)
update:
  - W = (1 - alpha) * W
  - g = grad(loss, W)
  - e = eta * g
  - W = W - e
read: f(q)
"""


@pytest.mark.parametrize("which", ["simultaneous", "momentum", "decay_first"])
@pytest.mark.parametrize("schedule", ["online", "minibatch"])
def test_compiled_matches_reference(which, schedule):
    """decay_first: the temporaries are replayed after the decay on the chunk-start state."""
    spec = {"simultaneous": lambda: two(SIMULTANEOUS), "momentum": momentum_spec,
            "decay_first": lambda: memspec.loads(DECAY_FIRST, "yaml")}[which]()
    dims = {k: v for k, v in {"d_model": 8, "heads": 2, "d_k": 3, "d_v": 3, "hidden": 4}.items() if k in spec.dims}
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
    assert memspec.lang.expr.unparse(rec.coeff["W2"][("cur", "U")]) == "0.5 + 1"
    assert memspec.lang.expr.unparse(rec.rest["U"]) == "-(eta * grad(loss, W2))"
    assert sorted(memspec.lang.expr.unparse(g) for g in rec.grads) == ["grad(loss, W1)", "grad(loss, W2)"]


# ------------------------------------------------------------------ schedule
DELTA = """
name: d
dims: {d_model: 8, heads: 2, d_k: 4, d_v: 4}
views: {q: d_k, k: d_k, v: d_v}
gates: {eta: sigmoid(logit), alpha: sigmoid(logit)}
state: {W: {shape: [d_k, d_v]}}
model: f(u) = u @ W
loss: 0.5 * sum((f(k) - v)^2)
update:
UPDATE
read: f(q)
"""


def delta(update: str) -> memspec.Spec:
    return memspec.loads(DELTA.replace("UPDATE", update), "yaml")


def test_delta_family_through_a_temporary():
    plain = analyse(delta("  - W = (1 - alpha) * W\n  - W = W - eta * grad(loss, W)"))
    temp = analyse(delta("  - W = (1 - alpha) * W\n  - g = grad(loss, W)\n  - W = W - eta * g"))
    assert plain.family == temp.family == "delta"
    assert temp.admits == plain.admits
    assert temp.plan == plain.plan
    assert temp.reasons == plain.reasons


def test_temporary_taken_before_a_write_it_depends_on_is_not_inlined():
    """g at the undecayed memory, used after the decay: not the gated delta rule (whose
    gradient is at the decayed memory); the delta family needs the gradient's position."""
    d = analyse(delta("  - g = grad(loss, W)\n  - W = (1 - alpha) * W\n  - W = W - eta * g"))
    rej = dict(d.rejected)
    assert "the temporary g is used after W changed" in rej["delta"]
    assert d.family == "online" and "minibatch" in d.admits   # linear recurrences around the held gradient
    # and written in one statement it is the delta family, with the decay in the gradient statement
    one = analyse(delta("  - W = (1 - alpha) * W - eta * grad(loss, W)"))
    assert one.family == "delta"


def test_additive_family_through_a_temporary():
    spec = memspec.loads("""
name: a
dims: {d_model: 8, heads: 2, d_k: 4, d_v: 4}
views: {q: d_k, k: d_k, v: d_v}
state: {S: {shape: [d_k, d_v]}}
update:
  - inc = outer(k, v)
  - S = 0.9 * S + inc
read: q @ S
""", "yaml")
    d = analyse(spec)
    assert d.family == "additive"
    assert memspec.lang.expr.unparse(d.plan.states[0].gamma) == "0.9"


# ------------------------------------------------------------------ checks
def errs(update: str, read: str = "f(q)", let: str = ""):
    text = DELTA.replace("UPDATE", update).replace("read: f(q)", f"read: {read}") + let
    _, diags = check(memspec.loads(text, "yaml"))
    return [(d.severity, d.code, d.message, (d.span.line, d.span.col) if d.span else None) for d in diags]


def test_valid_temporaries_have_no_diagnostics():
    assert errs("  - g = grad(loss, W)\n  - W = (1 - alpha) * W - eta * g") == []


@pytest.mark.parametrize("update,read,want", [
    ("  - g = grad(loss, W)\n  - g = 2 * g\n  - W = W - eta * g", "f(q)",
     ("error", "E-temp-twice", "the temporary 'g' is assigned twice (line 10); a temporary is assigned once per token",
      (11, 5))),
    ("  - W = W - eta * g\n  - g = grad(loss, W)", "f(q)",
     ("error", "E-temp-later", "the temporary 'g' is only available later: it is assigned at line 11", (10, 19))),
    ("  - g = grad(loss, W)\n  - W = W - eta * g", "f(q) + g @ v",
     ("error", "E-temp-scope", "'g' is a temporary of the update program; it is not visible in the read", (12, 14))),
    ("  - f = grad(loss, W)\n  - W = W - eta * f", "f(q)",
     ("error", "E-temp-shadow", "the temporary 'f' would shadow the model 'f'", (10, 5))),
    ("  - u = grad(loss, W)\n  - W = W - eta * u", "f(q)",
     ("error", "E-temp-shadow", "the temporary 'u' would shadow the model's argument 'u'", (10, 5))),
    ("  - k = 2 * k\n  - W = W - eta * grad(loss, W)", "f(q)",
     ("error", "E-target", "'k' is a view; update statements assign states or new temporaries", (10, 5))),
    ("  - Wn = Wn - eta * grad(loss, W)\n  - W = W - eta * grad(loss, W)", "f(q)",
     ("error", "E-temp-later", "'Wn' is not a state: this statement binds the temporary 'Wn', which has no value "
      "before it", (10, 10))),
    ("  - g = grad(loss, W)\n  - h = 2 * g\n  - W = W - eta * g", "f(q)",
     ("warning", "W-temp-unused", "the temporary 'h' is never used", (11, 5))),
])
def test_temporary_checks(update, read, want):
    got = errs(update, read)
    assert want in got, got
    assert all(d[0] == "warning" for d in got) == (want[0] == "warning")


def test_temporary_in_a_let_is_out_of_scope():
    got = errs("  - g = grad(loss, W)\n  - W = W - eta * g", let="let: {z: 2 * g}\n")
    assert ("error", "E-temp-scope", "'g' is a temporary of the update program; it is not visible in a let",
            (13, 14)) in got


def test_typo_in_a_state_target_points_at_the_state():
    got = errs("  - Wx = W - eta * grad(loss, W)")
    codes = [(d[1]) for d in got]
    assert "E-state-unwritten" in codes
    _, diags = check(memspec.loads(DELTA.replace("UPDATE", "  - Wx = W - eta * grad(loss, W)"), "yaml"))
    d = next(d for d in diags if d.code == "E-state-unwritten")
    assert d.hint == "the update assigns the temporary 'Wx': a typo for W?"


def test_graph_nodes_of_temporaries():
    from memspec.check.graph import lower
    g = lower(delta("  - g = grad(loss, W)\n  - W = W - eta * g"))
    assert g.nodes["temp:g"]["role"] == "temp"
    assert g.nodes["temp:g"]["shape"] == ("d_k", "d_v")
    assert g.has_edge("grad:W@temp:g", "temp:g")
    assert g.has_edge("temp:g", "update:W#1/e.1")
