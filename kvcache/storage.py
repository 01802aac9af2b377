"""Where a stream's K/V frames live. Dense storage here; quantized storage (kvcache/quant.py)
implements the same interface, and `make_storage` (kvcache/cache.py) picks one by `CacheSpec.quant`."""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from kvcache.spec import CacheSpec

_uids = itertools.count()


class KVStorage(ABC):
    """`spec.capacity_frames` frame slots of K and V for every layer of one stream.

    Slots [0, sink_frames) hold sinks, the rest the window. The ring logic lives in
    `StreamCache`; a storage only maps slot numbers to memory.
    """

    def __init__(self, spec: CacheSpec, device: torch.device | str) -> None:
        self.spec = spec
        self.device = torch.device(device)
        self.uid = next(_uids)  # never reused: what a CUDA graph that reads this storage is keyed on

    @abstractmethod
    def write(self, layer: int, slots: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Store frames. k, v: [len(slots), T, H, D] (keys before RoPE)."""

    @abstractmethod
    def read(self, layer: int, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of slots [0, num_slots) in `spec.dtype`: each [num_slots, T, H, D].

        The result may be a view of the storage or a reused scratch buffer: it is valid
        until the next read or write of the same layer.
        """

    @property
    def staging_frames(self) -> int:
        """Frames of room `staged` offers before slot 0 (0: none)."""
        return 0

    def staged(self, layer: int, num_own: int, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `num_own` frames of staging (a forward's own, which it writes) followed by
        slots [0, num_slots), each one tensor [num_own + num_slots, T, H, D]: the values are the
        stored ones, the keys a copy that the caller keeps rotated (StreamCache.keys_rotated says
        when it is current). Needs num_own <= `staging_frames`."""
        raise NotImplementedError(f"{type(self).__name__} has no staging")

    @abstractmethod
    def tensors(self) -> list[torch.Tensor]:
        """Every tensor this storage allocated (for exact accounting)."""

    def host_state(self) -> object:
        """What the storage keeps on the host besides `tensors()` (parking moves both; None: nothing)."""
        return None

    def load_host_state(self, state: object) -> None:
        """Take `host_state()` of a parked storage of the same spec."""

    @classmethod
    def bytes_for(cls, spec: CacheSpec) -> int:
        """Bytes `tensors()` will hold for `spec`, computed without allocating (the spec counts them)."""
        return spec.stream_bytes()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


class DenseStorage(KVStorage):
    """K/V stored in `spec.dtype` (bf16 or fp32): reads are views, no copy. With
    `spec.staging_frames`, each layer has that many frames of room before slot 0 in its values and
    in a copy of its keys that attention reads rotated (`staged`)."""

    def __init__(self, spec: CacheSpec, device: torch.device | str) -> None:
        super().__init__(spec, device)
        frame = (spec.tokens_per_frame, spec.num_heads, spec.head_dim)
        # k, v: [L, slots, T, H, D]. v is a view of the values with their staging, [L, staging + slots,
        # T, H, D]; rotated_k holds the keys as attention reads them, in that same layout.
        self.k = torch.zeros(spec.num_layers, spec.capacity_frames, *frame, dtype=spec.torch_dtype, device=self.device)
        self._staged_v = torch.zeros(spec.num_layers, spec.staging_frames + spec.capacity_frames, *frame,
                                     dtype=spec.torch_dtype, device=self.device)
        self.v = self._staged_v[:, spec.staging_frames :]
        self.rotated_k = torch.zeros_like(self._staged_v) if spec.staging_frames else None

    def write(self, layer: int, slots: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        if len(slots) == 0:
            return
        start = slots[0]
        if list(slots) == list(range(start, start + len(slots))):
            self.k[layer, start : start + len(slots)] = k
            self.v[layer, start : start + len(slots)] = v
        else:
            self.write_indexed(layer, torch.as_tensor(list(slots), device=self.device), k, v)

    def write_indexed(self, layer: int, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """`write` with the slots as a device tensor ([n] int64): what a CUDA graph replays with any slots."""
        self.k[layer].index_copy_(0, index, k.to(self.k.dtype))
        self.v[layer].index_copy_(0, index, v.to(self.v.dtype))

    def read(self, layer: int, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer, :num_slots], self.v[layer, :num_slots]

    @property
    def staging_frames(self) -> int:
        return self.spec.staging_frames

    def staged(self, layer: int, num_own: int, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= num_own <= self.staging_frames:
            raise ValueError(f"{num_own} frames of staged K/V, the storage has room for {self.staging_frames}")
        frames = slice(self.staging_frames - num_own, self.staging_frames + num_slots)
        return self.rotated_k[layer, frames], self._staged_v[layer, frames]

    def tensors(self) -> list[torch.Tensor]:
        return [self.k, self._staged_v] + ([self.rotated_k] if self.rotated_k is not None else [])
