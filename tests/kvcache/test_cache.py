import pytest
import torch

from kvcache import CachePool, CacheSpec, PoolFull, StreamCache


def spec(**kw) -> CacheSpec:
    base = dict(num_layers=2, num_heads=2, head_dim=4, tokens_per_frame=3, sink_frames=2, window_frames=3, dtype="float32")
    base.update(kw)
    return CacheSpec(**base)


def commit(cache: StreamCache, n: int, value: float) -> list[int]:
    """Commit n frames whose K is filled with `value + i` (i: frame within the commit)."""
    slots = cache.plan_commit(n)
    s = cache.spec
    k = torch.stack([torch.full((s.tokens_per_frame, s.num_heads, s.head_dim), value + i) for i in range(n)])
    for layer in range(s.num_layers):
        cache.write(layer, slots, k, -k)
    cache.advance(slots)
    return slots


def test_sinks_then_ring_window_rolls_in_place():
    cache = StreamCache(spec())
    assert commit(cache, 2, 0) == [0, 1]  # sinks
    assert commit(cache, 2, 2) == [2, 3]
    assert commit(cache, 1, 4) == [4]  # window full: frames 2, 3, 4
    assert cache.positions() == [0, 1, 2, 3, 4]
    storage_ptr = cache.storage.k.data_ptr()
    assert commit(cache, 2, 5) == [2, 3]  # overwrites the two oldest window frames (2, 3)
    assert cache.frame_ids == [0, 1, 5, 6, 4]
    assert cache.head == 2
    # oldest window frame (4, slot 4) sits right after the sinks, then 5, 6
    assert cache.positions() == [0, 1, 3, 4, 2]
    assert cache.window_slots_in_order() == [4, 2, 3]
    assert cache.storage.k.data_ptr() == storage_ptr  # no reallocation to roll
    k, v = cache.read(1)
    assert k.shape == (5, 3, 2, 4)
    assert [k[s, 0, 0, 0].item() for s in range(5)] == [0, 1, 5, 6, 4]
    assert torch.equal(v, -k)


def test_commit_larger_than_window_is_refused():
    cache = StreamCache(spec(sink_frames=0, window_frames=2))
    with pytest.raises(ValueError, match="overruns the window"):
        cache.plan_commit(3)


def test_relayout_window_orders_slots_by_time():
    cache = StreamCache(spec())
    for i in range(4):
        commit(cache, 1 if i else 2, 10 * i)
    commit(cache, 2, 99)  # frames 0,1 sinks; window now holds frames 4, 5 (ring) and 3... check order
    order = [cache.frame_ids[s] for s in cache.window_slots_in_order()]
    slots = cache.relayout_window()
    assert slots == [2, 3, 4]
    assert [cache.frame_ids[s] for s in slots] == order
    assert cache.positions() == [0, 1, 2, 3, 4]


def test_spec_validation_messages():
    with pytest.raises(ValueError, match="group_size 64 must divide tokens_per_frame 1560"):
        CacheSpec(30, 12, 128, 1560, 3, 9, quant="int2", group_size=64)
    with pytest.raises(ValueError, match="quant must be one of"):
        CacheSpec(30, 12, 128, 1560, 3, 9, quant="int3")


def test_wan_frame_bytes():
    s = CacheSpec(30, 12, 128, 1560, 3, 9)
    assert s.dense_frame_bytes == 2 * 30 * 1560 * 1536 * 2  # 274 MiB
    assert s.stream_bytes() == 12 * s.dense_frame_bytes


