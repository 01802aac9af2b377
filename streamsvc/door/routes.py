"""The HTTP routes of `streamsvc serve`, apart from the front that receives the requests.

A front (streamsvc/door/front.py, aiohttp) turns each request into an `HttpRequest`, calls `Routes.handle` and sends the
`HttpReply` it gets back; None means the request is the WebSocket upgrade at
WS_PATH, from an allowed origin, and the handshake goes on. The routes:

- WS_PATH: the origin check of a browser's upgrade (403 from a page of another site; see access.origin_allowed);
- /healthz: 200 once the engine has started, 503 before;
- /loras: the styles a stream may pick (serve --lora-dir; streamsvc/engine/styles.py) as JSON, a list of {name, rank,
  bytes, loaded, error}; behind the access token when the server has tokens (``?token=`` or a Bearer header);
- /metrics: the server's Prometheus metrics (streamsvc/metrics.py), refreshed at each request; behind the
  token (a Bearer header) when the server has tokens; 404 when --metrics-port serves them apart (metrics_only);
- RECORDINGS_PATH + NAME.mp4 / NAME.vtt: a finished recording and its chapters, NAME its id and its own secret
  (streamsvc/viewers/record.py: a missing or wrong secret is 404, as no recording is), behind the access token when the
  server has tokens; a Range request gets its part (seeking in a <video>; see byte_range), a download at a
  time per client beyond --max-downloads-per-client is refused by the front;
- anything else: the browser player's static files (404 when the server has none).

A reply's body is bytes, or a file (or a byte range of one) that a front may stream instead of reading it whole.
Nothing here knows the front: no sockets, no websockets or aiohttp types.
"""

from __future__ import annotations

import dataclasses
import http
import json
import mimetypes
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, unquote_to_bytes, urlsplit

from streamsvc.door.access import AccessConfig, Refusal, bearer_token, find_token, origin_allowed
from streamsvc.metrics import Metrics
from streamsvc.viewers.record import RecordingStore

WS_PATH = "/ws"
MAX_TARGET_CHARS = 2048  # a longer request target gets 414 (ours are short: a recording's name and its token)
RECORDINGS_PATH = "/recordings/"  # GET /recordings/ID-SECRET.mp4 (and .vtt, its chapters)


@dataclass(frozen=True)
class HttpRequest:
    """A request as the routes see it, whichever front received it."""

    method: str  # "GET", "POST", ... (the routes answer every method as GET today)
    target: str  # the request line's target: the path and its query, "/recordings/s0.mp4?token=..."
    headers: Mapping[str, str]  # looked up case-insensitively: the front's own header map (websockets' Headers...)
    remote: str | None = None  # the peer's address, as the front's socket has it; None when unknown
    body: bytes = b""  # the request's body (bounded by the front: front.MAX_BODY_BYTES)

    @property
    def path(self) -> str:
        """The target without its query: "/recordings/s0.mp4"."""
        return self.target.split("?", 1)[0]

    @property
    def query(self) -> dict[str, list[str]]:
        """The target's query, parsed: {"token": ["..."]}."""
        return parse_qs(urlsplit(self.target).query)


@dataclass(frozen=True)
class HttpReply:
    """An answer: its status and headers, and its body as bytes or as a file (a byte range of one) to send."""

    status: http.HTTPStatus
    headers: tuple[tuple[str, str], ...]  # in the order they go out; Content-Length is the body's (or span's) length
    body: bytes = b""  # the body, when `file` is None
    file: Path | None = None  # the body is this file's bytes instead (a front may stream them)
    span: tuple[int, int] | None = None  # the inclusive byte offsets of `file` that make the body; None: all of it
    download: bool = False  # a recording: counts against its client's concurrent downloads (front.DownloadSlots)


def reply(status: http.HTTPStatus, body: bytes, ctype: str) -> HttpReply:
    """A reply with `body` of content type `ctype`, never cached."""
    return HttpReply(status, _headers(ctype, len(body)), body)


