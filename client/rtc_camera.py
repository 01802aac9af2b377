"""A viewer's camera over WebRTC (issue 35): a frame source as an aiortc video track, and Y4M files for Chromium.

A frame source is ``source(i) -> [H, W, 3] uint8 RGB`` (client/camera.py: ``FileSource`` loops a video file; the
command line renders scenes of models/scenes.py, streamsvc/inputs/synthetic.py). ``FrameTrack`` plays one as a
camera: frame i at start + i / fps in real time, its pts on the 90 kHz video clock, so that aiortc's RTCP sender
reports (its send time paired with the frame's RTP timestamp) give the server the frame's capture time in this
process's clock (``time.time()``). ``write_y4m`` writes frames as a Y4M file: Chromium's fake camera
(``--use-fake-device-for-media-stream --use-file-for-fake-video-capture=FILE``) plays one, looped.
"""

from __future__ import annotations

import asyncio
import fractions
import time
from collections.abc import Callable
from pathlib import Path

import av
import numpy as np
from aiortc import VideoStreamTrack
from aiortc.mediastreams import MediaStreamError

VIDEO_CLOCK_HZ = 90_000
"""The RTP clock of video: a frame's pts counts 1/90000 s."""


class FrameTrack(VideoStreamTrack):
    """A camera playing `source`, `fps` frames a second, paced in real time (pts on the 90 kHz clock).

    ``frames`` counts the frames handed to aiortc; ``max_frames`` ends the track (MediaStreamError) after that many;
    while ``paused()`` the camera shows nothing (no frame goes out; its clock runs on, as a camera's would).
    """

    kind = "video"

    def __init__(self, source: Callable[[int], np.ndarray], fps: float, *, max_frames: int | None = None,
                 paused: Callable[[], bool] = lambda: False) -> None:
        super().__init__()
        if not fps > 0:
            raise ValueError(f"fps must be > 0, got {fps!r}")
        self.source = source
        self.fps = float(fps)
        self.max_frames = max_frames
        self.paused = paused
        self.frames = 0
        self._i = 0  # the camera's frame clock: frame i is due at start + i / fps
        self._start: float | None = None

    async def recv(self) -> av.VideoFrame:
        while True:
            if self.readyState != "live" or self.max_frames is not None and self.frames >= self.max_frames:
                self.stop()
                raise MediaStreamError
            i = self._i
            self._i += 1
            if self._start is None:
                self._start = time.monotonic()
            delay = self._start + i / self.fps - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if self.paused():
                continue
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(self.source(i)), format="rgb24")
            frame.pts = round(i * VIDEO_CLOCK_HZ / self.fps)
            frame.time_base = fractions.Fraction(1, VIDEO_CLOCK_HZ)
            self.frames += 1
            return frame


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
