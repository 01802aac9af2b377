"""Teacher forcing of the causal DiT (training's stages teacher and follow, models/train.py).

One forward over Self-Forcing's layout [clean chunks | noisy chunks]: a clean chunk sees the clean chunks
up to it, a noisy chunk the clean chunks before it and itself, at its clean twin's RoPE positions
(`teacher_layout`, `teacher_forward`). The text is per frame (`frame_text`), so that the sink chunk can keep
an older prompt after a switch, as a recache leaves it. The forward is models/dit.py's own, with a mask
instead of a cache; `sigmas` are the sampler's noise levels the noisy chunks are mostly trained at.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from models.dit import CacheAccess, CausalWanModel, TextKV
from models.stream import GeneratorConfig
from models.text import HashTextEncoder


def teacher_layout(num_chunks: int, frames_per_chunk: int) -> tuple[list[int], torch.Tensor]:
    """RoPE position of each frame of [clean | noisy] and which frames each sees ([2F, 2F] bool)."""
    nf = num_chunks * frames_per_chunk
    block = torch.arange(nf) // frames_per_chunk
    bq, bk = block[:, None], block[None, :]
    visible = torch.zeros(2 * nf, 2 * nf, dtype=torch.bool)
    visible[:nf, :nf] = bk <= bq  # clean: block-causal
    visible[nf:, :nf] = bk < bq  # noisy: the clean chunks before its own
    visible[nf:, nf:] = bk == bq  # and itself
    return list(range(nf)) * 2, visible


def teacher_forward(model: CausalWanModel, clean: torch.Tensor, noisy: torch.Tensor, t: torch.Tensor, text: TextKV, frames_per_chunk: int) -> torch.Tensor:
    """The flow of each noisy chunk given the clean chunks before it.

    clean, noisy: [B, C, F, h, w] (F = chunks * frames_per_chunk); t: [B, F] the noisy frames' timesteps;
    text: per-layer K/V with a row per frame of [clean | noisy] (batch B * 2F). -> v [B, C, F, h, w]."""
    b, nf = clean.shape[0], clean.shape[2]
    positions, visible = teacher_layout(nf // frames_per_chunk, frames_per_chunk)
    access = [CacheAccess(None, 0, visible=visible, positions=positions)] * b
    x = torch.cat([clean, noisy], dim=2)
    t = torch.cat([torch.zeros_like(t), t], dim=1)
    return model.predict_flow(x, t, text, access)[:, :, nf:]


def frame_text(model: CausalWanModel, encoder: HashTextEncoder, captions: Sequence[Sequence[str]]) -> TextKV:
    """Per-layer cross-attention K/V with one row per frame: captions[b][f] is frame f's of clip b."""
    unique = sorted({c for clip in captions for c in clip})
    rows = torch.tensor([unique.index(c) for clip in captions for c in clip], device=model.device)
    return [(k[rows], v[rows]) for k, v in model.project_text(encoder.encode(unique))]


def sigmas(gen: GeneratorConfig) -> torch.Tensor:
    return torch.tensor(gen.sigmas)
