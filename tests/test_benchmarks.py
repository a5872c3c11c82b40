"""The benchmark scripts that back the README's speed claims still run and still compute what
they time: their own equality checks (each exits non-zero when a timed form differs from the
module's chunked schedule) at small sizes, one round, no torch.compile."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def script(name):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod      # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_floor_minimal_form_equals_the_module(capsys):
    threads = torch.get_num_threads()
    try:
        assert script("floor").main(["--T", "128", "--D", "16", "--chunk", "16", "--group", "4", "--repeat", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    for row in ("online", "chunked", "minimal", "matmuls"):
        assert f"\n{row} " in out


@pytest.mark.parametrize("name", ["retention", "gla", "kda", "momentum_deltanet"])
def test_compiled_group_slices_equal_the_chunked_forward(name, capsys):
    """The script's slices (one chunk each, a shorter tail: T = 80, chunks of 32 or 64), run
    eagerly, equal the module's chunked forward over all tokens (its self-check exits 1 otherwise;
    that the slicing carries the state is tested in test_compiled_chunked.py)."""
    threads = torch.get_num_threads()
    try:
        rc = script("compiled_group").main([f"specs/{name}.yaml", "--T", "80", "--D", "16", "--slice-chunks", "1",
                                            "--repeat", "1", "--no-compile"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert rc == 0, out
    diff = float(out.split("largest relative difference to the eager chunked forward ")[1].split()[0])
    assert diff < 1e-5


def _table_rows(text: str, header: str) -> list[list[str]]:
    """The cells of the Markdown table that starts with ``header``."""
    rows = []
    for line in text.split(header, 1)[1].splitlines()[2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def _ms(cell: str) -> float:
    assert cell.endswith(" ms"), cell
    return float(cell[:-3].replace(",", ""))


def _bounds(number: str) -> tuple[float, float]:
    """The interval a printed number stands for: its value +- half a unit of its last decimal."""
    text = number.replace(",", "")
    half = 0.5 * 10.0 ** -(len(text.split(".")[1]) if "." in text else 0)
    return float(text) - half, float(text) + half


def _check_family_table(text: str) -> None:
    rows = _table_rows(text, "| family | spec (default schedule) | pass |")
    report = script("report")
    assert [r[0] for r in rows[::2]] == list(report.FAMILY_SPECS)
    assert {r[2] for r in rows} == {"forward", "forward + backward"}
    for family, _, _, mine, online, ratio, peer, peer_ratio, runs in rows:
        assert all(int(n) >= 1 for n in runs.split(" / "))
        if family == "online":
            assert online == ratio == "—"
        else:   # the ratio is the two printed times' quotient, up to the rounding of all three
            (o_lo, o_hi), (m_lo, m_hi), (r_lo, r_hi) = _bounds(online[:-3]), _bounds(mine[:-3]), _bounds(ratio[:-1])
            assert r_hi >= o_lo / m_hi and r_lo <= o_hi / max(m_lo, 1e-12), (ratio, online, mine)
        if peer != "—":
            assert float(peer_ratio[:-1]) > 0
    peers = {r[1].split(" ")[0]: r[6] for r in rows}
    assert "lact_anchor" in peers["lact"]


def test_report_family_table_quick(tmp_path):
    """benchmarks/report.py --quick --sections family: one spec per family in FAMILIES' order (each
    spec's family decided by the algebra, the script stops otherwise), forward and forward + backward,
    peers checked equal before timing; the README block is replaced between its markers only."""
    readme = tmp_path / "README.md"
    readme.write_text("before\n<!-- report:speed -->\nold table\n<!-- /report:speed -->\nafter\n")
    out = tmp_path / "benchmarks.md"
    threads = torch.get_num_threads()
    try:
        assert script("report").main(["--quick", "--threads", "1", "--sections", "family", "--out", str(out),
                                      "--readme", str(readme)]) == 0
    finally:
        torch.set_num_threads(threads)
    text = out.read_text()
    assert "| CPU | cores | threads | torch | Python |" in text and f"| {torch.__version__} |" in text
    _check_family_table(text)
    new = readme.read_text()
    shown = "`python benchmarks/report.py --threads 1 --quick --sections family`"
    assert new.startswith(f"before\n<!-- report:speed -->\n{shown}")
    assert new.endswith("<!-- /report:speed -->\nafter\n") and "old table" not in new
    # the README's line per family carries the report's times and ratios
    full = _table_rows(text, "| family | spec (default schedule) | pass |")
    short = _table_rows(new, "| family | spec (default schedule) | forward |")
    assert len(short) == len(full) // 2
    for line, fwd, bwd in zip(short, full[::2], full[1::2]):
        assert line[:2] == fwd[:2] and line[8] == fwd[6]
        assert line[2:5] == [fwd[3], fwd[5], fwd[7]] and line[5:8] == [bwd[3], bwd[5], bwd[7]]


@pytest.mark.slow
def test_report_quick_every_section(tmp_path):
    """The whole --quick report: the scripts' tables (memspec bench, anchors, floor, frontier memory) from their own
    commands, each shown with its command line, and the family table of the shipped specs."""
    out = tmp_path / "benchmarks.md"
    threads = torch.get_num_threads()
    try:
        assert script("report").main(["--quick", "--threads", "1", "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    text = out.read_text()
    _check_family_table(text)
    for command in ("`memspec bench specs/linear_attention.yaml", "`python benchmarks/anchors.py --T 128",
                    "`python benchmarks/anchors.py --dplr", "`python benchmarks/floor.py",
                    "`python benchmarks/lact_anchor.py --T 128"):
        assert command in text
    lact = _table_rows(text, "| chunk | pass | anchor |")
    assert [(r[0], r[1]) for r in lact] == [("16", "forward"), ("16", "fwd+bwd")] and all(_ms(r[3]) > 0 for r in lact)
    bench = _table_rows(text, "| spec | schedule | exact |")
    assert {(r[0], r[1]) for r in bench} == {("linear_attention", "additive"), ("linear_attention", "online"),
                                             ("hgrn", "scan"), ("hgrn", "online")}
    assert all(_ms(r[4]) > 0 for r in bench) and "failed" not in text
    two = text.split("## The elementwise and per-channel forms at two threads", 1)[1]
    assert "`memspec bench specs/hgrn.yaml --T 128 --repeat 1 --threads 2" in two
    assert {(r[0], r[1]) for r in _table_rows(two, "| spec | schedule | exact |")} == {("hgrn", "scan"),
                                                                                     ("hgrn", "online")}
    kernels = [r[0] for r in _table_rows(text, "| kernel | memspec, forward |")]
    assert kernels[:4] == ["delta rule", "gated delta rule", "linear attention", "decayed lin. attn"]
    assert [r[0] for r in _table_rows(text, "| row | median |")] == ["online", "chunked", "minimal", "matmuls"]
    memory = _table_rows(text, "| spec | schedule | peak GB |")
    assert [r[0] for r in memory] == ["titans", "lact"] and memory[0][3] == "1.00" and float(memory[1][2]) > 0
    families = {r[0]: r[2] for r in _table_rows(text, "| family | exact | shipped specs")}
    assert "deltanet" in families["delta"].split(", ") and families["apply_update"] == "lact"


def test_readme_speed_table_comes_from_the_report():
    """The README's speed table is the block benchmarks/report.py writes, from the same run as
    docs/benchmarks.md (the same times and ratios, family by family), never edited by hand."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = readme.split("<!-- report:speed -->\n", 1)[1].split("<!-- /report:speed -->", 1)[0]
    assert block.startswith("`python benchmarks/report.py")
    doc = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    assert block.split("`")[1] in doc.split("\n", 3)[2]          # the same command made both
    short = _table_rows(block, "| family | spec (default schedule) | forward |")
    full = _table_rows(doc, "| family | spec (default schedule) | pass |")
    assert [r[0] for r in short] == list(script("report").FAMILY_SPECS)
    for line, fwd, bwd in zip(short, full[::2], full[1::2]):
        assert line[2:5] == [fwd[3], fwd[5], fwd[7]] and line[5:8] == [bwd[3], bwd[5], bwd[7]]
