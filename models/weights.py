"""Loading Wan / Self-Forcing / LongLive DiT checkpoints from a local path (never from a hub).

What loads, all into Wan2.1's module names (models/dit.py):
- a .safetensors / .pt state dict, bare or wrapped: Self-Forcing's `self_forcing_dmd.pt` keeps the
  inference weights under `generator_ema` (and the raw ones under `generator`), LongLive's
  `longlive_base.pt` under `generator`; keys may carry a `model.` prefix (Self-Forcing wraps the DiT);
- a Wan2.1 folder: Wan's original layout (`config.json` + `diffusion_pytorch_model*.safetensors` at the
  root, maybe sharded with an index json) or the Diffusers layout (`transformer/`, in diffusers'
  WanTransformer3DModel names, renamed here to Wan's);
- a LoRA (LongLive's `lora.pt`, PEFT keys, maybe under `generator_lora`), merged into the weights.

A whole model file of `python -m models.train --export` (DiT, decoder and text vectors) is
models/model_file.py's.

The model's shapes come from the weights and the Wan folder's `config.json` (`read_wan_config`,
`infer_config`), each checked against the other; the preset gives resolution and sampling.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from models.config import ModelConfig

log = logging.getLogger(__name__)

WRAPPERS = ("auto", "generator", "generator_ema")  # `wrapper=` choices: auto takes generator_ema, else generator
_INNER_WRAPPERS = ("state_dict", "model")  # generic nesting taken off after the generator choice
_PREFIXES = ("base_model.model.", "model.", "module.")  # leading prefixes stripped, repeatedly
_INFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")  # wrapper names, dropped anywhere
_LORA = re.compile(r"^(?P<module>.+)\.(?P<half>lora_A|lora_B|lora_down|lora_up)(?:\.(?P<adapter>[^.]+))?\.weight$")
_LORA_HALF = {"lora_A": "A", "lora_down": "A", "lora_B": "B", "lora_up": "B"}
DIT_INDEX = "diffusion_pytorch_model.safetensors.index.json"  # a sharded DiT's key -> shard file map (the 14B's)

# diffusers' WanTransformer3DModel name -> Wan's name (the inverse of diffusers' convert_wan_to_diffusers.py)
_DIFFUSERS_TOP = {
    "scale_shift_table": "head.modulation",
    "proj_out.weight": "head.head.weight",
    "proj_out.bias": "head.head.bias",
    "patch_embedding.weight": "patch_embedding.weight",
    "patch_embedding.bias": "patch_embedding.bias",
    "condition_embedder.time_embedder.linear_1.": "time_embedding.0.",
    "condition_embedder.time_embedder.linear_2.": "time_embedding.2.",
    "condition_embedder.time_proj.": "time_projection.1.",
    "condition_embedder.text_embedder.linear_1.": "text_embedding.0.",
    "condition_embedder.text_embedder.linear_2.": "text_embedding.2.",
}
_DIFFUSERS_BLOCK = {  # after `blocks.N.`
    "scale_shift_table": "modulation",
    "attn1.to_q.": "self_attn.q.",
    "attn1.to_k.": "self_attn.k.",
    "attn1.to_v.": "self_attn.v.",
    "attn1.to_out.0.": "self_attn.o.",
    "attn1.norm_q.": "self_attn.norm_q.",
    "attn1.norm_k.": "self_attn.norm_k.",
    "attn2.to_q.": "cross_attn.q.",
    "attn2.to_k.": "cross_attn.k.",
    "attn2.to_v.": "cross_attn.v.",
    "attn2.to_out.0.": "cross_attn.o.",
    "attn2.norm_q.": "cross_attn.norm_q.",
    "attn2.norm_k.": "cross_attn.norm_k.",
    "norm2.": "norm3.",  # diffusers orders the norms 1, 2, 3 as applied; Wan's affine cross-attn norm is norm3
    "ffn.net.0.proj.": "ffn.0.",
    "ffn.net.2.": "ffn.2.",
}


class CheckpointError(ValueError):
    """A checkpoint that does not match the model: the message names the keys."""


def _shown(keys) -> str:
    keys = list(keys)
    return ", ".join(map(str, keys[:8])) + (f", ... ({len(keys) - 8} more)" if len(keys) > 8 else "")


# ---------------------------------------------------------------------------------------------- reading


def read_state_dict(path: str | Path, wrapper: str = "auto", dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Tensors of a local .safetensors / .pt file or Wan2.1 folder, unwrapped to the DiT's own keys;
    floating-point ones wider than `dtype` cast down to it when given (a sharded folder shard by shard,
    so that a 14B DiT stored in fp32, 57 GB, never sits in host memory in fp32 as a whole)."""
    path = Path(path)
    if path.is_dir():
        if wrapper != "auto":
            raise CheckpointError(f"checkpoint {path} is a Wan folder: wrapper={wrapper!r} applies to .pt files only")
        return load_wan_dir_dit(path, dtype)
    return _cast(unwrap(_read_file(path), wrapper), dtype)


