"""The shipped specs in ``specs/``: YAML and `.mem` agree, ``fmt`` is the identity on
the committed files, ``memspec check`` is clean, and each paper spec computes what its
paper defines (checked against independent PyTorch formulas through the reference
interpreter, at tiny sizes).
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import memspec
from memspec.tools.cli import main
from memspec.lang.fmt import to_mem, to_yaml

SPECS = Path(__file__).resolve().parent.parent / "specs"
PAPER_SPECS = [
    "linear_attention", "deltanet", "gated_deltanet", "longhorn", "mesa", "ttt_linear", "ttt_mlp",
    "titans", "titans_mac", "titans_mag", "titans_mal", "moneta", "yaad", "softmax_attention",
    "sliding_window_attention",
    # memories linear in their state: each also matched against its peer's recurrence in
    # tests/test_peer_references.py
    "gla", "rwkv6", "hgrn2", "retention", "mamba2", "kda", "gdn2", "comba", "rwkv7", "gated_deltaproduct",
    "momentum_deltanet", "deltanet_textbook",
    # the 2025-26 frontier: each also matched against its paper's equations in tests/test_frontier.py
    "atlas", "omeganet", "lact", "memora", "hope_cms", "titans_muon",
]
ALL_SPECS = sorted(p.stem for p in SPECS.glob("*.yaml"))


def _extends(name: str) -> bool:
    return any(line.startswith(("extends:", "extends ")) for line in
               (SPECS / f"{name}.yaml").read_text().splitlines() + (SPECS / f"{name}.mem").read_text().splitlines())


def test_every_paper_spec_is_shipped_in_both_formats():
    for name in PAPER_SPECS:
        assert (SPECS / f"{name}.yaml").is_file(), name
        assert (SPECS / f"{name}.mem").is_file(), name
    # every YAML spec has its .mem twin and the other way round
    assert sorted(p.stem for p in SPECS.glob("*.mem")) == ALL_SPECS


@pytest.mark.parametrize("name", ALL_SPECS)
def test_yaml_and_mem_give_equal_specs(name):
    a = memspec.load(SPECS / f"{name}.yaml")
    b = memspec.load(SPECS / f"{name}.mem")
    assert a == b
    assert a.name == name


@pytest.mark.parametrize("name", ALL_SPECS)
@pytest.mark.parametrize("fmt", ["yaml", "mem"])
def test_committed_file_is_canonical(name, fmt):
    path = SPECS / f"{name}.{fmt}"
    spec = memspec.load(path)
    text = to_yaml(spec) if fmt == "yaml" else to_mem(spec)
    if _extends(name):
        # a variant is written short (extends ...); fmt prints the resolved spec, and the
        # resolved text round-trips exactly
        assert "extends" not in text
        again = memspec.loads(text, fmt)
        assert again == spec
        assert (to_yaml(again) if fmt == "yaml" else to_mem(again)) == text
    else:
        assert path.read_text(encoding="utf-8") == text


@pytest.mark.parametrize("name", ALL_SPECS)
def test_round_trip_both_ways(name):
    spec = memspec.load(SPECS / f"{name}.yaml")
    y, m = to_yaml(spec), to_mem(spec)
    from_y, from_m = memspec.loads(y, "yaml"), memspec.loads(m, "mem")
    assert from_y == spec == from_m
    assert to_yaml(from_m) == y  # .mem -> Spec -> YAML is the same canonical YAML
    assert to_mem(from_y) == m


@pytest.mark.parametrize("name", PAPER_SPECS)
def test_metadata_and_gate_names(name):
    spec = memspec.load(SPECS / f"{name}.yaml")
    assert len(spec.description) > 80 and spec.cite
    # eta (step), mu (momentum), alpha (forget: keeps 1 - alpha); a spec with several step sizes
    # numbers or subscripts them (DeltaProduct's eta1, eta2; GDN-2's erase / write gates eta_k, eta_v);
    # Atlas' window weights are its gamma
    assert all(re.fullmatch(r"(eta|mu|alpha|gamma)(\d|_[kv])?", g) for g in spec.gates), sorted(spec.gates)
    assert spec.dims["d_model"] == 256 and spec.dims["heads"] == 4 and spec.dims["d_k"] == 64


def test_memspec_check_is_clean(capsys):
    files = sorted(str(p) for p in SPECS.glob("*.yaml")) + sorted(str(p) for p in SPECS.glob("*.mem"))
    assert main(["check", *files]) == 0
    out, err = capsys.readouterr()
    assert err == ""  # no errors and no warnings
    assert out.count(": ok") == len(files)


def test_fmt_cli_is_identity_on_shipped_files(capsys):
    for name in ["deltanet", "titans", "softmax_attention"]:
        for fmt in ["yaml", "mem"]:
            path = SPECS / f"{name}.{fmt}"
            assert main(["fmt", str(path)]) == 0
            assert capsys.readouterr().out == path.read_text(encoding="utf-8")
    # a variant converted to the other format is the resolved spec
    assert main(["fmt", str(SPECS / "titans_mac.yaml"), "--to", "mem"]) == 0
    out = capsys.readouterr().out
    assert memspec.loads(out, "mem") == memspec.load(SPECS / "titans_mac.mem")


def test_titans_variants_only_change_metadata_and_wiring():
    base = memspec.load(SPECS / "titans.yaml")
    expected = {"titans_mac": ("mac", 128, 64, 16), "titans_mag": ("mag", 64, 128, 16),
                "titans_mal": ("mal", 64, 128, 16)}
    for name, (kind, segment, window, persistent) in expected.items():
        v = memspec.load(SPECS / f"{name}.yaml")
        w = v.wiring
        assert (w.kind, w.segment, w.window, w.persistent) == (kind, segment, window, persistent)
        same = v.model_copy(update={"name": base.name, "description": base.description,
                                    "cite": base.cite, "wiring": base.wiring})
        assert same == base


# ------------------------------------------------------------------ the papers' math
B, T, H, D = 2, 5, 2, 4
DIMS = {"d_k": D, "d_v": D}


def _spec(name: str):
    return memspec.load(SPECS / f"{name}.yaml")


def _views(seed: int, dims=(D, D, D)):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(B, T, H, d, generator=g, dtype=torch.float64) for n, d in zip("qkv", dims)}


def _gate(seed: int, lo=0.1, hi=0.9):
    g = torch.Generator().manual_seed(seed)
    return lo + (hi - lo) * torch.rand(B, T, H, generator=g, dtype=torch.float64)


def _run(name, dims=DIMS, **kw):
    from memspec.reference import run

    return run(_spec(name), dims=dims, **kw)


def _l2n(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def test_linear_attention_is_the_normalised_kernel_sum():
    x = _views(0)
    out, st = _run("linear_attention", **x)
    phi = lambda t: F.elu(t) + 1  # noqa: E731
    qf, kf = phi(x["q"]), phi(x["k"])
    S = torch.cumsum(torch.einsum("bthi,bthj->bthij", kf, x["v"]), dim=1)  # causal, current included
    z = torch.cumsum(kf, dim=1)
    want = torch.einsum("bthi,bthij->bthj", qf, S) / (torch.einsum("bthi,bthi->bth", qf, z)[..., None] + 1e-6)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(st["S"], S[:, -1], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(st["z"], z[:, -1], rtol=1e-10, atol=1e-10)


def _delta_loop(x, beta, keep=None):
    """The (gated) delta rule in the papers' form, S_t = a_t S (I - b k k^T) + b k^T v (row vectors)."""
    q, k, v = _l2n(x["q"]), _l2n(x["k"]), x["v"]
    S = torch.zeros(B, H, D, D, dtype=torch.float64)
    eye = torch.eye(D, dtype=torch.float64)
    outs = []
    for t in range(T):
        kt, vt, b = k[:, t], v[:, t], beta[:, t, :, None, None]
        a = 1.0 if keep is None else keep[:, t, :, None, None]
        S = (eye - b * kt[..., :, None] * kt[..., None, :]) @ (a * S) + b * kt[..., :, None] * vt[..., None, :]
        outs.append(torch.einsum("bhi,bhij->bhj", q[:, t], S))
    return torch.stack(outs, 1), S


