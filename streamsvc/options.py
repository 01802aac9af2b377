"""What the command line's flags mean: the configurations they build (the generator's for `generate` and `serve`,
the engine's for `serve`), and the latency modes.

A latency mode (`--latency`) is a set of defaults that add up to a figure a viewer feels: how long a new prompt
takes to reach the screen, and a camera frame to come back restyled. Each of its choices is a flag of its own, and a
flag given explicitly wins over the mode:

- ``default``: chunks of 3 latent frames (12 video frames, 0.75 s at 16 fps; the released Self-Forcing and LongLive
  checkpoints' size), chunks started when the viewer's buffer falls to their latency plus a margin (0.175 s on a
  CPU, 0.25 s on a GPU), at most 2 s generated ahead, input video due 0.5 s after its last frame.
- ``low``: chunks of 1 latent frame (4 video frames, 0.25 s: the first one a single frame, which goes out with the
  second), a margin of 0.15 s, at most 1 s ahead, batches of up to 16 streams on a CPU (a chunk of one latent frame is
  a third of the tokens: batching gains more, a stream's forward 0.59 ms at 16 against 0.71 at 8), input video due
  0.25 s after its last frame, and a new prompt's first chunk cuts: its viewers drop the older frames they hold and
  have not shown (--prompt-cut). Every choice is exact (no approximate option): its fidelity tier is --fidelity's.

A chunk that would reach its viewer with less than the degrade margin to spare runs fewer steps (--degrade auto): 0.1 s
by default, 0.05 s under ``low``, so that a chunk started on time (its start margin ahead) does not degrade.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from models import GeneratorConfig, fidelity

CHUNK_LATENT_FRAMES = (1, 3)  # the chunk sizes a server serves (--chunk-latent-frames)


@dataclass(frozen=True)
class LatencyMode:
    """The defaults of one `--latency` (see the module docstring)."""

    chunk_latent_frames: int
    start_margin_s: tuple[float, float]  # (on a CPU, on a GPU): video a chunk should arrive ahead of its need
    # a chunk that would arrive with less than this to spare runs fewer steps (--degrade auto): below the start margin
    degrade_margin_s: float
    buffer_cap_s: float  # video generated ahead of a viewer at most
    max_batch: tuple[int, int]  # (on a CPU, on a GPU): streams per forward when their work matches
    input_latency_s: float  # input video: a chunk is due this long after its last input frame
    prompt_cut: bool  # a new prompt's first chunk drops the older frames its viewers hold and have not shown


LATENCY_MODES = {
    "default": LatencyMode(chunk_latent_frames=3, start_margin_s=(0.175, 0.25), degrade_margin_s=0.1, buffer_cap_s=2.0,
                           max_batch=(4, 1), input_latency_s=0.5, prompt_cut=False),
    "low": LatencyMode(chunk_latent_frames=1, start_margin_s=(0.15, 0.15), degrade_margin_s=0.05, buffer_cap_s=1.0,
                       max_batch=(16, 1), input_latency_s=0.25, prompt_cut=True),
}


def latency_name(args) -> str:
    """--latency, or the default mode's name."""
    return getattr(args, "latency", None) or "default"


def latency_mode(args) -> LatencyMode:
    return LATENCY_MODES[latency_name(args)]


def chunk_latent_frames(args) -> int:
    """--chunk-latent-frames, else the latency mode's."""
    given = getattr(args, "chunk_latent_frames", None)
    return given if given is not None else latency_mode(args).chunk_latent_frames


def generator_config(args) -> GeneratorConfig:
    """The model flags' GeneratorConfig before the speed options: the chunk size, the cache's sinks, window and
    storage."""
    return GeneratorConfig(frames_per_chunk=chunk_latent_frames(args), sink_frames=args.sink_frames,
                           window_frames=args.window_frames, kv_quant=args.kv_quant)


def speed_options(args, cfg: GeneratorConfig, device) -> GeneratorConfig:
    """`cfg` with the speed options --fidelity and --speed-options ask for (ValueError: one is over the cap)."""
    return fidelity.configure(cfg, args.fidelity, fidelity.parse(args.speed_options), device.type)


def weights(args) -> dict:
    """The weight flags as build_generator / EngineConfig keywords."""
    return {"wan_dir": args.wan_dir, "lora": args.lora, "lora_alpha": args.lora_alpha, "wrapper": args.wrapper,
            "decoder": args.decoder, "taehv": args.taehv, "weights": args.weights}


def generator_args(args, device: str | None = None):
    """(device, build_generator's keywords after the preset) for the model flags, on `device` (default: --device's)."""
    from streamsvc.offline import default_device

    device = default_device(device or args.device)
    cfg = speed_options(args, generator_config(args), device)
    return device, dict(device=device, seed=args.weights_seed, checkpoint=args.checkpoint, cfg=cfg, **weights(args))


