"""Wiring a memory layer into a network with attention (Titans §4, seed text §5.3).

Three wirings wrap any *Layer-like* module ``layer(x, state=None, return_state=True)
-> (y, state)`` (x, y ``[B, T, d_model]``, state a dict of ``[B, ...]`` tensors or
``None`` for the initial state; the compiled ``<Name>Layer`` is one):

* :class:`MAC` (memory as context), per segment of ``segment`` tokens: the segment's
  tokens **retrieve** from the memory left by earlier segments, attention runs over
  ``[persistent | retrieved | segment]`` (causal inside the segment), the attention
  output ``y`` is what the memory then **writes**, and the output is
  ``y * sigmoid(M(y))`` (Titans Eq. 25, ``o = y ⊗ M*(y)``).  Order: retrieve ->
  attend -> update.
* :class:`MAG` (memory as gate): sliding-window attention and the memory read the
  same input; a learned gate mixes them, ``o = g * attn + (1 - g) * memory``.
* :class:`MAL` (memory as layer): the memory layer, then sliding-window attention.

Persistent memory is ``P`` learned tokens ``[P, d_model]`` shared across sequences;
their keys and values are visible to every query (they never leave the window).
Attention is ``torch.nn.functional.scaled_dot_product_attention`` with an explicit
boolean mask (True = may attend).  There are no positional encodings: order comes
from the causal masks and from the memory.

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


class Attention(nn.Module):
    """Multi-head softmax attention with ``persistent`` learned tokens always visible.

    ``project_kv(x)`` turns tokens ``[B, n, d_model]`` into keys and values
    ``[B, heads, n, d_head]``; ``forward(x_q, k, v, mask)`` attends from the queries of
    ``x_q`` ``[B, T, d_model]`` to ``[persistent | k]`` with ``mask`` ``[T, n]`` (bool,
    True = may attend) for the non-persistent keys, and returns ``[B, T, d_model]``.
    """

    def __init__(self, d_model: int, heads: int = 1, persistent: int = 0):
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model={d_model} is not divisible by heads={heads}")
        self.d_model, self.heads, self.n_persistent = d_model, heads, persistent
        self.wq = nn.Linear(d_model, d_model, bias=False)
        self.wk = nn.Linear(d_model, d_model, bias=False)
        self.wv = nn.Linear(d_model, d_model, bias=False)
        self.wo = nn.Linear(d_model, d_model, bias=False)
        self.persistent = nn.Parameter(torch.randn(persistent, d_model) * 0.02)  # [P, d_model]

    def split(self, x: torch.Tensor) -> torch.Tensor:
        B, n, _ = x.shape
        return x.view(B, n, self.heads, self.d_model // self.heads).transpose(1, 2)  # [B, h, n, dh]

    def project_kv(self, x: torch.Tensor):
        return self.split(self.wk(x)), self.split(self.wv(x))

    def forward(self, x_q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        B, T, _ = x_q.shape
        q = self.split(self.wq(x_q))                                  # [B, h, T, dh]
        if self.n_persistent:
            pk, pv = self.project_kv(self.persistent.unsqueeze(0))    # [1, h, P, dh]
            k = torch.cat([pk.expand(B, -1, -1, -1), k], dim=2)
            v = torch.cat([pv.expand(B, -1, -1, -1), v], dim=2)
            always = torch.ones(T, self.n_persistent, dtype=torch.bool, device=mask.device)
            mask = torch.cat([always, mask], dim=1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, h, T, dh]
        return self.wo(o.transpose(1, 2).reshape(B, T, self.d_model))


class SlidingWindowAttention(Attention):
    """Causal attention over the last ``window`` tokens (itself included) and the persistent tokens.

    ``forward(x, state=None) -> (y, state)`` with x, y ``[B, T, d_model]``; state
    ``{"k", "v"}`` ``[B, heads, n, d_head]`` holds the keys/values of the last
    ``min(window - 1, seen)`` tokens.
    """

    def __init__(self, d_model: int, heads: int = 1, window: int = 64, persistent: int = 0):
        super().__init__(d_model, heads, persistent)
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

    ``forward(x, state=None, return_state=False)``; the state carries the memory
    state now (``mem``), at the segment start (``start``), and the keys/values of the
    current segment's tokens so far (``hk, hv, xk, xv`` ``[B, heads, n, d_head]``).
    """

    def __init__(self, layer: nn.Module, d_model: int, *, segment: int = 64, persistent: int = 4,
                 heads: int = 1):
        super().__init__()
        if segment < 1:
            raise ValueError("segment must be >= 1")
        self.layer = layer
        self.segment = segment
        self.attn = Attention(d_model, heads, persistent)

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
        """Write the attention outputs into the memory; returns (reads ``[B, L, D]``, new state)."""
        return self.layer(y, state=mem, return_state=True)

    def _segment_piece(self, x: torch.Tensor, st: dict):
        """Tokens x ``[B, L, D]`` that all fall in the current segment (after ``n`` earlier
        ones)."""
        L = x.shape[1]
        h = self.retrieve(x, st["start"])                  # 1. retrieve (pre-segment state)
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
        m, mem = self.update(y, st["mem"])                             # 3. update with y
        out = y * torch.sigmoid(m)                                     # 4. y ⊗ M(y)
        if n + L == self.segment:                                      # segment complete
            st = {"mem": mem, "start": mem, "hk": None, "hv": None, "xk": None, "xv": None}
        else:
            st = {"mem": mem, "start": st["start"], "hk": hk, "hv": hv, "xk": xk, "xv": xv}
        return out, st

    def forward(self, x: torch.Tensor, state=None, return_state: bool = False):
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
    """Memory as gate (Titans §4.2): ``o = g * SWA(x) + (1 - g) * M(x)``,
    ``g = sigmoid(x W_g + b)``.

    ``forward(x, state=None, return_state=False)``; state ``{"mem", "attn"}``.
    """

    def __init__(self, layer: nn.Module, d_model: int, *, window: int = 64, persistent: int = 4,
                 heads: int = 1):
        super().__init__()
        self.layer = layer
        self.attn = SlidingWindowAttention(d_model, heads, window, persistent)
        self.gate = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor, state=None, return_state: bool = False):
        st = state if state is not None else {"mem": None, "attn": None}
        y, attn_state = self.attn(x, st["attn"])
        m, mem = self.layer(x, state=st["mem"], return_state=True)
        g = torch.sigmoid(self.gate(x))
        out = g * y + (1 - g) * m
        new = {"mem": mem, "attn": attn_state}
        return (out, new) if return_state else out