def text_reply(status: http.HTTPStatus, text: str) -> HttpReply:
    """A reply of plain text, a line or a few (WHEP's and WHIP's errors)."""
    return reply(status, (text.rstrip("\n") + "\n").encode(), "text/plain; charset=utf-8")


def _headers(ctype: str, length: int) -> tuple[tuple[str, str], ...]:
    return ("Content-Type", ctype), ("Content-Length", str(length)), ("Cache-Control", "no-store")


_UNSATISFIABLE = b"the Range asks for bytes past the end of the file (its size is in Content-Range)\n"
_BAD_ESCAPE = re.compile(r"%(?![0-9A-Fa-f]{2})")
_DOT_SEGMENT = re.compile(r"(^|/)\.{1,2}(/|$)")


def bad_target(target: str) -> HttpReply | None:
    """The 4xx for a request target no route can want, checked before any route sees it; None: a fine one.

    Origin-form only ("/path?query"), at most MAX_TARGET_CHARS (414), printable ASCII, every %-escape two hex digits,
    the path's bytes once unescaped valid UTF-8 without control characters (NUL: "/%00"), and no "." or ".."
    segment. Routes see the target still escaped: "/recordings/..%2Fx" names no recording (404), it is no traversal.
    """
    if len(target) > MAX_TARGET_CHARS:
        return reply(http.HTTPStatus.REQUEST_URI_TOO_LONG, f"request target over {MAX_TARGET_CHARS} characters\n"
                     .encode(), "text/plain")
    path = target.split("?", 1)[0]
    fault = None
    if not target.startswith("/") or not all("!" <= c <= "~" for c in target):
        fault = "not an origin-form target of printable ASCII"
    elif _BAD_ESCAPE.search(target):
        fault = "a %-escape is not two hex digits"
    elif _DOT_SEGMENT.search(path):
        fault = "a '.' or '..' segment"
    else:
        try:
            text = unquote_to_bytes(path).decode("utf-8")
        except UnicodeDecodeError:
            fault = "the path is not UTF-8 once unescaped"
        else:
            if any(ord(c) < 0x20 or ord(c) == 0x7F for c in text):
                fault = "a control character in the path"
    if fault is None:
        return None
    return reply(http.HTTPStatus.BAD_REQUEST, f"bad request target: {fault}\n".encode(), "text/plain")


def metrics_refusal(request: HttpRequest, access: AccessConfig, metrics: Metrics) -> HttpReply | None:
    """The 401 of a /metrics request without the token on a server with tokens (what it shows, streams and
    refusals, is the operator's); None: served. The token comes as a Bearer header only, which scrapers send and
    which no address bar, log or proxy keeps."""
    if not access.auth or find_token(access.tokens, bearer_token(request.headers.get("Authorization"))) is not None:
        return None
    metrics.refusals.labels(Refusal.UNAUTHORIZED.value).inc()
    return HttpReply(http.HTTPStatus.UNAUTHORIZED, _headers("text/plain", len(_METRICS_TOKEN)) + (
        ("WWW-Authenticate", 'Bearer realm="streamsvc metrics"'),), _METRICS_TOKEN)


_METRICS_TOKEN = (b"/metrics needs the access token here: send it as an 'Authorization: Bearer TOKEN' header (or "
                  b"serve the metrics on their own port with --metrics-port)\n")


def token_refusal(request: HttpRequest, access: AccessConfig, metrics: Metrics) -> HttpReply | None:
    """The 401 of a request without the access token (``?token=`` or a Bearer header) on a server with tokens
    (GET /loras, a recording); None: served."""
    if access.auth:
        given = (request.query.get("token") or [None])[0] or bearer_token(request.headers.get("Authorization"))
        if find_token(access.tokens, given) is None:
            metrics.refusals.labels(Refusal.UNAUTHORIZED.value).inc()
            return reply(http.HTTPStatus.UNAUTHORIZED, b"this server needs an access token: add ?token=... to "
                         b"the address or send an Authorization: Bearer header\n", "text/plain")
    return None


