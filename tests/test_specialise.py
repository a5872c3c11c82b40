"""Kernels specialised to the constant arguments a module passes (memspec.codegen.specialise):
the same numbers as the general kernel for every binding, the decided branches gone."""
from __future__ import annotations

import inspect
import itertools

import pytest
import torch

from memspec.codegen.specialise import specialise, specialise_calls
from memspec.runtime.additive import chunk_additive
from memspec.runtime.delta import chunk_delta


def _load(src: str, name: str):
    ns = {"torch": torch}
    exec(compile(src, f"<specialised {name}>", "exec"), ns)
    return ns[name]


def _inputs(T=37, B=2, H=2, K=5, V=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return dict(q=r(B, T, H, K), k=r(B, T, H, K) / K ** 0.5, v=r(B, T, H, V),
                beta=torch.sigmoid(r(B, T, H)), log_gamma=-torch.rand(B, T, H, generator=g, dtype=torch.float64),
                log_rho=-torch.rand(B, T, H, generator=g, dtype=torch.float64), S0=r(B, H, K, V))


@pytest.mark.parametrize("decay,inclusive", itertools.product([False, True], [False, True]))
def test_chunk_additive_specialised_equals_general(decay, inclusive):
    x = _inputs()
    consts = {"inclusive": inclusive, "group": None}
    if not decay:
        consts["log_gamma"] = None
    fn = _load(specialise(chunk_additive, **consts), "chunk_additive")
    lg = x["log_gamma"] if decay else None
    want = chunk_additive(x["q"], x["k"], x["v"], lg, x["S0"], 8, inclusive=inclusive)
    args = [x["q"], x["k"], x["v"]] + ([lg] if decay else []) + [x["S0"], 8]
    got = fn(*args)
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    sig = inspect.signature(fn)
    assert "inclusive" not in sig.parameters and ("log_gamma" in sig.parameters) == decay


@pytest.mark.parametrize("decay,rho,inclusive", itertools.product([False, True], [False, True], [False, True]))
def test_chunk_delta_specialised_equals_general(decay, rho, inclusive):
    x = _inputs()
    consts = {"inclusive": inclusive}
    if not decay:
        consts["log_gamma"] = None
    if not rho:
        consts["log_rho"] = None
    src = specialise(chunk_delta, **consts)
    fn = _load(src, "chunk_delta")
    lg = x["log_gamma"] if decay else None
    lr = x["log_rho"] if rho else None
    want = chunk_delta(x["q"], x["k"], x["v"], x["beta"], lg, x["S0"], 8, log_rho=lr, inclusive=inclusive)
    kw = {"log_rho": lr} if rho else {}
    got = fn(x["q"], x["k"], x["v"], x["beta"], *([lg] if decay else []), x["S0"], 8, **kw)
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    if not decay and not rho:
        assert "if decayed" not in src and "decayed =" not in src and "log_gamma is not None" not in src
    assert "Specialised for this module:" in src


def test_calls_lose_their_constant_arguments():
    code = ("o, S = chunk_delta(qn, kn, v, eta, None, state['W'], self.chunk, log_rho=None, inclusive=True)\n"
            "o2, S2 = chunk_delta(qn, kn, v, eta, None, S, self.chunk, log_rho=None, inclusive=True)\n")
    new, src = specialise_calls(code, chunk_delta)
    assert new == ("o, S = chunk_delta(qn, kn, v, eta, state['W'], self.chunk)\n"
                   "o2, S2 = chunk_delta(qn, kn, v, eta, S, self.chunk)\n")
    assert src.startswith("def chunk_delta(q, k, v, beta, S0, chunk):")


def test_arguments_that_differ_between_calls_stay():
    code = ("a = chunk_delta(q, k, v, b, None, S, 8, inclusive=True)\n"
            "c = chunk_delta(q, k, v, b, lg, S, 8, inclusive=True)\n")
    new, src = specialise_calls(code, chunk_delta)
    assert "a = chunk_delta(q, k, v, b, None, S, 8)" in new and "c = chunk_delta(q, k, v, b, lg, S, 8)" in new
    assert src.startswith("def chunk_delta(q, k, v, beta, log_gamma, S0, chunk):")   # log_rho: never passed


def test_a_reassigned_parameter_is_refused():
    def f(x, flag=None):
        flag = x if flag is None else flag
        return flag

    with pytest.raises(TypeError, match="reassigns flag"):
        specialise(f, flag=None)
