"""The `memspec` command line.

Exit status: 0 success, 1 invalid spec (or, for `diff`, specs differ), 2 usage error,
70 internal error (a bug in memspec: one line names it; ``--debug`` or ``MEMSPEC_DEBUG=1``
prints the traceback).  Each subcommand is a function ``cmd_<name>(args) -> int``
registered in ``build_parser``.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

from ..lang.errors import Diagnostic, SpecError, printable
from ..lang.limits import clip
from ..pipeline.write import WriteError

EXIT_INTERNAL = 70   # sysexits' EX_SOFTWARE: not 0, 1 or 2, which mean ok, invalid spec, usage


class Options:
    """Settings of the whole command line (set by ``main`` from the global flags)."""

    allow_extends_outside = False


class UsageError(Exception):
    pass


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows each option's default, except where there is nothing to show (a flag off,
    no value) or the help text says it already."""

    def _get_help_string(self, action):
        d = action.default
        if d is None or d is False or d is argparse.SUPPRESS or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse exits 2 on usage errors; keep that, without a traceback
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def _print_diags(diags: list[Diagnostic]) -> None:
    for d in diags:
        print(d.render(), file=sys.stderr)


def load_checked(path: str, *, warnings: bool = True):
    """:func:`memspec.pipeline.build.load_checked`, printing the warnings; returns the
    :class:`~memspec.pipeline.build.Checked` or raises SpecError."""
    from ..pipeline.build import load_checked as pipeline_load

    checked = pipeline_load(path, allow_extends_outside=Options.allow_extends_outside)
    if warnings:
        _print_diags(list(checked.warnings))
    return checked


# ------------------------------------------------------------------ commands
def expand_spec_paths(paths: list[str]) -> list[str]:
    """Files as given; a directory stands for the spec files under it (sorted; symlinked
    folders are not followed).  A directory with no spec file is a usage error."""
    out: list[str] = []
    for p in paths:
        d = Path(p)
        if d.is_dir():
            found = [str(f) for f in sorted(d.rglob("*")) if f.suffix in (".yaml", ".yml", ".mem")]
            if not found:
                raise UsageError(f"{printable(clip(p, 200))}: no spec files (*.yaml, *.yml, *.mem) in this folder")
            out.extend(found)
        else:
            out.append(p)
    return out


def cmd_check(args) -> int:
    """Everything ``compile`` refuses: the checks and the schedule decision."""
    from ..lang.frontend.inherit import inherited_metadata
    from ..pipeline.build import decide

    status = 0
    for path in expand_spec_paths(args.files):
        try:
            spec = load_checked(path).spec
            decide(spec)
        except SpecError as err:
            _print_diags(err.diagnostics)
            status = 1
            continue
        if not args.quiet:
            print(f"{printable(path)}: ok{metadata_note(inherited_metadata(spec))}")
    return status


def metadata_note(inherited: list[tuple[str, str]]) -> str:
    """`` (inherits description and cite from titans.yaml: ...)`` for ``check``'s ok line."""
    if not inherited:
        return ""
    by_file: dict[str, list[str]] = {}
    for key, file in inherited:
        by_file.setdefault(file, []).append(key)
    parts = [f"{' and '.join(keys)} from {printable(file)}" for file, keys in by_file.items()]
    return f" (inherits {' and '.join(parts)}: text about the base; give the variant its own, or null to drop it)"


def cmd_fmt(args) -> int:
    from ..lang.fmt import to_mem, to_yaml
    from ..lang.frontend import format_of, load

    spec = load(args.file, allow_extends_outside=Options.allow_extends_outside)
    target = args.to or format_of(args.file)
    text = to_yaml(spec) if target == "yaml" else to_mem(spec)
    if args.write:
        from ..pipeline.write import write_atomic

        out = Path(args.file)
        if args.to and args.to != format_of(args.file):
            out = out.with_suffix(".yaml" if args.to == "yaml" else ".mem")
        write_atomic(out, text)
        print(f"wrote {out}")
    else:
        sys.stdout.write(text)
    return 0


def cmd_graph(args) -> int:
    from ..check.graph import render

    graph = load_checked(args.file).graph
    if args.format in ("svg", "png"):
        return _graphviz(render(graph, "dot"), args.format, args.output)
    text = render(graph, args.format)
    if args.output:
        from ..pipeline.write import write_atomic

        write_atomic(Path(args.output), text)
    else:
        sys.stdout.write(text)
    return 0


