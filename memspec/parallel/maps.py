"""Shards and state maps for :mod:`memspec.parallel`: the shard of each rank, the layout of one rank's
``(M, D)`` (flattened for one all-gather), the map of a shard read off the memory, ``S <- M S + D``."""
from __future__ import annotations

import math

import torch

from . import comm
from .plan import ParallelPlan


def shard_bounds(T: int, size: int) -> list[tuple[int, int]]:
    """The ``(start, end)`` of each rank's contiguous shard of T tokens (lengths differ by at most one)."""
    return [(r * T // size, (r + 1) * T // size) for r in range(size)]


def attached(memory, o, final: dict, carried: list) -> tuple:
    """``(o, final)`` with ``carried`` and the memory's parameters in their graph (:func:`.comm.attach`):
    a rank that never reads the learned initial state still gives it a (zero) gradient, as DDP
    expects of every parameter on every rank."""
    names = [n for n, v in final.items() if isinstance(v, torch.Tensor)]
    params = [p for p in memory.parameters() if p.requires_grad]
    out = comm.attach([o] + [final[n] for n in names], carried + params)
    return out[0], {**final, **dict(zip(names, out[1:]))}


class Layout:
    """The states of a plan's groups: sizes, the flattened ``(M, D)`` of one rank, ``S <- M S + D``."""

    def __init__(self, memory, plan: ParallelPlan, inputs: dict):
        x = next(iter(inputs.values()))
        self.B, self.H = x.shape[0], memory.heads
        self.dims = {n: tuple(getattr(memory, d) for d in shape) for n, shape in memory.STATE.items()}   # declared
        self.flip = set(plan.transposed)   # states held as written, mapped as their transpose [K, V]
        self.kv = {n: d[::-1] if n in self.flip else d for n, d in self.dims.items()}
        self.groups = plan.groups
        self.rows = [sum(self.kv[s][0] for s in g.states) for g in plan.groups]   # sum K per group
        self.cols = [self.kv[g.states[0]][-1] for g in plan.groups]               # V per group
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

    def to_kv(self, s, x):
        """A state as written -> as mapped ``[..., K, V]`` (its transpose for a value-side state); and back."""
        return x.transpose(-1, -2) if s in self.flip else x

    def apply(self, Ms, D: dict, S: dict) -> dict:
        out = {}
        for g, M in zip(self.groups, Ms):
            X = torch.cat([self.to_kv(s, S[s]) for s in g.states], dim=-2) if len(g.states) > 1 \
                else self.to_kv(g.states[0], S[g.states[0]])
            Y = M @ X                                                           # [B, H, sum K, V]
            for s, y in zip(g.states, Y.split([self.kv[s][0] for s in g.states], dim=-2)):
                out[s] = self.to_kv(s, y) + D[s]
            for s in g.sharing:                                                 # its M, its own D
                z = self.to_kv(s, S[s])
                out[s] = self.to_kv(s, (M @ z.unsqueeze(-1)).squeeze(-1) if z.dim() == 3 else M @ z) + D[s]
        return out


def shard_maps(memory, inputs, schedule, plan, layout: Layout):
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
            k = layout.kv[s][0]
            for j in range(n):
                S0[s][B * (1 + j):B * (2 + j)] = layout.to_kv(s, eye[top:top + k, j * V:(j + 1) * V])
            top += k
    _, final = memory(**batch, state=S0, schedule=schedule)
    D = {s: final[s][:B] for s in layout.names}
    Ms = []
    for g, K in zip(plan.groups, layout.rows):
        cols = [torch.cat([layout.to_kv(s, final[s][B * (1 + j):B * (2 + j)]) for s in g.states], dim=-2)
                for j in range(n)]
        Ms.append((torch.cat(cols, dim=-1) if n > 1 else cols[0])[..., :K].to(layout.dtype))   # [B, H, K, K]
    return Ms, D
