"""Our exact chunked kernels vs well-written pure-PyTorch chunked forms, same process.

Absolute times depend on the machine and its load, so this script measures comparable
pure-PyTorch chunked forms (flash-linear-attention's naive ``chunk`` references: row-by-row
forward substitution for the WY/UT transform, then a loop over chunks) next to
``memspec.runtime`` under the same load, plus the ``torch.bmm`` 64x64 peak, so the
comparison is fair whatever else the machine is doing.  The anchors get their inputs
already in their preferred ``[B, H, T, D]`` layout; ours take ``[B, T, H, D]``.

Each row prints median wall and process-CPU times, the speed-up, and the achieved
matmul GFLOP/s (``torch.utils.flop_counter`` on each implementation's own call) as a
fraction of the bmm peak.

With ``--backward`` each row times forward + backward (training): every input requires
grad and the loss is a fixed random projection of the outputs and the final state.

Per-channel decays (GLA) get a second table: ``chunk_additive`` with log decays
``[B, T, H, K]`` next to its own token recurrence (``recurrent_additive``, timed on fewer
rounds, it is slow) and to a pure-PyTorch chunked GLA written here from the math the way
flash-linear-attention's references are (chunks of 64, secondary sub-chunks of 16: scores
between sub-chunks factor through the query sub-chunk's start, those inside a sub-chunk are
built pairwise per channel, then a loop over chunks); and, when flash-linear-attention is
installed, the per-head decay kernel next to its ``naive_chunk_simple_gla``.
Where flash-linear-attention is installed (the ``test`` extra; loaded by file path through
``tests/peers.py``, no Triton), two more rows time its own pure-PyTorch chunked references,
``delta_rule_chunkwise`` (at its default chunk 32, and at 64) and
``naive_chunk_gated_delta_rule`` (chunk 64), against ``chunk_delta`` at chunk 64.

``--dplr`` times ``memspec.runtime.dplr.chunk_dplr`` on the memories it covers (KDA,
Gated DeltaNet-2, Comba, gated DeltaProduct with 2 steps, RWKV-7 / DPLR), and
``chunk_momentum_delta``, against their own token loops (``recurrent_dplr``,
``recurrent_momentum_delta``; timed ``--recurrent-repeat`` times: they are slow) and against fla's
pure-PyTorch chunked reference where one exists (``naive_chunk_kda``, ``naive_chunk_gdn2``,
``naive_chunk_comba``, ``chunk_momentum_delta_rule_ref``; timed ``--peer-repeat`` times,
alternated with ours; the last two compute other numbers, said in the row).  ``--dplr-chunk``
sets the chunk of the per-channel-decay rows (32, the chunk the compiled modules use: the
fastest on CPU), ``--chunk`` the others.

    python benchmarks/anchors.py [--T 2048] [--threads 2] [--backward] [--json out.json]
    python benchmarks/anchors.py --dplr [--backward] [--peer-repeat 3] [--recurrent-repeat 2]

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
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from memspec.tools.bench import bmm_peak
from memspec.runtime.additive import chunk_additive, recurrent_additive
from memspec.runtime.delta import chunk_delta
from memspec.runtime.dplr import chunk_dplr, recurrent_dplr
from memspec.runtime.momentum import chunk_momentum_delta, recurrent_momentum_delta


def fla_peer(op):
    """fla's ``ops/<op>/naive.py`` by file path (tests/peers.py), or None when fla is not installed."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    try:
        import pytest
        from peers import fla_naive
    except ImportError:
        return None
    try:
        return fla_naive(op)
    except pytest.skip.Exception:
        return None


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


