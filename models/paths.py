"""Object paths for video-to-video training and its evaluation: where an input video's object is, frame by frame.

The text-to-video scenes (models/scenes.py) move their object in a straight line in one of four directions,
because a prompt says which. An input video's object moves however the camera saw it, and the model is to follow
it, not to guess it. So the follow pairs of models/train.py draw their paths from families of motion, each with
random parameters: a model trained on them learns to read the position off the input, which a model trained on
straight lines alone need not (it can extrapolate from its context). `sample_path(rng, family, n, height, width)`
is the object's centre (x, y) in video frames 0 .. n-1, wrapped onto the frame as `scenes.draw` draws it (an
object across an edge shows on the other side). Every family moves at most MAX_SPEED px a frame.

- line: a straight line at any angle and speed (one in ten stands still);
- orbit: a circle or an ellipse (any size, tilt and direction), at a constant angular speed;
- zigzag: forward at a constant speed while the sideways direction reverses every few frames (no forward speed:
  back and forth on a line);
- wave: a sine about a line;
- stop_and_go: runs at a constant velocity and stops, by turns; a new run may take a new direction;
- speed_ramp: a straight line accelerating or decelerating (to a stop, where it stays);
- random_walk: a smooth random walk (its velocity an Ornstein-Uhlenbeck process).

HELD_OUT_FAMILIES (orbit) is never drawn for training (`sample_training_path`), so that the evaluation
(benchmarks/v2v_follow.py) sees a path the model has never seen. Orbits make a fair test: every piece of one is in
training (any direction and speed: lines; a direction turning smoothly: waves and random walks), but the whole is
not: its direction turns one way for ever and it comes back where it was, which no training path does, so a model
that extrapolates the training motions instead of reading the input goes astray. Holding out lines instead would
test little (every family is locally a line) and would lose the motion of text-to-video's scenes.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

MAX_SPEED = 4.0  # px per video frame, any family (the scenes' prompts move 3)

FAMILIES = ("line", "orbit", "zigzag", "wave", "stop_and_go", "speed_ramp", "random_walk")
HELD_OUT_FAMILIES = ("orbit",)  # never drawn for training: the evaluation's unseen motion (module doc)
TRAIN_FAMILIES = tuple(f for f in FAMILIES if f not in HELD_OUT_FAMILIES)


def sample_path(rng: np.random.Generator, family: str, n_frames: int, height: int, width: int) -> np.ndarray:
    """[n_frames, 2] float: the object's centre (x, y) in video frames 0 .. n_frames-1 of a path of `family`,
    its parameters and its start (anywhere in the frame) drawn from `rng`; wrapped onto the width x height frame."""
    if family not in FAMILIES:
        raise ValueError(f"path family {family!r} is unknown; use one of {', '.join(FAMILIES)}")
    if n_frames < 1:
        raise ValueError(f"a path needs at least one frame, got n_frames={n_frames}")
    start = rng.uniform((0.0, 0.0), (width, height))
    offsets = OFFSETS[family](rng, n_frames)  # [n, 2] from the start, unwrapped, offsets[0] == 0
    return np.mod(start + offsets, (width, height))


def sample_training_path(rng: np.random.Generator, n_frames: int, height: int, width: int) -> np.ndarray:
    """`sample_path` of a training family, each as likely (never one of HELD_OUT_FAMILIES)."""
    family = TRAIN_FAMILIES[int(rng.integers(len(TRAIN_FAMILIES)))]
    return sample_path(rng, family, n_frames, height, width)


# -- the families: each returns the offsets [n, 2] from the start, unwrapped (0 at frame 0) ------------------


def _direction(angle: float | np.ndarray) -> np.ndarray:
    return np.stack([np.cos(angle), np.sin(angle)], axis=-1)


def _from_steps(steps: np.ndarray) -> np.ndarray:
    """[n - 1, 2] per-frame moves -> [n, 2] offsets from frame 0."""
    return np.concatenate([np.zeros((1, 2)), np.cumsum(steps, axis=0)])


def _line(rng: np.random.Generator, n: int) -> np.ndarray:
    u = _direction(rng.uniform(0, 2 * np.pi))
    speed = rng.uniform(0.5, MAX_SPEED) if rng.random() >= 0.1 else 0.0
    return np.arange(n)[:, None] * speed * u


def _orbit(rng: np.random.Generator, n: int) -> np.ndarray:
    a = rng.uniform(8.0, 40.0)  # the larger semi-axis, px
    b = a if rng.random() < 0.4 else a * rng.uniform(0.35, 0.9)
    omega = rng.uniform(1.0, MAX_SPEED) / a * rng.choice((-1, 1))  # rad a frame: at most MAX_SPEED px along the arc
    angle = rng.uniform(0, 2 * np.pi) + omega * np.arange(n)
    tilt = rng.uniform(0, np.pi)
    rotation = np.array([[np.cos(tilt), -np.sin(tilt)], [np.sin(tilt), np.cos(tilt)]])
    points = np.stack([a * np.cos(angle), b * np.sin(angle)], axis=1) @ rotation.T
    return points - points[0]


def _zigzag(rng: np.random.Generator, n: int) -> np.ndarray:
    angle = rng.uniform(0, 2 * np.pi)
    u, w = _direction(angle), _direction(angle + np.pi / 2)
    forward = 0.0 if rng.random() < 0.3 else rng.uniform(0.3, 2.5)
    sideways = rng.uniform(1.0, np.sqrt(MAX_SPEED**2 - forward**2))
    leg = int(rng.integers(4, 17))  # frames between reversals
    sign = np.where((np.arange(n - 1) + int(rng.integers(leg))) // leg % 2 == 0, 1.0, -1.0)
    return _from_steps(forward * u + sideways * sign[:, None] * w)


def _wave(rng: np.random.Generator, n: int) -> np.ndarray:
    angle = rng.uniform(0, 2 * np.pi)
    u, w = _direction(angle), _direction(angle + np.pi / 2)
    forward = rng.uniform(0.5, 3.5)
    period = rng.uniform(16.0, 64.0)  # frames
    peak = rng.uniform(0.5, np.sqrt(MAX_SPEED**2 - forward**2))  # the sideways speed at the crossings
    amplitude = min(peak * period / (2 * np.pi), 32.0)
    t = np.arange(n)[:, None]
    phase = rng.uniform(0, 2 * np.pi)
    side = amplitude * (np.sin(2 * np.pi * t / period + phase) - np.sin(phase))
    return forward * t * u + side * w


def _stop_and_go(rng: np.random.Generator, n: int) -> np.ndarray:
    steps, moving, u = [], bool(rng.random() < 0.5), _direction(rng.uniform(0, 2 * np.pi))
    while len(steps) < n - 1:
        if moving:
            if steps and rng.random() < 0.5:  # a new run, a new direction
                u = _direction(rng.uniform(0, 2 * np.pi))
            steps += [rng.uniform(1.0, MAX_SPEED) * u] * int(rng.integers(4, 21))
        else:
            steps += [np.zeros(2)] * int(rng.integers(3, 16))
        moving = not moving
    return _from_steps(np.asarray(steps[: n - 1]).reshape(-1, 2))


def _speed_ramp(rng: np.random.Generator, n: int) -> np.ndarray:
    u = _direction(rng.uniform(0, 2 * np.pi))
    if rng.random() < 0.5:  # accelerating
        v0, accel = rng.uniform(0.0, 2.0), rng.uniform(0.03, 0.15)
    else:  # decelerating
        v0, accel = rng.uniform(2.0, MAX_SPEED), -rng.uniform(0.03, 0.15)
    speed = np.clip(v0 + accel * np.arange(1, n), 0.0, MAX_SPEED)  # frame k-1 -> k moves at the speed of frame k
    return _from_steps(speed[:, None] * u)


def _random_walk(rng: np.random.Generator, n: int) -> np.ndarray:
    keep = rng.uniform(0.85, 0.97)  # how much of its velocity the object keeps a frame: the smoothness
    spread = rng.uniform(1.0, 3.0)  # the velocity's std per axis, px a frame
    v = rng.normal(0.0, spread, size=2)
    steps = []
    for kick in rng.normal(0.0, spread * np.sqrt(1 - keep**2), size=(n - 1, 2)):
        v = keep * v + kick
        speed = float(np.hypot(*v))
        if speed > MAX_SPEED:
            v = v * (MAX_SPEED / speed)
        steps.append(v)
    return _from_steps(np.asarray(steps).reshape(-1, 2))


OFFSETS: dict[str, Callable[[np.random.Generator, int], np.ndarray]] = {
    "line": _line,
    "orbit": _orbit,
    "zigzag": _zigzag,
    "wave": _wave,
    "stop_and_go": _stop_and_go,
    "speed_ramp": _speed_ramp,
    "random_walk": _random_walk,
}
