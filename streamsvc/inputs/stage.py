"""The engine's side of input video (issue 35): releasing chunks by their input, handing frames to the generator.

Every call runs on the engine thread. Each stream with input has an `InputStream`: its timeline (InputFrames, fed
by the transports), its strength (snapped to the schedule's sigmas, the generator's `start_step`) and the chunks it
released. Each turn of the engine's loop `InputStage.poll` releases the next chunk of each stream with input
(`Scheduler.release`): once a frame has come for its last slot (`InputFrames.released`), at the strength's start
step; or, with none by `InputFrames.missing_at` (the slot's nominal arrival + `missing_wait_s`, or earlier, by
`Scheduler.release_by`, what its viewer's buffer leaves it, once the camera is known to be quiet: issue 41), as
missing (text-to-video, from step 0, all its steps and on time) unless some of its slots had frames (the input
stopped in the middle of it: those, the rest repeated). A frame
for the slot a stream waits on wakes the engine (`wake`). Before a chunk's first DENOISE (`before_denoise`) its
frames are taken and given to `generator.set_input` (None when missing: the generator resets its encoder's causal
state); the decode, scale and encode time per chunk is a sample of the scheduler's INPUT stage, which the warm-up
seeds (`seed_input_stage`). Each committed chunk's header gets its input ("frames" / "missing"), the capture time
of each frame's input frame and its strength (`header`).

If a chunk released with frames finds none when it starts (the sender handed over or the stream paused in
between), it runs on the last frame taken (black if none) at its release's step, and its header says "missing": the
scheduler's forward count for it was already planned. Input is refused with --parallel (the group's workers do not
replay set_input: not built).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np
import torch

from streamsvc.inputs.frames import InputFrames, TakenInput
from streamsvc.scheduling import Scheduler, Stage, StreamRequest

log = logging.getLogger("streamsvc.engine")

DEFAULT_STRENGTH = 0.6  # a start that asks for input without a strength (the built-in model snaps it to 0.625)


@dataclass
class _Release:
    start_step: int  # the step the chunk starts at (0: missing, text-to-video)
    strength: float  # the stream's strength when it was released (snapped)
    frames: bool  # released with input frames (else: missing)


@dataclass
class InputStream:
    """One stream's input on the engine thread."""

    frames: InputFrames  # its timeline, fed by the transports
    strength: float  # snapped: what the next releases use
    fps: float
    releases: dict[int, _Release] = field(default_factory=dict)  # by chunk index, until the chunk's commit
    captures: dict[int, list[float] | None] = field(default_factory=dict)  # by chunk index: capture_ms per frame
    set_for: int = -1  # the chunk whose input the generator has (a restarted chunk keeps it)


