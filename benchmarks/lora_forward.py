"""The forward cost of styles: a batch of streams with a LoRA adapter each (models/adapters.py), at ranks given,
against the same batch with none. Random weights; the adapters target every Linear of every block (a style
LoRA's usual layers), each stream its own adapter (the per-stream application's worst case).

    python benchmarks/lora_forward.py --preset tiny --threads 1
    python benchmarks/lora_forward.py --preset wan2.1-1.3b --layers 2 --latent 16x16 --threads 1   # Wan's widths on a CPU
    python benchmarks/lora_forward.py --preset wan2.1-1.3b --device cuda --ranks 16,64 --batch 1

A forward here is a denoising step over a cache of --cached-frames frames. On CUDA a batch of one replays
CUDA graphs (captured in the warm-up, the styled ones reading models/adapters.py `AdapterBuffers`); a batch
of several runs eagerly, as it does in serving. Warm-up is kept out of the timings (median of --iters, the
runs interleaved). Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.generator import Timer, fill_cache  # noqa: E402
from models import CacheAccess, ChunkGenerator, GeneratorConfig, ModelConfig  # noqa: E402
from models.dit import CausalWanModel  # noqa: E402


def write_lora(model, rank: int, seed: int, path: Path) -> Path:
    """A PEFT LoRA file over every Linear of the blocks."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, m in model.named_modules():
        if name.startswith("blocks.") and isinstance(m, torch.nn.Linear):
            sd[f"{name}.lora_A.weight"] = torch.randn(rank, m.in_features, generator=g) / m.in_features**0.5
            sd[f"{name}.lora_B.weight"] = torch.randn(m.out_features, rank, generator=g) * 0.01
    torch.save(sd, path)
    return path


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
    cfg = GeneratorConfig(cuda_graphs=not args.no_cuda_graphs, lora_max_rank=max(int(r) for r in args.ranks.split(",")))
    gen = ChunkGenerator(model, cfg)
    timer = Timer(device)
    states = [gen.open_stream(f"s{i}", f"prompt {i}", seed=i) for i in range(args.batch)]
    for s in states:
        fill_cache(gen, s, args.cached_frames)
    nf = cfg.frames_per_chunk
    x = torch.randn(args.batch, mc.in_channels, nf, mc.latent_height, mc.latent_width, device=device)
    t = torch.full((args.batch, nf), 937.5, device=device)

    runs = {"none": [None] * args.batch}
    with tempfile.TemporaryDirectory() as tmp:
        for rank in (int(r) for r in args.ranks.split(",")):
            names = [gen.adapters.load(f"r{rank}-{i}", write_lora(model, rank, i, Path(tmp) / f"r{rank}-{i}.pt")).name
                     for i in range(args.batch)]
            runs[f"rank {rank}"] = [gen.adapters.use(n, 1.0) for n in names]

    def forward(uses):
        text = [(torch.cat([s.text[i][0] for s in states]), torch.cat([s.text[i][1] for s in states])) for i in range(mc.num_layers)]
        access = [CacheAccess(s.cache, s.cache.num_frames, lora=u) for s, u in zip(states, uses)]
        return lambda: gen.forward(x, t, text, access)  # the text K/V: the prompts' (a style's own only changes values)

    ms = dict(zip(runs, timer.split([forward(u) for u in runs.values()], args.iters)))
    tokens = args.batch * nf * mc.tokens_per_frame
    print(f"{mc.name}: dim {mc.dim}, ffn {mc.ffn_dim}, {mc.num_layers} layers, {mc.tokens_per_frame} tokens a frame; "
          f"batch {args.batch} ({tokens} tokens) over {args.cached_frames} cached frames, {device}, {dtype}")
    print(f"{'adapters':>10} {'ms':>9} {'vs none':>8} {'adapter MB':>11}")
    rows = {}
    for name, v in ms.items():
        mb = sum(u.adapter.nbytes for u in runs[name] if u is not None) / 1e6
        rows[name] = {"ms": round(v, 3), "overhead": round(v / ms["none"] - 1, 4), "adapter_mb": round(mb, 2)}
        print(f"{name:>10} {v:9.2f} {v / ms['none'] - 1:+8.1%} {mb:11.2f}")
    print(json.dumps({"bench": "lora_forward", "preset": mc.name, "dim": mc.dim, "layers": mc.num_layers,
                      "tokens_per_frame": mc.tokens_per_frame, "batch": args.batch, "cached_frames": args.cached_frames,
                      "device": str(device), "dtype": str(dtype).removeprefix("torch."),
                      "threads": torch.get_num_threads(), "runs": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
