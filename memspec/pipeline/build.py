"""The pipeline: the one place that loads, checks, decides, generates, writes and imports.

Every tool (the CLI, diff, table, bench, train, the lab) goes through these functions:

* :func:`load_checked` -- spec file (or :class:`~memspec.lang.spec.Spec`) -> :class:`Checked`
  (the spec, its dataflow graph, the checks' warnings, the file's text); raises
  :class:`~memspec.lang.errors.SpecError` with every error;
* :func:`decide` -- the schedule decision (:func:`memspec.schedule.analyse`);
* :func:`generate_source` -- the generated module text of a checked spec;
* :func:`compile` -- writes ``<out_dir>/<name>.py`` atomically (:mod:`.write`);
* :func:`build` / :func:`build_memory` -- the same text executed as a fresh module
  (registered in :mod:`linecache`, so tracebacks show the generated lines), its
  ``<Name>Layer`` / ``<Name>Memory`` built with the given dims.

The shipped specs' modules live in ``compiled/`` and are regenerated with::

    memspec compile specs/*.yaml            # or: python -m memspec compile specs/*.yaml
"""
from __future__ import annotations

import builtins
import hashlib
import linecache
import os
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Union

from ..check.verify import check
from ..lang.errors import Diagnostic, SpecError
from ..lang.frontend import load
from ..lang.frontend.inherit import mark_inherited
from ..lang.limits import MAX_SIZE, quote
from ..lang.source import read_text
from ..lang.spec import Spec
from ..schedule import ScheduleDecision, analyse
from .source_check import check_source
from .write import write_atomic

SpecLike = Union[Spec, str, Path]


@dataclass(frozen=True)
class Checked:
    """A loaded spec that passed the checks."""

    spec: Spec
    graph: object                       # the networkx dataflow graph of one token step
    warnings: tuple[Diagnostic, ...]
    path: str | None                    # the file as the generated header names it
    text: str | None                    # the file's text (hashed into the header)


def load_checked(spec_or_path: SpecLike | Checked, *, allow_extends_outside: bool = False) -> Checked:
    """Load (a path) and check a spec; raise SpecError with every error (warnings included).
    ``allow_extends_outside``: see :func:`memspec.lang.frontend.load`."""
    if isinstance(spec_or_path, Checked):
        return spec_or_path
    if isinstance(spec_or_path, Spec):
        spec, path, text = spec_or_path, spec_or_path.path, None
    else:
        p = Path(spec_or_path)
        spec = load(p, allow_extends_outside=allow_extends_outside)
        path = _display(p)
        text = read_text(p)   # regular files only, bounded (the file was just read as a spec)
    graph, diags = check(spec)
    diags = mark_inherited(spec, diags)
    if any(d.severity == "error" for d in diags):
        raise SpecError(diags)
    return Checked(spec, graph, tuple(d for d in diags if d.severity == "warning"), path, text)


def _display(path: Path) -> str:
    try:
        return Path(os.path.abspath(path)).relative_to(os.getcwd()).as_posix()
    except (ValueError, OSError):
        return path.as_posix()


def decide(spec: Spec) -> ScheduleDecision:
    """The schedule decision; raises SpecError for a schedule the spec asks for and does not admit
    (saying so when the spec inherits that schedule through ``extends``)."""
    try:
        return analyse(spec)
    except SpecError as err:
        raise SpecError(mark_inherited(spec, err.diagnostics)) from None


def with_schedule(spec: Spec, schedule: str) -> Spec:
    """``spec`` with its schedule replaced (``online``, ``chunk(64)``, ``minibatch(16)``, ...; the
    spec syntax); raises ValueError, saying why, for a form that is not one or a schedule the
    spec's algebra does not admit."""
    text = Spec._schedule_form(schedule)
    new = spec.model_copy(update={"schedule": text})
    new._spans, new._key_spans, new._path = spec._spans, spec._key_spans, spec._path
    try:
        analyse(new)
    except SpecError as err:
        d = err.diagnostics[0]
        raise ValueError(f"{spec.name} cannot run {text}: {d.message}" + (f" ({d.hint})" if d.hint else "")) from None
    return new


def generate_source(checked: Checked, decision: ScheduleDecision | None = None) -> str:
    """The generated module text of a checked spec (what ``compile`` writes)."""
    decision = decide(checked.spec) if decision is None else decision
    from ..codegen import generate   # imports torch: loaded when code is generated, not to check a spec

    return generate(checked.spec, decision, source_path=checked.path, source_text=checked.text)


