"""Which stream's forward runs next: a pure, playback-aware scheduler.

No asyncio, no torch, no threads, no clock: every call that depends on time takes
`now` (float seconds, any monotonic origin), so the scheduler is tested by feeding
it events and asserting exact plans (sans-I/O, like vLLM's `schedule()` /
`update_from_output()`).

The unit of work is one forward. A chunk is `denoise_steps` DENOISE forwards
(steps 0..n-1) and one COMMIT forward (which writes the chunk's K/V and decodes
it). A new prompt adds one RECACHE forward before the next chunk of a stream whose
cache already holds committed frames. The engine drives it:

    plan = sched.next(now)                  # None: nothing to start; sleep until wake_at() or an event
    ... launch the forward(s) of `plan`, each stream under plan.prompt_seqs[i] ...
    sched.complete(plan, now, None, deliver=False)  # the state advances; the cost is not known yet
    ... later, from the forward's CUDA events:  sched.observe_cost(plan.kind, len(plan.stream_ids), seconds)
    ... a COMMIT's frames reach the transports: sched.delivered(stream_id, now)

(`complete(plan, now, elapsed_s)` with the default deliver=True does all three at
once, for a caller that runs a forward to its end before deciding the next one.)
A committed chunk not yet delivered is in flight: its frames count toward the
start rule, the cap and the slack as if buffered, but the viewer's buffer model
is credited only by `delivered`. Each stream's viewer buffer is modelled
(DESIGN.md "Measuring a stream": playback starts when the first chunk arrives,
then consumes frames at fps and stalls when empty) from delivered chunks and
`now`, or set exactly by `observe_buffer`.

When a stream's next chunk may start (the start rule). Its lead is the `lead_percentile`
(the median by default) of its last `latency_window` chunk latencies plus `start_margin_s`,
and `late_margin_s` more while any stream stalled within `late_margin_hold_s`; a chunk's latency runs
from the moment the rule made it due (or its first forward was issued, if earlier)
to its delivery, so it includes queueing behind other streams' work and a RECACHE
pending then. Only chunks that started due are samples (one running ahead, see
below, had time to spare and waited behind due ones). While a stream has fewer than
`latency_min_samples` samples taken since the last admission (an admission adds
queueing the older samples did not see), its latency is the larger of that p95 and
a prediction: one chunk of every admitted stream (batched by `max_batch`; its own
included) plus its own pending RECACHE.
A fresh chunk (step 0) is runnable when buffered + in flight <= lead, and only when
buffered + in flight + the chunk <= `buffer_cap_s`, which bounds everything: how far
ahead a stream runs, so how old its buffered video is when a new prompt arrives
(steering latency); it is not what keeps a stream fed, the lead is. A stream with a
prompt pending (no chunk yet started under its newest prompt) may start as soon as
the cap allows: running ahead under the new prompt is what its viewer wants. A chunk
in progress goes on while under the cap; a RECACHE is always runnable (no video).
`start_margin_s=math.inf` turns the rule off: every stream runs ahead to the cap.

Slack = time until the buffer (in flight included) runs dry - estimated time of the
forwards the stream's next chunk still needs (a pending RECACHE included). Ranking,
smallest key first, among runnable streams:

1. Streams about to stall (slack under `stall_guard_chunks` chunks of work) go
   before streams that are only working ahead, whatever the policy, and among
   them a chunk in progress goes first and keeps the device until committed, the
   one with the fewest forwards left first (two streams near empty that alternate
   forwards both deliver late). Admission bounds the average load; this guard is
   what turns that into no stalls during transients (two viewers joining at once,
   a burst of prompts), for every policy.
2. Among the others, with `chunk_granular`, a due chunk in progress (its stream at
   or under its lead) goes first too, again the fewest forwards left first:
   finishing one chunk before starting another lowers the average chunk latency,
   and the engine pays a KV-cache copy each time it switches streams. A chunk
   running ahead (steering to a new prompt, above its lead) keeps no such
   precedence: it has time to spare, a due stream may not.
3. Within each group, the policy (`SchedulerConfig.policy`):
   slack        the default. Streams already late (negative slack: newcomers,
                stalled streams, streams that cannot make it) first, the one with
                the fewest forwards left of its chunk first, so the one closest to
                delivering delivers instead of all of them advancing in lockstep;
                then streams on time, least slack first. A newcomer counts as
                running dry `startup_slack_s` after admission and a stalled stream
                as having run dry when its stall began, so both grow more urgent
                while they wait (a newcomer's first chunk goes ahead of streams
                with a healthy buffer: low TTFF, but not ahead of one about to stall).
   least_slack  the plain rule, a baseline: least slack first, a newcomer's or a
                stalled stream's buffer counting as 0 s.
   round_robin  one forward per stream in turn, in admission order (one chunk per
                stream in turn with `chunk_granular`).
   fifo         the earliest admitted stream first.

Prompts: the next chunk runs under the newest prompt, after a RECACHE when the
stream has committed frames. A chunk in progress is abandoned for the new prompt
(`restart_on_prompt`) only while the stream keeps `restart_margin_chunks` chunks
of slack after redoing it; a RECACHE that would leave the stream less slack than
`start_margin_s` (one forward at least), where skipping it would not stall it,
waits one chunk (that chunk keeps the old prompt). So a prompt does not cause a
stall; it shows up later instead.

Degrading (`degrade_steps`, e.g. (3, 2); off when empty). A playing stream whose chunk,
with all its steps, would reach the viewer less than `degrade_margin_s` before the buffer
(in flight included) runs dry runs that chunk with fewer denoising steps instead: the most
of `degrade_steps` that leave the margin, else the fewest; a chunk in progress can be cut
down to the steps it has run (its COMMIT is next). A stream with slack to spare, one not
yet playing (nothing can stall) or a paused one never degrades. For `pressure_hold_s`
after a degraded chunk the device is known to be short: streams steering to a new prompt
wait for their lead instead of running ahead, so the device's time goes to streams near
stalling; their RECACHE may start only its own cost plus the headroom before the lead
(at the lead it would not fit, and the prompt would wait a whole chunk). Plan.steps
carries the choice; the engine tags the chunk with it.

Costs (`CostModel`): the warm-up's median of each forward kind until `cost_min_samples`
are measured while serving, then the `cost_percentile` of the last `cost_window`.

Admission refuses, with the numbers and the fix, a stream whose KV cache does not
fit (the pool's reason), whose chunk does not fit the cap, whose compute would put
the predicted load over `utilization_target`, or that the start rule cannot serve:
with it admitted, the predicted lead (one chunk of every stream, batched, plus the
margin) and a chunk no longer fit under `buffer_cap_s`.

Admission counts every stage a chunk passes (`Stage`): the device (the forwards above),
the output stage (frames to the host, x264 and packing, on `output_capacity` workers) and
the transports' send (the event loop). The device's load counts the streams' prompt switches
as measured: the recaches of the last RECACHE_WINDOW_S, at a recache's cost. Each stage's cost per chunk is seeded by the
warm-up (`seed_stage`) and then follows the `cost_percentile` of what serving measures
(`observe_stage`); a stream is admitted only while every stage stays under its target.
It also listens to what viewers get (the closed loop): while any stream was late within
`late_hold_s` (a chunk delivered after its viewer's buffer ran dry, a viewer reporting an
empty buffer, a chunk degraded on the device or at the encoder: `mark_late`), nobody is
admitted. And a burst is admitted in tranches: streams that have not yet delivered
`confirm_chunks` chunks are starting, and a newcomer is admitted only while every stage
can make the starting streams' first `confirm_chunks` chunks within the first chunk's
play time with the time the admitted streams leave it; measurement confirms the room
(their chunks arrive, the costs follow them) before the next tranche.

The last resort (`overloaded`): when degradation has run out (a chunk ran with the fewest
steps it may and still did not leave the margin) and viewers still stall
(`overload_stalls` modelled stalls within `overload_window_s`), the newest stream is named
for the engine to end, rather than every viewer stalling.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from dataclasses import dataclass, field, replace

POLICIES = ("slack", "least_slack", "round_robin", "fifo")

RECACHE_STAGE = -1  # Plan.step of a RECACHE forward: it comes before a chunk's step 0
RECACHE_WINDOW_S = 10.0  # admission counts the recaches of this many past seconds as the streams' steering load
_EPS_S = 1e-9  # tolerance on time comparisons, so a wake-up at exactly the computed time is runnable


class SchedulerError(RuntimeError):
    """The scheduler was used against its contract (unknown stream, plan not outstanding, ...)."""


class Stage(enum.Enum):
    """The stages a chunk passes, each with its own cost per chunk and capacity (admission checks them all)."""

    DEVICE = "device"  # the forwards (the scheduler's CostModel by kind and batch)
    OUTPUT = "output"  # frames to the host, x264 and packing, on the output workers
    SEND = "send"  # the transports' send, on the event loop


class WorkKind(enum.Enum):
    RECACHE = "recache"  # recompute the window's K/V under a new prompt (one forward, no frames)
    DENOISE = "denoise"  # one denoising step of the chunk in progress
    COMMIT = "commit"  # write the clean chunk's K/V, decode and deliver its frames


@dataclass(frozen=True)
class SchedulerConfig:
    policy: str = "slack"  # one of POLICIES
    denoise_steps: int = 4  # DENOISE forwards per chunk (steps 0..n-1), then one COMMIT
    # Generate no further ahead: a stream whose buffered + in-flight video plus its next chunk exceeds this is
    # not runnable. It bounds steering latency (how much old video plays after a new prompt), not throughput;
    # it must hold a stream's lead plus a chunk (2 streams on an H200: ~0.75 s + 0.75 s).
    buffer_cap_s: float = 2.0
    max_batch: int = 1  # streams per forward, grouped only when their next work has the same kind and step
    # Admission keeps the predicted busy fraction of the device at or under this; math.inf turns it off
    # (and the start rule's check with it: every stream is admitted, as when measuring overload).
    utilization_target: float = 0.9
    initial_forward_s: float = 0.05  # cost of one forward of any kind until one of that kind is measured
    # A forward's cost estimate is this percentile of its kind's last `cost_window` measurements, once there
    # are `cost_min_samples` of them (before: the warm-up's figure, `seed_cost`).
    cost_percentile: float = 0.9
    cost_window: int = 64
    cost_min_samples: int = 8
    restart_on_prompt: bool = True  # abandon a chunk in progress for a new prompt when the stream's slack allows it
    # Slack a stream must keep after a restart, in chunks of work (others' forwards interleave with its own).
    restart_margin_chunks: float = 2.0
    startup_slack_s: float = 0.0  # policy 'slack': a newcomer ranks as if its buffer ran dry this long after admission
    # Every policy: streams with less slack than this many chunks of work go first, chunks in progress
    # first, before streams that are only working ahead; None: off.
    stall_guard_chunks: float | None = 1.0
    # A fresh chunk starts when buffered + in-flight video falls to its p95 chunk latency plus this margin
    # (what the estimates miss: jitter beyond the p95, the hand-over, a forward queued ahead on the device;
    # a RECACHE must leave this much slack too); math.inf: no start rule, every stream runs ahead to the cap.
    start_margin_s: float = 0.175
    latency_window: int = 32  # chunk latencies per stream the lead's percentile is taken over (the most recent ones)
    # The start rule's lead is this percentile of the stream's recent chunk latencies, plus start_margin_s.
    lead_percentile: float = 0.5
    # Fewer samples than this since the last admission: the lead is at least the predicted latency.
    latency_min_samples: int = 3
    # Among streams not about to stall, a chunk in progress goes first (finish one chunk before starting another).
    chunk_granular: bool = True
    # Fewer denoising steps a chunk may run with instead of a stall, e.g. (3, 2) (the generator's
    # degraded_steps); (): never degrade. See "Degrading" in the module docstring.
    degrade_steps: tuple[int, ...] = ()
    # A chunk degrades when with all its steps it would reach the viewer with less than this to spare (what
    # the estimate misses: the hand-over, a forward already queued on the device).
    degrade_margin_s: float = 0.1
    # After a degraded chunk, for this long, streams steering to a new prompt do not run ahead of their lead.
    pressure_hold_s: float = 2.0
    # The output stage: chunks it works on at once (its workers) and the busy fraction admission keeps it under.
    output_capacity: float = 1.0
    output_target: float = 0.7
    send_target: float = 0.5  # busy fraction of the event loop admission keeps the transports' send under
    # Closed loop: no admission until every stream has been on time for this long (see `mark_late`).
    late_hold_s: float = 2.0
    # After a stall every stream's lead grows by late_margin_s until none has stalled for late_margin_hold_s: a
    # stall shows jitter the latency percentile has not seen yet (a noisy neighbour, a busy host).
    late_margin_s: float = 0.25
    late_margin_hold_s: float = 30.0
    # A stream is starting until it has delivered this many chunks; starting streams bound the next tranche (0: off).
    confirm_chunks: int = 2
    # Last resort: with degradation run out, this many modelled stalls within overload_window_s end the newest stream.
    overload_stalls: int = 4
    overload_window_s: float = 4.0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy {self.policy!r} is unknown; use one of {', '.join(POLICIES)}")
        if self.denoise_steps < 1:
            raise ValueError(f"denoise_steps={self.denoise_steps}: a chunk needs at least 1 denoising step")
        if not self.buffer_cap_s > 0:
            raise ValueError(f"buffer_cap_s={self.buffer_cap_s}: must be > 0 s (a few chunks' duration, e.g. 2.0)")
        if self.max_batch < 1:
            raise ValueError(f"max_batch={self.max_batch}: must be >= 1 (1 turns batching off)")
        if not self.utilization_target > 0:
            raise ValueError(
                f"utilization_target={self.utilization_target}: must be > 0 (e.g. 0.9; math.inf turns admission off)"
            )
        if not (self.initial_forward_s > 0 and math.isfinite(self.initial_forward_s)):
            raise ValueError(f"initial_forward_s={self.initial_forward_s}: must be a finite cost > 0 s (e.g. 0.05)")
        if not 0 < self.cost_percentile <= 1:
            raise ValueError(f"cost_percentile={self.cost_percentile}: must be in (0, 1] (e.g. 0.9)")
        if not 1 <= self.cost_min_samples <= self.cost_window:
            raise ValueError(
                f"cost_min_samples={self.cost_min_samples}, cost_window={self.cost_window}: need "
                "1 <= cost_min_samples <= cost_window (e.g. 8 and 64)"
            )
        if not (self.restart_margin_chunks >= 0 and math.isfinite(self.restart_margin_chunks)):
            raise ValueError(
                f"restart_margin_chunks={self.restart_margin_chunks}: must be a finite number >= 0 (e.g. 2.0)"
            )
        if not (self.startup_slack_s >= 0 and math.isfinite(self.startup_slack_s)):
            raise ValueError(f"startup_slack_s={self.startup_slack_s}: must be a finite number of seconds >= 0")
        guard = self.stall_guard_chunks
        if guard is not None and not (guard >= 0 and math.isfinite(guard)):
            raise ValueError(f"stall_guard_chunks={guard}: must be a finite number >= 0 (e.g. 1.0), or None for off")
        if not self.start_margin_s >= 0:
            raise ValueError(
                f"start_margin_s={self.start_margin_s}: must be >= 0 s (e.g. 0.25), or math.inf for no start rule"
            )
        if any(not 1 <= n < self.denoise_steps for n in self.degrade_steps):
            raise ValueError(
                f"degrade_steps={self.degrade_steps}: each must be in [1, {self.denoise_steps - 1}], fewer "
                f"than denoise_steps={self.denoise_steps}"
            )
        if not (self.degrade_margin_s >= 0 and math.isfinite(self.degrade_margin_s)):
            raise ValueError(f"degrade_margin_s={self.degrade_margin_s}: must be a finite number of seconds >= 0")
        if not (self.pressure_hold_s >= 0 and math.isfinite(self.pressure_hold_s)):
            raise ValueError(f"pressure_hold_s={self.pressure_hold_s}: must be a finite number of seconds >= 0")
        if not (self.output_capacity > 0 and math.isfinite(self.output_capacity)):
            raise ValueError(f"output_capacity={self.output_capacity}: must be a finite number of workers > 0")
        for name in ("output_target", "send_target"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be > 0 (e.g. 0.7; math.inf turns the check off)")
        if not (self.late_margin_s >= 0 and math.isfinite(self.late_margin_s) and self.late_margin_hold_s >= 0):
            raise ValueError(f"late_margin_s={self.late_margin_s}, late_margin_hold_s={self.late_margin_hold_s}: "
                             "must be finite numbers of seconds >= 0 (e.g. 0.25 and 10.0)")
        if not (self.late_hold_s >= 0 and math.isfinite(self.late_hold_s)):
            raise ValueError(f"late_hold_s={self.late_hold_s}: must be a finite number of seconds >= 0 (e.g. 2.0)")
        if self.confirm_chunks < 0:
            raise ValueError(f"confirm_chunks={self.confirm_chunks}: must be >= 0 chunks (e.g. 2; 0 turns tranches off)")
        if self.overload_stalls < 1 or not (self.overload_window_s > 0 and math.isfinite(self.overload_window_s)):
            raise ValueError(
                f"overload_stalls={self.overload_stalls}, overload_window_s={self.overload_window_s}: need >= 1 "
                "stall and a finite window > 0 s (e.g. 2 and 4.0)"
            )
        if not 0 < self.lead_percentile <= 1:
            raise ValueError(f"lead_percentile={self.lead_percentile}: must be in (0, 1] (e.g. 0.95)")
        if self.latency_window < 1:
            raise ValueError(f"latency_window={self.latency_window}: must be >= 1 chunk latency (e.g. 32)")
        if not 0 <= self.latency_min_samples <= self.latency_window:
            raise ValueError(
                f"latency_min_samples={self.latency_min_samples}: must be in [0, latency_window="
                f"{self.latency_window}] (e.g. 3; 0 trusts the measured p95 from the first sample)"
            )


@dataclass(frozen=True)
class StreamRequest:
    stream_id: str  # unique among the scheduler's streams
    fps: float  # playback rate of the stream's video
    first_chunk_frames: int = 9  # frames the first chunk delivers (a causal VAE decodes its first latent frame to 1)
    chunk_frames: int = 12  # frames every later chunk delivers

    def __post_init__(self) -> None:
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


@dataclass
class PlaybackModel:
    """One viewer's playback buffer, as a fluid of frames (exact for chunks that arrive whole).

    Playback starts when the first frames arrive, consumes `fps` frames per second
    unless paused, and runs dry while empty. A dry spell is a stall once it has lasted
    `grace_s`: what the viewer holds beyond the frames the model counts (0 for a
    viewer's own report; a WebRTC receiver's jitter buffer and the frame on the wire
    for a track's queue). Planning sees the dry spell at once either way.
    """

    fps: float  # consumption rate while playing
    buffered_frames: float = 0.0  # frames in the buffer at `updated_at`
    updated_at: float = 0.0  # time `buffered_frames` refers to
    started: bool = False  # the first frames have arrived
    paused: bool = False  # the viewer paused: nothing is consumed and nothing stalls
    dry_since: float | None = None  # start of the dry spell in progress, None when not dry
    grace_s: float = 0.0  # a dry spell becomes a stall once it has lasted this long (set by each report)
    dry_counted: bool = False  # the dry spell in progress has lasted grace_s: it is counted in `stalls`
    stalls: int = 0  # stalls begun so far
    closed_stall_s: float = 0.0  # duration of the stalls that have ended (past their grace)

    def advance(self, now: float) -> None:
        """Consume frames up to `now` (times before `updated_at` are ignored)."""
        if now > self.updated_at:
            if self.started and not self.paused and self.dry_since is None:
                drained = (now - self.updated_at) * self.fps
                if drained > self.buffered_frames:
                    self.dry_since = self.updated_at + self.buffered_frames / self.fps
                    self.buffered_frames = 0.0
                else:
                    self.buffered_frames -= drained
            self.updated_at = now
        self._count_dry(now)

    def deliver(self, frames: int, now: float) -> None:
        self.advance(now)
        self._end_stall(now)
        self.buffered_frames += frames
        self.started = True

    def observe(self, frames: float, now: float) -> None:
        """The viewer's buffer holds exactly `frames` at `now`."""
        self.advance(now)
        self.buffered_frames = float(frames)
        if frames > 0:
            self.started = True
            self._end_stall(now)
        elif self.started and not self.paused and self.dry_since is None:
            self.dry_since = now
            self._count_dry(now)

    def pause(self, now: float) -> None:
        self.advance(now)
        self._end_stall(now)
        self.paused = True

    def resume(self, now: float) -> None:
        self.advance(now)
        self.paused = False

    def dry_at(self) -> float | None:
        """When the buffer runs (or ran) dry if nothing more arrives; None while not draining (pure)."""
        if self.dry_since is not None:
            return self.dry_since
        if not self.started or self.paused:
            return None
        return self.updated_at + self.buffered_frames / self.fps

    def seconds(self, now: float) -> float:
        """Buffered video at `now` in seconds (pure)."""
        dry_at = self.dry_at()
        if dry_at is None:
            return self.buffered_frames / self.fps
        return max(0.0, dry_at - max(now, self.updated_at))

    def stall_count(self, now: float) -> int:
        """Stalls begun by `now`, one in progress included (pure)."""
        dry_at = self.dry_at()
        starting = not self.dry_counted and dry_at is not None and now > dry_at and now - dry_at >= self.grace_s
        return self.stalls + (1 if starting else 0)

    def stall_seconds(self, now: float) -> float:
        """Stall time by `now`, one in progress included, each past its grace (pure)."""
        dry_at = self.dry_at()
        ongoing = 0.0 if dry_at is None else max(0.0, now - dry_at - self.grace_s)
        return self.closed_stall_s + ongoing

    def _count_dry(self, now: float) -> None:
        """The dry spell in progress becomes a stall once it has lasted grace_s."""
        if self.dry_since is not None and not self.dry_counted and now - self.dry_since >= self.grace_s:
            self.dry_counted = True
            self.stalls += 1

    def _end_stall(self, now: float) -> None:
        """The dry spell in progress ends at `now` (the caller has advanced to `now`, which counted it if due)."""
        if self.dry_since is not None:
            if self.dry_counted:
                self.closed_stall_s += max(0.0, now - self.dry_since - self.grace_s)
            self.dry_since, self.dry_counted = None, False


class CostModel:
    """The cost of one forward per (kind, batch size): a high percentile of what serving measures.

    A prior (the warm-up's median through `seed`, else the first measurement) stands until `min_samples`
    forwards of that kind and size are measured; from then on the estimate is the `percentile` of the
    last `window` of them. So it follows what forwards cost under load (a throttled device, a noisy
    neighbour, an encoder competing for the CPU) and comes back down when that passes, and a run of
    fast samples cannot talk it down the way it could a moving average.
    """

    def __init__(self, initial_forward_s: float, percentile: float = 0.9, window: int = 64, min_samples: int = 8) -> None:
        self.initial_forward_s = initial_forward_s
        self.percentile, self.min_samples = percentile, min_samples
        self._samples: dict[tuple[WorkKind, int], deque[float]] = {}
        self._window = window
        self._estimate: dict[tuple[WorkKind, int], float] = {}  # kept current by seed and observe

    def estimate(self, kind: WorkKind, batch: int = 1) -> float:
        """The (kind, batch) cost. A batch size not measured yet costs what its streams cost one by one
        (batch x the batch-1 cost, else the initial guess): no gain is counted before it is seen."""
        if (kind, batch) in self._estimate:
            return self._estimate[(kind, batch)]
        return batch * self._estimate.get((kind, 1), self.initial_forward_s)

    def seed(self, kind: WorkKind, batch: int, seconds: float) -> None:
        """A prior for (kind, batch), e.g. the warm-up's median; measurements replace it once there are enough."""
        key = (kind, batch)
        self._samples.pop(key, None)
        self._estimate[key] = seconds

    def observe(self, kind: WorkKind, batch: int, elapsed_s: float) -> None:
        key = (kind, batch)
        samples = self._samples.setdefault(key, deque(maxlen=self._window))
        samples.append(elapsed_s)
        if len(samples) >= self.min_samples:
            self._estimate[key] = _percentile(samples, self.percentile)
        else:
            self._estimate.setdefault(key, elapsed_s)


@dataclass(frozen=True)
class _InFlight:
    frames: int  # frames the chunk holds
    due_at: float  # when the chunk became due (its latency runs from here to its delivery)
    sampled: bool  # its latency is a sample of the start rule (it started due, not running ahead)


@dataclass
class _Stream:
    request: StreamRequest  # what was admitted
    order: int  # admission sequence number (fifo and round robin order)
    admitted_at: float  # time of admission
    playback: PlaybackModel  # the viewer's buffer
    latencies: deque[float]  # the most recent chunk latencies (due -> delivered), at most latency_window
    step: int = 0  # next denoise step of the chunk in progress; 0: none in progress; denoise_steps: COMMIT is next
    chunks_done: int = 0  # chunks committed (delivered or in flight)
    prompt_seq: int = 0  # latest prompt version (number of set_prompt calls)
    cache_seq: int = 0  # prompt version the KV cache was last computed under
    chunk_seq: int = 0  # prompt version the chunk in progress (or, between chunks, the last one) runs under
    deferred_seq: int = 0  # newest prompt version a chunk was already made without (a prompt waits one chunk at most)
    first_delivered_at: float | None = None  # time the first chunk was delivered
    in_flight: deque[_InFlight] = field(default_factory=deque)  # committed, not yet delivered, oldest first
    chunk_due_at: float | None = None  # when the chunk being made became due; None until its first forward completes
    chunk_sampled: bool = True  # the chunk being made started due (at or under the lead), so its latency is a sample
    last_commit_at: float = 0.0  # time of the last COMMIT (admission before the first): no chunk is due before it
    fresh_samples: int = 0  # latency samples taken since the last admission (of any stream)
    prompt_at: float = 0.0  # time of the latest set_prompt
    steps: int = 0  # denoising steps of the chunk in progress (set by each of its DENOISE forwards: it may be cut)
    degraded: int = 0  # chunks committed with fewer steps than the schedule's
    viewers: int = 1  # connections each of its chunks is sent to (its steerer and its watchers): the send's load
    parking: bool = False  # held for parking: no new chunk starts, the one in progress is committed (see `hold`)


@dataclass(frozen=True)
class _Work:
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


@dataclass(frozen=True)
class _Outstanding:
    plan: Plan  # handed out by next(), not yet completed or cancelled
    orders: tuple[int, ...]  # admission order of each of its streams (a re-admitted id is another stream)
    # Per stream: when its chunk became due, for a forward that starts a chunk (RECACHE, step 0); else None.
    due_at: tuple[float | None, ...]
    due: tuple[bool, ...]  # per stream: at or under its lead when the plan was made (see _Work.due)


def _percentile(samples, q: float) -> float | None:
    """Nearest-rank `q` percentile (q in (0, 1]; None for no samples)."""
    if not samples:
        return None
    ordered = sorted(samples)
    return ordered[math.ceil(q * len(ordered)) - 1]


def _p95(samples: deque[float]) -> float | None:
    return _percentile(samples, 0.95)


class Scheduler:
    """Streams, their playback state and cost estimates; answers next() and admit()."""

    def __init__(self, config: SchedulerConfig | None = None) -> None:
        self.config = config or SchedulerConfig()
        cfg = self.config
        self.costs = CostModel(cfg.initial_forward_s, cfg.cost_percentile, cfg.cost_window, cfg.cost_min_samples)
        self._streams: dict[str, _Stream] = {}  # in admission order (a stream unparked goes last)
        self._parked: dict[str, _Stream] = {}  # parked streams: no load, never scheduled (see `park`)
        self._next_order = 0
        self._rr_cursor = -1  # admission order of the stream round robin served last
        self._outstanding: _Outstanding | None = None
        self._pressure_until = -math.inf  # until then a chunk was recently degraded (see pressure_hold_s)
        # cost of one chunk on the output stage and the send (per stream; the device's is `costs`)
        self.stage_costs = CostModel(0.001, cfg.cost_percentile, cfg.cost_window, cfg.cost_min_samples)
        self._late: tuple[float, str, str] | None = None  # the latest lateness: (time, stream, what happened)
        self._late_margin = False  # late_margin_s is in force (a stream stalled within late_margin_hold_s)
        self._last_stall_at = -math.inf  # the latest modelled stall
        self._stalls: deque[float] = deque()  # times of modelled stalls within overload_window_s
        self._recaches: deque[float] = deque()  # times of recaches (one per stream) within RECACHE_WINDOW_S
        self._exhausted: deque[float] = deque()  # times within overload_window_s a chunk ran its fewest steps, short

    # ----- streams -------------------------------------------------------------------

    def __contains__(self, stream_id: str) -> bool:
        """Admitted, parked or not."""
        return stream_id in self._streams or stream_id in self._parked

    def __len__(self) -> int:
        """Admitted streams that are not parked."""
        return len(self._streams)

    @property
    def stream_ids(self) -> tuple[str, ...]:
        return tuple(self._streams)

    def admit(self, req: StreamRequest, now: float, kv_refusal: str | None = None) -> Admission:
        """Add `req` if the device can serve it without the others stalling.

        Refused when its KV cache does not fit (`kv_refusal`, the pool's reason,
        computed by the caller), when its chunk is longer than the buffer cap, when
        the predicted load with it would exceed `utilization_target`, or when the
        start rule could not serve the streams with it (predicted lead + a chunk
        over the cap).
        """
        if req.stream_id in self:
            raise SchedulerError(f"stream {req.stream_id!r} is already admitted")
        reasons, current, total = self._refusals(req, now, kv_refusal)
        if reasons:
            return Admission(accepted=False, reason="; ".join(reasons), predicted_load=current)
        for s in self._streams.values():  # their samples did not see the newcomer's queueing
            s.fresh_samples = 0
        self._streams[req.stream_id] = _Stream(
            request=req,
            order=self._next_order,
            admitted_at=now,
            playback=PlaybackModel(fps=req.fps, updated_at=now),
            latencies=deque(maxlen=self.config.latency_window),
            last_commit_at=now,
        )
        self._next_order += 1
        return Admission(accepted=True, reason=None, predicted_load=total)

    def _refusals(self, req: StreamRequest, now: float, kv_refusal: str | None,
                  viewers: int = 1) -> tuple[list[str], float, float]:
        """Why `req` (with `viewers` viewers) cannot join the admitted streams now (see `admit`), the predicted
        load without it and with it."""
        cfg = self.config
        steering = self._recache_load(now)
        current = self.predicted_load()
        n = len(self._streams) + 1
        needed = self.stream_load(req, n) + steering / max(1, n - 1)  # it steers as often as the others
        total = self._load(n) + needed  # with it, the others may batch more (or, unmeasured, no better)
        reasons = []
        if kv_refusal is not None:
            reasons.append(f"kv cache: {kv_refusal}")
        longest_chunk_s = max(req.first_chunk_frames, req.chunk_frames) / req.fps
        if longest_chunk_s > cfg.buffer_cap_s + _EPS_S:
            reasons.append(
                f"a chunk of {longest_chunk_s:.3f} s at {req.fps:g} fps cannot fit the "
                f"{cfg.buffer_cap_s:g} s buffer cap; raise buffer_cap_s or shorten the chunk"
            )
        elif math.isfinite(cfg.start_margin_s) and math.isfinite(cfg.utilization_target):
            latency_s = self._queue_work_s(n)
            lead_s = latency_s + cfg.start_margin_s
            chunk_s = max([longest_chunk_s] + [self._longest_chunk_s(s.request) for s in self._streams.values()])
            if lead_s + chunk_s > cfg.buffer_cap_s + _EPS_S:
                fix = math.ceil((lead_s + chunk_s) * 100 - 1e-6) / 100
                reasons.append(
                    f"start rule: with {n} streams a chunk must start {lead_s:.3f} s before its buffer runs dry "
                    f"({latency_s * 1e3:.1f} ms of predicted chunk latency, one chunk of every stream, + "
                    f"{cfg.start_margin_s:g} s margin) and a {chunk_s:.3f} s chunk must fit above that: "
                    f"{lead_s + chunk_s:.3f} s > the {cfg.buffer_cap_s:g} s buffer cap; raise the buffer cap "
                    f"(--buffer-cap, buffer_cap_s) to {fix:g} s or try again when a stream closes"
                )
        if total > cfg.utilization_target + _EPS_S:
            cost_ms = self._stream_chunk_s(n) * 1e3
            reasons.append(
                f"compute: the device is {current:.2f} busy with {len(self._streams)} streams and this one needs "
                f"{needed:.2f} ({req.fps / req.chunk_frames:.2f} chunks/s x {cost_ms:.1f} ms per chunk), "
                f"{total:.2f} > target {cfg.utilization_target:.2f}; try again when a stream closes"
            )
        reasons += self._stage_refusals(req, viewers)
        if math.isfinite(cfg.utilization_target):
            reasons += self._loop_refusals(req, now)
        return reasons, current, total

    def remove(self, stream_id: str) -> bool:
        """Forget a stream (closed or failed), parked or not; False if it was not there. A plan in flight for
        it is fine, and so is a chunk of it in flight (`delivered` then returns None)."""
        return (self._streams.pop(stream_id, None) or self._parked.pop(stream_id, None)) is not None

    # ----- parking (a paused stream's cache in host memory) ------------------------------

    def hold(self, stream_id: str, held: bool = True) -> None:
        """Start no new chunk (nor a RECACHE) for the stream: it is to be parked once its chunk in progress is
        committed (`parkable`); a new prompt does not restart that chunk. `held` False lets it go on again."""
        s = self._get(stream_id)
        if stream_id in self._parked:
            raise SchedulerError(f"stream {stream_id!r} is parked: unpark it instead")
        s.parking = held

    def parkable(self, stream_id: str) -> bool:
        """Whether the held stream is between chunks and in no outstanding plan: it may be parked now."""
        s = self._streams.get(stream_id)
        busy = self._outstanding is not None and stream_id in self._outstanding.plan.stream_ids
        return s is not None and s.parking and s.step == 0 and not busy

    def park(self, stream_id: str, now: float) -> None:
        """The stream's cache left the device: it costs no device load and is not scheduled, and its viewer's
        buffer is paused, until `unpark`. Its counters (prompt versions, chunks, latencies, viewers) stay; a
        prompt set meanwhile is applied after it comes back, a chunk in flight is still `delivered`."""
        if not self.parkable(stream_id):
            s = self._get(stream_id)
            raise SchedulerError(
                f"stream {stream_id!r} cannot be parked now: it is {'parked' if stream_id in self._parked else 'not held' if not s.parking else f'at step {s.step} of its chunk' if s.step else 'in the outstanding plan'}; "
                "hold() it and park it once parkable()"
            )
        s = self._streams.pop(stream_id)
        s.parking = False
        s.playback.pause(now)
        self._parked[stream_id] = s

    def unpark(self, stream_id: str, now: float, kv_refusal: str | None = None) -> Admission:
        """Bring a parked stream back if it is admitted again now, as a newcomer would be (its KV cache's room,
        `kv_refusal`, computed by the caller; the device, the start rule, the output stage, its viewers'
        send, the closed loop); refused, it stays parked. Admitted, it keeps its place in admission order,
        its viewer's buffer plays on, and its next chunk (after a RECACHE if a prompt came meanwhile) is
        scheduled as any other."""
        s = self._parked.get(stream_id)
        if s is None:
            raise SchedulerError(f"stream {stream_id!r} is not parked (parked: {list(self._parked)})")
        reasons, current, total = self._refusals(s.request, now, kv_refusal, s.viewers)
        if reasons:
            return Admission(accepted=False, reason="; ".join(reasons), predicted_load=current)
        for other in self._streams.values():  # their samples did not see its queueing
            other.fresh_samples = 0
        del self._parked[stream_id]
        s.fresh_samples = 0
        s.last_commit_at = max(s.last_commit_at, now)  # no chunk of it was due while parked
        s.playback.resume(now)
        self._streams[stream_id] = s
        return Admission(accepted=True, reason=None, predicted_load=total)

    @property
    def parked_ids(self) -> tuple[str, ...]:
        """Streams parked, in the order they were parked."""
        return tuple(self._parked)

    def is_parked(self, stream_id: str) -> bool:
        return stream_id in self._parked

    def set_prompt(self, stream_id: str, now: float) -> int:
        """A new prompt; returns its version. The next chunk runs under it (after a RECACHE if
        the stream has committed frames) and may start as soon as the cap allows; with
        restart_on_prompt a chunk in progress is abandoned when the stream's slack allows."""
        s = self._get(stream_id)
        s.playback.advance(now)
        s.prompt_seq += 1
        s.prompt_at = now
        return s.prompt_seq

    def pause(self, stream_id: str, now: float) -> None:
        """The viewer stopped consuming; generation goes on until the buffer reaches the start rule's lead."""
        self._get(stream_id).playback.pause(now)

    def resume(self, stream_id: str, now: float) -> None:
        self._get(stream_id).playback.resume(now)

    def observe_buffer(self, stream_id: str, buffered_frames: float, now: float, *, at_most: bool = False,
                       grace_s: float = 0.0) -> None:
        """An exact report of the viewer's buffer (delivered frames only, not those in flight);
        replaces the model's figure from `now` on. `at_most`: a report that crossed the network (a viewer's
        stats), which may have been sent a while before `now`: it lowers the model (a viewer behind it:
        decoding, rebuffering) but never raises it (a late report would credit frames already played).
        `grace_s`: what the viewer holds beyond the reported frames (a WebRTC track's queue: the frame on the
        wire and the receiver's jitter buffer). The model plans on the report, but a dry spell counts as a
        stall (the closed loop, the late margin, the last resort) only once it has lasted that long."""
        if buffered_frames < 0:
            raise ValueError(f"stream {stream_id!r}: buffered_frames={buffered_frames} must be >= 0")
        if not (grace_s >= 0 and math.isfinite(grace_s)):
            raise ValueError(f"stream {stream_id!r}: grace_s={grace_s} must be a finite number of seconds >= 0")
        s = self._get(stream_id)
        s.playback.grace_s = grace_s
        if at_most and not s.playback.started:
            # nothing delivered in the model yet: the report can only hold frames it is about to be told of (the
            # viewer may hear of the first chunk before the scheduler does); taken as it was, the first chunk
            # counted twice and the stream's second chunk came late
            return
        if at_most and not s.playback.paused:
            s.playback.advance(now)
            buffered_frames = min(buffered_frames, s.playback.seconds(now) * s.request.fps)
        stalls = s.playback.stalls
        s.playback.observe(buffered_frames, now)
        if s.playback.stalls > stalls:
            self._stalled(s, now, "its viewer reported an empty buffer")

    def mark_late(self, stream_id: str, now: float, what: str) -> None:
        """Stream `stream_id` was late at `now` in a way the scheduler cannot see (e.g. a chunk encoded cheaper
        to meet its deadline): admission stays closed for `late_hold_s` (the closed loop)."""
        self._late = (now, stream_id, what)

    def dry_at(self, stream_id: str) -> float | None:
        """When the stream's viewer runs dry unless its newest chunk in flight arrives: its buffer plus the
        chunks in flight before that one; None while it is not playing (not started or paused)."""
        s = self._get(stream_id)
        dry_at = s.playback.dry_at()
        if dry_at is None:
            return None
        return dry_at + sum(c.frames for c in list(s.in_flight)[:-1]) / s.request.fps

    def overloaded(self, now: float) -> str | None:
        """The last resort: the newest stream, to end, when degradation has run out within overload_window_s
        and `overload_stalls` modelled stalls followed it; None otherwise (and with fewer than 2 streams, where
        ending one helps nobody). Naming a stream clears the evidence: the next needs new stalls."""
        cfg = self.config
        for times in (self._stalls, self._exhausted):
            while times and times[0] < now - cfg.overload_window_s:
                times.popleft()
        if len(self._streams) < 2 or not self._exhausted:
            return None
        if sum(1 for t in self._stalls if t >= self._exhausted[0]) < cfg.overload_stalls:
            return None
        self._stalls.clear()
        self._exhausted.clear()
        return max(self._streams.values(), key=lambda s: s.order).request.stream_id

    def observe_stage(self, stage: Stage, seconds: float) -> None:
        """One chunk's measured cost on `stage` (OUTPUT: its encode on a worker; SEND: the event loop's share)."""
        if stage is Stage.DEVICE:
            raise ValueError("the device's costs are per forward: use observe_cost")
        if not (seconds >= 0 and math.isfinite(seconds)):
            raise ValueError(f"seconds={seconds}: a chunk's cost must be a finite number >= 0")
        self.stage_costs.observe(stage, 1, seconds)

    def seed_stage(self, stage: Stage, seconds: float) -> None:
        """What one chunk costs on `stage` before serving measures it (the warm-up's figure)."""
        if stage is Stage.DEVICE:
            raise ValueError("the device's costs are per forward: use seed_cost")
        if not (seconds > 0 and math.isfinite(seconds)):
            raise ValueError(f"seconds={seconds}: a chunk's cost must be a finite number > 0")
        self.stage_costs.seed(stage, 1, seconds)

    # ----- planning ------------------------------------------------------------------

    def next(self, now: float) -> Plan | None:
        """The next forward to run, or None when no stream may start work (no streams, all above their lead)."""
        if self._outstanding is not None:
            raise SchedulerError(
                f"plan {self._outstanding.plan.kind.value} for {self._outstanding.plan.stream_ids} is still "
                "outstanding; call complete() or cancel() with it first"
            )
        self._late_margin = now - self._last_stall_at < self.config.late_margin_hold_s
        candidates = []
        for s in self._streams.values():
            s.playback.advance(now)
            work = self._work(s, now)
            if work.runnable:
                candidates.append((s, work))
        if not candidates:
            return None
        candidates.sort(key=self._rank_key)
        leader, leader_work = candidates[0]
        batch = [(leader, leader_work)]
        for s, work in candidates[1:]:
            if len(batch) == self.config.max_batch:
                break
            if work.kind == leader_work.kind and work.step == leader_work.step:
                batch.append((s, work))
        plan = Plan(
            kind=leader_work.kind,
            stream_ids=tuple(s.request.stream_id for s, _ in batch),
            step=leader_work.step,
            restart=tuple(w.restart for _, w in batch),
            prompt_seqs=tuple(w.prompt_seq for _, w in batch),
            chunk_index=tuple(s.chunks_done for s, _ in batch),
            steps=tuple(w.steps for _, w in batch),
        )
        cfg = self.config
        floor = min(cfg.degrade_steps, default=cfg.denoise_steps)
        for s, w in batch:
            if w.steps < cfg.denoise_steps:
                self._pressure_until = now + cfg.pressure_hold_s
                self._late = (now, s.request.stream_id, f"a chunk ran {w.steps} of {cfg.denoise_steps} steps to stay ahead")
            playing = s.playback.started and not s.playback.paused
            if playing and w.kind is not WorkKind.RECACHE and w.steps <= floor and w.slack_s < cfg.degrade_margin_s:
                self._exhausted.append(now)  # the fewest steps it may run do not leave it the margin
        self._outstanding = _Outstanding(
            plan=plan,
            orders=tuple(s.order for s, _ in batch),
            due_at=tuple(self._due_at(s, now) if w.step <= 0 else None for s, w in batch),
            due=tuple(w.due for _, w in batch),
        )
        return plan

    def complete(self, plan: Plan, now: float, elapsed_s: float | None, deliver: bool = True) -> list[str]:
        """`plan` ran (or was launched): advance its streams, and the cost estimate by `elapsed_s`.

        `elapsed_s` None: no cost sample (give it later to `observe_cost`). `deliver`
        False: a COMMIT's chunk is in flight until `delivered` is called for it; it
        counts toward the start rule and the cap meanwhile. Returns the streams whose
        chunk was delivered now (a COMMIT with `deliver`). Streams removed while the
        plan ran are skipped.
        """
        if elapsed_s is not None and not (elapsed_s >= 0 and math.isfinite(elapsed_s)):
            raise ValueError(f"elapsed_s={elapsed_s}: a forward's wall time must be a finite number >= 0, or None")
        if deliver and plan.kind is WorkKind.COMMIT and self._outstanding and self._outstanding.plan == plan:
            for stream_id, order in zip(plan.stream_ids, self._outstanding.orders):
                s = self._streams.get(stream_id)
                if s is not None and s.order == order and s.in_flight:
                    raise SchedulerError(
                        f"stream {stream_id!r} has {len(s.in_flight)} chunk(s) in flight: deliver=True would credit "
                        "this one before them; complete with deliver=False and call delivered() in order"
                    )
        outstanding = self._take_outstanding(plan)
        if elapsed_s is not None:
            self.costs.observe(plan.kind, len(plan.stream_ids), elapsed_s)
        self._rr_cursor = outstanding.orders[-1]
        delivered = []
        for stream_id, order, prompt_seq, due_at, due, chunk_steps in zip(
            plan.stream_ids, outstanding.orders, plan.prompt_seqs, outstanding.due_at, outstanding.due, plan.steps
        ):
            s = self._streams.get(stream_id)
            if s is None or s.order != order:  # removed while the plan ran
                continue
            s.playback.advance(now)
            if due_at is not None and s.chunk_due_at is None:  # the chunk's first forward (a restart keeps it)
                s.chunk_due_at, s.chunk_sampled = due_at, due
            if plan.kind is WorkKind.RECACHE:
                self._recaches.append(now)
                s.step = 0  # a partial chunk (if any) is abandoned
                s.cache_seq = prompt_seq
            elif plan.kind is WorkKind.DENOISE:
                s.steps = chunk_steps
                if plan.step == 0:
                    s.chunk_seq = prompt_seq
                    if prompt_seq < s.prompt_seq and s.chunks_done > 0:  # made without the newest prompt
                        s.deferred_seq = s.prompt_seq
                s.step = plan.step + 1
            else:
                frames = s.request.first_chunk_frames if s.chunks_done == 0 else s.request.chunk_frames
                chunk = _InFlight(frames, now if s.chunk_due_at is None else s.chunk_due_at, s.chunk_sampled)
                s.chunk_due_at = None
                s.last_commit_at = now
                s.chunks_done += 1
                s.cache_seq = s.chunk_seq  # the committed frames' K/V were computed under the chunk's prompt
                s.degraded += chunk_steps < self.config.denoise_steps
                s.step = 0
                if deliver:
                    self._credit(s, chunk, now)
                    delivered.append(stream_id)
                else:
                    s.in_flight.append(chunk)
        return delivered

    def delivered(self, stream_id: str, now: float) -> float | None:
        """The oldest in-flight chunk of the stream reached the transports at `now`: the viewer's
        buffer gets its frames (the first one sets TTFF). Returns its latency (due -> now), a
        sample of the start rule unless the chunk ran ahead; None if the stream was removed."""
        s = self._streams.get(stream_id) or self._parked.get(stream_id)
        if s is None:
            return None
        if not s.in_flight:
            raise SchedulerError(
                f"stream {stream_id!r} has no chunk in flight (committed {s.chunks_done}); "
                "call delivered() once per COMMIT completed with deliver=False"
            )
        return self._credit(s, s.in_flight.popleft(), now)

    def observe_cost(self, kind: WorkKind, batch: int, seconds: float) -> None:
        """A measured forward: `batch` streams' `kind` forward took `seconds` (e.g. from CUDA events)."""
        if batch < 1:
            raise ValueError(f"batch={batch}: a forward runs at least 1 stream")
        if not (seconds >= 0 and math.isfinite(seconds)):
            raise ValueError(f"seconds={seconds}: a forward's time must be a finite number >= 0")
        self.costs.observe(kind, batch, seconds)

    def seed_cost(self, kind: WorkKind, batch: int, seconds: float) -> None:
        """What a `kind` forward of `batch` streams costs before serving measures it (the warm-up's median)."""
        if batch < 1:
            raise ValueError(f"batch={batch}: a forward runs at least 1 stream")
        if not (seconds > 0 and math.isfinite(seconds)):
            raise ValueError(f"seconds={seconds}: a forward's time must be a finite number > 0")
        self.costs.seed(kind, batch, seconds)

    def cancel(self, plan: Plan) -> None:
        """`plan` will not run (e.g. shutting down): forget it, nothing advances."""
        self._take_outstanding(plan)

    def wake_at(self, now: float) -> float | None:
        """Earliest time a stream becomes runnable by playback alone: its buffer drains to its lead
        (to the cap for a stream steering to a new prompt). None: never by time; new events such as
        a delivery, an admission, a prompt or a resume may still make work."""
        wake = math.inf
        for s in self._streams.values():
            work = self._work(s, now)
            if work.runnable:
                return now
            if s.playback.paused or s.playback.dry_at() is None or s.parking:  # not draining, or held for parking
                continue
            buffered = s.playback.seconds(now)
            excess = buffered + self._in_flight_s(s) - self._start_threshold_s(s, work.kind, work.step, now)
            if excess <= buffered + _EPS_S:  # the buffer alone can drain that much
                wake = min(wake, now + max(0.0, excess))
        return None if wake == math.inf else wake

    # ----- figures -------------------------------------------------------------------

    def stream_load(self, req: StreamRequest, streams: int = 1) -> float:
        """Busy fraction of the device one stream needs in steady state among `streams` streams (chunks/s x
        its share of a chunk's forwards at the batch size that many streams run at)."""
        return req.fps / req.chunk_frames * self._stream_chunk_s(streams)

    def predicted_load(self) -> float:
        """Busy fraction of the device the admitted streams need; recaches are left to the headroom."""
        return self._load(len(self._streams))

    def _load(self, streams: int) -> float:
        """The admitted streams' load when `streams` streams share the device (batches as that many allow), and
        their prompt switches: the recaches of the last RECACHE_WINDOW_S, as a rate, at the recache's cost."""
        chunks = sum(self.stream_load(s.request, streams) for s in self._streams.values())
        return chunks + self._recache_load()

    def _recache_load(self, now: float | None = None) -> float:
        """Busy fraction of the device the admitted streams' recaches took lately (measured, not predicted)."""
        if now is not None:
            while self._recaches and self._recaches[0] < now - RECACHE_WINDOW_S:
                self._recaches.popleft()
        return len(self._recaches) / RECACHE_WINDOW_S * self.costs.estimate(WorkKind.RECACHE)

    def _stream_chunk_s(self, streams: int) -> float:
        """One stream's share of a chunk's forwards when `streams` streams batch up to max_batch together."""
        batch = max(1, min(streams, self.config.max_batch))
        return self._chunk_cost_s(batch) / batch

    def lead_s(self, stream_id: str) -> float:
        """Buffered + in-flight video at which the stream's next fresh chunk becomes due (the start rule)."""
        return self._lead_s(self._get(stream_id))

    def stream_stats(self, stream_id: str, now: float) -> StreamStats:
        s = self._get(stream_id)
        work = self._work(s, now)
        pb = s.playback
        return StreamStats(
            stream_id=stream_id,
            buffered_s=pb.seconds(now),
            slack_s=work.slack_s,
            runnable=work.runnable,
            paused=pb.paused,
            chunks_delivered=s.chunks_done - len(s.in_flight),
            stalls=pb.stall_count(now),
            stall_s=pb.stall_seconds(now),
            ttff_s=None if s.first_delivered_at is None else s.first_delivered_at - s.admitted_at,
            prompt_pending=self._prompt_pending(s),
            in_flight_s=self._in_flight_s(s),
            lead_s=self._lead_s(s),
            latency_p95_s=_p95(s.latencies),
            degraded_chunks=s.degraded,
        )

    def stats(self, now: float) -> SchedulerStats:
        """A snapshot for metrics (changes nothing but forgetting recaches older than RECACHE_WINDOW_S)."""
        self._recache_load(now)
        per_stream = tuple(self.stream_stats(stream_id, now) for stream_id in self._streams)
        return SchedulerStats(
            streams=len(per_stream),
            queue_length=sum(1 for st in per_stream if st.runnable),
            predicted_load=self.predicted_load(),
            stalls=sum(st.stalls for st in per_stream),
            stall_s=sum(st.stall_s for st in per_stream),
            forward_cost_s={kind: self.costs.estimate(kind) for kind in WorkKind},
            per_stream=per_stream,
            degraded_chunks=sum(st.degraded_chunks for st in per_stream),
            pressure=now < self._pressure_until,
            stage_load={stage: self.stage_load(stage) for stage in Stage},
            late=self._late is not None and now - self._late[0] < self.config.late_hold_s,
            parked=len(self._parked),
        )

    # ----- internals -----------------------------------------------------------------

    def _get(self, stream_id: str) -> _Stream:
        """An admitted stream, parked or not."""
        s = self._streams.get(stream_id) or self._parked.get(stream_id)
        if s is None:
            raise SchedulerError(f"stream {stream_id!r} is not admitted (admitted: {list(self._streams)}, parked: "
                                 f"{list(self._parked)})")
        return s

    def _take_outstanding(self, plan: Plan) -> _Outstanding:
        """Clear the outstanding plan, which must be `plan`, and return it."""
        if self._outstanding is None or self._outstanding.plan != plan:
            raise SchedulerError(f"plan {plan.kind.value} for {plan.stream_ids} is not the outstanding plan")
        outstanding = self._outstanding
        self._outstanding = None
        return outstanding

    def _credit(self, s: _Stream, chunk: _InFlight, now: float) -> float:
        """The viewer gets `chunk` at `now`; returns its latency, recorded if the chunk started due."""
        s.playback.advance(now)
        if s.playback.dry_counted:
            self._stalled(s, now, f"chunk {s.chunks_done - len(s.in_flight) - 1} reached its viewer "
                                  f"{now - s.playback.dry_since:.2f} s after the buffer ran dry")
        s.playback.deliver(chunk.frames, now)
        if s.first_delivered_at is None:
            s.first_delivered_at = now
        latency = max(0.0, now - chunk.due_at)
        if chunk.sampled:
            s.latencies.append(latency)
            s.fresh_samples += 1
        return latency

    def _stalled(self, s: _Stream, now: float, what: str) -> None:
        """A modelled stall of `s`: the closed loop closes admission, and the last resort counts it."""
        self._late = (now, s.request.stream_id, what)
        self._stalls.append(now)
        self._last_stall_at = now

    def _stage_chunk_s(self, stage: Stage, streams: int) -> float:
        """One stream's chunk on `stage`, as a share of the stage's time (the device's batched at `streams`)."""
        if stage is Stage.DEVICE:
            return self._stream_chunk_s(streams)
        capacity = self.config.output_capacity if stage is Stage.OUTPUT else 1.0
        return self.stage_costs.estimate(stage) / capacity

    def _stage_target(self, stage: Stage) -> float:
        """The busy fraction admission keeps `stage` under."""
        cfg = self.config
        return {Stage.DEVICE: cfg.utilization_target, Stage.OUTPUT: cfg.output_target, Stage.SEND: cfg.send_target}[stage]

    def stage_load(self, stage: Stage, extra: StreamRequest | None = None, extra_viewers: int = 1) -> float:
        """Predicted busy fraction of `stage` with the admitted streams (and `extra`, if given, with `extra_viewers`
        viewers)."""
        streams = list(self._streams.values())
        chunk_s = self._stage_chunk_s(stage, len(streams) + (extra is not None))
        extra_rate = extra.fps / extra.chunk_frames if extra is not None else 0.0
        if stage is Stage.SEND:
            extra_rate *= extra_viewers
        return (sum(self._stage_rate(s, stage) for s in streams) + extra_rate) * chunk_s

    @staticmethod
    def _stage_rate(s: _Stream, stage: Stage) -> float:
        """Chunks a second stream `s` puts through `stage`: the send sends each chunk to each of its viewers."""
        rate = s.request.fps / s.request.chunk_frames
        return rate * s.viewers if stage is Stage.SEND else rate

    def admit_viewer(self, stream_id: str, now: float | None = None) -> Admission:
        """One more viewer of `stream_id`'s chunks (a watcher: no generation, one more send of each chunk), if the
        event loop's send stays under its target with it; the device and the output stage do not change. With
        `now`, an accepted one tells the stream's modelled buffer then (where the newcomer should start playing
        so as not to be ahead of every viewer: the stream would run ahead for it)."""
        s = self._get(stream_id)
        cost_s = self._stage_chunk_s(Stage.SEND, len(self._streams))
        load = self.stage_load(Stage.SEND) + s.request.fps / s.request.chunk_frames * cost_s
        if load > self.config.send_target + _EPS_S:
            viewers = sum(t.viewers for t in self._streams.values())
            return Admission(accepted=False, predicted_load=self.predicted_load(), reason=(
                f"send: the event loop would be {load:.2f} busy sending to {viewers + 1} viewers "
                f"({cost_s * 1e3:.2f} ms per chunk sent) > target {self.config.send_target:.2f}; try again when a "
                "viewer leaves"))
        s.viewers += 1
        buffered_s = None if now is None else s.playback.seconds(now)
        return Admission(accepted=True, reason=None, predicted_load=self.predicted_load(), buffered_s=buffered_s)

    def viewer_left(self, stream_id: str) -> None:
        """A viewer of `stream_id` (its steerer or a watcher) left; the stream itself goes on (or stays parked)."""
        s = self._streams.get(stream_id) or self._parked.get(stream_id)
        if s is not None:
            s.viewers = max(0, s.viewers - 1)

    def _stage_refusals(self, req: StreamRequest, viewers: int = 1) -> list[str]:
        """The output stage and the send, with `req` admitted: over their targets? (The device is checked apart.)"""
        cfg = self.config
        reasons = []
        for stage, what in ((Stage.OUTPUT, f"{cfg.output_capacity:g} output worker(s)"), (Stage.SEND, "the event loop")):
            load, target = self.stage_load(stage, req, viewers), self._stage_target(stage)
            if load > target + _EPS_S:
                reasons.append(
                    f"{stage.value}: {what} would be {load:.2f} busy with {len(self._streams) + 1} streams "
                    f"({self.stage_costs.estimate(stage) * 1e3:.1f} ms per chunk) > target {target:.2f}; try again "
                    "when a stream closes"
                )
        return reasons

    def _loop_refusals(self, req: StreamRequest, now: float) -> list[str]:
        """The closed loop (a stream late lately) and the tranche (streams still starting)."""
        cfg = self.config
        if self._late is not None and now - self._late[0] < cfg.late_hold_s:
            at, stream_id, what = self._late
            return [
                f"closed loop: stream {stream_id} was late {now - at:.1f} s ago ({what}); admission reopens once "
                f"every stream has been on time for {cfg.late_hold_s:g} s"
            ]
        starting = [s for s in self._streams.values() if s.chunks_done - len(s.in_flight) < cfg.confirm_chunks]
        if not starting:
            return []
        # The k-th of k newcomers gets its first chunk after all k first chunks and the first newcomer needs its
        # second within its first's play time: k chunks of each stage must fit in one chunk (the first newcomer's
        # own) plus that window at the stage's target, beside the streams already confirmed.
        window_s = req.first_chunk_frames / req.fps
        n = len(self._streams) + 1
        others = [s for s in self._streams.values() if s not in starting]
        for stage in Stage:
            chunk_s, target = self._stage_chunk_s(stage, n), self._stage_target(stage)
            busy = sum(self._stage_rate(s, stage) for s in others) * chunk_s
            room_s = max(0.0, target - busy) * window_s + chunk_s
            if (len(starting) + 1) * chunk_s > room_s + _EPS_S:
                since = now - min(s.admitted_at for s in starting)
                return [
                    f"starting: {len(starting)} streams admitted in the last {since:.1f} s have not yet delivered "
                    f"{cfg.confirm_chunks} chunks, and the {stage.value} starts {int(room_s / chunk_s + _EPS_S)} at "
                    f"once ({chunk_s * 1e3:.1f} ms per chunk, each stream's next chunk due within {window_s:.2f} s "
                    f"of its first, {busy:.2f} busy with the others, target {target:.2f}); try again in a second"
                ]
        return []

    def _guard_s(self) -> float:
        """Slack under which a stream counts as about to stall (0 with the guard off)."""
        return (self.config.stall_guard_chunks or 0.0) * self._chunk_cost_s()

    def _chunk_cost_s(self, batch: int = 1, steps: int | None = None) -> float:
        """Estimated time of one chunk's forwards at `batch` streams (no recache): `steps` denoising
        forwards (default: all of them) and the commit."""
        steps = self.config.denoise_steps if steps is None else steps
        return steps * self.costs.estimate(WorkKind.DENOISE, batch) + self.costs.estimate(WorkKind.COMMIT, batch)

    def _queue_work_s(self, streams: int) -> float:
        """One chunk of each of `streams` streams, in batches of up to max_batch: what a chunk may wait for."""
        batch = max(1, min(streams, self.config.max_batch))
        return math.ceil(streams / batch) * self._chunk_cost_s(batch)

    def _longest_chunk_s(self, req: StreamRequest) -> float:
        return max(req.first_chunk_frames, req.chunk_frames) / req.fps

    def _next_chunk_s(self, s: _Stream) -> float:
        frames = s.request.first_chunk_frames if s.chunks_done == 0 else s.request.chunk_frames
        return frames / s.request.fps

    def _in_flight_s(self, s: _Stream) -> float:
        return sum(c.frames for c in s.in_flight) / s.request.fps

    def _prompt_pending(self, s: _Stream) -> bool:
        if s.step > 0:
            return s.prompt_seq > s.chunk_seq
        return s.chunks_done > 0 and s.prompt_seq > s.cache_seq

    def _steering(self, s: _Stream) -> bool:
        """No chunk started yet under the newest prompt (a stream with committed frames)."""
        return s.chunks_done > 0 and s.prompt_seq > s.chunk_seq

    def _predicted_latency_s(self, s: _Stream) -> float:
        """A chunk's latency before enough are measured: one chunk of every stream, and its own RECACHE."""
        recache = s.chunks_done > 0 and s.prompt_seq > s.cache_seq
        return self._queue_work_s(len(self._streams)) + (self.costs.estimate(WorkKind.RECACHE) if recache else 0.0)

    def _lead_s(self, s: _Stream) -> float:
        """The start rule's lead: the lead_percentile of its chunk latencies (at least the prediction while samples
        are few) + the margin (+ the late margin while a stream stalled within late_margin_hold_s)."""
        measured = _percentile(s.latencies, self.config.lead_percentile)
        latency = measured
        if measured is None or s.fresh_samples < self.config.latency_min_samples:
            latency = max(measured or 0.0, self._predicted_latency_s(s))
        return latency + self.config.start_margin_s + (self.config.late_margin_s if self._late_margin else 0.0)

    def _start_threshold_s(self, s: _Stream, kind: WorkKind, step: int, now: float) -> float:
        """Buffered + in-flight video at or under which the stream's `kind` forward at `step` may start."""
        cap_s = self.config.buffer_cap_s - self._next_chunk_s(s)
        if step > 0:  # a chunk in progress goes on
            return cap_s
        if now < self._pressure_until:  # the device is short (a chunk was degraded): no steering ahead of the lead,
            lead = self._lead_s(s)
            if kind is WorkKind.RECACHE:  # but a prompt's RECACHE goes early enough to leave the chunk its lead (held
                # to the lead itself it no longer fits there, and the prompt waits a whole chunk)
                lead += self.costs.estimate(WorkKind.RECACHE) + self._recache_headroom_s()
            return min(cap_s, lead)
        if kind is WorkKind.RECACHE:  # it adds no video
            return math.inf
        return cap_s if self._steering(s) else min(cap_s, self._lead_s(s))  # steering runs ahead to the cap

    def _due_at(self, s: _Stream, now: float) -> float:
        """When the stream's next chunk became due under the start rule, `now` at the latest (pure).

        Not before its previous COMMIT (or its admission). A playing stream: when its
        buffered + in-flight video fell to its lead, or, steering to a new prompt, to the
        cap (not before the prompt came), whichever is earlier. A paused stream: `now`.
        """
        pb = s.playback
        dry_at = pb.dry_at()
        if pb.paused:
            return now
        if dry_at is None:  # not started: due since its previous chunk (or admission)
            return s.last_commit_at
        ahead_until = dry_at + self._in_flight_s(s)  # when buffered + in flight would run out
        cap_s = self.config.buffer_cap_s - self._next_chunk_s(s)
        due = ahead_until - min(cap_s, self._lead_s(s))
        if self._steering(s):
            due = min(due, max(s.prompt_at, ahead_until - cap_s))
        return max(s.last_commit_at, min(now, due))

    def _steps(self, s: _Stream, now: float, done: int, steps: int, extra_s: float) -> int:
        """Denoising steps for the stream's chunk, which has run `done` of its `steps` (a fresh chunk: 0 of all).

        Degrading: a playing stream whose buffer (in flight included) would run dry less than
        `degrade_margin_s` after its chunk's forwards (and `extra_s`, a pending RECACHE) runs the chunk with
        fewer steps, the most of `degrade_steps` that leave it that margin, else the fewest; a chunk in progress
        can be cut down to the steps it has run (its COMMIT next). A stream with slack to spare, one not
        yet playing (nothing can stall) or a paused one keeps its steps.
        """
        options = sorted((n for n in self.config.degrade_steps if done <= n < steps), reverse=True)
        pb = s.playback
        if not options or pb.paused or not (pb.started or s.in_flight):
            return steps
        dry_in = self._slack(s, now, 0.0, plain=False)
        margin = self.config.degrade_margin_s
        for n in (steps, *options):
            if dry_in - self._chunk_cost_s(steps=n - done) - extra_s >= margin:
                return n
        return options[-1]

    def _recache_headroom_s(self) -> float:
        """Slack a RECACHE must leave, else it waits a chunk: the start margin (what the estimates do not
        see: the hand-over, a forward already queued on the device, jitter), at least one forward."""
        margin = self.config.start_margin_s
        return max(self.costs.estimate(WorkKind.DENOISE), margin if math.isfinite(margin) else 0.0)

    def _slack(self, s: _Stream, now: float, remaining_s: float, plain: bool) -> float:
        """Time until the buffer (in flight included) runs dry minus `remaining_s`.

        `plain` (least_slack): the buffered seconds, 0 for a newcomer or a stalled stream.
        Otherwise a newcomer runs dry `startup_slack_s` after admission and a stalled
        stream ran dry when its stall began, so both grow more urgent as they wait.
        """
        pb = s.playback
        if pb.paused:
            return math.inf
        in_flight = self._in_flight_s(s)
        if plain:
            dry_in = pb.seconds(now) + in_flight
        elif pb.started:
            dry_in = pb.dry_at() - now + in_flight
        elif s.in_flight:  # the first chunk is on its way: it plays from its arrival, about now
            dry_in = in_flight
        else:
            dry_in = s.admitted_at + self.config.startup_slack_s - now
        return dry_in - remaining_s

    def _work(self, s: _Stream, now: float) -> _Work:
        """What stream `s` would run next, how urgent it is, and whether it may start (pure)."""
        cfg = self.config
        plain = cfg.policy == "least_slack"
        chunk_s = self._chunk_cost_s()
        recache_s = self.costs.estimate(WorkKind.RECACHE)
        restart = False
        if s.step > 0 and s.prompt_seq > s.chunk_seq and cfg.restart_on_prompt and not s.parking:
            # A new prompt arrived mid-chunk: start over under it if the buffer lasts that long.
            redo_s = chunk_s + (recache_s if s.chunks_done > 0 else 0.0)
            restart = self._slack(s, now, redo_s, plain) >= cfg.restart_margin_chunks * chunk_s
        if s.step > 0 and not restart:  # go on with the chunk in progress (or cut it short)
            steps = self._steps(s, now, s.step, s.steps, 0.0)
            kind = WorkKind.DENOISE if s.step < steps else WorkKind.COMMIT
            step = s.step if kind is WorkKind.DENOISE else cfg.denoise_steps
            prompt_seq = s.chunk_seq
            remaining_s = self._chunk_cost_s(steps=steps - s.step)
            forwards_left = steps - s.step + 1
        else:  # a fresh chunk
            recache = s.chunks_done > 0 and s.prompt_seq > s.cache_seq
            if recache and not restart and s.deferred_seq < s.prompt_seq:
                headroom_s = self._recache_headroom_s()
                with_recache = self._slack(s, now, chunk_s + recache_s, plain)
                if with_recache < headroom_s and self._slack(s, now, chunk_s, plain) >= 0:
                    # With the recache the stream would (nearly) stall, without it the chunk makes it:
                    # the prompt waits one chunk (that chunk keeps the prompt the cache holds).
                    recache = False
            extra_s = recache_s if recache else 0.0
            steps = self._steps(s, now, 0, cfg.denoise_steps, extra_s)
            if recache:
                kind, step, prompt_seq = WorkKind.RECACHE, RECACHE_STAGE, s.prompt_seq
            else:  # a committed stream's chunk runs under the prompt its cache holds
                prompt_seq = s.cache_seq if s.chunks_done > 0 else s.prompt_seq
                kind, step = WorkKind.DENOISE, 0
            remaining_s = self._chunk_cost_s(steps=steps) + extra_s
            forwards_left = steps + 1
        work = _Work(
            kind=kind,
            step=step,
            restart=restart,
            prompt_seq=prompt_seq,
            remaining_s=remaining_s,
            chunk_forwards_left=forwards_left,
            slack_s=self._slack(s, now, remaining_s, plain),
            runnable=True,
            due=True,
            steps=steps,
        )
        ahead_s = s.playback.seconds(now) + self._in_flight_s(s)
        if ahead_s > self._lead_s(s) + _EPS_S:
            work = replace(work, due=False)
        if ahead_s > self._start_threshold_s(s, kind, step, now) + _EPS_S or (s.parking and step <= 0):
            work = replace(work, runnable=False)  # above the threshold, or held for parking between chunks
        return work

    def _rank_key(self, candidate: tuple[_Stream, _Work]) -> tuple:
        """Sort key, smallest first: streams about to stall, chunks in progress first; then the rest,
        with chunk_granular due chunks in progress first; each group in the policy's order."""
        s, work = candidate
        # Chunks in progress that keep the device: the one closest to its COMMIT first, so two of them
        # never alternate forwards (least slack would: each one's slack grows as it advances).
        if self.config.stall_guard_chunks is not None and work.slack_s < self._guard_s():
            # Needed work before work-ahead; a chunk in progress keeps the device until it is committed.
            first = work.step > 0
            return (0, not first, work.chunk_forwards_left if first else 0, *self._policy_key(s, work))
        # A chunk running ahead (steering above its lead) keeps no precedence over a due one.
        first = self.config.chunk_granular and work.step > 0 and work.due
        return (1, not first, work.chunk_forwards_left if first else 0, *self._policy_key(s, work))

    def _policy_key(self, s: _Stream, work: _Work) -> tuple:
        policy = self.config.policy
        if policy == "slack":
            if work.slack_s < 0:  # late: the one closest to delivering first
                return (0, work.chunk_forwards_left, work.slack_s, s.order)
            return (1, work.slack_s, s.order)
        if policy == "least_slack":
            return (work.slack_s, s.order)
        if policy == "round_robin":  # the first stream after the last one served, cyclically
            return (s.order <= self._rr_cursor, s.order)
        return (s.order,)  # fifo
