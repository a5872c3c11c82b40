"""memspec: fast-weight memories as specs, compiled to PyTorch.

Pipeline (one module per phase)::

    spec file --frontend--> Spec --graph.lower--> networkx DiGraph --checks.verify-->
    --schedule.analyse--> Schedule --codegen--> compiled/<name>.py --torch.compile-->
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
