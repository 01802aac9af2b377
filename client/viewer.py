"""A viewer, whatever its transport: its config (``ClientConfig``, ``DecodeMode``, ``tls_context``), its states
(``ClientState``), what it saw (``StreamResult``), and ``ViewerClient``, the base class of the WebSocket and the
WebRTC clients (client/ws_client.py, client/webrtc_client.py): the session's timeline, control messages,
waiting, and the result.

A watcher is measured exactly like a steerer (TTFF counts from its own
connect). Both keep the latest ``audience`` message (their role can change:
a handover, a take) and the ``recording`` one; ``steer_secret`` is the
stream's steer secret while this viewer holds the token (``ready``'s, or the
new one the ``audience`` that gave it the token carried); an ``error`` with code
``not_steerer`` (a watcher asked for what only the steerer may do) is counted
and recorded, and the stream goes on. A server message the client does not use
(a valid one, or one of a type newer than this client) is counted in
``ignored_messages`` and never ends the session.

Imports from ``streamsvc``: the protocol only (DESIGN.md's dependency rule:
the client never sees the engine, the encoder or the server).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import ssl
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Self

import numpy as np
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed

from client.camera import FrameSource, GlassToGlass
from client.playback import PlaybackBuffer, PlaybackState, PlaybackStats
from client.verify import PixelLatency, PixelStats
from streamsvc.wire import protocol as P


class DecodeMode(enum.Enum):
    INLINE = "inline"  # decode on the event loop (cheap at small sizes: ~0.3 ms a frame at 128x128)
    THREAD = "thread"  # decode in a worker thread (asyncio.to_thread), for large frames
    NONE = "none"  # count frames from the chunk header without decoding (to measure the decoder's cost)


class ClientState(enum.Enum):
    NEW = "new"  # not connected
    OPENING = "opening"  # connecting, or waiting for ready
    PLAYING = "playing"  # admitted; chunks arrive
    REFUSED = "refused"  # the server refused the stream (see refused_reason)
    CLOSED = "closed"  # the session is over (closed by either side, or the connection failed)


def tls_context(ca_file: str | None, insecure: bool) -> ssl.SSLContext | None:
    """A client's TLS context for a server whose certificate no system CA signed: trusting the CA (or self-signed
    certificate) in `ca_file`, or with `insecure` checking none; None when neither is given (the system's CAs)."""
    if ca_file is None and not insecure:
        return None
    context = ssl.create_default_context(cafile=ca_file)
    if insecure:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


@dataclass(frozen=True)
class ClientConfig:
    prompt: str = ""  # the stream's opening prompt (a steerer's; a watcher gives none)
    seed: int | None = None  # noise seed; None lets the server pick (a steerer's only)
    fps: int | None = None  # requested frame rate; None takes the server's (a steerer's only)
    token: str | None = None  # access token, for a server that requires one (sent in `start` / `watch`)
    # watch this open stream (its id, from its steerer's `ready`) instead of starting one: the first message is
    # `watch`, not `start`; the viewer receives the stream's chunks from a keyframe on and may not steer it
    watch: str | None = None
    secret: str | None = None  # the watched stream's watch secret (its steerer's ready.watch_secret; the watch link's)
    stats_every_s: float = 0.5  # least time between `stats` messages (0: never send any); see _on_chunk
    decode: DecodeMode = DecodeMode.INLINE  # where access units are decoded
    open_timeout_s: float = 10.0  # connect + handshake + `ready`/`refused`, in all
    close_timeout_s: float = 2.0  # how long `close()` waits for the server's `closed`
    max_session_s: float = 3600.0  # hard bound on a session, whatever the caller asks
    # after a retryable error (protocol.RETRYABLE: a cluster's worker was lost), connect again at once and start
    # over, at most this many times a session; the playback buffer goes on (the gap is the viewer's stall)
    max_reconnects: int = 3
    # a wss:// server whose certificate no system CA signed (a self-signed one): trust the CA (or the certificate
    # itself) in this PEM file, or with `insecure` check no certificate at all (on a LAN, in tests)
    ca_file: str | None = None
    insecure: bool = False
    # time each prompt sent to the first played frame showing the prompt's colour (client/verify.py; the built-in
    # model's scenes): needs decoded frames
    verify_pixels: bool = False
    # input video (issue 35): the camera this viewer sends (frame i of its video, any size), H.264 over the socket
    # paced in real time at the stream's fps; the stream restyles it at `strength` (None: the server's default)
    input: FrameSource | None = None
    strength: float | None = None
    # the picture the stream starts from: a data: URL or an upload's id (client/start_image.py `image_ref`)
    image: str | None = None
    # the style the stream starts in (None: none): one the server offers (ready's `loras`, GET /loras), at this scale
    lora: str | None = None
    lora_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.watch is not None and (self.prompt or self.seed is not None or self.fps is not None):
            raise ValueError(f"watch={self.watch!r} joins a stream someone else started: give no prompt, seed or fps "
                             f"(got prompt={self.prompt!r}, seed={self.seed}, fps={self.fps})")
        if self.watch is None and not self.prompt:
            raise ValueError("give a prompt (to start a stream) or watch=STREAM_ID (to watch an open one)")
        if (self.watch is None) is not (self.secret is None):
            raise ValueError(f"watch={self.watch!r}, secret={'...' if self.secret else None}: a watch needs the "
                             "stream's watch secret (its steerer's ready.watch_secret, the watch link's), and only "
                             "a watch takes one")
        self.first_message()  # the protocol's own checks, with its messages
        for name in ("open_timeout_s", "close_timeout_s", "max_session_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be > 0 seconds")
        if self.ca_file is not None and self.insecure:
            raise ValueError(f"ca_file={self.ca_file!r} and insecure: give one (insecure checks no certificate)")
        if self.stats_every_s < 0:
            raise ValueError(f"stats_every_s={self.stats_every_s}: must be >= 0 (0 turns stats off)")
        if self.watch is not None and (self.input is not None or self.image is not None or self.lora is not None):
            raise ValueError("a watcher sends no input, image nor style: they are its stream's steerer's")
        if self.verify_pixels and self.decode is DecodeMode.NONE:
            raise ValueError("verify_pixels reads the frames: it needs decode inline or thread, not none")

    def connect_options(self, url: str) -> dict[str, Any]:
        """websockets' connect() options for `url` beyond the defaults: a wss:// URL's TLS context when ca_file or
        insecure is given (otherwise the system's CAs check the server's certificate)."""
        context = tls_context(self.ca_file, self.insecure)
        return {"ssl": context} if url.startswith("wss://") and context is not None else {}

    def start_message(self, transport: str | None = None) -> P.Start:
        """The ``start`` message that opens this viewer's stream."""
        return P.Start(prompt=self.prompt, seed=self.seed, fps=self.fps, transport=transport, token=self.token,
                       input=self.input is not None, strength=self.strength, image=self.image, lora=self.lora,
                       lora_scale=self.lora_scale)

    def first_message(self, transport: str | None = None) -> P.Start | P.Watch:
        """What the viewer sends first: ``watch`` of ``self.watch``, or the ``start`` of its own stream."""
        if self.watch is not None:
            return P.Watch(stream_id=self.watch, secret=self.secret, transport=transport, token=self.token)
        return self.start_message(transport)


@dataclass(frozen=True)
class StreamResult:
    """What one viewer saw. ``playback`` is None when the stream was never admitted."""

    url: str  # where it connected
    admitted: bool  # a `ready` came back
    refused_reason: str | None  # the server's reason when it refused the stream (error code `refused`)
    stream_id: str | None  # from `ready`
    fps: int | None  # the stream's frame rate, from `ready`
    width: int | None  # frame size announced in `ready`
    height: int | None
    chunk_frames: int | None  # frames in every chunk after the first, from `ready`
    playback: PlaybackStats | None  # the playback buffer's measures at the end of the session
    session_s: float  # connect -> end of the session
    connected_at: float | None  # the client's clock at connect (stall_events count from here)
    chunks: int  # chunks received
    # chunks degraded instead of a stall: fewer denoising steps than `ready` announced, or a cheaper encode
    degraded_chunks: int
    frames_decoded: int  # frames out of the decoder (or counted from headers with DecodeMode.NONE)
    bad_frames: int  # decoded frames whose size differs from `ready`'s
    prompt_versions: tuple[int, ...]  # distinct prompt versions seen in chunk headers, in order of arrival
    acks: tuple[tuple[str, int | None], ...]  # (request, prompt_version) of every ack, in order
    prompts_sent: int  # set_prompt messages sent
    min_headroom_s: float | None  # least video left in the buffer when a chunk arrived (after the first)
    stall_events: tuple[tuple[float, float], ...]  # (seconds from connect to the stall's end, its length), ended stalls
    decode_s: float  # wall time spent decoding, all chunks
    decode_max_s: float  # the slowest chunk's decode
    closed_reason: str | None  # the server's `closed` reason, if one came
    errors: tuple[str, ...]  # "code: message" of each error message, and the client's own failures
    pixels: PixelStats | None = None  # pixel-verified prompt latency (ClientConfig.verify_pixels), else None
    worker_lost: int = 0  # retryable errors (`worker_lost`): the worker running the stream was lost
    reconnects: int = 0  # times the viewer connected again after one and was admitted
    role: str | None = None  # "steer" or "watch": the latest audience message's role, else ready's; None if not admitted
    viewer_id: str | None = None  # this viewer's id on the stream, from `ready`
    watched: str | None = None  # the stream id this viewer asked to watch (ClientConfig.watch); None for a steerer
    audience_max: int = 0  # the most watchers any `audience` message announced
    not_steerer: int = 0  # `not_steerer` errors: requests only the steerer may make (the stream went on)
    recording_url: str | None = None  # where the stream's recording is, from a `recording` message
    ignored_messages: int = 0  # server messages this client does not use (newer types included); none was fatal
    # input video: per played frame with an echoed capture time, played - captured (s, this client's clock)
    glass_to_glass: tuple[float, ...] = ()
    input_missing: int = 0  # chunks whose header said input "missing" (text-to-video: its input had stopped)
    input_sent: int = 0  # input frames sent


class ViewerClient:
    """What every viewer client shares, whatever the transport: the session's timeline, control
    messages, waiting, and the result. Subclasses open and close the connection, send (`_send`) and
    feed frames into `self._buffer` (a PlaybackBuffer); they set the attributes this class reads."""

    def __init__(self, url: str, config: ClientConfig, clock: Callable[[], float]) -> None:
        if not url.startswith(("ws://", "wss://")):
            raise ValueError(f"url {url!r} must start with ws:// or wss:// (e.g. ws://127.0.0.1:8000/ws)")
        self.url = url
        self.config = config
        self.clock = clock
        self.state = ClientState.NEW
        self.ready: P.Ready | None = None
        self.refused_reason: str | None = None
        self.closed_reason: str | None = None
        self.headers: list[P.Chunk] = []  # every chunk header received, in order
        self.acks: list[P.Ack] = []
        self.resumes_refused = 0  # resumes the server answered with an error (the stream stayed paused)
        self._stream_paused = False  # this client asked for a pause, and no resume has been acknowledged since
        self.errors: list[str] = []
        self.server_errors: list[P.Error] = []  # the error messages themselves (code + message)
        self.frames_decoded = 0
        self.bad_frames = 0  # frames whose size differs from ready's
        self.prompts_sent = 0
        self.decode_s = 0.0  # wall time spent decoding (0 where the transport decodes elsewhere)
        self.decode_max_s = 0.0
        self.min_headroom_s: float | None = None  # least video buffered when a chunk or frame arrived, once playing
        self.stall_events: list[tuple[float, float]] = []  # (seconds from connect to the stall's end, its length)
        self._stall_s_seen = 0.0  # stall time of the stalls in stall_events
        self._ws: ClientConnection | None = None
        self._buffer: PlaybackBuffer | None = None
        self._connected_at: float | None = None
        self._ended_at: float | None = None
        self._final: PlaybackStats | None = None
        self._tasks: list[asyncio.Task] = []
        self._changed = asyncio.Event()  # set on every message received and on the end
        self._ended = asyncio.Event()  # the server closed the stream or the connection went away
        self._unacked_prompts = 0
        self.worker_lost = 0  # retryable errors received (protocol.RETRYABLE)
        self.reconnects = 0  # reconnections after one that were admitted
        self._retry = False  # the stream ended with a retryable error: run() connects again
        self.pixels: PixelLatency | None = None  # with verify_pixels: times prompts on the played frames' pixels
        # called with each chunk's header and its decoded frames (the transport's: av.VideoFrame, still YUV) as it
        # arrives, when set and frames are decoded: a soak test samples them (benchmarks/soak.py)
        self.frame_tap: Callable[[P.Chunk, list[Any]], None] | None = None
        self.audience: P.Audience | None = None  # the latest audience message
        self.audience_max = 0  # the most watchers any audience message announced
        # the stream's steer secret while this viewer steers (ready's, then a handover's or a take's audience's)
        self.steer_secret: str | None = None
        self.recording: P.Recording | None = None  # the latest recording message
        self.not_steerer = 0  # not_steerer errors received
        self.ignored_messages = 0  # server messages not used (see the module docstring)
        self._opened = asyncio.Event()  # ready came, or the opening failed (see wait_opened)
        self.g2g = GlassToGlass(clock)  # glass-to-glass of the frames whose chunk echoed capture times
        self.input_sent = 0  # input frames sent (config.input)
        self.input_paused = False  # stop sending input for a while (tests: an input that stops, then resumes)
        self.input_refused: str | None = None  # the server refused this stream's input (why): none is sent after

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    @property
    def chunks(self) -> int:
        """Chunk headers received so far."""
        return len(self.headers)

    @property
    def connected_at(self) -> float | None:
        """The client's clock when the session connected (its timeline's zero); None before."""
        return self._connected_at

    @property
    def role(self) -> str | None:
        """The viewer's role, "steer" or "watch": the latest audience message's, else ready's; None before ready."""
        if self.audience is not None:
            return self.audience.role
        return self.ready.role if self.ready is not None else None

    async def wait_opened(self, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) until ``ready`` came (True) or the opening failed or was refused (False):
        what a watcher of this viewer's stream waits for (it needs the stream id)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._opened.wait(), timeout_s)
        return self.ready is not None

    async def _await_ready(self) -> bool:
        """Read messages until ready (True), or refused / closed (False). Bounded by open()'s timeout."""
        async for raw in self._ws:
            if isinstance(raw, bytes):
                self._fail("a binary message arrived before ready")
                continue
            msg = self._parse(raw)
            if isinstance(msg, P.Ready):
                self.ready = msg
                self.steer_secret = msg.steer_secret  # a steerer's (a watcher's ready carries none)
                self._opened.set()
                return True
            if isinstance(msg, P.Error):
                self._on_error(msg)
                # no stream follows a refusal, nor any other error that answers the start or watch itself (a
                # server may keep the socket open after it: do not wait out the timeout)
                if msg.code in P.START_REFUSALS or msg.request == self.config.first_message().type:
                    self.refused_reason = msg.message
                    self.state = ClientState.REFUSED
                    return False
            elif isinstance(msg, P.Closed):
                self.closed_reason = msg.reason
                self.state = ClientState.CLOSED
                return False
            elif msg is not None:
                self._on_other(msg)
        self._fail("connection closed before ready")
        return False

    async def _drop_socket(self) -> None:
        """Close the WebSocket (bounded); quiet if it is already gone."""
        if self._ws is not None:
            with contextlib.suppress(ConnectionClosed, OSError, TimeoutError):
                async with asyncio.timeout(self.config.close_timeout_s):
                    await self._ws.close()

    def _new_buffer(self, to_rgb: Callable[[Any], np.ndarray] = np.asarray) -> PlaybackBuffer:
        """The stream's playback buffer, connected at connect time; with verify_pixels it reports each frame it
        plays to `self.pixels`, which reads frames with `to_rgb` (the transport's frames in, [H, W, 3] out)."""
        if self.config.verify_pixels:
            self.pixels = PixelLatency(to_rgb, clock=time.perf_counter)
        pixels, g2g = self.pixels, self.g2g

        def played(t: float) -> None:
            g2g.played(t)
            if pixels is not None:
                pixels.played(t)

        buf = PlaybackBuffer(self.ready.fps, on_render=played)
        buf.connect(self._connected_at)
        return buf

    def _finish(self) -> None:
        """Close the playback books at now (once)."""
        if self._ended_at is not None:
            return
        now = self.clock()
        self._ended_at = now
        if self._buffer is not None and self._buffer.state is not PlaybackState.ENDED:
            self._buffer.finish(now)
            self._final = self._buffer.stats()

    async def run(self, duration_s: float, prompts: Sequence[tuple[float, str]] = ()) -> StreamResult:
        """Open, play for ``duration_s`` (from connect), send each ``(at_s, prompt)`` at ``at_s`` after
        connect, close. Ends early if the server closes the stream. Returns the result, whatever happened."""
        duration_s = min(duration_s, self.config.max_session_s)
        try:
            if await self.open():
                start = self._connected_at
                deadline = start + duration_s
                schedule = sorted(prompts)[: max_count(duration_s, 0.01)]
                for _ in range(len(schedule) + self.config.max_reconnects + 2):
                    until = deadline if not schedule else min(deadline, start + schedule[0][0])
                    if not await self._sleep_until(until):
                        if self._retry and self.clock() < deadline and await self._reconnect():
                            continue  # placed again: the prompts go on from where they were
                        break
                    if self.clock() >= deadline or not schedule:
                        break
                    await self.set_prompt(schedule.pop(0)[1])
        finally:
            await self.close()
        return self.result()

    async def _reconnect(self) -> bool:
        """Connect again after a retryable error and start a new stream (the server places it again); the
        playback buffer goes on. False when that fails (the session then ends). Transports that cannot
        reconnect keep this default."""
        self._retry = False
        self._finish()
        return False

    async def _sleep_until(self, t: float) -> bool:
        """Sleep until clock() >= t; False if the stream ended first."""
        delay = t - self.clock()
        if delay > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._ended.wait(), delay)
        return not self._ended.is_set()

    # ------------------------------------------------------------ control

    async def set_prompt(self, prompt: str) -> None:
        """Steer the stream; control latency counts from now to the first frame under this prompt played."""
        msg = P.SetPrompt(prompt=prompt)  # raises on a bad prompt before anything is sent
        self._require_playing("set_prompt")
        now = self.clock()
        self._buffer.prompt_sent_at(now)
        if self.pixels is not None:
            self.pixels.prompt_sent(prompt, now)
        self._unacked_prompts += 1
        self.prompts_sent += 1
        await self._send(P.encode(msg))

    async def pause(self) -> None:
        """Pause playback here and ask the server to stop generating once the buffer is full."""
        self._require_playing("pause")
        self._buffer.pause(self.clock())
        self._stream_paused = True
        await self._send(P.encode(P.Pause()))

    async def resume(self) -> None:
        """Resume playback here and ask the server to generate again. It may refuse (no room now: `unavailable`):
        then playback pauses again (`resumes_refused`), and resume may be asked again."""
        self._require_playing("resume")
        self._buffer.resume(self.clock())
        await self._send(P.encode(P.Resume()))

    def _require_playing(self, action: str) -> None:
        if self.state is not ClientState.PLAYING or self._ended_at is not None:
            raise RuntimeError(f"cannot {action}: client is {self.state.value}")

    async def wait_until(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) until ``predicate()`` holds, re-checking after every message."""
        deadline = self.clock() + timeout_s
        for _ in range(max_count(timeout_s, 0.001)):
            if predicate():
                return True
            remaining = deadline - self.clock()
            if remaining <= 0:
                return False
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(remaining, 0.1))
        return predicate()

    def stats(self) -> PlaybackStats | None:
        """The playback measures now (or at the end of the session)."""
        if self._final is not None:
            return self._final
        if self._buffer is None:
            return None
        return self._buffer.stats(self.clock())

    def result(self) -> StreamResult:
        ready = self.ready
        versions: list[int] = []
        for h in self.headers:
            if not versions or versions[-1] != h.prompt_version:
                versions.append(h.prompt_version)
        end = self._ended_at if self._ended_at is not None else self.clock()
        return StreamResult(
            url=self.url,
            admitted=ready is not None,
            refused_reason=self.refused_reason,
            stream_id=ready.stream_id if ready else None,
            fps=ready.fps if ready else None,
            width=ready.width if ready else None,
            height=ready.height if ready else None,
            chunk_frames=ready.chunk_frames if ready else None,
            playback=self.stats(),
            session_s=0.0 if self._connected_at is None else end - self._connected_at,
            connected_at=self._connected_at,
            chunks=len(self.headers),
            degraded_chunks=sum(1 for h in self.headers if ready is not None and h.steps < ready.steps or h.encode == "fast"),
            frames_decoded=self.frames_decoded,
            bad_frames=self.bad_frames,
            prompt_versions=tuple(versions),
            acks=tuple((a.request, a.prompt_version) for a in self.acks),
            prompts_sent=self.prompts_sent,
            min_headroom_s=self.min_headroom_s,
            stall_events=tuple(self.stall_events),
            decode_s=self.decode_s,
            decode_max_s=self.decode_max_s,
            closed_reason=self.closed_reason,
            errors=tuple(self.errors),
            pixels=self.pixels.stats() if self.pixels is not None else None,
            worker_lost=self.worker_lost,
            reconnects=self.reconnects,
            role=self.role,
            viewer_id=ready.viewer_id if ready else None,
            watched=self.config.watch,
            audience_max=self.audience_max,
            not_steerer=self.not_steerer,
            recording_url=self.recording.url if self.recording is not None else None,
            ignored_messages=self.ignored_messages,
            glass_to_glass=tuple(self.g2g.samples),
            input_missing=sum(1 for h in self.headers if h.input == "missing"),
            input_sent=self.input_sent,
        )

    def _parse(self, raw: str):
        try:
            return P.parse_server(raw)
        except P.ProtocolError as e:
            if e.code is P.ErrorCode.UNKNOWN_TYPE:  # a server newer than this client: not ours to judge
                self.ignored_messages += 1
            else:
                self._fail(f"bad message from the server: {e}")
            return None

    def _on_other(self, msg) -> None:
        """A server message that is neither a chunk, an ack, an error nor closed: keep what a viewer shows
        (its role and audience, the recording); count anything else as ignored."""
        if isinstance(msg, P.Audience):
            self.audience = msg
            self.audience_max = max(self.audience_max, msg.watchers)
            if msg.steer_secret is not None:  # the token came to this viewer, with the stream's new steer secret
                self.steer_secret = msg.steer_secret
            elif msg.role != "steer":  # it went on: the secret this viewer had is revoked
                self.steer_secret = None
            if msg.role == "watch" and self._buffer is not None and self._ended_at is None:
                # the steerer paused or resumed: a watcher's playback waits with the stream, not counted as a stall
                (self._buffer.pause if msg.paused else self._buffer.resume)(self.clock())
        elif isinstance(msg, P.Recording):
            self.recording = msg
        else:
            self.ignored_messages += 1

    def _on_ack(self, msg: P.Ack) -> None:
        self.acks.append(msg)
        if msg.request == "resume":
            self._stream_paused = False
        if msg.request == "set_prompt" and msg.prompt_version is not None and self._unacked_prompts > 0:
            self._unacked_prompts -= 1
            if self._ended_at is None:
                self._buffer.prompt_acked(msg.prompt_version, self.clock())

    def _on_error(self, msg: P.Error) -> None:
        self.server_errors.append(msg)
        self.errors.append(f"{msg.code.value}: {msg.message}")
        if msg.code is P.ErrorCode.NOT_STEERER:
            self.not_steerer += 1  # the stream goes on; a set_prompt refused so is forgotten below
        if msg.code is P.ErrorCode.INPUT_REFUSED:
            self.input_refused = msg.message  # the stream goes on without input: the camera stops sending
        if msg.code in P.RETRYABLE:
            self.worker_lost += 1
            self._retry = self.reconnects < self.config.max_reconnects
        # A set_prompt the server refused or failed on is answered by an error instead of an ack
        # (acks and errors keep the order of the requests); forget it so later acks pair up.
        if msg.request == "set_prompt" and self._unacked_prompts > 0:
            self._unacked_prompts -= 1
            if self._buffer is not None:
                self._buffer.prompt_rejected()
        if msg.request == "pause":
            self._stream_paused = False  # refused: the stream goes on
        # A refused resume of a stream this client paused (no room now: `unavailable`, or over the control rate)
        # leaves it paused on the server: playback pauses again, so the wait for chunks that will not come is not
        # counted as a stall. `resume` may be sent again.
        if msg.request == "resume" and self._stream_paused and self._buffer is not None and self._ended_at is None:
            self._buffer.pause(self.clock())
            self.resumes_refused += 1

    def _fail(self, text: str) -> None:
        self.errors.append(text)


def max_count(seconds: float, period: float) -> int:
    """A loop bound: iterations of ``period`` in ``seconds``, with room to spare."""
    return int(seconds / period) + 10
