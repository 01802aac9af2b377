"""WebRTC transport: the paced track, ICE on loopback, and a Python client against the server over loopback."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from fractions import Fraction
from types import SimpleNamespace

import av
import pytest
from aiortc import RTCPeerConnection, RTCRtpSender
from aiortc.rtp import RTCP_PSFB_PLI, RtcpPsfbPacket
from websockets.asyncio.client import connect

from client.playback import PlaybackBuffer
from client.viewer import ClientConfig
from client.webrtc_client import WebRtcClient, default_ice_addresses
from streamsvc.engine.config import EngineConfig
from streamsvc.transport.track import PacketTrack
from streamsvc.transport.webrtc import WebRtcTransport
from streamsvc.viewers.server import Server, ServerConfig
from streamsvc.viewers.session import SessionState
from streamsvc.wire import protocol as P
from streamsvc.wire.rtc import IceServer, WebRtcConfig, complete_local_description, gather_on, h264_preferences

LOOPBACK = ("127.0.0.1",)
CANDIDATE = re.compile(r"^a=candidate:\S+ \d+ \S+ \d+ (\S+) \d+ typ (\S+)", re.M)


def candidates(sdp: str) -> list[tuple[str, str]]:
    """(address, type) of every ICE candidate in an SDP."""
    return CANDIDATE.findall(sdp)


@contextlib.asynccontextmanager
async def running_server(**engine):
    server = Server(EngineConfig(**engine), ServerConfig(port=0, webrtc=WebRtcConfig(ice_addresses=LOOPBACK)))
    await server.start()
    try:
        yield server
    finally:
        await asyncio.wait_for(server.stop(), 30)


def url_of(server: Server) -> str:
    return f"ws://127.0.0.1:{server.port}/ws"


# ---------------------------------------------------------------- pieces


def test_config_validation_and_ice_servers():
    assert IceServer.parse("stun:stun.example.org:3478") == IceServer("stun:stun.example.org:3478")
    assert IceServer.parse("turn:t.example.org:3478,u,p") == IceServer("turn:t.example.org:3478", "u", "p")
    with pytest.raises(ValueError, match="needs a username"):
        IceServer.parse("turn:t.example.org:3478")
    with pytest.raises(ValueError, match="must start with stun"):
        IceServer.parse("http://x")
    with pytest.raises(ValueError, match="not an IP address"):
        WebRtcConfig(ice_addresses=("localhost",))
    with pytest.raises(ValueError, match="empty"):
        WebRtcConfig(ice_addresses=())
    assert default_ice_addresses("ws://127.0.0.1:8000/ws") == ("127.0.0.1",)
    assert default_ice_addresses("ws://localhost:8000/ws") == ("127.0.0.1",)
    assert default_ice_addresses("ws://10.1.2.3:8000/ws") is None


def test_h264_preferences_match_the_encoder():
    prefs = h264_preferences()
    h264 = [c for c in prefs if c.mimeType == "video/H264"]
    assert len(h264) == 1
    assert h264[0].parameters["profile-level-id"] == "42e01f"
    assert h264[0].parameters["packetization-mode"] == "1"
    assert {c.mimeType for c in prefs} == {"video/H264", "video/rtx"}


async def test_gather_on_loopback_only():
    pc = RTCPeerConnection()
    try:
        pc.createDataChannel("control")
        sdp = await complete_local_description(pc, await pc.createOffer(), LOOPBACK, 10)
    finally:
        await pc.close()
    found = candidates(sdp)
    assert found and all(addr == "127.0.0.1" and kind == "host" for addr, kind in found), found


async def test_gather_on_is_scoped_to_its_block():
    import aioice.ice

    with gather_on(LOOPBACK):
        assert aioice.ice.get_host_addresses(True, True) == ["127.0.0.1"]
    assert "127.0.0.1" not in aioice.ice.get_host_addresses(True, False)  # aioice's own choice again


def test_a_server_on_loopback_offers_loopback_too():
    from streamsvc.wire.rtc import server_ice_addresses

    assert server_ice_addresses("127.0.0.1", None) == ("*", "127.0.0.1")
    assert server_ice_addresses("localhost", None) == ("*", "127.0.0.1")
    assert server_ice_addresses("::1", None) == ("*", "::1")
    assert server_ice_addresses("0.0.0.0", None) is None and server_ice_addresses("10.1.2.3", None) is None
    assert server_ice_addresses("127.0.0.1", ("10.0.0.5",)) == ("10.0.0.5",)  # what was asked for wins
    WebRtcConfig(ice_addresses=("*", "127.0.0.1"))  # "*" is a valid entry


async def test_gather_on_any_interface_and_loopback():
    import aioice.ice

    own = aioice.ice.get_host_addresses(True, False)
    with gather_on(("*", "127.0.0.1")):
        assert aioice.ice.get_host_addresses(True, False) == own + ["127.0.0.1"]


def _packets(n: int, start: int, fps: int) -> list[av.Packet]:
    out = []
    for i in range(start, start + n):
        p = av.Packet(b"\x00\x00\x00\x01\x65" + bytes([i % 256]) * 8)
        p.pts = p.dts = i * 90000 // fps
        p.time_base = Fraction(1, 90000)
        out.append(p)
    return out


def _header(index: int, pts: int, n: int, version: int = 0) -> P.Chunk:
    return P.Chunk(index=index, pts=pts, frames=n, prompt_version=version, steps=4, keyframe=index == 0,
                   sizes=[13] * n)


async def test_track_paces_reports_and_stalls():
    fps = 20
    loop = asyncio.get_running_loop()
    frames, queued, stalls = [], [], []
    track = PacketTrack(fps, on_frame=lambda h, q: frames.append((h, q, loop.time())),
                        on_queue=queued.append, on_stall=lambda: stalls.append(loop.time()), clock=loop.time)
    track.push(_packets(4, 0, fps), _header(0, 0, 4))
    assert queued == [4]
    sent = [await track.recv() for _ in range(4)]
    assert [p.pts for p in sent] == [0, 4500, 9000, 13500]
    assert [h.index if h else None for h, _, _ in frames] == [0, None, None, None]  # header with the first frame
    assert [q for _, q, _ in frames] == [3, 2, 1, 0]  # the queue the scheduler sees
    gaps = [b[2] - a[2] for a, b in zip(frames, frames[1:])]
    assert all(0.045 <= g <= 0.09 for g in gaps), gaps  # paced at 1/fps
    # the queue is empty at the next due time: a stall, then the late frame goes at once
    later = loop.call_later(0.2, track.push, _packets(2, 4, fps), _header(1, 4, 2, version=1))
    t0 = loop.time()
    packet = await asyncio.wait_for(track.recv(), 2)
    assert packet.pts == 4 * 90000 // fps and loop.time() - t0 >= 0.15
    assert track.stalls == 1 and len(stalls) == 1 and track.stall_s >= 0.1
    assert frames[-1][0].prompt_version == 1
    later.cancel()
    track.stop()
    with pytest.raises(Exception):
        await track.recv()


async def test_the_track_reports_its_queue_with_the_viewers_grace():
    """The scheduler plans on the track's queue; a dry queue is a stall only past the frame on the wire and the
    viewer's jitter buffer (WebRtcConfig.viewer_jitter_s)."""
    reports = []

    class Engine:
        def observe_buffer(self, stream_id, frames, grace_s=0.0):
            reports.append((stream_id, frames, grace_s))

    session = SimpleNamespace(stream_id="s1", fps=16, state=SessionState.PLAYING, outbox=asyncio.Queue())
    config = WebRtcConfig(ice_addresses=LOOPBACK, channel_wait_s=0.01, viewer_jitter_s=0.08)
    transport = WebRtcTransport(session, Engine(), config, on_control=lambda m: None, on_lost=lambda r: None)
    transport.track.push(_packets(2, 0, 16), _header(0, 0, 2))
    await transport.track.recv()
    await transport.track.recv()
    assert [(sid, frames) for sid, frames, _ in reports] == [("s1", 2.0), ("s1", 1.0), ("s1", 0.0)]
    assert all(grace == pytest.approx(1 / 16 + 0.08) for _, _, grace in reports)
    assert (await session.outbox.get()).index == 0  # no data channel: the chunk's header went on the WebSocket
    await transport.close()
    with pytest.raises(ValueError, match="viewer_jitter_s"):
        WebRtcConfig(viewer_jitter_s=-0.1)


