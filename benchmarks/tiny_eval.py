"""How well the built-in model shows what it is asked for: every colour x shape x motion, read off its pixels.

For each triple of models/scenes.py (those in HELD_OUT, never drawn in training, marked *) and each of
`--seeds` noise seeds, one stream of `--chunks` chunks opens with the triple's caption and switches at chunk
`--switch-at` to another triple's (a new colour, shape and motion: each triple is also switched to once per
seed). client/pixels.py reads every frame back.

The streams make chunks of `--chunk-latent-frames` latent frames (3, or 1 as `--latency low` serves). The chunk
counts (`--chunks`, `--switch-at`, `--drift-chunks`, the chunks scored) are in chunks of 3 latent frames at either
size: at size 1 each is 3 chunks of 1, so both sizes make and score the same video (a chunk of 3 is 12 frames, the
first 9; drift runs 45 s: 60 chunks of 3, 180 of 1).

- accuracy: a frame's colour and shape, a chunk's motion (the median step of its frames), before the switch
  and after it (the chunk the switch lands in is left out: it is the switch latency's), seen vs held out;
- switch latency: frames from the switch chunk's first frame to the first frame of the new colour, as a
  histogram, and the share within the first chunk made after the switch (12 frames at size 3, 4 at size 1);
- drift: `--drift-streams` streams (triples spread over the list, each its own seed) run `--drift-chunks`
  chunks with no switch; accuracy and the object's size (its pixels) at chunks 50-60 (the
  run's last 11) against 1-10.

Streams run batched (`--batch` per forward), on the CPU by default:

    python benchmarks/tiny_eval.py                          # the shipped weights, 8 seeds, 12 chunks, drift to 60
    python benchmarks/tiny_eval.py --quick                  # 2 seeds, 7 drift streams: about a quarter of the time
    python benchmarks/tiny_eval.py --chunk-latent-frames 1  # chunks of 1 latent frame (4 video frames)
    python benchmarks/tiny_eval.py --weights runs/tiny/tiny.safetensors --seeds 1 --drift-streams 0
    python benchmarks/tiny_eval.py --weights random --quick # the floor: what random weights score

Prints tables; ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from client import pixels  # noqa: E402
from models import GeneratorConfig, WorkKind, build_generator  # noqa: E402
from models.scenes import COLOURS, HELD_OUT, MOTIONS, SHAPES, Scene  # noqa: E402

Triple = tuple[str, str, str]
ATTRS = ("colour", "shape", "motion")
TRIPLES: list[Triple] = [(c, s, m) for c in COLOURS for s in SHAPES for m in MOTIONS]
DRIFT_EARLY = range(1, 11)  # chunks compared for drift with the run's last 11 (50-60 of 61)


def switched_to(t: Triple, seed: int) -> Triple:
    """The triple a stream opening with `t` switches to: another colour (1 to 6 steps along, by seed), the next
    shape and the motion two along; for each seed a permutation, so every triple is switched to once."""
    c, s, m = (list(COLOURS), list(SHAPES), list(MOTIONS))
    return (c[(c.index(t[0]) + 1 + seed % (len(c) - 1)) % len(c)], s[(s.index(t[1]) + 1) % len(s)],
            m[(m.index(t[2]) + 2) % len(m)])


def caption(t: Triple, seed: int) -> str:
    """A caption of the triple from the training templates (synonyms, order, fillers: models/scenes.py)."""
    return Scene(t[0], t[1], motion=t[2]).caption(np.random.default_rng([seed, TRIPLES.index(t)]))


@dataclass
class Job:
    """One stream: its prompts and what it is scored on."""

    triple: Triple  # the opening triple
    seed: int
    chunks: int  # chunks of 3 latent frames
    switch_at: int | None  # chunk (of 3) the second triple starts at (None: no switch)
    then: Triple | None  # the second triple


def run(gen, jobs: Sequence[Job], read_chunk, per: int = 1) -> Iterator[tuple[Job, int, np.ndarray]]:
    """(job, chunk index, frames [N, H, W, 3] uint8) of every chunk of 3 latent frames `read_chunk(job, chunk)`
    asks for, each `per` of the generator's chunks (3 // its chunk size); the jobs run together, one forward for
    all of them (they share the chunk count and the switch)."""
    states = [gen.open_stream(f"eval{i}", caption(j.triple, j.seed), seed=j.seed) for i, j in enumerate(jobs)]
    parts: list[list[np.ndarray]] = [[] for _ in jobs]  # the frames of each job's chunk of 3 so far
    try:
        for c in range(jobs[0].chunks * per):
            for j, s in zip(jobs, states):
                if j.switch_at is not None and c == j.switch_at * per:
                    gen.set_prompt(s, caption(j.then, j.seed))
                    gen.run(WorkKind.RECACHE, [s])
            while gen.next_work(states[0]) is WorkKind.DENOISE:
                gen.run(WorkKind.DENOISE, states)
            for i, (j, chunk) in enumerate(zip(jobs, gen.run(WorkKind.COMMIT, states))):
                if read_chunk(j, c // per):
                    parts[i].append(chunk.frames.cpu().numpy())
                    if c % per == per - 1:
                        yield j, c // per, np.concatenate(parts[i])
                        parts[i] = []
    finally:
        for s in states:
            gen.close_stream(s)


def batches(jobs: list[Job], size: int) -> Iterator[list[Job]]:
    for i in range(0, len(jobs), size):
        yield jobs[i : i + size]


class Tally:
    """Right / total counts by key."""

    def __init__(self) -> None:
        self.right: Counter = Counter()
        self.total: Counter = Counter()

    def add(self, key, ok: bool) -> None:
        self.right[key] += bool(ok)
        self.total[key] += 1

    def rate(self, key) -> float | None:
        return self.right[key] / self.total[key] if self.total[key] else None


def score_chunk(tally: Tally, key: tuple, want: Triple, readings: Sequence[pixels.Reading], size: tuple[int, int]) -> None:
    """Colour and shape per frame, motion per chunk, and all three per chunk (by majority of its frames)."""
    for r in readings:
        tally.add((*key, "colour"), r.colour == want[0])
        tally.add((*key, "shape"), r.shape == want[1])
    moved = pixels.motion(pixels.velocity(readings, *size))
    tally.add((*key, "motion"), moved == want[2])
    colour = Counter(r.colour for r in readings).most_common(1)[0][0]
    shape = Counter(r.shape for r in readings).most_common(1)[0][0]
    tally.add((*key, "all"), (colour, shape, moved) == want)


def pct(x: float | None) -> str:
    return "   -  " if x is None else f"{100 * x:5.1f}%"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--weights", default="builtin", help="builtin (default: the shipped file), random, or a model file")
    p.add_argument("--seeds", type=int, default=8, help="noise seeds per triple (default 8)")
    p.add_argument("--chunk-latent-frames", type=int, default=3, choices=(1, 3),
                   help="latent frames per chunk the streams make (default 3; the chunk counts stay in chunks of 3)")
    p.add_argument("--chunks", type=int, default=12, help="chunks (of 3 latent frames) per stream (default 12)")
    p.add_argument("--switch-at", type=int, default=6, help="chunk (of 3) the prompt switches at (default 6)")
    p.add_argument("--drift-chunks", type=int, default=61, help="chunks (of 3) of the drift streams (default 61: 0..60)")
    p.add_argument("--drift-streams", type=int, default=35, help="drift streams, spread over the triples (default 35; 0: none)")
    p.add_argument("--triples", type=int, default=None, help="only N triples, spread over the list (tests)")
    p.add_argument("--quick", action="store_true", help="--seeds 2 --drift-streams 7")
    p.add_argument("--batch", type=int, default=32, help="streams per forward (default 32)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads torch may use (default 2)")
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    if not 0 < args.switch_at < args.chunks - 1:
        p.error(f"--switch-at must leave chunks before and after it (0 < {args.switch_at} < {args.chunks - 1})")
    if args.quick:
        args.seeds, args.drift_streams = 2, 7
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    t_start = time.monotonic()
    cfg = GeneratorConfig(frames_per_chunk=args.chunk_latent_frames)
    gen = build_generator("tiny", device=args.device, weights=args.weights, cfg=cfg)
    return evaluate(gen, args, t_start)


def evaluate(gen, args: argparse.Namespace, t_start: float) -> dict:
    """Run the streams on `gen` (a ChunkGenerator, or anything with its stream methods), print the tables and
    the JSON line, return the result."""
    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    mc, size = gen.model_cfg, (gen.model_cfg.width, gen.model_cfg.height)
    fpc = gen.cfg.frames_per_chunk
    per = 3 // fpc  # the generator's chunks in a chunk of 3 latent frames
    triples = spread(TRIPLES, args.triples or len(TRIPLES))
    log(f"{args.weights}: dim {mc.dim}, {mc.num_layers} layers, chunks of {fpc} latent frames; {len(triples)} triples x "
        f"{args.seeds} seeds, {args.chunks} chunks of 3 (switch at {args.switch_at}); drift: {args.drift_streams} streams x "
        f"{args.drift_chunks} chunks of 3")

    # -- switch streams --------------------------------------------------------------------------
    tally = Tally()
    latency: list[int | None] = []  # frames from the switch to the new colour, per stream
    jobs = [Job(t, s, args.chunks, args.switch_at, switched_to(t, s)) for s in range(args.seeds) for t in triples]
    t0, done = time.monotonic(), 0
    for batch in batches(jobs, args.batch):
        first_new: dict[int, int | None] = {}
        for job, c, frames in run(gen, batch, lambda j, c: True, per):
            readings = [pixels.read_frame(f) for f in frames]
            key = id(job)
            if c >= args.switch_at and first_new.get(key) is None:  # the new colour's first frame, counted from the switch
                hit = next((i for i, r in enumerate(readings) if r.colour == job.then[0]), None)
                first_new[key] = None if hit is None else _frames_before(gen, args.switch_at * per, c * per) + hit
            if c == args.switch_at:
                continue
            want, phase = (job.triple, "before") if c < args.switch_at else (job.then, "after")
            held = want in HELD_OUT
            score_chunk(tally, (phase, held), want, readings, size)
            score_chunk(tally, ("triple", want), want, readings, size)
        latency += [first_new.get(id(j)) for j in batch]
        done += len(batch)
        log(f"  {done}/{len(jobs)} streams, {time.monotonic() - t0:.0f} s")
    gen_s = time.monotonic() - t0

    # -- drift streams ---------------------------------------------------------------------------
    drift = Tally()
    sizes: dict[str, list[int]] = defaultdict(list)
    late = range(max(DRIFT_EARLY.stop, args.drift_chunks - 11), args.drift_chunks)
    wanted = set(DRIFT_EARLY) | set(late)
    djobs = [Job(t, 1000 + i, args.drift_chunks, None, None) for i, t in enumerate(spread(triples, args.drift_streams))]
    t0 = time.monotonic()
    for batch in batches(djobs, args.batch) if late else ():
        for job, c, frames in run(gen, batch, lambda j, c: c in wanted, per):
            when = "early" if c in DRIFT_EARLY else "late"
            readings = [pixels.read_frame(f) for f in frames]
            score_chunk(drift, (when,), job.triple, readings, size)
            sizes[when] += [r.pixels for r in readings if r.colour == job.triple[0]]
    drift_s = time.monotonic() - t0

    # -- tables ----------------------------------------------------------------------------------
    print(f"\naccuracy ({len(jobs)} streams; colour and shape per frame, motion and all three per chunk)")
    print(f"{'':28s} {'colour':>7s} {'shape':>7s} {'motion':>7s} {'all 3':>7s}")
    acc = {}
    for phase in ("before", "after"):
        for held in (False, True):
            row = {a: tally.rate((phase, held, a)) for a in (*ATTRS, "all")}
            acc[f"{phase}_switch_{'held_out' if held else 'seen'}"] = {a: _r(v) for a, v in row.items()}
            label = f"{phase} the switch, {'held out' if held else 'seen'}"
            print(f"{label:28s} " + " ".join(f"{pct(row[a]):>7s}" for a in (*ATTRS, "all")))
    per_triple = {t: tally.rate(("triple", t, "all")) for t in triples}
    print("\nheld-out triples (*) and the 8 weakest seen ones: all three right, per chunk")
    def weakness(t: Triple) -> tuple[float, float]:  # all three right, then the three attributes' mean
        return per_triple[t] or 0.0, sum(tally.rate(("triple", t, a)) or 0.0 for a in ATTRS)

    weakest = sorted((t for t in triples if t not in HELD_OUT), key=weakness)[:8]
    for t in [t for t in triples if t in HELD_OUT] + weakest:
        marks = " ".join(f"{a} {pct(tally.rate(('triple', t, a)))}" for a in ATTRS)
        print(f"  {'*' if t in HELD_OUT else ' '} {' '.join(t):28s} {pct(per_triple[t])}   ({marks})")

    frames_first = gen.frames_in_chunk(args.switch_at * per)  # the first chunk made after the switch
    hits = [x for x in latency if x is not None]
    print(f"\nswitch latency: frames from the switch to the first frame of the new colour ({frames_first} frames a chunk)")
    hist = Counter(min(x // 3, 7) for x in hits)
    bins = {f"{3 * b}-{3 * b + 2}" if b < 7 else "21+": hist[b] for b in range(8)}
    bins["never"] = len(latency) - len(hits)
    top = max(bins.values()) or 1
    for label, n in bins.items():
        print(f"  {label:>6s} {n:5d} {'#' * round(40 * n / top)}")
    within = sum(x < frames_first for x in hits) / len(latency) if latency else None
    print(f"  within the first chunk after the switch: {pct(within)}")

    drift_out = None
    if djobs and late:
        print(f"\ndrift ({len(djobs)} streams of {args.drift_chunks} chunks, no switch): chunks 1-10 vs {late.start}-{late.stop - 1}")
        drift_out = {}
        for when in ("early", "late"):
            row = {a: drift.rate((when, a)) for a in (*ATTRS, "all")}
            mean_px = float(np.mean(sizes[when])) if sizes[when] else None
            drift_out[when] = {**{a: _r(v) for a, v in row.items()}, "object_pixels": _r(mean_px, 1)}
            print(f"  {'chunks 1-10' if when == 'early' else f'chunks {late.start}-{late.stop - 1}':14s} "
                  + " ".join(f"{a} {pct(row[a])}" for a in (*ATTRS, "all"))
                  + f"  object {'-' if mean_px is None else f'{mean_px:.0f}'} px")
        e, l_ = drift_out["early"]["object_pixels"], drift_out["late"]["object_pixels"]
        drift_out["size_ratio"] = _r(l_ / e) if e and l_ else None
        print(f"  object size late / early: {drift_out['size_ratio']}")

    result = {
        "bench": "tiny_eval",
        "weights": args.weights,
        "model": {"dim": mc.dim, "layers": mc.num_layers, "heads": mc.num_heads},
        "triples": len(triples),
        "held_out_triples": sum(t in HELD_OUT for t in triples),
        "seeds": args.seeds,
        "chunk_latent_frames": fpc,
        "chunks": args.chunks,
        "switch_at": args.switch_at,
        "accuracy": acc,
        "switch_latency_frames": {"hist": bins, "p50": _pctl(hits, 50), "p95": _pctl(hits, 95),
                                  "within_first_chunk": _r(within), "never": bins["never"]},
        "drift": drift_out,
        "device": args.device,
        "threads": args.threads,
        "seconds": {"switch_streams": round(gen_s, 1), "drift_streams": round(drift_s, 1),
                    "total": round(time.monotonic() - t_start, 1)},
    }
    print(json.dumps(result))
    return result


def spread(items: Sequence, n: int) -> list:
    """`n` items spread evenly over `items` (all of them, in order, when n >= len; repeating past that)."""
    if n >= len(items):
        return [items[i % len(items)] for i in range(n)]
    return [items[(i * len(items)) // n] for i in range(n)]


def _frames_before(gen, first_chunk: int, chunk: int) -> int:
    """Video frames of the generator's chunks first_chunk .. chunk - 1."""
    return sum(gen.frames_in_chunk(c) for c in range(first_chunk, chunk))


def _pctl(xs: Sequence[int], q: float) -> float | None:
    return None if not xs else float(np.percentile(xs, q))


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else round(x, nd)


if __name__ == "__main__":
    main()
