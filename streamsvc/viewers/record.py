"""Recording a stream: its encoded packets muxed into MP4 as they are sent, a chapter per prompt.

No re-encode: the access units the viewers get (H.264 Annex-B, SPS/PPS before each IDR) go into
the MP4 as they are. The track is a mux-only stream (no codec context: an encoder opened for it
would write its own SPS/PPS as the track's configuration, e.g. High profile for a Constrained
Baseline stream); with no extradata given, FFmpeg's MP4 muxer takes the first packet, the IDR
with its SPS/PPS, as the track's configuration (avcC), and turns every access unit into
length-prefixed samples. A recording starts at a keyframe chunk (the server asks the encoder for
one when recording starts) and its clock starts there at 0. Every IDR (at a chunk's start or in
its middle) is a sync sample, so a player seeks to it.
Each prompt is a chapter, written into the MP4 and into a WebVTT chapters file beside it
(``NAME.vtt``), which a page lists with ``<track kind="chapters">``. The MP4 is finished when
the recording closes (the stream ended, or the disk budget ran out, which closes it at once):
its index goes at the front (faststart), so a browser plays it as it downloads. Until then the
file has no index and does not play.

A recording's link is a capability: its files are named ``ID-SECRET.mp4`` and ``ID-SECRET.vtt`` (the
recording's NAME), where ID is ``{stream id}-{UTC time}`` and SECRET 128 random bits of its own (32 hex digits,
apart from the stream's watch and steer secrets), so the name is the link (``<video src>``, ``<track src>``, the
recording page's ``#id=NAME``) and it outlives a restart. A request is served only with the secret of a known
recording, compared in constant time; any other name is the same "not found". Files of other names (earlier
versions' ``ID.mp4``) count against the disk budget and are never served.

`RecordingStore` owns the directory and the disk budget; `Recorder` is one stream's recording.
Neither is thread-safe: one thread (the server's event loop) uses them.
"""

from __future__ import annotations

import logging
import re
import secrets
import time
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import av

from kvcache.units import format_bytes
from streamsvc.door.access import SECRET_BYTES, secret_matches
from streamsvc.wire.protocol import Chunk

log = logging.getLogger("streamsvc.record")

_FILE = re.compile(r"^[A-Za-z0-9_-]+\.(mp4|vtt)$")  # a recording's file (counted against the budget)
# what GET /recordings/NAME.mp4 (.vtt) may name: a recording's id and its secret
_LINK = re.compile(r"^(?P<id>[A-Za-z0-9_-]+)-(?P<secret>[0-9a-f]{32})\.(mp4|vtt)$")
_START_CODE = re.compile(b"\x00\x00\x01")
_IDR, _SPS, _PPS = 5, 7, 8  # H.264 NAL unit types
_STREAM_ID = re.compile(r"[A-Za-z0-9_-]+")  # what a recording id is made of (the stream id, a time stamp)


class RecordingRefused(Exception):
    """A recording that may not start; the message says why and what to do, for the viewer."""


@dataclass
class _Chapter:
    start: int  # first frame, counted from the recording's start
    end: int  # one past its last frame
    title: str  # the prompt


