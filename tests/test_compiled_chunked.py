"""compile=True on the exact chunked schedules: the chunked forward runs over slices of
SLICE_CHUNKS chunks, every full slice through one compiled graph (static shapes: compiled
once, whatever T), the tail eagerly, the state carried between slices.

That is exact because a chunked forward's token-local values (lets, gates, log decays) and its
chunks do not depend on where the sequence is cut at a chunk boundary: checked here for every
shipped spec with a chunked schedule, eagerly (float64), and under torch.compile for one spec in
the default run and one per kernel family in the slow run (forward and gradients)."""
from __future__ import annotations

import warnings

import pytest
import torch
from _compiled_harness import SPEC_FILES, inputs, make, small_dims

import memspec
from memspec.codegen.module import CHUNKED, SLICE_CHUNKS
from memspec.runtime import helpers
from memspec.schedule import analyse


def chunked_specs():
    out = []
    for path in SPEC_FILES:
        spec = memspec.load(path)
        decision = analyse(spec)
        fams = [s for s in decision.schedules if s in CHUNKED]
        if fams:
            out.append((path, fams[0]))
    return out


CHUNKED_SPECS = chunked_specs()


def test_every_chunked_family_has_a_shipped_spec():
    assert {fam for _, fam in CHUNKED_SPECS} == CHUNKED


def run_sliced(m, spec, ins, state, size, step):
    # the copy the module carries (modules whose chunked forward is never compiled carry none)
    in_slices = type(m).forward.__globals__.get("_in_slices", helpers._in_slices)
    tensors = tuple(ins[n] for n in (*spec.views, *spec.gates))
    return in_slices(step, m._forward_chunk, size, tensors, state)


@pytest.mark.parametrize("path,family", CHUNKED_SPECS, ids=[p.split("/")[-1] for p, _ in CHUNKED_SPECS])
def test_slices_equal_one_call(path, family):
    """Every shipped chunked spec: slices of 2 chunks (and a tail of 3 tokens), the state
    carried, equal one call over all tokens (outputs and states, float64)."""
    spec = memspec.load(path)
    m = make(spec, small_dims(spec), chunk=4)
    ins = inputs(spec, m, T=19)
    state = m.init_state(2, dtype=torch.float64)
    calls = []

    def step(*args):
        calls.append(args[0].shape[1])
        return m._forward_chunk(*args)

    with torch.no_grad():
        o, st = m._forward_chunk(*(ins[n] for n in (*spec.views, *spec.gates)), state)
        o2, st2 = run_sliced(m, spec, ins, state, 8, step)
    assert calls == [8, 8]   # the full slices went through the step, the tail (3 tokens) did not
    torch.testing.assert_close(o2, o, rtol=1e-10, atol=1e-12)
    assert st2.keys() == st.keys()
    for n in st:
        torch.testing.assert_close(st2[n], st[n], rtol=1e-10, atol=1e-12)


def test_slices_carry_the_state():
    """The check above can fail: slices that each restart from the initial state differ."""
    path, _ = CHUNKED_SPECS[0]
    spec = memspec.load(path)
    m = make(spec, small_dims(spec), chunk=4)
    ins = inputs(spec, m, T=16)
    state = m.init_state(2, dtype=torch.float64)
    with torch.no_grad():
        o, _ = m._forward_chunk(*(ins[n] for n in (*spec.views, *spec.gates)), state)
        o2, _ = run_sliced(m, spec, ins, state, 8, lambda *a: m._forward_chunk(*a[:-1], state))
    assert not torch.allclose(o2, o)


def test_compile_true_compiles_the_chunked_forward():
    """retention (additive, one decay per head) with compile=True: forward over 2.5 slices
    equals the eager module; the compiled graph ran (its first call was timed)."""
    spec = memspec.load("specs/retention.yaml")
    dims = small_dims(spec)
    eager = make(spec, dims, chunk=4, dtype=torch.float32)
    comp = make(spec, dims, chunk=4, dtype=torch.float32, compile=True)
    comp.load_state_dict(eager.state_dict())
    T = 5 * 4 * SLICE_CHUNKS // 2
    ins = inputs(spec, eager, T=T, dtype=torch.float32)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a, sa = eager(**ins, schedule="additive")
        b, sb = comp(**ins, schedule="additive")
    assert comp._chunked_fn.seconds is not None and comp._chunked_fn.compiled is not None
    # no autograd on CPU: the C++ wrapper compiled (a failure warns and drops it)
    assert comp._chunked_fn.inference is not None
    assert not [w for w in caught if "torch.compile failed" in str(w.message)]
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    for n in sa:
        torch.testing.assert_close(sb[n], sa[n], rtol=1e-5, atol=1e-5)


