"""The gateway: `streamsvc serve`'s HTTP/WebSocket front as a Ray driver, relaying each viewer to its replica.

It serves what `streamsvc serve` serves on one port (the player at /, /ws, /healthz, /metrics, /loras: the
replicas' styles, from their routing stats; and /replicas, the replicas' routing stats as JSON) and checks what a server checks (origins, tokens, the server cap,
per-client limits: the same door, streamsvc/door/), then hands each stream to an engine replica
(streamsvc/cluster/replica.py):

- the viewer's `start` opens one streaming call, `session`, placed by the request router on the
  replica with room (streamsvc/cluster/router.py); that call is the session's lease, renewed every
  second (`renew`) so that a replica ends the streams of a gateway that died;
- every item of the call goes to the viewer's WebSocket as it is (chunks as binary messages, the
  rest as text), and the viewer's later messages go to the same replica (`feed`), one at a time, in
  order;
- when the replica dies (its process, or its node), the call fails at once (a lost node: after about
  2.5 s): the viewer gets an `error` with code `worker_lost` (retryable: clients reconnect and are
  placed again, on another replica; the stream starts over) and its socket closes. A call that fails
  before its placement is retried on another replica, unseen by the viewer.

A `watch` goes to the replica that runs its stream, which its id names (a replica's stream ids are
`<replica>-s<n>`): the replica's server admits the watcher as its own (streamsvc/viewers/server.py), and the
relay is the same as a stream's. Watchers do not count against the gateway's stream caps. The gateway
knows no stream's secrets: the `watch` goes to the replica as the viewer sent it, watch secret and all,
and the replica checks it (as it checks a `take`'s steer secret, relayed with the viewer's later
messages); an id that names no replica gets the replica's own answer to a wrong secret, so that ids
cannot be probed through the gateway either.

WHEP and WHIP: a WHEP POST (streamsvc/door/whep.py) is admitted and placed as a /ws start is (`open_webrtc`), a
watch goes to its stream's replica, and its offer follows its start on the same relay; its DELETE ends the session
on the replica as a viewer's leaving does. A WHIP POST and its DELETE are forwarded to the stream's replica
(streamsvc/cluster/whip_relay.py).

WebRTC: signaling rides the relayed WebSocket; the answer comes from the replica's own peer
connection with its host's candidates, so media flows between the browser and the replica directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import itertools
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from streamsvc.cluster.placement import ReplicaStats
from streamsvc.cluster.replica import stream_prefix
from streamsvc.cluster.router import Board, board
from streamsvc.cluster.whip_relay import RelayedIngest
from streamsvc.door.access import Refusal
from streamsvc.door.cpumeter import CpuMeter
from streamsvc.door.entry import Client, Entry, Refused
from streamsvc.door.front import Connection, ConnectionClosed
from streamsvc.door.guard import Guard
from streamsvc.door.port import Port, serve_until_signalled
from streamsvc.door.routes import (RECORDINGS_PATH, WS_PATH, HttpReply, HttpRequest, check_origin, metrics_refusal,
                                   reply, static_file, token_refusal)
from streamsvc.door.whep import Endpoints, WhepOutlet, WhepSession
from streamsvc.metrics import Metrics
from streamsvc.transport.ws import WebSocketOutlet
from streamsvc.viewers.protocol import Admit, Send, Violation, ViewerProtocol
from streamsvc.viewers.server import ServerConfig
from streamsvc.wire import protocol as P
from streamsvc.wire.framing import MAX_INPUT_BYTES

log = logging.getLogger("streamsvc.cluster.gateway")

PLACE_ATTEMPTS = 3  # a session call that fails before its placement is tried again on another replica


@dataclass(frozen=True)
class GatewayConfig:
    renew_every_s: float = 1.0  # lease renewals to the replicas that hold this gateway's sessions
    call_timeout_s: float = 5.0  # bound on one call to a replica (a message, a renewal)
    place_timeout_s: float = 30.0  # bound on placing a session (a replica starting up counts against it)


@dataclass
class _Relay:
    conn_id: str
    replica: str | None = None  # where its session runs, once placed
    lost: bool = False  # its replica died under it
    watch: bool = False  # a watcher's (of a stream on `replica`), not a stream's


class Gateway:
    """`streamsvc serve`'s front without an engine: each stream runs on a replica behind `handle` (the engine
    deployment's Serve handle). Its door is the server's: the same guard, token and caps (streamsvc/door/entry.py),
    and each viewer's messages before its start or watch read by the viewer protocol (streamsvc/viewers/protocol.py)."""

    def __init__(self, handle, config: ServerConfig = ServerConfig(), gateway: GatewayConfig = GatewayConfig(),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.gateway = gateway
        self.metrics = Metrics()
        self.guard = Guard(config.access, self.metrics, clock)  # connection caps and request rates, as a server's
        self.entry = Entry(config.access, config.max_streams, self.metrics)  # the token and the stream caps
        self.streamless = CpuMeter()  # the front's hooks meter into it, as a server's (no engine here to read it)
        self.front = Port(config, self.guard, self.streamless, self.metrics, self.websocket)
        self.sessions: dict[str, _Relay] = {}  # conn id -> relay (counted against the server cap)
        self.watchers: dict[str, _Relay] = {}  # conn id -> a watcher's relay (not counted against it)
        self.handle = handle
        self.board: Board = board(handle.deployment_name)
        self.gateway_id = uuid.uuid4().hex[:12]
        self.worker_lost = 0  # sessions whose replica died under them
        self._ids = itertools.count()
        self._renewer: asyncio.Task | None = None
        # WHEP sessions are placed and relayed as /ws viewers (open_webrtc); WHIP goes to the stream's replica
        self.whep = Endpoints(self, whip=RelayedIngest(self))

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        # a first call makes the handle's router, which then learns the replicas and their stats
        with contextlib.suppress(Exception):
            await self.call("info", timeout_s=self.gateway.place_timeout_s)
        self._renewer = asyncio.create_task(self._renew())
        url = await self.front.open(self._route, self._route_metrics)
        log.info("gateway on %s (WebSocket at %s), %d replicas", url, WS_PATH, len(self.board.replicas))

    @property
    def port(self) -> int:
        return self.front.port

    async def stop(self, reason: str = "server shutting down") -> None:
        """Close the viewers' sockets; their sessions end on their replicas (the viewer left)."""
        await self.whep.stop()
        await self.front.close()
        if self._renewer is not None:
            self._renewer.cancel()

    async def serve_forever(self) -> None:
        await serve_until_signalled(self.start, self.stop)

    # -- HTTP -------------------------------------------------------------------------------

    def _route(self, request: HttpRequest) -> HttpReply | None:
        """The gateway's routes (as a server's): the replicas' health and metrics, its own player; None: the
        WebSocket upgrade goes on."""
        path = request.path
        if path == WS_PATH:
            return check_origin(request, self.config.access, self.metrics)
        if Endpoints.takes(path):  # WHEP and WHIP (streamsvc/door/whep.py, streamsvc/cluster/whip_relay.py)
            return self.whep.handle(request)
        if path == "/healthz":
            ready = [s for s in self.board.stats() if s.ready and not s.draining]
            ok = bool(ready)
            text = f"ok: {len(ready)} of {len(self.board.replicas)} replicas take streams\n" if ok else \
                f"no replica takes streams ({len(self.board.replicas)} known)\n"
            return reply(http.HTTPStatus.OK if ok else http.HTTPStatus.SERVICE_UNAVAILABLE, text.encode(), "text/plain")
        if path == "/metrics":  # behind the token, as a server's (routes.Routes.handle), or on --metrics-port alone
            if self.config.metrics_port is not None:
                return reply(http.HTTPStatus.NOT_FOUND, b"not found\n", "text/plain")
            return metrics_refusal(request, self.config.access, self.metrics) or self._route_metrics(request)
        if path.startswith(RECORDINGS_PATH):
            return reply(http.HTTPStatus.NOT_FOUND, b"recordings stay on the machine of the worker that ran the stream "
                         b"(its --recordings-dir); this gateway does not serve them\n", "text/plain")
        if path == "/replicas":  # what placement sees: each replica's routing stats, without its metrics
            rows = [{**s.to_dict(), "metrics": None} for s in self.board.stats()]
            return reply(http.HTTPStatus.OK, json.dumps(rows).encode(), "application/json")
        if path == "/loras":  # the replicas' styles (every replica serves the same --lora-dir), behind the token
            return (token_refusal(request, self.config.access, self.metrics)
                    or reply(http.HTTPStatus.OK, json.dumps(self.styles()).encode(), "application/json"))
        return static_file(self.config.static_dir, path)

    def _route_metrics(self, request: HttpRequest) -> HttpReply:
        """/metrics: every replica's and the gateway's own (metrics_text)."""
        if request.path != "/metrics":
            return reply(http.HTTPStatus.NOT_FOUND, b"this port serves /metrics only\n", "text/plain")
        return reply(http.HTTPStatus.OK, self.metrics_text().encode(), "text/plain; version=0.0.4")

    def metrics_text(self) -> str:
        """Prometheus text: every replica's metrics with a `replica` label (from its routing stats, at most
        about a second old), and the gateway's own as streamsvc_gateway_*."""
        samples: dict[str, list[str]] = {}
        stats = self.board.stats()
        self.metrics.connections.labels("websocket").set(self.guard.clients.held())  # its viewers' sockets
        self.metrics.process.refresh()  # its own threads (it has no encoder processes)
        for s in stats:
            for key, value in (s.metrics or {}).items():
                name, labels = _split(key)
                samples.setdefault(name, []).append(_sample(name, {**labels, "replica": s.replica}, value))
        for family in self.metrics.registry.collect():
            for smp in family.samples:
                name = "streamsvc_gateway_" + smp.name.removeprefix("streamsvc_")
                samples.setdefault(name, []).append(_sample(name, smp.labels, smp.value))
        own = {
            "streamsvc_gateway_sessions": [({}, len(self.sessions))],
            "streamsvc_gateway_watchers": [({}, len(self.watchers))],
            "streamsvc_gateway_worker_lost_total": [({}, self.worker_lost)],
            "streamsvc_gateway_replicas": [({"state": "ready"}, sum(s.ready and not s.draining for s in stats)),
                                           ({"state": "draining"}, sum(s.draining for s in stats)),
                                           ({"state": "starting"}, sum(not s.ready for s in stats))],
        }
        for name, rows in own.items():
            samples[name] = [_sample(name, labels, value) for labels, value in rows]
        return "".join(line for lines in samples.values() for line in lines)

    # -- viewers ----------------------------------------------------------------------------

    async def websocket(self, ws: Connection) -> None:
        """A viewer's socket: its start or watch, then its session relayed to a replica."""
        client = Client.of(ws.remote_address[0] if ws.remote_address else None, ws.headers, self.config.access)
        first = await self._await_start(ws, client)
        if first is None:
            return
        raw, msg = first
        placed = await self._admit(client, msg)
        if isinstance(placed, Refused):
            with contextlib.suppress(ConnectionClosed):
                await placed.send(WebSocketOutlet(ws))
            return
        relay, replica, release = placed
        try:
            await self._relay(ws, relay, raw, client.address, replica)
        finally:
            release()

    async def _admit(self, client: Client, msg: P.Start | P.Watch):
        """A start counted against the token and caps (a new session, placed by the router), or a watch sent to the
        replica its stream runs on, named by the stream id's prefix (a replica's stream ids are `<replica>-s<n>`):
        that replica's server admits it as it admits a watcher of its own, checking its watch secret (relayed as the
        viewer sent it). Watchers do not count against the streams' caps; their relays keep their lease as a
        stream's. Returns (its relay, the replica it must go to or None, what to call once it ends), or the
        refusal."""
        if isinstance(msg, P.Watch):
            token = self.entry.authorize(client, msg)
            if isinstance(token, Refused):
                return token
            uid = self.replica_of(msg.stream_id)
            if uid is None:  # the replica's answer to a link of no stream of its own
                return self.entry.refuse_link(msg.stream_id)
            relay = _Relay(f"{self.gateway_id}-{next(self._ids)}", watch=True)
            self.watchers[relay.conn_id] = relay
            return relay, uid, lambda: self.watchers.pop(relay.conn_id, None)
        token = self.entry.let_in(client, msg, len(self.sessions))
        if isinstance(token, Refused):
            return token
        relay = _Relay(f"{self.gateway_id}-{next(self._ids)}")
        self.sessions[relay.conn_id] = relay

        def release() -> None:
            self.sessions.pop(relay.conn_id, None)
            self.entry.release(token, client.address)
        return relay, None, release

    def replica_of(self, stream_id: str) -> str | None:
        """The replica that runs `stream_id` (its id's prefix names it), unless it is lost."""
        prefix = stream_id.partition("-")[0] + "-"
        return next((u for u in self.board.replicas if stream_prefix(u) == prefix and u not in self.board.lost), None)

    async def _await_start(self, ws: Connection, client: Client) -> tuple[str, P.Start | P.Watch] | None:
        """The viewer's start or watch (raw and parsed); what comes before it is answered by its protocol, as a
        server's viewer is, under the same guard (its deadline, its address's message rate, its protocol errors; the
        replica guards the rest)."""
        guard = self.guard.connection(ws, client.address)
        protocol = ViewerProtocol()
        try:
            async for raw in ws:
                if not guard.message():
                    break
                for action in protocol.receive(raw):
                    if isinstance(action, Send):
                        await ws.send(P.encode(action.message))
                    elif isinstance(action, Violation):
                        self.metrics.errors.inc()
                        if not guard.protocol_error():
                            return None
                    else:  # Admit or Watch: its session goes to a replica from here
                        guard.started()
                        return raw, action.start if isinstance(action, Admit) else action.watch
        except ConnectionClosed:
            pass
        finally:
            await guard.done()
        return None

    async def _relay(self, ws: Connection, relay: _Relay, start: str, address: str, replica: str | None) -> None:
        gen = await self._open_call(relay, start, address, replica)
        if isinstance(gen, Refused):
            with contextlib.suppress(ConnectionClosed):
                await gen.send(WebSocketOutlet(ws))
            return
        upstream = asyncio.create_task(self._upstream(ws, relay), name=f"up-{relay.conn_id}")
        try:
            async for item in gen:
                if isinstance(item, dict) and "allow_messages" in item:  # the stream takes input video: its
                    ws.allow_messages(min(int(item["allow_messages"]), MAX_INPUT_BYTES))  # camera's messages pass
                    continue
                if isinstance(item, dict):  # the replica's server closed the socket (e.g. unauthorized, the stream
                    code, reason = item.get("close", (1000, ""))  # ended): nothing more of the viewer's is read
                    await ws.close(code, reason, linger=False)
                    break
                if not await self._send_in_time(ws, item):
                    break
        except ConnectionClosed:
            pass  # the viewer left: upstream tells the replica
        except Exception as e:  # noqa: BLE001 - the replica's call failed: tell the viewer why
            error, reason = self._lost(relay, e)
            with contextlib.suppress(ConnectionClosed):
                await ws.send(P.encode(error))
                await ws.send(P.encode(P.Closed(reason=reason)))
                await ws.close(1011, reason)
        finally:
            upstream.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await upstream
            gen.cancel()

    async def _send_in_time(self, ws: Connection, item: str | bytes) -> bool:
        """Send an item of the replica's to the viewer. A viewer that does not read holds the relay up, and what the
        replica sends meanwhile waits in its call: a send that waits longer than a viewer's outbox may wait
        (ServerConfig.outbox.max_wait_s) closes the connection as a slow client (1008, counted); False then."""
        wait_s = self.config.outbox.max_wait_s
        try:
            async with asyncio.timeout(wait_s):
                await ws.send(item)
            return True
        except TimeoutError:
            self.metrics.refusals.labels(Refusal.SLOW_CLIENT.value).inc()
            await ws.close(1008, f"slow client: a message waited {wait_s:g} s to be sent", linger=False)
            return False

    async def _open_call(self, relay: _Relay, start: str, address: str, replica: str | None):
        """The session's streaming call, its placement read: a start placed by the router (a call that fails before
        its placement goes to another replica), a watch on the replica `replica` (no other will do). Or the
        refusal, counted."""
        if replica is not None:
            gen = self.handle.options(stream=True, method_name="session").remote(
                relay.conn_id, start, address, self.gateway_id, new_session=False, replica=replica)
            try:
                async with asyncio.timeout(self.gateway.call_timeout_s):
                    relay.replica = (await gen.__anext__())["placed"]
            except Exception as e:  # noqa: BLE001 - the replica is gone or does not answer: its streams with it
                gen.cancel()
                log.warning("watch %s on %s failed (%s: %s)", relay.conn_id, replica, type(e).__name__, e)
                return self.entry.refuse(Refusal.NO_STREAM, f"the worker of this stream does not answer "
                                                            f"({type(e).__name__}); the stream may be gone", "watch")
            return gen
        exclude: list[str] = []
        error = "no replica is running"
        for _ in range(PLACE_ATTEMPTS):
            gen = self.handle.options(stream=True, method_name="session").remote(
                relay.conn_id, start, address, self.gateway_id, new_session=True, exclude=tuple(exclude))
            try:
                async with asyncio.timeout(self.gateway.place_timeout_s):
                    first = await gen.__anext__()
            except TimeoutError:
                gen.cancel()
                error = f"no replica took the stream within {self.gateway.place_timeout_s:g} s"
                break
            except Exception as e:  # noqa: BLE001 - that replica failed; try another
                gen.cancel()
                uid = self.board.routed.pop(relay.conn_id, None)
                log.warning("placing %s on %s failed (%s: %s)", relay.conn_id, uid, type(e).__name__, e)
                error = f"{type(e).__name__} while placing the stream"
                if uid is not None:
                    self.board.mark_lost(uid)
                    exclude.append(uid)
                continue
            relay.replica = first["placed"]
            self.board.routed.pop(relay.conn_id, None)
            return gen
        return self.entry.refuse(Refusal.ADMISSION, f"the stream could not be placed on a worker: {error}")

    async def _upstream(self, ws: Connection, relay: _Relay) -> None:
        """The viewer's messages to its replica, in order; when the viewer leaves, the replica is told."""
        try:
            async for raw in ws:
                if not await self.call("feed", relay.conn_id, raw, replica=relay.replica):
                    return  # the session has ended there
        except ConnectionClosed:
            pass
        finally:
            await self._left(relay)

    async def _left(self, relay: _Relay) -> None:
        """The viewer left: its replica hears it (unless the replica is gone)."""
        if not relay.lost:
            with contextlib.suppress(Exception):
                await asyncio.shield(self.call("feed", relay.conn_id, None, replica=relay.replica))

    def _lost(self, relay: _Relay, e: Exception) -> tuple[P.Error, str]:
        """The replica's call failed under a session: the viewer's error, and the reason its session closed."""
        from ray.exceptions import RayActorError

        if isinstance(e, RayActorError):
            relay.lost = True
            self.worker_lost += 1
            self.board.mark_lost(relay.replica)
            log.warning("session %s: its replica %s was lost (%s)", relay.conn_id, relay.replica, type(e).__name__)
            return P.Error(code=P.ErrorCode.WORKER_LOST, message=(
                f"the worker running this stream was lost ({type(e).__name__}); the stream is gone" + (
                    "" if relay.watch else ": connect again to be placed on another worker"))), "worker lost"
        log.error("session %s on %s failed: %s: %s", relay.conn_id, relay.replica, type(e).__name__, e)
        return P.Error(code=P.ErrorCode.INTERNAL, message=f"the worker failed: {type(e).__name__}"[:200]), \
            "worker failed"

    # -- WHEP (streamsvc/door/whep.py) ---------------------------------------------------------

    async def open_webrtc(self, client: Client, first: P.Start | P.Watch, offer: str,
                          deadline: float) -> WhepSession | HttpReply:
        """A WHEP session, placed as a /ws viewer is and relayed the same way: `first`, then its `offer` fed to its
        replica (whose peer connection answers it: the media flows between the player and the replica); by
        `deadline` (loop time) the session, or the reply that says why not."""
        outlet = WhepOutlet()
        placed = await self._admit(client, first)
        if isinstance(placed, Refused):
            return outlet.refusal(placed.error, "the stream could not be opened")
        relay, replica, release = placed
        steers = isinstance(first, P.Start)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout_at(deadline):
                gen = await self._open_call(relay, P.encode(first), client.address, replica)
        except TimeoutError:
            gen = self.entry.refuse(Refusal.ADMISSION, "the stream could not be placed in time")
        if isinstance(gen, Refused):
            release()
            return outlet.refusal(gen.error, "the stream could not be opened")
        done = asyncio.ensure_future(self._relay_to_whep(gen, relay, outlet))
        done.add_done_callback(lambda _: release())

        async def close() -> None:  # its DELETE, or a session that did not come up
            if steers and not done.done():
                with contextlib.suppress(Exception):
                    await self.call("feed", relay.conn_id, P.encode(P.Close()), replica=relay.replica)
            await self._left(relay)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(10):
                    await asyncio.shield(done)

        ready = await outlet.expect(P.Ready, deadline)
        answer = None
        if isinstance(ready, P.Ready):
            with contextlib.suppress(Exception):
                await self.call("feed", relay.conn_id, P.encode(P.Offer(sdp=offer)), replica=relay.replica,
                                timeout_s=max(0.1, deadline - loop.time()))
            answer = await outlet.expect(P.Answer, deadline)
        if not isinstance(answer, P.Answer):
            refusal = outlet.refusal(answer if isinstance(ready, P.Ready) else ready,
                                     "the offer could not be answered" if isinstance(ready, P.Ready)
                                     else "the stream could not be opened")
            await close()
            return refusal
        outlet.set_up = True
        return WhepSession(ready.stream_id, answer.sdp, outlet, close, done, watch_secret=ready.watch_secret,
                           steer_secret=ready.steer_secret)

    async def _relay_to_whep(self, gen, relay: _Relay, outlet: WhepOutlet) -> None:
        """What a WHEP session's replica says, to its outlet (chunks never come: they go on its peer connection),
        until the call ends; then the session has ended."""
        try:
            async for item in gen:
                if isinstance(item, dict):
                    if "close" in item:
                        break
                    continue  # (allow_messages: a WHEP stream's camera comes over WHIP)
                if isinstance(item, str):
                    with contextlib.suppress(P.ProtocolError):
                        await outlet.send(P.parse_server(item))
        except ConnectionClosed:
            pass
        except Exception as e:  # noqa: BLE001 - the replica's call failed: the session ends with it
            _, reason = self._lost(relay, e)
            await outlet.close(1011, reason)
        finally:
            gen.cancel()
            await outlet.close(1000, outlet.reason or "session ended")

    # -- calls to the replicas ---------------------------------------------------------------

    async def call(self, method: str, *args, timeout_s: float | None = None, **kwargs):
        """A call of `method` on the engine deployment (pinned with `replica=`), bounded in time."""
        response = self.handle.options(method_name=method).remote(*args, **kwargs)
        try:
            async with asyncio.timeout(timeout_s or self.gateway.call_timeout_s):
                return await response
        except TimeoutError:
            response.cancel()
            raise

    async def _renew(self) -> None:
        """Every second, each replica holding sessions of this gateway hears that it is alive."""
        while True:
            await asyncio.sleep(self.gateway.renew_every_s)
            relays = [*self.sessions.values(), *self.watchers.values()]
            replicas = {r.replica for r in relays if r.replica is not None and not r.lost}
            results = await asyncio.gather(*(self.call("renew", self.gateway_id, replica=uid) for uid in replicas),
                                           return_exceptions=True)
            for uid, result in zip(replicas, results):
                if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
                    log.debug("renewing leases on %s failed: %s", uid, result)

    def replica_stats(self) -> list[ReplicaStats]:
        return self.board.stats()

    def styles(self) -> list[dict]:
        """The styles the ready replicas offer, as a server's GET /loras lists them: each name once (the first
        ready replica's row; they load the same --lora-dir), in name order."""
        rows: dict[str, dict] = {}
        for s in self.board.stats():
            if s.ready:
                for style in s.styles:
                    rows.setdefault(style["name"], dict(style))
        return [rows[name] for name in sorted(rows)]


def _split(key: str) -> tuple[str, dict[str, str]]:
    """'name{a=1,b=2}' -> ('name', {'a': '1', 'b': '2'}) (the replicas' metrics keys; values have no commas)."""
    if "{" not in key:
        return key, {}
    name, rest = key.split("{", 1)
    rest = rest.rstrip("}")
    return name, dict(kv.split("=", 1) for kv in rest.split(",") if kv)


def _sample(name: str, labels: dict[str, str], value: float) -> str:
    if labels:
        inner = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
        return f"{name}{{{inner}}} {float(value)!r}\n"
    return f"{name} {float(value)!r}\n"


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
