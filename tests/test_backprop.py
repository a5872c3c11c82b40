"""Closed-form gradients of the inner loss (memspec.schedule.backprop, emitted by
memspec.codegen.program.closed_grad_lines): each equals torch.func.grad of the module's own
inner_loss on random float64 inputs, and the decision of when a closed form applies follows
the algebra (a variant written differently gets the same; a loss outside the rules keeps
torch.func.grad)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import memspec
from memspec.codegen import generate
from memspec.codegen.context import Context
from memspec.codegen.program import closed_grad_lines
from memspec.codegen.text import Lines
from memspec.lang.expr import Name
from memspec.pipeline.build import build_memory, load_checked
from memspec.schedule import analyse
from memspec.schedule.backprop import NoClosedForm, closed_grad, spec_names

ROOT = Path(__file__).resolve().parent.parent

BASE = """
name: probe
dims: {d_model: 8, heads: 2, d_k: 3, hidden: 5}
views: {q: d_k, k: d_k, v: d_k}
gates: {eta: sigmoid(logit)}
params: {w: {shape: [d_k], init: ones}}
state:
  W1: {shape: [d_k, hidden], init: normal(0.5)}
  W2: {shape: [hidden, d_k], init: normal(0.5)}
  b: {shape: [hidden], init: normal(0.5)}
MODEL
LOSS
update:
  - g1 = grad(loss, W1)
  - g2 = grad(loss, W2)
  - gb = grad(loss, b)
  - W1 = W1 - eta * g1
  - W2 = W2 - eta * g2
  - b = b - eta * gb
