"""A viewer's camera over WebRTC into its stream's input: decoded frames and their capture times (issue 35).

``read_track(track, sink, clock)`` reads an aiortc remote video track until it ends and hands each decoded
``av.VideoFrame`` to ``sink.push_av(frame, capture_s)`` (``sink``: anything with ``push_av`` and
``decode_error``, i.e. ``streamsvc.inputs.frames.InputFrames``). The WHIP endpoint (issue 36) reuses it.

Capture time, in the SENDER's clock
------------------------------------
Glass-to-glass latency is measured in the sender's clock: the server echoes each input frame's capture time
back (the chunk header's ``capture_ms``) and the viewer subtracts it from its own clock when the generated
frame shows. A frame's RTP timestamp counts the sender's media clock (90 kHz for video) from a random origin;
the sender's RTCP sender reports (RFC 3550 section 6.4.1) pair an NTP wall-clock time with the RTP timestamp
of the same instant, so a frame's capture time is::

    capture_s = unix(sr.ntp) + signed32(rtp - sr.rtp) / 90000

with the last report received (a browser sends one about every second; the media clock's drift between two is
microseconds). Browsers stamp a frame's RTP timestamp at capture and their reports extrapolate it to the
report's NTP time, so this is the capture time; aiortc's own sender pairs the NTP time of sending with the
last packet's timestamp, i.e. a frame's send time (its capture time within a frame).

What aiortc keeps and what it does not (aiortc 1.16): ``RTCRtpReceiver._handle_rtcp_packet`` takes each
report but keeps only the middle 32 bits of its NTP time and the time it arrived (for the LSR/DLSR fields of
its receiver reports), never the report's RTP timestamp, and exposes neither (its ``getStats`` has the NTP
time as ``remoteTimestamp`` but no RTP timestamp). So ``SenderClock.install(receiver)`` wraps that method on
the one receiver instance (other receivers in the process keep aiortc's own), calling aiortc's first, and
keeps the last report's (NTP, RTP) pair. A decoded frame's ``pts`` is its RTP timestamp less the first
frame's (aiortc's ``TimestampMapper``, which also unwraps), so the clock reads that origin back
(``aiortc_hooks.timestamp_origin``) to rebuild the RTP timestamp modulo 2**32.

Before the first report (the first second or so) a frame is timed by its arrival here (``time.time()``, the
server's clock: right on one host, off by the clocks' offset otherwise); ``ReadStats.arrival_clock`` counts
those frames and ``sender_clock`` the others. A report with an NTP time of 0 (aiortc's sender sends those
before its first packet) is ignored.

Decoder errors: aiortc's decoder thread catches a frame's ``av.FFmpegError``, logs it and sets the
receiver's ``threading.Event`` (private to the receiver, read to send a PLI); the frame never
reaches the track. ``install`` replaces that event by one that also counts each error and reports it on the
event loop, where ``read_track`` calls ``sink.decode_error()``. It must run before the receiver starts (its
decoder thread is given the event then): right after ``setRemoteDescription``, as the server does.

Every private name of aiortc this module needs is reached through streamsvc/transport/aiortc_hooks.py, which names
them all. ``install`` returns False (and frames are timed on arrival, errors not counted) if a later aiortc lacks what
it uses (``aiortc_hooks.CLOCK_HOOKS``); ``tests/streamsvc/test_hooks.py`` and ``tests/streamsvc/test_rtc_input.py``
fail loudly then.

A frame as soon as it is whole: aiortc's jitter buffer hands a video frame to the decoder only when a packet of the
next frame arrives (``aiortc_hooks.HandOverJitterBuffer.aiortc_hand_over``), one frame period late (62 ms at 16 fps,
33 ms from a 30 fps camera), which delays every chunk's release by as much. ``MarkerJitterBuffer`` also hands it over
on the packet that carries the RTP marker bit (the last packet of an access unit: RFC 6184 for H.264, RFC 7741 for
VP8) once every packet from the frame's first is there; ``prompt_frames(receiver)`` puts one in a receiver before it
starts.

What a sender's frames may cost (``ReceiverGate``, issue 41): the jitter buffer hands each whole frame to the
stream's ``InputGate`` (streamsvc/inputs/gate.py) before aiortc's decoder sees it. A frame that declares a size over
the pixel cap (an H.264 SPS, a VP8 key frame: streamsvc/inputs/bitstream.py) is never decoded and refuses the input on
that frame (``on_refused``: WHIP ends the session, the camera stops its receiver and its decoder, and the viewer gets an
``input_refused`` error); frames over the rate (``MAX_RTC_FPS``) are dropped undecoded, a reference frame with its
group of pictures, with a PLI to the sender for the next key frame. The decoder thread's CPU time
(``time.pthread_getcpuclockid`` of aiortc's ``aiortc_hooks.decoder_thread``) is charged to the gate's budget and
to the input stage's cost (``InputFrames.add_work``), and each decoded frame's size is checked against the cap again
before it is scaled. Reading stops on the frame that refused the input, not on the next one.

On the server (``CameraInput``, used by streamsvc/transport/webrtc.py): a steerer's stream with input answers the
player's sendrecv video m-line sendrecv, hooks its receiver (clock, decoder errors, jitter buffer), reads the track
into ``session.input`` until the input changes hands (then the receiver is disabled: packets dropped undecoded), and
holds the track's first chunk of input frames until ``InputFrames.play_from`` (the scheduler's plan for it).

Audio is not read: a track of kind ``audio`` returns at once (the camera's audio is dropped; the server
answers a microphone's m-line inactive anyway, so no audio receiver runs).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from aiortc.jitterbuffer import JitterFrame
from aiortc.mediastreams import MediaStreamError

from streamsvc.inputs.gate import InputGate, Verdict
from streamsvc.transport import aiortc_hooks
from streamsvc.transport.aiortc_hooks import HandOverJitterBuffer
from streamsvc.wire import protocol as P

log = logging.getLogger("streamsvc.webrtc")

RTP_VIDEO_CLOCK_HZ = 90_000
"""The media clock of video RTP (RFC 6184, RFC 7741): a frame's RTP timestamp counts 1/90000 s."""
NTP_UNIX_OFFSET_S = 2_208_988_800
"""Seconds from the NTP epoch (1900-01-01) to the Unix epoch (1970-01-01)."""
MAX_HOLD_S = 10.0
"""The longest a track holds its first chunk of input frames for its due time (a bound, never reached: it is the
input latency and a chunk's duration)."""
MAX_RTC_FPS = 60.0
"""Frames a second a WebRTC sender's decoder takes (a second's burst): a camera or OBS at 60 fps passes; more are
dropped undecoded (ReceiverGate)."""
CPU_METER_S = 0.25  # how often the decoder thread's CPU time is read


