"""The player's camera as the stream's input, in Chromium (issue 35's must-show): a fake camera plays a Y4M rendered
from models/scenes.py (a red ball moving right); the page turns the camera on (its button), starts a stream of the
built-in model (its input adapter follows an input video) with input under the prompt "a blue ball", and shows glass-to-glass latency in its overlay. Frames
the page shows (drawn from its <video> into a canvas as they are presented, read with client/pixels.py) are each
matched, by their chunk header's capture_ms, to the input frame the server gave the model for them.

- test_the_player_sends_its_camera_...: the camera reaches the stream (timed by Chromium's RTCP sender reports), the
  frames on screen were made from it, and glass-to-glass is shown and plausible;
- test_the_stream_follows_the_camera: the object in each frame shown sits where the ball was in its input frame
  (mean error <= FOLLOWS_PX), in the prompt's colour.

Needs /usr/bin/chromium and playwright (skipped without either), like tests/client/test_browser.py. Bounded: every
wait has a timeout, and the whole test a minute or so.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import re
import shutil

import numpy as np
import pytest

from client.pixels import read_frame
from client.rtc_camera import write_y4m
from streamsvc.engine.config import EngineConfig

CHROMIUM = "/usr/bin/chromium"
playwright_api = pytest.importorskip("playwright.async_api", reason="playwright is not installed (pip install playwright)")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which(CHROMIUM) is None, reason=f"{CHROMIUM} is missing (apt-get install -y chromium)"),
]

from tests.client.test_browser import FLAGS, serving  # noqa: E402 (after the skips: it imports playwright too)

FPS = 16
INPUT_FRAMES = 128  # the ball moves 3 px a frame: after 128 frames it is back where it started (the file loops)
PROMPT = "a blue ball"
STRENGTH = 0.625  # snapped to the built-in model's schedule (1.0, 0.83, 0.625, 0.357)
FOLLOWS_PX = 8.0
"""Mean distance (px) between the object in a generated frame and the ball in its input frame that counts as
following. The ball crosses the 128-px frame in 43 frames: a stream that ignored the camera (a still blue ball
at the centre) is off by 32 px on average; one a frame late, by 3."""
GRAB = 32  # generated frames read off the page


def input_y4m(path, width: int, height: int):
    """The fake camera's file: a red ball moving right on dark gray, rendered by models/scenes.py at the model's size."""
    from models.scenes import Scene, Timeline

    timeline = Timeline(((0, Scene("red", "ball", motion="right"), "a red ball moving right"),), height, width)
    return write_y4m(path, timeline.render(range(INPUT_FRAMES)).numpy(), FPS)


@contextlib.asynccontextmanager
async def chromium_with_camera(tmp_path, y4m):
    flags = FLAGS + ["--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
                     f"--use-file-for-fake-video-capture={y4m}"]
    async with playwright_api.async_playwright() as pw:
        browser = await pw.chromium.launch_persistent_context(str(tmp_path / "profile"), executable_path=CHROMIUM,
                                                              headless=True, args=flags)
        try:
            yield browser
        finally:
            await browser.close()


def _wrapped_dx(a: float, b: float, size: int) -> float:
    return (a - b + size / 2) % size - size / 2


_SESSION: dict = {}  # the one browser session both tests read (run by whichever comes first)


async def _camera_session(tmp_path, monkeypatch) -> dict:
    """Chromium's fake camera into a stream of the built-in model: the frames grabbed off the page, the input frames
    the server took (by capture_ms), the page's glass-to-glass figures and overlay, the input's counts."""
    if _SESSION:
        return _SESSION
    from streamsvc.inputs import frames as inputs

    taken: dict[float, np.ndarray] = {}  # capture_ms -> the input frame (model size) a chunk took for it
    take = inputs.InputFrames.take

    def recording_take(self, first, n):
        got = take(self, first, n)
        if got is not None:
            for capture, frame in zip(got.capture_ms, got.frames):
                taken[capture] = np.array(frame)
        return got

    monkeypatch.setattr(inputs.InputFrames, "take", recording_take)
    async with serving(EngineConfig(weights="builtin")) as (server, base):  # its input adapter follows
        cfg = server.engine.gen.model_cfg
        y4m = input_y4m(tmp_path / "camera.y4m", cfg.width, cfg.height)
        async with chromium_with_camera(tmp_path, y4m) as browser:
            page = await browser.new_page()
            await page.goto(f"{base}/?autostart=0&prompt={PROMPT.replace(' ', '%20')}", timeout=15_000)
            assert await page.is_enabled("#camera")  # http://127.0.0.1 is a secure context: the camera is offered
            await page.click("#camera")
            await page.wait_for_function("player.cameraOn", timeout=10_000)
            assert await page.is_visible("#preview") and await page.evaluate(
                "document.getElementById('camera-select').options.length") >= 1
            await page.evaluate(f"""() => {{ const s = document.getElementById('strength');
                s.value = '{STRENGTH}'; s.dispatchEvent(new Event('change')); }}""")
            await page.press("#prompt", "Enter")  # Start: with the camera on, the stream asks for input
            await page.wait_for_function("player.phase === 'playing' && player.input", timeout=20_000)
            strength = await page.evaluate("player.strength")
            await page.wait_for_function("player.glassToGlass.length >= 16", timeout=30_000)
            frames = await asyncio.wait_for(page.evaluate(f"player.grab({GRAB})"), 20)
            g2g = await page.evaluate("player.glassToGlass")
            await page.wait_for_timeout(300)  # the overlay redraws every 250 ms
            overlay = await page.inner_text("#o-g2g")
            stream_id = await page.evaluate("player.streamId")
            stats = server.sessions[stream_id].input.stats()
            rtc = server.webrtc[server.sessions[stream_id].steerer.viewer_id].camera
            # the slider steers live: set_strength, acked with the value snapped to the schedule, shown by the page
            await page.evaluate("""() => { const s = document.getElementById('strength');
                s.value = '0.4'; s.dispatchEvent(new Event('change')); }""")
            await page.wait_for_function("player.strength !== null && player.strength < 0.5", timeout=10_000)
            steered = (await page.evaluate("player.strength"), await page.inner_text("#strength-value"))
            # the camera off (replaceTrack(null)) and on again (replaceTrack(track)), no renegotiation: the stream goes
            # on from the prompt alone ("missing") and picks the camera up again
            await page.click("#camera")
            await page.wait_for_function("player.inputOnScreen === 'missing'", timeout=15_000)
            await page.click("#camera")
            await page.wait_for_function("player.cameraOn && player.inputOnScreen === 'frames'", timeout=15_000)
            gap = {"missing": server.sessions[stream_id].input.stats()["missing_chunks"], "phase": await page.evaluate(
                "player.phase"), "stream": await page.evaluate("player.streamId") == stream_id}

    readings = []  # (output reading, input reading, width, height) of each grabbed frame made from input
    for f in frames:
        if f["input"] == "frames" and f["captureMs"] in taken:
            rgb = np.frombuffer(base64.b64decode(f["rgb"]), np.uint8).reshape(f["height"], f["width"], 3)
            readings.append((read_frame(rgb), read_frame(taken[f["captureMs"]]), f["width"], f["height"]))
    errors = [float(np.hypot(_wrapped_dx(out.centre[0], given.centre[0], w), _wrapped_dx(out.centre[1], given.centre[1], h)))
              if out.centre is not None else float("inf") for out, given, w, h in readings]
    _SESSION.update(frames=frames, readings=readings, errors=errors, g2g=g2g, overlay=overlay, stats=stats,
                    strength=strength, steered=steered, gap=gap, read=rtc.stats, clock_reports=rtc.clock.reports, held_s=rtc.held_s)
    print(f"camera in Chromium: {len(readings)} of {len(frames)} frames grabbed were made from input; object position "
          f"error mean {np.mean(errors):.1f} px (median {np.median(errors):.1f}); colours "
          f"{sorted({str(out.colour) for out, _, _, _ in readings})}; glass-to-glass p50 {np.median(g2g) / 1000:.2f} s, "
          f"max {max(g2g) / 1000:.2f} s (overlay {overlay}); first chunk held {rtc.held_s} s; camera {rtc.summary()}; "
          f"input {stats}")
    return _SESSION


async def test_the_player_sends_its_camera_as_the_streams_input_and_shows_glass_to_glass(tmp_path, monkeypatch):
    got = await _camera_session(tmp_path, monkeypatch)
    assert got["strength"] == pytest.approx(STRENGTH)  # the server's snapped value, from ready
    snapped = min((1.0, 0.8333, 0.625, 0.3571), key=lambda s: abs(s - 0.4))  # the built-in model's schedule
    assert got["steered"][0] == pytest.approx(snapped, abs=1e-3) and got["steered"][1] == f"{got['steered'][0]:.3f}"
    assert got["gap"] == {"missing": got["gap"]["missing"], "phase": "playing", "stream": True} and \
        got["gap"]["missing"] >= 1, got["gap"]  # the camera went off and on within the same stream
    assert got["read"].sender_clock > 0 and got["clock_reports"] > 0  # Chromium's RTCP sender reports timed them
    assert got["stats"]["received"] >= 32 and got["stats"]["decode_errors"] == 0, got["stats"]
    # the frames on screen were made from the camera: each one's header echoes the capture time of an input frame
    # the server gave the model, a red ball moving right
    assert len(got["readings"]) >= GRAB // 2, [f["input"] for f in got["frames"]]
    assert all(given.colour == "red" and given.centre is not None for _, given, _, _ in got["readings"])
    assert len({round(given.centre[0]) for _, given, _, _ in got["readings"]}) > 4  # it moved under the grabs
    # glass-to-glass: one host, one clock (the capture times are Chromium's own, through its sender reports): in a
    # steady stream a chunk's last capture + the input latency (the first chunk plays then), within a few seconds
    g2g = np.array(got["g2g"]) / 1000
    assert np.all(g2g > 0) and np.median(g2g) > 0.75 and np.percentile(g2g, 95) < 5.0, g2g
    assert re.fullmatch(r"\d+\.\d\d s", got["overlay"]), got["overlay"]


async def test_the_stream_follows_the_camera(tmp_path, monkeypatch):
    """The object in each generated frame sits where the ball was in the input frame it restyles (mean error at most
    FOLLOWS_PX), in the prompt's colour."""
    got = await _camera_session(tmp_path, monkeypatch)
    assert np.mean(got["errors"]) <= FOLLOWS_PX, got["errors"]
    assert all(out.colour == "blue" for out, _, _, _ in got["readings"])