def naive_chunk_gla(q, k, v, g, S0, C=64, c=16):
    """Chunked GLA, fla-style: q, k, v [B, H, T, D], g [B, H, T, K] per-channel log decays
    (T % C == 0, C % c == 0).  Inside a chunk, scores between sub-chunks of c tokens factor
    through the log decay at the query sub-chunk's start (both factors <= 1); inside a
    sub-chunk they are built pairwise per channel (``[c, c, K]``, masked before exp); the
    states follow in a loop over chunks."""
    B, H, T, K = q.shape
    N, n = T // C, C // c
    q, k, v, g = (x.reshape(B, H, N, C, x.shape[-1]) for x in (q, k, v, g))
    g = g.cumsum(-2)                                                 # [B, H, N, C, K]
    mask = torch.ones(c, c, dtype=torch.bool).tril()[:, :, None]     # s <= t
    A = q.new_zeros(B, H, N, C, C)
    for i in range(n):
        rows = slice(i * c, (i + 1) * c)
        q_i, g_i = q[..., rows, :], g[..., rows, :]
        if i:
            g_n = g[..., i * c - 1:i * c, :]                         # log decay before sub-chunk i
            q_n = q_i * (g_i - g_n).exp()
            for j in range(i):
                cols = slice(j * c, (j + 1) * c)
                A[..., rows, cols] = q_n @ (k[..., cols, :] * (g_n - g[..., cols, :]).exp()).transpose(-1, -2)
        pair = (g_i[..., :, None, :] - g_i[..., None, :, :]).masked_fill(~mask, float("-inf")).exp()
        A[..., rows, rows] = (q_i[..., :, None, :] * k[..., rows, :][..., None, :, :] * pair).sum(-1)
    S = S0.clone()
    o = torch.zeros_like(v)
    for t in range(N):
        g_t, g_end = g[:, :, t], g[:, :, t, -1:]                     # [B, H, C, K], [B, H, 1, K]
        o[:, :, t] = (q[:, :, t] * g_t.exp()) @ S + A[:, :, t] @ v[:, :, t]
        S = S * g_end.transpose(-1, -2).exp() + (k[:, :, t] * (g_end - g_t).exp()).transpose(-1, -2) @ v[:, :, t]
    return o.reshape(B, H, T, -1), S


def fla_simple_gla():
    """flash-linear-attention's ``fla/ops/simple_gla/naive.py`` loaded by file path (no Triton
    import), or None when it is not installed."""
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations or importlib.util.find_spec("einops") is None:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "ops" / "simple_gla" / "naive.py"
    if not path.is_file():
        return None
    mod_spec = importlib.util.spec_from_file_location("_fla_simple_gla_naive", path)
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    return module


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


def timed_many(fns, repeat, grad=False, every=None):
    """Several functions timed round-robin; for each, (median wall ms, median process CPU ms, best
    wall ms).  ``grad``: autograd on (forward + backward functions).  ``every[i] = m``: function i
    runs only in every m-th round (a slow one)."""
    wall = [[] for _ in fns]
    cpu = [[] for _ in fns]
    every = every or [1] * len(fns)
    with torch.set_grad_enabled(grad):
        for f, m in zip(fns, every):
            for _ in range(2 if m == 1 else 1):
                f()
        for r in range(repeat):
            for i, f in enumerate(fns):
                if r % every[i]:
                    continue
                t0, c0 = time.perf_counter(), time.process_time()
                f()
                wall[i].append(time.perf_counter() - t0)
                cpu[i].append(time.process_time() - c0)
    return [(statistics.median(w) * 1e3, statistics.median(c) * 1e3, min(w) * 1e3) for w, c in zip(wall, cpu)]


