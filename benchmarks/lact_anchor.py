"""LaCT's apply-then-update memory: memspec's compiled module vs a plain PyTorch anchor.

The anchor is written here from the LaCT paper's section 3 (Zhang et al. 2025, "Test-Time
Training Done Right"): SwiGLU fast weights f(x) = (silu(x W0) * (x W2)) W1, the sequence cut
into chunks; every token of a chunk is read with the weights the previous chunk left
(apply: three [C, d] @ [d, h] products), then the weights take one step on the chunk's
negative dot-product loss -sum_t <f(k_t), v_t> with per-token step sizes, its SwiGLU
backward written by hand (three more products and three for the summed gradients), and
each weight is renormalised to its initial column norms (weight normalisation).  Keys and
queries go through l2norm(silu(.)) as in specs/lact.yaml, so both compute the same function
(checked before timing: relative error of the outputs printed).

Printed side by side, alternated in one process (this machine is noisy; median of
``--repeat``): forward (no grad) and forward + backward of the memory alone (B=1, H=4,
d 64, hidden 128, float32), memspec eager / the anchor and memspec ``compile=True`` / the
eager anchor, at each chunk size.

    OMP_NUM_THREADS=1 python benchmarks/lact_anchor.py --threads 1 [--T 2048] [--chunks 64 512] [--clock cpu]
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent


def _l2n(x):
    """x / sqrt(|x|^2 + 1e-6) over the last axis (the spec's l2norm)."""
    return x / torch.sqrt(x.square().sum(-1, keepdim=True) + 1e-6)


def lact_anchor(q, k, v, lr0, lr1, lr2, w0, w1, w2, chunk):
    """q, k [N, T, d], v [N, T, dv], lr* [N, T] (step sizes), w0, w2 [N, d, h], w1 [N, h, dv]
    (N = batch x heads) -> o [N, T, dv].  A last partial chunk is read, never learned from."""
    T = q.shape[1]
    qn, kn = _l2n(F.silu(q)), _l2n(F.silu(k))
    n0, n1, n2 = (w.norm(dim=1, keepdim=True) for w in (w0, w1, w2))   # column norms, kept
    outs = []
    for s in range(0, T, chunk):
        qi, ki, vi = qn[:, s:s + chunk], kn[:, s:s + chunk], v[:, s:s + chunk]
        outs.append((F.silu(qi @ w0) * (qi @ w2)) @ w1)                   # apply
        if s + chunk > T:
            break
        a, b = ki @ w0, ki @ w2                                           # [N, C, h]
        sa = F.silu(a)
        hid = sa * b
        dhid = -(vi @ w1.transpose(1, 2))                                 # d loss / d hidden
        sig = torch.sigmoid(a)
        da = dhid * b * sig * (1 + a * (1 - sig))                         # through silu
        db = dhid * sa
        g0 = ki.transpose(1, 2) @ (lr0[:, s:s + chunk, None] * da)        # sum_t lr_t grad_t
        g1 = hid.transpose(1, 2) @ (lr1[:, s:s + chunk, None] * -vi)
        g2 = ki.transpose(1, 2) @ (lr2[:, s:s + chunk, None] * db)
        w0, w1, w2 = w0 - g0, w1 - g1, w2 - g2
        w0 = w0 / torch.sqrt(w0.square().sum(1, keepdim=True) + 1e-6) * n0
        w1 = w1 / torch.sqrt(w1.square().sum(1, keepdim=True) + 1e-6) * n1
        w2 = w2 / torch.sqrt(w2.square().sum(1, keepdim=True) + 1e-6) * n2
    return torch.cat(outs, dim=1)


def inputs(B, T, H, d, hidden, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    x = {n: r(B, T, H, d) for n in "qkv"}
    for n in ("eta0", "eta1", "eta2"):
        x[n] = F.softplus(r(B, T, H) - 4.0)
    w = {"W0": r(H, d, hidden) * 0.125, "W1": r(H, hidden, d) * 0.09, "W2": r(H, d, hidden) * 0.125}
    return x, w


def memspec_fn(module):
    def run(x):
        o, _ = module(x["q"], x["k"], x["v"], eta0=x["eta0"], eta1=x["eta1"], eta2=x["eta2"])
        return o
    return run


def anchor_fn(module, chunk):
    def run(x):
        B, T, H, d = x["q"].shape
        hm = lambda t: t.transpose(1, 2).reshape(B * H, T, *t.shape[3:])  # noqa: E731
        ws = [getattr(module, f"W{i}_init").expand(B, -1, -1, -1).reshape(B * H, *getattr(module, f"W{i}_init").shape[1:])
              for i in range(3)]
        o = lact_anchor(hm(x["q"]), hm(x["k"]), hm(x["v"]), hm(x["eta0"]), hm(x["eta1"]), hm(x["eta2"]), *ws, chunk)
        return o.reshape(B, H, T, -1).transpose(1, 2)
    return run


def timed(fn, x, backward: bool, clock=time.perf_counter) -> float:
    if backward:
        xs = {n: t.detach().requires_grad_() for n, t in x.items()}
        start = clock()
        fn(xs).square().sum().backward()
        return clock() - start
    with torch.no_grad():
        start = clock()
        fn(x)
        return clock() - start


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--H", type=int, default=4)
    ap.add_argument("--chunks", type=int, nargs="+", default=[64, 512])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-compile", action="store_true", help="skip memspec's compile=True column")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="wall time, or this thread's CPU time (time.thread_time: not the time other "
                         "processes hold the core, on a shared machine)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import memspec
    from memspec.pipeline.build import build_memory

    spec = memspec.load(ROOT / "specs" / "lact.yaml")
    d, hidden = 64, 128
    x, w = inputs(args.B, args.T, args.H, d, hidden)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    print(f"LaCT memory, B={args.B} H={args.H} T={args.T} d={d} hidden={hidden}, float32, "
          f"{torch.get_num_threads()} thread(s), median of {args.repeat}, {args.clock} clock")
    print(f"{'chunk':>6} {'pass':>10} {'anchor ms':>10} {'eager ms':>9} {'ratio':>6} {'compiled ms':>12} {'ratio':>6}")
    for chunk in args.chunks:
        mods = {}
        for comp in ([False] if args.no_compile else [False, True]):
            m = build_memory(spec, compile=comp, chunk=chunk, d_k=d, d_v=d, hidden=hidden, heads=args.H)
            with torch.no_grad():
                for i in range(3):
                    getattr(m, f"W{i}_init").copy_(w[f"W{i}"])
            mods[comp] = m
        fns = {"anchor": anchor_fn(mods[False], chunk), "eager": memspec_fn(mods[False])}
        if True in mods:
            fns["compiled"] = memspec_fn(mods[True])
        with torch.no_grad():
            want = fns["anchor"](x)
            for name in fns:
                if name != "anchor":
                    err = ((fns[name](x) - want).norm() / want.norm()).item()
                    assert err < 1e-4, (name, err)
        for backward in (False, True):
            for fn in fns.values():   # warm-up (compiles)
                timed(fn, x, backward)
            times = {name: [] for name in fns}
            for _ in range(args.repeat):
                for name, fn in fns.items():
                    times[name].append(timed(fn, x, backward, clock))
            med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
            row = f"{chunk:>6} {'fwd+bwd' if backward else 'forward':>10} {med['anchor']:>10.2f} {med['eager']:>9.2f} " \
                  f"{med['eager'] / med['anchor']:>6.2f}"
            if "compiled" in med:
                row += f" {med['compiled']:>12.2f} {med['compiled'] / med['anchor']:>6.2f}"
            print(row, flush=True)


if __name__ == "__main__":
    main()
