"""benchmarks/encode_input.py runs each encoder chunk by chunk at a preset's size and ends with one JSON line
(the GPU figures come from the lead's runs at wan2.1-1.3b sizes; here the tiny preset on the CPU)."""

import json

import pytest

from benchmarks.encode_input import main


@pytest.mark.parametrize("encoder, extra, state", [
    ("builtin", [], 0),
    ("taehv", ["--frames-per-chunk", "1"], 3 * 64 * (64 * 64 + 32 * 32 + 16 * 16) * 4),  # 3 MemBlocks of 64 channels at 1/2, 1/4, 1/8, fp32
    ("wan", ["--vae-base-dim", "8", "--frames-per-chunk", "1"], None),  # one latent frame a chunk: 1, then 4 frames
])
def test_encode_input_reports_per_chunk_ms_and_the_state(capsys, encoder, extra, state):
    assert main(["--encoder", encoder, "--chunks", "2", "--warmup", "0", "--threads", "1", *extra]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["benchmark"] == "encode_input" and out["encoder"] == encoder and (out["width"], out["height"]) == (128, 128)
    assert out["chunks"] == 2 and 0 < out["chunk_ms_median"] <= out["chunk_ms_p90"] and out["first_chunk_ms"] > 0
    assert out["state_bytes"] == state if state is not None else out["state_bytes"] > 0
