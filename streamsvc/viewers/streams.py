"""The open streams of one server once their viewers are in (`Streams`): what a viewer's control messages do
(prompts, pause and resume, the steer token, recording, stats, WebRTC offers), the `audience` each viewer hears, a
viewer leaving and a stream ending.

streamsvc/viewers/server.py admits viewers (`start`, `watch`), carries their messages and hands each one after the first
to `Streams.control`. Each stream's control messages are rate-limited (streamsvc/door/access.py); a refusal says why on
the wire and is counted in /metrics by reason. Prompts are coalesced by the scheduler: one recache per chunk at
most, however fast a viewer sends them. A stream whose steerer left goes on for its watchers until one takes the
steer token (`take` needs the stream's steer secret: a watch link does not carry it), or the orphan timeout ends it.
The steer secret follows the token: a handover or a take sends the new steerer a new one in its `audience` and
revokes the one before (session.Session.give_token).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from dataclasses import replace

from streamsvc.door.access import Refusal, StreamLimits
from streamsvc.door.routes import RECORDINGS_PATH
from streamsvc.engine.engine import ChunkOut, Engine
from streamsvc.engine.errors import EngineError
from streamsvc.engine.heap import Heap
from streamsvc.engine.styles import AdapterError, StyleBusy
from streamsvc.metrics import Metrics
from streamsvc.viewers.record import RecordingRefused, RecordingStore
from streamsvc.viewers.session import Session, SessionState, Viewer
from streamsvc.wire import protocol as P
from streamsvc.wire.rtc import SignalingError

log = logging.getLogger("streamsvc.server")  # the server's lines, under the name they have always had

AUDIENCE_DELAY_S = 0.25  # joins and leaves within this make one `audience` message to each viewer


class Streams:
    """The open streams of one server (`sessions`, by stream id) and what happens in them; every method runs on the
    event loop."""

    def __init__(self, engine: Engine, sessions: dict[str, Session], limits: StreamLimits, recordings: RecordingStore,
                 metrics: Metrics, clock: Callable[[], float], orphan_timeout_s: float, heap: Heap) -> None:
        self.engine = engine
        self.sessions = sessions  # the server's own dict: a stream is in it from its `start` until it ends
        self.limits = limits  # the per-client stream counts, released when a stream ends
        self.recordings = recordings
        self.metrics = metrics
        self.clock = clock  # the control rates' time (tests inject one)
        self.orphan_timeout_s = orphan_timeout_s  # how long a stream whose steerer left goes on for its watchers
        self.heap = heap  # what a stream held goes back soon after it ends
        self._tasks: set[asyncio.Task] = set()  # work spawned off a caller (kept referenced until done)

    def table_sizes(self) -> dict[str, int]:
        """Entries of the open streams' tables (see Server.table_sizes): the streams, their viewers, the recent prompt
        texts (each stream's at most PROMPT_TEXTS_KEPT), the chunks kept for watchers who join, the WebRTC viewers'
        queue reports, what the steer secret opened, and the work spawned off callers."""
        sessions = list(self.sessions.values())
        return {"viewers.sessions": len(sessions), "viewers.viewers": sum(len(s.viewers) for s in sessions),
                "viewers.prompt_texts": sum(len(s.prompt_texts) for s in sessions),
                "viewers.gop_chunks": sum(len(s.gop) for s in sessions),
                "viewers.track_queues": sum(len(s.track_queues) for s in sessions),
                "viewers.revocable": sum(len(s.revocable) for s in sessions), "viewers.tasks": len(self._tasks)}

    async def control(self, viewer: Viewer, msg) -> None:
        """A viewer's message after its `start` or `watch` (on its WebSocket, or a WebRTC viewer's data channel).
        Steering messages are the steerer's alone, every message but `close` is held to the viewer's rate, and a
        request that fails is answered with an error: the stream goes on."""
        session = viewer.session
        sid = session.stream_id
        refusal = self._over_rate(viewer, msg)
        if isinstance(msg, _STEER_TYPES) and viewer is not session.steerer:
            holder = session.steerer
            viewer.send(P.Error(code=P.ErrorCode.NOT_STEERER, request=msg.type, message=(
                f"'{msg.type}' refused: only the stream's steerer may send it, and you watch it; "
                + (f"its steerer ({holder.viewer_id}) can hand you the token" if holder is not None else
                   "nobody steers it now: send 'take' with its steer secret to steer it"))))
            return
        if isinstance(msg, (P.SetPrompt, P.SetLora)):
            await self._steer(session, msg, refusal)
            return
        if refusal is not None:
            viewer.send(refusal)
            return
        try:
            if isinstance(msg, (P.Pause, P.Resume)):
                await self._pause_or_resume(viewer, isinstance(msg, P.Pause))
            elif isinstance(msg, P.Stats):
                if msg.stalls > viewer.client_stalls:
                    self.metrics.client_stalls.inc(msg.stalls - viewer.client_stalls)
                    viewer.client_stalls = msg.stalls
                # it left the viewer a while ago (more so on a busy host): it may lower the model, never raise it;
                # the stream's model follows its viewer with the least buffered, a watcher's as much as its steerer's
                await asyncio.wrap_future(self.engine.observe_buffer(sid, viewer.buffered_frames(msg), at_most=True))
                if viewer is session.steerer:
                    session.buffer_report(msg.buffered_s)
            elif isinstance(msg, P.Close):
                if viewer is session.steerer:
                    await self.end(session, "closed by client")
                else:
                    await self.leave(viewer, "closed by client")
            elif isinstance(msg, P.SetStrength):  # input video (issue 35): from its next chunk on, snapped
                if session.input is None:
                    viewer.send(P.Error(code=P.ErrorCode.INVALID_FIELD, request="set_strength", message=(
                        "this stream takes no input video: start it with \"input\": true to set a strength")))
                    return
                strength = await asyncio.wrap_future(self.engine.set_strength(sid, msg.strength))
                session.description = replace(session.description, strength=strength)  # a later watcher's `ready`
                viewer.send(P.Ack(request="set_strength", strength=strength))
            elif isinstance(msg, P.Handover):
                self._handover(viewer, msg.to)
            elif isinstance(msg, P.Take):
                self._take(viewer, msg.secret)
            elif isinstance(msg, P.Record):
                await self.record(viewer)
            elif isinstance(msg, P.Offer):
                if viewer.rtc is None:
                    viewer.send(P.Error(code=P.ErrorCode.INVALID_FIELD, message=(
                        "this connection's transport is 'ws'; send "
                        f"{viewer.role.value == 'watch' and 'watch' or 'start'}"
                        " with transport 'webrtc' to use an offer")))
                    return
                try:
                    viewer.send(P.Answer(sdp=await viewer.rtc.answer(msg.sdp)))
                except SignalingError as e:
                    viewer.send(P.Error(code=P.ErrorCode.INVALID_FIELD, message=str(e)[: P.MAX_TEXT_CHARS]))
        except Exception as e:  # noqa: BLE001 - a failed request is reported, the stream goes on
            if viewer.closed:
                return
            viewer.send(failed(msg.type, e))

    def _over_rate(self, viewer: Viewer, msg) -> P.Error | None:
        """The error for a control message over its viewer's rate (stats have a rate of their own), or
        None when it may go on; close always may."""
        if isinstance(msg, P.Close):
            return None
        stats = isinstance(msg, P.Stats)
        bucket = viewer.stats_rate if stats else viewer.control_rate
        if bucket.take(self.clock()):
            return None
        self.metrics.refusals.labels((Refusal.STATS_RATE_LIMITED if stats else Refusal.RATE_LIMITED).value).inc()
        rate = bucket.rate
        return P.Error(code=P.ErrorCode.RATE_LIMITED, request=msg.type, message=(
            f"'{msg.type}' dropped: this stream may send {rate.per_s:g} {'stats' if stats else 'control'} messages "
            f"a second (bursts of {rate.burst}); the stream goes on"))

    async def _pause_or_resume(self, viewer: Viewer, pause: bool) -> None:
        """Park the stream's state in host memory, or bring it back. Both are idempotent: a repeat is
        acknowledged and does nothing. A refusal (no park budget, no room on the device to resume) is
        `unavailable` with the engine's reason; the stream stays as it was."""
        session, request = viewer.session, "pause" if pause else "resume"
        if pause is not (session.state is SessionState.PAUSED):
            try:
                await asyncio.wrap_future((self.engine.pause if pause else self.engine.resume)(session.stream_id))
            except EngineError as e:
                viewer.send(P.Error(code=P.ErrorCode.UNAVAILABLE, request=request, message=str(e)[: P.MAX_TEXT_CHARS]))
                return
            if pause:
                session.pause()
            else:
                session.resume()
            if session.watchers:
                self._send_audience(session)  # the watchers learn the stream is paused (or goes on)
        viewer.send(P.Ack(request=request))

    def _handover(self, viewer: Viewer, to: str) -> None:
        session = viewer.session
        target = session.viewers.get(to)
        if target is None or target is viewer:
            viewer.send(P.Error(code=P.ErrorCode.INVALID_FIELD, request="handover", message=(
                f"no watcher {to!r} on stream {session.stream_id}: hand over to the viewer_id of one of its watchers")))
            return
        if _cannot_steer(target):  # its new steer secret would reach nobody: the stream could not be steered again
            viewer.send(P.Error(code=P.ErrorCode.INVALID_FIELD, request="handover", message=(
                f"watcher {to!r} has no control channel (a WHEP player without one): it could not steer; hand the "
                "token to another watcher")))
            return
        self._give_token(viewer, target, "handover")

    def _take(self, viewer: Viewer, secret: str | None) -> None:
        """A viewer takes the steer token of its stream: it needs the stream's steer secret (its steerer's `ready`
        had it; watching needs only the watch secret), and the token must be free (its steerer left)."""
        session = viewer.session
        if not session.may_steer(secret):
            self.metrics.refusals.labels(Refusal.SECRET.value).inc()
            viewer.send(P.Error(code=P.ErrorCode.NOT_STEERER, request="take", message=(
                f"'take' refused: it needs stream {session.stream_id}'s steer secret, which its steerer's 'ready' "
                "carries (a watch link does not); the stream goes on")))
            return
        if session.steerer is not None and not _cannot_steer(session.steerer):
            holder = "you hold it" if session.steerer is viewer else f"{session.steerer.viewer_id} holds it"
            viewer.send(P.Error(code=P.ErrorCode.NOT_STEERER, request="take", message=(
                f"the steer token of stream {session.stream_id} is taken ({holder}); its steerer can hand it over")))
            return
        self._give_token(viewer, viewer, "take")

    def _give_token(self, asked: Viewer, to: Viewer, request: str) -> None:
        """`to` steers: its `audience` carries the stream's new steer secret (the one before is revoked)."""
        session = asked.session
        session.give_token(to)
        log.info("stream %s: the steer token went to %s (%s); the steer secret before is revoked", session.stream_id,
                 to.viewer_id, request)
        asked.send(P.Ack(request=request))
        self._send_audience(session, new_steerer=to)

    def audience_changed(self, session: Session, now: bool = False) -> None:
        """Every viewer gets `audience` soon (joins in a burst make one message each), or `now` (a role changed)."""
        if now:
            self._send_audience(session)
        elif not session.audience_due:
            session.audience_due = True
            asyncio.get_running_loop().call_later(AUDIENCE_DELAY_S, self._send_audience, session)

    @staticmethod
    def _send_audience(session: Session, new_steerer: Viewer | None = None) -> None:
        """`audience` to every viewer; to `new_steerer` (the token just came to it) with the stream's steer secret."""
        session.audience_due = False
        if session.closed:
            return
        watchers, steered = session.watchers, session.steerer is not None
        paused = session.state is SessionState.PAUSED
        for viewer in list(session.viewers.values()):
            secret = session.steer_secret if viewer is new_steerer else None
            viewer.send(P.Audience(role=viewer.role.value, watchers=watchers, steered=steered, paused=paused,
                                   steer_secret=secret))

    async def record(self, viewer: Viewer, quiet: bool = False) -> None:
        """Record the stream from its next keyframe on (`record`, or every stream with --record)."""
        session = viewer.session
        if session.recorder is None:
            shape = session.description.shape
            try:
                session.recorder = self.recordings.open(session.stream_id, session.fps, shape.width, shape.height)
            except RecordingRefused as e:
                viewer.send(P.Error(code=P.ErrorCode.UNAVAILABLE, request="record", message=str(e)[: P.MAX_TEXT_CHARS]))
                return
            self.engine.request_keyframe(session.stream_id)
            log.info("stream %s: recording %s", session.stream_id, session.recorder.recording_id)  # not its secret
        message = self.recording_message(session)
        for v in list(session.viewers.values()) if not quiet else [viewer]:
            v.send(message)

    @staticmethod
    def recording_message(session: Session) -> P.Recording:
        """Where the stream's recording is: its links carry the recording's own secret (streamsvc/viewers/record.py)."""
        name = session.recorder.name
        return P.Recording(url=f"{RECORDINGS_PATH}{name}.mp4", chapters=f"{RECORDINGS_PATH}{name}.vtt")

    def _record_chunk(self, session: Session, out: ChunkOut) -> None:
        recorder = session.recorder
        try:
            recorder.add(out.header, out.access_units, session.prompt_texts.get(out.header.prompt_version, ""))
        except Exception as e:  # noqa: BLE001 - a failed recording ends the recording, not the stream
            log.exception("stream %s: recording failed", session.stream_id)
            recorder.stopped_reason = recorder.stopped_reason or f"recording failed: {type(e).__name__}: {e}"
        if recorder.stopped_reason is not None:
            with contextlib.suppress(Exception):
                recorder.close()
            session.recorder = None
            session.to_steerer(P.Error(code=P.ErrorCode.UNAVAILABLE, request="record",
                                       message=recorder.stopped_reason[: P.MAX_TEXT_CHARS]))

    def chunk_done(self, session: Session, out: ChunkOut) -> None:
        """A chunk of the stream went out to its viewers: its recording gets it."""
        if session.recorder is not None:
            self._record_chunk(session, out)

    async def _steer(self, session: Session, msg: P.SetPrompt | P.SetLora, refusal: P.Error | None) -> None:
        """A set_prompt or a set_lora: refused, or to the engine (whose scheduler coalesces a flood: the newest takes
        the next chunk). Replies keep the order of the requests."""
        async with session.steering:
            reply = refusal if refusal is not None else await (
                self._prompt_to_engine(session, msg.prompt) if isinstance(msg, P.SetPrompt)
                else self._style_to_engine(session, msg))
            session.to_steerer(reply)

    async def _prompt_to_engine(self, session: Session, prompt: str) -> P.Ack | P.Error:
        """The stream's next chunks run under ``prompt``: the ack with their version, or the error."""
        try:
            accepted = await asyncio.wrap_future(self.engine.set_prompt(session.stream_id, prompt))
        except Exception as e:  # noqa: BLE001 - reported to the client, the stream goes on
            return failed("set_prompt", e)
        session.prompt = prompt
        self._new_version(session, accepted.version)
        return P.Ack(request="set_prompt", prompt_version=accepted.version,
                     unknown_words=wire_words(accepted.unknown_words))

    async def _style_to_engine(self, session: Session, msg: P.SetLora) -> P.Ack | P.Error:
        """The stream's next chunks run under style ``msg.lora`` (a switch to its newest prompt, streamsvc/engine/
        styles.py): the ack with their version, or why not (its style stays)."""
        try:
            version = await asyncio.wrap_future(self.engine.set_lora(session.stream_id, msg.lora, msg.lora_scale,
                                                                     session.prompt))
        except AdapterError as e:  # an unknown style, a bad scale or file (invalid), no room now (unavailable)
            code = P.ErrorCode.UNAVAILABLE if isinstance(e, StyleBusy) else P.ErrorCode.INVALID_FIELD
            return P.Error(code=code, request="set_lora", message=f"{e}; the stream goes on"[: P.MAX_TEXT_CHARS])
        except Exception as e:  # noqa: BLE001 - reported to the client, the stream goes on
            return failed("set_lora", e)
        session.description = replace(session.description, lora=msg.lora, lora_scale=msg.lora_scale)
        self._new_version(session, version)
        return P.Ack(request="set_lora", prompt_version=version)

    @staticmethod
    def _new_version(session: Session, version: int) -> None:
        """The stream's prompt and style have a new version: its chapter (its recording's) names them."""
        desc = session.description
        session.prompt_version = version
        session.prompt_texts[version] = chapter_title(session.prompt, desc.lora if desc is not None else None,
                                                      desc.lora_scale if desc is not None else 1.0)
        for old in [v for v in session.prompt_texts if v <= version - PROMPT_TEXTS_KEPT]:
            del session.prompt_texts[old]  # (a flood's: each prompt has its version; chunks run under recent ones)

    def _spawn(self, coro: Coroutine) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def leave(self, viewer: Viewer, reason: str) -> None:
        """A viewer goes (its connection closed, or a watcher's close): its transport ends; the stream goes on
        while it has viewers, steerable by whoever takes the token within the orphan timeout."""
        if viewer.left:
            return
        session = viewer.session
        viewer.send(P.Closed(reason=reason))
        viewer.send(None)
        steered = viewer is session.steerer
        session.leave(viewer, self.clock())
        session.track_queues.pop(viewer.viewer_id, None)
        if session.closed:
            return
        if not session.viewers:
            await self.end(session, reason if steered else f"its last viewer left ({reason})")
            return
        with contextlib.suppress(Exception):
            self.engine.viewer_left(session.stream_id)
        if steered:
            timeout = self.orphan_timeout_s
            log.info("stream %s: its steerer left (%s); it goes on for %d watchers, %g s until one takes the token",
                     session.stream_id, reason, session.watchers, timeout)
            asyncio.get_running_loop().call_later(timeout, self._orphan_expired, session, session.orphaned_at)
        self.audience_changed(session, now=steered)

    def _orphan_expired(self, session: Session, orphaned_at: float) -> None:
        if not session.closed and session.steerer is None and session.orphaned_at == orphaned_at:
            timeout = self.orphan_timeout_s
            self._spawn(self.end(session, f"its steerer left and nobody took the steer token within {timeout:g} s"))

    async def end(self, session: Session, reason: str, engine_closed: bool = False) -> None:
        """Close a stream once: free it in the engine, end its recording, tell every viewer, end their senders."""
        if not session.close(reason):
            return
        self.sessions.pop(session.stream_id, None)
        self.limits.release(session.token, session.address)
        if not engine_closed:
            with contextlib.suppress(Exception):
                await asyncio.wrap_future(self.engine.close_stream(session.stream_id))
        if session.recorder is not None:
            with contextlib.suppress(Exception):
                session.recorder.close()
        for viewer in list(session.viewers.values()):
            viewer.send(P.Closed(reason=reason))
            viewer.send(None)
            viewer.left = True
        self.heap.tidy_soon()


