"""Where a new stream goes: pure logic over what each replica reports (no Ray, no asyncio).

Each replica reports `ReplicaStats` through Serve's routing stats (streamsvc/cluster/replica.py,
`record_routing_stats`); the router (streamsvc/cluster/router.py) ranks the replicas with
`rank_replicas` for every new stream. Stats are a little old when they arrive (one stats period plus
the controller's broadcast), so the router counts the streams it placed since (`pending`) against the
replica's room. The ranking only orders: the engine's admission on the chosen replica decides, and a
refusal reaches the viewer with its reason (so a full cluster still sends the stream somewhere: to
the replica most likely to take it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ReplicaStats:
    """One replica's routing stats (Serve passes them as a dict: `to_dict` / `from_dict`)."""

    replica: str  # Serve's replica id (its unique_id)
    ready: bool = False  # the engine has warmed up and takes streams
    draining: bool = False  # takes no new streams (drain() was called); its streams play on
    streams: int = 0  # open streams
    free_kv_bytes: int = 0  # KV pool budget not held by streams
    stream_kv_bytes: int = 0  # what one more stream holds (its KV cache and decoder state)
    predicted_load: float = 0.0  # the scheduler's predicted busy fraction of the engine
    utilization_target: float = 1.0  # admission keeps predicted_load under this
    host: str = ""  # the node's address (its WebRTC candidates)
    node: str = ""  # the Ray node it runs on (its id, hex)
    pid: int = 0  # the replica's process
    metrics: Mapping[str, float] | None = None  # the replica's /metrics samples, {'name{labels}': value}
    styles: tuple[Mapping, ...] = ()  # the styles it offers, as its GET /loras lists them (serve --lora-dir)

    def to_dict(self) -> dict:
        return {k: (dict(v) if isinstance(v, Mapping) else [dict(x) for x in v] if k == "styles" else v)
                for k, v in self.__dict__.items()}

    @classmethod
    def from_dict(cls, d: Mapping) -> ReplicaStats | None:
        """None for an empty or foreign dict (a replica that has not reported yet)."""
        if not d or "replica" not in d:
            return None
        fields = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        if "styles" in fields:
            fields["styles"] = tuple(fields["styles"])
        return cls(**fields)

    def room(self, pending: int = 0) -> bool:
        """Whether one more stream fits, counting `pending` placed since these stats: KV for it, and load
        under the target (each stream's load estimated as the average of the open ones)."""
        if not self.ready or self.draining:
            return False
        if self.free_kv_bytes - pending * self.stream_kv_bytes < self.stream_kv_bytes:
            return False
        per_stream = self.predicted_load / self.streams if self.streams else 0.0
        return self.predicted_load + (pending + 1) * per_stream <= self.utilization_target

    def free_after(self, pending: int) -> int:
        return self.free_kv_bytes - pending * self.stream_kv_bytes


def rank_replicas(stats: Sequence[ReplicaStats], pending: Mapping[str, int] | None = None,
                  exclude: frozenset[str] | set[str] = frozenset()) -> list[str]:
    """Replica ids, best first, for a new stream: those with room (most free KV first, then least load),
    then the ready ones without room (their admission refuses with its reason), then the draining ones
    and those not ready. Replicas in `exclude` (seen failing) are left out."""
    pending = pending or {}

    def key(s: ReplicaStats):
        p = pending.get(s.replica, 0)
        tier = 0 if s.room(p) else 1 if s.ready and not s.draining else 2
        return tier, -s.free_after(p), s.predicted_load, s.streams + p, s.replica

    return [s.replica for s in sorted((s for s in stats if s.replica not in exclude), key=key)]
