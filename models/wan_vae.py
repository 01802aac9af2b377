"""The Wan2.1 VAE as a streaming decoder: diffusers' `AutoencoderKLWan`, decoded chunk by chunk.

Each stream owns its decoder's causal cache (`WanVAEState.feat_cache`: the last two input frames
of every causal 3D convolution, ~1.9 GB per 480x832 stream in bf16). A chunk runs the VAE's own
modules the way `AutoencoderKLWan._decode` does, one latent frame at a time, but with the stream's
cache instead of the model's, so nothing is lost between chunks and streams never mix.
`vae.decode` is never called on the serving path: it clears the cache on every call.

The encoder (`WanVAEEncoder`, video-to-video input, issue 35) runs the same way: the VAE's encoder, as
`AutoencoderKLWan._encode` does (a causal run's frame 0 alone, then groups of 4), chunk by chunk, with
the stream's own feature cache (`EncoderState.memory`), never `vae.encode`, which clears the model's.

Weights load from a local path only: Wan's original `Wan2.1_VAE.pth` (its key names renamed to
diffusers' here) or a Diffusers folder (`vae/config.json` + safetensors).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from models.decoder import DecoderState
from models.encoder import EncoderState, check_frames
from models.weights import CheckpointError, check_state_dict

WAN_VAE_FILE = "Wan2.1_VAE.pth"


def wan21_vae_config(base_dim: int = 96, z_dim: int = 16) -> dict:
    """`AutoencoderKLWan` kwargs of the Wan2.1 VAE (its latents_mean / latents_std are the library defaults)."""
    return dict(
        base_dim=base_dim,
        z_dim=z_dim,
        dim_mult=[1, 2, 4, 4],
        num_res_blocks=2,
        attn_scales=[],
        temperal_downsample=[False, True, True],
    )


# ---------------------------------------------------------------------------------------------
# Key renames: Wan's module names (wan/modules/vae.py) <-> diffusers' AutoencoderKLWan.
#
# Wan keeps each stage as a flat nn.Sequential: a ResidualBlock's `residual` is
# (RMS_norm, SiLU, CausalConv3d, RMS_norm, SiLU, Dropout, CausalConv3d) = indices 0, 2, 3, 6;
# `middle` is (resblock, attention, resblock); `head` is (RMS_norm, SiLU, conv); the decoder's
# `upsamples` lists, per stage, num_res_blocks + 1 resblocks and then a Resample (none after the
# last stage). Diffusers nests the decoder stages as up_blocks[b].resnets[j] / .upsamplers[0];
# the encoder's `downsamples` stay flat as `down_blocks`.

_RESBLOCK = {  # Wan suffix -> diffusers suffix, inside one residual block
    "residual.0.gamma": "norm1.gamma",
    "residual.2.weight": "conv1.weight",
    "residual.2.bias": "conv1.bias",
    "residual.3.gamma": "norm2.gamma",
    "residual.6.weight": "conv2.weight",
    "residual.6.bias": "conv2.bias",
    "shortcut.weight": "conv_shortcut.weight",
    "shortcut.bias": "conv_shortcut.bias",
}
_RESBLOCK_INV = {v: k for k, v in _RESBLOCK.items()}

_PREFIXES = [  # Wan prefix -> diffusers prefix, for the parts that are not numbered stages
    ("conv1.", "quant_conv."),
    ("conv2.", "post_quant_conv."),
    ("encoder.conv1.", "encoder.conv_in."),
    ("decoder.conv1.", "decoder.conv_in."),
    ("encoder.head.0.", "encoder.norm_out."),
    ("encoder.head.2.", "encoder.conv_out."),
    ("decoder.head.0.", "decoder.norm_out."),
    ("decoder.head.2.", "decoder.conv_out."),
    ("encoder.middle.1.", "encoder.mid_block.attentions.0."),
    ("decoder.middle.1.", "decoder.mid_block.attentions.0."),
]


def wan_key_to_diffusers(key: str, num_res_blocks: int = 2) -> str:
    """Diffusers' name of one Wan VAE key; a key it does not know comes back unchanged."""
    for wan, diff in _PREFIXES:
        if key.startswith(wan):
            return diff + key[len(wan) :]
    m = re.fullmatch(r"(encoder|decoder)\.middle\.([02])\.(.+)", key)
    if m and m[3] in _RESBLOCK:
        return f"{m[1]}.mid_block.resnets.{int(m[2]) // 2}.{_RESBLOCK[m[3]]}"
    m = re.fullmatch(r"encoder\.downsamples\.(\d+)\.(.+)", key)
    if m:
        return f"encoder.down_blocks.{m[1]}.{_RESBLOCK.get(m[2], m[2])}"
    m = re.fullmatch(r"decoder\.upsamples\.(\d+)\.(.+)", key)
    if m:
        stage, j = divmod(int(m[1]), num_res_blocks + 2)  # per stage: resblocks, then one Resample
        if j <= num_res_blocks and m[2] in _RESBLOCK:
            return f"decoder.up_blocks.{stage}.resnets.{j}.{_RESBLOCK[m[2]]}"
        if j == num_res_blocks + 1:
            return f"decoder.up_blocks.{stage}.upsamplers.0.{m[2]}"
    return key


