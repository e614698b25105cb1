"""`attnkit bench [SUITE] [--quick] [--goals] [--json FILE]`: run a benchmark suite, print its table.

The table fits the width it is printed at (`attnkit.viz.tables`): columns that
do not fit go on in blocks below, each cell whole. Under it, the suite's notes:
what was measured and how to read it. Goal lines (a number against a target the
project set itself) only with `--goals`; then a goal not met makes the exit
status 1, like a failing test, after the table, the notes and the JSON.
"""

from __future__ import annotations

import json
from typing import Optional

import typer
from rich.text import Text

from attnkit.bench import SUITES  # a name table only: nothing heavy is imported
from attnkit.cli._app import app, check_int, console, err_console, fail, say, usage
from attnkit.cli._output import plan, write_all

MAX_THREADS = 256
"""The most threads `bench --threads` takes."""


class _RichProgress:
    """attnkit.bench.Progress on a rich progress bar."""

    def __init__(self, bar):
        self.bar = bar
        self.task = bar.add_task("starting", total=None)
        self.started = False

    def total(self, n: int) -> None:
        self.bar.update(self.task, total=n)

    def step(self, description: str) -> None:
        if self.started:
            self.bar.advance(self.task)
        self.started = True
        self.bar.update(self.task, description=description)

    def finish(self) -> None:
        if self.started:
            self.bar.advance(self.task)


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.1f}" if abs(value) >= 10 else f"{value:.2f}"
    return str(value)


def _numeric(report, i: int) -> bool:
    return any(isinstance(row[i], (int, float)) and not isinstance(row[i], bool) for row in report.rows)


def _key_columns(report) -> int:
    """How many leading columns say what a row is (repeated in each block of a narrow table):
    those before the first column of measurements (floats), at least one, at most half."""
    half = max(1, len(report.columns) // 2)
    for i in range(len(report.columns)):
        if any(isinstance(row[i], float) for row in report.rows):
            return max(1, min(i, half))
    return 1


def _memory_methods(report) -> set:
    measurements = report.raw.get("measurements") if isinstance(report.raw, dict) else None
    if not isinstance(measurements, list):
        return set()
    return {m.get("memory_method") for m in measurements if isinstance(m, dict)} - {None}


def render(report, *, goals: bool = False) -> list:
    """The renderables `attnkit bench` prints for `report`: the table, then its notes
    (goal lines only when `goals`)."""
    from attnkit.bench.measure import memory_note
    from attnkit.viz.tables import fitted_table

    table = fitted_table(
        report.columns, [[Text(_cell(v)) for v in row] for row in report.rows], title=report.title,
        keys=_key_columns(report), justify=["right" if _numeric(report, i) else "left"
                                            for i in range(len(report.columns))],
    )
    out = [table]
    notes = report.notes + report.goals if goals else report.findings()
    memory = memory_note(_memory_methods(report))
    if memory:
        notes = notes + [memory]
    for note in notes:
        verdict = note.lstrip().split(" ", 1)[0].rstrip(":")
        style = "green" if verdict == "PASS" else "red" if verdict in ("FAIL", "MISS") else "dim"
        out.append(Text(note, style=style))
    return out


def _batch_sizes(suite: str, batch: Optional[str]) -> tuple[int, ...] | None:
    """`--batch 1,4,8,16` as sizes (decoder only; each in 1 .. 256)."""
    if batch is None:
        return None
    if suite != "decoder":
        usage(f"--batch applies to the decoder suite, not {suite!r}")
    try:
        sizes = tuple(int(part) for part in batch.split(","))
    except ValueError:
        sizes = ()
    if not sizes or any(not 1 <= size <= 256 for size in sizes):
        usage(f"expected --batch as sizes in 1..256 separated by commas (1,4,8,16), got {batch!r}")
    return sizes


@app.command()
def bench(
    suite: str = typer.Argument("attention", help=f"Which suite: {', '.join(SUITES)}."),
    quick: bool = typer.Option(False, "--quick", help="Small sizes, few repeats: well under a minute."),
    goals: bool = typer.Option(
        False, "--goals", help="Also check the project's speed and memory goals; exit 1 when one is not met."
    ),
    json_path: Optional[str] = typer.Option(
        None, "--json", metavar="FILE.json", help="Also write every measurement to this JSON file."
    ),
    threads: Optional[int] = typer.Option(
        None, "--threads", help=f"Threads for every contender (default: all CPUs; at most {MAX_THREADS})."
    ),
    batch: Optional[str] = typer.Option(
        None, "--batch", metavar="B,B,...", help="decoder only: B sequences decoded together (e.g. 1,4,8,16), "
        "aggregate tokens/s of attnkit's batched step beside llama.cpp's batch API."
    ),
) -> None:
    """Benchmark attnkit against its peers, side by side in one run."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from attnkit.bench import get_suite
    from attnkit.bench.measure import blas_summary, system_info

    if suite not in SUITES:
        usage(f"unknown suite {suite!r}; expected one of {', '.join(sorted(SUITES))}")
    check_int("--threads", threads, 1, MAX_THREADS)
    sizes = _batch_sizes(suite, batch)
    output = plan("--json", json_path, (".json",)) if json_path is not None else None
    module = get_suite(suite)
    flags = (" --quick" if quick else "") + (" --goals" if goals else "")
    console.print(Text.assemble((f"attnkit bench {suite}", "bold"), f"{flags}  BLAS: {blas_summary()}"))
    with Progress(TextColumn("{task.description:<48}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err_console, transient=True) as bar:
        progress = _RichProgress(bar)
        report = module.run(quick=quick, progress=progress, threads=threads, **({"batch": sizes} if sizes else {}))
        progress.finish()

    for renderable in render(report, goals=goals):
        console.print(renderable)

    if output is not None:
        payload = {"suite": suite, "quick": quick, "report": report.as_dict(), "system": system_info()}
        text = json.dumps(payload, indent=2, default=str)
        write_all([(output, lambda path: path.write_text(text, encoding="utf-8"))])
        say(f"wrote {output.path}")
    if goals:
        failed = report.failed_goals()
        if failed:
            fail(f"{len(failed)} of {len(report.goal_lines())} goal line(s) not met (FAIL, MISS or NOT met above)")
