"""The DiT's forward split over k gloo ranks on the CPU (models/parallel.py) gives one process's result.

Four spawned gloo ranks, as a group of 4 and (ranks 0 and 1) as a subgroup of 2, run the generator's
real path with `ShardedGenerator`: denoising steps, commits writing the cache, the ring turning, a
prompt switch with its recache, batched streams at unequal fills (masked forwards) over int4 KV. This
process compares them with a `ChunkGenerator` of the same weights and calls: every chunk's latents,
its decoded frames, and each rank's cache against its heads of the one-process cache.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from kvcache import CachePool
from models import ModelConfig
from models.build import build_generator
from models.decoder import NoDecoder
from models.generator import ChunkGenerator
from models.parallel import (
    PARALLEL_ENV,
    ReceivedTextEncoder,
    RootTextEncoder,
    allowed_degrees,
    build_sharded_generator,
    build_worker_generator,
    check_degree,
    init_rank,
    parallel_env,
    shard_spec,
    spawn_ranks,
)
from models.stream import GeneratorConfig

PROMPTS = ("a red ball rolls on green grass", "a blue cube on sand", "a yellow star in the night sky")
RING = GeneratorConfig(sink_frames=3, window_frames=6)  # the window turns from the fourth chunk on

# name -> (weights, generator config, scenario): the built-in model has 4 heads, random tiny weights 2
CASES = {
    "builtin-one-stream": ("builtin", RING, "one"),
    "builtin-two-streams-int4": ("builtin", replace(RING, kv_quant="int4"), "two"),
    "random-one-stream": ("random", RING, "one"),
    "builtin-video-to-video": ("builtin", RING, "v2v"),
    "builtin-chunks-of-one-frame": ("builtin", replace(RING, frames_per_chunk=1), "one"),  # --latency low's size
}
# how far a case's sharded latents and cache may be from one process's: float noise (1e-5), but chunks of one latent
# frame measured 4.8e-5 (47 of the frames' pixels one level off), for a cause not yet found (a note of issue 45)
TOLERANCE = {"builtin-chunks-of-one-frame": 1e-4}


def _one_stream(gen: ChunkGenerator):
    """6 chunks of one stream; its prompt switches before chunk 4 (a recache with the ring turned)."""
    state = gen.open_stream("a", PROMPTS[0], seed=1)
    chunks = []
    for chunk in gen.stream(state, {4: PROMPTS[1]}):
        chunks.append(chunk)
        if len(chunks) == 6:
            break
    return {"a": chunks}, [state]


def _two_streams(gen: ChunkGenerator):
    """Stream a alone for a chunk, then a and b batched by kind of work (unequal cache fills: masked
    forwards); b's prompt switches before its chunk 2 (its recache runs beside a's step)."""
    a, b = gen.open_stream("a", PROMPTS[0], seed=1), gen.open_stream("b", PROMPTS[1], seed=2)
    out = {"a": [], "b": []}

    def step(states):
        by_work = {}
        for s in states:
            if s is b and s.step == 0 and s.chunks_done == 2 and s.prompt == PROMPTS[1] and s.pending_prompt is None:
                gen.set_prompt(b, PROMPTS[2])
            by_work.setdefault(gen.next_work(s), []).append(s)
        for work, group in by_work.items():
            for s, chunk in zip(group, gen.run(work, group)):
                if chunk is not None:
                    out[s.stream_id].append(chunk)

    while not out["a"]:
        step([a])
    while len(out["b"]) < 4:
        step([a, b])
    return out, [a, b]


def _v2v_stream(gen: ChunkGenerator):
    """5 chunks of one stream with input video at strength 0.6 (each rank encodes the same frames itself)."""
    from models.scenes import Scene, Timeline

    mc = gen.model_cfg
    tl = Timeline(((0, Scene("red", "ball", motion="right"), "a red ball moving right"),), mc.height, mc.width)
    state = gen.open_stream("a", PROMPTS[1], seed=1)
    gen.set_strength(state, 0.6)
    chunks, first = [], 0
    while len(chunks) < 5:
        n = gen.frames_in_chunk(state.chunks_done)
        gen.set_input(state, tl.render(range(first, first + n)))
        first += n
        chunk = None
        while chunk is None:
            chunk = gen.run(gen.next_work(state), [state])[0]
        assert chunk.input == "frames" and chunk.start_step == gen.start_step(0.6) > 0
        chunks.append(chunk)
    return {"a": chunks}, [state]


SCENARIOS = {"one": _one_stream, "two": _two_streams, "v2v": _v2v_stream}


def _results(gen: ChunkGenerator, scenario: str) -> dict:
    chunks, states = SCENARIOS[scenario](gen)
    caches = {}
    for s in states:
        if gen.workspace is not None:
            gen.workspace.detach()
        n = s.cache.num_frames
        caches[s.stream_id] = [torch.stack([t.float().clone() for t in s.cache.read(layer, n)]) for layer in range(s.cache.spec.num_layers)]
    return {
        "latents": {sid: torch.stack([c.latents for c in cs]) for sid, cs in chunks.items()},
        "frames": {sid: torch.cat([c.frames for c in cs]) for sid, cs in chunks.items()},
        "caches": caches,  # per stream, per layer [2, frames, T, H (this rank's), D]
        "forwards": {s.stream_id: dict(s.forwards) for s in states},
    }


# group size -> the cases run over it: all four ranks (the default group), and ranks 0 and 1 (a subgroup)
RUNS = {4: ["builtin-one-stream", "builtin-two-streams-int4"], 2: list(CASES)}


def _rank_main(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    init_rank(rank, world_size, f"file://{init_file}", timeout_s=60)
    try:
        pair = dist.new_group([0, 1])  # every rank of the default group makes it
        for k, names in RUNS.items():
            if rank >= k:
                continue
            for name in names:
                weights, cfg, scenario = CASES[name]
                gen = build_sharded_generator("tiny", weights=weights, cfg=cfg, group=None if k == world_size else pair)
                res = _results(gen, scenario)
                res["env"] = {key: os.environ.get(key) for key in PARALLEL_ENV}
                res["spec_heads"] = gen.cache_spec().num_heads
                torch.save(res, f"{out_dir}/{name}-k{k}-rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_sharded_forwards_match_one_process(tmp_path):
    """4 gloo ranks: the cases over all 4, then over ranks 0 and 1 as a subgroup of 2."""
    start = time.monotonic()
    spawn_ranks(_rank_main, 4, (str(tmp_path / "init"), str(tmp_path)), timeout_s=90)
    spawned = time.monotonic() - start
    torch.set_num_threads(1)
    refs = {}
    report = []
    for k, names in RUNS.items():
        for name in names:
            weights, cfg, scenario = CASES[name]
            if name not in refs:
                refs[name] = _results(build_generator("tiny", weights=weights, cfg=cfg), scenario)
            ref = refs[name]
            ranks = [torch.load(tmp_path / f"{name}-k{k}-rank{r}.pt") for r in range(k)]
            heads = ref["caches"]["a"][0].shape[3]
            for res in ranks:
                assert res["env"] == PARALLEL_ENV
                assert res["spec_heads"] == heads // k
                assert res["forwards"] == ref["forwards"]
            lat = max((res["latents"][sid] - ref["latents"][sid]).abs().max().item() for res in ranks for sid in ref["latents"])
            off = sum((ranks[0]["frames"][sid] != ref["frames"][sid]).sum().item() for sid in ref["frames"])
            kv = 0.0
            for sid, layers in ref["caches"].items():
                for layer, full in enumerate(layers):
                    joined = torch.cat([res["caches"][sid][layer] for res in ranks], dim=3)  # rank r: heads [r H/k, (r+1) H/k)
                    kv = max(kv, (joined - full).abs().max().item())
            report.append(f"{name}: k={k} latents max|diff| {lat:.2e}, frames {off} pixels off, cache max|diff| {kv:.2e}")
            tol = TOLERANCE.get(name, 1e-5)
            assert lat <= tol and kv <= tol, report[-1]
            assert off == 0 or tol > 1e-5, report[-1]
    print(f"\n({spawned:.1f} s spawned, {time.monotonic() - start:.1f} s in all)\n  " + "\n  ".join(report))


def test_a_degree_that_does_not_divide_the_heads_names_the_allowed_ones():
    tiny, big = ModelConfig.from_name("tiny"), ModelConfig.from_name("wan2.1-14b")
    assert allowed_degrees(tiny) == [1, 2]
    assert allowed_degrees(replace(tiny, dim=128, num_heads=4)) == [1, 2, 4]  # the built-in model
    assert allowed_degrees(ModelConfig.from_name("wan2.1-1.3b")) == [1, 2, 3, 4, 6, 12]
    assert allowed_degrees(big) == [1, 2, 4, 5, 8, 10, 20, 40]
    check_degree(big, 8)
    with pytest.raises(ValueError, match="use one of 1, 2, 4, 5, 8, 10, 20, 40"):
        check_degree(big, 3)
    with pytest.raises(ValueError, match="use one of 1, 2$"):
        check_degree(tiny, 4)


def test_each_rank_allocates_and_counts_its_heads_of_a_cache():
    spec = ModelConfig.from_name("wan2.1-14b").cache_spec(sink_frames=3, window_frames=9)
    part = shard_spec(spec, 4)
    assert (part.num_heads, part.stream_bytes() * 4) == (10, spec.stream_bytes())
    tiny = replace(ModelConfig.from_name("tiny"), dim=128, num_heads=4).cache_spec(
        sink_frames=3, window_frames=6, dtype="float32", quant="int4")
    pool = CachePool(10 * 2**20, "cpu")
    cache = pool.allocate("s", shard_spec(tiny, 2))
    assert cache.nbytes == pool.used_bytes == shard_spec(tiny, 2).stream_bytes() < tiny.stream_bytes()
    with pytest.raises(ValueError, match="must divide the heads"):
        shard_spec(tiny, 3)


def test_the_spawn_environment_turns_multicast_off():
    env = parallel_env({"NCCL_NVLS_ENABLE": "1"})
    assert env == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _loading_main(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    """Rank 0 builds as a group's rank 0 does, rank 1 as a worker (streamsvc/engine/lockstep.py, offline.py), each
    recording the calls that load a text encoder or a decoder; both then open a stream (rank 0 encodes its
    prompt and broadcasts it)."""
    import models.build as g

    torch.set_num_threads(1)
    loads = []
    for name in ("_text_encoder", "_decoder"):
        real = getattr(g, name)
        setattr(g, name, lambda *a, _n=name, _real=real, **k: loads.append(_n) or _real(*a, **k))
    init_rank(rank, world_size, f"file://{init_file}", timeout_s=60)
    try:
        build = build_sharded_generator if rank == 0 else build_worker_generator
        gen = build("tiny", weights="random", cfg=RING, **({"root_only": True} if rank == 0 else {}))
        state = gen.open_stream("a", PROMPTS[0], seed=1)
        torch.save({"loads": loads, "text": type(gen.text_encoder).__name__, "decoder": type(gen.decoder).__name__,
                    "text_kv": state.text}, f"{out_dir}/load-rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_a_worker_loads_no_text_encoder_and_no_decoder(tmp_path):
    """The umT5 text encoder and the VAE/TAEHV decoder load on rank 0 only: a worker's build never calls their
    loaders (build_generator's dit_only), and its prompts' K/V come from rank 0's encoding."""
    spawn_ranks(_loading_main, 2, (str(tmp_path / "init"), str(tmp_path)), timeout_s=90)
    root, worker = (torch.load(tmp_path / f"load-rank{r}.pt") for r in range(2))
    assert sorted(root["loads"]) == ["_decoder", "_text_encoder"]
    assert (root["text"], root["decoder"]) == (RootTextEncoder.__name__, "TinyStreamingDecoder")
    assert worker["loads"] == []
    assert (worker["text"], worker["decoder"]) == (ReceivedTextEncoder.__name__, NoDecoder.__name__)
    assert len(root["text_kv"]) == len(worker["text_kv"]) > 0
    assert all(torch.equal(ka, kb) and torch.equal(va, vb)
               for (ka, va), (kb, vb) in zip(root["text_kv"], worker["text_kv"]))
