"""Measuring helpers shared by benchmark suites: best-of timing, peak memory, system facts.

Times are wall-clock best-of-n (the machine is shared; the minimum is the least
disturbed run). Peak memory is the most extra memory a call held above what was
allocated when it started: exact for NumPy through tracemalloc (NumPy reports
its data buffers there), sampled from the process's resident size for
libraries that allocate outside Python's view (torch). Before sampling, the C
allocator gives its free memory back to the system (glibc's `malloc_trim`):
otherwise a call that reuses memory freed by the previous call (torch's
buffers, timed a moment before) grows the resident size by nothing and reads
0 MiB. `MEMORY_METHODS` says what each way measures, for the notes under a table.
"""

from __future__ import annotations

import ctypes
import os
import platform
import threading
import time
import tracemalloc
from typing import Callable

from attnkit.deprecation import keyword_only

from attnkit.runtime import cpu_count


@keyword_only("warmup")
def best_time(fn: Callable[[], object], budget_s: float = 2.0, max_runs: int = 5, *,
              warmup: bool = True) -> tuple[float, list[float]]:
    """Best wall time of fn() over up to `max_runs` runs that fit in about `budget_s`.

    With warmup the first call (thread pools starting, pages faulting in) is not
    counted unless it is the only one that fits the budget.
    """
    times = []
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    if not warmup:
        times.append(first)
    runs = max(1, min(max_runs, int(budget_s / max(first, 1e-9))))
    if warmup and first > budget_s:
        return first, [first]
    for _ in range(runs if warmup else runs - 1):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), times


def best_times_interleaved(fns: dict[str, Callable[[], object]], budget_s: float = 2.0,
                           max_rounds: int = 5, min_rounds: int = 1,
                           settle_s: float = 0.0) -> dict[str, tuple[float, list[float]]]:
    """Best wall time of each function, measured round-robin so that every
    contender sees the same machine load (this machine is shared).

    One untimed warmup round first, unless a call is slower than `budget_s`
    (then its first run counts and it runs at most twice). At least
    `min_rounds` rounds for the others, at most `max_rounds`, as the budget allows.
    `settle_s` is a pause before each call: BLAS and OpenMP worker threads spin
    for a while after a multithreaded call, and would otherwise eat the next
    contender's CPU (the figures: docs/benchmarks.md, "Measurements behind design choices").
    Returns {name: (best seconds, all timed runs)}.
    """
    times: dict[str, list[float]] = {name: [] for name in fns}
    first: dict[str, float] = {}
    for name, fn in fns.items():
        time.sleep(settle_s)
        t0 = time.perf_counter()
        fn()
        first[name] = time.perf_counter() - t0
        if first[name] > budget_s:
            times[name].append(first[name])
    rounds = max(min_rounds, 1, min(max_rounds, int(budget_s / max(sum(first.values()), 1e-9))))
    for _ in range(rounds):
        for name, fn in fns.items():
            if times[name] and first[name] > budget_s and len(times[name]) >= 2:
                continue
            time.sleep(settle_s)
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: (min(ts), ts) for name, ts in times.items()}


def peak_numpy_bytes(fn: Callable[[], object]) -> int:
    """Peak bytes allocated during fn() above the start (tracemalloc; NumPy buffers included)."""
    was_tracing = tracemalloc.is_tracing()
    if not was_tracing:
        tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base, _ = tracemalloc.get_traced_memory()
        result = fn()
        _, peak = tracemalloc.get_traced_memory()
        del result
    finally:
        if not was_tracing:
            tracemalloc.stop()
    return max(0, peak - base)


MEMORY_METHODS = {
    "tracemalloc": "NumPy rows: every allocation, exactly (tracemalloc)",
    "rss": "torch rows: growth of the process's resident size, sampled every millisecond "
           "(torch allocates where tracemalloc cannot see; a shorter peak can be missed)",
}
"""How peak memory was measured, by the name a suite records it under ("memory_method")."""


def memory_note(methods) -> str | None:
    """One line saying how the peak memory in a table was measured, or None for no method.

    Arguments:
        methods: the `MEMORY_METHODS` keys a table's rows used (e.g. {"tracemalloc", "rss"}).
    """
    known = [m for m in MEMORY_METHODS if m in set(methods)]
    if not known:
        return None
    return "peak memory: the most extra memory one call held; " + "; ".join(MEMORY_METHODS[m] for m in known)


def _release_free_memory() -> None:
    """Give the C allocator's free memory back to the system, where the allocator can (glibc)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return
    trim.argtypes = [ctypes.c_size_t]
    trim(0)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes(fn: Callable[[], object], interval_s: float = 0.001) -> int | None:
    """Peak resident-size growth during fn(), sampled every `interval_s` (Linux only; else None).

    The C allocator's free memory goes back to the system first, so memory that an earlier
    call freed and this one reuses counts as growth, as it would in a fresh process.
    """
    if not os.path.exists("/proc/self/statm"):
        return None
    _release_free_memory()
    base = _rss_bytes()
    peak = [base]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss_bytes())
            time.sleep(interval_s)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        result = fn()
        peak[0] = max(peak[0], _rss_bytes())
        del result
    finally:
        done.set()
        sampler.join()
    return max(0, peak[0] - base)


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo, or None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def blas_info() -> list[dict]:
    """The BLAS libraries loaded and the kernel each runs (threadpoolctl)."""
    from threadpoolctl import threadpool_info

    return [
        {k: lib.get(k) for k in ("internal_api", "version", "architecture", "num_threads", "threading_layer")}
        for lib in threadpool_info()
        if lib.get("user_api") == "blas"
    ]


def blas_summary() -> str:
    """One line: e.g. "openblas 0.3.31 (SkylakeX kernel)"."""
    libs = blas_info()
    if not libs:
        return "no BLAS found by threadpoolctl"
    return ", ".join(f"{b['internal_api']} {b['version']} ({b['architecture']} kernel)" for b in libs)


def system_info() -> dict:
    """Versions and machine facts to store next to results."""
    import numpy as np

    info = {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "cpus": cpu_count(),
        "blas": blas_info(),
        "env": {k: os.environ.get(k) for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OMP_NUM_THREADS")},
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        import torch

        info["torch"] = torch.__version__
    except ImportError:
        info["torch"] = None
    return info


DECODER_PROMPT = (
    "The attention mechanism lets every token look at every other token in a single step. "
    "Explain, in plain words and with a small example, why this made transformers faster to train "
    "than recurrent networks, and what the key-value cache changes at inference time:"
)
"""The prompt the decoder benches (one sequence and batched) generate from."""


def thread_counts(threads: int | None) -> list[int]:
    """The thread counts a bench measures: `threads` when given, else 1 and (with a second
    CPU) 2."""
    from attnkit import runtime  # read at call time (tests set the CPU count)

    if threads is not None:
        return [int(threads)]
    return sorted({1, min(2, runtime.cpu_count())})
