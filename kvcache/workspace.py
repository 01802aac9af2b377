"""One device's working copy of the KV cache, shared by every stream in turn.

A CUDA graph bakes in the addresses of what it reads and writes. If each stream's forward read
its own cache, every stream would need graphs of its own, captured while it plays. Instead each
device has one `Workspace`: dense storage with staging room (CacheSpec.staging_frames) that the
stream about to run is swapped into. Its forwards read and write the workspace, so one set of
graphs, captured at start-up, serves every stream.

Swapping in copies the stream's filled slots from its home storage (the pool's, without
staging); swapping out copies back only the slots written since. The stream's `StreamCache`
keeps its ring bookkeeping throughout; only its `storage` attribute points at the workspace
while it is attached. At wan2.1-1.3b's sink 3 + window 9 a swap-in moves 12 frames of K and V
(3.2 GiB), about 1.5 ms on an H200; the scheduler finishes a chunk before it switches streams
when nobody is about to stall, so that is paid about once per chunk.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from kvcache.cache import StreamCache
from kvcache.spec import CacheSpec
from kvcache.storage import DenseStorage, KVStorage


class Workspace:
    """Staged dense storage that one stream's cache at a time is attached to."""

    def __init__(self, spec: CacheSpec, device: torch.device | str) -> None:
        if spec.quant != "none" or spec.staging_frames == 0:
            raise ValueError(f"a workspace is dense storage with staging, got quant={spec.quant!r}, "
                             f"staging_frames={spec.staging_frames}")
        self.spec = spec
        self.storage = DenseStorage(spec, device)
        self.owner: StreamCache | None = None  # the attached stream's cache
        self._home: KVStorage | None = None  # the owner's own storage while it is attached
        self._dirty: set[int] = set()  # slots the owner wrote since it was attached
        self.switches = 0  # attachments that copied a stream in

    @property
    def nbytes(self) -> int:
        return self.storage.nbytes

    def fits(self, cache: StreamCache) -> bool:
        """Whether `cache` can be attached: dense, the workspace's shape and dtype, no staging of its own."""
        s, w = cache.spec, self.spec
        return (
            type(cache.storage) is DenseStorage
            and cache.spec.staging_frames == 0
            and (s.num_layers, s.num_heads, s.head_dim, s.tokens_per_frame, s.dtype)
            == (w.num_layers, w.num_heads, w.head_dim, w.tokens_per_frame, w.dtype)
            and s.capacity_frames <= w.capacity_frames
        )

    def attach(self, cache: StreamCache) -> bool:
        """Make `cache` read and write the workspace; True if that copied it in (a switch)."""
        if self.owner is cache:
            return False
        if not self.fits(cache):
            raise ValueError(f"stream cache {cache.spec} cannot use the workspace {self.spec}")
        self.detach()
        home, n = cache.storage, cache.num_frames
        if n:
            self.storage.k[:, :n].copy_(home.k[:, :n])
            self.storage.v[:, :n].copy_(home.v[:, :n])
        self.owner, self._home = cache, home
        cache.storage = self.storage
        cache.touch()  # the rotated keys in the workspace are the previous owner's
        self.switches += 1
        return True

    def written(self, cache: StreamCache, slots: Iterable[int]) -> None:
        """A forward wrote `slots` of `cache` (a graph replay does that without the host seeing it)."""
        if cache is self.owner:
            self._dirty.update(slots)

    def detach(self) -> None:
        """Copy what the owner wrote back to its home storage and give that back to it."""
        cache, home = self.owner, self._home
        if cache is None:
            return
        for slot in sorted(self._dirty):
            home.k[:, slot].copy_(self.storage.k[:, slot])
            home.v[:, slot].copy_(self.storage.v[:, slot])
        cache.storage = home
        self._release()

    def release(self, cache: StreamCache) -> None:
        """`cache` is going away: forget it without copying anything back."""
        if cache is self.owner:
            cache.storage = self._home
            self._release()

    def _release(self) -> None:
        self.owner, self._home = None, None
        self._dirty.clear()
