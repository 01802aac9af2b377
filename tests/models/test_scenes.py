"""The procedural scenes the built-in model is trained on."""

import itertools

import numpy as np
import pytest
import torch

from models.scenes import (
    BACKGROUNDS,
    COLOURS,
    DEFAULT_BACKGROUND,
    HELD_OUT,
    MOTIONS,
    SHAPES,
    SIZES,
    SPEED,
    TRAIN_TRIPLES,
    Scene,
    Timeline,
    chunks_of_frames,
    sample_clip,
    sample_scene,
    vocabulary,
)
from models.text import HashTextEncoder


def one(scene: Scene, **kw) -> Timeline:
    return Timeline(((0, scene, "caption"),), **kw)


def test_frames_map_to_chunks_as_the_decoder_emits_them():
    # the first chunk decodes to 9 frames, later ones to 12
    assert chunks_of_frames(np.array([0, 8, 9, 20, 21])).tolist() == [0, 0, 1, 1, 2]


def test_at_chunk_size_one_a_chunk_is_one_latent_frame():
    # video frame 0 is latent frame 0, frames 1-4 latent frame 1, 5-8 latent frame 2, ...: a chunk each
    assert chunks_of_frames(np.array([0, 1, 4, 5, 8, 9, 12, 13]), 1).tolist() == [0, 1, 1, 2, 2, 3, 3, 4]
    a, b = Scene("red", "ball", motion="right"), Scene("blue", "square", motion="down")
    tl = Timeline(((0, a, "A"), (4, b, "B")), frames_per_chunk=1)  # a switch on the boundary of latent frame 4
    assert tl.segments_of_frames([12, 13]).tolist() == [0, 1]
    xy = tl.centres(range(15))
    assert np.allclose(xy[12] - xy[11], (SPEED, 0)) and np.allclose(xy[13] - xy[12], (0, SPEED))
    # the same moment in chunks of 3 and of 1 (chunk 2 of 3 = latent frame 6 = chunk 6 of 1): the same video
    three = Timeline(((0, a, "A"), (2, b, "B")))
    one = Timeline(((0, a, "A"), (6, b, "B")), frames_per_chunk=1)
    assert torch.equal(three.render(range(40)), one.render(range(40)))
    assert not torch.equal(three.render(range(40)), Timeline(((0, a, "A"), (2, b, "B")), frames_per_chunk=1).render(range(40)))


def test_object_starts_centred_moves_at_constant_speed_and_wraps():
    tl = one(Scene("red", "ball", motion="right"))
    xy = tl.centres(range(0, 50))
    assert tuple(xy[0]) == (64.0, 64.0)
    assert np.allclose(xy[1:11, 0] - xy[:10, 0], SPEED) and np.all(xy[:, 1] == 64)
    assert xy[49, 0] == (64 + 49 * SPEED) % 128  # wrapped around the right edge
    frame = tl.render([22]).numpy()[0]  # centre at x = 130 - 128 = 2: the ball shows on both edges
    red = np.all(frame == COLOURS["red"], axis=-1)
    assert red[64, 0] and red[64, 127] and not red[64, 64]


@pytest.mark.parametrize("shape, fill", [("ball", np.pi / 4), ("square", 1.0), ("triangle", 0.5)])
def test_shapes_fill_their_box_as_expected(shape, fill):
    frame = one(Scene("blue", shape, "big"), height=96, width=96).render([0]).numpy()[0]
    mask = np.all(frame == COLOURS["blue"], axis=-1)
    side = 2 * SIZES["big"]
    assert mask.sum() / side**2 == pytest.approx(fill, abs=0.03)
    assert np.all(frame[~mask] == BACKGROUNDS[DEFAULT_BACKGROUND])


def test_a_switch_keeps_the_position_and_changes_attributes_from_the_next_chunk():
    tl = Timeline(
        (
            (0, Scene("red", "ball", motion="right"), "a red ball moving right"),
            (2, Scene("blue", "square", "small", "down", "white"), "a small blue box falling on white"),
        )
    )
    xy = tl.centres(range(0, 26))
    assert np.allclose(xy[20] - xy[19], (SPEED, 0)) and np.allclose(xy[21] - xy[20], (0, SPEED))
    frames = tl.render([20, 21]).numpy()
    assert np.all(frames[0, 0, 0] == BACKGROUNDS[DEFAULT_BACKGROUND]) and np.all(frames[1, 0, 0] == BACKGROUNDS["white"])
    assert np.all(frames[1][round(xy[21, 1]), round(xy[21, 0])] == COLOURS["blue"])


