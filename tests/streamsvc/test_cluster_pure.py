"""The cluster's parts that need no Ray: placement over the replicas' routing stats (streamsvc/cluster/placement.py),
the replica's health check, and `streamsvc serve` without --cluster importing no Ray."""

import subprocess
import sys
from types import SimpleNamespace

import pytest

from streamsvc.cluster.placement import ReplicaStats, rank_replicas
from streamsvc.cluster.replica import EngineReplica, ReplicaConfig
from streamsvc.engine import Engine, EngineConfig

KV = 100  # one stream's KV bytes in these tests


def replica(name: str, free: int, streams: int = 0, load: float = 0.0, **kw) -> ReplicaStats:
    return ReplicaStats(replica=name, ready=True, streams=streams, free_kv_bytes=free, stream_kv_bytes=KV,
                        predicted_load=load, utilization_target=0.9, **kw)


def test_the_replica_with_the_most_free_kv_comes_first():
    assert rank_replicas([replica("a", 300), replica("b", 500), replica("c", 400)]) == ["b", "c", "a"]


def test_streams_placed_since_the_stats_count_against_their_replica():
    stats = [replica("a", 500), replica("b", 400)]
    assert rank_replicas(stats, pending={"a": 2}) == ["b", "a"]  # a: 300 free once its 2 pending streams open


def test_replicas_without_room_come_after_those_with_room_and_draining_or_starting_ones_last():
    stats = [replica("full", 50), replica("busy", 900, streams=3, load=0.75), replica("ok", 200),
             replica("drain", 900, draining=True), ReplicaStats(replica="new")]
    # busy: 3 streams at 0.75 load, one more makes 1.0 > 0.9; full: no KV for one more
    assert rank_replicas(stats) == ["ok", "busy", "full", "drain", "new"]


def test_when_none_has_room_the_best_still_comes_first_so_its_admission_refuses_with_the_reason():
    assert rank_replicas([replica("a", 50), replica("b", 80)]) == ["b", "a"]


def test_replicas_seen_failing_are_left_out():
    assert rank_replicas([replica("a", 500), replica("b", 400)], exclude={"a"}) == ["b"]


def test_stats_round_trip_through_the_dict_serve_carries():
    s = replica("a", 500, streams=2, load=0.3, host="10.0.0.2", pid=7, metrics={"streamsvc_chunks_total": 3.0})
    assert ReplicaStats.from_dict(s.to_dict()) == s
    assert ReplicaStats.from_dict({}) is None


def test_check_health_fails_once_the_engine_thread_has_not_turned_for_stall_s():
    now = [100.0]
    engine = Engine(EngineConfig(), on_chunk=lambda *a: None, on_error=lambda *a: None, clock=lambda: now[0])
    # no Ray: the check reads the replica's engine and config only
    replica = SimpleNamespace(config=ReplicaConfig(engine=EngineConfig(), stall_s=10.0),
                              server=SimpleNamespace(engine=engine))
    EngineReplica.check_health(replica)  # not started: building and warming up counts as healthy
    engine.heartbeat_at = 95.0
    EngineReplica.check_health(replica)
    now[0] = 106.0
    with pytest.raises(RuntimeError, match="stalled: its loop has not turned for 11.0 s"):
        EngineReplica.check_health(replica)


def test_serve_without_cluster_imports_no_ray():
    code = ("import sys, streamsvc.cli as c; a = c.build_parser().parse_args(['serve']); "
            "assert a.cluster is None; assert 'ray' not in sys.modules, 'ray imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
