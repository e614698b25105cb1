"""`attnkit bench`: results and reasons for everyone, the project's goal lines only with --goals.

A new user's `attnkit bench --quick` printed `FAIL causal / full forward time at L=1024:
0.71x (goal <= 0.60x)` and exited 0; torch rows read `MiB 0.00` with no word on why.
"""

from __future__ import annotations

import json
import platform
import types

import numpy as np
import pytest
from typer.testing import CliRunner

import attnkit.bench
from attnkit.bench import measure
from attnkit.bench.report import BenchReport, NullProgress, goal_failed, is_goal_line, without_goal
from attnkit.cli import app

runner = CliRunner()
ENV = {"COLUMNS": "120", "NO_COLOR": "1"}

# Notes as the suites write them: results, goal lines (in the notes, as suites wrote them
# before `goals` existed), and results with a trailing "(goal ...)".
RESULTS = ["CPU: a test machine, 2 CPUs for this process",
           "1 thread(s): same greedy tokens as transformers: yes",
           "DONE single-head causal forward at L=S=131072: 51.2 s (42 GFLOP/s)"]
GOALS_IN_NOTES = ["FAIL causal / full forward time at L=1024: 0.71x (goal <= 0.60x)",
                  "PASS forward vs NumPy naive at L=1024: 1.52x (goal >= 1.30x)",
                  "info forward vs torch SDPA at L=1024: 0.91x (goal >= 0.80x at L >= 2048, not measured in this run)",
                  "N/A  fwd 2 threads vs 1 at L=1024: 1.10x, not measurable now",
                  "goal: decoding (L=1) with flash >= naive at context 4096 (naive / flash >= 1.0): NOT met",
                  "MISS: the same, worst paired median ratio 0.912 (steadier on a loaded machine)",
                  "2 thread(s): goal attnkit >= 1.5x transformers: PASS (1.76x best)"]
TRAILING = ["embeddings agree within 3.1e-07 of sentence-transformers' (goal 1e-6)"]


def report(notes, goals=()):
    return BenchReport("t", ["impl", "ms"], [["attnkit flash", 1.25]], list(notes), {}, list(goals))


@pytest.fixture
def suite(monkeypatch):
    """`attnkit bench fake` returns the report put in `holder[0]`."""
    holder = []
    monkeypatch.setitem(attnkit.bench.SUITES, "fake", "a test suite")
    monkeypatch.setattr(attnkit.bench, "get_suite", lambda name: types.SimpleNamespace(
        run=lambda *, quick, progress, threads=None: holder[0]))
    return holder


def test_goal_lines_are_told_from_results():
    assert not any(is_goal_line(line) for line in RESULTS + TRAILING)
    assert all(is_goal_line(line) for line in GOALS_IN_NOTES)
    assert [goal_failed(line) for line in GOALS_IN_NOTES] == [True, False, False, False, True, True, False]
    assert without_goal(TRAILING[0]) == "embeddings agree within 3.1e-07 of sentence-transformers'"
    r = report(RESULTS + GOALS_IN_NOTES + TRAILING, goals=["FAIL a stated goal: 0.5x (goal >= 1.0x)"])
    assert r.findings() == RESULTS + [without_goal(TRAILING[0])]
    assert r.goal_lines() == GOALS_IN_NOTES + TRAILING + ["FAIL a stated goal: 0.5x (goal >= 1.0x)"]
    assert len(r.failed_goals()) == 4


def test_bench_prints_no_goal_lines_without_goals(suite, tmp_path):
    suite.append(report(RESULTS + GOALS_IN_NOTES + TRAILING, goals=["FAIL a stated goal: 0.5x (goal >= 1.0x)"]))
    path = tmp_path / "out.json"
    result = runner.invoke(app, ["bench", "fake", "--quick", "--json", str(path)], env=ENV)
    assert result.exit_code == 0, result.output
    out = result.stdout.split("wrote ")[0]  # the file's name holds this test's name
    for line in RESULTS:
        assert line in out
    assert "embeddings agree within 3.1e-07 of sentence-transformers'" in out
    for word in ("PASS", "FAIL", "MISS", "N/A", "goal", "NOT met"):
        assert word not in out, out
    # the JSON keeps everything measured and stated, goals included
    data = json.loads(path.read_text())
    assert data["report"]["notes"] == RESULTS + GOALS_IN_NOTES + TRAILING
    assert data["report"]["goals"] == ["FAIL a stated goal: 0.5x (goal >= 1.0x)"]


