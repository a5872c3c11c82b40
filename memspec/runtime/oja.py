"""Exact chunked kernel for a state transformed on its value side and read on its key side (the gated
Oja rule), and its token-loop reference.

One token updates the state ``S [K, V]`` (row-vector convention: the read is ``q @ S``) as

    S' = S Diag(d_t)                                (d_t = exp(log_decay_t), per value channel or scalar)
    z_t = c_t (S' u_t) + a_t                        (S u_t with read_after_decay=False)
    S <- S' + z_t w_tᵀ

``w_t [V]`` is the vector the transition acts with and writes along, ``u_t [V]`` the vector the
correction reads the state with (``None``: ``w_t``), ``c_t`` a scalar and ``a_t [K]`` the write.  The
gated Oja rule of flash-linear-attention (``h *= exp(gv); h += beta (k - h v) vᵀ; o = q h``) is
``w = u = v``, ``c = -beta``, ``a = beta k``, read after the decay.  The transition
``Diag(d) (I + c u wᵀ)`` multiplies the state from the right; the read ``q @ S`` contracts its rows.

The chunked form, a chunk of C tokens from its start state ``S_0``, with ``L_t`` the cumulative log
decay of the chunk (per channel) and ``r(t)`` the state the correction of token t reads (``t`` after
the decay, ``t - 1`` before it):

* inside the chunk ``S_t = S_0 Diag(e^{L_t}) + sum_{s <= t} z_s (e^{L_t - L_s} * w_s)ᵀ``, so the
  corrections solve one unit-lower-triangular system ``(I - N) Z = P S_0ᵀ + A`` with
  ``N[t, s] = c_t sum_j u_tj w_sj e^{L_r(t),j - L_sj}`` (``s < t``) and ``P_t = c_t e^{L_r(t)} * u_t``:
  ``Z = Z_A + Z_P S_0ᵀ`` (:func:`oja_prepare`, batched over chunks);
* the chunk's effect on the state is the affine map ``S_C = S_0 M + D`` with
  ``M = Diag(e^{L_C}) + Z_Pᵀ W~``, ``D = Z_Aᵀ W~`` (``W~_s = e^{L_C - L_s} * w_s``): the only
  sequential part, one product per chunk (:func:`oja_pass`);
* the outputs ``o_t = e^{L_t} * (q_t S_0) + sum_{s <= t} F[t, s] (e^{L_t - L_s} * w_s)`` with
  ``F = Q Zᵀ`` masked causally (:func:`oja_outputs`, batched over chunks).

Chunks are prepared, passed and read G at a time (:func:`chunk_oja`), so that temporaries stay small.
Per-channel decays never form a positive exponent nor a difference of cumulative sums: a chunk is
cut into sub-chunks of ``sub`` tokens; a pair inside one sub-chunk takes the sum of the log decays
between its tokens (a product with a 0 / 1 matrix), a pair across sub-chunks the product of two
factors split at the start of the later one's sub-chunk (each ``<= 1``) -- one batched product per
sub-chunk (:func:`oja_decays`).  Log decays may be any value ``<= 0``, -inf included (a decay of
0): -1e4 stands for anything lower, whose exp is exactly 0 in float32 and float64 alike, so no
number changes.

Non-finite inputs are screened by the rule of the kernels that solve per chunk (``_screen`` of
:mod:`.phases`): a bad token runs as an identity token, every output that reads a state at or after
it (in its document) and the final state are NaN, a bad probe poisons only its own output.
See :mod:`memspec.runtime` for the rules every kernel here follows.
"""
from __future__ import annotations

import torch

from .phases import _initial_states, _pass_states, _screen


