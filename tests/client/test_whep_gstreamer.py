"""GStreamer's webrtcbin (not our code) plays a WHEP stream (issue 36): benchmarks/whep_gstreamer.py drives a player
of PyGObject and the system's GStreamer (Debian 12: python3-gi, gir1.2-gst-plugins-bad-1.0; .ci/run installs them)
that POSTs its offer, plays and DELETEs. Skipped without them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SYSTEM_PYTHON = "/usr/bin/python3"


def _has_gst_webrtc() -> bool:
    probe = ("import gi; gi.require_version('Gst', '1.0'); gi.require_version('GstWebRTC', '1.0'); "
             "from gi.repository import Gst, GstWebRTC; Gst.init(None); "
             "assert Gst.ElementFactory.find('webrtcbin') and Gst.ElementFactory.find('avdec_h264')")
    try:
        return subprocess.run([SYSTEM_PYTHON, "-c", probe], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


pytestmark = [pytest.mark.slow, pytest.mark.skipif(not _has_gst_webrtc(), reason=(
    "the system's Python has no GStreamer WebRTC (apt-get install -y python3-gi gir1.2-gst-plugins-bad-1.0 "
    "gstreamer1.0-plugins-bad gstreamer1.0-libav)"))]


def test_a_gstreamer_whep_player_plays_and_deletes():
    seconds = 4
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "whep_gstreamer.py"), "--seconds", str(seconds)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["status"] == 201 and result["error"] is None, result
    assert result["frames"] >= 16 * seconds * 0.6 and result["size"] == [128, 128], result  # the tiny model's 16 fps
    assert result["delete"] == 200 and result["streams_left"] == 0, result
