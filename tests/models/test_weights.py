"""Checkpoints: Self-Forcing / LongLive wrappers, LoRA merges, inferred dims, Wan folders (CPU, tiny)."""

import json

import pytest
import torch

from models import CausalWanModel, CheckpointError, ModelConfig, build_generator, load_checkpoint, save_checkpoint
from models.weights import (
    WanConfig, dit_configs, diffusers_to_wan, infer_config, load_state_dict, load_wan_dir_dit, merge_lora,
    read_state_dict, read_wan_config,
)


def tiny_model(seed: int) -> CausalWanModel:
    return CausalWanModel(ModelConfig.from_name("tiny")).init_weights(seed)


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_round_trip(tmp_path, suffix):
    src, dst = tiny_model(1), tiny_model(2)
    path = tmp_path / f"dit{suffix}"
    save_checkpoint(src, path)
    load_checkpoint(dst, path)
    for (name, a), b in zip(src.state_dict().items(), dst.state_dict().values()):
        assert torch.equal(a, b), name


def test_self_forcing_wrappers_and_prefix(tmp_path):
    src = tiny_model(3)
    wrapped = {"generator_ema": {f"model.{k}": v for k, v in src.state_dict().items()}, "step": torch.tensor(5)}
    torch.save(wrapped, tmp_path / "sf.pt")
    dst = load_checkpoint(tiny_model(4), tmp_path / "sf.pt")
    assert torch.equal(dst.head.head.weight, src.head.head.weight)
    plain = {"generator": {f"model.{k}": v for k, v in src.state_dict().items()}}
    torch.save(plain, tmp_path / "g.pt")
    assert set(read_state_dict(tmp_path / "g.pt")) == set(src.state_dict())


def test_wan_module_names():
    keys = set(tiny_model(0).state_dict())
    for k in [
        "patch_embedding.weight", "text_embedding.0.weight", "text_embedding.2.weight", "time_embedding.0.weight",
        "time_embedding.2.weight", "time_projection.1.weight", "blocks.0.self_attn.q.weight",
        "blocks.0.self_attn.norm_q.weight", "blocks.1.cross_attn.norm_k.weight", "blocks.0.norm3.weight",
        "blocks.0.ffn.0.weight", "blocks.0.ffn.2.bias", "blocks.0.modulation", "head.head.weight", "head.modulation",
    ]:
        assert k in keys, k


def test_clear_errors_name_the_keys(tmp_path):
    sd = dict(tiny_model(0).state_dict())
    del sd["blocks.1.ffn.0.weight"]
    sd["img_emb.proj.0.weight"] = torch.zeros(3)
    sd["head.head.weight"] = torch.zeros(7, 7)
    torch.save(sd, tmp_path / "bad.pt")
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tiny_model(0), tmp_path / "bad.pt")
    msg = str(e.value)
    assert "1 missing key(s): blocks.1.ffn.0.weight" in msg
    assert "1 unexpected key(s): img_emb.proj.0.weight" in msg
    assert "head.head.weight: checkpoint (7, 7) vs model (256, 64)" in msg
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tiny_model(0), tmp_path / "nope.safetensors")
    (tmp_path / "w.ckpt").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="expected .safetensors or .pt"):
        load_checkpoint(tiny_model(0), tmp_path / "w.ckpt")


# ---- Self-Forcing / LongLive wrappers, LoRA, inferred dims, Wan folders ----

LINEARS = ["self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o",
           "cross_attn.q", "cross_attn.k", "cross_attn.v", "cross_attn.o", "ffn.0", "ffn.2"]


def prefixed(model, prefix="model."):
    return {f"{prefix}{k}": v.clone() for k, v in model.state_dict().items()}


