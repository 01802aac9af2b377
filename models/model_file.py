"""Whole model files: a trained model in one safetensors file, as `python -m models.train --export` writes it.

The DiT, its streaming decoder, the latent encoder it was trained with and the text vectors of its caption
words, with the config and preset it was trained as (`ModelFile`, `read_model_file`). The tiny preset's
ships with the package (`BUILTIN_WEIGHTS`, its input adapter inside: it follows an input video);
`resolve_weights` says which file a `weights=` choice names. Checkpoints of a DiT alone are
models/weights.py's.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from models.config import ModelConfig
from models.stream import INPUT_KINDS
from models.weights import CheckpointError

log = logging.getLogger(__name__)


BUILTIN_WEIGHTS = Path(__file__).resolve().parent / "assets" / "tiny.safetensors"
"""The tiny preset's trained model, shipped with the package (package data): `python -m models.train --export`."""
WEIGHTS = ("auto", "builtin", "random")  # `weights=` choices besides a path to a model file
BUILTIN_STYLES = BUILTIN_WEIGHTS.with_name("styles")
"""Style LoRAs trained for the built-in model (`python -m models.train_style --export`), one file a style, shipped with
the package: what `serve` offers with the built-in weights unless --lora-dir says otherwise."""


INPUT_ADAPTER = "input"
"""A model file's LoRA for the streams that have an input (a video to follow, a start image), which the generator
applies to those streams only (models/generator.py `input_adapter`; trained by `python -m models.train_input`)."""


def shipped_styles(weights: Path | None) -> Path | None:
    """The folder of styles trained for a model file: BUILTIN_STYLES for the built-in model's when it is installed
    and holds a file, None for any other model (a style is trained for one model's weights)."""
    if weights is None or weights.resolve() != BUILTIN_WEIGHTS or not BUILTIN_STYLES.is_dir():
        return None
    return BUILTIN_STYLES if any(p.suffix == ".safetensors" for p in BUILTIN_STYLES.iterdir()) else None


def shipped() -> dict[str, Path]:
    """The shipped model files by their `weights=` name (read at call time: tests point them elsewhere)."""
    return {"builtin": BUILTIN_WEIGHTS}


@dataclass(frozen=True)
class ModelFile:
    """A trained model in one safetensors file, as `python -m models.train --export` writes it: the DiT
    (`dit.*`), its streaming decoder (`decoder.*`), the latent encoder it was trained with (`pca.*`, the
    encoder of video-to-video input) and the text vectors of the caption words (`text.vectors`, one row per word of
    the metadata's `text.words`); the metadata's `model` is the ModelConfig trained (JSON), `preset` its
    preset's name, `sampler.timesteps` (optional, JSON) the denoising schedule to sample it with. Optional too: the
    input adapter (`input.<Linear>.lora_A.weight`, `.lora_B.weight`, the metadata's `input.alpha` and `input.kinds`,
    the inputs it was trained for: "video,image" when not given; INPUT_ADAPTER)."""

    path: Path
    preset: str  # the preset it was trained as (its resolution and sampling defaults)
    config: ModelConfig  # the shapes trained: the preset's, maybe grown (dim, layers)
    dit: dict[str, torch.Tensor]  # CausalWanModel's state dict
    decoder: dict[str, torch.Tensor]  # TinyStreamingDecoder's state dict
    words: tuple[str, ...]  # the caption words, in the order of `vectors`' rows
    vectors: torch.Tensor  # [len(words), text_dim] their text-encoder vectors, as the model was trained with
    timesteps: tuple[float, ...] | None = None  # the schedule it samples best with (None: the generator's default)
    pca: dict[str, torch.Tensor] = field(default_factory=dict)  # BlockPCA's state dict (empty: none in the file)
    # the input adapter (INPUT_ADAPTER): {Linear's name: (A [r, in], B [out, r], alpha)}; empty: none in the file
    input_adapter: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = field(default_factory=dict)
    input_kinds: tuple[str, ...] = INPUT_KINDS  # the inputs it was trained for (the metadata's `input.kinds`)


