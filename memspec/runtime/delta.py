"""Exact chunked kernel of the delta family (WY / UT representation), and its token-loop reference.

See :mod:`memspec.runtime` for the rules every kernel here follows.
"""
from __future__ import annotations

import torch


def recurrent_delta(q, k, v, beta, log_gamma, S0, log_rho=None, inclusive=True):
    """Token-loop reference for the (gated) delta rule.

    ``S_t = gamma_t S_{t-1} + outer(k_t, beta_t (v_t - rho_t k_t @ S_{t-1}))`` with
    ``gamma_t = exp(log_gamma_t)`` and ``rho_t = exp(log_rho_t)`` (default rho = gamma:
    ``S_t = gamma_t (I - beta_t k_t^T k_t) S_{t-1} + beta_t outer(k_t, v_t)``), ``o_t = q_t @ S_t``.

    Args:
        q: ``[B, T, H, K]`` probes, or None.  k: ``[B, T, H, K]``; v: ``[B, T, H, V]``.
        beta: ``[B, T, H]`` step sizes.
        log_gamma: ``[B, T, H]`` log decays (<= 0), or None for no decay.
        S0: ``[B, H, K, V]`` or None.
        log_rho: ``[B, T, H]`` log of the decay the error term sees, or None (= log_gamma).
        inclusive: True: o_t reads S_t; False: o_t reads S_{t-1}.

    Returns:
        (o ``[B, T, H, V]`` or None, S_T ``[B, H, K, V]``).
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    dt = torch.promote_types(k.dtype, torch.float32)
    S = k.new_zeros(B, H, K, V, dtype=dt) if S0 is None else S0.to(dt)
    if log_rho is None:
        log_rho = log_gamma
    outs = []
    for t in range(T):
        k_t, v_t, b_t = k[:, t].to(dt), v[:, t].to(dt), beta[:, t].to(dt)       # [B, H, K], [B, H, V], [B, H]
        pred = torch.einsum("bhk,bhkv->bhv", k_t, S)                               # [B, H, V]
        if log_rho is not None:
            pred = pred * torch.exp(log_rho[:, t].to(dt))[..., None]
        u_t = b_t[..., None] * (v_t - pred)                                        # [B, H, V]
        S_prev = S
        if log_gamma is not None:
            S = torch.exp(log_gamma[:, t].to(dt))[:, :, None, None] * S
        S = S + k_t[..., :, None] * u_t[..., None, :]                              # [B, H, K, V]
        if q is not None:
            read = S if inclusive else S_prev
            outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t].to(dt), read))
    o = torch.stack(outs, dim=1).to(v.dtype) if q is not None else None
    return o, S.to(S0.dtype if S0 is not None else v.dtype)


def chunk_delta(q, k, v, beta, log_gamma, S0, chunk, log_rho=None, inclusive=True, group=None):
    """Exact chunked (gated) delta rule through the WY / UT representation.

    Recurrence: ``S_t = gamma_t S_{t-1} + outer(k_t, u_t)``,
    ``u_t = beta_t (v_t - rho_t k_t @ S_{t-1})`` (rho = gamma unless ``log_rho`` is given).
    Inside a chunk (cumulative log decays ``L_t``, ``R_t = L_{t-1} + log rho_t``), the
    corrections solve the unit-lower-triangular system
    ``u_t + beta_t sum_{s<t} exp(R_t - L_s) (k_t . k_s) u_s = beta_t (v_t - exp(R_t) k_t @ S_start)``,
    i.e. ``u = U - W @ S_start`` with ``[W | U] = (I + A)^-1 [beta exp(R) k | beta v]``: one
    triangular solve per chunk, batched over chunks.  Then the chunk's effect on the state
    is one affine map, ``S_end = M S_start + D`` with ``M = exp(L_C) I - Kd^T W`` and
    ``D = Kd^T U`` (``Kd`` the keys decayed to the chunk end), and its outputs are
    ``o = (Qd - P W) @ S_start + P U`` (``P`` the masked, decayed scores, ``Qd`` the
    decayed probes): all of these are batched matmuls over chunks; the only sequential part
    is one ``[K, K] @ [K, V]`` product per chunk, ``S <- M_n S + D_n``.

    Chunks are processed G at a time (on CPU, G is chosen so that each temporary stays near
    512 KB: large per-call allocations are returned to the OS and page-faulted back on every
    call; on other devices G = 64).

    Args:
        q: ``[B, T, H, K]`` probes, or None.  k: ``[B, T, H, K]``; v: ``[B, T, H, V]``.
        beta: ``[B, T, H]`` step sizes.
        log_gamma: ``[B, T, H]`` log decays (<= 0), or None for no decay.
        S0: ``[B, H, K, V]`` or None.
        chunk: chunk size C.
        log_rho: ``[B, T, H]`` (<= 0) or None (= log_gamma).
        inclusive: True: o_t reads S_t; False: o_t reads S_{t-1}.
        group: chunks per batched group G (default: from the 512 KB budget); any G >= 1
            gives the same numbers.

    Returns:
        (o ``[B, T, H, V]`` or None, S_T ``[B, H, K, V]``).
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    BH = B * H
    dt = torch.promote_types(k.dtype, torch.float32)
    C = max(1, min(int(chunk), T))
    N, r = divmod(T, C)
    if group is not None:
        G = int(group)
    elif k.device.type == "cpu":   # temporaries near 512 KB (float32): no page faults per call
        G = round((1 << 17) / (BH * C * max(K + V, C)))
    else:                          # caching allocators: fewer, larger launches
        G = 64
    G = max(1, min(N, G))                                            # chunks per group
    kk, vv = k.to(dt), v.to(dt)                                      # no copies in float32
    qq = q.to(dt) if q is not None else None
    decayed = log_gamma is not None or log_rho is not None
    S = k.new_zeros(BH, K, V, dtype=dt) if S0 is None else S0.to(dt).reshape(BH, K, V)
    eye = torch.eye(K, dtype=dt, device=k.device)
    Np = N + (r > 0)                                                 # chunks, the tail included

    def per_chunk(x):  # per-token scalars [B, T, H] -> [Np, B H, C], chunk-major, tail padded with zeros
        x = x.to(dt)
        if Np * C > T:
            x = torch.nn.functional.pad(x, (0, 0, 0, Np * C - T))
        return x.reshape(B, Np, C, H).permute(1, 0, 3, 2).reshape(Np, BH, C)

    # per-token factors for every chunk at once (small: [Np, BH, C]); a padded tail token has
    # log decay 0, so L at the chunk's last slot is L at its last real token
    bc = per_chunk(beta)                                             # beta
    if decayed:
        lgc = per_chunk(log_gamma) if log_gamma is not None else torch.zeros_like(bc)
        L = torch.cumsum(lgc, dim=-1)                                # cumulative log decay in the chunk
        R = L if log_rho is None else L - lgc + per_chunk(log_rho)   # log decay the error term sees
        b_r = bc * torch.exp(R)                                      # beta exp(R): scales k on the right side
        to_end = torch.exp(L[..., -1:] - L)                          # decay from token t to the chunk end
        g_end = torch.exp(L[..., -1])                                # [Np, BH] decay over the chunk
        Lq = L if inclusive else L - lgc                             # log decay a probe sees
        q_fac = torch.exp(Lq)
        shared = log_rho is None and inclusive and qq is not None   # one decay matrix for solve and read

    def decay_matrix(rows, cols, diagonal):  # exp(rows_t - cols_s) on and below the diagonal, 1 above
        # (s > t is zeroed before exp, so nothing can overflow; masking with -inf instead would cost
        # a slow exp path for every masked entry; callers never read the entries above)
        return torch.exp((rows[:, :, None] - cols[:, None, :]).tril(diagonal))   # [nBH, c, c]

    # groups of n chunks of c tokens; every per-group piece comes from one split (not from slices:
    # the backward of a slice fills a zero tensor of the whole input, once per group)
    groups = [(min(G, N - j), C) for j in range(0, N, G)] + ([(1, r)] if r else [])
    t_pieces = [n * c for n, c in groups]
    c_pieces = [n for n, _ in groups]

    def t_split(x):  # [B, T, ...] -> one [B, n c, ...] piece per group
        return x.split(t_pieces, dim=1) if x is not None else [None] * len(groups)

    def c_split(x):  # [Np, BH, C] -> one [n B H, c] piece per group
        return [p[..., :c].reshape(n * BH, c) for p, (n, c) in zip(x.split(c_pieces, dim=0), groups)]

    pieces = [t_split(kk), t_split(vv), t_split(qq), c_split(bc)]
    if decayed:
        pieces += [c_split(L), c_split(R), c_split(b_r), c_split(to_end), c_split(Lq), c_split(q_fac),
                   g_end.split(c_pieces, dim=0)]
    outs = []                                                        # [B, n, c, H, V] per group
    for gi, (n, c) in enumerate(groups):
        kp, vp, qp, b = (x[gi] for x in pieces[:4])                  # [B, n c, H, K|V|K], [nBH, c]
        nBH = n * BH
        # k and v side by side, chunk-major: chunk j of the group is the batch slice [j BH, (j + 1) BH)
        kv = torch.cat([kp.view(B, n, c, H, K).permute(1, 0, 3, 2, 4),
                        vp.view(B, n, c, H, V).permute(1, 0, 3, 2, 4)], dim=-1).view(nBH, c, K + V)
        kg = kv[:, :, :K]                                            # [nBH, c, K] (a view)
        b = b[:, :, None]                                            # [nBH, c, 1]
        if decayed:
            Lg, Rg, b_rg, to_end_g, Lq_g, q_fac_g, g_end_g = (x[gi] for x in pieces[4:])
            if shared:
                read_decay = decay_matrix(Lg, Lg, 0)                 # exp(L_t - L_s), s <= t
                solve_decay = read_decay
            else:
                solve_decay = decay_matrix(Rg, Lg, -1)               # exp(R_t - L_s), s < t
            # A_ts = beta_t exp(R_t - L_s) (k_t . k_s), s < t (only the strict lower part is read)
            A = torch.bmm(kg * b, kg.transpose(1, 2)) * solve_decay  # [nBH, c, c]
            if K == V:
                fac = torch.stack([b_rg, b[:, :, 0]], dim=-1)        # [nBH, c, 2]
                rhs = (kv.view(nBH, c, 2, K) * fac[..., None]).view(nBH, c, K + V)
            else:
                rhs = torch.cat([kg * b_rg[:, :, None], kv[:, :, K:] * b], dim=-1)
            kd = kg * to_end_g[:, :, None]                           # [nBH, c, K] keys decayed to the chunk end
            M0 = eye * g_end_g.reshape(nBH, 1, 1)                    # [nBH, K, K]
        else:
            rhs = kv * b                                             # [beta k | beta v]
            A = torch.bmm(rhs[:, :, :K], kg.transpose(1, 2))         # beta_t (k_t . k_s); strict lower part read
            kd = kg
            M0 = eye.expand(nBH, K, K)
        # (I + A) X = rhs as X^T (I + A)^T = rhs^T: the fast layout for batched triangular solves on CPU
        X = torch.linalg.solve_triangular(A.transpose(1, 2), rhs.transpose(1, 2), upper=True, left=False,
                                          unitriangular=True).transpose(1, 2)   # [nBH, c, K + V] = [W | U]
        Wk, U = X.split([K, V], dim=-1)
        kd_t = kd.transpose(1, 2)                                    # [nBH, K, c]
        M = torch.baddbmm(M0, kd_t, Wk, alpha=-1)                    # [nBH, K, K] = g I - Kd^T W
        D = torch.bmm(kd_t, U)                                       # [nBH, K, V] = Kd^T U
        starts = [S]
        for M_j, D_j in zip(M.view(n, BH, K, K).unbind(0), D.view(n, BH, K, V).unbind(0)):
            S = torch.baddbmm(D_j, M_j, S)                           # [BH, K, V]: the only sequential part
            starts.append(S)
        if qq is not None:
            S_starts = torch.stack(starts[:-1]).view(nBH, K, V) if n > 1 else starts[0]   # [nBH, K, V]
            qg = qp.reshape(B, n, c, H, K).permute(1, 0, 3, 2, 4).reshape(nBH, c, K)      # [nBH, c, K]
            scores = torch.bmm(qg, kg.transpose(1, 2))               # [nBH, c, c]
            if decayed:
                if not shared:
                    read_decay = decay_matrix(Lq_g, Lg, 0 if inclusive else -1)
                scores = scores * read_decay
            Y_w, Y_u = torch.bmm(scores.tril_(0 if inclusive else -1), X).split([K, V], dim=-1)  # P W, P U
            neg_q = torch.addcmul(Y_w, qg, q_fac_g[:, :, None], value=-1) if decayed else Y_w - qg   # P W - Qd
            og = torch.baddbmm(Y_u, neg_q, S_starts, alpha=-1)       # [nBH, c, V] = P U + (Qd - P W) S_start
            outs.append(og.view(n, B, H, c, V).permute(1, 0, 3, 2, 4))   # [B, n, c, H, V] (a view)
    if qq is not None:  # one copy into [B, T, H, V] (a second one only for a tail chunk); no in-place writes
        full = [x for x, (_, c) in zip(outs, groups) if c == C]
        o = torch.cat(full, dim=1).view(B, N * C, H, V) if full else kk.new_zeros(B, 0, H, V)
        if len(full) < len(outs):
            o = torch.cat([o, outs[-1].reshape(B, r, H, V)], dim=1)
    S_out = S.view(B, H, K, V).to(S0.dtype if S0 is not None else v.dtype)
    if qq is None:
        return None, S_out
    return o.to(v.dtype), S_out
