"""`streamsvc serve`: the WebSocket endpoint, /healthz, /metrics and the player's static files on one port.

One WebSocket connection carries one stream: the client sends `start`, gets `ready`,
then every chunk as one binary message (see streamsvc/protocol.py) while it steers
with `set_prompt`, `pause`, `resume` and `close`. A bad message gets an `error` back and
the stream goes on; a client that vanishes has its stream closed and its KV cache freed.

Who may do what (streamsvc/access.py): a browser's upgrade must come from an allowed origin,
a stream starts only with a valid token when tokens are configured, each token and address
holds a limited number of streams, and each stream's control messages are rate-limited; every
refusal says why on the wire and is counted in /metrics by reason. Prompts are coalesced
(session.PromptGate): one recache per chunk at most, however fast a viewer sends them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import http
import itertools
import logging
import mimetypes
import random
import re
import signal
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from websockets.asyncio.server import ServerConnection, serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from streamsvc import protocol as P
from streamsvc.access import AccessConfig, Refusal, StreamLimits, TokenBucket, bearer_token, client_address, \
    exposure_warning, find_token, origin_allowed
from streamsvc.engine import ChunkOut, Engine, EngineConfig, EngineError
from streamsvc.record import RecordingRefused, RecordingStore
from streamsvc.session import Role, Session, SessionState, Viewer
from streamsvc.rtc import SignalingError, WebRtcConfig, server_ice_addresses
from streamsvc.transport.webrtc import WebRtcTransport

log = logging.getLogger("streamsvc.server")

WS_PATH = "/ws"
RECORDINGS_PATH = "/recordings/"  # GET /recordings/ID.mp4 (and ID.vtt, its chapters)
AUDIENCE_DELAY_S = 0.25  # joins and leaves within this make one `audience` message to each viewer
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
    orphan_timeout_s: float = 60.0  # a stream whose steerer left goes on this long for its watchers
    recordings_dir: str = "recordings"  # where recordings go (`record` messages, --record) and are served from
    record_all: bool = False  # record every stream (--record DIR)
    record_max_bytes: int = 4 << 30  # disk the recordings may use; a recording past it stops, a new one is refused
    # what this server's stream ids begin with: a cluster replica's own ("<replica>-"), so that a watch link names
    # the replica that runs its stream
    stream_prefix: str = ""

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_-]*", self.stream_prefix):
            raise ValueError(f"stream_prefix={self.stream_prefix!r}: letters, digits, '_' and '-' only")
        if self.max_watchers < 0:
            raise ValueError(f"max_watchers={self.max_watchers}: give 0 (no watchers) or more")
        if not self.orphan_timeout_s >= 0:
            raise ValueError(f"orphan_timeout_s={self.orphan_timeout_s}: give a number of seconds >= 0")


class Metrics:
    """Prometheus metrics of one server (its own registry, no globals)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.streams = Gauge("streamsvc_streams", "Open streams by state", ["state"], registry=r)
        self.admitted = Counter("streamsvc_streams_admitted", "Streams admitted", registry=r)
        self.refused = Counter("streamsvc_streams_refused", "Streams refused at admission", registry=r)
        self.stalls = Gauge("streamsvc_modelled_stalls", "Stalls of open streams in the scheduler's playback model", registry=r)
        self.client_stalls = Counter("streamsvc_client_stalls", "Stalls reported by clients (stats messages)", registry=r)
        self.track_stalls = Counter("streamsvc_webrtc_track_stalls",
                                    "WebRTC: times a track had no frame at its due time (stalls the server caused)",
                                    registry=r)
        self.ttff = Histogram("streamsvc_ttff_seconds", "Admission to first chunk sent", registry=r,
                              buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10))
        self.watcher_ttff = Histogram("streamsvc_watcher_ttff_seconds", "A watcher's join to its first chunk sent",
                                      registry=r, buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10))
        self.watchers = Gauge("streamsvc_watchers", "Viewers watching open streams (steerers not counted)", registry=r)
        self.watchers_admitted = Counter("streamsvc_watchers_admitted", "Watchers admitted", registry=r)
        self.orphans = Gauge("streamsvc_orphaned_streams", "Open streams whose steerer left (watchers remain)",
                             registry=r)
        self.recordings = Gauge("streamsvc_recordings", "Streams being recorded", registry=r)
        self.recording_bytes = Gauge("streamsvc_recordings_bytes", "Disk the recordings use", registry=r)
        self.chunk_latency = Histogram("streamsvc_chunk_latency_seconds", "First denoising step to chunk ready",
                                       registry=r, buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5))
        self.chunks = Counter("streamsvc_chunks", "Chunks sent", registry=r)
        self.degraded = Gauge("streamsvc_degraded_chunks", "Chunks degraded instead of a stall, by the stage that "
                              "was late (device: fewer denoising steps; encode: a cheaper x264 encode)", ["stage"],
                              registry=r)
        self.overloaded = Counter("streamsvc_streams_overloaded", "Streams ended as the last resort (error 'overloaded'): "
                                  "degradation could no longer keep every stream from stalling", registry=r)
        self.stage_load = Gauge("streamsvc_stage_load", "Predicted busy fraction of each stage a chunk passes "
                                "(what admission checks against its target)", ["stage"], registry=r)
        self.admission_closed = Gauge("streamsvc_admission_closed",
                                      "1 while a stream was late lately: no stream is admitted (the closed loop)", registry=r)
        self.pressure = Gauge("streamsvc_scheduler_pressure",
                              "1 while a chunk was degraded lately (no stream steers ahead of its lead)", registry=r)
        self.queue = Gauge("streamsvc_scheduler_queue", "Streams that want a forward now", registry=r)
        self.load = Gauge("streamsvc_scheduler_load", "Predicted busy fraction of the engine", registry=r)
        self.kv_bytes = Gauge("streamsvc_kv_bytes", "KV cache bytes held by open streams", registry=r)
        self.kv_budget = Gauge("streamsvc_kv_budget_bytes", "KV pool budget", registry=r)
        self.forwards = Gauge("streamsvc_forwards", "Forwards run, by kind", ["kind"], registry=r)
        self.forward_s = Gauge("streamsvc_forward_seconds", "Time spent in forwards, by kind", ["kind"], registry=r)
        self.forward_gpu_s = Gauge("streamsvc_forward_gpu_seconds",
                                   "Device time of forwards by CUDA events (CPU: wall time), by kind", ["kind"], registry=r)
        self.encode_s = Gauge("streamsvc_encode_seconds", "Output stage time: frames to host, x264 and packing",
                              registry=r)
        self.chunks_encoded = Gauge("streamsvc_chunks_encoded", "Chunks through the output stage", registry=r)
        self.chunk_latency_max = Gauge("streamsvc_chunk_latency_max_seconds",
                                       "Slowest chunk so far: its first forward's launch to its hand-over", registry=r)
        self.parked = Gauge("streamsvc_parked_streams", "Paused streams whose state is parked in host memory",
                            registry=r)
        self.parked_bytes = Gauge("streamsvc_parked_bytes", "Host memory the parked streams hold", registry=r)
        self.park_budget = Gauge("streamsvc_park_budget_bytes", "Host memory parked streams may hold", registry=r)
        self.parks = Gauge("streamsvc_parks", "Streams parked (pauses) and brought back (resumes)", ["op"],
                           registry=r)
        self.park_s = Gauge("streamsvc_park_seconds", "Time of the parks' and resumes' copies, in total", ["op"],
                            registry=r)
        self.errors = Counter("streamsvc_protocol_errors", "Bad client messages answered with an error", registry=r)
        self.refusals = Counter("streamsvc_refusals", "Requests refused, by reason", ["reason"], registry=r)
        for reason in Refusal:
            self.refusals.labels(reason.value)  # every reason shows, at 0 until it happens