def test_bench_goals_prints_them_and_fails_like_a_test(suite):
    suite.append(report(RESULTS + GOALS_IN_NOTES, goals=["PASS a stated goal: 1.5x (goal >= 1.0x)"]))
    result = runner.invoke(app, ["bench", "fake", "--quick", "--goals"], env=ENV)
    assert result.exit_code == 1, result.output
    for line in RESULTS + GOALS_IN_NOTES + ["PASS a stated goal: 1.5x (goal >= 1.0x)"]:
        assert line in result.stdout
    assert result.stderr.strip().splitlines() == ["error: 3 of 8 goal line(s) not met (FAIL, MISS or NOT met above)"]

    suite[0] = report(RESULTS, goals=["PASS a stated goal: 1.5x (goal >= 1.0x)"])
    passed = runner.invoke(app, ["bench", "fake", "--quick", "--goals"], env=ENV)
    assert passed.exit_code == 0 and "PASS a stated goal" in passed.stdout


def test_memory_column_says_how_it_was_measured(suite):
    r = report(RESULTS)
    r.raw = {"measurements": [{"memory_method": "tracemalloc"}, {"memory_method": "rss"}]}
    suite.append(r)
    out = " ".join(runner.invoke(app, ["bench", "fake"], env=ENV).stdout.split())
    assert measure.MEMORY_METHODS["tracemalloc"] in out and measure.MEMORY_METHODS["rss"] in out
    assert measure.memory_note([]) is None


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                    reason="resident size from /proc and malloc_trim: Linux with glibc")
def test_resident_peak_sees_memory_a_call_reuses():
    """Torch rows read 0.00 MiB: the previous call's freed buffers stayed in the C allocator,
    the next call reused them, and the resident size did not grow. The oracle is tracemalloc,
    which sees NumPy's buffers exactly."""
    def call():
        return np.ones(2 * 2**20)  # 16 MiB, held until the call's last sample

    for _ in range(3):  # the allocator now keeps 16 MiB it freed
        call()
    exact = measure.peak_numpy_bytes(call)
    sampled = measure.peak_rss_bytes(call)
    assert exact >= 16 * 2**20
    assert sampled >= 0.9 * exact, (sampled, exact)


@pytest.mark.slow
def test_attention_suite_quick_run_shows_no_goal_lines(monkeypatch, suite):
    """The real attention suite at tiny sizes: its goal lines reach the report, not the screen."""
    from attnkit.bench import attention

    monkeypatch.setattr(attention, "QUICK_LENGTHS", (32, 64))
    monkeypatch.setattr(attention, "H", 2)
    monkeypatch.setattr(attention, "E", 8)
    original = attention._scaling
    monkeypatch.setattr(attention, "_scaling", lambda L, *a, **k: original(64, *a, **k))
    suite.append(attention.run(quick=True, progress=NullProgress(), threads=1))  # once, shown twice
    assert suite[0].goal_lines()
    plain = runner.invoke(app, ["bench", "fake", "--quick"], env=ENV)
    assert plain.exit_code == 0, plain.output
    assert "attnkit flash" in plain.stdout
    assert not any(is_goal_line(line.strip()) for line in plain.stdout.splitlines() if line.strip())
    assert "goal" not in plain.stdout and "FAIL" not in plain.stdout and "PASS" not in plain.stdout
    with_goals = runner.invoke(app, ["bench", "fake", "--quick", "--goals"], env=ENV)
    assert with_goals.exit_code == (1 if suite[0].failed_goals() else 0), with_goals.output
    assert all(" ".join(line.split()) in " ".join(with_goals.stdout.split()) for line in suite[0].goal_lines())
