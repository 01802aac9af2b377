"""The soak test's viewers (benchmarks/soak.py): each slot's plan (benchmarks/soak_churn.py) carried out with the load
test's client (client/ws_client.py `StreamClient`, client/loadtest_prompts.py's prompts), what they saw summed over
every session (`Viewing`), and the frames sampled off a few streams (`FrameSampler`).

Frames: decoding and reading every frame of 16 streams on a 2-core CPU would cost the server the CPU it is being
measured on. Only the first `sample_streams` slots without input video decode (the rest count frames from the chunk
headers, as `--decode none` does: their stalls are measured all the same), and of those only one chunk in
`sample_every` is read: each frame's statistics, and for the built-in model its colour, shape and motion against the
prompt its chunk was made under. A prompt's first `settle` chunks are left out of that score (the switch's chunk, as
tiny_eval leaves it out, and the built-in model's shape takes a few chunks more to follow a switch), so that bursts of
prompts do not read as drift; the score by chunks since the switch (`Samples.by_position`) shows what they cost, and
by the prompts a stream had before (`Samples.by_switches`) whether its 20th prompt is followed as its first was.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field

import numpy as np

from benchmarks.soak_churn import Act, ChurnConfig, Event
from benchmarks.soak_figures import Sample, Triple, caption_triple, frame_change, frame_stats, score_chunk
from client.loadtest_host import stall_spans
from client.loadtest_prompts import viewer_prompt
from client.viewer import ClientConfig, ClientState, DecodeMode
from client.ws_client import StreamClient
from streamsvc.wire import protocol as P

ACK_TIMEOUT_S = 5.0  # a prompt's ack (its version) is waited for this long at most
OPEN_ATTEMPTS = 5  # a refused open is tried again this often (2 s apart) within its session
RESUME_RETRY_S = 5.0  # a refused resume (no room now) is sent again this often, times the churn's scale
RESUME_TRIES = 48  # within its session at most
MAX_ERRORS_KEPT = 20
POSITIONS = 6  # by_position keeps chunks 0..5 after a switch apart, and 6 on together
SWITCHES = 12  # by_switches keeps prompts 0..11 apart, and 12 on together


@dataclass
class Samples:
    """What the sampled frames showed, as (t, value) samples: one per frame (one per pair of frames for `change`);
    the pixel matches 1.0 or 0.0 per frame."""

    brightness: list[Sample] = field(default_factory=list)
    saturation: list[Sample] = field(default_factory=list)
    sharpness: list[Sample] = field(default_factory=list)
    change: list[Sample] = field(default_factory=list)
    colour: list[Sample] = field(default_factory=list)
    shape: list[Sample] = field(default_factory=list)
    motion: list[Sample] = field(default_factory=list)
    all: list[Sample] = field(default_factory=list)
    chunks_read: int = 0
    read_s: float = 0.0  # the client's time spent reading them
    # chunks since their prompt's switch (0: the switch's own; POSITIONS and more together) -> [frames right in all
    # three, frames scored], whether settled or not
    by_position: dict[int, list[int]] = field(default_factory=dict)
    # prompts the stream had before (0: its opening prompt's chunks; SWITCHES and more together) -> [frames right in
    # all three, frames scored], settled chunks only: whether a stream follows its 20th prompt as it followed its first
    by_switches: dict[int, list[int]] = field(default_factory=dict)
    # settled chunks: t, what was asked (the triple; in `scored_with_history` with the prompts the stream had before,
    # SWITCHES and more together), frames right in all three, frames
    scored: list[tuple[float, Triple, int, int]] = field(default_factory=list)
    scored_with_history: list[tuple[float, tuple[Triple, int], int, int]] = field(default_factory=list)
    # settled chunks' frame statistics by their prompt's text, for any model: statistic -> [(t, prompt, sum over
    # the chunk's frames, frames)] (soak_figures.mix_adjusted_drift: each prompt against itself)
    by_prompt: dict[str, list[tuple[float, str, float, int]]] = field(default_factory=dict)

    SERIES = ("brightness", "saturation", "sharpness", "change", "colour", "shape", "motion", "all")


FRAME_STATS = ("brightness", "saturation", "sharpness", "change")


def values(name: str, stats: Sequence, changes: list[float]) -> list[float]:
    """A chunk's values of frame statistic `name`: one a frame, or one a pair of frames for `change`."""
    return changes if name == "change" else [getattr(st, name) for st in stats]


