"""Which stream's forward runs next: a pure, playback-aware scheduler.

No asyncio, no torch, no threads, no clock: every call that depends on time takes
`now` (float seconds, any monotonic origin), so the scheduler is tested by feeding
it events and asserting exact plans (sans-I/O, like vLLM's `schedule()` /
`update_from_output()`).

The unit of work is one forward. A chunk is `denoise_steps` DENOISE forwards
(steps 0..n-1) and one COMMIT forward (which writes the chunk's K/V, decodes and
delivers it). A new prompt adds one RECACHE forward before the next chunk of a
stream whose cache already holds committed frames. The engine drives it:

    plan = sched.next(now)              # None: nothing needs work; sleep until wake_at() or an event
    ... run the forward(s) of `plan`, each stream under plan.prompt_seqs[i] ...
    delivered = sched.complete(plan, now, elapsed_s)

Each stream's viewer buffer is modelled (DESIGN.md "Measuring a stream": playback
starts when the first chunk arrives, then consumes frames at fps and stalls when
empty) from delivered chunks and `now`, or set exactly by `observe_buffer`.

Slack = time until the buffer runs dry - estimated time of the forwards the
stream's next chunk still needs (a pending RECACHE included). Ranking, smallest
key first, among streams below the buffer cap:

1. Streams about to stall (slack under `stall_guard_chunks` chunks of work) go
   before streams that are only working ahead, whatever the policy, and among
   them a chunk in progress goes first and keeps the device until delivered (two
   streams near empty that alternate forwards both deliver late). Admission
   bounds the average load; this guard is what turns that into no stalls during
   transients (two viewers joining at once, a burst of prompts), for every policy.
2. Within each group, the policy (`SchedulerConfig.policy`):
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
   round_robin  one forward per stream in turn, in admission order.
   fifo         the earliest admitted stream first.

Prompts: the next chunk runs under the newest prompt, after a RECACHE when the
stream has committed frames. A chunk in progress is abandoned for the new prompt
(`restart_on_prompt`) only while the stream keeps `restart_margin_chunks` chunks
of slack after redoing it; a RECACHE that would make the stream stall, where
skipping it would not, waits one chunk (that chunk keeps the old prompt). So a
prompt never causes a stall; it shows up later instead.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

POLICIES = ("slack", "least_slack", "round_robin", "fifo")

RECACHE_STAGE = -1  # Plan.step of a RECACHE forward: it comes before a chunk's step 0
_EPS_S = 1e-9  # tolerance on time comparisons, so a wake-up at exactly the computed time is runnable


class SchedulerError(RuntimeError):
    """The scheduler was used against its contract (unknown stream, plan not outstanding, ...)."""


class WorkKind(enum.Enum):
    RECACHE = "recache"  # recompute the window's K/V under a new prompt (one forward, no frames)
    DENOISE = "denoise"  # one denoising step of the chunk in progress
    COMMIT = "commit"  # write the clean chunk's K/V, decode and deliver its frames


@dataclass(frozen=True)
class SchedulerConfig:
    policy: str = "slack"  # one of POLICIES
    denoise_steps: int = 4  # DENOISE forwards per chunk (steps 0..n-1), then one COMMIT
    # Generate no further ahead: a stream whose buffered video plus its next chunk exceeds this is not runnable.
    buffer_cap_s: float = 2.0
    max_batch: int = 1  # streams per forward, grouped only when their next work has the same kind and step
    # Admission keeps the predicted busy fraction of the device at or under this; math.inf turns it off.
    utilization_target: float = 0.9
    initial_forward_s: float = 0.05  # cost of one forward of any kind until one of that kind is measured
    # Weight of a new measurement in the moving cost estimate, in (0, 1]; the first one replaces the guess.
    cost_smoothing: float = 0.2
    restart_on_prompt: bool = True  # abandon a chunk in progress for a new prompt when the stream's slack allows it
    # Slack a stream must keep after a restart, in chunks of work (others' forwards interleave with its own).
    restart_margin_chunks: float = 2.0
    startup_slack_s: float = 0.0  # policy 'slack': a newcomer ranks as if its buffer ran dry this long after admission
    # Every policy: streams with less slack than this many chunks of work go first, chunks in progress
    # first, before streams that are only working ahead; None: off.
    stall_guard_chunks: float | None = 1.0

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
        if not 0 < self.cost_smoothing <= 1:
            raise ValueError(f"cost_smoothing={self.cost_smoothing}: must be in (0, 1] (e.g. 0.2)")
        if not (self.restart_margin_chunks >= 0 and math.isfinite(self.restart_margin_chunks)):
            raise ValueError(
                f"restart_margin_chunks={self.restart_margin_chunks}: must be a finite number >= 0 (e.g. 2.0)"
            )
        if not (self.startup_slack_s >= 0 and math.isfinite(self.startup_slack_s)):
            raise ValueError(f"startup_slack_s={self.startup_slack_s}: must be a finite number of seconds >= 0")
        guard = self.stall_guard_chunks
        if guard is not None and not (guard >= 0 and math.isfinite(guard)):
            raise ValueError(f"stall_guard_chunks={guard}: must be a finite number >= 0 (e.g. 1.0), or None for off")


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


@dataclass(frozen=True)
class StreamStats:
    stream_id: str  # the stream
    buffered_s: float  # modelled (or last observed, then drained) video in the viewer's buffer
    slack_s: float  # what the ranking uses: time until the buffer runs dry - estimated work its next chunk needs
    runnable: bool  # whether it wants a forward now (False once its buffer is at the cap)
    paused: bool  # the viewer paused: nothing is consumed
    chunks_delivered: int  # chunks committed and delivered
    stalls: int  # stalls modelled (count of times the buffer ran dry while playing)
    stall_s: float  # modelled stall time, an ongoing stall included
    ttff_s: float | None  # admission -> first chunk delivered; None until then
    prompt_pending: bool  # a newer prompt than the one its cache or its next chunk was computed under


@dataclass(frozen=True)
class SchedulerStats:
    streams: int  # admitted streams
    queue_length: int  # streams that want a forward now
    predicted_load: float  # busy fraction of the device the admitted streams need (what admission checks)
    stalls: int  # modelled stalls, summed over streams
    stall_s: float  # modelled stall time, summed over streams
    forward_cost_s: dict[WorkKind, float]  # current cost estimate of one batch-1 forward, per kind
    per_stream: tuple[StreamStats, ...]  # in admission order


@dataclass
class PlaybackModel:
    """One viewer's playback buffer, as a fluid of frames (exact for chunks that arrive whole).

    Playback starts when the first frames arrive, consumes `fps` frames per second
    unless paused, and stalls while empty; the time between running dry and the
    next arrival is a stall.
    """

    fps: float  # consumption rate while playing
    buffered_frames: float = 0.0  # frames in the buffer at `updated_at`
    updated_at: float = 0.0  # time `buffered_frames` refers to
    started: bool = False  # the first frames have arrived
    paused: bool = False  # the viewer paused: nothing is consumed and nothing stalls
    dry_since: float | None = None  # start of the stall in progress, None when not stalled
    stalls: int = 0  # stalls begun so far
    closed_stall_s: float = 0.0  # duration of the stalls that have ended

    def advance(self, now: float) -> None:
        """Consume frames up to `now` (times before `updated_at` are ignored)."""
        if now <= self.updated_at:
            return
        if self.started and not self.paused and self.dry_since is None:
            drained = (now - self.updated_at) * self.fps
            if drained > self.buffered_frames:
                self.dry_since = self.updated_at + self.buffered_frames / self.fps
                self.stalls += 1
                self.buffered_frames = 0.0
            else:
                self.buffered_frames -= drained
        self.updated_at = now

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
            self.stalls += 1

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
        starting = self.dry_since is None and dry_at is not None and now > dry_at
        return self.stalls + (1 if starting else 0)

    def stall_seconds(self, now: float) -> float:
        """Stall time by `now`, one in progress included (pure)."""
        dry_at = self.dry_at()
        ongoing = 0.0 if dry_at is None else max(0.0, now - dry_at)
        return self.closed_stall_s + ongoing

    def _end_stall(self, now: float) -> None:
        if self.dry_since is not None:
            self.closed_stall_s += max(0.0, now - self.dry_since)
            self.dry_since = None


class CostModel:
    """Moving estimate of one forward's wall time per (kind, batch size)."""

    def __init__(self, initial_forward_s: float, smoothing: float) -> None:
        self.initial_forward_s = initial_forward_s
        self.smoothing = smoothing
        self._estimate: dict[tuple[WorkKind, int], float] = {}

    def estimate(self, kind: WorkKind, batch: int = 1) -> float:
        """Measured (kind, batch) cost; unmeasured: the batch-1 cost of the kind, else the initial guess."""
        if (kind, batch) in self._estimate:
            return self._estimate[(kind, batch)]
        return self._estimate.get((kind, 1), self.initial_forward_s)

    def observe(self, kind: WorkKind, batch: int, elapsed_s: float) -> None:
        key = (kind, batch)
        if key not in self._estimate:
            self._estimate[key] = elapsed_s
        else:
            self._estimate[key] += self.smoothing * (elapsed_s - self._estimate[key])


