"""The WebSocket's binary messages: chunks of video down, and input video up (issue 35), in one framing.

A wire module: it imports nothing of ours but the other wire modules (streamsvc/wire/protocol.py, whose
``pack_chunk`` and ``unpack_chunk`` make and read the chunks); the client and the server both use it.

Chunks (down)
-------------
Each chunk of video is one binary WebSocket message::

    offset  size  content
    0       4     magic b"SSC1" (stream chunk, framing version 1)
    4       4     H: length of the header in bytes, unsigned 32-bit big-endian
    8       H     the chunk header: a ``chunk`` message as UTF-8 JSON
    8+H     ...   the frames' H.264 access units (Annex-B), back to back, in
                  frame order; frame i's access unit is ``sizes[i]`` bytes

The payload is exactly ``sum(sizes)`` bytes; anything else is refused. On the
WebRTC data channel the chunk header is the same JSON ``chunk`` message, sent
as text, without the payload (the frames travel as RTP).

A chunk's ``pts`` is the stream index of its first frame (frames count from 0
at the start of the stream), so frame i of a chunk is frame ``pts + i`` and
plays at ``(pts + i) / fps`` seconds of stream time. ``keyframe`` is true when
the chunk's first access unit is an IDR frame carrying SPS/PPS: a viewer can
start decoding at that chunk.

Input video (up)
----------------
A ``start`` with ``"input": true`` opens a stream that takes the viewer's video (a camera)
and restyles it under the prompt, at ``strength`` (1: text-to-video, lower: closer to the input), snapped to the
model's schedule (``ready`` lists ``strengths`` and the snapped ``strength``; ``set_strength`` steers it live, from
the next chunk, acked with the snapped value). A model with no encoder refuses it at ``start`` (``refused``, with
the reason). Over WebSocket the input is H.264 in the binary messages below; over WebRTC it is
the peer connection's video track. Each chunk's header says its ``input`` ("none", "frames", or "missing" when the
input had stopped: that chunk is text-to-video) and, per frame, the ``capture_ms`` of the input frame it restyles
(the sender's clock, echoed), so the viewer computes glass-to-glass latency in its own clock. A chunk is due to
play ``input_latency_s`` after its last input frame was captured.

A stream whose ``start`` asked for input (``"input": true``) may send, after its ``ready``, binary messages::

    offset  size  content
    0       4     magic b"SSC1" (the downstream chunk's framing, version 1)
    4       4     H: length of the header in bytes, unsigned 32-bit big-endian
    8       H     the input header: an ``input`` message as UTF-8 JSON
    8+H     ...   the frames' H.264 access units (Annex-B), back to back, in frame order; frame i's is
                  ``sizes[i]`` bytes

    {"type": "input", "index": 3, "pts": 36, "frames": 12, "keyframe": false, "capture_ms": [...],
     "sizes": [2311, 187, ...]}

``index`` counts the sender's input messages from 0, ``pts`` is the sender's index of the first frame, ``keyframe``
says the first access unit is an IDR with SPS/PPS (a decoder can start there), ``capture_ms`` is each frame's
capture time in the sender's clock (milliseconds since the epoch, like ``Date.now()``): the server resamples the
input by it and echoes it in the chunks made from those frames. One message may carry one frame (a camera sends
each frame as it comes) or several.

Such a connection's messages may be up to ``MAX_INPUT_BYTES``; every other connection keeps the control limit
(``protocol.MAX_MESSAGE_BYTES``: a larger message closes it with 1009). An input message that does not follow the
framing is answered with an ``error`` (``bad_chunk``) and dropped; H.264 the server cannot decode counts as decode
errors; the stream goes on either way.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import Field, ValidationError, model_validator

from streamsvc.wire import errors as wire_errors
from streamsvc.wire.protocol import (
    CHUNK_PREFIX_BYTES,
    BaseMessage,
    ErrorCode,
    FrameCount,
    ProtocolError,
    framed_header,
    framed_units,
    pack_framed,
)

MAX_INPUT_BYTES = 4 * 1024 * 1024
"""Largest input message (one or more frames with an IDR at camera resolution fit)."""
MAX_CAPTURE_MS = 1e15  # capture times are milliseconds in [0, this] (epoch milliseconds until the year 33658)


class InputHeader(BaseMessage):
    """Header of one input message of H.264 frames (see the module docstring)."""

    type: Literal["input"] = "input"
    index: Annotated[int, Field(ge=0)]  # message number, from 0
    pts: Annotated[int, Field(ge=0)]  # the sender's index of the first frame
    frames: FrameCount  # frames (= access units) in the message
    keyframe: bool  # the first access unit is an IDR with SPS/PPS
    capture_ms: list[Annotated[float, Field(ge=0.0, le=MAX_CAPTURE_MS)]]  # per frame, the sender's clock, ms
    sizes: list[Annotated[int, Field(ge=1, le=MAX_INPUT_BYTES)]]  # byte size of each frame's access unit

    @model_validator(mode="after")
    def _one_per_frame(self) -> InputHeader:
        if len(self.sizes) != self.frames or len(self.capture_ms) != self.frames:
            raise ValueError(f"sizes has {len(self.sizes)} and capture_ms {len(self.capture_ms)} entries but frames "
                             f"is {self.frames}; give one of each per frame")
        return self

    @classmethod
    def describe(cls, access_units: list[bytes], capture_ms: list[float], *, index: int, pts: int,
                 keyframe: bool) -> InputHeader:
        return cls(index=index, pts=pts, frames=len(access_units), keyframe=keyframe, capture_ms=list(capture_ms),
                   sizes=[len(au) for au in access_units])


def pack_input(header: InputHeader, access_units: list[bytes]) -> bytes:
    """One binary input message: prefix, JSON header, access units. The header must describe them."""
    return pack_framed(header.model_dump_json().encode("utf-8"), header.sizes, access_units)


def unpack_input(data: bytes) -> tuple[InputHeader, list[bytes]]:
    """Split a binary input message into its header and access units. Raises ``ProtocolError`` on garbage."""
    data = bytes(data)
    head = framed_header(data, "input", MAX_INPUT_BYTES)
    try:
        header = InputHeader.model_validate_json(head)
    except ValidationError as exc:
        _, message = wire_errors.describe(exc, {"input": InputHeader}, model="input")
        raise ProtocolError(ErrorCode.BAD_CHUNK, f"input header: {message}") from None
    except (ValueError, json.JSONDecodeError) as exc:  # not UTF-8
        raise ProtocolError(ErrorCode.BAD_CHUNK, f"input header: {exc}"[:200]) from None
    return header, framed_units(data, CHUNK_PREFIX_BYTES + len(head), header.sizes, "input")
