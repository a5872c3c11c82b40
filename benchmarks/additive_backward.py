"""Forward + backward of the per-key-channel additive kernel and of generated layers that use it,
two versions alternated in one process (the machine is shared and noisy: ratios of the medians and
of the best runs are reported).

    OMP_NUM_THREADS=1 python benchmarks/additive_backward.py --old OLD_TREE [--specs gla gsa rwkv6]

OLD_TREE: a copy of the sources to compare with (``git archive <commit> | tar -x -C OLD_TREE``).  The
kernel: ``chunk_additive`` at B=1, H=4, T=2048, K=V=64, chunk 64, float32, per-channel log decays,
the loss ``o.sum() + S_T.sum()``.  The specs: each compiled by both versions (``memspec compile`` run
with that version's sources) and their Memory module timed as ``memspec bench --grad`` times it (the
same inputs, :func:`memspec.tools.bench.make_inputs`).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

import torch

from memspec.pipeline.build import load_checked, load_module
from memspec.tools.bench import alternate, make_inputs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def kernel_runs(old_tree: str) -> dict:
    """name -> fwd+bwd of chunk_additive from this tree ("new") and from ``old_tree`` ("old")."""
    path = os.path.join(old_tree, "memspec", "runtime", "additive.py")   # (its phases: this tree's, unchanged)
    old = {}
    exec(compile(open(path).read().replace("from .phases import", "from memspec.runtime.phases import"), path, "exec"),
         old)
    from memspec.runtime.additive import chunk_additive
    g = torch.Generator().manual_seed(0)
    B, H, T, K, V = 1, 4, 2048, 64, 64
    q, k = torch.randn(B, T, H, K, generator=g), torch.randn(B, T, H, K, generator=g)
    v = torch.randn(B, T, H, V, generator=g)
    lg = torch.nn.functional.logsigmoid(torch.randn(B, T, H, K, generator=g) + 3)
    ins = [x.requires_grad_() for x in (q, k, v, lg)]

    def run(fn):
        def f():
            o, S = fn(*ins, None, 64, per_channel=True)
            (o.sum() + S.sum()).backward()
        return f
    return {"kernel old": run(old["chunk_additive"]), "kernel new": run(chunk_additive)}


def spec_runs(name: str, old_tree: str, out: str) -> dict:
    """name -> fwd+bwd of the spec's generated Memory module, compiled by the old and this tree."""
    path = os.path.join(ROOT, "specs", f"{name}.yaml")
    spec = load_checked(path).spec
    runs = {}
    for label, tree in (("old", old_tree), ("new", ROOT)):
        folder = os.path.join(out, label)
        env = dict(os.environ, PYTHONPATH=tree)
        subprocess.run([sys.executable, "-m", "memspec", "compile", path, "-o", folder], check=True, cwd=tree,
                       env=env, capture_output=True)
        module = load_module(open(os.path.join(folder, f"{name}.py")).read(), f"{name}_{label}")
        memory = next(c for c in vars(module).values() if isinstance(c, type) and c.__name__.endswith("Memory"))
        dims = {d: 64 for d in ("d_k", "d_v") if d in spec.dims}
        m = memory(heads=4, **dims)
        views, gates = make_inputs(spec, 1, 2048, 4, dims, "cpu", torch.float32)
        for x in (*views.values(), *gates.values()):
            x.requires_grad_(True)

        def f(m=m, views=views, gates=gates):
            o, st = m(*views.values(), **gates)
            (o.sum() + sum(s.sum() for s in st.values())).backward()
        runs[f"{name} {label}"] = f
    return runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--old", required=True, help="a copy of the sources to compare with")
    p.add_argument("--specs", nargs="*", default=["gla", "gsa", "rwkv6"])
    p.add_argument("--rounds", type=int, default=15)
    a = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as out:
        groups = [kernel_runs(a.old)] + [spec_runs(s, a.old, out) for s in a.specs]
        for runs in groups:
            times = alternate(runs, a.rounds)
            (o, to), (n, tn) = times.items()
            med, low = [[f(t) * 1e3 for t in (to, tn)] for f in (statistics.median, min)]
            print(f"{o} / {n}: median {med[0]:.1f} / {med[1]:.1f} ms = {med[0] / med[1]:.2f}x, "
                  f"best {low[0]:.1f} / {low[1]:.1f} ms = {low[0] / low[1]:.2f}x")


if __name__ == "__main__":
    main()
