"""One stream's life on the event loop: an explicit state machine, its prompt versions and its viewers.

A stream has viewers (`Viewer`): the one that started it steers (holds its steer token), the
others watch. Each viewer has its own outbox and transport; each chunk is encoded once and put in
every viewer's outbox. A watcher that joins mid-stream starts at a keyframe chunk (the encoder makes
one every 2 s or so, at a chunk's start): it gets the chunks from there on at once (`Session.gop`
keeps the last two keyframe intervals). Of those keyframes it starts at the latest one that does not
put it ahead of the viewer that plays furthest ahead: a newcomer ahead of every viewer would have less
buffered than all of them, and the stream would run ahead for it, deepening every other viewer's buffer
(and its steerer's prompt-to-screen latency) by the difference. When none is kept (a stream without
one lately), it waits for the next keyframe chunk, asked of the encoder when it joins.

A stream's id names it and grants nothing: its links are capabilities. A watch needs its watch secret (the
watch link carries it), a `take` of its steer token its steer secret; both are made when it opens (128 random
bits each, streamsvc.door.access.new_secret), given to its steerer alone in `ready`, and compared in constant time.
Capabilities follow the steer token: `give_token` (a handover, a take) makes a new steer secret for the new steerer
and revokes the one before, ending what was opened with it (`revocable`: a WHIP publisher, streamsvc/door/whip.py).
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from streamsvc.door.access import TokenBucket, new_secret, secret_matches
from streamsvc.engine.reports import StreamDescription
from streamsvc.viewers.outbox import Outbox
from streamsvc.wire import protocol as P


class SessionState(enum.Enum):
    STARTING = "starting"  # admitted, no chunk delivered yet
    PLAYING = "playing"  # chunks arrive before the viewer's buffer runs dry
    STALLED = "stalled"  # the viewer's buffer ran dry
    PAUSED = "paused"  # the viewer paused; generation stops once the buffer is full
    CLOSED = "closed"  # ended: KV cache freed, no more messages


_ALLOWED = {
    SessionState.STARTING: {SessionState.PLAYING, SessionState.PAUSED, SessionState.CLOSED},
    SessionState.PLAYING: {SessionState.STALLED, SessionState.PAUSED, SessionState.CLOSED},
    SessionState.STALLED: {SessionState.PLAYING, SessionState.PAUSED, SessionState.CLOSED},
    SessionState.PAUSED: {SessionState.PLAYING, SessionState.STARTING, SessionState.CLOSED},
    SessionState.CLOSED: set(),
}


class InvalidState(RuntimeError):
    """A transition the state machine does not allow; the message says the state."""


GOP_CHUNKS = 8  # chunks a stream keeps for watchers who join: from its second-last keyframe chunk, or its last


class Role(enum.StrEnum):
    STEER = "steer"  # holds the stream's steer token: its prompts steer, its close ends the stream
    WATCH = "watch"  # receives the stream's chunks, steers nothing


@dataclass(eq=False)
class Viewer:
    """One connection on a stream: its steerer or a watcher. Its transport reads `outbox`."""

    viewer_id: str  # unique on the server ("v0", "v1", ...): the `to` of a handover
    session: Session  # the stream it views
    role: Role
    token: str | None = None  # the access token it came with
    address: str = ""  # its client address (a steerer's stream counts against it)
    control_rate: TokenBucket | None = None  # control messages it may still send (stats apart)
    stats_rate: TokenBucket | None = None  # stats messages it may still send
    joined_at: float = field(default_factory=time.monotonic)  # its TTFF runs from here
    first_chunk_at: float | None = None
    chunks_sent: int = 0
    client_stalls: int = 0  # stalls it has reported (stats messages)
    keyframe_wanted: bool = False  # joined mid-stream: chunks before the next keyframe chunk are not sent to it
    first_pts: int | None = None  # stream index of the first frame queued for it (it plays from there)
    queued_end: int = 0  # stream index after the last frame queued for it
    left: bool = False  # its connection is gone (or it closed): nothing more is put in its outbox
    rtc: object | None = None  # its WebRTC transport (streamsvc.transport.webrtc.WebRtcTransport), if any
    # messages for the transport, in order: a ChunkOut, a protocol model, or None (end); bounded
    # (streamsvc/viewers/outbox.py)
    outbox: Outbox = field(default_factory=Outbox)

    # what a transport reads of its stream (WebRtcTransport takes a viewer where it took a session)
    @property
    def stream_id(self) -> str:
        return self.session.stream_id

    @property
    def fps(self) -> int:
        return self.session.fps

    @property
    def state(self) -> SessionState:
        return self.session.state

    @property
    def closed(self) -> bool:
        return self.left or self.session.closed

    def buffer_report(self, buffered_s: float) -> None:
        self.session.buffer_report(buffered_s)

    def send(self, item) -> None:
        """Queue a message (or a chunk) for this viewer, unless it left."""
        if not self.left:
            self.outbox.put_nowait(item)

    def take_chunk(self, chunk) -> bool:
        """Queue a chunk unless the viewer still waits for a keyframe and this is not one; True if queued."""
        if self.left or self.keyframe_wanted and not chunk.header.keyframe:
            return False
        self.keyframe_wanted = False
        if self.first_pts is None:
            self.first_pts = chunk.header.pts
        self.queued_end = chunk.header.pts + chunk.header.frames
        self.outbox.put_nowait(chunk)
        return True

    def buffered_frames(self, stats: P.Stats) -> float:
        """Its buffer as the stream's model counts it, from its `stats`: what it reports it holds, and the frames
        queued for it that have not reached it yet (the model counts a chunk once it is handed to the viewers,
        and the event loop sends it to one viewer after another: with many viewers a report often comes before
        the newest chunk has reached its viewer, and would lower the model by that chunk). Over WebRTC the track
        paces the frames and reports its own queue: there the viewer's report is taken as it is."""
        reported = stats.buffered_s * self.fps
        if self.rtc is not None or self.first_pts is None:
            return reported
        return max(reported, self.queued_end - self.first_pts - stats.frames_played)

    def delivered(self, now: float) -> float | None:
        """A chunk went to its transport; the viewer's TTFF (join to first chunk) when it was its first."""
        self.chunks_sent += 1
        if self.first_chunk_at is not None:
            return None
        self.first_chunk_at = now
        return now - self.joined_at