class Recorder:
    """One stream's recording. `add` each chunk as it is sent, `close` when the stream ends (always)."""

    def __init__(self, store: RecordingStore, recording_id: str, fps: int, width: int, height: int) -> None:
        self.store = store
        self.recording_id = recording_id  # "{stream id}-{UTC time}": what logs and messages name it by
        self.secret = secrets.token_hex(SECRET_BYTES)  # its link's own secret (32 hex digits: 128 bits)
        self.name = f"{recording_id}-{self.secret}"  # its files' name and its link's: ID-SECRET.mp4, ID-SECRET.vtt
        self.fps, self.width, self.height = fps, width, height
        self.path = store.directory / f"{self.name}.mp4"
        self.chapters_path = store.directory / f"{self.name}.vtt"
        self.bytes_written = 0  # sample bytes muxed so far (what the budget counts; the index adds little)
        self.frames = 0  # frames muxed
        self.stopped_reason: str | None = None  # set when it stopped before its stream ended (the disk budget)
        self.chapters: list[_Chapter] = []
        self._container: av.container.OutputContainer | None = None  # opened at the first keyframe chunk
        self._stream = None
        self._first_pts: int | None = None  # stream index of the first recorded frame
        self._closed = False

    def add(self, header: Chunk, access_units: list[bytes], prompt: str) -> bool:
        """Mux one chunk (its header and access units as sent) made under `prompt`. Chunks before the first
        keyframe chunk are skipped. False when the recording has stopped (closed, or the budget is reached)."""
        if self._closed or self.stopped_reason is not None:
            return False
        if self._container is None and not header.keyframe:
            return True  # waits for a keyframe to start at
        size = sum(len(au) for au in access_units)
        if not self.store.reserve(size):
            self.stopped_reason = (
                f"recording {self.recording_id} stopped at {self.frames / self.fps:.1f} s: the recordings use "
                f"{format_bytes(self.store.used_bytes)} of their {format_bytes(self.store.max_bytes)} "
                "(--record-max-gib); delete old recordings or raise the limit")
            log.warning(self.stopped_reason)
            self.close()  # what was written plays from now on
            return False
        if self._container is None:
            self._open(access_units[0], header.pts)
        first = header.pts - self._first_pts
        if not self.chapters or self.chapters[-1].title != prompt:
            self.chapters.append(_Chapter(first, first, prompt))
            self._write_chapters()
        for i, au in enumerate(access_units):
            packet = av.Packet(au)
            packet.pts = packet.dts = first + i
            packet.duration = 1
            packet.time_base = Fraction(1, self.fps)  # the muxer rescales to its own (it picks the timescale)
            packet.is_keyframe = _IDR in _nal_types(au)  # a sync sample (stss) wherever the encoder put an IDR
            packet.stream = self._stream
            self._container.mux(packet)
        self.bytes_written += size
        self.frames = first + len(access_units)
        self.chapters[-1].end = self.frames
        return True

    def close(self) -> None:
        """Finish the MP4 (chapters, index at the front) and the chapters file. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._container is None:  # never started (no keyframe came, or its first chunk did not fit): no file
            self.store.finished(self)
            return
        try:
            self._container.set_chapters([
                {"id": i + 1, "start": c.start, "end": c.end, "time_base": Fraction(1, self.fps),
                 "metadata": {"title": c.title}}
                for i, c in enumerate(self.chapters)
            ])
            self._write_chapters()
        finally:
            try:
                self._container.close()  # the trailer: chapters, the index moved to the front
            finally:
                self.store.finished(self)  # counted from the disk from now on, even if the trailer failed
        log.info("recording %s: %d frames (%.1f s), %d chapters, %.1f MB", self.recording_id, self.frames,
                 self.frames / self.fps, len(self.chapters), self.path.stat().st_size / 1e6)

    def _open(self, idr: bytes, pts: int) -> None:
        if not {_SPS, _PPS} <= set(_nal_types(idr)):
            raise ValueError(f"recording {self.recording_id}: the keyframe chunk's first access unit has no SPS/PPS")
        container = av.open(str(self.path), "w", format="mp4", options={"movflags": "+faststart"})
        # no codec context, no extradata: the muxer makes the avcC of this first packet's SPS/PPS (module docstring)
        stream = container.add_mux_stream("h264", rate=self.fps, width=self.width, height=self.height,
                                          time_base=Fraction(1, self.fps))
        self._container, self._stream, self._first_pts = container, stream, pts

    def _write_chapters(self) -> None:
        """The chapters as WebVTT (one cue per prompt), rewritten whole: it is small."""
        lines = ["WEBVTT", ""]
        for i, c in enumerate(self.chapters):
            end = c.end if c.end > c.start else c.start + 1
            lines += [f"chapter-{i + 1}", f"{_vtt_time(c.start / self.fps)} --> {_vtt_time(end / self.fps)}",
                      _vtt_text(c.title), ""]
        self.chapters_path.write_text("\n".join(lines), encoding="utf-8")


class RecordingStore:
    """The recordings' directory and disk budget: hands out recorders, finds recordings by name."""

    def __init__(self, directory: Path, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes={max_bytes}: recordings need a disk budget > 0")
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self._known: dict[str, str] = {}  # recording id -> its secret: those made by this store or in the directory
        self._stored = 0  # bytes of the finished recordings' files, as of the last scan (or finished() since)
        self._active: dict[str, Recorder] = {}  # recordings being written, by id (counted by bytes_written)

    def table_sizes(self) -> dict[str, int]:
        """Its tables' entries (see Server.table_sizes): recordings being written, and those it knows (made here or
        found in the directory: as many as the directory holds, and those being written)."""
        return {"recordings.active": len(self._active), "recordings.known": len(self._known)}

    @property
    def used_bytes(self) -> int:
        """Disk the recordings use: those finished (from earlier runs too, as the directory holds them now: deleting
        old ones frees their share) and those being written."""
        self._scan()
        return self._active_bytes()

    def open(self, stream_id: str, fps: int, width: int, height: int) -> Recorder:
        """A new recording of `stream_id`; raises RecordingRefused when the recordings fill their budget."""
        if not _STREAM_ID.fullmatch(stream_id):
            raise ValueError(f"stream id {stream_id!r}: a recording's id is made of letters, digits, '-' and '_'")
        used = self.used_bytes
        if used >= self.max_bytes:
            raise RecordingRefused(
                f"cannot record: the recordings use {format_bytes(used)} of their {format_bytes(self.max_bytes)} "
                "(--record-max-gib); delete old recordings or raise the limit")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RecordingRefused(f"cannot record: the recordings directory {self.directory}: {e.strerror}") from None
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        base = recording_id = f"{stream_id}-{stamp}"
        for n in range(2, 1000):
            if recording_id not in self._known:  # (the directory was scanned just now, by used_bytes)
                break
            recording_id = f"{base}-{n}"
        recorder = Recorder(self, recording_id, fps, width, height)
        self._known[recording_id] = recorder.secret
        self._active[recording_id] = recorder
        return recorder

    def reserve(self, size: int) -> bool:
        """Whether `size` more bytes fit the budget (the caller writes them if so). Uses the last scan of the
        directory (at open, or a read of used_bytes): it is asked at every chunk."""
        return self._active_bytes() + size <= self.max_bytes

    def finished(self, recorder: Recorder) -> None:
        self._active.pop(recorder.recording_id, None)
        for path in (recorder.path, recorder.chapters_path):
            if path.exists():
                self._stored += path.stat().st_size

    def path(self, name: str) -> Path | None:
        """The file a request names (``ID-SECRET.mp4`` or ``.vtt`` of a recording here, with its secret), or None
        for any other name: no such recording, a wrong secret or none (the caller answers each alike)."""
        self._scan()
        recording_id = self._linked(name)
        if recording_id is None:
            return None
        target = self.directory / name
        return target if target.is_file() else None

    def in_progress(self, name: str) -> bool:
        """Whether the recording a request names (``ID-SECRET.mp4`` or ``.vtt``, with its secret) is still being
        written; False for a name without the right secret."""
        recording_id = self._linked(name)
        return recording_id is not None and recording_id in self._active

    def _linked(self, name: str) -> str | None:
        """The id of the recording whose link ``name`` is (its secret compared in constant time), or None."""
        link = _LINK.fullmatch(name)
        if link is None:
            return None
        recording_id = link["id"]
        return recording_id if secret_matches(self._known.get(recording_id), link["secret"]) else None

    def _active_bytes(self) -> int:
        return self._stored + sum(r.bytes_written for r in self._active.values())

    def _scan(self) -> None:
        """Count the finished recordings in the directory (earlier runs' too) as it is now, and know those it holds
        and those being written, no others: a recording deleted from the directory is forgotten (over a long run
        the recordings made would otherwise all stay known)."""
        stored = 0
        known = {recording_id: recorder.secret for recording_id, recorder in self._active.items()}
        try:
            entries = list(self.directory.iterdir())
        except OSError:  # no directory yet (made at the first recording), or unreadable
            entries = []
        for path in entries:
            link = _LINK.fullmatch(path.name)
            if _FILE.fullmatch(path.name) and not (link and link["id"] in self._active):
                try:
                    size = path.stat().st_size if path.is_file() else None
                except OSError:  # deleted meanwhile
                    size = None
                if size is not None:
                    if link is not None:
                        known.setdefault(link["id"], link["secret"])
                    stored += size
        self._stored, self._known = stored, known


def _nal_units(access_unit: bytes) -> list[bytes]:
    """The NAL units of an Annex-B access unit, without start codes."""
    starts = [m.end() for m in _START_CODE.finditer(access_unit)]
    units = []
    for i, start in enumerate(starts):
        end = starts[i + 1] - 3 if i + 1 < len(starts) else len(access_unit)
        units.append(access_unit[start:end].rstrip(b"\x00") if i + 1 < len(starts) else access_unit[start:end])
    return units


def _nal_types(access_unit: bytes) -> list[int]:
    return [nal[0] & 0x1F for nal in _nal_units(access_unit) if nal]


def _vtt_time(seconds: float) -> str:
    ms = round(seconds * 1000)
    return f"{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d}.{ms % 1000:03d}"


def _vtt_text(text: str) -> str:
    """A cue's text: one line, with the characters WebVTT reserves escaped."""
    text = " ".join(text.split())
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
