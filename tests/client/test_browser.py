"""The browser player end to end: headless Chromium (Debian's) plays a tiny-preset stream over WebRTC on loopback.

Needs ``/usr/bin/chromium`` (``apt-get install -y chromium``) and ``playwright`` from PyPI; skipped
without either. Playwright only drives the installed browser (``executable_path``): no browser download.
Saves a screenshot of the player playing, to docs/player.png when STREAMSVC_SCREENSHOT=1 (else to a temp dir).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
from pathlib import Path

import pytest

import client
from streamsvc.door.access import AccessConfig
from streamsvc.engine.config import EngineConfig
from streamsvc.viewers.server import Server, ServerConfig
from streamsvc.wire import protocol as P
from streamsvc.wire.rtc import WebRtcConfig

CHROMIUM = "/usr/bin/chromium"
playwright_api = pytest.importorskip("playwright.async_api", reason="playwright is not installed (pip install playwright)")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which(CHROMIUM) is None, reason=f"{CHROMIUM} is missing (apt-get install -y chromium)"),
]

STATIC = Path(client.__file__).resolve().parent / "static"
DOCS_SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "player.png"
FLAGS = [
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
    "--autoplay-policy=no-user-gesture-required",
    "--allow-loopback-in-peer-connection",  # without it Chromium never answers over loopback
    "--disable-features=WebRtcHideLocalIpsWithMdns",  # real 127.0.0.1 candidates, not mDNS names
    "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run",
]
PLAY_S = 5.0


async def _state(page) -> dict:
    return await page.evaluate(
        "() => ({phase: player.phase, shown: player.framesPresented, decoded: player.framesDecoded,"
        " version: player.versionOnScreen, acked: player.promptVersion, ttff: player.ttffMs,"
        " fps: player.presentedFps, freezes: player.freezeCount, freeze_s: player.totalFreezesDuration,"
        " steer: player.steerLatenciesMs, chunks: player.chunks, message: player.message, errors: player.errors})"
    )


@contextlib.asynccontextmanager
async def serving(engine: EngineConfig = EngineConfig(), **config):
    """(server, its base URL): the tiny model on the CPU with the player's pages, WebRTC on loopback; stopped on the
    way out (a second stop after a test's own does nothing)."""
    server = Server(engine, ServerConfig(port=0, static_dir=str(STATIC),
                                         webrtc=WebRtcConfig(ice_addresses=("127.0.0.1",)), **config))
    await server.start()
    try:
        yield server, f"http://127.0.0.1:{server.port}"
    finally:
        await asyncio.wait_for(server.stop(), 30)


@contextlib.asynccontextmanager
async def chromium(tmp_path: Path, **options):
    """Debian's Chromium, headless, with a fresh profile; closed on the way out."""
    async with playwright_api.async_playwright() as pw:
        browser = await pw.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=CHROMIUM, headless=True, args=FLAGS, **options)
        try:
            yield browser
        finally:
            await browser.close()


async def test_player_plays_steers_and_reports(tmp_path):
    viewport = {"width": 760, "height": 840}
    async with serving(max_streams=1) as (server, base), chromium(tmp_path, viewport=viewport) as browser:
        page = await browser.new_page()
        await page.goto(f"{base}/?prompt=a%20lighthouse%20in%20a%20storm", timeout=15_000)
        await page.wait_for_function("player.framesPresented > 0", timeout=20_000)
        first = await _state(page)
        assert first["phase"] == "playing" and first["ttff"] is not None, first

        await asyncio.sleep(PLAY_S)
        played = await _state(page)
        assert played["shown"] >= 0.6 * 16 * PLAY_S, played  # frames were decoded and shown at about 16 fps
        await page.wait_for_function("player.framesDecoded > 0", timeout=5_000)  # getStats agrees
        assert played["version"] == 0 and played["chunks"] >= 5, played

        # a second viewer is refused (cap of 1 stream) and told why
        other = await browser.new_page()
        await other.goto(base + "/", timeout=15_000)
        await other.wait_for_function("player.phase === 'refused'", timeout=15_000)
        banner = await other.inner_text("#banner-text")
        assert "refused" in banner and "cap of 1" in banner, banner
        await other.close()

        # steer: type a new prompt into the page
        await page.fill("#prompt", "a red fox running through snow")
        await page.press("#prompt", "Enter")
        await page.wait_for_function("player.versionOnScreen >= 1", timeout=15_000)
        steered = await _state(page)
        assert steered["acked"] == 1 and steered["steer"], steered  # the ack came and frames under v1 showed
        await page.wait_for_function(  # the overlay shows it (it redraws every 250 ms)
            "Number(document.getElementById('o-version').textContent.slice(1)) >= 1", timeout=2_000)

        await page.wait_for_timeout(1500)  # a getStats poll after the steer
        final = await _state(page)
        assert isinstance(final["freezes"], int) and final["freezes"] >= 0, final
        print(f"browser: ttff {final['ttff']:.0f} ms, {final['shown']} frames shown, {final['decoded']} decoded, "
              f"freezeCount {final['freezes']} ({final['freeze_s']:.2f} s), steer {final['steer'][0]:.0f} ms")
        shot = DOCS_SCREENSHOT if os.environ.get("STREAMSVC_SCREENSHOT") == "1" else tmp_path / "player.png"
        shot.parent.mkdir(parents=True, exist_ok=True)
        await page.screenshot(path=str(shot))
        assert shot.stat().st_size > 1000

        # the server goes away: the page says so
        await asyncio.wait_for(server.stop(), 30)
        await page.wait_for_function("player.phase === 'closed' || player.phase === 'failed'", timeout=10_000)
        assert "server shutting down" in await page.inner_text("#banner-text")
        assert server.engine.stats().kv_used_bytes == 0


