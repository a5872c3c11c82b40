"""The outer loop: train a :class:`~memspec.nn.MemoryLM` on MQAR or real text, compare specs, DDP.

The inner loop (the memory's updates) runs inside every forward pass; AdamW trains the
slow parameters -- projections, gates, learned initial states, the LM around them --
through the chain of inner updates (seed text §4.4-4.5).

``train(spec, cfg)`` returns a :class:`RunResult`; with ``cfg.out`` it writes
``log.json`` (config, loss per step, held-out accuracy, throughput) and
``checkpoint.pt`` (state dict + the spec text + the config); with ``cfg.save_hf`` the
trained model as a Hugging Face folder (:func:`memspec.hf.export`).  ``compare(specs, cfg,
seeds=N)`` trains each spec under the same budget for each of N seeds (seed s: the same
initialisation seed and the same batches for every spec); :func:`summarize` gathers the
runs per spec (mean, min and max accuracy), :func:`markdown_table` and
:func:`json_table` print them.  On the text task (``task="text"``,
:class:`~memspec.tools.tasks.TextTask`) the held-out metric is bits per byte, and the
accuracy is next-byte accuracy on the held-out files.

Distributed: launched by ``torchrun`` (``WORLD_SIZE`` > 1 in the environment), the
run joins a ``torch.distributed`` group (gloo on CPU, nccl on CUDA), wraps the model
in ``DistributedDataParallel``, and each rank trains on its contiguous share of the
same global batch.  Each rank's loss is its sum of token losses divided by the
*global* number of targets, times the world size, so DDP's gradient average equals
the gradient of the one-process loss: the loss curve matches one process with the
same global batch to float tolerance.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from ..parallel.model import data_world, shard_tokens, split_batch
from .tasks import MQAR, TextTask


@dataclass
class TrainConfig:
    task: str = "mqar"              # mqar | text
    data: str | None = None         # text: the corpus folder (None = the Python standard library)
    steps: int = 300
    batch: int = 32                 # global batch (split across ranks)
    seq_len: int = 64
    pairs: int = 8
    gap: int = 0                    # pad tokens between the pairs and the queries
    vocab: int = 64
    d_model: int = 64
    layers: int = 2
    heads: int = 4                  # memory heads; dims d_k and d_v default to d_model // heads
    dims: dict = field(default_factory=dict)   # other build-time dims (e.g. hidden, chunk)
    lr: float = 5e-3
    lr_schedule: str = "cosine"     # cosine | constant
    warmup: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    eval_size: int = 256
    compile: bool = False
    pack: bool = False              # the batch's sequences packed into one row (cu_seqlens), each alone
    context_parallel: int = 1       # ranks that share every sequence, each its shard of tokens (torchrun)
    out: str | None = None
    save_hf: str | None = None      # also write the trained model as a Hugging Face folder (memspec export)
    progress: bool = True

    def task_(self, split: str = "train") -> MQAR | TextTask:
        """The task; for text, the ``split`` (train or test) of the corpus."""
        if self.task == "text":
            return TextTask(data_dir=self.data, seq_len=self.seq_len, split=split)
        if self.task != "mqar":
            raise ValueError(f"unknown task {self.task!r}: the tasks are mqar and text")
        if self.data is not None:
            raise ValueError("--data is for the text task (--task text)")
        return MQAR(seq_len=self.seq_len, pairs=self.pairs, vocab_size=self.vocab, gap=self.gap)

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary: 256 bytes on the text task, ``vocab`` on MQAR."""
        return TextTask.vocab_size if self.task == "text" else self.vocab


@dataclass
class RunResult:
    spec: str
    schedule: str
    parameters: int
    accuracy: float                 # NaN when the run diverged
    chance: float
    tokens_per_s: float             # training tokens / training seconds
    seconds: float                  # training steps only
    losses: list[float] = field(default_factory=list)
    out: str | None = None
    seed: int = 0
    wall_seconds: float = 0.0       # the whole run: build, steps, evaluation
    diverged: str | None = None     # e.g. "loss is nan at step 25"
    bits_per_byte: float | None = None   # text task: held-out bits per byte


