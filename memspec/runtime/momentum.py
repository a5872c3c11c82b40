"""Exact chunked kernel of the momentum family (two states coupled linearly: the momentum delta
rule), and its token-loop reference.

See :mod:`memspec.runtime` for the rules every kernel here follows.
"""
from __future__ import annotations

import torch

from .phases import (_chunk_groups, _chunk_major, _group_size, _initial_states, _join_chunks, _pass_states, _screen,
                     _split_groups, _stacked, _token_major)


def recurrent_momentum_delta(q, k, v, p, log_gamma, log_mu, beta, eta, S0, M0, inclusive=True):
    """Token-loop reference for the momentum delta rule (two states coupled linearly).

    ``M_t = mu_t M_{t-1} + eta_t outer(k_t, p_t @ S_{t-1} - v_t)``,
    ``S_t = gamma_t S_{t-1} - beta_t M_t``; ``o_t = q_t @ S_t`` (``inclusive``) or ``q_t @ S_{t-1}``.
    (flash-linear-attention's ``recurrent_momentum_delta_rule_ref``: ``log_alpha = log_gamma``.)

    Args:
        q: ``[B, T, H, K]`` probes, or None.  k, p: ``[B, T, H, K]`` (write key, error read);
            v: ``[B, T, H, V]``.
        log_gamma, log_mu: ``[B, T, H]`` log decays (<= 0) of S and of the momentum M.
        beta, eta: ``[B, T, H]`` the step of S along M, the step of M along the error.
        S0, M0: ``[B, H, K, V]`` or None (zeros).
        inclusive: True: o_t reads S_t; False: S_{t-1}.

    Returns:
        (o ``[B, T, H, V]`` or None, S_T, M_T ``[B, H, K, V]``).
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    dt = torch.promote_types(k.dtype, torch.float32)
    S = k.new_zeros(B, H, K, V, dtype=dt) if S0 is None else S0.to(dt)
    M = k.new_zeros(B, H, K, V, dtype=dt) if M0 is None else M0.to(dt)
    outs = []
    for t in range(T):
        S_before = S
        err = torch.einsum("bhk,bhkv->bhv", p[:, t].to(dt), S) - v[:, t].to(dt)         # [B, H, V]
        mu, gam = torch.exp(log_mu[:, t].to(dt)), torch.exp(log_gamma[:, t].to(dt))
        M = mu[..., None, None] * M + (eta[:, t].to(dt)[..., None] * k[:, t].to(dt))[..., :, None] * err[..., None, :]
        S = gam[..., None, None] * S - beta[:, t].to(dt)[..., None, None] * M
        if q is not None:
            outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t].to(dt), S if inclusive else S_before))
    o = None
    if q is not None:
        o = torch.stack(outs, dim=1).to(v.dtype) if outs else v.new_zeros(B, 0, H, V)
    out_dtype = S0.dtype if S0 is not None else v.dtype
    return o, S.to(out_dtype), M.to(out_dtype)


def chunk_momentum_delta(q, k, v, p, log_gamma, log_mu, beta, eta, S0, M0, chunk, *, inclusive=True, group=None,
                         documents=None):
    """Exact chunked momentum delta rule (:func:`recurrent_momentum_delta`'s recurrence).

    The joint state ``Z = [S; M]`` (``[2K, V]``) has the transition ``Z_t = (D_t (x) I_K) Z_{t-1}
    + a_t z_t`` with the 2x2 upper-triangular ``D_t = [[gamma_t, -beta_t mu_t], [0, mu_t]]``, the
    rank-1 factor ``a_t = [-beta_t eta_t, eta_t] (x) k_t`` and ``z_t = p_t @ S_{t-1} - v_t``: a
    "2x2 (x) identity plus rank one" transition, so a chunk's errors come from one
    unit-lower-triangular solve (:func:`_momentum_maps`), the state passes over the chunks by three
    products each, and the outputs are batched over a group of chunks (:func:`_momentum_outputs`).
    Chunks are processed G at a time (on CPU, G is chosen so that each temporary stays near
    512 KB, as in the other kernels; on other devices G = 64).

    Non-finite inputs (``_screen``): a token whose k, p, v, beta, eta or log decays are not all
    finite runs as an identity token (cleared by torch.where), and every output reading a state at
    or after it (in its document), and both final states, are NaN; a non-finite probe makes only its
    own output NaN; outputs before such a token, and their gradients, are the clean sequence's.
    Log decays below -80 (-inf included) are clamped to -80 (:func:`_momentum_screen`: on CPU,
    all-finite inputs skip the masks).

    Args:
        q: ``[B, T, H, K]`` probes, or None (state only).
        k, p: ``[B, T, H, K]`` write keys and error reads.
        v: ``[B, T, H, V]`` write values.
        log_gamma, log_mu: ``[B, T, H]`` log decays (<= 0) of S and of the momentum M.
        beta, eta: ``[B, T, H]`` the step of S along M, the step of M along the error.
        S0, M0: ``[B, H, K, V]`` initial states, or None (zeros).
        chunk: tokens per chunk C.
        inclusive: True: o_t reads S_t; False: S_{t-1}.
        group: chunks per batched group G (default: as above); any G >= 1 gives the same numbers.
        documents: packed documents (``_Documents(cu_seqlens)``: B = 1, offsets ``[N + 1]``;
            S0, M0, S_T, M_T ``[N, H, K, V]``): each starts at a chunk, from its own states; or
            None.

    Returns:
        (o ``[B, T, H, V]`` or None, S_T, M_T ``[B, H, K, V]``).
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    dt = torch.promote_types(k.dtype, torch.float32)
    dev = k.device
    out_dtype = S0.dtype if S0 is not None else v.dtype
    if T == 0:
        o = v.new_zeros(B, 0, H, V) if q is not None else None
        zeros = k.new_zeros(B, H, K, V, dtype=out_dtype)
        return o, (S0 if S0 is not None else zeros), (M0 if M0 is not None else zeros)
    C = max(1, min(int(chunk), T))
    # the joint state [S; M] [B H, 2K, V] before the first chunk (packed: each document's enters where it starts)
    docs, Z = _initial_states(_momentum_joint(S0, M0, dt), documents, C, B, (H, 2 * K, V), dt, dev)
    ok, read_bad, state_bad = _momentum_screen(q, (k, p, v, beta, eta), (log_gamma, log_mu), docs, inclusive)
    tokens = (q, k, p, v, log_gamma, log_mu, beta, eta)              # per-token inputs [B, T, H, ...]
    if docs is not None:                                             # the laid-out row
        tokens = tuple(docs.lay(x) for x in tokens)
    T = tokens[1].shape[1]
    G = _group_size(T // C, B * H * C * (2 * K + V), group, dev)    # chunks per group
    groups = _chunk_groups(T, C, G, "chunk")                       # a tail chunk padded with identity tokens
    idx = torch.arange(C, device=dev)
    masks = (idx[:, None] >= idx[None, :], idx[:, None] > idx[None, :], torch.eye(C, dtype=dt, device=dev))
    outs, j0 = [], 0                                                  # [B, n c, H, V] per group; chunks before it
    for (n, c, _), okg, rbg, qg, kg, pg, vg, lgg, lmg, btg, etg in zip(
            groups, _split_groups(ok, groups), _split_groups(read_bad, groups),
            *(_split_groups(x, groups) for x in tokens)):
        okc = _chunk_major(okg[..., None], n, C, True).contiguous() if ok is not None else None   # [n, B, H, C, 1]
        step, kc, reads = _momentum_maps(kg, pg, vg, lgg, lmg, btg, etg, n, masks, okc)
        Z, Z_st, zs = _pass_states(step, n, Z, docs, j0)               # (documents: their initial, final [S; M])
        j0 += n
        if q is not None:
            og = _momentum_outputs(qg, kc, _stacked(zs), _stacked(Z_st), rbg, *(reads[0] if inclusive else reads[1]))
            outs.append(_token_major(og, B, H, c))                  # [B, n, c, H, V] (a view)
    Z = Z.reshape(B, H, 2 * K, V) if docs is None else docs.final()   # [B | N, H, 2K, V]
    Z = Z if state_bad is None else torch.where(state_bad[..., None, None], float("nan"), Z)   # (a bad token's)
    S_out, M_out = (x.to(out_dtype).contiguous() for x in Z.split(K, dim=2))
    if q is None:
        return None, S_out, M_out
    o = _join_chunks(outs)                                            # [B, T, H, V]
    if read_bad is not None:
        o = torch.where(read_bad[..., None], float("nan"), o)          # the reads at or after a bad token
    if docs is not None:
        o = docs.unlay(o)                                             # the documents' tokens, packed
    return o.to(v.dtype), S_out, M_out


def _momentum_screen(q, writes, decays, docs, inclusive):
    """The non-finite screen of :func:`chunk_momentum_delta`: ``_screen``'s flags ``(ok, read_bad,
    state_bad)``, or three Nones when every input is finite, on CPU (eager): there one sum of each
    input tells, without a device sync, and clearing nothing is cheaper than the masks (torch.where
    is not vectorized on CPU); the kernel then runs unmasked.  A sum is finite only when every
    entry is (a NaN or an inf stays in a sum); log decays of -inf (decays of 0) are valid."""
    if writes[0].device.type == "cpu" and not torch.compiler.is_compiling():
        dt = torch.promote_types(writes[0].dtype, torch.float32)
        total = sum(x.sum(dtype=dt) for x in writes + (q,) if x is not None)
        total = total + sum(x.clamp_min(-80.0).sum(dtype=dt) for x in decays)
        if torch.isfinite(total):
            return None, None, None
    return _screen(writes, decays, q, docs, inclusive)


def _momentum_joint(S0, M0, dt):
    """The joint initial state ``[S0; M0]`` ``[B or N, H, 2K, V]`` in dtype ``dt`` (a missing one:
    zeros), or None when neither is given."""
    if S0 is None and M0 is None:
        return None
    like = S0 if S0 is not None else M0
    return torch.cat([S0.to(dt) if S0 is not None else like.new_zeros(like.shape, dtype=dt),
                      M0.to(dt) if M0 is not None else like.new_zeros(like.shape, dtype=dt)], dim=2)


def _momentum_maps(kg, pg, vg, lgg, lmg, btg, etg, n, masks, ok):
    """The chunk maps of the momentum delta rule (``chunk_momentum_delta``), batched over a group of
    n chunks: the errors of each chunk from its start state, ``z = WZ [S; M] + U``, and its map
    ``[S; M] <- (D (x) I_K) [S; M] + kZ^T z``.

    Every interaction of sub-steps s < t factors as (a scalar from the 2x2 products
    ``P(t, s) = D_t ... D_{s+1}``) times an inner product of K-vectors, so the chunk's errors come
    from ONE unit-lower-triangular solve,
    ``(I - A) z = [e^{La_{t-1}} p | P12(t-1, start) p] [S_0; M_0] - V`` with
    ``A_ts = (P11(t-1,s) (-beta_s eta_s) + P12(t-1,s) eta_s) (p_t . k_s)``; the products' corner
    ``P12(t, s) = sum_{s<r<=t} e^{La_t - La_r} (-beta_r mu_r) e^{Lm_{r-1} - Lm_s}`` is one product
    of two masked decay matrices (entries <= 1: stable); the products at ``t - 1`` are those at
    ``t`` shifted by one row.  Then per chunk, on the stacked ``Z = [S; M]``: ``z = W_Z Z + U``,
    ``Z <- [e^{La_C} S + P12(C, start) M; e^{Lm_C} M] + K_Z^T z`` (three products per chunk: z, the
    2x2 decay as one ``[2, 2] x [2, K V]`` product, the rank update).

    Args:
        kg, pg: the group's write keys and error reads ``[B, n c, H, K]``; vg: values ``[B, n c, H, V]``.
        lgg, lmg: ``[B, n c, H]`` log decays of S and M; btg, etg: ``[B, n c, H]`` beta and eta.
        n: the group's chunks.
        masks: ``(s <= t, s < t, I)``: ``[C, C]`` each.
        ok: ``[n, B, H, C, 1]`` bool, contiguous: the tokens that run as written (the others, and a
            tail's padding, are identity tokens: their inputs cleared by torch.where); None: all.

    Returns:
        ``(step, kc, reads)``: ``step(j, Z) -> (Z_end, z_j)`` chunk j's map (for ``_pass_states``),
        kc ``[n BH, C, K]`` the keys chunk-major, and the outputs' factors ``(L_a, P12(t, start),
        [P(t, s) a~_s]_1)`` after each token's update and the same before it (at t - 1).
    """
    incl, strict, eye = masks
    B, H, K, C = kg.shape[0], kg.shape[2], kg.shape[3], eye.shape[0]
    nBH, BH = n * B * H, B * H

    def lay(x):  # [B, n c, H(, D)] -> [n BH, C(, D)], chunk-major, bad tokens and a tail's padding zeros
        x = x.to(eye.dtype)
        if x.dim() == 3:
            x = x[..., None]
        # (the where writes in ok's layout, chunk-major: the reshape is a view, no second copy)
        x = _chunk_major(x, n, C)
        return (x if ok is None else torch.where(ok, x, 0.0)).reshape(nBH, C, x.shape[-1])

    kc = lay(kg)
    la, lm = lay(lgg.clamp_min(-80.0))[..., 0], lay(lmg.clamp_min(-80.0))[..., 0]   # [n BH, C]
    pc, vc, bc, ec = lay(pg), lay(vg), lay(btg)[..., 0], lay(etg)[..., 0]
    ninf = torch.full((), float("-inf"), dtype=la.dtype, device=la.device)

    def dmat(rows, cols, mask):  # e^{rows_t - cols_s} where mask, else 0 (masked before exp)
        return torch.exp(torch.where(mask, rows[:, :, None] - cols[:, None, :], ninf))

    def shift(x):  # row t <- row t - 1 within the chunk (row 0: zeros): a product at t - 1
        return torch.nn.functional.pad(x[:, :-1], (0, 0, 1, 0) if x.dim() == 3 else (1, 0))

    La, Lm = torch.cumsum(la, dim=-1), torch.cumsum(lm, dim=-1)
    Lap, Lmp = La - la, Lm - lm                                      # before token t's decay
    Ea, Emp = dmat(La, La, incl), dmat(Lmp, Lm, strict)
    bm = -bc * torch.exp(lm)                                          # -beta_r mu_r
    Q12 = torch.bmm(Ea, bm[:, :, None] * Emp)                         # P12(t, s)
    h12 = torch.bmm(Ea, (bm * torch.exp(Lmp))[:, :, None])[..., 0]   # P12(t, start)
    be = (-bc * ec)[:, None, :]                                       # -beta_s eta_s
    Om = Ea * be + Q12 * ec[:, None, :]                               # [P(t, s) a~_s]_1, s <= t
    Gam = shift(Om)                                                   # [P(t-1, s) a~_s]_1, s < t
    h12p = shift(h12)                                                 # P12(t-1, start)
    A = Gam * torch.bmm(pc, kc.transpose(1, 2))                       # strictly lower
    rhs = torch.cat([pc * torch.exp(Lap)[..., None], pc * h12p[..., None], -vc], dim=-1)   # [n BH, C, 2K + V]
    # (I - A) X = rhs: the unit-triangular inverse (a solve against the C x C identity), then
    # one product with the 2K + V columns (measured faster on CPU than solving for them)
    inv = torch.linalg.solve_triangular(-A, eye.expand(nBH, C, C), upper=False, unitriangular=True)
    WZ, U = torch.bmm(inv, rhs).split([2 * K, vc.shape[-1]], dim=-1)   # z = WZ [S; M] + U
    kZ = torch.cat([kc * Om[:, -1, :, None], kc * (torch.exp(Lm[:, -1:] - Lm) * ec)[..., None]], dim=-1)
    gS, gM, hM = torch.exp(La[:, -1]), torch.exp(Lm[:, -1]), h12[:, -1]   # S's, M's: P11, P22, P12 (C, start)
    # the chunk's 2x2 D = P(C, start) = [[gS, hM], [0, gM]], applied to Z = [S; M] as a [2, 2] x [2, K V] product
    D = torch.stack([gS, hM, torch.zeros_like(gM), gM], dim=-1).view(nBH, 2, 2)
    WZ_j, U_j, kZ_j, D_j = (x.reshape(n, BH, *x.shape[1:]).unbind(0) for x in (WZ, U, kZ, D))

    def step(j, Z):  # chunk j's map of the joint state [S; M]: the errors z, then [S; M] at its end
        z = torch.baddbmm(U_j[j], WZ_j[j], Z)                          # [BH, C, V]
        Zd = torch.bmm(D_j[j], Z.view(BH, 2, K * Z.shape[-1])).view(BH, 2 * K, -1)   # [gS S + hM M; gM M]
        return torch.baddbmm(Zd, kZ_j[j].transpose(1, 2), z), z

    return step, kc, ((La, h12, Om), (Lap, h12p, Gam))


def _momentum_outputs(qg, kc, z, Zs, read_bad, La, h12, Om):
    """The outputs of a group of chunks: ``o = P z + [q e^{La} | q P12] [S; M]_start`` with
    ``P = Om * (q k^T)`` (the reads' factors of ``_momentum_maps``, after or before each token).

    Args:
        qg: the group's probes ``[B, n c, H, K]``; kc: ``[n BH, C, K]`` the write keys, chunk-major;
        z: ``[n BH, C, V]`` the chunks' errors; Zs: ``[n BH, 2K, V]`` the joint states at the
        chunks' starts; read_bad: ``[B, n c, H]`` bool, the outputs set to NaN (their probes are
        zeroed first, so that no NaN probe meets a product), or None; La, h12: ``[n BH, C]``, Om:
        ``[n BH, C, C]`` the reads' factors.

    Returns:
        ``[n BH, C, V]``.
    """
    nBH, C, K = kc.shape
    n = nBH // (qg.shape[0] * qg.shape[2])
    qc = _chunk_major(qg.to(kc.dtype), n, C)
    if read_bad is not None:   # (the flags chunk-major and contiguous: the where writes the layout, one copy)
        qc = torch.where(_chunk_major(read_bad[..., None], n, C).contiguous(), 0.0, qc)
    qc = qc.reshape(nBH, C, K)
    P = Om * torch.bmm(qc, kc.transpose(1, 2))
    qZ = torch.cat([qc * torch.exp(La)[..., None], qc * h12[..., None]], dim=-1)   # [n BH, C, 2K]: reads of [S; M]
    return torch.baddbmm(torch.bmm(P, z), qZ, Zs)
