"""Admission: every rule by which the scheduler refuses a stream, a viewer or an unpark, with its reason text.

Admission refuses, with the numbers and the fix, a stream whose KV cache does not
fit (the pool's reason), whose chunk does not fit the cap, whose compute would put
the predicted load over `utilization_target`, or that the start rule cannot serve:
with it admitted, the predicted lead (one chunk of every stream, batched, plus the
margin) and a chunk no longer fit under `buffer_cap_s`.

Admission counts every stage a chunk passes (`Stage`): the device (its forwards), the
output stage (frames to the host, x264 and packing, on `output_capacity` workers) and
the transports' send (the event loop), and for streams with input video the input stage (its decode, scale and
encode; issue 35). The device's load counts the streams' prompt
switches as measured: the recaches of the last RECACHE_WINDOW_S, at a recache's cost.
Each stage's cost per chunk is seeded by the warm-up (`seed_stage`) and then follows the
`cost_percentile` of what serving measures (`observe_stage`); a stream is admitted only
while every stage stays under its target. A stream with input video is charged on the device
the forwards of a chunk without input (all the steps; its chunks with input run fewer): its
camera may go off, and a chunk whose input is missing runs as text-to-video (issue 41). It also
listens to what viewers get (the closed loop): while any stream was late within `late_hold_s`
by the server's own measurements (a chunk delivered after the server's own figure of its
viewer's buffer ran dry, a WebRTC track's queue on the server running dry, a chunk degraded on
the device or at the encoder against the server's own deadline: `mark_late`), nobody is
admitted, while any stream is admitted: the loop keeps the admitted streams on time, and with
none the load that made one late is gone (a server with no streams is refused only by its
warm-up's figures, issue 33). Lateness a stream's own client causes (its viewer's `stats`
reports, its input missing or late) is charged to that stream (`StreamStats.client_late`) and
never closes admission: one quiet camera or lying viewer closed it for everyone (issue 41; see
the planner and `Scheduler.observe_buffer`). And a burst is admitted in
tranches: streams that have not yet delivered `confirm_chunks` chunks are starting, and
a newcomer is admitted only while every stage can make the starting streams' first
`confirm_chunks` chunks within the first chunk's play time with the time the admitted
streams leave it; measurement confirms the room (their chunks arrive, the costs follow
them) before the next tranche.

A stream with input video is refused when one chunk of it cannot reach its viewer within its input latency
(`input_latency_s`, serve --input-latency): a chunk is due at its release (its last input frame came) and plays
`input_latency_s` later, so its predicted latency (the input stage's decode, scale and encode, its denoising
forwards from its start step and the commit, which decodes, at the batch size the streams with it run at, and
the output stage's encode on one worker, each at its cost estimate) must be at most that, or every chunk of it
is late until its viewer's playout has slid (a Wan VAE encoder and decoder on one H100: 0.62 s a chunk against
the default 0.5 s, 9 stalls in its first 7 s). The reason names the figures, the latency that would do (the
prediction plus `start_margin_s`, what the estimates miss) and the faster encoder/decoder. Waiting behind other
streams' forwards is left to the device's target and the spread phases of the streams' input. The warm-up
asks the same of one stream alone (`input_refusal`) and logs it as a warning.

A parked stream comes back (`unpark`) only if it would be admitted again now, as a
newcomer with its viewers; one more viewer of a stream (`admit_viewer`) is refused only
by the send. A KV-pool refusal is the caller's (`kv_refusal`), passed through as it is.

`AdmissionControl` decides from the admitted streams' loads (`StreamLoad`), the cost
estimates and the clock, and changes nothing but the estimates' window of recaches; the
`Scheduler` adds an accepted stream to its registry.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .config import SchedulerConfig
from .costs import CostEstimates, input_steps
from .types import EPS_S, Admission, Late, Stage, StreamLoad, StreamRequest


def _rate(stream: StreamLoad, stage: Stage) -> float:
    """Chunks a second `stream` puts through `stage`: the send sends each chunk to each of its viewers, the input
    stage only a stream's with input."""
    rate = stream.request.fps / stream.request.chunk_frames
    if stage is Stage.INPUT and stream.request.input_start_step is None:
        return 0.0
    return rate * stream.viewers if stage is Stage.SEND else rate


