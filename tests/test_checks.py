"""The verifier (memspec.check.verify.check): each check, its code, message and location."""
from __future__ import annotations

import builtins
import keyword
from pathlib import Path

import pytest

import memspec
from memspec.check.verify import RESERVED_NAMES, check, identifier_problem
from memspec.lang.expr import FUNCTIONS

ROOT = Path(__file__).resolve().parent.parent

BASE = """name: t
dims: {d_model: 8, heads: 2, d_k: 4, d_v: 4}
views: {q: d_k, k: d_k, v: d_v}
gates: {eta: sigmoid(logit)}
state:
  W: {shape: [d_k, d_v]}
model: f(u) = u @ W
loss: 0.5 * sum((f(k) - v)^2)
update:
  - W = W - eta * grad(loss, W)
read: f(q)
"""


def diags_of(text: str, fmt: str = "yaml"):
    _, diags = check(memspec.loads(text, fmt))
    return diags


def codes(text: str, fmt: str = "yaml"):
    return [(d.severity, d.code) for d in diags_of(text, fmt)]


def test_base_is_clean():
    graph, diags = check(memspec.loads(BASE))
    assert diags == []
    assert graph.graph["spec"].name == "t"


@pytest.mark.parametrize("old,new,code,message,where", [
    ("eta * grad", "etaa * grad", "E-unknown-name", "unknown name 'etaa'", (10, 13)),
    ("read: f(q)", "read: f(q) + k", "E-shape", "shape mismatch in '+': [d_v] and [d_k]", None),
    ("sigmoid(logit)", "sigmod(logit)", "E-unknown-function", "unknown function 'sigmod'", (4, 14)),
    ("read: f(q)", "read: sum(f(q), d_v, 2)", "E-arity", "sum takes 1 to 2 arguments, got 3", (11, 7)),
    ("grad(loss, W)", "grad(loss, q)", "E-grad", "'q' is a view", (10, 30)),
    ("0.5 * sum((f(k) - v)^2)", "0.5 * (f(k) - v)^2", "E-grad", "grad needs a scalar loss; the loss has shape [d_v]",
     (8, 7)),
    ("W = W - eta", "q = W - eta", ("E-state-unwritten", "E-target"), "'q' is a view; update statements assign states", (10, 5)),
    ("gates: {eta: sigmoid(logit)}", "gates: {eta: sigmoid(logit) * sum(q)}", "E-order",
     "gate 'eta' uses the view 'q'", (4, 35)),
    ("f(u) = u @ W", "f(v) = v @ W", "E-shadow", "the model argument 'v' shadows the view 'v'", None),
    ("W: {shape: [d_k, d_v]}", "W: {shape: [d_k, d_w]}", "E-unknown-dim", "unknown dim 'd_w' in the shape of state W",
     (6, 20)),
])
def test_single_errors(old, new, code, message, where):
    assert BASE.count(old) == 1
    ds = [d for d in diags_of(BASE.replace(old, new)) if d.severity == "error"]
    want = list(code) if isinstance(code, tuple) else [code]
    assert [d.code for d in ds] == want, [d.render() for d in ds]
    d = ds[-1]
    assert message in d.message
    if where is not None:
        assert (d.span.line, d.span.col) == where


def test_state_never_written_and_never_read():
    text = BASE.replace("  W: {shape: [d_k, d_v]}\n", "  W: {shape: [d_k, d_v]}\n  z: {shape: [d_k]}\n  c: {shape: [d_k]}\n")
    text = text.replace("update:\n", "update:\n  - c = c + k\n")
    ds = diags_of(text)
    assert [(d.code, d.message) for d in ds] == [
        ("E-state-unwritten", "state 'z' is never written"),
        ("E-state-unread", "state 'z' is never read"),
        ("E-state-unread", "state 'c' is never read by the output: its value does not reach the read"),
    ]
    assert [d.span.line for d in ds] == [7, 7, 8]


def test_state_live_through_another_state():
    # U only reaches the output through W at the next token: live
    text = BASE.replace("  W: {shape: [d_k, d_v]}\n", "  W: {shape: [d_k, d_v]}\n  U: {shape: [d_k, d_v]}\n")
    text = text.replace("  - W = W - eta * grad(loss, W)\n",
                        "  - W = W + U\n  - U = 0.9 * U - eta * grad(loss, W)\n")
    assert diags_of(text) == []