def assert_same(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert set(sa) == set(sb)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def self_forcing_file(tmp_path):
    gen, ema = tiny_model(5), tiny_model(6)
    ckpt = {"generator": prefixed(gen), "generator_ema": prefixed(ema), "critic": prefixed(tiny_model(9)),
            "step": 600}
    torch.save(ckpt, tmp_path / "self_forcing_dmd.pt")
    return tmp_path / "self_forcing_dmd.pt", gen, ema


def test_wrapper_choice_ema_by_default_generator_when_asked(tmp_path):
    path, gen, ema = self_forcing_file(tmp_path)
    assert_same(load_checkpoint(tiny_model(0), path), ema)
    assert_same(load_checkpoint(tiny_model(0), path, wrapper="generator_ema"), ema)
    assert_same(load_checkpoint(tiny_model(0), path, wrapper="generator"), gen)
    g = build_generator("tiny", checkpoint=str(path), wrapper="generator")
    assert torch.equal(g.model.head.head.weight, gen.head.head.weight)
    g = build_generator("tiny", checkpoint=str(path))
    assert torch.equal(g.model.head.head.weight, ema.head.head.weight)
    # LongLive's base: only `generator`, which auto falls back to
    torch.save({"generator": prefixed(gen), "step": 1}, tmp_path / "longlive_base.pt")
    assert_same(load_checkpoint(tiny_model(0), tmp_path / "longlive_base.pt"), gen)


def test_missing_wrapper_names_the_top_level_keys(tmp_path):
    torch.save({"generator_ema": prefixed(tiny_model(1)), "critic": {}, "step": 3}, tmp_path / "sf.pt")
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tiny_model(0), tmp_path / "sf.pt", wrapper="generator")
    assert "no 'generator' state dict; its top-level keys are: critic, generator_ema, step" in str(e.value)
    save_checkpoint(tiny_model(1), tmp_path / "bare.safetensors")
    with pytest.raises(CheckpointError, match="no 'generator_ema' state dict"):
        load_checkpoint(tiny_model(0), tmp_path / "bare.safetensors", wrapper="generator_ema")
    with pytest.raises(CheckpointError, match="wrapper must be one of auto, generator, generator_ema"):
        load_checkpoint(tiny_model(0), tmp_path / "sf.pt", wrapper="ema")


def make_lora(model, rank, seed=0):
    """{module: (A [r, in], B [out, r])} over every Linear of every block, as LongLive trains it."""
    g = torch.Generator().manual_seed(seed)
    pairs = {}
    for i in range(len(model.blocks)):
        for name in LINEARS:
            w = model.get_submodule(f"blocks.{i}.{name}").weight
            pairs[f"blocks.{i}.{name}"] = (torch.randn(rank, w.shape[1], generator=g), torch.randn(w.shape[0], rank, generator=g))
    return pairs


def save_longlive_lora(path, pairs):
    """PEFT spellings: `base_model.model.` with an adapter name on even blocks, `model.` without on odd ones."""
    lora = {}
    for module, (a, b) in pairs.items():
        if int(module.split(".")[1]) % 2 == 0:
            lora[f"base_model.model.{module}.lora_A.default.weight"] = a
            lora[f"base_model.model.{module}.lora_B.default.weight"] = b
        else:
            lora[f"model.{module}.lora_A.weight"] = a
            lora[f"model.{module}.lora_B.weight"] = b
    critic = {"base_model.model.blocks.0.self_attn.q.lora_A.weight": torch.zeros(2, 2)}
    torch.save({"generator_lora": lora, "critic_lora": critic, "step": 1200}, path)


@pytest.mark.parametrize("alpha", [None, 8.0])
def test_lora_merges_exactly_as_by_hand(tmp_path, alpha):
    base = tiny_model(7)
    pairs = make_lora(base, rank=4)
    save_longlive_lora(tmp_path / "lora.pt", pairs)
    scale = 1.0 if alpha is None else alpha / 4
    expected = {m: base.get_submodule(m).weight.detach().float() + scale * (b @ a) for m, (a, b) in pairs.items()}
    model = tiny_model(7)
    assert merge_lora(model, tmp_path / "lora.pt", alpha=alpha) == 2 * len(LINEARS)
    for m, w in expected.items():
        assert torch.equal(model.get_submodule(m).weight, w), m
    for k, v in base.state_dict().items():  # nothing else moved
        if not any(k == f"{m}.weight" for m in pairs):
            assert torch.equal(model.state_dict()[k], v), k
    sd = {k: v.clone() for k, v in base.state_dict().items()}  # a state dict merges the same
    assert merge_lora(sd, tmp_path / "lora.pt", alpha=alpha) == 2 * len(LINEARS)
    for m, w in expected.items():
        assert torch.equal(sd[f"{m}.weight"], w), m