# ------------------------------------------------------------------ helpers
def load_spec(path: str, *, allow_extends_outside: bool = False, schedule: str | None = None):
    """Load and check a spec file (raises SpecError with located diagnostics); ``schedule``
    replaces the spec's own (ValueError when the spec does not admit it)."""
    from ..pipeline.build import load_checked, with_schedule

    spec = load_checked(path, allow_extends_outside=allow_extends_outside).spec
    return spec if schedule is None else with_schedule(spec, schedule)


def schedule_name(spec, chunk: int | None = None) -> str:
    """The memory's derived schedule, e.g. ``delta(64)`` (or the spec's own preference),
    and the wiring when there is one: ``minibatch(64), mac``."""
    try:
        from ..schedule import analyse

        d = analyse(spec)
        size = chunk if chunk and d.chunk else d.chunk          # a --dim chunk=N override
        name = f"{d.family}({size})" if size else d.family
    except Exception:
        name = spec.schedule
    return name if spec.wiring.kind == "none" else f"{name}, {spec.wiring.kind}"


def model_dims(spec, cfg: TrainConfig) -> dict:
    """Build-time dims of the memory at training size: ``heads``, and ``d_k`` / ``d_v``
    (when the spec has them) set to ``d_model // heads``; then ``cfg.dims`` (those the spec
    has, and ``chunk``); other dims keep the spec's values."""
    if cfg.d_model % cfg.heads:
        raise ValueError(f"d_model={cfg.d_model} is not divisible by heads={cfg.heads}")
    dims = {"heads": cfg.heads} if "heads" in spec.dims else {}
    for name in ("d_k", "d_v"):
        if name in spec.dims:
            dims[name] = cfg.d_model // cfg.heads
    for name, value in cfg.dims.items():
        if name in spec.dims or name == "chunk":
            dims[name] = value
    return dims


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    if cfg.lr_schedule == "constant":
        return cfg.lr
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def train_seed(cfg: TrainConfig, step: int) -> int:
    return (cfg.seed << 32) + step


def eval_seed(cfg: TrainConfig) -> int:
    return (cfg.seed << 32) + (1 << 31)          # never a training seed


def dist_env() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


class Progress:
    """A one-line progress bar on stderr (``\\r`` updates; no dependency)."""

    def __init__(self, name: str, total: int, enabled: bool = True):
        self.name, self.total, self.enabled = name, total, enabled
        self.tty = sys.stderr.isatty()
        self.last, self.shown = 0.0, 0

    def update(self, step: int, loss: float, tok_s: float) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if self.tty:
            if now - self.last < 0.2 and step < self.total:
                return
        elif step < self.total and step * 10 // self.total == self.shown * 10 // self.total:
            return                                   # not a terminal: one line per 10%
        self.last, self.shown = now, step
        width = 24
        done = int(width * step / self.total)
        bar = "#" * done + "." * (width - done)
        line = f"{self.name} [{bar}] {step}/{self.total} loss {loss:.4f} {tok_s:,.0f} tok/s"
        sys.stderr.write(f"\r{line} " if self.tty else line + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\n")
            sys.stderr.flush()


@torch.no_grad()
def evaluate(model, task: MQAR | TextTask, cfg: TrainConfig, device, *, bits: bool = False):
    """Held-out accuracy over ``cfg.eval_size`` sequences (MQAR: of the eval seed; text: of the
    held-out files); with ``bits``, ``(accuracy, bits per byte)``."""
    x, y = task.batch(cfg.eval_size, eval_seed(cfg))
    was = model.training
    model.eval()
    correct = total = 0
    nats = 0.0
    for i in range(0, cfg.eval_size, 64):
        logits = model(x[i:i + 64].to(device))
        yy = y[i:i + 64].to(device)
        m = yy != -100
        correct += (logits.argmax(-1)[m] == yy[m]).sum().item()
        total += m.sum().item()
        nats += F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), yy.reshape(-1), ignore_index=-100,
                                reduction="sum").item()
    model.train(was)
    acc = correct / max(total, 1)
    return (acc, nats / max(total, 1) / math.log(2)) if bits else acc