class FrameSampler:
    """A steerer's frame tap (`StreamClient.frame_tap`): reads one chunk in `every` into `samples`; `versions` maps the
    stream's prompt versions to the triple each asks for (None: not a caption, not scored), `prompts` to their text."""

    def __init__(self, samples: Samples, every: int, since: Callable[[], float], score: bool, settle: int = 2,
                 reader: Executor | None = None) -> None:
        self.samples, self.every, self.since, self.score, self.settle = samples, every, since, score, settle
        # where a sampled chunk is read and scored: on the caller's loop (None), or on this worker (with `--decode
        # thread`: converting and scoring 832x480 frames held the soak's loop 0.75 s a sampled chunk, its viewers stalled)
        self.reader = reader
        self.versions: dict[int, Triple | None] = {}
        self.prompts: dict[int, str] = {}
        self.chunks = 0
        self.version: int | None = None  # the prompt version of the chunk before
        self.position = 0  # chunks since the switch to it (0: its first)
        self.switches = -1  # prompts the stream had before this chunk's (the opening prompt's chunks: 0)

    def __call__(self, header: P.Chunk, frames: Sequence) -> None:
        self.position = 0 if header.prompt_version != self.version else self.position + 1
        self.switches += self.position == 0
        self.version = header.prompt_version
        self.chunks += 1
        if (self.chunks - 1) % self.every:
            return
        args = (header.prompt_version, self.position, self.switches, self.since(), list(frames))
        if self.reader is None:
            self._read(*args)
        else:
            self.reader.submit(self._read, *args)

    def _read(self, version: int, position: int, switches: int, t: float, frames: Sequence) -> None:
        """One sampled chunk's frames read, their statistics and (with `score`) their pixels recorded at time t."""
        t0 = time.perf_counter()
        s = self.samples
        rgb = [f.to_ndarray(format="rgb24") for f in frames]
        stats = [frame_stats(f) for f in rgb]
        changes = [frame_change(a, b) for a, b in zip(rgb, rgb[1:])]
        for name in FRAME_STATS:
            getattr(s, name).extend((t, v) for v in values(name, stats, changes))
        prompt = self.prompts.get(version)
        if prompt is not None and position >= self.settle:
            for name in FRAME_STATS:
                vs = values(name, stats, changes)
                if vs:
                    s.by_prompt.setdefault(name, []).append((t, prompt, sum(vs), len(vs)))
        want = self.versions.get(version)
        if self.score and want is not None and len(rgb) >= 2:
            sc = score_chunk(rgb, want)
            tally = s.by_position.setdefault(min(position, POSITIONS), [0, 0])
            tally[0] += sc.all
            tally[1] += sc.frames
            if position >= self.settle:
                for name in ("colour", "shape", "motion", "all"):
                    right = getattr(sc, name)
                    getattr(s, name).extend([(t, 1.0)] * right + [(t, 0.0)] * (sc.frames - right))
                tally = s.by_switches.setdefault(min(switches, SWITCHES), [0, 0])
                tally[0] += sc.all
                tally[1] += sc.frames
                s.scored.append((t, want, sc.all, sc.frames))
                s.scored_with_history.append((t, (want, min(switches, SWITCHES)), sc.all, sc.frames))
        s.chunks_read += 1
        s.read_s += time.perf_counter() - t0


@dataclass
class Viewing:
    """Playback of a kind of viewer (steerers or watchers), summed over every session: the ended ones folded in, the
    open ones read live."""

    open: list[StreamClient] = field(default_factory=list)
    ended: np.ndarray = field(default_factory=lambda: np.zeros(3))  # stalls, stall_s, play_s of the ended sessions
    ended_events: list[tuple[float, float]] = field(default_factory=list)  # the ended sessions' `stall_events`

    def totals(self) -> tuple[int, float, float]:
        """(stalls, stall seconds, playing seconds) so far."""
        out = self.ended.copy()
        for c in self.open:
            st = c.stats()
            if st is not None:
                out += (st.stalls, st.stall_s, st.play_s)
        return int(out[0]), float(out[1]), float(out[2])

    def stall_events(self) -> list[tuple[float, float]]:
        """Every ended stall so far as (its start on the monotonic clock, its length): the load test's loop pauses
        are on that clock too (client/loadtest_host.py `own_stalls`)."""
        return self.ended_events + [e for c in self.open for e in stall_spans(c.connected_at, c.stall_events)]

    def fold(self, c: StreamClient) -> None:
        """A session ended (its stats frozen): keep its figures, drop the client."""
        if c in self.open:
            self.open.remove(c)
            st = c.stats()
            if st is not None:
                self.ended += (st.stalls, st.stall_s, st.play_s)
            self.ended_events += stall_spans(c.connected_at, c.stall_events)


