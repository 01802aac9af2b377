"""The guard of long streams: a real server (in-process, tiny preset, CPU) under about two minutes of churn on 4
streams, its tables counted (Server.table_sizes) rather than its memory, so that it does not flake.

The churn: a stream that lives the whole run under a flood of prompts (one every 0.25 s, with bursts past the
control rate) and watchers joining and leaving it; streams that end and open again (their viewers reconnecting),
one recording, one pausing and resuming, one taking input video from a synthetic camera; a WebRTC watcher that
comes and goes; clients that vanish
without a close (a steerer before and after a pause, a watcher). While it runs every table stays within what the
open streams and viewers allow; once every stream has ended every per-stream table is empty, and /metrics says so
(with the same series as before the run: no label set grows with streams), and the threads are those of before the
run but for the pools that fill once (a closed stream's swscale threads were kept until a rare full garbage
collection: issue 46; the process's threads are the server's and its clients', one process).
Every loop is bounded by the run's deadline and a count.
"""

import asyncio
import contextlib
import os
import random
import time
import urllib.request

import numpy as np
import pytest
from websockets.asyncio.client import connect

from client.viewer import ClientConfig, ClientState, DecodeMode
from client.webrtc_client import WebRtcClient
from client.ws_client import StreamClient
from streamsvc.door.access import Refusal
from streamsvc.engine.config import EngineConfig
from streamsvc.viewers.server import Server, ServerConfig
from streamsvc.viewers.session import GOP_CHUNKS
from streamsvc.viewers.streams import PROMPT_TEXTS_KEPT
from streamsvc.wire import protocol as P
from tests.threads import HAS_PROC, names, python_names, thread_ids

CHURN_S = 100.0  # the churn's length; with start-up and the end, about two minutes on 2 cores
STREAMS = 4  # streams the test keeps open (the vanishing clients' come on top, briefly)
MAX_STREAMS = 6  # the server's cap: a stream past it is refused, which the churn takes in its stride
SLACK = 2  # streams closing while others open: the engine's tables may hold them a moment longer
MAX_VIEWERS = MAX_STREAMS + 6  # steerers, two watchers, a vanishing one, and connections still closing
T = 15.0  # bound on anything that should take well under a second
PROMPTS = ("a red fox in the snow", "a blue ball on grass", "a green car at night", "a yellow bird in the sky",
           "a white boat on the sea")
PER_STREAM_PROMPTS = 5  # the scheduler's prompt texts a stream: the cache's, the chunk's, the one before, the newest, the waiting

# the thread pools that start threads as they are needed, up to a bound, and keep them: the input decoders'
# (streamsvc/inputs/ws.py) and the event loop's default executor's (asyncio.to_thread)
POOLS = {"input-decode": 2, "asyncio": min(32, (os.cpu_count() or 1) + 4)}

pytestmark = pytest.mark.slow


def camera(w: int = 96, h: int = 64):
    """A moving bar on grey (input video of another size than the model's)."""
    def frame(i: int) -> np.ndarray:
        img = np.full((h, w, 3), 90, np.uint8)
        x = (3 * i) % (w - 12)
        img[:, x : x + 12] = (40, 200, 60)
        return img
    return frame


