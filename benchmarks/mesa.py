"""The mesa layer (specs/mesa.yaml): memspec's solve chunked form (conjugate gradients for every token's
system over whole chunks, to the solver's tolerance, then the additive probe of G) vs its own online
schedule (one torch.linalg.solve per token) and vs flash-linear-attention's pure-PyTorch MesaNet references
(``naive_mesa_net_CG``: chunked conjugate gradients, a fixed 30 steps; ``naive_mesa_net_exact``: every
token's state materialised and one batched torch.linalg.solve; loaded by file path through
``tests/peers.py``: no Triton; skipped without fla-core), timed alternately in one process.

The same inputs for all: q, k, v ``[B, T, H, D]`` ~ N(0, 1) (fla takes q, k l2-normalised, as the spec
does), eta = sigmoid(N(0, 1)), alpha = sigmoid(N(0, 1) - 4) (fla: beta = eta, g = log(1 - alpha), lamb =
lam per head and channel), zero initial states.  Forward only unless ``--grad`` (forward + backward of
the outputs' sum), eager, float32.  Prints the median wall and process-CPU time of ``--repeat`` runs
after one warm-up each, the ratios to the solve form, and each output's relative difference to the
float64 online schedule (exit status 1 when memspec's solve form is above 1e-4).

    python benchmarks/mesa.py [--B 1] [--H 4] [--T 2048] [--D 64] [--chunk N] [--fla-chunk 64]
        [--threads 2] [--repeat 5] [--grad] [--exact]

``--chunk``: memspec's chunk (default: the module's own, from the schedule decision); ``--fla-chunk``:
the chunk of fla's chunked reference (default 64, its kernels' chunk).
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

import memspec
from memspec.pipeline.build import build_memory

sys.path.insert(0, str(Path(__file__).resolve().parent))   # benchmarks/ is not a package
from timing import timed_alternately  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def fla_mesa():
    """fla's ``mesa_net/naive.py`` module, or None when flash-linear-attention is not installed."""
    if importlib.util.find_spec("fla") is None or importlib.util.find_spec("einops") is None:
        return None
    sys.path.insert(0, str(ROOT / "tests"))
    from peers import fla_naive
    return fla_naive("mesa_net")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("B", 1), ("H", 4), ("T", 2048), ("D", 64), ("chunk", None), ("fla-chunk", 64),
                          ("threads", 2), ("repeat", 5)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--grad", action="store_true", help="time forward + backward of the outputs' sum")
    ap.add_argument("--exact", action="store_true", help="time fla's naive_mesa_net_exact too (T x D x D floats)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    B, H, T, D = args.B, args.H, args.T, args.D
    chunk = {} if args.chunk is None else {"chunk": args.chunk}
    memory = build_memory(ROOT / "specs" / "mesa.yaml", compile=False, heads=H, d_k=D, d_v=D, **chunk)
    lam = float(memspec.load(ROOT / "specs" / "mesa.yaml").constants["lam"])
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, T, H, D, generator=g) for _ in range(3))
    eta = torch.sigmoid(torch.randn(B, T, H, generator=g))
    alpha = torch.sigmoid(torch.randn(B, T, H, generator=g) - 4.0)
    peer = fla_mesa()
    fla_chunk = args.fla_chunk if T % args.fla_chunk == 0 else None   # fla's reference takes whole chunks only

    def run(fn):
        def go():
            xs = [x.clone().requires_grad_(args.grad) for x in (q, k, v, eta, alpha)]
            o = fn(*xs)
            if args.grad and torch.is_grad_enabled():
                o.sum().backward()
            return o
        return go

    def fla(kind):
        def f(q, k, v, eta, alpha):
            qn, kn = (torch.nn.functional.normalize(x, dim=-1) for x in (q, k))
            lamb = torch.full((H, D), lam)
            if kind == "CG":
                return peer.naive_mesa_net_CG(qn, kn, v, torch.log(1 - alpha), lamb, eta, fla_chunk)[0]
            return peer.naive_mesa_net_exact(qn, kn, v, torch.log(1 - alpha), lamb, eta)[0]
        return f

    fns = {
        "memspec solve": run(lambda q, k, v, e, a: memory(q, k, v, eta=e, alpha=a, schedule="solve")[0]),
        "memspec online": run(lambda q, k, v, e, a: memory(q, k, v, eta=e, alpha=a, schedule="online")[0]),
    }
    if peer is not None and fla_chunk is not None:
        fns["fla naive_mesa_net_CG"] = run(fla("CG"))
    if peer is not None and args.exact:
        fns["fla naive_mesa_net_exact"] = run(fla("exact"))
    with torch.no_grad():
        ref = memory.double()(*(x.double() for x in (q, k, v)), eta=eta.double(), alpha=alpha.double(),
                              schedule="online")[0]
        memory.float()
        errs = {n: f() for n, f in fns.items()}
        errs = {n: ((o.double() - ref).norm() / ref.norm()).item() for n, o in errs.items()}
    times = timed_alternately(fns, args.repeat, args.grad)
    mine = times["memspec solve"][0]
    what = "forward + backward" if args.grad else "forward"
    print(f"mesa {what}: B={B} H={H} T={T} D={D} chunk={memory.chunk} (fla {fla_chunk}) threads={args.threads} "
          f"repeat={args.repeat} (median wall / process-CPU ms; rel diff to the float64 online schedule)")
    for name, (w, c) in times.items():
        ratio = f"{w / mine:6.2f}x the solve form" if name != "memspec solve" else "      1.00x"
        print(f"  {name:26s} {w:9.1f} ms wall {c:9.1f} ms cpu  {ratio}  rel diff {errs[name]:.1e}")
    if peer is None:
        print("  fla naive_mesa_net_CG: not installed (pip install -e '.[test]')")
    return 1 if errs["memspec solve"] > 1e-4 else 0


if __name__ == "__main__":
    raise SystemExit(main())
