"""Frontend: a spec file (YAML or `.mem`) -> validated :class:`~memspec.spec.Spec`.

``load(path)`` reads the file, resolves ``extends`` (relative to the file, cycles
rejected), parses expression strings with their file positions, validates with
pydantic and maps every validation error back to the spec's own line and column.
All problems of a file are collected and raised together as one ``SpecError``.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ..errors import Collector, Span, SpecError, did_you_mean, printable, remember_source
from ..limits import MAX_EXTENDS_CHAIN, MAX_SPEC_BYTES, clip, quote
from ..source import NotReadable, read_regular
from ..expr import Assign, Expr, FunDef, Num, SourcePos, parse_expr, parse_fundef, parse_stmt
from ..spec import Gate, Param, Spec, State, View, Wiring
from . import shipped
from .mem_frontend import read_mem
from .raw import RawSpec, merge_raw
from .yaml_frontend import read_yaml

SUFFIXES = {".yaml": "yaml", ".yml": "yaml", ".mem": "mem"}


def format_of(path: str | Path) -> str | None:
    return SUFFIXES.get(Path(path).suffix.lower())


def resolved(path: str | Path) -> Path:
    """``path`` made absolute with symlinks followed as far as they go (never raises: a
    symlink loop stays as it is, and reading it reports the loop)."""
    return Path(os.path.realpath(path))


def display_path(path: Path) -> str:
    """Paths in messages are relative to the working directory when possible."""
    try:
        return str(Path(os.path.abspath(path)).relative_to(os.getcwd()))
    except (ValueError, OSError):
        return str(path)


def read_source(path: Path, file: str, diags: Collector, via: Span | None = None) -> str | None:
    """The text of a spec file: a regular file (symlinks followed) of at most
    ``MAX_SPEC_BYTES``, UTF-8 without NUL; otherwise a located error and None."""
    try:
        data = read_regular(path, MAX_SPEC_BYTES)
    except NotReadable as err:
        if err.missing:
            also = shipped.shipped_equivalent(path) if via else None
            diags.error(f"no such spec file: {printable(file)}", via or Span(file, 1, 1),
                        hint=None if not via else "extends paths are relative to the spec file that extends"
                        + (f"; to extend the shipped spec, write `extends: {also}`" if also else ""))
        elif err.head:
            remember_source(file, err.head.decode("utf-8", errors="replace").split("\n", 1)[0])
            diags.error(err.reason, Span(file, 1, 1), hint="is this the right file?")
        else:
            remember_source(file, "")  # nothing to quote
            diags.error(f"cannot read spec: {err.reason}" if not err.reason.startswith("is ") else err.reason,
                        via or Span(file, 1, 1))
        return None
    if b"\x00" in data:
        i = data.index(b"\x00")
        line = data[:i].count(b"\n") + 1
        col = i - (data[:i].rfind(b"\n") + 1) + 1
        remember_source(file, "")  # never quote binary junk
        diags.error("binary data (NUL byte) in spec file", Span(file, line, col), hint="a spec is UTF-8 text")
        return None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        before = data[: err.start]
        line = before.count(b"\n") + 1
        col = len(before[before.rfind(b"\n") + 1 :].decode("utf-8", errors="replace")) + 1
        remember_source(file, data.decode("utf-8", errors="replace"))
        diags.error("invalid UTF-8 in spec file", Span(file, line, col), hint="a spec is UTF-8 text")
        return None
    if text.startswith("\ufeff"):
        text = text[1:]
    remember_source(file, text)
    return text


PROJECT_MARKERS = ("pyproject.toml", "setup.py", "setup.cfg", ".git")


def extends_root(spec_path: str | Path) -> Path:
    """The folder tree ``extends`` stays in: the spec's own folder, widened to the project it
    lies in (the nearest folder above it holding pyproject.toml, setup.py, setup.cfg or .git)
    when that project is below the home folder, so that ``specs/variants/x.yaml`` may extend
    ``../titans.yaml``.  A spec downloaded to a folder outside any project reaches only its
    own folder tree; the home folder (a dotfiles repository) and ``/`` never count as a project."""
    folder = resolved(spec_path).parent
    try:
        home = resolved(Path.home())
    except (RuntimeError, KeyError, OSError):
        home = None
    for d in (folder, *folder.parents):
        if d == Path(d.anchor) or (home is not None and (d == home or d in home.parents)):
            break
        if any(os.path.lexists(d / m) for m in PROJECT_MARKERS):
            return d
    return folder


def _inside(path: Path, root: Path) -> bool:
    try:
        path.relative_to(root)
        return True
    except ValueError:
        return False


def read_raw(path: Path, diags: Collector, chain: tuple[Path, ...] = (), via: Span | None = None,
             root: Path | None = None) -> RawSpec | None:
    """Read one file and everything it extends, merged.  ``root``: the folder tree every
    ``extends`` must stay in (None: anywhere)."""
    file = display_path(path)
    fmt = format_of(path)
    if fmt is None:
        diags.error(f"unknown spec format {quote(path.suffix)}", via or Span(file, 1, 1),
                    hint="spec files end in .yaml, .yml or .mem")
        return None
    text = read_source(path, file, diags, via)
    if text is None:
        return None
    if not text.strip():
        diags.error("empty spec", Span(file, 1, 1), hint="a spec needs at least name, state and read")
        return None
    raw = read_yaml(text, file, diags) if fmt == "yaml" else read_mem(text, file, diags)
    if raw is None:
        return None
    if raw.extends is None:
        _strip_drops(raw.data)
        return raw
    here = resolved(path)
    if len(chain) + 1 >= MAX_EXTENDS_CHAIN:
        diags.error(f"too many levels of extends (at most {MAX_EXTENDS_CHAIN} files in a chain)", raw.extends_span)
        return None
    if "\x00" in raw.extends or not raw.extends:
        diags.error("extends needs a file name", raw.extends_span)
        return None
    if shipped.is_shipped_name(raw.extends):
        base_path, why = shipped.resolve_shipped(raw.extends, fmt)
        if base_path is None:
            name = raw.extends[len(shipped.PREFIX):]
            hint = did_you_mean(name, shipped.shipped_names()) or "the shipped specs: " + ", ".join(
                shipped.shipped_names()[:12]) + ", …"
            diags.error(f"extends {quote(raw.extends)}: {why}", raw.extends_span, hint=hint)
            return None
    else:
        base_path = resolved(path.parent / raw.extends)
    if base_path in chain or base_path == here:
        cycle = " -> ".join(display_path(p) for p in (*chain, here, base_path))
        diags.error(f"cycle of extends: {printable(cycle)}", raw.extends_span, hint="a spec cannot extend itself")
        return None
    if shipped.is_shipped_name(raw.extends):
        root = None if root is None else shipped.shipped_dir()   # a shipped spec extends shipped ones
    elif root is not None and not _inside(base_path, root):
        also = shipped.shipped_equivalent(base_path)
        diags.error(f"extends {quote(raw.extends)} points outside {printable(display_path(root).rstrip('/') + '/')}, "
                    f"the folder tree the spec may extend from",
                    raw.extends_span,
                    hint=(f"to extend the shipped spec, write `extends: {also}`; " if also else "")
                    + "a spec extends files in its own folder tree (or its project's); to allow others pass "
                      "--allow-extends-outside (memspec.load(path, allow_extends_outside=True))")
        return None
    base = read_raw(base_path, diags, chain + (here,), raw.extends_span, root)
    if base is None:
        return None
    merged = merge_raw(base, raw)
    return merged


def _strip_drops(d: dict) -> None:
    for k in [k for k, v in d.items() if v is None and k in _SECTIONS_WITH_ENTRIES]:
        pass
    for sec in _SECTIONS_WITH_ENTRIES:
        sub = d.get(sec)
        if isinstance(sub, dict):
            for k in [k for k, v in sub.items() if v is None]:
                del sub[k]


_SECTIONS_WITH_ENTRIES = ("dims", "constants", "views", "gates", "params", "state", "let")


def _expression_paths(data: dict) -> list[tuple[tuple, str]]:
    """Paths of expression-valued fields and which parser they need."""
    out: list[tuple[tuple, str]] = []
    for key, kind in (("model", "fundef"), ("loss", "expr"), ("read", "expr")):
        if isinstance(data.get(key), str):
            out.append(((key,), kind))
    if isinstance(data.get("update"), list):
        for i, s in enumerate(data["update"]):
            if isinstance(s, str):
                out.append((("update", i), "stmt"))
    if isinstance(data.get("let"), dict):
        for k, v in data["let"].items():
            if isinstance(v, str):
                out.append((("let", k), "expr"))
    if isinstance(data.get("gates"), dict):
        for k, v in data["gates"].items():
            if isinstance(v, (str, int, float)) and not isinstance(v, bool):
                out.append((("gates", k), "expr"))
            elif isinstance(v, dict) and isinstance(v.get("formula"), str):
                out.append((("gates", k, "formula"), "expr"))
    return out


_PARSERS = {"expr": parse_expr, "stmt": parse_stmt, "fundef": parse_fundef}


def parse_expressions(raw: RawSpec, diags: Collector) -> None:
    """Replace expression strings in ``raw.data`` by AST, located in the file."""
    for path, kind in _expression_paths(raw.data):
        parent = raw.data
        for k in path[:-1]:
            parent = parent[k]
        text = parent[path[-1]]
        if not isinstance(text, str):
            text = repr(text)
        pos = raw.text_pos.get(path)
        if pos is None:
            sp = raw.span_of(path)
            pos = SourcePos(sp.file, sp.line, sp.col)
        try:
            parent[path[-1]] = _PARSERS[kind](text, pos)
        except SpecError as err:
            diags.extend(err.diagnostics)
            # placeholder: already reported; keep validating the rest of the spec
            parent[path[-1]] = {"expr": Num(0), "stmt": Assign("_", Num(0)),
                                "fundef": FunDef("_", "_", Num(0))}[kind]


_MODELS = {
    (): Spec,
    ("views", "*"): View,
    ("gates", "*"): Gate,
    ("params", "*"): Param,
    ("state", "*"): State,
    ("wiring",): Wiring,
}


def _model_for(path: tuple):
    for pat, model in _MODELS.items():
        if len(pat) == len(path) and all(p == "*" or p == q for p, q in zip(pat, path)):
            return model
    return None


def _plain(msg: str) -> str:
    for prefix in ("Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            return msg[len(prefix):]
    return msg


def map_validation_errors(err: ValidationError, raw: RawSpec, diags: Collector) -> None:
    for e in err.errors():
        loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        typ = e["type"]
        if typ == "extra_forbidden":
            parent, key = loc[:-1], loc[-1]
            model = _model_for(parent)
            fields = list(model.model_fields) if model else []
            if model is Spec:
                fields.append("extends")
            where = "spec" if not parent else " ".join(str(p) for p in parent)
            hint = did_you_mean(str(key), fields) or (
                "allowed: " + ", ".join(fields) if fields else None)
            diags.error(f"unknown field {quote(key)} in {clip(where)}", raw.key_span_of(loc), hint=hint)
        elif typ == "missing":
            parent, key = loc[:-1], loc[-1]
            where = "spec" if not parent else " ".join(str(p) for p in parent)
            diags.error(f"missing field {quote(key)} in {clip(where)}", raw.key_span_of(parent) if parent else raw.span_of(()),
                        hint=_missing_hint(str(key)))
        else:
            field = clip(".".join(str(p) for p in loc) or "spec")
            inp = e.get("input")
            msg = _plain(e["msg"])
            if typ in ("dict_type", "model_type", "model_attributes_type"):
                msg = f"expected a mapping, got {_kind(inp)}"
            elif typ == "list_type":
                msg = f"expected a list, got {_kind(inp)}"
            elif typ in ("string_type",):
                msg = f"expected text, got {_kind(inp)}"
            elif typ in ("int_type", "int_parsing", "int_from_float"):
                msg = f"expected an integer, got {_kind(inp)}"
            elif typ in ("float_type", "float_parsing"):
                msg = f"expected a number, got {_kind(inp)}"
            elif typ == "literal_error":
                msg = f"{_plain(e['msg'])}, got {quote(inp)}" if not isinstance(inp, (dict, list)) else _plain(e["msg"])
            elif typ == "is_instance_of":
                msg = f"expected an expression, got {_kind(inp)}"
            diags.error(f"{field}: {msg}", raw.span_of(loc))


def _kind(v: Any) -> str:
    if v is None:
        return "nothing (null)"
    if isinstance(v, bool):
        return f"a boolean ({str(v).lower()})"
    if isinstance(v, (int, float)):
        return f"a number ({v})"
    if isinstance(v, str):
        return f"text ({v!r})" if len(v) < 40 else "text"
    if isinstance(v, dict):
        return "a mapping"
    if isinstance(v, list):
        return "a list"
    if isinstance(v, Expr):
        return "an expression"
    return type(v).__name__


def _missing_hint(key: str) -> str | None:
    return {
        "name": "give the memory a name: `name: my_memory`",
        "read": "say how the memory is read, e.g. `read: f(q)`",
        "shape": "give the state a shape in dims, e.g. `shape: [d_k, d_v]`",
        "dim": "give the view a width, e.g. `dim: d_k`",
    }.get(key)


def spec_from_raw(raw: RawSpec, diags: Collector, path: str | None = None) -> Spec | None:
    parse_expressions(raw, diags)
    try:
        spec = Spec.model_validate(raw.data)
    except ValidationError as err:
        map_validation_errors(err, raw, diags)
        return None
    if diags.errors:
        return None
    spec._spans = dict(raw.spans)
    spec._key_spans = dict(raw.key_spans)
    spec._path = path
    return spec


def load(path: str | Path, *, allow_extends_outside: bool = False) -> Spec:
    """Load a spec from ``.yaml``/``.yml``/``.mem``; raises ``SpecError`` with all problems.

    ``extends`` may name only files inside :func:`extends_root` (after following
    symlinks) unless ``allow_extends_outside`` is true."""
    p = Path(path)
    diags = Collector()
    root = None if allow_extends_outside else extends_root(p)
    raw = read_raw(p, diags, root=root)
    spec = spec_from_raw(raw, diags, str(p)) if raw is not None and not diags.errors else None
    diags.raise_if_errors()
    assert spec is not None
    return spec


def loads(text: str, fmt: str = "yaml", file: str = "<string>") -> Spec:
    """Load a spec from text (no ``extends``)."""
    diags = Collector()
    remember_source(file, text)
    raw = read_yaml(text, file, diags) if fmt == "yaml" else read_mem(text, file, diags)
    if raw is not None and raw.extends is not None:
        diags.error("extends needs a file to resolve against; use load(path)", raw.extends_span)
    spec = spec_from_raw(raw, diags) if raw is not None and not diags.errors else None
    diags.raise_if_errors()
    assert spec is not None
    return spec
