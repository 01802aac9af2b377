"""Capabilities follow the steer token (issue 41, item 5), end to end: the server in-process (tiny preset, CPU), its
viewers over raw WebSockets and an aiortc WHIP publisher over loopback. A handover or a take gives the new steerer a
new steer secret (in the audience that tells it it steers) and revokes the one before: the WHIP session published
with it ends, and a WHIP POST or a take with it is refused. Every wait is bounded."""

from __future__ import annotations

import aiohttp
import aioice.ice
import pytest
from aiortc import RTCPeerConnection, RTCSessionDescription

from streamsvc.wire import protocol as P
from streamsvc.wire.rtc import WebRtcConfig
from tests.client.servers import running
from tests.client.test_e2e_watch import Peer, watch
from tests.client.test_whip import publisher_offer, until

pytestmark = pytest.mark.slow
SDP = {"Content-Type": "application/sdp"}


@pytest.fixture(autouse=True)
def loopback_candidates(monkeypatch):
    monkeypatch.setattr(aioice.ice, "get_host_addresses", lambda use_ipv4, use_ipv6: ["127.0.0.1"])


def given_secret(peer: Peer) -> str | None:
    """The steer secret the audience that gave `peer` the token carried."""
    return next((a.steer_secret for a in reversed(peer.of(P.Audience)) if a.steer_secret), None)


async def publish(http: aiohttp.ClientSession, base: str, stream_id: str, secret: str, pcs: list) -> tuple[int, str]:
    """A WHIP POST of an aiortc publisher's offer with `secret`: (status, Location), the answer applied on a 201."""
    pc = RTCPeerConnection()
    pcs.append(pc)
    offer = await publisher_offer(pc, "H264")
    async with http.post(f"{base}/whip/{stream_id}?secret={secret}", data=offer, headers=SDP) as r:
        body = await r.text()
        if r.status == 201:
            await pc.setRemoteDescription(RTCSessionDescription(body, "answer"))
        return r.status, r.headers.get("Location", body)


async def test_a_handover_revokes_the_steer_secret_and_ends_the_whip_session_published_with_it():
    async with running(webrtc=WebRtcConfig(ice_addresses=("127.0.0.1",)), orphan_timeout_s=30) as server, \
            aiohttp.ClientSession() as http:
        base = f"http://127.0.0.1:{server.port}"
        steerer = await Peer.open(server, {"type": "start", "prompt": "a red ball", "seed": 3, "input": True})
        sid, old = steerer.ready.stream_id, steerer.ready.steer_secret
        watcher = await Peer.open(server, watch(steerer.ready))
        session = server.sessions[sid]
        pcs: list = []
        try:
            status, location = await publish(http, base, sid, old, pcs)
            assert status == 201, location
            assert await until(lambda: session.input.stats()["received"] >= 10, 20), session.input.stats()

            await steerer.send({"type": "handover", "to": watcher.ready.viewer_id})
            await watcher.until(lambda: given_secret(watcher), "the new steerer's secret")
            new = given_secret(watcher)
            assert new != old and watcher.of(P.Audience)[-1].role == "steer"
            assert all(a.steer_secret is None for a in steerer.of(P.Audience))  # the old steerer is given none
            # the session published with the old secret is ended at the handover, its input with it
            assert await until(lambda: not server.whep.whip.publishers, 5)
            received = session.input.stats()["received"]
            assert not session.revocable
            async with http.delete(base + location) as r:
                assert r.status == 404  # gone
            status, text = await publish(http, base, sid, old, pcs)
            assert status == 404, text  # the old secret is refused, as a wrong one is
            status, location = await publish(http, base, sid, new, pcs)
            assert status == 201, location  # the new steerer's works
            assert await until(lambda: session.input.stats()["received"] >= received + 10, 20)

            # a take revokes the secret in its turn: once the new steerer has left, the old secret takes nothing
            await watcher.close()
            await steerer.until(lambda: steerer.of(P.Audience) and not steerer.of(P.Audience)[-1].steered,
                                "orphaned")
            await steerer.send({"type": "take", "secret": old})
            await steerer.until(lambda: any(e.request == "take" for e in steerer.errors), "take refused")
            assert [e for e in steerer.errors if e.request == "take"][0].code == P.ErrorCode.NOT_STEERER
            await steerer.send({"type": "take", "secret": new})
            await steerer.until(lambda: given_secret(steerer), "the token and a newer secret")
            assert given_secret(steerer) not in (old, new)
            assert await until(lambda: not server.whep.whip.publishers, 5)  # the publisher under `new` ended too
        finally:
            for pc in pcs:
                await pc.close()
            await steerer.close()
            await watcher.close()


async def test_a_handover_to_a_watcher_that_could_not_steer_is_refused():
    """A WHEP player without a control channel would be handed a secret it never receives: the stream would be
    steerable by nobody again. The steerer is told, and keeps the token and its secret."""
    async with running(webrtc=WebRtcConfig(ice_addresses=("127.0.0.1",))) as server, aiohttp.ClientSession() as http:
        base = f"http://127.0.0.1:{server.port}"
        steerer = await Peer.open(server, {"type": "start", "prompt": "a red ball", "seed": 3})
        sid = steerer.ready.stream_id
        player = RTCPeerConnection()
        try:
            player.addTransceiver("video", direction="recvonly")
            await player.setLocalDescription(await player.createOffer())
            async with http.post(f"{base}/whep/{sid}?secret={steerer.ready.watch_secret}",
                                 data=player.localDescription.sdp, headers=SDP) as r:
                assert r.status == 201, await r.text()
                await player.setRemoteDescription(RTCSessionDescription(await r.text(), "answer"))
            session = server.sessions[sid]
            whep = next(v for v in session.viewers.values() if v is not session.steerer)
            assert await until(lambda: whep.rtc.pc is not None and whep.rtc.pc.connectionState == "connected", 20)
            await steerer.send({"type": "handover", "to": whep.viewer_id})
            await steerer.until(lambda: any(e.request == "handover" for e in steerer.errors), "handover refused")
            assert "no control channel" in steerer.errors[-1].message
            assert session.steerer.viewer_id == steerer.ready.viewer_id and session.may_steer(steerer.ready.steer_secret)
        finally:
            await player.close()
            await steerer.close()