def diffusers_key_to_wan(key: str, num_res_blocks: int = 2) -> str:
    """The inverse of `wan_key_to_diffusers` (writes Wan-layout files, e.g. in tests)."""
    for wan, diff in _PREFIXES:
        if key.startswith(diff):
            return wan + key[len(diff) :]
    m = re.fullmatch(r"(encoder|decoder)\.mid_block\.resnets\.([01])\.(.+)", key)
    if m and m[3] in _RESBLOCK_INV:
        return f"{m[1]}.middle.{int(m[2]) * 2}.{_RESBLOCK_INV[m[3]]}"
    m = re.fullmatch(r"encoder\.down_blocks\.(\d+)\.(.+)", key)
    if m:
        return f"encoder.downsamples.{m[1]}.{_RESBLOCK_INV.get(m[2], m[2])}"
    per = num_res_blocks + 2
    m = re.fullmatch(r"decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.(.+)", key)
    if m and m[3] in _RESBLOCK_INV:
        return f"decoder.upsamples.{int(m[1]) * per + int(m[2])}.{_RESBLOCK_INV[m[3]]}"
    m = re.fullmatch(r"decoder\.up_blocks\.(\d+)\.upsamplers\.0\.(.+)", key)
    if m:
        return f"decoder.upsamples.{int(m[1]) * per + num_res_blocks + 1}.{m[2]}"
    return key


def rename_wan_vae(sd: dict[str, torch.Tensor], num_res_blocks: int = 2) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        new = wan_key_to_diffusers(k, num_res_blocks)
        if new in out:
            raise CheckpointError(f"VAE keys collide after renaming: {k!r} -> {new!r}")
        out[new] = v
    return out


# ---------------------------------------------------------------------------------------------
# Loading


def _meta_vae(config: dict):
    from diffusers import AutoencoderKLWan

    with torch.device("meta"):
        return AutoencoderKLWan.from_config(config)


def _load_original(file: Path, dtype: torch.dtype):
    """Wan's .pth: infer base_dim / z_dim from the tensors, rename, load strictly."""
    sd = torch.load(file, map_location="cpu", weights_only=True)
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise CheckpointError(f"{file}: expected a flat state dict of tensors (Wan's {WAN_VAE_FILE})")
    for need in ("encoder.conv1.weight", "decoder.conv1.weight"):
        if need not in sd:
            raise CheckpointError(f"{file}: missing key {need!r}; is this Wan's {WAN_VAE_FILE}?")
    base_dim = sd["encoder.conv1.weight"].shape[0]  # [base_dim, 3, 3, 3, 3]
    z_dim = sd["decoder.conv1.weight"].shape[1]  # [4 * base_dim, z_dim, 3, 3, 3]
    vae = _meta_vae(wan21_vae_config(base_dim=base_dim, z_dim=z_dim))
    renamed = rename_wan_vae(sd, vae.config.num_res_blocks)
    check_state_dict(vae, renamed)
    vae.load_state_dict({k: v.to(dtype) for k, v in renamed.items()}, strict=True, assign=True)
    return vae


def _check_diffusers_folder(folder: Path) -> None:
    """Strict key/shape check of a Diffusers VAE folder before from_pretrained (which only warns)."""
    from diffusers import AutoencoderKLWan
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no .safetensors weights next to config.json")
    shapes: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                shapes[k] = torch.empty(h.get_slice(k).get_shape(), device="meta")
    config = AutoencoderKLWan.load_config(str(folder), local_files_only=True)
    with torch.device("meta"):
        ref = AutoencoderKLWan.from_config(config)
    check_state_dict(ref, shapes)


def _load_diffusers(folder: Path, dtype: torch.dtype):
    from diffusers import AutoencoderKLWan

    _check_diffusers_folder(folder)
    return AutoencoderKLWan.from_pretrained(str(folder), local_files_only=True, torch_dtype=dtype)


