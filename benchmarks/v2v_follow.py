"""Does the built-in model follow its input video (issue 35)? Read off its pixels by client/pixels.py.

An input stream is rendered from models/scenes.py (by default "a red ball moving right", the issue's example,
and a green ball moving left on gray, a colour x shape x motion triple held out of training, from an
off-centre start); the stream's prompt names another colour ("a blue ball", "a yellow ball": no motion).
Each chunk gets the input's frames (`ChunkGenerator.set_input`) at each strength of the schedule. Per
frame of the output:

- colour: the palette colour nearest the output's median colour over the input object's pixels (its
  region), against the prompt's colour;
- position: the distance from the output object's centre (client/pixels.py `read_frame`) to the input's,
  wrap-aware (objects wrap at the edges); a frame with no object counts as a miss.

FOLLOW_PX: a mean error of at most 8 px counts as following: half the big object's radius (16 px), so the
output's object covers most of the input's. What not following gives: at strength 1.0 (text-to-video,
the input unused) the error is the input's drift from where the prompt puts the object, 30+ px here.
A strength follows when the mean error is at most FOLLOW_PX, the object is found in at least 90 % of
the frames and at least 90 % of them show the prompt's colour in the input object's region.

    python benchmarks/v2v_follow.py                   # the built-in model and its follow-trained twin, every strength
    python benchmarks/v2v_follow.py --weights FILE    # a model file of `python -m models.train --export`

The built-in model (models/assets/tiny.safetensors) follows at no strength: its x0 ignores x_t's layout.
models/assets/tiny_follow.safetensors is it after models/train.py's follow stage.

Prints a table; ends with one JSON line.
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
from models import build_generator  # noqa: E402
from models.model_file import FOLLOW_WEIGHTS  # noqa: E402
from models.scenes import BACKGROUNDS, COLOURS, HELD_OUT, SPEED, Scene, draw  # noqa: E402

FOLLOW_PX = 8.0  # mean position error (px) that counts as following: half the big object's radius
SHARE = 0.9  # share of frames that must show the object, and the prompt's colour in the input's region


@dataclass(frozen=True)
class Case:
    """An input video and the prompt it is restyled under."""

    name: str
    scene: Scene  # the input's look
    start: tuple[float, float]  # its object's centre at frame 0 (x, y), px
    velocity: tuple[float, float]  # px per frame
    prompt: str
    colour: str  # the prompt's colour

    def centres(self, frames: np.ndarray, width: int, height: int) -> np.ndarray:
        return np.mod(np.asarray(self.start) + frames[:, None] * np.asarray(self.velocity), (width, height))

    def render(self, frames: np.ndarray, width: int, height: int) -> torch.Tensor:
        return draw(self.centres(frames, width, height), [self.scene], height, width, "cpu", np.zeros(len(frames), int))


def cases(width: int = 128, height: int = 128) -> list[Case]:
    assert ("green", "ball", "left") in HELD_OUT
    return [
        Case("red ball right -> blue", Scene("red", "ball", motion="right"), (width / 2, height / 2), (SPEED, 0.0),
             "a blue ball", "blue"),
        Case("green ball left (held out), off-centre -> yellow", Scene("green", "ball", motion="left", background="gray"),
             (width * 0.7, height * 0.3), (-SPEED, 0.0), "a yellow ball", "yellow"),
    ]


@dataclass(frozen=True)
class Result:
    case: str
    strength: float  # the snapped strength
    start_step: int
    frames: int
    error_px: float  # mean distance of the output object's centre to the input's, frames with an object
    found: float  # share of frames with an object
    colour: float  # share of frames whose input-object region shows the prompt's colour
    input_colour: float  # share of frames whose input-object region shows the input's colour
    seconds: float

    @property
    def follows(self) -> bool:
        return self.error_px <= FOLLOW_PX and self.found >= SHARE and self.colour >= SHARE


def region_colour(frame: np.ndarray, region: np.ndarray, background: tuple[int, int, int]) -> str | None:
    """The palette colour of the output's median over `region` (the input object's pixels); None when that
    median is nearer the output's background than any palette colour (no object there)."""
    rgb = np.median(frame[region].astype(np.float32), axis=0)
    name = pixels.nearest(rgb)
    near_bg = np.linalg.norm(rgb - np.asarray(background, np.float32)) < np.linalg.norm(rgb - np.asarray(pixels.PALETTE[name], np.float32))
    return None if near_bg else name


