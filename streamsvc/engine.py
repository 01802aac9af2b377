"""The engine: one thread per device that runs the scheduler's plans on the model.

The event loop never touches the model, the scheduler or the KV pool. It sends
commands (open, prompt, pause, close, ...) that the engine thread applies between
forwards and answers through concurrent futures; finished chunks come back through
`on_chunk`, errors through `on_error`, both called with `loop.call_soon_threadsafe`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from kvcache import CachePool
from models import ChunkGenerator, GeneratorConfig, StreamState, Work, build_generator
from streamsvc.encode import StreamEncoder
from streamsvc.protocol import Chunk as ChunkHeader
from streamsvc.protocol import pack_chunk
from streamsvc.scheduler import Admission, Plan, Scheduler, SchedulerConfig, SchedulerStats, StreamRequest, WorkKind

log = logging.getLogger("streamsvc.engine")

_KIND = {Work.RECACHE: WorkKind.RECACHE, Work.DENOISE: WorkKind.DENOISE, Work.COMMIT: WorkKind.COMMIT}  # generator -> scheduler


class EngineError(RuntimeError):
    """The engine was used against its contract (unknown stream, not running, ...)."""


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine builds: the model on its device, the KV pool, the scheduler."""

    preset: str = "tiny"  # model preset (models.PRESETS)
    device: str = "cpu"  # torch device of the model and the KV pool
    checkpoint: str | None = None  # local DiT weights; None: random from weights_seed
    weights_seed: int = 0
    generator: GeneratorConfig = GeneratorConfig()
    scheduler: SchedulerConfig = SchedulerConfig(buffer_cap_s=1.0)
    kv_budget_bytes: int | None = None  # KV pool budget; None: 4 GiB on CPU, 85% of free memory on a GPU
    cpu_threads: int = 1  # torch intra-op threads on CPU (the event loop and encoders need the other cores)
    compile: bool = False  # torch.compile the DiT's elementwise helpers (GPU)
    warmup_chunks: int = 3  # chunks run at start to measure forward costs (the first, cold, is not counted)


@dataclass
class ChunkOut:
    """A finished, encoded chunk on its way to the transports."""

    stream_id: str
    header: ChunkHeader  # what the client sees first: index, pts, frame count, prompt version
    access_units: list[bytes]  # one H.264 access unit per frame
    packets: list  # the same frames as av.Packet (pts on the 90 kHz clock), for WebRTC
    payload: bytes  # the WebSocket binary message: framed header + access units, built once
    latency_s: float  # from the start of the chunk's first denoising step to now


@dataclass
class _Stream:
    state: StreamState
    fps: int
    encoder: StreamEncoder
    prompts: dict[int, str]  # prompt text by version
    chunk_started_at: float = 0.0
    keyframe: bool = True  # next chunk starts with an IDR (a viewer joined)


