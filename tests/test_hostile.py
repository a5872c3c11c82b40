"""Hostile inputs: no spec can run code, no input can hang or crash the tools.

Every input here either gets a located error (or a one-line ``memspec: error:`` for a path)
within a second of CPU time, or compiles into a module that imports with no side effect:
a payload would create a marker file, and after ``memspec.compile``, an import of the
written file and ``memspec.build`` the marker does not exist.  The golden messages of the
located errors are in tests/bad_specs/ (test_bad_specs.py); this file adds the inputs that
need the file system (special files, odd file names), the code-injection corpus, the
generated-source gate, internal errors, atomic writes, T = 0 and non-finite inputs.
"""
from __future__ import annotations

import ast
import contextlib
import importlib.util
import io
import os
import random
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import memspec
from memspec.lang import limits
from memspec.lang.errors import SpecError
from memspec.lang.shapes import let_order
from memspec.pipeline.source_check import GeneratedSourceError, check_source
from memspec.pipeline.write import write_atomic
from memspec.tools.cli import EXIT_INTERNAL, main

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "tests" / "bad_specs"


YAML = """name: {name}
description: {desc}
cite: {cite}
dims: {{d_model: 8, heads: 2, d_k: 4, d_v: 4}}
views: {{q: d_k, k: d_k, v: d_v}}
gates:
  eta: sigmoid(logit)
state:
  W: {{shape: [d_k, d_v]}}
model: f(u) = u @ W
loss: 0.5 * sum((f(k) - v)^2)
update:
  - W = W - eta * grad(loss, W)
read: {read}
"""

MEM = """memory {name}
description {desc}
cite {cite}
dims {{ d_model = 8, heads = 2, d_k = 4, d_v = 4 }}
view q : d_k
view k : d_k
view v : d_v
gate eta = sigmoid(logit)
state W : [d_k, d_v] = zeros
model f(u) = u @ W
loss = 0.5 * sum((f(k) - v)^2)
update {{ W = W - eta * grad(loss, W) }}
read = {read}
"""


def yaml_spec(name="s", desc='""', cite='""', read="f(q)") -> str:
    return YAML.format(name=name, desc=desc, cite=cite, read=read)


def mem_spec(name="s", desc='""', cite='""', read="f(q)") -> str:
    return MEM.format(name=name, desc=desc, cite=cite, read=read)


def run(*argv, env=None) -> tuple[int, str, str, float]:
    """``memspec ARGV`` in-process: (exit status, stdout, stderr, CPU seconds)."""
    out, err = io.StringIO(), io.StringIO()
    t0 = time.process_time()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(list(argv))
        except SystemExit as e:
            rc = e.code
    return rc, out.getvalue(), err.getvalue(), time.process_time() - t0


@pytest.fixture(scope="module", autouse=True)
def _warm():
    """Build the parsers once, so that timings are of the inputs."""
    memspec.loads("name: warm\nread: 1\n")
    memspec.loads("memory warm\nread = 1\n", "mem")


def _one_error_fast(argv, budget: float = 1.0) -> str:
    rc, out, err, cpu = run(*argv)
    assert rc in (1, 2), (rc, err)
    assert "Traceback" not in err and " error: " in err or err.startswith("memspec: error:"), err
    assert cpu < budget, f"{argv}: {cpu:.2f} s of CPU"
    assert len(err) < 20_000, len(err)
    return err


# ------------------------------------------------------------ the golden corpus, timed
HOSTILE_GOLDENS = sorted(p.name for p in CORPUS.iterdir() if p.suffix in (".yaml", ".mem") and p.stem in {
    "yaml_aliases", "yaml_alias_reuse", "expr_too_long", "expr_too_deep", "expr_nested_calls", "number_too_long",
    "number_in_expr", "mem_bad_escape", "inlined_too_deep", "inlined_too_large", "size_too_large", "size_over_limit",
    "dim_boolean", "constant_boolean", "wiring_too_large", "name_too_long", "let_runtime_name", "dim_class_name",
    "spec_name_module", "long_key", "extends_outside", "lone_surrogate", "binary_junk", "deep_nesting",
    "control_chars", "invalid_utf8"})


