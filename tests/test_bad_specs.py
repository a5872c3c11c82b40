"""The bad-spec corpus: `memspec check FILE` on every file of tests/bad_specs/ gives the
exact golden stderr (FILE.err next to it), exit status 1 (0 for `warn_*` files, which
only draw warnings), and never a Python traceback.

Regenerate the goldens with ``MEMSPEC_UPDATE_GOLDEN=1 pytest tests/test_bad_specs.py``
and review every one by eye: each must be a message a user would find clear.
"""
from __future__ import annotations

import contextlib
import io
import os
import random
from pathlib import Path

import pytest

from memspec import SpecError, load
from memspec.tools.cli import main

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "tests" / "bad_specs"
UPDATE = os.environ.get("MEMSPEC_UPDATE_GOLDEN") == "1"
CASES = sorted(p.name for p in CORPUS.iterdir() if p.is_file() and p.suffix in (".yaml", ".mem"))


def run_check(path: str) -> tuple[int, str, str]:
    """``memspec check PATH`` in-process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(["check", path])
        except SystemExit as e:  # argparse usage errors
            rc = e.code
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture
def at_root(monkeypatch):
    monkeypatch.chdir(ROOT)


def test_corpus_is_large_and_covers_both_formats():
    yaml = [c for c in CASES if c.endswith(".yaml")]
    mem = [c for c in CASES if c.endswith(".mem")]
    assert len(CASES) >= 30
    assert len(yaml) >= 20 and len(mem) >= 20


@pytest.mark.parametrize("name", CASES)
def test_bad_spec_golden(name, at_root):
    rel = f"tests/bad_specs/{name}"
    rc, out, err = run_check(rel)
    assert "Traceback" not in err and "Traceback" not in out
    golden = CORPUS / (name + ".err")
    if UPDATE:
        golden.write_text(err, encoding="utf-8")
    expected = golden.read_text(encoding="utf-8")
    assert err == expected
    if name.startswith("warn_"):
        assert rc == 0, err
        assert " warning: " in err and " error: " not in err
        assert out == f"{rel}: ok\n"
    else:
        assert rc == 1, err
        assert " error: " in err
        # every error is located in a file of the corpus: path:line:col
        first = err.splitlines()[0]
        assert first.startswith("tests/bad_specs/"), first
        assert out == ""


CHECK_CODES_BY_FILE = {
    # every check of the verifier, in both formats
    "unknown_name": "unknown name",
    "shape_mismatch": "shape mismatch",
    "state_unwritten": "is never written",
    "state_unread": "never read",
    "grad_nonscalar": "grad needs a scalar loss",
    "grad_nonstate": "is taken with respect to a state",
    "grad_first_arg": "the first argument of grad must be 'loss'",
    "grad_no_loss": "declares no loss",
    "grad_ambiguous": "is ambiguous",
    "let_cycle": "cycle within a step",
    "gate_order": "a gate formula may use only logit",
    "let_order": "let '",
    "unknown_function": "unknown function",
    "arity": "argument",
    "warn_unused": "is never used",
    "unsafe_identifiers": "reserved: the generated code uses it",
    "duplicate_names": "is declared twice",
    "append_misuse": "append",
    "attend_no_cache": "is not a cache",
    "update_target": "update statements assign states",
    "model_shadow": "the model",
    "unknown_dim": "unknown dim",
    "model_scope": "a model may use only its argument",
    "temp_twice": "is assigned twice",
    "temp_later": "is only available later",
    "temp_scope": "it is not visible in the read",
    "temp_shadow": "would shadow the model",
    "warn_temp_unused": "the temporary 'h' is never used",
    # the frontier specs: block updates, log of a state, Newton-Schulz and named axes
    "every_mixed": "which mixes a state with a gradient",
    "warn_log_state": "which has zero or negative entries",
    "frontier_shapes": "newton_schulz(X, steps) takes a number of steps",
}


@pytest.mark.parametrize("stem", sorted(CHECK_CODES_BY_FILE))
def test_every_check_in_both_formats(stem, at_root):
    for ext in (".yaml", ".mem"):
        golden = CORPUS / f"{stem}{ext}.err"
        assert golden.exists(), golden
        assert CHECK_CODES_BY_FILE[stem] in golden.read_text(encoding="utf-8"), golden


def test_ten_megabyte_file(tmp_path, at_root):
    big = tmp_path / "huge.yaml"
    line = "# " + "x" * 97 + "\n"
    big.write_text("name: huge\n" + line * 100_000, encoding="utf-8")
    assert big.stat().st_size > 10_000_000
    rc, out, err = run_check(str(big))
    assert rc == 1
    assert err == (f"{big}:1:1: error: file too large (10.0 MB); a spec is at most 64 KB\n"
                   f"    name: huge\n    ^\n    hint: is this the right file?\n")


def test_missing_file_and_directory(tmp_path, at_root):
    rc, _, err = run_check("tests/bad_specs/does_not_exist.yaml")
    assert rc == 1 and err.startswith("tests/bad_specs/does_not_exist.yaml:1:1: error: no such spec file")
    d = tmp_path / "dir.yaml"
    d.mkdir()
    with pytest.raises(SpecError, match="is a directory, not a spec file"):
        load(d)
    (d / "bad.mem").write_text("memory x\nread = q +\n", encoding="utf-8")
    rc, _, err = run_check(str(d))  # `check DIR` checks the specs under it
    assert rc == 1 and err.endswith("bad.mem:2:11: error: unexpected end of .mem file\n    read = q +\n              ^\n"
                                  "    hint: expected '(', '-', a name, a number\n") \
        and "Traceback" not in err, err


def test_usage_error_exit_2(at_root):
    rc, _, err = run_check("--no-such-flag")
    assert rc == 2 and "Traceback" not in err


VALID_YAML = """name: titans_like
dims: {d_model: 8, heads: 2, d_k: 4, d_v: 4}
constants: {lam: 0.5}
views: {q: d_k, k: d_k, v: d_v}
gates:
  eta: sigmoid(logit)
  mu: {formula: sigmoid(logit), bias: -1.0}
  alpha: sigmoid(logit)
