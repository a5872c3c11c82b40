"""Runtime helper of the dual form with per-channel decays (memspec.codegen.dualchunk): the
recurrence of a chunk's coefficients and weights along its tokens, one decay per row."""
from __future__ import annotations

import torch


def _row_scan(a, x, dim):
    """s_i = a_i * s_(i-1) + x_i along the token axis, from s_(-1) = 0: a [..., d, C] one decay
    per row and token; x [..., d, C] (dim -1) or [..., d, C, C'] (dim -2), or anything that
    broadcasts to it (a number, a scalar row [..., 1, C, C']).  Exact products (no ratios of
    cumulative products), one step per token of the block."""
    if dim == -2:
        a = a.unsqueeze(-1)
    if not isinstance(x, torch.Tensor):
        x = torch.full_like(a, float(x))
    x = x.expand(torch.broadcast_shapes(x.shape, a.shape))
    out, s = [], None
    for i in range(x.shape[dim]):
        xi = x.select(dim, i)
        s = xi if s is None else a.select(dim, i) * s + xi
        out.append(s)
    if dim == -2:   # weights [..., d, C, C'] stored token-major [..., C, d, C'] (the layout the reads contract)
        return torch.stack(out, -3).transpose(-3, -2)
    return torch.stack(out, dim)


def _block_scan(a, x, s0):
    """s_b = a_b * s_(b-1) + x_b over the blocks b of a chunk, from s0: a [B, H, nb] (or [B, H,
    nb, d], one factor per row, or a number), x [B, H, nb, *shape], s0 [B, H, *shape] ->
    [B, H, nb, *shape], the state at each block's end."""
    if not isinstance(a, torch.Tensor):
        a = torch.full(x.shape[:3], float(a), dtype=x.dtype, device=x.device)
    a = a.reshape(a.shape + (1,) * (x.dim() - a.dim()))
    out, s = [], s0
    for b in range(x.shape[2]):
        s = a[:, :, b] * s + x[:, :, b]
        out.append(s)
    return torch.stack(out, 2)
