"""H.264 encoding, once per stream, shared by every transport.

Each stream owns one ``StreamEncoder``. It turns the stream's RGB frames into
H.264 access units (one ``av.Packet`` per frame), and every transport reuses
those packets: the WebSocket transport frames their bytes into chunk messages
(``protocol.pack_chunk``), the WebRTC track returns the ``av.Packet`` objects
themselves from ``recv()`` (aiortc only packetizes a packet it is given).

``encode(..., fast=True)`` is the output stage's degradation when a chunk would reach its
viewer late: the chunk goes through a second x264 context at ``FAST_CRF_OFFSET`` higher CRF
(fewer bits to code) with point-sampled chroma (a 480x832 chunk: about 23 % less time), and
starts with an IDR, as does the next normal chunk (the two contexts share no reference frames).

Settings are for live streaming: libx264, preset ultrafast, tune zerolatency,
no B-frames, no lookahead, so each frame's packet comes out as soon as the
frame goes in. Keyframes come only at a chunk's first frame (an ``encode`` call's):
at the first chunk that starts ``keyframe_interval`` frames (2 s by default) or more
after the last IDR, and on demand (``request_keyframe()``, ``keyframe=True``); so a
viewer who joins a stream can start at any chunk flagged keyframe, a whole chunk. SPS/PPS
are repeated before every IDR; x264's own keyframe placement and scene cut detection are off;
Annex-B byte stream (start codes, no global extradata); yuv420p, BT.601
limited range, signalled in the VUI.

Packets are stamped on the 90 kHz RTP video clock: ``time_base = 1/90000``
and ``pts = dts = frame_index * 90000 // fps``, where ``frame_index`` counts
the stream's frames from 0.

``StreamDecoder`` is the other end, for tests and the Python client: access
units in, RGB frames out, starting at the first keyframe it sees.

``EncoderProcess`` runs streams' encoders in a child process of their own: PyAV
holds the GIL for much of an encode, so beside a busy engine thread a 12-frame
128x128 chunk takes 36-60 ms instead of 10 in-process; out of the server's GIL it
takes what x264 takes.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from fractions import Fraction
from multiprocessing.connection import Connection
from pathlib import Path

import av
import numpy as np
from av.codec.context import Flags
from av.video.frame import PictureType
from av.video.reformatter import VideoReformatter

from streamsvc.engine.heap import memory_giver

log = logging.getLogger(__name__)

FAST_CRF_OFFSET = 12  # a fast (degraded) chunk's CRF above the stream's
MMAP_THRESHOLD = 128 * 1024  # the encoder process's allocations this large are mmapped (glibc's default, held fixed)
RTP_CLOCK_HZ = 90_000
RTP_TIME_BASE = Fraction(1, RTP_CLOCK_HZ)

# H.264 NAL unit types (ITU-T H.264 table 7-1) that matter here.
NAL_SLICE = 1
NAL_IDR = 5
NAL_SEI = 6
NAL_SPS = 7
NAL_PPS = 8


def rtp_pts(frame_index: int, fps: int) -> int:
    """The 90 kHz timestamp of a stream's frame."""
    return frame_index * RTP_CLOCK_HZ // fps


def nal_unit_types(access_unit: bytes) -> list[int]:
    """The NAL unit types of an Annex-B access unit, in order (e.g. [7, 8, 6, 5] for an IDR with headers)."""
    types = []
    start = access_unit.find(b"\x00\x00\x01")
    while start != -1 and start + 3 < len(access_unit):
        types.append(access_unit[start + 3] & 0x1F)
        start = access_unit.find(b"\x00\x00\x01", start + 3)
    return types


def is_idr(access_unit: bytes) -> bool:
    """True when the access unit holds an IDR picture (decoding can start here if it also has SPS/PPS)."""
    return NAL_IDR in nal_unit_types(access_unit)


@dataclass(frozen=True)
class EncoderSpec:
    """What a stream's encoder is made for (the arguments of ``StreamEncoder``)."""

    width: int
    height: int
    fps: int
    threads: int = 1  # x264 threads of this stream's encoder

    def make(self) -> StreamEncoder:
        return StreamEncoder(self.width, self.height, self.fps, threads=self.threads)


