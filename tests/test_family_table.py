"""A schedule family is one row of memspec.schedule.decide.FAMILIES and one emitter: this file
adds a toy exact family with its own analysis, emitter and row (no other file changes), compiles
a spec with it and checks the module against the reference interpreter; a row without an
emitter, or an emitter without a row, is an error."""
from __future__ import annotations

import pytest
import torch

import memspec
from close import assert_same_function
from memspec import reference
from memspec.codegen import CodegenError, Emitter, class_name, generate, register
from memspec.codegen.module import EMITTERS, check_families
from memspec.lang.expr import Name
from memspec.pipeline.build import load_module
from memspec.schedule import analyse
from memspec.schedule import decide
from memspec.schedule.additive import analyse_additive
from memspec.schedule.algebra import NotAdmitted
from memspec.schedule.decide import Family

TOY = """
name: toy_running_sum
dims: {heads: 2, d_k: 4, d_v: 3}
views: {q: d_k, k: d_k, v: d_v}
state:
  S: {shape: [d_k, d_v]}
update:
  - S = S + outer(k, v)
read: q @ S
"""


# ------------------------------------------------------------ the toy family
def analyse_toy(alg, chunk):
    """Admits one running sum S <- S + outer(k, v) of two views, read as q @ S (q a view)."""
    plan, _ = analyse_additive(alg)
    if len(plan.states) != 1 or len(plan.probes) != 1:
        raise NotAdmitted("the toy family takes one state read by one probe")
    st, probe = plan.states[0], plan.probes[0]
    (a, b), = st.terms if len(st.terms) == 1 else (None, None)
    if st.gamma is not None or st.vector or not all(isinstance(x, Name) for x in (a, b, probe.vector)):
        raise NotAdmitted("the toy family takes S <- S + outer(k, v) of views, no decay")
    if plan.read != Name(probe.name):
        raise NotAdmitted("the toy family reads q @ S alone")
    return {"state": st.name, "k": a.id, "v": b.id, "q": probe.vector.id}, ["a running sum of outer(k, v)"]


def emit_toy(ctx, L):
    plan = ctx.plans["toy_sum"]
    s, q, k, v = plan["state"], plan["q"], plan["k"], plan["v"]
    args = ", ".join(ctx.views + ["state"])
    L(f"def _forward_toy_sum(self, {args}):")
    with L.indent():
        L('"""' + "Every token's state by one cumulative sum, then every token's read.  Returns (o, state)." + '"""')
        L(f"{s}_all = state[{s!r}].unsqueeze(1) + torch.cumsum({k}.unsqueeze(-1) * {v}.unsqueeze(-2), dim=1)",
          "[B, T, H, d_k, d_v]")
        L(f"o = ({q}.unsqueeze(-1) * {s}_all).sum(-2)", "[B, T, H, d_v]")
        L(f"return o, {{{s!r}: {s}_all[:, -1]}}")
    L()


TOY_ROW = Family("toy_sum", analyse_toy, exact=True, chunked=False, carried=False,
                 text="toy running sum (exact, one cumulative sum)")
TOY_EMITTER = Emitter(family="toy_sum", emit=emit_toy, forward_method="_forward_toy_sum",
                      schedule_text="toy running sum (exact)")


@pytest.fixture
def toy_row():
    undo = decide.register(TOY_ROW, before="cache")
    yield
    undo()


@pytest.fixture
def toy_family(toy_row):
    undo = register(TOY_EMITTER)
    yield
    undo()


# ------------------------------------------------------------ tests
def test_a_toy_family_compiles_and_matches_the_reference(toy_family):
    spec = memspec.loads(TOY)
    d = analyse(spec)
    assert d.family == "toy_sum" and d.exact and d.schedules == ("toy_sum", "online")
    assert decide.NAMES[0] == "toy_sum" and "a running sum of outer(k, v)" in d.reasons
    text = generate(spec, d)
    assert "# schedule: toy running sum (exact)" in text and "return self._forward_toy_sum(" in text
    mod = load_module(text, spec.name, spec)
    m = getattr(mod, f"{class_name(spec.name)}Memory")()
    assert m.SCHEDULES == ("toy_sum", "online") and m.DEFAULT_SCHEDULE == "toy_sum"
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 7, 2, n, generator=g, dtype=torch.float64) for n in (4, 4, 3))
    state = {"S": torch.randn(2, 2, 4, 3, generator=g, dtype=torch.float64)}
    ro, rs = reference.run(spec, state=dict(state), q=q, k=k, v=v)
    for schedule in ("auto", "toy_sum", "online"):
        o, st = m(q, k, v, state=dict(state), schedule=schedule)
        assert_same_function(o, ro, msg=schedule)
        assert_same_function(st["S"], rs["S"], msg=schedule)


def test_the_toy_row_leaves_the_shipped_decisions_alone(toy_family):
    d = analyse(memspec.load("specs/linear_attention.yaml"))   # two running sums: not the toy's
    assert d.family == "additive" and "toy_sum" not in d.admits
    assert ("toy_sum", "the toy family takes one state read by one probe") in d.rejected
    d = analyse(memspec.load("specs/deltanet.yaml"))
    assert d.family == "delta" and "toy_sum" not in d.admits


def test_a_family_without_an_emitter_fails_loudly(toy_row):
    with pytest.raises(CodegenError, match="no emitter for toy_sum"):
        check_families()
    spec = memspec.loads(TOY)
    with pytest.raises(CodegenError, match="no emitter for toy_sum"):
        generate(spec, analyse(spec))


def test_an_emitter_without_a_row_fails_loudly():
    with pytest.raises(CodegenError, match="not a row of FAMILIES"):
        register(TOY_EMITTER)
    assert "toy_sum" not in EMITTERS


def test_registration_is_undone():
    undo_row = decide.register(TOY_ROW)
    undo_emitter = register(TOY_EMITTER)
    assert decide.NAMES[-1] == "toy_sum" and list(EMITTERS)[-1] == "toy_sum"
    undo_emitter()
    undo_row()
    assert "toy_sum" not in decide.NAMES and "toy_sum" not in decide.BY_NAME and "toy_sum" not in EMITTERS
    check_families()
    with pytest.raises(ValueError, match="no such family"):
        decide.register(TOY_ROW, before="nope")