@dataclass
class Tally:
    """What the slots did, over the run."""

    sessions: int = 0  # streams admitted
    refused: int = 0  # opens refused (tried again)
    failed: int = 0  # sessions that never opened
    ended_early: int = 0  # streams the server ended (closed or lost) before their session's end
    prompts: int = 0
    prompt_errors: int = 0  # set_prompt answered by an error, or no ack in time
    pauses: int = 0
    resumes: int = 0  # resume requests sent (a refused one is sent again)
    resumes_refused: int = 0  # of those, refused: the stream stayed paused (no room now), and playback with it
    watchers: int = 0  # watchers admitted
    watchers_refused: int = 0
    input_sessions: int = 0  # sessions that asked for input video
    input_taken: int = 0  # of those, streams that took it (ready.input)
    errors: list[str] = field(default_factory=list)  # the first few client errors

    def error(self, text: str) -> None:
        if len(self.errors) < MAX_ERRORS_KEPT:
            self.errors.append(text)


@dataclass
class Context:
    """What every slot shares."""

    url: str
    churn: ChurnConfig
    started: float  # the run's start (monotonic)
    captions: bool  # prompts are scene captions (the built-in model's, or any model's with --verify-pixels)
    vocabulary: list[str] | None
    slots: int
    sample_streams: set[int]  # the slots whose frames are sampled
    sample_every: int
    score_pixels: bool
    settle: int = 2  # a prompt's first chunks left out of the pixel score (see the module docstring)
    decode: DecodeMode = DecodeMode.INLINE  # how the sampled slots decode (the others decode nothing)
    token: str | None = None
    sources: dict[int, Callable] = field(default_factory=dict)  # slot -> its input video (slots with input)
    samples: Samples = field(default_factory=Samples)
    reader: Executor | None = None  # where sampled chunks are read (None: on the loop; see FrameSampler)
    steerers: Viewing = field(default_factory=Viewing)
    watchers: Viewing = field(default_factory=Viewing)
    tally: Tally = field(default_factory=Tally)
    tasks: set = field(default_factory=set)  # the watchers' tasks

    def since(self) -> float:
        return time.monotonic() - self.started


def playing(c: StreamClient | None) -> bool:
    return c is not None and c.state is ClientState.PLAYING and c.closed_reason is None


async def _sleep_until(ctx: Context, t: float) -> None:
    delay = t - ctx.since()
    if delay > 0:
        await asyncio.sleep(delay)


async def _open(ctx: Context, slot: int, session: int, until: float) -> tuple[StreamClient | None, FrameSampler | None]:
    """The session's stream, opened (a refusal tried again, bounded); (None, None) when none was admitted."""
    index = slot + ctx.slots * session  # each session its own prompts
    prompt = viewer_prompt(index, 0, ctx.captions, ctx.vocabulary)
    source = ctx.sources.get(slot)
    sampled = slot in ctx.sample_streams
    cfg = ClientConfig(prompt=prompt, seed=index, token=ctx.token, open_timeout_s=max(10.0, 0.25 * ctx.slots),
                       decode=ctx.decode if sampled else DecodeMode.NONE, input=source)
    for attempt in range(OPEN_ATTEMPTS):
        c = StreamClient(ctx.url, cfg)
        if await c.open():
            break
        await c.close()
        if c.state is not ClientState.REFUSED:
            ctx.tally.error(f"slot {slot}: {'; '.join(c.errors) or 'no stream'}")
            return None, None
        ctx.tally.refused += 1
        if attempt == OPEN_ATTEMPTS - 1 or ctx.since() + 2.0 > until:
            return None, None
        await asyncio.sleep(2.0)
    ctx.tally.sessions += 1
    ctx.tally.input_sessions += source is not None
    ctx.tally.input_taken += source is not None and c.ready.input
    ctx.steerers.open.append(c)
    sampler = None
    if sampled:
        sampler = FrameSampler(ctx.samples, ctx.sample_every, ctx.since, ctx.score_pixels, ctx.settle, ctx.reader)
        sampler.versions[c.ready.prompt_version] = caption_triple(prompt)
        sampler.prompts[c.ready.prompt_version] = prompt
        c.frame_tap = sampler
    return c, sampler


