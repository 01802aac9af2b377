"""One stream's input video timeline (issue 35): frames in from a transport, chunks' frames out to the engine.

`InputFrames` is fed by a transport (the WebSocket's H.264 upstream decoded server-side, the WebRTC camera track
through streamsvc/inputs/rtc.py, any thread) and read by the engine thread, one chunk at a time.

What it does to a frame (the lead's decisions, CONTRACT35.md):
- Scale: centre-CROP to the model's aspect, then scale to the model's frame size. Not letterboxed: bars would be
  restyled as content and the subject would shrink.
- Resample to the stream's fps by capture time: each frame goes to the frame slot of its capture time (the sender's
  clock, seconds). A newer frame replaces an older one in the same slot (the older is `dropped`); a slot with no
  frame repeats the previous frame (`repeated`). Output frame i is input slot i restyled: chunk c takes the slots
  [first_frame, first_frame + frames_in_chunk(c)).
- Capture times map to slots through an anchor: the first frame goes to the first slot not yet taken, and later ones
  by their capture time from it. The slots also have a nominal arrival time in this server's clock (the anchor
  frame's arrival + slot / fps); two frames in a row whose capture-time slot is more than `REANCHOR_S` off their
  arrival-time slot (a sender's clock that jumped, a new sender) re-anchor (one alone is a straggler). While paused,
  frames are dropped; after `resume` the next frame re-anchors at the first free slot.
- Phase: the stream's first frame goes to slot `phase` (the slots before it repeat it), not 0. Viewers that start
  together send cameras that start together, and every chunk of theirs would be released by its last frame at the
  same moment, all due input_latency_s later: the server gives each stream another phase (streamsvc/inputs/ws.py),
  so their releases spread over a chunk's duration instead of queueing behind one another. Glass-to-glass does not
  change (each chunk is still due input_latency_s after its own release); the first chunk shows `phase` repeats.
- Bounded memory: only slots in [cursor, cursor + max_frames) are held (cursor: the first slot the engine has not
  taken); a frame for a slot already taken (late) or beyond that window (a sender far ahead of real time) is
  dropped and counted. So at most `max_frames` frames are ever held, whatever a sender does.

When a chunk may start (the engine asks `released` and `missing_at`): once a frame has arrived for its last slot or
a later one (its release), or, with no frame for its slots by `missing_at`, its input is declared missing: `take`
returns None and the chunk runs as text-to-video; frames that come later for its slots are late. A chunk some of
whose slots arrived before the input stopped takes what came (the rest repeated).

`missing_at` (issue 41): a chunk that has not come whole is let go at the earlier of
- its last slot's nominal arrival (one frame after it) plus the wait the engine gives (`wait_s`, half the input
  latency), the rule for a stream whose viewer is not playing yet; and
- `release_by`, from the scheduler: when its viewer's buffer runs dry less what the chunk takes to reach it (its
  lead, and for a chunk with no frame the forwards of text-to-video: `Scheduler.release_by`), so that a chunk
  whose camera went off runs all its steps and is still on time (released at its last slot's time, as before,
  it had a quarter of a second left for text-to-video, was degraded or encoded cheaper, and closed admission);
but never before the camera is known to be quiet: the slot after its newest frame (or the chunk's first slot, if
that is later) is overdue by `wait_s`. Before that moment a live camera's next frame may still come, and a chunk
let go then would cut a live stream's input short; after it, waiting only spends the chunk's deadline. Where the
text-to-video chunk takes longer than the input latency (a slow model on its device) this lets the chunk go before
its last slot's nominal arrival, as soon as the camera is known to be quiet, never on a guess. Before the first
frame ever came, every time here is FIRST_FRAME_WAIT_S later (a camera that connects late still gives the first
chunk).

Capture times are echoed per frame (`capture_ms`, sender's clock, milliseconds) so the viewer computes
glass-to-glass latency in its own clock.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

log = logging.getLogger("streamsvc.inputs")

REANCHOR_S = 1.0  # a frame whose capture-time slot is this far off its arrival-time slot re-anchors the timeline
DEFAULT_MAX_FRAMES = 64  # frames held at most per stream (4 s at 16 fps: several chunks ahead of the engine)
# Before the camera's first frame, the stream waits this long for it (a WebRTC camera's first frame comes after
# offer/answer, ICE, DTLS and a keyframe: 0.5-1.5 s with 8 peers connecting at once on loopback) before its chunks
# run without input; the first frame then goes to the first free slot, whenever it comes.
FIRST_FRAME_WAIT_S = 5.0


@dataclass(frozen=True)
class TakenInput:
    """One chunk's input, taken by the engine."""

    frames: np.ndarray  # [N, H, W, 3] uint8, the model's frame size
    capture_ms: list[float]  # per frame: the capture time (sender's clock, ms) of the frame it shows (repeats too)
    filled: int  # slots of the chunk that had a frame of their own (the others repeat one)


