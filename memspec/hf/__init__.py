"""memspec models in the Hugging Face ``transformers`` stack (needs the ``hf`` extra).

``MemspecConfig``, ``MemspecForCausalLM``, ``MemspecCache`` (:mod:`.modeling`);
:func:`config_for` and :func:`from_spec` make a model of a spec, :func:`from_memory_lm`
turns a trained :class:`~memspec.tools.nn.MemoryLM` into one (the same weights)::

    model = memspec.hf.from_spec("specs/deltanet.yaml", vocab_size=256, d_model=64, n_layers=2)
    out = model.generate(prompt, max_new_tokens=16)               # through the memories' states
    memspec.hf.export("specs/deltanet.yaml", "out/deltanet-hf", model=model)   # or: memspec export SPEC DIR

:func:`export` (:mod:`.folder`) writes a folder that loads without memspec.
"""
from __future__ import annotations

from .modeling import MemspecCache, MemspecConfig, MemspecForCausalLM

__all__ = ["MemspecCache", "MemspecConfig", "MemspecForCausalLM", "config_for", "export", "from_memory_lm",
           "from_spec"]


def config_for(spec, vocab_size: int, d_model: int, n_layers: int, *, mlp_ratio: int = 4, conv: int = 4,
               tie_embeddings: bool = True, **dims) -> MemspecConfig:
    """The config of a spec (a path or a Spec; checked) at these LM sizes; ``dims`` are the memory
    layer's build-time dims (``heads``, ``d_k``, ``chunk``, wiring sizes), as ``memspec.build`` takes them."""
    from ..lang.fmt import to_yaml
    from ..pipeline.build import load_checked

    checked = load_checked(spec)
    return MemspecConfig(spec=to_yaml(checked.spec), spec_name=checked.spec.name, vocab_size=vocab_size,
                         hidden_size=d_model, num_hidden_layers=n_layers, mlp_ratio=mlp_ratio, conv=conv,
                         layer_dims=dims, tie_word_embeddings=tie_embeddings)


def from_spec(spec, vocab_size: int, d_model: int, n_layers: int, **kwargs) -> MemspecForCausalLM:
    """A freshly initialised model of a spec (arguments as :func:`config_for`)."""
    return MemspecForCausalLM(config_for(spec, vocab_size, d_model, n_layers, **kwargs))


def from_memory_lm(lm, **dims) -> MemspecForCausalLM:
    """The model with a :class:`~memspec.tools.nn.MemoryLM`'s weights (its mixers the default
    compiled Layers, built with these ``dims``)."""
    block = lm.blocks[0]
    conv = block.conv.kernel if block.conv is not None else 0
    config = config_for(lm.spec, lm.vocab_size, lm.d_model, lm.n_layers, conv=conv,
                        mlp_ratio=block.mlp.up.out_features // lm.d_model,
                        tie_embeddings=lm.head.weight is lm.embed.weight, **dims)
    model = MemspecForCausalLM(config)
    model.load_state_dict(lm.state_dict())
    return model.to(next(lm.parameters()).device)


def export(spec, out_dir, **kwargs):
    """The model folder of a spec (:func:`memspec.hf.folder.export`)."""
    from .folder import export as write

    return write(spec, out_dir, **kwargs)
