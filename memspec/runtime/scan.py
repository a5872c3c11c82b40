"""Exact chunked kernel of the scan family (elementwise linear recurrences), and its token-loop reference.

See :mod:`memspec.runtime` for the rules every kernel here follows (standalone, torch only,
float32 arithmetic, causal: no future value reaches an earlier output).
"""
from __future__ import annotations

import torch


def recurrent_scan(a, b, h0):
    """Token-loop reference for ``h_t = a_t * h_{t-1} + b_t`` (elementwise).

    Args:
        a: decays broadcastable to b (``[B, T, H, *S]``, or without the batch and time axes).
        b: ``[B, T, H, *S]`` increments.
        h0: ``[B, H, *S]`` initial state, or None for zeros.

    Returns:
        (every token's state ``[B, T, H, *S]``, h_T ``[B, H, *S]``).
    """
    dt = torch.promote_types(b.dtype, torch.float32)
    a = a.to(dt).expand(b.shape)
    h = b.new_zeros(b.shape[:1] + b.shape[2:], dtype=dt) if h0 is None else h0.to(dt)
    states = []
    for t in range(b.shape[1]):
        h = a[:, t] * h + b[:, t].to(dt)
        states.append(h)
    hs = torch.stack(states, dim=1) if states else b.new_zeros(b.shape, dtype=dt)
    return hs.to(b.dtype), h.to(h0.dtype if h0 is not None else b.dtype)


