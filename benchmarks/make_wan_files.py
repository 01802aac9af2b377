"""Random weight files in the exact layouts real users have, for timing real-weight serving offline.

    python benchmarks/make_wan_files.py --out /data/wan [--size full|tiny|14b|tiny-14b] [--seed 0] [--device auto]

Writes, under --out (nothing is downloaded; the values are random, the names, shapes, dtypes and file
formats are the real ones):

    Wan2.1-T2V-1.3B/models_t5_umt5-xxl-enc-bf16.pth    umT5-XXL encoder, Wan's key names, bf16 (~11.4 GB)
    Wan2.1-T2V-1.3B/google/umt5-xxl/                   a local WordLevel tokenizer with 256,384 entries
                                                       (pad 0, eos 1, unk 2, then English and synthetic words)
    Wan2.1-T2V-1.3B/Wan2.1_VAE.pth                     the Wan2.1 VAE, Wan's key names, fp32 (~508 MB)
    Wan2.1-T2V-1.3B/config.json                        the base DiT's config, Wan's fields
    Wan2.1-T2V-1.3B/diffusion_pytorch_model.safetensors  the base DiT, Wan's names (bf16 unless --base-dtype)
    self_forcing_dmd.pt    {"generator_ema", "generator"}: DiT state dicts with a `model.` prefix, bf16
    longlive_base.pt       {"generator"}: a DiT state dict with a `model.` prefix, bf16
    lora.pt                {"generator_lora", "critic_lora", "step"}: PEFT lora_A / lora_B of every Linear
                           of each block, rank 256, bf16
    taew2_1.pth            TAEHV's encoder and decoder (`encoder.N.*`, `decoder.N.*`, as madebyollin/taehv's
                           nn.Sequentials name them), fp32; the encoder 64 channels wide (the tiny size: 8)

The DiTs are `CausalWanModel.init_weights` (base: seed, Self-Forcing's generator_ema: seed + 1,
LongLive's generator: seed + 2); Self-Forcing's `generator` is its generator_ema's tensors reversed along
their first dimension (other values, same bytes to read). umT5 and the LoRAs are normal noise from one
generator per 16M-element piece (on the GPU when there is one, else in CPU threads); norms are 1.
`--size tiny` writes the same layouts at the tiny preset's sizes (the tests load them on the CPU).

`--size 14b` writes Wan2.1-T2V-14B's layout instead: the same umT5, tokenizer and VAE files, its
config.json, and its DiT sharded as the 14B's is,

    Wan2.1-T2V-14B/diffusion_pytorch_model-0000N-of-00006.safetensors   whole tensors in key order, ~4.8 GB each
    Wan2.1-T2V-14B/diffusion_pytorch_model.safetensors.index.json       {"metadata": {"total_size"}, "weight_map"}

in bf16 (28.6 GB; `--base-dtype fp32` writes fp32 shards, 57 GB), drawn shard by shard on the
GPU as Xavier-normal noise (the variance of init_weights' Xavier-uniform), so that neither the whole DiT nor
an fp32 copy of it is ever in host memory; and taew2_1.pth. No Self-Forcing / LongLive / LoRA files (no
such 14B checkpoints; each would be another 28.6 GB). `--size tiny-14b` is that layout at the tiny
preset's sizes (the tests). About 40 GB and a few minutes at 14b on an H200 host.
Prints one line per file and ends with one JSON line: the files and their bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.config import ModelConfig  # noqa: E402
from models.dit import CausalWanModel  # noqa: E402
from models.taehv import TAEHV_FILE, TAEHVDecoder, TAEHVEncoder  # noqa: E402
from models.umt5 import WAN_CHECKPOINT, WAN_TOKENIZER, XXL, wan_key_map  # noqa: E402
from models.wan_vae import WAN_VAE_FILE, diffusers_key_to_wan, wan_key_to_diffusers, wan21_vae_config  # noqa: E402
from models.weights import DIT_INDEX  # noqa: E402

WAN_DIR = "Wan2.1-T2V-1.3B"
WAN_14B_DIR = "Wan2.1-T2V-14B"
DIT_FILE = "diffusion_pytorch_model.safetensors"
SELF_FORCING_FILE = "self_forcing_dmd.pt"
LONGLIVE_BASE_FILE = "longlive_base.pt"
LORA_FILE = "lora.pt"
LORA_TARGETS = tuple(f"self_attn.{p}" for p in "qkvo") + tuple(f"cross_attn.{p}" for p in "qkvo") + ("ffn.0", "ffn.2")

# what each size writes; the tiny umT5 is as wide as the tiny DiT's text input (32). `shards`: the DiT
# sharded with an index json as the 14B's is (Wan2.1-T2V-14B's folder, no Self-Forcing / LongLive / LoRA
# files); 0: one safetensors file, as the 1.3B's is, and the 1.3B's causal checkpoints beside the folder
_TINY_UMT5 = dict(vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
                  relative_attention_num_buckets=32, relative_attention_max_distance=128,
                  feed_forward_proj="gated-gelu")
SIZES = {
    "full": dict(
        preset="wan2.1-1.3b",
        umt5=dict(XXL),
        vae_base_dim=96,
        lora_rank=256,
        taehv_n_f=(256, 128, 64, 64),  # TAEHV's own
        shards=0,
    ),
    "tiny": dict(
        preset="tiny",
        umt5=_TINY_UMT5,
        vae_base_dim=8,
        lora_rank=4,
        taehv_n_f=(32, 16, 8, 8),
        shards=0,
    ),
    "14b": dict(
        preset="wan2.1-14b",
        umt5=dict(XXL),
        vae_base_dim=96,
        taehv_n_f=(256, 128, 64, 64),
        shards=6,  # as Wan2.1-T2V-14B's
    ),
    "tiny-14b": dict(
        preset="tiny",
        umt5=_TINY_UMT5,
        vae_base_dim=8,
        taehv_n_f=(32, 16, 8, 8),
        shards=6,
    ),
}

UMT5_STD = 0.02
LORA_B_STD = 1e-3
PIECE = 1 << 24  # elements per independently seeded piece of a random tensor

# real words first, so a prompt tokenizes into ids other than <unk>; synthetic words fill the rest
WORDS = (
    "a an the and of in on at to with from over under by for as is are was be it its this that "
    "red blue green yellow black white orange purple pink brown gray golden silver dark bright "
    "cat dog fox bird horse fish whale lion tiger bear wolf deer rabbit owl eagle dragon robot "
    "man woman child girl boy person people crowd astronaut knight dancer chef "
    "runs running walks walking flies flying swims swimming jumps dances sits stands looks turns "
    "fast slow slowly quickly gently softly "
    "snow rain fog storm sun sunset sunrise night day morning evening sky cloud clouds moon stars "
    "sea ocean river lake beach wave waves forest tree trees hill hills mountain mountains desert "
    "city street road car boat ship train plane house room window door light lights fire smoke water "
    "camera shot close-up wide aerial view cinematic realistic style detailed high quality 4k "
    "through across into around above below behind near far big small tall old young new"
).split()


def log(msg: str) -> None:
    print(msg, flush=True)


def _seed(*parts) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little") & ((1 << 63) - 1)


class Noise:
    """Deterministic normal noise, one generator per `PIECE` elements of each named tensor: on a CUDA
    device when given (then copied to the CPU), else filled in CPU threads."""

    def __init__(self, seed: int, device: torch.device, threads: int) -> None:
        self.seed, self.device = seed, device
        self.pool = ThreadPoolExecutor(max_workers=threads) if device.type == "cpu" and threads > 1 else None

    def normal(self, key: str, shape, std: float, dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype)
        flat = out.view(-1)
        pieces = [(i, flat[s : s + PIECE]) for i, s in enumerate(range(0, flat.numel(), PIECE))]

        def fill(item):
            i, piece = item
            g = torch.Generator(device=self.device).manual_seed(_seed(self.seed, key, i))
            if self.device.type == "cpu":
                piece.normal_(0.0, std, generator=g)
            else:
                piece.copy_(torch.empty(piece.numel(), device=self.device).normal_(0.0, std, generator=g).to(dtype))

        if self.pool is not None and len(pieces) > 1:
            list(self.pool.map(fill, pieces))
        else:
            for item in pieces:
                fill(item)
        return out


class Report:
    """Progress lines and the final manifest."""

    def __init__(self, out: Path) -> None:
        self.out, self.files, self.t0 = out, {}, time.perf_counter()

    def wrote(self, path: Path, started: float) -> None:
        paths = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        total = 0
        for p in paths:
            self.files[str(p.relative_to(self.out))] = p.stat().st_size
            total += p.stat().st_size
        log(f"wrote {path.relative_to(self.out)}  {total / 1e6:,.1f} MB  {time.perf_counter() - started:.1f} s")


# ---------------------------------------------------------------------------------------------- umT5


def umt5_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Wan's key -> shape of a umT5 encoder (shapes from transformers' own module, built on meta)."""
    from transformers import UMT5Config, UMT5EncoderModel

    with torch.device("meta"):
        model = UMT5EncoderModel(UMT5Config(**cfg, is_encoder_decoder=False, use_cache=False))
    own = model.state_dict()
    return {wan: tuple(own[hf[0]].shape) for wan, hf in wan_key_map(cfg["num_layers"]).items()}


