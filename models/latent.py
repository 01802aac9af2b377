"""The tiny preset's latent space: a fixed PCA encoder over 4x8x8 RGB blocks, whitened per channel.

A latent pixel of latent frame k sums up one 8x8 block of video frames 4k-3 .. 4k (for k = 0, frame 0
repeated four times: a stream's first latent frame decodes to one video frame): its 4 * 8 * 8 * 3
values in [-1, 1] projected on the blocks' top C principal components, each divided by its standard
deviation, so that every channel is about N(0, 1), as the flow-matching noise is. The encoder is fit
once on rendered scenes (models/scenes.py) and then fixed; a causal decoder is trained to invert it
(models/train.py), behind the StreamingDecoder interface (models/decoder.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from models.config import ModelConfig


def video_frames(latent_frames: Sequence[int], temporal: int = 4) -> list[int]:
    """The video frames each latent frame sums up, `temporal` per latent frame, in order."""
    out = []
    for k in latent_frames:
        out += [0] * temporal if k == 0 else list(range(temporal * k - temporal + 1, temporal * k + 1))
    return out


class BlockPCA:
    """Video frames <-> latents through the top principal components of space-time blocks."""

    def __init__(self, mean: torch.Tensor, basis: torch.Tensor, std: torch.Tensor, temporal: int = 4, spatial: int = 8):
        self.mean = mean  # [D] mean block, D = temporal * spatial * spatial * 3
        self.basis = basis  # [C, D] principal directions, orthonormal, largest variance first
        self.std = std  # [C] standard deviation of each component over the data it was fit on
        self.tu, self.su = temporal, spatial
        self.explained: float | None = None  # share of the variance the components keep (set by `fit`)

    @property
    def channels(self) -> int:
        return self.basis.shape[0]

    @classmethod
    def fit(cls, frames: torch.Tensor, channels: int, temporal: int = 4, spatial: int = 8) -> BlockPCA:
        """Fit on frames [N, temporal, H, W, 3] uint8 (N latent frames' worth of video)."""
        x = _blocks(frames[None], temporal, spatial).reshape(-1, temporal * spatial * spatial * 3).double()
        mean = x.mean(0)
        var, vec = torch.linalg.eigh(torch.cov((x - mean).T))  # ascending
        basis = vec[:, -channels:].flip(1).T  # [C, D], largest first
        # a fixed sign per component: its largest entry positive
        sign = torch.sign(basis.gather(1, basis.abs().argmax(1, keepdim=True)))
        std = var[-channels:].flip(0).clamp_min(1e-12).sqrt()
        pca = cls(mean.float(), (basis * sign).float(), std.float(), temporal, spatial)
        pca.explained = float(var[-channels:].sum() / var.sum())
        return pca

    @classmethod
    def for_model(cls, cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> BlockPCA:
        """From the tensors `state_dict` gave, checked against the preset's latent shape."""
        pca = cls(tensors["mean"], tensors["basis"], tensors["std"], cfg.temporal_upsample, cfg.spatial_upsample)
        want = (cfg.in_channels, cfg.temporal_upsample * cfg.spatial_upsample**2 * 3)
        if tuple(pca.basis.shape) != want:
            raise ValueError(f"PCA basis {tuple(pca.basis.shape)} does not fit preset {cfg.name}: want {want}")
        return pca

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"mean": self.mean, "basis": self.basis, "std": self.std}

    def to(self, device: torch.device | str) -> BlockPCA:
        return BlockPCA(self.mean.to(device), self.basis.to(device), self.std.to(device), self.tu, self.su)

    def inverse_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The linear inverse as a 1x1 convolution's weight [D, C, 1, 1] and bias [D] (a decoder starts from it)."""
        return (self.basis * self.std[:, None]).T[:, :, None, None].contiguous(), self.mean.clone()

    def encode(self, frames: torch.Tensor) -> torch.Tensor:
        """frames [B, F, temporal, H, W, 3] uint8 -> latents [B, C, F, H/spatial, W/spatial] float32."""
        x = _blocks(frames, self.tu, self.su)  # [B, F, h, w, D]
        z = (x - self.mean) @ self.basis.T / self.std  # [B, F, h, w, C]
        return z.permute(0, 4, 1, 2, 3).contiguous()

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """The linear inverse (a reference for the trained decoder): latents [B, C, F, h, w] ->
        frames [B, F, temporal, H, W, 3] float in about [-1, 1]."""
        b, _, nf, h, w = latents.shape
        x = (latents.permute(0, 2, 3, 4, 1) * self.std) @ self.basis + self.mean  # [B, F, h, w, D]
        x = x.view(b, nf, h, w, self.tu, self.su, self.su, 3).permute(0, 1, 4, 2, 5, 3, 6, 7)
        return x.reshape(b, nf, self.tu, h * self.su, w * self.su, 3)


def _blocks(frames: torch.Tensor, temporal: int, spatial: int) -> torch.Tensor:
    # frames [B, F, temporal, H, W, 3] uint8 -> [B, F, h, w, temporal * spatial * spatial * 3] float in [-1, 1]
    b, nf, t, hh, ww, _ = frames.shape
    h, w = hh // spatial, ww // spatial
    x = frames.view(b, nf, t, h, spatial, w, spatial, 3).permute(0, 1, 3, 5, 2, 4, 6, 7)
    return x.reshape(b, nf, h, w, -1).float() / 127.5 - 1
