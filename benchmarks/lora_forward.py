"""The forward cost of styles: a batch of streams with a LoRA adapter each (models/adapters.py), at ranks given,
against the same batch with none. Random weights; the adapters target every Linear of every block (a style
LoRA's usual layers), each stream its own adapter (the per-stream application's worst case).

    python benchmarks/lora_forward.py --preset tiny --threads 1
    python benchmarks/lora_forward.py --preset wan2.1-1.3b --layers 2 --latent 16x16 --threads 1   # Wan's widths on a CPU
    python benchmarks/lora_forward.py --preset wan2.1-1.3b --device cuda --ranks 16,64 --batch 1

A forward here is a denoising step over a cache of --cached-frames frames; a timed run is a chunk's worth of
them in a row (--steps). On CUDA a batch of one replays CUDA graphs (captured in the warm-up, the styled ones
reading models/adapters.py `AdapterBuffers`, as wide as the rank asked, rounded up to 16: each rank gets its
own generator), and the styled runs alternate between two styles, so every chunk copies its style into the
buffers (two styled streams taking turns: the serving case); a batch of several runs eagerly, as it does in
serving. Warm-up is kept out of the timings (median of --iters, the runs interleaved). Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.generator import Timer, fill_cache  # noqa: E402
from models import CacheAccess, ChunkGenerator, GeneratorConfig, ModelConfig  # noqa: E402
from models.dit import CausalWanModel  # noqa: E402


TARGETS = {"blocks": "every Linear of the blocks (musubi-tuner's Wan LoRAs)",
           "attention": "the attention Linears only (diffusers' Wan LoRA training's default: q, k, v, o)"}


def write_lora(model, rank: int, seed: int, path: Path, targets: str = "blocks") -> Path:
    """A PEFT LoRA file over the blocks' Linears `targets` names (TARGETS)."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, m in model.named_modules():
        if (name.startswith("blocks.") and isinstance(m, torch.nn.Linear)
                and (targets == "blocks" or "_attn." in name)):
            sd[f"{name}.lora_A.weight"] = torch.randn(rank, m.in_features, generator=g) / m.in_features**0.5
            sd[f"{name}.lora_B.weight"] = torch.randn(m.out_features, rank, generator=g) * 0.01
    torch.save(sd, path)
    return path


def time_styles(gen: ChunkGenerator, files: list[Path], x, t, args, timer: Timer) -> tuple[tuple[float, float], float]:
    """(ms a forward with no style, ms with one per stream) and the MB of one set of styles: chunks of
    `args.steps` forwards in a row, the styled ones alternating between two sets of styles (`files` split)."""
    mc = gen.model_cfg
    states = [gen.open_stream(f"s{i}", f"prompt {i}", seed=i) for i in range(args.batch)]
    for s in states:
        fill_cache(gen, s, args.cached_frames)
    names = [gen.adapters.load(f.stem, f).name for f in files]
    styles = [[gen.adapters.use(n, 1.0) for n in names[k::2]] for k in range(2)]
    text = [(torch.cat([s.text[i][0] for s in states]), torch.cat([s.text[i][1] for s in states]))
            for i in range(mc.num_layers)]  # the prompts' text K/V (a style's own only changes values)
    turn = itertools.count()

    def chunk(uses_of):
        def run():
            access = [CacheAccess(s.cache, s.cache.num_frames, lora=u) for s, u in zip(states, uses_of())]
            for _ in range(args.steps):
                gen.forward(x, t, text, access)
        return run

    none, styled = timer.split([chunk(lambda: [None] * args.batch), chunk(lambda: styles[next(turn) % 2])], args.iters)
    return (none / args.steps, styled / args.steps), sum(u.adapter.nbytes for u in styles[0]) / 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--layers", type=int, default=None, help="fewer blocks than the preset's (a CPU run of Wan's widths)")
    p.add_argument("--latent", default=None, help="latent HxW instead of the preset's (e.g. 16x16)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--ranks", default="16")
    p.add_argument("--cached-frames", type=int, default=9)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--steps", type=int, default=4, help="forwards a timed run makes in a row (a chunk's)")
    p.add_argument("--targets", choices=sorted(TARGETS), default="blocks",
                   help="; ".join(f"{k}: {v}" for k, v in TARGETS.items()))
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-cuda-graphs", action="store_true")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    over = {}
    if args.layers:
        over["num_layers"] = args.layers
    if args.latent:
        over["latent_height"], over["latent_width"] = map(int, args.latent.lower().split("x"))
    mc = ModelConfig.from_name(args.preset, **over)
    model = CausalWanModel(mc).init_weights(0).to(device, dtype).eval()
    timer = Timer(device)
    ranks = [int(r) for r in args.ranks.split(",")]
    nf = GeneratorConfig().frames_per_chunk
    x = torch.randn(args.batch, mc.in_channels, nf, mc.latent_height, mc.latent_width, device=device)
    t = torch.full((args.batch, nf), 937.5, device=device)
    ms, mbs = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for rank in ranks:  # a generator per rank: its graphs' buffers take that rank
            gen = ChunkGenerator(model, GeneratorConfig(cuda_graphs=not args.no_cuda_graphs, lora_max_rank=max(ranks)))
            files = [write_lora(model, rank, i, Path(tmp) / f"r{rank}-{i}.pt", args.targets) for i in range(2 * args.batch)]
            ms[f"rank {rank}"], mbs[f"rank {rank}"] = time_styles(gen, files, x, t, args, timer)
            del gen
            if device.type == "cuda":
                torch.cuda.empty_cache()
    tokens = args.batch * nf * mc.tokens_per_frame
    print(f"{mc.name}: dim {mc.dim}, ffn {mc.ffn_dim}, {mc.num_layers} layers, {mc.tokens_per_frame} tokens a frame; "
          f"batch {args.batch} ({tokens} tokens) over {args.cached_frames} cached frames, {device}, {dtype}; "
          f"styles on {TARGETS[args.targets]}")
    print(f"{'adapters':>10} {'ms':>9} {'none ms':>8} {'vs none':>8} {'adapter MB':>11}")
    rows = {}
    for name, (none, v) in ms.items():
        rows[name] = {"ms": round(v, 3), "none_ms": round(none, 3), "overhead": round(v / none - 1, 4),
                      "adapter_mb": round(mbs[name], 2)}
        print(f"{name:>10} {v:9.2f} {none:8.2f} {v / none - 1:+8.1%} {mbs[name]:11.2f}")
    print(json.dumps({"bench": "lora_forward", "preset": mc.name, "dim": mc.dim, "layers": mc.num_layers,
                      "tokens_per_frame": mc.tokens_per_frame, "batch": args.batch, "steps": args.steps, "targets": args.targets,
                      "cached_frames": args.cached_frames,
                      "device": str(device), "dtype": str(dtype).removeprefix("torch."),
                      "threads": torch.get_num_threads(), "runs": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
