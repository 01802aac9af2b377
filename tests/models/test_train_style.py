"""Training a style LoRA for the built-in model (models/train_style.py): its forward is serving's under the exported
file, only the pairs train, a batch switches the style on where it says, and a smoke run resumes and exports a file
that `serve --lora-dir` loads."""

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from safetensors import safe_open

from models import GeneratorConfig, build_generator, train_style
from models.adapters import AdapterSet, AdapterUse
from models.dit import CacheAccess
from models.model_file import BUILTIN_WEIGHTS, read_model_file
from models.teacher_forcing import frame_text, teacher_forward
from models.train_clips import render_clips
from models.train_style import STYLES, StyleConfig, StyleTrainer, main

pytestmark = pytest.mark.skipif(not BUILTIN_WEIGHTS.is_file(), reason="the built-in model file is not in this checkout")
CPU = torch.device("cpu")


def trained_pairs(trainer: StyleTrainer, seed: int = 0) -> None:
    """Random B's (training starts them at zero: the style would change nothing)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, b in trainer.pairs.values():
            b.copy_(torch.randn(b.shape, generator=g) * 0.1)


@pytest.mark.parametrize("nf", [3, 1])
def test_the_style_trains_what_serving_runs_under_the_exported_file(tmp_path, nf):
    """A stream opened with the exported style, its first denoising step: the training forward under the trainer's
    pairs (the prompt's K/V under them too) predicts the flow serving does (fp32, 1e-4), and not the base model's."""
    trainer = StyleTrainer(StyleConfig.smoke(), tmp_path, CPU)
    trained_pairs(trainer)
    trainer.export(tmp_path / "invert.safetensors")
    gen = build_generator("tiny", dtype=torch.float32, weights="builtin", cfg=GeneratorConfig(frames_per_chunk=nf))
    gen.adapters.load("invert", tmp_path / "invert.safetensors")
    prompt = "a green square moving right"
    state = gen.open_stream("s", prompt, seed=3, lora="invert")
    x = torch.randn(gen.model_cfg.in_channels, nf, gen.model_cfg.latent_height, gen.model_cfg.latent_width,
                    generator=torch.Generator().set_state(state.noise.get_state()))
    gen.denoise([state])
    v_served = x - state.x0  # sigma 1 at the first step

    model, use = trainer.model, trainer.adapter()
    t = torch.full((1, nf), 1000.0)
    with torch.no_grad():
        v = teacher_forward(model, torch.zeros_like(x)[None], x[None], t,
                            frame_text(model, trainer.encoder, [[prompt] * 2 * nf], use), nf, lora=use)[0]
        plain = teacher_forward(model, torch.zeros_like(x)[None], x[None], t,
                                frame_text(model, trainer.encoder, [[prompt] * 2 * nf]), nf)[0]
    torch.testing.assert_close(v, v_served, rtol=0, atol=1e-4)
    assert (plain - v_served).abs().max() > 1e-2


@pytest.mark.parametrize("per_frame", [False, True])
def test_a_batch_sharing_one_style_equals_each_stream_with_its_own(per_frame):
    """Training hands every clip the same AdapterUse: one product over all rows (models/adapters.py LoraBatch); it
    equals the per-stream terms serving adds (fp32, 1e-5), with a prompt per clip or per frame (training's), and a
    stream without a style beside them keeps the base model's rows."""
    trainer = StyleTrainer(StyleConfig.smoke(), None, CPU)
    trained_pairs(trainer)
    clean, captions, _ = trainer.batch(3)
    nf = clean.shape[2]
    captions = [c[nf:] for c in captions] if per_frame else [[c[-1]] for c in captions]  # [noisy] frames', or one
    shared = trainer.adapter()
    own = [AdapterUse(shared.adapter, 1.0) for _ in captions]  # equal, not the same object
    model, t = trainer.model, torch.full(clean.shape[:1] + clean.shape[2:3], 600.0)
    with torch.no_grad():
        text = frame_text(model, trainer.encoder, captions, shared)
        one = model.predict_flow(clean, t, text, [CacheAccess(None, 0, lora=shared)] * len(own))
        each = model.predict_flow(clean, t, text, [CacheAccess(None, 0, lora=use) for use in own])
        mixed = model.predict_flow(clean, t, text, [CacheAccess(None, 0, lora=own[0]), CacheAccess(None, 0)])
        plain = model.predict_flow(clean[1:], t[1:], [(k[len(k) // 2:], v[len(v) // 2:]) for k, v in text], [CacheAccess(None, 0)])
    torch.testing.assert_close(one, each, rtol=0, atol=1e-5)
    torch.testing.assert_close(mixed[:1], one[:1], rtol=0, atol=1e-5)
    assert torch.equal(mixed[1:], plain)  # its text K/V were the style's; its forward the base model's


def test_only_the_pairs_train_and_the_gradient_reaches_each(tmp_path):
    trainer = StyleTrainer(StyleConfig.smoke(), tmp_path, CPU)
    base = read_model_file(BUILTIN_WEIGHTS).dit
    assert len(trainer.pairs) == 2 * 10  # q k v o of both attentions and the MLP's two, in each of the 2 blocks
    assert all((b == 0).all() for _, b in trainer.pairs.values())  # it starts as the base model
    for _ in range(2):
        assert np.isfinite(trainer.train_step())
    assert [n for n, (a, b) in trainer.pairs.items() if (b == 0).all()] == []
    assert all(torch.equal(p, base[n]) for n, p in trainer.model.state_dict().items())
    assert not any(p.requires_grad for p in trainer.model.parameters())


def test_a_batch_switches_the_style_on_at_a_chunk(monkeypatch):
    """With switch_share 1 every clip's chunks before its switch are plain and not counted, those from it styled."""
    seen = []
    real = train_style.text_clips
    monkeypatch.setattr(train_style, "text_clips", lambda *a: seen.append(real(*a)) or seen[-1])
    trainer = StyleTrainer(replace(StyleConfig.smoke(), batch=6, switch_share=1.0), None, CPU)
    clean, _, weight = trainer.batch(3)
    clips = seen[0]
    frames = render_clips(clips, 3, trainer.mc.temporal_upsample, CPU)
    plain, styled = trainer.pca.encode(frames), trainer.pca.encode(STYLES["invert"](frames))
    for i, clip in enumerate(clips):
        switched = [k for k in range(len(clip.chunks)) if not torch.equal(clean[i, :, 3 * k], plain[i, :, 3 * k])]
        assert switched and switched == list(range(switched[0], len(clip.chunks))) and switched[0] >= 1
        is_styled = torch.tensor([k >= switched[0] for k in range(len(clip.chunks)) for _ in range(3)])
        torch.testing.assert_close(clean[i][:, is_styled], styled[i][:, is_styled], rtol=0, atol=0)
        assert (weight[i][~is_styled] == 0).all() and weight[i][is_styled].sum() > 0


def test_the_style_and_the_config_are_checked():
    frames = torch.randint(0, 256, (2, 3, 4, 4, 3), dtype=torch.uint8)
    assert torch.equal(STYLES["invert"](frames).int(), 255 - frames.int())
    for bad in ({"style": "sepia"}, {"targets": "everything"}, {"rank": 0}, {"switch_share": 1.5}, {"chunk_sizes": "2"}):
        with pytest.raises(ValueError):
            StyleConfig(**bad)


def test_a_smoke_run_resumes_and_exports_a_file_that_serving_loads(tmp_path, capsys):
    out, path = tmp_path / "run", tmp_path / "invert.safetensors"
    args = ["--smoke", "--out", str(out), "--device", "cpu", "--save-minutes", "0"]
    assert main(args + ["--minutes", "0"]) == 0  # stops at once, with a checkpoint
    assert "run again to resume" in capsys.readouterr().out
    assert main(args + ["--export", str(path)]) == 0
    assert "done" in capsys.readouterr().out
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [(r["step"], r["chunk"]) for r in log] == [(1, 3), (2, 1)]  # both chunk sizes, in turn
    with safe_open(str(path), "pt") as f:
        keys, meta = set(f.keys()), f.metadata()
    assert keys and all(k.startswith("base_model.model.blocks.") and k.endswith((".lora_A.weight", ".lora_B.weight"))
                        for k in keys)
    assert json.loads(meta["lora_adapter_metadata"])["lora_alpha"] == 8.0 and meta["style"] == "invert"
    assert path.stat().st_size < 1e6
    gen = build_generator("tiny", dtype=torch.float32, weights="builtin")
    adapters = AdapterSet(gen.model)
    adapter = adapters.load("invert", path)
    assert adapter.rank == 8 and len(adapter.layers) == 20 and adapter.touches_text
    with pytest.raises(ValueError, match="was made with"):
        StyleTrainer(replace(StyleConfig.smoke(), rank=4), out, CPU).resume()
