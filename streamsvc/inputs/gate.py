"""What one input decoder may cost (issue 41), decided before and while it decodes: one `InputGate` per decoder, on
every input path (the WebSocket's H.264 in streamsvc/inputs/ws.py, a WebRTC camera's and a WHIP publisher's in
streamsvc/inputs/rtc.py). Pure: no I/O, no decoder; the caller's clock.

Before a frame is decoded (`admit`, on its encoded bytes: streamsvc/inputs/bitstream.py `inspect`):
- The pixel cap: a frame that declares a size over the cap (an H.264 SPS, a VP8 key frame) refuses the input at
  once (`refused` says why); the caller drops its decoder and tells the client. Nothing after it is decoded.
- The rate: frames beyond `rate` a second (bursts of `burst`) are dropped undecoded, as early as the codec allows.
  A frame no other frame refers to (H.264 nal_ref_idc 0) goes alone; dropping a reference frame drops its whole
  group of pictures, every frame up to the next key frame (they would not decode without it, or decode into
  garbage), and `keyframe_wanted` asks the sender for one (a WebRTC sender's PLI; a WebSocket camera sends an IDR
  every 2 s on its own). A frame whose size header cannot be read is dropped the same way (bad input).
- After a refusal every frame is dropped.

After a frame is decoded: `decoded_size` checks its size against the cap as well (what no header declared: a
decoder that changed size mid-stream, a header this reader missed), and `decode_time` charges the decoder's CPU
time to its budget: a decoder whose CPU time over the last `sustain_s` seconds averages more than `max_load` seconds
a second refuses the input with the reason. The input stage's cost counts the same time (the transports add it to
`InputFrames.add_work`); the budget bounds what one stream can make that cost believe.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass

from streamsvc.door.access import Rate, TokenBucket
from streamsvc.inputs.bitstream import inspect, size_refusal

# A decoder's CPU time, in seconds a second, that refuses its input when sustained. On the 2-core test host a 1080p
# camera (the cap's size) at 4 Mbit/s decodes in 1.2 ms a frame: 0.04 CPU-s a second at 30 fps, far under. 1080p of
# pure noise at 1.6 MB a frame takes 117 ms a frame (3.7 at the WebSocket's 32 fps), and the resolution bomb of issue
# 41 took 1.9: both are refused after DECODE_SUSTAIN_S.
MAX_DECODE_LOAD = 0.5
DECODE_SUSTAIN_S = 3  # the seconds (whole windows of one) the decoder's CPU time is averaged over
KEYFRAME_REQUEST_S = 1.0  # while a group of pictures is dropped, the sender is asked for a key frame this often


class Verdict(enum.Enum):
    """What becomes of one encoded frame."""

    DECODE = "decode"
    DROP = "drop"  # not decoded (over the rate, or waiting for a key frame): the stream goes on
    BAD = "bad"  # not decoded: a size header that cannot be read (bad input, as a decode error)
    REFUSE = "refuse"  # the input is refused (`InputGate.refused` says why): nothing more is decoded


@dataclass
class GateCounts:
    decoded: int = 0  # frames let through to the decoder
    dropped: int = 0  # frames dropped undecoded (all the reasons below)
    alone: int = 0  # of them: over the rate, a frame no other refers to
    gop: int = 0  # of them: over the rate, or after such a frame, waiting for a key frame
    bad: int = 0  # of them: a size header that could not be read
    after_refusal: int = 0  # of them: after the input was refused
    keyframe_requests: int = 0  # times `keyframe_wanted` said yes


class InputGate:
    """One decoder's gate (the module docstring). `now` arguments are the caller's clock, in seconds."""

    def __init__(self, rate: float, burst: int, now: float, *, max_load: float = MAX_DECODE_LOAD,
                 sustain_s: int = DECODE_SUSTAIN_S) -> None:
        if not (rate > 0 and burst >= 1 and max_load > 0 and sustain_s >= 1):
            raise ValueError(f"an input gate needs rate > 0, burst >= 1, max_load > 0 and sustain_s >= 1, got "
                             f"{rate}, {burst}, {max_load}, {sustain_s}")
        self.max_load, self.sustain_s = max_load, sustain_s
        self.refused: str | None = None  # why the input was refused (the text a client reads), once it was
        self.counts = GateCounts()
        self._frames = TokenBucket(Rate(rate, int(burst)), now)  # frames decoded: `rate` a second, `burst` at once
        self._need_keyframe = False  # a reference frame was dropped: the rest of its group goes too
        self._asked_at: float | None = None  # when the sender was last asked for a key frame
        self._window_at: float | None = None  # the start of the decode budget's current one-second window
        self._window_s = 0.0  # CPU seconds charged in that window
        self._windows: deque[float] = deque(maxlen=sustain_s)  # the CPU seconds of the last whole windows

    # -- before decoding ------------------------------------------------------------------------

    def admit(self, frame: bytes, now: float) -> Verdict:
        """What to do with one encoded frame (an H.264 access unit or a VP8 frame)."""
        if self.refused is not None:
            return self._drop("after_refusal")
        info = inspect(frame)
        if info.size is not None:
            refusal = size_refusal(*info.size, what="a stream that declares frames")
            if refusal is not None:
                self.refuse(f"{refusal}: send a smaller size")
                return Verdict.REFUSE
        if info.error is not None:
            self._need_keyframe = True
            self._drop("bad")
            return Verdict.BAD
        if self._need_keyframe and not info.keyframe:
            return self._drop("gop")
        if not self._frames.take(now):
            if not info.reference:
                return self._drop("alone")
            self._need_keyframe = True
            return self._drop("gop")
        self._need_keyframe = False
        self._asked_at = None
        self.counts.decoded += 1
        return Verdict.DECODE

    def _drop(self, why: str) -> Verdict:
        self.counts.dropped += 1
        setattr(self.counts, why, getattr(self.counts, why) + 1)
        return Verdict.DROP

    def keyframe_wanted(self, now: float) -> bool:
        """Whether to ask the sender for a key frame now: frames wait for one, and it was not asked in the last
        KEYFRAME_REQUEST_S."""
        if not self._need_keyframe or self.refused is not None:
            return False
        if self._asked_at is not None and now - self._asked_at < KEYFRAME_REQUEST_S:
            return False
        self._asked_at = now
        self.counts.keyframe_requests += 1
        return True

    @property
    def waiting_for_keyframe(self) -> bool:
        return self._need_keyframe

    # -- after decoding -------------------------------------------------------------------------

    def decoded_size(self, width: int, height: int) -> bool:
        """A decoded frame's size: False (and the input refused) when it is over the cap."""
        refusal = size_refusal(width, height, what="a decoded frame")
        if refusal is not None:
            self.refuse(f"{refusal}: send a smaller size")
        return refusal is None

    def decode_time(self, cpu_s: float, now: float) -> bool:
        """The decoder spent `cpu_s` CPU seconds (up to `now`): False (and the input refused) once its budget is
        spent (the module docstring)."""
        if self._window_at is None or now - self._window_at >= self.sustain_s + 1:  # the first, or a long gap
            self._window_at, self._window_s = now, 0.0
            self._windows.clear()
        while now - self._window_at >= 1.0:  # close the windows that ended
            self._windows.append(self._window_s)
            self._window_s = 0.0
            self._window_at += 1.0
            if len(self._windows) == self.sustain_s and sum(self._windows) > self.max_load * self.sustain_s:
                if self.refused is None:
                    self.refuse(f"decoding this input took {sum(self._windows) / self.sustain_s:.2f} CPU-seconds a "
                                f"second over {self.sustain_s} s, over the {self.max_load:g} this server gives one "
                                "stream's input: send a smaller size, a lower bitrate or fewer frames a second")
                return False
        self._window_s += max(0.0, cpu_s)
        return self.refused is None

    def refuse(self, reason: str) -> None:
        """Refuse the input from now on (the first reason stays)."""
        if self.refused is None:
            self.refused = reason
