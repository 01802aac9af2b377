"""WebRTC input that cannot be abused (issue 33, items 6 and 7): the offer's checks, its ICE candidates, and the
data channel's bounds, on aiortc peers over loopback (no STUN, no network)."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import re
from types import SimpleNamespace

import pytest
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from aiortc.rtcconfiguration import RTCBundlePolicy

from streamsvc.door.access import ProtocolErrors
from streamsvc.transport import webrtc as webrtc_module
from streamsvc.transport.datachannel import DataChannelLimits, ReassemblyGuard
from streamsvc.transport.sdp import MAX_MEDIA, check_offer, reject_media
from streamsvc.transport.webrtc import WebRtcTransport
from streamsvc.viewers.session import SessionState
from streamsvc.wire import protocol as P
from streamsvc.wire.rtc import (
    CONTROL_CHANNEL,
    SignalingError,
    WebRtcConfig,
    complete_local_description,
    h264_preferences,
    rtc_configuration,
)

LOOPBACK = ("127.0.0.1",)
CANDIDATE = re.compile(r"^a=candidate:\S+ \d+ \S+ \d+ (\S+) (\d+) typ \S+", re.M)


# ---------------------------------------------------------------- helpers


async def _client_offer(*, audio: str | None = None, bundle_policy=None, channel_ordered: bool = True):
    """An aiortc viewer: (pc, its control channel, its complete offer). `audio`: "first" or "last" adds a
    microphone m-line before or after the video."""
    config = rtc_configuration()
    if bundle_policy is not None:
        config = RTCConfiguration(iceServers=[], bundlePolicy=bundle_policy)
    pc = RTCPeerConnection(config)
    if audio == "first":
        pc.addTransceiver("audio", direction="sendrecv")
    video = pc.addTransceiver("video", direction="recvonly")
    video.setCodecPreferences(h264_preferences())
    if audio == "last":
        pc.addTransceiver("audio", direction="sendrecv")
    channel = pc.createDataChannel(CONTROL_CHANNEL, ordered=channel_ordered)
    sdp = await complete_local_description(pc, await pc.createOffer(), LOOPBACK, 10)
    return pc, channel, sdp


class _Engine:
    def __init__(self) -> None:
        self.keyframes = 0

    def observe_buffer(self, stream_id, frames, grace_s=0.0) -> None:
        pass

    def request_keyframe(self, stream_id) -> None:
        self.keyframes += 1


def _transport(*, protocol_errors: ProtocolErrors | None = None, limits: DataChannelLimits | None = None,
               block: asyncio.Event | None = None, on_backlog=lambda: None, **config):
    """The server's side of one viewer, with no server around it: (transport, controls received, reasons lost)."""
    controls: list = []
    lost: list[str] = []

    async def on_control(msg) -> None:
        controls.append(msg)
        if block is not None:
            await block.wait()

    async def on_lost(reason: str) -> None:
        lost.append(reason)

    session = SimpleNamespace(stream_id="s1", fps=16, state=SessionState.PLAYING, outbox=asyncio.Queue(),
                              closed=False, buffer_report=lambda seconds: None)
    kwargs = {} if limits is None else {"limits": limits}
    transport = WebRtcTransport(session, _Engine(), WebRtcConfig(ice_addresses=LOOPBACK, **config),
                                on_control=on_control, on_lost=on_lost, on_backlog=on_backlog,
                                protocol_errors=protocol_errors, **kwargs)
    return transport, controls, lost


async def _until(condition, timeout_s: float = 10.0) -> bool:
    for _ in range(int(timeout_s / 0.02)):
        if condition():
            return True
        await asyncio.sleep(0.02)
    return condition()


@contextlib.asynccontextmanager
async def _connected(**kwargs):
    """A transport and an aiortc viewer connected on loopback, its control channel open on both sides."""
    transport, controls, lost = _transport(**kwargs)
    pc, channel, offer = await _client_offer()
    try:
        answer = await transport.answer(offer)
        await pc.setRemoteDescription(RTCSessionDescription(sdp=answer, type="answer"))
        assert await _until(lambda: channel.readyState == "open" and transport.channel is not None), "no channel"
        yield SimpleNamespace(transport=transport, controls=controls, lost=lost, pc=pc, channel=channel,
                              answer=answer)
    finally:
        await pc.close()
        await transport.close()


