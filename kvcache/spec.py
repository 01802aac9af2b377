"""What a stream's KV cache holds and how much memory it takes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

QUANT_MODES = ("none", "int4", "int2")
QUANT_BITS = {"int4": 4, "int2": 2}  # bits per code of each quantized mode

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def default_group_size(tokens_per_frame: int, largest: int = 128) -> int:
    """The largest divisor of `tokens_per_frame` that is <= `largest`: 120 for Wan's 1560, 64 for 64."""
    return max(g for g in range(1, min(largest, tokens_per_frame) + 1) if tokens_per_frame % g == 0)


@dataclass(frozen=True)
class CacheSpec:
    """Shape and storage of one stream's self-attention KV cache.

    A cache holds `sink_frames + window_frames` committed latent frames for every layer;
    the chunk being denoised is not part of it. Keys are stored before RoPE.
    """

    num_layers: int  # transformer blocks, each with its own K and V
    num_heads: int  # attention heads per layer
    head_dim: int  # channels per head
    tokens_per_frame: int  # tokens of one latent frame after patchify (1560 for 480x832 Wan)
    sink_frames: int  # first frames of the stream, kept for its whole life
    window_frames: int  # most recent frames, a ring that overwrites its oldest slot
    dtype: str = "bfloat16"  # dtype of reads (and of dense storage): bfloat16 | float32 | float16
    quant: str = "none"  # storage of window frames: none | int4 | int2
    # Quantized storage (kvcache/quant.py): keys per channel in groups of `group_size` consecutive tokens
    # of one frame; values per token in groups of one head's `head_dim` channels.
    group_size: int | None = None  # tokens per key group, divides tokens_per_frame; None: largest divisor <= 128
    residual_frames: int = 3  # newest window frames kept in `dtype` until they are quantized (at most window_frames)
    quantize_sinks: bool = False  # sinks stay in `dtype` unless this is set
    # Dense storage only: frames of room before slot 0 of each layer, in the values and in a copy of
    # the keys kept rotated to their slots' current positions. A forward of one stream writes its own
    # K/V there, so attention reads [own | cached] from the storage in place, and the cached keys are
    # rotated again only after the cache changed (models/dit.py AttentionKV). Costs a key per slot
    # and a key and value per staging frame: 2.4 GiB for Wan2.1-1.3B at sink 3 + window 9, 3 frames.
    staging_frames: int = 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_heads", "head_dim", "tokens_per_frame"):
            if getattr(self, name) <= 0:
                raise ValueError(f"CacheSpec.{name} must be positive, got {getattr(self, name)}")
        if self.sink_frames < 0 or self.window_frames < 0 or self.capacity_frames == 0:
            raise ValueError(
                f"CacheSpec needs sink_frames >= 0, window_frames >= 0 and at least one frame, "
                f"got sink_frames={self.sink_frames}, window_frames={self.window_frames}"
            )
        if self.dtype not in _DTYPES:
            raise ValueError(f"CacheSpec.dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.quant not in QUANT_MODES:
            raise ValueError(f"CacheSpec.quant must be one of {QUANT_MODES}, got {self.quant!r}")
        if self.staging_frames < 0 or (self.staging_frames and self.quant != "none"):
            raise ValueError(f"staging_frames must be >= 0 and needs quant='none', got {self.staging_frames} with {self.quant!r}")
        if self.group_size is None:
            object.__setattr__(self, "group_size", default_group_size(self.tokens_per_frame))
        if self.quant != "none":
            if self.group_size <= 0 or self.tokens_per_frame % self.group_size:
                raise ValueError(
                    f"group_size {self.group_size} must divide tokens_per_frame {self.tokens_per_frame} "
                    f"so that quantization groups align with frames (e.g. {default_group_size(self.tokens_per_frame)})"
                )
            if self.residual_frames < 0:
                raise ValueError(f"residual_frames must be >= 0, got {self.residual_frames}")
            per_byte = 8 // QUANT_BITS[self.quant]
            if self.head_dim % per_byte:
                raise ValueError(
                    f"{self.quant} packs {per_byte} codes per byte within a head: head_dim {self.head_dim} "
                    f"must be a multiple of {per_byte}"
                )

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def capacity_frames(self) -> int:
        return self.sink_frames + self.window_frames

    @property
    def dense_frame_bytes(self) -> int:
        """Bytes of K plus V of one frame, all layers, stored densely in `dtype`."""
        return 2 * self.num_layers * self.tokens_per_frame * self.num_heads * self.head_dim * self.torch_dtype.itemsize

    def stream_bytes(self) -> int:
        """Exact bytes one stream's storage allocates (its tensors, metadata included), computed
        without allocating. It mirrors the allocations of `DenseStorage` (kvcache/storage.py) and
        `QuantStorage` (kvcache/quant.py); `CachePool` checks the two agree on every allocation."""
        if self.quant == "none":
            s = self.staging_frames
            staged = s + (s + self.capacity_frames if s else 0)  # values' staging; rotated keys of staging and slots
            return self.dense_frame_bytes * self.capacity_frames + self.dense_frame_bytes // 2 * staged
        lay = QuantLayout.of(self)
        loc = self.capacity_frames * 2 * 4  # (kind, buffer) int32 of every slot
        dense = self.dense_frame_bytes * lay.dense_frames + self.num_layers * loc
        return dense + lay.quant_frames * quant_frame_bytes(self)


@dataclass(frozen=True)
class QuantLayout:
    """How many dense and quantized frame buffers a stream's quantized storage holds, per layer."""

    bits: int  # 4 or 2
    dense_sinks: int  # sink slots stored densely (slot s -> dense buffer s)
    residual: int  # dense buffers for the newest window frames
    quant_frames: int  # quantized frame buffers (the older window frames, and the sinks if quantized)

    @classmethod
    def of(cls, spec: CacheSpec) -> QuantLayout:
        residual = min(spec.residual_frames, spec.window_frames)
        dense_sinks = 0 if spec.quantize_sinks else spec.sink_frames
        quant = spec.window_frames - residual + (spec.sink_frames if spec.quantize_sinks else 0)
        return cls(QUANT_BITS[spec.quant], dense_sinks, residual, quant)

    @property
    def dense_frames(self) -> int:
        return self.dense_sinks + self.residual


def quant_frame_bytes(spec: CacheSpec, bits: int | None = None) -> int:
    """Bytes of one quantized latent frame, K and V of all layers: codes, scales and zero points
    (layout: kvcache/quant.py)."""
    bits = QUANT_BITS[spec.quant] if bits is None else bits
    t, c, h = spec.tokens_per_frame, spec.num_heads * spec.head_dim, spec.num_heads
    codes = t * c * bits // 8
    key_meta = (t // spec.group_size) * c * (2 + 4)  # bf16 scale + fp32 zero
    value_meta = t * h * (2 + 4)
    return spec.num_layers * (2 * codes + key_meta + value_meta)
