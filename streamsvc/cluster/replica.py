"""One engine per GPU as a Ray Serve replica: the same `Server` as `streamsvc serve`, without its socket.

A session is one streaming call, `session(...)`, from the gateway: it is the session's lease. Its
first item says where it runs (`Placement`); then come, in order, everything the server would have
sent on the viewer's WebSocket (text messages as str, chunks as bytes, and a `{"close": [code,
reason]}` where it would close the socket). The viewer's later messages arrive as `feed(...)` calls
pinned to this replica (streamsvc/cluster/router.py). Each viewer has a `ViewerDriver`
(streamsvc/viewers/driver.py) as a socket's viewer has, its `CallOutlet` the call back to the gateway, so admission,
rate limits, prompt coalescing, WebRTC signaling and every reply are the server's own code.

Ray does not cancel a streaming call whose caller died, so the gateway renews its sessions' leases
(`renew`, every second); a session not renewed for `lease_s` ends as if its viewer had left (a
gateway's death frees its streams' KV caches within a few seconds).

WebRTC: the server's peer connection lives here, so the SDP answer carries this host's candidates
(the node's address) and media flows directly between this replica and the browser; the gateway only
relays the signaling on the WebSocket.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from multidict import CIMultiDict

from streamsvc import library_logs
from streamsvc.door.entry import Client
from streamsvc.door.front import ConnectionClosed
from streamsvc.door.routes import HttpRequest
from streamsvc.engine.config import EngineConfig
from streamsvc.viewers.driver import ViewerDriver
from streamsvc.viewers.server import Server, ServerConfig
from streamsvc.wire import protocol as P

log = logging.getLogger("streamsvc.cluster.replica")


@dataclass(frozen=True)
class ReplicaConfig:
    """What every engine replica runs. `engine` may be a function that builds the EngineConfig on the
    replica's own host (its device, and defaults that depend on it), so the gateway needs no GPU."""

    engine: EngineConfig | Callable[[], EngineConfig]
    server: ServerConfig = ServerConfig(port=0)  # access rates, WebRTC (its host's candidates); never listens
    lease_s: float = 5.0  # a session whose gateway stopped renewing it this long ends
    stall_s: float = 10.0  # check_health fails when the engine thread's loop has not turned this long
    # niceness added to the engine (its thread and encoder processes) while it warms up, taken back after where
    # the OS lets it: on a shared host a replacement's warm-up then yields the CPU to the other replicas' streams
    warmup_nice: int = 0


class CallOutlet:
    """A viewer's outlet on a replica (a transport.ws.Outlet): what the server says to it becomes the items of its
    session's streaming call, for the gateway to send on the viewer's socket (text messages as str, chunks as bytes,
    ``{"close": [code, reason]}`` where the socket closes, ``{"allow_messages": n}`` where its message limit rises:
    the gateway's socket is the one that reads the viewer's messages). A None item ends the call. Sends fail
    (ConnectionClosed) once it closed, or once the call itself ended."""

    def __init__(self, conn_id: str) -> None:
        self.conn_id = conn_id
        self.items: asyncio.Queue[str | bytes | dict | None] = asyncio.Queue()
        self.closed = False

    async def send(self, message) -> None:
        await self.send_chunk(P.encode(message))

    async def send_chunk(self, payload: str | bytes) -> None:
        if self.closed:
            raise ConnectionClosed(f"relay {self.conn_id} closed")
        self.items.put_nowait(payload)

    async def close(self, code: int = 1000, reason: str = "", linger: bool = True) -> None:
        if not self.closed:  # (linger: the gateway's socket is the one that reads)
            self.items.put_nowait({"close": [code, reason]})
        self.closed = True

    def allow_messages(self, max_bytes: int) -> bool:
        if self.closed:
            return False
        self.items.put_nowait({"allow_messages": max_bytes})
        return True

    def buffered(self) -> int:
        return 0  # (the gateway's socket holds what it has not sent; a viewer that does not read holds up its relay)


@contextlib.contextmanager
def _niced(add: int):
    """Run the block at `add` more niceness (Linux: this thread, and the threads and processes it starts);
    afterwards this process's threads and children get their niceness back where permitted."""
    if add <= 0:
        yield
        return
    before = os.getpriority(os.PRIO_PROCESS, 0)
    os.setpriority(os.PRIO_PROCESS, 0, before + add)
    try:
        yield
    finally:
        for tid in _threads_and_children():
            with contextlib.suppress(OSError):  # lowering niceness needs CAP_SYS_NICE (or RLIMIT_NICE)
                os.setpriority(os.PRIO_PROCESS, tid, before)


def _threads_and_children() -> list[int]:
    """This process's thread ids and its children's pids (Linux /proc; empty elsewhere)."""
    ids = []
    with contextlib.suppress(OSError):
        for tid in os.listdir("/proc/self/task"):
            ids.append(int(tid))
            with contextlib.suppress(OSError, ValueError):
                ids += [int(c) for c in open(f"/proc/self/task/{tid}/children").read().split()]
    return ids


