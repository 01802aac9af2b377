"""Training to continue from a start image: the teacher's layout with a lead frame equals serving after
`start_from_image`, and the image clips are what models/train_image.py says."""

import numpy as np
import pytest
import torch

from client import pixels
from models import GeneratorConfig, build_generator
from models.model_file import BUILTIN_WEIGHTS
from models.scenes import COLOURS, HELD_OUT, SHAPE_WORDS, SIZES
from models.teacher_forcing import frame_sigmas, frame_text, teacher_forward, teacher_layout
from models.train import Trainer, TrainConfig
from models.train_image import MIN_CONTRAST, frame_weights, image_count, sample_image_clips
from tests.conftest import tiny_generator
from tests.models.test_start_image import square_image


def test_a_lead_frame_is_a_block_of_its_own_and_the_chunks_start_after_it():
    positions, visible = teacher_layout(num_chunks=2, frames_per_chunk=2, lead=1)  # blocks -1, 0, 0, 1
    assert positions == [0, 1, 2, 3] * 2
    assert visible.int().tolist() == [
        [1, 0, 0, 0, 0, 0, 0, 0],  # clean image: itself
        [1, 1, 1, 0, 0, 0, 0, 0],  # clean chunk 0: the image and itself
        [1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0],  # clean chunk 1 (a frame short)
        [0, 0, 0, 0, 1, 0, 0, 0],  # noisy image: itself only (it counts for nothing)
        [1, 0, 0, 0, 0, 1, 1, 0],  # noisy chunk 0: the clean image and itself
        [1, 0, 0, 0, 0, 1, 1, 0],
        [1, 1, 1, 0, 0, 0, 0, 1],  # noisy chunk 1: the clean image and chunk 0, and itself
    ]
    assert torch.equal(teacher_layout(2, 2, lead=0)[1], teacher_layout(2, 2)[1])
    with pytest.raises(ValueError, match="lead must be 0 or 1"):
        teacher_layout(2, 2, lead=2)


def test_a_lead_frames_chunks_take_their_levels_one_frame_later():
    sigma = torch.tensor([[1, 2], [3, 4]])
    out = frame_sigmas(sigma, 2, torch.tensor([0, 1]))
    assert out.tolist() == [[1, 1, 2, 2], [4, 3, 3, 4]]  # frames: chunks 0, 0, 1, 1 | the image, chunk 0, 0, 1
    assert frame_sigmas(sigma, 2).tolist() == [[1, 1, 2, 2], [3, 3, 4, 4]]


