"""The chained family's own kernel: an additive state whose decay acts on its *columns* (the
output channels of its probe), ``S_t = S_{t-1} Diag(exp(g_t)) + outer(k_t, w_t)`` read
``o_t = q_t @ S_t`` -- gated slot attention's first memory (``K̃ <- K̃ Diag(alpha) + k (1 - alpha)ᵀ``,
probed ``q @ K̃``); flash-linear-attention's GLA kernels call this decay ``gv``.  A decay on the
rows (the key side) is :func:`memspec.runtime.additive.chunk_additive`'s.
"""
from __future__ import annotations

import torch

from .phases import _pass_states


def recurrent_value_decay(q, k, w, log_decay, S0, inclusive=True):
    """Token loop of ``S_t = S_{t-1} Diag(exp(log_decay_t)) + outer(k_t, w_t)``, ``o_t = q_t @ S_t``
    (``inclusive=False``: ``q_t @ S_{t-1}``): the oracle of :func:`chunk_value_decay`.

    Args: q, k ``[B, T, H, K]``; w, log_decay ``[B, T, H, V]``; S0 ``[B, H, K, V]`` or None.
    Returns: (o ``[B, T, H, V]``, the final state ``[B, H, K, V]``)."""
    B, T, H, K = k.shape
    S = k.new_zeros(B, H, K, w.shape[-1]) if S0 is None else S0
    outs = []
    for t in range(T):
        before = S
        S = S * torch.exp(log_decay[:, t]).unsqueeze(-2) + k[:, t].unsqueeze(-1) * w[:, t].unsqueeze(-2)
        outs.append((q[:, t].unsqueeze(-2) @ (S if inclusive else before)).squeeze(-2))
    return torch.stack(outs, 1), S