class InputStage:
    """Releases and input frames for the engine's streams with input (engine thread only)."""

    def __init__(self, gen, sched: Scheduler, clock: Callable[[], float], wake: Callable[[], None],
                 latency_s: float, parallel: bool = False) -> None:
        self.gen, self.sched, self.clock, self.wake = gen, sched, clock, wake
        self.parallel = parallel  # --parallel K: the group's workers do not replay set_input (not built)
        self.latency_s = latency_s  # --input-latency: a chunk is due this long after its release
        self.streams: dict[str, InputStream] = {}

    @property
    def missing_wait_s(self) -> float:
        """How long after its last slot's nominal arrival a chunk with no input runs without: half the input
        latency (it runs all the steps then, in the other half), at least one frame."""
        return max(self.latency_s / 2, 1.0 / 16)

    def table_sizes(self) -> dict[str, int]:
        """Entries of its per-stream tables (see the server's `table_sizes`): the streams with input, and their
        chunks' releases and capture times kept until each chunk's commit."""
        streams = list(self.streams.values())
        return {"inputs.streams": len(streams),
                "inputs.chunks": sum(len(s.releases) + len(s.captures) for s in streams)}

    # -- streams ----------------------------------------------------------------------------------

    def refusal(self) -> str | None:
        """Why a stream cannot take input on this model; None when it can."""
        if self.parallel:
            return ("input video is not built for a stream split over a group of devices (--parallel): serve "
                    "without --parallel to take input")
        if not getattr(self.gen, "can_take_input", False):
            return ("this model has no encoder, so it cannot take input video (start without \"input\"); the "
                    "built-in model and those with a Wan VAE or TAEHV encoder can")
        return None

    def start_step(self, strength: float | None) -> tuple[int, float]:
        """(start step, snapped strength) of a requested strength (None: DEFAULT_STRENGTH)."""
        k = self.gen.start_step(DEFAULT_STRENGTH if strength is None else strength)
        return k, float(self.gen.sigmas[k])

    def open(self, stream_id: str, frames: InputFrames, state, strength: float | None, fps: float) -> InputStream:
        _, snapped = self.start_step(strength)
        self.gen.set_strength(state, snapped)
        frames.notify = self.wake
        stream = self.streams[stream_id] = InputStream(frames, snapped, float(fps))
        return stream

    def set_strength(self, stream_id: str, strength: float) -> float:
        """The stream's strength from its next release on; returns it snapped."""
        stream = self.streams.get(stream_id)
        if stream is None:
            raise ValueError(f"stream {stream_id!r} takes no input video: start it with \"input\": true to set a "
                             "strength")
        stream.strength = self.start_step(strength)[1]
        return stream.strength

    def close(self, stream_id: str) -> None:
        stream = self.streams.pop(stream_id, None)
        if stream is not None:
            stream.frames.close()

    # -- the loop ---------------------------------------------------------------------------------

    def chunk_frames(self, index: int) -> tuple[int, int]:
        """(first frame, frames) of chunk `index` of a stream (its input slots)."""
        first = 0 if index == 0 else self.gen.frames_in_chunk(0) + (index - 1) * self.gen.frames_in_chunk(1)
        return first, self.gen.frames_in_chunk(index)

    def poll(self, now: float) -> float | None:
        """Release what can be released; returns the earliest time a waiting chunk's input counts as missing."""
        soonest = None
        for stream_id, stream in self.streams.items():
            index = self.sched.releasable(stream_id)
            if index is None:
                continue
            first, n = self.chunk_frames(index)
            inp = stream.frames
            if inp.released(first, n):
                frames = inp.has_any(first, n)
            else:
                release_by = self.sched.release_by(stream_id, frames=inp.has_any(first, n))
                due = inp.missing_at(first, n, self.missing_wait_s, release_by)
                if now < due:
                    soonest = due if soonest is None else min(soonest, due)
                    continue
                frames = inp.has_any(first, n)
            k = self.gen.start_step(stream.strength) if frames else 0
            stream.releases[index] = _Release(k, stream.strength, frames)
            self.sched.release(stream_id, index, k, now, frames)
            if frames and inp.play_from is None and index == 0:  # what the scheduler's viewer model plays it from
                inp.play_from = now + self.latency_s + (self.gen.frames_in_chunk(1) - n) / stream.fps
        return soonest

    def before_denoise(self, stream_id: str, state, chunk_index: int) -> None:
        """A chunk's first DENOISE is about to launch: its input to the generator (once per chunk)."""
        stream = self.streams.get(stream_id)
        if stream is None or stream.set_for == chunk_index:
            return
        release = stream.releases.get(chunk_index)
        if release is None:
            raise RuntimeError(f"stream {stream_id}: chunk {chunk_index} starts before its input released it")
        t0 = time.perf_counter()
        first, n = self.chunk_frames(chunk_index)
        taken: TakenInput | None = stream.frames.take(first, n)
        stream.set_for = chunk_index
        if not release.frames:
            self.gen.set_input(state, None)
            stream.captures[chunk_index] = None
            return
        if taken is None:  # released with frames that went (a handover, a pause): the last one, or black
            log.info("stream %s: chunk %d's input went before it started; it runs on the last frame taken (or "
                     "black)", stream_id, chunk_index)
            last = stream.frames.last_frame()
            mc = self.gen.model_cfg
            frames = torch.zeros(n, mc.height, mc.width, 3, dtype=torch.uint8) if last is None else \
                torch.from_numpy(last).expand(n, -1, -1, -1).contiguous()
            stream.captures[chunk_index] = None
        else:
            frames = torch.from_numpy(taken.frames)
            stream.captures[chunk_index] = taken.capture_ms
        self.gen.set_strength(state, release.strength)
        self.gen.set_input(state, frames)
        work = stream.frames.take_work() + time.perf_counter() - t0  # decode and scale of its frames, and encode
        self.sched.observe_stage(Stage.INPUT, work)

    def header(self, stream_id: str, chunk) -> dict | None:
        """The input fields of a committed chunk's header (None: a stream without input)."""
        stream = self.streams.get(stream_id)
        if stream is None:
            return None
        release = stream.releases.pop(chunk.index, None)
        captures = stream.captures.pop(chunk.index, None)
        status = getattr(chunk, "input", "frames" if captures else "missing")
        if captures is None:
            status = "missing"
        return dict(input=status, capture_ms=captures, strength=None if release is None else release.strength)


