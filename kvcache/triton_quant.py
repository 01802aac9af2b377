"""Triton kernels for quantized KV storage (layout: kvcache/quant.py).

- `quantize_frame`: one frame's K and V -> packed codes + scales + zeros (two launches, at commit).
- `read_layer`: one fused launch per layer read, K and V together: every slot of [0, n) is
  unpacked + dequantized (quantized frames) or copied (dense sinks / residual) into the
  output buffers, in spec.dtype. The slot -> buffer table is read on the device (`loc`), so
  a read needs no host work beyond the launch and no host-device sync.

The codes equal the torch reference bit for bit: the same float32 ops, IEEE division
(`div_rn`), min/max and floor(q + 0.5). Dequantized values may differ from the reference by
one rounding (the kernel may fuse code * scale + zero into an FMA).

Import-guarded: without triton `AVAILABLE` is False and kvcache.quant uses its reference.
On CUDA tensors the kernels are compiled. With TRITON_INTERPRET=1 set before triton is first
imported (Triton decides this per process), they run in Triton's interpreter (numpy) on CPU
tensors instead, which is how the CPU tests check them without a GPU.
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

BLOCK_T = 64  # tokens per program of the value-quantize and read kernels


def _pow2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


if AVAILABLE:

    @triton.jit
    def _quant_keys_kernel(
        src_ptr,  # [T, C] one frame's keys, any float dtype
        codes_ptr,  # [T, C/P] uint8
        scale_ptr,  # [T/G, C] bf16
        zero_ptr,  # [T/G, C] fp32
        C: tl.constexpr,
        D: tl.constexpr,
        G: tl.constexpr,
        BITS: tl.constexpr,
        GP: tl.constexpr,  # G rounded up to a power of 2
        DPP: tl.constexpr,  # D/P rounded up to a power of 2
    ):
        # program (g, h): tokens [g*G, (g+1)*G) x head h's channels, per channel min/max over the tokens
        P: tl.constexpr = 8 // BITS
        DP: tl.constexpr = D // P
        LEV: tl.constexpr = (1 << BITS) - 1
        g = tl.program_id(0)
        h = tl.program_id(1)
        r = tl.arange(0, GP)
        j = tl.arange(0, DPP)
        rmask = r < G
        jmask = j < DP
        mask = rmask[:, None] & jmask[None, :]
        rows = g * G + r
        packed = tl.zeros([GP, DPP], dtype=tl.int32)
        for i in tl.static_range(P):
            col = h * D + i * DP + j
            x = tl.load(src_ptr + rows[:, None] * C + col[None, :], mask=mask, other=0.0).to(tl.float32)
            mn = tl.where(jmask, tl.min(tl.where(mask, x, float("inf")), axis=0), 0.0)
            mx = tl.where(jmask, tl.max(tl.where(mask, x, float("-inf")), axis=0), 0.0)
            s = tl.math.div_rn(mx - mn, tl.full([DPP], LEV, tl.float32))
            sb = s.to(tl.bfloat16)  # ceil to bf16: the grid must cover the group
            up = (sb.to(tl.int16, bitcast=True) + 1).to(tl.bfloat16, bitcast=True)
            sb = tl.where(sb.to(tl.float32) < s, up, sb)
            sf = sb.to(tl.float32)
            tl.store(scale_ptr + g * C + col, sb, mask=jmask)
            tl.store(zero_ptr + g * C + col, mn, mask=jmask)
            den = tl.where(sf > 0, sf, 1.0)
            q = tl.math.div_rn(x - mn[None, :], tl.broadcast_to(den[None, :], [GP, DPP]))
            q = tl.where(sf[None, :] > 0, q, 0.0)
            code = tl.minimum(tl.maximum(tl.floor(q + 0.5), 0.0), LEV * 1.0).to(tl.int32)
            packed = packed | (code << (i * BITS))
        tl.store(codes_ptr + rows[:, None] * (C // P) + h * DP + j[None, :], packed.to(tl.uint8), mask=mask)

    @triton.jit
    def _quant_values_kernel(
        src_ptr,  # [T, C] one frame's values
        codes_ptr,  # [T, C/P] uint8
        scale_ptr,  # [T, H] bf16
        zero_ptr,  # [T, H] fp32
        T: tl.constexpr,
        H: tl.constexpr,
        D: tl.constexpr,
        BITS: tl.constexpr,
        BT: tl.constexpr,
        DPP: tl.constexpr,
    ):
        # program (tb, h): tokens [tb*BT, (tb+1)*BT) x head h, per token min/max over the head's channels
        C: tl.constexpr = H * D
        P: tl.constexpr = 8 // BITS
        DP: tl.constexpr = D // P
        LEV: tl.constexpr = (1 << BITS) - 1
        tb = tl.program_id(0)
        h = tl.program_id(1)
        rows = tb * BT + tl.arange(0, BT)
        j = tl.arange(0, DPP)
        rmask = rows < T
        jmask = j < DP
        mask = rmask[:, None] & jmask[None, :]
        mn = tl.full([BT], float("inf"), tl.float32)
        mx = tl.full([BT], float("-inf"), tl.float32)
        for i in tl.static_range(P):
            col = h * D + i * DP + j
            x = tl.load(src_ptr + rows[:, None] * C + col[None, :], mask=mask, other=0.0).to(tl.float32)
            mn = tl.minimum(mn, tl.min(tl.where(mask, x, float("inf")), axis=1))
            mx = tl.maximum(mx, tl.max(tl.where(mask, x, float("-inf")), axis=1))
        mn = tl.where(rmask, mn, 0.0)
        mx = tl.where(rmask, mx, 0.0)
        s = tl.math.div_rn(mx - mn, tl.full([BT], LEV, tl.float32))
        sb = s.to(tl.bfloat16)
        up = (sb.to(tl.int16, bitcast=True) + 1).to(tl.bfloat16, bitcast=True)
        sb = tl.where(sb.to(tl.float32) < s, up, sb)
        sf = sb.to(tl.float32)
        tl.store(scale_ptr + rows * H + h, sb, mask=rmask)
        tl.store(zero_ptr + rows * H + h, mn, mask=rmask)
        den = tl.broadcast_to(tl.where(sf > 0, sf, 1.0)[:, None], [BT, DPP])
        packed = tl.zeros([BT, DPP], dtype=tl.int32)
        for i in tl.static_range(P):
            col = h * D + i * DP + j
            x = tl.load(src_ptr + rows[:, None] * C + col[None, :], mask=mask, other=0.0).to(tl.float32)
            q = tl.math.div_rn(x - mn[:, None], den)
            q = tl.where(sf[:, None] > 0, q, 0.0)
            code = tl.minimum(tl.maximum(tl.floor(q + 0.5), 0.0), LEV * 1.0).to(tl.int32)
            packed = packed | (code << (i * BITS))
        tl.store(codes_ptr + rows[:, None] * (C // P) + h * DP + j[None, :], packed.to(tl.uint8), mask=mask)

    @triton.jit
    def _read_kernel(
        loc_ptr,  # [n, 2] int32: (kind, buffer) per slot; kind -1 empty, 0 dense, 1 quantized
        dk_ptr,  # [Nd, T, C] dense keys
        dv_ptr,  # [Nd, T, C] dense values
        kc_ptr,  # [Nq, T, C/P] key codes
        ks_ptr,  # [Nq, T/G, C] key scales (bf16)
        kz_ptr,  # [Nq, T/G, C] key zeros (fp32)
        vc_ptr,  # [Nq, T, C/P] value codes
        vs_ptr,  # [Nq, T, H] value scales (bf16)
        vz_ptr,  # [Nq, T, H] value zeros (fp32)
        ok_ptr,  # [n, T, C] out keys
        ov_ptr,  # [n, T, C] out values
        T: tl.constexpr,
        H: tl.constexpr,
        D: tl.constexpr,
        G: tl.constexpr,
        BITS: tl.constexpr,
        BT: tl.constexpr,
        DPP: tl.constexpr,
    ):
        # program (tb, slot, h): tokens [tb*BT, (tb+1)*BT) of one slot x head h, K and V
        C: tl.constexpr = H * D
        P: tl.constexpr = 8 // BITS
        DP: tl.constexpr = D // P
        LEV: tl.constexpr = (1 << BITS) - 1
        tb = tl.program_id(0)
        slot = tl.program_id(1)
        h = tl.program_id(2)
        kind = tl.load(loc_ptr + slot * 2)
        idx = tl.load(loc_ptr + slot * 2 + 1).to(tl.int64)
        rows = tb * BT + tl.arange(0, BT)
        j = tl.arange(0, DPP)
        rmask = rows < T
        mask = rmask[:, None] & (j < DP)[None, :]
        out = slot.to(tl.int64) * (T * C) + rows[:, None] * C + h * D + j[None, :]
        if kind == 1:
            cb = idx * (T * (C // P)) + rows[:, None] * (C // P) + h * DP + j[None, :]
            kp = tl.load(kc_ptr + cb, mask=mask, other=0).to(tl.int32)
            vp = tl.load(vc_ptr + cb, mask=mask, other=0).to(tl.int32)
            vm = idx * (T * H) + rows * H + h
            vs = tl.load(vs_ptr + vm, mask=rmask, other=0.0).to(tl.float32)[:, None]
            vz = tl.load(vz_ptr + vm, mask=rmask, other=0.0)[:, None]
            km = idx * ((T // G) * C) + (rows // G)[:, None] * C + h * D + j[None, :]
            for i in tl.static_range(P):
                ks = tl.load(ks_ptr + km + i * DP, mask=mask, other=0.0).to(tl.float32)
                kz = tl.load(kz_ptr + km + i * DP, mask=mask, other=0.0)
                ck = ((kp >> (i * BITS)) & LEV).to(tl.float32)
                cv = ((vp >> (i * BITS)) & LEV).to(tl.float32)
                tl.store(ok_ptr + out + i * DP, (ck * ks + kz).to(ok_ptr.dtype.element_ty), mask=mask)
                tl.store(ov_ptr + out + i * DP, (cv * vs + vz).to(ov_ptr.dtype.element_ty), mask=mask)
        elif kind == 0:
            db = idx * (T * C) + rows[:, None] * C + h * D + j[None, :]
            for i in tl.static_range(P):
                tl.store(ok_ptr + out + i * DP, tl.load(dk_ptr + db + i * DP, mask=mask), mask=mask)
                tl.store(ov_ptr + out + i * DP, tl.load(dv_ptr + db + i * DP, mask=mask), mask=mask)
        else:
            zero = tl.zeros([BT, DPP], dtype=ok_ptr.dtype.element_ty)
            for i in tl.static_range(P):
                tl.store(ok_ptr + out + i * DP, zero, mask=mask)
                tl.store(ov_ptr + out + i * DP, zero, mask=mask)


def _check(t: torch.Tensor) -> None:
    if not AVAILABLE:
        raise RuntimeError("triton is not installed: pip install triton")
    if t.device.type == "cpu" and not triton.knobs.runtime.interpret:
        raise RuntimeError("Triton kernels on CPU tensors need TRITON_INTERPRET=1 set before triton is imported")
    if t.device.type not in ("cuda", "cpu"):
        raise ValueError(f"Triton kernels run on CUDA tensors (or interpreted on CPU ones), got {t.device}")


def _nonempty(t: torch.Tensor) -> torch.Tensor:
    # a buffer with no frames is never dereferenced, but the launcher wants a real pointer
    return t if t.numel() else torch.empty(1, dtype=t.dtype, device=t.device)


def quantize_frame(k, v, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, *, group_size: int, bits: int) -> None:
    """Quantize one frame: k, v [T, H, D] -> the six buffers of one quantized frame (kvcache/quant.py)."""
    t, h, d = k.shape
    p = 8 // bits
    _check(k)
    k, v = k.contiguous(), v.contiguous()
    dpp = _pow2(d // p)
    _quant_keys_kernel[(t // group_size, h)](
        k, k_codes, k_scale, k_zero, C=h * d, D=d, G=group_size, BITS=bits, GP=_pow2(group_size), DPP=dpp
    )
    _quant_values_kernel[(triton.cdiv(t, BLOCK_T), h)](
        v, v_codes, v_scale, v_zero, T=t, H=h, D=d, BITS=bits, BT=BLOCK_T, DPP=dpp
    )


def read_layer(storage, layer: int, num_slots: int, k_out: torch.Tensor, v_out: torch.Tensor) -> None:
    """One fused launch: slots [0, num_slots) of `layer` of a QuantStorage into k_out, v_out [n, T, H, D]."""
    spec = storage.spec
    t, h, d = spec.tokens_per_frame, spec.num_heads, spec.head_dim
    if not (k_out.is_contiguous() and v_out.is_contiguous()):
        raise ValueError("read_layer writes contiguous [n, T, H, D] outputs")
    _check(k_out)
    bufs = [
        storage.dense_k[layer], storage.dense_v[layer],
        storage.k_codes[layer], storage.k_scale[layer], storage.k_zero[layer],
        storage.v_codes[layer], storage.v_scale[layer], storage.v_zero[layer],
    ]  # fmt: skip
    _read_kernel[(triton.cdiv(t, BLOCK_T), num_slots, h)](
        storage.loc[layer],
        *[_nonempty(b) for b in bufs],
        k_out,
        v_out,
        T=t,
        H=h,
        D=d,
        G=spec.group_size,
        BITS=storage.bits,
        BT=BLOCK_T,
        DPP=_pow2(d // (8 // storage.bits)),
    )
