"""Exact chunked kernels for the additive and delta families, and token-loop references.

Every function here is standalone: it uses only ``torch`` (imported inside the
function body), no memspec imports and no closures, because the code generator
copies their source into the generated modules with ``inspect.getsource``.

Layout (flash-linear-attention): views ``[B, T, H, D]``, per-token scalars
``[B, T, H]``, states ``[B, H, K, V]``.  Row-vector convention: the probe of a state
is ``q_t @ S`` and a write is ``outer(k_t, v_t)``.

Decays enter as *log* decays ``log_gamma <= 0``; inside a chunk only
``exp(L_t - L_s)`` with ``s <= t`` (differences of cumulative log decays, never
positive) is ever exponentiated; entries outside the causal mask are masked before
``exp`` (to ``-inf``, or zeroed where only the strictly-lower part is read) so that
neither the values nor their gradients can overflow into NaN.  All arithmetic runs in
float32 or wider; the results are cast back to the input dtype.  T need not be a
multiple of the chunk size: the last chunk is shorter (the delta kernel pads only its
per-token scalars).  Chunks are processed in groups sized so that temporaries stay
small (about 512 KB on CPU): larger ones are page-faulted back on every call.
"""
from __future__ import annotations

import torch


def recurrent_additive(q, k, v, log_gamma, S0, inclusive=True):
    """Token-loop reference for ``S_t = exp(log_gamma_t) S_{t-1} + outer(k_t, v_t)``, ``o_t = q_t @ S_t``.

    Args:
        q: ``[B, T, H, K]`` probes, or None (state only).
        k: ``[B, T, H, K]``; v: ``[B, T, H, V]``.
        log_gamma: ``[B, T, H]`` log decays (<= 0), or None for no decay.
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
            S = torch.exp(log_gamma[:, t].to(dt))[:, :, None, None] * S
        S = S + k[:, t].to(dt)[..., :, None] * v[:, t].to(dt)[..., None, :]   # [B, H, K, V]
        if q is not None:
            read = S if inclusive else S_prev
            outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t].to(dt), read))
    o = torch.stack(outs, dim=1).to(v.dtype) if q is not None else None
    return o, S.to(S0.dtype if S0 is not None else v.dtype)


def chunk_additive(q, k, v, log_gamma, S0, chunk, inclusive=True, group=None):
    """Exact chunked form of ``S_t = exp(log_gamma_t) S_{t-1} + outer(k_t, v_t)``, ``o_t = q_t @ S_t``.

    Inside a chunk of C tokens with cumulative log decays ``L_t``:
    ``o_t = exp(L_t) q_t @ S_start + sum_{s <= t} exp(L_t - L_s) (q_t . k_s) v_s`` and
    ``S_end = exp(L_C) S_start + sum_s exp(L_C - L_s) outer(k_s, v_s)``.
    (``inclusive=False`` uses ``L_{t-1}`` and ``s < t``: o_t reads the state before token t.)

    Chunks are processed G at a time (on CPU, G is chosen so that each temporary stays near
    512 KB: large per-call allocations are returned to the OS and page-faulted back on every
    call; on other devices G = 64).
    Within a group of n chunks every product is one batched matmul over (B, H, chunk):
    the masked intra-chunk scores, the chunk increments ``K_j^T V_j``, and the states at
    the chunk starts, ``S_j = w_j S + sum_{i<j} W_ji K_i^T V_i``, as one ``[n, n]``
    lower-triangular (decay-weighted) matrix applied to the increments; no loop over
    tokens or chunks inside a group.

    Args:
        q: ``[B, T, H, K]`` probes, or None (state only).
        k: ``[B, T, H, K]``; v: ``[B, T, H, V]``, or a tuple of ``[B, T, H, V_i]`` read as their
            concatenation on the last axis (``V = sum V_i``) without a full-size copy.
        log_gamma: ``[B, T, H]`` log decays (<= 0), or None for no decay.
        S0: ``[B, H, K, V]`` initial state, or None for zeros.
        chunk: chunk size C.
        inclusive: True: o_t reads S_t; False: o_t reads S_{t-1}.
        group: chunks per batched group G (default: as above); any G >= 1
            gives the same numbers.

    Returns:
        (o ``[B, T, H, V]`` or None, S_T ``[B, H, K, V]``).
    """
    B, T, H, K = k.shape
    vs = tuple(v) if isinstance(v, (tuple, list)) else (v,)
    V = sum(x.shape[-1] for x in vs)
    BH = B * H
    dt = torch.promote_types(k.dtype, torch.float32)
    C = max(1, min(int(chunk), T))
    N, r = divmod(T, C)
    if group is not None:
        G = int(group)
    elif k.device.type == "cpu":   # temporaries near 512 KB (float32): no page faults per call
        G = round((1 << 17) / (BH * C * max(K, V, C)))
    else:                          # caching allocators: fewer, larger launches; the [G, G] prefix stays small
        G = 64
    G = max(1, min(N, G))                                            # chunks per group
    kk, vv = k.to(dt), tuple(x.to(dt) for x in vs)                   # no copies in float32
    qq = q.to(dt) if q is not None else None
    lg = log_gamma.to(dt) if log_gamma is not None else None
    S = k.new_zeros(BH, K * V, dtype=dt) if S0 is None else S0.to(dt).reshape(BH, K * V)
    idx = torch.arange(C, device=k.device)
    read_mask = idx[:, None] >= idx[None, :] if inclusive else idx[:, None] > idx[None, :]   # [C, C]
    gidx = torch.arange(G, device=k.device)
    strict = gidx[:, None] > gidx[None, :]                                                   # [G, G]

    def block(x, a, n, c):  # tokens [a, a + n c) of [B, T, H, D] -> [B H n, c, D] (one copy)
        return x[:, a:a + n * c].reshape(B, n, c, H, x.shape[-1]).permute(0, 3, 1, 2, 4).reshape(BH * n, c, -1)

    def block_cat(xs, a, n, c):  # the blocks of several [B, T, H, D_i] side by side: [B H n, c, sum D_i]
        if len(xs) == 1:
            return block(xs[0], a, n, c)
        out = xs[0].new_empty(B, H, n, c, V)
        lo = 0
        for x in xs:
            d = x.shape[-1]
            out[..., lo:lo + d] = x[:, a:a + n * c].reshape(B, n, c, H, d).permute(0, 3, 1, 2, 4)
            lo += d
        return out.view(BH * n, c, V)

    groups = [(j * C, min(G, N - j), C) for j in range(0, N, G)] + ([(N * C, 1, r)] if r else [])
    lower = {}                                                       # n -> [BH, n, n] strictly lower ones
    outs = []
    for a, n, c in groups:
        kg, vg = block(kk, a, n, c), block_cat(vv, a, n, c)         # [BHn, c, K], [BHn, c, V]
        if lg is not None:
            lgg = lg[:, a:a + n * c].reshape(B, n, c, H).permute(0, 3, 1, 2)   # [B, H, n, c]
            L = torch.cumsum(lgg, dim=-1)                            # [B, H, n, c]
            l_chunk = L[..., -1].reshape(BH, n)                      # [BH, n] log decay of each chunk
            kd = kg * torch.exp(L[..., -1:] - L).reshape(BH * n, c, 1)   # decayed to the chunk end
            lam = torch.cumsum(l_chunk, dim=-1)                      # [BH, n]
            lam_prev = lam - l_chunk                                 # [BH, n] log decay before chunk j
            W = torch.exp(torch.where(strict[:n, :n], lam_prev[:, :, None] - lam[:, None, :], float("-inf")))
            S_in = torch.exp(lam_prev)[:, :, None] * S[:, None, :]  # [BH, n, KV]
        else:
            kd = kg
            if n not in lower:
                lower[n] = strict[:n, :n].to(dt).expand(BH, n, n)
            W = lower[n]                                             # [BH, n, n]
            S_in = S[:, None, :]                                     # [BH, 1, KV]
        kv = torch.bmm(kd.transpose(1, 2), vg).view(BH, n, K * V)   # [BH, n, KV] chunk increments
        S_starts = torch.baddbmm(S_in, W, kv)                        # [BH, n, KV] state at each chunk start
        if lg is not None:
            S = torch.addcmul(kv[:, -1], S_starts[:, -1], torch.exp(l_chunk[:, -1:]))
        else:
            S = S_starts[:, -1] + kv[:, -1]                          # [BH, KV]
        if qq is None:
            continue
        qg = block(qq, a, n, c)                                      # [BHn, c, K]
        scores = torch.bmm(qg, kg.transpose(1, 2))                   # [BHn, c, c]
        if lg is not None:
            Lq = L if inclusive else L - lgg                         # [B, H, n, c]
            decay = torch.exp(torch.where(read_mask[:c, :c], Lq[..., :, None] - L[..., None, :], float("-inf")))
            scores = scores * decay.reshape(BH * n, c, c)
            qg = qg * torch.exp(Lq).reshape(BH * n, c, 1)
        else:
            scores = scores.tril_(0 if inclusive else -1)
        og = torch.baddbmm(torch.bmm(qg, S_starts.view(BH * n, K, V)), scores, vg)   # [BHn, c, V]
        outs.append(og.view(BH, n * c, V))
    S_out = S.view(B, H, K, V).to(S0.dtype if S0 is not None else vs[0].dtype)
    if qq is None:
        return None, S_out
    if not outs:                                                     # T = 0
        return kk.new_zeros(B, 0, H, V).to(vs[0].dtype), S_out
    o = (torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]).view(B, H, T, V).transpose(1, 2)  # [B, T, H, V]
    return o.to(vs[0].dtype), S_out


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
