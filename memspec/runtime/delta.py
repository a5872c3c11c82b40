"""Exact chunked kernel of the delta family (WY / UT representation), and its token-loop reference.

See :mod:`memspec.runtime` for the rules every kernel here follows.
"""
from __future__ import annotations

import torch

from .phases import (_chunk_groups, _chunk_major, _group_size, _initial_states, _join_chunks, _pass_states, _screen,
                     _split_groups, _stacked, _token_major)


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
    ``u_t = beta_t (v_t - rho_t k_t @ S_{t-1})`` (rho = gamma unless ``log_rho`` is given).  Per
    group of chunks: the per-token factors (:func:`_delta_factors`), one triangular solve per chunk
    for its corrections ``u = U - W S_start`` and its map ``S <- exp(L_C) S + Kd^T u``
    (:func:`_delta_maps`), the state passed over the chunks, and the outputs
    ``o = Qd S_start + P u`` (:func:`_delta_outputs`).

    Non-finite inputs: a token whose k, v, beta or log decays are not all finite runs as an
    identity token, and every output that reads a state at or after it, and the final state, are
    NaN; a non-finite probe makes only its own output NaN; outputs before such a token, and their
    gradients, are those of the clean sequence.  Log decays below -80 are clamped to -80.

    Args:
        q: ``[B, T, H, K]`` probes, or None.  k: ``[B, T, H, K]``; v: ``[B, T, H, V]``.
        beta: ``[B, T, H]`` step sizes (``[B, T, H, V]`` with ``per_channel``).
        log_gamma: ``[B, T, H]`` log decays (<= 0), or None for no decay.
        S0: ``[B, H, K, V]`` or None.
        chunk: chunk size C.
        log_rho: ``[B, T, H]`` (<= 0) or None (= log_gamma).
        inclusive: True: o_t reads S_t; False: o_t reads S_{t-1}.
        group: chunks per batched group G (default: temporaries near 512 KB on CPU, 64 elsewhere);
            any G >= 1 gives the same numbers.
        documents: packed documents (``_Documents(cu_seqlens)``: B = 1, offsets ``[N + 1]``;
            S0 and S_T ``[N, H, K, V]``): each starts at a chunk, from its own state; or None.
        per_channel: beta ``[B, T, H, V]``, a delta rule per value channel (:func:`_delta_channel_maps`).

    Returns:
        (o ``[B, T, H, V]`` or None, S_T ``[B, H, K, V]``).
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    dt = torch.promote_types(k.dtype, torch.float32)
    C = max(1, min(int(chunk), T))
    docs, S = _initial_states(S0, documents, C, B, (H, K, V), dt, k.device)
    ok, read_bad, state_bad = _screen((k, v, beta), (log_gamma, log_rho), q, docs, inclusive)
    kk, vv = k.to(dt), v.to(dt)                                      # no copies in float32
    qq = q.to(dt) if q is not None else None
    if docs is not None:                                             # the laid-out row
        kk, vv, qq = docs.lay(kk), docs.lay(vv), docs.lay(qq)
    width = C * V if per_channel else max(K + V, C)                  # floats per token of a chunk's temporaries
    groups = _chunk_groups(kk.shape[1], C, _group_size(kk.shape[1] // C, B * H * C * width, group, k.device))
    decayed = log_gamma is not None or log_rho is not None
    shared = decayed and log_rho is None and inclusive and q is not None   # one decay matrix for solve and read
    factors = _delta_factors(beta, log_gamma, log_rho, ok, read_bad, docs, groups, C, dt, inclusive, per_channel)
    outs, j0 = [], 0                                                 # [B, n, c, H, V] per group; chunks before it
    for (n, c, _), kp, vp, qp, (b, okg, rbad, dg) in zip(groups, _split_groups(kk, groups), _split_groups(vv, groups),
                                                          _split_groups(qq, groups), factors):
        # k and v side by side, chunk-major (chunk j of the group is the batch slice [j BH, (j + 1) BH)),
        # bad tokens zeroed (torch.where, never a product)
        kv = torch.cat([_chunk_major(kp, n, c), _chunk_major(vp, n, c)], dim=-1)
        kv = torch.where(okg.reshape(n, B, H, c, 1), kv, 0.0).reshape(n * B * H, c, K + V)
        if decayed:   # the pairs' decays exp(R_t - L_s), s < t (shared: exp(L_t - L_s), s <= t, read by the probes too)
            # (s > t is zeroed before exp, so nothing can overflow; callers never read the entries above)
            pair = torch.exp((dg["L"][:, :, None] - dg["L"][:, None, :]).tril() if shared
                             else (dg["R"][:, :, None] - dg["L"][:, None, :]).tril(-1))
            step = (_delta_channel_maps if per_channel else _delta_maps)(kv, b, K, n, pair, dg["b_r"], dg["to_end"],
                                                                           dg["g_end"])
        else:
            step = (_delta_channel_maps if per_channel else _delta_maps)(kv, b, K, n)
        S, starts, us = _pass_states(step, n, S, docs, j0)
        j0 += n
        if q is not None:
            og = _delta_outputs(qp, kv[:, :, :K], _stacked(us), _stacked(starts), rbad, inclusive,
                                dg if decayed else None, pair if shared else None)
            outs.append(_token_major(og, B, H, c))                   # [B, n, c, H, V] (a view)
    S = docs.final().reshape(-1, K, V) if docs is not None else S   # (packed: [N H, K, V])
    S = torch.where(state_bad.reshape(-1, 1, 1), float("nan"), S)   # a bad token poisons the final state
    S = S.reshape(-1, H, K, V).to(S0.dtype if S0 is not None else v.dtype)
    if q is None:
        return None, S
    o = _join_chunks(outs) if outs else kk.new_zeros(B, 0, H, V)     # [B, T, H, V]
    return (o if docs is None else docs.unlay(o)).to(v.dtype), S    # (packed: the documents' tokens)


def _delta_factors(beta, log_gamma, log_rho, ok, read_bad, docs, groups, C, dt, inclusive, per_channel):
    """The per-token factors of ``chunk_delta`` for every chunk at once (chunk-major ``[Np, BH, C]``:
    small), cut into one piece per group.  A bad token's factors are zeroed, and a padded tail token
    has log decay 0, so L at the chunk's last slot is L at its last real token.

    Args:
        beta, log_gamma, log_rho: ``chunk_delta``'s (not laid out; the decays None where absent).
        ok, read_bad: ``[B, T', H]`` the screen's flags on the laid-out row (read_bad None without
            probes).
        docs: the packed documents' chunks, or None.
        groups: ``(n, c, cp)`` per group; C: the chunk; dt: the kernel's dtype.
        inclusive, per_channel: ``chunk_delta``'s.

    Returns:
        per group ``(beta [n BH, c, 1] ([n BH, c, V] per channel), ok [n, BH, c], read_bad [n, BH, c]
        or None, the decays or None)``; the decays (``[n BH, c]``): the cumulative log decay ``"L"``,
        the log decay the error reads ``"R"``, ``"b_r"`` = beta e^R, ``"to_end"`` the decay from each
        token to the chunk end, ``"Lq"`` the log decay a probe sees and ``"q_fac"`` = e^Lq; and
        ``"g_end"`` ``[n, BH]`` the decay over each chunk.
    """
    B, T, H = ok.shape
    Np = -(-T // C)                                                  # chunks, the tail included
    zero = torch.zeros((), dtype=dt, device=ok.device)

    def per_chunk(x):  # [B, T, H, ...] -> [Np, B H, C, ...]: laid out, chunk-major, the tail padded with zeros
        x = _chunk_major((x if docs is None else docs.lay(x)).to(dt), Np, C)
        return x.contiguous().reshape(Np, B * H, C, *x.shape[4:])

    okc = _chunk_major(ok, Np, C, True).contiguous().reshape(Np, B * H, C)   # (the tail's padding: ok)
    sizes = [n for n, _, _ in groups]

    def split(x):  # [Np, BH, C, ...] -> one [n, BH, c, ...] piece per group
        return [p[:, :, :c] for p, (_, c, _) in zip(x.split(sizes, dim=0), groups)]

    bc = torch.where(okc[..., None] if per_channel else okc, per_chunk(beta), zero)
    rbad = ([None] * len(groups) if read_bad is None
            else split(_chunk_major(read_bad, Np, C).contiguous().reshape(Np, B * H, C)))
    decs = [None] * len(groups)
    if log_gamma is not None or log_rho is not None:
        lgc = (torch.where(okc, per_chunk(log_gamma).clamp_min(-80.0), zero) if log_gamma is not None
               else torch.zeros_like(bc))
        L = torch.cumsum(lgc, dim=-1)                                # cumulative log decay in the chunk
        Rl = L if log_rho is None else L - lgc + torch.where(okc, per_chunk(log_rho).clamp_min(-80.0), zero)
        b_r = bc * (torch.exp(Rl)[..., None] if per_channel else torch.exp(Rl))  # beta e^R: scales k on the right side
        to_end = torch.exp(L[..., -1:] - L)                          # decay from token t to the chunk end
        g_end = torch.exp(L[..., -1])                                # [Np, BH] decay over the chunk
        Lq = L if inclusive else L - lgc                             # log decay a probe sees
        cut = [[p.flatten(0, 1) for p in split(x)] for x in (L, Rl, b_r, to_end, Lq, torch.exp(Lq))]
        names = ("L", "R", "b_r", "to_end", "Lq", "q_fac", "g_end")
        decs = [dict(zip(names, d)) for d in zip(*cut, g_end.split(sizes, dim=0))]
    return [(b.flatten(0, 1) if per_channel else b.flatten(0, 1)[:, :, None], okg, rb, dg)   # beta [nBH, c, 1 | V]
            for b, okg, rb, dg in zip(split(bc), split(okc), rbad, decs)]


def _delta_maps(kv, b, K, n, solve_decay=None, b_r=None, to_end=None, g_end=None):
    """The chunk maps of the (gated) delta rule (``chunk_delta``), batched over a group's n chunks:
    the corrections of each chunk from its start state, ``u = U - W S``, and its map
    ``S <- g S + Kd^T u``, from one triangular solve ``(I + A) [W | U] = [beta e^R k | beta v]``.

    Inside a chunk (cumulative log decays ``L_t``, ``R_t = L_{t-1} + log rho_t``) the corrections
    solve the unit-lower-triangular system
    ``u_t + beta_t sum_{s<t} exp(R_t - L_s) (k_t . k_s) u_s = beta_t (v_t - exp(R_t) k_t @ S_start)``.

    Args:
        kv: ``[nBH, c, K + V]`` keys and values side by side (bad tokens zeroed); b: ``[nBH, c, 1]``
            beta; K: the key width; n: the group's chunks.
        solve_decay: ``[nBH, c, c]`` the decays ``exp(R_t - L_s)`` of the pairs s < t, or None (no
            decay: the other factors are None too).
        b_r: ``[nBH, c]`` ``beta exp(R)``; to_end: ``[nBH, c]`` the decay from each token to the chunk
            end; g_end: ``[n, BH]`` the decay over each chunk.

    Returns:
        ``step(j, S) -> (S_end, u_j)``: chunk j's map, for ``_pass_states`` (u_j ``[BH, c, V]``).
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
    gs = g_end.unbind(0) if g_end is not None else [None] * n
    Ws, Us, kds = (x.reshape(n, nBH // n, *x.shape[1:]).unbind(0) for x in (W, U, kd))

    def step(j, S):  # chunk j's map: the corrections u_j [BH, c, V], S <- g_j S + Kd_j^T u_j
        u_j = torch.baddbmm(Us[j], Ws[j], S, alpha=-1)
        Sg = S if gs[j] is None else S * gs[j][:, None, None]
        return torch.baddbmm(Sg, kds[j].transpose(1, 2), u_j), u_j

    return step


def _delta_channel_maps(kv, b, K, n, solve_decay=None, b_r=None, to_end=None, g_end=None):
    """The chunk maps of the delta rule with one step size per value channel (``chunk_delta`` with
    ``per_channel``), batched over a group's n chunks: column j of the state runs its own
    scalar-beta delta rule, so each chunk has one unit-lower-triangular system per value channel,
    ``A`` shared, ``(I + Diag(beta_j) A) u_j = beta_j v_j - beta_j e^R (K S)_j``; with ``T_j`` its
    inverse the corrections are ``u = T (beta v - beta e^R (K S))``, column by column.

    The inverses, channel last, halve the chunk level by level: the inverse of ``[[X, 0], [Y, Z]]``
    is ``[[X^-1, 0], [-Z^-1 Y X^-1, Z^-1]]`` with ``Y = Diag(beta_j) A_21``, so a level takes the
    shared ``A_21 X^-1`` (one batched product, the channels as columns) and one product per channel
    (elementwise over the channels).  A chunk of c tokens is padded to a power of two (the top-left
    block of a lower-triangular inverse is the inverse of the top-left block).

    Args:
        kv: ``[nBH, c, K + V]`` keys and values side by side (bad tokens zeroed); b: ``[nBH, c, V]``
            beta; K: the key width; n: the group's chunks.
        solve_decay: ``[nBH, c, c]`` the decays ``exp(R_t - L_s)`` of the pairs s < t, or None (no
            decay: the other factors are None too).
        b_r: ``[nBH, c, V]`` ``beta exp(R)``; to_end: ``[nBH, c]`` the decay from each token to the
            chunk end; g_end: ``[n, BH]`` the decay over each chunk.

    Returns:
        ``step(j, S) -> (S_end, u_j)``: chunk j's map, for ``_pass_states`` (u_j ``[BH, c, V]``).
    """
    nBH, c, V = b.shape
    kg, vg = kv[:, :, :K], kv[:, :, K:]                              # [nBH, c, K], [nBH, c, V] (views)
    A = torch.bmm(kg, kg.transpose(1, 2))                            # k_t . k_s (only s < t is read)
    if solve_decay is not None:
        A = A * solve_decay
        kd = kg * to_end[:, :, None]                                 # [nBH, c, K] keys decayed to the chunk end
        b_e = b_r
    else:
        kd = kg
        b_e = b
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
    BH = nBH // n
    # per chunk: T [BH, c, c, V] (T[:, t, s, j] = T_j[t, s]), the right sides' factors beta v and beta e^R
    # [BH, 2, c, V], the keys decayed to the chunk end and the keys the errors read [BH, c, K]
    maps = T[:, 0, :c, :c], torch.stack([b * vg, b_e], dim=1), kd
    gs = g_end.unbind(0) if g_end is not None else [None] * n
    Ts, Zs, kds = (x.reshape(n, BH, *x.shape[1:]).unbind(0) for x in maps)
    kgs = kv[:, :, :K].reshape(n, BH, c, K).unbind(0)

    def step(j, S):  # chunk j's map: u_j = T_j (beta v - beta e^R (K S)) column by column, S <- g_j S + Kd_j^T u_j
        bv, b_rj = Zs[j].unbind(1)
        u_j = (Ts[j] * torch.addcmul(bv, b_rj, torch.bmm(kgs[j], S), value=-1)[:, None]).sum(2)   # [BH, c, V]
        Sg = S if gs[j] is None else S * gs[j][:, None, None]
        return torch.baddbmm(Sg, kds[j].transpose(1, 2), u_j), u_j

    return step


def _delta_outputs(qp, kg, u, S_starts, read_bad, inclusive, dec=None, read_decay=None):
    """The outputs of a group of chunks, ``o = Qd @ S_start + P @ u`` (``P`` the masked, decayed
    scores, ``Qd`` the decayed probes); the outputs ``read_bad`` flags are NaN.

    Args:
        qp: the group's probes ``[B, n c, H, K]``; kg: ``[nBH, c, K]`` the keys; u: ``[nBH, c, V]``
            the corrections; S_starts: ``[nBH, K, V]`` the states at the chunks' starts.
        read_bad: ``[n, BH, c]`` the outputs set to NaN (their probes are zeroed first).
        inclusive: True: o_t reads S_t; False: S_{t-1}.
        dec: the group's decays (:func:`_delta_factors`), or None (no decay).
        read_decay: ``[nBH, c, c]`` the decays of the pairs a probe reads when the solve's are
            the same, or None (from ``dec``).

    Returns:
        ``[nBH, c, V]``.
    """
    n, BH, c = read_bad.shape
    B, H, K = qp.shape[0], qp.shape[2], qp.shape[3]
    qg = torch.where(~read_bad.reshape(n, B, H, c, 1), _chunk_major(qp, n, c), 0.0).reshape(n * BH, c, K)
    scores = torch.bmm(qg, kg.transpose(1, 2))                       # [nBH, c, c]
    if dec is not None:
        decay = read_decay if read_decay is not None else torch.exp(
            (dec["Lq"][:, :, None] - dec["L"][:, None, :]).tril(0 if inclusive else -1))
        scores = scores * decay
        qg = qg * dec["q_fac"][:, :, None]
    og = torch.baddbmm(torch.bmm(scores.tril_(0 if inclusive else -1), u), qg, S_starts)   # Qd S + P u
    return torch.where(read_bad.reshape(n * BH, c, 1), float("nan"), og)