def check_origin(request: HttpRequest, access: AccessConfig, metrics: Metrics) -> HttpReply | None:
    """Refuses (403) a browser's upgrade from a page of another site; see access.origin_allowed. None: allowed."""
    origin, host = request.headers.get("Origin"), request.headers.get("Host")
    if origin_allowed(origin, host, access.allowed_origins):
        return None
    metrics.refusals.labels(Refusal.ORIGIN.value).inc()
    text = (f"origin {origin[:200]!r} may not open streams here: only pages of this server (Host {host!r}) "
            "and origins given with --allow-origin may\n")
    return reply(http.HTTPStatus.FORBIDDEN, text.encode(), "text/plain")


def static_file(root: str | None, path: str) -> HttpReply:
    """The player's file at `path` under `root` ("/" is its index.html); 404 outside `root` or with no player."""
    if root is None:
        return reply(http.HTTPStatus.NOT_FOUND, b"no player here; connect a client to /ws\n", "text/plain")
    base = Path(root).resolve()
    target = (base / (path.lstrip("/") or "index.html")).resolve()
    if base not in target.parents and target != base or not target.is_file():
        return reply(http.HTTPStatus.NOT_FOUND, b"not found\n", "text/plain")
    ctype = mimetypes.guess_type(target.name)[0] or "application/octet-stream"
    return HttpReply(http.HTTPStatus.OK, _headers(ctype, target.stat().st_size), file=target)


class RangeNotSatisfiable(Exception):
    """A Range none of whose bytes the file has (416 with `Content-Range: bytes */SIZE`)."""


_RANGE = re.compile(r"(\d*)-(\d*)")
_HUGE = 10**18  # a position of more than 18 digits is past any file (and not worth int()'s cost)


def byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """The byte range a Range header asks of `size` bytes, as inclusive offsets (RFC 9110 section 14): one
    "bytes=START-END", "bytes=START-" or "bytes=-SUFFIX" (an END past the file is clamped to it). None: serve the
    whole file with 200, for no header, another unit, a malformed or invalid one (END before START), or several
    ranges. Raises RangeNotSatisfiable when the one range starts past the end (or asks for a suffix of 0 bytes).

    Several ranges get the whole file, which RFC 9110 allows a server to do (it may ignore Range): no client of
    ours asks for several (a <video> seeks with one open-ended range), and a multipart/byteranges body is where
    servers have been made to amplify (many overlapping small ranges of one large file) for no use of ours.
    """
    if not header:
        return None
    unit, _, ranges = header.partition("=")
    if unit.strip().lower() != "bytes":
        return None
    specs = [spec.strip() for spec in ranges.split(",") if spec.strip()]
    match = _RANGE.fullmatch(specs[0]) if len(specs) == 1 else None
    if match is None or match.group(1) == match.group(2) == "":
        return None
    first, last = (None if not text else int(text) if len(text) <= 18 else _HUGE for text in match.groups())
    if first is None:  # the last `last` bytes
        if last == 0 or size == 0:
            raise RangeNotSatisfiable(f"bytes=-{last} of {size} bytes")
        return max(0, size - last), size - 1
    if last is not None and last < first:
        return None  # invalid: ignored
    if first >= size:
        raise RangeNotSatisfiable(f"bytes={first}- of {size} bytes")
    return first, size - 1 if last is None else min(last, size - 1)


