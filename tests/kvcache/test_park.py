"""Parking a stream's cache in host memory: the round trip, the pool's accounting, the host budget."""

import pytest
import torch

from kvcache import CachePool, HostCopier, ParkBudget, StreamCache, park_cache, restore_cache
from tests.kvcache.test_cache import commit, spec


@pytest.mark.parametrize("quant", ["none", "int4"])
def test_a_parked_cache_restores_into_a_fresh_one_from_the_pool_exactly(quant):
    s = spec(num_heads=2, head_dim=8, tokens_per_frame=4, sink_frames=1, window_frames=3, quant=quant, residual_frames=1)
    pool = CachePool(10 * s.stream_bytes() + 100)
    cache = pool.allocate_or_raise("a", s, extra_bytes=100)
    assert pool.used_bytes == s.stream_bytes() + 100
    for i in range(5):  # the ring has turned: head 1
        commit(cache, 1, 10.0 * i)
    before = [cache.read(layer) for layer in range(s.num_layers)]
    before = [(k.clone(), v.clone()) for k, v in before]
    copier = HostCopier("cpu")
    parked = park_cache(cache, copier)
    assert parked.moved.done() and parked.nbytes == s.stream_bytes() == cache.storage.nbytes
    assert pool.release("a") == s.stream_bytes() + 100 and pool.used_bytes == 0  # the bytes go back on park
    del cache
    fresh = pool.allocate_or_raise("a", s, extra_bytes=100)  # and are taken again on restore
    assert pool.used_bytes == s.stream_bytes() + 100
    restore_cache(parked, fresh, copier).wait()
    assert (fresh.head, fresh.window_filled, fresh.frames_seen, fresh.frame_ids) == (1, 3, 5, [0, 4, 2, 3])
    assert fresh.positions() == [0, 3, 1, 2]
    for layer, (k, v) in enumerate(before):
        k2, v2 = fresh.read(layer)
        assert torch.equal(k, k2) and torch.equal(v, v2)
    commit(fresh, 1, 99.0)  # it goes on as the parked one would have: the oldest window frame is overwritten
    assert fresh.frame_ids == [0, 4, 5, 3]


def test_a_cache_restores_only_into_one_of_its_spec():
    copier = HostCopier("cpu")
    parked = park_cache(StreamCache(spec()), copier)
    with pytest.raises(ValueError, match="same spec"):
        restore_cache(parked, StreamCache(spec(window_frames=4)), copier)


def test_park_budget_accounting_and_refusal_with_the_numbers():
    budget = ParkBudget(3 * 2**30)
    assert budget.reserve("a", 2 * 2**30) is None
    assert (budget.used_bytes, budget.free_bytes, budget.num_streams) == (2 * 2**30, 2**30, 1)
    why = budget.reserve("b", 2 * 2**30)
    assert why == ("parking needs 2.00 GiB of host memory but the park budget has 1.00 GiB free of 3.00 GiB "
                   "(1 streams parked); resume or close a parked stream, or raise --park-budget-gib")
    assert not budget.holds("b") and budget.used_bytes == 2 * 2**30
    assert budget.reserve("b", 2**30) is None and budget.free_bytes == 0
    with pytest.raises(ValueError, match="already holds"):
        budget.reserve("b", 1)
    assert budget.release("a") == 2 * 2**30 and budget.release("a") == 0
    assert budget.used_bytes == 2**30
    with pytest.raises(ValueError):
        ParkBudget(-1)
    assert ParkBudget(0).refusal(1) is not None and ParkBudget(0).refusal(0) is None


def test_a_small_park_budget_is_told_in_the_unit_its_size_calls_for():
    """A budget of a few MiB or bytes read "needs 0.00 GiB ... 0.00 GiB free of 0.00 GiB" (issue 33)."""
    budget = ParkBudget(96 * 2**20)
    assert budget.reserve("a", 90 * 2**20) is None
    assert budget.refusal(int(6.5 * 2**20)) == (
        "parking needs 6.50 MiB of host memory but the park budget has 6.00 MiB free of 96.0 MiB (1 streams parked); "
        "resume or close a parked stream, or raise --park-budget-gib")
    assert ParkBudget(1000).refusal(1001).startswith("parking needs 1001 bytes of host memory but the park budget "
                                                     "has 1000 bytes free of 1000 bytes")


def test_a_forced_reservation_is_held_beyond_the_budget_and_says_what_it_overrode():
    budget = ParkBudget(1000)
    assert budget.reserve("a", 600) is None
    refusal = budget.refusal(700)
    assert refusal is not None
    assert budget.reserve("b", 700, force=True) == refusal  # bytes already copied to the host: counted anyway
    assert (budget.used_bytes, budget.free_bytes, budget.num_streams) == (1300, -300, 2)
    assert budget.reserve("c", 1) is not None and not budget.holds("c")
    assert budget.release("b") == 700 and budget.free_bytes == 400
