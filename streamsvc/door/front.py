"""The one port of `streamsvc serve`: HTTP and WebSocket through aiohttp, apart from what is served on it.

`HttpFront` listens (TCP, or TLS with `FrontConfig.tls`) and hands every request to its `Handlers`: an HTTP
request to `route` (streamsvc/door/routes.py's `Routes.handle`, or the gateway's), whose `HttpReply` it sends; the
WebSocket upgrade at /ws (`route` answers None) to `websocket`, as a `Connection`. Nothing else knows aiohttp
(but streamsvc/door/aiohttp_hooks.py, where the private names this uses are): server.py, streams.py and the
cluster's relay see a `Connection` (a socket's here, a relayed one in streamsvc/cluster/replica.py).

Why aiohttp (issue 33): one server for HTTP and WebSocket on one port that streams a response body (a recording
in bounded pieces) and reads a request body (the WHIP/WHEP POSTs to come), which websockets' `process_request`
can do neither of. Its WebSocket refuses an oversized frame at its header (close 1009) as websockets did. The
ASGI alternative (uvicorn + starlette, websockets underneath) is two more packages and a second event-loop
owner for the same result. `Routes` already routes, so the low-level `aiohttp.web.Server` is used (one handler for
every request) rather than an `Application` with a router.

What each stage bounds (the hostile-client rules of DESIGN.md):
- a connection: `Handlers.admit_connection` as it is accepted (a refusal drops it at once); its TLS handshake,
  and then its first request's head, each within `handshake_timeout_s` (a head sent slowly is dropped all the same),
  and no more than that idle between two requests;
- a request: a target no route can want (`routes.bad_target`: NUL and control bytes, bad percent-encoding,
  non-UTF-8, dot segments, overlong) is a 4xx before any route sees it; a body of at most `max_body_bytes` (or
  its path's `body_limits`: an image upload's 4 MiB), read
  within `handshake_timeout_s`; then `Handlers.admit_request`;
- an upgrade: `Handlers.admit_upgrade`, then a WebSocket whose messages are at most `max_message_bytes`,
  uncompressed, pinged every `heartbeat_s`;
- a file body: read `piece_bytes` at a time off the event loop (a thread), each piece written before the next is
  read, so a slow reader holds one piece; at most `max_downloads_per_client` at once per client (429 after).

A handler that raises is logged with its traceback and answered 500 (WebSocket: 1011) with no detail on the wire;
a malformed request, the client's fault, is one debug line and a 400 (aiohttp's own log would print a traceback
for each).
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import inspect
import logging
import os
import ssl
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from aiohttp import WSMsgType, web
from aiohttp.http_exceptions import HttpProcessingError
from multidict import CIMultiDict

from streamsvc.door.aiohttp_hooks import MISMATCH as MESSAGE_LIMIT_MISMATCH
from streamsvc.door.aiohttp_hooks import raise_message_limit
from streamsvc.door.routes import HttpReply, HttpRequest, bad_target, reply

log = logging.getLogger("streamsvc.front")

PIECE_BYTES = 256 << 10  # a file body is read and written this much at a time
MAX_BODY_BYTES = 64 << 10  # a request body (an SDP offer is a few KiB; a larger one is refused 413)
RETRY_AFTER_S = 5  # a 429's Retry-After: about the time a download of a recording takes
# a close that does not linger: the most it waits for what it wrote (its close frame last) to reach the peer, which then
# closes; a peer that does not read by then is dropped
NO_LINGER_S = 3.0


class ConnectionClosed(Exception):
    """The connection is closed (by its peer, or by the server): nothing more can be sent on it."""


class Connection(Protocol):
    """One WebSocket connection, as the server and the gateway read and write it (`WebSocketConnection`)."""

    remote_address: tuple[str, int] | None  # the peer's (host, port); None when unknown
    headers: Mapping[str, str]  # the upgrade request's headers, looked up case-insensitively

    def __aiter__(self) -> AsyncIterator[str | bytes]:
        """The peer's messages, text as str and binary as bytes, until the connection closes."""
        ...

    async def send(self, data: str | bytes) -> None:
        """One message (str: text, bytes: binary); raises ConnectionClosed once the connection is closed."""
        ...

    async def close(self, code: int = 1000, reason: str = "", linger: bool = True) -> None:
        """Close with this code and reason (a no-op once closed). linger=False, for a peer closed for abuse (a
        flood, a peer that does not read) or done with: send the close frame, then close the socket at once, reading
        nothing more from it."""
        ...