def test_pool_accounting_refusal_and_release_without_memory():
    s = spec(dtype="bfloat16")
    per = s.stream_bytes()
    pool = CachePool(budget_bytes=2 * per + per // 2, device="meta")
    a = pool.allocate("a", s)
    b = pool.allocate("b", s)
    assert a is not None and b is not None
    assert pool.used_bytes == 2 * per == a.nbytes + b.nbytes
    assert pool.allocate("c", s) is None
    reason = pool.refusal(s)
    assert "needs" in reason and "free" in reason and "2 streams open" in reason
    with pytest.raises(PoolFull, match="KV cache needs"):
        pool.allocate_or_raise("c", s)
    with pytest.raises(ValueError, match="already holds"):
        pool.allocate("a", s)
    assert pool.release("a") == per
    assert pool.release("a") == 0
    assert pool.used_bytes == per and pool.free_bytes == pool.budget_bytes - per
    assert pool.allocate("c", s) is not None
    assert pool.num_streams == 2


def test_pool_counts_per_stream_state_held_elsewhere():
    # e.g. a streaming decoder's cache: counted with the stream's KV cache, given back with it
    s = spec(dtype="bfloat16")
    per, extra = s.stream_bytes(), 1000
    pool = CachePool(budget_bytes=2 * per + extra, device="meta")
    assert pool.allocate("a", s, extra) is not None and pool.used_bytes == per + extra
    assert pool.refusal(s) is None and "decoder state" in pool.refusal(s, extra + 1)
    assert pool.allocate("b", s, extra + 1) is None and pool.allocate("b", s, extra) is None
    assert pool.allocate("b", s) is not None
    assert pool.release("a") == per + extra


def test_shared_memory_reserved_in_the_pool_counts_against_its_caches():
    # e.g. a style's adapter (streamsvc/engine/styles.py): held once, whatever streams use it
    s = spec(dtype="bfloat16")
    per = s.stream_bytes()
    pool = CachePool(budget_bytes=2 * per, device="meta")
    assert pool.reserve("style ink", per // 2) and pool.used_bytes == per // 2
    assert not pool.reserve("style neon", 2 * per) and "style neon" not in pool.reserved
    assert pool.allocate("a", s) is not None and pool.allocate("b", s) is None
    assert "reserved by style ink" in pool.refusal(s)
    with pytest.raises(ValueError, match="already holds"):
        pool.reserve("style ink", 1)
    assert pool.unreserve("style ink") == per // 2 and pool.unreserve("style ink") == 0
    assert pool.allocate("b", s) is not None and pool.num_streams == 2


def test_staging_sits_before_slot_0_and_is_counted():
    s = spec(staging_frames=2)
    cache = StreamCache(s)
    commit(cache, 4, 1.0)  # sinks 0-1, window 2-3
    store = cache.storage
    k, v = store.staged(1, 2, 3)  # [2 own | slots 0, 1, 2]
    assert k.shape == v.shape == (5, s.tokens_per_frame, s.num_heads, s.head_dim)
    assert torch.equal(v[2:], cache.read(1, 3)[1])  # the stored values themselves
    v[:2] = 7.0  # what a forward writes as its own values
    assert torch.equal(store.staged(1, 1, 0)[1][0], v[1])  # fewer own frames: the staging's tail
    assert not (cache.read(1)[1] == 7.0).any() and (cache.read(0)[1] != 7.0).all()  # slots and other layers untouched
    assert v.data_ptr() == store.staged(1, 2, 0)[1].data_ptr() and k.data_ptr() == store.rotated_k[1].data_ptr()  # views
    k[2:] = 5.0  # the rotated copy is not the stored keys
    assert not (cache.read(1)[0] == 5.0).any()
    with pytest.raises(ValueError, match="room for 2"):
        store.staged(0, 3, 1)
    # values' staging (2 frames) and rotated keys of staging + slots (2 + 5), each half a frame's K/V
    assert store.nbytes == s.stream_bytes() == spec().stream_bytes() + s.dense_frame_bytes // 2 * (2 + 7)
    assert sum(t.untyped_storage().nbytes() for t in store.tensors()) == store.nbytes
    with pytest.raises(ValueError, match="staging_frames"):
        spec(staging_frames=1, quant="int2", group_size=3, head_dim=8)


def test_rotated_keys_are_current_until_the_cache_changes():
    cache = StreamCache(spec(staging_frames=2))
    commit(cache, 2, 1.0)
    assert not cache.keys_rotated(2)
    cache.note_rotated(2)
    assert cache.keys_rotated(2) and not cache.keys_rotated(1)  # another prefix was not rotated
    slots = cache.plan_commit(2)  # planning changes nothing
    assert cache.keys_rotated(2)
    for change in (lambda: cache.write(0, slots, *cache.read(0, 2)), lambda: cache.advance(slots),
                   cache.relayout_window, cache.reset, cache.touch):
        cache.note_rotated(2)
        change()
        assert not cache.keys_rotated(2)
