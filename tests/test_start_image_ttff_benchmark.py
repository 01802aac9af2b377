"""benchmarks/start_image_ttff.py on made-up load test runs: the rounds alternate with and without the image, the
image goes to the load test, and the medians are of each side's TTFF p50."""

import json
from types import SimpleNamespace

from benchmarks import start_image_ttff as bench


def test_rounds_alternate_and_the_medians_are_each_sides(monkeypatch, capsys):
    calls = []

    def fake_run(cmd, capture_output, text, timeout):
        with_image = "--start-image" in cmd
        calls.append(with_image)
        if with_image:
            assert open(cmd[cmd.index("--start-image") + 1], "rb").read().startswith(b"\x89PNG")
        out = cmd[cmd.index("--json") + 1]
        p50 = (0.5 if with_image else 0.4) + 0.01 * len(calls)
        report = {"admitted": 4, "ttff_s": {"p50": p50, "p95": p50 + 0.1, "max": p50 + 0.2}, "stalls": {"count": 0}}
        with open(out, "w") as f:
            json.dump(report, f)
        return SimpleNamespace(returncode=0, stdout="", stderr="")

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    result = bench.main(["--rounds", "3", "--server-arg=--kv-quant=int4"])
    assert calls == [False, True, True, False, False, True]
    # without: 0.41, 0.44, 0.45 -> 0.44; with: 0.52, 0.53, 0.56 -> 0.53
    assert result["ttff_p50_median_s"] == {"no_image": 0.44, "image": 0.53}
    assert [r["round"] for r in result["runs"]] == [0, 0, 1, 1, 2, 2]
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last) == result