def chunk_value_decay(q, k, w, log_decay, S0, chunk, inclusive=True):
    """Exact chunked form of ``S_t = S_{t-1} Diag(exp(log_decay_t)) + outer(k_t, w_t)``,
    ``o_t = q_t @ S_t``: the decay on the columns of S, so every pair of tokens has its own weight
    per output channel, ``o_t = sum_{s <= t} (q_t . k_s) exp(L_t - L_s) * w_s`` (``L`` the
    cumulative log decays, per channel).

    Inside a chunk of ``chunk`` tokens (rounded down to a power of two; a shorter tail is padded
    with zero tokens), with ``L`` the cumulative log decays from the chunk's start (``Lq = L``, or
    ``L_{t-1}`` and pairs ``s < t`` when ``inclusive=False``):

    * the chunk-start state: ``(q_t @ S_start) * exp(Lq_t)``;
    * the pairs ``s < t``, level by level: the chunk is halved into blocks of 2h tokens, and a
      pair (t in a block's second half, s in its first, ``R`` the log decay at the first half's
      end) weighs ``exp(Lq_t - R) * exp(R - L_s)``: the block's scores ``q_t . k_s`` (from one
      ``q kᵀ`` per chunk) times ``w_s * exp(R - L_s)``, one batched matmul per level (elementwise
      for blocks of 2 and 4 tokens), scaled by ``exp(Lq_t - R)``; the pairs s = t (inclusive)
      weigh 1;
    * the next chunk's state: ``S_start Diag(exp(L_C)) + kᵀ (w * exp(L_C - L_s))``.

    Chunks are processed G at a time (G chosen so that each temporary stays near 512 KB in float32:
    larger per-call allocations are returned to the OS and page-faulted back on every call), the
    carried state passing from group to group.

    Every exponent is a decay from an earlier point to a later one (``<= 0``): nothing
    overflows, finite for any finite log decays (-40 per token and below), and no ``[C, C, V]``
    tensor is formed.  No pair with s > t enters any product, so a NaN or inf in token t's inputs
    changes no output before t (its scores with earlier queries are computed, then never read).

    Args:
        q: ``[B, T, H, K]`` probes, or None (the final state only).
        k: ``[B, T, H, K]``; w: ``[B, T, H, V]``.
        log_decay: ``[B, T, H, V]`` log decays (<= 0) of the state's columns.
        S0: ``[B, H, K, V]`` initial state, or None for zeros.
        chunk: tokens per chunk.
    Returns: (o ``[B, T, H, V]`` or None, the final state ``[B, H, K, V]``).
    """
    B, T, H, K = k.shape
    V = w.shape[-1]
    C = 1 << (max(int(chunk), 1).bit_length() - 1)   # a power of two (chunk rounded down)
    N = -(-T // C)
    G = max(1, (1 << 17) // (B * H * C * max(K, V, C)))   # chunks per group: temporaries near 512 KB in float32
    S = k.new_zeros(B, H, K, V) if S0 is None else S0.to(k.dtype)
    outs = []

    def blocks(x, t0, t1, n):  # tokens t0..t1 of [B, T, H, D] -> [B, H, n, C, D], a short tail padded with zeros
        x = x[:, t0:t1].transpose(1, 2)
        if n * C > t1 - t0:
            x = torch.nn.functional.pad(x, (0, 0, 0, n * C - (t1 - t0)))
        return x.reshape(B, H, n, C, x.shape[-1])

    for c0 in range(0, N, G):
        t0, t1 = c0 * C, min(T, (c0 + G) * C)
        n = -(-(t1 - t0) // C)
        kb, wb, gb = (blocks(x, t0, t1, n) for x in (k, w, log_decay))
        L = gb.cumsum(-2)                                        # [B, H, n, C, V] from the chunk's start
        end = L[..., -1:, :]                                     # [B, H, n, 1, V]
        inc = kb.transpose(-1, -2) @ (wb * torch.exp(end - L))   # [B, H, n, K, V] each chunk's own writes
        decay = torch.exp(end.squeeze(-2))                       # [B, H, n, V] the chunk's decay of S
        S, starts, _ = _pass_states(lambda j, S: (torch.addcmul(inc[:, :, j], S, decay[:, :, j].unsqueeze(-2)), None),
                                    n, S)
        if q is not None:
            outs.append(_value_decay_reads(blocks(q, t0, t1, n), kb, wb, L, torch.stack(starts, 2), inclusive))
    if q is None:
        return None, S
    if not outs:   # T = 0
        return w.new_zeros(B, 0, H, V), S
    return torch.cat(outs, 2)[:, :, :T].transpose(1, 2), S


def _value_decay_reads(qb, kb, wb, L, starts, inclusive):
    """The outputs of :func:`chunk_value_decay` for chunks ``[B, H, n, C, *]`` (probes ``qb``, keys
    ``kb``, values ``wb``, cumulative log decays ``L``, the chunk-start states ``starts``
    ``[B, H, n, K, V]``): ``[B, H, n C, V]``."""
    B, H, n, C, V = wb.shape
    Lq = L if inclusive else torch.cat([torch.zeros_like(L[..., :1, :]), L[..., :-1, :]], -2)   # through t - 1
    o = (qb @ starts) * torch.exp(Lq)                        # [B, H, n, C, V] the chunk-start states
    A = qb @ kb.transpose(-1, -2)                            # [B, H, n, C, C] scores q_t . k_s
    h = 1
    while h < C:   # pairs across the halves of blocks of 2h tokens, R the log decay at the first half's end
        nb = C // (2 * h)
        Lh, Lqh, wh = (x.reshape(B, H, n, nb, 2, h, V) for x in (L, Lq, wb))
        R = Lh[..., 0, h - 1:, :]                                            # [B, H, n, nb, 1, V]
        # the scores of t in the second half with s in the first: [B, H, n, nb, h, h]
        scores = A.reshape(B, H, n, nb, 2 * h, nb, 2 * h).diagonal(dim1=3, dim2=5)[..., h:, :h, :].movedim(-1, 3)
        first = wh[..., 0, :, :] * torch.exp(R - Lh[..., 0, :, :])           # [B, H, n, nb, h, V]
        if h <= 2:   # a few pairs per block: elementwise beats a batched matmul of tiny matrices
            out = (scores.unsqueeze(-1) * first.unsqueeze(-3)).sum(-2)
        else:
            out = scores @ first
        o.view(B, H, n, nb, 2, h, V)[..., 1, :, :] += out * torch.exp(Lqh[..., 1, :, :] - R)
        h *= 2
    if inclusive:   # the pairs s = t weigh 1
        o = o + (qb * kb).sum(-1, keepdim=True) * wb
    return o.reshape(B, H, n * C, V)
