"""Quantized KV storage, KIVI-style int4 / int2: the torch reference and `QuantStorage`.

Keys are quantized per channel: each channel's group of `group_size` consecutive tokens of
one frame shares a scale and a zero point (keys have outlier channels, so a channel's range
is what to follow). Values are quantized per token: each token's `head_dim` channels of one
head share them. Both are asymmetric min/max: x ~ zero + code * scale with codes in
[0, 2^bits - 1]; zero is the group's minimum (float32, exact) and scale its range / levels
rounded *up* to bfloat16, so the grid covers the group and every element is within scale / 2.

Layout of one quantized frame of one layer (T tokens, H heads, D = head_dim, C = H * D,
G = group_size, b bits, P = 8 // b codes per byte, DP = D // P):

    key codes    [T, C / P] uint8   byte (t, h, j) holds channels h*D + i*DP + j, i < P, at bits [i*b, (i+1)*b)
    key scale    [T / G, C] bf16    one per channel per token group
    key zero     [T / G, C] fp32
    value codes  [T, C / P] uint8   packed like the keys
    value scale  [T, H] bf16        one per token per head
    value zero   [T, H] fp32

Codes are packed "planar within a head" (a byte holds channels DP apart, not neighbours) so
that a kernel unpacks a byte tile into P contiguous channel tiles without shuffles.

The torch functions here are the reference: they run anywhere (CPU, CUDA, meta) and the
Triton kernels (kvcache/triton_quant.py) produce the same codes bit for bit.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch

from kvcache.spec import QUANT_BITS, CacheSpec, QuantLayout
from kvcache.spec import quant_frame_bytes  # noqa: F401  bytes of the layout described above; the spec counts all bytes
from kvcache.storage import KVStorage

# Where a slot's frame lives (first column of `QuantStorage.loc`).
EMPTY, DENSE, QUANT = -1, 0, 1


# -- the reference -----------------------------------------------------------------------------


def pack(codes: torch.Tensor, head_dim: int, bits: int) -> torch.Tensor:
    """codes: [..., C] integers in [0, 2^bits) -> [..., C / P] uint8, planar within each head."""
    p = 8 // bits
    *lead, c = codes.shape
    parts = codes.to(torch.uint8).reshape(*lead, c // head_dim, p, head_dim // p)
    out = parts[..., 0, :].clone()
    for i in range(1, p):
        out |= parts[..., i, :] << (bits * i)
    return out.reshape(*lead, c // p)


def unpack(packed: torch.Tensor, head_dim: int, bits: int) -> torch.Tensor:
    """[..., C / P] uint8 -> codes [..., C] uint8 (inverse of `pack`)."""
    p = 8 // bits
    *lead, cp = packed.shape
    mask = (1 << bits) - 1
    grouped = packed.reshape(*lead, cp * p // head_dim, head_dim // p)
    parts = [(grouped >> (bits * i)) & mask for i in range(p)]
    return torch.stack(parts, dim=-2).reshape(*lead, cp * p)


def ceil_bf16(x: torch.Tensor) -> torch.Tensor:
    """The smallest bfloat16 >= x, for finite x >= 0 (whatever the cast's rounding mode)."""
    r = x.to(torch.bfloat16)
    up = (r.view(torch.int16) + 1).view(torch.bfloat16)
    return torch.where(r.float() < x, up, r)


def _quantize(x: torch.Tensor, mn: torch.Tensor, mx: torch.Tensor, bits: int):
    # x: float32 groups; mn, mx: the groups' min / max, broadcastable to x -> codes (uint8, same shape as x), scale bf16
    levels = (1 << bits) - 1
    scale = ceil_bf16((mx - mn) / levels)
    sf = scale.float()
    q = torch.where(sf > 0, (x - mn) / torch.where(sf > 0, sf, 1.0), 0.0)
    codes = torch.floor(q + 0.5).clamp_(0, levels).to(torch.uint8)
    return codes, scale


def quantize_keys(k: torch.Tensor, group_size: int, bits: int):
    """k: [F, T, H, D] -> codes [F, T, C/P] uint8, scale [F, T/G, C] bf16, zero [F, T/G, C] fp32."""
    f, t, h, d = k.shape
    x = k.reshape(f, t // group_size, group_size, h * d).float()
    mn, mx = x.amin(dim=2, keepdim=True), x.amax(dim=2, keepdim=True)
    codes, scale = _quantize(x, mn, mx, bits)
    return pack(codes.reshape(f, t, h * d), d, bits), scale[:, :, 0], mn[:, :, 0]


def quantize_values(v: torch.Tensor, bits: int):
    """v: [F, T, H, D] -> codes [F, T, C/P] uint8, scale [F, T, H] bf16, zero [F, T, H] fp32."""
    f, t, h, d = v.shape
    x = v.float()
    mn, mx = x.amin(dim=3, keepdim=True), x.amax(dim=3, keepdim=True)
    codes, scale = _quantize(x, mn, mx, bits)
    return pack(codes.reshape(f, t, h * d), d, bits), scale[..., 0], mn[..., 0]


def dequantize_keys(codes, scale, zero, head_dim: int, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """codes [F, T, C/P], scale / zero [F, T/G, C] -> [F, T, H, D] in `dtype`."""
    f, t, _ = codes.shape
    c = unpack(codes, head_dim, bits).float()  # [F, T, C]
    g = t // scale.shape[1]
    x = c.view(f, t // g, g, -1) * scale.float()[:, :, None] + zero[:, :, None]
    return x.view(f, t, -1, head_dim).to(dtype)


def dequantize_values(codes, scale, zero, head_dim: int, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """codes [F, T, C/P], scale / zero [F, T, H] -> [F, T, H, D] in `dtype`."""
    f, t, _ = codes.shape
    c = unpack(codes, head_dim, bits).float().view(f, t, -1, head_dim)
    return (c * scale.float()[..., None] + zero[..., None]).to(dtype)


# -- the read scratch --------------------------------------------------------------------------


def scratch_bytes(spec: CacheSpec) -> int:
    """Bytes of the read scratch a device holds once for all quantized streams of this shape."""
    return 2 * spec.capacity_frames * spec.tokens_per_frame * spec.num_heads * spec.head_dim * spec.torch_dtype.itemsize


class ReadScratch:
    """Where reads dequantize to: one reused pair of K/V buffers per (device, dtype, T, H, D).

    Shared by every quantized stream of a device (one per device by default, `SHARED_SCRATCH`),
    so it is *not* part of any stream's bytes: budget `scratch_bytes(spec)` once per device.
    A read is valid until the next read of any storage sharing the scratch; the DiT consumes
    each read (RoPE, concatenation) before it reads the next stream or layer.
    """

    def __init__(self) -> None:
        self._bufs: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, spec: CacheSpec, device: torch.device, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V buffers, each [num_slots, T, H, D] in spec.dtype."""
        if device.type == "cuda" and device.index is None:  # "cuda" and "cuda:0" share one scratch
            device = torch.device("cuda", torch.cuda.current_device())
        key = (device, spec.torch_dtype, spec.tokens_per_frame, spec.num_heads, spec.head_dim)
        bufs = self._bufs.get(key)
        if bufs is None or bufs[0].shape[0] < num_slots:
            shape = (max(num_slots, spec.capacity_frames), spec.tokens_per_frame, spec.num_heads, spec.head_dim)
            with torch.inference_mode(False):  # a normal tensor: usable both inside and outside inference mode
                bufs = tuple(torch.empty(shape, dtype=spec.torch_dtype, device=device) for _ in range(2))
            self._bufs[key] = bufs
        return bufs[0][:num_slots], bufs[1][:num_slots]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self._bufs.values() for t in pair)

    def clear(self) -> None:
        self._bufs.clear()


SHARED_SCRATCH = ReadScratch()


# -- which buffer holds which slot -------------------------------------------------------------


class SlotMap:
    """One layer's placement of frames: slot -> (DENSE | QUANT | EMPTY, buffer index).

    Sinks have fixed dense buffers (or go to quantized ones with quantize_sinks). A window
    frame is written dense while it is among the `residual` most recently written window
    frames; when a newer one needs its buffer, it is quantized into a free quantized buffer.
    Writes arrive in commit order, so "most recently written" is "newest".
    """

    def __init__(self, spec: CacheSpec, layout: QuantLayout) -> None:
        self.sinks = spec.sink_frames
        self.layout = layout
        self.loc: list[tuple[int, int]] = [(EMPTY, 0)] * spec.capacity_frames
        self.free_dense = list(range(layout.dense_frames - 1, layout.dense_sinks - 1, -1))  # residual buffers
        self.free_quant = list(range(layout.quant_frames - 1, -1, -1))
        self.recent: deque[int] = deque()  # window slots held dense, oldest first

    def place(self, slot: int) -> tuple[tuple[int, int, int] | None, tuple[int, int]]:
        """Make room for a new frame at `slot`.

        Returns (eviction, destination): eviction is (evicted slot, its dense buffer, the quantized
        buffer it must be quantized into) or None; destination is (DENSE | QUANT, buffer index).
        """
        kind, idx = self.loc[slot]
        if kind == QUANT:
            self.free_quant.append(idx)
        elif kind == DENSE and slot >= self.sinks:
            self.free_dense.append(idx)
            self.recent.remove(slot)
        evict = None
        if slot < self.sinks and self.layout.dense_sinks:
            dest = (DENSE, slot)
        elif slot < self.sinks or self.layout.residual == 0:
            dest = (QUANT, self.free_quant.pop())
        else:
            if not self.free_dense:
                old = self.recent.popleft()
                d, q = self.loc[old][1], self.free_quant.pop()
                self.loc[old] = (QUANT, q)
                self.free_dense.append(d)
                evict = (old, d, q)
            dest = (DENSE, self.free_dense.pop())
            self.recent.append(slot)
        self.loc[slot] = dest
        return evict, dest


# -- the storage -------------------------------------------------------------------------------


class QuantStorage(KVStorage):
    """int4 / int2 K/V with dense sinks and a dense residual of the newest window frames.

    Per layer: dense buffers [sinks | residual] in spec.dtype, quantized frame buffers (see the
    module docstring), and `loc` [L, slots, 2] int32, (kind, buffer) of every slot, which the
    fused read kernel uses. Reads dequantize slots [0, n) into `scratch` (shared per device).
    backend: "torch" (the reference), "triton" (kernels; interpreted on CPU tensors) or "auto"
    (triton on CUDA when it imports, torch otherwise).
    """

    def __init__(
        self,
        spec: CacheSpec,
        device: torch.device | str,
        backend: str = "auto",
        scratch: ReadScratch | None = None,
    ) -> None:
        super().__init__(spec, device)
        if spec.quant not in QUANT_BITS:
            raise ValueError(f"QuantStorage stores int4 or int2, got quant={spec.quant!r}")
        self.layout = lay = QuantLayout.of(spec)
        self.bits = lay.bits
        self.backend = _resolve_backend(backend, self.device)
        self.scratch = SHARED_SCRATCH if scratch is None else scratch
        n_l, t, h, d, g = spec.num_layers, spec.tokens_per_frame, spec.num_heads, spec.head_dim, spec.group_size
        c, dev, nq = h * d, self.device, lay.quant_frames
        # dense frames, slots [sinks | residual]: [L, dense, T, H, D]
        self.dense_k = torch.zeros((n_l, lay.dense_frames, t, h, d), dtype=spec.torch_dtype, device=dev)
        self.dense_v = torch.zeros((n_l, lay.dense_frames, t, h, d), dtype=spec.torch_dtype, device=dev)
        # quantized frames: codes [L, Nq, T, C/P]; key scale/zero [L, Nq, T/G, C]; value scale/zero [L, Nq, T, H]
        self.k_codes = torch.zeros((n_l, nq, t, c * self.bits // 8), dtype=torch.uint8, device=dev)
        self.k_scale = torch.zeros((n_l, nq, t // g, c), dtype=torch.bfloat16, device=dev)
        self.k_zero = torch.zeros((n_l, nq, t // g, c), dtype=torch.float32, device=dev)
        self.v_codes = torch.zeros((n_l, nq, t, c * self.bits // 8), dtype=torch.uint8, device=dev)
        self.v_scale = torch.zeros((n_l, nq, t, h), dtype=torch.bfloat16, device=dev)
        self.v_zero = torch.zeros((n_l, nq, t, h), dtype=torch.float32, device=dev)
        # loc: [L, slots, 2] (kind, buffer index) of every slot, on the device for the read kernel
        self.loc = torch.full((n_l, spec.capacity_frames, 2), EMPTY, dtype=torch.int32, device=dev)
        self.maps = [SlotMap(spec, lay) for _ in range(n_l)]

    # -- KVStorage ----------------------------------------------------------------------------

    def write(self, layer: int, slots: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Store frames (k, v: [len(slots), T, H, D]) in time order: the last ones are the newest."""
        m = self.maps[layer]
        for i, slot in enumerate(slots):
            evict, (kind, idx) = m.place(slot)
            if evict is not None:
                _, d, q = evict
                self._quantize(layer, q, self.dense_k[layer, d], self.dense_v[layer, d])
            if kind == DENSE:
                self.dense_k[layer, idx].copy_(k[i])
                self.dense_v[layer, idx].copy_(v[i])
            else:
                self._quantize(layer, idx, k[i], v[i])
        if len(slots):
            self._upload_loc(layer)

    def read(
        self, layer: int, num_slots: int, out: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of slots [0, num_slots), each [num_slots, T, H, D] in spec.dtype.

        Into `out` if given, else into the shared scratch (valid until the next read of any
        stream sharing it). Empty slots read as zeros, as in DenseStorage.
        """
        k_out, v_out = out if out is not None else self.scratch.get(self.spec, self.device, num_slots)
        if num_slots == 0 or self.device.type == "meta":
            return k_out, v_out
        if self.backend == "triton":
            from kvcache import triton_quant

            triton_quant.read_layer(self, layer, num_slots, k_out, v_out)
        else:
            self._read_torch(layer, num_slots, k_out, v_out)
        return k_out, v_out

    def tensors(self) -> list[torch.Tensor]:
        return [
            self.dense_k, self.dense_v,
            self.k_codes, self.k_scale, self.k_zero,
            self.v_codes, self.v_scale, self.v_zero,
            self.loc,
        ]  # fmt: skip

    def host_state(self) -> list[SlotMap]:
        return self.maps  # which buffer holds each slot (`loc` is their copy on the device)

    def load_host_state(self, state: list[SlotMap]) -> None:
        self.maps = state

    # -- internals ----------------------------------------------------------------------------

    def _quantize(self, layer: int, q: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize one frame (k, v: [T, H, D]) into quantized buffer `q` of `layer`."""
        if self.device.type == "meta":
            return
        dst = (
            self.k_codes[layer, q], self.k_scale[layer, q], self.k_zero[layer, q],
            self.v_codes[layer, q], self.v_scale[layer, q], self.v_zero[layer, q],
        )  # fmt: skip
        if self.backend == "triton":
            from kvcache import triton_quant

            triton_quant.quantize_frame(k, v, *dst, group_size=self.spec.group_size, bits=self.bits)
            return
        kc, ks, kz = quantize_keys(k[None], self.spec.group_size, self.bits)
        vc, vs, vz = quantize_values(v[None], self.bits)
        for t, src in zip(dst, (kc, ks, kz, vc, vs, vz)):
            t.copy_(src[0])

    def _upload_loc(self, layer: int) -> None:
        if self.device.type == "meta":
            return
        row = torch.tensor(self.maps[layer].loc, dtype=torch.int32)  # [slots, 2]
        if self.device.type == "cuda":  # pinned + non_blocking: no host sync in the forward
            self.loc[layer].copy_(row.pin_memory(), non_blocking=True)
        else:
            self.loc[layer].copy_(row)

    def _read_torch(self, layer: int, n: int, k_out: torch.Tensor, v_out: torch.Tensor) -> None:
        locs = self.maps[layer].loc[:n]
        by_kind: dict[int, tuple[list[int], list[int]]] = {EMPTY: ([], []), DENSE: ([], []), QUANT: ([], [])}
        for slot, (kind, idx) in enumerate(locs):
            by_kind[kind][0].append(slot)
            by_kind[kind][1].append(idx)
        dev, d, dt = self.device, self.spec.head_dim, self.spec.torch_dtype

        def ix(xs: list[int]) -> torch.Tensor:
            return torch.as_tensor(xs, dtype=torch.long, device=dev)

        slots, idx = by_kind[DENSE]
        if slots:
            k_out.index_copy_(0, ix(slots), self.dense_k[layer, ix(idx)])
            v_out.index_copy_(0, ix(slots), self.dense_v[layer, ix(idx)])
        slots, idx = by_kind[QUANT]
        if slots:
            i, b = ix(idx), self.bits
            kq = dequantize_keys(self.k_codes[layer, i], self.k_scale[layer, i], self.k_zero[layer, i], d, b, dt)
            vq = dequantize_values(self.v_codes[layer, i], self.v_scale[layer, i], self.v_zero[layer, i], d, b, dt)
            k_out.index_copy_(0, ix(slots), kq)
            v_out.index_copy_(0, ix(slots), vq)
        slots, _ = by_kind[EMPTY]
        if slots:
            k_out.index_fill_(0, ix(slots), 0)
            v_out.index_fill_(0, ix(slots), 0)


def _resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"QuantStorage backend must be auto, torch or triton, got {backend!r}")
    if backend == "auto":
        if device.type != "cuda":
            return "torch"
        from kvcache import triton_quant

        return "triton" if triton_quant.AVAILABLE else "torch"
    if backend == "triton":
        from kvcache import triton_quant

        if not triton_quant.AVAILABLE:
            raise RuntimeError("QuantStorage backend='triton' needs the triton package: pip install triton")
        if device.type not in ("cuda", "cpu", "meta"):
            raise ValueError(f"Triton kernels run on CUDA (or interpreted on CPU), not on {device}")
    return backend
