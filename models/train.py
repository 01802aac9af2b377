"""Training the built-in model (the tiny preset) on rendered scenes: `python -m models.train`.

Stages, run in order by one command that stops after `--minutes` and checkpoints every
`--save-minutes` (run the same command again to resume; it prints `done` when every stage is):

1. pca: fit the latent encoder (models/latent.py) on rendered clips (seconds);
2. decoder: train the causal decoder (models/decoder.py) to turn the encoder's latents back into frames;
3. teacher: teacher forcing of the DiT (models/teacher_forcing.py). Its forward is models/dit.py's, over Self-Forcing's layout
   [clean chunks | noisy chunks]: a clean chunk sees the clean chunks up to it, a noisy chunk the
   clean chunks before it and itself, at its clean twin's RoPE positions. Flow matching: sigma per
   chunk, mostly one of the sampler's levels, partly at random; the clean context slightly noised.
   The loss is on the clean latent the predicted flow leads to (x - sigma v against x0): every level
   weighs alike, as the sampler uses each of them to predict x0.
   After a prompt switch the sinks keep the old prompt's K/V as a recache leaves them: a frame's text
   is per frame, the old prompt's for the sink chunk, the new one's for the rest. Each batch mixes three kinds of
   clip, each with its own noise levels and loss weights: text clips; video-to-video pairs (`follow_share`, drawn
   fresh each step: models/train_follow.py), whose noisy chunks start from an input video of the same motion in
   another look, so that the model learns to follow an input while it learns shapes; and clips that start from an
   image (`image_share`: latent frame 0 a clean block of its own, models/train_image.py).

4. rollout: a short fine-tune on the model's own context, as Self-Forcing trains: a batch of streams
   rolled out with the real ChunkGenerator (its cache, prompt switches and recaches), up to a random
   chunk; one random denoising step of that chunk runs with the gradient, its x0 regressed onto the
   chunk rendered from the model's own history (the scene is a function of the prompts and of where
   the object was: the rendered chunk is moved to continue from where the model's object is at the end
   of the chunk before, so a stream that drifted is taught to go on from there, not to jump back).

5. follow (off unless `follow_steps`; a fine-tune from a model file with `--init FILE`): teacher forcing on
   pairs from a pool rendered once (`follow_pool`) beside as many text clips (`follow_t2v`), no image clips. Such a
   fine-tune of a model trained without pairs learnt to follow but lost text-to-video shapes; the teacher's pairs
   are the recipe, this stage is for trying things on a finished file.

Chunk sizes (`chunk_sizes`): streams denoise chunks of 3 latent frames, or of 1 for low latency. The teacher, rollout
and follow stages train the sizes in turn, one a step (picked by the step's number: a batch shares one chunk size, each
size gets its share exactly, a resume goes on alike), on clips of what the cache holds at that size and the chunk
being made (models/train_clips.py `clip_layout`).

`--smoke` runs a few steps of each on the CPU in seconds (CI runs it; it trains both sizes, the teacher on all three
kinds of clip). `--export FILE` writes the weights as one safetensors file (DiT, decoder, encoder and the text vectors
of the caption words).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from models.adapters import AdapterUse
from models.config import ModelConfig, parse_overrides
from models.decoder import NoDecoder, TinyStreamingDecoder
from models.dit import CacheAccess, CausalWanModel
from models.generator import ChunkGenerator
from models.latent import BlockPCA, video_frames
from models.scenes import Clip, sample_clip, vocabulary
from models.stream import GeneratorConfig
from models.teacher_forcing import chunk_sigmas, frame_sigmas, frame_text, teacher_forward
from models.text import HashTextEncoder
from models.train_clips import (
    chunk_weights, clip_captions, clip_layout, object_centres, parse_chunk_sizes, render_clips, roll_frames, text_clips,
)
from models.train_follow import (
    FollowPairs, FollowPool, follow_levels, follow_pool, pair_count, pair_sigmas, pair_starts, sample_pairs,
)
from models.train_image import image_count, with_image_clips

STAGES = ("pca", "decoder", "teacher", "rollout", "follow")
CHUNK_UNIT = 3  # latent frames of the chunks TrainConfig's chunk counts are in (rollout_chunks), at every size
LOSS_WEIGHTS = {"none": 0, "std": 1, "var": 2}  # TrainConfig.loss_weight -> the power of each channel's std


@dataclass(frozen=True)
class TrainConfig:
    """One training run; a checkpoint remembers it, and a resumed run must agree with it."""

    preset: str = "tiny"
    # overrides of the preset's shapes (the export records the result): twice the preset's width, as wide as
    # 16 streams on a 2-core CPU allow (dim 128 / 2 layers: 19.7 ms a chunk on one thread, the preset 15.4);
    # the head predicts x0 (ModelConfig.prediction: as a flow, 128 outputs could not undo 256 values' noise)
    model: str = "dim=128,ffn_dim=256,num_heads=4,num_layers=2,prediction=sample"
    seed: int = 0
    # the chunk sizes (latent frames) trained, one a step in turn (a size named twice gets two turns); a clip is
    # what a sink 3 + window 9 cache holds at the step's size and the chunk being made (5 chunks of 3, 13 of 1)
    chunk_sizes: str = "3,1"
    pca_clips: int = 64  # clips the encoder is fit on
    decoder_steps: int = 840  # its loss is flat (0.006) by then
    teacher_steps: int = 12800  # 17 minutes on an H200 (78 ms a step; bf16 autocast is no faster at this size)
    batch: int = 128  # clips per step
    lr: float = 2e-3  # AdamW, cosine to 10 % of it over each stage (2e-3 learnt prompts faster than 1e-3)
    decoder_noise: float = 0.2  # latents get noise of up to this std while the decoder trains (the DiT's are not exact)
    p_sampler_sigma: float = 0.75  # share of noisy chunks at one of the sampler's levels (the rest: shifted uniform)
    # the clean context is noised to a level of up to this (its timestep stays 0): a rollout's context is the
    # model's own blurred, speckled output, not the clean render
    context_noise: float = 0.2
    # how the flow loss weighs the latent channels. The PCA latents are whitened: each channel has unit
    # variance, so in a plain MSE the faint high-order components (edge detail, std 0.3 before whitening)
    # count as much as the first (the block's mean colour, std 15) and learning colour and shape is slow.
    # "std": each channel by its std before whitening (normalized to mean 1); "var": by its variance (an
    # MSE in pixel space); "none": plain MSE on the whitened latents.
    loss_weight: str = "std"
    # off by default: 300 steps after the teacher (session 10) made the built-in model's squares rounder (the
    # pixel test's falling blue square 0.74-0.89 of frames over 8 seeds, against 0.89-0.94 without)
    rollout_steps: int = 0
    rollout_batch: int = 32  # streams rolled out together
    # the trained chunk is one of the first this many chunks of 3 of a stream (the window turns at 4); at size 1,
    # as many latent frames (36 chunks of 1)
    rollout_chunks: int = 12
    rollout_lr: float = 2e-4
    # the rollout's regression target: "history" renders the chunk from where the model's own object is at
    # the end of the chunk before (the scene is a function of the prompt and the history: a stream whose
    # object went astray continues from there), "absolute" the stream's rendered truth from its first frame
    # (which asks a model that drifted to jump back: a target its context contradicts)
    rollout_truth: str = "history"
    # video-to-video pairs (models/train_follow.py), in the teacher's batches (`follow_share`) and in stage 5's. The
    # follow stage (a fine-tune from a model file): steps, pairs per step (plus as many text-to-video clips), peak
    # learning rate. Both: the sampler's schedule whose levels below 1 an input chunk starts at: the built-in model's,
    # which the export names (`--timesteps` to name another)
    follow_steps: int = 0
    follow_batch: int = 32
    follow_lr: float = 5e-4
    follow_timesteps: str = "1000,500,250,100"
    follow_pool: int = 256  # pairs (and text-to-video clips) rendered and encoded once, each step's batch drawn from them
    # share of pairs whose input is another shape: at 1/3 the model came to keep x_t's shape, and after a
    # text-to-video prompt switch the old shape stayed two chunks (issue 15's test failed)
    follow_shape_share: float = 0.75
    follow_t2v: int = 0  # text-to-video clips per step beside the follow_batch pairs (0: as many)
    # share of pairs whose prompt switches at a chunk boundary (the input goes on): without them the model's
    # text-to-video switches kept the old shape for chunks, as its pairs' context and prompt always agreed
    follow_switch: float = 0.5
    # the first step of `follow_timesteps` an input chunk is trained to start at: 2 (sigma 0.625; 0.357 too). From
    # step 1 (0.833) the input's layout is too noisy to place an object exactly, the x0 it learnt there was a blur,
    # and the blur came into text-to-video: squares rounded into balls (issue 15's test after a switch, 0-20 %)
    follow_min_step: int = 2
    image_share: float = 0.25  # share of the teacher's clips that start from an image (models/train_image.py)
    # share of the teacher's clips that are video-to-video pairs. A follow fine-tune of a finished model (stage 5,
    # 250 steps of 16 pairs beside 32 text clips) learnt to follow but lost text-to-video shapes; from scratch, shape
    # is learnt with the pairs. A quarter is the follow stage's 32 pairs a step at batch 128 (400,000 over the
    # teacher's steps, 100 times that fine-tune's), and leaves text clips half of each batch beside the images
    follow_share: float = 0.25

    def __post_init__(self) -> None:
        parse_chunk_sizes(self.chunk_sizes, GeneratorConfig())
        if not (0 <= self.image_share and 0 <= self.follow_share and self.image_share + self.follow_share < 1):
            raise ValueError(f"image_share {self.image_share}, follow_share {self.follow_share}: use shares of at least 0 "
                             "that add up to less than 1 (text clips stay in every batch)")
        if self.loss_weight not in LOSS_WEIGHTS:
            raise ValueError(f"loss_weight {self.loss_weight!r}: use none, std or var")
        if self.rollout_truth not in ("history", "absolute"):
            raise ValueError(f"rollout_truth {self.rollout_truth!r}: use history or absolute")

    @property
    def sizes(self) -> tuple[int, ...]:
        return parse_chunk_sizes(self.chunk_sizes, GeneratorConfig())

    @classmethod
    def smoke(cls) -> TrainConfig:
        """A few steps of each stage (CI), each stage of two or more steps at both chunk sizes."""
        return cls(pca_clips=4, decoder_steps=3, teacher_steps=3, batch=3, rollout_steps=2, rollout_batch=2, rollout_chunks=3,
                   follow_steps=2, follow_batch=2, follow_pool=3)  # a teacher batch: a text clip, a pair, an image clip


def with_overrides(cfg, items: Sequence[str], error: Callable[[str], None]):
    """`cfg` (a dataclass) with each `--set FIELD=VALUE` of `items` applied, the value of the field's type; `error`
    (argparse's) is told of an unknown field."""
    fields = {k: type(v) for k, v in asdict(cfg).items()}
    for item in items:
        key, _, value = item.partition("=")
        if key not in fields:
            error(f"--set {item}: no field {key!r}; fields: {', '.join(fields)}")
        cfg = replace(cfg, **{key: fields[key](value)})
    return cfg


def save_atomic(state: dict, path: Path) -> None:
    """torch.save to `path` through a temporary file: a run killed mid-save keeps the previous checkpoint."""
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)


