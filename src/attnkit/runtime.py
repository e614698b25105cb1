"""The machine attnkit runs on: how many CPUs, BLAS threads, worker threads, scratch memory.

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
- Tiled kernels (flash attention): `run_tasks(tasks, fn, threads)` runs tasks on
  a shared pool of worker threads (`worker_pool(n)`) with BLAS held to one
  thread, or in the calling thread when there is too little work to split
  (`useful_threads(num_threads, work)`: one thread per `SERIAL_BELOW` score
  elements); `run_claimed(count, fn, threads)` runs chunks that threads claim as
  they come free (a late thread takes only what is left), with as many threads as
  `worker_threads(n)` allows around the call (`worker_thread_count()`);
  `scratch_buffer`, `scratch_tile` and `scratch_arrays` hand out per-thread
  scratch memory that is reused across tiles and calls (up to `ARENA_BYTES` a
  thread: fresh arrays are faulted in page by page, and glibc returns large
  freed blocks to the OS); `l2_cache_bytes()` is the per-core L2
  cache the OS reports, which sizes the tiles.

Optional packages (`require`, `EXTRAS`, `MissingExtraError`) are in `attnkit.extras`, and
the helpers of deprecated spellings (`renamed_keyword`, `keyword_only`) in
`attnkit.deprecation`; their names here are aliases until 0.3.0.

Nothing here is imported eagerly: threadpoolctl loads on the first
`one_blas_thread()`, NumPy on the first scratch buffer.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import itertools
import math
import os
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

# Aliases of names that moved, until 0.3.0 (CHANGELOG.md): import them from their homes.
from attnkit.deprecation import REMOVED_IN, keyword_only, renamed_keyword  # noqa: F401
from attnkit.extras import EXTRAS, MissingExtraError, require  # noqa: F401

__all__ = [
    "ARENA_BYTES",
    "FastestSchedule",
    "SERIAL_BELOW",
    "blas_thread_count",
    "blas_threads",
    "cpu_count",
    "l2_cache_bytes",
    "one_blas_thread",
    "run_claimed",
    "worker_thread_count",
    "worker_threads",
    "run_tasks",
    "scratch_arrays",
    "scratch_buffer",
    "scratch_tile",
    "useful_threads",
    "worker_pool",
]

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
    machine's load changes, and with it which is fastest). A re-timed schedule that is still
    the slower waits twice as long for its next turn (up to 64 x `retime_every`), so a
    schedule far slower on a busy machine (two threads spinning against other work) costs
    a few percent, not half the time; one that wins again brings
    the interval back to `retime_every`. `timed(schedule, seconds)` records one run's
    time (per unit of work); a schedule's estimate (`seconds`) is the median of its last
    three kept runs (the smaller of two), so one stalled run (a page fault storm, the
    VM's neighbour: one such batch moved a running average enough to send the encoder to
    its slower schedule for the next 32 batches; docs/benchmarks.md) moves nothing,
    while two slow runs of three (the machine got busy) do.

    The first run of all, and the first run of a schedule after another one ran, is a
    warm-up: its time is not kept and `choose()` names the same schedule again (a first run
    loads compiled code, and kept, its time made the faster schedule look the slowest by
    far). Switching leaves the previous schedule's threads busy for a while (OpenBLAS's
    spin after a threaded call before they sleep, taking a core from whatever runs next),
    so that run would be timed slow.

        schedule = choice.choose()
        start = time.perf_counter()
        ...  # run the work on `schedule`
        choice.timed(schedule, time.perf_counter() - start)
    """

    ESTIMATE_RUNS = 3  # kept runs per schedule behind its estimate (their median)

    def __init__(self, schedules: Sequence[str], retime_every: int) -> None:
        if len(schedules) < 2 or len(set(schedules)) != len(schedules):
            raise ValueError(f"expected two or more distinct schedules, got {schedules!r}")
        if retime_every < 2:
            raise ValueError(f"expected retime_every >= 2, got {retime_every!r}")
        self.schedules = tuple(schedules)
        self.retime_every = int(retime_every)
        self.seconds: dict[str, float] = {}  # each schedule's estimated time per unit of work
        self._samples: dict[str, deque] = {}  # each schedule's last kept times (ESTIMATE_RUNS)
        self._calls = 0
        self._turn = 0
        self._interval = self.retime_every  # calls between re-timings (doubles while they lose)
        self._retiming: str | None = None  # the schedule being re-timed
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
        if self._calls < self._interval:
            return ranked[0]
        self._calls = 0
        self._turn += 1
        self._retiming = ranked[1 + self._turn % (len(ranked) - 1)]
        return self._retiming

    def timed(self, schedule: str, seconds: float) -> None:
        if schedule not in self.schedules:
            raise ValueError(f"expected one of {self.schedules}, got {schedule!r}")
        if schedule != self._last:  # a warm-up (the first run of all, or after a switch): not kept
            self._last, self._again = schedule, schedule
            return
        self._last, self._again = schedule, None
        samples = self._samples.setdefault(schedule, deque(maxlen=self.ESTIMATE_RUNS))
        samples.append(seconds)
        self.seconds[schedule] = sorted(samples)[(len(samples) - 1) // 2]  # median; of two, the smaller
        if schedule == self._retiming:
            self._retiming = None
            lost = self.seconds[schedule] > min(self.seconds.values())
            self._interval = min(2 * self._interval, 64 * self.retime_every) if lost else self.retime_every

    def __repr__(self) -> str:
        return f"FastestSchedule({self.schedules!r}, retime_every={self.retime_every}, seconds={self.seconds!r})"


# ----------------------------------------------------------------------------- tiled kernels: threads and scratch

_pool_lock = threading.Lock()
_pools: dict[int, ThreadPoolExecutor] = {}
_scratch = threading.local()


def worker_pool(num_threads: int) -> ThreadPoolExecutor:
    """The process-wide pool of `num_threads` worker threads (made on first use, then kept).

    Its threads run whatever work attnkit splits (flash attention's tiles, a quantized
    model's product chunks, ...): they are named "attnkit-worker-N_i" (N: the pool's size)."""
    with _pool_lock:
        if num_threads not in _pools:
            _pools[num_threads] = ThreadPoolExecutor(num_threads, thread_name_prefix=f"attnkit-worker-{num_threads}")
        return _pools[num_threads]


def scratch_buffer(name: str, size: int, dtype: Any) -> Any:
    """A per-thread flat NumPy scratch buffer of at least `size` elements, reused
    across tiles and calls (its contents are whatever the last user left)."""
    import numpy as np

    bufs = getattr(_scratch, "bufs", None)
    if bufs is None:
        bufs = _scratch.bufs = {}
    key = (name, np.dtype(dtype).str)
    buf = bufs.get(key)
    if buf is None or buf.size < size:
        buf = bufs[key] = np.empty(max(size, 1), dtype=dtype)
    return buf


ARENA_BYTES = 64 << 20  # one call's O(L) temporaries a thread keeps for its next call


def scratch_arrays(shapes: Sequence[tuple[int, ...]], dtype: Any) -> list:
    """Arrays of these shapes for one call's temporaries (uninitialized), carved
    from one block: the calling thread's scratch when they fit ARENA_BYTES,
    else a fresh block. Fresh arrays are faulted in page by page on first touch,
    and glibc hands large freed blocks back to the OS: page faults were a large share
    of a flash backward's time (docs/benchmarks.md)."""
    import numpy as np

    dtype = np.dtype(dtype)
    sizes = [math.prod(shape) for shape in shapes]
    total = sum(sizes)
    block = scratch_buffer("arena", total, dtype) if total * dtype.itemsize <= ARENA_BYTES else np.empty(total, dtype)
    views, at = [], 0
    for shape, size in zip(shapes, sizes):
        views.append(block[at:at + size].reshape(shape))
        at += size
    return views


def scratch_tile(name: str, rows: int, cols: int, dtype: Any) -> Any:
    """A C-contiguous (rows, cols) view of a scratch buffer (BLAS writes it directly)."""
    return scratch_buffer(name, rows * cols, dtype)[: rows * cols].reshape(rows, cols)


SERIAL_BELOW = 1 << 21  # score elements per thread: below, a second thread costs more than it saves


def useful_threads(num_threads: int, work: int) -> int:
    """The threads a call of `work` score elements can use: one per SERIAL_BELOW
    elements, at most num_threads, at least 1. Plans are made for this count, not
    for num_threads: work that runs on one thread anyway keeps one thread's tiles
    and heads per task (cut for threads it would never use, a decode step over a long
    cache ran slower at num_threads=2 than at 1; docs/benchmarks.md)."""
    return max(1, min(num_threads, work // SERIAL_BELOW))


_WORKERS: contextvars.ContextVar[int] = contextvars.ContextVar("attnkit_worker_threads", default=1)


@contextlib.contextmanager
def worker_threads(n: int) -> Iterator[None]:
    """A context in which work split into claimed chunks (`run_claimed`; a quantized
    model's prefill products) may use `n` threads, the calling one and the pool's, while
    BLAS stays on one thread per call (the caller holds it there: `one_blas_thread`)."""
    token = _WORKERS.set(max(1, int(n)))
    try:
        yield
    finally:
        _WORKERS.reset(token)


def worker_thread_count() -> int:
    """The threads `worker_threads` allows in this context (1 outside one)."""
    return _WORKERS.get()


def run_claimed(count: int, fn: Callable[[int], Any], threads: int) -> None:
    """fn(0) .. fn(count - 1), each index claimed by whichever thread is free first: the
    calling thread and `threads - 1` of the pool's. A pool thread that starts late (its CPU
    busy with other work) only takes what is left, so a busy machine costs at most the
    chunk it holds, never a wait for a fixed share; one that has not started when the
    calling thread runs out of chunks is cancelled (the call never waits on the pool's
    queue, so it cannot deadlock from inside a pool thread)."""
    if threads <= 1 or count <= 1:
        for index in range(count):
            fn(index)
        return
    claims = itertools.count()  # next() is atomic under the GIL: every index runs once

    def claim_until_done() -> None:
        index = next(claims)
        while index < count:
            fn(index)
            index = next(claims)

    pool = worker_pool(threads - 1)
    others = [pool.submit(claim_until_done) for _ in range(threads - 1)]
    try:
        claim_until_done()
    finally:
        for other in others:
            if not other.cancel():
                other.result()


def run_tasks(tasks: list, fn: Callable, threads: int) -> list:
    """fn(task) for every task, on the pool of `threads` workers (the count
    `useful_threads` gives the call's work, so too little work to split stays on
    the calling thread: threads never make a call slower than one thread would),
    with BLAS held to one thread meanwhile (our threads do the spreading)."""
    with one_blas_thread():
        if threads == 1 or len(tasks) <= 1:
            return [fn(t) for t in tasks]
        return list(worker_pool(threads).map(fn, tasks))


@functools.lru_cache(maxsize=1)
def l2_cache_bytes() -> int:
    """The per-core L2 (or, lacking one, the largest data) cache the OS reports
    for CPU 0: Linux sysfs, then sysconf; 1 MiB when neither says."""
    sizes = {}
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for entry in sorted(os.listdir(base)):
            path = os.path.join(base, entry)
            try:
                with open(os.path.join(path, "level")) as f:
                    level = int(f.read())
                with open(os.path.join(path, "type")) as f:
                    kind = f.read().strip()
                with open(os.path.join(path, "size")) as f:
                    text = f.read().strip().upper()
            except (OSError, ValueError):
                continue
            if kind == "Instruction":
                continue
            unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            digits = text.rstrip("KMGB")
            if digits.isdigit():
                sizes[level] = int(digits) * unit
    except OSError:
        pass
    if 2 not in sizes:
        try:
            size = os.sysconf("SC_LEVEL2_CACHE_SIZE")
            if size > 0:
                sizes[2] = size
        except (AttributeError, ValueError, OSError):
            pass
    return sizes.get(2) or (max(sizes.values()) if sizes else 1 << 20)
