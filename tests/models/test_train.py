"""Training the built-in model: the teacher-forcing forward equals serving's, and a smoke run resumes."""

import json
import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from models.latent import BlockPCA, video_frames
from models import train, train_clips
from models.scenes import Clip, Scene, Timeline, draw, sample_clip
from models.teacher_forcing import frame_text, teacher_forward, teacher_layout
from models.train import STAGES, Trainer, TrainConfig, main
from models.train_clips import chunk_weights, clip_captions, object_centres
from tests.conftest import tiny_generator


def test_layout_is_self_forcings_clean_then_noisy():
    positions, visible = teacher_layout(num_chunks=3, frames_per_chunk=1)
    assert positions == [0, 1, 2, 0, 1, 2]
    assert visible.int().tolist() == [
        [1, 0, 0, 0, 0, 0],  # clean chunks: block-causal
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 0, 0],  # noisy chunk 0: itself
        [1, 0, 0, 0, 1, 0],  # noisy chunk 1: clean chunk 0 and itself
        [1, 1, 0, 0, 0, 1],
    ]


@pytest.mark.parametrize("weights", ["random", "builtin"])
def test_teacher_forcing_equals_the_chunk_generator_across_a_prompt_switch(weights):
    """Chunks 0 and 1 under A, a switch to B (the recache redoes chunk 1's K/V, the sinks keep A's),
    then chunk 2's first denoising step: the training forward predicts the same flow (fp32, 1e-4), for
    a flow model (random weights) and for the shipped one, which predicts x0."""
    from models import build_generator
    from models.model_file import BUILTIN_WEIGHTS

    if weights == "builtin" and not BUILTIN_WEIGHTS.is_file():
        pytest.skip("the built-in model file is not in this checkout")
    gen = build_generator("tiny", dtype=torch.float32, weights=weights)
    assert gen.model_cfg.prediction == ("sample" if weights == "builtin" else "flow")
    nf = gen.cfg.frames_per_chunk
    state = gen.open_stream("s", "a red ball moving right", seed=3)
    it = gen.stream(state)
    clean = [next(it).latents for _ in range(2)]
    gen.set_prompt(state, "a blue square falling")
    noise = torch.Generator().set_state(state.noise.get_state())  # the noise chunk 2 starts from
    x = torch.randn(clean[0].shape, generator=noise)
    gen.denoise([state])
    v_served = x - state.x0  # sigma 1 at the first step: x0 = x - v

    model = gen.model
    clean_all = torch.stack([torch.cat([*clean, torch.zeros_like(x)], dim=1)])  # chunk 2's clean twin is unseen
    noisy = torch.stack([torch.cat([torch.zeros_like(x)] * 2 + [x], dim=1)])
    t = torch.full((1, 3 * nf), 1000.0)
    captions = ["a red ball moving right"] * nf + ["a blue square falling"] * (5 * nf)
    with torch.no_grad():
        v = teacher_forward(model, clean_all, noisy, t, frame_text(model, gen.text_encoder, [captions]), nf)
    torch.testing.assert_close(v[0, :, 2 * nf :], v_served, rtol=0, atol=1e-4)


