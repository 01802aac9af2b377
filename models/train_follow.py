"""Video-to-video pairs for teacher forcing (models/train.py): a share of each teacher batch (`follow_share`), and the
follow stage's batches (stage 5, a fine-tune from a model file).

A pair is teacher forcing where a noisy chunk's position is not the prompt's. Its object starts anywhere and moves
along a path of models/paths.py's training families (lines at any velocity, zigzags, waves, stops, ramps, random
walks: what the prompt does not say). The target is the prompt's look along that path; the input is the same path
in another colour and background (often another shape, `shape_share`). A noisy chunk starts from the input,
x_t = (1 - sigma) z_input + sigma eps, at a level an input chunk starts at (`pair_sigmas`: the schedule's levels
from `min_step` on, 0.625 and 0.357 for the built-in model's), and its x0 is regressed onto the target; half the
noisy chunks start from the target instead (`pair_starts`: the later steps of an input chunk re-noise the model's
own x0). The caption names the target's colour and shape and no motion (as a restyling prompt does, "a blue ball"):
a motion phrase against the path taught the model to drop motion words. With `switch_share` the prompt switches at
a chunk boundary while the input goes on; the frames' captions and the chunks the loss counts are a cache's after
the switch's recache, as a text clip's (models/train_clips.py `clip_captions`, `chunk_weights`).

Why: in the text scenes nothing is random once the prompts are known, so the context and the prompt fix the
object's position and a model trained on them alone ignores x_t's layout: it follows no input at any strength.
A pair has the same layout as a text clip ([clean | noisy], the chunks of `clip_layout`), so the teacher runs them
in one forward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from models.config import ModelConfig
from models.latent import BlockPCA, video_frames
from models.paths import sample_training_path
from models.scenes import (
    BACKGROUNDS, COLOURS, MOTION_PHRASES, SHAPES, Clip, Scene, chunks_of_frames, draw, sample_clip, sample_scene,
)
from models.stream import GeneratorConfig
from models.train_clips import clip_layout, render_clips


@dataclass(frozen=True)
class PairPlan:
    """One pair before it is drawn (every random choice of it made)."""

    centres: np.ndarray  # [V, 2] the object's centre (x, y) in each video frame of the clip, px (both looks)
    looks: list[Scene]  # the target's looks: the first prompt's, and the new one's after a switch
    which: np.ndarray  # [V] int: the look of each video frame of the target
    source: Scene  # the input's look (one throughout)
    captions: list[str]  # the caption of each latent frame of [clean | noisy] (2F)
    weights: list[float]  # per chunk: whether the loss counts it (the chunks under the last prompt)


@dataclass
class FollowPairs:
    """Pairs rendered and encoded: what a teacher or follow batch takes."""

    target: torch.Tensor  # [N, C, F, h, w] the prompt's look along each path: the clean latents x0 is regressed onto
    source: torch.Tensor  # [N, C, F, h, w] the input: the same path in another look
    captions: list[list[str]]  # per pair, the caption of each frame of [clean | noisy]
    weights: torch.Tensor  # [N, F] float: the noisy frames the loss counts

    def __len__(self) -> int:
        return len(self.captions)

    def take(self, idx: list[int]) -> FollowPairs:
        return FollowPairs(self.target[idx], self.source[idx], [self.captions[i] for i in idx], self.weights[idx])


@dataclass
class FollowPool:
    """The follow stage's data at one chunk size, rendered and encoded once (each step draws its batch from it)."""

    pairs: FollowPairs
    clips: list[Clip]  # text-to-video clips drawn beside the pairs
    clean: torch.Tensor  # [N, C, F, h, w] the clips encoded


def pair_count(batch: int, share: float, taken: int = 0) -> int:
    """Pairs of a teacher batch of `batch` clips of which `taken` start from an image: `share` of it rounded up (so
    that a small batch has one), leaving at least one text clip."""
    return max(0, min(math.ceil(batch * share), batch - taken - 1)) if share > 0 else 0


def plan_pair(rng: np.random.Generator, mc: ModelConfig, gen: GeneratorConfig, frames_per_chunk: int,
              shape_share: float, switch_share: float) -> PairPlan:
    """One pair at a chunk size (module doc): its path, looks, captions and which chunks count."""
    fpc, (sinks, nc) = frames_per_chunk, clip_layout(gen, frames_per_chunk)
    looks = [sample_scene(rng)]
    switch = int(rng.integers(1, nc)) if rng.random() < switch_share else None
    if switch is not None:
        while (new := sample_scene(rng)).triple[:2] == looks[0].triple[:2]:  # another colour or shape
            pass
        looks.append(new)
    target = looks[0]
    colour = str(rng.choice([c for c in COLOURS if c != target.colour]))
    background = str(rng.choice([g for g in BACKGROUNDS if g not in (colour, target.background)]))
    others = [sh for sh in SHAPES if sh != target.shape]
    shape = str(rng.choice(others)) if rng.random() < shape_share else target.shape
    source = Scene(colour, shape, target.size, target.motion, background)
    captions = []
    for look in looks:
        still = Scene(look.colour, look.shape, look.size, "still", look.background)
        caption = still.caption(rng)
        while any(phrase in caption for phrase in MOTION_PHRASES["still"]):  # half the still captions name it
            caption = still.caption(rng)
        captions.append(caption)
    frames = np.asarray(video_frames(list(range(nc * fpc)), mc.temporal_upsample))
    centres = sample_training_path(rng, int(frames.max()) + 1, mc.height, mc.width)[frames]
    which = (chunks_of_frames(frames, fpc) >= switch).astype(int) if switch is not None else np.zeros(len(frames), int)
    # the sinks keep the prompt they were committed under, the rest is the last prompt's (a recache)
    frame_captions = [captions[int(switch is not None and c >= switch)] for c in range(sinks) for _ in range(fpc)]
    frame_captions += [captions[-1]] * (2 * nc * fpc - sinks * fpc)
    weights = [float(switch is None or c >= switch) for c in range(nc)]
    return PairPlan(centres, looks, which, source, frame_captions, weights)


