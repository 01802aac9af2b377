"""Debian's whip-client (GStreamer's webrtcbin, not our code) publishes a .y4m rendered from models/scenes.py into a
stream's input over this host (issue 36): benchmarks/whip_client.py, once with its candidates in the offer (-n) and
once trickling (its PATCHes get 405 and it connects with what its offer has). Skipped without whip-client
(.ci/run installs simple-whip-client and the GStreamer plugins) or a C compiler (the UPnP stand-in it builds)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("whip-client") is None, reason="whip-client is missing (apt-get install -y "
                       "simple-whip-client gstreamer1.0-plugins-bad gstreamer1.0-plugins-ugly gstreamer1.0-libav)"),
    pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler"),
]
ROOT = Path(__file__).resolve().parents[2]


def test_debians_whip_client_feeds_a_streams_input():
    seconds = 4
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "whip_client.py"), "--seconds", str(seconds)],
                          cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    frames = result["y4m_frames"]
    assert frames == seconds * 30
    no_trickle, trickle = result["runs"]
    for run in (no_trickle, trickle):
        assert run["exit"] == 0 and run["created_s"] is not None, done.stdout[-3000:]
        assert run["input_received"] >= 0.8 * frames and run["decode_errors"] == 0, done.stdout[-3000:]
    assert trickle["patch_405_lines"] >= 1  # it trickled, was refused, and published all the same
    assert result["ok"]
