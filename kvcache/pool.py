"""All KV-cache memory of one device under a byte budget."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcache.cache import StreamCache
from kvcache.spec import CacheSpec
from kvcache.storage import make_storage, storage_bytes


class PoolFull(RuntimeError):
    """A stream's cache does not fit in what is left of the pool's budget."""


@dataclass(frozen=True)
class Reservation:
    stream_id: str  # who holds it
    nbytes: int  # exact bytes of its storage tensors


class CachePool:
    """Hands out per-stream caches under `budget_bytes` and takes the memory back on release.

    Accounting is by exact storage bytes (`CacheSpec.stream_bytes`), so it is testable with
    no backing memory: on device "meta" tensors have shapes but no storage.
    """

    def __init__(self, budget_bytes: int, device: torch.device | str = "cpu") -> None:
        if budget_bytes <= 0:
            raise ValueError(f"pool budget must be positive, got {budget_bytes} bytes")
        self.budget_bytes = int(budget_bytes)
        self.device = torch.device(device)
        self._held: dict[str, tuple[Reservation, StreamCache]] = {}

    @property
    def used_bytes(self) -> int:
        return sum(r.nbytes for r, _ in self._held.values())

    @property
    def free_bytes(self) -> int:
        return self.budget_bytes - self.used_bytes

    @property
    def num_streams(self) -> int:
        return len(self._held)

    def fits(self, spec: CacheSpec) -> bool:
        return storage_bytes(spec) <= self.free_bytes

    def refusal(self, spec: CacheSpec) -> str | None:
        """Why a cache of `spec` would be refused now, or None if it fits."""
        need = storage_bytes(spec)
        if need <= self.free_bytes:
            return None
        return (
            f"KV cache needs {_mib(need)} but the pool has {_mib(self.free_bytes)} free of {_mib(self.budget_bytes)} "
            f"({self.num_streams} streams open); close a stream, use --kv-quant int2/int4 or a smaller window"
        )

    def allocate(self, stream_id: str, spec: CacheSpec) -> StreamCache | None:
        """A new cache for `stream_id`, or None when it does not fit the budget."""
        if stream_id in self._held:
            raise ValueError(f"stream {stream_id!r} already holds a cache")
        need = storage_bytes(spec)
        if need > self.free_bytes:
            return None
        storage = make_storage(spec, self.device)
        if storage.nbytes != need:  # keep the accounting honest
            raise AssertionError(f"storage allocated {storage.nbytes} bytes, accounting says {need}")
        cache = StreamCache(spec, storage=storage)
        self._held[stream_id] = (Reservation(stream_id, need), cache)
        return cache

    def allocate_or_raise(self, stream_id: str, spec: CacheSpec) -> StreamCache:
        cache = self.allocate(stream_id, spec)
        if cache is None:
            raise PoolFull(self.refusal(spec) or "KV pool is full")
        return cache

    def release(self, stream_id: str) -> int:
        """Free `stream_id`'s cache; returns the bytes given back (0 if it held none)."""
        held = self._held.pop(stream_id, None)
        return 0 if held is None else held[0].nbytes

    def holds(self, stream_id: str) -> bool:
        return stream_id in self._held


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