def test_build_generator_merges_the_lora(tmp_path):
    base = tiny_model(7)
    torch.save({"generator": prefixed(base)}, tmp_path / "longlive_base.pt")
    pairs = make_lora(base, rank=2)
    save_longlive_lora(tmp_path / "lora.pt", pairs)
    g = build_generator("tiny", checkpoint=str(tmp_path / "longlive_base.pt"), lora=str(tmp_path / "lora.pt"),
                        wrapper="generator")
    a, b = pairs["blocks.1.ffn.2"]
    assert torch.equal(g.model.blocks[1].ffn[2].weight, base.blocks[1].ffn[2].weight.detach() + b @ a)
    with pytest.raises(ValueError, match="lora needs a checkpoint"):
        build_generator("tiny", lora=str(tmp_path / "lora.pt"))


def test_lora_errors_name_the_key(tmp_path):
    base = tiny_model(7)
    pairs = make_lora(base, rank=2)
    pairs["blocks.5.self_attn.q"] = pairs["blocks.0.self_attn.q"]  # no block 5
    save_longlive_lora(tmp_path / "extra.pt", pairs)
    with pytest.raises(CheckpointError, match=r"1 pair\(s\) match no Linear of the model: blocks\.5\.self_attn\.q"):
        merge_lora(tiny_model(7), tmp_path / "extra.pt")
    a = torch.zeros(2, 64)
    torch.save({"blocks.0.norm3.lora_A.weight": a, "blocks.0.norm3.lora_B.weight": torch.zeros(64, 2)}, tmp_path / "norm.pt")
    with pytest.raises(CheckpointError, match="match no Linear of the model: blocks.0.norm3"):
        merge_lora(tiny_model(7), tmp_path / "norm.pt")
    torch.save({"base_model.model.blocks.0.ffn.0.lora_A.weight": a}, tmp_path / "half.pt")
    with pytest.raises(CheckpointError, match="blocks.0.ffn.0 has no lora_B weight"):
        merge_lora(tiny_model(7), tmp_path / "half.pt")
    torch.save({"blocks.0.ffn.0.lora_A.weight": a, "blocks.0.ffn.0.lora_B.weight": torch.zeros(64, 2)}, tmp_path / "shape.pt")
    with pytest.raises(CheckpointError, match=r"blocks.0.ffn.0 gives B @ A \(64, 64\) for a weight \(128, 64\)"):
        merge_lora(tiny_model(7), tmp_path / "shape.pt")
    torch.save({"blocks.0.ffn.0.weight": a}, tmp_path / "notlora.pt")
    with pytest.raises(CheckpointError, match="'blocks.0.ffn.0.weight' is not a lora_A / lora_B weight"):
        merge_lora(tiny_model(7), tmp_path / "notlora.pt")


def test_inferred_dims_win_over_the_preset(tmp_path):
    tiny = ModelConfig.from_name("tiny")
    small = ModelConfig.from_name("tiny", dim=32, num_heads=1, ffn_dim=96, num_layers=1, text_dim=24, freq_dim=16)
    src = CausalWanModel(small).init_weights(3)
    cfg = infer_config(tiny, src.state_dict())
    assert (cfg.dim, cfg.num_heads, cfg.ffn_dim, cfg.num_layers, cfg.text_dim, cfg.freq_dim) == (32, 1, 96, 1, 24, 16)
    assert (cfg.latent_height, cfg.text_len, cfg.patch, cfg.in_channels, cfg.out_channels) == (16, 16, (1, 4, 4), 16, 16)
    assert infer_config(tiny, tiny_model(0).state_dict()) == tiny  # the preset's own shapes: nothing changes
    wider = CausalWanModel(ModelConfig.from_name("tiny", dim=128, num_heads=4)).state_dict()
    assert infer_config(tiny, wider).num_heads == 4  # dim changed, no config: the preset's head_dim (32) kept
    stated = WanConfig(tmp_path / "config.json", num_heads=8, text_len=24, eps=1e-5)
    assert (infer_config(tiny, wider, [stated]).num_heads, infer_config(tiny, wider, [stated]).text_len) == (8, 24)
    assert infer_config(tiny, wider, [stated]).eps == 1e-5
    save_checkpoint(src, tmp_path / "small.safetensors")
    g = build_generator("tiny", checkpoint=str(tmp_path / "small.safetensors"))
    assert g.model_cfg.dim == 32 and g.model_cfg.text_dim == 24 and len(g.model.blocks) == 1
    assert_same(g.model, src)
    chunk = next(g.stream(g.open_stream("s", "a small model", seed=1)))
    assert chunk.latents.shape[0] == 16 and torch.isfinite(chunk.latents).all()
    with pytest.raises(CheckpointError, match="checkpoint has no 'patch_embedding.weight'"):
        infer_config(tiny, {"blocks.0.ffn.0.weight": torch.zeros(4, 4)})



