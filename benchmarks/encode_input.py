"""Encode time of a stream's input video per chunk, for each encoder (issue 35): what video-to-video adds.

    python benchmarks/encode_input.py --encoder builtin                       # the tiny preset, CPU
    python benchmarks/encode_input.py --encoder taehv --preset tiny
    python benchmarks/encode_input.py --encoder wan --preset tiny --vae-base-dim 16
    python benchmarks/encode_input.py --encoder wan --preset wan2.1-1.3b --device cuda     # on a GPU: 480x832
    python benchmarks/encode_input.py --encoder taehv --preset wan2.1-1.3b --device cuda

Random weights at the real architectures (the Wan2.1 VAE's encoder: diffusers AutoencoderKLWan, base_dim 96;
TAEHV's encoder: 64 channels; the built-in model's BlockPCA), run chunk by chunk as the generator does
(`StreamingEncoder.encode` with one stream's state): the first chunk (1 + 4 (F - 1) frames), then
`--chunks` more (4 F frames each) after `--warmup` chunks untimed. The frames are uint8 on the device already
(the decode and scale of the input are the transport's). Prints per-chunk ms (median, p90), the encode's share
of a chunk's playout time, the per-stream state bytes; ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.config import ModelConfig  # noqa: E402
from models.decoder import frames_per_chunk  # noqa: E402
from models.encoder import BlockPCAEncoder  # noqa: E402


def build_encoder(kind: str, mc: ModelConfig, device: torch.device, dtype: torch.dtype, vae_base_dim: int):
    if kind == "builtin":
        return BlockPCAEncoder.random(mc, seed=0, device=device)
    if kind == "taehv":
        from models.taehv import TAEHVEncoder

        torch.manual_seed(0)
        return TAEHVEncoder(latent_channels=mc.in_channels).to(device, dtype).eval()
    from diffusers import AutoencoderKLWan

    from models.wan_vae import WanVAEEncoder, wan21_vae_config

    torch.manual_seed(0)
    vae = AutoencoderKLWan(**wan21_vae_config(base_dim=vae_base_dim, z_dim=mc.in_channels))
    return WanVAEEncoder(torch.nn.Module.to(vae, dtype).eval()).to(device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--encoder", choices=("wan", "taehv", "builtin"), required=True)
    p.add_argument("--preset", default="tiny", help="the model preset whose frame size and chunk the input has")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                   help="auto: the serving path's (Wan VAE bf16, TAEHV fp16 on CUDA; float32 on the CPU)")
    p.add_argument("--chunks", type=int, default=8, help="timed chunks after the first")
    p.add_argument("--warmup", type=int, default=2, help="untimed chunks after the first")
    p.add_argument("--frames-per-chunk", type=int, default=3, help="latent frames per chunk")
    p.add_argument("--fps", type=float, default=16.0, help="the stream's fps (for the share of a chunk's playout)")
    p.add_argument("--vae-base-dim", type=int, default=96, help="the Wan VAE's base width (Wan2.1: 96)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    mc = ModelConfig.from_name(args.preset)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(args.dtype)
    if dtype is None:
        dtype = torch.float32 if device.type != "cuda" else {"wan": torch.bfloat16, "taehv": torch.float16}.get(args.encoder, torch.float32)
    enc = build_encoder(args.encoder, mc, device, dtype, args.vae_base_dim)
    state = enc.init_state()
    gen = torch.Generator(device="cpu").manual_seed(0)
    nf, tu = args.frames_per_chunk, mc.temporal_upsample

    def frames(first: bool) -> torch.Tensor:
        n = frames_per_chunk(nf, first, tu)
        return torch.randint(0, 256, (n, mc.height, mc.width, 3), generator=gen, dtype=torch.uint8).to(device)

    def timed(x: torch.Tensor) -> float:
        sync(device)
        t0 = time.perf_counter()
        z = enc.encode(x, state)
        sync(device)
        assert z.shape == (mc.in_channels, nf, mc.latent_height, mc.latent_width), z.shape
        return (time.perf_counter() - t0) * 1000

    first_ms = timed(frames(True))
    for _ in range(args.warmup):
        timed(frames(False))
    ms = [timed(frames(False)) for _ in range(args.chunks)]
    chunk_s = frames_per_chunk(nf, False, tu) / args.fps
    med = statistics.median(ms)
    p90 = sorted(ms)[min(len(ms) - 1, round(0.9 * (len(ms) - 1)))]
    state_bytes = enc.state_bytes(mc.height, mc.width)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    print(f"{args.encoder} encoder, {args.preset} ({mc.width}x{mc.height}), {str(dtype).removeprefix('torch.')} on {device_name}")
    print(f"  first chunk ({frames_per_chunk(nf, True, tu)} frames): {first_ms:.1f} ms (includes any lazy init)")
    print(f"  later chunks ({frames_per_chunk(nf, False, tu)} frames): median {med:.1f} ms, p90 {p90:.1f} ms over {len(ms)}; "
          f"{100 * med / 1000 / chunk_s:.1f} % of a chunk's {chunk_s:.2f} s playout at {args.fps:g} fps; "
          f"{frames_per_chunk(nf, False, tu) / (med / 1000):.0f} frames/s")
    print(f"  per-stream encoder state: {state_bytes / 2**20:.1f} MiB")
    print(json.dumps({"benchmark": "encode_input", "encoder": args.encoder, "preset": args.preset, "device": device_name,
                      "dtype": str(dtype).removeprefix("torch."), "width": mc.width, "height": mc.height,
                      "first_chunk_ms": round(first_ms, 2), "chunk_ms_median": round(med, 2), "chunk_ms_p90": round(p90, 2),
                      "chunks": len(ms), "playout_share": round(med / 1000 / chunk_s, 4), "state_bytes": state_bytes,
                      "vae_base_dim": args.vae_base_dim if args.encoder == "wan" else None}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
