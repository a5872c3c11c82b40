"""The normal form S_t = T_t(S_{t-1}) + W_t (memspec.schedule.transition).

* Written back as a spec (``as_expr``), the normal form of every shipped memory that is
  linear in its state is the same memory: the reference interpreter gives the same outputs
  and states token by token (float64, to 1e-12).
* The same memory written differently -- explicit error vs ``grad``, temporaries vs inline,
  renamed, a decay written as ``diag(d) @ S``, ``(S.T * d).T``, ``S - diag(1 - d) @ S`` or in
  a let -- has the same normal form (compared by meaning).
* The printed form, pinned for a few specs.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import memspec
from memspec import reference
from memspec.lang.expr import Assign, Name
from memspec.lang.normalize import canon
from memspec.schedule.algebra import SHOW_LETS, Algebra, NotAdmitted
from memspec.schedule.transition import as_expr, describe, normal_form

SPECS = Path(__file__).resolve().parent.parent / "specs"
LINEAR = ["linear_attention", "deltanet", "deltanet_textbook", "gated_deltanet", "longhorn", "mesa", "gla", "rwkv6",
          "hgrn2", "retention", "mamba2", "kda", "gdn2", "comba", "rwkv7", "gated_deltaproduct",
          "momentum_deltanet"]


def _nf(spec):
    alg = Algebra(spec)
    return alg, normal_form(alg)


def _written_back(spec):
    """The spec with its update program replaced by its normal form (every state's new value
    from the states before the token, through temporaries): no grad(...) left."""
    alg, nf = _nf(spec)
    temps = [Assign(f"{n}_next", as_expr(nf.maps[n])) for n in spec.state]
    stmts = temps + [Assign(n, Name(f"{n}_next")) for n in spec.state]
    return spec.model_copy(update={"update": stmts})


def _inputs(spec, dims, B=2, T=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = {v: torch.randn(B, T, 2, dims[view.dim], generator=g, dtype=torch.float64) for v, view in spec.views.items()}
    for n, gate in spec.gates.items():
        out[n] = 0.05 + 0.6 * torch.rand(B, T, 2, *(dims[d] for d in gate.shape), generator=g, dtype=torch.float64)
    return out


@pytest.mark.parametrize("name", LINEAR)
def test_the_normal_form_is_the_same_memory(name):
    spec = memspec.load(SPECS / f"{name}.yaml")
    dims = {"d_k": 3, "d_v": 4, "heads": 2}
    spec = spec.with_dims(**{k: v for k, v in dims.items() if k in spec.dims})
    back = _written_back(spec)
    ins = _inputs(spec, spec.dims)
    g = torch.Generator().manual_seed(3)
    state = {n: 0.3 * torch.randn(2, 2, *(spec.dims[d] for d in st.shape), generator=g, dtype=torch.float64)
             for n, st in spec.state.items()}
    params = {n: 0.2 * torch.randn(2, *(spec.dims[d] for d in p.shape), generator=g, dtype=torch.float64)
              for n, p in spec.params.items()}
    a, sa = reference.run(spec, state=dict(state), params=params, **ins)
    b, sb = reference.run(back, state=dict(state), params=params, **ins)
    assert torch.allclose(a, b, atol=1e-12, rtol=0)
    for n in spec.state:
        assert torch.allclose(sa[n], sb[n], atol=1e-12, rtol=0), n


def _spec(update: list[str], extra: str = "", lets: str = "") -> memspec.Spec:
    text = f"""\
name: v
dims: {{d_k: 4, d_v: 3}}
views: {{q: d_k, k: d_k, v: d_v, a: d_k}}
gates:
  eta: sigmoid(logit)
  alpha: {{formula: sigmoid(logit), shape: [d_k]}}
