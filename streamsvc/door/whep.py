"""WHEP on the server's port: any WHEP player (OBS, GStreamer's whepclientsrc, a page of plain JavaScript) starts or
watches a stream with one HTTP POST of its SDP offer (draft-ietf-wish-whep; issue 36).

The endpoints (paths under WHEP_PATH; `Endpoints.handle` answers them, the front awaits its reply):

- ``POST /whep?prompt=...`` (optional ``&fps=``, ``&seed=``, a style's ``&lora=`` and ``&lora_scale=``, a start
  image's ``&image=ID``, an upload's: streamsvc/wire/image.py) with an SDP offer (``Content-Type:
  application/sdp``): a new stream, steered by this session (``&input=1``, optional ``&strength=``: it takes a WHIP
  publisher's video).
  ``201 Created``, the answer, ``Location`` (the session, SESSION_PATH + a 128-bit secret), and the stream's
  capabilities in headers: ``X-Stream-Id``, ``X-Watch-Url`` (a WHEP URL that watches it), ``X-Watch-Secret``,
  ``X-Steer-Secret``. With a data channel named ``control`` in the offer, the player steers over it with the protocol's
  JSON as our player does (streamsvc/transport/webrtc.py). Without one the stream plays on its start prompt, and a
  client with the steer secret may take the steer token from the WHEP session over /ws (`take`;
  streamsvc/viewers/streams.py lets it, since a steerer without a control channel cannot steer). ``X-Steer-Secret``
  holds while this session steers: a handover or a take sends the new steerer a new one (in its ``audience``) and
  revokes this one (a take, or a WHIP publish with it, is refused; a WHIP publisher under it ends).
- ``POST /whep/{stream}?secret=WATCH_SECRET``: watch an open stream (the secret in the query: OBS and GStreamer
  take a URL, and a URL's query is where the player's watch links keep it too). A wrong or missing secret and an
  unknown stream get the same 404, as a /ws watch does.
- ``DELETE`` on the Location ends the session (a steering session ends its stream; a watcher leaves);
  ``PATCH`` (trickle ICE, ICE restart) is 405: the answer carries every server candidate, and a client's candidates
  must be in its offer (every WHEP client gathers before it posts, or can: whip-client's -n, GStreamer's
  whepclientsrc waits for gathering). ``OPTIONS`` answers a browser's CORS preflight.
- Errors are an HTTP status and a line of text: 400 a bad offer or query, 401 no or a wrong access token (the
  server's ``Authorization: Bearer``, where it has tokens), 403 a page of an origin not allowed (--allow-origin),
  404 no such stream or session, 405, 415 not application/sdp, 429 over a rate or cap (with Retry-After), 503 no
  room for the stream.

How: the endpoints parse the POST into a `start` (or `watch`) with transport ``webrtc`` and its offer, and hand them
to their host (`WhepHost.open_webrtc`): the server runs them through the viewer's protocol and driver
(streamsvc/viewers/driver.py) as a socket's messages go, so admission, the token, per-address stream caps, the
offer's checks, the peer connection, the data channel and a stream's end are the server's code, unchanged; in cluster
mode the gateway places a new stream as it places a /ws start and relays the session to its replica (the media flows
between the replica and the player). What the server says to the session goes to its `WhepOutlet`: its answer
becomes the 201; after, only its end matters. A DELETE ends the session, and a stream that ends (or a peer connection
that fails: ICE consent lost, aioice's 6 checks 5 s apart, about 30 s after the peer vanished) ends it from the
server's side.

Limits beside the server's: each POST is an HTTP request (--http-rate, by the front) and an upgrade (--connect-rate),
and each session holds one of its address's connections (--max-connections-per-client) until it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import http
import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol
from urllib.parse import quote

from pydantic import ValidationError

from streamsvc.door.access import (
    AccessConfig,
    LogGate,
    RateKind,
    Refusal,
    bearer_token,
    find_token,
    new_secret,
    origin_allowed,
)
from streamsvc.door.entry import Client
from streamsvc.door.front import ConnectionClosed
from streamsvc.door.guard import Guard
from streamsvc.door.routes import HttpReply, HttpRequest, reply, text_reply
from streamsvc.metrics import Metrics
from streamsvc.transport.sdp import check_offer
from streamsvc.wire import protocol as P
from streamsvc.wire.rtc import MAX_REMOTE_CANDIDATES, IceServer, SignalingError

log = logging.getLogger("streamsvc.whep")

WHEP_PATH = "/whep"
SESSION_PATH = "/whep/session/"  # + the session's secret: a WHEP session's Location
SDP = "application/sdp"
SETUP_TIMEOUT_S = 45.0  # POST to answer at most: a cluster's placement (30 s) and ICE gathering (10 s) fit
MAX_QUEUED = 64  # the server's messages a session keeps before its answer (ready, answer, audience...): a bound
EXPOSED = "Location, Link, X-Stream-Id, X-Watch-Url, X-Watch-Secret, X-Steer-Secret, Retry-After"
SESSION_LOG_PERIOD_S = 6.0  # a WHEP session's log lines: one of each kind (opened, ended) this often at most

# the status of a start, watch or offer the server refused, by its error code
_STATUS = {
    P.ErrorCode.UNAUTHORIZED: http.HTTPStatus.UNAUTHORIZED,
    P.ErrorCode.TOO_MANY_STREAMS: http.HTTPStatus.TOO_MANY_REQUESTS,
    P.ErrorCode.RATE_LIMITED: http.HTTPStatus.TOO_MANY_REQUESTS,
    P.ErrorCode.REFUSED: http.HTTPStatus.SERVICE_UNAVAILABLE,
    P.ErrorCode.OVERLOADED: http.HTTPStatus.SERVICE_UNAVAILABLE,
    P.ErrorCode.UNAVAILABLE: http.HTTPStatus.SERVICE_UNAVAILABLE,
    P.ErrorCode.WORKER_LOST: http.HTTPStatus.SERVICE_UNAVAILABLE,
    P.ErrorCode.NOT_FOUND: http.HTTPStatus.NOT_FOUND,
    P.ErrorCode.INVALID_FIELD: http.HTTPStatus.BAD_REQUEST,
    P.ErrorCode.BAD_IMAGE: http.HTTPStatus.BAD_REQUEST,
    P.ErrorCode.BAD_JSON: http.HTTPStatus.BAD_REQUEST,
    P.ErrorCode.TOO_LARGE: http.HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
}


class WhepOutlet:
    """What the server says to a WHEP session's viewer (a transport.ws.Outlet): its player has the stream's media and,
    when it has one, its data channel, and reads no messages. Until the session is set up its replies (its ready,
    the answer to its offer, an error) wait for `expect`; after, only its end matters (`closed`, or the outlet's
    close), which ends the session. Chunks never come here (its transport is WebRTC)."""

    def __init__(self) -> None:
        self._replies: asyncio.Queue[P.Ready | P.Answer | P.Error | None] = asyncio.Queue(MAX_QUEUED)
        self.set_up = False  # the 201 went out: the server's messages are no longer kept
        self.ended = asyncio.Event()  # the stream or the viewer ended (the server's `closed`, or a close)
        self.reason = ""  # why it ended, as the server said

    async def send(self, message) -> None:
        if self.ended.is_set():
            raise ConnectionClosed("the WHEP session has ended")
        if isinstance(message, P.Closed):
            self._end(message.reason)
        elif not self.set_up and isinstance(message, (P.Ready, P.Answer, P.Error)):
            with contextlib.suppress(asyncio.QueueFull):
                self._replies.put_nowait(message)

    async def send_chunk(self, payload: bytes) -> None:
        """(Never asked for: a WHEP session's chunks go on its peer connection.)"""

    async def close(self, code: int = 1000, reason: str = "", linger: bool = True) -> None:
        self._end(reason or f"closed ({code})")

    def allow_messages(self, max_bytes: int) -> bool:
        """A WHEP stream's camera comes over WHIP, not as messages: nothing to raise."""
        return True

    def buffered(self) -> int:
        return 0

    def _end(self, reason: str) -> None:
        if not self.ended.is_set():
            self.reason = reason
            self.ended.set()
            with contextlib.suppress(asyncio.QueueFull):
                self._replies.put_nowait(None)

    async def expect(self, kind: type, deadline: float) -> P.Ready | P.Answer | P.Error | None:
        """The server's next `kind` or `error` before `deadline` (loop time); None if it ended or took too long."""
        loop = asyncio.get_running_loop()
        for _ in range(MAX_QUEUED + 2):
            try:
                async with asyncio.timeout(max(0.0, deadline - loop.time())):
                    msg = await self._replies.get()
            except TimeoutError:
                return None
            if msg is None:
                return None
            if isinstance(msg, (kind, P.Error)):
                return msg
        return None

    def refusal(self, msg: P.Error | None, what: str) -> HttpReply:
        """The status and text of a session the server refused (its error), or that ended or timed out on the way."""
        if isinstance(msg, P.Error):
            return _refused(msg, what)
        if self.ended.is_set():
            return text_reply(http.HTTPStatus.SERVICE_UNAVAILABLE, f"{what}: the connection ended ({self.reason})")
        return text_reply(http.HTTPStatus.GATEWAY_TIMEOUT, f"{what}: no answer within {SETUP_TIMEOUT_S:g} s")


@dataclass
class WhepSession:
    """A WHEP session its host (the server, or the gateway) has set up: the stream it plays, the 201's fields, and
    how it ends."""

    stream_id: str
    answer: str  # the SDP answer
    outlet: WhepOutlet  # what the server says to it (its end: `ended`, `reason`)
    close: Callable[[], Awaitable[None]]  # its DELETE: a steering session ends its stream, a watcher leaves
    done: asyncio.Future  # done once its host is done with it (it ended, or was closed)
    watch_secret: str | None = None  # the stream's capabilities, for a session that steers it
    steer_secret: str | None = None


class WhepHost(Protocol):
    """What the endpoints need of the server or the gateway whose port they are on."""

    config: object  # its ServerConfig: access, webrtc
    guard: Guard
    metrics: Metrics

    async def open_webrtc(self, client: Client, first: P.Start | P.Watch, offer: str,
                          deadline: float) -> WhepSession | HttpReply:
        """Admit `first` with transport webrtc and answer `offer` by `deadline` (loop time): the session, or the
        reply that says why not (WhepOutlet.refusal)."""
        ...


@dataclass
class HttpSession:
    """One WHEP (or WHIP) session, found by its Location's secret."""

    kind: str  # "whep" (a player) or "whip" (an encoder)
    stream_id: str
    steers: bool  # a WHEP session that started its stream (its DELETE ends the stream)
    close: Callable[[], Awaitable[None]]  # ends the session (its DELETE)
    created_at: float = field(default_factory=time.monotonic)


class Endpoints:
    """The WHEP (and, with `whip`, WHIP) routes of one front: a `Server`'s or the gateway's (its `WhepHost`)."""

    def __init__(self, host: WhepHost, whip=None, setup_timeout_s: float = SETUP_TIMEOUT_S) -> None:
        self.host = host
        self.whip = whip  # streamsvc/door/whip.py's Ingest, or None (POST /whip is 404)
        self.setup_timeout_s = setup_timeout_s
        self.sessions: dict[bytes, HttpSession] = {}  # sha256 of the Location's secret -> the session
        # a client opens watch sessions at its connect rate: their lines, one of each kind every 6 s at most
        self._session_lines = LogGate(SESSION_LOG_PERIOD_S)

    def table_sizes(self) -> dict[str, int]:
        """Its tables' entries (see Server.table_sizes): WHEP and WHIP sessions open, and WHIP publishers."""
        return {"door.http_sessions": len(self.sessions),
                "door.whip_publishers": len(self.whip.publishers) if self.whip is not None else 0}

    def _log_session(self, kind: str, what: str, *args) -> None:
        """A session's line (`kind`: opened, ended), unless one of its kind went out within the period."""
        held = self._session_lines.allow(kind, time.monotonic())
        if held is not None:
            log.info(what + (f" ({held} more sessions {kind} since the last such line)" if held else ""), *args)

    @property
    def access(self) -> AccessConfig:
        return self.host.config.access

    @staticmethod
    def takes(path: str) -> bool:
        """Whether a request for `path` is one of these routes'."""
        return path == WHEP_PATH or path.startswith((WHEP_PATH + "/", "/whip/")) or path == "/whip"

    # -- a request --------------------------------------------------------------------------

    def handle(self, request: HttpRequest) -> HttpReply | Awaitable[HttpReply]:
        origin = request.headers.get("Origin")
        allowed = origin is None or origin_allowed(origin, request.headers.get("Host"), self.access.allowed_origins)
        cors = (("Access-Control-Allow-Origin", origin), ("Access-Control-Expose-Headers", EXPOSED),
                ("Vary", "Origin")) if origin is not None and allowed else (("Vary", "Origin"),)
        if request.method == "OPTIONS":
            return self._options(request, cors if allowed else ())
        if not allowed:
            self.host.metrics.refusals.labels(Refusal.ORIGIN.value).inc()
            return text_reply(http.HTTPStatus.FORBIDDEN, f"origin {origin[:200]!r} may not use this server: only its "
                              "own pages and origins given with --allow-origin may")
        answer = self._route(request)
        if isinstance(answer, HttpReply):
            return _with(answer, cors)
        return self._finish(answer, cors)

    async def _finish(self, pending: Awaitable[HttpReply], cors: tuple) -> HttpReply:
        return _with(await pending, cors)

    def _route(self, request: HttpRequest) -> HttpReply | Awaitable[HttpReply]:
        path, method = request.path, request.method
        is_session = path.startswith(SESSION_PATH) or path.startswith("/whip/session/")
        if is_session:
            if method not in ("DELETE", "PATCH"):
                return _not_allowed("DELETE, PATCH, OPTIONS")
            refusal = self._unauthorized(request)
            if refusal is not None:
                return refusal
            session = self.sessions.get(_key(path.rsplit("/", 1)[1]))
            if session is None or not path.startswith(f"/{session.kind}/session/"):
                return text_reply(http.HTTPStatus.NOT_FOUND, "no such session here (it ended, or its URL is wrong)")
            if method == "PATCH":
                return _not_allowed("DELETE, OPTIONS", "trickle ICE and ICE restarts are not supported: send every "
                                    "candidate in the offer (gather before the POST); end this session with DELETE")
            return self._delete(session)
        if method != "POST":
            return _not_allowed("POST, OPTIONS")
        if path.startswith("/whip"):
            if self.whip is None or path == "/whip":
                return text_reply(http.HTTPStatus.NOT_FOUND, "WHIP: POST /whip/STREAM?secret=STEER_SECRET (the stream "
                                  "must be open here and take input)")
        stream = path.removeprefix(WHEP_PATH).removeprefix("/whip").lstrip("/")
        if "/" in stream:
            return text_reply(http.HTTPStatus.NOT_FOUND, "not found")
        refusal = self._unauthorized(request) or _bad_media_type(request) or self._over_rate(request)
        if refusal is not None:
            return refusal
        try:
            offer = request.body.decode("utf-8")
            check_offer(offer, max_candidates=MAX_REMOTE_CANDIDATES, publish=path.startswith("/whip"))
        except (UnicodeDecodeError, SignalingError) as e:
            return text_reply(http.HTTPStatus.BAD_REQUEST,
                              f"bad offer: {e if isinstance(e, SignalingError) else 'not UTF-8'}")
        if path.startswith("/whip"):
            return self.whip.publish(self, request, stream, offer)
        first = self._first_message(request, stream)
        if isinstance(first, HttpReply):
            return first
        return self._open(request, first, offer, steers=not stream)

    def _first_message(self, request: HttpRequest, stream: str) -> P.Start | P.Watch | HttpReply:
        """The session's `start` (a new stream, from the query) or `watch` (of `stream`), or the 400 or 404."""
        query = {k: v[0] for k, v in request.query.items()}
        try:
            if stream:
                return P.Watch(stream_id=stream, secret=query.get("secret"), transport="webrtc")
            if "prompt" not in query:
                return text_reply(http.HTTPStatus.BAD_REQUEST, "a new stream needs its prompt: POST /whep?prompt=...")
            extra = {k: int(query[k]) for k in ("fps", "seed") if k in query}
            if query.get("input", "0").lower() in ("1", "true", "yes"):  # a WHIP publisher's (streamsvc/door/whip.py)
                extra["input"] = True
                if "strength" in query:
                    extra["strength"] = float(query["strength"])
            if "lora" in query:  # a style per stream (README: Styles per stream)
                extra |= {"lora": query["lora"], "lora_scale": float(query.get("lora_scale", 1.0))}
            if "image" in query:  # a start image, by its upload's id (streamsvc/wire/image.py)
                extra["image"] = query["image"]
            return P.Start(prompt=query["prompt"], transport="webrtc", **extra)
        except ValueError as e:  # pydantic's ValidationError, or int()
            status = http.HTTPStatus.NOT_FOUND if stream else http.HTTPStatus.BAD_REQUEST
            if isinstance(e, ValidationError) and stream:  # a stream id or secret no stream has: as a wrong one
                return text_reply(status, f"no open stream {stream[:64]!r} here with this watch secret")
            return text_reply(status, f"bad query: {_first_line(e)}")

    async def _open(self, request: HttpRequest, first: P.Start | P.Watch, offer: str, steers: bool) -> HttpReply:
        """The session: its host admits `first` and answers the offer; the 201 or the error."""
        guard = self.host.guard
        refusal = guard.admit_upgrade(request)  # the session holds one of its address's connections
        if refusal is not None:
            return refusal
        client = Client.of(request.remote or "unknown", request.headers, self.access)
        deadline = asyncio.get_running_loop().time() + self.setup_timeout_s
        try:
            opened = await self.host.open_webrtc(client, first, offer, deadline)
        except BaseException:
            guard.upgrade_ended(request)
            raise
        if isinstance(opened, HttpReply):
            guard.upgrade_ended(request)
            return opened
        secret = new_secret()
        key = _key(secret)
        self.sessions[key] = HttpSession("whep", opened.stream_id, steers, opened.close)
        opened.done.add_done_callback(lambda _: self._ended(key, request, opened.outlet))
        sid = quote(opened.stream_id, safe="")
        extra = [("Location", SESSION_PATH + secret), ("X-Stream-Id", opened.stream_id)]
        if opened.watch_secret:
            extra += [("X-Watch-Url", f"{WHEP_PATH}/{sid}?secret={quote(opened.watch_secret, safe='')}"),
                      ("X-Watch-Secret", opened.watch_secret)]
        if opened.steer_secret:
            extra.append(("X-Steer-Secret", opened.steer_secret))
        self._log_session("opened", "WHEP session for stream %s (%s) from %s", opened.stream_id,
                          "steers" if steers else "watches", client.address)
        return self.created(opened.answer, extra)

    def created(self, sdp: str, extra: Sequence[tuple[str, str]]) -> HttpReply:
        """The 201 of a session: the answer, `extra` headers (its Location...) and a Link for each ICE server."""
        body = sdp.encode()
        links = tuple(("Link", ice_link(s)) for s in self.host.config.webrtc.ice_servers)
        return HttpReply(http.HTTPStatus.CREATED, (("Content-Type", SDP), ("Content-Length", str(len(body))),
                                                   ("Cache-Control", "no-store"), *extra, *links), body)

    def register(self, session: HttpSession) -> str:
        """A session made elsewhere (WHIP): its Location's secret, the session kept until `forget`."""
        secret = new_secret()
        self.sessions[_key(secret)] = session
        return secret

    def forget(self, secret: str) -> None:
        self.sessions.pop(_key(secret), None)

    def _ended(self, key: bytes, request: HttpRequest, outlet: WhepOutlet) -> None:
        """A session's host is done with it: the session is gone, its connection slot too."""
        session = self.sessions.pop(key, None)
        self.host.guard.upgrade_ended(request)
        if session is not None:
            self._log_session("ended", "WHEP session for stream %s ended: %s", session.stream_id,
                              outlet.reason or "closed")

    async def _delete(self, session: HttpSession) -> HttpReply:
        await session.close()
        return reply(http.HTTPStatus.OK, b"session ended\n", "text/plain")

    # -- checks -----------------------------------------------------------------------------

    def _unauthorized(self, request: HttpRequest) -> HttpReply | None:
        """401 without the server's access token (a Bearer header) where it has tokens."""
        access = self.access
        if not access.auth:
            return None
        given = bearer_token(request.headers.get("Authorization"))
        if find_token(access.tokens, given) is not None:
            return None
        self.host.metrics.refusals.labels(Refusal.UNAUTHORIZED.value).inc()
        answer = text_reply(http.HTTPStatus.UNAUTHORIZED, "the access token is not valid" if given else
                            "this server needs an access token: send it as an 'Authorization: Bearer TOKEN' header")
        return _with(answer, (("WWW-Authenticate", 'Bearer realm="streamsvc"'),))

    def _over_rate(self, request: HttpRequest) -> HttpReply | None:
        """A POST opens a session as an upgrade opens a socket: it spends its address's --connect-rate too."""
        guard = self.host.guard
        address = guard.client(request)
        wait_s = guard.rates.take(RateKind.UPGRADE, address, guard.clock())
        if wait_s is None:
            return None
        guard.refused(Refusal.CONNECT_RATE, address)
        answer = text_reply(http.HTTPStatus.TOO_MANY_REQUESTS, "this address opens sessions faster than this server "
                            "serves one address (--connect-rate); slow down")
        return _with(answer, (("Retry-After", str(max(1, round(wait_s + 0.5)))),))

    def _options(self, request: HttpRequest, cors: tuple) -> HttpReply:
        """A CORS preflight (or a client asking what is allowed): 204 with the methods and headers, CORS only for an
        allowed origin."""
        session = request.path.startswith((SESSION_PATH, "/whip/session/"))
        methods = "DELETE, PATCH, OPTIONS" if session else "POST, OPTIONS"
        headers = (("Allow", methods), ("Cache-Control", "no-store"))
        if not session:
            headers += (("Accept-Post", SDP),)
        if cors:
            headers += cors + (("Access-Control-Allow-Methods", methods),
                               ("Access-Control-Allow-Headers", "Authorization, Content-Type, If-Match"),
                               ("Access-Control-Max-Age", "600"))
        return HttpReply(http.HTTPStatus.NO_CONTENT, headers)

    async def stop(self) -> None:
        """End every session (the server is stopping)."""
        await asyncio.gather(*(s.close() for s in list(self.sessions.values())), return_exceptions=True)


def ice_link(server: IceServer) -> str:
    """A Link header for one ICE server (WHIP, RFC 9725 section 4.6; WHEP does the same)."""
    link = f'<{server.url}>; rel="ice-server"'
    if server.username is not None:
        link += (f'; username={json.dumps(server.username)}; credential={json.dumps(server.credential)}'
                 '; credential-type="password"')
    return link


def _key(secret: str) -> bytes:
    """What a session is kept under: its secret's hash (a dict lookup then tells nothing of a guess's prefix)."""
    return hashlib.sha256(secret.encode("utf-8", "replace")).digest()


def _with(answer: HttpReply, headers: tuple) -> HttpReply:
    return HttpReply(answer.status, answer.headers + tuple(headers), answer.body, answer.file, answer.span,
                     answer.download)


def _not_allowed(methods: str, why: str = "") -> HttpReply:
    return _with(text_reply(http.HTTPStatus.METHOD_NOT_ALLOWED, why or f"allowed here: {methods}"),
                 (("Allow", methods),))


def _bad_media_type(request: HttpRequest) -> HttpReply | None:
    ctype = (request.headers.get("Content-Type") or "").split(";")[0].strip().lower()
    if ctype == SDP:
        return None
    return text_reply(http.HTTPStatus.UNSUPPORTED_MEDIA_TYPE, f"the offer must be sent as Content-Type: {SDP} "
                      f"(got {ctype[:60]!r})")


def _first_line(e: Exception) -> str:
    return str(e).splitlines()[0][:200] if str(e) else type(e).__name__


def _refused(msg: P.Error, what: str) -> HttpReply:
    """The status and text of a start, watch or offer the server refused (its error)."""
    status = _STATUS.get(msg.code, http.HTTPStatus.INTERNAL_SERVER_ERROR)
    answer = text_reply(status, f"{what}: {msg.message}")
    if status is http.HTTPStatus.UNAUTHORIZED:
        return _with(answer, (("WWW-Authenticate", 'Bearer realm="streamsvc"'),))
    if status in (http.HTTPStatus.SERVICE_UNAVAILABLE, http.HTTPStatus.TOO_MANY_REQUESTS):
        return _with(answer, (("Retry-After", "5"),))
    return answer