def degrade(args) -> bool:
    """--degrade, whose default is auto unless --fidelity exact (which allows no fewer steps)."""
    if args.degrade is None:
        return fidelity.degrade_allowed(args.fidelity)
    if args.degrade == "auto" and not fidelity.degrade_allowed(args.fidelity):
        raise ValueError("--degrade auto runs a late chunk with fewer steps (approximate), which --fidelity exact "
                         "rules out: drop one of them")
    return args.degrade == "auto"


def engine_config(args):
    """`serve`'s EngineConfig: the model flags, the scheduling flags and the latency mode's defaults under them."""
    from streamsvc.engine.config import EngineConfig
    from streamsvc.offline import default_device
    from streamsvc.scheduling import SchedulerConfig

    device = default_device(args.device)
    gen = speed_options(args, generator_config(args), device)
    gpu = device.type == "cuda"
    mode = latency_mode(args)
    utilization = args.utilization if args.utilization is not None else (0.9 if gpu else 0.6)
    max_batch = args.max_batch if args.max_batch is not None else mode.max_batch[gpu]
    # A GPU serves few streams one chunk at a time: a chunk's latency is its own forwards, or those and another
    # stream's whole chunk (320 ms at 1.3B), two modes the median misses; many batched CPU streams' latencies are tight.
    lead = args.lead_percentile if args.lead_percentile is not None else (0.95 if gpu else 0.5)
    margin = args.start_margin if args.start_margin is not None else mode.start_margin_s[gpu]
    cap = args.buffer_cap if args.buffer_cap is not None else mode.buffer_cap_s
    sched = SchedulerConfig(policy=args.policy, buffer_cap_s=cap, max_batch=max_batch,
                            utilization_target=utilization, startup_slack_s=args.startup_slack,
                            lead_percentile=lead, start_margin_s=margin,
                            degrade_margin_s=mode.degrade_margin_s,
                            prompt_cut=args.prompt_cut if args.prompt_cut is not None else mode.prompt_cut)
    return EngineConfig(
        preset=args.preset, checkpoint=args.checkpoint,
        weights_seed=args.weights_seed, generator=gen, scheduler=sched, compile=args.compile, **weights(args),
        degrade=degrade(args), latency=latency_name(args),
        kv_budget_bytes=int(args.kv_budget_gib * 2**30) if args.kv_budget_gib else None,
        **_park(args, mode), **_styles(args), **({"device": str(device)} | _group(args, device)),
    )


def _styles(args) -> dict:
    """EngineConfig's style fields from --lora-dir and --lora-budget-gib (streamsvc/engine/styles.py)."""
    budget = getattr(args, "lora_budget_gib", 2.0)
    if not budget >= 0:
        raise ValueError(f"--lora-budget-gib takes a number of GiB >= 0, got {budget:g}")
    folder = getattr(args, "lora_dir", None)
    if folder is None:  # the built-in model's shipped styles, if it is what serves (not split: --parallel takes none)
        folder = _shipped_styles(args)
    elif folder == "none":
        folder = None
    if folder is not None and not Path(folder).is_dir():
        raise ValueError(f"--lora-dir {folder}: not a directory (give a folder of LoRA files, one style each)")
    return dict(lora_dir=folder, lora_budget_bytes=int(budget * 2**30))


def _shipped_styles(args) -> str | None:
    """--lora-dir's default: the styles shipped for the built-in model (models/model_file.py BUILTIN_STYLES) when the
    flags serve its weights on one device; None otherwise, or for flags that name no one model (the weights check
    says why)."""
    from models.model_file import resolve_weights, shipped_styles

    if getattr(args, "parallel", 1) != 1 or getattr(args, "weights", None) is None:
        return None
    try:
        folder = shipped_styles(resolve_weights(args.weights, args.preset, args.checkpoint, args.wan_dir))
    except ValueError:
        return None
    return None if folder is None else str(folder)


def _group(args, device) -> dict:
    """EngineConfig's group for --parallel K (none for 1), and rank 0's device: the first of the group's."""
    if args.parallel == 1:
        return {}
    from streamsvc.engine.group import GroupConfig, group_devices

    group = GroupConfig(args.parallel, group_devices(str(device), args.parallel, args.devices), args.parallel_timeout)
    return {"group": group, "device": group.devices[0]}


def _park(args, mode: LatencyMode) -> dict:
    """EngineConfig's parking fields from --park-budget-gib and --park-timeout, and input video's latency."""
    if not args.park_budget_gib >= 0 or not args.park_timeout > 0:
        raise ValueError(f"--park-budget-gib takes a number >= 0 (0: no pausing) and --park-timeout one > 0, got "
                         f"{args.park_budget_gib:g} and {args.park_timeout:g}")
    input_latency = getattr(args, "input_latency", None)
    return dict(park_budget_bytes=int(args.park_budget_gib * 2**30), park_timeout_s=args.park_timeout,
                input_latency_s=input_latency if input_latency is not None else mode.input_latency_s)
