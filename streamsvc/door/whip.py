"""WHIP (RFC 9725) on the server's port: an encoder (OBS's WHIP output, GStreamer's whipclientsink, Debian's
whip-client, a browser) sends a camera as an open stream's input, for video-to-video (issues 35, 36).

``POST /whip/{stream}?secret=STEER_SECRET`` with an SDP offer (``Content-Type: application/sdp``) whose video is
H.264 (packetization-mode 1, constrained baseline or baseline: what aiortc's receiver negotiates) or VP8. The stream
must be open here and take input (its `start` asked ``input``; ``POST /whep?prompt=...&input=1`` does). ``201
Created`` with the answer (the video m-line recvonly, any other m-line rejected: a microphone is dropped) and a
``Location`` (``/whip/session/`` + 128 random bits) that DELETE ends. Every decoded frame goes to the stream's
``InputFrames`` (streamsvc/inputs/frames.py) through ``read_track`` (streamsvc/inputs/rtc.py: capture times from
the sender's RTCP reports), as the player's camera does.

Who may: the steer secret only (a watcher must never feed the input: the watch secret gets 403, anything else 404,
as a /ws watch of no stream), and the server's access token (``Authorization: Bearer``) where it has tokens. The
secret follows the steer token: a handover or a take revokes it (a POST with it then gets 404, as a wrong one) and
ends the session published with it, so the input is only ever the current steerer's. One
publisher per stream at a time (409 while one is on). The limits of a WHEP POST apply (streamsvc/door/whep.py:
--http-rate, --connect-rate, a connection of --max-connections-per-client held until the session ends).

What a publisher's frames may cost (issue 41): a frame that declares a size over the pixel cap (1920x1080 and 1920 a
side: an H.264 SPS, a VP8 key frame) ends its session on that frame, before aiortc's decoder sees it, and frames over
60 a second are dropped undecoded, with their group of pictures (streamsvc/inputs/rtc.py ReceiverGate); so
does a decoder whose CPU time stays over its budget. After the decoder, InputGuard checks the size again (and the
rate, where the jitter buffer could not be hooked) before a frame is scaled. Its ICE agent learns at most
--max-remote-candidates peer-reflexive candidates (streamsvc/transport/ice.py). A session ends on DELETE, when the
stream ends, when its steer secret is revoked, when its peer connection fails or closes (ICE consent lost: about 30 s
after the encoder vanished), or when it never connects (--connect-timeout's WebRtcConfig.connect_timeout_s). Its
input then stops (InputFrames.stop: frames that come later, from another publisher, anchor afresh).

In cluster mode the gateway forwards the POST and the DELETE to the replica that runs the stream (its id names it),
whose server runs this (streamsvc/cluster/replica.py `http`).
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import ipaddress
import logging
import re
import time

from aiortc import RTCPeerConnection, RTCRtpReceiver, RTCSessionDescription

from streamsvc.door.access import Rate, TokenBucket
from streamsvc.door.routes import HttpReply, HttpRequest, text_reply
from streamsvc.door.whep import HttpSession
from streamsvc.inputs.bitstream import MAX_PIXELS, MAX_SIDE, size_refusal
from streamsvc.inputs.rtc import MAX_RTC_FPS, ReadStats, ReceiverGate, SenderClock, prompt_frames, read_track
from streamsvc.transport.aiortc_hooks import answer_as_dtls_server, ice_connections
from streamsvc.transport.ice import PeerReflexiveCap
from streamsvc.transport.sdp import check_offer, reject_media
from streamsvc.wire.rtc import (
    ANY_INTERFACE,
    SignalingError,
    WebRtcConfig,
    complete_local_description,
    rtc_configuration,
)

log = logging.getLogger("streamsvc.whip")

_WATCH_S = 0.5  # how often a publisher checks that its stream is still open
MAX_INPUT_PIXELS = MAX_PIXELS  # a publisher's frame may be at most this large (the model takes 832x480 at most)
MAX_INPUT_FPS = MAX_RTC_FPS  # frames a second a publisher's input takes (a second's burst); the rest are dropped


class InputGuard:
    """What a publisher's frames may cost (a sink for read_track in front of the stream's InputFrames): a frame over
    MAX_INPUT_PIXELS ends the session (`refused` says why; the decoder's cost is the encoder's choice, so the
    session goes rather than the frames), frames over MAX_INPUT_FPS are dropped before their scale and crop. Pure:
    `now` is the caller's clock."""

    def __init__(self, sink, now=time.monotonic, max_pixels: int = MAX_INPUT_PIXELS,
                 max_fps: float = MAX_INPUT_FPS) -> None:
        self.sink = sink
        self.now = now
        self.max_pixels = max_pixels
        self.rate = TokenBucket(Rate(max_fps, max(1, int(max_fps))), now())
        self.refused: str | None = None  # why the session must end (a frame too large), once it must
        self.dropped = 0  # frames over the rate

    def push_av(self, frame, capture_s: float) -> None:
        if self.refused is not None:
            return
        if frame.width * frame.height > self.max_pixels or max(frame.width, frame.height) > MAX_SIDE:
            self.refused = size_refusal(frame.width, frame.height) or (
                f"a frame of {frame.width}x{frame.height}: this publisher may send at most {self.max_pixels} pixels")
            return
        if not self.rate.take(self.now()):
            self.dropped += 1
            return
        self.sink.push_av(frame, capture_s)

    def decode_error(self) -> None:
        self.sink.decode_error()