def _save_checkpoint(path: Path, payload: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)


# ------------------------------------------------------------------ training
def train(spec, cfg: TrainConfig, *, make_layer: Callable | None = None, name: str | None = None) -> RunResult:
    """Train a MemoryLM with the memory ``spec`` (a Spec or a path) on ``cfg.task``."""
    from .nn import MemoryLM, spec_text

    path = None
    if isinstance(spec, (str, Path)):
        path = str(spec)
        spec = load_spec(path)
    task = cfg.task_()
    rank, world = dist_env()
    distributed = world > 1
    if cfg.batch % data_world(cfg, world):
        raise ValueError(f"the global batch {cfg.batch} is not divisible by the {world} processes")
    device = _join_processes(rank) if distributed else torch.device("cpu")
    main_process = rank == 0
    label = name or spec.name
    t_wall = time.perf_counter()

    torch.manual_seed(cfg.seed)
    model = MemoryLM(spec, vocab_size=cfg.vocab_size, d_model=cfg.d_model, n_layers=cfg.layers,
                     compile=cfg.compile, make_layer=make_layer, **model_dims(spec, cfg)).to(device)
    n_params = model.num_parameters()
    net = model
    if distributed:
        from torch.nn.parallel import DistributedDataParallel

        net = shard_tokens(DistributedDataParallel(model), model, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))

    bar = Progress(label, cfg.steps, enabled=cfg.progress and main_process)
    losses, log_steps = [], []
    tokens, t_train = 0, 0.0
    for step in range(cfg.steps):
        t0 = time.perf_counter()
        x, y = task.batch(cfg.batch, train_seed(cfg, step))
        n_targets = (y != -100).sum().item()                 # global count, same on every rank
        x, y = split_batch(x, y, rank, world, cfg, device)   # its rows, or (context parallel) its tokens
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        offsets = torch.arange(0, x.numel() + 1, x.shape[1], device=device) if cfg.pack else None   # one row
        logits = net(x.reshape(1, -1), cu_seqlens=offsets).view(*x.shape, -1) if cfg.pack else net(x)
        loss_sum = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), y.reshape(-1), ignore_index=-100,
                                   reduction="sum")
        opt.zero_grad(set_to_none=True)
        (loss_sum * (world / n_targets)).backward()
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        loss_val = loss_sum.detach() / n_targets
        if distributed:
            import torch.distributed as dist

            dist.all_reduce(loss_val)
        t_train += time.perf_counter() - t0
        tokens += cfg.batch * cfg.seq_len
        losses.append(loss_val.item())
        log_steps.append({"step": step, "loss": losses[-1], "lr": lr_at(step, cfg)})
        if not math.isfinite(losses[-1]):
            bar.close()
            raise FloatingPointError(f"{label}: loss is {losses[-1]} at step {step}")
        bar.update(step + 1, losses[-1], tokens / t_train)
    bar.close()

    acc, bpb = _final_evaluation(model, task, cfg, device)
    result = RunResult(spec=label, schedule=schedule_name(spec, cfg.dims.get("chunk")), parameters=n_params, accuracy=acc,
                       chance=task.chance, tokens_per_s=tokens / max(t_train, 1e-9), seconds=t_train,
                       losses=losses, out=cfg.out, seed=cfg.seed, wall_seconds=time.perf_counter() - t_wall,
                       bits_per_byte=bpb)
    if cfg.out and main_process:
        record = {"spec": label, "spec_path": path, "seed": cfg.seed, "config": asdict(cfg), "world_size": world,
                  "parameters": n_params, "schedule": result.schedule, "accuracy": acc, "bits_per_byte": bpb, "chance": task.chance,
                  "tokens_per_s": result.tokens_per_s, "seconds": t_train, "wall_seconds": result.wall_seconds,
                  "threads": torch.get_num_threads(), "load_average": _load_average(), "log": log_steps}
        _write_run(Path(cfg.out), record, model, spec, spec_text(spec, path), cfg)
    if cfg.save_hf and main_process:
        from ..hf import export, from_memory_lm

        export(spec, cfg.save_hf, model=from_memory_lm(model, **model_dims(spec, cfg)))
    return result


