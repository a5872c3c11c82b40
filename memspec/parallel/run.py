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

import math

import torch
from torch import nn

from . import comm
from .plan import ParallelPlan, parallel_plan

_PLANS: dict = {}


def shard_bounds(T: int, size: int) -> list[tuple[int, int]]:
    """The ``(start, end)`` of each rank's contiguous shard of T tokens (lengths differ by at most one)."""
    return [(r * T // size, (r + 1) * T // size) for r in range(size)]


def shard(x: torch.Tensor, group=None, dim: int = 1) -> torch.Tensor:
    """This rank's contiguous piece of ``x`` along ``dim`` (the tokens; a view)."""
    rank, size = comm.rank_and_size(group)
    a, b = shard_bounds(x.shape[dim], size)[rank]
    return x.narrow(dim, a, b - a)


def context_parallel(memory, *views, state=None, schedule="auto", group=None, plan: ParallelPlan | None = None,
                     spec=None, **named):
    """Run ``memory`` (a generated ``<Name>Memory``) over this rank's shard of one sequence.

    ``views``: positional in the memory's ``VIEWS`` order (or by name in ``named``), with the
    gates by name, each ``[B, T_r, H, ...]``; ``schedule``: as ``forward``'s; ``group``: the
    process group (default: the world); ``plan``: a :class:`~.plan.ParallelPlan` (default:
    :func:`~.plan.parallel_plan` of ``spec``, or of the memory, found once per class).
    Returns ``(o [B, T_r, H, ...], the state at the end of this rank's shard)``.
    """
    inputs = _inputs(memory, views, named)
    schedule = memory.DEFAULT_SCHEDULE if schedule == "auto" else schedule
    if plan is None or plan.schedule != schedule:
        key = (type(memory), schedule, id(spec) if spec is not None else None)
        if key not in _PLANS:
            _PLANS[key] = parallel_plan(spec if spec is not None else memory, schedule)
        plan = _PLANS[key]
    rank, size = comm.rank_and_size(group)
    if size == 1:
        return memory(**inputs, state=state, schedule=schedule)
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

    def forward(self, *views, state=None, **named):
        return context_parallel(self.memory, *views, state=state, schedule=self.schedule, group=self.group,
                                plan=self.plan, **named)


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


def _attached(o, final: dict, carried: list) -> tuple:
    names = [n for n, v in final.items() if isinstance(v, torch.Tensor)]
    out = comm.attach([o] + [final[n] for n in names], carried)
    return out[0], {**final, **dict(zip(names, out[1:]))}


# ------------------------------------------------------------------ the scan of state maps
def _scan(memory, inputs, state, schedule, plan, group, rank, size):
    layout = _Layout(memory, plan, inputs)
    if rank == 0:
        o, final = memory(**inputs, state=state, schedule=schedule)
        piece = layout.flat(None, final)                     # M = 0: rank 1 starts from this final state
    elif rank < size - 1:
        piece = layout.flat(*_maps(memory, inputs, schedule, plan, layout))
    else:
        piece = layout.zeros()                               # the last map is read by no rank
    pieces = comm.all_gather(piece, group)
    if rank > 0:
        S = layout.unflat(pieces[0])[1]
        for j in range(1, rank):
            S = layout.apply(*layout.unflat(pieces[j]), S)
        o, final = memory(**inputs, state=S, schedule=schedule)
    return _attached(o, final, list(pieces))


class _Layout:
    """The states of a plan's groups: sizes, the flattened ``(M, D)`` of one rank, ``S <- M S + D``."""

    def __init__(self, memory, plan: ParallelPlan, inputs: dict):
        x = next(iter(inputs.values()))
        self.B, self.H = x.shape[0], memory.heads
        self.dims = {n: tuple(getattr(memory, d) for d in shape) for n, shape in memory.STATE.items()}
        self.groups = plan.groups
        self.rows = [sum(self.dims[s][0] for s in g.states) for g in plan.groups]   # sum K per group
        self.cols = [self.dims[g.states[0]][-1] for g in plan.groups]               # V per group
        self.copies = max(math.ceil(k / v) for k, v in zip(self.rows, self.cols))
        self.names = [s for g in plan.groups for s in g.states + g.sharing]
        # the dtype of the states (the memory's: float32 for float16 / bfloat16 views)
        self.dtype = memory.state_dtype or (torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype)
        self.device = x.device

    def _shapes(self):
        lead = (self.B, self.H)
        return ([lead + (k, k) for k in self.rows], [lead + self.dims[n] for n in self.names])

    def flat(self, Ms, D: dict) -> torch.Tensor:
        m_shapes, _ = self._shapes()
        Ms = Ms if Ms is not None else [torch.zeros(s, dtype=self.dtype, device=self.device) for s in m_shapes]
        parts = [m.reshape(-1) for m in Ms] + [D[n].to(self.dtype).reshape(-1) for n in self.names]
        return torch.cat(parts)

    def zeros(self) -> torch.Tensor:
        m_shapes, d_shapes = self._shapes()
        return torch.zeros(sum(math.prod(s) for s in m_shapes + d_shapes), dtype=self.dtype, device=self.device)

    def unflat(self, piece: torch.Tensor):
        m_shapes, d_shapes = self._shapes()
        sizes = [math.prod(s) for s in m_shapes + d_shapes]
        parts = [p.reshape(s) for p, s in zip(piece.split(sizes), m_shapes + d_shapes)]
        return parts[:len(m_shapes)], dict(zip(self.names, parts[len(m_shapes):]))

    def apply(self, Ms, D: dict, S: dict) -> dict:
        out = {}
        for g, M in zip(self.groups, Ms):
            X = torch.cat([S[s] for s in g.states], dim=-2) if len(g.states) > 1 else S[g.states[0]]
            Y = M @ X                                                           # [B, H, sum K, V]
            for s, y in zip(g.states, Y.split([self.dims[s][0] for s in g.states], dim=-2)):
                out[s] = y + D[s]
            for s in g.sharing:                                                 # its M, its own D
                z = S[s]
                out[s] = ((M @ z.unsqueeze(-1)).squeeze(-1) if z.dim() == 3 else M @ z) + D[s]
        return out


def _maps(memory, inputs, schedule, plan, layout: _Layout):
    """This rank's ``(M per group, D)``: its shard from zeros and, in the same batch, from the columns
    of the identity with the values zeroed."""
    B, n = layout.B, layout.copies
    batch = {}
    for name, x in inputs.items():
        copies = [x] + [torch.zeros_like(x) if name in plan.values else x] * n
        batch[name] = torch.cat(copies, dim=0)                                  # [B (1 + n), T_r, ...]
    S0 = {s: torch.zeros((B * (1 + n), layout.H) + d, dtype=layout.dtype, device=layout.device)
          for s, d in layout.dims.items()}
    for g, K, V in zip(plan.groups, layout.rows, layout.cols):
        eye = torch.eye(K, n * V, dtype=layout.dtype, device=layout.device)     # [sum K, n V]
        top = 0
        for s in g.states:
            k = layout.dims[s][0]
            for j in range(n):
                S0[s][B * (1 + j):B * (2 + j)] = eye[top:top + k, j * V:(j + 1) * V]
            top += k
    _, final = memory(**batch, state=S0, schedule=schedule)
    D = {s: final[s][:B] for s in layout.names}
    Ms = []
    for g, K in zip(plan.groups, layout.rows):
        cols = [torch.cat([final[s][B * (1 + j):B * (2 + j)] for s in g.states], dim=-2) if len(g.states) > 1
                else final[g.states[0]][B * (1 + j):B * (2 + j)] for j in range(n)]
        Ms.append((torch.cat(cols, dim=-1) if n > 1 else cols[0])[..., :K].to(layout.dtype))   # [B, H, K, K]
    return Ms, D


# ------------------------------------------------------------------ the relay
def _relay(memory, inputs, state, schedule, plan, group, rank, size):
    like = next(iter(inputs.values()))
    if rank > 0:
        meta = comm.recv_object(rank - 1, group)            # [(name, shape, dtype) or (name, None, value)]
        shapes = [(s, d, like.device) for _, s, d in meta if s is not None]
        got = iter(comm.recv(shapes, rank - 1, group)) if shapes else iter(())
        state = {n: (next(got) if s is not None else d) for n, s, d in meta}
    o, final = memory(**inputs, state=state, schedule=schedule)
    carried = []
    if rank < size - 1:
        meta = [(n, tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else (n, None, v)
                for n, v in final.items()]
        comm.send_object(meta, rank + 1, group)
        tensors = [v for v in final.values() if isinstance(v, torch.Tensor)]
        if tensors:
            token = comm.send(tensors, rank + 1, group)
            carried = [token] if token is not None else []
    return _attached(o, final, carried)
