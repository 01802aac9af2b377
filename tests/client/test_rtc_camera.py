"""client/rtc_camera.py: a frame source as a paced aiortc camera, and Y4M files for Chromium's fake camera (issue 35)."""

from __future__ import annotations

import asyncio
import time
from fractions import Fraction

import av
import numpy as np
import pytest
from aiortc.mediastreams import MediaStreamError

from client.pixels import read_frame
from client.rtc_camera import FrameTrack, write_y4m
from models.scenes import Scene, Timeline

SCENE = Timeline(((0, Scene("red", "ball", motion="right"), "a red ball moving right"),), 128, 128)


def test_a_y4m_file_plays_back_the_frames(tmp_path):
    frames = SCENE.render(range(12)).numpy()
    path = write_y4m(tmp_path / "cam.y4m", frames, 16)
    assert path.read_bytes().startswith(b"YUV4MPEG2 W128 H128 F16:1")
    with av.open(str(path)) as f:
        decoded = [frame.to_ndarray(format="rgb24") for frame in f.decode(video=0)]
    assert len(decoded) == 12
    centres = SCENE.centres(range(12))
    for n, rgb in enumerate(decoded):  # 4:2:0 and limited range blur the edge; the ball is where it was drawn
        reading = read_frame(rgb)
        assert reading.colour == "red" and np.allclose(reading.centre, centres[n], atol=1.0)
    with pytest.raises(ValueError, match="no frames"):
        write_y4m(tmp_path / "empty.y4m", [], 16)


async def test_the_track_is_paced_and_stamped_on_the_video_clock_and_pauses():
    video = SCENE.render(range(20)).numpy()
    paused = {"now": False}
    track = FrameTrack(lambda i: video[i % 20], fps=20, max_frames=10, paused=lambda: paused["now"])
    t0 = time.monotonic()
    frames = [await track.recv() for _ in range(6)]
    paused["now"] = True
    asked = time.monotonic()
    later = asyncio.create_task(track.recv())
    await asyncio.sleep(0.2)
    assert not later.done()  # paused: nothing goes out
    paused["now"] = False
    frames.append(await later)
    frames += [await track.recv() for _ in range(3)]
    took = time.monotonic() - t0
    assert [f.pts for f in frames[:6]] == [n * 4500 for n in range(6)] and frames[0].time_base == Fraction(1, 90_000)
    assert frames[6].pts >= 4500 * 9 and time.monotonic() - asked >= 0.2  # the camera's clock ran on while paused
    assert 0.6 <= took <= 2.0, took
    k = frames[6].pts // 4500
    assert np.array_equal(frames[6].to_ndarray(format="rgb24"), video[k % 20])
    assert track.frames == 10
    with pytest.raises(MediaStreamError):
        await track.recv()  # max_frames: the track ended