@dataclass(eq=False)
class Session:
    """A stream as the server sees it: its state, its prompts and its viewers. The engine feeds it chunks."""

    stream_id: str
    fps: int
    prompt: str
    watch_secret: str = field(default_factory=new_secret, repr=False)  # what a watch of it needs (the watch link's)
    steer_secret: str = field(default_factory=new_secret, repr=False)  # what a take of its steer token needs
    # what was opened with the steer secret and ends when it is revoked (a WHIP publisher), by a key of the opener's
    revocable: dict[str, Callable[[str], None]] = field(default_factory=dict, repr=False)
    created_at: float = field(default_factory=time.monotonic)
    state: SessionState = SessionState.STARTING
    prompt_version: int = 0  # newest version acknowledged to the client
    chunks_sent: int = 0
    first_chunk_at: float | None = None
    close_reason: str | None = None
    prompt_texts: dict[int, str] = field(default_factory=dict)  # recent prompts by version (recording's chapters)
    # held while a set_prompt is decided and answered, so replies keep the order of the requests
    steering: asyncio.Lock = field(default_factory=asyncio.Lock)
    viewers: dict[str, Viewer] = field(default_factory=dict)  # by viewer id: the steerer and the watchers
    steerer: Viewer | None = None  # who holds the steer token; None: it left, any watcher may take it
    orphaned_at: float | None = None  # when the steerer left (the orphan timeout runs from here)
    gop: list = field(default_factory=list)  # ChunkOuts from a keyframe chunk on, for newcomers (see _keep)
    recorder: object | None = None  # its recording (streamsvc.viewers.record.Recorder), if one runs
    token: str | None = None  # the access token it was opened with (it counts against the token's limit)
    address: str = ""  # the client address that opened it (it counts against the address's limit)
    track_queues: dict[str, float] = field(default_factory=dict)  # frames queued in each WebRTC viewer's track
    audience_due: bool = False  # an `audience` message to every viewer is on its way
    # its input video's timeline (streamsvc.inputs.frames.InputFrames), if its start asked for it
    input: object | None = None
    description: StreamDescription | None = None  # what admission described it as (its viewers' `ready`)
    _paused_from: SessionState = SessionState.PLAYING

    def may_watch(self, secret: str | None) -> bool:
        """Whether ``secret`` is this stream's watch secret (constant time)."""
        return secret_matches(self.watch_secret, secret)

    def may_steer(self, secret: str | None) -> bool:
        """Whether ``secret`` is this stream's steer secret (constant time): what a `take` needs."""
        return secret_matches(self.steer_secret, secret)

    def to_steerer(self, msg) -> None:
        """A reply meant for whoever steers the stream now (dropped while nobody does)."""
        if self.steerer is not None:
            self.steerer.send(msg)

    @property
    def watchers(self) -> int:
        return sum(1 for v in self.viewers.values() if v.role is Role.WATCH)

    def fan_out(self, chunk) -> list[Viewer]:
        """Queue a chunk for every viewer that may take it and keep it for watchers to come; the viewers that
        waited for a keyframe and took this one (their first)."""
        self._keep(chunk)
        firsts = []
        for viewer in list(self.viewers.values()):
            waited = viewer.keyframe_wanted
            if viewer.take_chunk(chunk) and waited:
                firsts.append(viewer)
        return firsts

    def _keep(self, chunk) -> None:
        """Keep the chunks from the second-last keyframe chunk on, at most GOP_CHUNKS of them (else from the last
        keyframe chunk; none when that one is too far back as well)."""
        self.gop.append(chunk)
        keys = [i for i, c in enumerate(self.gop) if c.header.keyframe]
        fits = [i for i in keys[-2:] if len(self.gop) - i <= GOP_CHUNKS]
        if fits:
            del self.gop[:fits[0]]
        else:
            self.gop.clear()  # too long since a keyframe: a newcomer waits for the next one

    def join(self, viewer: Viewer, buffered_frames: float | None = None) -> bool:
        """Add a viewer; it gets the kept chunks from a keyframe on at once: the latest keyframe that gives it
        at least `buffered_frames` (the stream's modelled buffer) and one chunk more, or else the earliest kept;
        without `buffered_frames`, the latest. False: none kept, it waits for one. (The model is a lower bound:
        a viewer's report lowers it, never raises it, and a chunk still on its way to a viewer is not in its
        report; the viewers' real buffers run up to a chunk above it.)"""
        self.viewers[viewer.viewer_id] = viewer
        if viewer.role is Role.STEER:
            self.steerer, self.orphaned_at = viewer, None
        if self.gop:
            starts = [i for i, c in enumerate(self.gop) if c.header.keyframe]
            first = starts[-1]
            if buffered_frames is not None:
                newest = self.gop[-1].header
                end = newest.pts + newest.frames  # the frames sent so far
                behind = [i for i in starts if end - self.gop[i].header.pts >= buffered_frames + newest.frames]
                first = behind[-1] if behind else starts[0]
            for chunk in self.gop[first:]:
                viewer.take_chunk(chunk)
            return True
        viewer.keyframe_wanted = self.chunks_sent > 0
        return not viewer.keyframe_wanted

    def leave(self, viewer: Viewer, now: float) -> None:
        """A viewer is gone; a steerer leaving orphans the stream from `now`."""
        viewer.left = True
        self.viewers.pop(viewer.viewer_id, None)
        if viewer is self.steerer:
            self.steerer, self.orphaned_at = None, now

    def give_token(self, to: Viewer) -> Viewer | None:
        """`to` steers from now on; the viewer that held the token (if any) watches. Returns that one. A new holder
        gets a new steer secret (`steer_secret`, for its `audience`): the one before is revoked, and what was opened
        with it (`revocable`) ends."""
        before = self.steerer
        if before is not None:
            before.role = Role.WATCH
        if before is not to:
            if self.input is not None:  # the input is the steerer's: the old one's stops here
                self.input.stop()
            self.steer_secret = new_secret()
            ends, self.revocable = list(self.revocable.values()), {}
            for end in ends:
                end("the stream's steer token went to another viewer: the steer secret it came with is revoked")
        to.role = Role.STEER
        self.steerer, self.orphaned_at = to, None
        return before

    def transition(self, new: SessionState) -> None:
        if new is self.state:
            return
        if new not in _ALLOWED[self.state]:
            raise InvalidState(f"session {self.stream_id} is {self.state.value}; it cannot become {new.value}")
        if new is SessionState.PAUSED:
            self._paused_from = self.state
        self.state = new

    @property
    def closed(self) -> bool:
        return self.state is SessionState.CLOSED

    def pause(self) -> None:
        self.transition(SessionState.PAUSED)
        if self.input is not None:  # input frames that come while paused are dropped (counted)
            self.input.pause()

    def resume(self) -> None:
        if self.input is not None:
            self.input.resume()
        if self.state is SessionState.PAUSED:
            self.transition(SessionState.PLAYING if self._paused_from is not SessionState.STARTING
                            else SessionState.STARTING)

    def delivered(self, now: float) -> None:
        """A chunk went out to the transport."""
        self.chunks_sent += 1
        if self.first_chunk_at is None:
            self.first_chunk_at = now
        if self.state in (SessionState.STARTING, SessionState.STALLED):
            self.transition(SessionState.PLAYING)

    def buffer_report(self, buffered_s: float) -> None:
        """The engine's model (or the client) says how much the viewer has buffered."""
        if self.state is SessionState.PLAYING and buffered_s <= 0:
            self.transition(SessionState.STALLED)
        elif self.state is SessionState.STALLED and buffered_s > 0:
            self.transition(SessionState.PLAYING)

    def close(self, reason: str) -> bool:
        """Returns False if it was already closed."""
        if self.closed:
            return False
        self.close_reason = reason
        self.transition(SessionState.CLOSED)
        if self.input is not None:
            self.input.close()
        return True

    @property
    def ttff_s(self) -> float | None:
        return None if self.first_chunk_at is None else self.first_chunk_at - self.created_at
