"""One config for the causal DiT and its latent space, with named presets."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace

from kvcache import CacheSpec


@dataclass(frozen=True)
class ModelConfig:
    """Shapes of the causal Wan-style DiT, its latent frames and its built-in decoder."""

    name: str
    dim: int  # transformer width
    ffn_dim: int  # hidden width of each block's MLP
    num_heads: int  # attention heads (head_dim = dim // num_heads)
    num_layers: int  # transformer blocks
    text_dim: int  # width of the text encoder's output
    text_len: int  # text tokens per prompt (padded with zeros, as Wan does)
    latent_height: int  # latent frame height (pixels / 8)
    latent_width: int  # latent frame width (pixels / 8)
    in_channels: int = 16  # latent channels
    out_channels: int = 16
    patch: tuple[int, int, int] = (1, 2, 2)  # (t, h, w) patch of the patch embedding
    freq_dim: int = 256  # sinusoidal timestep embedding width
    eps: float = 1e-6  # norm epsilon
    decoder_channels: int = 64  # width of the built-in streaming decoder
    temporal_upsample: int = 4  # video frames per latent frame (the first latent frame gives 1)
    spatial_upsample: int = 8  # pixels per latent pixel along each axis
    # what the head outputs: "flow" the velocity v = noise - x0 (Wan's DiTs), "sample" the clean latent x0,
    # turned into v = (x - x0) / sigma by the model (the built-in model: its head has fewer outputs per token
    # than a token's latent values, dim 128 against 4 x 4 x 16, so as a flow it cannot reproduce the noise
    # and every step would leave part of it in the frames)
    prediction: str = "flow"

    def __post_init__(self) -> None:
        if self.dim % self.num_heads:
            raise ValueError(f"{self.name}: dim {self.dim} is not divisible by num_heads {self.num_heads}")
        if self.head_dim % 2 or self.head_dim < 6:
            raise ValueError(f"{self.name}: head_dim {self.head_dim} must be even and >= 6 for 3D RoPE")
        if self.prediction not in ("flow", "sample"):
            raise ValueError(f"{self.name}: prediction {self.prediction!r}: use flow or sample")
        if self.patch[0] != 1:
            raise ValueError(f"{self.name}: temporal patch must be 1 for frame-causal caching, got {self.patch}")
        if self.latent_height % self.patch[1] or self.latent_width % self.patch[2]:
            raise ValueError(
                f"{self.name}: latent {self.latent_height}x{self.latent_width} is not divisible by patch {self.patch[1:]}"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def grid(self) -> tuple[int, int]:
        """Token grid (h, w) of one latent frame."""
        return self.latent_height // self.patch[1], self.latent_width // self.patch[2]

    @property
    def tokens_per_frame(self) -> int:
        h, w = self.grid
        return h * w

    @property
    def height(self) -> int:
        return self.latent_height * self.spatial_upsample

    @property
    def width(self) -> int:
        return self.latent_width * self.spatial_upsample

    @property
    def rope_split(self) -> tuple[int, int, int]:
        """Channels of each head given to (time, height, width) RoPE, as in Wan: 44/42/42 at 128."""
        d = self.head_dim
        return d - 4 * (d // 6), 2 * (d // 6), 2 * (d // 6)

    @classmethod
    def from_name(cls, name: str, **overrides) -> ModelConfig:
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
        return replace(PRESETS[name], **overrides)

    def cache_spec(self, **kw) -> CacheSpec:
        """The KV cache of one stream of this model; `kw` sets the frames, dtype and storage."""
        return CacheSpec(
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            tokens_per_frame=self.tokens_per_frame,
            **kw,
        )

    def flops_per_forward(self, query_frames: int, key_frames: int, batch: int = 1) -> float:
        """Matmul FLOPs of one DiT forward: `query_frames` new frames against `key_frames` visible frames
        (cache plus the query frames themselves). Used by benchmarks for TFLOP/s and MFU."""
        lq = query_frames * self.tokens_per_frame
        lk = key_frames * self.tokens_per_frame
        d, f = self.dim, self.ffn_dim
        per_layer = (
            2 * lq * d * d * 4  # self-attn q, k, v, o
            + 4 * lq * lk * d  # self-attn QK^T and PV
            + 2 * lq * d * d * 2  # cross-attn q, o (text K/V are cached per prompt)
            + 4 * lq * self.text_len * d  # cross-attn QK^T and PV
            + 2 * lq * d * f * 2  # ffn
        )
        return float(batch * self.num_layers * per_layer)


PRESETS: dict[str, ModelConfig] = {
    # CPU-fast: 128x128 video, 16 tokens per latent frame; carries 16 streams at 16 fps on 2 cores.
    "tiny": ModelConfig(
        name="tiny",
        dim=64,
        ffn_dim=128,
        num_heads=2,
        num_layers=2,
        text_dim=32,
        text_len=16,
        latent_height=16,
        latent_width=16,
        patch=(1, 4, 4),
        freq_dim=32,
        decoder_channels=16,
    ),
    # Wan2.1-T2V-1.3B: 480x832 video, 30x52 = 1560 tokens per latent frame.
    "wan2.1-1.3b": ModelConfig(
        name="wan2.1-1.3b",
        dim=1536,
        ffn_dim=8960,
        num_heads=12,
        num_layers=30,
        text_dim=4096,
        text_len=512,
        latent_height=60,
        latent_width=104,
        decoder_channels=64,
    ),
    # Wan2.1-T2V-14B: the same latent space, text encoder (umT5-XXL) and VAE, at the 480x832 its causal descendants
    # serve; 40 heads of 128. One latent frame of KV is 2 x 40 layers x 1560 tokens x 5120 x 2 B = 1.19 GiB,
    # so a stream's cache at sink 3 + window 9 is 14.3 GiB (the device's workspace 25 GiB once).
    "wan2.1-14b": ModelConfig(
        name="wan2.1-14b",
        dim=5120,
        ffn_dim=13824,
        num_heads=40,
        num_layers=40,
        text_dim=4096,
        text_len=512,
        latent_height=60,
        latent_width=104,
        decoder_channels=64,
    ),
}


def parse_overrides(text: str) -> dict:
    """"dim=128,prediction=sample" -> {"dim": 128, "prediction": "sample"}, typed as ModelConfig's fields."""
    types = {"int": int, "float": float, "str": str}
    fields = {f.name: types.get(f.type) for f in dataclasses.fields(ModelConfig) if f.name != "name"}
    out = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if fields.get(key) is None:
            raise ValueError(f"model override {item!r}: {key!r} is not a number or word field of ModelConfig")
        out[key] = fields[key](value)
    return out
