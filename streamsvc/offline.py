"""`streamsvc generate`: one stream, written to an H.264 MP4 file."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import av
import numpy as np
import torch

from models import ChunkGenerator
from models.stream import Chunk
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


def chunk_for_time(gen: ChunkGenerator, seconds: float, fps: float, image: bool = False) -> int:
    """Index of the first chunk that starts at or after `seconds` (`image`: the stream's chunk 0 is its start
    image's one frame)."""
    frame, start, index = seconds * fps, 0, 0
    while start < frame:
        start += 1 if image and index == 0 else gen.frames_in_chunk(index)
        index += 1
    return index


def video_chunks(gen: ChunkGenerator, prompt: str, seconds: float, fps: int, seed: int,
                 changes: list[PromptChange] = (), inputs=None, strength: float = 1.0,
                 image: torch.Tensor | None = None) -> Iterator[tuple[Chunk, int]]:
    """The generator calls of `seconds` of one stream, as (chunk, frames of it the video keeps). Every
    rank of a group (`streamsvc generate --parallel K`) runs this, so they make the same calls. `inputs`:
    the input video (streamsvc/inputs/offline.py `InputVideo`), each chunk's frames restyled at `strength`.
    `image`: the start image ([H, W, 3] uint8), the stream's first frame (`ChunkGenerator.start_from_image`)."""
    total = max(1, math.ceil(seconds * fps))
    state = gen.open_stream("offline", prompt, seed, input_kind="video" if inputs is not None else "image" if image is not None else None)
    prompt_at = {chunk_for_time(gen, c.at_s, fps, image is not None): c.prompt for c in sorted(changes, key=lambda c: c.at_s)}
    if inputs is not None:  # between chunks: before the first, and after each commit
        gen.set_strength(state, strength)
        gen.set_input(state, inputs.chunk(gen.frames_in_chunk(0)))
    written = 0
    if image is not None:
        if 0 in prompt_at:  # a change at 0 s is the image's prompt
            gen.set_prompt(state, prompt_at.pop(0))
        yield gen.start_from_image(state, image), 1
        written = 1
        if written >= total:
            return
    for chunk in gen.stream(state, prompt_at):
        n = min(chunk.frames.shape[0], total - written)
        written += n
        yield chunk, n
        if written >= total:
            return
        if inputs is not None:
            gen.set_input(state, inputs.chunk(gen.frames_in_chunk(state.chunks_done)))


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
    dump: Path | None = None,
    inputs=None,
    strength: float = 1.0,
    image: torch.Tensor | None = None,
) -> int:
    """Generate `seconds` of video and write it; returns the number of frames written. With `strip`, also
    write every `strip_every`-th frame (from the first) side by side as one PNG (`write_strip`). With
    `dump`, also save every chunk's clean latents and decoded frames (torch.save: {"latents": [chunks, C,
    F, h, w], "frames": [N, H, W, 3] uint8}), which is what tests compare exactly."""
    total = max(1, math.ceil(seconds * fps))
    bar = Progress(total, "frames") if progress else None
    mc = gen.model_cfg
    written = 0
    picked = []  # [H, W, 3] uint8 frames for the strip
    latents, frames = [], []  # for `dump`
    with av.open(str(out), mode="w") as container:
        vs = container.add_stream("libx264", rate=fps)
        vs.width, vs.height, vs.pix_fmt = mc.width, mc.height, "yuv420p"
        vs.options = {"crf": "18", "preset": "veryfast"}
        for chunk, n in video_chunks(gen, prompt, seconds, fps, seed, changes, inputs, strength, image):
            kept = chunk.frames[:n].cpu()
            if dump is not None:
                latents.append(chunk.latents.cpu())
                frames.append(kept)
            for i, rgb in enumerate(kept.numpy()):
                if strip is not None and (written + i) % strip_every == 0:
                    picked.append(rgb)
                frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
                for packet in vs.encode(frame):
                    container.mux(packet)
            written += n
            if bar:
                bar.update(n)
        for packet in vs.encode():
            container.mux(packet)
    if bar:
        bar.close()
    if strip is not None:
        write_strip(picked, strip)
    if dump is not None:
        torch.save({"latents": torch.stack(latents), "frames": torch.cat(frames)}, dump)
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


def generate_parallel(args, changes: list[PromptChange], strip: Path | None, generator_args: Callable) -> int:
    """`streamsvc generate --parallel K`: this process is rank 0 of a group of K (streamsvc/engine/group.py); it
    encodes the prompts, decodes the chunks and writes the file; ranks 1..K-1 make the same generator
    calls (`video_chunks`) on their shard. Returns the exit code: 2 for a bad K or flag (before any rank
    is spawned), 1 when the group fails (a rank died or hung: within --parallel-timeout).
    generator_args(args, device) -> (device, build_generator's keywords) (the CLI's, picklable by name)."""
    from models.parallel import build_base, check_degree, shard_generator
    from streamsvc.engine.group import Group, GroupConfig, GroupError, group_devices

    try:
        cfg = GroupConfig(args.parallel, group_devices(args.device, args.parallel, args.devices), args.parallel_timeout)
        device, kw = generator_args(args, cfg.devices[0])
        if device.type == "cuda":
            torch.cuda.set_device(device)
        base = build_base(args.preset, **kw)
        check_degree(base.model_cfg, cfg.size)
    except (ValueError, OSError) as e:
        print(f"streamsvc generate: {e}", file=sys.stderr)
        return 2
    video = (args.prompt, args.seconds, args.fps, args.seed, list(changes))
    try:
        group = Group(cfg, _generate_rank, (args, video, generator_args))
        gen = shard_generator(base, kw["cfg"], group.group, root_only=True)
        group.wait_ready()  # the workers' generators built: a rank gone at start-up is a GroupError at once
    except GroupError as e:  # the workers are killed
        print(f"streamsvc generate: {e}", file=sys.stderr)
        return 1
    ok = False
    try:
        n = generate_video(gen, *video[:4], Path(args.output), video[4], not args.quiet, strip=strip,
                           strip_every=args.strip_every, dump=Path(args.dump) if args.dump else None)
        ok = True
    except (RuntimeError, GroupError) as e:  # a collective failed or timed out (DistBackendError is a RuntimeError)
        print(f"streamsvc generate: {group.describe_failure(e)}", file=sys.stderr)
        return 1
    finally:
        group.close(kill=not ok)
    print(f"wrote {n} frames ({gen.model_cfg.width}x{gen.model_cfg.height}, {args.fps} fps, H.264) to {args.output} "
          f"with {cfg.size} ranks ({', '.join(cfg.devices)})")
    if strip is not None:
        print(f"wrote a strip of frames 0, {args.strip_every}, ... to {strip}")
    return 0


def _generate_rank(rank: int, group, device: str, args, video: tuple, generator_args: Callable) -> None:
    """Rank 1..K-1 of `generate_parallel`: the same generator calls on its shard, nothing written."""
    from models.parallel import build_worker_generator
    from streamsvc.engine.group import worker_ready

    _, kw = generator_args(args, device)
    gen = build_worker_generator(args.preset, group=group, **kw)
    worker_ready(group)
    for _ in video_chunks(gen, *video):
        pass
