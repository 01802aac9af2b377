"""Who may open streams, and how much each client may ask for: tokens, origins, limits, rates.

Pure logic, no sockets and no asyncio (the server applies it): a server reachable beyond
loopback hands GPU time to whoever connects, so it checks

- an access token (``--auth-token``, ``--auth-file``), compared in constant time;
- the ``Origin`` of a browser's WebSocket upgrade: any page on any site could otherwise
  start streams from its visitors' browsers (programs send no Origin and are unaffected);
- streams per token and per client address;
- control messages per second per stream, as a token bucket with a burst;
- the secrets that make links capabilities (a stream's watch and steer secrets, a recording's): SECRET_BYTES
  random bytes each (128 bits), checked with ``secret_matches`` in constant time;
- what one address may hold and cost without a stream: its connections (and all clients' together, below the
  process's file descriptor limit), its HTTP requests, WebSocket upgrades and messages before ``start`` or
  ``watch`` per second (token buckets in a table of bounded size), and a connection's protocol errors.

Every refusal has a ``Refusal`` reason: the wire error says it, /metrics counts it.
"""

from __future__ import annotations

import enum
import hmac
import ipaddress
import math
import secrets
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from streamsvc.wire.protocol import MAX_TOKEN_CHARS


class Refusal(enum.StrEnum):
    """Why a request was refused: the ``reason`` label of ``streamsvc_refusals_total``."""

    ORIGIN = "origin"  # a browser upgrade from an origin that is not allowed
    UNAUTHORIZED = "unauthorized"  # no token, or a wrong one
    TOKEN_STREAMS = "token_streams"  # the token's streams are at its limit (auth file)
    CLIENT_STREAMS = "client_streams"  # the address's streams are at --max-streams-per-client
    SERVER_CAP = "server_cap"  # the server's hard cap on open streams
    ADMISSION = "admission"  # the scheduler or the KV pool: no room for the stream's compute or memory
    NO_STREAM = "no_stream"  # watch: no open stream has that id
    WATCHERS = "watchers"  # watch: the stream has --max-watchers watchers already
    IMAGE = "image"  # start: its image cannot be used (its type, size, bytes, or an upload unknown or expired)
    RATE_LIMITED = "rate_limited"  # a control message over the stream's rate
    STATS_RATE_LIMITED = "stats_rate_limited"  # a stats message over its own, lower rate
    DOWNLOADS = "downloads"  # a recording's download past --max-downloads-per-client at once (HTTP 429)
    # watch: no open stream has that id and watch secret (one answer whether the id exists or not); take: the steer
    # secret is missing or wrong
    SECRET = "secret"
    CONNECTIONS = "connections"  # the server holds --max-connections connections (HTTP 503)
    CLIENT_CONNECTIONS = "client_connections"  # the address holds --max-connections-per-client (HTTP 429)
    HTTP_RATE = "http_rate"  # an HTTP request over the address's --http-rate (HTTP 429)
    CONNECT_RATE = "connect_rate"  # a WebSocket upgrade over the address's --connect-rate (HTTP 429)
    MESSAGE_RATE = "message_rate"  # messages before start or watch over the address's --connect-rate (closed)
    START_TIMEOUT = "start_timeout"  # no start or watch within --start-timeout (closed)
    PROTOCOL_ERRORS = "protocol_errors"  # --max-protocol-errors bad messages within PROTOCOL_ERROR_WINDOW_S (closed)
    # a viewer that does not read: its backlog of chunks and messages passed its bound (closed; a WebRTC viewer's peer
    # connection too, when it does not take its data channel's messages: streamsvc/viewers/outbox.py)
    SLOW_CLIENT = "slow_client"


@dataclass(frozen=True)
class Rate:
    """A token bucket's shape: ``per_s`` messages a second on average, up to ``burst`` at once."""

    per_s: float
    burst: int

    def __post_init__(self) -> None:
        if not (self.per_s > 0 and math.isfinite(self.per_s)) or self.burst < 1:
            raise ValueError(f"rate {self.per_s}/s with burst {self.burst}: need a finite rate > 0 and a burst >= 1")


