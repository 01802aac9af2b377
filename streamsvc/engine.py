"""The engine: one thread per device that decides and launches the scheduler's plans.

The loop reads like vLLM v1's core: `plan = scheduler.next()`, launch the plan's forward (a CUDA
graph replay on a GPU), record CUDA events around it, and go on to the next plan while the GPU
works. The scheduler counts a plan done when it is launched; what it cost comes from the events
once they have passed, and a chunk counts as delivered when the output stage (streamsvc/output.py)
has encoded it. At most two plans are in flight on the device, so a command (a prompt, a close)
waits at most one forward.

The event loop never touches the model, the scheduler or the KV pool. It sends commands (open,
prompt, pause, close, ...) that the engine thread applies between launches and answers through
concurrent futures; finished chunks come back through `on_chunk` (from the output workers),
errors through `on_error(stream_id, message, code)`, both of which the server wraps in
`loop.call_soon_threadsafe`. The code is "internal" for a failure, "overloaded" for the last
resort: the newest stream ended because degradation could no longer keep every stream from
stalling (Scheduler.overloaded), "park_expired" for a paused stream parked longer than
`park_timeout_s`.

Pause and resume (issue 27). `pause` holds the stream (the scheduler starts no new chunk for it; the
chunk in progress is committed, so nothing is redone and the stream goes on exactly where it was), then
parks it between launches: its whole state (KV cache, text K/V, decoder state, clean latents) is
copied to pinned host memory on a side CUDA stream after the work already queued, and once the copy's
event has passed its device memory goes back to the pool and the future resolves. Parked streams share
`park_budget_bytes` of host memory (a pause beyond it is refused) and end after `park_timeout_s`.
`resume` re-checks admission (KV room, the device's load, ...; refused, the stream stays parked),
allocates a fresh cache from the pool and copies everything back; the device's next work waits for the
copies, so the stream is scheduled again at once.

Before serving, the engine captures every CUDA graph serving replays (models/graphs.py) and runs
a throwaway stream through a full window, every ring phase and prompt switches, timing each kind
of forward at least five times; the scheduler starts from the medians.
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

import torch

from kvcache import CachePool, ParkBudget
from models import ChunkGenerator, GeneratorConfig, ParkedStream, StreamState, Work, build_generator, fidelity
from streamsvc.encode import EncoderSpec, StreamEncoder
from streamsvc.output import ChunkOut, OutputStage, StreamOutput
from streamsvc.scheduler import Admission, Plan, Scheduler, SchedulerConfig, SchedulerStats, Stage, StreamRequest, WorkKind

log = logging.getLogger("streamsvc.engine")

__all__ = ["ChunkOut", "Engine", "EngineConfig", "EngineError", "ParkResult"]

CHEAP_ENCODE_GAIN = 0.9  # the cheaper encode degrades a late chunk only when the warm-up timed it under this share
_KIND = {Work.RECACHE: WorkKind.RECACHE, Work.DENOISE: WorkKind.DENOISE, Work.COMMIT: WorkKind.COMMIT}  # generator -> scheduler


def keep_freed_memory(limit: int = 1 << 30) -> bool:
    """Make glibc's malloc keep what CPU tensors free for the next ones, instead of mapping every large
    block afresh and unmapping it when freed: each new mapping is paid again in page faults on first
    touch (a chunk's decode writes some 2 MB tensors a frame batch). Large blocks (up to its 32 MiB
    maximum) come from the heap, and the heap is not trimmed below `limit`. On the tiny preset this
    cuts a commit of 4 streams from 41-53 to 24-31 ms on a 2-core CPU. False where malloc is not glibc's."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
    return bool(mallopt(m_mmap_threshold, 32 << 20)) and bool(mallopt(m_trim_threshold, limit))