GRAPHVIZ_HINT = (
    "install Graphviz (Debian/Ubuntu: `apt install graphviz`, macOS: `brew install graphviz`, "
    "conda: `conda install graphviz`), or use --format mermaid or --format dot"
)


def _graphviz(dot_text: str, fmt: str, output: str | None) -> int:
    """Render DOT text to svg/png with the `dot` program (Graphviz)."""
    import shutil
    import subprocess

    exe = shutil.which("dot")
    if exe is None:
        print(f"memspec: error: --format {fmt} needs the Graphviz `dot` program, which is not installed",
              file=sys.stderr)
        print(f"    hint: {GRAPHVIZ_HINT}", file=sys.stderr)
        return 2
    proc = subprocess.run([exe, f"-T{fmt}"], input=dot_text.encode("utf-8"), capture_output=True)
    if proc.returncode != 0:
        print(f"memspec: error: dot failed: {proc.stderr.decode('utf-8', 'replace').strip()}", file=sys.stderr)
        return 1
    if output:
        from ..pipeline.write import write_atomic

        write_atomic(Path(output), proc.stdout)
    else:
        sys.stdout.flush()
        sys.stdout.buffer.write(proc.stdout)
    return 0


def cmd_diff(args) -> int:
    import os

    from .diff import diff, graph_edits, lower_graph, render_dot, render_json, render_markdown, render_text

    try:
        a, b = load_checked(args.a, warnings=False).spec, load_checked(args.b, warnings=False).spec
    except SpecError as err:  # like diff(1): trouble is exit status 2
        _print_diags(err.diagnostics)
        return 2
    edits = diff(a, b)
    graph: list | None = None
    if args.format == "dot" or (edits and not args.no_graph):
        ga, gb = lower_graph(a), lower_graph(b)
        graph = graph_edits(ga, gb) if edits else []
    status = 1 if edits else 0
    if args.format == "dot":
        text = render_dot(ga, gb, title=f"{a.name} -> {b.name}")
    elif args.format == "json":
        text = render_json(edits, graph)
    elif args.format == "markdown":
        heading = f"`{args.a}` → `{args.b}`"
        text = render_markdown(edits, heading=heading)
        if graph:
            text += "\n" + render_markdown(graph, heading="dataflow graph")
    else:
        color = sys.stdout.isatty() and "NO_COLOR" not in os.environ
        text = ""
        if edits:
            text = render_text(edits, color=color, heading=f"--- {args.a}\n+++ {args.b}")
        if graph:
            text += render_text(graph, color=color)
    sys.stdout.write(text)
    return status


def cmd_table(args) -> int:
    from .table import render_table, rows

    specs = [load_checked(p, warnings=False).spec for p in args.files]
    sys.stdout.write(render_table(rows(specs), args.format))
    return 0


def cmd_lab(args) -> int:
    from .lab.cli import main as lab_main

    return lab_main(args, UsageError)


def cmd_explain(args) -> int:
    from ..pipeline.build import decide
    from ..schedule import explain

    status = 0
    for path in args.files:
        try:
            spec = load_checked(path).spec
            decision = decide(spec)
            sys.stdout.write(brief(spec, decision) if args.brief else explain(spec, decision))
        except SpecError as err:
            _print_diags(err.diagnostics)
            status = 1
    return status


def brief(spec, d) -> str:
    """``explain --brief``: the schedule, whether it is exact, the chunk, and one line of why."""
    from ..schedule.decide import BY_NAME, NAMES

    forced = [r for r in d.reasons if r.startswith("forced by")]
    rejected = [f"{f}: {why}" for f, why in d.rejected if NAMES.index(f) < NAMES.index(d.family) and f != "cache"]
    if forced:
        why = forced[0]
    elif d.normal_form:
        why = "normal form " + "; ".join(d.normal_form)
    elif d.family == "online" and rejected:
        why = f"no faster schedule ({rejected[0]})"
    else:
        why = d.reasons[0] if d.reasons else "-"
    lines = [f"{spec.name}: {d.family}" + (f"({d.chunk})" if d.chunk and d.family != "cache" else ""),
             "  exact: " + BY_NAME[d.family].exact_line(d.exact, d.plan),
             f"  chunk: {d.chunk if d.chunk and d.family != 'cache' else '-'}",
             f"  admits: {', '.join(d.admits)}",
             f"  why: {why}"]
    return "\n".join(lines) + "\n"