def source(spec_or_path: SpecLike) -> str:
    """The generated module text of a spec file or Spec."""
    return generate_source(load_checked(spec_or_path))


def compile(spec_or_path: SpecLike | Checked, out_dir: Union[str, Path] = "compiled") -> Path:  # noqa: A001
    """Generate ``<out_dir>/<name>.py`` for a spec (atomically); returns its path."""
    return compile_with_decision(spec_or_path, out_dir)[0]


def compile_with_decision(spec_or_path: SpecLike | Checked, out_dir: Union[str, Path] = "compiled"):
    """:func:`compile`, returning ``(path, decision)``."""
    checked = load_checked(spec_or_path)
    decision = decide(checked.spec)
    out = Path(out_dir) / f"{checked.spec.name}.py"
    text = generate_source(checked, decision)
    check_source(text, checked.spec, str(out))   # before anything is written: an internal error writes nothing
    write_atomic(out, text)
    return out, decision


def decision_text(decision: ScheduleDecision) -> str:
    """``schedule delta(64), exact`` (what ``memspec compile`` prints)."""
    kind = "exact" if decision.exact else "approximate"
    chunk = f"({decision.chunk})" if decision.chunk and decision.family != "cache" else ""
    return f"schedule {decision.family}{chunk}, {kind}"


def load_module(text: str, name: str, spec: Spec | None = None) -> types.ModuleType:
    """Execute generated module text as a fresh module; its source is registered in
    linecache under a pseudo file name, so tracebacks show the generated lines.  The text
    passes :func:`~.source_check.check_source` first (as ``compile`` checks it before writing)."""
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]
    modname = f"memspec_compiled_{name}_{digest}"
    if modname in sys.modules:
        return sys.modules[modname]
    filename = f"<memspec compiled/{name}.py {digest}>"
    check_source(text, spec, filename)
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    mod = types.ModuleType(modname)
    mod.__file__ = filename
    exec(builtins.compile(text, filename, "exec"), mod.__dict__)
    sys.modules[modname] = mod
    return mod


def _module(spec_or_path: SpecLike | Checked):
    checked = load_checked(spec_or_path)
    return checked.spec, load_module(generate_source(checked), checked.spec.name, checked.spec)


def build(spec_or_path: SpecLike | Checked, *, compile: bool = True, **dims):  # noqa: A002
    """The ``<Name>Layer`` of a spec: ``x [B, T, d_model] -> y``; ``.memory`` is the memory.

    ``dims`` override the spec's dims (and ``chunk=`` the chunk size); for a wired spec
    also the wiring's sizes (MAC: ``segment``, ``persistent``; MAG / MAL: ``window``,
    ``persistent``; all: ``attn_heads``) and options (all: ``qk_norm``; MAC: ``write``,
    ``output``; MAG: ``gate``; MAL: ``residual``).  ``compile=True`` torch.compiles the
    per-token / per-chunk step functions (static shapes)."""
    spec, mod = _module(spec_or_path)
    _check_dims(spec, dims, wiring=True)
    return getattr(mod, f"{_class_name(spec.name)}Layer")(compile=compile, **dims)


def build_memory(spec_or_path: SpecLike | Checked, *, compile: bool = True, **dims):  # noqa: A002
    """The ``<Name>Memory`` of a spec alone (views and gates in, outputs and state out)."""
    spec, mod = _module(spec_or_path)
    _check_dims(spec, dims)
    dims = {k: v for k, v in dims.items() if k != "d_model" or "d_model" in spec.dims}
    return getattr(mod, f"{_class_name(spec.name)}Memory")(compile=compile, **dims)


def _class_name(name: str) -> str:
    from ..codegen import class_name

    return class_name(name)


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
            raise ValueError(f"dim {k} must be a positive integer, got {quote(v)}")
        if v > MAX_SIZE:
            raise ValueError(f"dim {k} is at most {MAX_SIZE}, got {v}")
    from ..check.sizes import size_problems

    sizes = {k: v for k, v in dims.items() if k in ("segment", "window", "persistent")}
    problems = size_problems(spec, {k: v for k, v in dims.items() if k not in sizes}, sizes)
    if problems:
        raise ValueError(f"{spec.name} with these dims cannot be allocated: {problems[0][0]}")
