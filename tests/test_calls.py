"""Kernel calls as structure (memspec.codegen.calls): the module frame binds the parameters every
call passes the same constant and writes each call without them; no generated text is read back."""
from __future__ import annotations

import pytest

from memspec.codegen.calls import Code, KernelCall, bound_constants
from memspec.codegen.specialise import specialise
from memspec.runtime.delta import chunk_delta


def _calls():
    return [KernelCall.of("o, S", chunk_delta, ["qn", "kn", "v", "eta", "None", "state['W']", "self.chunk"],
                          dict(log_rho=Code("None"), inclusive=True)),
            KernelCall.of("o2, S2", chunk_delta, ["qn", "kn", "v", "eta", "lg", "S", "self.chunk"],
                          dict(log_rho=Code("None"), inclusive=True), comment="[B, T, H, d_v]")]


def test_a_call_is_written_as_given():
    first, second = _calls()
    assert first.text() == ("o, S = chunk_delta(qn, kn, v, eta, None, state['W'], self.chunk, log_rho=None, "
                            "inclusive=True)")
    assert second.text().endswith("inclusive=True)  # [B, T, H, d_v]")
    assert first.with_keywords(documents=Code("docs")).text().endswith("inclusive=True, documents=docs)")


def test_the_constants_every_call_passes_are_bound_and_left_out():
    calls = _calls()
    consts = bound_constants(chunk_delta, calls)
    assert consts["log_rho"] is None and consts["inclusive"] is True and consts["documents"] is None
    assert "log_gamma" not in consts                         # None in one call, an expression in the other
    assert calls[0].text(frozenset(consts)) == "o, S = chunk_delta(qn, kn, v, eta, None, state['W'], self.chunk)"
    assert specialise(chunk_delta, **consts).startswith("def chunk_delta(q, k, v, beta, log_gamma, S0, chunk")
    assert bound_constants(chunk_delta, []) == {}


def test_a_parameter_the_kernel_lacks_is_refused():
    with pytest.raises(TypeError, match="no parameter 'nope'"):
        KernelCall.of("o", chunk_delta, ["q"], dict(nope=True))
    with pytest.raises(TypeError, match="no parameter 'nope'"):
        _calls()[0].with_keywords(nope=Code("x"))
