"""Every ```yaml and ```mem example of docs/language.md runs through `memspec check`: a
complete spec passes with no warning, a fragment (``<!-- doc-test: fragment of memspec:NAME
-->``) passes on top of that shipped spec, an excerpt (``<!-- doc-test: excerpt -->``: a few
sections of a larger spec) parses, its expressions included, and an example marked
``<!-- doc-test: invalid -->`` fails with exactly the located error the ```text block after
it shows."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from memspec.tools.cli import main

DOC = Path(__file__).resolve().parent.parent / "docs" / "language.md"
FENCE = re.compile(r"^```(\w*)\s*$")
MARKER = re.compile(r"^<!-- doc-test: (invalid|excerpt|fragment of (memspec:[\w/]+)) -->$")


@dataclass
class Block:
    line: int                 # of the opening fence
    lang: str
    text: str
    marker: str | None        # the doc-test comment before it, if any
    base: str | None          # fragment: the shipped spec it completes
    expected: str | None      # invalid: the next ```text block


def blocks(text: str) -> list[Block]:
    lines = text.split("\n")
    fenced: list[tuple[int, str, str, str | None]] = []   # (line, lang, text, marker line)
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        fenced.append((i + 1, m.group(1), "\n".join(lines[i + 1:end]) + "\n",
                       before if before.startswith("<!-- doc-test") else None))
        i = end + 1
    out = []
    for k, (line, lang, body, marker) in enumerate(fenced):
        if lang not in ("yaml", "mem"):
            continue
        m = MARKER.match(marker) if marker else None
        if marker and not m:
            raise ValueError(f"language.md:{line}: unknown doc-test marker {marker!r}")
        expected = None
        if m and m.group(1) == "invalid":
            nxt = fenced[k + 1] if k + 1 < len(fenced) else None
            if nxt is None or nxt[1] != "text":
                raise ValueError(f"language.md:{line}: an invalid example needs its error in a ```text block after it")
            expected = nxt[2]
        out.append(Block(line, lang, body, m.group(1).split()[0] if m else None, m.group(2) if m else None, expected))
    return out


BLOCKS = blocks(DOC.read_text(encoding="utf-8"))


def parse_errors(text: str, lang: str, file: str) -> list[str]:
    """An excerpt's problems: YAML or .mem syntax, a key that is no section of a spec, an
    expression that does not parse."""
    from memspec.lang.errors import Collector
    from memspec.lang.frontend import parse_expressions
    from memspec.lang.frontend.mem_frontend import read_mem
    from memspec.lang.frontend.yaml_frontend import read_yaml
    from memspec.lang.spec import SPEC_KEYS

    diags = Collector()
    raw = (read_yaml if lang == "yaml" else read_mem)(text, file, diags)
    if raw is not None:
        parse_expressions(raw, diags)
        unknown = sorted(set(raw.data) - set(SPEC_KEYS))
        if unknown:
            return [f"not a section of a spec: {', '.join(unknown)}"]
    return [d.render() for d in diags.errors]


def test_the_doc_has_examples_of_every_kind():
    assert len(BLOCKS) >= 5
    assert {b.lang for b in BLOCKS} == {"yaml", "mem"}
    assert {b.marker for b in BLOCKS} >= {None, "invalid", "fragment"}


def test_markers_are_read():
    text = ("<!-- doc-test: fragment of memspec:titans_mal -->\n```mem\nwiring mal\n```\n\n"
            "<!-- doc-test: invalid -->\n\n```yaml\nname: x\n```\nsays\n```text\nx.yaml:1:1: error: e\n```\n"
            "<!-- doc-test: excerpt -->\n```yaml\nread: q @ S\n```\n")
    a, b = blocks(text)[:2]
    assert (a.marker, a.base, a.text) == ("fragment", "memspec:titans_mal", "wiring mal\n")
    assert (b.marker, b.expected) == ("invalid", "x.yaml:1:1: error: e\n")
    assert blocks(text)[2].marker == "excerpt"
    assert parse_errors("read: q @ S\n", "yaml", "x.yaml") == []
    assert parse_errors("read: q @@ S\n", "yaml", "x.yaml")[0].startswith("x.yaml:1:")
    assert parse_errors("reed: q @ S\n", "yaml", "x.yaml") == ["not a section of a spec: reed"]
    assert parse_errors("read = q @ S\n", "mem", "x.mem") == []
    with pytest.raises(ValueError, match="unknown doc-test marker"):
        blocks("<!-- doc-test: maybe -->\n```yaml\nname: x\n```\n")


@pytest.mark.parametrize("block", BLOCKS, ids=[f"language.md:{b.line}:{b.lang}" for b in BLOCKS])
def test_example(block, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    text = block.text
    if block.marker == "fragment":
        head = (f'extends "{block.base}"\nmemory fragment\n' if block.lang == "mem"
                else f"extends: {block.base}\nname: fragment\n")
        text = head + text
    path = Path(f"example.{block.lang}")
    if block.marker == "excerpt":
        assert parse_errors(text, block.lang, path.name) == []
        return
    path.write_text(text, encoding="utf-8")
    rc = main(["check", "-q", str(path)])
    err = capsys.readouterr().err
    if block.marker == "invalid":
        assert rc == 1 and err == block.expected
    else:
        assert rc == 0 and err == "", err


def test_the_gate_examples_in_yaml_and_mem_are_one_spec(tmp_path, monkeypatch):
    from memspec import load
    from memspec.schedule import analyse

    monkeypatch.chdir(tmp_path)
    specs = {}
    for b in BLOCKS:
        if b.marker is None and ("memory gated_deltanet_rate" in b.text or "name: gated_deltanet_rate" in b.text):
            p = Path(f"rate.{b.lang}")
            p.write_text(b.text, encoding="utf-8")
            specs[b.lang] = load(p)
    assert set(specs) == {"yaml", "mem"} and specs["yaml"] == specs["mem"]
    assert specs["yaml"].params["A_log"].shape == []
    assert analyse(specs["mem"]).family == "delta"          # "it keeps the delta schedule"
    # the shipped spec's description names the same formula, and no longer calls it inexpressible
    shipped = load(DOC.parent.parent / "specs" / "gated_deltanet.mem")
    formula = str(specs["yaml"].gates["alpha"].formula)
    assert formula == "1 - exp(-exp(A_log) * softplus(logit))" and formula in shipped.description
    assert "not expressible" not in shipped.description
