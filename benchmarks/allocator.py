"""The same memory timed under glibc's default allocator settings and with its trimming held off.

glibc's malloc serves a large block (128 KiB and more at first) from fresh pages and, once the top
of its heap holds more free memory than the trim threshold, returns it to the kernel: a chunked
form whose step allocates megabyte temporaries (a chunk's rows, its per-token states) then
page-faults them back at every step, and the kernel zeroes every page.  Setting
``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` (or running under jemalloc or tcmalloc)
keeps freed blocks in the process.  These are the process's settings, not the library's:
this script measures what they are worth.

Each setting runs in processes of its own (the allocator reads its environment at start), the
two alternated ``--rounds`` times; each process times ``--repeat`` calls after a warm-up and
reports their median.  Printed: the median over the rounds of each setting and their ratio
(default / tuned: above 1, the tuned process is faster).

    python benchmarks/allocator.py [--spec specs/lact.yaml] [--schedule auto] [--chunk N] [--T 2048]
        [--threads 1] [--compile] [--grad] [--rounds 5] [--repeat 5]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TUNED = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}   # 32 MiB: the largest glibc takes

CHILD = """
import json, statistics, time, torch, memspec
from memspec.pipeline.build import build_memory
from memspec.tools.bench import bench_dims, make_inputs
torch.set_num_threads({threads})
spec = memspec.load({path!r})
dims = bench_dims(spec)
m = build_memory(spec, compile={compile}, heads=4, **dims, **({{"chunk": {chunk}}} if {chunk} else {{}}))
views, gates = make_inputs(spec, 1, {T}, 4, dims, "cpu", torch.float32)
def call():
    vs = [x.detach().requires_grad_({grad}) for x in views.values()]
    gs = {{n: x.detach().requires_grad_({grad}) for n, x in gates.items()}}
    o, _ = m(*vs, **gs, schedule={schedule!r})
    if {grad}:
        o.square().sum().backward()
times = []
with torch.set_grad_enabled({grad}):
    for i in range({repeat} + 2):
        start = time.perf_counter()
        call()
        if i >= 2:
            times.append(time.perf_counter() - start)
print(json.dumps(statistics.median(times)))
"""


def child(a, tuned: bool) -> float:
    code = CHILD.format(threads=a.threads, path=str(ROOT / a.spec), chunk=a.chunk or 0, compile=a.compile,
                        T=a.T, grad=a.grad, schedule=a.schedule, repeat=a.repeat)
    env = {k: v for k, v in os.environ.items() if k not in TUNED}
    env["OMP_NUM_THREADS"] = str(a.threads)
    if tuned:
        env.update(TUNED)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    if out.returncode != 0:
        raise SystemExit(out.stderr.strip().splitlines()[-1] if out.stderr.strip() else "child failed")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", default="specs/lact.yaml")
    ap.add_argument("--schedule", default="auto")
    ap.add_argument("--chunk", type=int, default=None)
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--grad", action="store_true", help="forward + backward (default: forward)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args(argv)
    runs = {False: [], True: []}
    for _ in range(a.rounds):
        for tuned in (False, True):
            runs[tuned].append(child(a, tuned))
    base, tuned = (statistics.median(runs[t]) * 1e3 for t in (False, True))
    what = "forward + backward" if a.grad else "forward"
    print(f"{a.spec} ({a.schedule}{f', chunk {a.chunk}' if a.chunk else ''}{', compiled' if a.compile else ''}), "
          f"T={a.T}, {a.threads} thread(s), {what}: default {base:.2f} ms, "
          f"{' '.join(f'{k}={v}' for k, v in TUNED.items())} {tuned:.2f} ms, default / tuned {base / tuned:.2f}x")


if __name__ == "__main__":
    main()
