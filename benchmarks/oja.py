"""The gated Oja rule (specs/gated_oja.yaml): memspec's oja chunked form vs its own online
schedule, timed alternately in one process (the load of other processes falls on both).

Inputs as flash-linear-attention's tests draw them: q, k, v ``[B, T, H, D]`` scaled by ``D^-0.5``,
``beta ~ U(0, 1)`` ``[B, T, H]``, per-channel gates ``g = exp(-softplus(x - 2))`` ``[B, T, H, D]``.
Forward only (no autograd), eager, float32.  Prints the median wall and process-CPU time of
``--repeat`` runs after one warm-up each, the ratio online / chunked, and the relative difference of
the outputs (exit status 1 when it is above 1e-4).  ``--grad`` times forward + backward instead.

    python benchmarks/oja.py [--B 1] [--H 4] [--T 2048] [--D 64] [--chunk N] [--threads 2] [--repeat 5] [--grad]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from memspec.pipeline.build import build_memory

sys.path.insert(0, str(Path(__file__).resolve().parent))   # benchmarks/ is not a package
from timing import timed_alternately  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--H", type=int, default=4)
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--D", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=None, help="default: the module's (32 with a decay)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--grad", action="store_true", help="time forward + backward")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    B, H, T, D = args.B, args.H, args.T, args.D
    sizes = {"chunk": args.chunk} if args.chunk else {}
    memory = build_memory(ROOT / "specs" / "gated_oja.yaml", compile=False, heads=H, d_k=D, d_v=D,
                          **sizes)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, T, H, D, generator=g) * D ** -0.5 for _ in range(3))
    beta = torch.rand(B, T, H, generator=g)
    gate = torch.exp(-torch.nn.functional.softplus(torch.randn(B, T, H, D, generator=g) - 2.0))
    leaves = [q, k, v, beta, gate]
    if args.grad:
        for x in leaves:
            x.requires_grad_(True)
    outs = {}

    def run(schedule):
        def once():
            with torch.set_grad_enabled(args.grad):
                o = memory(q, k, v, beta=beta, g=gate, schedule=schedule)[0]
                if args.grad:
                    torch.autograd.grad(o.square().sum(), leaves)
            outs[schedule] = o.detach()
        return once

    times = timed_alternately({"oja": run("oja"), "online": run("online")}, args.repeat)
    what = "forward + backward" if args.grad else "forward"
    print(f"gated Oja rule {what}, B={B} H={H} T={T} D={D}, float32, chunk {memory.chunk}, {args.threads} "
          f"thread(s), median of {args.repeat}")
    for name, (wall, cpu) in times.items():
        print(f"  memspec {name:10s} {wall:9.2f} ms wall {cpu:9.2f} ms CPU")
    (cw, cc), (ow, oc) = times["oja"], times["online"]
    print(f"  online / oja chunked: {ow / cw:.2f}x wall, {oc / cc:.2f}x CPU")
    ref = outs["online"].double()
    rel = float((outs["oja"].double() - ref).norm() / ref.norm())
    print(f"  relative difference (norm), chunked vs online: {rel:.2e}")
    if rel > 1e-4:
        print("error: the chunked form computes another function (relative difference above 1e-4)")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
