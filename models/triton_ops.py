"""Fused Triton kernels for the DiT's memory-bound steps, with the same signatures as the torch
references in models/dit_ops.py (which CPU runs and the tests use as ground truth).

- `residual_norm` / `residual_adaln`: add a (gated) residual branch to the float32 stream h in
  place and write the next LayerNorm of it (affine, or adaLN-modulated) in the model dtype:
  one pass over h instead of the three kernels torch.compile makes of it.
- `norm_rope_into`: qk-RMSNorm over the row, then RoPE's pairwise rotation, in one pass, written
  into a slice of the attention's query or key buffer (and, for keys, the normalized rows the
  cache stores).
- `rope_into`: cached keys rotated to their cache positions, into the head of the key buffer.
- `merge_parts`: attention over all keys from its outputs over two parts of them and their
  log-sum-exps (models/flash.py splits the keys where that fills the GPU's waves of tiles better).

The roundings follow the references (RMSNorm rounds to the model dtype before its weight, as
Wan's does), so results match them to within one rounding of the model dtype.

Import-guarded like kvcache/triton_quant.py: without triton `AVAILABLE` is False. CUDA tensors
run compiled kernels; with TRITON_INTERPRET=1 set before triton is imported, CPU tensors run
in Triton's interpreter, which is how the CPU tests check these kernels.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU machines without triton
    triton = None
    tl = None

AVAILABLE = triton is not None


def _block(n: int) -> int:
    return 1 << (n - 1).bit_length()


if AVAILABLE:

    @triton.jit
    def _add_norm_kernel(
        h_ptr,  # [R, N] float32 residual, updated in place
        y_ptr,  # [R, N] branch output (model dtype)
        gate_ptr,  # [G, N] (row stride gate_stride) or unused
        a_ptr,  # MODULATE: shift [G, N]; else LayerNorm weight [N]
        b_ptr,  # MODULATE: scale [G, N]; else LayerNorm bias [N]
        out_ptr,  # [R, N] model dtype
        rows_per_group,  # rows sharing one gate / modulation row (tokens per frame)
        gate_stride,
        mod_stride,
        N,
        eps,
        HAS_GATE: tl.constexpr,
        MODULATE: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        grp = row // rows_per_group
        cols = tl.arange(0, BLOCK)
        m = cols < N
        h = tl.load(h_ptr + row * N + cols, mask=m, other=0.0)
        y = tl.load(y_ptr + row * N + cols, mask=m, other=0.0).to(tl.float32)
        if HAS_GATE:
            h = h + y * tl.load(gate_ptr + grp * gate_stride + cols, mask=m, other=0.0)
        else:
            h = h + y
        tl.store(h_ptr + row * N + cols, h, mask=m)
        mean = tl.sum(h, axis=0) / N
        d = tl.where(m, h - mean, 0.0)
        n = d * tl.rsqrt(tl.sum(d * d, axis=0) / N + eps)
        if MODULATE:
            shift = tl.load(a_ptr + grp * mod_stride + cols, mask=m, other=0.0)
            scale = tl.load(b_ptr + grp * mod_stride + cols, mask=m, other=0.0)
            o = n * (1 + scale) + shift
        else:
            w = tl.load(a_ptr + cols, mask=m, other=0.0).to(tl.float32)
            b = tl.load(b_ptr + cols, mask=m, other=0.0).to(tl.float32)
            o = n * w + b
        tl.store(out_ptr + row * N + cols, o.to(out_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _norm_rope_kernel(
        x_ptr,  # [R, N] rows (row stride x_stride), N = heads * head_dim
        w_ptr,  # [N] RMSNorm weight
        cos_ptr,  # [R, D] float32: each pair's angle repeated
        sin_ptr,  # [R, D] float32: sin signed (-, +) per pair
        out_ptr,  # [R, N] rotated (row stride N)
        normed_ptr,  # [R, N] normalized, not rotated (WRITE_NORMED)
        R,
        x_stride,
        eps,
        H: tl.constexpr,
        HP: tl.constexpr,  # H rounded up to a power of 2
        D: tl.constexpr,
        NORM: tl.constexpr,
        WRITE_NORMED: tl.constexpr,
        ROWS: tl.constexpr,
    ):
        # a block of ROWS rows as [ROWS, H, D/2, 2]: the last axis holds each RoPE pair
        N: tl.constexpr = H * D
        dt = out_ptr.dtype.element_ty
        r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        r3 = r[:, None, None]
        head = tl.arange(0, HP)[None, :, None]
        off = head * D + tl.arange(0, D)[None, None, :]  # [1, HP, D]
        m = (r3 < R) & (head < H)
        x = tl.load(x_ptr + r3 * x_stride + off, mask=m, other=0.0).to(tl.float32)  # [ROWS, HP, D]
        if NORM:
            rstd = tl.rsqrt(tl.sum(tl.sum(x * x, axis=2), axis=1) / N + eps)[:, None, None]
            w = tl.load(w_ptr + off, mask=head < H, other=0.0).to(tl.float32)
            x = ((x * rstd).to(dt).to(tl.float32) * w).to(dt).to(tl.float32)
            if WRITE_NORMED:
                tl.store(normed_ptr + r3 * N + off, x.to(dt), mask=m)
        toff = r[:, None] * D + tl.arange(0, D)[None, :]  # [ROWS, D]
        c = tl.load(cos_ptr + toff, mask=r[:, None] < R, other=0.0)[:, None, :]
        s = tl.load(sin_ptr + toff, mask=r[:, None] < R, other=0.0)[:, None, :]
        even, odd = tl.split(tl.reshape(x, (ROWS, HP, D // 2, 2)))
        swapped = tl.reshape(tl.join(odd, even), (ROWS, HP, D))  # (x[2i+1], x[2i])
        tl.store(out_ptr + r3 * N + off, (x * c + swapped * s).to(dt), mask=m)


    @triton.jit
    def _merge_parts_kernel(
        o_ptr,  # [2, Lq, H, D]: attention of the same queries over two parts of the keys
        lse_ptr,  # [2, H, Lq] float32: their log-sum-exps
        out_ptr,  # [Lq, H, D]
        R,  # Lq * H rows of D
        Lq,
        H: tl.constexpr,
        D: tl.constexpr,
        ROWS: tl.constexpr,
    ):
        r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        m = r < R
        q, h = r // H, r % H
        l1 = tl.load(lse_ptr + h * Lq + q, mask=m, other=0.0)
        l2 = tl.load(lse_ptr + (H + h) * Lq + q, mask=m, other=0.0)
        top = tl.maximum(l1, l2)
        w1, w2 = tl.exp(l1 - top), tl.exp(l2 - top)
        inv = 1.0 / (w1 + w2)
        off = r[:, None] * D + tl.arange(0, D)[None, :]
        o1 = tl.load(o_ptr + off, mask=m[:, None], other=0.0).to(tl.float32)
        o2 = tl.load(o_ptr + R * D + off, mask=m[:, None], other=0.0).to(tl.float32)
        out = o1 * (w1 * inv)[:, None] + o2 * (w2 * inv)[:, None]
        tl.store(out_ptr + off, out.to(out_ptr.dtype.element_ty), mask=m[:, None])


# rows per program and warps of the RoPE kernel (tuned on the H200 at Wan's shapes; any value is correct)
ROPE_ROWS, ROPE_WARPS = 4, 4


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """`t` as [G, n] rows with unit column stride (a view: modulation rows are strided)."""
    r = t.reshape(-1, n)
    return r if r.stride(1) == 1 else r.contiguous()


def _add_norm(h, y, gate, a, b, eps: float, dtype: torch.dtype, modulate: bool):
    n = h.shape[-1]
    if not h.is_contiguous() or not y.is_contiguous() or h.dtype != torch.float32:
        raise ValueError("residual kernels need a contiguous float32 h and a contiguous branch output")
    rows = h.numel() // n
    rows_per_group = h.shape[-2]  # h: [B, F, T, dim]; gate / modulation: [B, F, 1, dim]
    out = torch.empty(h.shape, dtype=dtype, device=h.device)
    g = _rows(gate, n) if gate is not None else h
    if modulate:
        a, b = _rows(a, n), _rows(b, n)
    _add_norm_kernel[(rows,)](
        h, y, g, a, b, out, rows_per_group, g.stride(0), a.stride(0) if modulate else 0, n, eps,
        HAS_GATE=gate is not None, MODULATE=modulate, BLOCK=_block(n), num_warps=8,
    )
    return h, out


def residual_norm(h, y, gate, weight, bias, eps: float, dtype: torch.dtype):
    """h += y * gate (in place); returns (h, LayerNorm(h) * weight + bias in `dtype`)."""
    return _add_norm(h, y, gate, weight, bias, eps, dtype, modulate=False)


def residual_adaln(h, y, gate, shift, scale, eps: float, dtype: torch.dtype):
    """h += y * gate (gate None: h += y) in place; returns (h, LayerNorm(h) * (1 + scale) + shift in `dtype`)."""
    return _add_norm(h, y, gate, shift, scale, eps, dtype, modulate=True)


def _norm_rope_into(x, weight, eps: float, cos, sin, out, normed=None, norm: bool = True) -> None:
    # x: [L, H, D] (rows may be strided); out (and normed): [L, H, D] contiguous; cos, sin: [L, 1, D]
    rows, d = x.shape[0], x.shape[-1]
    n = x.shape[-2] * d
    x2 = x.reshape(rows, n) if x.stride(-1) == 1 and x.stride(-2) == d else x.reshape(rows, n).contiguous()
    _norm_rope_kernel[(triton.cdiv(rows, ROPE_ROWS),)](
        x2, weight if weight is not None else x2, cos, sin, out, normed if normed is not None else out, rows, x2.stride(0),
        eps, H=x.shape[-2], HP=_block(x.shape[-2]), D=d, NORM=norm, WRITE_NORMED=normed is not None, ROWS=ROPE_ROWS, num_warps=ROPE_WARPS,
    )


def norm_rope_into(x, weight, eps: float, cos, sin, out, normed=None) -> None:
    """out <- RoPE(RMSNorm(x)) over H*D; normed (if given) <- RMSNorm(x). x: [L, H, D]; out, normed: contiguous."""
    _norm_rope_into(x, weight, eps, cos, sin, out, normed)


def rope_into(x, cos, sin, out) -> None:
    """out <- RoPE(x) (cached keys, stored normalized). x: [L, H, D]; out: contiguous [L, H, D]."""
    _norm_rope_into(x, None, 0.0, cos, sin, out, norm=False)


def merge_parts(o: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Softmax attention over all keys from two parts of them: o [2, Lq, H, D] (each part's output),
    lse [2, H, Lq] float32 (each part's log-sum-exp) -> [Lq, H, D]."""
    _, lq, nh, d = o.shape
    if not o.is_contiguous() or not lse.is_contiguous() or lse.shape != (2, nh, lq):
        raise ValueError(f"merge_parts wants contiguous o [2, Lq, H, D] and lse [2, H, Lq], got {tuple(o.shape)}, {tuple(lse.shape)}")
    out = torch.empty(o.shape[1:], dtype=o.dtype, device=o.device)
    rows = lq * nh
    _merge_parts_kernel[(triton.cdiv(rows, 16),)](o, lse, out, rows, lq, H=nh, D=d, ROWS=16, num_warps=4)
    return out
