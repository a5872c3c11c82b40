"""Packed variable-length sequences (``cu_seqlens``): a packed row equals each document run alone.

Every shipped spec x every schedule its module admits, float64, small dims (chunk 4): outputs,
final states and the gradients of the inputs, parameters and initial states; document lengths 1,
below, equal to and above the chunk, not multiples of it, several short ones; decoding after a
packed prefill; the reference interpreter's packed run; seeded random length mixes.
"""
from __future__ import annotations

import random

import pytest
import torch

from _compiled_harness import (ROOT, SPEC_FILES, initial_state, inputs, load, make, ref_params, small_dims)
from close import assert_same_function
from memspec import reference

CASES = []
for _path in SPEC_FILES:
    _spec = load(_path)
    for _sched in make(_spec, small_dims(_spec)).SCHEDULES:
        CASES.append((_path, _sched))
IDS = [f"{p.split('/')[-1][:-5]}-{s}" for p, s in CASES]
# the default run takes gradients and decodes for one spec per family (and block updates); the rest is slow
FAST = {"deltanet", "gla", "kda", "momentum_deltanet", "titans", "lact", "sliding_window_attention", "mesa",
        "hope_cms", "hgrn"}
SOME = [pytest.param(p, s, id=i, marks=() if p.split("/")[-1][:-5] in FAST else pytest.mark.slow)
        for (p, s), i in zip(CASES, IDS)]

CHUNK = 4
MIX = [1, 3, 4, 6, 9, 1, 1, 2]          # 1, below / equal to / above the chunk, not multiples, short ones
ALIGNED = [5, 1, 9, 5]                  # every document ends one token into a chunk (same position)
DECODE = [9, 1, 17]                     # ... and one token into a block of 8 (hope_cms)


def offsets(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)


def setup(path, lengths, requires_grad=False, seed=1):
    spec = load(path)
    dims = small_dims(spec)
    m = make(spec, dims, chunk=CHUNK)
    ins = inputs(spec, m, B=1, T=sum(lengths), seed=seed, requires_grad=requires_grad)
    st = initial_state(spec, m, B=len(lengths), seed=seed + 1)
    if requires_grad:
        st = {n: t.detach().clone().requires_grad_(True) if not spec.state[n].learned else t
              for n, t in st.items()}
    return spec, dims, m, ins, st


def run_packed(m, spec, ins, st, schedule, lengths):
    return m(*[ins[v] for v in spec.views], **{g: ins[g] for g in spec.gates}, state=dict(st),
             schedule=schedule, cu_seqlens=offsets(lengths))


def run_alone(m, spec, ins, st, schedule, lengths):
    """Each document alone (B = 1): outputs concatenated, final states [1, H, ...] per document."""
    outs, finals, a = [], [], 0
    for i, n in enumerate(lengths):
        piece = {k: x[:, a:a + n] for k, x in ins.items()}
        o, f = m(*[piece[v] for v in spec.views], **{g: piece[g] for g in spec.gates},
                 state={k: t[i:i + 1] for k, t in st.items()}, schedule=schedule)
        outs.append(o)
        finals.append(f)
        a += n
    return torch.cat(outs, dim=1), finals


def shared_entries(finals):
    """The final-state entries every document has with one shape (or one int value)."""
    keys = set(finals[0])
    for f in finals[1:]:
        keys &= set(f)
    same = set()
    for k in keys:
        vals = [f[k] for f in finals]
        if isinstance(vals[0], torch.Tensor):
            same |= {k} if len({tuple(v.shape) for v in vals}) == 1 else set()
        else:
            same |= {k} if len(set(vals)) == 1 else set()
    return same, keys


def check_states(spec, packed, finals):
    """The packed final state holds every entry the documents share, stacked in document order;
    a streaming entry they cannot share leaves out its group (``minibatch.*``) and its states."""
    same, _ = shared_entries(finals)
    keys = set().union(*finals)
    open_groups = {k.split(".")[0] for k in keys - same if "." in k}
    left_out = {k for k in keys if "." in k and k.split(".")[0] in open_groups}
    left_out |= {k.split(".")[1] for k in left_out} | (keys - same)
    assert set(packed) == keys - left_out
    for k, v in packed.items():
        if isinstance(v, torch.Tensor):
            assert_same_function(v, torch.cat([f[k] for f in finals], dim=0), msg=k)
        else:
            assert v == finals[0][k]


