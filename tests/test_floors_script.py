"""benchmarks/floors.py: its verdicts, its argument checks, and one tiny run of its flash part
(the real run is in docs/benchmarks.md, "Floors")."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "floors.py"


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
    assert [r["goal"] for r in rows] == ["flash forward >= 0.8x torch SDPA, L=S=512",
                                         "flash fwd+bwd >= 1.0x torch SDPA, L=S=512"]
    for r in rows:
        assert r["floor_note"] in ("8 tiles of 512 x 512, 64 wide", "8 tiles of 512 x 512, 65 wide")  # 8 heads, a tile each
        assert r["floor_s"] > 0 and r["attnkit_s"] > 0 and r["peer_s"] > 0
        assert r["ceiling"] == pytest.approx(r["peer_s"] / r["floor_s"])
