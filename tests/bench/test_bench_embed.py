"""The `attnkit bench encoder` suite: runs, follows the suite protocol, checks fidelity."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import require

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
    # (tests/models/test_bert.py holds the float64-grounded fidelity budget.)
    assert result["max_abs_diff"] <= 1e-4
    # the row is the two timed contenders as sentences per second, and their ratio
    n = result["sentences"]
    assert result["attnkit_per_second"] == pytest.approx(n / result["attnkit_seconds"])
    assert result["reference_per_second"] == pytest.approx(n / result["reference_seconds"])
    assert result["ratio"] == pytest.approx(result["reference_seconds"] / result["attnkit_seconds"])
    row = report.rows[0]
    assert row[0] == "64 varied" and row[6] == round(result["ratio"], 2) and "goal" in report.notes[0]


def _result(**fields):
    from attnkit.bench.encoder import EncoderBenchResult

    base = dict(
        workload="varied", sentences=256, tokens=6169, batch_size=32, threads=1, repeats=7,
        attnkit_seconds=1.0, reference_seconds=1.6, attnkit_per_second=256.0, reference_per_second=160.0,
        ratio=1.6, max_abs_diff=2e-7,
    )
    return EncoderBenchResult(**{**base, **fields})


def test_goal_lines_say_pass_or_fail_per_thread_count():
    from attnkit.bench.encoder import goal_lines

    lines = goal_lines([
        _result(workload="uniform", sentences=64, batch_size=64),  # not the goal workload: no line
        _result(ort_seconds=1.1, ort_per_second=233.0, ort_ratio=1.1, ort_max_abs_diff=2e-7),
        _result(threads=2, ratio=1.2, one_thread_seconds=1.5, thread_gain=1.5),
    ])
    assert lines == [
        "goal: attnkit >= 1.3x sentence-transformers (256 varied sentences, batch 32, 1 thread): 1.60x PASS",
        "goal: attnkit >= 1.2x ONNX Runtime (256 varied sentences, batch 32, 1 thread): 1.10x FAIL",
        "goal: attnkit >= 1.3x sentence-transformers (256 varied sentences, batch 32, 2 threads): 1.20x FAIL",
        "goal: attnkit >= 1.2x ONNX Runtime (256 varied sentences, batch 32, 2 threads): not measured "
        "(install onnxruntime onnx onnxscript; the quick run skips it)",
        "goal: attnkit at 2 threads >= at 1 thread (256 varied, batch 32, timed alongside): 1.50x PASS",
    ]


@pytest.mark.slow
def test_onnxruntime_contender_matches_sentence_transformers(minilm_folder, torch, sentence_transformers):
    """The optional ONNX Runtime contender: the exported model gives sentence-transformers'
    embeddings, in input order, for batches of several lengths."""
    for name in ("onnxruntime", "onnx", "onnxscript"):  # in the test extra; optional for users
        require(name)
    from attnkit.bench.encoder import OnnxRuntimeEncoder, benchmark_sentences

    reference = sentence_transformers.SentenceTransformer(str(minilm_folder), device="cpu")
    texts = benchmark_sentences(20)
    ort = OnnxRuntimeEncoder(reference, threads=1)
    got = ort.encode(texts, batch_size=8)
    with torch.inference_mode():
        expected = reference.encode(texts, batch_size=8, convert_to_numpy=True)
    # float32 unit vectors; a wrong mask or order moves entries by 1e-2 (see the quick run's check)
    assert got.shape == expected.shape and np.abs(got - expected).max() <= 1e-4
