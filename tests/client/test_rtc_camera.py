"""client/synthetic.py: the synthetic camera draws models/scenes.py's scenes pixel for pixel, as a paced aiortc
track and as a Y4M file (issue 35)."""

from __future__ import annotations

import time
from fractions import Fraction

import av
import numpy as np
import pytest
from aiortc.mediastreams import MediaStreamError

from client.pixels import read_frame
from client.synthetic import SceneTrack, SyntheticScene, write_y4m
from models.scenes import Scene, Timeline


@pytest.mark.parametrize("colour,shape,motion,size,background,width,height", [
    ("red", "ball", "right", "big", "dark gray", 128, 128),
    ("blue", "square", "up", "small", "white", 160, 96),
    ("yellow", "triangle", "left", "big", "black", 96, 128),
    ("green", "ball", "still", "small", "gray", 64, 64),
])
def test_it_draws_what_the_built_in_models_scenes_draw(colour, shape, motion, size, background, width, height):
    scene = Scene(colour, shape, size, motion, background)
    expected = Timeline(((0, scene, "x"),), height, width).render(range(60)).numpy()
    synthetic = SyntheticScene(colour, shape, motion, size, background, width, height)
    assert np.array_equal(np.stack([synthetic.frame(n) for n in range(60)]), expected)
    assert np.allclose([synthetic.centre(n) for n in range(60)],
                       Timeline(((0, scene, "x"),), height, width).centres(range(60)))


def test_a_scene_from_words_and_bad_words():
    assert SyntheticScene.parse("synthetic") == SyntheticScene()
    assert SyntheticScene.parse("blue square down", 96, 64) == SyntheticScene("blue", "square", "down", width=96,
                                                                               height=64)
    assert SyntheticScene.parse("green triangle up") == SyntheticScene("green", "triangle", "up")
    with pytest.raises(ValueError, match="unknown word 'fox'"):
        SyntheticScene.parse("red fox")
    with pytest.raises(ValueError, match="is not one of"):
        SyntheticScene(colour="teal")


def test_a_y4m_file_plays_back_the_frames(tmp_path):
    scene = SyntheticScene("red", "ball", "right")
    frames = [scene.frame(n) for n in range(12)]
    path = write_y4m(tmp_path / "cam.y4m", frames, 16)
    assert path.read_bytes().startswith(b"YUV4MPEG2 W128 H128 F16:1")
    with av.open(str(path)) as f:
        decoded = [frame.to_ndarray(format="rgb24") for frame in f.decode(video=0)]
    assert len(decoded) == 12
    for n, rgb in enumerate(decoded):  # 4:2:0 and limited range blur the edge; the ball is where it was drawn
        reading = read_frame(rgb)
        assert reading.colour == "red" and np.allclose(reading.centre, scene.centre(n), atol=1.0)


async def test_the_track_is_paced_and_stamped_on_the_video_clock():
    track = SceneTrack(SyntheticScene(), fps=20, max_frames=10)
    t0 = time.monotonic()
    frames = [await track.recv() for _ in range(10)]
    took = time.monotonic() - t0
    assert [f.pts for f in frames] == [n * 4500 for n in range(10)] and frames[0].time_base == Fraction(1, 90_000)
    assert 0.4 <= took <= 1.5, took  # 9 frame periods of 50 ms
    assert np.array_equal(frames[7].to_ndarray(format="rgb24"), SyntheticScene().frame(7))
    with pytest.raises(MediaStreamError):
        await track.recv()  # max_frames: the track ended
