"""FlashAttention-4's Hopper/Blackwell forward (the `flash-attn-4` package, CuTe DSL) for the
self-attention of a forward whose queries see every key (no mask: the common one-stream path).

On the H200 at wan2.1-1.3b's shape (4,680 queries, 18,720 keys, 12 heads of 128) it runs at
about 648 TFLOP/s against SDPA's cuDNN backend's 537 (0.83 vs 1.00 ms a layer); for the
cross-attention's 512 text keys cuDNN stays faster, so that one keeps SDPA. One stream's
keys are split in two parts where that fills the GPU's waves of tiles better (`kv_parts`).

Optional: without the package, on other GPUs, on CPU, or with STREAMSVC_FLASH=0, `usable`
is False and the callers keep SDPA. The package is imported on first use (it takes seconds),
and each new shape class compiles once (about 2 s), which the engine's warm-up absorbs.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import os

import torch

from models import triton_ops


INSTALL_HINT = "pip install 'flash-attn-4[cu13]' (CUDA 13; plain flash-attn-4 for CUDA 12), or pip install -e '.[gpu]'"


@functools.cache
def _load():
    """(FA4's varlen forward, None) or (None, why it is not available)."""
    if os.environ.get("STREAMSVC_FLASH", "1") == "0":
        return None, "turned off (STREAMSVC_FLASH=0)"
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except ImportError as e:  # missing package or a CUDA/CuTe mismatch: SDPA instead
        return None, f"flash_attn.cute does not import ({type(e).__name__}: {e}); {INSTALL_HINT}"
    except Exception as e:  # noqa: BLE001 - the package raises other errors on a broken CUDA setup
        return None, f"flash_attn.cute failed to load ({type(e).__name__}: {e}); {INSTALL_HINT}"
    return flash_attn_varlen_func, None


def _kernel():
    return _load()[0]


def status(device: torch.device) -> str | None:
    """None when the self-attention on `device` runs FA4; else why not, with how to get it."""
    if device.type != "cuda":
        return "not a CUDA device"
    if not _arch_ok(device.index if device.index is not None else torch.cuda.current_device()):
        return f"FA4 needs an SM90 or SM100 GPU (Hopper, Blackwell), this is {torch.cuda.get_device_name(device)}"
    return _load()[1]


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


TILE_M = TILE_N = 128  # FA4's SM90/SM100 forward tile at head dim 128: queries x keys
CTA_COST = 2  # a tile's fixed cost (its queries in, its output out) in key blocks' time: fit on the H200


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _finish(tiles: int, blocks: tuple[int, ...], sms: int) -> int:
    """When the last of the kernel's tiles ends: FA4's SM90 grid is one CTA per (query tile,
    head, batch entry), handed out in that order to whichever SM frees first; a tile over
    `n` key blocks takes n + CTA_COST."""
    free = [0] * sms
    for n in blocks:
        for _ in range(tiles):
            heapq.heapreplace(free, free[0] + n + CTA_COST)
    return max(free)


@functools.cache
def _plan(tiles: int, lk: int, sms: int) -> tuple[int, ...]:
    """The split of `lk` keys (in whole key blocks, the ragged block in the short part) that `_finish` says ends first."""
    blocks = -(-lk // TILE_N)
    best, parts = _finish(tiles, (blocks,), sms), (lk,)
    for first in range((blocks + 1) // 2, blocks):  # the long part first: its tiles start, the short ones fill the tail
        t = _finish(tiles, (first, blocks - first), sms)
        if t < best:
            best, parts = t, (first * TILE_N, lk - first * TILE_N)
    return parts


def kv_parts(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, ...]:
    """How many keys each kernel batch entry attends over: (Lk,), or two parts whose tiles fill
    the GPU's waves better. FA4 has no split-KV on SM90, so `attend` splits the keys itself.

    At Wan's shape, 12 heads x 37 query tiles = 444 tiles on 132 SMs take 4 waves, the last a
    third full. Split 119 + 28 key blocks, the long tiles run first and the short ones fill in
    behind them: 1.1 ms a forward sooner than two equal halves on the H200."""
    b, lq, nh = q.shape[:3]
    lk = k.shape[1]
    if b != 1 or q.shape[-1] != 128 or lk < 2048 or not triton_ops.AVAILABLE or not (k.is_contiguous() and v.is_contiguous()):
        return (lk,)  # batches, other tiles (head dims 64, 96), few keys: one part
    return _plan(nh * -(-lq // TILE_M), lk, _num_sms(q.device))


@functools.cache
def _cu_seqlens(parts: tuple[int, ...], device: torch.device) -> torch.Tensor:
    # made on a forward's first, eager run (graphs.py), never inside a capture
    return torch.tensor([0, *itertools.accumulate(parts)], dtype=torch.int32, device=device)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Unmasked attention, [B, Lq, H, D] x [B, Lk, H, D] -> [B, Lq, H, D] (FA4's layout is ours)."""
    parts = kv_parts(q, k, v)
    if len(parts) == 2:
        # the key parts as a varlen batch of 2 over the same rows (no copy), the queries broadcast
        # (FA4 takes a stride-0 batch); the parts' outputs merged by their log-sum-exps
        out, lse = _kernel()(q.expand(2, *q.shape[1:]), k[0], v[0], cu_seqlens_k=_cu_seqlens(parts, q.device),
                             max_seqlen_k=max(parts), return_lse=True)
        return triton_ops.merge_parts(out, lse)[None]
    out = _kernel()(q, k, v)
    return out[0] if isinstance(out, tuple) else out
