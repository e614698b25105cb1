"""The `attnkit bench encoder` suite: runs, follows the suite protocol, checks fidelity."""

from __future__ import annotations

import pytest

from attnkit.bench import SUITES, BenchReport, run_suite
from attnkit.bench.encoder import benchmark_sentences, uniform_sentences


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
@pytest.mark.usefixtures("torch", "sentence_transformers", "minilm_folder")
def test_encoder_suite_quick_run():
    assert "encoder" in SUITES
    progress = Recorder()
    report = run_suite("encoder", quick=True, progress=progress, threads=2)
    assert isinstance(report, BenchReport)
    assert progress.n == len(progress.steps) == 2
    (result,) = report.raw["results"]
    assert result["sentences"] == 64 and result["threads"] == 2
    # The suite's fidelity check on unit-norm 384-d embeddings (entries about 0.05): a
    # wrong weight, mask or pooling moves entries by 1e-2 or more, float32 rounding by
    # about 1e-7 on any BLAS kernel; 1e-4 fails on the first and never on the second.
    # (tests/test_bert.py holds the float64-grounded fidelity budget.)
    assert result["max_abs_diff"] <= 1e-4
    # the row is the two timed contenders as sentences per second, and their ratio
    n = result["sentences"]
    assert result["attnkit_per_second"] == pytest.approx(n / result["attnkit_seconds"])
    assert result["reference_per_second"] == pytest.approx(n / result["reference_seconds"])
    assert result["ratio"] == pytest.approx(result["reference_seconds"] / result["attnkit_seconds"])
    row = report.rows[0]
    assert row[0] == "64 varied" and row[6] == round(result["ratio"], 2) and "goal" in report.notes[0]
