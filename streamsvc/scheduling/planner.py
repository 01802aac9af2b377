"""The planner: which stream's forward runs next (`next`), and what its completion changes (`complete`).

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
(steering latency); it is not what keeps a stream fed, the lead is. The cap holds by the
server's own figure of the buffer too (`PlaybackModel.own`): a viewer whose reports say it is
short makes its stream urgent, not run further ahead than that. A stream with a
prompt pending (no chunk yet started under its newest prompt) may start as soon as
the cap allows: running ahead under the new prompt is what its viewer wants. A chunk
in progress goes on while under the cap; a RECACHE is always runnable (no video).
`start_margin_s=math.inf` turns the rule off: every stream runs ahead to the cap.

Which runnable stream goes first: see `ranking` (slack, the stall guard, the policies).

Prompts: the next chunk runs under the newest prompt planned, after a RECACHE when the
stream has committed frames. Prompts are coalesced before they are planned (and only
there: `ScheduledStream.new_prompt`): the first since the last commit at once, a later one at
the next commit, the newest of those that came meanwhile. A chunk in progress is abandoned for the new prompt
(`restart_on_prompt`) only while the stream keeps `restart_margin_chunks` chunks
of slack after redoing it (with `prompt_cut`, the RECACHE's headroom: the chunk's frames would be cut anyway, and
the lead holds a switch's reserve, `switch_reserve_s`, so that a prompt goes at once); a RECACHE that would leave
the stream less slack than `start_margin_s` (one forward at least), where skipping it would not stall it,
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
carries the choice; the engine tags the chunk with it. A degraded chunk is lateness (the
closed loop), and one that ran its fewest steps short is evidence for the last resort
(see `overload`), when the server's own account demanded it (`ScheduledStream.server_dry_in`).

Whose lateness (issue 41). The planner plans on its viewer's buffer as the viewer's reports
leave it (a viewer behind the model makes its stream urgent), but lateness is the server's only
by its own account: the server's own figure of that buffer (`PlaybackModel.own`: deliveries,
pauses, its WebRTC track's queue), and for a chunk of input video its promise, delivery within
`input_latency_s` of the chunk's release. A chunk delivered after the own figure ran dry (past
its grace) and after that promise, or degraded when with all its steps it would miss that
deadline by the degrade margin, is the server's (`overload`); a chunk whose input was missing is
its client's whatever happens to it. What the server's account does not see (the viewer's
report, input that came late or not at all) is charged to the stream (`ScheduledStream.client_late`).

Input video (issue 35). A chunk of a stream with input starts only once released (`Scheduler.release`: its last
input frame came, or its input was declared missing), and then at once, whatever its lead (the viewer plays it
`input_latency_s` after its release; the cap still bounds it): it cannot run ahead of its input, and waiting for
the lead would only spend its deadline. It starts at its release's start step (the stream's strength, snapped;
0 when its input was missing), so it runs fewer forwards (`ScheduledStream.forwards`): steps k .. max(n, k + 1) - 1
for a chunk of n steps (degrading drops steps after the start step). Plan.step counts a chunk's forwards from 0 (the
engine adds k); Plan.steps is n, the schedule's step the chunk ends at. A chunk is degraded when it runs fewer
forwards than its full count from its start step. A new prompt never restarts a chunk of input video in progress
(the next chunk takes it): its deadline is short, and streams with input released together (viewers started
together) have theirs at the same time, so the redone work would come when every stream needs the device. The first
chunk with input frames plays from its release + input_latency_s + (chunk_frames - first_chunk_frames) / fps: from
then on chunk c (c >= 1) is due exactly input_latency_s after its release when the input comes in real time. A chunk
whose input is missing is released by its viewer's buffer instead (`release_by`: the buffer's dry time less its
lead, the output stage and the forwards of text-to-video beyond a chunk with frames), so that it runs all its steps
and is on time (issue 41).

Parking: a stream held for parking (`ScheduledStream.parking`) starts no new chunk nor RECACHE, and
a new prompt does not restart its chunk in progress; once that chunk is committed and the
stream is in no outstanding plan it is `parkable`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from models.work import WorkKind

from .config import SchedulerConfig
from .costs import CostEstimates, input_steps, percentile
from .overload import OverloadMonitor
from .ranking import rank_key
from .stream import InFlight, ScheduledStream, NextWork
from .types import EPS_S, RECACHE_STAGE, Plan, SchedulerError, Stage, StreamStats


@dataclass(frozen=True)
class _Outstanding:
    plan: Plan  # handed out by next(), not yet completed or cancelled
    orders: tuple[int, ...]  # admission order of each of its streams (a re-admitted id is another stream)
    # Per stream: when its chunk became due, for a forward that starts a chunk (RECACHE, step 0); else None.
    due_at: tuple[float | None, ...]
    due: tuple[bool, ...]  # per stream: at or under its lead when the plan was made (see NextWork.due)


class Planner:
    """Plans one forward at a time over the registry's admitted streams, and advances them as plans complete."""

    def __init__(self, config: SchedulerConfig, costs: CostEstimates, overload: OverloadMonitor,
                 streams: Mapping[str, ScheduledStream]) -> None:
        self.config = config
        self.costs = costs
        self.overload = overload
        self._streams = streams  # the registry's admitted streams, parked ones not included (a live view)
        self._rr_cursor = -1  # admission order of the stream round robin served last
        self._outstanding: _Outstanding | None = None
        self._pressure_until = -math.inf  # until then a chunk was recently degraded (see pressure_hold_s)
        self._late_margin = False  # late_margin_s is in force (a stream stalled within late_margin_hold_s)

    # ----- the plan contract -------------------------------------------------------------

    def next(self, now: float) -> Plan | None:
        """The next forward to run, or None when no stream may start work (no streams, all above their lead)."""
        if self._outstanding is not None:
            raise SchedulerError(
                f"plan {self._outstanding.plan.kind.value} for {self._outstanding.plan.stream_ids} is still "
                "outstanding; call complete() or cancel() with it first"
            )
        cfg = self.config
        self._late_margin = now - self.overload.last_stall_at < cfg.late_margin_hold_s
        candidates = []
        for s in self._streams.values():
            s.playback.advance(now)
            work = self._work(s, now)
            if work.runnable:
                candidates.append((s, work))
        if not candidates:
            return None
        guard_s = (cfg.stall_guard_chunks or 0.0) * self.costs.chunk_s()  # slack under which a stream is about to stall
        candidates.sort(key=lambda c: rank_key(c[0], c[1], cfg, guard_s, self._rr_cursor))
        leader, leader_work = candidates[0]
        batch = [(leader, leader_work)]
        for s, work in candidates[1:]:
            if len(batch) == cfg.max_batch:
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
            prompts=tuple(s.prompt_texts[w.prompt_seq] for s, w in batch),
        )
        floor = min(cfg.degrade_steps, default=cfg.denoise_steps)
        for s, w in batch:
            server_dry_in = s.server_dry_in(now)  # the server's own account: not its client's reports nor input
            if s.forwards(w.steps) < s.forwards(cfg.denoise_steps):
                done = s.step if s.step > 0 and not w.restart else 0
                full_s = self.costs.chunk_s(steps=s.forwards(cfg.denoise_steps) - done)
                full_s += self.costs.recache_s() if w.kind is WorkKind.RECACHE else 0.0
                if server_dry_in - full_s < cfg.degrade_margin_s:  # the server was short: lateness, pressure
                    self._pressure_until = now + cfg.pressure_hold_s
                    self.overload.mark_late(s.request.stream_id, now,
                                            f"a chunk ran {w.steps} of {cfg.denoise_steps} steps to stay ahead")
                elif w.kind is WorkKind.COMMIT:  # its client made it urgent (a report lower than the server's
                    s.client_late += 1  # figure, input late or missing): counted once a chunk, at its commit
            playing = s.playback.started and not s.playback.paused
            fewest = s.forwards(w.steps) <= s.forwards(floor)
            if playing and w.kind is not WorkKind.RECACHE and fewest and w.slack_s < cfg.degrade_margin_s \
                    and server_dry_in - w.remaining_s < cfg.degrade_margin_s:
                self.overload.exhausted(now)  # the fewest steps it may run do not leave it the margin
        self._outstanding = _Outstanding(
            plan=plan,
            orders=tuple(s.order for s, _ in batch),
            due_at=tuple(self._due_at(s, now) if w.step <= 0 else None for s, w in batch),
            due=tuple(w.due for _, w in batch),
        )
        return plan

    def complete(self, plan: Plan, now: float, elapsed_s: float | None, deliver: bool = True) -> list[str]:
        """`plan` ran (or was launched): advance its streams, and the cost estimate by `elapsed_s` (see
        `Scheduler.complete`). Returns the streams whose chunk was delivered now."""
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
            self.costs.forward.observe(plan.kind, len(plan.stream_ids), elapsed_s)
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
                self.costs.recached(now)
                s.step = 0  # a partial chunk (if any) is abandoned
                s.cache_seq = prompt_seq
            elif plan.kind is WorkKind.DENOISE:
                s.steps = chunk_steps
                if plan.step == 0:
                    s.chunk_seq, s.after_cut = prompt_seq, False
                    if prompt_seq < s.prompt_seq and s.chunks_done > 0:  # made without the newest prompt
                        s.deferred_seq = s.prompt_seq
                s.step = plan.step + 1
            else:
                req = s.request
                frames = req.first_chunk_frames if s.chunks_done == 0 else req.chunk_frames
                s.degraded += s.forwards(chunk_steps) < s.forwards(self.config.denoise_steps)
                release = s.releases.pop(s.chunks_done, None)
                play_from, owed_at = None, None
                if release is not None and release[2]:  # input frames: owed to its viewer input_latency_s after
                    owed_at = release[1] + req.input_latency_s
                    if s.chunks_done == 0:  # the first chunk of input frames
                        play_from = owed_at + (req.chunk_frames - req.first_chunk_frames) / req.fps
                # (not a stream of input video: its frames play on its camera's timeline, each a set time after capture)
                cut = (self.config.prompt_cut and req.input_start_step is None and s.chunks_done > 0
                       and s.chunk_seq > s.shown_seq)
                s.shown_seq, s.after_cut = s.chunk_seq, cut
                chunk = InFlight(frames, now if s.chunk_due_at is None else s.chunk_due_at, s.chunk_sampled, play_from,
                                  missing=release is not None and not release[2], owed_at=owed_at, cut=cut)
                s.chunk_due_at = None
                s.last_commit_at = now
                s.chunks_done += 1
                s.cache_seq = s.chunk_seq  # the committed frames' K/V were computed under the chunk's prompt
                s.step = 0
                s.chunk_committed(now)  # a prompt that waited for this chunk is planned
                if deliver:
                    self._credit(s, chunk, now)
                    delivered.append(stream_id)
                else:
                    s.in_flight.append(chunk)
        return delivered

    def delivered(self, s: ScheduledStream, now: float) -> float:
        """The oldest in-flight chunk of `s` (admitted, parked or not) reached the transports at `now`; returns its
        latency (see `Scheduler.delivered`)."""
        if not s.in_flight:
            raise SchedulerError(
                f"stream {s.request.stream_id!r} has no chunk in flight (committed {s.chunks_done}); "
                "call delivered() once per COMMIT completed with deliver=False"
            )
        return self._credit(s, s.in_flight.popleft(), now)

    def cancel(self, plan: Plan) -> None:
        """`plan` will not run: forget it, nothing advances."""
        self._take_outstanding(plan)

    def busy(self, stream_id: str) -> bool:
        """Whether the stream is in the outstanding plan."""
        return self._outstanding is not None and stream_id in self._outstanding.plan.stream_ids

    def parkable(self, s: ScheduledStream) -> bool:
        """Whether the admitted stream `s` is held, between chunks and in no outstanding plan: it may be parked."""
        return s.parking and s.step == 0 and not self.busy(s.request.stream_id)

    def pressure(self, now: float) -> bool:
        """A chunk was degraded within pressure_hold_s: no stream steers ahead of its lead."""
        return now < self._pressure_until

    def wake_at(self, now: float) -> float | None:
        """Earliest time a stream becomes runnable by playback alone (see `Scheduler.wake_at`)."""
        wake = math.inf
        for s in self._streams.values():
            work = self._work(s, now)
            if work.runnable:
                return now
            if s.step == 0 and not s.released():  # waits for its input (the engine's release), not for the clock
                continue
            if s.playback.paused or s.playback.dry_at() is None or s.parking:  # not draining, or held for parking
                continue
            buffered = s.playback.seconds(now)
            excess = buffered + s.in_flight_s() - self._start_threshold_s(s, work.kind, work.step, now)
            if excess <= buffered + EPS_S:  # the buffer alone can drain that much
                at = now + max(0.0, excess)
                if work.kind is not WorkKind.RECACHE:  # and the server's own figure to the cap
                    at = max(at, now + self._over_own_cap_s(s, now))
                wake = min(wake, at)
        return None if wake == math.inf else wake

    # ----- figures -----------------------------------------------------------------------

    def lead_s(self, s: ScheduledStream) -> float:
        """The start rule's lead: the lead_percentile of its chunk latencies (at least the prediction while samples
        are few) + the margin (+ the late margin while a stream stalled within late_margin_hold_s)."""
        cfg = self.config
        measured = percentile(s.latencies, cfg.lead_percentile)
        latency = measured
        if measured is None or s.fresh_samples < cfg.latency_min_samples:
            latency = max(measured or 0.0, self._predicted_latency_s(s))
        late = cfg.late_margin_s if self._late_margin else 0.0
        return latency + cfg.start_margin_s + late + self.switch_reserve_s(s)

    def switch_reserve_s(self, s: ScheduledStream) -> float:
        """With `prompt_cut`, the video a steerable stream keeps beyond its lead: a new prompt's RECACHE and first
        chunk (abandoning the chunk in progress) then fit in the buffer, so the prompt never waits a chunk. What it
        costs is the frames its cut drops, not latency: a cut shows the new prompt whatever the buffer holds."""
        if not self.config.prompt_cut or s.has_input or s.chunks_done == 0:
            return 0.0
        return self.costs.recache_s() + self.costs.chunk_s()

    def release_by(self, s: ScheduledStream, frames: bool) -> float | None:
        """The latest release of stream `s`'s next chunk of input video that reaches its viewer on time (see
        `Scheduler.release_by`); None while its viewer is not playing."""
        cfg = self.config
        dry_at = s.playback.dry_at()
        if dry_at is None:
            return None
        deadline = dry_at + s.in_flight_s()
        lead = self.lead_s(s) + self.costs.stage.estimate(Stage.OUTPUT)
        if s.step > 0:  # its chunk in progress comes first: its frames play before, its forwards left run before
            deadline += s.next_chunk_s()
            lead += self.costs.chunk_s(steps=max(0, s.forwards(s.steps) - s.step))
        if not frames:  # text-to-video: the forwards it runs beyond a chunk with frames
            lead += self.costs.chunk_s() - self.costs.chunk_s(steps=input_steps(s.request, cfg.denoise_steps))
        return deadline - lead

    def stream_stats(self, s: ScheduledStream, now: float) -> StreamStats:
        """A snapshot of stream `s` (admitted, parked or not) for metrics."""
        work = self._work(s, now)
        pb = s.playback
        return StreamStats(
            stream_id=s.request.stream_id,
            buffered_s=pb.seconds(now),
            slack_s=work.slack_s,
            runnable=work.runnable,
            paused=pb.paused,
            chunks_delivered=s.chunks_delivered,
            stalls=pb.stall_count(now),
            stall_s=pb.stall_seconds(now),
            ttff_s=None if s.first_delivered_at is None else s.first_delivered_at - s.admitted_at,
            prompt_pending=s.prompt_pending(),
            in_flight_s=s.in_flight_s(),
            lead_s=self.lead_s(s),
            latency_p95_s=percentile(s.latencies, 0.95),
            degraded_chunks=s.degraded,
            client_late=s.client_late,
        )

    # ----- internals ---------------------------------------------------------------------

    def _take_outstanding(self, plan: Plan) -> _Outstanding:
        """Clear the outstanding plan, which must be `plan`, and return it."""
        if self._outstanding is None or self._outstanding.plan != plan:
            raise SchedulerError(f"plan {plan.kind.value} for {plan.stream_ids} is not the outstanding plan")
        outstanding = self._outstanding
        self._outstanding = None
        return outstanding

    def _credit(self, s: ScheduledStream, chunk: InFlight, now: float) -> float:
        """The viewer gets `chunk` at `now`; returns its latency, recorded if the chunk started due."""
        s.playback.advance(now)
        own = s.playback.own or s.playback
        if own.dry_counted and not chunk.missing and (chunk.owed_at is None or now - own.grace_s > chunk.owed_at):
            # late by the server's own account: overload (the closed loop, the late margin, the last resort)
            self.overload.stalled(s.request.stream_id, now, f"chunk {s.chunks_done - len(s.in_flight) - 1} reached "
                                  f"its viewer {now - own.dry_since:.2f} s after the buffer ran dry")
        elif s.playback.dry_counted:  # late by its viewer's report, or its input missing or late: its client's
            s.client_late += 1
        s.last_missing = chunk.missing
        s.playback.deliver(chunk.frames, now, hold_until=chunk.play_from, cut=chunk.cut)
        if s.first_delivered_at is None:
            s.first_delivered_at = now
        latency = max(0.0, now - chunk.due_at)
        if chunk.sampled:
            s.latencies.append(latency)
            s.fresh_samples += 1
        return latency

    def _predicted_latency_s(self, s: ScheduledStream) -> float:
        """A chunk's latency before enough are measured: one chunk of every stream, and its own RECACHE."""
        return self.costs.queue_work_s(len(self._streams)) + (self.costs.recache_s() if s.recache_pending() else 0.0)

    def _start_threshold_s(self, s: ScheduledStream, kind: WorkKind, step: int, now: float) -> float:
        """Buffered + in-flight video at or under which the stream's `kind` forward at `step` may start."""
        cap_s = self.config.buffer_cap_s - s.next_chunk_s()
        if step > 0:  # a chunk in progress goes on
            return cap_s
        if now < self._pressure_until:  # the device is short (a chunk was degraded): no steering ahead of the lead,
            lead = self.lead_s(s)
            if kind is WorkKind.RECACHE:  # but a prompt's RECACHE goes early enough to leave the chunk its lead (held
                # to the lead itself it no longer fits there, and the prompt waits a whole chunk)
                lead += self.costs.recache_s() + self._recache_headroom_s()
            return min(cap_s, lead)
        if kind is WorkKind.RECACHE:  # it adds no video
            return math.inf
        return cap_s if s.steering() else min(cap_s, self.lead_s(s))  # steering runs ahead to the cap

    def _due_at(self, s: ScheduledStream, now: float) -> float:
        """When the stream's next chunk became due under the start rule, `now` at the latest (pure).

        Not before its previous COMMIT (or its admission). A playing stream: when its
        buffered + in-flight video fell to its lead, or, steering to a new prompt, to the
        cap (not before the prompt came), whichever is earlier. A paused stream: `now`.
        """
        pb = s.playback
        dry_at = pb.dry_at()
        if pb.paused:
            return now
        if s.chunks_done in s.releases:  # input video: due at its release
            return max(s.last_commit_at, min(now, s.releases[s.chunks_done][1]))
        if dry_at is None:  # not started: due since its previous chunk (or admission)
            return s.last_commit_at
        ahead_until = dry_at + s.in_flight_s()  # when buffered + in flight would run out
        cap_s = self.config.buffer_cap_s - s.next_chunk_s()
        due = ahead_until - min(cap_s, self.lead_s(s))
        if s.steering():
            due = min(due, max(s.prompt_at, ahead_until - cap_s))
        return max(s.last_commit_at, min(now, due))

    def _steps(self, s: ScheduledStream, now: float, done: int, steps: int, extra_s: float) -> int:
        """Denoising steps for the stream's chunk, which has run `done` of its `steps` (a fresh chunk: 0 of all).

        Degrading: a playing stream whose buffer (in flight included) would run dry less than
        `degrade_margin_s` after its chunk's forwards (and `extra_s`, a pending RECACHE) runs the chunk with
        fewer steps, the most of `degrade_steps` that leave it that margin, else the fewest; a chunk in progress
        can be cut down to the steps it has run (its COMMIT next). A stream with slack to spare, one not
        yet playing (nothing can stall) or a paused one keeps its steps.
        """
        options, seen = [], {s.forwards(steps)}  # (with input, several counts may run the same forwards: the most)
        for n in sorted(self.config.degrade_steps, reverse=True):
            if n < steps and done <= s.forwards(n) and s.forwards(n) not in seen:
                options.append(n)
                seen.add(s.forwards(n))
        pb = s.playback
        if not options or pb.paused or not (pb.started or s.in_flight):
            return steps
        dry_in = self._slack(s, now, 0.0, plain=False)
        margin = self.config.degrade_margin_s
        for n in (steps, *options):
            if dry_in - self.costs.chunk_s(steps=s.forwards(n) - done) - extra_s >= margin:
                return n
        return options[-1]

    def _recache_headroom_s(self) -> float:
        """Slack a RECACHE must leave, else it waits a chunk: the start margin (what the estimates do not
        see: the hand-over, a forward already queued on the device, jitter), at least one forward."""
        margin = self.config.start_margin_s
        return max(self.costs.forward.estimate(WorkKind.DENOISE), margin if math.isfinite(margin) else 0.0)

    def _slack(self, s: ScheduledStream, now: float, remaining_s: float, plain: bool) -> float:
        """Time until the buffer (in flight included) runs dry minus `remaining_s`.

        `plain` (least_slack): the buffered seconds, 0 for a newcomer or a stalled stream.
        Otherwise a newcomer runs dry `startup_slack_s` after admission and a stalled
        stream ran dry when its stall began, so both grow more urgent as they wait.
        """
        pb = s.playback
        if pb.paused:
            return math.inf
        in_flight = s.in_flight_s()
        if plain:
            dry_in = pb.seconds(now) + in_flight
        elif pb.started:
            dry_in = pb.dry_at() - now + in_flight
        elif s.in_flight:  # the first chunk is on its way: it plays from its arrival, about now
            dry_in = in_flight
        else:
            dry_in = s.admitted_at + self.config.startup_slack_s - now
        return dry_in - remaining_s

    def _work(self, s: ScheduledStream, now: float) -> NextWork:
        """What stream `s` would run next, how urgent it is, and whether it may start (pure)."""
        cfg = self.config
        plain = cfg.policy == "least_slack"
        chunk_s = self.costs.chunk_s()
        recache_s = self.costs.recache_s()
        restart = False
        if s.step > 0 and s.prompt_seq > s.chunk_seq and cfg.restart_on_prompt and not s.parking and not s.has_input:
            # A new prompt arrived mid-chunk: start over under it if the buffer lasts that long.
            redo_s = chunk_s + (recache_s if s.chunks_done > 0 else 0.0)
            # with prompt_cut the chunk's frames would be cut anyway: it must leave only what a RECACHE must
            margin_s = self._recache_headroom_s() if cfg.prompt_cut else cfg.restart_margin_chunks * chunk_s
            restart = self._slack(s, now, redo_s, plain) >= margin_s
        if s.step > 0 and not restart:  # go on with the chunk in progress (or cut it short)
            steps = self._steps(s, now, s.step, s.steps, 0.0)
            forwards = s.forwards(steps)
            kind = WorkKind.DENOISE if s.step < forwards else WorkKind.COMMIT
            step = s.step if kind is WorkKind.DENOISE else cfg.denoise_steps
            prompt_seq = s.chunk_seq
            remaining_s = self.costs.chunk_s(steps=forwards - s.step)
            forwards_left = forwards - s.step + 1
        else:  # a fresh chunk
            recache = s.recache_pending()
            if recache and not restart and s.deferred_seq <= s.cache_seq:
                headroom_s = self._recache_headroom_s()
                with_recache = self._slack(s, now, chunk_s + recache_s, plain)
                if with_recache < headroom_s and self._slack(s, now, chunk_s, plain) >= 0:
                    # With the recache the stream would (nearly) stall, without it the chunk makes it:
                    # the prompt waits one chunk (that chunk keeps the prompt the cache holds). One chunk since
                    # the cache's prompt, not one per prompt: under a flood each commit plans a newer one, and
                    # the stream would never switch.
                    recache = False
            extra_s = recache_s if recache else 0.0
            steps = self._steps(s, now, 0, cfg.denoise_steps, extra_s)
            if recache:
                kind, step, prompt_seq = WorkKind.RECACHE, RECACHE_STAGE, s.prompt_seq
            else:  # a committed stream's chunk runs under the prompt its cache holds
                prompt_seq = s.cache_seq if s.chunks_done > 0 else s.prompt_seq
                kind, step = WorkKind.DENOISE, 0
            remaining_s = self.costs.chunk_s(steps=s.forwards(steps)) + extra_s
            forwards_left = s.forwards(steps) + 1
        work = NextWork(
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
        ahead_s = s.playback.seconds(now) + s.in_flight_s()
        gated = s.has_input and kind is WorkKind.DENOISE and s.step == 0  # a fresh chunk of input video
        if gated and not s.released():
            return replace(work, runnable=False, due=False)
        if ahead_s > self.lead_s(s) + EPS_S and not gated:
            work = replace(work, due=False)
        threshold = cfg.buffer_cap_s - s.next_chunk_s() if gated else self._start_threshold_s(s, kind, step, now)
        if ahead_s > threshold + EPS_S or (s.parking and step <= 0):
            work = replace(work, runnable=False)  # above the threshold, or held for parking between chunks
        elif kind is not WorkKind.RECACHE and self._over_own_cap_s(s, now) > EPS_S:
            work = replace(work, runnable=False)  # its viewer's reports say it is short, the server's figure is full
        return work

    def _over_own_cap_s(self, s: ScheduledStream, now: float) -> float:
        """How far the server's own figure of the stream's buffer (in flight included) is above the cap less its next
        chunk (<= 0: not above). A viewer's reports may make its stream urgent, not run further ahead than the cap
        by the server's account: one reporting 0 four times a second had a chunk made every report (issue 41)."""
        own = s.playback.own
        if own is None:
            return 0.0
        return own.seconds(now) + s.in_flight_s() - (self.config.buffer_cap_s - s.next_chunk_s())
