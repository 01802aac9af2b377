"""The output stage: a finished chunk's frames from the device to the transports.

The engine thread only decides and launches. Once a chunk's commit and decode are launched,
`OutputStage.submit` queues a copy of its frames into pinned host memory on a side CUDA stream
and records an event behind it; a worker thread waits for that event (without the GIL), encodes
the frames with the stream's x264 encoder (PyAV releases the GIL), packs the WebSocket message
and hands the chunk over. So the GPU never waits for x264, and x264 never holds up a launch.

A stream's chunks go to one worker, in order (its encoder is stateful); streams are spread over
the workers. A chunk may carry the latest time a normal encode can start and still reach its
viewer in time (the engine's figure: the viewer's deadline less the output stage's cost and a
margin); a worker that picks it up later encodes it cheaper (`StreamEncoder.encode(fast=True)`),
tagged in the header; a chunk with time to spare never is. A stream that closes has its encoder
closed by its worker, after what is queued.

With `processes` (the CPU default) each worker's encoders live in a child process of their own
(`EncoderProcess`): PyAV holds the GIL for much of an encode, and on a CPU host the engine thread
and the event loop need it too; the worker thread sends the frames and waits without the GIL.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from streamsvc.engine.encode import EncoderProcess, EncoderSpec, StreamEncoder
from streamsvc.wire.protocol import Chunk as ChunkHeader
from streamsvc.wire.protocol import pack_chunk

log = logging.getLogger("streamsvc.output")


@dataclass
class ChunkOut:
    """A finished, encoded chunk on its way to the transports."""

    stream_id: str
    header: ChunkHeader  # what the client sees first: index, pts, frame count, prompt version
    access_units: list[bytes]  # one H.264 access unit per frame
    packets: list  # the same frames as av.Packet (pts on the 90 kHz clock), for WebRTC
    payload: bytes  # the WebSocket binary message: framed header + access units, built once
    latency_s: float  # from the launch of the chunk's first forward to the hand-over
    encode_s: float = 0.0  # the output stage's work on it: x264 and packing (the wait for the frames left out)
    fast: bool = False  # encoded cheaper to meet its deadline


@dataclass
class StreamOutput:
    """One stream's end of the output stage."""

    stream_id: str
    spec: EncoderSpec  # its encoder's size, rate and threads
    worker: int  # the worker that encodes all of its chunks
    encoder: StreamEncoder | None = None  # in this process (None: in the worker's encoder process)
    closed: bool = False  # set by the engine thread; its worker then skips what is still queued
    held: ChunkOut | None = None  # a first chunk of a single frame, waiting to go out with the second (its worker's)


@dataclass
class _Job:
    stream: StreamOutput
    frames: torch.Tensor  # [N, H, W, 3] uint8 on the host (pinned when copied from a GPU)
    ready: torch.cuda.Event | None  # recorded after the copy to the host; None: already there
    index: int  # chunk number in the stream
    first_frame: int  # stream index of its first frame
    prompt_version: int
    steps: int  # denoising steps it was made with
    keyframe: bool
    started_at: float  # launch of the chunk's first forward (engine clock)
    encode_by: float | None  # a normal encode must start by then (engine clock), else a cheaper one; None: no limit
    extra: dict | None = None  # more header fields: a stream with input video's input, capture_ms, strength