def with_backward(fn, inputs, seed=1, heads_first=False):
    """``fn`` (returning (o, S)) followed by the backward of a fixed random projection of o and S
    with respect to ``inputs`` (the same projection for [B, T, H, V] and head-first outputs)."""
    state = {}

    def run():
        o, S = fn()
        if "w" not in state:
            g = torch.Generator().manual_seed(seed)
            shape = (o.shape[0], o.shape[2], o.shape[1], o.shape[3]) if heads_first else o.shape
            w_o = torch.randn(shape, generator=g)
            state["w"] = (w_o.transpose(1, 2) if heads_first else w_o, torch.randn(S.shape, generator=g))
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
    ap.add_argument("--dplr", action="store_true", help="time chunk_dplr's memories (see the docstring)")
    ap.add_argument("--chunk", type=int, default=64, help="chunk of the --dplr rows with scalar decays")
    ap.add_argument("--dplr-chunk", type=int, default=32, help="chunk of the --dplr rows with per-channel decays")
    ap.add_argument("--peer-repeat", type=int, default=3, help="--dplr: repetitions with fla's (slow) references")
    ap.add_argument("--recurrent-repeat", type=int, default=2, help="--dplr: repetitions of the token loop")
    ap.add_argument("--ttt", action="store_true", help="TTT-Linear vs fla's chunk_ttt_linear_ref")
    ap.add_argument("--online", action="store_true", help="the online fallback: grad(...) vs outer product")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.dplr:
        return dplr_main(a)
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
    # flash-linear-attention's own references (q scaled by 1/sqrt(K) inside delta_rule_chunkwise; the
    # same work), where installed; chunk_delta at chunk 64 throughout
    fla_dr, fla_gdr = fla_peer("delta_rule"), fla_peer("gated_delta_rule")
    if fla_dr is not None:
        rows["delta rule (fla C32)"] = (rows["delta rule"][0],
                                        lambda: fla_dr.delta_rule_chunkwise(qh, kh, vh, bh, chunk_size=32))
        rows["delta rule (fla C64)"] = (rows["delta rule"][0],
                                        lambda: fla_dr.delta_rule_chunkwise(qh, kh, vh, bh, chunk_size=64))
    if fla_gdr is not None:
        rows["gated delta (fla)"] = (rows["gated delta rule"][0],
                                     lambda: fla_gdr.naive_chunk_gated_delta_rule(q, k, v, lg, beta, chunk_size=64, scale=1.0,
                                                                                 initial_state=S0, output_final_state=True))
    if a.backward:
        ours_in, theirs_in = [q, k, v, beta, lg], [qh, kh, vh, bh, gh]
        for name, (mine, theirs) in list(rows.items()):
            used = [3] if "delta" in name else []
            used += [4] if ("gated" in name or "decayed" in name) else []
            theirs_used = [x for i, x in enumerate(ours_in if name == "gated delta (fla)" else theirs_in)
                           if i < 3 or i in used]
            rows[name] = (with_backward(mine, [x for i, x in enumerate(ours_in) if i < 3 or i in used]),
                          with_backward(theirs, theirs_used, heads_first=name.startswith("delta rule (fla")))
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
        print(f"{name:<20} memspec {m[0]:7.2f} ms (cpu {m[1]:6.2f}, best {m[2]:6.2f}, {frac(pk['memspec'])})   "
              f"pure-PyTorch chunked {t[0]:7.2f} ms (cpu {t[1]:6.2f}, best {t[2]:6.2f}, {frac(pk['naive_chunk'])})   "
              f"speed-up x{t[0] / m[0]:.2f} (cpu x{t[1] / m[1]:.2f}, best x{t[2] / m[2]:.2f})")
    out["channel"] = channel_rows(a, q.detach(), k.detach(), v.detach(), S0)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)


