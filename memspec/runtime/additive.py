"""Exact chunked kernel of the additive family, and its token-loop reference.

See :mod:`memspec.runtime` for the rules every kernel here follows (standalone, torch only,
log decays, float32 arithmetic, groups of chunks, causal masks that no future value crosses).
"""
from __future__ import annotations

import torch

from .phases import (_chunk_groups, _chunk_major, _group_size, _join_chunks, _pass_states, _split_groups, _stacked,
                     _token_major)


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

    Inside a chunk with cumulative log decays ``L_t`` (per head, or per key channel) and
    ``Lq_t = L_t`` (``inclusive=False``: ``L_{t-1}``, and pairs ``s < t`` instead of ``s <= t``):
    ``o_t = (q_t * exp(Lq_t)) @ S_start + sum_{s <= t} (sum_i q_ti k_si exp(Lq_ti - L_si)) v_s`` and
    ``S_end = Diag(exp(L_C)) S_start + sum_s outer(k_s * exp(L_C - L_s), v_s)``.
    Every weight is the decay from an earlier token to a later one (<= 1): nothing overflows,
    whatever the decays.

    * One log decay per head (``[B, T, H]``: RetNet, Mamba-2): the pair weights
      ``exp(Lq_t - L_s)`` are one ``[C, C]`` matrix per chunk (masked after the product), applied
      to the scores ``q k^T``.  Their exponents are segment sums of the log decays between s and
      t (a masked cumulative sum, never a difference of two cumulative sums), so a log decay of
      -inf (a decay of exactly 0) zeroes the past exactly and no ``-inf - -inf`` arises.
    * An exponential input weight per head (``log_input``, ``[B, T, H]``: xLSTM's mLSTM,
      ``S_t = gamma_t S_{t-1} + exp(log_input_t) outer(k_t, v_t)``): the weights are kept in log
      space and the kernel carries a max stabiliser ``m`` (Beck et al. 2024, the mLSTM's m
      state): the state between chunks is ``exp(-m) S``, ``m`` following
      ``m <- max(L_C + m, max_s (L_C - L_s + log_input_s))``, and each output row is scaled by
      ``exp(-m_t)``, ``m_t`` the running maximum of its own log weights (the start state's and
      every pair's), so every ``exp`` has an exponent <= 0: finite for any log input.  The
      stabilisers are constants to autograd (the true function does not depend on them).
      Scalar decays only.
    * One per key channel (``[B, T, H, K]``: GLA, RWKV-6, HGRN-2): the weights differ per
      channel, so no ``[C, C]`` matrix serves.  The chunk (a power of two: ``chunk`` is rounded
      down to one, and a shorter tail is padded with zero tokens) is halved level by level:
      in a block of 2h tokens, a pair (t in the second half, s in the first) weighs
      ``E_h(s) F_h(t)``, E_h(s) the product of the decays after s to the end of the first half,
      F_h(t) the product from the second half's start through t (to t - 1 if exclusive); all
      such pairs of a level are one batched ``(q F) (k E)^T`` matmul applied to the first
      halves' values, and ``[k E | q F]`` passes to the next level by one product with the
      halves' decays.  The pairs s = t (inclusive) weigh 1.  So only products of decays enter,
      one ``exp`` per token and channel: no per-channel ``[C, C, K]`` tensor, no cancellation
      in long cumulative sums, and a log decay of -inf (a decay of exactly 0) is exact.
      Without autograd the factors are updated in place.

    Chunks are processed G at a time (on CPU, G is chosen so that each temporary stays near
    512 KB: large per-call allocations are returned to the OS and page-faulted back on every
    call; on other devices G = 64).  Within a group every product is one batched matmul over
    (chunks, B, H): the scores, the chunk increments ``K_j^T V_j``, the reads of the chunk-start
    states; the states themselves follow ``S <- Diag(exp(L_C)) S + K_j^T V_j``, one fused
    elementwise step per chunk.  In-place writes go only into tensors that depend on every
    input, so ``torch.func.grad`` and ``vmap`` work.

    Causality with non-finite inputs: a NaN or inf in token t's inputs changes no output before
    t.  Masks are applied after products, never by multiplying a future value by zero.  The
    per-head weights are one dense triangular product with v: v's non-finite entries are taken
    out of it (``nan_to_num``) and put back, through a prefix sum, into the whole rows of o from
    t to the chunk's end; later chunks see them through the state, as the token loop does.  Per
    channel no pair is masked at all, and the non-finite entries are exactly the loop's.

    Args:
        q: ``[B, T, H, K]`` probes, or None (state only).
        k: ``[B, T, H, K]``; v: ``[B, T, H, V]``, or a tuple of ``[B, T, H, V_i]`` read as their
            concatenation on the last axis (``V = sum V_i``) without a full-size copy.
        log_gamma: log decays (<= 0): ``[B, T, H]`` (per head, finite), ``[B, T, H, K]`` (per key
            channel: row i of S scales by ``exp(log_gamma[..., i])``), or None for no decay.
        S0: ``[B, H, K, V]`` initial state, or None for zeros.
        chunk: chunk size C.
        inclusive: True: o_t reads S_t; False: o_t reads S_{t-1} (RWKV-6's read; its bonus
            term is token-local and computed outside the kernel).
        group: chunks per batched group G (default: as above); any G >= 1
            gives the same numbers.
        per_channel: whether log_gamma is per key channel; None: from its rank.  A generated
            module passes its decay's kind, so that its specialised kernel keeps one path.
        documents: packed documents (``_Documents(cu_seqlens)``: B = 1, offsets ``[N + 1]``;
            S0 and S_T ``[N, H, K, V]``): each starts at a chunk, from its own state; or None.
        log_input: ``[B, T, H]`` log input weights (the increment of token t is
            ``exp(log_input_t) outer(k_t, v_t)``), or None (weight 1).

    Returns:
        (o ``[B, T, H, V]`` or None, S_T ``[B, H, K, V]``); T = 0 gives an empty o and S0.
        With ``log_input``: (o, S_T, m), o the outputs scaled by ``exp(-m)`` (the true output
        is ``exp(m) o``), m ``[B, T, H]`` the stabiliser of each token's output (None without
        q), S_T at its true scale (inf in float32 where the true state exceeds 3.4e38).
    """
    B, T, H, K = k.shape
    vs = tuple(v) if isinstance(v, (tuple, list)) else (v,)
    V = sum(x.shape[-1] for x in vs)
    BH = B * H
    dt = torch.promote_types(k.dtype, torch.float32)
    out_dtype = S0.dtype if S0 is not None else vs[0].dtype
    stab = log_input is not None                                     # max-stabilised exponential input weights
    if T == 0:
        o = vs[0].new_zeros(B, 0, H, V) if q is not None else None
        S_T = S0 if S0 is not None else k.new_zeros(B, H, K, V, dtype=out_dtype)
        if stab:
            return o, S_T, (k.new_zeros(B, 0, H, dtype=dt) if q is not None else None)
        return o, S_T
    # one log decay per key channel (decided operands first: the specialiser folds them)
    channel = per_channel if per_channel is not None else log_gamma is not None and log_gamma.dim() == 4
    if stab and channel:
        raise ValueError("log_input: the stabilised kernel takes one log decay per head [B, T, H]")
    C = max(1, min(int(chunk), T))
    if channel:                                                      # a power of two: halved level by level
        C = 1 << (C.bit_length() - 1)
    docs = None
    if documents is not None:   # packed documents: each starts at a chunk, from its own state
        S_docs = S0.to(dt) if S0 is not None else k.new_zeros(documents.count, H, K, V, dtype=dt)
        docs = documents.for_kernel(C, S_docs)
        T = docs.T
    q_in, k_in, lg_in, li_in = q, k, log_gamma, log_input            # per-token inputs [B, T, H, ...]
    if docs is not None:                                             # the laid-out row
        k_in = docs.lay(k)
        q_in = docs.lay(q) if q is not None else None
        lg_in = docs.lay(log_gamma) if log_gamma is not None else None
        li_in = docs.lay(log_input) if stab else None
        vs = tuple(docs.lay(x) for x in vs)
    # (packed: every chunk that starts a document enters its initial state)
    S = k.new_zeros(BH, K, V, dtype=dt) if S0 is None or docs is not None else S0.to(dt).reshape(BH, K, V)
    if stab:   # the state is carried as exp(-ms) S: ms [BH], the stabiliser (0: S0 at its true scale)
        ms = S.new_zeros(BH)
        m_outs = []                                                  # [B, n, c, H, 1] per group
    N, r = divmod(T, C)
    G = _group_size(N, BH * C * max(K, V, C), group, k.device)     # chunks per group
    # groups of n chunks of c slots holding m tokens each (m < c only in a per-channel tail,
    # padded with zero tokens: they follow every real token, so they change no output or state)
    groups = _chunk_groups(T, C, G, "power of two" if channel else None)

    def split(x):  # [B, T, ...] -> one [B, n m, ...] piece per group
        return _split_groups(x, groups)

    def block(xs, n, c, m, pad=0.0):  # pieces [B, n m, H, D_i] -> [n B H, c, sum D_i], one copy;
        # chunk-major: chunk j of the group is the batch slice [j BH, (j + 1) BH); a tail of m < c
        # tokens is padded with c - m tokens of value pad
        parts = [_chunk_major(x.to(dt), n, c, pad) for x in xs]
        x = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        return x.reshape(n * BH, c, x.shape[-1]).contiguous()

    if channel:  # without autograd, the per-channel factors are updated in place
        inputs = (q, k, log_gamma, S0) + vs
        inplace = not (torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in inputs))
    outs = []                                                        # [B, n, c, H, V] per group
    j0 = 0                                                           # chunks before this group
    pieces = zip(groups, split(q_in), split(k_in), zip(*(split(x) for x in vs)), split(lg_in), split(li_in))
    for (n, m, c), qp, kp, vp, lp, ip in pieces:
        nBH = n * BH
        vg = block(vp, n, c, m)                                      # [nBH, c, V]
        if channel:
            # a pair (t in the second half of a block of 2h tokens, s in its first half) weighs
            # exp(Lq_t - L_s) = E_h(s) F_h(t): E_h(s) the decays after s to the end of its h-block,
            # F_h(t) those from the start of its h-block through t (to t - 1 if exclusive), products
            # of decays (each <= 1); XE_h = [k E_h | q F_h] goes to the next level by one product
            gam_t = torch.exp(lp.to(dt))                             # [B, n m, H, K] decay of each token
            P = block([gam_t], n, c, m, pad=1.0)                     # [nBH, c, K] decay of each h-block (h = 1)
            if q is None:
                XE = block([kp], n, c, m)                            # [nBH, c, K] (E_1 = 1)
            else:                                                    # [nBH, c, 2K] (F_1 = gamma_t, or 1)
                XE = block([kp, qp.to(dt) * gam_t if inclusive else qp], n, c, m)
            W = XE.shape[-1]
            og = None                                                # [nBH, c, V] outputs of the chunk's pairs
            if inclusive and q is not None:                          # pairs s = t weigh 1
                og = block([(qp.to(dt) * kp.to(dt)).sum(-1, keepdim=True)], n, c, m) * vg
            XE, P, og = _additive_halving(XE, P, vg, og, q is not None, inclusive, inplace)
            kd = XE[..., :K]                                         # keys decayed to the chunk end
            g_end = P.view(n, BH, K, 1)                              # [n, BH, K, 1] decay over each chunk
        else:
            kg = block([kp], n, c, m)                                # [nBH, c, K]
            if log_gamma is not None or stab:
                lg = (block([lp[..., None]], n, c, m)[..., 0] if log_gamma is not None
                      else kg.new_zeros(nBH, c))                     # [nBH, c] log decays (may be -inf)
                L = torch.cumsum(lg, dim=1)                          # [nBH, c] cumulative log decay
                # the log decay after each token to the chunk end: a reversed cumsum, shifted (no difference)
                after = torch.nn.functional.pad(torch.cumsum(lg.flip(1), 1).flip(1)[:, 1:], (0, 1))
                g_log = L[:, -1].view(n, BH)                         # [n, BH] log decay over each chunk
                if stab:                                             # log weight of each token in the chunk-end
                    li = block([ip[..., None]], n, c, m)[..., 0]     # state; [nBH, c] log input weights
                    w_end = after + li
                    m_loc = w_end.detach().amax(1).clamp_min(-1e30)  # [nBH] its stabiliser (-inf rows: any)
                    kd = kg * torch.exp(w_end - m_loc[:, None])[..., None]   # scaled by exp(-m_loc)
                    m_loc = m_loc.view(n, BH)
                else:
                    kd = kg * torch.exp(after)[..., None]            # keys decayed to the chunk end
                    g_end = torch.exp(g_log).view(n, BH, 1, 1)       # [n, BH, 1, 1] decay over each chunk
            else:
                kd = kg
        kv = torch.bmm(kd.transpose(1, 2), vg).view(n, BH, K, V)    # chunk increments K_j^T V_j
        if stab:  # the state carried as exp(-m) S, m <- max(g + m, m_loc) (a scale: no gradient)
            m_list = []
            for j in range(n):
                if docs is not None and j0 + j in docs.first:
                    ms = torch.zeros_like(ms)                        # a document's state: its true scale
                m_list.append(ms)
                ms = torch.maximum(g_log[j].detach() + ms, m_loc[j])   # [BH]
            m_all = torch.stack(m_list + [ms])                       # [n + 1, BH] at each chunk's start
            g_end = torch.exp(g_log + m_all[:-1] - m_all[1:]).view(n, BH, 1, 1)   # every exponent <= 0
            kv = kv * torch.exp(m_loc - m_all[1:]).view(n, BH, 1, 1)
        # chunk j's map S <- Diag(g_j) S + K_j^T V_j [BH, K, V], forward in the chunks (a non-finite
        # increment reaches only later chunks); each map closes over assigned locals only (torch.compile)
        step = ((lambda j, S: (torch.addcmul(kv[j], g_end[j], S), None)) if log_gamma is not None or stab
                else (lambda j, S: (S + kv[j], None)))
        true_scale = (lambda j, S: S * torch.exp(m_all[j + 1]).view(BH, 1, 1)) if stab else None   # (its true scale)
        S, starts, _ = _pass_states(step, n, S, docs, j0, true_scale)
        j0 += n
        if q is None:
            continue
        S_starts = _stacked(starts)                                  # [nBH, K, V]
        if channel:                                                  # + (q F_c) @ S_start
            og = torch.baddbmm(og, XE[..., K:], S_starts) if og is not None else torch.bmm(XE[..., K:], S_starts)
        else:
            qg = block([qp], n, c, m)                                # [nBH, c, K]
            if stab:   # (m0: the chunks' start stabilisers)
                og, m_row = _additive_outputs(qg, kg, vg, S_starts, inclusive, lg, L, li, m_all[:-1].reshape(nBH))
                m_outs.append(_token_major(m_row[..., None], B, H, m))   # [B, n, m, H, 1]
            elif log_gamma is not None:
                og, _ = _additive_outputs(qg, kg, vg, S_starts, inclusive, lg, L)
            else:
                og, _ = _additive_outputs(qg, kg, vg, S_starts, inclusive)
        outs.append(_token_major(og, B, H, m))                     # [B, n, m, H, V] (a view)
    if docs is not None:
        S_out = docs.final().to(out_dtype)
    else:                                                            # (stabilised: back to the true scale)
        S_out = (S * torch.exp(ms).view(BH, 1, 1) if stab else S).view(B, H, K, V).to(out_dtype)
    if q is None:
        return (None, S_out, None) if stab else (None, S_out)

    def join(parts):  # [B, n, m, H, width] per group -> [B, T, H, width]
        x = _join_chunks(parts)
        return docs.unlay(x) if docs is not None else x              # the documents' tokens, packed

    o = join(outs).to(vs[0].dtype)
    return (o, S_out, join(m_outs)[..., 0]) if stab else (o, S_out)


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


def _additive_halving(XE, P, vg, og, probes, inclusive, inplace):
    """The pairs of per-channel chunks of ``chunk_additive``, halved level by level: in a block of 2h
    tokens a pair (t in the second half, s in the first) weighs ``E_h(s) F_h(t)``; all pairs of a
    level are one batched ``(q F) (k E)^T`` product applied to the first halves' values, and
    ``XE = [k E | q F]`` passes to the next level by one product with the halves' decays.

    Args:
        XE: ``[nBH, c, K]`` (no probes) or ``[nBH, c, 2K]``: ``[k E_1 | q F_1]``; P: ``[nBH, c, K]``
            each token's decay; vg: ``[nBH, c, V]`` values; og: ``[nBH, c, V]`` the outputs of the
            pairs s = t, or None.
        probes: whether there are probes (their outputs are computed); inclusive: o_t reads S_t.
        inplace: update the factors in place (no autograd).

    Returns:
        ``(XE, P, og)``: the keys decayed to the chunk end and the probes' decays from its start, the
        decay over each chunk ``[nBH, 1, K]``, the outputs of the chunk's pairs (None without probes).
    """
    nBH, c, W = XE.shape
    K, V = P.shape[-1], vg.shape[-1]
    ones = P.new_ones(nBH * c // 2, 1, 1, K)
    h = 1
    while h < c:
        nb = nBH * c // (2 * h)                              # blocks of 2h tokens
        XEb = XE.view(nb, 2, h, W)
        if probes:
            kt, qt = XEb[:, 0, :, :K], XEb[:, 1, :, K:]      # [nb, h, K]: first halves' k E, second halves' q F
            v1 = vg.view(nb, 2, h, V)[:, 0]                  # [nb, h, V]
            o2 = og.view(nb, 2, h, V)[:, 1] if og is not None else None   # [nb, h, V] second halves
            # out of place until og depends on q, k, v and the decays: in place after (vmap)
            fresh = h <= (1 if inclusive else 2)
            if h <= 2:                                       # tiny blocks: column by column
                scores = (qt * kt).sum(-1, keepdim=True) if h == 1 else torch.bmm(qt, kt.transpose(1, 2))
                cols = [(scores[:, :, j:j + 1], v1[:, j:j + 1]) for j in range(h)]   # [nb, h, 1], [nb, 1, V]
                if fresh:
                    cross = sum(a * b for a, b in cols)
                    o2 = cross if o2 is None else o2 + cross
                    o1 = og.view(nb, 2, h, V)[:, 0] if og is not None else torch.zeros_like(o2)
                    og = torch.stack([o1, o2], 1).view(nBH, c, V)
                else:
                    for a, b in cols:
                        o2.addcmul_(a, b)
            else:
                o2.add_(torch.bmm(torch.bmm(qt, kt.transpose(1, 2)), v1))
        Pb = P.view(nb, 2, 1, K)                             # the decays of the two halves
        # to blocks of 4h: first halves' E picks up the second half's decay, second halves' F the first's
        # in place from XE_2 on (XE_1 may be k itself; XE_2 depends on the decays: vmap)
        if inplace and h > 1:
            XEb[:, 0, :, :K].mul_(Pb[:, 1])
            if probes:
                XEb[:, 1, :, K:].mul_(Pb[:, 0])
        else:
            one = ones[:nb]
            fac = torch.cat([Pb[:, 1:], one] + ([one, Pb[:, :1]] if probes else []), -1)
            XE = (XEb * fac.view(nb, 2, 1, W)).view(nBH, c, W)
        P = Pb[:, 0] * Pb[:, 1]                              # [nb, 1, K]
        h *= 2
    return XE, P, og