def run(gen, case: Case, strength: float, chunks: int = 6, seed: int = 0) -> Result:
    """One stream of `chunks` chunks with the case's input at `strength`."""
    mc = gen.model_cfg
    state = gen.open_stream("v2v", case.prompt, seed=seed)
    snapped = gen.set_strength(state, strength)
    errors, found, colour, input_colour, first, k = [], [], [], [], 0, 0
    t0 = time.perf_counter()
    for c in range(chunks):
        idx = np.arange(first, first + gen.frames_in_chunk(c))
        frames_in = case.render(idx, mc.width, mc.height)
        gen.set_input(state, frames_in)
        out = None
        while out is None:
            out = gen.run(gen.next_work(state), [state])[0]
        k = out.start_step
        truth = case.centres(idx, mc.width, mc.height)
        mask = (frames_in != torch.tensor(BACKGROUNDS[case.scene.background], dtype=torch.uint8)).any(-1).numpy()
        for frame, centre, region in zip(out.frames.cpu().numpy(), truth, mask):
            r = pixels.read_frame(frame)
            found.append(r.centre is not None)
            if r.centre is not None:
                d = np.abs(np.asarray(r.centre) - centre)
                d = np.minimum(d, (mc.width, mc.height) - d)
                errors.append(float(np.hypot(*d)))
            seen = region_colour(frame, region, r.background)
            colour.append(seen == case.colour)
            input_colour.append(seen == case.scene.colour)
        first += len(idx)
    gen.close_stream(state)
    return Result(case.name, round(snapped, 4), k, first, float(np.mean(errors)) if errors else float("inf"),
                  float(np.mean(found)), float(np.mean(colour)), float(np.mean(input_colour)),
                  time.perf_counter() - t0)


def table(gen, chunks: int, seeds: int) -> list[Result]:
    """Every case at every strength of the schedule, averaged over `seeds` noise seeds, printed as a table."""
    rows = []
    print(f"  {'input -> prompt':50s} {'strength':>8s} {'step':>4s} {'error px':>8s} {'found':>6s} {'prompt colour':>13s} "
          f"{'input colour':>12s} follows")
    for case in cases(gen.model_cfg.width, gen.model_cfg.height):
        for strength in gen.input_strengths():
            runs = [run(gen, case, strength, chunks, seed) for seed in range(seeds)]
            r = Result(case.name, runs[0].strength, runs[0].start_step, sum(x.frames for x in runs),
                       *(float(np.mean([getattr(x, f) for x in runs])) for f in ("error_px", "found", "colour", "input_colour", "seconds")))
            rows.append(r)
            print(f"  {r.case:50s} {r.strength:8.3f} {r.start_step:4d} {r.error_px:8.1f} {r.found:6.2f} {r.colour:13.2f} "
                  f"{r.input_colour:12.2f} {'yes' if r.follows else 'no'}")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--weights", nargs="+", default=["builtin", str(FOLLOW_WEIGHTS)],
                   help="builtin (models/assets/tiny.safetensors), model files, or random (default: builtin and the "
                        "follow-trained models/assets/tiny_follow.safetensors)")
    p.add_argument("--chunks", type=int, default=6)
    p.add_argument("--seeds", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    out = {}
    for weights in args.weights:
        gen = build_generator("tiny", weights=weights)
        print(f"weights {weights}")
        rows = table(gen, args.chunks, args.seeds)
        following = sorted({r.strength for r in rows if r.strength < 1} - {r.strength for r in rows if not r.follows})
        print(f"  following (every case: mean error <= {FOLLOW_PX} px, object and prompt colour in >= {SHARE:.0%} of "
              f"frames) at strengths: {', '.join(f'{s:.3f}' for s in following) or 'none'}\n")
        out[Path(weights).name] = {"following_strengths": following, "rows": [asdict(r) | {"follows": r.follows} for r in rows]}
    print(json.dumps({"benchmark": "v2v_follow", "follow_px": FOLLOW_PX, "share": SHARE, "chunks": args.chunks,
                      "seeds": args.seeds, "weights": out}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
