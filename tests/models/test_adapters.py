"""Styles: LoRA adapters applied per stream in the batched forward, base weights shared (CPU, fp32, tiny preset).

Each test writes its own LoRA files (random pairs over every Linear of the tiny DiT) in the layouts served:
PEFT / LongLive, diffusers, ComfyUI's original Wan names, kohya (musubi-tuner). The reference for a stream
with a style is a generator with that LoRA merged into its weights (`merge_lora`, today's `--lora`).
"""

import json
import re

import pytest
import torch
from safetensors.torch import save_file

from kvcache import StreamCache
from models import CacheAccess, WorkKind
from models.adapters import AdapterError
from models.weights import merge_lora
from tests.conftest import tiny_generator

CFG = {"sink_frames": 3, "window_frames": 6}  # 4 chunks (12 frames) roll the window
TO_DIFFUSERS_BLOCK = {"self_attn.q": "attn1.to_q", "self_attn.k": "attn1.to_k", "self_attn.v": "attn1.to_v",
                      "self_attn.o": "attn1.to_out.0", "cross_attn.q": "attn2.to_q", "cross_attn.k": "attn2.to_k",
                      "cross_attn.v": "attn2.to_v", "cross_attn.o": "attn2.to_out.0", "ffn.0": "ffn.net.0.proj",
                      "ffn.2": "ffn.net.2"}
TO_DIFFUSERS_TOP = {"time_embedding.0": "condition_embedder.time_embedder.linear_1",
                    "time_embedding.2": "condition_embedder.time_embedder.linear_2",
                    "time_projection.1": "condition_embedder.time_proj",
                    "text_embedding.0": "condition_embedder.text_embedder.linear_1",
                    "text_embedding.2": "condition_embedder.text_embedder.linear_2", "head.head": "proj_out"}


def make_pairs(model, rank, seed, skip=()):
    """{module: (A [r, in], B [out, r])} over every Linear of the model but `skip`."""
    g = torch.Generator().manual_seed(seed)
    pairs = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and name not in skip:
            a = torch.randn(rank, m.in_features, generator=g) / m.in_features**0.5
            pairs[name] = (a, torch.randn(m.out_features, rank, generator=g) * 0.2)
    return pairs


def diffusers_name(module):
    if module in TO_DIFFUSERS_TOP:
        return TO_DIFFUSERS_TOP[module]
    _, i, rest = module.split(".", 2)
    return f"blocks.{i}.{TO_DIFFUSERS_BLOCK[rest]}"


def save_peft(path, pairs, alpha=None):
    """LongLive's lora.pt: PEFT keys under `generator_lora`, no alpha (it goes to `load` / `merge_lora`)."""
    sd = {}
    for m, (a, b) in pairs.items():
        sd[f"base_model.model.{m}.lora_A.default.weight"] = a
        sd[f"base_model.model.{m}.lora_B.default.weight"] = b
    torch.save({"generator_lora": sd, "step": 10}, path)
    return path


def save_diffusers(path, pairs, alpha):
    """diffusers' `save_lora_weights`: WanTransformer3DModel names, alpha in the metadata."""
    sd = {}
    for m, (a, b) in pairs.items():
        sd[f"transformer.{diffusers_name(m)}.lora_A.weight"] = a
        sd[f"transformer.{diffusers_name(m)}.lora_B.weight"] = b
    rank = next(iter(pairs.values()))[0].shape[0]
    meta = {"lora_adapter_metadata": json.dumps({"transformer.lora_alpha": alpha, "transformer.r": rank})}
    save_file(sd, str(path), metadata=meta)
    return path


def save_comfy(path, pairs, alpha):
    """The original Wan names under `diffusion_model.`, lora_down / lora_up and an alpha per layer."""
    sd = {}
    for m, (a, b) in pairs.items():
        sd[f"diffusion_model.{m}.lora_down.weight"] = a
        sd[f"diffusion_model.{m}.lora_up.weight"] = b
        sd[f"diffusion_model.{m}.alpha"] = torch.tensor(float(alpha))
    save_file(sd, str(path))
    return path


def save_kohya(path, pairs, alpha):
    """kohya / musubi-tuner: `lora_unet_` and Wan's names with underscores."""
    sd = {}
    for m, (a, b) in pairs.items():
        key = "lora_unet_" + m.replace(".", "_")
        sd[f"{key}.lora_down.weight"] = a
        sd[f"{key}.lora_up.weight"] = b
        sd[f"{key}.alpha"] = torch.tensor(float(alpha))
    save_file(sd, str(path))
    return path


