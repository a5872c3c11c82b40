"""memspec table: rows derived from the spec algebra; the four-paper table is pinned."""
from __future__ import annotations

import csv
import io
import textwrap
from pathlib import Path

import pytest

import memspec
from memspec.tools import cli
from memspec.lang.expr import parse_expr
from memspec.tools.costs import Coster, cost_text
from memspec.tools.features import features, loss_kind, terms
from memspec.tools.mathtext import render
from memspec.tools.table import ladder, render_table, row, rows

HERE = Path(__file__).resolve().parent
SPECS = HERE.parent / "specs"
FOUR = ["linear_attention", "deltanet", "ttt_mlp", "titans"]


@pytest.fixture(autouse=True)
def _at_repo_root(monkeypatch):
    monkeypatch.chdir(HERE.parent)


def load(name: str) -> memspec.Spec:
    return memspec.load(SPECS / f"{name}.yaml")


# ------------------------------------------------------------- the golden
def test_four_paper_table_golden(capsys):
    rc = cli.main(["table"] + [f"specs/{n}.yaml" for n in FOUR])
    out = capsys.readouterr().out
    assert rc == 0
    assert out == (HERE / "golden" / "table_four_papers.md").read_text(encoding="utf-8")


def test_four_papers_problem_and_mechanism():
    # the seed text's §5.4 table, derived from the specs
    rs = rows(load(n) for n in FOUR)
    assert [(r.problem, r.mechanism) for r in rs] == [
        ("Avoid scanning a growing list with a suitable similarity",
         "Recurrent numerator matrix and normalisation vector"),
        ("Correct an existing association instead of only adding",
         "Error-based write into fast weights"),
        ("Choose a richer state and learn what its local task should be",
         "Inner learner, learned views, outer objective"),
        # the shipped titans.yaml is the bare memory (wiring: none); see the MAC row below
        ("Manage continuing writes", "Momentum, decay"),
    ]


def test_wired_titans_reaches_the_seed_row():
    r = row(load("titans_mac"))
    assert r.problem == "Manage continuing writes and combine history with local context"
    assert r.mechanism == "Momentum, decay, memory-attention wiring (MAC)"
    assert r.wiring == "MAC (segment 128, persistent 16, qk_norm true, write attention, output gated)"


def test_rows_never_read_the_name():
    for n in FOUR + ["mesa", "softmax_attention", "longhorn", "moneta"]:
        s = load(n)
        renamed = s.model_copy(update={"name": "anonymous", "cite": "", "description": ""})
        a, b = row(s), row(renamed)
        assert (a.problem, a.mechanism, a.write, a.loss, a.step, a.momentum, a.forget, a.write_cost) == \
            (b.problem, b.mechanism, b.write, b.loss, b.step, b.momentum, b.forget, b.write_cost)


