"""The specs memspec ships, named from any folder: ``extends: memspec:deltanet``.

The shipped specs are the ``specs/`` folder of the repository, linked into the package
(``memspec/specs``) and carried by the wheel as package data (pyproject's package-data), so
``memspec:NAME`` resolves the same in a checkout and in an installed wheel.  ``NAME`` is a
file of that folder without its suffix (``deltanet``, ``variants/titans_mqar``); with a suffix
(``memspec:deltanet.mem``) it names that file exactly.
"""
from __future__ import annotations

import os
from pathlib import Path

PREFIX = "memspec:"
SUFFIXES = (".yaml", ".yml", ".mem")


def shipped_dir() -> Path:
    """The folder of the shipped specs (``memspec/specs``, resolved)."""
    return Path(os.path.realpath(Path(__file__).resolve().parent.parent.parent / "specs"))


def is_shipped_name(extends: str) -> bool:
    return extends.startswith(PREFIX)


def shipped_names() -> list[str]:
    """Every shipped spec as ``memspec:`` takes it (``deltanet``, ``variants/titans_mqar``), sorted."""
    root = shipped_dir()
    if not root.is_dir():
        return []
    names = {p.relative_to(root).with_suffix("").as_posix() for p in root.rglob("*") if p.suffix in SUFFIXES}
    return sorted(names)


def resolve_shipped(extends: str, prefer: str) -> tuple[Path | None, str | None]:
    """``(path, None)`` of the shipped spec ``memspec:NAME`` names, or ``(None, why)``.
    Without a suffix, a spec in the ``prefer`` format (``yaml`` or ``mem``: the extending
    file's) is taken before the other."""
    name = extends[len(PREFIX):]
    parts = name.split("/")
    if not name or any(p in ("", ".", "..") for p in parts) or "\\" in name or "\x00" in name:
        return None, "a shipped spec is named memspec:NAME or memspec:FOLDER/NAME (no '..', no leading '/')"
    root = shipped_dir()
    base = root.joinpath(*parts)
    if base.suffix in SUFFIXES:
        candidates = [base]
    else:
        order = (".mem", ".yaml", ".yml") if prefer == "mem" else (".yaml", ".yml", ".mem")
        candidates = [base.with_name(base.name + s) for s in order]
    for c in candidates:
        if c.is_file():
            return Path(os.path.realpath(c)), None
    return None, "no shipped spec of that name"


def shipped_equivalent(target: Path) -> str | None:
    """``memspec:NAME`` when a shipped spec has the name of ``target`` (a relative ``extends``
    that does not resolve, or leaves the folder tree, likely meant it), else None."""
    stem = target.with_suffix("").name
    names = shipped_names()
    for n in names:
        if n == stem:
            return PREFIX + n
    for n in names:
        if n.rsplit("/", 1)[-1] == stem:
            return PREFIX + n
    return None
