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


# ------------------------------------------------------------------ the same loading options everywhere
TINY = ["--steps", "2", "--batch", "2", "--seq-len", "16", "--pairs", "2", "--vocab", "16", "--d-model", "8",
        "--layers", "1", "--heads", "2", "--eval-size", "2", "--no-progress"]
BENCH_TINY = ["--T", "8", "--D", "4", "--H", "1", "--repeat", "1", "--schedules", "online"]


@pytest.fixture
def outside(tmp_path):
    """A spec extending a file outside its folder tree (tmp is no project): (child, parent)."""
    parent = shutil.copy(SPECS / "deltanet.yaml", (tmp_path / "a").mkdir() or tmp_path / "a" / "parent.yaml")
    child = write(tmp_path / "b" / "child.yaml", """
        extends: ../a/parent.yaml
        name: child
    """)
    return str(child), str(parent)


COMMANDS = {
    "check": lambda c, p, tmp: ["check", c],
    "fmt": lambda c, p, tmp: ["fmt", c],
    "graph": lambda c, p, tmp: ["graph", c],
    "explain": lambda c, p, tmp: ["explain", c],
    "compile": lambda c, p, tmp: ["compile", c, "-o", str(tmp / "out")],
    "table": lambda c, p, tmp: ["table", c],
    "diff": lambda c, p, tmp: ["diff", p, c],
    "bench": lambda c, p, tmp: ["bench", c, *BENCH_TINY],
    "train": lambda c, p, tmp: ["train", c, *TINY],
    "compare": lambda c, p, tmp: ["compare", c, *TINY, "--seeds", "1"],
    "export": lambda c, p, tmp: ["export", c, str(tmp / "hf"), "--vocab", "16", "--d-model", "8", "--layers", "1",
                                 "--heads", "2"],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_honours_allow_extends_outside(command, outside, tmp_path, capsys):
    if command == "export":
        pytest.importorskip("transformers")
        pytest.importorskip("safetensors")
    argv = COMMANDS[command](*outside, tmp_path)
    assert main(argv) == (2 if command == "diff" else 1)
    err = capsys.readouterr().err
    assert "points outside" in err and "pass --allow-extends-outside" in err
    assert main(["--allow-extends-outside", *argv]) == (1 if command == "diff" else 0)   # diff: the names differ
    err = capsys.readouterr().err
    assert "points outside" not in err and "--allow-extends-outside" not in err, err
    assert main([*argv, "--allow-extends-outside"]) == (1 if command == "diff" else 0)   # after the command too


# ------------------------------------------------------------------ check refuses what compile refuses
def _norm_child(folder: Path, suffix: str) -> Path:
    """A titans variant whose update leaves mini-batch form, inheriting `schedule: minibatch(64)`."""
    shutil.copy(SPECS / "titans.yaml", folder / "parent.yaml")
    if suffix == ".mem":
        return write(folder / "child.mem", """
            extends "parent.yaml"
            memory child
            update {
              U1 = mu * U1 - eta * grad(loss, W1)
              U2 = mu * U2 - eta * grad(loss, W2)
              W1 = l2norm(W1 + U1)
              W2 = (1 - alpha) * W2 + U2
            }
        """)
    return write(folder / "child.yaml", """
        extends: parent.yaml
        name: child
        update:
          - U1 = mu * U1 - eta * grad(loss, W1)
          - U2 = mu * U2 - eta * grad(loss, W2)
          - W1 = l2norm(W1 + U1)
          - W2 = (1 - alpha) * W2 + U2
    """)


@pytest.mark.parametrize("suffix", [".yaml", ".mem"])
def test_check_runs_the_schedule_analysis_and_names_an_inherited_setting(suffix, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    child = _norm_child(tmp_path, suffix)
    for command in (["check"], ["compile", "-o", "out"]):
        assert main([*command, child.name]) == 1
        err = capsys.readouterr().err
        line = _line_of(tmp_path / "parent.yaml", "schedule:")
        assert err.startswith(f"parent.yaml:{line}:11: error: schedule minibatch(64) needs gradient writes")
        assert f"({child.name} inherits schedule from parent.yaml through extends)" in err
        example = "`schedule auto`" if suffix == ".mem" else "`schedule: auto`"
        assert f"to override the inherited schedule, define it in {child.name} (e.g. {example})" in err
    assert not (tmp_path / "out").exists()
    line = "schedule auto\n" if suffix == ".mem" else "schedule: auto\n"
    child.write_text(child.read_text() + line)
    assert main(["check", child.name]) == 0
    assert capsys.readouterr().out.startswith(f"{child.name}: ok (inherits description and cite from parent.yaml")


def test_an_inherited_field_a_check_refuses_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copy(SPECS / "deltanet.yaml", tmp_path / "parent.yaml")
    write(tmp_path / "child.yaml", """
        extends: parent.yaml
        name: child
        gates:
          eta: null
    """)
    assert main(["check", "child.yaml"]) == 1
    err = capsys.readouterr().err
    assert "parent.yaml:34:13: error: unknown name 'eta' (child.yaml inherits update from parent.yaml" in err
    assert "define it in child.yaml" in err


def test_check_passes_every_shipped_spec(capsys):
    assert main(["check", "-q", str(SPECS)]) == 0
    assert capsys.readouterr().err == ""


# ------------------------------------------------------------------ --threads, --schedule, --brief, --help
def test_threads_sets_torch_threads_for_the_command(tmp_path, capsys):
    import json

    import torch

    before = torch.get_num_threads()
    out = tmp_path / "b.json"
    assert main(["bench", str(SPECS / "deltanet.yaml"), *BENCH_TINY, "--threads", "1", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["machine"]["threads"] == 1
    assert torch.get_num_threads() == before
    capsys.readouterr()
    for command in (["bench", str(SPECS / "deltanet.yaml"), *BENCH_TINY], ["train", str(SPECS / "deltanet.yaml"), *TINY]):
        assert main([*command, "--threads", "0"]) == 2
        assert "--threads must be >= 1, got 0" in capsys.readouterr().err


def test_train_and_compare_take_a_schedule(capsys):
    deltanet = str(SPECS / "deltanet.yaml")
    assert main(["train", deltanet, *TINY, "--threads", "1"]) == 0
    assert capsys.readouterr().out.startswith("deltanet: schedule delta(64),")
    assert main(["train", deltanet, *TINY, "--threads", "1", "--schedule", "online"]) == 0
    assert capsys.readouterr().out.startswith("deltanet: schedule online,")
    assert main(["compare", deltanet, str(SPECS / "titans.yaml"), *TINY, "--seeds", "1", "--schedule", "online"]) == 0
    out = capsys.readouterr().out
    assert "| deltanet | online |" in out and "| titans | online |" in out
    assert main(["train", str(SPECS / "titans.yaml"), *TINY, "--schedule", "chunk(16)"]) == 2
    err = capsys.readouterr().err
    assert "--schedule: titans cannot run chunk(16): schedule chunk(16) needs an exact chunk form" in err
    assert main(["train", deltanet, *TINY, "--schedule", "fast"]) == 2
    assert "unknown schedule 'fast'" in capsys.readouterr().err


def test_explain_brief(capsys):
    assert main(["explain", "--brief", str(SPECS / "deltanet.yaml"), str(SPECS / "titans.yaml")]) == 0
    assert capsys.readouterr().out == (
        "deltanet: delta(64)\n  exact: yes\n  chunk: 64\n  admits: delta, dplr, minibatch, online\n"
        "  why: normal form W <- T(W) + A with T = I - eta kn knᵀ; A = eta kn vᵀ\n"
        "titans: minibatch(64)\n  exact: no (an approximation of online learning)\n  chunk: 64\n"
        "  admits: minibatch, online\n  why: forced by schedule minibatch(64)\n")


def test_help_shows_defaults(capsys):
    from memspec.tools.cli import TRAIN_DEFAULTS
    from memspec.tools.train import TrainConfig

    config = TrainConfig()
    assert TRAIN_DEFAULTS == {k: getattr(config, k) for k in TRAIN_DEFAULTS}
    for command, shown in [("bench", ["tokens per sequence (default: 2048)", "(default: float32)"]),
                           ("train", ["optimizer steps (default: 300)", "(default: 0.005)", "(default: cosine)"]),
                           ("compare", ["seeds per spec", "(default: 3)"]),
                           ("compile", ["output folder (default: compiled)"]),
                           ("diff", ["output form (default: text)"])]:
        with pytest.raises(SystemExit):
            main([command, "--help"])
        out = " ".join(capsys.readouterr().out.split())
        assert all(s in out for s in shown), (command, out)
        assert "(default: None)" not in out and "(default: False)" not in out


# ------------------------------------------------------------------ extends: memspec:NAME
def test_extends_a_shipped_spec_by_name_from_any_folder(tmp_path):
    from memspec import load
    from memspec.lang.frontend.shipped import shipped_dir

    assert shipped_dir() == (SPECS).resolve()
    child = load(write(tmp_path / "mine.yaml", """
        extends: memspec:deltanet
        name: mine
    """))
    assert child == load(SPECS / "deltanet.yaml").model_copy(update={"name": "mine"})
    assert child.span("read").file.endswith("deltanet.yaml")
    mem_child = load(write(tmp_path / "mine.mem", """
        extends "memspec:deltanet"
        memory mine
    """))
    assert mem_child == child and mem_child.span("read").file.endswith("deltanet.mem")  # its own format
    exact = load(write(tmp_path / "exact.yaml", "extends: memspec:deltanet.mem\nname: mine\n"))
    assert exact.span("read").file.endswith("deltanet.mem")


def test_a_shipped_variant_copied_into_a_plain_folder(tmp_path, capsys, monkeypatch):
    from memspec import load

    monkeypatch.chdir(tmp_path)
    text = (SPECS / "variants" / "titans_mqar.yaml").read_text()
    assert "extends: ../titans.yaml" in text
    write(tmp_path / "titans_mqar.yaml", text)
    assert main(["check", "titans_mqar.yaml"]) == 1
    err = capsys.readouterr().err
    line = _line_of(ROOT / "specs" / "variants" / "titans_mqar.yaml", "extends:")
    assert f"titans_mqar.yaml:{line}:10: error: extends '../titans.yaml' points outside ./" in err
    assert "to extend the shipped spec, write `extends: memspec:titans`" in err
    write(tmp_path / "titans_mqar.yaml", text.replace("extends: ../titans.yaml", "extends: memspec:titans"))
    assert main(["check", "titans_mqar.yaml"]) == 0
    assert load("titans_mqar.yaml") == load(SPECS / "variants" / "titans_mqar.yaml")
    # a shipped variant by name: its own relative extends resolves among the shipped specs
    write(tmp_path / "two.yaml", "extends: memspec:variants/titans_mqar\nname: two\n")
    assert main(["check", "-q", "two.yaml"]) == 0
    # a relative extends that does not resolve names the shipped spec too
    (tmp_path / "sub").mkdir()
    write(tmp_path / "sub" / "v.yaml", text.replace("../titans.yaml", "titans.yaml"))
    assert main(["check", "sub/v.yaml"]) == 1
    err = capsys.readouterr().err
    assert "no such spec file" in err and "to extend the shipped spec, write `extends: memspec:titans`" in err


@pytest.mark.parametrize("name, message, hint", [
    ("memspec:deltanett", "no shipped spec of that name", "did you mean 'deltanet'?"),
    ("memspec:../deltanet", "a shipped spec is named memspec:NAME or memspec:FOLDER/NAME", "did you mean 'deltanet'?"),
    ("memspec:", "a shipped spec is named memspec:NAME", "the shipped specs: atlas, "),
])
def test_a_bad_shipped_name_is_a_located_error(name, message, hint, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "x.yaml", f"extends: '{name}'\nname: x\n")
    assert main(["check", "x.yaml"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"x.yaml:1:10: error: extends '{name}': {message}") and f"hint: {hint}" in err


@pytest.mark.slow
def test_an_installed_wheel_resolves_shipped_names(tmp_path):
    """The wheel carries the shipped specs (pyproject's package-data): built from a copy of the
    checkout, unpacked, and used from a folder outside it."""
    import zipfile

    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("memspec", "specs", "grammars"):
        shutil.copytree(ROOT / name, src / name, symlinks=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    wheel = next((tmp_path / "dist").glob("memspec-*.whl"))
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    assert (site / "memspec" / "specs" / "variants" / "titans_mqar.yaml").is_file()
    work = tmp_path / "work"
    write(work / "mine.yaml", "extends: memspec:variants/titans_mqar\nname: mine\n")
    env = {**__import__("os").environ, "PYTHONPATH": str(site)}
    r = subprocess.run([sys.executable, "-c", "import memspec, sys; print(memspec.__file__); "
                        "from memspec.tools.cli import main; sys.exit(main(['check', 'mine.yaml']))"],
                       cwd=work, env=env, capture_output=True, text=True)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    first, ok = r.stdout.splitlines()
    assert first == str(site / "memspec" / "__init__.py")
    shipped = site / "memspec" / "specs"
    assert ok == f"mine.yaml: ok (inherits description from {shipped / 'variants' / 'titans_mqar.yaml'} and cite from " \
                 f"{shipped / 'titans.yaml'}: text about the base; give the variant its own, or null to drop it)"


# ------------------------------------------------------------------ fast start: no torch to read a spec
NO_TORCH = """
import contextlib, io, sys
from memspec.tools.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    rc = main(sys.argv[1:])
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
assert not loaded, loaded[:5]
sys.exit(rc)
"""


@pytest.mark.parametrize("argv, rc", [
    (["check", "specs/deltanet.yaml", "specs/titans.mem"], 0),
    (["fmt", "specs/titans_mac.yaml", "--to", "mem"], 0),
    (["diff", "specs/deltanet.yaml", "specs/gated_deltanet.yaml"], 1),
    (["table", "specs/deltanet.yaml", "specs/gla.yaml"], 0),
    (["explain", "--brief", "specs/deltanet.yaml"], 0),
    (["--help"], 0),
])
def test_reading_commands_start_without_torch(argv, rc):
    r = subprocess.run([sys.executable, "-c", NO_TORCH, *argv], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == rc, r.stderr
    assert "AssertionError" not in r.stderr


def test_import_memspec_does_not_import_torch():
    code = "import sys, memspec; memspec.load; memspec.check; assert 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


# ------------------------------------------------------------------ description and cite under extends
def test_check_says_when_a_variant_inherits_its_description_or_cite(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "a.yaml", "extends: memspec:deltanet\nname: a\n")
    write(tmp_path / "b.yaml", "extends: memspec:deltanet\nname: b\ndescription: my variant\n")
    write(tmp_path / "c.mem", 'extends "memspec:deltanet"\nmemory c\ndescription "mine"\ncite ""\n')
    assert main(["check", "a.yaml", "b.yaml", "c.mem"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("a.yaml: ok (inherits description and cite from ")
    assert out[0].endswith("deltanet.yaml: text about the base; give the variant its own, or null to drop it)")
    assert out[1].startswith("b.yaml: ok (inherits cite from ") and "description" not in out[1]
    assert out[2] == "c.mem: ok"
    assert main(["check", str(SPECS / "deltanet.yaml")]) == 0 and capsys.readouterr().out.endswith("deltanet.yaml: ok\n")


def test_an_inherited_entry_can_be_dropped_says_the_hint(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copy(SPECS / "titans.yaml", tmp_path / "parent.yaml")
    write(tmp_path / "child.yaml", """
        extends: parent.yaml
        name: child
        update:
          - W1 = W1 - eta * grad(loss, W1)
          - W2 = W2 - eta * grad(loss, W2)
    """)
    assert main(["check", "child.yaml"]) == 1
    err = capsys.readouterr().err
    line = _line_of(tmp_path / "parent.yaml", "  U1:")
    assert f"parent.yaml:{line}:3: error: state 'U1' is never written (child.yaml inherits state U1 from parent.yaml" in err
    assert "define it in child.yaml, or remove it there (`state: {U1: null}`)" in err


def _line_of(path, prefix: str) -> int:
    """The 1-based number of the first line of ``path`` that starts with ``prefix``."""
    return next(i for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if line.startswith(prefix))
