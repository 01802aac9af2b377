"""Speed options and the fidelity tier each one belongs to (the one list of them).

Tiers, from the reference down (SGLang Diffusion's exact / lossless / lossy):
- `exact`: the bf16 reference math;
- `quantized`: the same work in lower precision (FP8 GEMMs, INT8 attention scores, int KV storage);
- `approximate`: less work (fewer denoising steps, the commit forward skipped, a recache of the newest chunk only).

`--fidelity TIER` caps the options: every option of a tier at or below it may run, and by default the
tier's `default` options that are fast on the device do. Without `--fidelity` the math stays exact in
steady state, options named on their own flags (`--kv-quant`) run, and the overload fallback of the
scheduler (`degrade`: a late chunk runs fewer steps instead of stalling) is allowed; an explicit
`--fidelity exact` turns that off too. Each option's drift against `exact` from the same seed is
measured by benchmarks/fidelity.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

TIERS = ("exact", "quantized", "approximate")  # each tier allows what the ones before it do


@dataclass(frozen=True)
class SpeedOption:
    name: str  # as named on the command line (--speed-options) and in logs
    tier: str  # quantized | approximate
    what: str  # one line: what it changes
    default: bool  # on with `--fidelity TIER` (TIER at or above its tier) when fast on the device
    fast_on: tuple[str, ...] = ("cuda",)  # device types where it saves time (elsewhere it runs a torch reference)
    overload_only: bool = False  # not a steady-state option: only instead of a stall (set by --degrade)


OPTIONS: tuple[SpeedOption, ...] = (
    SpeedOption("fp8-linears", "quantized",
                "the DiT's big linears (self-attention q/k/v/o, cross-attention q/o, FFN) as FP8 GEMMs: weights "
                "float8_e4m3fn with a scale per output channel, activations scaled per token (torch._scaled_mm)", True),
    SpeedOption("int8-attention", "quantized",
                "self-attention scores from INT8 Q and K (K smoothed by its mean over tokens, a scale per block), "
                "softmax and PV in bf16 (SageAttention-style Triton kernel)", False),  # on the H200 1.5-1.9x slower than FA4
    SpeedOption("kv-int4", "quantized", "KV cache stored in 4 bits (--kv-quant int4: memory, not speed)", False, ()),
    SpeedOption("kv-int2", "quantized", "KV cache stored in 2 bits (--kv-quant int2: memory, not speed)", False, ()),
    SpeedOption("steps-3", "approximate", "every chunk runs the first 3 of the 4 denoising steps", True, ("cuda", "cpu")),
    SpeedOption("steps-2", "approximate", "every chunk runs the first 2 of the 4 denoising steps", False, ("cuda", "cpu")),
    SpeedOption("commit-reuse", "approximate",
                "no commit forward: the cache keeps the K/V of the chunk's last denoising step (computed from its "
                "noisy input at that step's noise level, as a context_noise > 0 commit would be)", True, ("cuda", "cpu")),
    SpeedOption("recache-last", "approximate",
                "a prompt switch recomputes only the window's newest chunk under the new prompt (one forward instead of "
                "one per cached chunk); the older window chunks keep the K/V they had under the old prompt", False,
                ("cuda", "cpu")),
    SpeedOption("degrade", "approximate", "a chunk about to be late runs 3 or 2 steps instead of stalling (--degrade)",
                False, ("cuda", "cpu"), overload_only=True),
)
BY_NAME = {o.name: o for o in OPTIONS}
STEADY = tuple(o.name for o in OPTIONS if not o.overload_only and not o.name.startswith("kv-"))  # --speed-options


def rank(tier: str) -> int:
    if tier not in TIERS:
        raise ValueError(f"fidelity {tier!r} is unknown; use one of {', '.join(TIERS)}")
    return TIERS.index(tier)


def allowed(option: str, tier: str | None) -> bool:
    """Whether `option` may run under `--fidelity tier` (None: no cap given)."""
    return tier is None or rank(BY_NAME[option].tier) <= rank(tier)


def defaults(tier: str | None, device_type: str) -> list[str]:
    """The options `--fidelity tier` turns on when none are named: its own and lower tiers' defaults
    that are fast on `device_type` (None or exact: none)."""
    return [o.name for o in OPTIONS if o.default and tier is not None and allowed(o.name, tier) and device_type in o.fast_on]


def parse(text: str | None) -> list[str] | None:
    """`--speed-options` text: None (not given), [] for 'none', else the names, each checked."""
    if text is None:
        return None
    names = [n.strip() for n in text.split(",") if n.strip()]
    if names == ["none"]:
        return []
    for n in names:
        if n not in STEADY:
            raise ValueError(f"speed option {n!r} is unknown; use none or a comma list of {', '.join(STEADY)}")
    if "steps-3" in names and "steps-2" in names:
        raise ValueError("steps-3 and steps-2 are alternatives: name one")
    return names


def configure(cfg, tier: str | None, names: Sequence[str] | None, device_type: str):
    """`cfg` (a GeneratorConfig) with the options on: `names` (None: the tier's defaults on this device),
    each checked against the cap `tier`, as is the KV storage cfg already asks for. ValueError says
    which option is over the cap and what to do."""
    if tier is not None:
        rank(tier)
    names = defaults(tier, device_type) if names is None else list(names)
    if cfg.kv_quant != "none":
        kv = f"kv-{cfg.kv_quant}"
        if not allowed(kv, tier):
            raise ValueError(f"--kv-quant {cfg.kv_quant} is a {BY_NAME[kv].tier} option, over --fidelity {tier}: "
                             f"drop it or give --fidelity {BY_NAME[kv].tier}")
    for n in names:
        if not allowed(n, tier):
            raise ValueError(f"speed option {n} is {BY_NAME[n].tier}, over --fidelity {tier}: drop it or give "
                             f"--fidelity {BY_NAME[n].tier}")
    steps = [int(n.split("-")[1]) for n in names if n.startswith("steps-")]
    timesteps = cfg.timesteps[: steps[0]] if steps else cfg.timesteps
    return replace(cfg, fp8_linears="fp8-linears" in names, attention_quant="int8" if "int8-attention" in names else "none",
                   commit_reuse="commit-reuse" in names, recache_chunks=1 if "recache-last" in names else 0,
                   timesteps=timesteps)


def degrade_allowed(tier: str | None) -> bool:
    """The overload fallback (fewer steps instead of a stall) is off only under an explicit `--fidelity exact`."""
    return tier != "exact"


def active(cfg, full_steps: int = 4) -> list[str]:
    """The steady-state options a GeneratorConfig has on, by name (for logs and reports)."""
    out = []
    if getattr(cfg, "fp8_linears", False):
        out.append("fp8-linears")
    if getattr(cfg, "attention_quant", "none") == "int8":
        out.append("int8-attention")
    if cfg.kv_quant != "none":
        out.append(f"kv-{cfg.kv_quant}")
    if len(cfg.timesteps) < full_steps:
        out.append(f"steps-{len(cfg.timesteps)}")
    if getattr(cfg, "commit_reuse", False):
        out.append("commit-reuse")
    if getattr(cfg, "recache_chunks", 0):  # the option sets 1; more newest chunks (set by hand) go by the same name
        out.append("recache-last")
    return out


def tier_of(names: Iterable[str]) -> str:
    """The lowest tier that allows every option in `names` (exact for none)."""
    return TIERS[max((rank(BY_NAME[n].tier) for n in names), default=0)]


def describe(cfg, degrade: bool, full_steps: int = 4) -> str:
    """One log line: the tier the options add up to, each option on, and whether overload may degrade."""
    names = active(cfg, full_steps)
    on = ", ".join(names) if names else "none (bf16 reference math)"
    return f"fidelity {tier_of(names)}: speed options {on}; overload degrade {'on' if degrade else 'off'}"


def help_text() -> str:
    """The options and their tiers, for --help."""
    return "; ".join(f"{o.name} ({o.tier}{', default' if o.default else ''})" for o in OPTIONS
                     if not o.overload_only and not o.name.startswith("kv-"))
