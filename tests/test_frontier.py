"""The 2025-26 frontier: the new primitives against hand-computed numbers, each new
spec against an independent PyTorch loop of its paper's equations (through the reference
interpreter, float64), the block-update and apply-then-update semantics, window losses,
and the schedule decisions `memspec explain` reports for the six specs.

The compiled modules of the six specs are tested against the reference like every shipped
spec (tests/test_compiled_vs_reference.py: outputs, states, gradients, gradcheck, causality,
streaming, step()).
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import memspec
from memspec import reference
from memspec.lang.errors import SpecError
from memspec.lang.expr import parse_expr, unparse
from memspec.runtime import helpers, muon
from memspec.schedule import analyse, explain
from memspec.schedule.algebra import Algebra
from memspec.schedule.decide import BY_NAME

from close import assert_same_function

ROOT = Path(__file__).resolve().parent.parent
SPECS = ROOT / "specs"
NEW = ["atlas", "omeganet", "lact", "memora", "hope_cms", "titans_muon"]
DT = torch.float64


def _spec(name):
    return memspec.load(SPECS / f"{name}.yaml")


def _l2n(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _rand(*shape, seed, scale=0.5):
    g = torch.Generator().manual_seed(seed)
    return scale * torch.randn(*shape, generator=g, dtype=DT)


def _gate(*shape, seed, lo=0.05, hi=0.4):
    g = torch.Generator().manual_seed(seed)
    return lo + (hi - lo) * torch.rand(*shape, generator=g, dtype=DT)


# ------------------------------------------------------------------ Newton-Schulz
A, B_, C_ = 3.4445, -4.7750, 2.0315


def _p(s):
    return A * s + B_ * s ** 3 + C_ * s ** 5


def test_newton_schulz_one_step_on_a_diagonal_matrix_by_hand():
    # X = diag(3, 4): |X|_F = 5, singular values 0.6 and 0.8 after the normalisation;
    # one step maps s -> 3.4445 s - 4.7750 s^3 + 2.0315 s^5
    X = torch.tensor([[3.0, 0.0], [0.0, 4.0]], dtype=DT).reshape(1, 1, 2, 2)
    one = reference.newton_schulz(X, 1)[0, 0]
    assert float(one[0, 0]) == pytest.approx(1.19326944, abs=1e-7)   # 2.0667 - 1.0314 + 0.15796944
    assert float(one[1, 1]) == pytest.approx(0.97648192, abs=1e-7)   # 2.7556 - 2.4448 + 0.66568192
    assert float(one[0, 1]) == 0.0 and float(one[1, 0]) == 0.0


def test_newton_schulz_acts_on_the_singular_values():
    # X = U diag(s) V^T with rotations U, V: the iteration keeps U and V and maps each
    # normalised singular value through p five times (its closed form)
    def rot(a):
        return torch.tensor([[math.cos(a), -math.sin(a)], [math.sin(a), math.cos(a)]], dtype=DT)
    U, V = rot(0.3), rot(-1.1)
    s = torch.tensor([2.0, 0.5], dtype=DT)
    X = (U @ torch.diag(s) @ V.T).reshape(1, 1, 2, 2)
    f = float(torch.linalg.norm(s))
    want_s = [x / (f + 1e-7) for x in s.tolist()]
    for _ in range(5):
        want_s = [_p(x) for x in want_s]
    want = U @ torch.diag(torch.tensor(want_s, dtype=DT)) @ V.T
    got = reference.newton_schulz(X, 5)[0, 0]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    # to the iteration's accuracy it is the orthogonal polar factor U V^T: the quintic's
    # singular values settle in about [0.68, 1.13], not at 1
    assert all(0.68 < x < 1.2 for x in torch.linalg.svdvals(got).tolist())
    assert float(torch.linalg.matrix_norm(got - U @ V.T, ord=2)) < 0.33


@pytest.mark.parametrize("shape", [(3, 5), (5, 3), (4, 4)])
def test_compiled_helper_is_the_reference_iteration(shape):
    X = _rand(2, 3, *shape, seed=1)
    torch.testing.assert_close(muon.newton_schulz(X, 5), reference.newton_schulz(X, 5), rtol=0, atol=1e-12)


# the LaCT authors' per-iteration coefficients (their zeropower_via_newtonschulz5; Moonlight's Muon)
LACT_NS = ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
           (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012))


def test_newton_schulz_schedule_takes_one_triple_per_step_by_hand():
    # X = diag(3, 4) normalised to singular values 0.6, 0.8; step i maps s -> a_i s + b_i s^3 + c_i s^5
    X = torch.tensor([[3.0, 0.0], [0.0, 4.0]], dtype=DT).reshape(1, 1, 2, 2)
    two = reference.newton_schulz(X, LACT_NS[:2])[0, 0]
    s = [0.6 / (1 + 0.2e-7), 0.8 / (1 + 0.2e-7)]
    for a, b, c in LACT_NS[:2]:
        s = [a * x + b * x ** 3 + c * x ** 5 for x in s]
    # 0.6 -> 4.0848 * 0.6 - 6.8946 * 0.216 + 2.9270 * 0.07776 = 2.45088 - 1.4892336 + 0.2276035 by the first triple
    assert float(reference.newton_schulz(X, LACT_NS[:1])[0, 0][0, 0]) == pytest.approx(1.1892499, abs=1e-6)
    torch.testing.assert_close(torch.diagonal(two), torch.tensor(s, dtype=DT), rtol=1e-12, atol=1e-12)
    # five steps of Muon's one triple are not this schedule
    assert not torch.allclose(reference.newton_schulz(X, 5), reference.newton_schulz(X, LACT_NS))


@pytest.mark.parametrize("shape", [(3, 5), (5, 3)])
def test_compiled_helper_runs_the_schedule_as_the_reference(shape):
    X = _rand(2, 3, *shape, seed=4)
    torch.testing.assert_close(muon.newton_schulz(X, LACT_NS), reference.newton_schulz(X, LACT_NS),
                               rtol=0, atol=1e-12)


def test_a_schedule_is_a_constant_of_triples_in_both_formats(tmp_path):
    from memspec.lang.fmt import to_mem, to_yaml
    spec = memspec.load(SPECS / "variants" / "lact_muon.yaml")
    assert spec.constants["ns"] == LACT_NS
    for text, suffix in ((to_yaml(spec), ".yaml"), (to_mem(spec), ".mem")):
        path = tmp_path / f"again{suffix}"
        path.write_text(text, encoding="utf-8")
        assert memspec.load(path).constants == spec.constants
    assert "const ns = [(4.0848, -6.8946, 2.927), (3.9505," in to_mem(spec)


@pytest.mark.parametrize("constants,update,message", [
    ("{ns: [[1.0, 2.0]]}", "W0 - newton_schulz(eta0 * g0, ns)", "a list of (a, b, c) triples"),
    ("{ns: [[1.0, 2.0, 3.0]]}", "W0 - ns * newton_schulz(eta0 * g0, 5)", "is a Newton-Schulz coefficient schedule"),
    ("{c: 2.0}", "W0 - newton_schulz(eta0 * g0, c)", "a constant holding (a, b, c) coefficients"),
])
def test_a_bad_schedule_gets_a_located_error(tmp_path, constants, update, message):
    path = tmp_path / "bad.yaml"
    path.write_text(f"extends: {(SPECS / 'lact.yaml').as_posix()}\nname: bad\nconstants: {constants}\nupdate:\n"
                    f"  - g0 = grad(loss, W0)\n  - W0 = {update}\n  - W1 = W1\n  - W2 = W2\n", encoding="utf-8")
    import contextlib
    import io
    from memspec.tools.cli import main
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = main(["check", str(path), "--allow-extends-outside"])
    assert rc == 1 and message in out.getvalue() and "bad.yaml:" in out.getvalue(), out.getvalue()
    assert "Traceback" not in out.getvalue()


def test_newton_schulz_gradcheck():
    X = _rand(1, 1, 3, 4, seed=2).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: reference.newton_schulz(x, 3), (X,), eps=1e-6, atol=1e-6)
    assert torch.autograd.gradcheck(lambda x: muon.newton_schulz(x, 3), (X,), eps=1e-6, atol=1e-6)


# ------------------------------------------------------------------ mirror descent
MIRROR = """
memory mirror
dims { d_model = 8, heads = 1, d = 3 }
view c : d
gate eta = sigmoid(logit)
state w : [d] = ones
loss = sum(w * c)
update {
  w = softmax(0.5 * log(w) - eta * grad(loss, w), d)
}
read = w
"""


def test_softmax_mirror_step_on_a_three_element_state_by_hand():
    spec = memspec.loads(MIRROR, "mem")
    w0 = torch.tensor([0.2, 0.3, 0.5], dtype=DT).reshape(1, 1, 3)
    c = torch.tensor([1.0, 0.0, -1.0], dtype=DT).reshape(1, 1, 1, 3)
    eta = torch.ones(1, 1, 1, dtype=DT)
    out, st = reference.run(spec, state={"w": w0}, c=c, eta=eta)
    # logits 0.5 log w - c = (-1.80472, -0.60199, 0.65343); exp / sum = (0.062452, 0.207915, 0.729633)
    z = [0.5 * math.log(0.2) - 1.0, 0.5 * math.log(0.3), 0.5 * math.log(0.5) + 1.0]
    e = [math.exp(x) for x in z]
    want = [x / sum(e) for x in e]
    assert st["w"][0, 0].tolist() == pytest.approx([0.062452, 0.207915, 0.729633], abs=1e-6)
    torch.testing.assert_close(st["w"][0, 0], torch.tensor(want, dtype=DT), rtol=0, atol=1e-12)
    # the compiled online step, and its gradient for the outer loop (float64 gradcheck)
    m = memspec.build(spec, compile=False).memory.to(DT)
    o, s = m(c, eta=eta, state={"w": w0})
    torch.testing.assert_close(s["w"], st["w"], rtol=0, atol=1e-12)
    cc = c.clone().requires_grad_(True)
    ee = torch.full((1, 2, 1), 0.7, dtype=DT, requires_grad=True)
    c2 = torch.cat([cc, 0.5 * cc], dim=1)
    assert torch.autograd.gradcheck(lambda x, y: m(x, eta=y, state={"w": w0})[0], (c2.detach().requires_grad_(True), ee),
                                    eps=1e-6, atol=1e-6)


# ------------------------------------------------------------------ the six papers' equations
def _ns(X, steps=5):
    """Newton-Schulz written out independently (on X, never transposed); ``steps`` a count of
    Muon's triple or a coefficient schedule."""
    X = X / (torch.linalg.matrix_norm(X) + 1e-7)
    for a, b, c in (steps if isinstance(steps, tuple) else ((A, B_, C_),) * steps):
        Am = X @ X.T
        X = a * X + (b * Am + c * Am @ Am) @ X
    return X