# fields added to TrainConfig since, at the value that the runs made before them trained with
LATER_FIELDS = {"image_share": 0.0, "follow_share": 0.0}


def saved_config(config: dict) -> dict:
    """A checkpoint's TrainConfig in today's fields. One from before `chunk_sizes` trained chunks of 3 only, on clips
    of `chunks` (5, what the cache holds, now derived from it): it resumes with `--set chunk_sizes=3`. One from before
    a field of LATER_FIELDS trained without what it adds: it resumes with `--set follow_share=0` (say)."""
    config = {**LATER_FIELDS, **config}
    if "chunk_sizes" in config or config.get("chunks") != 5:
        return config
    return {**{k: v for k, v in config.items() if k != "chunks"}, "chunk_sizes": "3"}


def channel_weights(pca: BlockPCA, loss_weight: str) -> torch.Tensor:
    """[1, C, 1, 1, 1]: each latent channel's weight in the flow loss (TrainConfig.loss_weight): its std before
    whitening to the power LOSS_WEIGHTS names, normalized to mean 1."""
    w = pca.std ** LOSS_WEIGHTS[loss_weight]
    return (w / w.mean()).view(1, -1, 1, 1, 1)


def forcing_loss(model: CausalWanModel, encoder: HashTextEncoder, clean: torch.Tensor, noisy: torch.Tensor, sigma: torch.Tensor,
                 captions: list, weight: torch.Tensor, fpc: int, channels: torch.Tensor, context_noise: float,
                 lead: torch.Tensor | None = None, amp: bool = False, lora: AdapterUse | None = None) -> torch.Tensor:
    """The teacher-forcing loss of a batch: the clean context (clean [B, C, F, h, w]) noised by up to `context_noise`,
    the forward over [context | noisy] (sigma [B, F] the noisy frames' levels; under the style `lora` if given), the
    loss on the x0 it leads to, weighed per channel (`channels`, `channel_weights`) and per noisy frame as `weight`
    [B, F] counts them. `amp`: the forward under bf16 autocast."""
    ctx = torch.rand(clean.shape[0], 1, 1, 1, 1, device=clean.device) * context_noise
    context = (1 - ctx) * clean + ctx * torch.randn_like(clean)
    with torch.autocast(clean.device.type, dtype=torch.bfloat16, enabled=amp):
        text = frame_text(model, encoder, captions, lora)
        v = teacher_forward(model, context, noisy, 1000 * sigma, text, fpc, lead, lora=lora).float()
    per_frame = ((noisy - sigma[:, None, :, None, None] * v - clean).pow(2) * channels).mean(dim=(1, 3, 4))
    return (per_frame * weight).sum() / weight.sum().clamp_min(1)


