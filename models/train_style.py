"""Training a style LoRA for the built-in model: `python -m models.train_style --style invert --out DIR --export FILE`.

A style is a look applied to every frame: `STYLES` names each by a function of the rendered frames (uint8 RGB), and
`invert` (255 - frame) is the one trained so far: on pixels it is exact and plain to measure (a styled frame against
255 minus the plain one), its colours stay readable (255 - styled is the prompt's scene), and the latent encoder and
the decoder carry inverted frames as well as plain ones (the built-in decoder: 31 dB either way).

The base model (a model file, `--base`, the built-in one by default) stays frozen; low-rank pairs (A [r, in] random,
B [out, r] zero, so that training starts from the base model) on the Linears `TARGETS` names learn the style with the
built-in model's own teacher-forcing loss (models/train.py `forcing_loss`) on text clips (models/scenes.py) whose
frames are restyled before they are encoded: the clean context is the style's (a styled stream's cache holds styled
frames), the captions are the clip's (the prompt is what it was), the noise levels are the model file's schedule's.
A share of the clips switch the style on at a chunk (`switch_share`): plain before it, as a live switch leaves the
cache (its sinks plain for good), styled from it.
The forward is serving's own: the pairs go in as a stream's adapter (models/adapters.py `AdapterUse`), so that what
is trained is what `serve --lora-dir` runs.

Runs on the CPU or CUDA (`--device`), for `--minutes` at a time, with a checkpoint every `--save-minutes` (run the
same command again to resume; it prints `done` after `steps`). `--export FILE` writes the pairs in PEFT's layout
(`base_model.model.<module>.lora_A.weight`, `lora_B`, the alpha in diffusers' `lora_adapter_metadata`), a file
`serve --lora-dir` loads as it is. `--smoke` runs a few steps in seconds (CI).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from models.adapters import Adapter, AdapterUse, LoraLayer
from models.dit import CausalWanModel
from models.latent import BlockPCA
from models.model_file import BUILTIN_WEIGHTS, read_model_file
from models.scenes import Clip
from models.stream import GeneratorConfig
from models.teacher_forcing import chunk_sigmas
from models.text import VocabTextEncoder
from models.train import LOSS_WEIGHTS, channel_weights, forcing_loss, save_atomic, with_overrides
from models.train_clips import (
    chunk_weights,
    clip_captions,
    parse_chunk_sizes,
    render_clips,
    text_clips,
)


def invert(frames: torch.Tensor) -> torch.Tensor:
    """Inverted colours: 255 - each value."""
    return 255 - frames


STYLES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"invert": invert}  # uint8 frames -> the style's
# which Linears get a pair, by a pattern on their module names: every Linear of the blocks (attention, cross-attention
# and MLP; the cross-attention's k and v see the prompt only: serving encodes a styled stream's prompt under its style)
TARGETS = {"blocks": r"blocks\.\d+\.(self_attn|cross_attn)\.[qkvo]|blocks\.\d+\.ffn\.[02]",
           "blocks+head": r"blocks\.\d+\.(self_attn|cross_attn)\.[qkvo]|blocks\.\d+\.ffn\.[02]|head\.head"}


@dataclass(frozen=True)
class StyleConfig:
    """One style-training run; a checkpoint remembers it, and a resumed run must agree with it."""

    style: str = "invert"
    base: str = "builtin"  # the model file the style is for ("builtin": models/assets/tiny.safetensors)
    targets: str = "blocks"  # TARGETS
    rank: int = 8
    alpha: float = 8.0  # the pairs' scale is alpha / rank
    seed: int = 0
    steps: int = 2000
    batch: int = 16  # clips per step
    lr: float = 2e-3  # AdamW, cosine to 10 % of it over the steps
    chunk_sizes: str = "3,1"  # trained in turn, one a step, as models/train.py's teacher does
    p_sampler_sigma: float = 0.75  # share of noisy chunks at one of the sampler's levels (the rest: shift-warped uniform)
    context_noise: float = 0.2  # the clean context noised to a level of up to this (a stream's own output is not clean)
    loss_weight: str = "std"  # models/train.py TrainConfig.loss_weight
    # share of clips whose style is switched on live: their chunks before a random one are plain (the base model
    # made them: a switch recaches them as they are, and the sinks keep the stream's first chunk for good), the loss
    # counts the styled ones after. Without them the style sees a styled cache only, never the plain one a live
    # switch leaves it.
    switch_share: float = 0.25

    def __post_init__(self) -> None:
        if self.style not in STYLES:
            raise ValueError(f"style {self.style!r}: use one of {', '.join(STYLES)}")
        self.check()

    def check(self) -> None:
        """What every adapter run must have right (models/train_input.py's too)."""
        parse_chunk_sizes(self.chunk_sizes, GeneratorConfig())
        if self.targets not in TARGETS:
            raise ValueError(f"targets {self.targets!r}: use one of {', '.join(TARGETS)}")
        if self.loss_weight not in LOSS_WEIGHTS:
            raise ValueError(f"loss_weight {self.loss_weight!r}: use {', '.join(LOSS_WEIGHTS)}")
        if not 0 <= self.switch_share <= 1:
            raise ValueError(f"switch_share {self.switch_share}: use a share in [0, 1]")
        if self.rank < 1 or not self.alpha > 0 or self.steps < 1 or self.batch < 1:
            raise ValueError(f"rank {self.rank}, alpha {self.alpha}, steps {self.steps}, batch {self.batch}: each must be positive")

    @property
    def sizes(self) -> tuple[int, ...]:
        return parse_chunk_sizes(self.chunk_sizes, GeneratorConfig())

    @property
    def base_path(self) -> Path:
        return BUILTIN_WEIGHTS if self.base == "builtin" else Path(self.base)

    @classmethod
    def smoke(cls) -> StyleConfig:
        """Two steps of two clips, one at each chunk size (CI)."""
        return cls(steps=2, batch=2)


def styled_from(rng: np.random.Generator, clip: Clip) -> int:
    """The chunk (of the stream's) at which a clip's style is switched on: one of its chunks after its first."""
    return int(clip.chunks[rng.integers(1, len(clip.chunks))])


class StyleTrainer:
    """The frozen base model, the style's pairs and their optimizer: everything a checkpoint holds."""

    def __init__(self, cfg: StyleConfig, out: Path | None, device: torch.device) -> None:
        self.cfg, self.out, self.device = cfg, out, device
        mf = read_model_file(cfg.base_path)
        self.mc = mf.config
        if not mf.pca:
            raise ValueError(f"{cfg.base_path} holds no latent encoder (pca.*): a style is trained on frames it encodes")
        self.gen = replace(GeneratorConfig(), timesteps=mf.timesteps) if mf.timesteps else GeneratorConfig()
        self.encoder = VocabTextEncoder(self.mc.text_dim, self.mc.text_len, mf.words, mf.vectors)
        self.pca = BlockPCA.for_model(self.mc, mf.pca).to(device)
        self.model = CausalWanModel(self.mc)
        self.model.load_state_dict(mf.dit)
        self.model = self.model.to(device).train().requires_grad_(False)
        self.channels = channel_weights(self.pca, cfg.loss_weight).to(device)
        torch.manual_seed(cfg.seed)
        self.pairs = self._init_pairs()  # module name -> (A, B), the trained parameters
        self.opt = torch.optim.AdamW([t for pair in self.pairs.values() for t in pair], lr=cfg.lr, weight_decay=0.0)
        self.step = 0
        self.rng = np.random.default_rng(cfg.seed)

    def _init_pairs(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """A [r, in] uniform in +-1/sqrt(in) (PEFT's default), B [out, r] zero, for each targeted Linear."""
        pattern = re.compile(TARGETS[self.cfg.targets])
        pairs = {}
        for name, m in self.model.named_modules():
            if isinstance(m, torch.nn.Linear) and pattern.fullmatch(name):
                bound = 1 / math.sqrt(m.in_features)
                a = (torch.rand(self.cfg.rank, m.in_features, device=self.device) * 2 - 1) * bound
                b = torch.zeros(m.out_features, self.cfg.rank, device=self.device)
                pairs[name] = (a.requires_grad_(), b.requires_grad_())
        if not pairs:
            raise ValueError(f"targets {self.cfg.targets!r} name no Linear of {self.cfg.base_path}")
        return pairs

    def adapter(self) -> AdapterUse:
        """The pairs as a stream's style at scale 1 (serving's adapter, over the trained tensors themselves)."""
        scale = self.cfg.alpha / self.cfg.rank
        layers = {name: LoraLayer(a, b, scale) for name, (a, b) in self.pairs.items()}
        linears = dict(self.model.named_modules())
        return AdapterUse(Adapter.of(self.cfg.style, layers, linears), 1.0)

    @property
    def checkpoint_path(self) -> Path:
        return self.out / "checkpoint.pt"

    def chunk_size(self) -> int:
        return self.cfg.sizes[self.step % len(self.cfg.sizes)]

    # -- training -----------------------------------------------------------------------------

    def batch(self, fpc: int) -> tuple[torch.Tensor, list, torch.Tensor]:
        """A batch of styled text clips at chunk size `fpc`: clean latents [B, C, F, h, w], each frame's caption of
        [clean | noisy], and which noisy frames the loss counts [B, F]. A `switch_share` of them switch the style on
        at one of their chunks after the first (`styled_from`): plain before it, styled from it."""
        clips = text_clips(self.rng, self.cfg.batch, self.gen, self.mc, fpc)
        frames = render_clips(clips, fpc, self.mc.temporal_upsample, self.device)  # [B, F, tu, H, W, 3]
        weight = torch.tensor([chunk_weights(c) for c in clips], device=self.device)  # [B, chunks]
        styled = torch.ones_like(weight, dtype=torch.bool)
        for i, clip in enumerate(clips):
            if self.rng.random() < self.cfg.switch_share:
                switch = styled_from(self.rng, clip)
                styled[i] = torch.tensor([c >= switch for c in clip.chunks], device=self.device)
        styled = styled.repeat_interleave(fpc, dim=1)  # [B, F]
        frames = torch.where(styled[:, :, None, None, None, None], STYLES[self.cfg.style](frames), frames)
        weight = weight.repeat_interleave(fpc, dim=1) * styled  # a plain chunk was the base model's: not taught
        return self.pca.encode(frames), [clip_captions(c, fpc) for c in clips], weight

    def loss(self, clean: torch.Tensor, captions: list, weight: torch.Tensor, fpc: int) -> torch.Tensor:
        """The teacher-forcing loss of the base model under the style, on one batch (`batch`)."""
        sigma = chunk_sigmas(self.gen, clean.shape[0], clean.shape[2] // fpc, self.cfg.p_sampler_sigma, self.device)
        sigma = sigma.repeat_interleave(fpc, dim=1)  # [B, F]
        s = sigma[:, None, :, None, None]
        noisy = (1 - s) * clean + s * torch.randn_like(clean)
        return forcing_loss(self.model, self.encoder, clean, noisy, sigma, captions, weight, fpc, self.channels,
                            self.cfg.context_noise, lora=self.adapter())

    def step_loss(self, fpc: int) -> torch.Tensor:
        """The loss of one step's batch at chunk size `fpc` (models/train_input.py trains on other batches)."""
        return self.loss(*self.batch(fpc), fpc)

    def train_step(self) -> float:
        frac = self.step / self.cfg.steps
        for group in self.opt.param_groups:
            group["lr"] = self.cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))
        loss = self.step_loss(self.chunk_size())
        if math.isfinite(loss.item()):
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.opt.param_groups[0]["params"], 1.0)
            self.opt.step()
        self.step += 1
        return loss.item()

    def run(self, minutes: float, save_minutes: float) -> bool:
        """Train for up to `minutes`, with a checkpoint every `save_minutes` and at the end; returns whether all
        `steps` are done."""
        start = last_save = time.monotonic()
        with (self.out / "log.jsonl").open("a") as log:
            while self.step < self.cfg.steps and time.monotonic() - start <= minutes * 60:
                t0, fpc = time.monotonic(), self.chunk_size()
                loss = self.train_step()
                record = {"step": self.step, "chunk": fpc, "loss": round(loss, 6), "seconds": round(time.monotonic() - t0, 3)}
                if self.step % 25 == 0 or self.step == self.cfg.steps:
                    print(json.dumps(record), flush=True)
                log.write(json.dumps(record) + "\n")
                if time.monotonic() - last_save > save_minutes * 60:
                    self.save()
                    last_save = time.monotonic()
        self.save()
        return self.step >= self.cfg.steps

    # -- checkpoints and export ---------------------------------------------------------------

    def save(self) -> None:
        state = {"config": asdict(self.cfg), "step": self.step, "opt": self.opt.state_dict(),
                 "pairs": {name: (a.detach(), b.detach()) for name, (a, b) in self.pairs.items()},
                 "rng": self.rng.bit_generator.state, "torch_rng": torch.get_rng_state()}
        save_atomic(state, self.checkpoint_path)

    def resume(self) -> bool:
        if not self.checkpoint_path.exists():
            return False
        state = torch.load(self.checkpoint_path, map_location=self.device, weights_only=False)
        if state["config"] != asdict(self.cfg):
            raise ValueError(f"{self.checkpoint_path} was made with {state['config']}, not {asdict(self.cfg)}: use another --out")
        with torch.no_grad():
            for name, (a, b) in self.pairs.items():
                a.copy_(state["pairs"][name][0])
                b.copy_(state["pairs"][name][1])
        self.opt.load_state_dict(state["opt"])
        self.step = state["step"]
        self.rng.bit_generator.state = state["rng"]
        torch.set_rng_state(state["torch_rng"].cpu())
        return True

    def export(self, path: Path) -> None:
        """The pairs in PEFT's layout, float32, the alpha and what they were trained as in the metadata."""
        from safetensors.torch import save_file

        tensors = {}
        for name, (a, b) in self.pairs.items():
            tensors[f"base_model.model.{name}.lora_A.weight"] = a.detach().float().cpu().contiguous()
            tensors[f"base_model.model.{name}.lora_B.weight"] = b.detach().float().cpu().contiguous()
        config = {"peft_type": "LORA", "r": self.cfg.rank, "lora_alpha": self.cfg.alpha, "target_modules": sorted(self.pairs)}
        metadata = {"lora_adapter_metadata": json.dumps(config), "style": self.cfg.style,
                    "base": self.cfg.base_path.name, "steps": str(self.step), "format": "pt", **self.export_metadata()}
        save_file(tensors, path, metadata=metadata)

    def export_metadata(self) -> dict[str, str]:
        """More of what the exported file says it is (models/train_input.py: the inputs it was trained for)."""
        return {}


