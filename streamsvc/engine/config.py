"""The engine's configuration: one frozen dataclass of everything the engine builds (the model on its device,
the KV pool, the scheduler, the output stage) and how it serves (warm-up, degradation, pausing), validated at
construction. streamsvc.engine.engine re-exports it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from models import GeneratorConfig
from streamsvc.scheduling import SchedulerConfig

if TYPE_CHECKING:
    from streamsvc.engine.group import GroupConfig

__all__ = ["EngineConfig"]


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine builds: the model on its device, the KV pool, the scheduler."""

    preset: str = "tiny"  # model preset (models.PRESETS)
    device: str = "cpu"  # torch device of the model and the KV pool
    checkpoint: str | None = None  # local DiT weights (file or Wan folder); None: wan_dir's, else random
    weights_seed: int = 0
    wan_dir: str | None = None  # Wan2.1 folder (either layout): umT5, the VAE, the base DiT
    lora: str | None = None  # a LoRA merged into the checkpoint (LongLive)
    lora_alpha: float | None = None  # None: the LoRA's rank (scale 1)
    # styles per stream (streamsvc/engine/styles.py): a folder of LoRA files, one style each (None: none offered), and
    # the device memory their loaded adapters may hold (the least recently used unused one is evicted past it)
    lora_dir: str | None = None
    lora_budget_bytes: int = 2 * 2**30
    wrapper: str = "auto"  # which state dict of a training checkpoint: auto | generator | generator_ema
    decoder: str = "auto"  # tiny | wan-vae | taehv | auto (wan-vae with wan_dir, else tiny)
    taehv: str | None = None  # TAEHV's taew2_1.pth, for decoder taehv
    # a whole model file (DiT, decoder, text vectors): "builtin" (the tiny preset's, shipped), a path, "auto" (builtin
    # for the tiny preset without checkpoint or wan_dir); None / "random": the fields above
    # (models.model_file.resolve_weights)
    weights: str | None = None
    generator: GeneratorConfig = GeneratorConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    kv_budget_bytes: int | None = None  # KV pool budget; None: 4 GiB on CPU, 85% of free memory on a GPU
    cpu_threads: int = 1  # torch intra-op threads on CPU (the event loop and encoders need the other cores)
    compile: bool | None = None  # torch.compile the DiT's elementwise helpers; None: on CUDA only
    warmup_chunks: int = 6  # chunks the warm-up stream runs once its window is full (>= 5 samples per kind)
    # A chunk about to be late runs fewer denoising steps (GeneratorConfig.degraded_steps) instead of stalling.
    degrade: bool = True
    output_workers: int | None = None  # encoder threads; None: a quarter of the cores, 1 to 4
    # x264 in a child process per output worker, out of the server's GIL; None: on CPU hosts (on a GPU host the
    # engine thread only launches, and a 480x832 chunk's frames would cross a pipe)
    output_processes: bool | None = None
    # Host memory all paused (parked) streams may hold: their KV caches and decoder states, pinned on a GPU host
    # (a wan2.1-1.3b stream at sink 3 + window 9: 3.2 GiB of KV); a pause beyond it is refused. 0: no pausing.
    park_budget_bytes: int = 8 * 2**30
    park_timeout_s: float = 300.0  # a stream parked longer is ended ("park_expired")
    input_latency_s: float = 0.5  # input video: a chunk is due this long after its last input frame (--input-latency)
    latency: str = "default"  # the latency mode the serving choices came from (--latency: streamsvc/options.py)
    # --parallel K: each forward split over a group of K ranks, this process rank 0 on `device`
    # (streamsvc/engine/lockstep.py)
    group: "GroupConfig | None" = None

    def build_generator(self, device):
        """The generator this engine runs on `device` (a torch.device): built from the model fields, or for --parallel
        K rank 0's of its group (streamsvc/engine/lockstep.py)."""
        kw = dict(device=device, seed=self.weights_seed, checkpoint=self.checkpoint, lora=self.lora,
                  lora_alpha=self.lora_alpha, wrapper=self.wrapper, wan_dir=self.wan_dir, decoder=self.decoder,
                  taehv=self.taehv, weights=self.weights)
        if self.group is not None:
            from streamsvc.engine.lockstep import group_generator

            return group_generator(self.preset, self.group, self.generator, kw)
        from models import build_generator

        return build_generator(self.preset, cfg=self.generator, **kw)

    def describe_latency(self) -> str:
        """One log line: the latency mode and the serving choices it comes to (streamsvc/options.py)."""
        sched, n = self.scheduler, self.generator.frames_per_chunk
        return (f"latency {self.latency}: chunks of {n} latent frame{'s' * (n != 1)}, started "
                f"{sched.start_margin_s:g} s ahead of their latency, at most {sched.buffer_cap_s:g} s ahead of a "
                f"viewer; input video due {self.input_latency_s:g} s after its last frame; a new prompt "
                f"{'cuts to its first chunk' if sched.prompt_cut else 'plays after the buffered video'} (each choice "
                "exact)")

    def __post_init__(self) -> None:
        if self.park_budget_bytes < 0:
            raise ValueError(f"park_budget_bytes={self.park_budget_bytes}: must be >= 0 (0 refuses every pause)")
        if not 0 < self.input_latency_s < 60:
            raise ValueError(f"input_latency_s={self.input_latency_s}: must be in (0, 60) s (e.g. 0.5)")
        if self.lora_budget_bytes < 0:
            raise ValueError(f"lora_budget_bytes={self.lora_budget_bytes}: must be >= 0 (e.g. 2 GiB)")
        if self.lora_dir is not None and self.group is not None:
            raise ValueError("--lora-dir does not go with --parallel: a forward split over a device group cannot add a "
                             "stream's own adapter (models/dit.py); serve styles without --parallel")
        if not self.park_timeout_s > 0:
            raise ValueError(f"park_timeout_s={self.park_timeout_s}: must be > 0 s (e.g. 300)")
