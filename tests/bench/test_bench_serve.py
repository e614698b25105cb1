"""`attnkit bench serve` on a tiny decoder: every measurement is there, with its goal line,
and the run leaves the engine idle with no block held."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serve"))
from tiny_decoders import flat_folder  # noqa: E402,F401 - a fixture

from conftest import require  # noqa: E402


@pytest.mark.slow
def test_bench_serve_reports_every_measure_and_goal(flat_folder):  # noqa: F811
    require("openai")
    require("fastapi")
    from attnkit.bench import SUITES
    from attnkit.bench.report import NullProgress
    from attnkit.bench.serve import run

    assert SUITES["serve"] == "attnkit.bench.serve"
    report = run(quick=True, progress=NullProgress(), threads=1, model=str(flat_folder))
    assert [row[0] for row in report.rows][:2] == ["completion tokens/s", "time to first token (ms)"]
    rows = {row[0]: row for row in report.rows}
    assert len(rows) == 6
    for measure in ("completion tokens/s", "time to first token (ms)", "KV bytes held (MiB)"):
        assert math.isfinite(rows[measure][3]) and rows[measure][3] > 0, rows[measure]
    # (the tiny model's text is bytes that are not UTF-8: it comes in one piece, so no chunk gaps)
    assert len(report.goals) == 4 and all(line.startswith(("PASS", "FAIL")) for line in report.goals)
    assert report.raw["ttft"]["repeat_cached_tokens"] > 0  # the repeat read the system prompt from the cache
    assert report.raw["engine"]["used_blocks"] == 0 and report.raw["engine"]["running"] == 0