@dataclass
class _Stream:
    request: StreamRequest  # what was admitted
    order: int  # admission sequence number (fifo and round robin order)
    admitted_at: float  # time of admission
    playback: PlaybackModel  # the viewer's buffer
    step: int = 0  # next denoise step of the chunk in progress; 0: none in progress; denoise_steps: COMMIT is next
    chunks_done: int = 0  # chunks committed and delivered
    prompt_seq: int = 0  # latest prompt version (number of set_prompt calls)
    cache_seq: int = 0  # prompt version the KV cache was last computed under
    chunk_seq: int = 0  # prompt version the chunk in progress runs under
    deferred_seq: int = 0  # newest prompt version a chunk was already made without (a prompt waits one chunk at most)
    first_delivered_at: float | None = None  # time the first chunk was delivered


@dataclass(frozen=True)
class _Work:
    kind: WorkKind  # the stream's next forward
    step: int  # Plan.step of that forward
    restart: bool  # it abandons a partial chunk
    prompt_seq: int  # prompt version it runs under
    remaining_s: float  # estimated time of the forwards left until its next chunk is delivered, this one included
    chunk_forwards_left: int  # DENOISE + COMMIT forwards left of that chunk (a RECACHE not counted)
    slack_s: float  # time until its buffer runs dry (as the policy counts it) minus remaining_s
    runnable: bool  # below the buffer cap (RECACHE adds no video and is always runnable)


