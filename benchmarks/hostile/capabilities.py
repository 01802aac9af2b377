"""Round two (issue 41), items 5 and 6: the old steerer's WHIP after a handover, and a log flood.

    python -m benchmarks.hostile --case old_steerer --case log_flood

Old steerer (`old_steerer`): a fresh server (tiny preset, CPU, ICE on 127.0.0.1). A viewer starts a stream with input
over /ws; an aiortc WHIP publisher (this process, 127.0.0.1 candidates only, no STUN) feeds it with the steer secret
the viewer's `ready` carried, until a chunk restyles its frames. A second viewer watches; the first hands it the
steer token. Timed from the handover: the new steerer's `audience` with a new steer secret, and the old publisher's
peer connection leaving "connected" (the server ended it). Then a DELETE of the old session's Location (404: the
server had ended it), a WHIP POST with the old secret, and one with the new secret (201), until a chunk restyles the
new publisher's frames. What must hold: the new steerer got a new secret, the old session was ended within 5 s of the
handover, the old secret's POST refused (404), the new one's taken.

Log flood (`log_flood`): a fresh server (tiny preset, CPU, ICE on 127.0.0.1), a stream with input; for --seconds
(10) an aiortc WHIP publisher sends it H.264 frames no decoder can decode, 100 a second (issue 41 saw 1,152 in 5 s
make 1,151 WARNING lines), while this process also sends its ICE agent authenticated STUN checks from 200 new
ports (each a peer-reflexive candidate, and an aioice line, before issue 41's cap), asks GET /healthz 300 times
(aiohttp's access log), and connects and closes a WHEP player 5 times (aioice's lines of each ICE session). The
server's log lines from the attack's start to its end are counted by source (a library's top package, libav's with
av; each of our loggers by its name; a line that is no log record, on stderr, as "other"), with the lines held back
that the gate's lines report. What must hold: at most 10 lines a minute (over a window shorter than a minute: at
most 10) from each library, and from "other". Our own loggers are counted and shown (`ours_over`), not held to it:
their client-caused lines go through access.LogGate, and what remains is a few lines a session (a WHEP session's
start, end and track summary), which the per-address connection rate bounds, not a gate.

Prints each figure as it comes, then (from __main__) one JSON line with all of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import socket
import time
from collections import Counter
from collections.abc import Sequence
from fractions import Fraction

import aiohttp
import aioice.ice
import av
import numpy as np
from aioice import stun
from aiortc import RTCPeerConnection, RTCRtpSender, RTCSessionDescription, VideoStreamTrack
from websockets.asyncio.client import connect

from streamsvc.wire import protocol as P
from streamsvc.wire.rtc import complete_local_description, rtc_configuration

from .common import HOST, Served, T, limited_server

SDP = {"Content-Type": "application/sdp"}
LOOPBACK = ("127.0.0.1",)
VIDEO_TIME_BASE = Fraction(1, 90000)  # RTP's clock for video
BOUND_PER_MINUTE = 10  # log lines a minute from each source, at most
LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (\w+) ([\w.-]+): ")
HELD = re.compile(r"\[(\d+) more lines from \S+ held back")  # streamsvc/library_logs.py's count


def _loopback_only() -> None:
    """This process's aiortc gathers on 127.0.0.1 alone (its peers are the server on loopback), with no STUN."""
    aioice.ice.get_host_addresses = lambda use_ipv4, use_ipv6: ["127.0.0.1"]


# ---------------------------------------------------------------- clients


class _Viewer:
    """One /ws viewer: its ready, the messages and chunk headers it got, read in the background."""

    def __init__(self, ws) -> None:
        self.ws = ws
        self.messages: list = []
        self.headers: list[P.Chunk] = []
        self.ready: P.Ready | None = None
        self._task = asyncio.create_task(self._read())

    @classmethod
    async def open(cls, url: str, first: dict) -> _Viewer:
        viewer = cls(await connect(url, max_size=P.MAX_CHUNK_BYTES, open_timeout=T))
        await viewer.ws.send(json.dumps(first))
        if not await _until(lambda: viewer.ready is not None or any(isinstance(m, P.Error) for m in viewer.messages),
                            T) or viewer.ready is None:
            raise RuntimeError(f"{first['type']} was not admitted: {viewer.messages[-3:]}")
        return viewer

    async def _read(self) -> None:
        with contextlib.suppress(Exception):
            async for raw in self.ws:
                if isinstance(raw, bytes):
                    self.headers.append(P.unpack_chunk(raw)[0])
                    continue
                msg = P.parse_server(raw)
                self.messages.append(msg)
                if isinstance(msg, P.Ready):
                    self.ready = msg

    def audience_secret(self) -> str | None:
        return next((m.steer_secret for m in reversed(self.messages) if isinstance(m, P.Audience) and m.steer_secret),
                    None)

    async def close(self) -> None:
        await self.ws.close()
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task