@pytest.mark.parametrize("switch_at", [2, 5])
def test_at_chunk_size_one_teacher_forcing_equals_the_chunk_generator(switch_at):
    """Chunks of 1 latent frame: chunks 0 .. switch_at-1 under A, a switch to B (its recache redoes the window's
    chunks; the sinks, chunks 0-2, keep the prompt each was committed under), on to chunk 5's first denoising
    step. The training forward, its mask per chunk of 1 and its captions from `clip_captions` of the same
    timeline, predicts the same flow (fp32, 1e-4): at 2 the switch lands among the sinks, at 5 in the window."""
    from models import build_generator
    from models.stream import GeneratorConfig

    gen = build_generator("tiny", dtype=torch.float32, weights="random", cfg=GeneratorConfig(frames_per_chunk=1))
    a, b = Scene("red", "ball", motion="right"), Scene("blue", "square", motion="down")
    captions = {"A": "a red ball moving right", "B": "a blue square falling"}
    state = gen.open_stream("s", captions["A"], seed=3)
    it = gen.stream(state)
    clean = []
    for c in range(5):
        if c == switch_at:
            gen.set_prompt(state, captions["B"])
        clean.append(next(it).latents)
    if switch_at == 5:
        gen.set_prompt(state, captions["B"])
    noise = torch.Generator().set_state(state.noise.get_state())  # the noise chunk 5 starts from
    x = torch.randn(clean[0].shape, generator=noise)
    gen.denoise([state])
    v_served = x - state.x0  # sigma 1 at the first step: x0 = x - v

    clip = Clip(Timeline(((0, a, "A"), (switch_at, b, "B")), frames_per_chunk=1), tuple(range(6)), sinks=3)
    frame_captions = [captions[c] for c in clip_captions(clip, 1)]
    assert clip_captions(clip, 1)[:3] == ["A", "A", "A" if switch_at == 5 else "B"]
    model = gen.model
    clean_all = torch.cat([*clean, torch.zeros_like(x)], dim=1)[None]  # chunk 5's clean twin is unseen
    noisy = torch.cat([torch.zeros_like(x)] * 5 + [x], dim=1)[None]
    with torch.no_grad():
        text = frame_text(model, gen.text_encoder, [frame_captions])
        v = teacher_forward(model, clean_all, noisy, torch.full((1, 6), 1000.0), text, 1)
    torch.testing.assert_close(v[0, :, 5:], v_served, rtol=0, atol=1e-4)


def test_a_batch_sharing_one_layout_equals_each_sample_alone():
    """Training's batch shares one access (no cache, one mask): attention runs on the batch at once; it
    must give what the per-stream path gives each sample."""
    from models.dit import CacheAccess

    gen = tiny_generator()
    model, nf = gen.model, gen.cfg.frames_per_chunk
    mc = model.cfg
    g = torch.Generator().manual_seed(0)
    clean, noisy = (torch.randn(3, mc.in_channels, 2 * nf, mc.latent_height, mc.latent_width, generator=g) for _ in range(2))
    t = torch.rand(3, 2 * nf, generator=g) * 1000
    text = frame_text(model, gen.text_encoder, [["a red ball"] * 4 * nf, ["a blue box"] * 4 * nf, ["a green ball"] * 4 * nf])
    positions, visible = teacher_layout(2, nf)
    shared = CacheAccess(None, 0, visible=visible, positions=positions)
    x, tt = torch.cat([clean, noisy], dim=2), torch.cat([torch.zeros_like(t), t], dim=1)
    with torch.no_grad():
        batched = model.predict_flow(x, tt, text, [shared] * 3)
        alone = model.predict_flow(x, tt, text, [replace(shared) for _ in range(3)])  # distinct: the loop
    torch.testing.assert_close(batched, alone, rtol=0, atol=1e-5)


def test_captions_and_loss_follow_what_a_cache_holds_after_a_switch():
    a, b = Scene("red", "ball", motion="right"), Scene("blue", "square", motion="down")
    from models.scenes import Clip

    switched = Clip(Timeline(((0, a, "A"), (3, b, "B"))), (0, 1, 2, 3, 4))
    assert clip_captions(switched, 1) == ["A"] + ["B"] * 9
    assert chunk_weights(switched) == [0, 0, 0, 1, 1]
    long = Clip(Timeline(((0, a, "A"), (9, b, "B"))), (0, 20, 21, 22, 23))
    assert chunk_weights(long) == [0, 0, 1, 1, 1]  # chunk 20 right after the sinks: not a real cache