@pytest.mark.parametrize("lengths", [MIX, pytest.param(ALIGNED, marks=pytest.mark.slow)], ids=["mix", "aligned"])
@pytest.mark.parametrize("path,schedule", CASES, ids=IDS)
def test_packed_equals_documents_alone(path, schedule, lengths):
    spec, dims, m, ins, st = setup(path, lengths)
    with torch.no_grad():
        o, packed = run_packed(m, spec, ins, st, schedule, lengths)
        ro, finals = run_alone(m, spec, ins, st, schedule, lengths)
    assert o.shape == ro.shape
    assert_same_function(o, ro)
    check_states(spec, packed, finals)


@pytest.mark.parametrize("path,schedule", SOME)
def test_packed_gradients_equal_documents_alone(path, schedule):
    spec, dims, m, ins, st = setup(path, MIX, requires_grad=True)
    o, packed = run_packed(m, spec, ins, st, schedule, MIX)
    ro, finals = run_alone(m, spec, ins, st, schedule, MIX)
    g = torch.Generator().manual_seed(7)
    w_o = torch.randn(o.shape, generator=g, dtype=o.dtype)
    kept = [k for k in packed if k in spec.state]
    w_s = {k: torch.randn(packed[k].shape, generator=g, dtype=o.dtype) for k in kept}
    wrt = list(ins.values()) + list(m.parameters()) + [t for t in st.values() if t.requires_grad]

    def scalar(out, states):
        return (out * w_o).sum() + sum((states[k] * w).sum() for k, w in w_s.items())

    mine = torch.autograd.grad(scalar(o, packed), wrt, allow_unused=True)
    alone = {k: torch.cat([f[k] for f in finals], dim=0) for k in kept}
    theirs = torch.autograd.grad(scalar(ro, alone), wrt, allow_unused=True)
    # Newton-Schulz multiplies small singular values by up to 3.4 a step: batched differently (a
    # document among more or fewer rows), its float64 gradients differ by ~1e-12 (measured 1.1e-12)
    muon = "newton_schulz" in (ROOT / path).read_text()
    checked = 0
    for a, b in zip(mine, theirs):
        if b is None or b.numel() == 0:
            assert a is None or a.numel() == 0 or float(a.abs().max()) == 0.0
            continue
        if muon:
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
        else:
            assert_same_function(a, b)
        checked += float(b.abs().max()) > 0
    assert checked >= len(ins)


@pytest.mark.parametrize("path,schedule", SOME)
def test_decoding_after_a_packed_prefill(path, schedule):
    """Prefill packed documents, then decode one token of every document as a batch of N."""
    spec, dims, m, ins, st = setup(path, DECODE)
    nxt = inputs(spec, m, B=len(DECODE), T=1, seed=9)
    with torch.no_grad():
        _, packed = run_packed(m, spec, ins, st, schedule, DECODE)
        _, finals = run_alone(m, spec, ins, st, schedule, DECODE)
        if set(packed) != set().union(*finals):   # documents' caches of different lengths: no decoding
            assert all(spec.state[k].cache for k in spec.state if k not in packed)
            return
        o, after = m.step(*[nxt[v] for v in spec.views], **{g: nxt[g] for g in spec.gates}, state=packed)
        for i, f in enumerate(finals):
            oi, ai = m.step(*[nxt[v][i:i + 1] for v in spec.views], **{g: nxt[g][i:i + 1] for g in spec.gates},
                            state=f)
            assert_same_function(o[i:i + 1], oi)
            for k in spec.state:
                assert_same_function(after[k][i:i + 1], ai[k])


REFERENCE_SPECS = ["specs/gated_deltanet.yaml", "specs/gla.yaml", "specs/kda.yaml", "specs/momentum_deltanet.yaml",
                   "specs/titans.yaml", "specs/sliding_window_attention.yaml", "specs/lact.yaml"]


