"""Two generated modules of one spec timed side by side: a change to the generator, measured.

OLD and NEW are two versions of a generated module (e.g. ``git show REV:compiled/titans.py >
/tmp/old.py`` and ``compiled/titans.py``).  Both are built with the same dims, NEW loads OLD's
parameters, their outputs are checked equal (to float32 rounding), then they are timed round-robin
in one process (``memspec.tools.bench.alternate``: the machine's slow spells fall on both alike).
Printed: each one's median and NEW / OLD (below 1, NEW is faster).

    python benchmarks/generated_ab.py OLD.py NEW.py --spec specs/titans.yaml [--T 2048] [--grad]
        [--compile] [--chunk N] [--threads 1] [--rounds 7]
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--spec", required=True)
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--chunk", type=int, default=None)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--grad", action="store_true", help="forward + backward (default: forward)")
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    import memspec
    from memspec.codegen import class_name
    from memspec.pipeline.build import load_module
    from memspec.tools.bench import alternate, bench_dims, make_inputs

    spec = memspec.load(ROOT / a.spec if not Path(a.spec).is_absolute() else a.spec)
    dims = bench_dims(spec)
    kw = {**dims, **({"chunk": a.chunk} if a.chunk else {})}
    old, new = (getattr(load_module(Path(p).read_text(encoding="utf-8"), spec.name, spec),
                        f"{class_name(spec.name)}Memory")(compile=a.compile, heads=4, **kw) for p in (a.old, a.new))
    new.load_state_dict(old.state_dict())
    views, gates = make_inputs(spec, 1, a.T, 4, dims, "cpu", torch.float32)

    def call(m):
        vs = [x.detach().requires_grad_(a.grad) for x in views.values()]
        gs = {n: x.detach().requires_grad_(a.grad) for n, x in gates.items()}
        with torch.set_grad_enabled(a.grad):
            o, _ = m(*vs, **gs)
            if a.grad:
                o.square().sum().backward()
        return o.detach()

    want, got = call(old), call(new)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    times = alternate({"old": lambda: call(old), "new": lambda: call(new)}, a.rounds)
    med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
    print(f"{spec.name}, T={a.T}, {a.threads} thread(s){', compiled' if a.compile else ''}, "
          f"{'forward + backward' if a.grad else 'forward'}: old {med['old']:.1f} ms, new {med['new']:.1f} ms, "
          f"new / old {med['new'] / med['old']:.3f}")


if __name__ == "__main__":
    main()
