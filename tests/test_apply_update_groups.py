"""apply_update's whole chunks in groups (one call of ``_update_chunks`` for up to 256 tokens,
one compiled graph under ``compile=True``): the numbers of one chunk at a time.

With chunk 4 a group is 8 chunks (32 tokens); T = 75 runs two groups, then single chunks and a
piece of one.  Compared with the reference interpreter's apply_update (float64), with streaming
the same tokens in pieces that start inside chunks and groups, and with gradients.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from _compiled_harness import call, initial_state, inputs, load, make, reference_run, small_dims  # noqa: E402


def _lact(compile=False, dtype=torch.float64):
    spec = load("specs/lact.yaml")
    dims = small_dims(spec)
    return spec, dims, make(spec, dims, chunk=4, dtype=dtype, compile=compile)


def test_groups_of_whole_chunks_give_the_reference_numbers():
    spec, dims, m = _lact()
    ins, st = inputs(spec, m, T=75), initial_state(spec, m)
    with torch.no_grad():
        o, s = call(m, spec, ins, dict(st), "apply_update")
        ro, rs = reference_run(spec, m, dims, "apply_update", st, ins)
    torch.testing.assert_close(o, ro, rtol=1e-10, atol=1e-12)
    for n in ("W0", "W1", "W2"):
        torch.testing.assert_close(s[n], rs[n], rtol=1e-10, atol=1e-12)


def test_streaming_through_groups_equals_one_call():
    spec, _, m = _lact()
    ins, st = inputs(spec, m, T=75), initial_state(spec, m)
    with torch.no_grad():
        whole, s_whole = call(m, spec, ins, dict(st), "apply_update")
        state, outs = dict(st), []
        for a, b in ((0, 5), (5, 45), (45, 75)):   # pieces that start inside a chunk and a group
            piece = {n: t[:, a:b] for n, t in ins.items()}
            o, state = call(m, spec, piece, state, "apply_update")
            outs.append(o)
    torch.testing.assert_close(torch.cat(outs, 1), whole, rtol=1e-12, atol=1e-12)
    for n in ("W0", "W1", "W2"):
        torch.testing.assert_close(state[n], s_whole[n], rtol=1e-12, atol=1e-12)


def test_gradients_through_groups_are_the_single_chunk_gradients():
    """The same chunks run one at a time (T not reaching a group: pieces of 28 tokens) and in
    groups: the gradients of every input and parameter agree."""
    spec, _, m = _lact()
    ins, st = inputs(spec, m, T=56, requires_grad=True), initial_state(spec, m)

    def grads(pieces):
        state, outs = dict(st), []
        for a, b in pieces:
            o, state = call(m, spec, {n: t[:, a:b] for n, t in ins.items()}, state, "apply_update")
            outs.append(o)
        loss = torch.cat(outs, 1).square().sum() + sum(state[n].square().sum() for n in ("W0", "W1", "W2"))
        return torch.autograd.grad(loss, list(ins.values()) + list(m.parameters()))

    grouped, single = grads([(0, 56)]), grads([(0, 28), (28, 56)])
    for a, b in zip(grouped, single):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.slow
def test_compiled_groups_equal_eager():
    spec, _, eager = _lact(dtype=torch.float32)
    _, _, comp = _lact(compile=True, dtype=torch.float32)
    comp.load_state_dict(eager.state_dict())
    ins = inputs(spec, eager, T=75, dtype=torch.float32)
    with torch.no_grad():
        a, sa = call(eager, spec, ins, None, "apply_update")
        b, sb = call(comp, spec, ins, None, "apply_update")
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert comp._chunks_fn.compiled is not None and comp._chunks_fn.seconds is not None   # compiled, ran
    for n in ("W0", "W1", "W2"):
        torch.testing.assert_close(sb[n], sa[n], rtol=1e-5, atol=1e-5)
