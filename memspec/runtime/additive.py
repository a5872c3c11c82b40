"""Exact chunked kernel of the additive family, and its token-loop reference.

See :mod:`memspec.runtime` for the rules every kernel here follows (standalone, torch only,
log decays, float32 arithmetic, groups of chunks, causal masks that no future value crosses).
"""
from __future__ import annotations

import torch

from .phases import (_chunk_groups, _chunk_major, _group_size, _initial_states, _join_chunks, _pass_states,
                     _split_groups, _stacked, _token_major)


def recurrent_additive(q, k, v, log_gamma, S0, inclusive=True, log_input=None):
    """Token-loop reference for ``S_t = Diag(exp(log_gamma_t)) S_{t-1} + outer(k_t, v_t)``, ``o_t = q_t @ S_t``.

    Args:
        q: ``[B, T, H, K]`` probes, or None (state only).
        k: ``[B, T, H, K]``; v: ``[B, T, H, V]``.
        log_gamma: log decays (<= 0): ``[B, T, H]``, one per head (the whole state scales, as in
            RetNet / Mamba-2), or ``[B, T, H, K]``, one per key channel (row i of S scales by
            ``exp(log_gamma[..., i])``, as in GLA / RWKV-6 / HGRN-2); or None for no decay.
        S0: ``[B, H, K, V]`` initial state, or None for zeros.
        inclusive: True: o_t reads S_t (write, then read); False: o_t reads S_{t-1}.
        log_input: ``[B, T, H]``: the increment is ``exp(log_input_t) outer(k_t, v_t)`` (computed as
            written, at the true scale), or None.

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
            S = torch.exp(log_gamma[:, t].to(dt)).view(B, H, -1, 1) * S   # [B, H, 1 | K, 1] row scaling
        w = torch.exp(log_input[:, t].to(dt)).view(B, H, 1, 1) if log_input is not None else 1.0
        S = S + w * k[:, t].to(dt)[..., :, None] * v[:, t].to(dt)[..., None, :]   # [B, H, K, V]
        if q is not None:
            read = S if inclusive else S_prev
            outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t].to(dt), read))
    if q is None:
        o = None
    else:
        o = torch.stack(outs, dim=1).to(v.dtype) if outs else v.new_zeros(B, 0, H, V)
    return o, S.to(S0.dtype if S0 is not None else v.dtype)


def chunk_additive(q, k, v, log_gamma, S0, chunk, *, inclusive=True, group=None, documents=None, per_channel=None,
                   log_input=None):
    """Exact chunked form of ``S_t = Diag(exp(log_gamma_t)) S_{t-1} + outer(k_t, v_t)``, ``o_t = q_t @ S_t``.

    Inside a chunk with cumulative log decays ``L_t``: ``S_end = Diag(exp(L_C)) S_start + sum_s outer(k_s *
    exp(L_C - L_s), v_s)``, ``o_t = (q_t * exp(L_t)) @ S_start + sum_{s <= t} (sum_i q_ti k_si exp(L_ti -
    L_si)) v_s`` (exclusive: ``L_{t-1}``, s < t); every weight is a decay (<= 1).  Per group of chunks: the
    factors (per head :func:`_additive_factors`, per key channel :func:`_additive_halving`), the maps
    (:func:`_additive_maps`), the outputs; per key channel under autograd :class:`_AdditiveChannel` (a
    closed-form backward).  A NaN or inf in token t's inputs changes no output before t.

    Args:
        q: ``[B, T, H, K]`` probes, or None (state only).
        k: ``[B, T, H, K]``; v: ``[B, T, H, V]``, or a tuple of ``[B, T, H, V_i]`` read as their
            concatenation on the last axis (``V = sum V_i``) without a full-size copy.
        log_gamma: log decays (<= 0): ``[B, T, H]`` (per head, finite), ``[B, T, H, K]`` (per key
            channel: row i of S scales by ``exp(log_gamma[..., i])``), or None for no decay.
        S0: ``[B, H, K, V]`` initial state, or None for zeros; inclusive: o_t reads S_t (else S_{t-1}).
        chunk: chunk size C (per key channel: rounded down to a power of two); group: chunks per
            batched group G (default: temporaries near 512 KB on CPU, 64 elsewhere).
        documents: packed documents (``_Documents(cu_seqlens)``: B = 1, offsets ``[N + 1]``;
            S0 and S_T ``[N, H, K, V]``): each starts at a chunk, from its own state; or None.
        per_channel: whether log_gamma is per key channel; None: from its rank.
        log_input: ``[B, T, H]`` log input weights (token t adds ``exp(log_input_t) outer(k_t, v_t)``;
            per-head decays only), or None (weight 1).

    Returns:
        (o ``[B, T, H, V]`` or None, S_T ``[B, H, K, V]``); T = 0 gives an empty o and S0.  With
        ``log_input``: (o, S_T, m), o scaled by ``exp(-m)``, m ``[B, T, H]`` each output's
        stabiliser (None without q), S_T at its true scale.
    """
    (B, T, H, K), vs = k.shape, tuple(v) if isinstance(v, (tuple, list)) else (v,)
    V, BH, dt = sum(x.shape[-1] for x in vs), B * H, torch.promote_types(k.dtype, torch.float32)
    stab = log_input is not None                                     # max-stabilised exponential input weights
    if T == 0:
        return _additive_empty(q, k, vs[0], V, S0, stab)
    channel = per_channel if per_channel is not None else log_gamma is not None and log_gamma.dim() == 4
    if stab and channel:
        raise ValueError("log_input: the stabilised kernel takes one log decay per head [B, T, H]")
    C = max(1, min(int(chunk), T))
    if channel:                                                      # a power of two: halved level by level
        C = 1 << (C.bit_length() - 1)
    docs, S = _initial_states(S0, documents, C, B, (H, K, V), dt, k.device)
    q_in, k_in, lg_in, li_in, *vs = [q, k, log_gamma, log_input, *vs] if docs is None else [
        docs.lay(x) for x in [q, k, log_gamma, log_input, *vs]]    # (packed: the laid-out row)
    ms = S.new_zeros(BH) if stab else None   # the state carried as exp(-ms) S (0: S0 at its true scale)
    decayed = log_gamma is not None or stab                          # (decided operands first: the specialiser folds)
    groups = _chunk_groups(k_in.shape[1], C, _group_size(k_in.shape[1] // C, BH * C * max(K, V, C), group, k.device),
                           "power of two" if channel else None)   # (n, m, c): m tokens in c slots (a padded tail)
    grad = channel and torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in [q, k, S0, lg_in] + vs)
    if grad and q is not None and not torch._C._are_functorch_transforms_active():   # closed-form backward
        return _channel_finish(*_AdditiveChannel.apply(q_in, k_in, lg_in, S if docs is None else docs.S0, docs, groups,
                                                       inclusive, *vs), docs, (B, H, K, V), S0, vs[0].dtype)
    inplace = channel and not grad                                   # (no autograd: the factors in place)
    outs, m_outs, j0 = [], [], 0                                     # [B, n, m, H, V | 1] per group; chunks before
    for (n, m, c), qp, kp, vp, lp, ip in zip(groups, _split_groups(q_in, groups), _split_groups(k_in, groups),
                                              zip(*(_split_groups(x, groups) for x in vs)),
                                              _split_groups(lg_in, groups), _split_groups(li_in, groups)):
        vg = _additive_block(vp, n, c, BH, dt)                       # [nBH, c, V]
        if channel:
            KE, QF, P, og, h = _additive_channel_factors(qp, kp, lp, vg, n, c, BH, inclusive)
            KE, QF, P, og = _additive_halving(KE, QF, P, vg, og, q is not None, inclusive, inplace, h)
            kd, g_end, g_log, m_loc = KE, P.view(n, BH, K, 1), None, None   # decayed to the chunk end
        else:
            kg, lg, L, kd, g_log, g_end, li, m_loc = _additive_factors(kp, lp, ip, n, c, BH, dt, decayed, stab)
        step, true_scale, m_all, ms = _additive_maps(kd, vg, g_end, g_log, m_loc, ms, docs, j0, n, decayed, stab)
        S, starts, _ = _pass_states(step, n, S, docs, j0, true_scale)
        j0 += n
        if q is None:
            continue
        if channel:                                                  # + (q F_c) @ S_start
            og = torch.baddbmm(og, QF, _stacked(starts)) if og is not None else torch.bmm(QF, _stacked(starts))
        else:
            og, m_row = _additive_outputs(_additive_block([qp], n, c, BH, dt), kg, vg, _stacked(starts), inclusive,
                                          lg if decayed else None, L if decayed else None, li if stab else None,
                                          m_all[:-1].reshape(-1) if stab else None)
            if stab:
                m_outs.append(_token_major(m_row[..., None], B, H, m))   # [B, n, m, H, 1]
        outs.append(_token_major(og, B, H, m))                       # [B, n, m, H, V] (a view)
    return _additive_finish(outs, m_outs, S, ms, docs, (B, H, K, V), S0, vs[0].dtype, q is not None, stab)


def _channel_finish(o, S_T, docs, shape, S0, o_dtype):
    """``chunk_additive``'s returns with one log decay per key channel: the outputs (None without
    probes; packed: the documents' tokens) in dtype ``o_dtype``, the final state ``[B | N, H, K, V]`` in
    S0's dtype (or ``o_dtype``)."""
    S_T = (S_T if docs is not None else S_T.view(shape)).to(S0.dtype if S0 is not None else o_dtype)
    if o is None:
        return None, S_T
    return (o if docs is None else docs.unlay(o)).to(o_dtype), S_T


