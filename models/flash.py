"""FlashAttention-4's Hopper/Blackwell forward (the `flash-attn-4` package, CuTe DSL) for the
self-attention of a forward whose queries see every key (no mask: the common one-stream path).

On the H200 at wan2.1-1.3b's shape (4,680 queries, 18,720 keys, 12 heads of 128) it runs at
about 648 TFLOP/s against SDPA's cuDNN backend's 537 (0.83 vs 1.00 ms a layer); for the
cross-attention's 512 text keys cuDNN stays faster, so that one keeps SDPA. One stream's
keys are split in two halves where that fills the last wave of tiles (`kv_splits`).

Optional: without the package, on other GPUs, on CPU, or with STREAMSVC_FLASH=0, `usable`
is False and the callers keep SDPA. The package is imported on first use (it takes seconds),
and each new shape class compiles once (about 2 s), which the engine's warm-up absorbs.
"""

from __future__ import annotations

import functools
import os

import torch

from models import triton_ops


@functools.cache
def _kernel():
    if os.environ.get("STREAMSVC_FLASH", "1") == "0":
        return None
    try:
        from flash_attn.cute import flash_attn_func
    except Exception:  # noqa: BLE001 - missing package or CUDA/CuTe mismatch: fall back to SDPA
        return None
    return flash_attn_func


@functools.cache
def _arch_ok(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] in (9, 10)  # the SM90 and SM100 kernels


def usable(q: torch.Tensor) -> bool:
    """Whether `attend` can run on tensors like `q` ([B, L, H, D])."""
    return (
        q.is_cuda
        and q.dtype in (torch.bfloat16, torch.float16)
        and q.shape[-1] in (64, 96, 128)
        and _arch_ok(q.device.index if q.device.index is not None else torch.cuda.current_device())
        and _kernel() is not None
    )


TILE_M = 128  # FA4's SM90/SM100 query tile at head dim 128


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def kv_splits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    """1, or 2 when splitting the keys in halves shortens the kernel's last, partly idle wave of
    query tiles. FA4 has no split-KV on SM90, so `attend` splits them itself; one stream only.

    At Wan's shape, 12 heads x 37 tiles = 444 tiles on 132 SMs: 4 waves, the last 36 % full;
    split, 888 half-length tiles take 7 half-waves (3.5 waves)."""
    b, lq, nh = q.shape[:3]
    lk = k.shape[1]
    if b != 1 or lk % 2 or lk < 2048 or not triton_ops.AVAILABLE or not (k.is_contiguous() and v.is_contiguous()):
        return 1
    sms = _num_sms(q.device)
    tiles = nh * -(-lq // TILE_M)
    waves = lambda s: -(-s * tiles // sms) / s  # noqa: E731
    return 2 if waves(2) < waves(1) else 1


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Unmasked attention, [B, Lq, H, D] x [B, Lk, H, D] -> [B, Lq, H, D] (FA4's layout is ours)."""
    if kv_splits(q, k, v) == 2:
        # the key halves as a batch of 2 (views), the queries broadcast (FA4 takes a stride-0 batch):
        # twice the tiles, each half as long, then the halves' outputs merged by their log-sum-exps
        lk = k.shape[1]
        out, lse = _kernel()(q.expand(2, *q.shape[1:]), k.view(2, lk // 2, *k.shape[2:]),
                             v.view(2, lk // 2, *v.shape[2:]), return_lse=True)
        return triton_ops.merge_halves(out, lse)[None]
    out = _kernel()(q, k, v)
    return out[0] if isinstance(out, tuple) else out
