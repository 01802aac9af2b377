"""WHEP end to end (issue 36): aiortc as a plain WHEP client (an HTTP POST of its offer, no code of ours on the client
side but the loopback ICE choice) plays a stream, and every refusal is an HTTP status with a line of text."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from types import SimpleNamespace

import aiohttp
import aioice.ice
import pytest
from aiortc import RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError

from streamsvc.door.access import AccessConfig, Rate
from streamsvc.door.whep import Endpoints, ice_link
from streamsvc.wire.rtc import IceServer, WebRtcConfig
from tests.client.servers import running

pytestmark = pytest.mark.slow
LOOPBACK = WebRtcConfig(ice_addresses=("127.0.0.1",))
SDP = {"Content-Type": "application/sdp"}


@pytest.fixture(autouse=True)
def loopback_candidates(monkeypatch):
    """The client's host candidates on 127.0.0.1 (aioice leaves loopback out): this host may have no other."""
    monkeypatch.setattr(aioice.ice, "get_host_addresses", lambda use_ipv4, use_ipv6: ["127.0.0.1"])


async def offer(pc: RTCPeerConnection, channel: bool = False) -> str:
    """A WHEP client's offer: a recvonly video (and a `control` data channel), every candidate gathered."""
    pc.addTransceiver("video", direction="recvonly")
    if channel:
        pc.control = pc.createDataChannel("control")
    await pc.setLocalDescription(await pc.createOffer())
    return pc.localDescription.sdp


def base(server) -> str:
    return f"http://127.0.0.1:{server.port}"


async def play(track, seconds: float) -> list:
    """The frames of `track` that arrive within `seconds` (bounded: at most 100 a second)."""
    frames = []
    end = time.monotonic() + seconds
    for _ in range(int(seconds * 100)):
        left = end - time.monotonic()
        if left <= 0:
            break
        try:
            frames.append(await asyncio.wait_for(track.recv(), left))
        except (TimeoutError, MediaStreamError):
            break
    return frames


async def test_a_plain_aiortc_whep_client_plays_five_seconds_and_deletes():
    async with running(webrtc=LOOPBACK) as server, aiohttp.ClientSession() as http:
        pc = RTCPeerConnection()
        tracks: asyncio.Queue = asyncio.Queue()
        pc.on("track", tracks.put_nowait)
        try:
            sdp = await offer(pc)
            async with http.post(f"{base(server)}/whep?prompt=a+red+ball", data=sdp, headers=SDP) as r:
                assert r.status == 201, await r.text()
                assert r.content_type == "application/sdp"
                location, answer = r.headers["Location"], await r.text()
                stream_id, watch_url = r.headers["X-Stream-Id"], r.headers["X-Watch-Url"]
                steer_secret = r.headers["X-Steer-Secret"]
                assert "Link" not in r.headers  # no ICE servers (test_ice_servers_are_link_headers)
            assert location.startswith("/whep/session/") and len(location.rsplit("/", 1)[1]) >= 22  # 128 bits
            assert "a=candidate:" in sdp and "a=setup:passive" in answer  # the DTLS server (GStreamer needs it)
            session = server.sessions[stream_id]
            assert session.steer_secret == steer_secret and watch_url == f"/whep/{stream_id}?secret={session.watch_secret}"
            await pc.setRemoteDescription(RTCSessionDescription(answer, "answer"))
            track = await asyncio.wait_for(tracks.get(), 20)
            frames = await play(track, 5.0)
            # the stream's fps (16) for 5 s, less the first frame's wait (the start gate, the first chunk)
            assert len(frames) >= 40, len(frames)
            width, height = server.engine.gen.model_cfg.width, server.engine.gen.model_cfg.height
            assert (frames[-1].width, frames[-1].height) == (width, height)
            async with http.delete(base(server) + location) as r:
                assert r.status == 200, await r.text()
            for _ in range(50):  # the stream ends with its steering session
                if stream_id not in server.sessions:
                    break
                await asyncio.sleep(0.1)
            assert stream_id not in server.sessions
            assert server.whep.sessions == {}
            async with http.delete(base(server) + location) as r:  # gone
                assert r.status == 404
        finally:
            await pc.close()


