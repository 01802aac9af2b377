"""Building a chunk generator from local files, nothing downloaded: `build_generator` and its factories.

The DiT (random from a seed, a checkpoint with an optional LoRA, or a whole model file of `python -m
models.train --export`), the text encoder (the built-in hashing one, or umT5 from a Wan folder), and the
streaming decoder with the encoder of the same autoencoder (`DECODERS`: tiny, the Wan VAE, TAEHV). The DiT
and umT5 are refused, with the figures, before they load when they would not fit the GPU.

models/generator.py is the runtime this assembles.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import torch

from kvcache.units import format_bytes
from models.config import ModelConfig
from models.decoder import NoDecoder, StreamingDecoder, TinyStreamingDecoder
from models.dit import CausalWanModel
from models.encoder import BlockPCAEncoder, StreamingEncoder
from models.generator import ChunkGenerator
from models.latent import BlockPCA
from models.stream import GeneratorConfig
from models.text import TextEncoder

log = logging.getLogger(__name__)


DECODERS = ("auto", "tiny", "wan-vae", "taehv")


def build_generator(
    preset: str = "tiny",
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    seed: int = 0,
    checkpoint: str | None = None,
    cfg: GeneratorConfig = GeneratorConfig(),
    lora: str | None = None,
    lora_alpha: float | None = None,
    wrapper: str = "auto",
    wan_dir: str | None = None,
    decoder: str = "auto",
    taehv: str | None = None,
    weights: str | None = None,
    dit_only: bool = False,
) -> ChunkGenerator:
    """A generator for a preset, everything from local files, nothing downloaded.

    `weights`: a whole trained model (DiT, decoder and text vectors) from one file: "builtin" (the tiny
    preset's, shipped with the package), a path to a file of `python -m models.train --export`, or "auto"
    (the built-in one for the tiny preset with no checkpoint and no Wan folder); None or "random" (the
    default) for what follows (models/model_file.py `resolve_weights`).

    The DiT: random weights from `seed`, or a checkpoint (a .pt/.safetensors file, `wrapper` choosing
    its `generator_ema` / `generator`, or a Wan2.1 folder) whose shapes win over the preset's, checked
    against the config.json of `wan_dir` and of a checkpoint folder, which also give the heads
    (models/weights.py `infer_config`), with an optional LoRA merged in fp32; with `wan_dir` and no
    checkpoint, the folder's own DiT. `wan_dir` (either layout) also gives the umT5 text encoder and the
    Wan VAE. `decoder`: tiny (the built-in), wan-vae (from `wan_dir`), taehv (`taehv`, a taew2_1.pth),
    auto (wan-vae with `wan_dir`, else tiny). The DiT is made in `dtype` on `device` and filled there,
    never whole in fp32 on the host (a 14B's would be 57 GB). `dit_only`: no umT5 and no decoder are loaded
    (a group's worker rank, models/parallel.py): the hashing encoder and `NoDecoder` stand in."""
    from models.dit_ops import Rope
    from models.model_file import resolve_weights
    from models.weights import dit_configs, infer_config, load_state_dict, merge_lora, read_state_dict

    if decoder not in DECODERS:
        raise ValueError(f"decoder {decoder!r} is unknown; use one of {', '.join(DECODERS)}")
    model_file = resolve_weights(weights, preset, checkpoint, wan_dir)
    if model_file is not None:
        if lora or decoder not in ("auto", "tiny"):
            raise ValueError(f"a model file ({model_file}) brings its own decoder and takes no LoRA: drop --lora / --decoder")
        return _from_model_file(model_file, preset, device, dtype, cfg)
    checkpoint = checkpoint or wan_dir
    if lora and not checkpoint:
        raise ValueError("lora needs a checkpoint (or a Wan folder): it is merged into the checkpoint's weights")
    mc = ModelConfig.from_name(preset)
    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if checkpoint:
        # read in the model's dtype, unless a LoRA is merged first (in fp32, into the weights as stored)
        sd = read_state_dict(checkpoint, wrapper, dtype=None if lora else dtype)
        mc = infer_config(mc, sd, dit_configs(checkpoint, wan_dir))
        if lora and any(v.is_floating_point() and v.dtype.itemsize > dtype.itemsize for v in sd.values()):
            merge_lora(sd, lora, alpha=lora_alpha)  # wider than the model: merged before the one rounding
            lora = None
        model = _empty_model(mc, device, dtype, sum(v.numel() for v in sd.values()))
        model = load_state_dict(model, sd)
        del sd
        if lora:
            merge_lora(model, lora, alpha=lora_alpha)  # logs the layers merged
    else:
        model = _empty_model(mc, device, dtype, None).init_weights(seed)
    model.rope = Rope(mc)  # its tables are plain tensors, not parameters: built on meta
    model = model.eval()
    if dit_only:
        return ChunkGenerator(model, cfg, None, NoDecoder(mc))
    text_encoder = _text_encoder(wan_dir, mc, device, dtype)
    dec, enc = _decoder(decoder, wan_dir, taehv, device)
    return ChunkGenerator(model, cfg, text_encoder, dec, enc)


def _empty_model(mc: ModelConfig, device: torch.device, dtype: torch.dtype, numel: int | None) -> CausalWanModel:
    """The DiT's modules in `dtype` on `device`, uninitialized (no default init of weights about to be
    overwritten); refused with the figures when its `numel` weights would not fit the GPU."""
    with torch.device("meta"):
        model = CausalWanModel(mc).to(dtype)
    if numel is None:
        numel = sum(p.numel() for p in model.parameters())
    _check_free_memory(f"the DiT ({numel / 1e9:.2f} B parameters)", numel * dtype.itemsize, device)
    return model.to_empty(device=device)


def _from_model_file(
    path: Path, preset: str, device: str | torch.device, dtype: torch.dtype | None, cfg: GeneratorConfig
) -> ChunkGenerator:
    """A generator from a whole model file: the DiT built to the file's own config (the preset's shapes as
    trained, maybe grown), its decoder, and the text encoder with its caption words' stored vectors."""
    from models.dit_ops import Rope
    from models.text import VocabTextEncoder
    from models.model_file import read_model_file
    from models.weights import CheckpointError, load_state_dict

    mf = read_model_file(path)
    if mf.preset != preset:
        raise CheckpointError(f"model file {path} was trained as the {mf.preset!r} preset, not {preset!r}: use --preset {mf.preset}")
    mc = mf.config
    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device("meta"):  # no random init of weights about to be overwritten
        model = CausalWanModel(mc)
    model = load_state_dict(model.to_empty(device="cpu"), mf.dit)
    model.rope = Rope(mc)  # its tables are plain tensors, not parameters: built on meta above
    decoder = load_state_dict(TinyStreamingDecoder(mc), mf.decoder)
    model = model.to(device=device, dtype=dtype).eval()
    decoder = decoder.to(device=device, dtype=dtype).eval()
    text_encoder = VocabTextEncoder(mc.text_dim, mc.text_len, mf.words, mf.vectors)
    log.info("model %s: %s preset, dim %d, %d layers, %d caption words", path, mf.preset, mc.dim, mc.num_layers, len(mf.words))
    encoder = BlockPCAEncoder(BlockPCA.for_model(mc, mf.pca), device) if mf.pca else None
    gen = ChunkGenerator(model, _file_schedule(cfg, mf.timesteps), text_encoder, decoder, encoder)
    if mf.input_adapter:
        adapter = gen.set_input_adapter(mf.input_adapter, str(path), mf.input_kinds)
        log.info("model %s: an input adapter of rank %d on %d Linears, for the streams with input of kind %s",
                 path, adapter.rank, len(adapter.layers), " or ".join(mf.input_kinds))
    return gen


def _file_schedule(cfg: GeneratorConfig, timesteps: tuple[float, ...] | None) -> GeneratorConfig:
    """The model file's own denoising levels in place of the default schedule's: as many of them as the
    caller's schedule has (a steps-N option keeps the first N of the default, so N of the file's). A
    schedule the caller wrote out (not a prefix of the default) stays as it is."""
    n, default = len(cfg.timesteps), GeneratorConfig.timesteps
    if timesteps is None or cfg.timesteps != default[:n] or n > len(timesteps):
        return cfg
    log.info("sampling with the model file's timesteps %s", ", ".join(f"{t:g}" for t in timesteps[:n]))
    return replace(cfg, timesteps=timesteps[:n])


def _text_encoder(wan_dir: str | None, mc: ModelConfig, device: torch.device, dtype: torch.dtype) -> TextEncoder | None:
    """umT5 from the Wan folder (None: the built-in hashing encoder), checked against the DiT's text input."""
    if not wan_dir:
        return None
    from models.umt5 import DIFFUSERS_ENCODER, WAN_CHECKPOINT, UMT5TextEncoder, detect_layout

    root = Path(wan_dir)
    files = [root / WAN_CHECKPOINT] if detect_layout(root) == "wan" else sorted((root / DIFFUSERS_ENCODER).glob("*.safetensors"))
    _check_free_memory("the umT5 text encoder", sum(f.stat().st_size for f in files), device)  # files in bf16 (Wan's)
    enc = UMT5TextEncoder.from_wan_dir(wan_dir, device=device, dtype=dtype, text_len=mc.text_len)
    if enc.text_dim != mc.text_dim:
        raise ValueError(
            f"the text encoder in {wan_dir} gives {enc.text_dim}-wide embeddings but the DiT's text_embedding takes "
            f"{mc.text_dim}: use the Wan folder that goes with this checkpoint"
        )
    return enc


def _check_free_memory(what: str, need_bytes: int, device: torch.device) -> None:
    """Refuse to start, with the figures, what would not fit on the GPU (rather than fail half loaded)."""
    if device.type != "cuda":
        return
    free, total = torch.cuda.mem_get_info(device)
    if need_bytes > free:
        raise ValueError(
            f"{what} needs about {format_bytes(need_bytes)} on {device}, which has {format_bytes(free)} free of "
            f"{format_bytes(total)}: stop what else runs on that GPU, or use another (--device cuda:N)"
        )


def _decoder(
    kind: str, wan_dir: str | None, taehv: str | None, device: torch.device
) -> tuple[StreamingDecoder | None, StreamingEncoder | None]:
    """The streaming decoder `kind` names and the encoder of the same autoencoder (video-to-video input):
    (None, None) for the built-in tiny decoder (ChunkGenerator makes both); the TAEHV file's encoder, or None
    for a file without one (can_take_input is then False)."""
    if kind == "auto":
        kind = "wan-vae" if wan_dir else "taehv" if taehv else "tiny"
    if kind == "tiny":
        return None, None
    if kind == "wan-vae":
        if not wan_dir:
            raise ValueError("the wan-vae decoder loads from the Wan2.1 folder: give --wan-dir PATH")
        from models.wan_vae import WanVAEDecoder, WanVAEEncoder

        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        decoder = WanVAEDecoder.from_path(wan_dir, device, dtype)
        return decoder, WanVAEEncoder(decoder.vae)  # the same VAE's encoder: loaded once
    if not taehv:
        raise ValueError("the taehv decoder loads TAEHV's taew2_1.pth: give --taehv PATH")
    from models.taehv import TAEHVDecoder, TAEHVEncoder
    from models.weights import CheckpointError

    dtype = torch.float16 if device.type == "cuda" else torch.float32
    try:
        encoder = TAEHVEncoder.from_path(taehv, device, dtype)
    except CheckpointError as e:
        log.warning("no input video with this TAEHV file: %s", e)
        encoder = None
    return TAEHVDecoder.from_path(taehv, device, dtype), encoder
