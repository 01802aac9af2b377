"""All KV-cache memory of one device under a byte budget."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcache.cache import StreamCache, make_storage
from kvcache.spec import CacheSpec
from kvcache.units import format_bytes


class PoolFull(RuntimeError):
    """A stream's cache does not fit in what is left of the pool's budget."""


@dataclass(frozen=True)
class Reservation:
    stream_id: str  # who holds it
    nbytes: int  # exact bytes of its storage tensors, plus the per-stream state counted with them


class CachePool:
    """Hands out per-stream caches under `budget_bytes` and takes the memory back on release.

    Accounting is by exact storage bytes (`CacheSpec.stream_bytes`), so it is testable with
    no backing memory: on device "meta" tensors have shapes but no storage. Other device memory
    that streams share (a style's adapter: streamsvc/engine/styles.py) is held against the same
    budget by `reserve`, so a stream's cache fits only in what the caches and those leave.
    """

    def __init__(self, budget_bytes: int, device: torch.device | str = "cpu") -> None:
        if budget_bytes <= 0:
            raise ValueError(f"pool budget must be positive, got {budget_bytes} bytes")
        self.budget_bytes = int(budget_bytes)
        self.device = torch.device(device)
        self._held: dict[str, tuple[Reservation, StreamCache]] = {}
        self.reserved: dict[str, int] = {}  # shared memory held against the budget, by holder (`reserve`)

    @property
    def used_bytes(self) -> int:
        return sum(r.nbytes for r, _ in self._held.values()) + sum(self.reserved.values())

    @property
    def free_bytes(self) -> int:
        return self.budget_bytes - self.used_bytes

    @property
    def num_streams(self) -> int:
        return len(self._held)

    def table_sizes(self) -> dict[str, int]:
        """Entries of its per-stream table: the caches it holds (what a server counts of it, with its other tables)."""
        return {"kv.caches": len(self._held)}

    def fits(self, spec: CacheSpec, extra_bytes: int = 0) -> bool:
        return spec.stream_bytes() + extra_bytes <= self.free_bytes

    def refusal(self, spec: CacheSpec, extra_bytes: int = 0) -> str | None:
        """Why a cache of `spec` (plus `extra_bytes` of other per-stream state, e.g. the decoder's)
        would be refused now, or None if it fits."""
        need = spec.stream_bytes() + extra_bytes
        if need <= self.free_bytes:
            return None
        extra = f" (decoder state {format_bytes(extra_bytes)} included)" if extra_bytes else ""
        shared = ""
        if self.reserved:  # e.g. styles' adapters
            names = ", ".join(list(self.reserved)[:3]) + (", ..." if len(self.reserved) > 3 else "")
            shared = f"; {format_bytes(sum(self.reserved.values()))} of it reserved by {names}"
        return (
            f"KV cache needs {format_bytes(need)}{extra} but the pool has {format_bytes(self.free_bytes)} free of "
            f"{format_bytes(self.budget_bytes)} ({self.num_streams} streams open{shared}); close a stream, use "
            "--kv-quant int2/int4 or a smaller window"
        )

    def allocate(self, stream_id: str, spec: CacheSpec, extra_bytes: int = 0) -> StreamCache | None:
        """A new cache for `stream_id`, or None when it and `extra_bytes` (per-stream state held
        elsewhere, counted against the same budget) do not fit."""
        if stream_id in self._held:
            raise ValueError(f"stream {stream_id!r} already holds a cache")
        need = spec.stream_bytes()
        if need + extra_bytes > self.free_bytes:
            return None
        storage = make_storage(spec, self.device)
        if storage.nbytes != need:  # keep the accounting honest
            raise AssertionError(f"storage allocated {storage.nbytes} bytes, accounting says {need}")
        cache = StreamCache(spec, storage=storage)
        self._held[stream_id] = (Reservation(stream_id, need + extra_bytes), cache)
        return cache

    def allocate_or_raise(self, stream_id: str, spec: CacheSpec, extra_bytes: int = 0) -> StreamCache:
        cache = self.allocate(stream_id, spec, extra_bytes)
        if cache is None:
            raise PoolFull(self.refusal(spec, extra_bytes) or "KV pool is full")
        return cache

    def release(self, stream_id: str) -> int:
        """Free `stream_id`'s cache; returns the bytes given back (0 if it held none)."""
        held = self._held.pop(stream_id, None)
        return 0 if held is None else held[0].nbytes

    def reserve(self, holder: str, nbytes: int) -> bool:
        """Hold `nbytes` of the budget for `holder` (memory no stream owns, e.g. a style's adapter); False, and
        nothing held, when they do not fit in what is free."""
        if holder in self.reserved:
            raise ValueError(f"{holder!r} already holds a reservation")
        if nbytes > self.free_bytes:
            return False
        self.reserved[holder] = int(nbytes)
        return True

    def unreserve(self, holder: str) -> int:
        """Give `holder`'s reservation back; returns its bytes (0 if it held none)."""
        return self.reserved.pop(holder, 0)

    def holds(self, stream_id: str) -> bool:
        return stream_id in self._held