class WebSocketConnection:
    """A `Connection` over an aiohttp WebSocket (already upgraded)."""

    def __init__(self, ws: web.WebSocketResponse, request: HttpRequest, peer: tuple[str, int] | None,
                 transport: asyncio.Transport | None = None) -> None:
        self._ws = ws
        self._transport = transport  # closed at once by a close that does not linger
        self.headers = request.headers
        self.remote_address = peer

    def __aiter__(self) -> AsyncIterator[str | bytes]:
        return self._messages()

    async def _messages(self) -> AsyncIterator[str | bytes]:
        while True:
            msg = await self._ws.receive()
            if msg.type in (WSMsgType.TEXT, WSMsgType.BINARY):
                yield msg.data
            elif msg.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED, WSMsgType.ERROR):
                return  # (an oversized frame is an ERROR: aiohttp has closed the socket with 1009)

    async def send(self, data: str | bytes) -> None:
        if self._ws.closed:
            raise ConnectionClosed(f"connection closed ({self._ws.close_code})")
        try:
            if isinstance(data, str):
                await self._ws.send_str(data)
            else:
                await self._ws.send_bytes(data)
        except ConnectionError as e:  # the transport went away under the send
            raise ConnectionClosed(str(e)) from None

    async def close(self, code: int = 1000, reason: str = "", linger: bool = True) -> None:
        # a close frame's reason: 123 bytes of UTF-8 (a character cut in two is left out)
        closing = self._ws.close(code=code, message=reason.encode()[:123].decode(errors="ignore").encode())
        if linger or self._transport is None:
            with contextlib.suppress(ConnectionError):
                await closing
            return
        # aiohttp would read (and parse) a flood until the peer's close frame: once the task has written ours (its
        # first step, which runs before this coroutine resumes), the socket stops reading and closes once what was
        # written is flushed
        task = asyncio.ensure_future(closing)
        await asyncio.sleep(0)
        self._transport.close()
        with contextlib.suppress(ConnectionError, TimeoutError):
            async with asyncio.timeout(NO_LINGER_S):
                await task
                while self._transport.get_write_buffer_size():  # what was written (our close frame last) flushes
                    await asyncio.sleep(0.05)
        if self._transport.get_write_buffer_size():  # a peer that reads nothing would keep the socket open as long as
            self._transport.abort()                  # it keeps its window shut: dropped

    def buffered(self) -> int:
        """Bytes written and not yet handed to the kernel (the transport's buffer: aiohttp waits for it to drain
        only every 256 KiB): what a viewer's outbox counts with its own against its bound
        (streamsvc/viewers/outbox.py)."""
        return self._transport.get_write_buffer_size() if self._transport is not None else 0

    @property
    def closed(self) -> bool:
        return self._ws.closed

    def allow_messages(self, max_bytes: int) -> bool:
        """Raise this connection's message limit to `max_bytes` (issue 35: a stream whose `start` asked for input
        video; every other connection keeps the front's limit and its 1009). aiohttp fixes the limit in the frame
        parser it makes at the upgrade, so a new parser with the new limit takes over (between messages: this runs
        while the `start` is handled, before the viewer has its `ready`). False (the limit unchanged) where this
        aiohttp's internals differ."""
        try:
            raise_message_limit(self._ws, max_bytes)  # (streamsvc/door/aiohttp_hooks.py: aiohttp's private names)
        except MESSAGE_LIMIT_MISMATCH:
            log.warning("this aiohttp's WebSocket cannot raise its message limit: input messages over the control "
                        "limit close the connection (1009)", exc_info=True)
            return False
        return True


