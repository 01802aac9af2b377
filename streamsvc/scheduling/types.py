"""The scheduling package's shared types: its errors, stages, requests, plans and answers (the forward kinds are
models.work.WorkKind, the generator's own).

Plans and answers are frozen dataclasses with a comment on every field: the engine runs
a plan, it does not decide. Nothing here depends on another module of the package.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import NamedTuple

from models.work import WorkKind

RECACHE_STAGE = -1  # Plan.step of a RECACHE forward: it comes before a chunk's step 0
EPS_S = 1e-9  # tolerance on time comparisons, so a wake-up at exactly the computed time is runnable


class SchedulerError(RuntimeError):
    """The scheduler was used against its contract (unknown stream, plan not outstanding, ...)."""


class Stage(enum.Enum):
    """The stages a chunk passes, each with its own cost per chunk and capacity (admission checks them all)."""

    DEVICE = "device"  # the forwards (the scheduler's CostModel by kind and batch)
    OUTPUT = "output"  # frames to the host, x264 and packing, on the output workers
    SEND = "send"  # the transports' send, on the event loop
    INPUT = "input"  # a stream's input video (issue 35): decode, scale and encode; streams with input only


@dataclass(frozen=True)
class StreamRequest:
    stream_id: str  # unique among the scheduler's streams
    fps: float  # playback rate of the stream's video
    first_chunk_frames: int = 9  # frames the first chunk delivers (a causal VAE decodes its first latent frame to 1)
    chunk_frames: int = 12  # frames every later chunk delivers
    # Input video (issue 35): the step its chunks start at (the stream's strength, snapped); None: no input
    input_start_step: int | None = None
    input_latency_s: float = 0.5  # with input: a chunk is due this long after its last input frame came (its release)
    prompt: str = ""  # its opening prompt (version 0): the text of the plans that run under it
    # a style (streamsvc/engine/styles.py): the extra share of each of its forwards it costs on the device (0: none)
    style_cost: float = 0.0

    @property
    def first_delivery(self) -> tuple[int, int]:
        """(chunks, frames) of what its viewer gets first: a first chunk of a single frame (chunks of one latent
        frame) goes out with the second (streamsvc/engine/engine.py `_handed_over`): alone, it would play and stall."""
        if self.first_chunk_frames == 1:
            return 2, 1 + self.chunk_frames
        return 1, self.first_chunk_frames

    def __post_init__(self) -> None:
        if not (self.style_cost >= 0 and math.isfinite(self.style_cost)):
            raise ValueError(f"stream {self.stream_id!r}: style_cost={self.style_cost} must be a finite share >= 0")
        if not (self.fps > 0 and math.isfinite(self.fps)):
            raise ValueError(f"stream {self.stream_id!r}: fps={self.fps} must be a finite rate > 0")
        if self.first_chunk_frames < 1 or self.chunk_frames < 1:
            raise ValueError(
                f"stream {self.stream_id!r}: first_chunk_frames={self.first_chunk_frames} and "
                f"chunk_frames={self.chunk_frames} must both be >= 1"
            )


@dataclass(frozen=True)
class Admission:
    accepted: bool  # whether the stream was added
    reason: str | None  # why it was refused, with the numbers; None when accepted
    predicted_load: float  # busy fraction of the device the admitted streams need, the new one included if accepted
    # admit_viewer: the stream's modelled buffer when the viewer was admitted (its viewer with the least), seconds
    buffered_s: float | None = None


@dataclass(frozen=True)
class Plan:
    kind: WorkKind  # the forward to run
    stream_ids: tuple[str, ...]  # 1..max_batch streams, all at the same kind and step, most urgent first
    # DENOISE: step index 0..denoise_steps-1 (0 starts a fresh chunk, discarding any partial one);
    # COMMIT: denoise_steps; RECACHE: -1 (RECACHE_STAGE).
    step: int
    restart: tuple[bool, ...]  # per stream: True when this plan abandons the stream's partial chunk for its new prompt
    # Per stream: the prompt version the forward runs under (0 = the opening prompt, n = the n-th set_prompt).
    prompt_seqs: tuple[int, ...]
    chunk_index: tuple[int, ...]  # per stream: index of the chunk this forward belongs to (0 = the first chunk)
    # Per stream: the denoising steps its chunk runs with (denoise_steps, fewer when degraded; RECACHE: those
    # the chunk after it would run with now). A COMMIT's `step` is denoise_steps whatever a degraded chunk's count.
    steps: tuple[int, ...]
    # Per stream: the text of the prompt `prompt_seqs` names (what a RECACHE, or a chunk under a new prompt, needs:
    # the engine applies what the plan says and keeps no prompts of its own)
    prompts: tuple[str, ...] = ()


@dataclass(frozen=True)
class StreamStats:
    stream_id: str  # the stream
    buffered_s: float  # modelled (or last observed, then drained) video in the viewer's buffer
    slack_s: float  # what the ranking uses: time until the buffer runs dry - estimated work its next chunk needs
    runnable: bool  # whether it wants a forward now (False above its lead or at the cap)
    paused: bool  # the viewer paused: nothing is consumed
    chunks_delivered: int  # chunks committed and delivered
    stalls: int  # stalls modelled (count of times the buffer ran dry while playing)
    stall_s: float  # modelled stall time, an ongoing stall included
    ttff_s: float | None  # admission -> first chunk delivered; None until then
    prompt_pending: bool  # a newer prompt than the one its cache or its next chunk was computed under
    in_flight_s: float  # video committed but not yet delivered (counts toward the start rule and the cap)
    lead_s: float  # a fresh chunk starts when buffered + in flight falls to this (the start rule)
    latency_p95_s: float | None  # p95 of its recent chunk latencies; None before the first delivery
    degraded_chunks: int = 0  # chunks committed with fewer denoising steps than the schedule's
    # lateness its own client caused (its viewer's reports, its input missing or late): charged to it, not overload
    client_late: int = 0


@dataclass(frozen=True)
class SchedulerStats:
    streams: int  # admitted streams
    queue_length: int  # streams that want a forward now
    predicted_load: float  # busy fraction of the device the admitted streams need (what admission checks)
    stalls: int  # modelled stalls, summed over streams
    stall_s: float  # modelled stall time, summed over streams
    forward_cost_s: dict[WorkKind, float]  # current cost estimate of one batch-1 forward, per kind
    per_stream: tuple[StreamStats, ...]  # in admission order
    degraded_chunks: int = 0  # summed over the admitted streams
    pressure: bool = False  # a chunk was degraded within pressure_hold_s: no stream steers ahead of its lead
    # predicted busy fraction of each stage (the device's is predicted_load), what admission checks
    stage_load: dict[Stage, float] = field(default_factory=dict)
    late: bool = False  # a stream was late within late_hold_s: admission is closed (the closed loop)
    parked: int = 0  # streams parked (not counted in `streams`)
    client_late: int = 0  # lateness the streams' own clients caused, summed over the admitted streams (never overload)


class Late(NamedTuple):
    """A stream that was late (a stall, a degraded chunk, a cheaper encode): what closes admission for a while."""

    at: float  # when
    stream_id: str  # which stream
    what: str  # what happened, for the refusal's text


@dataclass(frozen=True)
class StreamLoad:
    """What admission knows of one admitted stream: the load it puts on each stage, and whether it is starting."""

    request: StreamRequest  # its rate and chunk sizes
    viewers: int = 1  # connections each of its chunks is sent to (its steerer and its watchers)
    chunks_delivered: int = 0  # chunks that reached its viewer (fewer than confirm_chunks: it is still starting)
    admitted_at: float = 0.0  # when it was admitted
