"""The torch_modules benchmark suite, at toy sizes (the real run is in docs/benchmarks.md)."""

from __future__ import annotations

import pytest

from attnkit.bench import SUITES, NullProgress, run_suite
from attnkit.bench import torch_modules


def test_round_robin_timing_pairs_rounds():
    calls = []
    timed = torch_modules.time_round_robin({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, rounds=3)
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b"]  # warmup, then alternating order
    assert set(timed) == {"a", "b"} and all(len(t["runs_s"]) == 3 for t in timed.values())
    assert timed["a"]["paired_median"] == 1.0
    with pytest.raises(ValueError, match="clock"):
        torch_modules.time_round_robin({"a": lambda: None}, rounds=1, clock="sundial")


def test_suite_reports_every_contender_and_the_goal(monkeypatch, torch):
    assert SUITES["torch_modules"] == "attnkit.bench.torch_modules"
    monkeypatch.setattr(torch_modules, "D_MODEL", 32)
    monkeypatch.setattr(torch_modules, "HEADS", 4)
    monkeypatch.setattr(torch_modules, "QUICK_LENGTHS", (48,))
    monkeypatch.setattr(torch_modules, "GOAL_L", 48)
    report = run_suite("torch_modules", quick=True, progress=NullProgress(), threads=1)
    impls = {row[3] for row in report.rows}
    assert {"direct SDPA", "attnkit.torch MHA", "torch.nn.MultiheadAttention",
            "SDPA (attention only)", "attnkit.torch flash_attention"} <= impls
    assert len(report.rows) == 4 * 3 + 2 * 2  # 4 MHA cases x 3 contenders, 2 flash cases x 2 (threads=1: once)
    # each row is its measurement: ms, then the ratio of the baseline's best time to this
    # contender's (the baseline of its group: direct SDPA, or SDPA attention-only)
    assert report.columns == ["L=S", "causal", "pass", "impl", "ms", "vs direct", "paired"]
    assert len(report.rows) == len(report.raw["measurements"])
    for row, m in zip(report.rows, report.raw["measurements"]):
        assert row[4] == pytest.approx(m["best_s"] * 1e3) and row[4] > 0
        base = "direct SDPA" if m["kind"] == "mha" else "SDPA (attention only)"
        (baseline,) = [b for b in report.raw["measurements"] if b["impl"] == base and b["kind"] == m["kind"]
                       and (b["L"], b["causal"], b["passes"], b["threads"]) == (m["L"], m["causal"], m["passes"], m["threads"])]
        assert row[5] == pytest.approx(baseline["best_s"] / m["best_s"]) == m["vs_direct"]
        assert row[6] == m["paired_median"] > 0
    assert report.raw["goal"]["L"] == 48 and isinstance(report.raw["goal"]["met"], bool)
    # the goal lines are apart from the notes a user reads (attnkit bench --goals shows them)
    assert [goal.split()[0] for goal in report.goals] == [
        "PASS" if report.raw["goal"]["met"] else "MISS", "PASS" if report.raw["goal"]["met_paired"] else "MISS"]
    assert not any(note.startswith(("PASS", "MISS")) or "goal" in note for note in report.findings())