@dataclass(frozen=True)
class AccessConfig:
    # token -> most streams it may hold at once (None: no limit of its own); empty: no tokens needed
    tokens: dict[str, int | None] = field(default_factory=dict)
    allowed_origins: tuple[str, ...] = ()  # origins allowed besides the one matching the request's Host
    max_streams_per_client: int | None = None  # per remote address; None: no limit (load tests from one address)
    trust_proxy: bool = False  # take the client address from X-Forwarded-For (only behind a proxy that sets it)
    control_rate: Rate = Rate(5.0, 10)  # set_prompt, pause, resume, offer: per stream
    stats_rate: Rate = Rate(4.0, 4)  # stats messages, apart from the control rate (clients send about 2 a second)
    # connections (HTTP and WebSocket) one address may hold at once; the CPU load tests open about 100 from one
    max_connections_per_client: int = 256
    max_connections: int | None = None  # all addresses together; None: from the fd limit (default_max_connections)
    start_timeout_s: float = 10.0  # a WebSocket without start or watch this long is closed
    http_rate: Rate = Rate(20.0, 50)  # per address: HTTP requests other than the upgrade (/metrics, /healthz, files)
    # per address: WebSocket upgrades, and (a bucket of the same shape) messages on connections without a stream;
    # the burst lets an address open all its connections at once and send each its start or watch
    connect_rate: Rate = Rate(20.0, 256)
    max_protocol_errors: int = 10  # bad messages within PROTOCOL_ERROR_WINDOW_S that close a connection

    def __post_init__(self) -> None:
        if self.max_connections_per_client < 1 or (self.max_connections is not None and self.max_connections < 1):
            raise ValueError(f"max_connections_per_client={self.max_connections_per_client}, max_connections="
                             f"{self.max_connections}: give at least 1")
        if not (self.start_timeout_s > 0 and math.isfinite(self.start_timeout_s)):
            raise ValueError(f"start_timeout_s={self.start_timeout_s}: give a finite number of seconds > 0")
        if self.max_protocol_errors < 1:
            raise ValueError(f"max_protocol_errors={self.max_protocol_errors}: give at least 1")
        for token, limit in self.tokens.items():
            check_token(token)
            if limit is not None and limit < 1:
                raise ValueError(f"a token's stream limit is {limit}; give at least 1, or none for no limit")
        if self.max_streams_per_client is not None and self.max_streams_per_client < 1:
            raise ValueError(f"max_streams_per_client={self.max_streams_per_client}: give at least 1")
        for origin in self.allowed_origins:
            if normalize_origin(origin) is None:
                raise ValueError(f"allowed origin {origin!r} is not scheme://host[:port], e.g. https://example.org")

    @property
    def auth(self) -> bool:
        return bool(self.tokens)


# ---------------------------------------------------------------- tokens


def check_token(token: str) -> str:
    """The token, if it is one a client can send (printable ASCII, no spaces; the wire's rule)."""
    if not token or len(token) > MAX_TOKEN_CHARS or not all("!" <= c <= "~" for c in token):
        raise ValueError(f"a token must be 1 to {MAX_TOKEN_CHARS} printable ASCII characters without spaces")
    return token


def parse_auth_file(text: str, source: str = "auth file") -> dict[str, int | None]:
    """Tokens from ``TOKEN [MAX_STREAMS]`` lines; ``#`` starts a comment. Errors name the line."""
    tokens: dict[str, int | None] = {}
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        where = f"{source}, line {number}"
        if len(words) > 2 or (len(words) == 2 and not (words[1].isdigit() and int(words[1]) >= 1)):
            raise ValueError(f"{where}: expected 'TOKEN [MAX_STREAMS]' with MAX_STREAMS a whole number >= 1")
        try:
            token = check_token(words[0])
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        if token in tokens:
            raise ValueError(f"{where}: the token appears twice")
        tokens[token] = int(words[1]) if len(words) == 2 else None
    return tokens


