"""`streamsvc generate`: one stream, written to an H.264 MP4 file."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import av
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
) -> int:
    """Generate `seconds` of video and write it; returns the number of frames written."""
    total = max(1, math.ceil(seconds * fps))
    state = gen.open_stream("offline", prompt, seed)
    prompt_at = {chunk_for_time(gen, c.at_s, fps): c.prompt for c in sorted(changes, key=lambda c: c.at_s)}
    bar = Progress(total, "frames") if progress else None
    mc = gen.model_cfg
    written = 0
    with av.open(str(out), mode="w") as container:
        vs = container.add_stream("libx264", rate=fps)
        vs.width, vs.height, vs.pix_fmt = mc.width, mc.height, "yuv420p"
        vs.options = {"crf": "18", "preset": "veryfast"}
        for chunk in gen.stream(state, prompt_at):
            for rgb in chunk.frames[: total - written].cpu().numpy():
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
    return written


def default_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)