state:
  S: {{shape: [d_k, d_v]}}
{lets}{extra}update:
""" + "".join(f"  - {u}\n" for u in update) + "read: q @ S\n"
    return memspec.loads(text)


def _canon_map(spec):
    alg, nf = _nf(spec)
    return canon(as_expr(nf.maps["S"]))


GRAD = "model: f(u) = u @ S\nloss: 0.5 * sum((f(k) - v)^2)\n"


@pytest.mark.parametrize("variant", [
    (["S = S + eta * outer(k, v - k @ S)"], ""),
    (["S = S - eta * grad(loss, S)"], GRAD),
    (["S = S - eta * grad(loss)"], GRAD),
    (["g = grad(loss, S)", "S = S - eta * g"], GRAD),
    (["e = v - k @ S", "S = S + outer(k, eta * e)"], ""),
    (["S = (eye(d_k) - eta * outer(k, k)) @ S + eta * outer(k, v)"], ""),
    (["S = S - outer(eta * k, k @ S - v)"], ""),
])
def test_the_delta_rule_written_five_ways_has_one_normal_form(variant):
    update, extra = variant
    base = _canon_map(_spec(["S = S + eta * outer(k, v - k @ S)"]))
    assert _canon_map(_spec(update, extra)) == base


@pytest.mark.parametrize("decay", ["diag(1 - alpha) @ S", "(S.T * (1 - alpha)).T", "S - diag(alpha) @ S",
                                   "diag(keep) @ S", "S.T.T - (S.T * alpha).T"])
def test_a_row_scaling_written_any_way_is_one_transition(decay):
    base = _canon_map(_spec(["S = diag(1 - alpha) @ S + outer(k, v)"]))
    lets = "let:\n  keep: 1 - alpha\n"
    spec = _spec([f"S = {decay} + outer(k, v)"], lets=lets)
    alg, nf = _nf(spec)
    # the normal form is one Diag factor whatever the spelling
    (term,) = nf.maps["S"].terms
    assert term.left.kind == "diag" and term.right.kind == "I"
    assert canon(as_expr(nf.maps["S"])) == base


def test_a_renamed_memory_has_the_renamed_normal_form():
    a = _spec(["S = diag(1 - alpha) @ S", "S = S + eta * outer(k, v - k @ S)"])
    text = memspec.lang.fmt.to_yaml(a).replace("S", "M").replace("eta", "beta")
    b = memspec.loads(text)
    la, lb = describe(_nf(a)[1], Algebra(a)), describe(_nf(b)[1], Algebra(b))
    assert [x.replace("S", "M").replace("eta", "beta") for x in la] == lb


def test_printed_normal_forms():
    """The normal form in the spec's names, as explain prints it."""
    want = {
        "deltanet": ["W <- T(W) + A with T = I - eta kn knᵀ; A = eta kn vᵀ"],
        "gated_deltanet": ["W <- T(W) + A with T = (1 - alpha) I - eta * (1 - alpha) kn knᵀ; A = eta kn vᵀ"],
        "gla": ["S <- T(S) + W with T = Diag(1 - alpha); W = k vᵀ"],
        "kda": ["W <- T(W) + A with T = Diag(1 - alpha) - eta kn (kn * (1 - alpha))ᵀ; A = eta kn vᵀ"],
        "comba": ["S <- T(S) + W with T = (1 - alpha) I - eta * (1 - alpha) kn pnᵀ; W = eta kn vᵀ"],
        "rwkv7": ["S <- T(S) + W with T = Diag(1 - alpha) - (eta * kh) khᵀ; W = k vᵀ"],
        "momentum_deltanet": [
            "W <- T(W) + A with T[W <- W] = (1 - alpha) I - eta kn knᵀ; T[W <- U] = mu I; A = eta kn vᵀ",
            "U <- T(U) + A with T[U <- W] = -eta kn knᵀ; T[U <- U] = mu I; A = eta kn vᵀ"],
        "linear_attention": ["S <- T(S) + W with T = I; W = kf vᵀ", "z <- T(z) + W with T = I; W = kf"],
    }
    for name, lines in want.items():
        spec = memspec.load(SPECS / f"{name}.yaml")
        alg, nf = _nf(spec)
        token = SHOW_LETS.set(tuple((inl, n) for n, inl in alg.lets.items() if not isinstance(inl, Name)))
        try:
            assert describe(nf, alg) == lines, name
        finally:
            SHOW_LETS.reset(token)


@pytest.mark.parametrize("update, why", [
    (["S = S * S"], "multiplies the state by the state"),
    (["S = S + outer(k, tanh(k @ S))"], "not polynomial in the state"),
    (["S = S.T + outer(k, v)"], "transposes the state"),
    (["S = outer(k @ S, k @ S) + S"], "outer product of two values that depend on the state"),
])
def test_what_is_not_linear_in_the_state_says_why(update, why):
    spec = _spec(update) if "S.T +" not in update[0] else memspec.loads(
        "name: v\ndims: {d: 3}\nviews: {q: d, k: d, v: d}\nstate:\n  S: {shape: [d, d]}\n"
        f"update:\n  - {update[0]}\nread: q @ S\n")
    with pytest.raises(NotAdmitted, match=why):
        _nf(spec)


