"""Input video over the WebSocket, on the server (issue 35): a stream's timeline made at `start`, the connection's
larger message limit, and its H.264 upstream decoded into the timeline.

A `start` with ``"input": true`` gets an `InputFrames` at the model's frame size (`input_frames`; the engine refuses
it, with the reason, on a model without an encoder). Once admitted, and before its `ready` goes out, its
connection's message limit rises to `framing.MAX_INPUT_BYTES` (`allow_input`; every other connection keeps the
control limit and its 1009). Its binary messages are input (`Upstream`): unpacked (a message that breaks the framing
is answered with `bad_chunk` and dropped), decoded by PyAV in a small pool of threads off the event loop, one
message at a time per connection, and pushed with their capture times; H.264 that does not decode is counted as
decode errors. Each access unit passes the connection's `InputGate` (streamsvc/inputs/gate.py) before the decoder
sees it, read from its own NAL units (the header's ``keyframe`` is not trusted):
- The pixel cap (streamsvc/inputs/bitstream.py): an SPS that declares more than 1920x1080 (or a decoded frame that is)
  refuses the connection's input at once: an ``error`` (``input_refused``, with the size and the cap), the decoder
  and its pictures dropped, and every later input message dropped unread. The stream goes on as text-to-video: its
  viewer (and its watchers) keep what they came for, and a camera too large is the sender's to fix, not a reason to
  end the stream; a sender that wants input again starts a new stream. The same when the decoder's CPU time stays
  over its budget (`MAX_DECODE_LOAD` CPU-seconds a second over `DECODE_SUSTAIN_S`), with that reason.
- A flood is not decoded: frames beyond `FLOOD_RATE` times the stream's fps (bursts of a second's frames) are dropped
  undecoded (counted), a frame no other refers to (nal_ref_idc 0) alone, a reference frame with the rest of its
  group of pictures, up to the next IDR (they would not decode without it), so one sender cannot take the decoder
  threads every stream shares. The decoder's CPU time counts in the input stage's cost (`InputFrames.add_work`).
The input is the steerer's: after a handover the old steerer's messages are refused (`not_steerer`), and the stream
goes on either way.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from streamsvc.inputs.frames import InputFrames
from streamsvc.inputs.gate import InputGate, Verdict
from streamsvc.wire import protocol as P
from streamsvc.wire.framing import MAX_INPUT_BYTES, unpack_input

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
    shape = engine.shape
    return InputFrames(shape.width, shape.height, fps, phase=(PHASE_STEP * next(_streams)) % shape.first_chunk_frames,
                       max_frames=4 * shape.chunk_frames)  # 4 chunks ahead of the engine at most


def allow_input(outlet) -> None:
    """The connection of a stream with input takes input messages up to MAX_INPUT_BYTES (streamsvc/door/front.py;
    `outlet`: its transport.ws.Outlet)."""
    if not outlet.allow_messages(MAX_INPUT_BYTES):
        log.warning("this connection cannot take input messages over the control limit (%s)", type(outlet).__name__)


def ready_fields(desc) -> dict:
    """`ready`'s input fields for the viewers of a stream (`desc`: its StreamDescription)."""
    if desc.strength is None:
        return {}
    return dict(input=True, strengths=[round(s, 6) for s in desc.shape.strengths], strength=round(desc.strength, 6),
                input_latency_s=desc.input_latency_s)


