"""A memory over one sequence split into contiguous shards, one per rank: :func:`context_parallel`.

Rank ``r`` of ``P`` holds the tokens ``shard_bounds(T, P)[r]`` of every view and gate
(``[B, T_r, H, ...]``) and returns its outputs ``[B, T_r, H, ...]`` and the state at the end of its
shard (the last rank's is the sequence's final state).  The initial state is rank 0's ``state``
(default: ``init_state``); the other ranks' ``state`` is not read.

**Scan** (:func:`~.plan.parallel_plan` proved ``S_end = M S_0 + D`` with ``M`` on the key side):

1. rank 0 runs its shard from the initial state (its final state is the prefix rank 1 needs);
   ranks ``0 < r < P - 1`` run their shard twice in one batch -- from zeros (``D``) and from the
   identity with the values zeroed (``M``, ``ceil(K / V)`` copies of the batch for a ``[K, V]``
   state); the last rank's map is never read, so it sends zeros;
2. one all-gather of the flattened maps;
3. rank ``r`` folds ``S <- M_j S + D_j`` over ``j < r`` (the exclusive scan) into its true initial
   state, and runs its shard from it.

Backward is autograd through these steps: the all-gather's backward sums over ranks the gradient
of each rank's map.  **Relay**: rank ``r`` receives the whole state (open mini-batch chunks and
block positions included) from ``r - 1``, runs its shard, sends its final state to ``r + 1``; in
backward the state's gradient goes back the same way.

Gradients of what every rank holds alike -- the memory's parameters, rank 0's initial state -- are
each rank's part: sum them over ranks (DDP's all-reduce does) to get the one-process gradient.
Every rank must call backward when one does.
"""
from __future__ import annotations

import torch
from torch import nn

from . import comm
from .documents import run_documents
from .maps import Layout, attached, shard_bounds, shard_maps
from .plan import ParallelPlan, parallel_plan

_PLANS: dict = {}


def shard(x: torch.Tensor, group=None, dim: int = 1) -> torch.Tensor:
    """This rank's contiguous piece of ``x`` along ``dim`` (the tokens; a view)."""
    rank, size = comm.rank_and_size(group)
    a, b = shard_bounds(x.shape[dim], size)[rank]
    return x.narrow(dim, a, b - a)


def context_parallel(memory, *views, state=None, schedule="auto", cu_seqlens=None, group=None,
                     plan: ParallelPlan | None = None, spec=None, **named):
    """Run ``memory`` (a generated ``<Name>Memory``) over this rank's shard of one sequence.

    ``views``: positional in the memory's ``VIEWS`` order (or by name in ``named``), with the
    gates by name, each ``[B, T_r, H, ...]``; ``schedule``: as ``forward``'s; ``group``: the
    process group (default: the world); ``plan``: a :class:`~.plan.ParallelPlan` (default:
    :func:`~.plan.parallel_plan` of ``spec``, or of the memory, found once per class).
    Returns ``(o [B, T_r, H, ...], the state at the end of this rank's shard)``.

    ``cu_seqlens``: the offsets ``[N + 1]`` of packed documents in the whole row (B = 1; the same
    tensor on every rank); ``state`` is then ``[N, H, ...]`` on every rank, and the final state the
    rows of this rank's documents (:mod:`.documents`).
    """
    inputs = _inputs(memory, views, named)
    schedule = memory.DEFAULT_SCHEDULE if schedule == "auto" else schedule
    if plan is None or plan.schedule != schedule:
        key = (type(memory), schedule, id(spec) if spec is not None else None)
        if key not in _PLANS:
            _PLANS[key] = parallel_plan(spec if spec is not None else memory, schedule)
        plan = _PLANS[key]
    rank, size = comm.rank_and_size(group)
    if size == 1:   # one process (or none initialised): the memory itself
        return memory(**inputs, state=state, schedule=schedule, cu_seqlens=cu_seqlens)
    if cu_seqlens is not None:
        return run_documents(memory, inputs, state, cu_seqlens, schedule, plan, group, rank, size)
    go = _scan if plan.path == "scan" else _relay
    return go(memory, inputs, state, schedule, plan, group, rank, size)


class ContextParallel(nn.Module):
    """``memory`` over this rank's shard: ``forward(*views, state=None, **gates)`` is
    :func:`context_parallel` with this module's group, schedule and plan (:attr:`plan`)."""

    def __init__(self, memory, *, group=None, schedule="auto", spec=None):
        super().__init__()
        self.memory = memory
        self.group = group
        self.schedule = memory.DEFAULT_SCHEDULE if schedule == "auto" else schedule
        self.plan = parallel_plan(spec if spec is not None else memory, self.schedule)

    def forward(self, *views, state=None, cu_seqlens=None, **named):
        return context_parallel(self.memory, *views, state=state, schedule=self.schedule, cu_seqlens=cu_seqlens,
                                group=self.group, plan=self.plan, **named)


def _inputs(memory, views, named) -> dict:
    names = list(memory.VIEWS)
    if len(views) > len(names):
        raise ValueError(f"{type(memory).__name__} takes the views {', '.join(names)}; got {len(views)} positional")
    inputs = dict(zip(names, views))
    twice = sorted(set(inputs) & set(named))
    if twice:
        raise ValueError(f"view {', '.join(twice)} given both by position and by name")
    inputs.update(named)
    return inputs


# ------------------------------------------------------------------ the scan of state maps
def _scan(memory, inputs, state, schedule, plan, group, rank, size):
    layout = Layout(memory, plan, inputs)
    if rank == 0:
        o, final = memory(**inputs, state=state, schedule=schedule)
        piece = layout.flat(None, final)                     # M = 0: rank 1 starts from this final state
    elif rank < size - 1:
        piece = layout.flat(*shard_maps(memory, inputs, schedule, plan, layout))
    else:
        piece = layout.zeros()                               # the last map is read by no rank
    pieces = comm.all_gather(piece, group)
    if rank > 0:
        S = layout.unflat(pieces[0])[1]
        for j in range(1, rank):
            S = layout.apply(*layout.unflat(pieces[j]), S)
        o, final = memory(**inputs, state=S, schedule=schedule)
    return attached(memory, o, final, list(pieces))


# ------------------------------------------------------------------ the relay
def _relay(memory, inputs, state, schedule, plan, group, rank, size):
    like = next(iter(inputs.values()))
    if rank > 0:
        meta = comm.recv_object(rank - 1, group)            # [(name, shape, dtype) or (name, None, value)]
        shapes = [(s, d, like.device) for _, s, d in meta if s is not None]
        received = comm.recv(shapes, rank - 1, group) if shapes else []
        got = iter(received)
        state = {n: (next(got) if s is not None else d) for n, s, d in meta}
    o, final = memory(**inputs, state=state, schedule=schedule)
    # the received state stays in the graph even where nothing reads it: its backward sends the gradient back
    carried = list(received) if rank > 0 else []
    if rank < size - 1:
        meta = [(n, tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else (n, None, v)
                for n, v in final.items()]
        comm.send_object(meta, rank + 1, group)
        tensors = [v for v in final.values() if isinstance(v, torch.Tensor)]
        if tensors:
            token = comm.send(tensors, rank + 1, group)
            carried += [token] if token is not None else []
    return attached(memory, o, final, carried)