@dataclass(frozen=True)
class _Outstanding:
    plan: Plan  # handed out by next(), not yet completed or cancelled
    orders: tuple[int, ...]  # admission order of each of its streams (a re-admitted id is another stream)


class Scheduler:
    """Streams, their playback state and cost estimates; answers next() and admit()."""

    def __init__(self, config: SchedulerConfig | None = None) -> None:
        self.config = config or SchedulerConfig()
        self.costs = CostModel(self.config.initial_forward_s, self.config.cost_smoothing)
        self._streams: dict[str, _Stream] = {}  # in admission order
        self._next_order = 0
        self._rr_cursor = -1  # admission order of the stream round robin served last
        self._outstanding: _Outstanding | None = None

    # ----- streams -------------------------------------------------------------------

    def __contains__(self, stream_id: str) -> bool:
        return stream_id in self._streams

    def __len__(self) -> int:
        return len(self._streams)

    @property
    def stream_ids(self) -> tuple[str, ...]:
        return tuple(self._streams)

    def admit(self, req: StreamRequest, now: float, kv_refusal: str | None = None) -> Admission:
        """Add `req` if the device can serve it without the others stalling.

        Refused when its KV cache does not fit (`kv_refusal`, the pool's reason,
        computed by the caller), when its chunk is longer than the buffer cap, or
        when the predicted load with it would exceed `utilization_target`.
        """
        if req.stream_id in self._streams:
            raise SchedulerError(f"stream {req.stream_id!r} is already admitted")
        cfg = self.config
        current = self.predicted_load()
        needed = self.stream_load(req)
        total = current + needed
        reasons = []
        if kv_refusal is not None:
            reasons.append(f"kv cache: {kv_refusal}")
        longest_chunk_s = max(req.first_chunk_frames, req.chunk_frames) / req.fps
        if longest_chunk_s > cfg.buffer_cap_s + _EPS_S:
            reasons.append(
                f"a chunk of {longest_chunk_s:.3f} s at {req.fps:g} fps cannot fit the "
                f"{cfg.buffer_cap_s:g} s buffer cap; raise buffer_cap_s or shorten the chunk"
            )
        if total > cfg.utilization_target + _EPS_S:
            cost_ms = self._chunk_cost_s() * 1e3
            reasons.append(
                f"compute: the device is {current:.2f} busy with {len(self._streams)} streams and this one needs "
                f"{needed:.2f} ({req.fps / req.chunk_frames:.2f} chunks/s x {cost_ms:.1f} ms per chunk), "
                f"{total:.2f} > target {cfg.utilization_target:.2f}; try again when a stream closes"
            )
        if reasons:
            return Admission(accepted=False, reason="; ".join(reasons), predicted_load=current)
        self._streams[req.stream_id] = _Stream(
            request=req,
            order=self._next_order,
            admitted_at=now,
            playback=PlaybackModel(fps=req.fps, updated_at=now),
        )
        self._next_order += 1
        return Admission(accepted=True, reason=None, predicted_load=total)

    def remove(self, stream_id: str) -> bool:
        """Forget a stream (closed or failed); False if it was not there. A plan in flight for it is fine."""
        return self._streams.pop(stream_id, None) is not None

    def set_prompt(self, stream_id: str, now: float) -> int:
        """A new prompt; returns its version. The next chunk runs under it (after a RECACHE if
        the stream has committed frames); with restart_on_prompt a chunk in progress is
        abandoned when the stream's slack allows."""
        s = self._get(stream_id)
        s.playback.advance(now)
        s.prompt_seq += 1
        return s.prompt_seq

    def pause(self, stream_id: str, now: float) -> None:
        """The viewer stopped consuming; generation goes on until the buffer reaches the cap."""
        self._get(stream_id).playback.pause(now)

    def resume(self, stream_id: str, now: float) -> None:
        self._get(stream_id).playback.resume(now)

    def observe_buffer(self, stream_id: str, buffered_frames: float, now: float) -> None:
        """An exact report of the viewer's buffer; replaces the model's figure from `now` on."""
        if buffered_frames < 0:
            raise ValueError(f"stream {stream_id!r}: buffered_frames={buffered_frames} must be >= 0")
        self._get(stream_id).playback.observe(buffered_frames, now)

    # ----- planning ------------------------------------------------------------------

    def next(self, now: float) -> Plan | None:
        """The next forward to run, or None when no stream needs work (no streams, or all at the cap)."""
        if self._outstanding is not None:
            raise SchedulerError(
                f"plan {self._outstanding.plan.kind.value} for {self._outstanding.plan.stream_ids} is still "
                "outstanding; call complete() or cancel() with it first"
            )
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
        )
        self._outstanding = _Outstanding(plan=plan, orders=tuple(s.order for s, _ in batch))
        return plan

    def complete(self, plan: Plan, now: float, elapsed_s: float) -> list[str]:
        """`plan` ran in `elapsed_s`: advance its streams and the cost estimate.

        Returns the streams whose chunk was delivered now (after a COMMIT). Streams
        removed while the plan ran are skipped.
        """
        if not (elapsed_s >= 0 and math.isfinite(elapsed_s)):
            raise ValueError(f"elapsed_s={elapsed_s}: a forward's wall time must be a finite number >= 0")
        orders = self._take_outstanding(plan)
        self.costs.observe(plan.kind, len(plan.stream_ids), elapsed_s)
        self._rr_cursor = orders[-1]
        delivered = []
        for stream_id, order, prompt_seq in zip(plan.stream_ids, orders, plan.prompt_seqs):
            s = self._streams.get(stream_id)
            if s is None or s.order != order:  # removed while the plan ran
                continue
            s.playback.advance(now)
            if plan.kind is WorkKind.RECACHE:
                s.step = 0  # a partial chunk (if any) is abandoned
                s.cache_seq = prompt_seq
            elif plan.kind is WorkKind.DENOISE:
                if plan.step == 0:
                    s.chunk_seq = prompt_seq
                    if prompt_seq < s.prompt_seq and s.chunks_done > 0:  # made without the newest prompt
                        s.deferred_seq = s.prompt_seq
                s.step = plan.step + 1
            else:
                frames = s.request.first_chunk_frames if s.chunks_done == 0 else s.request.chunk_frames
                s.playback.deliver(frames, now)
                if s.first_delivered_at is None:
                    s.first_delivered_at = now
                s.chunks_done += 1
                s.cache_seq = s.chunk_seq  # the committed frames' K/V were computed under the chunk's prompt
                s.step = 0
                delivered.append(stream_id)
        return delivered

    def cancel(self, plan: Plan) -> None:
        """`plan` will not run (e.g. shutting down): forget it, nothing advances."""
        self._take_outstanding(plan)

    def wake_at(self, now: float) -> float | None:
        """Earliest time a stream at the buffer cap becomes runnable by playback alone (None: never
        by time; new events such as an admission, a prompt or a resume may still make work)."""
        wake = math.inf
        for s in self._streams.values():
            if s.playback.paused:
                continue
            over = s.playback.seconds(now) + self._next_chunk_s(s) - self.config.buffer_cap_s
            wake = min(wake, now + max(0.0, over))
        return None if wake == math.inf else wake

    # ----- figures -------------------------------------------------------------------

    def stream_load(self, req: StreamRequest) -> float:
        """Busy fraction of the device one stream needs in steady state (chunks/s x cost per chunk)."""
        return req.fps / req.chunk_frames * self._chunk_cost_s()

    def predicted_load(self) -> float:
        """Busy fraction of the device the admitted streams need; recaches are left to the headroom."""
        return sum(self.stream_load(s.request) for s in self._streams.values())

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
            chunks_delivered=s.chunks_done,
            stalls=pb.stall_count(now),
            stall_s=pb.stall_seconds(now),
            ttff_s=None if s.first_delivered_at is None else s.first_delivered_at - s.admitted_at,
            prompt_pending=self._prompt_pending(s),
        )

    def stats(self, now: float) -> SchedulerStats:
        """A snapshot for metrics (pure: changes nothing)."""
        per_stream = tuple(self.stream_stats(stream_id, now) for stream_id in self._streams)
        return SchedulerStats(
            streams=len(per_stream),
            queue_length=sum(1 for st in per_stream if st.runnable),
            predicted_load=self.predicted_load(),
            stalls=sum(st.stalls for st in per_stream),
            stall_s=sum(st.stall_s for st in per_stream),
            forward_cost_s={kind: self.costs.estimate(kind) for kind in WorkKind},
            per_stream=per_stream,
        )

    # ----- internals -----------------------------------------------------------------

    def _get(self, stream_id: str) -> _Stream:
        try:
            return self._streams[stream_id]
        except KeyError:
            raise SchedulerError(f"stream {stream_id!r} is not admitted (admitted: {list(self._streams)})") from None

    def _take_outstanding(self, plan: Plan) -> tuple[int, ...]:
        """Clear the outstanding plan, which must be `plan`; returns its streams' admission orders."""
        if self._outstanding is None or self._outstanding.plan != plan:
            raise SchedulerError(f"plan {plan.kind.value} for {plan.stream_ids} is not the outstanding plan")
        orders = self._outstanding.orders
        self._outstanding = None
        return orders

    def _guard_s(self) -> float:
        """Slack under which a stream counts as about to stall (0 with the guard off)."""
        return (self.config.stall_guard_chunks or 0.0) * self._chunk_cost_s()

    def _chunk_cost_s(self) -> float:
        """Estimated time of one chunk's forwards at batch 1 (no recache)."""
        denoise = self.costs.estimate(WorkKind.DENOISE)
        return self.config.denoise_steps * denoise + self.costs.estimate(WorkKind.COMMIT)

    def _next_chunk_s(self, s: _Stream) -> float:
        frames = s.request.first_chunk_frames if s.chunks_done == 0 else s.request.chunk_frames
        return frames / s.request.fps

    def _prompt_pending(self, s: _Stream) -> bool:
        if s.step > 0:
            return s.prompt_seq > s.chunk_seq
        return s.chunks_done > 0 and s.prompt_seq > s.cache_seq

    def _fresh_chunk_s(self, s: _Stream, recache: bool) -> float:
        """Estimated time of a whole chunk from now, with a RECACHE first if `recache`."""
        extra = self.costs.estimate(WorkKind.RECACHE) if recache else 0.0
        return extra + self._chunk_cost_s()

    def _slack(self, s: _Stream, now: float, remaining_s: float, plain: bool) -> float:
        """Time until the buffer runs dry minus `remaining_s`.

        `plain` (least_slack): the buffered seconds, 0 for a newcomer or a stalled stream.
        Otherwise a newcomer runs dry `startup_slack_s` after admission and a stalled
        stream ran dry when its stall began, so both grow more urgent as they wait.
        """
        pb = s.playback
        if pb.paused:
            return math.inf
        if plain:
            dry_in = pb.seconds(now)
        elif pb.started:
            dry_in = pb.dry_at() - now
        else:
            dry_in = s.admitted_at + self.config.startup_slack_s - now
        return dry_in - remaining_s

    def _work(self, s: _Stream, now: float) -> _Work:
        """What stream `s` would run next and how urgent it is (pure)."""
        cfg = self.config
        plain = cfg.policy == "least_slack"
        chunk_s = self._chunk_cost_s()
        recache_s = self.costs.estimate(WorkKind.RECACHE)
        restart = False
        if s.step > 0 and s.prompt_seq > s.chunk_seq and cfg.restart_on_prompt:
            # A new prompt arrived mid-chunk: start over under it if the buffer lasts that long.
            redo_s = chunk_s + (recache_s if s.chunks_done > 0 else 0.0)
            restart = self._slack(s, now, redo_s, plain) >= cfg.restart_margin_chunks * chunk_s
        if s.step > 0 and not restart:  # go on with the chunk in progress
            kind = WorkKind.DENOISE if s.step < cfg.denoise_steps else WorkKind.COMMIT
            step, prompt_seq = s.step, s.chunk_seq
            remaining_s = (cfg.denoise_steps - s.step) * self.costs.estimate(WorkKind.DENOISE)
            remaining_s += self.costs.estimate(WorkKind.COMMIT)
            forwards_left = cfg.denoise_steps - s.step + 1
        else:  # a fresh chunk
            recache = s.chunks_done > 0 and s.prompt_seq > s.cache_seq
            if recache and not restart and s.deferred_seq < s.prompt_seq:
                headroom_s = self.costs.estimate(WorkKind.DENOISE)  # one forward, for estimate error
                with_recache = self._slack(s, now, chunk_s + recache_s, plain)
                if with_recache < headroom_s and self._slack(s, now, chunk_s, plain) >= 0:
                    # With the recache the stream would (nearly) stall, without it the chunk makes it:
                    # the prompt waits one chunk (that chunk keeps the prompt the cache holds).
                    recache = False
            if recache:
                kind, step, prompt_seq, remaining_s = WorkKind.RECACHE, RECACHE_STAGE, s.prompt_seq, chunk_s + recache_s
            else:  # a committed stream's chunk runs under the prompt its cache holds
                prompt_seq = s.cache_seq if s.chunks_done > 0 else s.prompt_seq
                kind, step, remaining_s = WorkKind.DENOISE, 0, chunk_s
            forwards_left = cfg.denoise_steps + 1
        below_cap = s.playback.seconds(now) + self._next_chunk_s(s) <= cfg.buffer_cap_s + _EPS_S
        return _Work(
            kind=kind,
            step=step,
            restart=restart,
            prompt_seq=prompt_seq,
            remaining_s=remaining_s,
            chunk_forwards_left=forwards_left,
            slack_s=self._slack(s, now, remaining_s, plain),
            runnable=below_cap or kind is WorkKind.RECACHE,
        )

    def _rank_key(self, candidate: tuple[_Stream, _Work]) -> tuple:
        """Sort key, smallest first: streams about to stall, then the rest, each in the policy's order."""
        s, work = candidate
        if self.config.stall_guard_chunks is not None and work.slack_s < self._guard_s():
            # Needed work before work-ahead; a chunk in progress keeps the device until it is delivered.
            return (0, work.step <= 0, *self._policy_key(s, work))
        return (1, False, *self._policy_key(s, work))

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
