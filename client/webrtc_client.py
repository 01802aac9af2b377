"""One viewer over WebRTC (aiortc): signal on the WebSocket, receive RTP video, steer on the data channel.

``WebRtcClient`` is the WebRTC twin of ``client.ws_client.StreamClient``: the
same ``ClientConfig`` in, the same ``StreamResult`` out, the same
``PlaybackBuffer`` measures (DESIGN.md "Measuring a stream"), so
``streamsvc loadtest --transport webrtc`` reports the same figures.

The session:

1. WebSocket to ``/ws``: ``start`` with ``transport: "webrtc"`` (or ``watch``
   with ``ClientConfig.watch`` and ``secret``: a watcher of an open stream), then ``ready``
   (or ``error`` with code ``refused``: the session ends with that reason).
2. A peer connection with a recvonly video transceiver (H.264 only, the
   codec the server sends) and a data channel named ``control``; the offer
   goes on the WebSocket once ICE gathering is complete, and the server's
   ``answer`` comes back there.
3. Frames come out of aiortc's decoder. Each one's RTP timestamp gives its
   stream frame index (``index = first chunk's pts + round(pts * fps / 90000)``:
   aiortc counts pts from the first packet, which the server's track sends as
   the first frame of the first chunk), and the ``chunk`` headers on the data
   channel give each index its prompt version. A frame whose header has not
   arrived yet waits for it (at most ``HEADER_WAIT_S``).
4. ``set_prompt``/``pause``/``resume``/``close`` go on the data channel once it
   is open (on the WebSocket before); acks and errors come back on either.

Playout: a WebRTC receiver plays through a jitter buffer, and so does this
client: playback starts ``playout_delay_s`` after the first frame arrives
(frames arriving meanwhile wait in the buffer), then follows the
``PlaybackBuffer`` rules; after a stall it rebuffers the same way (the frame
that ends the stall and those after it wait ``playout_delay_s``, counted as
stall time), as a jitter buffer refills after an underrun. Without that, one
late frame would leave no margin at all and every later frame a microsecond
late would count as a stall of its own. TTFF is connect -> the first frame
playable, so it includes the playout delay as a browser's includes its jitter
buffer. The server paces
frames at the stream's fps and sees the real buffer (its track's queue), so
this client sends no ``stats``. Of ``ClientConfig``, ``decode`` and
``stats_every_s`` do not apply (aiortc decodes every frame in its own thread,
so ``StreamResult.decode_s`` is 0).

ICE: no STUN/TURN unless given. Host candidates: ``ice_addresses``; by
default loopback only when the server's URL is on loopback (tests and local
load tests stay on 127.0.0.1), else aioice's choice (every interface but
loopback).

Input video (issue 35): with ``ClientConfig.input`` (a frame source), the ``start`` asks for input and the video
transceiver is sendrecv, sending the source as a camera (``client.rtc_camera.FrameTrack``, paced at the stream's
fps): the server times each frame in this process's clock through aiortc's RTCP sender reports and echoes it in the
chunk headers' ``capture_ms``; each frame played out of the playback buffer gets its glass-to-glass latency
(``StreamResult.glass_to_glass``), played - captured, in this client's clock.

Every wait is bounded (``open_timeout_s`` for start + signaling,
``close_timeout_s`` for the end, ``max_session_s`` for the session).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import time
from collections import deque
from collections.abc import Callable, Sequence
from urllib.parse import urlsplit

from aiortc import RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError
from av.video.reformatter import VideoReformatter
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI

from client.playback import PlaybackState
from client.rtc_camera import FrameTrack
from client.viewer import ClientConfig, ClientState, StreamResult, ViewerClient
from streamsvc.wire import protocol as P
from streamsvc.wire.rtc import (
    CONTROL_CHANNEL,
    IceServer,
    complete_local_description,
    h264_preferences,
    rtc_configuration,
)

RTP_CLOCK_HZ = 90_000
"""The RTP clock of video (RFC 6184 for H.264): a frame's timestamp counts 1/90000 s (protocol.py's limits)."""
PLAYOUT_DELAY_S = 0.15
"""Default jitter-buffer delay: playback starts this long after the first frame arrives."""
HEADER_WAIT_S = 1.0
"""A frame waits at most this long for its chunk header; then it takes the newest version known."""
LOOPBACK = "loopback-if-local"
"""``ice_addresses`` default: 127.0.0.1 (or ::1) when the server's URL is on loopback, else aioice's choice."""


def default_ice_addresses(url: str) -> tuple[str, ...] | None:
    """Loopback only for a server on loopback; None (every interface but loopback) otherwise."""
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return ("127.0.0.1",)
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if ip.is_loopback:
        return ("::1",) if ip.version == 6 else ("127.0.0.1",)
    return None


class WebRtcClient(ViewerClient):
    """One stream over WebRTC, signaled on one WebSocket connection.

    ``await client.run(duration_s, prompts)`` for a whole session, or step by step::

        async with WebRtcClient(url, ClientConfig(prompt="a cat")) as c:   # start, ready, offer, answer
            await c.wait_until(lambda: c.frames_decoded >= 20, 10)
            await c.set_prompt("a dog")
        result = c.result()
    """

    def __init__(
        self,
        url: str,
        config: ClientConfig,
        *,
        ice_addresses: Sequence[str] | None | str = LOOPBACK,
        ice_servers: Sequence[IceServer] = (),
        playout_delay_s: float = PLAYOUT_DELAY_S,
        clock: Callable[[], float] = time.monotonic,
        camera_fps: float | None = None,
    ) -> None:
        """`camera_fps`: the rate of ``config.input``'s camera (None: the stream's fps; a browser's camera runs at
        30 whatever the stream's, and the server drops what is beyond the stream's)."""
        super().__init__(url, config, clock)
        self.camera_fps = camera_fps
        if playout_delay_s < 0:
            raise ValueError(f"playout_delay_s={playout_delay_s}: must be >= 0")
        self.ice_addresses = default_ice_addresses(url) if ice_addresses == LOOPBACK else ice_addresses
        self.ice_servers = tuple(ice_servers)
        self.playout_delay_s = playout_delay_s
        self.unmapped_frames = 0  # frames that found no chunk header in time (given the newest version)
        self.channel_messages = 0  # server messages that came on the data channel (the rest came on the WebSocket)
        self.versions_played: list[int] = []  # distinct prompt versions of the frames pushed to the buffer
        self._pc: RTCPeerConnection | None = None
        self._channel = None
        self._track = None
        self._answer: asyncio.Future | None = None
        self._pending: deque[tuple[int, float]] = deque()  # (pts on the 90 kHz clock, arrival) awaiting a header
        self._held: list[tuple[int, float | None]] = []  # (version, capture ms) of frames waiting out the playout
        # delay (start, or after a stall)
        self._camera: FrameTrack | None = None  # config.input as the camera, once negotiating
        self._holding = False  # frames go to _held until the playout delay is over

    # ------------------------------------------------------------ lifecycle

    @property
    def channel_open(self) -> bool:
        return self._channel is not None and self._channel.readyState == "open"

    async def open(self) -> bool:
        """Start the stream and negotiate the peer connection. True when admitted and answered.

        A refusal sets ``refused_reason``; failures and timeouts add to ``errors``; both return False.
        """
        if self.state is not ClientState.NEW:
            raise RuntimeError(f"cannot open: client is {self.state.value}")
        self.state = ClientState.OPENING
        cfg = self.config
        self._connected_at = self.clock()
        ok = False
        try:
            async with asyncio.timeout(cfg.open_timeout_s):
                self._ws = await connect(self.url, compression=None, max_size=P.MAX_CHUNK_BYTES,
                                         open_timeout=cfg.open_timeout_s, close_timeout=cfg.close_timeout_s,
                                         **cfg.connect_options(self.url))
                await self._ws.send(P.encode(cfg.first_message("webrtc")))
                if await self._await_ready():
                    rgb = VideoReformatter()  # one swscale context for every frame, not one per frame
                    self._buffer = self._new_buffer(to_rgb=lambda frame: rgb.reformat(frame, format="rgb24").to_ndarray())
                    self.state = ClientState.PLAYING
                    self._tasks.append(asyncio.create_task(self._receive(), name=f"ws-{self.ready.stream_id}"))
                    ok = await self._negotiate()
        except TimeoutError:
            self._fail(f"timeout: no ready/answer within {cfg.open_timeout_s:g} s")
        except (OSError, InvalidHandshake, InvalidURI) as e:
            self._fail(f"connect: {type(e).__name__}: {e}")
        except ConnectionClosed as e:
            self._fail(f"connection closed before the stream started: {e}")
        finally:
            self._opened.set()
        if not ok:
            if self.state in (ClientState.OPENING, ClientState.PLAYING):
                self.state = ClientState.CLOSED
            await self._teardown()
            self._finish()
            return False
        self._tasks.append(asyncio.create_task(self._receive_frames(), name=f"rtp-{self.ready.stream_id}"))
        self._tasks.append(asyncio.create_task(self._play_clock(), name=f"clock-{self.ready.stream_id}"))
        return True

    async def _negotiate(self) -> bool:
        """Offer (complete candidate list), answer, remote description. Bounded by open()'s timeout."""
        pc = self._pc = RTCPeerConnection(rtc_configuration(self.ice_servers))
        pc.on("connectionstatechange", self._on_connection_state)
        self._channel = pc.createDataChannel(CONTROL_CHANNEL)
        self._channel.on("message", self._on_channel_message)
        if self.config.input is not None:  # the camera goes up the stream's own transceiver: sendrecv, as the player's
            self._camera = FrameTrack(self.config.input, self.camera_fps or self.ready.fps,
                                      paused=lambda: self.input_paused or self.input_refused is not None)
            transceiver = pc.addTransceiver(self._camera, direction="sendrecv")
        else:
            transceiver = pc.addTransceiver("video", direction="recvonly")
        transceiver.setCodecPreferences(h264_preferences())
        self._answer = asyncio.get_running_loop().create_future()
        sdp = await complete_local_description(pc, await pc.createOffer(), self.ice_addresses,
                                               self.config.open_timeout_s)
        await self._ws.send(P.encode(P.Offer(sdp=sdp)))
        answer = await self._answer  # set by the receiver: an answer, or None on an error / the end
        if answer is None:
            return False
        await pc.setRemoteDescription(RTCSessionDescription(sdp=answer.sdp, type="answer"))
        self._track = transceiver.receiver.track  # aiortc makes the remote track with the answer
        if self._track is None:
            self._fail("the server's answer has no video track")
            return False
        return True

    def result(self) -> StreamResult:
        if self._camera is not None:
            self.input_sent = self._camera.frames  # frames the camera handed to aiortc
        return super().result()

    async def close(self) -> None:
        """End the session: freeze the measures, send ``close``, wait for ``closed`` (bounded), tear down."""
        if self.state in (ClientState.NEW, ClientState.OPENING):
            self.state = ClientState.CLOSED
        self._finish()
        if self.state is ClientState.PLAYING and self.closed_reason is None and not self._ended.is_set():
            with contextlib.suppress(ConnectionClosed, OSError):
                await self._send(P.encode(P.Close()))
                await self.wait_until(lambda: self._ended.is_set(), self.config.close_timeout_s)
        if self.state is ClientState.PLAYING:
            self.state = ClientState.CLOSED
        await self._teardown()

    async def _teardown(self) -> None:
        current = asyncio.current_task()
        tasks = [t for t in self._tasks if t is not current]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=self.config.close_timeout_s)
        if self._answer is not None and not self._answer.done():
            self._answer.set_result(None)
        if self._pc is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self.config.close_timeout_s):
                    await self._pc.close()
        await self._drop_socket()

    # ------------------------------------------------------------ control

    async def send_raw(self, data: str, *, on_channel: bool = True) -> None:
        """Send anything (tests), on the data channel or the WebSocket."""
        if on_channel:
            if not self.channel_open:
                raise RuntimeError("the control channel is not open")
            self._channel.send(data)
        else:
            await self._ws.send(data)

    async def _send(self, text: str) -> None:
        """On the data channel once it is open, else on the WebSocket."""
        if self.channel_open:
            with contextlib.suppress(Exception):  # a channel closing under us: fall back to the WebSocket
                self._channel.send(text)
                return
        if self._ws is None:
            raise RuntimeError(f"cannot send: client is {self.state.value}")
        try:
            await self._ws.send(text)
        except ConnectionClosed as e:
            self._lost(f"connection lost: {e}")

    # ------------------------------------------------------------ tasks

    async def _receive(self) -> None:
        """Every WebSocket message after ready (answer, acks, errors, closed) until the connection ends."""
        try:
            async for raw in self._ws:
                self._on_text(raw)
                if self._ended.is_set():
                    return
        except ConnectionClosed as e:
            self._lost(f"connection lost: {e}")
            return
        self._lost("connection lost: closed by the server without a closed message")

    async def _receive_frames(self) -> None:
        """Every decoded frame from the video track, until it ends or the session does."""
        fps = self.ready.fps
        for _ in range(int(self.config.max_session_s * (fps + 1)) + 10):
            if self._ended.is_set():
                return
            try:
                frame = await asyncio.wait_for(self._track.recv(), 1.0)
            except TimeoutError:
                continue
            except MediaStreamError:
                self._lost("the video track ended")
                return
            self._on_frame(frame)
            self._changed.set()

    async def _play_clock(self) -> None:
        """Advance the buffer every frame, so the state is current even with no frame arriving."""
        period = 1.0 / self.ready.fps
        for _ in range(int(self.config.max_session_s / period) + 10):
            await asyncio.sleep(period)
            if self._ended_at is not None:
                return
            self._buffer.advance(self.clock())
            self._map_pending(self.clock())

    # ------------------------------------------------------------ frames

    def _on_frame(self, frame) -> None:
        if self._ended_at is not None:
            return
        self.frames_decoded += 1
        if (frame.height, frame.width) != (self.ready.height, self.ready.width):
            self.bad_frames += 1
        now = self.clock()
        if self.pixels is not None:  # every frame that comes here enters the buffer in this order
            self.pixels.arrived(frame)  # an av.VideoFrame, converted only if its colour is read
        self._pending.append((int(frame.pts), now))
        self._map_pending(now)

    def _frame_index(self, pts: int) -> int:
        """Stream frame index of a frame whose pts (90 kHz, 0 at the first packet) is ``pts``."""
        return self.headers[0].pts + round(pts * self.ready.fps / RTP_CLOCK_HZ)

    def _header_of(self, index: int) -> P.Chunk | None:
        for h in reversed(self.headers):
            if h.pts <= index < h.pts + h.frames:
                return h
            if h.pts + h.frames <= index:
                return None  # its header has not come yet
        return None

    def _version_of(self, index: int) -> int | None:
        h = self._header_of(index)
        return None if h is None else h.prompt_version

    def _capture_ms(self, index: int) -> float | None:
        """The capture time (ms, this client's wall clock) of the input frame stream frame `index` restyles."""
        h = self._header_of(index)
        return h.capture_ms[index - h.pts] if h is not None and h.capture_ms else None

    def _map_pending(self, now: float) -> None:
        """Give frames their versions, in order; a frame waiting past HEADER_WAIT_S takes the newest known."""
        for _ in range(len(self._pending)):
            pts, arrived = self._pending[0]
            index = self._frame_index(pts) if self.headers else None
            version = self._version_of(index) if index is not None else None
            if version is None:
                if now - arrived < HEADER_WAIT_S:
                    return
                self.unmapped_frames += 1
                if self.unmapped_frames == 1:
                    self._fail(f"a frame (pts {pts}) had no chunk header after {HEADER_WAIT_S:g} s")
                version = self.headers[-1].prompt_version if self.headers else 0
            self._pending.popleft()
            self._play(version, now, self._capture_ms(index) if index is not None else None)

    def _play(self, version: int, now: float, capture_ms: float | None = None) -> None:
        """A frame is available: into the playback buffer, or held for the playout delay (start, after a stall)."""
        if self._ended_at is not None:
            return
        if not self.versions_played or self.versions_played[-1] != version:
            self.versions_played.append(version)
        buf = self._buffer
        buf.advance(now)  # a stall that began since the last clock tick is seen here
        if not self._holding and (buf.state is PlaybackState.WAITING or buf.state is PlaybackState.STALLED):
            self._holding = True
            asyncio.get_running_loop().call_later(self.playout_delay_s, self._release_held)
        if self._holding:
            self._held.append((version, capture_ms))
            return
        left = buf.stats(now).buffered_s
        self.min_headroom_s = left if self.min_headroom_s is None else min(self.min_headroom_s, left)
        self.g2g.arrived(None if capture_ms is None else [capture_ms], 1)  # before the push, which may play it
        buf.push(1, version, now)

    def _release_held(self) -> None:
        """The playout delay is over: the held frames go into the buffer at once (ending a stall, if one)."""
        self._holding = False
        if self._ended_at is not None or not self._held:
            return
        now = self.clock()
        buf = self._buffer
        stalled = buf.state is PlaybackState.STALLED
        for _, capture_ms in self._held:  # in the order they are pushed (and played)
            self.g2g.arrived(None if capture_ms is None else [capture_ms], 1)
        runs: list[list[int]] = []
        for v, _ in self._held:
            if runs and runs[-1][0] == v:
                runs[-1][1] += 1
            else:
                runs.append([v, 1])
        self._held.clear()
        for v, n in runs:
            buf.push(n, v, now)
        if stalled:  # these frames end a stall
            total = buf.stats().stall_s
            self.stall_events.append((now - self._connected_at, total - self._stall_s_seen))
            self._stall_s_seen = total
        self._changed.set()

    # ------------------------------------------------------------ messages

    def _on_channel_message(self, raw) -> None:
        if isinstance(raw, bytes):
            self._fail("a binary message arrived on the control channel")
            return
        self.channel_messages += 1
        self._on_text(raw)
        self._changed.set()

    def _on_text(self, raw) -> None:
        msg = self._parse(raw)
        if msg is None:
            return
        if isinstance(msg, P.Chunk):
            self.headers.append(msg)
            self._map_pending(self.clock())
        elif isinstance(msg, P.Answer):
            if self._answer is not None and not self._answer.done():
                self._answer.set_result(msg)
            else:
                self._fail("an answer arrived that was not asked for")
        elif isinstance(msg, P.Ack):
            self._on_ack(msg)
        elif isinstance(msg, P.Error):
            self._on_error(msg)
            if self._answer is not None and not self._answer.done() and msg.code is not P.ErrorCode.INTERNAL:
                self._answer.set_result(None)  # the offer was refused; the message says why
        elif isinstance(msg, P.Closed):
            if self.closed_reason is None:
                self.closed_reason = msg.reason
            self._finish()
            self._ended.set()
            if self._answer is not None and not self._answer.done():
                self._answer.set_result(None)
        elif isinstance(msg, P.Ready):
            self._fail("a second ready arrived")
        else:  # audience, recording
            self._on_other(msg)
        self._changed.set()

    def _parse(self, raw):
        if isinstance(raw, bytes):
            self._fail("a binary message arrived on a WebRTC stream's WebSocket")
            return None
        return super()._parse(raw)

    def _on_connection_state(self) -> None:
        if self._pc is not None and self._pc.connectionState == "failed":
            self._lost("the WebRTC connection failed")

    def _lost(self, text: str) -> None:
        """The session ended without (or before) a closed message."""
        if self._ended.is_set():
            return
        if self.closed_reason is None and self._ended_at is None:
            self._fail(text)
        self._finish()
        self._ended.set()
        self._changed.set()
        if self._answer is not None and not self._answer.done():
            self._answer.set_result(None)