def test_deltanet_is_the_delta_rule():
    x, eta = _views(1), _gate(2)
    out, st = _run("deltanet", eta=eta, **x)
    want, S = _delta_loop(x, eta)
    torch.testing.assert_close(out, want, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(st["W"], S, rtol=1e-9, atol=1e-10)


def test_gated_deltanet_decays_before_the_delta_step():
    x, eta, alpha = _views(3), _gate(4), _gate(5, 0.05, 0.5)
    out, st = _run("gated_deltanet", eta=eta, alpha=alpha, **x)
    want, S = _delta_loop(x, eta, keep=1 - alpha)
    torch.testing.assert_close(out, want, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(st["W"], S, rtol=1e-9, atol=1e-10)
    # the gate formula gives a retention exp(-softplus(logit)); bias -4 keeps ~98%
    g = _spec("gated_deltanet").gates["alpha"]
    assert str(g.formula) == "1 - exp(-softplus(logit))" and g.bias == -4.0
    assert math.exp(-math.log1p(math.exp(g.bias))) == pytest.approx(0.98201, abs=1e-5)  # kept at start


def test_longhorn_is_the_implicit_step():
    """W_t minimises |W - W_{t-1}|^2/2 + eta |k W - v|^2/2: its gradient there is zero."""
    x, eta = _views(6), _gate(7)
    g = torch.Generator().manual_seed(8)
    W0 = torch.randn(B, H, D, D, generator=g, dtype=torch.float64)
    from memspec.reference import run

    spec = _spec("longhorn")
    W = W0
    for t in range(T):
        one = {n: x[n][:, t:t + 1] for n in "qkv"}
        out, st = run(spec, dims=DIMS, state={"W": W}, eta=eta[:, t:t + 1], **one)
        W1, k, v, e = st["W"], one["k"][:, 0], one["v"][:, 0], eta[:, t, :, None, None]
        resid = torch.einsum("bhi,bhij->bhj", k, W1) - v
        opt = (W1 - W) + e * k[..., :, None] * resid[..., None, :]
        assert opt.abs().max() < 1e-12
        torch.testing.assert_close(out[:, 0], torch.einsum("bhi,bhij->bhj", one["q"][:, 0], W1))
        W = W1


def test_mesa_reads_the_ridge_regression_solution():
    """With eta = 1 and alpha = 0, o_t = q argmin_W sum_s |k_s W - v_s|^2 + lam |W|^2."""
    x = _views(9)
    ones, zeros = torch.ones(B, T, H, dtype=torch.float64), torch.zeros(B, T, H, dtype=torch.float64)
    out, _ = _run("mesa", eta=ones, alpha=zeros, **x)
    lam = _spec("mesa").constants["lam"]
    q, k, v = _l2n(x["q"]), _l2n(x["k"]), x["v"]
    for t in range(T):
        A = torch.cat([k[:, : t + 1], math.sqrt(lam) * torch.eye(D, dtype=torch.float64)[:, None, :].expand(B, D, H, D)], 1)
        Y = torch.cat([v[:, : t + 1], torch.zeros(B, D, H, D, dtype=torch.float64)], 1)
        Wstar = torch.linalg.lstsq(A.transpose(1, 2), Y.transpose(1, 2)).solution  # [B, H, D, D]
        torch.testing.assert_close(out[:, t], torch.einsum("bhi,bhij->bhj", q[:, t], Wstar), rtol=1e-8, atol=1e-9)
    # with forgetting and an input gate: H, G are the gated, decayed sums
    eta, alpha = _gate(10), _gate(11, 0.0, 0.3)
    out, st = _run("mesa", eta=eta, alpha=alpha, **x)
    Hs = torch.zeros(B, H, D, D, dtype=torch.float64)
    Gs = torch.zeros(B, H, D, D, dtype=torch.float64)
    for t in range(T):
        a, e = (1 - alpha[:, t])[..., None, None], eta[:, t][..., None, None]
        Hs = a * Hs + e * k[:, t, :, :, None] * k[:, t, :, None, :]
        Gs = a * Gs + e * k[:, t, :, :, None] * v[:, t, :, None, :]
    torch.testing.assert_close(st["H"], Hs)
    torch.testing.assert_close(st["G"], Gs)


def _ln(x, w, b):
    return F.layer_norm(x, x.shape[-1:], eps=1e-5) * w + b


def test_ttt_linear_is_minibatch_gd_on_the_v_minus_k_target():
    """Paper form: f_res(k) = LN(k W) reconstructs v - k; gradients of a mini-batch at its start."""
    x, eta = _views(12), _gate(13, 0.01, 0.2)
    g = torch.Generator().manual_seed(14)
    W0 = 0.3 * torch.randn(H, D, D, generator=g, dtype=torch.float64)
    lw = 1 + 0.1 * torch.randn(H, D, generator=g, dtype=torch.float64)
    lb = 0.1 * torch.randn(H, D, generator=g, dtype=torch.float64)
    b0 = 0.1 * torch.randn(H, D, generator=g, dtype=torch.float64)
    C = 3
    out, st = _run("ttt_linear", dims={"d_k": D}, schedule=("minibatch", C),
                   params={"W": W0, "b": b0, "ln_w": lw, "ln_b": lb}, eta=eta, **x)
    assert _spec("ttt_linear").schedule == "minibatch(16)"
    W, b = W0.expand(B, H, D, D).clone(), b0.expand(B, H, D).clone()
    for t in range(T):
        if t % C == 0:
            Ws, bs = W.clone(), b.clone()
        Wr, br = Ws.clone().requires_grad_(), bs.clone().requires_grad_()
        # the paper's loss: the non-residual part reconstructs v - k; both gradients at the chunk start
        loss = 0.5 * ((_ln(torch.einsum("bhi,bhij->bhj", x["k"][:, t], Wr) + br, lw, lb)
                       - (x["v"][:, t] - x["k"][:, t])) ** 2).sum()
        gW, gb = torch.autograd.grad(loss, (Wr, br))
        W = W - eta[:, t, :, None, None] * gW
        b = b - eta[:, t, :, None] * gb
        q = x["q"][:, t]
        want = q + _ln(torch.einsum("bhi,bhij->bhj", q, W) + b, lw, lb)
        torch.testing.assert_close(out[:, t], want, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(st["W"], W)
    torch.testing.assert_close(st["b"], b)


def _simultaneous_steps(p: dict, loss_of, order, step):
    """The papers' step (online): every gradient at the same tensors, then every tensor steps."""
    leaves = {n: p[n].clone().requires_grad_() for n in order}
    grads = torch.autograd.grad(loss_of({**p, **leaves}), [leaves[n] for n in order])
    return {**p, **{n: step(n, p[n], gr) for n, gr in zip(order, grads)}}


def test_ttt_mlp_online_steps_match_autograd():
    x, eta = _views(15), _gate(16, 0.01, 0.2)
    hidden = 6
    g = torch.Generator().manual_seed(17)
    init = {"W1": 0.3 * torch.randn(H, D, hidden, generator=g, dtype=torch.float64),
            "b1": 0.1 * torch.randn(H, hidden, generator=g, dtype=torch.float64),
            "W2": 0.3 * torch.randn(H, hidden, D, generator=g, dtype=torch.float64),
            "b2": 0.1 * torch.randn(H, D, generator=g, dtype=torch.float64)}
    out, st = _run("ttt_mlp", dims={"d_k": D, "hidden": hidden}, schedule="online", params=init, eta=eta, **x)
    ones, zeros = torch.ones(H, D, dtype=torch.float64), torch.zeros(H, D, dtype=torch.float64)

    def f(u, p):
        h = F.gelu(torch.einsum("bhi,bhij->bhj", u, p["W1"]) + p["b1"])
        return u + _ln(torch.einsum("bhi,bhij->bhj", h, p["W2"]) + p["b2"], ones, zeros)

    p = {n: t.expand(B, *t.shape).clone() for n, t in init.items()}
    for t in range(T):
        e = eta[:, t]
        p = _simultaneous_steps(
            p, lambda pp: 0.5 * ((f(x["k"][:, t], pp) - x["v"][:, t]) ** 2).sum(), ["W1", "b1", "W2", "b2"],
            lambda n, w, gr: w - e.reshape(B, H, *([1] * (gr.dim() - 2))) * gr)
        torch.testing.assert_close(out[:, t], f(x["q"][:, t], p), rtol=1e-9, atol=1e-10)
    for n in init:
        torch.testing.assert_close(st[n], p[n])


def _plain_mlp(u, W1, W2):
    return torch.einsum("bhi,bhij->bhj", F.gelu(torch.einsum("bhi,bhij->bhj", u, W1)), W2)


def _mlp_unit_hidden(u, W1, W2):
    """The MLP memory with an l2-normalised hidden layer (titans, moneta: their bounded step)."""
    h = F.gelu(torch.einsum("bhi,bhij->bhj", u, W1))
    return torch.einsum("bhi,bhij->bhj", h / torch.sqrt((h * h).sum(-1, keepdim=True) + 1e-6), W2)


def _mlp_memory_check(name, loss_fn, gates, momentum, qk, vv, schedule="online", model=None):
    """Run the spec and a hand-written loop of its recurrence, on a 2-layer MLP memory
    (``model``: the memory's function, default the plain MLP).

    ``schedule="spec"`` (mini-batch 64, so T tokens are one chunk): Titans' gradients are
    all taken at the chunk start."""
    hidden = 5
    x = _views(20)
    g = torch.Generator().manual_seed(21)
    W1 = 0.5 * torch.randn(H, D, hidden, generator=g, dtype=torch.float64)
    W2 = 0.5 * torch.randn(H, hidden, D, generator=g, dtype=torch.float64)
    out, st = _run(name, dims={"d_k": D, "d_v": D, "hidden": hidden}, schedule=schedule,
                   params={"W1": W1, "W2": W2}, **gates, **x)
    q, k, v = qk(x["q"]), qk(x["k"]), vv(x["v"])
    _mlp = model or _plain_mlp
    p = {"W1": W1.expand(B, H, D, hidden).clone(), "W2": W2.expand(B, H, hidden, D).clone()}
    u1, u2 = torch.zeros_like(p["W1"]), torch.zeros_like(p["W2"])
    start = dict(p)
    for t in range(T):
        e = gates["eta"][:, t][..., None, None]
        keep = 1 - gates["alpha"][:, t][..., None, None]
        loss_of = lambda pp: loss_fn(_mlp(k[:, t], pp["W1"], pp["W2"]), v[:, t])  # noqa: E731
        if momentum:  # Titans: both gradients at the old memory, then decay + momentum
            at = p if schedule == "online" else start
            a1, a2 = at["W1"].clone().requires_grad_(), at["W2"].clone().requires_grad_()
            g1, g2 = torch.autograd.grad(loss_of({"W1": a1, "W2": a2}), (a1, a2))
            m = gates["mu"][:, t][..., None, None]
            u1, u2 = m * u1 - e * g1, m * u2 - e * g2
            p = {"W1": keep * p["W1"] + u1, "W2": keep * p["W2"] + u2}
        else:
            p = _simultaneous_steps(p, loss_of, ["W1", "W2"], lambda n, w, gr: keep * w - e * gr)
        torch.testing.assert_close(out[:, t], _mlp(q[:, t], p["W1"], p["W2"]), rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(st["W1"], p["W1"])
    torch.testing.assert_close(st["W2"], p["W2"])


@pytest.mark.parametrize("schedule", ["online", "spec"])
def test_titans_momentum_and_forgetting(schedule):
    assert _spec("titans").schedule == "minibatch(64)"
    gates = {"eta": _gate(22), "mu": _gate(23), "alpha": _gate(24, 0.0, 0.3)}
    _mlp_memory_check("titans", lambda p, v: 0.5 * ((p - v) ** 2).sum(), gates, True,
                      lambda t: _l2n(F.silu(t)), F.silu, schedule, model=_mlp_unit_hidden)


def test_moneta_lp_loss():
    assert _spec("moneta").constants["p"] == 3.0
    gates = {"eta": _gate(25), "alpha": _gate(26, 0.0, 0.3)}
    _mlp_memory_check("moneta", lambda p, v: ((p - v).abs() ** 3).sum(), gates, False, _l2n, lambda t: t,
                      model=_mlp_unit_hidden)


def test_yaad_huber_loss():
    delta = _spec("yaad").constants["delta"]
    gates = {"eta": _gate(27), "alpha": _gate(28, 0.0, 0.3)}
    _mlp_memory_check("yaad", lambda p, v: F.huber_loss(p, v, reduction="sum", delta=delta), gates, False,
                      _l2n, lambda t: t)


def test_titans_scalar_step_of_the_seed_text():
    """Seed text §5.2: W = 2, U = 0.2, g = -0.4, mu = 0.5, eta = 0.1, alpha = 0.1 -> U = 0.14, W = 1.94,
    computed with the titans update program (gradient taken at the old memory)."""
    spec = _spec("titans")
    upd = [str(s) for s in spec.update]
    assert upd == ["U1 = mu * U1 - eta * grad(loss, W1)", "U2 = mu * U2 - eta * grad(loss, W2)",
                   "W1 = (1 - alpha) * W1 + U1", "W2 = (1 - alpha) * W2 + U2"]
    W, U, g, mu, eta, alpha = 2.0, 0.2, -0.4, 0.5, 0.1, 0.1
    U = mu * U - eta * g
    W = (1 - alpha) * W + U
    assert (round(U, 10), round(W, 10)) == (0.14, 1.94)


def test_softmax_attention_is_causal_sdpa():
    x = _views(30)
    out, st = _run("softmax_attention", **x)
    q, k, v = (x[n].transpose(1, 2) for n in "qkv")  # [B, H, T, D]
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
    torch.testing.assert_close(out, want, rtol=1e-9, atol=1e-10)
    assert st["K"].shape == (B, H, T, D)


def test_sliding_window_attention_keeps_the_last_window():
    spec = _spec("sliding_window_attention")
    assert spec.state["K"].window == spec.state["V"].window == 512
    small = memspec.loads(to_yaml(spec).replace("window: 512", "window: 2"), "yaml")
    from memspec.reference import run

    x = _views(31)
    out, st = run(small, dims=DIMS, **x)
    q, k, v = (x[n].transpose(1, 2) for n in "qkv")
    i = torch.arange(T)
    mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - 2)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)
    torch.testing.assert_close(out, want, rtol=1e-9, atol=1e-10)
    assert st["K"].shape == (B, H, 2, D)
    full, _ = run(spec, dims=DIMS, **x)  # T < 512: the same as full causal attention
    torch.testing.assert_close(full, F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2))


def test_textbook_delta_rule_is_deltanet():
    """The explicit §3.3 form W + eta outer(kn, v - kn @ W) and DeltaNet's W - eta grad(loss, W)
    are the same memory: the same outputs and state token by token."""
    x = _views(7)
    eta = _gate(8)
    a, sa = _run("deltanet_textbook", eta=eta, **x)
    b, sb = _run("deltanet", eta=eta, **x)
    assert torch.allclose(a, b, atol=1e-12, rtol=0) and torch.allclose(sa["W"], sb["W"], atol=1e-12, rtol=0)