def _final_evaluation(model, task, cfg: TrainConfig, device) -> tuple:
    """(accuracy, bits per byte or None): text on its held-out split, in bits per byte too."""
    if cfg.task == "text":
        return evaluate(model, cfg.task_("test"), cfg, device, bits=True)
    return evaluate(model, task, cfg, device), None


def _join_processes(rank: int) -> torch.device:
    """Under torchrun: join the process group (nccl with CUDA, else gloo) unless joined; this rank's device."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    return torch.device("cpu")


def _write_run(out: Path, record: dict, model, spec, text: str, cfg: TrainConfig) -> None:
    """``out/log.json`` (the run's record) and ``out/checkpoint.pt`` (weights, spec text, config)."""
    from ..pipeline.write import write_atomic

    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "log.json", json.dumps(record, indent=1) + "\n")
    _save_checkpoint(out / "checkpoint.pt", {"state_dict": model.state_dict(), "spec_text": text,
                                             "spec_name": spec.name, "config": asdict(cfg)})


def _load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):       # not on every platform
        return None


def seeds_of(cfg: TrainConfig, seeds: int) -> list[int]:
    """The seeds of a comparison: ``cfg.seed, cfg.seed + 1, ...`` (``seeds`` of them)."""
    if seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {seeds}")
    return [cfg.seed + i for i in range(seeds)]


def train_or_diverge(spec, cfg: TrainConfig, *, make_layer: Callable | None = None,
                     name: str | None = None) -> RunResult:
    """:func:`train`, with a diverged run (a non-finite loss) returned as a result with
    accuracy NaN and ``diverged`` saying where, so that a sweep goes on."""
    t0 = time.perf_counter()
    try:
        return train(spec, cfg, make_layer=make_layer, name=name)
    except FloatingPointError as err:
        if isinstance(spec, (str, Path)):
            spec = load_spec(str(spec))
        label = name or spec.name
        return RunResult(spec=label, schedule=schedule_name(spec, cfg.dims.get("chunk")), parameters=0,
                         accuracy=float("nan"), chance=cfg.task_().chance, tokens_per_s=float("nan"),
                         seconds=float("nan"), out=cfg.out, seed=cfg.seed, wall_seconds=time.perf_counter() - t0,
                         diverged=str(err).split(": ", 1)[-1])


def compare(specs: list, cfg: TrainConfig, *, seeds: int = 1, make_layer: Callable | None = None,
            names: list[str] | None = None, on_result: Callable | None = None) -> list[RunResult]:
    """Train each spec under the same config for each seed of :func:`seeds_of` and return
    the results (seed-major: every spec under the first seed, then the next), so that
    for a given seed every spec starts from the same initialisation seed and sees the
    same batches.  With ``cfg.out`` each run writes ``out/<spec>[/seed<s>]``.
    ``on_result(result)`` is called after each run (e.g. to log it)."""
    results = []
    labels = names or [Path(s).stem if isinstance(s, (str, Path)) else s.name for s in specs]
    for seed in seeds_of(cfg, seeds):
        for s, label in zip(specs, labels):
            sub = replace(cfg, seed=seed)
            if cfg.out:
                folder = Path(cfg.out) / label
                sub = replace(sub, out=str(folder / f"seed{seed}" if seeds > 1 else folder))
            r = train_or_diverge(s, sub, make_layer=make_layer, name=label)
            results.append(r)
            if on_result is not None:
                on_result(r)
    return results


