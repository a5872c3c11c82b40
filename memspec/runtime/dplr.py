"""Exact chunked kernel for diagonal-plus-low-rank (DPLR) transitions, and its token-loop reference.

One token applies R >= 1 sub-steps in order; sub-step r is

    S <- Diag(d_{t,r}) S + a_{t,r} (b_{t,r}^T S) + outer(k_{t,r}, v_{t,r})

on the state ``S [K, V]`` (row-vector convention: reads ``q @ S``), where ``b`` reads the state
*before* the sub-step and the decay ``d_t = exp(log_decay_t)`` (a scalar or one factor per key
channel) acts on the first sub-step of the token only.  This one form covers:

==========================  ==========================================================================
DeltaNet                    ``a = -beta`` (scalar: ``a = -beta k``), ``b = None`` (``= k``), ``v <- beta v``
gated DeltaNet              + scalar ``log_decay``; ``b = exp(log_decay)`` (scalar, the error read
                            after the decay) or ``None`` (read before it)
Kimi Delta Attention        per-channel ``log_decay [B, T, H, K]``, ``a = -beta``, ``b = exp(g) * k``
Gated DeltaNet-2            per-channel decay, ``a = -1``, ``b = exp(g) * b_gate * k``, ``v <- w * v``
Comba                       scalar decay, ``a = -beta``, ``b = exp(log_decay) * p`` (``p != k``)
RWKV-7 / DPLR               per-channel decay, arbitrary vectors ``a``, ``b``
gated DeltaProduct          R Householder steps per token: ``k, v [B, T, H, R, *]``, ``a = -beta``
                            ``[B, T, H, R]``, ``b`` = ``k`` scaled by the decay on sub-step 0 only
==========================  ==========================================================================

``simultaneous=True`` instead applies the R rank-1 terms of a token at once, all reading the
state before the token: ``S <- Diag(d_t) S + sum_r a_{t,r} (b_{t,r}^T S) + sum_r outer(k_{t,r}, v_{t,r})``.

See :mod:`memspec.runtime` for the rules every kernel here follows (standalone, torch only,
log decays, float32 arithmetic, groups of chunks).
"""
from __future__ import annotations

import torch