async def test_without_a_secure_context_the_page_says_why_there_is_no_camera(tmp_path):
    """Browsers give the camera only to a secure context (HTTPS, or localhost / 127.0.0.0/8): on plain HTTP at another
    address navigator.mediaDevices is missing (simulated here: removed before the page's scripts run). The camera
    button is off and the page says what to open instead."""
    async with serving() as (server, base), chromium_with_camera(tmp_path, tmp_path / "none.y4m") as browser:
        page = await browser.new_page()
        await page.add_init_script("Object.defineProperty(navigator, 'mediaDevices', {get: () => undefined})")
        await page.goto(f"{base}/?autostart=0", timeout=15_000)
        assert await page.is_disabled("#camera")
        text = await page.inner_text("#camera-status")
        assert "secure context" in text and "localhost" in text, text


async def test_turning_the_camera_on_during_a_stream_without_input_starts_one_with_it(tmp_path):
    """A stream started without the camera takes no input (the server answered its video m-line sendonly); turning
    the camera on starts a new stream with it, whose frames come from the camera."""
    async with serving() as (server, base):
        cfg = server.engine.gen.model_cfg
        y4m = input_y4m(tmp_path / "camera.y4m", cfg.width, cfg.height)
        async with chromium_with_camera(tmp_path, y4m) as browser:
            page = await browser.new_page()
            await page.goto(f"{base}/?prompt=a%20blue%20ball", timeout=15_000)
            await page.wait_for_function("player.framesPresented > 0", timeout=20_000)
            first = await page.evaluate("({id: player.streamId, input: player.input})")
            assert first["input"] is False and server.webrtc[next(iter(server.webrtc))].camera is None
            await page.click("#camera")
            await page.wait_for_function(f"player.streamId !== {first['id']!r} && player.input && player.phase === "
                                         "'playing'", timeout=20_000)
            assert "starting a new one with your camera" in await page.inner_text("#camera-status")
            await page.wait_for_function("player.inputOnScreen === 'frames'", timeout=20_000)
            stream_id = await page.evaluate("player.streamId")
            assert server.sessions[stream_id].input.stats()["received"] > 0
            assert first["id"] not in server.sessions  # the stream without input ended


async def test_a_link_with_camera_1_starts_with_the_camera_at_its_strength(tmp_path):
    """/?camera=1&strength=S: the page turns the camera on first, then starts the stream with input at S."""
    async with serving() as (server, base):
        cfg = server.engine.gen.model_cfg
        y4m = input_y4m(tmp_path / "camera.y4m", cfg.width, cfg.height)
        async with chromium_with_camera(tmp_path, y4m) as browser:
            page = await browser.new_page()
            await page.goto(f"{base}/?camera=1&strength=0.3&prompt=a%20blue%20ball", timeout=15_000)
            await page.wait_for_function("player.input && player.inputOnScreen === 'frames'", timeout=20_000)
            state = await page.evaluate("({strength: player.strength, camera: player.cameraOn})")
            assert state == {"strength": pytest.approx(min(server.engine.gen.input_strengths())), "camera": True}