class MarkerJitterBuffer(HandOverJitterBuffer):
    """aiortc's video jitter buffer that also hands a frame over on its marker packet (see the module docstring),
    through `gate` (a ReceiverGate) when it has one."""

    def __init__(self, capacity: int = 512, gate: ReceiverGate | None = None) -> None:  # aiortc's video capacity
        super().__init__(capacity=capacity)
        self.early = 0  # frames handed over on their marker packet (before the next frame's first packet)
        self.gate = gate

    def add(self, packet) -> tuple[bool, JitterFrame | None]:
        pli, frame = super().add(packet)
        if self.gate is None:
            return pli, frame
        return self.gate.pass_frame(pli, frame, time.monotonic())

    def hand_over(self, sequence_number: int) -> JitterFrame | None:
        packets = []
        for count, packet in enumerate(self.packets_from_origin()):  # up to a gap (a packet to come, or lost)
            if packets and packet.timestamp != packets[0].timestamp:
                break  # the next frame: aiortc's own rule
            packets.append(packet)
            if packet.marker:
                frame = JitterFrame(data=b"".join(self.payload(p) for p in packets), timestamp=packet.timestamp)
                self.remove(count + 1)
                self.early += 1
                return frame
        return self.aiortc_hand_over(sequence_number)


def prompt_frames(receiver, gate: ReceiverGate | None = None) -> MarkerJitterBuffer | None:
    """Give a video `receiver` (not started yet) a ``MarkerJitterBuffer`` (through `gate`, installed on it); None if
    this aiortc keeps it elsewhere."""
    if not aiortc_hooks.has_jitter_buffer(receiver):
        log.warning("aiortc %s keeps no %s: input frames reach the decoder a frame late%s",
                    aiortc_hooks.aiortc_version(), aiortc_hooks.JITTER_BUFFER,
                    ", and their size is checked only once decoded" if gate is not None else "")
        return None
    buffer = MarkerJitterBuffer(gate=gate)
    if gate is not None:
        gate.receiver = receiver
    aiortc_hooks.replace_jitter_buffer(receiver, buffer)
    return buffer