class _Camera(VideoStreamTrack):
    """A 320x240 camera at 30 fps whose colour changes every frame."""

    def __init__(self) -> None:
        super().__init__()
        self.sent = 0

    async def recv(self) -> av.VideoFrame:
        pts, time_base = await self.next_timestamp()
        frame = av.VideoFrame.from_ndarray(np.full((240, 320, 3), (self.sent * 7) % 256, np.uint8), format="rgb24")
        frame.pts, frame.time_base = pts, time_base
        self.sent += 1
        return frame


class _Undecodable(VideoStreamTrack):
    """H.264 access units no decoder can decode (a non-IDR slice of random bytes, no SPS/PPS ever), `fps` a second,
    handed to aiortc as packets (it sends a packet as it is)."""

    def __init__(self, fps: float) -> None:
        super().__init__()
        self.fps = fps
        self.sent = 0
        self._t0: float | None = None

    async def recv(self) -> av.Packet:
        loop = asyncio.get_running_loop()
        if self._t0 is None:
            self._t0 = loop.time()
        await asyncio.sleep(max(0.0, self._t0 + self.sent / self.fps - loop.time()))
        packet = av.Packet(b"\x00\x00\x00\x01\x41" + os.urandom(160))
        packet.pts, packet.time_base = int(self.sent * 90000 / self.fps), VIDEO_TIME_BASE
        self.sent += 1
        return packet


async def _publish(http: aiohttp.ClientSession, base: str, stream_id: str, secret: str, track) -> tuple:
    """A WHIP POST of an aiortc publisher of `track` (H.264): (pc, status, Location or the error's text, the offer,
    the answer or None)."""
    pc = RTCPeerConnection(rtc_configuration())
    transceiver = pc.addTransceiver(track, direction="sendonly")
    transceiver.setCodecPreferences([c for c in RTCRtpSender.getCapabilities("video").codecs
                                     if c.mimeType.lower() == "video/h264"])
    offer = await complete_local_description(pc, await pc.createOffer(), LOOPBACK, 10)
    async with http.post(f"{base}/whip/{stream_id}?secret={secret}", data=offer, headers=SDP) as r:
        body = await r.text()
        if r.status != 201:
            return pc, r.status, body[:200], offer, None
        await pc.setRemoteDescription(RTCSessionDescription(body, "answer"))
        return pc, r.status, r.headers["Location"], offer, body


async def _until(check, seconds: float) -> bool:
    for _ in range(int(seconds / 0.02)):
        if check():
            return True
        await asyncio.sleep(0.02)
    return bool(check())


def _restyled_since(viewer: _Viewer, n: int) -> bool:
    return any(h.input == "frames" for h in viewer.headers[n:])


# ---------------------------------------------------------------- old steerer


