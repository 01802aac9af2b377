"""Training the built-in model's input adapter: `python -m models.train_input --out DIR --export FILE`.

The built-in model draws text-to-video well (its shapes among them) but, trained on text scenes only, ignores
x_t's layout: an input video is restyled, not followed. Teaching the whole model to follow cost it its shapes:
every full run with video-to-video pairs and image starts in the teacher's batches came out with squares rounded
into blobs (benchmarks/RESULTS.md, "The new recipe's first full run on a GPU", "Two runs side by side"). In a pair
the noisy chunk's shape is the input's and the target's is the prompt's, so the model learns to distrust the shape
x_t shows, its own text-to-video steps included.

So the input is a mode of its own: a LoRA (models/adapters.py, the per-stream adapters styles use) that the
server applies to the streams that have an input, a video to follow or a start image, and to no other. A
text-to-video stream runs the base weights, bit for bit; a stream with an input runs base + adapter. The adapter
is trained here with the base frozen, on the teacher's three kinds of clips in one batch:
- video-to-video pairs (models/train_follow.py, `pair_share`): the input's path in the prompt's look, each noisy
  chunk started from the input at a level an input chunk starts at (0.625, 0.357 for the built-in schedule);
- clips that start from an image (models/train_image.py, `image_share`): latent frame 0 a clean image, then the
  prompt's motion from where the image has the object;
- text clips (the rest): a stream with an input runs text-to-video chunks too (a camera gone quiet, strength 1).
The forward is serving's own (the adapter goes in as the stream's `AdapterUse`), the loss the teacher's
(models/train.py `forcing_loss`), the run models/train_style.py's (resumable, `--minutes`, `--smoke`). `--export`
writes the pairs in PEFT's layout; `--embed FILE` then writes the base model file with them in it (models/model_file.py
`INPUT_ADAPTER`, `embed_input_adapter`), where `serve --weights FILE` finds them.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from models.model_file import embed_input_adapter
from models.teacher_forcing import chunk_sigmas, frame_sigmas, sigmas
from models.train import forcing_loss
from models.train_clips import chunk_weights, clip_captions, render_clips, text_clips
from models.train_follow import pair_count, pair_sigmas, pair_starts, sample_pairs
from models.train_image import image_count, with_image_clips
from models.train_style import StyleConfig, StyleTrainer, add_run_arguments, train_from_arguments

ADAPTER_NAME = "input"  # the adapter's name in the model file and in a stream's state


@dataclass(frozen=True)
class InputConfig(StyleConfig):
    """One input-adapter run: models/train_style.py's fields (but `switch_share`, a style's live switch: the input
    adapter is on from a stream's start) and the batch's mix."""

    style: str = ADAPTER_NAME
    targets: str = "blocks+head"
    rank: int = 16
    alpha: float = 16.0
    steps: int = 1500
    batch: int = 16
    pair_share: float = 0.5  # share of each batch that is video-to-video pairs
    image_share: float = 0.25  # share that starts from an image (the rest: text clips, at least one)
    pair_shape_share: float = 0.75  # share of pairs whose input is another shape (models/train.py follow_shape_share)
    pair_switch_share: float = 0.5  # share of pairs whose prompt switches at a chunk boundary (follow_switch)
    min_step: int = 2  # the first step of the schedule an input chunk starts at (follow_min_step)

    def __post_init__(self) -> None:
        if self.style != ADAPTER_NAME:
            raise ValueError(f"style {self.style!r}: the input adapter is {ADAPTER_NAME!r}")
        self.check()
        if not (0 <= self.pair_share and 0 <= self.image_share and self.pair_share + self.image_share < 1):
            raise ValueError(f"pair_share {self.pair_share}, image_share {self.image_share}: use shares of at least 0 "
                             "that add up to less than 1 (text clips stay in every batch)")

    @classmethod
    def smoke(cls) -> InputConfig:
        """Two steps of three clips (a text clip, a pair, an image clip), one at each chunk size (CI)."""
        return cls(steps=2, batch=3)


class InputTrainer(StyleTrainer):
    """The frozen base model and the input adapter's pairs (models/train_style.py `StyleTrainer`), trained on
    pairs, image starts and text clips."""

    cfg: InputConfig

    def export_metadata(self) -> dict[str, str]:
        """The inputs it was trained for (a batch without image clips teaches nothing of start images: the model file
        then leaves image streams on the base weights)."""
        kinds = [k for k, share in (("video", self.cfg.pair_share), ("image", self.cfg.image_share)) if share > 0]
        return {"input_kinds": ",".join(kinds)}

    def step_loss(self, fpc: int) -> torch.Tensor:
        """The teacher's loss on one mixed batch at chunk size `fpc` (models/train.py `Trainer.teacher_step`'s
        layout: text clips, then pairs, then image clips), under the adapter."""
        cfg, dev = self.cfg, self.device
        n_images = image_count(cfg.batch, cfg.image_share)
        n_pairs = pair_count(cfg.batch, cfg.pair_share, n_images)
        clips = text_clips(self.rng, cfg.batch - n_images - n_pairs, self.gen, self.mc, fpc)
        clean = self.pca.encode(render_clips(clips, fpc, self.mc.temporal_upsample, dev))
        captions = [clip_captions(c, fpc) for c in clips]
        weight = torch.tensor([chunk_weights(c) for c in clips], device=dev).repeat_interleave(fpc, dim=1)
        first, nc = len(clips), len(clips[0].chunks)
        start = clean
        if n_pairs:
            pairs = sample_pairs(self.rng, self.pca, self.mc, self.gen, n_pairs, fpc, shape_share=cfg.pair_shape_share,
                                 switch_share=cfg.pair_switch_share, device=dev)
            clean, weight = torch.cat([clean, pairs.target]), torch.cat([weight, pairs.weights])
            captions = captions + pairs.captions
            start = torch.cat([start, pair_starts(pairs.target, pairs.source, fpc)])
        clean, captions, weight, lead = with_image_clips(self.rng, self.pca, self.mc, clean, captions, weight, n_images, fpc)
        start = torch.cat([start, clean[start.shape[0]:]])  # image clips start from their own frames
        sigma = chunk_sigmas(self.gen, clean.shape[0], nc, cfg.p_sampler_sigma, dev)
        if n_pairs:
            sigma[first : first + n_pairs] = pair_sigmas(n_pairs, nc, sigmas(self.gen).to(dev), cfg.min_step)
        sigma = frame_sigmas(sigma, fpc, lead)  # [B, F]
        s = sigma[:, None, :, None, None]
        noisy = (1 - s) * start + s * torch.randn_like(clean)
        return forcing_loss(self.model, self.encoder, clean, noisy, sigma, captions, weight, fpc, self.channels,
                            cfg.context_noise, lead, lora=self.adapter())


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m models.train_input", description=__doc__.split("\n\n")[0])
    add_run_arguments(p, "adapter", "runs/input", "two steps of three clips")
    p.add_argument("--embed", type=Path, metavar="FILE",
                   help="after --export, write the base model file with the adapter in it to FILE (what serve --weights FILE runs)")
    args = p.parse_args(argv)
    if args.embed and not args.export:
        p.error("--embed needs --export (the adapter file it embeds)")
    trainer = train_from_arguments(p, args, InputConfig.smoke() if args.smoke else InputConfig(), InputTrainer)
    if args.embed:
        embed_input_adapter(trainer.cfg.base_path, args.export, args.embed)
        print(f"wrote {args.embed} ({args.embed.stat().st_size / 1e6:.2f} MB): {trainer.cfg.base_path.name} with the adapter", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
