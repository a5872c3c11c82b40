"""A memspec memory as a Hugging Face causal language model.

``MemspecConfig`` (a ``PretrainedConfig``) carries the spec's canonical text and the LM
sizes; ``MemspecForCausalLM`` (``PreTrainedModel`` + ``GenerationMixin``) is
:class:`memspec.tools.nn.MemoryLM`'s network -- embedding, pre-norm residual blocks whose
mixer is the spec's compiled Layer (with its wiring) after a short convolution, then an
MLP; RMSNorm; a head tied to the embedding -- with the same parameter names, so a
MemoryLM's state dict loads into it as it is.  ``MemspecCache`` holds every block's state
(the memory's state, and the attention caches of a wired memory).

Past the section marked below this file imports only torch, transformers and the standard
library's dataclasses and typing: ``memspec export`` writes it next to a copy of the compiled
module, with that section replaced by the module's import, so the folder loads where memspec
is not installed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import ModelOutput

# ---- memspec: the exported modeling file replaces this section (memspec.tools.export) ----
from ..tools.nn import Block


def memory_layer(config):
    """The spec's compiled Layer at the config's sizes (built from the spec text by memspec)."""
    from ..lang.frontend import loads
    from ..pipeline.build import build

    return build(loads(config.spec), compile=False, d_model=config.hidden_size, **config.layer_dims)
# ---- end of the memspec section ----


class MemspecConfig(PretrainedConfig):
    """The spec (``spec``: its canonical YAML, ``memspec fmt --to yaml``; ``spec_name``) and the
    LM's sizes: ``vocab_size``, ``hidden_size`` (d_model), ``num_hidden_layers``,
    ``mlp_ratio``, ``conv`` (short-convolution taps before each mixer; 0 or 1 = none),
    ``layer_dims`` (the build-time dims of the memory layer: heads, d_k, chunk, wiring sizes).
    """

    model_type = "memspec"

    def __init__(self, spec: str = "", spec_name: str = "memory", vocab_size: int = 256, hidden_size: int = 64,
                 num_hidden_layers: int = 2, mlp_ratio: int = 4, conv: int = 4, layer_dims: dict | None = None,
                 tie_word_embeddings: bool = True, use_cache: bool = True, **kwargs):
        self.spec = spec
        self.spec_name = spec_name
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.mlp_ratio = mlp_ratio
        self.conv = conv
        self.layer_dims = dict(layer_dims or {})
        self.use_cache = use_cache
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)


def _rows(state, index: torch.Tensor):
    """A block state (nested dicts / lists of tensors ``[B, ...]``) at the batch rows ``index``."""
    if isinstance(state, torch.Tensor):
        return state.index_select(0, index.to(state.device)) if state.dim() else state
    if isinstance(state, dict):
        return {key: _rows(value, index) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_rows(value, index) for value in state)
    return state


class MemspecCache(Cache):
    """Every block's state, per group of batch rows that share a prompt length.

    A batch without padding is one group.  Rows of a left-padded batch are grouped by their
    number of pad tokens: each group ran its prompt without the pads, so a row's state is
    the one it has alone (a growing attention cache or a wired memory's segment position
    differs between groups, so groups are not merged).  ``groups``: a list of
    ``(rows [b] int64, [state of each block])``; ``seen``: the tokens each row has consumed,
    pads included (``get_seq_length``).
    """

    is_compileable = False
    is_croppable = False

    def __init__(self):
        super().__init__(layers=[])
        self.groups: list[tuple[torch.Tensor, list]] = []
        self.seen = 0

    def __len__(self):
        return len(self.groups[0][1]) if self.groups else 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.seen + query_length, 0

    @property
    def batch_size(self) -> int:
        return sum(len(rows) for rows, _ in self.groups)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row ``r`` of the new batch continues old row ``beam_idx[r]`` (beam search, repeats)."""
        beam_idx = beam_idx.to("cpu").long()
        groups = []
        for rows, states in self.groups:
            local = {int(r): i for i, r in enumerate(rows.tolist())}
            new = [r for r, old in enumerate(beam_idx.tolist()) if old in local]
            if new:
                index = torch.tensor([local[int(beam_idx[r])] for r in new])
                groups.append((torch.tensor(new), [_rows(s, index) for s in states]))
        self.groups = groups

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.reorder_cache(torch.arange(self.batch_size).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.reorder_cache(torch.as_tensor(indices))

    def reset(self) -> None:
        self.groups, self.seen = [], 0

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a memory's state cannot be rolled back: MemspecCache cannot be cropped")


@dataclass
class MemspecCausalLMOutput(ModelOutput):
    """``loss`` (with labels), ``logits [B, T, vocab]``, ``cache`` (also as ``past_key_values``)."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    cache: MemspecCache | None = None
    past_key_values: MemspecCache | None = None


class MemspecForCausalLM(PreTrainedModel, GenerationMixin):
    """The spec's memory in a causal LM (see the module docstring).

    ``forward(input_ids [B, T] | inputs_embeds [B, T, d], attention_mask [B, seen + T] (1 = token,
    0 = left padding), cache, labels [B, T], use_cache, logits_to_keep)``.  Labels are the
    inputs (shifted inside: position t predicts token t + 1; -100 ignored), as transformers'
    causal LMs take them.  Padding is left padding only: a padded row's pads never reach its
    memory (its rows run without them; their logits are 0).  A call continuing a cache of one
    token per row decodes through each memory's per-token ``step`` schedule.  ``past_key_values``
    is the cache's older name; ``return_dict`` and the other keywords generation passes
    (``output_attentions``, ...) are accepted and have no effect (the output is always a
    ``MemspecCausalLMOutput``; a memory has no attention weights to return).
    """

    config_class = MemspecConfig
    base_model_prefix = "memspec"
    main_input_name = "input_ids"
    _tied_weights_keys: ClassVar[dict] = {"head.weight": "embed.weight"}

    def __init__(self, config: MemspecConfig):
        super().__init__(config)
        d = config.hidden_size
        self.embed = nn.Embedding(config.vocab_size, d)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.blocks = nn.ModuleList(Block(memory_layer(config), d, config.mlp_ratio, config.conv)
                                    for _ in range(config.num_hidden_layers))
        self.norm = nn.RMSNorm(d)
        self.head = nn.Linear(d, config.vocab_size, bias=False)
        self._decoding = False
        for module in self.modules():   # the compiled memories: decode with their step schedule
            if hasattr(type(module), "STEP_SCHEDULE"):
                module.register_forward_pre_hook(self._step_schedule, with_kwargs=True)
        self.post_init()

    def _step_schedule(self, module, args, kwargs):
        """While decoding one token per row, a memory runs ``module.step``'s schedule."""
        if self._decoding:
            return args, {**kwargs, "schedule": module.STEP_SCHEDULE}
        return None

    def _init_weights(self, module):
        """Every module keeps the initialisation its constructor gave it (the compiled Layer's
        gate biases, the embedding's normal(0.02))."""

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False                    # the model makes its own MemspecCache

    def get_input_embeddings(self):
        return self.embed

    def set_input_embeddings(self, value):
        self.embed = value

    def get_output_embeddings(self):
        return self.head

    def set_output_embeddings(self, value):
        self.head = value

    def forward(self, input_ids=None, attention_mask=None, cache=None, inputs_embeds=None, labels=None,
                use_cache=None, logits_to_keep=0, past_key_values=None, return_dict=None, **kwargs):
        cache = cache if cache is not None else past_key_values
        if cache is not None and not isinstance(cache, MemspecCache):
            raise ValueError(f"cache: expected a MemspecCache (every block's memory state), got {type(cache).__name__}")
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids [B, T] and inputs_embeds [B, T, d_model]")
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds   # [B, T, d_model]
        B, T, _ = x.shape
        if use_cache is None:
            use_cache = self.config.use_cache and not self.training
        if cache is None and use_cache:
            cache = MemspecCache()
        seen = cache.seen if cache is not None else 0
        pads = self._pads(attention_mask, B, T, seen)
        if cache is not None and cache.groups:
            if cache.batch_size != B:
                raise ValueError(f"the cache holds {cache.batch_size} rows, the inputs {B}")
            groups = cache.groups
        else:
            groups = [(torch.nonzero(pads == p).flatten(), [None] * len(self.blocks)) for p in pads.unique().tolist()]
        self._decoding = T == 1 and seen > 0
        try:
            h, new_groups = self._run(x, groups, pads)
        finally:
            self._decoding = False
        if cache is not None:
            cache.groups, cache.seen = new_groups, seen + T
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        logits = self.head(self.norm(h))                                       # [B, T, vocab]
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                   labels[:, 1:].reshape(-1).to(logits.device), ignore_index=-100)
        return MemspecCausalLMOutput(loss=loss, logits=logits, cache=cache if use_cache else None,
                                     past_key_values=cache if use_cache else None)

    def _pads(self, attention_mask, B: int, T: int, seen: int) -> torch.Tensor:
        """Left pads per row ``[B]`` from a ``[B, seen + T]`` mask (zeros then ones)."""
        if attention_mask is None:
            return torch.zeros(B, dtype=torch.long)
        mask = attention_mask.detach().to("cpu")
        if mask.dim() != 2 or mask.shape != (B, seen + T):
            raise ValueError(f"attention_mask: expected [batch, past + new tokens] = [{B}, {seen + T}], "
                             f"got {list(mask.shape)}")
        if not ((mask == 0) | (mask == 1)).all():
            raise ValueError("attention_mask: expected 0 (padding) and 1 (token) only")
        mask = mask.long()
        if (mask[:, 1:] < mask[:, :-1]).any():
            raise ValueError("attention_mask: only left padding is supported (a row is pads, then tokens); "
                             "a memory cannot skip a pad in the middle of a sequence")
        pads = (mask == 0).sum(1)
        if seen and (pads > seen).any():
            raise ValueError("attention_mask: padding after the cached tokens (pads come before a row's first token)")
        if (pads >= seen + T).any():
            raise ValueError("attention_mask: a row with no token (all padding)")
        return pads - seen if seen else pads

    def _run(self, x: torch.Tensor, groups: list, pads: torch.Tensor):
        """The blocks over each group's rows (without their pads); pad positions give zeros."""
        if len(groups) == 1 and int(pads.max()) <= 0:
            states = groups[0][1]
            out = []
            for block, st in zip(self.blocks, states):
                x, st = block(x, state=st, return_state=True)
                out.append(st)
            return x, [(groups[0][0], out)]
        h = torch.zeros_like(x)
        new = []
        for rows, states in groups:
            p = max(int(pads[rows[0]]), 0)
            y = x[rows.to(x.device), p:]
            out = []
            for block, st in zip(self.blocks, states):
                y, st = block(y, state=st, return_state=True)
                out.append(st)
            h[rows.to(x.device), p:] = y
            new.append((rows, out))
        return h, new

    def prepare_inputs_for_generation(self, input_ids, cache=None, past_key_values=None, attention_mask=None,
                                      inputs_embeds=None, use_cache=True, **kwargs):
        """The tokens the cache has not seen yet (all of them at the first step)."""
        cache = cache if cache is not None else past_key_values
        seen = cache.seen if isinstance(cache, MemspecCache) else 0
        inputs = {"input_ids": input_ids[:, seen:], "attention_mask": attention_mask, "use_cache": use_cache}
        if inputs_embeds is not None and seen == 0:
            inputs = {"inputs_embeds": inputs_embeds, "attention_mask": attention_mask, "use_cache": use_cache}
        if isinstance(cache, MemspecCache):
            inputs["cache"] = cache
        return inputs