@dataclass
class _Slot:
    frame: np.ndarray  # [H, W, 3] uint8, scaled
    capture_s: float  # sender's clock
    arrived_at: float  # this server's clock


@dataclass
class InputCounts:
    received: int = 0  # frames pushed (decoded ones, over any transport)
    dropped: int = 0  # frames not used: replaced in their slot, late, too far ahead, or pushed while paused
    repeated: int = 0  # output frames that repeat the previous input frame (a slot with no frame of its own)
    decode_errors: int = 0  # input the transport could not decode (garbage, a broken stream), and bad frames
    late: int = 0  # of `dropped`: frames for a slot the engine had already taken
    paused: int = 0  # of `dropped`: frames pushed while the stream was paused
    flood: int = 0  # of `dropped`: frames the transport dropped undecoded (beyond its flood bound)
    chunks: int = 0  # chunks taken with input frames
    missing_chunks: int = 0  # chunks taken with none (text-to-video)
    reanchors: int = 0  # times the capture clock was re-anchored (the first frame, a jump, a resume)


class InputFrames:
    """One stream's input timeline (see the module docstring). Thread-safe: transports push from any thread, the
    engine takes from its own."""

    def __init__(self, width: int, height: int, fps: float, *, clock: Callable[[], float] = time.monotonic,
                 max_frames: int = DEFAULT_MAX_FRAMES, notify: Callable[[], None] | None = None,
                 phase: int = 0) -> None:
        if width < 1 or height < 1 or not (fps > 0 and math.isfinite(fps)):
            raise ValueError(f"input frames need a size >= 1x1 and a finite fps > 0, got {width}x{height} at {fps}")
        if max_frames < 1:
            raise ValueError(f"max_frames={max_frames}: at least one frame must be held")
        self.width, self.height, self.fps = width, height, float(fps)
        self.clock = clock
        self.max_frames = max_frames
        if not 0 <= phase < max_frames:
            raise ValueError(f"phase={phase}: the first frame's slot must be in [0, max_frames={max_frames})")
        self.phase = phase  # the slot of the stream's first frame (the slots before it repeat it): see the docstring
        self.notify = notify  # called (from the pushing thread) when a frame reaches the slot the engine waits for
        self.counts = InputCounts()
        self._lock = threading.Lock()
        self._slots: dict[int, _Slot] = {}  # held frames by slot, all in [cursor, cursor + max_frames)
        self._cursor = 0  # the first slot not taken
        self._newest = -1  # the newest slot that has had a frame (taken or not)
        self._last: _Slot | None = None  # the frame of the newest slot taken (what a chunk's first empty slot repeats)
        self._anchor: tuple[float, int] | None = None  # (capture_s, slot) of the anchor frame; None: next one anchors
        self._origin = clock()  # this server's time of slot 0's nominal arrival
        self._off = 0  # frames in a row whose capture-time slot was far off their arrival-time slot
        self._waiting_for: int | None = None  # the slot whose frame releases the chunk the engine waits on
        self.paused = False
        self.closed = False
        self._work_s = 0.0  # decode and scale time of frames pushed since the last `take_work` (the INPUT stage)
        self._scaler = None  # this stream's av VideoReformatter (its swscale context is kept from frame to frame)
        # this server's clock (the engine's, time.monotonic) from which the viewer plays the stream's first chunk of
        # input frames (set by the engine at its release: release + input latency + (chunk - first chunk) / fps);
        # a transport that paces frames itself (a WebRTC track) holds the first frame until then. None: not yet
        self.play_from: float | None = None
        self._scale_lock = threading.Lock()

    # -- transports (any thread) ----------------------------------------------------------------

    def push_frame(self, frame: np.ndarray, capture_s: float) -> None:
        """One decoded frame ([H, W, 3] uint8 RGB, any size) captured at `capture_s` (the sender's clock, s)."""
        if not isinstance(frame, np.ndarray) or frame.dtype != np.uint8 or frame.ndim != 3 or frame.shape[2] != 3 \
                or frame.shape[0] < 1 or frame.shape[1] < 1:
            self.decode_error()
            return
        self._place(lambda: scale_crop(frame, self.width, self.height), capture_s)

    def push_av(self, frame, capture_s: float) -> None:
        """One `av.VideoFrame` (any size and pixel format) captured at `capture_s` (the sender's clock, s)."""
        self._place(lambda: self._scale_av(frame), capture_s)

    def _scale_av(self, frame) -> np.ndarray:
        with self._scale_lock:  # one swscale context per stream, kept: making one costs more than a scale
            if self.closed:  # it came as the stream closed and is dropped (`_place`): no context made past `close`
                return np.zeros((self.height, self.width, 3), np.uint8)
            if self._scaler is None:
                from av.video.reformatter import VideoReformatter

                self._scaler = VideoReformatter()
            return scale_crop_av(frame, self.width, self.height, self._scaler)

    def drop(self) -> None:
        """A frame the transport dropped undecoded (a flood): counted as received and dropped."""
        with self._lock:
            self.counts.received += 1
            self.counts.dropped += 1
            self.counts.flood += 1

    def add_work(self, seconds: float) -> None:
        """Time spent on this input (decoding, scaling): a sample of the input stage, per chunk, by `take_work`."""
        with self._lock:
            self._work_s += max(0.0, seconds)

    def decode_error(self) -> None:
        """The transport could not decode some input (counted; the stream goes on)."""
        with self._lock:
            self.counts.decode_errors += 1

    def _place(self, scaled: Callable[[], np.ndarray], capture_s: float) -> None:
        now = self.clock()
        if not math.isfinite(capture_s):
            self.decode_error()
            return
        with self._lock:
            self.counts.received += 1
            if self.closed or self.paused:
                self.counts.dropped += 1
                self.counts.paused += self.paused
                return
            slot = self._slot_of(capture_s, now)
            if slot < self._cursor or slot < self._newest - self.max_frames:
                self.counts.dropped += 1
                self.counts.late += 1
                return
            if slot >= self._cursor + self.max_frames:
                self.counts.dropped += 1
                return
        t0 = time.perf_counter()
        try:
            image = scaled()  # outside the lock: scaling is the costly part (PyAV releases the GIL)
            self.add_work(time.perf_counter() - t0)
        except Exception:  # noqa: BLE001 - a frame PyAV cannot convert is bad input, counted
            log.debug("an input frame could not be scaled", exc_info=True)
            self.decode_error()
            return
        wake = None
        with self._lock:
            if slot < self._cursor or self.closed or self.paused:  # taken (or paused) while it was scaled
                self.counts.dropped += 1
                self.counts.late += slot < self._cursor
                return
            if slot in self._slots:
                self.counts.dropped += 1  # the newer frame replaces it
            self._slots[slot] = _Slot(image, capture_s, now)
            self._newest = max(self._newest, slot)
            if self._waiting_for is not None and slot >= self._waiting_for:
                self._waiting_for, wake = None, self.notify
        if wake is not None:
            wake()

    def _slot_of(self, capture_s: float, now: float) -> int:
        """The slot of a frame captured at `capture_s` arriving `now` (the lock held); anchors when needed."""
        by_arrival = math.floor((now - self._origin) * self.fps)
        if self._anchor is not None:
            capture0, slot0 = self._anchor
            slot = slot0 + math.floor((capture_s - capture0) * self.fps + 0.5)
            if abs(slot - by_arrival) <= REANCHOR_S * self.fps + 1:
                self._off = 0
                return slot
            self._off += 1
            if self._off < 2:  # one frame off: a straggler (late, or one bad timestamp), taken by its capture time
                return slot
        self._off = 0
        if self.counts.reanchors == 0:  # the stream's first frame: at its phase (see `phase`), however late it came
            slot = self._cursor + self.phase
        else:  # a clock that jumped, a resume: the first free slot, or the slot of its arrival if that is later
            slot = max(self._cursor, by_arrival)
        self._anchor = (capture_s, slot)
        self._origin = now - slot / self.fps
        self.counts.reanchors += 1
        return slot

    # -- the engine (its thread) ----------------------------------------------------------------

    def released(self, first: int, n: int) -> bool:
        """Whether a frame has come for the last slot of the chunk [first, first + n) or a later one; if not, the
        next such frame calls `notify`."""
        with self._lock:
            last = first + n - 1
            if self._newest >= last:
                return True
            self._waiting_for = last
            return False

    def has_any(self, first: int, n: int) -> bool:
        """Whether any slot of the chunk [first, first + n) holds a frame."""
        with self._lock:
            return any(s in self._slots for s in range(first, first + n))

    def last_frame(self) -> np.ndarray | None:
        """The frame of the newest slot taken (what an empty slot would repeat); None after a gap or before any."""
        with self._lock:
            return None if self._last is None else self._last.frame

    def take_work(self) -> float:
        """The decode and scale time spent since the last call (and forget it)."""
        with self._lock:
            work, self._work_s = self._work_s, 0.0
            return work

    def missing_at(self, first: int, n: int, wait_s: float, release_by: float | None = None) -> float:
        """When the chunk [first, first + n)'s input counts as missing if no frame has come for its last slot (this
        server's clock; see the module docstring): that slot's nominal arrival (one frame after it) plus `wait_s`,
        or `release_by` (the latest release that reaches the viewer on time) if earlier, but not before the slot
        after the newest frame (or the chunk's first slot, if later) is overdue by `wait_s`. Before any frame has
        come, each of the timeline's times is FIRST_FRAME_WAIT_S later (a camera that connects late still gives the
        first chunk)."""
        with self._lock:
            first_wait = FIRST_FRAME_WAIT_S if self.counts.reanchors == 0 else 0.0
            nominal = self._origin + first_wait + (first + n) / self.fps + wait_s
            if release_by is None:
                return nominal
            quiet = self._origin + first_wait + max(self._newest + 1, first) / self.fps + wait_s
            return max(quiet, min(nominal, release_by))

    def take(self, first: int, n: int) -> TakenInput | None:
        """The chunk [first, first + n)'s frames, removed from the timeline (the cursor moves past them); None
        when none of its slots had a frame (its input is missing). A slot with no frame repeats the previous
        one (the chunk's first slot: the last frame taken before it, else the chunk's first frame)."""
        with self._lock:
            own = [self._slots.pop(s, None) for s in range(first, first + n)]
            for s in [s for s in self._slots if s < first + n]:  # earlier slots never taken (a chunk skipped)
                del self._slots[s]
                self.counts.dropped += 1
            self._cursor = max(self._cursor, first + n)
            if self._waiting_for is not None and self._waiting_for < self._cursor:
                self._waiting_for = None
            filled = sum(s is not None for s in own)
            if filled == 0:
                self.counts.missing_chunks += 1
                self._last = None  # the input stopped: a later chunk repeats nothing from before the gap
                return None
            prev = self._last or next(s for s in own if s is not None)
            slots = []
            for s in own:
                if s is None:
                    self.counts.repeated += 1
                    s = prev
                slots.append(s)
                prev = s
            self._last = prev
            self.counts.chunks += 1
        return TakenInput(np.stack([s.frame for s in slots]), [s.capture_s * 1000.0 for s in slots], filled)

    # -- the stream's life (any thread) ---------------------------------------------------------

    def pause(self) -> None:
        """The stream paused: frames pushed from now on are dropped (counted)."""
        with self._lock:
            self.paused = True
            self._slots.clear()

    def resume(self) -> None:
        """The stream plays on: the next frame re-anchors at the first free slot, which is due now."""
        with self._lock:
            self.paused = False
            self._anchor = None
            self._origin = self.clock() - self._cursor / self.fps

    def stop(self) -> None:
        """The input's sender is gone (a handover): what is held goes; frames that come again re-anchor."""
        with self._lock:
            self._slots.clear()
            self._anchor = None
            self._last = None

    def close(self) -> None:
        """The stream ended: nothing more is held or taken, and its swscale context goes now, with the threads it
        keeps (FFmpeg's swscale runs a pool of as many threads as the host has cores a context), not when a garbage
        collection finds the stream's objects: a session and its viewers refer to each other, and in a server
        whose heap is mostly the model's, a full collection is rare (each closed input stream kept its threads, 2
        on 2 cores, for as long as the soak ran: issue 46)."""
        with self._lock:
            self.closed = True
            self._slots.clear()
            self._last = None
        with self._scale_lock:  # after a scale under way
            self._scaler = None

    @property
    def held(self) -> int:
        """Frames held now (at most max_frames)."""
        with self._lock:
            return len(self._slots)

    def stats(self) -> dict:
        """The counts (received, dropped, repeated, decode_errors, late, paused, flood, chunks, missing_chunks,
        reanchors) and the frames held now."""
        with self._lock:
            c = self.counts
            return dict(received=c.received, dropped=c.dropped, repeated=c.repeated, decode_errors=c.decode_errors,
                        late=c.late, paused=c.paused, flood=c.flood, chunks=c.chunks, missing_chunks=c.missing_chunks,
                        reanchors=c.reanchors, held=len(self._slots))