def _unbounded_send(pc) -> None:
    """Let the viewer's aiortc send past the max-message-size the server advertised (as a hostile peer would)."""
    pc.sctp._remote_max_message_size = 0


async def _drained(pc, timeout_s: float = 20.0) -> bool:
    """Every chunk the viewer's SCTP queued has been sent and acknowledged."""
    sctp = pc.sctp
    return await _until(lambda: not sctp._data_channel_queue and not sctp._outbound_queue and not sctp._sent_queue,
                        timeout_s)


def _remote_candidates(transport: WebRtcTransport) -> list[str]:
    """The addresses the server's ICE agent was given to probe."""
    ice = transport.pc.getTransceivers()[0].receiver.transport.transport
    return [c.ip for c in ice.getRemoteCandidates()]


# ---------------------------------------------------------------- the offer (item 6)


def _flood_offer(real: str, m_lines: int) -> str:
    """`real` with minimal video m-lines added up to `m_lines` in all, each one that aiortc takes (ICE and DTLS
    from the session level, a codec, RTCP mux): the issue's offer (680 of them fit a message)."""
    more = m_lines - real.count("\nm=")
    session_end = real.index("\r\nm=") + 2
    shared = "".join(line + "\r\n" for line in real.split("\r\n")
                     if line.startswith(("a=ice-ufrag:", "a=ice-pwd:", "a=fingerprint:", "a=setup:")))
    shared = "".join(dict.fromkeys(shared.splitlines(keepends=True)))  # once each
    extra = "".join(f"m=video 9 RTP/AVP 96\r\na=mid:v{i}\r\na=recvonly\r\na=rtcp-mux\r\na=rtpmap:96 VP8/90000\r\n"
                    for i in range(more))
    return real[:session_end] + shared + real[session_end:] + extra


async def test_an_offer_of_890_m_lines_is_refused_before_aiortc_and_leaves_nothing_open(monkeypatch):
    made = []

    class Counted(RTCPeerConnection):
        def __init__(self, *args, **kwargs) -> None:
            made.append(self)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(webrtc_module, "RTCPeerConnection", Counted)
    pc, _, real = await _client_offer()
    await pc.close()
    offer = _flood_offer(real, 890)
    transport, _, lost = _transport()
    with pytest.raises(SignalingError, match="890 m-lines; this server takes at most 4"):
        await transport.answer(offer)
    assert transport.pc is None and made == [] and not lost  # no peer connection was ever made
    # the viewer may send a good offer next
    pc, channel, good = await _client_offer()
    try:
        await pc.setRemoteDescription(RTCSessionDescription(sdp=await transport.answer(good), type="answer"))
        assert len(made) == 1 and await _until(lambda: channel.readyState == "open")
    finally:
        await pc.close()
        await transport.close()
    assert made[0].connectionState == "closed"


@pytest.mark.slow
async def test_the_server_answers_an_offer_of_680_m_lines_with_invalid_field_and_the_stream_goes_on(monkeypatch):
    from websockets.asyncio.client import connect

    from tests.streamsvc.test_webrtc import _recv_type, running_server, url_of

    monkeypatch.setattr(webrtc_module, "DEFAULT_MAX_PROTOCOL_ERRORS", 999)  # what a transport has of its own

    async with running_server() as server, connect(url_of(server)) as ws:
        await ws.send(P.encode(P.Start(prompt="a cat", transport="webrtc")))
        ready = await _recv_type(ws, "ready")
        rtc = server.webrtc[ready["viewer_id"]]
        assert rtc.errors.limit == server.config.access.max_protocol_errors  # --max-protocol-errors reaches it
        pc, channel, real = await _client_offer()
        try:
            flood = P.encode(P.Offer(sdp=_flood_offer(real, 680)))
            assert len(flood) <= P.MAX_MESSAGE_BYTES  # it passes the protocol's own size check
            await ws.send(flood)
            error = await _recv_type(ws, "error", 5)  # at once, not after the 20 s connect timeout
            assert error["code"] == "invalid_field" and "680 m-lines" in error["message"], error
            assert rtc.pc is None and not rtc._tasks  # nothing was opened
            await ws.send(P.encode(P.Offer(sdp=real)))  # a good offer: answered, and the stream plays
            answer = await _recv_type(ws, "answer")
            await pc.setRemoteDescription(RTCSessionDescription(sdp=answer["sdp"], type="answer"))
            assert await _until(lambda: channel.readyState == "open" and rtc.track.frames_sent > 0, 15)
        finally:
            await pc.close()