def add_run_arguments(p: argparse.ArgumentParser, what: str, out: str, smoke: str) -> None:
    """The options every adapter run takes (this module's and models/train_input.py's): the base, the run folder,
    the device, the time, the overrides, the export. `what` names the adapter, `out` the default folder."""
    p.add_argument("--base", default=None, metavar="FILE",
                   help=f"the model file the {what} is for (default: the built-in model, models/assets/tiny.safetensors)")
    p.add_argument("--out", type=Path, default=Path(out), help="checkpoint and log folder (resumed if it holds a checkpoint)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--minutes", type=float, default=9.0, help="stop (with a checkpoint) after this long")
    p.add_argument("--save-minutes", type=float, default=3.0, help="checkpoint this often")
    p.add_argument("--smoke", action="store_true", help=f"{smoke}, seconds on a CPU (CI)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads torch may use")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="override a field of the run's config")
    p.add_argument("--export", type=Path, help=f"after training, write the {what} to this .safetensors file (PEFT's layout)")


def train_from_arguments(p: argparse.ArgumentParser, args: argparse.Namespace, cfg: StyleConfig, trainer_class: type) -> StyleTrainer:
    """`cfg` with `--base` and the `--set` overrides, trained as `add_run_arguments`' options say (resumed from
    `--out`, for `--minutes`), and exported if asked; returns the trainer."""
    torch.set_num_threads(args.threads)
    torch.backends.cuda.matmul.allow_tf32 = True
    cfg = replace(cfg, base=args.base) if args.base else cfg
    cfg = with_overrides(cfg, args.set, p.error)
    args.out.mkdir(parents=True, exist_ok=True)
    trainer = trainer_class(cfg, args.out, torch.device(args.device))
    if trainer.resume():
        print(f"resumed {trainer.checkpoint_path} at step {trainer.step}", flush=True)
    done = trainer.run(args.minutes, args.save_minutes)
    print("done" if done else f"stopped at step {trainer.step} of {cfg.steps}: run again to resume", flush=True)
    if args.export:
        trainer.export(args.export)
        print(f"wrote {args.export} ({args.export.stat().st_size / 1e3:.0f} kB)", flush=True)
    return trainer


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m models.train_style", description=__doc__.split("\n\n")[0])
    p.add_argument("--style", default=None, choices=sorted(STYLES), help="the look to learn (default: the config's, invert)")
    add_run_arguments(p, "style", "runs/style", "two steps of two clips")
    args = p.parse_args(argv)
    cfg = StyleConfig.smoke() if args.smoke else StyleConfig()
    train_from_arguments(p, args, replace(cfg, style=args.style) if args.style else cfg, StyleTrainer)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
