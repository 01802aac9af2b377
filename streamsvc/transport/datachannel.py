"""Bounds on what a WebRTC peer's data channels make the server hold: the SCTP reassembly below aiortc.

aiortc's SCTP association (``RTCSctpTransport``) reassembles each message from its DATA chunks in an
``InboundStream`` that has no bound: a peer that ignores the advertised ``max-message-size`` had an 8 MiB
message reassembled whole (+24.5 MiB of RSS, 4.4 s of CPU: ``pop_messages`` rescans the whole reassembly on
each chunk), and checks above aiortc (our message size) only come once a message is whole. Chunks far ahead
of the cumulative TSN are kept too (and each one adds a gap to every SACK), on as many streams as the peer
names (up to 65,535).

``ReassemblyGuard.install(sctp)`` bounds one association, ours only: it wraps how that instance receives a DATA
chunk and makes a stream's ``InboundStream`` (other peer connections in the process, the Python client's included,
keep aiortc's own), and has the answer advertise ``max_message_bytes`` (a well-behaved sender, a browser's
``RTCDataChannel.send`` too, refuses to send more). Before aiortc takes a DATA chunk, the guard:

- drops, unacknowledged, a chunk more than ``tsn_window`` TSNs ahead (the peer sends it again: RFC 4960 lets
  a receiver drop what it cannot hold);
- refuses a message that would pass ``max_message_bytes``, any chunk that would make the peer's partial
  messages pass ``max_held_bytes`` or ``max_held_chunks``, and a message on more than ``max_streams`` SCTP
  streams. A refusal discards every partial message the peer has (an abusive peer; a well-behaved one
  never has more than a message in flight), skips each ordered stream past what was discarded, and drops
  the refused message's later fragments (acknowledged, so the peer does not resend them);
- counts a message that aiortc fails to deliver (invalid UTF-8, an open of an open channel) instead of
  letting the exception close the DTLS transport with a traceback.

Each refusal calls ``on_refused(reason)``, a message aiortc fails to deliver ``on_failed(reason)`` (by default the
same): the transport answers it with an error the peer sees, and counts it as a protocol error. What the guard uses of
aiortc's association below its API goes through ``SctpAssociation`` (streamsvc/transport/aiortc_hooks.py, which names
it: ``SCTP_HOOKS``); besides it, ``InboundStream.reassembly`` and ``sequence_number`` and the ``DataChunk`` fields,
the same in aiortc 1.9 to 1.16. ``install`` returns False (and the transport keeps its own message-level checks) if a
later aiortc lacks it, and ``tests/streamsvc/test_hooks.py`` and ``tests/streamsvc/test_webrtc_abuse.py`` fail
loudly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from aiortc.rtcsctptransport import InboundStream

from streamsvc.transport import aiortc_hooks
from streamsvc.transport.aiortc_hooks import SctpAssociation
from streamsvc.wire.protocol import MAX_MESSAGE_BYTES

log = logging.getLogger("streamsvc.webrtc")

_LAST, _FIRST, _UNORDERED = 0x01, 0x02, 0x04  # DATA chunk flags (RFC 4960 section 3.3.1)
_TSN_MODULO, _SSN_MODULO = 2**32, 2**16


@dataclass(frozen=True)
class DataChannelLimits:
    """What one peer's data channels may make the server hold."""

    max_message_bytes: int = MAX_MESSAGE_BYTES  # advertised as max-message-size; a larger message is refused
    max_held_bytes: int = 2 * MAX_MESSAGE_BYTES  # the peer's partial messages, all streams together
    max_held_chunks: int = 256  # their DATA chunks (tiny fragments cost a Python object each)
    max_streams: int = 8  # SCTP streams the peer may send on (a data channel is one; we use one)
    tsn_window: int = 512  # chunks further ahead than this of the cumulative TSN are dropped unacknowledged
    inbox: int = 16  # whole messages waiting for the control handler; more are dropped (and counted)
    # the server's messages queued on the channel unsent (the peer acknowledges nothing): past it the peer is closed
    max_buffered_bytes: int = 256 << 10

    def __post_init__(self) -> None:
        for name in ("max_message_bytes", "max_held_bytes", "max_held_chunks", "max_streams", "tsn_window", "inbox",
                     "max_buffered_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: give at least 1")
        if self.max_held_bytes < self.max_message_bytes:
            raise ValueError(f"max_held_bytes={self.max_held_bytes} < max_message_bytes={self.max_message_bytes}: "
                             "a message the peer may send would not fit")