def stale_leases(leases: dict[str, float], owner: dict[str, str], now: float, lease_s: float) -> list[str]:
    """The gateways whose lease ran out and that hold no session here: forgotten (a gateway that comes back renews
    with its next session), so that over a long run the leases are those of the gateways of late."""
    holding = set(owner.values())
    return [g for g, renewed in leases.items() if g not in holding and now - renewed > lease_s]


def stream_prefix(replica_uid: str) -> str:
    """The prefix of a replica's stream ids: its id's letters and digits and a '-' (`s3` there is `<uid>-s3`)."""
    return "".join(c for c in replica_uid if c.isascii() and c.isalnum()) + "-"


async def _read(driver: ViewerDriver, inbox: asyncio.Queue, outlet: CallOutlet) -> None:
    """The viewer's messages to its driver, one at a time, in order, until they end (the viewer left, or the
    session ends here) or nothing more of them is read; then the viewer leaves and its last messages (its
    `closed`) still go out, for the gateway to relay to a viewer that is still there, and the call ends."""
    async def messages():
        while (message := await inbox.get()) is not None:
            yield message

    try:
        await driver.serve(messages())
    finally:
        outlet.items.put_nowait(None)


class EngineReplica:
    """The deployment's class (streamsvc/cluster/launch.py wraps it in `serve.deployment`)."""

    async def __init__(self, config: ReplicaConfig) -> None:
        import ray
        from ray import serve

        self.config = config
        library_logs.install()  # as `streamsvc serve` does: the libraries' lines gated as ours are
        # the engine thread and this loop share the GIL: as `streamsvc serve` does, hand it over sooner
        sys.setswitchinterval(5e-4)
        self.uid = serve.get_replica_context().replica_id.unique_id
        self.host = ray.util.get_node_ip_address()
        self.node = ray.get_runtime_context().get_node_id()
        engine = config.engine() if callable(config.engine) else config.engine
        server_cfg = config.server
        if not server_cfg.webrtc.ice_addresses:  # offer this node's address (and loopback on a loopback host)
            server_cfg = replace(server_cfg, host=self.host)
        server_cfg = replace(server_cfg, stream_prefix=stream_prefix(self.uid))  # watch links name this replica
        self.server = Server(engine, server_cfg)
        self.draining = False
        self.stream_kv_bytes = 0
        self.inboxes: dict[str, asyncio.Queue] = {}  # conn id -> its viewer's messages (`feed`)
        self.outlets: dict[str, CallOutlet] = {}  # conn id -> where its server's messages go
        self.leases: dict[str, float] = {}  # gateway id -> its latest renewal (time.monotonic)
        self.owner: dict[str, str] = {}  # conn id -> its gateway
        with _niced(config.warmup_nice):  # threads and processes started in here inherit it
            await self.server.start(listen=False)
        self.server.heap.freeze()  # the replica's process is its server's (streamsvc/engine/heap.py)
        gen = self.server.engine.gen
        self.stream_kv_bytes = gen.cache_spec().stream_bytes() + self.server.engine.decoder_bytes  # one stream's
        self._reaper = asyncio.create_task(self._reap())
        log.info("replica %s ready on %s (%s)", self.uid, self.host, engine.device)

    # -- sessions ----------------------------------------------------------------------------

    async def session(self, conn_id: str, start: str, address: str, gateway: str, new_session: bool = True,
                      exclude: tuple[str, ...] = (), replica: str | None = None):
        """One viewer's connection: its placement, then everything the server sends it (see the module's doc).
        `start` is the viewer's first message: a `start` (a new session, placed by the router) or a `watch` of a
        stream here (`replica` pins the call to this replica; a draining one still takes watchers)."""
        yield {"placed": self.uid, "host": self.host}
        if self.draining and new_session:
            yield P.encode(P.Error(code=P.ErrorCode.REFUSED, request="start",
                                   message=f"worker {self.uid} is draining and takes no new streams"))
            return
        outlet = CallOutlet(conn_id)
        driver = ViewerDriver(self.server, Client(address), outlet, self.server.guard.connection(outlet, address))
        inbox: asyncio.Queue[str | bytes | None] = asyncio.Queue()  # the viewer's messages (`feed`); None: they end
        self.inboxes[conn_id], self.outlets[conn_id] = inbox, outlet
        self.owner[conn_id] = gateway
        self.leases[gateway] = time.monotonic()
        inbox.put_nowait(start)
        reader = asyncio.create_task(_read(driver, inbox, outlet), name=f"relay-{conn_id}")
        try:
            while True:
                item = await outlet.items.get()
                if item is None:
                    return
                yield item
        finally:  # the stream ended, the gateway cancelled the call, or the lease ran out
            outlet.closed = True
            inbox.put_nowait(None)
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(reader), 5)
            self.inboxes.pop(conn_id, None)
            self.outlets.pop(conn_id, None)
            self.owner.pop(conn_id, None)

    async def feed(self, conn_id: str, message: str | bytes | None, replica: str) -> bool:
        """A viewer's message for its session (None: the viewer left). False when no such session."""
        inbox = self.inboxes.get(conn_id)
        if inbox is None:
            return False
        inbox.put_nowait(message)
        return True

    async def http(self, method: str, target: str, headers: list[tuple[str, str]], body: bytes, address: str,
                   replica: str) -> tuple[int, tuple[tuple[str, str], ...], bytes]:
        """A WHIP request (POST, or its session's DELETE) the gateway forwards to the replica that runs its stream
        (streamsvc/cluster/whip_relay.py): the server's answer (status, headers, body)."""
        answer = self.server.whep.handle(HttpRequest(method, target, CIMultiDict(headers), address, body))
        if inspect.isawaitable(answer):
            answer = await answer
        return answer.status.value, answer.headers, answer.body

    async def renew(self, gateway: str, replica: str) -> int:
        """The gateway is alive: its sessions here keep their lease. Returns how many it has here."""
        self.leases[gateway] = time.monotonic()
        return sum(1 for g in self.owner.values() if g == gateway)

    async def _reap(self) -> None:
        """End the sessions whose gateway stopped renewing (it died: Ray does not cancel their calls)."""
        while True:
            await asyncio.sleep(min(1.0, self.config.lease_s / 4))
            now = time.monotonic()
            for conn_id, gateway in list(self.owner.items()):
                if now - self.leases.get(gateway, now) > self.config.lease_s:
                    log.warning("session %s: its gateway %s stopped renewing; ending it", conn_id, gateway)
                    inbox = self.inboxes.get(conn_id)
                    if inbox is not None:
                        inbox.put_nowait(None)
                    self.owner.pop(conn_id, None)
            for gateway in stale_leases(self.leases, self.owner, now, self.config.lease_s):
                del self.leases[gateway]

    # -- operations ----------------------------------------------------------------------------

    async def drain(self, replica: str, draining: bool = True) -> int:
        """Take no new streams (False: take them again); the open ones play on. Returns how many are open.
        The router sends new streams elsewhere once the routing stats say so (within a stats period); one
        that comes here meanwhile is refused with the reason, and its viewer may retry."""
        self.draining = draining
        return len(self.server.sessions)

    async def info(self, replica: str | None = None) -> dict:
        return self.record_routing_stats()

    def record_routing_stats(self) -> dict:
        """Serve's routing stats: what the router places new streams by (placement.ReplicaStats)."""
        from streamsvc.cluster.placement import ReplicaStats

        engine = self.server.engine
        st = engine.stats()
        snap, sched = st.scheduler, engine.config.scheduler
        return ReplicaStats(
            replica=self.uid, ready=snap is not None, draining=self.draining, streams=len(self.server.sessions),
            free_kv_bytes=max(0, st.kv_budget_bytes - st.kv_used_bytes), stream_kv_bytes=self.stream_kv_bytes,
            predicted_load=snap.predicted_load if snap is not None else 0.0,
            utilization_target=sched.utilization_target, host=self.host, node=self.node, pid=os.getpid(),
            metrics=self._metrics(), styles=tuple(dataclasses.asdict(style) for style in engine.styles.listing),
        ).to_dict()

    def _metrics(self) -> dict[str, float]:
        """The replica's /metrics samples, {'name{labels}': value} (labels sorted, unquoted)."""
        self.server.refresh_metrics()
        out = {}
        for family in self.server.metrics.registry.collect():
            for s in family.samples:
                if s.name.endswith("_created"):  # prometheus_client's creation times: not figures
                    continue
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def check_health(self) -> None:
        """Serve's health check: fails when the engine thread has stalled or died."""
        stalled = self.server.engine.stalled_for()
        if stalled is not None and stalled > self.config.stall_s:
            raise RuntimeError(f"engine thread stalled: its loop has not turned for {stalled:.1f} s "
                               f"(limit {self.config.stall_s:g} s)")

    async def __del__(self) -> None:
        """Serve stops the replica (scaled down, replaced, drained past graceful_shutdown_timeout_s): its
        viewers hear `worker_lost` first, so that they reconnect and are placed on another replica."""
        self.draining = True
        lost = P.encode(P.Error(code=P.ErrorCode.WORKER_LOST, message=(
            f"worker {self.uid} is stopping; the stream is gone: connect again to be placed on another worker")))
        for outlet in list(self.outlets.values()):
            outlet.items.put_nowait(lost)
        with contextlib.suppress(Exception):
            await self.server.stop("worker stopping")