@dataclass(frozen=True)
class FrontConfig:
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (HttpFront.port)
    tls: ssl.SSLContext | None = None  # https and wss on the same port (tls_context); None: plain http and ws
    max_message_bytes: int = 64 << 10  # a WebSocket message past this closes its connection with 1009
    heartbeat_s: float = 20.0  # a WebSocket is pinged this often; no pong within half of it closes it
    handshake_timeout_s: float = 10.0  # accept to a request's head (and TLS handshake); a request body within it
    max_downloads_per_client: int = 4  # file bodies sent at once to one client address (HttpReply.download)
    piece_bytes: int = PIECE_BYTES  # a file body is read this much at a time
    max_body_bytes: int = MAX_BODY_BYTES  # request bodies past this get 413
    body_limits: Mapping[str, int] = field(default_factory=dict)  # a path's own body limit (POST /images: 4 MiB)

    def __post_init__(self) -> None:
        if self.max_downloads_per_client < 1:
            raise ValueError(f"max_downloads_per_client={self.max_downloads_per_client}: give at least 1")
        if not self.handshake_timeout_s > 0 or not self.heartbeat_s > 0:
            raise ValueError(f"handshake_timeout_s={self.handshake_timeout_s}, heartbeat_s={self.heartbeat_s}: "
                             "give seconds > 0")
        if self.piece_bytes < 1 or self.max_body_bytes < 0:
            raise ValueError(f"piece_bytes={self.piece_bytes}, max_body_bytes={self.max_body_bytes}: give >= 1, >= 0")


def _no_refusal(*_) -> None:
    return None


@dataclass(frozen=True)
class Handlers:
    """What a front calls: the service behind it (streamsvc/viewers/server.py's `Server`, the cluster's gateway).

    The `admit_*` hooks are where limits plug in (connections per address and in total, request rates): each
    answers None to let the connection, request or upgrade go on."""

    # a request's reply (or an awaitable of it: a route that waits); None: the WebSocket upgrade goes on
    route: Callable[[HttpRequest], HttpReply | Awaitable[HttpReply] | None]
    websocket: Callable[[Connection], Awaitable[None]]  # serves one upgraded connection until it ends
    client: Callable[[HttpRequest], str]  # the client address a request counts against (access.client_address)
    admit_connection: Callable[[str], str | None] = _no_refusal  # a new connection's peer -> why it is dropped
    hold_connection: Callable[[str], float] = lambda _: 0.0  # an admitted one's peer -> seconds it waits unread
    connection_closed: Callable[[str], None] = _no_refusal  # a connection admitted above has closed
    admit_request: Callable[[HttpRequest], HttpReply | None] = _no_refusal  # every request, an upgrade's too
    admit_upgrade: Callable[[HttpRequest], HttpReply | None] = _no_refusal  # a WebSocket upgrade, after `route`
    upgrade_ended: Callable[[HttpRequest], None] = _no_refusal  # an upgrade admitted above has ended (or failed)
    download_refused: Callable[[str], None] = _no_refusal  # a client at its download cap got 429 (to count it)


class DownloadSlots:
    """File bodies being sent per client address, at most `cap` each (pure bookkeeping)."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._held: Counter[str] = Counter()

    def acquire(self, client: str) -> bool:
        if self._held[client] >= self.cap:
            return False
        self._held[client] += 1
        return True

    def release(self, client: str) -> None:
        self._held[client] -= 1
        if self._held[client] <= 0:
            del self._held[client]

    def held(self, client: str) -> int:
        return self._held[client]

    def __len__(self) -> int:
        """Addresses with a download under way."""
        return len(self._held)


def tls_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    """A server's TLS context from a PEM certificate (chain) and its key; raises OSError / ssl.SSLError."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert_file, key_file)
    return context


# the tables of a front (HttpFront.table_sizes): connections, connections before their first request, WebSockets,
# addresses downloading
FRONT_TABLES = ("door.connections", "door.handshakes", "door.websockets", "door.downloads_by_address")