def test_at_chunk_size_one_each_sink_chunk_keeps_its_own_prompt():
    a, b, c = (Scene(*t) for t in (("red", "ball"), ("blue", "square"), ("green", "triangle")))
    among_sinks = Clip(Timeline(((0, a, "A"), (1, b, "B"), (7, c, "C")), frames_per_chunk=1), tuple(range(13)), sinks=3)
    assert clip_captions(among_sinks, 1) == ["A", "B", "B"] + ["C"] * 23  # clean sinks 0-2, then the rest
    assert chunk_weights(among_sinks) == [0.0] * 7 + [1.0] * 6
    long = Clip(Timeline(((0, a, "A"), (40, b, "B")), frames_per_chunk=1), (0, 1, 2, *range(50, 60)), sinks=3)
    assert long.long and clip_captions(long, 1) == ["A"] * 3 + ["B"] * 23
    assert chunk_weights(long) == [0, 0, 0, 0] + [1] * 9  # chunk 50 right after the sinks: not a real cache
    assert clip_captions(Clip(long.timeline, long.chunks), 1)[:3] == ["A", "B", "B"]  # one sink chunk: only it keeps A


def test_chunk_sizes_are_trained_in_turn_and_checked():
    trainer = Trainer(TrainConfig.smoke(), out=None, device=torch.device("cpu"))
    assert [trainer.chunk_size() for trainer.step in range(4)] == [3, 1, 3, 1]
    assert train_clips.clip_layout(trainer.gen, 3) == (1, 5) and train_clips.clip_layout(trainer.gen, 1) == (3, 13)
    assert TrainConfig(chunk_sizes="3,3,1").sizes == (3, 3, 1)
    for bad in ("2", "3,0", "", "one"):
        with pytest.raises(ValueError, match="chunk sizes"):
            TrainConfig(chunk_sizes=bad)


def test_a_teacher_step_at_chunk_size_one_trains_on_what_its_cache_holds(monkeypatch):
    """Step 1 of the teacher stage trains chunks of 1: clips of 13 latent frames (3 sink chunks, 9 window chunks
    and the chunk made), each its own chunk in the mask, and its gradients reach every DiT weight."""
    trainer = Trainer(TrainConfig.smoke(), out=None, device=torch.device("cpu"))
    trainer.pca_step()
    trainer.stage, trainer.step = "teacher", 1
    trainer.opt = trainer._optimizer()
    seen = []
    real = train.teacher_forward

    def forward(model, clean, noisy, t, text, fpc, lead=None, lora=None):
        seen.append((clean.shape, fpc, lead))
        return real(model, clean, noisy, t, text, fpc, lead, lora=lora)

    monkeypatch.setattr(train, "teacher_forward", forward)
    before = {k: p.detach().clone() for k, p in trainer.model.named_parameters()}
    assert math.isfinite(trainer.teacher_step())
    (shape, fpc, lead), = seen
    assert fpc == 1 and shape[0] == 3 and shape[2] == 13
    assert lead.tolist() == [0, 0, 1]  # a text clip, a pair, then a clip that starts from an image (models/train_image.py)
    assert [k for k, p in trainer.model.named_parameters() if torch.equal(p, before[k])] == []


def test_gradients_reach_every_dit_weight():
    trainer = Trainer(TrainConfig.smoke(), out=None, device=torch.device("cpu"))
    trainer.pca_step()
    trainer.stage = "teacher"
    trainer.opt = trainer._optimizer()
    before = {k: p.detach().clone() for k, p in trainer.model.named_parameters()}
    trainer.teacher_step()
    unchanged = [k for k, p in trainer.model.named_parameters() if torch.equal(p, before[k])]
    assert unchanged == []


def test_pca_encodes_whitened_and_its_inverse_recovers_flat_colour():
    rng = np.random.default_rng(0)
    clips = [sample_clip(rng) for _ in range(4)]
    frames = torch.stack([c.timeline.render(video_frames(range(12))).view(12, 4, 128, 128, 3) for c in clips])
    pca = BlockPCA.fit(frames.flatten(0, 1), channels=16)
    z = pca.encode(frames)
    assert z.shape == (4, 16, 12, 16, 16)
    assert torch.allclose(z.std(dim=(0, 2, 3, 4)), torch.ones(16), atol=0.02)
    back = pca.decode(z)
    target = frames.float() / 127.5 - 1
    assert (back - target).abs().mean() < 0.05 and pca.explained > 0.9


