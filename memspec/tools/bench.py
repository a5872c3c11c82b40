"""`memspec bench`: every schedule a spec admits, timed side by side in one process.

For each spec the generated ``<Name>Memory`` is built once (``memspec.build.build_memory``)
and its ``forward`` is timed with ``schedule=<family>`` for every admitted family,
after warm-up, the schedules alternating round by round (one timed run of each per round, so
that a slow spell of a shared machine falls on all of them and the ratios stay fair).  Each timed
run follows an untimed run of the same schedule: the first call after another schedule's pays
for what that one left (on CPU, measured: a chunked call right after the online schedule's
thousands of small allocations took 1.2-1.7x its time in a loop of itself), and a model in use
calls one schedule again and again.  Reported: median wall time, tokens/s, speed-up over the online schedule,
achieved GFLOP/s (matrix-multiply FLOPs counted by ``torch.utils.flop_counter``)
as a fraction of this machine's batched-matmul peak (``torch.bmm`` on 64x64 tiles,
measured by the same command), peak memory and build / first-call time.

Peak memory: on CUDA ``torch.cuda.max_memory_allocated`` (reset per schedule); on
CPU the process's peak resident set size after the schedule ran (``resource``),
which only grows, so it is an upper bound shared by the schedules measured before.
"""
from __future__ import annotations

import json
import math
import platform
import statistics
import time
from pathlib import Path

import torch

from ..schedule.decide import BY_NAME, FAMILIES

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
APPROXIMATE = tuple(f.name for f in FAMILIES if not f.exact)   # schedules that approximate online learning


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def bmm_peak(device: str = "cpu", dtype=torch.float32, batch: int = 256, repeat: int = 20) -> float:
    """Best GFLOP/s of ``torch.bmm`` on ``batch`` 64x64 @ 64x64 tiles."""
    a = torch.randn(batch, 64, 64, device=device, dtype=dtype)
    b = torch.randn(batch, 64, 64, device=device, dtype=dtype)
    flops = 2 * 64 ** 3 * batch
    with torch.no_grad():
        for _ in range(3):
            torch.bmm(a, b)
        _sync(device)
        best = math.inf
        for _ in range(repeat):
            t0 = time.perf_counter()
            torch.bmm(a, b)
            _sync(device)
            best = min(best, time.perf_counter() - t0)
    return flops / best / 1e9


def _peak_rss_mb() -> float | None:
    try:
        import resource
    except ImportError:  # pragma: no cover - not on POSIX
        return None
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / 1024.0 if platform.system() != "Darwin" else kb / 2**20


def bench_dims(spec, D: int = 64, hidden: int = 128) -> dict:
    """The sizes the frontier benchmarks build a memory at, those the spec declares: d_k = d_v = D
    and hidden (the MLP memories' width)."""
    return {k: v for k, v in {"d_k": D, "d_v": D, "hidden": hidden}.items() if k in spec.dims}


def make_inputs(spec, B: int, T: int, H: int, dims: dict, device: str, dtype, seed: int = 0):
    """Views ``[B, T, H, D]`` (unit-scale rows), gates ``[B, T, H]`` (``[B, T, H, d]`` per channel) in (0, 1)."""
    g = torch.Generator().manual_seed(seed)
    views = {}
    for n, v in spec.views.items():
        d = dims.get(v.dim, spec.dims[v.dim])
        views[n] = (torch.randn(B, T, H, d, generator=g) / math.sqrt(d)).to(device=device, dtype=dtype)
    gates = {}
    for n, gate in spec.gates.items():
        channels = [dims.get(d, spec.dims[d]) for d in gate.shape]
        gates[n] = torch.sigmoid(torch.randn(B, T, H, *channels, generator=g) - 1.0).to(device=device, dtype=dtype)
    return views, gates


def _flops(fn) -> int | None:
    try:
        from torch.utils.flop_counter import FlopCounterMode
    except ImportError:  # pragma: no cover
        return None
    with FlopCounterMode(display=False) as fc:
        fn()
    return int(fc.get_total_flops())


def alternate(fns: dict, rounds: int, sync=lambda: None) -> dict:
    """Time the callables ``fns`` (name -> fn) round-robin: each round runs every one twice, in
    order, and times the second run, after ``sync()`` (a slow spell of the machine falls on all of
    them alike; the timed run follows a run of itself, not another's).  Returns name -> seconds
    per round."""
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            fn()                                               # untimed: after a run of itself
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - t0)
    return times