class StreamEncoder:
    """One stream's H.264 encoder: RGB frames in, one ``av.Packet`` per frame out, in order.

    ``encode`` is called from one thread at a time (it may be a worker thread:
    the event loop should not wait on it at large sizes); ``request_keyframe``
    may be called from any thread.
    """

    def __init__(
        self,
        width: int,
        height: int,
        fps: int,
        *,
        keyframe_interval: int | None = None,
        crf: int = 23,
        threads: int = 1,
        options: Mapping[str, str] | None = None,
    ) -> None:
        """``keyframe_interval`` in frames (default ``2 * fps``): the least distance between interval keyframes,
        which come at a chunk's start; ``crf`` is x264's quality (lower is better);
        ``threads`` per encoder (1 suits many streams per machine); ``options`` are extra libavcodec/libx264
        options that override the defaults (for tuning; B-frames stay off whatever they say)."""
        if width <= 0 or height <= 0 or width % 2 or height % 2:
            raise ValueError(f"frame size {width}x{height} must be positive and even (yuv420p); pad or crop it")
        if not (isinstance(fps, int) and fps > 0):
            raise ValueError(f"fps must be a positive integer, got {fps!r}")
        self.width = width
        self.height = height
        self.fps = fps
        self.keyframe_interval = keyframe_interval if keyframe_interval is not None else 2 * fps
        if self.keyframe_interval < 1:
            raise ValueError(f"keyframe_interval must be >= 1 frame, got {self.keyframe_interval}")
        self._crf = crf
        self._threads = threads
        self._extra_options = dict(options or {})
        self._ctx: av.VideoCodecContext | None = self._open(crf)
        self._fast_crf = min(51, crf + FAST_CRF_OFFSET)
        self._fast_ctx: av.VideoCodecContext | None = None  # opened at the first fast chunk
        self._last_fast = False  # the last chunk went through the fast context
        # one swscale context for every frame: a frame's own reformat() builds a new one each call (at 128x128 that
        # set-up was 3 of a 12-frame chunk's 4 ms)
        self._to_yuv = VideoReformatter()
        self._next_index = 0  # the lowest stream index the next frame may have
        self._keyframe_lock = threading.Lock()
        self._keyframe_requested = False
        self._last_idr: int | None = None  # stream index of the last IDR (None: none yet)
        self._warned_buffering = False

    @property
    def next_index(self) -> int:
        """The stream index after the last frame encoded (0 before any)."""
        return self._next_index

    def request_keyframe(self) -> None:
        """Make the next frame encoded an IDR with SPS/PPS (a viewer joined and must start decoding there)."""
        with self._keyframe_lock:
            self._keyframe_requested = True

    def encode(self, frames: np.ndarray, *, start_index: int, keyframe: bool = False,
               fast: bool = False) -> list[av.Packet]:
        """Encode ``frames`` [N, H, W, 3] uint8 RGB, the stream's frames ``start_index .. start_index + N - 1``.

        Returns exactly N packets, frame i's packet at position i, each an
        Annex-B access unit with 90 kHz pts. The first one is an IDR when
        ``keyframe`` is true, a keyframe was requested, or ``fast`` differs from
        the last chunk's (``fast``: the cheaper encode, see the module docstring).
        """
        if self._ctx is None:
            raise RuntimeError("encoder is closed")
        if frames.ndim != 4 or frames.shape[1:] != (self.height, self.width, 3) or frames.dtype != np.uint8:
            raise ValueError(
                f"frames must be uint8 [N, {self.height}, {self.width}, 3] RGB, got {frames.dtype} {list(frames.shape)}"
            )
        if len(frames) == 0:
            return []
        if start_index < self._next_index:
            raise ValueError(f"start_index {start_index} goes back: frames up to {self._next_index - 1} are encoded")
        due = self._last_idr is None or start_index - self._last_idr >= self.keyframe_interval
        with self._keyframe_lock:
            force_idr = keyframe or due or self._keyframe_requested or fast != self._last_fast
            self._keyframe_requested = False
        if fast and self._fast_ctx is None:
            self._fast_ctx = self._open(self._fast_crf)
        ctx = self._fast_ctx if fast else self._ctx
        self._last_fast = fast

        packets: list[av.Packet] = []
        for i, rgb in enumerate(frames):
            # RGB -> BT.601 limited-range yuv420p, chroma averaged (point-sampled when fast)
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb), format="rgb24")
            frame = self._to_yuv.reformat(frame, format="yuv420p", interpolation="POINT" if fast else "BILINEAR")
            frame.pts = start_index + i  # in 1/fps; restamped to 90 kHz below
            if i == 0 and force_idr:
                frame.pict_type = PictureType.I  # an IDR, with forced-idr on
            packets.extend(ctx.encode(frame))
        if len(packets) < len(frames):
            packets.extend(self._drain(fast))
        if [p.pts for p in packets] != list(range(start_index, start_index + len(frames))):
            raise RuntimeError(
                f"encoder returned packets for frames {[p.pts for p in packets]}, "
                f"expected {start_index}..{start_index + len(frames) - 1}"
            )
        self._next_index = start_index + len(frames)
        for packet in packets:
            if packet.is_keyframe:
                self._last_idr = packet.pts
            self._stamp(packet)
        return packets

    def close(self) -> None:
        """Release the encoder: its x264 contexts and its swscale context, with the threads swscale keeps (a pool
        of as many as the host has cores), now rather than when a garbage collection finds an owner that sits in a
        reference cycle. Idempotent; ``encode`` raises afterwards."""
        for ctx in (self._ctx, self._fast_ctx):
            if ctx is not None:
                try:
                    ctx.encode(None)  # drain and discard
                except av.FFmpegError:
                    pass
        self._ctx = self._fast_ctx = None
        self._to_yuv = None

    def _open(self, crf: int) -> av.VideoCodecContext:
        ctx = av.CodecContext.create("libx264", "w")
        ctx.width = self.width
        ctx.height = self.height
        ctx.pix_fmt = "yuv420p"
        ctx.framerate = Fraction(self.fps)
        ctx.time_base = Fraction(1, self.fps)  # pts in frames while encoding
        ctx.gop_size = 0  # keyframes only where encode() forces them (x264-params below say so too)
        ctx.max_b_frames = 0
        ctx.thread_count = self._threads
        x264_params = ":".join(
            [
                "repeat-headers=1",  # SPS/PPS before every IDR
                "annexb=1",
                "scenecut=0",  # keyframes only where encode() forces them: at chunk starts
                "keyint=infinite",
                "rc-lookahead=0",
                "sync-lookahead=0",
                "bframes=0",
                "colormatrix=smpte170m",  # tell players the RGB<->YUV matrix: BT.601, swscale's default
            ]
        )
        options = {
            "preset": "ultrafast",
            "tune": "zerolatency",
            "crf": str(crf),
            "forced-idr": "1",  # a forced keyframe is an IDR, not just an I-frame
            "x264-params": x264_params,
        }
        options.update(self._extra_options)
        if "x264-params" in self._extra_options:  # extra params go after ours (they override), B-frames stay off
            options["x264-params"] = f"{x264_params}:{self._extra_options['x264-params']}:bframes=0"
        ctx.options = options
        ctx.open()
        return ctx

    def _drain(self, fast: bool) -> list[av.Packet]:
        """Empty an encoder that held frames back, and start a fresh one (whose first frame is an IDR).

        With the settings above libx264 never holds frames, but options can
        make it (lookahead, frame threads); a chunk must not wait for the next
        one, so its packets are forced out at the cost of an early keyframe.
        """
        if not self._warned_buffering:
            log.warning("H.264 encoder buffers frames (options %s); draining it after every chunk", self._extra_options)
            self._warned_buffering = True
        if fast:
            packets, self._fast_ctx = self._fast_ctx.encode(None), self._open(self._fast_crf)
        else:
            packets, self._ctx = self._ctx.encode(None), self._open(self._crf)
        return packets

    def _stamp(self, packet: av.Packet) -> None:
        index = packet.pts
        packet.pts = packet.dts = rtp_pts(index, self.fps)
        packet.duration = rtp_pts(index + 1, self.fps) - packet.pts
        packet.time_base = RTP_TIME_BASE


