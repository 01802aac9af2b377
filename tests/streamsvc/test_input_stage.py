"""The engine's side of input video (streamsvc/inputs/stage.py) with a fake generator, a real scheduler and a manual
clock: chunks released by their last frame or as missing, frames to set_input, the header's input fields."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from streamsvc.inputs.frames import FIRST_FRAME_WAIT_S, InputFrames
from streamsvc.inputs.stage import InputStage
from streamsvc.scheduling import Scheduler, SchedulerConfig, Stage, StreamRequest
from tests.clock import ManualClock

FPS = 16


class FakeGen:
    """What InputStage uses of a ChunkGenerator: the schedule, chunk sizes, and the input calls (recorded)."""

    sigmas = [1.0, 0.83, 0.625, 0.357]
    model_cfg = SimpleNamespace(width=8, height=8)
    can_take_input = True

    def __init__(self) -> None:
        self.inputs: list[object] = []  # what set_input got: an array of frames, or None
        self.strengths: list[float] = []

    def frames_in_chunk(self, index: int) -> int:
        return 9 if index == 0 else 12

    def start_step(self, strength: float) -> int:
        return min(range(len(self.sigmas)), key=lambda k: (abs(self.sigmas[k] - strength), k))

    def set_strength(self, state, strength: float) -> float:
        self.strengths.append(strength)
        return strength

    def set_input(self, state, frames) -> None:
        self.inputs.append(None if frames is None else frames.numpy())


def setup(strength: float = 0.6):
    clock = ManualClock(100.0)
    gen, sched = FakeGen(), Scheduler(SchedulerConfig(utilization_target=float("inf")))
    woken = []
    stage = InputStage(gen, sched, clock, lambda: woken.append(clock.now), latency_s=0.5)
    frames = InputFrames(8, 8, FPS, clock=clock)
    k, _ = stage.start_step(strength)
    assert sched.admit(StreamRequest("a", FPS, input_start_step=k), clock.now).accepted
    stage.open("a", frames, state=None, strength=strength, fps=FPS)
    return clock, gen, sched, stage, frames, woken


def push(frames: InputFrames, clock: ManualClock, values, capture0: float) -> None:
    for i, v in enumerate(values):
        frames.push_frame(np.full((8, 8, 3), v, np.uint8), capture0 + i / FPS)
        clock.now += 1 / FPS


def test_a_chunk_is_released_by_its_last_frame_and_its_frames_go_to_set_input():
    clock, gen, sched, stage, frames, woken = setup()
    missing_at = stage.poll(clock.now)
    assert sched.next(clock.now) is None
    # the first chunk's last slot + half the latency, and the wait for a camera's first frame
    assert missing_at == pytest.approx(100.0 + FIRST_FRAME_WAIT_S + 9 / FPS + 0.25)
    push(frames, clock, range(9), capture0=7.0)
    assert woken  # the ninth frame woke the engine
    assert stage.poll(clock.now) is None
    plan = sched.next(clock.now)
    assert plan is not None and plan.chunk_index == (0,)
    assert frames.play_from == pytest.approx(clock.now + 0.5 + 3 / FPS)
    sched.observe_stage(Stage.INPUT, 1.0)  # (the seed; the chunk's own sample follows)
    stage.before_denoise("a", None, 0)
    assert len(gen.inputs) == 1 and gen.inputs[0].shape == (9, 8, 8, 3)
    assert [int(f[0, 0, 0]) for f in gen.inputs[0]] == list(range(9))
    assert gen.strengths[-1] == 0.625  # the release's strength, snapped
    stage.before_denoise("a", None, 0)  # a restarted chunk keeps its input: not taken again
    assert len(gen.inputs) == 1
    header = stage.header("a", SimpleNamespace(index=0, input="frames"))
    assert header["input"] == "frames" and header["strength"] == 0.625
    assert header["capture_ms"] == pytest.approx([(7.0 + i / FPS) * 1000 for i in range(9)])


def test_an_input_that_stops_is_released_as_missing_and_runs_every_step():
    clock, gen, sched, stage, frames, _ = setup()
    push(frames, clock, range(9), capture0=7.0)
    stage.poll(clock.now)
    plan = sched.next(clock.now)
    stage.before_denoise("a", None, 0)
    sched.complete(plan, clock.now, 0.01)  # run chunk 0 to its commit
    for _ in range(10):
        plan = sched.next(clock.now)
        if plan is None:
            break
        sched.complete(plan, clock.now, 0.01)
    assert sched.releasable("a") == 1
    # nothing more comes: chunk 1 (slots 9..20) waits until its last slot's time + 0.25 s, then runs without
    due = stage.poll(clock.now)
    assert due is not None and due > clock.now
    clock.now = due - 0.01
    assert stage.poll(clock.now) is not None and sched.releasable("a") == 1
    clock.now = due
    stage.poll(clock.now)
    assert sched.releasable("a") is None  # released (as missing)
    plan = sched.next(clock.now)
    assert plan.chunk_index == (1,) and plan.steps == (4,)
    stage.before_denoise("a", None, 1)
    assert gen.inputs[-1] is None  # text-to-video
    assert stage.header("a", SimpleNamespace(index=1, input="missing")) == {
        "input": "missing", "capture_ms": None, "strength": 0.625}


def test_a_camera_that_goes_off_has_its_next_chunk_released_in_time_to_run_every_step():
    # exact costs: a forward 1/16 s, the output stage 1/16 s, the start margin 0.25 s (issue 41)
    clock, gen = ManualClock(100.0), FakeGen()
    sched = Scheduler(SchedulerConfig(initial_forward_s=1 / 16, start_margin_s=0.25, degrade_steps=(3, 2),
                                      degrade_margin_s=0.125, confirm_chunks=0))
    sched.seed_stage(Stage.OUTPUT, 1 / 16)
    stage = InputStage(gen, sched, clock, lambda: None, latency_s=0.5)
    frames = InputFrames(8, 8, FPS, clock=clock)
    k, _ = stage.start_step(0.6)
    assert sched.admit(StreamRequest("a", FPS, input_start_step=k), clock.now).accepted
    stage.open("a", frames, state=None, strength=0.6, fps=FPS)

    def run_chunk(index: int) -> list:
        plans = []
        for _ in range(10):
            plan = sched.next(clock.now)
            if plan.step == 0:
                stage.before_denoise("a", None, index)
            clock.now += 1 / 16
            sched.complete(plan, clock.now, 1 / 16)
            plans.append(plan)
            if plan.kind.value == "commit":
                return plans
        raise AssertionError(plans)

    push(frames, clock, range(9), capture0=7.0)  # the camera's first chunk, then it goes off
    assert stage.poll(clock.now) is None  # released by its last frame at 100.5625
    run_chunk(0)  # 2 forwards from step 2 and the commit: delivered at 100.75, played from 101.25, dry at 101.8125
    # chunk 1 has no frame: let go when its viewer's buffer leaves it its lead (0.3125 s predicted, 0.25 s margin),
    # the output stage and the 2 forwards text-to-video runs beyond step 2; by its last slot's time + half the input
    # latency (101.5625) it would have had 0.25 s for 0.3125 s of forwards
    due = stage.poll(clock.now)
    assert due == pytest.approx(101.8125 - (0.3125 + 0.25) - 1 / 16 - 2 / 16)
    clock.now = due - 0.01
    assert stage.poll(clock.now) == pytest.approx(due) and sched.releasable("a") == 1
    clock.now = due
    assert stage.poll(clock.now) is None and not stage.streams["a"].releases[1].frames  # released as missing
    plans = run_chunk(1)
    assert [p.steps for p in plans] == [(4,)] * 5 and gen.inputs[-1] is None  # every step, text-to-video
    stats = sched.stats(clock.now)
    assert clock.now + 1 / 16 <= 101.8125 and (stats.degraded_chunks, stats.stalls, stats.late) == (0, 0, False)


def test_strength_changes_apply_to_the_next_release_and_a_stream_without_input_has_none():
    clock, gen, sched, stage, frames, _ = setup(strength=1.0)
    assert stage.set_strength("a", 0.4) == 0.357
    push(frames, clock, range(9), capture0=3.0)
    stage.poll(clock.now)
    assert stage.streams["a"].releases[0].start_step == 3
    with pytest.raises(ValueError, match="no input"):
        stage.set_strength("b", 0.5)
    assert stage.header("b", SimpleNamespace(index=0)) is None
    gen.can_take_input = False
    assert "no encoder" in stage.refusal()
    assert "--parallel" in InputStage(gen, sched, clock, lambda: None, 0.5, parallel=True).refusal()
