"""Parking: one stream's cache moved to host memory and back, and the host budget parked streams share.

A paused stream gives its device memory back to the pool: its cache's tensors are copied to host memory
(pinned on CUDA, so the copy is a DMA on a side stream that overlaps the device's other work; a plain copy
elsewhere) and its storage is dropped. Restoring copies them into a cache freshly allocated from the pool.
The ring's bookkeeping (fills, head, frame ids) and a quantized storage's slot maps travel with the
tensors, so the restored cache reads exactly what the parked one held.

`HostCopier` moves lists of tensors and says when a move is done (a CUDA event, polled: the caller never
waits for it); `ParkBudget` is the host memory's accounting, pure and testable without any memory.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import torch

from kvcache.cache import StreamCache
from kvcache.units import format_bytes


class Transfer:
    """Tensors being copied between the device and the host: `tensors` are the copies (valid once `done()`).

    The sources are kept alive until the copy has finished, so the caching allocator cannot hand their
    memory to other work while the side stream still reads it."""

    def __init__(self, tensors: list[torch.Tensor], sources: list[torch.Tensor], start: torch.cuda.Event | None,
                 end: torch.cuda.Event | None, seconds: float) -> None:
        self.tensors = tensors  # the copies, in the order of the sources
        self.nbytes = sum(t.numel() * t.element_size() for t in tensors)  # bytes moved
        self._sources: list[torch.Tensor] | None = sources  # dropped once the copy is done
        self._start, self._end = start, end  # CUDA events around the copies (None: they ran at once)
        self._seconds = seconds  # CPU: the copies' wall time

    def done(self) -> bool:
        """Whether the copies have finished (never waits); the sources are let go then."""
        if self._end is not None and not self._end.query():
            return False
        self._sources = None
        return True

    def wait(self) -> None:
        if self._end is not None:
            self._end.synchronize()
        self._sources = None

    def make_stream_wait(self, stream: torch.cuda.Stream) -> None:
        """Make `stream` wait for the copies (the host does not): work queued on it after this call reads what
        they wrote. Nothing to wait for where they ran at once."""
        if self._end is not None:
            stream.wait_event(self._end)

    @property
    def seconds(self) -> float:
        """The copies' time on the side stream (CUDA events; CPU: wall time). Needs `done()`."""
        if self._end is None:
            return self._seconds
        return self._start.elapsed_time(self._end) / 1e3


class HostCopier:
    """Copies tensors to host memory and back: on CUDA into pinned memory, on a side stream that first waits
    for the work queued on the current one (what wrote the tensors), ending with an event; elsewhere a
    plain copy, done when the call returns."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None

    def to_host(self, tensors: list[torch.Tensor]) -> Transfer:
        return self._copy(tensors, [torch.empty(t.shape, dtype=t.dtype, pin_memory=self.cuda) for t in tensors])

    def to_device(self, tensors: list[torch.Tensor], out: list[torch.Tensor] | None = None) -> Transfer:
        """Host tensors into `out` (device tensors of the same shapes, written in place; views stay views) or
        new device tensors. On CUDA the current stream waits for the copies: work queued after this call
        reads what they wrote."""
        if out is None:
            out = [torch.empty(t.shape, dtype=t.dtype, device=self.device) for t in tensors]
        moved = self._copy(tensors, out)
        if self.cuda:
            moved.make_stream_wait(torch.cuda.current_stream(self.device))
        return moved

    def _copy(self, src: list[torch.Tensor], dst: list[torch.Tensor]) -> Transfer:
        if len(src) != len(dst) or any(s.shape != d.shape or s.dtype != d.dtype for s, d in zip(src, dst)):
            raise ValueError("parking copies tensors onto tensors of the same shapes and dtypes")
        if not self.cuda:
            t0 = time.perf_counter()
            for s, d in zip(src, dst):
                d.copy_(s)
            return Transfer(dst, [], None, None, time.perf_counter() - t0)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            start.record()
            for s, d in zip(src, dst):
                d.copy_(s, non_blocking=True)
            end.record()
        return Transfer(dst, list(src), start, end, 0.0)


@dataclass
class ParkedCache:
    """A stream cache's contents on the host: its storage's tensors and the ring's bookkeeping."""

    spec: object  # the CacheSpec it was allocated with (a restore needs a cache of the same)
    moved: Transfer  # storage.tensors() copied to the host, in that order
    ring: dict = field(default_factory=dict)  # StreamCache's bookkeeping: fills, head, frames seen, frame ids
    storage_state: object = None  # the storage's own host-side bookkeeping (a quantized storage's slot maps)

    @property
    def nbytes(self) -> int:
        return self.moved.nbytes


_RING = ("sinks_filled", "window_filled", "head", "frames_seen", "frame_ids")


def park_cache(cache: StreamCache, copier: HostCopier) -> ParkedCache:
    """Start copying `cache` to the host (the caller drops the cache once `moved.done()`)."""
    ring = {name: copy.copy(getattr(cache, name)) for name in _RING}
    return ParkedCache(cache.spec, copier.to_host(cache.storage.tensors()), ring, cache.storage.host_state())


def restore_cache(parked: ParkedCache, cache: StreamCache, copier: HostCopier) -> Transfer:
    """Copy a parked cache into `cache` (fresh from the pool, of the same spec): its storage in place, its ring
    as it was. The cache's rotated keys count as stale (a forward rotates them again)."""
    if cache.spec != parked.spec:
        raise ValueError(f"a cache parked as {parked.spec} restores into one of the same spec, not {cache.spec}")
    parked.moved.wait()
    moved = copier.to_device(parked.moved.tensors, cache.storage.tensors())
    for name, value in parked.ring.items():
        setattr(cache, name, copy.copy(value))
    cache.storage.load_host_state(copy.deepcopy(parked.storage_state))
    cache.touch()
    return moved


class ParkBudget:
    """Host memory that parked streams may hold, by exact bytes per stream (accounting only, no memory)."""

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"park budget must be >= 0 bytes (0: no parking), got {budget_bytes}")
        self.budget_bytes = int(budget_bytes)
        self._held: dict[str, int] = {}

    @property
    def used_bytes(self) -> int:
        return sum(self._held.values())

    @property
    def free_bytes(self) -> int:
        return self.budget_bytes - self.used_bytes

    @property
    def num_streams(self) -> int:
        return len(self._held)

    def holds(self, stream_id: str) -> bool:
        return stream_id in self._held

    def refusal(self, nbytes: int) -> str | None:
        """Why parking `nbytes` more would be refused now, or None if it fits."""
        if nbytes <= self.free_bytes:
            return None
        return (
            f"parking needs {format_bytes(nbytes)} of host memory but the park budget has "
            f"{format_bytes(self.free_bytes)} free of {format_bytes(self.budget_bytes)} ({self.num_streams} streams "
            "parked); resume or close a parked stream, or raise --park-budget-gib"
        )

    def reserve(self, stream_id: str, nbytes: int, force: bool = False) -> str | None:
        """Hold `nbytes` for `stream_id`; returns the refusal instead when they do not fit. `force` holds them
        even beyond the budget (bytes already copied to the host: the accounting stays exact, and free_bytes
        goes below 0 until they are released) and returns the refusal it overrode."""
        if stream_id in self._held:
            raise ValueError(f"stream {stream_id!r} already holds parked memory")
        why = self.refusal(nbytes)
        if why is None or force:
            self._held[stream_id] = int(nbytes)
        return why

    def release(self, stream_id: str) -> int:
        """Give `stream_id`'s bytes back; returns them (0 if it held none)."""
        return self._held.pop(stream_id, 0)