class Churn:
    """The run's clients and its record of the server's tables."""

    def __init__(self, server: Server, seed: int = 46) -> None:
        self.server = server
        self.url = f"ws://127.0.0.1:{server.port}/ws"
        self.rng = random.Random(seed)
        self.deadline = time.monotonic() + CHURN_S
        self.clients: set[StreamClient] = set()
        self.long: StreamClient | None = None  # the stream that lives the whole run (watchers join it)
        self.opened = 0  # streams admitted
        self.vanished = 0  # clients that went away without a close
        self.samples = 0
        self.peaks: dict[str, int] = {}
        self.over: list[str] = []  # bounds a sample broke

    def running(self) -> bool:
        return time.monotonic() < self.deadline

    async def open(self, webrtc: bool = False, **config) -> StreamClient | WebRtcClient | None:
        """A viewer (over WebRTC with `webrtc`), admitted (None when refused or failed: the churn goes on)."""
        c = (WebRtcClient if webrtc else StreamClient)(self.url, ClientConfig(decode=DecodeMode.NONE, **config))
        self.clients.add(c)
        if await asyncio.wait_for(c.open(), T):
            self.opened += config.get("watch") is None
            return c
        await self.close(c)
        return None

    async def close(self, c: StreamClient) -> None:
        self.clients.discard(c)
        await asyncio.wait_for(c.close(), T)

    async def steer(self, c: StreamClient, burst: int = 1) -> None:
        """`burst` prompts at once (past the control rate's burst, some are refused: rate_limited)."""
        for _ in range(burst):
            if c.state is not ClientState.PLAYING:
                return
            with contextlib.suppress(RuntimeError):  # it ended meanwhile
                await c.set_prompt(self.rng.choice(PROMPTS))

    async def pause_resume(self, c: StreamClient) -> None:
        with contextlib.suppress(RuntimeError):
            await c.pause()
            await asyncio.sleep(self.rng.uniform(1.0, 3.0))
            await c.resume()

    async def vanish(self, first: P.Start | P.Watch, chunks: int, pause: bool = False) -> None:
        """A client that sends `first`, takes `chunks` chunks (then, with `pause`, pauses its stream) and goes away:
        its TCP connection aborted, no close frame."""
        ws = await asyncio.wait_for(connect(self.url, compression=None, max_size=P.MAX_CHUNK_BYTES), T)
        try:
            await ws.send(P.encode(first))
            async with asyncio.timeout(T):
                got = 0
                async for msg in ws:
                    if isinstance(msg, str) and isinstance(P.parse_server(msg), (P.Error, P.Closed)):
                        break  # refused (the cap, a watch of a stream that ended): gone all the same
                    got += isinstance(msg, bytes)
                    if got == chunks:
                        if not pause:
                            break
                        await ws.send(P.encode(P.Pause()))
                        pause = False
        except TimeoutError:
            pass
        finally:
            ws.transport.abort()
            self.vanished += 1

    def sample(self) -> None:
        """The server's tables now, against what its open streams and viewers allow."""
        sizes = self.server.table_sizes()
        self.samples += 1
        for name, n in sizes.items():
            self.peaks[name] = max(self.peaks.get(name, 0), n)
        streams = MAX_STREAMS + SLACK
        scheduled = sizes["scheduler.streams"] + sizes["scheduler.parked"]
        bounds = {
            **dict.fromkeys(("viewers.sessions", "engine.streams", "kv.caches", "scheduler.streams", "output.streams",
                             "output.encoders", "parking.streams", "parking.budget_streams", "inputs.streams",
                             "recordings.active", "viewers.tasks", "styles.streams"), streams),
            "scheduler.parked": streams - sizes["scheduler.streams"] if scheduled <= streams else -1,
            **dict.fromkeys(("viewers.viewers", "door.websockets", "door.connections"), MAX_VIEWERS),
            "viewers.webrtc": 1 + SLACK, "viewers.track_queues": sizes["viewers.webrtc"], "viewers.revocable": 0,
            "viewers.prompt_texts": PROMPT_TEXTS_KEPT * sizes["viewers.sessions"],
            "viewers.gop_chunks": GOP_CHUNKS * sizes["viewers.sessions"],
            "scheduler.prompt_texts": PER_STREAM_PROMPTS * scheduled,
            "scheduler.chunks_in_flight": 4 * scheduled,
            "scheduler.releases": 2 * sizes["inputs.streams"] + 2,
            "inputs.chunks": 4 * sizes["inputs.streams"] + 4,
            "engine.forwards_in_flight": 2,
            # one client address (loopback): one entry in each of its tables
            **dict.fromkeys(("door.streams_by_address", "door.websockets_by_address", "door.sockets_by_address"), 1),
            "door.streams_by_token": 0, "door.rate_buckets": 3, "door.log_keys": len(Refusal),
            "door.handshakes": MAX_VIEWERS, "door.downloads_by_address": 0, "door.http_sessions": 0,
            "door.whip_publishers": 0, "recordings.known": self.opened, "images.uploads": 0,  # (nothing uploads)
        }
        assert set(bounds) == set(sizes), f"tables without a bound here: {set(sizes) - set(bounds)}"
        self.over += [f"{name}={sizes[name]} > {bound} ({sizes})" for name, bound in bounds.items()
                      if sizes[name] > bound]


