"""attnkit.runtime: BLAS thread limits and the measured choice among schedules."""

from __future__ import annotations

import pytest

from attnkit.runtime import FastestSchedule, blas_thread_count, blas_threads, keyword_only, one_blas_thread


def test_blas_thread_count_follows_the_limits():
    before = blas_thread_count()
    assert before >= 1
    with one_blas_thread():
        assert blas_thread_count() == 1
    with blas_threads(2):
        assert blas_thread_count() in (1, 2)  # a BLAS built single-threaded stays at 1
    assert blas_thread_count() == before


def test_fastest_schedule_times_each_then_runs_the_fastest_and_retimes_the_others():
    choice = FastestSchedule(("a", "b", "c"), retime_every=4)
    times = {"a": 3.0, "b": 1.0, "c": 2.0}
    runs = []

    def run(n: int) -> None:
        for _ in range(n):
            runs.append(choice.choose())
            choice.timed(runs[-1], times[runs[-1]])

    run(6)
    # every schedule timed in order; the first run of all and the first after a switch are
    # warm-ups, not kept
    assert runs == ["a", "a", "b", "b", "c", "c"]
    assert choice.seconds == times
    runs.clear()
    run(48)
    # the fastest runs (after one warm-up); the 4th choice re-times a slower one (a warm-up
    # and a timed run), taking turns; each that still loses doubles the wait: 4, 8, 16 runs
    assert "".join(runs) == "bbbb" "aa" + "b" * 8 + "cc" + "b" * 16 + "aa" + "b" * 14
    assert choice._interval == 32
    choice.timed("b", 5.0)  # one slow run of the last three (1, 1, 5): the median stays 1
    assert choice.seconds["b"] == 1.0
    choice.timed("b", 5.0)  # two of three (1, 5, 5): b is now slower than c (2)
    assert choice.seconds["b"] == 5.0
    assert choice.choose() == "c"


def test_fastest_schedule_estimates_from_the_median_of_the_last_three_runs():
    """One stalled run moves no estimate (a running average moved 1.6x for one 3x stall
    and switched the encoder to its slower schedule); two of three do; of two runs the
    smaller counts."""
    choice = FastestSchedule(("a", "b"), retime_every=1000)
    choice.timed("a", 9.0)  # warm-up
    for seconds, estimate in ((2.0, 2.0), (6.0, 2.0), (1.0, 2.0), (7.0, 6.0), (8.0, 7.0), (1.0, 7.0), (1.0, 1.0)):
        choice.timed("a", seconds)
        assert choice.seconds["a"] == estimate, (seconds, choice.seconds)
    choice.timed("b", 9.0)  # warm-up after the switch
    choice.timed("b", 0.5)
    choice.timed("b", 30.0)  # stalled once: b stays the faster
    assert choice.seconds == {"a": 1.0, "b": 0.5} and choice.choose() == "b"


def test_fastest_schedule_keeps_no_time_from_the_first_run_after_a_switch():
    choice = FastestSchedule(("one", "two"), retime_every=8)
    choice.timed("one", 50.0)  # the first run of all (loading code): a warm-up
    assert choice.seconds == {} and choice.choose() == "one"
    choice.timed("one", 1.0)
    choice.timed("two", 9.0)  # just after "one": a warm-up
    assert choice.seconds == {"one": 1.0} and choice.choose() == "two"
    choice.timed("two", 2.0)
    assert choice.seconds == {"one": 1.0, "two": 2.0}


@pytest.mark.parametrize(
    "schedules, retime_every, message",
    [(("a",), 4, "two or more distinct"), (("a", "a"), 4, "two or more distinct"), (("a", "b"), 1, "retime_every")],
)
def test_fastest_schedule_rejects_bad_arguments(schedules, retime_every, message):
    with pytest.raises(ValueError, match=message):
        FastestSchedule(schedules, retime_every)


def test_fastest_schedule_rejects_an_unknown_schedule():
    choice = FastestSchedule(("a", "b"), retime_every=4)
    with pytest.raises(ValueError, match=r"expected one of \('a', 'b'\), got 'z'"):
        choice.timed("z", 1.0)
    assert choice.seconds == {}  # nothing recorded
    assert repr(choice) == "FastestSchedule(('a', 'b'), retime_every=4, seconds={})"


def test_keyword_only_takes_the_old_positional_call_for_one_release_with_a_warning():
    @keyword_only("quick", "threads")
    def run(name, *, quick=False, threads=None):
        return name, quick, threads

    assert run("a", quick=True, threads=2) == ("a", True, 2)
    with pytest.warns(DeprecationWarning, match=r"run: pass quick=, threads= by keyword .*0\.3\.0"):
        assert run("a", True, 2) == ("a", True, 2)
    with pytest.warns(DeprecationWarning, match=r"pass quick= by keyword"):
        assert run("a", True, threads=3) == ("a", True, 3)
    with pytest.raises(TypeError, match="multiple values for argument 'quick'"):
        run("a", True, quick=False)
    with pytest.raises(TypeError, match="3 positional arguments at most"):
        run("a", True, 2, 4)


def test_bench_suites_take_keywords_and_warn_on_positional_arguments():
    import inspect

    from attnkit import bench
    from attnkit.bench.measure import best_time

    for name in bench.SUITES:
        parameters = inspect.signature(bench.get_suite(name).run).parameters.values()
        assert all(p.kind == p.KEYWORD_ONLY for p in parameters), name
    assert inspect.signature(bench.run_suite).parameters["quick"].kind == inspect.Parameter.KEYWORD_ONLY
    assert inspect.signature(best_time).parameters["warmup"].kind == inspect.Parameter.KEYWORD_ONLY
    with pytest.warns(DeprecationWarning, match="best_time: pass warmup= by keyword"):
        seconds, times = best_time(lambda: None, 0.0, 1, False)
    assert len(times) == 1


def test_run_claimed_runs_every_chunk_once_and_a_late_thread_takes_only_what_is_left():
    """`run_claimed`: every index exactly once, whatever the threads; a pool thread that
    starts late (its CPU busy) leaves the chunks to the calling thread instead of holding a
    fixed share; an error in a chunk reaches the caller; from inside a pool thread it
    cannot wait on itself."""
    import threading
    import time

    from attnkit.runtime import run_claimed, worker_pool, worker_thread_count, worker_threads

    for threads in (1, 2, 3):
        seen = []
        run_claimed(50, seen.append, threads)
        assert sorted(seen) == list(range(50))

    # the pool's thread is held busy: the calling thread runs every chunk and does not wait
    # for the pool to come free
    release = threading.Event()
    blocker = worker_pool(1).submit(release.wait)
    ran_on = []
    start = time.perf_counter()
    run_claimed(8, lambda i: ran_on.append(threading.get_ident()), 2)
    assert time.perf_counter() - start < 1.0
    assert set(ran_on) == {threading.get_ident()}
    release.set()
    blocker.result()

    with pytest.raises(ZeroDivisionError):
        run_claimed(6, lambda i: 1 / (i - 3), 2)

    # a pool thread calling it with the pool's only thread busy (itself) finishes alone
    assert worker_pool(1).submit(lambda: run_claimed(4, lambda i: None, 2) or "done").result(timeout=10) == "done"

    assert worker_thread_count() == 1
    with worker_threads(3):
        assert worker_thread_count() == 3
        with worker_threads(0):
            assert worker_thread_count() == 1
    assert worker_thread_count() == 1
