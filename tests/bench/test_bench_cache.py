"""The cache benchmark suite runs, its rows are its measurements, and its two
contenders compute the same attention."""

from __future__ import annotations

import pytest

from attnkit.bench import SUITES, NullProgress, run_suite
from attnkit.bench.cache import GOAL_CONTEXT, GOAL_RATIO, QUICK_SIZES


def test_cache_suite_quick_run():
    assert "cache" in SUITES
    report = run_suite("cache", quick=True, progress=NullProgress(), threads=1)
    assert report.columns == ["S", "L", "naive ms", "flash ms", "naive / flash", "max |diff|"]
    assert [(row[0], row[1]) for row in report.rows] == list(QUICK_SIZES)
    for row, size in zip(report.rows, report.raw["sizes"]):
        naive_ms, flash_ms, ratio, diff = row[2], row[3], row[4], float(row[5])
        assert (row[0], row[1]) == (size["S"], size["L"])
        # the row is the best of each contender's timed rounds, in ms, and their ratio
        naive_s, flash_s = min(size["naive_s"]), min(size["flash_s"])
        assert naive_ms == pytest.approx(naive_s * 1e3, abs=1e-3) and naive_ms > 0
        assert flash_ms == pytest.approx(flash_s * 1e3, abs=1e-3) and flash_ms > 0
        assert ratio == pytest.approx(naive_s / flash_s, abs=0.006)
        # One attention over the same cache: outputs of size ~1 (averages of N(0, 1)
        # values) agree to float32 rounding (~1e-7); a wrong mask or alignment moves
        # them by O(0.1). 1e-4 fails on a bug and never on a CPU.
        assert diff < 1e-4, f"naive and flash disagree by {diff}"
    # the goal line says what the rows at the goal's context say
    decode = [row[4] for row in report.rows if row[0] == GOAL_CONTEXT and row[1] == 1]
    met = bool(decode) and all(r >= GOAL_RATIO for r in decode)
    assert report.raw["goal"]["met"] is met
    # a goal line, held back from what a user reads unless asked for (attnkit bench --goals)
    (goal,) = report.goals
    assert goal.startswith(f"{'PASS' if met else 'FAIL'} decoding (L=1) with flash at context {GOAL_CONTEXT}: ")
    assert report.failed_goals() == ([] if met else [goal])
    assert not any("goal" in note.lower() for note in report.findings())
