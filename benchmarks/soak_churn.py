"""What each of the soak test's streams does, and when (benchmarks/soak.py), pure: `slot_plan` -> a sorted list of
`Event` s, which benchmarks/soak_streams.py carries out.

A slot is one steerer's place over the whole run. It opens a stream, and every `session_s` (spread by +-20 % over the
slots, so reconnects do not line up) closes it and opens a new one: a viewer reconnecting, and a stream's state made
and dropped again. Within a session:

- a new prompt every `prompt_every_s`, and bursts of one every `burst_every_s` for `burst_s`, every `burst_period_s`;
- a pause of `pause_s` every `pause_every_s` (no prompt while paused);
- up to `watchers` watchers, each joining every `watch_every_s` and leaving `watch_s` later.

Every period is the hour-long run's, in seconds, times `scale` (a test's short minutes: 0.1 makes a 30 s prompt
period 3 s). Each slot runs at its own phase (slot / slots) so the events spread over time. Nothing is planned within
`quiet_s` of a session's end.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Act(enum.Enum):
    OPEN = "open"  # start the slot's stream (a new session)
    PROMPT = "prompt"  # set_prompt: the session's prompt number `change`
    PAUSE = "pause"
    RESUME = "resume"
    WATCH = "watch"  # a watcher joins the stream, for `length_s`
    CLOSE = "close"  # end the session's stream


@dataclass(frozen=True)
class Event:
    t: float  # seconds from the run's start
    act: Act
    session: int  # the slot's session number, from 0 (each reconnect starts the next)
    change: int = 0  # PROMPT: the session's prompt number, from 1
    length_s: float = 0.0  # WATCH: how long the watcher stays


@dataclass(frozen=True)
class ChurnConfig:
    """The churn of every slot, in an hour-long run's seconds (times `scale`)."""

    run_s: float  # the run's length (real seconds, not scaled)
    scale: float = 1.0  # every period below is multiplied by this
    prompt_every_s: float = 30.0  # a new prompt this often
    burst_every_s: float = 5.0  # within a burst, a new prompt this often
    burst_s: float = 30.0  # a burst's length
    burst_period_s: float = 300.0  # a burst starts this often (each slot at its phase)
    session_s: float = 480.0  # a session's length before the steerer reconnects (0.8 to 1.2 times, by slot)
    reconnect_gap_s: float = 1.0  # between a session's close and the next one's open
    pause_every_s: float = 240.0  # a pause starts this often
    pause_s: float = 15.0  # and lasts this long
    watchers: int = 1  # watchers a stream at most at once
    watch_every_s: float = 90.0  # each watcher joins this often
    watch_s: float = 45.0  # and stays this long
    quiet_s: float = 2.0  # nothing new this close to a session's end
    stagger_s: float = 0.5  # slot i opens its first stream at i * stagger_s

    def __post_init__(self) -> None:
        periods = ("prompt_every_s", "burst_every_s", "burst_s", "burst_period_s", "session_s", "pause_every_s",
                   "watch_every_s")
        for name in periods:
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)}: give a period > 0 s")
        if not (self.run_s > 0 and self.scale > 0):
            raise ValueError(f"run_s={self.run_s}, scale={self.scale}: both must be > 0")
        if self.burst_every_s > self.prompt_every_s or self.burst_s >= self.burst_period_s:
            raise ValueError(f"a burst ({self.burst_s:g} s, a prompt every {self.burst_every_s:g} s, every "
                             f"{self.burst_period_s:g} s) must prompt faster than {self.prompt_every_s:g} s and end "
                             "before the next one")
        if not 0 <= self.pause_s < self.pause_every_s or not 0 < self.watch_s < self.watch_every_s:
            raise ValueError(f"pause_s={self.pause_s} must be below pause_every_s={self.pause_every_s}, and "
                             f"watch_s={self.watch_s} below watch_every_s={self.watch_every_s}")
        if self.watchers < 0:
            raise ValueError(f"watchers={self.watchers}: give 0 or more")

    def s(self, seconds: float) -> float:
        """An hour-long run's period in this run's seconds."""
        return seconds * self.scale