def test_smoke_run_trains_every_stage_resumes_and_exports(tmp_path, capsys):
    from safetensors import safe_open

    out = tmp_path / "run"
    weights = tmp_path / "tiny.safetensors"
    args = ["--smoke", "--out", str(out), "--device", "cpu", "--save-minutes", "0"]
    assert main(args + ["--minutes", "0"]) == 0  # stops at once, with a checkpoint
    assert "run again to resume" in capsys.readouterr().out
    assert main(args + ["--export", str(weights)]) == 0
    assert "done" in capsys.readouterr().out
    stages = [json.loads(line)["stage"] for line in (out / "log.jsonl").read_text().splitlines()]
    assert sorted(set(stages)) == sorted(STAGES) and len(stages) == 1 + 3 + 3 + 2 + 2
    sizes = [(r["stage"], r.get("chunk")) for r in map(json.loads, (out / "log.jsonl").read_text().splitlines())]
    assert [n for stage, n in sizes if stage == "teacher"] == [3, 1, 3]  # both chunk sizes, in turn
    assert [n for stage, n in sizes if stage in ("rollout", "follow")] == [3, 1, 3, 1]
    with safe_open(str(weights), "pt") as f:
        keys = set(f.keys())
    assert {"pca.basis", "text.vectors", "decoder.conv_in.weight", "dit.patch_embedding.weight"} <= keys
    assert weights.stat().st_size < 5e6


def test_the_decoder_starts_as_the_encoders_inverse():
    trainer = Trainer(TrainConfig.smoke(), out=None, device=torch.device("cpu"))
    trainer.pca_step()
    trainer.decoder.detail.weight.data.zero_()  # leave only the linear path and a flat colour of 0
    trainer.decoder.color.weight.data.zero_()
    clip = sample_clip(np.random.default_rng(5))
    frames = clip.timeline.render(video_frames(range(6))).view(1, 6, 4, 128, 128, 3)
    z = trainer.pca.encode(frames)
    with torch.no_grad():
        rgb, _ = trainer.decoder(z.transpose(1, 2))
    torch.testing.assert_close(rgb, trainer.pca.decode(z).flatten(1, 2), atol=1e-4, rtol=0)


def test_a_rollout_step_trains_on_the_generators_own_cache_across_a_switch(tmp_path, monkeypatch):
    """The rollout stage rolls streams out with the ChunkGenerator (a prompt switch, so a recache) and
    steps every DiT weight that one denoising forward reaches, leaving no stream open."""
    import models.train as train

    trainer = Trainer(TrainConfig.smoke(), tmp_path, torch.device("cpu"))
    trainer.pca_step()
    trainer.stage, trainer.step = "rollout", 0
    trainer.opt = trainer._optimizer()
    switched = []
    real = train.sample_clip

    def with_switch(rng, num_chunks, **kw):  # always a switch at the last chunk
        clip = real(rng, num_chunks, **kw)
        a, b = Scene("red", "ball", motion="right"), Scene("blue", "square", motion="down")
        segments = ((0, a, "a red ball moving right"), (num_chunks - 1, b, "a blue square falling"))
        switched.append(num_chunks > 1)
        return clip.__class__(Timeline(segments if num_chunks > 1 else segments[:1]), clip.chunks)

    monkeypatch.setattr(train, "sample_clip", with_switch)
    trainer.rng = np.random.default_rng(1)  # k = 2 of rollout_chunks 3: two chunks, then the switch
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    recaches = []
    real_recache = train.ChunkGenerator.recache
    monkeypatch.setattr(train.ChunkGenerator, "recache", lambda self, s: (recaches.append(s.stream_id), real_recache(self, s)))
    loss = trainer.rollout_step()
    assert np.isfinite(loss)
    assert any(switched) and recaches, "the rollout crossed a prompt switch with a recache"
    after = trainer.model.state_dict()
    moved = [k for k in before if not torch.equal(before[k], after[k])]
    assert any(k.startswith("blocks.0.self_attn") for k in moved) and any(k.startswith("head") for k in moved)