class ReceiverGate:
    """An ``InputGate`` around one aiortc receiver's decoder (the module docstring): before it (``pass_frame``, from
    the jitter buffer, on the event loop) and after it (``push_av``, a sink for ``read_track`` in front of `sink`).
    `on_refused(reason)` is called once, on the event loop, when the input is refused."""

    def __init__(self, sink, on_refused: Callable[[str], None], *, rate: float = MAX_RTC_FPS,
                 now: Callable[[], float] = time.monotonic) -> None:
        self.sink = sink  # the stream's InputFrames (or anything with push_av, decode_error, drop, add_work)
        self.on_refused = on_refused
        self.now = now
        self.gate = InputGate(rate, round(rate), now())
        self.receiver = None  # the aiortc receiver (prompt_frames sets it): its decoder thread's CPU time is read
        self._cpu_at = -float("inf")  # when the decoder thread's CPU time was last read
        self._cpu_s: float | None = None  # what it was then
        self._told = False

    @property
    def refused(self) -> str | None:
        return self.gate.refused

    def pass_frame(self, pli: bool, frame: JitterFrame | None, now: float) -> tuple[bool, JitterFrame | None]:
        """The jitter buffer's (pli, frame) for aiortc's receiver: the frame if the gate lets it through to the
        decoder, and a PLI when the gate waits for a key frame."""
        if frame is not None:
            verdict = self.gate.admit(frame.data, now)
            if verdict is not Verdict.DECODE:
                if verdict is Verdict.DROP and self.gate.refused is None:
                    _call(self.sink, "drop")
                elif verdict is Verdict.BAD:
                    self.sink.decode_error()
                frame = None
        if now - self._cpu_at >= CPU_METER_S:
            self._meter(now)
        self.report()
        return pli or self.gate.keyframe_wanted(now), frame

    def _meter(self, now: float) -> None:
        """The decoder thread's CPU time since the last reading: to the gate's budget and the input stage's cost."""
        self._cpu_at = now
        thread = aiortc_hooks.decoder_thread(self.receiver)
        try:
            cpu_s = time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
        except (AttributeError, TypeError, OSError):  # not started, ended, or a platform without thread clocks
            return
        spent, self._cpu_s = (0.0 if self._cpu_s is None else cpu_s - self._cpu_s), cpu_s
        _call(self.sink, "add_work", spent)
        self.gate.decode_time(spent, now)

    def report(self) -> None:
        """Call `on_refused` (once) if the input was refused (on the event loop: `push_av` runs off it)."""
        if self.gate.refused is not None and not self._told:
            self._told = True
            self.on_refused(self.gate.refused)

    def stop_decoder(self) -> bool:
        """Drop the receiver's packets from now on and end its decoder thread (its pictures freed; call it off the
        event loop: it joins the thread). False when this aiortc lacks the hooks (``aiortc_hooks.DECODER_HOOKS``)."""
        return aiortc_hooks.stop_decoder(self.receiver)

    # -- after the decoder: a sink for read_track ---------------------------------------------------

    def push_av(self, frame, capture_s: float) -> None:
        if self.gate.refused is None and self.gate.decoded_size(frame.width, frame.height):
            self.sink.push_av(frame, capture_s)

    def decode_error(self) -> None:
        self.sink.decode_error()


def _call(sink, name: str, *args) -> None:
    method = getattr(sink, name, None)
    if method is not None:
        method(*args)


class InputSink(Protocol):
    """Where a stream's input frames go (``streamsvc.inputs.frames.InputFrames``)."""

    def push_av(self, frame, capture_s: float) -> None: ...

    def decode_error(self) -> None: ...


@dataclass(frozen=True)
class SenderReport:
    """One RTCP sender report's clock pair (RFC 3550 section 6.4.1)."""

    ntp_timestamp: int  # 64-bit NTP time: seconds since 1900 in the high 32 bits, the fraction in the low 32
    rtp_timestamp: int  # the media clock at the same instant (32 bits)
    received_s: float  # time.time() here when it arrived

    @property
    def unix_s(self) -> float:
        """The report's NTP time as Unix epoch seconds."""
        return (self.ntp_timestamp >> 32) - NTP_UNIX_OFFSET_S + (self.ntp_timestamp & 0xFFFFFFFF) / 2**32