# --------------------------------------------------------------- columns
def test_columns_of_every_paper():
    got = {n: row(load(n)) for n in ["linear_attention", "deltanet", "gated_deltanet", "longhorn", "mesa",
                                     "ttt_linear", "ttt_mlp", "titans", "moneta", "yaad",
                                     "softmax_attention", "sliding_window_attention"]}
    assert {n: (r.step, r.momentum, r.forget) for n, r in got.items()} == {
        "linear_attention": ("—", "—", "—"),
        "deltanet": ("η, per token", "—", "—"),
        "gated_deltanet": ("η, per token", "—", "1 − α, per token (W)"),
        "longhorn": ("ε = η/(1 + η Σ(k k)), per token", "—", "—"),
        "mesa": ("η, per token (additive write)", "—", "1 − α, per token (H, G)"),
        "ttt_linear": ("η, per token", "—", "—"),
        "ttt_mlp": ("η, per token", "—", "—"),
        "titans": ("η, per token", "μ, per token (U₁, U₂)", "1 − α, per token (W₁, W₂)"),
        "moneta": ("η, per token", "—", "1 − α, per token (W₁, W₂)"),
        "yaad": ("η, per token", "—", "1 − α, per token (W₁, W₂)"),
        "softmax_attention": ("—", "—", "—"),
        "sliding_window_attention": ("—", "—", "—"),
    }
    assert {n: (r.write_cost, r.read_cost) for n, r in got.items()} == {
        "linear_attention": ("O(d_k·d_v)", "O(d_k·d_v)"),
        "deltanet": ("O(d_k·d_v)", "O(d_k·d_v)"),
        "gated_deltanet": ("O(d_k·d_v)", "O(d_k·d_v)"),
        "longhorn": ("O(d_k·d_v)", "O(d_k·d_v)"),
        "mesa": ("O(d_k·(d_k + d_v))", "O(d_k²·(d_k + d_v))"),   # the solve dominates the read
        "ttt_linear": ("O(d_k²)", "O(d_k²)"),
        "ttt_mlp": ("O(d_k·hidden)", "O(d_k·hidden)"),
        "titans": ("O(hidden·(d_k + d_v))", "O(hidden·(d_k + d_v))"),
        "moneta": ("O(hidden·(d_k + d_v))", "O(hidden·(d_k + d_v))"),
        "yaad": ("O(hidden·(d_k + d_v))", "O(hidden·(d_k + d_v))"),
        "softmax_attention": ("O(d_k + d_v)", "O(n·(d_k + d_v))"),
        "sliding_window_attention": ("O(d_k + d_v)", "O(n·(d_k + d_v))"),
    }
    assert {n: r.loss.split(":")[0] for n, r in got.items() if r.loss != "—"} == {
        "deltanet": "squared error", "gated_deltanet": "squared error", "longhorn": "squared error",
        "ttt_linear": "squared error", "ttt_mlp": "squared error", "titans": "squared error",
        "moneta": "ℓp (p = 3)", "yaad": "Huber",
    }
    assert got["deltanet"].write == "W ← W − η ∇ℓ(W)"
    assert got["gated_deltanet"].write == "W ← (1 − α) W; W ← W − η ∇ℓ(W)"
    assert got["linear_attention"].read == "qf · S/(qf · z + ε)"
    assert got["softmax_attention"].read == "softmax(K q/√d_k) · V"
    assert got["softmax_attention"].state == "K cache [n, d_k], V cache [n, d_v]"
    assert got["sliding_window_attention"].state == "K cache [≤512, d_k], V cache [≤512, d_v]"
    assert got["mesa"].read == "qn · (H + λ I)⁻¹ G"
    assert got["titans"].schedule == "minibatch chunk 64, approximate"
    assert got["deltanet"].schedule == "delta chunk 64, exact"


def test_ladder_of_other_papers():
    got = {n: ladder(load(n), features(load(n))) for n in
           ["gated_deltanet", "longhorn", "mesa", "moneta", "yaad", "softmax_attention"]}
    assert got == {
        "gated_deltanet": ("Correct an existing association instead of only adding; manage continuing writes",
                           "Error-based write into fast weights, decay"),
        "longhorn": ("Correct an existing association instead of only adding; "
                     "keep each write stable whatever the key's norm",
                     "Error-based write into fast weights, implicit key-dependent step"),
        "mesa": ("Read the least-squares fit of all stored associations; manage continuing writes",
                 "Key/value statistics read by an exact least-squares solve, decay"),
        "moneta": ("Manage continuing writes", "Decay, ℓp (p = 3) inner loss"),
        "yaad": ("Manage continuing writes", "Decay, Huber inner loss"),
        "softmax_attention": ("Retain individual key/value entries and read them by matching",
                              "Explicit key/value cache read by softmax matching"),
    }