read: f(q)
schedule: online
"""

MODELS = {
    "tanh": "model: f(u) = tanh(u @ W1 + b) @ W2",
    "gelu": "model: f(u) = gelu(u @ W1 + b) @ W2",
    "silu": "model: f(u) = silu(b + u @ W1) @ W2",
    "sigmoid-residual": "model: f(u) = u + sigmoid(u @ W1 + b) @ W2",
    "layernorm": "model: f(u) = u + layernorm(relu(u @ W1 + b) @ W2, w)",
    "rmsnorm": "model: f(u) = rmsnorm(softplus(u @ W1 + b) @ W2, w)",
    "l2norm": "model: f(u) = l2norm(exp(0.1 * (u @ W1 + b)) @ W2)",
}
LOSSES = {
    "half-square": "loss: 0.5 * sum((f(k) - v)^2)",
    "mean": "loss: mean((v - f(k))^2) / 2",
    "dot": "loss: (f(k) - v) @ (f(k) - v)",
    "norm": "loss: norm(f(k) - v)^2",
    "abs-power": "loss: sum(abs(f(k) - v)^3)",
    "huber": "loss: sum(huber(f(k) - v, 0.5))",
    "weighted": "loss: sum(w * (f(k) - v) * (f(k) - v)) + 0.1 * sum(f(k) * v)",
}


def closed_and_autograd(spec, seed=0):
    """(closed-form gradients, torch.func.grad of inner_loss) of the first gradient group,
    float64, at random states and inputs."""
    decision = analyse(spec)
    ctx = Context(spec, decision)
    key, cg = next(iter(ctx.closed_grads.items()))
    group = next(g for g in ctx.grad_groups if g and tuple(map(str, g)) == key)
    targets = list(dict.fromkeys(c.args[1].id if len(c.args) == 2 else spec.model_states()[0] for c in group))
    L = Lines()
    L(f"def _closed(self, {', '.join(ctx.loss_args)}):")
    with L.indent():
        outs = closed_grad_lines(ctx, L, ctx.emitter(), cg, targets, ctx.taken(), "the test")
        L(f"return ({', '.join(outs[t] for t in targets)},)")
    mem = build_memory(spec, compile=False).double()
    namespace = sys.modules[type(mem).__module__].__dict__
    exec("\n".join(L.lines), namespace)
    closed = namespace.pop("_closed")
    g = torch.Generator().manual_seed(seed)
    B, H = 2, mem.heads
    args = []
    for a in ctx.loss_args:
        dims = spec.state[a].shape if a in spec.state else ctx.shape(Name(a))
        args.append(torch.randn(B, H, *(getattr(mem, d) for d in dims), generator=g, dtype=torch.float64))
    got = closed(mem, *args)
    want = torch.func.grad(mem.inner_loss, argnums=tuple(ctx.loss_args.index(t) for t in targets))(*args)
    return got, want


# every model and every loss at least once (each case builds a module: not the full product)
CASES = [("tanh", "half-square"), ("gelu", "mean"), ("silu", "dot"), ("sigmoid-residual", "norm"),
         ("layernorm", "abs-power"), ("rmsnorm", "huber"), ("l2norm", "weighted"), ("gelu", "weighted"),
         ("layernorm", "half-square"), ("tanh", "dot")]


@pytest.mark.parametrize("model, loss", CASES)
def test_closed_form_equals_autograd(model, loss):
    spec = memspec.loads(BASE.replace("MODEL", MODELS[model]).replace("LOSS", LOSSES[loss]), "yaml")
    got, want = closed_and_autograd(spec)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("model", ["f(u) = tanh(u @ (P + W1) + b) @ W2", "f(u) = tanh(u @ (W1 + P) + b) @ W2"])
def test_a_layer_through_a_state_plus_a_fixed_matrix(model):
    # x @ (A + W) with A free of states (a residual `eye + W`, a learned base P) is x @ A + x @ W
    text = BASE.replace("params: {w: {shape: [d_k], init: ones}}",
                        "params:\n  P: {shape: [d_k, hidden]}")
    spec = memspec.loads(text.replace("MODEL", f"model: {model}").replace("LOSS", LOSSES["half-square"]), "yaml")
    got, want = closed_and_autograd(spec)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-12)


SHIPPED_WITH_CLOSED_FORM = ["deltanet", "gated_deltanet", "hope_cms", "longhorn", "moneta", "lab/seed_titans", "titans",
                            "titans_mac", "titans_mag", "titans_mal", "ttt_linear", "ttt_mlp", "yaad"]


@pytest.mark.parametrize("name", SHIPPED_WITH_CLOSED_FORM)
def test_shipped_closed_forms_equal_autograd_and_replace_func_grad(name):
    checked = load_checked(ROOT / "specs" / f"{name}.yaml")
    got, want = closed_and_autograd(checked.spec)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-12)
    text = generate(checked.spec, analyse(checked.spec))
    assert "torch.func.grad" not in text


def gradient_program(text: str) -> list[str]:
    spec = memspec.loads(text, "yaml")
    cg = closed_grad(spec, spec.loss, ["W1", "W2", "b"], spec_names(spec))
    return [ln for ln in cg.describe()]


def test_the_same_loss_written_differently_gets_an_equal_gradient():
    """Three spellings of one loss: each has a closed form, and the gradients agree."""
    base = BASE.replace("MODEL", MODELS["gelu"])
    spellings = ["loss: 0.5 * sum((f(k) - v)^2)", "loss: sum((v - f(k))^2) / 2",
                 "loss: 0.5 * ((f(k) - v) @ (f(k) - v))"]
    results = [closed_and_autograd(memspec.loads(base.replace("LOSS", s), "yaml"), seed=3)[0] for s in spellings]
    for other in results[1:]:
        for a, b in zip(results[0], other):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_renamed_spec_gets_the_same_program():
    """Nothing is keyed on names: renaming the states, the model and its argument changes
    only the names in the gradient program."""
    text = BASE.replace("MODEL", MODELS["layernorm"]).replace("LOSS", LOSSES["half-square"])
    renamed = text.replace("W1", "A").replace("W2", "Z").replace(" b", " c").replace("(b", "(c") \
        .replace("f(", "mem(").replace("(u)", "(x)").replace("u @", "x @").replace("= u +", "= x +") \
        .replace(", b)", ", c)").replace("b:", "c:").replace("gb", "gc")
    spec = memspec.loads(renamed, "yaml")
    cg = closed_grad(spec, spec.loss, ["A", "Z", "c"], spec_names(spec))
    original = memspec.loads(text, "yaml")
    cg0 = closed_grad(original, original.loss, ["W1", "W2", "b"], spec_names(original))
    assert [s.kind for s in cg.forward + cg.backward] == [s.kind for s in cg0.forward + cg0.backward]
    assert len(cg.sites) == len(cg0.sites) == 3


@pytest.mark.parametrize("loss, why", [
    ("loss: sum(min(f(k) - v, 0.5)^2)", "min"),
    ("loss: sum(clamp(f(k), -1, 1) - v)", "clamp"),
    ("loss: sum((k @ (W1 @ W2) + b @ W2 - v)^2)", "other than through"),
])
def test_no_closed_form_keeps_torch_func_grad(loss, why):
    text = BASE.replace("MODEL", MODELS["tanh"]).replace("LOSS", loss)
    spec = memspec.loads(text, "yaml")
    with pytest.raises(NoClosedForm, match=why):
        closed_grad(spec, spec.loss, ["W1", "W2", "b"], spec_names(spec))
    src = generate(spec, analyse(spec))
    assert "torch.func.grad(self.inner_loss" in src