def test_a_rollout_step_at_chunk_size_one_rolls_out_chunks_of_one(tmp_path, monkeypatch):
    """Step 1 of the rollout stage rolls out chunks of 1 latent frame, up to chunk k of rollout_chunks chunks of 3's
    worth of latent frames (k = 7 of 9 here: the sinks and into the window), and steps the DiT."""
    import models.train as train

    trainer = Trainer(TrainConfig.smoke(), tmp_path, torch.device("cpu"))
    trainer.pca_step()
    trainer.stage, trainer.step = "rollout", 1
    trainer.opt = trainer._optimizer()
    commits = []
    real = train.ChunkGenerator.commit

    def commit(self, states):
        commits.append((self.cfg.frames_per_chunk, states[0].cache.num_frames))
        return real(self, states)

    monkeypatch.setattr(train.ChunkGenerator, "commit", commit)
    trainer.rng = np.random.default_rng(0)  # k = 7
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    assert np.isfinite(trainer.rollout_step())
    assert commits == [(1, n) for n in range(7)]  # chunks 0-6 committed a latent frame each, then chunk 7 trained
    assert any(not torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())


def test_an_older_checkpoint_resumes_at_chunk_size_three_only(tmp_path):
    """A checkpoint from before chunk sizes (clips of `chunks` 5, chunks of 3 only) resumes with chunk_sizes=3, the
    recipe it was made with, and not with both sizes; a new one resumes at the size its step is at."""
    old = Trainer(replace(TrainConfig.smoke(), chunk_sizes="3"), tmp_path, torch.device("cpu"))
    old.stage, old.step = "teacher", 1
    old.save()
    state = torch.load(old.checkpoint_path, weights_only=False)
    config = {k: v for k, v in state["config"].items() if k != "chunk_sizes"}
    state["config"] = {**config, "chunks": 5}
    torch.save(state, old.checkpoint_path)
    resumed = Trainer(replace(TrainConfig.smoke(), chunk_sizes="3"), tmp_path, torch.device("cpu"))
    assert resumed.resume() and (resumed.stage, resumed.step, resumed.chunk_size()) == ("teacher", 1, 3)
    with pytest.raises(ValueError, match="use another --out"):
        Trainer(TrainConfig.smoke(), tmp_path, torch.device("cpu")).resume()
    state["config"]["chunks"] = 4  # clips of another length: not today's recipe at any size
    torch.save(state, old.checkpoint_path)
    with pytest.raises(ValueError, match="use another --out"):
        Trainer(replace(TrainConfig.smoke(), chunk_sizes="3"), tmp_path, torch.device("cpu")).resume()
    both = Trainer(TrainConfig.smoke(), tmp_path / "new", torch.device("cpu"))
    (tmp_path / "new").mkdir()
    both.stage, both.step = "teacher", 1
    both.save()
    again = Trainer(TrainConfig.smoke(), tmp_path / "new", torch.device("cpu"))
    assert again.resume() and again.chunk_size() == 1


def test_the_flow_loss_weighs_latent_channels_by_their_spread_before_whitening(tmp_path):
    trainer = Trainer(TrainConfig.smoke(), tmp_path, torch.device("cpu"))
    trainer.pca_step()
    std = trainer.pca.std
    for how, power in (("none", 0), ("std", 1), ("var", 2)):
        trainer.cfg = replace(trainer.cfg, loss_weight=how)
        w = trainer._channel_weights().flatten()
        torch.testing.assert_close(w, std**power / (std**power).mean())
    assert w[0] > 100 * w[-1]  # the first component (mean colour) far above the last (fine detail)
    with pytest.raises(ValueError, match="loss_weight"):
        TrainConfig(loss_weight="pixels")


