"""Gated slot attention (specs/gsa.yaml): memspec's chained chunked form (two passes: the value-decay
kernel for the key memory, the softmax over the slots, the additive kernel for the value memory) vs
its own online schedule and vs flash-linear-attention's ``naive_recurrent_gsa`` (pure PyTorch, loaded
by file path through ``tests/peers.py``: no Triton; skipped without fla-core), timed alternately in
one process (the load of other processes falls on all of them).

The same inputs for all: q, k, v ``[B, T, H, D]`` ~ N(0, 1), the slot gate ``alpha = 1 -
sigmoid(x)^(1/8)`` with x ~ N(0, 1) (fla takes ``s = alpha`` and ``g = log(1 - alpha)``), zero initial
states.  Forward only (no autograd) unless ``--grad`` (forward + backward of the outputs' sum), eager,
float32.  Prints the median wall and process-CPU time of ``--repeat`` runs after one warm-up each, the
ratios to the chained form, and the largest relative difference of the outputs (online and fla against
the chained form; exit status 1 when one is above 1e-4).

    python benchmarks/gsa.py [--B 1] [--H 4] [--T 2048] [--D 64] [--m 64] [--chunk 64] [--threads 2]
        [--repeat 5] [--grad]
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

from memspec.pipeline.build import build_memory

sys.path.insert(0, str(Path(__file__).resolve().parent))   # benchmarks/ is not a package
from timing import timed_alternately  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def fla_gsa():
    """fla's ``naive_recurrent_gsa``, or None when flash-linear-attention is not installed."""
    if importlib.util.find_spec("fla") is None or importlib.util.find_spec("einops") is None:
        return None
    sys.path.insert(0, str(ROOT / "tests"))
    from peers import fla_naive
    return fla_naive("gsa").naive_recurrent_gsa


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("B", 1), ("H", 4), ("T", 2048), ("D", 64), ("m", 64), ("chunk", 64), ("threads", 2),
                          ("repeat", 5)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--grad", action="store_true", help="time forward + backward of the outputs' sum")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    B, H, T, D, M = args.B, args.H, args.T, args.D, args.m
    memory = build_memory(ROOT / "specs" / "gsa.yaml", compile=False, chunk=args.chunk, heads=H, d_k=D, d_v=D, m=M)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, T, H, D, generator=g) for _ in range(3))
    alpha = 1 - torch.sigmoid(torch.randn(B, T, H, M, generator=g)) ** (1 / 8)
    log_keep = torch.log(1 - alpha)
    naive = fla_gsa()

    def run(fn):
        def go():
            xs = [x.clone().requires_grad_(args.grad) for x in (q, k, v, alpha)]
            o = fn(*xs)
            if args.grad:
                o.sum().backward()
            return o
        return go

    fns = {
        "memspec chained": run(lambda q, k, v, a: memory(q, k, v, alpha=a, schedule="chained")[0]),
        "memspec online": run(lambda q, k, v, a: memory(q, k, v, alpha=a, schedule="online")[0]),
    }
    if naive is not None:
        fns["fla naive_recurrent_gsa"] = run(lambda q, k, v, a: naive(q, k, v, a, torch.log(1 - a))[0])
    with torch.no_grad():
        ref = memory(q, k, v, alpha=alpha, schedule="chained")[0]
        errs = {"memspec online": memory(q, k, v, alpha=alpha, schedule="online")[0]}
        if naive is not None:
            errs["fla naive_recurrent_gsa"] = naive(q, k, v, alpha, log_keep)[0]
        errs = {n: ((o - ref).norm() / ref.norm()).item() for n, o in errs.items()}
    times = timed_alternately(fns, args.repeat, args.grad)
    mine = times["memspec chained"][0]
    what = "forward + backward" if args.grad else "forward"
    print(f"gsa {what}: B={B} H={H} T={T} D={D} m={M} chunk={args.chunk} threads={args.threads} "
          f"repeat={args.repeat} (median wall / process-CPU ms)")
    for name, (w, c) in times.items():
        ratio = f"{w / mine:6.2f}x the chained form" if name != "memspec chained" else "      1.00x"
        err = f"  rel diff {errs[name]:.1e}" if name in errs else ""
        print(f"  {name:26s} {w:9.1f} ms wall {c:9.1f} ms cpu  {ratio}{err}")
    if naive is None:
        print("  fla naive_recurrent_gsa: not installed (pip install -e '.[test]')")
    return 1 if any(e > 1e-4 for e in errs.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
