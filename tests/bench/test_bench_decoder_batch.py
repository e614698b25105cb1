"""`attnkit bench decoder --batch`: the report of a measured result, its goal lines, and the
option's checks (the measurement itself loads SmolLM2 and runs for minutes)."""

from __future__ import annotations

from typer.testing import CliRunner

from attnkit.bench import BenchReport, decoder_batch


def _raw(lcpp=True):
    results = []
    for threads, rates in ((1, {1: (80.0, 70.0), 4: (200.0, 100.0), 8: (240.0, 120.0)}),
                           (2, {1: (140.0, 110.0), 4: (300.0, 190.0), 8: (320.0, 230.0)})):
        for B, (ours, theirs) in rates.items():
            rate = {"attnkit": ours, **({"llama.cpp": theirs} if lcpp else {})}
            results.append({"threads": threads, "batch": B, "tokens_per_second": rate,
                            "times_s": {name: [B * 32 / r] for name, r in rate.items()}, "compiled": True,
                            "cpu_tokens_per_second": {name: 1.1 * r for name, r in rate.items()},
                            "same_tokens": True if lcpp else None})
    return {"batches": [1, 4, 8], "threads": [1, 2], "steps": 32, "prompt_tokens": 50, "rounds": 3,
            "results": results, "llama_cpp": lcpp, "cpu_model": "Some CPU"}


def test_report_rows_ratios_and_goal_lines():
    report = decoder_batch.report_from_raw(_raw())
    assert isinstance(report, BenchReport) and report.columns == decoder_batch.COLUMNS
    assert all(len(row) == len(report.columns) for row in report.rows) and len(report.rows) == 6
    assert report.rows[2] == [1, 8, 240.0, "3.00x", 120.0, "1.71x", "2.00x"]
    goals = "\n".join(report.goals)
    assert ("1 thread(s), B = 4: goal attnkit >= 1.2x llama.cpp's batch API (done at 1.0x): PASS (2.00x by CPU time; "
            "done)") in goals
    assert "2 thread(s), B = 8: goal attnkit >= 1.2x llama.cpp's batch API (done at 1.0x): PASS (1.39x by wall" in goals
    assert "1 thread: goal attnkit B = 8 >= 2.5x its B = 1: PASS (3.00x by CPU time)" in goals
    notes = "\n".join(report.notes)
    assert "CPU: Some CPU" in notes
    assert "by this thread's CPU time" in notes and "B = 8: attnkit 264.0, llama.cpp 132.0 (2.00x)" in notes


def test_goals_by_wall_clock_without_cpu_times():
    raw = _raw()
    for r in raw["results"]:
        del r["cpu_tokens_per_second"]
    goals = "\n".join(decoder_batch.report_from_raw(raw).goals)
    assert "1 thread: goal attnkit B = 8 >= 2.5x its B = 1: PASS (3.00x by wall clock)" in goals


def test_report_without_llama_cpp():
    report = decoder_batch.report_from_raw(_raw(lcpp=False))
    assert all(row[4] is None and row[6] is None for row in report.rows)
    assert "not measured (llama-cpp-python not installed)" in "\n".join(report.goals)
    assert "not installed" in "\n".join(report.notes)


def test_the_batch_option_is_checked():
    from attnkit.cli import app

    runner = CliRunner()
    for args, words in ((["bench", "attention", "--batch", "4"], "decoder suite"),
                        (["bench", "decoder", "--batch", "4,x"], "sizes in 1..256"),
                        (["bench", "decoder", "--batch", "0"], "sizes in 1..256")):
        result = runner.invoke(app, args)
        assert result.exit_code != 0 and words in result.output + (result.stderr or ""), result.output
