"""Video-to-video pairs in training (models/train_follow.py): what a pair is, and the teacher's batches that mix them
with text and image clips at both chunk sizes."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from client import pixels
from models import train
from models.config import ModelConfig
from models.scenes import MOTION_PHRASES
from models.stream import GeneratorConfig
from models.train import Trainer, TrainConfig
from models.train_clips import object_centres
from models.train_follow import follow_levels, pair_count, plan_pair, render_pairs

CPU = torch.device("cpu")


def drawn_pair(rng, fpc):
    """A pair at chunk size `fpc` drawn alone: (target frames [F, tu, H, W, 3], input frames, captions, weights)."""
    cfg = TrainConfig()
    mc = ModelConfig.from_name(cfg.preset, **train.parse_overrides(cfg.model))
    plan = plan_pair(rng, mc, GeneratorConfig(), fpc, cfg.follow_shape_share, cfg.follow_switch)
    target, source = render_pairs([plan], mc, "cpu")
    return target[0], source[0], plan.captions, plan.weights


def test_a_follow_pair_is_one_trajectory_in_two_looks_under_a_caption_without_motion():
    rng = np.random.default_rng(0)
    for _ in range(12):
        target, source, captions, weights = drawn_pair(rng, 3)
        assert len(captions) == 2 * 15 and len(weights) == 5 and weights[-1] == 1.0
        caption = " ".join(set(captions))
        assert target.shape == source.shape == (15, 4, 128, 128, 3)
        frames_t, frames_s = target.flatten(0, 1).float() / 127.5 - 1, source.flatten(0, 1).float() / 127.5 - 1
        ct, cs = object_centres(frames_t), object_centres(frames_s)  # the same place in both, frame by frame
        both = ~(ct.isnan().any(1) | cs.isnan().any(1))
        assert both.float().mean() > 0.9
        d = (ct[both] - cs[both]).abs()
        assert float(torch.minimum(d, torch.tensor([128, 128]) - d).max()) < 6  # a triangle's centroid: r/3 off
        look_t, look_s = pixels.read_frame(target[2, 0].numpy()), pixels.read_frame(source[2, 0].numpy())
        assert look_t.colour != look_s.colour and look_t.background != look_s.background
        if weights[0] == 0:  # a prompt switch: the target's look changes at the first counted chunk, the input's not
            at = weights.index(1.0) * 3
            a, b = pixels.read_frame(target[at - 1, -1].numpy()), pixels.read_frame(target[at, -1].numpy())
            assert (a.colour, a.shape) != (b.colour, b.shape) or a.background != b.background
            assert captions[0] != captions[-1] and captions[:3] == [captions[0]] * 3
        words = [p for ps in MOTION_PHRASES.values() for p in ps]
        assert not any(p in caption for p in words), caption
    for _ in range(12):  # chunks of 1: 13 of them, the sinks 0-2 each under the prompt it was made under
        target, source, captions, weights = drawn_pair(rng, 1)
        assert target.shape == source.shape == (13, 4, 128, 128, 3)
        assert len(captions) == 2 * 13 and len(weights) == 13 and weights[-1] == 1.0
        switch = weights.index(1.0)
        assert captions[:3] == [captions[0] if c < switch else captions[-1] for c in range(3)]
        assert captions[3:] == [captions[-1]] * 23
        if switch:
            a, b = pixels.read_frame(target[switch - 1, -1].numpy()), pixels.read_frame(target[switch, -1].numpy())
            assert (a.colour, a.shape) != (b.colour, b.shape) or a.background != b.background
            assert captions[0] != captions[-1]


def test_pairs_drawn_in_one_batch_are_each_pair_drawn_alone():
    cfg = TrainConfig()
    mc = ModelConfig.from_name(cfg.preset, **train.parse_overrides(cfg.model))
    rng = np.random.default_rng(3)
    plans = [plan_pair(rng, mc, GeneratorConfig(), 3, cfg.follow_shape_share, 1.0) for _ in range(3)]
    target, source = render_pairs(plans, mc, "cpu")
    for i, plan in enumerate(plans):
        alone = render_pairs([plan], mc, "cpu")
        assert torch.equal(target[i], alone[0][0]) and torch.equal(source[i], alone[1][0])
    assert not torch.equal(target[0], target[1])


def test_the_pairs_share_of_a_teacher_batch_leaves_text_clips():
    assert [pair_count(128, 0.25, 32), pair_count(3, 0.25, 1), pair_count(2, 0.25, 1), pair_count(128, 0.0, 32)] == [32, 1, 0, 0]
    assert pair_count(8, 0.6, 4) == 3  # a text clip stays
    for image, follow in ((0.5, 0.5), (0.25, -0.1), (0.9, 0.2)):
        with pytest.raises(ValueError, match="follow_share"):
            TrainConfig(image_share=image, follow_share=follow)


def teacher(step: int, **fields) -> Trainer:
    trainer = Trainer(replace(TrainConfig.smoke(), **fields), out=None, device=CPU)
    trainer.pca_step()
    trainer.stage, trainer.step = "teacher", step
    trainer.opt = trainer._optimizer()
    return trainer


def spy(monkeypatch):
    """Records each teacher-forcing update's batch (Trainer._forcing_step's arguments) and each draw of pairs."""
    seen = {"batch": [], "pairs": []}
    real_step, real_pairs = Trainer._forcing_step, train.sample_pairs

    def forcing_step(self, clean, noisy, sigma, captions, weight, fpc, lead=None):
        seen["batch"].append({"clean": clean, "noisy": noisy, "sigma": sigma, "captions": captions, "weight": weight,
                              "fpc": fpc, "lead": lead})
        return real_step(self, clean, noisy, sigma, captions, weight, fpc, lead)

    def sample_pairs(*args, **kwargs):
        seen["pairs"].append(real_pairs(*args, **kwargs))
        return seen["pairs"][-1]

    monkeypatch.setattr(Trainer, "_forcing_step", forcing_step)
    monkeypatch.setattr(train, "sample_pairs", sample_pairs)
    return seen


@pytest.mark.parametrize("step, fpc, frames", [(0, 3, 15), (1, 1, 13)])
def test_a_teacher_batch_mixes_text_clips_pairs_and_image_clips(monkeypatch, step, fpc, frames):
    """Batch 8, a quarter pairs and a quarter image clips: 4 text clips, 2 pairs at the step's chunk size in the text
    clips' layout, 2 image clips in theirs. Each pair's clean latents, captions and loss weights are its own; its noisy
    chunks are at the levels an input chunk starts at, each noised from the input's chunk or the target's (the noise
    is zeroed here, so that x_t / (1 - sigma) shows where a chunk started)."""
    seen = spy(monkeypatch)
    monkeypatch.setattr(torch, "randn_like", torch.zeros_like)
    trainer = teacher(step, batch=8, image_share=0.25, follow_share=0.25)
    assert np.isfinite(trainer.teacher_step())
    (batch,), (pairs,) = seen["batch"], seen["pairs"]
    assert batch["fpc"] == fpc and batch["clean"].shape[0] == 8 and batch["clean"].shape[2] == frames
    assert batch["lead"].tolist() == [0] * 6 + [1] * 2
    assert len(pairs) == 2 and pairs.target.shape == pairs.source.shape == batch["clean"][4:6].shape
    assert torch.equal(batch["clean"][4:6], pairs.target) and batch["captions"][4:6] == pairs.captions
    assert torch.equal(batch["weight"][4:6], pairs.weights) and (pairs.weights[:, -1] == 1).all()
    sigma = batch["sigma"][4:6]
    chunk_sigma = sigma.view(2, -1, fpc)
    assert (chunk_sigma == chunk_sigma[..., :1]).all()  # a level per chunk
    starts_at = follow_levels(trainer.cfg.follow_timesteps, CPU)[trainer.cfg.follow_min_step :]
    assert torch.isclose(sigma[..., None], starts_at).any(-1).all()  # 0.625 or 0.357
    start = batch["noisy"][4:6] / (1 - sigma[:, None, :, None, None])
    kinds = []
    for c in range(frames // fpc):
        chunk = slice(c * fpc, (c + 1) * fpc)
        for i in range(2):
            from_input = torch.allclose(start[i, :, chunk], pairs.source[i, :, chunk], atol=1e-4)
            from_target = torch.allclose(start[i, :, chunk], pairs.target[i, :, chunk], atol=1e-4)
            assert from_input or from_target
            kinds.append(from_input)
    assert any(kinds) and not all(kinds)
    s = batch["sigma"][:4, None, :, None, None]  # the text clips' chunks start from their own clean latents
    keep = (s < 0.99).expand_as(batch["noisy"][:4])
    torch.testing.assert_close((batch["noisy"][:4] / (1 - s).clamp_min(1e-6))[keep], batch["clean"][:4][keep])


@pytest.mark.parametrize("step", [0, 1])
def test_a_mixed_teacher_step_trains_every_dit_weight(monkeypatch, step):
    seen = spy(monkeypatch)
    trainer = teacher(step)  # the smoke batch: a text clip, a pair, an image clip
    before = {k: p.detach().clone() for k, p in trainer.model.named_parameters()}
    assert np.isfinite(trainer.teacher_step())
    assert [len(p) for p in seen["pairs"]] == [1] and seen["batch"][0]["lead"].tolist() == [0, 0, 1]
    assert [k for k, p in trainer.model.named_parameters() if torch.equal(p, before[k])] == []


@pytest.mark.parametrize("step", [0, 1])
def test_without_a_share_of_pairs_the_teacher_draws_none(monkeypatch, step):
    """follow_share 0: the batch is text and image clips alone and no pair is drawn (nor a level or a start for one),
    so the random streams and the losses are those of the teacher before pairs."""
    for name in ("sample_pairs", "pair_sigmas", "pair_starts"):
        monkeypatch.setattr(train, name, lambda *a, **k: pytest.fail("a pair was drawn"))
    seen = spy(monkeypatch)
    trainer = teacher(step, batch=8, follow_share=0.0)
    assert np.isfinite(trainer.teacher_step())
    assert seen["batch"][0]["lead"].tolist() == [0] * 6 + [1] * 2


def test_a_mixed_teacher_run_resumes_as_if_never_stopped(tmp_path):
    """Pairs are drawn fresh from the trainer's random stream, which the checkpoint holds: a run stopped after two
    steps and resumed takes the same next steps (losses equal) as one that went on."""
    cfg = replace(TrainConfig.smoke(), teacher_steps=4)
    first = Trainer(cfg, tmp_path, CPU)
    first.pca_step()
    first.stage, first.step = "teacher", 0
    first.opt = first._optimizer()

    def steps(trainer, n):
        out = []
        for _ in range(n):
            out.append(trainer.teacher_step())
            trainer.step += 1
        return out

    steps(first, 2)
    first.save()
    went_on = steps(first, 2)
    resumed = Trainer(cfg, tmp_path, CPU)
    assert resumed.resume() and (resumed.stage, resumed.step) == ("teacher", 2)
    assert steps(resumed, 2) == went_on


def test_a_checkpoint_from_before_pairs_resumes_without_them(tmp_path):
    old = Trainer(replace(TrainConfig.smoke(), follow_share=0.0), tmp_path, CPU)
    old.stage, old.step = "teacher", 1
    old.save()
    state = torch.load(old.checkpoint_path, weights_only=False)
    state["config"] = {k: v for k, v in state["config"].items() if k not in ("follow_share", "image_share")}
    torch.save(state, old.checkpoint_path)
    with pytest.raises(ValueError, match="use another --out"):
        Trainer(TrainConfig.smoke(), tmp_path, CPU).resume()  # the default mixes pairs in: not that run's recipe
    with pytest.raises(ValueError, match="use another --out"):
        Trainer(replace(TrainConfig.smoke(), follow_share=0.0), tmp_path, CPU).resume()  # nor image clips
    resumed = Trainer(replace(TrainConfig.smoke(), follow_share=0.0, image_share=0.0), tmp_path, CPU)
    assert resumed.resume() and (resumed.stage, resumed.step) == ("teacher", 1)
