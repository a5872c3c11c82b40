"""The `memspec` command line.

Exit status: 0 success, 1 invalid spec (or, for `diff`, specs differ), 2 usage error.
Each subcommand is a function ``cmd_<name>(args) -> int`` registered in ``build_parser``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .errors import Diagnostic, SpecError


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse exits 2 on usage errors; keep that, without a traceback
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def _print_diags(diags: list[Diagnostic]) -> None:
    for d in diags:
        print(d.render(), file=sys.stderr)


def load_checked(path: str, *, warnings: bool = True):
    """Load and verify a spec; print every diagnostic; return (spec, graph) or raise SpecError."""
    from .checks import check
    from .frontend import load

    spec = load(path)
    graph, diags = check(spec)
    errors = [d for d in diags if d.severity == "error"]
    if errors:
        raise SpecError(diags)
    if warnings:
        _print_diags([d for d in diags if d.severity == "warning"])
    return spec, graph


# ------------------------------------------------------------------ commands
def cmd_check(args) -> int:
    status = 0
    for path in args.files:
        try:
            load_checked(path)
        except SpecError as err:
            _print_diags(err.diagnostics)
            status = 1
            continue
        if not args.quiet:
            print(f"{path}: ok")
    return status


def cmd_fmt(args) -> int:
    from .fmt import to_mem, to_yaml
    from .frontend import format_of, load

    spec = load(args.file)
    target = args.to or format_of(args.file)
    text = to_yaml(spec) if target == "yaml" else to_mem(spec)
    if args.write:
        from .emit import write_atomic

        out = Path(args.file)
        if args.to and args.to != format_of(args.file):
            out = out.with_suffix(".yaml" if args.to == "yaml" else ".mem")
        write_atomic(out, text)
        print(f"wrote {out}")
    else:
        sys.stdout.write(text)
    return 0


def cmd_graph(args) -> int:
    from .graph import render

    spec, graph = load_checked(args.file)
    text = render(graph, args.format)
    if args.output:
        from .emit import write_atomic

        write_atomic(Path(args.output), text)
    else:
        sys.stdout.write(text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="memspec", description="Fast-weight memories as specs, compiled to PyTorch.")
    p.add_argument("--version", action="store_true", help="print the version and exit")
    sub = p.add_subparsers(dest="command", parser_class=_Parser)

    s = sub.add_parser("check", help="validate spec files (all errors, located)")
    s.add_argument("files", nargs="+")
    s.add_argument("-q", "--quiet", action="store_true")
    s.set_defaults(func=cmd_check)

    s = sub.add_parser("fmt", help="print a spec in canonical form (or convert between YAML and .mem)")
    s.add_argument("file")
    s.add_argument("--to", choices=["yaml", "mem"])
    s.add_argument("-w", "--write", action="store_true", help="write the result next to the input")
    s.set_defaults(func=cmd_fmt)

    s = sub.add_parser("graph", help="print the dataflow graph of one token step")
    s.add_argument("file")
    s.add_argument("--format", choices=["text", "dot", "mermaid"], default="text")
    s.add_argument("-o", "--output")
    s.set_defaults(func=cmd_graph)

    # --- further subcommands register here (compile, explain, bench, diff, table, lab, train)
    for register in _EXTRA_COMMANDS:
        register(sub)
    return p


_EXTRA_COMMANDS: list = []


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        from . import __version__

        print(f"memspec {__version__}")
        return 0
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    try:
        return args.func(args)
    except SpecError as err:
        _print_diags(err.diagnostics)
        return 1
    except UsageError as err:
        print(f"memspec: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
