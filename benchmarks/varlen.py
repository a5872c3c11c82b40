"""Packed variable-length sequences (cu_seqlens): what they cost and what they save.

    python benchmarks/varlen.py ab --rev REV      # unpacked kernels: REV's source vs this checkout's
    python benchmarks/varlen.py packed            # packed vs padded training step (tokens/s)

``ab``: every exact chunked kernel of ``memspec.runtime`` as this checkout has it against the same
kernel's source at git revision REV (loaded from ``git show``), on one unpacked batch (B = 1,
T = 2048, H = 4, K = V = 64), forward and forward + backward, timed round-robin in one process
(``memspec.tools.bench.alternate``); prints the median time of each and their ratio.

``packed``: a training step (forward + backward) of a compiled memory over a batch of documents whose
lengths are log-normal (mean about 300 tokens) up to 8,192 tokens: packed into one row with
cu_seqlens, and padded to the longest document ([N, T_max]); prints tokens/s of each and the padded
batch's fraction of real tokens.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from memspec.runtime import additive, delta, dplr, momentum  # noqa: E402
from memspec.tools.bench import alternate  # noqa: E402

KERNELS = {"additive": additive.chunk_additive, "delta": delta.chunk_delta, "dplr": dplr.chunk_dplr,
           "momentum": momentum.chunk_momentum_delta}


def old_kernel(rev: str, family: str):
    """The kernel ``family`` as revision ``rev`` wrote it (its module's source, executed alone)."""
    src = subprocess.run(["git", "show", f"{rev}:memspec/runtime/{family}.py"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    scope: dict = {"__name__": f"old_{family}"}
    exec(compile(src, f"{rev}:{family}.py", "exec"), scope)
    return scope[KERNELS[family].__name__]


def kernel_cases(T=2048, H=4, D=64):
    """(name, family, args, kwargs) of one unpacked call per kernel form worth timing."""
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(1, T, *shape, generator=g)

    q, k, v = r(H, D), torch.nn.functional.normalize(r(H, D), dim=-1), r(H, D)
    beta, lg = torch.rand(1, T, H, generator=g), -0.1 * torch.rand(1, T, H, generator=g)
    lgc = -0.1 * torch.rand(1, T, H, D, generator=g)
    S0 = torch.zeros(1, H, D, D)
    return [
        ("retention (additive, scalar decay)", "additive", (q, k, v, lg, S0, 64), {}),
        ("gla (additive, per channel)", "additive", (q, k, v, lgc, S0, 64), {}),
        ("gated_deltanet (delta)", "delta", (q, k, v, beta, lg, S0, 64), {}),
        ("kda (dplr, per channel)", "dplr", (q, k, v, -beta, None, lgc, S0, 32), {"read_after_decay": True}),
        ("comba (dplr, scalar decay)", "dplr", (q, k, v, -beta, k.flip(-1), lg, S0, 64), {"read_after_decay": True}),
        ("momentum_deltanet (momentum)", "momentum", (q, k, v, k, lg, lg, beta, beta, S0, S0, 64), {}),
    ]


def ab(rev: str, rounds: int) -> None:
    for name, family, args, kw in kernel_cases():
        new, old = KERNELS[family], old_kernel(rev, family)
        for grad in (False, True):
            leaves = [a.detach().clone().requires_grad_(grad) if torch.is_tensor(a) else a for a in args]

            def run(fn, leaves=leaves, grad=grad):
                with torch.set_grad_enabled(grad):
                    out = fn(*leaves, **kw)
                    if grad:
                        (out[0].square().sum() + out[1].square().sum()).backward()

            times = alternate({"old": lambda: run(old), "new": lambda: run(new)}, rounds)
            t_old, t_new = statistics.median(times["old"]), statistics.median(times["new"])
            print(f"{name:36s} {'fwd+bwd' if grad else 'fwd':8s} {rev[:10]} {1e3 * t_old:8.2f} ms   "
                  f"now {1e3 * t_new:8.2f} ms   now/old {t_new / t_old:5.3f}", flush=True)


def lengths_lognormal(total: int, mean: float, seed: int) -> list[int]:
    """Document lengths (log-normal, sigma 1, mean ``mean``) filling ``total`` tokens; the last one cut."""
    g = torch.Generator().manual_seed(seed)
    sigma = 1.0
    mu = torch.log(torch.tensor(mean)) - sigma ** 2 / 2
    out, used = [], 0
    while used < total:
        n = max(1, int(torch.exp(mu + sigma * torch.randn((), generator=g))))
        n = min(n, total - used)
        out.append(n)
        used += n
    return out


def packed(spec_paths: list[str], rounds: int, total: int = 8192, H: int = 4, D: int = 64) -> None:
    from memspec.pipeline.build import build_memory
    import memspec

    lengths = lengths_lognormal(total, 300.0, seed=0)
    N, T_max = len(lengths), max(lengths)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    print(f"{N} documents, {total} tokens, longest {T_max}: padded batch [{N}, {T_max}] is "
          f"{total / (N * T_max):.1%} real tokens")
    for path in spec_paths:
        spec = memspec.load(ROOT / path)
        dims = {d: D for d in ("d_k", "d_v") if d in spec.dims}
        m = build_memory(spec, heads=H, **dims)
        g = torch.Generator().manual_seed(1)
        views = {n: 0.5 * torch.randn(1, total, H, getattr(m, vw.dim), generator=g) for n, vw in spec.views.items()}
        gates = {n: 0.05 + 0.3 * torch.rand(1, total, H, *(getattr(m, d) for d in gt.shape), generator=g)
                 for n, gt in spec.gates.items()}

        def pad(x):   # [1, total, ...] -> [N, T_max, ...], documents left-aligned, zeros after
            out = x.new_zeros(N, T_max, *x.shape[2:])
            for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
                out[i, :b - a] = x[0, a:b]
            return out

        padded_in = {n: pad(x) for n, x in {**views, **gates}.items()}

        def step(inputs, **kw):
            leaves = {n: x.detach().requires_grad_(True) for n, x in inputs.items()}
            o, _ = m(*[leaves[v] for v in spec.views], **{g: leaves[g] for g in spec.gates}, **kw)
            o.square().sum().backward()

        times = alternate({"packed": lambda: step({**views, **gates}, cu_seqlens=cu),
                           "padded": lambda: step(padded_in)}, rounds)
        t_p, t_d = statistics.median(times["packed"]), statistics.median(times["padded"])
        print(f"{spec.name:20s} {m.DEFAULT_SCHEDULE:10s} packed {total / t_p:9.0f} tok/s ({1e3 * t_p:7.1f} ms)   "
              f"padded {total / t_d:9.0f} tok/s ({1e3 * t_d:7.1f} ms)   padded/packed time {t_d / t_p:5.2f}",
              flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("ab")
    a.add_argument("--rev", required=True)
    a.add_argument("--rounds", type=int, default=7)
    b = sub.add_parser("packed")
    b.add_argument("--specs", nargs="+", default=["specs/gated_deltanet.yaml", "specs/gla.yaml", "specs/kda.yaml",
                                                  "specs/momentum_deltanet.yaml", "specs/titans.yaml"])
    b.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.cmd == "ab":
        ab(args.rev, args.rounds)
    else:
        packed(args.specs, args.rounds)


if __name__ == "__main__":
    main()
