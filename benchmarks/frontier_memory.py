"""Peak memory and time of one forward + backward of each frontier layer, each in a process of its own.

The layer of each spec (d_model 256, 4 heads of 64, hidden 128, eager, float32, x [1, T, 256]),
one forward and backward of ``y.square().mean()``; printed: the process's peak resident memory
(``ru_maxrss``, which includes torch's own ~0.3 GB), the wall time, and the ratio of the peak to
the titans layer's (the bound it is held to: within 3x).  A spec that runs out of the memory limit or
the time limit is reported as such.  The children run with ``MALLOC_MMAP_THRESHOLD_=65536``: tensors
of 64 KiB or more are mapped and unmapped, so the resident peak is the peak of live tensors (glibc's
heap otherwise keeps freed chunks resident, and a run that frees many tensors of varying sizes -- a
recomputed chunk -- reads several times its live peak).

    python benchmarks/frontier_memory.py [--T 2048] [--threads 1] [--limit-gb 20] [--timeout 600] [--markdown]
"""
from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPECS = ["titans", "lact", "variants/lact_swa", "omeganet", "memora", "hope_cms", "atlas", "titans_muon",
         "variants/titans_muon_chunked"]

CHILD = """
import resource, sys, time, torch, memspec
torch.set_num_threads({threads})
layer = memspec.build({path!r}, compile=False, d_model=256, heads=4, **{dims!r})
x = torch.randn(1, {T}, 256)
start = time.perf_counter()
layer(x).square().mean().backward()
print(time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def run(name: str, a) -> tuple[str, float | None, float | None]:
    import memspec
    from memspec.tools.bench import bench_dims

    path = ROOT / "specs" / f"{name}.yaml"
    spec = memspec.load(path)
    dims = bench_dims(spec)
    code = CHILD.format(threads=a.threads, path=str(path), dims=dims, T=a.T)
    limit = int(a.limit_gb * 2**30)

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    try:
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": str(a.threads)}
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=a.timeout,
                             preexec_fn=cap, env=env)
    except subprocess.TimeoutExpired:
        return "timeout", None, None
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["?"])[-1]
        return ("out of memory" if "memory" in last.lower() else last[:60]), None, None
    seconds, kb = out.stdout.split()
    return "ok", float(seconds), int(kb) / 2**20


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--limit-gb", type=float, default=20.0)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--markdown", action="store_true", help="print a Markdown table (for the README)")
    ap.add_argument("specs", nargs="*", default=SPECS)
    a = ap.parse_args(argv)
    title = (f"forward + backward of each layer, x [1, {a.T}, 256], {a.threads} thread(s), "
             f"memory limit {a.limit_gb:g} GB, {time.strftime('%Y-%m-%d')}")
    if a.markdown:
        print(f"`python benchmarks/frontier_memory.py --T {a.T} --threads {a.threads} --markdown` ({title}):\n")
        print("| spec | schedule | peak GB | / titans | seconds |\n|---|---|---:|---:|---:|")
    else:
        print(title)
        print(f"{'spec':32} {'status':>14} {'seconds':>9} {'peak GB':>8} {'/ titans':>9}")
    base = None
    for name in a.specs:
        status, seconds, gb = run(name, a)
        if name == "titans" and gb is not None:
            base = gb
        if a.markdown:
            import memspec
            from memspec.schedule import analyse
            d = analyse(memspec.load(ROOT / "specs" / f"{name}.yaml"))
            sched = f"{d.family}({d.chunk})" if d.chunk else d.family
            cells = [f"{gb:.2f}", f"{gb / base:.2f}" if base else "—", f"{seconds:.1f}"] if gb is not None \
                else [status, "—", "—"]
            print(f"| {name} | {sched} | " + " | ".join(cells) + " |", flush=True)
            continue
        ratio = f"{gb / base:9.2f}" if gb is not None and base else f"{'':>9}"
        print(f"{name:32} {status:>14} {seconds if seconds is not None else float('nan'):9.1f} "
              f"{gb if gb is not None else float('nan'):8.2f} {ratio}", flush=True)


if __name__ == "__main__":
    main()
