"""Exact chunked kernel of the delta family (WY / UT representation), and its token-loop reference.

See :mod:`memspec.runtime` for the rules every kernel here follows.
"""
from __future__ import annotations

import torch

from .phases import (_chunk_groups, _chunk_major, _group_size, _join_chunks, _pass_states, _split_groups, _stacked,
                     _token_major)


def recurrent_delta(q, k, v, beta, log_gamma, S0, log_rho=None, inclusive=True):
    """Token-loop reference for the (gated) delta rule.

    ``S_t = gamma_t S_{t-1} + outer(k_t, beta_t (v_t - rho_t k_t @ S_{t-1}))`` with
    ``gamma_t = exp(log_gamma_t)`` and ``rho_t = exp(log_rho_t)`` (default rho = gamma:
    ``S_t = gamma_t (I - beta_t k_t^T k_t) S_{t-1} + beta_t outer(k_t, v_t)``), ``o_t = q_t @ S_t``.

    Args:
        q: ``[B, T, H, K]`` probes, or None.  k: ``[B, T, H, K]``; v: ``[B, T, H, V]``.
        beta: ``[B, T, H]`` step sizes, or ``[B, T, H, V]``: one per value channel (column j of the
            state runs its own delta rule, ``u_tj = beta_tj (v_tj - rho_t k_t @ S_{t-1}[:, j])``).
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
        u_t = (b_t if b_t.dim() == 3 else b_t[..., None]) * (v_t - pred)            # [B, H, V]
        S_prev = S
        if log_gamma is not None:
            S = torch.exp(log_gamma[:, t].to(dt))[:, :, None, None] * S
        S = S + k_t[..., :, None] * u_t[..., None, :]                              # [B, H, K, V]
        if q is not None:
            read = S if inclusive else S_prev
            outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t].to(dt), read))
    o = torch.stack(outs, dim=1).to(v.dtype) if q is not None else None
    return o, S.to(S0.dtype if S0 is not None else v.dtype)


def chunk_delta(q, k, v, beta, log_gamma, S0, chunk, *, inclusive=True, group=None, documents=None,
                log_rho=None, per_channel=False):
    """Exact chunked (gated) delta rule through the WY / UT representation.

    Recurrence: ``S_t = gamma_t S_{t-1} + outer(k_t, u_t)``,
    ``u_t = beta_t (v_t - rho_t k_t @ S_{t-1})`` (rho = gamma unless ``log_rho`` is given).
    Inside a chunk (cumulative log decays ``L_t``, ``R_t = L_{t-1} + log rho_t``), the
    corrections solve the unit-lower-triangular system
    ``u_t + beta_t sum_{s<t} exp(R_t - L_s) (k_t . k_s) u_s = beta_t (v_t - exp(R_t) k_t @ S_start)``,
    i.e. ``u = U - W @ S_start`` with ``[W | U] = (I + A)^-1 [beta exp(R) k | beta v]``: one
    triangular solve per chunk, batched over chunks.  The sequential part is, per chunk,
    ``u = U - W S`` and ``S <- exp(L_C) S + Kd^T u`` (``Kd`` the keys decayed to the chunk end);
    the outputs are then batched over chunks: ``o = Qd @ S_start + P @ u`` (``P`` the masked,
    decayed scores, ``Qd`` the decayed probes).

    Chunks are processed G at a time (on CPU, G is chosen so that each temporary stays near
    512 KB: large per-call allocations are returned to the OS and page-faulted back on every
    call; on other devices G = 64).

    Non-finite inputs: a token whose k, v, beta or log decays are not all finite is replaced by
    an identity token (by ``torch.where``, never by a product with zero), and every output that
    reads a state at or after it, and the final state, are NaN; a non-finite probe makes only its
    own output NaN.  Outputs before such a token, and their gradients, are those of the clean
    sequence.  Log decays below -80 are clamped to -80.

    Args:
        q: ``[B, T, H, K]`` probes, or None.  k: ``[B, T, H, K]``; v: ``[B, T, H, V]``.
        beta: ``[B, T, H]`` step sizes (``[B, T, H, V]`` with ``per_channel``).
        log_gamma: ``[B, T, H]`` log decays (<= 0), or None for no decay.
        S0: ``[B, H, K, V]`` or None.
        chunk: chunk size C.
        log_rho: ``[B, T, H]`` (<= 0) or None (= log_gamma).
        inclusive: True: o_t reads S_t; False: o_t reads S_{t-1}.
        group: chunks per batched group G (default: from the 512 KB budget); any G >= 1
            gives the same numbers.
        documents: packed documents (``_Documents(cu_seqlens)``: B = 1, offsets ``[N + 1]``;
            S0 and S_T ``[N, H, K, V]``): each starts at a chunk, from its own state; or None.
        per_channel: beta ``[B, T, H, V]``, a delta rule per value channel (:func:`_delta_channel_maps`).

    Returns:
        (o ``[B, T, H, V]`` or None, S_T ``[B, H, K, V]``).
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    BH = B * H
    dt = torch.promote_types(k.dtype, torch.float32)
    dev = k.device
    C = max(1, min(int(chunk), T))
    docs = None
    if documents is not None:   # packed documents: each starts at a chunk, from its own state
        S_docs = S0.to(dt) if S0 is not None else k.new_zeros(documents.count, H, K, V, dtype=dt)
        docs = documents.for_kernel(C, S_docs)
        T = docs.T
    N, r = divmod(T, C)
    width = C * V if per_channel else max(K + V, C)  # floats per token of a chunk's temporaries
    G = _group_size(N, BH * C * width, group, dev)                   # chunks per group
    kk, vv = k.to(dt), v.to(dt)                                      # no copies in float32
    qq = q.to(dt) if q is not None else None
    bt, lgt, lrt = beta, log_gamma, log_rho                          # per-token scalars [B, T, H]
    if docs is not None:                                             # the laid-out row
        kk, vv, qq, bt, lgt, lrt = (docs.lay(x) for x in (kk, vv, qq, bt, lgt, lrt))
    decayed = log_gamma is not None or log_rho is not None
    # (packed: every chunk that starts a document enters its initial state)
    S = k.new_zeros(BH, K, V, dtype=dt) if S0 is None or docs is not None else S0.to(dt).reshape(BH, K, V)
    Np = N + (r > 0)                                                 # chunks, the tail included
    zero = torch.zeros((), dtype=dt, device=dev)
    nan_value = torch.full((), float("nan"), dtype=dt, device=dev)

    def per_chunk(x):  # per-token scalars [B, T, H] -> [Np, B H, C], chunk-major, tail padded with zeros
        return _chunk_major(x.to(dt), Np, C).contiguous().reshape(Np, BH, C, *x.shape[3:])

    # non-finite inputs: a token with a non-finite k, v, beta or decay is replaced by an identity token
    # (torch.where, never a product), and every output reading a state at or after it, and the final
    # state, are NaN; a non-finite probe makes its own output NaN.  The flags come from one sum per token.
    # (the state itself is never poisoned inside: later outputs are replaced by NaN at the end, so
    # no NaN ever meets a product, forward or backward)
    total = kk.sum(-1) + vv.sum(-1) + (bt.to(dt).sum(-1) if per_channel else bt.to(dt))
    if log_gamma is not None:                                        # a decay of 0 (log -inf) is valid
        total = total + lgt.to(dt).clamp_min(-80.0)
    if log_rho is not None:
        total = total + lrt.to(dt).clamp_min(-80.0)
    ok = torch.isfinite(per_chunk(total))                            # [Np, BH, C] (padding: ok)
    bad = (~torch.isfinite(total)).to(dt)                            # [B, T, H]
    if docs is None:
        bad_before = torch.cumsum(bad, dim=1)                        # bad tokens at or before t
        state_bad = (bad_before[:, -1] > 0).reshape(BH, 1, 1) if T else None
    else:                                                            # ... in its document
        bad_before = docs.cumsum(bad)
        state_bad = (docs.total(bad) > 0).reshape(-1, 1, 1)         # [N H, 1, 1]
    if qq is not None:
        read_bad = (bad_before if inclusive else bad_before - bad) + (~torch.isfinite(qq.sum(-1))).to(dt)
        read_bad = per_chunk(read_bad) > 0                           # [Np, BH, C]

    # per-token factors for every chunk at once (small: [Np, BH, C]); a padded tail token has
    # log decay 0, so L at the chunk's last slot is L at its last real token
    bc = torch.where(ok[..., None] if per_channel else ok, per_chunk(bt), zero)  # beta
    if decayed:
        lgc = (torch.where(ok, per_chunk(lgt).clamp_min(-80.0), zero) if log_gamma is not None
               else torch.zeros_like(bc))
        L = torch.cumsum(lgc, dim=-1)                                # cumulative log decay in the chunk
        Rl = L if log_rho is None else L - lgc + torch.where(ok, per_chunk(lrt).clamp_min(-80.0), zero)
        b_r = bc * (torch.exp(Rl)[..., None] if per_channel else torch.exp(Rl))  # beta e^R: scales k on the right side
        to_end = torch.exp(L[..., -1:] - L)                          # decay from token t to the chunk end
        g_end = torch.exp(L[..., -1])                                # [Np, BH] decay over the chunk
        Lq = L if inclusive else L - lgc                             # log decay a probe sees
        q_fac = torch.exp(Lq)
        shared = log_rho is None and inclusive and qq is not None   # one decay matrix for solve and read

    def decay_matrix(rows, cols, diagonal):  # exp(rows_t - cols_s) on and below the diagonal, 1 above
        # (s > t is zeroed before exp, so nothing can overflow; masking with -inf instead would cost
        # a slow exp path for every masked entry; callers never read the entries above)
        return torch.exp((rows[:, :, None] - cols[:, None, :]).tril(diagonal))   # [nBH, c, c]

    # groups of n chunks of c tokens; every per-group piece comes from one split
    groups = _chunk_groups(T, C, G)
    c_pieces = [n for n, _, _ in groups]

    def t_split(x):  # [B, T, ...] -> one [B, n c, ...] piece per group
        return _split_groups(x, groups)

    def c_split(x):  # [Np, BH, ...] -> one [n, BH, ...] piece per group ([n B H, c] for c < C: the tail)
        return [p[:, :, :c] for p, (n, c, _) in zip(x.split(c_pieces, dim=0), groups)]

    pieces = [t_split(kk), t_split(vv), t_split(qq), c_split(bc), c_split(ok)]
    pieces.append(c_split(read_bad) if qq is not None else [None] * len(groups))
    if decayed:
        pieces += [c_split(L), c_split(Rl), c_split(b_r), c_split(to_end), c_split(Lq), c_split(q_fac),
                   g_end.split(c_pieces, dim=0)]
    outs = []                                                        # [B, n, c, H, V] per group
    j0 = 0                                                           # chunks before this group
    for gi, (n, c, _) in enumerate(groups):
        kp, vp, qp, b, okg, rbad = (x[gi] for x in pieces[:6])
        nBH = n * BH
        flat = lambda x: x.flatten(0, 1)  # noqa: E731  [n, BH, c, ...] -> [n B H, c, ...]
        b = flat(b) if per_channel else flat(b)[:, :, None]  # [nBH, c, 1] (per channel: [nBH, c, V])
        # k and v side by side, chunk-major (chunk j of the group is the batch slice [j BH, (j + 1) BH)),
        # bad tokens zeroed
        kv = torch.cat([_chunk_major(kp, n, c), _chunk_major(vp, n, c)], dim=-1)
        kv = torch.where(okg.reshape(n, B, H, c, 1), kv, zero).reshape(nBH, c, K + V)
        if decayed:
            Lg, Rg, b_rg, to_end_g, Lq_g, q_fac_g = (flat(x[gi]) for x in pieces[6:12])
            g_end_g = pieces[12][gi]                                 # [n, BH]
            if shared:
                read_decay = decay_matrix(Lg, Lg, 0)                 # exp(L_t - L_s), s <= t
                solve_decay = read_decay
            else:
                solve_decay = decay_matrix(Rg, Lg, -1)               # exp(R_t - L_s), s < t
            Wk, U, kd = (_delta_channel_maps if per_channel else _delta_maps)(kv, b, K, solve_decay, b_rg, to_end_g)
        else:
            Wk, U, kd = (_delta_channel_maps if per_channel else _delta_maps)(kv, b, K)
        # the sequential part, per chunk: u = U - W S (the corrections), S <- g S + Kd^T u
        gs = g_end_g.unbind(0) if decayed else [None] * n
        Ws, Us, kds = (x.reshape(n, BH, *x.shape[1:]).unbind(0) for x in (Wk, U, kd))
        kgs = kv[:, :, :K].reshape(n, BH, c, K).unbind(0) if per_channel else None  # the keys the errors read

        def step(j, S):  # chunk j's map: the corrections u_j [BH, c, V], S <- g_j S + Kd_j^T u_j
            u_j = _corrections(Us[j], Ws[j], kgs[j], S) if per_channel else torch.baddbmm(Us[j], Ws[j], S, alpha=-1)
            Sg = S if gs[j] is None else S * gs[j][:, None, None]
            return torch.baddbmm(Sg, kds[j].transpose(1, 2), u_j), u_j

        S, starts, us = _pass_states(step, n, S, docs, j0)
        j0 += n
        if qq is not None:
            u = _stacked(us)                                         # [nBH, c, V]
            S_starts = _stacked(starts)                              # [nBH, K, V]
            qg = _chunk_major(qp, n, c)                              # [n, B, H, c, K]
            qg = torch.where(~rbad.reshape(n, B, H, c, 1), qg, zero).reshape(nBH, c, K)
            if decayed:
                if not shared:
                    read_decay = decay_matrix(Lq_g, Lg, 0 if inclusive else -1)
                og = _delta_outputs(qg, kv[:, :, :K], u, S_starts, inclusive, read_decay, q_fac_g)
            else:
                og = _delta_outputs(qg, kv[:, :, :K], u, S_starts, inclusive)
            og = torch.where(rbad.reshape(nBH, c, 1), nan_value, og)
            outs.append(_token_major(og, B, H, c))                   # [B, n, c, H, V] (a view)
    if qq is not None:
        o = _join_chunks(outs) if outs else kk.new_zeros(B, 0, H, V)   # [B, T, H, V]
        if docs is not None:
            o = docs.unlay(o)                                        # the documents' tokens, packed
    if docs is not None:
        S = docs.final().reshape(-1, K, V)                           # [N H, K, V]
    if state_bad is not None:
        S = torch.where(state_bad, nan_value, S)                           # a bad token poisons the final state
    S_out = S.reshape(-1, H, K, V).to(S0.dtype if S0 is not None else v.dtype)
    return (o.to(v.dtype) if qq is not None else None), S_out


