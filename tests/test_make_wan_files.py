"""benchmarks/make_wan_files.py at --size tiny: every file it writes loads through the serving path
(Wan folder: umT5 + tokenizer, VAE, base DiT; Self-Forcing; LongLive base + LoRA; TAEHV) and a chunk
generates; at --size tiny-14b, Wan2.1-T2V-14B's layout (the DiT in 6 shards with an index json) loads
as the wan2.1-14b preset, through build_generator and benchmarks/generator.py. CPU only, nothing
downloaded."""

import json
import math
import shutil

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("diffusers")
pytest.importorskip("tokenizers")

from benchmarks.make_wan_files import (  # noqa: E402
    SIZES, WAN_14B_DIR, WAN_DIR, dit_shapes, main, shard_names, shard_plan, wan_config_json,
)
from models import CheckpointError, ModelConfig, build_generator  # noqa: E402
from models.umt5 import XXL  # noqa: E402
from models.weights import DIT_INDEX, read_lora, read_state_dict  # noqa: E402


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    out = tmp_path_factory.mktemp("wanfiles")
    assert main(["--out", str(out), "--size", "tiny", "--seed", "3", "--device", "cpu"]) == 0
    return out


def _weights(gen) -> dict[str, torch.Tensor]:
    return {k: v.float() for k, v in gen.model.state_dict().items()}


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k].float()) for k in b)


