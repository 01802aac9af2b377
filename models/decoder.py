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
        x, mem = self._features(z, memory)
        return _frames(self._patches(x, z.flatten(0, 1))).unflatten(0, (b, nf * self.tu)), mem

    def _features(self, z: torch.Tensor, memory: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """z [B, F, C, h, w] -> (features of each video frame [B*F*tu, ch, h, w], the memory to carry on)."""
        b, nf, _, h, w = z.shape
        feats = F.silu(self.conv_in(z.flatten(0, 1))).unflatten(0, (b, nf))  # [B, F, ch, h, w]
        mixed = []
        mem = memory
        for f in range(nf):  # causal: each frame sees the previous one
            prev = torch.zeros_like(feats[:, f]) if mem is None else mem
            mem = feats[:, f] + F.silu(self.memory(torch.cat([feats[:, f], prev], dim=1)))
            mixed.append(mem)
        x = self.temporal(torch.stack(mixed, 1).flatten(0, 1))  # [B*F, ch*tu, h, w]
        return F.silu(self.frame(x.view(b * nf * self.tu, -1, h, w))), mem

    def _patches(self, x: torch.Tensor, z: torch.Tensor, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        """Each latent pixel's su x su patch of each of its tu video frames, scale * (flat colour + detail +
        the linear path) + shift: x [B*F*tu, ch, h, w] features, z [B*F, C, h, w] latents ->
        [B*F, tu, h, w, su, su, 3] float.

        The three 1x1 maps are one matmul per frame of the tu, with the patch (dy, dx, c) in the last
        dimension, so the full-resolution output is written once (summing full-size maps and permuting
        them into [H, W, 3] order cost the CPU most of a chunk's decode)."""
        bf, c_lat, h, w = z.shape
        tu, su, ch, o = self.tu, self.su, x.shape[1], 3 * self.su * self.su
        # detail's output channels are (c, dy, dx): reordered to (dy, dx, c), the flat colour added to each
        detail = self.detail.weight.view(3, su, su, ch).permute(1, 2, 0, 3).reshape(o, ch) + self.color.weight.view(3, ch).repeat(su * su, 1)
        bias = self.detail.bias.view(3, su, su).permute(1, 2, 0).reshape(o) + self.color.bias.repeat(su * su)
        # the linear path's output channels are (t, dy, dx, c) already
        linear, bias = self.inverse.weight.view(tu, o, c_lat), self.inverse.bias.view(tu, o) + bias
        weight = torch.cat([detail.expand(tu, o, ch) * scale, linear * scale, (bias * scale + shift)[..., None]], dim=2)
        ones = x.new_ones(bf, tu, 1, h * w)  # the bias's input
        inputs = torch.cat([x.view(bf, tu, ch, h * w), z.view(bf, 1, c_lat, h * w).expand(bf, tu, c_lat, h * w), ones], dim=2)
        out = torch.matmul(inputs.transpose(2, 3), weight.transpose(1, 2))  # [B*F, tu, h*w, o]
        return out.view(bf, tu, h, w, su, su, 3)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, state: DecoderState) -> torch.Tensor:
        # latents: [C, F, h, w] -> frames [N, H, W, 3] uint8
        p = self.conv_in.weight
        z = latents.to(p.device, p.dtype).transpose(0, 1)[None]  # [1, F, C, h, w]
        first = state.memory is None
        x, mem = self._features(z, None if first else state.memory[None])
        state.memory = mem[0].detach()
        # straight to [0, 255], rounded and narrowed to uint8 before the one permute into [N, H, W, 3]
        patches = self._patches(x, z[0], scale=127.5, shift=127.5).clamp_(0, 255).round_().to(torch.uint8)
        frames = _frames(patches)
        frames = frames[self.tu - 1 :] if first else frames  # the stream's first latent frame gives one video frame
        state.frames_out += frames.shape[0]
        return frames  # [N, H, W, 3]


def _frames(patches: torch.Tensor) -> torch.Tensor:
    """[B*F, tu, h, w, su, su, 3] patches -> [B*F*tu, H, W, 3] frames: one permute, rows of su*3 values moving whole."""
    bf, tu, h, w, su, _, c = patches.shape
    return patches.permute(0, 1, 2, 4, 3, 5, 6).reshape(bf * tu, h * su, w * su, c)


def frames_per_chunk(latent_frames: int, first: bool, temporal_upsample: int = 4) -> int:
    """Video frames a chunk of `latent_frames` decodes to."""
    return latent_frames * temporal_upsample - (temporal_upsample - 1 if first else 0)


class NoDecoder:
    """A decoder that loads nothing and makes no frames, only their count, [N, 0, 0, 3] uint8: that of a
    group's other ranks (models/parallel.py: the decode runs on rank 0 only, after the commit, not
    overlapping the next chunk), so a rank's stream state (frames done, chunk boundaries) stays rank 0's."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.tu = cfg.temporal_upsample

    def init_state(self) -> DecoderState:
        return DecoderState()

    def state_bytes(self, height: int, width: int) -> int:
        return 0

    def decode(self, latents: torch.Tensor, state: DecoderState) -> torch.Tensor:
        n = frames_per_chunk(latents.shape[1], state.frames_out == 0, self.tu)
        state.frames_out += n
        return torch.empty(n, 0, 0, 3, dtype=torch.uint8, device=latents.device)