def load_wan_vae(path: str | Path, dtype: torch.dtype = torch.float32):
    """An `AutoencoderKLWan` (on the CPU) from Wan's .pth, a folder holding it, or a Diffusers folder."""
    path = Path(path)
    if path.is_file():
        return _load_original(path, dtype)
    if (path / WAN_VAE_FILE).is_file():
        return _load_original(path / WAN_VAE_FILE, dtype)
    for folder in (path / "vae", path):
        if (folder / "config.json").is_file():
            return _load_diffusers(folder, dtype)
    raise CheckpointError(
        f"no Wan VAE at {path}: expected {WAN_VAE_FILE}, a folder holding it, or a Diffusers folder "
        "with vae/config.json (weights load from a local path only)"
    )


# ---------------------------------------------------------------------------------------------
# Streaming decode


@dataclass
class WanVAEState(DecoderState):
    """One stream's causal decoder cache (the `memory` field of DecoderState is unused)."""

    feat_cache: list = field(default_factory=list)  # per causal conv: [1, c, 2, h', w'] tensor, "Rep" or None
    feat_idx: list[int] = field(default_factory=lambda: [0])  # next cache slot, reset per latent frame
    latent_frames_in: int = 0  # latent frames decoded so far (0: the next one is the stream's first)

    def nbytes(self) -> int:
        """Bytes this stream's cache holds on the device."""
        return sum(t.numel() * t.element_size() for t in self.feat_cache if isinstance(t, torch.Tensor))


class _WanVAEPart(nn.Module):
    """What the streaming decoder and encoder share: the VAE, the DiT latents' per-channel normalization (raw =
    z * std + mean, kept in fp32 and applied in fp32) and the number of the part's causal convolutions (one
    stream's cache slots)."""

    part = ""  # the VAE's module this streams: "decoder" or "encoder"
    conv = ""  # the part's 1x1x1 convolution, whose weight tells the device and dtype

    def __init__(self, vae) -> None:
        super().__init__()
        self.vae = vae
        cfg = vae.config
        self.register_buffer("mean", torch.tensor(cfg.latents_mean, dtype=torch.float32).view(-1, 1, 1, 1))
        self.register_buffer("std", torch.tensor(cfg.latents_std, dtype=torch.float32).view(-1, 1, 1, 1))
        self.num_convs = sum(type(m).__name__ == "WanCausalConv3d" for m in getattr(vae, self.part).modules())

    @classmethod
    def from_path(cls, path: str | Path, device: torch.device | str = "cuda", dtype: torch.dtype = torch.bfloat16):
        vae = load_wan_vae(path, dtype).eval().requires_grad_(False)
        return cls(vae).to(device)

    @property
    def device(self) -> torch.device:
        return getattr(self.vae, self.conv).weight.device

    @property
    def dtype(self) -> torch.dtype:
        return getattr(self.vae, self.conv).weight.dtype

    def vae_config(self) -> dict:
        """The VAE's AutoencoderKLWan keyword arguments (to build its like on the meta device)."""
        return {k: v for k, v in self.vae.config.items() if not k.startswith("_")}


class WanVAEDecoder(_WanVAEPart):
    """`StreamingDecoder` over diffusers' AutoencoderKLWan: latents [16, F, h, w] -> uint8 [N, 8h, 8w, 3]."""

    part, conv = "decoder", "post_quant_conv"

    def init_state(self) -> WanVAEState:
        return WanVAEState(feat_cache=[None] * self.num_convs)

    def state_bytes(self, height: int, width: int) -> int:
        """One stream's causal cache at this video size, once steady (1.89 GB at 480x832 in bf16)."""
        return wan_vae_state_bytes(height, width, self.dtype, config=self.vae_config())

    @torch.no_grad()
    def decode_float(self, latents: torch.Tensor, state: WanVAEState) -> torch.Tensor:
        """latents [C, F, h, w] (normalized) -> video [3, N, 8h, 8w] in [-1, 1], in the VAE's dtype."""
        z = latents.to(self.device, torch.float32) * self.std + self.mean  # [C, F, h, w]
        x = self.vae.post_quant_conv(z[None].to(self.dtype))  # [1, C, F, h, w]; a 1x1x1 conv, no cache
        outs = []
        for i in range(x.shape[2]):  # one latent frame at a time, like AutoencoderKLWan._decode
            state.feat_idx = [0]
            outs.append(
                self.vae.decoder(
                    x[:, :, i : i + 1],
                    feat_cache=state.feat_cache,
                    feat_idx=state.feat_idx,
                    first_chunk=state.latent_frames_in == 0,
                )
            )  # [1, 3, 1 or 4, H, W]
            state.latent_frames_in += 1
        return torch.cat(outs, dim=2)[0].clamp_(-1.0, 1.0)  # [3, N, H, W]

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, state: WanVAEState) -> torch.Tensor:
        """latents [C, F, h, w] -> frames [N, H, W, 3] uint8 on the decoder's device; updates state."""
        video = self.decode_float(latents, state)  # [3, N, H, W]
        frames = video.permute(1, 2, 3, 0).float().add_(1).mul_(127.5).round_().clamp_(0, 255).to(torch.uint8)
        state.frames_out += frames.shape[0]
        return frames  # [N, H, W, 3]