@dataclass
class Summary:
    """One spec's runs across seeds."""

    spec: str
    schedule: str
    parameters: int
    chance: float
    runs: list[RunResult]

    @property
    def finished(self) -> list[RunResult]:
        return [r for r in self.runs if r.diverged is None]

    @property
    def text(self) -> bool:
        """Runs of the text task (their metric is bits per byte)."""
        return any(r.bits_per_byte is not None for r in self.runs)

    def metric(self, r: RunResult) -> float:
        """A run's metric: held-out bits per byte on the text task, else accuracy."""
        return r.bits_per_byte if self.text and r.bits_per_byte is not None else r.accuracy

    def _acc(self, fn):
        accs = [self.metric(r) for r in self.finished]
        return fn(accs) if accs else float("nan")

    @property
    def mean(self) -> float:
        """Mean of the metric (accuracy, or bits per byte on text) over the finished runs."""
        return self._acc(lambda a: sum(a) / len(a))

    @property
    def min(self) -> float:
        return self._acc(min)

    @property
    def max(self) -> float:
        return self._acc(max)

    @property
    def tokens_per_s(self) -> float:
        done = self.finished
        return sum(r.tokens_per_s for r in done) / len(done) if done else float("nan")

    @property
    def wall_seconds(self) -> float:
        """The longest run's wall time (each run is one process on the shared machine)."""
        return max(r.wall_seconds for r in self.runs)


def summarize(results: list[RunResult]) -> list[Summary]:
    """The runs grouped per spec, in first-seen order."""
    out: dict[str, Summary] = {}
    for r in results:
        if r.spec not in out:
            out[r.spec] = Summary(r.spec, r.schedule, r.parameters, r.chance, [])
        s = out[r.spec]
        s.runs.append(r)
        if not s.parameters and r.parameters:
            s.parameters = r.parameters
    return list(out.values())


def _acc_text(v: float) -> str:
    return "NaN" if math.isnan(v) else f"{v:.3f}"


def markdown_table(results: list[RunResult]) -> str:
    """One row per spec.  One seed: its metric (accuracy; held-out bits per byte on the
    text task); several: mean, min and max over the seeds, the per-seed values, and the
    diverged runs (excluded from the mean)."""
    groups = summarize(results)
    several = any(len(g.runs) > 1 for g in groups)
    text = any(g.text for g in groups)
    name = "bits per byte" if text else "accuracy"
    if not several:
        lines = [f"| spec | schedule | parameters | {name} | tokens/s |",
                 "|---|---|---:|---:|---:|"]
        for g in groups:
            r = g.runs[0]
            acc = _acc_text(g.metric(r)) + (f" (diverged: {r.diverged})" if r.diverged else "")
            lines.append(f"| {g.spec} | {g.schedule} | {g.parameters:,} | {acc} | {_rate(r.tokens_per_s)} |")
    else:
        lines = [f"| spec | schedule | parameters | mean {name} | min | max | per seed | tokens/s | s / run |",
                 "|---|---|---:|---:|---:|---:|---|---:|---:|"]
        for g in groups:
            per = " / ".join(_acc_text(g.metric(r)) for r in g.runs)
            bad = [r for r in g.runs if r.diverged]
            if bad:
                per += " (" + "; ".join(f"seed {r.seed} diverged: {r.diverged}" for r in bad) + ")"
            lines.append(f"| {g.spec} | {g.schedule} | {g.parameters:,} | {_acc_text(g.mean)} | {_acc_text(g.min)} | "
                         f"{_acc_text(g.max)} | {per} | {_rate(g.tokens_per_s)} | {g.wall_seconds:.0f} |")
    if groups:
        lines.append("")
        seeds = sorted({r.seed for g in groups for r in g.runs})
        first = ("bits per byte on the held-out files (a uniform guess: 8.000)" if text
                 else f"chance accuracy: {groups[0].chance:.3f}")
        lines.append(first + (f"; seeds {', '.join(map(str, seeds))}"
                                                                    if several else ""))
    return "\n".join(lines) + "\n"


