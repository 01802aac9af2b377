"""Teacher forcing of the causal DiT (training's stages teacher and follow, models/train.py).

One forward over Self-Forcing's layout [clean chunks | noisy chunks]: a clean chunk sees the clean chunks
up to it, a noisy chunk the clean chunks before it and itself, at its clean twin's RoPE positions
(`teacher_layout`, `teacher_forward`). The text is per frame (`frame_text`), so that the sink chunk can keep
an older prompt after a switch, as a recache leaves it. The forward is models/dit.py's own, with a mask
instead of a cache; `sigmas` are the sampler's noise levels the noisy chunks are mostly trained at.
A clip that starts from an image (models/train_image.py) has a lead frame, a block of its own, and its chunks
one frame later (`teacher_layout`'s `lead`; `frame_sigmas` puts the chunks' levels on their frames).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from models.adapters import AdapterUse
from models.dit import CacheAccess, CausalWanModel, TextKV
from models.stream import GeneratorConfig
from models.text import HashTextEncoder


def teacher_layout(num_chunks: int, frames_per_chunk: int, lead: int = 0) -> tuple[list[int], torch.Tensor]:
    """RoPE position of each frame of [clean | noisy] and which frames each sees ([2F, 2F] bool). With `lead` = 1
    (a start image) frame 0 is a block of its own and the chunks start at frame 1, as the generator's blocks do
    after `start_from_image` (F is still num_chunks x frames_per_chunk: the last chunk is a frame short)."""
    if lead not in (0, 1):
        raise ValueError(f"lead must be 0 or 1 (a start image's frame), got {lead}")
    nf = num_chunks * frames_per_chunk
    block = (torch.arange(nf) - lead).div(frames_per_chunk, rounding_mode="floor")
    bq, bk = block[:, None], block[None, :]
    visible = torch.zeros(2 * nf, 2 * nf, dtype=torch.bool)
    visible[:nf, :nf] = bk <= bq  # clean: block-causal
    visible[nf:, :nf] = bk < bq  # noisy: the clean chunks before its own
    visible[nf:, nf:] = bk == bq  # and itself
    return list(range(nf)) * 2, visible


def teacher_forward(model: CausalWanModel, clean: torch.Tensor, noisy: torch.Tensor, t: torch.Tensor, text: TextKV,
                    frames_per_chunk: int, lead: torch.Tensor | None = None, lora: AdapterUse | None = None) -> torch.Tensor:
    """The flow of each noisy chunk given the clean chunks before it.

    clean, noisy: [B, C, F, h, w] (F = chunks * frames_per_chunk); t: [B, F] the noisy frames' timesteps;
    text: per-layer K/V with a row per frame of [clean | noisy] (batch B * 2F). -> v [B, C, F, h, w].
    lead: [B] each clip's lead frames (`teacher_layout`; None: 0); the clips of each layout run as one forward.
    lora: every clip's style (models/adapters.py; None: the base weights), added as serving adds it."""
    values = [0] if lead is None else sorted(set(lead.tolist()))
    if len(values) == 1:
        return _forward(model, clean, noisy, t, text, frames_per_chunk, values[0], lora)
    b = clean.shape[0]
    parts, order = [], []
    for value in values:
        idx = (lead == value).nonzero().flatten().to(clean.device)
        per = text[0][0].shape[0] // b  # text rows per clip: 2F (a prompt per frame) or 1
        rows = (idx[:, None] * per + torch.arange(per, device=idx.device)).flatten()
        part_text = [(k[rows], v[rows]) for k, v in text]
        parts.append(_forward(model, clean[idx], noisy[idx], t[idx], part_text, frames_per_chunk, value, lora))
        order.append(idx)
    return torch.cat(parts)[torch.argsort(torch.cat(order))]


def _forward(model: CausalWanModel, clean: torch.Tensor, noisy: torch.Tensor, t: torch.Tensor, text: TextKV,
             frames_per_chunk: int, lead: int, lora: AdapterUse | None = None) -> torch.Tensor:
    b, nf = clean.shape[0], clean.shape[2]
    positions, visible = teacher_layout(nf // frames_per_chunk, frames_per_chunk, lead)
    access = [CacheAccess(None, 0, visible=visible, positions=positions, lora=lora)] * b
    x = torch.cat([clean, noisy], dim=2)
    t = torch.cat([torch.zeros_like(t), t], dim=1)
    return model.predict_flow(x, t, text, access)[:, :, nf:]


def frame_text(model: CausalWanModel, encoder: HashTextEncoder, captions: Sequence[Sequence[str]],
               lora: AdapterUse | None = None) -> TextKV:
    """Per-layer cross-attention K/V with one row per frame: captions[b][f] is frame f's of clip b (under the
    style `lora`, as a styled stream's prompt is encoded)."""
    unique = sorted({c for clip in captions for c in clip})
    rows = torch.tensor([unique.index(c) for clip in captions for c in clip], device=model.device)
    return [(k[rows], v[rows]) for k, v in model.project_text(encoder.encode(unique), lora)]


def frame_sigmas(sigma: torch.Tensor, frames_per_chunk: int, lead: torch.Tensor | None = None) -> torch.Tensor:
    """[B, chunks] the noise level of each noisy chunk -> [B, F] each frame's. A clip with a lead frame has its
    chunks one frame later: its frame f >= 1 takes chunk (f - 1) // frames_per_chunk's level (its frame 0, a
    block of its own that counts for nothing, the last chunk's)."""
    out = sigma.repeat_interleave(frames_per_chunk, dim=1)
    return out if lead is None else torch.where(lead[:, None].bool(), out.roll(1, dims=1), out)


def sigmas(gen: GeneratorConfig) -> torch.Tensor:
    return torch.tensor(gen.sigmas)


def chunk_sigmas(gen: GeneratorConfig, batch: int, chunks: int, p_sampler_sigma: float, device) -> torch.Tensor:
    """[batch, chunks] a noise level per noisy chunk: with probability `p_sampler_sigma` one of the sampler's
    levels, else uniform warped by the sampler's shift (the levels it visits between them)."""
    levels = sigmas(gen).to(device)
    u = torch.rand(batch, chunks, device=device)
    warped = gen.shift * u / (1 + (gen.shift - 1) * u)
    pick = levels[torch.randint(len(levels), (batch, chunks), device=device)]
    return torch.where(torch.rand(batch, chunks, device=device) < p_sampler_sigma, pick, warped)
