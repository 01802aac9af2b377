"""The cluster's parts that need no Ray: placement over the replicas' routing stats (streamsvc/cluster/placement.py),
the replica's health check, `streamsvc serve` without --cluster importing no Ray, and the relay of a viewer's
WebSocket (the gateway's code and the replica's `session`/`feed` and its viewers' drivers around a real `Server`, the
handle's calls made in this process instead of through Ray Serve)."""

import asyncio
import contextlib
import subprocess
import sys
from types import SimpleNamespace

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from streamsvc.cluster.placement import ReplicaStats, rank_replicas
from streamsvc.cluster.replica import EngineReplica, ReplicaConfig, stale_leases
from streamsvc.engine.config import EngineConfig
from streamsvc.engine.engine import Engine
from streamsvc.viewers.server import Server, ServerConfig
from streamsvc.wire import protocol as P

KV = 100  # one stream's KV bytes in these tests


def replica(name: str, free: int, streams: int = 0, load: float = 0.0, **kw) -> ReplicaStats:
    return ReplicaStats(replica=name, ready=True, streams=streams, free_kv_bytes=free, stream_kv_bytes=KV,
                        predicted_load=load, utilization_target=0.9, **kw)


def test_the_replica_with_the_most_free_kv_comes_first():
    assert rank_replicas([replica("a", 300), replica("b", 500), replica("c", 400)]) == ["b", "c", "a"]


def test_the_cluster_forgets_replicas_and_gateways_of_long_ago():
    """Over a long run the router's placements are those of the last PENDING_S (a replica placed on long ago, or
    replaced since, keeps no entry) and a replica's leases those of gateways that hold a session or renewed lately."""
    pytest.importorskip("ray.serve")  # the router module imports Ray (no instance is started)
    from streamsvc.cluster.router import PENDING_S, Board

    board = Board()
    for uid, at in (("old", 0.0), ("old", 1.0), ("new", 10.0), ("new", 10.5)):
        board.placed.setdefault(uid, []).append(at)
    assert board.pending(10.0 + PENDING_S / 2) == {"new": 2} and set(board.placed) == {"new"}
    assert board.pending(11.0 + PENDING_S) == {} and board.placed == {}
    leases = {"g-gone": 0.0, "g-holding": 0.0, "g-renewed": 95.0}
    owner = {"conn1": "g-holding"}
    assert stale_leases(leases, owner, now=100.0, lease_s=10.0) == ["g-gone"]
    assert stale_leases(leases, {}, now=100.0, lease_s=10.0) == ["g-gone", "g-holding"]


def test_streams_placed_since_the_stats_count_against_their_replica():
    stats = [replica("a", 500), replica("b", 400)]
    assert rank_replicas(stats, pending={"a": 2}) == ["b", "a"]  # a: 300 free once its 2 pending streams open


def test_replicas_without_room_come_after_those_with_room_and_draining_or_starting_ones_last():
    stats = [replica("full", 50), replica("busy", 900, streams=3, load=0.75), replica("ok", 200),
             replica("drain", 900, draining=True), ReplicaStats(replica="new")]
    # busy: 3 streams at 0.75 load, one more makes 1.0 > 0.9; full: no KV for one more
    assert rank_replicas(stats) == ["ok", "busy", "full", "drain", "new"]


def test_when_none_has_room_the_best_still_comes_first_so_its_admission_refuses_with_the_reason():
    assert rank_replicas([replica("a", 50), replica("b", 80)]) == ["b", "a"]


def test_replicas_seen_failing_are_left_out():
    assert rank_replicas([replica("a", 500), replica("b", 400)], exclude={"a"}) == ["b"]


def test_stats_round_trip_through_the_dict_serve_carries():
    s = replica("a", 500, streams=2, load=0.3, host="10.0.0.2", pid=7, metrics={"streamsvc_chunks_total": 3.0},
                styles=({"name": "ink", "rank": 8, "bytes": 4096, "loaded": True, "error": None},))
    assert ReplicaStats.from_dict(s.to_dict()) == s
    assert ReplicaStats.from_dict(s.to_dict()).styles[0]["name"] == "ink"
    assert ReplicaStats.from_dict({}) is None


def test_check_health_fails_once_the_engine_thread_has_not_turned_for_stall_s():
    now = [100.0]
    engine = Engine(EngineConfig(), on_chunk=lambda *a: None, on_error=lambda *a: None, clock=lambda: now[0])
    # no Ray: the check reads the replica's engine and config only
    replica = SimpleNamespace(config=ReplicaConfig(engine=EngineConfig(), stall_s=10.0),
                              server=SimpleNamespace(engine=engine))
    EngineReplica.check_health(replica)  # not started: building and warming up counts as healthy
    engine.heartbeat_at = 95.0
    EngineReplica.check_health(replica)
    now[0] = 106.0
    with pytest.raises(RuntimeError, match="stalled: its loop has not turned for 11.0 s"):
        EngineReplica.check_health(replica)


