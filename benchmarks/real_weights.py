"""What the real-weight parts cost per prompt and per chunk, with full-size random weights built in
memory (no files): umT5-XXL encoding a prompt (bf16), and decoding one 3-latent chunk at 480x832
with the Wan VAE (bf16), TAEHV (fp16) and the built-in tiny decoder, beside each decoder's state
memory per stream. Warm-up is kept out; CUDA events time the device.

    python benchmarks/real_weights.py --device cuda            # the H200 figures
    python benchmarks/real_weights.py --device cpu --size tiny  # a smoke run

Ends with one JSON line.
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
from models.decoder import TinyStreamingDecoder  # noqa: E402


def timed(fn, device: torch.device, iters: int) -> float:
    """Median ms of `fn()` over `iters` runs after one warm-up run."""
    fn()
    out = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            out.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(out)


def umt5_ms(size: str, device: torch.device, iters: int) -> dict:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

    from models.umt5 import XXL, UMT5TextEncoder

    cfg = dict(XXL) if size == "full" else dict(vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
                                                    relative_attention_num_buckets=32)
    words = [f"w{i}" for i in range(cfg["vocab_size"] - 3)]
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2} | {w: i + 3 for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = UMT5EncoderModel(UMT5Config(**{"feed_forward_proj": "gated-gelu", **cfg})).to(dtype).eval()
    enc = UMT5TextEncoder(model, tokenizer, cache_size=0)
    prompt = " ".join(words[i * 7 % len(words)] for i in range(24))  # a 25-token prompt, like a typical one
    ms = timed(lambda: enc.encode([prompt]), device, iters)
    params = sum(p.numel() for p in model.parameters())
    del enc, model
    return {"umt5_ms_per_prompt": round(ms, 2), "umt5_params": params, "umt5_tokens": 25}


def decoders_ms(size: str, device: torch.device, iters: int) -> dict:
    from models.taehv import TAEHVDecoder
    from models.wan_vae import WanVAEDecoder, wan21_vae_config

    from diffusers import AutoencoderKLWan

    mc = ModelConfig.from_name("wan2.1-1.3b" if size == "full" else "tiny")
    latents = torch.randn(mc.in_channels, 3, mc.latent_height, mc.latent_width, device=device)
    half = torch.bfloat16 if device.type == "cuda" else torch.float32
    built = {}
    with torch.device(device):
        built["wan_vae"] = WanVAEDecoder(AutoencoderKLWan(**wan21_vae_config(base_dim=96 if size == "full" else 8))
                                         .to(half).eval())
        built["taehv"] = TAEHVDecoder().to(torch.float16 if device.type == "cuda" else torch.float32).eval()
    built["tiny"] = TinyStreamingDecoder(mc).init_weights(0).to(device, half)  # seeded on the host
    out = {}
    for name, dec in built.items():
        state = dec.init_state()
        dec.decode(latents, state)  # the first chunk (9 frames); later chunks: 12
        out[f"{name}_ms_per_chunk"] = round(timed(lambda d=dec, s=state: d.decode(latents, s), device, iters), 2)
        out[f"{name}_state_mb"] = round(dec.state_bytes(mc.height, mc.width) / 2**20, 1)
        del state
    out["frame_size"] = f"{mc.width}x{mc.height}"
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--size", default="full", choices=("full", "tiny"))
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args()
    device = torch.device(args.device)
    result = {"bench": "real_weights", "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "size": args.size}
    with torch.inference_mode():
        result |= umt5_ms(args.size, device, args.iters)
        print(f"umT5: {result['umt5_ms_per_prompt']} ms per prompt ({result['umt5_params'] / 1e9:.2f} B parameters)",
              file=sys.stderr, flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        result |= decoders_ms(args.size, device, args.iters)
    for name in ("wan_vae", "taehv", "tiny"):
        print(f"{name}: {result[f'{name}_ms_per_chunk']} ms per chunk of 12 frames at {result['frame_size']}, "
              f"state {result[f'{name}_state_mb']} MiB per stream", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
