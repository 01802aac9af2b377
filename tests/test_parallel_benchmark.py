"""benchmarks/parallel.py (issue 34's sequence parallel prediction): the CPU smoke on the tiny preset, and its pure
parts (the collectives' bytes, the chunk arithmetic, what admission allows)."""

import json
import math

import pytest

from benchmarks import parallel
from models import PRESETS
from streamsvc.scheduling import SchedulerConfig


def test_the_tiny_preset_on_cpu(capsys):
    assert parallel.main(["--preset", "tiny", "--device", "cpu", "--iters", "1", "--blocks", "2"]) == 0
    out = capsys.readouterr()
    r = json.loads(out.out.splitlines()[-1])
    assert r["bench"] == "parallel" and r["preset"] == "tiny" and r["weights"] == "random"
    assert r["ks"] == [1, 2]  # --weights random tiny: 2 heads
    assert set(r["skipped"]) == {"4", "8"} and "does not divide the 2 heads" in r["skipped"]["4"]
    assert r["bus_gbps"] == 329.0 and "KINDS.md" in r["bus_source"]
    assert r["approx_options"] == ["steps-3", "commit-reuse"]  # fp8-linears pays only on CUDA
    assert r["validation"]["forward_ms"] > 0 and r["validation"]["ratio"] > 0
    one, two = r["rows"]
    assert one["bytes"]["per_forward"] == 0 and one["comm_ms"] == 0  # one rank: no collective
    assert two["comm_write_ms"] == 0 and not r["keys_rope_on_shard"]  # keys cross before RoPE: writes cost no traffic
    # k = 2: each rank sends half of its 24 tokens x 64 values of q, k, v and of the output (bf16), per block,
    # and the other rank's half of the flow (24 tokens x 256 values, float32) once a forward
    assert two["bytes"]["a2a_qkv"] == 3 * 24 * 64 * 2 // 2 and two["bytes"]["a2a_out"] == 24 * 64 * 2 // 2
    assert two["bytes"]["per_forward"] == 2 * 4 * 1536 + 24 * 256 * 4
    for row in (one, two):
        s = row["shard_ms"]["bf16"]
        assert all(s[p] > 0 for p in ("blocks", "pre", "attention", "post", "outer"))
        ex, ap = row["exact"], row["approximate"]
        fwd = s["forward"] + row["comm_ms"]
        dit = 5 * fwd + s["rotate"] + s["write"] + row["comm_write_ms"]  # 4 steps + commit
        assert ex["dit_chunk_ms"] == pytest.approx(dit, abs=0.2)
        assert ap["dit_chunk_ms"] == pytest.approx(3 * fwd + s["rotate"] + s["write"] + row["comm_write_ms"], abs=0.2)
        for t in (ex, ap):
            assert t["chunk_ms"] == pytest.approx(t["dit_chunk_ms"] + r["decode_ms"], abs=0.2)
            assert t["live"] == (t["chunk_ms"] < 750) and t["margin_ms"] == pytest.approx(750 - t["chunk_ms"], abs=0.2)
            assert t["refused_next"] or t["streams"] == 64  # the next stream's refusal with its reason, or the cap
            if t["load"] > 0.9:
                assert t["streams"] == 0 and "compute" in t["refused_next"]
    assert "One rank's share" in out.err and "Predicted chunk latency" in out.err


def test_the_issues_figures_for_14b():
    """Issue 34: at 14B, k = 4, an all-to-all moves about 9 MB per rank, 36 MB a block, 1.4 GB a forward."""
    b = parallel.collective_bytes(PRESETS["wan2.1-14b"], 4680, 4)
    assert b["a2a_out"] == 1170 * 5120 * 2 * 3 // 4 == 8_985_600
    assert b["per_block"] == 4 * 8_985_600
    assert 1.43e9 < b["per_forward"] < 1.45e9
    assert b["collectives_per_forward"] == 81
    assert parallel.collective_bytes(PRESETS["wan2.1-14b"], 4680, 1)["per_forward"] == 0
    assert parallel.collective_ms(329_000_000, 1, 329.0, 20.0) == pytest.approx(1.02)


def test_chunk_arithmetic_and_admission():
    assert parallel.chunk_ms(10, 1, 0.5, 2, 0.25, 4, False) == 4 * 12 + 1 + 12 + 0.5 + 0.25
    assert parallel.chunk_ms(10, 1, 0.5, 2, 0.25, 3, True) == 3 * 12 + 1 + 0.5 + 0.25
    # 200 ms chunks at 1.33 chunks/s: 0.27 a stream, so 3 under the 0.9 target (the start rule would allow 5)
    n, why = parallel.admitted(0.2, 4, 0.04, 0.001, SchedulerConfig())
    assert n == 3 and why.startswith("compute")
    n, why = parallel.admitted(0.7, 4, 0.1, 0.001, SchedulerConfig())
    assert n == 0 and "compute" in why
    assert parallel.admitted(0.05, 4, 0.01, 0.001, SchedulerConfig(), limit=5) == (5, None)
    assert math.isclose(parallel.CHUNK_FRAMES / parallel.FPS, 0.75)
