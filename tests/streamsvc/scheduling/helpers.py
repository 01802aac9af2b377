"""Shared helpers of the scheduling tests: exact costs, a scheduler maker, a clock that runs plans.

Times and costs are multiples of 1/16 s so every figure is exact in binary floating point:
a forward costs 1/16 s, a chunk (4 DENOISE + 1 COMMIT) 5/16 s, and at 16 fps the first
chunk (9 frames) plays 0.5625 s and a later one (12 frames) 0.75 s.
"""

from __future__ import annotations

import math

from models.work import WorkKind
from streamsvc.scheduling import Plan, Scheduler, SchedulerConfig, StreamRequest

FPS = 16.0
COST = 0.0625  # one forward
CHUNK_WORK = 5 * COST  # one chunk's forwards
MARGIN = 0.25  # start_margin_s (the default, exact in binary)
# The forward-level baselines: no start rule (every stream runs ahead to the cap), no chunk-granular preference.
PLAIN = {"start_margin_s": math.inf, "chunk_granular": False}
D, C, R = WorkKind.DENOISE, WorkKind.COMMIT, WorkKind.RECACHE


def make(**overrides) -> Scheduler:
    """A scheduler with exact costs and margin; admission off unless a test is about it."""
    defaults = {"initial_forward_s": COST, "utilization_target": math.inf, "start_margin_s": MARGIN}
    return Scheduler(SchedulerConfig(**{**defaults, **overrides}))


def admit(sched: Scheduler, *ids: str, now: float = 0.0) -> None:
    for stream_id in ids:
        assert sched.admit(StreamRequest(stream_id, FPS), now).accepted


class Clock:
    """Runs plans one after another, each taking `cost` seconds, and records them."""

    def __init__(self, sched: Scheduler, now: float = 0.0, cost: float = COST) -> None:
        self.sched, self.now, self.cost = sched, now, cost
        self.delivered: list[tuple[float, str]] = []

    def step(self) -> Plan | None:
        plan = self.sched.next(self.now)
        if plan is not None:
            self.now += self.cost
            for stream_id in self.sched.complete(plan, self.now, self.cost):
                self.delivered.append((self.now, stream_id))
        return plan

    def run(self, n: int) -> list[tuple[WorkKind, tuple[str, ...], int]]:
        plans = []
        for _ in range(n):
            plan = self.step()
            assert plan is not None
            plans.append((plan.kind, plan.stream_ids, plan.step))
        return plans

    def ids(self, n: int) -> list[str]:
        return ["+".join(ids) for _, ids, _ in self.run(n)]

    def launch(self, n: int, elapsed_s: float | None = COST) -> list[Plan]:
        """Run `n` plans as the engine does: each counted done at its end (`cost` later) with its
        frames in flight (deliver=False) and `elapsed_s` as its measured cost (None: not known)."""
        plans = []
        for _ in range(n):
            plan = self.sched.next(self.now)
            assert plan is not None
            self.now += self.cost
            assert self.sched.complete(plan, self.now, elapsed_s, deliver=False) == []
            plans.append(plan)
        return plans


CHUNK = [(D, 0), (D, 1), (D, 2), (D, 3), (C, 4)]
DEGRADE = {"degrade_steps": (3, 2), "degrade_margin_s": 0.125}  # the margin exact in binary


def first_chunk(sched: Scheduler) -> float:
    """Run stream "a"'s first chunk (delivered at 0.3125: 9 frames, dry at 0.875); returns the time."""
    clock = Clock(sched)
    assert clock.run(5) == [(k, ("a",), s) for k, s in CHUNK]
    return clock.now
