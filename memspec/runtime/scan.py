"""Exact chunked kernel of the scan family (elementwise linear recurrences), and its token-loop reference.

See :mod:`memspec.runtime` for the rules every kernel here follows (standalone, torch only,
float32 arithmetic, causal: no future value reaches an earlier output).
"""
from __future__ import annotations

import torch


def recurrent_scan(a, b, h0):
    """Token-loop reference for ``h_t = a_t * h_{t-1} + b_t`` (elementwise).

    Args:
        a: decays broadcastable to b (``[B, T, H, *S]``, or without the batch and time axes).
        b: ``[B, T, H, *S]`` increments.
        h0: ``[B, H, *S]`` initial state, or None for zeros.

    Returns:
        (every token's state ``[B, T, H, *S]``, h_T ``[B, H, *S]``).
    """
    dt = torch.promote_types(b.dtype, torch.float32)
    a = a.to(dt).expand(b.shape)
    h = b.new_zeros(b.shape[:1] + b.shape[2:], dtype=dt) if h0 is None else h0.to(dt)
    states = []
    for t in range(b.shape[1]):
        h = a[:, t] * h + b[:, t].to(dt)
        states.append(h)
    hs = torch.stack(states, dim=1) if states else b.new_zeros(b.shape, dtype=dt)
    return hs.to(b.dtype), h.to(h0.dtype if h0 is not None else b.dtype)


def chunk_scan(a, b, h0, chunk):
    """Exact chunked form of ``h_t = a_t * h_{t-1} + b_t`` (elementwise, any state shape ``S``).

    The T tokens are cut into N chunks of C (the last one padded with tokens ``a = 1, b = 0``,
    which follow every real token and change nothing).  All chunks run at once:

    * within each chunk, from a zero state, ``u_i = a_i * u_{i-1} + b_i`` for i = 1..C: C
      elementwise steps, each over every chunk ``[B, N, H, *S]``;
    * the cumulative decays ``P_i = a_1 ... a_i`` of every chunk (``cumprod``);
    * one carry per chunk: ``c_j = P_C(j) * c_{j-1} + u_C(j)`` for j = 1..N, from ``c_0 = h0``;
    * every token's state ``h_i(j) = u_i(j) + P_i(j) * c_{j-1}``.

    Work and memory are O(T |S|), C + N Python steps.  Only products of decays enter (no
    division, no log), so a decay of any sign, of exp(-40) per token or exactly 0 is exact
    (equal to the token loop up to rounding), and nothing overflows that the loop does not.
    A non-finite input at token t reaches only the states from t on.  Plain autograd (the
    gradients are those of the loop's operations); ``torch.func`` works (no in-place writes).

    Args:
        a: decays, broadcastable to b: ``[B, T, H, *S]`` or with size-1 axes (a scalar per
            token ``[B, T, H, 1, ...]``, one per row ``[..., d, 1]``), or without the batch and
            time axes (a learned decay ``[H, *S]``).
        b: ``[B, T, H, *S]`` increments.
        h0: ``[B, H, *S]`` initial state, or None for zeros.
        chunk: chunk size C.

    Returns:
        (every token's state ``[B, T, H, *S]``, h_T ``[B, H, *S]``); T = 0 gives an empty
        sequence and h0.
    """
    B, T = b.shape[:2]
    rest = b.shape[2:]                                               # [H, *S]
    dt = torch.promote_types(b.dtype, torch.float32)
    h = b.new_zeros((B,) + rest, dtype=dt) if h0 is None else h0.to(dt)
    out_dtype = h0.dtype if h0 is not None else b.dtype
    if T == 0:
        return b.new_zeros(b.shape), h.to(out_dtype)
    C = max(1, min(int(chunk), T))
    N = -(-T // C)
    pad = N * C - T
    a = a.to(dt).expand(b.shape)
    b = b.to(dt)
    if pad:                                                          # tail tokens a = 1, b = 0
        a = torch.cat([a, a.new_ones((B, pad) + rest)], dim=1)
        b = torch.cat([b, b.new_zeros((B, pad) + rest)], dim=1)
    a = a.reshape((B, N, C) + rest)                                  # [B, N, C, H, *S]
    b = b.reshape((B, N, C) + rest)
    u = [b[:, :, 0]]                                                 # [B, N, H, *S] per position
    for i in range(1, C):
        u.append(torch.addcmul(b[:, :, i], a[:, :, i], u[-1]))
    P = torch.cumprod(a, dim=2)                                      # [B, N, C, H, *S] decays from the chunk start
    starts = []
    for j in range(N):                                               # one carry per chunk
        starts.append(h)
        h = torch.addcmul(u[-1][:, j], P[:, j, -1], h)               # [B, H, *S]
    carry = torch.stack(starts, dim=1).unsqueeze(2)                  # [B, N, 1, H, *S] chunk-start states
    hs = torch.stack(u, dim=2).addcmul(P, carry)                     # [B, N, C, H, *S]
    hs = hs.reshape((B, N * C) + rest)
    return hs[:, :T].to(out_dtype) if pad else hs.to(out_dtype), h.to(out_dtype)
