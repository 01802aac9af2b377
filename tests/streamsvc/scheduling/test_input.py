"""Input video in the scheduler (issue 35): a chunk starts once released by its input, from its start step, and its
viewer plays it input_latency_s after its release; admission counts the input stage and the fewer forwards."""

from __future__ import annotations

import math

import pytest

from streamsvc.scheduling import Scheduler, SchedulerConfig, SchedulerError, Stage, StreamRequest
from tests.streamsvc.scheduling.helpers import COST, FPS, C, Clock, D, admit, make

LATENCY = 0.5


def admit_input(sched: Scheduler, stream_id: str = "a", start_step: int = 2, now: float = 0.0) -> None:
    req = StreamRequest(stream_id, FPS, input_start_step=start_step, input_latency_s=LATENCY)
    assert sched.admit(req, now).accepted


def test_a_chunk_waits_for_its_release_then_runs_from_its_start_step():
    sched = make()
    admit_input(sched)
    assert sched.next(0.0) is None and sched.wake_at(0.0) is None  # no input yet: nothing to run, no wake by time
    assert sched.releasable("a") == 0
    sched.release("a", 0, 2, 0.5625)  # its 9th frame came at 0.5625
    clock = Clock(sched, now=0.5625)
    plans = clock.run(3)  # steps 2 and 3 (the plan counts forwards from 0), then the commit
    assert [(k, s) for k, _, s in plans] == [(D, 0), (D, 1), (C, 4)]
    assert clock.delivered == [(0.5625 + 3 * COST, "a")]
    assert sched.next(clock.now) is None  # chunk 1 not released: its input has not come
    assert sched.releasable("a") == 1
    with pytest.raises(SchedulerError):
        sched.release("a", 0, 2, clock.now)  # released (and committed) already
    with pytest.raises(ValueError):
        sched.release("a", 1, 4, clock.now)  # no step 4 in a 4-step schedule


def test_the_viewer_plays_the_first_chunk_of_input_from_its_release_plus_the_latency():
    sched = make()
    admit_input(sched)
    sched.release("a", 0, 2, 0.5625)
    clock = Clock(sched, now=0.5625)
    clock.run(3)  # delivered at 0.75
    # it plays from 0.5625 + 0.5 + (12 - 9) / 16 = 1.25: until then it holds all 9 frames
    assert sched.stream_stats("a", 1.0).buffered_s == 9 / FPS
    assert sched.stream_stats("a", 1.25 + 0.25).buffered_s == 9 / FPS - 0.25
    # chunk 1 (frames 9..20) is released as its 21st frame comes (0.5625 + 0.75) and due 0.5 s later, when the
    # first chunk has played out: 1.25 + 0.5625 = 1.8125 = 1.3125 + 0.5
    assert sched.stream_stats("a", 1.3125).buffered_s == pytest.approx(1.8125 - 1.3125)
    sched.release("a", 1, 2, 1.3125)
    plan = sched.next(1.3125)
    assert plan is not None and plan.kind is D and plan.chunk_index == (1,)  # at once, whatever the lead


def test_a_missing_input_runs_every_step_and_a_chunk_of_input_is_no_degraded_one():
    sched = make()
    admit_input(sched, start_step=3)
    sched.release("a", 0, 0, 0.6, frames=False)  # missing: text-to-video, from step 0
    clock = Clock(sched, now=0.6)
    assert [(k, s) for k, _, s in clock.run(5)] == [(D, 0), (D, 1), (D, 2), (D, 3), (C, 4)]
    sched.release("a", 1, 3, clock.now)  # frames again, at the last step: one forward
    assert [(k, s) for k, _, s in clock.run(2)] == [(D, 0), (C, 4)]
    stats = sched.stats(clock.now)
    assert stats.degraded_chunks == 0 and not stats.pressure


def test_a_chunk_of_input_degrades_only_the_steps_after_its_start():
    sched = make(degrade_steps=(3, 2), degrade_margin_s=0.125)
    admit_input(sched, start_step=1)
    sched.release("a", 0, 1, 0.5625)
    clock = Clock(sched, now=0.5625)
    clock.run(4)  # steps 1, 2, 3 and the commit: no hurry, nothing degraded
    # chunk 1 released late: its viewer (playing chunk 0 since 1.25) runs dry 0.1 s later, short of any chunk
    late = 1.25 + 0.5625 - 0.1
    sched.release("a", 1, 1, late)
    plan = sched.next(late)
    assert plan.kind is D and plan.step == 0 and plan.steps == (2,)  # n = 2 of (3, 2): step 1 alone, the fewest
    sched.complete(plan, late + COST, COST)
    clock.now = late + COST
    assert [(k, s) for k, _, s in clock.run(1)] == [(C, 4)]
    assert sched.stats(clock.now).degraded_chunks == 1