def _cast(sd: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """`sd` with its floating-point tensors wider than `dtype` cast down to it (None: as they are)."""
    if dtype is None:
        return sd
    return {k: v.to(dtype) if v.is_floating_point() and v.dtype.itemsize > dtype.itemsize else v for k, v in sd.items()}


def _read_file(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist (weights load from a local path only)")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    if path.suffix in (".pt", ".pth", ".bin"):
        return torch.load(path, map_location="cpu", weights_only=True)
    raise CheckpointError(f"checkpoint {path}: expected .safetensors or .pt, got {path.suffix!r}")


def unwrap(sd: dict, wrapper: str = "auto") -> dict[str, torch.Tensor]:
    """Take the `generator_ema` / `generator` (then `state_dict` / `model`) wrappers off and strip
    `model.`-style prefixes. `wrapper="auto"` takes `generator_ema` when present, else `generator`, else
    the dict as it is; `"generator"` / `"generator_ema"` insist on that entry (LongLive's base wants
    `generator`: its EMA copy, if any, is not what it runs)."""
    if wrapper not in WRAPPERS:
        raise CheckpointError(f"wrapper must be one of {', '.join(WRAPPERS)}, got {wrapper!r}")
    top = sorted(map(str, sd))
    if wrapper == "auto":
        wrapper = next((w for w in ("generator_ema", "generator") if isinstance(sd.get(w), dict)), None)
    elif not isinstance(sd.get(wrapper), dict):
        raise CheckpointError(f"checkpoint has no {wrapper!r} state dict; its top-level keys are: {_shown(top)}")
    if wrapper is not None:
        sd = sd[wrapper]
    while (inner := next((w for w in _INNER_WRAPPERS if isinstance(sd.get(w), dict)), None)) is not None:
        sd = sd[inner]
    return _tensors(sd, what="checkpoint", top=top)


def _tensors(sd: dict, what: str, top: list[str]) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in sd.items():
        if not isinstance(v, torch.Tensor):
            raise CheckpointError(
                f"{what} entry {k!r} is a {type(v).__name__}, not a tensor (top-level keys: {_shown(top)})"
            )
        out[_strip(k)] = v
    return out


def _strip(key: str) -> str:
    for infix in _INFIXES:
        key = key.replace(infix, "")
    changed = True
    while changed:
        changed = False
        for p in _PREFIXES:
            if key.startswith(p):
                key, changed = key[len(p) :], True
    return key


# ---------------------------------------------------------------------------------------------- Wan folders


def load_wan_dir_dit(path: str | Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The base DiT of a local Wan2.1 folder, in Wan's names: the original layout (`config.json` +
    `diffusion_pytorch_model*.safetensors` at the root) or the Diffusers layout (`transformer/`, or that
    folder itself), sharded (with `diffusion_pytorch_model.safetensors.index.json`, as the 14B's is) or
    not; floating-point tensors wider than `dtype` cast down to it shard by shard when given."""
    path = Path(path)
    folder = _dit_folder(path)
    sd = _read_shards(folder, dtype)
    if any(k.startswith("condition_embedder.") or ".attn1." in k for k in sd):
        sd = diffusers_to_wan(sd)
    return sd


# config.json's fields in Wan's names (WanModel's), and diffusers' name of each (WanTransformer3DModel's)
_CONFIG_FIELDS = {
    "dim": None,  # diffusers: num_attention_heads * attention_head_dim
    "ffn_dim": "ffn_dim",
    "num_heads": "num_attention_heads",
    "num_layers": "num_layers",
    "in_dim": "in_channels",
    "out_dim": "out_channels",
    "text_dim": "text_dim",
    "text_len": None,  # diffusers' pipeline pads to 512 tokens; its config does not say
    "freq_dim": "freq_dim",
    "eps": "eps",
    "patch_size": "patch_size",
}
_CONFIG_CLASSES = ("WanModel", "WanTransformer3DModel")


@dataclass(frozen=True)
class WanConfig:
    """What a Wan folder's config.json says of its DiT, in Wan's field names; None where it says nothing
    (Wan's own config.json has no text_dim or patch_size, diffusers' no text_len)."""

    path: Path  # the config.json read
    dim: int | None = None
    ffn_dim: int | None = None
    num_heads: int | None = None
    num_layers: int | None = None
    in_dim: int | None = None
    out_dim: int | None = None
    text_dim: int | None = None
    text_len: int | None = None
    freq_dim: int | None = None
    eps: float | None = None
    patch_size: tuple[int, int, int] | None = None


def read_wan_config(path: str | Path) -> WanConfig | None:
    """The DiT's config.json of a local Wan2.1 folder: at its root (Wan's layout) or in `transformer/`
    (Diffusers'), or None when it has none (or `path` is a checkpoint file). Wan's field names, or
    diffusers' (`num_attention_heads` x `attention_head_dim`, `in_channels`, ...); a malformed file, another
    model's config or a non-T2V Wan model is a CheckpointError."""
    path = Path(path)
    if not path.is_dir():
        if path.exists():
            return None  # a state-dict file says nothing of its heads
        raise CheckpointError(f"Wan folder {path} does not exist (weights load from a local path only)")
    file = next((f for f in (path / "config.json", path / "transformer" / "config.json") if f.is_file()), None)
    if file is None:
        return None
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{file} is not readable JSON: {e}") from e
    if not isinstance(raw, dict):
        raise CheckpointError(f"{file} holds a JSON {type(raw).__name__}, not the DiT's config (an object)")
    cls = raw.get("_class_name")
    if cls is not None and cls not in _CONFIG_CLASSES:
        raise CheckpointError(f"{file} is the config of a {cls}, not of a Wan DiT ({' or '.join(_CONFIG_CLASSES)})")
    if raw.get("model_type", "t2v") != "t2v":
        raise CheckpointError(f"{file} describes a Wan {raw['model_type']!r} model: only text-to-video (t2v) DiTs run here")
    fields: dict = {}
    for wan, diffusers in _CONFIG_FIELDS.items():
        value = raw.get(wan, raw.get(diffusers) if diffusers else None)
        if value is not None:
            fields[wan] = _config_value(file, wan, value)
    if "dim" not in fields and raw.get("num_attention_heads") is not None and raw.get("attention_head_dim") is not None:
        fields["dim"] = _config_value(file, "num_attention_heads", raw["num_attention_heads"]) * _config_value(
            file, "attention_head_dim", raw["attention_head_dim"])
    return WanConfig(file, **fields)


def _config_value(file: Path, field: str, value):
    """A config.json value checked: a positive int (eps: a positive number; patch_size: three ints)."""
    if field == "patch_size":
        if not (isinstance(value, list) and len(value) == 3 and all(type(v) is int and v > 0 for v in value)):
            raise CheckpointError(f"{file}: patch_size {value!r} is not three positive ints")
        return tuple(value)
    if field == "eps":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise CheckpointError(f"{file}: eps {value!r} is not a positive number")
        return float(value)
    if type(value) is not int or value <= 0:
        raise CheckpointError(f"{file}: {field} {value!r} is not a positive int")
    return value


def dit_configs(checkpoint: str | Path | None, wan_dir: str | Path | None) -> list[WanConfig]:
    """The config.json files that describe the DiT loaded from `checkpoint` (a file or a Wan folder; None:
    `wan_dir`'s own DiT): the checkpoint folder's own, then `wan_dir`'s, which holds for every checkpoint
    loaded with it. Each is checked against the DiT's tensors (`infer_config`)."""
    folders = [Path(p) for p in (checkpoint, wan_dir) if p]
    configs: list[WanConfig] = []
    for folder in folders:
        cfg = read_wan_config(folder)
        if cfg is not None and all(cfg.path.resolve() != c.path.resolve() for c in configs):
            configs.append(cfg)
    return configs


def _dit_folder(path: Path) -> Path:
    if not path.is_dir():
        raise CheckpointError(f"Wan folder {path} does not exist (weights load from a local path only)")
    for folder in (path, path / "transformer"):
        if (folder / "config.json").is_file() and any(folder.glob("diffusion_pytorch_model*.safetensors")):
            return folder
    found = sorted(p.name for p in path.iterdir())
    raise CheckpointError(
        f"{path} holds no DiT: expected config.json + diffusion_pytorch_model*.safetensors at its root (Wan's layout) "
        f"or in transformer/ (Diffusers' layout); found: {_shown(found)}"
    )


def _read_shards(folder: Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = folder / DIT_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is not a shard index (JSON with a 'weight_map' object): {e!r}") from e
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index}: its weight_map is not an object of key -> shard file name")
        files = sorted(set(weight_map.values()))
        absent = [f for f in files if not (folder / f).is_file()]
        if absent:
            raise CheckpointError(f"{index} names shard(s) that are not in {folder}: {_shown(absent)}")
    else:
        weight_map = None
        files = sorted(p.name for p in folder.glob("diffusion_pytorch_model*.safetensors"))
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        shard = _cast(load_file(str(folder / f)), dtype)
        if weight_map is not None and (stray := sorted(k for k in shard if weight_map.get(k) != f)):
            raise CheckpointError(f"{folder / f} holds key(s) that {index.name} maps elsewhere or not at all: {_shown(stray)}")
        sd.update(shard)
        del shard
    if weight_map is not None and (lost := sorted(set(weight_map) - set(sd))):
        raise CheckpointError(f"{index} maps key(s) that no shard holds: {_shown(lost)}")
    return {_strip(k): v for k, v in sd.items()}


def diffusers_to_wan(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename diffusers' WanTransformer3DModel keys to Wan's; a key with no Wan name (image embedder,
    added K/V projections of I2V, fused projections) is an error naming it."""
    out, unknown = {}, []
    for k, v in sd.items():
        new = _rename(k, _DIFFUSERS_TOP)
        if new is None and (m := re.match(r"^(blocks\.\d+\.)(.+)$", k)):
            rest = _rename(m.group(2), _DIFFUSERS_BLOCK)
            new = m.group(1) + rest if rest is not None else None
        if new is None:
            unknown.append(k)
        else:
            out[new] = v
    if unknown:
        raise CheckpointError(
            f"{len(unknown)} Diffusers transformer key(s) have no Wan2.1 T2V name: {_shown(sorted(unknown))}"
        )
    return out


def _rename(key: str, table: dict[str, str]) -> str | None:
    for src, dst in table.items():
        if key == src or (src.endswith(".") and key.startswith(src)):
            return dst + key[len(src) :]
    return None


# ---------------------------------------------------------------------------------------------- shapes


def infer_config(
    preset_cfg: ModelConfig, state_dict: dict[str, torch.Tensor], configs: Sequence[WanConfig] = ()
) -> ModelConfig:
    """The preset with the DiT's shapes: dim, ffn_dim, num_layers, text_dim, freq_dim, patch and in/out
    channels read from the weights, and checked against each of `configs` (the Wan folder's config.json:
    a field that disagrees with the tensors is a CheckpointError naming the field, its value and the
    tensor's shape). Heads cannot be read from shapes: the config's num_heads; with no config, the
    preset's while dim is the preset's, else the preset's head_dim (128 in every Wan2.1 size) when it
    divides dim, else an error that asks for a config.json. The config's text_len and eps win over the
    preset's; resolution and the decoder stay the preset's."""

    def shape(key: str, ndim: int) -> torch.Size:
        if key not in state_dict:
            raise CheckpointError(f"checkpoint has no {key!r}: cannot infer the model's shape (is it a Wan2.1 DiT?)")
        s = state_dict[key].shape
        if len(s) != ndim:
            raise CheckpointError(f"checkpoint {key!r} has shape {tuple(s)}, expected {ndim} dims")
        return s

    pe = shape("patch_embedding.weight", 5)  # [dim, in_channels, pt, ph, pw]
    dim, in_channels, patch = int(pe[0]), int(pe[1]), tuple(int(p) for p in pe[2:])
    blocks = {int(m.group(1)) for k in state_dict if (m := re.match(r"^blocks\.(\d+)\.", k))}
    if not blocks:
        raise CheckpointError("checkpoint has no blocks.N.* keys: cannot infer num_layers (is it a Wan2.1 DiT?)")
    head = shape("head.head.weight", 2)  # [out_channels * pt * ph * pw, dim]
    patch_numel = patch[0] * patch[1] * patch[2]
    if head[0] % patch_numel:
        raise CheckpointError(f"head.head.weight has {head[0]} outputs, not a multiple of the patch {patch}")
    ffn = shape("blocks.0.ffn.0.weight", 2)  # [ffn_dim, dim]
    text = shape("text_embedding.0.weight", 2)  # [dim, text_dim]
    time = shape("time_embedding.0.weight", 2)  # [dim, freq_dim]
    num_layers = max(blocks) + 1
    # what the tensors say of each config.json field: (value, the tensor that says it)
    seen = {
        "dim": (dim, f"patch_embedding.weight is {tuple(pe)}"),
        "in_dim": (in_channels, f"patch_embedding.weight is {tuple(pe)}"),
        "patch_size": (patch, f"patch_embedding.weight is {tuple(pe)}"),
        "ffn_dim": (int(ffn[0]), f"blocks.0.ffn.0.weight is {tuple(ffn)}"),
        "num_layers": (num_layers, f"blocks run from blocks.0 to blocks.{num_layers - 1}"),
        "out_dim": (int(head[0]) // patch_numel, f"head.head.weight is {tuple(head)} (patch {patch})"),
        "text_dim": (int(text[1]), f"text_embedding.0.weight is {tuple(text)}"),
        "freq_dim": (int(time[1]), f"time_embedding.0.weight is {tuple(time)}"),
    }
    for cfg in configs:
        wrong = [f"{field} {getattr(cfg, field)} but the checkpoint's {where}"
                 for field, (value, where) in seen.items()
                 if getattr(cfg, field) is not None and getattr(cfg, field) != value]
        if wrong:
            raise CheckpointError(
                f"{cfg.path} says " + "; ".join(wrong) + ": it describes another model than the checkpoint (give the "
                "Wan folder of the checkpoint's size, or a config.json that matches it)"
            )
    stated = {c.path: c.num_heads for c in configs if c.num_heads is not None}
    if len(set(stated.values())) > 1:
        raise CheckpointError("the configs disagree on num_heads: " + ", ".join(f"{p} says {h}" for p, h in stated.items()))
    num_heads = next(iter(stated.values()), None)
    if num_heads is None:
        num_heads = _guess_heads(preset_cfg, dim, {k: v for k, (v, _) in seen.items()})
    elif dim % num_heads or (dim // num_heads) % 2 or dim // num_heads < 6:
        raise CheckpointError(
            f"{next(iter(stated))} says num_heads {num_heads}, which does not split the checkpoint's dim {dim} into "
            "heads of an even width >= 6 (3D RoPE)"
        )
    text_len = next((c.text_len for c in configs if c.text_len is not None), preset_cfg.text_len)
    eps = next((c.eps for c in configs if c.eps is not None), preset_cfg.eps)
    try:
        return replace(
            preset_cfg,
            dim=dim,
            ffn_dim=int(ffn[0]),
            num_heads=int(num_heads),
            num_layers=num_layers,
            text_dim=int(text[1]),
            text_len=text_len,
            freq_dim=int(time[1]),
            eps=eps,
            in_channels=in_channels,
            out_channels=int(head[0]) // patch_numel,
            patch=patch,
        )
    except ValueError as e:
        raise CheckpointError(f"the checkpoint's shapes do not fit preset {preset_cfg.name!r}: {e}") from e


def _guess_heads(preset_cfg: ModelConfig, dim: int, seen: dict) -> int:
    """Heads of a DiT no config.json describes: the preset's at the preset's dim, else heads of the
    preset's head_dim when they divide dim (logged as a guess), else an error asking for a config.json."""
    if dim == preset_cfg.dim:
        return preset_cfg.num_heads
    head_dim = preset_cfg.head_dim
    if dim % head_dim == 0:
        log.info("the DiT's dim %d is not the %s preset's and no config.json says its heads: %d heads of %d (the "
                 "preset's head width) assumed", dim, preset_cfg.name, dim // head_dim, head_dim)
        return dim // head_dim
    widths = [w for w in range(6, dim + 1, 2) if dim % w == 0]
    width = max((w for w in widths if w <= head_dim), default=widths[0] if widths else head_dim)
    example = {"_class_name": "WanModel", "model_type": "t2v", "dim": dim, "ffn_dim": seen["ffn_dim"],
               "num_heads": max(1, dim // width), "num_layers": seen["num_layers"], "in_dim": seen["in_dim"],
               "out_dim": seen["out_dim"], "freq_dim": seen["freq_dim"], "text_len": preset_cfg.text_len}
    raise CheckpointError(
        f"cannot tell the DiT's attention heads: its dim {dim} is not a multiple of the {preset_cfg.name!r} preset's "
        f"head width {head_dim}, and no config.json says num_heads. Add the model's config.json to the Wan folder "
        f"given with --wan-dir (Wan's field names), e.g. for heads {width} wide:\n  {json.dumps(example)}"
    )


# ---------------------------------------------------------------------------------------------- loading


def check_state_dict(model: nn.Module, sd: dict[str, torch.Tensor]) -> None:
    """Raise CheckpointError naming every missing, unexpected or mis-shaped key."""
    own = model.state_dict()
    missing = sorted(set(own) - set(sd))
    unexpected = sorted(set(sd) - set(own))
    shapes = sorted(
        f"{k}: checkpoint {tuple(sd[k].shape)} vs model {tuple(own[k].shape)}"
        for k in set(own) & set(sd)
        if sd[k].shape != own[k].shape
    )
    problems = []
    for what, keys in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", shapes)):
        if keys:
            problems.append(f"{len(keys)} {what} key(s): {_shown(keys)}")
    if problems:
        raise CheckpointError("checkpoint does not match the model: " + "; ".join(problems))


def load_state_dict(model: nn.Module, sd: dict[str, torch.Tensor]) -> nn.Module:
    """Copy `sd` into `model` strictly, after `check_state_dict`."""
    check_state_dict(model, sd)
    model.load_state_dict(sd, strict=True, assign=False)
    return model


def load_checkpoint(model: nn.Module, path: str | Path, wrapper: str = "auto") -> nn.Module:
    return load_state_dict(model, read_state_dict(path, wrapper))


def save_checkpoint(model: nn.Module, path: str | Path) -> None:
    path = Path(path)
    sd = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if path.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(sd, str(path))
    else:
        torch.save(sd, path)


# ---------------------------------------------------------------------------------------------- LoRA


def read_lora(path: str | Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{Linear's module name: (A [r, in], B [out, r])} of a PEFT LoRA file: bare, or nested under
    `generator_lora` (LongLive's `lora.pt`, whose `critic_lora` and `step` are ignored). Keys may carry
    `base_model.model.` / `model.` prefixes and an adapter name (`lora_A.default.weight`);
    `lora_down` / `lora_up` are read as A / B."""
    sd = _read_file(Path(path))
    top = sorted(map(str, sd))
    if isinstance(sd.get("generator_lora"), dict):
        sd = sd["generator_lora"]
    elif any(not isinstance(v, torch.Tensor) for v in sd.values()):
        raise CheckpointError(
            f"LoRA file {path} has no 'generator_lora' state dict; its top-level keys are: {_shown(top)}"
        )
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in _tensors(sd, what="LoRA", top=top).items():
        m = _LORA.match(key)
        if m is None:
            raise CheckpointError(f"LoRA file {path}: key {key!r} is not a lora_A / lora_B weight")
        half = halves.setdefault(m.group("module"), {})
        if _LORA_HALF[m.group("half")] in half:
            raise CheckpointError(
                f"LoRA file {path}: {m.group('module')} has two {m.group('half')} (several adapters?)"
            )
        half[_LORA_HALF[m.group("half")]] = t
    pairs = {}
    for module, half in sorted(halves.items()):
        if set(half) != {"A", "B"}:
            lacking = "lora_B" if "A" in half else "lora_A"
            raise CheckpointError(f"LoRA file {path}: {module} has no {lacking} weight")
        a, b = half["A"], half["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise CheckpointError(
                f"LoRA file {path}: {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}: "
                "not [r, in] and [out, r]"
            )
        pairs[module] = (a, b)
    return pairs


def merge_lora(
    model_or_state_dict: nn.Module | dict[str, torch.Tensor], lora_path: str | Path, alpha: float | None = None
) -> int:
    """Merge a LoRA into a model's Linears (or a state dict's `<module>.weight`s) in place:
    W += (alpha / r) * B @ A, computed in fp32, r read from A's shape, alpha the rank when None (scale 1:
    LongLive's rank-256 alpha-256 LoRA; its file holds no alpha). Every pair must match a Linear of the
    right shape. Returns the number of layers merged."""
    pairs = read_lora(lora_path)
    if isinstance(model_or_state_dict, nn.Module):
        modules = dict(model_or_state_dict.named_modules())
        targets = {m: modules[m].weight for m in pairs if isinstance(modules.get(m), nn.Linear)}
    else:
        targets = {m: model_or_state_dict[f"{m}.weight"] for m in pairs if f"{m}.weight" in model_or_state_dict}
        targets = {m: w for m, w in targets.items() if w.ndim == 2}
    unmatched = sorted(set(pairs) - set(targets))
    if unmatched:
        raise CheckpointError(
            f"LoRA {lora_path}: {len(unmatched)} pair(s) match no Linear of the model: {_shown(unmatched)}"
        )
    for module, (a, b) in pairs.items():
        w = targets[module]
        if (b.shape[0], a.shape[1]) != tuple(w.shape):
            raise CheckpointError(
                f"LoRA {lora_path}: {module} gives B @ A {(b.shape[0], a.shape[1])} for a weight {tuple(w.shape)}"
            )
    for module, (a, b) in pairs.items():
        w = targets[module]
        scale = (a.shape[0] if alpha is None else alpha) / a.shape[0]
        delta = b.to(w.device, torch.float32) @ a.to(w.device, torch.float32)
        merged = (w.detach().float() + scale * delta).to(w.dtype)
        if isinstance(model_or_state_dict, nn.Module):
            with torch.no_grad():
                w.copy_(merged)
        else:
            model_or_state_dict[f"{module}.weight"] = merged
    ranks = sorted({a.shape[0] for a, _ in pairs.values()})
    log.info("merged LoRA %s (rank %s) into %d layers", lora_path, "/".join(map(str, ranks)), len(pairs))
    return len(pairs)
