"""Who may open streams, and how much each client may ask for: tokens, origins, limits, rates.

Pure logic, no sockets and no asyncio (the server applies it): a server reachable beyond
loopback hands GPU time to whoever connects, so it checks

- an access token (``--auth-token``, ``--auth-file``), compared in constant time;
- the ``Origin`` of a browser's WebSocket upgrade: any page on any site could otherwise
  start streams from its visitors' browsers (programs send no Origin and are unaffected);
- streams per token and per client address;
- control messages per second per stream, as a token bucket with a burst.

Every refusal has a ``Refusal`` reason: the wire error says it, /metrics counts it.
"""

from __future__ import annotations

import enum
import hmac
import ipaddress
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from streamsvc.protocol import MAX_TOKEN_CHARS


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
    RATE_LIMITED = "rate_limited"  # a control message over the stream's rate
    STATS_RATE_LIMITED = "stats_rate_limited"  # a stats message over its own, lower rate


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

    def __post_init__(self) -> None:
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
