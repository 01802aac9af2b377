"""The engine as rank 0 of a group of two gloo ranks on the CPU (streamsvc/engine/lockstep.py), in this process with
one spawned worker: what the worker holds follows rank 0's streams, a stream closed while paused included.
"""

from __future__ import annotations

import pytest

from streamsvc.engine.config import EngineConfig
from streamsvc.engine.engine import Engine
from streamsvc.engine.group import GroupConfig
from streamsvc.scheduling import SchedulerConfig
from tests.streamsvc.test_engine import Collector


@pytest.fixture(scope="module")
def group_engine():
    got = Collector()
    cfg = EngineConfig(preset="tiny", device="cpu", weights="random", degrade=False, warmup_chunks=2,
                       scheduler=SchedulerConfig(buffer_cap_s=2.0, max_batch=1),
                       group=GroupConfig(2, ("cpu", "cpu"), timeout_s=20.0))
    eng = Engine(cfg, got.on_chunk, got.on_error)
    eng.start().result(timeout=120)
    try:
        yield eng, got
    finally:
        eng.stop(timeout=30)


@pytest.mark.slow
def test_a_stream_closed_while_paused_leaves_nothing_parked_on_the_workers(group_engine):
    eng, got = group_engine
    gen = eng.gen
    assert gen.worker_holdings() == [{"streams": 0, "parked": 0, "parked_bytes": 0}]
    for sid in ("a", "b"):
        assert eng.open_stream(sid, "a red ball", seed=1, fps=16).result(timeout=20).accepted
    got.wait(lambda g: len(g.chunks.get("a", [])) >= 1 and len(g.chunks.get("b", [])) >= 1, timeout=60)
    paused = eng.pause("a").result(timeout=30)
    [held] = gen.worker_holdings()
    # the worker parked its own copy (its heads of the cache: a share of rank 0's bytes)
    assert (held["streams"], held["parked"]) == (1, 1) and 0 < held["parked_bytes"] <= paused.nbytes
    assert eng.close_stream("a").result(timeout=20) is True  # closed while paused
    assert (eng.stats().parked_streams, eng.stats().parked_bytes) == (0, 0)
    assert gen.worker_holdings() == [{"streams": 1, "parked": 0, "parked_bytes": 0}]
    n = len(got.chunks["b"])
    got.wait(lambda g: len(g.chunks["b"]) >= n + 2, timeout=60)  # the group goes on with b
    assert eng.close_stream("b").result(timeout=20) is True
    assert gen.worker_holdings() == [{"streams": 0, "parked": 0, "parked_bytes": 0}]
    assert not got.errors and gen.failure is None