def test_heads_no_config_can_tell_are_an_error_that_asks_for_one(tmp_path):
    """dim 48 is no multiple of the tiny preset's 32-wide heads: the error asks for a config.json and shows
    a line of one, which, put in a Wan folder, makes the same weights load."""
    tiny = ModelConfig.from_name("tiny")
    src = CausalWanModel(ModelConfig.from_name("tiny", dim=48, num_heads=4, ffn_dim=96)).init_weights(2)
    with pytest.raises(CheckpointError) as e:
        infer_config(tiny, src.state_dict())
    msg = str(e.value)
    assert "cannot tell the DiT's attention heads: its dim 48 is not a multiple of the 'tiny' preset's head width 32" in msg
    assert "Add the model's config.json to the Wan folder given with --wan-dir" in msg and "pass num_heads" not in msg
    example = json.loads(msg.splitlines()[-1])
    assert example == {"_class_name": "WanModel", "model_type": "t2v", "dim": 48, "ffn_dim": 96, "num_heads": 2,
                       "num_layers": 2, "in_dim": 16, "out_dim": 16, "freq_dim": 32, "text_len": 16}
    torch.save({"generator_ema": prefixed(src)}, tmp_path / "sf.pt")
    with pytest.raises(CheckpointError, match="cannot tell the DiT's attention heads"):
        build_generator("tiny", checkpoint=str(tmp_path / "sf.pt"))
    assert infer_config(tiny, src.state_dict(), [WanConfig(tmp_path / "config.json", **example_fields(example, 4))]).num_heads == 4
    wan = tmp_path / "Wan2.1-T2V-small"
    wan.mkdir()
    save_checkpoint(src, wan / "diffusion_pytorch_model.safetensors")
    (wan / "config.json").write_text(json.dumps({**example, "num_heads": 4}))
    g = build_generator("tiny", checkpoint=str(wan))
    assert (g.model_cfg.dim, g.model_cfg.num_heads, g.model_cfg.head_dim) == (48, 4, 12)
    assert_same(g.model, src)


def example_fields(example: dict, heads: int) -> dict:
    return {k: v for k, v in {**example, "num_heads": heads}.items() if not k.startswith("_") and k != "model_type"}


def shapes_with(checkpoint, wan=None) -> ModelConfig:
    """The tiny preset as build_generator shapes it for `checkpoint` loaded with the Wan folder `wan`
    (without loading the folder's umT5, which these tests do not write)."""
    return infer_config(ModelConfig.from_name("tiny"), read_state_dict(checkpoint), dit_configs(checkpoint, wan))


def wan_config(cfg: ModelConfig, **override) -> dict:
    """config.json as Wan2.1 ships it (WanModel's fields: no text_dim, no patch_size)."""
    return {"_class_name": "WanModel", "_diffusers_version": "0.30.0", "model_type": "t2v", "dim": cfg.dim,
            "eps": cfg.eps, "ffn_dim": cfg.ffn_dim, "freq_dim": cfg.freq_dim, "in_dim": cfg.in_channels,
            "num_heads": cfg.num_heads, "num_layers": cfg.num_layers, "out_dim": cfg.out_channels,
            "text_len": cfg.text_len, **override}


