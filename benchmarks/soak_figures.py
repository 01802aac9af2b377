"""The soak test's figures (benchmarks/soak.py), pure: no asyncio, no I/O; times in seconds from the run's start.

- What a frame shows: `frame_stats` (mean brightness, saturation, sharpness as the variance of the Laplacian),
  `frame_change` (mean absolute change of grey level from the frame before), and for the built-in model whether a
  chunk's frames match the prompt's colour, shape and motion (`score_chunk`, read by client/pixels.py).
- Series of (t, value) samples and what they show over the run: `window_mean`, `drift` (the mean of the run's last
  15 % less that of its first 15 %, as HeliosBench's delta-M), `growth` (the end against a point in the run, with the
  range after it).
- The server's cumulative latency histogram (scraped every minute): `histogram_quantile` (Prometheus's linear
  interpolation within a bucket) on the buckets' change between two scrapes (`bucket_delta`).
- `windows`: the run's points of comparison, minute 5 for growth and minutes 5-15 against the last 10 for latency,
  scaled to the run's length when it is shorter than an hour.
"""

from __future__ import annotations

import math
import re
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from client import pixels

Sample = tuple[float, float]  # (seconds from the run's start, value)
Triple = tuple[str, str, str]  # (colour, shape, motion) as client/pixels.py names them

# the load test's captions (client/loadtest_prompts.py: "a {colour} {shape} {motion}") -> client/pixels.py's motions
CAPTION_MOTIONS = {"moving right": "right", "moving left": "left", "rising": "up", "falling": "down",
                   "standing still": "still"}
_CAPTION = re.compile(r"a (\w+) (ball|square|triangle) (" + "|".join(CAPTION_MOTIONS) + r")")
GREY = np.array([0.299, 0.587, 0.114], np.float32)  # BT.601 luma weights
DRIFT_SHARE = 0.15  # drift: the run's first and last 15 %


def caption_triple(prompt: str) -> Triple | None:
    """The (colour, shape, motion) a load-test caption asks for; None for any other prompt (it is not scored)."""
    m = _CAPTION.fullmatch(prompt.strip())
    if m is None or m.group(1) not in pixels.PALETTE:
        return None
    return m.group(1), m.group(2), CAPTION_MOTIONS[m.group(3)]


# ---------------------------------------------------------------- frames


@dataclass(frozen=True)
class FrameStats:
    """What any model's frame shows, whatever it draws."""

    brightness: float  # mean luma, 0..255
    saturation: float  # mean HSV saturation, (max - min) / max of each pixel's RGB, 0..1
    sharpness: float  # variance of the 4-neighbour Laplacian of the luma (blur lowers it)


def grey(frame: np.ndarray) -> np.ndarray:
    """[H, W, 3] uint8 -> [H, W] float32 luma."""
    return frame.astype(np.float32) @ GREY


def frame_stats(frame: np.ndarray) -> FrameStats:
    """The statistics of one RGB frame [H, W, 3] uint8 (at least 3x3)."""
    f = frame.astype(np.float32)
    y = f @ GREY
    hi, lo = f.max(-1), f.min(-1)
    saturation = np.divide(hi - lo, hi, out=np.zeros_like(hi), where=hi > 0)
    laplacian = y[:-2, 1:-1] + y[2:, 1:-1] + y[1:-1, :-2] + y[1:-1, 2:] - 4 * y[1:-1, 1:-1]
    return FrameStats(float(y.mean()), float(saturation.mean()), float(laplacian.var()))


def frame_change(before: np.ndarray, after: np.ndarray) -> float:
    """Mean absolute change of luma from one frame to the next, 0..255."""
    return float(np.abs(grey(after) - grey(before)).mean())


@dataclass(frozen=True)
class ChunkScore:
    """How many of a chunk's frames show what the prompt asks for."""

    frames: int
    colour: int  # frames of the prompt's colour
    shape: int  # frames of its shape
    motion: int  # frames of a chunk whose motion (the median step of its frames) is the prompt's: all or none
    all: int  # frames right in all three


def score_chunk(frames: Sequence[np.ndarray], want: Triple) -> ChunkScore:
    """Read each frame of a chunk (client/pixels.py) and count those matching `want`."""
    readings = [pixels.read_frame(f) for f in frames]
    h, w = frames[0].shape[:2]
    moved = pixels.motion(pixels.velocity(readings, w, h)) == want[2]
    colour = [r.colour == want[0] for r in readings]
    shape = [r.shape == want[1] for r in readings]
    return ChunkScore(len(frames), sum(colour), sum(shape), len(frames) * moved,
                      sum(c and s and moved for c, s in zip(colour, shape)))


# ---------------------------------------------------------------- series


def window_mean(samples: Sequence[Sample], t0: float, t1: float) -> float | None:
    """The mean value of the samples with t0 <= t < t1; None when there are none."""
    values = [v for t, v in samples if t0 <= t < t1]
    return sum(values) / len(values) if values else None


def drift(samples: Sequence[Sample], run_s: float, share: float = DRIFT_SHARE) -> dict:
    """The change from the run's first `share` to its last (HeliosBench's delta-M): the mean of each window, their
    difference (`delta`, last - first) and that relative to the first (`relative`; None when the first is 0)."""
    first = window_mean(samples, 0.0, share * run_s)
    last = window_mean(samples, (1 - share) * run_s, math.inf)
    delta = None if first is None or last is None else last - first
    return {"first": first, "last": last, "delta": delta,
            "relative": None if delta is None or first == 0 else delta / abs(first),
            "samples": (sum(1 for t, _ in samples if t < share * run_s),
                        sum(1 for t, _ in samples if t >= (1 - share) * run_s))}