def find_token(tokens: dict[str, int | None], given: str | None) -> str | None:
    """The configured token equal to ``given``, or None. Compares against every token in constant time
    (hmac.compare_digest), so neither the time taken nor an early exit tells how much of a guess was right."""
    if given is None:
        return None
    probe = given.encode()
    match = None
    for token in tokens:
        if hmac.compare_digest(token.encode(), probe):
            match = token
    return match


SECRET_BYTES = 16  # random bytes of a watch, steer or recording secret: 128 bits, past guessing


def new_secret() -> str:
    """A fresh secret for a link (a stream's watch or steer secret): SECRET_BYTES random bytes, URL-safe base64."""
    return secrets.token_urlsafe(SECRET_BYTES)


def secret_matches(expected: str | None, given: str | None) -> bool:
    """Whether ``given`` is the secret ``expected``, compared in constant time (hmac.compare_digest) so that the
    time taken tells nothing of how much of a guess was right. ``expected`` None (no such stream or recording) is
    compared against a stand-in of the same length, so that it takes the same time and is never a match."""
    probe = (given or "").encode("utf-8", "replace")
    same = hmac.compare_digest((expected or _NO_SECRET).encode(), probe)
    return same and expected is not None and given is not None


_NO_SECRET = "-" * 22  # what a lookup that found nothing compares against (the length of new_secret()'s)


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer TOKEN`` header value, or None."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


# ---------------------------------------------------------------- origins and addresses


def normalize_origin(origin: str) -> str | None:
    """``scheme://host[:port]`` in lower case with the default port left out, or None if it is not one."""
    parts = urlsplit(origin.strip().lower())
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
        return None
    try:
        port = parts.port
    except ValueError:
        return None
    default = 443 if parts.scheme == "https" else 80
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{parts.scheme}://{host}" + (f":{port}" if port not in (None, default) else "")


def origin_allowed(origin: str | None, host: str | None, allowed: Iterable[str]) -> bool:
    """Whether a WebSocket upgrade may go on. No Origin: not a browser, allowed. Otherwise the origin's
    host[:port] must be the request's Host (a page the server itself served, also through a reverse proxy
    that keeps Host), or one of ``allowed``."""
    if origin is None:
        return True
    own = normalize_origin(origin)
    if own is None:
        return False  # "null" (a sandboxed frame, a file: page) or garbage
    if host and own.split("://", 1)[1] == _host_without_default_port(host.strip().lower(), own.split("://", 1)[0]):
        return True
    return own in {normalize_origin(a) for a in allowed}


def _host_without_default_port(host: str, scheme: str) -> str:
    default = ":443" if scheme == "https" else ":80"
    return host.removesuffix(default)


def client_address(remote: str | None, forwarded_for: str | None, trust_proxy: bool) -> str:
    """The address a client's stream limit counts against: the peer's, or with ``trust_proxy`` the
    nearest address in X-Forwarded-For (the one the proxy added; earlier ones the client may have made up)."""
    if trust_proxy and forwarded_for:
        nearest = forwarded_for.split(",")[-1].strip()
        if nearest:
            return nearest
    return remote or "unknown"


