"""The viewer's buffer model: exact stalls, graces, and the viewers' reports of their buffers."""

from __future__ import annotations

import pytest

from streamsvc.scheduling import PlaybackModel, StreamRequest
from tests.streamsvc.scheduling.helpers import COST, D, FPS, Clock, admit, first_chunk, make


# ----- the model alone ----------------------------------------------------------------------------


def test_playback_model_counts_stalls_exactly():
    pb = PlaybackModel(fps=FPS)
    pb.advance(1.0)
    assert (pb.started, pb.stalls) == (False, 0)  # nothing plays before the first frames
    pb.deliver(9, 1.0)
    assert (pb.seconds(1.0), pb.seconds(1.5)) == (0.5625, 0.0625)
    pb.advance(2.0)
    assert (pb.stalls, pb.dry_since, pb.stall_seconds(2.0)) == (1, 1.5625, 0.4375)
    pb.deliver(12, 2.5)
    assert (pb.closed_stall_s, pb.seconds(2.5), pb.dry_at()) == (0.9375, 0.75, 3.25)
    pb.pause(3.0)
    assert pb.seconds(10.0) == 0.25 and pb.dry_at() is None
    pb.resume(10.0)
    assert pb.dry_at() == 10.25
    assert (pb.stall_count(11.0), pb.stall_seconds(11.0)) == (2, 1.6875)


def test_a_dry_spell_shorter_than_the_grace_is_no_stall():
    pb = PlaybackModel(fps=FPS, grace_s=0.2)  # the viewer holds 0.2 s beyond the model (a WebRTC track's queue)
    pb.deliver(9, 1.0)  # dry at 1.5625
    pb.advance(1.7)
    assert (pb.dry_since, pb.seconds(1.7), pb.stalls, pb.stall_count(1.7)) == (1.5625, 0.0, 0, 0)  # planning sees it
    pb.deliver(12, 1.75)  # 0.1875 s dry: within the grace
    assert (pb.stalls, pb.closed_stall_s, pb.dry_since) == (0, 0.0, None)
    pb.observe(0, 2.0)  # the track's queue is empty
    assert (pb.stalls, pb.stall_count(2.1), pb.stall_count(2.2)) == (0, 0, 1)
    pb.advance(2.25)  # past the grace: a stall, counted once
    pb.advance(2.5)
    assert (pb.stalls, pb.stall_seconds(2.5)) == (1, 0.3)
    pb.deliver(12, 2.75)
    assert (pb.stalls, pb.closed_stall_s) == (1, 0.55)  # the stall's time past its grace


# ----- buffer reports and modelled stalls, through the Scheduler ----------------------------------


def test_a_report_with_a_grace_counts_as_a_stall_only_once_the_dry_spell_outlasts_it():
    sched = make(late_hold_s=1.0, confirm_chunks=0, late_margin_s=0.25, utilization_target=0.9)
    admit(sched, "a")
    now = first_chunk(sched)
    lead = sched.lead_s("a")
    sched.observe_buffer("a", 0, now, grace_s=0.15)  # a WebRTC track sent its last frame
    assert sched.admit(StreamRequest("b", FPS), now).accepted  # no stall yet: admission stays open
    sched.remove("b")
    assert sched.stream_stats("a", now).slack_s < 0  # but the stream plans as dry
    clock = Clock(sched, now)
    clock.run(5)  # its next chunk arrives 0.3125 s later: past the grace
    assert sched.stats(clock.now).stalls == 1
    assert "reached its viewer 0.31 s after the buffer ran dry" in sched.admit(StreamRequest("c", FPS), clock.now).reason
    sched.cancel(sched.next(clock.now))  # the margin in force is decided when the scheduler plans
    assert sched.lead_s("a") == lead + 0.25
    quick = make(late_hold_s=1.0, confirm_chunks=0, utilization_target=0.9)
    admit(quick, "a")
    now = first_chunk(quick)
    quick.observe_buffer("a", 0, now, grace_s=0.5)
    Clock(quick, now).run(5)  # within the grace: the viewer never saw it
    assert quick.stats(now + 0.3125).stalls == 0
    assert quick.admit(StreamRequest("c", FPS), now + 0.3125).accepted
    with pytest.raises(ValueError, match="grace_s"):
        quick.observe_buffer("a", 0, now, grace_s=-1.0)


