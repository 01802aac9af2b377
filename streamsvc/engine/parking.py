"""Pause and resume (issue 27): the engine's parked streams.

`pause` holds the stream (the scheduler starts no new chunk for it; the chunk in progress is committed, so
nothing is redone and the stream goes on exactly where it was), then parks it between launches: its whole state
(KV cache, text K/V, decoder state, clean latents) is copied to pinned host memory on a side CUDA stream after
the work already queued, and once the copy's event has passed its device memory goes back to the pool and the
future resolves. Parked streams share `park_budget_bytes` of host memory (a pause beyond it is refused) and end
after `park_timeout_s`. `resume` re-checks admission (KV room, the device's load, ...; refused, the stream stays
parked), allocates a fresh cache from the pool and copies everything back; the device's next work waits for the
copies, so the stream is scheduled again at once.

This module holds that bookkeeping: `Parking`, which the engine owns and calls from its thread only (pause,
resume, tend between launches, drop when a stream closes), and `ParkResult`, what a pause or a resume moved.
The copies are the generator's (ChunkGenerator.park / restore); ending a stream is the engine's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from kvcache import CachePool, ParkBudget
from models import ChunkGenerator, ParkedStream, StreamState
from streamsvc.engine.errors import EngineError
from streamsvc.scheduling import Scheduler

log = logging.getLogger("streamsvc.engine")  # the engine's own log: parking is part of it

__all__ = ["ParkResult", "Parking"]


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

    state: StreamState  # the stream's generator state (its tensors go to the host while parked)
    paused: Future  # resolves to ParkResult once the stream is parked (the copies to the host done)
    reserved: int  # bytes of the park budget it holds
    parked: ParkedStream | None = None  # set when its copies to the host were launched (between chunks)
    parked_at: float | None = None  # engine clock when they were done (the park timeout counts from here)
    resumed: Future | None = None  # resume(): resolves to ParkResult once the copies back are done
    device_bytes: int = 0  # pool bytes given back


class Parking:
    """The engine's paused streams, from `pause` until `resume` has copied them back or the stream is closed.

    Engine thread only. It holds streams in the scheduler (hold / park / unpark), gives their device memory
    back to the pool and takes it again, and charges their host memory to the park budget; it tells the engine
    through `on_pool_change` (the pool's use changed: the engine publishes it) and `on_expired(stream_id,
    parked_s)` (a stream parked longer than `timeout_s`: the engine ends it). Its figures are read by the event
    loop (metrics).
    """

    def __init__(
        self,
        gen: ChunkGenerator,
        sched: Scheduler,
        pool: CachePool,
        budget: ParkBudget,
        *,
        extra_bytes: int,
        timeout_s: float,
        clock: Callable[[], float],
        on_pool_change: Callable[[], None],
        on_expired: Callable[[str, float], None],
    ) -> None:
        self.gen, self.sched, self.pool, self.budget = gen, sched, pool, budget
        self.extra_bytes = extra_bytes  # a stream's device memory besides its KV cache (its decoder state)
        self.timeout_s = timeout_s  # a stream parked longer is ended
        self.clock = clock
        self._on_pool_change, self._on_expired = on_pool_change, on_expired
        self._parks: dict[str, _Park] = {}  # by stream id: being parked, parked, or (until copies are done) coming back
        self.parked_streams = 0  # streams parked now (their copies to the host launched, not resumed)
        self.parked_bytes = 0  # host memory they hold (what the park budget counts)
        self.parks = 0  # pauses done (streams parked)
        self.restores = 0  # resumes done (streams back on the device)
        self.park_seconds = 0.0  # total time of the parks' copies to the host
        self.restore_seconds = 0.0  # total time of the resumes' copies back
        self.last_park_seconds: float | None = None  # the latest park's copy time (None: none yet)
        self.last_restore_seconds: float | None = None  # the latest resume's copy time (None: none yet)

    def table_sizes(self) -> dict[str, int]:
        """Entries of its per-stream tables (see the server's `table_sizes`): streams being parked, parked or coming
        back, and those the park budget charges."""
        return {"parking.streams": len(self._parks), "parking.budget_streams": self.budget.num_streams}

    def warm_up(self, pinned_only: bool = True) -> int:
        """At start, on a GPU: park a throwaway stream and drop it, so that the host's pinned memory for one stream's
        park is allocated now and kept by torch's caching host allocator. Pinning it on the first pause took 1-3 s
        of the engine thread for a wan2.1-1.3b stream (4.2 GB), and the other streams stalled meanwhile (the
        8-minute GPU soak, benchmarks/RESULTS.md). Nothing on a CPU (no pinned memory: `pinned_only`), when the
        park budget cannot hold a stream, or when the pool has no room for one; returns the bytes parked (0: none)."""
        gen = self.gen
        if pinned_only and gen.device.type != "cuda":
            return 0
        spec, stream_id = gen.cache_spec(), "park-warmup"
        if self.pool.refusal(spec, self.extra_bytes) is not None:
            return 0
        cache = self.pool.allocate_or_raise(stream_id, spec, self.extra_bytes)
        try:
            state = gen.open_stream(stream_id, "warm up", seed=0, cache=cache)
            nbytes = gen.park_bytes(state)
            if self.budget.refusal(nbytes) is not None:
                gen.close_stream(state)
                return 0
            parked = gen.park(state)
            parked.cache.moved.wait()
            parked.moved.wait()
            gen.close_stream(state)
            del parked, cache, state  # the pinned blocks go back to torch's cache, the device memory to the pool
        finally:
            self.pool.release(stream_id)
        return nbytes

    def pending(self) -> bool:
        """Whether a held stream waits for its chunk's commit to be parked, or copies are running (to poll)."""
        return any(park.parked_at is None or park.resumed is not None for park in self._parks.values())

    def pause(self, future: Future, state: StreamState) -> None:
        """Hold the stream, and park it once its chunk in progress is committed; `future` resolves to a
        ParkResult once it is parked. Raises EngineError for a stream already paused, or when the park budget
        has no room for it."""
        stream_id = state.stream_id
        park = self._parks.get(stream_id)
        if park is not None:
            raise EngineError(f"stream {stream_id!r} is already {'paused' if park.parked else 'being paused'}")
        need = self.gen.park_bytes(state)
        why = self.budget.reserve(stream_id, need)
        if why is not None:
            raise EngineError(f"cannot pause stream {stream_id!r}: {why}")
        self.sched.hold(stream_id)
        self._parks[stream_id] = _Park(state, future, need)
        self.tend(self.clock())

    def resume(self, future: Future, stream_id: str) -> None:
        """Bring the paused stream back: a fresh cache from the pool, its copies back launched; `future`
        resolves to a ParkResult once they are done. A stream not parked yet goes on at once (and its pause
        fails). Raises EngineError for a stream not paused, or when admission refuses it now (it stays parked)."""
        park = self._parks.get(stream_id)
        if park is None or park.resumed is not None:
            raise EngineError(f"stream {stream_id!r} is not paused")
        if park.parked is None:  # still committing its chunk: it just goes on
            self.sched.hold(stream_id, False)
            self.budget.release(stream_id)
            del self._parks[stream_id]
            park.paused.set_exception(EngineError(f"stream {stream_id!r} was resumed before it was parked"))
            future.set_result(ParkResult(stream_id, 0, 0.0, 0))
            return
        if park.parked_at is None:  # its copies to the host are still running: they finish first
            park.parked.cache.moved.wait()
            park.parked.moved.wait()
            self._parked(stream_id, park, self.clock())
        spec = self.gen.cache_spec()
        now = self.clock()
        admission = self.sched.unpark(stream_id, now, kv_refusal=self.pool.refusal(spec, self.extra_bytes))
        if not admission.accepted:
            raise EngineError(f"cannot resume stream {stream_id!r} now: {admission.reason}")
        try:
            cache = self.pool.allocate_or_raise(stream_id, spec, self.extra_bytes)
            self.gen.restore(park.parked, cache)
        except Exception:
            self.pool.release(stream_id)
            self.sched.hold(stream_id)
            self.sched.park(stream_id, now)  # it stays parked
            raise
        self._on_pool_change()
        self.budget.release(stream_id)
        self.parked_streams -= 1
        self.parked_bytes = self.budget.used_bytes
        park.resumed = future
        self.tend(now)

    def tend(self, now: float) -> None:
        """Between launches: park the held streams that reached a chunk boundary, finish the parks and resumes
        whose copies are done, and end the streams parked longer than park_timeout_s."""
        for stream_id, park in list(self._parks.items()):
            if park.parked is None:
                if self.sched.parkable(stream_id):
                    park.parked = self.gen.park(park.state)  # copies launched after the chunk's commit
                    self.sched.park(stream_id, now)
                    self.parked_streams += 1
            elif park.resumed is not None:
                if park.parked.done():
                    del self._parks[stream_id]
                    self.restores += 1
                    self.restore_seconds += park.parked.seconds
                    self.last_restore_seconds = park.parked.seconds
                    park.resumed.set_result(ParkResult(stream_id, park.parked.nbytes, park.parked.seconds,
                                                       park.device_bytes))
                continue
            if park.parked is not None and park.parked_at is None and park.parked.done():
                self._parked(stream_id, park, now)
            elif park.parked_at is not None and now - park.parked_at >= self.timeout_s:
                self._on_expired(stream_id, now - park.parked_at)

    def drop(self, stream_id: str) -> None:
        """The stream is closing: its host memory goes (with the parked copies), and a pause or resume still
        under way fails."""
        park = self._parks.pop(stream_id, None)
        if park is None:
            return
        if park.parked is not None and park.parked_at is None:  # copies still writing its host memory
            park.parked.cache.moved.wait()
            park.parked.moved.wait()
        if park.parked is not None and park.resumed is None:
            self.parked_streams -= 1
        self.budget.release(stream_id)
        self.parked_bytes = self.budget.used_bytes
        for fut in (park.paused, park.resumed):
            if fut is not None and not fut.done():
                fut.set_exception(EngineError(f"stream {stream_id!r} was closed"))

    def _parked(self, stream_id: str, park: _Park, now: float) -> None:
        """The stream's copies to the host are done: its device memory goes back to the pool (its cache's
        last reference is dropped with the copies' sources), the park budget holds what it really took."""
        park.parked_at = now
        park.device_bytes = self.pool.release(stream_id)
        self._on_pool_change()
        self.budget.release(stream_id)
        # what it holds, which may exceed what pause() reserved: a decoder whose state the chunk committed
        # meanwhile created (a first chunk) or grew. The copies are made: held anyway, the next pause refused
        over = self.budget.reserve(stream_id, park.parked.nbytes, force=True)
        if over is not None:
            log.warning("stream %s parked %d bytes, %d more than pause() reserved: over the park budget (%s)",
                        stream_id, park.parked.nbytes, park.parked.nbytes - park.reserved, over)
        park.reserved = park.parked.nbytes
        self.parked_bytes = self.budget.used_bytes
        self.parks += 1
        self.park_seconds += park.parked.seconds
        self.last_park_seconds = park.parked.seconds
        park.paused.set_result(ParkResult(stream_id, park.parked.nbytes, park.parked.seconds, park.device_bytes))