class Publisher:
    """One WHIP session: its peer connection, the task reading its track into the stream's input."""

    def __init__(self, stream_id: str, pc: RTCPeerConnection, sink) -> None:
        self.stream_id = stream_id
        self.pc = pc
        self.sink = sink  # the stream's InputFrames
        self.stats = ReadStats()
        self.closed = False
        self.tasks: list[asyncio.Task] = []
        self.on_close = lambda: None  # the endpoints forget the session, the connection slot is freed
        self.refused: str | None = None  # why its input was refused (before the decoder: ReceiverGate), if it was

    def refuse(self, reason: str) -> None:
        """Its input was refused (a frame over the cap, a decoder over its budget): the session ends now."""
        if not self.closed:
            self.refused = reason
            log.info("WHIP into stream %s refused: %s", self.stream_id, reason)
            self.tasks.append(asyncio.ensure_future(self.close(reason)))

    async def close(self, reason: str = "closed") -> None:
        if self.closed:
            return
        self.closed = True
        self.on_close()
        s = self.stats
        log.info("WHIP into stream %s ended (%s): %d frames, %d decoder errors", self.stream_id, reason, s.frames,
                 s.decode_errors)
        with contextlib.suppress(Exception):
            self.sink.stop()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(5.0):
                await self.pc.close()
        others = [t for t in self.tasks if t is not asyncio.current_task()]
        for task in others:
            task.cancel()