def _channel_groups(q, k, lg, vs, S, docs, groups, inclusive, inplace, keep):
    """The per-channel chunked forward over the groups: factors and the pairs inside each chunk
    (:func:`_additive_channel_factors`, :func:`_additive_halving`), the chunk maps, the outputs.

    Args:
        q: ``[B, T', H, K]`` probes, or None; k, lg: keys and log decays ``[B, T', H, K]``; vs: the
            value pieces ``[B, T', H, V_i]`` (the laid-out rows, packed); S: ``[B H, K, V]`` the state
            before the first chunk; docs: the packed documents' chunks, or None; groups: ``(n, m, c)``
            per group; inclusive: o_t reads S_t.
        inplace: update the factors in place (no autograd); keep: return the states at the chunks'
            starts.

    Returns:
        ``(o [B, T', H, V] or None, S_T [B H | N, ...], starts)``: the outputs in dtype of S, the final
        state (packed: the documents'), and per group ``[n B H, K, V]`` (empty unless ``keep``).
    """
    B, _, H, K = k.shape
    BH, dt = B * H, S.dtype
    outs, starts, j0 = [], [], 0
    for (n, m, c), qp, kp, vp, lp in zip(groups, _split_groups(q, groups), _split_groups(k, groups),
                                          zip(*(_split_groups(x, groups) for x in vs)), _split_groups(lg, groups)):
        vg = _additive_block(vp, n, c, BH, dt)                       # [nBH, c, V]
        KE, QF, P, og, h = _additive_channel_factors(qp, kp, lp, vg, n, c, BH, inclusive)
        KE, QF, P, og = _additive_halving(KE, QF, P, vg, og, q is not None, inclusive, inplace, h)
        step = _additive_maps(KE, vg, P.view(n, BH, K, 1), None, None, None, docs, j0, n, True, False)[0]
        S, st, _ = _pass_states(step, n, S, docs, j0)
        j0 += n
        S_starts = _stacked(st)                                      # [nBH, K, V]
        starts += [S_starts] if keep else []
        if q is not None:                                            # + (q F_c) @ S_start
            og = torch.baddbmm(og, QF, S_starts) if og is not None else torch.bmm(QF, S_starts)
            outs.append(_token_major(og, B, H, m))                   # [B, n, m, H, V] (a view)
    return (_join_chunks(outs) if q is not None else None), (docs.final() if docs is not None else S), starts