def _rate(v: float) -> str:
    return "—" if math.isnan(v) else f"{v:,.0f}"


def _num(v: float):
    return None if isinstance(v, float) and not math.isfinite(v) else v


def run_fields(r: RunResult) -> dict:
    """One run's figures as JSON values (the comparison's rows and the runs.jsonl log)."""
    bits = {} if r.bits_per_byte is None else {"bits_per_byte": _num(r.bits_per_byte)}
    return {"seed": r.seed, "accuracy": _num(r.accuracy), **bits, "tokens_per_s": _num(r.tokens_per_s),
            "seconds": _num(r.seconds), "wall_seconds": r.wall_seconds, "diverged": r.diverged}


def json_table(results: list[RunResult], cfg: TrainConfig | None = None) -> str:
    """The comparison as JSON: the config, then per spec the summary and every run
    (seed, accuracy, tokens/s, training and wall seconds, final loss, divergence)."""
    rows = []
    for g in summarize(results):
        rows.append({
            "spec": g.spec, "schedule": g.schedule, "parameters": g.parameters, "chance": g.chance,
            ("bits_per_byte" if g.text else "accuracy"): {"mean": _num(g.mean), "min": _num(g.min),
                                                         "max": _num(g.max)},
            "tokens_per_s": _num(g.tokens_per_s),
            "runs": [{**run_fields(r), "final_loss": _num(r.losses[-1]) if r.losses else None} for r in g.runs],
        })
    record = {"config": {k: v for k, v in asdict(cfg).items() if k not in ("out", "progress")} if cfg else None,
              "seeds": sorted({r.seed for r in results}), "rows": rows}
    return json.dumps(record, indent=1) + "\n"


# ------------------------------------------------------------------ command line
_OPTIONS = ("steps", "batch", "seq_len", "pairs", "gap", "vocab", "d_model", "layers", "heads", "lr", "seed",
            "eval_size", "lr_schedule", "context_parallel")


def config_from_args(args, usage_error=ValueError) -> TrainConfig:
    """A TrainConfig from parsed `memspec train` / `compare` options (None = default)."""
    over = {k: getattr(args, k) for k in _OPTIONS if getattr(args, k, None) is not None}
    for k in ("steps", "batch", "seq_len", "pairs", "vocab", "d_model", "layers", "heads", "eval_size"):
        if k in over and over[k] < 1:
            raise usage_error(f"--{k.replace('_', '-')} must be >= 1, got {over[k]}")
    if "lr" in over and not over["lr"] > 0:
        raise usage_error(f"--lr must be > 0, got {over['lr']}")
    for k in ("gap", "seed"):
        if k in over and over[k] < 0:
            raise usage_error(f"--{k} must be >= 0, got {over[k]}")
    if getattr(args, "seeds", 1) < 1:
        raise usage_error(f"--seeds must be >= 1, got {args.seeds}")
    dims = {}
    for item in getattr(args, "dim", None) or []:
        name, _, value = item.partition("=")
        if not name.isidentifier() or not value.isdigit() or int(value) < 1:
            raise usage_error(f"--dim expects NAME=N with N >= 1, got {item!r}")
        dims[name] = int(value)
    data = getattr(args, "data", None)
    if data is not None and args.task != "text":
        raise usage_error("--data is for the text task (--task text)")
    if getattr(args, "save_hf", None):
        try:
            import safetensors  # noqa: F401
            import transformers  # noqa: F401
        except ImportError:
            raise usage_error("--save-hf needs transformers and safetensors: pip install 'memspec[hf]'") from None
    if args.task == "text" and "vocab" in over and over["vocab"] != 256:
        raise usage_error(f"--vocab: the text task's vocabulary is the 256 byte values, got {over['vocab']}")
    cfg = TrainConfig(task=args.task, data=data, save_hf=getattr(args, "save_hf", None), compile=args.compile,
                      pack=getattr(args, "pack", False), out=args.out, progress=not args.no_progress,
                      dims=dims, **over)
    try:
        cfg.task_()
        _, world = dist_env()
        if cfg.batch % data_world(cfg, world):
            raise ValueError(f"--batch {cfg.batch} is not divisible by the {world} processes")
        if cfg.d_model % cfg.heads:
            raise ValueError(f"--d-model {cfg.d_model} is not divisible by --heads {cfg.heads}")
    except ValueError as err:
        raise usage_error(str(err)) from None
    return cfg