class Server:
    def __init__(self, engine_config: EngineConfig, config: ServerConfig = ServerConfig(),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock  # the control rates' time (tests inject one)
        self.limits = StreamLimits(config.access)
        self._tasks: set[asyncio.Task] = set()  # prompts released at a chunk (kept referenced until done)
        self._chunks_sent = 0  # chunks handed to the transports (the SEND stage's measure)
        self._send_meter: asyncio.Task | None = None
        self.engine_config = engine_config
        self.metrics = Metrics()
        self.sessions: dict[str, Session] = {}
        self._ids = itertools.count()
        self._viewer_ids = itertools.count()
        self.recordings = RecordingStore(Path(config.recordings_dir), config.record_max_bytes)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server = None
        self.webrtc: dict[str, WebRtcTransport] = {}  # viewer id -> its peer connection, for transport 'webrtc'
        # on a loopback address, WebRTC offers loopback candidates too (a loopback-only host can connect)
        self._webrtc_config = dataclasses.replace(
            config.webrtc, ice_addresses=server_ice_addresses(config.host, config.webrtc.ice_addresses))
        self.engine = Engine(engine_config, on_chunk=self._from_engine(self._on_chunk),
                             on_error=self._from_engine(self._on_error))

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self, listen: bool = True) -> None:
        """Start the engine, then listen (``listen=False``: a cluster replica, whose connections come
        from the gateway through streamsvc/cluster instead of a socket)."""
        self._loop = asyncio.get_running_loop()
        await asyncio.wrap_future(self.engine.start())
        self._send_meter = asyncio.create_task(self._measure_send(), name="send-meter")
        if not listen:
            return
        self._server = await serve(
            self._handle, self.config.host, self.config.port, process_request=self._http,
            compression=None, max_size=P.MAX_MESSAGE_BYTES, ping_interval=20, ping_timeout=20,
        )
        log.info("serving on http://%s:%d (WebSocket at %s)", self.config.host, self.port, WS_PATH)
        warning = exposure_warning(self.config.host, self.config.access)
        if warning:
            log.warning(warning)

    @property
    def port(self) -> int:
        return self._server.sockets[0].getsockname()[1]

    async def stop(self, reason: str = "server shutting down") -> None:
        """Every stream gets `closed`, then the engine stops."""
        for session in list(self.sessions.values()):
            await self._end(session, reason)
        if self._send_meter is not None:
            self._send_meter.cancel()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
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
        """Every SEND_PERIOD_S, the event loop's CPU time per chunk sent (everything it does: the sends, control
        messages, WebRTC's packetizing and encryption) goes to admission as the SEND stage's cost."""
        cpu, chunks = time.thread_time(), self._chunks_sent
        while True:
            await asyncio.sleep(SEND_PERIOD_S)
            if self._chunks_sent - chunks >= SEND_MIN_CHUNKS:
                now_cpu = time.thread_time()
                self.engine.observe_send((now_cpu - cpu) / (self._chunks_sent - chunks))
                cpu, chunks = now_cpu, self._chunks_sent

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
        if session.recorder is not None:
            self._record_chunk(session, out)
        self._spawn(self._release_prompt(session))

    def _record_chunk(self, session: Session, out: ChunkOut) -> None:
        recorder = session.recorder
        try:
            recorder.add(out.header, out.access_units, session.prompt_texts.get(out.header.prompt_version, ""))
        except Exception as e:  # noqa: BLE001 - a failed recording ends the recording, not the stream
            log.exception("stream %s: recording failed", session.stream_id)
            recorder.stopped_reason = recorder.stopped_reason or f"recording failed: {type(e).__name__}: {e}"
        if recorder.stopped_reason is not None:
            with contextlib.suppress(Exception):
                recorder.close()
            session.recorder = None
            session.to_steerer(P.Error(code=P.ErrorCode.UNAVAILABLE, request="record",
                                       message=recorder.stopped_reason[: P.MAX_TEXT_CHARS]))

    def _on_error(self, stream_id: str, message: str, code: str) -> None:
        """The engine ended a stream: a failure ("internal") or the last resort ("overloaded")."""
        session = self.sessions.get(stream_id)
        if code == P.ErrorCode.OVERLOADED:
            self.metrics.overloaded.inc()
        if session is None:
            return
        if code == "park_expired":  # a paused stream parked past --park-timeout: it ends, no failure
            asyncio.ensure_future(self._end(session, message, engine_closed=True))
            return
        for viewer in list(session.viewers.values()):
            viewer.send(P.Error(code=P.ErrorCode(code), message=message[: P.MAX_TEXT_CHARS]))
        reason = "overloaded" if code == P.ErrorCode.OVERLOADED else "generation failed"
        asyncio.ensure_future(self._end(session, reason, engine_closed=True))

    # -- HTTP ---------------------------------------------------------------------------------

    def _http(self, connection: ServerConnection, request: Request) -> Response | None:
        path = request.path.split("?", 1)[0]
        if path == WS_PATH:
            return self._check_origin(request)  # None: the WebSocket handshake goes on
        if path == "/healthz":
            ok = self.engine.snapshot is not None
            return self._respond(http.HTTPStatus.OK if ok else http.HTTPStatus.SERVICE_UNAVAILABLE,
                                 b"ok\n" if ok else b"starting\n", "text/plain")
        if path == "/metrics":
            self._refresh_metrics()
            return self._respond(http.HTTPStatus.OK, generate_latest(self.metrics.registry), "text/plain; version=0.0.4")
        if path.startswith(RECORDINGS_PATH):
            return self._recording(request, path.removeprefix(RECORDINGS_PATH))
        return self._static(path)

    def _recording(self, request: Request, name: str) -> Response:
        """A recording (ID.mp4) or its chapters (ID.vtt), behind the access token when the server has tokens (as
        `?token=` for a page's <video>, or an Authorization header); a Range request gets its part (seeking)."""
        access = self.config.access
        if access.auth:
            query = parse_qs(urlsplit(request.path).query)
            given = (query.get("token") or [None])[0] or bearer_token(request.headers.get("Authorization"))
            if find_token(access.tokens, given) is None:
                self.metrics.refusals.labels(Refusal.UNAUTHORIZED.value).inc()
                return self._respond(http.HTTPStatus.UNAUTHORIZED, b"this server needs an access token: add "
                                     b"?token=... to the address or send an Authorization: Bearer header\n", "text/plain")
        if self.recordings.in_progress(name):  # its index (the moov box) and chapters are written when it ends
            return self._respond(http.HTTPStatus.CONFLICT, b"recording in progress: it can be fetched once its "
                                 b"stream ends or its steerer stops recording\n", "text/plain")
        target = self.recordings.path(name)
        if target is None:
            return self._respond(http.HTTPStatus.NOT_FOUND, b"no such recording\n", "text/plain")
        ctype = "video/mp4" if target.suffix == ".mp4" else "text/vtt; charset=utf-8"
        size = target.stat().st_size
        span = _byte_range(request.headers.get("Range"), size)
        with target.open("rb") as f:  # a seek reads only the part asked for
            if span is None:
                response = self._respond(http.HTTPStatus.OK, f.read(), ctype)
            else:
                start, end = span
                f.seek(start)
                response = self._respond(http.HTTPStatus.PARTIAL_CONTENT, f.read(end + 1 - start), ctype)
                response.headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        response.headers["Accept-Ranges"] = "bytes"
        return response

    def _check_origin(self, request: Request) -> Response | None:
        """Refuses (403) a browser's upgrade from a page of another site; see access.origin_allowed."""
        origin, host = request.headers.get("Origin"), request.headers.get("Host")
        if origin_allowed(origin, host, self.config.access.allowed_origins):
            return None
        self.metrics.refusals.labels(Refusal.ORIGIN.value).inc()
        text = (f"origin {origin[:200]!r} may not open streams here: only pages of this server (Host {host!r}) "
                "and origins given with --allow-origin may\n")
        return self._respond(http.HTTPStatus.FORBIDDEN, text.encode(), "text/plain")

    def _static(self, path: str) -> Response:
        root = self.config.static_dir
        if root is None:
            return self._respond(http.HTTPStatus.NOT_FOUND, b"no player here; connect a client to /ws\n", "text/plain")
        base = Path(root).resolve()
        target = (base / (path.lstrip("/") or "index.html")).resolve()
        if base not in target.parents and target != base or not target.is_file():
            return self._respond(http.HTTPStatus.NOT_FOUND, b"not found\n", "text/plain")
        ctype = mimetypes.guess_type(target.name)[0] or "application/octet-stream"
        return self._respond(http.HTTPStatus.OK, target.read_bytes(), ctype)

    @staticmethod
    def _respond(status: http.HTTPStatus, body: bytes, ctype: str) -> Response:
        headers = Headers([("Content-Type", ctype), ("Content-Length", str(len(body))), ("Cache-Control", "no-store")])
        return Response(status.value, status.phrase, headers, body)

    def _refresh_metrics(self) -> None:
        m, snap = self.metrics, self.engine.snapshot
        for state in SessionState:
            m.streams.labels(state.value).set(sum(1 for s in self.sessions.values() if s.state is state))
        m.kv_bytes.set(self.engine.kv_used_bytes)
        m.watchers.set(sum(s.watchers for s in self.sessions.values()))
        m.orphans.set(sum(1 for s in self.sessions.values() if s.steerer is None))
        m.recordings.set(sum(1 for s in self.sessions.values() if s.recorder is not None))
        m.recording_bytes.set(self.recordings.used_bytes)
        m.kv_budget.set(self.engine.kv_budget_bytes)
        for kind, n in self.engine.forwards.items():
            m.forwards.labels(kind).set(n)
            m.forward_s.labels(kind).set(self.engine.forward_seconds[kind])
            m.forward_gpu_s.labels(kind).set(self.engine.gpu_seconds[kind])
        m.encode_s.set(self.engine.encode_seconds)
        m.chunks_encoded.set(self.engine.chunks_encoded)
        m.chunk_latency_max.set(self.engine.chunk_latency_max_s)
        m.parked.set(self.engine.parked_streams)
        m.parked_bytes.set(self.engine.parked_bytes)
        m.park_budget.set(self.engine.config.park_budget_bytes)
        for op, n, seconds in (("park", self.engine.parks, self.engine.park_seconds),
                               ("restore", self.engine.restores, self.engine.restore_seconds)):
            m.parks.labels(op).set(n)
            m.park_s.labels(op).set(seconds)
        m.degraded.labels("device").set(self.engine.degraded_chunks)
        m.degraded.labels("encode").set(self.engine.fast_encodes)
        if snap is not None:
            for stage, load in snap.stage_load.items():
                m.stage_load.labels(stage.value).set(load)
            m.admission_closed.set(int(snap.late))
            m.pressure.set(int(snap.pressure))
            m.queue.set(snap.queue_length)
            m.load.set(snap.predicted_load)
            m.stalls.set(snap.stalls)

    # -- WebSocket ----------------------------------------------------------------------------

    async def _handle(self, ws: ServerConnection) -> None:
        viewer: Viewer | None = None
        sender: asyncio.Task | None = None
        try:
            async for raw in ws:
                try:
                    msg = P.parse_client(raw)
                except P.ProtocolError as e:
                    self.metrics.errors.inc()
                    await self._send_now(ws, viewer, e.to_message())
                    continue
                if isinstance(msg, (P.Start, P.Watch)):
                    if viewer is not None:
                        await self._send_now(ws, viewer, P.Error(code=P.ErrorCode.ALREADY_STARTED, message=(
                            f"this connection already {'steers' if viewer.role is Role.STEER else 'watches'} stream "
                            f"{viewer.stream_id}; open another connection for another stream")))
                        continue
                    viewer = await (self._start(ws, msg) if isinstance(msg, P.Start) else self._watch(ws, msg))
                    if viewer is not None:
                        sender = asyncio.create_task(self._sender(ws, viewer), name=f"send-{viewer.viewer_id}")
                elif viewer is None:
                    await ws.send(P.encode(P.Error(code=P.ErrorCode.NOT_STARTED,
                                                   message=f"send 'start' or 'watch' before '{msg.type}'")))
                else:
                    await self._control(viewer, msg)
                    if viewer.closed:
                        break
        except ConnectionClosed:
            pass
        finally:
            if viewer is not None:
                await self._leave(viewer, "client disconnected")
            if sender is not None:
                with contextlib.suppress(asyncio.TimeoutError, ConnectionClosed):
                    await asyncio.wait_for(sender, timeout=2)
                sender.cancel()

    async def _send_now(self, ws, viewer: Viewer | None, msg) -> None:
        if viewer is not None:
            viewer.send(msg)
        else:
            await ws.send(P.encode(msg))

    async def _authorize(self, ws: ServerConnection, msg: P.Start | P.Watch) -> tuple[bool, str | None]:
        """The access token check of a start or watch: (allowed, the token); a refusal has gone out when not."""
        access = self.config.access
        given = msg.token or bearer_token(ws.request.headers.get("Authorization"))
        token = find_token(access.tokens, given)
        if access.auth and token is None:
            await self._refuse(ws, Refusal.UNAUTHORIZED, "the access token is not valid" if given else (
                "this server needs an access token: send it as 'token' in start or as an 'Authorization: Bearer' "
                "header (the player takes it from the page address: #token=...)"), msg.type)
            await ws.close(1008, "unauthorized")
            return False, None
        return True, token

    def _address(self, ws: ServerConnection) -> str:
        remote = ws.remote_address[0] if ws.remote_address else None
        return client_address(remote, ws.request.headers.get("X-Forwarded-For"), self.config.access.trust_proxy)

    async def _let_in(self, ws: ServerConnection, msg: P.Start) -> tuple[str | None, str] | None:
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

    def _new_viewer(self, ws: ServerConnection, session: Session, role: Role, token: str | None) -> Viewer:
        access, now = self.config.access, self.clock()
        return Viewer(f"v{next(self._viewer_ids)}", session, role, token=token, address=self._address(ws),
                      control_rate=TokenBucket(access.control_rate, now), stats_rate=TokenBucket(access.stats_rate, now))

    async def _start(self, ws: ServerConnection, msg: P.Start) -> Viewer | None:
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
            await self._end(session, "client disconnected")  # a no-op for a session already refused
            raise

    async def _open(self, ws: ServerConnection, msg: P.Start, session: Session, seed: int) -> Viewer | None:
        """Admission in the engine, then `ready` (or the refusal) to the viewer, who steers the stream."""
        stream_id, fps = session.stream_id, session.fps
        try:
            admission = await asyncio.wrap_future(self.engine.open_stream(stream_id, msg.prompt, seed, fps))
        except Exception as e:  # noqa: BLE001 - reported to the client, the server goes on
            log.exception("open_stream failed")
            admission = None
            reason = f"could not open the stream: {type(e).__name__}: {e}"
        else:
            reason = admission.reason
        if admission is None or not admission.accepted:
            self.sessions.pop(stream_id, None)
            session.close("refused")
            self.limits.release(session.token, session.address)
            await self._refuse(ws, Refusal.ADMISSION, reason or "refused")
            return None
        self.metrics.admitted.inc()
        viewer = self._new_viewer(ws, session, Role.STEER, session.token)
        await ws.send(P.encode(self._ready(viewer)))
        self._connect(viewer, msg.transport)
        session.join(viewer)
        if self.config.record_all:
            await self._record(viewer, quiet=True)
        return viewer

    def _ready(self, viewer: Viewer) -> P.Ready:
        gen = self.engine.gen
        return P.Ready(
            stream_id=viewer.stream_id, fps=viewer.fps, width=gen.model_cfg.width, height=gen.model_cfg.height,
            first_chunk_frames=gen.frames_in_chunk(0), chunk_frames=gen.frames_in_chunk(1),
            prompt_version=viewer.session.prompt_version, steps=len(gen.sigmas), role=viewer.role.value,
            viewer_id=viewer.viewer_id,
        )

    def _connect(self, viewer: Viewer, transport: str | None) -> None:
        """A WebRTC viewer's chunks go on a peer connection once its offer is answered (else on the WebSocket)."""
        if transport != "webrtc":
            return
        viewer.rtc = self.webrtc[viewer.viewer_id] = WebRtcTransport(
            viewer, _TrackReports(self.engine, viewer), self._webrtc_config,
            on_control=lambda m: self._control(viewer, m), on_lost=lambda reason: self._leave(viewer, reason),
            on_stall=self.metrics.track_stalls.inc,
        )

    async def _watch(self, ws: ServerConnection, msg: P.Watch) -> Viewer | None:
        """A watcher joins an open stream: the same chunks as its steerer, from a keyframe on; no generation."""
        allowed, token = await self._authorize(ws, msg)
        if not allowed:
            return None
        session = self.sessions.get(msg.stream_id)
        if session is None or session.closed:
            await self._refuse(ws, Refusal.NO_STREAM, f"no open stream {msg.stream_id!r} here: it ended, or the watch "
                                                      "link is from another server", "watch")
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
        # from a keyframe that does not put it ahead of the stream's other viewers (see streamsvc/session.py)
        buffered = None if admission.buffered_s is None else admission.buffered_s * session.fps
        if not session.join(viewer, buffered):  # too long since the last keyframe: the next chunk starts with one
            self.engine.request_keyframe(session.stream_id)
        if session.recorder is not None:
            viewer.send(self._recording_message(session))
        self._audience_changed(session)
        return viewer

    async def _refuse(self, ws: ServerConnection, reason: Refusal, message: str, request: str = "start") -> None:
        """Answer a start or watch that will not be served with the code of its reason, and count it."""
        self.metrics.refusals.labels(reason.value).inc()
        if reason in (Refusal.SERVER_CAP, Refusal.ADMISSION) and request == "start":
            self.metrics.refused.inc()
        await ws.send(P.encode(P.Error(code=_START_REFUSAL_CODES[reason], message=message[: P.MAX_TEXT_CHARS],
                                       request=request)))

    def _over_rate(self, viewer: Viewer, msg) -> P.Error | None:
        """The error for a control message over its viewer's rate (stats have a rate of their own), or
        None when it may go on; close always may."""
        if isinstance(msg, P.Close):
            return None
        stats = isinstance(msg, P.Stats)
        bucket = viewer.stats_rate if stats else viewer.control_rate
        if bucket.take(self.clock()):
            return None
        self.metrics.refusals.labels((Refusal.STATS_RATE_LIMITED if stats else Refusal.RATE_LIMITED).value).inc()
        rate = bucket.rate
        return P.Error(code=P.ErrorCode.RATE_LIMITED, request=msg.type, message=(
            f"'{msg.type}' dropped: this stream may send {rate.per_s:g} {'stats' if stats else 'control'} messages "
            f"a second (bursts of {rate.burst}); the stream goes on"))

    async def _control(self, viewer: Viewer, msg) -> None:
        session = viewer.session
        sid = session.stream_id
        refusal = self._over_rate(viewer, msg)
        if isinstance(msg, _STEER_TYPES) and viewer is not session.steerer:
            holder = session.steerer
            viewer.send(P.Error(code=P.ErrorCode.NOT_STEERER, request=msg.type, message=(
                f"'{msg.type}' refused: only the stream's steerer may send it, and you watch it; "
                + (f"its steerer ({holder.viewer_id}) can hand you the token" if holder is not None else
                   "nobody steers it now: send 'take' to steer it"))))
            return
        if isinstance(msg, P.SetPrompt):
            await self._steer(session, msg.prompt, refusal)
            return
        if refusal is not None:
            viewer.send(refusal)
            return
        try:
            if isinstance(msg, (P.Pause, P.Resume)):
                await self._pause_or_resume(viewer, isinstance(msg, P.Pause))
            elif isinstance(msg, P.Stats):
                if msg.stalls > viewer.client_stalls:
                    self.metrics.client_stalls.inc(msg.stalls - viewer.client_stalls)
                    viewer.client_stalls = msg.stalls
                # it left the viewer a while ago (more so on a busy host): it may lower the model, never raise it;
                # the stream's model follows its viewer with the least buffered, a watcher's as much as its steerer's
                await asyncio.wrap_future(self.engine.observe_buffer(sid, viewer.buffered_frames(msg), at_most=True))
                if viewer is session.steerer:
                    session.buffer_report(msg.buffered_s)
            elif isinstance(msg, P.Close):
                if viewer is session.steerer:
                    await self._end(session, "closed by client")
                else:
                    await self._leave(viewer, "closed by client")
            elif isinstance(msg, P.Handover):
                self._handover(viewer, msg.to)
            elif isinstance(msg, P.Take):
                self._take(viewer)
            elif isinstance(msg, P.Record):
                await self._record(viewer)
            elif isinstance(msg, P.Offer):
                if viewer.rtc is None:
                    viewer.send(P.Error(code=P.ErrorCode.INVALID_FIELD, message=(
                        f"this connection's transport is 'ws'; send {viewer.role.value == 'watch' and 'watch' or 'start'}"
                        " with transport 'webrtc' to use an offer")))
                    return
                try:
                    viewer.send(P.Answer(sdp=await viewer.rtc.answer(msg.sdp)))
                except SignalingError as e:
                    viewer.send(P.Error(code=P.ErrorCode.INVALID_FIELD, message=str(e)[: P.MAX_TEXT_CHARS]))
        except Exception as e:  # noqa: BLE001 - a failed request is reported, the stream goes on
            if viewer.closed:
                return
            viewer.send(_failed(msg.type, e))

    async def _pause_or_resume(self, viewer: Viewer, pause: bool) -> None:
        """Park the stream's state in host memory, or bring it back. Both are idempotent: a repeat is
        acknowledged and does nothing. A refusal (no park budget, no room on the device to resume) is
        `unavailable` with the engine's reason; the stream stays as it was."""
        session, request = viewer.session, "pause" if pause else "resume"
        if pause is not (session.state is SessionState.PAUSED):
            try:
                await asyncio.wrap_future((self.engine.pause if pause else self.engine.resume)(session.stream_id))
            except EngineError as e:
                viewer.send(P.Error(code=P.ErrorCode.UNAVAILABLE, request=request, message=str(e)[: P.MAX_TEXT_CHARS]))
                return
            if pause:
                session.pause()
            else:
                session.resume()
        viewer.send(P.Ack(request=request))

    def _handover(self, viewer: Viewer, to: str) -> None:
        session = viewer.session
        target = session.viewers.get(to)
        if target is None or target is viewer:
            viewer.send(P.Error(code=P.ErrorCode.INVALID_FIELD, request="handover", message=(
                f"no watcher {to!r} on stream {session.stream_id}: hand over to the viewer_id of one of its watchers")))
            return
        self._give_token(viewer, target, "handover")

    def _take(self, viewer: Viewer) -> None:
        session = viewer.session
        if session.steerer is not None:
            holder = "you hold it" if session.steerer is viewer else f"{session.steerer.viewer_id} holds it"
            viewer.send(P.Error(code=P.ErrorCode.NOT_STEERER, request="take", message=(
                f"the steer token of stream {session.stream_id} is taken ({holder}); its steerer can hand it over")))
            return
        self._give_token(viewer, viewer, "take")

    def _give_token(self, asked: Viewer, to: Viewer, request: str) -> None:
        asked.session.give_token(to)
        asked.send(P.Ack(request=request))
        self._audience_changed(asked.session, now=True)

    def _audience_changed(self, session: Session, now: bool = False) -> None:
        """Every viewer gets `audience` soon (joins in a burst make one message each), or `now` (a role changed)."""
        if now:
            self._send_audience(session)
        elif not session.audience_due:
            session.audience_due = True
            self._loop.call_later(AUDIENCE_DELAY_S, self._send_audience, session)

    @staticmethod
    def _send_audience(session: Session) -> None:
        session.audience_due = False
        if session.closed:
            return
        watchers, steered = session.watchers, session.steerer is not None
        for viewer in list(session.viewers.values()):
            viewer.send(P.Audience(role=viewer.role.value, watchers=watchers, steered=steered))

    async def _record(self, viewer: Viewer, quiet: bool = False) -> None:
        """Record the stream from its next keyframe on (`record`, or every stream with --record)."""
        session = viewer.session
        if session.recorder is None:
            gen = self.engine.gen
            try:
                session.recorder = self.recordings.open(session.stream_id, session.fps, gen.model_cfg.width,
                                                        gen.model_cfg.height)
            except RecordingRefused as e:
                viewer.send(P.Error(code=P.ErrorCode.UNAVAILABLE, request="record", message=str(e)[: P.MAX_TEXT_CHARS]))
                return
            self.engine.request_keyframe(session.stream_id)
            log.info("stream %s: recording to %s", session.stream_id, session.recorder.path)
        message = self._recording_message(session)
        for v in list(session.viewers.values()) if not quiet else [viewer]:
            v.send(message)

    @staticmethod
    def _recording_message(session: Session) -> P.Recording:
        rid = session.recorder.recording_id
        return P.Recording(url=f"{RECORDINGS_PATH}{rid}.mp4", chapters=f"{RECORDINGS_PATH}{rid}.vtt")

    async def _steer(self, session: Session, prompt: str, refusal: P.Error | None) -> None:
        """A set_prompt: refused, sent to the engine now, or left waiting for the next chunk (PromptGate)."""
        async with session.steering:
            if refusal is not None:
                replies = session.prompts.refuse(refusal)
            elif session.prompts.submit(prompt):
                replies = [await self._prompt_to_engine(session, prompt)]
            else:
                replies = []
            for reply in replies:
                session.to_steerer(reply)

    async def _release_prompt(self, session: Session) -> None:
        """A chunk of the stream is done: the prompt that waited for it goes to the engine, and the
        replies held behind it go out."""
        async with session.steering:
            prompt = session.prompts.chunk_done()
            if prompt is None or session.closed:
                return
            for reply in session.prompts.answered(await self._prompt_to_engine(session, prompt)):
                session.to_steerer(reply)

    async def _prompt_to_engine(self, session: Session, prompt: str) -> P.Ack | P.Error:
        """The stream's next chunks run under ``prompt``: the ack with their version, or the error."""
        try:
            version = await asyncio.wrap_future(self.engine.set_prompt(session.stream_id, prompt))
        except Exception as e:  # noqa: BLE001 - reported to the client, the stream goes on
            return _failed("set_prompt", e)
        session.prompt, session.prompt_version = prompt, version
        session.prompt_texts[version] = prompt
        return P.Ack(request="set_prompt", prompt_version=version)

    def _spawn(self, coro: Coroutine) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _sender(self, ws: ServerConnection, viewer: Viewer) -> None:
        """Sends the viewer's outbox in order: chunks as binary, messages as text, None ends.

        A WebRTC viewer's chunks go to its track instead, and its messages on its data channel once that is open.
        """
        try:
            await self._send_outbox(ws, viewer)
        finally:
            if viewer.rtc is not None:
                self.webrtc.pop(viewer.viewer_id, None)
                await asyncio.shield(viewer.rtc.close())  # the peer connection closes even if this task is cancelled

    async def _send_outbox(self, ws: ServerConnection, viewer: Viewer) -> None:
        rtc = viewer.rtc
        while True:
            item = await viewer.outbox.get()
            if item is None:
                return
            try:
                if isinstance(item, ChunkOut):
                    if rtc is not None:
                        rtc.feed(item)  # the track sends its frames (and the header) at the stream's pace
                    else:
                        await ws.send(item.payload)
                    self._chunks_sent += 1
                    self.metrics.chunks.inc()
                    ttff = viewer.delivered(self._loop.time())
                    if ttff is not None:
                        (self.metrics.ttff if viewer.role is Role.STEER else self.metrics.watcher_ttff).observe(ttff)
                elif rtc is None or not rtc.send_control(item):
                    await ws.send(P.encode(item))
            except ConnectionClosed:
                return

    async def _leave(self, viewer: Viewer, reason: str) -> None:
        """A viewer goes (its connection closed, or a watcher's close): its transport ends; the stream goes on
        while it has viewers, steerable by whoever takes the token within the orphan timeout."""
        if viewer.left:
            return
        session = viewer.session
        viewer.send(P.Closed(reason=reason))
        viewer.send(None)
        steered = viewer is session.steerer
        session.leave(viewer, self.clock())
        session.track_queues.pop(viewer.viewer_id, None)
        if session.closed:
            return
        if not session.viewers:
            await self._end(session, reason if steered else f"its last viewer left ({reason})")
            return
        with contextlib.suppress(Exception):
            self.engine.viewer_left(session.stream_id)
        if steered:
            timeout = self.config.orphan_timeout_s
            log.info("stream %s: its steerer left (%s); it goes on for %d watchers, %g s until one takes the token",
                     session.stream_id, reason, session.watchers, timeout)
            self._loop.call_later(timeout, self._orphan_expired, session, session.orphaned_at)
        self._audience_changed(session, now=steered)

    def _orphan_expired(self, session: Session, orphaned_at: float) -> None:
        if not session.closed and session.steerer is None and session.orphaned_at == orphaned_at:
            timeout = self.config.orphan_timeout_s
            self._spawn(self._end(session, f"its steerer left and nobody took the steer token within {timeout:g} s"))

    async def _end(self, session: Session, reason: str, engine_closed: bool = False) -> None:
        """Close a stream once: free it in the engine, end its recording, tell every viewer, end their senders."""
        if not session.close(reason):
            return
        self.sessions.pop(session.stream_id, None)
        self.limits.release(session.token, session.address)
        if not engine_closed:
            with contextlib.suppress(Exception):
                await asyncio.wrap_future(self.engine.close_stream(session.stream_id))
        if session.recorder is not None:
            with contextlib.suppress(Exception):
                session.recorder.close()
        for viewer in list(session.viewers.values()):
            viewer.send(P.Closed(reason=reason))
            viewer.send(None)
            viewer.left = True


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
    Refusal.WATCHERS: P.ErrorCode.REFUSED,
}
_STEER_TYPES = (P.SetPrompt, P.Pause, P.Resume, P.Record, P.Handover)  # what only a stream's steerer may send


def _byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """The first range of an HTTP Range header ("bytes=START-END", "bytes=START-", "bytes=-SUFFIX") as inclusive
    offsets within `size` bytes; None for no header, one we do not parse, or one that does not fit (the whole body)."""
    if not header or not header.startswith("bytes=") or size == 0:
        return None
    first = header.removeprefix("bytes=").split(",", 1)[0].strip()
    start_text, _, end_text = first.partition("-")
    try:
        if start_text:
            start = int(start_text)
            end = min(int(end_text), size - 1) if end_text else size - 1
        else:
            start, end = max(0, size - int(end_text)), size - 1
    except ValueError:
        return None
    return (start, end) if 0 <= start <= end else None


def _failed(request: str, e: Exception) -> P.Error:
    """The error for a request the server failed on: what failed, never a traceback."""
    return P.Error(code=P.ErrorCode.INTERNAL, message=f"{request} failed: {e}"[: P.MAX_TEXT_CHARS], request=request)


async def run_server(engine_config: EngineConfig, config: ServerConfig) -> None:
    await Server(engine_config, config).serve_forever()
