"""The `attnkit bench encoder` suite: runs, follows the suite protocol, checks fidelity."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("sentence_transformers")

from attnkit.bench import SUITES, BenchReport, run_suite  # noqa: E402
from attnkit.bench.encoder import benchmark_sentences, uniform_sentences  # noqa: E402


class Recorder:
    def __init__(self):
        self.n, self.steps = None, []

    def total(self, n):
        self.n = n

    def step(self, description):
        self.steps.append(description)


def test_sentence_sets_are_deterministic():
    assert benchmark_sentences(64) == benchmark_sentences(64)
    assert len(set(benchmark_sentences(64))) > 40
    assert len(uniform_sentences(10)) == 10


@pytest.mark.slow
def test_encoder_suite_quick_run():
    assert "encoder" in SUITES
    progress = Recorder()
    report = run_suite("encoder", quick=True, progress=progress, threads=2)
    assert isinstance(report, BenchReport)
    assert progress.n == len(progress.steps) == 2
    (result,) = report.raw["results"]
    assert result["sentences"] == 64 and result["threads"] == 2
    assert result["max_abs_diff"] <= 1e-6
    assert result["attnkit_seconds"] > 0 and result["reference_seconds"] > 0
    assert report.rows[0][0] == "64 varied" and "goal" in report.notes[0]