SMALL = textwrap.dedent("""\
    name: m
    dims: {d_k: 4, d_v: 4}
    constants: {lr: 0.1, keep: 0.9}
    views: {q: d_k, k: d_k, v: d_v}
    gates: {g: sigmoid(logit)}
    state:
      W: {shape: [d_k, d_v]}
      M: {shape: [d_k, d_v]}
    model: f(u) = u @ W
    loss: 0.5 * sum((f(k) - v)^2)
    update:
      - M = keep * M - lr * grad(loss, W)
      - W = W + M
    read: f(q)
    """)


def test_features_from_the_algebra_not_the_names():
    # momentum with constant coefficients and unconventional names: still momentum, not per token
    s = memspec.loads(SMALL)
    ft = features(s)
    assert (ft.step.text, ft.step.per_token) == ("lr", False)
    assert (ft.momentum.text, ft.momentum.per_token, ft.momentum_states) == ("keep", False, ("M",))
    assert ft.forget is None and ft.grad_write and ft.model_linear
    # the same decay on a state that feeds nothing is forgetting
    s2 = memspec.loads(SMALL.replace("- W = W + M", "- W = g * W + M").replace("keep * M", "M"))
    ft2 = features(s2)
    assert ft2.momentum is None
    assert (ft2.forget.text, ft2.forget.per_token, ft2.forget_states) == ("g", True, ("W",))


def test_loss_kinds():
    base = memspec.loads(SMALL)
    def kind(loss):
        return loss_kind(base.model_copy(update={"loss": parse_expr(loss)}))
    assert kind("sum((f(k) - v)^2) / 2") == "squared error"
    assert kind("mean((v - f(k))^2)") == "squared error"
    assert kind("sum(huber(f(k) - v, 1))") == "Huber"
    assert kind("sum(abs(f(k) - v)^4)") == "ℓp (p = 4)"
    assert kind("-sum(f(k) * v)") == "dot product"
    assert kind("sum(exp(f(k)))") == "custom"


def test_terms_distribute_products():
    got = sorted((c, tuple(str(f) for f in fs)) for c, fs in terms(parse_expr("(1 - a) * W + 2 * (b - c) / 4")))
    assert got == [(-1.0, ("a", "W")), (-0.5, ("c",)), (0.5, ("b",)), (1.0, ("W",))]


def test_render_math():
    assert render(parse_expr("W - eta * grad(loss, W)")) == "W − η ∇ℓ(W)"
    assert render(parse_expr("0.5 * sum((f(k) - v)^2)")) == "½ ‖f(k) − v‖²"
    assert render(parse_expr("S + outer(k, v)")) == "S + k ⊗ v"
    assert render(parse_expr("-(a + b).T")) == "−(a + b)ᵀ"
    assert render(parse_expr("W1 @ W2")) == "W₁ · W₂"
    assert render(parse_expr("x^p")) == "x^p"


def test_cost_text_factors_and_dominance():
    s = load("mesa")
    from collections import Counter
    assert cost_text(Counter({("d_k",): 1, ("d_k", "d_v"): 1}), s) == "O(d_k·d_v)"
    assert cost_text(Counter({("d_k", "d_k", "d_k"): 1, ("d_k", "d_k", "d_v"): 1}), s) == "O(d_k²·(d_k + d_v))"
    assert cost_text(Counter(), s) == "O(1)"
    c = Coster(load("ttt_mlp")).cost(parse_expr("outer(k, v)"))
    assert cost_text(c, s) == "O(d_k²)"   # v has width d_k in TTT