def is_loopback(host: str) -> bool:
    """Whether a listen address reaches this machine only (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def exposure_warning(host: str, config: AccessConfig) -> str | None:
    """What `serve` warns at start when it listens beyond loopback and anyone may start streams."""
    if config.auth or is_loopback(host):
        return None
    return (f"listening on {host} with no access token: anyone who reaches this port can start streams; "
            "give --auth-token or --auth-file (README: Running beyond localhost)")


# ---------------------------------------------------------------- limits


class TokenBucket:
    """``rate.burst`` messages at once, refilled at ``rate.per_s``; the caller passes the time."""

    def __init__(self, rate: Rate, now: float) -> None:
        self.rate = rate
        self._level = float(rate.burst)
        self._at = now

    def take(self, now: float) -> bool:
        """Spend one message if the bucket holds one; False (and nothing spent) otherwise."""
        self._level = min(float(self.rate.burst), self._level + max(0.0, now - self._at) * self.rate.per_s)
        self._at = max(self._at, now)
        if self._level < 1.0:
            return False
        self._level -= 1.0
        return True

    def empty(self, now: float) -> None:
        """Spend everything the bucket holds at `now`: what comes next waits for the rate."""
        self.take(now)
        self._level = 0.0

    def wait_s(self) -> float:
        """Seconds until the bucket holds a message again, as of the last `take` (0 if it holds one now)."""
        return max(0.0, 1.0 - self._level) / self.rate.per_s

    def holds_one(self, now: float) -> bool:
        """Whether a `take` at `now` would succeed (nothing is spent)."""
        return self._level + max(0.0, now - self._at) * self.rate.per_s >= 1.0

    def full(self, now: float) -> bool:
        """Whether the bucket has refilled to its burst by `now`: it is then the same as a new one."""
        return self._level + max(0.0, now - self._at) * self.rate.per_s >= self.rate.burst


class StreamLimits:
    """Open streams per token and per client address, against the configured limits."""

    def __init__(self, config: AccessConfig) -> None:
        self.config = config
        self._by_token: Counter[str] = Counter()
        self._by_address: Counter[str] = Counter()

    def acquire(self, token: str | None, address: str) -> tuple[Refusal, str] | None:
        """Count a new stream, or say why it may not open (reason and a message for the client)."""
        token_limit = self.config.tokens.get(token) if token is not None else None
        if token_limit is not None and self._by_token[token] >= token_limit:
            return Refusal.TOKEN_STREAMS, f"this token may hold {token_limit} streams at once; close one first"
        address_limit = self.config.max_streams_per_client
        if address_limit is not None and self._by_address[address] >= address_limit:
            return Refusal.CLIENT_STREAMS, (f"this address may hold {address_limit} streams at once "
                                            "(--max-streams-per-client); close one first")
        if token is not None:
            self._by_token[token] += 1
        self._by_address[address] += 1
        return None

    def table_sizes(self) -> dict[str, int]:
        """Its entries (see Server.table_sizes): an address or a token that holds no stream has none."""
        return {"door.streams_by_address": len(self._by_address), "door.streams_by_token": len(self._by_token)}

    def held(self) -> int:
        """Streams counted now (by address: every stream has one)."""
        return sum(self._by_address.values())

    def release(self, token: str | None, address: str) -> None:
        """A stream counted by ``acquire`` ended."""
        if token is not None:
            self._by_token[token] -= 1
            if self._by_token[token] <= 0:
                del self._by_token[token]
        self._by_address[address] -= 1
        if self._by_address[address] <= 0:
            del self._by_address[address]


# ---------------------------------------------------------------- what one address may hold and cost

FD_RESERVE = 128  # file descriptors kept for the engine, its encoders, recordings, logs and the listening socket
# file descriptors one connection may need: its socket, and a WebRTC viewer's ICE sockets (one UDP socket per
# gathered address, usually one or two) or its stream's recording
FDS_PER_CONNECTION = 3
MAX_CONNECTIONS_CEILING = 16384  # beyond what one event loop serves: 256 streams of 64 watchers, with room
PROTOCOL_ERROR_WINDOW_S = 10.0  # the window --max-protocol-errors counts in
RATE_TABLE_SIZE = 8192  # addresses (times kinds of request) whose rates are tracked at once; the idlest go first
RATE_PRUNE_PERIOD_S = 60.0  # how often the rate table drops the buckets that have refilled (RequestRates.prune)


def default_max_connections(fd_limit: int) -> int:
    """The total connection cap for a soft RLIMIT_NOFILE of `fd_limit` (negative: unlimited): room for
    FD_RESERVE descriptors of the process's own and FDS_PER_CONNECTION for each connection, at most
    MAX_CONNECTIONS_CEILING, at least 1."""
    if fd_limit < 0:
        return MAX_CONNECTIONS_CEILING
    return max(1, min(MAX_CONNECTIONS_CEILING, (fd_limit - FD_RESERVE) // FDS_PER_CONNECTION))


def address_key(address: str) -> str:
    """What an address's limits count against: an IPv4 address itself (also IPv4-mapped IPv6), an IPv6 address's
    /64 (one host usually holds a whole /64, so one address each would let it multiply its limits by 2^64), and
    anything else (an unparsed X-Forwarded-For) cut to 64 characters."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return address[:64]
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


