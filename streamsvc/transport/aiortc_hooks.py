"""aiortc's private names: the one module of streamsvc/ that touches them (issue 42, part 4).

The server needs a few things of aiortc that its public API does not give, and reaches below it for them here only:

- the DTLS role of an answer (``answer_as_dtls_server``: streamsvc/transport/webrtc.py, streamsvc/door/whip.py);
- a peer connection's ICE agents (``ice_connections``: the aioice ``Connection`` each ``RTCIceTransport`` keeps, which
  streamsvc/transport/ice.py bounds);
- a viewer's keyframe requests (``route_keyframe_requests``: to the stream's encoder, not aiortc's);
- an SCTP association's receive side (``SctpAssociation``: streamsvc/transport/datachannel.py's reassembly bounds);
- a receiver's RTCP, timestamp origin, decoder-error event, decoder thread, decoding switch and jitter buffer, and
  the jitter buffer's frame hand-over (``wrap_rtcp_handler``, ``timestamp_origin``, ``replace_decoder_error_event``,
  ``decoder_thread``, ``disable_decoding``, ``stop_decoder``, ``has_jitter_buffer``/``replace_jitter_buffer``,
  ``HandOverJitterBuffer``: streamsvc/inputs/rtc.py's camera input).

Only the mechanism is here; the policy (the caps, the gates, their verdicts, what is logged when a hook is missing)
stays with the callers. Each function touches the one instance it is given: other peer connections in the process,
the Python client's included, keep aiortc's own behaviour.

What this uses of aiortc is data: ``HOOKED``, (module, class, name) for each name, and the tuples the callers check an
instance against before hooking it (``SCTP_HOOKS``, ``CLOCK_HOOKS``, ``DECODER_HOOKS``: an ``install`` that finds one
missing returns False and logs a warning, as before). It was tested against aiortc ``TESTED_VERSION``; pyproject.toml
pins aiortc below the next minor version, and tests/streamsvc/test_hooks.py checks every name in the installed aiortc
(and that no other module of streamsvc/ uses one), so an upgrade fails there, loudly, before anything else.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable, Iterable, Iterator

from aiortc.jitterbuffer import JitterBuffer, JitterFrame

LIBRARY = "aiortc"
TESTED_VERSION = "1.16.0"

_RECEIVER = "_RTCRtpReceiver__"  # RTCRtpReceiver's name-mangled private attributes
SCTP_HOOKS = ("_receive_data_chunk", "_get_inbound_stream", "_mark_received", "_inbound_streams", "_last_received_tsn",
              "_sack_misordered", "_sack_needed", "_advertised_rwnd", "getCapabilities")
"""What ``SctpAssociation`` uses of an ``RTCSctpTransport``."""
CLOCK_HOOKS = ("_handle_rtcp_packet", f"{_RECEIVER}timestamp_mapper", f"{_RECEIVER}decoder_error")
"""What the sender clock (streamsvc/inputs/rtc.py ``SenderClock``) uses of an ``RTCRtpReceiver``."""
DECODER_HOOKS = (f"{_RECEIVER}decoder_thread", f"{_RECEIVER}stop_decoder", "_enabled")
"""What ``stop_decoder`` uses of an ``RTCRtpReceiver`` (streamsvc/inputs/rtc.py ``ReceiverGate``)."""
JITTER_BUFFER = f"{_RECEIVER}jitter_buffer"
"""Where an ``RTCRtpReceiver`` keeps its jitter buffer."""

HOOKED = (
    ("aiortc.rtcdtlstransport", "RTCDtlsTransport", "_role"),
    ("aiortc.rtcdtlstransport", "RTCDtlsTransport", "_set_role"),
    ("aiortc.rtcicetransport", "RTCIceTransport", "_connection"),
    ("aiortc.rtcrtpsender", "RTCRtpSender", "_send_keyframe"),
    *(("aiortc.rtcsctptransport", "RTCSctpTransport", name) for name in SCTP_HOOKS),
    *(("aiortc.rtcrtpreceiver", "RTCRtpReceiver", name) for name in CLOCK_HOOKS + DECODER_HOOKS + (JITTER_BUFFER,)),
    ("aiortc.rtcrtpreceiver", "TimestampMapper", "_origin"),
    ("aiortc.jitterbuffer", "JitterBuffer", "_remove_frame"),
    ("aiortc.jitterbuffer", "JitterBuffer", "_packets"),
    ("aiortc.jitterbuffer", "JitterBuffer", "_origin"),
    ("aiortc.rtp", "RtpPacket", "_data"),
)
"""Every name of aiortc this module uses: (module, class or None for a module attribute, name)."""
SET_ELSEWHERE = {("aiortc.rtp", "RtpPacket", "_data"): "aiortc.rtcrtpreceiver"}
"""Instance attributes of HOOKED that aiortc sets outside their class's ``__init__``: the module that sets them (the
receiver depayloads each packet into its ``_data``)."""


def aiortc_version() -> str:
    """The installed aiortc's version (for warnings)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(LIBRARY)
    except PackageNotFoundError:
        return "(unknown version)"