WRITERS = {"diffusers": save_diffusers, "comfy": save_comfy, "kohya": save_kohya}


@pytest.mark.parametrize("layout", sorted(WRITERS))
def test_every_layout_loads_the_same_adapter(tmp_path, layout):
    gen = tiny_generator()
    pairs = make_pairs(gen.model, rank=4, seed=1)
    assert len(pairs) == 26  # 2 blocks x 10, the text and time embeddings (2 + 2), the time projection, the head
    ref = gen.adapters.load("peft", save_peft(tmp_path / "peft.pt", pairs), alpha=2.0)
    got = gen.adapters.load(layout, WRITERS[layout](tmp_path / f"{layout}.safetensors", pairs, alpha=2.0))
    assert set(got.layers) == set(ref.layers) == set(pairs)
    for m, layer in got.layers.items():
        assert torch.equal(layer.a, ref.layers[m].a) and torch.equal(layer.b, ref.layers[m].b), m
        assert layer.scale == ref.layers[m].scale == 0.5, m
    assert got.rank == 4 and got.touches_text
    assert got.nbytes == sum(4 * (a.numel() + b.numel()) for a, b in pairs.values())  # fp32
    assert gen.adapters.nbytes == 2 * got.nbytes and gen.adapters.names == sorted(["peft", layout])


def run_batch(gen, styles, chunks):
    """Four streams (prompts and seeds fixed) with `styles` [(name, scale)], every forward batched."""
    prompts = ["a red fox", "a blue car", "waves at dusk", "a lighthouse"]
    states = [gen.open_stream(f"s{i}", p, seed=20 + i, lora=name, lora_scale=scale)
              for i, (p, (name, scale)) in enumerate(zip(prompts, styles))]
    out = [[] for _ in states]
    for _ in range(chunks):
        for _ in range(len(gen.sigmas)):
            gen.run(WorkKind.DENOISE, states)
        for j, chunk in enumerate(gen.run(WorkKind.COMMIT, states)):
            out[j].append(chunk)
    return states, out


def test_a_batch_of_four_streams_each_equals_its_merged_or_plain_generator(tmp_path):
    gen = tiny_generator(**CFG)
    # (name, rank, the file's alpha, layout, the stream's scale)
    specs = [("ink", 4, None, "peft", 1.0), ("neon", 8, 4.0, "kohya", 0.5), ("chalk", 2, 3.0, "diffusers", 1.5)]
    merged_alpha = {}
    for k, (name, rank, alpha, layout, scale) in enumerate(specs):
        pairs = make_pairs(gen.model, rank, seed=k + 1)
        save_peft(tmp_path / f"{name}-merge.pt", pairs)  # what --lora merges
        writer = save_peft if layout == "peft" else WRITERS[layout]
        gen.adapters.load(name, writer(tmp_path / f"{name}.{'pt' if layout == 'peft' else 'safetensors'}", pairs, alpha))
        merged_alpha[name] = scale * (alpha if alpha is not None else rank)
    styles = [(name, scale) for name, *_, scale in specs] + [(None, 1.0)]
    states, got = run_batch(gen, styles, chunks=4)

    plain_states, plain = run_batch(tiny_generator(**CFG), [(None, 1.0)] * 4, chunks=4)
    for x, y in zip(got[3], plain[3]):  # no style: bit for bit a generator without adapters
        assert torch.equal(x.latents, y.latents) and torch.equal(x.frames, y.frames), x.index
    for layer in range(gen.model_cfg.num_layers):
        assert all(torch.equal(a, b) for a, b in zip(states[3].cache.read(layer), plain_states[3].cache.read(layer)))

    for i, (name, *_) in enumerate(specs):  # a style: the generator with its LoRA merged, within 1e-5
        merged = tiny_generator(**CFG)
        merge_lora(merged.model, tmp_path / f"{name}-merge.pt", alpha=merged_alpha[name])
        merged_states, want = run_batch(merged, [(None, 1.0)] * 4, chunks=4)
        for x, y, base in zip(got[i], want[i], plain[i]):
            torch.testing.assert_close(x.latents, y.latents, atol=1e-5, rtol=0)
            assert (x.latents - base.latents).abs().max() > 1e-2  # and the style does change the stream
        for layer in range(gen.model_cfg.num_layers):
            for a, b in zip(states[i].cache.read(layer), merged_states[i].cache.read(layer)):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_a_live_switch_equals_a_fresh_stream_under_the_new_style(tmp_path):
    cfg = {**CFG, "recache_sinks": True}  # the whole cache is recomputed under the new style
    gen = tiny_generator(**cfg)
    for k, name in enumerate(["ink", "neon"]):
        gen.adapters.load(name, save_peft(tmp_path / f"{name}.pt", make_pairs(gen.model, 4, seed=k + 1)))
    state = gen.open_stream("s", "a forest", seed=2, lora="ink")
    it = gen.stream(state)
    for _ in range(4):  # the window has rolled: frames 0-2 sinks, 6-11 window
        next(it)
    gen.set_lora(state, "neon", 0.5)
    assert gen.next_work(state) is WorkKind.RECACHE and state.lora == "ink"  # applied with the recache
    gen.run(WorkKind.RECACHE, [state])
    assert (state.lora, state.lora_scale, state.prompt, state.prompt_version) == ("neon", 0.5, "a forest", 1)

    # the reference: "neon" merged, a fresh stream that commits the same clean latents (in time order after the
    # recache) chunk by chunk, then draws the same noise
    merged = tiny_generator(**cfg)
    merge_lora(merged.model, tmp_path / "neon.pt", alpha=0.5 * 4)
    ref = merged.open_stream("r", "a forest", seed=0)
    nf = gen.cfg.frames_per_chunk
    for c in range(3):
        slots = ref.cache.plan_commit(nf)
        x = state.clean[c * nf : (c + 1) * nf].transpose(0, 1)[None]
        merged.model(x, torch.zeros(1, nf), ref.text, [CacheAccess(ref.cache, ref.cache.num_frames, write_slots=slots)])
        ref.cache.advance(slots)
        ref.clean[slots[0] : slots[-1] + 1] = state.clean[c * nf : (c + 1) * nf]
    for layer in range(gen.model_cfg.num_layers):
        for a, b in zip(state.cache.read(layer), ref.cache.read(layer)):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    ref.noise.set_state(state.noise.get_state())
    it_ref = merged.stream(ref)
    after, fresh = [next(it) for _ in range(2)], [next(it_ref) for _ in range(2)]
    for x, y in zip(after, fresh):
        assert x.prompt_version == 1
        torch.testing.assert_close(x.latents, y.latents, atol=1e-5, rtol=0)


