"""A spec's Hugging Face model folder (what `memspec export` and `memspec train --save-hf` write).

The folder holds ``config.json`` (a :class:`~memspec.hf.MemspecConfig`, with the
``auto_map`` of the Hub's convention for custom architectures), ``modeling_memspec.py``
(:mod:`memspec.hf.modeling` with its memspec section replaced by the LM blocks' sources and
the import of the compiled module), the compiled module ``<name>.py`` next to it (what
``memspec compile`` writes), and the weights in ``model.safetensors``.  It loads where
memspec is not installed::

    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)
"""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

from ..codegen import class_name
from ..codegen.text import inert
from ..pipeline.build import compile as compile_module
from ..pipeline.build import load_checked
from ..pipeline.write import write_atomic
from ..tools import nn as lm_blocks
from . import modeling
from .modeling import MemspecForCausalLM

MODELING = "modeling_memspec"
SECTION_START = "# ---- memspec: the exported modeling file replaces this section"
SECTION_END = "# ---- end of the memspec section ----"
ALLOWED_IMPORTS = {"__future__", "dataclasses", "typing", "torch", "transformers"}


def modeling_source(spec) -> str:
    """The text of ``modeling_memspec.py`` for a spec: :mod:`memspec.hf.modeling` with its memspec
    section replaced by :mod:`memspec.tools.nn`'s blocks and the compiled Layer's import."""
    text = inspect.getsource(modeling)
    start, end = text.index(SECTION_START), text.index(SECTION_END) + len(SECTION_END)
    module, layer = inert(spec.name, "name"), inert(f"{class_name(spec.name)}Layer", "name")
    blocks = "\n\n\n".join(inspect.getsource(c).rstrip() for c in (lm_blocks.MLP, lm_blocks.ShortConv, lm_blocks.Block))
    section = (f"# ---- the LM blocks (memspec.tools.nn) and the compiled memory ({module}.py, next to this file) "
               f"----\nfrom .{module} import {layer}\n\n\n{blocks}\n\n\n"
               f"def memory_layer(config):\n"
               f'    """The spec\'s compiled Layer at the config\'s sizes."""\n'
               f"    return {layer}(compile=False, d_model=config.hidden_size, **config.layer_dims)\n\n\n"
               "# ---- end of the memory section ----")
    doc_end = text.index('"""', 3) + 3
    doc = inert(f"The {spec.name} memory as a Hugging Face causal LM, written by `memspec export`.", "doc")
    out = (f'"""{doc}\n\nmemspec.hf.modeling with the LM blocks and the compiled module ({module}.py) in place of '
           'memspec:\nit imports only torch, transformers and the module next to it.\n"""'
           + text[doc_end:start] + section + text[end:])
    check_imports(out)
    return out


def check_imports(text: str) -> None:
    """The exported file imports only torch, transformers (and the standard library's
    dataclasses and typing) and the module next to it; anything else is a bug of the export."""
    for node in ast.walk(ast.parse(text)):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        bad = [n for n in names if n.split(".")[0] not in ALLOWED_IMPORTS]
        if bad:
            raise AssertionError(f"the exported modeling file would import {', '.join(bad)}")


def export(spec, out_dir, *, model=None, vocab_size: int = 256, d_model: int = 64, n_layers: int = 2,
           **dims) -> Path:
    """Write the model folder of ``spec`` (a path or a Spec) into ``out_dir``; returns it.

    ``model``: a :class:`~memspec.hf.MemspecForCausalLM` of this spec whose weights to write
    (e.g. a trained one); by default a fresh one of these sizes (``dims``: the memory layer's
    build-time dims)."""
    from . import config_for

    checked = load_checked(spec)
    spec = checked.spec
    if spec.name in (MODELING, "config", "model"):
        raise ValueError(f"a spec named {spec.name!r} would overwrite the folder's {spec.name} file")
    if model is None:
        model = MemspecForCausalLM(config_for(checked, vocab_size, d_model, n_layers, **dims))
    elif model.config.spec_name != spec.name:
        raise ValueError(f"the model is of spec {model.config.spec_name!r}, not {spec.name!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    compile_module(checked, out)                                     # out/<name>.py
    write_atomic(out / f"{MODELING}.py", modeling_source(spec))
    model.config.auto_map = {"AutoConfig": f"{MODELING}.MemspecConfig",
                             "AutoModelForCausalLM": f"{MODELING}.MemspecForCausalLM"}
    model.config.architectures = ["MemspecForCausalLM"]
    model.save_pretrained(out)                                       # config.json, model.safetensors
    return out
