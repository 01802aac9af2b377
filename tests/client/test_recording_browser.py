"""A recording made by streamsvc.viewers.record plays in headless Chromium's <video>, its prompts listed as chapters.

No server of ours: a 30 s steered stream (a prompt every 2 s, IDRs mid-chunk, a fast chunk, recording started
mid-stream) is encoded as the output stage does and recorded; a loopback HTTP server (with Range, as the
service's /recordings/ has) serves the MP4, its WebVTT chapters and a page with
``<video src=ID.mp4><track kind="chapters" src=ID.vtt default>``. Needs ``/usr/bin/chromium`` and ``playwright``
(see test_browser.py; no browser download); skipped without either.
"""

from __future__ import annotations

import http.server
import io
import re
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest

import client
from streamsvc.engine.encode import StreamEncoder
from streamsvc.viewers.record import RecordingStore
from streamsvc.wire.protocol import Chunk

CHROMIUM = "/usr/bin/chromium"
playwright_api = pytest.importorskip("playwright.async_api", reason="playwright is not installed (pip install playwright)")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which(CHROMIUM) is None, reason=f"{CHROMIUM} is missing (apt-get install -y chromium)"),
]
FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--autoplay-policy=no-user-gesture-required", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run"]

STATIC = Path(client.__file__).resolve().parent / "static"
W, H, FPS = 320, 192, 16
SECONDS = 30
PAGE = """<!doctype html><meta charset="utf-8"><title>recording</title>
<video id="video" muted playsinline src="recordings/{id}.mp4">
<track kind="chapters" src="recordings/{id}.vtt" default></video>"""