class OutputStage:
    """Worker threads that wait for chunks' frames, encode, pack and hand them over."""

    def __init__(
        self,
        device: torch.device,
        workers: int,
        on_chunk: Callable[[ChunkOut, StreamOutput], None],
        on_failed: Callable[[StreamOutput, str], None],
        clock: Callable[[], float] = time.monotonic,
        processes: bool = False,
    ) -> None:
        """`on_chunk(out, stream)` and `on_failed(stream, message)` are called from the workers; `processes`:
        x264 in one child process per worker, out of this process's GIL."""
        self.device = device
        self._on_chunk, self._on_failed, self.clock = on_chunk, on_failed, clock
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._queues: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(max(1, workers))]
        self._hosts = [EncoderProcess() for _ in self._queues] if processes else None
        self._next_worker = itertools.count()
        self._threads = [
            threading.Thread(target=self._work, args=(q,), name=f"output-{i}", daemon=True) for i, q in enumerate(self._queues)
        ]
        for t in self._threads:
            t.start()
        self._lock = threading.Lock()  # guards the figures below
        self.encode_seconds = 0.0  # x264 and packing, summed over chunks (the wait for the frames left out)
        self.chunks = 0
        self.fast_chunks = 0  # chunks encoded cheaper to meet their deadline
        self.latency_max_s = 0.0
        self.streams = 0  # streams opened here whose close their worker has not done yet (under _lock)

    def table_sizes(self) -> dict[str, int]:
        """Entries of its per-stream tables (see the server's `table_sizes`): its open streams, and the x264
        encoders alive (in this process, one per open stream; else as the encoder processes last told)."""
        encoders = sum(host.encoders for host in self._hosts) if self._hosts else self.streams
        return {"output.streams": self.streams, "output.encoders": encoders}

    def open(self, stream_id: str, spec: EncoderSpec) -> StreamOutput:
        """A stream's output; its encoder is made here (threads) or at its first chunk (processes)."""
        encoder = None if self._hosts else spec.make()
        with self._lock:
            self.streams += 1
        return StreamOutput(stream_id, spec, next(self._next_worker) % len(self._queues), encoder)

    def submit(self, stream: StreamOutput, frames: torch.Tensor, *, index: int, first_frame: int, prompt_version: int,
               steps: int, keyframe: bool, started_at: float, encode_by: float | None = None,
               extra: dict | None = None) -> None:
        """Queue a chunk whose frames ([N, H, W, 3] uint8, maybe still being computed on the device) are launched."""
        ready = None
        if frames.is_cuda:
            host = torch.empty(frames.shape, dtype=frames.dtype, pin_memory=True)
            cs = self._copy_stream
            cs.wait_stream(torch.cuda.current_stream(frames.device))
            with torch.cuda.stream(cs):
                host.copy_(frames, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(cs)
            frames.record_stream(cs)  # the decoder's output is not reused before the copy has read it
            frames = host
        job = _Job(stream, frames, ready, index, first_frame, prompt_version, steps, keyframe, started_at, encode_by,
                   extra)
        self._queues[stream.worker].put(job)

    def close(self, stream: StreamOutput) -> None:
        """The stream is gone: its worker closes its encoder after what is queued."""
        stream.closed = True
        self._queues[stream.worker].put(stream)

    def encoder_pids(self) -> list[int]:
        """The process ids of the workers' encoder processes (none when x264 runs in this process)."""
        return [host.pid for host in self._hosts or ()]

    def device_memory(self) -> tuple[int, int] | None:
        """(allocated, reserved) bytes of torch's CUDA allocator on the stage's device; None off CUDA."""
        if self.device.type != "cuda":
            return None
        return torch.cuda.memory_allocated(self.device), torch.cuda.memory_reserved(self.device)

    def stop(self, timeout: float = 5.0) -> None:
        for q in self._queues:
            q.put(None)
        for t in self._threads:
            t.join(timeout)
        for host in self._hosts or ():
            host.stop(timeout)

    # -- workers ------------------------------------------------------------------------------

    def _work(self, q: queue.SimpleQueue) -> None:
        while True:
            job = q.get()
            if job is None:
                return
            if isinstance(job, StreamOutput):
                if job.encoder is not None:
                    job.encoder.close()
                else:
                    self._hosts[job.worker].close_stream(job.stream_id)
                with self._lock:
                    self.streams -= 1
                continue
            if job.stream.closed:
                continue
            try:
                self._deliver(job)
            except Exception as e:  # noqa: BLE001 - one stream's failure ends that stream, not the worker
                log.exception("output of chunk %d of %s failed", job.index, job.stream.stream_id)
                job.stream.closed = True
                self._on_failed(job.stream, f"encoding failed: {type(e).__name__}: {e}")
                self._replace_dead_host(job.stream.worker)

    def _replace_dead_host(self, worker: int) -> None:
        """A worker's encoder process that died takes its streams' encoders with it (they failed); the streams
        that come after get a new one."""
        host = self._hosts[worker] if self._hosts else None
        if host is not None and not host.alive:
            log.warning("encoder process of output worker %d died; starting another", worker)
            host.stop()
            self._hosts[worker] = EncoderProcess()

    def _deliver(self, job: _Job) -> None:
        if job.ready is not None:
            job.ready.synchronize()  # the frames are on the host (waits without the GIL)
        t0 = self.clock()
        fast = job.encode_by is not None and t0 > job.encode_by
        stream, frames = job.stream, job.frames.numpy()
        if stream.encoder is not None:
            packets = stream.encoder.encode(frames, start_index=job.first_frame, keyframe=job.keyframe, fast=fast)
        else:
            packets = self._hosts[stream.worker].encode(stream.stream_id, stream.spec, frames,
                                                        start_index=job.first_frame, keyframe=job.keyframe, fast=fast)
        aus = [bytes(p) for p in packets]
        keyframe = job.keyframe or packets[0].is_keyframe
        header = ChunkHeader.describe(aus, index=job.index, pts=job.first_frame, prompt_version=job.prompt_version,
                                      steps=job.steps, keyframe=keyframe, fast=fast, **(job.extra or {}))
        payload = pack_chunk(header, aus)
        now = self.clock()
        out = ChunkOut(job.stream.stream_id, header, aus, packets, payload, now - job.started_at, now - t0, fast)
        with self._lock:
            self.encode_seconds += now - t0
            self.chunks += 1
            self.fast_chunks += fast
            self.latency_max_s = max(self.latency_max_s, out.latency_s)
        self._on_chunk(out, job.stream)
