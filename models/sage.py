"""INT8 attention scores, SageAttention-style (the `quantized` tier's `int8-attention`), for the
self-attention of a forward whose queries see every key (no mask: one stream over its KV cache).

The approach (SageAttention, Zhang et al. 2024), written here from the paper's description:
- K is smoothed: its mean over the tokens is subtracted (per stream and head). Every score of a query
  then drops by the same q . mean(k), which softmax does not see, and the channel outliers K carries
  no longer eat the INT8 range.
- Q (with the softmax scale and log2(e) folded in) and the smoothed K are quantized to INT8 with one
  float32 scale per block of tokens and head (BLOCK_M query rows, BLOCK_N key rows); a tile's scores are
  its int32 dot products times its rows' and columns' scales (the tile size is tuned per shape on the GPU).
- The softmax runs online in float32 (base 2), and P . V in bf16 with a float32 accumulator.

`reference` is the same math in torch (the quantization simulated exactly, the products in float32):
CPU runs it and the tests check the Triton kernel against it, and both against bf16 attention.
"""

from __future__ import annotations

import math

import torch

from models import triton_ops

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU machines without triton
    triton = None
    tl = None

LOG2E = 1.4426950408889634
BLOCK_M, BLOCK_N = 128, 64  # query rows and key rows per tile (and per quantization block)


def _blocks(n: int, block: int) -> int:
    return -(-n // block)


def smooth_k(k: torch.Tensor) -> torch.Tensor:
    """k: [B, Lk, H, D] -> its mean over the tokens, [B, 1, H, D] float32."""
    return k.mean(dim=1, keepdim=True, dtype=torch.float32)  # no float32 copy of the keys


def quantize_blocks(x: torch.Tensor, block: int, scale: float = 1.0, mean: torch.Tensor | None = None):
    """x: [B, L, H, D] -> (int8 [B, H, L, D], float32 scales [B, H, ceil(L / block)]) of (x - mean) * scale,
    one scale per `block` tokens of a head: s = amax / 127, q = round(x / s) (ties away from 0)."""
    b, n, nh, d = x.shape
    xf = x.float()
    if mean is not None:
        xf = xf - mean
    xf = (xf * scale).permute(0, 2, 1, 3)  # [B, H, L, D]
    nb = _blocks(n, block)
    pad = nb * block - n
    padded = torch.nn.functional.pad(xf, (0, 0, 0, pad)).view(b, nh, nb, block, d)
    s = padded.abs().amax(dim=(3, 4)).clamp(min=1e-8) / 127.0  # [B, H, nb]
    y = padded / s[..., None, None]
    y = torch.where(y >= 0, torch.floor(y + 0.5), torch.ceil(y - 0.5))  # half away from zero, in float32 as the kernel
    q = y.clamp(-127, 127).to(torch.int8).view(b, nh, nb * block, d)[:, :, :n]
    return q.contiguous(), s


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_m: int = BLOCK_M, block_n: int = BLOCK_N) -> torch.Tensor:
    """q [B, Lq, H, D], k, v [B, Lk, H, D] -> [B, Lq, H, D] in q's dtype: the kernel's math in torch."""
    d = q.shape[-1]
    qi, qs = quantize_blocks(q, block_m, 1.0 / math.sqrt(d) * LOG2E)
    ki, ks = quantize_blocks(k, block_n, 1.0, smooth_k(k))
    lq, lk = q.shape[1], k.shape[1]
    sq = qs.repeat_interleave(block_m, dim=2)[:, :, :lq, None]  # [B, H, Lq, 1]
    sk = ks.repeat_interleave(block_n, dim=2)[:, :, None, :lk]  # [B, H, 1, Lk]
    s = (qi.float() @ ki.float().transpose(-1, -2)) * sq * sk  # scores in base 2
    p = torch.exp2(s - s.amax(dim=-1, keepdim=True))
    denom = p.sum(dim=-1, keepdim=True)
    pv_dtype = v.dtype if v.dtype in (torch.bfloat16, torch.float16) else torch.float32
    out = (p.to(pv_dtype).float() @ v.permute(0, 2, 1, 3).float()) / denom  # P in the PV dtype, as the kernel
    return out.permute(0, 2, 1, 3).to(q.dtype)