def test_manifest_lists_every_file(files, capsys):
    assert main(["--out", str(files / "again"), "--size", "tiny", "--seed", "3", "--device", "cpu"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    manifest = json.loads(line)["files"]
    for name in (f"{WAN_DIR}/models_t5_umt5-xxl-enc-bf16.pth", f"{WAN_DIR}/Wan2.1_VAE.pth", f"{WAN_DIR}/config.json",
                 f"{WAN_DIR}/diffusion_pytorch_model.safetensors", "self_forcing_dmd.pt", "longlive_base.pt",
                 "lora.pt", "taew2_1.pth"):
        assert manifest[name] == (files / "again" / name).stat().st_size > 0
    assert any(k.startswith(f"{WAN_DIR}/google/umt5-xxl/") for k in manifest)
    # the same seed writes the same tensors
    a = torch.load(files / "lora.pt", weights_only=True)["generator_lora"]
    b = torch.load(files / "again" / "lora.pt", weights_only=True)["generator_lora"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_self_forcing_and_the_wan_folder_load_and_generate(files):
    wan = files / WAN_DIR
    sd = torch.load(files / "self_forcing_dmd.pt", weights_only=True)
    assert sd["generator_ema"]["model.blocks.0.self_attn.q.weight"].dtype == torch.bfloat16
    ema = read_state_dict(files / "self_forcing_dmd.pt", "generator_ema")
    raw = read_state_dict(files / "self_forcing_dmd.pt", "generator")
    base = read_state_dict(wan)
    gen = build_generator("tiny", wan_dir=str(wan), checkpoint=str(files / "self_forcing_dmd.pt"))
    assert type(gen.text_encoder).__name__ == "UMT5TextEncoder" and type(gen.decoder).__name__ == "WanVAEDecoder"
    assert type(gen.encoder).__name__ == "WanVAEEncoder" and gen.encoder.vae is gen.decoder.vae  # one VAE, both ways
    assert gen.text_encoder.tokenizer.pad_token_id == 0 and gen.text_encoder.tokenizer.eos_token_id == 1
    w = _weights(gen)
    assert _same(w, ema) and not _same(w, raw) and not _same(w, base)  # generator_ema's, not the others'
    state = gen.open_stream("s", "a red fox running through snow", seed=0)
    chunk = next(gen.stream(state))
    assert chunk.frames.shape == (9, 128, 128, 3) and chunk.frames.dtype == torch.uint8
    assert torch.isfinite(chunk.latents).all()
    text = gen.text_encoder.encode(["a red fox running through snow"])
    assert torch.isfinite(text).all() and text[0, :7].abs().sum() > 0 and text[0, 7:].abs().sum() == 0  # 6 words + </s>
    # the folder's own DiT, without a checkpoint
    assert _same(_weights(build_generator("tiny", wan_dir=str(wan))), base)


def test_longlive_base_and_lora_load_with_taehv(files):
    base = read_state_dict(files / "longlive_base.pt", "generator")
    pairs = read_lora(files / "lora.pt")
    assert len(pairs) == 2 * 10 and all(a.shape[0] == 4 for a, _ in pairs.values())
    gen = build_generator("tiny", wan_dir=str(files / WAN_DIR), checkpoint=str(files / "longlive_base.pt"),
                          wrapper="generator", lora=str(files / "lora.pt"), decoder="taehv",
                          taehv=str(files / "taew2_1.pth"))
    assert type(gen.decoder).__name__ == "TAEHVDecoder" and type(gen.encoder).__name__ == "TAEHVEncoder"
    tae = torch.load(files / "taew2_1.pth", weights_only=True)  # TAEHV's layout: encoder.N.* and decoder.N.*
    assert {k.split(".")[0] for k in tae} == {"encoder", "decoder"} and tae["encoder.17.weight"].shape == (16, 8, 3, 3)
    w = _weights(gen)
    a, b = pairs["blocks.1.ffn.2"]
    merged = base["blocks.1.ffn.2.weight"].float() + b.float() @ a.float()  # merged in fp32 (the CPU model's dtype)
    torch.testing.assert_close(w["blocks.1.ffn.2.weight"], merged)
    assert not torch.equal(w["blocks.1.ffn.2.weight"], base["blocks.1.ffn.2.weight"].float())  # B is not zero
    assert torch.equal(w["head.head.weight"], base["head.head.weight"].float())
    chunk = next(gen.stream(gen.open_stream("s", "a blue boat at night", seed=1)))
    assert chunk.frames.shape == (9, 128, 128, 3)
    state = gen.open_stream("v2v", "a blue boat at night", seed=1)  # video-to-video through TAEHV's encoder
    gen.set_strength(state, 0.6)
    gen.set_input(state, chunk.frames)
    out = next(gen.stream(state))
    assert out.input == "frames" and out.start_step == 3 and out.frames.shape == (9, 128, 128, 3)


# ---- Wan2.1-T2V-14B's layout ----


@pytest.fixture(scope="module")
def files_14b(tmp_path_factory):
    out = tmp_path_factory.mktemp("wan14b")
    assert main(["--out", str(out), "--size", "tiny-14b", "--seed", "5", "--device", "cpu"]) == 0
    return out


def test_the_14b_layout_shards_the_dit_with_an_index(files_14b):
    from safetensors import safe_open

    wan = files_14b / WAN_14B_DIR
    names = shard_names(6)
    assert names[0] == "diffusion_pytorch_model-00001-of-00006.safetensors"
    assert sorted(p.name for p in wan.glob("diffusion_pytorch_model*")) == sorted([*names, DIT_INDEX])
    assert {p.name for p in files_14b.iterdir()} == {WAN_14B_DIR, "taew2_1.pth"}  # no 14B Self-Forcing / LongLive
    index = json.loads((wan / DIT_INDEX).read_text())
    shapes = dit_shapes(ModelConfig.from_name("tiny"))
    assert list(index["weight_map"]) == list(shapes)  # every key, in the model's order
    total = 0
    for name in names:
        with safe_open(str(wan / name), "pt") as f:
            keys = list(f.keys())
            assert keys and sorted(keys) == sorted(k for k, v in index["weight_map"].items() if v == name)
            for k in keys:
                t = f.get_tensor(k)
                assert tuple(t.shape) == shapes[k] and t.dtype == torch.bfloat16
                total += t.numel() * t.element_size()
    assert index["metadata"]["total_size"] == total
    assert json.loads((wan / "config.json").read_text()) == wan_config_json(ModelConfig.from_name("tiny"))


def test_the_14b_layout_loads_as_the_14b_preset_and_generates(files_14b):
    wan = files_14b / WAN_14B_DIR
    gen = build_generator("wan2.1-14b", wan_dir=str(wan), decoder="tiny")
    mc = gen.model_cfg
    assert type(gen.text_encoder).__name__ == "UMT5TextEncoder"
    assert (mc.name, mc.dim, mc.num_heads, mc.num_layers, mc.text_len) == ("wan2.1-14b", 64, 2, 2, 16)  # config.json's
    assert (mc.height, mc.width, mc.tokens_per_frame) == (480, 832, 390)  # the preset's resolution, the weights' patch
    assert _same(_weights(gen), read_state_dict(wan))
    w = gen.model.blocks[1].self_attn.q.weight  # Xavier-normal noise: sd sqrt(2 / (64 + 64))
    assert 0.1 < w.std().item() < 0.15 and gen.model.blocks[0].norm3.weight.eq(1).all()
    chunk = next(gen.stream(gen.open_stream("s", "a red fox running through snow", seed=0)))
    assert chunk.frames.shape == (9, 480, 832, 3) and torch.isfinite(chunk.latents).all()


def test_the_14b_layouts_config_is_checked_against_its_shards(files_14b, tmp_path):
    wan = tmp_path / WAN_14B_DIR
    shutil.copytree(files_14b / WAN_14B_DIR, wan)
    config = json.loads((wan / "config.json").read_text())
    (wan / "config.json").write_text(json.dumps({**config, "dim": 5120, "num_heads": 40, "num_layers": 40}))
    with pytest.raises(CheckpointError) as e:
        build_generator("wan2.1-14b", checkpoint=str(wan))
    assert str(e.value).startswith(f"{wan / 'config.json'} says dim 5120 but the checkpoint's patch_embedding.weight is "
                                   "(64, 16, 1, 4, 4); num_layers 40 but the checkpoint's blocks run from blocks.0 to blocks.1")
    (wan / "config.json").write_text(json.dumps(config))
    (wan / shard_names(6)[3]).unlink()
    with pytest.raises(CheckpointError, match="names shard\\(s\\) that are not in .*-00004-of-00006.safetensors"):
        build_generator("wan2.1-14b", checkpoint=str(wan))


def test_the_full_size_14b_plan():
    """--size 14b (not written here: 40 GB): Wan2.1-T2V-14B's shapes in 6 shards of about 4.8 GB (bf16)."""
    spec = SIZES["14b"]
    assert (spec["preset"], spec["shards"], spec["umt5"], spec["vae_base_dim"]) == ("wan2.1-14b", 6, dict(XXL), 96)
    mc = ModelConfig.from_name("wan2.1-14b")
    assert (mc.dim, mc.ffn_dim, mc.num_heads, mc.head_dim, mc.num_layers, mc.text_dim, mc.height, mc.width) == (
        5120, 13824, 40, 128, 40, 4096, 480, 832)
    shapes = dit_shapes(mc)
    assert sum(math.prod(s) for s in shapes.values()) == 14_288_491_584
    plan = shard_plan(shapes, 2, 6)
    per_shard = {n: sum(math.prod(shapes[k]) * 2 for k, f in plan.items() if f == n) for n in shard_names(6)}
    assert all(4.6e9 < b < 4.9e9 for b in per_shard.values()), per_shard
    order = [plan[k] for k in shapes]
    assert order == sorted(order)  # whole tensors in key order
    assert json.loads(json.dumps(wan_config_json(mc))) == {
        "_class_name": "WanModel", "_diffusers_version": "0.30.0", "model_type": "t2v", "dim": 5120, "eps": 1e-06,
        "ffn_dim": 13824, "freq_dim": 256, "in_dim": 16, "num_heads": 40, "num_layers": 40, "out_dim": 16, "text_len": 512}
    assert mc.cache_spec(sink_frames=3, window_frames=9, dtype="bfloat16").stream_bytes() == 2 * 40 * 1560 * 5120 * 2 * 12


def test_the_generator_benchmark_takes_the_14b_preset_and_every_tier(files_14b, capsys):
    from benchmarks.generator import main as bench

    args = ["--preset", "wan2.1-14b", "--device", "cpu", "--wan-dir", str(files_14b / WAN_14B_DIR), "--decoder", "tiny",
            "--only-chunk", "--iters", "1", "--sink-frames", "0", "--window-frames", "3"]
    assert bench(args + ["--fidelity", "approximate,exact"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["preset"] == "wan2.1-14b" and result["model"]["tokens_per_frame"] == 390
    assert result["load"]["load_s"] >= 0 and result["load"]["host_peak_rss_gib"] > 0
    assert [r["fidelity"] for r in result["runs"]] == ["exact", "approximate"]  # in tier order, one load
    exact, approximate = (r["chunk"] for r in result["runs"])
    assert (exact["steps"], approximate["steps"]) == (4, 3) and exact["denoise_step_ms"] > 0
    assert approximate["commit_ms"] < 1 < exact["commit_ms"]  # commit-reuse: no commit forward
    with pytest.raises(SystemExit):
        bench(args + ["--fidelity", "exact,fastest"])
    assert "fidelity 'fastest' is unknown" in capsys.readouterr().err