def test_admission_counts_the_forwards_of_a_missing_input_and_the_input_stage_of_streams_with_input():
    cfg = SchedulerConfig(initial_forward_s=COST, input_target=0.5)
    sched = Scheduler(cfg)
    full = sched.stream_load(StreamRequest("t", FPS))
    one = sched.stream_load(StreamRequest("i", FPS, input_start_step=3))
    # its chunks with input run 1 + 1 forwards, but its camera may go off: without input they run 4 + 1 (issue 41)
    assert full == pytest.approx(16 / 12 * 5 * COST) and one == full
    sched.seed_stage(Stage.INPUT, 0.2)  # 0.2 s of decode, scale and encode a chunk: 0.27 of the stage a stream
    assert sched.admit(StreamRequest("t1", FPS), 0.0).accepted  # no input: the input stage is not its
    assert sched.stage_load(Stage.INPUT) == 0.0
    assert sched.admit(StreamRequest("i1", FPS, input_start_step=3), 0.0).accepted
    assert sched.stage_load(Stage.INPUT) == pytest.approx(16 / 12 * 0.2)
    refused = sched.admit(StreamRequest("i2", FPS, input_start_step=3), 0.0)
    assert not refused.accepted and "input" in refused.reason and "decode" in refused.reason
    assert math.isclose(sched.stage_load(Stage.INPUT, StreamRequest("t2", FPS)), 16 / 12 * 0.2)


def test_a_new_prompt_does_not_restart_a_chunk_of_input_in_progress():
    sched = make(startup_slack_s=10.0)  # slack to spare: a stream without input would restart (below)
    admit_input(sched, start_step=0)
    sched.release("a", 0, 0, 0.5625)
    clock = Clock(sched, now=0.5625)
    clock.run(1)  # step 0 of 4
    sched.set_prompt("a", clock.now)
    plan = sched.next(clock.now)
    assert plan.kind is D and plan.step == 1 and plan.restart == (False,)
    plain = make(startup_slack_s=10.0)
    admit(plain, "b")
    clock = Clock(plain)
    clock.run(1)
    plain.set_prompt("b", clock.now)
    assert plain.next(clock.now).restart == (True,)


def seeded(input_s: float, commit_s: float, output_s: float = 0.02, **overrides) -> Scheduler:
    """A scheduler with admission on and its costs seeded as a warm-up would: a denoise forward COST."""
    sched = make(**{"utilization_target": 0.9, **overrides})
    sched.seed_cost(D, 1, COST)
    sched.seed_cost(C, 1, commit_s)
    sched.seed_stage(Stage.INPUT, input_s)
    sched.seed_stage(Stage.OUTPUT, output_s)
    return sched


def test_an_input_stream_whose_chunk_outlasts_the_input_latency_is_refused_with_the_figures_and_the_fix():
    # Wan's VAE as encoder and decoder on one H100: a 0.1875 s input stage, one denoise (start step 3), a 0.375 s
    # commit with its decode, 0.0625 s of x264: 0.6875 s a chunk > 0.5 s, so every chunk would be late
    sched = seeded(input_s=0.1875, commit_s=0.375, output_s=0.0625)
    req = StreamRequest("i", FPS, input_start_step=3, input_latency_s=LATENCY)
    refused = sched.admit(req, 0.0)
    assert not refused.accepted and "i" not in sched
    assert refused.reason.startswith("input latency: an input chunk takes 0.69 s on this device")
    assert "187.5 ms input stage" in refused.reason and "437.5 ms for 1 denoising forward(s)" in refused.reason
    assert "62.5 ms output stage" in refused.reason
    # the fix: the prediction + the start margin (0.25) rounded up to 0.1 s, or a faster encoder/decoder
    assert "--input-latency is 0.50 s: serve with --input-latency 1, or a faster encoder/decoder (--decoder taehv)" \
        in refused.reason
    assert sched.input_refusal(req) == refused.reason  # what the warm-up warns of
    # text-to-video on the same device: admitted (its chunks have no input latency)
    assert sched.admit(StreamRequest("t", FPS), 0.0).accepted
    assert sched.input_refusal(StreamRequest("t2", FPS)) is None
    # with the latency it names, the input stream is admitted
    wider = seeded(input_s=0.1875, commit_s=0.375, output_s=0.0625)
    assert wider.admit(StreamRequest("i", FPS, input_start_step=3, input_latency_s=1.0), 0.0).accepted


def test_an_input_stream_whose_chunk_fits_the_input_latency_is_admitted_and_its_steps_count():
    sched = seeded(input_s=0.125, commit_s=0.25)  # 0.125 + 0.0625 + 0.25 + 0.02 = 0.4575 s <= 0.5 s
    assert sched.input_refusal(StreamRequest("x", FPS, input_start_step=3)) is None
    assert sched.admit(StreamRequest("i", FPS, input_start_step=3, input_latency_s=LATENCY), 0.0).accepted
    assert seeded(input_s=0.125, commit_s=0.25).admit(StreamRequest("t", FPS), 0.0).accepted  # text-to-video too
    # the same device at strength 1.0 (step 0: four denoising forwards) misses it: 0.645 s, and a lower strength
    # is one more fix
    reason = sched.input_refusal(StreamRequest("x", FPS, input_start_step=0, input_latency_s=LATENCY))
    assert reason is not None and "takes 0.65 s" in reason and "4 denoising forward(s)" in reason
    assert "--input-latency 0.9, a lower strength (fewer denoising steps), or a faster" in reason
    # admission off (measuring overload): admitted whatever its latency
    off = seeded(input_s=0.3, commit_s=0.5, utilization_target=math.inf)  # 0.8825 s a chunk
    assert off.admit(StreamRequest("i", FPS, input_start_step=3, input_latency_s=LATENCY), 0.0).accepted