def cmd_compile(args) -> int:
    from ..pipeline.build import compile_with_decision, decision_text

    status, checked = 0, []
    paths: dict[str, str] = {}
    for p in args.files:             # a file named twice is compiled once
        paths.setdefault(os.path.realpath(p), p)
    for path in paths.values():      # every spec loaded and checked before anything is written
        try:
            checked.append(load_checked(path))
        except SpecError as err:
            _print_diags(err.diagnostics)
            status = 1
    clashes = name_clashes(checked)
    if clashes:
        _print_diags(clashes)
        return 1
    for c in checked:
        try:
            out, decision = compile_with_decision(c, args.output)
            print(f"wrote {printable(str(out))} ({decision_text(decision)})")
        except SpecError as err:
            _print_diags(err.diagnostics)
            status = 1
        except WriteError as err:
            print(f"memspec: error: cannot write {printable(str(err.path))}: {err.reason}", file=sys.stderr)
            return 2
    return status


def name_clashes(checked: list) -> list[Diagnostic]:
    """An error at the ``name`` of every spec whose name an earlier one has (both would write
    ``<out>/<name>.py``)."""
    first: dict[str, str] = {}
    out = []
    for c in checked:
        name = c.spec.name
        if name in first:
            out.append(Diagnostic("error", f"two specs named {name!r}: {printable(str(first[name]))} and this one "
                                  f"would both write {name}.py", c.spec.key_span("name"),
                                  hint="give each spec its own `name`; nothing was written"))
        else:
            first[name] = c.path
    return out


@contextlib.contextmanager
def torch_threads(n: int | None):
    """``--threads N``: torch's intra-op threads while the command runs (None: torch's choice)."""
    if n is None:
        yield
        return
    if n < 1:
        raise UsageError(f"--threads must be >= 1, got {n}")
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def cmd_bench(args) -> int:
    from .bench import run_cli

    with torch_threads(args.threads):
        return run_cli(args, load_checked, UsageError)


def cmd_train(args) -> int:
    from .train import run_cli as train_cli

    with torch_threads(args.threads):
        return train_cli(args, UsageError)


THREADS_HELP = ("CPU threads torch runs on (torch.set_num_threads; default: torch's choice, one per core); "
                "on a shared machine 1 is often fastest")
SCHEDULE_HELP = ("run the memory with this schedule instead of the spec's own: the spec syntax, e.g. online, "
                 "chunk(64), minibatch(16), apply_update(64) or auto")


TRAIN_DEFAULTS = {"steps": 300, "batch": 32, "seq_len": 64, "pairs": 8, "gap": 0, "vocab": 64, "d_model": 64,
                  "layers": 2, "heads": 4, "lr": 5e-3, "seed": 0, "eval_size": 256, "lr_schedule": "cosine"}
"""memspec.tools.train.TrainConfig's defaults, for ``--help`` (which does not import torch; a test
keeps the two equal).  The options themselves default to None: the config's own value."""


def cmd_export(args) -> int:
    from .export import run_cli as export_cli

    return export_cli(args, UsageError)


