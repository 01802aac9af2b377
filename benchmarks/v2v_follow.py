"""Does the built-in model follow its input video, on motion it has never seen? Read off its pixels by client/pixels.py.

Input streams are rendered from models/scenes.py's looks moving along models/paths.py's paths:

- held-out scenes: per path family, `--scenes` inputs whose colour and shape are those of a colour x shape x motion
  triple held out of text-to-video training (scenes.HELD_OUT, each in turn; every fourth object small), on a random
  background, from a random start, along a random path of the family; the prompt names another colour and a shape,
  no motion ("a blue square"). Every draw comes from a seed training does not use; scene i has the same looks and
  prompt in every family. (Every colour x shape pair is seen in training, as are captions without motion: what is
  new is the input, its path and their combination.)
- the families: paths.HELD_OUT_FAMILIES (orbits), never in training, and training families for comparison
  (`--families`, default orbit, line and zigzag; `all` for every family);
- two fixed cases (issue 35's): "a red ball moving right" from the centre under "a blue ball", and a green ball
  moving left from (0.7 W, 0.3 H) on gray (a held-out triple) under "a yellow ball".

Each chunk gets the input's frames (`ChunkGenerator.set_input`) at each strength the schedule offers below 1
(`ChunkGenerator.input_strengths`: the built-in model's 0.833, 0.625, 0.357), at chunks of `--chunk-latent-frames`
latent frames (1 and 3). Per frame of the output:

- colour: the palette colour nearest the output's median over the region where the object should be (the pixels
  of both the input's object and the prompt's object drawn at its place: a square input under "a ball" is read
  over the ball), against the prompt's colour ("prompt colour"; "anywhere": the output's object's own colour,
  wherever it is: a model that restyles without following shows the prompt's colour there, not in the region);
- position: the distance from the output object's centre (client/pixels.py `read_frame`) to where the prompt's
  object drawn at the input's place reads, wrap-aware (objects wrap at the edges; a triangle's centroid is a third
  of its half-height below its box's centre, so the reference is read, not the path's point); a frame with no
  object is not in the mean, and counts against `found`.

FOLLOW_PX: a mean error of at most 8 px counts as following: half the big object's radius (16 px), so the
output's object covers most of the input's. What not following gives: at strength 1.0 (text-to-video, the input
unused; `--strengths 1`) the error is the input's drift from where the prompt puts the object, 30+ px. A row
follows when the mean error is at most FOLLOW_PX, the object is found in at least 90 % of the frames and at least
90 % of them show the prompt's colour.

    python benchmarks/v2v_follow.py                                  # the default (built-in) weights, chunks of 3
    python benchmarks/v2v_follow.py --chunk-latent-frames 1 3 --weights builtin follow
    python benchmarks/v2v_follow.py --weights FILE --quick           # a model file of `python -m models.train --export`

Prints a row per family and strength as it goes; ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from client import pixels  # noqa: E402
from models import build_generator  # noqa: E402
from models.paths import FAMILIES, HELD_OUT_FAMILIES, sample_path  # noqa: E402
from models.scenes import BACKGROUNDS, COLOURS, HELD_OUT, SHAPES, SPEED, Scene, draw  # noqa: E402
from models.stream import GeneratorConfig  # noqa: E402

FOLLOW_PX = 8.0  # mean position error (px) that counts as following: half the big object's radius
SHARE = 0.9  # share of frames that must show the object, and the prompt's colour where the object should be
EVAL_SEED = 4435  # the held-out scenes' draws (training draws from default_rng(TrainConfig.seed), another stream)
FIXED = "issue 35"  # the family name of the fixed cases' rows
DEFAULT_FAMILIES = (*HELD_OUT_FAMILIES, "line", "zigzag")
HELD_OUT_LOOKS = tuple(sorted(HELD_OUT))  # the held-out scenes' input looks, in turn


@dataclass(frozen=True)
class Case:
    """An input video and the prompt it is restyled under."""

    name: str
    family: str  # the input's path family (models/paths.py), or FIXED
    scene: Scene  # the input's look
    prompt: str
    target: Scene  # the prompt's look: its colour and shape, the size of the input's object, the default background
    path: np.ndarray = field(compare=False, repr=False)  # [N, 2] the input object's centre (x, y) in video frames 0..N-1

    @property
    def colour(self) -> str:
        return self.target.colour

    def centres(self, frames: np.ndarray) -> np.ndarray:
        if len(frames) and frames.max() >= len(self.path):
            raise ValueError(f"case {self.name!r} has a path of {len(self.path)} frames, frame {frames.max()} asked")
        return self.path[frames]

    def render(self, frames: np.ndarray, width: int, height: int) -> torch.Tensor:
        """The input's video frames `frames`: [N, H, W, 3] uint8."""
        return draw(self.centres(frames), [self.scene], height, width, "cpu", np.zeros(len(frames), int))

    def expected(self, frames: np.ndarray, width: int, height: int) -> torch.Tensor:
        """The prompt's object where the input's is: what following would show, [N, H, W, 3] uint8."""
        return draw(self.centres(frames), [self.target], height, width, "cpu", np.zeros(len(frames), int))