@pytest.mark.parametrize("path", REFERENCE_SPECS)
def test_compiled_packed_equals_reference_packed(path):
    """The reference interpreter's packed run (each document alone) against the compiled one."""
    spec, dims, m, ins, st = setup(path, ALIGNED)
    schedule = m.DEFAULT_SCHEDULE
    mode = (schedule, CHUNK) if schedule in ("minibatch", "apply_update") else "online"
    with torch.no_grad():
        o, packed = run_packed(m, spec, ins, st, schedule, ALIGNED)
        ro, rs = reference.run(spec, state={k: t for k, t in st.items() if k in spec.state}, schedule=mode,
                               dims=dims, params=ref_params(spec, m), cu_seqlens=offsets(ALIGNED), **ins)
    assert_same_function(o, ro)
    for k in packed:
        if k in rs:
            assert_same_function(packed[k], rs[k], msg=k)


def test_reference_packed_documents_run_alone():
    spec = load("specs/gated_deltanet.yaml").with_dims(heads=2, d_k=4, d_v=5)
    g = torch.Generator().manual_seed(0)
    T = 9
    ins = {n: torch.randn(1, T, 2, 5 if n == "v" else 4, generator=g, dtype=torch.float64) for n in spec.views}
    ins.update({n: torch.rand(1, T, 2, generator=g, dtype=torch.float64) for n in spec.gates})
    S0 = torch.randn(3, 2, 4, 5, generator=g, dtype=torch.float64)
    o, s = reference.run(spec, state={"W": S0}, cu_seqlens=torch.tensor([0, 3, 3, 9]), **ins)
    o2, s2 = reference.run(spec, state={"W": S0[2:]}, **{n: x[:, 3:] for n, x in ins.items()})
    assert_same_function(o[:, 3:], o2)
    assert_same_function(s["W"][2:], s2["W"])
    assert torch.equal(s["W"][1], S0[1])          # an empty document keeps its state
    o0, _ = reference.run(spec, state={"W": S0[:1]}, **{n: x[:, :3] for n, x in ins.items()})
    assert_same_function(o[:, :3], o0)


@pytest.mark.parametrize("bad,match", [
    (torch.tensor([0, 4, 3, 9]), "without decreasing"),
    (torch.tensor([0, 3, 8]), "from 0 to T = 9"),
    (torch.tensor([0.0, 9.0]), "integer tensor"),
    (torch.tensor([[0, 9]]), "integer tensor"),
])
def test_bad_offsets_are_refused(bad, match):
    spec, dims, m, ins, st = setup("specs/gated_deltanet.yaml", [9])
    with pytest.raises(ValueError, match=match):
        m(*[ins[v] for v in spec.views], **{g: ins[g] for g in spec.gates}, cu_seqlens=bad)
    with pytest.raises(ValueError, match=match):
        reference.run(spec, dims=dims, params=ref_params(spec, m), cu_seqlens=bad, **ins)


def test_packing_needs_one_row():
    spec, dims, m, _, _ = setup("specs/gated_deltanet.yaml", [9])
    ins = inputs(spec, m, B=2, T=9)
    with pytest.raises(ValueError, match="B must be 1"):
        m(*[ins[v] for v in spec.views], **{g: ins[g] for g in spec.gates}, cu_seqlens=offsets([4, 5]))


PROPERTY = ["specs/gated_deltanet.yaml", "specs/gla.yaml", "specs/rwkv7.yaml", "specs/momentum_deltanet.yaml",
            "specs/titans.yaml", "specs/softmax_attention.yaml"]