def recurrent_oja(q, w, u, c, a, log_decay, S0, inclusive=True, read_after_decay=True):
    """Token-loop reference of the value-side transition (see the module docstring).

    Args:
        q: ``[B, T, H, K]`` probes, or None (state only).
        w: ``[B, T, H, V]`` the vector the transition acts with and writes along.
        u: ``[B, T, H, V]`` the vector the correction reads the state with, or None (``w``).
        c: ``[B, T, H]`` the correction's scalar.
        a: ``[B, T, H, K]`` the write.
        log_decay: ``[B, T, H]`` or ``[B, T, H, V]`` log decays (<= 0), or None (no decay).
        S0: ``[B, H, K, V]`` initial state, or None for zeros.
        inclusive: True: o_t reads the state after token t; False: before it.
        read_after_decay: True: the correction reads ``S Diag(d_t)``; False: ``S``.

    Returns:
        (o ``[B, T, H, V]`` or None, S_T ``[B, H, K, V]``).
    """
    B, T, H, V = w.shape
    K = a.shape[-1]
    dt = torch.promote_types(w.dtype, torch.float32)
    u = w if u is None else u
    S = w.new_zeros(B, H, K, V, dtype=dt) if S0 is None else S0.to(dt)
    outs = []
    for t in range(T):
        before = S
        Sd = S
        if log_decay is not None:
            d = torch.exp(log_decay[:, t].to(dt))                                 # [B, H] or [B, H, V]
            Sd = S * (d[..., None, None] if d.dim() == 2 else d[:, :, None, :])
        seen = Sd if read_after_decay else S
        z = c[:, t, :, None].to(dt) * torch.einsum("bhkv,bhv->bhk", seen, u[:, t].to(dt)) + a[:, t].to(dt)
        S = Sd + z[..., :, None] * w[:, t, :, None, :].to(dt)
        if q is not None:
            outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t].to(dt), S if inclusive else before))
    o = None
    if q is not None:
        o = torch.stack(outs, dim=1).to(w.dtype) if outs else w.new_zeros(B, 0, H, V)
    return o, S.to(S0.dtype if S0 is not None else w.dtype)


def oja_constants(C, sub, dtype, device):
    """The 0 / 1 matrices of :func:`oja_decays` for chunks of C tokens in sub-chunks of ``sub`` (n = C / sub):
    ``sums_in`` / ``sums_ex`` ``[s s, s]`` (pair (t, s) sums the tokens s < r <= t / s < r < t),
    ``tail`` ``[s, s]`` (token s sums those after it in its sub-chunk), ``between`` ``[n n, n]`` (target I =
    1..n, source J: the sub-chunks J < K < I), ``upto`` ``[n, n]`` (I = 1..n: the sub-chunks K < I) and
    ``blocks`` ``[1, n, 1, n, 1]`` (the pairs of one sub-chunk, True)."""
    n = C // sub
    ti = torch.arange(sub, device=device)
    t_, s_, r_ = ti[:, None, None], ti[None, :, None], ti[None, None, :]
    I = torch.arange(1, n + 1, device=device)[:, None, None]
    J = torch.arange(n, device=device)[None, :, None]
    Kk = torch.arange(n, device=device)[None, None, :]
    return {"sums_in": ((s_ < r_) & (r_ <= t_)).to(dtype).reshape(sub * sub, sub),
            "sums_ex": ((s_ < r_) & (r_ < t_)).to(dtype).reshape(sub * sub, sub),
            "tail": (ti[None, :] > ti[:, None]).to(dtype),
            "between": ((Kk > J) & (Kk < I)).to(dtype).reshape(n * n, n),
            "upto": (Kk[0] < I[:, 0]).to(dtype),
            "blocks": torch.eye(n, dtype=torch.bool, device=device)[None, :, None, :, None]}