class HttpFront:
    """One listening port served by aiohttp (see the module's doc): `await start()`, `port`, `await stop()`."""

    def __init__(self, config: FrontConfig, handlers: Handlers) -> None:
        self.config = config
        self.handlers = handlers
        self.downloads = DownloadSlots(config.max_downloads_per_client)
        self._listener: _Listener | None = None
        self._runner: web.ServerRunner | None = None
        self._listening: asyncio.AbstractServer | None = None
        self._sockets: set[WebSocketConnection] = set()  # open WebSockets, closed (1001) at stop

    @property
    def scheme(self) -> str:
        return "https" if self.config.tls is not None else "http"

    def table_sizes(self) -> dict[str, int]:
        """Its tables' entries (see Server.table_sizes): connections open, those whose first request has not come,
        WebSockets open, addresses downloading (a /metrics request counts its own connection)."""
        listener = self._listener
        return dict(zip(FRONT_TABLES, (listener.connections if listener is not None else 0,
                                       listener.handshakes if listener is not None else 0,
                                       len(self._sockets), len(self.downloads)), strict=True))

    async def start(self) -> None:
        cfg = self.config
        # keepalive_timeout: an idle keep-alive connection between requests is closed after it too
        self._listener = _Listener(self._on_request, self.handlers, cfg.handshake_timeout_s,
                                   keepalive_timeout=cfg.handshake_timeout_s, access_log=None, logger=_ProtocolLog(log))
        self._runner = web.ServerRunner(self._listener, shutdown_timeout=2.0)
        await self._runner.setup()
        # our own create_server (not a TCPSite): it bounds the TLS handshake, which a TCPSite leaves at 60 s
        self._listening = await asyncio.get_running_loop().create_server(
            self._runner.server, cfg.host, cfg.port, ssl=cfg.tls, reuse_address=True, backlog=1024,
            ssl_handshake_timeout=cfg.handshake_timeout_s if cfg.tls is not None else None)

    @property
    def port(self) -> int:
        return self.socket.getsockname()[1]

    @property
    def socket(self):
        """The listening socket (asyncio's view of it)."""
        return self._listening.sockets[0]

    async def stop(self) -> None:
        """Stop listening, close every open WebSocket (1001), then the connections still open."""
        if self._listening is not None:
            self._listening.close()
        await asyncio.gather(*(conn.close(1001, "server shutting down") for conn in list(self._sockets)),
                             return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()
        if self._listening is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._listening.wait_closed(), 5)

    # -- a request ----------------------------------------------------------------------------

    async def _on_request(self, raw: web.BaseRequest) -> web.StreamResponse:
        self._listener.request_began(raw.protocol)
        bad = bad_target(raw.raw_path)
        if bad is not None:
            return await self._send(raw, None, bad)
        body = await self._read_body(raw)
        if isinstance(body, HttpReply):
            return await self._send(raw, None, body)
        request = HttpRequest(raw.method, raw.raw_path, raw.headers, raw.remote, body)
        answer = self.handlers.admit_request(request)
        if answer is None:
            try:
                answer = self.handlers.route(request)
                if inspect.isawaitable(answer):  # a route that waits (WHEP/WHIP: signaling, streamsvc/door/whep.py)
                    answer = await answer
            except Exception:  # noqa: BLE001 - a bug: logged in full, the client learns nothing of it
                log.exception("%s %s failed", raw.method, raw.raw_path[:200])
                answer = reply(http.HTTPStatus.INTERNAL_SERVER_ERROR, b"internal error\n", "text/plain")
            if answer is None:
                return await self._upgrade(raw, request)
        return await self._send(raw, request, answer)

    async def _read_body(self, raw: web.BaseRequest) -> bytes | HttpReply:
        """The request's body (b"" for none), or the 413 / 408 / 400 that refuses it."""
        if not raw.body_exists:
            return b""
        limit = self.config.body_limits.get(raw.path, self.config.max_body_bytes)
        too_large = reply(http.HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                          f"a request body here is at most {limit} bytes\n".encode(), "text/plain")
        if raw.content_length is not None and raw.content_length > limit:
            return too_large
        data = bytearray()
        try:
            async with asyncio.timeout(self.config.handshake_timeout_s):
                while chunk := await raw.content.readany():
                    data += chunk
                    if len(data) > limit:
                        return too_large
        except TimeoutError:
            return reply(http.HTTPStatus.REQUEST_TIMEOUT, b"the request body came too slowly\n", "text/plain")
        except HttpProcessingError:
            return reply(http.HTTPStatus.BAD_REQUEST, b"malformed request body\n", "text/plain")
        return bytes(data)

    async def _send(self, raw: web.BaseRequest, request: HttpRequest | None, answer: HttpReply) -> web.StreamResponse:
        """Send `answer`: its bytes, or its file streamed (a download: under the client's cap)."""
        headers = CIMultiDict(answer.headers)
        if answer.file is None:
            response = web.Response(status=answer.status.value, reason=answer.status.phrase, headers=headers,
                                    body=answer.body)
            # a request we would not read, or a refusal that ends its connection (Connection: close, as the
            # guard's 429 and 503 say): the connection is not kept for another
            if request is None or headers.get("Connection", "").lower() == "close":
                response.force_close()
            return response
        if not answer.download:
            return await self._send_file(raw, answer, headers)
        client = self.handlers.client(request)
        if not self.downloads.acquire(client):
            self.handlers.download_refused(client)
            cap = self.config.max_downloads_per_client
            busy = reply(http.HTTPStatus.TOO_MANY_REQUESTS, f"this address is downloading {cap} files already, its "
                         "limit (--max-downloads-per-client); try again when one is done\n".encode(), "text/plain")
            return web.Response(status=busy.status.value, reason=busy.status.phrase,
                                headers=CIMultiDict(busy.headers + (("Retry-After", str(RETRY_AFTER_S)),)),
                                body=busy.body)
        try:
            return await self._send_file(raw, answer, headers)
        finally:
            self.downloads.release(client)

    async def _send_file(self, raw: web.BaseRequest, answer: HttpReply, headers: CIMultiDict) -> web.StreamResponse:
        """The file's bytes (its span), read `piece_bytes` at a time in a thread, each written (and drained to the
        socket's buffer) before the next is read."""
        loop = asyncio.get_running_loop()
        try:
            fd = await loop.run_in_executor(None, os.open, answer.file, os.O_RDONLY)
        except OSError:  # gone since the route looked
            return web.Response(status=404, text="not found\n")
        response = web.StreamResponse(status=answer.status.value, reason=answer.status.phrase, headers=headers)
        try:
            start, end = answer.span if answer.span is not None else (0, os.fstat(fd).st_size - 1)
            response.content_length = end + 1 - start
            await response.prepare(raw)
            if raw.method == "HEAD":
                return response
            position = start
            while position <= end:
                piece = await loop.run_in_executor(None, read_piece, fd, position,
                                                   min(self.config.piece_bytes, end + 1 - position))
                if not piece:  # the file shrank under us: the promised length cannot be met
                    log.warning("%s shrank while being sent; its connection is dropped", Path(answer.file).name)
                    if raw.transport is not None:
                        raw.transport.abort()
                    return response
                await response.write(piece)
                position += len(piece)
            await response.write_eof()
        except ConnectionError:  # the client went away mid-body
            pass
        finally:
            os.close(fd)
        return response

    # -- a WebSocket --------------------------------------------------------------------------

    async def _upgrade(self, raw: web.BaseRequest, request: HttpRequest) -> web.StreamResponse:
        refusal = self.handlers.admit_upgrade(request)
        if refusal is not None:
            return await self._send(raw, request, refusal)
        try:
            return await self._websocket(raw, request)
        finally:
            self.handlers.upgrade_ended(request)

    async def _websocket(self, raw: web.BaseRequest, request: HttpRequest) -> web.StreamResponse:
        """An admitted upgrade: the WebSocket, served by `Handlers.websocket` until it ends."""
        cfg = self.config
        # max_msg_size + 1: aiohttp refuses a message of max_msg_size bytes itself, websockets (the client) does not
        ws = web.WebSocketResponse(compress=False, max_msg_size=cfg.max_message_bytes + 1, heartbeat=cfg.heartbeat_s,
                                   autoping=True)
        if not ws.can_prepare(raw).ok:
            return await self._send(raw, request, HttpReply(
                http.HTTPStatus.UPGRADE_REQUIRED, (("Content-Type", "text/plain"), ("Upgrade", "websocket")),
                b"this is the WebSocket endpoint: connect with a WebSocket client\n"))
        try:
            await ws.prepare(raw)
        except ConnectionError:
            return ws
        conn = WebSocketConnection(ws, request, raw.transport.get_extra_info("peername") if raw.transport else None,
                                   raw.transport)
        self._sockets.add(conn)
        try:
            await self.handlers.websocket(conn)
        except Exception:  # noqa: BLE001 - a bug: logged in full, the client gets 1011 and nothing else
            log.exception("WebSocket handler failed")
            await conn.close(1011, "internal error")
        finally:
            self._sockets.discard(conn)
            await conn.close()
        return ws


