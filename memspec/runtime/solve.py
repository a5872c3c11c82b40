"""Solve reads of an additive state: every token solves ``x_t = (H_t + lam I)^-1 q_t`` with
``H_t = exp(log_gamma_t) H_{t-1} + beta_t outer(k_t, k_t)`` (MesaNet, von Oswald et al. 2025: the
mesa layer's regularised least-squares read), by conjugate gradients run for all tokens of a chunk
at once; :func:`recurrent_solve` is the token loop it is tested against.

Inside a chunk with chunk-start state ``H_0`` and cumulative log decays ``L``, token t's matrix is
``H_t = exp(L_t) H_0 + sum_{s <= t} exp(L_t - L_s) beta_s k_s k_sᵀ``, so one conjugate-gradient
step applies every token's own matrix to its own search direction ``p_t`` with chunk-level
products (flash-linear-attention's chunked MesaNet does the same):

    A p = exp(L) * (P H_0) + ((P Kᵀ) * W) K + lam P,    W[t, s] = exp(L_t - L_s) beta_s (s <= t)

``H_t`` is symmetric positive semi-definite whenever ``H_0`` is and every ``beta_t >= 0`` (the
analysis admits only such specs; the initial state is zeros), so with ``lam > 0`` every system is
symmetric positive definite: conjugate gradients converges, in exact arithmetic in at most K steps.
The kernel runs each token's iteration until its residual ``||q_t - A_t x_t||`` is at most ``tol``
times ``||q_t||`` (:func:`_solve_tolerance`: near the precision of the dtype) or ``steps`` steps
have run; a token that has converged stops moving (its step is 0), so its result does not depend on
the tokens batched with it.

The backward solves the adjoint systems ``A_t y_t = dL/dx_t`` by conjugate gradients too (the
matrices are symmetric) and differentiates the matrices in closed form: ``dL/dA_t = -y_t x_tᵀ``,
carried to ``H_0``, the keys, the pair weights and the decays through one product each (no
autograd through the iterations).

A spec may name the solver instead: ``cg(H + lam I, q, N)`` (:func:`cg`, the language's function) is
N conjugate-gradient steps from x = 0, a token stopping early only once its residual reaches the
rounding level of ``q_t`` -- MesaNet's fixed-step read, another function than the solve.  The kernel
then runs exactly those steps (``fixed=True``, :class:`_ChunkCG`), and its backward differentiates
the iterations (run again under autograd, one group of chunks at a time): the exact solve's adjoint
would be the gradient of another function.  The regulariser ``lam`` may be one per token and key
channel (``Diag(lam_t)``, a learned per-dimension Lambda), differentiated too.
"""
from __future__ import annotations

import torch

from .phases import (_chunk_groups, _chunk_major, _group_size, _initial_states, _join_chunks, _pass_states, _screen,
                     _split_groups, _stacked, _token_major)


def recurrent_solve(q, k, beta, log_gamma, H0, lam, inclusive=True):
    """Token loop: ``H_t = exp(log_gamma_t) H_{t-1} + beta_t outer(k_t, k_t)``,
    ``x_t = solve(H_t + lam I, q_t)`` (``inclusive=False``: with ``H_{t-1}``); the oracle of
    :func:`chunk_solve`.  Row-vector convention, ``x_t (H_t + lam I) = q_t``: the same x for a
    symmetric state, and the gradient with respect to the state ``-x_tᵀ y_t`` as
    :func:`chunk_solve` gives it.

    Args: q, k ``[B, T, H, K]``; beta, log_gamma ``[B, T, H]`` (log_gamma None: no decay);
    H0 ``[B, H, K, K]`` or None (zeros); lam a number.
    Returns: (x ``[B, T, H, K]``, the final state ``[B, H, K, K]``)."""
    B, T, Hh, K = k.shape
    dt = torch.promote_types(k.dtype, torch.float32)
    S = k.new_zeros(B, Hh, K, K, dtype=dt) if H0 is None else H0.to(dt)
    eye = lam * torch.eye(K, dtype=dt, device=k.device)
    xs = []
    for t in range(T):
        before = S
        if log_gamma is not None:
            S = torch.exp(log_gamma[:, t].to(dt))[..., None, None] * S
        kt = k[:, t].to(dt)
        S = S + beta[:, t].to(dt)[..., None, None] * (kt.unsqueeze(-1) * kt.unsqueeze(-2))
        A = (S if inclusive else before) + eye
        x_t = torch.linalg.solve(A, q[:, t].to(dt).unsqueeze(-2), left=False)   # x_t A = q_t
        xs.append(x_t.squeeze(-2))
    x = torch.stack(xs, 1) if xs else q.new_zeros(B, 0, Hh, K, dtype=dt)
    return x.to(q.dtype), S.to(H0.dtype if H0 is not None else k.dtype)