async def test_track_holds_frames_while_paused():
    fps = 50
    paused = True
    loop = asyncio.get_running_loop()
    track = PacketTrack(fps, is_paused=lambda: paused, clock=loop.time)
    track.push(_packets(2, 0, fps), _header(0, 0, 2))
    recv = asyncio.ensure_future(track.recv())
    await asyncio.sleep(0.3)
    assert not recv.done()
    paused = False
    assert (await asyncio.wait_for(recv, 2)).pts == 0
    assert track.stalls == 0  # a pause is no stall
    track.stop()


# ---------------------------------------------------------------- client <-> server over loopback


@pytest.mark.slow
async def test_python_client_plays_steers_and_frees_the_stream():
    async with running_server() as server:
        client = WebRtcClient(url_of(server), ClientConfig(prompt="a lighthouse in a storm", seed=1))
        assert await client.open(), client.errors
        try:
            sid = client.ready.stream_id
            rtc = server.sessions[sid].steerer.rtc
            # SDP: H.264 only, every candidate on loopback, both ways
            answer = client._pc.remoteDescription.sdp
            assert "H264/90000" in answer and "VP8" not in answer
            assert "profile-level-id=42e01f" in answer
            for sdp in (answer, client._pc.localDescription.sdp):
                assert candidates(sdp) and all(a == "127.0.0.1" for a, _ in candidates(sdp)), candidates(sdp)

            assert await client.wait_until(lambda: client.frames_decoded >= 24, 15), client.errors
            assert client.bad_frames == 0
            assert client.channel_open and client.channel_messages >= 2  # chunk headers came on the data channel
            assert [h.index for h in client.headers] == list(range(len(client.headers)))
            assert client.headers[0].keyframe and client.headers[0].pts == 0
            assert client.ready.steps == 4 and all(1 <= h.steps <= 4 for h in client.headers)  # steps on both transports
            assert rtc.track.frames_sent >= 24 and rtc.channel is not None

            # steer: the ack and then frames of the new version
            await client.set_prompt("a red fox running through snow")
            assert await client.wait_until(lambda: 1 in client.versions_played, 15), (client.versions_played, client.errors)
            assert ("set_prompt", 1) in [(a.request, a.prompt_version) for a in client.acks]
            assert await client.wait_until(lambda: client.stats().control_latencies_s, 5)

            # an RTCP PLI from the viewer becomes a keyframe request: a later chunk starts with an IDR
            sender = rtc.pc.getSenders()[0]
            seen = len(client.headers)
            await sender._handle_rtcp_packet(RtcpPsfbPacket(fmt=RTCP_PSFB_PLI, ssrc=1, media_ssrc=sender._ssrc))
            assert rtc.keyframe_requests == 1
            assert await client.wait_until(lambda: any(h.keyframe for h in client.headers[seen:]), 10)

            assert server.engine.stats().kv_used_bytes > 0
            rtc.track._on_stall()  # what the track calls when a frame is due and none is queued
            assert server.metrics.registry.get_sample_value("streamsvc_webrtc_track_stalls_total") == 1
        finally:
            await client.close()
        result = client.result()
        assert result.admitted and result.closed_reason == "closed by client" and not result.errors, result.errors
        assert result.playback.stalls == 0 and result.playback.ttff_s < 3
        # closing freed the stream: KV pool, session and peer connection
        for _ in range(100):
            if server.engine.stats().kv_used_bytes == 0 and not server.webrtc and not server.sessions:
                break
            await asyncio.sleep(0.05)
        assert server.engine.stats().kv_used_bytes == 0 and not server.webrtc and not server.sessions