class MAL(nn.Module):
    """Memory as layer (Titans §4.3): ``o = SWA(M(x))``.

    ``forward(x, state=None, return_state=False)``; state ``{"mem", "attn"}``.
    """

    def __init__(self, layer: nn.Module, d_model: int, *, window: int = 64, persistent: int = 4,
                 heads: int = 1):
        super().__init__()
        self.layer = layer
        self.attn = SlidingWindowAttention(d_model, heads, window, persistent)

    def forward(self, x: torch.Tensor, state=None, return_state: bool = False):
        st = state if state is not None else {"mem": None, "attn": None}
        m, mem = self.layer(x, state=st["mem"], return_state=True)
        y, attn_state = self.attn(m, st["attn"])
        new = {"mem": mem, "attn": attn_state}
        return (y, new) if return_state else y


WIRINGS = {"mac": MAC, "mag": MAG, "mal": MAL}


def wrap(layer: nn.Module, kind: str, d_model: int, *, segment: int = 64, window: int = 64,
         persistent: int = 4, heads: int = 1) -> nn.Module:
    """``layer`` wired by ``kind`` (``"none"`` returns it unchanged)."""
    if kind == "none":
        return layer
    if kind == "mac":
        return MAC(layer, d_model, segment=segment, persistent=persistent, heads=heads)
    if kind in ("mag", "mal"):
        return WIRINGS[kind](layer, d_model, window=window, persistent=persistent, heads=heads)
    raise ValueError(f"unknown wiring {kind!r}: use none, mac, mag or mal")


def source(kind: str | None = None) -> str:
    """The source of the wiring classes, in dependency order, for copying into generated files.

    ``kind`` (``"mac"``, ``"mag"`` or ``"mal"``) keeps only the classes that wiring needs;
    ``None`` gives all of them."""
    import inspect

    needs = {None: (Attention, SlidingWindowAttention, MAC, MAG, MAL), "mac": (Attention, MAC),
             "mag": (Attention, SlidingWindowAttention, MAG), "mal": (Attention, SlidingWindowAttention, MAL)}
    if kind not in needs:
        raise ValueError(f"unknown wiring {kind!r}: use mac, mag or mal")
    return "\n\n".join(inspect.getsource(c) for c in needs[kind])