def usable(q: torch.Tensor) -> bool:
    """Whether `attend` runs the Triton kernel (CUDA, bf16/fp16, head dim 16..256 and a power of 2)."""
    d = q.shape[-1]
    return triton_ops.AVAILABLE and (q.is_cuda or _interpreting()) and d >= 16 and d & (d - 1) == 0 and d <= 256


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Unmasked attention [B, Lq, H, D] x [B, Lk, H, D] -> [B, Lq, H, D]: the Triton kernel where `usable`, else `reference`."""
    if not usable(q):
        return reference(q, k, v)
    return _attend_triton(q, k, v)


if triton is not None:

    @triton.jit
    def _quant_kernel(
        x_ptr,  # [B, L, H, D] (strides sb, sl, sh; unit stride over D)
        mean_ptr,  # [B, H, D] float32 (HAS_MEAN)
        out_ptr,  # [B, H, L, D] int8
        scale_ptr,  # [B, H, nb] float32
        L, H, nb, sb, sl, sh, mul,
        D: tl.constexpr,
        BLOCK: tl.constexpr,
        HAS_MEAN: tl.constexpr,
    ):
        blk = tl.program_id(0)
        bh = tl.program_id(1)
        bi, hi = bh // H, bh % H
        rows = blk * BLOCK + tl.arange(0, BLOCK)
        cols = tl.arange(0, D)
        m = rows[:, None] < L
        x = tl.load(x_ptr + bi.to(tl.int64) * sb + rows[:, None].to(tl.int64) * sl + hi * sh + cols[None, :], mask=m, other=0.0).to(tl.float32)
        if HAS_MEAN:
            x = x - tl.load(mean_ptr + (bi * H + hi) * D + cols)[None, :]
        x = tl.where(m, x * mul, 0.0)
        s = tl.maximum(tl.max(tl.max(tl.abs(x), axis=1), axis=0), 1e-8) / 127.0
        y = x / s
        y = tl.where(y >= 0, tl.floor(y + 0.5), tl.ceil(y - 0.5))  # round half away from zero
        y = tl.minimum(tl.maximum(y, -127.0), 127.0)
        tl.store(out_ptr + (bh.to(tl.int64) * L + rows[:, None]) * D + cols[None, :], y.to(tl.int8), mask=m)
        tl.store(scale_ptr + bh * nb + blk, s)

    @triton.jit
    def _attn_kernel(
        q_ptr,  # [B, H, Lq, D] int8
        qs_ptr,  # [B, H, nbq] float32: a scale per QM query rows
        k_ptr,  # [B, H, Lk, D] int8
        ks_ptr,  # [B, H, nbk] float32: a scale per QN key rows
        v_ptr,  # [B, Lk, H, D] (strides vb, vl, vh)
        o_ptr,  # [B, Lq, H, D] (strides ob, ol, oh)
        Lq, Lk, H, nbq, nbk, vb, vl, vh, ob, ol, oh,
        D: tl.constexpr,
        QM: tl.constexpr,  # quantization blocks: any tile size works with any of them
        QN: tl.constexpr,
        BM: tl.constexpr,  # tile: query rows x key rows
        BN: tl.constexpr,
    ):
        mb = tl.program_id(0)
        bh = tl.program_id(1)
        bi, hi = bh // H, bh % H
        rows = mb * BM + tl.arange(0, BM)
        rm = rows < Lq
        cols = tl.arange(0, D)
        q = tl.load(q_ptr + (bh.to(tl.int64) * Lq + rows[:, None]) * D + cols[None, :], mask=rm[:, None], other=0)
        q_scale = tl.load(qs_ptr + bh * nbq + rows // QM, mask=rm, other=0.0)  # [BM]
        m_i = tl.full([BM], float("-inf"), tl.float32)
        l_i = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, D], tl.float32)
        k_base = k_ptr + bh.to(tl.int64) * Lk * D
        v_base = v_ptr + bi.to(tl.int64) * vb + hi * vh
        for start in range(0, Lk, BN):
            keys = start + tl.arange(0, BN)
            km = keys < Lk
            k = tl.load(k_base + keys[:, None] * D + cols[None, :], mask=km[:, None], other=0)
            k_scale = tl.load(ks_ptr + bh * nbk + keys // QN, mask=km, other=0.0)  # [BN]
            s = tl.dot(q, tl.trans(k)).to(tl.float32) * q_scale[:, None] * k_scale[None, :]  # [BM, BN], base 2
            s = tl.where(km[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_base + keys[:, None].to(tl.int64) * vl + cols[None, :], mask=km[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(o_ptr + bi.to(tl.int64) * ob + rows[:, None].to(tl.int64) * ol + hi * oh + cols[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=rm[:, None])

    # On the GPU the tile is picked per shape by timing a few (on a forward's first, eager run: models/graphs.py
    # captures only after it, so the timing never lands in a graph).
    _attn_kernel_tuned = triton.autotune(
        configs=[
            triton.Config({"BM": 128, "BN": 64}, num_warps=8, num_stages=3),
            triton.Config({"BM": 128, "BN": 128}, num_warps=8, num_stages=2),
            triton.Config({"BM": 128, "BN": 64}, num_warps=4, num_stages=3),
        ],
        key=["Lq", "Lk", "D"],
    )(_attn_kernel)


def _quantize(x: torch.Tensor, block: int, mul: float, mean: torch.Tensor | None):
    b, n, nh, d = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    nb = _blocks(n, block)
    out = torch.empty(b, nh, n, d, dtype=torch.int8, device=x.device)
    scale = torch.empty(b, nh, nb, dtype=torch.float32, device=x.device)
    mean_arg = mean.reshape(b, nh, d).contiguous() if mean is not None else scale
    _quant_kernel[(nb, b * nh)](x, mean_arg, out, scale, n, nh, nb, x.stride(0), x.stride(1), x.stride(2), mul,
                                D=d, BLOCK=block, HAS_MEAN=mean is not None, num_warps=4)
    return out, scale


def _tiles(d: int, lq: int) -> tuple[int, int]:
    """The quantization blocks (query rows, key rows): the kernel's own tiles' sizes on the GPU, small ones in the
    interpreter (whose tiles are those)."""
    if _interpreting():
        return 16, 16
    return BLOCK_M, BLOCK_N


def quantize_qk(q: torch.Tensor, k: torch.Tensor):
    """The kernel's INT8 operands: (q int8 [B, H, Lq, D], its scales, smoothed k int8 [B, H, Lk, D], its scales)."""
    qm, qn = _tiles(q.shape[-1], q.shape[1])
    qi, qs = _quantize(q, qm, 1.0 / math.sqrt(q.shape[-1]) * LOG2E, None)
    ki, ks = _quantize(k, qn, 1.0, smooth_k(k))
    return qi, qs, ki, ks


def attend_quantized(qi, qs, ki, ks, v: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The attention kernel alone on `quantize_qk`'s operands: out [B, Lq, H, D] <- softmax(Q K^T / sqrt(D)) V."""
    b, nh, lq, d = qi.shape
    lk = ki.shape[2]
    qm, qn = _tiles(d, lq)
    if v.stride(-1) != 1:
        v = v.contiguous()
    args = (qi, qs, ki, ks, v, out, lq, lk, nh, qs.shape[-1], ks.shape[-1],
            v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2))
    if _interpreting():
        _attn_kernel[(_blocks(lq, 16), b * nh)](*args, D=d, QM=qm, QN=qn, BM=16, BN=16, num_warps=4, num_stages=1)
    else:
        _attn_kernel_tuned[lambda meta: (_blocks(lq, meta["BM"]), b * nh)](*args, D=d, QM=qm, QN=qn)
    return out


def _attend_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    return attend_quantized(*quantize_qk(q, k), v, out)
