"""The WebSocket viewer's H.264 decoder: access units in, frames out.

The client's own decoder (DESIGN.md: the client imports only the wire conventions, never the service's
encoder). Where decoding may start is the wire's word, not the bitstream's: a chunk whose header says
``keyframe`` starts with an IDR carrying SPS/PPS (``streamsvc.wire.protocol``), and the client feeds the decoder
from the first such chunk on (a watcher's first chunk is one).

Frames stay ``av.VideoFrame``s. Converting one to RGB costs about twice its decode (at 128x128 on one core:
0.09 ms against 0.04 ms), and a load test decodes every frame of every viewer on one event loop: 25 viewers of
one stream get each chunk at the same moment, so that cost is paid 25 times in one turn of the loop. Only the
frames whose pixels are read (``client.verify``) are converted, when they are read, as the WebRTC client does.
"""

from __future__ import annotations

import av
from av.codec.context import Flags


class FrameDecoder:
    """One stream's H.264 decoder (PyAV, one thread, low delay: each access unit gives its frame at once)."""

    def __init__(self) -> None:
        self._ctx = av.CodecContext.create("h264", "r")
        self._ctx.thread_count = 1  # frame threads would delay output by a frame per thread
        self._ctx.flags |= Flags.low_delay

    def decode(self, access_unit: bytes) -> list[av.VideoFrame]:
        """The frames of one access unit (one, or none while the decoder fills). Raises ``av.FFmpegError`` on a
        corrupt one; the decoder goes on with the next."""
        if self._ctx is None:
            raise RuntimeError("decoder is closed")
        return self._ctx.decode(av.Packet(access_unit))

    def close(self) -> None:
        """Release the decoder (frames still inside are dropped)."""
        self._ctx = None