class Upstream:
    """One connection's input video: H.264 in, decoded frames into its stream's InputFrames."""

    def __init__(self, viewer) -> None:
        self.viewer = viewer
        self.frames: InputFrames = viewer.session.input
        self._decoder = None  # the connection's H.264 decoder, made for the first frame it decodes
        self.messages = 0
        self.frames_in = 0
        self.dropped_messages = 0  # input messages dropped unread after the input was refused
        fps = float(viewer.session.fps)
        # the flood's bound: frames a second, and a second's worth; the pixel cap; the decoder's CPU budget
        self.gate = InputGate(FLOOD_RATE * fps, fps, time.monotonic())
        self._told = False  # the client was sent the refusal
        self._closed = False  # its connection ended (`close`)

    @classmethod
    def for_viewer(cls, viewer) -> Upstream | None:
        """The upstream of a viewer that steers a stream with input (None for anyone else)."""
        if viewer is None or getattr(viewer.session, "input", None) is None or viewer.session.steerer is not viewer:
            return None
        return cls(viewer)

    @property
    def refused(self) -> str | None:
        """Why this connection's input was refused (None: it was not)."""
        return self.gate.refused

    async def receive(self, raw: bytes) -> None:
        """One binary message (an error answers it when it is refused; the stream goes on). One that breaks the
        framing raises the ProtocolError it was answered with: the connection counts it (streamsvc/door/guard.py)."""
        if self.gate.refused is not None:  # refused: dropped unread (the client was told once)
            self.dropped_messages += 1
            return
        try:
            header, units = unpack_input(raw)
        except P.ProtocolError as e:
            self.frames.decode_error()
            self.viewer.send(e.to_message())
            raise
        if self.viewer.session.steerer is not self.viewer:
            self.viewer.send(P.Error(code=P.ErrorCode.NOT_STEERER, message=(
                "input dropped: the stream's input is its steerer's, and you handed the steer token over")))
            return
        self.messages += 1
        batch = self._admit(units, header.capture_ms)
        if batch and self.gate.refused is None:
            await asyncio.get_running_loop().run_in_executor(_DECODERS, self._decode, batch)
        if self.gate.refused is not None:
            self._refuse()

    def _admit(self, units: list[bytes], capture_ms: list[float]) -> list[tuple[bytes, float]]:
        """The access units to decode, with their capture times; the others dropped (counted) or refused."""
        now, batch = time.monotonic(), []
        for unit, capture in zip(units, capture_ms):
            verdict = self.gate.admit(unit, now)
            if verdict is Verdict.DECODE:
                batch.append((unit, capture))
            elif verdict is Verdict.REFUSE:
                return []
            elif verdict is Verdict.BAD:
                self.frames.decode_error()
            else:
                self.frames.drop()
        return batch

    def close(self) -> None:
        """The connection ended: its decoder (and the pictures it holds) goes now, not when a garbage collection
        finds the connection's objects (they refer to each other). A decode under way ends with the decoder it
        began with; none begins after this."""
        self._closed = True
        self._decoder = None

    def _refuse(self) -> None:
        """The input is refused: the decoder and its pictures go, the client is told once."""
        self._decoder = None
        if not self._told:
            self._told = True
            log.info("stream %s: input refused: %s", self.viewer.stream_id, self.gate.refused)
            self.viewer.send(P.Error(code=P.ErrorCode.INPUT_REFUSED, message=(
                f"input refused: {self.gate.refused}; the stream goes on without input (start a new one to send "
                "input again)")))

    def _decode(self, batch: list[tuple[bytes, float]]) -> None:
        import av

        if self._closed:
            return
        if self._decoder is None:
            self._decoder = av.CodecContext.create("h264", "r")
            self._decoder.thread_count = 1  # no frame threading: a frame out for each frame in, no added delay
        decoder, decode_s = self._decoder, 0.0
        for unit, capture_ms in batch:
            t0, cpu0 = time.perf_counter(), time.thread_time()
            try:
                frames = decoder.decode(av.Packet(unit))
            except (av.FFmpegError, ValueError):
                self.frames.decode_error()
                continue
            finally:
                decode_s += time.perf_counter() - t0
                self.gate.decode_time(time.thread_time() - cpu0, time.monotonic())
            if not frames:  # with no frame threading and no B-frames each access unit gives a frame: garbage
                self.frames.decode_error()
            for frame in frames:
                if not self.gate.decoded_size(frame.width, frame.height):
                    break
                self.frames_in += 1
                self.frames.push_av(frame, capture_ms / 1000.0)
            if self.gate.refused is not None:
                break
        self.frames.add_work(decode_s)
