"""The engine: one thread per device that decides and launches the scheduler's plans.

The loop reads like vLLM v1's core: `plan = scheduler.next()`, launch the plan's forward (a CUDA graph replay on a
GPU), record CUDA events around it, and go on to the next plan while the GPU works. The scheduler counts a plan done
when it is launched; what it cost comes from the events once they have passed, and a chunk counts as delivered when
the output stage (engine/output.py) has encoded it. At most two plans are in flight on the device, so a command (a
prompt, a close) waits at most one forward.

The event loop never touches the model, the scheduler or the KV pool. It sends commands (open, prompt, pause, close,
...) that the engine thread applies between launches and answers through concurrent futures; finished chunks come
back through `on_chunk` (from the output workers), errors through `on_error(stream_id, message, code)`, both of which
the server wraps in `loop.call_soon_threadsafe`. The code is "internal" for a failure, "overloaded" for the last
resort: the newest stream ended because degradation could no longer keep every stream from stalling
(Scheduler.overloaded), "park_expired" for a paused stream parked longer than `park_timeout_s`. Pause and resume park
a stream's whole state in host memory between launches and bring it back (engine/parking.py).

Before serving, the engine captures every CUDA graph serving replays (models/graphs.py) and runs a throwaway stream
through a full window, every ring phase and prompt switches, timing each kind of forward at least five times; the
scheduler starts from the medians (engine/warmup.py). Launched forwards are timed by CUDA events (engine/timing.py).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace

import torch

from kvcache import CachePool, ParkBudget
from models import ChunkGenerator, StreamState, fidelity
from models.work import WorkKind
from streamsvc.engine.commands import Commands
from streamsvc.engine.config import EngineConfig
from streamsvc.engine.encode import EncoderSpec
from streamsvc.engine.errors import EngineError
from streamsvc.engine.images import IMAGE_AND_INPUT, StartImages
from streamsvc.engine.output import ChunkOut, OutputStage, StreamOutput
from streamsvc.engine.parking import Parking
from streamsvc.engine.reports import PARKING_FIGURES, EngineStats, ModelShape, Opened, PromptAccepted, StreamDescription
from streamsvc.engine.styles import StyleLibrary
from streamsvc.engine.timing import InFlight, Timer
from streamsvc.engine.warmup import keep_freed_memory, log_attention, warm_up
from streamsvc.inputs.stage import InputStage, seed_input_stage
from streamsvc.scheduling import Admission, Plan, Scheduler, SchedulerStats, Stage, StreamRequest, without_streamless

log = logging.getLogger("streamsvc.engine")


@dataclass
class _Stream:
    state: StreamState
    fps: int
    output: StreamOutput  # its encoder, on its output worker
    chunk_started_at: float = 0.0  # launch of the chunk in progress's first forward
    recached: bool = False  # a recache launched the chunk about to start (its time counts from there)
    keyframe: bool = True  # next chunk starts with an IDR (a viewer joined)
    has_input: bool = False  # it takes input video (streamsvc/inputs/stage.py)


class Engine:
    def __init__(self, config: EngineConfig, on_chunk: Callable[[ChunkOut], None],
                 on_error: Callable[[str, str, str], None], clock: Callable[[], float] = time.monotonic,
                 streamless: Callable[[], tuple[float, int]] | None = None) -> None:
        self.config = config
        # the event loop's CPU on clients without a stream so far and their events (the server's meter): on a CPU
        # device it is left out of the forwards' cost samples (scheduling.without_streamless)
        self._streamless = streamless
        self._on_chunk, self._on_error = on_chunk, on_error
        self.clock = clock
        self._commands = Commands()  # what other threads ask of the engine thread (streamsvc/engine/commands.py)
        self._streams: dict[str, _Stream] = {}
        self._in_flight: deque[InFlight] = deque()
        self._thread = threading.Thread(target=self._main, name=f"engine-{config.device}", daemon=True)
        self._ready = Future()
        self._stopping = False
        # the engine thread's figures (replaced, never mutated): the event loop reads them through `stats()`
        self._snapshot: SchedulerStats | None = None
        self._kv_used_bytes = 0
        self._kv_budget_bytes = 0
        self._forwards: dict[str, int] = {w.value: 0 for w in WorkKind}  # (see EngineStats)
        self._forward_seconds: dict[str, float] = {w.value: 0.0 for w in WorkKind}
        self._gpu_seconds: dict[str, float] = {w.value: 0.0 for w in WorkKind}
        self.decoder_bytes = 0  # device memory of one stream's decoder state, counted with its KV cache
        self._degraded_chunks = 0
        self.park_budget = ParkBudget(config.park_budget_bytes)  # host memory of parked streams (engine thread)
        self._cheap_encode = False  # the warm-up measured the cheaper encode cheaper: a late chunk's encode degrades
        self.heartbeat_at: float | None = None  # engine clock at the loop's latest turn (None: not serving yet)
        self.gen: ChunkGenerator | None = None
        self.sched: Scheduler | None = None
        self.pool: CachePool | None = None  # the device's KV caches
        self.output: OutputStage | None = None
        self.parking: Parking | None = None  # paused streams (streamsvc/engine/parking.py)
        self.inputs: InputStage | None = None  # streams' input video (issue 35): releases, frames to the generator
        self.shape: ModelShape | None = None  # what every stream has (frame size, chunks, words): set once ready
        self.styles = StyleLibrary(None, {})  # the styles offered (streamsvc/engine/styles.py): set once built
        self.images = StartImages()  # streams started from an image (streamsvc/engine/images.py): set once built

    def stats(self) -> EngineStats:
        """The engine's figures now (any thread)."""
        out, park = self.output, self.parking
        return EngineStats(
            scheduler=self._snapshot, kv_used_bytes=self._kv_used_bytes, kv_budget_bytes=self._kv_budget_bytes,
            forwards=dict(self._forwards), forward_seconds=dict(self._forward_seconds),
            gpu_seconds=dict(self._gpu_seconds), degraded_chunks=self._degraded_chunks,
            **({} if out is None else dict(encode_seconds=out.encode_seconds, chunks_encoded=out.chunks,
                                           fast_encodes=out.fast_chunks, chunk_latency_max_s=out.latency_max_s)),
            **({} if park is None else {name: getattr(park, name) for name in PARKING_FIGURES}),
        )

    def table_sizes(self) -> dict[str, int]:
        """Entries of its per-stream tables and its parts' (any thread, a moment's view; see Server.table_sizes)."""
        parts = (self.pool, self.sched, self.parking, self.inputs, self.output, self.styles)
        return {"engine.streams": len(self._streams), "engine.forwards_in_flight": len(self._in_flight),
                **{k: n for part in parts if part is not None for k, n in part.table_sizes().items()}}

    @property
    def failure(self) -> str | None:
        """Why the engine's device group cannot go on (--parallel K: a rank died or hung); None: it can."""
        return getattr(self.gen, "failure", None)

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
        self._commands.close()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self.output is not None:
            self.output.stop()

    # -- commands (any thread; answered by the engine thread between launches) ---------------

    def open_stream(self, stream_id: str, prompt: str, seed: int, fps: int, input=None,
                    strength: float | None = None, lora: str | None = None, lora_scale: float = 1.0,
                    image=None) -> Future:
        """Future[Opened]: admitted streams start generating at once, described for their viewers; with `input` (an
        InputFrames) they restyle it at `strength` (refused, with the reason, by a model without an encoder), with
        `lora` under that style at `lora_scale` (refused, with the reason, when it cannot be: engine/styles.py), from
        `image` ([H, W, 3] uint8 at the model's frame size: chunk 0 is its frame, engine/images.py) if given."""
        return self._commands.submit(self._open, stream_id, prompt, seed, fps, input, strength, lora, lora_scale, image)

    def set_lora(self, stream_id: str, lora: str | None, scale: float, prompt: str) -> Future:
        """Future[int]: the stream's style from its next chunk on: a switch to its newest `prompt` (styles.switch)."""
        return self._commands.submit(lambda: self.styles.switch(
            self._get(stream_id).state.stream_id, lora, scale,
            lambda cost: self.sched.set_prompt(stream_id, self.clock(), prompt, cost)))

    def set_strength(self, stream_id: str, strength: float) -> Future:
        """Future[float]: a stream with input restyles it at `strength` from its next chunk on (snapped)."""
        return self._commands.submit(lambda: self.inputs.set_strength(self._get(stream_id).state.stream_id, strength))

    def set_prompt(self, stream_id: str, prompt: str) -> Future:
        """Future[PromptAccepted]: the new prompt's version and its words the model does not know."""
        return self._commands.submit(self._set_prompt, stream_id, prompt)

    def pause(self, stream_id: str) -> Future:
        """Future[ParkResult]: the stream's chunk in progress is committed, then its state is parked in host
        memory and its device memory goes back to the pool; resolves once parked. Fails (EngineError) for a
        stream not open or already paused, or when the park budget has no room for it."""
        return self._commands.submit(self._pause, stream_id, later=True)

    def resume(self, stream_id: str) -> Future:
        """Future[ParkResult]: the paused stream back on the device, going on where it stopped; resolves once
        its copies back are done. Fails (EngineError, the reason with the numbers; the stream stays paused)
        when admission refuses it now (no KV room, the device's load, ...), or for a stream not paused. A
        stream still finishing its chunk before its park goes on at once (ParkResult of 0 bytes) and its
        pause fails."""
        return self._commands.submit(self._resume, stream_id, later=True)

    def observe_buffer(self, stream_id: str, buffered_frames: float, at_most: bool = False,
                       grace_s: float = 0.0) -> Future:
        """The viewer's buffer (Scheduler.observe_buffer: `at_most` for a report that crossed the network,
        `grace_s` for what the viewer holds beyond it)."""
        return self._commands.submit(self._observe, stream_id, buffered_frames, at_most, grace_s)

    def request_keyframe(self, stream_id: str) -> Future:
        return self._commands.submit(self._keyframe, stream_id)

    def admit_viewer(self, stream_id: str) -> Future:
        """Future[Admission]: one more viewer (a watcher) of the stream's chunks, if the send has room; an
        accepted one carries the stream's modelled buffer (`buffered_s`)."""
        return self._commands.submit(lambda: self.sched.admit_viewer(self._get(stream_id).state.stream_id,
                                                                     self.clock()))

    def viewer_left(self, stream_id: str) -> Future:
        """A viewer of the stream left (the stream goes on)."""
        return self._commands.submit(self.sched.viewer_left, stream_id)

    def observe_send(self, seconds_per_chunk: float) -> Future:
        """What the transports' send cost the event loop per chunk lately (admission's SEND stage)."""
        return self._commands.submit(self.sched.observe_stage, Stage.SEND, seconds_per_chunk)

    def close_stream(self, stream_id: str) -> Future:
        """Future[bool]: frees the stream's KV cache at once; False if it was not open."""
        return self._commands.submit(self._close, stream_id)

    def wake(self) -> None:
        """Make the engine thread's loop turn now (any thread): something it plans by has changed."""
        self._commands.wake()

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
            for cmd in self._commands.drain():
                cmd.future.set_exception(EngineError("engine stopped"))
            for sid in list(self._streams):
                self._close(sid)
            if hasattr(self.gen, "close"):  # a group's generator: its other ranks stop
                self.gen.close()

    def _build(self) -> None:
        cfg = self.config
        device = torch.device(cfg.device)
        if device.type == "cpu":
            torch.set_num_threads(cfg.cpu_threads)
            if not keep_freed_memory():
                log.info("not glibc's malloc: CPU tensors' large blocks go back to the OS when freed (slower chunks)")
        t0 = time.monotonic()
        self.gen = gen = cfg.build_generator(device)
        self.decoder_bytes = gen.decoder_state_bytes()  # counted with each stream's KV cache
        log_attention(device)
        if cfg.compile if cfg.compile is not None else device.type == "cuda":
            from models.dit_ops import compile_helpers

            compile_helpers()
        budget = cfg.kv_budget_bytes
        if budget is None:
            budget = int(torch.cuda.mem_get_info(device)[0] * 0.85) if device.type == "cuda" else 4 * 2**30
        spec = gen.cache_spec()
        if spec.quant != "none":  # the dequantization scratch is shared by all streams of the device
            from kvcache.quant import scratch_bytes

            budget -= scratch_bytes(spec)
        self.pool = CachePool(budget, device)
        self._kv_budget_bytes = budget
        self.styles = StyleLibrary.from_folder(getattr(gen, "adapters", None), cfg.lora_dir, cfg.lora_budget_bytes,
                                               self.pool, parallel=cfg.group is not None)
        self.styles.load_at_start()  # before the CUDA graphs: those of its styles' Linears are captured
        # the scheduler plans the generator's schedule, and its shorter ones instead of stalls unless told not to
        degrade = gen.cfg.shorter_steps if cfg.degrade else ()
        workers = cfg.output_workers or min(4, max(1, (os.cpu_count() or 1) // 4))
        self.sched = Scheduler(replace(cfg.scheduler, denoise_steps=len(gen.sigmas), degrade_steps=degrade,
                                       output_capacity=float(workers)))
        log.info("%s", fidelity.describe(gen.cfg, bool(degrade)))  # which speed options run (models/fidelity.py)
        processes = cfg.output_processes if cfg.output_processes is not None else device.type == "cpu"
        self.output = OutputStage(device, workers, self._handed_over, self._output_failed, self.clock, processes)
        self.parking = Parking(gen, self.sched, self.pool, self.park_budget, extra_bytes=self.decoder_bytes,
                               timeout_s=cfg.park_timeout_s, clock=self.clock, on_pool_change=self._kv_changed,
                               on_expired=self._park_expired)
        log.info("model ready in %.1f s", time.monotonic() - t0)
        if device.type == "cuda":
            log.info("capturing CUDA graphs (compiles kernels on first sight; takes a while the first time)")
            t0 = time.monotonic()
            n = gen.capture_graphs()
            log.info("captured %d CUDA graphs in %.1f s", n, time.monotonic() - t0)
        self.styles.ready(gen)
        if pinned := self.parking.warm_up():
            log.info("pinned one stream's park memory (%.2f GB) at start: the first pause does not pin it on the "
                     "engine thread", pinned / 1e9)
        self._cheap_encode = warm_up(gen, self.sched, cfg.warmup_chunks, self.clock)
        self.images = StartImages(gen, parallel=cfg.group is not None)
        self.images.warm_up(gen)
        self.inputs = InputStage(gen, self.sched, self.clock, self.wake,
                                 cfg.input_latency_s, parallel=cfg.group is not None)
        seed_input_stage(gen, self.sched, latency_s=cfg.input_latency_s)  # and warns if it cannot be met
        self.shape = ModelShape.of(gen)
        self._snapshot = self.sched.stats(self.clock())

    # -- engine thread: the loop ------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stopping:
            self.heartbeat_at = self.clock()
            for cmd in self._commands.drain():
                Commands.apply(cmd)
            self._retire(wait=False)
            now = self.clock()
            self.parking.tend(now)
            self._end_overloaded(now)
            missing_at = self.inputs.poll(now)  # input video: chunks released by their input (or its absence)
            plan = self.sched.next(now)
            if plan is not None:
                if len(self._in_flight) >= 2:  # the device has a forward running and one queued
                    self._retire(wait=True)
                self._launch(plan)
                continue
            self._snapshot = self.sched.stats(now)
            if self._in_flight:  # nothing to launch: wait for the device instead of the clock
                self._retire(wait=True)
                continue
            wake = self.sched.wake_at(now)
            wake = wake if missing_at is None else min(wake or missing_at, missing_at)
            timeout = 0.5 if wake is None else min(0.5, max(0.0, wake - now))
            if self.parking.pending():
                timeout = min(timeout, 0.002)  # copies to poll, or a stream to park once its chunk is committed
            cmd = self._commands.next(timeout)
            if cmd is not None:
                Commands.apply(cmd)

    def _launch(self, plan: Plan) -> None:
        """Launch `plan`'s forward (and for a COMMIT, its decode and the copy of its frames to the
        host) and count it done in the scheduler; its cost is read from its events later."""
        streams = [self._streams[sid] for sid in plan.stream_ids]
        try:
            for st, seq, prompt in zip(streams, plan.prompt_seqs, plan.prompts):
                if seq > st.state.prompt_version:  # the plan brings a new prompt: its text encoded now, off the
                    self.gen.encode_prompt(prompt)  # forward's timed cost (of a flood, one a chunk), and applied
                    self.gen.set_prompt(st.state, prompt, version=seq)
                    self.styles.apply(self.gen, st.state, seq)  # a style switch planned up to it goes with it
            now = self.clock()
            timer = Timer(self.gen.device, self.clock, self._streamless)
            chunks = self._run(plan, streams, now)
        except Exception as e:  # noqa: BLE001 - one plan's failure ends its streams, not the engine
            log.exception("forward %s for %s failed", plan.kind.value, plan.stream_ids)
            self.sched.cancel(plan)
            failure = self.failure  # a group's rank died or hung: every stream of the group ends
            for sid in list(self._streams) if failure else plan.stream_ids:
                self._close(sid)
                if failure:
                    self._on_error(sid, f"generation failed: {failure}", "worker_lost")
                else:
                    self._on_error(sid, f"generation failed: {type(e).__name__}: {e}", "internal")
            return
        self._in_flight.append(timer.launched(plan.kind, len(streams), now))
        self.sched.complete(plan, now, None, deliver=False)
        for st, chunk in chunks:  # a chunk that cuts (the scheduler's call) starts with a keyframe its viewers start at
            cut = self.sched.cuts(st.state.stream_id)
            keyframe, st.keyframe = st.keyframe or cut, False
            self._degraded_chunks += chunk.steps < len(self.gen.sigmas)
            extra = (self.inputs.header(st.state.stream_id, chunk) if st.has_input else None) or {}
            extra |= {"cut": True} if cut else {}
            self.output.submit(st.output, chunk.frames, index=chunk.index, first_frame=chunk.first_frame,
                               prompt_version=chunk.prompt_version, steps=chunk.steps, keyframe=keyframe,
                               started_at=st.chunk_started_at, encode_by=self._encode_by(st.state.stream_id),
                               extra=extra or None)
        self._snapshot = self.sched.stats(now)

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
            self._forwards[kind] += 1
            self._gpu_seconds[kind] += f.elapsed_s
            self._forward_seconds[kind] += self.clock() - f.launched_at
            # on CPU, the wall time less what the event loop did meanwhile for clients without a stream (or no sample)
            seconds = without_streamless(f.elapsed_s, f.streamless_s, self.sched.config.streamless_max_share,
                                         f.streamless_events)
            if seconds is not None:
                self.sched.observe_cost(f.kind, f.batch, seconds)

    def _wait_all(self) -> None:
        try:
            while self._in_flight:
                self._retire(wait=True)
        except Exception:  # noqa: BLE001 - shutting down after a device error: nothing more to account
            log.exception("waiting for the device at shutdown failed")
            self._in_flight.clear()

    def _run(self, plan: Plan, streams: list[_Stream], now: float) -> list[tuple[_Stream, object]]:
        gen = self.gen
        for st, restart, steps, index in zip(streams, plan.restart, plan.steps, plan.chunk_index):
            state = st.state
            if restart or (plan.kind is not WorkKind.COMMIT and plan.step <= 0 and state.step != 0):
                gen.abandon_chunk(state)
            if st.has_input and plan.kind is WorkKind.DENOISE and plan.step == 0:  # its input, before its first step
                self.inputs.before_denoise(state.stream_id, state, index)
            if plan.kind is WorkKind.DENOISE and plan.step > 0 and state.step != plan.step + state.start:
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
        """An output worker has encoded a chunk: to the transports, and (as a command) to the scheduler. A first
        chunk of a single frame (chunks of one latent frame: the VAE's first latent frame is one video frame) goes
        out with the second: alone, its viewer would play it and stall until the next came, and the scheduler counts
        it in flight (buffered) until then, so the second chunk starts at once."""
        if out.header.index == 0 and out.header.frames == 1:
            stream.held = out
            return
        now = self.clock()
        for chunk in (stream.held, out) if stream.held is not None else (out,):
            self._on_chunk(chunk)
            self._commands.post(self._delivered, stream, chunk, now)
        stream.held = None

    def _delivered(self, stream: StreamOutput, out: ChunkOut, now: float) -> None:
        self.sched.observe_stage(Stage.OUTPUT, out.encode_s)
        if self._is_open(stream):  # not a closed stream whose id was opened again
            self.sched.delivered(stream.stream_id, now)
            if out.fast:
                self.sched.mark_late(stream.stream_id, now,
                                     f"chunk {out.header.index} encoded cheaper to meet its deadline")

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
        self._commands.post(self._fail, stream, message)

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

    def _open(self, stream_id: str, prompt: str, seed: int, fps: int, input=None, strength=None, lora=None, scale=1.0,
              image=None):
        if stream_id in self._streams:
            raise EngineError(f"stream {stream_id!r} is already open")
        kind = "video" if input is not None else "image" if image is not None else None  # of input (INPUT_KINDS)
        refusal = (f"this server cannot generate: {self.failure}" if self.failure else self.inputs.refusal()
                   if input is not None else None) or (self.images.refusal or (IMAGE_AND_INPUT if input else None)
                   if image is not None else None) or self.styles.take(stream_id, lora, scale, kind)  # (held if None)
        if refusal:
            return Opened(Admission(False, refusal, 0.0))
        gen = self.gen
        spec = gen.cache_spec()
        req = StreamRequest(
            stream_id, prompt=prompt, fps=float(fps),
            first_chunk_frames=1 if image is not None else gen.frames_in_chunk(0),  # an image's one frame
            chunk_frames=gen.frames_in_chunk(1),
            input_start_step=None if input is None else self.inputs.start_step(strength)[0],
            input_latency_s=self.config.input_latency_s, style_cost=self.styles.cost_of(stream_id))
        admission = self.sched.admit(req, self.clock(), kv_refusal=self.pool.refusal(spec, self.decoder_bytes))
        if not admission.accepted:
            self.styles.release(stream_id)
            return Opened(admission)
        try:
            cache = self.pool.allocate_or_raise(stream_id, spec, self.decoder_bytes)
            state = gen.open_stream(stream_id, prompt, seed, cache, lora=lora, lora_scale=scale,
                                    input_kind=kind)
            # on a GPU host, two x264 threads per stream: the encode is part of every chunk's latency
            spec = EncoderSpec(gen.model_cfg.width, gen.model_cfg.height, fps,
                               threads=2 if gen.device.type == "cuda" else 1)
        except Exception:
            self.sched.remove(stream_id)
            self.pool.release(stream_id)
            self.styles.release(stream_id)
            raise
        st = self._streams[stream_id] = _Stream(state, fps, self.output.open(stream_id, spec),
                                                has_input=input is not None)
        snapped = None if input is None else self.inputs.open(stream_id, input, state, strength, fps).strength
        self._kv_used_bytes = self.pool.used_bytes
        if image is not None:  # its chunk 0, committed now (streamsvc/engine/images.py); a failure ends the stream
            self._start_image(st, image)
        return Opened(admission, StreamDescription(
            self.shape, fps, self._unknown_words(prompt), strength=snapped, image=image is not None,
            input_latency_s=None if input is None else self.config.input_latency_s, lora=lora, lora_scale=scale))

    def _start_image(self, st: _Stream, image) -> None:
        try:
            chunk = self.images.start(self.gen, st.state, image)
        except Exception:
            self._close(st.state.stream_id)
            raise
        now = self.clock()
        self.sched.started(st.state.stream_id, now, frames=chunk.frames.shape[0])
        self.output.submit(st.output, chunk.frames, index=0, first_frame=0, prompt_version=chunk.prompt_version,
                           steps=len(self.gen.sigmas), keyframe=True, started_at=now, extra={"input": "image"})
        st.keyframe = False

    def _set_prompt(self, stream_id: str, prompt: str) -> PromptAccepted:
        self._get(stream_id)  # (an EngineError for a stream not open)
        version = self.sched.set_prompt(stream_id, self.clock(), prompt)  # its plans carry the text (encoded then)
        return PromptAccepted(version, self._unknown_words(prompt))

    def _unknown_words(self, prompt: str) -> tuple[str, ...]:
        return tuple(self.gen.text_encoder.unknown_words(prompt))

    def _pause(self, future: Future, stream_id: str) -> None:
        self.parking.pause(future, self._get(stream_id).state)

    def _resume(self, future: Future, stream_id: str) -> None:
        self._get(stream_id)
        self.parking.resume(future, stream_id)

    def _park_expired(self, stream_id: str, parked_s: float) -> None:
        """A paused stream parked longer than park_timeout_s (the parking's tend): ended."""
        self._close(stream_id)
        log.info("stream %s parked for %.0f s: ended (--park-timeout)", stream_id, parked_s)
        self._on_error(stream_id, f"the stream was paused for more than {self.config.park_timeout_s:g} s "
                                  "(--park-timeout) and has ended; open a new stream", "park_expired")

    def _kv_changed(self) -> None:
        """The parking gave a stream's device memory back to the pool or took it again."""
        self._kv_used_bytes = self.pool.used_bytes

    def _observe(self, stream_id: str, buffered_frames: float, at_most: bool, grace_s: float) -> None:
        self._get(stream_id)
        self.sched.observe_buffer(stream_id, buffered_frames, self.clock(), at_most=at_most, grace_s=grace_s)

    def _keyframe(self, stream_id: str) -> None:
        self._get(stream_id).keyframe = True

    def _close(self, stream_id: str) -> bool:
        st = self._streams.pop(stream_id, None)
        self.sched.remove(stream_id)
        self.inputs.close(stream_id)
        self.parking.drop(stream_id)  # a paused stream's host memory goes (with the parked copies)
        self.styles.release(stream_id)
        # a paused one's too: a group's workers forget its parked copy (streamsvc/engine/lockstep.py)
        if st is not None:
            self.gen.close_stream(st.state)
        self.pool.release(stream_id)  # launched forwards that write it run first on the device's one queue
        self._kv_used_bytes = self.pool.used_bytes
        if st is None:
            return False
        self.output.close(st.output)
        return True
