"""The generator: emitter output, recurrence extraction, generated text (goldens = compiled/),
determinism, the CLI, build(), runtime validation and torch.compile."""
from __future__ import annotations

import ast
import traceback

import pytest
import torch

import memspec
from memspec.pipeline.build import build, build_memory, source
from memspec.tools.cli import main
from memspec.codegen import ExprEmitter
from memspec.schedule.recurrence import NotRecurrence, minibatch_recurrence
from memspec.lang.expr import parse_expr, unparse

from _compiled_harness import ROOT, SPEC_FILES, call, inputs, load, make, small_dims

TOY = """
name: toy
dims: {d_model: 8, heads: 2, d_k: 4, d_v: 3}
constants: {lam: 0.1}
views: {q: d_k, k: d_k, v: d_v}
gates: {eta: sigmoid(logit), alpha: {formula: sigmoid(logit), bias: -3.0}}
params: {ln_w: {shape: [d_v], init: ones}}
state: {W: {shape: [d_k, d_v]}}
model: f(u) = u @ W
loss: 0.5 * sum((f(k) - v)^2)
update: ["W = (1 - alpha) * W", "W = W - eta * grad(loss, W)"]
read: f(q) * ln_w
"""


@pytest.fixture(autouse=True)
def _at_root(monkeypatch):
    monkeypatch.chdir(ROOT)


# ------------------------------------------------------------------ emitter
@pytest.mark.parametrize("text,code", [
    ("l2norm(k) * eta", "l2norm(k) * eta[..., None]"),
    ("eta * outer(k, v)", "eta[..., None, None] * (k.unsqueeze(-1) * v.unsqueeze(-2))"),
    ("(1 - alpha) * W - eta * grad(loss, W)", "(1 - alpha)[..., None, None] * W - eta[..., None, None] * g_W"),
    ("f(q) * ln_w", "self.f(q, W) * self.ln_w"),
    ("-d_k^(-0.5)", "-self.d_k ** -0.5"),
    ("q @ solve(W @ W.T + lam * eye(d_k), W)",
     "(torch.linalg.solve(W @ W.transpose(-2, -1) + 0.1 * torch.eye(self.d_k, dtype=q.dtype, device=q.device), "
     "q.unsqueeze(-2), left=False) @ W).squeeze(-2)"),   # v A^-1: one right-hand side, not W's columns
    ("max(k, 0)", "k.clamp(min=0)"),
    ("huber(v - f(k), eta)", "huber(v - self.f(k, W), eta[..., None])"),
    ("sum(W^2)", "(W ** 2).sum((-2, -1))"),
    ("k @ k", "(k * k).sum(-1)"),
    ("W @ v", "(W @ v.unsqueeze(-1)).squeeze(-1)"),
    ("(-eta)^2", "(-eta) ** 2"),
])
def test_emitter(text, code):
    spec = memspec.loads(TOY)
    em = ExprEmitter(spec, grads={"grad(loss, W)": "g_W"}, like="q")
    assert em.emit(parse_expr(text)) == code


def test_emitter_semantics_over_any_prefix():
    """The same code is right for one token [B, H, ...] and for all tokens [B, T, H, ...]."""
    spec = memspec.loads(TOY)
    em = ExprEmitter(spec, like="q")
    e = parse_expr("layernorm(outer(k, v) * eta, ln_w) + rmsnorm(v, ln_w)[0]" if False else "eta * outer(l2norm(k), v)")
    code = em.emit(e)
    for prefix in ((2, 3), (2, 5, 3)):
        k = torch.randn(*prefix, 4)
        v = torch.randn(*prefix, 3)
        eta = torch.rand(*prefix)
        got = eval(code, {"torch": torch, "l2norm": lambda x: x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)},
                   {"k": k, "v": v, "eta": eta})
        kn = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        want = eta[..., None, None] * torch.einsum("...i,...j->...ij", kn, v)
        assert torch.allclose(got, want)


# ------------------------------------------------------------------ recurrences
def test_recurrence_of_titans():
    rec = minibatch_recurrence(load("specs/titans.yaml"))
    assert rec.order == ("U1", "W1", "U2", "W2")
    assert {k: unparse(v) for k, v in rec.coeff["W1"].items()} == {("prev", "W1"): "1 - alpha", ("cur", "U1"): "1"}
    assert {k: unparse(v) for k, v in rec.coeff["U1"].items()} == {("prev", "U1"): "mu"}
    assert unparse(rec.rest["U1"]) == "-(eta * grad(loss, W1))"
    assert rec.rest["W1"] is None


