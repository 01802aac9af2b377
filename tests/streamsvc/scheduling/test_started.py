"""A stream whose first chunk came from outside the plans (a start image: `Scheduler.started`)."""

from __future__ import annotations

import pytest

from streamsvc.scheduling import SchedulerError, StreamRequest
from tests.streamsvc.scheduling.helpers import CHUNK, COST, FPS, C, D, make


def image_stream(sched, stream_id: str = "a", now: float = 0.0) -> None:
    assert sched.admit(StreamRequest(stream_id, FPS, first_chunk_frames=1), now).accepted
    sched.started(stream_id, now, frames=1)


def test_the_image_counts_as_chunk_zero_in_flight_and_the_plans_begin_at_chunk_one():
    sched = make()
    image_stream(sched)
    assert sched.stream_stats("a", 0.0).in_flight_s == 1 / FPS
    plan = sched.next(0.0)
    assert (plan.kind, plan.step, plan.chunk_index) == (D, 0, (1,))  # the stream's second chunk, due at once
    assert sched.delivered("a", 0.0625) == 0.0625  # the image, delivered: the stream's first frame (TTFF)
    stats = sched.stream_stats("a", 0.0625)
    assert (stats.chunks_delivered, stats.ttff_s, stats.buffered_s) == (1, 0.0625, 1 / FPS)


def test_then_every_chunk_is_a_full_one_and_deliveries_keep_their_order():
    sched = make()
    image_stream(sched)
    now, plans = 0.0, []
    for _ in range(5):  # as the engine runs them: a commit's chunk is in flight until the output stage delivers it
        plan = sched.next(now)
        now += COST
        sched.complete(plan, now, COST, deliver=False)
        plans.append((plan.kind, plan.step))
    assert plans == CHUNK and plan.kind is C
    assert sched.stream_stats("a", now).in_flight_s == (1 + 12) / FPS  # the image, then chunk 1 behind it
    sched.delivered("a", now)
    sched.delivered("a", now)
    stats = sched.stream_stats("a", now)
    assert (stats.chunks_delivered, stats.buffered_s, stats.in_flight_s) == (2, 13 / FPS, 0.0)
    with pytest.raises(SchedulerError, match="no chunk in flight"):
        sched.delivered("a", now)


def test_only_before_the_streams_first_plan_and_with_its_requests_frames():
    sched = make()
    assert sched.admit(StreamRequest("a", FPS, first_chunk_frames=1), 0.0).accepted
    with pytest.raises(SchedulerError, match="its request says 1"):
        sched.started("a", 0.0, frames=9)
    sched.next(0.0)  # its first chunk's first forward is planned: too late
    with pytest.raises(SchedulerError, match="has begun its chunks"):
        sched.started("a", 0.0, frames=1)
    image_stream(sched, "b")
    with pytest.raises(SchedulerError, match="has begun its chunks"):
        sched.started("b", 0.0, frames=1)
