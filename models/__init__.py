"""The causal DiT, text encoders, streaming decoders, the chunk generator, presets and weights.

The names below load their modules when first used (PEP 562), so that a torch-free module of the package
(`models.work`, the forward kinds the pure scheduler plans) imports without the model.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_HOMES = {
    "PRESETS": "models.config", "ModelConfig": "models.config",
    "DecoderState": "models.decoder", "StreamingDecoder": "models.decoder", "TinyStreamingDecoder": "models.decoder",
    "frames_per_chunk": "models.decoder",
    "CacheAccess": "models.dit", "CausalWanModel": "models.dit",
    "build_generator": "models.build",
    "ChunkGenerator": "models.generator",
    "Chunk": "models.stream", "GeneratorConfig": "models.stream", "ParkedStream": "models.stream",
    "StreamState": "models.stream",
    "HashTextEncoder": "models.text", "TextEncoder": "models.text",
    "CheckpointError": "models.weights", "load_checkpoint": "models.weights", "save_checkpoint": "models.weights",
    "WorkKind": "models.work",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'models' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # looked up once
    return value


if TYPE_CHECKING:  # what the names are, for readers and type checkers (exported by __all__)
    from models.build import build_generator
    from models.config import PRESETS, ModelConfig
    from models.decoder import DecoderState, StreamingDecoder, TinyStreamingDecoder, frames_per_chunk
    from models.dit import CacheAccess, CausalWanModel
    from models.generator import ChunkGenerator
    from models.stream import Chunk, GeneratorConfig, ParkedStream, StreamState
    from models.text import HashTextEncoder, TextEncoder
    from models.weights import CheckpointError, load_checkpoint, save_checkpoint
    from models.work import WorkKind