def test_grad_forms():
    two = BASE.replace("  W: {shape: [d_k, d_v]}\n", "  W: {shape: [d_k, d_v]}\n  b: {shape: [d_v]}\n")
    two = two.replace("u @ W", "u @ W + b").replace("  - W = W - eta * grad(loss, W)\n",
                                                    "  - W = W - eta * grad(loss)\n  - b = b - eta * grad(loss, b)\n")
    ds = diags_of(two)
    assert [d.code for d in ds] == ["E-grad"]
    assert ds[0].message == "grad(loss) is ambiguous: the model reads 2 states (W, b)"
    assert diags_of(BASE.replace("grad(loss, W)", "grad(loss)")) == []
    ds = diags_of(BASE.replace("loss: 0.5 * sum((f(k) - v)^2)\n", ""))
    assert [(d.code, d.message) for d in ds] == [("E-grad", "grad(loss, ...) but the spec declares no loss")]
    ds = diags_of(BASE.replace("grad(loss, W)", "grad(W, loss)"))
    assert [d.message for d in ds] == ["the first argument of grad must be 'loss', got 'W'"]
    ds = diags_of(BASE.replace("read: f(q)", "read: f(q) + grad(loss, W) @ q"))
    assert [d.message for d in ds] == ["grad(...) is only allowed in update statements"]


def test_grad_zero_warning():
    text = BASE.replace("  W: {shape: [d_k, d_v]}\n", "  W: {shape: [d_k, d_v]}\n  S: {shape: [d_k, d_v]}\n")
    text = text.replace("update:\n", "update:\n  - S = S - eta * grad(loss, S)\n").replace("read: f(q)",
                                                                                       "read: f(q) + q @ S")
    ds = diags_of(text)
    assert [(d.severity, d.code) for d in ds] == [("warning", "W-grad-zero")]
    assert ds[0].message == "the loss does not depend on 'S'; grad(loss, S) is always zero"


def test_lets():
    ok = BASE.replace("\nmodel:", "\nlet:\n  kn: l2norm(k)\n  kk: 2 * kn\nmodel:").replace("f(k)", "f(kk)")
    assert diags_of(ok) == []
    later = BASE.replace("\nmodel:", "\nlet:\n  kk: 2 * kn\n  kn: l2norm(k)\nmodel:").replace("f(k)", "f(kk)")
    ds = diags_of(later)
    assert [(d.code, d.message) for d in ds] == [("E-order", "let 'kk' uses the let 'kn', which is defined later")]
    cyc = BASE.replace("\nmodel:", "\nlet:\n  a: l2norm(b)\n  b: 2 * a\nmodel:").replace("f(k)", "f(a)")
    ds = diags_of(cyc)
    assert [(d.code, d.message) for d in ds] == [("E-cycle", "cycle within a step: a -> b -> a")]
    st = BASE.replace("\nmodel:", "\nlet:\n  p: k @ W\nmodel:").replace("read: f(q)", "read: f(q) + p")
    ds = diags_of(st)
    assert [(d.code, d.message) for d in ds] == [
        ("E-order", "let 'p' reads the state 'W'; lets are computed before the update")]
    mod = BASE.replace("\nmodel:", "\nlet:\n  p: f(k)\nmodel:").replace("read: f(q)", "read: f(q) + p")
    ds = diags_of(mod)
    assert [d.code for d in ds] == ["E-order"] and "cannot apply the model" in ds[0].message


def test_model_scope():
    ds = diags_of(BASE.replace("f(u) = u @ W", "f(u) = (u + q) @ W * eta"))
    assert [(d.code, d.message) for d in ds] == [
        ("E-order", "the model uses the view 'q'; a model may use only its argument 'u', states, params, constants "
                    "and dims"),
        ("E-order", "the model uses the gate 'eta'; a model may use only its argument 'u', states, params, "
                    "constants and dims")]
    ok = BASE.replace("dims: {", "constants: {c: 2.0}\nparams: {s: {shape: [d_v], init: ones}}\ndims: {")
    assert diags_of(ok.replace("f(u) = u @ W", "f(u) = c * (u @ W) * s + d_k")) == []


CACHE = """name: c
dims: {d_model: 8, heads: 2, d_k: 4, d_v: 4}
views: {q: d_k, k: d_k, v: d_v}
state:
  K: {shape: [d_k], cache: true, window: 16}
  V: {shape: [d_v], cache: true, window: 16}
update:
  - K = append(K, k)
  - V = append(V, v)
read: attend(q, K, V, d_k^(-0.5))
"""


