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


def chunk_dplr(q, k, v, a, b, log_decay, S0, chunk, inclusive=True, simultaneous=False, read_after_decay=False,
               group=None, sub=None, a_form=None, b_form=None, decay_form=None):
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

    Decays are exponentiated only as differences ``l_i - L_j <= 0`` (scalar decays), or, per
    channel, in sub-blocks of ``sub`` tokens: between blocks the factor splits at the later
    block's start, ``e^{l_i - ref_I} e^{ref_I - L_j}`` (both <= 1, block sums added exactly);
    inside a block it splits at the block's start in float64 (``e^{-lambda_j}`` <= e^640 with
    log decays >= -40 per token and ``sub <= 16``).  Log decays below -40 per token are clamped
    to -40 (a factor of 4e-18): finite values and gradients for any input.

    Non-finite inputs: a token whose state inputs (k, v, a, b, log decay) are not all finite is
    replaced by an identity token (by ``torch.where``), and every output that reads a state at or
    after it, and the final state, are NaN; a non-finite probe makes only its own output NaN.
    Outputs before such a token are exact and their gradients finite.

    Args:
        q, k, v, a, b, log_decay, S0: as in :func:`recurrent_dplr` (``q [B, T, H, K]``,
            ``k [B, T, H, R, K]``, ``v [B, T, H, R, V]``, ``a [B, T, H, R, K]`` or ``[B, T, H, R]``,
            ``b [B, T, H, R, K]`` or ``[B, T, H, R]`` or None, ``log_decay [B, T, H]`` or
            ``[B, T, H, K]`` or None, ``S0 [B, H, K, V]`` or None; without the R axis for R = 1).
        chunk: tokens per chunk C (C R sub-steps enter each solve).
        inclusive: True: o_t reads the state after token t; False: before it.
        simultaneous: the R terms of a token read the state before the token.
        read_after_decay: the reads of sub-step 0 see the state after the token's decay.
        group: chunks per batched group G (default: temporaries near 512 KB on CPU, 64 elsewhere);
            any G >= 1 gives the same numbers.
        sub: tokens per decay sub-block for per-channel decays (default 16, or the largest
            divisor of C below it; at most 16); any value gives the same numbers.
        a_form, b_form, decay_form: the forms of ``a`` (``"vector"`` or ``"scalar"``), ``b``
            (``"key"``: None, ``"scalar"``, ``"vector"``) and ``log_decay`` (``"none"``,
            ``"scalar"``, ``"channel"``), which must agree with the tensors passed; None: read
            from their ranks.  A generated module passes them, so that its specialised copy of
            this kernel keeps only the paths it runs.

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
    wide = torch.float64                                             # the in-block factors of per-channel decays
    dev = k.device
    # the forms of a, b and the decay (the passed forms first: the specialiser folds them)
    a_vec = a_form == "vector" if a_form is not None else a.dim() == 5   # a as vectors (else a scalar times k)
    b_kind = (("k" if b_form == "key" else "vec" if b_form == "vector" else "scalar") if b_form is not None
              else "k" if b is None else "vec" if b_r.dim() == 5 else "scalar")
    decay = ((None if decay_form == "none" else decay_form) if decay_form is not None
             else None if log_decay is None else "channel" if log_decay.dim() == 4 else "scalar")
    S = k.new_zeros(BH, K, V, dtype=dt) if S0 is None else S0.to(dt).reshape(BH, K, V)
    s_dtype = S0.dtype if S0 is not None else v.dtype
    if T == 0:
        return (v.new_zeros(B, 0, H, V) if q is not None else None), S.reshape(B, H, K, V).to(s_dtype)
    C = max(1, min(int(chunk), T))
    N, rem = divmod(T, C)
    Np = N + (rem > 0)
    ns = 1                                                           # tokens per decay sub-block
    if decay == "channel":
        target = max(1, min(16, int(sub) if sub is not None else 16, C))
        ns = max(d for d in range(1, target + 1) if C % d == 0)
    w = 2 if a_vec else 1                                            # column factor sets: [-a | k] or [k]
    n_full = C * R
    width = max(K + V, w * n_full)
    if decay == "channel":
        width = max(width, w * (C // ns) * K)
    if group is not None:
        G = int(group)
    elif dev.type == "cpu":         # temporaries near 512 KB (float32): no page faults per call
        G = round((1 << 17) / (BH * n_full * width))
    else:                           # caching allocators: fewer, larger launches
        G = 64
    G = max(1, min(N, G)) if N else 1
    # groups (chunks nc, tokens c, tokens after padding cp): the tail chunk is padded with identity
    # tokens (zeros) to a multiple of the decay sub-block
    groups = [(min(G, N - j), C, C) for j in range(0, N, G)]
    if rem:
        groups.append((1, rem, -(-rem // ns) * ns))
    after = read_after_decay and decay is not None

    # ---- per-token flags and scalars, all chunks at once ([Np, BH, C] or [Np, BH, C R])
    def per_chunk(x, r):  # [B, T, H(, r)] -> [Np, BH, C r], chunk-major, tail padded with zeros
        x = x.reshape(B, T, H, r)
        if Np * C > T:
            x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, Np * C - T))
        return x.reshape(B, Np, C, H, r).permute(1, 0, 3, 2, 4).contiguous().reshape(Np, BH, C * r)

    # a token is bad when one of its state inputs is not finite (the sum is then NaN or inf)
    total = k.sum((-2, -1), dtype=dt) + v.sum((-2, -1), dtype=dt)
    total = total + (a.sum((-2, -1), dtype=dt) if a_vec else a.sum(-1, dtype=dt))
    if b_kind != "k":
        total = total + (b_r.sum((-2, -1), dtype=dt) if b_kind == "vec" else b_r.sum(-1, dtype=dt))
    if decay is not None:
        lg_all = log_decay.to(dt).clamp_min(-40.0)                   # (a decay of 0, log -inf, is valid)
        total = total + (lg_all.sum(-1) if decay == "channel" else lg_all)
    okf = torch.isfinite(per_chunk(total, 1))                        # [Np, BH, C] (padding: ok)
    # the state is never poisoned inside (no NaN ever meets a product, forward or backward): the
    # outputs reading a state at or after a bad token, and the final state, are set to NaN at the end
    bad = (~torch.isfinite(total)).to(dt)                            # [B, T, H]
    bad_before = torch.cumsum(bad, dim=1)                            # bad tokens at or before t
    state_bad = (bad_before[:, -1] > 0).reshape(BH, 1, 1)
    zero = torch.zeros((), dtype=dt, device=dev)
    nan_value = torch.full((), float("nan"), dtype=dt, device=dev)
    if q is not None:
        q_okf = torch.isfinite(per_chunk(q.sum(-1, dtype=dt), 1))
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

    def split_t(x):  # [B, T, ...] -> one [B, n c, ...] piece per group
        return x.split([nc * c for nc, c, _ in groups], dim=1) if x is not None else [None] * len(groups)

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

    def channel_factors(glog):
        """The decay factors of per-channel log decays glog [M, nbk, ns, K] (sub-blocks of ns tokens)."""
        nbk = glog.shape[1]
        lam = torch.cumsum(glog, dim=2)                               # in-block cumulative log decay (inclusive)
        tot = lam[:, :, -1]                                           # [M, nbk, K] each block's log decay
        e_nlam = torch.exp(lam.to(wide, copy=True).neg_())           # e^{-lam_j} <= e^{16 * 40} (float64)
        e_colend = (e_nlam * torch.exp(tot.to(wide))[:, :, None]).to(dt)   # e^{tot_J - lam_j} <= 1
        f = {"e_nlam": e_nlam}
        # row factors e^{rho_i} <= 1 (float64) per token and row slot: the R reads, then the probe
        lam_q = None if q is None else ("lam" if inclusive else "lamp")
        slots = [("lamp" if before == "all" or (before == "first" and r == 0) else "lam") for r in range(R)]
        slots += [lam_q] if lam_q else []
        pick = {"lam": torch.reciprocal(e_nlam) if "lam" in slots else None,
                "lamp": torch.exp((lam - glog).to(wide)) if "lamp" in slots else None}
        if len(set(slots)) == 1:
            f["e_row"] = pick[slots[0]][:, :, :, None]                # [M, nbk, ns, 1, K]
        else:
            f["e_row"] = torch.stack([pick[x] for x in slots], dim=3)  # [M, nbk, ns, slots, K]
        if nbk == 1:
            f["end"], f["g_end"] = e_colend, torch.exp(tot[:, 0])    # e^{L_C - L_j}, e^{L_C}
            return f
        ref = torch.cumsum(tot, dim=1) - tot                          # before block I (a prefix sum: exact)
        suf = torch.flip(torch.cumsum(torch.flip(tot, (1,)), dim=1), (1,)) - tot   # after block J
        bi = torch.arange(nbk, device=dev)
        between = ((bi[None, :, None] > bi[None, None, :]) & (bi[None, :, None] < bi[:, None, None])).to(dt)
        seg = torch.einsum("imj,bmk->bijk", between, tot).contiguous()   # blocks strictly between J and I
        f.update({"e_colend": e_colend, "end": torch.exp(suf)[:, :, None] * e_colend, "e_seg": torch.exp(seg),
                  "e_ref": torch.exp(ref), "g_end": torch.exp(ref[:, -1] + tot[:, -1])})
        return f

    dec_p = {key: split_c(x) for key, x in dec.items()}

    k_p, v_p, q_p = split_t(k), split_t(v), split_t(q)
    g_p = split_t(lg_all) if decay == "channel" else None
    a_p = split_t(a) if a_vec else split_c(a_s)
    b_p = split_t(b_r) if b_kind == "vec" else split_c(b_s)
    ok_p = split_c(okf)
    rb_p = split_c(read_bad) if q is not None else [None] * len(groups)
    q_ok_p = split_c(q_okf) if q is not None else [None] * len(groups)
    outs = []                                                        # [B, nc, c, H, V] per group
    for gi, (nc, c, cp) in enumerate(groups):
        nBH, n = nc * BH, cp * R
        m_solve, m_read = mask_cache[cp]
        okg = ok_p[gi][..., :cp].reshape(nc, B, H, cp, 1, 1)
        dg_ = {key: x[gi] for key, x in dec_p.items()}               # this group's decay factors

        def lay(x, rr=R):  # piece [B, nc c, H(, rr), d] -> [nc, B, H, cp, rr, d] chunk-major view (tail padded)
            x = x.reshape(B, nc, c, H, rr, x.shape[-1]).permute(1, 0, 3, 2, 4, 5)
            if cp > c:
                x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, cp - c))
            return x

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
            # ---- per-channel decays, sub-blocks of ns tokens (nbk per chunk, m sub-steps each); the read
            # rows and the probe rows of a block enter the same products
            nbk, m = cp // ns, ns * R
            gch = torch.where(okg[..., 0, :], lay(g_p[gi].unsqueeze(3), 1)[..., 0, :].to(dt), zero)   # [nc, B, H, cp, K]
            dg_ = channel_factors(gch.reshape(nBH, nbk, ns, K))
            sl = R + (q is not None)                                  # row slots per token: R reads (+ the probe)
            x = rows.reshape(nBH, nbk, ns, R, K)
            if q is not None:
                x = torch.cat([x, qg.reshape(nBH, nbk, ns, 1, K)], dim=3)   # [nBH, nbk, ns, sl, K]
            x64 = (x * dg_["e_row"]).reshape(nBH, nbk, ns * sl, K)  # e^{rho_i} x_i (float64)
            mask_d = m_solve[:m, :m].reshape(ns, R, m)
            if q is not None:
                mask_d = torch.cat([mask_d, m_read[:ns, None, :m]], dim=1)   # [ns, sl, m]
            mask_d = mask_d.reshape(ns * sl, 1, 1, m)
            y = cols.reshape(nBH, w, nbk, ns, R, K)
            # inside a block: e^{rho_i - lam_j} = e^{rho_i} e^{-lam_j} in float64
            y64 = (y * dg_["e_nlam"][:, None, :, :, None]).transpose(1, 2).reshape(nBH, nbk, w * m, K)
            dgm = torch.matmul(x64, y64.transpose(-1, -2)).reshape(nBH, nbk, ns * sl, w, 1, m)
            dgm = torch.where(mask_d, dgm, 0.0).to(dt)
            x32 = x64.to(dt)
            if nbk == 1:
                full = dgm                                            # [nBH, 1, ns sl, w, 1, m]
            else:
                # between blocks J < I: e^{rho_i} * e^{seg_IJ} * e^{tot_J - lam_j}, each <= 1
                e_seg = dg_["e_seg"]
                yI = e_seg[:, :, None, :, None, None] * (y * dg_["e_colend"][:, None, :, :, None])[:, None]
                off = torch.matmul(x32, yI.reshape(nBH, nbk, w * n, K).transpose(-1, -2))
                off = off.reshape(nBH, nbk, ns * sl, w, nbk, m)
                bi = torch.arange(nbk, device=dev)
                full = torch.where((bi[:, None] > bi[None, :])[:, None, None, :, None], off,
                                   torch.where((bi[:, None] == bi[None, :])[:, None, None, :, None], dgm, zero))
                x32 = x32 * dg_["e_ref"][:, :, None]             # e^{l_i} rows (the block offset)
            full = full.reshape(nBH, nbk, ns, sl, w * n)
            x32 = x32.reshape(nBH, nbk, ns, sl, K)
            Nmat = full[:, :, :, :R].reshape(nBH, n, w * n)           # [nBH, n, w n]
            rk = x32[:, :, :, :R].reshape(nBH, n, K)                  # e^{l_i} rows
            if q is not None:
                P = full[:, :, :, R].reshape(nBH, cp, w * n)
                qd = x32[:, :, :, R].reshape(nBH, cp, K)
            end_fac = dg_["end"][:, :, :, None].expand(-1, -1, -1, R, -1).reshape(nBH, n, K)   # e^{L_C - L_j}
            g_end = dg_["g_end"]
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
        kd = kg if decay is None else kg * end_fac                   # keys decayed to the chunk end
        if a_vec:
            ad = an if decay is None else an * end_fac               # -a decayed to the chunk end
            Dv = torch.bmm(kd.transpose(1, 2), vg).reshape(nc, BH, K, V)   # K~^T V: no state in it
            ad_j = ad.reshape(nc, BH, n, K).unbind(0)
        kd_j = kd.reshape(nc, BH, n, K).unbind(0)
        g_j = g_end.reshape(nc, BH, *g_end.shape[1:]).unbind(0) if decay is not None else [None] * nc
        zs, starts = [], []
        for j, (W_j, U_j) in enumerate(zip(Wk.reshape(nc, BH, n, K).unbind(0), U.reshape(nc, BH, n, V).unbind(0))):
            starts.append(S)
            Sg = S if g_j[j] is None else S * (g_j[j][:, None, None] if decay == "scalar" else g_j[j][:, :, None])
            if a_vec:
                z = torch.baddbmm(U_j, W_j, S)                        # u = W S + U  [BH, n, V]
                S = torch.baddbmm(Sg + Dv[j], ad_j[j].transpose(1, 2), z, alpha=-1)
            else:
                z = torch.baddbmm(U_j, W_j, S, alpha=-1)              # z = U - W S
                S = torch.baddbmm(Sg, kd_j[j].transpose(1, 2), z)
            zs.append(z)
        if q is None:
            continue
        S_starts = torch.stack(starts).reshape(nBH, K, V) if nc > 1 else starts[0]
        z = torch.stack(zs).reshape(nBH, n, V) if nc > 1 else zs[0]
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
        outs.append(og.reshape(nc, B, H, cp, V)[:, :, :, :c].permute(1, 0, 3, 2, 4))   # [B, nc, c, H, V] (a view)
    S_out = torch.where(state_bad, nan_value, S).reshape(B, H, K, V).to(s_dtype)   # a bad token poisons the state
    if q is None:
        return None, S_out
    # one copy into [B, T, H, V] (a second one only for a tail chunk); no in-place writes
    full = [x for x, (_, c, _) in zip(outs, groups) if c == C]
    o = torch.cat(full, dim=1).reshape(B, N * C, H, V) if full else v.new_zeros(B, 0, H, V, dtype=dt)
    if len(full) < len(outs):
        o = torch.cat([o, outs[-1].reshape(B, rem, H, V)], dim=1)
    return o.to(v.dtype), S_out