async def post(http, url: str, sdp: str, **headers) -> tuple[int, dict, str]:
    async with http.post(url, data=sdp, headers={**SDP, **headers}) as r:
        return r.status, r.headers, await r.text()


async def until(check, seconds: float = 10.0) -> bool:
    for _ in range(int(seconds / 0.05)):
        if check():
            return True
        await asyncio.sleep(0.05)
    return check()


async def test_watching_and_each_refusal_is_a_status_with_text():
    """A watch link's secret watches; a wrong or missing secret, the steer secret, an unknown stream, a bad offer, a
    wrong content type, a missing prompt, a PATCH, a DELETE of no session: each its 4xx and a line of text."""
    async with running(webrtc=LOOPBACK) as server, aiohttp.ClientSession() as http:
        url = base(server)
        pcs = [RTCPeerConnection() for _ in range(2)]
        try:
            status, headers, answer = await post(http, f"{url}/whep?prompt=a+blue+square", await offer(pcs[0]))
            assert status == 201, answer
            await pcs[0].setRemoteDescription(RTCSessionDescription(answer, "answer"))
            stream_id, watch_url = headers["X-Stream-Id"], headers["X-Watch-Url"]
            watch_secret, steer_secret = headers["X-Watch-Secret"], headers["X-Steer-Secret"]
            good = pcs[1]
            sdp = await offer(good)
            refusals = {
                f"/whep/{stream_id}?secret=wrong-secret-wrong-secret": 404,
                f"/whep/{stream_id}": 404,  # no secret
                f"/whep/{stream_id}?secret={steer_secret}": 404,  # the steer secret is no watch secret
                f"/whep/s999?secret={watch_secret}": 404,  # no such stream
                "/whep": 400,  # no prompt
                "/whep/a/b": 404,
            }
            for path, expected in refusals.items():
                status, headers, text = await post(http, url + path, sdp)
                assert (status, headers["Content-Type"]) == (expected, "text/plain; charset=utf-8"), (path, text)
                assert text.endswith("\n") and "Traceback" not in text
            for body, expected in (("hello", 400), ("v=0\r\nm=video 9 UDP/TLS/RTP/SAVPF 96\r\n" * 40, 400)):
                status, _, text = await post(http, f"{url}/whep?prompt=x", body)
                assert status == expected and text.startswith("bad offer"), text
            async with http.post(f"{url}/whep?prompt=x", data=sdp, headers={"Content-Type": "text/plain"}) as r:
                assert r.status == 415
            async with http.get(f"{url}/whep") as r:
                assert r.status == 405 and r.headers["Allow"] == "POST, OPTIONS"
            async with http.delete(f"{url}/whep/session/AAAAAAAAAAAAAAAAAAAAAA") as r:
                assert r.status == 404 and "no such session" in await r.text()
            assert len(server.sessions) == 1  # none of these started a stream
            status, headers, answer = await post(http, url + watch_url, sdp)
            assert status == 201, answer
            assert "X-Steer-Secret" not in headers and headers["X-Stream-Id"] == stream_id
            await good.setRemoteDescription(RTCSessionDescription(answer, "answer"))
            async with http.patch(url + headers["Location"], data="a=end-of-candidates\r\n",
                                  headers={"Content-Type": "application/trickle-ice-sdpfrag"}) as r:
                assert r.status == 405 and "DELETE" in r.headers["Allow"]
            # a trickling client's PATCH is refused, and it connects with the candidates of its offer
            assert "a=candidate:" in sdp and await until(lambda: good.connectionState == "connected", 20)
            assert await until(lambda: server.sessions[stream_id].watchers == 1)
            async with http.delete(url + headers["Location"]) as r:  # a watcher leaves; the stream goes on
                assert r.status == 200
            assert await until(lambda: server.sessions[stream_id].watchers == 0)
            assert stream_id in server.sessions
        finally:
            for pc in pcs:
                await pc.close()


