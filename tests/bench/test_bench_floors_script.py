"""benchmarks/floors.py: its verdicts, its argument checks, and one tiny run of its flash part
(the real run is in docs/benchmarks.md, "Floors")."""

from __future__ import annotations

import importlib.util
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "floors.py"


@pytest.fixture(scope="module")
def floors():
    spec = importlib.util.spec_from_file_location("floors", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "floor, ours, peer, goal, verdict",
    [
        (1.0, 1.2, 1.5, 1.2, "PASS now"),  # 1.25 >= 1.2
        (1.0, 1.5, 1.4, 1.5, "unreachable here"),  # even a free rest gives 1.4 < 1.5
        (1.0, 1.5, 1.8, 1.5, "reachable: the rest must shrink"),  # 1.2 now, 1.8 at most
        (1.0, 1.25, 1.5, 1.2, "PASS now"),  # exactly at the goal passes, as the suites' goal lines do
    ],
)
def test_each_goal_gets_the_verdict_its_times_imply(floors, floor, ours, peer, goal, verdict):
    row = floors.assess(dict(floor_s=floor, attnkit_s=ours, peer_s=peer, goal_ratio=goal))
    assert row["verdict"] == verdict
    assert row["ratio"] == pytest.approx(peer / ours)
    assert row["ceiling"] == pytest.approx(peer / floor)
    # the budget is what attnkit's non-floor work may cost: floor + budget is the slowest passing time
    assert row["budget_s"] == pytest.approx(peer / goal - floor)
    assert (peer / (floor + row["budget_s"])) == pytest.approx(goal)


@pytest.mark.parametrize("part, ours, verdict", [("encoder", 1.15, "PASS"), ("encoder", 1.16, "FAIL"),
                                                 ("flash", 1.2, "PASS"), ("flash", 1.21, "FAIL")])
def test_each_path_gets_its_distance_to_its_floor(floors, part, ours, verdict):
    row = floors.assess(dict(part=part, floor_s=1.0, attnkit_s=ours, peer_s=2.0, goal_ratio=1.0))
    assert row["x_floor"] == pytest.approx(ours)
    assert row["floor_goal"] == (1.15 if part == "encoder" else 1.2)
    assert row["floor_verdict"] == verdict


def test_an_info_floor_gets_no_verdict(floors):
    """The encoder's linear products alone are shown beside its floor as info: no verdict,
    whatever the distance (no implementation runs the encoder in that time)."""
    row = floors.assess(dict(part="encoder", info=True, floor_s=1.0, attnkit_s=1.4, peer_s=2.0, goal_ratio=1.0))
    assert row["x_floor"] == pytest.approx(1.4) and row["floor_verdict"] == "info"
    assert floors._cells(dict(row, goal="g", floor_note="n"))[-1] == "info"


def _rows(floors):
    return [floors.assess(dict(part="encoder", goal="attnkit >= 1.3x sentence-transformers (256 varied, batch 32)",
                               floor_s=1.0, floor_note="130.2 GFLOP/s, 6000 tokens", attnkit_s=1.3, peer_s=1.5,
                               goal_ratio=1.3)),
            floors.assess(dict(part="flash", goal="flash forward >= 1.2x torch SDPA, L=S=2048", floor_s=0.1,
                               floor_note="128 tiles of 256 x 512, 65 wide", attnkit_s=0.12, peer_s=0.2,
                               goal_ratio=1.2))]


def test_a_file_gets_every_cell_whole_on_one_line(floors):
    """Written to a file (no terminal) the table is printed at its own width: each cell on
    one line, never a column squeezed to a word a line."""
    from rich.console import Console

    out = io.StringIO()
    rows = _rows(floors)
    assert floors.render(rows, "floors", Console(file=out, width=80, color_system=None)) == []
    lines = out.getvalue().splitlines()
    for r in rows:
        for cell in floors._cells(r):
            assert any(cell in line for line in lines), f"cell {cell!r} is not whole on one line"


@pytest.mark.parametrize("width", [60, 80, 120, 200])
def test_a_terminal_gets_wrapped_words_or_fewer_columns_never_cut_cells(floors, width):
    from rich.console import Console

    out = io.StringIO()
    rows = _rows(floors)
    dropped = floors.render(rows, "floors", Console(file=out, width=width, force_terminal=True, color_system=None))
    text = out.getvalue()
    assert all(len(line) <= width for line in text.splitlines()), "a line wider than the terminal"
    assert "…" not in text, "a cell was cut"
    shown = [i for i, column in enumerate(floors.COLUMNS) if column[0] not in dropped]
    words = text.split()
    for r in rows:
        cells = floors._cells(r)
        for i in shown:
            for word in cells[i].split():
                assert word in words or any(word in w for w in words), f"{word!r} of column {i} missing or cut"
    if dropped:
        assert "columns left out to fit" in " ".join(words)
    assert "ratio now" in text and "x floor" in text  # never dropped


def test_help_speaks_of_floors_not_of_tickets():
    run = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True)
    assert run.returncode == 0
    assert "issue" not in run.stdout.lower() and "floor" in run.stdout.lower()


def test_lengths_that_are_not_whole_tiles_are_refused():
    run = subprocess.run([sys.executable, str(SCRIPT), "--part", "flash", "--lengths", "1000"],
                         capture_output=True, text=True)
    assert run.returncode == 2
    assert "multiples of 512" in run.stderr and "[1000]" in run.stderr


@pytest.mark.slow
def test_the_flash_part_runs_and_reports_both_goals(tmp_path, torch):
    out = tmp_path / "floors.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--part", "flash", "--lengths", "512", "--rounds", "1",
                          "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["goal"] for r in rows] == ["flash forward >= 1.2x torch SDPA, L=S=512",
                                         "flash fwd+bwd >= 1.0x torch SDPA, L=S=512"]
    for r in rows:
        assert r["floor_note"] in ("8 tiles of 512 x 512, 64 wide", "8 tiles of 512 x 512, 65 wide")  # 8 heads, a tile each
        assert r["floor_s"] > 0 and r["attnkit_s"] > 0 and r["peer_s"] > 0
        assert r["ceiling"] == pytest.approx(r["peer_s"] / r["floor_s"])
        assert r["x_floor"] == pytest.approx(r["attnkit_s"] / r["floor_s"])