def steered_stream(store: RecordingStore) -> tuple[str, list[tuple[int, str]], int]:
    """Records a 30 s stream whose prompt changes every 2 s (at the next chunk, as the server's do); returns the
    recording's name (ID-SECRET, as its link has it), its chapters as (first frame, prompt) counted from the recording's start, and its frames."""
    enc = StreamEncoder(W, H, FPS)  # IDRs every 2 s, counted from the last one: mid-chunk after the forced one
    rec = store.open("s7", FPS, W, H)
    y, x = np.mgrid[0:H, 0:W]
    pts, index, sizes = 0, 0, [9] + [12] * 60
    prompts, recorded_from = [], None
    for n in sizes:
        if recorded_from is not None and pts - recorded_from >= SECONDS * FPS:
            break
        t = np.arange(pts, pts + n)[:, None, None]
        video = np.empty((n, H, W, 3), np.uint8)
        video[..., 0] = (x + 5 * t) % 256
        video[..., 1] = (y + 3 * t) % 256
        video[..., 2] = 60 * (pts // (2 * FPS) % 4)
        keyframe = index == 2  # `record` arrives during chunk 1: the server asks for a keyframe
        packets = enc.encode(video, start_index=pts, keyframe=keyframe, fast=index == 20)
        aus = [bytes(p) for p in packets]
        if keyframe:
            recorded_from = pts
        elapsed = 0 if recorded_from is None else (pts - recorded_from) // (2 * FPS)
        prompt = f"scene {elapsed}: a red ball" + (" & a <blue> cube" if elapsed % 5 == 3 else "")
        header = Chunk.describe(aus, index=index, pts=pts, prompt_version=elapsed, steps=4,
                                keyframe=packets[0].is_keyframe, fast=index == 20)
        if index >= 1:  # from the chunk after `record` on: chunk 1 (no keyframe) is skipped, chunk 2 starts it
            assert rec.add(header, aus, prompt)
        if recorded_from is not None and (not prompts or prompts[-1][1] != prompt):
            prompts.append((pts - recorded_from, prompt))
        pts, index = pts + n, index + 1
    rec.close()
    enc.close()
    return rec.name, prompts, pts - recorded_from  # its files' name, its link: the id and its secret


class _Files(http.server.SimpleHTTPRequestHandler):
    """Static files with single byte ranges (a <video> asks for ranges to seek)."""

    def send_head(self):  # noqa: D102 - http.server's hook
        match = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        path = Path(self.translate_path(self.path))
        if match is None or not path.is_file():
            return super().send_head()
        data = path.read_bytes()
        start = int(match[1])
        end = min(int(match[2]) if match[2] else len(data) - 1, len(data) - 1)
        self.send_response(206)
        self.send_header("Content-Type", self.guess_type(str(path)))
        self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
        self.send_header("Content-Length", str(end - start + 1))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        return io.BytesIO(data[start:end + 1])

    def log_message(self, *args):  # quiet
        pass


_Files.extensions_map = {**http.server.SimpleHTTPRequestHandler.extensions_map, ".vtt": "text/vtt", ".mp4": "video/mp4"}


async def test_a_30_s_steered_recording_plays_in_chromium_with_a_chapter_per_prompt(tmp_path):
    store = RecordingStore(tmp_path / "recordings", 1 << 30)  # the layout of the service's /recordings/ID-SECRET.mp4
    rid, chapters, frames = steered_stream(store)
    assert frames == SECONDS * FPS and len(chapters) == SECONDS // 2
    (tmp_path / "index.html").write_text(PAGE.format(id=rid), encoding="utf-8")
    shutil.copy(STATIC / "recording.html", tmp_path / "recording.html")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                             lambda *a: _Files(*a, directory=str(tmp_path)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        async with playwright_api.async_playwright() as pw:
            browser = await pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
            try:
                page = await browser.new_page()
                await page.goto(f"http://127.0.0.1:{server.server_address[1]}/index.html", timeout=15_000)
                info = await page.evaluate("""async () => {
                    const v = document.getElementById('video');
                    const track = v.textTracks[0];
                    track.mode = 'hidden';  // load the cues without drawing them
                    const el = v.querySelector('track');
                    if (el.readyState !== 2) {
                        await new Promise((done, fail) => { el.addEventListener('load', done, {once: true});
                                                            el.addEventListener('error', fail, {once: true}); });
                    }
                    if (v.readyState < 1) {
                        await new Promise((done) => v.addEventListener('loadedmetadata', done, {once: true}));
                    }
                    const canPlay = v.canPlayType('video/mp4; codecs="avc1.42C01E"');
                    v.playbackRate = 16;
                    const started = performance.now();
                    await v.play();
                    await new Promise((done) => v.addEventListener('ended', done, {once: true}));
                    const ended = {time: v.currentTime, wall_ms: performance.now() - started,
                                   frames: v.getVideoPlaybackQuality().totalVideoFrames};
                    const cue = track.cues[7];
                    v.currentTime = cue.startTime;  // a chapter link: seek (a range request)
                    await new Promise((done) => v.addEventListener('seeked', done, {once: true}));
                    return {canPlay, ended, error: v.error && v.error.code, duration: v.duration,
                            width: v.videoWidth, height: v.videoHeight, seekedTo: v.currentTime,
                            cues: [...track.cues].map((c) => ({start: c.startTime, end: c.endTime, raw: c.text,
                                                               text: c.getCueAsHTML().textContent}))};
                }""")
                # the player's recording page (client/static/recording.html) lists the same prompts
                player = await browser.new_page()
                await player.goto(f"http://127.0.0.1:{server.server_address[1]}/recording.html#id={rid}",
                                  timeout=15_000)
                await player.wait_for_function("recording.chapters.length > 0", timeout=10_000)
                listed = await player.evaluate(
                    "[...document.querySelectorAll('#chapters li')].map((li) => li.textContent)")
            finally:
                await browser.close()
    finally:
        server.shutdown()
        server.server_close()
    print(f"recording {rid}: {info['duration']:.3f} s, {info['ended']['frames']} frames in Chromium "
          f"(played at 16x in {info['ended']['wall_ms'] / 1000:.2f} s), {len(info['cues'])} chapters")
    assert info["canPlay"] == "probably", "this Chromium cannot play H.264 in MP4 (no proprietary codecs)"
    assert info["error"] is None and (info["width"], info["height"]) == (W, H)
    assert info["duration"] == pytest.approx(frames / FPS, abs=1 / FPS)
    assert info["ended"]["time"] == pytest.approx(info["duration"], abs=1e-3)
    assert info["ended"]["frames"] >= 0.9 * frames
    assert [c["text"] for c in info["cues"]] == [p for _, p in chapters]  # escaped in the file, as typed in the page
    assert "&amp;" in info["cues"][3]["raw"]  # VTTCue.text is the raw cue text: a page shows getCueAsHTML()'s
    starts = [f / FPS for f, _ in chapters]
    assert [c["start"] for c in info["cues"]] == pytest.approx(starts, abs=1e-3)
    assert [c["end"] for c in info["cues"]] == pytest.approx(starts[1:] + [frames / FPS], abs=1e-3)
    assert info["seekedTo"] == pytest.approx(starts[7], abs=1 / FPS)
    assert listed == [f"{f / FPS:.2f} s: {p}" for f, p in chapters]
