"""Getting the engine's device ready to serve (its start-up, in the engine thread).

`keep_freed_memory` keeps glibc's malloc from paying page faults on every chunk's CPU tensors, and
`log_attention` says which attention kernel runs. `warm_up` runs a throwaway stream through a full window,
every ring phase and prompt switches, timing each kind of forward at least five times (and batches of max_batch
and half of it when the scheduler batches), and seeds the scheduler's costs with the medians, its output stage's with x264's and its
send's with what sending its chunks costs the sender (`send_cost_s`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import socket
import statistics
import struct
import threading
import time
from collections.abc import Callable

import torch

from models import ChunkGenerator, StreamState
from models.work import WorkKind
from streamsvc.engine.encode import StreamEncoder
from streamsvc.engine.timing import Timer
from streamsvc.scheduling import Scheduler, Stage
from streamsvc.wire.protocol import Chunk, pack_chunk

log = logging.getLogger("streamsvc.engine")  # the engine's own log: its start-up is part of it

__all__ = ["CHEAP_ENCODE_GAIN", "keep_freed_memory", "log_attention", "send_cost_s", "warm_up"]

CHEAP_ENCODE_GAIN = 0.9  # the cheaper encode degrades a late chunk only when the warm-up timed it under this share


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


def warm_up(gen: ChunkGenerator, sched: Scheduler, chunks: int, clock: Callable[[], float]) -> bool:
    """Time what serving runs: a throwaway stream fills its window, turns the ring and switches
    prompts (a recache each time, as the speed options shape it); at least 5 samples of each kind of forward once
    the window is full (`chunks` of them), the median of each goes to the scheduler, and so do x264's per chunk and
    the send's (`send_cost_s` of the chunks encoded). Returns whether the cheaper encode degrades a late chunk (the
    warm-up timed it cheaper, switches included)."""
    state = gen.open_stream("warmup", "warm up", seed=0)
    enc = StreamEncoder(gen.model_cfg.width, gen.model_cfg.height, 16)
    costs: dict[WorkKind, list[float]] = {k: [] for k in WorkKind}
    encodes: dict[bool, list[float]] = {False: [], True: []}  # x264 per chunk: normal, fast (steady, no switch)
    payloads: list[bytes] = []  # the normal encodes' chunks, as the transports would send them
    capacity = gen.cache_spec().capacity_frames
    full_chunks, index = 0, 0
    try:
        while full_chunks < max(5, chunks):
            full = state.cache.num_frames == capacity
            if full:
                gen.set_prompt(state, f"warm up {full_chunks}")
                full_chunks += 1
            frames = _run_chunk(gen, [state], costs if full else None, clock)[0].frames.cpu().numpy()
            for fast in (False, False, True, True) if full else (False,):  # each pair's first one switches
                t0 = time.perf_counter()
                packets = enc.encode(frames, start_index=index, fast=fast)
                encodes[fast].append(time.perf_counter() - t0)
                if not fast:
                    aus = [bytes(p) for p in packets]
                    payloads.append(pack_chunk(Chunk.describe(aus, index=len(payloads), pts=index, prompt_version=0,
                                                              steps=len(gen.sigmas), keyframe=packets[0].is_keyframe), aus))
                index += len(frames)
    finally:
        gen.close_stream(state)
        enc.close()
    medians = _seed_costs(sched, costs, 1)
    pairs = {fast: [a + b for a, b in zip(t[-2 * full_chunks::2], t[-2 * full_chunks + 1::2])]
             for fast, t in encodes.items()}  # two chunks in a mode, the switch into it included
    normal_s, fast_s = (statistics.median(pairs[fast]) / 2 for fast in (False, True))
    sched.seed_stage(Stage.OUTPUT, statistics.median(encodes[False][-2 * full_chunks + 1::2]))
    send_s = send_cost_s(payloads)  # the loop's CPU to hand over, frame and write a chunk: the send's seed
    sched.seed_stage(Stage.SEND, send_s)
    # the cheaper encode is a degradation only where it is cheaper, switches included (at 128x128 x264 is a
    # fifth of a chunk's encode, and a switch costs an IDR and, the first time, an encoder)
    cheap_encode = fast_s < CHEAP_ENCODE_GAIN * normal_s
    log.info("warm-up: forward costs at a full cache, median of %s runs (ms): %s; x264 %.2f ms a chunk, %.2f ms "
             "encoded cheaper (%s); sending a chunk %.3f ms", "/".join(str(len(costs[k])) for k in medians),
             {k.value: round(1e3 * v, 2) for k, v in medians.items()}, 1e3 * normal_s, 1e3 * fast_s,
             "a late chunk's degradation" if cheap_encode else "no gain: late chunks keep the normal encode",
             1e3 * send_s)
    timed = {sched.config.max_batch, sched.config.max_batch // 2} - {0, 1}  # the sizes between cost the line
    for batch in range(2, sched.config.max_batch + 1):
        _warm_up_batched(gen, sched, batch, clock, timed=batch in timed)
    return cheap_encode


def _warm_up_batched(gen: ChunkGenerator, sched: Scheduler, batch: int, clock: Callable[[], float],
                     timed: bool = True) -> None:
    """Run a batch too (`batch` throwaway streams in step). `timed` (a full batch and half of one): at a full cache,
    its costs seeded; without them admission counts a batch as its streams one by one until serving has measured
    one, and a burst of newcomers (all arriving before any batch ran) is refused below what the device carries.
    Otherwise one chunk, so that serving's first batch of that size does not pay a first use (on one H100 under fp8
    linears, warmed at 4 and 2 only, a chunk of serving's first run took 2.9 s and its streams stalled; none after)."""
    states = [gen.open_stream(f"warmup-{i}", "warm up", seed=i) for i in range(batch)]
    costs: dict[WorkKind, list[float]] = {k: [] for k in WorkKind}
    capacity = gen.cache_spec().capacity_frames
    try:
        for _ in range(capacity // gen.cfg.frames_per_chunk + 3 if timed else 1):  # fill the caches, 3 chunks timed
            _run_chunk(gen, states, costs if states[0].cache.num_frames == capacity else None, clock)
    finally:
        for state in states:
            gen.close_stream(state)
    if not timed:
        return
    medians = _seed_costs(sched, costs, batch)
    log.info("warm-up: batches of %d at a full cache (ms): %s", batch, {k.value: round(1e3 * v, 2) for k, v in medians.items()})


def _run_chunk(gen: ChunkGenerator, states: list[StreamState], costs: dict[WorkKind, list[float]] | None,
               clock: Callable[[], float]) -> list:
    """One chunk of `states` (in step, batched), forward by forward, each forward's time into
    costs[kind] when costs is given; returns the chunks."""
    while True:
        work = gen.next_work(states[0])
        timer = Timer(gen.device, clock)
        out = gen.run(work, states)
        if costs is not None:
            costs[work].append(timer.seconds())
        if out[0] is not None:
            return out


def _seed_costs(sched: Scheduler, costs: dict[WorkKind, list[float]], batch: int) -> dict[WorkKind, float]:
    """The median of each kind's times, seeded into the scheduler's costs at `batch`."""
    medians = {kind: statistics.median(times) for kind, times in costs.items() if times}
    for kind, seconds in medians.items():
        sched.seed_cost(kind, batch, seconds)
    return medians


def send_cost_s(payloads: list[bytes], cpu_clock: Callable[[], float] = time.thread_time) -> float:
    """The send's cost per chunk before serving measures it (the SEND stage's seed): the CPU an event loop spends,
    per chunk, to take each of `payloads` handed over from another thread (as the engine's output workers hand
    chunks to the server's loop), queue it for a sender task, frame it as a WebSocket binary message and write it
    to a loopback TCP connection (a socket pair where loopback TCP is not to be had), which a thread of its own
    drains. `cpu_clock` is the loop thread's CPU clock.

    That is a chunk's send as far as it needs no viewer: what serving adds (the WebSocket library's bookkeeping,
    the viewer's, the metrics; WebRTC's packetizing and encryption) comes with the samples serving takes
    (scheduling.SendSampler), which replace this seed once there are enough of them."""
    if not payloads:
        return 1e-6
    try:
        with socket.create_server(("127.0.0.1", 0)) as listener:
            sender = socket.create_connection(listener.getsockname(), timeout=5)
            receiver, _ = listener.accept()
    except OSError:
        sender, receiver = socket.socketpair()
    drain = threading.Thread(target=_drain, args=(receiver,), name="warmup-send-drain", daemon=True)
    drain.start()
    try:
        return max(1e-6, asyncio.run(_loop_send_s(sender, payloads, cpu_clock)))
    finally:
        sender.close()
        drain.join(5)
        receiver.close()


async def _loop_send_s(sock: socket.socket, payloads: list[bytes], cpu_clock: Callable[[], float]) -> float:
    """`send_cost_s` on this thread's event loop: each payload handed over by another thread once the previous one
    is written; the loop thread's CPU over all of them, per payload."""
    loop = asyncio.get_running_loop()
    sock.setblocking(False)
    _, writer = await asyncio.open_connection(sock=sock)
    outbox: asyncio.Queue[bytes | None] = asyncio.Queue()
    sent = threading.Semaphore(0)

    async def send_outbox() -> None:
        while (payload := await outbox.get()) is not None:
            writer.write(_ws_frame(payload))
            await writer.drain()
            sent.release()

    def hand_over() -> None:
        for payload in payloads:
            loop.call_soon_threadsafe(outbox.put_nowait, payload)
            sent.acquire(timeout=5)
        loop.call_soon_threadsafe(outbox.put_nowait, None)

    task = asyncio.create_task(send_outbox())
    t0 = cpu_clock()
    await asyncio.gather(task, asyncio.to_thread(hand_over))
    seconds = cpu_clock() - t0
    writer.close()
    return seconds / len(payloads)


def _ws_frame(payload: bytes) -> bytes:
    """`payload` as one unmasked binary WebSocket frame (RFC 6455 5.2), as a server sends it."""
    n = len(payload)
    if n < 126:
        head = struct.pack("!BB", 0x82, n)
    elif n < 1 << 16:
        head = struct.pack("!BBH", 0x82, 126, n)
    else:
        head = struct.pack("!BBQ", 0x82, 127, n)
    return head + payload


def _drain(sock: socket.socket) -> None:
    """Read `sock` until its peer closes (the loopback's reader)."""
    with contextlib.suppress(OSError):
        while sock.recv(1 << 16):
            pass
