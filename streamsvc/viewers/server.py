"""`streamsvc serve`: the WebSocket endpoint, /healthz, /metrics and the player's static files on one port.

One WebSocket connection carries one stream: the client sends `start`, gets `ready`,
then every chunk as one binary message (see streamsvc/wire/protocol.py) while it steers
with `set_prompt`, `pause`, `resume` and `close`. A bad message gets an `error` back and
the stream goes on; a client that vanishes has its stream closed and its KV cache freed. What
waits to be sent to a viewer is bounded (streamsvc/viewers/outbox.py: a client that does not read is
closed, 1008), and once its stream ends its connection closes: nothing more of it is read.

Who may do what (streamsvc/door/access.py): a browser's upgrade must come from an allowed origin,
a stream starts only with a valid token when tokens are configured, each token and address
holds a limited number of streams, and each stream's control messages are rate-limited; every
refusal says why on the wire and is counted in /metrics by reason. Prompts are coalesced by the
scheduler: one recache per chunk at most, however fast a viewer sends them.

Here: the server's life (the engine, the listening socket), the engine's chunks to each stream's viewers, and a
connection's WebSocket: who may start or watch a stream, its `ready`, its sender. Beside it:
streamsvc/viewers/streams.py (what happens in an open stream once a viewer is in: its control messages, leaving,
ending), streamsvc/door/routes.py (the HTTP routes, behind an interface any front can serve), streamsvc/door/front.py
(the port itself: aiohttp's HTTP and WebSocket server, and the `Connection` a session talks through) and
streamsvc/metrics.py (the metrics).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import random
import re
import signal
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from streamsvc.door.access import (AccessConfig, ProtocolErrors, Refusal, StreamLimits, TokenBucket, bearer_token,
                                    client_address, exposure_warning, find_token, secret_matches)
from streamsvc.door.cpumeter import CpuMeter, MeteredClose
from streamsvc.door.front import Connection, ConnectionClosed, FrontConfig, Handlers, HttpFront, tls_context
from streamsvc.door.guard import ConnectionGuard, Guard, raise_fd_limit
from streamsvc.door.routes import WS_PATH, HttpReply, HttpRequest, Routes
from streamsvc.door.whep import Endpoints
from streamsvc.door.whip import Ingest
from streamsvc.engine.config import EngineConfig
from streamsvc.engine.engine import ChunkOut, Engine
from streamsvc.inputs.ws import Upstream, allow_input, input_frames, ready_fields
from streamsvc.metrics import Metrics
from streamsvc.scheduling import SendSampler
from streamsvc.transport.webrtc import WebRtcTransport
from streamsvc.transport.ws import send_outbox
from streamsvc.viewers.outbox import Outbox, OutboxLimits
from streamsvc.viewers.protocol import Admit, Input, Send, State, Violation, ViewerProtocol, Watch
from streamsvc.viewers.record import RecordingStore
from streamsvc.viewers.session import Role, Session, Viewer
from streamsvc.viewers.streams import Streams, wire_vocabulary, wire_words
from streamsvc.wire import protocol as P
from streamsvc.wire.rtc import WebRtcConfig, server_ice_addresses

log = logging.getLogger("streamsvc.server")

SEND_PERIOD_S = 1.0  # how often the event loop's cost per chunk is measured for admission (its SEND stage)
SEND_MIN_CHUNKS = 8  # chunks a measurement needs (fewer: it waits for the next period)


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (see Server.port)
    static_dir: str | None = None  # the browser player's files, served at / (None: no player)
    max_streams: int = 256  # hard cap on open streams, whatever the admission says
    webrtc: WebRtcConfig = WebRtcConfig()  # ICE servers and candidate addresses of WebRTC streams
    access: AccessConfig = AccessConfig()  # tokens, origins, per-client limits, control rates
    max_watchers: int = 64  # watchers per stream, its steerer not counted
    outbox: OutboxLimits = OutboxLimits()  # a viewer's backlog past which it is closed; its error replies' rate
    orphan_timeout_s: float = 60.0  # a stream whose steerer left goes on this long for its watchers
    recordings_dir: str = "recordings"  # where recordings go (`record` messages, --record) and are served from
    record_all: bool = False  # record every stream (--record DIR)
    record_max_bytes: int = 4 << 30  # disk the recordings may use; a recording past it stops, a new one is refused
    # what this server's stream ids begin with: a cluster replica's own ("<replica>-"), so that a watch link names
    # the replica that runs its stream
    stream_prefix: str = ""
    tls_cert: str | None = None  # PEM certificate (chain) and its key: https and wss on the port (--tls-cert/key)
    tls_key: str | None = None
    metrics_port: int | None = None  # /metrics on this port alone, without the token (then 404 on the main port)
    max_downloads_per_client: int = 4  # recordings one client address may download at once (429 past it)
    handshake_timeout_s: float = 10.0  # a connection's TLS handshake and first request's head must come within it

    def __post_init__(self) -> None:
        if (self.tls_cert is None) is not (self.tls_key is None):
            raise ValueError("give both --tls-cert and --tls-key (a certificate and its private key), or neither")
        if self.max_downloads_per_client < 1:
            raise ValueError(f"max_downloads_per_client={self.max_downloads_per_client}: give at least 1")
        if not re.fullmatch(r"[A-Za-z0-9_-]*", self.stream_prefix):
            raise ValueError(f"stream_prefix={self.stream_prefix!r}: letters, digits, '_' and '-' only")
        if self.max_watchers < 0:
            raise ValueError(f"max_watchers={self.max_watchers}: give 0 (no watchers) or more")
        if not self.orphan_timeout_s >= 0:
            raise ValueError(f"orphan_timeout_s={self.orphan_timeout_s}: give a number of seconds >= 0")


class Server:
    """One `streamsvc serve`: an engine, and the port its viewers and the HTTP routes are served on."""

    def __init__(self, engine_config: EngineConfig, config: ServerConfig = ServerConfig(),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock  # the control rates' time (tests inject one)
        self.limits = StreamLimits(config.access)
        self._chunks_sent = 0  # chunks handed to the transports (the SEND stage's measure)
        self._send_meter: asyncio.Task | None = None
        # the event loop's CPU on clients without a stream (HTTP requests, a connection's messages before it has a
        # stream): left out of the send's and (on a CPU device) the forwards' cost samples, shown in /metrics
        self.streamless = CpuMeter()
        self.engine_config = engine_config
        self.metrics = Metrics()
        self.guard = Guard(config.access, self.metrics, clock)  # what one address may hold and cost on the port
        self.sessions: dict[str, Session] = {}
        self._ids = itertools.count()
        self._viewer_ids = itertools.count()
        self.recordings = RecordingStore(Path(config.recordings_dir), config.record_max_bytes)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._front: HttpFront | None = None  # the port (aiohttp); None for a cluster replica
        self._metrics_front: HttpFront | None = None  # --metrics-port's
        self.webrtc: dict[str, WebRtcTransport] = {}  # viewer id -> its peer connection, for transport 'webrtc'
        # on a loopback address, WebRTC offers loopback candidates too (a loopback-only host can connect)
        self._webrtc_config = dataclasses.replace(
            config.webrtc, ice_addresses=server_ice_addresses(config.host, config.webrtc.ice_addresses))
        self.engine = Engine(engine_config, on_chunk=self._from_engine(self._on_chunk),
                             on_error=self._from_engine(self._on_error), streamless=self.streamless.reading)
        self.streams = Streams(self.engine, self.sessions, self.limits, self.recordings, self.metrics, clock,
                               config.orphan_timeout_s)
        self.routes = Routes(config.access, config.static_dir, self.recordings, self.metrics,
                             ready=lambda: self.engine.shape is not None and not self.engine.failure,
                             refresh_metrics=self._refresh_metrics,
                             metrics_apart=config.metrics_port is not None)
        self.whep = Endpoints(self, whip=Ingest(self))  # WHEP (a POST's offer served as a connection) and WHIP

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self, listen: bool = True) -> None:
        """Start the engine, then listen (``listen=False``: a cluster replica, whose connections come
        from the gateway through streamsvc/cluster instead of a socket)."""
        self._loop = asyncio.get_running_loop()
        await asyncio.wrap_future(self.engine.start())
        self._send_meter = asyncio.create_task(self._measure_send(), name="send-meter")
        if not listen:
            return
        self.guard.listen(raise_fd_limit())
        log.info("serving on %s (WebSocket at %s)", await self._listen(self._route), WS_PATH)
        warning = exposure_warning(self.config.host, self.config.access)
        if warning:
            log.warning(warning)

    @property
    def port(self) -> int:
        return self._front.port

    async def stop(self, reason: str = "server shutting down") -> None:
        """Every stream gets `closed`, then the engine stops."""
        for session in list(self.sessions.values()):
            await self.streams.end(session, reason)
        if self._send_meter is not None:
            self._send_meter.cancel()
        await self._close_fronts()
        await asyncio.to_thread(self.engine.stop)

    async def serve_forever(self) -> None:
        await self.start()
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("shutting down")
        await self.stop()

    async def _measure_send(self) -> None:
        """Every SEND_PERIOD_S, the event loop's CPU time per chunk sent goes to admission as the SEND stage's cost
        (scheduling.SendSampler): everything the loop does for the streams (the sends, control messages, WebRTC's
        packetizing and encryption, which no wrapper of ours could time) less what it did for clients without a
        stream (self.streamless), over windows of at least SEND_MIN_CHUNKS chunks; a period without a chunk sent
        is charged to none."""
        config = self.engine_config.scheduler
        sampler = SendSampler(SEND_MIN_CHUNKS, config.streamless_max_share)
        while True:
            streamless_s, events = self.streamless.reading()
            sample = sampler.read(time.thread_time(), streamless_s, self._chunks_sent, events)
            if sample is not None:
                self.engine.observe_send(sample)
            await asyncio.sleep(SEND_PERIOD_S)

    # -- engine callbacks (called in the engine thread, run on the loop) ---------------------

    def _from_engine(self, fn: Callable) -> Callable:
        def call(*args):
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(fn, *args)
        return call

    def _on_chunk(self, out: ChunkOut) -> None:
        """A chunk encoded once goes to every viewer of its stream (and its recording)."""
        session = self.sessions.get(out.stream_id)
        if session is None or session.closed:
            return
        self.metrics.chunk_latency.observe(out.latency_s)
        session.delivered(self._loop.time())
        for viewer in session.fan_out(out):
            # a watcher that waited for this keyframe has only it buffered: the stream's model follows it from here
            self.engine.observe_buffer(session.stream_id, out.header.frames, at_most=True)
        self.streams.chunk_done(session, out)

    def _on_error(self, stream_id: str, message: str, code: str) -> None:
        """The engine ended a stream: a failure ("internal") or the last resort ("overloaded")."""
        session = self.sessions.get(stream_id)
        if code == P.ErrorCode.OVERLOADED:
            self.metrics.overloaded.inc()
        if session is None:
            return
        if code == "park_expired":  # a paused stream parked past --park-timeout: it ends, no failure
            asyncio.ensure_future(self.streams.end(session, message, engine_closed=True))
            return
        for viewer in list(session.viewers.values()):
            viewer.send(P.Error(code=P.ErrorCode(code), message=message[: P.MAX_TEXT_CHARS]))
        reason = "overloaded" if code == P.ErrorCode.OVERLOADED else "generation failed"
        asyncio.ensure_future(self.streams.end(session, reason, engine_closed=True))

    # -- HTTP and the port (streamsvc/door/front.py serves the routes of streamsvc/door/routes.py) -----------------

    async def _listen(self, route: Callable[[HttpRequest], HttpReply | None]) -> str:
        """Open the port, its requests answered by `route` (and --metrics-port's); returns the port's base URL."""
        cfg = self.config
        front = FrontConfig(host=cfg.host, port=cfg.port, max_message_bytes=P.MAX_MESSAGE_BYTES,
                            tls=tls_context(cfg.tls_cert, cfg.tls_key) if cfg.tls_cert else None,
                            handshake_timeout_s=cfg.handshake_timeout_s,
                            max_downloads_per_client=cfg.max_downloads_per_client)
        self._front = HttpFront(front, self._handlers(route))
        await self._front.start()
        if cfg.metrics_port is not None:
            self._metrics_front = HttpFront(dataclasses.replace(front, port=cfg.metrics_port),
                                            self._handlers(self._route_metrics))
            await self._metrics_front.start()
        return f"{self._front.scheme}://{cfg.host}:{self.port}"

    async def _close_fronts(self) -> None:
        for front in (self._front, self._metrics_front):
            if front is not None:
                await front.stop()

    def _handlers(self, route: Callable[[HttpRequest], HttpReply | None]) -> Handlers:
        guard = self.guard  # the front's admission hooks: connection caps and request rates (streamsvc/door/guard.py)
        # each is stream-less work, and a connection or a request a stream-less event (self.streamless)
        hook, meter = self.streamless.hook, lambda fn: self.streamless.hook(fn, event=False)
        return Handlers(route=route, websocket=self._handle, client=guard.client,
                        admit_connection=hook(guard.admit_connection), connection_closed=meter(guard.connection_closed),
                        hold_connection=meter(guard.hold_connection),
                        admit_request=hook(guard.admit_request), admit_upgrade=meter(guard.admit_upgrade),
                        upgrade_ended=meter(guard.upgrade_ended),
                        download_refused=lambda _: self.metrics.refusals.labels(Refusal.DOWNLOADS.value).inc())

    def _route(self, request: HttpRequest) -> HttpReply | None:
        """The routes' reply to a request on the port; None: the WebSocket upgrade goes on (the gateway has its
        own). Its CPU is stream-less work (self.streamless). WHEP and WHIP: streamsvc/door/whep.py (the front awaits
        them)."""
        if Endpoints.takes(request.path):
            return self.whep.handle(request)
        with self.streamless.measure():
            return self.routes.handle(request)

    def _route_metrics(self, request: HttpRequest) -> HttpReply:
        """--metrics-port's one route: /metrics, no token (bind it where only the scraper reaches). Stream-less work
        too (self.streamless)."""
        with self.streamless.measure():
            return self.routes.metrics_only(request)

    def _refresh_metrics(self) -> None:
        """Bring the metrics' gauges up to date (what GET /metrics runs first)."""
        connections = {"websocket": self.guard.clients.held(), "whip": len(self.whep.whip.publishers),
                       "webrtc": sum(1 for rtc in self.webrtc.values() if rtc.pc is not None)}
        self.metrics.refresh(self.engine, self.sessions.values(), self.recordings.used_bytes, self.streamless.seconds,
                             connections)

    # -- WebSocket ----------------------------------------------------------------------------

    async def _handle(self, ws: Connection) -> None:
        """One connection. Its CPU while it has no stream (before `start` or `watch`, after a refusal) is stream-less
        work (self.streamless): not its stream's, which has none."""
        conn = _Connection()
        stream_less = lambda: conn.viewer is None  # noqa: E731
        await self.streamless.run(self._connection(MeteredClose(ws, self.streamless, stream_less), conn), stream_less)

    async def _connection(self, ws: Connection, conn: _Connection) -> None:
        """One WebSocket's viewer: its messages through its protocol (streamsvc/viewers/protocol.py), whose actions
        are carried out here, in order."""
        viewer: Viewer | None = None
        sender: asyncio.Task | None = None
        guard = self.guard.connection(ws, self._address(ws))  # its start deadline, pre-start rate, protocol errors
        upstream: Upstream | None = None  # its input video, if it steers a stream that takes input over it
        protocol = ViewerProtocol()
        try:
            async for raw in ws:
                if protocol.state is State.CLOSED or viewer is not None and viewer.closed:
                    break  # its stream ended (or it left): nothing more of it is parsed; the sender closes it
                if viewer is None:
                    self.streamless.event()  # a junk flood's parsing is mostly aiohttp's: counted, if not timed
                    if not guard.message():
                        break
                else:
                    protocol.role(viewer.role is Role.STEER)  # (a handover or a take moves the steer token)
                actions = deque(protocol.receive(raw))
                while actions:
                    action = actions.popleft()
                    if isinstance(action, Send):
                        await self._send_now(ws, viewer, action.message)
                    elif isinstance(action, Violation):
                        self.metrics.errors.inc()
                        if not guard.protocol_error():
                            protocol.closed()
                    elif isinstance(action, Input):
                        try:
                            await upstream.receive(action.data)  # input video: decoded into its stream's input
                        except P.ProtocolError:  # it broke the framing (answered): a protocol error
                            actions.appendleft(Violation())
                    elif isinstance(action, (Admit, Watch)):
                        viewer = await (self._start(ws, action.start) if isinstance(action, Admit)
                                        else self._watch(ws, action.watch))
                        conn.viewer = viewer
                        if viewer is None:
                            actions.extend(protocol.refused())
                            continue
                        upstream = Upstream.for_viewer(viewer)
                        guard.started()
                        viewer.outbox.on_overflow(guard.backlogged)  # a client that does not read is closed
                        sender = asyncio.create_task(self._sender(ws, viewer, guard), name=f"send-{viewer.viewer_id}")
                        actions.extend(protocol.admitted(viewer.stream_id, viewer.role is Role.STEER,
                                                         takes_input=upstream is not None))
                    else:  # Control: a request of its stream
                        await self.streams.control(viewer, action.message)
                        if viewer.closed:
                            protocol.closed()
                    if protocol.state is State.CLOSED:
                        break
                if protocol.state is State.CLOSED:
                    break
        except ConnectionClosed:
            pass
        finally:
            if viewer is not None:
                await self.streams.leave(viewer, "client disconnected")
            if sender is not None:  # its last messages (`closed`), then it closes the connection (guard.ended)
                with contextlib.suppress(asyncio.TimeoutError, ConnectionClosed):
                    await asyncio.wait_for(sender, timeout=2)
                sender.cancel()
            await guard.done()  # a close under way finishes

    async def _send_now(self, ws, viewer: Viewer | None, msg) -> None:
        if viewer is not None:
            viewer.send(msg)
        else:
            await ws.send(P.encode(msg))

    async def _authorize(self, ws: Connection, msg: P.Start | P.Watch) -> tuple[bool, str | None]:
        """The access token check of a start or watch: (allowed, the token); a refusal has gone out when not."""
        access = self.config.access
        given = msg.token or bearer_token(ws.headers.get("Authorization"))
        token = find_token(access.tokens, given)
        if access.auth and token is None:
            await self._refuse(ws, Refusal.UNAUTHORIZED, "the access token is not valid" if given else (
                "this server needs an access token: send it as 'token' in start or as an 'Authorization: Bearer' "
                "header (the player takes it from the page address: #token=...)"), msg.type)
            await ws.close(1008, "unauthorized")
            return False, None
        return True, token

    def _address(self, ws: Connection) -> str:
        remote = ws.remote_address[0] if ws.remote_address else None
        return client_address(remote, ws.headers.get("X-Forwarded-For"), self.config.access.trust_proxy)

    async def _let_in(self, ws: Connection, msg: P.Start) -> tuple[str | None, str] | None:
        """Token, server cap and per-client limits: the stream's token and client address (counted in
        self.limits), or None after the refusal went out."""
        allowed, token = await self._authorize(ws, msg)
        if not allowed:
            return None
        if len(self.sessions) >= self.config.max_streams:
            await self._refuse(ws, Refusal.SERVER_CAP, f"server is at its cap of {self.config.max_streams} streams")
            return None
        address = self._address(ws)
        over_limit = self.limits.acquire(token, address)
        if over_limit is not None:
            await self._refuse(ws, *over_limit)
            return None
        return token, address

    def _new_viewer(self, ws: Connection, session: Session, role: Role, token: str | None) -> Viewer:
        access, now = self.config.access, self.clock()
        outbox = Outbox(self.config.outbox, self.clock, below=getattr(ws, "buffered", lambda: 0),
                        on_dropped=self.metrics.replies_dropped.inc)
        return Viewer(f"v{next(self._viewer_ids)}", session, role, token=token, address=self._address(ws),
                      control_rate=TokenBucket(access.control_rate, now),
                      stats_rate=TokenBucket(access.stats_rate, now), outbox=outbox)

    async def _start(self, ws: Connection, msg: P.Start) -> Viewer | None:
        client = await self._let_in(ws, msg)
        if client is None:
            return None
        token, address = client
        stream_id = f"{self.config.stream_prefix}s{next(self._ids)}"
        fps = msg.fps or 16
        seed = msg.seed if msg.seed is not None else random.randrange(2**31)
        session = Session(stream_id, fps, msg.prompt, token=token, address=address)
        session.prompt_texts[0] = msg.prompt
        self.sessions[stream_id] = session
        try:
            return await self._open(ws, msg, session, seed)
        except BaseException:  # the viewer left (or the server stops) while its stream was being opened
            await self.streams.end(session, "client disconnected")  # a no-op for a session already refused
            raise

    async def _open(self, ws: Connection, msg: P.Start, session: Session, seed: int) -> Viewer | None:
        """Admission in the engine, then `ready` (or the refusal) to the viewer, who steers the stream."""
        stream_id, fps = session.stream_id, session.fps
        session.input = input_frames(self.engine, msg, fps)  # input video (issue 35), if it asked for it
        try:
            opened = await asyncio.wrap_future(self.engine.open_stream(stream_id, msg.prompt, seed, fps,
                                                                       session.input, msg.strength))
        except Exception as e:  # noqa: BLE001 - reported to the client, the server goes on
            log.exception("open_stream failed")
            opened = None
            reason = f"could not open the stream: {type(e).__name__}: {e}"
        else:
            reason = opened.reason
        if opened is None or not opened.accepted:
            self.sessions.pop(stream_id, None)
            session.close("refused")
            self.limits.release(session.token, session.address)
            await self._refuse(ws, Refusal.ADMISSION, reason or "refused")
            return None
        self.metrics.admitted.inc()
        session.description = opened.stream
        viewer = self._new_viewer(ws, session, Role.STEER, session.token)
        allow_input(ws, session)  # with input: before its ready, its input messages may be larger than control ones
        await ws.send(P.encode(self._ready(viewer)))
        self._connect(viewer, msg.transport)
        session.join(viewer)
        if self.config.record_all:
            await self.streams.record(viewer, quiet=True)
        return viewer

    def _ready(self, viewer: Viewer) -> P.Ready:
        """A viewer's `ready`: its stream as admission described it, and what is the viewer's own."""
        session = viewer.session
        desc, shape = session.description, session.description.shape
        return P.Ready(
            stream_id=viewer.stream_id, fps=desc.fps, width=shape.width, height=shape.height,
            first_chunk_frames=shape.first_chunk_frames, chunk_frames=shape.chunk_frames,
            prompt_version=session.prompt_version, steps=shape.steps, role=viewer.role.value,
            viewer_id=viewer.viewer_id, vocabulary=wire_vocabulary(shape.vocabulary),
            unknown_words=wire_words(desc.unknown_words),
            # the stream's capabilities go to its steerer alone (a watcher came with the watch secret; neither grants
            # a watcher steering)
            **({"watch_secret": session.watch_secret, "steer_secret": session.steer_secret}
               if viewer.role is Role.STEER else {}), **ready_fields(desc),
        )

    def _connect(self, viewer: Viewer, transport: str | None) -> None:
        """A WebRTC viewer's chunks go on a peer connection once its offer is answered (else on the WebSocket)."""
        if transport != "webrtc":
            return
        viewer.rtc = self.webrtc[viewer.viewer_id] = WebRtcTransport(
            viewer, _TrackReports(self.engine, viewer), self._webrtc_config,
            on_control=lambda m: self.streams.control(viewer, m),
            on_lost=lambda reason: self.streams.leave(viewer, reason), on_stall=self.metrics.track_stalls.inc,
            on_backlog=self.metrics.refusals.labels(Refusal.SLOW_CLIENT.value).inc,
            protocol_errors=ProtocolErrors(self.config.access.max_protocol_errors),
        )

    async def _watch(self, ws: Connection, msg: P.Watch) -> Viewer | None:
        """A watcher joins an open stream by its watch link (its id and watch secret): the same chunks as its steerer,
        from a keyframe on; no generation."""
        allowed, token = await self._authorize(ws, msg)
        if not allowed:
            return None
        session = self.sessions.get(msg.stream_id)
        # one answer whether the id names an open stream or not (an id grants nothing, and tells nothing)
        if not secret_matches(session.watch_secret if session is not None else None, msg.secret) or session.closed:
            await self._refuse_link(ws, msg.stream_id)
            return None
        limit = self.config.max_watchers
        if session.watchers >= limit:
            await self._refuse(ws, Refusal.WATCHERS, f"stream {session.stream_id} has {limit} watchers, its limit "
                                                     "(--max-watchers); try again when one leaves", "watch")
            return None
        try:
            admission = await asyncio.wrap_future(self.engine.admit_viewer(session.stream_id))
        except Exception as e:  # noqa: BLE001 - the stream closed meanwhile, or the engine stopped
            await self._refuse(ws, Refusal.NO_STREAM, f"stream {session.stream_id} cannot be watched: {e}", "watch")
            return None
        if not admission.accepted:
            await self._refuse(ws, Refusal.ADMISSION, admission.reason or "refused", "watch")
            return None
        if session.closed:
            await self._refuse(ws, Refusal.NO_STREAM, f"stream {session.stream_id} ended", "watch")
            return None
        self.metrics.watchers_admitted.inc()
        viewer = self._new_viewer(ws, session, Role.WATCH, token)
        await ws.send(P.encode(self._ready(viewer)))
        self._connect(viewer, msg.transport)
        # from a keyframe that does not put it ahead of the stream's other viewers (see streamsvc/viewers/session.py)
        buffered = None if admission.buffered_s is None else admission.buffered_s * session.fps
        if not session.join(viewer, buffered):  # too long since the last keyframe: the next chunk starts with one
            self.engine.request_keyframe(session.stream_id)
        if session.recorder is not None:
            viewer.send(self.streams.recording_message(session))
        self.streams.audience_changed(session)
        return viewer

    async def _refuse_link(self, ws: Connection, stream_id: str) -> None:
        """Refuse a watch whose link is not an open stream's: its id names none, or its watch secret is missing or
        wrong. The same answer (code, message, metric) either way, so that ids cannot be probed."""
        await self._refuse(ws, Refusal.SECRET, (
            f"no open stream {stream_id!r} here with this watch secret: the watch link is incomplete (it carries "
            "#watch=ID&secret=...) or wrong, the stream ended, or the link is from another server"), "watch")

    async def _refuse(self, ws: Connection, reason: Refusal, message: str, request: str = "start") -> None:
        """Answer a start or watch that will not be served with the code of its reason, and count it."""
        self.metrics.refusals.labels(reason.value).inc()
        if reason in (Refusal.SERVER_CAP, Refusal.ADMISSION) and request == "start":
            self.metrics.refused.inc()
        await ws.send(P.encode(P.Error(code=_START_REFUSAL_CODES[reason], message=message[: P.MAX_TEXT_CHARS],
                                       request=request)))

    async def _sender(self, ws: Connection, viewer: Viewer, guard: ConnectionGuard) -> None:
        """Sends the viewer's outbox (streamsvc/transport/ws.py); once it ends (the viewer is done), its WebRTC peer
        connection closes, and then its connection (nothing more it sends is parsed)."""
        try:
            await send_outbox(ws, viewer, lambda: self._chunk_sent(viewer))
        finally:
            if viewer.rtc is not None:
                self.webrtc.pop(viewer.viewer_id, None)
                await asyncio.shield(viewer.rtc.close())  # the peer connection closes even if this task is cancelled
            guard.ended(viewer.session.close_reason or "left the stream")

    def _chunk_sent(self, viewer: Viewer) -> None:
        self._chunks_sent += 1
        self.metrics.chunks.inc()
        ttff = viewer.delivered(self._loop.time())
        if ttff is not None:
            (self.metrics.ttff if viewer.role is Role.STEER else self.metrics.watcher_ttff).observe(ttff)


