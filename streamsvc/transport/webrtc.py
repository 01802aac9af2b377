"""WebRTC delivery through aiortc: one paced track and one data channel per stream.

What goes where
---------------
- Video: ``PacketTrack`` (streamsvc/transport/track.py), an aiortc ``VideoStreamTrack`` that returns the
  stream's own ``av.Packet`` s, paced at the stream's fps.
- Control: a data channel named ``control``, opened by the viewer, carries
  the same JSON messages as the WebSocket (``streamsvc.wire.protocol``): the
  viewer's ``set_prompt``/``pause``/``resume``/``close``, the server's
  ``ack``/``error``/``closed``, and each chunk's ``chunk`` header, sent when
  the track sends the chunk's first frame, so a viewer maps frames (by RTP
  timestamp) to prompt versions. Before the channel opens, server messages
  go on the WebSocket; ``closed`` goes on both.
- Signaling: on the WebSocket, after ``start`` with ``transport: "webrtc"``
  and ``ready``: the viewer's ``offer`` (complete: it waited for ICE gathering,
  no trickle), the server's ``answer`` (also complete).

H.264 only: the server's transceiver prefers exactly H.264 packetization-mode 1,
profile-level-id 42e01f (constrained baseline, up to level 3.1), which is
what our x264 ultrafast/zerolatency encoder makes (profile_idc 66 with
constraint_set0/1, no CABAC, no B-frames). An offer without it is refused
with a message that says so.

The viewer's buffer, as the scheduler sees it: the frames queued in the track
and not yet sent. The viewer stalls exactly when that queue is empty at a
frame's due time (its jitter buffer is a few frames at most), so every time
the track takes or gets frames it reports the queue with
``engine.observe_buffer(stream_id, frames_queued, grace_s=...)``. (The frame on screen is
counted as played: one frame of margin for the network and the decoder. With
it counted too, the slack scheduler ran chunks to within milliseconds of
their due time and a busy 2-core machine saw stalls of a few ms.) A WebRTC viewer therefore
needs to send no ``stats``. The scheduler plans on the queue alone, but counts a dry
queue as a stall (closing admission, raising every stream's lead, the last resort's
evidence) only once it has stayed dry past the frame sent last and the viewer's
jitter buffer (``WebRtcConfig.viewer_jitter_s``). Counted at once, a busy host's
short dry spells ended streams (``overloaded``) whose viewers never stalled.

A picture loss (RTCP PLI or FIR) from the viewer becomes
``engine.request_keyframe(stream_id)``: the next chunk starts with an IDR. A viewer's PLIs force one keyframe a
second at most (``KEYFRAME_REQUEST_MIN_INTERVAL_S``): a flood of them costs the stream no more IDRs than that.

Input from the viewer is bounded (issue 33): its offer is checked before aiortc sees it
(``streamsvc.transport.sdp``: size, lines, m-lines, codecs; ICE candidates aioice must never probe dropped,
at most ``WebRtcConfig.max_remote_candidates`` kept, and as many peer-reflexive ones learned from the viewer's
STUN checks: ``streamsvc.transport.ice``), so a bad one leaves no peer connection behind; m-lines
other than the stream's video and the data channel are answered inactive (rejected, port 0, unless one holds
the offer's BUNDLE tag), so no receiver decodes what the viewer sends; the data channel's SCTP reassembly is
bounded (``streamsvc.transport.datachannel``), and so is the inbox of whole messages. Each bad message counts
as a protocol error (``ProtocolErrors``; a refused oversized message too, answered ``too_large`` on the channel):
the ``limit``-th within its window closes the peer connection and the viewer, and so does a peer that leaves more
than ``DataChannelLimits.max_buffered_bytes`` of the server's messages unacknowledged (a slow client). The log lines
bad input causes are at most one per peer every 10 s, with a count of those held back.

Camera input (issue 35): the player always offers its video m-line sendrecv (the server refuses renegotiation, so
turning the camera on later is the browser's ``replaceTrack``). The server answers it sendrecv only to the steerer of
a stream that asked for input, and reads that track into the stream's ``InputFrames``
(``streamsvc.inputs.rtc.CameraInput``); to anyone else it answers sendonly: nothing is sent, nothing decoded.

ICE: no STUN/TURN unless configured (``RTCConfiguration(iceServers=[])``; with
``None`` aiortc would ask a public STUN server). aioice gathers host
candidates on every interface except 127.0.0.1; ``WebRtcConfig.ice_addresses``
(``streamsvc serve --ice-address``) picks the addresses instead, through
``gather_on``, so tests and load tests keep all ICE traffic on loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

from aiortc import (
    RTCPeerConnection,
    RTCSessionDescription,
)

from streamsvc.door.access import LogGate, ProtocolErrors
from streamsvc.inputs.rtc import CameraInput
from streamsvc.transport.aiortc_hooks import (
    answer_as_dtls_server,
    ice_connections,
    route_keyframe_requests,
)
from streamsvc.transport.datachannel import DataChannelLimits, ReassemblyGuard
from streamsvc.transport.ice import PeerReflexiveCap
from streamsvc.transport.sdp import CheckedOffer, check_offer, reject_media
from streamsvc.transport.track import PacketTrack
from streamsvc.viewers.protocol import Send, Violation, ViewerProtocol
from streamsvc.viewers.session import SessionState
from streamsvc.wire import protocol as P
from streamsvc.wire.rtc import (
    ANY_INTERFACE,
    CONTROL_CHANNEL,
    H264_PACKETIZATION_MODE,
    H264_PROFILE_LEVEL_ID,
    SignalingError,
    WebRtcConfig,
    complete_local_description,
    h264_preferences,
    rtc_configuration,
)

log = logging.getLogger("streamsvc.webrtc")

KEYFRAME_REQUEST_MIN_INTERVAL_S = 1.0
"""A viewer's PLIs closer together than this ask the encoder for one keyframe (a decoder repeats its PLI until one
comes; the encoder makes one every 2 s anyway): a flood forces at most one IDR a second."""
BAD_INPUT_LOG_PERIOD_S = 10.0
"""A peer's bad input (protocol errors, refused messages) is logged at most once in this long, with a count."""
DEFAULT_MAX_PROTOCOL_ERRORS = 10
"""Protocol errors within ``ProtocolErrors``' window that close a peer, when the server gives no counter."""


