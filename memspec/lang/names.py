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

Module-level helpers the generated code defines are named after the language's
functions (never spec identifiers) or start with ``_`` (which spec identifiers cannot).
"""
from __future__ import annotations

import keyword

MODULE_NAMES = frozenset({"torch", "nn", "F", "math", "time", "warnings"})
LOCAL_NAMES = frozenset({"self", "state", "schedule", "x", "o"})
PARAMETER_NAMES = frozenset({"unknown", "chunk"})
LANGUAGE_NAMES = frozenset({"logit", "loss"})

GENERATED_NAMES = MODULE_NAMES | LOCAL_NAMES
"""Names the generated code binds at module level or as locals."""

RESERVED_NAMES = GENERATED_NAMES | PARAMETER_NAMES | LANGUAGE_NAMES
"""Names a spec may not declare."""


def fresh(base: str, taken: set) -> str:
    """``base`` or ``base_2``, ``base_3``, ... -- the first not in ``taken`` (then taken)."""
    name, i = base, 2
    while name in taken or keyword.iskeyword(name):
        name = f"{base}_{i}"
        i += 1
    taken.add(name)
    return name
