"""The names generated code binds itself, and fresh local names.

One list, used by the checks (a spec may not declare these names) and by the code
generator (it never binds a local that could collide with them):

* :data:`MODULE_NAMES` -- what every generated module imports at its top level;
* :data:`LOCAL_NAMES` -- names the generated methods bind themselves (``self``, the
  ``state`` dict, the ``schedule`` argument, the Layer's ``x`` and ``o``);
* :data:`PARAMETER_NAMES` -- fixed parameter names of generated methods
  (``forward(..., **unknown)``, ``__init__(..., chunk=)``);
* :data:`LANGUAGE_NAMES` -- names with a fixed meaning in the language (a gate formula's
  ``logit``, the inner ``loss``).

The module-level functions and classes the generated code defines are copied by source
from :mod:`memspec.runtime` (helpers named after the language's functions, ``_``-private
ones, ``chunk_delta``, ``chunk_additive``, the wiring's ``Attention``, ``MAC``, ...):
:func:`runtime_names` reads their names from those files, so the list cannot drift from
what is emitted, and :func:`class_names` gives the spec's own classes.  A spec may declare
none of them; ``memspec.pipeline.source_check`` checks every generated module against
the spec's names as a backstop.  :func:`shadows_module`: a spec name that would make
``compiled/<name>.py`` shadow an importable module (``torch``, ``math``, ``time``, ...).
"""
from __future__ import annotations

import ast
import keyword
import sys
from functools import lru_cache
from importlib import resources

MODULE_NAMES = frozenset({"torch", "nn", "F", "math", "time", "warnings"})
LOCAL_NAMES = frozenset({"self", "state", "schedule", "x", "o"})
PARAMETER_NAMES = frozenset({"unknown", "chunk"})
LANGUAGE_NAMES = frozenset({"logit", "loss"})

GENERATED_NAMES = MODULE_NAMES | LOCAL_NAMES
"""Names the generated code binds at module level or as locals."""

RESERVED_NAMES = GENERATED_NAMES | PARAMETER_NAMES | LANGUAGE_NAMES
"""Names a spec may not declare."""


@lru_cache(maxsize=None)
def runtime_names() -> frozenset:
    """Top-level functions and classes of ``memspec/runtime/*.py`` (read with ``ast``; torch
    is not imported): the names the code copied into generated modules binds."""
    names: set = set()
    for entry in resources.files("memspec.runtime").iterdir():
        if entry.name.endswith(".py"):
            tree = ast.parse(entry.read_text(encoding="utf-8"))
            names |= {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    return frozenset(names)


def class_name(name: str) -> str:
    """``gated_deltanet`` -> ``GatedDeltanet``."""
    return "".join(p[:1].upper() + p[1:] for p in name.split("_") if p) or "Spec"


def class_names(spec_name: str) -> frozenset:
    """The classes a spec's generated module defines."""
    c = class_name(spec_name)
    return frozenset({f"{c}Memory", f"{c}Layer", f"{c}MemoryLayer"})


SHADOWED_PACKAGES = frozenset({"torch", "numpy", "memspec"})


def shadows_module(name: str) -> bool:
    """``compiled/<name>.py`` would shadow a module for code run in that folder: a standard
    library module, torch, numpy or memspec (the generated code and memspec import them)."""
    return name in SHADOWED_PACKAGES or name in MODULE_NAMES or name in getattr(sys, "stdlib_module_names", ())


def fresh(base: str, taken: set) -> str:
    """``base`` or ``base_2``, ``base_3``, ... -- the first not in ``taken`` (then taken)."""
    name, i = base, 2
    while name in taken or keyword.iskeyword(name):
        name = f"{base}_{i}"
        i += 1
    taken.add(name)
    return name
