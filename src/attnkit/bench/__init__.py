"""Benchmark harness behind `attnkit bench [SUITE] [--quick] [--json FILE]`.

A suite is a module listed in `SUITES` (name -> module path) that defines

    def run(*, quick: bool, progress: Progress, threads: int | None = None) -> BenchReport

(all keyword-only: the suites take `quick`, `progress` and `threads` by position
until 0.3.0, with a DeprecationWarning, through `attnkit.deprecation.keyword_only`)

- `quick=True` must finish in well under a minute (small sizes, few repeats);
  the full run is what docs/benchmarks.md records.
- `progress` is how a suite reports headway without printing (the library
  never prints): call `progress.total(n)` once with the number of steps, then
  `progress.step("what is running")` as each step starts. `NullProgress` does nothing.
- `threads` is the thread count every contender gets (None: all CPUs).
- The suite returns a `BenchReport`: a title, column names, rows (one list of
  plain values per row, same length as columns; None shows as "-"), notes
  (short lines shown under the table: what was measured and how to read it,
  skipped sizes), `raw`, a JSON-serializable dict with everything measured, and
  `goals`: lines that check a number against a target the project set
  ("FAIL causal / full forward time at L=1024: 0.71x (goal <= 0.60x)"). Goal
  lines are for attnkit's developers: the CLI prints them only with --goals
  (and then exits 1 when one is not met); a goal line left among the notes is
  recognised and held back too (`attnkit.bench.report.is_goal_line`).
- A suite that measures peak memory records how in each measurement's
  "memory_method" (`attnkit.bench.measure.MEMORY_METHODS`); the CLI says so
  under the table.

The CLI (`attnkit.cli.bench`) renders the table at the width it has (columns
that do not fit go on in blocks, `attnkit.viz.tables`), shows a progress bar,
writes `{"suite", "quick", "report": {...}, "system": system_info()}` as JSON
with --json, and prints which BLAS kernel ran (`blas_info`). Helpers shared by suites live in
`attnkit.bench.measure` (timing, peak memory, system info), and `BenchReport`
and `Progress` in `attnkit.bench.report` (suites import them from there).

Suites import their heavy dependencies (torch, models) inside `run`.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from attnkit.bench.report import BenchReport, NullProgress, Progress
from attnkit.deprecation import keyword_only

SUITES: dict[str, str] = {
    "attention": "attnkit.bench.attention",
    "encoder": "attnkit.bench.encoder",
    "torch_modules": "attnkit.bench.torch_modules",
    "decoder": "attnkit.bench.decoder",
    "nn": "attnkit.bench.nn",
    "distributed": "attnkit.bench.distributed",
    "cache": "attnkit.bench.cache",
    "hf": "attnkit.bench.hf",
    "interpret": "attnkit.bench.interpret",
    "serve": "attnkit.bench.serve",
}


def get_suite(name: str) -> ModuleType:
    """The suite module registered under `name`."""
    try:
        path = SUITES[name]
    except KeyError:
        raise ValueError(f"unknown benchmark suite {name!r}; expected one of {sorted(SUITES)}") from None
    return importlib.import_module(path)


@keyword_only("quick", "progress", "threads")
def run_suite(name: str, *, quick: bool = False, progress: Progress | None = None,
              threads: int | None = None) -> BenchReport:
    """Run one suite and return its report."""
    return get_suite(name).run(quick=quick, progress=progress or NullProgress(), threads=threads)


__all__ = ["SUITES", "BenchReport", "NullProgress", "Progress", "get_suite", "run_suite"]
