"""What a CUDA graph of a forward is keyed on (models/graphs.py): a graph replayed under the wrong
key would read the wrong cache slots or positions, so the key must change whenever they do."""

import torch

from models import CacheAccess, GeneratorConfig, build_generator
from models.graphs import GraphedForward, graph_key


def setup(**cfg):
    gen = build_generator("tiny", device="cpu", dtype=torch.float32, seed=0, cfg=GeneratorConfig(sink_frames=3, window_frames=6, **cfg))
    mc = gen.model_cfg
    x = torch.zeros(1, mc.in_channels, 3, mc.latent_height, mc.latent_width)
    return gen, x, torch.zeros(1, 3)


def commit(cache, n=3):
    slots = cache.plan_commit(n)
    cache.advance(slots)
    return slots


def test_key_follows_the_ring_phase_and_the_cache_not_the_values():
    gen, x, t = setup()
    s = gen.open_stream("a", "a kite", seed=0)
    read = lambda: graph_key(x, t, s.text, [CacheAccess(s.cache, s.cache.num_frames)])  # noqa: E731
    keys = []
    for _ in range(3 + 6 // 3 * 2):  # sinks, fill the window, then two turns of the ring
        commit(s.cache)
        keys.append(read())
    # sinks, window 3/6, window full at head 0, 3, 0, 3: positions repeat with the ring's phase
    assert len({keys[0], keys[1], keys[2]}) == 3
    assert keys[2] == keys[4] and keys[3] == keys[5] and keys[2] != keys[3]
    assert graph_key(x + 1, t + 500, s.text, [CacheAccess(s.cache, s.cache.num_frames)]) == read()  # inputs: copied in
    other = gen.open_stream("b", "a kite", seed=0)
    for _ in range(len(keys)):
        commit(other.cache)
    assert graph_key(x, t, other.text, [CacheAccess(other.cache, other.cache.num_frames)]) != read()  # another cache
    assert graph_key(x, t, s.text, [CacheAccess(s.cache, 3)]) != read()  # another prefix
    assert graph_key(x, t, s.text, [CacheAccess(s.cache, s.cache.num_frames, keys_rotated=True)]) != read()  # no rotation


def test_key_tells_writes_apart_and_refuses_what_cannot_be_captured():
    gen, x, t = setup()
    a, b = gen.open_stream("a", "a kite", seed=0), gen.open_stream("b", "a kite", seed=0)
    commit(a.cache)
    n = a.cache.num_frames
    plain = graph_key(x, t, a.text, [CacheAccess(a.cache, n)])
    write = graph_key(x, t, a.text, [CacheAccess(a.cache, n, write_slots=a.cache.plan_commit(3))])
    assert write is not None and write != plain
    assert graph_key(x, t, a.text, [CacheAccess(a.cache, n, write_slots=[5, 3, 4])]) is None  # wrapping write
    two = torch.cat([x, x]), torch.cat([t, t])
    assert graph_key(*two, a.text, [CacheAccess(a.cache, n), CacheAccess(b.cache, 0)]) is None  # unequal reads: masked
    assert graph_key(x, t, a.text, [CacheAccess(None, 0, block_ids=[0, 0, 1])]) is None  # several blocks: masked
    q, xq, tq = setup(kv_quant="int2")
    s = q.open_stream("q", "a kite", seed=0)
    assert graph_key(xq, tq, s.text, [CacheAccess(s.cache, 0)]) is None  # quantized storage


def test_cpu_runs_the_model_itself():
    gen, x, t = setup()
    s = gen.open_stream("a", "a kite", seed=0)
    assert gen.runner is gen.model
    graphed = GraphedForward(gen.model)
    acc = [CacheAccess(s.cache, 0)]
    torch.testing.assert_close(graphed(x, t, s.text, acc), gen.model(x, t, s.text, acc), rtol=0, atol=0)
    assert graphed.stats == {"replays": 0, "captures": 0, "eager": 1}
