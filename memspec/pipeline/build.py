"""`memspec.compile` and `memspec.build`: a spec -> a generated module -> an ``nn.Module``.

``compile(spec_or_path, out_dir="compiled") -> Path`` writes ``<out_dir>/<name>.py``
atomically (:func:`memspec.emit.write_atomic`).  ``build(spec_or_path, *,
compile=True, **dims)`` generates the same text, executes it as a fresh module
(registered in :mod:`linecache`, so tracebacks show the generated lines) and returns
its ``<Name>Layer`` built with the given dims (``chunk=`` sets the chunk size of
chunked schedules).  ``build_memory`` returns the ``<Name>Memory`` alone.

The shipped specs' modules live in ``compiled/`` and are regenerated with::

    memspec compile specs/*.yaml            # or: python -m memspec compile specs/*.yaml
"""
from __future__ import annotations

import hashlib
import linecache
import sys
import types
from pathlib import Path
from typing import Union

from ..codegen.module import class_name, generate
from .write import write_atomic
from ..lang.errors import SpecError
from ..lang.spec import Spec

SpecLike = Union[Spec, str, Path]


def _load(spec_or_path: SpecLike) -> tuple[Spec, str | None, str | None]:
    """(spec, path as written in the header, source text)."""
    if isinstance(spec_or_path, Spec):
        return spec_or_path, spec_or_path.path, None
    from ..lang.frontend import load

    path = Path(spec_or_path)
    spec = load(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        text = None
    return spec, _display(path), text


def _display(path: Path) -> str:
    try:
        return path.resolve().relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return path.as_posix()


def _checked(spec: Spec) -> None:
    """Run the verifier; raise SpecError with every error."""
    from ..check.verify import check

    _, diags = check(spec)
    errors = [d for d in diags if d.severity == "error"]
    if errors:
        raise SpecError(errors)


def decide(spec: Spec):
    """The schedule decision (``memspec.schedule.analyse``); raises SpecError for a forced
    schedule the spec does not admit."""
    from ..schedule.decide import analyse

    return analyse(spec)


def source(spec_or_path: SpecLike) -> str:
    """The generated module text of a spec (what ``compile`` writes)."""
    spec, path, text = _load(spec_or_path)
    _checked(spec)
    return generate(spec, decide(spec), source_path=path, source_text=text)


def compile(spec_or_path: SpecLike, out_dir: Union[str, Path] = "compiled") -> Path:  # noqa: A001
    """Generate ``<out_dir>/<name>.py`` for a spec (atomically); returns its path."""
    text = source(spec_or_path)
    spec, _, _ = _load(spec_or_path)
    out = Path(out_dir) / f"{spec.name}.py"
    write_atomic(out, text)
    return out


def compile_checked(spec: Spec, path: Union[str, Path], out_dir: Union[str, Path] = "compiled"):
    """For the CLI: ``spec`` already loaded and checked from ``path``; writes the module and
    returns ``(out_path, "schedule: ...")``."""
    p = Path(path)
    try:
        text = p.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        text = None
    decision = decide(spec)
    code = generate(spec, decision, source_path=_display(p), source_text=text)
    out = Path(out_dir) / f"{spec.name}.py"
    write_atomic(out, code)
    kind = "exact" if decision.exact else "approximate"
    chunk = f"({decision.chunk})" if decision.chunk and decision.family != "cache" else ""
    return out, f"schedule {decision.family}{chunk}, {kind}"


def load_module(text: str, name: str) -> types.ModuleType:
    """Execute generated module text as a fresh module; its source is registered in
    linecache under a pseudo file name, so tracebacks show the generated lines."""
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]
    modname = f"memspec_compiled_{name}_{digest}"
    if modname in sys.modules:
        return sys.modules[modname]
    filename = f"<memspec compiled/{name}.py {digest}>"
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    mod = types.ModuleType(modname)
    mod.__file__ = filename
    exec(builtins_compile(text, filename, "exec"), mod.__dict__)
    sys.modules[modname] = mod
    return mod


def builtins_compile(text, filename, mode):
    import builtins

    return builtins.compile(text, filename, mode)


def _module(spec_or_path: SpecLike):
    spec, path, text = _load(spec_or_path)
    _checked(spec)
    code = generate(spec, decide(spec), source_path=path, source_text=text)
    return spec, load_module(code, spec.name)


def build(spec_or_path: SpecLike, *, compile: bool = True, **dims):  # noqa: A002
    """The ``<Name>Layer`` of a spec: ``x [B, T, d_model] -> y``; ``.memory`` is the memory.

    ``dims`` override the spec's dims (and ``chunk=`` the chunk size); for a wired spec
    also the wiring's sizes (MAC: ``segment``, ``persistent``; MAG / MAL: ``window``,
    ``persistent``; all: ``attn_heads``) and options (all: ``qk_norm``; MAC: ``write``,
    ``output``; MAG: ``gate``; MAL: ``residual``).  ``compile=True`` torch.compiles the
    per-token / per-chunk step functions (static shapes)."""
    spec, mod = _module(spec_or_path)
    _check_dims(spec, dims, wiring=True)
    return getattr(mod, f"{class_name(spec.name)}Layer")(compile=compile, **dims)


def build_memory(spec_or_path: SpecLike, *, compile: bool = True, **dims):  # noqa: A002
    """The ``<Name>Memory`` of a spec alone (views and gates in, outputs and state out)."""
    spec, mod = _module(spec_or_path)
    _check_dims(spec, dims)
    dims = {k: v for k, v in dims.items() if k != "d_model" or "d_model" in spec.dims}
    return getattr(mod, f"{class_name(spec.name)}Memory")(compile=compile, **dims)


WIRING_SIZES = {"none": (), "mac": ("segment", "persistent", "attn_heads"),
                "mag": ("window", "persistent", "attn_heads"), "mal": ("window", "persistent", "attn_heads")}


def _check_dims(spec: Spec, dims: dict, wiring: bool = False) -> None:
    extra = WIRING_SIZES[spec.wiring.kind] if wiring else ()
    options = tuple(spec.wiring.options()) if wiring else ()
    allowed = set(spec.dims) | {"chunk", "heads", "d_model"} | set(extra) | set(options)
    unknown = sorted(set(dims) - allowed)
    if unknown:
        raise ValueError(f"unknown dims {', '.join(unknown)}; {spec.name} has dims "
                         f"{', '.join(spec.dims)} (and chunk{''.join(', ' + w for w in extra + options)})")
    for k in [k for k in dims if k in options]:
        try:                                                  # the spec's own rules for the option
            spec.wiring.model_validate({**spec.wiring.model_dump(exclude_defaults=True), k: dims[k]})
        except ValueError as err:
            msg = err.errors()[0]["msg"] if hasattr(err, "errors") else str(err)
            raise ValueError(f"wiring option {k}: {msg.removeprefix('Value error, ')}") from None
    for k, v in ((k, v) for k, v in dims.items() if k not in options):
        if k == "persistent" and isinstance(v, int) and not isinstance(v, bool) and v == 0:
            continue   # no persistent tokens
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"dim {k} must be a positive integer, got {v!r}")
