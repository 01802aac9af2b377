"""What a style LoRA does to the built-in model's frames, read on pixels: the inverted-colours style
(models/train_style.py) against the same streams without it.

For each prompt (a colour x shape x motion caption, spread over models/scenes.py's triples) and each of `--seeds`
noise seeds, three streams of `--chunks` chunks run side by side in one batch: `plain` (no style), `styled` (the
style from its start) and `switched` (plain, then the style switched on live before chunk `--switch-at`, as a
steerer's set_lora does: a recache, then the style). A stream's object starts centred and moves as its caption says,
so the streams are comparable pixel by pixel. Per chunk:

- the styled stream against 255 minus the plain one (what an exact inversion would be) and against the plain one:
  PSNR, and the per-pixel correlation with the plain frames (-1: an exact inversion, +1: no change);
- reference: the plain stream against its own inversion (the PSNR of a style that changed nothing);
- content: client/pixels.py reads colour, shape and motion (benchmarks/soak_figures.py `score_chunk`) off the plain
  frames and off 255 minus the styled ones (the inverted colours are no palette colour: the inversion of an inverted
  frame is the prompt's scene), each against the prompt;
- the switch: the switched stream's chunks before it equal the plain ones (bit for bit), and the chunks from it on
  are the styled stream's look (correlation with the plain frames and PSNR against 255 minus them), the first one
  separately: a switch shows in the chunk its version tags.

    python benchmarks/style_pixels.py                                        # models/assets/styles/invert.safetensors
    python benchmarks/style_pixels.py --style runs/style/invert.safetensors --seeds 2 --prompts 6
    python benchmarks/style_pixels.py --chunk-latent-frames 1                # chunks of 1 (counts stay in chunks of 3)

Prints a table per prompt; ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.soak_figures import CAPTION_MOTIONS, caption_triple, score_chunk  # noqa: E402
from benchmarks.tiny_eval import TRIPLES, spread  # noqa: E402
from models import GeneratorConfig, WorkKind, build_generator  # noqa: E402
from models.scenes import HELD_OUT  # noqa: E402

DEFAULT_STYLE = Path(__file__).resolve().parents[1] / "models" / "assets" / "styles" / "invert.safetensors"
PHRASES = {m: phrase for phrase, m in CAPTION_MOTIONS.items()}  # motion -> the load test's caption phrase


def caption(triple: tuple[str, str, str]) -> str:
    return f"a {triple[0]} {triple[1]} {PHRASES[triple[2]]}"


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float32) - b.astype(np.float32)) ** 2))
    return 99.0 if mse == 0 else 10 * np.log10(255.0**2 / mse)


def correlation(a: np.ndarray, b: np.ndarray) -> float:
    """Pearson's correlation of two chunks' pixel values (all channels)."""
    x, y = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    x, y = x - x.mean(), y - y.mean()
    return float((x * y).sum() / max(np.sqrt((x * x).sum() * (y * y).sum()), 1e-9))


def run_streams(gen, prompt: str, seed: int, chunks: int, switch_at: int, per: int) -> dict[str, list[np.ndarray]]:
    """The three streams' chunks of 3 latent frames (frames [N, H, W, 3] uint8) by kind: plain, styled, switched."""
    kinds = {"plain": None, "styled": "style", "switched": None}
    states = {k: gen.open_stream(f"{k}-{seed}", prompt, seed=seed, lora=lora) for k, lora in kinds.items()}
    out: dict[str, list[np.ndarray]] = {k: [] for k in kinds}
    parts: dict[str, list[np.ndarray]] = {k: [] for k in kinds}
    try:
        for c in range(chunks * per):
            if c == switch_at * per:
                gen.set_lora(states["switched"], "style", 1.0)
                gen.run(WorkKind.RECACHE, [states["switched"]])
            batch = list(states.values())
            while gen.next_work(batch[0]) is WorkKind.DENOISE:
                gen.run(WorkKind.DENOISE, batch)
            for k, chunk in zip(states, gen.run(WorkKind.COMMIT, batch)):
                parts[k].append(chunk.frames.cpu().numpy())
                if c % per == per - 1:
                    out[k].append(np.concatenate(parts[k]))
                    parts[k] = []
    finally:
        for s in states.values():
            gen.close_stream(s)
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--style", type=Path, default=DEFAULT_STYLE, help="the style LoRA file (default: the shipped invert)")
    p.add_argument("--weights", default="builtin", help="the base model: builtin (default) or a model file")
    p.add_argument("--prompts", type=int, default=12, help="prompts, spread over the colour x shape x motion triples (default 12)")
    p.add_argument("--seeds", type=int, default=2, help="noise seeds per prompt (default 2)")
    p.add_argument("--chunks", type=int, default=8, help="chunks (of 3 latent frames) per stream (default 8)")
    p.add_argument("--switch-at", type=int, default=4, help="chunk (of 3) the switched stream's style starts at (default 4)")
    p.add_argument("--chunk-latent-frames", type=int, default=3, choices=(1, 3))
    p.add_argument("--threads", type=int, default=1, help="CPU threads torch may use (default 1)")
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    if not 0 < args.switch_at < args.chunks:
        p.error(f"--switch-at must leave chunks before and from it (0 < {args.switch_at} < {args.chunks})")
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    t_start = time.monotonic()
    fpc = args.chunk_latent_frames
    gen = build_generator("tiny", device=args.device, dtype=torch.float32, weights=args.weights,
                          cfg=GeneratorConfig(frames_per_chunk=fpc))
    adapter = gen.adapters.load("style", args.style)
    triples = spread([t for t in TRIPLES if t not in HELD_OUT], args.prompts)
    print(f"style {args.style} (rank {adapter.rank}, {len(adapter.layers)} Linears) on {args.weights}; {len(triples)} prompts x "
          f"{args.seeds} seeds, {args.chunks} chunks of 3 (switch at {args.switch_at}), chunks of {fpc} latent frames",
          file=sys.stderr, flush=True)
    rows, first_switched, before_equal = [], [], True
    content = {"plain": np.zeros(4), "styled": np.zeros(4), "frames": 0}  # colour, shape, motion, all
    print(f"{'prompt':34} {'seed':>4} {'PSNR inv':>8} {'PSNR plain':>10} {'ref':>6} {'corr':>6} {'switch corr':>11}")
    for triple in triples:
        prompt = caption(triple)
        assert caption_triple(prompt) == triple
        for seed in range(args.seeds):
            s = run_streams(gen, prompt, seed, args.chunks, args.switch_at, 3 // fpc)
            per_chunk = []
            for c, (plain, styled, switched) in enumerate(zip(s["plain"], s["styled"], s["switched"])):
                per_chunk.append((psnr(styled, 255 - plain), psnr(styled, plain), psnr(plain, 255 - plain),
                                  correlation(styled, plain)))
                for kind, frames in (("plain", plain), ("styled", 255 - styled)):
                    sc = score_chunk(list(frames), triple)
                    content[kind] += (sc.colour, sc.shape, sc.motion, sc.all)
                content["frames"] += len(plain)
                if c < args.switch_at:
                    before_equal &= bool(np.array_equal(switched, plain))
            after = [(psnr(sw, 255 - pl), correlation(sw, pl))
                     for sw, pl in zip(s["switched"][args.switch_at :], s["plain"][args.switch_at :])]
            first_switched.append(after[0])
            m = np.mean(per_chunk, axis=0)
            rows.append((*m, *np.mean(after, axis=0)))
            print(f"{prompt:34} {seed:4d} {m[0]:8.2f} {m[1]:10.2f} {m[2]:6.2f} {m[3]:6.3f} {np.mean(after, axis=0)[1]:11.3f}",
                  flush=True)
    r = np.mean(rows, axis=0)
    first = np.mean(first_switched, axis=0)
    rates = {kind: dict(zip(("colour", "shape", "motion", "all"), np.round(content[kind] / content["frames"], 4).tolist()))
             for kind in ("plain", "styled")}
    print(f"\nmean over {len(rows)} streams: styled vs 255 - plain {r[0]:.2f} dB, vs plain {r[1]:.2f} dB "
          f"(a style that changed nothing: {r[2]:.2f} dB against the inversion); correlation with plain {r[3]:.3f}")
    print(f"switched on at chunk {args.switch_at}: chunks before equal to plain: {before_equal}; its first chunk under the style "
          f"{first[0]:.2f} dB vs 255 - plain, correlation {first[1]:.3f}; all chunks from it {r[4]:.2f} dB, {r[5]:.3f}")
    print(f"content read on pixels (share of frames): plain {rates['plain']}; 255 - styled {rates['styled']}")
    result = {
        "benchmark": "style_pixels", "style": str(args.style), "weights": args.weights, "rank": adapter.rank,
        "prompts": len(triples), "seeds": args.seeds, "chunks": args.chunks, "chunk_latent_frames": fpc,
        "psnr_vs_inverted_plain_db": round(float(r[0]), 2), "psnr_vs_plain_db": round(float(r[1]), 2),
        "psnr_unchanged_vs_inverted_db": round(float(r[2]), 2), "correlation_with_plain": round(float(r[3]), 4),
        "switch_at": args.switch_at, "switch_chunks_before_equal_plain": before_equal,
        "switch_first_chunk_psnr_vs_inverted_db": round(float(first[0]), 2),
        "switch_first_chunk_correlation_with_plain": round(float(first[1]), 4),
        "switch_after_psnr_vs_inverted_db": round(float(r[4]), 2), "switch_after_correlation_with_plain": round(float(r[5]), 4),
        "content_plain": rates["plain"], "content_styled_inverted_back": rates["styled"],
        "seconds": round(time.monotonic() - t_start, 1),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
