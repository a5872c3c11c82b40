"""Titans' MLP memory, mini-batch(64): memspec's compiled module vs a plain PyTorch anchor.

The anchor is the way the open implementations write it (titans-pytorch style): per
chunk, ``torch.func.vmap`` of ``torch.func.grad`` of each token's loss at the
chunk-start weights (every token's gradients materialised, [B*H, C, d, hidden]), the
momentum and forgetting recurrences by a log-depth associative scan over the chunk, and
every token's read with its own materialised weights.  memspec's module (the dual form
derived from specs/titans.yaml) never materialises per-token weights.

Printed side by side, in one process (this machine is noisy): forward (no grad) and
forward + backward times of the memory alone (d_model 256 = 4 heads of 64, hidden 128,
T = 2048, B = 1, float32), the ratio to the anchor, and the ratio to the module's own
online schedule (forward only; the online schedule is slow, so it is timed once).

    OMP_NUM_THREADS=2 python benchmarks/titans_anchor.py [--T 2048] [--repeat 5] [--compile]

``--peer`` times the layers instead: memspec's ``TitansLayer`` (specs/titans.yaml, eager,
hidden 256 to match the peer's expansion factor 4) against titans-pytorch's
``NeuralMemory(dim=256, heads=4, dim_head=64, chunk_size=64)`` (the ``bench`` extra), eager
both, x [1, T, 256], forward and forward + backward, alternated in one process.  The peer's
memory model is its default (a 2-layer MLP inside a LayerNorm residual, with its own
projections, RMSNorms and learned gates): the same mini-batch learning, somewhat more work
around it.

    OMP_NUM_THREADS=2 python benchmarks/titans_anchor.py --peer [--T 2048] [--repeat 7]

Titans with Muon, as titans-pytorch's ``spectral_norm_surprises`` runs it (the momentum
orthogonalised once per chunk), against memspec's ``titans_muon_chunked`` variant:

    python benchmarks/titans_anchor.py --peer --spectral --spec specs/variants/titans_muon_chunked.yaml
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent


def _scan(a, x):
    """Inclusive associative scan of s_i = a_i s_(i-1) + x_i over dim 1 from s_0 = 0
    (Hillis-Steele, log2(C) steps): a [N, C], x [N, C, ...] -> s [N, C, ...]."""
    C = a.shape[1]
    extra = (None,) * (x.dim() - 2)
    step = 1
    while step < C:
        a_prev = torch.cat([torch.ones_like(a[:, :step]), a[:, :-step]], dim=1)
        x_prev = torch.cat([torch.zeros_like(x[:, :step]), x[:, :-step]], dim=1)
        x = x + a[(...,) + extra] * x_prev
        a = a * a_prev
        step *= 2
    return x


def titans_anchor(qn, kn, vs, eta, mu, alpha, W1, W2, C=64):
    """Plain mini-batch Titans: qn, kn, vs [B, T, H, D] (already normalised), gates
    [B, T, H], W1 [B, H, D, hidden], W2 [B, H, hidden, D] -> (o [B, T, H, D], W1, W2)."""
    B, T, H, D = kn.shape
    N = B * H

    def flat(x):  # [B, T, H, ...] -> [B*H, T, ...]
        return x.transpose(1, 2).reshape(N, T, *x.shape[3:])

    q, k, v, e, m, a = (flat(x) for x in (qn, kn, vs, eta, mu, alpha))
    W1, W2 = W1.reshape(N, *W1.shape[2:]), W2.reshape(N, *W2.shape[2:])
    U1, U2 = torch.zeros_like(W1), torch.zeros_like(W2)

    def token_loss(w1, w2, k_t, v_t):
        return 0.5 * ((F.gelu(k_t @ w1) @ w2 - v_t) ** 2).sum()

    grads = torch.func.vmap(torch.func.vmap(torch.func.grad(token_loss, argnums=(0, 1)),
                                            in_dims=(None, None, 0, 0)), in_dims=(0, 0, 0, 0))
    outs = []
    for s in range(0, T, C):
        sl = slice(s, min(s + C, T))
        g1, g2 = grads(W1, W2, k[:, sl], v[:, sl])                        # [N, C, D, hid], [N, C, hid, D]
        e_c, m_c, keep = e[:, sl], m[:, sl], 1 - a[:, sl]
        # momentum U_i = mu_i U_(i-1) - eta_i g_i from U (carried): fold U into the first token
        x1 = -e_c[..., None, None] * g1
        x2 = -e_c[..., None, None] * g2
        x1[:, 0] += m_c[:, 0, None, None] * U1
        x2[:, 0] += m_c[:, 0, None, None] * U2
        U1s, U2s = _scan(m_c, x1), _scan(m_c, x2)
        y1, y2 = U1s.clone(), U2s.clone()
        y1[:, 0] += keep[:, 0, None, None] * W1
        y2[:, 0] += keep[:, 0, None, None] * W2
        W1s, W2s = _scan(keep, y1), _scan(keep, y2)                      # every token's weights
        h = F.gelu(torch.einsum("ncd,ncdh->nch", q[:, sl], W1s))
        outs.append(torch.einsum("nch,nchd->ncd", h, W2s))
        W1, W2, U1, U2 = W1s[:, -1], W2s[:, -1], U1s[:, -1], U2s[:, -1]
    o = torch.cat(outs, dim=1).reshape(B, H, T, -1).transpose(1, 2)
    return o, W1.reshape(B, H, *W1.shape[1:]), W2.reshape(B, H, *W2.shape[1:])


def timed(fn, repeat):
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def peer_rows(a):
    """memspec's TitansLayer vs titans-pytorch's NeuralMemory, eager both, alternated."""
    import memspec.pipeline.build as build
    from titans_pytorch import NeuralMemory

    torch.manual_seed(0)
    ours_layer = build.build(ROOT / a.spec, compile=False, d_model=256, heads=4, d_k=64, d_v=64, hidden=256)
    # the spec's initial gate biases let this random (untrained) memory grow without bound over
    # 2048 tokens (NaN by the end, and NaN arithmetic is slow): a smaller step keeps it finite
    for name, proj in ours_layer.named_children():
        if name.startswith("eta") and name.endswith("_proj"):
            proj.bias.data.fill_(-5.0)
    peer = NeuralMemory(dim=256, heads=4, dim_head=64, chunk_size=64, spectral_norm_surprises=a.spectral)
    x = torch.randn(1, a.T, 256)

    def ours(grad):
        def run():
            xs = x.detach().requires_grad_(grad)
            y = ours_layer(xs)
            if grad:
                y.sum().backward()
        return run

    def theirs(grad):
        def run():
            xs = x.detach().requires_grad_(grad)
            y, _ = peer(xs)
            if grad:
                y.sum().backward()
        return run

    with torch.no_grad():
        y, st = ours_layer(x, return_state=True)
        assert torch.isfinite(y).all() and all(torch.isfinite(v).all() for v in st.values())
    print(f"{a.spec} vs NeuralMemory(spectral_norm_surprises={a.spectral}), x [1, {a.T}, 256], heads 4 x 64, "
          f"chunk 64, eager both, float32, threads={torch.get_num_threads()}")
    print(f"{'':24} {'memspec ms':>11} {'peer ms':>10} {'memspec/peer':>13} {'(process cpu)':>14}")
    for grad in (False, True):
        fns = [ours(grad), theirs(grad)]
        times, cpus = [[], []], [[], []]
        with torch.set_grad_enabled(grad):
            for f in fns:
                f()
            for _ in range(a.repeat):
                for i, f in enumerate(fns):
                    t0, c0 = time.perf_counter(), time.process_time()
                    f()
                    times[i].append(time.perf_counter() - t0)
                    cpus[i].append(time.process_time() - c0)
        m, t = (statistics.median(ts) * 1e3 for ts in times)
        mc, tc = (statistics.median(ts) for ts in cpus)
        print(f"{'forward + backward' if grad else 'forward (no grad)':24} {m:11.1f} {t:10.1f} {m / t:13.2f} "
              f"{mc / tc:14.2f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--peer", action="store_true", help="memspec's layer vs titans-pytorch's NeuralMemory")
    ap.add_argument("--spec", default="specs/titans.yaml", help="--peer: memspec's spec (e.g. "
                    "specs/variants/titans_muon_chunked.yaml with --spectral)")
    ap.add_argument("--spectral", action="store_true", help="--peer: NeuralMemory(spectral_norm_surprises=True)")
    ap.add_argument("--compile", action="store_true", help="torch.compile memspec's chunk step")
    ap.add_argument("--no-online", action="store_true")
    a = ap.parse_args()
    if a.peer:
        peer_rows(a)
        return
    import memspec

    torch.manual_seed(0)
    mem = memspec.pipeline.build(ROOT / "specs/titans.yaml", compile=a.compile).memory
    B, T, H, D, hid = 1, a.T, mem.heads, mem.d_k, mem.hidden
    q, k, v = (torch.randn(B, T, H, D) for _ in range(3))
    # a small step keeps this random (untrained) memory bounded over 2048 tokens; with the
    # spec's initial gate biases alone it grows without bound (~1e19 by token 256)
    eta, mu, alpha = (s * torch.sigmoid(torch.randn(B, T, H) + b) for s, b in ((0.05, -2.0), (1.0, 2.0), (1.0, -4.0)))
    leaves = [q, k, v, eta, mu, alpha]

    def ours(grad):
        xs = [x.detach().requires_grad_(grad) for x in leaves]
        o, st = mem(xs[0], xs[1], xs[2], eta=xs[3], mu=xs[4], alpha=xs[5])
        if grad:
            (o.sum() + st["W1"].sum() + st["W2"].sum()).backward()
        return o

    def anchor(grad):
        xs = [x.detach().requires_grad_(grad) for x in leaves]
        qn, kn = F.normalize(F.silu(xs[0]), dim=-1, eps=1e-6), F.normalize(F.silu(xs[1]), dim=-1, eps=1e-6)
        W1 = mem.W1_init.detach().expand(B, H, D, hid).requires_grad_(False)
        W2 = mem.W2_init.detach().expand(B, H, hid, D)
        o, W1e, W2e = titans_anchor(qn, kn, F.silu(xs[2]), xs[3], xs[4], xs[5], W1, W2, C=mem.chunk)
        if grad:
            (o.sum() + W1e.sum() + W2e.sum()).backward()
        return o

    with torch.no_grad():
        o_ours, o_anchor = ours(False), anchor(False)
        diff = ((o_ours - o_anchor).norm() / o_anchor.norm()).item()
    print(f"titans mini-batch({mem.chunk}), B={B} T={T} H={H} d_k={D} hidden={hid}, float32, "
          f"threads={torch.get_num_threads()}, compile={a.compile}")
    print(f"relative difference memspec vs anchor = {diff:.2e} (the same math; l2norm epsilons differ)")
    with torch.no_grad():
        f_ours = timed(lambda: ours(False), a.repeat)
        f_anchor = timed(lambda: anchor(False), a.repeat)
    b_ours = timed(lambda: ours(True), a.repeat)
    b_anchor = timed(lambda: anchor(True), a.repeat)
    print(f"{'':24} {'memspec ms':>11} {'anchor ms':>10} {'anchor/memspec':>15}")
    print(f"{'forward (no grad)':24} {f_ours:11.1f} {f_anchor:10.1f} {f_anchor / f_ours:15.2f}")
    print(f"{'forward + backward':24} {b_ours:11.1f} {b_anchor:10.1f} {b_anchor / b_ours:15.2f}")
    if not a.no_online:
        with torch.no_grad():
            xs = leaves
            t0 = time.perf_counter()
            mem(xs[0], xs[1], xs[2], eta=xs[3], mu=xs[4], alpha=xs[5], schedule="online")
            online = (time.perf_counter() - t0) * 1e3
        print(f"{'online schedule (fwd)':24} {online:11.1f} {'':10} {'':15}  "
              f"mini-batch is {online / f_ours:.1f}x faster than online")


if __name__ == "__main__":
    main()
