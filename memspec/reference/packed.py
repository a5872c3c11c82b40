"""Packed documents in the reference interpreter (flash-linear-attention's ``cu_seqlens``): the
offsets checked, and each document run alone from its own row of the initial state."""
from __future__ import annotations

from typing import Any

import torch

from ..lang.spec import Spec
from .inputs import check_inputs, full_state, learned_params
from .tokens import run_sequence


def document_bounds(cu_seqlens: Any, B: int, T: int) -> list[tuple[int, int]]:
    """The ``(start, end)`` of each packed document, from offsets ``[N + 1]`` (checked: a 1-D
    integer tensor from 0 to T, never decreasing, over a batch of one row)."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point() \
            or cu_seqlens.dtype == torch.bool or cu_seqlens.numel() < 2:
        got = (f"{cu_seqlens.dtype} {list(cu_seqlens.shape)}" if isinstance(cu_seqlens, torch.Tensor)
               else type(cu_seqlens).__name__)
        raise ValueError(f"cu_seqlens must be an integer tensor of offsets [N + 1] (0, ..., T), got {got}")
    if B != 1:
        raise ValueError(f"cu_seqlens packs the documents into one row: B must be 1, got B = {B}")
    offsets = [int(x) for x in cu_seqlens.tolist()]
    if offsets[0] != 0 or offsets[-1] != T or any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to T = {T} without decreasing, got {offsets}")
    return list(zip(offsets[:-1], offsets[1:]))


def run_documents(spec: Spec, state: dict | None, schedule: Any, params: dict | None,
                  cu_seqlens: torch.Tensor, inputs: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`~memspec.reference.run` over packed documents: each runs alone from row i of ``state`` ``[N, H, ...]``;
    outputs are concatenated along T, final states stacked ``[N, H, ...]``; a cache that the
    documents leave at different lengths (no one ``[N, H, n, ...]`` tensor) is left out."""
    B, T, H, dtype, device = check_inputs(spec, inputs)
    bounds = document_bounds(cu_seqlens, B, T)
    N = len(bounds)
    full = full_state(spec, state, N, H, dtype, device, learned_params(spec, params, H, dtype, device))
    outs, finals = [], []
    for i, (a, b) in enumerate(bounds):
        row = {n: t[i:i + 1] for n, t in full.items()}
        if b == a:
            finals.append(row)
            continue
        o, s = run_sequence(spec, row, schedule, params, {n: x[:, a:b] for n, x in inputs.items()})
        outs.append(o)
        finals.append(s)
    final = {}
    for name in full:   # a cache whose documents end at different lengths is left out
        if len({tuple(f[name].shape) for f in finals}) == 1:
            final[name] = torch.cat([f[name] for f in finals], dim=0)
    return torch.cat(outs, dim=1), final