def _cannot_steer(viewer: Viewer) -> bool:
    """A steerer whose peer connection is up without a control channel (a WHEP player that offered none,
    streamsvc/door/whep.py) cannot steer: a `take` with the steer secret takes the token from it."""
    pc = viewer.rtc.pc if viewer.rtc is not None else None
    return pc is not None and pc.sctp is None and pc.connectionState == "connected"


PROMPT_TEXTS_KEPT = 64  # a stream's recent prompts by version, for its recording's chapters

_STEER_TYPES = (P.SetPrompt, P.Pause, P.Resume, P.Record, P.Handover, P.SetStrength, P.SetLora)  # steerer's only


def chapter_title(prompt: str, lora: str | None, scale: float) -> str:
    """A recording's chapter for a prompt under a style: the prompt, and the style when there is one."""
    return prompt if lora is None or scale == 0 else f"{prompt} [style {lora} x{scale:g}]"


def wire_words(words: tuple[str, ...]) -> list[str]:
    """Words the model does not know (of a prompt), as many as the wire carries."""
    return [w[: P.MAX_WORD_CHARS] for w in words[: P.MAX_UNKNOWN_WORDS]]


def wire_vocabulary(words: tuple[str, ...] | None) -> list[str] | None:
    """The words the model was trained with, as many as the wire carries; None for an open vocabulary."""
    return None if words is None else [w for w in words if len(w) <= P.MAX_WORD_CHARS][: P.MAX_VOCABULARY]


def failed(request: str, e: Exception) -> P.Error:
    """The error for a request the server failed on: what failed, never a traceback."""
    return P.Error(code=P.ErrorCode.INTERNAL, message=f"{request} failed: {e}"[: P.MAX_TEXT_CHARS], request=request)
