"""memspec: fast-weight memories as specs, compiled to PyTorch.

Pipeline (one module per phase)::

    spec file --frontend--> Spec --graph.lower--> networkx DiGraph --checks.verify-->
    --schedule.analyse--> Schedule --codegen--> compiled/<name>.py --torch.compile-->
"""
from .errors import Diagnostic, Span, SpecError
from .expr import parse_expr
from .frontend import load, loads
from .spec import Spec
from .graph import lower
from .checks import check
from .build import build, compile  # noqa: A004  (memspec.compile: spec -> compiled/<name>.py)
from .diff import diff, graph_diff  # memspec.diff(a, b) -> typed edits (the module: memspec.diff via from-imports)

__version__ = "0.1.0"

__all__ = ["build", "check", "compile", "diff", "graph_diff", "lower", "Diagnostic", "Span", "Spec", "SpecError", "load", "loads", "parse_expr", "__version__"]
