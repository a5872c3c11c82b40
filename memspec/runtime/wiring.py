"""Wiring a memory layer into a network with attention (Titans §4, seed text §5.3).

Three wirings wrap any *Layer-like* module ``layer(x, state=None, return_state=True)
-> (y, state)`` (x, y ``[B, T, d_model]``, state a dict of ``[B, ...]`` tensors or
``None`` for the initial state; the compiled ``<Name>Layer`` is one):

* :class:`MAC` (memory as context), per segment of ``segment`` tokens: the segment's
  tokens **retrieve** from the memory left by earlier segments, attention runs over
  ``[persistent | retrieved | segment]`` (causal inside the segment), the attention
  output ``y`` is what the memory then **writes**, and the output is
  ``y * sigmoid(M(y))`` (Titans Eq. 25, ``o = y ⊗ M*(y)``).  Order: retrieve ->
  attend -> update.  Options: write the segment input instead, add instead of gate.
* :class:`MAG` (memory as gate): sliding-window attention and the memory read the
  same input and are mixed: ``o = RMSNorm(y) * sigmoid(RMSNorm(m))`` (Titans Eq. 28,
  the default) or the convex ``o = g * y + (1 - g) * m`` with a learned gate ``g``.
* :class:`MAL` (memory as layer): the memory layer, then sliding-window attention,
  with a residual around the attention, ``o = M(x) + SWA(M(x))`` (the default), or
  without, ``o = SWA(M(x))``.

Every option's default is the paper's form (for MAL: the paper's layers with their
residual connection); ``OPTIONS`` lists each kind's own.

Persistent memory is ``P`` learned tokens ``[P, d_model]`` shared across sequences;
their keys and values are visible to every query (they never leave the window).
Attention is ``torch.nn.functional.scaled_dot_product_attention`` with an explicit
boolean mask (True = may attend), by default on l2-normalised queries and keys with a
learned per-head temperature (``qk_norm``, :class:`Attention`).  There are no
positional encodings: order comes from the causal masks and from the memory.

Packed documents: every wiring's ``forward`` takes ``cu_seqlens`` (B = 1, int offsets
``[N + 1]``): each document runs alone from the initial state (:func:`each_document`), so that
no segment, attention window or memory state crosses a document.

Streaming: every wiring's ``forward(x, state=None, return_state=False)`` carries the
memory state and the attention's keys/values (the last ``window - 1`` tokens for
sliding windows; for MAC the current segment's retrieved and token keys/values and
the memory state at the segment start).  One call over T tokens equals several calls
with carried state, split anywhere (as long as the memory layer streams exactly).

This module imports only torch, and the classes reference nothing else in memspec,
so that the code generator can copy them into standalone files: :func:`source`
returns their source in dependency order.
"""
from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F


def each_document(run, x: torch.Tensor, cu_seqlens: torch.Tensor, state=None,
                  return_state: bool = False):
    """Packed documents ``x [1, T, d_model]`` at offsets ``cu_seqlens [N + 1]`` through ``run(x)``
    (a wiring's own forward), each alone from the initial state: the documents of one length as one
    batch ``[n, length, d_model]``.  Returns ``[1, T, d_model]``.  A packed call neither starts from
    a state nor returns one (the wirings' states are per batch row, not per document)."""
    if state is not None or return_state:
        raise ValueError("cu_seqlens: a wired layer runs each packed document from the initial "
                         "state and returns no state; pass state=None, return_state=False (or "
                         "run the documents as a batch)")
    offsets = [int(t) for t in cu_seqlens.tolist()]
    if (x.shape[0] != 1 or offsets[0] != 0 or offsets[-1] != x.shape[1]
            or any(b < a for a, b in zip(offsets, offsets[1:]))):
        raise ValueError(f"cu_seqlens: expected one row (B = 1) and offsets rising from 0 to "
                         f"T = {x.shape[1]}, got B = {x.shape[0]} and {offsets}")
    by_length = {}
    for a, b in zip(offsets, offsets[1:]):
        by_length.setdefault(b - a, []).append(a)
    y = x.new_zeros(0, x.shape[-1])
    order = []
    for length, starts in by_length.items():
        tokens = torch.tensor([a + t for a in starts for t in range(length)], dtype=torch.long,
                              device=x.device)
        out = run(x[0].index_select(0, tokens).view(len(starts), length, x.shape[-1]))
        y = torch.cat([y, out.reshape(-1, x.shape[-1])])
        order.append(tokens)
    order = torch.cat(order) if order else torch.zeros(0, dtype=torch.long, device=x.device)
    return y.index_select(0, torch.argsort(order)).unsqueeze(0)