class ConnectionLimits:
    """Open connections per client address and in total, against their caps. Memory is one entry per address
    that holds a connection (an entry goes when its count returns to 0), so it is bounded by the total cap."""

    def __init__(self, per_client: int, total: int) -> None:
        if per_client < 1 or total < 1:
            raise ValueError(f"connection caps {per_client} per client, {total} in total: give at least 1 each")
        self.per_client = per_client
        self.total = total
        self._by_address: Counter[str] = Counter()
        self._held = 0

    def acquire(self, address: str) -> tuple[Refusal, str] | None:
        """Count a new connection from `address`, or say why it may not stay (reason, message for the client)."""
        if self._held >= self.total:
            return Refusal.CONNECTIONS, (f"the server holds {self.total} connections, its cap (--max-connections); "
                                         "try again shortly")
        key = address_key(address)
        if self._by_address[key] >= self.per_client:  # (a Counter's lookup adds no entry)
            return Refusal.CLIENT_CONNECTIONS, (f"this address holds {self.per_client} connections, its cap "
                                                "(--max-connections-per-client); close one first")
        self._by_address[key] += 1
        self._held += 1
        return None

    def release(self, address: str) -> None:
        """A connection counted by `acquire` closed."""
        key = address_key(address)
        if self._by_address[key] <= 0:
            raise ValueError(f"release of a connection from {address} that was not acquired")
        self._by_address[key] -= 1
        self._held -= 1
        if self._by_address[key] == 0:
            del self._by_address[key]

    def held(self, address: str | None = None) -> int:
        """Connections counted now: from `address`, or from all."""
        return self._held if address is None else self._by_address.get(address_key(address), 0)

    def addresses(self) -> int:
        """Addresses holding a connection now (the entries kept)."""
        return len(self._by_address)


class RateKind(enum.StrEnum):
    """What a client without a stream makes the server do, each kind with its own rate per address."""

    HTTP = "http"  # an HTTP request other than the upgrade: /metrics, /healthz, the player's files, recordings
    UPGRADE = "upgrade"  # a WebSocket upgrade
    MESSAGE = "message"  # a message on a connection with no stream yet: start, watch, or anything else