def test_a_switch_rides_a_pending_prompt_and_a_style_may_be_switched_off(tmp_path):
    gen = tiny_generator()
    gen.adapters.load("ink", save_peft(tmp_path / "ink.pt", make_pairs(gen.model, 4, seed=1)))
    state = gen.open_stream("s", "one", seed=0, lora="ink", lora_scale=0.8)
    gen.set_prompt(state, "two", version=7)
    gen.set_lora(state, None)
    assert (state.pending_prompt, state.pending_version, state.pending_lora) == ("two", 7, (None, 1.0))
    chunk = next(gen.stream(state))  # nothing cached yet: applied without a recache
    assert (chunk.prompt_version, state.prompt, state.lora, gen.lora_use(state)) == (7, "two", None, None)
    assert gen.adapters.use("ink", 0.0) is None  # scale 0: the base weights, bit for bit


def test_a_text_style_has_its_own_prompt_kv_and_others_share_the_prompts(tmp_path):
    gen = tiny_generator()
    text_layers = {"text_embedding.0", "text_embedding.2"} | {f"blocks.{i}.cross_attn.{p}" for i in range(2) for p in "kv"}
    gen.adapters.load("all", save_peft(tmp_path / "all.pt", make_pairs(gen.model, 4, seed=1)))
    gen.adapters.load("video", save_peft(tmp_path / "video.pt", make_pairs(gen.model, 4, seed=2, skip=text_layers)))
    plain = gen.encode_prompt("a cat")
    assert gen.encode_prompt("a cat", gen.adapters.use("video", 1.0)) is plain
    styled = gen.encode_prompt("a cat", gen.adapters.use("all", 1.0))
    assert styled is not plain and not torch.allclose(styled[0][0], plain[0][0])
    assert gen.encode_prompt("a cat", gen.adapters.use("all", 0.5)) is not styled  # per scale


