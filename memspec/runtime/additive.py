"""Exact chunked kernel of the additive family, and its token-loop reference.

See :mod:`memspec.runtime` for the rules every kernel here follows (standalone, torch only,
log decays, float32 arithmetic, groups of chunks).
"""
from __future__ import annotations

import torch


def recurrent_additive(q, k, v, log_gamma, S0, inclusive=True):
    """Token-loop reference for ``S_t = exp(log_gamma_t) S_{t-1} + outer(k_t, v_t)``, ``o_t = q_t @ S_t``.

    Args:
        q: ``[B, T, H, K]`` probes, or None (state only).
        k: ``[B, T, H, K]``; v: ``[B, T, H, V]``.
        log_gamma: ``[B, T, H]`` log decays (<= 0), or None for no decay.
        S0: ``[B, H, K, V]`` initial state, or None for zeros.
        inclusive: True: o_t reads S_t (write, then read); False: o_t reads S_{t-1}.

    Returns:
        (o ``[B, T, H, V]`` or None, S_T ``[B, H, K, V]``).
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    dt = torch.promote_types(k.dtype, torch.float32)
    S = k.new_zeros(B, H, K, V, dtype=dt) if S0 is None else S0.to(dt)
    outs = []
    for t in range(T):
        S_prev = S
        if log_gamma is not None:
            S = torch.exp(log_gamma[:, t].to(dt))[:, :, None, None] * S
        S = S + k[:, t].to(dt)[..., :, None] * v[:, t].to(dt)[..., None, :]   # [B, H, K, V]
        if q is not None:
            read = S if inclusive else S_prev
            outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t].to(dt), read))
    o = torch.stack(outs, dim=1).to(v.dtype) if q is not None else None
    return o, S.to(S0.dtype if S0 is not None else v.dtype)


def chunk_additive(q, k, v, log_gamma, S0, chunk, inclusive=True, group=None):
    """Exact chunked form of ``S_t = exp(log_gamma_t) S_{t-1} + outer(k_t, v_t)``, ``o_t = q_t @ S_t``.

    Inside a chunk of C tokens with cumulative log decays ``L_t``:
    ``o_t = exp(L_t) q_t @ S_start + sum_{s <= t} exp(L_t - L_s) (q_t . k_s) v_s`` and
    ``S_end = exp(L_C) S_start + sum_s exp(L_C - L_s) outer(k_s, v_s)``.
    (``inclusive=False`` uses ``L_{t-1}`` and ``s < t``: o_t reads the state before token t.)

    Chunks are processed G at a time (on CPU, G is chosen so that each temporary stays near
    512 KB: large per-call allocations are returned to the OS and page-faulted back on every
    call; on other devices G = 64).
    Within a group of n chunks every product is one batched matmul over (B, H, chunk):
    the masked intra-chunk scores, the chunk increments ``K_j^T V_j``, and the states at
    the chunk starts, ``S_j = w_j S + sum_{i<j} W_ji K_i^T V_i``, as one ``[n, n]``
    lower-triangular (decay-weighted) matrix applied to the increments; no loop over
    tokens or chunks inside a group.

    Args:
        q: ``[B, T, H, K]`` probes, or None (state only).
        k: ``[B, T, H, K]``; v: ``[B, T, H, V]``, or a tuple of ``[B, T, H, V_i]`` read as their
            concatenation on the last axis (``V = sum V_i``) without a full-size copy.
        log_gamma: ``[B, T, H]`` log decays (<= 0), or None for no decay.
        S0: ``[B, H, K, V]`` initial state, or None for zeros.
        chunk: chunk size C.
        inclusive: True: o_t reads S_t; False: o_t reads S_{t-1}.
        group: chunks per batched group G (default: as above); any G >= 1
            gives the same numbers.

    Returns:
        (o ``[B, T, H, V]`` or None, S_T ``[B, H, K, V]``).
    """
    B, T, H, K = k.shape
    vs = tuple(v) if isinstance(v, (tuple, list)) else (v,)
    V = sum(x.shape[-1] for x in vs)
    BH = B * H
    dt = torch.promote_types(k.dtype, torch.float32)
    C = max(1, min(int(chunk), T))
    N, r = divmod(T, C)
    if group is not None:
        G = int(group)
    elif k.device.type == "cpu":   # temporaries near 512 KB (float32): no page faults per call
        G = round((1 << 17) / (BH * C * max(K, V, C)))
    else:                          # caching allocators: fewer, larger launches; the [G, G] prefix stays small
        G = 64
    G = max(1, min(N, G))                                            # chunks per group
    kk, vv = k.to(dt), tuple(x.to(dt) for x in vs)                   # no copies in float32
    qq = q.to(dt) if q is not None else None
    lg = log_gamma.to(dt) if log_gamma is not None else None
    S = k.new_zeros(BH, K * V, dtype=dt) if S0 is None else S0.to(dt).reshape(BH, K * V)
    idx = torch.arange(C, device=k.device)
    read_mask = idx[:, None] >= idx[None, :] if inclusive else idx[:, None] > idx[None, :]   # [C, C]
    gidx = torch.arange(G, device=k.device)
    strict = gidx[:, None] > gidx[None, :]                                                   # [G, G]

    def block(x, a, n, c):  # tokens [a, a + n c) of [B, T, H, D] -> [B H n, c, D] (one copy)
        return x[:, a:a + n * c].reshape(B, n, c, H, x.shape[-1]).permute(0, 3, 1, 2, 4).reshape(BH * n, c, -1)

    def block_cat(xs, a, n, c):  # the blocks of several [B, T, H, D_i] side by side: [B H n, c, sum D_i]
        if len(xs) == 1:
            return block(xs[0], a, n, c)
        out = xs[0].new_empty(B, H, n, c, V)
        lo = 0
        for x in xs:
            d = x.shape[-1]
            out[..., lo:lo + d] = x[:, a:a + n * c].reshape(B, n, c, H, d).permute(0, 3, 1, 2, 4)
            lo += d
        return out.view(BH * n, c, V)

    groups = [(j * C, min(G, N - j), C) for j in range(0, N, G)] + ([(N * C, 1, r)] if r else [])
    lower = {}                                                       # n -> [BH, n, n] strictly lower ones
    outs = []
    for a, n, c in groups:
        kg, vg = block(kk, a, n, c), block_cat(vv, a, n, c)         # [BHn, c, K], [BHn, c, V]
        if lg is not None:
            lgg = lg[:, a:a + n * c].reshape(B, n, c, H).permute(0, 3, 1, 2)   # [B, H, n, c]
            L = torch.cumsum(lgg, dim=-1)                            # [B, H, n, c]
            l_chunk = L[..., -1].reshape(BH, n)                      # [BH, n] log decay of each chunk
            kd = kg * torch.exp(L[..., -1:] - L).reshape(BH * n, c, 1)   # decayed to the chunk end
            lam = torch.cumsum(l_chunk, dim=-1)                      # [BH, n]
            lam_prev = torch.cat([lam.new_zeros(BH, 1), lam[:, :-1]], dim=-1)   # [BH, n] log decay before chunk j
            # (an exclusive sum, not lam - l_chunk: that would round with chunk j's own decay, so a
            # later token of chunk j could move the state chunk j starts from in the last bit)
            W = torch.exp(torch.where(strict[:n, :n], lam_prev[:, :, None] - lam[:, None, :], float("-inf")))
            S_in = torch.exp(lam_prev)[:, :, None] * S[:, None, :]  # [BH, n, KV]
        else:
            kd = kg
            if n not in lower:
                lower[n] = strict[:n, :n].to(dt).expand(BH, n, n)
            W = lower[n]                                             # [BH, n, n]
            S_in = S[:, None, :]                                     # [BH, 1, KV]
        kv = torch.bmm(kd.transpose(1, 2), vg).view(BH, n, K * V)   # [BH, n, KV] chunk increments
        S_starts = torch.baddbmm(S_in, W, kv)                        # [BH, n, KV] state at each chunk start
        if lg is not None:
            S = torch.addcmul(kv[:, -1], S_starts[:, -1], torch.exp(l_chunk[:, -1:]))
        else:
            S = S_starts[:, -1] + kv[:, -1]                          # [BH, KV]
        if qq is None:
            continue
        qg = block(qq, a, n, c)                                      # [BHn, c, K]
        scores = torch.bmm(qg, kg.transpose(1, 2))                   # [BHn, c, c]
        if lg is not None:
            Lq = L if inclusive else L - lgg                         # [B, H, n, c]
            decay = torch.exp(torch.where(read_mask[:c, :c], Lq[..., :, None] - L[..., None, :], float("-inf")))
            scores = scores * decay.reshape(BH * n, c, c)
            qg = qg * torch.exp(Lq).reshape(BH * n, c, 1)
        else:
            scores = scores.tril_(0 if inclusive else -1)
        og = torch.baddbmm(torch.bmm(qg, S_starts.view(BH * n, K, V)), scores, vg)   # [BHn, c, V]
        outs.append(og.view(BH, n * c, V))
    S_out = S.view(B, H, K, V).to(S0.dtype if S0 is not None else vs[0].dtype)
    if qq is None:
        return None, S_out
    if not outs:                                                     # T = 0
        return kk.new_zeros(B, 0, H, V).to(vs[0].dtype), S_out
    o = (torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]).view(B, H, T, V).transpose(1, 2)  # [B, T, H, V]
    return o.to(vs[0].dtype), S_out