def test_hostile_corpus_covers_both_formats():
    assert len([n for n in HOSTILE_GOLDENS if n.endswith(".mem")]) >= 14
    assert len([n for n in HOSTILE_GOLDENS if n.endswith(".yaml")]) >= 20


@pytest.mark.parametrize("name", HOSTILE_GOLDENS)
def test_hostile_corpus_is_fast_and_located(name, monkeypatch):
    monkeypatch.chdir(ROOT)
    err = _one_error_fast(["check", f"tests/bad_specs/{name}"])
    assert err.startswith(f"tests/bad_specs/{name}:"), err


def test_billion_laughs_deep(tmp_path):
    """Nine levels of nine aliases: 9**9 values if expanded."""
    lines = ["name: laughs", 'a0: &a0 ["lol"]'] + [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]"
                                                  for i in range(1, 10)] + ["read: q"]
    p = tmp_path / "laughs.yaml"
    p.write_text("\n".join(lines) + "\n")
    err = _one_error_fast(["check", str(p)])
    assert "anchors and aliases are not allowed" in err


def test_a_megabyte_expression_and_ten_thousand_minus_signs(tmp_path):
    for text in ("q + " * 250_000 + "q", "-" * 10_000 + "q", "(" * 10_000 + "q" + ")" * 10_000,
                 "-" * 1_000 + "q", "sigmoid(" * 1_000 + "q" + ")" * 1_000):
        for ext, src in ((".yaml", yaml_spec(read=text)), (".mem", mem_spec(read=text))):
            p = tmp_path / f"e{ext}"
            p.write_text(src)
            err = _one_error_fast(["check", str(p)])
            assert "file too large" in err or "too long" in err or "too deeply" in err, err[:300]


def test_inlining_chains_in_reverse_order(tmp_path):
    """A chain of lets declared last-first (the dependency order walk must not recurse)."""
    lets = "".join(f"  a{i}: a{i + 1} + q\n" for i in range(2000)) + "  a2000: q\n"
    p = tmp_path / "rev.yaml"
    p.write_text("name: rev\ndims: {d_k: 4, d_v: 4}\nviews: {q: d_k}\nlet:\n" + lets + "read: a0\n")
    err = _one_error_fast(["check", str(p)])
    assert "grows too large once lets" in err


def test_let_order_is_the_recursive_walks():
    from memspec.lang.expr import BinOp, Name, Num

    def recursive(lets):
        deps = {n: [x.id for x in e.walk() if isinstance(x, Name) and x.id in lets] for n, e in lets.items()}
        done, state = [], {}

        def visit(n):
            if state.get(n) == "done":
                return True
            if state.get(n) in ("busy", "cycle"):
                return False
            state[n] = "busy"
            ok = all(visit(d) for d in deps[n])
            state[n] = "done" if ok else "cycle"
            if ok:
                done.append(n)
            return ok

        for n in lets:
            visit(n)
        return done

    rng = random.Random(10)
    for _ in range(1500):
        names = [f"l{i}" for i in range(rng.randrange(1, 9))]
        rng.shuffle(names)
        lets = {}
        for n in names:
            e = Num(1)
            for _ in range(rng.randrange(0, 4)):
                e = BinOp("+", e, Name(rng.choice(names + ["q"])))
            lets[n] = e
        assert let_order(lets) == recursive(lets), lets