def _first_calls(run, schedules, device: str, failed) -> dict:
    """The first (building / compiling) and second (warm-up) call of every schedule:
    {schedule: {first, second, mem}} (seconds, peak MB); a schedule that raises goes to
    ``failed(schedule, err)`` instead (the others still run)."""
    live = {}
    for schedule in schedules:
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t1 = time.perf_counter()
        try:
            run(schedule)
        except Exception as err:  # a broken schedule is reported, the others still run
            failed(schedule, err)
            continue
        _sync(device)
        first = time.perf_counter() - t1
        t1 = time.perf_counter()
        run(schedule)
        _sync(device)
        second = time.perf_counter() - t1
        mem = (torch.cuda.max_memory_allocated() / 2**20) if device == "cuda" else _peak_rss_mb()
        live[schedule] = {"first": first, "second": second, "mem": mem}
    return live


def bench_spec(spec, *, T: int = 2048, B: int = 1, H: int = 4, D: int = 64, device: str = "cpu",
               dtype: str = "float32", repeat: int = 5, grad: bool = False, schedules=None,
               compile: bool = False, peak: float | None = None, budget_s: float = 20.0) -> list[dict]:
    """Time every admitted schedule of one spec; returns one record per schedule."""
    from ..pipeline.build import build_memory
    from ..schedule import analyse

    decision = analyse(spec)
    dims = {d: D for d in ("d_k", "d_v") if d in spec.dims}
    tdtype = DTYPES[dtype]
    t0 = time.perf_counter()
    memory = build_memory(spec, compile=compile, heads=H, **dims).to(device=device, dtype=tdtype)
    build_s = time.perf_counter() - t0
    available = [s for s in decision.admits if s in getattr(memory, "SCHEDULES", decision.admits)]
    wanted = [s for s in available if schedules is None or s in schedules]
    views, gates = make_inputs(spec, B, T, H, dims, device, tdtype)
    if grad:
        for x in (*views.values(), *gates.values()):
            x.requires_grad_(True)
    records = []

    def run(schedule):
        if grad:
            o, st = memory(*views.values(), **gates, schedule=schedule)
            loss = o.float().sum() + sum(s.float().sum() for s in st.values())
            loss.backward()
            return o
        with torch.no_grad():
            return memory(*views.values(), **gates, schedule=schedule)[0]

    # first (building / compiling) and second (warm-up) call of every schedule, then the timed
    # runs round-robin: each round times every schedule once, so that a slow spell of a shared,
    # noisy machine lands on all of them alike and the ratios between them stay fair; each timed
    # run follows an untimed one of its own schedule (the steady state of a model in use, not the
    # cost of switching from the schedule before)
    live = _first_calls(run, wanted, device, lambda schedule, err: records.append(
        {"spec": spec.name, "schedule": schedule, "exact": schedule not in APPROXIMATE,
         "error": f"{type(err).__name__}: {err}", "build_s": build_s}))
    # as many rounds as the budget allows (at least one)
    n = max(1, min(repeat, int(budget_s / max(2 * sum(x["second"] for x in live.values()), 1e-9))))
    times = alternate({schedule: (lambda s=schedule: run(s)) for schedule in live}, n, lambda: _sync(device))
    for schedule, x in live.items():
        med = statistics.median(times[schedule])
        flops = _flops(lambda: run(schedule)) if not compile else None
        rec = {
            "spec": spec.name,
            "schedule": schedule,
            "exact": schedule not in APPROXIMATE,
            "chunk": memory.chunk if BY_NAME[schedule].chunked else None,
            "median_ms": med * 1e3,
            "runs": n,
            "tokens_per_s": B * T / med,
            "gflop": flops / 1e9 if flops is not None else None,
            "gflops": flops / med / 1e9 if flops is not None else None,
            "frac_of_bmm_peak": (flops / med / 1e9 / peak) if flops is not None and peak else None,
            "peak_mem_mb": x["mem"],
            "peak_mem_kind": "cuda_max_allocated" if device == "cuda" else "process_peak_rss",
            "build_s": build_s,
            "first_call_s": x["first"],
            # with compile: the first (compiling) call of each compiled step function
            "compile_s": {name: fn.seconds for name, fn in vars(memory).items()
                          if getattr(fn, "seconds", None) is not None} or None,
        }
        records.append(rec)
    online = next((r for r in records if r["schedule"] == "online" and "error" not in r), None)
    for r in records:
        if "error" not in r:
            r["speedup_vs_online"] = online["median_ms"] / r["median_ms"] if online else None
    return records


