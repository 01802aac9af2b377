"""The input stage's warm-up (streamsvc/inputs/stage.py `seed_input_stage`) on the CPU with a spy encoder: the encoder
runs on both chunk shapes a stream gives it before serving, on a throwaway causal run, the INPUT seed comes from
later chunks, and a device too slow for --input-latency is said at warm-up."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import torch

from models.encoder import EncoderState
from models.work import WorkKind
from streamsvc.inputs.stage import seed_input_stage
from streamsvc.scheduling import Scheduler, SchedulerConfig, Stage

SETUP_S = 0.2  # what the spy's first call of a shape costs more (cuDNN's per-shape set-up on a GPU)
RUN_START_S = 0.1  # what a chunk that starts a causal run costs (a first chunk, or a run restarted)
LATER_S = 0.01  # what a later chunk of a run costs


class SpyEncoder:
    """Records every call (frames, the state's frames before, the state); costs RUN_START_S for a chunk that starts
    a run, LATER_S for a later one, and SETUP_S more the first time it sees a (frame count, run start) shape."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, EncoderState]] = []
        self.states: list[EncoderState] = []

    def init_state(self) -> EncoderState:
        self.states.append(EncoderState())
        return self.states[-1]

    def encode(self, frames: torch.Tensor, state: EncoderState) -> torch.Tensor:
        assert frames.dtype == torch.uint8 and tuple(frames.shape[1:]) == (16, 16, 3)
        shape = (frames.shape[0], state.frames_in == 0)
        seen = any((n, before == 0) == shape for n, before, _ in self.calls)
        self.calls.append((frames.shape[0], state.frames_in, state))
        state.frames_in += frames.shape[0]
        time.sleep((RUN_START_S if shape[1] else LATER_S) + (0 if seen else SETUP_S))
        return torch.zeros(4, 3, 2, 2)


class FakeGen:
    """What seed_input_stage uses of a ChunkGenerator."""

    can_take_input = True
    model_cfg = SimpleNamespace(width=16, height=16)
    device = torch.device("cpu")
    sigmas = [1.0, 0.83, 0.625, 0.357]

    def __init__(self) -> None:
        self.encoder = SpyEncoder()

    def frames_in_chunk(self, index: int) -> int:
        return 9 if index == 0 else 12

    def start_step(self, strength: float) -> int:
        return min(range(len(self.sigmas)), key=lambda k: (abs(self.sigmas[k] - strength), k))


def test_warm_up_runs_the_encoder_on_both_chunk_shapes_and_seeds_from_later_chunks():
    gen, sched = FakeGen(), Scheduler(SchedulerConfig())
    seconds = seed_input_stage(gen, sched, camera=(160, 120))
    calls = gen.encoder.calls
    # one throwaway run: a first chunk (9 frames, a fresh state), then later chunks (12) of the same run
    assert len(gen.encoder.states) == 1 and all(state is gen.encoder.states[0] for _, _, state in calls)
    assert [(n, before) for n, before, _ in calls[:2]] == [(9, 0), (12, 9)]
    assert all(n == 12 and before > 0 for n, before, _ in calls[2:]) and len(calls) >= 3
    # the seed: a later chunk's decode, scale and encode (not a run's first chunk, nor a shape's first call)
    assert LATER_S <= seconds < RUN_START_S
    assert sched.stage_costs.estimate(Stage.INPUT) == seconds


def test_warm_up_warns_when_one_stream_with_input_cannot_meet_the_input_latency(caplog):
    def warned(commit_s: float) -> list[str]:
        gen, sched = FakeGen(), Scheduler(SchedulerConfig())
        sched.seed_cost(WorkKind.DENOISE, 1, 0.05)
        sched.seed_cost(WorkKind.COMMIT, 1, commit_s)
        sched.seed_stage(Stage.OUTPUT, 0.01)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="streamsvc.engine"):
            seed_input_stage(gen, sched, camera=(160, 120), latency_s=0.5)
        return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]

    assert warned(commit_s=0.05) == []  # a chunk in about 0.2 s: fine
    [line] = warned(commit_s=0.6)  # the commit (with its decode) alone outlasts 0.5 s
    assert "strength 0.625 (the default)" in line and "--input-latency is 0.50 s" in line
    assert "serve with --input-latency" in line and "--decoder taehv" in line
