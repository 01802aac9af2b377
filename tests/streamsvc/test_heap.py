"""The serving process's heap (streamsvc/engine/heap.py): closed streams' cycles collected soon, once a second at
most; long-lived objects frozen out of the collector."""

import asyncio
import gc
import weakref

import pytest

from streamsvc.engine.heap import Heap


class Node:
    """Half of a reference cycle, as a closed stream's session and viewers are."""

    other: "Node"


def cycle() -> weakref.ref:
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


@pytest.fixture
def no_automatic_collection():
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


async def until(predicate, timeout_s: float = 5.0) -> bool:
    for _ in range(int(timeout_s / 0.01)):
        if predicate():
            return True
        await asyncio.sleep(0.01)
    return predicate()


async def test_a_tidy_collects_cycles_once_the_close_has_settled_and_closes_close_together_share_one(no_automatic_collection):
    heap = Heap(settle_s=0.2, every_s=0.0)
    ref = cycle()
    for _ in range(3):
        heap.tidy_soon()
    assert ref() is not None and heap.tidies == 0  # not at the close: what it lets go is let go a little later
    assert await until(lambda: ref() is None)
    await asyncio.sleep(0.3)
    assert heap.tidies == 1


async def test_tidies_come_at_most_once_every_every_s(no_automatic_collection):
    now = [100.0]  # the heap's clock, moved by hand: how late this loop wakes does not decide what is checked
    heap = Heap(settle_s=0.0, every_s=1.0, clock=lambda: now[0])
    heap.tidy_soon()
    assert await until(lambda: heap.tidies == 1)
    ref = cycle()
    now[0] += 0.25
    heap.tidy_soon()  # a quarter second after the first: waits out the rest of the second
    loop = asyncio.get_running_loop()
    assert heap._pending is not None and heap._pending.when() - loop.time() > 0.7
    assert heap.tidies == 1 and ref() is not None
    assert await until(lambda: heap.tidies == 2)
    assert ref() is None
    now[0] += 5.0
    heap.tidy_soon()  # long after: settle_s (0) only
    assert heap._pending is not None and heap._pending.when() - loop.time() <= 0.01


async def test_a_cancelled_tidy_does_not_run(no_automatic_collection):
    heap = Heap(settle_s=0.1)
    heap.tidy_soon()
    heap.cancel()
    await asyncio.sleep(0.3)
    assert heap.tidies == 0


def test_freezing_keeps_what_is_alive_out_of_later_collections():
    heap = Heap()
    try:
        heap.freeze()
        assert gc.get_freeze_count() > 0
        ref = cycle()  # made after the freeze: a collection still frees it
        gc.collect()
        assert ref() is None
    finally:
        gc.unfreeze()