def channel_rows(a, q, k, v, S0):
    """Per-channel decays (GLA): memspec vs its token recurrence and the pure-PyTorch chunked GLA;
    the per-head decay kernel vs fla's naive_chunk_simple_gla (when installed)."""
    g = torch.Generator().manual_seed(1)
    B, T, H, K = q.shape
    lgc = torch.log(0.9 + 0.1 * torch.rand(B, T, H, K, generator=g))    # per-channel log decays
    lg = lgc[..., 0].contiguous()                                      # per-head
    qh, kh, vh, gh = (x.transpose(1, 2).contiguous() for x in (q, k, v, lgc))
    with torch.no_grad():  # the chunked reference agrees with ours (sanity) before timing
        ours = chunk_additive(q, k, v, lgc, S0, 64)[0].transpose(1, 2)
        ref = naive_chunk_gla(qh, kh, vh, gh, S0)[0]
        assert (ours - ref).abs().max() < 1e-3, (ours - ref).abs().max()
    peer = fla_simple_gla()
    if peer is not None:
        with torch.no_grad():
            ours = chunk_additive(q, k, v, lg, S0, 64)[0]
            ref = peer.naive_chunk_simple_gla(q, k, v, lg, initial_state=S0, scale=1.0)[0]
            assert (ours - ref).abs().max() < 1e-3, (ours - ref).abs().max()
    if a.backward:
        q, k, v, lgc, lg, qh, kh, vh, gh = (x.requires_grad_() for x in (q, k, v, lgc, lg, qh, kh, vh, gh))
    fns = {"memspec": (lambda: chunk_additive(q, k, v, lgc, S0, 64), [q, k, v, lgc]),
           "pure-PyTorch chunked GLA": (lambda: naive_chunk_gla(qh, kh, vh, gh, S0), [qh, kh, vh, gh]),
           "token recurrence": (lambda: recurrent_additive(q, k, v, lgc, S0), [q, k, v, lgc])}
    run = {name: with_backward(f, ins) if a.backward else f for name, (f, ins) in fns.items()}
    res = timed_many(list(run.values()), a.repeat, grad=a.backward, every=[1, 1, 5])
    rows = {"per-channel decay": dict(zip(run, ({"ms": r[0], "cpu_ms": r[1], "best_ms": r[2]} for r in res)))}
    m, c, rec = res
    print(f"\nper-channel decays (GLA), chunk 64{'; forward + backward' if a.backward else ''}:")
    print(f"  memspec {m[0]:7.2f} ms (cpu {m[1]:6.2f})   pure-PyTorch chunked GLA {c[0]:7.2f} ms (cpu {c[1]:6.2f}):"
          f" x{c[0] / m[0]:.2f} (cpu x{c[1] / m[1]:.2f})   token recurrence {rec[0]:8.1f} ms (cpu {rec[1]:7.1f}):"
          f" x{rec[0] / m[0]:.1f} (cpu x{rec[1] / m[1]:.1f})")
    if peer is not None:
        pair = {"memspec": (lambda: chunk_additive(q, k, v, lg, S0, 64), [q, k, v, lg]),
                "fla naive_chunk_simple_gla": (lambda: peer.naive_chunk_simple_gla(
                    q, k, v, lg, initial_state=S0, output_final_state=True, scale=1.0), [q, k, v, lg])}
        run = {name: with_backward(f, ins) if a.backward else f for name, (f, ins) in pair.items()}
        m, t = timed_many(list(run.values()), a.repeat, grad=a.backward)
        rows["per-head decay"] = {"memspec": {"ms": m[0], "cpu_ms": m[1], "best_ms": m[2]},
                                  "fla naive_chunk_simple_gla": {"ms": t[0], "cpu_ms": t[1], "best_ms": t[2]}}
        print(f"  per-head decay: memspec {m[0]:7.2f} ms (cpu {m[1]:6.2f})   fla naive_chunk_simple_gla"
              f" {t[0]:7.2f} ms (cpu {t[1]:6.2f}): x{t[0] / m[0]:.2f} (cpu x{t[1] / m[1]:.2f})")
    return rows