@pytest.mark.parametrize("path", PROPERTY)
def test_random_length_mixes(path):
    """Seeded random mixes (empty documents included): packed equals alone, every schedule."""
    rng = random.Random(path)
    spec = load(path)
    for trial in range(2):
        lengths = [rng.choice([0, 1, 1, 2, 3, 4, 5, 7, 8, 11]) for _ in range(rng.randint(1, 7))]
        if sum(lengths) == 0:
            lengths.append(1)
        for schedule in make(spec, small_dims(spec)).SCHEDULES:
            _, _, m, ins, st = setup(path, lengths, seed=trial)
            with torch.no_grad():
                o, packed = run_packed(m, spec, ins, st, schedule, lengths)
                ro, finals = run_alone_nonempty(m, spec, ins, st, schedule, lengths)
            assert_same_function(o, ro, msg=f"{lengths} {schedule}")
            check_states(spec, packed, finals)


def run_alone_nonempty(m, spec, ins, st, schedule, lengths):
    """As :func:`run_alone`; an empty document keeps its initial state."""
    outs, finals, a = [], [], 0
    for i, n in enumerate(lengths):
        row = {k: t[i:i + 1] for k, t in st.items()}
        if n == 0:
            finals.append(row)
            continue
        o, f = run_alone(m, spec, {k: x[:, a:a + n] for k, x in ins.items()}, row, schedule, [n])
        outs.append(o)
        finals.append(f[0])
        a += n
    return torch.cat(outs, dim=1), finals


# ---------------------------------------------------------------- the kernels, one call per packed row
from memspec.runtime.additive import chunk_additive, recurrent_additive  # noqa: E402
from memspec.runtime.delta import chunk_delta, recurrent_delta  # noqa: E402
from memspec.runtime.dplr import chunk_dplr, recurrent_dplr  # noqa: E402
from memspec.runtime.momentum import chunk_momentum_delta, recurrent_momentum_delta  # noqa: E402
from memspec.runtime.varlen import _Documents  # noqa: E402

KERNEL_MIX = [1, 3, 4, 6, 9, 0, 1, 1, 2]     # an empty document too
H, K, V = 2, 4, 5


def kernel_forms(T, g):
    """(name, chunked call, token loop call, number of states) per kernel form, float64 inputs."""
    def r(*shape, scale=1.0):
        return scale * torch.randn(1, T, *shape, generator=g, dtype=torch.float64)

    q, v = r(H, K), r(H, V)
    k, p = (torch.nn.functional.normalize(r(H, K), dim=-1) for _ in range(2))
    beta = torch.rand(1, T, H, generator=g, dtype=torch.float64)
    lg = -torch.rand(1, T, H, generator=g, dtype=torch.float64)
    lgc = -torch.rand(1, T, H, K, generator=g, dtype=torch.float64)
    k2 = torch.nn.functional.normalize(r(H, 2, K), dim=-1)
    v2, b2 = r(H, 2, V), torch.rand(1, T, H, 2, generator=g, dtype=torch.float64)
    forms = []
    for incl in (True, False):
        for name, decay in (("none", None), ("scalar", lg), ("channel", lgc)):
            forms.append((f"additive-{name}-{incl}", chunk_additive, recurrent_additive,
                          (q, k, v, decay), dict(inclusive=incl), 1))
        forms.append((f"delta-{incl}", chunk_delta, recurrent_delta, (q, k, v, beta, lg), dict(inclusive=incl), 1))
        forms.append((f"delta-rho-{incl}", chunk_delta, recurrent_delta, (q, k, v, beta, lg),
                      dict(inclusive=incl, log_rho=lgc[..., 0]), 1))
        forms.append((f"dplr-kda-{incl}", chunk_dplr, recurrent_dplr, (q, k, v, -beta, None, lgc),
                      dict(inclusive=incl, read_after_decay=True), 1))
        forms.append((f"dplr-rwkv7-{incl}", chunk_dplr, recurrent_dplr, (q, k, v, r(H, K, scale=0.3), p, lgc),
                      dict(inclusive=incl), 1))
        forms.append((f"dplr-product-{incl}", chunk_dplr, recurrent_dplr, (q, k2, v2, -b2, None, lg),
                      dict(inclusive=incl, read_after_decay=True), 1))
        forms.append((f"momentum-{incl}", chunk_momentum_delta, recurrent_momentum_delta,
                      (q, k, v, p, lg, lgc[..., 1], beta, beta.flip(1)), dict(inclusive=incl), 2))
    return forms


