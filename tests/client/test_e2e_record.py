"""Recording end to end: a steerer's `record`, prompt changes as chapters, the MP4 served over HTTP after the stream,
at a link that carries the recording's own secret."""

import asyncio
import re
import urllib.error
import urllib.request

import av

from streamsvc.door.access import AccessConfig
from streamsvc.wire import protocol as P
from tests.client.test_e2e_watch import Peer, running, start, watch


def get(url: str, headers: dict | None = None) -> tuple[int, dict, bytes]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


async def test_a_steered_recording_has_a_chapter_per_prompt_and_is_served_after_the_stream(tmp_path):
    async with running(recordings_dir=str(tmp_path)) as server:
        steerer = await Peer.open(server, start("a red ball moving right"))
        watcher = await Peer.open(server, watch(steerer.ready))
        await watcher.send({"type": "record"})
        await watcher.until(lambda: watcher.errors, "not_steerer")
        assert watcher.errors[0].code == P.ErrorCode.NOT_STEERER
        await steerer.send({"type": "record"})
        await steerer.until(lambda: steerer.of(P.Recording), "recording")
        await watcher.until(lambda: watcher.of(P.Recording), "the watchers hear of it too")
        rec = steerer.of(P.Recording)[0]
        for prompt in ("a blue square falling", "a green triangle rising"):
            await steerer.until(lambda: len(steerer.payloads) >= len(steerer.of(P.Ack)) * 3 + 3, "chunks")
            await steerer.send({"type": "set_prompt", "prompt": prompt})
        await steerer.until(lambda: any(h.prompt_version == 2 for h in steerer.headers), "the second prompt")
        seen = len(steerer.payloads)
        await steerer.until(lambda: len(steerer.payloads) >= seen + 2, "two more chunks")
        base = f"http://127.0.0.1:{server.port}"
        status, _, text = await asyncio.to_thread(get, base + rec.url)  # unindexed until the stream ends
        assert status == 409 and b"in progress" in text
        # the link is the recording's id and a secret of its own; without it, or with another, nothing tells that
        # the recording exists, in progress or not
        link = re.fullmatch(r"/recordings/(s\d+-\d{8}T\d{6})-([0-9a-f]{32})\.mp4", rec.url)
        assert link and rec.chapters == rec.url.removesuffix(".mp4") + ".vtt", rec
        rid, secret = link.groups()
        assert secret not in (steerer.ready.watch_secret, steerer.ready.steer_secret)
        wrong = ("/recordings/" + rid + ".mp4", "/recordings/" + rid + ".vtt", f"/recordings/{rid}-{'0' * 32}.mp4",
                 f"/recordings/{rid}-{secret[::-1]}.mp4", f"/recordings/{rid}-{secret[:-1]}.mp4")
        for path in wrong:
            assert (await asyncio.to_thread(get, base + path))[:3:2] == (404, b"no such recording\n"), path
        await steerer.send({"type": "close"})
        await steerer.until(lambda: steerer.of(P.Closed), "closed")
        server.refresh_metrics()
        assert server.metrics.registry.get_sample_value("streamsvc_recordings_bytes") > 0

        status, headers, body = await asyncio.to_thread(get, base + rec.url)
        assert status == 200 and headers["Content-Type"] == "video/mp4"
        path = tmp_path / "got.mp4"
        path.write_bytes(body)
        headers_after = [h for h in steerer.headers if h.index >= min(h.index for h in steerer.headers if h.keyframe
                                                                      and h.index > 0)]
        with av.open(str(path)) as c:
            frames = sum(1 for _ in c.decode(video=0))
            titles = [ch["metadata"]["title"] for ch in c.chapters()]
        assert frames >= sum(h.frames for h in headers_after) - 12  # from a keyframe asked for at `record` on
        assert frames <= sum(h.frames for h in steerer.headers)
        assert titles[-2:] == ["a blue square falling", "a green triangle rising"], titles
        status, headers, vtt = await asyncio.to_thread(get, base + rec.chapters)
        assert status == 200 and headers["Content-Type"].startswith("text/vtt") and b"a green triangle rising" in vtt
        status, headers, part = await asyncio.to_thread(get, base + rec.url, {"Range": "bytes=0-99"})
        assert status == 206 and part == body[:100] and headers["Content-Range"] == f"bytes 0-99/{len(body)}"
        assert (await asyncio.to_thread(get, base + "/recordings/..%2F..%2Fetc%2Fpasswd"))[0] == 404
        for path in wrong:  # finished: still nothing without the secret
            assert (await asyncio.to_thread(get, base + path))[:3:2] == (404, b"no such recording\n"), path
        assert server.metrics.registry.get_sample_value("streamsvc_refusals_total", {"reason": "secret"}) >= 10
        await watcher.close()
        await steerer.close()


async def test_record_all_and_recordings_behind_the_token(tmp_path):
    access = AccessConfig(tokens={"tok-1": None})
    async with running(recordings_dir=str(tmp_path), record_all=True, access=access) as server:
        steerer = await Peer.open(server, {**start(), "token": "tok-1"})
        await steerer.until(lambda: steerer.of(P.Recording), "recording from the start")
        await steerer.until(lambda: len(steerer.payloads) >= 3, "chunks")
        await steerer.send({"type": "close"})
        await steerer.until(lambda: steerer.of(P.Closed), "closed")
        url = f"http://127.0.0.1:{server.port}{steerer.of(P.Recording)[0].url}"
        assert (await asyncio.to_thread(get, url))[0] == 401
        assert (await asyncio.to_thread(get, url + "?token=wrong"))[0] == 401
        status, _, body = await asyncio.to_thread(get, url + "?token=tok-1")
        assert status == 200 and len(body) > 1000
        status, _, _ = await asyncio.to_thread(get, url, {"Authorization": "Bearer tok-1"})
        assert status == 200
        # the token is needed on top of the secret, and the secret on top of the token
        no_secret = re.sub(r"-[0-9a-f]{32}\.mp4$", ".mp4", url)
        assert no_secret != url and (await asyncio.to_thread(get, no_secret + "?token=tok-1"))[0] == 404
        await steerer.close()
