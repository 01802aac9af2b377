"""Who may open or watch a stream: the access token, the server's stream cap, the caps per token and per client
address, and the error code each refusal goes out with. One room that the server (streamsvc/viewers/server.py) and
the cluster's gateway (streamsvc/cluster/gateway.py) both use, whatever carries the viewer (a WebSocket, a WHEP
POST, a gateway's relay).

A viewer comes as a `Client` (its address and the bearer token of its request's headers); each check answers with
what it allows, or a `Refused`: the `error` to send (the request's code and a message that says why) and whether
the connection closes after it. Every refusal is counted in /metrics by reason (`Entry.refuse`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from streamsvc.door.access import AccessConfig, Refusal, StreamLimits, bearer_token, client_address, find_token
from streamsvc.metrics import Metrics
from streamsvc.wire import protocol as P

# the error code of a start or watch refused, by its reason
REFUSAL_CODES = {
    Refusal.UNAUTHORIZED: P.ErrorCode.UNAUTHORIZED,
    Refusal.TOKEN_STREAMS: P.ErrorCode.TOO_MANY_STREAMS,
    Refusal.CLIENT_STREAMS: P.ErrorCode.TOO_MANY_STREAMS,
    Refusal.SERVER_CAP: P.ErrorCode.REFUSED,
    Refusal.ADMISSION: P.ErrorCode.REFUSED,
    Refusal.NO_STREAM: P.ErrorCode.NOT_FOUND,
    Refusal.SECRET: P.ErrorCode.NOT_FOUND,  # a watch link of no open stream: as if the stream did not exist
    Refusal.WATCHERS: P.ErrorCode.REFUSED,
    Refusal.IMAGE: P.ErrorCode.BAD_IMAGE,
}


@dataclass(frozen=True)
class Client:
    """Who asks for a stream: the address it counts against, and the token its request's headers carry."""

    address: str  # X-Forwarded-For's nearest with --trust-proxy, else the peer's
    bearer: str | None = None  # the Authorization header's bearer token (a start's or watch's `token` wins)

    @classmethod
    def of(cls, remote: str | None, headers: Mapping[str, str], access: AccessConfig) -> Client:
        """The client of a request (or an upgrade) from `remote` with `headers`."""
        return cls(client_address(remote, headers.get("X-Forwarded-For"), access.trust_proxy),
                   bearer_token(headers.get("Authorization")))


@dataclass(frozen=True)
class Refused:
    """A start or watch that will not be served: the error that says why, and whether the connection closes after
    it (a wrong token: 1008)."""

    error: P.Error
    close: bool = False

    async def send(self, outlet) -> None:
        """Tell the viewer on `outlet` (a transport.ws.Outlet) why, and close it where the refusal says so."""
        await outlet.send(self.error)
        if self.close:
            await outlet.close(1008, "unauthorized")


class Entry:
    """The token, the caps and the refusals of one front (see the module docstring). `limits` counts the open
    streams by token and address: a stream let in holds its count until `release`."""

    def __init__(self, access: AccessConfig, max_streams: int, metrics: Metrics) -> None:
        self.access = access
        self.max_streams = max_streams
        self.metrics = metrics
        self.limits = StreamLimits(access)

    def authorize(self, client: Client, msg: P.Start | P.Watch) -> str | None | Refused:
        """The token a start or watch comes with (None where the server has no tokens), or its refusal."""
        given = msg.token or client.bearer
        token = find_token(self.access.tokens, given)
        if self.access.auth and token is None:
            return self.refuse(Refusal.UNAUTHORIZED, "the access token is not valid" if given else (
                "this server needs an access token: send it as 'token' in start or as an 'Authorization: Bearer' "
                "header (the player takes it from the page address: #token=...)"), msg.type, close=True)
        return token

    def let_in(self, client: Client, msg: P.Start, open_streams: int) -> str | None | Refused:
        """A new stream's token, its stream counted against its token and address (`release` when it ends); or the
        refusal: no token, the server at its cap (`open_streams` of `max_streams`), or a per-client cap."""
        token = self.authorize(client, msg)
        if isinstance(token, Refused):
            return token
        if open_streams >= self.max_streams:
            return self.refuse(Refusal.SERVER_CAP, f"server is at its cap of {self.max_streams} streams")
        over_limit = self.limits.acquire(token, client.address)
        if over_limit is not None:
            return self.refuse(*over_limit)
        return token

    def release(self, token: str | None, address: str) -> None:
        """A stream `let_in` counted has ended."""
        self.limits.release(token, address)

    def refuse(self, reason: Refusal, message: str, request: str = "start", close: bool = False) -> Refused:
        """A start or watch refused for `reason`: counted, with its code and `message`."""
        self.metrics.refusals.labels(reason.value).inc()
        if reason in (Refusal.SERVER_CAP, Refusal.ADMISSION) and request == "start":
            self.metrics.refused.inc()
        return Refused(P.Error(code=REFUSAL_CODES[reason], message=message[: P.MAX_TEXT_CHARS], request=request),
                       close=close)

    def refuse_link(self, stream_id: str) -> Refused:
        """A watch whose link is not an open stream's: its id names none, or its watch secret is missing or wrong.
        The same answer (code, message, metric) either way, so that ids cannot be probed."""
        return self.refuse(Refusal.SECRET, (
            f"no open stream {stream_id!r} here with this watch secret: the watch link is incomplete (it carries "
            "#watch=ID&secret=...) or wrong, the stream ended, or the link is from another server"), "watch")