@pytest.mark.parametrize("nf", [3, 1])
@pytest.mark.parametrize("weights", ["random", "builtin"])
def test_teacher_forcing_with_a_lead_frame_equals_the_generator_after_an_image_start(weights, nf):
    """Image, chunk 1 committed, then chunk 2's first denoising step: the training forward over [image | chunk 1 |
    chunk 2 | ...] with a lead frame predicts the flow serving does (fp32, 1e-4)."""
    if weights == "builtin" and not BUILTIN_WEIGHTS.is_file():
        pytest.skip("the built-in model file is not in this checkout")
    gen = build_generator("tiny", dtype=torch.float32, weights=weights, cfg=GeneratorConfig(frames_per_chunk=nf))
    prompt = "a green square moving right"
    state = gen.open_stream("s", prompt, seed=3)
    image = gen.start_from_image(state, square_image()).latents
    it = gen.stream(state)
    chunk1 = next(it).latents
    noise = torch.Generator().set_state(state.noise.get_state())
    x = torch.randn(chunk1.shape, generator=noise)
    gen.denoise([state])
    v_served = x - state.x0  # sigma 1 at the first step

    frames = -(-(1 + 2 * nf) // nf) * nf  # a whole number of chunks' frames, at least the image and two chunks
    mc = gen.model_cfg
    pad = torch.zeros(mc.in_channels, frames - 1 - 2 * nf, mc.latent_height, mc.latent_width)
    clean = torch.cat([image, chunk1, torch.zeros_like(x), pad], dim=1)[None]  # chunk 2's clean twin is unseen
    noisy = torch.cat([torch.zeros_like(image), torch.zeros_like(chunk1), x, pad], dim=1)[None]
    t = torch.full((1, frames), 1000.0)
    with torch.no_grad():
        text = frame_text(gen.model, gen.text_encoder, [[prompt] * 2 * frames])
        v = teacher_forward(gen.model, clean, noisy, t, text, nf, lead=torch.tensor([1]))
    torch.testing.assert_close(v[0, :, 1 + nf : 1 + 2 * nf], v_served, rtol=0, atol=1e-4)


def test_a_batch_of_mixed_layouts_equals_each_clip_in_its_own():
    gen = tiny_generator()
    model, nf = gen.model, gen.cfg.frames_per_chunk
    mc = model.cfg
    g = torch.Generator().manual_seed(0)
    clean, noisy = (torch.randn(3, mc.in_channels, 2 * nf, mc.latent_height, mc.latent_width, generator=g) for _ in range(2))
    t = torch.rand(3, 2 * nf, generator=g) * 1000
    captions = [["a red ball"] * 4 * nf, ["a blue box"] * 4 * nf, ["a green ball"] * 4 * nf]
    lead = torch.tensor([1, 0, 1])
    with torch.no_grad():
        mixed = teacher_forward(model, clean, noisy, t, frame_text(model, gen.text_encoder, captions), nf, lead)
        for i in range(3):
            alone = teacher_forward(model, clean[i : i + 1], noisy[i : i + 1], t[i : i + 1],
                                    frame_text(model, gen.text_encoder, captions[i : i + 1]), nf, lead[i : i + 1])
            torch.testing.assert_close(mixed[i : i + 1], alone, rtol=0, atol=1e-5)
    assert not torch.allclose(mixed[0], teacher_forward(model, clean[:1], noisy[:1], t[:1],
                                                        frame_text(model, gen.text_encoder, captions[:1]), nf)[0])


def test_the_loss_counts_the_whole_chunks_after_the_image():
    assert frame_weights(9, 3) == [0, 1, 1, 1, 1, 1, 1, 0, 0]
    assert frame_weights(5, 1) == [0, 1, 1, 1, 1]
    assert [image_count(128, 0.25), image_count(2, 0.25), image_count(2, 0.0), image_count(1, 0.5)] == [32, 1, 0, 0]


def test_an_image_clip_starts_anywhere_keeps_its_colours_and_moves_as_its_caption_says():
    from models.config import ModelConfig

    mc = ModelConfig.from_name("tiny")
    rng = np.random.default_rng(0)
    n, frames = 64, 9
    clips = sample_image_clips(rng, n, frames, 3, mc)
    assert clips.frames.shape == (n, frames, 4, 128, 128, 3) and clips.weights.shape == (n, frames)
    video = clips.frames.flatten(1, 2).numpy()  # [N, 36, H, W, 3]: frame 0 four times, then video frames 1..32
    palette = np.array(list(COLOURS.values()))
    off_object = off_background = 0
    for i, scene in enumerate(clips.scenes):
        fg, bg = clips.looks[i]
        assert all((video[i, k] == video[i, 0]).all() for k in range(4))  # latent frame 0: the image alone
        is_fg, is_bg = (video[i] == fg).all(-1), (video[i] == bg).all(-1)
        assert (is_fg | is_bg).all() and is_fg.any(axis=(1, 2)).all()  # the image's colours, the object in every frame
        assert np.linalg.norm(fg.astype(float) - bg) >= MIN_CONTRAST - 1e-6
        assert pixels.nearest(fg) == scene.colour and scene.triple not in HELD_OUT
        off_object += not (palette == fg).all(1).any()
        off_background += tuple(bg) not in pixels.BACKGROUNDS.values()
        caption = clips.captions[i][0]
        assert clips.captions[i] == [caption] * 2 * frames and scene.colour in caption
        assert any(w in caption for w in SHAPE_WORDS[scene.shape])
        first, last = (np.asarray(pixels.read_frame(video[i, k]).centre) for k in (0, -1))
        d = np.abs(first - clips.starts[i])
        assert np.minimum(d, 128 - d).max() <= SIZES[scene.size]  # the object's centroid: a triangle's is lower
        d = np.abs(last - np.mod(first + 32 * np.asarray(scene.velocity), 128))  # 32 frames on at its velocity
        assert np.minimum(d, 128 - d).max() < 1.0, (scene, first, last)
    assert 0.3 < off_object / n < 0.7 and 0.3 < off_background / n < 0.7
    assert clips.starts.std(0).min() > 20  # anywhere, not centred


def test_a_teacher_step_trains_on_text_and_image_clips(monkeypatch):
    seen = []
    import models.train as train

    real = train.teacher_forward
    monkeypatch.setattr(train, "teacher_forward", lambda *a, **k: seen.append(a[-1]) or real(*a, **k))
    cfg = TrainConfig.smoke()
    assert cfg.image_share > 0
    trainer = Trainer(cfg, out=None, device=torch.device("cpu"))
    trainer.pca_step()
    trainer.stage = "teacher"
    trainer.opt = trainer._optimizer()
    before = {k: p.detach().clone() for k, p in trainer.model.named_parameters()}
    loss = trainer.teacher_step()
    assert np.isfinite(loss) and seen[0].tolist() == [0, 0, 1]  # a text clip, a video-to-video pair, one from an image
    assert [k for k, p in trainer.model.named_parameters() if torch.equal(p, before[k])] == []
    with pytest.raises(ValueError, match="image_share"):
        TrainConfig(image_share=1.0)