# ------------------------------------------------------------------ diagonal plus low rank (the dplr plans)
from memspec.lang.expr import unparse  # noqa: E402
from memspec.schedule.dplr import analyse_dplr  # noqa: E402


def _dplr(spec):
    alg = Algebra(spec)
    return analyse_dplr(alg)[0]


def _steps_text(plan):
    return [tuple(None if x is None else unparse(x) for x in (st.a, st.b, st.k, st.v)) for st in plan.steps]


def test_dplr_plans_of_the_shipped_specs():
    """Each step's a, b, k, v in the kernel's form (a scalar times the step's key where it is one,
    b omitted where it is the key), the decay on the first step."""
    want = {   # (decay, read after the decay, a form, b form, steps (a, b, k, v))
        "kda": ("1 - alpha", True, "scalar", "key", [("-eta", None, "l2norm(k)", "eta * v")]),
        "gdn2": ("1 - alpha", True, "scalar", "vector", [("-1", "eta_k * l2norm(k)", "l2norm(k)", "eta_v * v")]),
        "comba": ("1 - alpha", True, "scalar", "vector", [("-eta", "l2norm(p)", "l2norm(k)", "eta * v")]),
        "rwkv7": ("1 - alpha", False, "vector", "vector",
                  [("-(eta * l2norm(k * xi))", "l2norm(k * xi)", "k", "v")]),
        "gated_deltaproduct": ("1 - alpha", True, "scalar", "key",
                               [("-eta1", None, "l2norm(k1)", "eta1 * v1"), ("-eta2", None, "l2norm(k2)", "eta2 * v2")]),
    }
    for name, (decay, after, a_form, b_form, steps) in want.items():
        plan = _dplr(memspec.load(SPECS / f"{name}.yaml"))
        assert (unparse(plan.decay), plan.read_after_decay, plan.a_form, plan.b_form) == (decay, after, a_form,
                                                                                           b_form), name
        assert _steps_text(plan) == steps, name
        assert not plan.simultaneous


@pytest.mark.parametrize("update, extra", [
    (["S = diag(1 - alpha) @ S", "S = S - eta * grad(loss, S)"], GRAD),
    (["S = diag(1 - alpha) @ S", "S = S + eta * outer(k, v - k @ S)"], ""),
    (["S = diag(1 - alpha) @ S + eta * outer(k, v - k @ (diag(1 - alpha) @ S))"], ""),
    (["S = (eye(d_k) - eta * outer(k, k)) @ (diag(1 - alpha) @ S) + eta * outer(k, v)"], ""),
])
def test_kda_written_four_ways_has_one_plan(update, extra):
    base = _dplr(_spec(["S = diag(1 - alpha) @ S", "S = S + eta * outer(k, v - k @ S)"]))
    plan = _dplr(_spec(update, extra))
    assert canon(plan.decay) == canon(base.decay)
    assert (plan.read_after_decay, plan.a_form, plan.b_form) == (base.read_after_decay, base.a_form, base.b_form)
    assert len(plan.steps) == len(base.steps) == 1
    for a, b in zip(plan.steps, base.steps):
        for x, y in ((a.a, b.a), (a.b, b.b), (a.k, b.k), (a.v, b.v)):
            assert (x is None and y is None) or canon(x) == canon(y)


def test_deltaproduct_steps_stay_in_order_and_a_rank_two_statement_is_simultaneous():
    two = _dplr(_spec(["S = S + eta * outer(k, v - k @ S)", "S = S + eta * outer(a, v - a @ S)"]))
    assert len(two.steps) == 2 and not two.simultaneous
    assert [unparse(st.k) for st in two.steps] == ["k", "a"]
    one = _dplr(_spec(["S = S + eta * outer(k, v - k @ S) + eta * outer(a, v - a @ S)"]))
    assert len(one.steps) == 2 and one.simultaneous


def test_a_second_decay_after_a_rank_one_step_is_not_dplr():
    spec = _spec(["S = S + eta * outer(k, v - k @ S)", "S = diag(1 - alpha) @ S + eta * outer(a, v - a @ S)"])
    with pytest.raises(NotAdmitted, match="decays it again"):
        _dplr(spec)