class Attention(nn.Module):
    """Multi-head softmax attention with ``persistent`` learned tokens always visible.

    ``project_kv(x)`` turns tokens ``[B, n, d_model]`` into keys and values
    ``[B, heads, n, d_head]``; ``forward(x_q, k, v, mask)`` attends from the queries of
    ``x_q`` ``[B, T, d_model]`` to ``[persistent | k]`` with ``mask`` ``[T, n]`` (bool,
    True = may attend) for the non-persistent keys, and returns ``[B, T, d_model]``.

    ``qk_norm=True`` (the default) l2-normalises queries and keys and scales their
    cosine by a learned per-head gain times ``sqrt(d_head)`` (``qk_gain`` ``[heads]``,
    initialised to 1): at initialisation the scores of RMS-normalised queries and keys
    under the usual ``1 / sqrt(d_head)``, with the temperature learned (query-key
    normalisation: Henry et al. 2020; RMSNorm on q and k in OLMo 2 and Gemma 3).
    ``qk_norm=False`` is plain scaled dot-product attention, ``softmax(q k^T /
    sqrt(d_head)) v`` (Vaswani et al. 2017).
    """

    def __init__(self, d_model: int, heads: int = 1, persistent: int = 0, qk_norm: bool = True):
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model={d_model} is not divisible by heads={heads}")
        self.d_model, self.heads, self.n_persistent = d_model, heads, persistent
        self.qk_norm = qk_norm
        self.wq = nn.Linear(d_model, d_model, bias=False)
        self.wk = nn.Linear(d_model, d_model, bias=False)
        self.wv = nn.Linear(d_model, d_model, bias=False)
        self.wo = nn.Linear(d_model, d_model, bias=False)
        self.persistent = nn.Parameter(torch.randn(persistent, d_model) * 0.02)  # [P, d_model]
        if qk_norm:
            self.qk_gain = nn.Parameter(torch.ones(heads))                          # [heads]

    def split(self, x: torch.Tensor) -> torch.Tensor:
        B, n, _ = x.shape
        return x.view(B, n, self.heads, self.d_model // self.heads).transpose(1, 2)  # [B, h, n, dh]

    def project_kv(self, x: torch.Tensor):
        k = self.split(self.wk(x))                                    # [B, h, n, dh]
        if self.qk_norm:
            k = F.normalize(k, dim=-1)
        return k, self.split(self.wv(x))

    def forward(self, x_q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        B, T, _ = x_q.shape
        q = self.split(self.wq(x_q))                                  # [B, h, T, dh]
        scale = None                                                  # SDPA's default, 1 / sqrt(dh)
        if self.qk_norm:
            q = F.normalize(q, dim=-1) * self.qk_gain.view(-1, 1, 1)  # the learned temperature
            scale = (self.d_model // self.heads) ** 0.5               # cosine * gain * sqrt(dh)
        if self.n_persistent:
            pk, pv = self.project_kv(self.persistent.unsqueeze(0))    # [1, h, P, dh]
            k = torch.cat([pk.expand(B, -1, -1, -1), k], dim=2)
            v = torch.cat([pv.expand(B, -1, -1, -1), v], dim=2)
            always = torch.ones(T, self.n_persistent, dtype=torch.bool, device=mask.device)
            mask = torch.cat([always, mask], dim=1)
        # a non-finite key or value reaches only the outputs that attend to it (a masked weight
        # times a future nan would be nan): zeroed by where, and the outputs that see one are nan
        bad = ~torch.isfinite(k.sum(-1) + v.sum(-1))                  # [B, h, n]
        zero = torch.zeros((), dtype=v.dtype, device=v.device)
        k, v = torch.where(bad.unsqueeze(-1), zero, k), torch.where(bad.unsqueeze(-1), zero, v)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # [B, h, T, dh]
        reached = (bad.to(o.dtype) @ mask.T.to(o.dtype)) > 0           # [B, h, T]
        o = torch.where(reached.unsqueeze(-1), torch.full_like(zero, float("nan")), o)
        return self.wo(o.transpose(1, 2).reshape(B, T, self.d_model))


class SlidingWindowAttention(Attention):
    """Causal attention over the last ``window`` tokens (itself included) and the persistent tokens.

    ``forward(x, state=None) -> (y, state)`` with x, y ``[B, T, d_model]``; state
    ``{"k", "v"}`` ``[B, heads, n, d_head]`` holds the keys/values of the last
    ``min(window - 1, seen)`` tokens.
    """

    def __init__(self, d_model: int, heads: int = 1, window: int = 64, persistent: int = 0,
                 qk_norm: bool = True):
        super().__init__(d_model, heads, persistent, qk_norm)
        if window < 1:
            raise ValueError("window must be >= 1")
        self.window = window

    def forward(self, x: torch.Tensor, state=None):
        B, T, _ = x.shape
        k, v = self.project_kv(x)                                     # [B, h, T, dh]
        if state is not None:
            k = torch.cat([state["k"], k], dim=2)
            v = torch.cat([state["v"], v], dim=2)
        n = k.shape[2] - T                                            # past tokens carried
        q_pos = torch.arange(T, device=x.device).unsqueeze(1) + n     # [T, 1]
        k_pos = torch.arange(n + T, device=x.device).unsqueeze(0)     # [1, n + T]
        mask = (k_pos <= q_pos) & (q_pos - k_pos < self.window)      # [T, n + T]
        y = super().forward(x, k, v, mask)
        keep = self.window - 1
        new_state = {"k": k[:, :, k.shape[2] - min(keep, k.shape[2]):],
                     "v": v[:, :, v.shape[2] - min(keep, v.shape[2]):]}
        return y, new_state


class MAC(nn.Module):
    """Memory as context (Titans §4.1), segment by segment: retrieve -> attend -> update.

    For a segment S (tokens ``[B, L, d_model]``) with memory state ``M`` left by the
    earlier segments:

    1. retrieve ``h = M(S)``: every token of S reads ``M`` (the state at the segment
       start), never a write made from S: through the layer's read-only call
       ``layer.read(x, state)`` when it has one (compiled Layers do); otherwise each
       token is run through the memory layer alone from ``M`` (the segment folded into
       the batch), so that a ``write_read`` memory's retrieval also sees the token's own
       transient write, never another token's;
    2. attend: queries of S over ``[persistent | h | S]``, causal inside the segment
       (token i sees ``h_j`` and ``S_j`` for j <= i), giving ``y``;
    3. update: the memory layer runs over ``y`` from ``M`` (token by token inside the
       layer, so token i reads the state after the writes of y_1..y_i), giving ``m``
       and the state handed to the next segment;
    4. output ``y * sigmoid(m)``.

    Options (the paper's form is the default): ``write="input"`` writes the segment's
    tokens S instead of ``y`` in step 3 (``m = M(S)``); ``output="additive"`` returns
    ``y + m`` instead of ``y * sigmoid(m)`` in step 4.  ``qk_norm`` is the attention's
    (:class:`Attention`).

    ``forward(x, state=None, return_state=False)``; the state carries the memory
    state now (``mem``), at the segment start (``start``), and the keys/values of the
    current segment's tokens so far (``hk, hv, xk, xv`` ``[B, heads, n, d_head]``).
    """

    def __init__(self, layer: nn.Module, d_model: int, *, segment: int = 64, persistent: int = 4,
                 heads: int = 1, qk_norm: bool = True, write: str = "attention",
                 output: str = "gated"):
        super().__init__()
        if segment < 1:
            raise ValueError("segment must be >= 1")
        if write not in ("attention", "input"):
            raise ValueError(f"write must be 'attention' or 'input', got {write!r}")
        if output not in ("gated", "additive"):
            raise ValueError(f"output must be 'gated' or 'additive', got {output!r}")
        self.layer = layer
        self.segment = segment
        self.write, self.output = write, output
        self.attn = Attention(d_model, heads, persistent, qk_norm)

    @staticmethod
    def _repeat_state(state, times: int):
        if state is None:
            return None
        if isinstance(state, torch.Tensor):
            return state.repeat_interleave(times, dim=0) if state.dim() else state
        if isinstance(state, dict):
            return {key: MAC._repeat_state(val, times) for key, val in state.items()}
        if isinstance(state, (list, tuple)):
            return type(state)(MAC._repeat_state(val, times) for val in state)
        return state

    def retrieve(self, x: torch.Tensor, start) -> torch.Tensor:
        """Read the memory state ``start`` (None = initial) with every token of x ``[B, L, D]``.

        A layer with a read-only call ``layer.read(x, state)`` (every compiled Layer whose
        read needs only views and state) is read with it; any other layer runs each token
        alone from ``start`` (the segment folded into the batch)."""
        read = getattr(self.layer, "read", None)
        if read is not None:
            return read(x, start)
        B, L, D = x.shape
        folded = x.reshape(B * L, 1, D)                                # one token per batch row
        h, _ = self.layer(folded, state=self._repeat_state(start, L), return_state=True)
        return h.reshape(B, L, D)

    def update(self, y: torch.Tensor, mem):
        """Write ``y`` ``[B, L, D]`` into the memory; returns (reads ``[B, L, D]``, new state)."""
        return self.layer(y, state=mem, return_state=True)

    def _segment_piece(self, x: torch.Tensor, st: dict):
        """Tokens x ``[B, L, D]`` that all fall in the current segment (after ``n`` earlier)."""
        L = x.shape[1]
        h = self.retrieve(x, st["start"])                              # 1. retrieve (segment start)
        hk, hv = self.attn.project_kv(h)                               # [B, h, L, dh]
        xk, xv = self.attn.project_kv(x)
        if st["hk"] is not None:
            hk, hv = torch.cat([st["hk"], hk], 2), torch.cat([st["hv"], hv], 2)
            xk, xv = torch.cat([st["xk"], xk], 2), torch.cat([st["xv"], xv], 2)
        n = hk.shape[2] - L
        causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
        past = torch.ones(L, n, dtype=torch.bool, device=x.device)
        mask = torch.cat([past, causal, past, causal], dim=1)          # [L, 2 (n + L)]
        y = self.attn(x, torch.cat([hk, xk], 2), torch.cat([hv, xv], 2), mask)  # 2. attend
        m, mem = self.update(y if self.write == "attention" else x, st["mem"])  # 3. update
        out = y * torch.sigmoid(m) if self.output == "gated" else y + m          # 4. y ⊗ M(y)
        if n + L == self.segment:                                      # segment complete
            st = {"mem": mem, "start": mem, "hk": None, "hv": None, "xk": None, "xv": None}
        else:
            st = {"mem": mem, "start": st["start"], "hk": hk, "hv": hv, "xk": xk, "xv": xv}
        return out, st

    def forward(self, x: torch.Tensor, state=None, return_state: bool = False, cu_seqlens=None):
        if cu_seqlens is not None:   # packed documents: each alone (segments and windows restart)
            return each_document(self.forward, x, cu_seqlens, state, return_state)
        B, T, _ = x.shape
        st = state if state is not None else {"mem": None, "start": None,
                                              "hk": None, "hv": None, "xk": None, "xv": None}
        outs, t = [], 0
        while t < T:
            n = 0 if st["hk"] is None else st["hk"].shape[2]
            L = min(self.segment - n, T - t)
            out, st = self._segment_piece(x[:, t:t + L], st)
            outs.append(out)
            t += L
        y = torch.cat(outs, dim=1) if outs else x[:, :0]
        return (y, st) if return_state else y


class MAG(nn.Module):
    """Memory as gate (Titans §4.2): sliding-window attention ``y = SWA(x)`` and the memory
    ``m = M(x)`` read the same input and are mixed.

    ``gate="normalized"`` (the paper's Eq. 28, ``o = y ⊗ M(x)``, with "the outputs y and
    M(x) normalised using learnable vector-valued weights, followed by a non-linearity"):
    ``o = RMSNorm(y) * sigmoid(RMSNorm(m))``, two RMSNorms with learned weights
    ``[d_model]``, the non-linear gate the same as MAC's ``y * sigmoid(m)``.
    ``gate="convex"``: ``o = g * y + (1 - g) * m`` with ``g = sigmoid(x W_g + b)`` per channel.

    ``forward(x, state=None, return_state=False)``; state ``{"mem", "attn"}``.
    """

    def __init__(self, layer: nn.Module, d_model: int, *, window: int = 64, persistent: int = 4,
                 heads: int = 1, qk_norm: bool = True, gate: str = "normalized"):
        super().__init__()
        if gate not in ("normalized", "convex"):
            raise ValueError(f"gate must be 'normalized' or 'convex', got {gate!r}")
        self.layer = layer
        self.attn = SlidingWindowAttention(d_model, heads, window, persistent, qk_norm)
        self.gate_form = gate
        if gate == "normalized":
            self.norm_attn = nn.RMSNorm(d_model)
            self.norm_mem = nn.RMSNorm(d_model)
        else:
            self.gate = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor, state=None, return_state: bool = False, cu_seqlens=None):
        if cu_seqlens is not None:   # packed documents: each alone (segments and windows restart)
            return each_document(self.forward, x, cu_seqlens, state, return_state)
        st = state if state is not None else {"mem": None, "attn": None}
        y, attn_state = self.attn(x, st["attn"])
        m, mem = self.layer(x, state=st["mem"], return_state=True)
        if self.gate_form == "normalized":
            out = self.norm_attn(y) * torch.sigmoid(self.norm_mem(m))
        else:
            g = torch.sigmoid(self.gate(x))
            out = g * y + (1 - g) * m
        new = {"mem": mem, "attn": attn_state}
        return (out, new) if return_state else out


class MAL(nn.Module):
    """Memory as layer (Titans §4.3): the memory layer, then sliding-window attention.

    ``residual=True`` (the default): ``o = M(x) + SWA(M(x))``, the residual connection
    around the attention layer that the paper's stacked layers have (its MAL follows
    Samba, where every layer sits in a residual block); ``residual=False``: the bare
    composition ``o = SWA(M(x))``, in which the memory's read reaches the output only
    through an attention that starts out uniform over its window.

    ``forward(x, state=None, return_state=False)``; state ``{"mem", "attn"}``.
    """

    def __init__(self, layer: nn.Module, d_model: int, *, window: int = 64, persistent: int = 4,
                 heads: int = 1, qk_norm: bool = True, residual: bool = True):
        super().__init__()
        self.layer = layer
        self.attn = SlidingWindowAttention(d_model, heads, window, persistent, qk_norm)
        self.residual = residual

    def forward(self, x: torch.Tensor, state=None, return_state: bool = False, cu_seqlens=None):
        if cu_seqlens is not None:   # packed documents: each alone (segments and windows restart)
            return each_document(self.forward, x, cu_seqlens, state, return_state)
        st = state if state is not None else {"mem": None, "attn": None}
        m, mem = self.layer(x, state=st["mem"], return_state=True)
        y, attn_state = self.attn(m, st["attn"])
        out = m + y if self.residual else y
        new = {"mem": mem, "attn": attn_state}
        return (out, new) if return_state else out


WIRINGS = {"mac": MAC, "mag": MAG, "mal": MAL}


OPTIONS = {"mac": ("write", "output"), "mag": ("gate",), "mal": ("residual",)}


def wrap(layer: nn.Module, kind: str, d_model: int, *, segment: int = 64, window: int = 64,
         persistent: int = 4, heads: int = 1, qk_norm: bool = True, **options) -> nn.Module:
    """``layer`` wired by ``kind`` (``"none"`` returns it unchanged); ``options`` are the
    kind's own (:data:`OPTIONS`: MAC ``write``, ``output``; MAG ``gate``; MAL ``residual``)."""
    if kind == "none":
        return layer
    if kind not in WIRINGS:
        raise ValueError(f"unknown wiring {kind!r}: use none, mac, mag or mal")
    unknown = sorted(set(options) - set(OPTIONS[kind]))
    if unknown:
        raise ValueError(f"{kind} has no option {', '.join(unknown)}: its options are "
                         f"{', '.join(OPTIONS[kind])} (and qk_norm)")
    if kind == "mac":
        return MAC(layer, d_model, segment=segment, persistent=persistent, heads=heads,
                   qk_norm=qk_norm, **options)
    return WIRINGS[kind](layer, d_model, window=window, persistent=persistent, heads=heads,
                         qk_norm=qk_norm, **options)


def source(kind: str | None = None) -> str:
    """The source of the wiring classes (and :func:`each_document`), in dependency order, for copying
    into generated files.

    ``kind`` (``"mac"``, ``"mag"`` or ``"mal"``) keeps only the classes that wiring needs;
    ``None`` gives all of them."""
    import inspect

    needs = {None: (each_document, Attention, SlidingWindowAttention, MAC, MAG, MAL),
             "mac": (each_document, Attention, MAC),
             "mag": (each_document, Attention, SlidingWindowAttention, MAG),
             "mal": (each_document, Attention, SlidingWindowAttention, MAL)}
    if kind not in needs:
        raise ValueError(f"unknown wiring {kind!r}: use mac, mag or mal")
    return "\n\n".join(inspect.getsource(c) for c in needs[kind])