# -- the run -------------------------------------------------------------------------------------


class Trainer:
    """Holds everything a checkpoint holds; `run` trains until the time is up or every stage is done."""

    def __init__(self, cfg: TrainConfig, out: Path, device: torch.device, amp: bool = False) -> None:
        self.cfg, self.out, self.device = cfg, out, device
        self.amp = amp  # the teacher's forward under bf16 autocast (weights, optimizer and loss stay float32)
        self.mc = ModelConfig.from_name(cfg.preset, **parse_overrides(cfg.model))
        self.gen = GeneratorConfig()
        self.encoder = HashTextEncoder(self.mc.text_dim, self.mc.text_len)
        torch.manual_seed(cfg.seed)
        self.model = CausalWanModel(self.mc).init_weights(cfg.seed).to(device).train()
        self.decoder = TinyStreamingDecoder(self.mc).init_weights(cfg.seed).to(device).train()
        self.pca: BlockPCA | None = None
        self.stage, self.step = STAGES[0], 0
        self.rng = np.random.default_rng(cfg.seed)
        self.opt = self._optimizer()
        self.skipped_steps = 0  # steps whose loss was not finite (not stepped), this run
        self._pool: dict[int, FollowPool] = {}  # the follow stage's data by chunk size (not checkpointed: redrawn)

    def _optimizer(self) -> torch.optim.Optimizer | None:
        params = {"decoder": self.decoder, "teacher": self.model, "rollout": self.model, "follow": self.model}.get(self.stage)
        return None if params is None else torch.optim.AdamW(params.parameters(), lr=self._peak_lr, weight_decay=0.01)

    @property
    def _peak_lr(self) -> float:
        return {"rollout": self.cfg.rollout_lr, "follow": self.cfg.follow_lr}.get(self.stage, self.cfg.lr)

    @property
    def checkpoint_path(self) -> Path:
        return self.out / "checkpoint.pt"

    # -- checkpoints --------------------------------------------------------------------------

    def save(self) -> None:
        state = {
            "config": asdict(self.cfg),
            "stage": self.stage,
            "step": self.step,
            "pca": None if self.pca is None else self.pca.state_dict(),
            "dit": self.model.state_dict(),
            "decoder": self.decoder.state_dict(),
            "opt": None if self.opt is None else self.opt.state_dict(),
            "rng": self.rng.bit_generator.state,
            "torch_rng": torch.get_rng_state(),
        }
        save_atomic(state, self.checkpoint_path)

    def resume(self) -> bool:
        if not self.checkpoint_path.exists():
            return False
        state = torch.load(self.checkpoint_path, map_location=self.device, weights_only=False)
        if saved_config(state["config"]) != asdict(self.cfg):
            raise ValueError(f"{self.checkpoint_path} was made with {state['config']}, not {asdict(self.cfg)}: use another --out")
        self.stage, self.step = state["stage"], state["step"]
        if state["pca"] is not None:
            self.pca = BlockPCA.for_model(self.mc, state["pca"]).to(self.device)
        self.model.load_state_dict(state["dit"])
        self.decoder.load_state_dict(state["decoder"])
        self.opt = self._optimizer()
        if self.opt is not None and state["opt"] is not None:
            self.opt.load_state_dict(state["opt"])
        self.rng.bit_generator.state = state["rng"]
        torch.set_rng_state(state["torch_rng"].cpu())
        return True

    # -- stages -------------------------------------------------------------------------------

    def steps_of(self, stage: str) -> int:
        return {"pca": 1, "decoder": self.cfg.decoder_steps, "teacher": self.cfg.teacher_steps, "rollout": self.cfg.rollout_steps,
                "follow": self.cfg.follow_steps}[stage]

    def run(self, minutes: float, save_minutes: float) -> bool:
        """Train for up to `minutes`; returns whether every stage is done."""
        start = last_save = time.monotonic()
        log = (self.out / "log.jsonl").open("a")
        while self.stage != "done":
            if self.steps_of(self.stage) == 0:  # a stage turned off (rollout_steps=0)
                self._next_stage()
                continue
            if time.monotonic() - start > minutes * 60:
                break
            t0, size = time.monotonic(), self.chunk_size()
            loss = getattr(self, f"{self.stage}_step")()
            self.step += 1
            record = {"stage": self.stage, "step": self.step, "loss": round(loss, 6), "seconds": round(time.monotonic() - t0, 3)}
            if self.stage in ("teacher", "rollout", "follow"):  # the stages that train chunk sizes in turn
                record["chunk"] = size
            if self.skipped_steps:
                record["skipped"] = self.skipped_steps
            if self.step % 50 == 0 or self.step == self.steps_of(self.stage):
                print(json.dumps(record), flush=True)
            log.write(json.dumps(record) + "\n")
            if self.step >= self.steps_of(self.stage):
                self._next_stage()
            if time.monotonic() - last_save > save_minutes * 60:
                self.save()
                last_save = time.monotonic()
        log.close()
        self.save()
        return self.stage == "done"

    def _next_stage(self) -> None:
        i = STAGES.index(self.stage) + 1
        self.stage, self.step = (STAGES[i] if i < len(STAGES) else "done"), 0
        self.opt = self._optimizer()

    def _lr(self) -> None:
        frac = self.step / max(1, self.steps_of(self.stage))
        for group in self.opt.param_groups:
            group["lr"] = self._peak_lr * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))

    def chunk_size(self) -> int:
        """The chunk size (latent frames) this step of the stage trains: `chunk_sizes` in turn."""
        sizes = self.cfg.sizes
        return sizes[self.step % len(sizes)]

    def _clips(self, n: int, fpc: int | None = None) -> list[Clip]:
        """`n` clips at chunk size `fpc` (default: the first of `chunk_sizes`, as the encoder and decoder see them)."""
        return text_clips(self.rng, n, self.gen, self.mc, fpc or self.cfg.sizes[0])

    def _render(self, clips: Sequence[Clip]) -> torch.Tensor:
        return render_clips(clips, clips[0].frames_per_chunk, self.mc.temporal_upsample, self.device)

    def pca_step(self) -> float:
        frames = self._render(self._clips(self.cfg.pca_clips))
        self.pca = BlockPCA.fit(frames.flatten(0, 1), self.mc.in_channels, self.mc.temporal_upsample, self.mc.spatial_upsample)
        weight, bias = self.pca.inverse_weights()
        with torch.no_grad():  # the decoder starts as the encoder's linear inverse and learns the rest
            self.decoder.inverse.weight.copy_(weight)
            self.decoder.inverse.bias.copy_(bias)
        print(f"pca: {self.mc.in_channels} components keep {self.pca.explained:.1%} of the blocks' variance", flush=True)
        return self.pca.explained

    def decoder_step(self) -> float:
        self._lr()
        frames = self._render(self._clips(self.cfg.batch))  # [B, F, tu, H, W, 3]
        z = self.pca.encode(frames)  # [B, C, F, h, w]
        z = z + torch.rand(z.shape[0], 1, 1, 1, 1, device=z.device) * self.cfg.decoder_noise * torch.randn_like(z)
        rgb, _ = self.decoder(z.transpose(1, 2))  # [B, F*tu, H, W, 3]
        target = frames.flatten(1, 2).float() / 127.5 - 1
        loss = torch.nn.functional.mse_loss(rgb, target)
        self._update(loss, self.decoder)
        return loss.item()

    def teacher_step(self) -> float:
        """Teacher forcing on a batch of text clips, video-to-video pairs (`follow_share`) and image clips
        (`image_share`), at the step's chunk size; the pairs share the text clips' layout, the images have theirs."""
        self._lr()
        cfg, fpc = self.cfg, self.chunk_size()
        n_images = image_count(cfg.batch, cfg.image_share)
        n_pairs = pair_count(cfg.batch, cfg.follow_share, n_images)
        clips = self._clips(cfg.batch - n_images - n_pairs, fpc)
        clean = self.pca.encode(self._render(clips))  # [B, C, F, h, w]
        captions = [clip_captions(c, fpc) for c in clips]
        weight = torch.tensor([chunk_weights(c) for c in clips], device=self.device).repeat_interleave(fpc, dim=1)  # [B, F]
        if n_pairs:  # after the text clips
            pairs = self._pairs(n_pairs, fpc)
            clean, weight = torch.cat([clean, pairs.target]), torch.cat([weight, pairs.weights])
            captions = captions + pairs.captions
        clean, captions, weight, lead = with_image_clips(self.rng, self.pca, self.mc, clean, captions, weight, n_images, fpc)
        b, nc, first = clean.shape[0], len(clips[0].chunks), len(clips)
        # sigma per noisy chunk: mostly one of the sampler's levels, else shift-warped uniform (a pair's: an input's)
        sigma = chunk_sigmas(self.gen, b, nc, cfg.p_sampler_sigma, self.device)
        start = clean
        if n_pairs:
            input_levels = follow_levels(cfg.follow_timesteps, self.device)
            sigma[first : first + n_pairs] = pair_sigmas(n_pairs, nc, input_levels, cfg.follow_min_step)
            start = clean.clone()
            start[first : first + n_pairs] = pair_starts(pairs.target, pairs.source, fpc)
        sigma = frame_sigmas(sigma, fpc, lead)  # [B, F]
        s = sigma[:, None, :, None, None]
        noisy = (1 - s) * start + s * torch.randn_like(clean)
        return self._forcing_step(clean, noisy, sigma, captions, weight, fpc, lead)

    def follow_step(self) -> float:
        """Teacher forcing on video-to-video pairs, plus as many text-to-video clips (stage 5), from a pool."""
        self._lr()
        cfg, fpc = self.cfg, self.chunk_size()
        b = cfg.follow_batch
        if fpc not in self._pool:
            self._pool[fpc] = follow_pool(self.rng, self.pca, self.mc, self.gen, cfg.follow_pool, fpc, **self._pair_recipe())
        pool = self._pool[fpc]
        pairs = pool.pairs.take(torch.randint(len(pool.pairs), (b,)).tolist())
        pick = torch.randint(len(pool.clips), (cfg.follow_t2v or b,)).tolist()
        clips = [pool.clips[i] for i in pick]
        clean = torch.cat([pairs.target, pool.clean[pick]])  # [B + T, C, F, h, w]
        captions = pairs.captions + [clip_captions(c, fpc) for c in clips]
        weight = torch.tensor([chunk_weights(c) for c in clips], device=self.device).repeat_interleave(fpc, dim=1)
        weight = torch.cat([pairs.weights, weight])  # [B + T, F]
        levels = follow_levels(cfg.follow_timesteps, self.device)
        nc = clean.shape[2] // fpc
        sigma = levels[torch.randint(len(levels), (clean.shape[0], nc), device=self.device)].float()
        sigma[:b] = pair_sigmas(b, nc, levels, cfg.follow_min_step)
        sigma = sigma.repeat_interleave(fpc, dim=1)  # [B + T, F]
        s = sigma[:, None, :, None, None]
        start = clean.clone()
        start[:b] = pair_starts(pairs.target, pairs.source, fpc)
        noisy = (1 - s) * start + s * torch.randn_like(clean)
        return self._forcing_step(clean, noisy, sigma, captions, weight, fpc)

    def _forcing_step(self, clean: torch.Tensor, noisy: torch.Tensor, sigma: torch.Tensor, captions: list, weight: torch.Tensor,
                      fpc: int, lead: torch.Tensor | None = None) -> float:
        """One teacher-forcing update (`forcing_loss`)."""
        loss = forcing_loss(self.model, self.encoder, clean, noisy, sigma, captions, weight, fpc, self._channel_weights(),
                            self.cfg.context_noise, lead, self.amp)
        self._update(loss, self.model)
        return loss.item()

    def _pair_recipe(self) -> dict:
        return {"shape_share": self.cfg.follow_shape_share, "switch_share": self.cfg.follow_switch, "device": self.device}

    def _pairs(self, n: int, fpc: int) -> FollowPairs:
        """`n` fresh video-to-video pairs at chunk size `fpc` (models/train_follow.py)."""
        return sample_pairs(self.rng, self.pca, self.mc, self.gen, n, fpc, **self._pair_recipe())

    def init_from(self, path: Path) -> None:
        """Start the follow stage from a model file's weights (`python -m models.train --export`'s)."""
        from models.model_file import read_model_file

        mf = read_model_file(path)
        if mf.config != self.mc:
            raise ValueError(f"{path} is a {mf.config} model, this run trains {self.mc}")
        self.model.load_state_dict(mf.dit)
        self.decoder.load_state_dict(mf.decoder)
        self.pca = BlockPCA.for_model(self.mc, mf.pca).to(self.device)
        self.stage, self.step = "follow", 0
        self.opt = self._optimizer()

    def rollout_step(self) -> float:
        """Streams rolled out by the ChunkGenerator up to chunk k (switching prompt where their timelines
        do), k's first `step` denoising steps too; then step `step` of chunk k with the gradient."""
        self._lr()
        cfg, fpc = self.cfg, self.chunk_size()
        k = int(self.rng.integers(cfg.rollout_chunks * CHUNK_UNIT // fpc))
        step = int(self.rng.integers(len(self.gen.sigmas)))
        sinks = clip_layout(self.gen, fpc)[0]
        timelines = [sample_clip(self.rng, k + 1, frames_per_chunk=fpc, sinks=sinks, p_long=0.0, height=self.mc.height,
                                 width=self.mc.width).timeline for _ in range(cfg.rollout_batch)]
        gen_cfg = replace(self.gen, frames_per_chunk=fpc, cuda_graphs=False, stage_kv=False)
        gen = ChunkGenerator(self.model, gen_cfg, self.encoder, NoDecoder(self.mc))  # the latents and the cache, no frames
        seed = int(self.rng.integers(2**31))
        self.model.eval()
        states = [gen.open_stream(f"r{i}", tl.caption_at(0), seed=seed + i) for i, tl in enumerate(timelines)]
        try:
            for chunk in range(k + 1):
                for s, tl in zip(states, timelines):
                    if tl.caption_at(chunk) != s.prompt:
                        gen.set_prompt(s, tl.caption_at(chunk))
                for _ in range(len(self.gen.sigmas) if chunk < k else step):
                    gen.denoise(states)
                if chunk < k:
                    gen.commit(states)
            if step == 0:  # start chunk k (its prompt, a recache after a switch, its noise) without a step
                for s in states:
                    gen.start_chunk(s)
            self.model.train()
            x = torch.stack([s.x for s in states]).clone()  # out of inference mode: autograd may keep it
            sigma = gen.sigmas[step]
            t = torch.full((len(states), fpc), 1000 * sigma, device=self.device)
            text = self.model.project_text(self.encoder.encode([s.prompt for s in states]).to(self.device))
            v = self.model.predict_flow(x, t, text, [CacheAccess(s.cache, s.cache.num_frames) for s in states])
            frames = self._render([Clip(tl, (k,)) for tl in timelines])  # chunk k as rendered, [B, F, tu, H, W, 3]
            if cfg.rollout_truth == "history" and k > 0:
                frames = self._continue_from(frames, states, timelines, k)
            truth = self.pca.encode(frames)
            loss = ((x - sigma * v - truth).pow(2) * self._channel_weights()).mean()
        finally:
            for s in states:
                gen.close_stream(s)
        self._update(loss, self.model)
        return loss.item()

    def _continue_from(self, frames: torch.Tensor, states, timelines, k: int) -> torch.Tensor:
        """Chunk k's rendered frames, each stream's shifted on the torus by where its generated object is
        at the last video frame of chunk k-1 against where the rendered one is; unshifted where no object
        is found (the scene is the same up to the shift: constant velocity, wrapping at the edges)."""
        fpc = timelines[0].frames_per_chunk
        last_latent = k * fpc - 1
        last_video = video_frames([last_latent], self.mc.temporal_upsample)[-1]
        newest = [max(range(len(s.cache.frame_ids)), key=s.cache.frame_ids.__getitem__) for s in states]
        z = torch.stack([s.clean[slot] for s, slot in zip(states, newest)])  # [B, C, h, w]
        seen = self.pca.decode(z[:, :, None])[:, 0, -1]  # [B, H, W, 3]: the linear inverse's last video frame
        found = object_centres(seen)  # [B, 2] (x, y), NaN without an object
        want = torch.as_tensor(np.stack([tl.centres([last_video])[0] for tl in timelines]), dtype=torch.float32)
        size = torch.tensor([self.mc.width, self.mc.height], dtype=torch.float32)
        return roll_frames(frames, torch.remainder(found.cpu() - want + size / 2, size) - size / 2)

    def _channel_weights(self) -> torch.Tensor:
        """[1, C, 1, 1, 1]: each latent channel's weight in the flow loss (TrainConfig.loss_weight)."""
        return channel_weights(self.pca, self.cfg.loss_weight).to(self.device)

    def _update(self, loss: torch.Tensor, module: torch.nn.Module) -> None:
        if not math.isfinite(loss.item()):  # e.g. an overflow under --amp: the step is skipped, the weights kept
            self.skipped_steps += 1
            return
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        self.opt.step()

    # -- export -------------------------------------------------------------------------------

    def export(self, path: Path, timesteps: Sequence[float] | None = None) -> None:
        """The weights as shipped: DiT, decoder, encoder and the caption words' text vectors, one file, with
        the denoising schedule to sample it with (`timesteps`; default: `follow_timesteps`, the built-in model's)."""
        from safetensors.torch import save_file

        words = vocabulary()
        tensors = {f"dit.{k}": v for k, v in self.model.state_dict().items()}
        tensors |= {f"decoder.{k}": v for k, v in self.decoder.state_dict().items()}
        tensors |= {f"pca.{k}": v for k, v in self.pca.state_dict().items()}
        tensors["text.vectors"] = torch.stack([self.encoder.word_vector(w) for w in words])
        tensors = {k: v.detach().float().cpu().contiguous() for k, v in tensors.items()}
        metadata = {"preset": self.cfg.preset, "model": json.dumps(asdict(self.mc)), "text.words": json.dumps(words),
                    "sampler.timesteps": json.dumps([float(t) for t in timesteps or self.cfg.follow_timesteps.split(",")])}
        save_file(tensors, path, metadata=metadata)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m models.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("runs/tiny"), help="checkpoint and log folder (resumed if it holds a checkpoint)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--minutes", type=float, default=9.0, help="stop (with a checkpoint) after this long")
    p.add_argument("--save-minutes", type=float, default=3.0, help="checkpoint this often")
    p.add_argument("--smoke", action="store_true", help="a few steps of each stage, seconds on a CPU (CI)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads torch may use")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="override a TrainConfig field")
    p.add_argument("--export", type=Path, help="after training, write the weights to this .safetensors file")
    p.add_argument("--timesteps", type=lambda v: tuple(float(t) for t in v.split(",")), metavar="T1,T2,...",
                   help="the sampling schedule the export names (timesteps before the shift; default: the "
                        "follow_timesteps field, 1000,500,250,100: a lower last level than Self-Forcing's 250 gives "
                        "the built-in model sharper edges)")
    p.add_argument("--init", type=Path, metavar="FILE",
                   help="start from a model file's weights (e.g. models/assets/tiny.safetensors) at the follow stage "
                        "(video-to-video; set follow_steps) instead of from scratch")
    p.add_argument("--amp", choices=("bf16", "off"), default="off",
                   help="the teacher stage's forward in bf16 autocast (float32 weights and loss; resumes either way)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.backends.cuda.matmul.allow_tf32 = True
    cfg = with_overrides(TrainConfig.smoke() if args.smoke else TrainConfig(), args.set, p.error)
    args.out.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(cfg, args.out, torch.device(args.device), amp=args.amp == "bf16")
    if trainer.resume():
        print(f"resumed {trainer.checkpoint_path} at {trainer.stage} step {trainer.step}", flush=True)
    elif args.init:
        trainer.init_from(args.init)
    done = trainer.run(args.minutes, args.save_minutes)
    print("done" if done else f"stopped at {trainer.stage} step {trainer.step}: run again to resume", flush=True)
    if args.export and trainer.pca is not None:
        trainer.export(args.export, args.timesteps)
        print(f"wrote {args.export} ({args.export.stat().st_size / 1e6:.2f} MB)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
