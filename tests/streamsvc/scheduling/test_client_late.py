"""Whose lateness (issue 41): only the server's own measurements close admission, widen the leads or end a stream.

A viewer's own reports may lower its stream's model (it becomes urgent), and a stream's input may go missing or come
late; the lateness that follows is charged to that stream (`client_late`), never read as the server's overload. A
chunk whose input is missing is released in time to run every step, and admission charges a stream with input what
such a chunk costs.
"""

from __future__ import annotations

import math

import pytest

from streamsvc.scheduling import Scheduler, Stage, StreamRequest
from tests.streamsvc.scheduling.helpers import COST, DEGRADE, FPS, MARGIN, C, Clock, D, admit, first_chunk, make

LATENCY = 0.5


def admit_input(sched: Scheduler, stream_id: str = "a", start_step: int = 2, now: float = 0.0) -> None:
    req = StreamRequest(stream_id, FPS, input_start_step=start_step, input_latency_s=LATENCY)
    assert sched.admit(req, now).accepted


def serve_until(clock: Clock, t: float) -> None:
    """Run plans until `t`, the clock jumping to the next wake-up while nothing is runnable (bounded)."""
    for _ in range(10_000):
        if clock.now >= t:
            return
        if clock.step() is None:
            wake = clock.sched.wake_at(clock.now)
            assert wake is None or wake > clock.now  # nothing runnable, so no wake-up now (the engine would spin)
            clock.now = t if wake is None else min(wake, t)
    raise AssertionError(f"still at {clock.now} after 10000 plans, short of {t}")


def run_chunk(clock: Clock) -> list:
    """Run the next chunk's plans up to its commit; returns them."""
    plans = []
    for _ in range(10):
        plans.append(clock.step())
        assert plans[-1] is not None
        if plans[-1].kind is C:
            return plans
    raise AssertionError(f"no commit in {plans}")


def test_a_viewer_reporting_an_empty_buffer_four_times_a_second_lowers_its_own_model_and_closes_nothing():
    # Before issue 41: its first report closed admission for everyone, and so did every one after (34 of 34 tries
    # over 17 s refused on the scheduler alone).
    sched = make(**DEGRADE, utilization_target=0.9, confirm_chunks=0, late_hold_s=2.0, initial_forward_s=1 / 64)
    admit(sched, "liar", "honest")
    clock = Clock(sched, cost=1 / 64)
    refused, tries = [], 0
    for tick in range(4 * 17):
        t = tick * 0.25
        serve_until(clock, t)
        sched.observe_buffer("liar", 0, t, at_most=True)
        assert sched.stream_stats("liar", t).buffered_s == 0  # its model follows the report: the stream is urgent
        if tick % 2 == 0:
            tries += 1
            admission = sched.admit(StreamRequest(f"new{tick}", FPS), t)
            if admission.accepted:
                sched.remove(f"new{tick}")
            else:
                refused.append(admission.reason)
    assert (tries, refused) == (34, [])
    stats = sched.stats(t)
    liar, honest = stats.per_stream
    assert not stats.late and liar.stalls > 0 and liar.client_late > 0  # its stalls are its own
    assert (honest.stalls, honest.client_late) == (0, 0)
    assert stats.client_late == liar.client_late
    assert sched.overloaded(t) is None and sched._overload.last_stall_at == -math.inf  # no late margin either
    # urgent, but no further ahead than the cap by the server's own figure: about real time, not a chunk a report
    assert liar.chunks_delivered <= (17 + 2.0) / 0.75 + 1


def test_a_late_chunk_whose_input_was_missing_is_its_streams_and_does_not_close_admission():
    sched = make(utilization_target=0.9, confirm_chunks=0, late_hold_s=2.0)
    admit_input(sched)
    sched.release("a", 0, 2, 0.5625)
    clock = Clock(sched, now=0.5625)
    run_chunk(clock)  # delivered at 0.75: plays from 1.25, runs dry at 1.8125
    # the camera went off and chunk 1 was let go only at 2.0 (a late release): it runs as text-to-video, late
    sched.release("a", 1, 0, 2.0, frames=False)
    clock.now = 2.0
    run_chunk(clock)
    st = sched.stream_stats("a", clock.now)
    assert (st.stalls, st.client_late) == (1, 1)
    assert sched.admit(StreamRequest("b", FPS), clock.now).accepted
    assert not sched.stats(clock.now).late and sched._overload.last_stall_at == -math.inf


