"""`memspec export SPEC DIR`: a spec's self-contained Hugging Face model folder, of a fresh
model at the given sizes (:func:`memspec.hf.export`; :mod:`memspec.hf.folder` says what the
folder holds).  It loads where memspec is not installed::

    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)

``memspec train --save-hf DIR`` writes the same folder with the trained weights.
"""
from __future__ import annotations

from ..pipeline.build import load_checked


def run_cli(args, usage_error) -> int:
    """`memspec export SPEC DIR [--vocab N --d-model N --layers N --heads N --dim NAME=N --seed N]`."""
    import torch

    from .train import TrainConfig, model_dims

    for flag in ("vocab", "d_model", "layers", "heads"):
        if getattr(args, flag) < 1:
            raise usage_error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    dims = {}
    for item in args.dim or []:
        name, _, value = item.partition("=")
        if not name.isidentifier() or not value.isdigit() or int(value) < 1:
            raise usage_error(f"--dim expects NAME=N with N >= 1, got {item!r}")
        dims[name] = int(value)
    checked = load_checked(args.spec, allow_extends_outside=getattr(args, "allow_extends_outside", False))
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise usage_error("memspec export needs transformers and safetensors: pip install 'memspec[hf]'") from None
    from ..hf.folder import MODELING, export

    try:
        sizes = model_dims(checked.spec, TrainConfig(d_model=args.d_model, heads=args.heads, dims=dims))
        torch.manual_seed(args.seed)
        out = export(checked, args.dir, vocab_size=args.vocab, d_model=args.d_model, n_layers=args.layers, **sizes)
    except ValueError as err:
        raise usage_error(str(err)) from None
    print(f"wrote {out}: config.json, {MODELING}.py, {checked.spec.name}.py, model.safetensors "
          f"(load: AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True))")
    return 0


def add_arguments(s) -> None:
    """The arguments of `memspec export`."""
    s.add_argument("spec", metavar="SPEC")
    s.add_argument("dir", metavar="DIR")
    s.add_argument("--vocab", type=int, default=256, help="vocabulary size (default 256: bytes)")
    s.add_argument("--d-model", type=int, default=64, dest="d_model", help="model width (default 64)")
    s.add_argument("--layers", type=int, default=2, help="blocks (default 2)")
    s.add_argument("--heads", type=int, default=4, help="memory heads; d_k and d_v default to d_model // heads")
    s.add_argument("--dim", action="append", metavar="NAME=N", help="another build-time dim of the memory")
    s.add_argument("--seed", type=int, default=0, help="initialisation seed (default 0)")