def prompt_of(target: Scene) -> str:
    """A restyling prompt, "a blue ball" ("a small blue ball" for a small object): colour, shape, no motion."""
    return " ".join(["a", *(["small"] if target.size == "small" else []), target.colour, target.shape])


def cases(width: int = 128, height: int = 128, n_frames: int = 400) -> list[Case]:
    """The fixed cases (issue 35's): a red ball moving right under "a blue ball", and a green ball moving left (a
    held-out triple) from an off-centre start on gray under "a yellow ball"."""
    assert ("green", "ball", "left") in HELD_OUT
    t = np.arange(n_frames)[:, None]
    line = lambda start, velocity: np.mod(np.asarray(start) + t * np.asarray(velocity), (width, height))  # noqa: E731
    return [
        Case("red ball right -> blue", FIXED, Scene("red", "ball", motion="right"), "a blue ball", Scene("blue", "ball"),
             line((width / 2, height / 2), (SPEED, 0.0))),
        Case("green ball left (held out), off-centre -> yellow", FIXED, Scene("green", "ball", motion="left", background="gray"),
             "a yellow ball", Scene("yellow", "ball"), line((width * 0.7, height * 0.3), (-SPEED, 0.0))),
    ]


def scene_cases(
    family: str, n: int, width: int = 128, height: int = 128, n_frames: int = 400, seed: int = EVAL_SEED
) -> list[Case]:
    """`n` held-out scenes moving along paths of `family` (module doc), the same for a seed and a family. Scene i
    is the same whatever `n`, and its path's first frames whatever `n_frames`; its looks and prompt are the same
    for every family (the families' rows differ in the paths alone)."""
    out = []
    for i in range(n):
        rng = np.random.default_rng([seed, i])
        colour, shape, motion = HELD_OUT_LOOKS[i % len(HELD_OUT_LOOKS)]
        size = "small" if i % 4 == 3 else "big"  # as many small ones as training has, a fifth, at least one in 4
        look = Scene(colour, shape, size, motion, str(rng.choice([b for b in BACKGROUNDS if b != colour])))
        colour = str(rng.choice([c for c in COLOURS if c != look.colour]))
        target = Scene(colour, str(rng.choice(SHAPES)), look.size)
        path = sample_path(np.random.default_rng([seed, i, 1 + FAMILIES.index(family)]), family, n_frames, height, width)
        out.append(Case(f"{family} {i}: {look.colour} {look.shape} -> {colour} {target.shape}", family, look,
                        prompt_of(target), target, path))
    return out


@dataclass(frozen=True)
class Result:
    """One stream's measures, or several streams' pooled (`pool`)."""

    case: str  # the case's name, or the group's
    family: str  # the input's path family (models/paths.py), or FIXED
    strength: float  # the snapped strength
    start_step: int  # the denoising step an input chunk starts at
    frames: int  # video frames measured
    error_px: float  # mean distance of the output object's centre to the expected one, frames with an object
    found: float  # share of frames with an object
    colour: float  # share of frames whose object region (module doc) shows the prompt's colour (what `follows` asks)
    object_colour: float  # share of frames whose object, wherever it is, reads as the prompt's colour
    input_colour: float  # share of frames whose object region shows the input's colour
    seconds: float  # wall time of the streams

    @property
    def follows(self) -> bool:
        return self.error_px <= FOLLOW_PX and self.found >= SHARE and self.colour >= SHARE


