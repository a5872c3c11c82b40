"""Exact chunked kernel for diagonal-plus-low-rank (DPLR) transitions, and its token-loop reference.

One token applies R >= 1 sub-steps in order; sub-step r is

    S <- Diag(d_{t,r}) S + a_{t,r} (b_{t,r}^T S) + outer(k_{t,r}, v_{t,r})

on the state ``S [K, V]`` (row-vector convention: reads ``q @ S``), where ``b`` reads the state
*before* the sub-step (``read_after_decay=True``: sub-step 0 reads it after the decay, i.e.
``b <- d * b``) and the decay ``d_t = exp(log_decay_t)`` (a scalar or one factor per key channel)
acts on the first sub-step of the token only.  ``a`` and ``b`` may be vectors, or scalars
meaning that multiple of ``k``.  This one form covers:

==========================  ==========================================================================
DeltaNet                    ``a = -beta`` (scalar: ``a = -beta k``), ``b = None`` (``= k``), ``v <- beta v``
gated DeltaNet              + scalar ``log_decay``, ``read_after_decay=True`` (the error read after
                            the decay; False reads it before)
Kimi Delta Attention        per-channel ``log_decay [B, T, H, K]``, ``a = -beta``, ``b = None``,
                            ``read_after_decay=True``
Gated DeltaNet-2            per-channel decay, ``a = -1``, ``b = b_gate * k``, ``v <- w * v``,
                            ``read_after_decay=True``
Comba                       scalar decay, ``a = -beta``, ``b = p`` (a vector ``!= k``),
                            ``read_after_decay=True``
RWKV-7 / DPLR               per-channel decay, arbitrary vectors ``a``, ``b`` (read before the decay)
gated DeltaProduct          R Householder steps per token: ``k, v [B, T, H, R, *]``, ``a = -beta``
                            ``[B, T, H, R]``, ``b = None``, ``read_after_decay=True``
==========================  ==========================================================================

``simultaneous=True`` instead applies the R rank-1 terms of a token at once, all reading the
state before the token (after its decay with ``read_after_decay``):
``S <- Diag(d_t) S + sum_r a_{t,r} (b_{t,r}^T S) + sum_r outer(k_{t,r}, v_{t,r})``.

See :mod:`memspec.runtime` for the rules every kernel here follows (standalone, torch only,
log decays, float32 arithmetic, groups of chunks).
"""
from __future__ import annotations

import torch

from .phases import (_chunk_groups, _chunk_major, _group_size, _join_chunks, _pass_states, _split_groups, _stacked,
                     _token_major)


def recurrent_dplr(q, k, v, a, b, log_decay, S0, inclusive=True, simultaneous=False, read_after_decay=False):
    """Token-loop reference for the diagonal-plus-low-rank recurrence (see the module docstring).

    Sub-step r of token t: ``u = b_{t,r} @ S`` (the state before the sub-step), then
    ``S <- Diag(d) S + outer(a_{t,r}, u) + outer(k_{t,r}, v_{t,r})`` with ``d = exp(log_decay_t)``
    on sub-step 0 and ``d = 1`` on the others (``read_after_decay``: on sub-step 0, ``u`` reads
    ``Diag(d) S``).  ``o_t = q_t @ S`` after the token's last sub-step (``inclusive``) or before
    its first (``inclusive=False``).

    Args:
        q: ``[B, T, H, K]`` probes, or None (state only).
        k: ``[B, T, H, R, K]`` write keys, or ``[B, T, H, K]`` for R = 1.
        v: ``[B, T, H, R, V]`` write values (``[B, T, H, V]`` for R = 1).
        a: ``[B, T, H, R, K]`` left factors of the low-rank term, or ``[B, T, H, R]`` scalars
            meaning ``a_{t,r} * k_{t,r}`` (R = 1: ``[B, T, H, K]`` / ``[B, T, H]``).
        b: read vectors shaped like ``k``, or scalars shaped like a scalar ``a`` (meaning
            ``b_{t,r} * k_{t,r}``), or None (``b = k``).
        log_decay: ``[B, T, H]`` (scalar) or ``[B, T, H, K]`` (per key channel) log decays
            (<= 0), or None (no decay).
        S0: ``[B, H, K, V]`` initial state, or None for zeros.
        inclusive: True: o_t reads the state after token t; False: before it.
        simultaneous: True: the R terms of a token all read the state before the token
            (``S <- Diag(d) S + sum_r a_r (b_r^T S) + sum_r outer(k_r, v_r)``).
        read_after_decay: True: the reads of sub-step 0 (all sub-steps when simultaneous)
            see the state after the token's decay.

    Returns:
        (o ``[B, T, H, V]`` or None, S_T ``[B, H, K, V]``).
    """
    if k.dim() == 4:
        k, v, a = k.unsqueeze(3), v.unsqueeze(3), a.unsqueeze(3)
        b = b.unsqueeze(3) if b is not None else None
    B, T, H, R, K = k.shape
    V = v.shape[-1]
    dt = torch.promote_types(k.dtype, torch.float32)
    k, v = k.to(dt), v.to(dt)
    a = a.to(dt)[..., None] * k if a.dim() == 4 else a.to(dt)                    # [B, T, H, R, K]
    b = k if b is None else (b.to(dt)[..., None] * k if b.dim() == 4 else b.to(dt))
    S = k.new_zeros(B, H, K, V, dtype=dt) if S0 is None else S0.to(dt)
    outs = []
    for t in range(T):
        S_before = S
        d = None
        if log_decay is not None:
            d = torch.exp(log_decay[:, t].to(dt))                                   # [B, H] or [B, H, K]
            d = d[..., None] if d.dim() == 3 else d[..., None, None]
        if simultaneous:
            S_dec = S if d is None else d * S
            u = torch.einsum("bhrk,bhkv->bhrv", b[:, t], S_dec if read_after_decay else S)   # [B, H, R, V]
            S = S_dec + torch.einsum("bhrk,bhrv->bhkv", a[:, t], u) + torch.einsum("bhrk,bhrv->bhkv", k[:, t], v[:, t])
        else:
            for r in range(R):
                if r == 0 and d is not None and read_after_decay:
                    S = d * S
                u = torch.einsum("bhk,bhkv->bhv", b[:, t, :, r], S)                 # [B, H, V]
                if r == 0 and d is not None and not read_after_decay:
                    S = d * S
                S = S + a[:, t, :, r, :, None] * u[..., None, :] + k[:, t, :, r, :, None] * v[:, t, :, r, None, :]
        if q is not None:
            read = S if inclusive else S_before
            outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t].to(dt), read))
    o = None
    if q is not None:
        o = torch.stack(outs, dim=1).to(v.dtype) if outs else v.new_zeros(B, 0, H, V)
    return o, S.to(S0.dtype if S0 is not None else v.dtype)