def render_pairs(plans: list[PairPlan], mc: ModelConfig, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """(target, input) frames [N, F, temporal, H, W, 3] uint8 of the planned pairs, drawn in one batch."""
    scenes, which = [], []
    for plan in plans:  # every target's looks, then every input's
        which.append(len(scenes) + plan.which)
        scenes += plan.looks
    for plan in plans:
        which.append(np.full(len(plan.which), len(scenes)))
        scenes.append(plan.source)
    centres = np.concatenate([p.centres for p in plans] * 2)
    out = draw(centres, scenes, mc.height, mc.width, device, np.concatenate(which))
    out = out.view(2, len(plans), -1, mc.temporal_upsample, *out.shape[1:])
    return out[0], out[1]


def sample_pairs(rng: np.random.Generator, pca: BlockPCA, mc: ModelConfig, gen: GeneratorConfig, n: int,
                 frames_per_chunk: int, *, shape_share: float, switch_share: float, device: torch.device | str,
                 slice_size: int = 32) -> FollowPairs:
    """`n` fresh pairs at a chunk size, rendered and encoded `slice_size` pairs at a time (the frames of one slice:
    about 0.2 GB at 128x128 and chunks of 3)."""
    plans = [plan_pair(rng, mc, gen, frames_per_chunk, shape_share, switch_share) for _ in range(n)]
    target, source = [], []
    for i in range(0, n, slice_size):
        t, s = render_pairs(plans[i : i + slice_size], mc, device)
        target.append(pca.encode(t))
        source.append(pca.encode(s))
    weights = torch.tensor([p.weights for p in plans], device=device).repeat_interleave(frames_per_chunk, dim=1)
    return FollowPairs(torch.cat(target), torch.cat(source), [p.captions for p in plans], weights)


def follow_pool(rng: np.random.Generator, pca: BlockPCA, mc: ModelConfig, gen: GeneratorConfig, n: int,
                frames_per_chunk: int, *, shape_share: float, switch_share: float, device: torch.device | str) -> FollowPool:
    """The follow stage's pool: `n` pairs and as many text-to-video clips at a chunk size, encoded (on a CPU,
    rendering and encoding cost a step more than the model's forward and backward)."""
    pairs = sample_pairs(rng, pca, mc, gen, n, frames_per_chunk, shape_share=shape_share, switch_share=switch_share,
                         device=device)
    sinks, chunks = clip_layout(gen, frames_per_chunk)
    clips = [sample_clip(rng, chunks, frames_per_chunk=frames_per_chunk, sinks=sinks, height=mc.height, width=mc.width)
             for _ in range(n)]
    clean = torch.cat([pca.encode(render_clips(clips[i : i + 16], frames_per_chunk, mc.temporal_upsample, device))
                       for i in range(0, n, 16)])
    return FollowPool(pairs, clips, clean)


def follow_levels(timesteps: str, device: torch.device | str) -> torch.Tensor:
    """The noise levels of the schedule `timesteps` ("1000,500,250,100", before the shift), in its order."""
    return torch.tensor(GeneratorConfig(timesteps=tuple(float(t) for t in timesteps.split(","))).sigmas, device=device)


def pair_sigmas(n: int, chunks: int, levels: torch.Tensor, min_step: int) -> torch.Tensor:
    """[n, chunks] a level per noisy chunk of `n` pairs: one an input chunk starts at (`levels[min_step:]`)."""
    return levels[torch.randint(min_step, len(levels), (n, chunks), device=levels.device)].float()


def pair_starts(target: torch.Tensor, source: torch.Tensor, frames_per_chunk: int) -> torch.Tensor:
    """What each pair's noisy chunks are noised from ([N, C, F, h, w]): the input or, for half of them, the target."""
    n, _, nf = target.shape[:3]
    from_input = torch.rand(n, 1, nf // frames_per_chunk, 1, 1, device=target.device) < 0.5
    return torch.where(from_input.repeat_interleave(frames_per_chunk, dim=2), source, target)