async def test_tokens_rates_and_caps_hold_for_the_post_and_the_delete():
    """Where the server has tokens, POST and DELETE need the Bearer token (401 with WWW-Authenticate); a POST spends
    its address's --connect-rate (429 with Retry-After); a session holds one of its address's connections."""
    access = AccessConfig(tokens={"sekrit-token": None}, max_connections_per_client=1)
    async with running(access, webrtc=LOOPBACK) as server, aiohttp.ClientSession() as http:
        url = f"{base(server)}/whep?prompt=a+ball"
        pc = RTCPeerConnection()
        try:
            sdp = await offer(pc)
            for auth in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic sekrit-token"}):
                status, headers, text = await post(http, url, sdp, **auth)
                assert status == 401 and headers["WWW-Authenticate"].startswith("Bearer"), text
            status, headers, answer = await post(http, url, sdp, Authorization="Bearer sekrit-token")
            assert status == 201, answer
            location = headers["Location"]
            # the address's one connection is the session's: a second POST is refused until it ends
            status, headers, text = await post(http, url, sdp, Authorization="Bearer sekrit-token")
            assert status == 429 and "Retry-After" in headers, text
            async with http.delete(base(server) + location) as r:
                assert r.status == 401
            async with http.delete(base(server) + location, headers={"Authorization": "Bearer sekrit-token"}) as r:
                assert r.status == 200
            assert await until(lambda: not server.sessions and not server.whep.sessions)
        finally:
            await pc.close()
    access = AccessConfig(connect_rate=Rate(0.01, 2))
    async with running(access) as server, aiohttp.ClientSession() as http:
        statuses = [(await post(http, f"{base(server)}/whep?prompt=x", "not sdp"))[0] for _ in range(3)]
        assert statuses == [400, 400, 429]


async def test_cors_preflight_and_origins():
    """OPTIONS answers a preflight with CORS headers for an allowed origin (--allow-origin) only; a POST from a page
    of another origin is 403 and starts nothing."""
    async with running(AccessConfig(allowed_origins=("http://allowed.example:8080",))) as server, \
            aiohttp.ClientSession() as http:
        url = f"{base(server)}/whep"
        preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
        async with http.options(url, headers={"Origin": "http://allowed.example:8080", **preflight}) as r:
            assert r.status == 204
            assert r.headers["Access-Control-Allow-Origin"] == "http://allowed.example:8080"
            assert "POST" in r.headers["Access-Control-Allow-Methods"]
            assert "content-type" in r.headers["Access-Control-Allow-Headers"].lower()
            assert r.headers["Accept-Post"] == "application/sdp"
        async with http.options(url + "/session/x", headers={"Origin": "http://allowed.example:8080"}) as r:
            assert r.status == 204 and "DELETE" in r.headers["Access-Control-Allow-Methods"]
        async with http.options(url, headers={"Origin": "http://evil.example", **preflight}) as r:
            assert r.status == 204 and "Access-Control-Allow-Origin" not in r.headers
        status, _, text = await post(http, url + "?prompt=x", "v=0\r\n", Origin="http://evil.example")
        assert status == 403 and "--allow-origin" in text
        status, headers, _ = await post(http, url + "?prompt=x", "v=0\r\n", Origin="http://allowed.example:8080")
        assert status == 400 and headers["Access-Control-Allow-Origin"] == "http://allowed.example:8080"
        assert "Location" in headers["Access-Control-Expose-Headers"]


def test_ice_servers_are_link_headers():
    stun, turn = IceServer("stun:stun.example.org:3478"), IceServer("turn:t.example.org:3478?transport=udp", "u", "p\"")
    assert ice_link(stun) == '<stun:stun.example.org:3478>; rel="ice-server"'
    assert ice_link(turn) == ('<turn:t.example.org:3478?transport=udp>; rel="ice-server"; username="u"; '
                              'credential="p\\""; credential-type="password"')
    host = SimpleNamespace(config=SimpleNamespace(webrtc=WebRtcConfig(ice_servers=(stun, turn))))
    created = Endpoints(host).created("v=0\r\n", [("Location", "/whep/session/x")])
    assert created.status == 201
    assert [v for k, v in created.headers if k == "Link"] == [ice_link(stun), ice_link(turn)]


