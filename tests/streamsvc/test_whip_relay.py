"""The gateway's WHIP relay (issue 36) without Ray: a fake gateway whose `_call` answers as a replica would."""

from __future__ import annotations

import http
from types import SimpleNamespace

from multidict import CIMultiDict

from streamsvc.cluster import whip_relay
from streamsvc.cluster.whip_relay import RelayedIngest
from streamsvc.door.routes import HttpRequest
from streamsvc.door.whep import Endpoints


class FakeGateway:
    def __init__(self) -> None:
        self.board = SimpleNamespace(replicas={"abc123": object()}, lost={})
        self.guard = SimpleNamespace(client=lambda request: request.remote)
        self.gateway = SimpleNamespace(place_timeout_s=1.0)
        self.calls: list[tuple] = []

    def replica_of(self, stream_id):  # (Gateway.replica_of: the replica its id's prefix names)
        return next((uid for uid in self.board.replicas if stream_id.startswith(uid + "-")), None)

    async def call(self, method, *args, replica, timeout_s=None):
        self.calls.append((method, args, replica))
        verb, target = args[0], args[1]
        if verb == "POST":
            return 201, (("Content-Type", "application/sdp"), ("Location", f"/whip/session/there{len(self.calls)}")), b"v=0\r\n"
        return 200, (), b"session ended\n"


async def test_whip_goes_to_the_streams_replica_and_the_gateway_keeps_a_bounded_location(monkeypatch):
    monkeypatch.setattr(whip_relay, "MAX_RELAYED", 2)
    g = FakeGateway()
    endpoints = Endpoints(SimpleNamespace())
    ingest = RelayedIngest(g)
    request = HttpRequest("POST", "/whip/abc123-s4?secret=S", CIMultiDict({"Content-Type": "application/sdp",
                                                                            "Authorization": "Bearer T"}), "10.0.0.9")
    answer = await ingest.publish(endpoints, request, "abc123-s4", "v=0\r\n")
    assert answer.status is http.HTTPStatus.CREATED
    method, (verb, target, headers, body, address), replica = g.calls[0]
    assert (method, verb, target, replica, address) == ("http", "POST", "/whip/abc123-s4?secret=S", "abc123", "10.0.0.9")
    assert headers == [("Content-Type", "application/sdp")]  # the token stays at the gateway
    location = dict(answer.headers)["Location"]
    assert location.startswith("/whip/session/") and "there" not in location
    (session,) = endpoints.sessions.values()
    await session.close()  # the gateway's DELETE: forwarded with the replica's own Location
    assert g.calls[-1][1][:2] == ("DELETE", "/whip/session/there1") and not endpoints.sessions

    unknown = await ingest.publish(endpoints, request, "zzz-s1", "v=0\r\n")
    assert unknown.status is http.HTTPStatus.NOT_FOUND and len(g.calls) == 2
    for _ in range(3):
        await ingest.publish(endpoints, request, "abc123-s4", "v=0\r\n")
    assert len(endpoints.sessions) == 2  # the oldest forgotten past MAX_RELAYED