class StreamDecoder:
    """H.264 access units in, RGB frames out: the viewer's side of ``StreamEncoder``.

    Access units before the first IDR are skipped (a viewer that joins
    mid-stream starts at a keyframe). A corrupt access unit raises
    ``av.FFmpegError`` (e.g. ``av.InvalidDataError``).
    """

    def __init__(self) -> None:
        self._ctx = av.CodecContext.create("h264", "r")
        self._ctx.thread_count = 1  # frame threads would delay output by a frame per thread
        self._ctx.flags |= Flags.low_delay
        self._to_rgb = VideoReformatter()  # one swscale context for every frame (see StreamEncoder)
        self._started = False

    @property
    def waiting_for_keyframe(self) -> bool:
        """True until the first IDR has been decoded."""
        return not self._started

    def decode(self, access_unit: bytes) -> list[np.ndarray]:
        """Decode one access unit; returns its frames as [H, W, 3] uint8 RGB (one, or none before a keyframe)."""
        if self._ctx is None:
            raise RuntimeError("decoder is closed")
        if not self._started:
            if not is_idr(access_unit):
                return []
            self._started = True
        return [self.to_rgb(frame) for frame in self._ctx.decode(av.Packet(access_unit))]

    def to_rgb(self, frame: av.VideoFrame) -> np.ndarray:
        """A decoded frame as [H, W, 3] uint8 RGB."""
        return self._to_rgb.reformat(frame, format="rgb24").to_ndarray()

    def close(self) -> None:
        """Release the decoder and its swscale context (with its threads: see ``StreamEncoder.close``); frames
        still inside are dropped."""
        self._ctx = None
        self._to_rgb = None