def _alone(loop, args, kw, states, lengths):
    """Each document through the token loop: outputs concatenated, final states stacked."""
    outs, finals, a = [], [[] for _ in states], 0
    for i, n in enumerate(lengths):
        if n:
            piece = {key: x[:, a:a + n] if torch.is_tensor(x) else x for key, x in kw.items()}
            res = loop(*[x[:, a:a + n] if torch.is_tensor(x) else x for x in args], *[s[i:i + 1] for s in states],
                       **piece)
            outs.append(res[0])
            for f, s in zip(finals, res[1:]):
                f.append(s[0])
        else:
            for f, s in zip(finals, states):
                f.append(s[i])
        a += n
    return torch.cat(outs, dim=1), [torch.stack(f) for f in finals]


KERNEL_FORMS = [f[0] for f in kernel_forms(4, torch.Generator().manual_seed(0))]


@pytest.mark.parametrize("chunk", [2, 4, 16])
@pytest.mark.parametrize("form", KERNEL_FORMS)
def test_kernel_packed_row_equals_documents_alone(form, chunk):
    """One kernel call over the packed row (chunks 2 and 4: documents end inside and across chunks;
    16: longer than every document) equals each document through the token loop."""
    T = sum(KERNEL_MIX)
    g = torch.Generator().manual_seed(3)
    name, fn, loop, args, kw, n_states = next(f for f in kernel_forms(T, g) if f[0] == form)
    states = [torch.randn(len(KERNEL_MIX), H, K, V, generator=g, dtype=torch.float64) for _ in range(n_states)]
    res = fn(*args, *states, chunk, documents=_Documents(offsets(KERNEL_MIX)), **kw)
    o, finals = _alone(loop, args, kw, states, KERNEL_MIX)
    assert_same_function(res[0], o)
    for got, want in zip(res[1:], finals):
        assert got.shape == (len(KERNEL_MIX), H, K, V)
        assert_same_function(got, want)


@pytest.mark.parametrize("form", [f for f in KERNEL_FORMS if f.endswith("True")])
def test_kernel_packed_gradients_equal_documents_alone(form):
    T = sum(KERNEL_MIX)
    g = torch.Generator().manual_seed(4)
    name, fn, loop, args, kw, n_states = next(f for f in kernel_forms(T, g) if f[0] == form)
    args = [x.detach().requires_grad_(True) if torch.is_tensor(x) else x for x in args]
    states = [torch.randn(len(KERNEL_MIX), H, K, V, generator=g, dtype=torch.float64, requires_grad=True)
              for _ in range(n_states)]
    leaves = [x for x in args if torch.is_tensor(x)] + states
    res = fn(*args, *states, 4, documents=_Documents(offsets(KERNEL_MIX)), **kw)
    o, finals = _alone(loop, args, kw, states, KERNEL_MIX)
    w = [torch.randn(x.shape, generator=g, dtype=torch.float64) for x in res]

    def scalar(xs):
        return sum((x * wi).sum() for x, wi in zip(xs, w))

    mine = torch.autograd.grad(scalar(res), leaves)
    theirs = torch.autograd.grad(scalar([o, *finals]), leaves)
    for a, b in zip(mine, theirs):
        assert_same_function(a, b)


def test_kernel_non_finite_token_stays_in_its_document():
    """A NaN in document 0 makes its later outputs and its final state NaN; document 1 is untouched."""
    lengths = [5, 6]
    g = torch.Generator().manual_seed(5)
    for name, fn, loop, args, kw, n_states in kernel_forms(sum(lengths), g):
        if not name.startswith(("delta", "dplr")):   # the kernels that flag non-finite tokens
            continue
        states = [torch.randn(2, H, K, V, generator=g, dtype=torch.float64) for _ in range(n_states)]
        bad = [x.clone() if torch.is_tensor(x) else x for x in args]
        bad[2][0, 2] = float("nan")                                  # v of token 2 (document 0)
        res = fn(*bad, *states, 4, documents=_Documents(offsets(lengths)), **kw)
        clean = fn(*args, *states, 4, documents=_Documents(offsets(lengths)), **kw)
        first = 2 if kw.get("inclusive", True) else 3
        assert torch.isnan(res[0][0, first:5]).all(), name
        assert_same_function(res[0][:, :2], clean[0][:, :2])
        assert_same_function(res[0][:, 5:], clean[0][:, 5:])
        assert torch.isnan(res[1][0]).all() and torch.equal(res[1][1], clean[1][1]), name