def oja_decays(lg, sub, consts, pairs=("in", "ex")):
    """The decay factors of every chunk, split at sub-chunks (nothing exponentiated is positive).

    Every exponent is a sum of log decays (<= 0) taken as a product with a 0 / 1 matrix, never a
    difference of cumulative sums; log decays are finite here (-1e4 stands for anything lower, -inf
    included: the exp of either is exactly 0 in float32 and float64 alike).

    Args:
        lg: ``[X, C, V]`` log decays of X chunks of C tokens (C a multiple of ``sub``).
        sub: tokens per sub-chunk s (n = C / s sub-chunks).
        consts: :func:`oja_constants` of (C, sub).
        pairs: which pair weights to form (``"in"``, ``"ex"``); the others are None.

    Returns:
        a dict of ``[X, C, V]`` row factors ``e^{L_t - L_b}`` (``row_in``: after the token's decay,
        ``row_ex``: before it; ``L_b`` the log decay at the start of t's sub-chunk), ``[X, n, s, s, V]``
        pair weights inside a sub-chunk (``pair_in``: ``e^{L_t - L_s}`` for s <= t, ``pair_ex``:
        ``e^{L_{t-1} - L_s}`` for s < t; 1 for the pairs outside those masks, which the users mask),
        ``[X, n, C, V]`` column factors ``e^{L_b(I) - L_s}`` for the tokens of the sub-chunks before
        sub-chunk I (I = n: the chunk end, ``e^{L_C - L_s}``; for the other tokens a factor <= 1 that
        the users mask), ``[X, n, 1, V]`` ``e^{L_b}`` (``start``: from the chunk start to each sub-chunk)
        and ``[X, V]`` ``e^{L_C}`` (``end``).
    """
    X, C, V = lg.shape
    n = C // sub
    g = lg.clamp_min(-1e4).reshape(X * n, sub, V)
    inc = torch.cumsum(g, dim=1)                                          # L_t - L_b, t after its decay
    exc = torch.nn.functional.pad(inc[:, :-1], (0, 0, 1, 0))              # ... before it
    total = inc[:, -1].reshape(X, n, V)                                   # each sub-chunk's log decay
    pair_in = pair_ex = None
    if "in" in pairs:
        pair_in = torch.exp(torch.matmul(consts["sums_in"], g)).reshape(X, n, sub, sub, V)
    if "ex" in pairs:
        pair_ex = torch.exp(torch.matmul(consts["sums_ex"], g)).reshape(X, n, sub, sub, V)
    tail = torch.matmul(consts["tail"], g).reshape(X, 1, n, sub, V)      # from s to the end of its sub-chunk
    gap = torch.matmul(consts["between"], total).reshape(X, n, n, 1, V)   # between the sub-chunks J and I
    col = torch.exp(tail + gap).reshape(X, n, C, V)
    upto = torch.matmul(consts["upto"], total)                            # [X, n(I), V]: sum_{K < I}
    start = torch.nn.functional.pad(upto[:, :-1], (0, 0, 1, 0))           # each sub-chunk's start
    return {"row_in": torch.exp(inc).reshape(X, C, V), "row_ex": torch.exp(exc).reshape(X, C, V),
            "pair_in": pair_in, "pair_ex": pair_ex, "col": col,
            "start": torch.exp(start)[:, :, None], "end": torch.exp(upto[:, -1])}


