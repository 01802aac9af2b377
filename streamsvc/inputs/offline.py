"""`streamsvc generate --input FILE --strength S`: a video file as the stream's input (issue 35), offline; and
`generate --image FILE`'s start image (`read_image`).

The file is decoded with PyAV; each frame is centre-cropped to the model's aspect and scaled to its frame
size (streamsvc/inputs/frames.py `scale_crop_av`: not letterboxed, bars would be restyled as content), then
resampled to the stream's fps by its presentation time, as the live path does by capture time: output
slot i takes the frames whose time falls in [i / fps, (i + 1) / fps) from the first frame's, the newest
one winning (the others `dropped`); a slot with no frame repeats the previous one (`repeated`). Audio is
ignored. Chunk c gets the next `frames_in_chunk(c)` slots; once the file has ended, a chunk that still got
some of its slots repeats its last frame, and a chunk that got none runs as text-to-video (its input
`missing`).

The pixel cap of every input (streamsvc/inputs/bitstream.py, issue 41): a file whose video stream is over 1920x1080 (or
1920 a side) is refused before a frame is decoded, with a one-line error; a frame over it later in the file (a
stream that changes size) ends the input there, as the file's end would.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from streamsvc.inputs.bitstream import size_refusal
from streamsvc.inputs.frames import scale_crop_av


@dataclass
class InputCounts:
    decoded: int = 0  # frames decoded from the file
    dropped: int = 0  # frames replaced by a newer one in their slot (the file's fps above the stream's)
    repeated: int = 0  # slots with no frame of their own (the file's fps below the stream's, or gaps)
    slots: int = 0  # frames handed to the stream (the stream's fps)
    missing_chunks: int = 0  # chunks after the file's end: text-to-video
    refused: str | None = None  # why the input ended early (a frame over the pixel cap)
    padded: int = 0  # slots of the file's last chunk that repeat its last frame


class InputVideo:
    """A video file as a stream's input frames, `chunks` of them at a time (module doc)."""

    def __init__(self, path: str | Path, width: int, height: int, fps: float) -> None:
        import av

        self.path, self.width, self.height, self.fps = Path(path), width, height, fps
        self.counts = InputCounts()
        try:
            self._container = av.open(str(path))
        except (av.FFmpegError, OSError) as e:
            raise ValueError(f"cannot read the input video {path}: {e}") from e
        if not self._container.streams.video:
            self._container.close()
            raise ValueError(f"the input {path} has no video stream")
        video = self._container.streams.video[0].codec_context
        refusal = size_refusal(video.width, video.height, what=f"the input {Path(path).name}: a video")
        if refusal is not None:  # before a frame is decoded (or scaled)
            self._container.close()
            raise ValueError(f"{refusal}: scale it down first (e.g. ffmpeg -i IN -vf scale=-2:720 OUT)")
        self._slots = self._resampled()

    def close(self) -> None:
        self._container.close()

    def __enter__(self) -> InputVideo:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _decoded(self) -> Iterator[tuple[float, np.ndarray]]:
        """(seconds, [H, W, 3] uint8 at the model's size) of each decoded frame, in decode order."""
        import av

        stream = self._container.streams.video[0]
        reformatter = av.video.reformatter.VideoReformatter()
        last = -math.inf
        for frame in self._container.decode(stream):
            refusal = size_refusal(frame.width, frame.height, what=f"the input {self.path.name}: a frame")
            if refusal is not None:
                self.counts.refused = refusal
                print(f"streamsvc generate: {refusal}; its input ends here", file=sys.stderr)
                return
            t = float(frame.time) if frame.time is not None else (last + 1 / self.fps if last > -math.inf else 0.0)
            last = t
            self.counts.decoded += 1
            yield t, scale_crop_av(frame, self.width, self.height, reformatter)

    def _resampled(self) -> Iterator[np.ndarray]:
        """The file's frames at the stream's fps, one per slot, until the file ends."""
        t0, slot, pending = None, 0, None
        for t, frame in self._decoded():
            if t0 is None:
                t0 = t
            s = max(slot, math.floor((t - t0) * self.fps + 1e-6))  # a frame out of order goes to the current slot
            if pending is not None and s == slot:
                self.counts.dropped += 1  # a newer frame in the same slot
            elif pending is not None:
                yield pending
                for _ in range(s - slot - 1):  # slots with no frame of their own repeat the previous one
                    self.counts.repeated += 1
                    yield pending
            pending, slot = frame, s
        if pending is not None:
            yield pending

    def chunk(self, n: int) -> torch.Tensor | None:
        """The next `n` slots as [n, H, W, 3] uint8; None once the file has ended (no slot left)."""
        frames = []
        for frame in self._slots:
            frames.append(frame)
            if len(frames) == n:
                break
        if not frames:
            self.counts.missing_chunks += 1
            return None
        self.counts.padded += n - len(frames)
        frames += [frames[-1]] * (n - len(frames))
        self.counts.slots += len(frames)
        return torch.from_numpy(np.stack(frames))

    def summary(self) -> str:
        c = self.counts
        return (f"input {self.path.name}: {c.decoded} frames decoded, {c.slots} at {self.fps:g} fps "
                f"({c.dropped} dropped, {c.repeated} repeated, {c.padded} padded at its end), "
                f"{c.missing_chunks} chunks after its end as text-to-video"
                + (f"; it ended early: {c.refused}" if c.refused else ""))


def open_input(gen, path: str | None, strength: float, fps: float) -> InputVideo | None:
    """`generate --input`'s video for `gen` (None without one); a ValueError that says why when the model takes
    no input, the strength is out of range or the file cannot be read. Logs the snapped strength."""
    if path is None:
        return None
    if not gen.can_take_input:
        raise ValueError("--input needs a model with an encoder (video-to-video); this model has none "
                         "(a TAEHV file without its encoder.* weights, or a parallel group)")
    snapped = gen.input_strengths()[gen.start_step(strength)]
    print(f"strength {strength:g} snaps to {snapped:.3f}, the schedule's step {gen.start_step(strength)} "
          f"(strengths: {', '.join(f'{s:.3f}' for s in gen.input_strengths())})", file=sys.stderr)
    mc = gen.model_cfg
    return InputVideo(path, mc.width, mc.height, fps)


def read_image(path: str | Path, width: int, height: int) -> torch.Tensor:
    """`generate --image`'s start image: the file's first picture (PNG, JPEG: what PyAV decodes), centre-cropped and
    scaled to the model's frame size as an input video's frames are -> [height, width, 3] uint8 RGB; a ValueError
    that says why when the file cannot be read or its picture is over the pixel cap."""
    import av

    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise ValueError(f"the image {path} has no picture")
            video = container.streams.video[0].codec_context
            refusal = size_refusal(video.width, video.height, what=f"the image {Path(path).name}")
            if refusal is not None:
                raise ValueError(f"{refusal}: scale it down first")
            frame = next(container.decode(video=0), None)
    except (av.FFmpegError, OSError) as e:
        raise ValueError(f"cannot read the image {path}: {e}") from e
    if frame is None:
        raise ValueError(f"the image {path} has no picture")
    return torch.from_numpy(scale_crop_av(frame, width, height))
