"""The scheduler's one configuration, validated at construction, and its policies.

Every knob of the scheduling package is a field of `SchedulerConfig`; each module's
docstring says what its knobs do (the start rule, ranking, prompts and degrading in
`planner`, costs in `costs`, admission in `admission`, the last resort in `overload`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

POLICIES = ("slack", "least_slack", "round_robin", "fifo")


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
    # a new prompt's first chunk cuts: its viewers drop the older frames they hold and have not shown (its header's
    # `cut`), and the buffer model holds that chunk alone from its delivery
    prompt_cut: bool = False
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
    # degraded_steps); (): never degrade. See "Degrading" in scheduling/planner.py.
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
    input_target: float = 0.5  # busy fraction admission keeps the input stage (decode, scale, encode) under
    # A cost sample (the send's CPU per chunk; a CPU forward's wall time) less the event loop's work for clients
    # without a stream over the same time; dropped instead where that work was over this share of it (see costs).
    streamless_max_share: float = 0.1
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
        for name in ("output_target", "send_target", "input_target"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be > 0 (e.g. 0.7; math.inf turns the check off)")
        if not 0 < self.streamless_max_share <= 1:
            raise ValueError(f"streamless_max_share={self.streamless_max_share}: must be in (0, 1] (e.g. 0.1)")
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