def _additive_empty(q, k, v0, V, S0, stab):
    """``chunk_additive``'s returns for T = 0: an empty o (None without probes), S0 (or zeros
    ``[B, H, K, V]``) and, stabilised, an empty m."""
    B, _, H, K = k.shape
    o = v0.new_zeros(B, 0, H, V) if q is not None else None
    S_T = S0 if S0 is not None else k.new_zeros(B, H, K, V, dtype=v0.dtype)
    if stab:
        return o, S_T, (k.new_zeros(B, 0, H, dtype=torch.promote_types(k.dtype, torch.float32)) if q is not None
                        else None)
    return o, S_T


def _additive_block(xs, n, c, BH, dt, pad=0.0):
    """Pieces ``[B, n m, H, D_i]`` -> ``[n B H, c, sum D_i]`` in dtype ``dt``, one copy; chunk-major:
    chunk j of the group is the batch slice ``[j BH, (j + 1) BH)``; a tail of m < c tokens is padded
    with c - m tokens of value ``pad``."""
    parts = [_chunk_major(x.to(dt), n, c, pad) for x in xs]
    x = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
    return x.reshape(n * BH, c, x.shape[-1]).contiguous()


def _additive_factors(kp, lp, ip, n, c, BH, dt, decayed, stab):
    """A group's factors in ``chunk_additive`` with one log decay per head (or none).

    The pair weights ``exp(Lq_t - L_s)`` are one ``[C, C]`` matrix per chunk
    (:func:`_additive_outputs`); the keys are decayed to the chunk end by the log decay after each
    token, a reversed cumulative sum (never a difference of two cumulative sums), so a log decay
    of -inf (a decay of exactly 0) zeroes the past exactly.  With exponential input weights
    (``stab``: xLSTM's mLSTM) each key's log weight in the chunk-end state, ``L_C - L_s +
    log_input_s``, is scaled by the chunk's maximum ``m_loc`` (:func:`_additive_maps` carries it).

    Args:
        kp: the group's keys ``[B, n m, H, K]``; lp, ip: its log decays and log input weights
            ``[B, n m, H]`` (None where absent).
        n, c, BH, dt: the group's chunks, slots per chunk, B H, the kernel's dtype.
        decayed: a decay or input weights enter; stab: the input weights do.

    Returns:
        ``(kg, lg, L, kd, g_log, g_end, li, m_loc)``: the keys ``[nBH, c, K]``, the log decays and
        their cumulative sums ``[nBH, c]``, the keys decayed to the chunk end (stabilised: scaled by
        ``exp(-m_loc)``), the log decay over each chunk ``[n, BH]``, its decay ``[n, BH, 1, 1]`` (not
        stabilised), the log input weights ``[nBH, c]`` and ``m_loc [n, BH]`` (the factors a form
        lacks: None).
    """
    kg = _additive_block([kp], n, c, BH, dt)                         # [nBH, c, K]
    if not decayed:
        return kg, None, None, kg, None, None, None, None
    lg = (_additive_block([lp[..., None]], n, c, BH, dt)[..., 0] if lp is not None
          else kg.new_zeros(n * BH, c))                              # [nBH, c] log decays (may be -inf)
    L = torch.cumsum(lg, dim=1)                                      # [nBH, c] cumulative log decay
    # the log decay after each token to the chunk end: a reversed cumsum, shifted (no difference)
    after = torch.nn.functional.pad(torch.cumsum(lg.flip(1), 1).flip(1)[:, 1:], (0, 1))
    g_log = L[:, -1].view(n, BH)                                     # [n, BH] log decay over each chunk
    if stab:                                                         # log weight of each token in the chunk-end
        li = _additive_block([ip[..., None]], n, c, BH, dt)[..., 0]  # state; [nBH, c] log input weights
        w_end = after + li
        m_loc = w_end.detach().amax(1).clamp_min(-1e30)              # [nBH] its stabiliser (-inf rows: any)
        kd = kg * torch.exp(w_end - m_loc[:, None])[..., None]       # scaled by exp(-m_loc)
        return kg, lg, L, kd, g_log, None, li, m_loc.view(n, BH)
    kd = kg * torch.exp(after)[..., None]                            # keys decayed to the chunk end
    return kg, lg, L, kd, g_log, torch.exp(g_log).view(n, BH, 1, 1), None, None


