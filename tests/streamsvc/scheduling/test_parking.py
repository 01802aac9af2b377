"""Parking: a held stream commits its chunk, then costs nothing until it is admitted again."""

from __future__ import annotations

import math

import pytest

from streamsvc.scheduling import RECACHE_STAGE, Admission, Scheduler, SchedulerError, StreamRequest
from tests.streamsvc.scheduling.helpers import C, D, FPS, R, Clock, make


def admit12(sched: Scheduler, *ids: str, now: float = 0.0) -> None:
    """12 fps, 12 frames a chunk: 1 chunk/s, load 0.3125 each."""
    for stream_id in ids:
        assert sched.admit(StreamRequest(stream_id, fps=12.0, chunk_frames=12), now).accepted


def test_a_held_stream_commits_its_chunk_then_parks_costing_no_load_and_getting_no_plans():
    sched = make(utilization_target=0.9)
    admit12(sched, "a", "b")
    clock = Clock(sched)
    assert clock.run(2) == [(D, ("a",), 0), (D, ("a",), 1)]
    sched.hold("a")
    assert sched.set_prompt("a", clock.now) == 1  # held: the chunk in progress is not restarted for it
    assert not sched.parkable("a")
    with pytest.raises(SchedulerError, match="'a' cannot be parked now: it is at step 2 of its chunk"):
        sched.park("a", clock.now)
    # a's chunk goes on to its commit; then b's, never a's next one (nor its RECACHE)
    assert clock.run(5) == [(D, ("a",), 2), (D, ("a",), 3), (C, ("a",), 4), (D, ("b",), 0), (D, ("b",), 1)]
    assert sched.parkable("a") and sched.predicted_load() == 0.625
    sched.park("a", clock.now)
    assert sched.predicted_load() == 0.3125 and len(sched) == 1 and "a" in sched and sched.is_parked("a")
    assert sched.parked_ids == ("a",) and sched.stream_ids == ("b",)
    stats = sched.stats(clock.now)
    assert (stats.streams, stats.parked, [s.stream_id for s in stats.per_stream]) == (1, 1, ["b"])
    assert clock.run(4) == [(D, ("b",), 2), (D, ("b",), 3), (C, ("b",), 4), (D, ("b",), 0)]
    assert not sched.parkable("a")


def test_a_parked_stream_keeps_its_counters_and_comes_back_with_its_prompt_applied():
    sched = make()
    admit12(sched, "a")
    clock = Clock(sched)
    clock.run(5)  # chunk 0 under prompt 0
    sched.hold("a")
    sched.park("a", clock.now)  # between chunks already
    assert sched.set_prompt("a", 3.0) == 1  # steering a parked stream: applied after it comes back
    assert sched.next(3.0) is None and sched.wake_at(3.0) is None
    assert sched.stream_stats("a", 3.0).buffered_s == 0.75  # paused while parked: 9 frames at 12 fps
    assert sched.unpark("a", 10.0) == Admission(accepted=True, reason=None, predicted_load=0.3125)
    assert not sched.is_parked("a") and sched.parked_ids == ()
    clock.now = 10.0
    plans = clock.launch(6)
    assert [(p.kind, p.step, p.prompt_seqs, p.chunk_index) for p in plans] == [
        (R, RECACHE_STAGE, (1,), (1,)), (D, 0, (1,), (1,)), (D, 1, (1,), (1,)), (D, 2, (1,), (1,)),
        (D, 3, (1,), (1,)), (C, 4, (1,), (1,)),
    ]


def test_unpark_rechecks_admission_and_a_refused_stream_stays_parked():
    sched = make(utilization_target=0.9)
    admit12(sched, "a", "b")
    sched.hold("a")
    sched.park("a", 0.0)  # before its first chunk
    admit12(sched, "c")  # takes a's room
    refused = sched.unpark("a", 1.0, kv_refusal="KV cache needs 3.2 GiB but the pool has 1.0 GiB free")
    assert not refused.accepted and refused.predicted_load == 0.625
    assert refused.reason.startswith("kv cache: KV cache needs 3.2 GiB but the pool has 1.0 GiB free; start rule: ")
    assert "compute: the device is 0.62 busy with 2 streams and this one needs 0.31" in refused.reason
    assert sched.is_parked("a") and sched.stream_ids == ("b", "c")
    sched.remove("c")
    assert sched.unpark("a", 2.0, kv_refusal="pool full") == Admission(False, "kv cache: pool full", 0.3125)
    assert sched.unpark("a", 2.0) == Admission(accepted=True, reason=None, predicted_load=0.625)
    assert sched.stream_ids == ("b", "a")


def test_a_parked_stream_is_still_credited_its_chunk_in_flight_and_keeps_its_viewers():
    sched = make(send_target=math.inf)
    admit12(sched, "a")
    assert sched.admit_viewer("a").accepted
    clock = Clock(sched)
    clock.launch(5)  # chunk 0 committed, in flight
    sched.hold("a")
    sched.park("a", clock.now)
    assert sched.delivered("a", 1.0) == 1.0 - 0.0  # due at admission, delivered at 1.0
    assert sched.stream_stats("a", 5.0).buffered_s == 0.75 and sched.stream_stats("a", 5.0).chunks_delivered == 1
    sched.viewer_left("a")
    assert sched.unpark("a", 5.0).accepted
    assert sched._streams["a"].viewers == 1  # the steerer: its watcher left while it was parked
    assert sched.stream_stats("a", 5.5).buffered_s == 0.25  # playing again


def test_parking_used_against_its_contract_says_why():
    sched = make()
    admit12(sched, "a")
    with pytest.raises(SchedulerError, match="'a' cannot be parked now: it is not held"):
        sched.park("a", 0.0)
    with pytest.raises(SchedulerError, match="'a' is not parked"):
        sched.unpark("a", 0.0)
    plan = sched.next(0.0)
    sched.hold("a")
    assert not sched.parkable("a")  # in the outstanding plan
    sched.cancel(plan)
    sched.park("a", 0.0)
    with pytest.raises(SchedulerError, match="'a' is parked: unpark it instead"):
        sched.hold("a")
    with pytest.raises(SchedulerError, match="already admitted"):
        sched.admit(StreamRequest("a", FPS), 0.0)
    assert sched.remove("a") and "a" not in sched and not sched.remove("a")


def test_a_hold_let_go_before_parking_lets_the_stream_go_on():
    sched = make()
    admit12(sched, "a")
    sched.hold("a")
    assert sched.next(0.0) is None and sched.wake_at(0.0) is None
    sched.hold("a", False)
    assert sched.next(0.0).stream_ids == ("a",)