def dplr_inputs(B, T, H, D, seed=0):
    """Inputs of the --dplr rows: views [B, T, H, D], gates, per-channel log decays in log(0.9..1)."""
    g = torch.Generator().manual_seed(seed)
    unit = lambda *s: torch.nn.functional.normalize(torch.randn(*s, D, generator=g), dim=-1)  # noqa: E731
    x = {"q": torch.randn(B, T, H, D, generator=g) / D ** 0.5, "k": unit(B, T, H), "v": torch.randn(B, T, H, D, generator=g),
         "beta": torch.rand(B, T, H, generator=g), "g": torch.log(0.9 + 0.1 * torch.rand(B, T, H, D, generator=g)),
         "gs": torch.log(0.9 + 0.1 * torch.rand(B, T, H, generator=g)), "p": unit(B, T, H),
         "b_gate": torch.rand(B, T, H, D, generator=g), "w": torch.rand(B, T, H, D, generator=g),
         "k2": unit(B, T, H, 2), "v2": torch.randn(B, T, H, 2, D, generator=g), "beta2": torch.rand(B, T, H, 2, generator=g),
         "kk": unit(B, T, H), "iclr": torch.rand(B, T, H, D, generator=g)}
    return x


def dplr_rows(x, C, Cc):
    """name -> (memspec's chunked kernel, memspec's token loop, fla's chunked reference or None, inputs
    used, None where fla's reference computes the same recurrence, else a note); each callable returns
    (o, S_T)."""
    kda, gdn2, comba = fla_peer("kda"), fla_peer("gdn2"), fla_peer("comba")
    rows = {}

    def both(name, args, kw, peer, used, note=None):
        rows[name] = (lambda: chunk_dplr(*args(), **kw), lambda: recurrent_dplr(*args()[:7], **kw_rec(kw)),
                      peer, used, note)

    def kw_rec(kw):
        return {key: val for key, val in kw.items() if key == "read_after_decay"}

    q, k, v, beta, g, gs = (x[n] for n in ("q", "k", "v", "beta", "g", "gs"))
    # KDA: S <- Diag(e^g) S; S += beta k (v - k^T S)^T, read after the decay
    both("KDA", lambda: (q, k, v * beta[..., None], -beta, None, g, None, Cc), {"read_after_decay": True},
         (lambda: kda.naive_chunk_kda(q, k, v, g, beta, scale=1.0, output_final_state=True)) if kda else None,
         ["q", "k", "v", "beta", "g"])
    # GDN-2: S <- Diag(e^g) S; S += k (w v - (b k)^T S)^T
    bg, w = x["b_gate"], x["w"]
    both("GDN-2", lambda: (q, k, w * v, -torch.ones_like(beta), bg * k, g, None, Cc), {"read_after_decay": True},
         (lambda: gdn2.naive_chunk_gdn2(q, k, v, g, bg, w, scale=1.0, output_final_state=True)) if gdn2 else None,
         ["q", "k", "v", "g", "b_gate", "w"])
    # Comba: S <- e^g S; S += beta k (v - p^T S)^T (the recurrent reference's order; fla's naive_chunk_comba
    # reads p^T S before the decay: the same work, other numbers)
    p = x["p"]
    both("Comba", lambda: (q, k, v * beta[..., None], -beta, p, gs, None, C), {"read_after_decay": True},
         (lambda: comba.naive_chunk_comba(q, k, v, p, gs, beta, scale=1.0, output_final_state=True)) if comba else None,
         ["q", "k", "v", "beta", "gs", "p"], note="fla reads p^T S before the decay")
    # gated DeltaProduct, 2 Householder steps per token
    k2, v2, b2 = x["k2"], x["v2"], x["beta2"]
    both("DeltaProduct(2)", lambda: (q, k2, v2 * b2[..., None], -b2, None, gs, None, C), {"read_after_decay": True},
         None, ["q", "k2", "v2", "beta2", "gs"])
    # RWKV-7 / DPLR: S <- Diag(w) S + (kk * iclr)(-kk)^T S + k v^T, per-channel w
    kk, iclr = x["kk"], x["iclr"]
    both("RWKV-7 (DPLR)", lambda: (q, k, v, kk * iclr, -kk, g, None, Cc), {}, None, ["q", "k", "v", "kk", "iclr", "g"])
    # momentum delta rule: M = mu M + eta k (p^T S - v)^T, S = alpha S - beta M (fla's
    # chunk_momentum_delta_rule_ref does not match its recurrent reference: timed, not compared)
    mom = fla_peer("momentum_delta_rule")
    # p = k and eta in [0, 0.2] (momentum_deltanet's regime): with p != k or eta near 1 the recurrence
    # itself grows past 1e13 over 2048 tokens, and no kernel can be compared to another there
    margs = lambda: (q, k, v, k, gs, gs * 0.5, beta, 0.2 * x["iclr"][..., 0], None, None)  # noqa: E731
    two = lambda f: (lambda: (lambda o, S, M: (o, torch.stack([S, M])))(*f()))  # noqa: E731  (o, [S; M])
    rows["momentum delta"] = (
        two(lambda: chunk_momentum_delta(*margs(), C)), two(lambda: recurrent_momentum_delta(*margs())),
        (lambda: mom.chunk_momentum_delta_rule_ref(*margs()[:8], scale=1.0, output_final_state=True,
                                                   chunk_size=C)) if mom else None,
        ["q", "k", "v", "gs", "beta", "iclr"], "fla's chunked reference != its recurrent one")
    return rows