def oja_prepare(w, u, c, a, lg, sub, consts, read_after_decay=True, inclusive=True):
    """The intra-chunk preparation of X chunks at once: the corrections ``Z = Z_A + Z_P S_0ᵀ`` as
    functions of the chunk's start state (one triangular solve per chunk) and the chunk's affine map
    ``S_C = S_0 M + D``.

    Args:
        w, u: ``[X, C, V]`` (u None: w); c: ``[X, C]``; a: ``[X, C, K]``; lg: ``[X, C, V]`` log decays
            or None -- X chunks of C tokens (C a multiple of ``sub``), in the kernel's dtype.
        sub: tokens per sub-chunk; consts: :func:`oja_constants` (:func:`oja_decays`).
        read_after_decay: the correction reads the state after the token's decay.
        inclusive: the outputs read the state after their token (which pair weights to keep).

    Returns:
        a dict: ``ZA [X, C, K]``, ``ZP [X, C, V]``, ``M [X, V, V]``, ``D [X, K, V]``, the decay factors
        ``dec`` (None without decays), ``wcol [X, n - 1, C, V]`` (w times the column factors of
        sub-chunks 1..n-1) and ``pw [X, n, s, s, V]`` (w times the pair weights the outputs take, when
        the correction takes the same ones; else None).
    """
    X, C, V = w.shape
    n = C // sub
    r = c[..., None] * (w if u is None else u)                             # [X, C, V] rows of N
    if lg is None:   # no decay: N = tril(r wᵀ, -1), P = r, W~ = w
        N = torch.matmul(r, w.transpose(1, 2)).tril(-1)                    # [X, C, C]
        P, w_end, dec, wcol = r, w, None, None
    else:
        dec = oja_decays(lg, sub, consts, pairs=("in" if read_after_decay or inclusive else "",
                                         "ex" if not (read_after_decay and inclusive) else ""))
        rowf = dec["row_in" if read_after_decay else "row_ex"]             # [X, C, V]
        rd = (r * rowf).reshape(X, n, sub, V)                              # rows decayed from their sub-chunk's start
        # pairs inside a sub-chunk: sum_j r_tj w_sj e^{L_r(t),j - L_sj}, s < t
        pw = dec["pair_in" if read_after_decay else "pair_ex"] * w.reshape(X, n, 1, sub, V)   # [X, n, t, s, V]
        inner = torch.matmul(pw, r.reshape(X, n, sub, V, 1))[..., 0].tril(-1)    # [X, n, s, s] (s < t)
        # pairs across sub-chunks: the rows of sub-chunk I >= 1 against every column before it
        wcol = w[:, None] * dec["col"][:, :n - 1]                          # [X, n - 1, C, V]
        cross = torch.matmul(rd[:, 1:], wcol.transpose(-1, -2))            # [X, n - 1, s, C]
        cross = torch.cat([cross.new_zeros(X, 1, sub, C), cross], dim=1).reshape(X, n, sub, n, sub)
        # [X, C, C]: the pairs inside a sub-chunk from inner, the others from cross (where the column
        # factors are no weights, after the row's sub-chunk, the solve reads nothing)
        N = torch.where(consts["blocks"], inner[:, :, :, None, :], cross).reshape(X, C, C)
        P = (rd * dec["start"]).reshape(X, C, V)                           # c_t e^{L_r(t)} u_t
        w_end = w * dec["col"][:, n - 1]                                   # W~: w decayed to the chunk end
    # the one triangular solve per chunk, (I - N) [Z_A | Z_P] = [A | P], in the layout that batches
    # fastest on CPU: [Z_A | Z_P]ᵀ (I - N)ᵀ = [A | P]ᵀ
    rhs = torch.cat([a, P], dim=-1)                                        # [X, C, K + V]
    Z = torch.linalg.solve_triangular(-N.transpose(1, 2), rhs.transpose(1, 2), upper=True, left=False,
                                      unitriangular=True).transpose(1, 2)
    ZA, ZP = Z.split([a.shape[-1], V], dim=-1)                             # [X, C, K], [X, C, V]
    M = torch.matmul(ZP.transpose(1, 2), w_end)                            # [X, V, V]
    M = M + (torch.diag_embed(dec["end"]) if dec is not None else torch.eye(V, dtype=M.dtype, device=M.device))
    D = torch.matmul(ZA.transpose(1, 2), w_end)                            # [X, K, V]
    return {"ZA": ZA, "ZP": ZP, "M": M, "D": D, "dec": dec, "wcol": wcol,
            "pw": pw if lg is not None and read_after_decay == inclusive else None}


def oja_pass(M, D, S, docs=None, first=0):
    """The state passing over chunks, the only sequential part: ``S <- S M_j + D_j``.

    Args:
        M: ``[NC, BH, V, V]``, D: ``[NC, BH, K, V]`` the chunks' affine maps, in order.
        S: ``[BH, K, V]`` the state before the first chunk.
        docs: packed documents laid out in chunks (``_DocumentChunks``: a document's initial state
            enters where it starts, its final state is kept where it ends), or None.
        first: the index of the first of these chunks in the row (for ``docs``).

    Returns:
        (the start state of every chunk ``[NC, BH, K, V]``, the state after the last).
    """
    def step(j, S):
        return torch.baddbmm(D[j], S, M[j]), None                          # [BH, K, V]

    S, starts, _ = _pass_states(step, M.shape[0], S, docs, first)
    return torch.stack(starts), S