def _delta_maps(kv, b, K, solve_decay=None, b_r=None, to_end=None):
    """The chunk maps of the (gated) delta rule (``chunk_delta``), batched over chunks: the
    corrections of each chunk from its start state, ``u = U - W S``, and its map
    ``S <- g S + Kd^T u``, from one triangular solve ``(I + A) [W | U] = [beta e^R k | beta v]``.

    Args:
        kv: ``[nBH, c, K + V]`` keys and values side by side (bad tokens zeroed); b: ``[nBH, c, 1]``
            beta; K: the key width.
        solve_decay: ``[nBH, c, c]`` the decays ``exp(R_t - L_s)`` of the pairs s < t, or None (no
            decay: the other factors are None too).
        b_r: ``[nBH, c]`` ``beta exp(R)``; to_end: ``[nBH, c]`` the decay from each token to the chunk end.

    Returns:
        ``(W [nBH, c, K], U [nBH, c, V], Kd [nBH, c, K])``, Kd the keys decayed to the chunk end.
    """
    nBH, c, KV = kv.shape
    kg = kv[:, :, :K]                                                # [nBH, c, K] (a view)
    if solve_decay is not None:
        # A_ts = beta_t exp(R_t - L_s) (k_t . k_s), s < t (only the strict lower part is read)
        A = torch.bmm(kg * b, kg.transpose(1, 2)) * solve_decay      # [nBH, c, c]
        if 2 * K == KV:
            fac = torch.stack([b_r, b[:, :, 0]], dim=-1)             # [nBH, c, 2]
            rhs = (kv.reshape(nBH, c, 2, K) * fac[..., None]).reshape(nBH, c, KV)
        else:
            rhs = torch.cat([kg * b_r[:, :, None], kv[:, :, K:] * b], dim=-1)
        kd = kg * to_end[:, :, None]                                 # [nBH, c, K] keys decayed to the chunk end
    else:
        rhs = kv * b                                                 # [beta k | beta v]
        A = torch.bmm(rhs[:, :, :K], kg.transpose(1, 2))             # beta_t (k_t . k_s); strict lower part read
        kd = kg
    # (I + A) X = rhs as X^T (I + A)^T = rhs^T: the fast layout for batched triangular solves on CPU
    X = torch.linalg.solve_triangular(A.transpose(1, 2), rhs.transpose(1, 2), upper=True, left=False,
                                      unitriangular=True).transpose(1, 2)   # [nBH, c, K + V] = [W | U]
    W, U = X.split([K, KV - K], dim=-1)
    return W, U, kd