def test_bad_files_names_ranks_and_scales_are_clear_errors(tmp_path):
    gen = tiny_generator(lora_max_rank=4)
    pairs = make_pairs(gen.model, 4, seed=1)
    gen.adapters.load("ink", save_peft(tmp_path / "ink.pt", pairs))
    cases = {  # file -> what the error says
        "missing.safetensors": "does not exist",
        "corrupt.safetensors": "cannot be read",
        "notes.txt": "expected one of",
        "list.pt": "not a state dict",
        "deep.pt": "1 layer(s) match no Linear of the model: blocks.5.self_attn.q",
        "half.pt": "blocks.0.ffn.0 has no lora_B",
        "shape.pt": "a LoRA of another model",
        "wide.pt": "rank 8, over the maximum 4",
        "diff.safetensors": "full-weight difference",
        "empty.pt": "holds no LoRA pairs",
    }
    (tmp_path / "corrupt.safetensors").write_bytes(b"\x07not a safetensors file")
    (tmp_path / "notes.txt").write_text("a style")
    torch.save([1, 2], tmp_path / "list.pt")
    a, b = pairs["blocks.0.self_attn.q"]
    save_peft(tmp_path / "deep.pt", {**pairs, "blocks.5.self_attn.q": (a, b)})
    torch.save({"blocks.0.ffn.0.lora_A.weight": pairs["blocks.0.ffn.0"][0]}, tmp_path / "half.pt")
    save_peft(tmp_path / "shape.pt", {"blocks.0.ffn.0": (torch.zeros(4, 7), torch.zeros(128, 4))})
    save_peft(tmp_path / "wide.pt", make_pairs(gen.model, 8, seed=2))
    save_file({"diffusion_model.blocks.0.self_attn.q.diff": torch.zeros(64, 64)}, str(tmp_path / "diff.safetensors"))
    torch.save({}, tmp_path / "empty.pt")
    for file, message in cases.items():
        with pytest.raises(AdapterError, match=re.escape(message)):
            gen.adapters.load(file.split(".")[0], tmp_path / file)
    assert gen.adapters.names == ["ink"]  # nothing half-loaded
    with pytest.raises(ValueError, match="loaded already"):
        gen.adapters.load("ink", tmp_path / "ink.pt")

    with pytest.raises(ValueError, match=r"no style named 'ocean' \(offered: ink\)"):
        gen.open_stream("s", "a cat", seed=0, lora="ocean")
    state = gen.open_stream("s", "a cat", seed=0, lora="ink")
    for scale in (2.5, -0.1, float("nan"), "1"):
        with pytest.raises(ValueError, match=r"lora_scale must be a number in \[0.0, 2.0\]"):
            gen.set_lora(state, "ink", scale)
    with pytest.raises(ValueError, match="no style named 'ocean'"):
        gen.set_lora(state, "ocean")
    assert (state.pending_lora, state.pending_prompt) == (None, None)  # the stream goes on as it was
    assert next(gen.stream(state)).prompt_version == 0 and state.lora == "ink"


def test_a_folder_of_styles_loads_each_file_by_its_name_or_none(tmp_path):
    gen = tiny_generator()
    folder = tmp_path / "styles"
    folder.mkdir()
    save_kohya(folder / "neon.safetensors", make_pairs(gen.model, 2, seed=1), alpha=2.0)
    save_peft(folder / "ink.pt", make_pairs(gen.model, 2, seed=2))
    (folder / "README.md").write_text("not a LoRA: not offered")
    assert gen.adapters.load_dir(folder) == ["ink", "neon"] == gen.adapters.names
    other = tiny_generator()
    save_peft(folder / "zz-broken.pt", {"blocks.9.ffn.0": make_pairs(gen.model, 2, seed=3)["blocks.0.ffn.0"]})
    with pytest.raises(AdapterError, match="zz-broken.pt: 1 layer"):
        other.adapters.load_dir(folder)
    assert other.adapters.names == []