# ---------------------------------------------------------------- the server side of one stream


class WebRtcTransport:
    """One stream's peer connection on the server: answers the offer, sends the track, runs the channel.

    The server feeds it: ``feed(chunk)`` for each ``ChunkOut`` (its
    ``packets`` and ``header``), ``send_control(msg)`` for each server
    message. It calls back: ``on_control(msg)`` (awaited, in order) for each
    viewer message from the data channel, ``on_lost(reason)`` once when the
    connection fails or never comes up, or the viewer's protocol errors
    reach ``protocol_errors``' limit (the peer connection then closes).
    ``engine`` is the stream's engine (``observe_buffer``,
    ``request_keyframe``); ``session`` its session (its ``stream_id``,
    ``fps``, ``state`` and ``outbox``). ``protocol_errors`` may be the
    viewer's WebSocket's own counter, so that both channels add up.
    """

    def __init__(
        self,
        session,
        engine,
        config: WebRtcConfig,
        *,
        on_control: Callable[[object], Awaitable[None]],
        on_lost: Callable[[str], Awaitable[None]],
        on_stall: Callable[[], None] = lambda: None,
        on_backlog: Callable[[], None] = lambda: None,
        protocol_errors: ProtocolErrors | None = None,
        limits: DataChannelLimits = DataChannelLimits(),
    ) -> None:
        """`on_stall()` each time the track finds no frame at a frame's due time (the server made the viewer stall);
        `on_backlog()` when the peer is closed for not taking its data channel's messages (a slow client)."""
        self.session = session
        self.stream_id = session.stream_id
        self.engine = engine
        self.config = config
        self._on_control, self._on_lost, self._on_stall, self._on_backlog = on_control, on_lost, on_stall, on_backlog
        self.pc: RTCPeerConnection | None = None
        self.channel = None  # the viewer's `control` data channel, once it opened
        self._channel_open = asyncio.Event()
        self.limits = limits
        self._inbox: asyncio.Queue[str | bytes | None] = asyncio.Queue(maxsize=limits.inbox)
        self.inbox_dropped = 0  # messages dropped because the inbox was full
        self.errors = protocol_errors or ProtocolErrors(DEFAULT_MAX_PROTOCOL_ERRORS)
        self.protocol = ViewerProtocol.on_channel(self.stream_id)  # what its data channel's messages mean
        self.guard = ReassemblyGuard(limits, on_refused=lambda what: self._refused(P.ErrorCode.TOO_LARGE, what),
                                     on_failed=lambda what: self._refused(P.ErrorCode.BAD_JSON, what))
        self.ice_guard = PeerReflexiveCap(config.max_remote_candidates, on_dropped=lambda addr: self._log_gated(
            "prflx", logging.INFO, f"an ICE check from a new address dropped: {config.max_remote_candidates} "
                                   "peer-reflexive candidates already"))
        self._log_gate = LogGate(BAD_INPUT_LOG_PERIOD_S)
        self.candidates_dropped = 0  # of the offer: never to be probed, or over the cap
        self._tasks: list[asyncio.Task] = []  # connect watchdog and channel reader, cancelled by close()
        self._lost_task: asyncio.Task | None = None  # on_lost(reason), left to finish: it ends the session
        self._closing_task: asyncio.Task | None = None  # close() started by too many protocol errors
        self._closed = False
        self._last_keyframe_request = float("-inf")
        self.keyframe_requests = 0
        self.camera: CameraInput | None = None  # the steerer's camera into its stream's input (issue 35), if it takes one
        # the viewer holds the frame sent last and its jitter buffer beyond the queue: a stall only past those
        self._grace_s = 1.0 / session.fps + config.viewer_jitter_s
        self.track = PacketTrack(
            session.fps,
            on_frame=self._frame_sent,
            on_queue=self._observe,
            on_stall=self._stalled,
            is_paused=lambda: session.state is SessionState.PAUSED,
            start_gate=self._wait_for_channel,
            max_frame_wait_s=config.max_frame_wait_s,
        )

    # -- signaling ---------------------------------------------------------------------------

    async def answer(self, offer_sdp: str) -> str:
        """The SDP answer to the viewer's offer, with every local candidate. Raises ``SignalingError``: then no
        peer connection is left (the viewer may send a corrected offer)."""
        if self._closed:
            raise SignalingError(f"stream {self.stream_id} is closed")
        if self.pc is not None:
            raise SignalingError("this stream already has a peer connection; renegotiation is not supported")
        offer = check_offer(offer_sdp, max_candidates=self.config.max_remote_candidates,
                            allow_loopback=_gathers_on_loopback(self.config.ice_addresses))
        if offer.dropped:
            self.candidates_dropped += sum(offer.dropped.values())
            # not always bad input (a browser hides its host addresses behind mDNS names): info, gated all the same
            dropped = ", ".join(f"{n} {reason}" for reason, n in sorted(offer.dropped.items()))
            self._log_gated("candidates", logging.INFO,
                            f"the offer's ICE candidates dropped (never probed): {dropped}; {offer.candidates} kept")
        pc = self.pc = RTCPeerConnection(rtc_configuration(self.config.ice_servers))
        try:
            sdp = await self._answer(pc, offer)
        except BaseException:
            self.pc = None  # the viewer may send a corrected offer
            with contextlib.suppress(Exception):
                await asyncio.wait_for(pc.close(), 5.0)
            raise
        self._tasks.append(asyncio.create_task(self._watch_connect(), name=f"rtc-connect-{self.stream_id}"))
        self._tasks.append(asyncio.create_task(self._run_inbox(), name=f"rtc-control-{self.stream_id}"))
        if self.camera is not None:
            self._tasks.append(self.camera.start())
        return sdp

    async def _answer(self, pc: RTCPeerConnection, offer: CheckedOffer) -> str:
        pc.on("datachannel", self._on_datachannel)
        pc.on("connectionstatechange", lambda: self._on_connection_state(pc))
        transceiver = pc.addTransceiver(self.track, direction="sendonly")
        transceiver.setCodecPreferences(h264_preferences())
        # a viewer's PLI/FIR goes to the stream's encoder (aiortc's own only affects frames aiortc encodes itself)
        route_keyframe_requests(transceiver.sender, self._keyframe_requested)
        try:
            await pc.setRemoteDescription(RTCSessionDescription(sdp=offer.sdp, type="offer"))
        except Exception as e:  # noqa: BLE001 - aiortc raises several types for a bad offer; the viewer gets the text
            if "video" in str(e):
                raise SignalingError(
                    f"the offer has no usable video codec ({e}): this server sends H.264 only, packetization-mode "
                    f"{H264_PACKETIZATION_MODE}, profile-level-id {H264_PROFILE_LEVEL_ID}"
                ) from None
            raise SignalingError(f"the offer could not be applied: {type(e).__name__}: {e}") from None
        if transceiver.mid is None:
            raise SignalingError("the offer has no video m-line: add a recvonly video transceiver before createOffer()")
        for connection in ice_connections(pc):  # peer-reflexive candidates capped as the offer's are
            self.ice_guard.install(connection)
        if pc.sctp is not None:
            self.guard.install(pc.sctp)
        else:  # no data channel offered (a WHEP player, streamsvc/door/whep.py): the first frame waits for none
            self._channel_open.set()
        # An offer's setup:actpass is answered passive: this side is the DTLS server, whose ECDSA certificate suits
        # every client (GStreamer's whepsrc shares no cipher suite with aiortc as a client: aiortc_hooks says why)
        answer_as_dtls_server(pc)
        # the stream's video m-line is answered sendrecv only for a steerer whose stream takes input (then its camera
        # is read into the stream's input, streamsvc/inputs/rtc.py), else sendonly: nothing is sent to us
        camera = CameraInput.for_viewer(self.session)
        self.camera = camera if camera is not None and camera.answering(transceiver) else None
        # Every other m-line (a microphone, a camera: input the server does not take yet) is answered inactive, so
        # no receiver decodes what the viewer sends; the answer rejects it (port 0) unless it holds the offer's
        # BUNDLE tag, whose transport the others share (rejecting that one would reject the whole group).
        others = {t.mid for t in pc.getTransceivers() if t is not transceiver and t.mid is not None}
        for other in pc.getTransceivers():
            if other is not transceiver:
                other.direction = "inactive"
        tag = offer.bundle[0] if offer.bundle else None
        try:
            sdp = await complete_local_description(
                pc, await pc.createAnswer(), self.config.ice_addresses, self.config.gather_timeout_s
            )
        except TimeoutError:
            raise SignalingError(f"ICE gathering took longer than {self.config.gather_timeout_s:g} s") from None
        sdp = reject_media(sdp, others - {tag})
        try:  # it fits, within check_offer's limits; never send what we would refuse
            size = len(P.encode(P.Answer(sdp=sdp)).encode())
        except ValueError:  # pydantic's ValidationError: the SDP alone is over the limit
            size = len(sdp)
        if size > P.MAX_MESSAGE_BYTES:
            raise SignalingError(f"the answer to this offer would be a {size}-byte message, over the protocol's "
                                 f"{P.MAX_MESSAGE_BYTES}: offer fewer m-lines")
        return sdp

    # -- from the server ----------------------------------------------------------------------

    def feed(self, chunk) -> None:
        """Queue a finished chunk (a ``ChunkOut``) for the track."""
        if not self._closed:
            self.track.push(chunk.packets, chunk.header)

    def send_control(self, msg) -> bool:
        """Send a server message on the data channel. True when it went there only; False: send it on the WebSocket.

        ``answer`` and ``ready`` (signaling) always go on the WebSocket, and
        so does everything before the channel opens; ``closed`` goes on both.
        """
        if isinstance(msg, (P.Answer, P.Ready)) or not self._channel_ready():
            return False
        if self.channel.bufferedAmount > self.limits.max_buffered_bytes:  # the peer takes none: a slow client
            self._backlogged()
            return True
        try:
            self.channel.send(P.encode(msg))
        except Exception:  # noqa: BLE001 - a channel closing under us: the WebSocket still carries it
            return False
        return not isinstance(msg, P.Closed)

    async def close(self) -> None:
        """Stop the track and close the peer connection (bounded). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.track.stop()
        t = self.track
        log.info("stream %s: track sent %d frames, %d stalls (%.3f s), %d keyframe requests",
                 self.stream_id, t.frames_sent, t.stalls, t.stall_s, self.keyframe_requests)
        if self.camera is not None:
            log.info("stream %s: %s", self.stream_id, self.camera.summary())
        if self.errors.count:
            log.info("stream %s: the viewer's peer made %d protocol errors (%d messages refused, %d dropped from a "
                     "full inbox)", self.stream_id, self.errors.count, self.guard.refused, self.inbox_dropped)
        with contextlib.suppress(asyncio.QueueFull):  # full: the reader is cancelled below
            self._inbox.put_nowait(None)
        if self.pc is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(5.0):
                    await self.pc.close()
        others = [t for t in self._tasks if t is not asyncio.current_task()]
        for task in others:
            task.cancel()
        if others:
            await asyncio.wait(others, timeout=2.0)

    # -- track callbacks -------------------------------------------------------------------------

    def _frame_sent(self, header: P.Chunk | None, buffered: float) -> None:
        if header is not None and not self.send_control(header):
            self.session.outbox.put_nowait(header)  # no channel: the header goes on the WebSocket as text
        self._observe(buffered)

    def _observe(self, buffered: float) -> None:
        if not self._closed:
            self.engine.observe_buffer(self.stream_id, buffered, grace_s=self._grace_s)

    def _stalled(self) -> None:
        if self._closed or self.session.closed:  # the stream is ending: no more frames is no stall
            return
        self._on_stall()
        self._observe(0)
        self.session.buffer_report(0.0)  # PLAYING -> STALLED; the next chunk delivered makes it PLAYING again

    def _keyframe_requested(self) -> None:
        now = time.monotonic()
        if now - self._last_keyframe_request < KEYFRAME_REQUEST_MIN_INTERVAL_S or self._closed:
            return
        self._last_keyframe_request = now
        self.keyframe_requests += 1
        # the viewer decides how often: a line per period at most
        self._log_gated("keyframe", logging.INFO, "the viewer lost a picture (PLI/FIR); next chunk starts with an IDR")
        self.engine.request_keyframe(self.stream_id)

    async def _wait_for_channel(self) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._channel_open.wait(), self.config.channel_wait_s)
        if self.camera is not None:  # input video: the first chunk plays when the scheduler plans it to
            await self.camera.hold_first_chunk(self.track, self.config.max_frame_wait_s)

    # -- peer connection events ------------------------------------------------------------------

    def _channel_ready(self) -> bool:
        return self.channel is not None and self.channel.readyState == "open"

    def _on_datachannel(self, channel) -> None:
        if channel.label != CONTROL_CHANNEL or self.channel is not None:
            self._log_bad_input(f"ignoring data channel {channel.label[:64]!r} (only one named {CONTROL_CHANNEL!r} "
                                "is used)")
            return
        self.channel = channel
        channel.on("message", self._received)
        self._channel_open.set()

    def _received(self, raw: str | bytes) -> None:
        """A whole message on the control channel: into the inbox, or dropped (a protocol error) when it is full."""
        if self._closed:
            return
        if len(raw) > self.limits.max_message_bytes:  # the guard refuses these below aiortc, if it is installed
            self._refused(P.ErrorCode.TOO_LARGE, f"a message of {len(raw)} bytes, over {self.limits.max_message_bytes}")
            return
        try:
            self._inbox.put_nowait(raw)
        except asyncio.QueueFull:
            self.inbox_dropped += 1
            self._protocol_error(f"a data channel message dropped: {self.limits.inbox} wait already (send fewer)")

    def _refused(self, code: P.ErrorCode, what: str) -> None:
        """A message on the data channel refused (too large, or undeliverable): the peer hears why, on the channel,
        and it counts as a protocol error."""
        if not (self._closed or self._closing_task is not None):
            self.send_control(P.Error(code=code, message=f"data channel message refused: {what}"[: P.MAX_TEXT_CHARS]))
        self._protocol_error(what)

    def _backlogged(self) -> None:
        """The peer leaves the server's messages on its data channel unacknowledged past the bound: closed, as a
        WebSocket that does not read is (streamsvc/viewers/outbox.py)."""
        if self._closed or self._closing_task is not None:
            return
        self._on_backlog()
        self._report_lost(f"slow client: {self.channel.bufferedAmount} bytes unsent on the data channel (limit "
                          f"{self.limits.max_buffered_bytes})")
        self._spawn_close()

    def _protocol_error(self, what: str) -> None:
        """Count a bad message from the viewer's peer; the limit-th within the window closes the peer connection."""
        if self._closed or self._closing_task is not None:
            return
        self._log_bad_input(what)
        if self.errors.add(time.monotonic()):
            self._report_lost(f"{self.errors.limit} protocol errors within {self.errors.window_s:g} s on the WebRTC "
                              f"connection (the last: {what})")
            self._spawn_close()

    def _log_bad_input(self, what: str) -> None:
        self._log_gated("bad input", logging.WARNING, what)

    def _log_gated(self, key: str, level: int, what: str) -> None:
        """A line the viewer's input causes: at most one of each `key` every BAD_INPUT_LOG_PERIOD_S, with a count."""
        held_back = self._log_gate.allow(key, time.monotonic())
        if held_back is not None:
            log.log(level, "stream %s: %s%s", self.stream_id, what, _held_back(held_back))

    def _spawn_close(self) -> None:
        """Close the peer connection now, from a callback (the viewer's end follows through `on_lost`)."""
        task = asyncio.get_running_loop().create_task(self.close(), name=f"rtc-close-{self.stream_id}")
        self._closing_task = task  # referenced until done

    def _on_connection_state(self, pc: RTCPeerConnection) -> None:
        if pc is not self.pc:  # a connection given up on during signaling
            return
        state = pc.connectionState
        log.debug("stream %s: peer connection %s", self.stream_id, state)
        if state == "failed":
            self._report_lost("the WebRTC connection failed (ICE or DTLS)")
        elif state == "closed":
            self._report_lost("the WebRTC connection was closed")

    def _report_lost(self, reason: str) -> None:
        if self._closed or self._lost_task is not None:
            return
        self._lost_task = asyncio.create_task(self._on_lost(reason), name=f"rtc-lost-{self.stream_id}")

    async def _watch_connect(self) -> None:
        deadline = time.monotonic() + self.config.connect_timeout_s
        for _ in range(int(self.config.connect_timeout_s / 0.05) + 2):
            if self._closed or self.pc is None or self.pc.connectionState == "connected":
                return
            if time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.05)
        self._report_lost(f"no WebRTC connection within {self.config.connect_timeout_s:g} s (ICE found no working pair)")

    async def _run_inbox(self) -> None:
        """The viewer's messages on the data channel, one at a time, in order (like the WebSocket handler)."""
        while True:  # ends with the None that close() queues
            raw = await self._inbox.get()
            if raw is None or self._closed:
                return
            answer = None
            for action in self.protocol.receive_on_channel(raw):  # streamsvc/viewers/protocol.py decides
                if isinstance(action, Send):
                    answer = action.message
                    self.send_control(answer)
                elif isinstance(action, Violation):
                    self._protocol_error(f"a bad message on the data channel ({answer.code.value}: "
                                         f"{answer.message[:200]})")
                else:
                    await self._on_control(action.message)


def _held_back(count: int) -> str:
    return f" ({count} more such lines held back in the last {BAD_INPUT_LOG_PERIOD_S:g} s)" if count else ""


def _gathers_on_loopback(addresses: Sequence[str] | None) -> bool:
    """Whether the server's own host candidates include a loopback address (then a viewer's may be on loopback)."""
    return any(a != ANY_INTERFACE and ipaddress.ip_address(a).is_loopback for a in addresses or ())
