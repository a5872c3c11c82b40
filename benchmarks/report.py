"""Regenerate every speed figure the README shows and write docs/benchmarks.md.

One command, one machine, one date:

    python benchmarks/report.py [--threads N] [--quick] [--out docs/benchmarks.md] [--readme README.md]

The report has these tables, each with the exact command that produced it:

* **one spec per schedule family** (the README's table, measured here): the generated memory's
  default schedule against its own online schedule and against a peer computing the same memory
  where one is installed -- flash-linear-attention's pure-PyTorch chunked references (loaded by
  file path, ``tests/peers.py``; their outputs checked equal to memspec's before timing),
  titans-pytorch's ``NeuralMemory`` (layer against layer: its own memory MLP, projections and
  gates, so the same mini-batch learning with more work around it) and the LaCT anchor of
  ``benchmarks/lact_anchor.py`` (checked equal); forward (no grad) and forward + backward (the
  loss is the sum of the outputs), B=1, H=4, T=2048, D=64, float32.  The three are timed
  round-robin in one process per family (``memspec.tools.bench.alternate``: each round runs every function
  twice and times the second run), as many rounds as ``--repeat`` and a time budget allow (a call
  that takes over a quarter of the budget is timed by its one call);
* **every shipped spec, each schedule** (forward): ``memspec bench specs/*.yaml --json``;
* **kernels against pure-PyTorch chunked forms**: ``benchmarks/anchors.py --json`` (the delta rule,
  the gated delta rule, linear attention, per-channel decays) and ``--dplr --json`` (the dplr and
  momentum kernels against fla's references and their own token loops), forward and forward +
  backward;
* **the eager floor** of an exact chunked form (retention): ``benchmarks/floor.py``;
* **LaCT against its anchor**, eager and compiled, at the given threads and at two:
  ``benchmarks/lact_anchor.py``;
* **the shipped specs by family**, derived from ``memspec.schedule.decide`` (no timing).

Ratios are *other / memspec*: above 1, memspec is faster.  ``--quick`` runs every table at small
sizes with one round (a couple of minutes; ``tests/test_benchmarks.py`` runs it) and its figures
mean nothing.  ``--readme FILE`` also replaces the speed table between the markers
``<!-- report:speed -->`` and ``<!-- /report:speed -->`` of FILE.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from memspec.lang.errors import SpecError
from memspec.pipeline.build import build, build_memory, decide, load_checked
from memspec.schedule.decide import BY_NAME, NAMES
from memspec.tools.bench import alternate, make_inputs

BEGIN, END = "<!-- report:speed -->", "<!-- /report:speed -->"
# one shipped spec per schedule family, in the order of schedule.decide.FAMILIES
FAMILY_SPECS = {"cache": "softmax_attention", "additive": "retention", "chained": "gsa", "solve": "mesa",
                "delta": "deltanet", "dplr": "kda", "oja": "gated_oja", "momentum": "momentum_deltanet",
                "scan": "mamba", "minibatch": "titans", "online": "omeganet", "apply_update": "lact"}
# dims a spec keeps at its own size: Mamba-1's d_k is its state size N (16), not a head dim
OWN_DIMS = {"mamba": ("d_k",)}
# specs whose memory is another shipped spec's (they differ in the wiring only: `memspec diff`)
SAME_MEMORY = {"titans_mac": "titans", "titans_mag": "titans", "titans_mal": "titans"}


def script(name: str):
    """``benchmarks/<name>.py`` as a module (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(f"_report_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def l2n(x):
    """memspec's l2norm: x / sqrt(sum(x^2) + 1e-6) over the last axis."""
    return x / torch.sqrt(x.square().sum(-1, keepdim=True) + 1e-6)


def rel_err(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


# ---------------------------------------------------------------------------------------------
# one spec per family: memspec's default schedule, its online schedule, a peer


@dataclass
class Row:
    """One family's row: ``calls(grad)`` -> {"memspec", "online", "peer"?: fn}; each fn runs one
    forward (and, with grad, the backward of the outputs' sum) from fresh leaves."""

    family: str
    spec: str
    schedule: str                 # memspec's default schedule, as the module runs it
    exact: bool
    calls: Callable[[bool], dict]
    peer: str | None = None       # what the peer is
    check: str | None = None      # how the peer was checked before timing
    results: dict = field(default_factory=dict)   # "forward" / "forward + backward" -> {"ms": {name: ms}, "runs": {name: n}}


def _fresh(tensors, grad):
    return [t.detach().requires_grad_(grad) for t in tensors]


def _finish(out, grad):
    o = out[0] if isinstance(out, tuple) else out
    if grad:
        o.float().sum().backward()
    return o


def module_row(name: str, T: int, H: int, D: int, peer=None) -> Row:
    """A generated memory (eager) and its inputs as ``memspec bench`` makes them.  ``peer(memory, views,
    gates)`` -> (what it is, fn(views, gates) -> o computing the same memory, how it is fed), or three
    Nones when fla is not installed; its outputs are checked equal to memspec's before timing."""
    spec = load_checked(ROOT / "specs" / f"{name}.yaml").spec
    decision = decide(spec)
    dims = {d: D for d in ("d_k", "d_v") if d in spec.dims and d not in OWN_DIMS.get(name, ())}
    memory = build_memory(spec, compile=False, heads=H, **dims)
    views, gates = make_inputs(spec, 1, T, H, dims, "cpu", torch.float32)
    names = [*views, *gates]
    tensors = [*views.values(), *gates.values()]

    def memspec_call(schedule, grad):
        def run():
            xs = dict(zip(names, _fresh(tensors, grad)))
            return _finish(memory(*[xs[n] for n in views], **{n: xs[n] for n in gates}, schedule=schedule), grad)
        return run

    peer_name, peer_fn, check = peer(memory, views, gates) if peer else (None, None, None)

    def peer_call(grad):
        def run():
            xs = dict(zip(names, _fresh(tensors, grad)))
            return _finish(peer_fn({n: xs[n] for n in views}, {n: xs[n] for n in gates}), grad)
        return run

    if peer_fn is not None:
        with torch.no_grad():
            err = rel_err(peer_call(False)(), memspec_call(decision.family, False)())
        if err > getattr(peer_fn, "tolerance", 1e-3):   # (a peer that stops early says how far)
            raise SystemExit(f"{name}: the peer {peer_name} differs from memspec (relative error {err:.1e})")
        check = f"{check}; outputs equal to memspec's to {err:.0e} relative"

    def calls(grad):
        fns = {"memspec": memspec_call(decision.family, grad)}
        if decision.family != "online":
            fns["online"] = memspec_call("online", grad)
        if peer_fn is not None:
            fns["peer"] = peer_call(grad)
        return fns
    chunk = memory.chunk if BY_NAME[decision.family].chunked else None
    label = name + "".join(f" ({d} = {spec.dims[d]})" for d in OWN_DIMS.get(name, ()))
    return Row(decision.family, label, f"{decision.family}({chunk})" if chunk else decision.family,
               decision.exact, calls, peer_name if peer_fn is not None else None, check)


def _fla(op):
    """fla's ``ops/<op>/naive.py`` (benchmarks/anchors.py's loader), or None."""
    anchors = sys.modules.get("_report_anchors") or script("anchors")
    return anchors.fla_peer(op)


def peer_retention(memory, views, gates):
    sg = _fla("simple_gla")
    if sg is None:
        return None, None, None

    def run(v, g):
        q, k, x = v["q"], v["k"], v["v"]
        lg = torch.nn.functional.logsigmoid(memory.lam).expand(*q.shape[:3])
        return sg.naive_chunk_simple_gla(q, k, x, lg, scale=1.0, output_final_state=True)[0]
    return "fla `naive_chunk_simple_gla`", run, "g = logsigmoid(lam), scale 1"


def peer_deltanet(memory, views, gates):
    dr = _fla("delta_rule")
    if dr is None:
        return None, None, None

    def run(v, g):
        hf = lambda t: t.transpose(1, 2)
        K = v["q"].shape[-1]
        o, _ = dr.delta_rule_chunkwise(hf(l2n(v["q"])) * math.sqrt(K), hf(l2n(v["k"])), hf(v["v"]), hf(g["eta"]),
                                       chunk_size=64)
        return o.transpose(1, 2)
    return "fla `delta_rule_chunkwise` (chunk 64)", run, "l2-normalised q, k fed, q * sqrt(d_k)"


def peer_kda(memory, views, gates):
    kda = _fla("kda")
    if kda is None:
        return None, None, None

    def run(v, g):
        return kda.naive_chunk_kda(l2n(v["q"]), l2n(v["k"]), v["v"], torch.log1p(-g["alpha"]), g["eta"], scale=1.0,
                                   output_final_state=True)[0]
    return "fla `naive_chunk_kda` (chunk 64)", run, "l2-normalised q, k fed, g = log(1 - alpha), scale 1"


def peer_mesa(memory, views, gates):
    mesa = _fla("mesa_net")
    if mesa is None:
        return None, None, None
    lam = float(load_checked(ROOT / "specs" / "mesa.yaml").spec.constants["lam"])

    def run(v, g):
        q, k = l2n(v["q"]), l2n(v["k"])
        H, D = q.shape[2], q.shape[3]
        C = 64 if q.shape[1] % 64 == 0 else q.shape[1]   # fla's reference takes whole chunks only
        return mesa.naive_mesa_net_CG(q, k, v["v"], torch.log(1 - g["alpha"]), torch.full((H, D), lam), g["eta"],
                                      C)[0]
    run.tolerance = 1e-2   # its 30 fixed conjugate-gradient steps stop short of memspec's tolerance
    return "fla `naive_mesa_net_CG` (chunk 64, 30 steps)", run, "l2-normalised q, k fed, g = log(1 - alpha), beta = eta"


def titans_row(T: int) -> Row:
    """Titans as a layer (x [1, T, 256], 4 heads of 64, hidden 256: titans-pytorch's expansion 4),
    eager: mini-batch(64), the same layer's memory online, titans-pytorch's NeuralMemory."""
    torch.manual_seed(0)
    layer = build(ROOT / "specs" / "titans.yaml", compile=False, d_model=256, heads=4, d_k=64, d_v=64, hidden=256)
    # the spec's initial step lets this untrained memory grow to NaN over 2048 tokens (as titans_anchor.py)
    layer.eta_proj.bias.data.fill_(-5.0)
    online = build(ROOT / "specs" / "titans.yaml", compile=False, d_model=256, heads=4, d_k=64, d_v=64, hidden=256)
    online.load_state_dict(layer.state_dict())
    forward = online.memory.forward
    online.memory.forward = lambda *a, **kw: forward(*a, **{**kw, "schedule": "online"})
    x = torch.randn(1, T, 256)
    try:
        from titans_pytorch import NeuralMemory
        peer = NeuralMemory(dim=256, heads=4, dim_head=64, chunk_size=64)
    except ImportError:
        peer = None
    decision = decide(load_checked(ROOT / "specs" / "titans.yaml").spec)

    def call(m, grad):
        def run():
            return _finish(m(*_fresh([x], grad)), grad)
        return run

    def calls(grad):
        fns = {"memspec": call(layer, grad), "online": call(online, grad)}
        if peer is not None:
            fns["peer"] = call(peer, grad)
        return fns
    with torch.no_grad():
        y = layer(x)
        if not torch.isfinite(y).all():
            raise SystemExit("titans layer: non-finite outputs")
    return Row(decision.family, "titans (layer, hidden 256)", f"minibatch({layer.memory.chunk})", False, calls,
               "titans-pytorch `NeuralMemory` (layer)" if peer is not None else None,
               "its own memory MLP, norms and gates: the same mini-batch learning, not the same numbers")


def lact_row(T: int, H: int) -> Row:
    """LaCT's memory (d 64, hidden 128) at its spec's chunk against benchmarks/lact_anchor.py's anchor."""
    la = script("lact_anchor")
    spec = load_checked(ROOT / "specs" / "lact.yaml").spec
    decision = decide(spec)
    memory = build_memory(spec, compile=False, d_k=64, d_v=64, hidden=128, heads=H)
    x, w = la.inputs(1, T, H, 64, 128)
    with torch.no_grad():
        for i in range(3):
            getattr(memory, f"W{i}_init").copy_(w[f"W{i}"])
    anchor = la.anchor_fn(memory, memory.chunk)
    names, tensors = list(x), list(x.values())

    def call(fn, grad):
        def run():
            return _finish(fn(dict(zip(names, _fresh(tensors, grad)))), grad)
        return run

    def online(xs):
        return memory(xs["q"], xs["k"], xs["v"], eta0=xs["eta0"], eta1=xs["eta1"], eta2=xs["eta2"], schedule="online")[0]

    with torch.no_grad():
        err = rel_err(la.memspec_fn(memory)(x), anchor(x))
    if err > 1e-4:
        raise SystemExit(f"lact: memspec differs from the anchor (relative error {err:.1e})")

    def calls(grad):
        return {"memspec": call(la.memspec_fn(memory), grad), "online": call(online, grad), "peer": call(anchor, grad)}
    return Row(decision.family, "lact", f"apply_update({memory.chunk})", decision.exact, calls,
               "`benchmarks/lact_anchor.py`'s anchor", f"outputs equal to memspec's to {err:.0e} relative")


def family_row(family: str, T: int, H: int, D: int) -> Row:
    """The row of one family (its spec from FAMILY_SPECS), built in this process."""
    name = FAMILY_SPECS[family]
    peers = {"retention": peer_retention, "deltanet": peer_deltanet, "kda": peer_kda, "mesa": peer_mesa}
    if name == "titans":
        row = titans_row(T)
    elif name == "lact":
        row = lact_row(T, H)
    else:
        row = module_row(name, T, H, D, peers.get(name))
    if row.family != family or family not in BY_NAME:
        raise SystemExit(f"{name}: expected the {family} family, the algebra decided {row.family}")
    return row


ROW_FIELDS = ("family", "spec", "schedule", "exact", "peer", "check", "results")


def family_rows(z: "Sizes", threads: int) -> list[Row]:
    """Every family's row, each built and timed in a process of its own (``--family-row``): what one
    row leaves behind in a process (the allocator's heap) never slows the next row's functions
    (measured: LaCT's anchor ran 1.9x slower after the rows before it than alone)."""
    rows = []
    for family in FAMILY_SPECS:
        with tempfile.TemporaryDirectory() as d:
            out = Path(d) / "row.json"
            text = run_command(["python", "benchmarks/report.py", "--family-row", family, "--T", str(z.T), "--repeat",
                                str(z.repeat), "--budget", str(z.budget_s), "--json", str(out)], threads, quiet=True)
            print(text, end="", flush=True)
            rows.append(Row(calls=None, **json.loads(out.read_text())))
    return rows


def one_row(family: str, z: "Sizes", out: Path) -> None:
    """``--family-row FAMILY``: build and time that family's row here; its fields to ``out`` (JSON)."""
    row = family_row(family, z.T, 4, 64)
    run_family_rows([row], z.repeat, z.budget_s)
    out.write_text(json.dumps({k: getattr(row, k) for k in ROW_FIELDS}))


def measure(fns: dict, grad: bool, repeat: int, budget_s: float) -> tuple[dict, dict]:
    """Median ms of each function and its number of timed runs.  One untimed call each first; then
    the functions whose call takes under a quarter of ``budget_s`` are timed round-robin
    (``alternate``: each round runs each twice and times the second) for as many rounds as ``repeat``
    and the budget allow (at least one); a slower one (an online schedule's backward can take half a
    minute) is timed by that one call."""
    with torch.set_grad_enabled(grad):
        once = {}
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            once[name] = time.perf_counter() - t0
        slow = {name for name, t in once.items() if t > budget_s / 4}
        fast = {name: fn for name, fn in fns.items() if name not in slow}
        rounds = max(1, min(repeat, int(budget_s / max(2 * sum(once[n] for n in fast), 1e-9))))
        times = alternate(fast, rounds)
        for name in slow:
            times[name] = [once[name]]
    return ({name: statistics.median(times[name]) * 1e3 for name in fns},
            {name: len(times[name]) for name in fns})


def run_family_rows(rows: list[Row], repeat: int, budget_s: float) -> None:
    for row in rows:
        for grad in (False, True):
            ms, runs = measure(row.calls(grad), grad, repeat, budget_s)
            row.results["forward + backward" if grad else "forward"] = {"ms": ms, "runs": runs}
            print(f"  {row.spec:<28} {'fwd+bwd' if grad else 'forward':<8} "
                  + "  ".join(f"{k} {v:9.2f} ms" for k, v in ms.items()), flush=True)


def _ms(x: float | None) -> str:
    if x is None:
        return "—"
    return f"{x:,.0f} ms" if x >= 100 else f"{x:.1f} ms"


def _ratio(other: float | None, mine: float) -> str:
    return "—" if other is None else f"{other / mine:.2f}×"


def family_table(rows: list[Row]) -> str:
    """Every time and ratio, two lines per family (docs/benchmarks.md)."""
    lines = [("| family | spec (default schedule) | pass | memspec | online schedule | online / memspec | peer "
             "| peer / memspec | timed runs |"), "|---|---|---|---:|---:|---:|---|---:|---:|"]
    for row in rows:
        for what, res in row.results.items():
            ms = res["ms"]
            runs = " / ".join(str(n) for n in res["runs"].values())
            lines.append(f"| {row.family} | {row.spec} ({_schedule(row)}) | {what} | {_ms(ms['memspec'])} | "
                         f"{_ms(ms.get('online'))} | {_ratio(ms.get('online'), ms['memspec'])} | "
                         f"{row.peer or '—'} | {_ratio(ms.get('peer'), ms['memspec'])} | {runs} |")
    return "\n".join(lines) + "\n"


def readme_table(rows: list[Row]) -> str:
    """One line per family: memspec's times and the ratios (the README)."""
    lines = [("| family | spec (default schedule) | forward | online / memspec | peer / memspec "
             "| fwd + bwd | online / memspec | peer / memspec | peer |"), "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for row in rows:
        cells = []
        for res in row.results.values():
            ms = res["ms"]
            cells += [_ms(ms["memspec"]), _ratio(ms.get("online"), ms["memspec"]), _ratio(ms.get("peer"), ms["memspec"])]
        lines.append(f"| {row.family} | {row.spec} ({_schedule(row)}) | " + " | ".join(cells) + f" | {row.peer or '—'} |")
    return "\n".join(lines) + "\n"


def _schedule(row: Row) -> str:
    return row.schedule + ("" if row.exact else ", approximate")


# ---------------------------------------------------------------------------------------------
# the scripts run as they are, each in its own process


class CommandFailed(Exception):
    """A benchmark command exited non-zero: its report section says so, the others still run."""


def run_command(argv: list[str], threads: int | None, quiet: bool = False) -> str:
    """Run one benchmark command (``memspec ...`` or ``python benchmarks/...``) from the checkout; its
    stdout.  The child gets OMP_NUM_THREADS = threads where given; ``quiet``: the command line is not
    printed."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    exe = [sys.executable, "-m", "memspec"] + argv[1:] if argv[0] == "memspec" else [sys.executable] + argv[1:]
    if not quiet:
        print("$ " + shlex.join(argv), flush=True)
    done = subprocess.run(exe, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        tail = (done.stdout + done.stderr).strip().splitlines()[-1:] or [""]
        print(done.stdout[-2000:] + done.stderr[-4000:], file=sys.stderr)
        raise CommandFailed(f"exit {done.returncode}: {tail[0][:300]}")
    return done.stdout


def bench_table(record: dict) -> str:
    lines = ["| spec | schedule | exact | chunk | median | online / schedule | % of bmm peak |",
             "|---|---|---|---:|---:|---:|---:|"]
    for r in record["results"]:
        if "error" in r:
            lines.append(f"| {r['spec']} | {r['schedule']} | failed: {r['error'][:80]} | | | | |")
            continue
        frac = r.get("frac_of_bmm_peak")
        speed = r.get("speedup_vs_online")
        lines.append(f"| {r['spec']} | {r['schedule']} | {'yes' if r['exact'] else 'no'} | {r['chunk'] or '—'} | "
                     f"{_ms(r['median_ms'])} | {'—' if speed is None else f'{speed:.1f}×'} | "
                     f"{'—' if frac is None else f'{100 * frac:.0f} %'} |")
    return "\n".join(lines) + "\n"


def anchors_table(fwd: dict, bwd: dict) -> str:
    lines = [("| kernel | memspec, forward | pure-PyTorch chunked | ratio | memspec, fwd + bwd | pure-PyTorch chunked "
             "| ratio |"), "|---|---:|---:|---:|---:|---:|---:|"]
    for name, f in fwd["rows"].items():
        b = bwd["rows"].get(name)
        cells = [_ms(f["memspec_ms"]), _ms(f["naive_chunk_ms"]), _ratio(f["naive_chunk_ms"], f["memspec_ms"])]
        cells += ([_ms(b["memspec_ms"]), _ms(b["naive_chunk_ms"]), _ratio(b["naive_chunk_ms"], b["memspec_ms"])]
                  if b else ["—"] * 3)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    for name, f in fwd["channel"].items():
        b = bwd["channel"].get(name, {})
        mine, others = f["memspec"], [k for k in f if k != "memspec"]
        for other in others:
            cells = [_ms(mine["ms"]), _ms(f[other]["ms"]), _ratio(f[other]["ms"], mine["ms"])]
            cells += ([_ms(b["memspec"]["ms"]), _ms(b[other]["ms"]), _ratio(b[other]["ms"], b["memspec"]["ms"])]
                      if other in b else ["—"] * 3)
            lines.append(f"| {name} vs {other} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def dplr_table(fwd: dict, bwd: dict) -> str:
    lines = ["| kernel | pass | memspec | token loop | loop / memspec | fla's chunked reference | fla / memspec |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for name in fwd["rows"]:
        for what, rec in (("forward", fwd), ("forward + backward", bwd)):
            r = rec["rows"].get(name)
            if r is None:
                continue
            fla = r.get("fla_chunk_ms")
            note = f" ({r['fla_note']})" if r.get("fla_note") else ""
            lines.append(f"| {name} | {what} | {_ms(r['memspec_ms'])} | {_ms(r['recurrent_ms'])} | "
                         f"{r['recurrent_speedup']:.1f}× | {_ms(fla)}{note} | {_ratio(fla, r['memspec_ms'])} |")
    return "\n".join(lines) + "\n"


def floor_table(text: str) -> str:
    """floor.py's rows (``name  median  ratio x``) as Markdown."""
    lines = ["| row | median | online / row |", "|---|---:|---:|"]
    for line in text.splitlines():
        parts = line.rsplit(None, 2)
        if len(parts) == 3 and parts[2].endswith("x") and parts[1].replace(".", "").isdigit():
            lines.append(f"| {parts[0].strip()} | {float(parts[1]):.2f} ms | {parts[2][:-1]}× |")
    if len(lines) == 2:
        raise SystemExit(f"benchmarks/floor.py printed no rows:\n{text}")
    return "\n".join(lines) + "\n"


def lact_table(text: str) -> str:
    """lact_anchor.py's rows (``chunk pass anchor eager ratio [compiled ratio]``) as Markdown."""
    lines = ["| chunk | pass | anchor | eager | eager / anchor | compiled | compiled / anchor |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for line in text.splitlines():
        parts = line.split()
        if len(parts) in (5, 7) and parts[0].isdigit() and parts[1] in ("forward", "fwd+bwd"):
            comp = parts[5:] or ["—", "—"]
            lines.append(f"| {parts[0]} | {parts[1]} | {parts[2]} ms | {parts[3]} ms | {parts[4]}× | "
                         + (f"{comp[0]} ms | {comp[1]}× |" if parts[5:] else "— | — |"))
    if len(lines) == 2:
        raise SystemExit(f"benchmarks/lact_anchor.py printed no rows:\n{text}")
    return "\n".join(lines) + "\n"


def memory_table(text: str) -> str:
    """frontier_memory.py's Markdown table, its own title line included."""
    return text.strip() + "\n"


def families_table() -> str:
    """The shipped specs by their default schedule's family, in the order of FAMILIES (no timing)."""
    by = {name: [] for name in NAMES}
    for path in sorted((ROOT / "specs").glob("*.yaml")):
        decision = decide(load_checked(path).spec)
        by[decision.family].append(path.stem)
    lines = ["| family | exact | shipped specs (their default schedule) |", "|---|---|---|"]
    for name, specs in by.items():
        lines.append(f"| {name} | {'yes' if BY_NAME[name].exact else 'no'} | {', '.join(specs) or '—'} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# the report


def machine(threads: int) -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, check=False,
                                text=True).stdout.strip() or None
    except OSError:
        commit = None
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
            "threads": threads, "commit": commit,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def _load() -> str:
    try:
        return " / ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "—"


@dataclass
class Sizes:
    T: int
    repeat: int
    budget_s: float
    bench: list[str]
    bench_argv: list[str]
    bench2: list[str]   # measured at two threads too: the forms whose online step is cheap per token
    anchors: list[str]
    dplr: list[str]
    floor: list[str]
    lact: list[str]
    memory: list[str]


def sizes(quick: bool) -> Sizes:
    if quick:
        return Sizes(T=128, repeat=1, budget_s=1.0,
                     bench=["specs/linear_attention.yaml", "specs/hgrn.yaml"], bench_argv=["--T", "128", "--repeat", "1"],
                     bench2=["specs/hgrn.yaml"],
                     anchors=["--T", "128", "--repeat", "1"],
                     dplr=["--T", "128", "--repeat", "1", "--peer-repeat", "1", "--recurrent-repeat", "1"],
                     floor=["--T", "128", "--D", "16", "--chunk", "16", "--group", "4", "--repeat", "1"],
                     lact=["--T", "128", "--chunks", "16", "--repeat", "1", "--no-compile"],
                     memory=["--T", "128", "titans", "lact"])
    return Sizes(T=2048, repeat=5, budget_s=20.0,
                 bench=[f"specs/{p.name}" for p in sorted((ROOT / "specs").glob("*.yaml")) if p.stem not in SAME_MEMORY],
                 bench_argv=["--T", "2048", "--B", "1", "--H", "4", "--D", "64", "--repeat", "3"],
                 bench2=[f"specs/{n}.yaml" for n in ("hgrn", "rglru", "mamba", "mlstm", "gsa", "gated_oja",
                                                     "gated_deltanet_channel", "deltanet_column", "mesa")],
                 anchors=["--T", "2048", "--repeat", "7"],
                 dplr=["--T", "2048", "--repeat", "3", "--peer-repeat", "1", "--recurrent-repeat", "1"],
                 floor=["--T", "2048", "--repeat", "9"],
                 lact=["--T", "2048", "--repeat", "7"],
                 memory=["--T", "2048"])


def checked_specs(paths: list[str]) -> tuple[list[str], list[str]]:
    """(the spec files that check, 'path: first error line' of the others)."""
    ok, bad = [], []
    for p in paths:
        try:
            load_checked(ROOT / p)
            ok.append(p)
        except SpecError as err:   # a spec another change left invalid: said in the report
            bad.append(f"{p}: {str(err).splitlines()[0][:200]}")
    return ok, bad


def scripts_section(z: Sizes, threads: int) -> tuple[list[str], list[str]]:
    """The tables of the scripts run as they are (bench, anchors, floor): (Markdown lines, failures)."""
    t = ["--threads", str(threads)]
    specs, unchecked = checked_specs(z.bench)
    with tempfile.TemporaryDirectory() as d:
        j = {k: str(Path(d) / f"{k}.json") for k in ("bench", "bench2", "fwd", "bwd", "dplr", "dplr_bwd")}
        argv = {"bench": ["memspec", "bench", *specs, *z.bench_argv, *t, "--json", j["bench"]],
                "bench2": ["memspec", "bench", *checked_specs(z.bench2)[0], *z.bench_argv, "--threads", "2",
                           "--json", j["bench2"]],
                "fwd": ["python", "benchmarks/anchors.py", *z.anchors, *t, "--json", j["fwd"]],
                "bwd": ["python", "benchmarks/anchors.py", *z.anchors, *t, "--backward", "--json", j["bwd"]],
                "dplr": ["python", "benchmarks/anchors.py", "--dplr", *z.dplr, *t, "--json", j["dplr"]],
                "dplr_bwd": ["python", "benchmarks/anchors.py", "--dplr", *z.dplr, *t, "--backward",
                             "--json", j["dplr_bwd"]],
                "floor": ["python", "benchmarks/floor.py", *z.floor, *t],
                "lact": ["python", "benchmarks/lact_anchor.py", *z.lact, *t],
                "lact2": ["python", "benchmarks/lact_anchor.py", *z.lact, "--threads", "2"],
                "memory": ["python", "benchmarks/frontier_memory.py", *t, "--markdown", *z.memory]}
        got, failed = {}, {}
        for k, a in argv.items():
            try:
                text = run_command(a, 2 if k in ("bench2", "lact2") else threads)
                got[k] = json.loads(Path(j[k]).read_text()) if k in j else text
            except CommandFailed as err:
                failed[k] = str(err)

    def cmd(k):
        shown = [a if not a.startswith(d) else Path(a).name for a in argv[k]]
        return f"`{shlex.join(shown)}`"

    def table(keys, render):
        bad = [k for k in keys if k in failed]
        return [f"{cmd(k)} failed ({failed[k]})." for k in bad] + ([] if bad else [render(*(got[k] for k in keys))])

    peak = got["bench"]["machine"]["bmm_64x64_peak_gflops"] if "bench" in got else float("nan")
    notes = [f"* left out, it does not check: {b}" for b in unchecked]
    notes += [f"* {n}: the memory of {base} in a wiring (measured as {base})" for n, base in SAME_MEMORY.items()
              if f"specs/{n}.yaml" not in z.bench and f"specs/{base}.yaml" in z.bench]
    out = ["## Every shipped spec, each schedule it carries (forward, no grad)", "",
           (f"{cmd('bench')} (the generated memories, eager; schedules alternated round-robin in one process; "
            f"% of this machine's `torch.bmm` 64×64 peak, {peak:.0f} GFLOP/s in this run):"), "",
           *notes, *([""] if notes else []),
           *table(["bench"], bench_table),
           "## The elementwise and per-channel forms at two threads", "",
           (f"{cmd('bench2')}: the exact chunked forms whose online step is cheap per token (a small state that "
            "stays in cache), where a second thread speeds the chunked products and not the per-token loop:"), "",
           *table(["bench2"], bench_table),
           "## Kernels against pure-PyTorch chunked forms", "",
           (f"{cmd('fwd')} and {cmd('bwd')}: `memspec.runtime`'s kernels against the pure-PyTorch chunked forms "
            "written in the script as flash-linear-attention's references are, and against fla's own references "
            "where installed (`fla` rows), alternated in one process; per-channel decays against the chunked GLA "
            "written there, their own token recurrence and fla's `naive_chunk_simple_gla`:"), "",
           *table(["fwd", "bwd"], anchors_table),
           "## The dplr and momentum kernels", "",
           (f"{cmd('dplr')} and {cmd('dplr_bwd')}: `chunk_dplr` and `chunk_momentum_delta` against their own "
            "token loops and fla's chunked references (checked equal where they compute the same recurrence):"), "",
           *table(["dplr", "dplr_bwd"], dplr_table),
           "## The eager floor of an exact chunked form", "",
           (f"{cmd('floor')}: retention's online and chunked schedules next to the fewest eager ops an exact "
            "chunked form of it needs and their batched matmuls alone (what any eager chunked form pays):"), "",
           *table(["floor"], floor_table),
           "## LaCT against its anchor, eager and compiled", "",
           (f"{cmd('lact')}: LaCT's memory (d 64, hidden 128) against the apply-then-update chunks written by hand "
            "from the paper in the script, eager and with `compile=True` (against the eager anchor), forward and "
            "forward + backward; ratios are memspec / anchor here (below 1, memspec is faster):"), "",
           *table(["lact"], lact_table), "",
           f"At two threads, {cmd('lact2')}:", "",
           *table(["lact2"], lact_table),
           "## Peak memory of the frontier layers at training length", "",
           ("The frontier memories, whose schedules form every token's state, against the titans layer (recomputed "
            "chunks keep each within 2x; seconds: one run):"), "",
           *table(["memory"], memory_table)]
    return out, [f"{shlex.join(argv[k])}: {why}" for k, why in failed.items()] + unchecked


def report(z: Sizes, threads: int, argv_shown: str, sections: set[str]) -> tuple[str, str, list[str]]:
    """(docs/benchmarks.md, the README's speed block, what failed)."""
    m = machine(threads)
    load0 = _load()
    rows = []
    if "family" in sections:
        print(f"one spec per family, T={z.T}", flush=True)
        rows = family_rows(z, threads)
    rest, failed = scripts_section(z, threads) if "scripts" in sections else ([], [])
    where = (f"{m['cpu']}, {m['cores']} cores, {threads} thread{'s' if threads > 1 else ''}, torch {m['torch']}, "
             f"Python {m['python']}, {m['date']}")
    config = f"B=1, H=4, T={z.T}, D=64, float32"
    own = "; ".join(f"{n} keeps its {', '.join(ds)}" for n, ds in OWN_DIMS.items())
    table = family_table(rows) if rows else ""
    readme = "\n".join([BEGIN, f"`{argv_shown}` ({config}; {where}):", "", readme_table(rows).rstrip() if rows else "",
                        END])
    checks = [f"* {r.spec}: {r.peer} — {r.check}" for r in rows if r.peer]
    doc = ["# Benchmarks", "",
           f"Generated by `{argv_shown}` on {m['date']}" + (f" at commit {m['commit']}" if m["commit"] else "")
           + "; rerun it rather than editing this file.  Ratios are *other / memspec*: above 1, memspec is "
           "faster.  Every table alternates memspec and what it is compared with in one process.", "",
           "| CPU | cores | threads | torch | Python | load average at the start / end (1, 5, 15 min) |",
           "|---|---:|---:|---|---|---|",
           f"| {m['cpu']} | {m['cores']} | {threads} | {m['torch']} | {m['python']} | {load0} → {_load()} |", ""]
    if rows:
        doc += ["## One spec per schedule family", "",
                (f"`{argv_shown}` ({config}, d_k = d_v = D; {own}): the generated memory's default schedule "
                 "(eager), the same memory's "
                "online schedule and a peer, forward (no grad) and forward + backward of the outputs' sum, "
                f"round-robin in one process per family (at most {z.repeat} rounds within {z.budget_s:.0f} s; a call over a "
                "quarter of that is timed by its one call; the README shows this table's ratios).  "
                "Peers, and how each was checked before timing:"), "",
                *checks, "", table]
    doc += rest
    doc += ["## The shipped specs by family", "",
            "Each spec's default schedule as `memspec explain` decides it from the update's algebra:", "",
            families_table()]
    return "\n".join(doc), readme, failed


def replace_block(path: Path, block: str) -> None:
    text = path.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{path}: no {BEGIN} ... {END} block to replace")
    head, rest = text.split(BEGIN, 1)
    path.write_text(head + block + rest.split(END, 1)[1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's choice)")
    ap.add_argument("--quick", action="store_true", help="small sizes, one round: checks the script, not the speed")
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"), help="the report (default: %(default)s)")
    ap.add_argument("--readme", default=None, help="also replace the speed block of this README")
    ap.add_argument("--sections", default="family,scripts",
                    help="comma-separated: family (one spec per family), scripts (bench, anchors, floor)")
    ap.add_argument("--family-row", default=None, help=argparse.SUPPRESS)   # (a child: one family's row)
    ap.add_argument("--T", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--repeat", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--budget", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.family_row:
        one_row(a.family_row, Sizes(**{**vars(sizes(False)), "T": a.T, "repeat": a.repeat, "budget_s": a.budget}),
                Path(a.json))
        return 0
    threads_before = torch.get_num_threads()
    if a.threads:
        torch.set_num_threads(a.threads)
    threads = torch.get_num_threads()
    shown = ["python", "benchmarks/report.py"] + (["--threads", str(a.threads)] if a.threads else []) \
        + (["--quick"] if a.quick else []) + (["--sections", a.sections] if a.sections != "family,scripts" else [])
    try:
        doc, block, failed = report(sizes(a.quick), threads, shlex.join(shown), set(a.sections.split(",")))
    finally:
        torch.set_num_threads(threads_before)
    Path(a.out).write_text(doc)
    print(f"wrote {a.out}")
    if a.readme:
        replace_block(Path(a.readme), block)
        print(f"updated the speed table of {a.readme}")
    for why in failed:
        print(f"report.py: failed: {why}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