@pytest.mark.slow
async def test_dropped_peer_connection_ends_the_stream():
    async with running_server() as server:
        client = WebRtcClient(url_of(server), ClientConfig(prompt="waves on a shore"))
        assert await client.open(), client.errors
        assert await client.wait_until(lambda: client.frames_decoded >= 5, 15)
        await client._pc.close()  # the viewer's side goes away without a word on the WebSocket
        assert await client.wait_until(lambda: client.closed_reason is not None, 10)
        assert "WebRTC connection" in client.closed_reason
        await client.close()
        for _ in range(100):
            if server.engine.stats().kv_used_bytes == 0 and not server.sessions:
                break
            await asyncio.sleep(0.05)
        assert server.engine.stats().kv_used_bytes == 0 and not server.sessions


async def _recv_type(ws, type_: str, timeout: float = 10.0) -> dict:
    async with asyncio.timeout(timeout):
        while True:
            msg = json.loads(await ws.recv())
            if msg["type"] == type_:
                return msg


@pytest.mark.slow
async def test_signaling_errors_are_clear_and_the_stream_goes_on():
    async with running_server() as server:
        async with connect(url_of(server)) as ws:  # an offer on a ws-transport stream
            await ws.send(P.encode(P.Start(prompt="a cat")))
            await _recv_type(ws, "ready")
            await ws.send(P.encode(P.Offer(sdp="v=0\r\n")))
            err = await _recv_type(ws, "error")
            assert err["code"] == "invalid_field" and "transport 'webrtc'" in err["message"]

        async with connect(url_of(server)) as ws:  # a VP8-only offer on a webrtc stream
            await ws.send(P.encode(P.Start(prompt="a cat", transport="webrtc")))
            await _recv_type(ws, "ready")
            pc = RTCPeerConnection()
            try:
                t = pc.addTransceiver("video", direction="recvonly")
                t.setCodecPreferences([c for c in RTCRtpSender.getCapabilities("video").codecs
                                       if c.mimeType == "video/VP8"])
                sdp = await complete_local_description(pc, await pc.createOffer(), LOOPBACK, 10)
            finally:
                await pc.close()
            await ws.send(P.encode(P.Offer(sdp=sdp)))
            err = await _recv_type(ws, "error")
            assert err["code"] == "invalid_field" and "H.264" in err["message"], err
            await ws.send(P.encode(P.SetPrompt(prompt="a dog")))  # the stream goes on
            ack = await _recv_type(ws, "ack")
            assert ack["prompt_version"] == 1