def test_observe_buffer_replaces_the_model():
    sched = make()
    admit(sched, "a")
    clock = Clock(sched)
    clock.run(5)
    sched.observe_buffer("a", 4, 0.5)  # the viewer has 0.25 s left, not the modelled 0.375
    assert sched.stream_stats("a", 0.5).buffered_s == 0.25
    assert sched.stream_stats("a", 1.0).stall_s == 0.25
    with pytest.raises(ValueError, match="buffered_frames=-1"):
        sched.observe_buffer("a", -1, 1.0)


def test_stats_model_stalls_and_queue():
    sched = make()
    admit(sched, "a", "b")
    clock = Clock(sched)
    clock.run(5)  # a's first chunk at 0.3125: 0.5625 s, runs dry at 0.875
    stats = sched.stats(1.0)
    assert stats.streams == 2 and stats.queue_length == 2
    assert [(s.stream_id, s.buffered_s, s.stalls, s.stall_s) for s in stats.per_stream] == [
        ("a", 0.0, 1, 0.125),
        ("b", 0.0, 0, 0.0),
    ]
    assert (stats.stalls, stats.stall_s) == (1, 0.125)
    assert stats.forward_cost_s[D] == COST


def test_a_report_from_across_the_network_lowers_the_model_but_never_raises_it():
    sched = make()
    admit(sched, "a")
    now = first_chunk(sched)  # 9 frames delivered at 0.3125
    sched.observe_buffer("a", 9, now + 0.25, at_most=True)  # sent when the viewer had 9, arriving 0.25 s later
    assert sched.stream_stats("a", now + 0.25).buffered_s == 0.5625 - 0.25  # the model's: 4 frames played since
    sched.observe_buffer("a", 2, now + 0.25, at_most=True)  # the viewer is behind the model: it wins
    assert sched.stream_stats("a", now + 0.25).buffered_s == 0.125
    sched.observe_buffer("a", 0, now + 0.3125, at_most=True)
    assert sched.stream_stats("a", now + 0.3125).stalls == 1
    sched.observe_buffer("a", 9, now + 0.5)  # an exact report (the server's own WebRTC track) sets it
    assert sched.stream_stats("a", now + 0.5).buffered_s == 0.5625


def test_a_report_of_the_first_chunk_that_comes_before_the_scheduler_hears_of_it_does_not_count_it_twice():
    sched = make()
    admit(sched, "a")
    clock = Clock(sched)
    clock.launch(5)  # the first chunk's forwards: its 9 frames in flight
    now = clock.now + 0.01
    sched.observe_buffer("a", 9, now, at_most=True)  # the viewer got it before the engine told the scheduler
    assert sched.stream_stats("a", now).buffered_s == 0  # nothing delivered in the model yet: the report waits
    sched.delivered("a", now)
    assert sched.stream_stats("a", now).buffered_s == 0.5625  # the chunk once, not 18 frames


def test_a_cut_chunk_leaves_the_viewer_holding_it_alone_in_both_figures():
    pb = PlaybackModel(fps=FPS, own=PlaybackModel(fps=FPS))
    pb.deliver(12, 1.0)
    pb.deliver(4, 1.25, cut=True)  # a new prompt's first chunk: the older frames are dropped
    assert pb.seconds(1.25) == pb.own.seconds(1.25) == 0.25
    pb.deliver(4, 1.5)
    assert pb.seconds(1.5) == pytest.approx(0.25)
