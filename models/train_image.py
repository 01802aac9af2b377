"""Teacher-forcing clips that start from an image (causal image-to-video, models/generator.py `start_from_image`).

A clip's latent frame 0 is a still image of its scene, a block of its own in the teacher's layout (the clean frame
is the context every chunk sees, as the committed image is; its noisy twin counts for nothing), and the scene then
moves as its caption says from there. What the text clips do not teach:
- the object starts anywhere (a text clip's starts centred, models/scenes.py `Timeline.centres`), so the model
  must read where it is off the image, not off the frame index;
- the image's colours need not be the palette's: with `OFF_PALETTE` the object's colour is its palette colour
  moved (still nearest it, so the caption, which names it, stays right and a held-out triple stays unseen), and
  independently the background is any colour far enough from the object's, so that the model keeps the colours
  the image shows rather than snapping to the palette's.
One prompt per clip (its scene's caption, whose background word is the palette's nearest the image's): a switch
after an image start is a text clip's switch with older sinks.

A clip has as many latent frames as the text clips it is batched with (F = chunks x frames_per_chunk): the image,
then chunks from latent frame 1, the last one a frame short (it counts for nothing either).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from models.config import ModelConfig
from models.latent import BlockPCA, video_frames
from models.scenes import BACKGROUNDS, COLOURS, DEFAULT_BACKGROUND, Scene, draw, sample_scene

OFF_PALETTE = 0.5  # share of images whose object colour is moved off the palette; the same for the background, independently
COLOUR_STEP = 90  # an off-palette object colour is its palette colour plus up to this much per channel
MIN_CONTRAST = 120.0  # RGB distance between the object and its background (client/pixels.py takes 80 as the object's)
TRIES = 64  # draws of an off-palette colour before keeping the palette's


@dataclass
class ImageClips:
    """Clips that start from an image, rendered: what the teacher step adds to its batch."""

    frames: torch.Tensor  # [N, F, temporal, H, W, 3] uint8: the video frames each latent frame sums up
    captions: list[list[str]]  # per clip, the caption of each frame of [clean | noisy] (2F, its one prompt)
    weights: torch.Tensor  # [N, F] float: the noisy frames the loss counts (those of the whole chunks)
    scenes: list[Scene]  # what each clip's caption says (its palette look)
    looks: np.ndarray  # [N, 2, 3] uint8: each image's object colour and background colour as drawn
    starts: np.ndarray  # [N, 2] the object's centre (x, y) in the image, px


def image_count(batch: int, share: float) -> int:
    """Clips of a teacher batch of `batch` that start from an image: `share` of it rounded up (so that a small
    batch has one), at most batch - 1 (the text clips stay)."""
    return min(math.ceil(batch * share), batch - 1) if share > 0 else 0


def frame_weights(num_frames: int, frames_per_chunk: int) -> list[float]:
    """Which noisy frames of an image clip of `num_frames` latent frames the loss counts: those of the whole
    chunks after the image (frame 0, the image, and a last chunk cut short count for nothing)."""
    whole = (num_frames - 1) // frames_per_chunk * frames_per_chunk
    return [float(1 <= f <= whole) for f in range(num_frames)]


def sample_image_clips(rng: np.random.Generator, n: int, num_frames: int, frames_per_chunk: int, mc: ModelConfig,
                       device: torch.device | str = "cpu") -> ImageClips:
    """`n` clips of `num_frames` latent frames, each from a random image of a random training scene (module doc)."""
    size = np.array([mc.width, mc.height], dtype=np.float64)
    video = np.asarray(video_frames(range(num_frames), mc.temporal_upsample))  # the video frame of each, in order
    scenes, centres, looks, captions = [], [], [], []
    for _ in range(n):
        scene = sample_scene(rng)
        fg = _object_colour(rng, scene.colour, np.array(BACKGROUNDS[scene.background]))
        bg = _background(rng, fg) if rng.random() < OFF_PALETTE else np.array(BACKGROUNDS[scene.background])
        named = _nearest(BACKGROUNDS, bg)
        if named != scene.background:  # the caption names the palette background nearest the image's
            scene = Scene(scene.colour, scene.shape, scene.size, scene.motion, named if named != scene.colour else DEFAULT_BACKGROUND)
        start = rng.uniform(0, size)
        centres.append(np.mod(start + video[:, None] * np.asarray(scene.velocity), size))
        scenes.append(scene)
        looks.append(np.stack([fg, bg]))
        captions.append([scene.caption(rng)] * (2 * num_frames))
    which = np.repeat(np.arange(n), len(video))
    drawn = draw(np.concatenate(centres), scenes, mc.height, mc.width, device, which)  # palette colours
    palette = torch.as_tensor([COLOURS[s.colour] for s in scenes], device=device, dtype=torch.uint8)
    look = torch.as_tensor(np.stack(looks), device=device, dtype=torch.uint8)  # [N, 2, 3]
    idx = torch.as_tensor(which, device=device)
    is_object = (drawn == palette[idx][:, None, None]).all(-1, keepdim=True)
    frames = torch.where(is_object, look[idx, 0][:, None, None], look[idx, 1][:, None, None])
    weights = torch.tensor([frame_weights(num_frames, frames_per_chunk)] * n, device=device)
    return ImageClips(frames.view(n, num_frames, mc.temporal_upsample, *frames.shape[1:]), captions, weights, scenes,
                      np.stack(looks).astype(np.uint8), np.stack([c[0] for c in centres]))


def with_image_clips(rng: np.random.Generator, pca: BlockPCA, mc: ModelConfig, clean: torch.Tensor, captions: list,
                     weight: torch.Tensor, n: int, frames_per_chunk: int) -> tuple[torch.Tensor, list, torch.Tensor, torch.Tensor | None]:
    """The teacher's batch (clean [B, C, F, h, w] latents, each clip's frame captions, weight [B, F] per noisy
    frame) with `n` image clips after its clips, and each clip's lead frames ([B + n]: 0 for the batch's, 1 for
    the image clips', models/teacher_forcing.py `teacher_layout`); for n = 0 the batch as it is and None."""
    if n == 0:
        return clean, captions, weight, None
    images = sample_image_clips(rng, n, clean.shape[2], frames_per_chunk, mc, clean.device)
    lead = torch.tensor([0] * clean.shape[0] + [1] * n, device=clean.device)
    return (torch.cat([clean, pca.encode(images.frames)]), captions + images.captions,
            torch.cat([weight, images.weights.to(weight.dtype)]), lead)


