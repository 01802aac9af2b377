"""Streaming latent encoders: a chunk's input video frames plus carried state in, latents out.

The mirror of models/decoder.py, for video-to-video (issue 35): a stream's input frames are encoded
chunk by chunk into the DiT's latent space, then noised to the stream's strength and denoised under
its prompt (models/generator.py `set_input`). Wan's convention holds here too: latent frame 0 of a
causal run is video frame 0 alone (4x temporal: latent frame k sums up frames 4k-3 .. 4k), so the
stream's first chunk of F latent frames takes 1 + 4 (F - 1) video frames and later ones 4 F
(`frames_per_chunk` in models/decoder.py).

Implementations:
- `BlockPCAEncoder`: the built-in model's fixed linear encoder (models/latent.py), stateless;
- `TAEHVEncoder` (models/taehv.py): TAEHV's causal encoder, a per-stream memory per MemBlock;
- `WanVAEEncoder` (models/wan_vae.py): the Wan VAE's encoder run chunk by chunk with a per-stream
  feature cache.

A causal run restarts when the generator resets a stream's encoder state (its input went missing):
a causal encoder then takes a 4 F-frame chunk as a new run whose first latent frame is the chunk's
4th frame alone (the last of the first latent frame's group; Wan's encoder needs a lone first frame).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from models.config import ModelConfig
from models.latent import BlockPCA


@dataclass
class EncoderState:
    """What a streaming encoder carries from one chunk to the next (one stream's causal run)."""

    memory: Any = None  # the encoder's carried features (tensors in dicts / lists), None at a run's start
    frames_in: int = 0  # video frames of this run encoded so far (0: the next chunk starts a run)

    def nbytes(self) -> int:
        return _nbytes(self.memory)


class StreamingEncoder(Protocol):
    def init_state(self) -> EncoderState: ...

    def state_bytes(self, height: int, width: int) -> int:
        """Device memory one stream's state holds at this video size (admission counts it)."""
        ...

    def encode(self, frames: torch.Tensor, state: EncoderState) -> torch.Tensor:
        """frames [N, H, W, 3] uint8 (any device) -> latents [C, F, h, w] float32 on the encoder's device;
        N = 1 + 4 (F - 1) at a stream's start, else 4 F; updates state."""
        ...


def latent_frames(n: int, temporal: int, first: bool) -> int:
    """Latent frames that `n` input video frames make: 1 + (n - 1) / temporal for a stream's first chunk
    (`first`), n / temporal after; a ValueError naming the counts that fit if `n` fits neither."""
    if first and n % temporal == 1:
        return 1 + (n - 1) // temporal
    if not first and n > 0 and n % temporal == 0:
        return n // temporal
    want = "1 + a multiple of" if first else "a multiple of"
    raise ValueError(f"{n} input frames do not make whole latent frames: a {'first' if first else 'later'} chunk "
                     f"takes {want} {temporal} video frames")


def check_frames(frames: torch.Tensor, height: int, width: int) -> None:
    """A ValueError with the shapes unless `frames` is [N, height, width, 3] uint8 with N >= 1."""
    if frames.dtype != torch.uint8 or frames.ndim != 4 or tuple(frames.shape[1:]) != (height, width, 3) or not len(frames):
        raise ValueError(
            f"input frames must be [N, {height}, {width}, 3] uint8 (the model's frame size, RGB), got "
            f"{list(frames.shape)} {frames.dtype}"
        )


def grouped(frames: torch.Tensor, temporal: int, first: bool) -> torch.Tensor:
    """frames [N, H, W, 3] -> [F, temporal, H, W, 3]: a first chunk's frame 0 repeated `temporal` times as
    its first latent frame's group (models/latent.py `video_frames`), then groups of `temporal`."""
    latent_frames(frames.shape[0], temporal, first)
    if first:
        frames = torch.cat([frames[:1].expand(temporal - 1, *frames.shape[1:]), frames])
    return frames.unflatten(0, (-1, temporal))


class BlockPCAEncoder:
    """The built-in model's encoder (models/latent.py `BlockPCA`): stateless, one matmul per chunk."""

    def __init__(self, pca: BlockPCA, device: torch.device | str = "cpu") -> None:
        self.pca = pca.to(device)
        self.device = torch.device(device)

    @classmethod
    def random(cls, cfg: ModelConfig, seed: int = 0, device: torch.device | str = "cpu") -> BlockPCAEncoder:
        """A random-weights encoder for a random-weights model (tests, benchmarks): an orthonormal basis
        drawn from `seed`, a zero mean and a unit scale (no data behind it: the latents of a rendered frame
        are about N(0, 0.5) per channel, as they come)."""
        d = cfg.temporal_upsample * cfg.spatial_upsample**2 * 3
        gen = torch.Generator().manual_seed(seed)
        basis, _ = torch.linalg.qr(torch.randn(d, cfg.in_channels, generator=gen))  # [D, C] orthonormal columns
        scale = (d / cfg.in_channels) ** -0.5 * 4  # a block of [-1, 1] values projects to about this spread
        pca = BlockPCA(torch.zeros(d), basis.T.contiguous(), torch.full((cfg.in_channels,), scale), cfg.temporal_upsample,
                       cfg.spatial_upsample)
        return cls(pca, device)

    def init_state(self) -> EncoderState:
        return EncoderState()

    def state_bytes(self, height: int, width: int) -> int:
        return 0

    @torch.no_grad()
    def encode(self, frames: torch.Tensor, state: EncoderState) -> torch.Tensor:
        # stateless: a count of 1 + 4k frames is a stream's first chunk (its frame 0 stands for 4)
        blocks = grouped(frames.to(self.device), self.pca.tu, frames.shape[0] % self.pca.tu == 1)  # [F, tu, H, W, 3]
        state.frames_in += frames.shape[0]
        return self.pca.encode(blocks[None])[0]  # [C, F, h, w]


def _nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(o) for o in obj)
    if isinstance(obj, dict):
        return sum(_nbytes(o) for o in obj.values())
    return 0