class RequestRates:
    """Per-address token buckets for each RateKind, in a table of at most `size` entries.

    An attacker with many addresses cannot grow the table past `size`: a new entry evicts the least recently
    used one. Evicting loses nothing the attacker lacks anyway (a new address gets a full bucket too), and entries
    that have refilled to their burst, the same as absent ones, are dropped first by `prune`, which also runs every
    RATE_PRUNE_PERIOD_S: over a long run the table holds the addresses of late, not every address ever seen.
    """

    REFUSALS = {RateKind.HTTP: Refusal.HTTP_RATE, RateKind.UPGRADE: Refusal.CONNECT_RATE,
                RateKind.MESSAGE: Refusal.MESSAGE_RATE}

    def __init__(self, rates: dict[RateKind, Rate], size: int = RATE_TABLE_SIZE) -> None:
        if size < 1:
            raise ValueError(f"a rate table of {size} entries: give at least 1")
        self.rates = dict(rates)
        self.size = size
        self._buckets: OrderedDict[tuple[RateKind, str], TokenBucket] = OrderedDict()
        self._pruned_at = -math.inf  # the latest prune's time

    @classmethod
    def from_config(cls, config: AccessConfig, size: int = RATE_TABLE_SIZE) -> RequestRates:
        return cls({RateKind.HTTP: config.http_rate, RateKind.UPGRADE: config.connect_rate,
                    RateKind.MESSAGE: config.connect_rate}, size)

    def take(self, kind: RateKind, address: str, now: float) -> float | None:
        """Spend one of the address's requests of `kind`: None if it may go on, else the seconds until it may
        (Retry-After)."""
        key = (kind, address_key(address))
        if now - self._pruned_at >= RATE_PRUNE_PERIOD_S:
            self.prune(now)
        bucket = self._buckets.get(key)
        if bucket is None:
            if len(self._buckets) >= self.size:
                self.prune(now)
            while len(self._buckets) >= self.size:
                self._buckets.popitem(last=False)
            bucket = self._buckets[key] = TokenBucket(self.rates[kind], now)
        else:
            self._buckets.move_to_end(key)
        return None if bucket.take(now) else bucket.wait_s()

    def empty(self, kind: RateKind, address: str, now: float) -> None:
        """Spend all of the address's requests of `kind` at `now` (a penalty: an address whose connection was closed
        for a flood gets no burst for its next ones, only the rate)."""
        self.take(kind, address, now)
        self._buckets[(kind, address_key(address))].empty(now)

    def over_rate(self, address: str, now: float) -> bool:
        """Whether any of the address's buckets is empty at `now`: what it sends next waits for the rate. (A
        look only: nothing is spent, and an address never seen is not over.)"""
        key = address_key(address)
        for kind in self.rates:
            bucket = self._buckets.get((kind, key))
            if bucket is not None and not bucket.holds_one(now):
                return True
        return False

    def prune(self, now: float) -> None:
        """Drop the entries whose buckets have refilled by `now` (they hold nothing a new entry would not)."""
        self._pruned_at = now
        for key in [k for k, bucket in self._buckets.items() if bucket.full(now)]:
            del self._buckets[key]

    def __len__(self) -> int:
        return len(self._buckets)


class ProtocolErrors:
    """A connection's bad messages: the `limit`-th within `window_s` seconds means the peer is not a client
    that made a mistake but a program sending junk, and the connection closes. Holds at most `limit` times."""

    def __init__(self, limit: int, window_s: float = PROTOCOL_ERROR_WINDOW_S) -> None:
        if limit < 1 or not window_s > 0:
            raise ValueError(f"{limit} protocol errors within {window_s} s: give a limit >= 1 and a window > 0")
        self.limit = limit
        self.window_s = window_s
        self._times: deque[float] = deque(maxlen=limit)
        self.count = 0  # every error counted, for the log

    def add(self, now: float) -> bool:
        """Count an error at `now`; True when it is the `limit`-th within the window (close the connection)."""
        self.count += 1
        self._times.append(now)
        return len(self._times) == self.limit and now - self._times[0] <= self.window_s


class LogGate:
    """Log lines that clients can cause, at most one per key every `period_s`, so that a flood of them costs
    neither the disk nor the event loop. `allow` says whether to log now and how many lines were held back."""

    def __init__(self, period_s: float = 10.0, size: int = 256) -> None:
        self.period_s = period_s
        self.size = size  # keys tracked at most (the idlest go first); keys should be kinds, not addresses
        self._keys: OrderedDict[str, tuple[float, int]] = OrderedDict()  # key -> (last line's time, held back since)

    def allow(self, key: str, now: float) -> int | None:
        """None: do not log this one (it is counted). Else log it, with the returned number of lines held back."""
        last = self._keys.get(key)
        if last is not None and now - last[0] < self.period_s:
            self._keys[key] = (last[0], last[1] + 1)
            return None
        self._keys[key] = (now, 0)
        self._keys.move_to_end(key)
        while len(self._keys) > self.size:
            self._keys.popitem(last=False)
        return 0 if last is None else last[1]

    def __len__(self) -> int:
        """Keys tracked (at most `size`)."""
        return len(self._keys)