def _nearest(palette: dict[str, tuple[int, int, int]], rgb: np.ndarray) -> str:
    names = list(palette)
    return names[int(np.linalg.norm(np.array([palette[k] for k in names]) - rgb, axis=1).argmin())]


def _object_colour(rng: np.random.Generator, name: str, background: np.ndarray) -> np.ndarray:
    """The object's colour: its palette colour, or with OFF_PALETTE that colour moved (still nearest it among the
    palette's, and far enough from the scene's palette background)."""
    own = np.array(COLOURS[name])
    if rng.random() < OFF_PALETTE:
        for _ in range(TRIES):
            rgb = np.clip(own + rng.integers(-COLOUR_STEP, COLOUR_STEP + 1, size=3), 0, 255)
            if _nearest(COLOURS, rgb) == name and np.linalg.norm(rgb - background) >= MIN_CONTRAST:
                return rgb
    return own


def _background(rng: np.random.Generator, fg: np.ndarray) -> np.ndarray:
    """Any colour at least MIN_CONTRAST from the object's (the palette's dark gray if none is drawn in TRIES)."""
    for _ in range(TRIES):
        rgb = rng.integers(0, 256, size=3)
        if np.linalg.norm(rgb - fg) >= MIN_CONTRAST:
            return rgb
    return np.array(BACKGROUNDS[DEFAULT_BACKGROUND])