def test_cache_rules():
    assert diags_of(CACHE) == []
    ds = diags_of(CACHE.replace("V = append(V, v)", "V = append(K, v)"))
    assert [d.code for d in ds] == ["E-cache", "E-shape"]
    assert ds[0].message == "append onto 'K' assigned to 'V'"
    ds = diags_of(CACHE.replace("V = append(V, v)", "V = V * 2"))
    assert [d.message for d in ds] == ["the cache 'V' is only updated as V = append(V, k)"]
    ds = diags_of(CACHE.replace("read: attend(q, K, V, d_k^(-0.5))", "read: attend(q, K, append(V, v), 1.0)"))
    assert sorted(d.code for d in ds) == ["E-cache", "E-cache"]
    ds = diags_of(CACHE.replace("attend(q, K, V,", "attend(q, K, v,"))
    assert [d.message for d in ds] == ["attend(q, K, V, scale) reads cache states; 'v' is not a cache"]
    ds = diags_of(CACHE.replace("  - K = append(K, k)\n", "  - K = append(K, k)\n  - K = append(K, k) * 2\n"))
    assert "append(K, k) is only allowed as a whole statement K = append(K, k)" in [d.message for d in ds]
    ds = diags_of(BASE.replace("W = W - eta * grad(loss, W)", "W = append(W, k)"))
    assert "append(K, k) pushes onto a cache state; 'W' is not a cache" in [d.message for d in ds]
    ds = diags_of(CACHE.replace("grad", "g") + "")  # no grad at all: fine
    assert ds == []


def test_window_only_on_caches():
    with pytest.raises(memspec.SpecError, match="window is only meaningful for a cache state"):
        memspec.loads(BASE.replace("W: {shape: [d_k, d_v]}", "W: {shape: [d_k, d_v], window: 4}"))


@pytest.mark.parametrize("init,warns", [("uniform(-1, 1)", True), ("learned(uniform(0.0, 2.0))", True),
                                        ("learned(normal(0.1))", True), ("uniform(0.5, 1.5)", False),
                                        ("ones", False), ("learned(uniform(0.5, 1.5))", False)])
def test_log_of_a_state_warns_when_its_init_can_be_nonpositive(init, warns):
    """log(W) of a state whose init can hold zero or negative entries warns; a uniform init warns
    exactly when its lower bound is <= 0."""
    text = BASE.replace("  W: {shape: [d_k, d_v]}\n", f"  W: {{shape: [d_k, d_v], init: '{init}'}}\n").replace(
        "read: f(q)", "read: q @ log(W)")
    assert (("warning", "W-log-state") in codes(text)) == warns


def test_unused_warnings_only_for_valid_specs():
    text = BASE.replace("dims: {d_model: 8,", "dims: {d_model: 8, spare: 3,").replace(
        "gates: {eta: sigmoid(logit)}", "gates: {eta: sigmoid(logit), mu: sigmoid(logit)}\nconstants: {c: 1.0}")
    assert codes(text) == [("warning", "W-unused")] * 3
    assert [d.message for d in diags_of(text)] == ["dim 'spare' is never used", "gate 'mu' is never used",
                                                   "constant 'c' is never used"]
    # with an error the warnings are held back (they would mostly echo the error)
    assert codes(text.replace("read: f(q)", "read: f(qq)")) == [("error", "E-unknown-name")]


def test_duplicates_across_sections():
    text = BASE.replace("  W: {shape: [d_k, d_v]}\n", "  W: {shape: [d_k, d_v]}\n  k: {shape: [d_k]}\n")
    ds = diags_of(text)
    assert [(d.code, d.message) for d in ds] == [
        ("E-duplicate", "'k' is declared twice: as a view at line 3 and as a state")]
    assert (ds[0].span.line, ds[0].span.col) == (7, 3)


@pytest.mark.parametrize("name,problem", [
    ("W; import os", "is not a plain identifier"),
    ("2x", "is not a plain identifier"),
    ("a-b", "is not a plain identifier"),
    ("é", "is not a plain identifier"),
    ("", "is not a plain identifier"),
    ("_x", "starts with '_'"),
    ("__class__", "starts with '_'"),
    ("lambda", "is a Python keyword"),
    ("None", "is a Python keyword"),
    ("len", "is a Python builtin"),
    ("print", "is a Python builtin"),
    ("exp", "is the name of the function exp(...)"),
    ("grad", "is the name of the function grad(...)"),
    ("torch", "is reserved"), ("F", "is reserved"), ("self", "is reserved"), ("x", "is reserved"),
    ("o", "is reserved"), ("state", "is reserved"), ("schedule", "is reserved"), ("logit", "is reserved"),
])
def test_identifier_problem(name, problem):
    assert problem in identifier_problem(name)[0]