@functools.cache  # once per process: the CLI resolves before the server starts, the engine again
def _warn_not_installed(path: Path) -> None:
    log.warning("the built-in model (%s) is not in this install: random weights. Train it with "
                "`python -m models.train --export FILE` and pass --weights FILE, or --weights random to say so", path)


def resolve_weights(weights: str | None, preset: str, checkpoint: str | None = None, wan_dir: str | None = None) -> Path | None:
    """The model file that `weights` names, or None for the DiT of `checkpoint` / `wan_dir`, else random
    weights. None or "random": no model file ("random" with a checkpoint or a Wan folder is a contradiction);
    "builtin": the shipped one (the tiny preset's); "auto": the shipped one for the tiny preset when no
    checkpoint or Wan folder is given and the file is installed, else None (random weights, with a warning when
    the tiny preset's file is missing); anything else: a path to a model file."""
    given = "a checkpoint" if checkpoint else "a Wan folder" if wan_dir else None
    if weights is None:
        return None
    if weights == "auto":
        if preset != "tiny" or given is not None:
            return None
        if not BUILTIN_WEIGHTS.is_file():
            _warn_not_installed(BUILTIN_WEIGHTS)
            return None
        return BUILTIN_WEIGHTS
    if weights == "random":
        if given:
            raise ValueError(f"weights 'random' asks for random DiT weights, but {given} was given too: drop one")
        return None
    if weights == "follow" and not Path(weights).exists():  # the separate file it named is gone
        raise ValueError("weights 'follow' is no more: the built-in weights (auto, builtin) follow an input video "
                         "themselves, through their input adapter")
    path = shipped().get(weights) or Path(weights)
    if given:
        raise ValueError(
            f"weights {weights!r} is a whole model (DiT, decoder, text vectors), and {given} was given too: drop one "
            "(a checkpoint or a Wan folder goes with weights 'random' or 'auto')"
        )
    if weights in shipped() and preset != "tiny":
        raise ValueError(f"the built-in weights ({weights}) are the tiny preset's, not {preset!r}: use --preset tiny")
    return path