def _train_arguments(s, compare: bool) -> None:
    """Options of `train` and `compare` (defaults: memspec.train.TrainConfig)."""
    s.add_argument("files", nargs="+" if compare else 1, metavar="SPEC")
    s.add_argument("--task", choices=["mqar", "text"], default="mqar",
                   help="mqar (synthetic recall) or text (bytes of a folder's text files; metric: bits per byte)")
    s.add_argument("--data", metavar="DIR", help="text task: the corpus folder (default: the running Python's "
                   "standard library, its *.py files)")
    for flag, kind, dest, help_ in [
        ("--steps", int, "steps", "optimizer steps"), ("--batch", int, "batch", "global batch (sequences)"),
        ("--seq-len", int, "seq_len", "tokens per sequence"), ("--pairs", int, "pairs", "key-value pairs"),
        ("--gap", int, "gap", "pad tokens between the pairs and the queries"),
        ("--vocab", int, "vocab", "vocabulary size"), ("--d-model", int, "d_model", "model width"),
        ("--layers", int, "layers", "blocks"), ("--heads", int, "heads", "memory heads"),
        ("--lr", float, "lr", "peak learning rate"), ("--seed", int, "seed", "seed (model and data)"),
        ("--eval-size", int, "eval_size", "held-out sequences")]:
        s.add_argument(flag, type=kind, dest=dest, help=f"{help_} (default: {TRAIN_DEFAULTS[dest]})")
    s.add_argument("--lr-schedule", choices=["cosine", "constant"], dest="lr_schedule",
                   help=f"learning-rate schedule after the warm-up (default: {TRAIN_DEFAULTS['lr_schedule']})")
    s.add_argument("--schedule", metavar="SCHEDULE", help=SCHEDULE_HELP)
    s.add_argument("--threads", type=int, metavar="N", help=THREADS_HELP)
    s.add_argument("--dim", action="append", metavar="NAME=N",
                   help="set a build-time dim of the memory (e.g. hidden=32, chunk=16); ignored by specs without it")
    s.add_argument("--compile", action="store_true", help="torch.compile the memory steps")
    s.add_argument("--pack", action="store_true",
                   help="train on the batch's sequences packed into one row (cu_seqlens: each runs alone)")
    s.add_argument("--context-parallel", type=int, metavar="P", dest="context_parallel",
                   help="under torchrun with k x P processes: every sequence split over P of them (memspec.parallel), "
                        "k data-parallel replicas")
    s.add_argument("--out", help="folder for log.json and checkpoint.pt" + (" (one subfolder per spec)" if compare else ""))
    s.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    if not compare:
        s.add_argument("--save-hf", metavar="DIR", dest="save_hf",
                       help="also write the trained model as a Hugging Face folder (as `memspec export`)")
    if compare:
        s.add_argument("--seeds", type=int, default=3,
                       help="seeds per spec (seed, seed + 1, ...; the same batches for every spec)")
        s.add_argument("--json", metavar="PATH", help="also write the table as JSON here (--out writes table.json)")
    s.set_defaults(compare=compare)


def _bench_arguments(s) -> None:
    """Options of `bench`."""
    s.add_argument("files", nargs="+")
    s.add_argument("--T", type=int, default=2048, help="tokens per sequence")
    s.add_argument("--B", type=int, default=1, help="sequences")
    s.add_argument("--H", type=int, default=4, help="heads")
    s.add_argument("--D", type=int, default=64, help="d_k = d_v = D (other dims keep the spec's sizes)")
    s.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the memory runs")
    s.add_argument("--dtype", choices=["float32", "bfloat16", "float64"], default="float32", help="inputs' dtype")
    s.add_argument("--repeat", type=int, default=5, help="timed runs per schedule (median reported)")
    s.add_argument("--grad", action="store_true", help="time forward + backward")
    s.add_argument("--compile", action="store_true", help="build with torch.compile (first-call time includes it)")
    s.add_argument("--schedules", help="comma-separated subset of the schedules the specs run (default: all)")
    s.add_argument("--threads", type=int, metavar="N", help=THREADS_HELP)
    s.add_argument("--json", help="write the JSON record here")


def _global_flags(p: argparse.ArgumentParser, top: bool) -> None:
    """Flags every subcommand takes too (``memspec --debug check x`` = ``memspec check --debug x``)."""
    d = {} if top else {"default": argparse.SUPPRESS}
    p.add_argument("--debug", action="store_true", help="on an internal error, print the traceback "
                   "(also: MEMSPEC_DEBUG=1)", **d)
    p.add_argument("--allow-extends-outside", action="store_true",
                   help="let `extends` name files outside the spec's folder tree", **d)