def chunk_solve(q, k, beta, log_gamma, H0, lam, chunk, *, inclusive=True, tol=None, steps=None,
                fixed=False, group=None, documents=None):
    """Chunked form of :func:`recurrent_solve`: ``x_t = solve(H_t + lam I, q_t)`` for every
    token by conjugate gradients over whole chunks (the module docstring gives the algebra).
    The state passes over chunks as ``H_end = exp(L_C) H_0 + sum_s beta_s exp(L_C - L_s) k_s
    k_sᵀ``, its writes symmetrised (it stays symmetric in floating point); a group of G chunks
    runs one batched solver.  A log decay of -inf (a decay of exactly 0) forgets exactly.
    Non-finite inputs (k, beta, log_gamma; q): a bad token runs as an identity token, and the
    outputs that read a state at or after it (in its document) and the final state are NaN; a bad
    probe makes only its own output NaN.

    Args:
        q: ``[B, T, H, K]`` right-hand sides.
        k: ``[B, T, H, K]`` keys; beta: ``[B, T, H]`` write weights (>= 0).
        log_gamma: ``[B, T, H]`` log decays (<= 0), or None for no decay.
        H0: ``[B, H, K, K]`` initial state (symmetric positive semi-definite), or None for
            zeros; one that is not symmetric (to ``tol`` of its largest entry) takes a direct
            solve per token (:func:`_direct_solve`).
        lam: the regulariser: a number > 0, or a tensor > 0 broadcasting to ``[B, T, H, K]`` (one
            per token and key channel: ``H_t + Diag(lam_t)``; ``[H, K]`` a learned one per head).
        chunk: chunk size C.
        inclusive: True: token t solves with H_t; False: with H_{t-1}.
        tol: the relative residual at which a token stops (None: :func:`_solve_tolerance`).
        steps: the most conjugate-gradient steps (None: K, where exact arithmetic converges).
        fixed: False: solve to ``tol`` as above.  True: the spec's solver ``cg(A, q, steps)``
            instead, ``steps`` conjugate-gradient steps from x = 0 and :func:`cg`'s early stop
            only (:func:`_solve_group`).
        group: chunks per batched group G (default: temporaries near 512 KB on CPU).
        documents: packed documents (``_Documents(cu_seqlens)``: B = 1; H0 and the final state
            ``[N, H, K, K]``): each starts at a chunk, from its own state; or None.

    Returns:
        (x ``[B, T, H, K]``, the final state ``[B, H, K, K]``).
    """
    B, T, Hh, K = k.shape
    BH = B * Hh
    dt = torch.promote_types(k.dtype, torch.float32)
    out_dtype = H0.dtype if H0 is not None else k.dtype
    tolerance = _solve_tolerance(dt) if tol is None else float(tol)
    most = K if steps is None else int(steps)   # conjugate-gradient steps at most
    if T == 0:
        H_T = H0 if H0 is not None else k.new_zeros(B, Hh, K, K, dtype=out_dtype)
        return q.new_zeros(B, 0, Hh, K), H_T
    C = max(1, min(int(chunk), T))
    docs, S = _initial_states(H0, documents, C, B, (Hh, K, K), dt, k.device)
    ok, read_bad, state_bad = _screen((k, beta), (log_gamma,), q, docs, inclusive)
    # conjugate gradients needs symmetric systems; an initial state that is not (beyond the
    # solver's tolerance of its largest entry) takes the direct solve (one device sync)
    symmetric = H0 is None or bool((H0 - H0.transpose(-1, -2)).abs().amax()
                                   <= tolerance * H0.abs().amax())
    inputs = _solve_inputs(q, k, beta, log_gamma, lam, docs, ok, read_bad)   # [B, T', H, ...] (packed: laid out)
    T = inputs[1].shape[1]
    G = _group_size(-(-T // C), BH * C * max(K, C), group, k.device)
    groups = _chunk_groups(T, C, G)
    pieces = zip(groups, *(_split_groups(x, groups) for x in inputs))
    outs, j0 = [], 0
    for (n, m, c), qp, kp, bp, lp, *lam_p in pieces:
        def block(x):   # [B, n c, H, *D] -> [n B H, c, *D]
            x = _chunk_major(x.to(dt), n, c)
            return x.reshape(n * BH, c, *x.shape[4:])

        qg, kg, bg, lg = block(qp), block(kp), block(bp), block(lp)   # [nBH, c, (K)]
        lam_g = block(lam_p[0]) if lam_p else float(lam)             # [nBH, c, K] or a number
        W, Lq, g_end, kd = _solve_weights(lg, bg, kg, n, inclusive)
        kk = torch.bmm(kd.transpose(1, 2), kg)          # each chunk's writes, decayed to its end
        kk = ((kk + kk.transpose(1, 2)) * 0.5).view(n, BH, K, K)   # symmetric in floating point
        S, starts, _ = _pass_states(lambda j, S: (torch.addcmul(kk[j], g_end[j], S), None), n, S,
                                    docs, j0)
        j0 += n
        H_starts, a = _stacked(starts), torch.exp(Lq)   # [nBH, K, K], [nBH, c]
        x = _solve_group(qg, H_starts, kg, W, a, lam_g, symmetric, fixed, tolerance, most)
        outs.append(_token_major(x, B, Hh, m))   # [B, n, m, H, K]
    H_T = docs.final() if docs is not None else S.view(B, Hh, K, K)
    H_T = torch.where(state_bad[..., None, None], float("nan"), H_T)   # a bad token poisons it
    x = torch.where(read_bad[..., None], float("nan"), _join_chunks(outs))   # reads at or after a bad token
    x = docs.unlay(x) if docs is not None else x
    return x.to(q.dtype), H_T.to(out_dtype)


def _solve_group(q, H0, k, W, a, lam, symmetric, fixed, tol, steps):
    """A group's solutions ``x [nBH, c, K]`` of every token's system (chunk-start states ``H0
    [nBH, K, K]``): with ``fixed``, the ``steps`` conjugate-gradient steps of ``cg(A, q, steps)``
    (``A_t x_t = q_t`` as cg writes it: ``p A_tᵀ`` row by row), else ``x_t A_t = q_t`` solved to
    the relative residual ``tol``; an initial state that is not ``symmetric`` forms every
    token's matrix."""
    if fixed and symmetric:
        return _ChunkCG.apply(q, H0.transpose(1, 2), k, W, a, lam, steps)
    elif fixed:
        A = _formed_systems(H0, k, W, a, lam, q)
        return _cg_rows(lambda P: (A @ P.unsqueeze(-1)).squeeze(-1), q, steps)
    elif symmetric:
        return _ChunkSolve.apply(q, H0, k, W, a, lam, tol, steps)
    else:
        return _direct_solve(q, H0, k, W, a, lam)


def _solve_inputs(q, k, beta, log_gamma, lam, docs, ok, read_bad):
    """``chunk_solve``'s per-token inputs on the laid-out row (``docs``: packed documents, or None):
    the probes, keys, write weights and log decays (0 without a decay; -inf, a decay of 0, as the
    lowest finite one), and a regulariser that is a tensor, as ``[B, T, H, K]`` (one per token and
    key channel).  A bad token (``ok`` false, :func:`_screen`'s flags) runs as an identity
    token (no write, no decay) and the probe of an output set to NaN (``read_bad``) as 0 (solved at
    once), by ``torch.where`` only when there is one (one sync: the solver's steps sync anyway)."""
    lg_all = log_gamma if log_gamma is not None else torch.zeros_like(beta)   # (no decay: 0)
    q_in, k_in, b_in, lg_in = q, k, beta, lg_all
    if docs is not None:   # the laid-out row
        q_in, k_in, b_in, lg_in = docs.lay(q), docs.lay(k), docs.lay(beta), docs.lay(lg_all)
    if bool((read_bad | ~ok).any()):
        q_in, k_in, b_in, lg_in = (torch.where(read_bad[..., None], 0.0, q_in), torch.where(ok[..., None], k_in, 0.0),
                                   torch.where(ok, b_in, 0.0), torch.where(ok, lg_in, 0.0))
    out = (q_in, k_in, b_in, torch.nan_to_num(lg_in, 0.0, 0.0))
    if torch.is_tensor(lam):
        lam = (lam.unsqueeze(-1) if lam.dim() == 3 else lam).expand(*q.shape)
        out += (docs.lay(lam) if docs is not None else lam,)
    return out


def _solve_tolerance(dtype):
    """The relative residual at which the solver stops: near the precision of ``dtype`` (a
    residual of ``tol ||q||`` leaves an error of at most ``tol`` times the condition number)."""
    return 1e-12 if dtype == torch.float64 else 1e-6


def _solve_weights(lg, bg, kg, n, inclusive):
    """A group's chunk constants from its log decays ``lg`` and write weights ``bg``
    ``[nBH, c]`` and keys ``kg`` ``[nBH, c, K]`` (n chunks): the pair weights ``W [nBH, c, c]``
    (``exp(L_t - L_s) beta_s`` for s <= t, s < t when exclusive), the log decay ``Lq [nBH, c]``
    of the chunk-start state at each token, the decay over each chunk ``[n, BH, 1, 1]`` and the
    keys weighted and decayed to the chunk's end ``[nBH, c, K]``."""
    nBH, c = lg.shape
    later = torch.ones(c, c, dtype=torch.bool, device=lg.device).tril(-1)   # u > s
    # seg[t, s] = sum of lg_u over s < u <= t
    seg = torch.cumsum(lg[:, :, None].expand(-1, c, c).masked_fill(~later, 0.0), dim=1)
    L = torch.cumsum(lg, dim=1)                                      # [nBH, c]
    if not inclusive:                              # token t sees the state through t - 1
        seg = torch.nn.functional.pad(seg[:, :-1], (0, 0, 1, 0))
        L_q = torch.nn.functional.pad(L[:, :-1], (1, 0))
    else:
        L_q = L
    pairs = torch.ones(c, c, dtype=torch.bool, device=lg.device).tril(0 if inclusive else -1)
    W = torch.exp(seg).masked_fill(~pairs, 0.0) * bg[:, None, :]     # [nBH, c, c]
    # the log decay after each token to the chunk's end
    after = torch.nn.functional.pad(torch.cumsum(lg.flip(1), 1).flip(1)[:, 1:], (0, 1))
    kd = kg * (bg * torch.exp(after))[..., None]                     # [nBH, c, K]
    g_end = torch.exp(L[:, -1]).view(n, -1, 1, 1)
    return W, L_q, g_end, kd


def _formed_systems(H0, k, W, a, lam, q):
    """Every token's matrix ``a_t H_0 + sum_s W[t, s] k_s k_sᵀ + Diag(lam_t)`` formed,
    ``[nBH, c, K, K]`` (``H_0 [nBH, K, K]`` any matrix, ``lam`` a number or ``[nBH, c, K]``, ``q``
    the right-hand sides ``[nBH, c, K]`` for the shape): the path of an initial state that is not
    symmetric, where the chunk-level products do not apply; differentiated by autograd."""
    kk = k.unsqueeze(-1) * k.unsqueeze(-2)                           # [nBH, c, K, K]
    A = a[..., None, None] * H0.unsqueeze(1) + torch.einsum("bts,bsij->btij", W, kk)
    return A + torch.diag_embed(lam * torch.ones_like(q))


def _direct_solve(q, H0, k, W, a, lam):
    """Every token's system ``x_t A_t = q_t`` (:func:`_formed_systems`) solved directly."""
    A = _formed_systems(H0, k, W, a, lam, q)
    return torch.linalg.solve(A, q.unsqueeze(-2), left=False).squeeze(-2)   # x_t A_t = q_t


def _solve_matvec(P, H0, k, W, a, lam):
    """Every token's matrix applied to its own row of ``P [nBH, c, K]``:
    ``a_t (p_t H_0) + sum_s W[t, s] (p_t . k_s) k_s + lam p_t`` (H_0 ``[nBH, K, K]`` the
    chunk's start state, symmetric; ``a [nBH, c]`` its decay at each token; ``lam`` a number or
    ``[nBH, c, K]``, one per token and channel)."""
    if torch.is_tensor(lam):                                         # lam [nBH, c, K]: Diag(lam_t)
        out = torch.baddbmm(lam * P, P * a[..., None], H0)
    else:
        out = torch.baddbmm(P, P * a[..., None], H0, beta=lam)       # lam p_t + (a_t p_t) H_0
    return torch.baddbmm(out, torch.bmm(P, k.transpose(1, 2)).mul_(W), k)


def _conjugate_gradients(matvec, b, tol, steps):
    """``x`` with ``matvec(x) = b`` row by row (``b [N, c, K]``, every row its own symmetric
    positive definite system): conjugate gradients, a row stopping (its step 0 from then on)
    once its residual is at most ``tol ||b_t||``; at most ``steps`` steps.  A row of zeros is
    solved at once (x = 0); a non-finite one stays active and gives a non-finite x.  Runs
    without autograd (updates in place)."""
    x = torch.zeros_like(b)
    r, p = b.clone(), b.clone()
    rr = (b * b).sum(-1)                                             # [N, c] squared residuals
    stop = rr * (tol * tol)
    for _ in range(steps):
        active = ~(rr <= stop)                                       # (NaN rows stay active)
        if not bool(active.any()):
            break
        Ap = matvec(p)
        alpha = torch.where(active, rr / (p * Ap).sum(-1), 0.0).unsqueeze(-1)   # [N, c, 1]
        x.addcmul_(alpha, p)
        r.addcmul_(alpha, Ap, value=-1.0)
        rr_new = (r * r).sum(-1)
        p.mul_(torch.where(active, rr_new / rr, 0.0).unsqueeze(-1)).add_(r)
        rr = torch.where(active, rr_new, rr)
    return x


class _ChunkSolve(torch.autograd.Function):
    """``x_t = q_t A_t^-1`` for a group of chunks (:func:`_solve_matvec` applies ``A``), by
    conjugate gradients; the backward solves the adjoint systems ``y_t A_t = g_t`` the same way
    and takes ``dL/dA_t = -x_tᵀ y_t`` to the operands of ``A`` in closed form."""

    @staticmethod
    def forward(ctx, q, H0, k, W, a, lam, tol, steps):
        with torch.no_grad():
            x = _conjugate_gradients(lambda P: _solve_matvec(P, H0, k, W, a, lam), q, tol, steps)
        ctx.save_for_backward(x, H0, k, W, a, *([lam] if torch.is_tensor(lam) else []))
        ctx.solver = (None if torch.is_tensor(lam) else lam, tol, steps)
        return x

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        x, H0, k, W, a, *lam_t = ctx.saved_tensors
        lam, tol, steps = ctx.solver
        lam = lam_t[0] if lam_t else lam
        y = _conjugate_gradients(lambda P: _solve_matvec(P, H0, k, W, a, lam), g, tol, steps)
        # x_t A_t = a_t (x_t H_0) + sum_s W[t, s] (x_t . k_s) k_s + lam x_t against -y_t
        xk = torch.bmm(x, k.transpose(1, 2))                         # [nBH, c, c] x_t . k_s
        yk = torch.bmm(y, k.transpose(1, 2))                         # [nBH, c, c] y_t . k_s
        d_a = -(torch.bmm(x, H0) * y).sum(-1)                        # [nBH, c]
        d_H0 = -torch.bmm((x * a[..., None]).transpose(1, 2), y)     # [nBH, K, K]
        d_W = -(xk * yk)                                             # [nBH, c, c]
        d_k = -torch.bmm((xk * W).transpose(1, 2), y) - torch.bmm((yk * W).transpose(1, 2), x)
        d_lam = -(x * y) if torch.is_tensor(lam) else None               # Diag(lam_t) against -y_t x_tᵀ
        return y, d_H0, d_k, d_W, d_a, d_lam, None, None


def cg(A, B, steps):
    """``cg(A, B, steps)`` of the language: ``steps`` iterations of conjugate gradients on
    ``A X = B`` from ``X = 0``, every column of ``B [..., n, m]`` its own iteration, a column
    stopping once its residual is at the rounding level of its ``b`` (``||r|| <= eps ||b||``, eps
    the dtype's machine epsilon: converged, where exact arithmetic has 0; its divisions then by 1,
    so no 0 / 0 reaches a gradient).  Differentiable by autograd through the iterations."""
    x = torch.zeros_like(B)
    r, p = B, B
    rr = (B * B).sum(-2, keepdim=True)                               # [..., 1, m] squared residuals
    stop = rr * torch.finfo(B.dtype).eps ** 2                        # the rounding level of b
    for _ in range(steps):
        active = ~(rr <= stop)                                       # (a NaN column stays active)
        Ap = A @ p
        alpha = torch.where(active, rr, 0.0) / torch.where(active, (p * Ap).sum(-2, keepdim=True), 1.0)
        x = x + alpha * p
        r = r - alpha * Ap
        rr_new = (r * r).sum(-2, keepdim=True)
        p = r + torch.where(active, rr_new, 0.0) / torch.where(active, rr, 1.0) * p
        rr = torch.where(active, rr_new, rr)
    return x


def _cg_rows(matvec, b, steps):
    """``steps`` conjugate-gradient steps on every row of ``b [N, c, K]`` (its own symmetric
    system, ``matvec`` applying every row's matrix), from x = 0, a row stopping once its residual
    is at the rounding level of its ``b``: the iteration of :func:`cg` (and of the reference
    interpreter's ``cg``) with the rows batched.  Out of place, so autograd runs through it."""
    x = torch.zeros_like(b)
    r, p = b, b
    rr = (b * b).sum(-1, keepdim=True)                               # [N, c, 1]
    stop = rr * torch.finfo(b.dtype).eps ** 2                        # the rounding level of b
    for _ in range(steps):
        active = ~(rr <= stop)                                       # (a NaN row stays active)
        if not bool(active.any()):                                   # every row converged
            break
        Ap = matvec(p)
        alpha = torch.where(active, rr, 0.0) / torch.where(active, (p * Ap).sum(-1, keepdim=True), 1.0)
        x = x + alpha * p
        r = r - alpha * Ap
        rr_new = (r * r).sum(-1, keepdim=True)
        p = r + torch.where(active, rr_new, 0.0) / torch.where(active, rr, 1.0) * p
        rr = torch.where(active, rr_new, rr)
    return x


class _ChunkCG(torch.autograd.Function):
    """``x_t`` = ``steps`` conjugate-gradient steps on ``x_t A_t = q_t`` for a group of chunks
    (:func:`_solve_matvec` applies ``A``): the spec's truncated solver.  Its function is not
    ``q_t A_t^-1``, so the exact solve's adjoint does not give its gradient; the backward
    differentiates the iterations themselves: it runs them again under autograd (the forward
    keeps none of its iterates: one group's at a time in the backward) and takes the
    vector-Jacobian product."""

    @staticmethod
    def forward(ctx, q, H0, k, W, a, lam, steps):
        with torch.no_grad():   # the same steps and stop as _cg_rows, in place
            x = _conjugate_gradients(lambda P: _solve_matvec(P, H0, k, W, a, lam), q, torch.finfo(q.dtype).eps,
                                     steps)
        ctx.save_for_backward(q, H0, k, W, a, *([lam] if torch.is_tensor(lam) else []))
        ctx.solver = (None if torch.is_tensor(lam) else lam, steps)
        return x

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        lam, steps = ctx.solver
        ins = [t.detach().requires_grad_(need) for t, need in zip(ctx.saved_tensors, ctx.needs_input_grad)]
        q, H0, k, W, a, *lam_t = ins
        with torch.enable_grad():
            x = _cg_rows(lambda P: _solve_matvec(P, H0, k, W, a, lam_t[0] if lam_t else lam), q, steps)
            wrt = [t for t in ins if t.requires_grad]
            grads = iter(torch.autograd.grad(x, wrt, g, allow_unused=True) if wrt else ())
        out = [next(grads) if t.requires_grad else None for t in ins]
        return (*out, *([] if lam_t else [None]), None)
