"""A whole language model over shards of its sequences: :class:`ShardedLM` (``memspec train
--context-parallel P``).

Every rank holds all sequences of its data-parallel replica's rows (all of the batch's without data
parallelism), but only its contiguous shard of their tokens.  What is
token-local (embedding, norms, projections, MLPs, the head) runs on the shard as it is; what reads
earlier tokens crosses the shard boundary:

* each memory runs through :func:`~.run.context_parallel` (the scan of state maps or the relay);
* each short convolution takes its past inputs (``kernel - 1`` tokens) from the rank before
  (:class:`_Halo`; rank 0 from zeros), and hands its last ones on; in backward their gradient goes back.

Wired layers (MAC / MAG / MAL: attention windows and segments) are refused: their attention would need
the keys of earlier shards.  The model's loss on a rank is its share of the sequence's loss; the
gradients of the parameters summed over ranks (DDP's average times the world size, as ``train``
scales its loss) are the one-process gradients.
"""
from __future__ import annotations

from contextlib import contextmanager

from torch import nn

from . import comm
from .plan import plan_for
from .maps import shard_bounds
from .run import context_parallel


class _ShardedMemory(nn.Module):
    """A memory whose forward is :func:`context_parallel` over this rank's shard."""

    def __init__(self, memory, group, plan):
        super().__init__()
        self.inner = memory
        self.group, self.plan = group, plan

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["inner"], name)   # dims (d_k, d_v, heads, ...) as the Layer reads them

    def forward(self, *views, state=None, cu_seqlens=None, schedule="auto", **named):
        return context_parallel(self.inner, *views, state=state, schedule=schedule, cu_seqlens=cu_seqlens,
                                group=self.group, plan=self.plan, **named)


class _Halo(nn.Module):
    """A short convolution over this rank's shard, its past inputs from the rank before."""

    def __init__(self, conv, group):
        super().__init__()
        self.inner, self.group = conv, group

    def forward(self, x, state=None, cu_seqlens=None):
        if cu_seqlens is not None:
            raise ValueError("context parallel training takes no packed documents")
        rank, size = comm.rank_and_size(self.group)
        k1 = self.inner.kernel - 1
        if x.shape[1] < k1:
            raise ValueError(f"a shard of {x.shape[1]} tokens is shorter than the convolution's {k1} past inputs")
        carried = []
        if rank < size - 1:   # sent first: the last rank only receives, so the chain never waits on itself
            token = comm.send([x[:, x.shape[1] - k1:]], rank + 1, self.group)
            carried += [token] if token is not None else []
        if rank > 0:
            (state,) = comm.recv([((x.shape[0], k1, x.shape[2]), x.dtype, x.device)], rank - 1, self.group)
            carried.append(state)
        y, last = self.inner(x, state)
        return comm.attach([y], carried)[0], last


@contextmanager
def sharded(model, group=None, plan=None):
    """Inside, ``model`` (a :class:`~memspec.tools.nn.MemoryLM`) runs this rank's shard of its
    sequences: memories through :func:`context_parallel`, short convolutions with their halo."""
    if model.spec.wiring.kind != "none":
        raise ValueError(f"context parallel training runs unwired memories; {model.spec.name} is wired "
                         f"{model.spec.wiring.kind.upper()} (its attention reads earlier shards)")
    swaps = []
    try:
        for block in model.blocks:
            mem = getattr(block.mixer, "memory", None)
            if mem is None or not hasattr(mem, "VIEWS"):
                raise ValueError(f"context parallel training needs a generated memory layer, got "
                                 f"{type(block.mixer).__name__}")
            p = plan if plan is not None else plan_for(model.spec, mem.DEFAULT_SCHEDULE)
            swaps.append((block.mixer, "memory", mem))
            block.mixer.memory = _ShardedMemory(mem, group, p)
            if block.conv is not None:
                swaps.append((block, "conv", block.conv))
                block.conv = _Halo(block.conv, group)
        yield model
    finally:
        for owner, name, module in reversed(swaps):
            setattr(owner, name, module)


class ShardedLM(nn.Module):
    """``net`` (the model, or DDP around it) whose forward takes this rank's shard of every sequence
    ``tokens [B, T_r]`` and returns its logits ``[B, T_r, vocab]``; ``model`` is the MemoryLM inside."""

    def __init__(self, net, model, group=None):
        super().__init__()
        self.net, self.group = net, group
        object.__setattr__(self, "model", model)   # not a second registration of the same parameters

    def forward(self, tokens):
        with sharded(self.model, self.group):
            return self.net(tokens)


def data_world(cfg, world: int) -> int:
    """The data-parallel replicas that split the batch's rows: ``world``, or ``world / P`` when
    ``P = cfg.context_parallel`` ranks share every sequence of a replica (consecutive ranks); a
    ValueError when P does not divide the processes."""
    cp = cfg.context_parallel
    if cp == 1:
        return world
    if cp < 1 or world % cp:
        raise ValueError(f"--context-parallel {cp} runs under torchrun with a multiple of {max(cp, 1)} processes "
                         f"(torchrun --nproc-per-node {max(cp, 1)} -m memspec train ..., or k x {max(cp, 1)}: k "
                         f"data-parallel replicas of {max(cp, 1)} shards), not {world}")
    if cfg.pack:
        raise ValueError("--context-parallel takes no --pack")
    return world // cp


def shard_tokens(net, model, cfg):
    """``net`` unchanged for ``cfg.context_parallel == 1``; else :class:`ShardedLM` over this rank's
    group of P consecutive ranks (one group per replica, each its own: the collectives of the
    memories never interleave with DDP's, which spans every rank)."""
    import torch.distributed as dist

    cp = cfg.context_parallel
    if cp == 1:
        return net
    world = dist.get_world_size()
    data_world(cfg, world)
    groups = [dist.new_group(list(range(r, r + cp))) for r in range(0, world, cp)]   # every rank makes every group
    return ShardedLM(net, model, groups[dist.get_rank() // cp])


def split_batch(x, y, rank, world, cfg, device):
    """This rank's part of the batch: its replica's rows (data parallel), and with context
    parallelism its shard of their tokens."""
    replicas = data_world(cfg, world)
    cp = world // replicas
    local = cfg.batch // replicas
    r = rank // cp
    x, y = x[r * local:(r + 1) * local], y[r * local:(r + 1) * local]
    if cp > 1:
        a, b = shard_bounds(x.shape[1], cp)[rank % cp]
        x, y = x[:, a:b], y[:, a:b]
    return x.to(device), y.to(device)


__all__ = ["ShardedLM", "data_world", "shard_tokens", "sharded", "split_batch"]
