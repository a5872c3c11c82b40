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


def _counting(m, name):
    """Wrap m.<name> so that its calls are counted (the list it returns grows by one per call)."""
    calls, fn = [], getattr(m, name)

    def counted(*args):
        calls.append(1)
        return fn(*args)
    setattr(m, name, counted)
    return calls


@pytest.mark.parametrize("use_state", [True, False], ids=["state-used", "state-dropped"])
def test_last_chunk_split_gives_the_reference_gradients(use_state):
    """Under autograd a call whose last chunk is whole runs it as a read and an update
    (``_read_fn``, ``_learn_fn``): outputs, final state and the gradients of every input and
    parameter are the reference interpreter's (float64), whether the loss reads the final
    state or drops it."""
    spec, dims, m = _lact()
    ins, st = inputs(spec, m, T=12, requires_grad=True), initial_state(spec, m)
    reads, learns = _counting(m, "_read_fn"), _counting(m, "_learn_fn")
    g = torch.Generator().manual_seed(3)
    o, s = call(m, spec, ins, dict(st), "apply_update")
    assert (len(reads), len(learns)) == (1, 1)       # the split ran, once
    ro, rs = reference_run(spec, m, dims, "apply_update", st, ins)
    torch.testing.assert_close(o, ro, rtol=1e-10, atol=1e-12)
    w_o = torch.randn(o.shape, generator=g, dtype=o.dtype)
    ws = {n: torch.randn(s[n].shape, generator=g, dtype=o.dtype) for n in ("W0", "W1", "W2")}

    def scalar(out, states):
        return (out * w_o).sum() + (sum((states[n] * w).sum() for n, w in ws.items()) if use_state else 0)

    wrt = list(ins.values()) + list(m.parameters())
    for a, b in zip(torch.autograd.grad(scalar(o, s), wrt), torch.autograd.grad(scalar(ro, rs), wrt)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_no_split_without_autograd_or_inside_a_chunk():
    """The split is for a whole last chunk under autograd only: without autograd, or when the
    call ends inside a chunk, the last chunk runs as one step."""
    spec, _, m = _lact()
    st = initial_state(spec, m)
    learns = _counting(m, "_learn_fn")
    for T, grad in ((12, False), (10, True), (14, True)):
        ins = inputs(spec, m, T=T, requires_grad=grad)
        with torch.set_grad_enabled(grad):
            call(m, spec, ins, dict(st), "apply_update")
        assert not learns, (T, grad)


@pytest.mark.slow
def test_compiled_last_chunk_split_equals_eager():
    """compile=True: the split's two graphs give eager's outputs and gradients."""
    spec, _, eager = _lact(dtype=torch.float32)
    _, _, comp = _lact(compile=True, dtype=torch.float32)
    comp.load_state_dict(eager.state_dict())
    ins = inputs(spec, eager, T=8, dtype=torch.float32, requires_grad=True)
    wrt = list(ins.values())
    got = []
    for m in (eager, comp):
        o, s = call(m, spec, ins, None, "apply_update")
        got.append(torch.autograd.grad(o.square().sum() + s["W1"].sum(), wrt + list(m.parameters())))
    assert comp._learn_fn.compiled is not None and comp._learn_fn.seconds is not None   # compiled, ran
    for a, b in zip(*got):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


def test_write_read_rows_step_gives_the_reference_numbers(tmp_path):
    """order: write_read (each chunk's last token reads the updated state): the rows step reads
    that row anew, and a whole last chunk is never split (its read needs the update).  Outputs,
    state and gradients against the reference interpreter (float64)."""
    path = tmp_path / "lact_wr.yaml"
    path.write_text("extends: memspec:lact\nname: lact_wr\norder: write_read\n", encoding="utf-8")
    spec = load(str(path))
    dims = small_dims(spec)
    m = make(spec, dims, chunk=4)
    assert not hasattr(m, "_learn_fn")
    ins, st = inputs(spec, m, T=12, requires_grad=True), initial_state(spec, m)
    o, s = call(m, spec, ins, dict(st), "apply_update")
    ro, rs = reference_run(spec, m, dims, "apply_update", st, ins)
    torch.testing.assert_close(o, ro, rtol=1e-10, atol=1e-12)
    for n in ("W0", "W1", "W2"):
        torch.testing.assert_close(s[n], rs[n], rtol=1e-10, atol=1e-12)
    wrt = list(ins.values()) + list(m.parameters())
    mine = torch.autograd.grad(o.square().sum() + s["W1"].sum(), wrt)
    ref = torch.autograd.grad(ro.square().sum() + rs["W1"].sum(), wrt)
    for a, b in zip(mine, ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