def _longest_chunk_s(req: StreamRequest) -> float:
    return max(req.first_chunk_frames, req.chunk_frames) / req.fps


class AdmissionControl:
    """Admits or refuses, with the reasons, given the admitted streams' loads, the cost estimates and `now` (pure)."""

    def __init__(self, config: SchedulerConfig, costs: CostEstimates) -> None:
        self.config = config
        self.costs = costs

    # ----- loads -------------------------------------------------------------------------

    def device_load(self, streams: Sequence[StreamLoad], sharing: int | None = None) -> float:
        """Busy fraction of the device `streams` need when `sharing` streams (default: all of them) share it
        (batches as that many allow), and their prompt switches: the recaches measured lately, as a rate, at the
        recache's cost."""
        sharing = len(streams) if sharing is None else sharing
        chunks = sum(self.costs.stream_load(s.request, sharing) for s in streams)
        return chunks + self.costs.recache_load()

    def stage_load(self, stage: Stage, streams: Sequence[StreamLoad], extra: StreamRequest | None = None,
                   extra_viewers: int = 1) -> float:
        """Predicted busy fraction of `stage` with `streams` (and `extra`, if given, with `extra_viewers` viewers)."""
        chunk_s = self.costs.stage_chunk_s(stage, len(streams) + (extra is not None))
        extra_rate = extra.fps / extra.chunk_frames if extra is not None else 0.0
        if stage is Stage.INPUT and extra is not None and extra.input_start_step is None:
            extra_rate = 0.0
        if stage is Stage.SEND:
            extra_rate *= extra_viewers
        return (sum(_rate(s, stage) for s in streams) + extra_rate) * chunk_s

    def target(self, stage: Stage) -> float:
        """The busy fraction admission keeps `stage` under."""
        cfg = self.config
        targets = {Stage.DEVICE: cfg.utilization_target, Stage.OUTPUT: cfg.output_target, Stage.SEND: cfg.send_target,
                   Stage.INPUT: cfg.input_target}
        return targets[stage]

    def closed(self, late: Late | None, now: float) -> bool:
        """The closed loop: a stream was late within late_hold_s, so nobody is admitted."""
        return late is not None and now - late.at < self.config.late_hold_s

    # ----- decisions ---------------------------------------------------------------------

    def admit(self, req: StreamRequest, streams: Sequence[StreamLoad], now: float, *, late: Late | None = None,
              kv_refusal: str | None = None, viewers: int = 1) -> Admission:
        """Whether `req` (with `viewers` viewers) may join the admitted `streams` at `now`; `late`: the latest
        lateness (the closed loop), `kv_refusal`: the KV pool's reason, if its cache does not fit.

        Accepted, `predicted_load` is the device's with it; refused, without it, and `reason` says every
        rule it breaks, "; "-joined."""
        cfg = self.config
        steering = self.costs.recache_load(now)
        current = self.device_load(streams)
        n = len(streams) + 1
        needed = self.costs.stream_load(req, n) + steering / max(1, n - 1)  # it steers as often as the others
        total = self.device_load(streams, n) + needed  # with it, the others may batch more (or, unmeasured, no better)
        reasons = []
        if kv_refusal is not None:
            reasons.append(f"kv cache: {kv_refusal}")
        longest_chunk_s = _longest_chunk_s(req)
        if longest_chunk_s > cfg.buffer_cap_s + EPS_S:
            reasons.append(
                f"a chunk of {longest_chunk_s:.3f} s at {req.fps:g} fps cannot fit the "
                f"{cfg.buffer_cap_s:g} s buffer cap; raise buffer_cap_s or shorten the chunk"
            )
        elif math.isfinite(cfg.start_margin_s) and math.isfinite(cfg.utilization_target):
            reasons += self._start_rule_refusals(req, streams)
        if math.isfinite(cfg.utilization_target):
            reasons += self.input_refusals(req, len(streams) + 1)
        if total > cfg.utilization_target + EPS_S:
            cost_ms = self.costs.stream_chunk_s(n) * 1e3
            reasons.append(
                f"compute: the device is {current:.2f} busy with {len(streams)} streams and this one needs "
                f"{needed:.2f} ({req.fps / req.chunk_frames:.2f} chunks/s x {cost_ms:.1f} ms per chunk), "
                f"{total:.2f} > target {cfg.utilization_target:.2f}; try again when a stream closes"
            )
        reasons += self._stage_refusals(req, streams, viewers)
        if math.isfinite(cfg.utilization_target):
            reasons += self._loop_refusals(req, streams, now, late)
        if reasons:
            return Admission(accepted=False, reason="; ".join(reasons), predicted_load=current)
        return Admission(accepted=True, reason=None, predicted_load=total)

    def admit_viewer(self, stream: StreamLoad, streams: Sequence[StreamLoad],
                     buffered_s: float | None = None) -> Admission:
        """Whether `stream` (admitted, parked or not) may send its chunks to one more viewer: the event loop's send
        with the admitted `streams` stays under its target; the device and the output stage do not change.
        `buffered_s` is passed through to an accepted `Admission`."""
        cost_s = self.costs.stage_chunk_s(Stage.SEND, len(streams))
        load = self.stage_load(Stage.SEND, streams) + stream.request.fps / stream.request.chunk_frames * cost_s
        if load > self.config.send_target + EPS_S:
            viewers = sum(t.viewers for t in streams)
            return Admission(accepted=False, predicted_load=self.device_load(streams), reason=(
                f"send: the event loop would be {load:.2f} busy sending to {viewers + 1} viewers "
                f"({cost_s * 1e3:.2f} ms per chunk sent) > target {self.config.send_target:.2f}; try again when a "
                "viewer leaves"))
        return Admission(accepted=True, reason=None, predicted_load=self.device_load(streams), buffered_s=buffered_s)

    # ----- the rules ---------------------------------------------------------------------

    def _start_rule_refusals(self, req: StreamRequest, streams: Sequence[StreamLoad]) -> list[str]:
        """With `req` admitted, do the predicted lead (one chunk of every stream, batched, plus the margin) and
        the longest chunk still fit under the buffer cap?"""
        cfg = self.config
        n = len(streams) + 1
        latency_s = self.costs.queue_work_s(n)
        lead_s = latency_s + cfg.start_margin_s
        chunk_s = max([_longest_chunk_s(req)] + [_longest_chunk_s(s.request) for s in streams])
        if lead_s + chunk_s <= cfg.buffer_cap_s + EPS_S:
            return []
        fix = math.ceil((lead_s + chunk_s) * 100 - 1e-6) / 100
        return [
            f"start rule: with {n} streams a chunk must start {lead_s:.3f} s before its buffer runs dry "
            f"({latency_s * 1e3:.1f} ms of predicted chunk latency, one chunk of every stream, + "
            f"{cfg.start_margin_s:g} s margin) and a {chunk_s:.3f} s chunk must fit above that: "
            f"{lead_s + chunk_s:.3f} s > the {cfg.buffer_cap_s:g} s buffer cap; raise the buffer cap "
            f"(--buffer-cap, buffer_cap_s) to {fix:g} s or try again when a stream closes"
        ]

    def input_refusals(self, req: StreamRequest, streams: int = 1) -> list[str]:
        """Can one chunk of `req`'s input video (if it has any) reach its viewer within its input latency, among
        `streams` streams (it included)? The predicted latency from its release to its delivery: the input stage,
        its forwards from its start step and the commit at the batch size that many streams run at, and the
        output stage's encode (one worker's)."""
        if req.input_start_step is None:
            return []
        cfg, costs = self.config, self.costs
        batch = max(1, min(streams, cfg.max_batch))
        steps = input_steps(req, cfg.denoise_steps)
        input_s, output_s = costs.stage.estimate(Stage.INPUT), costs.stage.estimate(Stage.OUTPUT)
        forwards_s = costs.chunk_s(batch, steps)
        latency_s = input_s + forwards_s + output_s
        if latency_s <= req.input_latency_s + EPS_S:
            return []
        margin_s = cfg.start_margin_s if math.isfinite(cfg.start_margin_s) else 0.0
        fix = math.ceil((latency_s + margin_s) * 10 - 1e-6) / 10
        batched = f" in batches of {batch}" if batch > 1 else ""
        fewer = ", a lower strength (fewer denoising steps)" if steps > 1 else ""
        return [
            f"input latency: an input chunk takes {latency_s:.2f} s on this device ({input_s * 1e3:.1f} ms input "
            f"stage (decode, scale, encode) + {forwards_s * 1e3:.1f} ms for {steps} denoising forward(s) and the "
            f"commit with its decode{batched} + {output_s * 1e3:.1f} ms output stage) and --input-latency is "
            f"{req.input_latency_s:.2f} s: serve with --input-latency {fix:g}{fewer}, or a faster encoder/decoder "
            "(--decoder taehv)"
        ]

    def _stage_refusals(self, req: StreamRequest, streams: Sequence[StreamLoad], viewers: int = 1) -> list[str]:
        """The output stage and the send, with `req` admitted: over their targets? (The device is checked apart.)"""
        cfg = self.config
        reasons = []
        stages = ((Stage.OUTPUT, f"{cfg.output_capacity:g} output worker(s)"), (Stage.SEND, "the event loop"),
                  (Stage.INPUT, "the input stage (decode, scale, encode)"))
        for stage, what in stages:
            load, target = self.stage_load(stage, streams, req, viewers), self.target(stage)
            if load > target + EPS_S:
                reasons.append(
                    f"{stage.value}: {what} would be {load:.2f} busy with {len(streams) + 1} streams "
                    f"({self.costs.stage.estimate(stage) * 1e3:.1f} ms per chunk) > target {target:.2f}; try again "
                    "when a stream closes"
                )
        return reasons

    def _loop_refusals(self, req: StreamRequest, streams: Sequence[StreamLoad], now: float,
                       late: Late | None) -> list[str]:
        """The closed loop (a stream late lately, while streams are admitted) and the tranche (streams still
        starting)."""
        cfg = self.config
        if streams and self.closed(late, now):
            return [
                f"closed loop: stream {late.stream_id} was late {now - late.at:.1f} s ago ({late.what}); admission "
                f"reopens once every stream has been on time for {cfg.late_hold_s:g} s"
            ]
        starting = [s for s in streams if s.chunks_delivered < cfg.confirm_chunks]
        if not starting:
            return []
        # The k-th of k newcomers gets its first delivery after all k first deliveries (each of one chunk, or two
        # where a lone first frame waits for the second) and the first newcomer needs its next chunk within its first
        # delivery's play time: k deliveries of each stage must fit in one (the first newcomer's own) plus that window
        # at the stage's target, beside the streams already confirmed.
        first_chunks, first_frames = req.first_delivery
        window_s = first_frames / req.fps
        n = len(streams) + 1
        others = [s for s in streams if not s.chunks_delivered < cfg.confirm_chunks]
        for stage in Stage:
            if stage is Stage.INPUT and req.input_start_step is None:
                continue
            chunk_s, target = self.costs.stage_chunk_s(stage, n), self.target(stage)
            busy = sum(_rate(s, stage) for s in others) * chunk_s
            room_s = max(0.0, target - busy) * window_s + first_chunks * chunk_s
            if (len(starting) + 1) * first_chunks * chunk_s > room_s + EPS_S:
                since = now - min(s.admitted_at for s in starting)
                return [
                    f"starting: {len(starting)} streams admitted in the last {since:.1f} s have not yet delivered "
                    f"{cfg.confirm_chunks} chunks, and the {stage.value} starts "
                    f"{int(room_s / (first_chunks * chunk_s) + EPS_S)} at "
                    f"once ({chunk_s * 1e3:.1f} ms per chunk, each stream's next chunk due within {window_s:.2f} s "
                    f"of its first, {busy:.2f} busy with the others, target {target:.2f}); try again in a second"
                ]
        return []