class Ingest:
    """The WHIP endpoint of one `Server` (whep.Endpoints calls `publish` for a POST it has checked: token, content
    type, rate, a well-formed offer)."""

    def __init__(self, server) -> None:
        self.server = server
        self.publishers: dict[str, Publisher] = {}  # stream id -> its publisher

    @property
    def webrtc(self) -> WebRtcConfig:
        return getattr(self.server, "_webrtc_config", None) or self.server.config.webrtc

    async def publish(self, endpoints, request: HttpRequest, stream_id: str, offer: str) -> HttpReply:
        secret = (request.query.get("secret") or [None])[0]
        session = self.server.sessions.get(stream_id)
        if session is None or session.closed or not session.may_steer(secret):
            if session is not None and session.may_watch(secret):
                return text_reply(http.HTTPStatus.FORBIDDEN, "a watch secret does not feed a stream's input: WHIP "
                                  "needs the stream's steer secret (?secret=STEER_SECRET)")
            return text_reply(http.HTTPStatus.NOT_FOUND,
                              f"no open stream {stream_id[:64]!r} here with this steer secret")
        sink = getattr(session, "input", None)
        if sink is None:
            return text_reply(http.HTTPStatus.CONFLICT, f"stream {stream_id} takes no input: open it with input "
                              "(POST /whep?prompt=...&input=1, or 'start' with \"input\": true)")
        if stream_id in self.publishers:
            return text_reply(http.HTTPStatus.CONFLICT, f"stream {stream_id} has a WHIP publisher already: DELETE its "
                              "session first")
        refusal = self.server.guard.admit_upgrade(request)
        if refusal is not None:
            return refusal
        try:
            pc, sdp, receiver, hooked, clock = await self._answer(offer)
        except SignalingError as e:
            self.server.guard.upgrade_ended(request)
            return text_reply(http.HTTPStatus.BAD_REQUEST, f"bad offer: {e}")
        except BaseException:
            self.server.guard.upgrade_ended(request)
            raise
        publisher = self.publishers[stream_id] = Publisher(stream_id, pc, sink)
        location = endpoints.register(HttpSession("whip", stream_id, False, publisher.close))

        def forget() -> None:
            endpoints.forget(location)
            self.publishers.pop(stream_id, None)
            session.revocable.pop(location, None)
            self.server.guard.upgrade_ended(request)

        publisher.on_close = forget
        # a handover or a take revokes the steer secret it came with: it ends then (streamsvc/viewers/session.py)
        session.revocable[location] = lambda reason: publisher.tasks.append(
            asyncio.ensure_future(publisher.close(reason)))
        gate = ReceiverGate(sink, publisher.refuse)  # before aiortc's decoder: the cap, the rate, the budget
        prompt_frames(receiver, gate)
        active = lambda: not publisher.closed and not session.closed and gate.refused is None  # noqa: E731
        publisher.tasks.append(asyncio.create_task(self._read(publisher, receiver, clock if hooked else None,
                                                              active, gate), name=f"whip-{stream_id}"))
        publisher.tasks.append(asyncio.create_task(self._watch(publisher, session), name=f"whip-watch-{stream_id}"))
        pc.on("connectionstatechange", lambda: pc.connectionState in ("failed", "closed") and asyncio.ensure_future(
            publisher.close(f"the peer connection {pc.connectionState}")))
        log.info("WHIP into stream %s from %s", stream_id, request.remote)
        return endpoints.created(sdp, [("Location", "/whip/session/" + location), ("X-Stream-Id", stream_id)])

    async def _answer(self, offer_sdp: str):
        """(pc, answer SDP, the video receiver, whether the sender clock hooked it, the clock); SignalingError."""
        cfg = self.webrtc
        offer = check_offer(offer_sdp, max_candidates=cfg.max_remote_candidates,
                            allow_loopback=_loopback(cfg.ice_addresses), publish=True)
        pc = RTCPeerConnection(rtc_configuration(cfg.ice_servers))
        try:
            try:
                await pc.setRemoteDescription(RTCSessionDescription(sdp=offer.sdp, type="offer"))
            except Exception as e:  # noqa: BLE001 - aiortc raises several types for a bad offer
                raise SignalingError(f"the offer could not be applied: {type(e).__name__}: {e}") from None
            video = next((t for t in pc.getTransceivers() if t.kind == "video" and t.receiver.track is not None), None)
            if video is None:
                raise SignalingError("the offer has no video this server can receive (H.264 or VP8)")
            video.direction = "recvonly"
            for connection in ice_connections(pc):  # peer-reflexive candidates capped as the offer's are
                PeerReflexiveCap(cfg.max_remote_candidates).install(connection)
            codecs = [c for c in RTCRtpReceiver.getCapabilities("video").codecs
                      if c.mimeType.lower() in ("video/h264", "video/vp8", "video/rtx")]
            video.setCodecPreferences(codecs)
            others = {t.mid for t in pc.getTransceivers() if t is not video and t.mid is not None}
            for other in pc.getTransceivers():
                if other is not video:
                    other.direction = "inactive"
            # the offer's setup:actpass: answered passive (this side the DTLS server), for GStreamer's whip-client and
            # whipclientsink, which share no cipher suite with aiortc as a DTLS client (aiortc_hooks says why)
            answer_as_dtls_server(pc, [video])
            clock = SenderClock()
            hooked = clock.install(video.receiver)
            try:
                sdp = await complete_local_description(pc, await pc.createAnswer(), cfg.ice_addresses,
                                                       cfg.gather_timeout_s)
            except TimeoutError:
                raise SignalingError(f"ICE gathering took longer than {cfg.gather_timeout_s:g} s") from None
            if not re.search(r"^a=rtpmap:\d+ (H264|VP8)/", sdp, re.M | re.I):
                raise SignalingError("no codec in common: this server takes H.264 (packetization-mode 1, baseline) "
                                     "or VP8")
            tag = offer.bundle[0] if offer.bundle else None
            return pc, reject_media(sdp, others - {tag}), video.receiver, hooked, clock
        except BaseException:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(pc.close(), 5.0)
            raise

    async def _read(self, publisher: Publisher, receiver, clock: SenderClock | None, active,
                    gate: ReceiverGate) -> None:
        try:
            guard = InputGuard(gate)
            await read_track(receiver.track, guard, clock, active=lambda: active() and guard.refused is None,
                             stats=publisher.stats)
            if guard.refused is not None:
                log.info("WHIP into stream %s refused: %s", publisher.stream_id, guard.refused)
                publisher.stats.ended = guard.refused
            gate.report()
            if guard.dropped:
                log.info("WHIP into stream %s: %d frames over %g a second dropped", publisher.stream_id,
                         guard.dropped, MAX_INPUT_FPS)
        finally:
            await publisher.close(publisher.stats.ended or "its track ended")

    async def _watch(self, publisher: Publisher, session) -> None:
        """Ends the publisher when its stream ends, or when it has not connected within connect_timeout_s."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.webrtc.connect_timeout_s
        while not publisher.closed:
            if session.closed:
                await publisher.close("its stream ended")
                return
            if publisher.pc.connectionState != "connected" and loop.time() > deadline:
                await publisher.close(f"no connection within {self.webrtc.connect_timeout_s:g} s")
                return
            if publisher.pc.connectionState == "connected":
                deadline = float("inf")
            await asyncio.sleep(_WATCH_S)


def _loopback(addresses) -> bool:
    """Whether the server gathers on a loopback address (then a publisher's loopback candidates are kept)."""
    return any(a != ANY_INTERFACE and ipaddress.ip_address(a).is_loopback for a in addresses or ())