class _CountingEvent(threading.Event):
    """aiortc's decoder-error event that also counts each error (set from the decoder thread)."""

    def __init__(self, on_error: Callable[[], None]) -> None:
        super().__init__()
        self._on_error = on_error

    def set(self) -> None:
        self._on_error()
        super().set()


class SenderClock:
    """RTP timestamps -> the sender's capture clock (Unix seconds), from the sender reports one receiver gets.

    ``install(receiver)`` hooks an aiortc ``RTCRtpReceiver`` (see the module's docstring); ``on_report`` takes
    a report directly (tests, or a receiver of our own). ``capture_s(pts)`` is a decoded frame's capture time,
    or None before the first report.
    """

    def __init__(self, clock_rate: int = RTP_VIDEO_CLOCK_HZ) -> None:
        if clock_rate <= 0:
            raise ValueError(f"clock_rate={clock_rate}: must be > 0")
        self.clock_rate = clock_rate
        self.last: SenderReport | None = None  # the newest usable report
        self.reports = 0  # usable reports taken
        self.ignored_reports = 0  # reports with an NTP time of 0 (a sender that has sent nothing yet)
        self.decode_errors = 0  # frames aiortc's decoder failed on (counted from its thread)
        self._receiver = None
        self._origin: int | None = None  # the RTP timestamp of pts 0, when known without a receiver (tests)
        self.errors_handed = 0  # of decode_errors, those read_track handed to its sink
        self.on_decode_error: Callable[[], None] | None = None  # called from the decoder thread (read_track's)

    # -- hooking aiortc ----------------------------------------------------------------------------

    def install(self, receiver) -> bool:
        """Keep `receiver`'s sender reports and count its decoder errors from now on. False: this aiortc lacks
        the hooks (then frames are timed on arrival). Call it before the receiver starts (its `receive`)."""
        missing = aiortc_hooks.missing(receiver, aiortc_hooks.CLOCK_HOOKS)
        if missing:
            log.warning("aiortc %s lacks %s: input frames are timed on arrival, not in the sender's clock",
                        aiortc_hooks.aiortc_version(), ", ".join(missing))
            return False
        from aiortc.rtp import RtcpSrPacket

        def on_rtcp(packet) -> None:  # after aiortc's own handling (stats, LSR for its receiver reports)
            if isinstance(packet, RtcpSrPacket):
                info = packet.sender_info
                self.on_report(info.ntp_timestamp, info.rtp_timestamp)

        aiortc_hooks.wrap_rtcp_handler(receiver, on_rtcp)
        aiortc_hooks.replace_decoder_error_event(receiver, _CountingEvent(self._decoder_error))
        self._receiver = receiver
        return True

    def _decoder_error(self) -> None:
        """From aiortc's decoder thread: one more frame it could not decode."""
        self.decode_errors += 1  # only this thread writes it
        callback = self.on_decode_error
        if callback is not None:
            try:
                callback()
            except RuntimeError:  # the reader's loop closed meanwhile: counted all the same
                pass

    # -- the mapping ---------------------------------------------------------------------------------

    def on_report(self, ntp_timestamp: int, rtp_timestamp: int, received_s: float | None = None) -> None:
        """A sender report's (NTP, RTP) pair."""
        if ntp_timestamp == 0:
            self.ignored_reports += 1
            return
        self.last = SenderReport(ntp_timestamp, rtp_timestamp & 0xFFFFFFFF,
                                 time.time() if received_s is None else received_s)
        self.reports += 1

    def set_origin(self, rtp_timestamp: int) -> None:
        """The RTP timestamp of pts 0 (without a receiver; aiortc's receiver knows its own)."""
        self._origin = rtp_timestamp & 0xFFFFFFFF

    def rtp_timestamp(self, pts: int) -> int | None:
        """The RTP timestamp (32 bits) of a decoded frame whose pts is `pts`, or None if the origin is unknown."""
        origin = self._origin
        if self._receiver is not None:
            origin = aiortc_hooks.timestamp_origin(self._receiver)
        if origin is None:
            return None
        return (int(pts) + origin) & 0xFFFFFFFF

    def capture_s(self, pts: int | None) -> float | None:
        """The capture time (Unix seconds, the sender's clock) of the frame with this pts; None before the first
        report, or for a frame with no pts."""
        report = self.last
        if report is None or pts is None:
            return None
        rtp = self.rtp_timestamp(pts)
        if rtp is None:
            return None
        delta = (rtp - report.rtp_timestamp) & 0xFFFFFFFF
        if delta >= 2**31:
            delta -= 2**32  # a frame captured before the report
        return report.unix_s + delta / self.clock_rate