def test_recurrence_of_gated_delta_composes_statements():
    rec = minibatch_recurrence(memspec.loads(TOY))
    assert {k: unparse(v) for k, v in rec.coeff["W"].items()} == {("prev", "W"): "1 - alpha"}
    assert unparse(rec.rest["W"]) == "-(eta * grad(loss, W))"


def test_not_a_recurrence():
    spec = memspec.loads(TOY.replace('"W = (1 - alpha) * W"', '"W = W * W"'))
    with pytest.raises(NotRecurrence, match="not a token-local scalar times a state"):
        minibatch_recurrence(spec)
    with pytest.raises(NotRecurrence, match="no gradient"):
        minibatch_recurrence(load("specs/linear_attention.yaml"))


# ------------------------------------------------------------------ generated text
@pytest.mark.parametrize("path", SPEC_FILES)
def test_compiled_is_not_stale(path):
    """compiled/<name>.py is exactly what `memspec compile` generates now (the goldens)."""
    spec = load(path)
    committed = (ROOT / "compiled" / f"{spec.name}.py").read_text(encoding="utf-8")
    assert source(path) == committed, f"compiled/{spec.name}.py is stale: run `memspec compile specs/*.yaml`"


def test_generation_is_deterministic_and_standalone():
    for path in SPEC_FILES:
        a, b = source(path), source(path)
        assert a == b
        tree = ast.parse(a)
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported |= {n.name.split(".")[0] for n in node.names}
            elif isinstance(node, ast.ImportFrom):
                imported.add(node.module.split(".")[0])
        assert imported <= {"torch", "math", "time", "warnings"}, path
        assert "memspec" not in imported


def test_header_names_spec_hash_and_schedule():
    text = source("specs/titans.yaml")
    head = text.splitlines()[:8]
    assert head[0].startswith("# Generated by memspec ") and "specs/titans.yaml" in head[0]
    assert any(ln.startswith("# spec sha256") and len(ln.split()[-1]) == 64 for ln in head)
    assert any("schedule: minibatch(64)" in ln and "approximate" in ln for ln in head)
    assert "# [B, H, C, hidden]" in text and "# [B, H, C, C]" in text       # shape comments (head-major chunks)
    assert any("dual form" in ln for ln in head) and "_token_grads" not in text
    assert "class TitansMemory(nn.Module):" in text and "class TitansLayer(nn.Module):" in text
    mac = source("specs/titans_mac.yaml")
    assert "TitansMacLayer is MAC around TitansMacMemoryLayer" in mac and "not built here" not in mac
    assert "class TitansMacLayer(MAC):" in mac and "class TitansMacMemoryLayer(nn.Module):" in mac


