"""WHIP end to end (issue 36): aiortc as a plain WHIP publisher (an HTTP POST of its offer) sends video into an open
stream's input, H.264 and VP8; only the steer secret may, and every refusal is an HTTP status with a line of text."""

from __future__ import annotations

import asyncio
import re
from fractions import Fraction

import aiohttp
import aioice.ice
import av
import numpy as np
import pytest
from aiortc import RTCPeerConnection, RTCRtpSender, RTCSessionDescription, VideoStreamTrack

from streamsvc.inputs.frames import InputFrames
from streamsvc.wire.rtc import WebRtcConfig
from tests.client.servers import running

pytestmark = pytest.mark.slow
SDP = {"Content-Type": "application/sdp"}


@pytest.fixture(autouse=True)
def loopback_candidates(monkeypatch):
    monkeypatch.setattr(aioice.ice, "get_host_addresses", lambda use_ipv4, use_ipv6: ["127.0.0.1"])


class Camera(VideoStreamTrack):
    """A 320x240 camera at 30 fps whose colour changes every frame."""

    def __init__(self) -> None:
        super().__init__()
        self.sent = 0

    async def recv(self) -> av.VideoFrame:
        pts, time_base = await self.next_timestamp()
        image = np.full((240, 320, 3), (self.sent * 7) % 256, np.uint8)
        frame = av.VideoFrame.from_ndarray(image, format="rgb24")
        frame.pts, frame.time_base = pts, time_base
        self.sent += 1
        return frame


async def publisher_offer(pc: RTCPeerConnection, codec: str, direction: str = "sendonly") -> str:
    transceiver = pc.addTransceiver(Camera() if direction != "recvonly" else "video", direction=direction)
    codecs = [c for c in RTCRtpSender.getCapabilities("video").codecs if c.mimeType.lower() == f"video/{codec}"]
    transceiver.setCodecPreferences(codecs)
    await pc.setLocalDescription(await pc.createOffer())
    return pc.localDescription.sdp


async def until(check, seconds: float) -> bool:
    for _ in range(int(seconds / 0.05)):
        if check():
            return True
        await asyncio.sleep(0.05)
    return check()


async def test_an_aiortc_whip_publisher_feeds_the_streams_input():
    async with running(webrtc=WebRtcConfig(ice_addresses=("127.0.0.1",))) as server, aiohttp.ClientSession() as http:
        base = f"http://127.0.0.1:{server.port}"
        viewer = RTCPeerConnection()
        viewer.addTransceiver("video", direction="recvonly")
        await viewer.setLocalDescription(await viewer.createOffer())
        async with http.post(f"{base}/whep?prompt=a+red+ball&input=1", data=viewer.localDescription.sdp,
                             headers=SDP) as r:
            assert r.status == 201, await r.text()
            stream_id, steer, watch = r.headers["X-Stream-Id"], r.headers["X-Steer-Secret"], r.headers["X-Watch-Secret"]
            await viewer.setRemoteDescription(RTCSessionDescription(await r.text(), "answer"))
        session = server.sessions[stream_id]
        if getattr(session, "input", None) is None:  # the server's start with input (issue 35) not in this tree yet
            gen = server.engine.gen
            session.input = InputFrames(gen.model_cfg.width, gen.model_cfg.height, session.fps)
        pcs = []
        try:
            for codec in ("H264", "VP8"):
                pc = RTCPeerConnection()
                pcs.append(pc)
                offer = await publisher_offer(pc, codec)
                for secret, expected in ((watch, 403), ("not-the-secret-at-all-xx", 404), (None, 404)):
                    query = f"?secret={secret}" if secret else ""
                    async with http.post(f"{base}/whip/{stream_id}{query}", data=offer, headers=SDP) as r:
                        assert r.status == expected, await r.text()
                async with http.post(f"{base}/whip/s999?secret={steer}", data=offer, headers=SDP) as r:
                    assert r.status == 404
                received = session.input.stats()["received"]
                async with http.post(f"{base}/whip/{stream_id}?secret={steer}", data=offer, headers=SDP) as r:
                    assert r.status == 201, await r.text()
                    location, answer = r.headers["Location"], await r.text()
                assert location.startswith("/whip/session/") and len(location.rsplit("/", 1)[1]) >= 22
                assert re.search(rf"a=rtpmap:\d+ {codec}/90000", answer) and "a=recvonly" in answer
                assert "a=setup:passive" in answer  # the server is the DTLS server (GStreamer's DTLS needs it)
                await pc.setRemoteDescription(RTCSessionDescription(answer, "answer"))
                assert await until(lambda: session.input.stats()["received"] >= received + 30, 20), \
                    session.input.stats()
                async with http.post(f"{base}/whip/{stream_id}?secret={steer}", data=offer, headers=SDP) as r:
                    assert r.status == 409, await r.text()  # one publisher at a time
                async with http.delete(base + location) as r:
                    assert r.status == 200
                assert await until(lambda: not server.whep.whip.publishers, 5)
                assert [s.kind for s in server.whep.sessions.values()] == ["whep"]  # the viewer's alone
                async with http.delete(base + location) as r:
                    assert r.status == 404

            pc = RTCPeerConnection()
            pcs.append(pc)
            recvonly = await publisher_offer(pc, "H264", direction="recvonly")
            async with http.post(f"{base}/whip/{stream_id}?secret={steer}", data=recvonly, headers=SDP) as r:
                assert r.status == 400 and "must be sendonly" in await r.text()
            unknown = re.sub(r"(a=rtpmap:\d+ )H264/", r"\1AV1/", offer.replace("VP8/", "AV1/"))
            async with http.post(f"{base}/whip/{stream_id}?secret={steer}", data=unknown, headers=SDP) as r:
                assert 400 <= r.status < 500 and "Traceback" not in await r.text()
            assert stream_id in server.sessions  # the stream went on through all of it
        finally:
            for pc in pcs + [viewer]:
                await pc.close()