@dataclass
class _Connection:
    """What the stream-less meter asks of a connection: whether it has a stream yet."""

    viewer: Viewer | None = None  # its viewer, once a start or watch is admitted


class _TrackReports:
    """What a viewer's WebRTC track tells the engine (WebRtcTransport's `engine`): its queue of frames, as the lowest
    of its stream's WebRTC viewers (the model follows the viewer closest to stalling), and its keyframe requests."""

    def __init__(self, engine: Engine, viewer: Viewer) -> None:
        self.engine, self.viewer = engine, viewer

    def observe_buffer(self, stream_id: str, buffered_frames: float, grace_s: float = 0.0) -> None:
        queues = self.viewer.session.track_queues
        queues[self.viewer.viewer_id] = buffered_frames
        self.engine.observe_buffer(stream_id, min(queues.values()), grace_s=grace_s)

    def request_keyframe(self, stream_id: str) -> None:
        self.engine.request_keyframe(stream_id)


_START_REFUSAL_CODES = {
    Refusal.UNAUTHORIZED: P.ErrorCode.UNAUTHORIZED,
    Refusal.TOKEN_STREAMS: P.ErrorCode.TOO_MANY_STREAMS,
    Refusal.CLIENT_STREAMS: P.ErrorCode.TOO_MANY_STREAMS,
    Refusal.SERVER_CAP: P.ErrorCode.REFUSED,
    Refusal.ADMISSION: P.ErrorCode.REFUSED,
    Refusal.NO_STREAM: P.ErrorCode.NOT_FOUND,
    Refusal.SECRET: P.ErrorCode.NOT_FOUND,  # a watch link of no open stream: as if the stream did not exist
    Refusal.WATCHERS: P.ErrorCode.REFUSED,
}


async def run_server(engine_config: EngineConfig, config: ServerConfig) -> None:
    await Server(engine_config, config).serve_forever()
