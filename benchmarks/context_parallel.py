"""Context parallelism on CPU: one sequence of T tokens over P gloo processes (one thread each) against
one process, forward + backward of the memory alone; time per step (median of the rounds, the slowest
rank's) and peak resident memory per rank (the rise of ``ru_maxrss`` over the process's footprint
once its inputs are built), and what the scan's map costs (the two-run batch from zeros and from the
identity) against one plain run of a shard.

    python benchmarks/context_parallel.py --spec specs/gated_deltanet.yaml --T 32768 --ranks 1 2
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _inputs(mem, T, gen):
    x = {n: torch.randn(1, T, mem.heads, getattr(mem, d), generator=gen) for n, d in mem.VIEWS.items()}
    gates = mem.GATES
    for g, shape in gates.items():
        x[g] = 0.1 + 0.8 * torch.rand(1, T, mem.heads, *(getattr(mem, d) for d in shape), generator=gen)
    return x


def _build(args):
    from memspec.pipeline.build import build_memory

    torch.manual_seed(0)
    return build_memory(args.spec, compile=False, heads=args.heads, d_k=args.d, d_v=args.d)


def _rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _worker(rank, world, init, args, out):
    from memspec.parallel import context_parallel, shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    mem = _build(args)
    mine = {n: shard(x).clone().requires_grad_() for n, x in _inputs(mem, args.T, torch.Generator().manual_seed(1)).items()}
    base = _rss_mb()
    times = []
    for i in range(args.rounds + 1):
        dist.barrier()
        t0 = time.perf_counter()
        o, s = context_parallel(mem, **mine)
        loss = o.square().mean() + (sum(v.square().mean() for v in s.values()) if rank == world - 1 else 0)
        loss.backward()
        dist.barrier()
        if i == 0:
            peak = _rss_mb() - base
        else:
            times.append(time.perf_counter() - t0)
        for x in mine.values():
            x.grad = None
    with open(os.path.join(out, f"{world}.{rank}.json"), "w") as f:
        json.dump({"time": statistics.median(times), "peak_mb": peak}, f)
    dist.destroy_process_group()


def _map_cost(args, P):
    """One process, one thread: the map of a shard of T / P tokens against one plain run of it."""
    from memspec.parallel import parallel_plan
    from memspec.parallel.maps import Layout, shard_maps

    torch.set_num_threads(1)
    mem = _build(args)
    plan = parallel_plan(args.spec)
    x = {n: v.requires_grad_() for n, v in _inputs(mem, args.T // P, torch.Generator().manual_seed(1)).items()}
    layout = Layout(mem, plan, x)

    def plain():
        o, s = mem(**x)
        (o.square().mean() + sum(v.square().mean() for v in s.values())).backward()

    def maps():
        Ms, D = shard_maps(mem, x, mem.DEFAULT_SCHEDULE, plan, layout)
        (sum(m.square().mean() for m in Ms) + sum(v.square().mean() for v in D.values())).backward()

    t = {"plain": [], "map": []}
    for _ in range(args.rounds + 1):
        for name, fn in (("plain", plain), ("map", maps)):   # alternated
            t0 = time.perf_counter()
            fn()
            t[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v[1:]) for k, v in t.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spec", default="specs/gated_deltanet.yaml")
    p.add_argument("--T", type=int, default=32768)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    out = tempfile.mkdtemp()
    rows = {}
    for world in args.ranks:
        mp.start_processes(_worker, args=(world, os.path.join(out, f"init{world}"), args, out), nprocs=world,
                           start_method="spawn")
        ranks = [json.load(open(os.path.join(out, f"{world}.{r}.json"))) for r in range(world)]
        rows[world] = (max(r["time"] for r in ranks), max(r["peak_mb"] for r in ranks))
    name = os.path.splitext(os.path.basename(args.spec))[0]
    print(f"`python benchmarks/context_parallel.py --spec {args.spec} --T {args.T} --ranks "
          f"{' '.join(map(str, args.ranks))}` ({name}, B = 1, H = {args.heads}, d = {args.d}, float32, "
          f"forward + backward, one thread per rank, torch {torch.__version__}):\n")
    print("| ranks | time per step (slowest rank) | vs 1 rank | peak memory per rank (rise) |")
    print("|---:|---:|---:|---:|")
    one = rows.get(1, rows[min(rows)])[0]
    for world, (t, mb) in rows.items():
        print(f"| {world} | {t:.2f} s | {t / one:.2f}x | {mb:.0f} MB |")
    cost = _map_cost(args, max(args.ranks))
    print(f"\nthe map of a shard of {args.T // max(args.ranks)} tokens (from zeros and from the identity, one "
          f"batch; forward + backward): {cost['map']:.2f} s against {cost['plain']:.2f} s for one plain run "
          f"({cost['map'] / cost['plain']:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