# ---------------------------------------------------------------- the layers and the wirings
from memspec.pipeline.build import build  # noqa: E402

LAYER_MIX = [1, 5, 3, 8, 2]
WIRED = {"titans_mac": {"segment": 3}, "titans_mag": {"window": 4}, "titans_mal": {"window": 4}}


def small_layer(name):
    spec = load(f"specs/{name}.yaml")
    if spec.wiring.kind != "none":   # short segments / windows: documents cross several
        spec = spec.model_copy(update={"wiring": spec.wiring.model_copy(update={**WIRED[name], "persistent": 2})})
    torch.manual_seed(0)
    return build(spec, compile=False, d_model=8, heads=2, chunk=4,
                 **{d: v for d, v in dict(d_k=4, d_v=4, hidden=4).items() if d in spec.dims}).double()


@pytest.mark.parametrize("name", ["gated_deltanet", "gla", "titans", "softmax_attention",
                                  "titans_mac", "titans_mag", "titans_mal"])
def test_layer_packed_equals_documents_alone(name):
    """The Layer (projections, memory, output) and the wirings (MAC segments, sliding windows) over a
    packed row equal each document alone: outputs and the gradients of every parameter and of x."""
    layer = small_layer(name)
    x = torch.randn(1, sum(LAYER_MIX), 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64,
                    requires_grad=True)
    y = layer(x, cu_seqlens=offsets(LAYER_MIX))
    bounds = offsets(LAYER_MIX).tolist()
    alone = torch.cat([layer(x[:, a:b]) for a, b in zip(bounds, bounds[1:])], dim=1)
    assert_same_function(y, alone)
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    wrt = [x] + [p for p in layer.parameters() if p.requires_grad]
    mine = torch.autograd.grad((y * w).sum(), wrt, allow_unused=True)
    theirs = torch.autograd.grad((alone * w).sum(), wrt, allow_unused=True)
    for a, b in zip(mine, theirs):
        if b is None:
            assert a is None or float(a.abs().max()) == 0.0
        else:
            assert_same_function(a, b)


