"""Exact chunked kernel of the additive family, and its token-loop reference.

See :mod:`memspec.runtime` for the rules every kernel here follows (standalone, torch only,
log decays, float32 arithmetic, groups of chunks, causal masks that no future value crosses).
"""
from __future__ import annotations

import torch



def recurrent_additive(q, k, v, log_gamma, S0, inclusive=True):
    """Token-loop reference for ``S_t = Diag(exp(log_gamma_t)) S_{t-1} + outer(k_t, v_t)``, ``o_t = q_t @ S_t``.

    Args:
        q: ``[B, T, H, K]`` probes, or None (state only).
        k: ``[B, T, H, K]``; v: ``[B, T, H, V]``.
        log_gamma: log decays (<= 0): ``[B, T, H]``, one per head (the whole state scales, as in
            RetNet / Mamba-2), or ``[B, T, H, K]``, one per key channel (row i of S scales by
            ``exp(log_gamma[..., i])``, as in GLA / RWKV-6 / HGRN-2); or None for no decay.
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
            S = torch.exp(log_gamma[:, t].to(dt)).view(B, H, -1, 1) * S   # [B, H, 1 | K, 1] row scaling
        S = S + k[:, t].to(dt)[..., :, None] * v[:, t].to(dt)[..., None, :]   # [B, H, K, V]
        if q is not None:
            read = S if inclusive else S_prev
            outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t].to(dt), read))
    if q is None:
        o = None
    else:
        o = torch.stack(outs, dim=1).to(v.dtype) if outs else v.new_zeros(B, 0, H, V)
    return o, S.to(S0.dtype if S0 is not None else v.dtype)


def chunk_additive(q, k, v, log_gamma, S0, chunk, inclusive=True, group=None, per_channel=None,
                   documents=None):
    """Exact chunked form of ``S_t = Diag(exp(log_gamma_t)) S_{t-1} + outer(k_t, v_t)``, ``o_t = q_t @ S_t``.

    Inside a chunk with cumulative log decays ``L_t`` (per head, or per key channel) and
    ``Lq_t = L_t`` (``inclusive=False``: ``L_{t-1}``, and pairs ``s < t`` instead of ``s <= t``):
    ``o_t = (q_t * exp(Lq_t)) @ S_start + sum_{s <= t} (sum_i q_ti k_si exp(Lq_ti - L_si)) v_s`` and
    ``S_end = Diag(exp(L_C)) S_start + sum_s outer(k_s * exp(L_C - L_s), v_s)``.
    Every weight is the decay from an earlier token to a later one (<= 1): nothing overflows,
    whatever the decays.

    * One log decay per head (``[B, T, H]``: RetNet, Mamba-2): the pair weights
      ``exp(Lq_t - L_s)`` are one ``[C, C]`` matrix per chunk (zeroed above the diagonal before
      ``exp``, masked after the product), applied to the scores ``q k^T``.  Log decays must be
      finite here (the code generator clamps them at log(1e-30)).
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

    Returns:
        (o ``[B, T, H, V]`` or None, S_T ``[B, H, K, V]``); T = 0 gives an empty o and S0.
    """
    B, T, H, K = k.shape
    vs = tuple(v) if isinstance(v, (tuple, list)) else (v,)
    V = sum(x.shape[-1] for x in vs)
    BH = B * H
    dt = torch.promote_types(k.dtype, torch.float32)
    out_dtype = S0.dtype if S0 is not None else vs[0].dtype
    if T == 0:
        o = vs[0].new_zeros(B, 0, H, V) if q is not None else None
        return o, (S0 if S0 is not None else k.new_zeros(B, H, K, V, dtype=out_dtype))
    # one log decay per key channel (decided operands first: the specialiser folds them)
    channel = per_channel if per_channel is not None else log_gamma is not None and log_gamma.dim() == 4
    C = max(1, min(int(chunk), T))
    if channel:                                                      # a power of two: halved level by level
        C = 1 << (C.bit_length() - 1)
    docs = None
    if documents is not None:   # packed documents: each starts at a chunk, from its own state
        S_docs = S0.to(dt) if S0 is not None else k.new_zeros(documents.count, H, K, V, dtype=dt)
        docs = documents.for_kernel(C, S_docs)
        T = docs.T
    q_in, k_in, lg_in = q, k, log_gamma                              # per-token inputs [B, T, H, ...]
    if docs is not None:                                             # the laid-out row
        k_in = docs.lay(k)
        q_in = docs.lay(q) if q is not None else None
        lg_in = docs.lay(log_gamma) if log_gamma is not None else None
        vs = tuple(docs.lay(x) for x in vs)
    # (packed: every chunk that starts a document enters its initial state)
    S = k.new_zeros(BH, K, V, dtype=dt) if S0 is None or docs is not None else S0.to(dt).reshape(BH, K, V)
    N, r = divmod(T, C)
    if group is not None:
        G = int(group)
    elif k.device.type == "cpu":   # temporaries near 512 KB (float32): no page faults per call
        G = round((1 << 17) / (BH * C * max(K, V, C)))
    else:                          # caching allocators: fewer, larger launches
        G = 64
    G = max(1, min(N, G))                                            # chunks per group
    # groups of n chunks of c slots holding m tokens each (m < c only in a per-channel tail,
    # padded with zero tokens: they follow every real token, so they change no output or state)
    groups = [(min(G, N - j), C, C) for j in range(0, N, G)]
    if r:
        groups.append((1, 1 << (r - 1).bit_length() if channel else r, r))
    sizes = [n * m for n, _, m in groups]

    def split(x):  # [B, T, ...] -> one [B, n m, ...] piece per group (a split, not slices: the
        # backward of a slice fills a zero tensor of the whole input, once per group)
        return x.split(sizes, dim=1) if x is not None else [None] * len(groups)

    def block(xs, n, c, m, pad=0.0):  # pieces [B, n m, H, D_i] -> [n B H, c, sum D_i], one copy;
        # chunk-major: chunk j of the group is the batch slice [j BH, (j + 1) BH); a tail of m < c
        # tokens is padded with c - m tokens of value pad
        parts = []
        for x in xs:
            x = x.to(dt)
            if m < c:
                x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, c - m), value=pad)
            parts.append(x.reshape(B, n, c, H, x.shape[-1]).permute(1, 0, 3, 2, 4))
        x = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        return x.reshape(n * BH, c, x.shape[-1]).contiguous()

    if channel:  # without autograd, the per-channel factors are updated in place
        inputs = (q, k, log_gamma, S0) + vs
        inplace = not (torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in inputs))
    outs = []                                                        # [B, n, c, H, V] per group
    j0 = 0                                                           # chunks before this group
    pieces = zip(groups, split(q_in), split(k_in), zip(*(split(x) for x in vs)), split(lg_in))
    for (n, c, m), qp, kp, vp, lp in pieces:
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
            ones = P.new_ones(nBH * c // 2, 1, 1, K)
            h = 1
            while h < c:
                nb = nBH * c // (2 * h)                              # blocks of 2h tokens
                XEb = XE.view(nb, 2, h, W)
                if q is not None:
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
                    if q is not None:
                        XEb[:, 1, :, K:].mul_(Pb[:, 0])
                else:
                    one = ones[:nb]
                    fac = torch.cat([Pb[:, 1:], one] + ([] if q is None else [one, Pb[:, :1]]), -1)
                    XE = (XEb * fac.view(nb, 2, 1, W)).view(nBH, c, W)
                P = Pb[:, 0] * Pb[:, 1]                              # [nb, 1, K]
                h *= 2
            kd = XE[..., :K]                                         # keys decayed to the chunk end
            g_end = P.view(n, BH, K, 1)                              # [n, BH, K, 1] decay over each chunk
        else:
            kg = block([kp], n, c, m)                                # [nBH, c, K]
            if log_gamma is not None:
                lg = block([lp[..., None]], n, c, m)                 # [nBH, c, 1]
                L = torch.cumsum(lg, dim=1)                          # [nBH, c, 1] cumulative log decay
                Lq = L if inclusive else L - lg                      # the log decay a probe sees
                kd = kg * torch.exp(L[:, -1:] - L)                   # keys decayed to the chunk end
                g_end = torch.exp(L[:, -1]).view(n, BH, 1, 1)        # [n, BH, 1, 1] decay over each chunk
            else:
                kd = kg
        kv = torch.bmm(kd.transpose(1, 2), vg).view(n, BH, K, V)    # chunk increments K_j^T V_j
        starts = []
        for j in range(n):  # forward in the chunks: a non-finite increment reaches only later chunks
            if docs is not None:
                S = docs.enter(j0 + j, S)                            # a document's initial state
            starts.append(S)
            S = torch.addcmul(kv[j], g_end[j], S) if log_gamma is not None else S + kv[j]   # [BH, K, V]
            if docs is not None:
                docs.leave(j0 + j, S)                                # a document's final state
        j0 += n
        if q is None:
            continue
        S_starts = torch.stack(starts).view(nBH, K, V) if n > 1 else starts[0]   # [nBH, K, V]
        if channel:                                                  # + (q F_c) @ S_start
            og = torch.baddbmm(og, XE[..., K:], S_starts) if og is not None else torch.bmm(XE[..., K:], S_starts)
        else:
            qg = block([qp], n, c, m)                                # [nBH, c, K]
            d = 0 if inclusive else -1                               # pairs s <= t (s < t)
            scores = torch.bmm(qg, kg.transpose(1, 2))               # [nBH, c, c]
            if log_gamma is not None:
                Lq1, L1 = Lq[..., 0], L[..., 0]                      # [nBH, c]
                # exp(Lq_t - L_s) on the pairs; the rest is zeroed before exp (exp(0) = 1, masked after)
                decay = torch.exp((Lq1[:, :, None] - L1[:, None, :]).tril(d))
                scores = (scores * decay).tril_(d)
                qg = qg * torch.exp(Lq)                              # [nBH, c, K] decayed probes
            else:
                scores = scores.tril_(d)
            # the triangular product with v: its non-finite entries go around it, from their row on
            v_ok = torch.nan_to_num(vg, 0.0, 0.0, 0.0)               # [nBH, c, V]
            v_sum = vg.sum(-1, keepdim=True)                         # [nBH, c, 1] non-finite iff the row is
            v_bad = torch.cumsum(v_sum - v_sum, dim=1)               # [nBH, c, 1] 0, or nan from s on
            if not inclusive:
                v_bad = torch.nn.functional.pad(v_bad[:, :-1], (0, 0, 1, 0))   # ... from s + 1 on
            og = torch.baddbmm(torch.bmm(qg, S_starts), scores, v_ok).add_(v_bad)   # [nBH, c, V]
        outs.append(og.view(n, B, H, c, V).permute(1, 0, 3, 2, 4))  # [B, n, c, H, V] (a view)
    S_out = (S.view(B, H, K, V) if docs is None else docs.final()).to(out_dtype)
    if q is None:
        return None, S_out
    # one copy into [B, T, H, V] (a second one only for a tail chunk)
    full = outs[:len(outs) - (r > 0)]
    o = torch.cat(full, dim=1).reshape(B, N * C, H, V) if full else None
    if r:
        tail = outs[-1][:, :, :r].reshape(B, r, H, V)
        o = torch.cat([o, tail], dim=1) if o is not None else tail
    if docs is not None:
        o = docs.unlay(o)                                            # the documents' tokens, packed
    return o.to(vs[0].dtype), S_out
