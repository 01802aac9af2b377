"""The causal DiT, text encoders, streaming decoders, the chunk generator, presets and weights."""

from models.config import PRESETS, ModelConfig
from models.decoder import DecoderState, StreamingDecoder, TinyStreamingDecoder, frames_per_chunk
from models.dit import CacheAccess, CausalWanModel
from models.build import build_generator
from models.generator import ChunkGenerator
from models.stream import Chunk, GeneratorConfig, ParkedStream, StreamState, Work
from models.text import HashTextEncoder, TextEncoder
from models.weights import CheckpointError, load_checkpoint, save_checkpoint

__all__ = [
    "PRESETS",
    "CacheAccess",
    "CausalWanModel",
    "CheckpointError",
    "Chunk",
    "ChunkGenerator",
    "DecoderState",
    "GeneratorConfig",
    "HashTextEncoder",
    "ModelConfig",
    "ParkedStream",
    "StreamState",
    "StreamingDecoder",
    "TextEncoder",
    "TinyStreamingDecoder",
    "Work",
    "build_generator",
    "frames_per_chunk",
    "load_checkpoint",
    "save_checkpoint",
]