class EncoderProcess:
    """A child process that owns the encoders of some streams; ``encode`` and ``close_stream`` are called
    from one thread at a time (an output worker), which waits for the answer without the GIL.

    A stream's encoder is made in the child at its first chunk. Errors in the child come back as
    ``RuntimeError`` with the child's message; a dead child as ``RuntimeError`` too. The child ignores
    SIGINT (the server shuts it down) and exits when this end closes, so none outlives the server.
    It is `python -m streamsvc.engine.encode FD`, not a multiprocessing child: those import the parent's main
    module again (for the server: torch and the models, 300 MB), this one only av and numpy.
    """

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        root = str(Path(__file__).resolve().parents[1])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
               # x264's frame buffers (1-2 MB each) stay mmapped, so a closed encoder's go back whole and an open one
               # holds only the pages it touches. Left to glibc, the first buffer freed raises the mmap threshold
               # above their size and the next encoders' come from the heap, resident in full and fragmented: the
               # process grew about 1 MB a minute with 16 streams reconnecting every 8 minutes (76 to 106 MB).
               "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}
        self._proc = subprocess.Popen([sys.executable, "-m", "streamsvc.engine.encode", str(theirs.fileno())],
                                      pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env)
        theirs.close()
        self._conn = Connection(ours.detach())
        self.encoders = 0  # the child's open encoders, as of its last answer

    def encode(self, stream_id: str, spec: EncoderSpec, frames: np.ndarray, *, start_index: int,
               keyframe: bool, fast: bool = False) -> list[av.Packet]:
        """The stream's packets for ``frames``, as ``StreamEncoder.encode`` returns them."""
        try:
            self._conn.send(("encode", stream_id, asdict(spec), frames, start_index, keyframe, fast))
            status, payload, self.encoders = self._conn.recv()
        except (EOFError, OSError) as e:
            raise RuntimeError(f"the encoder process is gone (exit code {self._proc.poll()}): {e}") from None
        if status != "ok":
            raise RuntimeError(payload)
        return [_packet(*fields) for fields in payload]

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None

    @property
    def pid(self) -> int:
        """The child's process id (what /metrics reads its memory, fds and threads by)."""
        return self._proc.pid

    def close_stream(self, stream_id: str) -> None:
        """Close the stream's encoder (if it has one); returns once the child has."""
        try:
            self._conn.send(("close", stream_id))
            _, _, self.encoders = self._conn.recv()
        except (EOFError, OSError):
            self.encoders = 0  # the child is gone, and its encoders with it

    def stop(self, timeout: float = 5.0) -> None:
        try:
            self._conn.send(None)
        except (EOFError, OSError):
            pass
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout)
        self._conn.close()


def _packet(data: bytes, pts: int, duration: int, keyframe: bool) -> av.Packet:
    """An access unit from the encoder process as the packet ``StreamEncoder`` would have returned."""
    packet = av.Packet(data)
    packet.pts = packet.dts = pts
    packet.duration = duration
    packet.time_base = RTP_TIME_BASE
    packet.is_keyframe = keyframe
    return packet


def _encoder_main(conn) -> None:
    """The encoder process: ("encode", stream_id, spec, frames, start_index, keyframe, fast) -> ("ok", packets as
    (bytes, pts, duration, keyframe), encoders) or ("error", message, encoders); ("close", stream_id) -> ("closed",
    None, encoders); None or a closed pipe ends it. `encoders`: how many it holds open after the request. A closed
    encoder's memory goes back to the system: its large buffers are mmapped (`EncoderProcess` fixes the threshold),
    and the heap is trimmed after each close (`memory_giver`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    encoders: dict[str, StreamEncoder] = {}
    give_back = memory_giver()
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                return
            if msg is None:
                return
            if msg[0] == "close":
                encoder = encoders.pop(msg[1], None)
                if encoder is not None:
                    encoder.close()
                    del encoder
                    if give_back is not None:
                        give_back()
                conn.send(("closed", None, len(encoders)))
                continue
            _, stream_id, spec, frames, start_index, keyframe, fast = msg
            try:
                if stream_id not in encoders:
                    encoders[stream_id] = EncoderSpec(**spec).make()
                packets = encoders[stream_id].encode(frames, start_index=start_index, keyframe=keyframe, fast=fast)
                conn.send(("ok", [(bytes(p), p.pts, p.duration, p.is_keyframe) for p in packets], len(encoders)))
            except Exception as e:  # noqa: BLE001 - the stream's worker reports it; the process serves the others
                conn.send(("error", f"{type(e).__name__}: {e}", len(encoders)))
    finally:
        for encoder in encoders.values():
            encoder.close()


if __name__ == "__main__":  # an EncoderProcess's child: python -m streamsvc.engine.encode FD
    _encoder_main(Connection(int(sys.argv[1])))