def chunk_scan(a, b, h0, chunk):
    """Exact chunked form of ``h_t = a_t * h_{t-1} + b_t`` (elementwise, any state shape ``S``).

    The T tokens are cut into N chunks of C (the last one padded with tokens ``a = 1, b = 0``,
    which follow every real token and change nothing).  All chunks run at once:

    * pass 1, within each chunk from a zero state: ``u_i = a_i * u_{i-1} + b_i`` and the
      chunk's decay ``P_i = P_{i-1} a_i`` for i = 1..C, C elementwise steps over every chunk
      ``[B, N, H, *S]``, keeping only the last (nothing of size T is written);
    * one carry per chunk, its end state: ``c_j = P_C(j) * c_{j-1} + u_C(j)`` from ``c_0 = h0``
      -- a recurrence of this form over N tokens, so it runs through this function again
      (about log_C(T) levels);
    * pass 2, every chunk from its start state ``c_{j-1}``: ``h_i = a_i * h_{i-1} + b_i``, the
      token loop's own step, C steps over every chunk; their states are the output.

    Work is O(T |S|) (three products per token and entry), memory the output and O(T |S| / C).  Only products of decays enter (no division, no log), so a
    decay of any sign, of exp(-40) per token or exactly 0 is exact (equal to the token loop up
    to rounding), and nothing overflows that the loop does not.  A non-finite input at token t
    reaches only the states from t on.  Gradients are plain autograd of the same steps (no
    in-place writes: ``torch.func`` works).

    Args:
        a: decays, broadcastable to b: ``[B, T, H, *S]`` or with size-1 axes (a scalar per
            token ``[B, T, H, 1, ...]``, one per row ``[..., d, 1]``), or without the batch and
            time axes (a learned decay ``[H, *S]``).
        b: ``[B, T, H, *S]`` increments.
        h0: ``[B, H, *S]`` initial state, or None for zeros.
        chunk: chunk size C (>= 2 for the levels to shrink; 1 is read as 2).

    Returns:
        (every token's state ``[B, T, H, *S]``, h_T ``[B, H, *S]``); T = 0 gives an empty
        sequence and h0.
    """
    B, T = b.shape[:2]
    rest = b.shape[2:]                                               # [H, *S]
    dt = torch.promote_types(b.dtype, torch.float32)
    h = b.new_zeros((B,) + rest, dtype=dt) if h0 is None else h0.to(dt)
    out_dtype = h0.dtype if h0 is not None else b.dtype
    if T == 0:
        return b.new_zeros(b.shape), h.to(out_dtype)
    C = max(2, min(int(chunk), T)) if T > 1 else 1
    N = -(-T // C)
    pad = N * C - T
    a = a.to(dt).expand(b.shape)
    b = b.to(dt)
    if pad:                                                          # tail tokens a = 1, b = 0
        a = torch.cat([a, a.new_ones((B, pad) + rest)], dim=1)
        b = torch.cat([b, b.new_zeros((B, pad) + rest)], dim=1)
    # [B, N, H, *S] per position, every chunk at once (unbind: one stack of their gradients, not C
    # zero-filled copies of the whole input as slices would give)
    a = a.reshape((B, N, C) + rest).unbind(2)
    b = b.reshape((B, N, C) + rest).unbind(2)
    u, P = b[0], a[0]
    for i in range(1, C):                                            # pass 1: each chunk from zero
        u = torch.addcmul(b[i], a[i], u)
        P = P * a[i]
    if N > 1:                                                        # the chunks' end states, by the same scan
        ends, h_end = chunk_scan(P, u, h, chunk)                     # [B, N, H, *S]
        x = torch.cat([h.unsqueeze(1), ends[:, :-1]], dim=1)         # chunk-start states
    else:
        x, h_end = h.unsqueeze(1), torch.addcmul(u[:, 0], P[:, 0], h)
    states = []
    for i in range(C):                                               # pass 2: each chunk from its start state
        x = torch.addcmul(b[i], a[i], x)
        states.append(x)
    hs = torch.stack(states, dim=2).reshape((B, N * C) + rest)       # [B, T (+ pad), H, *S]
    return (hs[:, :T] if pad else hs).to(out_dtype), h_end.to(out_dtype)


def chunk_scan_read(coefficients, read, xs, ys, h0, chunk, inclusive=True):
    """The scan fused with its read: ``h_t = a_t * h_{t-1} + b_t`` for one or several states
    (elementwise), ``o_t = read(h_t, y_t)``, with ``a_t, b_t`` computed from the token's inputs
    ``x_t`` when needed -- no tensor of T states, decays or increments is ever formed.

    The first ``N = T // C`` chunks run as :func:`chunk_scan` does -- pass 1 computes every
    chunk's end state from zero and its decay (C steps, each over every chunk), the carries run
    through :func:`chunk_scan` one level up, pass 2 runs every chunk from its start state and
    reads each state as it is made -- but ``coefficients`` is called on one position of every
    chunk (inputs ``[B, N, H, ...]``) in both passes.  The last ``T - N C`` tokens follow one by
    one.  Work is O(T |S|), memory (besides autograd's) the outputs and O(N |S|).  The same
    exactness and causality as :func:`chunk_scan`; plain autograd.

    From 8,192 floats of state per token (B H |S|, all states) on, every token follows one by one:
    a step of the chunked passes then covers N chunks' states, which leave the cache, while one
    token's state stays in it (1 thread, T = 2048, H = 4: Mamba-1's ``[16, 64]`` state per head ran
    1.8x faster chunked than token by token; a ``[64, 64]`` state 2x slower at chunk 64, 1.4x at 256).

    Args:
        coefficients: ``f(*x) -> ((a, b), ...)``, one pair per state, for inputs ``x`` with any
            leading axes ``[..., H, ...]``; ``a`` broadcastable to ``b``, ``b`` the state's shape.
        read: ``f(*states, *y) -> o``, the read of the states with the same leading axes.
        xs, ys: the token-local inputs ``[B, T, H, ...]`` of ``coefficients`` and of ``read``
            (together at least one).
        h0: the initial states ``[B, H, *S_i]`` (a tuple, one per state).
        chunk: chunk size C.
        inclusive: True: ``o_t`` reads the states after token t's write; False: before it.

    Returns:
        (o ``[B, T, H, ...]``, the final states as a tuple).
    """
    B, T = (tuple(xs) + tuple(ys))[0].shape[:2]
    nx = len(xs)
    xs = tuple(xs) + tuple(ys)                                       # sliced together, split at nx
    dt = torch.promote_types(h0[0].dtype, torch.float32)
    hs = [h.to(dt) for h in h0]
    C = max(2, min(int(chunk), T)) if T > 1 else 1
    N = T // C if B * sum(h[0].numel() for h in hs) < 8192 else 0    # 8,192 floats a token on: token by token
    outs = []
    if N:
        # one position of every chunk [B, N, H, ...] (unbind: one stack of their gradients)
        xc = [x[:, :N * C].reshape((B, N, C) + x.shape[2:]).unbind(2) for x in xs]
        us, Ps = None, None
        for i in range(C):                                           # pass 1: each chunk from zero
            pairs = coefficients(*[x[i] for x in xc[:nx]])
            if i == 0:
                us, Ps = [b.to(dt) for _, b in pairs], [a.to(dt) for a, _ in pairs]
            else:
                us = [torch.addcmul(b, a, u) for (a, b), u in zip(pairs, us)]
                Ps = [P * a for (a, _), P in zip(pairs, Ps)]
        if N > 1:                                                    # the chunks' end states, by the scan
            carried = [chunk_scan(P.expand(u.shape), u, h, chunk) for P, u, h in zip(Ps, us, hs)]
            starts = [torch.cat([h.unsqueeze(1), ends[:, :-1]], dim=1) for h, (ends, _) in zip(hs, carried)]
            hs = [h_end for _, h_end in carried]
        else:
            starts = [h.unsqueeze(1) for h in hs]                    # [B, 1, H, *S]
            hs = [torch.addcmul(u[:, 0], P[:, 0], h) for P, u, h in zip(Ps, us, hs)]
        for i in range(C):                                           # pass 2: from every chunk's start state
            x = [x[i] for x in xc]
            if not inclusive:
                outs.append(read(*starts, *x[nx:]))
            starts = [torch.addcmul(b, a, s) for (a, b), s in zip(coefficients(*x[:nx]), starts)]
            if inclusive:
                outs.append(read(*starts, *x[nx:]))
        o = torch.stack(outs, dim=2)                                 # [B, N, C, H, ...]
        outs = [o.reshape((B, N * C) + o.shape[3:])]
    tail = []
    for x in (zip(*[x[:, N * C:].unbind(1) for x in xs]) if T > N * C else ()):   # the tail, token by token
        if not inclusive:                                            # (x: the token's inputs [B, H, ...])
            tail.append(read(*hs, *x[nx:]))
        hs = [torch.addcmul(b, a, h) for (a, b), h in zip(coefficients(*x[:nx]), hs)]
        if inclusive:
            tail.append(read(*hs, *x[nx:]))
    if tail:
        outs.append(torch.stack(tail, dim=1))
    if not outs:                                                     # T = 0: an empty read
        outs = [read(*[h.unsqueeze(1)[:, :0] for h in hs], *[x[:, :0] for x in xs[nx:]])]
    o = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    return o, tuple(h.to(h0_.dtype) for h, h0_ in zip(hs, h0))