# ------------------------------------------------------------------ formats
def test_formats(capsys):
    files = ["specs/deltanet.yaml", "specs/titans_mac.yaml"]
    assert cli.main(["table", *files, "--format", "csv"]) == 0
    got = list(csv.reader(io.StringIO(capsys.readouterr().out)))
    assert got[0][:4] == ["spec", "problem reached", "main mechanism", "state"]
    assert [r[0] for r in got[1:]] == ["deltanet", "titans_mac"]
    assert got[1][4] == "W ← W − η ∇ℓ(W)"
    assert cli.main(["table", *files, "--format", "text"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("deltanet\n  problem reached   Correct an existing association instead of only adding\n")
    assert "\n\ntitans_mac\n" in text and "  wiring            MAC (segment 128, persistent 16, qk_norm true, write attention, output gated)\n" in text
    assert cli.main(["table", "specs/nope.yaml"]) == 1
    assert "no such spec file" in capsys.readouterr().err
    with pytest.raises(ValueError):
        render_table([], "html")


def test_wiring_options_are_reported():
    base = memspec.load(str(SPECS / "titans_mal.yaml"))
    assert row(base).wiring == "MAL (window 128, persistent 16, qk_norm true, residual true)"
    bare = base.model_copy(update={"wiring": base.wiring.model_copy(update={"residual": False, "qk_norm": False})})
    assert row(bare).wiring == "MAL (window 128, persistent 16, qk_norm false, residual false)"
    mag = memspec.load(str(SPECS / "titans_mag.yaml"))
    convex = mag.model_copy(update={"wiring": mag.wiring.model_copy(update={"gate": "convex"})})
    assert row(mag).wiring == "MAG (window 128, persistent 16, qk_norm true, gate normalized)"
    assert row(convex).wiring == "MAG (window 128, persistent 16, qk_norm true, gate convex)"


# ------------------------------------------------------------------ the 2025-26 frontier
FRONTIER = {   # spec -> (optimizer, loss window, update frequency)
    "atlas": ("Muon (on momentum)", "last 8 tokens, weighted", "every token"),
    "omeganet": ("SGD", "last 8 tokens", "every token"),
    "lact": ("SGD, renormalised", "1 token", "once per chunk of 64 (apply, then update)"),
    "memora": ("mirror", "1 token", "every token"),
    "hope_cms": ("SGD", "1 token", "W₂ every 4, W₃ every 8; others every token"),
    "titans_muon": ("Muon (on momentum)", "1 token", "every token"),
    "titans": ("momentum", "1 token", "every token"),
    "deltanet": ("SGD", "1 token", "every token"),
    "linear_attention": ("—", "—", "every token"),
    "softmax_attention": ("—", "—", "every token"),
}


@pytest.mark.parametrize("name", sorted(FRONTIER))
def test_optimizer_window_and_frequency_columns(name):
    r = row(load(name))
    assert (r.optimizer, r.window, r.frequency) == FRONTIER[name]


def test_frontier_rows_read_like_the_papers():
    rs = {r.spec: r for r in rows(load(n) for n in ("atlas", "lact", "memora", "titans_muon"))}
    assert rs["atlas"].write.endswith("W₁ ← (1 − α) W₁ − η NS₅(S₁); W₂ ← (1 − α) W₂ − η NS₅(S₂)")
    assert rs["atlas"].loss == "weighted squared error: ½ Σ(G · (f(K) − V)²)"
    assert rs["atlas"].step == "η, per token" and rs["titans_muon"].step == "η₁, per token"
    assert rs["atlas"].mechanism == "Momentum, decay, window loss"
    assert "Z₁ ← (1 − α) Z₁ − η g₁" in rs["memora"].write and "W₁ ← c₁ softmax_hidden(Z₁)" in rs["memora"].write
    assert "W₀ ← l2norm((W₀ − η₀ g₀)ᵀ)ᵀ ‖W₀‖_d_k" in rs["lact"].write
    assert rs["lact"].loss.startswith("dot product") and rs["lact"].step == "η₀, per token"
    assert rs["lact"].schedule == "apply_update chunk 64, approximate"
    # a window of cached rows costs n times the model; Newton-Schulz a cube of the smaller side
    assert "n·d_k·hidden" in rs["atlas"].write_cost and "d_k³" in rs["titans_muon"].write_cost
    muon = row(memspec.load(SPECS / "variants" / "lact_muon.yaml"))
    assert muon.optimizer == "Muon, renormalised"
