"""What does a compiled chunk step buy the exact chunked forms?

A forward ratio of 20x over the online schedule for every exact chunked form (B=1, H=4, T=2048,
D=64, float32, no grad, 2 threads) sits at the floor of eager PyTorch on this machine
(``benchmarks/floor.py``).  ``compile=True`` runs a module's chunked forward over slices of
``SLICE_CHUNKS`` chunks, every full slice through one ``torch.compile(dynamic=False)`` graph
(``_in_slices`` in the generated module).  This script does the same with an eager module's
``_forward_chunk`` -- for every chunked spec, including the per-channel additive ones that
``compile=True`` leaves eager -- and times it, alternated in one process, against the same module's
eager chunked and online schedules (and, with ``--online-compiled``, the online schedule of a
``compile=True`` module).  It prints the first (compiling) call's time, the largest relative
difference to the eager chunked forward, and the ratios.  ``--no-compile`` runs the slices eagerly
(a check of the slicing).

    python benchmarks/compiled_group.py specs/retention.yaml [--repeat 5] [--online-compiled]

Measured when ``compile=True`` took this route: the compiled slices run 1.2-2.1x faster than eager
for the additive (per head), delta, dplr and momentum kernels; gla's per-channel additive kernel
took 586-745 s to compile and ran 2x slower (745 s and 29.4 vs 13.3 ms for its whole
chunked forward), so ``compile=True`` leaves it eager.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("spec")
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--H", type=int, default=4)
    ap.add_argument("--D", type=int, default=64)
    ap.add_argument("--slice-chunks", type=int, default=None, help="chunks per slice (default: SLICE_CHUNKS, as compile=True)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--online-compiled", action="store_true", help="also time a compile=True module's online schedule")
    ap.add_argument("--no-compile", action="store_true", help="slice without compiling (checks the slicing)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    sys.path.insert(0, str(ROOT))
    from memspec.codegen.module import CHUNKED, SLICE_CHUNKS
    from memspec.pipeline.build import build_memory, load_checked
    from memspec.runtime.helpers import _in_slices
    from memspec.tools.bench import alternate, make_inputs

    spec = load_checked(a.spec).spec
    dims = {d: a.D for d in ("d_k", "d_v") if d in spec.dims}
    memory = build_memory(spec, compile=False, heads=a.H, **dims)   # eager (build_memory compiles by default)
    chunked = [s for s in memory.SCHEDULES if s in CHUNKED]
    if not chunked:
        raise SystemExit(f"{spec.name} has no exact chunked schedule")
    schedule = chunked[0]
    views, gates = make_inputs(spec, 1, a.T, a.H, dims, "cpu", torch.float32)
    tensors = (*views.values(), *gates.values())
    step = memory._forward_chunk if a.no_compile else torch.compile(memory._forward_chunk, dynamic=False)
    size = (a.slice_chunks or SLICE_CHUNKS) * memory.chunk

    def run(m, s):
        with torch.no_grad():
            return m(*views.values(), **gates, schedule=s)

    def sliced():
        with torch.no_grad():
            return _in_slices(step, memory._forward_chunk, size, tensors, memory.init_state(1))

    o_eager, st_eager = run(memory, schedule)
    t0 = time.perf_counter()
    o_sl, st_sl = sliced()
    first = time.perf_counter() - t0
    diff = max(((x - y).abs().max() / y.abs().max().clamp_min(1e-30)).item()
               for x, y in [(o_sl, o_eager)] + [(st_sl[k], st_eager[k]) for k in st_eager])
    print(f"{spec.name}: _forward_chunk over slices of {size} tokens "
          f"({'eager' if a.no_compile else 'torch.compile, dynamic=False'}); first call {first:.1f} s; "
          f"largest relative difference to the eager chunked forward {diff:.1e}")
    fns = {"online": lambda: run(memory, "online"),
           "chunked, eager": lambda: run(memory, schedule),
           "chunked, compiled slices": sliced}
    if a.online_compiled:
        compiled = build_memory(spec, compile=True, heads=a.H, **dims)
        compiled.load_state_dict(memory.state_dict())
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
