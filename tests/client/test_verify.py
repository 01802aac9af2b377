"""Pixel-verified prompt latency: the prompt's colour word, a frame's colour, the first played frame that shows it."""

import ast
from pathlib import Path

import numpy as np
import pytest

from client import loadtest_prompts, loadtest_report, pixels
from client.playback import PlaybackBuffer
from client.verify import PixelLatency, frame_colour, prompt_colour
from models import scenes
from models.scenes import Scene, Timeline

CLIENT = Path(__file__).resolve().parents[2] / "client"


def test_the_client_imports_nothing_of_models():
    for path in CLIENT.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n == "models" or n.startswith("models.") for n in names), path.name


@pytest.mark.parametrize("prompt, colour", [
    ("a red ball moving right", "red"),
    ("show me the little BLUE box, falling", "blue"),
    ("a purple triangle on a white background", "purple"),
    ("on a black background, a white square", "white"),
    ("a yellow ball against a gray wall", "yellow"),
    ("a green circle on white", "green"),
    ("a cat on a roof", None),
    ("a square in front of a white wall", None),
])
def test_the_colour_word_of_a_prompt_is_the_objects(prompt, colour):
    assert prompt_colour(prompt) == colour


def test_every_caption_the_model_is_trained_on_gives_its_colour():
    rng = np.random.default_rng(0)
    for _ in range(500):
        scene = scenes.sample_scene(rng)
        assert prompt_colour(scene.caption(rng)) == scene.colour


def test_frame_colour_reads_what_read_frame_reads():
    rng = np.random.default_rng(1)
    for colour in scenes.COLOURS:
        for shape in scenes.SHAPES:
            for size in scenes.SIZES:
                for background in scenes.BACKGROUNDS:
                    if background == colour:
                        continue
                    tl = Timeline(((0, Scene(colour, shape, size, "right", background), "c"),))
                    for frame in tl.render([int(rng.integers(0, 60))]).numpy():
                        assert frame_colour(frame) == pixels.read_frame(frame).colour == colour
    assert frame_colour(np.full((128, 128, 3), 60, np.uint8)) is None


def solid(colour: str | None) -> np.ndarray:
    """A frame with a big square of `colour` on dark gray (None: no object)."""
    f = np.full((128, 128, 3), 60, np.uint8)
    if colour is not None:
        f[40:80, 40:80] = scenes.COLOURS[colour]
    return f


def test_latency_is_from_the_send_to_the_first_played_frame_of_the_colour():
    px = PixelLatency()
    buf = PlaybackBuffer(16, on_render=px.played)
    buf.connect(0.0)
    for c in ["red"] * 8:
        px.arrived(solid(c))
    buf.push(8, 0, 0.0)  # frame k plays at k / 16
    buf.advance(0.1)  # as the client does: the buffer plays what is due before the prompt goes out
    px.prompt_sent("a blue square falling", 0.1)
    for c in ["red", "blue", "blue"]:
        px.arrived(solid(c))
    buf.push(3, 1, 0.2)
    buf.advance(1.0)  # frames 0..10 played; the first blue one is frame 9, at 9 / 16
    s = px.stats()
    assert s.latencies_s == pytest.approx((9 / 16 - 0.1,))
    assert (s.unmatched, s.superseded, s.no_colour) == (0, 0, 0)
    assert s.frames_read == 9 - 1  # frames 2..9: the ones played while the prompt waited (none before it)


def test_unmatched_superseded_and_colourless_prompts_are_counted_apart():
    px = PixelLatency()
    for c in ["red", None, "red", "green", "green"]:
        px.arrived(solid(c))
    px.prompt_sent("a green ball", 0.0)
    px.played(0.1)  # red
    px.prompt_sent("a white ball", 0.15)  # the green prompt never showed: superseded
    px.played(0.2)  # no object
    px.played(0.3)  # red
    px.prompt_sent("a cat", 0.35)  # no colour word: not timed, and the white prompt is superseded
    px.played(0.4)
    px.prompt_sent("a yellow box", 0.45)
    px.played(0.5)  # green: not yellow
    s = px.stats()
    assert s.latencies_s == () and (s.unmatched, s.superseded, s.no_colour) == (1, 2, 1)
    assert s.frames_read == 4 and s.read_s == 0.0  # all but the frame played at 0.4; no clock given: not timed
    with pytest.raises(RuntimeError, match="never arrived"):
        px.played(0.6)


def test_frames_convert_only_when_read():
    converted = []

    def to_rgb(frame):
        converted.append(frame)
        return solid(frame)

    px = PixelLatency(to_rgb)
    for c in ["red", "red", "blue", "blue"]:
        px.arrived(c)
    px.played(0.0)  # nothing awaited: not converted
    px.prompt_sent("a blue ball", 0.05)
    for t in (0.1, 0.2, 0.3):
        px.played(t)
    assert converted == ["red", "blue"] and px.stats().latencies_s == pytest.approx((0.15,))


def test_load_test_captions_ask_for_a_new_colour_each_time():
    for i in range(16):
        sched = loadtest_prompts.prompt_schedule(i, 16, 5.0, 30.0, captions=True)
        prompts = [loadtest_prompts.caption(i, 0)] + [p for _, p in sched]
        colours = [prompt_colour(p) for p in prompts]
        assert None not in colours and all(a != b for a, b in zip(colours, colours[1:]))
        for p in prompts:  # every word is a caption word of the built-in model
            assert set(p.split()) <= set(scenes.vocabulary()), p
    assert loadtest_prompts.caption(0, 0) == "a red ball moving right"


def test_a_pixel_summary_reports_percentiles_and_misses():
    from client.verify import PixelStats

    stats = [PixelStats((0.5, 1.0), 0, 1, 0, 40, 0.01), PixelStats((1.5,), 2, 0, 1, 20, 0.005)]
    s = loadtest_report.pixel_summary(stats)
    assert (s["n"], s["p50"], s["max"], s["unmatched"], s["superseded"], s["no_colour"]) == (3, 1.0, 1.5, 2, 1, 1)
    assert s["frames_read"] == 60 and s["read_ms_per_frame"] == 0.25
    assert loadtest_report.pixel_summary([]) is None