async def test_steering_over_the_data_channel_or_taken_over_ws_without_one():
    """With a `control` data channel the WHEP player steers as our player does (set_prompt, ack). Without one, the
    stream plays on its start prompt and a /ws client with the steer secret takes the token from the session."""
    from websockets.asyncio.client import connect

    async with running(webrtc=LOOPBACK) as server, aiohttp.ClientSession() as http:
        steering, plain = RTCPeerConnection(), RTCPeerConnection()
        try:
            sdp = await offer(steering, channel=True)
            channel = steering.control
            status, _, answer = await post(http, f"{base(server)}/whep?prompt=a+red+ball", sdp)
            assert status == 201, answer
            await steering.setRemoteDescription(RTCSessionDescription(answer, "answer"))
            assert await until(lambda: channel.readyState == "open", 20)
            replies: asyncio.Queue = asyncio.Queue()
            channel.on("message", replies.put_nowait)
            channel.send(json.dumps({"type": "set_prompt", "prompt": "a green square"}))
            for _ in range(50):
                msg = json.loads(await asyncio.wait_for(replies.get(), 10))
                if msg["type"] in ("ack", "error"):
                    break
            assert (msg["type"], msg.get("prompt_version")) == ("ack", 1), msg

            status, headers, answer = await post(http, f"{base(server)}/whep?prompt=a+blue+ball", await offer(plain))
            assert status == 201, answer
            await plain.setRemoteDescription(RTCSessionDescription(answer, "answer"))
            assert await until(lambda: plain.connectionState == "connected", 20)
            stream_id = headers["X-Stream-Id"]
            async with connect(f"ws://127.0.0.1:{server.port}/ws") as ws:
                await ws.send(json.dumps({"type": "watch", "stream_id": stream_id,
                                          "secret": headers["X-Watch-Secret"]}))
                await ws.send(json.dumps({"type": "take", "secret": headers["X-Steer-Secret"]}))
                await ws.send(json.dumps({"type": "set_prompt", "prompt": "a green ball"}))
                seen = []
                for _ in range(200):
                    raw = await asyncio.wait_for(ws.recv(), 10)
                    if isinstance(raw, str):
                        seen.append(json.loads(raw))
                        if seen[-1]["type"] in ("ack", "error") and seen[-1].get("request") == "set_prompt":
                            break
                kinds = [(m["type"], m.get("request")) for m in seen if m["type"] in ("ack", "error")]
                assert kinds == [("ack", "take"), ("ack", "set_prompt")], seen
                assert server.sessions[stream_id].steerer.role.value == "steer"
        finally:
            await steering.close()
            await plain.close()


async def test_a_session_whose_peer_vanished_ends_by_its_ice_timeout(monkeypatch):
    """No DELETE: the player's sockets go silent. ICE consent (RFC 7675, aioice: 6 failed checks, 5 s apart by
    default; 0.1 s here) fails, the stream ends, and the session with it."""
    monkeypatch.setattr(aioice.ice, "CONSENT_INTERVAL", 0.1)
    async with running(webrtc=LOOPBACK) as server, aiohttp.ClientSession() as http:
        pc = RTCPeerConnection()
        try:
            status, headers, answer = await post(http, f"{base(server)}/whep?prompt=a+ball", await offer(pc))
            assert status == 201, answer
            await pc.setRemoteDescription(RTCSessionDescription(answer, "answer"))
            assert await until(lambda: pc.connectionState == "connected", 20)
            assert len(server.whep.sessions) == 1
            ice = pc.getTransceivers()[0].receiver.transport.transport._connection
            for protocol in ice._protocols:  # gone without a word: no DTLS close, no more STUN answers
                protocol.transport.close()
            assert await until(lambda: not server.whep.sessions and not server.sessions, 20)
            async with http.delete(base(server) + headers["Location"]) as r:
                assert r.status == 404
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(pc.close(), 5)