def read_piece(fd: int, offset: int, size: int) -> bytes:
    """At most `size` bytes of the file `fd` from `offset` (what a file body is read with, in a thread)."""
    return os.pread(fd, size, offset)


class _Listener(web.Server):
    """aiohttp's low-level server with the connection hooks of `Handlers` and the handshake deadline: a connection
    is offered to `admit_connection` as it is accepted (dropped at once when refused), is dropped when no request's
    head has come `deadline_s` later, and `connection_closed` hears of its end."""

    def __init__(self, handler, handlers: Handlers, deadline_s: float, **kwargs) -> None:
        super().__init__(handler, **kwargs)
        self._hooks = handlers
        self._deadline_s = deadline_s
        self._admitted: dict[object, str] = {}  # request handler (one per connection) -> its peer's address
        self._waiting: dict[object, asyncio.TimerHandle] = {}  # connections without a request yet -> their deadline

    def connection_made(self, handler, transport: asyncio.Transport) -> None:
        super().connection_made(handler, transport)
        peer = transport.get_extra_info("peername")
        address = peer[0] if peer else ""
        refusal = self._hooks.admit_connection(address)
        if refusal is not None:
            log.debug("connection from %s dropped: %s", address, refusal)
            transport.abort()
            return
        self._admitted[handler] = address
        loop = asyncio.get_running_loop()
        # an address over its rate: its connection waits unread (a flood slows to the rate, and costs no parsing
        # meanwhile); at most half the handshake deadline, which (aiohttp's idle timer too) runs from the accept
        hold_s = min(self._hooks.hold_connection(address), self._deadline_s / 2)
        if hold_s > 0:
            transport.pause_reading()
            loop.call_later(hold_s, _resume_reading, transport)
        self._waiting[handler] = loop.call_later(self._deadline_s, transport.abort)

    @property
    def connections(self) -> int:
        """Connections admitted and open."""
        return len(self._admitted)

    @property
    def handshakes(self) -> int:
        """Connections whose first request's head has not come yet."""
        return len(self._waiting)

    def request_began(self, handler) -> None:
        """A request's head came on this connection: its handshake deadline is met."""
        deadline = self._waiting.pop(handler, None)
        if deadline is not None:
            deadline.cancel()

    def connection_lost(self, handler, exc: BaseException | None = None) -> None:
        super().connection_lost(handler, exc)
        self.request_began(handler)
        address = self._admitted.pop(handler, None)
        if address is not None:
            self._hooks.connection_closed(address)


def _resume_reading(transport: asyncio.Transport) -> None:
    if not transport.is_closing():
        transport.resume_reading()


class _ProtocolLog(logging.LoggerAdapter):
    """aiohttp's per-connection log: a malformed request (the client's fault) is one debug line, not the
    traceback aiohttp would print for each; anything else it reports stays an error with its traceback."""

    def __init__(self, logger: logging.Logger) -> None:
        super().__init__(logger, {})

    def log(self, level: int, msg, *args, exc_info=None, **kwargs) -> None:
        if isinstance(exc_info, HttpProcessingError):
            super().log(logging.DEBUG, str(msg) + " (%s)", *args, repr(exc_info)[:300])
            return
        super().log(level, msg, *args, exc_info=exc_info, **kwargs)