# ------------------------------------------------------------ files that are not spec files
def _special_files(d: Path) -> dict:
    out = {}
    (d / "zero.yaml").symlink_to("/dev/zero")
    out["zero.yaml"] = "is a character device, not a regular file"
    os.mkfifo(d / "fifo.mem")
    out["fifo.mem"] = "is a FIFO (named pipe), not a regular file"
    (d / "loop.yaml").symlink_to("loop.yaml")
    out["loop.yaml"] = "a loop of symbolic links"
    (d / "dir.yaml").mkdir()
    out["dir.yaml"] = "is a directory, not a spec file"
    return out


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_special_files_as_spec_and_as_extends_target(tmp_path):
    expected = _special_files(tmp_path)
    for name, message in expected.items():
        err = _one_error_fast(["check", str(tmp_path / name)])
        if name == "dir.yaml":   # `check DIR` checks the specs under it: none here
            assert err == f"memspec: error: {tmp_path / name}: no spec files (*.yaml, *.yml, *.mem) in this folder\n"
            with pytest.raises(SpecError, match=message):
                memspec.load(tmp_path / name)
        else:
            assert message in err and err.startswith(f"{tmp_path / name}:1:1: error:"), err
        base = tmp_path / f"via_{name.split('.')[0]}.yaml"
        base.write_text(f"extends: {name}\nname: via\n")
        err = _one_error_fast(["check", str(base)])
        # /dev/zero lies outside the folder: not even opened; asked for, its name has no spec suffix
        assert (message if name != "zero.yaml" else "points outside") in err, err
        if name == "zero.yaml":
            err = _one_error_fast(["check", "--allow-extends-outside", str(base)])
            assert "unknown spec format" in err, err
            (tmp_path / "zero_link.yaml").symlink_to("/dev/zero")
            base.write_text("extends: zero_link.yaml\nname: via\n")
            err = _one_error_fast(["check", "--allow-extends-outside", str(base)])
            assert "unknown spec format" in err or message in err, err


def test_file_too_large_is_judged_by_reading(tmp_path):
    p = tmp_path / "big.yaml"
    p.write_text("name: big\n" + "#" * limits.MAX_SPEC_BYTES)
    err = _one_error_fast(["check", str(p)])
    assert "file too large" in err and "at most 64 KB" in err