def seed_input_stage(gen, sched: Scheduler, fps: int = 16, camera: tuple[int, int] = (640, 480),
                     latency_s: float | None = None) -> float | None:
    """Get the model's encoder ready and time the input stage of one chunk before serving (the scheduler's INPUT
    seed): decoding a camera's H.264 (`camera` size), scaling it to the model's size, and the model's encoder; None
    (nothing seeded) for a model without an encoder.

    The encoder first runs, untimed, on both shapes a stream gives it, on a throwaway causal run: a first chunk
    (`frames_in_chunk(0)` frames, 1 + 4 (F - 1)) and a later one (`frames_in_chunk(1)`, 4 F). The first call of
    each shape pays the encoder's lazy set-up (cuDNN picks its algorithms per shape: the Wan VAE's first chunk
    took 1119 ms against 189 ms for later ones on an H100, TAEHV's 442 against 15), which a stream's first input
    chunk paid before. The seed is then the median of three later chunks of the same run, as serving encodes.
    With `latency_s` (--input-latency), a WARNING says so when even one stream with input at the default strength
    could not be served within it (admission refuses those), and what latency would do."""
    if not getattr(gen, "can_take_input", False):
        return None
    import av
    from av.video.reformatter import VideoReformatter

    from streamsvc.inputs.frames import scale_crop_av

    mc = gen.model_cfg
    first_n, n = gen.frames_in_chunk(0), gen.frames_in_chunk(1)
    packets = _camera_packets(n, fps, camera)

    def decoded() -> torch.Tensor:  # the camera's chunk decoded and scaled to the model's size: [n, H, W, 3] uint8
        decoder, scaler = av.CodecContext.create("h264", "r"), VideoReformatter()
        frames = [scale_crop_av(f, mc.width, mc.height, scaler) for p in packets
                  for f in decoder.decode(av.Packet(bytes(p)))]
        return torch.from_numpy(np.stack(frames[:n] + frames[-1:] * (n - len(frames[:n]))))

    def sync() -> None:
        if gen.device.type == "cuda":
            torch.cuda.synchronize(gen.device)

    encoder = gen.encoder
    state = encoder.init_state()  # a throwaway causal run, no stream's
    chunk = decoded()  # (also makes the decoder's and swscale's contexts)
    t0 = time.perf_counter()
    encoder.encode(chunk[:first_n].to(gen.device), state)  # a stream's first chunk: its shape's set-up
    encoder.encode(chunk.to(gen.device), state)  # a later chunk's
    sync()
    setup_s = time.perf_counter() - t0
    timings = []
    for _ in range(3):
        t0 = time.perf_counter()
        encoder.encode(decoded().to(gen.device), state)
        sync()
        timings.append(time.perf_counter() - t0)
    seconds = sorted(timings)[1]
    sched.seed_stage(Stage.INPUT, max(seconds, 1e-4))
    log.info("input stage: %.1f ms a chunk (decode %dx%d H.264, scale to %dx%d, encode); the encoder's first "
             "chunk of each shape (%d and %d frames) took %.1f ms", seconds * 1e3, *camera, mc.width, mc.height,
             first_n, n, setup_s * 1e3)
    if latency_s is not None:
        k = gen.start_step(DEFAULT_STRENGTH)
        req = StreamRequest("warm-up", float(fps), first_chunk_frames=first_n, chunk_frames=n, input_start_step=k,
                            input_latency_s=latency_s)
        refusal = sched.input_refusal(req)
        if refusal is not None:
            log.warning("input video at strength %.3g (the default) cannot be served on time: %s; streams with "
                        "input will be refused", float(gen.sigmas[k]), refusal)
    return seconds


def _camera_packets(n: int, fps: int, camera: tuple[int, int]) -> list:
    """`n` frames of a camera (`camera` size, a square moving on grey) encoded as H.264 at `fps`, as a sender
    would send them."""
    import av

    w, h = camera
    codec = av.CodecContext.create("libx264", "w")
    codec.width, codec.height, codec.pix_fmt, codec.time_base = w, h, "yuv420p", Fraction(1, fps)
    codec.options = {"preset": "ultrafast", "tune": "zerolatency"}
    rng = np.random.default_rng(0)
    packets = []
    for i in range(n):
        img = np.full((h, w, 3), 40, np.uint8)
        img[(i * 7) % (h - 64):][:64, (i * 11) % (w - 64):][:, :64] = rng.integers(0, 255, 3, dtype=np.uint8)
        frame = av.VideoFrame.from_ndarray(img, format="rgb24")
        frame.pts = i
        packets += codec.encode(frame)
    return packets + list(codec.encode(None))
