"""A generated stream's plain types: how it is sampled (`GeneratorConfig`), the unit of work (`Work`: one
forward of one stream), what it carries between forwards (`StreamState`), what a commit yields (`Chunk`), and
its form while parked in host memory (`ParkedStream`, with `PARKED_FIELDS`: what parking moves, and
`field_tensors` / `with_tensors`: the tensors in those fields, and the fields again around their copies).

Data only, with the config's validation and derived schedule; models/generator.py runs the forwards on them.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from kvcache import ParkedCache, StreamCache, Transfer
from models.decoder import DecoderState
from models.dit import TextKV
from models.encoder import EncoderState
from models.work import WorkKind


@dataclass(frozen=True)
class GeneratorConfig:
    """How a stream is sampled and how much it remembers."""

    frames_per_chunk: int = 3  # latent frames denoised together
    timesteps: tuple[float, ...] = (1000.0, 750.0, 500.0, 250.0)  # before the shift
    # Shorter schedules a chunk may run with instead of a stall (the scheduler's choice, `--degrade`): the
    # first n of `timesteps`. Self-Forcing trains every exit of its schedule (a random one per rollout), so a
    # chunk stopped after n steps is an output the model was trained to give, only less refined.
    # Counts at or above the schedule's length are ignored (a 2-step schedule has none of these).
    degraded_steps: tuple[int, ...] = (3, 2)
    shift: float = 5.0  # flow-matching timestep warp: sigma = shift*s / (1 + (shift-1)*s)
    sink_frames: int = 3  # first latent frames kept for the stream's whole life
    window_frames: int = 9  # most recent latent frames kept (a ring)
    kv_quant: str = "none"  # KV storage: none | int4 | int2
    recache_sinks: bool = False  # a prompt switch also recomputes the sinks' K/V
    cuda_graphs: bool = True  # on CUDA, replay forwards as CUDA graphs (models/graphs.py)
    # dense KV: one stream's forwards run in the device's workspace (kvcache/workspace.py), which has
    # room for one chunk before the cache's slots and a rotated copy of the keys, so a forward reads its
    # cache in place, a chunk rotates the cached keys once, not five times, and one set of CUDA graphs
    # serves every stream; the workspace costs 5.6 GiB once for wan2.1-1.3b (streams keep 3.2 GiB each)
    stage_kv: bool = True
    # Speed options (models/fidelity.py lists them with their tiers; `fidelity.configure` sets these):
    fp8_linears: bool = False  # quantized: the DiT's big linears as FP8 GEMMs (models/fp8.py), swapped in at load
    attention_quant: str = "none"  # quantized: "int8" runs the unmasked self-attention as models/sage.py's kernel
    # approximate: no commit forward. A chunk's last denoising step also writes its K/V into the cache slots
    # its commit would have written, and the commit only advances the ring and decodes. Those K/V are the
    # model's view of the chunk at that step's input: x_t at the last step's sigma (0.625 for the default
    # schedule), from the x0 predicted one step earlier, not the clean x0 at timestep 0 (what Self-Forcing's
    # `context_noise` > 0 also caches, with x0 re-noised instead). A recache recomputes them clean.
    commit_reuse: bool = False
    # approximate: a recache recomputes only the window's newest `recache_chunks` chunks (0: every chunk) under
    # the new prompt; the older window chunks keep the K/V they were committed with under the old prompt (and
    # the sinks theirs, unless recache_sinks). The newest chunk is the one the next chunk attends to most
    # closely; recomputing it alone is one forward instead of one per cached chunk.
    recache_chunks: int = 0
    # styles (models/adapters.py): the largest rank a stream's adapter may have (CUDA graphs will hold one in
    # buffers of this rank per targeted Linear)
    lora_max_rank: int = 64

    def __post_init__(self) -> None:
        if self.frames_per_chunk < 1:
            raise ValueError(f"frames_per_chunk must be >= 1, got {self.frames_per_chunk}")
        if not self.timesteps or any(not 0 < t <= 1000 for t in self.timesteps):
            raise ValueError(f"timesteps must be in (0, 1000], got {self.timesteps}")
        if any(n < 1 for n in self.degraded_steps):
            raise ValueError(f"degraded_steps {self.degraded_steps} must each be >= 1 (a chunk needs a step)")
        if self.recache_chunks < 0:
            raise ValueError(f"recache_chunks must be >= 0 (0: recache every window chunk), got {self.recache_chunks}")
        if self.lora_max_rank < 1:
            raise ValueError(f"lora_max_rank must be >= 1, got {self.lora_max_rank}")
        if self.attention_quant not in ("none", "int8"):
            raise ValueError(f"attention_quant {self.attention_quant!r} is unknown; use none or int8")
        if self.window_frames and self.window_frames < self.frames_per_chunk:
            raise ValueError(
                f"window_frames ({self.window_frames}) must hold at least one chunk ({self.frames_per_chunk} frames)"
            )

    @property
    def sigmas(self) -> list[float]:
        """Noise level of each denoising step: 1, 0.9375, 0.8333, 0.625 for the defaults."""
        out = []
        for t in self.timesteps:
            s = t / 1000.0
            out.append(self.shift * s / (1 + (self.shift - 1) * s))
        return out

    @property
    def shorter_steps(self) -> tuple[int, ...]:
        """The step counts a degraded chunk may run with, most first."""
        return tuple(sorted({n for n in self.degraded_steps if n < len(self.timesteps)}, reverse=True))

    @property
    def forwards_per_chunk(self) -> int:
        return len(self.timesteps) + (0 if self.commit_reuse else 1)


INPUT_KINDS = ("video", "image")  # a stream's inputs: a video to follow, a start image (StreamState.input_kind)


@dataclass
class Chunk:
    """One decoded chunk of a stream."""

    index: int  # chunk number within the stream, from 0
    first_frame: int  # index of its first video frame in the stream (its pts in frames)
    frames: torch.Tensor  # [N, H, W, 3] uint8 video frames, on the model's device (the caller copies them out)
    latents: torch.Tensor  # [C, F, h, w] float32 clean latents, on the model's device
    prompt_version: int  # version of the prompt it was generated under
    steps: int  # the schedule's step it ends at (fewer than the schedule's steps when degraded; 0: a start image)
    input: str = "none"  # its input video: "none" (text-to-video), "frames" (set_input's), "missing" (set_input(None))
    start_step: int = 0  # the step it started at (input frames at a strength < 1); it ran steps - start_step steps


@dataclass
class StreamState:
    """Everything one stream carries between forwards."""

    stream_id: str
    cache: StreamCache
    noise: torch.Generator  # the stream's own noise source
    prompt: str
    text: TextKV  # cross-attention K/V of `prompt`, batch 1
    decoder: DecoderState
    clean: torch.Tensor  # [slots, C, h, w] clean latents of the frames in each cache slot (for recache)
    prompt_version: int = 0
    pending_prompt: str | None = None  # applied before the next chunk (with a recache if anything is cached)
    pending_version: int | None = None  # version the pending prompt takes (default: the current one + 1)
    # its style: a name of the generator's adapters (None: the base weights) and its scale; a switch waits in
    # pending_lora (name, scale) and is applied with the pending prompt, which `set_lora` sets too
    lora: str | None = None
    lora_scale: float = 1.0
    # its input: "video" (to follow), "image" (a start image) or None; unless it has a style, its forwards run
    # under the model's input adapter (ChunkGenerator.input_adapter) when the model has one for that kind
    input_kind: str | None = None
    pending_lora: tuple[str | None, float] | None = None
    step: int = 0  # next denoising step of the chunk in progress (== steps: ready to commit)
    steps: int = 0  # denoising steps of the chunk in progress or the next one (set by open_stream: the full schedule)
    x: torch.Tensor | None = None  # [C, F, h, w] current noisy input of the chunk in progress
    x0: torch.Tensor | None = None  # last predicted clean chunk
    # commit reuse: the slots the chunk's last denoising step wrote its K/V to (its commit then runs no forward)
    reused_slots: list[int] | None = None
    # the window holds K/V that are not its frames' (an abandoned chunk's, written by commit reuse): the next
    # recache recomputes the whole window, whatever cfg.recache_chunks says
    recache_all: bool = False
    chunk_version: int = 0  # prompt version the chunk in progress is generated under
    chunks_done: int = 0
    frames_done: int = 0  # video frames emitted
    # latent frames at the stream's start that no chunk denoised: 1 after `start_from_image` (the image's latent
    # frame 0, a block of its own), else 0. The chunks' blocks of frames_per_chunk start after them.
    start_frames: int = 0
    # video-to-video (set_input / set_strength)
    strength: float = 1.0  # the input's strength, snapped to a schedule sigma (1.0: step 0, text-to-video); next chunk on
    encoder: EncoderState | None = None  # the input encoder's causal state (None: the model has no encoder)
    input_latents: torch.Tensor | None = None  # [C, F, h, w] the next chunk's encoded input, kept until its commit
    input: str = "none"  # the next (or in-progress) chunk's input: "none" | "frames" | "missing"
    start: int = 0  # the step the chunk in progress started at (set at its first denoise)
    forwards: dict[str, int] = field(default_factory=lambda: {w.value: 0 for w in WorkKind})


# StreamState's fields that hold device tensors, moved to the host when the stream is parked (its cache apart)
PARKED_FIELDS = ("text", "decoder", "clean", "x", "x0", "encoder", "input_latents")


@dataclass
class ParkedStream:
    """A stream parked in host memory (`ChunkGenerator.park`): its state, whose cache is None and whose
    PARKED_FIELDS are None, and host copies of everything it held on the device. The noise generator stays
    in the state: its state is a seed and an offset, kept on the host even for a CUDA generator."""

    state: StreamState  # the stream, stripped of its device memory until `restore`
    cache: ParkedCache  # its KV cache's storage and ring
    fields: dict  # PARKED_FIELDS' values with every tensor replaced by its host copy (once `moved` is done)
    moved: Transfer  # the copy of the fields' tensors
    restored: list[Transfer] = field(default_factory=list)  # the copies back, after `restore`

    @property
    def nbytes(self) -> int:
        """Host memory it holds: the cache's and the other fields' tensors."""
        return self.cache.nbytes + self.moved.nbytes

    def done(self) -> bool:
        """Whether the copies to the host (or, after `restore`, back to the device) have finished."""
        copies = self.restored or [self.cache.moved, self.moved]
        return all([t.done() for t in copies])

    @property
    def seconds(self) -> float:
        """Time of the copies (to the host, or back after `restore`) on the copy stream; needs `done()`."""
        return sum(t.seconds for t in (self.restored or [self.cache.moved, self.moved]))


def field_tensors(obj) -> list[torch.Tensor]:
    """Every tensor in `obj` (in lists, tuples, dicts and dataclasses, nested), in a fixed order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in field_tensors(item)]
    if isinstance(obj, dict):
        return [t for item in obj.values() for t in field_tensors(item)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [t for f in dataclasses.fields(obj) for t in field_tensors(getattr(obj, f.name))]
    return []


def with_tensors(obj, tensors: Iterator[torch.Tensor]):
    """`obj` again with its tensors (in `field_tensors` order) replaced by the next of `tensors`; containers and
    dataclasses are copied, everything else is shared."""
    if isinstance(obj, torch.Tensor):
        return next(tensors)
    if isinstance(obj, list):
        return [with_tensors(item, tensors) for item in obj]
    if isinstance(obj, tuple):
        return tuple(with_tensors(item, tensors) for item in obj)
    if isinstance(obj, dict):
        return {key: with_tensors(item, tensors) for key, item in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = copy.copy(obj)
        for f in dataclasses.fields(obj):
            setattr(out, f.name, with_tensors(getattr(obj, f.name), tensors))
        return out
    return obj
