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

Here: the server's life (the engine, the port), the engine's chunks to each stream's viewers, and admission:
`admit` answers a viewer's start or watch, whatever door it came by, with its Viewer (its `ready` first in its
outbox) or the refusal. The doors: `websocket` (a socket's messages to its ViewerDriver, streamsvc/viewers/driver.py)
and `open_webrtc` (a WHEP POST, streamsvc/door/whep.py, through the same driver); a cluster replica drives its
viewers the same way (streamsvc/cluster/replica.py). Beside it: streamsvc/viewers/streams.py (what happens in an
open stream once a viewer is in: its control messages, leaving, ending), streamsvc/door/entry.py (the token and the
caps), streamsvc/door/routes.py (the HTTP routes), streamsvc/door/port.py (the port itself) and streamsvc/metrics.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import http
import itertools
import logging
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from streamsvc.door.access import AccessConfig, ProtocolErrors, Refusal, TokenBucket, secret_matches
from streamsvc.door.cpumeter import CpuMeter
from streamsvc.door.entry import Client, Entry, Refused
from streamsvc.door.front import Connection
from streamsvc.door.guard import Guard
from streamsvc.door.images import ImageUploads
from streamsvc.door.port import Port, serve_until_signalled
from streamsvc.door.routes import WS_PATH, HttpReply, HttpRequest, Routes, text_reply
from streamsvc.door.whep import Endpoints, WhepOutlet, WhepSession
from streamsvc.door.whip import Ingest
from streamsvc.engine.config import EngineConfig
from streamsvc.engine.engine import ChunkOut, Engine
from streamsvc.engine.heap import Heap
from streamsvc.inputs.ws import input_frames, ready_fields
from streamsvc.metrics import Metrics
from streamsvc.scheduling import SendSampler
from streamsvc.transport.webrtc import WebRtcTransport
from streamsvc.transport.ws import Outlet, WebSocketOutlet
from streamsvc.viewers.driver import ViewerDriver
from streamsvc.viewers.outbox import Outbox, OutboxLimits
from streamsvc.viewers.record import RecordingStore
from streamsvc.viewers.session import Role, Session, Viewer
from streamsvc.viewers.streams import Streams, chapter_title, wire_vocabulary, wire_words
from streamsvc.wire import protocol as P
from streamsvc.wire.image import ImageError
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

    # tables that outlive the streams by design (see table_sizes), each bounded: the door's request-rate buckets by
    # address (access.RATE_TABLE_SIZE), its refusals' log keys (LogGate.size), the recordings known (as many as the
    # recordings directory holds), the start images uploaded (door/images.py: MAX_UPLOADS, each for TTL_S)
    KEPT_TABLES = frozenset({"door.rate_buckets", "door.log_keys", "recordings.known", "images.uploads"})

    def __init__(self, engine_config: EngineConfig, config: ServerConfig = ServerConfig(),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock  # the control rates' time (tests inject one)
        self._chunks_sent = 0  # chunks handed to the transports (the SEND stage's measure)
        self._send_meter: asyncio.Task | None = None
        # the event loop's CPU on clients without a stream (HTTP requests, a connection's messages before it has a
        # stream): left out of the send's and (on a CPU device) the forwards' cost samples, shown in /metrics
        self.streamless = CpuMeter()
        self.engine_config = engine_config
        self.metrics = Metrics()
        self.guard = Guard(config.access, self.metrics, clock)  # what one address may hold and cost on the port
        self.entry = Entry(config.access, config.max_streams, self.metrics)  # who may open or watch a stream
        self.sessions: dict[str, Session] = {}
        self._ids = itertools.count()
        self._viewer_ids = itertools.count()
        self.recordings = RecordingStore(Path(config.recordings_dir), config.record_max_bytes)
        self._loop: asyncio.AbstractEventLoop | None = None
        self.front = Port(config, self.guard, self.streamless, self.metrics, self.websocket,  # (a replica: unopened)
                          body_limits=ImageUploads.body_limits())
        self.webrtc: dict[str, WebRtcTransport] = {}  # viewer id -> its peer connection, for transport 'webrtc'
        # on a loopback address, WebRTC offers loopback candidates too (a loopback-only host can connect)
        self._webrtc_config = dataclasses.replace(
            config.webrtc, ice_addresses=server_ice_addresses(config.host, config.webrtc.ice_addresses))
        self.engine = Engine(engine_config, on_chunk=self._from_engine(self._on_chunk),
                             on_error=self._from_engine(self._on_error), streamless=self.streamless.reading)
        # the process's collections and trims (streams and connections come and go for hours), stream-less work
        self.heap = Heap(metered=lambda fn: self.streamless.hook(fn, event=False))
        self.streams = Streams(self.engine, self.sessions, self.entry.limits, self.recordings, self.metrics, clock,
                               config.orphan_timeout_s, self.heap)
        self.routes = Routes(config.access, config.static_dir, self.recordings, self.metrics,
                             ready=lambda: self.engine.shape is not None and not self.engine.failure,
                             refresh_metrics=self.refresh_metrics,
                             metrics_apart=config.metrics_port is not None, styles=lambda: self.engine.styles.listing)
        self.whep = Endpoints(self, whip=Ingest(self))  # WHEP (a POST's offer served as a connection) and WHIP
        self.uploads = ImageUploads(config.access, self._frame_size, self.routes.token_refusal)  # start images

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self, listen: bool = True) -> None:
        """Start the engine, then listen (``listen=False``: a cluster replica, whose connections come
        from the gateway through streamsvc/cluster instead of a socket)."""
        self._loop = asyncio.get_running_loop()
        await asyncio.wrap_future(self.engine.start())
        self._send_meter = asyncio.create_task(self._measure_send(), name="send-meter")
        if not listen:
            return
        log.info("%s", self.engine_config.describe_latency())
        log.info("serving on %s (WebSocket at %s)", await self.front.open(self._route, self._route_metrics), WS_PATH)

    @property
    def port(self) -> int:
        return self.front.port

    async def stop(self, reason: str = "server shutting down") -> None:
        """Every stream gets `closed`, then the engine stops."""
        for session in list(self.sessions.values()):
            await self.streams.end(session, reason)
        if self._send_meter is not None:
            self._send_meter.cancel()
        await self.front.close()
        self.heap.cancel()
        await asyncio.to_thread(self.engine.stop)

    async def serve_forever(self) -> None:
        """`streamsvc serve`: the process is the server's, so once the engine is up its heap is frozen (the model, the
        libraries, the warm-up: alive for good, out of every later collection; streamsvc/engine/heap.py)."""

        async def start() -> None:
            await self.start()
            self.heap.freeze()

        await serve_until_signalled(start, self.stop)

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

    # -- HTTP (streamsvc/door/port.py serves the routes of streamsvc/door/routes.py) -------------------------------

    def _route(self, request: HttpRequest) -> HttpReply | None:
        """The routes' reply to a request on the port; None: the WebSocket upgrade goes on (the gateway has its
        own). Its CPU is stream-less work (self.streamless). WHEP and WHIP: streamsvc/door/whep.py (the front awaits
        them)."""
        if Endpoints.takes(request.path):
            return self.whep.handle(request)
        if ImageUploads.takes(request.path):  # a start image's upload (streamsvc/door/images.py): the front awaits it
            return self.uploads.handle(request)
        with self.streamless.measure():
            return self.routes.handle(request)

    def _frame_size(self) -> tuple[int, int] | None:
        """The model's frame (width, height), what start images are fitted to; None until the engine is ready."""
        shape = self.engine.shape
        return None if shape is None else (shape.width, shape.height)

    def _route_metrics(self, request: HttpRequest) -> HttpReply:
        """--metrics-port's one route: /metrics, no token (bind it where only the scraper reaches). Stream-less work
        too (self.streamless)."""
        with self.streamless.measure():
            return self.routes.metrics_only(request)

    def refresh_metrics(self) -> None:
        """Bring the metrics' gauges up to date (what GET /metrics runs first)."""
        connections = {"websocket": self.guard.clients.held(), "whip": len(self.whep.whip.publishers),
                       "webrtc": sum(1 for rtc in self.webrtc.values() if rtc.pc is not None)}
        self.metrics.refresh(self.engine, self.sessions.values(), self.recordings.used_bytes, self.streamless.seconds,
                             connections, self.table_sizes())

    def table_sizes(self) -> dict[str, int]:
        """Entries of every table the server keeps per stream, viewer, connection or client address, by a stable name
        (`part.table`), each counted by its part; /metrics shows them as streamsvc_table_entries{table=NAME}. All but
        KEPT_TABLES are 0 once every stream has ended and every connection has closed (the scraper's own connection
        shows in door.connections while it asks), and none grows with a stream's age. The names:

        - viewers.*: sessions (open streams), viewers (steerers and watchers), prompt_texts (each stream's recent
          prompts, for its recording's chapters), gop_chunks (chunks kept for watchers who join), track_queues (WebRTC
          viewers' queue reports), revocable (what a steer secret opened: WHIP publishers), tasks (work spawned off
          callers), webrtc (WebRTC viewers' peer connections);
        - door.*: streams_by_address and streams_by_token (the per-client stream caps' counts), websockets_by_address
          and sockets_by_address (the connection caps' counts), rate_buckets and log_keys (kept), connections,
          handshakes (connections whose first request has not come), websockets, downloads_by_address, http_sessions
          (WHEP and WHIP sessions), whip_publishers;
        - recordings.*: active (being written), known (kept: those in the recordings directory and being written);
        - engine.streams, engine.forwards_in_flight; kv.caches; scheduler.*: streams, parked, prompt_texts (those a
          plan may still run under), chunks_in_flight, releases (input video's released chunks); parking.streams,
          parking.budget_streams; inputs.streams, inputs.chunks (input releases and capture times until the chunk's
          commit); output.streams, output.encoders (x264 encoders alive, in the encoder processes too); styles.streams
          (the streams whose styles the engine holds); images.uploads (start images uploaded, kept).
        """
        sizes = {"viewers.webrtc": len(self.webrtc)}
        for part in (self.streams, self.entry.limits, self.guard, self.front, self.whep, self.recordings, self.engine,
                     self.uploads):
            sizes |= part.table_sizes()
        return sizes

    # -- viewers (streamsvc/viewers/driver.py carries out each one's protocol) ----------------------------------

    async def websocket(self, ws: Connection) -> None:
        """One WebSocket's viewer: its messages to its driver until it closes. Its CPU while it has no stream (before
        `start` or `watch`, after a refusal) is stream-less work (self.streamless): not its stream's, which has none."""
        client = Client.of(ws.remote_address[0] if ws.remote_address else None, ws.headers, self.config.access)
        driver: ViewerDriver | None = None
        stream_less = lambda: driver is None or driver.streamless  # noqa: E731
        # its close is stream-less work while it has no stream: the guard closes an abusive connection from a task of
        # its own, and the front's close reads and parses whatever the peer still sends until its close frame (under a
        # flood of junk frames, three quarters of the loop's CPU)
        outlet = WebSocketOutlet(ws, closing=lambda close: self.streamless.run(close, stream_less))
        driver = ViewerDriver(self, client, outlet, self.guard.connection(outlet, client.address))
        try:
            await self.streamless.run(driver.serve(ws), stream_less)
        finally:
            self.heap.tidy_soon()  # the connection's objects refer to each other: a collection frees them

    async def admit(self, client: Client, msg: P.Start | P.Watch, outlet: Outlet) -> Viewer | Refused:
        """A viewer's start (a new stream, which it steers) or watch (of an open stream): its Viewer, whose outbox
        holds its `ready` first, or the refusal (counted). `outlet`: where its messages will go (its bytes unsent
        count in its outbox's bound)."""
        if isinstance(msg, P.Watch):
            return await self._watch(client, msg, outlet)
        token = self.entry.let_in(client, msg, len(self.sessions))
        if isinstance(token, Refused):
            return token
        stream_id = f"{self.config.stream_prefix}s{next(self._ids)}"
        seed = msg.seed if msg.seed is not None else random.randrange(2**31)
        session = Session(stream_id, msg.fps or 16, msg.prompt, token=token, address=client.address)
        session.prompt_texts[0] = chapter_title(msg.prompt, msg.lora, msg.lora_scale)
        self.sessions[stream_id] = session
        try:
            return await self._open(client, msg, session, seed, outlet)
        except BaseException:  # the viewer left (or the server stops) while its stream was being opened
            await self.streams.end(session, "client disconnected")  # a no-op for a session already refused
            raise

    async def _open(self, client: Client, msg: P.Start, session: Session, seed: int,
                    outlet: Outlet) -> Viewer | Refused:
        """Admission in the engine; the viewer who steers the stream, or the refusal."""
        stream_id, fps = session.stream_id, session.fps
        session.input = input_frames(self.engine, msg, fps)  # input video (issue 35), if it asked for it
        refusal, opened = Refusal.ADMISSION, None
        try:
            image = None if msg.image is None else await self.uploads.resolve(msg.image)  # (streamsvc/wire/image.py)
            opened = await asyncio.wrap_future(self.engine.open_stream(stream_id, msg.prompt, seed, fps, session.input,
                                                                       msg.strength, msg.lora, msg.lora_scale, image))
        except ImageError as e:
            refusal, reason = Refusal.IMAGE, f"the start image cannot be used: {e}; no stream was opened"
        except Exception as e:  # noqa: BLE001 - reported to the client, the server goes on
            log.exception("open_stream failed")
            reason = f"could not open the stream: {type(e).__name__}: {e}"
        else:
            reason = opened.reason
        if opened is None or not opened.accepted:
            self.sessions.pop(stream_id, None)
            session.close("refused")
            self.entry.release(session.token, session.address)
            return self.entry.refuse(refusal, reason or "refused")
        self.metrics.admitted.inc()
        session.description = opened.stream
        viewer = self._new_viewer(client, session, Role.STEER, session.token, outlet)
        viewer.send(self._ready(viewer))
        self._connect(viewer, msg.transport)
        session.join(viewer)
        if self.config.record_all:
            await self.streams.record(viewer, quiet=True)
        return viewer

    def _new_viewer(self, client: Client, session: Session, role: Role, token: str | None, outlet: Outlet) -> Viewer:
        access, now = self.config.access, self.clock()
        outbox = Outbox(self.config.outbox, self.clock, below=outlet.buffered,
                        on_dropped=self.metrics.replies_dropped.inc)
        return Viewer(f"v{next(self._viewer_ids)}", session, role, token=token, address=client.address,
                      control_rate=TokenBucket(access.control_rate, now),
                      stats_rate=TokenBucket(access.stats_rate, now), outbox=outbox)

    def _ready(self, viewer: Viewer) -> P.Ready:
        """A viewer's `ready`: its stream as admission described it, and what is the viewer's own."""
        session = viewer.session
        desc, shape = session.description, session.description.shape
        return P.Ready(
            stream_id=viewer.stream_id, fps=desc.fps, width=shape.width, height=shape.height,
            first_chunk_frames=1 if desc.image else shape.first_chunk_frames, chunk_frames=shape.chunk_frames,
            prompt_version=session.prompt_version, steps=shape.steps, role=viewer.role.value,
            viewer_id=viewer.viewer_id, vocabulary=wire_vocabulary(shape.vocabulary),
            unknown_words=wire_words(desc.unknown_words),
            # the stream's capabilities go to its steerer alone (a watcher came with the watch secret; neither grants
            # a watcher steering)
            **({"watch_secret": session.watch_secret, "steer_secret": session.steer_secret}
               if viewer.role is Role.STEER else {}), **ready_fields(desc), latency=self.engine_config.latency,
            loras=list(self.engine.styles.offered[: P.MAX_LORAS]) or None, lora=desc.lora,
            lora_scale=desc.lora_scale if desc.lora is not None else None, image=desc.image or None,
        )

    def _connect(self, viewer: Viewer, transport: str | None) -> None:
        """A WebRTC viewer's chunks go on a peer connection once its offer is answered (else on the WebSocket)."""
        if transport != "webrtc":
            return
        viewer.rtc = self.webrtc[viewer.viewer_id] = WebRtcTransport(
            viewer, TrackReports(self.engine, viewer), self._webrtc_config,
            on_control=lambda m: self.streams.control(viewer, m),
            on_lost=lambda reason: self.streams.leave(viewer, reason), on_stall=self.metrics.track_stalls.inc,
            on_backlog=self.metrics.refusals.labels(Refusal.SLOW_CLIENT.value).inc,
            protocol_errors=ProtocolErrors(self.config.access.max_protocol_errors),
        )

    async def _watch(self, client: Client, msg: P.Watch, outlet: Outlet) -> Viewer | Refused:
        """A watcher joins an open stream by its watch link (its id and watch secret): the same chunks as its steerer,
        from a keyframe on; no generation."""
        token = self.entry.authorize(client, msg)
        if isinstance(token, Refused):
            return token
        session = self.sessions.get(msg.stream_id)
        # one answer whether the id names an open stream or not (an id grants nothing, and tells nothing)
        if not secret_matches(session.watch_secret if session is not None else None, msg.secret) or session.closed:
            return self.entry.refuse_link(msg.stream_id)
        limit = self.config.max_watchers
        if session.watchers >= limit:
            return self.entry.refuse(Refusal.WATCHERS, f"stream {session.stream_id} has {limit} watchers, its limit "
                                                       "(--max-watchers); try again when one leaves", "watch")
        try:
            admission = await asyncio.wrap_future(self.engine.admit_viewer(session.stream_id))
        except Exception as e:  # noqa: BLE001 - the stream closed meanwhile, or the engine stopped
            return self.entry.refuse(Refusal.NO_STREAM, f"stream {session.stream_id} cannot be watched: {e}", "watch")
        if not admission.accepted:
            return self.entry.refuse(Refusal.ADMISSION, admission.reason or "refused", "watch")
        if session.closed:
            return self.entry.refuse(Refusal.NO_STREAM, f"stream {session.stream_id} ended", "watch")
        self.metrics.watchers_admitted.inc()
        viewer = self._new_viewer(client, session, Role.WATCH, token, outlet)
        viewer.send(self._ready(viewer))
        self._connect(viewer, msg.transport)
        # from a keyframe that does not put it ahead of the stream's other viewers (see streamsvc/viewers/session.py)
        buffered = None if admission.buffered_s is None else admission.buffered_s * session.fps
        if not session.join(viewer, buffered):  # too long since the last keyframe: the next chunk starts with one
            self.engine.request_keyframe(session.stream_id)
        if session.recorder is not None:
            viewer.send(self.streams.recording_message(session))
        self.streams.audience_changed(session)
        return viewer

    def chunk_sent(self, viewer: Viewer) -> None:
        """A chunk of `viewer`'s went to its transport (the SEND stage's measure, its TTFF)."""
        self._chunks_sent += 1
        self.metrics.chunks.inc()
        ttff = viewer.delivered(self._loop.time())
        if ttff is not None:
            (self.metrics.ttff if viewer.role is Role.STEER else self.metrics.watcher_ttff).observe(ttff)

    async def disconnect(self, viewer: Viewer) -> None:
        """`viewer` is done: its WebRTC peer connection, if it has one, closes (even if the caller is cancelled)."""
        if viewer.rtc is not None:
            self.webrtc.pop(viewer.viewer_id, None)
            await asyncio.shield(viewer.rtc.close())


    async def open_webrtc(self, client: Client, first: P.Start | P.Watch, offer: str,
                          deadline: float) -> WhepSession | HttpReply:
        """A WHEP session (streamsvc/door/whep.py): its viewer's `first` (a start or a watch, transport webrtc), then
        its `offer`, through the viewer's protocol as a socket's messages go; by `deadline` (loop time) the session,
        or the reply that says why not."""
        outlet = WhepOutlet()
        driver = ViewerDriver(self, client, outlet)
        # its set-up is work of no stream until it has one (self.streamless), as a socket's messages before then are
        return await self.streamless.run(self._set_up_webrtc(driver, outlet, first, offer, deadline),
                                         lambda: driver.streamless)

    async def _set_up_webrtc(self, driver: ViewerDriver, outlet: WhepOutlet, first: P.Start | P.Watch, offer: str,
                             deadline: float) -> WhepSession | HttpReply:
        steers = isinstance(first, P.Start)

        async def close() -> None:  # its DELETE, or a session that did not come up: its stream or its viewer ends
            if steers and driver.viewer is not None:
                await driver.receive_message(P.Close())
            await outlet.close(1000, "session ended")
            await driver.close("session ended")

        try:
            async with asyncio.timeout_at(deadline):
                await driver.receive_message(first)
                if driver.viewer is None:
                    return outlet.refusal(driver.refusal, "the stream could not be opened")
                await driver.receive_message(P.Offer(sdp=offer))
                answer = await outlet.expect(P.Answer, deadline)
        except TimeoutError:
            answer = None
        if not isinstance(answer, P.Answer):
            refusal = outlet.refusal(answer, "the offer could not be answered")
            await close()
            return refusal
        outlet.set_up = True
        if outlet.ended.is_set():  # it ended between its answer and now
            await driver.close(outlet.reason)
            return text_reply(http.HTTPStatus.SERVICE_UNAVAILABLE, f"the stream ended: {outlet.reason}")

        async def ended() -> None:  # the stream ended, or the session was closed
            await outlet.ended.wait()
            await driver.close(outlet.reason or "session ended")

        session = driver.viewer.session
        return WhepSession(session.stream_id, answer.sdp, outlet, close, asyncio.ensure_future(ended()),
                           **({"watch_secret": session.watch_secret, "steer_secret": session.steer_secret}
                              if steers else {}))


class TrackReports:
    """What a viewer's WebRTC track tells the engine (WebRtcTransport's `engine`): its queue of frames, as the lowest
    of its stream's WebRTC viewers (the model follows the viewer closest to stalling), and its keyframe requests.
    A viewer that left its stream reports nothing: its track may still send what it had queued until its peer
    connection closes, and its entry (dropped when it left) would come back for the stream's life, holding the
    stream's model at a queue nobody plays."""

    def __init__(self, engine: Engine, viewer: Viewer) -> None:
        self.engine, self.viewer = engine, viewer

    def observe_buffer(self, stream_id: str, buffered_frames: float, grace_s: float = 0.0) -> None:
        if self.viewer.closed:
            return
        queues = self.viewer.session.track_queues
        queues[self.viewer.viewer_id] = buffered_frames
        self.engine.observe_buffer(stream_id, min(queues.values()), grace_s=grace_s)

    def request_keyframe(self, stream_id: str) -> None:
        self.engine.request_keyframe(stream_id)


async def run_server(engine_config: EngineConfig, config: ServerConfig) -> None:
    await Server(engine_config, config).serve_forever()