class ReassemblyGuard:
    """Bounds one SCTP association's reassembly (see the module's docstring). Counters for logs and tests."""

    def __init__(self, limits: DataChannelLimits, on_refused: Callable[[str], None] = lambda reason: None,
                 on_failed: Callable[[str], None] | None = None) -> None:
        self.limits = limits
        self._on_refused = on_refused
        self._on_failed = on_failed or on_refused
        self._sctp: SctpAssociation | None = None
        self._skip: dict[int, int] = {}  # stream id -> next TSN of an unordered refused message still arriving
        self.refused = 0  # messages refused
        self.dropped_chunks = 0  # chunks dropped: of refused messages, or out of the window
        self.failed = 0  # messages aiortc raised on
        self.held_peak = 0  # most bytes of partial messages held at once

    def install(self, sctp) -> bool:
        """Bound this association (an ``RTCSctpTransport``) from now on. False: this aiortc lacks the hooks."""
        missing = aiortc_hooks.missing(sctp, aiortc_hooks.SCTP_HOOKS)
        if missing:
            log.warning("aiortc %s lacks %s: data channel reassembly is not bounded below aiortc",
                        aiortc_hooks.aiortc_version(), ", ".join(missing))
            return False
        self._sctp = association = SctpAssociation(sctp)
        max_streams = self.limits.max_streams

        def get_inbound_stream(stream_id: int, get_stream):
            # a FORWARD TSN chunk may name any stream: past the cap it gets one that is not kept
            streams = association.inbound_streams
            if stream_id in streams or len(streams) < max_streams:
                return get_stream(stream_id)
            return InboundStream()

        association.wrap_receive_data_chunk(self._receive)
        association.wrap_get_inbound_stream(get_inbound_stream)
        association.advertise_max_message_size(self.limits.max_message_bytes)
        return True

    def held(self) -> tuple[int, int]:
        """Bytes and chunks of partial messages held now, all streams together (0, 0 before `install`)."""
        if self._sctp is None:
            return 0, 0
        chunks = [c for stream in self._sctp.inbound_streams.values() for c in stream.reassembly]
        return sum(len(c.user_data) for c in chunks), len(chunks)

    async def _receive(self, chunk, receive) -> None:
        sctp = self._sctp
        verdict = self._verdict(chunk)
        if verdict is None:
            try:
                await receive(chunk)
            except Exception as e:  # noqa: BLE001 - aiortc raises on some peer input; it must not end the transport
                self.failed += 1
                self._on_failed(f"a data channel message aiortc could not deliver ({type(e).__name__}: {e})")
            return
        self.dropped_chunks += 1
        sctp.request_sack()
        if verdict != "window":
            sctp.acknowledge(chunk.tsn)  # acknowledged: the peer does not send it again

    def _verdict(self, chunk) -> str | None:
        """None: aiortc takes the chunk. Else why it is dropped: "window", "skip" (a refused message's fragment) or
        "refused" (it is refused now)."""
        sctp, limits = self._sctp, self.limits
        last = sctp.last_received_tsn
        if last is None or sctp.is_misordered(chunk.tsn):
            return None  # before the association is up, or a duplicate: aiortc's own handling
        ahead = (chunk.tsn - last) % _TSN_MODULO
        if ahead == 0 or ahead >= _TSN_MODULO // 2:
            return None  # a duplicate
        if ahead > limits.tsn_window:
            return "window"
        sid = chunk.stream_id
        stream = sctp.inbound_streams.get(sid)
        if stream is None and len(sctp.inbound_streams) >= limits.max_streams:
            return self._refuse(chunk, f"a message on more than {limits.max_streams} SCTP streams")
        if chunk.flags & _UNORDERED:
            if self._skip.get(sid) == chunk.tsn and not chunk.flags & _FIRST:
                self._skip_next(chunk)
                return "skip"
            self._skip.pop(sid, None)
        elif stream is not None and 0 < (stream.sequence_number - chunk.stream_seq) % _SSN_MODULO < _SSN_MODULO // 2:
            return "skip"  # its message was delivered or refused already
        size = len(chunk.user_data)
        message = size + (_partial_bytes(stream, chunk) if stream is not None else 0)
        if message > limits.max_message_bytes:
            return self._refuse(chunk, f"a message of more than {limits.max_message_bytes} bytes (the advertised "
                                       "max-message-size)")
        held_bytes, held_chunks = self.held()
        if held_bytes + size > limits.max_held_bytes or held_chunks + 1 > limits.max_held_chunks:
            return self._refuse(chunk, f"partial messages of more than {limits.max_held_bytes} bytes or "
                                       f"{limits.max_held_chunks} chunks")
        self.held_peak = max(self.held_peak, held_bytes + size)
        return None

    def _refuse(self, chunk, reason: str) -> str:
        """Discard every partial message, skip past them, and drop the rest of `chunk`'s message as it comes."""
        sctp = self._sctp
        for stream in sctp.inbound_streams.values():
            self._discard(stream)
        if not chunk.flags & _UNORDERED:
            stream = sctp.inbound_streams.get(chunk.stream_id)
            if stream is None and len(sctp.inbound_streams) < self.limits.max_streams:
                stream = sctp.inbound_stream(chunk.stream_id)
            if stream is not None:
                _skip_past(stream, [chunk.stream_seq])
        elif not chunk.flags & _LAST:
            self._skip_next(chunk)
        self.refused += 1
        self._on_refused(reason)
        return "refused"

    def _discard(self, stream) -> None:
        if not stream.reassembly:
            return
        self._sctp.release_window(sum(len(c.user_data) for c in stream.reassembly))
        _skip_past(stream, [c.stream_seq for c in stream.reassembly if not c.flags & _UNORDERED])
        stream.reassembly = []  # aiortc rebinds this list itself (it slices it), so a new one is safe

    def _skip_next(self, chunk) -> None:
        if chunk.flags & _LAST:
            self._skip.pop(chunk.stream_id, None)
        else:
            self._skip[chunk.stream_id] = (chunk.tsn + 1) % _TSN_MODULO


