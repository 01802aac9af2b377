"""What training makes of the rendered scenes' clips (models/scenes.py): their chunks at a chunk size, as a cache
holds them (`clip_layout`, `parse_chunk_sizes`), their video frames in one batch (`render_clips`), the caption of
each frame of [clean | noisy] (`clip_captions`), which noisy chunks the loss counts (`chunk_weights`), and where a
frame's object is (`object_centres`, `roll_frames`: the rollout moves its target to continue from the model's own
object).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from models.latent import video_frames
from models.scenes import Clip, draw, sample_clip
from models.stream import GeneratorConfig


def parse_chunk_sizes(text: str, gen: GeneratorConfig) -> tuple[int, ...]:
    """"3,1" -> (3, 1): the chunk sizes (latent frames) trained, in their turn; each must divide the cache's sink
    and window frames, so that a cache holds whole chunks."""
    try:
        sizes = tuple(int(n) for n in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or any(n < 1 or gen.sink_frames % n or gen.window_frames % n for n in sizes):
        raise ValueError(f"chunk sizes {text!r}: use sizes that divide the cache's {gen.sink_frames} sink and "
                         f"{gen.window_frames} window frames, comma-separated (3,1)")
    return sizes


def clip_layout(gen: GeneratorConfig, frames_per_chunk: int) -> tuple[int, int]:
    """(sink chunks, chunks) of a training clip at a chunk size: what `gen`'s cache holds, its sink frames and its
    window frames in chunks of that size, then the chunk being made. Sink 3 + window 9: (1, 5) at 3, (3, 13) at 1."""
    sinks = gen.sink_frames // frames_per_chunk
    return sinks, sinks + gen.window_frames // frames_per_chunk + 1


def text_clips(rng: np.random.Generator, n: int, gen: GeneratorConfig, mc, frames_per_chunk: int) -> list[Clip]:
    """`n` random training clips (models/scenes.py `sample_clip`) at a chunk size, laid out as `clip_layout` says,
    at the model's (`mc`, a ModelConfig) video size."""
    sinks, chunks = clip_layout(gen, frames_per_chunk)
    return [sample_clip(rng, chunks, frames_per_chunk=frames_per_chunk, sinks=sinks, height=mc.height, width=mc.width)
            for _ in range(n)]


def clip_latent_frames(clip: Clip, frames_per_chunk: int) -> list[int]:
    return [c * frames_per_chunk + i for c in clip.chunks for i in range(frames_per_chunk)]


def render_clips(clips: Sequence[Clip], frames_per_chunk: int, temporal: int, device) -> torch.Tensor:
    """[B, F, temporal, H, W, 3] uint8: the video frames each latent frame of each clip sums up, drawn
    in one batch (a clip at a time costs a GPU step more in launches and copies than its training). The
    clips' timelines must be in chunks of `frames_per_chunk`, as their prompt switches are."""
    centres, scenes, which = [], [], []
    for clip in clips:
        if clip.frames_per_chunk != frames_per_chunk:
            raise ValueError(f"a clip of chunks of {clip.frames_per_chunk} latent frames rendered at {frames_per_chunk}")
        tl = clip.timeline
        frames = video_frames(clip_latent_frames(clip, frames_per_chunk), temporal)
        centres.append(tl.centres(frames))
        which.append(len(scenes) + tl.segments_of_frames(frames))
        scenes += tl.scenes
    tl = clips[0].timeline
    out = draw(np.concatenate(centres), scenes, tl.height, tl.width, device, np.concatenate(which))
    return out.view(len(clips), -1, temporal, *out.shape[1:])


def clip_captions(clip: Clip, frames_per_chunk: int) -> list[str]:
    """The caption of each frame of [clean | noisy]: each clean sink chunk's own prompt, the one it was
    committed under (a recache leaves the sinks' K/V), the clip's last prompt everywhere else (a recache
    redoes the window)."""
    tl, sinks = clip.timeline, clip.chunks[: clip.sinks]
    last = tl.caption_at(clip.chunks[-1])
    nf = len(clip.chunks) * frames_per_chunk
    return [tl.caption_at(c) for c in sinks for _ in range(frames_per_chunk)] + [last] * (2 * nf - len(sinks) * frames_per_chunk)


def chunk_weights(clip: Clip) -> list[float]:
    """Which noisy chunks the loss counts: those generated under the clip's last prompt whose context is
    what a real stream's cache would hold (the chunk right before them, or none at the stream's start)."""
    tl, chunks = clip.timeline, clip.chunks
    last = tl.segment_at(chunks[-1])
    return [
        float(tl.segment_at(c) == last and (c == 0 or (i > 0 and chunks[i - 1] == c - 1)))
        for i, c in enumerate(chunks)
    ]


def object_centres(frames: torch.Tensor, threshold: float = 80 / 127.5, min_pixels: int = 20) -> torch.Tensor:
    """frames [B, H, W, 3] in [-1, 1] -> [B, 2] (x, y) of each frame's object in pixels, wrap-aware (the
    circular mean of the pixels farther than `threshold` from the border's median colour), NaN where fewer
    than `min_pixels` are (client/pixels.py reads frames the same way, on the CPU, for the viewers)."""
    b, h, w, _ = frames.shape
    border = torch.cat([frames[:, 0], frames[:, -1], frames[:, :, 0], frames[:, :, -1]], dim=1)  # [B, 2(H+W), 3]
    background = border.median(dim=1).values[:, None, None]
    mask = ((frames - background).norm(dim=-1) > threshold).float()  # [B, H, W]

    def circular(weights: torch.Tensor, size: int) -> torch.Tensor:  # [B, size] -> [B]
        angle = 2 * math.pi * (torch.arange(size, device=weights.device) + 0.5) / size
        mean = torch.atan2((weights * angle.sin()).sum(1), (weights * angle.cos()).sum(1))
        return torch.remainder(mean, 2 * math.pi) * size / (2 * math.pi)

    centres = torch.stack([circular(mask.sum(1), w), circular(mask.sum(2), h)], dim=1)
    return torch.where(mask.sum((1, 2))[:, None] >= min_pixels, centres, torch.full_like(centres, math.nan))


def roll_frames(frames: torch.Tensor, shifts: torch.Tensor) -> torch.Tensor:
    """frames [B, ..., H, W, 3] with sample i moved by shifts[i] = (dx, dy) pixels (rounded) on the torus;
    a NaN shift leaves its sample as it is."""
    out = frames.clone()
    for i, (dx, dy) in enumerate(shifts.tolist()):
        if not math.isnan(dx):
            out[i] = torch.roll(frames[i], (round(dy), round(dx)), dims=(-3, -2))
    return out
