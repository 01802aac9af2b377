"""Streaming latent decoders: a latent chunk plus carried state in, uint8 RGB frames out.

Wan's convention: 8x spatial, 4x temporal, and a stream's first latent frame gives one
video frame, so the first chunk of 3 latent frames gives 1 + 4 + 4 = 9 frames, later ones 12.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from models.config import ModelConfig


@dataclass
class DecoderState:
    """What a streaming decoder carries from one chunk to the next (one stream)."""

    memory: torch.Tensor | None = None  # features of the previous latent frame: [ch, h, w]
    frames_out: int = 0  # video frames produced so far


class StreamingDecoder(Protocol):
    def init_state(self) -> DecoderState: ...

    def state_bytes(self, height: int, width: int) -> int:
        """Device memory one stream's state holds at this video size (admission counts it)."""
        ...

    def decode(self, latents: torch.Tensor, state: DecoderState) -> torch.Tensor:
        """latents [C, F, h, w] -> frames [N, H, W, 3] uint8 (on the decoder's device); updates state."""
        ...


class TinyStreamingDecoder(nn.Module):
    """A TAEHV-class causal decoder: 2D convolutions with a one-frame temporal memory.

    Per latent frame: conv_in, a memory block that mixes in the previous frame's features,
    a 1x1 temporal upsample to 4 frames, then per frame a 3x3 conv and, per latent pixel, an
    8x8 patch of detail over a flat colour. Cheap: its convolutions run at latent resolution
    and the full-resolution frame is written once, in [N, H, W, 3] order.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        ch, c = cfg.decoder_channels, cfg.in_channels
        self.tu, self.su = cfg.temporal_upsample, cfg.spatial_upsample
        self.conv_in = nn.Conv2d(c, ch, 3, padding=1)
        self.memory = nn.Conv2d(2 * ch, ch, 3, padding=1)
        self.temporal = nn.Conv2d(ch, ch * self.tu, 1)
        self.frame = nn.Conv2d(ch, ch, 3, padding=1)
        self.color = nn.Conv2d(ch, 3, 1)
        self.detail = nn.Conv2d(ch, 3 * self.su * self.su, 1)
        # a linear path straight from a latent pixel to its tu x su x su x 3 block of video: zero in random
        # weights; a linear encoder's inverse to start from (models/latent.py BlockPCA.inverse_weights)
        self.inverse = nn.Conv2d(c, self.tu * self.su * self.su * 3, 1)

    def init_weights(self, seed: int) -> TinyStreamingDecoder:
        gen = torch.Generator().manual_seed(seed)
        for p in self.parameters():
            with torch.no_grad():
                if p.ndim == 1:
                    p.zero_()
                else:
                    fan_in = p.shape[1] * p.shape[2] * p.shape[3]
                    p.copy_(torch.randn(p.shape, generator=gen) / fan_in**0.5)
        with torch.no_grad():
            self.detail.weight.mul_(0.25)
            self.inverse.weight.zero_()
        return self

    def init_state(self) -> DecoderState:
        return DecoderState()

    def state_bytes(self, height: int, width: int) -> int:
        # the memory: [ch, h, w] features of the last latent frame
        p = self.conv_in.weight
        return p.shape[0] * (height // self.su) * (width // self.su) * p.element_size()

    def forward(self, z: torch.Tensor, memory: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Differentiable (training runs it): z [B, F, C, h, w] latents, memory [B, ch, h, w] (the
        features of the latent frame before z's first; None at a stream's start) ->
        (rgb [B, F*tu, H, W, 3] float, about [-1, 1]; the memory to carry on)."""
        b, nf, _, h, w = z.shape
        feats = F.silu(self.conv_in(z.flatten(0, 1))).unflatten(0, (b, nf))  # [B, F, ch, h, w]
        mixed = []
        mem = memory
        for f in range(nf):  # causal: each frame sees the previous one
            prev = torch.zeros_like(feats[:, f]) if mem is None else mem
            mem = feats[:, f] + F.silu(self.memory(torch.cat([feats[:, f], prev], dim=1)))
            mixed.append(mem)
        x = self.temporal(torch.stack(mixed, 1).flatten(0, 1))  # [B*F, ch*tu, h, w]
        x = F.silu(self.frame(x.view(b * nf * self.tu, -1, h, w)))  # [N, ch, h, w], N = B*F*tu
        n, su, tu = x.shape[0], self.su, self.tu
        # per latent pixel an 8x8 patch: a flat colour plus detail plus the linear path, summed at latent
        # resolution with the patch in the channels, (3, su, su) order; then one permute into [N, H, W, 3]
        # (summing in the output's layout, with 3 innermost, took the CPU 4x as long)
        # the linear path's channels are (tu, su, su, 3): its weights reordered to (tu, 3, su, su) (a tiny tensor)
        weight = self.inverse.weight.view(tu, su, su, 3, -1).permute(0, 3, 1, 2, 4).reshape(self.inverse.weight.shape)
        bias = self.inverse.bias.view(tu, su, su, 3).permute(0, 3, 1, 2).reshape(-1)
        linear = F.conv2d(z.flatten(0, 1), weight, bias).view(n, 3, su * su, h, w)  # [N, 3, su*su, h, w]
        patch = linear + self.detail(x).view(n, 3, su * su, h, w) + self.color(x)[:, :, None]
        rgb = patch.view(n, 3, su, su, h, w).permute(0, 4, 2, 5, 3, 1)  # [N, h, su, w, su, 3]
        return rgb.reshape(b, nf * tu, h * su, w * su, 3), mem

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, state: DecoderState) -> torch.Tensor:
        # latents: [C, F, h, w] -> frames [N, H, W, 3] uint8
        p = self.conv_in.weight
        z = latents.to(p.device, p.dtype).transpose(0, 1)[None]  # [1, F, C, h, w]
        first = state.memory is None
        rgb, mem = self(z, None if first else state.memory[None])
        state.memory = mem[0].detach()
        rgb = rgb[0, self.tu - 1 :] if first else rgb[0]  # the stream's first latent frame gives one video frame
        frames = rgb.clamp_(-1, 1).add_(1).mul_(127.5).round_().to(torch.uint8)
        state.frames_out += frames.shape[0]
        return frames  # [N, H, W, 3]


def frames_per_chunk(latent_frames: int, first: bool, temporal_upsample: int = 4) -> int:
    """Video frames a chunk of `latent_frames` decodes to."""
    return latent_frames * temporal_upsample - (temporal_upsample - 1 if first else 0)
