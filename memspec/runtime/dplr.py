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

from .phases import (_chunk_groups, _chunk_major, _group_size, _initial_states, _join_chunks, _pass_states, _screen,
                     _split_groups, _stacked, _token_major)


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
    Per group of chunks: the factors (:func:`_dplr_factors`) and the matrix of each chunk's pairs
    of sub-steps, one triangular solve for all its reads (:func:`_dplr_solve`), the state passed
    over the chunks by their maps (:func:`_dplr_maps`), and the outputs (:func:`_dplr_outputs`).

    Non-finite inputs (k, v, a, b, log decay; the probes): as in every kernel that solves per
    chunk, a bad token runs as an identity token, and the outputs from it on and the final state
    are NaN; a bad probe only its own output.  Outputs before it, and their gradients, are exact.

    Args:
        q, k, v, a, b, log_decay, S0: as :func:`recurrent_dplr`'s (k ``[B, T, H, R, K]``, or
            ``[B, T, H, K]`` for R = 1; a and b vectors or scalars; b None: ``b = k``).
        chunk: tokens per chunk C (C R sub-steps enter each solve).
        inclusive: True: o_t reads the state after token t; False: before it.
        simultaneous: the R terms of a token read the state before the token.
        read_after_decay: the reads of sub-step 0 see the state after the token's decay.
        group: chunks per batched group G (default: temporaries near 512 KB on CPU, 64 elsewhere);
            any G >= 1 gives the same numbers.
        a_form, b_form, decay_form: the forms of ``a`` (``"vector"``, ``"scalar"``), ``b``
            (``"key"``: None, ``"scalar"``, ``"vector"``) and ``log_decay`` (``"none"``,
            ``"scalar"``, ``"channel"``) as passed; None: read from their ranks (a generated module
            passes them: its specialised copy of this kernel keeps only the paths it runs).
        documents: packed documents (``_Documents(cu_seqlens)``: B = 1, offsets ``[N + 1]``;
            S0 and S_T ``[N, H, K, V]``): each starts at a chunk, from its own state; or None.

    Returns:
        (o ``[B, T, H, V]`` or None, S_T ``[B, H, K, V]``).
    """
    B, T, H = k.shape[:3]
    R, K, V = k.shape[3] if k.dim() == 5 else 1, k.shape[-1], v.shape[-1]
    # the forms of a, b and the decay (the passed forms first: the specialiser folds them)
    a_vec = a_form == "vector" if a_form is not None else a.dim() == k.dim()   # a as vectors (else a scalar times k)
    b_kind = (("k" if b_form == "key" else "vec" if b_form == "vector" else "scalar") if b_form is not None
              else "k" if b is None else "vec" if b.dim() == k.dim() else "scalar")
    decay = ((None if decay_form == "none" else decay_form) if decay_form is not None
             else None if log_decay is None else "channel" if log_decay.dim() == 4 else "scalar")
    s_dtype = S0.dtype if S0 is not None else v.dtype
    if T == 0:
        return (v.new_zeros(B, 0, H, V) if q is not None else None), (S0 if S0 is not None else
                                                                       k.new_zeros(B, H, K, V, dtype=s_dtype))
    w = 2 if a_vec else 1                                            # column factor sets: [-a | k] or [k]
    # the chunk C, the groups (nc, c, cp), the inputs [B, T', H, R, ...] (packed: laid out), the start state
    C, groups, docs, S, tokens = _dplr_layout(q, k, v, a, b, log_decay, S0, documents, chunk, group, w, decay)
    ok, read_bad, state_bad = _screen((k, v, a, b), (log_decay,), q, docs, inclusive)
    after = read_after_decay and decay is not None
    # which reads see the state before the token's decay: none, all (simultaneous, R = 1), the first
    before = "none" if after else ("all" if simultaneous or R == 1 else "first")
    shared = after and inclusive and not simultaneous and (R == 1 and q is not None)   # (scalar decays)
    zero = torch.zeros((), dtype=S.dtype, device=k.device)
    pieces = _dplr_tokens(tokens, ok, read_bad, groups, C, zero, a_vec, b_kind, decay, inclusive, before)
    masks = {c: _dplr_masks(c, R, simultaneous, inclusive, k.device) for c in {cp for _, _, cp in groups}}
    if decay == "channel":   # the places of the pairs in each chunk's matrix; pairs of one token enter
        same = q is not None and inclusive or R > 1 and not simultaneous   # (inclusive probes, sequential reads)
        pairs = {c: pair_index(c, R + (q is not None), w, R, same, masks[c]) for c in masks}
    outs, j0 = [], 0                                                 # [B, nc, c, H, V] per group; chunks before it
    for (nc, c, cp), (kp, vp, qp, gp, ap, bp, okg, bad, dg) in zip(groups, pieces):
        kg, vg, rows, cols, an, qg, gch = _dplr_factors(kp, vp, qp, ap, bp, gp, okg, bad, B, H, c, cp, C, zero, a_vec,
                                                        b_kind, decay)
        if decay == "channel":
            Nmat, rk, ends, g_end, reads = _dplr_channel_pairs(rows, cols, qg, gch, pairs[cp], same, before, inclusive)
        else:
            Nmat, rk, ends, g_end, reads = _dplr_pairs(rows, cols, dg, masks[cp][0], C, R, zero, a_vec, simultaneous,
                                                       decay, shared)
        X = _dplr_solve(Nmat, rk, vg, a_vec)                         # [W | U]
        S, starts, zs = _pass_states(_dplr_maps(X, kg, vg, an, ends, g_end, nc, a_vec, decay), nc, S, docs, j0)
        j0 += nc
        if q is not None:
            og = _dplr_outputs(qg, cols, vg, _stacked(starts), _stacked(zs), reads, dg, masks[cp][1], bad, C, R, zero,
                               inclusive, a_vec, decay)
            outs.append(_token_major(og, B, H, c))                   # [B, nc, c, H, V] (a view)
    S = docs.final().reshape(-1, K, V) if docs is not None else S   # (packed: [N H, K, V])
    S_out = torch.where(state_bad.reshape(-1, 1, 1), float("nan"), S).reshape(-1, H, K, V).to(s_dtype)
    if q is None:
        return None, S_out                                           # (a bad token poisons the state)
    o = _join_chunks(outs)                                           # [B, T, H, V]
    return (o if docs is None else docs.unlay(o)).to(v.dtype), S_out   # (packed: the documents' tokens)


def _dplr_layout(q, k, v, a, b, log_decay, S0, documents, chunk, group, w, decay):
    """The layout of ``chunk_dplr``'s row: the chunk C (per-channel decays: a power of two, halved
    level by level), the inputs with their sub-step axis (``[B, T, H, R, *]``), packed documents
    laid out in one row, each from a chunk's start (their initial states S0 ``[N, H, K, V]``, or
    None), the state before the first chunk, and the groups of chunks (``w`` column sets per
    sub-step size them): a per-channel tail chunk is padded with identity tokens to a power of two.

    Returns:
        ``(C, groups, docs or None, S [B H, K, V], (k, v, a, b, q, log_decay))``.
    """
    B, T, H = k.shape[:3]
    dt = torch.promote_types(k.dtype, torch.float32)
    C = max(1, min(int(chunk), T))
    if decay == "channel":
        C = 1 << (C.bit_length() - 1)
    b_r = b                                                          # b with the sub-step axis (b is never rebound)
    if k.dim() == 4:
        k, v, a = k.unsqueeze(3), v.unsqueeze(3), a.unsqueeze(3)
        if b is not None:
            b_r = b.unsqueeze(3)
    R, K, V = k.shape[3], k.shape[-1], v.shape[-1]
    docs, S = _initial_states(S0, documents, C, B, (H, K, V), dt, k.device)
    q_in, lg_in = q, log_decay
    if docs is not None:
        T = docs.T                                                   # the laid-out row
        k, v, a, b_r = (docs.lay(x) for x in (k, v, a, b_r))
        q_in, lg_in = docs.lay(q), docs.lay(log_decay)
    G = _group_size(T // C, B * H * C * R * max(K + V, w * C * R), group, k.device)   # chunks per group
    groups = _chunk_groups(T, C, G, "power of two" if decay == "channel" else None)
    return C, groups, docs, S, (k, v, a, b_r, q_in, lg_in)


def _dplr_solve(N, rk, vg, a_vec):
    """The one unit-lower-triangular solve of each chunk of ``chunk_dplr``: ``(I + N) X = rhs``,
    ``X = [W | U]`` (N ``[nBH, n, w n]``, only its strict lower triangle read; rk ``[nBH, n, K]``
    the decayed rows, vg ``[nBH, n, V]`` the values): vector a, ``N = [-A^{ba} | A^{bk}]`` and
    ``rhs = [e^l b | A^{bk} V]``; scalar a, ``rhs = [-alpha e^l b | V]``.  Returns ``[nBH, n, K + V]``."""
    if a_vec:
        n = rk.shape[1]
        Nba, Nbk = N[:, :, :n], N[:, :, n:]                          # -A^{ba}, A^{bk}
        rhs = torch.cat([rk, torch.bmm(Nbk, vg)], dim=-1)
    else:
        Nba, rhs = N, torch.cat([rk, vg], dim=-1)
    # X^T (I + N)^T = rhs^T: the fast layout for batched triangular solves on CPU
    return torch.linalg.solve_triangular(Nba.transpose(1, 2), rhs.transpose(1, 2), upper=True, left=False,
                                         unitriangular=True).transpose(1, 2)   # [nBH, n, K + V]


def _dplr_tokens(tokens, ok, read_bad, groups, C, zero, a_vec, b_kind, decay, inclusive, before):
    """The per-token flags and scalars of ``chunk_dplr``, and its scalar decays' factors, for all
    chunks at once (chunk-major ``[Np, BH, C]`` per token, ``[Np, BH, C R]`` per sub-step; a tail
    chunk padded with ok tokens of log decay 0), cut into one piece per group.

    Args:
        tokens: ``(k, v, a, b, q, log_decay)`` laid out: the state inputs with their sub-step
            axis (``[B, T, H, R, ...]``), the probes and the log decays (or None).
        ok, read_bad: ``[B, T, H]`` the screen's flags (read_bad None without probes).
        groups: ``(nc, c, cp)`` per group; C: tokens per chunk.
        zero: a 0 of the kernel's dtype and device.
        a_vec, b_kind, decay: the forms of a, b and the decay (``chunk_dplr``'s).
        inclusive: the probes read the state after their token.
        before: which reads see the state before the token's decay (``"none"``, ``"all"``,
            ``"first"``).

    Returns:
        per group the pieces of the keys, values, probes, per-channel log decays (clamped; ``[B,
        nc c, H, ...]``), a and b (vectors: per token; scalars ``[nc, BH, C R]``), the ok flags of
        the tokens and the outputs' bad flags (``[nc, BH, C]``) and the scalar decays' factors (a
        dict).
    """
    k, v, a, b_r, q, lg = tokens
    B, T, H, R = k.shape[:4]
    Np = -(-T // C)                                                  # chunks, the tail included
    dt, dev = zero.dtype, zero.device

    def per_chunk(x, r):  # [B, T, H(, r)] -> [Np, BH, C r], chunk-major, tail padded with zeros
        return _chunk_major(x.reshape(B, T, H, r), Np, C).contiguous().reshape(Np, B * H, C * r)

    okf = _chunk_major(ok, Np, C, True).contiguous().reshape(Np, B * H, C)   # [Np, BH, C] (padding: ok)
    bad = per_chunk(read_bad, 1) if read_bad is not None else None  # [Np, BH, C]
    lg_all = lg.to(dt).clamp_min(-40.0) if decay is not None else None   # (a decay of 0, log -inf, is valid)
    ok_r = okf.repeat_interleave(R, dim=-1) if R > 1 else okf        # [Np, BH, C R]
    a_s = None if a_vec else torch.where(ok_r, per_chunk(a.to(dt), R), zero)      # scalar a
    b_s = torch.where(ok_r, per_chunk(b_r.to(dt), R), zero) if b_kind == "scalar" else None

    def split_c(x):  # [Np, BH, ...] -> one [nc, BH, ...] piece per group
        return x.split([nc for nc, _, _ in groups], dim=0) if x is not None else [None] * len(groups)

    dec_p = [{}] * len(groups)                                       # the scalar decays' factors per group
    if decay == "scalar":
        g = torch.where(okf, per_chunk(lg_all, 1), zero)             # [Np, BH, C]
        L = torch.cumsum(g, dim=-1)                                   # cumulative log decay in the chunk
        Lp = L - g                                                    # before token t's decay
        Lr = L.repeat_interleave(R, dim=-1) if R > 1 else L          # [Np, BH, C R] column log of sub-step j
        l_row = Lr if before == "none" else (Lp.repeat_interleave(R, dim=-1) if R > 1 else Lp)
        if before == "first":                                         # (sub-step 0 of each token)
            l_row = torch.where(torch.arange(C * R, device=dev) % R == 0, l_row, Lr)
        Lq = L if inclusive else Lp                                   # the log decay a probe sees
        dec = {"L": L, "Lr": Lr, "l_row": l_row, "Lq": Lq, "e_row": torch.exp(l_row),
               "end": torch.exp(L[..., -1:] - Lr), "g_end": torch.exp(L[..., -1]), "e_q": torch.exp(Lq)}
        dec_p = [dict(zip(dec, x)) for x in zip(*(split_c(x) for x in dec.values()))]
    token_p = [_split_groups(x, groups) for x in (k, v, q)]
    token_p.append(_split_groups(lg_all if decay == "channel" else None, groups))   # per-channel log decays
    a_p = _split_groups(a, groups) if a_vec else split_c(a_s)
    b_p = _split_groups(b_r, groups) if b_kind == "vec" else split_c(b_s)
    return list(zip(*token_p, a_p, b_p, split_c(okf), split_c(bad), dec_p))


def _dplr_masks(c, R, simultaneous, inclusive, device):
    """The masks of a chunk of c tokens in ``chunk_dplr`` (sub-step ``i = t R + r``, its token
    ``i // R``): ``(solve [c R, c R], read [c, c R])``, the sub-steps whose writes a read, and a
    probe, sees."""
    n = c * R
    tok = torch.arange(n, device=device) // R
    if simultaneous:
        solve = tok[:, None] > tok[None, :]                          # j in an earlier token
    else:
        solve = torch.arange(n, device=device)[:, None] > torch.arange(n, device=device)[None, :]
    ti = torch.arange(c, device=device)
    read = ti[:, None] >= tok[None, :] if inclusive else ti[:, None] > tok[None, :]   # [c, n]
    return solve, read


def _dplr_factors(k, v, q, a, b, lg, ok, bad, B, H, c, cp, C, zero, a_vec, b_kind, decay):
    """The factors of a group's chunks in ``chunk_dplr``, chunk-major (chunk j of the group is the
    batch slice ``[j BH, (j + 1) BH)``), bad tokens zeroed (by ``torch.where``, never a product).

    Inside a chunk the C R sub-steps are indexed ``i = t R + r``.  With cumulative log decays
    ``L_t`` (per channel where the decay is), the read of sub-step i, ``u_i = b_i^T S_{i-1}``, is
    affine in the chunk's start state: ``u_i = (e^{l_i} b_i)^T S_start + sum_{j < i} A_ij u_j +
    (A^k V)_i`` with ``A_ij = sum_c b_ic a_jc e^{l_ic - L_jc}`` (``l_i`` the log decay the read of i
    sees), so all reads of a chunk come from ONE unit-lower-triangular solve, ``u = W S_start + U``,
    whose matrix pairs the rows (the reads ``b``) with the columns (``[-a | k]``).  When ``a`` is a
    scalar times ``k`` (every delta-rule variant), the write and the correction share the key and
    the system is the delta rule's: ``z = alpha u + v`` solves
    ``(I - diag(alpha) A) z = alpha e^{l} b S + V`` (rows ``-alpha b``, columns ``k``).

    Args:
        k, v: the group's piece ``[B, nc c, H, R, *]``; q: its probes ``[B, nc c, H, K]``, or None.
        a, b: vectors: pieces like ``k``; scalars: ``[nc, BH, C R]`` (b: None when it is ``k``).
        lg: the per-channel log decays' piece ``[B, nc c, H, K]`` (clamped), or None.
        ok, bad: ``[nc, BH, C]`` the ok flags of the tokens, the bad flags of the outputs (their
            probes are zeroed; None without probes).
        B, H: batch and heads; c, cp: tokens per chunk and slots (a tail chunk's padded).
        C: tokens per chunk of the row.
        zero: a 0 of the kernel's dtype.
        a_vec, b_kind, decay: the forms of a, b and the decay (``chunk_dplr``'s).

    Returns:
        ``(kg [nBH, n, K], vg [nBH, n, V], rows [nBH, n, K], cols [nBH, w n, K], -a [nBH, n, K]
        or None, probes [nBH, cp, K] or None, per-channel log decays [nc, B, H, cp, K] or None)``,
        n = cp R.
    """
    nc, R, K, V = ok.shape[0], k.shape[3], k.shape[-1], v.shape[-1]
    nBH, n = nc * B * H, cp * R
    okg = ok[..., :cp].reshape(nc, B, H, cp, 1, 1)

    def lay(x, rr=R):  # piece [B, nc c, H(, rr), d] -> [nc, B, H, cp, rr, d] chunk-major view (tail padded)
        return _chunk_major(x.reshape(B, nc * c, H, rr, x.shape[-1]), nc, cp)

    def scal(x):  # [nc, BH, C r] -> [nBH, cp r]
        return x[..., :x.shape[-1] // C * cp].reshape(nBH, -1)

    # k and v side by side in one buffer, bad tokens zeroed (torch.where, never a product)
    kv = torch.where(okg, torch.cat([lay(k), lay(v)], dim=-1).to(zero.dtype), zero).reshape(nBH, n, K + V)
    kg, vg = kv[:, :, :K], kv[:, :, K:]                              # [nBH, n, K], [nBH, n, V] (views)
    if b_kind == "vec":
        bg = torch.where(okg, lay(b).to(zero.dtype), zero).reshape(nBH, n, K)
    # solve rows (the reads) and the column factor sets; the signs are folded in:
    # vector a: rows b, columns [-a | k]; scalar a: rows -alpha b, columns k
    if a_vec:
        an = torch.where(okg, -lay(a).to(zero.dtype), zero).reshape(nBH, n, K)
        cols = torch.cat([an, kg], dim=1)                            # [nBH, 2 n, K]
        rows = bg if b_kind == "vec" else (kg * scal(b)[..., None] if b_kind == "scalar" else kg)
    else:
        cols = kg
        rscale = -scal(a)                                            # [nBH, n]
        if b_kind == "scalar":
            rscale = rscale * scal(b)
        rows = (bg if b_kind == "vec" else kg) * rscale[..., None]
    qg = None
    if q is not None:
        qkeep = ~bad[..., :cp].reshape(nc, B, H, cp, 1, 1)
        qg = torch.where(qkeep, lay(q.unsqueeze(3), 1).to(zero.dtype), zero).reshape(nBH, cp, K)
    if decay == "channel":
        gch = torch.where(okg[..., 0, :], lay(lg.unsqueeze(3), 1)[..., 0, :].to(zero.dtype), zero)   # [nc, B, H, cp, K]
    return kg, vg, rows, cols, (an if a_vec else None), qg, (gch if decay == "channel" else None)


def _dplr_pairs(rows, cols, dg, m_solve, C, R, zero, a_vec, simultaneous, decay, shared):
    """The matrix of a group's pairs of sub-steps in ``chunk_dplr`` with a scalar decay or none:
    ``N = rows cols^T``, decayed by ``exp(l_i - L_j)`` (exponentiated only as such differences,
    each <= 0), the right side's rows ``e^{l_i} b_i`` and the factors of the chunk maps.

    Args:
        rows: ``[nBH, n, K]``; cols: ``[nBH, w n, K]`` (:func:`_dplr_factors`).
        dg: the group's decay factors (``"L"``, ``"Lr"``, ``"l_row"``, ``"e_row"``, ``"end"``,
            ``"g_end"``: ``[nc, BH, C]`` or ``[nc, BH, C R]``; empty without a decay).
        m_solve: ``[n, n]`` the pairs a read sees; C, R: the chunk and the sub-steps per token.
        zero: a 0 of the kernel's dtype.
        a_vec, simultaneous, decay: ``chunk_dplr``'s forms.
        shared: the reads and the probes see the same decays (R = 1, inclusive, reads after the
            decay).

    Returns:
        ``(N [nBH, n, w n], e^l rows, the decay from each sub-step to the chunk end [nBH, n, 1],
        the decay over each chunk [nBH], the probes' decays [nBH, n, n] when shared)`` (the decays
        None without a decay).
    """
    nBH, n = rows.shape[:2]
    w = cols.shape[1] // n

    def scal(x):  # [nc, BH, C r] -> [nBH, cp r]
        return x[..., :x.shape[-1] // C * (n // R)].reshape(nBH, -1)

    if decay == "scalar":
        L, Lr, l_row = scal(dg["L"]), scal(dg["Lr"]), scal(dg["l_row"])
        if shared:   # the reads and the probes see the same decays: one matrix, masked at the read
            dec_s = torch.exp((L[:, :, None] - L[:, None, :]).tril())
        else:
            dec_s = torch.exp(torch.where(m_solve, l_row[:, :, None] - Lr[:, None, :], zero))   # [nBH, n, n]
        Nmat = torch.bmm(rows, cols.transpose(1, 2))                  # [nBH, n, w n]
        Nmat = (Nmat.reshape(nBH, n, w, n) * dec_s[:, :, None, :]).reshape(nBH, n, w * n) if a_vec else Nmat * dec_s
        rk = rows * scal(dg["e_row"])[..., None]
        ends = scal(dg["end"])[..., None]                             # [nBH, n, 1]
        g_end = dg["g_end"].reshape(nBH)
        reads = dec_s if shared else None
    else:
        Nmat = torch.bmm(rows, cols.transpose(1, 2))
        rk, ends, g_end, reads = rows, None, None, None
    if a_vec or (simultaneous and R > 1):
        # the solve reads only the strict lower triangle; A^{bk} V and simultaneous steps need zeros
        Nmat = torch.where(m_solve.repeat(1, 2) if a_vec else m_solve, Nmat, zero)
    return Nmat, rk, ends, g_end, reads


def _dplr_channel_pairs(rows, cols, qg, gch, pairs, same, before, inclusive):
    """The matrix of a group's pairs of sub-steps in ``chunk_dplr`` with per-channel decays, halved
    level by level (no ``[C, C]`` matrix of decays serves, and none is exponentiated): in a block
    of 2h tokens a pair (row i in the second half, column j in the first) weighs ``F_h(i) E_h(j)``,
    ``F_h(i)`` the product of the decays from the second half's start to the state i reads,
    ``E_h(j)`` of those after j to the first half's end; all pairs of a level are one batched
    product ``(X F) (Y E)^T``, and the factors pass to the next level by one product with the
    halves' decays: after the last level they are the rows' decays from the chunk start and the
    columns' to its end.  Two sub-steps of one token weigh 1.  So only products of decays (each
    <= 1) enter, one ``exp`` per token and channel, with no cancellation in long sums.

    Args:
        rows: ``[nBH, cp R, K]``; cols: ``[nBH, w cp R, K]``; qg: ``[nBH, cp, K]`` the probes (or
            None).
        gch: ``[nc, B, H, cp, K]`` the tokens' log decays (cp a power of two).
        pairs: the positions of the matrix's entries in the flat list of pairs (``pair_index``).
        same: whether pairs of one token enter (weight 1).
        before: which reads see the state before the token's decay (``"none"``, ``"all"``,
            ``"first"``).
        inclusive: the probes read the state after their token.

    Returns:
        ``(N [nBH, n, w n], e^l rows [nBH, n, K], the columns decayed to the chunk end
        [nBH, cp, w, R, K], the decay over each chunk [nBH, K], (P [nBH, cp, w n], the decayed
        probes [nBH, cp, K]) or None)``.
    """
    nBH, n, K = rows.shape
    cp, w = gch.shape[3], cols.shape[1] // n
    R = n // cp
    # the row slots whose state has the token's own decay (F_1 = its decay; the others F_1 = 1)
    decayed = [not (before == "all" or (before == "first" and r == 0)) for r in range(R)]
    decayed += [inclusive] if qg is not None else []
    # without autograd, the factors are updated in place
    inplace = not (torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (rows, cols, qg, gch)))
    gam = torch.exp(gch).reshape(nBH, cp, 1, K)                      # the decay of each token
    # rows X [nBH, cp, sl, K] (the reads, then the probe), columns Y [nBH, cp, w R, K] ([-a | k])
    xs = rows.reshape(nBH, cp, R, K) if qg is None else torch.cat([rows.reshape(nBH, cp, R, K),
                                                                   qg.reshape(nBH, cp, 1, K)], dim=2)
    ys = cols.reshape(nBH, w, cp, R, K).transpose(1, 2).reshape(nBH, cp, w * R, K).contiguous()
    sl, wR = xs.shape[2], w * R
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
    full = torch.cat(pieces, dim=1).index_select(1, pairs).reshape(nBH, cp, sl, w * n)
    reads = None
    if qg is not None:                                               # the probes' scores, masked and decayed
        reads = full[:, :, R], xF[:, :, R]                           # [nBH, cp, w n], [nBH, cp, K]
    # e^{l_i} rows (decayed from the chunk start), the columns decayed to the chunk end, e^{L_C}
    return (full[:, :, :R].reshape(nBH, n, w * n), xF[:, :, :R].reshape(nBH, n, K), yE.reshape(nBH, cp, w, R, K),
            Pd.reshape(nBH, K), reads)


def _dplr_maps(X, kg, vg, an, ends, g_end, nc, a_vec, decay):
    """The map of each chunk of a group in ``chunk_dplr``, ``step(j, S) -> (S_end, x_j)`` for
    :func:`_pass_states`: the reads from the chunk's start state, then the state update (vector a:
    ``u = W S + U``, ``S <- Diag(g) S + K~^T V - (-A~)^T u``; scalar a: ``z = U - W S`` (the right
    side carried ``-alpha``), ``S <- Diag(g) S + K~^T z``; tildes decayed to the chunk end).

    Args:
        X: ``[nBH, n, K + V]`` the solve's ``[W | U]``; kg, vg: ``[nBH, n, K]``, ``[nBH, n, V]``
            the keys and values; an: ``[nBH, n, K]`` -a, or None (scalar a).
        ends: the decays to the chunk end: ``[nBH, n, 1]`` (scalar decay), the columns decayed
            ``[nBH, cp, w, R, K]`` (per channel), or None; g_end: ``[nBH]`` / ``[nBH, K]`` the decay
            over each chunk, or None.
        nc: the group's chunks.
        a_vec, decay: ``chunk_dplr``'s forms.

    Returns:
        ``step``; its ``x_j``: ``[BH, n, V]`` the chunk's reads ``u`` (vector a) or ``z``.
    """
    nBH, n, K = kg.shape
    BH = nBH // nc
    Wk, U = X.split([K, X.shape[-1] - K], dim=-1)
    if decay == "channel":                                           # (from the halving: [-a | k] decayed)
        kd = ends[:, :, -1].reshape(nBH, n, K)
        if a_vec:
            ad = ends[:, :, 0].reshape(nBH, n, K)
    else:
        kd = kg if decay is None else kg * ends                      # keys decayed to the chunk end
        if a_vec:
            ad = an if decay is None else an * ends                  # -a decayed to the chunk end
    if a_vec:
        Dv = torch.bmm(kd.transpose(1, 2), vg).reshape(nc, BH, K, -1)   # K~^T V: no state in it
        ad_j = ad.reshape(nc, BH, n, K).unbind(0)
    kd_j = kd.reshape(nc, BH, n, K).unbind(0)
    # [BH, 1, 1] or [BH, K, 1] per chunk: the decay over the chunk
    g_j = [None] * nc
    if decay is not None:
        g_j = (g_end.reshape(nc, BH, -1, 1) if decay == "channel" else g_end.reshape(nc, BH, 1, 1)).unbind(0)
    W_j, U_j = Wk.reshape(nc, BH, n, K).unbind(0), U.reshape(nc, BH, n, -1).unbind(0)
    # (each def closes over assigned locals only: torch.compile)
    if a_vec:
        def step(j, S):
            z = torch.baddbmm(U_j[j], W_j[j], S)                      # u = W S + U  [BH, n, V]
            Sg = S + Dv[j] if g_j[j] is None else torch.addcmul(Dv[j], S, g_j[j])   # Diag(g) S + K~^T V
            return torch.baddbmm(Sg, ad_j[j].transpose(1, 2), z, alpha=-1), z
    else:
        def step(j, S):
            z = torch.baddbmm(U_j[j], W_j[j], S, alpha=-1)            # z = U - W S
            return torch.baddbmm(S if g_j[j] is None else S * g_j[j], kd_j[j].transpose(1, 2), z), z
    return step


def _dplr_outputs(qg, cols, vg, S_starts, z, reads, dg, m_read, bad, C, R, zero, inclusive, a_vec, decay):
    """The outputs of a group's chunks in ``chunk_dplr`` from the states at their starts:
    ``o = (Q~ + P^a W) S_start + P^a U + P^k V``, i.e. ``o = Q~ S_start + P [-u | V]`` (vector a)
    or ``Q~ S_start + P z``, ``P`` the masked, decayed query scores.

    Args:
        qg: ``[nBH, cp, K]`` the probes; cols: ``[nBH, w n, K]`` the columns; vg: ``[nBH, n, V]``.
        S_starts: ``[nBH, K, V]`` the chunks' start states; z: ``[nBH, n, V]`` their reads.
        reads: per channel ``(P, Q~)`` from the halving; a shared scalar decay's matrix; or None.
        dg: the group's scalar decay factors (``"Lq"``, ``"Lr"``, ``"e_q"``), or empty.
        m_read: ``[cp, n]`` the pairs a probe reads; bad: ``[nc, BH, C]`` the outputs set to NaN.
        C, R: the chunk and the sub-steps per token.
        zero: a 0 of the kernel's dtype.
        inclusive, a_vec, decay: ``chunk_dplr``'s arguments and forms.

    Returns:
        ``[nBH, cp, V]``.
    """
    nBH, cp = qg.shape[:2]
    w = cols.shape[1] // (cp * R)

    def scal(x):  # [nc, BH, C r] -> [nBH, cp r]
        return x[..., :x.shape[-1] // C * cp].reshape(nBH, -1)

    if decay == "channel":
        P, qd = reads                                                # [nBH, cp, w n], [nBH, cp, K]
    else:
        P = torch.bmm(qg, cols.transpose(1, 2))                      # [nBH, cp, w n]
        qd = qg
        if decay == "scalar":
            Lq = scal(dg["Lq"])
            dec_q = reads if reads is not None else torch.exp(   # (shared: the reads' decays)
                torch.where(m_read, Lq[:, :, None] - scal(dg["Lr"])[:, None, :], zero))
            P = (P.reshape(nBH, cp, w, -1) * dec_q[:, :, None, :]).reshape(nBH, cp, -1) if a_vec else P * dec_q
            qd = qg * scal(dg["e_q"])[..., None]
        if R == 1 and not a_vec:
            P = P.tril_(0 if inclusive else -1)
        else:
            P = torch.where((m_read.repeat(1, 2) if a_vec else m_read), P, zero)
    if a_vec:   # o = Q~ S + P^a u + P^k V, P holding [-P^a | P^k]
        og = torch.baddbmm(torch.bmm(P, torch.cat([-z, vg], dim=1)), qd, S_starts)
    else:       # o = Q~ S + P z
        og = torch.baddbmm(torch.bmm(P, z), qd, S_starts)
    return torch.where(bad[..., :cp].reshape(nBH, cp, 1), float("nan"), og)