def _additive_channel_factors(qp, kp, lp, vg, n, c, BH, inclusive):
    """A group's factors in ``chunk_additive`` with one log decay per key channel, and the first level
    of :func:`_additive_halving` (blocks of 2 tokens), read from the inputs' chunk-major views: the
    keys ``KE = k E_2`` and probes ``QF = q F_2`` (``E_2``: the decay of the token after it in its
    pair, else 1; ``F_2``: its pair's decays up to it, the token's own one when its probe reads the
    state after it), each pair's decay ``P`` (a padded tail token: 1) and the outputs of the pairs
    s = t (inclusive: they weigh 1) and (s, t) = (2i, 2i + 1).  A chunk of one token (c = 1) has no
    pairs: level 1's factors (``E_1 = 1``, ``F_1``), each token's decay.

    Args:
        qp: the group's probes ``[B, n m, H, K]``, or None; kp: its keys; lp: its log decays
            ``[B, n m, H, K]``; vg: ``[nBH, c, V]`` its values.
        n, c, BH: the group's chunks, slots per chunk, B H.
        inclusive: o_t reads S_t.

    Returns:
        ``(KE, QF, P, og, h)``: KE, QF ``[nBH, c, K]`` (QF None without probes), P ``[nBH c / h, 1,
        K]``, og ``[nBH, c, V]`` (None without probes), h the level the halving goes on from.
    """
    dt, K, V = vg.dtype, kp.shape[-1], vg.shape[-1]
    gam_t = torch.exp(lp.to(dt))                                     # [B, n m, H, K] decay of each token
    diag = (qp.to(dt) * kp.to(dt)).sum(-1, keepdim=True) if qp is not None and inclusive else None   # [B, n m, H, 1]
    if c == 1:
        KE, P = _additive_block([kp], n, c, BH, dt), _additive_block([gam_t], n, c, BH, dt, 1.0)   # [nBH, 1, K]
        if qp is None:
            return KE, None, P, None, 1
        QF = _additive_block([qp.to(dt) * gam_t if inclusive else qp], n, c, BH, dt)
        return KE, QF, P, _additive_block([diag], n, c, BH, dt) * vg if inclusive else None, 1

    def pairs(x, pad=0.0):   # [B, n m, H, D] -> the even and the odd tokens of each chunk [n, B, H, c / 2, D] (views)
        return _chunk_major(x.to(dt), n, c, pad).unflatten(3, (c // 2, 2)).unbind(4)
    g1, g2 = pairs(gam_t, 1.0)
    k1, k2 = pairs(kp)
    g12 = g1 * g2                                                    # [n, B, H, c / 2, K] each pair's decay
    KE = torch.stack([k1 * g2, k2], 4).view(n * BH, c, K)            # one copy into the blocks
    P = g12.reshape(n * BH * c // 2, 1, K)
    if qp is None:
        return KE, None, P, None, 2
    q1, q2 = pairs(qp)
    if inclusive:
        q2 = q2 * g2                                                 # the odd probes read after their own decay
    QF = torch.stack([q1 * g1 if inclusive else q1, q2 * g1], 4).view(n * BH, c, K)
    score = (q2 * k1).sum(-1, keepdim=True).reshape(n * BH, c // 2, 1)   # [nBH, c / 2, 1] the pair (2i, 2i + 1)
    v1, v2 = vg.view(n * BH, c // 2, 2, V).unbind(2)                 # [nBH, c / 2, V]
    if inclusive:                                                    # + the pairs s = t
        d1, d2 = _additive_block([diag], n, c, BH, dt).view(n * BH, c // 2, 2, 1).unbind(2)
        og = torch.stack([d1 * v1, torch.addcmul(d2 * v2, score, v1)], 2)
    else:
        og = torch.stack([torch.zeros_like(v1), score * v1], 2)
    return KE, QF, P, og.view(n * BH, c, V), 2


def _additive_maps(kd, vg, g_end, g_log, m_loc, ms, docs, j0, n, decayed, stab):
    """The chunk maps of a group of n chunks in ``chunk_additive``, ``S <- Diag(g_j) S + K_j^T V_j``,
    forward in the chunks (a non-finite increment reaches only later chunks).

    With exponential input weights (``stab``) the state between chunks is carried as ``exp(-m) S``
    (Beck et al. 2024, the mLSTM's m state), ``m <- max(L_C + m, m_loc)`` (a document's first chunk
    starts from 0: its state at its true scale), so every ``exp`` has an exponent <= 0: finite for
    any log input.  The stabilisers are constants to autograd (the true function does not depend
    on them).

    Args:
        kd: ``[nBH, c, K]`` the keys decayed to the chunk end; vg: ``[nBH, c, V]`` the values.
        g_end: ``[n, BH, 1 | K, 1]`` the decay over each chunk, or None (no decay; stabilised: from
            g_log); g_log, m_loc: ``[n, BH]`` the log decay over each chunk and its stabiliser
            (stabilised; else None).
        ms: ``[BH]`` the stabiliser before the group (stabilised; else None).
        docs, j0: the packed documents' chunks (or None) and the chunks before this group.
        decayed, stab: a decay enters; the input weights are stabilised.

    Returns:
        ``(step, true_scale, m_all, m)``: chunk j's map for ``_pass_states``, the state at its true
        scale (stabilised; else None), the stabilisers at the chunks' starts and end ``[n + 1, BH]``
        and the one after the group (stabilised; else None).
    """
    BH = kd.shape[0] // n
    kv = torch.bmm(kd.transpose(1, 2), vg).view(n, BH, kd.shape[-1], vg.shape[-1])   # chunk increments K_j^T V_j
    g, m, m_all = g_end, ms, None
    if stab:   # (a scale: no gradient)
        m_list = []
        for j in range(n):
            if docs is not None and j0 + j in docs.first:
                m = torch.zeros_like(m)                              # a document's state: its true scale
            m_list.append(m)
            m = torch.maximum(g_log[j].detach() + m, m_loc[j])       # [BH]
        m_all = torch.stack(m_list + [m])                            # [n + 1, BH] at each chunk's start
        g = torch.exp(g_log + m_all[:-1] - m_all[1:]).view(n, BH, 1, 1)   # every exponent <= 0
        kv = kv * torch.exp(m_loc - m_all[1:]).view(n, BH, 1, 1)
    # each map closes over assigned locals only (torch.compile)
    step = (lambda j, S: (torch.addcmul(kv[j], g[j], S), None)) if decayed else (lambda j, S: (S + kv[j], None))
    true_scale = (lambda j, S: S * torch.exp(m_all[j + 1]).view(BH, 1, 1)) if stab else None   # (its true scale)
    return step, true_scale, m_all, m


def _additive_finish(outs, m_outs, S, ms, docs, shape, S0, o_dtype, probes, stab):
    """``chunk_additive``'s returns: the outputs of the groups joined (packed: the documents' tokens;
    None without probes; in dtype ``o_dtype``), the final state at its true scale ``[B | N, H, K, V]``
    (in S0's dtype, or ``o_dtype``) and, stabilised, the outputs' stabilisers ``[B, T, H]``."""
    out_dtype = S0.dtype if S0 is not None else o_dtype
    if docs is not None:
        S_out = docs.final().to(out_dtype)
    else:                                                            # (stabilised: back to the true scale)
        S_out = (S * torch.exp(ms).view(-1, 1, 1) if stab else S).view(shape).to(out_dtype)
    if not probes:
        return (None, S_out, None) if stab else (None, S_out)
    o = _join_chunks(outs)                                           # [B, T', H, V]
    o = (o if docs is None else docs.unlay(o)).to(o_dtype)          # (packed: the documents' tokens)
    if stab:
        mo = _join_chunks(m_outs)
        return o, S_out, (mo if docs is None else docs.unlay(mo))[..., 0]
    return o, S_out


def _additive_outputs(qg, kg, vg, S_starts, inclusive, lg=None, L=None, li=None, m0=None):
    """The outputs of a group of chunks with one log decay per head (``chunk_additive``):
    ``o_t = (q_t exp(Lq_t)) @ S_start + sum_{s <= t} exp(seg_ts) (q_t . k_s) v_s``.

    Args:
        qg, kg: ``[nBH, c, K]`` probes and keys; vg: ``[nBH, c, V]`` values; S_starts: ``[nBH, K, V]``
            the states at the chunks' starts.
        inclusive: True: o_t reads S_t; False: S_{t-1}.
        lg, L: ``[nBH, c]`` the log decays and their cumulative sums in the chunk, or None (no decay).
        li: ``[nBH, c]`` the log input weights (the stabilised form), or None; m0: ``[nBH]`` the
            chunks' start stabilisers.

    Returns:
        ``(o [nBH, c, V], m)``: with ``li``, o scaled by ``exp(-m)``, m ``[nBH, c]`` each row's
        stabiliser; else m is None.
    """
    c = qg.shape[1]
    d = 0 if inclusive else -1                                       # pairs s <= t (s < t)
    scores = torch.bmm(qg, kg.transpose(1, 2))                       # [nBH, c, c]
    m_row = None
    if lg is not None:
        # segment sums seg[t, s] = sum of lg_u over s < u <= t (u < t if exclusive): the log
        # decay of the pair, a masked cumulative sum (0 above the diagonal: exp(0) = 1, masked after)
        later = torch.ones(c, c, dtype=torch.bool, device=lg.device).tril(-1)   # u > s
        seg = torch.cumsum(lg[:, :, None].expand(-1, c, c).masked_fill(~later, 0.0), dim=1)
        Lq = L                                                       # [nBH, c] the log decay a probe sees
        if not inclusive:                                            # row t reads through t - 1
            seg = torch.nn.functional.pad(seg[:, :-1], (0, 0, 1, 0))
            Lq = torch.nn.functional.pad(L[:, :-1], (1, 0))
        if li is not None:  # row t: its log weights (the start state's, each pair's), scaled by their max
            pairs = torch.ones(c, c, dtype=torch.bool, device=lg.device).tril(d)
            lw = (seg + li[:, None, :]).masked_fill_(~pairs, float("-inf"))   # [nBH, c, c]
            a = Lq + m0[:, None]                                     # [nBH, c]
            m_row = torch.maximum(a.detach(), lw.detach().amax(-1)).clamp_min(-1e30)
            decay = torch.exp(lw.sub_(m_row[..., None]))
            qg = qg * torch.exp(a - m_row)[..., None]                # [nBH, c, K] decayed probes
        else:
            decay = torch.exp(seg)
            qg = qg * torch.exp(Lq)[..., None]                       # [nBH, c, K] decayed probes
        scores = (scores * decay).tril_(d)
    else:
        scores = scores.tril_(d)
    # the triangular product with v: its non-finite entries go around it, from their row on
    v_ok = torch.nan_to_num(vg, 0.0, 0.0, 0.0)                       # [nBH, c, V]
    v_sum = vg.sum(-1, keepdim=True)                                 # [nBH, c, 1] non-finite iff the row is
    v_bad = torch.cumsum(v_sum - v_sum, dim=1)                       # [nBH, c, 1] 0, or nan from s on
    if not inclusive:
        v_bad = torch.nn.functional.pad(v_bad[:, :-1], (0, 0, 1, 0))   # ... from s + 1 on
    return torch.baddbmm(torch.bmm(qg, S_starts), scores, v_ok).add_(v_bad), m_row   # [nBH, c, V]


def _additive_halving(KE, QF, P, vg, og, probes, inclusive, inplace, h):
    """The pairs of per-channel chunks of ``chunk_additive``, halved level by level: in a block of 2h
    tokens a pair (t in the second half, s in the first) weighs ``E_h(s) F_h(t)``; all pairs of a
    level are one batched ``(q F) (k E)^T`` product applied to the first halves' values, and
    ``KE = k E``, ``QF = q F`` pass to the next level by one product with the halves' decays.

    Args:
        KE, QF: ``[nBH, c, K]`` ``k E_h`` and ``q F_h`` (QF None without probes); P: ``[nBH c / h, 1,
            K]`` the decay of each h-block; vg: ``[nBH, c, V]`` values; og: ``[nBH, c, V]`` the outputs
            of the pairs inside the h-blocks, or None.
        probes: whether there are probes (their outputs are computed); inclusive: o_t reads S_t.
        inplace: update the factors in place (no autograd).
        h: the level to start from (:func:`_additive_channel_factors` did the levels below).

    Returns:
        ``(KE, QF, P, og)``: the keys decayed to the chunk end and the probes' decays from its start, the
        decay over each chunk ``[nBH, 1, K]``, the outputs of the chunk's pairs (None without probes).
    """
    nBH, c, K = KE.shape
    V = vg.shape[-1]
    while h < c:
        nb = nBH * c // (2 * h)                              # blocks of 2h tokens
        k1, k2 = KE.view(nb, 2, h, K).unbind(1)              # [nb, h, K]: the halves' k E
        p1, p2 = P.view(nb, 2, 1, K).unbind(1)               # [nb, 1, K]: the halves' decays
        if probes:
            q1, q2 = QF.view(nb, 2, h, K).unbind(1)          # [nb, h, K]: the halves' q F
            v1 = vg.view(nb, 2, h, V)[:, 0]                  # [nb, h, V]
            o2 = og.view(nb, 2, h, V)[:, 1]                  # [nb, h, V] second halves
            if h > 2:
                o2.add_(torch.bmm(torch.bmm(q2, k1.transpose(1, 2)), v1))
            else:                                            # blocks of 4 tokens: column by column
                scores = torch.bmm(q2, k1.transpose(1, 2))   # [nb, 2, 2]
                cols = [(scores[:, :, j:j + 1], v1[:, j:j + 1]) for j in range(h)]   # [nb, 2, 1], [nb, 1, V]
                # out of place until og depends on q, k, v and the decays: in place after (vmap)
                if not inclusive:
                    o2 = o2 + sum(a * b for a, b in cols)
                    og = torch.stack([og.view(nb, 2, h, V)[:, 0], o2], 1).view(nb, 2 * h, V)
                else:
                    for a, b in cols:
                        o2.addcmul_(a, b)
        # to blocks of 4h: first halves' E picks up the second half's decay, second halves' F the first's
        # in place (KE and QF are copies that depend on the decays: vmap)
        if inplace:
            k1.mul_(p2)
            if probes:
                q2.mul_(p1)
        else:
            KE = torch.stack([k1 * p2, k2], 1).view(nBH, c, K)
            QF = torch.stack([q1, q2 * p1], 1).view(nBH, c, K) if probes else None
        P = p1 * p2                                          # [nb, 1, K]
        h *= 2
    return KE, QF, P, og.view(nBH, c, V) if og is not None else None


class _AdditiveChannel(torch.autograd.Function):
    """The per-channel chunked kernel (:func:`_channel_groups`, in place) with a closed-form backward.

    Inside a chunk, with ``L_t`` the cumulative log decays from its start (per key channel), the
    kernel computes ``o_t = (q_t F_t) @ S_0 + sum_{s <= t} (sum_i q_ti k_si exp(L_ti - L_si)) v_s`` and
    ``S_c = Diag(P) S_0 + sum_s (k_s E_s)^T v_s`` with ``F_t = exp(L_t)`` (exclusive: ``exp(L_{t-1})``,
    s < t), ``E_s = exp(L_c - L_s)``, ``P = exp(L_c)``.  Given ``dO`` and ``dS_c`` (the gradient of the
    chunk's end state, carried back from the chunks after it):

    * ``dS_0 = Diag(P) dS_c + (q F)^T dO`` carries the gradient to the chunk before (packed: a
      document's first chunk gives it to that document's initial state, its last one takes its final
      state's gradient instead);
    * ``dq_t = (dO_t S_0^T) F_t + sum_s (dO_t . v_s) k_s exp(L_t - L_s)``, ``dk_s = (v_s dS_c^T) E_s +
      sum_t (dO_t . v_s) q_t exp(L_t - L_s)``, ``dv_s = (k_s E_s) dS_c + sum_t A_ts dO_t``: the pairs
      are halved level by level as the forward halves them (:func:`_channel_levels`): in a block of
      2h tokens, the pairs (t in the second half, s in the first) weigh ``(q_t F_h(t)) . (k_s
      E_h(s))`` with ``F_h``, ``E_h`` products of decays inside the halves, so each level is four
      products (the scores, ``dO v^T``, and their products with the factors; batched matrix products,
      or column by column in blocks of 2 and 4 tokens), every weight a product of decays <= 1 (finite
      for any log decay);
    * the log decays: a weight that holds the decay of token u (``d/d log g_u`` of a product that holds
      ``g_u`` is the product's own term) is a level's pair that spans u inside its halves (t >= u, or
      t > u exclusive, in the second half; s < u in the first: ``(q_t F_h(t)) dq_h(t)``, ``(k_s
      E_h(s)) dk_h(s)``, the pair's terms of ``dq``, ``dk`` before they are scaled by the factors), a
      read of the chunk's start state by a probe t >= u (``(q_t F_t) (dO_t S_0^T)``), a key s < u of
      the end state (``(k_s E_s) (v_s dS_c^T)``) and ``P`` (``sum_v (Diag(P) S_0 dS_c)_{iv}``): the
      gradient sums these terms (by positions or triangular products), never a difference.  (The
      shorter ``q dq - k dk`` summed from u to the chunk's end, flash-linear-attention's chunked GLA
      backward, subtracts the terms of the pairs that do not span u: their rounding swamps a gradient
      of 1e-9 next to terms of 1 after a log decay of -20.)  A decay of 0 (log decay -inf) gets a
      gradient of exactly 0: every term that holds it is a product with 0.

    Saved: the inputs and the states at the chunks' starts (what autograd would keep of the forward);
    recomputed: the factors of every level (elementwise products of decays, cheaper than keeping
    ``log2 C`` copies of them).  A differentiable backward (create_graph: second derivatives) runs
    the forward again with autograd through the groups (:func:`_channel_groups`) and differentiates
    that, so second derivatives are those of the plain path.
    """

    @staticmethod
    def forward(ctx, q, k, lg, S, docs, groups, inclusive, *vs):
        """-> (o ``[B, T', H, V]``, S_T ``[B H | N, ...]``) in the dtype of S (S: the state before the first
        chunk ``[B H, K, V]``, or packed the documents' initial states ``docs.S0``)."""
        S_run = S if docs is None else S.new_zeros(k.shape[0] * k.shape[2], *S.shape[-2:])
        o, S_T, starts = _channel_groups(q, k, lg, vs, S_run, docs, groups, inclusive, True, True)
        ctx.save_for_backward(q, k, lg, S, *vs)
        ctx.starts, ctx.docs, ctx.groups, ctx.inclusive = starts, docs, groups, inclusive
        return o, S_T

    @staticmethod
    def backward(ctx, do, dS_T):
        q, k, lg, S, *vs = ctx.saved_tensors
        if torch.is_grad_enabled():   # second derivatives: the plain path, differentiated in the graph
            ins = (q, k, lg, S, *vs)
            S_run = S if ctx.docs is None else S.new_zeros(k.shape[0] * k.shape[2], *S.shape[-2:])
            o, S_out, _ = _channel_groups(q, k, lg, vs, S_run, ctx.docs, ctx.groups, ctx.inclusive, False, False)
            want = [x.requires_grad for x in ins]
            got = iter(torch.autograd.grad((o, S_out), [x for x, w in zip(ins, want) if w], (do, dS_T),
                                           create_graph=True, allow_unused=True))
            g = [next(got) if w else None for w in want]
        else:
            g = _channel_backward(q, k, lg, vs, S, ctx.starts, ctx.docs, ctx.groups, ctx.inclusive, do, dS_T)
        return (*g[:4], None, None, None, *g[4:])


def _channel_backward(q, k, lg, vs, S, starts, docs, groups, inclusive, do, dS_T):
    """The gradients of :class:`_AdditiveChannel` (its docstring derives them): the groups in reverse,
    each chunk's end-state gradient carried back over the chunks.

    Returns the gradients of ``(q, k, lg, S, *vs)``, each in its input's dtype and layout.
    """
    B, _, H, K = k.shape
    BH, dt, widths = B * H, S.dtype, [x.shape[-1] for x in vs]
    dS0 = torch.zeros_like(S) if docs is not None else None         # [N, H, K, V] packed
    dS = S.new_zeros(BH, K, sum(widths)) if docs is not None else dS_T.to(dt).reshape(BH, K, -1)
    parts, j1 = [], sum(n for n, _, _ in groups)
    for (n, m, c), qp, kp, lp, dop, vp, S_starts in reversed(list(zip(
            groups, _split_groups(q, groups), _split_groups(k, groups), _split_groups(lg, groups),
            _split_groups(do, groups), zip(*(_split_groups(x, groups) for x in vs)), starts))):
        j1 -= n
        qg, kg = _additive_block([qp], n, c, BH, dt), _additive_block([kp], n, c, BH, dt)   # [nBH, c, K]
        gam = _additive_block([torch.exp(lp.to(dt))], n, c, BH, dt, 1.0)   # [nBH, c, K] (a padded tail: 1)
        vg, dog = _additive_block(vp, n, c, BH, dt), _additive_block([dop], n, c, BH, dt)   # [nBH, c, V]
        dq, dk, dv, dlg, F, E, P = _channel_levels(qg, kg, gam, vg, dog, inclusive)
        QF, KE = qg * F, kg * E                                      # [nBH, c, K]
        carried = torch.bmm(QF.transpose(1, 2), dog).view(n, BH, K, -1)   # (q F)^T dO per chunk
        ends = []                                                    # dS_c per chunk, last first
        for j in reversed(range(n)):
            if docs is not None and j1 + j in docs.last:             # a document's final state
                dS = dS_T[docs.last[j1 + j]].to(dt).reshape(BH, K, -1)
            ends.append(dS)
            dS = torch.addcmul(carried[j], P.view(n, BH, K, 1)[j], dS)   # dS_0 = Diag(P) dS_c + (q F)^T dO
            if docs is not None and j1 + j in docs.first:            # a document's initial state
                dS0[docs.first[j1 + j]] += dS.view(dS0.shape[1:])
                dS = torch.zeros_like(dS)
        dSe = _stacked(ends[::-1])                                   # [nBH, K, V]
        dQF = torch.bmm(dog, S_starts.transpose(1, 2))               # [nBH, c, K] dO S_0^T
        dq.addcmul_(dQF, F)
        dKE = torch.bmm(vg, dSe.transpose(1, 2))                     # [nBH, c, K] v dS_c^T
        dk.addcmul_(dKE, E)
        dv.add_(torch.bmm(KE, dSe))
        # the log decays: token u is in F_t for t >= u (exclusive t > u), in E_s for s < u, and in P
        ones = torch.ones(c, c, dtype=dt, device=k.device)           # (triangular products: sums over t, s)
        dlg.add_(torch.matmul(ones.triu(1 - inclusive), QF * dQF)).add_(torch.matmul(ones.tril(-1), KE * dKE))
        dlg.add_((P[:, 0] * (S_starts * dSe).sum(-1))[:, None])      # sum_v (Diag(P) S_0 dS_c)
        parts.append([_token_major(x, B, H, m) for x in (dq, dk, dlg, dv)])
    dq, dk, dlg, dv = [_join_chunks(list(p)[::-1]) for p in zip(*parts)]   # [B, T', H, K | V]
    if docs is None:
        dS0 = dS.view(S.shape)
    else:                                                            # an empty document keeps its state
        for i in set(range(dS0.shape[0])) - set(docs.first.values()):
            dS0[i] += dS_T[i].to(dt)
    return (dq.to(q.dtype), dk.to(k.dtype), dlg.to(lg.dtype), dS0.to(S.dtype),
            *(x.to(y.dtype) for x, y in zip(dv.split(widths, -1), vs)))


def _channel_levels(qg, kg, gam, vg, dog, inclusive):
    """The gradients of a group's pairs inside each chunk (``o_t = sum_{s <= t} A_ts v_s``, see
    :class:`_AdditiveChannel`), halved level by level as :func:`_additive_halving` computes them, and
    the chunks' factors.

    Args:
        qg, kg: ``[nBH, c, K]`` probes and keys; gam: ``[nBH, c, K]`` the decays (a padded tail: 1);
            vg, dog: ``[nBH, c, V]`` the values and the outputs' gradients (c a power of two).
        inclusive: o_t reads S_t (the pairs s = t weigh 1).

    Returns:
        ``(dq, dk, dv, dlg, F, E, P)``: the pairs' gradients ``[nBH, c, K | V]`` (``dlg`` the log decays':
        a pair (t, s) of a level weighs the decays of the tokens between them in its halves, so token u
        of the second half gets the pairs of t >= u (exclusive t > u), of the first half those of s <
        u: sums of the pairs' own terms, by triangular products), each token's decay from the chunk's
        start ``F`` (inclusive: its own one too) and to its end ``E`` ``[nBH, c, K]``, the decay over
        each chunk ``P`` ``[nBH, 1, K]``.
    """
    nBH, c, K = kg.shape
    V = vg.shape[-1]
    F = gam.clone() if inclusive else torch.ones_like(gam)          # level 1: within the token
    E = torch.ones_like(gam)
    P = gam.reshape(nBH * c, 1, K)                                   # each 1-block's decay
    if inclusive:                                                    # the pairs s = t
        dd = (dog * vg).sum(-1, keepdim=True)                        # [nBH, c, 1] dO_t . v_t
        dq, dk, dv = dd * kg, dd * qg, (qg * kg).sum(-1, keepdim=True) * dog
    else:
        dq, dk, dv = torch.zeros_like(qg), torch.zeros_like(kg), torch.zeros_like(vg)
    dlg = torch.zeros_like(kg)                                       # (the pairs s = t weigh 1: none)
    h = 1
    while h < c:
        nb = nBH * c // (2 * h)                                      # blocks of 2h tokens
        F2, E1 = F.view(nb, 2, h, K)[:, 1], E.view(nb, 2, h, K)[:, 0]   # second halves' F, first halves' E
        qf = qg.view(nb, 2, h, K)[:, 1] * F2                         # [nb, h, K] q F_h (second halves)
        ke = kg.view(nb, 2, h, K)[:, 0] * E1                         # [nb, h, K] k E_h (first halves)
        v1, do2 = vg.view(nb, 2, h, V)[:, 0], dog.view(nb, 2, h, V)[:, 1]
        if h <= 2:            # small blocks: column by column (batched products of tiny matrices are slow)
            kes, v1s = ke.split(1, 1), v1.split(1, 1)                # [nb, 1, K | V] each first-half token s
            dov = [(do2 * x).sum(-1, keepdim=True) for x in v1s]     # [nb, h, 1] dO_t . v_s
            dv.view(nb, 2, h, V)[:, 0].add_(torch.cat([((qf * x).sum(-1, keepdim=True) * do2).sum(1, keepdim=True)
                                                       for x in kes], 1))   # sum_t A_ts dO_t
            dqf = sum(d * x for d, x in zip(dov, kes))               # [nb, h, K]
            dke = torch.cat([(d * qf).sum(1, keepdim=True) for d in dov], 1)
        else:                 # [nb, h, h] A_ts and dO_t . v_s, then the pairs' gradients of v, q F and k E
            scores, dov = torch.bmm(qf, ke.transpose(1, 2)), torch.bmm(do2, v1.transpose(1, 2))
            dv.view(nb, 2, h, V)[:, 0].add_(torch.bmm(scores.transpose(1, 2), do2))
            dqf, dke = torch.bmm(dov, ke), torch.bmm(dov.transpose(1, 2), qf)   # [nb, h, K]
        dq.view(nb, 2, h, K)[:, 1].addcmul_(dqf, F2)
        dk.view(nb, 2, h, K)[:, 0].addcmul_(dke, E1)
        # the log decays: each token sums the pairs that span it, t >= u (exclusive t > u) in the second
        # half, s < u in the first (a cumulative sum over a middle axis is slow on CPU: by positions, or
        # a triangular product)
        a, b = dqf.mul_(qf), dke.mul_(ke)                            # [nb, h, K] each pair's terms
        if h <= 4:
            for j in range(h - 2, -1, -1):
                a[:, j].add_(a[:, j + 1])                            # sum_{t >= u}
                b[:, h - 1 - j].add_(b[:, h - 2 - j])                # sum_{s <= u}
        else:
            ones = torch.ones(h, h, dtype=a.dtype, device=a.device)
            a, b = torch.matmul(ones.triu(), a), torch.matmul(ones.tril(), b)
        dlg.view(nb, 2, h, K)[:, 1, :h - 1 + inclusive].add_(a[:, 1 - inclusive:])
        dlg.view(nb, 2, h, K)[:, 0, 1:].add_(b[:, :-1])
        p1, p2 = P.view(nb, 2, 1, K).unbind(1)                       # [nb, 1, K] the halves' decays
        F2.mul_(p1)                                                  # to blocks of 4h
        E1.mul_(p2)
        P = p1 * p2
        h *= 2
    return dq, dk, dv, dlg, F, E, P.view(nBH, 1, K)
