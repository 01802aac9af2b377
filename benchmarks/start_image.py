"""Does the built-in model continue from a start image? Causal image-to-video, read off its pixels by client/pixels.py.

Each case is an image drawn here: a shape on a flat background in colours of this benchmark's own (none of
models/scenes.py's palette), off-centre, and a prompt naming the shape, a motion and the palette colour
client/pixels.py finds nearest the object's (as the model's captions name one). A stream starts from the image
(`ChunkGenerator.start_from_image`: its latent frame 0, committed as context) and runs `--frames` video frames
more, at each chunk size of `--chunk-sizes` (latent frames per chunk), for `--seeds` noise seeds. Per stream:

- first frame: the PSNR of the stream's first frame (decoded from the image's latent) against the image;
- moves as the prompt says: in each window of 12 frames after the image (one chunk of 3 latent frames, three
  of 1), the direction client/pixels.py reads off the object's centres (`velocity`, `motion`) is the prompt's;
- continues from the image: the distance from the image's object centre to frame 1's (wrap-aware; a frame
  with no object counts as a window's miss and is left out of the distance);
- keeps the image's look: the RGB distance of frames 1..'s object (the median of the pixels far from the
  border's median) and background (that median) from the image's.

FIRST_FRAME_DB and MOVES_SHARE are the targets: the first frame at least 25 dB against the image, and the
prompt's motion in at least 90 % of the windows. LOOK_RGB is this benchmark's own: a model that keeps what the
image shows keeps its object's and background's colours within that mean RGB distance (one that snaps them to
its palette is 47-259 off for these colours).

    python benchmarks/start_image.py                      # the shipped weights, chunk sizes 3 and 1, 4 seeds
    python benchmarks/start_image.py --weights runs/tiny/tiny.safetensors --seeds 2

Prints a table and progress; ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from client import pixels  # noqa: E402
from models import GeneratorConfig, build_generator  # noqa: E402

FIRST_FRAME_DB = 25.0  # the first frame's PSNR against the image, at least
MOVES_SHARE = 0.9  # windows whose motion is the prompt's, at least
LOOK_RGB = 40.0  # mean RGB distance of the object's and the background's colours from the image's, at most
WINDOW = 12  # video frames per motion reading: a chunk of 3 latent frames
DIRECTIONS = {"right": (1, 0), "left": (-1, 0), "up": (0, -1), "down": (0, 1)}


@dataclass(frozen=True)
class Case:
    """A start image and the motion its prompt asks for."""

    name: str
    shape: str  # square | ball | triangle (apex up)
    half: int  # half the shape's extent, px
    colour: tuple[int, int, int]  # the object's RGB
    background: tuple[int, int, int]
    centre: tuple[int, int]  # the object's centre (x, y), px
    motion: str  # a key of DIRECTIONS

    @property
    def prompt(self) -> str:
        return f"a {pixels.nearest(self.colour)} {self.shape} moving {self.motion}"

    def image(self, height: int, width: int) -> np.ndarray:
        """[H, W, 3] uint8: the shape at `centre` on the background."""
        ys, xs = np.mgrid[0:height, 0:width] + 0.5
        dx, dy = xs - self.centre[0], ys - self.centre[1]
        r = self.half
        inside = {"square": (abs(dx) <= r) & (abs(dy) <= r), "ball": dx**2 + dy**2 <= r**2,
                  "triangle": (abs(dy) <= r) & (2 * abs(dx) <= dy + r)}[self.shape]
        out = np.empty((height, width, 3), np.uint8)
        out[:] = self.background
        out[inside] = self.colour
        return out


CASES = (
    Case("teal square on beige, right", "square", 14, (20, 170, 160), (235, 215, 175), (40, 80), "right"),
    Case("pink ball on navy, down", "ball", 13, (240, 110, 170), (30, 40, 90), (88, 36), "down"),
    Case("olive triangle on lavender, left", "triangle", 15, (120, 130, 20), (200, 190, 235), (96, 90), "left"),
    Case("brown square on light cyan, up", "square", 12, (130, 70, 30), (160, 225, 230), (30, 44), "up"),
)


@dataclass(frozen=True)
class Result:
    case: str
    chunk_size: int
    seed: int
    psnr_db: float  # the first frame against the image
    windows: int  # windows of WINDOW frames after the image
    moves: float  # share of them whose motion is the prompt's
    speed_px: float  # median step along the prompt's direction, px a frame (NaN: no object read)
    start_offset_px: float  # frame 1's object centre from the image's (NaN: no object in frame 1)
    object_rgb_error: float  # mean RGB distance of frames 1..'s object colour from the image's (NaN: no object)
    background_rgb_error: float  # mean RGB distance of frames 1..'s background from the image's
    seconds: float


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return 100.0 if mse == 0 else min(100.0, 10 * np.log10(255**2 / mse))  # 100: identical


def object_rgb(frame: np.ndarray, background: tuple[int, int, int]) -> np.ndarray | None:
    """The median colour of the pixels far from `background` (client/pixels.py's foreground), None if too few."""
    f = frame.reshape(-1, 3).astype(np.float32)
    far = np.linalg.norm(f - np.asarray(background, np.float32), axis=1) > pixels.FOREGROUND_DISTANCE
    return np.median(f[far], axis=0) if far.sum() >= pixels.MIN_PIXELS else None


def run(gen, case: Case, seed: int, frames: int) -> Result:
    """One stream from the case's image, `frames` video frames after it."""
    mc = gen.model_cfg
    size = (mc.width, mc.height)
    image = case.image(mc.height, mc.width)
    t0 = time.perf_counter()
    state = gen.open_stream("start", case.prompt, seed=seed, input_kind="image")
    out = [gen.start_from_image(state, torch.from_numpy(image)).frames.cpu()]
    it, n = gen.stream(state), 0
    while n < frames:
        chunk = next(it)
        out.append(chunk.frames.cpu())
        n += chunk.frames.shape[0]
    gen.close_stream(state)
    seconds = time.perf_counter() - t0
    video = torch.cat(out)[: 1 + frames].numpy()
    readings = [pixels.read_frame(f) for f in video]
    want = DIRECTIONS[case.motion]
    moves, speeds = [], []
    for w in range(1, len(video) - WINDOW + 1, WINDOW):
        v = pixels.velocity(readings[w : w + WINDOW], *size)
        moves.append(pixels.motion(v) == case.motion)
        if v is not None:
            speeds.append(v[0] * want[0] + v[1] * want[1])
    start = pixels.read_frame(image).centre
    offset = float("nan")
    if readings[1].centre is not None:
        d = np.abs(np.subtract(readings[1].centre, start))
        offset = float(np.hypot(*np.minimum(d, np.subtract(size, d))))
    objects = [object_rgb(f, r.background) for f, r in zip(video[1:], readings[1:])]
    objects = [o for o in objects if o is not None]
    obj_err = float(np.mean([np.linalg.norm(o - case.colour) for o in objects])) if objects else float("nan")
    bg_err = float(np.mean([np.linalg.norm(np.subtract(r.background, case.background)) for r in readings[1:]]))
    return Result(case.name, gen.cfg.frames_per_chunk, seed, psnr(video[0], image), len(moves),
                  float(np.mean(moves)) if moves else 0.0, float(np.median(speeds)) if speeds else float("nan"),
                  offset, obj_err, bg_err, seconds)


def summary(rows: list[Result]) -> dict:
    """The rows' figures together: PSNR min and mean, the share of windows moving as asked, the means."""
    windows = sum(r.windows for r in rows)
    moves = sum(r.moves * r.windows for r in rows) / windows if windows else 0.0
    mean = lambda xs: _r(float(np.nanmean(xs)) if not np.all(np.isnan(xs)) else float("nan"))  # noqa: E731
    out = {"streams": len(rows), "psnr_db_min": _r(min(r.psnr_db for r in rows)), "psnr_db_mean": _r(np.mean([r.psnr_db for r in rows])),
           "moves_as_prompted": _r(moves), "speed_px": mean([r.speed_px for r in rows]),
           "start_offset_px": mean([r.start_offset_px for r in rows]), "object_rgb_error": mean([r.object_rgb_error for r in rows]),
           "background_rgb_error": mean([r.background_rgb_error for r in rows])}
    out["first_frame_ok"] = out["psnr_db_min"] is not None and out["psnr_db_min"] >= FIRST_FRAME_DB
    out["moves_ok"] = moves >= MOVES_SHARE
    out["keeps_look"] = all(out[k] is not None and out[k] <= LOOK_RGB for k in ("object_rgb_error", "background_rgb_error"))
    return out


def _r(x: float, nd: int = 3) -> float | None:
    return None if x is None or not np.isfinite(x) else round(float(x), nd)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--weights", default="builtin", help="builtin (default: the shipped file), random, or a model file")
    p.add_argument("--chunk-sizes", default="3,1", help="latent frames per chunk, comma-separated (default 3,1)")
    p.add_argument("--seeds", type=int, default=4, help="noise seeds per case (default 4)")
    p.add_argument("--frames", type=int, default=48, help="video frames after the image (default 48: 4 windows)")
    p.add_argument("--cases", type=int, default=len(CASES), help=f"only the first N of the {len(CASES)} cases (tests)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads torch may use (default 1)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    t_start = time.monotonic()
    sizes = [int(s) for s in args.chunk_sizes.split(",")]
    cases = CASES[: args.cases]
    per_size, rows = {}, []
    for k in sizes:
        gen = build_generator("tiny", weights=args.weights, cfg=GeneratorConfig(frames_per_chunk=k))
        these = []
        for case in cases:
            for seed in range(args.seeds):
                r = run(gen, case, seed, args.frames)
                these.append(r)
                log(f"  chunk size {k}: {case.name}, seed {seed}: {r.psnr_db:.1f} dB, moves {r.moves:.0%}, "
                    f"{r.seconds:.1f} s")
        rows += these
        per_size[str(k)] = summary(these)
    print(f"\n{args.weights}: {len(cases)} images x {args.seeds} seeds, {args.frames} frames after the image "
          f"(prompt's motion per {WINDOW} frames)")
    print(f"  {'case':36s} {'size':>4s} {'PSNR dB':>8s} {'moves':>6s} {'px/frame':>8s} {'start px':>8s} {'obj rgb':>7s} {'bg rgb':>6s}")
    for case in cases:
        for k in sizes:
            mine = [r for r in rows if r.case == case.name and r.chunk_size == k]
            s = summary(mine)
            print(f"  {case.name:36s} {k:4d} {s['psnr_db_min']!s:>8s} {s['moves_as_prompted']:6.0%} {s['speed_px']!s:>8s} "
                  f"{s['start_offset_px']!s:>8s} {s['object_rgb_error']!s:>7s} {s['background_rgb_error']!s:>6s}")
    for k in sizes:
        s = per_size[str(k)]
        print(f"  chunk size {k}: first frame >= {FIRST_FRAME_DB:.0f} dB: {'yes' if s['first_frame_ok'] else 'no'} "
              f"(min {s['psnr_db_min']}), moves as the prompt says in {s['moves_as_prompted']:.0%} of windows "
              f"(target {MOVES_SHARE:.0%}): {'yes' if s['moves_ok'] else 'no'}; keeps the image's colours (within "
              f"{LOOK_RGB:.0f} RGB): {'yes' if s['keeps_look'] else 'no'}")
    result = {"bench": "start_image", "weights": args.weights, "cases": [c.name for c in cases], "seeds": args.seeds,
              "frames": args.frames, "window": WINDOW, "targets": {"first_frame_db": FIRST_FRAME_DB, "moves_share": MOVES_SHARE, "look_rgb": LOOK_RGB},
              "chunk_sizes": per_size, "rows": [asdict(r) | {k: _r(v) for k, v in asdict(r).items() if isinstance(v, float)} for r in rows],
              "threads": args.threads, "seconds": round(time.monotonic() - t_start, 1)}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
