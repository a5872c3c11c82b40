"""Would a compiled group step bring the exact chunked forms to 20x their online schedule?

Issue 12's forward target (every exact chunked form at least 20x faster than its own online
schedule, B=1, H=4, T=2048, D=64, float32, no grad, 2 threads) sits at the floor of eager
PyTorch on this machine (``benchmarks/floor.py``).  The route left open was a chunked schedule
whose per-group step runs under ``torch.compile`` with static shapes.  This script measures that
route on a shipped spec *before* restructuring the kernels for it: the module's chunked kernel
(``chunk_additive``, ``chunk_delta``, ``chunk_dplr`` or ``chunk_momentum_delta``, the copy in
``compiled/<spec>.py``) is called slice by slice, ``--slice`` tokens at a time (default 512: one
group of 8 chunks of 64 on CPU, the group the kernels batch), the state threaded from slice to
slice, every full slice through ``torch.compile(kernel, dynamic=False)`` (compiled once: all full
slices have one shape) -- exactly what a compiled group step would run -- and timed, alternated
in one process, against the same kernel eager, the module's online schedule, the chunked schedule
of a ``compile=True`` module (which runs its whole chunked forward, token-local values included,
slice by slice through one compiled graph; a per-channel additive decay is not compiled) and, with
``--online-compiled``, that module's online schedule.  It prints the compile
time, the largest relative difference to the eager kernel and the ratios.

    python benchmarks/compiled_group.py specs/retention.yaml [--slice 512] [--repeat 5] [--online-compiled]

Measured (session 6, one run each; README, speed section): the kernel through compiled slices
runs 1.1-1.8x faster than eager, the compile=True module's chunked forward 1.2-2.1x; gla's kernel
(per-channel additive) took 586-695 s to compile and ran 2x slower, so compile=True leaves it
eager.  (The first version of this script built its "eager" module with build_memory's default,
compile=True, so its online row was the compiled token step; it now builds it with
compile=False.)
"""
from __future__ import annotations

import argparse
import inspect
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ("chunk_additive", "chunk_delta", "chunk_dplr", "chunk_momentum_delta")
CARRIED = ("S0", "M0")   # the states a kernel takes and returns after its output (in this order)


def module_kernel(memory):
    """(name, function) of the chunked kernel the module's ``_forward_chunk`` calls."""
    names = type(memory)._forward_chunk.__globals__
    found = [n for n in KERNELS if n in names]
    if len(found) != 1:
        raise SystemExit(f"expected one chunked kernel in the module, found {found or 'none'}")
    return found[0], names[found[0]]


def sliced(kernel, step, size):
    """``kernel`` over its tokens ``size`` at a time, the states threaded from slice to slice;
    every full slice runs through ``step`` (the compiled kernel), a shorter tail through ``kernel``.
    Tokens are the arguments whose dim 1 is the sequence (tensors, or tuples of them)."""
    sig = inspect.signature(kernel)
    carried = [p for p in CARRIED if p in sig.parameters]

    def run(*args, **kw):
        given = sig.bind(*args, **kw).arguments
        ref = given["k"][0] if isinstance(given["k"], tuple) else given["k"]
        T = ref.shape[1]

        def per_token(name, x):
            if name in carried:
                return False
            if isinstance(x, tuple):
                return all(isinstance(y, torch.Tensor) and y.dim() >= 3 and y.shape[1] == T for y in x)
            return isinstance(x, torch.Tensor) and x.dim() >= 3 and x.shape[1] == T

        tokens = [n for n, x in given.items() if per_token(n, x)]
        states = [given[p] for p in carried]
        outs = []
        for t in range(0, T, size):
            part = dict(given)
            for n in tokens:
                x = given[n]
                part[n] = tuple(y[:, t:t + size] for y in x) if isinstance(x, tuple) else x[:, t:t + size]
            part.update(zip(carried, states))
            o, *states = (step if t + size <= T else kernel)(**part)
            outs.append(o)
        o = torch.cat(outs, dim=1) if outs[0] is not None else None
        return (o, *states)

    return run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("spec")
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--H", type=int, default=4)
    ap.add_argument("--D", type=int, default=64)
    ap.add_argument("--slice", type=int, default=512, help="tokens per compiled call (one group of chunks)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--online-compiled", action="store_true", help="also time a compile=True module's online schedule")
    ap.add_argument("--no-compile", action="store_true", help="slice without compiling (checks the slicing)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    sys.path.insert(0, str(ROOT))
    from memspec.pipeline.build import build_memory, load_checked
    from memspec.tools.bench import alternate, make_inputs

    spec = load_checked(a.spec).spec
    dims = {d: a.D for d in ("d_k", "d_v") if d in spec.dims}
    memory = build_memory(spec, compile=False, heads=a.H, **dims)   # eager (build_memory compiles by default)
    chunked = [s for s in ("additive", "delta", "dplr", "momentum") if s in memory.SCHEDULES]
    if not chunked:
        raise SystemExit(f"{spec.name} has no exact chunked schedule")
    schedule = chunked[0]
    globals_ = type(memory)._forward_chunk.__globals__
    name, kernel = module_kernel(memory)
    step = kernel if a.no_compile else torch.compile(kernel, dynamic=False)
    by_slices = sliced(kernel, step, a.slice)
    views, gates = make_inputs(spec, 1, a.T, a.H, dims, "cpu", torch.float32)

    def run(m, s):
        with torch.no_grad():
            return m(*views.values(), **gates, schedule=s)

    def with_kernel(fn):
        globals_[name] = fn
        try:
            return run(memory, schedule)
        finally:
            globals_[name] = kernel

    o_eager, st_eager = run(memory, schedule)
    t0 = time.perf_counter()
    o_sl, st_sl = with_kernel(by_slices)
    compile_s = time.perf_counter() - t0
    diff = max(((x - y).abs().max() / y.abs().max().clamp_min(1e-30)).item()
               for x, y in [(o_sl, o_eager)] + [(st_sl[k], st_eager[k]) for k in st_eager])
    print(f"{spec.name}: {name} over slices of {a.slice} tokens "
          f"({'eager' if a.no_compile else 'torch.compile, dynamic=False'}); first call {compile_s:.1f} s; "
          f"largest relative difference to the eager kernel {diff:.1e}")
    fns = {"online": lambda: run(memory, "online"),
           "chunked, eager": lambda: run(memory, schedule),
           "chunked, compiled slices": lambda: with_kernel(by_slices)}
    compiled = build_memory(spec, heads=a.H, compile=True, **dims)
    compiled.load_state_dict(memory.state_dict())
    if hasattr(compiled, "_chunked_fn") and not a.no_compile:   # the module's own compile=True path
        t0 = time.perf_counter()
        o_c, _ = run(compiled, schedule)
        print(f"  compile=True module: first call {time.perf_counter() - t0:.1f} s; relative difference "
              f"{((o_c - o_eager).abs().max() / o_eager.abs().max()).item():.1e}")
        fns["chunked, compile=True module"] = lambda: run(compiled, schedule)
    if a.online_compiled:
        run(compiled, "online")
        fns["online, compile=True"] = lambda: run(compiled, "online")
    for fn in fns.values():   # warm-up
        fn()
    times = {k: statistics.median(v) for k, v in alternate(fns, a.repeat).items()}
    for k, t in times.items():
        print(f"  {k:28s} {t * 1e3:9.2f} ms   online / row {times['online'] / t:6.1f}x")
    return 0 if diff < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