class _Frame:
    """What the client reads of a decoded frame."""

    def __init__(self, index: int, fps: int, size: int = 128) -> None:
        self.pts = index * 90000 // fps  # aiortc counts from the first packet, which is frame 0
        self.width = self.height = size


async def test_client_playout_delay_and_one_stall_per_late_frame():
    """On a manual clock (no sleeps: the test asserts what the client does, not how fast this host runs it): the
    first frames wait out the playout delay; a gap longer than the buffer is one stall, refilled by the playout
    delay, not one stall per late frame after it."""
    from tests.clock import ManualClock

    fps, delay = 20, 0.1
    clock = ManualClock(0.0)
    client = WebRtcClient("ws://127.0.0.1:1/ws", ClientConfig(prompt="x"), playout_delay_s=delay, clock=clock)
    client.ready = P.Ready(stream_id="s0", fps=fps, width=128, height=128, first_chunk_frames=60, chunk_frames=60,
                           prompt_version=0, steps=4)
    client._connected_at = clock()
    client._buffer = PlaybackBuffer(fps)
    client._buffer.connect(client._connected_at)
    client.headers = [_header(0, 0, 60, version=0), _header(1, 60, 60, version=1)]
    timers: list[tuple[float, object]] = []  # the client's call_later, due on the manual clock
    loop = asyncio.get_running_loop()
    loop.call_later = lambda delay_s, callback: timers.append((clock() + delay_s, callback))

    def advance(to: float) -> None:
        """Time moves to `to`: each timer due by then fires at its own due time, in order."""
        while timers and min(timers, key=lambda t: t[0])[0] <= to:
            due, callback = min(timers, key=lambda t: t[0])
            timers.remove((due, callback))
            clock.now = max(clock.now, due)
            callback()
            client._buffer.advance(clock())
        clock.now = max(clock.now, to)
        client._buffer.advance(clock())

    t = 0.0

    def frames(indices, jitter_s=0.0):
        """Frames at fps from `t`; odd ones `jitter_s` late (jitter, not drift)."""
        nonlocal t
        for k, i in enumerate(indices):
            advance(t + k / fps + (jitter_s if k % 2 else 0.0))
            client._on_frame(_Frame(i, fps))
            client._buffer.advance(clock())
        t += len(indices) / fps

    try:
        frames(range(0, 3))
        advance(t)
        assert client.stats().ttff_s == pytest.approx(delay)  # the first frame waited out the playout delay
        frames(range(3, 20))
        assert client.stats().stalls == 0
        t += 0.3  # the server stalled: frames stop for longer than the buffer lasts
        frames(range(20, 70), jitter_s=0.01)  # then on time again, with some jitter
        stats = client.stats()
        assert stats.stalls == 1, client.stall_events  # one stall, refilled by the playout delay, not one per frame
        assert client.stall_events[0][1] >= delay  # the rebuffer counts as stall time
        assert client.versions_played == [0, 1]
        assert client.frames_decoded == 70 and client.bad_frames == 0
    finally:
        del loop.call_later


async def test_a_cut_drops_the_tracks_queue_and_its_timestamps_stay_continuous():
    """A new prompt's first chunk (header `cut`) drops the frames the track still holds; the packets after it go out
    earlier in pts by what was dropped (copies: a stream's packets are every viewer's)."""
    fps, headers = 20, []
    track = PacketTrack(fps, on_frame=lambda h, q: headers.append(h), clock=asyncio.get_running_loop().time)
    track.push(_packets(4, 0, fps), _header(0, 0, 4))
    first = await track.recv()
    assert first.pts == 0 and track.frames_queued == 3
    new = _packets(4, 4, fps)
    for p in new:
        p.duration = 90000 // fps
    track.push(new, P.Chunk(**{**_header(1, 4, 4, version=1).model_dump(), "cut": True, "keyframe": True}))
    assert track.frames_queued == 4  # the 3 older frames dropped
    sent = [await asyncio.wait_for(track.recv(), 2) for _ in range(4)]
    assert [p.pts for p in sent] == [4500, 9000, 13500, 18000]  # continuous after frame 0
    assert [p.pts for p in new] == [18000, 22500, 27000, 31500]  # the stream's own packets untouched
    assert bytes(sent[0]) == bytes(new[0])
    assert [h.pts for h in headers if h is not None] == [0, 1]  # the cut chunk's header moved with its first frame
    track.stop()
