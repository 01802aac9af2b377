"""A viewer's camera for streams with input video (issue 35): frames in, H.264 input messages out, and the
glass-to-glass latency of what comes back.

A *frame source* is any callable ``source(i) -> np.ndarray`` giving frame ``i`` ([H, W, 3] uint8 RGB, any size)
of the camera's video: `FileSource` loops a video file, and the command line renders scenes of models/scenes.py
(the client itself imports only the wire modules). `H264Camera` encodes frames one at a time as the WebSocket's
upstream wants them (streamsvc/wire/framing.py): x264 ultrafast/zerolatency (no B-frames, no lookahead: a frame's
access unit comes out at once), an IDR with SPS/PPS every `keyint` frames. `GlassToGlass` keeps, per played
frame, (the time it was played) - (the capture time its chunk's header echoed), both in this client's clock.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from fractions import Fraction

import av
import numpy as np

FrameSource = Callable[[int], np.ndarray]


class H264Camera:
    """Frames in, one H.264 access unit (Annex-B) out per frame."""

    def __init__(self, fps: int, keyint: int | None = None) -> None:
        self.fps = fps
        self.keyint = keyint or 2 * fps  # an IDR every 2 s: where the server's decoder can (re)start
        self._codec: av.VideoCodecContext | None = None
        self._size: tuple[int, int] | None = None
        self.frames = 0

    def _open(self, width: int, height: int) -> av.VideoCodecContext:
        codec = av.CodecContext.create("libx264", "w")
        codec.width, codec.height, codec.pix_fmt = width, height, "yuv420p"
        codec.time_base = Fraction(1, self.fps)
        codec.framerate = Fraction(self.fps, 1)
        codec.gop_size = self.keyint
        codec.max_b_frames = 0
        codec.options = {"preset": "ultrafast", "tune": "zerolatency", "repeat-headers": "1"}
        codec.thread_count = 1
        codec.open()
        return codec

    def encode(self, frame: np.ndarray) -> tuple[bytes, bool] | None:
        """One frame's access unit and whether it is an IDR; None when the encoder held it (it does not here)."""
        h, w = frame.shape[:2]
        w2, h2 = w - w % 2, h - h % 2  # yuv420p needs even sizes
        if self._codec is None or self._size != (w2, h2):
            self._codec, self._size = self._open(w2, h2), (w2, h2)
        vf = av.VideoFrame.from_ndarray(np.ascontiguousarray(frame[:h2, :w2]), format="rgb24")
        vf.pts = self.frames
        self.frames += 1
        packets = self._codec.encode(vf)
        if not packets:
            return None
        return b"".join(bytes(p) for p in packets), any(p.is_keyframe for p in packets)


class FileSource:
    """A video file's frames, looped (decoded once, at most `max_frames` kept, scaled down to `width` if wider):
    `--input FILE` of the load test."""

    def __init__(self, path: str, max_frames: int = 256, width: int | None = None) -> None:
        frames = []
        with av.open(path) as container:
            for frame in container.decode(video=0):
                if width is not None and frame.width > width:
                    height = max(2, round(frame.height * width / frame.width / 2) * 2)
                    frame = frame.reformat(width=width, height=height)
                frames.append(frame.to_ndarray(format="rgb24"))
                if len(frames) >= max_frames:
                    break
        if not frames:
            raise ValueError(f"{path}: no video frames")
        self.frames = frames

    def __call__(self, i: int) -> np.ndarray:
        return self.frames[i % len(self.frames)]


class GlassToGlass:
    """Per played frame: played at (this client's clock) - captured at (the echoed capture time, converted)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        # this client's capture times are wall-clock ms (Date.now()-like); its playback clock is `clock`
        self.offset_s = time.time() - clock()
        self._pending: deque[float | None] = deque()  # capture times (the client's clock) of frames not yet played
        self.samples: list[float] = []  # seconds, one per played frame that had a capture time

    @staticmethod
    def now_ms() -> float:
        """A capture time for a frame captured now (wall clock, ms)."""
        return time.time() * 1000.0

    def to_clock(self, capture_ms: float) -> float:
        return capture_ms / 1000.0 - self.offset_s

    def arrived(self, capture_ms: list[float] | None, frames: int) -> None:
        """A chunk of `frames` frames arrived (in play order) with these capture times (None: no input)."""
        for i in range(frames):
            self._pending.append(self.to_clock(capture_ms[i]) if capture_ms and i < len(capture_ms) else None)

    def dropped(self, n: int) -> None:
        """The `n` oldest frames not yet played will not be (a cut to a new prompt)."""
        for _ in range(min(n, len(self._pending))):
            self._pending.popleft()

    def played(self, t: float) -> None:
        """The oldest frame not yet played is on screen at `t` (this client's clock)."""
        if self._pending:
            captured = self._pending.popleft()
            if captured is not None and len(self.samples) < 1_000_000:
                self.samples.append(t - captured)

    def percentile(self, q: float) -> float | None:
        if not self.samples:
            return None
        ordered = sorted(self.samples)
        return ordered[max(0, math.ceil(q * len(ordered)) - 1)]