def wan_dir(tmp_path, model, heads, shards=1, **override):
    """Wan's original layout: config.json + diffusion_pytorch_model*.safetensors at the folder root."""
    from safetensors.torch import save_file

    d = tmp_path / "Wan2.1-T2V-1.3B"
    d.mkdir()
    (d / "models_t5_umt5-xxl-enc-bf16.pth").write_bytes(b"")
    (d / "config.json").write_text(json.dumps(wan_config(model.cfg, num_heads=heads, **override)))
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    keys = sorted(sd)
    if shards == 1:
        save_file(sd, str(d / "diffusion_pytorch_model.safetensors"))
        return d
    weight_map = {}
    for i in range(shards):
        name = f"diffusion_pytorch_model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = keys[i::shards]
        save_file({k: sd[k] for k in part}, str(d / name))
        weight_map.update({k: name for k in part})
    (d / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return d


@pytest.mark.parametrize("shards", [1, 3])
def test_wan_dir_original_layout_loads_strictly(tmp_path, shards):
    src = tiny_model(11)
    d = wan_dir(tmp_path, src, heads=2, shards=shards)
    assert_same(load_state_dict(tiny_model(0), load_wan_dir_dit(d)), src)
    assert_same(load_checkpoint(tiny_model(0), d), src)
    assert_same(build_generator("tiny", checkpoint=str(d)).model, src)
    with pytest.raises(CheckpointError, match="applies to .pt files only"):
        load_checkpoint(tiny_model(0), d, wrapper="generator")


def test_wan_dir_heads_from_config_and_errors(tmp_path):
    d = wan_dir(tmp_path, tiny_model(11), heads=4)  # config.json's heads win: head_dim 16
    g = build_generator("tiny", checkpoint=str(d))
    assert (g.model_cfg.num_heads, g.model_cfg.head_dim) == (4, 16)
    (d / "diffusion_pytorch_model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="holds no DiT: .* found: config.json, models_t5_umt5-xxl-enc-bf16.pth"):
        load_wan_dir_dit(d)


def test_wan_dir_sharded_index_naming_an_absent_shard(tmp_path):
    d = wan_dir(tmp_path, tiny_model(11), heads=2, shards=2)
    (d / "diffusion_pytorch_model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="names shard\\(s\\) that are not in .*: diffusion_pytorch_model-00002-of-00002"):
        load_wan_dir_dit(d)


def test_wan_dir_sharded_index_that_disagrees_with_its_shards(tmp_path):
    d = wan_dir(tmp_path, tiny_model(11), heads=2, shards=3)
    index = d / "diffusion_pytorch_model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    index.write_text(json.dumps({"weight_map": {**weight_map, "head.head.weight": "diffusion_pytorch_model-00001-of-00003.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"-00002-of-00003.safetensors holds key\(s\) that .* maps elsewhere or not at all: head.head.weight"):
        load_wan_dir_dit(d)
    index.write_text(json.dumps({**weight_map, "blocks.9.ffn.0.weight": "x"}))  # no "weight_map"
    with pytest.raises(CheckpointError, match="is not a shard index"):
        load_wan_dir_dit(d)
    index.write_text(json.dumps({"weight_map": {**weight_map, "blocks.9.ffn.0.weight": weight_map["head.head.weight"]}}))
    with pytest.raises(CheckpointError, match="maps key\\(s\\) that no shard holds: blocks.9.ffn.0.weight"):
        load_wan_dir_dit(d)


def test_a_sharded_fp32_folder_is_read_in_the_models_dtype(tmp_path):
    src = tiny_model(11)
    d = wan_dir(tmp_path, src, heads=2, shards=3)
    sd = read_state_dict(d, dtype=torch.bfloat16)
    assert {v.dtype for v in sd.values()} == {torch.bfloat16}
    assert torch.equal(sd["head.head.weight"], src.head.head.weight.detach().bfloat16())
    assert {v.dtype for v in read_state_dict(d, dtype=torch.float64).values()} == {torch.float32}  # never widened


# ---- config.json: the DiT's shape, checked against the tensors ----


def test_config_json_gives_the_heads_for_a_checkpoint_file_loaded_with_the_folder(tmp_path):
    """Self-Forcing's .pt beside a Wan folder whose config.json says 4 heads: 4 heads of 16, the config's
    text_len; without the folder, the preset's 2 heads (the same tensors fit both)."""
    src = tiny_model(11)
    d = wan_dir(tmp_path, src, heads=4, text_len=24)
    torch.save({"generator_ema": prefixed(src)}, tmp_path / "self_forcing_dmd.pt")
    mc = shapes_with(tmp_path / "self_forcing_dmd.pt", d)
    assert (mc.num_heads, mc.head_dim, mc.text_len) == (4, 16, 24)
    mc = shapes_with(tmp_path / "self_forcing_dmd.pt")
    assert (mc.num_heads, mc.text_len) == (2, 16)
    g = build_generator("tiny", checkpoint=str(d))  # the folder's own DiT: its config too
    assert (g.model_cfg.num_heads, g.model_cfg.text_len) == (4, 24)
    assert_same(g.model, src)


@pytest.mark.parametrize("field, value, says", [
    ("dim", 96, "dim 96 but the checkpoint's patch_embedding.weight is (64, 16, 1, 4, 4)"),
    ("ffn_dim", 8960, "ffn_dim 8960 but the checkpoint's blocks.0.ffn.0.weight is (128, 64)"),
    ("num_layers", 30, "num_layers 30 but the checkpoint's blocks run from blocks.0 to blocks.1"),
    ("in_dim", 36, "in_dim 36 but the checkpoint's patch_embedding.weight is (64, 16, 1, 4, 4)"),
    ("out_dim", 4, "out_dim 4 but the checkpoint's head.head.weight is (256, 64) (patch (1, 4, 4))"),
    ("freq_dim", 256, "freq_dim 256 but the checkpoint's time_embedding.0.weight is (64, 32)"),
    ("text_dim", 4096, "text_dim 4096 but the checkpoint's text_embedding.0.weight is (64, 32)"),
    ("patch_size", [1, 2, 2], "patch_size (1, 2, 2) but the checkpoint's patch_embedding.weight is (64, 16, 1, 4, 4)"),
])
def test_a_config_that_disagrees_with_the_tensors_names_the_field(tmp_path, field, value, says):
    src = tiny_model(11)
    d = wan_dir(tmp_path, src, heads=2, **{field: value})
    torch.save({"generator_ema": prefixed(src)}, tmp_path / "self_forcing_dmd.pt")
    for load in (lambda: build_generator("tiny", checkpoint=str(d)), lambda: shapes_with(tmp_path / "self_forcing_dmd.pt", d)):
        with pytest.raises(CheckpointError) as e:
            load()
        assert f"{d / 'config.json'} says {says}" in str(e.value)
        assert "describes another model than the checkpoint" in str(e.value)


def test_config_json_heads_that_cannot_split_dim(tmp_path):
    d = wan_dir(tmp_path, tiny_model(11), heads=3)
    with pytest.raises(CheckpointError, match="says num_heads 3, which does not split the checkpoint's dim 64"):
        build_generator("tiny", checkpoint=str(d))


def test_the_checkpoint_folders_config_and_wan_dirs_are_both_checked(tmp_path):
    src = tiny_model(11)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    own, other = wan_dir(tmp_path / "a", src, heads=2), wan_dir(tmp_path / "b", src, heads=4)
    with pytest.raises(CheckpointError, match=r"the configs disagree on num_heads: .*a/.* says 2, .*b/.* says 4"):
        shapes_with(own, other)
    assert dit_configs(own, own) == [read_wan_config(own)]  # one folder, one config
    big = CausalWanModel(ModelConfig.from_name("tiny", dim=128, num_heads=4)).init_weights(1)
    (tmp_path / "c").mkdir()
    wrong = wan_dir(tmp_path / "c", big, heads=4)
    with pytest.raises(CheckpointError, match="c/.*config.json says dim 128 but the checkpoint's patch_embedding.weight is \\(64,"):
        shapes_with(own, wrong)


def test_read_wan_config_takes_wan_and_diffusers_names(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(wan_config(ModelConfig.from_name("wan2.1-14b"))))
    c = read_wan_config(tmp_path)
    assert (c.dim, c.ffn_dim, c.num_heads, c.num_layers, c.in_dim, c.out_dim, c.text_len, c.freq_dim, c.eps) == (
        5120, 13824, 40, 40, 16, 16, 512, 256, 1e-6)
    assert c.text_dim is None and c.patch_size is None and c.path == tmp_path / "config.json"
    d = tmp_path / "diffusers"
    (d / "transformer").mkdir(parents=True)
    (d / "transformer" / "config.json").write_text(json.dumps({
        "_class_name": "WanTransformer3DModel", "_diffusers_version": "0.33.0", "added_kv_proj_dim": None,
        "attention_head_dim": 128, "cross_attn_norm": True, "eps": 1e-06, "ffn_dim": 8960, "freq_dim": 256,
        "image_dim": None, "in_channels": 16, "num_attention_heads": 12, "num_layers": 30, "out_channels": 16,
        "patch_size": [1, 2, 2], "qk_norm": "rms_norm_across_heads", "rope_max_seq_len": 1024, "text_dim": 4096}))
    c = read_wan_config(d)
    assert (c.dim, c.num_heads, c.ffn_dim, c.num_layers, c.in_dim, c.out_dim, c.text_dim, c.patch_size, c.text_len) == (
        1536, 12, 8960, 30, 16, 16, 4096, (1, 2, 2), None)
    (tmp_path / "nothing.pt").write_bytes(b"")
    assert read_wan_config(tmp_path / "nothing.pt") is None  # a state-dict file says nothing
    (tmp_path / "empty").mkdir()
    assert read_wan_config(tmp_path / "empty") is None
    with pytest.raises(CheckpointError, match="does not exist"):
        read_wan_config(tmp_path / "nowhere")


@pytest.mark.parametrize("config, error", [
    ({"_class_name": "AutoencoderKLWan", "dim": 96}, "is the config of a AutoencoderKLWan, not of a Wan DiT"),
    ({"_class_name": "WanModel", "model_type": "i2v", "dim": 5120}, "describes a Wan 'i2v' model: only text-to-video"),
    ({"dim": "5120"}, "dim '5120' is not a positive int"),
    ({"num_heads": 0}, "num_heads 0 is not a positive int"),
    ({"eps": -1}, "eps -1 is not a positive number"),
    ({"patch_size": [1, 2]}, r"patch_size \[1, 2\] is not three positive ints"),
    ([1, 2], "holds a JSON list, not the DiT's config"),
])
def test_a_malformed_config_json_is_an_error(tmp_path, config, error):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=error):
        read_wan_config(tmp_path)
    (tmp_path / "config.json").write_text("{dim: 1")
    with pytest.raises(CheckpointError, match="is not readable JSON"):
        read_wan_config(tmp_path)


# diffusers' own rename table (scripts/convert_wan_to_diffusers.py), spelled independently of ours
DIFFUSERS_RENAMES = [
    ("time_embedding.0", "condition_embedder.time_embedder.linear_1"),
    ("time_embedding.2", "condition_embedder.time_embedder.linear_2"),
    ("text_embedding.0", "condition_embedder.text_embedder.linear_1"),
    ("text_embedding.2", "condition_embedder.text_embedder.linear_2"),
    ("time_projection.1", "condition_embedder.time_proj"),
    ("head.modulation", "scale_shift_table"), ("head.head", "proj_out"), ("modulation", "scale_shift_table"),
    ("ffn.0", "ffn.net.0.proj"), ("ffn.2", "ffn.net.2"),
    ("norm3", "norm2"),  # the T2V model has no norm2 weights
    ("self_attn", "attn1"), ("cross_attn", "attn2"),
    (".q.", ".to_q."), (".k.", ".to_k."), (".v.", ".to_v."), (".o.", ".to_out.0."),
]


def test_diffusers_transformer_folder_loads_strictly(tmp_path):
    diffusers = pytest.importorskip("diffusers")
    src = tiny_model(13)
    sd = {}
    for k, v in src.state_dict().items():
        for a, b in DIFFUSERS_RENAMES:
            k = k.replace(a, b)
        sd[k] = v
    cfg = src.cfg
    dm = diffusers.WanTransformer3DModel(
        patch_size=cfg.patch, num_attention_heads=cfg.num_heads, attention_head_dim=cfg.head_dim,
        in_channels=cfg.in_channels, out_channels=cfg.out_channels, text_dim=cfg.text_dim, freq_dim=cfg.freq_dim,
        ffn_dim=cfg.ffn_dim, num_layers=cfg.num_layers,
    )
    dm.load_state_dict(sd, strict=True)  # our test renames are diffusers' real module names
    d = tmp_path / "Wan2.1-T2V-1.3B-Diffusers"
    dm.save_pretrained(d / "transformer", max_shard_size="20KB")  # sharded, with an index json
    assert (d / "transformer" / "diffusion_pytorch_model.safetensors.index.json").is_file()
    assert_same(load_state_dict(tiny_model(0), load_wan_dir_dit(d)), src)
    assert_same(load_state_dict(tiny_model(0), load_wan_dir_dit(d / "transformer")), src)
    g = build_generator("tiny", checkpoint=str(d))
    assert g.model_cfg.num_heads == cfg.num_heads
    assert_same(g.model, src)
    unknown = "condition_embedder.image_embedder.ff.net.0.proj.weight"  # I2V's image embedder
    with pytest.raises(CheckpointError, match=r"1 Diffusers transformer key\(s\) have no Wan2.1 T2V name: " + unknown):
        diffusers_to_wan({**sd, unknown: torch.zeros(1)})
