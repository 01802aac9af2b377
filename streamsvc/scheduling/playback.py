"""The viewer's buffer model: what each stream's viewer holds, and when it stalls.

Each stream's viewer buffer is modelled (DESIGN.md "Measuring a stream": playback starts
when the first chunk arrives, then consumes frames at fps and stalls when empty) from
delivered chunks and `now`, or set exactly by a report of the viewer (`observe`,
`report`). A committed chunk not yet delivered is in flight: the planner counts it as
buffered, but the model is credited only when it is delivered. A dry spell counts as a
stall only once it outlasts what the viewer holds beyond the report (`grace_s`).

Two figures (issue 41, DESIGN.md "Hostile clients"): the model the planner plans on, which a
viewer's own report (`at_most`: its `stats`, across the network) may lower, and `own`, the
server's own figure, fed only by what the server measures itself: its deliveries, its pauses
and the exact reports of its own queues (a WebRTC track's). A viewer's reports make its own
stream urgent, but a dry spell only `own` sees is the server's: only that one is overload.

Pure: every call that depends on time takes `now`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PlaybackModel:
    """One viewer's playback buffer, as a fluid of frames (exact for chunks that arrive whole).

    Playback starts when the first frames arrive, consumes `fps` frames per second
    unless paused, and runs dry while empty. A dry spell is a stall once it has lasted
    `grace_s`: what the viewer holds beyond the frames the model counts (0 for a
    viewer's own report; a WebRTC receiver's jitter buffer and the frame on the wire
    for a track's queue). Planning sees the dry spell at once either way.
    """

    fps: float  # consumption rate while playing
    buffered_frames: float = 0.0  # frames in the buffer at `updated_at`
    updated_at: float = 0.0  # time `buffered_frames` refers to
    started: bool = False  # the first frames have arrived
    paused: bool = False  # the viewer paused: nothing is consumed and nothing stalls
    dry_since: float | None = None  # start of the dry spell in progress, None when not dry
    grace_s: float = 0.0  # a dry spell becomes a stall once it has lasted this long (set by each report)
    dry_counted: bool = False  # the dry spell in progress has lasted grace_s: it is counted in `stalls`
    stalls: int = 0  # stalls begun so far
    closed_stall_s: float = 0.0  # duration of the stalls that have ended (past their grace)
    # the server's own figure of the same buffer: deliveries, pauses and exact reports, never a viewer's `at_most`
    # report (see the module docstring); None: this is the own figure (or a model with no reports to tell apart)
    own: PlaybackModel | None = None

    def advance(self, now: float) -> None:
        """Consume frames up to `now` (times before `updated_at` are ignored)."""
        if self.own is not None:
            self.own.advance(now)
        if now > self.updated_at:
            if self.started and not self.paused and self.dry_since is None:
                drained = (now - self.updated_at) * self.fps
                if drained > self.buffered_frames:
                    self.dry_since = self.updated_at + self.buffered_frames / self.fps
                    self.buffered_frames = 0.0
                else:
                    self.buffered_frames -= drained
            self.updated_at = now
        self._count_dry(now)

    def deliver(self, frames: int, now: float, hold_until: float | None = None, cut: bool = False) -> None:
        """`frames` arrive at `now`: a dry spell in progress ends, and playback starts if it had not (the first
        frames: at `hold_until` if later, a viewer that holds a stream of input video until its playout is due).
        `cut`: the viewer drops what it held and had not shown (a new prompt's first chunk): it holds these alone."""
        if self.own is not None:
            self.own.deliver(frames, now, hold_until, cut)
        self.advance(now)
        self._end_stall(now)
        if cut:
            self.buffered_frames = 0.0
        self.buffered_frames += frames
        if not self.started and hold_until is not None and hold_until > now:
            self.updated_at = hold_until  # nothing is consumed before then
        self.started = True

    def observe(self, frames: float, now: float) -> None:
        """The viewer's buffer holds exactly `frames` at `now` (the server's own figure too)."""
        if self.own is not None:
            self.own.observe(frames, now)
        self._set(frames, now)

    def _set(self, frames: float, now: float) -> None:
        """This figure (not `own`) holds `frames` at `now`."""
        self.advance(now)
        self.buffered_frames = float(frames)
        if frames > 0:
            self.started = True
            self._end_stall(now)
        elif self.started and not self.paused and self.dry_since is None:
            self.dry_since = now
            self._count_dry(now)

    def report(self, frames: float, now: float, *, at_most: bool = False, grace_s: float = 0.0) -> bool:
        """A report of the viewer's buffer (see `Scheduler.observe_buffer`); True when it began a stall (of this
        figure for an `at_most` report, of `own` for an exact one).

        `at_most`: a report that crossed the network (the viewer's own) may be old: it lowers the model,
        never raises it, and leaves `own` as it was. Otherwise an exact report of the server's own (a
        WebRTC track's queue): both figures take it.
        `grace_s`: what the viewer holds beyond the reported frames (kept for later dry spells too).
        """
        self.grace_s = grace_s
        if self.own is not None and not at_most:
            self.own.grace_s = grace_s
        if at_most and not self.started:
            # nothing delivered in the model yet: the report can only hold frames it is about to be told of (the
            # viewer may hear of the first chunk before the scheduler does); taken as it was, the first chunk
            # counted twice and the stream's second chunk came late
            return False
        if at_most and not self.paused:
            self.advance(now)
            frames = min(frames, self.seconds(now) * self.fps)
        stalls, own = self.stalls, self.own or self
        own_stalls = own.stalls
        if at_most:
            self._set(frames, now)
            return self.stalls > stalls
        self.observe(frames, now)
        return own.stalls > own_stalls  # an exact report: did the server's own figure begin a stall

    def pause(self, now: float) -> None:
        """The viewer paused at `now`: nothing is consumed, and a dry spell in progress ends."""
        if self.own is not None:
            self.own.pause(now)
        self.advance(now)
        self._end_stall(now)
        self.paused = True

    def resume(self, now: float) -> None:
        """The viewer plays on from `now`."""
        if self.own is not None:
            self.own.resume(now)
        self.advance(now)
        self.paused = False

    def dry_at(self) -> float | None:
        """When the buffer runs (or ran) dry if nothing more arrives; None while not draining (pure)."""
        if self.dry_since is not None:
            return self.dry_since
        if not self.started or self.paused:
            return None
        return self.updated_at + self.buffered_frames / self.fps

    def seconds(self, now: float) -> float:
        """Buffered video at `now` in seconds (pure)."""
        dry_at = self.dry_at()
        if dry_at is None:
            return self.buffered_frames / self.fps
        return max(0.0, dry_at - max(now, self.updated_at))

    def stall_count(self, now: float) -> int:
        """Stalls begun by `now`, one in progress included (pure)."""
        dry_at = self.dry_at()
        starting = not self.dry_counted and dry_at is not None and now > dry_at and now - dry_at >= self.grace_s
        return self.stalls + (1 if starting else 0)

    def stall_seconds(self, now: float) -> float:
        """Stall time by `now`, one in progress included, each past its grace (pure)."""
        dry_at = self.dry_at()
        ongoing = 0.0 if dry_at is None else max(0.0, now - dry_at - self.grace_s)
        return self.closed_stall_s + ongoing

    def _count_dry(self, now: float) -> None:
        """The dry spell in progress becomes a stall once it has lasted grace_s."""
        if self.dry_since is not None and not self.dry_counted and now - self.dry_since >= self.grace_s:
            self.dry_counted = True
            self.stalls += 1

    def _end_stall(self, now: float) -> None:
        """The dry spell in progress ends at `now` (the caller has advanced to `now`, which counted it if due)."""
        if self.dry_since is not None:
            if self.dry_counted:
                self.closed_stall_s += max(0.0, now - self.dry_since - self.grace_s)
            self.dry_since, self.dry_counted = None, False