async def test_the_player_shows_the_built_in_models_words_and_a_prompts_unknown_ones(tmp_path):
    """Under the prompt box: how many words the built-in model knows (the list one click away, opened when a prompt
    has unknown words) and the prompt's unknown words; a steer to a caption clears them (issue 33)."""
    from models.scenes import vocabulary

    async with serving(EngineConfig(weights="builtin")) as (server, base), chromium(tmp_path) as browser:
        page = await browser.new_page()
        await page.goto(f"{base}/?prompt=a%20red%20fox%20in%20the%20snow", timeout=15_000)
        await page.wait_for_function("player.phase === 'playing'", timeout=20_000)
        assert await page.evaluate("player.vocabulary") == vocabulary()
        assert await page.inner_text("#unknown-words") == "unknown to this model: fox, snow"
        words = [w for w in vocabulary() if w.isalpha()]
        assert await page.inner_text("#vocabulary-summary") == f"this model knows {len(words)} words; others draw noise"
        assert await page.inner_text("#vocabulary-words") == ", ".join(words)  # shown: the list opened by itself

        await page.fill("#prompt", "a blue square falling")
        await page.press("#prompt", "Enter")
        await page.wait_for_function("player.promptVersion >= 1", timeout=15_000)
        assert await page.is_hidden("#unknown-words") and await page.is_visible("#vocabulary-summary")

    async with serving() as (server, base), chromium(tmp_path) as browser:  # random weights: any text, no list
        page = await browser.new_page()
        await page.goto(f"{base}/?prompt=a%20red%20fox%20in%20the%20snow", timeout=15_000)
        await page.wait_for_function("player.phase === 'playing'", timeout=20_000)
        assert await page.is_hidden("#vocabulary") and await page.is_hidden("#unknown-words")


async def test_player_takes_its_token_from_the_page_fragment(tmp_path):
    """A server with a token: the page with #token=... plays (its upgrade comes from the server's own origin);
    the page without one is refused with the reason."""
    access = AccessConfig(tokens={"s3cret-token": None})
    async with serving(access=access) as (server, base), chromium(tmp_path) as browser:
        page = await browser.new_page()
        await page.goto(f"{base}/?prompt=a%20koi%20pond#token=s3cret-token", timeout=15_000)
        await page.wait_for_function("player.framesPresented > 0", timeout=20_000)
        assert (await _state(page))["phase"] == "playing"

        other = await browser.new_page()
        await other.goto(base + "/", timeout=15_000)
        await other.wait_for_function("player.phase === 'refused'", timeout=15_000)
        assert "access token" in await other.inner_text("#banner-text")