async def test_without_a_data_channel_the_first_frame_waits_for_none():
    """The track holds its first frame for the control channel (channel_wait_s, 15 s here); an offer without a data
    channel (a WHEP player) gets it as soon as it is made."""
    async with running(webrtc=WebRtcConfig(ice_addresses=("127.0.0.1",), channel_wait_s=15.0)) as server, \
            aiohttp.ClientSession() as http:
        pc = RTCPeerConnection()
        tracks: asyncio.Queue = asyncio.Queue()
        pc.on("track", tracks.put_nowait)
        try:
            status, _, answer = await post(http, f"{base(server)}/whep?prompt=a+ball", await offer(pc))
            assert status == 201, answer
            await pc.setRemoteDescription(RTCSessionDescription(answer, "answer"))
            track = await asyncio.wait_for(tracks.get(), 10)
            began = time.monotonic()
            await asyncio.wait_for(track.recv(), 10)
            assert time.monotonic() - began < 10
        finally:
            await pc.close()


def test_session_lines_are_gated_per_kind(caplog, monkeypatch):
    """A client opens watch sessions at its connect rate: their opened/ended lines go out once per kind a period,
    the next one saying how many were held back (a flood of sessions is not a flood of lines)."""
    import logging

    from streamsvc.door import whep

    now = [1000.0]
    monkeypatch.setattr(whep.time, "monotonic", lambda: now[0])
    endpoints = whep.Endpoints(host=None)
    with caplog.at_level(logging.INFO, logger="streamsvc.whep"):
        for i in range(20):
            endpoints._log_session("opened", "WHEP session for stream %s (watches) from %s", f"s{i}", "127.0.0.1")
            endpoints._log_session("ended", "WHEP session for stream %s ended: %s", f"s{i}", "closed")
        now[0] += whep.SESSION_LOG_PERIOD_S
        endpoints._log_session("opened", "WHEP session for stream %s (watches) from %s", "s20", "127.0.0.1")
    lines = [r.getMessage() for r in caplog.records if r.name == "streamsvc.whep"]
    assert lines == ["WHEP session for stream s0 (watches) from 127.0.0.1", "WHEP session for stream s0 ended: closed",
                     "WHEP session for stream s20 (watches) from 127.0.0.1 (19 more sessions opened since the last "
                     "such line)"]


async def test_a_whep_post_starts_from_an_uploaded_image_and_a_bad_id_is_a_400():
    """The POST names an upload (POST /images) with &image=ID: its stream starts from the image and plays; an id no
    upload has is a 400 that says why, and no stream is opened."""
    from tests.streamsvc.test_start_image import drawn, encode

    async with running(webrtc=LOOPBACK) as server, aiohttp.ClientSession() as http:
        url = base(server)
        async with http.post(f"{url}/images", data=encode(drawn()), headers={"Content-Type": "image/png"}) as r:
            assert r.status == 201, await r.text()
            image_id = (await r.json())["image"]
        pcs = [RTCPeerConnection() for _ in range(2)]
        tracks: asyncio.Queue = asyncio.Queue()
        pcs[0].on("track", tracks.put_nowait)
        try:
            status, _, text = await post(http, f"{url}/whep?prompt=a+red+ball&image={'B' * 22}", await offer(pcs[1]))
            assert status == 400 and "no upload BBBBBB... here" in text and not server.sessions, text
            status, headers, answer = await post(http, f"{url}/whep?prompt=a+red+ball&image={image_id}",
                                                 await offer(pcs[0]))
            assert status == 201, answer
            assert server.sessions[headers["X-Stream-Id"]].description.image
            await pcs[0].setRemoteDescription(RTCSessionDescription(answer, "answer"))
            track = await asyncio.wait_for(tracks.get(), 20)
            assert len(await play(track, 3.0)) >= 10
            async with http.delete(url + headers["Location"]) as r:
                assert r.status == 200
        finally:
            for pc in pcs:
                await pc.close()