class Routes:
    """The routes of one server (see the module's doc); a front calls `handle` for each request."""

    def __init__(self, access: AccessConfig, static_dir: str | None, recordings: RecordingStore, metrics: Metrics,
                 ready: Callable[[], bool], refresh_metrics: Callable[[], None], metrics_apart: bool = False,
                 styles: Callable[[], Sequence] = tuple) -> None:
        self.access = access  # tokens (recordings) and allowed origins (the upgrade)
        self.static_dir = static_dir  # the browser player's files, served at / (None: no player)
        self.recordings = recordings
        self.metrics = metrics  # served at /metrics; refusals are counted in it by reason
        self.ready = ready  # whether the engine takes streams (/healthz)
        self.refresh_metrics = refresh_metrics  # brings the gauges up to date before /metrics is served
        self.metrics_apart = metrics_apart  # /metrics is on its own port (metrics_only), not on this one
        self.styles = styles  # the styles offered (/loras): frozen dataclasses, read as they stand

    def handle(self, request: HttpRequest) -> HttpReply | None:
        """The reply to `request`; None for the WebSocket upgrade at WS_PATH from an allowed origin (the
        handshake goes on)."""
        path = request.path
        if path == WS_PATH:
            return check_origin(request, self.access, self.metrics)
        if path == "/healthz":
            ok = self.ready()
            return reply(http.HTTPStatus.OK if ok else http.HTTPStatus.SERVICE_UNAVAILABLE,
                         b"ok\n" if ok else b"starting\n", "text/plain")
        if path == "/metrics":
            if self.metrics_apart:
                return reply(http.HTTPStatus.NOT_FOUND, b"not found\n", "text/plain")
            refusal = metrics_refusal(request, self.access, self.metrics)
            if refusal is not None:
                return refusal
            self.refresh_metrics()
            return reply(http.HTTPStatus.OK, self.metrics.exposition(), "text/plain; version=0.0.4")
        if path.startswith(RECORDINGS_PATH):
            return self._recording(request, path.removeprefix(RECORDINGS_PATH))
        if path == "/loras":
            body = json.dumps([dataclasses.asdict(style) for style in self.styles()]).encode()
            return self.token_refusal(request) or reply(http.HTTPStatus.OK, body, "application/json")
        return static_file(self.static_dir, path)

    def metrics_only(self, request: HttpRequest) -> HttpReply:
        """The routes of --metrics-port: /metrics without a token (that port is for the scraper alone), 404 else."""
        if request.path != "/metrics":
            return reply(http.HTTPStatus.NOT_FOUND, b"this port serves /metrics only\n", "text/plain")
        self.refresh_metrics()
        return reply(http.HTTPStatus.OK, self.metrics.exposition(), "text/plain; version=0.0.4")

    def token_refusal(self, request: HttpRequest) -> HttpReply | None:
        """The 401 of a request without the access token on this server (`token_refusal`); None: served."""
        return token_refusal(request, self.access, self.metrics)

    def _recording(self, request: HttpRequest, name: str) -> HttpReply:
        """A recording (ID-SECRET.mp4) or its chapters (.vtt), behind the access token when the server has tokens (as
        `?token=` for a page's <video>, or an Authorization header); a Range request gets its part (seeking)."""
        refusal = self.token_refusal(request)
        if refusal is not None:
            return refusal
        if self.recordings.in_progress(name):  # its index (the moov box) and chapters are written when it ends
            return reply(http.HTTPStatus.CONFLICT, b"recording in progress: it can be fetched once its stream ends "
                         b"or its steerer stops recording\n", "text/plain")
        target = self.recordings.path(name)
        if target is None:  # no such recording, or a missing or wrong secret: one answer, never which
            self.metrics.refusals.labels(Refusal.SECRET.value).inc()
            return reply(http.HTTPStatus.NOT_FOUND, b"no such recording\n", "text/plain")
        ctype = "video/mp4" if target.suffix == ".mp4" else "text/vtt; charset=utf-8"
        size = target.stat().st_size
        try:
            span = byte_range(request.headers.get("Range"), size)
        except RangeNotSatisfiable:
            return HttpReply(http.HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE,
                             _headers("text/plain", len(_UNSATISFIABLE)) + (("Content-Range", f"bytes */{size}"),),
                             _UNSATISFIABLE)
        if span is None:
            return HttpReply(http.HTTPStatus.OK, _headers(ctype, size) + (("Accept-Ranges", "bytes"),), file=target,
                             download=True)
        start, end = span
        headers = _headers(ctype, end + 1 - start) + (("Content-Range", f"bytes {start}-{end}/{size}"),
                                                      ("Accept-Ranges", "bytes"))
        return HttpReply(http.HTTPStatus.PARTIAL_CONTENT, headers, file=target, span=span, download=True)
