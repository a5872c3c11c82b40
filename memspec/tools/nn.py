"""Language-model blocks around compiled memory layers.

``MemoryLM(spec, vocab_size, d_model, n_layers)``: embedding -> ``n_layers`` pre-norm
residual :class:`Block` s (mixer = the spec's compiled Layer, which for a ``mac`` /
``mag`` / ``mal`` spec is already the wired layer; then an MLP) -> RMSNorm -> head (tied to the
embedding by default).  Every mixer carries a state, so the model decodes token by
token with the same outputs as the full-sequence forward::

    lm = MemoryLM("specs/deltanet.yaml", vocab_size=64, d_model=64, n_layers=2)
    logits = lm(tokens)                                   # [B, T, vocab]
    logits, state = lm(tokens[:, :5], return_state=True)  # prefill
    logits, state = lm(tokens[:, 5:6], state=state, return_state=True)  # one more token
    out = lm.generate(prompt, max_new_tokens=8)           # greedy
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ..runtime.wiring import wrap


class MLP(nn.Module):
    def __init__(self, d_model: int, ratio: int = 4):
        super().__init__()
        self.up = nn.Linear(d_model, ratio * d_model)
        self.down = nn.Linear(ratio * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.gelu(self.up(x)))


class ShortConv(nn.Module):
    """Causal depthwise convolution over the last ``kernel`` tokens.

    Initialised as a token shift: half of the channels carry the current token, the other
    half the previous one (so that from the start a key can be associated with the token
    after it, as associative recall needs).

    ``forward(x, state=None) -> (y, state)`` with x, y ``[B, T, d]``; state ``[B, kernel - 1, d]``
    holds the last inputs.  Fast-weight layers use it so that a token's key can see its
    predecessor (the short convolution of DeltaNet / Zoology's models).  With ``cu_seqlens``
    (packed documents, B = 1, offsets ``[N + 1]``) a document's taps never reach the document
    before it: they start from its own row of state ``[N, kernel - 1, d]`` (zeros by default).
    """

    def __init__(self, d: int, kernel: int = 4):
        super().__init__()
        self.kernel = kernel
        w = torch.zeros(d, kernel)
        w[: d - d // 2, -1] = 1.0                                      # current token
        w[d - d // 2:, -2] = 1.0                                       # previous token (token shift)
        self.weight = nn.Parameter(w)                                  # [d, kernel]

    def forward(self, x: torch.Tensor, state=None, cu_seqlens=None):
        if cu_seqlens is not None:
            return self._packed(x, state, cu_seqlens)
        B, T, d = x.shape
        past = state if state is not None else x.new_zeros(B, self.kernel - 1, d)
        xx = torch.cat([past, x], dim=1)                               # [B, kernel - 1 + T, d]
        y = nn.functional.conv1d(xx.transpose(1, 2), self.weight.unsqueeze(1), groups=d)
        return y.transpose(1, 2), xx[:, xx.shape[1] - (self.kernel - 1):]

    def _packed(self, x: torch.Tensor, state, cu_seqlens: torch.Tensor):
        """Packed documents ``x [1, T, d]``: every document laid out after its own past inputs
        (``[past_i | document_i]``, one row), one convolution, each token's output picked out."""
        offsets = [int(t) for t in cu_seqlens.tolist()]
        n, k1, d = len(offsets) - 1, self.kernel - 1, x.shape[-1]
        past = state if state is not None else x.new_zeros(n, k1, d)
        docs = list(enumerate(zip(offsets, offsets[1:])))
        xx = torch.cat([p for i, (a, b) in docs for p in (past[i], x[0, a:b])])   # [n k1 + T, d]
        # [n k1 + T - k1, d]
        y = nn.functional.conv1d(xx.T.unsqueeze(0), self.weight.unsqueeze(1), groups=d)[0].T
        # token t of document i sits at xx[i k1 + k1 + t], its output at y[i k1 + t]; its state: the last k1
        outs = torch.tensor([i * k1 + t for i, (a, b) in docs for t in range(a, b)], dtype=torch.long)
        last = torch.tensor([i * k1 + b + j for i, (a, b) in docs for j in range(k1)], dtype=torch.long)
        new_state = xx.index_select(0, last.to(x.device)).view(n, k1, d)
        return y.index_select(0, outs.to(y.device)).unsqueeze(0), new_state


class Block(nn.Module):
    """Pre-norm residual block: ``x + mixer(conv(norm(x)))``, then ``x + mlp(norm(x))``.

    ``conv`` is an optional :class:`ShortConv` of ``conv`` taps (0 = none).
    ``forward(x, state=None, return_state=False, cu_seqlens=None)`` with x ``[B, T, d_model]``; the
    state is ``{"mixer": <the mixer's state>, "conv": [B, conv - 1, d_model]}``; ``cu_seqlens``: packed
    documents (B = 1, offsets ``[N + 1]``), passed to the convolution and the mixer.
    """

    def __init__(self, mixer: nn.Module, d_model: int, mlp_ratio: int = 4, conv: int = 0):
        super().__init__()
        self.norm1 = nn.RMSNorm(d_model)
        self.conv = ShortConv(d_model, conv) if conv > 1 else None
        self.mixer = mixer
        self.norm2 = nn.RMSNorm(d_model)
        self.mlp = MLP(d_model, mlp_ratio)

    def forward(self, x: torch.Tensor, state=None, return_state: bool = False, cu_seqlens=None):
        st = state if state is not None else {"mixer": None, "conv": None}
        u, conv_state = self.norm1(x), None
        if self.conv is not None:
            u, conv_state = self.conv(u, st["conv"], cu_seqlens=cu_seqlens)
        if cu_seqlens is None:
            h, mixer_state = self.mixer(u, state=st["mixer"], return_state=True)
        elif return_state:
            h, mixer_state = self.mixer(u, state=st["mixer"], return_state=True, cu_seqlens=cu_seqlens)
        else:   # (a wired mixer returns no state for packed documents)
            h, mixer_state = self.mixer(u, state=st["mixer"], cu_seqlens=cu_seqlens), None
        x = x + h
        x = x + self.mlp(self.norm2(x))
        return (x, {"mixer": mixer_state, "conv": conv_state}) if return_state else x


def _load_spec(spec):
    from ..lang.frontend import load

    return load(str(spec)) if isinstance(spec, (str, Path)) else spec


def spec_text(spec, path=None) -> str:
    """A self-contained text of the spec (canonical YAML when available; else the file)."""
    try:
        from ..lang.fmt import to_yaml

        return to_yaml(spec)
    except Exception:
        p = path or getattr(spec, "path", None)
        if p and Path(p).exists():
            return Path(p).read_text(encoding="utf-8")
        return spec.model_dump_json(indent=2)


def _default_layer(spec, d_model: int, compile: bool, dims: dict) -> nn.Module:
    from ..pipeline.build import build

    return build(spec, compile=compile, d_model=d_model, **dims)


class MemoryLM(nn.Module):
    """A small language model whose token mixers are the spec's memory layers.

    The default mixer is ``memspec.build(spec, d_model=d_model, compile=compile, **dims)``
    used as it is: the generated ``<Name>Layer`` already contains the spec's wiring
    (MAC / MAG / MAL around ``<Name>MemoryLayer``).  ``make_layer(spec, d_model) ->
    nn.Module`` overrides it with a bare memory layer (a stand-in), which is then wrapped
    by :func:`memspec.wiring.wrap` in the spec's wiring.  Either way the wiring attention
    uses ``heads`` attention heads (the spec's ``heads`` dim when it divides ``d_model``,
    else 1).  ``conv`` taps of causal short convolution before each mixer (0 or 1 = none).
    """

    def __init__(self, spec, vocab_size: int, d_model: int, n_layers: int, *, tie_embeddings: bool = True,
                 compile: bool = False, mlp_ratio: int = 4, conv: int = 4, make_layer: Callable | None = None, **dims):
        super().__init__()
        self.spec = _load_spec(spec)
        self.vocab_size, self.d_model, self.n_layers = vocab_size, d_model, n_layers
        w = self.spec.wiring
        heads = dims.get("heads", self.spec.dims.get("heads", 1))
        heads = heads if d_model % heads == 0 else 1
        blocks = []
        for _ in range(n_layers):
            if make_layer is None:
                mixer = _default_layer(self.spec, d_model, compile, dims)   # wired in the generated code
            else:
                mixer = wrap(make_layer(self.spec, d_model), w.kind, d_model, segment=w.segment,
                             window=w.window, persistent=w.persistent, heads=heads, **w.options())
            blocks.append(Block(mixer, d_model, mlp_ratio, conv))
        self.embed = nn.Embedding(vocab_size, d_model)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.blocks = nn.ModuleList(blocks)
        self.norm = nn.RMSNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        if tie_embeddings:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor, state=None, return_state: bool = False, cu_seqlens=None):
        """tokens ``[B, T]`` (int) -> logits ``[B, T, vocab]``; state: one entry per block.
        ``cu_seqlens``: packed documents (B = 1, int offsets ``[N + 1]``), each alone."""
        x = self.embed(tokens)
        states = list(state) if state is not None else [None] * len(self.blocks)
        new = []
        for block, st in zip(self.blocks, states):
            if return_state or cu_seqlens is None:
                x, st = block(x, state=st, return_state=True, cu_seqlens=cu_seqlens)
            else:   # packed documents, no state asked for: a wired mixer returns none
                x, st = block(x, state=st, cu_seqlens=cu_seqlens), None
            new.append(st)
        logits = self.head(self.norm(x))
        return (logits, new) if return_state else logits

    @torch.no_grad()
    def generate(self, tokens: torch.Tensor, max_new_tokens: int, *, temperature: float = 0.0,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Continue ``tokens`` ``[B, T]`` by ``max_new_tokens`` (greedy when temperature is 0),
        carrying every layer's state (one token per step after the prompt)."""
        logits, state = self(tokens, return_state=True)
        out = [tokens]
        last = logits[:, -1]
        for _ in range(max_new_tokens):
            if temperature > 0:
                probs = torch.softmax(last / temperature, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=generator)
            else:
                nxt = last.argmax(-1, keepdim=True)
            out.append(nxt)
            logits, state = self(nxt, state=state, return_state=True)
            last = logits[:, -1]
        return torch.cat(out, dim=1)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
