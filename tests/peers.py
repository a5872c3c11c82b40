"""The peers' pure-PyTorch references, loaded without their packages' Triton imports.

flash-linear-attention's ``fla/ops/<op>/naive.py`` files import only ``torch`` and
``einops``, but ``import fla.ops.<op>.naive`` runs ``fla/__init__.py``, which imports the
Triton kernels of every op.  :func:`fla_naive` loads one ``naive.py`` by file path instead,
so the references run on a CPU-only machine with just ``fla-core`` and ``einops``
installed (the ``test`` extra).  Tests that need a peer call :func:`fla_naive` and are
skipped, with the reason, when the peer is not installed.

Which convention of the peer a test matches is said in the test itself (the brief lists
the references whose chunked and recurrent forms disagree; tests trust the recurrent ones).
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest


def fla_root() -> Path | None:
    """The installed ``fla`` package folder (found without importing it), or None."""
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def fla_naive(op: str, file: str = "naive.py"):
    """The module ``fla/ops/<op>/<file>`` (e.g. ``fla_naive("gla")``), or skip the test."""
    root = fla_root()
    if root is None or importlib.util.find_spec("einops") is None:
        pytest.skip("flash-linear-attention (fla-core) and einops are not installed: pip install -e '.[test]'")
    path = root / "ops" / op / file
    if not path.is_file():
        pytest.skip(f"this fla-core has no {path.relative_to(root)}")
    name = f"_fla_peer_{op.replace('/', '_')}_{Path(file).stem}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
