"""What the load test's own machine does to its figures: pauses of the viewers' event loop (``LoopPauses``, and
``own_stalls``: the stalls that overlap one, the load test's and not the server's) and the CPU time the hypervisor
gave to other guests (``cpu_ticks``, ``steal_fraction``, noted above ``STEAL_WARN``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from client.viewer import StreamResult, max_count


class LoopPauses:
    """Pauses of the viewers' own event loop: a ticker that sleeps `period_s` records every wake-up later than
    `min_pause_s` as (when the pause began, its length) on the monotonic clock. All viewers share one process
    and one loop; a viewer whose loop is held up past its buffer stalls however fast the server is, so the
    report counts the stalls that overlap such a pause apart (see `own_stalls`).

    Whose fault a pause is: `busy` holds the loop thread's own CPU time in each pause. A pause the loop spent
    working (busy close to its length) is the viewers' own cost (decoding, parsing, many viewers served in one
    turn); one it spent waiting (busy far below its length) is a CPU taken by other processes: the server's
    threads on a host of few cores."""

    def __init__(self, period_s: float = 0.01, min_pause_s: float = 0.05) -> None:
        self.period_s, self.min_pause_s = period_s, min_pause_s
        self.pauses: list[tuple[float, float]] = []
        self.busy: list[float] = []  # the loop thread's CPU seconds in each of `pauses`
        self.max_s = 0.0

    async def run(self, until: float) -> None:
        for _ in range(max_count(max(0.0, until - time.monotonic()), self.period_s)):
            t, cpu = time.monotonic(), time.thread_time()
            if t >= until:
                return
            await asyncio.sleep(self.period_s)
            late = time.monotonic() - t - self.period_s
            self.max_s = max(self.max_s, late)
            if late >= self.min_pause_s:
                self.pauses.append((t + self.period_s, late))
                self.busy.append(time.thread_time() - cpu)

    def figures(self) -> dict:
        """The report's ``client_loop`` section."""
        return {"pause_max_s": round(self.max_s, 4), "pauses_over_50ms": len(self.pauses),
                "paused_s": round(sum(lag for _, lag in self.pauses), 3),
                "busy_in_pauses_s": round(sum(self.busy), 3)}  # the loop's own CPU time in them (see the class)


def own_stalls(results: Sequence[StreamResult], pauses: Sequence[tuple[float, float]]) -> int:
    """Stalls that overlap a pause of the viewers' own event loop (the load test's, not the server's)."""
    return overlapping([span for r in results for span in stall_spans(r.connected_at, r.stall_events)], pauses)[0]


def stall_spans(connected_at: float | None, stall_events: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """A viewer's ended stalls (`stall_events`: seconds from its connect to the stall's end, the stall's length) as
    (start, length) on the monotonic clock, where the loop's pauses are; none for a viewer that never connected."""
    if connected_at is None:
        return []
    return [(connected_at + end - length, length) for end, length in stall_events]


def overlapping(stalls: Sequence[tuple[float, float]], pauses: Sequence[tuple[float, float]]) -> tuple[int, float]:
    """(how many, their seconds) of `stalls` that overlap one of `pauses`, both (start, length) on the monotonic
    clock."""
    hit = [length for start, length in stalls if any(p < start + length and start < p + lag for p, lag in pauses)]
    return len(hit), sum(hit)


STEAL_WARN = 0.05  # above this share of CPU time taken by the hypervisor, the report says so


def cpu_ticks() -> list[int] | None:
    """The machine's CPU time counters (/proc/stat's first line: user nice system idle iowait irq softirq
    steal ...), or None where there is no /proc/stat."""
    try:
        with open("/proc/stat") as f:
            return [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None


def steal_fraction(before: list[int] | None, after: list[int] | None) -> float | None:
    """Share of the CPU time between two `cpu_ticks` readings that the hypervisor gave to other guests."""
    if not before or not after or len(before) < 8 or len(after) < 8:
        return None
    delta = [b - a for a, b in zip(before, after)]
    total = sum(delta[:8])  # guest time (fields 9, 10) is already counted in user
    return delta[7] / total if total > 0 else None
