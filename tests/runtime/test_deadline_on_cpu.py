"""The deadline rule (runtime/control/deadline.py): at a step boundary the master checkpoints and stops when the time left
no longer covers the next step, its checkpoint and a margin, from what this attempt measured."""

from restage.runtime.control.deadline import (
    MARGIN_SECONDS,
    WINDOW_STEPS,
    DeadlineWatch,
    deadline_from_env,
    must_stop,
    read_time_limit,
    write_time_limit,
)


def test_the_rule_compares_time_left_with_step_save_and_margin():
    assert not must_stop(seconds_left=100.0, next_step_seconds=50.0, save_seconds=29.0, margin_seconds=20.0)
    assert must_stop(seconds_left=100.0, next_step_seconds=50.0, save_seconds=31.0, margin_seconds=20.0)
    assert must_stop(seconds_left=-5.0, next_step_seconds=0.0, save_seconds=0.0, margin_seconds=0.0)


def test_no_deadline_never_stops():
    watch = DeadlineWatch(None)
    watch.step_done(1e9)
    assert watch.check(now_seconds=1e12) is None


def test_a_step_of_minutes_stops_long_before_the_signal_would_come():
    """A 5-minute step and a 2-minute save: 500 s left cover both and the margin, 434 s do not."""
    end = 10_000.0
    watch = DeadlineWatch(end)
    watch.step_done(300.0)
    watch.saved(120.0)
    assert MARGIN_SECONDS == 15.0
    assert watch.check(end - 500.0) is None  # 300 + 120 + 15 = 435 <= 500
    assert watch.check(end - 435.0) is None
    stop = watch.check(end - 434.0)
    assert stop is not None and (stop.seconds_left, stop.next_step_seconds, stop.save_seconds, stop.margin_seconds) == (
        434.0, 300.0, 120.0, MARGIN_SECONDS)
    assert stop.describe() == ("434 s left before the time limit < next step 300.0 s + checkpoint 120.0 s + margin "
                               "15 s")


def test_estimates_are_the_longest_recent_step_and_save():
    watch = DeadlineWatch(1000.0)
    watch.step_done(9.0)  # the first step, warm-up included
    for seconds in [2.0] * (WINDOW_STEPS - 1):
        watch.step_done(seconds)
    assert watch.next_step_seconds == 9.0
    watch.step_done(3.0)  # the warm-up step leaves the window
    assert watch.next_step_seconds == 3.0
    # No save timed yet: the longer of the step estimate and the load of this attempt's checkpoint.
    assert watch.save_seconds == 3.0
    watch.loaded(7.5)
    assert watch.save_seconds == 7.5
    watch.saved(4.0)
    watch.saved(6.0)
    watch.saved(5.0)
    assert watch.save_seconds == 6.0
    assert watch.check(1000.0 - (3.0 + 6.0 + MARGIN_SECONDS) - 0.5) is None
    assert watch.check(1000.0 - (3.0 + 6.0 + MARGIN_SECONDS) + 0.5) is not None


def test_save_before_end_seconds_replaces_the_estimates():
    watch = DeadlineWatch(1000.0, save_before_end_seconds=120.0)
    watch.step_done(500.0)
    watch.saved(400.0)
    assert watch.check(1000.0 - 121.0) is None
    stop = watch.check(1000.0 - 119.0)
    assert stop is not None and stop.margin_seconds == 120.0 and stop.next_step_seconds == 0.0
    assert stop.describe() == "119 s left before the time limit < run.save_before_end_seconds=120"


def test_the_deadline_and_the_marker_the_driver_reads(tmp_path):
    assert deadline_from_env({"RESTAGE_DEADLINE": "1767225600"}) == 1767225600.0
    assert deadline_from_env({}) is None
    assert read_time_limit(tmp_path) is None
    watch = DeadlineWatch(100.0)
    watch.step_done(30.0)
    stop = watch.check(60.0)
    assert stop is not None
    write_time_limit(tmp_path, 7, stop)
    assert read_time_limit(tmp_path) == {"step": 7, "seconds_left": 40.0, "reason": stop.describe()}
