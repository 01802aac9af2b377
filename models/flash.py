"""FlashAttention-4's Hopper/Blackwell forward (the `flash-attn-4` package, CuTe DSL) for the
self-attention of a forward whose queries see every key (no mask: the common one-stream path).

On the H200 at wan2.1-1.3b's shape (4,680 queries, 18,720 keys, 12 heads of 128) it runs at
about 648 TFLOP/s against SDPA's cuDNN backend's 537 (0.83 vs 1.00 ms a layer); for the
cross-attention's 512 text keys cuDNN stays faster, so that one keeps SDPA.

Optional: without the package, on other GPUs, on CPU, or with STREAMSVC_FLASH=0, `usable`
is False and the callers keep SDPA. The package is imported on first use (it takes seconds),
and each new shape class compiles once (about 2 s), which the engine's warm-up absorbs.
"""

from __future__ import annotations

import functools
import os

import torch


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


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Unmasked attention, [B, Lq, H, D] x [B, Lk, H, D] -> [B, Lq, H, D] (FA4's layout is ours)."""
    out = _kernel()(q, k, v)
    return out[0] if isinstance(out, tuple) else out
