"""What a frame of the built-in model shows: the object's colour, shape and velocity, read off pixels.

The built-in model draws one object on a flat background (models/scenes.py). This reads it back
without the model: the background is the median of the border pixels, the foreground every pixel
far from it, the colour the palette entry nearest the foreground's median, the shape its fill ratio
of its bounding box (a square fills it, a ball pi/4 of it, a triangle half), and the velocity the
step of its centroid between frames, wrap-aware (objects leave one edge and enter the opposite one).
The client imports nothing of models/: the palette is its own copy (a test checks they agree).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

PALETTE: dict[str, tuple[int, int, int]] = {  # object colours, as models/scenes.py draws them
    "red": (230, 30, 30),
    "green": (30, 200, 50),
    "blue": (40, 80, 240),
    "yellow": (245, 220, 30),
    "orange": (250, 140, 0),
    "purple": (150, 50, 210),
    "white": (255, 255, 255),
}
BACKGROUNDS: dict[str, tuple[int, int, int]] = {
    "white": (255, 255, 255),
    "black": (0, 0, 0),
    "gray": (128, 128, 128),
    "dark gray": (60, 60, 60),
}
FOREGROUND_DISTANCE = 80.0  # RGB distance from the background beyond which a pixel is the object's
MIN_PIXELS = 20  # fewer foreground pixels than this: no object
# fill ratio of the bounding box: square 1, ball pi/4 = 0.785, triangle 0.5; the cuts halfway between
SQUARE_ABOVE, TRIANGLE_BELOW = 0.89, 0.64


@dataclass(frozen=True)
class Reading:
    """What one frame shows."""

    background: tuple[int, int, int]  # RGB, the border pixels' median
    colour: str | None  # nearest PALETTE name to the foreground's median colour; None: no object
    shape: str | None  # ball | square | triangle; None: no object
    centre: tuple[float, float] | None  # (x, y) in pixels, wrap-aware
    pixels: int  # foreground pixels


def read_frame(frame: np.ndarray) -> Reading:
    """frame [H, W, 3] uint8 -> what it shows."""
    f = frame.astype(np.float32)
    border = np.concatenate([f[0], f[-1], f[:, 0], f[:, -1]])
    bg = np.median(border, axis=0)
    mask = _majority(np.linalg.norm(f - bg, axis=-1) > FOREGROUND_DISTANCE)
    n = int(mask.sum())
    bg_rgb = tuple(int(round(c)) for c in bg)
    if n < MIN_PIXELS:
        return Reading(bg_rgb, None, None, None, n)
    colour = nearest(np.median(f[mask], axis=0))
    cx, cy = _circular_mean(mask.sum(0)), _circular_mean(mask.sum(1))
    return Reading(bg_rgb, colour, _shape(mask, cx, cy), (cx, cy), n)


def _majority(mask: np.ndarray) -> np.ndarray:
    """Pixels of `mask` with at least 5 of their 3x3 neighbourhood in it (wrapping at the edges):
    stray noise pixels go, the object's outline stays."""
    count = sum(np.roll(mask, (dy, dx), axis=(0, 1)).astype(np.uint8) for dy in (-1, 0, 1) for dx in (-1, 0, 1))
    return mask & (count >= 5)


def nearest(rgb: Sequence[float]) -> str:
    """The PALETTE name nearest an RGB colour."""
    names = list(PALETTE)
    dist = np.linalg.norm(np.array([PALETTE[c] for c in names], dtype=np.float32) - np.asarray(rgb, np.float32), axis=1)
    return names[int(dist.argmin())]


def _circular_mean(weights: np.ndarray) -> float:
    """Mean position along an axis of period len(weights), weighted: the centroid of a wrapped object."""
    size = len(weights)
    angle = 2 * np.pi * (np.arange(size) + 0.5) / size
    mean = np.arctan2((weights * np.sin(angle)).sum(), (weights * np.cos(angle)).sum())
    return float((mean % (2 * np.pi)) * size / (2 * np.pi))


def _shape(mask: np.ndarray, cx: float, cy: float) -> str:
    """The shape from the fill ratio of the bounding box, the mask rolled so the object sits centred."""
    h, w = mask.shape
    centred = np.roll(mask, (h // 2 - int(cy), w // 2 - int(cx)), axis=(0, 1))
    rows, cols = np.flatnonzero(centred.any(1)), np.flatnonzero(centred.any(0))
    fill = centred.sum() / ((rows[-1] - rows[0] + 1) * (cols[-1] - cols[0] + 1))
    return "square" if fill > SQUARE_ABOVE else "triangle" if fill < TRIANGLE_BELOW else "ball"


def velocity(readings: Sequence[Reading], width: int, height: int) -> tuple[float, float] | None:
    """Median (dx, dy) per frame between consecutive readings with an object, each step wrapped onto
    (-size/2, size/2]; None with fewer than two."""
    steps = []
    for a, b in zip(readings, readings[1:]):
        if a.centre is None or b.centre is None:
            continue
        dx, dy = b.centre[0] - a.centre[0], b.centre[1] - a.centre[1]
        steps.append(((dx + width / 2) % width - width / 2, (dy + height / 2) % height - height / 2))
    if not steps:
        return None
    dx, dy = np.median(np.array(steps), axis=0)
    return float(dx), float(dy)


def motion(v: tuple[float, float] | None, threshold: float = 1.5) -> str | None:
    """left | right | up | down | still from a velocity in pixels per frame (y grows downwards)."""
    if v is None:
        return None
    dx, dy = v
    if max(abs(dx), abs(dy)) <= threshold:
        return "still"
    if abs(dx) >= abs(dy):
        return "right" if dx > 0 else "left"
    return "down" if dy > 0 else "up"