def test_the_input_guard_drops_frames_over_the_rate_and_refuses_large_ones():
    from types import SimpleNamespace

    from streamsvc.door.whip import InputGuard

    pushed = []
    sink = SimpleNamespace(push_av=lambda frame, capture_s: pushed.append(capture_s), decode_error=lambda: None)
    t = [0.0]
    guard = InputGuard(sink, now=lambda: t[0], max_pixels=640 * 480, max_fps=10)
    small = SimpleNamespace(width=640, height=480)
    for i in range(30):  # 30 frames in 1 s: the burst of 10, and 10 more as the bucket refills
        t[0] = i / 30
        guard.push_av(small, t[0])
    assert len(pushed) == 10 + 9 and guard.dropped == 11 and guard.refused is None
    guard.push_av(SimpleNamespace(width=641, height=480), 2.0)
    assert guard.refused is not None and "641x480" in guard.refused
    t[0] = 100.0
    guard.push_av(small, 100.0)  # nothing after a refusal
    assert len(pushed) == 19


class BigCamera(Camera):
    async def recv(self) -> av.VideoFrame:
        pts, time_base = await self.next_timestamp()
        frame = av.VideoFrame.from_ndarray(np.zeros((1088, 1936, 3), np.uint8), format="rgb24")
        frame.pts, frame.time_base = pts, time_base
        return frame


async def test_a_publisher_over_1920x1080_loses_its_session():
    async with running(webrtc=WebRtcConfig(ice_addresses=("127.0.0.1",))) as server, aiohttp.ClientSession() as http:
        base = f"http://127.0.0.1:{server.port}"
        viewer = RTCPeerConnection()
        viewer.addTransceiver("video", direction="recvonly")
        await viewer.setLocalDescription(await viewer.createOffer())
        async with http.post(f"{base}/whep?prompt=a+ball&input=1", data=viewer.localDescription.sdp, headers=SDP) as r:
            assert r.status == 201, await r.text()
            stream_id, steer = r.headers["X-Stream-Id"], r.headers["X-Steer-Secret"]
        session = server.sessions[stream_id]
        if getattr(session, "input", None) is None:
            session.input = InputFrames(128, 128, session.fps)
        pc = RTCPeerConnection()
        try:
            pc.addTransceiver(BigCamera(), direction="sendonly")
            await pc.setLocalDescription(await pc.createOffer())
            async with http.post(f"{base}/whip/{stream_id}?secret={steer}", data=pc.localDescription.sdp,
                                 headers=SDP) as r:
                assert r.status == 201, await r.text()
                await pc.setRemoteDescription(RTCSessionDescription(await r.text(), "answer"))
            assert await until(lambda: stream_id in server.whep.whip.publishers, 2)
            assert await until(lambda: not server.whep.whip.publishers, 30)  # refused at its first frame
            assert session.input.stats()["received"] == 0 and stream_id in server.sessions  # the stream goes on
        finally:
            await pc.close()
            await viewer.close()