def recurrent_dplr(q, k, v, a, b, log_decay, S0, inclusive=True, simultaneous=False):
    """Token-loop reference for the diagonal-plus-low-rank recurrence (see the module docstring).

    Sub-step r of token t: ``u = b_{t,r} @ S`` (the state before the sub-step), then
    ``S <- Diag(d) S + outer(a_{t,r}, u) + outer(k_{t,r}, v_{t,r})`` with ``d = exp(log_decay_t)``
    on sub-step 0 and ``d = 1`` on the others.  ``o_t = q_t @ S`` after the token's last sub-step
    (``inclusive``) or before its first (``inclusive=False``).

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
            u = torch.einsum("bhrk,bhkv->bhrv", b[:, t], S)                         # [B, H, R, V]
            S = S if d is None else d * S
            S = S + torch.einsum("bhrk,bhrv->bhkv", a[:, t], u) + torch.einsum("bhrk,bhrv->bhkv", k[:, t], v[:, t])
        else:
            for r in range(R):
                u = torch.einsum("bhk,bhkv->bhv", b[:, t, :, r], S)                 # [B, H, V]
                if r == 0 and d is not None:
                    S = d * S
                S = S + a[:, t, :, r, :, None] * u[..., None, :] + k[:, t, :, r, :, None] * v[:, t, :, r, None, :]
        if q is not None:
            read = S if inclusive else S_before
            outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t].to(dt), read))
    o = None
    if q is not None:
        o = torch.stack(outs, dim=1).to(v.dtype) if outs else v.new_zeros(B, 0, H, V)
    return o, S.to(S0.dtype if S0 is not None else v.dtype)


def chunk_dplr(q, k, v, a, b, log_decay, S0, chunk, inclusive=True, simultaneous=False, group=None, sub=None):
    """Exact chunked diagonal-plus-low-rank recurrence (WY / UT representation, generalised).

    The recurrence is :func:`recurrent_dplr`'s; all arguments mean the same (shapes there).
    Inside a chunk the C R sub-steps are indexed ``i = t R + r``.  With cumulative log decays
    ``L_t`` (per channel where the decay is), the read of sub-step i,
    ``u_i = b_i^T S_{i-1}``, is affine in the chunk's start state:
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

    Decays are exponentiated only as differences ``l_i - L_j <= 0``.  Per-channel decays use
    sub-blocks of ``sub`` tokens: between blocks the factor splits at the later block's start
    (``e^{l_i - ref_I} e^{ref_I - L_j}``, both <= 1, the block sums added exactly); inside a
    block it is formed per channel: finite values and gradients for any log decay >= -80
    per token (smaller ones are clamped to -80).

    Non-finite inputs: a token whose state inputs (k, v, a, b, log decay) are not all finite is
    replaced by an identity token (by ``torch.where``), and every output that reads a state at or
    after it, and the final state, are NaN; a non-finite probe makes only its own output NaN.
    Outputs before such a token are exact and their gradients finite.

    Args:
        q, k, v, a, b, log_decay, S0: as in :func:`recurrent_dplr` (``q [B, T, H, K]``,
            ``k, b [B, T, H, R, K]``, ``v [B, T, H, R, V]``, ``a [B, T, H, R, K]`` or
            ``[B, T, H, R]``, ``b`` also ``[B, T, H, R]`` or None, ``log_decay [B, T, H]`` or
            ``[B, T, H, K]`` or None, ``S0 [B, H, K, V]`` or None; without the R axis for R = 1).
        chunk: tokens per chunk C (C R sub-steps enter each solve).
        inclusive: True: o_t reads the state after token t; False: before it.
        simultaneous: the R terms of a token read the state before the token.
        group: chunks per batched group G (default: temporaries near 512 KB on CPU, 64 elsewhere);
            any G >= 1 gives the same numbers.
        sub: tokens per decay sub-block for per-channel decays (default about sqrt(C / R),
            a divisor of C); any value gives the same numbers.

    Returns:
        (o ``[B, T, H, V]`` or None, S_T ``[B, H, K, V]``).
    """
    if k.dim() == 4:
        k, v, a = k.unsqueeze(3), v.unsqueeze(3), a.unsqueeze(3)
        b = b.unsqueeze(3) if b is not None else None
    B, T, H, R, K = k.shape
    V = v.shape[-1]
    BH = B * H
    dt = torch.promote_types(k.dtype, torch.float32)
    dev = k.device
    a_vec = a.dim() == 5                                              # a given as vectors
    b_kind = "k" if b is None else ("vec" if b.dim() == 5 else "scalar")
    decay = None if log_decay is None else ("channel" if log_decay.dim() == 4 else "scalar")
    S = k.new_zeros(BH, K, V, dtype=dt) if S0 is None else S0.to(dt).reshape(BH, K, V)
    s_dtype = S0.dtype if S0 is not None else v.dtype
    if T == 0:
        return (v.new_zeros(B, 0, H, V) if q is not None else None), S.view(B, H, K, V).to(s_dtype)
    C = max(1, min(int(chunk), T))
    N, rem = divmod(T, C)
    Np = N + (rem > 0)
    nsub = 1                                                          # tokens per decay sub-block
    if decay == "channel":
        target = int(sub) if sub is not None else max(1, round((C / R) ** 0.5))
        nsub = max(d for d in range(1, min(target, C) + 1) if C % d == 0)
    n_full = C * R                                                    # sub-steps of a full chunk
    width = max(K + V, n_full) if not a_vec else max(K + V, 2 * n_full)
    if decay == "channel":
        nb_full = C // nsub
        width = max(width, (nb_full * (2 if a_vec else 1) + nsub * R) * K)
    if group is not None:
        G = int(group)
    elif dev.type == "cpu":         # temporaries near 512 KB (float32): no page faults per call
        G = round((1 << 17) / (BH * n_full * width))
    else:                           # caching allocators: fewer, larger launches
        G = 64
    G = max(1, min(N, G)) if N else 1
    # groups (chunks n, tokens c, tokens after padding cp): the tail chunk is padded with identity
    # tokens (zeros) to a multiple of the decay sub-block
    groups = [(min(G, N - j), C, C) for j in range(0, N, G)]
    if rem:
        groups.append((1, rem, -(-rem // nsub) * nsub))

    # ---- per-token flags and scalars, all chunks at once ([Np, BH, C] or [Np, BH, C R])
    def per_chunk(x, r):  # [B, T, H(, r)] -> [Np, BH, C r], chunk-major, tail padded with zeros
        x = x.reshape(B, T, H, r)
        if Np * C > T:
            x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, Np * C - T))
        return x.reshape(B, Np, C, H, r).permute(1, 0, 3, 2, 4).reshape(Np, BH, C * r)

    total = k.sum((-2, -1), dtype=dt) + v.sum((-2, -1), dtype=dt)    # [B, T, H]: non-finite iff an input is
    total = total + (a.sum((-2, -1), dtype=dt) if a_vec else a.sum(-1, dtype=dt))
    if b_kind != "k":
        total = total + (b.sum((-2, -1), dtype=dt) if b_kind == "vec" else b.sum(-1, dtype=dt))
    if decay is not None:
        lg_all = log_decay.to(dt).clamp_min(-80.0)
        total = total + (lg_all.sum(-1) if decay == "channel" else lg_all)
    ok = torch.isfinite(per_chunk(total, 1))                          # [Np, BH, C] bool (padding: ok)
    bad_cum = torch.cumsum((~ok).to(dt), dim=-1) > 0                 # a bad token at or before t
    chunk_bad = bad_cum[..., -1]                                      # [Np, BH]
    if q is not None:
        q_ok = torch.isfinite(per_chunk(q.sum(-1, dtype=dt), 1))
        read_bad = bad_cum if inclusive else torch.cumsum((~ok).to(dt), dim=-1) - (~ok).to(dt) > 0
        read_bad = read_bad | ~q_ok                                   # [Np, BH, C]
    ok_r = ok.repeat_interleave(R, dim=-1) if R > 1 else ok          # [Np, BH, C R]
    zero = torch.zeros((), dtype=dt, device=dev)
    a_s = None if a_vec else torch.where(ok_r, per_chunk(a.to(dt), R), zero)   # scalar a, [Np, BH, C R]
    b_s = torch.where(ok_r, per_chunk(b.to(dt), R), zero) if b_kind == "scalar" else None
    g_s = torch.where(ok, per_chunk(lg_all, 1), zero) if decay == "scalar" else None

    # ---- masks (sub-step i = t R + r; token of i = i // R)
    def masks(c):
        n = c * R
        tok = torch.arange(n, device=dev) // R
        sub_r = torch.arange(n, device=dev) % R
        ti = torch.arange(c, device=dev)
        if simultaneous:
            solve = tok[:, None] > tok[None, :]                      # j in an earlier token
            first = torch.ones(n, dtype=torch.bool, device=dev)      # every read sees the previous token
        else:
            solve = torch.arange(n, device=dev)[:, None] > torch.arange(n, device=dev)[None, :]
            first = sub_r == 0                                        # only sub-step 0 reads before the decay
        read = ti[:, None] >= tok[None, :] if inclusive else ti[:, None] > tok[None, :]   # [c, n]
        return solve, read, first

    mask_cache = {}

    def split_t(x):  # [B, T, ...] -> one [B, n c, ...] piece per group
        return x.split([nc * c for nc, c, _ in groups], dim=1) if x is not None else [None] * len(groups)

    def split_c(x):  # [Np, BH, ...] -> one [n, BH, ...] piece per group
        return x.split([nc for nc, _, _ in groups], dim=0)

    k_p, v_p, q_p = split_t(k), split_t(v), split_t(q)
    a_p = split_t(a) if a_vec else split_c(a_s)
    b_p = split_t(b) if b_kind == "vec" else (split_c(b_s) if b_kind == "scalar" else [None] * len(groups))
    g_p = split_t(lg_all) if decay == "channel" else (split_c(g_s) if decay == "scalar" else [None] * len(groups))
    ok_p, bad_p, chunk_bad_p = split_c(ok), split_c(bad_cum), split_c(chunk_bad)
    rb_p = split_c(read_bad) if q is not None else [None] * len(groups)
    q_ok_p = split_c(q_ok) if q is not None else [None] * len(groups)
    eye = torch.eye(K, dtype=dt, device=dev)
    outs = []
    for gi, (nc, c, cp) in enumerate(groups):
        nBH, n = nc * BH, cp * R
        if cp not in mask_cache:
            mask_cache[cp] = masks(cp)
        m_solve, m_read, first = mask_cache[cp]
        okg = ok_p[gi][..., :cp].reshape(nc, B, H, cp, 1, 1)

        def lay(x, d, rr=R, keep=okg):  # piece [B, nc c, H(, rr), d] -> [nBH, cp rr, d] (one copy; bad tokens zeroed)
            x = x.reshape(B, nc, c, H, rr, d).permute(1, 0, 3, 2, 4, 5)
            if cp > c:
                x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, cp - c))
            return torch.where(keep, x.to(dt), zero).reshape(nBH, cp * rr, d)

        def scal(x):  # [nc, BH, C R] -> [nBH, n]
            return x[..., :n].reshape(nBH, n)

        kg = lay(k_p[gi], K)                                          # [nBH, n, K]
        vg = lay(v_p[gi], V)                                          # [nBH, n, V]
        if b_kind == "vec":
            bg = lay(b_p[gi], K)
        elif b_kind == "scalar":
            bg = kg * scal(b_p[gi])[..., None]
        else:
            bg = kg
        # left factor, sign folded in: "an" = -a (vector a) or "ab" = -alpha b (scalar a: a = alpha k)
        if a_vec:
            an = -lay(a_p[gi], K)                                     # [nBH, n, K]
        else:
            alpha = scal(a_p[gi])                                     # [nBH, n]
            ab = bg * (-alpha)[..., None]                             # rows of the solve: -alpha_i b_i
        cols = torch.cat([an, kg], dim=1) if a_vec else kg           # [nBH, w n, K] column factors
        rows = bg if a_vec else ab                                    # [nBH, n, K] solve-row factors
        qg = lay(q_p[gi].unsqueeze(3), K, 1, q_ok_p[gi][..., :cp].reshape(nc, B, H, cp, 1, 1)) if q is not None else None

        if decay == "scalar":
            g = g_p[gi][..., :cp].reshape(nBH, cp)                    # [nBH, cp] log decays
            L = torch.cumsum(g, dim=-1)                               # cumulative log decay in the chunk
            Lp = L - g                                                # before token t's decay
            Lr = L.repeat_interleave(R, dim=-1) if R > 1 else L       # [nBH, n] column log of sub-step j
            Lpr = Lp.repeat_interleave(R, dim=-1) if R > 1 else Lp
            l_row = torch.where(first, Lpr, Lr)                       # [nBH, n] log the read of i sees
            row_fac = torch.exp(l_row)                                # e^{l_i}
            end_fac = torch.exp(L[:, -1:] - Lr)                       # [nBH, n] decay from j to the chunk end
            g_end = torch.exp(L[:, -1])                               # [nBH]
            dec_s = torch.exp(torch.where(m_solve, l_row[:, :, None] - Lr[:, None, :], zero))   # [nBH, n, n]
            Nmat = torch.bmm(rows, cols.transpose(1, 2))              # [nBH, n, w n]
            if a_vec:
                Nmat = (Nmat.view(nBH, n, 2, n) * dec_s[:, :, None, :]).view(nBH, n, 2 * n)
            else:
                Nmat = Nmat * dec_s
        elif decay == "channel":
            gch = lay(g_p[gi].unsqueeze(3), K, 1)                    # [nBH, cp, K] (bad tokens: 0)
            nbk, m = cp // nsub, nsub * R                             # sub-blocks, sub-steps per block
            gb = gch.view(nBH, nbk, nsub, K)
            lam = torch.cumsum(gb, dim=2)                             # local inclusive cumulative logs
            lamp = lam - gb                                           # local, before the token's decay
            tot = lam[:, :, -1]                                       # [nBH, nbk, K] per block
            ref = torch.cumsum(tot, dim=1) - tot                      # log decay before block I (prefix sum)
            suf = torch.flip(torch.cumsum(torch.flip(tot, (1,)), dim=1), (1,)) - tot   # after block J
            idx = torch.arange(nbk, device=dev)
            between = (idx[None, :, None] > idx[None, None, :]) & (idx[:, None, None] > idx[None, None, :]) \
                & (idx[None, :, None] < idx[:, None, None])            # [I, m, J]: J < m < I
            seg = torch.einsum("imj,bmk->bijk", between.to(dt), tot)  # [nBH, I, J, K]: sum of blocks strictly between
            lam_r = lam.repeat_interleave(R, dim=2) if R > 1 else lam     # [nBH, nbk, m, K] column logs
            lamp_r = lamp.repeat_interleave(R, dim=2) if R > 1 else lamp
            first_b = first.view(nbk, m)[0] if not simultaneous else None
            rho = lamp_r if (simultaneous or R == 1) else torch.where(first_b[:, None], lamp_r, lam_r)   # local row logs
            # off-diagonal blocks: e^{l_i - L_j} = e^{rho_i} * e^{seg_IJ + tot_J - lam_j}, both factors <= 1
            col_e = torch.exp(seg[:, :, :, None, :] + (tot[:, None, :, None, :] - lam_r[:, None]))   # [nBH, I, J, m, K]
            col_e = col_e.reshape(nBH, nbk, n, K)
            blk_lt = (idx[:, None] > idx[None, :])                    # [I, J]

            def decayed(x, rho_x, mx, ys, mask_d):
                """sum_c x_ic y_jc e^{rho-global_i - L_j} masked: rows x [nBH, nbk mx, K] with local logs
                rho_x [nBH, nbk, mx, K]; ys [nBH, w, n, K]; mask_d [mx, m] inside a block.
                Returns [nBH, nbk mx, w, n]."""
                w = ys.shape[1]
                xr = x.view(nBH, nbk, mx, K) * torch.exp(rho_x)      # e^{rho_i} x_i
                Y = col_e[:, :, None] * ys[:, None]                   # [nBH, I, w, n, K]
                off = torch.matmul(xr[:, :, None], Y.transpose(-1, -2))   # [nBH, I, w, mx, n]
                off = off.permute(0, 1, 3, 2, 4).reshape(nBH, nbk, mx, w, nbk, m)
                yb = ys.view(nBH, w, nbk, m, K).transpose(1, 2)       # [nBH, nbk, w, m, K]
                e_in = torch.exp((rho_x[:, :, :, None, :] - lam_r[:, :, None, :, :]).clamp_max(0.0))  # [nBH, nbk, mx, m, K]
                diag = torch.einsum("bimk,bimjk,biwjk->bimwj", x.view(nBH, nbk, mx, K), e_in, yb)  # [nBH, nbk, mx, w, m]
                eq = torch.eye(nbk, dtype=torch.bool, device=dev)
                full = torch.where(blk_lt[:, None, None, :, None], off,
                                   torch.where(eq[:, None, None, :, None] & mask_d[None, :, None, None, :],
                                               diag[:, :, :, :, None, :], zero))
                return full.reshape(nBH, nbk * mx, w, n)

            Nmat = decayed(rows, rho, m, cols.view(nBH, 2 if a_vec else 1, n, K),
                           m_solve[:m, :m]).reshape(nBH, n, -1)      # [nBH, n, w n]
            row_fac = torch.exp(ref[:, :, None] + rho).reshape(nBH, n, K)         # e^{l_i} per channel
            end_fac = torch.exp(suf[:, :, None] + (tot[:, :, None] - lam_r)).reshape(nBH, n, K)
            g_end = torch.exp(ref[:, -1] + tot[:, -1])                # [nBH, K]
        else:
            Nmat = torch.bmm(rows, cols.transpose(1, 2))
        if decay != "channel" and (a_vec or (simultaneous and R > 1)):
            # the solve reads only the strict lower triangle; A^{bk} V and the simultaneous mask need zeros
            Nmat = torch.where(m_solve.repeat(1, 2) if a_vec else m_solve, Nmat, zero)

        # right-hand side and the one triangular solve: (I + N) X = rhs, X = [W | U]
        if decay is None:
            rk = rows if not a_vec else bg
        elif decay == "scalar":
            rk = (rows if not a_vec else bg) * row_fac[..., None]
        else:
            rk = (rows if not a_vec else bg) * row_fac
        if a_vec:
            Nba, Nbk = Nmat[:, :, :n], Nmat[:, :, n:]                 # -A^{ba}, A^{bk}
            rhs = torch.cat([rk, torch.bmm(Nbk, vg)], dim=-1)         # [e^l b | A^{bk} V]
        else:
            Nba = Nmat
            rhs = torch.cat([rk, vg], dim=-1)                         # [-alpha e^l b | V]
        X = torch.linalg.solve_triangular(Nba.transpose(1, 2), rhs.transpose(1, 2), upper=True, left=False,
                                          unitriangular=True).transpose(1, 2)   # [nBH, n, K + V]
        Wk, U = X.split([K, V], dim=-1)
        # chunk transition S_end = M S_start + D
        if decay is None:
            kd, M0 = kg, eye.expand(nBH, K, K)
            ad = an if a_vec else None
        elif decay == "scalar":
            kd = kg * end_fac[..., None]
            ad = an * end_fac[..., None] if a_vec else None
            M0 = eye * g_end.view(nBH, 1, 1)
        else:
            kd = kg * end_fac
            ad = an * end_fac if a_vec else None
            M0 = torch.diag_embed(g_end)
        if a_vec:   # M = Diag + A~^T W, D = A~^T U + K~^T V  (an = -a)
            M = torch.baddbmm(M0, ad.transpose(1, 2), Wk, alpha=-1)
            D = torch.baddbmm(torch.bmm(kd.transpose(1, 2), vg), ad.transpose(1, 2), U, alpha=-1)
        else:       # z = -W S + U (the solve's right side carries -alpha): M = Diag - K~^T W, D = K~^T U
            M = torch.baddbmm(M0, kd.transpose(1, 2), Wk, alpha=-1)
            D = torch.bmm(kd.transpose(1, 2), U)
        D = torch.where(chunk_bad_p[gi].reshape(nBH, 1, 1), torch.full((), float("nan"), dtype=dt, device=dev), D)
        starts = [S]
        for M_j, D_j in zip(M.view(nc, BH, K, K).unbind(0), D.view(nc, BH, K, V).unbind(0)):
            S = torch.baddbmm(D_j, M_j, S)                            # the only sequential part
            starts.append(S)
        if q is None:
            continue
        S_starts = torch.stack(starts[:-1]).view(nBH, K, V) if nc > 1 else starts[0]
        # query scores P [nBH, cp, w n], masked and decayed
        if decay == "channel":
            rho_q = lam if inclusive else lamp                        # [nBH, nbk, nsub, K]
            P = decayed(qg, rho_q, nsub, cols.view(nBH, 2 if a_vec else 1, n, K),
                        m_read.view(nbk, nsub, nbk, m)[0, :, 0]).reshape(nBH, cp, -1)
            qd = qg * torch.exp(ref[:, :, None] + rho_q).reshape(nBH, cp, K)
        else:
            P = torch.bmm(qg, cols.transpose(1, 2))                   # [nBH, cp, w n]
            if decay == "scalar":
                Lq = L if inclusive else Lp
                dec_q = torch.exp(torch.where(m_read, Lq[:, :, None] - Lr[:, None, :], zero))   # [nBH, cp, n]
                P = P.view(nBH, cp, -1, n) * dec_q[:, :, None, :]
                qd = qg * torch.exp(Lq)[..., None]
            else:
                P = P.view(nBH, cp, -1, n)
                qd = qg
            P = torch.where(m_read[:, None, :], P, zero).view(nBH, cp, -1)
        if a_vec:
            Pa, Pk = P[:, :, :n], P[:, :, n:]                         # -P^a, P^k
            Y_w, Y_u = torch.bmm(Pa, X).split([K, V], dim=-1)
            og = torch.baddbmm(torch.bmm(Pk, vg) - Y_u, Y_w - qd, S_starts, alpha=-1)   # (Q~ + P^a W) S + P^a U + P^k V
        else:
            Y_w, Y_u = torch.bmm(P, X).split([K, V], dim=-1)          # P W, P U
            og = torch.baddbmm(Y_u, Y_w - qd, S_starts, alpha=-1)     # (Q~ - P W) S + P U
        rb = rb_p[gi][..., :cp].reshape(nBH, cp, 1)
        og = torch.where(rb, torch.full((), float("nan"), dtype=dt, device=dev), og)
        og = og.view(nc, B, H, cp, V)[:, :, :, :c].permute(1, 0, 3, 2, 4)      # [B, nc, c, H, V]
        outs.append(og.reshape(B, nc * c, H, V))
    S_out = S.view(B, H, K, V).to(s_dtype)
    if q is None:
        return None, S_out
    o = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
    return o.to(v.dtype), S_out