def wrapped_distance(a: np.ndarray, b: np.ndarray, width: int, height: int) -> np.ndarray:
    """[..., 2] (x, y) points -> their distance on the width x height torus (objects wrap at the edges)."""
    d = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
    return np.hypot(*np.moveaxis(np.minimum(d, np.asarray((width, height)) - d), -1, 0))


def object_region(frames: np.ndarray, scene: Scene) -> np.ndarray:
    """[N, H, W, 3] frames drawn of `scene` -> [N, H, W] bool: its object's pixels."""
    return (frames != np.asarray(BACKGROUNDS[scene.background], np.uint8)).any(-1)


def region_colour(frame: np.ndarray, region: np.ndarray, background: tuple[int, int, int]) -> str | None:
    """The palette colour of the output's median over `region` (where the object should be); None when that
    median is nearer the output's background than any palette colour (no object there)."""
    rgb = np.median(frame[region].astype(np.float32), axis=0)
    name = pixels.nearest(rgb)
    distance = lambda ref: np.linalg.norm(rgb - np.asarray(ref, np.float32))  # noqa: E731
    near_bg = distance(background) < distance(pixels.PALETTE[name])
    return None if near_bg else name


def pool(results: Sequence[Result], name: str) -> Result:
    """The results of several streams as one: shares over all their frames, the error over all frames with an
    object (a stream's mean weighs by its frames with an object), times summed."""
    frames = np.array([r.frames for r in results], np.float64)
    with_object = frames * np.array([r.found for r in results])
    errors = np.array([r.error_px if r.found else 0.0 for r in results])
    share = lambda f: float(np.dot(frames, [getattr(r, f) for r in results]) / frames.sum())  # noqa: E731
    return Result(name, results[0].family, results[0].strength, results[0].start_step, int(frames.sum()),
                  float(np.dot(with_object, errors) / with_object.sum()) if with_object.sum() else float("inf"),
                  share("found"), share("colour"), share("object_colour"), share("input_colour"),
                  float(sum(r.seconds for r in results)))


def run(gen, case: Case, strength: float, chunks: int = 6, seed: int = 0) -> Result:
    """One stream of `chunks` chunks with the case's input at `strength`."""
    mc = gen.model_cfg
    state = gen.open_stream("v2v", case.prompt, seed=seed, input_kind="video")
    snapped = gen.set_strength(state, strength)
    errors, found, colour, object_colour, input_colour, first, k = [], [], [], [], [], 0, 0
    t0 = time.perf_counter()
    for c in range(chunks):
        idx = np.arange(first, first + gen.frames_in_chunk(c))
        frames_in = case.render(idx, mc.width, mc.height).numpy()
        gen.set_input(state, torch.from_numpy(frames_in))
        out = None
        while out is None:
            out = gen.run(gen.next_work(state), [state])[0]
        k = out.start_step
        expected = case.expected(idx, mc.width, mc.height).numpy()
        regions = object_region(frames_in, case.scene) & object_region(expected, case.target)  # [N, H, W]
        for frame, want, region in zip(out.frames.cpu().numpy(), expected, regions):
            r = pixels.read_frame(frame)
            found.append(r.centre is not None)
            object_colour.append(r.colour == case.colour)
            if r.centre is not None:
                centre = pixels.read_frame(want).centre
                errors.append(float(wrapped_distance(r.centre, centre, mc.width, mc.height)))
            seen = region_colour(frame, region, r.background)
            colour.append(seen == case.colour)
            input_colour.append(seen == case.scene.colour)
        first += len(idx)
    gen.close_stream(state)
    return Result(case.name, case.family, round(snapped, 4), k, first, float(np.mean(errors)) if errors else float("inf"),
                  *(float(np.mean(x)) for x in (found, colour, object_colour, input_colour)), time.perf_counter() - t0)