def oja_outputs(q, w, prep, S_start, sub, consts, inclusive=True):
    """The outputs of X chunks at once, each from its start state.

    Args:
        q: ``[X, C, K]`` probes; w: ``[X, C, V]``; prep: :func:`oja_prepare`'s dict; S_start:
            ``[X, K, V]`` each chunk's start state; sub: tokens per sub-chunk; consts:
            :func:`oja_constants`; inclusive: o_t reads the state after token t.

    Returns:
        o ``[X, C, V]``: ``e^{L_o(t)} * (q_t S_0) + sum_s F[t, s] (e^{L_o(t) - L_s} * w_s)``, ``F = Q Zᵀ``.
    """
    X, C, V = w.shape
    n = C // sub
    Z = torch.baddbmm(prep["ZA"], prep["ZP"], S_start.transpose(1, 2))    # [X, C, K] the corrections
    F = torch.matmul(q, Z.transpose(1, 2)).tril(0 if inclusive else -1)    # [X, C, C] q_t . z_s
    qS = torch.matmul(q, S_start)                                          # [X, C, V]
    dec = prep["dec"]
    if dec is None:
        return qS + torch.matmul(F, w)
    rowf = dec["row_in" if inclusive else "row_ex"].reshape(X, n, sub, V)
    pw = prep["pw"]
    if pw is None:
        pw = dec["pair_in" if inclusive else "pair_ex"] * w.reshape(X, n, 1, sub, V)   # [X, n, t, s, V]
    Fb = F.reshape(X, n, sub, n, sub)
    inner = torch.diagonal(Fb, dim1=1, dim2=3).permute(0, 3, 1, 2)         # [X, n, s, s] F's diagonal blocks
    o = torch.matmul(inner[:, :, :, None, :], pw)[:, :, :, 0]             # [X, n, s, V]
    # across sub-chunks: F without its diagonal blocks (the column factors there are no weights)
    Fx = torch.where(consts["blocks"], torch.zeros((), dtype=F.dtype, device=F.device), Fb)
    cross = torch.matmul(Fx.reshape(X, n, sub, C)[:, 1:], prep["wcol"])   # [X, n - 1, s, V]
    o = o + torch.cat([cross.new_zeros(X, 1, sub, V), cross], dim=1) * rowf
    o = o + qS.reshape(X, n, sub, V) * rowf * dec["start"]
    return o.reshape(X, C, V)


def oja_chunks(x, NC, C, dt):
    """``[B, T, H, d]`` -> ``[NC B H, C, d]`` chunk-major in dtype ``dt``, the tail padded with identity
    tokens (zeros); None stays None."""
    if x is None:
        return None
    B, T, H, d = x.shape
    x = torch.nn.functional.pad(x.to(dt), (0, 0, 0, 0, 0, NC * C - T))
    return x.reshape(B, NC, C, H, d).permute(1, 0, 3, 2, 4).reshape(NC * B * H, C, d)