def read_model_file(path: str | Path) -> ModelFile:
    """A model file's tensors and metadata, checked for what generation needs; a missing or malformed file
    is a CheckpointError that says what is wrong (the shipped file's says how to get it back)."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        if path == BUILTIN_WEIGHTS:
            raise CheckpointError(
                f"the built-in model's weights are missing: {path} is not there. They ship with the package "
                "(package data): reinstall it (pip install -e . from a checkout that has the file), pass "
                "--weights FILE for a model file made by `python -m models.train --export FILE`, or "
                "--weights random for random weights"
            )
        raise CheckpointError(f"model file {path} does not exist (weights load from a local path only)")
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"model file {path} is not a readable safetensors file: {e}") from e
    lacking = [k for k in ("preset", "model", "text.words") if k not in meta]
    if lacking or "text.vectors" not in tensors:
        raise CheckpointError(
            f"{path} is not a model file of `python -m models.train --export`: it lacks "
            f"{', '.join([*(f'metadata {k!r}' for k in lacking), *(['text.vectors'] if 'text.vectors' not in tensors else [])])}"
        )
    try:
        fields = json.loads(meta["model"])
        config = ModelConfig(**{**fields, "patch": tuple(fields["patch"])})
        words = tuple(json.loads(meta["text.words"]))
        timesteps = tuple(float(t) for t in json.loads(meta["sampler.timesteps"])) if "sampler.timesteps" in meta else None
    except (TypeError, KeyError, ValueError) as e:
        raise CheckpointError(f"model file {path}: its metadata does not describe a model ({e})") from e
    vectors = tensors.pop("text.vectors")
    if tuple(vectors.shape) != (len(words), config.text_dim):
        raise CheckpointError(
            f"model file {path}: text.vectors is {tuple(vectors.shape)}, expected ({len(words)}, {config.text_dim}) "
            "(one row per word of text.words, text_dim wide)"
        )
    parts: dict[str, dict[str, torch.Tensor]] = {"dit": {}, "decoder": {}, "pca": {}, INPUT_ADAPTER: {}}
    for key, t in tensors.items():
        head, _, rest = key.partition(".")
        if head not in parts or not rest:
            raise CheckpointError(f"model file {path}: unexpected tensor {key!r} (expected dit.*, decoder.*, pca.*, input.*)")
        parts[head][rest] = t
    kinds = tuple(meta.get(f"{INPUT_ADAPTER}.kinds", ",".join(INPUT_KINDS)).split(","))
    if not set(kinds) <= set(INPUT_KINDS):
        raise CheckpointError(f"model file {path}: metadata 'input.kinds' is {','.join(kinds)!r}: name some of {', '.join(INPUT_KINDS)}")
    return ModelFile(path, meta["preset"], config, parts["dit"], parts["decoder"], words, vectors, timesteps, parts["pca"],
                     _input_pairs(path, parts[INPUT_ADAPTER], meta.get(f"{INPUT_ADAPTER}.alpha")), kinds)


def _input_pairs(path: Path, tensors: dict[str, torch.Tensor], alpha: str | None) -> dict[str, tuple]:
    """The input adapter's {Linear: (A, B, alpha)} from its `input.*` tensors (without the prefix), read as a
    LoRA file's are (models/adapters.py `pairs_of`); every pair takes the metadata's `input.alpha`."""
    from models.adapters import AdapterError, pairs_of

    if not tensors:
        return {}
    try:
        value = float(alpha) if alpha is not None else None
    except ValueError:
        value = None
    if value is None or not value > 0:
        raise CheckpointError(f"model file {path}: its input adapter needs a positive metadata 'input.alpha' (got {alpha!r})")
    try:
        return pairs_of(f"{path} (input.*)", tensors, value)
    except AdapterError as e:
        raise CheckpointError(f"model file {path}: its input adapter is not a LoRA: {e}") from e


def embed_input_adapter(model: str | Path, adapter: str | Path, out: str | Path, kinds: Sequence[str] | None = None) -> Path:
    """Write `out`: the model file `model` with the LoRA file `adapter` (`python -m models.train_input --export`'s)
    as its input adapter (one in `model` already is replaced), for the inputs `kinds` names (default: those its
    metadata's `input_kinds` names, else both). The adapter's pairs must share one alpha."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from models.adapters import read_lora

    pairs, adapter_meta = read_lora(adapter)
    alphas = {a for _, _, a in pairs.values()}
    if len(alphas) != 1 or None in alphas:
        raise CheckpointError(f"LoRA {adapter}: an input adapter needs one alpha for every pair, got {sorted(map(str, alphas))}")
    with safe_open(str(model), "pt") as f:
        meta = dict(f.metadata() or {})
        tensors = {k: f.get_tensor(k) for k in f.keys() if not k.startswith(f"{INPUT_ADAPTER}.")}
    for module, (a, b, _) in pairs.items():
        tensors[f"{INPUT_ADAPTER}.{module}.lora_A.weight"] = a.float().contiguous()
        tensors[f"{INPUT_ADAPTER}.{module}.lora_B.weight"] = b.float().contiguous()
    meta[f"{INPUT_ADAPTER}.alpha"] = str(alphas.pop())
    if kinds is None:
        kinds = adapter_meta.get("input_kinds", ",".join(INPUT_KINDS)).split(",")
    meta[f"{INPUT_ADAPTER}.kinds"] = ",".join(kinds)
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    try:
        read_model_file(tmp)  # what serve will read: checked before it replaces anything
    except CheckpointError:
        tmp.unlink()
        raise
    tmp.replace(out)
    return out
