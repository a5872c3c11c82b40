"""Our exact chunked kernels vs well-written pure-PyTorch chunked forms, same process.

The issue's anchors (about 24 ms delta rule, 46 ms gated delta rule, 8 ms linear
attention at B=1, H=4, T=2048, D=64, float32, no grad, 2 CPU cores) were measured on
a quiet machine.  This script re-measures comparable pure-PyTorch chunked forms
(flash-linear-attention's naive ``chunk`` references: row-by-row forward
substitution for the WY/UT transform, then a loop over chunks) next to
``memspec.runtime`` under the same load, plus the ``torch.bmm`` 64x64 peak, so the
comparison is fair whatever else the machine is doing.  The anchors get their inputs
already in their preferred ``[B, H, T, D]`` layout; ours take ``[B, T, H, D]``.

Each row prints median wall and process-CPU times, the speed-up, and the achieved
matmul GFLOP/s (``torch.utils.flop_counter`` on each implementation's own call) as a
fraction of the bmm peak.

With ``--backward`` each row times forward + backward (training): every input requires
grad and the loss is a fixed random projection of the outputs and the final state.

    python benchmarks/anchors.py [--T 2048] [--threads 2] [--backward] [--json out.json]

``--ttt`` times the compiled ``specs/ttt_linear.yaml`` module (mini-batch 16, dual form;
eager and ``compile=True``) against flash-linear-attention's pure-PyTorch
``chunk_ttt_linear_ref`` (``fla/ops/ttt/naive.py``, loaded by file path: the ``bench``
extra).  The two compute the same mini-batch TTT-Linear when eta is constant within each
mini-batch (the peer indexes eta by the reading row) and T is a multiple of 16 (the peer
corrupts its bias state on a padded tail), with eps 1e-5 and scale 1 given to the peer;
the final states are checked equal before timing.  The outputs differ by construction
(the peer's read is z + LN(z), memspec's spec reads q + LN(z)), so only the states are
compared.

``--online`` times the online fallback: a gated delta rule written with ``grad(loss, S)``
against the same update written as an explicit outer product, both ``schedule="online"``
(the per-token step; the closed-form gradient makes the two the same code).

    python benchmarks/anchors.py --ttt [--backward] [--threads 2]
    python benchmarks/anchors.py --online [--T 512]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from memspec.tools.bench import bmm_peak
from memspec.runtime.additive import chunk_additive
from memspec.runtime.delta import chunk_delta


def naive_chunk_delta_rule(q, k, v, beta, S0, C=64):
    """FLA-style naive chunked delta rule; q, k, v [B, H, T, D], beta [B, H, T] (T % C == 0)."""
    B, H, T, K = k.shape
    v = v * beta[..., None]
    k_beta = k * beta[..., None]
    q, k, v, k_beta = (x.reshape(B, H, T // C, C, x.shape[-1]) for x in (q, k, v, k_beta))
    mask = torch.triu(torch.ones(C, C, dtype=torch.bool), diagonal=0)
    attn = -(k_beta @ k.transpose(-1, -2)).masked_fill(mask, 0)
    for i in range(1, C):
        attn[..., i, :i] = attn[..., i, :i] + (attn[..., i, :, None].clone() * attn[..., :, :i].clone()).sum(-2)
    attn = attn + torch.eye(C)
    u = attn @ v
    w = attn @ k_beta
    S = S0.clone()
    o = torch.zeros_like(u)
    mask = torch.triu(torch.ones(C, C, dtype=torch.bool), diagonal=1)
    for i in range(T // C):
        q_i, k_i = q[:, :, i], k[:, :, i]
        a = (q_i @ k_i.transpose(-1, -2)).masked_fill_(mask, 0)
        u_i = u[:, :, i] - w[:, :, i] @ S
        o[:, :, i] = q_i @ S + a @ u_i
        S = S + k_i.transpose(-1, -2) @ u_i
    return o.reshape(B, H, T, -1), S


def naive_chunk_gated_delta_rule(q, k, v, beta, g, S0, C=64):
    """FLA-style naive chunked gated delta rule; g [B, H, T] log decays."""
    B, H, T, K = k.shape
    v = v * beta[..., None]
    k_beta = k * beta[..., None]
    q, k, v, k_beta = (x.reshape(B, H, T // C, C, x.shape[-1]) for x in (q, k, v, k_beta))
    g = g.reshape(B, H, T // C, C).cumsum(-1)
    mask = torch.triu(torch.ones(C, C, dtype=torch.bool), diagonal=0)
    decay = (g[..., :, None] - g[..., None, :]).tril().exp().tril()
    attn = -((k_beta @ k.transpose(-1, -2)) * decay).masked_fill(mask, 0)
    for i in range(1, C):
        attn[..., i, :i] = attn[..., i, :i] + (attn[..., i, :, None].clone() * attn[..., :, :i].clone()).sum(-2)
    attn = attn + torch.eye(C)
    u = attn @ v
    w = attn @ (k_beta * g.exp()[..., None])
    S = S0.clone()
    o = torch.zeros_like(u)
    mask = torch.triu(torch.ones(C, C, dtype=torch.bool), diagonal=1)
    for i in range(T // C):
        q_i, k_i, g_i = q[:, :, i], k[:, :, i], g[:, :, i]
        a = (q_i @ k_i.transpose(-1, -2) * decay[:, :, i]).masked_fill_(mask, 0)
        u_i = u[:, :, i] - w[:, :, i] @ S
        o[:, :, i] = (q_i * g_i[..., None].exp()) @ S + a @ u_i
        S = S * g_i[..., -1, None, None].exp() + (k_i * (g_i[..., -1, None] - g_i).exp()[..., None]).transpose(-1, -2) @ u_i
    return o.reshape(B, H, T, -1), S


def naive_chunk_linear_attention(q, k, v, S0, C=64):
    """Chunked causal linear attention; q, k, v [B, H, T, D]."""
    B, H, T, K = k.shape
    q, k, v = (x.reshape(B, H, T // C, C, x.shape[-1]) for x in (q, k, v))
    mask = torch.triu(torch.ones(C, C, dtype=torch.bool), diagonal=1)
    S = S0.clone()
    o = torch.zeros_like(v)
    for i in range(T // C):
        q_i, k_i, v_i = q[:, :, i], k[:, :, i], v[:, :, i]
        o[:, :, i] = q_i @ S + (q_i @ k_i.transpose(-1, -2)).masked_fill_(mask, 0) @ v_i
        S = S + k_i.transpose(-1, -2) @ v_i
    return o.reshape(B, H, T, -1), S


def naive_chunk_decayed_linear_attention(q, k, v, g, S0, C=64):
    """Chunked linear attention with a scalar log decay per token (retention / simple GLA);
    q, k, v [B, H, T, D], g [B, H, T] (T % C == 0)."""
    B, H, T, K = k.shape
    q, k, v = (x.reshape(B, H, T // C, C, x.shape[-1]) for x in (q, k, v))
    g = g.reshape(B, H, T // C, C).cumsum(-1)
    mask = torch.triu(torch.ones(C, C, dtype=torch.bool), diagonal=1)
    S = S0.clone()
    o = torch.zeros_like(v)
    for i in range(T // C):
        q_i, k_i, v_i, g_i = q[:, :, i], k[:, :, i], v[:, :, i], g[:, :, i]
        decay = (g_i[..., :, None] - g_i[..., None, :]).masked_fill(mask, float("-inf")).exp()
        o[:, :, i] = (q_i * g_i.exp()[..., None]) @ S + (q_i @ k_i.transpose(-1, -2) * decay) @ v_i
        S = S * g_i[..., -1, None, None].exp() + (k_i * (g_i[..., -1:] - g_i).exp()[..., None]).transpose(-1, -2) @ v_i
    return o.reshape(B, H, T, -1), S


def matmul_flops(fn, grad=False):
    """Matmul FLOPs of one call (``torch.utils.flop_counter``), or None where unavailable; with
    ``grad`` the call runs with autograd on (a forward + backward function)."""
    try:
        from torch.utils.flop_counter import FlopCounterMode
    except ImportError:  # pragma: no cover
        return None
    with torch.set_grad_enabled(grad), FlopCounterMode(display=False) as fc:
        fn()
    return fc.get_total_flops()


def timed(fn, repeat):
    """(median wall ms, median process CPU ms, best wall ms): on a loaded machine the CPU time is the
    steadier one."""
    return timed_many([fn], repeat)[0]


def timed_pair(fn_a, fn_b, repeat, grad=False):
    """Both functions timed alternately (a, b, a, b, ...), so that load from other processes falls on
    both alike; for each, (median wall ms, median process CPU ms, best wall ms)."""
    return timed_many([f for f in (fn_a, fn_b) if f is not None], repeat, grad)


def timed_many(fns, repeat, grad=False):
    """Several functions timed round-robin; for each, (median wall ms, median process CPU ms, best
    wall ms).  ``grad``: autograd on (forward + backward functions)."""
    wall = [[] for _ in fns]
    cpu = [[] for _ in fns]
    with torch.set_grad_enabled(grad):
        for f in fns:
            f()
            f()
        for _ in range(repeat):
            for i, f in enumerate(fns):
                t0, c0 = time.perf_counter(), time.process_time()
                f()
                wall[i].append(time.perf_counter() - t0)
                cpu[i].append(time.process_time() - c0)
    return [(statistics.median(w) * 1e3, statistics.median(c) * 1e3, min(w) * 1e3) for w, c in zip(wall, cpu)]


def with_backward(fn, inputs, seed=1):
    """``fn`` (returning (o, S)) followed by the backward of a fixed random projection of o and S
    with respect to ``inputs``."""
    state = {}

    def run():
        o, S = fn()
        if "w" not in state:
            g = torch.Generator().manual_seed(seed)
            state["w"] = (torch.randn(o.shape, generator=g), torch.randn(S.shape, generator=g))
        w_o, w_s = state["w"]
        loss = (o * w_o).sum() + (S * w_s).sum()
        return torch.autograd.grad(loss, inputs)
    return run


def ratio_line(name, m, t, who="peer"):
    print(f"{name:<34} memspec {m[0]:8.1f} ms (cpu {m[1]:8.1f})   {who} {t[0]:8.1f} ms (cpu {t[1]:8.1f})   "
          f"memspec / {who} = {m[0] / t[0]:.2f} (cpu {m[1] / t[1]:.2f})")


def ttt_rows(a):
    """TTT-Linear mini-batch 16: memspec (eager, compiled) vs fla's chunk_ttt_linear_ref."""
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root / "tests"))
    from peers import fla_root
    import importlib.util
    import memspec.pipeline.build as build
    path = fla_root() / "ops" / "ttt" / "naive.py"
    spec = importlib.util.spec_from_file_location("_fla_ttt_naive", path)
    naive = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(naive)
    B, T, H, D, C = a.B, a.T, a.H, a.D, 16
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, T, H, D, generator=g)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, D, generator=g), dim=-1)
    v = torch.randn(B, T, H, D, generator=g)
    eta = (0.1 * torch.rand(B, T // C, 1, H, generator=g)).expand(B, T // C, C, H).reshape(B, T, H)
    mems = {c: build.build_memory(root / "specs/ttt_linear.yaml", compile=c, heads=H, d_k=D) for c in (False, True)}
    mem = mems[False]
    mems[True].load_state_dict(mem.state_dict())
    leaves = [q, k, v, eta]

    def ours(m, grad):
        def run():
            xs = [x.detach().requires_grad_(grad) for x in leaves]
            o, st = m(xs[0], xs[1], xs[2], eta=xs[3])
            if grad:
                (o.sum() + st["W"].sum() + st["b"].sum()).backward()
            return st
        return run

    def theirs(grad):
        def run():
            xs = [x.detach().requires_grad_(grad) for x in leaves]
            W0 = mem.W_init.detach().expand(B, H, D, D).clone()
            b0 = mem.b_init.detach().reshape(1, H, 1, D).expand(B, H, 1, D).clone()
            # (a clone: the peer scales q in place)
            o, h, hb = naive.chunk_ttt_linear_ref(xs[0].clone(), xs[1], xs[2], mem.ln_w.detach(), mem.ln_b.detach(), xs[3][..., None],
                                                  scale=1.0, eps=1e-5, mini_batch_size=C, initial_state=W0,
                                                  initial_state_bias=b0, output_final_state=True)
            if grad:
                (o.sum() + h.sum() + hb.sum()).backward()
            return {"W": h, "b": hb.squeeze(-2)}
        return run

    with torch.no_grad():
        mine, peer = ours(mem, False)(), theirs(False)()
        for s in ("W", "b"):
            err = ((mine[s] - peer[s]).norm() / peer[s].norm()).item()
            assert err < 1e-4, (s, err)
    print(f"TTT-Linear mini-batch {C}, B={B} T={T} H={H} D={D}, float32, threads={torch.get_num_threads()}; "
          "final states agree with fla's chunk_ttt_linear_ref")
    for grad in (False, True):
        what = "forward + backward" if grad else "forward"
        fns = [ours(mems[False], grad), ours(mems[True], grad), theirs(grad)]
        with torch.set_grad_enabled(grad):
            fns[1]()   # compile outside the timing
        eager, comp, peer = timed_many(fns, a.repeat, grad)
        ratio_line(f"ttt_linear eager, {what}", eager, peer, "fla")
        ratio_line(f"ttt_linear compile=True, {what}", comp, peer, "fla")


GATED_DELTA_GRAD = """
name: gated_delta_grad
dims: {d_model: 256, heads: 4, d_k: 64, d_v: 64}
views: {q: d_k, k: d_k, v: d_v}
gates: {beta: sigmoid(logit), alpha: sigmoid(logit)}
state: {S: {shape: [d_k, d_v]}}
loss: 0.5 * sum((k @ S - v)^2)
update:
  - S = alpha * S - beta * grad(loss, S)
read: q @ S
"""
GATED_DELTA_OUTER = GATED_DELTA_GRAD.replace("gated_delta_grad", "gated_delta_outer").replace(
    "beta * grad(loss, S)", "beta * outer(k, k @ S - v)")


def online_rows(a):
    """The online fallback: a gated delta rule with grad(...) vs the explicit outer product."""
    import tempfile
    from pathlib import Path
    import memspec.pipeline.build as build
    mems = {}
    with tempfile.TemporaryDirectory() as d:
        for name, text in (("grad", GATED_DELTA_GRAD), ("outer", GATED_DELTA_OUTER)):
            p = Path(d) / f"{name}.yaml"
            p.write_text(text)
            mems[name] = build.build_memory(p, compile=False)
    B, T, H, D = a.B, a.T, a.H, a.D
    g = torch.Generator().manual_seed(0)
    q, v = torch.randn(B, T, H, D, generator=g), torch.randn(B, T, H, D, generator=g)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, D, generator=g), dim=-1)
    beta, alpha = torch.rand(B, T, H, generator=g), 0.9 + 0.1 * torch.rand(B, T, H, generator=g)

    def run(m):
        return lambda: m(q, k, v, beta=beta, alpha=alpha, schedule="online")
    with torch.no_grad():
        o1, o2 = run(mems["grad"])()[0], run(mems["outer"])()[0]
        assert (o1 - o2).abs().max() < 1e-4
        m, t = timed_many([run(mems["grad"]), run(mems["outer"])], a.repeat)
    print(f"online gated delta rule, B={B} T={T} H={H} D={D}, threads={torch.get_num_threads()}")
    ratio_line("grad(loss, S) vs outer(k, k @ S - v)", m, t, "outer")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--H", type=int, default=4)
    ap.add_argument("--D", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--backward", action="store_true", help="time forward + backward")
    ap.add_argument("--json")
    ap.add_argument("--ttt", action="store_true", help="TTT-Linear vs fla's chunk_ttt_linear_ref")
    ap.add_argument("--online", action="store_true", help="the online fallback: grad(...) vs outer product")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.ttt or a.online:
        if a.ttt:
            ttt_rows(a)
        if a.online:
            online_rows(a)
        return
    g = torch.Generator().manual_seed(0)
    B, T, H, D = a.B, a.T, a.H, a.D
    q = torch.randn(B, T, H, D, generator=g) / D ** 0.5
    k = torch.nn.functional.normalize(torch.randn(B, T, H, D, generator=g), dim=-1)
    v = torch.randn(B, T, H, D, generator=g)
    beta = torch.rand(B, T, H, generator=g)
    lg = torch.log(0.9 + 0.1 * torch.rand(B, T, H, generator=g))
    S0 = torch.zeros(B, H, D, D)
    qh, kh, vh = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    bh, gh = beta.transpose(1, 2).contiguous(), lg.transpose(1, 2).contiguous()
    # the naive forms agree with ours (sanity) before timing
    with torch.no_grad():
        ours = chunk_delta(q, k, v, beta, lg, S0, 64)[0].transpose(1, 2)
        ref = naive_chunk_gated_delta_rule(qh, kh, vh, bh, gh, S0)[0]
        assert (ours - ref).abs().max() < 1e-3, (ours - ref).abs().max()
        for lg_arg, naive in ((None, lambda: naive_chunk_linear_attention(qh, kh, vh, S0)),
                              (lg, lambda: naive_chunk_decayed_linear_attention(qh, kh, vh, gh, S0))):
            ours = chunk_additive(q, k, v, lg_arg, S0, 64)[0].transpose(1, 2)
            assert (ours - naive()[0]).abs().max() < 1e-3, (ours - naive()[0]).abs().max()
    if a.backward:
        leaves = [x.requires_grad_() for x in (q, k, v, beta, lg, qh, kh, vh, bh, gh)]
        q, k, v, beta, lg, qh, kh, vh, bh, gh = leaves
    rows = {
        "delta rule": (lambda: chunk_delta(q, k, v, beta, None, S0, 64),
                       lambda: naive_chunk_delta_rule(qh, kh, vh, bh, S0)),
        "gated delta rule": (lambda: chunk_delta(q, k, v, beta, lg, S0, 64),
                             lambda: naive_chunk_gated_delta_rule(qh, kh, vh, bh, gh, S0)),
        "linear attention": (lambda: chunk_additive(q, k, v, None, S0, 64),
                             lambda: naive_chunk_linear_attention(qh, kh, vh, S0)),
        "decayed lin. attn": (lambda: chunk_additive(q, k, v, lg, S0, 64),
                              lambda: naive_chunk_decayed_linear_attention(qh, kh, vh, gh, S0)),
    }
    if a.backward:
        ours_in, theirs_in = [q, k, v, beta, lg], [qh, kh, vh, bh, gh]
        for name, (mine, theirs) in list(rows.items()):
            used = [3] if "delta" in name else []
            used += [4] if ("gated" in name or "decayed" in name) else []
            rows[name] = (with_backward(mine, [x for i, x in enumerate(ours_in) if i < 3 or i in used]),
                          with_backward(theirs, [x for i, x in enumerate(theirs_in) if i < 3 or i in used]))
    peak = bmm_peak("cpu")
    out = {"T": T, "B": B, "H": H, "D": D, "threads": torch.get_num_threads(), "bmm_peak_gflops": peak,
           "backward": a.backward, "rows": {}}
    print(f"torch.bmm 64x64 peak: {peak:.1f} GFLOP/s ({torch.get_num_threads()} threads)"
          + ("; forward + backward" if a.backward else "; forward"))
    for name, (mine, theirs) in rows.items():
        m, t = timed_pair(mine, theirs, a.repeat, grad=a.backward)
        fm, ft = matmul_flops(mine, a.backward), matmul_flops(theirs, a.backward)
        pk = {}
        for who, f, ms in (("memspec", fm, m[0]), ("naive_chunk", ft, t[0])):
            pk[who] = f / (ms * 1e-3) / 1e9 / peak if f else None
        out["rows"][name] = {"memspec_ms": m[0], "memspec_cpu_ms": m[1], "memspec_best_ms": m[2],
                             "naive_chunk_ms": t[0], "naive_chunk_cpu_ms": t[1], "naive_chunk_best_ms": t[2],
                             "memspec_flops": fm, "naive_chunk_flops": ft,
                             "memspec_peak_fraction": pk["memspec"], "naive_chunk_peak_fraction": pk["naive_chunk"]}

        def frac(x):
            return f"{100 * x:3.0f}% pk" if x is not None else "  -    "
        print(f"{name:<18} memspec {m[0]:7.2f} ms (cpu {m[1]:6.2f}, best {m[2]:6.2f}, {frac(pk['memspec'])})   "
              f"pure-PyTorch chunked {t[0]:7.2f} ms (cpu {t[1]:6.2f}, best {t[2]:6.2f}, {frac(pk['naive_chunk'])})   "
              f"speed-up x{t[0] / m[0]:.2f} (cpu x{t[1] / m[1]:.2f}, best x{t[2] / m[2]:.2f})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
