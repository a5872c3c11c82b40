"""The shipped memories linear in their state: the exact chunked schedule vs the same module's
online schedule, timed alternately in one process (the load of other processes falls on both).

For each spec: the compiled ``<Name>Memory`` (eager), views ``[B, T, H, D]`` with unit-norm
rows and gates in (0, 1) as ``memspec bench`` makes them, and per schedule the median wall time
and the median process-CPU time (the steadier one on a loaded machine) of ``--repeat`` runs,
after one warm-up each; the ratio online / chunked.  ``--backward`` times forward + backward
(every view and gate requires grad; the loss is a fixed random projection of the outputs and
the final state).

    python benchmarks/linear_specs.py [--T 2048] [--threads 2] [--backward] [--repeat 3]
                                      [--specs gla,kda,...] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import memspec
from memspec.pipeline.build import build_memory

sys.path.insert(0, str(Path(__file__).resolve().parent))   # benchmarks/ is not a package
from timing import timed_alternately  # noqa: E402

from memspec.schedule import analyse
from memspec.tools.bench import make_inputs

ROOT = Path(__file__).resolve().parent.parent
SPECS = ["retention", "mamba2", "gla", "rwkv6", "hgrn2", "deltanet_textbook", "kda", "gdn2", "comba", "rwkv7",
         "gated_deltaproduct"]


def runner(memory, views, gates, schedule, grad, seed=1):
    state = {}

    def run():
        o, st = memory(*views.values(), **gates, schedule=schedule)
        if not grad:
            return o
        if "w" not in state:
            g = torch.Generator().manual_seed(seed)
            state["w"] = (torch.randn(o.shape, generator=g), {n: torch.randn(t.shape, generator=g)
                                                              for n, t in st.items()})
        w_o, w_s = state["w"]
        loss = (o * w_o).sum() + sum((st[n] * w).sum() for n, w in w_s.items())
        return torch.autograd.grad(loss, [*views.values(), *gates.values()])
    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--H", type=int, default=4)
    ap.add_argument("--D", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--backward", action="store_true")
    ap.add_argument("--specs", default=",".join(SPECS))
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    out = {"T": a.T, "B": a.B, "H": a.H, "D": a.D, "threads": a.threads, "backward": a.backward, "rows": {}}
    print(f"T={a.T} B={a.B} H={a.H} D={a.D} float32, {a.threads} threads, "
          + ("forward + backward" if a.backward else "forward, no grad") + f", median of {a.repeat}, alternately")
    for name in a.specs.split(","):
        spec = memspec.load(ROOT / "specs" / f"{name}.yaml")
        d = analyse(spec)
        dims = {x: a.D for x in ("d_k", "d_v") if x in spec.dims}
        memory = build_memory(spec, compile=False, heads=a.H, **dims)
        views, gates = make_inputs(spec, a.B, a.T, a.H, dims, "cpu", torch.float32)
        if a.backward:
            for x in (*views.values(), *gates.values()):
                x.requires_grad_(True)
        fns = {s: runner(memory, views, gates, s, a.backward) for s in (d.family, "online")}
        t = timed_alternately(fns, a.repeat, a.backward)
        (cw, cc), (ow, oc) = t[d.family], t["online"]
        out["rows"][name] = {"family": d.family, "chunked_ms": cw, "chunked_cpu_ms": cc, "online_ms": ow,
                             "online_cpu_ms": oc, "speedup": ow / cw, "speedup_cpu": oc / cc}
        print(f"{name:<20} {d.family:<9} {cw:9.1f} ms (cpu {cc:9.1f})   online {ow:10.1f} ms (cpu {oc:10.1f})   "
              f"x{ow / cw:6.1f} (cpu x{oc / cc:6.1f})", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
