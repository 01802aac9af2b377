"""TAEHV-compatible streaming decoder (loads madebyollin/taehv's `taew2_1.pth`, MIT licensed).

A tiny causal decoder for Wan2.1 latents: 2D convolutions at each frame, where each MemBlock also
sees its own input one time step earlier (its temporal memory), TGrow layers that turn one time
step into `stride` time steps, and 2x nearest upsampling per stage. The module is written here with
TAEHV's parameter names (`decoder.N.*` of one nn.Sequential), so its file loads strictly.

Differences from the full Wan VAE: TAEHV decodes the DiT's normalized latents directly (no
latents_mean / latents_std) and outputs [0, 1]. A stream's first latent frame's first 3 output frames
are dropped, so chunks give 9 then 12 frames, as with the Wan VAE. Its per-stream memory is the
last input frame of each of the 9 MemBlocks (~67 MB per 480x832 stream in fp16).

The encoder (`TAEHVEncoder`, video-to-video input, issue 35) is TAEHV's too (`encoder.N.*` of the same
file): per frame 2D convolutions in [0, 1] RGB, three stages of (TPool, a stride-2 conv, 3 MemBlocks),
where a TPool folds `stride` consecutive time steps into one (Wan2.1: strides 2, 2, 1, so 4 frames make
a latent frame), then a conv to the latent channels. Run chunk by chunk, causally: a chunk's frames are a
multiple of 4, so a TPool never straddles chunks, and each MemBlock's memory (its last input frame) is
the stream's state. TAEHV's own `encode_video` pads a clip's end to a multiple of 4; here a stream's
first chunk (1 + 4k frames) repeats frame 0 three times at the start instead, so that latent frame k
sums frames 4k-3 .. 4k as the Wan VAE's does, and the decoder's 3 dropped frames undo exactly that.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from models.decoder import DecoderState
from models.encoder import EncoderState, check_frames, grouped
from models.weights import CheckpointError, check_state_dict

TAEHV_FILE = "taew2_1.pth"


def conv(n_in: int, n_out: int, bias: bool = True) -> nn.Conv2d:
    return nn.Conv2d(n_in, n_out, 3, padding=1, bias=bias)


class Clamp(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x / 3) * 3  # soft clamp of the latents to (-3, 3)


class MemBlock(nn.Module):
    """out = relu(conv([x, past]) + x): `past` is this block's input one time step earlier."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.conv = nn.Sequential(conv(2 * n_in, n_out), nn.ReLU(), conv(n_out, n_out), nn.ReLU(), conv(n_out, n_out))
        self.skip = nn.Conv2d(n_in, n_out, 1, bias=False) if n_in != n_out else nn.Identity()

    def forward(self, x: torch.Tensor, past: torch.Tensor) -> torch.Tensor:
        # x, past: [T, C, H, W]
        return F.relu(self.conv(torch.cat([x, past], 1)) + self.skip(x))