state:
  W: {shape: [d_k, d_v]}
  U: {shape: [d_k, d_v]}
let:
  kn: l2norm(k)
model: f(u) = u @ W
loss: lam * sum((f(kn) - v)^2)
update:
  - U = mu * U - eta * grad(loss, W)
  - W = (1 - alpha) * W + U
read: f(q)
"""

VALID_MEM = """memory titans_like
dims { d_model = 8, heads = 2, d_k = 4, d_v = 4 }
const lam = 0.5
view q : d_k
view k : d_k
view v : d_v
gate eta = sigmoid(logit)
gate mu = sigmoid(logit) bias -1.0
gate alpha = sigmoid(logit)
state W : [d_k, d_v] = zeros
state U : [d_k, d_v] = zeros
let kn = l2norm(k)
model f(u) = u @ W
loss = lam * sum((f(kn) - v)^2)
update {
  U = mu * U - eta * grad(loss, W)
  W = (1 - alpha) * W + U
}
read = f(q)
"""

_NOISE = list("[]{}()<>:;,.=+-*/@^'\"#!&|%$\\\t\n ") + ["\x00", "é", "\ufeff", "0", "9", "e", "W", "_"]


def _mutate(text: str, rng: random.Random) -> str:
    kind = rng.randrange(7)
    n = len(text)
    if n == 0:
        return rng.choice(_NOISE)
    if kind == 0:  # truncate
        return text[: rng.randrange(n + 1)]
    if kind == 1:  # delete a run of characters
        i = rng.randrange(n)
        return text[:i] + text[i + rng.randrange(1, 8):]
    if kind == 2:  # insert noise
        i = rng.randrange(n + 1)
        return text[:i] + "".join(rng.choice(_NOISE) for _ in range(rng.randrange(1, 4))) + text[i:]
    if kind == 3:  # swap two lines
        lines = text.split("\n")
        i, j = rng.randrange(len(lines)), rng.randrange(len(lines))
        lines[i], lines[j] = lines[j], lines[i]
        return "\n".join(lines)
    if kind == 4:  # duplicate a line
        lines = text.split("\n")
        i = rng.randrange(len(lines))
        return "\n".join(lines[: i + 1] + [lines[i]] + lines[i + 1:])
    if kind == 5:  # replace a character
        i = rng.randrange(n)
        return text[:i] + rng.choice(_NOISE) + text[i + 1:]
    # several mutations at once
    for _ in range(3):
        text = _mutate(text, rng)
    return text


def test_valid_texts_are_valid(tmp_path, at_root):
    for name, text in (("v.yaml", VALID_YAML), ("v.mem", VALID_MEM)):
        p = tmp_path / name
        p.write_text(text, encoding="utf-8")
        rc, out, err = run_check(str(p))
        assert rc == 0 and err == "", err


@pytest.mark.parametrize("fmt,text", [("yaml", VALID_YAML), ("mem", VALID_MEM)], ids=["yaml", "mem"])
def test_mutations_never_raise(fmt, text, tmp_path, at_root):
    rng = random.Random(20240 + len(fmt))
    counts = {0: 0, 1: 0}
    for i in range(250):
        mutated = _mutate(text, rng)
        p = tmp_path / f"m{i}.{fmt}"
        p.write_bytes(mutated.encode("utf-8", errors="surrogatepass"))
        rc, out, err = run_check(str(p))  # an exception here fails the test
        assert rc in (0, 1), (mutated, err)
        assert "Traceback" not in err
        if rc == 1:
            assert " error: " in err, (mutated, err)
        counts[rc] += 1
    # the mutations exercise both outcomes
    assert counts[1] > 50 and counts[0] > 0, counts
