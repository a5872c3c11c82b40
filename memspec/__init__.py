"""memspec: fast-weight memories as specs, compiled to PyTorch.

The phases, one package each, importing only downward::

    spec file --lang.frontend--> Spec --check (graph.lower, verify)--> networkx DiGraph, diagnostics
      --schedule.analyse--> ScheduleDecision --codegen--> compiled/<name>.py (imports only torch)

:mod:`memspec.pipeline.build` is the one load -> check -> decide -> generate -> write path
(:func:`build`, :func:`compile`); :mod:`memspec.reference` is the token-by-token oracle,
:mod:`memspec.runtime` the torch-only code generated modules carry, :mod:`memspec.tools` the
command line and its tools, :mod:`memspec.hf` the Hugging Face model (the ``hf`` extra).
Importing memspec does not import torch: torch loads when code is generated or run, so
reading, checking and comparing specs starts fast.
"""
from .lang.errors import Diagnostic, Span, SpecError
from .lang.expr import parse_expr
from .lang.frontend import load, loads
from .lang.spec import Spec
from .check.graph import lower
from .check.verify import check
from .pipeline.build import build, compile  # noqa: A004  (memspec.compile: spec -> compiled/<name>.py)
from .tools.diff import diff, graph_diff  # memspec.diff(a, b) -> typed edits (the module: memspec.diff via from-imports)

__version__ = "0.1.0"

__all__ = ["build", "check", "compile", "diff", "graph_diff", "lower", "Diagnostic", "Span", "Spec", "SpecError", "load", "loads", "parse_expr", "__version__"]
