"""The object paths of video-to-video training and its evaluation (models/paths.py)."""

import numpy as np
import pytest

from models.paths import FAMILIES, HELD_OUT_FAMILIES, MAX_SPEED, TRAIN_FAMILIES, sample_path, sample_training_path

H, W = 96, 128  # not square: x wraps at W, y at H
N = 120


def steps(path: np.ndarray) -> np.ndarray:
    """[N, 2] wrapped centres -> [N - 1, 2] per-frame moves, unwrapped (a move is shorter than half the frame)."""
    d = np.diff(path, axis=0)
    size = np.array([W, H])
    return np.mod(d + size / 2, size) - size / 2


def cross(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return a[..., 0] * b[..., 1] - a[..., 1] * b[..., 0]


def signatures(d: np.ndarray) -> set[str]:
    """The families whose defining property the moves `d` have (each property holds for its own family alone)."""
    speed = np.hypot(*d.T)
    moving = speed > 1e-9
    distinct = np.unique(np.round(d, 6), axis=0)
    ref = d[np.argmax(speed)]
    parallel = bool(np.all(np.abs(cross(d, ref)) < 1e-6) and np.all(d @ ref >= -1e-9))
    turns = cross(d[:-1], d[1:])
    out = set()
    if len(distinct) == 1:
        out.add("line")  # a still object (one line in ten) too
    if parallel and len(distinct) > 1 and (np.all(np.diff(speed) >= -1e-9) or np.all(np.diff(speed) <= 1e-9)):
        out.add("speed_ramp")  # one direction, the speed only ever rising (or only falling)
    restarts = np.any(~moving[:-1] & moving[1:])
    if restarts and np.any(moving[:-1] & ~moving[1:]):
        out.add("stop_and_go")  # stops, and goes again
    if moving.all() and len(distinct) == 2 and abs(np.hypot(*distinct[0]) - np.hypot(*distinct[1])) < 1e-6:
        out.add("zigzag")  # two moves of one length, by turns
    if len(distinct) > 2 and moving.all():
        # the moves lie on one line in velocity space (a constant forward part), on both sides of the origin's foot
        centred = d - d.mean(axis=0)
        axis = np.linalg.svd(centred, full_matrices=False)[2][0]
        on_line = np.abs(cross(centred, axis)).max() < 1e-6
        foot = d.mean(axis=0) - (d.mean(axis=0) @ axis) * axis
        along = (d - foot) @ axis
        if on_line and along.min() < -1e-3 and along.max() > 1e-3:
            out.add("wave")
        elif not on_line and (np.all(turns > 1e-9) or np.all(turns < -1e-9)):
            out.add("orbit")  # always turning the same way
        elif not on_line and turns.min() < 0 < turns.max() and len(distinct) == len(d):
            out.add("random_walk")  # turning both ways, a new velocity every frame
    return out


def test_a_path_is_the_same_for_a_seed_and_another_for_another_seed():
    for family in FAMILIES:
        a = sample_path(np.random.default_rng(7), family, N, H, W)
        b = sample_path(np.random.default_rng(7), family, N, H, W)
        c = sample_path(np.random.default_rng(8), family, N, H, W)
        assert a.shape == (N, 2) and np.array_equal(a, b), family
        assert not np.allclose(a, c), family
    assert np.array_equal(sample_training_path(np.random.default_rng(3), N, H, W),
                          sample_training_path(np.random.default_rng(3), N, H, W))


@pytest.mark.parametrize("family", FAMILIES)
def test_paths_stay_on_the_frame_move_continuously_and_at_most_max_speed(family):
    rng = np.random.default_rng(0)
    fastest = 0.0
    for _ in range(40):
        path = sample_path(rng, family, N, H, W)
        assert np.all((path >= 0) & (path < (W, H))), family
        d = steps(path)
        speed = np.hypot(*d.T)
        assert speed.max() <= MAX_SPEED + 1e-9, (family, speed.max())  # no jumps: wrapping only moves on the torus
        raw = np.abs(np.diff(path, axis=0))
        jumps = raw > MAX_SPEED + 1e-9  # where a coordinate leaves one edge and enters the other
        assert np.allclose(raw[jumps[:, 0], 0] + np.abs(d[jumps[:, 0], 0]), W), family
        assert np.allclose(raw[jumps[:, 1], 1] + np.abs(d[jumps[:, 1], 1]), H), family
        fastest = max(fastest, speed.max())
    assert fastest > 0.6 * MAX_SPEED, family  # the families reach fast motion, not only crawls


def test_paths_wrap_and_cover_the_frame():
    starts = np.array([sample_path(np.random.default_rng(s), "line", 2, H, W)[0] for s in range(200)])
    assert starts[:, 0].min() < 0.1 * W and starts[:, 0].max() > 0.9 * W  # any start
    assert starts[:, 1].min() < 0.1 * H and starts[:, 1].max() > 0.9 * H
    wrapped = [np.abs(np.diff(sample_path(np.random.default_rng(s), "line", N, H, W), axis=0)).max() > W / 2 for s in range(20)]
    assert any(wrapped)  # a fast line crosses an edge in 120 frames


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_has_its_own_motion(family):
    rng = np.random.default_rng(1)
    for _ in range(25):
        d = steps(sample_path(rng, family, N, H, W))
        assert signatures(d) == {family}, (family, signatures(d), d[:8])


def test_the_training_sampler_draws_every_training_family_and_never_a_held_out_one():
    assert set(HELD_OUT_FAMILIES) and set(HELD_OUT_FAMILIES) <= set(FAMILIES)
    assert set(TRAIN_FAMILIES) == set(FAMILIES) - set(HELD_OUT_FAMILIES)
    rng = np.random.default_rng(2)
    seen = {}
    for _ in range(400):
        (family,) = signatures(steps(sample_training_path(rng, N, H, W)))
        seen[family] = seen.get(family, 0) + 1
    assert set(seen) == set(TRAIN_FAMILIES), seen
    assert min(seen.values()) > 400 / len(TRAIN_FAMILIES) / 2, seen  # about as likely each


def test_an_unknown_family_or_no_frames_is_refused():
    with pytest.raises(ValueError, match="unknown; use one of line"):
        sample_path(np.random.default_rng(0), "spiral", N, H, W)
    with pytest.raises(ValueError, match="at least one frame"):
        sample_path(np.random.default_rng(0), "line", 0, H, W)
    assert sample_path(np.random.default_rng(0), "random_walk", 1, H, W).shape == (1, 2)