def wan_vae_state_bytes(
    height: int, width: int, dtype: torch.dtype = torch.bfloat16, config: dict | None = None
) -> int:
    """Per-stream cache bytes of the Wan VAE decoder at a video size, once it is steady (after 2 latent frames).

    Measured, not estimated: the decoder runs on the meta device (no memory, no compute) over three
    latent frames and the cache tensors' sizes are summed. `config`: AutoencoderKLWan kwargs (Wan2.1's
    by default). 480x832 in bf16 is about 1.89 GB.
    """
    cfg = dict(config) if config is not None else wan21_vae_config()
    vae = nn.Module.to(_meta_vae(cfg), dtype)  # nn.Module's cast: ModelMixin.to warns about dtype casts
    dec = WanVAEDecoder(vae).to("meta")
    state = dec.init_state()
    h, w = height // 8, width // 8
    dec.decode_float(torch.zeros(vae.config.z_dim, 3, h, w, device="meta"), state)
    return state.nbytes()


# ---------------------------------------------------------------------------------------------
# Streaming encode


class WanVAEEncoder(_WanVAEPart):
    """`StreamingEncoder` over diffusers' AutoencoderKLWan: uint8 frames [N, H, W, 3] -> the DiT's normalized
    latents [16, F, H/8, W/8], the posterior's mean ((mu - latents_mean) / latents_std). A stream's first chunk
    (1 + 4k frames) starts its causal run with frame 0 alone; a run restarted mid-stream (a fresh state,
    4k frames) drops the chunk's first 3 frames so that its 4th stands alone for its first latent frame."""

    part, conv = "encoder", "quant_conv"

    def __init__(self, vae) -> None:
        if getattr(vae.config, "patch_size", None):
            raise ValueError("a patchified Wan VAE (Wan2.2's) is not supported by the streaming encoder")
        super().__init__(vae)

    def init_state(self) -> EncoderState:
        return EncoderState(memory=[None] * self.num_convs)

    def state_bytes(self, height: int, width: int) -> int:
        """One stream's causal cache at this video size, once steady (measured on the meta device)."""
        vae = nn.Module.to(_meta_vae(self.vae_config()), self.dtype)
        enc = WanVAEEncoder(vae).to("meta")
        state = enc.init_state()
        enc.encode_raw(torch.zeros(3, 9, height, width, device="meta", dtype=self.dtype), state)
        return state.nbytes()

    @torch.no_grad()
    def encode_raw(self, video: torch.Tensor, state: EncoderState) -> torch.Tensor:
        """video [3, T, H, W] in [-1, 1] (T = 1 + 4k at a run's start, else 4k) -> the posterior's mean [C, F, h, w]
        (not normalized), in float32; updates state."""
        x = video[None].to(self.device, self.dtype)  # [1, 3, T, H, W]
        first = state.frames_in == 0
        rest = x[:, :, 1 if first else 0 :]
        groups = ([x[:, :, :1]] if first else []) + (list(rest.split(4, dim=2)) if rest.shape[2] else [])
        outs = []
        for g in groups:  # as AutoencoderKLWan._encode: frame 0 alone, then 4 at a time
            idx = [0]
            outs.append(self.vae.encoder(g, feat_cache=state.memory, feat_idx=idx))
        state.frames_in += video.shape[1]
        h = self.vae.quant_conv(torch.cat(outs, dim=2))  # [1, 2C, F, h, w]: mean and log-variance
        return h[0, : h.shape[1] // 2].float()

    @torch.no_grad()
    def encode(self, frames: torch.Tensor, state: EncoderState) -> torch.Tensor:
        """frames [N, H, W, 3] uint8 -> latents [C, F, h, w] float32 (normalized, as the DiT's); updates state."""
        check_frames(frames, frames.shape[1], frames.shape[2])
        n = frames.shape[0]
        if n % 4 == 0 and state.frames_in == 0:  # a run restarted mid-stream: its first latent frame is one frame
            frames = frames[3:]
        elif n % 4 != (1 if state.frames_in == 0 else 0):
            raise ValueError(f"{n} input frames after {state.frames_in}: a causal run takes 1 + 4k frames, then 4k")
        video = frames.to(self.device).permute(3, 0, 1, 2).to(self.dtype).div_(127.5).sub_(1)  # [3, T, H, W]
        mu = self.encode_raw(video, state)
        return (mu - self.mean.to(mu.device)) / self.std.to(mu.device)