class EncodedCamera(VideoStreamTrack):
    """A sender of encoded frames (aiortc packetizes an av.Packet as it is): `frames` once, then nothing more."""

    def __init__(self, frames: list[bytes]) -> None:
        super().__init__()
        self.frames = frames
        self.sent = 0

    async def recv(self) -> av.Packet:
        if self.sent >= len(self.frames):
            await asyncio.Event().wait()  # no next frame, ever: a refusal must not wait for one
        packet = av.Packet(self.frames[self.sent])
        packet.pts, packet.time_base = 3000 * self.sent, Fraction(1, 90_000)
        self.sent += 1
        return packet


def vp8_key_frame(width: int, height: int) -> bytes:
    """A real 64x48 VP8 key frame whose header declares width x height (RFC 6386 9.1: 14 bits each, LE)."""
    codec = av.CodecContext.create("libvpx", "w")
    codec.width, codec.height, codec.pix_fmt, codec.time_base = 64, 48, "yuv420p", Fraction(1, 30)
    frame = av.VideoFrame.from_ndarray(np.zeros((48, 64, 3), np.uint8), format="rgb24")
    frame.pts = 0
    data = bytearray(b"".join(bytes(p) for p in codec.encode(frame) + codec.encode(None)))
    assert data[3:6] == b"\x9d\x01\x2a"
    data[6:10] = width.to_bytes(2, "little") + height.to_bytes(2, "little")
    return bytes(data)


@pytest.mark.parametrize("codec", ["H264", "VP8"])
async def test_a_frame_that_declares_8192x4096_ends_the_session_on_that_frame_undecoded(codec):
    from streamsvc.inputs.bitstream import with_size
    from tests.streamsvc.test_bitstream import sps_of, x264

    if codec == "H264":
        idr = x264(64, 48, 1)[0]
        bomb = idr.replace(sps_of(idr), with_size(sps_of(idr), 8192, 4096))
    else:
        bomb = vp8_key_frame(8192, 4096)
    async with running(webrtc=WebRtcConfig(ice_addresses=("127.0.0.1",))) as server, aiohttp.ClientSession() as http:
        base = f"http://127.0.0.1:{server.port}"
        async with http.post(f"{base}/whep?prompt=a+ball&input=1", data=await recvonly_offer(), headers=SDP) as r:
            assert r.status == 201, await r.text()
            stream_id, steer = r.headers["X-Stream-Id"], r.headers["X-Steer-Secret"]
        session = server.sessions[stream_id]
        pc = RTCPeerConnection()
        try:
            camera = EncodedCamera([bomb])
            transceiver = pc.addTransceiver(camera, direction="sendonly")
            transceiver.setCodecPreferences([c for c in RTCRtpSender.getCapabilities("video").codecs
                                             if c.mimeType.lower() == f"video/{codec.lower()}"])
            await pc.setLocalDescription(await pc.createOffer())
            async with http.post(f"{base}/whip/{stream_id}?secret={steer}", data=pc.localDescription.sdp,
                                 headers=SDP) as r:
                assert r.status == 201, await r.text()
                await pc.setRemoteDescription(RTCSessionDescription(await r.text(), "answer"))
            publisher = server.whep.whip.publishers[stream_id]
            # the one frame it ever sends ends it: before, the refusal waited for a next frame that never came
            assert await until(lambda: not server.whep.whip.publishers, 15)
            assert camera.sent == 1 and "8192x4096" in publisher.refused and "1920x1080" in publisher.refused
            assert publisher.stats.frames == 0  # aiortc's decoder never saw it
            assert session.input.stats()["received"] == 0 and stream_id in server.sessions  # the stream goes on
        finally:
            await pc.close()


async def recvonly_offer() -> str:
    viewer = RTCPeerConnection()
    viewer.addTransceiver("video", direction="recvonly")
    await viewer.setLocalDescription(await viewer.createOffer())
    sdp = viewer.localDescription.sdp
    await viewer.close()
    return sdp
