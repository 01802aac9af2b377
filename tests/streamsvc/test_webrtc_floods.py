"""A WebRTC peer's floods below the protocol (issue 41, the leftovers of issue 33): authenticated STUN checks from
ever new addresses (each a peer-reflexive candidate aioice keeps) and RTCP picture-loss reports (each a keyframe),
on aiortc peers over loopback (no STUN server, no network)."""

from __future__ import annotations

import asyncio
import re
import socket
from types import SimpleNamespace

import pytest
from aioice import stun
from aiortc import RTCPeerConnection, RTCSessionDescription
from aiortc.rtp import RTCP_PSFB_PLI, RtcpPsfbPacket

from streamsvc.transport.aiortc_hooks import ice_connections
from streamsvc.transport.webrtc import WebRtcTransport
from streamsvc.viewers.session import SessionState
from streamsvc.wire.rtc import (
    CONTROL_CHANNEL,
    WebRtcConfig,
    complete_local_description,
    h264_preferences,
    rtc_configuration,
)

LOOPBACK = ("127.0.0.1",)


class _Engine:
    def __init__(self) -> None:
        self.keyframes = 0

    def observe_buffer(self, stream_id, frames, grace_s=0.0) -> None:
        pass

    def request_keyframe(self, stream_id) -> None:
        self.keyframes += 1


async def _answered(**config):
    """A transport that answered an aiortc viewer's offer, and the viewer, connecting on loopback."""
    async def nothing(*args) -> None:
        pass

    session = SimpleNamespace(stream_id="s1", fps=16, state=SessionState.PLAYING, outbox=asyncio.Queue(),
                              closed=False, buffer_report=lambda seconds: None)
    transport = WebRtcTransport(session, _Engine(), WebRtcConfig(ice_addresses=LOOPBACK, **config),
                                on_control=nothing, on_lost=nothing)
    pc = RTCPeerConnection(rtc_configuration())
    pc.addTransceiver("video", direction="recvonly").setCodecPreferences(h264_preferences())
    pc.createDataChannel(CONTROL_CHANNEL)
    offer = await complete_local_description(pc, await pc.createOffer(), LOOPBACK, 10)
    answer = await transport.answer(offer)
    await pc.setRemoteDescription(RTCSessionDescription(sdp=answer, type="answer"))
    return transport, pc, offer, answer


def _sdp_value(sdp: str, name: str) -> str:
    return re.search(rf"^a={name}:(\S+)", sdp, re.M).group(1)


@pytest.mark.slow
async def test_stun_checks_from_new_addresses_make_at_most_the_cap_of_peer_reflexive_candidates():
    cap, flood = 3, 40
    transport, pc, offer, answer = await _answered(max_remote_candidates=cap)
    sockets = []
    try:
        (connection,) = ice_connections(transport.pc)
        port = int(re.search(r"^a=candidate:\S+ 1 udp \d+ 127\.0\.0\.1 (\d+) typ host", answer, re.M).group(1))
        username = f"{_sdp_value(answer, 'ice-ufrag')}:{_sdp_value(offer, 'ice-ufrag')}"
        password = _sdp_value(answer, "ice-pwd").encode()
        for _ in range(flood):  # each check from a port of its own: a new address to the server's ICE agent
            request = stun.Message(message_method=stun.Method.BINDING, message_class=stun.Class.REQUEST)
            request.attributes.update({"USERNAME": username, "PRIORITY": 1853824767,
                                       "ICE-CONTROLLING": 1234567890123})
            request.add_message_integrity(password)
            request.add_fingerprint()
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.bind(("127.0.0.1", 0))
            s.sendto(bytes(request), ("127.0.0.1", port))
            sockets.append(s)
        for _ in range(250):  # bounded: until the server's agent has seen every check
            prflx = [c for c in connection._remote_candidates if c.type == "prflx"]
            if len(prflx) + transport.ice_guard.dropped >= flood:
                break
            await asyncio.sleep(0.02)
        prflx = [c for c in connection._remote_candidates if c.type == "prflx"]
        assert len(prflx) <= cap, len(prflx)
        assert transport.ice_guard.dropped >= flood - cap
        assert len(connection._check_list) <= cap + len(connection._remote_candidates)
    finally:
        for s in sockets:
            s.close()
        await pc.close()
        await transport.close()


@pytest.mark.slow
async def test_a_flood_of_plis_forces_at_most_one_keyframe_a_second():
    transport, pc, _, _ = await _answered()
    try:
        sender = transport.pc.getSenders()[0]
        loop = asyncio.get_running_loop()
        t0, sent = loop.time(), 0
        while loop.time() - t0 < 0.9 and sent < 10_000:  # a picture-loss report every few ms, for 0.9 s
            await sender._handle_rtcp_packet(RtcpPsfbPacket(fmt=RTCP_PSFB_PLI, ssrc=1, media_ssrc=sender._ssrc))
            sent += 1
            await asyncio.sleep(0.003)
        assert sent > 50
        assert transport.engine.keyframes == 1 == transport.keyframe_requests  # the first; the rest within 1 s
        await asyncio.sleep(max(0.0, t0 + 1.05 - loop.time()))
        await sender._handle_rtcp_packet(RtcpPsfbPacket(fmt=RTCP_PSFB_PLI, ssrc=1, media_ssrc=sender._ssrc))
        assert transport.engine.keyframes == 2  # a second later a lost picture is answered again
    finally:
        await pc.close()
        await transport.close()