async def test_offer_checks_say_what_to_change():
    pc, _, real = await _client_offer()
    await pc.close()
    assert check_offer(real, allow_loopback=True).sdp.replace("\r\n", "\n") == real.replace("\r\n", "\n")  # as it was
    video_at = real.index("m=video")
    cases = {
        "a 'text' m-line": real + "m=text 9 UDP/TLS/RTP/SAVPF 96\r\na=mid:t\r\n",
        "2 audio m-lines": real + "m=audio 9 UDP/TLS/RTP/SAVPF 0\r\na=mid:a\r\n" * 2,
        f"at most {MAX_MEDIA}": _flood_offer(real, MAX_MEDIA + 1),
        "characters; at most 1024": real + "a=x" + "y" * 2000 + "\r\n",
        "control character": real + "a=x\x00y\r\n",
        "not type=value": real + "junk\r\n",
        "must start with the line v=0": "o=- 1 1 IN IP4 0.0.0.0\r\n" + real,
        "no video m-line": real[:video_at],
        "is sendonly": real.replace("a=recvonly", "a=sendonly", 1),
        "offers RTX, VP8, and this server sends H.264 only": real.replace("H264/90000", "VP8/90000"),
        "AV1, RTX but no usable video codec": real.replace("H264/90000", "AV1/90000"),
    }
    for expected, offer in cases.items():
        with pytest.raises(SignalingError, match=re.escape(expected)):
            check_offer(offer)
    with pytest.raises(SignalingError, match="bytes; this server takes at most"):
        check_offer(real + ("a=x-filler:" + "y" * 1000 + "\r\n") * 70)


def _with_candidates(offer: str, lines: list[str]) -> str:
    """`offer` with `lines` added after the candidates of its first m-line."""
    first = offer.index("m=")
    end = offer.index("\r\nm=", first + 1) + 2 if "\r\nm=" in offer[first + 1:] else len(offer)
    return offer[:end] + "".join(f"{line}\r\n" for line in lines) + offer[end:]


def _thousand_candidates() -> list[str]:
    """1,000 candidates: 500 on 127.0.0.x, the rest on addresses never to probe."""
    bad = ["169.254.169.254", "169.254.1.2", "fe80::1", "fe80::2%eth0", "224.0.0.1", "ff02::1", "0.0.0.0", "::",
           "255.255.255.255", "240.0.0.1", "0.1.2.3", "::ffff:169.254.169.254"]
    lines = [f"a=candidate:{i} 1 udp {i} 127.0.0.{2 + i % 250} {10000 + i} typ host" for i in range(500)]
    lines += [f"a=candidate:b{i} 1 udp {i} {bad[i % len(bad)]} {20000 + i} typ host" for i in range(500)]
    return lines


def test_candidates_are_capped_and_never_link_local_multicast_or_unspecified():
    bare_offer = ("v=0\r\no=- 1 1 IN IP4 0.0.0.0\r\ns=-\r\nt=0 0\r\na=group:BUNDLE 0\r\n"
                     "m=video 9 UDP/TLS/RTP/SAVPF 96\r\na=mid:0\r\na=recvonly\r\na=rtpmap:96 H264/90000\r\n")
    extra = ["a=candidate:t 1 tcp 1 127.0.0.1 9 typ host tcptype active",
             "a=candidate:h 1 udp 1 example.org 9 typ host",
             "a=candidate:m 1 udp 1 0d7c6e3c-1e62-4d1c-bd0c-1b1b2c4c7e5e.local 9 typ host",
             "a=candidate:z 1 udp 1 10.0.0.1 0 typ host", "a=candidate:bad"]
    offer = check_offer(_with_candidates(bare_offer, _thousand_candidates() + extra), max_candidates=16,
                        allow_loopback=True)
    kept = CANDIDATE.findall(offer.sdp)
    assert offer.candidates == len(kept) == 16
    assert all(ipaddress.ip_address(a).is_loopback for a, _ in kept)
    assert offer.dropped["over the cap"] == 500 - 16
    assert offer.dropped["link-local"] == 4 * 42 + 41  # 169.254/16 (2 kinds), fe80::/10 (2), and IPv4-mapped
    for reason in ("multicast", "unspecified", "broadcast", "transport", "hostname", "mdns", "port", "malformed"):
        assert offer.dropped[reason] > 0, reason
    # on a server that does not gather on loopback itself, loopback is never probed either
    remote = check_offer(_with_candidates(bare_offer, _thousand_candidates()), max_candidates=16)
    assert remote.candidates == 0 and remote.dropped["loopback"] == 500


