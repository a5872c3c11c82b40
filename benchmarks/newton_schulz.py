"""Newton-Schulz's closed-form backward (memspec.runtime.muon) against autograd through the plain
iterations, timed alternately in one process (the load of other processes falls on both).

"plain" is the iteration the generated modules carried before (the same products, baddbmm, with
autograd's backward through them); "closed" is ``memspec.runtime.muon.newton_schulz``.

1. The bare iteration (5 steps of Muon's triple) on float32 matrices [N, m, n] (default
   [32, 64, 128] and its transpose): forward without autograd, and forward + backward.
2. titans_muon's memory (d_k = d_v = 64, hidden 128, H heads, B = 1, float32, eager) on its
   minibatch and online schedules: forward + backward of ``(o * w).sum()`` with respect to its
   inputs and parameters; "plain" sets the generated module's ``newton_schulz`` to the plain
   iteration, so everything else is the same code.

Prints the median wall time of ``--repeat`` runs after one warm-up each and the ratios plain / closed,
and the largest relative difference of the gradients.

    python benchmarks/newton_schulz.py [--T 512] [--H 4] [--threads 1] [--repeat 5] [--schedules minibatch,online]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from memspec.pipeline.build import build_memory
from memspec.runtime.muon import newton_schulz

sys.path.insert(0, str(Path(__file__).resolve().parent))   # benchmarks/ is not a package
from timing import timed_alternately  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def plain_newton_schulz(X, steps):
    """The iteration as generated modules carried it before, differentiated by autograd."""
    schedule = steps if isinstance(steps, tuple) else ((3.4445, -4.7750, 2.0315),) * steps
    tall = X.shape[-2] > X.shape[-1]
    if tall:
        X = X.transpose(-2, -1)
    X = X / (torch.linalg.matrix_norm(X, keepdim=True) + 1e-7)
    shape = X.shape
    X = X.reshape(-1, *shape[-2:])
    for a, b, c in schedule:
        A = torch.bmm(X, X.transpose(-2, -1))
        X = torch.baddbmm(X, torch.baddbmm(A, A, A, beta=b, alpha=c), X, beta=a)
    X = X.reshape(shape)
    return X.transpose(-2, -1) if tall else X


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def bare(shape, repeat):
    X = torch.randn(*shape, requires_grad=True)
    g = torch.randn(*shape)

    def fwd(fn):
        def run():
            with torch.no_grad():
                fn(X, 5)
        return run

    def fwd_bwd(fn):
        return lambda: torch.autograd.grad(fn(X, 5), X, g)

    times = timed_alternately({"plain fwd": fwd(plain_newton_schulz), "closed fwd": fwd(newton_schulz),
                               "plain fwd+bwd": fwd_bwd(plain_newton_schulz), "closed fwd+bwd": fwd_bwd(newton_schulz)},
                              repeat)
    diff = _rel(fwd_bwd(newton_schulz)()[0], fwd_bwd(plain_newton_schulz)()[0])
    for what in ("fwd", "fwd+bwd"):
        p, c = times[f"plain {what}"][0], times[f"closed {what}"][0]
        print(f"bare {list(shape)} {what:8s} plain {p:8.2f} ms  closed {c:8.2f} ms  plain/closed {p / c:5.2f}x")
    print(f"bare {list(shape)} gradient relative difference {diff:.1e}")


def layer(T, H, schedules, repeat):
    torch.manual_seed(0)
    m = build_memory(ROOT / "specs" / "titans_muon.yaml", compile=False, heads=H, d_k=64, d_v=64, hidden=128)
    module = sys.modules[type(m).__module__]
    views = {v: torch.randn(1, T, H, 64, requires_grad=True) for v in ("q", "k", "v")}
    gates = {g: torch.rand(1, T, H, requires_grad=True) for g in ("mu", "alpha", "eta1", "eta2")}
    leaves = list(views.values()) + list(gates.values()) + list(m.parameters())
    w = torch.randn(1, T, H, 64)

    def run(schedule, fn):
        def go():
            module.newton_schulz = fn
            for t in leaves:
                t.grad = None
            o, _ = m(*views.values(), **gates, schedule=schedule)
            (o * w).sum().backward()   # (a reentrant checkpoint: .backward(), not autograd.grad)
            return [t.grad for t in leaves]
        return go

    for schedule in schedules:
        closed, plain = run(schedule, newton_schulz), run(schedule, plain_newton_schulz)
        times = timed_alternately({"plain": plain, "closed": closed}, repeat)
        diff = max(_rel(a, b) for a, b in zip(closed(), plain()))
        p, c = times["plain"][0], times["closed"][0]
        print(f"titans_muon {schedule:9s} T={T} H={H} fwd+bwd  plain {p:9.1f} ms  closed {c:9.1f} ms  "
              f"plain/closed {p / c:5.2f}x  (gradients: relative difference {diff:.1e})")
    module.newton_schulz = newton_schulz


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, default=512)
    ap.add_argument("--H", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--schedules", default="minibatch,online")
    ap.add_argument("--shape", default="32,64,128")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    shape = tuple(int(x) for x in a.shape.split(","))
    bare(shape, a.repeat)
    bare(shape[:-2] + shape[-2:][::-1], a.repeat)
    if a.T:
        layer(a.T, a.H, [s for s in a.schedules.split(",") if s], a.repeat)


if __name__ == "__main__":
    main()
