"""The causal Wan-style DiT: block-causal over latent frames, K/V cached per stream.

Module names follow Wan2.1's state dict so real checkpoints load (see models/weights.py). Its
elementwise steps (RoPE, the norms, the modulation and residuals) are models/dit_ops.py's. A stream with a
style (`CacheAccess.lora`, models/adapters.py) gets its adapter's low-rank terms at each Linear it names
(`linear`, `sequential`), on its rows only; without any, a forward runs exactly as it would without adapters.
Shapes in comments: B streams, F frames in this forward, T tokens per frame, L = F*T,
H heads, D head dim, C latent channels.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from kvcache import StreamCache
from models import flash, fp8, sage, triton_ops
from models.adapters import AdapterUse, LoraBatch
from models.config import ModelConfig
from models.dit_ops import KERNELS, Rope

# a "sample" model's flow at timestep 0 (a commit, whose flow nobody reads): x0 through the smallest sigma
SAMPLE_MIN_SIGMA = 1e-3


@dataclass
class CacheAccess:
    """How one stream of a forward uses its KV cache (and, with a style, which adapter it runs under)."""

    cache: StreamCache | None  # the stream's cache; None: attend to this forward's frames only
    read_slots: int  # attend to cache slots [0, read_slots) (a prefix: sinks first, then the window)
    write_slots: Sequence[int] | None = None  # after each layer reads, store this forward's K/V here
    block_ids: Sequence[int] | None = None  # per input frame: frames see same-or-earlier blocks; None: all
    # training's [clean | noisy] layout (models/teacher_forcing.py): which of this forward's frames each of them
    # sees ([F, F] bool, overrides block_ids) and each frame's RoPE position (None: after the frames read)
    visible: torch.Tensor | None = None
    positions: Sequence[int] | None = None
    # the storage's rotated keys of [0, read_slots) are current (StreamCache.keys_rotated): read them as
    # they are. Only forwards that read in place (`in_place`) use them; the caller checks and notes.
    keys_rotated: bool = False
    # CUDA graphs (models/graphs.py) pass what differs between replays as fixed device buffers:
    write_index: torch.Tensor | None = None  # [len(write_slots)] int64, the write slots on the device
    key_rope: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin of key_positions(); None: looked up
    # the stream's style (models/adapters.py): its low-rank terms are added to its rows only; None: the base weights
    lora: AdapterUse | None = None

    @property
    def frames_read(self) -> int:
        """Cached frames this forward attends to (0 without a cache)."""
        return self.read_slots if self.cache is not None else 0

    @property
    def spans_blocks(self) -> bool:
        """Whether some input frame must not see another: they belong to several blocks (each sees its
        own and earlier ones), or `visible` says who sees whom."""
        return self.visible is not None or (self.block_ids is not None and len(set(self.block_ids)) > 1)

    def frame_mask(self) -> torch.Tensor:
        """[F, F] bool: which input frames each input frame sees (for a forward that `spans_blocks`)."""
        if self.visible is not None:
            return self.visible
        ids = torch.as_tensor(list(self.block_ids))
        return ids[None, :] <= ids[:, None]

    def query_positions(self, num_frames: int) -> list[int]:
        """Input frames sit right after the frames they read: [read | input], unless `positions` says."""
        if self.positions is not None:
            return list(self.positions)
        return list(range(self.read_slots, self.read_slots + num_frames))

    def key_positions(self) -> list[int]:
        return self.cache.positions(self.read_slots) if self.cache is not None and self.read_slots else []


def needs_mask(access: Sequence[CacheAccess]) -> bool:
    """Whether some query must not see some key: streams read unequal cache prefixes, or a
    forward spans several blocks (a recache's frames, each seeing its own block and earlier)."""
    return len({acc.frames_read for acc in access}) > 1 or any(acc.spans_blocks for acc in access)


def in_place(access: Sequence[CacheAccess], num_frames: int) -> bool:
    """Whether a forward of `num_frames` frames reads its cache in place (AttentionKV's staged
    layout): one stream that sees every key, over storage with staging room for its frames."""
    cache = access[0].cache if len(access) == 1 else None
    return cache is not None and not needs_mask(access) and cache.storage.staging_frames >= num_frames


# Per layer: text keys and values of the cross-attention, each [B, text_len, H, D].
TextKV = list[tuple[torch.Tensor, torch.Tensor]]


class SequenceSplit(Protocol):
    """One forward split over the ranks of a group by tokens (models/parallel.py's Ulysses). Each rank
    holds the same T/size tokens of every frame, so per-frame modulation applies to its shard as it is;
    everything but self-attention runs on the shard."""

    size: int  # ranks in the group; divides the heads and the tokens of a frame

    def shard(self, p: torch.Tensor) -> torch.Tensor:
        """[B, F, T, X] -> this rank's tokens of each frame, [B, F, T/size, X]."""

    def gather(self, p: torch.Tensor) -> torch.Tensor:
        """[B, F, T/size, X] on every rank -> all of them, [B, F, T, X] (on every rank)."""

    def self_attention(self, model: CausalWanModel, ops, layer: int, attn: SelfAttention, x: torch.Tensor,
                       kv: AttentionKV, rope, mask: torch.Tensor | None) -> torch.Tensor:
        """`CausalWanModel._self_attention` for the shard's tokens x [B, n, dim] -> [B, n, dim];
        kv holds this rank's heads of the cache."""


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return KERNELS.rms_norm(x, self.weight, self.eps)


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.q = nn.Linear(cfg.dim, cfg.dim)
        self.k = nn.Linear(cfg.dim, cfg.dim)
        self.v = nn.Linear(cfg.dim, cfg.dim)
        self.o = nn.Linear(cfg.dim, cfg.dim)
        self.norm_q = RMSNorm(cfg.dim, cfg.eps)
        self.norm_k = RMSNorm(cfg.dim, cfg.eps)


class CrossAttention(SelfAttention):
    def text_kv(self, context: torch.Tensor, lora: LoraBatch | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        # context: [B, text_len, dim] -> k, v: [B, text_len, H, D]
        b, n = context.shape[:2]
        k = self.norm_k(linear(self.k, context, lora)).view(b, n, self.num_heads, self.head_dim)
        v = linear(self.v, context, lora).view(b, n, self.num_heads, self.head_dim)
        return k, v

    def forward(self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        b, n = x.shape[:2]
        q = self.norm_q(linear(self.q, x, lora)).view(b, n, self.num_heads, self.head_dim)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return linear(self.o, out.transpose(1, 2).reshape(b, n, -1), lora)


class Block(nn.Module):
    """Wan's block. Its norm1 and norm2 have no weights: `adaln` does them, fused with the modulation.
    The forward lives in `CausalWanModel._block`, which fuses each residual with the next norm."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = SelfAttention(cfg)
        self.norm3 = nn.LayerNorm(cfg.dim, eps=cfg.eps)  # weights only: `residual_norm` applies it
        self.cross_attn = CrossAttention(cfg)
        self.ffn = nn.Sequential(nn.Linear(cfg.dim, cfg.ffn_dim), nn.GELU(approximate="tanh"), nn.Linear(cfg.ffn_dim, cfg.dim))
        self.modulation = nn.Parameter(torch.randn(1, 6, cfg.dim) / cfg.dim**0.5)


class Head(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head = nn.Linear(cfg.dim, cfg.out_channels * math.prod(cfg.patch))
        self.modulation = nn.Parameter(torch.randn(1, 2, cfg.dim) / cfg.dim**0.5)


def linear(lin: nn.Module, x: torch.Tensor, lora: LoraBatch | None) -> torch.Tensor:
    """lin(x) [B, ..., out], with the low-rank terms of the streams whose style adapts `lin` added to their rows."""
    out = lin(x)
    return out if lora is None else lora.add(lin, x, out)


def sequential(seq: nn.Sequential, x: torch.Tensor, lora: LoraBatch | None, streams: int) -> torch.Tensor:
    """seq(x), each Linear's output with the streams' low-rank terms (x's rows: `streams` equal groups, in order)."""
    if lora is None:
        return seq(x)
    for m in seq:  # as nn.Sequential runs them
        y = m(x)
        if isinstance(m, (nn.Linear, fp8.FP8Linear)):
            lora.add(m, x.view(streams, -1, x.shape[-1]), y.view(streams, -1, y.shape[-1]))
        x = y
    return x


def feed_forward(ffn: nn.Sequential, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
    """Wan's FFN (Linear, tanh-GELU, Linear); on CUDA the GELU runs in the first GEMM's epilogue (cuBLASLt).
    With styles, each Linear on its own (the terms go in before the GELU)."""
    fc1, _, fc2 = ffn
    if lora is not None:
        return sequential(ffn, x, lora, x.shape[0])
    if isinstance(fc1, fp8.FP8Linear):  # FP8 GEMMs; the GELU goes with the hidden activation's quantization
        xq, xs = fp8.OPS.quantize_rows(x.reshape(-1, x.shape[-1]))
        hq, hs = fp8.OPS.gelu_quantize_rows(fc1.gemm(xq, xs, x.dtype))
        return fc2.gemm(hq, hs, x.dtype).view(*x.shape[:-1], -1)
    if not x.is_cuda or torch.is_grad_enabled():
        return ffn(x)
    y = torch._addmm_activation(fc1.bias, x.flatten(0, -2), fc1.weight.t(), use_gelu=True)
    return fc2(y).view(*x.shape[:-1], -1)


def sinusoidal_embedding(dim: int, t: torch.Tensor) -> torch.Tensor:
    # t: [N] timesteps in [0, 1000] -> [N, dim] (cos | sin), computed in float64 as Wan does
    half = dim // 2
    freqs = torch.pow(10000.0, -torch.arange(half, dtype=torch.float64, device=t.device) / half)
    arg = torch.outer(t.to(torch.float64), freqs)
    return torch.cat([torch.cos(arg), torch.sin(arg)], dim=1)


def attention_backends():
    """Prefer cuDNN attention on CUDA (1.6x flash's speed at our shapes on the H200)."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:  # pragma: no cover - old torch
        return contextlib.nullcontext()
    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    try:
        return sdpa_kernel(order, set_priority=True)
    except TypeError:  # pragma: no cover - torch without set_priority
        return contextlib.nullcontext()


class AttentionKV:
    """One forward's self-attention keys and values, per layer [B, Lk, H, D]: for each stream its
    cached frames (keys rotated to their cache positions) then this forward's, zero-padded to
    the longest stream (the mask hides the padding). `buffers` fills the cached part; the
    layer then writes its own keys and values straight into their place (`own_at`): no
    concatenation.

    In place (`in_place`: one stream, no mask, storage with staging): the order is [own | cached]
    (attention without a mask does not care) and both are the storage's staged tensors. The
    values are the stored ones, never copied; the keys are the storage's rotated copy, rotated
    again only when the cache changed since (`CacheAccess.keys_rotated`): within a chunk the
    denoising steps and the commit read the same cache at the same positions."""

    def __init__(self, model: CausalWanModel, access: Sequence[CacheAccess], rope, n_tokens: int, ops,
                 heads: int | None = None) -> None:
        cfg = model.cfg
        self.access, self.rope, self.ops = access, rope, ops
        self.reads = [acc.frames_read * cfg.tokens_per_frame for acc in access]  # tokens
        self.n_tokens, self.n_frames = n_tokens, n_tokens // cfg.tokens_per_frame
        # heads: the model's, or one rank's share of them in a sequence-parallel forward (its cache's)
        self.shape = (len(access), max(self.reads) + n_tokens, heads or cfg.num_heads, cfg.head_dim)
        self.dtype, self.device = model.dtype, model.device
        self.staged = in_place(access, self.n_frames)
        # training's layout: one access for every sample, no cache: attention runs on the batch at once
        self.shared = access[0].cache is None and all(acc is access[0] for acc in access)
        self.own_at = [0] if self.staged else self.reads  # where each stream's own keys and values go

    def buffers(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        nh, hd = self.shape[2:]
        n = self.n_tokens
        if self.staged:
            acc = self.access[0]
            k, v = (t.view(self.shape) for t in acc.cache.storage.staged(layer, self.n_frames, acc.read_slots))
            if self.reads[0] and not acc.keys_rotated:
                self._rotate(0, acc.cache.read(layer, acc.read_slots)[0], k[0, n:])
            return k, v
        k = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        v = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        for j, acc in enumerate(self.access):
            r = self.reads[j]  # [cached | own] fills [0, r + n)
            if r:
                kc, vc = acc.cache.read(layer, acc.read_slots)  # once: quantized storage dequantizes on read
                self._rotate(j, kc, k[j, :r])
                v[j, :r].copy_(vc.reshape(-1, nh, hd))
            if r + n < self.shape[1]:  # padding: masked out, but must hold finite values
                k[j, r + n :].zero_()
                v[j, r + n :].zero_()
        return k, v

    def _rotate(self, j: int, kc: torch.Tensor, out: torch.Tensor) -> None:
        """out <- stream j's cached keys kc ([S, T, H, D], stored before RoPE) rotated to their cache positions."""
        _, (c_cos, c_sin) = self.rope[j]
        self.ops.rope_into(kc.reshape(-1, *self.shape[2:]), c_cos, c_sin, out)


class CausalWanModel(nn.Module):
    """Wan2.1's DiT made block-causal over latent frames with per-frame timesteps."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embedding = nn.Conv3d(cfg.in_channels, cfg.dim, kernel_size=cfg.patch, stride=cfg.patch)
        self.text_embedding = nn.Sequential(nn.Linear(cfg.text_dim, cfg.dim), nn.GELU(approximate="tanh"), nn.Linear(cfg.dim, cfg.dim))
        self.time_embedding = nn.Sequential(nn.Linear(cfg.freq_dim, cfg.dim), nn.SiLU(), nn.Linear(cfg.dim, cfg.dim))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(cfg.dim, cfg.dim * 6))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.head = Head(cfg)
        self.rope = Rope(cfg)
        # the unmasked self-attention's math: "none" (bf16, FA4 or SDPA) or "int8" (models/sage.py; the
        # quantized tier's int8-attention). Linears swapped for FP8 ones by models/fp8.py run that way.
        self.attention_quant = "none"

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embedding.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.patch_embedding.weight.device

    def init_weights(self, seed: int) -> CausalWanModel:
        """Random weights from `seed` (Xavier linears, small embeddings), the same on any device."""
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("modulation"):
                new = torch.randn(p.shape, generator=gen) / self.cfg.dim**0.5
            elif p.ndim == 1:
                new = torch.ones(p.shape) if "norm" in name else torch.zeros(p.shape)
            else:
                fan_out, fan_in = p.shape[0], math.prod(p.shape[1:])
                bound = math.sqrt(6.0 / (fan_in + fan_out))
                new = (torch.rand(p.shape, generator=gen) * 2 - 1) * bound
            with torch.no_grad():
                p.copy_(new)
        return self

    # -- text ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def text_kv(self, context: torch.Tensor, lora: AdapterUse | None = None) -> TextKV:
        """Cross-attention K/V of a prompt, computed once per prompt (and style): context [1, text_len, text_dim]
        (or [B, ...] without a style)."""
        return self.project_text(context, lora)

    def project_text(self, context: torch.Tensor, lora: AdapterUse | None = None) -> TextKV:
        """`text_kv`, differentiable (training runs it)."""
        batch = LoraBatch.of([lora] * context.shape[0])
        ctx = sequential(self.text_embedding, context.to(self.device, self.dtype), batch, context.shape[0])
        return [blk.cross_attn.text_kv(ctx, batch) for blk in self.blocks]

    # -- forward ------------------------------------------------------------------------------

    @torch.inference_mode()  # serving: no autograd state anywhere
    def forward(self, x: torch.Tensor, t: torch.Tensor, text: TextKV, access: Sequence[CacheAccess]) -> torch.Tensor:
        """Predict the flow v for `x`.

        x: [B, C, F, Hl, Wl] latents; t: [B, F] timesteps in [0, 1000]; text: per-layer text K/V
        with batch B, or B*F (a prompt per frame, as training's layout wants); access: per stream,
        which cache prefix to read and where to write. Returns v: [B, C, F, Hl, Wl] in float32.
        """
        return self.predict_flow(x, t, text, access)

    def predict_flow(self, x: torch.Tensor, t: torch.Tensor, text: TextKV, access: Sequence[CacheAccess],
                     split: SequenceSplit | None = None) -> torch.Tensor:
        """`forward`, differentiable when autograd is on (training runs it; the fused kernels then step aside).
        With `split` (models/parallel.py), this rank's share of a forward split over a group: every rank
        passes the same x, t and text, holds its heads of each cache, and gets the whole v."""
        cfg = self.cfg
        b, _, nf = x.shape[:3]
        if len(access) != b or t.shape != (b, nf):
            raise ValueError(f"batch mismatch: x {tuple(x.shape)}, t {tuple(t.shape)}, {len(access)} cache accesses")
        lora = LoraBatch.of([acc.lora for acc in access])  # None: no stream has a style
        if lora is not None and split is not None:
            raise ValueError("styles (LoRA adapters) do not run in a forward split over a group")
        tpf = cfg.tokens_per_frame
        parts = split.size if split is not None else 1
        tpl = tpf // parts  # tokens of each frame this rank holds

        h = self._patchify(x, split)  # [B, F*tpl, dim] float32, contiguous
        e = sequential(self.time_embedding, sinusoidal_embedding(cfg.freq_dim, t.flatten()).to(self.dtype), lora, b).float()  # [B*F, dim]
        e0 = sequential(self.time_projection, e.to(self.dtype), lora, b).float().view(b, nf, 1, 6, cfg.dim)  # [B, F, 1, 6, dim]
        # per block: shift, scale, gate (self-attention), shift, scale, gate (FFN), each [B, F, 1, dim]
        # all blocks' in one add (two kernels, not two per block): [layers, B, F, 1, 6, dim]
        mod = torch.stack([blk.modulation for blk in self.blocks]).float().view(-1, 1, 1, 1, 6, cfg.dim) + e0
        mods = [m.unbind(3) for m in mod]
        head = (self.head.modulation.float().view(1, 1, 1, 2, cfg.dim) + e.view(b, nf, 1, 1, cfg.dim)).unbind(3)
        rope = self._rope_tables(access, nf)
        mask = self._attention_mask(access, nf, x.device)

        # Each step adds a residual and normalizes for the next in one pass: a block hands on the
        # residual h [B, F, T, dim] float32 and the next block's (or the head's) modulated input y.
        h = h.view(b, nf, tpl, cfg.dim)
        y = KERNELS.adaln(h, mods[0][0], mods[0][1], cfg.eps, self.dtype)
        ops = triton_ops if x.is_cuda and triton_ops.AVAILABLE and not torch.is_grad_enabled() else KERNELS
        kv = AttentionKV(self, access, rope, nf * tpf, ops, heads=cfg.num_heads // parts)
        with attention_backends():
            for i, blk in enumerate(self.blocks):
                shift, scale = mods[i + 1][:2] if i + 1 < len(self.blocks) else head
                h, y = self._block(ops, i, blk, h, y, mods[i], text[i], shift, scale, kv, rope, mask, split, lora)

        out = linear(self.head.head, y, lora).float()  # [B, F, tpl, C*pt*ph*pw]
        if split is not None:
            out = split.gather(out)
        out = self._unpatchify(out.view(b, nf * tpf, -1), nf)
        if cfg.prediction == "sample":  # the head gave x0: the flow that leads from x to it
            sigma = (t.float() / 1000).clamp_min(SAMPLE_MIN_SIGMA).view(b, 1, nf, 1, 1)
            out = (x.float() - out) / sigma
        return out

    def _block(self, ops, i, blk: Block, h, y, mod, text_kv, next_shift, next_scale, kv, rope, mask, split=None, lora=None):
        """h: residual [B, F, T, dim] float32 (T: the rank's tokens of a frame with `split`); y: this block's
        modulated input -> (h, the next block's y). `ops`: the fused kernels (models/triton_ops.py on CUDA,
        else the torch references). `lora`: the streams' styles (never with `split`)."""
        eps, dt = self.cfg.eps, self.dtype
        b, nf, tpf, dim = h.shape
        if split is None:
            a = self._self_attention(ops, i, blk.self_attn, y.view(b, nf * tpf, dim), kv, rope, mask, lora).view_as(h)
        else:
            a = split.self_attention(self, ops, i, blk.self_attn, y.view(b, nf * tpf, dim), kv, rope, mask).view_as(h)
        h, y = ops.residual_norm(h, a, mod[2], blk.norm3.weight, blk.norm3.bias, eps, dt)
        rows = text_kv[0].shape[0]  # B, or B*F: a prompt per frame
        a = blk.cross_attn(y.view(rows, -1, dim), *text_kv, lora).view_as(h)
        h, y = ops.residual_adaln(h, a, None, mod[3], mod[4], eps, dt)
        a = feed_forward(blk.ffn, y, lora)
        return ops.residual_adaln(h, a, mod[5], next_shift, next_scale, eps, dt)

    @staticmethod
    def project_qkv(attn: SelfAttention, x: torch.Tensor, lora: LoraBatch | None = None):
        """x [B, L, dim] -> q, k [B, L, H, D] before the qk norm, and v [B, L, H, D] when the FP8 path made it
        with them (else None: the caller's GEMM writes it where it goes), the streams' styles added."""
        b, n = x.shape[:2]
        nh, hd = attn.num_heads, attn.head_dim
        if isinstance(attn.q, fp8.FP8Linear):  # x quantized once for the three FP8 GEMMs
            xq, xs = fp8.OPS.quantize_rows(x.reshape(b * n, -1))
            q, k, v = (lin.gemm(xq, xs, x.dtype) for lin in (attn.q, attn.k, attn.v))
            if lora is not None:
                q, k, v = (lora.add(lin, x, y.view(b, n, -1)) for lin, y in zip((attn.q, attn.k, attn.v), (q, k, v)))
            return q.view(b, n, nh, hd), k.view(b, n, nh, hd), v.view(b, n, nh, hd)
        return linear(attn.q, x, lora).view(b, n, nh, hd), linear(attn.k, x, lora).view(b, n, nh, hd), None

    def _self_attention(self, ops, layer, attn: SelfAttention, x, kv: AttentionKV, rope, mask, lora=None) -> torch.Tensor:
        b, n = x.shape[:2]
        hd, nh, eps, tpf = attn.head_dim, attn.num_heads, self.cfg.eps, self.cfg.tokens_per_frame
        q, k, v_all = self.project_qkv(attn, x, lora)
        if kv.shared:  # no cache, the same positions and mask for every sample: no loop over the batch
            (cos, sin), _ = rope[0]
            qs = KERNELS.norm_rope(q, attn.norm_q.weight, eps, cos, sin).transpose(1, 2)
            ks = KERNELS.norm_rope(k, attn.norm_k.weight, eps, cos, sin).transpose(1, 2)
            vs = (v_all if v_all is not None else linear(attn.v, x, lora).view(b, n, nh, hd)).transpose(1, 2)
            out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask).transpose(1, 2)
            return linear(attn.o, out.reshape(b, n, -1), lora)
        keys, values = kv.buffers(layer)  # [B, Lk, H, D], the cached part filled
        qs = torch.empty_like(q)
        writes = []  # (access, K normalized before RoPE, V), stored once attention has read the cache
        for j, acc in enumerate(kv.access):
            (q_cos, q_sin), _ = rope[j]
            r = kv.own_at[j]
            ops.norm_rope_into(q[j], attn.norm_q.weight, eps, q_cos, q_sin, qs[j])
            kn = torch.empty_like(k[j]) if acc.write_slots is not None else None
            ops.norm_rope_into(k[j], attn.norm_k.weight, eps, q_cos, q_sin, keys[j, r : r + n], kn)
            if v_all is not None:
                vj = values[j, r : r + n].copy_(v_all[j])
            elif torch.is_grad_enabled():  # autograd has no GEMM into place
                vj = values[j, r : r + n].copy_(attn.v(x[j]).view(n, nh, hd))
            else:
                vj = torch.addmm(attn.v.bias, x[j], attn.v.weight.t(), out=values[j, r : r + n].view(n, -1))  # V GEMM into place
            if lora is not None and v_all is None:
                lora.add_stream(j, attn.v, x[j], vj.view(n, -1))
            if kn is not None:
                writes.append((acc, kn.view(-1, tpf, nh, hd), vj.view(-1, tpf, nh, hd)))
        return linear(attn.o, self.attend(layer, qs, keys, values, mask, writes).reshape(b, n, -1), lora)

    def attend(self, layer: int, qs, keys, values, mask, writes) -> torch.Tensor:
        """Self-attention of queries qs [B, L, H, D] (normalized, rotated) over keys and values [B, Lk, H, D],
        then the cache writes: (access, keys before RoPE, values) each [frames, T, H, D]. -> [B, L, H, D]."""
        if mask is None and self.attention_quant == "int8":
            out = sage.attend(qs, keys, values)  # [B, L, H, D]
        elif mask is None and flash.usable(qs):
            out = flash.attend(qs, keys, values)  # [B, L, H, D]
        else:
            out = F.scaled_dot_product_attention(qs.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask).transpose(1, 2)
        for acc, kn, vj in writes:  # staged values are the cache itself: a write before would overwrite what is read
            acc.cache.write(layer, acc.write_slots, kn, vj, index=acc.write_index)
        return out

    def _rope_tables(self, access: Sequence[CacheAccess], nf: int):
        dev = self.device
        return [(self.rope.table(acc.query_positions(nf), dev), self.key_rope(acc)) for acc in access]

    def key_rope(self, acc: CacheAccess) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """cos, sin of the cached keys' positions ([read_slots * T, 1, D] each); (None, None) without any."""
        if not acc.read_slots:
            return None, None
        return acc.key_rope if acc.key_rope is not None else self.rope.table(acc.key_positions(), self.device)

    def _attention_mask(self, access: Sequence[CacheAccess], nf: int, device) -> torch.Tensor | None:
        """Boolean [B, 1, Lq, Lk] (True: attend), or None when every query sees every key."""
        if not needs_mask(access):
            return None
        tpf = self.cfg.tokens_per_frame
        if len(access) > 1 and all(acc is access[0] for acc in access):  # one mask, broadcast over the batch
            return self._attention_mask(access[:1], nf, device)
        reads = [acc.frames_read for acc in access]
        lk = (max(reads) + nf) * tpf
        mask = torch.zeros(len(access), 1, nf * tpf, lk, dtype=torch.bool)
        for j, acc in enumerate(access):
            c = reads[j] * tpf
            mask[j, :, :, :c] = True
            if acc.spans_blocks:
                frame_ok = acc.frame_mask().cpu()  # [Fq, Fk]
                mask[j, :, :, c : c + nf * tpf] = frame_ok.repeat_interleave(tpf, 0).repeat_interleave(tpf, 1)
            else:
                mask[j, :, :, c : c + nf * tpf] = True
        return mask.to(device)

    def _patchify(self, x: torch.Tensor, split: SequenceSplit | None = None) -> torch.Tensor:
        # x: [B, C, F*pt, h*ph, w*pw] -> tokens [B, F*h*w, dim] float32 (with `split`: the rank's, [B, F*h*w/size,
        # dim]). The patch embedding is a Conv3d with stride == kernel, i.e. one GEMM over flattened patches
        # (faster than a conv, and it avoids torch 2.11's wrong bf16 Conv3d on CPU).
        cfg = self.cfg
        b, c = x.shape[:2]
        (pt, ph, pw), conv = cfg.patch, self.patch_embedding
        nf, gh, gw = x.shape[2] // pt, x.shape[3] // ph, x.shape[4] // pw
        p = x.to(self.dtype).view(b, c, nf, pt, gh, ph, gw, pw).permute(0, 2, 4, 6, 1, 3, 5, 7).reshape(b, nf, gh * gw, -1)
        if split is not None:
            p = split.shard(p)
        return F.linear(p.reshape(b, -1, p.shape[-1]), conv.weight.flatten(1), conv.bias).float()

    def _unpatchify(self, out: torch.Tensor, nf: int) -> torch.Tensor:
        # out: [B, F*h*w, C*pt*ph*pw] -> [B, C, F*pt, h*ph, w*pw]
        cfg = self.cfg
        b = out.shape[0]
        (gh, gw), (pt, ph, pw) = cfg.grid, cfg.patch
        x = out.view(b, nf, gh, gw, pt, ph, pw, cfg.out_channels)
        x = torch.einsum("bfhwpqrc->bcfphqwr", x)
        return x.reshape(b, cfg.out_channels, nf * pt, gh * ph, gw * pw)

