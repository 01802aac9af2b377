"""`streamsvc generate`: one stream, written to an H.264 MP4 file."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import av
import numpy as np
import torch

from models import ChunkGenerator
from streamsvc.progress import Progress


@dataclass(frozen=True)
class PromptChange:
    at_s: float  # seconds into the video
    prompt: str

    @classmethod
    def parse(cls, text: str) -> PromptChange:
        at, sep, prompt = text.partition(":")
        try:
            seconds = float(at)
        except ValueError:
            seconds = -1.0
        if not sep or seconds < 0 or not prompt.strip():
            raise ValueError(f"--prompt-at wants SECONDS:TEXT with SECONDS >= 0, got {text!r}")
        return cls(seconds, prompt.strip())


def chunk_for_time(gen: ChunkGenerator, seconds: float, fps: float) -> int:
    """Index of the first chunk that starts at or after `seconds`."""
    frame, start, index = seconds * fps, 0, 0
    while start < frame:
        start += gen.frames_in_chunk(index)
        index += 1
    return index


def generate_video(
    gen: ChunkGenerator,
    prompt: str,
    seconds: float,
    fps: int,
    seed: int,
    out: Path,
    changes: list[PromptChange] = (),
    progress: bool = True,
    strip: Path | None = None,
    strip_every: int = 8,
) -> int:
    """Generate `seconds` of video and write it; returns the number of frames written. With `strip`, also
    write every `strip_every`-th frame (from the first) side by side as one PNG (`write_strip`)."""
    total = max(1, math.ceil(seconds * fps))
    state = gen.open_stream("offline", prompt, seed)
    prompt_at = {chunk_for_time(gen, c.at_s, fps): c.prompt for c in sorted(changes, key=lambda c: c.at_s)}
    bar = Progress(total, "frames") if progress else None
    mc = gen.model_cfg
    written = 0
    picked = []  # [H, W, 3] uint8 frames for the strip
    with av.open(str(out), mode="w") as container:
        vs = container.add_stream("libx264", rate=fps)
        vs.width, vs.height, vs.pix_fmt = mc.width, mc.height, "yuv420p"
        vs.options = {"crf": "18", "preset": "veryfast"}
        for chunk in gen.stream(state, prompt_at):
            for i, rgb in enumerate(chunk.frames[: total - written].cpu().numpy()):
                if strip is not None and (written + i) % strip_every == 0:
                    picked.append(rgb)
                frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
                for packet in vs.encode(frame):
                    container.mux(packet)
            n = min(chunk.frames.shape[0], total - written)
            written += n
            if bar:
                bar.update(n)
            if written >= total:
                break
        for packet in vs.encode():
            container.mux(packet)
    if bar:
        bar.close()
    if strip is not None:
        write_strip(picked, strip)
    return written


STRIP_GAP = 2  # pixels of white between the frames of a strip


def write_strip(frames: list[np.ndarray], path: Path) -> None:
    """Frames [H, W, 3] uint8 side by side, `STRIP_GAP` white pixels apart, as one PNG (PyAV's png encoder)."""
    if not frames:
        raise ValueError("a strip needs at least one frame")
    h, w, _ = frames[0].shape
    out = np.full((h, len(frames) * (w + STRIP_GAP) - STRIP_GAP, 3), 255, np.uint8)
    for i, f in enumerate(frames):
        out[:, i * (w + STRIP_GAP) : i * (w + STRIP_GAP) + w] = f
    ctx = av.CodecContext.create("png", "w")
    ctx.width, ctx.height, ctx.pix_fmt = out.shape[1], out.shape[0], "rgb24"
    packets = ctx.encode(av.VideoFrame.from_ndarray(out, format="rgb24")) + ctx.encode(None)
    Path(path).write_bytes(b"".join(bytes(p) for p in packets))


def default_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)
