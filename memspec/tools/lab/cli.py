"""``memspec lab list`` and ``memspec lab run NAME [--seed S] [--out DIR]``."""
from __future__ import annotations

import json
import sys
from pathlib import Path

DEFAULT_OUT = "lab_results"
NO_PLOT = "matplotlib is not installed: no plot (install it with `pip install 'memspec[plot]'`)"


MAX_SEED = 2**31 - 1 - 1000  # bandwidth draws its stream with seed + 1000


def _seed(text: str) -> int:
    import argparse

    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid seed {text!r}: an integer from 0 to {MAX_SEED}") from None
    if not 0 <= n <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"seed {n} out of range: use 0 to {MAX_SEED}")
    return n


def add_arguments(s) -> None:
    sub = s.add_subparsers(dest="lab_command", metavar="{list,run}", parser_class=type(s))
    sub.add_parser("list", help="list the experiments")
    r = sub.add_parser("run", help="run one experiment: print its table, save table, numbers and plot")
    r.add_argument("name", help="an experiment (see `memspec lab list`)")
    r.add_argument("--seed", type=_seed, default=0, help=f"random seed, 0 to {MAX_SEED} (default 0)")
    r.add_argument("--out", default=DEFAULT_OUT,
                   help=f"folder for NAME.txt, NAME.json and NAME.png (default {DEFAULT_OUT})")


def main(args, usage_error) -> int:
    from . import REGISTRY, experiment, experiments, save_plot
    from ...pipeline.write import write_atomic
    from ...lang.errors import did_you_mean

    if args.lab_command == "list":
        width = max(len(n) for n in REGISTRY)
        for name, mod in experiments().items():
            print(f"{name.ljust(width)}  {mod.SUMMARY}")
        return 0
    if args.lab_command != "run":
        raise usage_error("say `memspec lab list` or `memspec lab run NAME`")
    if args.name not in REGISTRY:
        hint = did_you_mean(args.name, REGISTRY)
        raise usage_error(f"no experiment {args.name!r}" + (f"; {hint}" if hint else "")
                          + f" (experiments: {', '.join(REGISTRY)})")
    result = experiment(args.name).run(seed=args.seed)
    text = result.render()
    sys.stdout.write(text)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise usage_error(f"--out {args.out!r} is a file, not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
        write_atomic(out / f"{result.name}.txt", text)
        write_atomic(out / f"{result.name}.json", json.dumps(result.values, indent=1, default=float) + "\n")
        path = save_plot(result, out)
    except OSError as err:
        raise usage_error(f"cannot write to {args.out!r}: {err.strerror or err}") from None
    print(f"wrote {out / (result.name + '.txt')}, {out / (result.name + '.json')}"
          + (f", {path}" if path else ""))
    if path is None and result.plot is not None:
        print(NO_PLOT)
    return 0
