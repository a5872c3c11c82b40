"""The command line as a user meets it: the same loading options everywhere, `check` refusing
what `compile` refuses, `extends: memspec:NAME`, `--threads`, `--schedule`, `explain --brief`,
defaults in `--help`, and commands that start without importing torch."""
from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from memspec.tools.cli import main

ROOT = Path(__file__).resolve().parent.parent
SPECS = ROOT / "specs"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip())
    return path


# ------------------------------------------------------------------ small reliability leftovers
def test_bench_refuses_an_unknown_schedule(capsys):
    assert main(["bench", str(SPECS / "deltanet.yaml"), "--schedules", "bogus,online", "--T", "4"]) == 2
    err = capsys.readouterr().err
    assert "unknown schedule 'bogus'" in err and "delta" in err and "Traceback" not in err


def test_bench_refuses_schedules_a_spec_does_not_run(capsys):
    # deltanet admits dplr, but its module carries delta, minibatch and online
    assert main(["bench", str(SPECS / "deltanet.yaml"), "--schedules", "dplr", "--T", "4"]) == 2
    err = capsys.readouterr().err
    assert "runs none of them" in err and "delta, minibatch, online" in err


def test_compile_of_two_specs_with_one_name_writes_nothing(tmp_path, capsys):
    a = shutil.copy(SPECS / "deltanet.yaml", tmp_path / "a.yaml")
    b = shutil.copy(SPECS / "deltanet.mem", tmp_path / "b.mem")
    out = tmp_path / "out"
    assert main(["compile", str(a), str(b), "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert "two specs named 'deltanet'" in err and "b.mem:1:8" in err and "nothing was written" in err
    assert not out.exists()
    # the same file named twice is compiled once
    assert main(["compile", str(a), str(a), "-o", str(out)]) == 0
    assert [p.name for p in out.iterdir()] == ["deltanet.py"]