def threads_left(before: set[int]) -> list[str]:
    """The threads started since `before` that still run, but for those of POOLS within their bounds."""
    started = thread_ids() - before
    pooled: dict[str, list[int]] = {}
    for tid, name in python_names(started).items():
        pooled.setdefault(name.rsplit("_", 1)[0], []).append(tid)
    for pool, bound in POOLS.items():
        if len(pooled.get(pool, ())) <= bound:
            started -= set(pooled.get(pool, ()))
    return names(started)


async def sampler(churn: Churn) -> None:
    for _ in range(int(CHURN_S / 0.25) + 1):
        if not churn.running():
            return
        churn.sample()
        await asyncio.sleep(0.25)


async def long_stream(churn: Churn) -> None:
    """The stream of the whole run: a prompt every 0.25 s (under the control rate), a burst of 15 every 20 s."""
    c = churn.long
    for i in range(int(CHURN_S / 0.25) + 1):
        if not churn.running() or c.state is not ClientState.PLAYING:
            return
        await churn.steer(c, burst=15 if i % 80 == 40 else 1)
        await asyncio.sleep(0.25)


async def watchers(churn: Churn) -> None:
    """Watchers of the long stream join for a few seconds and leave (a close), two at a time; every fourth round
    one vanishes instead."""
    ready = churn.long.ready
    for i in range(int(CHURN_S)):
        if not churn.running():
            return
        if i % 4 == 3:
            await churn.vanish(P.Watch(stream_id=ready.stream_id, secret=ready.watch_secret), chunks=2)
            continue
        pair = await asyncio.gather(*(churn.open(watch=ready.stream_id, secret=ready.watch_secret) for _ in range(2)))
        await asyncio.sleep(churn.rng.uniform(2.0, 5.0))
        for w in pair:
            if w is not None:
                await churn.close(w)


async def webrtc_watcher(churn: Churn) -> None:
    """A WebRTC watcher of the long stream joins for a few seconds and leaves, every 12 s."""
    ready = churn.long.ready
    for _ in range(int(CHURN_S / 12) + 1):
        if not churn.running():
            return
        w = await churn.open(webrtc=True, watch=ready.stream_id, secret=ready.watch_secret)
        await asyncio.sleep(churn.rng.uniform(3.0, 5.0))
        if w is not None:
            await churn.close(w)
        await asyncio.sleep(7.0)


async def cycling(churn: Churn, slot: int) -> None:
    """Streams that live 8-20 s each and open again: slot 1 records its streams, slot 2 pauses and resumes, slot 3
    takes input video. A prompt every 3 s, with a burst of 12 once a stream."""
    for life in range(int(CHURN_S)):
        if not churn.running():
            return
        extra = {"input": camera(), "strength": 0.7} if slot == 3 else {}
        c = await churn.open(prompt=churn.rng.choice(PROMPTS), seed=slot * 100 + life, **extra)
        if c is None:
            await asyncio.sleep(1.0)
            continue
        if slot == 1:
            await c.send_raw(P.encode(P.Record()))
        ends = time.monotonic() + churn.rng.uniform(8.0, 20.0)
        for beat in range(10):
            if time.monotonic() >= min(ends, churn.deadline) or c.state is not ClientState.PLAYING:
                break
            await churn.steer(c, burst=12 if beat == 1 else 1)
            if slot == 2 and beat % 2 == 0:
                await churn.pause_resume(c)
            await asyncio.sleep(3.0)
        await churn.close(c)