@dataclass
class ReadStats:
    """What ``read_track`` did with one track."""

    frames: int = 0  # video frames handed to the sink
    sender_clock: int = 0  # of them, timed by the sender's reports
    arrival_clock: int = 0  # of them, timed on arrival here (no report yet)
    decode_errors: int = 0  # frames the decoder failed on (each one a sink.decode_error())
    ignored: int = 0  # frames that were not video (never pushed)
    ended: str = ""  # why reading stopped: "track ended", "stopped" (by `active`), "audio"


async def read_track(
    track,
    sink: InputSink,
    clock: SenderClock | None = None,
    *,
    active: Callable[[], bool] = lambda: True,
    now: Callable[[], float] = time.time,
    offload: bool = True,
    stats: ReadStats | None = None,
) -> ReadStats:
    """Read `track` until it ends, pushing each video frame with its capture time into `sink`.

    `clock` (installed on the track's receiver) times frames in the sender's clock and counts decoder errors
    (each one a ``sink.decode_error()`` on the event loop, as it happens); without one, or before its first
    report, a frame is timed by `now()` at its arrival. `active()` is asked before each frame (False
    stops reading: the input changed hands, and the frame is not pushed) and after it is pushed (a sink that refused
    it stops reading on that frame). `offload` runs ``push_av`` (a scale and a
    crop) in a worker thread, one frame at a time and in order, off the event loop. `stats` (given, or a new
    one) is updated as frames come and returned.
    """
    stats = stats if stats is not None else ReadStats()
    if getattr(track, "kind", "video") != "video":
        stats.ended = "audio"
        return stats
    if clock is not None:
        loop = asyncio.get_running_loop()

        def hand_errors() -> None:  # on the loop: every error counted since the last call
            new = clock.decode_errors - clock.errors_handed
            clock.errors_handed += new
            stats.decode_errors += new
            for _ in range(new):
                sink.decode_error()

        hand_errors()  # those before reading started
        clock.on_decode_error = lambda: loop.call_soon_threadsafe(hand_errors)
    try:
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                stats.ended = "track ended"
                return stats
            if not active():
                stats.ended = "stopped"
                return stats
            if not _is_video(frame):
                stats.ignored += 1
                continue
            capture = clock.capture_s(frame.pts) if clock is not None else None
            if capture is None:
                capture = now()
                stats.arrival_clock += 1
            else:
                stats.sender_clock += 1
            if offload:
                await asyncio.to_thread(sink.push_av, frame, capture)
            else:
                sink.push_av(frame, capture)
            stats.frames += 1
            if not active():  # this frame stopped it (a sink that refused it): ended now, not on the next frame
                stats.ended = "stopped"
                return stats
    finally:
        if clock is not None:
            clock.on_decode_error = None