@dataclass
class _Command:
    fn: Callable  # run in the engine thread
    args: tuple
    future: Future = field(default_factory=Future)


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        on_chunk: Callable[[ChunkOut], None],
        on_error: Callable[[str, str], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._on_chunk, self._on_error = on_chunk, on_error
        self.clock = clock
        self._commands: queue.SimpleQueue[_Command | None] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._thread = threading.Thread(target=self._main, name=f"engine-{config.device}", daemon=True)
        self._ready = Future()
        self._stopping = False
        # read by the event loop (metrics); replaced, never mutated, by the engine thread
        self.snapshot: SchedulerStats | None = None
        self.kv_used_bytes = 0
        self.kv_budget_bytes = 0
        self.forwards: dict[str, int] = {w.value: 0 for w in WorkKind}  # forwards run, by kind
        self.forward_seconds: dict[str, float] = {w.value: 0.0 for w in WorkKind}  # wall: launch to finish, by kind
        self.gpu_seconds: dict[str, float] = {w.value: 0.0 for w in WorkKind}  # device time (CUDA events; CPU: wall)
        self.encode_seconds = 0.0  # output stage: frames to host, x264 and packing, summed over chunks
        self.chunks_encoded = 0
        self.chunk_latency_max_s = 0.0  # the slowest chunk so far: its first forward's launch to its hand-over
        self.gen: ChunkGenerator | None = None
        self.sched: Scheduler | None = None

    # -- lifecycle (any thread) ---------------------------------------------------------------

    def start(self) -> Future:
        """Build the model and warm up in the engine thread; the future resolves when ready."""
        self._thread.start()
        return self._ready

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._commands.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- commands (any thread; answered by the engine thread between forwards) ---------------

    def open_stream(self, stream_id: str, prompt: str, seed: int, fps: int) -> Future:
        """Future[Admission]: admitted streams start generating at once."""
        return self._submit(self._open, stream_id, prompt, seed, fps)

    def set_prompt(self, stream_id: str, prompt: str) -> Future:
        """Future[int]: the new prompt's version."""
        return self._submit(self._set_prompt, stream_id, prompt)

    def pause(self, stream_id: str) -> Future:
        """The viewer stopped playing: generation stops once its buffer is full."""
        return self._submit(self._pause, stream_id, True)

    def resume(self, stream_id: str) -> Future:
        return self._submit(self._pause, stream_id, False)

    def observe_buffer(self, stream_id: str, buffered_frames: float) -> Future:
        return self._submit(self._observe, stream_id, buffered_frames)

    def request_keyframe(self, stream_id: str) -> Future:
        return self._submit(self._keyframe, stream_id)

    def close_stream(self, stream_id: str) -> Future:
        """Future[bool]: frees the stream's KV cache at once; False if it was not open."""
        return self._submit(self._close, stream_id)

    def _submit(self, fn, *args) -> Future:
        cmd = _Command(fn, args)
        if self._stopping:
            cmd.future.set_exception(EngineError("engine is stopping"))
        else:
            self._commands.put(cmd)
        return cmd.future

    # -- engine thread --------------------------------------------------------------------------

    def _main(self) -> None:
        try:
            self._build()
        except BaseException as e:  # noqa: BLE001 - reported to whoever awaits start()
            log.exception("engine failed to start")
            self._ready.set_exception(e)
            return
        self._ready.set_result(self)
        try:
            self._loop()
        finally:
            for cmd in self._drain():
                cmd.future.set_exception(EngineError("engine stopped"))
            for sid in list(self._streams):
                self._close(sid)

    def _build(self) -> None:
        cfg = self.config
        device = torch.device(cfg.device)
        if device.type == "cpu":
            torch.set_num_threads(cfg.cpu_threads)
        self.gen = build_generator(cfg.preset, device=device, seed=cfg.weights_seed, checkpoint=cfg.checkpoint, cfg=cfg.generator)
        if cfg.compile:
            from models.dit import compile_helpers

            compile_helpers()
        budget = cfg.kv_budget_bytes
        if budget is None:
            budget = int(torch.cuda.mem_get_info(device)[0] * 0.85) if device.type == "cuda" else 4 * 2**30
        spec = self.gen.cache_spec()
        if spec.quant != "none":  # the dequantization scratch is shared by all streams of the device
            from kvcache.quant import scratch_bytes

            budget -= scratch_bytes(spec)
        self.pool = CachePool(budget, device)
        self.kv_budget_bytes = budget
        self.sched = Scheduler(cfg.scheduler)
        self._warm_up()
        self.snapshot = self.sched.stats(self.clock())

    def _warm_up(self) -> None:
        """Run a throwaway stream so the first admissions use measured costs, not a guess."""
        gen = self.gen
        state = gen.open_stream("warmup", "warm up", seed=0)
        costs: dict[WorkKind, list[float]] = {k: [] for k in WorkKind}
        enc = StreamEncoder(gen.model_cfg.width, gen.model_cfg.height, 16)
        for chunk_index in range(max(2, self.config.warmup_chunks)):
            if chunk_index == self.config.warmup_chunks - 1:
                gen.set_prompt(state, "warm up again")
            while True:
                work = gen.next_work(state)
                t0 = self.clock()
                out = gen.run(work, [state])
                if out[0] is not None:
                    enc.encode(out[0].frames, start_index=out[0].first_frame)
                self._sync()
                if chunk_index > 0:  # the first chunk pays for lazy initialisation
                    costs[_KIND[work]].append(self.clock() - t0)
                if out[0] is not None:
                    break
        enc.close()
        for kind, times in costs.items():
            if times:
                self.sched.costs.observe(kind, 1, sorted(times)[len(times) // 2])
        log.info("warm-up costs (ms): %s", {k.value: round(1e3 * sorted(v)[len(v) // 2], 2) for k, v in costs.items() if v})

    def _sync(self) -> None:
        if self.gen.device.type == "cuda":
            torch.cuda.synchronize(self.gen.device)

    def _drain(self) -> list[_Command]:
        out = []
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return out
            if cmd is not None:
                out.append(cmd)

    def _apply(self, cmd: _Command) -> None:
        try:
            cmd.future.set_result(cmd.fn(*cmd.args))
        except Exception as e:  # noqa: BLE001 - the caller gets the error through the future
            cmd.future.set_exception(e)

    def _loop(self) -> None:
        while not self._stopping:
            for cmd in self._drain():
                self._apply(cmd)
            now = self.clock()
            plan = self.sched.next(now)
            if plan is None:
                self.snapshot = self.sched.stats(now)
                wake = self.sched.wake_at(now)
                timeout = 0.5 if wake is None else min(0.5, max(0.0, wake - now))
                try:
                    cmd = self._commands.get(timeout=timeout)
                except queue.Empty:
                    continue
                if cmd is not None:
                    self._apply(cmd)
                continue
            self._execute(plan)

    def _execute(self, plan: Plan) -> None:
        streams = [self._streams[sid] for sid in plan.stream_ids]
        t0 = self.clock()
        try:
            chunks = self._run(plan, streams)
            self._sync()
        except Exception as e:  # noqa: BLE001 - one plan's failure ends its streams, not the engine
            log.exception("forward %s for %s failed", plan.kind.value, plan.stream_ids)
            self.sched.cancel(plan)
            for sid in plan.stream_ids:
                self._close(sid)
                self._on_error(sid, f"generation failed: {type(e).__name__}: {e}")
            return
        now = self.clock()
        elapsed = now - t0
        self.forwards[plan.kind.value] += 1
        self.forward_seconds[plan.kind.value] += elapsed
        self.sched.complete(plan, now, elapsed)
        for out in chunks:
            self._on_chunk(out)
        self.snapshot = self.sched.stats(now)

    def _run(self, plan: Plan, streams: list[_Stream]) -> list[ChunkOut]:
        gen = self.gen
        for st, seq, restart in zip(streams, plan.prompt_seqs, plan.restart):
            state = st.state
            if seq > state.prompt_version:
                gen.set_prompt(state, st.prompts[seq], version=seq)
            if restart or (plan.kind is not WorkKind.COMMIT and plan.step <= 0 and state.step != 0):
                gen.abandon_chunk(state)
            if plan.kind is WorkKind.DENOISE and plan.step > 0 and state.step != plan.step:
                raise EngineError(f"stream {state.stream_id}: plan step {plan.step}, generator at step {state.step}")
        states = [st.state for st in streams]
        if plan.kind is WorkKind.RECACHE:
            for state in states:
                if state.pending_prompt is None:  # the plan's version is already applied: nothing to redo
                    continue
                gen.recache(state)
            return []
        if plan.kind is WorkKind.DENOISE:
            if plan.step == 0:
                for st in streams:
                    st.chunk_started_at = self.clock()
            gen.denoise(states)
            return []
        now = self.clock()
        outs = []
        for st, chunk in zip(streams, gen.commit(states)):
            keyframe = st.keyframe
            st.keyframe = False
            packets = st.encoder.encode(chunk.frames, start_index=chunk.first_frame, keyframe=keyframe)
            aus = [bytes(p) for p in packets]
            header = ChunkHeader.describe(
                aus, index=chunk.index, pts=chunk.first_frame, prompt_version=chunk.prompt_version, keyframe=keyframe
            )
            outs.append(ChunkOut(st.state.stream_id, header, aus, packets, pack_chunk(header, aus), now - st.chunk_started_at))
        return outs

    # -- command bodies (engine thread) ---------------------------------------------------------

    def _get(self, stream_id: str) -> _Stream:
        if stream_id not in self._streams:
            raise EngineError(f"stream {stream_id!r} is not open")
        return self._streams[stream_id]

    def _open(self, stream_id: str, prompt: str, seed: int, fps: int) -> Admission:
        if stream_id in self._streams:
            raise EngineError(f"stream {stream_id!r} is already open")
        gen = self.gen
        spec = gen.cache_spec()
        req = StreamRequest(
            stream_id, fps=float(fps), first_chunk_frames=gen.frames_in_chunk(0), chunk_frames=gen.frames_in_chunk(1)
        )
        admission = self.sched.admit(req, self.clock(), kv_refusal=self.pool.refusal(spec))
        if not admission.accepted:
            return admission
        try:
            cache = self.pool.allocate_or_raise(stream_id, spec)
            state = gen.open_stream(stream_id, prompt, seed, cache)
            encoder = StreamEncoder(gen.model_cfg.width, gen.model_cfg.height, fps)
        except Exception:
            self.sched.remove(stream_id)
            self.pool.release(stream_id)
            raise
        self._streams[stream_id] = _Stream(state, fps, encoder, {0: prompt})
        self.kv_used_bytes = self.pool.used_bytes
        return admission

    def _set_prompt(self, stream_id: str, prompt: str) -> int:
        st = self._get(stream_id)
        version = self.sched.set_prompt(stream_id, self.clock())
        st.prompts[version] = prompt
        for old in [v for v in st.prompts if v < version - 8]:  # keep a few recent versions only
            del st.prompts[old]
        return version

    def _pause(self, stream_id: str, paused: bool) -> None:
        self._get(stream_id)
        (self.sched.pause if paused else self.sched.resume)(stream_id, self.clock())

    def _observe(self, stream_id: str, buffered_frames: float) -> None:
        self._get(stream_id)
        self.sched.observe_buffer(stream_id, buffered_frames, self.clock())

    def _keyframe(self, stream_id: str) -> None:
        self._get(stream_id).keyframe = True

    def _close(self, stream_id: str) -> bool:
        st = self._streams.pop(stream_id, None)
        self.sched.remove(stream_id)
        self.pool.release(stream_id)
        self.kv_used_bytes = self.pool.used_bytes
        if st is None:
            return False
        st.encoder.close()
        return True
