"""The last resort: the newest stream is named only once degradation has run out and viewers still stall."""

from __future__ import annotations

from streamsvc.scheduling import Late, OverloadMonitor, Scheduler, SchedulerConfig
from tests.streamsvc.scheduling.helpers import C, COST, DEGRADE, Clock, admit, first_chunk, make


def run_late(sched: Scheduler, until: float, away: float) -> Clock:
    """Serve `streams` until `until`, the device away for `away` s after each chunk (a throttled device)."""
    clock = Clock(sched)
    while clock.now < until:
        plan = clock.step()
        if plan is None:
            clock.now = sched.wake_at(clock.now) or clock.now + COST
        elif plan.kind is C:
            clock.now += away
    return clock


def test_the_newest_stream_is_ended_only_after_degradation_ran_out():
    # Degradation absorbs the device being away 0.1 s after every chunk: chunks run fewer steps, and though the
    # start-up stalls twice, the fewest steps always leave the margin, so no stream is named.
    mild = make(**DEGRADE, start_margin_s=0.0625)
    admit(mild, "a", "b")
    clock = run_late(mild, 6.0, away=0.1)
    assert mild.stats(clock.now).degraded_chunks > 0
    assert mild.overloaded(clock.now) is None
    # Away for long after every chunk: chunks run with 2 steps (the fewest) and the viewers still stall.
    sched = make(**DEGRADE, overload_stalls=2, overload_window_s=4.0)
    admit(sched, "a", "b")
    clock = run_late(sched, 3.0, away=0.5)
    named = sched.overloaded(clock.now)
    assert named == "b"  # the newest
    assert sched.stats(clock.now).degraded_chunks > 0 and sched.stats(clock.now).stalls >= 2
    assert sched.overloaded(clock.now) is None  # the evidence is spent: the next needs stalls of its own


def test_stalls_without_degradation_running_out_end_nobody():
    sched = make(**DEGRADE)
    admit(sched, "a", "b")
    first_chunk(sched)
    for t in (1.0, 1.5, 2.0):
        sched._overload.stalled("a", t, "test")  # stalls the degrade never had a chance against
    assert sched.overloaded(2.0) is None
    one = make()
    admit(one, "a")
    assert one.overloaded(0.0) is None


def test_the_monitor_alone_names_the_newest_once_stalls_follow_degradation_running_out():
    monitor = OverloadMonitor(SchedulerConfig(overload_stalls=2, overload_window_s=4.0))
    monitor.stalled("a", 1.0, "before")  # a stall before degradation ran out is no evidence
    monitor.exhausted(1.5)
    monitor.stalled("a", 2.0, "after")
    assert monitor.overloaded(2.0, ["a", "b"]) is None  # one stall since
    monitor.stalled("b", 2.5, "after too")
    assert (monitor.late, monitor.last_stall_at) == (Late(2.5, "b", "after too"), 2.5)
    assert monitor.overloaded(2.5, ["a"]) is None  # one stream: ending it helps nobody
    assert monitor.overloaded(2.5, ["a", "b"]) == "b"  # the newest
    assert monitor.overloaded(2.5, ["a", "b"]) is None  # the evidence is spent
    monitor.exhausted(3.0)
    monitor.stalled("a", 3.5, "again")
    monitor.stalled("a", 4.0, "again")
    assert monitor.overloaded(7.5, ["a", "b"]) is None  # out of the window by then