def _reading_commands(sub) -> None:
    """The commands that read specs without running them (check, fmt, graph, diff, table)."""
    s = sub.add_parser("check", help="validate spec files: everything compile refuses, the schedule decision "
                                     "included (all errors, located)")
    s.add_argument("files", nargs="+")
    s.add_argument("-q", "--quiet", action="store_true")
    s.set_defaults(func=cmd_check)

    s = sub.add_parser("fmt", help="print a spec in canonical form (or convert between YAML and .mem)")
    s.add_argument("file")
    s.add_argument("--to", choices=["yaml", "mem"], help="the output's syntax (default: the input's)")
    s.add_argument("-w", "--write", action="store_true", help="write the result next to the input")
    s.set_defaults(func=cmd_fmt)

    s = sub.add_parser("graph", help="print the dataflow graph of one token step")
    s.add_argument("file")
    s.add_argument("--format", choices=["text", "dot", "mermaid", "svg", "png"], default="text",
                   help="svg and png need Graphviz's `dot` program")
    s.add_argument("-o", "--output")
    s.set_defaults(func=cmd_graph)

    s = sub.add_parser("diff", help="semantic diff of two specs (exit 0 equal, 1 different, 2 trouble)")
    s.add_argument("a")
    s.add_argument("b")
    s.add_argument("--format", choices=["text", "markdown", "json", "dot"], default="text", help="output form")
    s.add_argument("--no-graph", action="store_true", help="leave out the dataflow-graph edits")
    s.set_defaults(func=cmd_diff)

    s = sub.add_parser("table", help="comparison table of specs (one row per spec)")
    s.add_argument("files", nargs="+")
    s.add_argument("--format", choices=["markdown", "text", "csv"], default="markdown", help="output form")
    s.set_defaults(func=cmd_table)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="memspec", description="Fast-weight memories as specs, compiled to PyTorch.",
                formatter_class=_HelpFormatter)
    p.add_argument("--version", action="store_true", help="print the version and exit")
    _global_flags(p, top=True)
    sub = p.add_subparsers(dest="command", parser_class=_Parser)
    _add_parser = sub.add_parser

    def add_parser(*a, **kw):
        kw.setdefault("formatter_class", _HelpFormatter)
        s = _add_parser(*a, **kw)
        _global_flags(s, top=False)
        return s

    sub.add_parser = add_parser   # every subcommand, including those registered elsewhere (lab, _EXTRA_COMMANDS)

    _reading_commands(sub)

    s = sub.add_parser("lab", help="the seed course's experiments, reproduced from specs (list, run NAME)")
    from .lab.cli import add_arguments as _lab_arguments
    _lab_arguments(s)
    s.set_defaults(func=cmd_lab)

    s = sub.add_parser("explain", help="the derived schedule of each spec and the algebra behind it")
    s.add_argument("files", nargs="+")
    s.add_argument("--brief", action="store_true", help="a few lines per spec: schedule, exact, chunk, why")
    s.set_defaults(func=cmd_explain)

    s = sub.add_parser("compile", help="generate the standalone PyTorch module of each spec (compiled/<name>.py)")
    s.add_argument("files", nargs="+")
    s.add_argument("-o", "--output", default="compiled", help="output folder")
    s.set_defaults(func=cmd_compile)

    s = sub.add_parser("bench", help="time every schedule a spec admits, side by side (writes JSON)")
    _bench_arguments(s)
    s.set_defaults(func=cmd_bench)

    s = sub.add_parser("train", help="train a small LM with the memory on a synthetic task (MQAR)")
    _train_arguments(s, compare=False)
    s.set_defaults(func=cmd_train)

    s = sub.add_parser("compare", help="train each spec under the same budget for several seeds "
                                       "(mean / min / max accuracy; Markdown and JSON)")
    _train_arguments(s, compare=True)
    s.set_defaults(func=cmd_train)

    s = sub.add_parser("export", help="write a Hugging Face model folder of a spec (config.json, modeling file, "
                                      "compiled module, safetensors weights; loads without memspec)")
    from .export import add_arguments as _export_arguments
    _export_arguments(s)
    s.set_defaults(func=cmd_export)

    # --- further subcommands register here (compile, explain, bench, diff, table, lab, train)
    for register in _EXTRA_COMMANDS:
        register(sub)
    return p


_EXTRA_COMMANDS: list = []


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        from .. import __version__

        print(f"memspec {__version__}")
        return 0
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    debug = args.debug or os.environ.get("MEMSPEC_DEBUG", "") not in ("", "0")
    Options.allow_extends_outside = args.allow_extends_outside
    try:
        return args.func(args)
    except SpecError as err:
        _print_diags(err.diagnostics)
        return 1
    except UsageError as err:
        print(f"memspec: error: {err}", file=sys.stderr)
        return 2
    except WriteError as err:
        print(f"memspec: error: cannot write {printable(str(err.path))}: {err.reason}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as err:  # a bug in memspec (or its environment): one line, no traceback
        if debug:
            import traceback

            traceback.print_exc()
        print(internal_error_line(err, debug), file=sys.stderr)
        return EXIT_INTERNAL
    finally:
        Options.allow_extends_outside = False


def internal_error_line(err: BaseException, debug: bool = False) -> str:
    """The one line an internal error prints: what failed, and how to see more."""
    what = printable(clip(str(err), 300)) or "(no message)"
    more = "" if debug else "; run with --debug (or MEMSPEC_DEBUG=1) for the traceback"
    return f"memspec: internal error: {type(err).__name__}: {what} (a bug in memspec{more})"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
