"""A stream's video as aiortc sees it: `PacketTrack`, whose ``recv()`` returns the stream's own ``av.Packet`` s
(Annex-B, pts on the 90 kHz clock, ``time_base`` 1/90000), one per frame, paced at the stream's fps. aiortc only
packetizes a packet it is given (``H264Encoder.pack``): a stream is encoded once whatever the transport. The RTP
timestamp of a frame is ``origin + pts``, less the frames a cut to a new prompt dropped before it (a receiver's jitter
buffer would hold a jump in timestamps back as long as the jump); the chunk header sent with a frame (on the data
channel, by which the viewer maps frames to prompts) moves with it.

Its queue is the viewer's buffer as the scheduler sees it (streamsvc/transport/webrtc.py says how it is reported).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence

import av
from aiortc import VideoStreamTrack
from aiortc.mediastreams import MediaStreamError

from streamsvc.wire import protocol as P

_POLL_S = 0.25  # longest single wait in a bounded loop


class PacketTrack(VideoStreamTrack):
    """A stream's video as aiortc sees it: ``recv()`` returns the stream's own packets, paced at ``fps``.

    ``push`` queues a chunk's packets. Frame k after the last (re)start is due
    at ``anchor + k / fps``; ``recv`` sleeps until then and returns the next
    queued packet. When the queue is empty at a frame's due time the viewer
    stalls: ``recv`` waits for the next packet, returns it on arrival and
    paces from there (the same rule as ``client.playback``). While
    ``is_paused()`` it holds the next frame and paces afresh on resume.

    Callbacks (on the event loop): ``on_frame(header, buffered)`` for each
    frame returned, with the chunk's header on its first frame (None on the
    others); ``on_queue(buffered)`` when packets are pushed; ``on_stall()``
    when a stall starts. ``buffered`` is ``frames_queued``: the frame sent
    last counts as played (it still has to cross the network and the viewer's
    decoder), which leaves the scheduler one frame of margin for that trip.
    """

    def __init__(
        self,
        fps: int,
        *,
        on_frame: Callable[[P.Chunk | None, float], None] = lambda header, buffered: None,
        on_queue: Callable[[float], None] = lambda buffered: None,
        on_stall: Callable[[], None] = lambda: None,
        is_paused: Callable[[], bool] = lambda: False,
        start_gate: Callable[[], Awaitable[object]] | None = None,
        max_frame_wait_s: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        if not fps > 0:
            raise ValueError(f"fps must be > 0, got {fps!r}")
        self.fps = fps
        self._on_frame, self._on_queue, self._on_stall = on_frame, on_queue, on_stall
        self._is_paused = is_paused
        self._start_gate = start_gate  # awaited (bounded by the caller) before the first frame
        self._max_frame_wait_s = max_frame_wait_s
        self._clock = clock
        self._queue: deque[tuple[av.Packet, P.Chunk | None]] = deque()
        self._arrived = asyncio.Event()
        self._anchor: float | None = None  # due time of frame k = anchor + k / fps; None: next frame goes at once
        self._k = 0
        # what cuts dropped: later packets go out this much earlier in pts (90 kHz ticks), their headers in frames
        self._pts_cut, self._frames_cut = 0, 0
        self.frames_sent = 0
        self.stalls = 0  # times the queue was empty at a frame's due time
        self.stall_s = 0.0

    @property
    def frames_queued(self) -> int:
        """Frames pushed and not yet sent."""
        return len(self._queue)

    def push(self, packets: Sequence[av.Packet], header: P.Chunk) -> None:
        """Queue one chunk: its packets in frame order, its header sent with the first. A chunk that cuts (a new
        prompt's first, from a keyframe) drops the frames queued before it: the viewer sees the new prompt next."""
        if len(packets) != header.frames:
            raise ValueError(f"chunk {header.index}: {len(packets)} packets for a header of {header.frames} frames")
        if header.cut and self._queue:  # (its timestamps stay continuous: a receiver would hold a jump back)
            last = self._queue[-1][0]
            self._pts_cut += last.pts + (last.duration or round(90_000 / self.fps)) - self._queue[0][0].pts
            self._frames_cut += len(self._queue)
            self._queue.clear()
        for i, packet in enumerate(packets):
            self._queue.append((packet, header if i == 0 else None))
        self._arrived.set()
        self._on_queue(float(len(self._queue)))

    async def recv(self) -> av.Packet:
        if self.readyState != "live":
            raise MediaStreamError
        if self._start_gate is not None:
            gate, self._start_gate = self._start_gate, None
            await gate()
        if self._anchor is not None:
            delay = self._anchor + self._k / self.fps - self._clock()
            if delay > 0:
                await asyncio.sleep(delay)
        waited = await self._wait_for_frame()
        now = self._clock()
        if waited or self._anchor is None:
            self._anchor, self._k = now, 0  # pace afresh from this frame
        self._k += 1
        packet, header = self._queue.popleft()
        if self._pts_cut:  # the viewer maps a frame to its header by pts: the header moves with it
            packet = _moved(packet, -self._pts_cut)
            if header is not None:
                header = header.model_copy(update={"pts": header.pts - self._frames_cut})
        self.frames_sent += 1
        self._on_frame(header, float(len(self._queue)))
        return packet

    async def _wait_for_frame(self) -> bool:
        """Wait until a frame is queued and the stream is not paused. True if it had to wait (a stall or a pause)."""
        stalled_at: float | None = None
        waited = False
        for _ in range(int(self._max_frame_wait_s / _POLL_S) + 1):
            if self.readyState != "live":
                raise MediaStreamError
            paused = self._is_paused()
            if self._queue and not paused:
                if stalled_at is not None:
                    self.stall_s += self._clock() - stalled_at
                return waited
            waited = True
            if not self._queue and not paused and stalled_at is None and self._anchor is not None:
                stalled_at = self._clock()
                self.stalls += 1
                self._on_stall()
            self._arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), _POLL_S)
        self.stop()
        raise MediaStreamError(f"no frame to send for {self._max_frame_wait_s:g} s")


def _moved(packet: av.Packet, ticks: int) -> av.Packet:
    """A copy of `packet` `ticks` later (the stream's packets are every WebRTC viewer's: never changed in place)."""
    moved = av.Packet(bytes(packet))
    moved.pts = moved.dts = packet.pts + ticks
    moved.duration, moved.time_base, moved.is_keyframe = packet.duration, packet.time_base, packet.is_keyframe
    return moved
