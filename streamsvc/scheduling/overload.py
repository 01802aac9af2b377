"""Overload detection and the last resort: what viewers got lately, and which stream to end when nothing else helps.

The last resort (`overloaded`): when degradation has run out (a chunk ran with the fewest
steps it may and still did not leave the margin) and viewers still stall
(`overload_stalls` modelled stalls within `overload_window_s`), the newest stream is named
for the engine to end, rather than every viewer stalling.

`OverloadMonitor` is where the evidence is kept: each modelled stall (it also widens every
lead for `late_margin_hold_s`, see the planner), each chunk that ran its fewest steps and
still fell short, and the latest lateness of any kind (a stall, a degraded chunk, a
cheaper encode: `mark_late`), which closes admission for `late_hold_s` (the closed loop,
see admission).

Only the server's own measurements are evidence (issue 41): a stall of the server's own
figure of a viewer's buffer (`PlaybackModel.own`) or of its WebRTC track's queue, a chunk
degraded or encoded cheaper against the server's own deadline. What a stream's own client
causes (its viewer's reports, its input missing or late) is charged to that stream and never
reaches the monitor: it would end *another* stream, and close admission for everyone.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

from .config import SchedulerConfig
from .types import Late


class OverloadMonitor:
    """The evidence of overload, fed by the planner and the viewers' reports, and the last resort on it (pure)."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.late: Late | None = None  # the latest lateness (the closed loop)
        self.last_stall_at = -math.inf  # the latest modelled stall (the late margin)
        self._stalls: deque[float] = deque()  # times of modelled stalls within overload_window_s
        self._exhausted: deque[float] = deque()  # times within overload_window_s a chunk ran its fewest steps, short

    def mark_late(self, stream_id: str, now: float, what: str) -> None:
        """Stream `stream_id` was late at `now` (`what` happened): admission stays closed for `late_hold_s`."""
        self.late = Late(now, stream_id, what)

    def stalled(self, stream_id: str, now: float, what: str) -> None:
        """A modelled stall of the stream: the closed loop closes admission, and the last resort counts it."""
        self.late = Late(now, stream_id, what)
        self._stalls.append(now)
        self.last_stall_at = now

    def exhausted(self, now: float) -> None:
        """A chunk starts at `now` with the fewest steps it may run, and they do not leave it the margin."""
        self._exhausted.append(now)

    def overloaded(self, now: float, stream_ids: Sequence[str]) -> str | None:
        """The last resort: the newest of `stream_ids` (the admitted streams, oldest admission first), to end, when
        degradation has run out within overload_window_s and `overload_stalls` modelled stalls followed it; None
        otherwise (and with fewer than 2 streams, where ending one helps nobody). Naming a stream clears the
        evidence: the next needs new stalls."""
        cfg = self.config
        for times in (self._stalls, self._exhausted):
            while times and times[0] < now - cfg.overload_window_s:
                times.popleft()
        if len(stream_ids) < 2 or not self._exhausted:
            return None
        if sum(1 for t in self._stalls if t >= self._exhausted[0]) < cfg.overload_stalls:
            return None
        self._stalls.clear()
        self._exhausted.clear()
        return stream_ids[-1]
