"""`attnkit bench`: the harness protocol, the attention suite at tiny sizes, the CLI and its JSON."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from attnkit import bench
from attnkit.bench import BenchReport, attention, measure
from attnkit.cli import app


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setattr(attention, "QUICK_LENGTHS", (32, 64))
    monkeypatch.setattr(attention, "H", 2)
    monkeypatch.setattr(attention, "E", 8)
    original = attention._scaling
    monkeypatch.setattr(attention, "_scaling", lambda L, *a, **k: original(64, *a, **k))


class Recorder:
    def __init__(self):
        self.n, self.steps = None, []

    def total(self, n):
        self.n = n

    def step(self, description):
        self.steps.append(description)


@pytest.mark.slow
def test_attention_suite_reports_every_contender(tiny, torch):
    rec = Recorder()
    report = bench.run_suite("attention", quick=True, progress=rec, threads=2)
    assert isinstance(report, BenchReport)
    assert report.columns == attention.COLUMNS
    assert len(rec.steps) <= rec.n and len(rec.steps) >= 2 * 2 * 2 * 4  # lengths x causal x passes x impls
    impls = {row[3] for row in report.rows}
    assert impls == set(attention.IMPLS)
    assert all(len(row) == len(report.columns) for row in report.rows)
    raw = report.raw
    m = raw["measurements"][0]
    assert {"impl", "L", "causal", "passes", "seconds", "gflops", "peak_bytes", "threads", "vs_sdpa"} <= set(m)
    # each row is its measurement in the documented units (ms, MiB), and "vs SDPA" is
    # torch SDPA's time over this contender's, both timed in the same configuration
    assert len(report.rows) == len(raw["measurements"])
    by_config = {(m["L"], m["causal"], m["passes"], m["impl"]): m for m in raw["measurements"]}
    for row, m in zip(report.rows, raw["measurements"]):
        L, causal, passes, impl, ms, gflops, mib, vs_sdpa = row
        assert (L, causal, passes, impl) == (m["L"], "yes" if m["causal"] else "no", m["passes"], m["impl"])
        assert ms == pytest.approx(m["seconds"] * 1e3, abs=1e-3) and ms > 0
        assert mib == pytest.approx(m["peak_bytes"] / 2**20, abs=0.05)
        sdpa = by_config[(m["L"], m["causal"], m["passes"], "torch SDPA")]
        assert m["vs_sdpa"] == pytest.approx(sdpa["seconds"] / m["seconds"])
        assert vs_sdpa == f"{m['vs_sdpa']:.2f}x"
    assert all(row[-1] == "1.00x" for row in report.rows if row[3] == "torch SDPA")
    # GFLOP/s follow FlashAttention's convention: 4 B H L S E, halved when causal, x3.5 with backward
    for m in raw["measurements"]:
        flops = 4 * 2 * m["L"] * m["S"] * 8 / (2 if m["causal"] else 1) * (3.5 if m["passes"] == "fwd+bwd" else 1)
        assert m["gflops"] == pytest.approx(flops / m["seconds"] / 1e9)
    assert raw["extras"]["scaling_fwd"]["L"] == 64
    assert any(note.startswith("BLAS: ") for note in report.notes)
    assert any(g["name"].startswith("forward vs torch SDPA") for g in raw["goals"])
    json.dumps(report.as_dict())  # JSON-serializable as promised


def test_flash_peak_memory_is_far_below_naive():
    """What the memory column measures, at a size where it shows: flash holds no (L, S) array."""
    import attnkit

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 2048, 16), dtype=np.float32) for _ in range(3))
    naive = measure.peak_numpy_bytes(lambda: attnkit.scaled_dot_product_attention(q, k, v))
    flash = measure.peak_numpy_bytes(lambda: attnkit.flash_attention(q, k, v, num_threads=1))
    assert naive >= 2 * 2048 * 2048 * 4  # the scores
    assert flash < naive / 8


def test_measure_helpers():
    seconds, times = measure.best_time(lambda: sum(range(1000)), budget_s=0.01, max_runs=3)
    assert seconds == min(times) and 1 <= len(times) <= 3
    assert measure.peak_numpy_bytes(lambda: np.ones(1 << 20)) >= 8 << 20
    assert "kernel" in measure.blas_summary() or "no BLAS" in measure.blas_summary()
    info = measure.system_info()
    assert info["numpy"] == np.__version__ and info["cpus"] >= 1


def test_report_rows_must_match_columns_and_unknown_suites_fail():
    with pytest.raises(ValueError, match="2 values for 3 columns"):
        BenchReport("t", ["a", "b", "c"], [[1, 2]])
    with pytest.raises(ValueError, match="unknown benchmark suite 'nope'"):
        bench.get_suite("nope")
    result = CliRunner().invoke(app, ["bench", "nope"])
    assert result.exit_code != 0 and "unknown suite" in result.output


@pytest.mark.slow
def test_cli_prints_the_table_and_writes_json(tiny, tmp_path):
    path = tmp_path / "attention.json"
    result = CliRunner().invoke(app, ["bench", "attention", "--quick", "--threads", "1", "--json", str(path)])
    assert result.exit_code == 0, result.output
    assert "attnkit flash" in result.output and "BLAS" in result.output
    data = json.loads(path.read_text())
    assert data["suite"] == "attention" and data["quick"] is True
    assert data["report"]["columns"] == attention.COLUMNS
    assert {m["threads"] for m in data["report"]["raw"]["measurements"]} == {1}
    assert data["system"]["blas"] is not None
