"""The outer loop: train a :class:`~memspec.nn.MemoryLM` on MQAR, compare specs, DDP.

The inner loop (the memory's updates) runs inside every forward pass; AdamW trains the
slow parameters -- projections, gates, learned initial states, the LM around them --
through the chain of inner updates (seed text §4.4-4.5).

``train(spec, cfg)`` returns a :class:`RunResult`; with ``cfg.out`` it writes
``log.json`` (config, loss per step, held-out accuracy, throughput) and
``checkpoint.pt`` (state dict + the spec text + the config).  ``compare(specs, cfg)``
trains each spec under the same budget and seed; :func:`markdown_table` prints the
result.

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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from .tasks import MQAR


@dataclass
class TrainConfig:
    task: str = "mqar"
    steps: int = 300
    batch: int = 32                 # global batch (split across ranks)
    seq_len: int = 64
    pairs: int = 8
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
    out: str | None = None
    progress: bool = True

    def task_(self) -> MQAR:
        if self.task != "mqar":
            raise ValueError(f"unknown task {self.task!r}: the only task is mqar")
        return MQAR(seq_len=self.seq_len, pairs=self.pairs, vocab_size=self.vocab)


@dataclass
class RunResult:
    spec: str
    schedule: str
    parameters: int
    accuracy: float
    chance: float
    tokens_per_s: float
    seconds: float
    losses: list[float] = field(default_factory=list)
    out: str | None = None


# ------------------------------------------------------------------ helpers
def load_spec(path: str):
    """Load and check a spec file (raises SpecError with located diagnostics)."""
    from ..pipeline.build import load_checked

    return load_checked(path).spec


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
def evaluate(model, task: MQAR, cfg: TrainConfig, device) -> float:
    x, y = task.batch(cfg.eval_size, eval_seed(cfg))
    was = model.training
    model.eval()
    correct = total = 0
    for i in range(0, cfg.eval_size, 64):
        logits = model(x[i:i + 64].to(device))
        m = y[i:i + 64].to(device) != -100
        correct += (logits.argmax(-1)[m] == y[i:i + 64].to(device)[m]).sum().item()
        total += m.sum().item()
    model.train(was)
    return correct / max(total, 1)


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
    if cfg.batch % world:
        raise ValueError(f"the global batch {cfg.batch} is not divisible by the {world} processes")
    device = torch.device("cpu")
    if distributed:
        import torch.distributed as dist

        if not dist.is_initialized():
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            dist.init_process_group(backend)
        if torch.cuda.is_available():
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    main_process = rank == 0
    label = name or spec.name

    torch.manual_seed(cfg.seed)
    model = MemoryLM(spec, vocab_size=cfg.vocab, d_model=cfg.d_model, n_layers=cfg.layers,
                     compile=cfg.compile, make_layer=make_layer, **model_dims(spec, cfg)).to(device)
    n_params = model.num_parameters()
    net = model
    if distributed:
        from torch.nn.parallel import DistributedDataParallel

        net = DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))

    local = cfg.batch // world
    bar = Progress(label, cfg.steps, enabled=cfg.progress and main_process)
    losses, log_steps = [], []
    tokens, t_train = 0, 0.0
    for step in range(cfg.steps):
        t0 = time.perf_counter()
        x, y = task.batch(cfg.batch, train_seed(cfg, step))
        n_targets = (y != -100).sum().item()                 # global count, same on every rank
        x, y = x[rank * local:(rank + 1) * local].to(device), y[rank * local:(rank + 1) * local].to(device)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        logits = net(x)
        loss_sum = F.cross_entropy(logits.reshape(-1, cfg.vocab), y.reshape(-1), ignore_index=-100,
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

    acc = evaluate(model, task, cfg, device)
    result = RunResult(spec=label, schedule=schedule_name(spec, cfg.dims.get("chunk")), parameters=n_params, accuracy=acc,
                       chance=task.chance, tokens_per_s=tokens / max(t_train, 1e-9), seconds=t_train,
                       losses=losses, out=cfg.out)
    if cfg.out and main_process:
        from ..pipeline.write import write_atomic

        out = Path(cfg.out)
        out.mkdir(parents=True, exist_ok=True)
        text = spec_text(spec, path)
        record = {"spec": label, "spec_path": path, "config": asdict(cfg), "world_size": world,
                  "parameters": n_params, "schedule": result.schedule, "accuracy": acc, "chance": task.chance,
                  "tokens_per_s": result.tokens_per_s, "seconds": t_train, "log": log_steps}
        write_atomic(out / "log.json", json.dumps(record, indent=1) + "\n")
        _save_checkpoint(out / "checkpoint.pt", {"state_dict": model.state_dict(), "spec_text": text,
                                                 "spec_name": spec.name, "config": asdict(cfg)})
    return result


def compare(specs: list, cfg: TrainConfig, *, make_layer: Callable | None = None) -> list[RunResult]:
    """Train each spec under the same config (budget, seed, data) and return the results."""
    results = []
    for s in specs:
        sub = cfg
        if cfg.out:
            stem = Path(s).stem if isinstance(s, (str, Path)) else s.name
            sub = TrainConfig(**{**asdict(cfg), "out": str(Path(cfg.out) / stem)})
        results.append(train(s, sub, make_layer=make_layer))
    return results


def markdown_table(results: list[RunResult]) -> str:
    lines = ["| spec | schedule | parameters | accuracy | tokens/s |",
             "|---|---|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r.spec} | {r.schedule} | {r.parameters:,} | {r.accuracy:.3f} | {r.tokens_per_s:,.0f} |")
    if results:
        lines.append("")
        lines.append(f"chance accuracy: {results[0].chance:.3f}")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ command line
_OPTIONS = ("steps", "batch", "seq_len", "pairs", "vocab", "d_model", "layers", "heads", "lr", "seed",
            "eval_size", "lr_schedule")


def config_from_args(args, usage_error=ValueError) -> TrainConfig:
    """A TrainConfig from parsed `memspec train` / `compare` options (None = default)."""
    over = {k: getattr(args, k) for k in _OPTIONS if getattr(args, k, None) is not None}
    for k in ("steps", "batch", "seq_len", "pairs", "vocab", "d_model", "layers", "heads", "eval_size"):
        if k in over and over[k] < 1:
            raise usage_error(f"--{k.replace('_', '-')} must be >= 1, got {over[k]}")
    if "lr" in over and not over["lr"] > 0:
        raise usage_error(f"--lr must be > 0, got {over['lr']}")
    dims = {}
    for item in getattr(args, "dim", None) or []:
        name, _, value = item.partition("=")
        if not name.isidentifier() or not value.isdigit() or int(value) < 1:
            raise usage_error(f"--dim expects NAME=N with N >= 1, got {item!r}")
        dims[name] = int(value)
    cfg = TrainConfig(task=args.task, compile=args.compile, out=args.out, progress=not args.no_progress,
                      dims=dims, **over)
    try:
        cfg.task_()
        _, world = dist_env()
        if cfg.batch % world:
            raise ValueError(f"--batch {cfg.batch} is not divisible by the {world} processes")
        if cfg.d_model % cfg.heads:
            raise ValueError(f"--d-model {cfg.d_model} is not divisible by --heads {cfg.heads}")
    except ValueError as err:
        raise usage_error(str(err)) from None
    return cfg


def run_cli(args, usage_error) -> int:
    cfg = config_from_args(args, usage_error)
    rank, world = dist_env()
    specs = [load_spec(f) for f in args.files]          # every spec checked before any training
    try:
        if args.compare:
            results = []
            for path, spec in zip(args.files, specs):
                sub = cfg if not cfg.out else TrainConfig(**{**asdict(cfg), "out": str(Path(cfg.out) / Path(path).stem)})
                results.append(train(spec, sub, name=Path(path).stem))
            table = markdown_table(results)
            if rank == 0:
                sys.stdout.write(table)
                if cfg.out:
                    from ..pipeline.write import write_atomic

                    write_atomic(Path(cfg.out) / "table.md", table)
        else:
            r = train(specs[0], cfg, name=Path(args.files[0]).stem)
            if rank == 0:
                print(f"{r.spec}: schedule {r.schedule}, {r.parameters:,} parameters, held-out recall accuracy "
                      f"{r.accuracy:.3f} (chance {r.chance:.3f}), final loss {r.losses[-1]:.4f}, "
                      f"{r.tokens_per_s:,.0f} tokens/s, {r.seconds:.1f} s"
                      + (f"; wrote {cfg.out}/log.json and {cfg.out}/checkpoint.pt" if cfg.out else ""))
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