class CameraInput:
    """A WebRTC viewer's camera into its stream's input, on the server: set up while the offer is answered, read
    until the track ends or the input changes hands.

    ``for_viewer(viewer)`` is None unless the viewer steers a stream that asked for input (``session.input``, an
    ``InputFrames``): then the transport answers the offer's video m-line ``sendrecv`` (``answering``), which
    starts aiortc's receiver, and reads the track (``start``). Otherwise the m-line is answered ``sendonly``, as
    before: the viewer's browser sends nothing and no receiver or decoder runs, whatever its camera does. The
    input is the steerer's alone: after a handover (``active()`` turns False) reading stops and the receiver is
    disabled, so later packets are dropped before they are decoded (the peer connection cannot be renegotiated).
    """

    def __init__(self, stream_id: str, sink: InputSink, active: Callable[[], bool],
                 tell: Callable[[P.Error], None] | None = None) -> None:
        self.stream_id = stream_id
        self.sink = sink
        self.active = active
        self.tell = tell  # sends the viewer an error (its input refused)
        self.gate = ReceiverGate(sink, self._refused)  # the pixel cap, the rate and the decode budget (issue 41)
        self._stopping: asyncio.Task | None = None  # the decoder's end after a refusal
        self.clock = SenderClock()
        self.stats = ReadStats()
        self.receiver = None  # the video transceiver's receiver, once answering
        self.hooked = False  # the clock is installed (else frames are timed on arrival)
        self.jitter: MarkerJitterBuffer | None = None  # the receiver's jitter buffer, once answering
        self.held_s: float | None = None  # how long the first chunk of input frames was held (see hold_first_chunk)

    @classmethod
    def for_viewer(cls, viewer) -> CameraInput | None:
        """The camera input of `viewer` (a ``Viewer``): None unless it steers a stream that takes input."""
        session = getattr(viewer, "session", None)
        sink = getattr(session, "input", None)
        if sink is None or getattr(session, "steerer", None) is not viewer:
            return None
        return cls(viewer.stream_id, sink, lambda: session.steerer is viewer and not viewer.closed,
                   tell=getattr(viewer, "send", None))

    def answering(self, transceiver) -> bool:
        """After ``setRemoteDescription`` and before ``createAnswer``: answer `transceiver` (the stream's video)
        sendrecv and hook its receiver. False when the offer sends no video (its m-line is recvonly): then the
        stream's input stays missing, and the answer is sendonly."""
        track = transceiver.receiver.track
        if track is None:
            log.info("stream %s asked for input, but the viewer's offer sends no video (a recvonly m-line): the "
                     "stream runs as text-to-video", self.stream_id)
            return False
        transceiver.direction = "sendrecv"
        self.receiver = transceiver.receiver
        self.hooked = self.clock.install(transceiver.receiver)
        self.jitter = prompt_frames(transceiver.receiver, self.gate)
        return True

    def start(self) -> asyncio.Task:
        """Read the camera's track into the stream's input (a task; cancel it, or close the peer connection)."""
        return asyncio.create_task(self._read(), name=f"rtc-input-{self.stream_id}")

    async def _read(self) -> None:
        await read_track(self.receiver.track, self.gate, self.clock if self.hooked else None,
                         active=lambda: self.active() and self.gate.refused is None, stats=self.stats)
        self.gate.report()  # a decoded frame over the cap: refused on the loop
        if self.stats.ended == "stopped" and self.gate.refused is None:
            aiortc_hooks.disable_decoding(self.receiver)  # aiortc's own switch: packets dropped undecoded
            log.info("stream %s: the camera input stopped (its viewer no longer steers)", self.stream_id)

    def _refused(self, reason: str) -> None:
        """The gate refused the camera (on the event loop): its packets are dropped from now on, its decoder ends
        (off the loop: it joins aiortc's decoder thread), and the viewer is told; the stream goes on without input."""
        log.info("stream %s: the camera input refused: %s", self.stream_id, reason)
        if self.receiver is not None:
            aiortc_hooks.disable_decoding(self.receiver)
        self._stopping = asyncio.ensure_future(asyncio.to_thread(self.gate.stop_decoder))
        if self.tell is not None:
            self.tell(P.Error(code=P.ErrorCode.INPUT_REFUSED, message=(
                f"input refused: {reason}; the stream goes on without input (start a new one to send input again)")))

    async def hold_first_chunk(self, track, max_wait_s: float) -> None:
        """Before the stream's track sends its first frame: if its first chunk was made from input frames, hold it
        until the time the scheduler's model of the viewer plays it from (``InputFrames.play_from``, set by the
        engine at the chunk's release: the release + the input latency + (chunk - first chunk frames) / fps, in
        ``time.monotonic()``, the track's clock). From there on each chunk, released by its last input frame, has
        the input latency to be made and sent; played at once, every later chunk would come just in time, or late.
        `track` is the stream's ``PacketTrack`` (its queue: this package's); waits at most `max_wait_s` for its
        first chunk."""
        queued = getattr(track, "_queue", None)
        for _ in range(int(max_wait_s / 0.01) + 1):
            if queued or track.readyState != "live":
                break
            await asyncio.sleep(0.01)
        play_from = getattr(self.sink, "play_from", None)
        if not queued or play_from is None or queued[0][1] is None or queued[0][1].input != "frames":
            return
        delay = play_from - time.monotonic()
        if 0 < delay <= MAX_HOLD_S:
            self.held_s = delay
            await asyncio.sleep(delay)

    def summary(self) -> str:
        s = self.stats
        return (f"camera input: {s.frames} frames ({s.sender_clock} timed by the sender's reports, {s.arrival_clock} "
                f"on arrival), {s.decode_errors} decoder errors, {self.clock.reports} sender reports")


def _is_video(frame) -> bool:
    import av

    return isinstance(frame, av.VideoFrame)