def dplr_main(a):
    B, T, H, D = a.B, a.T, a.H, a.D
    x = dplr_inputs(B, T, H, D)
    rows = dplr_rows(x, a.chunk, a.dplr_chunk)
    with torch.no_grad():   # sanity: chunked = token loop = fla where it is the same recurrence
        for name, (mine, rec, peer, _, note) in rows.items():
            o, S = mine()
            o_r, S_r = rec()
            assert (o - o_r).abs().max() < 1e-3 and (S - S_r).abs().max() < 1e-3, name
            if peer is not None and note is None:
                o_p, S_p = peer()
                assert (o - o_p).abs().max() < 1e-3 and (S - S_p).abs().max() < 1e-3, (name, (o - o_p).abs().max())
    if a.backward:
        for t in x.values():
            t.requires_grad_()
        rows = {name: tuple([with_backward(f, [x[n] for n in used]) if f is not None else None
                             for f in (mine, rec, peer)] + [used, note])
                for name, (mine, rec, peer, used, note) in rows.items()}
    print(f"chunk_dplr, B={B} T={T} H={H} D={D}, {torch.get_num_threads()} threads, chunk {a.chunk} "
          f"(per-channel decays {a.dplr_chunk})" + ("; forward + backward" if a.backward else "; forward"))
    out = {"T": T, "B": B, "H": H, "D": D, "threads": torch.get_num_threads(), "backward": a.backward,
           "chunk": a.chunk, "dplr_chunk": a.dplr_chunk, "rows": {}}
    for name, (mine, rec, peer, _, note) in rows.items():
        fns = [mine] + ([peer] if peer is not None else [])
        times = timed_many(fns, a.peer_repeat if peer is not None else a.repeat, grad=a.backward)
        (r,) = timed_many([rec], a.recurrent_repeat, grad=a.backward)
        m = times[0]
        row = {"memspec_ms": m[0], "memspec_best_ms": m[2], "recurrent_ms": r[0], "recurrent_speedup": r[0] / m[0]}
        line = f"{name:<16} memspec {m[0]:8.2f} ms (best {m[2]:7.2f})   token loop {r[0]:9.1f} ms x{r[0] / m[0]:6.1f}"
        if peer is not None:
            t = times[1]
            row.update({"fla_chunk_ms": t[0], "fla_chunk_best_ms": t[2], "fla_speedup": t[0] / m[0],
                        "fla_note": note})
            line += f"   fla naive chunk {t[0]:9.1f} ms x{t[0] / m[0]:6.1f}" + (f" ({note})" if note else "")
        out["rows"][name] = row
        print(line)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