def missing(obj, names: Iterable[str]) -> list[str]:
    """Those of `names` that `obj` (an aiortc instance) lacks: what this aiortc moved or renamed."""
    return [name for name in names if not hasattr(obj, name)]


# ---------------------------------------------------------------- a peer connection


def answer_as_dtls_server(pc, transceivers: Iterable | None = None) -> None:
    """Answer an offer's ``setup:actpass`` passive: each DTLS transport of `pc` (its transceivers' and its SCTP
    association's; those of `transceivers` only, where given) whose role is still "auto" becomes the DTLS server.
    Call it after ``setRemoteDescription`` and before ``createAnswer``.

    Why: as a DTLS client aiortc offers ECDSA cipher suites only, which GStreamer 1.22's DTLS (webrtcbin: whepsrc,
    whip-client, whipclientsink) does not share with its RSA certificate ("no shared cipher"); as the server, aiortc's
    ECDSA certificate suits every client. aiortc has no public way to choose its role."""
    if transceivers is None:
        transports = {t.receiver.transport for t in pc.getTransceivers()} | ({pc.sctp.transport} if pc.sctp else set())
    else:
        transports = {t.receiver.transport for t in transceivers}
    for dtls in transports:
        if dtls._role == "auto":
            dtls._set_role("server")


def ice_connections(pc) -> list:
    """The aioice ``Connection`` of each of an aiortc peer connection's transports (one under BUNDLE)."""
    dtls = [t.receiver.transport for t in pc.getTransceivers()] + ([pc.sctp.transport] if pc.sctp else [])
    found = {}
    for transport in dtls:
        connection = getattr(transport.transport, "_connection", None)  # RTCDtlsTransport -> RTCIceTransport -> it
        if connection is not None:
            found[id(connection)] = connection
    return list(found.values())


def route_keyframe_requests(sender, on_request: Callable[[], None]) -> None:
    """Call `on_request()` for each keyframe request (an RTCP PLI or FIR) `sender` (an ``RTCRtpSender``) gets. aiortc
    turns one into ``sender._send_keyframe()``, which only affects frames aiortc encodes itself; the server's packets
    come from the stream's encoder, so the request goes there instead."""
    sender._send_keyframe = on_request


# ---------------------------------------------------------------- an SCTP association


class SctpAssociation:
    """The receive side of one aiortc SCTP association (an ``RTCSctpTransport``), as streamsvc/transport/datachannel.py
    bounds it. Check ``missing(sctp, SCTP_HOOKS)`` first."""

    def __init__(self, sctp) -> None:
        self.sctp = sctp

    @property
    def inbound_streams(self) -> dict:
        """Stream id -> its ``InboundStream`` (aiortc's own dict, live: read it, change nothing in it)."""
        return self.sctp._inbound_streams

    @property
    def last_received_tsn(self) -> int | None:
        """The cumulative TSN: every DATA chunk up to it was received (None before the association is up)."""
        return self.sctp._last_received_tsn

    def is_misordered(self, tsn: int) -> bool:
        """Whether the chunk `tsn` was received already, ahead of the cumulative TSN (a gap its SACKs report)."""
        return tsn in self.sctp._sack_misordered

    def acknowledge(self, tsn: int) -> None:
        """Count the chunk `tsn` received (its next SACK acknowledges it: the peer does not send it again)."""
        self.sctp._mark_received(tsn)

    def request_sack(self) -> None:
        """Have the association send a SACK after this packet, as it does after a DATA chunk it takes."""
        self.sctp._sack_needed = True

    def release_window(self, n_bytes: int) -> None:
        """Give back `n_bytes` of the advertised receive window (bytes of partial messages discarded)."""
        self.sctp._advertised_rwnd += n_bytes

    def inbound_stream(self, stream_id: int):
        """The stream's ``InboundStream``, made if new (through ``wrap_get_inbound_stream``'s wrapper, once given)."""
        return self.sctp._get_inbound_stream(stream_id)

    def wrap_receive_data_chunk(self, wrapper: Callable[[object, Callable[[object], Awaitable[None]]],
                                                        Awaitable[None]]) -> None:
        """From now on each DATA chunk goes to ``await wrapper(chunk, receive)`` (`receive`: aiortc's own)."""
        receive = self.sctp._receive_data_chunk

        async def receive_data_chunk(chunk) -> None:
            await wrapper(chunk, receive)

        self.sctp._receive_data_chunk = receive_data_chunk

    def wrap_get_inbound_stream(self, wrapper: Callable[[int, Callable[[int], object]], object]) -> None:
        """From now on aiortc gets a stream's ``InboundStream`` from ``wrapper(stream_id, get)`` (`get`: its own)."""
        get = self.sctp._get_inbound_stream

        def get_inbound_stream(stream_id: int):
            return wrapper(stream_id, get)

        self.sctp._get_inbound_stream = get_inbound_stream

    def advertise_max_message_size(self, n_bytes: int) -> None:
        """The answer's ``max-message-size``: `n_bytes` (aiortc's ``getCapabilities``, on this instance)."""
        from aiortc.rtcsctptransport import RTCSctpCapabilities

        capabilities = RTCSctpCapabilities(maxMessageSize=n_bytes)
        self.sctp.getCapabilities = lambda: capabilities