def sessions(slot: int, slots: int, cfg: ChurnConfig) -> list[tuple[float, float]]:
    """The slot's sessions, (open, close) in run seconds: back to back from its stagger to the run's end."""
    phase = slot / max(1, slots)
    length = cfg.s(cfg.session_s) * (0.8 + 0.4 * phase)
    start, out = cfg.s(cfg.stagger_s) * slot, []
    for _ in range(int(cfg.run_s / length) + 2):
        if start >= cfg.run_s - cfg.s(cfg.quiet_s):
            break
        end = min(start + length, cfg.run_s)
        if cfg.run_s - end < length / 4:  # a last session shorter than a quarter: this one runs to the end instead
            end = cfg.run_s
        out.append((start, end))
        start = end + cfg.s(cfg.reconnect_gap_s)
    return out


def _every(period: float, offset: float, until: float) -> list[float]:
    """offset, offset + period, ... below `until` (bounded by the count)."""
    times = (offset + k * period for k in range(int(max(0.0, until - offset) / period) + 1))
    return [t for t in times if t < until]


def slot_plan(slot: int, slots: int, cfg: ChurnConfig) -> list[Event]:
    """Every event of slot `slot` of `slots` over the run, in time order."""
    phase = slot / max(1, slots)
    pauses = [(t, t + cfg.s(cfg.pause_s)) for t in _every(cfg.s(cfg.pause_every_s),
                                                          cfg.s(cfg.pause_every_s) * (0.5 + 0.4 * phase), cfg.run_s)]
    bursts = [(t, t + cfg.s(cfg.burst_s)) for t in _every(cfg.s(cfg.burst_period_s),
                                                          cfg.s(cfg.burst_period_s) * (0.5 + 0.25 * phase), cfg.run_s)]
    events: list[Event] = []
    for n, (a, b) in enumerate(sessions(slot, slots, cfg)):
        last = b - cfg.s(cfg.quiet_s)  # nothing new from here on
        events.append(Event(a, Act.OPEN, n))
        held = [(p0, p1) for p0, p1 in pauses if a + cfg.s(cfg.quiet_s) <= p0 and p1 <= last]
        for p0, p1 in held:
            events += [Event(p0, Act.PAUSE, n), Event(p1, Act.RESUME, n)]
        times = _every(cfg.s(cfg.prompt_every_s), a + cfg.s(cfg.prompt_every_s) * (0.5 + 0.5 * phase), last)
        for b0, b1 in bursts:
            times += _every(cfg.s(cfg.burst_every_s), max(b0, a + cfg.s(cfg.burst_every_s)), min(b1, last))
        kept: list[float] = []
        for t in sorted(times):  # none within half a burst period of the one before, none while paused
            if (not kept or t - kept[-1] >= cfg.s(cfg.burst_every_s) / 2) and not any(p0 <= t < p1 for p0, p1 in held):
                kept.append(t)
        events += [Event(t, Act.PROMPT, n, change=k + 1) for k, t in enumerate(kept)]
        for w in range(cfg.watchers):
            offset = a + cfg.s(cfg.watch_every_s) * (0.2 + 0.5 * w / cfg.watchers + 0.2 * phase)
            for t in _every(cfg.s(cfg.watch_every_s), offset, last - cfg.s(cfg.watch_s) / 4):  # none too short
                events.append(Event(t, Act.WATCH, n, length_s=min(cfg.s(cfg.watch_s), last - t)))
        events.append(Event(b, Act.CLOSE, n))
    order = {act: i for i, act in enumerate(Act)}  # at one time: open first, close last
    return sorted(events, key=lambda e: (e.t, e.session, order[e.act]))