async def _old_steerer(server: Served) -> dict:
    _loopback_only()
    base = f"http://{HOST}:{server.port}"
    pcs: list = []
    steerer = watcher = None
    try:
        async with aiohttp.ClientSession() as http:
            steerer = await _Viewer.open(server.url, {"type": "start", "prompt": "a red ball", "seed": 3, "input": True})
            sid, old = steerer.ready.stream_id, steerer.ready.steer_secret
            watcher = await _Viewer.open(server.url, {"type": "watch", "stream_id": sid,
                                                      "secret": steerer.ready.watch_secret})
            pc_old, status, location, _, _ = await _publish(http, base, sid, old, _Camera())
            pcs.append(pc_old)
            if status != 201:
                raise RuntimeError(f"the first WHIP POST got {status}: {location}")
            fed = await _until(lambda: pc_old.connectionState == "connected" and _restyled_since(steerer, 0), T)
            print(f"old steerer: stream {sid}, WHIP publisher with its steer secret: {status}, input restyled: {fed}")

            t0 = time.monotonic()
            await steerer.ws.send(json.dumps({"type": "handover", "to": watcher.ready.viewer_id}))
            got = await _until(lambda: watcher.audience_secret() is not None, T)
            secret_s = time.monotonic() - t0 if got else None
            new = watcher.audience_secret()
            ended = await _until(lambda: pc_old.connectionState != "connected", 10.0)
            ended_s = time.monotonic() - t0 if ended else None
            async with http.delete(base + location) as r:
                delete_status = r.status  # 404: the server had ended it; 200: this DELETE did
            print(f"old steerer: handover -> the new steerer's secret in {secret_s and round(secret_s, 3)} s "
                  f"(new: {new is not None and new != old}); the old publisher's connection {pc_old.connectionState} "
                  f"after {ended_s and round(ended_s, 3)} s; DELETE of its session {delete_status}")
            pc, old_status, old_text, _, _ = await _publish(http, base, sid, old, _Camera())
            pcs.append(pc)
            n = len(watcher.headers)
            pc, new_status, _, _, _ = await _publish(http, base, sid, new, _Camera()) if new else (None, None, 0, 0, 0)
            pcs.append(pc)
            new_fed = new_status == 201 and await _until(lambda: _restyled_since(watcher, n), T)
            print(f"old steerer: WHIP POST with the old secret {old_status} ({old_text[:80]!r}); with the new "
                  f"{new_status}, its input restyled: {new_fed}")
            return {"input_restyled_before": fed, "new_secret": new is not None and new != old,
                    "secret_after_handover_s": secret_s and round(secret_s, 3),
                    "old_session_ended_s": ended_s and round(ended_s, 3), "old_pc_state": pc_old.connectionState,
                    "old_session_delete_status": delete_status, "old_secret_post_status": old_status,
                    "new_secret_post_status": new_status, "new_input_restyled": new_fed}
    finally:
        for pc in pcs:
            if pc is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(pc.close(), 5)
        for viewer in (steerer, watcher):
            if viewer is not None:
                await viewer.close()


def old_steerer(serve_args: Sequence[str] = ()) -> dict:
    """The "old steerer" must-show (module doc); its figures."""
    with limited_server(["--ice-address", "127.0.0.1", *serve_args], nofile=4096) as server:
        figures = asyncio.run(_old_steerer(server))
        figures["server_log_tail"] = server.log_tail(8) if not figures["old_session_ended_s"] else None
    return {"case": "old_steerer", **figures}


def old_steerer_holds(f: dict) -> bool:
    return (f["new_secret"] and f["old_session_ended_s"] is not None and f["old_session_ended_s"] < 5.0
            and f["old_session_delete_status"] == 404 and f["old_secret_post_status"] == 404
            and f["new_secret_post_status"] == 201)


# ---------------------------------------------------------------- log flood


def _stun_flood(offer: str, answer: str, checks: int) -> int:
    """Authenticated STUN checks to the server's ICE agent of a session, each from a new port (a new address to it,
    so a peer-reflexive candidate); the checks sent."""
    def value(sdp: str, name: str) -> str:
        return re.search(rf"^a={name}:(\S+)", sdp, re.M).group(1)

    port = int(re.search(r"^a=candidate:\S+ 1 udp \d+ 127\.0\.0\.1 (\d+) typ host", answer, re.M).group(1))
    username, password = f"{value(answer, 'ice-ufrag')}:{value(offer, 'ice-ufrag')}", value(answer, "ice-pwd")
    for _ in range(checks):
        request = stun.Message(message_method=stun.Method.BINDING, message_class=stun.Class.REQUEST)
        request.attributes.update({"USERNAME": username, "PRIORITY": 1853824767, "ICE-CONTROLLING": 1234567890123})
        request.add_message_integrity(password.encode())
        request.add_fingerprint()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind((HOST, 0))
            s.sendto(bytes(request), (HOST, port))
    return checks


async def _whep_player(http: aiohttp.ClientSession, base: str, sid: str, watch_secret: str) -> int:
    """A WHEP player that connects, plays a moment and leaves (DELETE): the status of its POST."""
    pc = RTCPeerConnection(rtc_configuration())
    try:
        pc.addTransceiver("video", direction="recvonly")
        offer = await complete_local_description(pc, await pc.createOffer(), LOOPBACK, 10)
        async with http.post(f"{base}/whep/{sid}?secret={watch_secret}", data=offer, headers=SDP) as r:
            if r.status != 201:
                return r.status
            location = r.headers["Location"]
            await pc.setRemoteDescription(RTCSessionDescription(await r.text(), "answer"))
        await _until(lambda: pc.connectionState == "connected", 10)
        await asyncio.sleep(0.5)
        async with http.delete(base + location):
            pass
        return 201
    finally:
        await asyncio.wait_for(pc.close(), 5)


