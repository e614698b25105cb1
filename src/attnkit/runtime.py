"""The machine attnkit runs on: how many CPUs, BLAS threads, and the optional packages.

- `cpu_count()`: the CPUs this process may use (its affinity mask on Linux,
  which a container or `taskset` narrows; `os.cpu_count()` elsewhere). The
  default thread count of `flash_attention`, `SentenceEncoder` and the benchmarks.
- `one_blas_thread()`: a context in which BLAS (OpenBLAS, MKL, ...) runs on one
  thread, restored on exit (threadpoolctl); `blas_threads(n)` on n threads. Used
  wherever attnkit spreads work over its own threads, so that the two thread
  pools do not fight over the cores, and for decode steps, whose matrix-vector
  products a second BLAS thread slows down on a busy machine;
  `blas_thread_count()` is the current limit.
- `FastestSchedule`: picks the fastest of a few ways to run the same work by
  timing them as it goes (the encoder's and the decoder's thread choices).
- `require(module, extra, purpose)`: import an optional package, or raise
  `MissingExtraError` naming the pip extra that installs it
  (`pip install 'attnkit[png]'`). The command line prints that message as its
  one error line.
- `renamed_keyword(...)`: a keyword's old spelling, still taken for one release with
  a DeprecationWarning (CHANGELOG.md lists each).

Nothing here is imported eagerly: threadpoolctl loads on the first
`one_blas_thread()`, and each optional package when `require` asks for it.
"""

from __future__ import annotations

import functools
import importlib
import os
import warnings
from collections.abc import Sequence
from types import ModuleType
from typing import Any

__all__ = [
    "EXTRAS",
    "FastestSchedule",
    "MissingExtraError",
    "blas_thread_count",
    "blas_threads",
    "cpu_count",
    "one_blas_thread",
    "renamed_keyword",
    "require",
]

REMOVED_IN = "0.3.0"
"""The release in which a deprecated spelling stops working."""


def renamed_keyword(where: str, old: str, old_value: Any, new: str, new_value: Any, default: Any) -> Any:
    """The value of keyword `new`, taking one still passed under its old name `old`
    (`old_value` None: not passed). Warns when `old` is used; refuses both at once
    (TypeError) unless `new` kept its default."""
    if old_value is None:
        return new_value
    if new_value != default:
        raise TypeError(f"{where}: expected {new}= alone, got both {new}= and its old spelling {old}=")
    warnings.warn(f"{where}: {old}= is deprecated, use {new}= (the old spelling goes in {REMOVED_IN})",
                  DeprecationWarning, stacklevel=3)
    return old_value


def cpu_count() -> int:
    """The number of CPUs this process may run on (at least 1)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


@functools.lru_cache(maxsize=1)
def _blas_controller() -> Any:
    """threadpoolctl's view of the BLAS libraries NumPy loaded, found once (finding them scans
    the process's libraries)."""
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController().select(user_api="blas")


def one_blas_thread() -> Any:
    """A context manager in which BLAS runs single-threaded; leaving it restores the limits.

        with one_blas_thread():
            ...  # matrix products here use one BLAS thread
    """
    return _blas_controller().limit(limits=1)


def blas_threads(n: int) -> Any:
    """A context manager in which BLAS runs on `n` threads; leaving it restores the
    limits. `blas_threads(1)` is `one_blas_thread()`."""
    return _blas_controller().limit(limits=int(n))


def blas_thread_count() -> int:
    """The threads BLAS may use now (the current limit; 1 when no BLAS library is found)."""
    return max((lib.num_threads for lib in _blas_controller().lib_controllers), default=1)


class FastestSchedule:
    """The fastest of a few ways (`schedules`) to run the same kind of work, by measurement.

    `choose()` names the schedule to run next: each one not yet timed, then the fastest,
    except that every `retime_every`-th call re-times one of the others in turn (the
    machine's load changes, and with it which is fastest). `timed(schedule, seconds)` folds
    one run's time (per unit of work) into that schedule's running average.

    The first run of a schedule after another one ran is a warm-up: its time is not kept
    and `choose()` names the same schedule again. Switching leaves the previous schedule's
    threads busy for a while (OpenBLAS's spin about 0.1 s after a threaded call before they
    sleep, taking a core from whatever runs next), so that run would be timed slow.

        schedule = choice.choose()
        start = time.perf_counter()
        ...  # run the work on `schedule`
        choice.timed(schedule, time.perf_counter() - start)
    """

    def __init__(self, schedules: Sequence[str], retime_every: int) -> None:
        if len(schedules) < 2 or len(set(schedules)) != len(schedules):
            raise ValueError(f"expected two or more distinct schedules, got {schedules!r}")
        if retime_every < 2:
            raise ValueError(f"expected retime_every >= 2, got {retime_every!r}")
        self.schedules = tuple(schedules)
        self.retime_every = int(retime_every)
        self.seconds: dict[str, float] = {}  # each schedule's measured time per unit of work
        self._calls = 0
        self._last: str | None = None  # the schedule timed last (warm after its first run)
        self._again: str | None = None  # a schedule whose warm-up just ran: run it again

    def choose(self) -> str:
        if self._again is not None:
            return self._again
        for schedule in self.schedules:
            if schedule not in self.seconds:
                return schedule  # not timed yet
        self._calls += 1
        ranked = sorted(self.schedules, key=self.seconds.__getitem__)
        turn, due = divmod(self._calls, self.retime_every)
        return ranked[1 + turn % (len(ranked) - 1)] if due == 0 else ranked[0]

    def timed(self, schedule: str, seconds: float) -> None:
        if schedule not in self.schedules:
            raise ValueError(f"expected one of {self.schedules}, got {schedule!r}")
        if schedule != self._last and self._last is not None:  # a warm-up after a switch: not kept
            self._last, self._again = schedule, schedule
            return
        self._last, self._again = schedule, None
        old = self.seconds.get(schedule)
        self.seconds[schedule] = seconds if old is None else (old + seconds) / 2

    def __repr__(self) -> str:
        return f"FastestSchedule({self.schedules!r}, retime_every={self.retime_every}, seconds={self.seconds!r})"


# ----------------------------------------------------------------------------- optional packages

EXTRAS: dict[str, tuple[str, ...]] = {
    "gguf": ("gguf",),
    "chat": ("jinja2", "prompt_toolkit"),
    "png": ("matplotlib",),
    "serve": ("fastapi", "uvicorn"),
    "torch": ("torch",),
    "hf": ("transformers", "torch"),
}
"""pip extra -> the packages it brings (pyproject.toml's optional-dependencies, by import name)."""


class MissingExtraError(ImportError):
    """An optional package is not installed. The message names the pip extra that installs it."""


def require(module: str, extra: str, purpose: str) -> ModuleType:
    """Import the optional package `module`, or say which extra installs it.

    Arguments:
        module: the import name (`"matplotlib"`, `"gguf"`).
        extra: the pip extra that brings it (a key of `EXTRAS`).
        purpose: what needs it, for the message (`"PNG output"`).

    Raises:
        MissingExtraError: `module` (or a package it needs) is not installed.
    """
    assert module in EXTRAS[extra], f"{module} is not in the {extra!r} extra"
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        raise MissingExtraError(
            f"{purpose} needs the package {error.name or module!r}, which is not installed; "
            f"install it with: pip install 'attnkit[{extra}]'",
            name=error.name or module,
        ) from None