# ---------------------------------------------------------------- a receiver


def wrap_rtcp_handler(receiver, on_packet: Callable[[object], None]) -> None:
    """Call `on_packet(packet)` for each RTCP packet `receiver` (an ``RTCRtpReceiver``) gets, after aiortc's own
    handling of it (its stats, the LSR of its receiver reports). Check ``missing(receiver, CLOCK_HOOKS)`` first."""
    handle = receiver._handle_rtcp_packet

    async def handle_rtcp_packet(packet) -> None:
        await handle(packet)
        on_packet(packet)

    receiver._handle_rtcp_packet = handle_rtcp_packet


def replace_decoder_error_event(receiver, event: threading.Event) -> None:
    """The ``threading.Event`` the receiver's decoder thread sets on a frame it cannot decode (read to send a PLI):
    `event` instead. Before the receiver starts (its decoder thread is given the event then)."""
    setattr(receiver, f"{_RECEIVER}decoder_error", event)


def timestamp_origin(receiver) -> int | None:
    """The RTP timestamp of the receiver's pts 0 (its first frame's; aiortc's ``TimestampMapper``), None until then."""
    return getattr(getattr(receiver, f"{_RECEIVER}timestamp_mapper", None), "_origin", None)


def decoder_thread(receiver) -> threading.Thread | None:
    """The receiver's decoder thread: None before it starts, once it has ended, or where aiortc keeps none."""
    return getattr(receiver, f"{_RECEIVER}decoder_thread", None)


def disable_decoding(receiver) -> None:
    """aiortc's own switch (a sendonly transceiver's): the receiver drops its packets undecoded from now on."""
    receiver._enabled = False


def stop_decoder(receiver) -> bool:
    """Drop the receiver's packets from now on and end its decoder thread (its pictures freed; off the event loop: it
    joins the thread). False, and nothing done, where there is no receiver or this aiortc lacks ``DECODER_HOOKS``."""
    if receiver is None or missing(receiver, DECODER_HOOKS):
        return False
    receiver._enabled = False
    getattr(receiver, f"{_RECEIVER}stop_decoder")()
    return True


def has_jitter_buffer(receiver) -> bool:
    """Whether the receiver keeps a jitter buffer where ``replace_jitter_buffer`` puts one."""
    return isinstance(getattr(receiver, JITTER_BUFFER, None), JitterBuffer)


def replace_jitter_buffer(receiver, buffer: JitterBuffer) -> None:
    """The receiver's jitter buffer: `buffer` instead (before the receiver starts)."""
    setattr(receiver, JITTER_BUFFER, buffer)


class HandOverJitterBuffer(JitterBuffer):
    """aiortc's video jitter buffer with its frame hand-over open to a subclass: aiortc looks for a whole frame after
    each packet it adds (its ``_remove_frame``); here ``hand_over(sequence_number)`` answers, by default aiortc's own
    rule (``aiortc_hand_over``: a frame once a packet of the next one arrives). ``packets_from_origin`` and ``payload``
    read what it holds."""

    def __init__(self, capacity: int = 512) -> None:  # aiortc's video capacity
        super().__init__(capacity=capacity, is_video=True)

    def hand_over(self, sequence_number: int) -> JitterFrame | None:
        """The frame to hand to the decoder now, if any (removed from the buffer), after the packet `sequence_number`
        was added."""
        return self.aiortc_hand_over(sequence_number)

    def aiortc_hand_over(self, sequence_number: int) -> JitterFrame | None:
        return super()._remove_frame(sequence_number)

    def _remove_frame(self, sequence_number: int) -> JitterFrame | None:
        return self.hand_over(sequence_number)

    def packets_from_origin(self) -> Iterator:
        """The packets held from the oldest on, in sequence order, up to the first one missing (a packet to come, or
        lost). The n-th one's frame is removed with ``remove(n)``."""
        for count in range(self.capacity):
            packet = self._packets[(self._origin + count) % self.capacity]
            if packet is None:
                return
            yield packet

    @staticmethod
    def payload(packet) -> bytes:
        """A packet's depayloaded bytes (set by aiortc's receiver): a frame's data is its packets' joined."""
        return packet._data
