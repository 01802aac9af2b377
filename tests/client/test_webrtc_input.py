"""A Python viewer's camera over WebRTC (issue 35): client/webrtc_client.py sends its ClientConfig.input (a scene of
models/scenes.py) as a camera track (client/rtc_camera.py), its stream's input, the server reads it
(streamsvc/inputs/rtc.py) and the client measures glass-to-glass latency from the chunk headers' capture_ms, in its own
clock."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from client.viewer import ClientConfig
from client.webrtc_client import WebRtcClient
from models.scenes import Scene, Timeline
from streamsvc.engine.config import EngineConfig
from streamsvc.viewers.server import Server, ServerConfig
from streamsvc.wire.rtc import WebRtcConfig

pytestmark = pytest.mark.slow
LOOPBACK = ("127.0.0.1",)


async def test_a_python_viewers_camera_is_the_streams_input_and_it_measures_glass_to_glass():
    server = Server(EngineConfig(weights="builtin"), ServerConfig(port=0, webrtc=WebRtcConfig(ice_addresses=LOOPBACK)))
    await asyncio.wait_for(server.start(), 60)
    try:
        video = Timeline(((0, Scene("red", "ball", motion="right"), "a red ball moving right"),), 128, 128).render(
            range(128)).numpy()
        config = ClientConfig(prompt="a blue ball", seed=1, input=lambda i: video[i % len(video)], strength=0.6)
        client = WebRtcClient(f"ws://127.0.0.1:{server.port}/ws", config)
        async with client:
            assert client.ready.input and client.ready.strength == pytest.approx(0.625)  # snapped to the schedule
            session = server.sessions[client.ready.stream_id]
            ok = await client.wait_until(lambda: len(client.g2g.samples) >= 48, 30)
            stats = session.input.stats()
            transport = server.webrtc[session.steerer.viewer_id]
            read, held = transport.camera.stats, transport.camera.held_s
        result = client.result()
    finally:
        await asyncio.wait_for(server.stop(), 30)
    g2g = np.array(result.glass_to_glass)
    print(f"python camera: {result.input_sent} frames sent, {read.frames} read by the server ({read.sender_clock} "
          f"timed by the sender's reports), input {stats}; {len(g2g)} frames played from input, "
          f"{result.input_missing} chunks missing input; glass-to-glass p50 {np.median(g2g):.2f} s, p95 "
          f"{np.percentile(g2g, 95):.2f} s; the first chunk held {held} s; stalls "
          f"{result.playback.stalls if result.playback else None}")
    assert ok, (len(g2g), stats)
    assert read.sender_clock > 0 and read.frames >= 0.8 * result.input_sent - 20, (read, result.input_sent)
    # one host, one clock: glass-to-glass is positive, at least a chunk's duration (its last input frame must come
    # before it starts) and within a few seconds
    chunk_s = client.ready.chunk_frames / client.ready.fps
    assert np.all(g2g > 0) and np.median(g2g) >= 0.5 * chunk_s and np.percentile(g2g, 95) < 5.0, g2g


async def test_a_wide_camera_at_30_fps_is_cropped_and_thinned_to_the_streams_frames(monkeypatch):
    """A camera of another aspect (16:9, 320x180) at 30 fps into a 16 fps stream of a square model: the server crops
    and scales each frame and keeps one a frame slot (the others dropped and counted); every chunk still has input."""
    from streamsvc.inputs import frames as inputs

    server = Server(EngineConfig(weights="builtin"), ServerConfig(port=0, webrtc=WebRtcConfig(ice_addresses=LOOPBACK)))
    await asyncio.wait_for(server.start(), 60)
    shapes = set()
    take = inputs.InputFrames.take

    def watching_take(self, first, n):
        got = take(self, first, n)
        if got is not None:
            shapes.add(got.frames.shape[1:])
        return got

    monkeypatch.setattr(inputs.InputFrames, "take", watching_take)
    try:
        wide = Timeline(((0, Scene("red", "ball", motion="right"), "a red ball moving right"),), 180, 320).render(
            range(64)).numpy()
        config = ClientConfig(prompt="a blue ball", seed=2, input=lambda i: wide[i % len(wide)])
        client = WebRtcClient(f"ws://127.0.0.1:{server.port}/ws", config, camera_fps=30)
        async with client:
            session = server.sessions[client.ready.stream_id]
            ok = await client.wait_until(lambda: len(client.g2g.samples) >= 32, 30)
            stats = session.input.stats()
        result = client.result()
    finally:
        await asyncio.wait_for(server.stop(), 30)
    print(f"wide camera at 30 fps: sent {result.input_sent}, input {stats}, taken frames {shapes}")
    assert ok and shapes == {(128, 128, 3)}, (stats, shapes)
    assert stats["received"] >= 60 and stats["dropped"] >= 0.3 * stats["received"], stats  # ~14 of every 30
    assert result.input_missing == 0 and stats["decode_errors"] == 0