def _delta_channel_maps(kv, b, K, solve_decay=None, b_r=None, to_end=None):
    """The chunk maps of the delta rule with one step size per value channel (``chunk_delta`` with
    ``per_channel``), batched over chunks: column j of the state runs its own scalar-beta delta rule,
    so each chunk has one unit-lower-triangular system per value channel, ``A`` shared,
    ``(I + Diag(beta_j) A) u_j = beta_j v_j - beta_j e^R (K S)_j``; with ``T_j`` its inverse the
    corrections are ``u = T (beta v - beta e^R (K S))`` column by column (:func:`_corrections`).

    The inverses, channel last, halve the chunk level by level: the inverse of ``[[X, 0], [Y, Z]]``
    is ``[[X^-1, 0], [-Z^-1 Y X^-1, Z^-1]]`` with ``Y = Diag(beta_j) A_21``, so a level takes the
    shared ``A_21 X^-1`` (one batched product, the channels as columns) and one product per channel
    (elementwise over the channels).  A chunk of c tokens is padded to a power of two (the top-left
    block of a lower-triangular inverse is the inverse of the top-left block).

    Args:
        kv: ``[nBH, c, K + V]`` keys and values side by side (bad tokens zeroed); b: ``[nBH, c, V]``
            beta; K: the key width.
        solve_decay: ``[nBH, c, c]`` the decays ``exp(R_t - L_s)`` of the pairs s < t, or None (no
            decay: the other factors are None too).
        b_r: ``[nBH, c, V]`` ``beta exp(R)``; to_end: ``[nBH, c]`` the decay from each token to the chunk end.

    Returns:
        ``(T [nBH, c, c, V], Z [nBH, 2, c, V], Kd [nBH, c, K])``: ``T[:, t, s, j] = T_j[t, s]``, Z the
        right-hand sides' factors ``beta v`` and ``beta e^R``, Kd the keys decayed to the chunk end.
    """
    nBH, c, V = b.shape
    kg, vg = kv[:, :, :K], kv[:, :, K:]                              # [nBH, c, K], [nBH, c, V] (views)
    A = torch.bmm(kg, kg.transpose(1, 2))                            # k_t . k_s (only s < t is read)
    if solve_decay is not None:
        A = A * solve_decay
        kd = kg * to_end[:, :, None]                                 # [nBH, c, K] keys decayed to the chunk end
    else:
        b_r = b
        kd = kg
    cp = 1 << (c - 1).bit_length()                                   # c padded to a power of two
    Ap, bp = A, b
    if cp > c:
        Ap = torch.nn.functional.pad(A, (0, cp - c, 0, cp - c))
        bp = torch.nn.functional.pad(b, (0, 0, 0, cp - c))
    T = b.new_ones(nBH, cp, 1, 1, V)                                 # the diagonal blocks' inverses, size s
    s = 1
    if cp > 1:   # blocks of 2: [[1, 0], [-beta_1j a_10, 1]]
        one = T[:, 0::2, 0, 0]                                       # [nBH, cp / 2, V]
        low = -bp.reshape(nBH, cp // 2, 2, V)[:, :, 1] * torch.diagonal(Ap, -1, 1, 2)[:, 0::2, None]
        T = torch.stack([one, torch.zeros_like(one), low, one], dim=2).reshape(nBH, cp // 2, 2, 2, V)
        s = 2
    while s < cp:
        m = cp // (2 * s)                                            # pairs of blocks
        A21 = torch.diagonal(Ap.reshape(nBH, m, 2 * s, m, 2 * s), dim1=1, dim2=3)[:, s:, :s].permute(0, 3, 1, 2)
        X, Z = T[:, 0::2], T[:, 1::2]                                # [nBH, m, s, s, V]
        Y = torch.matmul(A21, X.reshape(nBH, m, s, s * V)).reshape(nBH, m, s, s, V)    # A_21 X^-1
        Y = bp.reshape(nBH, m, 2, s, 1, V)[:, :, 1] * Y              # Diag(beta_j) A_21 X^-1
        Y = -(Z[:, :, :, :, None] * Y[:, :, None]).sum(3)            # -Z^-1 Diag(beta_j) A_21 X^-1
        T = torch.cat([torch.cat([X, torch.zeros_like(X)], dim=3), torch.cat([Y, Z], dim=3)], dim=2)
        s *= 2
    return T[:, 0, :c, :c], torch.stack([b * vg, b_r], dim=1), kd


def _corrections(Z, T, kg, S):
    """The corrections of a chunk with a step per value channel, column by column:
    ``u = T (beta v - beta e^R (K S))`` (Z ``[BH, 2, c, V]`` the factors ``beta v`` and ``beta e^R``,
    T ``[BH, c, c, V]`` from :func:`_delta_channel_maps`, kg ``[BH, c, K]``, S ``[BH, K, V]``)."""
    bv, b_r = Z.unbind(1)
    return (T * torch.addcmul(bv, b_r, torch.bmm(kg, S), value=-1)[:, None]).sum(2)   # [BH, c, V]


def _delta_outputs(qg, kg, u, S_starts, inclusive, read_decay=None, q_fac=None):
    """The outputs of a group of chunks, ``o = Qd @ S_start + P @ u`` (``P`` the masked, decayed
    scores, ``Qd`` the decayed probes).

    Args:
        qg, kg: ``[nBH, c, K]`` probes and keys; u: ``[nBH, c, V]`` the corrections; S_starts:
            ``[nBH, K, V]`` the states at the chunks' starts.
        inclusive: True: o_t reads S_t; False: S_{t-1}.
        read_decay: ``[nBH, c, c]`` the decays of the pairs a probe reads, or None (no decay);
            q_fac: ``[nBH, c]`` the decay a probe sees from the chunk start.

    Returns:
        ``[nBH, c, V]``.
    """
    scores = torch.bmm(qg, kg.transpose(1, 2))                       # [nBH, c, c]
    if read_decay is not None:
        scores = scores * read_decay
        qg = qg * q_fac[:, :, None]
    return torch.baddbmm(torch.bmm(scores.tril_(0 if inclusive else -1), u), qg, S_starts)   # Qd S + P u