@pytest.mark.slow
async def test_1000_offered_candidates_keep_the_cap_and_the_loopback_connection_works():
    transport, _, _ = _transport(max_remote_candidates=16)
    pc, channel, real = await _client_offer()
    offer = _with_candidates(real, _thousand_candidates())  # the viewer's own 127.0.0.1 candidate comes first
    assert len(P.encode(P.Offer(sdp=offer))) <= P.MAX_MESSAGE_BYTES
    try:
        answer = await transport.answer(offer)
        probed = _remote_candidates(transport)
        assert 1 <= len(set(probed)) <= 16, probed
        for address in probed:
            ip = ipaddress.ip_address(address)
            assert not (ip.is_link_local or ip.is_multicast or ip.is_unspecified or ip.is_reserved), address
        assert transport.candidates_dropped >= 1000 - 16
        await pc.setRemoteDescription(RTCSessionDescription(sdp=answer, type="answer"))
        assert await _until(lambda: channel.readyState == "open" and transport.pc.connectionState == "connected")
    finally:
        await pc.close()
        await transport.close()


# ---------------------------------------------------------------- audio and other m-lines


def test_reject_media_sets_port_0_inactive_and_leaves_the_bundle():
    answer = ("v=0\r\na=group:BUNDLE 0 1 2\r\nm=audio 5000 UDP/TLS/RTP/SAVPF 111\r\na=mid:0\r\na=recvonly\r\n"
              "a=candidate:1 1 udp 1 127.0.0.1 5000 typ host\r\na=end-of-candidates\r\n"
              "m=video 5000 UDP/TLS/RTP/SAVPF 96\r\na=mid:1\r\na=sendonly\r\n"
              "a=candidate:1 1 udp 1 127.0.0.1 5000 typ host\r\n")
    out = reject_media(answer, {"0"})
    assert "a=group:BUNDLE 1 2\r\n" in out
    assert "m=audio 0 UDP/TLS/RTP/SAVPF 111\r\na=mid:0\r\na=inactive\r\nm=video 5000" in out
    assert out.count("a=candidate:") == 1 and "a=sendonly" in out
    assert reject_media(answer, set()) == answer


@pytest.mark.slow
@pytest.mark.parametrize("audio", ["last", "first"])
async def test_audio_is_accepted_but_nothing_is_received(audio):
    """aiortc answers an audio m-line recvonly and would decode what comes into a queue nobody reads: it is
    answered inactive instead, rejected (port 0, out of BUNDLE) unless it holds the BUNDLE tag."""
    transport, _, _ = _transport()
    pc, channel, offer = await _client_offer(audio=audio, bundle_policy=RTCBundlePolicy.MAX_BUNDLE)
    try:
        answer = await transport.answer(offer)
        audio_m = re.search(r"^m=audio (\d+) .*?(?=^m=|\Z)", answer, re.M | re.S)
        bundle = re.search(r"^a=group:BUNDLE (.*)$", answer, re.M).group(1).split()
        mic = next(t for t in transport.pc.getTransceivers() if t.kind == "audio")
        assert mic.currentDirection == "inactive" and "a=inactive" in audio_m.group(0)
        if audio == "last":
            assert audio_m.group(1) == "0" and mic.mid not in bundle
        else:  # the offerer's BUNDLE tag: its transport carries the others
            assert bundle[0] == mic.mid
        await pc.setRemoteDescription(RTCSessionDescription(sdp=answer, type="answer"))
        assert await _until(lambda: channel.readyState == "open" and transport.pc.connectionState == "connected")
        assert not mic.receiver._RTCRtpReceiver__started  # nothing the viewer sends is decoded
    finally:
        await pc.close()
        await transport.close()