def test_lateness_by_the_servers_own_account_still_closes_admission():
    # a WebRTC track's queue on the server running dry (an exact report) closes it; the viewer's own report does not
    sched = make(utilization_target=0.9, confirm_chunks=0, late_hold_s=1.0)
    admit(sched, "a")
    now = first_chunk(sched)
    sched.observe_buffer("a", 0, now, at_most=True)
    assert sched.admit(StreamRequest("b", FPS), now).accepted
    sched.remove("b")
    sched.observe_buffer("a", 0, now + 0.125)
    assert "its viewer's queue on the server ran dry" in sched.admit(StreamRequest("b", FPS), now + 0.125).reason
    # a chunk of input frames released in time (its release + the input latency is when its viewer needs it) and
    # delivered late because the device was away: the server's
    sched = make(utilization_target=0.9, confirm_chunks=0, late_hold_s=2.0)
    admit_input(sched)
    sched.release("a", 0, 2, 0.5625)
    clock = Clock(sched, now=0.5625)
    run_chunk(clock)  # runs dry at 1.8125 = 1.3125 + the input latency
    sched.release("a", 1, 2, 1.3125)
    plan = sched.next(1.9)  # the device was away
    clock.now = 1.9 + COST
    sched.complete(plan, clock.now, COST)
    run_chunk(clock)
    st = sched.stream_stats("a", clock.now)
    assert (st.stalls, st.client_late) == (1, 0)
    assert "closed loop: stream a was late" in sched.admit(StreamRequest("b", FPS), clock.now).reason
    # and a degraded chunk, its input in time: the server's too
    sched = make(**DEGRADE, utilization_target=0.9, confirm_chunks=0)
    admit_input(sched)
    sched.release("a", 0, 2, 0.5625)
    clock = Clock(sched, now=0.5625)
    run_chunk(clock)
    sched.release("a", 1, 0, 1.3125, frames=True)  # strength 1.0: 4 forwards from its release, in time
    assert sched.next(1.6).steps == (2,)  # the device was away: 0.2125 s left, the fewest steps
    assert "a chunk ran 2 of 4 steps to stay ahead" in sched.admit(StreamRequest("b", FPS), 1.6).reason


def test_input_that_comes_late_makes_its_chunk_degrade_for_its_stream_alone():
    # chunk 1's last frame came 0.4 s late: its viewer runs dry 0.1 s after its release, so it degrades, but the
    # server owes it only by its release + the input latency: its client's, admission stays open
    sched = make(**DEGRADE, utilization_target=0.9, confirm_chunks=0)
    admit_input(sched)
    sched.release("a", 0, 2, 0.5625)
    clock = Clock(sched, now=0.5625)
    run_chunk(clock)
    late = 1.8125 - 0.1
    sched.release("a", 1, 1, late)
    clock.now = late
    plans = run_chunk(clock)
    assert plans[0].steps == (2,)  # degraded to step 1 alone
    assert sched.admit(StreamRequest("b", FPS), clock.now).accepted
    st = sched.stream_stats("a", clock.now)
    assert st.degraded_chunks == 1 and st.client_late >= 1
    assert sched.overloaded(clock.now) is None


def test_a_chunk_whose_input_is_missing_is_released_in_time_to_run_every_step():
    sched = make(**DEGRADE, utilization_target=0.9, confirm_chunks=0)
    sched.seed_stage(Stage.OUTPUT, COST)
    admit_input(sched)
    assert sched.release_by("a", frames=False) is None  # its viewer is not playing: nothing to be late for
    sched.release("a", 0, 2, 0.5625)
    clock = Clock(sched, now=0.5625)
    run_chunk(clock)  # delivered at 0.75: plays from 1.25, runs dry at 1.8125
    lead = 5 * COST + MARGIN  # the predicted latency (one chunk, few samples yet) and the margin
    assert sched.release_by("a", frames=True) == 1.8125 - lead - COST  # and the output stage
    by = sched.release_by("a", frames=False)
    assert by == 1.8125 - lead - COST - 2 * COST  # and the 2 forwards text-to-video runs beyond its start step
    # (by its last slot's time + half the input latency, 1.5625, it had 0.25 s left for 0.3125 s of forwards)
    sched.release("a", 1, 0, by, frames=False)
    clock.now = by
    plans = run_chunk(clock)
    assert [(p.kind, p.step, p.steps) for p in plans] == [(D, 0, (4,)), (D, 1, (4,)), (D, 2, (4,)), (D, 3, (4,)),
                                                          (C, 4, (4,))]
    assert clock.delivered[-1] == (by + 5 * COST, "a") and by + 5 * COST + COST + MARGIN <= 1.8125
    stats = sched.stats(clock.now)
    assert (stats.degraded_chunks, stats.client_late, stats.stalls, stats.late) == (0, 0, 0, False)


def test_admission_charges_a_stream_with_input_what_its_chunks_cost_when_its_input_is_missing():
    # one forward 0.125 s: a chunk without input (4 + 1 forwards) 0.625 s, 0.83 of the device at 16/12 chunks a
    # second; with input at step 3 (1 + 1) it would be 0.33, and two such streams fit under 0.9
    sched = make(utilization_target=0.9, confirm_chunks=0, buffer_cap_s=4.0, initial_forward_s=0.125)
    full = sched.stream_load(StreamRequest("t", FPS))
    assert sched.stream_load(StreamRequest("i", FPS, input_start_step=3)) == full == pytest.approx(16 / 12 * 5 * 0.125)
    assert sched.admit(StreamRequest("i1", FPS, input_start_step=3, input_latency_s=LATENCY), 0.0).accepted
    refused = sched.admit(StreamRequest("i2", FPS, input_start_step=3, input_latency_s=LATENCY), 0.0)
    assert not refused.accepted and "compute: the device is 0.83 busy with 1 streams" in refused.reason
