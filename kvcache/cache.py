"""One stream's KV cache: sink frames that stay, and a ring window that rolls without copying."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcache.quant import QuantStorage
from kvcache.spec import CacheSpec
from kvcache.storage import DenseStorage, KVStorage


def make_storage(spec: CacheSpec, device: torch.device | str) -> KVStorage:
    """A new storage of the kind `spec.quant` names: dense for "none", quantized for int4 / int2."""
    return (DenseStorage if spec.quant == "none" else QuantStorage)(spec, device)


class StreamCache:
    """Sinks + ring window over a `KVStorage`.

    Filled slots are always the prefix [0, num_frames): sinks fill first, then the window
    slots in order; once the window is full, a commit overwrites its oldest slot (`head`)
    and moves `head` on. Nothing is copied to roll.

    Positions are cache-relative: sinks sit at 0..S-1, the window's frames at S.. in time
    order, and the chunk being denoised right after them. `positions()` gives each
    physical slot's position so RoPE can be applied at read time.

    `version` changes with every change to what a slot holds or where it sits. Storage with
    staging keeps a rotated copy of the keys; `keys_rotated` says whether that copy is current.
    """

    def __init__(self, spec: CacheSpec, device: torch.device | str = "cpu", storage: KVStorage | None = None):
        self.spec = spec
        self.storage = storage if storage is not None else make_storage(spec, device)
        self.version = 0
        self.reset()

    def reset(self) -> None:
        self.sinks_filled = 0  # sink slots written, 0..S
        self.window_filled = 0  # window slots written, 0..W
        self.head = 0  # window slot (0..W-1) holding the oldest window frame
        self.frames_seen = 0  # frames committed over the stream's life
        # absolute frame index held by each physical slot (-1: empty), for inspection and tests
        self.frame_ids = [-1] * self.spec.capacity_frames
        self.touch()

    def touch(self) -> None:
        """Mark the contents or positions changed: the rotated keys are stale."""
        self.version += 1
        self._rotated: tuple[int, int] | None = None  # (version, slots) the rotated keys were made at

    def keys_rotated(self, num_slots: int) -> bool:
        """Whether the storage's rotated keys of slots [0, num_slots) are current (`note_rotated`
        since the last change), so a forward may read them without rotating again."""
        return self._rotated == (self.version, num_slots)

    def note_rotated(self, num_slots: int) -> None:
        """A forward has rotated slots [0, num_slots) into the storage's rotated keys."""
        self._rotated = (self.version, num_slots)

    @property
    def num_frames(self) -> int:
        """Committed frames currently held (the filled slot prefix)."""
        return self.sinks_filled + self.window_filled

    @property
    def nbytes(self) -> int:
        return self.storage.nbytes

    def positions(self, num_slots: int | None = None) -> list[int]:
        """Cache-relative temporal position of each physical slot in [0, num_slots)."""
        n = self.num_frames if num_slots is None else num_slots
        s, w = self.spec.sink_frames, self.spec.window_frames
        out = []
        for slot in range(n):
            if slot < s:
                out.append(slot)
            else:
                out.append(s + (slot - s - self.head) % w)
        return out

    def plan_commit(self, num_frames: int) -> list[int]:
        """Slots the next `num_frames` committed frames go to, in time order (nothing changes yet)."""
        s, w = self.spec.sink_frames, self.spec.window_frames
        sinks, window, head = self.sinks_filled, self.window_filled, self.head
        slots = []
        for _ in range(num_frames):
            if sinks < s:
                slots.append(sinks)
                sinks += 1
            elif w == 0:
                raise ValueError("cache has no window and its sinks are full: nothing more can be committed")
            elif window < w:
                slots.append(s + window)
                window += 1
            else:
                slots.append(s + head)
                head = (head + 1) % w
        if len(set(slots)) != len(slots):
            raise ValueError(f"a commit of {num_frames} frames overruns the window of {w} frames")
        return slots

    def write(self, layer: int, slots: Sequence[int], k: torch.Tensor, v: torch.Tensor,
              index: torch.Tensor | None = None) -> None:
        """Store one layer's K/V ([len(slots), T, H, D], keys before RoPE) at `slots`; `index`, a
        device tensor of the same slots, lets a CUDA graph write wherever its replay is told to."""
        if index is None:
            self.storage.write(layer, slots, k, v)
        else:
            self.storage.write_indexed(layer, index, k, v)
        self.touch()

    def read(self, layer: int, num_slots: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K/V of slots [0, num_slots): each [num_slots, T, H, D]."""
        return self.storage.read(layer, self.num_frames if num_slots is None else num_slots)

    def advance(self, slots: Sequence[int]) -> None:
        """Mark the frames written at `slots` (from `plan_commit`) as committed."""
        s, w = self.spec.sink_frames, self.spec.window_frames
        for slot in slots:
            if slot < s:
                assert slot == self.sinks_filled, (slot, self.sinks_filled)
                self.sinks_filled += 1
            elif self.window_filled < w:
                assert slot == s + self.window_filled, (slot, self.window_filled)
                self.window_filled += 1
            else:
                assert slot == s + self.head, (slot, self.head)
                self.head = (self.head + 1) % w
            self.frame_ids[slot] = self.frames_seen
            self.frames_seen += 1
        self.touch()

    def window_slots_in_order(self) -> list[int]:
        """Physical window slots from oldest to newest."""
        s, w = self.spec.sink_frames, self.spec.window_frames
        return [s + (self.head + i) % w for i in range(self.window_filled)] if w else []

    def relayout_window(self) -> list[int]:
        """Forget the window's order so it can be rewritten in time order from slot S (recache).

        Returns the slots the recomputed frames go to, oldest first; frame ids are kept.
        """
        ids = [self.frame_ids[slot] for slot in self.window_slots_in_order()]
        s = self.spec.sink_frames
        self.head = 0
        slots = list(range(s, s + len(ids)))
        for slot, fid in zip(slots, ids):
            self.frame_ids[slot] = fid
        self.touch()
        return slots