# ---------------------------------------------------------------- the data channel (item 7)


def _sctp():
    """A real aiortc SCTP association, not connected: DATA chunks are fed to it directly."""
    from aiortc.rtcdtlstransport import RTCCertificate, RTCDtlsTransport
    from aiortc.rtcicetransport import RTCIceGatherer, RTCIceTransport
    from aiortc.rtcsctptransport import RTCSctpTransport

    dtls = RTCDtlsTransport(RTCIceTransport(RTCIceGatherer(iceServers=[])), [RTCCertificate.generateCertificate()])
    return RTCSctpTransport(dtls)


async def test_the_hooks_the_guard_needs_are_in_this_aiortc():
    sctp = _sctp()
    guard = ReassemblyGuard(DataChannelLimits(max_message_bytes=1000, max_held_bytes=2000))
    assert guard.install(sctp)
    assert sctp.getCapabilities().maxMessageSize == 1000
    assert type(sctp).getCapabilities().maxMessageSize > 1000  # other instances keep aiortc's own


_LAST, _FIRST, _UNORDERED = 0x01, 0x02, 0x04


class _Feed:
    """DATA chunks into a guarded association, as the network would hand them; what comes out whole."""

    def __init__(self, limits: DataChannelLimits) -> None:
        self.sctp = _sctp()
        self.reasons: list[str] = []
        self.guard = ReassemblyGuard(limits, on_refused=self.reasons.append)
        assert self.guard.install(self.sctp)
        self.sctp._last_received_tsn = 999  # as the INIT from the peer would set it: its first TSN is 1000
        self.delivered: list[tuple[int, bytes]] = []
        self.tsn = 1000

        async def receive(stream_id, pp_id, data):  # aiortc's hand-off to the data channels
            self.delivered.append((stream_id, data))

        self.sctp._receive = receive

    async def message(self, data: bytes, *, stream: int = 0, ssn: int = 0, fragment: int = 1000,
                      ordered: bool = True, end: bool = True, tsn: int | None = None) -> None:
        """One message in fragments of `fragment` bytes (`end`: the last one says it is the last)."""
        from aiortc.rtcsctptransport import DataChunk

        parts = [data[i:i + fragment] for i in range(0, len(data), fragment)] or [b""]
        for i, part in enumerate(parts):
            chunk = DataChunk()
            chunk.flags = (_FIRST if i == 0 else 0) | (_LAST if end and i == len(parts) - 1 else 0) | (
                0 if ordered else _UNORDERED)
            chunk.tsn, chunk.stream_id, chunk.stream_seq, chunk.protocol = (
                self.tsn if tsn is None else tsn, stream, ssn, 51)
            chunk.user_data = part
            if tsn is None:
                self.tsn += 1
            await self.sctp._receive_data_chunk(chunk)