async def _prompt(ctx: Context, c: StreamClient, sampler: FrameSampler | None, prompt: str) -> None:
    """Send a prompt; with a sampler, wait (bounded) for its ack to learn the version its chunks will carry."""
    acks, errors = len(c.acks), len(c.server_errors)
    await c.set_prompt(prompt)
    ctx.tally.prompts += 1
    if sampler is None:
        return

    def mine() -> list[P.Ack]:  # (the slot sends one request at a time; a pause's ack may still come)
        return [a for a in c.acks[acks:] if a.request == "set_prompt"]

    await c.wait_until(lambda: bool(mine()) or len(c.server_errors) > errors, ACK_TIMEOUT_S)
    if not mine():
        ctx.tally.prompt_errors += 1
        return
    sampler.versions[mine()[0].prompt_version] = caption_triple(prompt)
    sampler.prompts[mine()[0].prompt_version] = prompt


async def _watch(ctx: Context, ready: P.Ready, length_s: float) -> None:
    cfg = ClientConfig(watch=ready.stream_id, secret=ready.watch_secret, token=ctx.token, decode=DecodeMode.NONE,
                       open_timeout_s=10.0)
    w = StreamClient(ctx.url, cfg)
    ctx.watchers.open.append(w)
    try:
        result = await w.run(length_s)
        if result.admitted:
            ctx.tally.watchers += 1
        else:
            ctx.tally.watchers_refused += 1
    finally:
        ctx.watchers.fold(w)


async def _resume(ctx: Context, c: StreamClient, session_end: float) -> None:
    """Resume the paused stream. The server may refuse (`unavailable`: no room now, the stream stays paused and so
    does playback, client/viewer.py); a viewer tries again, so the request goes again every `RESUME_RETRY_S` until it
    is taken or the session is about to end."""
    retry_s = RESUME_RETRY_S * ctx.churn.scale
    for _ in range(RESUME_TRIES):
        refused, answered = c.resumes_refused, len(c.acks)
        await c.resume()
        ctx.tally.resumes += 1
        await c.wait_until(lambda: c.resumes_refused > refused or not playing(c)
                           or any(a.request == "resume" for a in c.acks[answered:]), ACK_TIMEOUT_S)
        if c.resumes_refused == refused or not playing(c):
            return
        ctx.tally.resumes_refused += 1
        if ctx.since() + retry_s >= session_end - ctx.churn.quiet_s * ctx.churn.scale:
            return
        await asyncio.sleep(retry_s)


async def _end(ctx: Context, c: StreamClient | None) -> None:
    if c is not None:
        await c.close()
        for e in c.errors:
            ctx.tally.error(e)
        ctx.steerers.fold(c)


async def run_slot(ctx: Context, slot: int, plan: Sequence[Event]) -> None:
    """Carry out the slot's plan, in time; a stream the server ended is opened again at the slot's next event."""
    c: StreamClient | None = None
    sampler: FrameSampler | None = None
    closes = {e.session: e.t for e in plan if e.act is Act.CLOSE}
    try:
        for e in plan:
            await _sleep_until(ctx, e.t)
            if e.act is Act.CLOSE:
                await _end(ctx, c)
                c = sampler = None
                continue
            if e.act is not Act.OPEN and c is not None and not playing(c):
                ctx.tally.ended_early += 1
                await _end(ctx, c)
                c = sampler = None
            if c is None:
                c, sampler = await _open(ctx, slot, e.session, closes[e.session])
                if c is None:
                    ctx.tally.failed += e.act is Act.OPEN
                    continue
            try:
                await _act(ctx, slot, e, c, sampler, closes[e.session])
            except RuntimeError as err:  # the stream ended under the request: opened again at the next event
                ctx.tally.error(f"slot {slot}: {err}")
    finally:
        with contextlib.suppress(Exception):
            await _end(ctx, c)


async def _act(ctx: Context, slot: int, e: Event, c: StreamClient, sampler: FrameSampler | None,
               session_end: float) -> None:
    """One event of an open stream's (a prompt, a pause or resume, a watcher)."""
    if e.act is Act.PROMPT:
        index = slot + ctx.slots * e.session
        await _prompt(ctx, c, sampler, viewer_prompt(index, e.change, ctx.captions, ctx.vocabulary))
    elif e.act is Act.PAUSE:
        await c.pause()
        ctx.tally.pauses += 1
    elif e.act is Act.RESUME:
        await _resume(ctx, c, session_end)
    elif e.act is Act.WATCH and c.ready.watch_secret is not None:
        task = asyncio.create_task(_watch(ctx, c.ready, e.length_s))
        ctx.tasks.add(task)
        task.add_done_callback(ctx.tasks.discard)
