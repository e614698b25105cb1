"""attnkit.runtime: BLAS thread limits and the measured choice among schedules."""

from __future__ import annotations

import pytest

from attnkit.runtime import FastestSchedule, blas_thread_count, blas_threads, one_blas_thread


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
    order = []
    for seconds in (3.0, 1.0, 2.0):  # every schedule is timed once, in order
        order.append(choice.choose())
        choice.timed(order[-1], seconds)
    assert order == ["a", "b", "c"]
    runs = [choice.choose() for _ in range(16)]
    # every 4th call re-times a slower schedule, taking turns; the rest run the fastest
    assert runs.count("b") == 12
    assert [r for r in runs if r != "b"] == ["a", "c", "a", "c"]
    choice.timed("b", 5.0)  # running average: (1 + 5) / 2 = 3, now slower than c (2)
    assert choice.seconds["b"] == pytest.approx(3.0)
    assert choice.choose() == "c"


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
