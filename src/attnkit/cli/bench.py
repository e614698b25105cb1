"""`attnkit bench [SUITE] [--quick] [--json FILE]`: run a benchmark suite, print its table."""

from __future__ import annotations

import json
from typing import Optional

import typer
from rich.text import Text

from attnkit.bench import SUITES  # a name table only: nothing heavy is imported
from attnkit.cli._app import app, check_int, console, err_console, say, usage
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


@app.command()
def bench(
    suite: str = typer.Argument("attention", help=f"Which suite: {', '.join(SUITES)}."),
    quick: bool = typer.Option(False, "--quick", help="Small sizes, few repeats: well under a minute."),
    json_path: Optional[str] = typer.Option(
        None, "--json", metavar="FILE.json", help="Also write every measurement to this JSON file."
    ),
    threads: Optional[int] = typer.Option(
        None, "--threads", help=f"Threads for every contender (default: all CPUs; at most {MAX_THREADS})."
    ),
) -> None:
    """Benchmark attnkit against its peers, side by side in one run."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich import box
    from rich.table import Table

    from attnkit.bench import get_suite
    from attnkit.bench.measure import blas_summary, system_info

    if suite not in SUITES:
        usage(f"unknown suite {suite!r}; expected one of {', '.join(sorted(SUITES))}")
    check_int("--threads", threads, 1, MAX_THREADS)
    output = plan("--json", json_path, (".json",)) if json_path is not None else None
    module = get_suite(suite)
    console.print(Text.assemble((f"attnkit bench {suite}", "bold"), f"{' --quick' if quick else ''}  BLAS: {blas_summary()}"))
    with Progress(TextColumn("{task.description:<48}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err_console, transient=True) as bar:
        progress = _RichProgress(bar)
        report = module.run(quick=quick, progress=progress, threads=threads)
        progress.finish()

    table = Table(title=report.title, title_justify="left", box=box.SIMPLE_HEAD)
    for i, name in enumerate(report.columns):
        numeric = any(isinstance(row[i], (int, float)) and not isinstance(row[i], bool) for row in report.rows)
        table.add_column(Text(name), justify="right" if numeric else "left", no_wrap=True)
    for row in report.rows:
        table.add_row(*(Text(_cell(v)) for v in row))
    console.print(table)
    for note in report.notes:
        style = "green" if note.startswith("PASS") else "red" if note.startswith("MISS") else "dim"
        console.print(Text(note, style=style))

    if output is not None:
        payload = {"suite": suite, "quick": quick, "report": report.as_dict(), "system": system_info()}
        text = json.dumps(payload, indent=2, default=str)
        write_all([(output, lambda path: path.write_text(text, encoding="utf-8"))])
        say(f"wrote {output.path}")
