"""Runtime helpers of the dual form with per-channel decays (memspec.codegen.dualchunk): the
recurrences of a chunk's coefficients and weights along its tokens, one decay per row, and of
the states from block to block."""
from __future__ import annotations

import torch

from .phases import _affine_steps


def _row_scan(a, x, dim):
    """s_i = a_i * s_(i-1) + x_i along the token axis, from s_(-1) = 0: a [..., d, C] one decay
    per row and token; x [..., d, C] (dim -1) or [..., d, C, C'] (dim -2), or anything that
    broadcasts to it (a number, a scalar row [..., 1, C, C']).  Exact products (no ratios of
    cumulative products), one step per token of the block.  Weights (dim -2) are stored
    token-major, [..., C, d, C'] seen as [..., d, C, C'] (the layout the reads contract)."""
    if dim == -2:
        a = a.unsqueeze(-1)
    if not isinstance(x, torch.Tensor):
        x = torch.full_like(a, float(x))
    shape = torch.broadcast_shapes(x.shape, a.shape)
    x = x.expand(shape)
    out = _affine_steps(x.unbind(dim), a.unbind(dim), None)   # unbind and one stack
    return torch.stack(out, -3).transpose(-3, -2) if dim == -2 else torch.stack(out, -1)


def _block_scan(a, x, s0):
    """s_b = a_b * s_(b-1) + x_b over the blocks b of a chunk, from s0: a [B, H, nb] (or [B, H,
    nb, d], one factor per row, or a number), x [B, H, nb, *shape], s0 [B, H, *shape] ->
    (the state at each block's start [B, H, nb, *shape], the state after the last block)."""
    if not isinstance(a, torch.Tensor):
        a = torch.full(x.shape[:3], float(a), dtype=x.dtype, device=x.device)
    a = a.reshape(a.shape + (1,) * (x.dim() - a.dim()))
    ends = _affine_steps(x.unbind(2), a.unbind(2), s0)
    return torch.stack([s0] + ends[:-1], 2), ends[-1]
