"""The `streamsvc` command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from models import PRESETS, GeneratorConfig, build_generator
from kvcache import QUANT_MODES


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="tiny", choices=list(PRESETS), help="model size (default: tiny, CPU-fast)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: cuda if present)")
    p.add_argument("--checkpoint", default=None, help="local .safetensors/.pt DiT weights (default: random from --weights-seed)")
    p.add_argument("--weights-seed", type=int, default=0, help="seed of the random weights when no checkpoint is given")
    p.add_argument("--kv-quant", default="none", choices=QUANT_MODES, help="KV cache storage (default: none = model dtype)")
    p.add_argument("--sink-frames", type=int, default=3, help="latent frames kept from the stream's start (default 3)")
    p.add_argument("--window-frames", type=int, default=9, help="most recent latent frames kept (default 9)")


def _generator(args):
    from streamsvc.offline import default_device

    cfg = GeneratorConfig(sink_frames=args.sink_frames, window_frames=args.window_frames, kv_quant=args.kv_quant)
    return build_generator(
        args.preset, device=default_device(args.device), seed=args.weights_seed, checkpoint=args.checkpoint, cfg=cfg
    )


def cmd_generate(args) -> int:
    from streamsvc.offline import PromptChange, generate_video

    try:
        changes = [PromptChange.parse(t) for t in args.prompt_at]
    except ValueError as e:
        print(f"streamsvc generate: {e}", file=sys.stderr)
        return 2
    if args.seconds <= 0 or args.fps <= 0:
        print("streamsvc generate: --seconds and --fps must be positive", file=sys.stderr)
        return 2
    gen = _generator(args)
    n = generate_video(gen, args.prompt, args.seconds, args.fps, args.seed, Path(args.output), changes, not args.quiet)
    print(f"wrote {n} frames ({gen.model_cfg.width}x{gen.model_cfg.height}, {args.fps} fps, H.264) to {args.output}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="streamsvc",
        description="Live autoregressive video generation for many viewers: serve streams, load-test them, "
        "or generate a video file offline.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate one video offline and write an H.264 MP4")
    g.add_argument("--prompt", required=True, help="what the video shows")
    g.add_argument("--seconds", type=float, default=3.0, help="length of the video (default 3)")
    g.add_argument("--fps", type=int, default=16, help="frames per second (default 16)")
    g.add_argument("--seed", type=int, default=0, help="noise seed: same seed and prompts give the same frames")
    g.add_argument("-o", "--output", default="out.mp4", help="output .mp4 path (default out.mp4)")
    g.add_argument(
        "--prompt-at", action="append", default=[], metavar="SECONDS:TEXT",
        help="switch to TEXT from the first chunk starting at SECONDS (repeatable)",
    )
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    _model_args(g)
    g.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
