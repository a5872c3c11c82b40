"""Shared helpers of the compiled-module tests: small dims, random inputs, reference runs."""
from __future__ import annotations

import glob
from pathlib import Path

import torch

import memspec
from memspec import reference
from memspec.pipeline.build import build_memory

ROOT = Path(__file__).resolve().parent.parent
SPEC_FILES = sorted(Path(p).relative_to(ROOT).as_posix() for p in glob.glob(str(ROOT / "specs" / "*.yaml")))


def small_dims(spec) -> dict:
    """Tiny sizes with d_k != d_v where the spec has both."""
    want = {"d_model": 8, "heads": 2, "d_k": 4, "d_v": 5, "hidden": 6}
    return {k: v for k, v in want.items() if k in spec.dims}


def load(path):
    return memspec.load(ROOT / path) if not isinstance(path, memspec.Spec) else path


def make(spec, dims, chunk=4, dtype=torch.float64, seed=0, compile=False):
    """(memory module, inputs dict, initial state) with random, nontrivial values."""
    torch.manual_seed(seed)
    m = build_memory(spec, compile=compile, chunk=chunk, **dims).to(dtype)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(p + 0.1 * torch.randn_like(p))
    return m


def inputs(spec, m, B=2, T=10, dtype=torch.float64, seed=1, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    H = m.heads
    out = {}
    for v, view in spec.views.items():
        out[v] = 0.5 * torch.randn(B, T, H, getattr(m, view.dim), generator=g, dtype=dtype)
    for n, gate in spec.gates.items():
        channels = [getattr(m, d) for d in gate.shape]   # a per-channel gate is [B, T, H, d]
        out[n] = 0.05 + 0.3 * torch.rand(B, T, H, *channels, generator=g, dtype=dtype)
    if requires_grad:
        for t in out.values():
            t.requires_grad_(True)
    return out


def initial_state(spec, m, B=2, dtype=torch.float64, seed=2):
    """init_state (learned initial values stay connected to their parameters) plus noise on
    the plain tensors, so that a zero start does not hide mistakes."""
    g = torch.Generator().manual_seed(seed)
    st = m.init_state(B, dtype=dtype, generator=g)
    out = {}
    for n, t in st.items():
        decl = spec.state[n]
        if decl.cache or decl.learned:
            out[n] = t
        else:
            out[n] = t + 0.1 * torch.randn(t.shape, generator=g, dtype=dtype)
    return out


def ref_params(spec, m) -> dict:
    return {n: getattr(m, n) for n in spec.params}


def reference_run(spec, m, dims, schedule, state, ins):
    sched = (schedule, m.chunk) if schedule in ("minibatch", "apply_update") else "online"
    return reference.run(spec, state=dict(state), schedule=sched, dims=dims, params=ref_params(spec, m), **ins)


def call(m, spec, ins, state=None, schedule="auto"):
    return m(*[ins[v] for v in spec.views], **{g: ins[g] for g in spec.gates}, state=state, schedule=schedule)


def rel_err(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))