def _partial_bytes(stream, chunk) -> int:
    """Bytes held of the message `chunk` belongs to: ordered, those of its stream sequence number; unordered,
    the fragments next to it in TSN order (a message's fragments have consecutive TSNs)."""
    if not chunk.flags & _UNORDERED:
        return sum(len(c.user_data) for c in stream.reassembly
                   if not c.flags & _UNORDERED and c.stream_seq == chunk.stream_seq)
    by_tsn = {c.tsn: c for c in stream.reassembly if c.flags & _UNORDERED}
    total = 0
    for step, stop_before, stop_after in ((-1, _LAST, _FIRST), (1, _FIRST, _LAST)):
        if chunk.flags & stop_after:
            continue
        tsn = chunk.tsn
        for _ in range(len(by_tsn)):
            tsn = (tsn + step) % _TSN_MODULO
            c = by_tsn.get(tsn)
            if c is None or c.flags & stop_before:
                break
            total += len(c.user_data)
            if c.flags & stop_after:
                break
    return total


def _skip_past(stream, sequence_numbers: list[int]) -> None:
    """Move an ordered stream's next expected sequence number past those given (the ones at or ahead of it)."""
    current = stream.sequence_number
    ahead = [(s - current) % _SSN_MODULO for s in sequence_numbers]
    ahead = [d for d in ahead if d < _SSN_MODULO // 2]
    if ahead:
        stream.sequence_number = (current + max(ahead) + 1) % _SSN_MODULO

