"""A viewer's camera over WebRTC into its stream's input (streamsvc/inputs/rtc.py, issue 35): RTP -> the
sender's clock through RTCP sender reports, the arrival-time fallback, decoder errors, audio ignored; a fake track
with fake reports, then aiortc peers over loopback."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from fractions import Fraction
from types import SimpleNamespace

import av
import numpy as np
import pytest
from aiortc import RTCPeerConnection, RTCSessionDescription, VideoStreamTrack
from aiortc.mediastreams import MediaStreamError

from streamsvc.inputs.rtc import (
    NTP_UNIX_OFFSET_S,
    CameraInput,
    MarkerJitterBuffer,
    SenderClock,
    prompt_frames,
    read_track,
)
from streamsvc.transport.webrtc import WebRtcTransport
from streamsvc.wire.rtc import (
    CONTROL_CHANNEL,
    WebRtcConfig,
    complete_local_description,
    h264_preferences,
    rtc_configuration,
)

LOOPBACK = ("127.0.0.1",)


def ntp(unix_s: float) -> int:
    """A 64-bit NTP timestamp of a Unix time."""
    whole = int(unix_s)
    return ((whole + NTP_UNIX_OFFSET_S) << 32) | int(round((unix_s - whole) * 2**32))


def video_frame(pts: int) -> av.VideoFrame:
    frame = av.VideoFrame.from_ndarray(np.zeros((16, 16, 3), np.uint8), format="rgb24")
    frame.pts, frame.time_base = pts, Fraction(1, 90_000)
    return frame


class Sink:
    """What InputFrames is to read_track: (frame, capture_s) pushed, decoder errors counted."""

    def __init__(self) -> None:
        self.pushed: list[tuple[av.VideoFrame, float]] = []
        self.errors = 0
        self.threads: set[str] = set()

    def push_av(self, frame, capture_s: float) -> None:
        self.threads.add(threading.current_thread().name)
        self.pushed.append((frame, capture_s))

    def decode_error(self) -> None:
        self.errors += 1


class FakeTrack:
    """A remote track: `items` in order (a callable is called, not returned: a sender report arriving), then
    the end (MediaStreamError)."""

    def __init__(self, items, kind: str = "video") -> None:
        self.kind = kind
        self._items = list(items)
        self.reads = 0

    async def recv(self):
        while self._items:
            item = self._items.pop(0)
            if callable(item):
                item()
                continue
            self.reads += 1
            await asyncio.sleep(0)
            return item
        raise MediaStreamError


# ---------------------------------------------------------------- the mapping


def test_rtp_maps_to_the_senders_clock_through_the_last_report():
    clock = SenderClock()
    clock.set_origin(500)  # pts 0 is RTP timestamp 500
    assert clock.capture_s(0) is None  # no report yet
    t0 = 1_760_000_000.25
    clock.on_report(ntp(t0), 500 + 9_000)  # at t0 the media clock read pts 9000 (0.1 s)
    assert clock.capture_s(9_000) == pytest.approx(t0, abs=1e-6)
    assert clock.capture_s(9_000 + 45_000) == pytest.approx(t0 + 0.5, abs=1e-6)
    assert clock.capture_s(0) == pytest.approx(t0 - 0.1, abs=1e-6)  # captured before the report
    clock.on_report(ntp(t0 + 1.0), 500 + 9_000 + 90_000 + 900)  # the next report: 10 ms of drift, taken as is
    assert clock.capture_s(9_000 + 90_000) == pytest.approx(t0 + 1.0 - 0.01, abs=1e-6)
    assert clock.reports == 2


def test_rtp_wraps_around_32_bits():
    clock = SenderClock()
    clock.set_origin(2**32 - 90_000)  # one second before the wrap
    t0 = 1_760_000_000.0
    clock.on_report(ntp(t0), 45_000)  # half a second after the wrap
    # pts 135000: RTP (2**32 - 90000 + 135000) mod 2**32 = 45000, the report's instant
    assert clock.capture_s(135_000) == pytest.approx(t0, abs=1e-6)
    assert clock.capture_s(0) == pytest.approx(t0 - 1.5, abs=1e-6)  # before the wrap
    assert clock.capture_s(135_000 + 2**32) == pytest.approx(t0, abs=1e-6)  # aiortc's unwrapped pts


def test_a_report_with_no_ntp_time_is_ignored():
    """aiortc's sender reports NTP 0 / RTP 0 before its first packet: that pair would put frames at 1900."""
    clock = SenderClock()
    clock.set_origin(0)
    clock.on_report(0, 0)
    assert clock.last is None and clock.ignored_reports == 1 and clock.capture_s(100) is None