class TGrow(nn.Module):
    """One time step -> `stride` time steps (a 1x1 conv to stride*C channels, split in time order)."""

    def __init__(self, n_f: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv2d(n_f, n_f * stride, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, c, h, w = x.shape
        return self.conv(x).reshape(t * self.stride, c, h, w)  # [T*stride, C, H, W]


class TPool(nn.Module):
    """`stride` time steps -> one (their channels side by side, earliest first, through a 1x1 conv)."""

    def __init__(self, n_f: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv2d(n_f * stride, n_f, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, c, h, w = x.shape
        return self.conv(x.reshape(t // self.stride, self.stride * c, h, w))  # [T/stride, C, H, W]


def run_memblocks(layers: nn.Sequential, x: torch.Tensor, memory: dict[int, torch.Tensor]) -> torch.Tensor:
    """`layers` over x [T, C, H, W] (time as the batch), each MemBlock i seeing its input one time step
    earlier: memory[i] (its last input of the chunk before; zeros at a stream's start) for the first step.
    Updates `memory` with this chunk's last inputs."""
    for i, block in enumerate(layers):
        if isinstance(block, MemBlock):
            prev = memory.get(i)
            past = torch.cat([torch.zeros_like(x[:1]) if prev is None else prev, x[:-1]])  # [T, C, H, W]
            memory[i] = x[-1:].clone()
            x = block(x, past)
        else:
            x = block(x)
    return x


@dataclass
class TAEHVState(DecoderState):
    """One stream's temporal memory (the `memory` field of DecoderState is unused)."""

    block_memory: dict[int, torch.Tensor] = field(default_factory=dict)  # MemBlock index -> last input [1, C, H', W']
    latent_frames_in: int = 0  # latent frames decoded so far (0: the next chunk starts the stream)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.block_memory.values())


class TAEHVDecoder(nn.Module):
    """`StreamingDecoder` with TAEHV's decoder: latents [C, F, h, w] -> uint8 frames [N, 8h, 8w, 3].

    n_f: channels of the stages (TAEHV: 256, 128, 64, 64); time_upscale: TGrow strides of stages (Wan2.1:
    1, 2, 2, i.e. 4x in time); patch_size: the output pixel-shuffle (1 for Wan2.1).
    """

    def __init__(
        self,
        latent_channels: int = 16,
        n_f: tuple[int, int, int, int] = (256, 128, 64, 64),
        time_upscale: tuple[int, int, int] = (1, 2, 2),
        patch_size: int = 1,
    ) -> None:
        super().__init__()
        self.patch_size = patch_size
        layers: list[nn.Module] = [Clamp(), conv(latent_channels, n_f[0]), nn.ReLU()]
        for i in range(3):  # a stage: 3 MemBlocks, 2x upsample, TGrow, conv to the next width
            layers += [MemBlock(n_f[i], n_f[i]) for _ in range(3)]
            layers += [nn.Upsample(scale_factor=2), TGrow(n_f[i], time_upscale[i])]
            layers += [conv(n_f[i], n_f[i + 1], bias=False)]
        layers += [nn.ReLU(), conv(n_f[3], 3 * patch_size**2)]
        self.decoder = nn.Sequential(*layers)
        self.t_upscale = 1
        for s in time_upscale:
            self.t_upscale *= s
        self.frames_to_trim = self.t_upscale - 1  # dropped at a stream's start (Wan: first latent -> 1 frame)

    @classmethod
    def from_path(
        cls, path: str | Path, device: torch.device | str = "cuda", dtype: torch.dtype = torch.float16
    ) -> TAEHVDecoder:
        """From TAEHV's file (.pth or .safetensors, keys `decoder.N.*`; `encoder.*` keys are ignored)."""
        path = Path(path)
        if path.is_dir():
            path = path / TAEHV_FILE
        sd = {k: v for k, v in _read(path).items() if not k.startswith("encoder.")}  # decoder only
        for need in (f"decoder.{i}.weight" for i in (1, 8, 14, 20, 22)):
            if need not in sd:
                raise CheckpointError(f"{path}: missing key {need!r}; is this TAEHV's {TAEHV_FILE}?")
        n_f = tuple(sd[f"decoder.{i}.weight"].shape[0] for i in (1, 8, 14, 20))  # conv weights: [out, in, 3, 3]
        out = sd["decoder.22.weight"].shape[0]
        patch = round((out // 3) ** 0.5)
        model = cls(latent_channels=sd["decoder.1.weight"].shape[1], n_f=n_f, patch_size=patch)
        own = model.state_dict()
        for i, layer in enumerate(model.decoder):
            key = f"decoder.{i}.conv.weight"
            if isinstance(layer, TGrow) and key in sd and sd[key].shape[0] > own[key].shape[0]:
                sd[key] = sd[key][-own[key].shape[0] :]  # a TGrow trained wider: keep the last time step's channels
        check_state_dict(model, sd)
        model.load_state_dict(sd, strict=True)
        return model.to(device, dtype).eval().requires_grad_(False)

    @property
    def device(self) -> torch.device:
        return self.decoder[1].weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.decoder[1].weight.dtype

    def init_state(self) -> TAEHVState:
        return TAEHVState()

    @torch.no_grad()
    def decode_float(self, latents: torch.Tensor, state: TAEHVState) -> torch.Tensor:
        """latents [C, F, h, w] (the DiT's, normalized) -> video [N, 3, H, W] in [0, 1]; updates state."""
        x = latents.to(self.device, self.dtype).transpose(0, 1)  # [F, C, h, w]: time as the batch
        x = run_memblocks(self.decoder, x, state.block_memory)  # causal in time
        if self.patch_size > 1:
            x = F.pixel_shuffle(x, self.patch_size)
        if state.latent_frames_in == 0:
            x = x[self.frames_to_trim :]
        state.latent_frames_in += latents.shape[1]
        return x.clamp_(0, 1)  # [N, 3, H, W]

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, state: TAEHVState) -> torch.Tensor:
        """latents [C, F, h, w] -> frames [N, H, W, 3] uint8 on the decoder's device; updates state."""
        x = self.decode_float(latents, state)
        frames = x.permute(0, 2, 3, 1).float().mul_(255).round_().clamp_(0, 255).to(torch.uint8)
        state.frames_out += frames.shape[0]
        return frames  # [N, H, W, 3]

    def state_bytes(self, height: int, width: int, dtype: torch.dtype | None = None) -> int:
        """Per-stream memory bytes at a video size: one input frame per MemBlock at its stage's resolution."""
        elsize = torch.empty(0, dtype=dtype or self.dtype).element_size()
        h, w = height // (8 * self.patch_size), width // (8 * self.patch_size)  # latent size
        total, scale = 0, 1
        for block in self.decoder:
            if isinstance(block, MemBlock):
                total += block.conv[0].in_channels // 2 * (h * scale) * (w * scale)
            elif isinstance(block, nn.Upsample):
                scale *= 2
        return total * elsize


class TAEHVEncoder(nn.Module):
    """`StreamingEncoder` with TAEHV's encoder: uint8 frames [N, H, W, 3] -> latents [C, F, H/8, W/8]
    (module doc). width: its channels (TAEHV: 64); time_downscale: the TPool strides (Wan2.1: 2, 2, 1)."""

    def __init__(self, latent_channels: int = 16, width: int = 64, time_downscale: tuple[int, int, int] = (2, 2, 1),
                 patch_size: int = 1) -> None:
        super().__init__()
        self.patch_size = patch_size
        layers: list[nn.Module] = [conv(3 * patch_size**2, width), nn.ReLU()]
        for stride in time_downscale:  # a stage: TPool, a stride-2 conv, 3 MemBlocks
            layers += [TPool(width, stride), nn.Conv2d(width, width, 3, padding=1, stride=2, bias=False)]
            layers += [MemBlock(width, width) for _ in range(3)]
        layers += [conv(width, latent_channels)]
        self.encoder = nn.Sequential(*layers)
        self.t_downscale = 1
        for s in time_downscale:
            self.t_downscale *= s

    @classmethod
    def from_path(cls, path: str | Path, device: torch.device | str = "cuda", dtype: torch.dtype = torch.float16) -> TAEHVEncoder:
        """From TAEHV's file (its `encoder.N.*` keys, strictly; the decoder's are ignored)."""
        sd = {k: v for k, v in _read(path).items() if k.startswith("encoder.")}
        first, last = "encoder.0.weight", f"encoder.{len(cls().encoder) - 1}.weight"
        if first not in sd or last not in sd:
            raise CheckpointError(
                f"{path}: no TAEHV encoder in it (keys encoder.N.*); a file made by an older "
                "benchmarks/make_wan_files.py holds the decoder only: make it again"
            )
        strides = tuple(sd[f"encoder.{i}.conv.weight"].shape[1] // sd[f"encoder.{i}.conv.weight"].shape[0] for i in (2, 7, 12))
        patch = round((sd[first].shape[1] // 3) ** 0.5)
        model = cls(latent_channels=sd[last].shape[0], width=sd[first].shape[0], time_downscale=strides, patch_size=patch)
        check_state_dict(model, sd)
        model.load_state_dict(sd, strict=True)
        return model.to(device, dtype).eval().requires_grad_(False)

    @property
    def device(self) -> torch.device:
        return self.encoder[0].weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.encoder[0].weight.dtype

    def init_state(self) -> EncoderState:
        return EncoderState(memory={})

    def state_bytes(self, height: int, width: int, dtype: torch.dtype | None = None) -> int:
        """Per-stream memory: one input frame per MemBlock, at its stage's resolution (1/2, 1/4, 1/8)."""
        elsize = torch.empty(0, dtype=dtype or self.dtype).element_size()
        total, h, w = 0, height // self.patch_size, width // self.patch_size
        for block in self.encoder:
            if isinstance(block, nn.Conv2d) and block.stride == (2, 2):
                h, w = (h + 1) // 2, (w + 1) // 2
            elif isinstance(block, MemBlock):
                total += block.conv[0].in_channels // 2 * h * w
        return total * elsize

    @torch.no_grad()
    def encode(self, frames: torch.Tensor, state: EncoderState) -> torch.Tensor:
        """frames [N, H, W, 3] uint8 -> latents [C, F, H/8, W/8] float32; N = 1 + 4k at a stream's start
        (frame 0 stands for the 4 frames of latent frame 0), else 4k; updates state."""
        check_frames(frames, frames.shape[1], frames.shape[2])
        t = self.t_downscale
        x = grouped(frames.to(self.device), t, frames.shape[0] % t == 1).flatten(0, 1)  # [4F, H, W, 3]
        x = x.permute(0, 3, 1, 2).to(self.dtype).div_(255)  # [T, 3, H, W] in [0, 1]
        if self.patch_size > 1:
            x = F.pixel_unshuffle(x, self.patch_size)
        if state.memory is None:
            state.memory = {}
        z = run_memblocks(self.encoder, x, state.memory)  # [F, C, h, w]
        state.frames_in += frames.shape[0]
        return z.transpose(0, 1).float()  # [C, F, h, w]


def _read(path: str | Path) -> dict[str, torch.Tensor]:
    """TAEHV's file (.pth or .safetensors; a folder: its taew2_1.pth) as a state dict."""
    path = Path(path)
    if path.is_dir():
        path = path / TAEHV_FILE
    if not path.is_file():
        raise CheckpointError(f"no TAEHV checkpoint at {path} (weights load from a local path only)")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    return torch.load(path, map_location="cpu", weights_only=True)
