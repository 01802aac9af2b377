"""WHEP from a browser (issue 36): headless Chromium runs a page of plain JavaScript that follows the WHEP draft (no
code of ours: RTCPeerConnection, fetch, a <video>), served from another origin than the server's (a second loopback
port), so the CORS preflight of its POST and DELETE is part of what is tested. The same page from a third origin,
not allowed, is blocked by the browser and starts nothing.

Needs /usr/bin/chromium and playwright (skipped without them, as tests/client/test_browser.py).
"""

from __future__ import annotations

import contextlib
import shutil

import pytest
from aiohttp import web

from streamsvc.door.access import AccessConfig
from streamsvc.wire.rtc import WebRtcConfig
from tests.client.servers import running
from tests.client.test_browser import CHROMIUM, chromium

playwright_api = pytest.importorskip("playwright.async_api", reason="playwright is not installed (pip install playwright)")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which(CHROMIUM) is None, reason=f"{CHROMIUM} is missing (apt-get install -y chromium)"),
]

PAGE = """<!doctype html>
<meta charset="utf-8"><title>WHEP</title>
<video id="video" autoplay muted playsinline></video>
<script>
// A WHEP player after draft-ietf-wish-whep, section 4: offer (recvonly), POST it as application/sdp, 201 with the
// answer and the session's Location, DELETE the Location to end. Nothing else.
window.whep = {status: null, location: null, streamId: null, error: null, deleted: null};
async function play(endpoint) {
  try {
    const pc = new RTCPeerConnection();
    window.pc = pc;
    pc.addTransceiver("video", {direction: "recvonly"});
    pc.ontrack = (e) => { document.getElementById("video").srcObject = new MediaStream([e.track]); };
    await pc.setLocalDescription(await pc.createOffer());
    await new Promise((done) => {  // no trickle: every candidate in the offer
      if (pc.iceGatheringState === "complete") return done();
      pc.addEventListener("icegatheringstatechange", () => pc.iceGatheringState === "complete" && done());
      setTimeout(done, 5000);
    });
    const response = await fetch(endpoint, {method: "POST", headers: {"Content-Type": "application/sdp"},
                                            body: pc.localDescription.sdp});
    whep.status = response.status;
    if (response.status !== 201) { whep.error = await response.text(); return; }
    whep.location = new URL(response.headers.get("Location"), endpoint).href;
    whep.streamId = response.headers.get("X-Stream-Id");
    await pc.setRemoteDescription({type: "answer", sdp: await response.text()});
  } catch (e) {
    whep.error = String(e);
  }
}
async function framesDecoded() {
  let n = 0;
  (await window.pc.getStats()).forEach((r) => { if (r.type === "inbound-rtp" && r.kind === "video") n = r.framesDecoded; });
  return n;
}
async function stop() {
  const response = await fetch(whep.location, {method: "DELETE"});
  whep.deleted = response.status;
  window.pc.close();
}
</script>
"""


@contextlib.asynccontextmanager
async def page_server():
    """The page on a port of its own (another origin than the stream server's)."""
    async def index(_request):
        return web.Response(text=PAGE, content_type="text/html")

    app = web.Application()
    app.router.add_get("/", index)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    finally:
        await runner.cleanup()


async def test_a_plain_javascript_whep_page_from_another_origin_plays_and_deletes(tmp_path):
    async with page_server() as allowed, page_server() as stranger:
        access = AccessConfig(allowed_origins=(allowed,))
        async with running(access, webrtc=WebRtcConfig(ice_addresses=("127.0.0.1",))) as server, \
                chromium(tmp_path) as browser:
            endpoint = f"http://127.0.0.1:{server.port}/whep?prompt=a%20red%20ball"
            page = await browser.new_page()
            await page.goto(allowed + "/", timeout=15_000)
            await page.evaluate(f"play({endpoint!r})")
            state = await page.evaluate("whep")
            assert state["status"] == 201 and state["error"] is None, state
            assert state["location"].startswith(f"http://127.0.0.1:{server.port}/whep/session/")
            assert state["streamId"] in server.sessions  # X-Stream-Id: exposed to the page by CORS
            await page.wait_for_function("framesDecoded().then((n) => n >= 48)", timeout=20_000, polling=250)
            await page.wait_for_function("document.getElementById('video').videoWidth > 0", timeout=5_000)
            await page.evaluate("stop()")
            assert await page.evaluate("whep.deleted") == 200  # the DELETE's preflight passed too
            for _ in range(100):
                if not server.sessions:
                    break
                await page.wait_for_timeout(100)
            assert not server.sessions and not server.whep.sessions

            other = await browser.new_page()  # an origin not given with --allow-origin: the preflight fails
            await other.goto(stranger + "/", timeout=15_000)
            await other.evaluate(f"play({endpoint!r})")
            state = await other.evaluate("whep")
            assert state["status"] is None and "Failed to fetch" in state["error"], state
            assert not server.sessions