def test_bare_layer_packed_state():
    """The bare Layer passes the documents' states [N, H, ...] through."""
    layer = small_layer("gated_deltanet")
    x = torch.randn(1, sum(LAYER_MIX), 8, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    _, state = layer(x, return_state=True, cu_seqlens=offsets(LAYER_MIX))
    assert state["W"].shape == (len(LAYER_MIX), 2, 4, 4)
    bounds = offsets(LAYER_MIX).tolist()
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        _, s = layer(x[:, a:b], return_state=True)
        assert_same_function(state["W"][i:i + 1], s["W"])


def test_wired_layer_packed_refuses_states():
    layer = small_layer("titans_mag")
    x = torch.zeros(1, 4, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="returns no state"):
        layer(x, return_state=True, cu_seqlens=offsets([2, 2]))
    with pytest.raises(ValueError, match="offsets rising from 0 to T = 4"):
        layer(x, cu_seqlens=offsets([2, 3]))


# ---------------------------------------------------------------- the language model
from memspec.tools.nn import MemoryLM, ShortConv  # noqa: E402


def test_short_conv_never_crosses_a_document():
    conv = ShortConv(6, kernel=4).double()
    with torch.no_grad():
        conv.weight.copy_(torch.randn(6, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64))
    x = torch.randn(1, sum(LAYER_MIX), 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    past = torch.randn(len(LAYER_MIX), 3, 6, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    y, st = conv(x, past, cu_seqlens=offsets(LAYER_MIX))
    bounds = offsets(LAYER_MIX).tolist()
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        yi, si = conv(x[:, a:b], past[i:i + 1])
        assert_same_function(y[:, a:b], yi)
        assert_same_function(st[i:i + 1], si)


@pytest.mark.parametrize("name", ["gated_deltanet", "titans_mag"])
def test_memory_lm_packed_equals_documents_alone(name):
    """MemoryLM (short convolutions, mixers, wirings) over packed documents: logits and gradients."""
    spec = load(f"specs/{name}.yaml")
    if spec.wiring.kind != "none":
        spec = spec.model_copy(update={"wiring": spec.wiring.model_copy(update={"window": 4, "persistent": 2})})
    torch.manual_seed(0)
    lm = MemoryLM(spec, vocab_size=11, d_model=8, n_layers=2, heads=2, chunk=4,
                  **{d: v for d, v in dict(d_k=4, d_v=4, hidden=4).items() if d in spec.dims}).double()
    tokens = torch.randint(0, 11, (1, sum(LAYER_MIX)), generator=torch.Generator().manual_seed(1))
    logits = lm(tokens, cu_seqlens=offsets(LAYER_MIX))
    bounds = offsets(LAYER_MIX).tolist()
    alone = torch.cat([lm(tokens[:, a:b]) for a, b in zip(bounds, bounds[1:])], dim=1)
    assert_same_function(logits, alone)
    params = list(lm.parameters())
    mine = torch.autograd.grad(logits.logsumexp(-1).sum(), params, allow_unused=True)
    theirs = torch.autograd.grad(alone.logsumexp(-1).sum(), params, allow_unused=True)
    for a, b in zip(mine, theirs):
        if b is not None:
            assert_same_function(a, b)


def test_train_pack_gives_the_batch_losses():
    """`memspec train --pack`: the batch's sequences in one row give the losses of the batch."""
    from dataclasses import replace

    from memspec.tools.cli import build_parser
    from memspec.tools.train import TrainConfig, config_from_args, train

    tiny = TrainConfig(steps=3, batch=4, seq_len=12, pairs=2, vocab=16, d_model=16, layers=1, heads=2,
                       eval_size=8, warmup=1, progress=False)
    path = str(ROOT / "specs" / "gated_deltanet.yaml")
    plain = train(path, tiny)
    packed = train(path, replace(tiny, pack=True))
    torch.testing.assert_close(torch.tensor(packed.losses), torch.tensor(plain.losses), rtol=1e-4, atol=1e-5)
    args = build_parser().parse_args(["train", path, "--pack"])
    assert config_from_args(args).pack


@pytest.mark.parametrize("path", ["specs/gated_deltanet.yaml", "specs/gla.yaml", "specs/kda.yaml",
                                  "specs/momentum_deltanet.yaml", "specs/titans.yaml"])
def test_only_empty_documents_keep_their_states(path):
    spec, dims, m, ins, st = setup(path, [0, 0, 0])
    with torch.no_grad():
        o, packed = run_packed(m, spec, ins, st, "auto", [0, 0, 0])
    assert o.shape[:2] == (1, 0)
    for k in spec.state:
        assert torch.equal(packed[k], st[k]), k


@pytest.mark.parametrize("path", ["specs/gated_deltanet.yaml", "specs/titans.yaml"])
def test_packed_bfloat16_keeps_float32_states(path):
    """bfloat16 inputs: the packed states are float32 [N, H, ...] and equal each document's."""
    spec, dims, m, ins, st = setup(path, MIX)
    m = m.float()
    ins = {k: x.to(torch.bfloat16) for k, x in ins.items()}
    with torch.no_grad():
        o, packed = m(*[ins[v] for v in spec.views], **{g: ins[g] for g in spec.gates}, cu_seqlens=offsets(MIX))
        ro, finals = run_alone(m, spec, ins, m.init_state(len(MIX)), "auto", MIX)
    assert o.dtype == torch.bfloat16
    for k in packed:
        if k in spec.state:
            assert packed[k].dtype == torch.float32 and packed[k].shape[0] == len(MIX)
            torch.testing.assert_close(packed[k], torch.cat([f[k] for f in finals]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(o.float(), ro.float(), rtol=1.6e-2, atol=1e-5)