def pair_index(c, sl, w, R, same, masks):
    """Where each entry of a per-channel chunk's matrix sits in the flat list of its pairs.

    The matrix has rows (token ti, slot s: R reads, then the probe) and columns (set, token tj,
    sub-step r), ``[c sl, w c R]``; the flat list (per chunk) is ``[0, same-token pairs
    [c, sl, w R] (when ``same``), level 1 [c/2, 1, sl, 1, w R], level 2 [c/4, 2, sl, 2, w R], ...]``,
    level h holding the pairs (second half, first half) of each block of 2h tokens.  Entries
    outside the masks (``masks(c)``: the reads' solve mask over sub-steps, the probes' read mask)
    point at the 0.  Returns a long tensor of ``c sl w c R`` positions.
    """
    solve, read = masks
    dev = solve.device
    wR = w * R
    ti = torch.arange(c, device=dev).view(c, 1, 1, 1, 1)
    s = torch.arange(sl, device=dev).view(1, sl, 1, 1, 1)
    ws = torch.arange(w, device=dev).view(1, 1, w, 1, 1)
    tj = torch.arange(c, device=dev).view(1, 1, 1, c, 1)
    r = torch.arange(R, device=dev).view(1, 1, 1, 1, R)
    shape = (c, sl, w, c, R)
    # the masks, per (row token, slot) and (column token, sub-step)
    i_sub = ti * R + s.clamp(max=R - 1)                               # the read's sub-step
    j_sub = tj * R + r
    keep_read = solve[i_sub, j_sub]
    keep_probe = read[ti, j_sub]
    keep = torch.where(s < R, keep_read, keep_probe).expand(shape)
    col = ws * R + r                                                  # column slot within a token
    pos = torch.zeros(shape, dtype=torch.long, device=dev)
    base = 1
    if same:
        pos = torch.where(ti == tj, base + (ti * sl + s) * wR + col, pos)
        base += c * sl * wR
    h = 1
    x = ti ^ tj
    while h < c:
        level = (x >= h) & (x < 2 * h) & (ti > tj)                    # the highest differing bit is h
        b, it, jt = ti // (2 * h), ti % h, tj % h
        pos = torch.where(level, base + ((b * h + it) * sl + s) * (h * wR) + jt * wR + col, pos)
        base += (c // (2 * h)) * h * sl * h * wR
        h *= 2
    return torch.where(keep, pos, 0).reshape(-1)


def chunk_dplr(q, k, v, a, b, log_decay, S0, chunk, *, inclusive=True, group=None, documents=None,
               simultaneous=False, read_after_decay=False, a_form=None, b_form=None, decay_form=None):
    """Exact chunked diagonal-plus-low-rank recurrence (WY / UT representation, generalised).

    The recurrence is :func:`recurrent_dplr`'s; all arguments mean the same (shapes there).
    Inside a chunk the C R sub-steps are indexed ``i = t R + r``.  With cumulative log decays
    ``L_t`` (per channel where the decay is), the read of sub-step i, ``u_i = b_i^T S_{i-1}``,
    is affine in the chunk's start state:
    ``u_i = (e^{l_i} b_i)^T S_start + sum_{j < i} A_ij u_j + (A^k V)_i`` with
    ``A_ij = sum_c b_ic a_jc e^{l_ic - L_jc}`` (``l_i`` the log decay the read of i sees), so
    all reads of a chunk come from ONE unit-lower-triangular solve (batched over chunks),
    ``u = W S_start + U``.  Then the chunk's effect on the state is one affine map
    ``S_end = M S_start + D`` (``M = Diag(e^{L_C}) + A~^T W``, ``D = A~^T U + K~^T V``, tildes
    decayed to the chunk end), and the outputs are ``o = (Q~ + P^a W) S_start + P^a U + P^k V``
    with ``P`` the masked, decayed query scores: batched matmuls over chunks; the only
    sequential part is ``S <- M_n S + D_n`` per chunk.  When ``a`` is a scalar times ``k``
    (every delta-rule variant), the write and the correction share the key and the system is
    the delta rule's: ``z = alpha u + v`` solves ``(I - diag(alpha) A) z = alpha e^{l} b S + V``.

    Decays are exponentiated only as differences ``l_i - L_j <= 0`` (scalar decays).  Per key
    channel no ``[C, C]`` matrix of decays serves, and none is exponentiated: the chunk (a power of
    two: ``chunk`` is rounded down to one, a tail is padded with identity tokens) is halved level
    by level, as in the additive kernel (``chunk_additive``).  In a block of 2h tokens a
    pair (i in the second half, j in the first) weighs ``F_h(i) E_h(j)``: ``F_h(i)`` the product
    of the decays from the second half's start to the state i reads, ``E_h(j)`` of those after j
    to the first half's end.  All such pairs of a level are one batched product
    ``(X F) (Y E)^T`` of the rows (reads and probes) and the columns ([-a | k]); the factors pass
    to the next level by one product with the halves' decays, and after the last level they are
    the rows' decays from the chunk start and the columns' to its end.  Two sub-steps of one
    token weigh 1.  So only products of decays (each <= 1) enter, one ``exp`` per token and
    channel, in the kernel's dtype, with no cancellation in long sums.  Log decays below -40 per
    token are clamped to -40 (a factor of 4e-18): finite values and gradients for any input.

    Non-finite inputs: a token whose state inputs (k, v, a, b, log decay) are not all finite is
    replaced by an identity token (by ``torch.where``), and every output that reads a state at or
    after it, and the final state, are NaN; a non-finite probe makes only its own output NaN.
    Outputs before such a token are exact and their gradients finite.

    Args:
        q: ``[B, T, H, K]`` probes, or None (state only).
        k: ``[B, T, H, R, K]`` write keys, or ``[B, T, H, K]`` for R = 1.
        v: ``[B, T, H, R, V]`` write values (``[B, T, H, V]`` for R = 1).
        a: ``[B, T, H, R, K]`` left factors of the low-rank term, or ``[B, T, H, R]`` scalars
            meaning ``a_{t,r} * k_{t,r}`` (R = 1: ``[B, T, H, K]`` / ``[B, T, H]``).
        b: read vectors shaped like ``k``, or scalars shaped like a scalar ``a`` (meaning
            ``b_{t,r} * k_{t,r}``), or None (``b = k``).
        log_decay: ``[B, T, H]`` (scalar) or ``[B, T, H, K]`` (per key channel) log decays
            (<= 0), or None (no decay).
        S0: ``[B, H, K, V]`` initial state, or None for zeros.
        chunk: tokens per chunk C (C R sub-steps enter each solve).
        inclusive: True: o_t reads the state after token t; False: before it.
        simultaneous: the R terms of a token read the state before the token.
        read_after_decay: the reads of sub-step 0 see the state after the token's decay.
        group: chunks per batched group G (default: temporaries near 512 KB on CPU, 64 elsewhere);
            any G >= 1 gives the same numbers.
        a_form, b_form, decay_form: the forms of ``a`` (``"vector"`` or ``"scalar"``), ``b``
            (``"key"``: None, ``"scalar"``, ``"vector"``) and ``log_decay`` (``"none"``,
            ``"scalar"``, ``"channel"``), which must agree with the tensors passed; None: read
            from their ranks.  A generated module passes them, so that its specialised copy of
            this kernel keeps only the paths it runs.
        documents: packed documents (``_Documents(cu_seqlens)``: B = 1, offsets ``[N + 1]``;
            S0 and S_T ``[N, H, K, V]``): each starts at a chunk, from its own state; or None.

    Returns:
        (o ``[B, T, H, V]`` or None, S_T ``[B, H, K, V]``).
    """
    b_r = b                                                          # b with the sub-step axis (b is never rebound)
    if k.dim() == 4:
        k, v, a = k.unsqueeze(3), v.unsqueeze(3), a.unsqueeze(3)
        if b is not None:
            b_r = b.unsqueeze(3)
    B, T, H, R, K = k.shape
    V = v.shape[-1]
    BH = B * H
    dt = torch.promote_types(k.dtype, torch.float32)
    dev = k.device
    # the forms of a, b and the decay (the passed forms first: the specialiser folds them)
    a_vec = a_form == "vector" if a_form is not None else a.dim() == 5   # a as vectors (else a scalar times k)
    b_kind = (("k" if b_form == "key" else "vec" if b_form == "vector" else "scalar") if b_form is not None
              else "k" if b is None else "vec" if b_r.dim() == 5 else "scalar")
    decay = ((None if decay_form == "none" else decay_form) if decay_form is not None
             else None if log_decay is None else "channel" if log_decay.dim() == 4 else "scalar")
    # (packed: every chunk that starts a document enters its initial state)
    S = k.new_zeros(BH, K, V, dtype=dt) if S0 is None or documents is not None else S0.to(dt).reshape(BH, K, V)
    s_dtype = S0.dtype if S0 is not None else v.dtype
    if T == 0:
        S_T = S0 if S0 is not None and documents is not None else S.reshape(B, H, K, V).to(s_dtype)
        return (v.new_zeros(B, 0, H, V) if q is not None else None), S_T
    C = max(1, min(int(chunk), T))
    if decay == "channel":                                           # a power of two: halved level by level
        C = 1 << (C.bit_length() - 1)
    docs = None
    q_in, lg_in = q, log_decay                                       # per-token inputs [B, T, H, ...]
    if documents is not None:   # packed documents: each starts at a chunk, from its own state
        S_docs = S0.to(dt) if S0 is not None else k.new_zeros(documents.count, H, K, V, dtype=dt)
        docs = documents.for_kernel(C, S_docs)
        T = docs.T                                                   # the laid-out row
        k, v, a, b_r = (docs.lay(x) for x in (k, v, a, b_r))
        q_in, lg_in = docs.lay(q), docs.lay(log_decay)
    N, rem = divmod(T, C)
    Np = N + (rem > 0)
    w = 2 if a_vec else 1                                            # column factor sets: [-a | k] or [k]
    n_full = C * R
    width = max(K + V, w * n_full)
    G = _group_size(N, BH * n_full * width, group, dev)            # chunks per group
    # groups (chunks nc, tokens c, tokens after padding cp): a per-channel tail chunk is padded with
    # identity tokens (zeros, decay 1) to a power of two
    groups = _chunk_groups(T, C, G, "power of two" if decay == "channel" else None)
    after = read_after_decay and decay is not None

    # ---- per-token flags and scalars, all chunks at once ([Np, BH, C] or [Np, BH, C R])
    def per_chunk(x, r):  # [B, T, H(, r)] -> [Np, BH, C r], chunk-major, tail padded with zeros
        return _chunk_major(x.reshape(B, T, H, r), Np, C).contiguous().reshape(Np, BH, C * r)

    # a token is bad when one of its state inputs is not finite (the sum is then NaN or inf)
    total = k.sum((-2, -1), dtype=dt) + v.sum((-2, -1), dtype=dt)
    total = total + (a.sum((-2, -1), dtype=dt) if a_vec else a.sum(-1, dtype=dt))
    if b_kind != "k":
        total = total + (b_r.sum((-2, -1), dtype=dt) if b_kind == "vec" else b_r.sum(-1, dtype=dt))
    if decay is not None:
        lg_all = lg_in.to(dt).clamp_min(-40.0)                   # (a decay of 0, log -inf, is valid)
        total = total + (lg_all.sum(-1) if decay == "channel" else lg_all)
    okf = torch.isfinite(per_chunk(total, 1))                        # [Np, BH, C] (padding: ok)
    # the state is never poisoned inside (no NaN ever meets a product, forward or backward): the
    # outputs reading a state at or after a bad token, and the final state, are set to NaN at the end
    bad = (~torch.isfinite(total)).to(dt)                            # [B, T, H]
    if docs is None:
        bad_before = torch.cumsum(bad, dim=1)                        # bad tokens at or before t
        state_bad = (bad_before[:, -1] > 0).reshape(BH, 1, 1)
    else:                                                            # ... in its document
        bad_before = docs.cumsum(bad)
        state_bad = (docs.total(bad) > 0).reshape(-1, 1, 1)         # [N H, 1, 1]
    zero = torch.zeros((), dtype=dt, device=dev)
    nan_value = torch.full((), float("nan"), dtype=dt, device=dev)
    if q is not None:
        q_okf = torch.isfinite(per_chunk(q_in.sum(-1, dtype=dt), 1))
        read_bad = per_chunk(bad_before if inclusive else bad_before - bad, 1) > 0
        read_bad = read_bad | ~q_okf                                 # [Np, BH, C]
    ok_r = okf.repeat_interleave(R, dim=-1) if R > 1 else okf        # [Np, BH, C R]
    a_s = None if a_vec else torch.where(ok_r, per_chunk(a.to(dt), R), zero)      # scalar a
    b_s = torch.where(ok_r, per_chunk(b_r.to(dt), R), zero) if b_kind == "scalar" else None

    # ---- masks of a chunk of c tokens (sub-step i = t R + r; token of i = i // R)
    def masks(c):
        n = c * R
        tok = torch.arange(n, device=dev) // R
        if simultaneous:
            solve = tok[:, None] > tok[None, :]                      # j in an earlier token
        else:
            solve = torch.arange(n, device=dev)[:, None] > torch.arange(n, device=dev)[None, :]
        ti = torch.arange(c, device=dev)
        read = ti[:, None] >= tok[None, :] if inclusive else ti[:, None] > tok[None, :]   # [c, n]
        return solve, read

    mask_cache = {c: masks(c) for c in {cp for _, _, cp in groups}}
    # which reads see the state before the token's decay: none (read_after_decay), all (simultaneous,
    # or R = 1), or sub-step 0 only
    before = "none" if after else ("all" if simultaneous or R == 1 else "first")
    if decay == "channel":
        # without autograd, the halving's factors are updated in place
        inplace = not (torch.is_grad_enabled()
                       and any(x is not None and x.requires_grad for x in (q, k, v, a, b_r, log_decay, S0)))
        sl = R + (q is not None)                                     # row slots per token: R reads (+ the probe)
        wR = w * R                                                   # column slots per token: (set, sub-step)
        # the slots whose state has the token's own decay (F_1 = its decay; the others F_1 = 1)
        decayed = [not (before == "all" or (before == "first" and r == 0)) for r in range(R)]
        decayed += [inclusive] if q is not None else []
        # pairs of sub-steps of one token enter (weight 1): inclusive probes, R > 1 sequential reads
        same = q is not None and inclusive or R > 1 and not simultaneous
        pair_cache = {c: pair_index(c, sl, w, R, same, mask_cache[c]) for c in mask_cache}

    def split_t(x):  # [B, T, ...] -> one [B, n c, ...] piece per group
        return _split_groups(x, groups)

    def split_c(x):  # [Np, BH, ...] -> one [nc, BH, ...] piece per group
        return x.split([nc for nc, _, _ in groups], dim=0) if x is not None else [None] * len(groups)

    # ---- decay factors of every chunk at once
    dec = {}
    if decay == "scalar":
        g = torch.where(okf, per_chunk(lg_all, 1), zero)             # [Np, BH, C]
        L = torch.cumsum(g, dim=-1)                                   # cumulative log decay in the chunk
        Lp = L - g                                                    # before token t's decay
        Lr = L.repeat_interleave(R, dim=-1) if R > 1 else L          # [Np, BH, C R] column log of sub-step j
        first = torch.arange(C * R, device=dev) % R == 0              # sub-step 0 of each token
        l_row = Lr if before == "none" else (Lp.repeat_interleave(R, dim=-1) if R > 1 else Lp)
        if before == "first":
            l_row = torch.where(first, l_row, Lr)
        Lq = L if inclusive else Lp                                   # the log decay a probe sees
        dec = {"L": L, "Lr": Lr, "l_row": l_row, "Lq": Lq, "e_row": torch.exp(l_row),
               "end": torch.exp(L[..., -1:] - Lr), "g_end": torch.exp(L[..., -1]), "e_q": torch.exp(Lq)}

    dec_p = {key: split_c(x) for key, x in dec.items()}

    k_p, v_p, q_p = split_t(k), split_t(v), split_t(q_in)
    g_p = split_t(lg_all) if decay == "channel" else None
    a_p = split_t(a) if a_vec else split_c(a_s)
    b_p = split_t(b_r) if b_kind == "vec" else split_c(b_s)
    ok_p = split_c(okf)
    rb_p = split_c(read_bad) if q is not None else [None] * len(groups)
    q_ok_p = split_c(q_okf) if q is not None else [None] * len(groups)
    outs = []                                                        # [B, nc, c, H, V] per group
    j0 = 0                                                           # chunks before this group
    for gi, (nc, c, cp) in enumerate(groups):
        nBH, n = nc * BH, cp * R
        m_solve, m_read = mask_cache[cp]
        okg = ok_p[gi][..., :cp].reshape(nc, B, H, cp, 1, 1)
        dg_ = {key: x[gi] for key, x in dec_p.items()}               # this group's decay factors

        def lay(x, rr=R):  # piece [B, nc c, H(, rr), d] -> [nc, B, H, cp, rr, d] chunk-major view (tail padded)
            return _chunk_major(x.reshape(B, nc * c, H, rr, x.shape[-1]), nc, cp)

        def scal(x):  # [nc, BH, C r] -> [nBH, cp r]
            return x[..., :x.shape[-1] // C * cp].reshape(nBH, -1)

        # k and v side by side in one buffer, bad tokens zeroed (torch.where, never a product)
        kv = torch.where(okg, torch.cat([lay(k_p[gi]), lay(v_p[gi])], dim=-1).to(dt), zero).reshape(nBH, n, K + V)
        kg, vg = kv[:, :, :K], kv[:, :, K:]                          # [nBH, n, K], [nBH, n, V] (views)
        if b_kind == "vec":
            bg = torch.where(okg, lay(b_p[gi]).to(dt), zero).reshape(nBH, n, K)
        # solve rows (the reads) and the column factor sets; the signs are folded in:
        # vector a: rows b, columns [-a | k]; scalar a: rows -alpha b, columns k
        if a_vec:
            an = torch.where(okg, -lay(a_p[gi]).to(dt), zero).reshape(nBH, n, K)
            cols = torch.cat([an, kg], dim=1)                       # [nBH, 2 n, K]
            rows = bg if b_kind == "vec" else (kg * scal(b_p[gi])[..., None] if b_kind == "scalar" else kg)
        else:
            cols = kg
            rscale = -scal(a_p[gi])                                  # [nBH, n]
            if b_kind == "scalar":
                rscale = rscale * scal(b_p[gi])
            rows = (bg if b_kind == "vec" else kg) * rscale[..., None]
        qg = None
        if q is not None:
            qkeep = q_ok_p[gi][..., :cp].reshape(nc, B, H, cp, 1, 1)
            qg = torch.where(qkeep, lay(q_p[gi].unsqueeze(3), 1).to(dt), zero).reshape(nBH, cp, K)

        if decay == "channel":
            # ---- per-channel decays, halved level by level: rows X [nBH, cp, sl, K] (the reads, then
            # the probe), columns Y [nBH, cp, w R, K] ([-a | k] per sub-step)
            gch = torch.where(okg[..., 0, :], lay(g_p[gi].unsqueeze(3), 1)[..., 0, :].to(dt), zero)   # [nc, B, H, cp, K]
            gam = torch.exp(gch).reshape(nBH, cp, 1, K)              # the decay of each token
            xs = rows.reshape(nBH, cp, R, K)
            if q is not None:
                xs = torch.cat([xs, qg.reshape(nBH, cp, 1, K)], dim=2)   # [nBH, cp, sl, K]
            ys = cols.reshape(nBH, w, cp, R, K).transpose(1, 2).reshape(nBH, cp, wR, K).contiguous()
            full, xF, yE, Pd = _dplr_halving(xs, ys, gam, decayed, same, inplace, pair_cache[cp])
            full = full.reshape(nBH, cp, sl, w * n)
            Nmat = full[:, :, :R].reshape(nBH, n, w * n)              # [nBH, n, w n]
            rk = xF[:, :, :R].reshape(nBH, n, K)                      # e^{l_i} rows (decayed from the chunk start)
            if q is not None:
                P = full[:, :, R]                                     # [nBH, cp, w n]
                qd = xF[:, :, R]                                      # [nBH, cp, K]
            yE = yE.reshape(nBH, cp, w, R, K)                         # columns decayed to the chunk end
            kd = yE[:, :, w - 1].reshape(nBH, n, K)
            if a_vec:
                ad = yE[:, :, 0].reshape(nBH, n, K)
            g_end = Pd.reshape(nBH, K)                                # e^{L_C}
        elif decay == "scalar":
            L, Lr, l_row = scal(dg_["L"]), scal(dg_["Lr"]), scal(dg_["l_row"])
            shared = R == 1 and not simultaneous and after and inclusive and q is not None
            if shared:   # the reads and the probes see the same decays: one matrix, masked at the read
                dec_s = torch.exp((L[:, :, None] - L[:, None, :]).tril())
            else:
                dec_s = torch.exp(torch.where(m_solve, l_row[:, :, None] - Lr[:, None, :], zero))   # [nBH, n, n]
            Nmat = torch.bmm(rows, cols.transpose(1, 2))              # [nBH, n, w n]
            Nmat = (Nmat.reshape(nBH, n, w, n) * dec_s[:, :, None, :]).reshape(nBH, n, w * n) if a_vec else Nmat * dec_s
            rk = rows * scal(dg_["e_row"])[..., None]
            end_fac = scal(dg_["end"])[..., None]                     # [nBH, n, 1]
            g_end = dg_["g_end"].reshape(nBH)
        else:
            Nmat = torch.bmm(rows, cols.transpose(1, 2))
            rk = rows
        if decay != "channel" and (a_vec or (simultaneous and R > 1)):
            # the solve reads only the strict lower triangle; A^{bk} V and simultaneous steps need zeros
            Nmat = torch.where(m_solve.repeat(1, 2) if a_vec else m_solve, Nmat, zero)

        # ---- the one triangular solve per chunk: (I + N) X = rhs, X = [W | U]
        if a_vec:
            Nba, Nbk = Nmat[:, :, :n], Nmat[:, :, n:]                 # -A^{ba}, A^{bk}
            rhs = torch.cat([rk, torch.bmm(Nbk, vg)], dim=-1)         # [e^l b | A^{bk} V]
        else:
            Nba = Nmat
            rhs = torch.cat([rk, vg], dim=-1)                         # [-alpha e^l b | V]
        # X^T (I + N)^T = rhs^T: the fast layout for batched triangular solves on CPU
        X = torch.linalg.solve_triangular(Nba.transpose(1, 2), rhs.transpose(1, 2), upper=True, left=False,
                                          unitriangular=True).transpose(1, 2)   # [nBH, n, K + V]
        Wk, U = X.split([K, V], dim=-1)
        # ---- the sequential part, per chunk: the reads from the start state, then the state update
        # (vector a: u = W S + U, S <- Diag(g) S + K~^T V - (-A~)^T u; scalar a: z = U - W S (the right
        # side carried -alpha), S <- Diag(g) S + K~^T z)
        if decay != "channel":                                       # (per channel: from the halving)
            kd = kg if decay is None else kg * end_fac               # keys decayed to the chunk end
            if a_vec:
                ad = an if decay is None else an * end_fac           # -a decayed to the chunk end
        if a_vec:
            Dv = torch.bmm(kd.transpose(1, 2), vg).reshape(nc, BH, K, V)   # K~^T V: no state in it
            ad_j = ad.reshape(nc, BH, n, K).unbind(0)
        kd_j = kd.reshape(nc, BH, n, K).unbind(0)
        # [BH, 1, 1] or [BH, K, 1] per chunk: the decay over the chunk
        g_j = [None] * nc
        if decay is not None:
            g_j = (g_end.reshape(nc, BH, -1, 1) if decay == "channel" else g_end.reshape(nc, BH, 1, 1)).unbind(0)
        W_j, U_j = Wk.reshape(nc, BH, n, K).unbind(0), U.reshape(nc, BH, n, V).unbind(0)
        # chunk j's map: the reads from its start state, then the state update (each def closes over
        # assigned locals only: torch.compile)
        if a_vec:
            def step(j, S):
                z = torch.baddbmm(U_j[j], W_j[j], S)                  # u = W S + U  [BH, n, V]
                Sg = S + Dv[j] if g_j[j] is None else torch.addcmul(Dv[j], S, g_j[j])   # Diag(g) S + K~^T V
                return torch.baddbmm(Sg, ad_j[j].transpose(1, 2), z, alpha=-1), z
        else:
            def step(j, S):
                z = torch.baddbmm(U_j[j], W_j[j], S, alpha=-1)        # z = U - W S
                return torch.baddbmm(S if g_j[j] is None else S * g_j[j], kd_j[j].transpose(1, 2), z), z

        S, starts, zs = _pass_states(step, nc, S, docs, j0)
        j0 += nc
        if q is None:
            continue
        S_starts, z = _stacked(starts), _stacked(zs)                 # [nBH, K, V], [nBH, n, V]
        # ---- outputs: query scores P [nBH, cp, w n], masked and decayed
        if decay != "channel":
            P = torch.bmm(qg, cols.transpose(1, 2))                   # [nBH, cp, w n]
            qd = qg
            if decay == "scalar":
                Lq = scal(dg_["Lq"])
                dec_q = dec_s if shared else torch.exp(torch.where(m_read, Lq[:, :, None] - Lr[:, None, :], zero))
                P = (P.reshape(nBH, cp, w, n) * dec_q[:, :, None, :]).reshape(nBH, cp, w * n) if a_vec else P * dec_q
                qd = qg * scal(dg_["e_q"])[..., None]
            if R == 1 and not a_vec:
                P = P.tril_(0 if inclusive else -1)
            else:
                P = torch.where((m_read.repeat(1, 2) if a_vec else m_read), P, zero)
        if a_vec:   # o = Q~ S + P^a u + P^k V, P holding [-P^a | P^k]
            og = torch.baddbmm(torch.bmm(P, torch.cat([-z, vg], dim=1)), qd, S_starts)
        else:       # o = Q~ S + P z
            og = torch.baddbmm(torch.bmm(P, z), qd, S_starts)
        og = torch.where(rb_p[gi][..., :cp].reshape(nBH, cp, 1), nan_value, og)
        outs.append(_token_major(og, B, H, c))                     # [B, nc, c, H, V] (a view)
    if docs is not None:
        S = docs.final().reshape(-1, K, V)                           # [N H, K, V]
    S_out = torch.where(state_bad, nan_value, S).reshape(-1, H, K, V).to(s_dtype)   # a bad token poisons the state
    if q is None:
        return None, S_out
    o = _join_chunks(outs)                                           # [B, T, H, V]
    if docs is not None:
        o = docs.unlay(o)                                            # the documents' tokens, packed
    return o.to(v.dtype), S_out


def _dplr_halving(xs, ys, gam, decayed, same, inplace, pairs):
    """The pairs of a per-channel chunk of ``chunk_dplr``, halved level by level: in a block of 2h
    tokens a pair (row i in the second half, column j in the first) weighs ``F_h(i) E_h(j)``, one
    batched product ``(X F) (Y E)^T`` per level; the factors pass to the next level by one product
    with the halves' decays.

    Args:
        xs: ``[nBH, cp, sl, K]`` the rows (the reads, then the probe); ys: ``[nBH, cp, w R, K]`` the
            columns (``[-a | k]`` per sub-step), contiguous; gam: ``[nBH, cp, 1, K]`` each token's decay.
        decayed: per row slot, whether its state has the token's own decay (F_1 = its decay, else 1).
        same: whether pairs of one token enter (weight 1).
        inplace: update the factors in place (no autograd).
        pairs: the positions of the matrix's entries in the flat list of pairs (``pair_index``).

    Returns:
        ``(entries [nBH, cp sl w R cp], X F, Y E, P)``: the matrix's entries (zeros off the pairs), the
        rows decayed from the chunk start, the columns decayed to its end, the decay over the chunk
        ``[nBH, 1, 1, K]``.
    """
    nBH, cp, sl, K = xs.shape
    wR = ys.shape[2]
    # flat entries of the chunk's matrix: 0, the same-token pairs, then each level's pairs
    pieces = [gam.new_zeros(nBH, 1)]
    if same:
        pieces.append((xs[:, :, :, None] * ys[:, :, None]).sum(-1).reshape(nBH, -1))   # [nBH, cp sl wR]
    # X F_1 (F_1 = the token's decay where the slot's state has it), Y E_1 (E_1 = 1)
    if all(decayed):
        xF = xs * gam
    elif any(decayed):
        xF = xs * torch.cat([gam if d else torch.ones_like(gam) for d in decayed], dim=2)
    else:
        xF = xs
    yE, Pd = ys, gam                                                 # Pd [nBH, cp / h, 1, K]: each h-block's decay
    h = 1
    while h < cp:
        nb = cp // (2 * h)                                           # blocks of 2h tokens per chunk
        xb, yb = xF.reshape(nBH, nb, 2, h * sl, K), yE.reshape(nBH, nb, 2, h * wR, K)
        if h == 1:                                                   # [nBH, nb, sl, wR]
            off = (xb[:, :, 1, :, None] * yb[:, :, 0, None]).sum(-1)
        else:                                                        # [nBH, nb, h sl, h wR]
            off = torch.matmul(xb[:, :, 1], yb[:, :, 0].transpose(-1, -2))
        pieces.append(off.reshape(nBH, -1))
        # to blocks of 4h: the second halves' F pick up the first half's decay, the first
        # halves' E the second half's
        Pb = Pd.reshape(nBH, nb, 2, 1, K)
        if inplace and h > 1:                                        # (level 1's factors may be the inputs)
            xb[:, :, 1].mul_(Pb[:, :, 0])
            yb[:, :, 0].mul_(Pb[:, :, 1])
        else:   # fresh contiguous tensors (the levels after may update them in place through views)
            xF = torch.stack([xb[:, :, 0], xb[:, :, 1] * Pb[:, :, 0]], dim=2).reshape(nBH, cp, sl, K)
            yE = torch.stack([yb[:, :, 0] * Pb[:, :, 1], yb[:, :, 1]], dim=2).reshape(nBH, cp, wR, K)
        Pd = Pb[:, :, 0] * Pb[:, :, 1]                               # [nBH, nb, 1, K]
        h *= 2
    # rows (token, slot), columns (set, token, sub-step); zeros off the pairs
    return torch.cat(pieces, dim=1).index_select(1, pairs), xF, yE, Pd