async def vanishing(churn: Churn) -> None:
    """Every 8 s a client starts a stream and goes away without a close: after a chunk, or after pausing it."""
    for i in range(int(CHURN_S / 8) + 1):
        if not churn.running():
            return
        await churn.vanish(P.Start(prompt=churn.rng.choice(PROMPTS), seed=1000 + i), chunks=1 + i % 2,
                           pause=i % 2 == 1)
        await asyncio.sleep(8.0)


async def metrics(server: Server) -> dict[str, float]:
    """/metrics' series by name and labels (`name{labels}`)."""
    text = await asyncio.to_thread(lambda: urllib.request.urlopen(  # noqa: S310 - loopback
        f"http://127.0.0.1:{server.port}/metrics", timeout=T).read().decode())
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


async def test_a_server_under_churn_keeps_its_tables_bounded_and_empties_them_when_its_streams_end(tmp_path):
    server = Server(EngineConfig(preset="tiny", device="cpu"),
                    ServerConfig(port=0, max_streams=MAX_STREAMS, recordings_dir=str(tmp_path)))
    await asyncio.wait_for(server.start(), 60)
    try:
        before = await metrics(server)
        threads = thread_ids() if HAS_PROC else set()
        churn = Churn(server)
        churn.long = await churn.open(prompt=PROMPTS[0], seed=1)
        assert churn.long is not None
        async with asyncio.timeout(CHURN_S + 60):
            await asyncio.gather(sampler(churn), long_stream(churn), watchers(churn), webrtc_watcher(churn),
                                 vanishing(churn), *(cycling(churn, slot) for slot in (1, 2, 3)))
        assert churn.long.state is ClientState.PLAYING, churn.long.errors  # it lived the whole run
        for c in list(churn.clients):
            await churn.close(c)
        # what it went through (a run that churned less would prove less)
        assert churn.opened >= 8 and churn.vanished >= 12 and churn.long.prompts_sent >= 200, vars(churn)
        assert churn.samples >= CHURN_S / 0.5 and churn.peaks["scheduler.parked"] >= 1, churn.peaks
        assert churn.peaks["inputs.streams"] >= 1 and churn.peaks["recordings.active"] >= 1, churn.peaks
        assert churn.peaks["viewers.viewers"] >= 4 and churn.peaks["viewers.prompt_texts"] >= PROMPT_TEXTS_KEPT
        assert churn.peaks["viewers.webrtc"] >= 1, churn.peaks
        assert not churn.over, "\n".join(churn.over[:10])

        def leftovers() -> dict[str, int]:
            return {name: n for name, n in server.table_sizes().items() if n and name not in Server.KEPT_TABLES}

        for _ in range(int(T / 0.1)):  # the vanished ones' streams end as their connections' ends are noticed
            if not leftovers():
                break
            await asyncio.sleep(0.1)
        assert not leftovers(), f"left after every stream ended: {leftovers()} (peaks {churn.peaks})"
        sizes = server.table_sizes()
        assert sizes["door.rate_buckets"] <= 3 and sizes["door.log_keys"] <= len(Refusal)
        assert sizes["recordings.known"] >= 1  # the recordings made, in the directory

        after = await metrics(server)
        assert set(after) == set(before)  # no label set grew with the streams (none is by stream, viewer or address)
        tables = {key.split('{table="')[1][:-2]: n for key, n in after.items()
                  if key.startswith("streamsvc_table_entries{")}
        assert set(tables) == set(sizes)
        assert tables["engine.streams"] == tables["kv.caches"] == tables["output.encoders"] == 0
        assert tables["door.connections"] >= 1  # the scrape's own

        if HAS_PROC:  # the threads its streams and viewers started end with them (WebRTC's decoders as they close)
            for _ in range(int(T / 0.1)):
                if not threads_left(threads):
                    break
                await asyncio.sleep(0.1)
            assert not threads_left(threads), f"threads left after every stream ended: {threads_left(threads)}"
    finally:
        await asyncio.wait_for(server.stop(), 30)
