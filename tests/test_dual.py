"""The dual form of the mini-batch schedule (memspec.schedule.dual, memspec.codegen.dual).

Numerical agreement with the reference interpreter, gradients, causality and streaming
are covered for every shipped spec by test_compiled_vs_reference.py (the dual form is
the mini-batch schedule of titans, ttt_*, moneta, yaad, deltanet, longhorn); here: which
specs admit it and why not, that it never forms a per-token state, and that it agrees
with the materialising form on specs written to stress the recurrence algebra.
"""
import inspect
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import memspec
from memspec.pipeline.build import build_memory
from memspec.codegen import generate
from memspec.schedule.dual import NotDual, analyse_dual
from memspec.reference import run as reference_run
from memspec.schedule import analyse, explain

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name,sites", [
    ("titans", {"W1": "matmul", "W2": "matmul"}),
    ("ttt_mlp", {"W1": "matmul", "b1": "bias", "W2": "matmul", "b2": "bias"}),
    ("ttt_linear", {"W": "matmul", "b": "bias"}),
    ("moneta", {"W1": "matmul", "W2": "matmul"}),
    ("yaad", {"W1": "matmul", "W2": "matmul"}),
    ("deltanet", {"W": "matmul"}),
])
def test_shipped_specs_admit_the_dual_form(name, sites):
    form = analyse_dual(memspec.load(ROOT / f"specs/{name}.yaml"))
    assert form.sites == sites
    src = (ROOT / f"compiled/{name}.py").read_text()
    assert "def _chunk_step(" in src and "_token_grads" not in src
    # the deltas in closed form (memspec.schedule.backprop): no tapped loss, no torch.func.grad
    assert form.grad is not None and "_chunk_loss" not in src and "torch.func.grad" not in src
    spec = memspec.load(ROOT / f"specs/{name}.yaml")
    if analyse(spec).family == "minibatch":   # (deltanet's own schedule is the exact delta form)
        assert "dual form" in explain(spec)


BASE = """
name: probe
dims: {d_model: 8, heads: 2, d_k: 3, hidden: 4}
views: {q: d_k, k: d_k, v: d_k}
gates: {eta: 0.5 * sigmoid(logit), alpha: sigmoid(logit)}
state:
  W1: {shape: [d_k, hidden], init: normal(0.5)}
  W2: {shape: [hidden, d_k], init: normal(0.5)}
MODEL
loss: 0.5 * sum((f(k) - v)^2)
update:
UPDATE
read: f(q)
"""
# both gradients at the same point (temporaries); written one after the other, W2's gradient
# would see this token's new W1 (memspec's sequential statement semantics): no dual form
PLAIN = "  - g1 = grad(loss, W1)\n  - g2 = grad(loss, W2)\n  - W1 = W1 - eta * g1\n  - W2 = W2 - eta * g2"
SEQUENTIAL = "  - W1 = W1 - eta * grad(loss, W1)\n  - W2 = W2 - eta * grad(loss, W2)"


def probe(model="model: f(u) = tanh(u @ W1) @ W2", update=PLAIN, extra=""):
    return memspec.loads(BASE.replace("MODEL", model).replace("UPDATE", update) + extra, "yaml")


@pytest.mark.parametrize("model,update,why", [
    ("model: f(u) = tanh(u @ W1) @ W2", "  - W1 = (1 - alpha) * W1\n  - W1 = W1 - eta * grad(loss, W1)\n"
     "  - W2 = W2 - eta * grad(loss, W2)", "before a gradient is taken"),
    ("model: f(u) = tanh(u @ W1) @ W2", SEQUENTIAL, "statement 1 writes W1 before a gradient"),
    ("model: f(u) = tanh(u @ W1) @ W2 + tanh(u @ W1) @ W2", PLAIN, "enters the model 2 times"),
    ("model: f(u) = tanh(u @ (W1 * W1)) @ W2", PLAIN, "other than through"),
    ("model: f(u) = tanh(u @ W1) @ W2", "  - g = grad(loss, W1)\n  - h = grad(loss, W2)\n"
     "  - W1 = W1 - eta * g * g\n  - W2 = W2 - eta * h", "not a"),
])
def test_specs_without_a_dual_form_say_why_and_fall_back(model, update, why):
    spec = probe(model, update)
    with pytest.raises(NotDual, match=why):
        analyse_dual(spec)
    d = analyse(spec)
    if "minibatch" in d.admits:
        src = generate(spec, d)
        assert "_token_grads" in src and "_chunk_loss" not in src