def chunk_oja(q, w, u, c, a, log_decay, S0, chunk, inclusive=True, read_after_decay=True, sub=8,
              group=None, documents=None):
    """Exact chunked value-side transition: :func:`recurrent_oja`'s recurrence (the same arguments) in
    chunks -- :func:`oja_prepare` for every chunk, :func:`oja_pass` over them, :func:`oja_outputs`.

    Args:
        q: ``[B, T, H, K]`` probes, or None (state only).
        w: ``[B, T, H, V]`` the vector the transition acts with and writes along.
        u: ``[B, T, H, V]`` the vector the correction reads the state with, or None (``w``).
        c: ``[B, T, H]`` the correction's scalar.
        a: ``[B, T, H, K]`` the write.
        log_decay: ``[B, T, H]`` or ``[B, T, H, V]`` log decays (<= 0, -inf allowed), or None.
        S0: ``[B, H, K, V]`` initial state, or None for zeros.
        chunk: tokens per chunk C (rounded up to a multiple of the sub-chunk).
        inclusive: True: o_t reads the state after token t; False: before it.
        read_after_decay: the correction reads the state after the token's decay.
        sub: tokens per sub-chunk (per-channel decays; any value gives the same numbers).
        group: chunks per group G (default: temporaries near 2 MB on CPU, 64 elsewhere); any G >= 1
            gives the same numbers.
        documents: packed documents (``_Documents(cu_seqlens)``: B = 1, offsets ``[N + 1]``; S0 and
            S_T ``[N, H, K, V]``): each starts at a chunk, from its own state; or None.

    Returns:
        (o ``[B, T, H, V]`` or None, S_T ``[B, H, K, V]``).
    """
    B, T, H, V = w.shape
    K = a.shape[-1]
    BH = B * H
    dt = torch.promote_types(w.dtype, torch.float32)
    s_dtype = S0.dtype if S0 is not None else w.dtype
    if T == 0:
        S_T = S0 if S0 is not None else w.new_zeros(B, H, K, V)
        return (w.new_zeros(B, 0, H, V) if q is not None else None), S_T
    C = max(1, min(int(chunk), T))
    s = min(int(sub), C)
    C = -(-C // s) * s                                                     # a multiple of the sub-chunk
    if log_decay is not None and log_decay.dim() == 3:                     # one decay per head: every channel
        log_decay = log_decay[..., None].expand(B, T, H, V)
    docs, S = _initial_states(S0, documents, C, B, (H, K, V), dt, w.device)   # (packed: each from a chunk)
    # non-finite inputs (_screen): a bad token runs as an identity token (its w, u, c, write and decay
    # cleared by torch.where, never by a product), the probes of the outputs set to NaN are zeroed
    ok, read_bad, state_bad = _screen((w, u, c[..., None], a), (log_decay,), q, docs, inclusive)
    q, *xs = [x if docs is None else docs.lay(x) for x in (q, w, u, c[..., None], a, log_decay)]   # the laid-out row
    xs = [q if q is None else torch.where(read_bad[..., None], 0.0, q)] + [
        None if x is None else torch.where(ok[..., None], x, 0.0) for x in xs]
    NC = -(-xs[1].shape[1] // C)
    qc, wc, uc, cc, ac, lgc = (oja_chunks(x, NC, C, dt) for x in xs)   # [NC B H, C, d]
    consts = oja_constants(C, s, dt, w.device)
    # groups of G consecutive chunks (every head), prepared, passed and read one at a time:
    # temporaries near 2 MB on CPU (larger ones are page-faulted back on every call; smaller
    # groups pay more per operation: measured fastest at T = 2048, H = 4, D = 64)
    G = int(group) if group is not None else (
        round((1 << 19) / (BH * C * (s if lgc is not None else 1) * V)) if w.device.type == "cpu" else 64)
    G, outs = max(1, min(NC, G)), []
    for j in range(0, NC, G):
        nc = min(G, NC - j)
        at = slice(j * BH, (j + nc) * BH)
        prep = oja_prepare(wc[at], uc[at] if uc is not None else None, cc[at, :, 0], ac[at],
                           lgc[at] if lgc is not None else None, s, consts, read_after_decay, inclusive)
        starts, S = oja_pass(prep["M"].reshape(nc, BH, V, V), prep["D"].reshape(nc, BH, K, V), S, docs, j)
        if q is not None:
            outs.append(oja_outputs(qc[at], wc[at], prep, starts.reshape(nc * BH, K, V), s, consts, inclusive))
    S_T = docs.final() if docs is not None else S.reshape(B, H, K, V)
    S_T = torch.where(state_bad[..., None, None], float("nan"), S_T)           # a bad token poisons it
    if q is None:
        return None, S_T.to(s_dtype)
    o = torch.cat(outs, dim=0) if len(outs) > 1 else outs[0]                    # [NC B H, C, V]
    o = o.reshape(NC, B, H, C, V).permute(1, 0, 3, 2, 4).reshape(B, NC * C, H, V)
    o = o[:, :read_bad.shape[1]]                                               # the laid-out (or real) tokens
    o = torch.where(read_bad[..., None], float("nan"), o)                      # reads at or after a bad token
    o = docs.unlay(o) if docs is not None else o
    return o.to(w.dtype), S_T.to(s_dtype)
