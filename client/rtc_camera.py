"""A synthetic camera: the built-in model's scenes rendered as input video (issue 35), for load tests and tests.

``SyntheticScene`` draws one object of a colour and shape moving at a constant velocity on a flat background,
wrapping at the edges, exactly as ``models/scenes.py`` draws a scene (a test checks they agree pixel for pixel);
the client imports nothing of ``models/``, so this is its own copy, like ``client/pixels.py``'s palette.
``SceneTrack`` is an aiortc video track of its frames, paced at a frame rate (a viewer's camera over WebRTC);
``write_y4m`` writes frames as a Y4M file (Chromium's fake camera: ``--use-file-for-fake-video-capture``).
"""

from __future__ import annotations

import asyncio
import fractions
import time
from dataclasses import dataclass
from pathlib import Path

import av
import numpy as np
from aiortc import VideoStreamTrack
from aiortc.mediastreams import MediaStreamError

from client.pixels import BACKGROUNDS, PALETTE

SPEED = 3.0  # pixels per frame, models/scenes.py's SPEED
SIZES = {"small": 9.0, "big": 16.0}  # half the object's extent in pixels, models/scenes.py's SIZES
MOTIONS = {"left": (-1.0, 0.0), "right": (1.0, 0.0), "up": (0.0, -1.0), "down": (0.0, 1.0), "still": (0.0, 0.0)}
SHAPES = ("ball", "square", "triangle")
VIDEO_CLOCK_HZ = 90_000
"""The RTP clock of video: a frame's pts counts 1/90000 s."""


@dataclass(frozen=True)
class SyntheticScene:
    """One object moving on a background; frame n has it at the centre plus n steps of its velocity (wrapped)."""

    colour: str = "red"  # a key of client.pixels.PALETTE
    shape: str = "ball"  # ball | square | triangle
    motion: str = "right"  # left | right | up | down | still
    size: str = "big"  # small | big
    background: str = "dark gray"  # a key of client.pixels.BACKGROUNDS
    width: int = 128
    height: int = 128

    def __post_init__(self) -> None:
        for value, allowed in ((self.colour, PALETTE), (self.shape, SHAPES), (self.motion, MOTIONS),
                               (self.size, SIZES), (self.background, BACKGROUNDS)):
            if value not in allowed:
                raise ValueError(f"{value!r} is not one of {', '.join(allowed)}")
        if self.width < 1 or self.height < 1:
            raise ValueError(f"a {self.width}x{self.height} frame: give at least 1x1")

    @classmethod
    def parse(cls, text: str, width: int = 128, height: int = 128) -> SyntheticScene:
        """'red ball right' (colour, shape, motion; any order, any subset; 'synthetic' alone: the defaults)."""
        fields: dict[str, str] = {}
        for word in text.replace(",", " ").split():
            for name, allowed in (("colour", PALETTE), ("shape", SHAPES), ("motion", MOTIONS), ("size", SIZES)):
                if word in allowed:
                    fields[name] = word
                    break
            else:
                if word != "synthetic":
                    raise ValueError(f"unknown word {word!r} in scene {text!r}: give a colour ({', '.join(PALETTE)}), "
                                     f"a shape ({', '.join(SHAPES)}), a motion ({', '.join(MOTIONS)})")
        return cls(**fields, width=width, height=height)

    def centre(self, n: int) -> tuple[float, float]:
        """(x, y) of the object in frame n, wrapped onto the frame."""
        dx, dy = MOTIONS[self.motion]
        return ((self.width / 2 + dx * SPEED * n) % self.width, (self.height / 2 + dy * SPEED * n) % self.height)

    def frame(self, n: int) -> np.ndarray:
        """Frame n: [height, width, 3] uint8 RGB (pixel (row r, column c) samples (c + 0.5, r + 0.5))."""
        cx, cy = (np.float32(v) for v in self.centre(n))
        w, h, r = self.width, self.height, np.float32(SIZES[self.size])
        xs = np.arange(w, dtype=np.float32)[None, :] + np.float32(0.5)
        ys = np.arange(h, dtype=np.float32)[:, None] + np.float32(0.5)
        dx = np.remainder(xs - cx + np.float32(w / 2), np.float32(w)) - np.float32(w / 2)  # toroidal offsets
        dy = np.remainder(ys - cy + np.float32(h / 2), np.float32(h)) - np.float32(h / 2)
        if self.shape == "ball":
            mask = dx**2 + dy**2 <= r**2
        elif self.shape == "square":
            mask = (np.abs(dx) <= r) & (np.abs(dy) <= r)
        else:  # triangle, apex up, half its box
            mask = (np.abs(dy) <= r) & (2 * np.abs(dx) <= dy + r)
        out = np.empty((h, w, 3), np.uint8)
        out[:] = BACKGROUNDS[self.background]
        out[mask] = PALETTE[self.colour]
        return out


class SceneTrack(VideoStreamTrack):
    """A camera showing `scene`, `fps` frames a second, paced in real time (pts on the 90 kHz clock).

    ``capture_times[n]`` is frame n's capture time (``time.time()`` when it was made), ``frames`` how many were
    made; ``max_frames`` ends the track (MediaStreamError) after that many.
    """

    kind = "video"

    def __init__(self, scene: SyntheticScene, fps: float, *, max_frames: int | None = None) -> None:
        super().__init__()
        if not fps > 0:
            raise ValueError(f"fps must be > 0, got {fps!r}")
        self.scene = scene
        self.fps = float(fps)
        self.max_frames = max_frames
        self.frames = 0
        self._start: float | None = None
        self._cache: dict[int, np.ndarray] = {}  # a scene repeats: frame n and n + period look the same

    async def recv(self) -> av.VideoFrame:
        if self.readyState != "live" or self.max_frames is not None and self.frames >= self.max_frames:
            self.stop()
            raise MediaStreamError
        n = self.frames
        if self._start is None:
            self._start = time.monotonic()
        delay = self._start + n / self.fps - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        frame = av.VideoFrame.from_ndarray(self._picture(n), format="rgb24")
        frame.pts = round(n * VIDEO_CLOCK_HZ / self.fps)
        frame.time_base = fractions.Fraction(1, VIDEO_CLOCK_HZ)
        self.frames += 1
        return frame

    def _picture(self, n: int) -> np.ndarray:
        period = _period(self.scene)
        key = n % period if period else n
        if key not in self._cache:
            if len(self._cache) > 512:
                self._cache.clear()
            self._cache[key] = self.scene.frame(key)
        return self._cache[key]


def _period(scene: SyntheticScene) -> int | None:
    """Frames after which the scene repeats exactly (None: not within 512 frames)."""
    dx, dy = MOTIONS[scene.motion]
    for n in range(1, 513):
        if (dx * SPEED * n) % scene.width == 0 and (dy * SPEED * n) % scene.height == 0:
            return n
    return None


def write_y4m(path: str | Path, frames, fps: int) -> Path:
    """Write RGB frames ([H, W, 3] uint8 each, one size) as a Y4M file (4:2:0) at `fps`; returns the path."""
    path = Path(path)
    frames = list(frames)
    if not frames:
        raise ValueError("no frames to write")
    h, w = frames[0].shape[:2]
    with av.open(str(path), "w", format="yuv4mpegpipe") as out:
        stream = out.add_stream("rawvideo", rate=fps)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        for i, rgb in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb), format="rgb24").reformat(format="yuv420p")
            frame.pts = i
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return path
