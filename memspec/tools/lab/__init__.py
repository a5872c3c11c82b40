"""The lab: the seed course's experiments, reproduced from specs (``memspec lab``).

Each experiment is one module with ``NAME``, ``SUMMARY`` and ``run(seed=0) -> Result``
(a :class:`~memspec.lab.common.Result`: tables, numbers, an optional plot).
:data:`REGISTRY` lists them in order.  Every number comes from a spec in
``specs/lab/`` (``specs/lab/seed_titans.yaml`` among them) run by memspec.  Modules are imported
on first use, so that ``import memspec.lab`` stays cheap.
"""
from __future__ import annotations

import importlib
from types import ModuleType

# experiment name -> module (memspec.lab.<module>)
REGISTRY = {
    "drift": "drift",
    "characters": "characters",
    "bandwidth": "bandwidth",
    "seed-memory": "seed_memory",
    "interference": "interference",
}

__all__ = ["REGISTRY", "experiment", "experiments", "run_experiment", "save_plot"]


def experiment(name: str) -> ModuleType:
    """The module of experiment ``name`` (KeyError if there is none)."""
    return importlib.import_module(f"{__name__}.{REGISTRY[name]}")


def experiments() -> dict[str, ModuleType]:
    return {name: experiment(name) for name in REGISTRY}


def run_experiment(name: str, seed: int = 0):
    """Run one experiment by name; returns its :class:`~memspec.lab.common.Result`."""
    return experiment(name).run(seed=seed)


def save_plot(result, out):
    from .common import save_plot as _save

    return _save(result, out)