def mix_adjusted_drift(chunks: Sequence[tuple[float, Hashable, float, int]], run_s: float,
                       share: float = DRIFT_SHARE) -> dict:
    """`drift` with the prompts' mix taken out: chunks (t, the prompt asked for, the sum of their frames' values,
    frames) each count as their mean less their prompt's over the whole run, weighted by frames; `relative` is the
    delta against the run's mean. For a pixel score (a value 1 per frame right): the built-in model draws some triples
    far better than others (a ball before a triangle), so a window that happened to ask for more triangles would read
    as drift; for a frame statistic, a dark prompt's frames are darker. This compares each prompt with itself."""
    total: dict[Hashable, float] = {}
    frames: dict[Hashable, int] = {}
    for _, want, v, n in chunks:
        total[want] = total.get(want, 0.0) + v
        frames[want] = frames.get(want, 0) + n

    def mean(t0: float, t1: float) -> tuple[float | None, int]:
        inside = [(want, v, n) for t, want, v, n in chunks if t0 <= t < t1 and n > 0]
        count = sum(n for _, _, n in inside)
        if not count:
            return None, 0
        return sum(v - n * total[want] / frames[want] for want, v, n in inside) / count, count

    (first, n0), (last, n1) = mean(0.0, share * run_s), mean((1 - share) * run_s, math.inf)
    delta = None if first is None or last is None else last - first
    overall = sum(total.values()) / max(1, sum(frames.values()))
    return {"first": first, "last": last, "delta": delta,
            "relative": None if delta is None or overall == 0 else delta / abs(overall), "samples": (n0, n1)}


def at_or_after(samples: Sequence[Sample], t: float) -> Sample | None:
    """The first sample at or after `t` (else the last one; None for none)."""
    for s in samples:
        if s[0] >= t:
            return s
    return samples[-1] if samples else None


def at_or_before(samples: Sequence[Sample], t: float) -> Sample | None:
    """The last sample at or before `t` (else the first one; None for none)."""
    for s in reversed(samples):
        if s[0] <= t:
            return s
    return samples[0] if samples else None


def growth(samples: Sequence[Sample], from_s: float) -> dict | None:
    """The series' end against its value at `from_s` (the first sample from then on): `start`, `end`, `change`
    (end - start), `relative` (change / start; None when start is 0), and `min` / `max` from `from_s` on (flat: the
    two equal). None for an empty series."""
    start = at_or_after(samples, from_s)
    if start is None:
        return None
    after = [v for t, v in samples if t >= start[0]]
    end = samples[-1][1]
    return {"from_s": start[0], "start": start[1], "end": end, "change": end - start[1],
            "relative": (end - start[1]) / start[1] if start[1] else None, "min": min(after), "max": max(after)}


# ---------------------------------------------------------------- latency histogram


def bucket_delta(before: Mapping[float, float], after: Mapping[float, float]) -> list[tuple[float, float]]:
    """The cumulative buckets {le: count} (le = inf included) of what was observed between two scrapes, sorted."""
    return sorted((le, after[le] - before.get(le, 0.0)) for le in after)


def histogram_quantile(buckets: Sequence[tuple[float, float]], q: float) -> float | None:
    """The q-quantile (0..1) of sorted cumulative buckets [(le, count)], as Prometheus' histogram_quantile: linear
    within the bucket it falls in (from 0 for the first); in the +Inf bucket, the largest finite bound. None for no
    observations."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for le, count in buckets:
        if count >= rank and count > below:
            if math.isinf(le):
                return lower
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    return lower


def window_quantile(scrapes: Sequence[tuple[float, Mapping[float, float]]], t0: float, t1: float,
                    q: float) -> float | None:
    """The q-quantile of what was observed from `t0` to `t1`, from cumulative buckets scraped at times: between the
    last scrape at or before t0 and the first at or after t1 (a window narrower than the scrapes widens to them);
    None without two scrapes around it or with no observations."""
    a, b = at_or_before(scrapes, t0), at_or_after(scrapes, t1)
    if a is None or b is None or b[0] <= a[0]:
        return None
    return histogram_quantile(bucket_delta(a[1], b[1]), q)


def highest_bucket(buckets: Sequence[tuple[float, float]]) -> float | None:
    """The upper bound of the highest bucket that gained observations (a bound on the window's slowest); None: none."""
    below = 0.0
    top = None
    for le, count in buckets:
        if count > below:
            top = le
        below = count
    return top


# ---------------------------------------------------------------- the run's windows


@dataclass(frozen=True)
class Windows:
    """Where the run's figures compare, in seconds from its start: an hour's points, scaled to a shorter run."""

    growth_from_s: float  # RSS, fds, threads and tables: the end against here (an hour: minute 5)
    early: tuple[float, float]  # latency's baseline (an hour: minutes 5-15)
    late: tuple[float, float]  # against its end (an hour: the last 10 minutes)
    scale: float  # the run's length over an hour, at most 1


def windows(run_s: float, minute_s: float = 60.0) -> Windows:
    """The windows of a run of `run_s` seconds whose minutes are `minute_s` long (a test shortens them)."""
    scale = min(1.0, run_s / (60 * minute_s))
    m = scale * minute_s
    return Windows(5 * m, (5 * m, 15 * m), (run_s - 10 * m, run_s), scale)
