"""`attnkit bench decoder`: the report's rows and goal lines, the bandwidth bound, the optional llama.cpp.

The suite itself loads SmolLM2 twice and runs for minutes, so these tests check its
parts: the report built from a measured result, the bytes a decode step reads, the
bandwidth probe, and that llama.cpp stays optional.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

from attnkit.bench import BenchReport, decoder
from attnkit.models.llama import LlamaConfig, LlamaForCausalLM


def _result(threads, ours, hf, decode, bandwidth, lcpp=None):
    rate = {"attnkit": ours, "transformers": hf}
    if lcpp is not None:
        rate["llama.cpp"] = lcpp
    weight = 538e6
    bound = bandwidth * 1e9 / weight
    return {
        "threads": threads,
        "tokens_per_second": rate,
        "decode_tokens_per_second": decode,
        "ratio": ours / hf,
        "ratio_paired_median": ours / hf,
        "llama_cpp_ratio": None if lcpp is None else ours / lcpp,
        "times_s": {name: [128 / r] for name, r in rate.items()},
        "bandwidth_gb_s": [bandwidth],
        "bound_tokens_per_second": bound,
        "bound_fraction": decode / bound,
        "bound_fraction_paired_median": 0.5,
        "same_tokens": True,
        "llama_cpp": "installed" if lcpp else "not installed",
    }


def _raw(*results):
    return {
        "prompt_tokens": 50, "new_tokens": 128, "threads": [r["threads"] for r in results], "weight_bytes": 538e6,
        "probe_bytes": 256 * 2**20, "results": list(results), "load_s": {"attnkit": 1.0, "transformers": 2.0},
        "per_token": [{"context": 32, "with_cache_ms": 30.0, "without_cache_ms": 100.0}],
        "cpu_model": "Some CPU", "blas": "openblas",
    }


def test_report_has_goal_lines_for_each_thread_count_and_the_cpu():
    raw = _raw(_result(1, 30.0, 17.0, 32.0, 20.0), _result(2, 29.0, 22.0, 31.0, 30.0))
    report = decoder.report_from_raw(raw)
    assert isinstance(report, BenchReport) and report.columns == decoder.COLUMNS
    assert all(len(row) == len(report.columns) for row in report.rows)
    text = "\n".join(report.notes)
    assert "CPU: Some CPU" in text
    # 1 thread: 30/17 = 1.76x PASS; bound 20e9/538e6 = 37.2 tok/s, 32/37.2 = 86% PASS
    assert "1 thread(s): goal attnkit >= 1.5x transformers: PASS (1.76x" in text
    assert "1 thread(s): goal attnkit decode >= 60% of the float32 bandwidth bound: PASS (86% best; 50% median" in text
    # 2 threads: 29/22 = 1.32x FAIL; bound 55.8 tok/s, 31/55.8 = 56% FAIL
    assert "2 thread(s): goal attnkit >= 1.5x transformers: FAIL (1.32x" in text
    assert "2 thread(s): goal attnkit decode >= 60% of the float32 bandwidth bound: FAIL (56%" in text
    assert "not slower than at 1: PASS (0.97x" in text
    assert "not installed" in text
    greedy = [row for row in report.rows if row[0].startswith("greedy")]
    assert [row[1] for row in greedy] == [1, 2] and greedy[0][3:6] == [30.0, 17.0, None]
    bound_rows = [row for row in report.rows if "bound" in row[0]]
    assert bound_rows[0][3] == pytest.approx(20e9 / 538e6, abs=0.05) and bound_rows[0][6] == "86% of bound"


def test_report_with_llama_cpp_and_one_thread_count():
    report = decoder.report_from_raw(_raw(_result(1, 30.0, 15.0, 32.0, 20.0, lcpp=60.0)))
    text = "\n".join(report.notes)
    assert "llama.cpp (native Q4_1, not float32): attnkit 0.50x" in text
    assert "not slower" not in text  # one thread count: nothing to compare
    assert report.rows[0][5] == 60.0


def test_thread_counts_default_to_one_and_two(monkeypatch):
    import attnkit.runtime
    from attnkit.bench.measure import thread_counts

    assert thread_counts(3) == [3]
    monkeypatch.setattr(attnkit.runtime, "cpu_count", lambda: 8)
    assert thread_counts(None) == [1, 2]
    monkeypatch.setattr(attnkit.runtime, "cpu_count", lambda: 1)
    assert thread_counts(None) == [1]


def test_weight_bytes_counts_what_a_decode_step_reads():
    tied = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=2,
                                        num_heads=4, num_kv_heads=2, head_dim=4), seed=0)
    assert decoder.weight_bytes(tied) == sum(a.nbytes for a in tied.parameters())  # the tied head reads the table
    untied = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=2,
                                          num_heads=4, num_kv_heads=2, head_dim=4, tie_word_embeddings=False), seed=0)
    assert decoder.weight_bytes(untied) == sum(a.nbytes for a in untied.parameters()) - 64 * 16 * 4


def test_bandwidth_probe_reads_its_matrix():
    probe = decoder.BandwidthProbe(nbytes=1 << 20, d=64)
    assert probe.matrix.dtype == np.float32 and probe.matrix.shape[0] == 64
    assert probe.nbytes == pytest.approx(1 << 20, rel=0.01)
    assert probe.measure() > 0 and probe.measure(3 << 20) > 0


def test_llama_cpp_is_optional(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails as if not installed
    assert decoder._llama_cpp_runner(tmp_path / "x.gguf", np.arange(3), 4, 1) is None
