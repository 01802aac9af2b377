"""The `Scheduler`: the registry of streams, and the one object the engine talks to.

It owns the admitted and the parked streams and composes the parts, each in a module of
its own: `AdmissionControl` (admission), `Planner` (planner, ranking), `CostEstimates`
(costs), `OverloadMonitor` (overload) and each stream's `PlaybackModel` (playback). Its
methods check their arguments, find the stream and delegate; what they decide is
documented where it is decided.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque

from models.work import WorkKind

from .admission import AdmissionControl
from .config import SchedulerConfig
from .costs import CostEstimates
from .overload import OverloadMonitor
from .planner import Planner
from .playback import PlaybackModel
from .stream import InFlight, ScheduledStream
from .types import Admission, Plan, SchedulerError, SchedulerStats, Stage, StreamLoad, StreamRequest, StreamStats


class Scheduler:
    """Streams, their playback state and cost estimates; answers next() and admit()."""

    def __init__(self, config: SchedulerConfig | None = None) -> None:
        self.config = config or SchedulerConfig()
        self._estimates = CostEstimates(self.config)
        self.costs = self._estimates.forward  # one forward's cost, by kind and batch
        self.stage_costs = self._estimates.stage  # one chunk's cost on the output stage and the send
        self._streams: dict[str, ScheduledStream] = {}  # in admission order (a stream unparked goes last)
        self._parked: dict[str, ScheduledStream] = {}  # parked streams: no load, never scheduled (see `park`)
        self._next_order = 0
        self._overload = OverloadMonitor(self.config)
        self._admission = AdmissionControl(self.config, self._estimates)
        self._planner = Planner(self.config, self._estimates, self._overload, self._streams)

    # ----- streams -------------------------------------------------------------------

    def __contains__(self, stream_id: str) -> bool:
        """Admitted, parked or not."""
        return stream_id in self._streams or stream_id in self._parked

    def __len__(self) -> int:
        """Admitted streams that are not parked."""
        return len(self._streams)

    @property
    def stream_ids(self) -> tuple[str, ...]:
        """Admitted streams that are not parked, in admission order (an unparked one last)."""
        return tuple(self._streams)

    def admit(self, req: StreamRequest, now: float, kv_refusal: str | None = None) -> Admission:
        """Add `req` if the device can serve it without the others stalling.

        Into an empty server, from the warm-up's cost figures (see `_restart_if_empty`).
        Refused when its KV cache does not fit (`kv_refusal`, the pool's reason,
        computed by the caller), when its chunk is longer than the buffer cap, when
        the predicted load with it would exceed `utilization_target`, or when the
        start rule could not serve the streams with it (predicted lead + a chunk
        over the cap), when a chunk of its input video could not reach its viewer
        within its input latency; and by the output stage, the send, the closed
        loop and the tranche (see `admission`).
        """
        if req.stream_id in self:
            raise SchedulerError(f"stream {req.stream_id!r} is already admitted")
        self._restart_if_empty()
        admission = self._admission.admit(req, self._loads(), now, late=self._overload.late, kv_refusal=kv_refusal)
        if not admission.accepted:
            return admission
        for s in self._streams.values():  # their samples did not see the newcomer's queueing
            s.fresh_samples = 0
        self._streams[req.stream_id] = ScheduledStream(
            request=req,
            order=self._next_order,
            admitted_at=now,
            playback=PlaybackModel(fps=req.fps, updated_at=now, own=PlaybackModel(fps=req.fps, updated_at=now)),
            latencies=deque(maxlen=self.config.latency_window),
            last_commit_at=now,
            prompt_texts={0: req.prompt},
        )
        self._next_order += 1
        return admission

    def input_refusal(self, req: StreamRequest) -> str | None:
        """Why a stream with input video like `req` could not be served on time even alone (one chunk's predicted
        latency over its input latency, see `admission`), from the cost estimates as they stand (the warm-up's
        after it); None when it could, or for a stream without input."""
        reasons = self._admission.input_refusals(req)
        return "; ".join(reasons) if reasons else None

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
        return s is not None and self._planner.parkable(s)

    def park(self, stream_id: str, now: float) -> None:
        """The stream's cache left the device: it costs no device load and is not scheduled, and its viewer's
        buffer is paused, until `unpark`. Its counters (prompt versions, chunks, latencies, viewers) stay; a
        prompt set meanwhile is applied after it comes back, a chunk in flight is still `delivered`."""
        if not self.parkable(stream_id):
            s = self._get(stream_id)
            state = ("parked" if stream_id in self._parked else "not held" if not s.parking
                     else f"at step {s.step} of its chunk" if s.step else "in the outstanding plan")
            raise SchedulerError(
                f"stream {stream_id!r} cannot be parked now: it is {state}; hold() it and park it once parkable()"
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
        self._restart_if_empty()
        admission = self._admission.admit(s.request, self._loads(), now, late=self._overload.late,
                                          kv_refusal=kv_refusal, viewers=s.viewers)
        if not admission.accepted:
            return admission
        for other in self._streams.values():  # their samples did not see its queueing
            other.fresh_samples = 0
        del self._parked[stream_id]
        s.fresh_samples = 0
        s.last_commit_at = max(s.last_commit_at, now)  # no chunk of it was due while parked
        s.playback.resume(now)
        s.chunk_committed(now)  # a prompt that waited while it was parked is planned (as after a commit)
        self._streams[stream_id] = s
        return admission

    @property
    def parked_ids(self) -> tuple[str, ...]:
        """Streams parked, in the order they were parked."""
        return tuple(self._parked)

    def is_parked(self, stream_id: str) -> bool:
        """Whether the stream is parked."""
        return stream_id in self._parked

    # ----- what viewers do and get ------------------------------------------------------

    def set_prompt(self, stream_id: str, now: float, prompt: str = "", style_cost: float | None = None) -> int:
        """A new prompt (its text: the plans that run under it carry it); returns its version, one per call.

        Prompts are coalesced here, so that a flood of them costs one prompt switch a chunk at most: the first since
        the stream's last committed chunk is planned at once (its next chunk runs under it, after a RECACHE if the
        stream has committed frames, and may start as soon as the cap allows; with restart_on_prompt a chunk in
        progress is abandoned when the stream's slack allows); a later one waits for the next commit, and a newer
        one replaces it (of those that come between two chunks only the newest is planned). A style switch is one
        (streamsvc/engine/styles.py), with its `style_cost`: the stream is charged that share from now on."""
        s = self._get(stream_id)
        if style_cost is not None:
            s.request = dataclasses.replace(s.request, style_cost=style_cost)
        s.playback.advance(now)
        return s.new_prompt(prompt, now)

    def started(self, stream_id: str, now: float, frames: int) -> None:
        """The stream's first chunk was made at its admission, outside the plans: a start image, encoded and committed
        by the engine (streamsvc/engine/images.py), of `frames` frames (its request's first_chunk_frames). It counts
        as committed at `now` and in flight until `delivered`, as any chunk (its latency is no sample of the start
        rule); the stream's next chunk is its second. Only before any plan ran for the stream."""
        s = self._get(stream_id)
        if s.chunks_done or s.step or self._planner.busy(stream_id):
            raise SchedulerError(f"stream {stream_id!r} has begun its chunks ({s.chunks_done} committed, step "
                                 f"{s.step}): its first chunk can no longer come from outside the plans")
        if frames != s.request.first_chunk_frames:
            raise SchedulerError(f"stream {stream_id!r}: a first chunk of {frames} frames, but its request says "
                                 f"{s.request.first_chunk_frames}")
        s.in_flight.append(InFlight(frames, now, sampled=False))
        s.chunks_done, s.last_commit_at = 1, now

    def release(self, stream_id: str, chunk_index: int, start_step: int, now: float, frames: bool = True) -> None:
        """Input video (issue 35): chunk `chunk_index` of the stream may start at `now`, at `start_step` (its
        strength's step; 0 with `frames` False: its input was missing, it runs as text-to-video). Chunks are
        released in order, each once, and not before the chunk before it has started."""
        s = self._get(stream_id)
        if not s.has_input:
            raise SchedulerError(f"stream {stream_id!r} takes no input video: nothing to release")
        if chunk_index in s.releases or chunk_index < s.chunks_done or chunk_index > s.chunks_done + 1:
            raise SchedulerError(f"stream {stream_id!r}: chunk {chunk_index} cannot be released (committed "
                                 f"{s.chunks_done}, released {sorted(s.releases)})")
        if not 0 <= start_step < self.config.denoise_steps:
            raise ValueError(f"start_step={start_step}: must be a step of the schedule, 0..{self.config.denoise_steps - 1}")
        s.releases[chunk_index] = (start_step, now, frames)

    def release_by(self, stream_id: str, frames: bool) -> float | None:
        """Input video: the latest time the stream's next chunk to release may be released and still reach its
        viewer on time: when its viewer's buffer (its chunks in flight and in progress included) runs dry, less its
        lead (its chunk latency from release to delivery, measured or predicted, and the margin), the output stage,
        the forwards its chunk in progress has left, and, for a chunk whose input is missing (`frames` False), the
        forwards a text-to-video chunk runs beyond one with frames. None while its viewer is not playing (nothing to
        be late for). The input stage declares a chunk's input missing by then at the latest (streamsvc/inputs/frames.py
        `InputFrames.missing_at`)."""
        return self._planner.release_by(self._get(stream_id), frames)

    def releasable(self, stream_id: str) -> int | None:
        """Input video: the index of the stream's next chunk to release (its next one not released yet, the one
        after its chunk in progress at most); None when there is none now (or it takes no input)."""
        s = self._streams.get(stream_id)  # (a parked stream's next chunk is released once it is back)
        if s is None or not s.has_input or s.parking:
            return None
        for c in (s.chunks_done, s.chunks_done + 1):
            if c not in s.releases:
                return c if c == s.chunks_done or s.step > 0 else None
        return None

    def pause(self, stream_id: str, now: float) -> None:
        """The viewer stopped consuming; generation goes on until the buffer reaches the start rule's lead."""
        self._get(stream_id).playback.pause(now)

    def resume(self, stream_id: str, now: float) -> None:
        """The viewer plays on."""
        self._get(stream_id).playback.resume(now)

    def observe_buffer(self, stream_id: str, buffered_frames: float, now: float, *, at_most: bool = False,
                       grace_s: float = 0.0) -> None:
        """An exact report of the viewer's buffer (delivered frames only, not those in flight);
        replaces the model's figure from `now` on. `at_most`: a report that crossed the network (a viewer's
        stats), which may have been sent a while before `now`: it lowers the model (a viewer behind it:
        decoding, rebuffering) but never raises it (a late report would credit frames already played).
        `grace_s`: what the viewer holds beyond the reported frames (a WebRTC track's queue: the frame on the
        wire and the receiver's jitter buffer). The model plans on the report, but a dry spell counts as a
        stall (the closed loop, the late margin, the last resort) only once it has lasted that long.

        Only an exact report is the server's own measurement (its WebRTC track's queue running dry): a viewer's
        own (`at_most`) makes its stream urgent, but a stall it reports, and lateness that follows from it, is
        charged to that stream (`StreamStats.client_late`), never read as overload (issue 41: one viewer
        reporting 0 closed admission for everyone)."""
        if buffered_frames < 0:
            raise ValueError(f"stream {stream_id!r}: buffered_frames={buffered_frames} must be >= 0")
        if not (grace_s >= 0 and math.isfinite(grace_s)):
            raise ValueError(f"stream {stream_id!r}: grace_s={grace_s} must be a finite number of seconds >= 0")
        s = self._get(stream_id)
        if s.playback.report(buffered_frames, now, at_most=at_most, grace_s=grace_s):
            if at_most:
                s.client_late += 1
            else:
                self._overload.stalled(stream_id, now, "its viewer's queue on the server ran dry")

    def mark_late(self, stream_id: str, now: float, what: str) -> None:
        """Stream `stream_id` was late at `now` in a way the scheduler cannot see (e.g. a chunk encoded cheaper
        to meet its deadline, `dry_at`): admission stays closed for `late_hold_s` (the closed loop). Unless the
        chunk it delivered last ran without input (its input was missing): that is charged to the stream."""
        s = self._streams.get(stream_id) or self._parked.get(stream_id)
        if s is not None and s.last_missing:
            s.client_late += 1
            return
        self._overload.mark_late(stream_id, now, what)

    def dry_at(self, stream_id: str) -> float | None:
        """By the server's own account (not its viewer's reports; a chunk of input no earlier than its release +
        input_latency_s), when the stream's viewer runs dry unless its newest chunk in flight arrives: its buffer
        plus the chunks in flight before that one; None while it is not playing (not started or paused). What the
        encoder's deadline runs from: a cheaper encode is the server's lateness."""
        return self._get(stream_id).dry_at()

    def overloaded(self, now: float) -> str | None:
        """The last resort: the newest stream, to end, when degradation has run out within overload_window_s
        and `overload_stalls` modelled stalls followed it; None otherwise (and with fewer than 2 streams, where
        ending one helps nobody). Naming a stream clears the evidence: the next needs new stalls."""
        oldest_first = sorted(self._streams.values(), key=lambda s: s.order)
        return self._overload.overloaded(now, [s.request.stream_id for s in oldest_first])

    def admit_viewer(self, stream_id: str, now: float | None = None) -> Admission:
        """One more viewer of `stream_id`'s chunks (a watcher: no generation, one more send of each chunk), if the
        event loop's send stays under its target with it; the device and the output stage do not change. With
        `now`, an accepted one tells the stream's modelled buffer then (where the newcomer should start playing
        so as not to be ahead of every viewer: the stream would run ahead for it)."""
        s = self._get(stream_id)
        buffered_s = None if now is None else s.playback.seconds(now)
        admission = self._admission.admit_viewer(s.load, self._loads(), buffered_s)
        if admission.accepted:
            s.viewers += 1
        return admission

    def viewer_left(self, stream_id: str) -> None:
        """A viewer of `stream_id` (its steerer or a watcher) left; the stream itself goes on (or stays parked)."""
        s = self._streams.get(stream_id) or self._parked.get(stream_id)
        if s is not None:
            s.viewers = max(0, s.viewers - 1)

    # ----- planning ------------------------------------------------------------------

    def next(self, now: float) -> Plan | None:
        """The next forward to run, or None when no stream may start work (no streams, all above their lead)."""
        return self._planner.next(now)

    def complete(self, plan: Plan, now: float, elapsed_s: float | None, deliver: bool = True) -> list[str]:
        """`plan` ran (or was launched): advance its streams, and the cost estimate by `elapsed_s`.

        `elapsed_s` None: no cost sample (give it later to `observe_cost`). `deliver`
        False: a COMMIT's chunk is in flight until `delivered` is called for it; it
        counts toward the start rule and the cap meanwhile. Returns the streams whose
        chunk was delivered now (a COMMIT with `deliver`). Streams removed while the
        plan ran are skipped.
        """
        return self._planner.complete(plan, now, elapsed_s, deliver)

    def delivered(self, stream_id: str, now: float) -> float | None:
        """The oldest in-flight chunk of the stream reached the transports at `now`: the viewer's
        buffer gets its frames (the first one sets TTFF). Returns its latency (due -> now), a
        sample of the start rule unless the chunk ran ahead; None if the stream was removed."""
        s = self._streams.get(stream_id) or self._parked.get(stream_id)
        if s is None:
            return None
        return self._planner.delivered(s, now)

    def cuts(self, stream_id: str) -> bool:
        """Whether the stream's newest committed chunk, in flight, cuts to a new prompt (`prompt_cut`: its header
        says so, and its viewers drop the older frames they hold)."""
        s = self._streams.get(stream_id) or self._parked.get(stream_id)
        return s is not None and bool(s.in_flight) and s.in_flight[-1].cut

    def cancel(self, plan: Plan) -> None:
        """`plan` will not run (e.g. shutting down): forget it, nothing advances."""
        self._planner.cancel(plan)

    def wake_at(self, now: float) -> float | None:
        """Earliest time a stream becomes runnable by playback alone: its buffer drains to its lead
        (to the cap for a stream steering to a new prompt). None: never by time; new events such as
        a delivery, an admission, a prompt or a resume may still make work."""
        return self._planner.wake_at(now)

    # ----- costs ---------------------------------------------------------------------

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

    # ----- figures -------------------------------------------------------------------

    def stream_load(self, req: StreamRequest, streams: int = 1) -> float:
        """Busy fraction of the device one stream needs in steady state among `streams` streams (chunks/s x
        its share of a chunk's forwards at the batch size that many streams run at)."""
        return self._estimates.stream_load(req, streams)

    def predicted_load(self) -> float:
        """Busy fraction of the device the admitted streams need; recaches are left to the headroom."""
        return self._admission.device_load(self._loads())

    def stage_load(self, stage: Stage, extra: StreamRequest | None = None, extra_viewers: int = 1) -> float:
        """Predicted busy fraction of `stage` with the admitted streams (and `extra`, if given, with `extra_viewers`
        viewers)."""
        return self._admission.stage_load(stage, self._loads(), extra, extra_viewers)

    def lead_s(self, stream_id: str) -> float:
        """Buffered + in-flight video at which the stream's next fresh chunk becomes due (the start rule)."""
        return self._planner.lead_s(self._get(stream_id))

    def stream_stats(self, stream_id: str, now: float) -> StreamStats:
        """A snapshot of one stream (parked or not) for metrics."""
        return self._planner.stream_stats(self._get(stream_id), now)

    def stats(self, now: float) -> SchedulerStats:
        """A snapshot for metrics (changes nothing but forgetting recaches older than RECACHE_WINDOW_S)."""
        self._estimates.recache_load(now)
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
            pressure=self._planner.pressure(now),
            stage_load={stage: self.stage_load(stage) for stage in Stage},
            late=self._admission.closed(self._overload.late, now),
            parked=len(self._parked),
            client_late=sum(st.client_late for st in per_stream),
        )

    def table_sizes(self) -> dict[str, int]:
        """Entries of the scheduler's per-stream tables (see the server's `table_sizes`): its streams, running and
        parked, and what each keeps: the prompt texts a plan may still run under, the chunks in flight, the input
        releases. Read from another thread it is a moment's view."""
        streams = [*self._streams.values(), *self._parked.values()]
        return {"scheduler.streams": len(self._streams), "scheduler.parked": len(self._parked),
                "scheduler.prompt_texts": sum(len(s.prompt_texts) for s in streams),
                "scheduler.chunks_in_flight": sum(len(s.in_flight) for s in streams),
                "scheduler.releases": sum(len(s.releases) for s in streams)}

    # ----- internals -----------------------------------------------------------------

    def _get(self, stream_id: str) -> ScheduledStream:
        """An admitted stream, parked or not."""
        s = self._streams.get(stream_id) or self._parked.get(stream_id)
        if s is None:
            raise SchedulerError(f"stream {stream_id!r} is not admitted (admitted: {list(self._streams)}, parked: "
                                 f"{list(self._parked)})")
        return s

    def _restart_if_empty(self) -> None:
        """With no stream running (none admitted, or all parked), the cost estimates go back to the warm-up's figures
        (CostEstimates.restart): no sample comes to correct them while nothing runs, and a server with no streams
        is refused only by what its warm-up measured, never by an estimate that work outside any stream raised."""
        if not self._streams:
            self._estimates.restart()

    def _loads(self) -> list[StreamLoad]:
        """What admission knows of the admitted streams (parked ones not included), in admission order."""
        return [s.load for s in self._streams.values()]
