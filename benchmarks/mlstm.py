"""xLSTM's mLSTM (specs/mlstm.yaml): memspec's stabilised chunked form vs its own online
schedule and vs mlstm-kernels' native chunkwise PyTorch function (``pip install
mlstm-kernels==2.0.6``, the ``peers`` extra; skipped without it), timed alternately in one
process (the load of other processes falls on all of them).

The same inputs for all: q, k, v ``[B, T, H, D]`` with unit-norm rows, input-gate
preactivations ``ig ~ N(0, 3^2)`` and forget-gate preactivations ``fg ~ 3 + N(0, 1)``
(mlstm-kernels takes them ``[B, H, T, ...]``, transposed once outside the timing, eps = 0:
the same function).  Forward only (no autograd), eager, float32.  Prints the median wall and
process-CPU time of ``--repeat`` runs after one warm-up each, the ratios, and the largest
relative difference of the outputs (online and peer against the chunked form; exit status 1
when one is above 1e-4).

    python benchmarks/mlstm.py [--B 1] [--H 4] [--T 2048] [--D 64] [--chunk 64] [--threads 2] [--repeat 5]
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
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    B, H, T, D = args.B, args.H, args.T, args.D
    memory = build_memory(ROOT / "specs" / "mlstm.yaml", compile=False, chunk=args.chunk, heads=H, d_k=D, d_v=D)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.nn.functional.normalize(torch.randn(B, T, H, D, generator=g), dim=-1) for _ in range(3))
    ig = 3.0 * torch.randn(B, T, H, generator=g)
    fg = 3.0 + torch.randn(B, T, H, generator=g)
    outs = {}

    def ours(schedule):
        def run():
            outs[schedule] = memory(q, k, v, ig=ig, fg=fg, schedule=schedule)[0]
        return run

    fns = {"memspec chunked": ours("additive"), "memspec online": ours("online")}
    try:
        from mlstm_kernels.torch.chunkwise.native import (
            mlstm_chunkwise__native_autograd,
        )
    except ImportError:
        print("mlstm-kernels is not installed (pip install mlstm-kernels==2.0.6): its row is skipped")
    else:
        peer_args = [x.transpose(1, 2).contiguous() for x in (q, k, v, ig, fg)]   # [B, H, T, ...]

        def peer():
            outs["peer"] = mlstm_chunkwise__native_autograd(*peer_args, eps=0.0,
                                                            chunk_size=args.chunk).transpose(1, 2)
        fns["mlstm-kernels chunkwise (native)"] = peer
    times = timed_alternately(fns, args.repeat, grad=False)
    print(f"mLSTM forward, B={B} H={H} T={T} D={D}, float32, chunk {args.chunk}, {args.threads} thread(s), "
          f"median of {args.repeat}")
    for name, (wall, cpu) in times.items():
        print(f"  {name:34s} {wall:9.2f} ms wall {cpu:9.2f} ms CPU")
    base = times["memspec chunked"]
    for name, (wall, cpu) in times.items():
        if name != "memspec chunked":
            print(f"  {name} / memspec chunked: {wall / base[0]:.2f}x wall, {cpu / base[1]:.2f}x CPU")
    ref = outs["additive"].double()
    ok = True
    for name, o in (("online", outs["online"]), ("peer", outs.get("peer"))):
        if o is not None:
            rel = float((o.double() - ref).norm() / ref.norm())
            ok = ok and rel <= 1e-4
            print(f"  relative difference (norm), {name} vs chunked: {rel:.2e}")
    if not ok:
        print("error: a timed form computes another function (relative difference above 1e-4)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