def count_lines(text: str) -> tuple[Counter, Counter, Counter]:
    """Lines, bytes and lines held back (what the gate's "[N more lines from X held back" says) of a server log by
    source: a library's top package (libav's counted with av), each of our loggers by its name, or "other" for a
    line that is no record (a traceback, stderr)."""
    lines, size, held = Counter(), Counter(), Counter()
    for line in text.splitlines():
        m = LINE.match(line)
        name = "other" if m is None else m.group(2)
        source = name if name.startswith("streamsvc.") else name.split(".")[0]
        source = "av" if source == "libav" else source
        lines[source] += 1
        size[source] += len(line) + 1
        more = HELD.search(line)
        if more:
            held[source] += int(more.group(1))
    return lines, size, held


async def _log_flood(server: Served, seconds: float, fps: float) -> dict:
    _loopback_only()
    base = f"http://{HOST}:{server.port}"
    offset = server.log_path.stat().st_size
    t0 = time.monotonic()
    pc = steerer = None
    sent = Counter()
    try:
        async with aiohttp.ClientSession() as http:
            steerer = await _Viewer.open(server.url, {"type": "start", "prompt": "a red ball", "seed": 3, "input": True})
            sid = steerer.ready.stream_id
            track = _Undecodable(fps)
            pc, status, location, offer, answer = await _publish(http, base, sid, steerer.ready.steer_secret, track)
            if status != 201:
                raise RuntimeError(f"the WHIP POST got {status}: {location}")
            await _until(lambda: pc.connectionState == "connected", T)
            print(f"log flood: stream {sid}, a publisher of undecodable frames at {fps:g} a second for {seconds:g} s")
            end = time.monotonic() + seconds
            sent["stun_checks"] = await asyncio.to_thread(_stun_flood, offer, answer, 200)
            for _ in range(300):
                async with http.get(f"{base}/healthz") as r:
                    sent[f"healthz_{r.status}"] += 1
            for _ in range(5):
                sent[f"whep_{await _whep_player(http, base, sid, steerer.ready.watch_secret)}"] += 1
            await asyncio.sleep(max(0.0, end - time.monotonic()))
            sent["undecodable_frames"] = track.sent
            async with http.delete(base + location) as r:
                sent[f"whip_delete_{r.status}"] += 1
    finally:
        if pc is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(pc.close(), 5)
        if steerer is not None:
            await steerer.close()
    await asyncio.sleep(2.0)  # the server's lines of the ends
    window_s = time.monotonic() - t0
    with open(server.log_path, "rb") as f:
        f.seek(offset)
        text = f.read().decode(errors="replace")
    lines, size, held = count_lines(text)
    allowed = BOUND_PER_MINUTE * max(1.0, window_s / 60.0)
    print(f"log flood: sent {dict(sent)}; in {window_s:.1f} s the server wrote {sum(lines.values())} lines "
          f"({sum(size.values()) / 1024:.1f} KiB): {dict(lines)}; held back, as the lines that passed say: "
          f"{dict(held)}")
    return {"seconds": seconds, "fps": fps, "sent": dict(sent), "window_s": round(window_s, 1),
            "lines": dict(lines), "bytes": dict(size), "held_back": dict(held), "allowed_per_source": round(allowed, 1),
            "over": sorted(s for s, n in lines.items() if n > allowed and not s.startswith("streamsvc.")),
            "ours_over": sorted(s for s, n in lines.items() if n > allowed and s.startswith("streamsvc."))}


def log_flood(seconds: float = 10.0, fps: float = 100.0, serve_args: Sequence[str] = ()) -> dict:
    """The "log flood" must-show (module doc); its figures."""
    with limited_server(["--ice-address", "127.0.0.1", *serve_args], nofile=4096) as server:
        figures = asyncio.run(_log_flood(server, seconds, fps))
        figures["server_log_tail"] = server.log_tail(12) if figures["over"] else None
    return {"case": "log_flood", **figures}
