"""What one client address may hold and cost on the port, applied: the front's admission hooks and each
WebSocket's guard. The policy is streamsvc/door/access.py's (pure); this is its side with sockets and timers.

Two counts of connections, because a reverse proxy puts every client behind one peer address:

- sockets, by peer address, as the front accepts them (HTTP or WebSocket: each holds a file descriptor). Past
  hard caps (`socket_caps`: twice the per-address cap, half again the total) a connection is dropped at once,
  unanswered: the file descriptors are at stake, and an idle socket past them would otherwise hold one until the
  front's handshake timeout. With --trust-proxy only the total applies.
- WebSockets, by client address (X-Forwarded-For's with --trust-proxy), at their upgrade: past
  --max-connections-per-client an upgrade gets 429, past --max-connections 503, each with Retry-After, and holds
  nothing after.

Per address, as token buckets (access.RequestRates): HTTP requests (--http-rate: 429 past it), WebSocket upgrades
and messages before start or watch (--connect-rate: an upgrade past it gets 429, a message closes its connection).
Each WebSocket (`ConnectionGuard`) must send start or watch within --start-timeout, and is closed after
--max-protocol-errors bad messages within access.PROTOCOL_ERROR_WINDOW_S (a stream's malformed input messages count),
or when its viewer does not read (its outbox past its bound, streamsvc/viewers/outbox.py: `slow_client`). Closes use
code 1008 (policy violation) with the reason in words; every refusal and close is counted in /metrics by its Refusal
reason, and the log lines they cause are rate-limited (access.LogGate). Once its viewer is done (its stream ended, or
it left), a WebSocket is closed (1000) and nothing more it sends is read.
"""

from __future__ import annotations

import asyncio
import dataclasses
import http
import logging
import math
import resource
from collections.abc import Callable

from streamsvc.door.access import (
    FD_RESERVE,
    PROTOCOL_ERROR_WINDOW_S,
    AccessConfig,
    ConnectionLimits,
    LogGate,
    ProtocolErrors,
    RateKind,
    Refusal,
    RequestRates,
    client_address,
    default_max_connections,
)
from streamsvc.door.routes import WS_PATH, HttpReply, HttpRequest, reply
from streamsvc.metrics import Metrics

log = logging.getLogger("streamsvc.guard")

HOLD_S = 1.0  # how long a new socket from an address over its request rate waits before it is read
POLICY_VIOLATION = 1008  # the WebSocket close code of a connection closed by a limit (RFC 6455 7.4.1)


def raise_fd_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (systemd starts a service at a soft 1024, far below its hard
    limit), log it, and return the soft limit now (-1: unlimited). Where the kernel refuses the hard limit (macOS's
    unlimited one), the soft limit stays."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass
    now = resource.getrlimit(resource.RLIMIT_NOFILE)[0]

    def shown(limit: int) -> str:
        return "unlimited" if limit == resource.RLIM_INFINITY else str(limit)

    log.info("file descriptors: soft limit %s%s (hard %s)", shown(now),
             f", raised from {shown(soft)}" if now != soft else "", shown(hard))
    return -1 if now == resource.RLIM_INFINITY else now


