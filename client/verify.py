"""Pixel-verified steering latency: from sending a prompt to the first played frame that shows its colour.

The control latency of DESIGN.md counts from a prompt's send to the first frame *generated under* it
(the chunk header's prompt version): it trusts the server. With the built-in model (models/scenes.py:
one object of a colour on a background) the frames themselves can say when the video obeys: this
module reads the colour word of a prompt (`prompt_colour`), the object's colour in a frame
(`frame_colour`, client/pixels.py's palette and rules, on every other pixel), and times the first
played frame whose colour matches (`PixelLatency`, pure: no asyncio, no I/O; times in seconds on any
monotonic clock).

Frames are read only while a prompt waits for its colour, when they are played (not when they
arrive), so a load test pays for a frame's read only between a prompt and its match.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from client.pixels import FOREGROUND_DISTANCE, MIN_PIXELS, PALETTE, nearest

_WORDS = re.compile(r"[a-z]+")
_BACKGROUND_AFTER = {"background", "wall", "backdrop"}  # "... a white background": the background's colour
_BACKGROUND_BEFORE = {"on", "against"}  # "... on white": the background's colour too
STEP = 2  # frame_colour reads every STEP-th pixel along each axis (a small ball keeps 60 of its 250 pixels)


def prompt_colour(prompt: str) -> str | None:
    """The object's colour word of a prompt (a PALETTE name), or None when it names none. A colour named
    for the background ("on a white background", "against a black wall", "on gray") is not the object's."""
    words = _WORDS.findall(prompt.lower())
    for i, w in enumerate(words):
        if w not in PALETTE:
            continue
        after = words[i + 1] if i + 1 < len(words) else ""
        before = words[i - 1] if i > 0 else ""
        if after in _BACKGROUND_AFTER or before in _BACKGROUND_BEFORE:
            continue
        return w
    return None


def frame_colour(frame: np.ndarray, step: int = STEP) -> str | None:
    """The object's colour in a frame [H, W, 3] uint8 (a PALETTE name), None when there is no object: as
    client/pixels.py `read_frame` finds it (background the border's median, the object every pixel
    FOREGROUND_DISTANCE from it, its colour the palette entry nearest its median), on every `step`-th
    pixel and without the outline filter, about 8x cheaper."""
    f = frame[::step, ::step].astype(np.float32)
    border = np.concatenate([f[0], f[-1], f[:, 0], f[:, -1]])
    bg = np.median(border, axis=0)
    mask = np.square(f - bg).sum(-1) > FOREGROUND_DISTANCE**2
    if int(mask.sum()) * step * step < MIN_PIXELS:
        return None
    return nearest(np.median(f[mask], axis=0))


@dataclass(frozen=True)
class PixelStats:
    """What `PixelLatency` measured for one viewer."""

    latencies_s: tuple[float, ...]  # one per matched prompt: sent -> first played frame showing its colour
    unmatched: int  # prompts whose colour had not played when the session ended (nor a later prompt was sent)
    superseded: int  # prompts whose colour had not played when the next prompt was sent (not counted above)
    no_colour: int  # prompts that name no colour (not timed)
    frames_read: int  # frames whose colour was read
    read_s: float  # time spent reading them


class PixelLatency:
    """One viewer's pixel-verified prompt latency. Feed it the frames in the order they enter the playback
    buffer (`arrived`), each played frame's time in the same order (`played`, PlaybackBuffer's on_render),
    and each prompt with its send time (`prompt_sent`). A frame is any object; `to_rgb` turns it into
    [H, W, 3] uint8 when its colour is needed (e.g. an av.VideoFrame, decoded only then)."""

    def __init__(self, to_rgb: Callable[[Any], np.ndarray] = np.asarray, clock: Callable[[], float] | None = None) -> None:
        self.to_rgb = to_rgb
        self.clock = clock  # times the reads (time.perf_counter); None: not timed
        self._frames: deque[Any] = deque()  # arrived, not played yet, oldest first
        self._awaiting: tuple[str, float] | None = None  # (colour, sent at) of the newest prompt, not on screen yet
        self._latencies: list[float] = []
        self._superseded = 0
        self._no_colour = 0
        self._frames_read = 0
        self._read_s = 0.0

    def arrived(self, frame: Any) -> None:
        """A frame entered the playback buffer (it will play after those before it)."""
        self._frames.append(frame)

    def dropped(self, n: int) -> None:
        """The `n` oldest frames not played yet will not be (a cut to a new prompt)."""
        for _ in range(min(n, len(self._frames))):
            self._frames.popleft()

    def played(self, t: float) -> None:
        """The oldest frame not played yet played at `t`."""
        if not self._frames:
            raise RuntimeError("a frame played that never arrived: call arrived() for every frame, in order")
        frame = self._frames.popleft()
        if self._awaiting is None:
            return
        colour, sent = self._awaiting
        t0 = self.clock() if self.clock else 0.0
        seen = frame_colour(self.to_rgb(frame))
        if self.clock:
            self._read_s += self.clock() - t0
        self._frames_read += 1
        if seen == colour and t >= sent:
            self._latencies.append(t - sent)
            self._awaiting = None

    def prompt_sent(self, prompt: str, t: float) -> None:
        """A prompt went out at `t`: time its colour (a prompt still waiting for its own is superseded)."""
        if self._awaiting is not None:
            self._superseded += 1
        colour = prompt_colour(prompt)
        if colour is None:
            self._no_colour += 1
        self._awaiting = None if colour is None else (colour, t)

    def stats(self) -> PixelStats:
        return PixelStats(tuple(self._latencies), int(self._awaiting is not None), self._superseded,
                          self._no_colour, self._frames_read, self._read_s)
