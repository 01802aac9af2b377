"""What the event loop reads of the engine: frozen descriptions made on the engine thread, never the model itself.

- `ModelShape`: what every stream of this engine has (frame size, chunk frames, steps, vocabulary, strengths), set
  once the engine is ready (`Engine.shape`).
- `StreamDescription`: one admitted stream as its viewers' `ready` tells it (`Engine.open_stream` hands it back,
  in `Opened` with the scheduler's admission).
- `PromptAccepted`: a new prompt's version and the words of it the model does not know (`Engine.set_prompt`).
- `EngineStats`: what the engine has done, at one instant (`Engine.stats`).
"""

from __future__ import annotations

from dataclasses import dataclass

from streamsvc.scheduling import Admission, SchedulerStats


@dataclass(frozen=True)
class ModelShape:
    """What every stream of one engine has: the model's frame size, chunk lengths and steps, its words."""

    width: int
    height: int
    first_chunk_frames: int  # video frames in a stream's first chunk (a causal VAE's first latent frame is one)
    chunk_frames: int  # video frames in each later chunk
    steps: int  # denoising steps of a chunk at full quality
    vocabulary: tuple[str, ...] | None  # the words the model was trained with; None: any
    strengths: tuple[float, ...]  # the strengths a stream with input may have (the schedule's sigmas)

    @classmethod
    def of(cls, gen) -> ModelShape:
        """What every stream of generator `gen` (a ChunkGenerator, or a group's) has."""
        words = gen.text_encoder.vocabulary
        return cls(gen.model_cfg.width, gen.model_cfg.height, gen.frames_in_chunk(0), gen.frames_in_chunk(1),
                   len(gen.sigmas), None if words is None else tuple(words),
                   tuple(float(s) for s in gen.input_strengths()))


@dataclass(frozen=True)
class StreamDescription:
    """One admitted stream, fixed at admission: what its viewers' `ready` is built from."""

    shape: ModelShape
    fps: int
    unknown_words: tuple[str, ...]  # the words of its opening prompt outside the vocabulary, each once
    strength: float | None = None  # a stream with input: its strength, snapped to `shape.strengths`
    input_latency_s: float | None = None  # a stream with input: a chunk is due this long after its last frame
    lora: str | None = None  # its style (streamsvc/engine/styles.py), None: none; a live switch replaces it
    lora_scale: float = 1.0
    image: bool = False  # it started from an image: its chunk 0 is that one frame (streamsvc/engine/images.py)


@dataclass(frozen=True)
class Opened:
    """`Engine.open_stream`'s answer: the scheduler's admission and, when it accepted, the stream's description."""

    admission: Admission
    stream: StreamDescription | None = None

    @property
    def accepted(self) -> bool:
        return self.admission.accepted

    @property
    def reason(self) -> str | None:
        return self.admission.reason


@dataclass(frozen=True)
class PromptAccepted:
    """A new prompt, taken: its version, and the words of it the model does not know."""

    version: int
    unknown_words: tuple[str, ...]


# Parking's figures that EngineStats carries (by the same names)
PARKING_FIGURES = ("parked_streams", "parked_bytes", "parks", "restores", "park_seconds", "restore_seconds",
                   "last_park_seconds", "last_restore_seconds")


@dataclass(frozen=True)
class EngineStats:
    """What the engine has done, at one instant (`Engine.stats`): what the event loop reads (metrics, a cluster
    replica's report). The device's figures come from the engine thread, the encode's from the output stage, the
    pauses' from its `Parking`; each is read as it stands, none waits."""

    scheduler: SchedulerStats | None  # the scheduler's latest snapshot (None: not serving yet)
    kv_used_bytes: int  # the KV pool's bytes held by streams
    kv_budget_bytes: int  # the pool's budget
    forwards: dict[str, int]  # forwards run, by kind (WorkKind's value)
    forward_seconds: dict[str, float]  # their wall time, launch to finish, by kind
    gpu_seconds: dict[str, float]  # their device time (CUDA events; a CPU: wall), by kind
    degraded_chunks: int  # chunks made with fewer denoising steps than the schedule's (instead of a stall)
    encode_seconds: float = 0.0  # x264 and packing, summed over chunks
    chunks_encoded: int = 0
    fast_encodes: int = 0  # chunks the output stage encoded cheaper to meet their deadline
    chunk_latency_max_s: float = 0.0
    parked_streams: int = 0  # paused streams parked in host memory now
    parked_bytes: int = 0  # the host memory they hold
    parks: int = 0  # pauses done
    restores: int = 0  # resumes done
    park_seconds: float = 0.0  # total time of the parks' copies to the host
    restore_seconds: float = 0.0  # total time of the resumes' copies back
    last_park_seconds: float | None = None  # the latest park's copy time (None: none yet)
    last_restore_seconds: float | None = None