def test_clips_are_deterministic_from_a_seed():
    a = sample_clip(np.random.default_rng(7))
    b = sample_clip(np.random.default_rng(7))
    assert a == b
    frames = list(range(0, 9 + 12 * 4))
    assert torch.equal(a.timeline.render(frames), b.timeline.render(frames))


def test_clips_cover_switches_and_old_sinks():
    rng = np.random.default_rng(0)
    clips = [sample_clip(rng) for _ in range(200)]
    assert all(c.chunks[0] == 0 and len(c.chunks) == 5 for c in clips)
    assert all(list(c.chunks[1:]) == list(range(c.chunks[1], c.chunks[1] + 4)) for c in clips)
    long = [c for c in clips if c.long]
    switched = [c for c in clips if len(c.timeline.segments) > 1]
    assert 30 < len(long) < 100 and 60 < len(switched) < 160
    # some long clips have sinks under an earlier prompt than their window's
    assert any(c.timeline.segment_at(0) != c.timeline.segment_at(c.chunks[1]) for c in long)


def test_clips_at_chunk_size_one_hold_three_sink_chunks_and_switch_anywhere():
    """At chunk size 1 the cache's 3 sink frames are chunks 0, 1 and 2: a clip holds them, then consecutive chunks
    (from far in for a long clip, up to 180 latent frames: the 45 s of 60 chunks of 3); a switch may land among the
    sinks of a clip from the stream's start."""
    rng = np.random.default_rng(0)
    clips = [sample_clip(rng, 13, frames_per_chunk=1, sinks=3) for _ in range(300)]
    assert all(c.chunks[:3] == (0, 1, 2) and len(c.chunks) == 13 and c.frames_per_chunk == 1 for c in clips)
    assert all(list(c.chunks[3:]) == list(range(c.chunks[3], c.chunks[3] + 10)) for c in clips)
    long = [c for c in clips if c.long]
    assert 50 < len(long) < 140 and all(13 <= c.chunks[3] < 180 for c in long) and max(c.chunks[3] for c in long) > 60
    assert all(c.chunks[3] == 3 for c in clips if not c.long)
    starts = [start for c in clips for start, _, _ in c.timeline.segments[1:]]
    assert {1, 2} <= set(starts)  # switches among the sinks, as a stream's first chunks see them
    assert any(c.timeline.segment_at(0) != c.timeline.segment_at(c.chunks[3]) for c in long)
    # a rollout's short clip of fewer chunks than the sinks
    assert sample_clip(rng, 2, frames_per_chunk=1, sinks=3).chunks == (0, 1)


def test_no_object_is_drawn_on_its_own_colour():
    rng = np.random.default_rng(1)
    assert all(s.background != s.colour for s in (sample_scene(rng) for _ in range(500)))
    with pytest.raises(ValueError, match="invisible"):
        Scene("white", "ball", background="white")


def test_held_out_triples_are_never_drawn_but_every_pair_is_seen():
    rng = np.random.default_rng(2)
    drawn = {sample_scene(rng).triple for _ in range(3000)}
    assert drawn == set(TRAIN_TRIPLES) and not drawn & HELD_OUT
    for i, j in itertools.combinations(range(3), 2):
        all_pairs = {(t[i], t[j]) for t in itertools.product(COLOURS, SHAPES, MOTIONS)}
        assert {(t[i], t[j]) for t in TRAIN_TRIPLES} == all_pairs
    assert {sample_scene(rng, held_out=True).triple for _ in range(200)} == HELD_OUT


def test_captions_name_the_scene_in_varied_words():
    rng = np.random.default_rng(3)
    scene = Scene("green", "square", "small", "up", "black")
    captions = {scene.caption(rng) for _ in range(100)}
    assert len(captions) > 30
    for c in captions:
        words = c.replace(",", "").split()
        assert "green" in words and ({"square", "box"} & set(words)) and "black" in words
        assert {"small", "little", "tiny"} & set(words)
    words = {w for c in captions for w in HashTextEncoder(8, 16).tokenize(c)}
    assert words <= set(vocabulary())
