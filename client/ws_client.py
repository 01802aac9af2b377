"""One viewer over WebSocket: connect, start (or watch), decode, play, steer, report.

``StreamClient`` speaks the wire protocol of ``streamsvc/wire/protocol.py`` to a
server's ``/ws`` endpoint (one connection = one stream): it sends ``start``
(or, with ``ClientConfig.watch`` and ``secret``, ``watch``: the viewer watches
an open stream by its id and watch secret, and steers nothing), waits for
``ready`` (or ``error`` with a code of ``protocol.START_REFUSALS``, or any
error that answers the ``start`` or
``watch`` itself, which ends it with a reason, not an exception),
receives every chunk as one binary message
(``protocol.unpack_chunk``), decodes its access units with
``client.decode.FrameDecoder`` from the first keyframe chunk on and pushes
the frames into a
``client.playback.PlaybackBuffer`` under the chunk's prompt version. The
buffer does all the measuring (DESIGN.md "Measuring a stream"); this module
only feeds it with what arrives and when.

While a stream plays, three tasks run on the event loop:

- the receiver: chunks, acks, errors, ``closed``;
- the playback clock: advances the buffer every frame (1 / fps);
- the reporter: ``stats`` messages so the server's scheduler sees the viewer's
  real buffer. One goes out right after a chunk arrives (at most one per
  ``stats_every_s``), when no other chunk can be in flight; a fallback sends
  one when none went out for ``2 * stats_every_s`` (stalled or paused).

What it shares with the WebRTC client (client/webrtc_client.py) is client/viewer.py's:
its config, its result, the session's timeline, control messages and waiting.

Every loop is bounded: by the connection's life, by ``max_session_s`` and by a
count derived from it. Network failures, refusals and server errors end up in
``StreamResult.errors`` / ``refused_reason``; nothing but programming errors
(and cancellation) escapes ``run()``.

Imports from ``streamsvc``: the protocol only (DESIGN.md's dependency rule:
the client never sees the engine, the encoder or the server).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import av
from av.video.reformatter import VideoReformatter
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI

from client.camera import H264Camera
from client.decode import FrameDecoder
from client.playback import PlaybackState
from client.viewer import ClientConfig, ClientState, DecodeMode, ViewerClient, max_count
from streamsvc.wire import protocol as P
from streamsvc.wire.framing import InputHeader, pack_input

WS_PATH = "/ws"
# a re-placement (after `worker_lost`) that admission refused is tried again after this, doubling each time, at most
# this many times in all and within ClientConfig.open_timeout_s: 0.5 + 1 + 2 + 4 s
REPLACE_BACKOFF_S = 0.5
REPLACE_ATTEMPTS = 5


class StreamClient(ViewerClient):
    """One stream over one WebSocket connection.

    Either ``await client.run(duration_s, prompts)`` for a whole session, or
    drive it step by step (tests)::

        async with StreamClient(url, ClientConfig(prompt="a cat")) as c:   # open(): connect, start, ready
            await c.wait_until(lambda: c.chunks >= 2, 5)
            await c.set_prompt("a dog")
        result = c.result()
    """

    def __init__(self, url: str, config: ClientConfig, *, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(url, config, clock)
        self._last_report = float("-inf")  # when the last stats message went out
        self._decoder: FrameDecoder | None = None
        self._keyframe_seen = False  # a keyframe chunk came on this connection: it and every later chunk play
        self._before_keyframe = 0  # chunks that came before it (not played)

    # ------------------------------------------------------------ lifecycle

    async def open(self) -> bool:
        """Connect, send ``start`` and wait for ``ready``. True when admitted.

        A refusal sets ``refused_reason``; a network failure or a timeout adds to
        ``errors``; both return False and leave the client CLOSED or REFUSED.
        """
        if self.state is not ClientState.NEW:
            raise RuntimeError(f"cannot open: client is {self.state.value}")
        self._connected_at = self.clock()
        try:
            if not await self._connect():
                return False
            rgb = VideoReformatter()  # one swscale context for the frames whose pixels are read, lazily
            self._buffer = self._new_buffer(to_rgb=lambda frame: rgb.reformat(frame, format="rgb24").to_ndarray())
            self._begin()
            return True
        finally:
            self._opened.set()

    async def _connect(self, finish: bool = True) -> bool:
        """Connect, send ``start``, wait for ``ready``: True when admitted (then PLAYING); else the socket
        is dropped and, with ``finish``, the session is over."""
        self.state = ClientState.OPENING
        cfg = self.config
        try:
            async with asyncio.timeout(cfg.open_timeout_s):
                self._ws = await connect(self.url, compression=None, max_size=P.MAX_CHUNK_BYTES,
                                         open_timeout=cfg.open_timeout_s, close_timeout=cfg.close_timeout_s,
                                         **cfg.connect_options(self.url))
                await self._ws.send(P.encode(cfg.first_message()))
                admitted = await self._await_ready()
        except TimeoutError:
            self._fail(f"timeout: no ready or refusal within {cfg.open_timeout_s:g} s")
            admitted = False
        except (OSError, InvalidHandshake, InvalidURI) as e:
            self._fail(f"connect: {type(e).__name__}: {e}")
            admitted = False
        except ConnectionClosed as e:
            self._fail(f"connection closed before ready: {_close_text(e)}")
            admitted = False
        if not admitted:
            await self._drop_socket()
            if finish:
                self._finish()
            return False
        self.state = ClientState.PLAYING
        return True

    def _begin(self) -> None:
        """The admitted stream's tasks: receiver, playback clock, reporter."""
        cfg = self.config
        if cfg.decode is not DecodeMode.NONE:
            self._decoder = FrameDecoder()
        self._keyframe_seen, self._before_keyframe = False, 0
        self._tasks = [
            asyncio.create_task(self._receive(), name=f"recv-{self.ready.stream_id}"),
            asyncio.create_task(self._play_clock(), name=f"clock-{self.ready.stream_id}"),
        ]
        if cfg.stats_every_s > 0:
            self._tasks.append(asyncio.create_task(self._report(), name=f"stats-{self.ready.stream_id}"))
        if cfg.input is not None:
            self._tasks.append(asyncio.create_task(self._send_input(), name=f"input-{self.ready.stream_id}"))

    async def _reconnect(self) -> bool:
        self._retry = False
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=self.config.close_timeout_s)
        self._tasks = []
        await self._drop_socket()
        if self._decoder is not None:
            self._decoder.close()
            self._decoder = None
        for _ in range(self._unacked_prompts):  # the old stream's prompts will never be acked
            self._buffer.prompt_rejected()
        self._unacked_prompts = 0
        self._ended.clear()
        self.closed_reason = None
        # the cluster places the stream again, on a worker whose admission may refuse it for a moment (its closed
        # loop after a late chunk, a tranche still starting): a refusal is tried again, with backoff, within the
        # opening's timeout; any other end of the opening ends the session
        wait_s, give_up = REPLACE_BACKOFF_S, self.clock() + self.config.open_timeout_s
        for _ in range(REPLACE_ATTEMPTS):
            if await self._connect(finish=False):
                self.reconnects += 1
                self.refused_reason = None
                self._begin()
                return True
            refusal = self.server_errors[-1].code if self.state is ClientState.REFUSED and self.server_errors else None
            if refusal is not P.ErrorCode.REFUSED or self.clock() + wait_s > give_up:
                break
            await asyncio.sleep(wait_s)
            wait_s *= 2
        self._finish()
        return False

    async def close(self) -> None:
        """End the session: freeze the measures, send ``close``, wait for ``closed`` (bounded), drop the socket."""
        if self.state in (ClientState.NEW, ClientState.OPENING):
            self.state = ClientState.CLOSED
        self._finish()
        ws = self._ws
        if ws is not None and self.state is ClientState.PLAYING and self.closed_reason is None:
            with contextlib.suppress(ConnectionClosed):
                await ws.send(P.encode(P.Close()))
                await self.wait_until(lambda: self._ended.is_set(), self.config.close_timeout_s)
        if self.state is ClientState.PLAYING:
            self.state = ClientState.CLOSED
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=self.config.close_timeout_s)
        await self._drop_socket()
        if self._decoder is not None:
            self._decoder.close()

    # ------------------------------------------------------------ the whole session

    async def send_raw(self, data: str | bytes) -> None:
        """Send anything (tests: malformed messages)."""
        if self._ws is None:
            raise RuntimeError(f"cannot send: client is {self.state.value}")
        await self._send(data)

    async def _send(self, data: str | bytes) -> None:
        try:
            await self._ws.send(data)
        except ConnectionClosed as e:
            self._lost(e)

    # ------------------------------------------------------------ tasks

    async def _receive(self) -> None:
        """Every message from the server, in order, until the connection ends."""
        try:
            async for raw in self._ws:
                if isinstance(raw, bytes):
                    await self._on_chunk(raw)
                else:
                    self._on_text(raw)
                self._changed.set()
                if self._ended.is_set():
                    return
        except ConnectionClosed as e:
            self._lost(e)
            return
        self._lost(None)

    async def _play_clock(self) -> None:
        """Advance the buffer every frame, so the state is current even with no chunk arriving."""
        period = 1.0 / self.ready.fps
        for _ in range(max_count(self.config.max_session_s, period)):
            await asyncio.sleep(period)
            if self._ended_at is not None:
                return
            self._buffer.advance(self.clock())

    async def _report(self) -> None:
        """The fallback reporter: a `stats` message when none went out for 2 x stats_every_s (the
        stream is stalled or paused, so no chunk arrival triggers one; see _on_chunk)."""
        period = self.config.stats_every_s
        for _ in range(max_count(self.config.max_session_s, period)):
            await asyncio.sleep(period)
            if self._ended_at is not None or self._ended.is_set():
                return
            if self.clock() - self._last_report >= 2 * period:
                await self._send_stats()

    async def _send_input(self) -> None:
        """The camera: frame i captured at start + i / fps (paced in real time), encoded and sent at once, its
        capture time in the header (wall clock, ms). Skipped while `input_paused`; ends once the server refused the
        input (`input_refused`)."""
        camera, fps, index = H264Camera(self.ready.fps), self.ready.fps, 0
        start = self.clock()
        for i in range(max_count(self.config.max_session_s, 1.0 / fps)):
            delay = start + i / fps - self.clock()
            if delay > 0:
                await asyncio.sleep(delay)
            if self._ended_at is not None or self._ended.is_set() or self.input_refused is not None:
                return  # (a refused input: the server reads no more of it)
            if self.input_paused:
                continue
            captured = self.g2g.now_ms()
            out = camera.encode(self.config.input(i))
            if out is None:
                continue
            au, key = out
            header = InputHeader.describe([au], [captured], index=index, pts=i, keyframe=key)
            index += 1
            self.input_sent += 1
            await self._send(pack_input(header, [au]))

    async def _send_stats(self) -> None:
        now = self.clock()
        self._last_report = now
        s = self._buffer.stats(now)
        await self._send(P.encode(P.Stats(
            buffered_s=min(s.buffered_s, P.MAX_STAT), frames_played=min(s.frames_played, int(P.MAX_STAT)),
            stalls=min(s.stalls, int(P.MAX_STAT)), stall_s=min(s.stall_s, P.MAX_STAT), ttff_s=s.ttff_s,
            freezes=min(s.freezes, int(P.MAX_STAT)), freeze_s=min(s.freeze_s, P.MAX_STAT),
            delivered_fps=min(s.delivered_fps, 1000.0),
        )))

    # ------------------------------------------------------------ messages

    async def _on_chunk(self, raw: bytes) -> None:
        try:
            header, units = P.unpack_chunk(raw)
        except P.ProtocolError as e:
            self._fail(f"bad chunk from the server: {e}")
            return
        self.headers.append(header)
        self._keyframe_seen = self._keyframe_seen or header.keyframe
        if not self._keyframe_seen:  # nothing before an IDR decodes; a server sends no such chunk (protocol.py)
            self._before_keyframe += 1
            if self._before_keyframe == 1:
                self._fail(f"chunk {header.index} came before any keyframe chunk: it and any more such are not played")
            return
        t0 = time.perf_counter()
        # the frames, for their pixels (verify_pixels) or the frame tap
        kept: list[av.VideoFrame] | None = [] if self.pixels is not None or self.frame_tap is not None else None
        if self.config.decode is DecodeMode.NONE:
            frames = header.frames
        elif self.config.decode is DecodeMode.THREAD:
            frames = await asyncio.to_thread(self._decode, units, kept)
        else:
            frames = self._decode(units, kept)
        took = time.perf_counter() - t0
        self.decode_s += took
        self.decode_max_s = max(self.decode_max_s, took)
        if frames <= 0 or self._ended_at is not None:
            return
        if self.frame_tap is not None and kept:
            self.frame_tap(header, kept)
        now = self.clock()
        buf = self._buffer
        if self.frames_decoded > 0:  # how close to running dry this chunk came
            left = buf.stats(now).buffered_s
            self.min_headroom_s = left if self.min_headroom_s is None else min(self.min_headroom_s, left)
        stalled = buf.state is PlaybackState.STALLED
        self.frames_decoded += frames
        for f in kept if self.pixels is not None else ():
            self.pixels.arrived(f)  # before the push, which may play the first of them
        self.g2g.arrived(header.capture_ms, frames)
        # input video: the first chunk plays from its last capture + input_latency_s (+ a later chunk's extra frames:
        # then every later chunk is due input_latency_s after its last capture); see push
        play_from = None
        if header.capture_ms and self.ready.input_latency_s is not None:
            extra_s = (self.ready.chunk_frames - header.frames) / self.ready.fps
            play_from = self.g2g.to_clock(header.capture_ms[-1]) + self.ready.input_latency_s + extra_s
        dropped = buf.push(frames, header.prompt_version, now, play_from=play_from, cut=header.cut)
        if dropped:  # a cut to a new prompt: the frames it drops are the oldest of those queued before this chunk's
            self.g2g.dropped(dropped)
            if self.pixels is not None:
                self.pixels.dropped(dropped)
        if stalled:  # this chunk ends a stall
            total = buf.stats().stall_s
            self.stall_events.append((now - self._connected_at, total - self._stall_s_seen))
            self._stall_s_seen = total
        # Report the buffer right after a chunk arrived: the server's buffer cap keeps the next chunk from
        # being delivered for about (cap - chunk) seconds, so no chunk is in flight that the report would
        # miss. (A report taken while a chunk travels tells the server the viewer lacks that chunk: it
        # then makes one more, at a busy moment, and the viewer's buffer overshoots the cap.)
        if self.config.stats_every_s > 0 and now - self._last_report >= self.config.stats_every_s:
            await self._send_stats()

    def _decode(self, units: list[bytes], kept: list[av.VideoFrame] | None = None) -> int:
        """Decode a chunk's access units; returns the frames out (wrong-sized ones are counted as bad), which
        go to `kept` too when given (still YUV: only those whose pixels are read are converted to RGB)."""
        n = 0
        want = (self.ready.height, self.ready.width)
        for au in units:
            try:
                frames = self._decoder.decode(au)
            except av.FFmpegError as e:
                self._fail(f"decode: {type(e).__name__}: {e}")
                continue
            for f in frames:
                n += 1
                if (f.height, f.width) != want:
                    self.bad_frames += 1
                if kept is not None:
                    kept.append(f)
        return n

    def _on_text(self, raw: str) -> None:
        msg = self._parse(raw)
        if msg is None:
            return
        if isinstance(msg, P.Ack):
            self._on_ack(msg)
        elif isinstance(msg, P.Error):
            self._on_error(msg)
        elif isinstance(msg, P.Closed):
            self.closed_reason = msg.reason
            if not self._retry:  # (a retryable end keeps the playback books open for the next stream)
                self._finish()
            self._ended.set()
        elif isinstance(msg, P.Ready):
            self._fail("a second ready arrived")
        else:  # audience, recording; an answer (WebRTC signaling) never comes on a ws-transport stream
            self._on_other(msg)

    def _lost(self, exc: ConnectionClosed | None) -> None:
        """The connection ended. Without a `closed` message first, that is an error."""
        if self._ended.is_set():
            return
        if self._retry:
            self._ended.set()
            self._changed.set()
            return
        if self.closed_reason is None and self._ended_at is None:
            self._fail(f"connection lost: {_close_text(exc)}")
        self._finish()
        self._ended.set()
        self._changed.set()


def _close_text(exc: ConnectionClosed | None) -> str:
    if exc is None:
        return "closed by the server without a closed message"
    rcvd = exc.rcvd
    return f"code {rcvd.code} {rcvd.reason!r}" if rcvd is not None else "no close frame (the connection dropped)"


def stream_url(host: str, port: int) -> str:
    """The WebSocket URL of a server's stream endpoint."""
    return f"ws://{host}:{port}{WS_PATH}"