async def test_a_second_page_opens_the_watch_link_and_plays_the_same_stream(tmp_path):
    """The steering page shows a watch link (the stream's id and watch secret) and a steer link; a second page opening
    the watch link plays the same stream (from a keyframe), says it watches, has no prompt box and no steer link, and
    both pages count one watcher. The id without the secret is refused."""
    async with serving() as (server, base), chromium(tmp_path) as browser:
        page = await browser.new_page()
        await page.goto(f"{base}/?prompt=a%20blue%20square%20falling", timeout=15_000)
        await page.wait_for_function("player.framesPresented > 0", timeout=20_000)
        link = await page.get_attribute("#watch-link", "href")
        stream_id = await page.evaluate("player.streamId")
        session = server.sessions[stream_id]
        assert link.endswith(f"/#watch={stream_id}&secret={session.watch_secret}"), link
        assert await page.inner_text("#role") == "steering" and await page.is_visible("#steer-link")
        steer_link = await page.get_attribute("#steer-link", "href")
        assert steer_link == f"{link}&steer={session.steer_secret}"

        stranger = await browser.new_page()  # the id alone: refused, and told what the link lacks
        await stranger.goto(link.split("&", 1)[0], timeout=15_000)
        await stranger.wait_for_function("player.phase === 'refused'", timeout=15_000)
        assert "watch secret" in await stranger.inner_text("#banner-text") and session.watchers == 0
        await stranger.close()

        watcher = await browser.new_page()
        await watcher.goto(link, timeout=15_000)
        await watcher.wait_for_function("player.framesPresented >= 16", timeout=20_000)
        state = await watcher.evaluate("({role: player.role, id: player.streamId, phase: player.phase})")
        assert state == {"role": "watch", "id": stream_id, "phase": "playing"}, state
        assert await watcher.inner_text("#role") == "watching"
        assert await watcher.is_disabled("#prompt")
        assert not await watcher.is_visible("#steer-link") and not await watcher.is_visible("#take")
        await page.wait_for_function("player.watchers === 1", timeout=5_000)
        await page.wait_for_function(
            "document.getElementById('watchers').textContent === '1 watching'", timeout=2_000)
        assert len(server.sessions) == 1  # one stream generated for both pages
        await watcher.close()
        await page.wait_for_function("player.watchers === 0", timeout=5_000)


async def test_a_recording_of_a_steered_stream_plays_in_chromium_with_its_prompts_listed(tmp_path):
    """A steerer records its stream and steers it (a prompt every 2 s); once the stream ends, recording.html plays the
    MP4 in Chromium's <video> to its end and lists one chapter per prompt. STREAMSVC_RECORD_S sets the stream's length
    (default 6 s; the issue's figure is 30)."""
    from tests.client.test_e2e_watch import Peer

    seconds = float(os.environ.get("STREAMSVC_RECORD_S", "6"))
    prompts = ["a red ball moving right", "a blue square falling", "a green triangle rising", "a yellow ball still"]
    async with serving(recordings_dir=str(tmp_path / "rec")) as (server, base):
        steerer = await Peer.open(server, {"type": "start", "prompt": prompts[0], "seed": 5})
        await steerer.send({"type": "record"})
        await steerer.until(lambda: steerer.of(P.Recording), "recording")
        steps = int(seconds / 2)
        for i in range(1, steps + 1):
            await asyncio.sleep(2.0)
            if i < steps:
                await steerer.send({"type": "set_prompt", "prompt": prompts[i % len(prompts)] + f" {i}"})
        await steerer.send({"type": "close"})
        await steerer.until(lambda: steerer.of(P.Closed), "closed")
        await steerer.close()
        rid = steerer.of(P.Recording)[0].url.rsplit("/", 1)[1].removesuffix(".mp4")  # ID-SECRET: the link
        assert re.fullmatch(r"s\d+-\d{8}T\d{6}-[0-9a-f]{32}", rid), rid
        versions = sorted({h.prompt_version for h in steerer.headers})
        async with chromium(tmp_path) as browser:
            page = await browser.new_page()
            await page.goto(f"{base}/recording.html#id={rid}", timeout=15_000)
            await page.wait_for_function("document.getElementById('video').readyState >= 1", timeout=15_000)
            await page.wait_for_function("recording.chapters.length > 0", timeout=10_000)
            info = await page.evaluate("""async () => {
                const v = document.getElementById('video');
                v.playbackRate = 8;
                await v.play();
                await new Promise((done) => v.addEventListener('ended', done, {once: true}));
                return {duration: v.duration, width: v.videoWidth, time: v.currentTime, error: recording.error,
                        frames: v.getVideoPlaybackQuality().totalVideoFrames, chapters: recording.chapters,
                        listed: [...document.querySelectorAll('#chapters li')].map((li) => li.textContent)};
            }""")
            blind = await browser.new_page()  # the recording's id without its secret: nothing plays (404)
            await blind.goto(f"{base}/recording.html#id={rid.rsplit('-', 1)[0]}", timeout=15_000)
            await blind.wait_for_function("recording.error !== null", timeout=15_000)
        recorded_s = info["duration"]
        print(f"recording {rid}: {recorded_s:.2f} s in Chromium, {info['frames']} frames decoded, "
              f"{len(info['chapters'])} chapters: {[c['text'] for c in info['chapters']]}")
        assert info["error"] is None and info["width"] == server.engine.gen.model_cfg.width
        assert seconds - 2.5 <= recorded_s <= seconds + 1 and info["time"] == pytest.approx(recorded_s, abs=0.1)
        assert info["frames"] >= 0.9 * recorded_s * 16
        assert [c["text"] for c in info["chapters"]][0] == prompts[0]
        assert len(info["chapters"]) >= len(versions) - 1 and len(info["listed"]) == len(info["chapters"])
        assert [c["start"] for c in info["chapters"]] == sorted(c["start"] for c in info["chapters"])


