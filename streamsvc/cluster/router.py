"""The Serve request router of the engine replicas (runs in the gateway's process, inside its handle).

Two kinds of calls reach the replicas through it:

- a new session (`session`): ranked by `placement.rank_replicas` over the replicas' routing stats,
  counting the sessions this router placed since the stats were taken;
- everything else about a session (`feed`, `renew`, `drain`, ...), which carries ``replica=<id>`` in
  its keyword arguments: only that replica. A replica that is gone matches nothing, and the call waits
  for it until the caller's timeout (the gateway bounds every such call).

`Board` lets the gateway see what the router sees (the live replicas and their stats, for /metrics and
/healthz) and tell it about a replica it saw fail, which no new session goes to from then on.
"""

from __future__ import annotations

import importlib
import time
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from streamsvc.cluster.placement import ReplicaStats, rank_replicas

PENDING_S = 3.0  # a placement counts against its replica's room this long (stats arrive within ~1 s)
STRICT_TRIES = 3  # a new session goes to the best replica only, this many tries (Serve backs off between them)
LOST_S = 60.0  # a replica seen failing gets no new session this long (Serve drops it from the list sooner)


class Board:
    """The replicas one deployment's router knows, shared with the gateway in the same process."""

    def __init__(self) -> None:
        self.replicas: dict[str, RunningReplica] = {}  # unique id -> replica
        self.lost: dict[str, float] = {}  # unique id -> when the gateway saw it fail (time.monotonic)
        self.placed: dict[str, list[float]] = {}  # unique id -> when this router chose it for a new session
        self.routed: dict[str, str] = {}  # conn id -> the replica its session call went to (until placed)

    def stats(self) -> list[ReplicaStats]:
        out = []
        for uid, r in list(self.replicas.items()):
            s = ReplicaStats.from_dict(r.routing_stats or {})
            out.append(s if s is not None else ReplicaStats(replica=uid))
        return out

    def mark_lost(self, uid: str) -> None:
        self.lost[uid] = time.monotonic()

    def excluded(self, now: float) -> set[str]:
        for uid in [u for u, t in self.lost.items() if now - t > LOST_S]:
            del self.lost[uid]
        return set(self.lost)

    def pending(self, now: float) -> dict[str, int]:
        """Sessions this router placed on each replica within PENDING_S; a replica with none has no entry (over a
        long run the replicas replaced would otherwise each keep one)."""
        out = {}
        for uid in list(self.placed):
            times = [t for t in self.placed[uid] if now - t < PENDING_S]
            if times:
                self.placed[uid] = times
                out[uid] = len(times)
            else:
                del self.placed[uid]
        return out


BOARDS: dict[str, Board] = {}
"""deployment name -> its board, in this process (the gateway's)."""


def board(deployment: str) -> Board:
    return BOARDS.setdefault(deployment, Board())


class EngineRouter(RequestRouter):
    """New sessions to the replica with room (most free KV); a session's other calls to its replica."""

    def initialize_state(self, **kwargs) -> None:
        # Serve hands the handle a copy of this class made by cloudpickle, whose module globals are its own:
        # the board comes from the module itself, as the gateway sees it
        self.board = importlib.import_module(__name__).board(self._deployment_id.name)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.board.replicas = {r.replica_id.unique_id: r for r in replicas}

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        kwargs = pending_request.kwargs if pending_request is not None else {}
        if pending_request is not None:  # no locality passes here: when none takes it, back off before the next try
            pending_request.routing_context.should_backoff = True
        pinned = kwargs.get("replica")
        if pinned is not None:
            return [[by_id[pinned]]] if pinned in by_id else []
        if pending_request is None or kwargs.get("new_session") is not True:  # ping, metrics: any replica
            return [list(candidate_replicas)]
        now = time.monotonic()
        stats = [ReplicaStats.from_dict(r.routing_stats or {}) or ReplicaStats(replica=uid) for uid, r in by_id.items()]
        excluded = self.board.excluded(now) | set(kwargs.get("exclude") or ())
        ranked = rank_replicas(stats, self.board.pending(now), excluded)
        # Serve tries the ranks in order and skips a replica that does not answer its queue-length probe in
        # time (a busy CPU replica may not): the best one alone for the first tries, every one after
        tries = getattr(pending_request, "streamsvc_tries", 0)
        pending_request.streamsvc_tries = tries + 1
        if tries < STRICT_TRIES:
            ranked = ranked[:1]
        if ranked:  # counted now: sessions routed at once (a burst of viewers) must see each other's choice
            self.board.placed.setdefault(ranked[0], []).append(now)
        return [[by_id[uid]] for uid in ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        if pending_request.kwargs.get("new_session") is True:
            if pending_request.args:
                self.board.routed[pending_request.args[0]] = replica_id.unique_id

