"""The per-stream state the scheduler keeps, and the view of a stream's next forward.

`ScheduledStream` is one admitted stream: its request, its viewer's buffer (`PlaybackModel`, with
the server's own figure beside the one its viewer's reports may lower), its chunk in progress,
its prompt versions, its chunks in flight, its recent chunk latencies and the lateness its
own client caused (`client_late`: charged to it, never read as the server's overload). The
registry (`Scheduler`) owns the streams; the planner advances them; admission sees each
through `load`. `NextWork` is what the planner would run next for a
stream and how urgent it is; the ranking sorts on it.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from models.work import WorkKind

from .playback import PlaybackModel
from .types import StreamLoad, StreamRequest


@dataclass(frozen=True)
class InFlight:
    """A committed chunk on its way to the viewer (the transports have not had it yet)."""

    frames: int  # frames the chunk holds
    due_at: float  # when the chunk became due (its latency runs from here to its delivery)
    sampled: bool  # its latency is a sample of the start rule (it started due, not running ahead)
    play_from: float | None = None  # its viewer starts playing it no earlier than this (a first chunk of input video)
    missing: bool = False  # input video: it ran without input (its input was missing): its lateness is its client's
    # input video with frames: its release + input_latency_s, by when the server owes it to its viewer (None: no input)
    owed_at: float | None = None
    cut: bool = False  # a new prompt's first chunk, which cuts: its viewer holds it alone once it arrives


@dataclass
class ScheduledStream:
    """One admitted stream's state (parked or not)."""

    request: StreamRequest  # what was admitted
    order: int  # admission sequence number (fifo and round robin order)
    admitted_at: float  # time of admission
    playback: PlaybackModel  # the viewer's buffer
    latencies: deque[float]  # the most recent chunk latencies (due -> delivered), at most latency_window
    step: int = 0  # next denoise step of the chunk in progress; 0: none in progress; denoise_steps: COMMIT is next
    chunks_done: int = 0  # chunks committed (delivered or in flight)
    prompt_seq: int = 0  # the prompt version the planner steers to (the newest planned; see new_prompt)
    cache_seq: int = 0  # prompt version the KV cache was last computed under
    chunk_seq: int = 0  # prompt version the chunk in progress (or, between chunks, the last one) runs under
    # newest prompt version a chunk was already made without: past its cache's, the next fresh chunk recaches (a
    # prompt waits one chunk at most, however many come meanwhile)
    deferred_seq: int = 0
    shown_seq: int = 0  # prompt version of the last committed chunk (a newer one's first chunk cuts, with prompt_cut)
    after_cut: bool = False  # its last commit was a cut and no chunk has started since: the next runs ahead too
    first_delivered_at: float | None = None  # time the first chunk was delivered
    in_flight: deque[InFlight] = field(default_factory=deque)  # committed, not yet delivered, oldest first
    chunk_due_at: float | None = None  # when the chunk being made became due; None until its first forward completes
    chunk_sampled: bool = True  # the chunk being made started due (at or under the lead), so its latency is a sample
    last_commit_at: float = 0.0  # time of the last COMMIT (admission before the first): no chunk is due before it
    fresh_samples: int = 0  # latency samples taken since the last admission (of any stream)
    prompt_at: float = 0.0  # when `prompt_seq` was planned
    latest_seq: int = 0  # the newest prompt version given out (one per set_prompt)
    waiting_seq: int | None = None  # a prompt that waits for the next commit (`new_prompt`)
    prompted_since_chunk: bool = False  # a prompt was planned since the last commit: a newer one waits
    prompt_texts: dict[int, str] = field(default_factory=dict)  # by version: those a plan may still run under (<= 5)
    steps: int = 0  # denoising steps of the chunk in progress (set by each of its DENOISE forwards: it may be cut)
    degraded: int = 0  # chunks committed with fewer steps than the schedule's
    viewers: int = 1  # connections each of its chunks is sent to (its steerer and its watchers): the send's load
    parking: bool = False  # held for parking: no new chunk starts, the one in progress is committed (see `hold`)
    # input video (issue 35): by chunk index, the released chunks' (start step, release time, with frames: not
    # missing); a chunk of a stream with input starts only once released (see planner)
    releases: dict[int, tuple[int, float, bool]] = field(default_factory=dict)
    # lateness its own client caused (a viewer's report, input missing or late), charged to it, not to the server
    client_late: int = 0
    last_missing: bool = False  # the chunk delivered last ran without input (a cheaper encode of it is the client's)

    @property
    def stream_id(self) -> str:
        """The stream's id (its request's)."""
        return self.request.stream_id

    @property
    def has_input(self) -> bool:
        """The stream takes input video: its chunks start once released, at their start step."""
        return self.request.input_start_step is not None

    def released(self) -> bool:
        """Its chunk in progress (or next one) may run: released by its input, or a stream without input."""
        return not self.has_input or self.chunks_done in self.releases

    def start_step(self) -> int:
        """The step its chunk in progress (or next one) starts at: 0 but for a chunk with input frames."""
        return self.releases.get(self.chunks_done, (0, 0.0, False))[0]

    def forwards(self, steps: int) -> int:
        """DENOISE forwards of its chunk in progress (or next one) run with `steps` (the schedule's step it ends at:
        the full count, or a degraded one): from its start step on, at least one."""
        k = self.start_step()
        return max(steps, k + 1) - k

    @property
    def chunks_delivered(self) -> int:
        """Chunks committed and delivered to the viewer (those in flight not counted)."""
        return self.chunks_done - len(self.in_flight)

    @property
    def load(self) -> StreamLoad:
        """What admission knows of the stream."""
        return StreamLoad(self.request, self.viewers, self.chunks_delivered, self.admitted_at)

    def next_chunk_s(self) -> float:
        """Video its next chunk holds, in seconds (the first chunk is shorter)."""
        frames = self.request.first_chunk_frames if self.chunks_done == 0 else self.request.chunk_frames
        return frames / self.request.fps

    def in_flight_s(self) -> float:
        """Video committed but not yet delivered, in seconds."""
        return sum(c.frames for c in self.in_flight) / self.request.fps

    def new_prompt(self, text: str, now: float) -> int:
        """A prompt arrives (Scheduler.set_prompt): its version. Planned at once if none was since the last commit,
        else it waits for the next one, replacing any that waited."""
        self.latest_seq += 1
        self.prompt_texts[self.latest_seq] = text
        if self.waiting_seq is not None:  # replaced before it was planned
            del self.prompt_texts[self.waiting_seq]
        self.waiting_seq = None
        if self.prompted_since_chunk:
            self.waiting_seq = self.latest_seq
        else:
            self._plan_prompt(self.latest_seq, now)
        return self.latest_seq

    def chunk_committed(self, now: float) -> None:
        """A chunk was committed (or the stream comes back from parking): a prompt that waited is planned now."""
        waiting, self.waiting_seq = self.waiting_seq, None
        if waiting is not None:
            self._plan_prompt(waiting, now)
        else:
            self.prompted_since_chunk = False

    def _plan_prompt(self, version: int, now: float) -> None:
        # the texts a plan may still run under: the cache's, the chunk's, the one planned before (a recache of it
        # may be under way) and this one; those planned between and never run are gone too (under a flood a stream
        # may run chunks under its cache's prompt while newer ones are planned: a text each, for its life)
        live = {self.cache_seq, self.chunk_seq, self.prompt_seq, version}
        self.prompt_seq, self.prompt_at, self.prompted_since_chunk = version, now, True
        for old in [v for v in self.prompt_texts if v not in live]:
            del self.prompt_texts[old]

    def prompt_pending(self) -> bool:
        """A newer prompt than the one its cache or its chunk in progress was computed under."""
        if self.step > 0:
            return self.prompt_seq > self.chunk_seq
        return self.chunks_done > 0 and self.prompt_seq > self.cache_seq

    def recache_pending(self) -> bool:
        """Its cache holds committed frames computed under an older prompt: its next fresh chunk needs a RECACHE."""
        return self.chunks_done > 0 and self.prompt_seq > self.cache_seq

    def steering(self) -> bool:
        """No chunk started yet under the newest prompt (a stream with committed frames), or none since the chunk that
        cut to it (its viewer will hold that chunk alone: the next one runs ahead to the cap too)."""
        return self.chunks_done > 0 and (self.prompt_seq > self.chunk_seq or self.after_cut)

    def dry_at(self) -> float | None:
        """By the server's own account (`PlaybackModel.own`, not its viewer's reports), when its viewer runs dry
        unless its newest chunk in flight arrives: its buffer plus the chunks in flight before that one, and for a
        chunk of input video no earlier than its release + input_latency_s (input that came late is its client's);
        None while it is not playing (not started or paused)."""
        dry_at = (self.playback.own or self.playback).dry_at()
        if dry_at is None:
            return None
        dry_at += sum(c.frames for c in list(self.in_flight)[:-1]) / self.request.fps
        owed_at = self.in_flight[-1].owed_at if self.in_flight else None
        return dry_at if owed_at is None else max(dry_at, owed_at)

    def server_dry_in(self, now: float) -> float:
        """By the server's own account, how long until its next chunk (the one in progress, or the next one) must
        reach its viewer: its buffer and its chunks in flight, no earlier than the chunk's release +
        input_latency_s for a chunk with input frames; inf for a chunk whose input is missing (its lateness is its
        client's) or a viewer not playing (nothing stalls)."""
        own = self.playback.own or self.playback
        release = self.releases.get(self.chunks_done)
        if own.paused or (release is not None and not release[2]):
            return math.inf
        dry_at = own.dry_at()
        if dry_at is None and not self.in_flight:
            return math.inf
        dry_in = (0.0 if dry_at is None else dry_at - now) + self.in_flight_s()
        if release is not None:
            dry_in = max(dry_in, release[1] + self.request.input_latency_s - now)
        return dry_in


@dataclass(frozen=True)
class NextWork:
    """What a stream would run next, how urgent it is, and whether it may start now (see planner)."""

    kind: WorkKind  # the stream's next forward
    step: int  # Plan.step of that forward
    restart: bool  # it abandons a partial chunk
    prompt_seq: int  # prompt version it runs under
    remaining_s: float  # estimated time of the forwards left until its next chunk is committed, this one included
    chunk_forwards_left: int  # DENOISE + COMMIT forwards left of that chunk (a RECACHE not counted)
    slack_s: float  # time until its buffer (in flight included) runs dry (as the policy counts it) minus remaining_s
    runnable: bool  # the start rule and the cap allow it (a RECACHE adds no video and is always runnable)
    due: bool  # buffered + in flight is at or under the stream's lead: needed work, not work ahead
    steps: int  # denoising steps of its chunk (fewer than denoise_steps: degraded)
