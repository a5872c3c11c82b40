"""Compile time of every compiled graph of the given specs' default schedules, fresh inductor cache.

For each spec: a module built with ``compile=True`` runs one full chunk of its
default schedule without grad, and a second module the same with grad (the training
graph); each ``_Compiled`` step reports the wall time of its first (compiling) call.  Before
them, one tiny function is compiled and its time printed as the start-up: inductor's
one-time work in a process with a fresh cache (imports, the C++ toolchain probe, the
kernels' common header), which would otherwise be charged to the first graph.

    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python benchmarks/compile_times.py specs/titans.yaml [...]
"""
from __future__ import annotations

import argparse
import resource
import time

import torch

import memspec.pipeline.build as build
from memspec.codegen.module import SLICE_CHUNKS


def cpu_seconds():
    """CPU time of this process and its finished children (the C++ compiler runs)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def compiled_steps(mem):
    return {name: f for name, f in vars(mem).items() if type(f).__name__ == "_Compiled"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+")
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    t0, c0 = time.perf_counter(), cpu_seconds()
    torch.compile(lambda x: torch.sin(x) * 2 + 1, dynamic=False)(torch.randn(8, 8))
    print(f"start-up (a tiny graph, fresh cache): {time.perf_counter() - t0:.1f} s "
          f"(cpu {cpu_seconds() - c0:.1f} s)", flush=True)
    for path in a.files:
        row = []
        for grad in (False, True):
            torch.manual_seed(0)
            mem = build.build_memory(path, compile=True)
            # one full chunk (an online default: as many tokens, one compiled token step); a compiled
            # exact chunked forward: one slice of SLICE_CHUNKS chunks (the graph it compiles)
            T = mem.chunk * (SLICE_CHUNKS if hasattr(mem, "_chunked_fn") else 1)
            views = {n: torch.randn(1, T, mem.heads, getattr(mem, d)).requires_grad_(grad) for n, d in mem.VIEWS.items()}
            shapes = mem.GATES   # per channel: dims
            gates = {n: 0.1 * torch.rand(1, T, mem.heads, *(getattr(mem, d) for d in dims))
                     for n, dims in shapes.items()}
            t0, c0 = time.perf_counter(), cpu_seconds()
            with torch.set_grad_enabled(grad):
                o, st = mem(**views, **gates)
                if grad:
                    o.sum().backward()
            total, cpu = time.perf_counter() - t0, cpu_seconds() - c0
            for name, f in compiled_steps(mem).items():
                if f.seconds is not None:
                    row.append(f"{name}{' (training)' if grad else ''} {f.seconds:.1f} s")
            row.append(f"{'training' if grad else 'no-grad'} call {total:.1f} s (cpu {cpu:.1f} s)")
        print(f"{path}: " + ", ".join(row), flush=True)


if __name__ == "__main__":
    main()