@pytest.mark.parametrize("name", ["W", "eta", "d_k", "W1", "kn", "lam", "ln_w", "alpha", "K"])
def test_identifier_ok(name):
    assert identifier_problem(name) is None


def test_reserved_names_cover_the_documented_set():
    assert {"torch", "nn", "F", "math", "self", "state", "schedule", "x", "o", "logit"} <= RESERVED_NAMES
    for n in RESERVED_NAMES:
        assert identifier_problem(n) is not None
    for n in list(FUNCTIONS) + keyword.kwlist + ["len", "sum", "id"]:
        assert identifier_problem(n) is not None
    assert all(identifier_problem(n) is not None for n in dir(builtins))


def test_every_declared_name_is_checked():
    sections = {
        "dims": "dims: {d_model: 8, heads: 2, d_k: 4, d_v: 4, len: 2}",
        "constants": "constants: {print: 1.0}",
        "views": "views: {q: d_k, k: d_k, v: d_v, id: d_k}",
        "params": "params: {torch: {shape: [d_k]}}",
        "let": "let: {self: 2 * k}",
    }
    for sec, line in sections.items():
        text = BASE
        if sec == "dims":
            text = text.replace("dims: {d_model: 8, heads: 2, d_k: 4, d_v: 4}", line)
        elif sec == "views":
            text = text.replace("views: {q: d_k, k: d_k, v: d_v}", line)
        else:
            text = text.replace("\nmodel:", "\n" + line + "\nmodel:")
        ds = [d for d in diags_of(text) if d.code == "E-identifier"]
        assert len(ds) == 1, (sec, [d.render() for d in ds])
    ds = diags_of(BASE.replace("f(u) = u @ W", "f(x) = x @ W"))
    assert [d.message for d in ds] == ["model argument 'x' is reserved: the generated code uses it"]
    ds = diags_of(BASE.replace("f(u) = u @ W", "sum(u) = u @ W"))
    assert "model name 'sum' is the name of the function sum(...)" in [d.message for d in ds]


def test_injected_key_is_one_clear_error():
    text = BASE.replace("  W: {shape: [d_k, d_v]}\n", "  W: {shape: [d_k, d_v]}\n  \"Z; import os\": {shape: [d_k]}\n")
    ds = diags_of(text)
    assert [(d.code, d.message) for d in ds] == [
        ("E-identifier", "state name 'Z; import os' is not a plain identifier")]
    assert (ds[0].span.line, ds[0].span.col) == (7, 3)


def test_mem_spans_point_at_names():
    text = """memory t
dims { d_model = 8, heads = 2, d_k = 4, d_v = 4 }
view q : d_k
view k : d_k
view v : d_v
gate eta = sigmoid(logit)
state W : [d_k, d_v] = zeros
state W2 : [d_k, d_v] = zeros
model f(u) = u @ W
loss = 0.5 * sum((f(k) - v)^2)
update { W = W - eta * grad(loss, W) }
read = f(q)
"""
    ds = diags_of(text, "mem")
    assert [(d.code, d.span.line, d.span.col) for d in ds] == [
        ("E-state-unwritten", 8, 7), ("E-state-unread", 8, 7)]


def test_every_diagnostic_is_located():
    for path in sorted((ROOT / "tests" / "bad_specs").glob("*.*")):
        if path.suffix not in (".yaml", ".mem"):
            continue
        try:
            spec = memspec.load(path)
        except memspec.SpecError as err:
            assert all(d.span is not None for d in err.diagnostics), path
            continue
        _, ds = check(spec)
        assert ds and all(d.span is not None and d.span.line >= 1 for d in ds), path


SPECS = sorted(p for p in (ROOT / "specs").glob("*") if p.suffix in (".yaml", ".mem"))


@pytest.mark.skipif(not SPECS, reason="no shipped specs yet")
def test_shipped_specs_are_clean():
    for p in SPECS:
        _, ds = check(memspec.load(p))
        assert ds == [], "\n".join(d.render() for d in ds)