class EngineError(RuntimeError):
    """The engine was used against its contract (unknown stream, not running, ...)."""


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine builds: the model on its device, the KV pool, the scheduler."""

    preset: str = "tiny"  # model preset (models.PRESETS)
    device: str = "cpu"  # torch device of the model and the KV pool
    checkpoint: str | None = None  # local DiT weights (file or Wan folder); None: wan_dir's, else random
    weights_seed: int = 0
    wan_dir: str | None = None  # Wan2.1 folder (either layout): umT5, the VAE, the base DiT
    lora: str | None = None  # a LoRA merged into the checkpoint (LongLive)
    lora_alpha: float | None = None  # None: the LoRA's rank (scale 1)
    wrapper: str = "auto"  # which state dict of a training checkpoint: auto | generator | generator_ema
    decoder: str = "auto"  # tiny | wan-vae | taehv | auto (wan-vae with wan_dir, else tiny)
    taehv: str | None = None  # TAEHV's taew2_1.pth, for decoder taehv
    # a whole model file (DiT, decoder, text vectors): "builtin" (the tiny preset's, shipped), a path, "auto" (builtin
    # for the tiny preset without checkpoint or wan_dir); None / "random": the fields above (models.weights.resolve_weights)
    weights: str | None = None
    generator: GeneratorConfig = GeneratorConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    kv_budget_bytes: int | None = None  # KV pool budget; None: 4 GiB on CPU, 85% of free memory on a GPU
    cpu_threads: int = 1  # torch intra-op threads on CPU (the event loop and encoders need the other cores)
    compile: bool | None = None  # torch.compile the DiT's elementwise helpers; None: on CUDA only
    warmup_chunks: int = 6  # chunks the warm-up stream runs once its window is full (>= 5 samples per kind)
    # A chunk about to be late runs fewer denoising steps (GeneratorConfig.degraded_steps) instead of stalling.
    degrade: bool = True
    output_workers: int | None = None  # encoder threads; None: a quarter of the cores, 1 to 4
    # x264 in a child process per output worker, out of the server's GIL; None: on CPU hosts (on a GPU host the
    # engine thread only launches, and a 480x832 chunk's frames would cross a pipe)
    output_processes: bool | None = None
    # Host memory all paused (parked) streams may hold: their KV caches and decoder states, pinned on a GPU host
    # (a wan2.1-1.3b stream at sink 3 + window 9: 3.2 GiB of KV); a pause beyond it is refused. 0: no pausing.
    park_budget_bytes: int = 8 * 2**30
    park_timeout_s: float = 300.0  # a stream parked longer is ended ("park_expired")

    def __post_init__(self) -> None:
        if self.park_budget_bytes < 0:
            raise ValueError(f"park_budget_bytes={self.park_budget_bytes}: must be >= 0 (0 refuses every pause)")
        if not self.park_timeout_s > 0:
            raise ValueError(f"park_timeout_s={self.park_timeout_s}: must be > 0 s (e.g. 300)")


@dataclass(frozen=True)
class ParkResult:
    """What a pause (the stream parked) or a resume (it came back) moved."""

    stream_id: str
    nbytes: int  # bytes copied: the stream's KV cache, text K/V, decoder state and latents (what it holds parked)
    seconds: float  # the copies' time (CUDA events on the copy stream; CPU: wall time)
    device_bytes: int  # the KV pool's bytes given back (pause) or taken again (resume), the decoder's included


@dataclass
class _Park:
    """A stream being paused, paused, or coming back."""

    paused: Future  # resolves to ParkResult once the stream is parked (the copies to the host done)
    reserved: int  # bytes of the park budget it holds
    parked: ParkedStream | None = None  # set when its copies to the host were launched (between chunks)
    parked_at: float | None = None  # engine clock when they were done (the park timeout counts from here)
    resumed: Future | None = None  # resume(): resolves to ParkResult once the copies back are done
    device_bytes: int = 0  # pool bytes given back


@dataclass
class _Stream:
    state: StreamState
    fps: int
    output: StreamOutput  # its encoder, on its output worker
    prompts: dict[int, str]  # prompt text by version
    chunk_started_at: float = 0.0  # launch of the chunk in progress's first forward
    recached: bool = False  # a recache launched the chunk about to start (its time counts from there)
    keyframe: bool = True  # next chunk starts with an IDR (a viewer joined)
    park: _Park | None = None  # pause(): being parked, parked, or (until its copies are done) coming back


@dataclass
class _Command:
    fn: Callable  # run in the engine thread
    args: tuple
    future: Future = field(default_factory=Future)
    later: bool = False  # fn(future, *args) resolves the future itself, maybe later (fn's errors still do)


@dataclass
class _InFlight:
    """A launched plan whose forward the device may still be running."""

    kind: WorkKind
    batch: int  # streams in the forward
    launched_at: float  # engine clock at launch
    start: torch.cuda.Event | None  # recorded before its forward (None on CPU: it ran at launch)
    end: torch.cuda.Event | None
    elapsed_s: float = 0.0  # CPU: the forward's wall time


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        on_chunk: Callable[[ChunkOut], None],
        on_error: Callable[[str, str, str], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._on_chunk, self._on_error = on_chunk, on_error
        self.clock = clock
        self._commands: queue.SimpleQueue[_Command | None] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._in_flight: deque[_InFlight] = deque()
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
        self.decoder_bytes = 0  # device memory of one stream's decoder state, counted with its KV cache
        self.degraded_chunks = 0  # chunks made with fewer denoising steps than the schedule's (instead of a stall)
        self.park_budget = ParkBudget(config.park_budget_bytes)  # host memory of parked streams (engine thread)
        self.parked_streams = 0  # streams parked now (their copies to the host launched, not resumed)
        self.parked_bytes = 0  # host memory they hold (what the park budget counts)
        self.parks = 0  # pauses done (streams parked)
        self.restores = 0  # resumes done (streams back on the device)
        self.park_seconds = 0.0  # total time of the parks' copies to the host
        self.restore_seconds = 0.0  # total time of the resumes' copies back
        self.last_park_seconds: float | None = None  # the latest park's copy time (None: none yet)
        self.last_restore_seconds: float | None = None  # the latest resume's copy time (None: none yet)
        self._cheap_encode = False  # the warm-up measured the cheaper encode cheaper: a late chunk's encode degrades
        self.heartbeat_at: float | None = None  # engine clock at the loop's latest turn (None: not serving yet)
        self.gen: ChunkGenerator | None = None
        self.sched: Scheduler | None = None
        self.output: OutputStage | None = None

    # output-stage figures, read by the event loop (metrics)
    @property
    def encode_seconds(self) -> float:
        return self.output.encode_seconds if self.output else 0.0

    @property
    def chunks_encoded(self) -> int:
        return self.output.chunks if self.output else 0

    @property
    def fast_encodes(self) -> int:
        """Chunks the output stage encoded cheaper to meet their deadline."""
        return self.output.fast_chunks if self.output else 0

    @property
    def chunk_latency_max_s(self) -> float:
        return self.output.latency_max_s if self.output else 0.0

    def stalled_for(self) -> float | None:
        """Seconds since the engine thread's loop last turned (a turn waits 0.5 s at most when idle, one
        forward when busy); inf when the thread has died, None while it builds and warms up."""
        if not self._thread.is_alive() and self._thread.ident is not None:
            return float("inf")
        return None if self.heartbeat_at is None else max(0.0, self.clock() - self.heartbeat_at)

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
        if self.output is not None:
            self.output.stop()

    # -- commands (any thread; answered by the engine thread between launches) ---------------

    def open_stream(self, stream_id: str, prompt: str, seed: int, fps: int) -> Future:
        """Future[Admission]: admitted streams start generating at once."""
        return self._submit(self._open, stream_id, prompt, seed, fps)

    def set_prompt(self, stream_id: str, prompt: str) -> Future:
        """Future[int]: the new prompt's version."""
        return self._submit(self._set_prompt, stream_id, prompt)

    def pause(self, stream_id: str) -> Future:
        """Future[ParkResult]: the stream's chunk in progress is committed, then its state is parked in host
        memory and its device memory goes back to the pool; resolves once parked. Fails (EngineError) for a
        stream not open or already paused, or when the park budget has no room for it."""
        return self._submit_later(self._pause, stream_id)

    def resume(self, stream_id: str) -> Future:
        """Future[ParkResult]: the paused stream back on the device, going on where it stopped; resolves once
        its copies back are done. Fails (EngineError, the reason with the numbers; the stream stays paused)
        when admission refuses it now (no KV room, the device's load, ...), or for a stream not paused. A
        stream still finishing its chunk before its park goes on at once (ParkResult of 0 bytes) and its
        pause fails."""
        return self._submit_later(self._resume, stream_id)

    def observe_buffer(self, stream_id: str, buffered_frames: float, at_most: bool = False,
                       grace_s: float = 0.0) -> Future:
        """The viewer's buffer (Scheduler.observe_buffer: `at_most` for a report that crossed the network,
        `grace_s` for what the viewer holds beyond it)."""
        return self._submit(self._observe, stream_id, buffered_frames, at_most, grace_s)

    def request_keyframe(self, stream_id: str) -> Future:
        return self._submit(self._keyframe, stream_id)

    def admit_viewer(self, stream_id: str) -> Future:
        """Future[Admission]: one more viewer (a watcher) of the stream's chunks, if the send has room; an
        accepted one carries the stream's modelled buffer (`buffered_s`)."""
        return self._submit(lambda: self.sched.admit_viewer(self._get(stream_id).state.stream_id, self.clock()))

    def viewer_left(self, stream_id: str) -> Future:
        """A viewer of the stream left (the stream goes on)."""
        return self._submit(self.sched.viewer_left, stream_id)

    def observe_send(self, seconds_per_chunk: float) -> Future:
        """What the transports' send cost the event loop per chunk lately (admission's SEND stage)."""
        return self._submit(self.sched.observe_stage, Stage.SEND, seconds_per_chunk)

    def close_stream(self, stream_id: str) -> Future:
        """Future[bool]: frees the stream's KV cache at once; False if it was not open."""
        return self._submit(self._close, stream_id)

    def _submit_later(self, fn, *args) -> Future:
        return self._submit(fn, *args, later=True)

    def _submit(self, fn, *args, later: bool = False) -> Future:
        cmd = _Command(fn, args, later=later)
        if self._stopping:
            cmd.future.set_exception(EngineError("engine is stopping"))
        else:
            self._commands.put(cmd)
        return cmd.future

    # -- engine thread: start-up ----------------------------------------------------------------

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
            self._wait_all()
            for cmd in self._drain():
                cmd.future.set_exception(EngineError("engine stopped"))
            for sid in list(self._streams):
                self._close(sid)

    def _build(self) -> None:
        cfg = self.config
        device = torch.device(cfg.device)
        if device.type == "cpu":
            torch.set_num_threads(cfg.cpu_threads)
            if not keep_freed_memory():
                log.info("not glibc's malloc: CPU tensors' large blocks go back to the OS when freed (slower chunks)")
        t0 = time.monotonic()
        self.gen = gen = build_generator(
            cfg.preset, device=device, seed=cfg.weights_seed, checkpoint=cfg.checkpoint, cfg=cfg.generator,
            lora=cfg.lora, lora_alpha=cfg.lora_alpha, wrapper=cfg.wrapper, wan_dir=cfg.wan_dir, decoder=cfg.decoder,
            taehv=cfg.taehv, weights=cfg.weights,
        )
        self.decoder_bytes = gen.decoder_state_bytes()  # counted with each stream's KV cache
        log_attention(device)
        if cfg.compile if cfg.compile is not None else device.type == "cuda":
            from models.dit import compile_helpers

            compile_helpers()
        budget = cfg.kv_budget_bytes
        if budget is None:
            budget = int(torch.cuda.mem_get_info(device)[0] * 0.85) if device.type == "cuda" else 4 * 2**30
        spec = gen.cache_spec()
        if spec.quant != "none":  # the dequantization scratch is shared by all streams of the device
            from kvcache.quant import scratch_bytes

            budget -= scratch_bytes(spec)
        self.pool = CachePool(budget, device)
        self.kv_budget_bytes = budget
        # the scheduler plans the generator's schedule, and its shorter ones instead of stalls unless told not to
        degrade = gen.cfg.shorter_steps if cfg.degrade else ()
        workers = cfg.output_workers or min(4, max(1, (os.cpu_count() or 1) // 4))
        self.sched = Scheduler(replace(cfg.scheduler, denoise_steps=len(gen.sigmas), degrade_steps=degrade,
                                       output_capacity=float(workers)))
        log.info("%s", fidelity.describe(gen.cfg, bool(degrade)))  # which speed options run (models/fidelity.py)
        processes = cfg.output_processes if cfg.output_processes is not None else device.type == "cpu"
        self.output = OutputStage(device, workers, self._handed_over, self._output_failed, self.clock, processes)
        log.info("model ready in %.1f s", time.monotonic() - t0)
        if device.type == "cuda":
            log.info("capturing CUDA graphs (compiles kernels on first sight; takes a while the first time)")
            t0 = time.monotonic()
            n = gen.capture_graphs()
            log.info("captured %d CUDA graphs in %.1f s", n, time.monotonic() - t0)
        self._warm_up()
        self.snapshot = self.sched.stats(self.clock())

    def _warm_up(self) -> None:
        """Time what serving runs: a throwaway stream fills its window, turns the ring and switches
        prompts (a recache each time, as the speed options shape it); at least 5 samples of each kind of forward once
        the window is full, the median of each goes to the scheduler."""
        gen, cfg = self.gen, self.config
        state = gen.open_stream("warmup", "warm up", seed=0)
        enc = StreamEncoder(gen.model_cfg.width, gen.model_cfg.height, 16)
        costs: dict[WorkKind, list[float]] = {k: [] for k in WorkKind}
        encodes: dict[bool, list[float]] = {False: [], True: []}  # x264 per chunk: normal, fast (steady, no switch)
        capacity = gen.cache_spec().capacity_frames
        full_chunks, index = 0, 0
        try:
            while full_chunks < max(5, cfg.warmup_chunks):
                full = state.cache.num_frames == capacity
                if full:
                    gen.set_prompt(state, f"warm up {full_chunks}")
                    full_chunks += 1
                frames = self._run_chunk([state], costs if full else None)[0].frames.cpu().numpy()
                for fast in (False, False, True, True) if full else (False,):  # each pair's first one switches
                    t0 = time.perf_counter()
                    enc.encode(frames, start_index=index, fast=fast)
                    encodes[fast].append(time.perf_counter() - t0)
                    index += len(frames)
        finally:
            gen.close_stream(state)
            enc.close()
        medians = self._seed_costs(costs, 1)
        pairs = {fast: [a + b for a, b in zip(t[-2 * full_chunks::2], t[-2 * full_chunks + 1::2])]
                 for fast, t in encodes.items()}  # two chunks in a mode, the switch into it included
        normal_s, fast_s = (statistics.median(pairs[fast]) / 2 for fast in (False, True))
        self.sched.seed_stage(Stage.OUTPUT, statistics.median(encodes[False][-2 * full_chunks + 1::2]))
        # the cheaper encode is a degradation only where it is cheaper, switches included (at 128x128 x264 is a
        # fifth of a chunk's encode, and a switch costs an IDR and, the first time, an encoder)
        self._cheap_encode = fast_s < CHEAP_ENCODE_GAIN * normal_s
        log.info("warm-up: forward costs at a full cache, median of %s runs (ms): %s; x264 %.2f ms a chunk, %.2f ms "
                 "encoded cheaper (%s)", "/".join(str(len(costs[k])) for k in medians),
                 {k.value: round(1e3 * v, 2) for k, v in medians.items()}, 1e3 * normal_s, 1e3 * fast_s,
                 "a late chunk's degradation" if self._cheap_encode else "no gain: late chunks keep the normal encode")
        if self.sched.config.max_batch > 1:
            self._warm_up_batched(self.sched.config.max_batch)

    def _warm_up_batched(self, batch: int) -> None:
        """Time a full batch too (max_batch throwaway streams in step, at a full cache): without it admission
        counts a batch as its streams one by one until serving has measured one, and a burst of newcomers
        (all arriving before any batch ran) is refused below what the device carries."""
        gen = self.gen
        states = [gen.open_stream(f"warmup-{i}", "warm up", seed=i) for i in range(batch)]
        costs: dict[WorkKind, list[float]] = {k: [] for k in WorkKind}
        capacity = gen.cache_spec().capacity_frames
        try:
            for _ in range(capacity // gen.cfg.frames_per_chunk + 3):  # fill the caches, then 3 chunks timed
                self._run_chunk(states, costs if states[0].cache.num_frames == capacity else None)
        finally:
            for state in states:
                gen.close_stream(state)
        medians = self._seed_costs(costs, batch)
        log.info("warm-up: batches of %d at a full cache (ms): %s", batch, {k.value: round(1e3 * v, 2) for k, v in medians.items()})

    def _run_chunk(self, states: list[StreamState], costs: dict[WorkKind, list[float]] | None) -> list:
        """One chunk of `states` (in step, batched), forward by forward, each forward's time into
        costs[kind] when costs is given; returns the chunks."""
        gen = self.gen
        while True:
            work = gen.next_work(states[0])
            timer = _Timer(gen.device, self.clock)
            out = gen.run(work, states)
            if costs is not None:
                costs[_KIND[work]].append(timer.seconds())
            if out[0] is not None:
                return out

    def _seed_costs(self, costs: dict[WorkKind, list[float]], batch: int) -> dict[WorkKind, float]:
        """The median of each kind's times, seeded into the scheduler's costs at `batch`."""
        medians = {kind: statistics.median(times) for kind, times in costs.items() if times}
        for kind, seconds in medians.items():
            self.sched.seed_cost(kind, batch, seconds)
        return medians

    # -- engine thread: the loop ------------------------------------------------------------------

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
            if cmd.later:
                cmd.fn(cmd.future, *cmd.args)
            else:
                cmd.future.set_result(cmd.fn(*cmd.args))
        except Exception as e:  # noqa: BLE001 - the caller gets the error through the future
            if not cmd.future.done():
                cmd.future.set_exception(e)

    def _loop(self) -> None:
        while not self._stopping:
            self.heartbeat_at = self.clock()
            for cmd in self._drain():
                self._apply(cmd)
            self._retire(wait=False)
            now = self.clock()
            self._tend_parks(now)
            self._end_overloaded(now)
            plan = self.sched.next(now)
            if plan is not None:
                if len(self._in_flight) >= 2:  # the device has a forward running and one queued
                    self._retire(wait=True)
                self._launch(plan)
                continue
            self.snapshot = self.sched.stats(now)
            if self._in_flight:  # nothing to launch: wait for the device instead of the clock
                self._retire(wait=True)
                continue
            wake = self.sched.wake_at(now)
            timeout = 0.5 if wake is None else min(0.5, max(0.0, wake - now))
            if any(st.park is not None and (st.park.parked_at is None or st.park.resumed) for st in self._streams.values()):
                timeout = min(timeout, 0.002)  # copies to poll, or a stream to park once its chunk is committed
            try:
                cmd = self._commands.get(timeout=timeout)
            except queue.Empty:
                continue
            if cmd is not None:
                self._apply(cmd)

    def _launch(self, plan: Plan) -> None:
        """Launch `plan`'s forward (and for a COMMIT, its decode and the copy of its frames to the
        host) and count it done in the scheduler; its cost is read from its events later."""
        streams = [self._streams[sid] for sid in plan.stream_ids]
        now = self.clock()
        timer = _Timer(self.gen.device, self.clock)
        try:
            chunks = self._run(plan, streams, now)
        except Exception as e:  # noqa: BLE001 - one plan's failure ends its streams, not the engine
            log.exception("forward %s for %s failed", plan.kind.value, plan.stream_ids)
            self.sched.cancel(plan)
            for sid in plan.stream_ids:
                self._close(sid)
                self._on_error(sid, f"generation failed: {type(e).__name__}: {e}", "internal")
            return
        self._in_flight.append(timer.launched(plan.kind, len(streams), now))
        self.sched.complete(plan, now, None, deliver=False)
        for st, chunk in chunks:
            keyframe, st.keyframe = st.keyframe, False
            self.degraded_chunks += chunk.steps < len(self.gen.sigmas)
            self.output.submit(st.output, chunk.frames, index=chunk.index, first_frame=chunk.first_frame,
                               prompt_version=chunk.prompt_version, steps=chunk.steps, keyframe=keyframe,
                               started_at=st.chunk_started_at, encode_by=self._encode_by(st.state.stream_id))
        self.snapshot = self.sched.stats(now)

    def _retire(self, wait: bool) -> None:
        """Account the forwards the device has finished (with `wait`: at least the oldest one)."""
        while self._in_flight:
            f = self._in_flight[0]
            if f.end is not None:
                if not f.end.query():
                    if not wait:
                        return
                    f.end.synchronize()  # releases the GIL
                f.elapsed_s = f.start.elapsed_time(f.end) / 1e3
            wait = False
            self._in_flight.popleft()
            kind = f.kind.value
            self.forwards[kind] += 1
            self.gpu_seconds[kind] += f.elapsed_s
            self.forward_seconds[kind] += self.clock() - f.launched_at
            self.sched.observe_cost(f.kind, f.batch, f.elapsed_s)

    def _wait_all(self) -> None:
        try:
            while self._in_flight:
                self._retire(wait=True)
        except Exception:  # noqa: BLE001 - shutting down after a device error: nothing more to account
            log.exception("waiting for the device at shutdown failed")
            self._in_flight.clear()

    def _run(self, plan: Plan, streams: list[_Stream], now: float) -> list[tuple[_Stream, object]]:
        gen = self.gen
        for st, seq, restart, steps in zip(streams, plan.prompt_seqs, plan.restart, plan.steps):
            state = st.state
            if seq > state.prompt_version:
                gen.set_prompt(state, st.prompts[seq], version=seq)
            if restart or (plan.kind is not WorkKind.COMMIT and plan.step <= 0 and state.step != 0):
                gen.abandon_chunk(state)
            if plan.kind is WorkKind.DENOISE and plan.step > 0 and state.step != plan.step:
                raise EngineError(f"stream {state.stream_id}: plan step {plan.step}, generator at step {state.step}")
            if plan.kind is not WorkKind.RECACHE:
                gen.set_steps(state, steps)
        states = [st.state for st in streams]
        if plan.kind is WorkKind.RECACHE:
            for st in streams:
                st.chunk_started_at, st.recached = now, True  # the prompt's chunk starts with its recache
                if st.state.pending_prompt is not None:  # else the plan's version is already applied
                    gen.recache(st.state)
            return []
        if plan.kind is WorkKind.DENOISE:
            if plan.step == 0:
                for st in streams:
                    if not st.recached:
                        st.chunk_started_at = now
                    st.recached = False
            gen.denoise(states)
            return []
        return list(zip(streams, gen.commit(states)))

    def _handed_over(self, out: ChunkOut, stream: StreamOutput) -> None:
        """An output worker has encoded a chunk: to the transports, and (as a command) to the scheduler."""
        self._on_chunk(out)
        self._commands.put(_Command(self._delivered, (stream, out, self.clock())))

    def _delivered(self, stream: StreamOutput, out: ChunkOut, now: float) -> None:
        self.sched.observe_stage(Stage.OUTPUT, out.encode_s)
        if self._is_open(stream):  # not a closed stream whose id was opened again
            self.sched.delivered(stream.stream_id, now)
            if out.fast:
                self.sched.mark_late(stream.stream_id, now, f"chunk {out.header.index} encoded cheaper to meet its deadline")

    def _encode_by(self, stream_id: str) -> float | None:
        """The latest start of a normal encode of the stream's newest chunk: its viewer's deadline less the output
        stage's cost (p90) and the degrade margin; None (never cheaper) with degradation off or nothing playing."""
        deadline = self.sched.dry_at(stream_id)
        if not (self.config.degrade and self._cheap_encode) or deadline is None:
            return None
        return deadline - self.sched.stage_costs.estimate(Stage.OUTPUT) - self.sched.config.degrade_margin_s

    def _end_overloaded(self, now: float) -> None:
        """The last resort: end the stream the scheduler names, when degradation can no longer keep every stream
        from stalling."""
        victim = self.sched.overloaded(now)
        if victim is None or not self._close(victim):
            return
        log.warning("overloaded: ended stream %s, the newest, after degradation ran out and viewers still stalled",
                    victim)
        self._on_error(victim, "the server is overloaded: the newest stream ended so that the others keep playing "
                               "(degradation could no longer keep every stream from stalling); try again later",
                       "overloaded")

    def _output_failed(self, stream: StreamOutput, message: str) -> None:
        self._commands.put(_Command(self._fail, (stream, message)))

    def _fail(self, stream: StreamOutput, message: str) -> None:
        if self._is_open(stream) and self._close(stream.stream_id):
            self._on_error(stream.stream_id, message, "internal")

    def _is_open(self, stream: StreamOutput) -> bool:
        st = self._streams.get(stream.stream_id)
        return st is not None and st.output is stream

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
        admission = self.sched.admit(req, self.clock(), kv_refusal=self.pool.refusal(spec, self.decoder_bytes))
        if not admission.accepted:
            return admission
        try:
            cache = self.pool.allocate_or_raise(stream_id, spec, self.decoder_bytes)
            state = gen.open_stream(stream_id, prompt, seed, cache)
            # on a GPU host, two x264 threads per stream: the encode is part of every chunk's latency
            spec = EncoderSpec(gen.model_cfg.width, gen.model_cfg.height, fps, threads=2 if gen.device.type == "cuda" else 1)
        except Exception:
            self.sched.remove(stream_id)
            self.pool.release(stream_id)
            raise
        self._streams[stream_id] = _Stream(state, fps, self.output.open(stream_id, spec), {0: prompt})
        self.kv_used_bytes = self.pool.used_bytes
        return admission

    def _set_prompt(self, stream_id: str, prompt: str) -> int:
        st = self._get(stream_id)
        self.gen.encode_prompt(prompt)  # now, not inside its recache: the text encoder runs off the plan's time
        version = self.sched.set_prompt(stream_id, self.clock())
        st.prompts[version] = prompt
        for old in [v for v in st.prompts if v < version - 8]:  # keep a few recent versions only
            del st.prompts[old]
        return version

    def _pause(self, future: Future, stream_id: str) -> None:
        st = self._get(stream_id)
        if st.park is not None:
            raise EngineError(f"stream {stream_id!r} is already {'paused' if st.park.parked else 'being paused'}")
        need = self.gen.park_bytes(st.state)
        why = self.park_budget.reserve(stream_id, need)
        if why is not None:
            raise EngineError(f"cannot pause stream {stream_id!r}: {why}")
        self.sched.hold(stream_id)
        st.park = _Park(future, need)
        self._tend_parks(self.clock())

    def _resume(self, future: Future, stream_id: str) -> None:
        st = self._get(stream_id)
        park = st.park
        if park is None or park.resumed is not None:
            raise EngineError(f"stream {stream_id!r} is not paused")
        if park.parked is None:  # still committing its chunk: it just goes on
            self.sched.hold(stream_id, False)
            self.park_budget.release(stream_id)
            st.park = None
            park.paused.set_exception(EngineError(f"stream {stream_id!r} was resumed before it was parked"))
            future.set_result(ParkResult(stream_id, 0, 0.0, 0))
            return
        if park.parked_at is None:  # its copies to the host are still running: they finish first
            park.parked.cache.moved.wait()
            park.parked.moved.wait()
            self._parked(st, self.clock())
        spec = self.gen.cache_spec()
        now = self.clock()
        admission = self.sched.unpark(stream_id, now, kv_refusal=self.pool.refusal(spec, self.decoder_bytes))
        if not admission.accepted:
            raise EngineError(f"cannot resume stream {stream_id!r} now: {admission.reason}")
        try:
            cache = self.pool.allocate_or_raise(stream_id, spec, self.decoder_bytes)
            self.gen.restore(park.parked, cache)
        except Exception:
            self.pool.release(stream_id)
            self.sched.hold(stream_id)
            self.sched.park(stream_id, now)  # it stays parked
            raise
        self.kv_used_bytes = self.pool.used_bytes
        self.park_budget.release(stream_id)
        self.parked_streams -= 1
        self.parked_bytes = self.park_budget.used_bytes
        park.resumed = future
        self._tend_parks(now)

    def _tend_parks(self, now: float) -> None:
        """Between launches: park the held streams that reached a chunk boundary, finish the parks and resumes
        whose copies are done, and end the streams parked longer than park_timeout_s."""
        for stream_id, st in list(self._streams.items()):
            park = st.park
            if park is None:
                continue
            if park.parked is None:
                if self.sched.parkable(stream_id):
                    park.parked = self.gen.park(st.state)  # copies launched after the chunk's commit
                    self.sched.park(stream_id, now)
                    self.parked_streams += 1
            elif park.resumed is not None:
                if park.parked.done():
                    st.park = None
                    self.restores += 1
                    self.restore_seconds += park.parked.seconds
                    self.last_restore_seconds = park.parked.seconds
                    park.resumed.set_result(ParkResult(stream_id, park.parked.nbytes, park.parked.seconds,
                                                       park.device_bytes))
                continue
            if park.parked is not None and park.parked_at is None and park.parked.done():
                self._parked(st, now)
            elif park.parked_at is not None and now - park.parked_at >= self.config.park_timeout_s:
                self._close(stream_id)
                log.info("stream %s parked for %.0f s: ended (--park-timeout)", stream_id, now - park.parked_at)
                self._on_error(stream_id, f"the stream was paused for more than {self.config.park_timeout_s:g} s "
                                          "(--park-timeout) and has ended; open a new stream", "park_expired")

    def _parked(self, st: _Stream, now: float) -> None:
        """The stream's copies to the host are done: its device memory goes back to the pool (its cache's
        last reference is dropped with the copies' sources), the park budget holds what it really took."""
        park, stream_id = st.park, st.state.stream_id
        park.parked_at = now
        park.device_bytes = self.pool.release(stream_id)
        self.kv_used_bytes = self.pool.used_bytes
        self.park_budget.release(stream_id)
        # what it holds, which may exceed what pause() reserved: a decoder whose state the chunk committed
        # meanwhile created (a first chunk) or grew. The copies are made: held anyway, the next pause refused
        over = self.park_budget.reserve(stream_id, park.parked.nbytes, force=True)
        if over is not None:
            log.warning("stream %s parked %d bytes, %d more than pause() reserved: over the park budget (%s)",
                        stream_id, park.parked.nbytes, park.parked.nbytes - park.reserved, over)
        park.reserved = park.parked.nbytes
        self.parked_bytes = self.park_budget.used_bytes
        self.parks += 1
        self.park_seconds += park.parked.seconds
        self.last_park_seconds = park.parked.seconds
        park.paused.set_result(ParkResult(stream_id, park.parked.nbytes, park.parked.seconds, park.device_bytes))

    def _observe(self, stream_id: str, buffered_frames: float, at_most: bool, grace_s: float) -> None:
        self._get(stream_id)
        self.sched.observe_buffer(stream_id, buffered_frames, self.clock(), at_most=at_most, grace_s=grace_s)

    def _keyframe(self, stream_id: str) -> None:
        self._get(stream_id).keyframe = True

    def _close(self, stream_id: str) -> bool:
        st = self._streams.pop(stream_id, None)
        self.sched.remove(stream_id)
        if st is not None and st.park is not None:  # its host memory goes (with the parked copies)
            park = st.park
            if park.parked is not None and park.parked_at is None:  # copies still writing its host memory
                park.parked.cache.moved.wait()
                park.parked.moved.wait()
            if park.parked is not None and park.resumed is None:
                self.parked_streams -= 1
            self.park_budget.release(stream_id)
            self.parked_bytes = self.park_budget.used_bytes
            for fut in (park.paused, park.resumed):
                if fut is not None and not fut.done():
                    fut.set_exception(EngineError(f"stream {stream_id!r} was closed"))
        if st is not None and st.state.cache is not None:
            self.gen.close_stream(st.state)
        self.pool.release(stream_id)  # launched forwards that write it run first on the device's one queue
        self.kv_used_bytes = self.pool.used_bytes
        if st is None:
            return False
        self.output.close(st.output)
        return True


class _Timer:
    """CUDA events around launched work (read later), or the wall time of work that ran at once."""

    def __init__(self, device: torch.device, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.start = None
        self.t0 = clock()
        if device.type == "cuda":
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record()

    def launched(self, kind: WorkKind, batch: int, now: float) -> _InFlight:
        end = None
        if self.start is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        return _InFlight(kind, batch, now, self.start, end, self.clock() - self.t0)

    def seconds(self) -> float:
        """Wait for the work and return its time (warm-up)."""
        if self.start is None:
            return self.clock() - self.t0
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        return self.start.elapsed_time(end) / 1e3


def log_attention(device: torch.device) -> None:
    """Say which self-attention kernel runs on `device`, and how to get the fast one when it is missing."""
    from models import flash

    if device.type != "cuda":
        return
    why_not = flash.status(device)
    if why_not is None:
        log.info("attention: FlashAttention-4 for the self-attention, cuDNN SDPA for the cross-attention")
    else:
        log.warning("attention: SDPA (cuDNN) for all attention; FlashAttention-4 is not in use: %s", why_not)