def test_object_centres_find_a_drawn_object_across_the_edges():
    scenes = [Scene("red", "ball", size="small"), Scene("yellow", "square"), Scene("white", "triangle", background="black")]
    centres = np.array([[30.0, 64.0], [126.0, 3.0], [64.0, 127.5]])
    frames = draw(centres, scenes, 128, 128, "cpu").float() / 127.5 - 1
    found = object_centres(frames)
    dist = torch.remainder(found - torch.tensor(centres, dtype=torch.float32) + 64, 128) - 64
    assert dist[:2].abs().max() < 0.6  # ball and square: symmetric about their centre
    assert dist[2, 0].abs() < 0.6 and dist[2, 1].abs() < 6  # the triangle's mass sits below its box centre
    empty = torch.full((1, 128, 128, 3), -0.5)
    assert torch.isnan(object_centres(empty)).all()


def test_the_rollout_target_continues_from_where_the_generated_object_is(tmp_path):
    """rollout_truth "history": chunk k's target is the rendered chunk moved by how far the model's object
    (read from its last latent frame of chunk k-1) is from the rendered one; no object: not moved."""
    trainer = Trainer(replace(TrainConfig.smoke(), pca_clips=32), tmp_path, torch.device("cpu"))
    trainer.pca_step()
    fpc, tu = trainer.gen.frames_per_chunk, trainer.mc.temporal_upsample
    a = Scene("green", "square", motion="right")
    tl = Timeline(((0, a, "a green square moving right"),))
    k, offset = 2, (-20, 12)
    last = video_frames([k * fpc - 1], tu)[-1]
    centre = tl.centres([last]) + np.array([offset])
    seen = draw(np.repeat(centre, tu, axis=0), [a] * tu, 128, 128, "cpu")  # the model's last latent frame, astray
    z = trainer.pca.encode(seen[None, None])[0, :, 0]  # [C, h, w]
    state = type("S", (), {})()
    state.cache = type("C", (), {"frame_ids": [0, 1, 2, k * fpc - 1, k * fpc - 2]})()
    state.clean = torch.stack([torch.zeros_like(z)] * 3 + [z, torch.zeros_like(z)])
    frames = train_clips.render_clips([Clip(tl, (k,))], fpc, tu, "cpu")
    moved = trainer._continue_from(frames, [state], [tl], k)
    # read from the PCA's linear inverse, the object's centre is within a pixel of where it was drawn
    near = [(offset[0] + i, offset[1] + j) for i in (-1, 0, 1) for j in (-1, 0, 1)]
    assert any(torch.equal(moved, train_clips.roll_frames(frames, torch.tensor([d], dtype=torch.float32))) for d in near)
    state.clean = torch.zeros_like(state.clean) - 3  # no object in view: the rendered truth as it is
    assert torch.equal(trainer._continue_from(frames, [state], [tl], k), frames)
    shifted = draw(np.array([[40.0, 50.0]]) + np.array([offset]), [a], 128, 128, "cpu")
    torch.testing.assert_close(train_clips.roll_frames(draw(np.array([[40.0, 50.0]]), [a], 128, 128, "cpu"), torch.tensor([offset], dtype=torch.float32)), shifted)


def test_the_teacher_step_under_bf16_autocast_tracks_float32(tmp_path):
    """--amp bf16: the teacher's forward in bf16 autocast gives the float32 loss within bf16's precision, and
    the weights it steps stay float32."""
    losses = {}
    for amp in (False, True):
        trainer = Trainer(TrainConfig.smoke(), tmp_path / str(amp), torch.device("cpu"), amp=amp)
        trainer.pca_step()
        trainer.stage, trainer.step = "teacher", 0
        trainer.opt = trainer._optimizer()
        trainer.rng = np.random.default_rng(5)
        torch.manual_seed(5)
        losses[amp] = trainer.teacher_step()
        assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    assert np.isfinite(losses[True]) and losses[True] != losses[False]
    assert abs(losses[True] - losses[False]) < 0.05 * losses[False]