def test_serve_without_cluster_imports_no_ray():
    code = ("import sys, streamsvc.cli as c; a = c.build_parser().parse_args(['serve']); "
            "assert a.cluster is None; assert 'ray' not in sys.modules, 'ray imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ---------------------------------------------------------------- the relay, without Ray

T = 20.0  # bound on anything that takes a second or two on a busy 2-core machine


class _Call:
    """A Serve handle's call made in this process: awaitable (a response) or async-iterable (stream=True)."""

    def __init__(self, coro_or_gen) -> None:
        self._it = coro_or_gen
        self._task: asyncio.Task | None = None

    def __await__(self):
        self._task = asyncio.ensure_future(self._it)
        return self._task.__await__()

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self._it.__anext__()

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()
        elif hasattr(self._it, "aclose"):  # a session call: its generator's finally runs, as Serve's cancel does
            asyncio.ensure_future(self._it.aclose())


class _LocalHandle:
    """The engine deployment's handle, its replicas in this process: a call pinned with ``replica=`` goes to that
    one (as EngineRouter routes it), a new session to the first that is not draining."""

    deployment_name = "relay-test"

    def __init__(self, replicas: dict) -> None:
        self.replicas = replicas
        self._method = ""

    def options(self, method_name: str, stream: bool = False) -> "_LocalHandle":
        h = _LocalHandle(self.replicas)
        h._method = method_name
        return h

    def remote(self, *args, **kwargs) -> _Call:
        pinned = kwargs.get("replica")
        replica = self.replicas[pinned] if pinned else next(
            (r for r in self.replicas.values() if not r.draining), next(iter(self.replicas.values())))
        return _Call(getattr(EngineReplica, self._method)(replica, *args, **kwargs))


@contextlib.asynccontextmanager
async def relayed(uids: tuple[str, ...] = ("r1",)):
    """A gateway on a free port whose replicas run the tiny preset on CPU in this process: (gateway, replicas)."""
    pytest.importorskip("ray.serve")  # the gateway's router module imports Ray (no instance is started)
    from streamsvc.cluster.gateway import Gateway, GatewayConfig
    from streamsvc.cluster.replica import stream_prefix

    replicas = {}
    try:
        for uid in uids:
            server = Server(EngineConfig(), ServerConfig(port=0, stream_prefix=stream_prefix(uid)))
            await asyncio.wait_for(server.start(listen=False), 60)
            replicas[uid] = SimpleNamespace(server=server, draining=False, uid=uid, host="127.0.0.1", inboxes={}, outlets={},
                                            owner={}, leases={})
        g = Gateway(_LocalHandle(replicas), ServerConfig(port=0), GatewayConfig(call_timeout_s=5, place_timeout_s=T))
        g.board.replicas = dict.fromkeys(uids)  # what the router would have learnt
        await asyncio.wait_for(g.start(), T)
        try:
            yield g, list(replicas.values())
        finally:
            await g.stop()
    finally:
        for r in replicas.values():
            await asyncio.wait_for(r.server.stop(), 30)


async def _until_closed(ws) -> list:
    """Every message until the socket closes: text ones parsed, chunks as 'chunk'."""
    seen = []
    with contextlib.suppress(ConnectionClosed):
        async with asyncio.timeout(T):
            async for raw in ws:
                seen.append("chunk" if isinstance(raw, bytes) else P.parse_server(raw))
    return seen


async def _started(g, first: P.Start | P.Watch = P.Start(prompt="a red fox", seed=1)) -> tuple[object, P.Ready]:
    """A viewer's socket through the gateway once its first chunk came, and its `ready`."""
    ws = await connect(f"ws://127.0.0.1:{g.port}/ws", compression=None, max_size=P.MAX_CHUNK_BYTES)
    await ws.send(P.encode(first))
    async with asyncio.timeout(T):
        ready = P.parse_server(await ws.recv())
        assert isinstance(ready, P.Ready), ready
        while not isinstance(await ws.recv(), bytes):  # a chunk: the stream plays
            pass
    return ws, ready


async def test_a_viewer_that_sends_close_through_the_gateway_gets_closed_before_the_socket_closes():
    async with relayed() as (g, (replica,)):
        ws, _ = await _started(g)
        await ws.send(P.encode(P.Close()))
        seen = await _until_closed(ws)
        texts = [m for m in seen if m != "chunk"]
        assert texts and isinstance(texts[-1], P.Closed) and texts[-1].reason == "closed by client", seen
        assert ws.close_code == 1000
        assert await _wait(lambda: not replica.inboxes and not g.sessions and not replica.server.sessions)


async def test_a_session_the_replica_ends_on_its_own_still_tells_its_viewer_closed():
    """The lease reaper ends a session by ending its viewer's input (as the viewer's leaving does): a viewer
    still there (its gateway's renewals came late) gets `closed` before its socket closes, not a bare close."""
    async with relayed() as (g, (replica,)):
        ws, _ = await _started(g)
        (inbox,) = replica.inboxes.values()
        inbox.put_nowait(None)  # what EngineReplica._reap does
        seen = await _until_closed(ws)
        texts = [m for m in seen if m != "chunk"]
        assert texts and isinstance(texts[-1], P.Closed), seen
        assert await _wait(lambda: not replica.inboxes and not g.sessions and not replica.server.sessions)


async def _answer(g, first: P.Watch) -> P.ServerMessage:
    """The gateway's first answer to a viewer's first message."""
    async with connect(f"ws://127.0.0.1:{g.port}/ws", compression=None) as ws:
        await ws.send(P.encode(first))
        async with asyncio.timeout(T):
            return P.parse_server(await ws.recv())


async def test_a_watch_link_through_the_gateway_reaches_the_replica_that_runs_the_stream():
    """The gateway relays a watch as the viewer sent it, secret and all, to the replica its id names; the replica
    checks the secret (the gateway knows none), as it checks a take's steer secret relayed with later messages."""
    async with relayed(("r1", "r2")) as (g, (r1, r2)):
        r1.draining = True  # new streams go to r2; r1 still answers watches (it runs none here)
        steerer, ready = await _started(g)
        assert ready.stream_id.startswith("r2-") and list(r2.server.sessions) == [ready.stream_id]
        assert ready.watch_secret and ready.steer_secret  # the replica's, relayed to its steerer
        sid = ready.stream_id
        # without the secret, or with a wrong one, the replica refuses: as the gateway does an id of no replica
        refusals = [await _answer(g, watch) for watch in (
            P.Watch(stream_id=sid), P.Watch(stream_id=sid, secret=ready.steer_secret),
            P.Watch(stream_id="r9-s0", secret=ready.watch_secret), P.Watch(stream_id="s0", secret=ready.watch_secret))]
        assert all(isinstance(a, P.Error) and a.code == P.ErrorCode.NOT_FOUND for a in refusals), refusals
        texts = {a.message.replace(repr(w), "ID") for a, w in zip(refusals, (sid, sid, "r9-s0", "s0"))}
        assert len(texts) == 1, texts  # one answer, whichever refused it
        assert r2.server.metrics.registry.get_sample_value("streamsvc_refusals_total", {"reason": "secret"}) == 2
        assert r2.server.sessions[sid].watchers == 0 and not g.watchers
        watcher, seen = await _started(g, P.Watch(stream_id=ready.stream_id, secret=ready.watch_secret))
        assert seen.watch_secret is None and seen.steer_secret is None
        assert seen.role == "watch" and seen.stream_id == ready.stream_id
        assert r2.server.sessions[ready.stream_id].watchers == 1 and len(g.watchers) == 1 and len(g.sessions) == 1
        await watcher.send(P.encode(P.SetPrompt(prompt="a blue whale")))  # relayed; the replica refuses it
        async with asyncio.timeout(T):
            errors = []
            while not errors:
                raw = await watcher.recv()
                errors = [m for m in [P.parse_server(raw)] if isinstance(m, P.Error)] if isinstance(raw, str) else []
        assert errors[0].code == P.ErrorCode.NOT_STEERER
        for other in ("r1-s0", "r9-s0", "s0"):  # r1 runs no such stream; r9 is no replica; no replica named
            answer = await _answer(g, P.Watch(stream_id=other, secret=ready.watch_secret))
            assert isinstance(answer, P.Error) and answer.code == P.ErrorCode.NOT_FOUND, (other, answer)
        # the steerer leaves; a take through the gateway needs the steer secret, which the replica checks
        await steerer.close()
        assert await _wait(lambda: r2.server.sessions[sid].steerer is None)
        for take in (P.Take(), P.Take(secret=ready.watch_secret)):
            await watcher.send(P.encode(take))
            answer = await _reply(watcher, "take")
            assert answer.code == P.ErrorCode.NOT_STEERER and "steer secret" in answer.message, (take, answer)
        await watcher.send(P.encode(P.Take(secret=ready.steer_secret)))
        assert isinstance(await _reply(watcher, "take"), P.Ack)
        assert r2.server.sessions[sid].steerer is not None and len(g.sessions) == 0
        await watcher.close()  # the stream's last viewer, its steerer now: the stream ends
        assert await _wait(lambda: not g.watchers and not r2.server.sessions and not r2.inboxes)


async def _reply(ws, request: str) -> P.Ack | P.Error:
    """The next ack or error that answers `request` on a viewer's socket (chunks and other messages skipped)."""
    async with asyncio.timeout(T):
        while True:
            raw = await ws.recv()
            msg = P.parse_server(raw) if isinstance(raw, str) else None
            if isinstance(msg, (P.Ack, P.Error)) and msg.request == request:
                return msg


async def _wait(predicate, timeout_s: float = T) -> bool:
    for _ in range(int(timeout_s / 0.05)):
        if predicate():
            return True
        await asyncio.sleep(0.05)
    return predicate()