async def test_the_guard_refuses_a_message_while_it_is_reassembled():
    limits = DataChannelLimits(max_message_bytes=3000, max_held_bytes=6000, max_held_chunks=20, max_streams=2,
                               tsn_window=50)
    feed = _Feed(limits)
    await feed.message(b"a" * 2500)
    assert feed.delivered == [(0, b"a" * 2500)]  # within the limit: whole
    await feed.message(b"b" * 100_000, ssn=1)  # 100 fragments: refused at the fourth, the rest skipped
    assert feed.guard.refused == 1 and feed.guard.dropped_chunks == 97 and feed.guard.held_peak <= 3000
    assert "more than 3000 bytes" in feed.reasons[0] and feed.guard.held() == (0, 0)
    await feed.message(b"c" * 10, ssn=2)  # the ordered stream goes on after the refused message
    assert feed.delivered[-1] == (0, b"c" * 10)
    # unordered: the same, and the stream goes on
    await feed.message(b"d" * 100_000, ordered=False)
    await feed.message(b"e" * 10, ordered=False)
    assert feed.guard.refused == 2 and feed.delivered[-1] == (0, b"e" * 10) and feed.guard.held() == (0, 0)
    # partial messages of two streams together: refused past max_held_bytes, and all of them discarded
    await feed.message(b"f" * 2900, ssn=3, end=False)
    await feed.message(b"g" * 2900, stream=1, end=False)
    assert feed.guard.refused == 2 and feed.guard.held() == (5800, 6)
    await feed.message(b"h" * 500, stream=1, ssn=1)
    assert feed.guard.refused == 3 and "partial messages of more than 6000 bytes" in feed.reasons[-1]
    assert feed.guard.held() == (0, 0) and feed.guard.held_peak <= 6000
    await feed.message(b"k", ssn=4)  # both streams skipped past what was discarded
    await feed.message(b"l", stream=1, ssn=2)
    assert feed.delivered[-2:] == [(0, b"k"), (1, b"l")]
    # a third stream past max_streams=2
    await feed.message(b"m", stream=5)
    assert feed.guard.refused == 4 and "more than 2 SCTP streams" in feed.reasons[-1]
    assert 5 not in feed.sctp._inbound_streams
    # a chunk far ahead of the cumulative TSN is dropped unacknowledged (the peer sends it again)
    ahead = feed.tsn + 100
    await feed.message(b"n", ssn=5, tsn=ahead)
    assert ahead not in feed.sctp._sack_misordered and feed.guard.refused == 4
    # tiny fragments of a message that never ends: refused at max_held_chunks
    await feed.message(b"o" * 40, ssn=5, fragment=1, end=False)
    assert feed.guard.refused == 5 and feed.guard.held() == (0, 0)
    assert all(len(data) <= limits.max_message_bytes for _, data in feed.delivered)


@pytest.mark.slow
async def test_an_oversized_message_is_refused_while_reassembled_and_the_channel_goes_on():
    limits = DataChannelLimits()
    async with _connected(protocol_errors=ProtocolErrors(100)) as c:
        assert f"a=max-message-size:{limits.max_message_bytes}" in c.answer  # what a well-behaved sender keeps to
        guard = c.transport.guard
        _unbounded_send(c.pc)
        c.channel.send("x" * (1024 * 1024))  # 16 times the limit, in about 900 chunks
        assert await _drained(c.pc), "the viewer's message was not acknowledged"
        assert guard.refused == 1 and guard.dropped_chunks > 800
        assert 0 < guard.held_peak <= limits.max_held_bytes  # what was buffered, never the whole message
        assert guard.held() == (0, 0)
        assert c.controls == [] and c.transport.errors.count == 1
        c.channel.send(P.encode(P.Pause()))  # the next message on the same ordered stream still arrives
        assert await _until(lambda: c.controls), "the channel is stuck after a refusal"
        assert isinstance(c.controls[0], P.Pause) and c.transport.pc.connectionState == "connected"


@pytest.mark.slow
async def test_an_oversized_message_is_answered_with_too_large_on_the_channel():
    async with _connected(protocol_errors=ProtocolErrors(100)) as c:
        replies = []
        c.channel.on("message", replies.append)
        _unbounded_send(c.pc)
        c.channel.send("x" * (100 * 1024))
        assert await _until(lambda: replies), "the viewer was not told"
        error = P.parse_server(replies[0])
        assert error.code is P.ErrorCode.TOO_LARGE, error
        assert error.message.startswith("data channel message refused: a message of more than 65536 bytes")
        assert c.transport.errors.count == 1 and not c.lost  # a protocol error; the stream goes on


@pytest.mark.slow
async def test_a_peer_that_takes_none_of_its_channels_messages_is_closed_as_a_slow_client():
    backlogged = []
    limits = DataChannelLimits(max_buffered_bytes=8192)
    async with _connected(limits=limits, on_backlog=lambda: backlogged.append(1)) as c:
        message = P.Error(code=P.ErrorCode.INVALID_FIELD, message="x" * 300)
        for _ in range(100):  # a viewer that reads them: nothing piles up
            c.transport.send_control(message)
            await asyncio.sleep(0.005)
        assert not c.lost and c.transport.channel.bufferedAmount <= limits.max_buffered_bytes

        async def deaf(chunk) -> None:  # from here the viewer's SCTP takes (and acknowledges) nothing
            pass

        c.pc.sctp._receive_chunk = deaf
        for _ in range(400):
            c.transport.send_control(message)
            if c.lost:
                break
            await asyncio.sleep(0.005)
        assert c.lost and c.lost[0].startswith("slow client: ") and "(limit 8192)" in c.lost[0], c.lost
        assert backlogged == [1] and await _until(lambda: c.transport.pc.connectionState == "closed")