# ---------------------------------------------------------------- the jitter buffer


def _packet(seq: int, timestamp: int, data: bytes, marker: bool = False):
    from aiortc.rtp import RtpPacket

    packet = RtpPacket(payload_type=96, marker=int(marker), sequence_number=seq, timestamp=timestamp, ssrc=1)
    packet._data = data
    return packet


def test_a_frame_goes_to_the_decoder_on_its_marker_packet_not_a_frame_later():
    from aiortc.jitterbuffer import JitterBuffer

    ours, aiortcs = MarkerJitterBuffer(), JitterBuffer(capacity=512, is_video=True)
    frame = [_packet(10, 3000, b"a"), _packet(11, 3000, b"b"), _packet(12, 3000, b"c", marker=True)]
    assert [ours.add(p)[1] for p in frame[:2]] == [None, None]
    got = ours.add(frame[2])[1]
    assert (got.data, got.timestamp) == (b"abc", 3000) and ours.early == 1
    assert [aiortcs.add(p)[1] for p in frame] == [None, None, None]  # aiortc's waits for the next frame
    assert aiortcs.add(_packet(13, 6000, b"d"))[1].data == b"abc"

    # a packet missing: nothing until it comes (a retransmission), then the whole frame
    assert ours.add(_packet(13, 6000, b"d"))[1] is None
    assert ours.add(_packet(15, 6000, b"f", marker=True))[1] is None
    got = ours.add(_packet(14, 6000, b"e"))[1]
    assert got.data == b"def" and ours.early == 2
    # a frame whose marker packet is lost: handed over by aiortc's rule, on the next frame's first packet
    assert ours.add(_packet(16, 9000, b"g"))[1] is None
    got = ours.add(_packet(18, 12000, b"i"))[1]
    assert got is None  # 17 (the marker) missing, and the next frame's first packet is not contiguous either
    got = ours.add(_packet(17, 12000, b"h"))[1]
    assert got.data == b"g" and ours.early == 2


# ---------------------------------------------------------------- read_track with a fake track


async def test_frames_are_timed_on_arrival_until_the_first_report_then_in_the_senders_clock():
    clock = SenderClock()
    clock.set_origin(1_000)
    t0 = 1_700_000_000.0
    track = FakeTrack([video_frame(0), video_frame(3_000),
                       lambda: clock.on_report(ntp(t0), 1_000 + 6_000),
                       video_frame(6_000), video_frame(9_000)])
    sink = Sink()
    arrivals = iter([500.0, 501.0])
    stats = await read_track(track, sink, clock, now=lambda: next(arrivals), offload=False)
    assert [c for _, c in sink.pushed] == pytest.approx([500.0, 501.0, t0, t0 + 3_000 / 90_000])
    assert (stats.frames, stats.arrival_clock, stats.sender_clock) == (4, 2, 2)
    assert stats.ended == "track ended"


async def test_without_a_clock_every_frame_is_timed_on_arrival_and_pushed_off_the_loop():
    sink = Sink()
    stats = await read_track(FakeTrack([video_frame(i * 3_000) for i in range(3)]), sink, None, now=lambda: 7.0)
    assert [c for _, c in sink.pushed] == [7.0, 7.0, 7.0] and stats.arrival_clock == 3
    assert threading.main_thread().name not in sink.threads  # push_av (a scale) ran in a worker thread


async def test_decoder_errors_reach_the_sink_from_the_decoders_thread():
    clock = SenderClock()
    clock.set_origin(0)
    clock._decoder_error()  # one before reading started: handed over when it starts
    sink = Sink()

    def errors_from_a_thread():
        t = threading.Thread(target=lambda: [clock._decoder_error() for _ in range(3)])
        t.start()
        t.join()

    track = FakeTrack([video_frame(0), errors_from_a_thread, video_frame(3_000)])
    stats = await read_track(track, sink, clock, offload=False)
    await asyncio.sleep(0)  # the last call_soon_threadsafe
    assert sink.errors == 4 and clock.decode_errors == 4
    assert stats.decode_errors == 4 and stats.frames == 2


async def test_audio_is_not_read_and_non_video_frames_are_ignored():
    sink = Sink()
    audio = FakeTrack([av.AudioFrame(format="s16", layout="mono", samples=160)], kind="audio")
    stats = await read_track(audio, sink)
    assert stats.ended == "audio" and audio.reads == 0 and not sink.pushed

    mixed = FakeTrack([av.AudioFrame(format="s16", layout="mono", samples=160), video_frame(0)])
    stats = await read_track(mixed, sink, offload=False)
    assert stats.ignored == 1 and stats.frames == 1