# ------------------------------------------------------------------ CLI and build
def test_cli_compile(tmp_path, capsys):
    assert main(["compile", "specs/deltanet.yaml", "-o", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "wrote" in out and "deltanet.py" in out and "delta" in out
    assert (tmp_path / "deltanet.py").read_text() == (ROOT / "compiled" / "deltanet.py").read_text()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]   # no temp files left


def test_cli_compile_bad_spec(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(TOY.replace("f(q) * ln_w", "f(qq)"))
    assert main(["compile", str(bad), "-o", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "error" in err and "qq" in err and "Traceback" not in err
    assert not (tmp_path / "toy.py").exists()


def test_build_layer_and_state():
    layer = build("specs/titans.yaml", compile=False, d_model=8, heads=2, d_k=4, d_v=4, hidden=6, chunk=4)
    x = torch.randn(2, 7, 8)
    y, st = layer(x, return_state=True)
    assert y.shape == (2, 7, 8)
    assert set(st) >= {"W1", "W2", "U1", "U2"} and st["W1"].shape == (2, 2, 4, 6)
    y2 = layer(x[:, 3:], state=layer(x[:, :3], return_state=True)[1])
    assert torch.allclose(y2, y[:, 3:], atol=1e-5)
    y.sum().backward()
    assert layer.memory.W1_init.grad is not None and layer.q_proj.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match=r"x: expected \[B, T, d_model\] = \[B, T, 8\], got \[2, 7, 9\]"):
        layer(torch.randn(2, 7, 9))
    with pytest.raises(ValueError, match="unknown dims d_q"):
        build("specs/titans.yaml", compile=False, d_q=3)


def test_traceback_shows_generated_lines():
    m = build_memory("specs/deltanet.yaml", compile=False, heads=2, d_k=4, d_v=5)
    q = torch.randn(1, 3, 2, 4)
    try:
        m(q, q, torch.randn(1, 3, 2, 5), eta=torch.rand(1, 3, 2), schedule="online",
          state={"W": torch.randn(1, 2, 4, 5, dtype=torch.float64)})
    except ValueError:
        text = traceback.format_exc()
    assert "memspec compiled/deltanet.py" in text and "_check_state" in text


# ------------------------------------------------------------------ runtime validation
def test_runtime_validation_messages():
    m = build_memory("specs/titans.yaml", compile=False, heads=4, d_k=32, d_v=32, hidden=8)
    B, T = 2, 16
    q, k, v = (torch.randn(B, T, 4, 32) for _ in range(3))
    g = {n: torch.rand(B, T, 4) for n in ("eta", "mu", "alpha")}
    with pytest.raises(ValueError, match=r"k: expected \[B, T, H, d_k\] = \[2, 16, 4, 32\], got \[2, 16, 4, 31\]"):
        m(q, torch.randn(B, T, 4, 31), v, **g)
    with pytest.raises(ValueError, match=r"q: expected \[B, T, H, d_k\] = \[B, T, 4, 32\], got \[2, 16, 32\]"):
        m(q[:, :, 0], k, v, **g)
    with pytest.raises(ValueError, match=r"v: expected \[B, T, H, d_v\] = \[2, 16, 4, 32\], got \[2, 15, 4, 32\]"):
        m(q, k, v[:, 1:], **g)
    with pytest.raises(ValueError, match=r"mu: expected \[B, T, H\] = \[2, 16, 4\], got \[2, 16, 3\]"):
        m(q, k, v, **{**g, "mu": torch.rand(B, T, 3)})
    with pytest.raises(ValueError, match=r"eta: dtype torch.float64 does not match q \(torch.float32\)"):
        m(q, k, v, **{**g, "eta": g["eta"].double()})
    with pytest.raises(ValueError, match=r"missing gate alpha: expected \[B, T, H\] = \[2, 16, 4\]"):
        m(q, k, v, eta=g["eta"], mu=g["mu"])
    with pytest.raises(ValueError, match="unknown argument.*beta"):
        m(q, k, v, **g, beta=g["eta"])
    with pytest.raises(ValueError, match="schedule 'delta' is not admitted by titans"):
        m(q, k, v, **g, schedule="delta")
    with pytest.raises(ValueError, match=r"state\['W1'\]: expected \[B, H, d_k, hidden\] = \[2, 4, 32, 8\]"):
        m(q, k, v, **g, state={**m.init_state(B), "W1": torch.zeros(2, 4, 32, 9)})
    with pytest.raises(ValueError, match="missing U2"):
        st = m.init_state(B)
        del st["U2"]
        m(q, k, v, **g, state=st)


# ------------------------------------------------------------------ torch.compile
@pytest.mark.slow
@pytest.mark.parametrize("path", ["specs/deltanet.yaml", "specs/titans.yaml", "specs/softmax_attention.yaml"])
def test_compiled_equals_eager(path):
    spec = load(path)
    dims = small_dims(spec)
    eager = make(spec, dims, dtype=torch.float32)
    comp = make(spec, dims, dtype=torch.float32, compile=True)
    comp.load_state_dict(eager.state_dict())
    ins = inputs(spec, eager, T=10, dtype=torch.float32)
    for schedule in eager.SCHEDULES:
        with torch.no_grad():
            a, _ = call(eager, spec, ins, None, schedule)
            b, _ = call(comp, spec, ins, None, schedule)
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), schedule


WINDOWED = """
name: windowed
dims: {d_model: 8, heads: 2, d_k: 4, d_v: 3}
views: {q: d_k, k: d_k, v: d_v}
state:
  K: {shape: [d_k], cache: true, window: 3}
  V: {shape: [d_v], cache: true, window: 3}
let: {kn: l2norm(k)}
update: ["K = append(K, kn)", "V = append(V, v)"]
read: 2 * attend(q, K, V, d_k^-0.5) + v
"""


def test_windowed_cache_matches_reference_and_streams():
    from memspec import reference

    spec = memspec.loads(WINDOWED)
    m = build_memory(spec, compile=False)
    assert m.SCHEDULES == ("cache", "online")
    ins = inputs(spec, m, T=8)
    ins = {n: t.float() for n, t in ins.items()}
    ro, rs = reference.run(spec, **ins)
    for schedule in m.SCHEDULES:
        o, st = call(m, spec, ins, None, schedule)
        assert torch.allclose(o, ro, atol=1e-5), schedule
        assert st["K"].shape == (2, 2, 3, 4) and torch.allclose(st["K"], rs["K"], atol=1e-6)
        o1, s1 = call(m, spec, {n: t[:, :5] for n, t in ins.items()}, None, schedule)
        o2, s2 = call(m, spec, {n: t[:, 5:] for n, t in ins.items()}, s1, schedule)
        assert torch.allclose(torch.cat([o1, o2], 1), o, atol=1e-6)