def test_directory_without_specs(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    rc, out, err, _ = run("check", str(tmp_path))
    assert rc == 2 and out == ""
    assert err == f"memspec: error: {tmp_path}: no spec files (*.yaml, *.yml, *.mem) in this folder\n"


# ------------------------------------------------------------ extends stays in its folder tree
def test_extends_confined_unless_allowed(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.yaml").write_text("name: secret\ntoken: gho_SECRET\n")
    project = tmp_path / "downloads"
    project.mkdir()
    spec = project / "evil.yaml"
    for target in ("../outside/secret.yaml", str(outside / "secret.yaml")):
        spec.write_text(f"extends: {target}\nname: evil\n")
        err = _one_error_fast(["check", str(spec)])
        assert "points outside" in err and "gho_SECRET" not in err, err
    rc, _, err, _ = run("check", "--allow-extends-outside", str(spec))
    assert rc == 1 and "unknown field 'token'" in err   # read only when the user asks
    with pytest.raises(SpecError, match="points outside"):
        memspec.load(spec)
    with pytest.raises(SpecError, match="unknown field 'token'"):
        memspec.load(spec, allow_extends_outside=True)
    # a symlink inside the folder that leads outside counts as outside
    (project / "link.yaml").symlink_to(outside / "secret.yaml")
    spec.write_text("extends: link.yaml\nname: evil\n")
    assert "points outside" in _one_error_fast(["check", str(spec)])


def test_extends_inside_a_project(tmp_path):
    """A spec in a subfolder of a project may extend its parent folder's specs."""
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'p'\n")
    (tmp_path / "specs" / "variants").mkdir(parents=True)
    (tmp_path / "specs" / "deltanet.yaml").write_bytes((ROOT / "specs" / "deltanet.yaml").read_bytes())
    v = tmp_path / "specs" / "variants" / "v.yaml"
    v.write_text("extends: ../deltanet.yaml\nname: v\n")
    assert memspec.load(v).name == "v"


# ------------------------------------------------------------ no spec text becomes code
MARKER_CODE = "__import__('pathlib').Path({marker!r}).write_text('pwned')"


def _payloads(marker: Path) -> list[str]:
    code = MARKER_CODE.format(marker=str(marker))
    return [
        f'"""\n{code}\n"""',
        f'"""; {code}; """',
        f"\\\"\\\"\\\"\r{code}\r\\\"\\\"\\\"",
        f"x\u2028{code}\u2029y\x0b{code}\x0c\x1c\x1d\x1e\x85",
        f"\\N{{BULLET}} \\u12 \\x4 {code} \\",
        f"end with a quote\"",
        f"nul \x00 and esc \x1b[2J",
        f"'''\n{code}\n'''",
    ]


def _yaml_str(s: str) -> str:
    """A YAML double-quoted scalar for any text (escapes for non-printables)."""
    out = []
    for ch in s:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch.isprintable():
            out.append(ch)
        else:
            out.append(f"\\u{ord(ch):04x}" if ord(ch) <= 0xFFFF else f"\\U{ord(ch):08x}")
    return '"' + "".join(out) + '"'


def _mem_str(s: str) -> str:
    import json

    return json.dumps(s)


SMALL = dict(d_model=8, heads=2, d_k=4, d_v=4)


def _compiles_inert(path: Path, out_dir: Path, marker: Path) -> None:
    """compile, import the written file, build in-process: no marker, the module checks."""
    written = memspec.compile(path, out_dir)
    text = written.read_text(encoding="utf-8")
    check_source(text)
    spec = importlib.util.spec_from_file_location(f"hostile_{written.stem}", written)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    layer = memspec.build(path, compile=False, **SMALL)
    y = layer(torch.randn(1, 3, 8))
    assert y.shape == (1, 3, 8)
    assert not marker.exists(), f"{path.name}: the payload ran"


def test_free_text_cannot_become_code(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "PWNED"
    for i, payload in enumerate(_payloads(marker)):
        y = tmp_path / f"free_{i}.yaml"
        y.write_text(yaml_spec(f"free_y{i}", _yaml_str(payload), _yaml_str(payload)), encoding="utf-8")
        _compiles_inert(y, tmp_path / "out", marker)
        m = tmp_path / f"free_{i}.mem"
        m.write_text(mem_spec(f"free_m{i}", _mem_str(payload), _mem_str(payload)), encoding="utf-8")
        _compiles_inert(m, tmp_path / "out", marker)
    # block scalars; then the same with \r line separators
    code = MARKER_CODE.format(marker=str(marker))
    y = tmp_path / "block.yaml"
    y.write_text(yaml_spec("block", f'|\n  a\n  """\n  {code}\n  """', f'>-\n  x """\n  {code}'), encoding="utf-8")
    _compiles_inert(y, tmp_path / "out", marker)
    y.write_bytes(y.read_bytes().replace(b"\n  ", b"\r  "))
    with contextlib.suppress(SpecError):   # \r alone is a line break for YAML too: valid or a located error
        _compiles_inert(y, tmp_path / "out", marker)


@pytest.mark.parametrize("name", ["evil\nimport os; PAYLOAD.yaml", "evil\rPAYLOAD.yaml",
                                  "evil\u2028PAYLOAD.yaml", "evil\x0bx\x1b[2Jx\x85PAYLOAD.yaml"])
def test_file_names_cannot_become_code(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "PWNED"
    p = tmp_path / name.replace("PAYLOAD", MARKER_CODE.format(marker=marker.name))
    p.write_text(yaml_spec("path_payload"))
    _compiles_inert(p, tmp_path / "out", marker)
    header = (tmp_path / "out" / "path_payload.py").read_text().splitlines()[:2]
    assert all(h.startswith("# ") for h in header), header
    rc, out, err, _ = run("check", str(p))
    assert rc == 0 and not [ch for ch in out + err if not ch.isprintable() and ch != "\n"], (out, err)


@pytest.mark.parametrize("fmt", ["yaml", "mem"])
def test_non_finite_numbers_are_explicit(fmt, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    if fmt == "yaml":
        text = ("name: nonfinite\ndims: {d_model: 8, heads: 2, d_k: 4, d_v: 4}\nconstants: {big: .inf, nan_c: .nan}\n"
                "views: {q: d_k, k: d_k, v: d_v}\ngates:\n  eta: {formula: sigmoid(logit), bias: .nan}\n"
                "  mu: {formula: sigmoid(logit), bias: -.inf}\nstate:\n  W: {shape: [d_k, d_v]}\n"
                "model: f(u) = u @ W\nloss: 0.5 * sum((f(k) - v)^2)\nupdate:\n"
                "  - W = W - eta * mu * grad(loss, W) * min(big, 1) * min(nan_c, 1)\nread: f(q) * 1e999\n")
    else:
        text = ("memory nonfinite\ndims { d_model = 8, heads = 2, d_k = 4, d_v = 4 }\nview q : d_k\nview k : d_k\n"
                "view v : d_v\ngate eta = sigmoid(logit) bias 1e999\ngate mu = sigmoid(logit) bias -1e999\n"
                "state W : [d_k, d_v] = zeros\nmodel f(u) = u @ W\nloss = 0.5 * sum((f(k) - v)^2)\n"
                "update { W = W - eta * mu * grad(loss, W) }\nread = f(q) * 1e999\n")
    p = tmp_path / f"nonfinite.{fmt}"
    p.write_text(text)
    written = memspec.compile(p, tmp_path / "out")
    src = written.read_text()
    tree = check_source(src)
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    assert "inf" not in names and "nan" not in names
    assert 'float("inf")' in src or 'float("-inf")' in src
    layer = memspec.build(p, compile=False, **SMALL)
    layer(torch.randn(1, 2, 8))   # runs (values are what the spec says: not finite)


def test_normal_init_must_be_finite():
    with pytest.raises(SpecError, match="finite std"):
        memspec.loads("name: n\ndims: {d_k: 4}\nviews: {q: d_k}\nparams:\n  w: {shape: [d_k], init: normal(1e999)}\n"
                      "read: q * w\n")


# ------------------------------------------------------------ the generated-source gate
@pytest.mark.parametrize("text", [
    "import os\nos.system('x')\n",
    "import yaml\n",
    "from . import x\n",
    "x = open('f')\n",
    "class A:\n    x = print('hi')\n",
    "class A(metaclass=type):\n    pass\n",
    "def f(x=print('hi')):\n    pass\n",
    "@decorate()\ndef f():\n    pass\n",
    "def f(x: print('hi')):\n    pass\n",
    "for i in range(3):\n    pass\n",
    "if True:\n    import torch\n",
    "x = 1\ndel x\n",
    "'''doc\n'''\n__import__('os')\n",
    "def f(:\n",
    "x = 1\x00\n",
])
def test_source_check_refuses_code_that_runs_at_import(text):
    with pytest.raises(GeneratedSourceError):
        check_source(text)


def test_source_check_accepts_every_shipped_module():
    for f in sorted((ROOT / "compiled").glob("*.py")):
        check_source(f.read_text(encoding="utf-8"))


def test_source_check_refuses_a_spec_name_at_top_level():
    spec = memspec.loads("name: s\ndims: {d_k: 4}\nviews: {q: d_k}\nread: q\n")
    with pytest.raises(GeneratedSourceError, match="q"):
        check_source("import torch\n\ndef q():\n    pass\n", spec)


def test_a_bad_generated_module_is_an_internal_error_and_writes_nothing(tmp_path, monkeypatch):
    import memspec.pipeline.build as pb

    real = pb.generate_source
    monkeypatch.setattr(pb, "generate_source", lambda *a, **k: real(*a, **k) + "\nprint('ran')\n")
    out = tmp_path / "out"
    rc, stdout, err, _ = run("compile", str(ROOT / "specs" / "deltanet.yaml"), "-o", str(out))
    assert rc == EXIT_INTERNAL and rc not in (0, 1, 2)
    assert err.count("\n") == 1 and err.startswith("memspec: internal error: GeneratedSourceError:"), err
    assert not out.exists() or not any(out.iterdir())
    with pytest.raises(GeneratedSourceError):
        memspec.build(ROOT / "specs" / "deltanet.yaml", compile=False)


# ------------------------------------------------------------ internal errors
def test_internal_error_one_line_and_debug_traceback(monkeypatch):
    import memspec.tools.cli as cli

    def boom(args):
        raise KeyError("something inside")

    monkeypatch.setattr(cli, "cmd_check", boom)
    spec = str(ROOT / "specs" / "deltanet.yaml")
    rc, _, err, _ = run("check", spec)
    assert rc == EXIT_INTERNAL and rc not in (0, 1, 2)
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("memspec: internal error: KeyError: 'something inside'") and "--debug" in err
    rc, _, err, _ = run("check", "--debug", spec)
    assert rc == EXIT_INTERNAL and "Traceback (most recent call last)" in err
    monkeypatch.setenv("MEMSPEC_DEBUG", "1")
    rc, _, err, _ = run("check", spec)
    assert rc == EXIT_INTERNAL and "Traceback (most recent call last)" in err


def test_internal_error_exit_status_from_a_real_process(tmp_path):
    """The installed entry point: exit status and one line, in a subprocess."""
    code = ("import sys, memspec.tools.cli as c\n"
            "c.cmd_explain = lambda a: (_ for _ in ()).throw(RuntimeError('bug'))\n"
            "sys.exit(c.main(['explain', sys.argv[1]]))\n")
    p = subprocess.run([sys.executable, "-c", code, str(ROOT / "specs" / "deltanet.yaml")], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == EXIT_INTERNAL
    assert p.stderr.strip().count("\n") == 0 and p.stderr.startswith("memspec: internal error: RuntimeError: bug")


# ------------------------------------------------------------ atomic writes
def test_written_files_follow_the_umask(tmp_path):
    for mask, mode in ((0o022, 0o644), (0o077, 0o600), (0o002, 0o664)):
        old = os.umask(mask)
        try:
            write_atomic(tmp_path / f"m{mask:o}.py", "x = 1\n")
        finally:
            os.umask(old)
        assert stat.S_IMODE((tmp_path / f"m{mask:o}.py").stat().st_mode) == mode


def test_temp_files_of_killed_writers_are_removed(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".deltanet.py.{dead.pid}.0badc0de.tmp"
    stale.write_text("half a module")
    live = tmp_path / f".deltanet.py.{os.getppid()}.0badc0de.tmp"   # a running process: left alone
    live.write_text("being written")
    other = tmp_path / f".other.py.{dead.pid}.0badc0de.tmp"        # another file's: left alone
    other.write_text("x")
    write_atomic(tmp_path / "deltanet.py", "x = 1\n")
    assert not stale.exists() and live.exists() and other.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other.name, "deltanet.py"])


def test_kill_9_during_compile_leaves_nothing_behind_after_the_next_write(tmp_path):
    """A writer killed mid-write leaves its temp file; the next write of the file removes it."""
    code = ("import os, sys, signal\n"
            "from memspec.pipeline import write\n"
            "real = os.replace\n"
            "def stop(*a):\n    os.kill(os.getpid(), signal.SIGKILL)\n"
            "write.os.replace = stop\n"
            "write.write_atomic(sys.argv[1], 'x = 1\\n' * 100000)\n")
    target = tmp_path / "deltanet.py"
    p = subprocess.run([sys.executable, "-c", code, str(target)], capture_output=True, timeout=120)
    assert p.returncode == -9
    assert [f.name for f in tmp_path.iterdir() if f.name.endswith(".tmp")], "the killed writer left its temp file"
    memspec.compile(ROOT / "specs" / "deltanet.yaml", tmp_path)
    assert sorted(f.name for f in tmp_path.iterdir()) == ["deltanet.py"]


# ------------------------------------------------------------ sizes at build time
def test_build_refuses_sizes_it_cannot_allocate():
    with pytest.raises(ValueError, match=r"view q needs 128,000,000,000 bytes"):
        memspec.build(ROOT / "specs" / "deltanet.yaml", compile=False, d_k=1_000_000_000, d_model=8)
    with pytest.raises(ValueError, match="at most 2147483647"):
        memspec.build(ROOT / "specs" / "deltanet.yaml", compile=False, d_k=10**12)


def test_bench_refuses_sizes_before_allocating(tmp_path):
    rc, _, err, _ = run("bench", str(CORPUS / "size_too_large.yaml"), "--T", "4", "--repeat", "1")
    assert rc == 1 and "bytes" in err and "Traceback" not in err


# ------------------------------------------------------------ T = 0 and non-finite inputs
T0_SPECS = ["deltanet", "linear_attention", "softmax_attention", "titans", "moneta", "titans_mac", "titans_mal"]


def _dims(spec):
    d = {k: v for k, v in SMALL.items() if k in spec.dims or k in ("heads", "d_model")}
    if "hidden" in spec.dims:
        d["hidden"] = 4
    return d


def _inputs(mem, spec, dims, T, B=2):
    torch.manual_seed(0)
    views = [torch.randn(B, T, 2, dims.get(spec.views[v].dim, spec.dims[spec.views[v].dim])) for v in mem.VIEWS]
    gates = {g: torch.rand(B, T, 2) * 0.5 for g in mem.GATES}
    return views, gates


@pytest.mark.parametrize("name", T0_SPECS)
def test_zero_tokens_on_every_schedule_and_the_layer(name):
    spec = memspec.load(ROOT / "specs" / f"{name}.yaml")
    dims = _dims(spec)
    mem = memspec.pipeline.build.build_memory(spec, compile=False, **dims)
    views, gates = _inputs(mem, spec, dims, 0)
    s0 = {k: v + 1.0 for k, v in mem.init_state(2).items()}
    for schedule in mem.SCHEDULES:
        o, st = mem(*views, **gates, state=s0, schedule=schedule)
        assert o.shape[:3] == (2, 0, 2) and o.numel() == 0, (schedule, o.shape)
        assert set(st) == set(s0) and all(torch.equal(st[k], s0[k]) for k in s0), schedule
    layer = memspec.build(spec, compile=False, **dims)
    assert layer(torch.randn(2, 0, 8)).shape == (2, 0, 8)


@pytest.mark.parametrize("name", ["titans", "moneta", "ttt_linear", "deltanet", "softmax_attention",
                                  "sliding_window_attention"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_token_does_not_reach_earlier_outputs(name, bad):
    """Token 10 of 20 is non-finite: outputs of tokens 0-9 are finite and equal online's on every
    schedule the generator writes itself (mini-batch, dual form, cache); later ones are not finite."""
    spec = memspec.load(ROOT / "specs" / f"{name}.yaml")
    dims = _dims(spec)
    torch.manual_seed(0)   # the learned initial states too: the same memory whatever ran before
    mem = memspec.pipeline.build.build_memory(spec, compile=False, chunk=8, **dims)
    views, gates = _inputs(mem, spec, dims, 20)
    clean = [x.clone() for x in views]
    views[-1][:, 10] = bad
    clean[-1][:, 10:] = 0.25   # the same first ten tokens, and finite later ones
    ref, _ = mem(*views, **gates, schedule="online")
    assert torch.isfinite(ref[:, :10]).all()
    for schedule in mem.SCHEDULES:
        if schedule in ("delta", "additive"):
            continue   # the runtime kernels' masking (memspec/runtime/delta.py, additive.py) is tested there
        o, st = mem(*views, **gates, schedule=schedule)
        assert torch.isfinite(o[:, :10]).all(), schedule
        assert not torch.isfinite(o[:, 10:]).all(), schedule
        o_clean, _ = mem(*clean, **gates, schedule=schedule)   # causal: the first ten outputs cannot differ
        torch.testing.assert_close(o[:, :10], o_clean[:, :10], rtol=0, atol=0)
        if schedule != "minibatch":   # exact schedules equal online; minibatch(C) is approximate
            torch.testing.assert_close(o[:, :10], ref[:, :10], rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------ terminal output
def test_table_and_diff_escape_terminal_control_characters(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    a = tmp_path / "a.yaml"
    a.write_text((ROOT / "specs" / "deltanet.yaml").read_text())
    b = tmp_path / "b.yaml"
    b.write_text("extends: a.yaml\nname: b\ndescription: \"clear \\e[2J\\e]0;title\\a \\u202e evil\"\n"
                 "cite: \"\\e[31mred\\x9b\"\n")
    for argv in (["table", str(b)], ["table", "--format", "text", str(b)], ["table", "--format", "csv", str(b)],
                 ["diff", str(a), str(b)], ["diff", "--format", "markdown", str(a), str(b)],
                 ["diff", "--format", "json", str(a), str(b)]):
        rc, out, err, _ = run(*argv)
        assert rc in (0, 1), (argv, err)
        bad = [ch for ch in out + err if not ch.isprintable() and ch not in "\n"]
        assert not bad, (argv, bad)
    rc, out, _, _ = run("table", "--format", "text", str(b))
    assert "\\x1b[31mred" in out


# ------------------------------------------------------------ a real install
def test_grammar_is_package_data():
    from importlib import resources

    from memspec.lang.expr import GRAMMAR_RESOURCE

    package, name = GRAMMAR_RESOURCE
    shipped = resources.files(package).joinpath(name).read_text(encoding="utf-8")
    assert shipped == (ROOT / "grammars" / "memspec.lark").read_text(encoding="utf-8")
    assert "package-data" in (ROOT / "pyproject.toml").read_text() and '"memspec.lang" = ["*.lark"]' in \
        (ROOT / "pyproject.toml").read_text()


def test_every_limit_is_documented():
    doc = (ROOT / "docs" / "language.md").read_text(encoding="utf-8")
    section = doc[doc.index("## Limits"):]
    for name in dir(limits):
        if name.startswith("MAX_"):
            value = getattr(limits, name)
            assert name in section, name
            assert f"{value:,}" in section or str(value) in section, (name, value)


# ------------------------------------------------------------ the one escaping function
BREAKERS = ["\n", "\r", "\r\n", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029", "\x00",
            "\ud800", "\\", "\\N", "\\u12", '"', '"""', "'''", "\x1b[2J", "\u202e"]


@pytest.mark.parametrize("piece", BREAKERS)
def test_inert_text_stays_in_its_comment_or_docstring(piece):
    from memspec.codegen.text import inert

    text = f"a{piece}b{piece}"
    comment = inert(text, "comment")
    doc = inert(text, "doc")
    assert len(comment.splitlines()) == 1 and len(doc.splitlines()) == 1
    tree = ast.parse(f'"""x {doc}\n"""\nX = 1  # {comment}\n')
    assert len(tree.body) == 2 and isinstance(tree.body[1], ast.Assign)
    assert ast.get_docstring(tree, clean=False) == f"x {comment}\n"   # the docstring reads as the comment
    assert ast.literal_eval(inert(text)) == text                      # and as a literal, the text itself


def test_inert_literals_and_names():
    from memspec.codegen.text import UnsafeValue, inert

    for v in (float("inf"), float("-inf"), 1e-300, -0.0, 3, True, None, ("a",), {"W": ("d_k", "d_v")}):
        assert repr(eval(inert(v), {})) == repr(v)
    assert eval(inert(float("nan")), {}) != eval(inert(float("nan")), {})
    assert "inf" not in inert(float("inf")).replace('"inf"', "")
    for bad in ("a b", "1x", "def", "x\n", "é"):
        with pytest.raises(UnsafeValue):
            inert(bad, "name")
    assert inert("d_k", "name") == "d_k"