async def test_reading_stops_when_the_input_changes_hands():
    sink = Sink()
    owner = {"steers": True}
    track = FakeTrack([video_frame(0), lambda: owner.update(steers=False), video_frame(3_000), video_frame(6_000)])
    stats = await read_track(track, sink, active=lambda: owner["steers"], offload=False)
    assert stats.ended == "stopped" and stats.frames == 1 and len(sink.pushed) == 1


# ---------------------------------------------------------------- aiortc over loopback


def barcode(n: int) -> np.ndarray:
    """A 96x128 frame showing n (0-255) as 8 columns, black or white, most significant bit first."""
    bits = np.array([(n >> (7 - i)) & 1 for i in range(8)], np.uint8) * 255
    return np.repeat(np.repeat(bits, 16)[None, :, None], 96, axis=0).repeat(3, axis=2)


def read_barcode(frame: av.VideoFrame) -> int:
    columns = frame.to_ndarray(format="gray")[:, 4::16][:, :8].mean(axis=0)
    return int(sum(1 << (7 - i) for i, c in enumerate(columns) if c > 128))


class Camera(VideoStreamTrack):
    """A sender's camera: aiortc's paced frames, each showing its number (a barcode) and its send time kept."""

    def __init__(self, garbage_at: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.sent_at: dict[int, float] = {}  # frame number -> time.time() when aiortc took it
        self.garbage_at = garbage_at
        self.count = 0
        self.jitter = None  # the receiving side's MarkerJitterBuffer (set by _pair)

    async def recv(self):
        pts, time_base = await self.next_timestamp()
        self.count += 1
        if self.count in self.garbage_at:  # an access unit of junk slices: the receiver's decoder fails on it
            packet = av.Packet(b"\x00\x00\x00\x01\x41" + os.urandom(600))
            packet.pts, packet.time_base = pts, time_base
            return packet
        frame = av.VideoFrame.from_ndarray(barcode(self.count % 256), format="rgb24")
        frame.pts, frame.time_base = pts, time_base
        self.sent_at[self.count % 256] = time.time()
        return frame


async def _pair(camera: Camera):
    """A sender (camera, sendonly) and a receiver whose receiver has a SenderClock: (sender pc, receiver pc,
    clock, the receiver's remote track)."""
    sender, receiver = RTCPeerConnection(rtc_configuration()), RTCPeerConnection(rtc_configuration())
    sender.addTransceiver(camera, direction="sendonly")
    offer = await complete_local_description(sender, await sender.createOffer(), LOOPBACK, 10)
    await receiver.setRemoteDescription(RTCSessionDescription(sdp=offer, type="offer"))
    clock = SenderClock()
    (transceiver,) = receiver.getTransceivers()
    assert clock.install(transceiver.receiver), "this aiortc lacks what rtc_input hooks"
    camera.jitter = prompt_frames(transceiver.receiver)
    assert camera.jitter is not None
    answer = await complete_local_description(receiver, await receiver.createAnswer(), LOOPBACK, 10)
    await sender.setRemoteDescription(RTCSessionDescription(sdp=answer, type="answer"))
    return sender, receiver, clock, transceiver.receiver.track


@pytest.mark.slow
async def test_an_aiortc_senders_frames_are_timed_in_its_clock_through_its_reports():
    camera = Camera(garbage_at=(40,))
    sender, receiver, clock, track = await _pair(camera)
    sink = Sink()
    reading = asyncio.create_task(read_track(track, sink, clock))
    try:
        for _ in range(100):  # 10 s at most: the first report comes 0.5-1.5 s in
            await asyncio.sleep(0.1)
            if clock.reports >= 2 and len(sink.pushed) >= 80:
                break
    finally:
        await sender.close()
        await receiver.close()
        stats = await asyncio.wait_for(reading, 5)
    assert clock.reports >= 1 and stats.sender_clock > 0 and stats.arrival_clock > 0, stats
    # a frame's capture time (the sender's: aiortc's report pairs its send time with its last packet's timestamp)
    # is its send time to within a frame; before the first report, its arrival time (loopback: milliseconds later)
    errors = [capture - camera.sent_at[read_barcode(frame)] for frame, capture in sink.pushed]
    sender_timed = errors[stats.arrival_clock:]
    print(f"{stats.frames} frames: {stats.arrival_clock} on arrival, {stats.sender_clock} in the sender's clock; "
          f"capture - sent: median {np.median(sender_timed) * 1e3:.1f} ms, worst {np.max(np.abs(sender_timed)) * 1e3:.1f}"
          f" ms; {stats.decode_errors} decoder errors")
    # within a frame (33 ms at aiortc's 30 fps): a frame's worth of error would be a mapping off by one frame; the
    # worst one is bounded loosely (a busy host delays a packet's sending, and the report's pairing with it)
    assert abs(np.median(sender_timed)) < 0.010 and np.max(np.abs(sender_timed)) < 0.1, sender_timed
    assert min(errors[: stats.arrival_clock]) >= 0  # arrival comes after sending
    assert stats.decode_errors >= 1 and sink.errors == stats.decode_errors  # the junk access unit
    assert camera.jitter.early >= stats.frames - 5  # each frame decoded on its marker packet, not a frame later


# ---------------------------------------------------------------- the server's transport


def _viewer(*, takes_input: bool, steers: bool = True):
    """A steerer (or watcher) of a stream, as WebRtcTransport sees it, with the stream's input (a Sink) if it asked
    for input."""
    from streamsvc.viewers.session import SessionState

    session = SimpleNamespace(stream_id="s1", fps=16, state=SessionState.PLAYING, closed=False,
                              input=Sink() if takes_input else None, steerer=None)
    viewer = SimpleNamespace(session=session, stream_id="s1", fps=16, state=SessionState.PLAYING, closed=False,
                             outbox=asyncio.Queue(), buffer_report=lambda seconds: None)
    session.steerer = viewer if steers else SimpleNamespace()
    return viewer


class _Engine:
    def observe_buffer(self, stream_id, frames, grace_s=0.0) -> None:
        pass

    def request_keyframe(self, stream_id) -> None:
        pass


async def _camera_offer(camera: Camera):
    """The player's offer, from aiortc: a sendrecv video transceiver (H.264) sending `camera`, a control channel."""
    pc = RTCPeerConnection(rtc_configuration())
    transceiver = pc.addTransceiver(camera, direction="sendrecv")
    transceiver.setCodecPreferences(h264_preferences())
    pc.createDataChannel(CONTROL_CHANNEL)
    return pc, await complete_local_description(pc, await pc.createOffer(), LOOPBACK, 10)


def _video_direction(sdp: str) -> str:
    video = sdp[sdp.index("m=video"):]
    video = video[: video.index("\nm=")] if "\nm=" in video else video
    return next(d for d in ("sendrecv", "sendonly", "recvonly", "inactive") if f"a={d}" in video)


async def _serve(viewer, camera: Camera):
    """The server's transport answering a viewer whose player sends `camera`: (transport, the player's pc)."""
    async def nothing(*args) -> None:
        pass

    transport = WebRtcTransport(viewer, _Engine(), WebRtcConfig(ice_addresses=LOOPBACK), on_control=nothing,
                                on_lost=nothing)
    pc, offer = await _camera_offer(camera)
    answer = await transport.answer(offer)
    await pc.setRemoteDescription(RTCSessionDescription(sdp=answer, type="answer"))
    return transport, pc, answer


def test_only_a_steerer_whose_stream_takes_input_has_a_camera_input():
    assert CameraInput.for_viewer(_viewer(takes_input=True)) is not None
    assert CameraInput.for_viewer(_viewer(takes_input=False)) is None
    assert CameraInput.for_viewer(_viewer(takes_input=True, steers=False)) is None  # a watcher's camera: never read


@pytest.mark.slow
async def test_the_steerers_camera_feeds_its_streams_input_until_it_hands_over():
    viewer, camera = _viewer(takes_input=True), Camera()
    transport, pc, answer = await _serve(viewer, camera)
    sink = viewer.session.input
    try:
        assert _video_direction(answer) == "sendrecv"
        for _ in range(100):  # 10 s at most
            await asyncio.sleep(0.1)
            if transport.camera.clock.reports and transport.camera.stats.sender_clock >= 10:
                break
        stats = transport.camera.stats
        assert stats.sender_clock >= 10 and stats.frames == len(sink.pushed), stats
        errors = [capture - camera.sent_at[read_barcode(frame)] for frame, capture in sink.pushed[stats.arrival_clock:]]
        assert abs(np.median(errors)) < 0.010 and np.max(np.abs(errors)) < 0.1, errors  # the sender's clock

        viewer.session.steerer = SimpleNamespace()  # a handover: the input is the steerer's alone
        for _ in range(50):
            await asyncio.sleep(0.1)
            if stats.ended:
                break
        assert stats.ended == "stopped" and transport.camera.receiver._enabled is False
        pushed = len(sink.pushed)
        await asyncio.sleep(0.3)
        assert len(sink.pushed) == pushed
    finally:
        await pc.close()
        await transport.close()


@pytest.mark.slow
async def test_a_stream_without_input_answers_sendonly_and_nothing_is_sent_or_decoded():
    for viewer in (_viewer(takes_input=False), _viewer(takes_input=True, steers=False)):
        camera = Camera()
        transport, pc, answer = await _serve(viewer, camera)
        try:
            assert _video_direction(answer) == "sendonly" and transport.camera is None
            for _ in range(100):
                await asyncio.sleep(0.1)
                if pc.connectionState == "connected":
                    break
            await asyncio.sleep(0.5)
            assert pc.connectionState == "connected"
            assert camera.count == 0  # the player's sender never read its camera: nothing went on the wire
            receiver = transport.pc.getTransceivers()[0].receiver
            assert receiver._RTCRtpReceiver__decoder_thread is None  # and the server runs no decoder
        finally:
            await pc.close()
            await transport.close()


class BombCamera(Camera):
    """A camera whose frame `bomb_at` is a real IDR whose SPS declares 8192x4096 (the frames before are aiortc's)."""

    def __init__(self, bomb_at: int) -> None:
        super().__init__()
        self.bomb_at = bomb_at

    async def recv(self):
        if self.count + 1 != self.bomb_at:
            return await super().recv()
        from streamsvc.inputs.bitstream import with_size
        from tests.streamsvc.test_bitstream import sps_of, x264

        pts, time_base = await self.next_timestamp()
        self.count += 1
        idr = x264(64, 48, 1)[0]
        packet = av.Packet(idr.replace(sps_of(idr), with_size(sps_of(idr), 8192, 4096)))
        packet.pts, packet.time_base = pts, time_base
        return packet


def test_this_aiortc_has_what_the_receiver_gate_hooks():
    from aiortc import RTCRtpReceiver

    from streamsvc.transport.aiortc_hooks import DECODER_HOOKS

    receiver = RTCRtpReceiver("video", SimpleNamespace(state="new"))
    missing = [name for name in DECODER_HOOKS + ("_RTCRtpReceiver__jitter_buffer",) if not hasattr(receiver, name)]
    assert not missing, f"aiortc moved {missing}: update streamsvc/inputs/rtc.py ReceiverGate"


@pytest.mark.slow
async def test_a_camera_frame_that_declares_8192x4096_is_refused_undecoded_and_the_decoder_ends():
    from streamsvc.wire import protocol as P

    viewer, camera = _viewer(takes_input=True), BombCamera(bomb_at=20)
    told: list = []
    viewer.send = told.append
    transport, pc, _ = await _serve(viewer, camera)
    sink = viewer.session.input
    try:
        for _ in range(100):  # 10 s at most
            await asyncio.sleep(0.1)
            if told and transport.camera.stats.ended:
                break
        assert [m.code for m in told] == [P.ErrorCode.INPUT_REFUSED] and "8192x4096" in told[0].message
        gate, receiver = transport.camera.gate, transport.camera.receiver
        assert 10 <= gate.gate.counts.decoded <= 19 and gate.refused is not None  # the 20th never reached it
        assert 0 < len(sink.pushed) <= 19 and all(frame.width == 128 for frame, _ in sink.pushed)
        assert receiver._enabled is False and receiver._RTCRtpReceiver__decoder_thread is None  # its memory freed
        assert pc.connectionState == "connected"  # the viewer's stream goes on
    finally:
        await pc.close()
        await transport.close()


def test_the_decoder_threads_cpu_time_is_input_work_and_over_its_budget_refuses_the_input():
    from streamsvc.inputs.rtc import ReceiverGate

    stop = threading.Event()

    def decoding() -> None:  # aiortc's decoder thread, busy
        while not stop.is_set():
            sum(range(20_000))

    thread = threading.Thread(target=decoding, name="video-decoder")
    work: list[float] = []
    refused: list[str] = []
    gate = ReceiverGate(SimpleNamespace(add_work=work.append), refused.append)
    gate.gate.max_load = 0.2  # CPU-seconds a second: the thread takes most of a core
    gate.receiver = SimpleNamespace(_RTCRtpReceiver__decoder_thread=thread)
    thread.start()
    try:
        t0 = time.monotonic()
        while not refused and time.monotonic() - t0 < 10:  # what the jitter buffer does on each packet
            gate.pass_frame(False, None, time.monotonic())
            time.sleep(0.05)
    finally:
        stop.set()
        thread.join()
    assert sum(work) > 0.6  # the decoder's CPU time went to the input stage's cost
    assert len(refused) == 1 and "CPU-seconds a second over 3 s" in refused[0]
    assert 3.0 <= time.monotonic() - t0 < 6.0