def run_cli(args, usage_error) -> int:
    cfg = config_from_args(args, usage_error)
    rank, world = dist_env()
    try:                                                # every spec checked before any training
        specs = [load_spec(f, allow_extends_outside=getattr(args, "allow_extends_outside", False),
                           schedule=getattr(args, "schedule", None)) for f in args.files]
    except ValueError as err:
        raise usage_error(f"--schedule: {err}") from None
    try:
        if args.compare:
            from ..pipeline.write import write_atomic

            def log_run(r: RunResult) -> None:           # one JSON line per finished run, as they finish
                if rank == 0 and cfg.out:
                    Path(cfg.out).mkdir(parents=True, exist_ok=True)
                    line = {"spec": r.spec, **run_fields(r), "load_average": _load_average()}
                    with open(Path(cfg.out) / "runs.jsonl", "a", encoding="utf-8") as f:
                        f.write(json.dumps(line) + "\n")

            results = compare(specs, cfg, seeds=args.seeds, names=[Path(p).stem for p in args.files],
                              on_result=log_run)
            table = markdown_table(results)
            as_json = json_table(results, cfg)
            if rank == 0:
                sys.stdout.write(table)
                if cfg.out:
                    write_atomic(Path(cfg.out) / "table.md", table)
                    write_atomic(Path(cfg.out) / "table.json", as_json)
                if args.json:
                    write_atomic(Path(args.json), as_json)
        else:
            r = train(specs[0], cfg, name=Path(args.files[0]).stem)
            if rank == 0 and r.bits_per_byte is not None:
                print(f"{r.spec}: schedule {r.schedule}, {r.parameters:,} parameters, held-out {r.bits_per_byte:.3f} "
                      f"bits per byte (next-byte accuracy {r.accuracy:.3f}), final loss {r.losses[-1]:.4f}, "
                      f"{r.tokens_per_s:,.0f} tokens/s, {r.seconds:.1f} s"
                      + (f"; wrote {cfg.out}/log.json and {cfg.out}/checkpoint.pt" if cfg.out else "")
                      + (f"; wrote the Hugging Face folder {cfg.save_hf}" if cfg.save_hf else ""))
            elif rank == 0:
                print(f"{r.spec}: schedule {r.schedule}, {r.parameters:,} parameters, held-out recall accuracy "
                      f"{r.accuracy:.3f} (chance {r.chance:.3f}), final loss {r.losses[-1]:.4f}, "
                      f"{r.tokens_per_s:,.0f} tokens/s, {r.seconds:.1f} s"
                      + (f"; wrote {cfg.out}/log.json and {cfg.out}/checkpoint.pt" if cfg.out else "")
                      + (f"; wrote the Hugging Face folder {cfg.save_hf}" if cfg.save_hf else ""))
    except FloatingPointError as err:
        print(f"memspec: error: {err}", file=sys.stderr)
        return 1
    except ValueError as err:                            # e.g. sizes the memory cannot be built with
        raise usage_error(str(err)) from None
    finally:
        if world > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
    return 0
