"""The viewer's playback buffer: pure logic, no asyncio, no I/O.

This is the model of DESIGN.md "Measuring a stream", fed with what a client
sees and when: frames arriving (already decoded), the prompts it sends and the
server's acks. Times are seconds on any monotonic clock, passed in as ``now``;
every call moves the clock forward (a call with an earlier time raises
``ValueError``) and first plays the frames due by then.

Playback rules
--------------
- Playback starts when the first frames arrive: the first frame plays at its
  arrival time, and each next frame is due ``1 / fps`` after the one before.
- A frame plays at its due time if it has arrived. If the buffer is empty at a
  frame's due time, the stream stalls from that due time until the next frame
  arrives; that frame plays on arrival, and the frames after it are due every
  ``1 / fps`` from then on. A stall counts only if it lasts longer than zero.
- ``pause`` freezes the playback clock (neither play time nor stall time
  accrues; frames still arrive into the buffer); ``resume`` picks up where it
  was: the frame that was next is due after the time it still had left, and a
  stall that was going on goes on (the same stall).

Measures (``stats()``)
----------------------
- ``ttff_s``: connect -> first frame available to play (its arrival).
- ``stalls``, ``stall_s``: count and total time stalled; ``play_s``: time
  playing (from the first frame, not stalled, not paused). A stall still going
  on counts up to the latest ``now``.
- ``delivered_fps``: frames played / (play_s + stall_s).
- W3C freezes, as libwebrtc computes ``freezeCount`` and
  ``totalFreezesDuration``: for each rendered frame after the first, its gap
  is the time since the previous render. The gap joins a window of the last
  30 gaps; once the window holds at least 5, the gap is a freeze when it is
  >= max(3 * mean, mean + 150 ms) of the window (the gap itself included),
  and its whole length counts as freeze time. A gap that spans a pause is
  left out, as libwebrtc leaves paused time out.
- Control latency: from the moment a prompt was sent to the moment the first
  frame with ``prompt_version >= `` that prompt's version is played. The
  version comes back in the server's ack, after the send: call
  ``prompt_sent_at(now)`` when sending and ``prompt_acked(version, now)`` when
  the ack arrives (acks come in the order of the sends; ``prompt_rejected()``
  when an error came back instead). ``prompt_sent(version, now)`` does both
  when the version is known at send time. A frame played before the ack still
  counts (it is remembered), and one frame can settle several prompts (a later
  version supersedes earlier ones that never reached the screen).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

FREEZE_WINDOW_FRAMES = 30  # gaps averaged (libwebrtc kAvgInterframeDelaysWindowSizeFrames)
FREEZE_MIN_SAMPLES = 5  # gaps needed before a freeze can be detected (kMinFrameSamplesToDetectFreeze)
FREEZE_MIN_INCREASE_S = 0.150  # a freeze is at least this much longer than the mean gap (kMinIncreaseForFreezeMs)


class PlaybackState(StrEnum):
    NEW = "new"  # not connected yet
    WAITING = "waiting"  # connected, no frame yet
    PLAYING = "playing"
    STALLED = "stalled"  # the buffer ran dry at a frame's due time
    PAUSED = "paused"
    ENDED = "ended"  # finish() was called


@dataclass(frozen=True)
class PlaybackStats:
    ttff_s: float | None  # connect -> first frame available; None before it
    stalls: int  # stalls of positive length, one still going on included
    stall_s: float  # total time stalled
    play_s: float  # total time playing: from the first frame on, not stalled, not paused
    frames_played: int  # frames rendered
    frames_received: int  # frames that arrived (played or buffered)
    delivered_fps: float  # frames_played / (play_s + stall_s); 0.0 before any time has passed
    freezes: int  # W3C freezeCount
    freeze_s: float  # W3C totalFreezesDuration
    control_latencies_s: tuple[float, ...]  # one per settled prompt, prompt sent -> first frame under it played
    prompts_pending: int  # prompts sent whose frames have not played yet
    buffered_s: float  # frames received but not played, in seconds of video
    paused_s: float  # total time paused

    @property
    def stall_ratio(self) -> float:
        """stall_s / (play_s + stall_s); 0.0 before any time has passed."""
        total = self.play_s + self.stall_s
        return self.stall_s / total if total > 0 else 0.0


class PlaybackBuffer:
    """One viewer's playback buffer at ``fps`` frames per second."""

    def __init__(self, fps: float, on_render: Callable[[float], None] | None = None) -> None:
        """`on_render(t)`: called as each frame plays, oldest first, with its render time (client/verify.py
        reads the frame's pixels then)."""
        if not fps > 0:
            raise ValueError(f"fps must be > 0, got {fps!r}")
        self.fps = fps
        self.on_render = on_render
        self._state = PlaybackState.NEW
        self._now = float("-inf")  # latest time seen
        self._connected_at: float | None = None
        self._first_frame_at: float | None = None
        self._hold_until: float | None = None  # a stream of input video: the first frames play from then (see push)

        # Buffer: runs of (frames, prompt_version), oldest first.
        self._queue: deque[list[int]] = deque()
        self._queued = 0
        self._received = 0
        self._played = 0

        # Playback clock, while PLAYING: the next frame is due at anchor + k / fps
        # (computed from an anchor, so no rounding error accumulates).
        self._anchor = 0.0
        self._k = 0
        self._play_since = 0.0  # start of the current playing interval
        self._play_s = 0.0

        # Stalls. The current stall's time is stall_acc plus, while STALLED, now - stall_since.
        self._stalls = 0
        self._stall_s = 0.0
        self._stall_since = 0.0
        self._stall_acc = 0.0

        # Pause.
        self._paused_from = PlaybackState.NEW
        self._paused_at = 0.0
        self._remaining = 0.0  # time the next frame still had before its due time, when paused while playing
        self._paused_s = 0.0

        # W3C freezes, from render times.
        self._last_render: float | None = None
        self._gap_spans_pause = False
        self._gaps: deque[float] = deque(maxlen=FREEZE_WINDOW_FRAMES)
        self._freezes = 0
        self._freeze_s = 0.0

        # Control latency.
        self._unacked: deque[float] = deque()  # send times of prompts awaiting their ack
        self._awaiting: list[tuple[int, float]] = []  # (version, sent at), not yet on screen
        self._first_render_of: dict[int, float] = {}  # prompt version -> first time one of its frames played
        self._latencies: list[float] = []

    @property
    def state(self) -> PlaybackState:
        return self._state

    # ------------------------------------------------------------ inputs

    def connect(self, now: float) -> None:
        """The viewer connected (TTFF counts from here)."""
        self._require(PlaybackState.NEW, "connect")
        self._clock(now)
        self._connected_at = now
        self._state = PlaybackState.WAITING

    def push(self, frames: int, prompt_version: int, now: float, play_from: float | None = None,
             cut: bool = False) -> int:
        """``frames`` frames generated under ``prompt_version`` arrived and are decoded. ``play_from``: the first
        frames play no earlier than then (a stream of input video plays each frame a fixed time after its capture,
        so that its next chunks, which come as their input comes, arrive in time). ``cut``: the frames buffered and
        not played yet are dropped first (a new prompt's first chunk from a server that cuts: its header says so).
        Returns how many were dropped."""
        if frames < 1:
            raise ValueError(f"frames must be >= 1, got {frames}")
        self._require_live("push")
        self._advance(now)
        dropped = self._queued if cut else 0
        if cut:
            self._queue.clear()
            self._queued = 0
        if self._queue and self._queue[-1][1] == prompt_version:
            self._queue[-1][0] += frames
        else:
            self._queue.append([frames, prompt_version])
        self._queued += frames
        self._received += frames
        if self._first_frame_at is None:
            self._first_frame_at = now
        if self._state is PlaybackState.WAITING:
            if play_from is not None and play_from > now:
                self._hold_until = play_from if self._hold_until is None else self._hold_until
            else:
                self._start_playing(now)
        elif self._state is PlaybackState.STALLED:
            self._end_stall(self._stall_acc + (now - self._stall_since))
            self._start_playing(now)
        return dropped

    def advance(self, now: float) -> None:
        """Play the frames due by ``now`` (entering a stall if the buffer runs dry)."""
        self._require_live("advance")
        self._advance(now)

    def pause(self, now: float) -> None:
        """The viewer paused playback. Idempotent."""
        self._require_live("pause")
        self._advance(now)
        if self._state is PlaybackState.PAUSED:
            return
        if self._state is PlaybackState.PLAYING:
            self._play_s += now - self._play_since
            self._remaining = self._next_due() - now
        elif self._state is PlaybackState.STALLED:
            self._stall_acc += now - self._stall_since
        self._paused_from = self._state
        self._paused_at = now
        self._gap_spans_pause = True
        self._state = PlaybackState.PAUSED

    def resume(self, now: float) -> None:
        """The viewer resumed playback. Does nothing unless paused."""
        self._require_live("resume")
        self._advance(now)
        if self._state is not PlaybackState.PAUSED:
            return
        self._paused_s += now - self._paused_at
        was = self._paused_from
        if was is PlaybackState.PLAYING:
            self._state = PlaybackState.PLAYING
            self._anchor, self._k = now + self._remaining, 0
            self._play_since = now
        elif was is PlaybackState.STALLED:
            if self._queued:
                self._end_stall(self._stall_acc)
                self._start_playing(now)
            else:
                self._state = PlaybackState.STALLED
                self._stall_since = now
        elif self._queued:  # was WAITING, and frames came during the pause
            self._start_playing(now)
        else:
            self._state = PlaybackState.WAITING

    def finish(self, now: float) -> None:
        """The session ends at ``now``: play what is due, close the books. Later inputs raise."""
        self._require_live("finish")
        self._advance(now)
        if self._state is PlaybackState.PLAYING:
            self._play_s += now - self._play_since
        elif self._state is PlaybackState.STALLED:
            self._end_stall(self._stall_acc + (now - self._stall_since))
        elif self._state is PlaybackState.PAUSED:
            self._paused_s += now - self._paused_at
            if self._paused_from is PlaybackState.STALLED:
                self._end_stall(self._stall_acc)
        self._state = PlaybackState.ENDED

    # ------------------------------------------------------------ prompts

    def prompt_sent_at(self, now: float) -> None:
        """A ``set_prompt`` was sent at ``now``; its version comes with the ack (``prompt_acked``)."""
        self._require_live("prompt_sent_at")
        self._advance(now)
        self._unacked.append(now)

    def prompt_acked(self, version: int, now: float) -> None:
        """The ack of the oldest unacked prompt arrived: its frames will carry ``version``."""
        self._require_live("prompt_acked")
        self._advance(now)
        if not self._unacked:
            raise RuntimeError("an ack arrived but no prompt awaits one: call prompt_sent_at() when sending")
        self._bind(version, self._unacked.popleft())

    def prompt_rejected(self) -> None:
        """The oldest unacked prompt got an error instead of an ack: forget it."""
        if not self._unacked:
            raise RuntimeError("a prompt was rejected but none awaits an ack")
        self._unacked.popleft()

    def prompt_sent(self, version: int, now: float) -> None:
        """A prompt whose version is known at send time was sent at ``now``."""
        self._require_live("prompt_sent")
        self._advance(now)
        self._bind(version, now)

    # ------------------------------------------------------------ output

    def stats(self, now: float | None = None) -> PlaybackStats:
        """The measures as of ``now`` (advancing to it first) or, without it, as of the latest time seen."""
        if now is not None and self._state is not PlaybackState.ENDED:
            self.advance(now)
        play_s, stall_s, stalls = self._play_s, self._stall_s, self._stalls
        current_stall = 0.0
        if self._state is PlaybackState.PLAYING:
            play_s += self._now - self._play_since
        elif self._state is PlaybackState.STALLED:
            current_stall = self._stall_acc + (self._now - self._stall_since)
        elif self._state is PlaybackState.PAUSED and self._paused_from is PlaybackState.STALLED:
            current_stall = self._stall_acc
        if current_stall > 0:
            stalls += 1
            stall_s += current_stall
        paused_s = self._paused_s
        if self._state is PlaybackState.PAUSED:
            paused_s += self._now - self._paused_at
        watched = play_s + stall_s
        return PlaybackStats(
            ttff_s=None if self._first_frame_at is None else self._first_frame_at - self._connected_at,
            stalls=stalls,
            stall_s=stall_s,
            play_s=play_s,
            frames_played=self._played,
            frames_received=self._received,
            delivered_fps=self._played / watched if watched > 0 else 0.0,
            freezes=self._freezes,
            freeze_s=self._freeze_s,
            control_latencies_s=tuple(self._latencies),
            prompts_pending=len(self._unacked) + len(self._awaiting),
            buffered_s=self._queued / self.fps,
            paused_s=paused_s,
        )

    # ------------------------------------------------------------ internals

    def _require(self, state: PlaybackState, action: str) -> None:
        if self._state is not state:
            raise RuntimeError(f"cannot {action}: playback is {self._state}")

    def _require_live(self, action: str) -> None:
        if self._state in (PlaybackState.NEW, PlaybackState.ENDED):
            hint = " (call connect() first)" if self._state is PlaybackState.NEW else ""
            raise RuntimeError(f"cannot {action}: playback is {self._state}{hint}")

    def _clock(self, now: float) -> None:
        if now < self._now:
            raise ValueError(f"time went backwards: {now} after {self._now}")
        self._now = now

    def _next_due(self) -> float:
        return self._anchor + self._k / self.fps

    def _advance(self, now: float) -> None:
        """Move the clock to ``now``, playing the frames due by then."""
        self._clock(now)
        if self._state is PlaybackState.WAITING and self._hold_until is not None and now >= self._hold_until:
            self._start_playing(self._hold_until)
        if self._state is not PlaybackState.PLAYING:
            return
        while (due := self._next_due()) <= now:
            if not self._queued:
                self._play_s += due - self._play_since
                self._state = PlaybackState.STALLED
                self._stall_since, self._stall_acc = due, 0.0
                return
            self._render(due)
            self._k += 1

    def _start_playing(self, now: float) -> None:
        """Play the next frame at ``now`` and run the playback clock from there."""
        self._state = PlaybackState.PLAYING
        self._play_since = now
        self._render(now)
        self._anchor, self._k = now, 1

    def _end_stall(self, duration: float) -> None:
        if duration > 0:
            self._stalls += 1
            self._stall_s += duration

    def _render(self, t: float) -> None:
        """Take the oldest buffered frame off the queue and put it on screen at ``t``."""
        run = self._queue[0]
        version = run[1]
        run[0] -= 1
        if run[0] == 0:
            self._queue.popleft()
        self._queued -= 1
        self._played += 1
        self._count_freeze(t)
        if self.on_render is not None:
            self.on_render(t)
        if version not in self._first_render_of:
            self._first_render_of[version] = t
        if self._awaiting:
            still = []
            for wanted, sent in self._awaiting:
                if version >= wanted:
                    self._latencies.append(t - sent)
                else:
                    still.append((wanted, sent))
            self._awaiting = still

    def _count_freeze(self, t: float) -> None:
        last, self._last_render = self._last_render, t
        spans_pause, self._gap_spans_pause = self._gap_spans_pause, False
        if last is None or spans_pause:
            return
        gap = t - last
        self._gaps.append(gap)
        if len(self._gaps) < FREEZE_MIN_SAMPLES:
            return
        mean = sum(self._gaps) / len(self._gaps)
        if gap >= max(3 * mean, mean + FREEZE_MIN_INCREASE_S):
            self._freezes += 1
            self._freeze_s += gap

    def _bind(self, version: int, sent: float) -> None:
        """A prompt sent at ``sent`` has ``version``: settle it now if such a frame already played."""
        played = [t for v, t in self._first_render_of.items() if v >= version and t >= sent]
        if played:
            self._latencies.append(min(played) - sent)
        else:
            self._awaiting.append((version, sent))