def bench(paths, *, T=2048, B=1, H=4, D=64, device="cpu", dtype="float32", repeat=5, grad=False,
          schedules=None, compile=False, loader=None) -> dict:
    """Benchmark spec files; returns the JSON record (machine, config, results)."""
    if loader is None:
        from ..lang.frontend import load as loader  # noqa: N813
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    peak = bmm_peak(device, DTYPES[dtype] if dtype != "float64" else torch.float64)
    results = []
    for p in paths:
        spec = loader(p)
        if isinstance(spec, tuple):
            spec = spec[0]
        results.extend(bench_spec(spec, T=T, B=B, H=H, D=D, device=device, dtype=dtype, repeat=repeat,
                                  grad=grad, schedules=schedules, compile=compile, peak=peak))
    return {
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "device": device if device == "cpu" else torch.cuda.get_device_name(),
            "bmm_64x64_peak_gflops": peak,
        },
        "config": {"T": T, "B": B, "H": H, "D": D, "dtype": dtype, "grad": grad, "compile": compile,
                   "repeat": repeat},
        "results": results,
    }


def render(record: dict) -> str:
    """A fixed-width table of a bench record."""
    m, c = record["machine"], record["config"]
    out = [f"bench: T={c['T']} B={c['B']} H={c['H']} D={c['D']} {c['dtype']}"
           f"{' forward+backward' if c['grad'] else ' forward, no grad'} on {m['device']} "
           f"({m['threads']} threads); torch.bmm 64x64 peak {m['bmm_64x64_peak_gflops']:.1f} GFLOP/s"]
    head = f"{'spec':<26}{'schedule':<11}{'exact':<7}{'chunk':>6}{'median ms':>11}{'tok/s':>11}" \
           f"{'x online':>10}{'GFLOP/s':>9}{'% peak':>8}{'mem MB':>9}{'build s':>9}{'1st s':>8}"
    out.append(head)
    out.append("-" * len(head))
    for r in record["results"]:
        if "error" in r:
            out.append(f"{r['spec']:<26}{r['schedule']:<11}failed: {r['error'][:120]}")
            continue

        def f(x, fmt):
            return format(x, fmt) if x is not None else "-"
        out.append(f"{r['spec']:<26}{r['schedule']:<11}{'yes' if r['exact'] else 'no':<7}"
                   f"{f(r['chunk'], 'd'):>6}{r['median_ms']:>11.2f}{r['tokens_per_s']:>11.0f}"
                   f"{f(r['speedup_vs_online'], '.1f'):>10}{f(r['gflops'], '.1f'):>9}"
                   f"{f(r['frac_of_bmm_peak'] * 100 if r['frac_of_bmm_peak'] is not None else None, '.0f'):>8}"
                   f"{f(r['peak_mem_mb'], '.0f'):>9}{r['build_s']:>9.2f}{r['first_call_s']:>8.2f}")
    return "\n".join(out) + "\n"


def wanted_schedules(text: str | None, specs: dict, usage_error) -> set[str] | None:
    """The ``--schedules`` subset (None: every schedule): each name a schedule family, and every
    spec carrying at least one of them; otherwise ``usage_error`` saying what there is."""
    if not text:
        return None
    from ..lang.errors import printable
    from ..pipeline.build import decide
    from ..schedule.decide import NAMES

    names = [n.strip() for n in text.split(",")]
    unknown = [n for n in names if n not in NAMES]
    if unknown:
        raise usage_error(f"--schedules: unknown schedule {', '.join(map(repr, unknown))}; "
                          f"the schedules are {', '.join(NAMES)}")
    for path, spec in specs.items():
        carried = decide(spec).schedules
        if not set(names) & set(carried):
            raise usage_error(f"--schedules {','.join(names)}: {printable(path)} ({spec.name}) runs none of them; "
                              f"its generated module runs {', '.join(carried)}")
    return set(names)


def run_cli(args, load_checked, usage_error) -> int:
    """``memspec bench FILE... [--T --B --H --D --device --dtype --repeat --grad --json]``."""
    import sys

    for name in ("T", "B", "H", "D", "repeat"):
        if getattr(args, name) < 1:
            raise usage_error(f"--{name} must be >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise usage_error("--device cuda: no CUDA device is available")
    specs = {p: load_checked(p).spec for p in args.files}   # every spec checked before any timing
    schedules = wanted_schedules(args.schedules, specs, usage_error)
    record = bench(args.files, T=args.T, B=args.B, H=args.H, D=args.D, device=args.device, dtype=args.dtype,
                   repeat=args.repeat, grad=args.grad, schedules=schedules, compile=getattr(args, "compile", False),
                   loader=specs.__getitem__)
    sys.stdout.write(render(record))
    if args.json:
        from ..pipeline.write import write_atomic

        write_atomic(Path(args.json), json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0
