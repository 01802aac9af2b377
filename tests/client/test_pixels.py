"""The pixel checker reads rendered scenes back: colour, shape, velocity (and it keeps the renderer's palette)."""

import numpy as np
import pytest

from client import pixels
from models import scenes
from models.scenes import Scene, Timeline


def test_palette_is_the_renderers():
    assert pixels.PALETTE == scenes.COLOURS
    assert pixels.BACKGROUNDS == scenes.BACKGROUNDS


def read(scene: Scene, frames=range(9, 21)):
    tl = Timeline(((0, scene, "caption"),))
    readings = [pixels.read_frame(f) for f in tl.render(list(frames)).numpy()]
    return readings, pixels.velocity(readings, 128, 128)


def test_every_colour_shape_size_motion_and_background_is_read_back():
    for colour in scenes.COLOURS:
        for shape in scenes.SHAPES:
            for size in scenes.SIZES:
                for motion in scenes.MOTIONS:
                    for background in scenes.BACKGROUNDS:
                        if background == colour:
                            continue
                        readings, v = read(Scene(colour, shape, size, motion, background), frames=[9, 10, 11])
                        assert {(r.colour, r.shape) for r in readings} == {(colour, shape)}
                        assert pixels.motion(v) == motion
                        assert readings[0].background == scenes.BACKGROUNDS[background]


def test_velocity_is_wrap_aware():
    # a ball moving right crosses the right edge around frame 21
    readings, v = read(Scene("red", "ball", motion="right"), frames=range(15, 30))
    assert v == pytest.approx((scenes.SPEED, 0.0), abs=0.01)
    readings, v = read(Scene("blue", "square", "small", motion="up"), frames=range(15, 30))
    assert v == pytest.approx((0.0, -scenes.SPEED), abs=0.01)


def test_an_object_across_the_edge_keeps_its_shape():
    readings, _ = read(Scene("green", "triangle", motion="down"), frames=[20, 21, 22, 23])  # centre y near 128
    assert all(r.shape == "triangle" for r in readings)


def test_a_blank_frame_has_no_object():
    r = pixels.read_frame(np.full((128, 128, 3), 60, np.uint8))
    assert (r.colour, r.shape, r.centre) == (None, None, None)
    assert pixels.velocity([r, r], 128, 128) is None


def test_noisy_frames_still_read_right():
    rng = np.random.default_rng(0)
    tl = Timeline(((0, Scene("orange", "ball", motion="left", background="black"), "c"),))
    frames = tl.render(list(range(9, 21))).numpy().astype(np.float32)
    noisy = np.clip(frames + rng.normal(0, 20, frames.shape), 0, 255).astype(np.uint8)
    readings = [pixels.read_frame(f) for f in noisy]
    assert [(r.colour, r.shape) for r in readings] == [("orange", "ball")] * 12
    assert pixels.motion(pixels.velocity(readings, 128, 128)) == "left"
