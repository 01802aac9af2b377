"""What a generator will hold in memory, worked out from its shapes before anything is built.

`estimate` adds up the parts that dominate a served model: the DiT's weights (counted on the meta device, in
the dtype the device runs: fp32 on a CPU, bf16 on a GPU), the text encoder and VAE files of a Wan folder, one
stream's KV cache (`CacheSpec.stream_bytes`, exact), the device's workspace (one stream's cache with room for a
chunk's own K/V, or the dequantization scratch of a quantized cache), and a forward's activations at the
batch the server runs (the block's q/k/v/o and FFN intermediates for the chunk's tokens, and the keys and values
of every visible token after RoPE). The activations are an estimate from the shapes; the rest is exact for
random weights and within the files' size for real ones.

A worked figure: wan2.1-1.3b on a CPU at sink 3 + window 9 and batch 4 holds 5.7 GB of fp32 weights, 12.1 GB of
workspace, 6.9 GB of KV per stream and about 2.3 GB of activations, more than a 24 GB machine has (the server
was killed by the kernel at 23 GB before this check).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from models.config import ModelConfig
from models.stream import GeneratorConfig


@dataclass(frozen=True)
class Footprint:
    """Bytes a generator holds, by part (host memory on a CPU, device memory on a GPU)."""

    weights: int  # the DiT's parameters in the device's dtype
    encoders: int  # a Wan folder's umT5 text encoder and VAE (0 for the built-in ones)
    workspace: int  # the device's shared workspace (or a quantized cache's read scratch)
    activations: int  # one forward's intermediates at the server's batch (an estimate)
    stream_kv: int  # one stream's KV cache

    @property
    def fixed(self) -> int:
        """What the server holds before its first stream."""
        return self.weights + self.encoders + self.workspace + self.activations

    def with_streams(self, n: int) -> int:
        """What it holds with `n` streams open."""
        return self.fixed + n * self.stream_kv


def dit_parameters(mc: ModelConfig) -> int:
    """The DiT's parameter count, from a model built on the meta device (no memory)."""
    from models.dit import CausalWanModel

    with torch.device("meta"):
        return sum(p.numel() for p in CausalWanModel(mc).parameters())


SHAPE_FIELDS = ("dim", "ffn_dim", "num_heads", "num_layers", "text_dim", "text_len", "freq_dim")  # a config.json's


def estimate(preset: str, cfg: GeneratorConfig, device_type: str, batch: int = 1,
             wan_dir: str | None = None, shapes: dict | None = None) -> Footprint:
    """The footprint of `preset` under `cfg` on a device of `device_type` ("cpu" or "cuda") running up to `batch`
    streams a forward, with the encoders of `wan_dir` if given; `shapes`: the DiT's own dimensions where a
    checkpoint's config.json gives them (SHAPE_FIELDS), over the preset's."""
    from kvcache.quant import scratch_bytes

    mc = ModelConfig.from_name(preset, **{k: v for k, v in (shapes or {}).items() if k in SHAPE_FIELDS})
    dtype = torch.float32 if device_type == "cpu" else torch.bfloat16
    itemsize = dtype.itemsize
    spec = mc.cache_spec(sink_frames=cfg.sink_frames, window_frames=cfg.window_frames,
                         dtype=str(dtype).removeprefix("torch."), quant=cfg.kv_quant)
    if cfg.kv_quant == "none":
        workspace = replace(spec, staging_frames=cfg.frames_per_chunk).stream_bytes() if cfg.stage_kv else 0
    else:
        workspace = scratch_bytes(spec)
    tokens = cfg.frames_per_chunk * mc.tokens_per_frame
    visible = (spec.capacity_frames + cfg.frames_per_chunk) * mc.tokens_per_frame
    activations = batch * itemsize * (tokens * (mc.ffn_dim + 4 * mc.dim) + 2 * visible * mc.dim)
    encoders = 0
    if wan_dir is not None:  # the files are bf16; a CPU holds them in fp32
        widen = 2 if device_type == "cpu" else 1
        files = [f for f in Path(wan_dir).rglob("*") if f.is_file() and ("t5" in f.name.lower() or "vae" in
                                                                          f.name.lower() or "text_encoder" in
                                                                          f.parent.name or "vae" in f.parent.name)]
        encoders = widen * sum(f.stat().st_size for f in files if f.suffix in (".pth", ".safetensors", ".bin"))
    return Footprint(weights=dit_parameters(mc) * itemsize, encoders=encoders, workspace=workspace,
                     activations=activations, stream_kv=spec.stream_bytes())
