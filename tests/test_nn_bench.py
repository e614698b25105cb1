"""The nn benchmark suite runs, and its contenders compute the same function."""

from __future__ import annotations

from attnkit.bench import SUITES, NullProgress, run_suite


def test_nn_suite_quick_run():
    assert "nn" in SUITES
    report = run_suite("nn", quick=True, progress=NullProgress(), threads=1)
    assert [row[1] for row in report.rows] == ["TransformerBlock", "MultiHeadAttention"]
    for row in report.rows:
        ours_ms, torch_ms, speedup, diff = row[2], row[3], row[4], float(row[5])
        assert ours_ms > 0 and torch_ms > 0 and speedup > 0
        assert diff < 1e-4, f"attnkit and torch disagree by {diff}"