def test_a_step_whose_loss_is_not_finite_is_skipped(tmp_path):
    trainer = Trainer(TrainConfig.smoke(), tmp_path, torch.device("cpu"))
    trainer.pca_step()
    trainer.stage, trainer.step = "teacher", 0
    trainer.opt = trainer._optimizer()
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    loss = sum(p.sum() for p in trainer.model.parameters()) * float("nan")
    trainer._update(loss, trainer.model)
    assert trainer.skipped_steps == 1
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
    trainer._update(sum(p.pow(2).sum() for p in trainer.model.parameters()), trainer.model)  # a finite one steps
    assert trainer.skipped_steps == 1 and not all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())


def test_model_overrides_are_typed_as_the_config_fields():
    assert train.parse_overrides("dim=128,num_layers=2,eps=1e-5,prediction=sample") == {
        "dim": 128, "num_layers": 2, "eps": 1e-5, "prediction": "sample"
    }
    with pytest.raises(ValueError, match="patch"):
        train.parse_overrides("patch=2")


def test_a_batch_of_clips_renders_as_each_timeline_alone():
    """render_clips draws a batch at once (scenes looked up per segment): each clip's frames must be its
    timeline's, across a prompt switch and for a long clip's late chunks."""
    rng = np.random.default_rng(4)
    clips = [sample_clip(rng, p_switch=1.0, p_long=p) for p in (0.0, 1.0, 0.0, 1.0)]
    assert any(c.long for c in clips) and all(len(c.timeline.segments) > 1 for c in clips)
    batch = train_clips.render_clips(clips, 3, 4, "cpu")  # [B, F, 4, H, W, 3]
    for clip, frames in zip(clips, batch):
        alone = clip.timeline.render(video_frames(train_clips.clip_latent_frames(clip, 3)))
        assert torch.equal(frames.flatten(0, 1), alone)


def test_a_stage_of_zero_steps_is_skipped(tmp_path):
    trainer = Trainer(replace(TrainConfig.smoke(), rollout_steps=0), tmp_path, torch.device("cpu"))
    assert trainer.run(minutes=5, save_minutes=60)
    stages = [json.loads(line)["stage"] for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert "teacher" in stages and "rollout" not in stages and trainer.stage == "done"


def test_the_follow_stage_starts_from_a_model_file_and_trains_the_dit(tmp_path):
    smoke = Trainer(TrainConfig.smoke(), out=tmp_path, device=torch.device("cpu"))
    assert smoke.run(minutes=5, save_minutes=60)
    smoke.export(tmp_path / "m.safetensors")
    trainer = Trainer(TrainConfig.smoke(), out=tmp_path, device=torch.device("cpu"))
    trainer.init_from(tmp_path / "m.safetensors")
    assert (trainer.stage, trainer.step) == ("follow", 0)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    assert all(torch.equal(before[k], v) for k, v in smoke.model.state_dict().items())
    loss = trainer.follow_step()
    assert math.isfinite(loss) and loss > 0
    assert any(not torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
    assert len(trainer._pool[3].pairs) == len(trainer._pool[3].clips) == 3  # follow_pool of each, rendered once


def test_set_overrides_take_the_fields_type_and_refuse_an_unknown_field():
    from models.train import with_overrides

    errors = []
    cfg = with_overrides(TrainConfig(), ["teacher_steps=7", "follow_share=0.125", "chunk_sizes=1"], errors.append)
    assert (cfg.teacher_steps, cfg.follow_share, cfg.chunk_sizes) == (7, 0.125, "1") and not errors
    def refuse(message):  # as argparse's error does: it does not return
        raise SystemExit(message)

    with pytest.raises(SystemExit, match="no field 'nosuch'; fields: preset, .*teacher_steps"):
        with_overrides(TrainConfig(), ["nosuch=1"], refuse)