def test_a_styled_forward_with_streams_at_other_fills_is_the_merged_forward(tmp_path):
    # a batch whose streams read different cache prefixes (a mask) through the model directly
    gen, merged = tiny_generator(), tiny_generator()
    save_peft(tmp_path / "ink.pt", make_pairs(gen.model, 4, seed=1))
    gen.adapters.load("ink", tmp_path / "ink.pt")
    merge_lora(merged.model, tmp_path / "ink.pt")
    mc = gen.model_cfg
    caches = [StreamCache(gen.cache_spec()) for _ in range(2)]
    for cache, n in zip(caches, (3, 6)):
        for layer in range(mc.num_layers):
            kv = torch.randn(2, n, mc.tokens_per_frame, mc.num_heads, mc.head_dim, generator=torch.Generator().manual_seed(n))
            cache.write(layer, list(range(n)), kv[0], kv[1])
        cache.sinks_filled, cache.window_filled = 3, n - 3
    x = torch.randn(2, mc.in_channels, 3, mc.latent_height, mc.latent_width, generator=torch.Generator().manual_seed(0))
    t = torch.full((2, 3), 700.0)
    use = gen.adapters.use("ink", 1.0)
    text = [(torch.cat([a, a]), torch.cat([b, b])) for a, b in gen.encode_prompt("a cat", use)]
    got = gen.model(x, t, text, [CacheAccess(c, n, lora=use) for c, n in zip(caches, (3, 6))])
    mtext = [(torch.cat([a, a]), torch.cat([b, b])) for a, b in merged.encode_prompt("a cat")]
    want = merged.model(x, t, mtext, [CacheAccess(c, n) for c, n in zip(caches, (3, 6))])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_graph_buffers_hold_any_adapter_of_the_same_targets_exactly(tmp_path):
    # what a CUDA graph reads (models/graphs.py): fixed buffers of the maximum rank, zero-padded, the scales
    # on the device; an adapter of a smaller rank after a larger one leaves no trace of it
    from models.adapters import AdapterBuffers

    gen = tiny_generator(lora_max_rank=8)
    for name, rank, seed in (("wide", 8, 1), ("narrow", 2, 2)):
        gen.adapters.load(name, save_kohya(tmp_path / f"{name}.safetensors", make_pairs(gen.model, rank, seed), alpha=3.0))
    buffers = AdapterBuffers(gen.adapters.get("wide"), max_rank=8)
    state = gen.open_stream("s", "a cat", seed=0)
    mc = gen.model_cfg
    x = torch.randn(1, mc.in_channels, 3, mc.latent_height, mc.latent_width, generator=torch.Generator().manual_seed(0))
    t = torch.full((1, 3), 800.0)
    for name, scale in (("wide", 1.0), ("narrow", 0.5), ("narrow", 0.5), ("wide", 2.0)):
        use = gen.adapters.use(name, scale)
        buffers.load(use)
        assert buffers.resident == (use.adapter.uid, scale)
        text = gen.encode_prompt("a cat", use)
        want = gen.model(x, t, text, [CacheAccess(state.cache, 0, lora=use)])
        got = gen.model(x, t, text, [CacheAccess(state.cache, 0, lora=buffers.use)])
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    other = make_pairs(gen.model, 2, seed=3, skip={"head.head"})
    gen.adapters.load("other", save_peft(tmp_path / "other.pt", other))
    with pytest.raises(ValueError, match="other layers"):
        buffers.load(gen.adapters.use("other", 1.0))
    assert buffers.nbytes == 4 * 8 * sum(a.shape[1] + b.shape[0] for a, b in make_pairs(gen.model, 1, 0).values())


def test_graph_buffers_take_the_rank_the_styles_need(tmp_path):
    # the CUDA graphs' buffers are as wide as the widest style loaded on those Linears, rounded up to 16 (a library
    # of rank-16 styles does not pay for the maximum), and refuse a wider one loaded later
    from models.adapters import AdapterBuffers

    gen = tiny_generator(lora_max_rank=64)
    gen.adapters.load("small", save_kohya(tmp_path / "small.safetensors", make_pairs(gen.model, 4, 1), alpha=4.0))
    targets = gen.adapters.get("small").targets
    assert gen.adapters.buffer_rank(targets) == 16
    assert gen.adapters.buffer_rank(("blocks.0.ffn.0",)) == 64  # no style there yet: the maximum
    gen.adapters.load("mid", save_kohya(tmp_path / "mid.safetensors", make_pairs(gen.model, 20, 2), alpha=4.0))
    assert gen.adapters.buffer_rank(targets) == 32
    buffers = AdapterBuffers(gen.adapters.get("small"), max_rank=16)
    gen.adapters.load("wide", save_kohya(tmp_path / "wide.safetensors", make_pairs(gen.model, 40, 3), alpha=4.0))
    assert gen.adapters.buffer_rank(targets) == 48
    with pytest.raises(ValueError, match="rank 40, over these buffers' 16"):
        buffers.load(gen.adapters.use("wide", 1.0))
    small = tiny_generator(lora_max_rank=8)
    small.adapters.load("small", tmp_path / "small.safetensors")
    assert small.adapters.buffer_rank(targets) == 8  # never past the generator's maximum
