"""benchmarks/fidelity.py on the tiny preset (the CI smoke of the drift table) and the --fidelity plumbing of
benchmarks/service.py (pure: the flags each tier's server and generator benchmark get)."""

import json

import pytest

from benchmarks import fidelity as fidelity_bench
from benchmarks import service


def test_fidelity_table_on_the_tiny_preset(capsys):
    code = fidelity_bench.main(["--preset", "tiny", "--device", "cpu", "--chunks", "4", "--timed-chunks", "1",
                                "--window-frames", "6", "--variants", "quantized,commit-reuse,steps-3"])
    assert code == 0
    out = capsys.readouterr().out.splitlines()
    result = json.loads(out[-1])
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows) == ["exact", "quantized", "commit-reuse", "steps-3"]  # exact first: the reference
    assert rows["exact"]["rel_err_last"] == 0 and rows["exact"]["forwards_per_chunk"] == 5
    assert rows["commit-reuse"]["forwards_per_chunk"] == 4 and rows["commit-reuse"]["commit_ms"] == 0
    assert rows["steps-3"]["steps"] == 3 and rows["steps-3"]["tier"] == "approximate"
    assert rows["quantized"]["options"] == ["fp8-linears", "int8-attention"] and rows["quantized"]["tier"] == "quantized"
    for r in list(rows.values())[1:]:
        assert 0 < r["rel_err_last"] and r["psnr_db"] > 0 and r["dit_chunk_ms"] > 0
    assert rows["quantized"]["rel_err_last"] < rows["steps-3"]["rel_err_last"]
    assert any(line.lstrip().startswith("variant") for line in out)  # the table


def test_service_sweeps_each_tier_with_its_flags():
    args = service.parse_args(["--fidelity", "exact,approximate", "--start", "2", "--max-streams", "4"])
    assert args.tiers == ["exact", "approximate"] and args.start == 2
    assert service.tier_args("quantized", None) == ["--fidelity", "quantized"]
    assert service.tier_args(None, "fp8-linears") == ["--speed-options", "fp8-linears"]
    flags = service.bench_flags(["--compile", "--fidelity", "approximate", "--speed-options", "steps-2"], "cuda")
    assert flags == ["--compile", "--fidelity", "approximate", "--speed-options", "steps-2"]
    assert service.parse_args([]).tiers == [None]


def test_service_sweeps_each_latency_mode_and_times_its_chunk_size():
    args = service.parse_args(["--latency", "default,low", "--fidelity", "exact"])
    assert args.latencies == ["default", "low"] and args.tiers == ["exact"]
    assert service.parse_args([]).latencies == [None]
    assert service.bench_flags(["--latency", "low"], "cpu") == ["--chunk-latent-frames", "1"]
    assert service.bench_flags(["--latency", "low", "--chunk-latent-frames", "3"], "cpu") == ["--chunk-latent-frames", "3"]
    assert service.bench_flags(["--latency", "default"], "cpu") == []
    with pytest.raises(SystemExit):
        service.parse_args(["--latency", "lowest"])


def test_service_knows_the_steps_a_tier_serves_without_the_benchmark():
    assert service.planned_steps([], "cpu") == 4
    assert service.planned_steps(["--fidelity", "approximate"], "cuda:0") == 3
    assert service.planned_steps(["--fidelity", "approximate", "--speed-options", "steps-2,commit-reuse"], "cpu") == 2
