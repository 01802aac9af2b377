"""What a CUDA graph of a forward is keyed on (models/graphs.py). One set of graphs serves every
stream, so the key holds the shape of the work (cached frames read, frames written, whether the
cached keys are rotated first) and the workspace, never the stream, its slots or its RoPE phase;
and a forward that a graph cannot replay safely gets no key."""

import pytest
import torch

from models import CacheAccess, GeneratorConfig, build_generator
from models.graphs import GraphedForward, describe, graph_key


def setup(**cfg):
    gen = build_generator("tiny", device="cpu", dtype=torch.float32, seed=0, cfg=GeneratorConfig(sink_frames=3, window_frames=6, **cfg))
    mc = gen.model_cfg
    x = torch.zeros(1, mc.in_channels, 3, mc.latent_height, mc.latent_width)
    return gen, x, torch.zeros(1, 3)


def commit(cache, n=3):
    slots = cache.plan_commit(n)
    cache.advance(slots)
    return slots


def key(gen, x, t, state, **acc):
    gen.workspace.attach(state.cache)
    return graph_key(x, t, state.text, [CacheAccess(state.cache, state.cache.num_frames, **acc)])


def test_streams_and_ring_phases_share_keys():
    gen, x, t = setup()
    a, b = gen.open_stream("a", "a kite", seed=0), gen.open_stream("b", "a boat", seed=1)
    keys_a, keys_b = [], []
    for _ in range(3 + 6 // 3 * 2):  # sinks, fill the window, then two turns of the ring
        commit(a.cache)
        commit(b.cache)
        keys_a.append(key(gen, x, t, a))
        keys_b.append(key(gen, x, t, b))
    assert keys_a == keys_b  # another stream, another prompt: the same graphs
    # fills 3, 6, 9 differ; the full cache at every phase of the ring is one graph
    assert len(set(keys_a[:3])) == 3 and set(keys_a[2:]) == {keys_a[2]}
    assert key(gen, x + 1, t + 500, a) == key(gen, x, t, a)  # values: copied in
    writes = key(gen, x, t, a, write_slots=a.cache.plan_commit(3))
    assert writes not in (None, keys_a[-1])
    assert key(gen, x, t, a, write_slots=[5, 3, 4]) == writes  # which slots: copied in
    assert key(gen, x, t, a, keys_rotated=True) != keys_a[-1]  # reads the rotated keys as they are
    assert "6 cached frames" in describe(keys_a[1]) and "writing 3 frames" in describe(writes)


def test_no_key_for_what_a_graph_cannot_replay():
    gen, x, t = setup()
    a, b = gen.open_stream("a", "a kite", seed=0), gen.open_stream("b", "a kite", seed=0)
    commit(a.cache)
    n = a.cache.num_frames
    assert graph_key(x, t, a.text, [CacheAccess(a.cache, n)]) is None  # not in the workspace: its own storage
    two = torch.cat([x, x]), torch.cat([t, t])
    assert graph_key(*two, a.text, [CacheAccess(a.cache, n), CacheAccess(b.cache, 0)]) is None  # a batch
    gen.workspace.attach(a.cache)
    assert graph_key(x, t, a.text, [CacheAccess(a.cache, n)]) is not None
    assert graph_key(x, t, a.text, [CacheAccess(a.cache, n, block_ids=[0, 0, 1])]) is None  # several blocks: masked
    q, xq, tq = setup(kv_quant="int2")
    s = q.open_stream("q", "a kite", seed=0)
    assert q.workspace is None and graph_key(xq, tq, s.text, [CacheAccess(s.cache, 0)]) is None  # quantized


def test_cpu_runs_the_model_itself_and_captures_nothing():
    gen, x, t = setup()
    s = gen.open_stream("a", "a kite", seed=0)
    assert gen.runner is gen.model and gen.capture_graphs() == 0
    graphed = GraphedForward(gen.model)
    acc = [CacheAccess(s.cache, 0)]
    torch.testing.assert_close(graphed(x, t, s.text, acc), gen.model(x, t, s.text, acc), rtol=0, atol=0)
    assert graphed.stats == {"replays": 0, "captures": 0, "eager": 1}


def chunk(gen, state):
    """Run `state`'s forwards until its next chunk is out."""
    for _ in range(10):
        out = gen.run(gen.next_work(state), [state])
        if out[0] is not None:
            return out[0]
    raise AssertionError("no chunk after 10 forwards")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graphs_captured_at_start_serve_every_stream_and_equal_eager():
    """bf16 on the GPU: the graphs captured before serving replay every forward of two streams
    that take turns in the workspace, through every ring phase and a prompt switch (a recache),
    nothing runs eagerly or is captured while serving, and the chunks equal eager forwards'."""
    from dataclasses import replace

    from models.config import ModelConfig
    from models.dit import CausalWanModel
    from models.generator import ChunkGenerator

    mc = ModelConfig.from_name("tiny", dim=256, num_heads=2, latent_height=64, latent_width=64)  # 256 tokens a frame
    model = CausalWanModel(mc).init_weights(3).to("cuda", torch.bfloat16).eval()
    cfg = GeneratorConfig(sink_frames=3, window_frames=6)
    graphed, eager = ChunkGenerator(model, cfg), ChunkGenerator(model, replace(cfg, cuda_graphs=False))
    captured = graphed.capture_graphs()
    assert captured == len(graphed.runner.keys) == 2 + 3 * 4  # fill 0: step + commit; 3, 6, 9: both rotating or not
    before = dict(graphed.runner.stats)
    latents = []
    for gen in (graphed, eager):
        states = [gen.open_stream(f"s{i}", f"prompt {i}", seed=i) for i in range(2)]
        got = []
        for c in range(6):  # 18 frames through 3 sinks + 6 window slots: every phase of the ring
            if c == 4:
                gen.set_prompt(states[0], "another prompt")
            for s in states:  # chunk by chunk: each chunk switches the workspace to its stream
                got.append(chunk(gen, s).latents)
        latents.append(torch.stack(got).float())
    stats = graphed.runner.stats
    assert stats["captures"] == before["captures"] and stats["eager"] == before["eager"], (before, stats)
    assert stats["replays"] - before["replays"] == 2 * 6 * 5 + 2, stats  # 5 forwards a chunk, a 2-forward recache
    err = ((latents[0] - latents[1]).norm() / latents[1].norm()).item()
    assert err < 1e-2, err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_styles_replay_graphs_captured_with_their_buffers_and_equal_eager(tmp_path):
    """bf16 on the GPU: styles loaded before the capture get graphs of their own (one set per set of targeted
    Linears), replayed for every style of those targets through its buffers: three streams (two styles of the
    same targets and ranks 8 and 2, and none) take turns, one switches live to a style of other targets, and
    the chunks equal eager forwards' while nothing runs eagerly or is captured while serving."""
    from dataclasses import replace

    from models.config import ModelConfig
    from models.dit import CausalWanModel
    from models.generator import ChunkGenerator

    mc = ModelConfig.from_name("tiny", dim=256, num_heads=2, latent_height=64, latent_width=64)
    model = CausalWanModel(mc).init_weights(3).to("cuda", torch.bfloat16).eval()
    cfg = GeneratorConfig(sink_frames=3, window_frames=6, lora_max_rank=32)
    graphed, eager = ChunkGenerator(model, cfg), ChunkGenerator(model, replace(cfg, cuda_graphs=False))
    g = torch.Generator().manual_seed(0)

    def load(name, rank, skip=()):
        sd = {}
        for module, lin in model.named_modules():
            if module.startswith("blocks.") and isinstance(lin, torch.nn.Linear) and not any(s in module for s in skip):
                sd[f"{module}.lora_A.weight"] = torch.randn(rank, lin.in_features, generator=g) / lin.in_features**0.5
                sd[f"{module}.lora_B.weight"] = torch.randn(lin.out_features, rank, generator=g) * 0.1
        torch.save(sd, tmp_path / f"{name}.pt")
        for gen in (graphed, eager):
            gen.adapters.load(name, tmp_path / f"{name}.pt")

    for name, rank, skip in (("ink", 8, ()), ("neon", 2, ()), ("attn", 4, ("ffn",))):
        load(name, rank, skip)
    assert graphed.capture_graphs() == 3 * (2 + 3 * 4)  # none, the blocks' Linears, their attention only
    before = dict(graphed.runner.stats)
    latents = []
    for gen in (graphed, eager):
        states = [gen.open_stream(f"s{i}", f"prompt {i}", seed=i, lora=style, lora_scale=scale)
                  for i, (style, scale) in enumerate((("ink", 1.0), ("neon", 1.5), (None, 1.0)))]
        got = []
        for c in range(5):
            if c == 3:
                gen.set_lora(states[0], "attn", 0.5)
            for s in states:  # chunk by chunk: each chunk switches the workspace and the style's buffers
                got.append(chunk(gen, s).latents)
        latents.append(torch.stack(got).float())
    stats = graphed.runner.stats
    assert stats["captures"] == before["captures"] and stats["eager"] == before["eager"], (before, stats)
    assert stats["replays"] - before["replays"] == 3 * 5 * 5 + 2, stats  # 5 forwards a chunk, a 2-forward recache
    err = ((latents[0] - latents[1]).norm() / latents[1].norm()).item()
    assert err < 1e-2, err
    assert {b.max_rank for b in graphed.runner.adapter_buffers.values()} == {16}  # the widest style (8), rounded up

    # a style loaded after the capture, wider than its Linears' buffers: its forwards run eagerly, and right
    load("wide", 24)
    before = dict(stats)
    got = [chunk(gen, gen.open_stream("w", "prompt w", seed=7, lora="wide")).latents.float() for gen in (graphed, eager)]
    assert graphed.runner.stats["eager"] > before["eager"] and graphed.runner.stats["captures"] == before["captures"]
    err = ((got[0] - got[1]).norm() / got[1].norm()).item()
    assert err < 1e-2, err