def test_per_channel_additive_stays_eager_under_compile():
    """gla's chunked forward is not compiled (minutes to compile): compile=True runs it eagerly."""
    spec = memspec.load("specs/gla.yaml")
    comp = make(spec, small_dims(spec), chunk=4, dtype=torch.float32, compile=True)
    assert not hasattr(comp, "_chunked_fn")
    assert "_in_slices" not in type(comp).forward.__globals__


@pytest.mark.slow
@pytest.mark.parametrize("path", ["specs/retention.yaml", "specs/deltanet.yaml", "specs/comba.yaml", "specs/kda.yaml",
                                  "specs/momentum_deltanet.yaml"])
def test_compiled_chunked_forward_and_gradients_equal_eager(path):
    spec = memspec.load(path)
    dims = small_dims(spec)
    eager = make(spec, dims, chunk=4, dtype=torch.float32)
    comp = make(spec, dims, chunk=4, dtype=torch.float32, compile=True)
    comp.load_state_dict(eager.state_dict())
    fam = next(s for s in eager.SCHEDULES if s in CHUNKED)
    T = 5 * 4 * SLICE_CHUNKS // 2
    outs = []
    for m in (eager, comp):
        ins = inputs(spec, eager, T=T, dtype=torch.float32, requires_grad=True)
        o, st = m(**ins, schedule=fam)
        loss = (o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum() + sum(s.sum() for s in st.values())
        grads = torch.autograd.grad(loss, [*ins.values(), *m.parameters()], allow_unused=True)
        outs.append((o.detach(), {n: s.detach() for n, s in st.items()}, grads))
    assert comp._chunked_fn.compiled is not None
    (a, sa, ga), (b, sb, gb) = outs
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    for n in sa:
        torch.testing.assert_close(sb[n], sa[n], rtol=1e-4, atol=1e-5)
    for x, y in zip(ga, gb):
        assert (x is None) == (y is None)
        if x is not None:
            torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-4)


def test_compiled_falls_back_from_the_cpp_wrapper_to_the_python_one_then_to_eager(monkeypatch):
    """Calls without autograd on CPU go through the C++ wrapper, calls under autograd (or not on
    CPU) through the Python one.  A graph the C++ wrapper cannot compile runs through the Python
    wrapper, with a warning; one neither can compile runs eagerly, with a warning; each outcome
    the function's own value."""
    ran = []

    def fake_compile(fails_for):
        def compile(fn, dynamic=False, options=None):
            wrapper = "cpp" if (options or {}).get("cpp_wrapper") else "python"

            def run(*args):
                if wrapper in fails_for:
                    raise RuntimeError(f"no {wrapper} wrapper here\nsecond line")
                ran.append(wrapper)
                return fn(*args) + 0
            return run
        return compile

    x = torch.arange(3.0)
    for fails_for, ran_no_grad, warned in ((set(), "cpp", 0), ({"cpp"}, "python", 1),
                                           ({"cpp", "python"}, None, 2)):
        monkeypatch.setattr(helpers.torch, "compile", fake_compile(fails_for))
        step = helpers._Compiled(lambda t: t * 2)
        ran.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.no_grad():
                torch.testing.assert_close(step(x), x * 2, rtol=0, atol=0)
                torch.testing.assert_close(step(x), x * 2, rtol=0, atol=0)   # no second warning
            torch.testing.assert_close(step(x), x * 2, rtol=0, atol=0)       # under autograd
        want = [] if ran_no_grad is None else [ran_no_grad] * 2 + ["python"]
        assert ran == want and len(caught) == warned, (fails_for, ran, caught)
        assert (step.compiled is None) == (warned == 2)
        assert all("no cpp wrapper here" in str(w.message) or "no python wrapper here" in str(w.message)
                   for w in caught)
    monkeypatch.setattr(helpers.torch, "compile", fake_compile(set()))
    step, ran[:] = helpers._Compiled(lambda t: t * 2), []
    with torch.no_grad():
        step(torch.ones(2, device="meta"))
    assert ran == ["python"]   # not on CPU: the Python wrapper
