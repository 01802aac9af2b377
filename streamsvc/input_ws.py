"""Input video over the WebSocket, on the server (issue 35): a stream's timeline made at `start`, the connection's
larger message limit, and its H.264 upstream decoded into the timeline.

A `start` with ``"input": true`` gets an `InputFrames` at the model's frame size (`input_frames`; the engine refuses
it, with the reason, on a model without an encoder). Once admitted, and before its `ready` goes out, its
connection's message limit rises to `wire_input.MAX_INPUT_BYTES` (`allow_input`; every other connection keeps the
control limit and its 1009). Its binary messages are input (`Upstream`): unpacked (a message that breaks the framing
is answered with `bad_chunk` and dropped), decoded by PyAV in a small pool of threads off the event loop, one
message at a time per connection, and pushed with their capture times; H.264 that does not decode is counted as
decode errors. A flood is not decoded: frames beyond `FLOOD_RATE` times the stream's fps (bursts of a second's
frames) are dropped undecoded (counted), and so is what follows them up to the next keyframe (a P-frame without its
reference would not decode anyway), so one sender cannot take the decoder threads every stream shares. The input is
the steerer's: after a handover the old steerer's messages are refused (`not_steerer`), and the stream goes on
either way.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from streamsvc import protocol as P
from streamsvc.inputs import InputFrames
from streamsvc.wire_input import MAX_INPUT_BYTES, InputHeader, unpack_input

log = logging.getLogger("streamsvc.server")

_DECODERS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="input-decode")  # PyAV releases the GIL
PHASE_STEP = 4  # stream n's first input frame goes to slot PHASE_STEP * n mod the first chunk's frames
_streams = itertools.count()  # streams with input opened so far (their phases)
FLOOD_RATE = 2.0  # input frames a second a connection may send, in times its stream's fps (more are not decoded)


def input_frames(engine, msg: P.Start, fps: int) -> InputFrames | None:
    """The timeline of a stream whose start asked for input (None when it did not), at the next phase: stream n's
    first frame goes to slot 4 n mod (the first chunk's frames), so that streams started together are released at
    phases spread over a chunk (InputFrames's docstring)."""
    if not msg.input:
        return None
    mc, first = engine.gen.model_cfg, engine.gen.frames_in_chunk(0)
    return InputFrames(mc.width, mc.height, fps, phase=(PHASE_STEP * next(_streams)) % first,
                       max_frames=4 * engine.gen.frames_in_chunk(1))  # 4 chunks ahead of the engine at most


def allow_input(ws, session) -> None:
    """The connection of a stream with input takes input messages up to MAX_INPUT_BYTES (front.py)."""
    if session.input is None:
        return
    allow = getattr(ws, "allow_messages", None)
    if allow is None or not allow(MAX_INPUT_BYTES):
        log.warning("this connection cannot take input messages over the control limit (%s)", type(ws).__name__)


def ready_fields(engine, session) -> dict:
    """`ready`'s input fields for a stream's viewers."""
    stream = engine.inputs.streams.get(session.stream_id) if engine.inputs is not None else None
    if stream is None:
        return {}
    return dict(input=True, strengths=[round(float(s), 6) for s in engine.gen.input_strengths()],
                strength=round(stream.strength, 6), input_latency_s=engine.config.input_latency_s)


class Upstream:
    """One connection's input video: H.264 in, decoded frames into its stream's InputFrames."""

    def __init__(self, viewer) -> None:
        import av

        self.viewer = viewer
        self.frames: InputFrames = viewer.session.input
        self._decoder = av.CodecContext.create("h264", "r")
        self._decoder.thread_count = 1  # no frame threading: a frame out for each frame in, no added delay
        self.messages = 0
        self.frames_in = 0
        fps = float(viewer.session.fps)
        self._rate, self._burst = FLOOD_RATE * fps, fps  # the flood's bound: frames a second, and a second's worth
        self._tokens, self._at = self._burst, time.monotonic()
        self._need_keyframe = False  # frames were dropped undecoded: the next ones wait for a keyframe

    @classmethod
    def for_viewer(cls, viewer) -> Upstream | None:
        """The upstream of a viewer that steers a stream with input (None for anyone else)."""
        if viewer is None or getattr(viewer.session, "input", None) is None or viewer.session.steerer is not viewer:
            return None
        return cls(viewer)

    async def receive(self, raw: bytes) -> None:
        """One binary message (an error answers it when it is refused; the stream goes on)."""
        try:
            header, units = unpack_input(raw)
        except P.ProtocolError as e:
            self.frames.decode_error()
            self.viewer.send(e.to_message())
            return
        if self.viewer.session.steerer is not self.viewer:
            self.viewer.send(P.Error(code=P.ErrorCode.NOT_STEERER, message=(
                "input dropped: the stream's input is its steerer's, and you handed the steer token over")))
            return
        self.messages += 1
        if not self._admit(header):
            return
        await asyncio.get_running_loop().run_in_executor(_DECODERS, self._decode, header, units)

    def _admit(self, header: InputHeader) -> bool:
        """Whether the message's frames are decoded: within the flood bound, and not waiting for a keyframe."""
        now = time.monotonic()
        self._tokens = min(self._burst, self._tokens + (now - self._at) * self._rate)
        self._at = now
        if self._need_keyframe and not header.keyframe or self._tokens < header.frames:
            self._need_keyframe = True
            for _ in range(header.frames):
                self.frames.drop()
            return False
        self._need_keyframe = False
        self._tokens -= header.frames
        return True

    def _decode(self, header: InputHeader, units: list[bytes]) -> None:
        import av

        decode_s = 0.0
        for unit, capture_ms in zip(units, header.capture_ms):
            t0 = time.perf_counter()
            try:
                frames = self._decoder.decode(av.Packet(unit))
            except (av.FFmpegError, ValueError):
                self.frames.decode_error()
                continue
            finally:
                decode_s += time.perf_counter() - t0
            if not frames:  # with no frame threading and no B-frames each access unit gives a frame: garbage
                self.frames.decode_error()
            for frame in frames:
                self.frames_in += 1
                self.frames.push_av(frame, capture_ms / 1000.0)
        self.frames.add_work(decode_s)