async def test_the_player_starts_from_a_picked_image_and_switches_the_style_it_picks(tmp_path):
    """A file picked in the page is the stream's first frame (inline in the start; a large one uploaded first), and
    the style picker lists ready's styles and switches the stream's style live (set_lora, acked)."""
    import base64

    import numpy as np

    from models import build_generator
    from tests.models.test_adapters import make_pairs, save_diffusers, save_peft
    from tests.streamsvc.test_start_image import drawn, encode, psnr

    image = drawn()
    small, large, gif = tmp_path / "small.png", tmp_path / "large.png", tmp_path / "a.gif"
    small.write_bytes(encode(image))
    large.write_bytes(encode(np.random.default_rng(0).integers(0, 256, (400, 400, 3), dtype=np.uint8)))
    gif.write_bytes(b"GIF89a" + bytes(64))
    styles = tmp_path / "styles"
    styles.mkdir()
    model = build_generator("tiny", weights="builtin").model  # the served model's shapes
    save_peft(styles / "ink.pt", make_pairs(model, 8, 1))
    save_diffusers(styles / "neon.safetensors", make_pairs(model, 4, 2), alpha=4)
    engine = EngineConfig(lora_dir=str(styles), weights="auto")
    async with serving(engine) as (server, base), chromium(tmp_path) as browser:
        page = await browser.new_page()
        await page.goto(f"{base}/?autostart=0&prompt=a%20green%20square%20moving%20right", timeout=15_000)
        await page.set_input_files("#start-image", str(small))
        assert "starts from small.png" in await page.inner_text("#start-image-status")
        await page.evaluate("() => { window.firstFrames = player.grab(2); }")  # (not awaited here)
        await page.click("#send")
        await page.wait_for_function("player.framesPresented > 0 && player.imageStarted", timeout=20_000)
        stream_id = await page.evaluate("player.streamId")
        assert server.sessions[stream_id].description.image
        frames = await page.evaluate("window.firstFrames")
        first = np.frombuffer(base64.b64decode(frames[0]["rgb"]), np.uint8).reshape(128, 128, 3)
        print(f"browser: first frame shown {frames[0]['index']} ({frames[0]['input']}), "
              f"{psnr(first, image):.1f} dB against the picked image")
        assert frames[0]["input"] == "image" and psnr(first, image) >= 20.0

        assert await page.is_visible("#style-box")
        assert await page.eval_on_selector_all("#style option", "os => os.map(o => o.value)") == ["", "ink", "neon"]
        await page.select_option("#style", "ink")
        await page.wait_for_function("player.lora === 'ink' && player.acks.some(a => a.request === 'set_lora')",
                                     timeout=15_000)
        assert server.sessions[stream_id].description.lora == "ink"
        await page.close()  # (one stream at a time on this CPU: a second is refused while the first runs late)
        for _ in range(100):
            if not server.sessions:
                break
            await asyncio.sleep(0.1)

        other = await browser.new_page()  # a file over 45 KiB goes up first (POST /images), then its id in start
        await other.goto(f"{base}/?autostart=0", timeout=15_000)
        await other.set_input_files("#start-image", str(large))
        await other.click("#send")
        await other.wait_for_function("player.framesPresented > 0 && player.imageStarted", timeout=20_000)
        assert server.table_sizes()["images.uploads"] == 1
        await other.set_input_files("#start-image", str(gif))  # refused in the page: nothing is sent
        assert "not a PNG, JPEG or WebP" in await other.inner_text("#start-image-status")
        await other.close()