@pytest.mark.parametrize("update", [
    PLAIN,
    # momentum, decay, a temporary mixing a state finished earlier in the token
    "  - U = 0.8 * U - eta * grad(loss, W2)\n  - m = 0.5 * U\n  - g = grad(loss, W1)\n"
    "  - W1 = (1 - alpha) * W1 - eta * g\n  - W2 = (1 - alpha) * W2 + m + U",
    # a decay that reads the previous value of another state (R_(i-1), not R_i)
    "  - g = grad(loss, W1)\n  - h = grad(loss, W2)\n  - W2 = W2 + 0.3 * U - eta * h\n  - U = 0.9 * U - h\n"
    "  - W1 = W1 - eta * g",
])
@pytest.mark.parametrize("order", ["write_read", "read_write"])
@pytest.mark.parametrize("bias", [False, True, "no closed form"])
def test_dual_matches_reference_on_recurrence_algebra(update, order, bias):
    extra = f"order: {order}\n"
    model = "model: f(u) = tanh(u @ W1 + b) @ W2" if bias is True else "model: f(u) = tanh(u @ W1) @ W2"
    if bias == "no closed form":   # clamp has no derivative rule: the deltas by torch.func.grad of _chunk_loss
        model, bias = "model: f(u) = clamp(u @ W1, -1, 1) @ W2", False
    if bias:   # a bias state with its own decayed gradient step, taken with the others
        update = "  - gb = grad(loss, b)\n" + update + "\n  - b = (1 - alpha) * b - eta * gb"
    text = BASE.replace("MODEL", model).replace("UPDATE", update) + extra
    if "U" in update:
        text = text.replace("state:\n", "state:\n  U: {shape: [hidden, d_k], init: normal(0.1)}\n")
    if bias:
        text = text.replace("state:\n", "state:\n  b: {shape: [hidden], init: normal(0.3)}\n")
    spec = memspec.loads(text, "yaml")
    form = analyse_dual(spec)
    assert (form.grad is None) == ("clamp" in model)
    torch.manual_seed(0)
    C, T = 4, 11
    mem = build_memory(spec, chunk=C, compile=False).double()
    B, H = 2, 2
    q, k, v = (torch.randn(B, T, H, 3, dtype=torch.float64) for _ in range(3))
    eta, alpha = (0.5 * torch.rand(B, T, H, dtype=torch.float64) for _ in range(2))
    state = mem.init_state(B, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ins = [x.requires_grad_() for x in (q, k, v, eta, alpha)]
    o, st = mem(q, k, v, eta=eta, alpha=alpha, state=dict(state), schedule="minibatch")
    ro, rst = reference_run(spec, state=dict(state), schedule=("minibatch", C),
                            q=q, k=k, v=v, eta=eta, alpha=alpha)
    torch.testing.assert_close(o, ro, rtol=1e-9, atol=1e-10)
    names = [n for n in st if not n.startswith("minibatch.")]
    for n in names:
        torch.testing.assert_close(st[n], rst[n], rtol=1e-9, atol=1e-10)
    # the outer gradients through the chunk's inner updates
    w = torch.randn_like(o)
    got = torch.autograd.grad((o * w).sum() + sum(st[n].sum() for n in names), ins, allow_unused=True)
    want = torch.autograd.grad((ro * w).sum() + sum(rst[n].sum() for n in names), ins, allow_unused=True)
    for x, g, r in zip(ins, got, want):   # (alpha is unused by some programs)
        zero = torch.zeros_like(x)
        torch.testing.assert_close(zero if g is None else g, zero if r is None else r, rtol=1e-8, atol=1e-10)
    assert got[0] is not None and got[0].abs().sum() > 0


class _LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_titans_chunk_never_materialises_per_token_weights():
    """The dual form's largest tensor is far below one chunk of per-token MLP weights
    (the materialising form's [B, C, H, d_k, hidden])."""
    spec = memspec.load(ROOT / "specs/titans.yaml")
    mem = build_memory(spec, heads=2, d_k=16, d_v=16, hidden=32, chunk=16, compile=False)
    B, T, H = 1, 32, 2
    q, k, v = (torch.randn(B, T, H, 16) for _ in range(3))
    gates = {g: torch.rand(B, T, H) * 0.1 for g in ("eta", "mu", "alpha")}
    per_token_weights = B * 16 * H * 16 * 32
    rec = _LargestTensor()
    with rec:
        mem(q, k, v, **gates, schedule="minibatch")
    assert rec.largest < per_token_weights / 8, rec.largest


@pytest.mark.parametrize("name", ["titans", "ttt_mlp", "ttt_linear", "moneta", "yaad", "deltanet"])
def test_chunk_pre_is_local_to_batch_rows_and_holds_what_reads_no_state(name):
    """_chunk_pre (what the chunk step reads that depends on no state) runs once for all full
    chunks stacked on the batch axis: on two chunks stacked it gives each chunk's own numbers,
    and the sequential _chunk_step builds no decay matrix itself."""
    spec = memspec.load(ROOT / f"specs/{name}.yaml")
    dims = {d: n for d, n in {"heads": 2, "d_k": 4, "d_v": 4, "hidden": 8}.items() if d in spec.dims}
    mem = build_memory(spec, **dims, chunk=4, compile=False).double()
    src = (ROOT / f"compiled/{name}.py").read_text()
    step = src[src.index("    def _chunk_step("):]
    assert "def _chunk_pre(" in src and "_decay_matrix(" not in step.split("\n    def ")[0]
    names = list(inspect.signature(mem._chunk_pre).parameters)
    torch.manual_seed(0)
    dims = {**{v: getattr(mem, d) for v, d in mem.VIEWS.items()}, **{n: None for n in names if n not in mem.VIEWS}}
    def chunk():   # head-major [B, H, C, ...] inputs (gates in (0, 1), lets as random as the views)
        return [torch.rand(1, 2, 4, dtype=torch.float64) if n in mem.GATES else
                torch.randn(1, 2, 4, dims[n] or mem.d_k, dtype=torch.float64) for n in names]
    a, b = chunk(), chunk()
    both = mem._chunk_pre(*(torch.cat([x, y]) for x, y in zip(a, b)))
    for got, pa, pb in zip(both, mem._chunk_pre(*a), mem._chunk_pre(*b)):
        torch.testing.assert_close(got, torch.cat([pa, pb]), rtol=1e-12, atol=0)
    # the forward calls it once on its 3 full chunks stacked (batch 3 B), and once on the tail
    # (its numbers are the reference's: tests/test_compiled_vs_reference.py)
    B, T = 2, 3 * 4 + 1
    ins = {v: torch.randn(B, T, 2, getattr(mem, d), dtype=torch.float64) for v, d in mem.VIEWS.items()}
    ins.update({g: torch.rand(B, T, 2, *(getattr(mem, d) for d in dg), dtype=torch.float64)
                for g, dg in mem.GATES.items()})
    calls, real = [], mem._chunk_pre

    def spy(*xs):
        calls.append(xs[0].shape[0])
        return real(*xs)
    mem._chunk_pre = spy
    with torch.no_grad():
        mem(**ins, schedule="minibatch")
    assert calls == [3 * B, B]

