"""How fast can an exact chunked form be in eager PyTorch on this machine?

Can every exact chunked form run at least 20x faster than its own online schedule (B=1, H=4,
T=2048, D=64, float32, no grad, 2 threads)?  This script measures the ceiling of
that ratio for the simplest chunked memory there is, retention (one scalar decay per head,
``S_t = gamma S_{t-1} + k_t^T v_t``, ``o_t = q_t S_t``, ``specs/retention.yaml``), timing
alternately in one process:

* ``online``: the compiled module's online schedule (one step per token);
* ``chunked``: its additive chunked schedule (``memspec.runtime.additive.chunk_additive``);
* ``minimal``: the fewest eager ops an exact chunked form of it needs, written here: the
  layout copies into chunks, the in-chunk cumulative log decays, the scores ``q k^T`` with
  their ``[C, C]`` decay weights and causal mask, the chunk increments ``K~^T V``, one fused
  state step per chunk, the reads ``(q e^L) S_start + scores V`` and the copy back; no
  non-finite masking, no tail chunk, chunks batched ``--group`` at a time as memspec's kernels
  batch them (checked equal to ``chunked``);
* ``matmuls``: the four batched matmuls alone (scores, increments, reads of the start states,
  scores times values), on operands already laid out;
* with ``--compile``: ``minimal`` with its group step under ``torch.compile(dynamic=False)``
  (static shapes, compiled once; the loop over groups stays in Python).

Each round runs every row twice and times the second run (the first call after another row's
pays for what that one left: measured 1.2-1.7x after the online schedule, as in ``memspec bench``).
Each row prints the median time and the ratio online / row.  If ``minimal`` stays under 20x,
no eager chunked form of any memory reaches the target on this machine: every other family does
at least this work per chunk (per-channel decays and DPLR transitions add to it).

    python benchmarks/floor.py [--T 2048] [--group 8] [--repeat 15] [--threads 2] [--compile]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def retention_group(q, k, v, log_gamma, S, chunk):
    """Exact chunked retention over one group of whole chunks with the fewest eager ops.
    q, k: [B, n C, H, K]; v: [B, n C, H, V]; log_gamma: [B, n C, H] (<= 0); S: [B, H, K, V] the
    state before the group.  Returns (o [B, n C, H, V], the state after the group)."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    C = chunk
    N = T // C

    def chunks(x):  # [B, T, H, D] -> [B N H, C, D]
        return x.reshape(B, N, C, H, x.shape[-1]).permute(0, 1, 3, 2, 4).reshape(B * N * H, C, x.shape[-1])

    qc, kc, vc = chunks(q), chunks(k), chunks(v)
    L = log_gamma.reshape(B, N, C, H).permute(0, 1, 3, 2).reshape(B * N * H, C).cumsum(-1)   # [BNH, C]
    scores = torch.bmm(qc, kc.transpose(1, 2))                                               # [BNH, C, C]
    scores = (scores * torch.exp((L[:, :, None] - L[:, None, :]).tril())).tril()
    kd = kc * torch.exp(L[:, -1:] - L)[..., None]                                            # keys to the chunk end
    inc = torch.bmm(kd.transpose(1, 2), vc).view(B, N, H, K, V)                             # K~^T V per chunk
    g = torch.exp(L[:, -1]).view(B, N, H, 1, 1)                                              # decay over each chunk
    starts = []
    for j in range(N):
        starts.append(S)
        S = torch.addcmul(inc[:, j], g[:, j], S)
    S_start = torch.stack(starts, 1).reshape(B * N * H, K, V)
    o = torch.baddbmm(torch.bmm(qc * torch.exp(L)[..., None], S_start), scores, vc)         # [BNH, C, V]
    return o.view(B, N, H, C, V).permute(0, 1, 3, 2, 4).reshape(B, T, H, V), S


def minimal_retention(q, k, v, log_gamma, chunk, group, step=retention_group):
    """Retention over T (a multiple of chunk * group) in groups of ``group`` chunks, each by
    ``step``; zero start state.  Returns (o [B, T, H, V], S_T [B, H, K, V])."""
    B, T, H, K = k.shape
    S = q.new_zeros(B, H, K, v.shape[-1])
    outs = []
    n = chunk * group
    for t in range(0, T, n):
        o, S = step(q[:, t:t + n], k[:, t:t + n], v[:, t:t + n], log_gamma[:, t:t + n], S, chunk)
        outs.append(o)
    return torch.cat(outs, 1), S


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--H", type=int, default=4)
    ap.add_argument("--D", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--group", type=int, default=8,
                    help="chunks per batched group of the minimal form (8: temporaries of 512 KB, as memspec's)")
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compile", action="store_true", help="also time the minimal form under torch.compile")
    a = ap.parse_args(argv)
    if a.T % (a.chunk * a.group):
        ap.error("--T must be a multiple of --chunk times --group (the minimal form has no tail)")
    torch.set_num_threads(a.threads)
    sys.path.insert(0, str(ROOT))
    from memspec.pipeline.build import build_memory
    from memspec.tools.bench import alternate

    B, T, H, D = a.B, a.T, a.H, a.D
    memory = build_memory(ROOT / "specs" / "retention.yaml", compile=False, heads=H, d_k=D, d_v=D,
                          chunk=a.chunk)   # eager (build_memory compiles by default)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, T, H, D, generator=g) for _ in range(3))
    k = torch.nn.functional.normalize(k, dim=-1)
    with torch.no_grad():
        log_gamma = torch.nn.functional.logsigmoid(memory.lam).expand(B, T, H).contiguous()
    N = T // a.chunk
    ops = [torch.randn(B * N * H, a.chunk, D, generator=g) for _ in range(3)] + [torch.randn(B * N * H, D, D, generator=g)]

    def matmuls():
        qc, kc, vc, S = ops
        s = torch.bmm(qc, kc.transpose(1, 2))
        torch.bmm(kc.transpose(1, 2), vc)
        return torch.baddbmm(torch.bmm(qc, S), s, vc)

    rows = {
        "online": lambda: memory(q, k, v, schedule="online"),
        "chunked": lambda: memory(q, k, v, schedule="additive"),
        "minimal": lambda: minimal_retention(q, k, v, log_gamma, a.chunk, a.group),
        "matmuls": matmuls,
    }
    if a.compile:
        step = torch.compile(retention_group, dynamic=False)   # one group: static shapes, compiled once
        rows["minimal, compiled"] = lambda: minimal_retention(q, k, v, log_gamma, a.chunk, a.group, step)
    with torch.no_grad():
        ref_o, ref_S = rows["chunked"]()
        for name in ("minimal", "minimal, compiled"):
            if name in rows:
                o, S = rows[name]()
                err = max(((o - ref_o).norm() / ref_o.norm()).item(), ((S - ref_S["S"]).norm() / ref_S["S"].norm()).item())
                if err > 1e-4:
                    raise SystemExit(f"{name} differs from the chunked schedule (relative error {err:.1e})")
        for fn in rows.values():        # warm-up (and the compile)
            fn()
            fn()
        times = alternate(rows, a.repeat)   # round-robin, each timed run after a run of itself
    med = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
    print(f"retention, B={B} T={T} H={H} D={D} chunk {a.chunk}, float32, no grad, {a.threads} threads, "
          f"median of {a.repeat} alternated runs")
    print(f"{'row':<20} {'median ms':>10} {'online / row':>13}")
    for name, m in med.items():
        print(f"{name:<20} {m:>10.2f} {med['online'] / m:>12.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