def write_umt5(path: Path, cfg: dict, noise: Noise) -> None:
    tensors = {}
    for key, shape in umt5_shapes(cfg).items():  # embedding, final norm, then block by block
        if key.endswith("norm.weight") or key.endswith("norm1.weight") or key.endswith("norm2.weight"):
            tensors[key] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            tensors[key] = noise.normal(f"umt5/{key}", shape, UMT5_STD, torch.bfloat16)
    torch.save(tensors, path)


def write_tokenizer(folder: Path, vocab_size: int) -> None:
    """A WordLevel tokenizer of exactly `vocab_size` entries (umT5's ids for <pad>, </s>, <unk>),
    appending </s> as umT5's does, saved with save_pretrained so AutoTokenizer loads it."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    for w in WORDS:
        if len(vocab) < vocab_size:
            vocab.setdefault(w, len(vocab))
    i = 0
    while len(vocab) < vocab_size:
        vocab.setdefault(f"w{i:06d}", len(vocab))
        i += 1
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    if len(fast) != vocab_size:
        raise RuntimeError(f"tokenizer has {len(fast)} entries, expected {vocab_size}")
    fast.save_pretrained(str(folder))


# ---------------------------------------------------------------------------------------------- VAE, TAEHV


def write_wan_vae(path: Path, base_dim: int, seed: int) -> None:
    from diffusers import AutoencoderKLWan

    torch.manual_seed(_seed(seed, "vae") % (1 << 32))
    vae = AutoencoderKLWan(**wan21_vae_config(base_dim=base_dim))  # diffusers' random init, fp32, on the CPU
    sd = {}
    for k, v in vae.state_dict().items():
        wan = diffusers_key_to_wan(k)
        if wan_key_to_diffusers(wan) != k:
            raise RuntimeError(f"VAE key {k!r} -> {wan!r} does not rename back")
        sd[wan] = v.detach().float().contiguous()
    del vae
    torch.save(sd, path)


def write_taehv(path: Path, n_f: tuple[int, ...], seed: int) -> None:
    torch.manual_seed(_seed(seed, "taehv") % (1 << 32))
    decoder = TAEHVDecoder(n_f=n_f)  # PyTorch's default init
    encoder = TAEHVEncoder(width=n_f[3])  # TAEHV's is 64 wide, as its decoder's last stage
    sd = encoder.state_dict() | decoder.state_dict()  # `encoder.N.*` then `decoder.N.*`, as TAEHV's file
    torch.save({k: v.detach().float().contiguous() for k, v in sd.items()}, path)


# ---------------------------------------------------------------------------------------------- DiT, LoRA


def dit_state_dict(mc: ModelConfig, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """`CausalWanModel(mc).init_weights(seed)`'s tensors in `dtype`, Wan's names (no default init first)."""
    with torch.device("meta"):
        model = CausalWanModel(mc)
    model = model.to_empty(device="cpu").init_weights(seed)
    sd = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()}
    del model
    return sd


def wan_config_json(mc: ModelConfig) -> dict:
    """The fields of Wan2.1's config.json (WanModel's)."""
    return {
        "_class_name": "WanModel",
        "_diffusers_version": "0.30.0",
        "model_type": "t2v",
        "dim": mc.dim,
        "eps": mc.eps,
        "ffn_dim": mc.ffn_dim,
        "freq_dim": mc.freq_dim,
        "in_dim": mc.in_channels,
        "num_heads": mc.num_heads,
        "num_layers": mc.num_layers,
        "out_dim": mc.out_channels,
        "text_len": mc.text_len,
    }


def dit_shapes(mc: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Wan's key -> shape of the DiT's tensors, in the model's order (built on meta: nothing allocated)."""
    with torch.device("meta"):
        model = CausalWanModel(mc)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def shard_names(shards: int) -> list[str]:
    return [f"diffusion_pytorch_model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]


def shard_plan(shapes: dict[str, tuple[int, ...]], itemsize: int, shards: int) -> dict[str, str]:
    """Key -> shard file, as save_pretrained splits a model: whole tensors in key order, each in the shard
    where the middle of its bytes falls (so shards hold about 1 / shards of the bytes each)."""
    sizes = [math.prod(s) * itemsize for s in shapes.values()]
    share = sum(sizes) / shards
    names, plan, before = shard_names(shards), {}, 0
    for key, size in zip(shapes, sizes):
        plan[key] = names[min(shards - 1, int((before + size / 2) // share))]
        before += size
    if empty := [n for n in names if n not in plan.values()]:
        raise ValueError(f"{len(shapes)} tensors leave shard(s) {', '.join(empty)} empty: fewer shards, please")
    return plan


def dit_tensor(key: str, shape: tuple[int, ...], mc: ModelConfig, noise: Noise, dtype: torch.dtype) -> torch.Tensor:
    """One DiT tensor of random values shaped as init_weights draws them: modulation N(0, 1/dim), norms 1,
    biases 0, the rest Xavier-normal (the variance of init_weights' Xavier-uniform)."""
    if key.endswith("modulation"):
        return noise.normal(f"dit/{key}", shape, mc.dim**-0.5, dtype)
    if len(shape) == 1:
        return (torch.ones if "norm" in key else torch.zeros)(shape, dtype=dtype)
    fan_out, fan_in = shape[0], math.prod(shape[1:])
    return noise.normal(f"dit/{key}", shape, math.sqrt(2.0 / (fan_in + fan_out)), dtype)


def write_sharded_dit(folder: Path, mc: ModelConfig, noise: Noise, dtype: torch.dtype, shards: int,
                      report: Report) -> None:
    """The DiT as `shards` safetensors files and their index, one shard in host memory at a time."""
    from safetensors.torch import save_file

    shapes = dit_shapes(mc)
    plan = shard_plan(shapes, dtype.itemsize, shards)
    for name in shard_names(shards):
        t = time.perf_counter()
        tensors = {k: dit_tensor(k, shapes[k], mc, noise, dtype) for k, f in plan.items() if f == name}
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        del tensors
        report.wrote(folder / name, t)
    t = time.perf_counter()
    total = sum(math.prod(s) * dtype.itemsize for s in shapes.values())
    index = {"metadata": {"total_size": total}, "weight_map": plan}
    (folder / DIT_INDEX).write_text(json.dumps(index, indent=2) + "\n")
    report.wrote(folder / DIT_INDEX, t)


def lora_state_dict(shapes: dict[str, tuple[int, int]], rank: int, noise: Noise, tag: str) -> dict[str, torch.Tensor]:
    """PEFT keys (`base_model.model.<module>.lora_A.weight` [r, in], `lora_B` [out, r]) for every Linear named."""
    out = {}
    for module, (n_out, n_in) in shapes.items():
        prefix = f"base_model.model.{module}"
        out[f"{prefix}.lora_A.weight"] = noise.normal(f"{tag}/{module}/A", (rank, n_in), n_in**-0.5, torch.bfloat16)
        out[f"{prefix}.lora_B.weight"] = noise.normal(f"{tag}/{module}/B", (n_out, rank), LORA_B_STD, torch.bfloat16)
    return out


# ---------------------------------------------------------------------------------------------- main


def make_files(out: str | Path, size: str = "full", seed: int = 0, device: str = "auto",
               base_dtype: str = "bf16", threads: int | None = None) -> dict[str, int]:
    """Write every file under `out`; returns {relative path: bytes}."""
    spec = SIZES[size]
    out = Path(out)
    wan = out / (WAN_14B_DIR if spec["shards"] else WAN_DIR)
    wan.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else "cpu" if device == "auto" else device)
    noise = Noise(seed, dev, threads or min(16, os.cpu_count() or 1))
    mc = ModelConfig.from_name(spec["preset"])
    if spec["umt5"]["d_model"] != mc.text_dim:
        raise RuntimeError(f"umT5 d_model {spec['umt5']['d_model']} != the {mc.name} DiT's text_dim {mc.text_dim}")
    base_dtype = torch.float32 if base_dtype == "fp32" else torch.bfloat16
    report = Report(out)
    log(f"make_wan_files: size={size} seed={seed} noise on {dev} -> {out}")
    dits = None
    if not spec["shards"]:
        # the three DiTs' init_weights draw on one CPU core each (a serial generator): run them beside the rest
        dits = ThreadPoolExecutor(max_workers=3)
        base_f = dits.submit(dit_state_dict, mc, seed, base_dtype)
        ema_f = dits.submit(dit_state_dict, mc, seed + 1, torch.bfloat16)
        longlive_f = dits.submit(dit_state_dict, mc, seed + 2, torch.bfloat16)

    t = time.perf_counter()
    write_tokenizer(wan / WAN_TOKENIZER, spec["umt5"]["vocab_size"])
    report.wrote(wan / WAN_TOKENIZER, t)

    t = time.perf_counter()
    write_umt5(wan / WAN_CHECKPOINT, spec["umt5"], noise)
    report.wrote(wan / WAN_CHECKPOINT, t)

    t = time.perf_counter()
    write_wan_vae(wan / WAN_VAE_FILE, spec["vae_base_dim"], seed)
    report.wrote(wan / WAN_VAE_FILE, t)

    t = time.perf_counter()
    (wan / "config.json").write_text(json.dumps(wan_config_json(mc), indent=2) + "\n")
    report.wrote(wan / "config.json", t)
    if spec["shards"]:
        write_sharded_dit(wan, mc, noise, base_dtype, spec["shards"], report)
    else:
        write_checkpoints(out, wan, mc, spec["lora_rank"], noise, base_f, ema_f, longlive_f, report)
        dits.shutdown()

    t = time.perf_counter()
    write_taehv(out / TAEHV_FILE, spec["taehv_n_f"], seed)
    report.wrote(out / TAEHV_FILE, t)

    total = sum(report.files.values())
    log(f"done: {len(report.files)} files, {total / 1e9:.2f} GB in {time.perf_counter() - report.t0:.1f} s")
    return dict(sorted(report.files.items()))


def write_checkpoints(out: Path, wan: Path, mc: ModelConfig, rank: int, noise: Noise, base_f, ema_f, longlive_f,
                      report: Report) -> None:
    """The 1.3B's: the Wan folder's own DiT, Self-Forcing's and LongLive's checkpoints and the LoRA."""
    from safetensors.torch import save_file

    t = time.perf_counter()
    base = base_f.result()
    save_file(base, str(wan / DIT_FILE), metadata={"format": "pt"})
    linears = {f"blocks.{i}.{m}": tuple(base[f"blocks.{i}.{m}.weight"].shape)
               for i in range(mc.num_layers) for m in LORA_TARGETS}
    del base
    report.wrote(wan / DIT_FILE, t)

    t = time.perf_counter()
    ema = ema_f.result()
    raw = {k: v.flip(0).contiguous() for k, v in ema.items()}  # distinct tensors, other values
    torch.save({"generator_ema": {f"model.{k}": v for k, v in ema.items()},
                "generator": {f"model.{k}": v for k, v in raw.items()}}, out / SELF_FORCING_FILE)
    del ema, raw
    report.wrote(out / SELF_FORCING_FILE, t)

    t = time.perf_counter()
    gen = longlive_f.result()
    torch.save({"generator": {f"model.{k}": v for k, v in gen.items()}}, out / LONGLIVE_BASE_FILE)
    del gen
    report.wrote(out / LONGLIVE_BASE_FILE, t)

    t = time.perf_counter()
    torch.save({"generator_lora": lora_state_dict(linears, rank, noise, "generator_lora"),
                "critic_lora": lora_state_dict(linears, rank, noise, "critic_lora"),
                "step": 0}, out / LORA_FILE)
    report.wrote(out / LORA_FILE, t)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder to write into (created)")
    p.add_argument("--size", choices=sorted(SIZES), default="full")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="where the umT5/LoRA noise is drawn: auto (cuda if any), cuda, cpu")
    p.add_argument("--base-dtype", choices=("bf16", "fp32"), default="bf16",
                   help="dtype of the Wan folder's own DiT safetensors (fp32 at 14b: 57 GB)")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    files = make_files(args.out, args.size, args.seed, args.device, args.base_dtype)
    print(json.dumps({"benchmark": "make_wan_files", "out": str(args.out), "size": args.size, "seed": args.seed,
                      "seconds": round(time.perf_counter() - t0, 1), "total_bytes": sum(files.values()),
                      "files": files}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