def socket_caps(per_client: int, total: int, fd_limit: int, trust_proxy: bool) -> tuple[int, int]:
    """The hard caps on sockets (per peer address, in total) past which a connection is dropped as it is
    accepted: room beyond the WebSocket caps for the connections that are being told 429 or 503, or that carry
    HTTP requests, yet below the fd limit. Behind a trusted proxy every client has the proxy's address: no cap
    per peer but the total."""
    hard_total = total + max(16, total // 2)
    if fd_limit >= 0:
        hard_total = max(total, min(hard_total, fd_limit - FD_RESERVE // 2))
    return (hard_total if trust_proxy else min(hard_total, 2 * per_client)), hard_total


class Guard:
    """The limits of one server's port (see the module's doc). `listen` sets the caps once the fd limit is known;
    the `admit_*` methods and `connection_closed`/`upgrade_ended` are the front's hooks (front.Handlers);
    `connection` guards one WebSocket."""

    def __init__(self, access: AccessConfig, metrics: Metrics, clock: Callable[[], float]) -> None:
        self.access = access
        self.metrics = metrics  # refusals are counted in it by reason
        self.clock = clock  # the rates' and the protocol errors' time
        self.rates = RequestRates.from_config(access)
        self.logs = LogGate()
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self._set_caps(-1 if soft == resource.RLIM_INFINITY else soft)  # until `listen` knows the raised limit

    def _set_caps(self, fd_limit: int) -> None:
        access = self.access
        total = access.max_connections or default_max_connections(fd_limit)
        self.clients = ConnectionLimits(access.max_connections_per_client, total)  # WebSockets, by client address
        self.sockets = ConnectionLimits(*socket_caps(access.max_connections_per_client, total, fd_limit,
                                                     access.trust_proxy))  # sockets, by peer address

    def listen(self, fd_limit: int) -> None:
        """Set the caps for a process whose soft fd limit is `fd_limit` (-1: unlimited), and log them. (Only
        before the port takes connections: the counts start anew.)"""
        access = self.access
        self._set_caps(fd_limit)
        total, per_client = self.clients.total, self.clients.per_client
        http_rate, connect_rate = access.http_rate, access.connect_rate
        log.info("connections: at most %d in total and %d per address (WebSockets; sockets of any kind are dropped "
                 "past %d in total and %d per address); a WebSocket without start or watch is closed after %g s; "
                 "per address a second: %g HTTP requests (burst %d), %g upgrades and messages before start "
                 "(burst %d); %d protocol errors within "
                 "%g s close a connection", total, per_client, self.sockets.total, self.sockets.per_client,
                 access.start_timeout_s, http_rate.per_s, http_rate.burst, connect_rate.per_s, connect_rate.burst,
                 access.max_protocol_errors, PROTOCOL_ERROR_WINDOW_S)
        if access.max_connections is not None and fd_limit >= 0 and total > default_max_connections(fd_limit):
            log.warning("--max-connections %d is more than the file descriptor limit (%d) leaves room for (%d): "
                        "the process may run out of descriptors", total, fd_limit, default_max_connections(fd_limit))
        if per_client >= total:
            log.warning("--max-connections-per-client %d is not below the total cap %d: one address can hold every "
                        "connection (raise the fd limit, `ulimit -n`, or lower --max-connections-per-client)",
                        per_client, total)

    def table_sizes(self) -> dict[str, int]:
        """Its tables' entries (see Server.table_sizes): addresses holding WebSockets and sockets (none once their
        connections closed), the request rates' buckets and the refusals' log keys (kept, each bounded: RATE_TABLE_SIZE,
        LogGate.size)."""
        return {"door.websockets_by_address": self.clients.addresses(),
                "door.sockets_by_address": self.sockets.addresses(), "door.rate_buckets": len(self.rates),
                "door.log_keys": len(self.logs)}

    # -- the front's hooks ---------------------------------------------------------------------

    def admit_connection(self, peer: str) -> str | None:
        """A socket as it is accepted: None to serve it, else why it is dropped (past the hard caps)."""
        refused = self.sockets.acquire(self._peer_key(peer))
        if refused is None:
            return None
        reason, _ = refused
        self.refused(reason, peer)
        return f"{reason.value}: past the hard socket cap"

    def hold_connection(self, peer: str) -> float:
        """Seconds a socket just admitted waits unread: HOLD_S while its address is over one of its request rates
        (it has been refused lately and its bucket is still empty), else 0. A flood of requests answered 429 at
        once costs the event loop an accept, a parse and a reply each (some 600 a second from one program on a
        2-core host); held, each of its connections costs an accept and a timer, and the flooder waits with it.
        Behind a proxy (--trust-proxy) every peer is the proxy, so nothing is held."""
        if self.access.trust_proxy or not self.rates.over_rate(peer, self.clock()):
            return 0.0
        return HOLD_S

    def connection_closed(self, peer: str) -> None:
        """A socket admitted by `admit_connection` has closed."""
        self.sockets.release(self._peer_key(peer))

    def admit_request(self, request: HttpRequest) -> HttpReply | None:
        """Every request, before its route: within its address's rate (HTTP requests, or upgrades at WS_PATH)?"""
        kind = RateKind.UPGRADE if request.path == WS_PATH else RateKind.HTTP
        address = self.client(request)
        wait_s = self.rates.take(kind, address, self.clock())
        if wait_s is None:
            return None
        reason = RequestRates.REFUSALS[kind]
        self.refused(reason, address)
        upgrade = kind is RateKind.UPGRADE
        what, flag = ("WebSocket upgrades", "--connect-rate") if upgrade else ("HTTP requests", "--http-rate")
        return _too_busy(http.HTTPStatus.TOO_MANY_REQUESTS, f"this address sends {what} faster than this server "
                         f"serves one address ({flag}); slow down", wait_s)

    def admit_upgrade(self, request: HttpRequest) -> HttpReply | None:
        """A WebSocket upgrade that passed its route: counted against its client's and the server's caps (429 or
        503 past them). One admitted here ends with `upgrade_ended`, whether the upgrade happens or not."""
        address = self.client(request)
        refused = self.clients.acquire(address)
        if refused is None:
            return None
        reason, message = refused
        self.refused(reason, address)
        status = http.HTTPStatus.SERVICE_UNAVAILABLE if reason is Refusal.CONNECTIONS else (
            http.HTTPStatus.TOO_MANY_REQUESTS)
        return _too_busy(status, message, self.access.start_timeout_s)  # an idle slot frees by then

    def upgrade_ended(self, request: HttpRequest) -> None:
        """A WebSocket admitted by `admit_upgrade` has ended (or its upgrade failed)."""
        self.clients.release(self.client(request))

    def client(self, request: HttpRequest) -> str:
        """The address a request counts against (X-Forwarded-For's nearest with --trust-proxy)."""
        return client_address(request.remote, request.headers.get("X-Forwarded-For"), self.access.trust_proxy)

    # -- one WebSocket --------------------------------------------------------------------------

    def connection(self, conn, address: str) -> ConnectionGuard:
        """The guard of a WebSocket just upgraded from `address` (`conn`: a front.Connection): its start
        deadline runs from now."""
        return ConnectionGuard(self, conn, address)

    def _peer_key(self, peer: str) -> str:
        return "proxy" if self.access.trust_proxy else peer

    def refused(self, reason: Refusal, address: str) -> None:
        """Count a refusal or a close, and log it at most once per reason every LogGate period."""
        self.metrics.refusals.labels(reason.value).inc()
        held_back = self.logs.allow(reason.value, self.clock())
        if held_back is not None:
            log.info("refused or closed: %s (from %s%s)", reason.value, address[:64],
                     f"; {held_back} more since the last such line" if held_back else "")


class ConnectionGuard:
    """One WebSocket's limits: its deadline for start or watch, the rate of its messages before then (its
    address's bucket), and its protocol errors. Each check that fails closes the connection (1008) and says so."""

    def __init__(self, guard: Guard, conn, address: str) -> None:
        self.guard = guard
        self.conn = conn
        self.address = address
        access = guard.access
        self.errors = ProtocolErrors(access.max_protocol_errors)
        self.closing: Refusal | None = None  # why the guard closed the connection, once it has
        self._deadline: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(
            access.start_timeout_s, self._expire)
        self._closer: asyncio.Task | None = None

    def message(self) -> bool:
        """A message arrived while the connection has no stream: False (and closing) past its address's rate."""
        if self.guard.rates.take(RateKind.MESSAGE, self.address, self.guard.clock()) is None:
            return True
        self._close(Refusal.MESSAGE_RATE, "too many messages before start or watch", linger=False)
        return False

    def protocol_error(self) -> bool:
        """A bad message (unparseable, invalid, out of turn): False (and closing) when it is one too many."""
        if not self.errors.add(self.guard.clock()):
            return True
        self._close(Refusal.PROTOCOL_ERRORS, f"{self.errors.limit} protocol errors within {self.errors.window_s:g} s",
                    linger=False)
        return False

    def backlogged(self, text: str) -> None:
        """The connection's viewer does not read: its outbox passed its bound (streamsvc/viewers/outbox.py). Closed
        (1008) without reading more; a peer that reads nothing of what is queued is dropped (front.Connection.close)."""
        self._close(Refusal.SLOW_CLIENT, text, linger=False)

    def ended(self, text: str) -> None:
        """The connection's viewer is done (its stream ended, or it left) and its last messages went out: closed
        (1000) without reading more, so that nothing it sends after is parsed. Not a refusal: nothing counted."""
        if self._closer is None:
            self._closer = asyncio.ensure_future(self.conn.close(1000, text, linger=False))

    def started(self) -> None:
        """The connection has its stream: no deadline any more."""
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    async def done(self) -> None:
        """The connection's handler ends: the deadline goes, and a close under way finishes."""
        self.started()
        if self._closer is not None:
            await asyncio.shield(self._closer)

    def _expire(self) -> None:
        self._deadline = None
        self._close(Refusal.START_TIMEOUT, f"no start or watch within {self.guard.access.start_timeout_s:g} s")

    def _close(self, reason: Refusal, text: str, linger: bool = True) -> None:
        """Close with 1008 and `text`; linger=False for a flood (front.Connection.close: nothing more is read)."""
        if self.closing is not None or self._closer is not None:
            return
        self.closing = reason
        self.guard.refused(reason, self.address)
        if not linger:  # a flood: the address's next connections come at its rate, without a burst
            self.guard.rates.empty(RateKind.UPGRADE, self.address, self.guard.clock())
        self._closer = asyncio.ensure_future(self.conn.close(POLICY_VIOLATION, text, linger=linger))


def _too_busy(status: http.HTTPStatus, message: str, retry_after_s: float) -> HttpReply:
    """A refusal that says when to try again (Retry-After, whole seconds, at least 1)."""
    answer = reply(status, (message + "\n").encode(), "text/plain")
    return dataclasses.replace(answer, headers=answer.headers + (
        ("Retry-After", str(max(1, math.ceil(retry_after_s)))), ("Connection", "close")))