def table(gen, groups: dict[str, list[Case]], strengths: Sequence[float], chunks: int, seeds: int) -> list[Result]:
    """Every group of cases (a family's held-out scenes, or a fixed case alone) at every strength, each case over
    `seeds` noise seeds, pooled per group; a row printed as each is done."""
    rows = []
    print(f"  {'family / case':60s} {'strength':>8s} {'step':>4s} {'frames':>6s} {'error px':>8s} {'found':>6s} "
          f"{'prompt colour':>13s} {'anywhere':>8s} {'input colour':>12s} {'seconds':>7s} follows", flush=True)
    for name, group in groups.items():
        for strength in strengths:
            r = pool([run(gen, case, strength, chunks, seed) for case in group for seed in range(seeds)], name)
            rows.append(r)
            print(f"  {r.case:60s} {r.strength:8.3f} {r.start_step:4d} {r.frames:6d} {r.error_px:8.1f} {r.found:6.2f} "
                  f"{r.colour:13.2f} {r.object_colour:8.2f} {r.input_colour:12.2f} {r.seconds:7.1f} "
                  f"{'yes' if r.follows else 'no'}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--weights", nargs="+", default=["builtin"],
                   help="builtin (the default weights), a model file of `python -m models.train --export` (its input "
                        "adapter, if it has one, runs the streams), or random")
    p.add_argument("--chunk-latent-frames", type=int, nargs="+", default=[3], metavar="N",
                   help="latent frames a chunk (GeneratorConfig.frames_per_chunk): 3, 1, or both (default 3)")
    p.add_argument("--families", nargs="+", default=list(DEFAULT_FAMILIES), metavar="FAMILY",
                   help=f"path families of the held-out scenes (default {' '.join(DEFAULT_FAMILIES)}; all: every one of "
                        f"{', '.join(FAMILIES)}; held out of training: {', '.join(HELD_OUT_FAMILIES)})")
    p.add_argument("--scenes", type=int, default=8, help="held-out scenes per family")
    p.add_argument("--latent-frames", type=int, default=18,
                   help="each stream's length in latent frames (18: 6 chunks of 3, 18 of 1; 69 video frames)")
    p.add_argument("--strengths", type=float, nargs="+",
                   help="input strengths (default: each the schedule offers below 1; 1 is text-to-video, the input unused)")
    p.add_argument("--seeds", type=int, default=1, help="noise seeds per case")
    p.add_argument("--quick", action="store_true", help="2 scenes per family, 12 latent frames")
    args = p.parse_args(argv)
    families = list(FAMILIES) if args.families == ["all"] else args.families
    if unknown := set(families) - set(FAMILIES):
        p.error(f"unknown path families {', '.join(sorted(unknown))}: use {', '.join(FAMILIES)} or all")
    if args.quick:
        args.scenes, args.latent_frames = 2, 12
    torch.set_num_threads(1)
    runs = []
    for weights in args.weights:
        for fpc in args.chunk_latent_frames:
            if args.latent_frames % fpc:
                p.error(f"--latent-frames {args.latent_frames} is not a whole number of chunks of {fpc}")
            gen = build_generator("tiny", weights=weights, cfg=GeneratorConfig(frames_per_chunk=fpc))
            mc, chunks = gen.model_cfg, args.latent_frames // fpc
            n_frames = 1 + (args.latent_frames - 1) * mc.temporal_upsample
            strengths = args.strengths or [s for s in gen.input_strengths() if s < 1]
            groups = {f"{family} (held out)" if family in HELD_OUT_FAMILIES else family:
                      scene_cases(family, args.scenes, mc.width, mc.height, n_frames) for family in families}
            groups |= {f"{FIXED}: {c.name}": [c] for c in cases(mc.width, mc.height, n_frames)}
            print(f"weights {weights}, chunks of {fpc} latent frames ({chunks} chunks, {n_frames} video frames a stream), "
                  f"{args.scenes} held-out scenes a family, {args.seeds} seed(s)", flush=True)
            rows = table(gen, groups, strengths, chunks, args.seeds)
            following = sorted({r.strength for r in rows} - {r.strength for r in rows if not r.follows})
            print(f"  every row follows (mean error <= {FOLLOW_PX} px, object and prompt colour in >= {SHARE:.0%} of "
                  f"frames) at strengths: {', '.join(f'{s:.3f}' for s in following) or 'none'}\n", flush=True)
            runs.append({"weights": Path(weights).name, "chunk_latent_frames": fpc, "following_strengths": following,
                         "rows": [asdict(r) | {"follows": r.follows} for r in rows]})
    print(json.dumps({"benchmark": "v2v_follow", "follow_px": FOLLOW_PX, "share": SHARE, "latent_frames": args.latent_frames,
                      "scenes": args.scenes, "seeds": args.seeds, "families": families,
                      "held_out_families": list(HELD_OUT_FAMILIES), "runs": runs}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