# -- scaling: centre crop to the model's aspect, then scale --------------------------------------------


def crop_box(w: int, h: int, width: int, height: int) -> tuple[int, int, int, int]:
    """(x, y, cw, ch): the centred crop of a w x h image with the aspect of width x height (at least 1 x 1)."""
    if w * height > h * width:  # wider than the model: crop the sides
        cw, ch = max(1, round(h * width / height)), h
    else:  # taller: crop top and bottom
        cw, ch = w, max(1, round(w * height / width))
    return (w - cw) // 2, (h - ch) // 2, cw, ch


def scale_crop(frame: np.ndarray, width: int, height: int) -> np.ndarray:
    """[H, W, 3] uint8 -> [height, width, 3] uint8: centre-cropped to the aspect, then scaled (area average)."""
    h, w = frame.shape[:2]
    if (w, h) == (width, height):
        return np.ascontiguousarray(frame)
    x, y, cw, ch = crop_box(w, h, width, height)
    import av

    crop = av.VideoFrame.from_ndarray(np.ascontiguousarray(frame[y : y + ch, x : x + cw]), format="rgb24")
    return crop.reformat(width=width, height=height, format="rgb24", interpolation="AREA").to_ndarray()


def scale_crop_av(frame, width: int, height: int, reformatter=None) -> np.ndarray:
    """An av.VideoFrame (any size and format) -> [height, width, 3] uint8 RGB: scaled in one pass (swscale) to
    cover width x height with its own aspect, then centre-cropped. `reformatter`: an av VideoReformatter to reuse
    (its swscale context is cached while the sizes stay the same)."""
    w, h = frame.width, frame.height
    scale = max(width / w, height / h)
    sw, sh = max(width, math.ceil(w * scale - 1e-6)), max(height, math.ceil(h * scale - 1e-6))
    if reformatter is None:
        rgb = frame.reformat(width=sw, height=sh, format="rgb24", interpolation="AREA").to_ndarray()
    else:
        rgb = reformatter.reformat(frame, width=sw, height=sh, format="rgb24", interpolation="AREA").to_ndarray()
    x, y = (sw - width) // 2, (sh - height) // 2
    return np.ascontiguousarray(rgb[y : y + height, x : x + width])
