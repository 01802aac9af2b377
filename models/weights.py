"""Loading Wan / Self-Forcing-layout checkpoints from a local path (never from a hub)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

_WRAPPERS = ("generator_ema", "generator", "state_dict", "model")  # nested dicts to unwrap, in order
_PREFIXES = ("model.", "_fsdp_wrapped_module.", "_orig_mod.", "module.")


class CheckpointError(ValueError):
    """A checkpoint that does not match the model: the message names the keys."""


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Tensors of a local .safetensors or .pt/.pth file, unwrapped to the DiT's own keys."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist (weights load from a local path only)")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        sd = load_file(str(path))
    elif path.suffix in (".pt", ".pth", ".bin"):
        sd = torch.load(path, map_location="cpu", weights_only=True)
    else:
        raise CheckpointError(f"checkpoint {path}: expected .safetensors or .pt, got {path.suffix!r}")
    return unwrap(sd)


def unwrap(sd: dict) -> dict[str, torch.Tensor]:
    """Take `generator_ema` / `generator` / `model` wrappers off and strip `model.`-style prefixes."""
    for key in _WRAPPERS:
        if isinstance(sd.get(key), dict):
            return unwrap(sd[key])
    out = {}
    for k, v in sd.items():
        if not isinstance(v, torch.Tensor):
            raise CheckpointError(f"checkpoint entry {k!r} is a {type(v).__name__}, not a tensor")
        changed = True
        while changed:
            changed = False
            for p in _PREFIXES:
                if k.startswith(p):
                    k, changed = k[len(p) :], True
        out[k] = v
    return out


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
            shown = ", ".join(keys[:8]) + (f", ... ({len(keys) - 8} more)" if len(keys) > 8 else "")
            problems.append(f"{len(keys)} {what} key(s): {shown}")
    if problems:
        raise CheckpointError("checkpoint does not match the model: " + "; ".join(problems))


def load_checkpoint(model: nn.Module, path: str | Path) -> nn.Module:
    sd = read_state_dict(path)
    check_state_dict(model, sd)
    model.load_state_dict(sd, strict=True, assign=False)
    return model


def save_checkpoint(model: nn.Module, path: str | Path) -> None:
    path = Path(path)
    sd = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if path.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(sd, str(path))
    else:
        torch.save(sd, path)