@pytest.mark.slow
async def test_an_oversized_unordered_message_is_refused_too():
    transport, controls, _ = _transport(protocol_errors=ProtocolErrors(100))
    pc, channel, offer = await _client_offer(channel_ordered=False)
    try:
        await pc.setRemoteDescription(RTCSessionDescription(sdp=await transport.answer(offer), type="answer"))
        assert await _until(lambda: channel.readyState == "open" and transport.channel is not None)
        _unbounded_send(pc)
        channel.send("y" * (300 * 1024))
        assert await _drained(pc)
        assert transport.guard.refused == 1 and transport.guard.held_peak <= DataChannelLimits().max_held_bytes
        channel.send(P.encode(P.Resume()))
        assert await _until(lambda: controls) and isinstance(controls[0], P.Resume)
    finally:
        await pc.close()
        await transport.close()


@pytest.mark.slow
async def test_the_inbox_is_bounded_and_what_overflows_is_dropped_and_counted():
    block = asyncio.Event()  # the handler is busy with the first message: the rest wait in the inbox
    limits = DataChannelLimits(inbox=4)
    async with _connected(protocol_errors=ProtocolErrors(1000), limits=limits, block=block) as c:
        for _ in range(30):
            c.channel.send(P.encode(P.Pause()))
        assert await _drained(c.pc)
        assert await _until(lambda: c.transport.inbox_dropped == 30 - 1 - 4)
        assert c.transport._inbox.qsize() == 4 and len(c.controls) == 1
        block.set()
        assert await _until(lambda: len(c.controls) == 5)


@pytest.mark.slow
async def test_a_peer_that_keeps_sending_oversized_messages_is_closed():
    async with _connected(protocol_errors=ProtocolErrors(3)) as c:
        _unbounded_send(c.pc)
        for _ in range(3):
            c.channel.send("z" * (100 * 1024))
        assert await _until(lambda: c.lost, 20), (c.transport.guard.refused, c.transport.errors.count)
        assert "3 protocol errors within 10 s" in c.lost[0] and "max-message-size" in c.lost[0]
        assert await _until(lambda: c.transport.pc.connectionState == "closed")


@pytest.mark.slow
async def test_junk_on_the_data_channel_closes_the_peer_after_n_protocol_errors():
    async with _connected(protocol_errors=ProtocolErrors(5)) as c:
        replies = []
        c.channel.on("message", replies.append)
        for i in range(4):
            c.channel.send(f"not json {i}")
        assert await _until(lambda: len(replies) == 4)  # each one answered with an error, the stream goes on
        assert all(P.parse_server(r).code is P.ErrorCode.BAD_JSON for r in replies) and not c.lost
        c.channel.send(P.encode(P.Start(prompt="x")))  # out of turn: the fifth
        assert await _until(lambda: c.lost)
        assert "5 protocol errors within 10 s" in c.lost[0]
        assert await _until(lambda: c.transport.pc.connectionState == "closed")


@pytest.mark.slow
async def test_the_log_lines_bad_input_causes_are_rate_limited(caplog):
    caplog.set_level(logging.INFO, logger="streamsvc.webrtc")
    async with _connected(protocol_errors=ProtocolErrors(1000)) as c:
        replies = []
        c.channel.on("message", replies.append)
        for i in range(40):
            c.channel.send(f"junk {i}")
        for i in range(5):
            c.pc.createDataChannel(f"extra{i}")  # ignored channels are bad input too
        assert await _until(lambda: len(replies) == 40)
        await asyncio.sleep(0.2)
        lines = [r for r in caplog.records if r.name == "streamsvc.webrtc" and r.levelno >= logging.WARNING]
        assert len(lines) == 1, [r.getMessage() for r in lines]
        assert "bad_json" in lines[0].getMessage() and c.transport.errors.count == 40