def _mlp(u, W1, W2):
    return F.gelu(u @ W1) @ W2


def _mlp_unit_hidden(u, W1, W2):
    """Titans' memory: the hidden layer l2-normalised (its bounded step)."""
    return _l2n(F.gelu(u @ W1)) @ W2


def _grad(loss_fn, *ws):
    ws = [w.detach().requires_grad_(True) for w in ws]
    with torch.enable_grad():
        gs = torch.autograd.grad(loss_fn(*ws), ws)
    return gs


def _run(name, T, dims, params=None, state=None, schedule="online", seed=0):
    spec = _spec(name)
    spec = spec.with_dims(**dims)
    g = seed
    views = {n: _rand(1, T, 1, spec.dims[v.dim], seed=g + i) for i, (n, v) in enumerate(spec.views.items())}
    gates = {n: _gate(1, T, 1, seed=g + 10 + i) for i, n in enumerate(spec.gates)}
    out, st = reference.run(spec, state=state, schedule=schedule, params=params, **views, **gates)
    return spec, views, gates, out[0, :, 0], {k: v[0, 0] for k, v in st.items()}


def test_omeganet_is_the_omega_rule_on_a_linear_memory():
    T, c = 11, 8
    spec, x, g, out, st = _run("omeganet", T, {"d_k": 3, "d_v": 2})
    q, k, v = (_l2n(x["q"][0, :, 0]), _l2n(x["k"][0, :, 0]), x["v"][0, :, 0])
    W = torch.zeros(3, 2, dtype=DT)
    for t in range(T):
        lo = max(0, t - c + 1)
        Kw, Vw = k[lo:t + 1], v[lo:t + 1]
        grad = Kw.T @ (Kw @ W - Vw) / c                # the window's mean loss: sum of k_i^T (k_i W - v_i) / 8
        W = W - g["eta"][0, t, 0] * grad
        torch.testing.assert_close(out[t], q[t] @ W, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(st["W"], W, rtol=1e-10, atol=1e-12)


def test_omeganet_with_a_window_of_one_is_deltanet():
    base = _spec("omeganet")
    assert unparse(base.loss) == "0.5 * sum((f(K) - V)^2) / 8"   # the window's mean; one pair: the plain loss
    one = base.model_copy(update={"state": {**base.state, "K": base.state["K"].model_copy(update={"window": 1}),
                                            "V": base.state["V"].model_copy(update={"window": 1})},
                                  "loss": base.loss.left})
    dims = {"d_k": 3, "d_v": 2}
    x = {n: _rand(1, 7, 2, 3 if n != "v" else 2, seed=i) for i, n in enumerate("qkv")}
    eta = _gate(1, 7, 2, seed=9)
    o1, s1 = reference.run(one, dims=dims, eta=eta, **x)
    o2, s2 = reference.run(_spec("deltanet"), dims=dims, eta=eta, **x)
    torch.testing.assert_close(o1, o2, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(s1["W"], s2["W"], rtol=1e-12, atol=1e-14)


def test_atlas_is_the_weighted_omega_rule_with_muon():
    T, c, dk, dv, hid = 10, 8, 3, 2, 4
    p1, p2 = _rand(1, dk, seed=40) + 1, _rand(1, dk, seed=41)
    W1, W2 = _rand(1, dk, hid, seed=42), _rand(1, hid, dv, seed=43)
    spec, x, g, out, st = _run("atlas", T, {"d_k": dk, "d_v": dv, "hidden": hid},
                               params={"p1": p1, "p2": p2, "W1": W1, "W2": W2})
    phi = lambda u: _l2n(p1[0] * _l2n(u) + p2[0] * _l2n(u) ** 2)  # noqa: E731
    q, k, v = phi(x["q"][0, :, 0]), phi(x["k"][0, :, 0]), x["v"][0, :, 0]
    w1, w2 = W1[0], W2[0]
    s1, s2 = torch.zeros_like(w1), torch.zeros_like(w2)
    for t in range(T):
        lo = max(0, t - c + 1)
        gam = g["gamma"][0, lo:t + 1, 0]
        g1, g2 = _grad(lambda a, b: 0.5 * (gam[:, None] * (_mlp(k[lo:t + 1], a, b) - v[lo:t + 1]) ** 2).sum(), w1, w2)
        s1, s2 = g["mu"][0, t, 0] * s1 + g1, g["mu"][0, t, 0] * s2 + g2
        keep, eta = 1 - g["alpha"][0, t, 0], g["eta"][0, t, 0]
        w1, w2 = keep * w1 - eta * _ns(s1), keep * w2 - eta * _ns(s2)
        torch.testing.assert_close(out[t], _mlp(q[t], w1, w2), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(st["W1"], w1, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(st["S2"], s2, rtol=1e-9, atol=1e-12)


def test_titans_muon_orthogonalises_the_surprise():
    T, dk, dv, hid = 6, 3, 2, 4
    W1, W2 = _rand(1, dk, hid, seed=50), _rand(1, hid, dv, seed=51)
    spec, x, g, out, st = _run("titans_muon", T, {"d_k": dk, "d_v": dv, "hidden": hid}, params={"W1": W1, "W2": W2})
    q, k, v = (_l2n(F.silu(x["q"][0, :, 0])), _l2n(F.silu(x["k"][0, :, 0])), F.silu(x["v"][0, :, 0]))
    w1, w2 = W1[0], W2[0]
    u1, u2 = torch.zeros_like(w1), torch.zeros_like(w2)
    for t in range(T):
        g1, g2 = _grad(lambda a, b: 0.5 * ((_mlp_unit_hidden(k[t], a, b) - v[t]) ** 2).sum(), w1, w2)
        mu, keep = g["mu"][0, t, 0], 1 - g["alpha"][0, t, 0]
        u1, u2 = mu * u1 + g1, mu * u2 + g2
        w1 = keep * w1 - g["eta1"][0, t, 0] * _ns(u1)
        w2 = keep * w2 - g["eta2"][0, t, 0] * _ns(u2)
        torch.testing.assert_close(out[t], _mlp_unit_hidden(q[t], w1, w2), rtol=1e-9, atol=1e-12)


def test_memora_is_a_mirror_descent_step_on_the_simplex():
    T, dk, dv, hid = 5, 3, 2, 4
    g0 = torch.Generator().manual_seed(60)
    W1 = 0.5 + torch.rand(1, dk, hid, generator=g0, dtype=DT)
    W2 = 0.5 + torch.rand(1, hid, dv, generator=g0, dtype=DT)
    spec, x, g, out, st = _run("memora", T, {"d_k": dk, "d_v": dv, "hidden": hid}, params={"W1": W1, "W2": W2})
    c1, c2 = spec.constants["c1"], spec.constants["c2"]
    q, k, v = _l2n(x["q"][0, :, 0]), _l2n(x["k"][0, :, 0]), x["v"][0, :, 0]
    w1, w2 = W1[0], W2[0]
    z1, z2 = torch.zeros_like(w1), torch.zeros_like(w2)   # the logits' learned start (zeros)
    for t in range(T):
        g1, g2 = _grad(lambda a, b: 0.5 * ((_mlp(k[t], a, b) - v[t]) ** 2).sum(), w1, w2)
        keep, eta = 1 - g["alpha"][0, t, 0], g["eta"][0, t, 0]
        z1, z2 = keep * z1 - eta * g1, keep * z2 - eta * g2    # the mirror step on the logits
        w1 = c1 * torch.softmax(z1, dim=-1)                   # each row of W1 sums to c1
        w2 = c2 * torch.softmax(z2, dim=-1)
        torch.testing.assert_close(out[t], _mlp(q[t], w1, w2), rtol=1e-9, atol=1e-12)
        if t:   # from the second token on, W is on the simplex: the step is W = c softmax((1 - alpha) log W - eta g)
            torch.testing.assert_close(z1.log_softmax(-1), torch.log(w1 / c1), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(st["W1"].sum(-1), torch.full((dk,), c1, dtype=DT), rtol=1e-12, atol=1e-12)


def test_hope_cms_levels_apply_their_summed_steps_every_block():
    T, d = 17, 3
    spec, x, g, out, st = _run("hope_cms", T, {"d_k": d})
    q, k, v = _l2n(x["q"][0, :, 0]), _l2n(x["k"][0, :, 0]), x["v"][0, :, 0]
    eye = torch.eye(d, dtype=DT)
    f = lambda u, a, b, c: _l2n(_l2n(u @ (eye + a)) @ (eye + b)) @ (eye + c)  # noqa: E731  (unit inputs of levels 2, 3)
    W = [torch.zeros(d, d, dtype=DT) for _ in range(3)]
    acc = [torch.zeros(d, d, dtype=DT) for _ in range(3)]
    every = (1, 4, 8)
    for t in range(T):
        grads = _grad(lambda a, b, c: 0.5 * ((f(k[t], a, b, c) - v[t]) ** 2).sum(), *W)
        for lvl in range(3):
            acc[lvl] = acc[lvl] + g[f"eta{lvl + 1}"][0, t, 0] * grads[lvl]
            if (t + 1) % every[lvl] == 0:   # theta <- theta - sum_t eta_t grad_t at the block's end
                W[lvl] = W[lvl] - acc[lvl]
                acc[lvl] = torch.zeros_like(acc[lvl])
        torch.testing.assert_close(out[t], f(q[t], *W), rtol=1e-10, atol=1e-12)
    for lvl in range(3):
        torch.testing.assert_close(st[f"W{lvl + 1}"], W[lvl], rtol=1e-10, atol=1e-12)
    assert float(st["W3"].abs().max()) > 0   # level 3 moved once, at token 7 (and again at 15)


def _lact_loop(x, g, params, C, T):
    """LaCT as its paper describes it: per chunk, apply (every token reads the weights the last
    chunk left), then update by the lr-weighted gradient sum of -<f(k), v>, then renormalise each
    weight to its initial input-side column norms."""
    q, k, v = (_l2n(F.silu(x["q"][0, :, 0])), _l2n(F.silu(x["k"][0, :, 0])), x["v"][0, :, 0])
    w0, w1, w2 = params["W0"][0], params["W1"][0], params["W2"][0]
    f = lambda u, a, b, c: (F.silu(u @ a) * (u @ c)) @ b  # noqa: E731

    def renorm(u, w):   # u's columns scaled to w's norms (the spec's l2norm: eps 1e-6 in the root)
        return u / torch.sqrt((u * u).sum(0) + 1e-6) * w.norm(dim=0)

    outs = []
    for s in range(0, T, C):
        e = min(s + C, T)
        outs.append(f(q[s:e], w0, w1, w2))
        if e - s < C:
            break
        lrs = [g[f"eta{i}"][0, s:e, 0] for i in range(3)]
        g0, g1, g2 = (_grad(lambda a, b, c, i=i: (lrs[i] * -(f(k[s:e], a, b, c) * v[s:e]).sum(-1)).sum(), w0, w1, w2)[i]
                      for i in range(3))
        w0, w1, w2 = renorm(w0 - g0, w0), renorm(w1 - g1, w1), renorm(w2 - g2, w2)
    return torch.cat(outs), (w0, w1, w2)


def test_lact_applies_then_updates_with_renormalised_swiglu_weights():
    T, C, dk, dv, hid = 11, 4, 3, 2, 4
    params = {"W0": _rand(1, dk, hid, seed=70), "W1": _rand(1, hid, dv, seed=71), "W2": _rand(1, dk, hid, seed=72)}
    spec, x, g, out, st = _run("lact", T, {"d_k": dk, "d_v": dv, "hidden": hid}, params=params,
                               schedule=("apply_update", C))
    want, (w0, w1, w2) = _lact_loop(x, g, params, C, T)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)
    for n, w in zip(("W0", "W1", "W2"), (w0, w1, w2)):
        torch.testing.assert_close(st[n], w, rtol=1e-10, atol=1e-12)
    # every input-side column keeps its initial norm, up to l2norm's eps: a factor
    # |u| / sqrt(|u|^2 + 1e-6) >= 1 - 1e-5 per chunk for the columns here (|u| > 0.25)
    for n in ("W0", "W1", "W2"):
        torch.testing.assert_close(st[n].norm(dim=0), params[n][0].norm(dim=0), rtol=2e-5, atol=0)


def test_apply_update_of_one_is_online():
    # LaCT reads before it writes (order read_write), so chunks of 1 are online learning exactly
    params = {"W0": _rand(1, 3, 4, seed=80), "W1": _rand(1, 4, 2, seed=81), "W2": _rand(1, 3, 4, seed=82)}
    dims = {"d_k": 3, "d_v": 2, "hidden": 4}
    _, _, _, a, sa = _run("lact", 6, dims, params=params, schedule=("apply_update", 1))
    _, _, _, b, sb = _run("lact", 6, dims, params=params, schedule="online")
    assert_same_function(a, b)
    for n in sa:
        assert_same_function(sa[n], sb[n])


def test_apply_update_sums_gradients_inside_newton_schulz():
    # Muon on the chunk update (LaCT's option): NS5 of the chunk's summed gradient, not a sum of NS5s
    spec = memspec.load(SPECS / "variants" / "lact_muon.yaml").with_dims(d_k=3, d_v=2, hidden=4)
    params = {"W0": _rand(1, 3, 4, seed=90), "W1": _rand(1, 4, 2, seed=91), "W2": _rand(1, 3, 4, seed=92)}
    x = {n: _rand(1, 4, 1, 3 if n != "v" else 2, seed=i) for i, n in enumerate("qkv")}
    g = {f"eta{i}": _gate(1, 4, 1, seed=95 + i) for i in range(3)}
    _, st = reference.run(spec, schedule=("apply_update", 4), params=params, **x, **g)
    q, k, v = (_l2n(F.silu(x["q"][0, :, 0])), _l2n(F.silu(x["k"][0, :, 0])), x["v"][0, :, 0])
    w0, w1, w2 = (params[n][0] for n in ("W0", "W1", "W2"))
    f = lambda u, a, b, c: (F.silu(u @ a) * (u @ c)) @ b  # noqa: E731
    g1 = _grad(lambda a, b, c: (g["eta1"][0, :, 0] * -(f(k, a, b, c) * v).sum(-1)).sum(), w0, w1, w2)[1]
    u = w1 - _ns(g1, LACT_NS)   # the authors' coefficient schedule
    torch.testing.assert_close(st["W1"][0, 0], u / torch.sqrt((u * u).sum(0) + 1e-6) * w1.norm(dim=0),
                               rtol=1e-9, atol=1e-12)


# ------------------------------------------------------------------ decisions and errors
EXPECTED = {   # spec -> (family, exact, chunk, admits, a line of the mini-batch / apply-update reasons)
    "atlas": ("minibatch", False, 16, ("minibatch", "online"), "window loss: the loss is a sum over the rows of K, V, G"),
    "omeganet": ("online", True, None, ("minibatch", "online"), "window loss: the loss is a sum over the rows of K, V"),
    "lact": ("apply_update", False, 64, ("online", "apply_update"), "one backward pass each"),
    "memora": ("minibatch", False, 16, ("minibatch", "online"), "W1 <- c1 * softmax(Z1, hidden) with Z1 (after the token)"),
    "hope_cms": ("online", True, None, ("minibatch", "online"), "a multiple of the chunk 4 (nested chunks)"),
    "titans_muon": ("minibatch", False, 64, ("minibatch", "online"),
                    "W1 <- (1 - alpha) * W1 - eta1 * newton_schulz(U1, 5) with U1 (after the token)"),
}


@pytest.mark.parametrize("name", NEW)
def test_schedule_decision_of_the_frontier_specs(name):
    spec = _spec(name)
    d = analyse(spec)
    fam, exact, chunk, admits, why = EXPECTED[name]
    assert (d.family, d.exact, d.chunk, d.admits) == (fam, exact, chunk, admits)
    approx = "apply_update" if fam == "apply_update" else "minibatch"
    _, reasons = BY_NAME[approx].analyse(Algebra(spec), d.chunks[approx])
    assert any(why in r for r in reasons), reasons
    text = explain(spec)
    if fam == "online":   # auto is exact: online, and explain says how to ask for mini-batch
        assert "ask for it with `schedule: minibatch(N)`" in text
    else:
        assert why in text


def test_hope_cms_mini_batch_nests_in_the_blocks():
    d = analyse(_spec("hope_cms"))
    assert d.chunks["minibatch"] == 4   # the gcd of the blocks (4, 8)
    bad = _spec("hope_cms").model_copy(update={"schedule": "minibatch(16)"})
    with pytest.raises(SpecError, match="a block of 4, 8 tokens is not a whole number of chunks of 16"):
        analyse(bad)


def test_apply_update_with_a_cache_is_a_located_error(tmp_path):
    p = tmp_path / "window_chunks.yaml"
    p.write_text("name: window_chunks\ndims: {d_model: 16, heads: 2, d_k: 4, d_v: 4}\n"
                 "views: {q: d_k, k: d_k, v: d_v}\ngates: {eta: sigmoid(logit)}\nstate:\n"
                 "  W: {shape: [d_k, d_v]}\n  K: {shape: [d_k], cache: true, window: 4}\n"
                 "  V: {shape: [d_v], cache: true, window: 4}\nmodel: f(u) = u @ W\n"
                 "loss: 0.5 * sum((f(K) - V)^2)\nupdate:\n  - K = append(K, k)\n  - V = append(V, v)\n"
                 "  - W = W - eta * grad(loss, W)\nread: f(q)\nschedule: apply_update(16)\n", encoding="utf-8")
    with pytest.raises(SpecError) as ei:
        analyse(memspec.load(p))
    (diag,) = ei.value.diagnostics
    assert (diag.code, diag.span.line, diag.span.col) == ("E-schedule", 16, 11)
    assert diag.hint.startswith("state K, V is a cache")


def test_window_rows_of_an_empty_and_a_partial_cache():
    # the first tokens see windows shorter than c: the band of _window_sums keeps only rows that exist
    g = torch.arange(1.0, 6.0, dtype=DT).reshape(1, 5, 1)      # rows 1..5, the last 3 the chunk's own
    got = helpers._window_sums(g, 3, 2)
    assert got.flatten().tolist() == [2 + 3, 3 + 4, 4 + 5]
    got = helpers._window_sums(g[:, 2:], 3, 8)                 # no row before the chunk
    assert got.flatten().tolist() == [3, 3 + 4, 3 + 4 + 5]


def test_two_key_value_writes_per_token():
    # titans-pytorch's num_kv_per_token: the loss of both pairs; compiled mini-batch = reference
    spec = memspec.load(SPECS / "variants" / "titans_two_kv.yaml")
    dims = {"d_model": 8, "heads": 2, "d_k": 3, "d_v": 2, "hidden": 4}
    torch.manual_seed(0)
    m = memspec.build(spec, compile=False, chunk=4, **dims).memory.to(DT)
    ins = {n: _rand(2, 6, 2, getattr(m, v.dim), seed=i) for i, (n, v) in enumerate(spec.views.items())}
    gates = {n: _gate(2, 6, 2, seed=20 + i) for i, n in enumerate(spec.gates)}
    params = {n: getattr(m, m_attr) for n, m_attr in (("W1", "W1_init"), ("W2", "W2_init"))}
    for schedule, ref_schedule in (("online", "online"), ("minibatch", ("minibatch", 4))):
        o, s = m(*[ins[v] for v in spec.views], **gates, schedule=schedule)
        ro, rs = reference.run(spec, dims=dims, schedule=ref_schedule, params=params, **ins, **gates)
        torch.testing.assert_close(o, ro, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(s["W2"], rs["W2"], rtol=1e-10, atol=1e-12)
    # one pair written twice is the same as the titans memory with its loss doubled
    one = {**ins, "k2": ins["k"], "v2": ins["v"]}
    _, two = reference.run(spec, dims=dims, params=params, **one, **gates)
    base = _spec("titans").model_copy(update={"loss": parse_expr("sum((f(kn) - vs)^2)")})
    _, ref = reference.run(base, dims=dims, params=params, **{n: ins[n] for n in "qkv"}, **gates)
    torch.testing.assert_close(two["W1"], ref["W1"], rtol=1e-12, atol=1e-14)


def test_diff_of_frequencies_schedules_and_new_functions():
    from memspec.tools.diff import Changed, diff
    a = _spec("hope_cms")
    b = a.model_copy(update={"state": {**a.state, "W3": a.state["W3"].model_copy(update={"every": 16})}})
    assert diff(a, b) == [Changed("state", ("state", "W3", "every"), 8, 16)]
    lact, muon = _spec("lact"), memspec.load(SPECS / "variants" / "lact_muon.yaml")
    edits = diff(lact, muon)
    changed = [e for e in edits if e.path[0] == "update"]
    assert len(changed) == 3 and all("newton_schulz" in str(e.new) for e in changed)


def test_readme_shows_omeganet_as_five_lines_on_deltanet():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = readme.split("```yaml\nextends: deltanet.yaml\n", 1)[1].split("```", 1)[0]
    lines = ["extends: deltanet.yaml"] + block.strip("\n").split("\n")
    assert len(lines) == 5
    shipped = (SPECS / "omeganet.yaml").read_text(encoding="utf-8").splitlines()
    assert all(line in shipped for line in lines)
    assert [ln.split(":")[0] for ln in shipped if ln and not ln.startswith(" ")] == \
        ["extends", "name", "description", "cite", "state", "loss", "update"]


@pytest.mark.slow
@pytest.mark.parametrize("name", NEW)
def test_torch_compile_equals_eager(name):
    """Every schedule of the six modules under torch.compile (static shapes, compiled per-token
    and per-chunk steps) gives the eager numbers."""
    import sys
    sys.path.insert(0, str(ROOT / "tests"))
    from _compiled_harness import call, inputs, load, make, small_dims

    spec = load(f"specs/{name}.yaml")
    dims = small_dims(spec)
    eager = make(spec, dims, dtype=torch.float32)
    comp = make(spec, dims, dtype=torch.float32, compile=True)
    comp.load_state_dict(eager.state_dict())
    ins = inputs(spec, eager, T=12, dtype=torch.float32)
    for schedule in eager.SCHEDULES:
        with torch.no_grad():
            a, _ = call(eager, spec, ins, None, schedule)
            b, _ = call(comp, spec, ins, None, schedule)
        # float32 from two code paths (inductor's fused kernels order sums otherwise); five Newton-Schulz
        # steps amplify the rounding (measured up to 1.4e-5 absolute on outputs of order 0.04)
        tol = 5e-5 if "newton_schulz" in (ROOT / f"specs/{name}.yaml").read_text() else 1e-5
        torch.testing.assert_close(b, a, atol=tol, rtol=tol)


def test_a_module_with_apply_update_and_minibatch_runs_both():
    """A spec asking for apply_update(C) that also admits minibatch carries both schedules: each
    family writes its own chunk methods (they had shared the name _chunk_step), and each
    schedule's numbers are the reference's."""
    from _compiled_harness import call, initial_state, inputs, make, reference_run, rel_err, small_dims

    text = (ROOT / "specs" / "ttt_linear.yaml").read_text().replace("schedule: minibatch(16)",
                                                                     "schedule: apply_update(4)")
    assert "apply_update(4)" in text
    spec = memspec.loads(text)
    dims = small_dims(spec)
    m = make(spec, dims)
    assert {"minibatch", "apply_update"} <= set(m.SCHEDULES)
    ins, st = inputs(spec, m), initial_state(spec, m)
    for schedule in ("minibatch", "apply_update"):
        with torch.no_grad():
            o, _ = call(m, spec, ins, dict(st), schedule)
            ro, _ = reference_run(spec, m, dims, schedule, st, ins)
        assert rel_err(o, ro) <= 1e-9, schedule


@pytest.mark.parametrize("name", NEW)
def test_the_oracle_runs_each_batch_row_and_head_alone(name):
    """The hand-written checks above run one batch row and one head; here a (row, head) of a
    B = 2, H = 2 reference run (online and the spec's schedule) equals the run of that row and head
    alone, for another head and another row: no mixing across rows or heads, so those checks cover
    every series of a batch."""
    spec = _spec(name)
    T, B, H = 9, 2, 2
    views = {n: _rand(B, T, H, spec.dims[v.dim], seed=i) for i, (n, v) in enumerate(spec.views.items())}
    gates = {n: _gate(B, T, H, seed=10 + i) for i, n in enumerate(spec.gates)}
    # random initial states drawn once (the reference draws a fresh [H, ...] per call otherwise)
    init = reference.init_state(spec, B, H, dtype=DT, generator=torch.Generator().manual_seed(5))
    for schedule in ("online", spec.schedule):
        out, st = reference.run(spec, schedule=schedule, state=init, **views, **gates)
        for b, h in ((0, 1), (1, 0)):      # another head of row 0, another row of head 0
            one = {n: x[b:b + 1, :, h:h + 1] for n, x in {**views, **gates}.items()}
            s0 = {n: x[b:b + 1, h:h + 1] for n, x in init.items()}
            o1, s1 = reference.run(spec, schedule=schedule, state=s0, **one)
            torch.testing.assert_close(out[b:b + 1, :, h:h + 1], o1, rtol=1e-12, atol=1e-12)
            for key in st:
                torch.testing.assert_close(st[key][b:b + 1, h:h + 1], s1[key], rtol=1e-12, atol=1e-12)


CHANGED_BEFORE_A_GRADIENT = {
    "apply_update": ('name: two_steps\ndims: {d_model: 16, heads: 2, d_k: 4, d_v: 4}\nviews: {q: d_k, k: d_k, v: d_v}\ngates: {eta: sigmoid(logit)}\nstate:\n  W: {shape: [d_k, d_v]}\nmodel: f(u) = u @ W\nloss: 0.5 * sum((f(k) - v)^2)\nupdate:\n  - W = W - eta * grad(loss, W)\n  - W = W - eta * grad(loss, W)\nread: f(q)\nschedule: apply_update(16)\n', "statement 2 takes a gradient after W changed within the token"),
    "window": ('name: decayed_window\ndims: {d_model: 16, heads: 2, d_k: 4, d_v: 4}\nviews: {q: d_k, k: d_k, v: d_v}\ngates: {eta: sigmoid(logit)}\nstate:\n  W: {shape: [d_k, d_v]}\n  K: {shape: [d_k], cache: true, window: 4}\n  V: {shape: [d_v], cache: true, window: 4}\nmodel: f(u) = u @ W\nloss: 0.5 * sum((f(K) - V)^2)\nupdate:\n  - K = append(K, k)\n  - V = append(V, v)\n  - W = 0.9 * W\n  - W = W - eta * grad(loss, W)\nread: f(q)\nschedule: minibatch(16)\n', "W changes before a gradient of the window loss is taken"),
    "block": ('name: block_twice\ndims: {d_model: 16, heads: 2, d_k: 4, d_v: 4}\nviews: {q: d_k, k: d_k, v: d_v}\ngates: {eta: sigmoid(logit)}\nstate:\n  W: {shape: [d_k, d_v], every: 4}\n  M: {shape: [d_k, d_v]}\nmodel: f(u) = u @ W + u @ M\nloss: 0.5 * sum((f(k) - v)^2)\nupdate:\n  - W = W - eta * grad(loss, W)\n  - M = M - eta * grad(loss, M)\nread: f(q)\nschedule: minibatch(4)\n', "a gradient is taken after W's block update in the token (take the gradients first)"),
}


@pytest.mark.parametrize("case", sorted(CHANGED_BEFORE_A_GRADIENT))
def test_a_state_changed_before_a_gradient_refuses_the_chunk_schedule(case, tmp_path):
    """A chunk's gradients are all taken at its start: apply_update, a window loss's mini-batch and
    nested blocks refuse a program that changes a state the loss reads before a later gradient of
    the token, with a located error that names the statement or state."""
    text, why = CHANGED_BEFORE_A_GRADIENT[case]
    p = tmp_path / f"{case}.yaml"
    p.write_text(text, encoding="utf-8")
    with pytest.raises(SpecError) as ei:
        analyse(memspec.load(p))
    (diag,) = ei.value.diagnostics
    assert diag.code == "E-schedule" and diag.span.line == text.count("\n") and why in diag.hint


@pytest.mark.parametrize("variant", ["lact_muon", "titans_muon_chunked", "lact_swa"])
def test_apply_update_variants_compiled_equal_the_reference(variant):
    """The shipped apply_update variants (rows of a chunk as matrix products, closed-form
    gradients, Newton-Schulz on the chunk's sums): outputs, states and every gradient equal the
    reference interpreter's apply_update schedule in float64, over two chunks and a partial one."""
    from _compiled_harness import call, initial_state, inputs, make, reference_run, small_dims
    spec = memspec.load(SPECS / "variants" / f"{variant}.yaml")
    dims = small_dims(spec)
    m = make(spec, dims, chunk=4)
    ins = inputs(spec, m, T=10, requires_grad=True)
    st = initial_state(spec, m)
    o, fs = call(m, spec, ins, dict(st), "apply_update")
    ro, rs = reference_run(spec, m, dims, "apply_update", st, ins)
    torch.testing.assert_close(o, ro, rtol=1e-9, atol=1e-11)
    for n in fs:
        if not n.startswith("every."):
            torch.testing.assert_close(fs[n], rs[n], rtol=1e-9, atol=1e-11)
    leaves = list(ins.values()) + [p for p in m.parameters() if p.requires_grad]
    got = torch.autograd.grad(o.square().sum(), leaves, allow_unused=True)
    want = torch.autograd.grad(ro.square().sum(), leaves, allow_unused=True)
    for a, b in zip(got, want):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)


def _saved_bytes(fn):
    """The bytes autograd saves for the backward while ``fn`` runs (checkpointed regions save their
    inputs only), and fn's result."""
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return total[0], out


@pytest.mark.parametrize("name, schedule, T", [("titans_muon", "minibatch", 16), ("memora", "minibatch", 16),
                                               ("atlas", "minibatch", 16), ("hope_cms", "online", 150),
                                               ("omeganet", "online", 150)])
def test_checkpointed_chunks_keep_no_per_token_state_and_give_the_same_gradients(name, schedule, T):
    # the materialising mini-batch chunk step, and the online loop in segments of 64 tokens, under
    # torch.utils.checkpoint: same outputs, states and gradients as keeping every token's state;
    # autograd saves far fewer bytes (the per-token states are recomputed in the backward)
    spec = _spec(name)
    dims = {d: n for d, n in {"d_model": 8, "heads": 2, "d_k": 4, "d_v": 4, "hidden": 6}.items() if d in spec.dims}
    runs = {}
    for checkpoint in (True, False, None):   # None (the default): only past 256 tokens
        torch.manual_seed(0)
        m = memspec.build(spec, compile=False, chunk=4, **dims).memory.to(DT)
        m.checkpoint = checkpoint
        ins = {n: _rand(1, T, 2, getattr(m, v.dim), seed=i).requires_grad_() for i, (n, v) in enumerate(spec.views.items())}
        gates = {n: _gate(1, T, 2, seed=20 + i).requires_grad_() for i, n in enumerate(spec.gates)}
        saved, (o, s) = _saved_bytes(lambda: m(*ins.values(), **gates, schedule=schedule))
        loss = o.square().sum() + sum(x.square().sum() for x in s.values() if torch.is_tensor(x))
        leaves = [*ins.values(), *gates.values(), *m.parameters()]
        loss.backward()   # (a reentrant checkpoint takes .backward(), not torch.autograd.grad)
        runs[checkpoint] = (saved, o.detach(), s, [x.grad for x in leaves])
    (saved_ck, o_ck, s_ck, g_ck), (saved, o, s, g) = runs[True], runs[False]
    assert runs[None][0] == saved   # T <= 256: the default keeps the states
    assert_same_function(o_ck, o)
    assert s_ck.keys() == s.keys()
    for k in s:
        if torch.is_tensor(s[k]):
            assert_same_function(s_ck[k], s[k])
        else:   # a position in the blocks
            assert s_ck[k] == s[k]
    for a, b in zip(g_ck, g):   # float64; the recomputed chunks' backward adds in another order
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
    assert saved_ck * 4 < saved, (saved_ck, saved)
