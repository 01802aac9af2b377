"""Procedural scenes for the built-in model: one object of a colour and shape moving on a background,
captioned from templates. Drawn while training runs, deterministic from a seed; nothing is stored.

The motion follows from the prompt and the history alone: the object starts centred and moves at a
constant velocity, wrapping around the edges; at a prompt switch (always at a chunk boundary) it keeps
its position and takes the new attributes from the next chunk on. A model trained by regression on
these clips can therefore render sharp frames: nothing in them is random once the prompts are known.

Frames are numbered as a stream's video frames; video frame n belongs to latent frame 0 when n == 0,
else to latent frame (n + 3) // 4 (Wan's 4x temporal convention), and latent frame k to chunk
k // frames_per_chunk: a timeline's chunks are of its `frames_per_chunk` latent frames (3, or 1 for
low-latency streams), and its prompt switches land on their boundaries.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

# Object colours and backgrounds, RGB. client/pixels.py keeps its own copy (a test checks they agree).
COLOURS: dict[str, tuple[int, int, int]] = {
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
DEFAULT_BACKGROUND = "dark gray"  # what a caption that names no background gets
SHAPES = ("ball", "square", "triangle")
SIZES = {"small": 9.0, "big": 16.0}  # half the object's extent in pixels (a big square is 32 px wide)
DEFAULT_SIZE = "big"
SPEED = 3.0  # pixels per video frame
MOTIONS: dict[str, tuple[float, float]] = {  # velocity (dx, dy) in units of SPEED; y grows downwards
    "left": (-1.0, 0.0),
    "right": (1.0, 0.0),
    "up": (0.0, -1.0),
    "down": (0.0, 1.0),
    "still": (0.0, 0.0),
}

# Caption words: synonyms for each attribute value. A caption names the colour and the shape always,
# the size, the motion and the background sometimes (unnamed: big, still, dark gray).
SHAPE_WORDS = {"ball": ("ball", "circle"), "square": ("square", "box"), "triangle": ("triangle",)}
SIZE_WORDS = {"small": ("small", "little", "tiny"), "big": ("big", "large")}
MOTION_PHRASES = {
    "left": ("moving left", "going left", "heading to the left", "drifting left"),
    "right": ("moving right", "going right", "heading to the right", "drifting right"),
    "up": ("rising", "moving up", "going up", "floating upwards"),
    "down": ("falling", "moving down", "going down", "dropping"),
    "still": ("standing still", "not moving", "staying still", "resting"),
}
BACKGROUND_PHRASES = ("on a {} background", "on {}", "against a {} background", "in front of a {} wall")
FILLERS = ("", "", "a video of", "look,", "show me", "please show", "here is", "watch")
ARTICLES = ("a", "the", "one")

# colour x shape x motion triples never drawn for training (every pair of them is still seen): the
# compositional test. One per colour, each shape and each motion at least once.
HELD_OUT: frozenset[tuple[str, str, str]] = frozenset(
    {
        ("red", "triangle", "up"),
        ("green", "ball", "left"),
        ("blue", "square", "still"),
        ("yellow", "ball", "down"),
        ("orange", "triangle", "right"),
        ("purple", "square", "left"),
        ("white", "ball", "right"),
    }
)


@dataclass(frozen=True)
class Scene:
    """What one prompt asks for."""

    colour: str  # a key of COLOURS
    shape: str  # one of SHAPES
    size: str = DEFAULT_SIZE  # a key of SIZES
    motion: str = "still"  # a key of MOTIONS
    background: str = DEFAULT_BACKGROUND  # a key of BACKGROUNDS, never the object's colour

    def __post_init__(self) -> None:
        for value, allowed in (
            (self.colour, COLOURS),
            (self.shape, SHAPES),
            (self.size, SIZES),
            (self.motion, MOTIONS),
            (self.background, BACKGROUNDS),
        ):
            if value not in allowed:
                raise ValueError(f"{value!r} is not one of {', '.join(allowed)}")
        if self.background == self.colour:
            raise ValueError(f"a {self.colour} object on a {self.background} background would be invisible")

    @property
    def triple(self) -> tuple[str, str, str]:
        return self.colour, self.shape, self.motion

    @property
    def velocity(self) -> tuple[float, float]:
        dx, dy = MOTIONS[self.motion]
        return dx * SPEED, dy * SPEED

    def caption(self, rng: np.random.Generator) -> str:
        """A caption from the templates: synonyms, the parts in shuffled order, a few filler words.
        The defaults (big, still, dark gray) are named only sometimes; other values always."""
        adjectives = [self.colour]
        if self.size != DEFAULT_SIZE or rng.random() < 0.3:
            adjectives.append(_pick(rng, SIZE_WORDS[self.size]))
        rng.shuffle(adjectives)
        noun = " ".join([_pick(rng, ARTICLES), *adjectives, _pick(rng, SHAPE_WORDS[self.shape])])
        extras = []
        if self.motion != "still" or rng.random() < 0.5:
            extras.append(_pick(rng, MOTION_PHRASES[self.motion]))
        if self.background != DEFAULT_BACKGROUND:
            extras.append(_pick(rng, BACKGROUND_PHRASES).format(self.background))
        rng.shuffle(extras)
        parts = [noun, *extras] if rng.random() < 0.75 else [*extras, noun]
        return " ".join(p for p in (_pick(rng, FILLERS), *parts) if p)


def _pick(rng: np.random.Generator, options: Sequence[str]) -> str:
    return options[int(rng.integers(len(options)))]


def vocabulary() -> list[str]:
    """Every word a caption can use, sorted (the text-encoder vectors the built-in model was trained on)."""
    phrases = [
        *COLOURS,
        *BACKGROUNDS,
        *(w for ws in SHAPE_WORDS.values() for w in ws),
        *(w for ws in SIZE_WORDS.values() for w in ws),
        *(p for ps in MOTION_PHRASES.values() for p in ps),
        *(p.format("") for p in BACKGROUND_PHRASES),
        *FILLERS,
        *ARTICLES,
    ]
    return sorted({w.strip(",") for p in phrases for w in p.split()} | {","})


TRAIN_TRIPLES: tuple[tuple[str, str, str], ...] = tuple(
    sorted((c, s, m) for c in COLOURS for s in SHAPES for m in MOTIONS if (c, s, m) not in HELD_OUT)
)


def sample_scene(rng: np.random.Generator, held_out: bool = False) -> Scene:
    """A random scene whose colour x shape x motion is a training triple (`held_out`: a HELD_OUT one)."""
    triples = sorted(HELD_OUT) if held_out else TRAIN_TRIPLES
    colour, shape, motion = triples[int(rng.integers(len(triples)))]
    # half the scenes on the default background, as most prompts name none
    background = DEFAULT_BACKGROUND if rng.random() < 0.5 else _pick(rng, [b for b in BACKGROUNDS if b != colour])
    size = DEFAULT_SIZE if rng.random() < 0.6 else _pick(rng, list(SIZES))
    return Scene(colour, shape, size, motion, background)


def chunks_of_frames(frames: np.ndarray, frames_per_chunk: int = 3) -> np.ndarray:
    """The chunk (of `frames_per_chunk` latent frames) each of video frames `frames` (an int array) belongs to."""
    return np.where(frames == 0, 0, (frames + 3) // 4) // frames_per_chunk


@dataclass(frozen=True)
class Timeline:
    """A stream's prompts: `segments` are (first chunk, scene, caption), the first at chunk 0, in order; its
    chunks are of `frames_per_chunk` latent frames."""

    segments: tuple[tuple[int, Scene, str], ...]
    height: int = 128
    width: int = 128
    frames_per_chunk: int = 3

    def __post_init__(self) -> None:
        starts = [s for s, _, _ in self.segments]
        if not starts or starts[0] != 0 or starts != sorted(set(starts)):
            raise ValueError(f"segments must start at chunk 0 and be strictly increasing, got starts {starts}")

    @property
    def scenes(self) -> list[Scene]:
        return [scene for _, scene, _ in self.segments]

    def segment_at(self, chunk: int) -> int:
        """Index of the segment that chunk `chunk` is generated under."""
        return int(self.segments_of(np.asarray([chunk]))[0])

    def segments_of(self, chunks: np.ndarray) -> np.ndarray:
        """`segment_at` of each of `chunks` (an int array), at once."""
        return np.searchsorted([start for start, _, _ in self.segments], chunks, side="right") - 1

    def segments_of_frames(self, frames: Sequence[int] | np.ndarray) -> np.ndarray:
        """The segment each of video frames `frames` is generated under, at once."""
        return self.segments_of(chunks_of_frames(np.asarray(frames), self.frames_per_chunk))

    def scene_at(self, chunk: int) -> Scene:
        return self.segments[self.segment_at(chunk)][1]

    def caption_at(self, chunk: int) -> str:
        return self.segments[self.segment_at(chunk)][2]

    def centres(self, frames: Sequence[int]) -> np.ndarray:
        """[N, 2] (x, y) centre of the object in each video frame: it starts at the frame's centre, and
        frame n > 0 moves it by the velocity of the scene of n's chunk; wrapped onto the frame."""
        n = np.arange(max(frames, default=0) + 1)
        velocity = np.array([scene.velocity for scene in self.scenes])  # [segments, 2]
        step = np.where((n > 0)[:, None], velocity[self.segments_of_frames(n)], 0.0)
        pos = np.cumsum(step, axis=0) + (self.width / 2, self.height / 2)
        return np.mod(pos[list(frames)], (self.width, self.height))

    def render(self, frames: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
        """Video frames `frames` of this stream: [N, H, W, 3] uint8, drawn on `device`."""
        return draw(self.centres(frames), self.scenes, self.height, self.width, device, self.segments_of_frames(frames))


def draw(
    centres: np.ndarray, scenes: Sequence[Scene], height: int, width: int, device, which: np.ndarray | None = None
) -> torch.Tensor:
    """[N, H, W, 3] uint8: frame i's scene (scenes[which[i]], or scenes[i] without `which`) with its object
    centred at centres[i] (x, y) on its background, on a torus (an object across an edge shows on the other
    side too). Pixel (row r, column c) samples (c+0.5, r+0.5)."""
    n = len(centres)
    which = torch.as_tensor(np.arange(n) if which is None else which, device=device)
    as_t = lambda v: torch.as_tensor(np.asarray(v, dtype=np.float32), device=device)  # noqa: E731
    cx, cy = as_t(centres[:, 0]).view(n, 1, 1), as_t(centres[:, 1]).view(n, 1, 1)
    r = as_t([SIZES[s.size] for s in scenes])[which].view(n, 1, 1)
    shape = torch.as_tensor([SHAPES.index(s.shape) for s in scenes], device=device)[which]
    xs = torch.arange(width, device=device, dtype=torch.float32).view(1, 1, width) + 0.5
    ys = torch.arange(height, device=device, dtype=torch.float32).view(1, height, 1) + 0.5
    dx = torch.remainder(xs - cx + width / 2, width) - width / 2  # [N, 1, W] toroidal offsets
    dy = torch.remainder(ys - cy + height / 2, height) - height / 2  # [N, H, 1]
    inside = torch.stack(
        [
            dx**2 + dy**2 <= r**2,  # ball
            (dx.abs() <= r) & (dy.abs() <= r),  # square
            (dy.abs() <= r) & (2 * dx.abs() <= dy + r),  # triangle, apex up, half its box
        ]
    )  # [3, N, H, W]
    mask = inside[shape, torch.arange(n, device=device)]  # [N, H, W]: each frame's own shape
    fg = torch.as_tensor([COLOURS[s.colour] for s in scenes], device=device, dtype=torch.uint8)[which].view(n, 1, 1, 3)
    bg = torch.as_tensor([BACKGROUNDS[s.background] for s in scenes], device=device, dtype=torch.uint8)[which].view(n, 1, 1, 3)
    return torch.where(mask[..., None], fg, bg)


@dataclass(frozen=True)
class Clip:
    """A training clip: some chunks of a rendered stream, as the model's cache would hold them."""

    timeline: Timeline
    # the stream's chunks in the clip (of the timeline's frames_per_chunk latent frames): the sink chunks
    # 0 .. sinks - 1, then consecutive ones
    chunks: tuple[int, ...]
    sinks: int = 1  # chunks that hold the cache's sink frames (3 latent frames: one chunk of 3, three of 1)

    @property
    def frames_per_chunk(self) -> int:
        return self.timeline.frames_per_chunk

    @property
    def long(self) -> bool:
        """Whether the sinks are old: the clip's later chunks come long after the sink chunks."""
        return len(self.chunks) > self.sinks and self.chunks[self.sinks] != self.sinks


def sample_clip(
    rng: np.random.Generator,
    num_chunks: int = 5,
    *,
    frames_per_chunk: int = 3,
    sinks: int = 1,
    p_switch: float = 0.5,
    p_long: float = 0.3,
    max_chunk: int | None = None,
    height: int = 128,
    width: int = 128,
) -> Clip:
    """A clip of `num_chunks` chunks of `frames_per_chunk` latent frames: the stream's first `sinks` chunks,
    then consecutive chunks (with `p_long`, from far into the stream, up to chunk `max_chunk`, by default
    180 latent frames in (45 s of video): old sinks, as in a long stream). With `p_switch` the prompt
    switches at one of the clip's chunk boundaries; a long clip's sinks may also come from an earlier prompt."""
    max_chunk = max_chunk or 180 // frames_per_chunk
    long = rng.random() < p_long and num_chunks > sinks
    first = int(rng.integers(num_chunks, max_chunk)) if long else sinks
    chunks = (*range(min(sinks, num_chunks)), *range(first, first + num_chunks - sinks))
    scene = sample_scene(rng)
    segments = [(0, scene, scene.caption(rng))]
    starts = []
    if long and rng.random() < p_switch:  # a prompt switch long before the clip's window
        starts.append(int(rng.integers(1, first)))
    if num_chunks > 1 and rng.random() < p_switch:  # in a long clip, after its sinks (the earlier switch's place)
        starts.append(chunks[int(rng.integers(sinks if long else 1, num_chunks))])
    for start in starts:
        scene = _switch(rng, scene)
        segments.append((start, scene, scene.caption(rng)))
    return Clip(Timeline(tuple(segments), height, width, frames_per_chunk), chunks, sinks)


def _switch(rng: np.random.Generator, old: Scene) -> Scene:
    """A new scene for a prompt switch: often only one or two attributes change, as a viewer steers."""
    new = sample_scene(rng)
    if rng.random() < 0.5:  # keep some of the old attributes
        keep = {k: getattr(old, k) for k in ("shape", "size", "motion", "background") if rng.random() < 0.5}
        if keep.get("background") == new.colour:
            del keep["background"]
        candidate = replace(new, **keep)
        if candidate.triple not in HELD_OUT:
            new = candidate
    return new if new != old else _switch(rng, old)
