"""WHEP end to end (issue 36): aiortc as a plain WHEP client (an HTTP POST of its offer, no code of ours on the client
side but the loopback ICE choice) plays a stream, and every refusal is an HTTP status with a line of text."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import aiohttp
import aioice.ice
import pytest
from aiortc import RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError

from streamsvc.access import AccessConfig
from streamsvc.rtc import IceServer, WebRtcConfig
from tests.client.servers import running

pytestmark = pytest.mark.slow
LOOPBACK = WebRtcConfig(ice_addresses=("127.0.0.1",))
SDP = {"Content-Type": "application/sdp"}


@pytest.fixture(autouse=True)
def loopback_candidates(monkeypatch):
    """The client's host candidates on 127.0.0.1 (aioice leaves loopback out): this host may have no other."""
    monkeypatch.setattr(aioice.ice, "get_host_addresses", lambda use_ipv4, use_ipv6: ["127.0.0.1"])


async def offer(pc: RTCPeerConnection, channel: bool = False) -> str:
    """A WHEP client's offer: a recvonly video (and a `control` data channel), every candidate gathered."""
    pc.addTransceiver("video", direction="recvonly")
    if channel:
        pc.createDataChannel("control")
    await pc.setLocalDescription(await pc.createOffer())
    return pc.localDescription.sdp


def base(server) -> str:
    return f"http://127.0.0.1:{server.port}"


async def play(track, seconds: float) -> list:
    """The frames of `track` that arrive within `seconds` (bounded: at most 100 a second)."""
    frames = []
    end = time.monotonic() + seconds
    for _ in range(int(seconds * 100)):
        left = end - time.monotonic()
        if left <= 0:
            break
        try:
            frames.append(await asyncio.wait_for(track.recv(), left))
        except (TimeoutError, MediaStreamError):
            break
    return frames


async def test_a_plain_aiortc_whep_client_plays_five_seconds_and_deletes():
    async with running(webrtc=LOOPBACK) as server, aiohttp.ClientSession() as http:
        pc = RTCPeerConnection()
        tracks: asyncio.Queue = asyncio.Queue()
        pc.on("track", tracks.put_nowait)
        try:
            sdp = await offer(pc)
            async with http.post(f"{base(server)}/whep?prompt=a+red+ball", data=sdp, headers=SDP) as r:
                assert r.status == 201, await r.text()
                assert r.content_type == "application/sdp"
                location, answer = r.headers["Location"], await r.text()
                stream_id, watch_url = r.headers["X-Stream-Id"], r.headers["X-Watch-Url"]
                steer_secret = r.headers["X-Steer-Secret"]
                assert "Link" not in r.headers  # no ICE servers (test_ice_servers_are_link_headers)
            assert location.startswith("/whep/session/") and len(location.rsplit("/", 1)[1]) >= 22  # 128 bits
            session = server.sessions[stream_id]
            assert session.steer_secret == steer_secret and watch_url == f"/whep/{stream_id}?secret={session.watch_secret}"
            await pc.setRemoteDescription(RTCSessionDescription(answer, "answer"))
            track = await asyncio.wait_for(tracks.get(), 20)
            frames = await play(track, 5.0)
            # the stream's fps (16) for 5 s, less the first frame's wait (the start gate, the first chunk)
            assert len(frames) >= 40, len(frames)
            width, height = server.engine.gen.model_cfg.width, server.engine.gen.model_cfg.height
            assert (frames[-1].width, frames[-1].height) == (width, height)
            async with http.delete(base(server) + location) as r:
                assert r.status == 200, await r.text()
            for _ in range(50):  # the stream ends with its steering session
                if stream_id not in server.sessions:
                    break
                await asyncio.sleep(0.1)
            assert stream_id not in server.sessions
            assert server.whep.sessions == {}
            async with http.delete(base(server) + location) as r:  # gone
                assert r.status == 404
        finally:
            await pc.close()
