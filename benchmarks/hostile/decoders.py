"""The resolution bomb (issue 41, item 3): input whose H.264 SPS declares 8192x8192, over the WebSocket and over WHIP.

    python -m benchmarks.hostile --case resolution_bomb

A fresh server (tiny preset, CPU, the defaults), on loopback. For each path, a stream with input starts and sends a
few real frames (a 64x48 camera, libx264), and once the server's RSS has settled the bomb goes: a real 64x48 IDR whose
SPS is rewritten to declare 8192x8192 (streamsvc/inputs/bitstream.py `with_size`; 197 kB of it took 289 MiB before issue
41, and 1.9 CPU-seconds a second). The server's peak RSS is reset just before (Linux: /proc/PID/clear_refs, so
VmHWM is the peak from then on) and read 1 s after.

- WebSocket: a `start` with input, then input messages (streamsvc/wire/framing.py). Refused: the `error`
  (`input_refused`) reaches the client; timed from the bomb's send.
- WHIP: the stream's steer secret publishes an aiortc track of encoded frames (aiortc packetizes an `av.Packet` as it
  is): the camera's, the bomb, then the camera's P-frames for a second. Refused: the server ends the session (its log's "refused" line, or the publisher's peer connection leaving
  "connected", whichever is seen first; polled every 5 ms); timed from the moment the track handed the bomb over.

What must hold, for each path: the peak RSS grows by under 32 MiB, and the refusal comes within 1 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Sequence
from fractions import Fraction

import aiohttp
import aioice.ice
import av
import numpy as np
from aiortc import RTCPeerConnection, RTCRtpSender, RTCSessionDescription, VideoStreamTrack
from websockets.asyncio.client import connect

from streamsvc.inputs.bitstream import NAL_SPS, nal_units, with_size
from streamsvc.wire import protocol as P
from streamsvc.wire.framing import InputHeader, pack_input
from streamsvc.wire.rtc import complete_local_description, rtc_configuration

from .common import HOST, Served, T, limited_server

BOMB = (8192, 8192)  # what the bomb's SPS declares
CAMERA = (64, 48)  # the real frames' size (and the bomb's slices')
WARM_FRAMES = 16  # real frames sent before the bomb (one second at the stream's 16 fps)
SETTLE_S = 1.5  # from the last real frame to the bomb: the server's RSS settles
AFTER_S = 1.0  # from the refusal to the peak RSS's reading
MAX_RSS_MIB = 32.0
MAX_REFUSAL_S = 1.0
SDP = {"Content-Type": "application/sdp"}
VIDEO_TIME_BASE = Fraction(1, 90_000)


def camera_frames(n: int) -> list[bytes]:
    """`n` access units of a 64x48 camera (libx264 ultrafast, an IDR with SPS/PPS first)."""
    codec = av.CodecContext.create("libx264", "w")
    codec.width, codec.height, codec.pix_fmt, codec.time_base = *CAMERA, "yuv420p", Fraction(1, 16)
    codec.options = {"preset": "ultrafast", "tune": "zerolatency"}
    out = []
    for i in range(n):
        frame = av.VideoFrame.from_ndarray(np.full((CAMERA[1], CAMERA[0], 3), 9 * i % 256, np.uint8), format="rgb24")
        frame.pts = i
        out += [bytes(p) for p in codec.encode(frame)]
    return out + [bytes(p) for p in codec.encode(None)]


def bomb(idr: bytes, size: tuple[int, int] = BOMB) -> bytes:
    """A real IDR (SPS, PPS, slices) whose SPS declares `size` instead."""
    sps = next(u for u in nal_units(idr) if u[0] & 0x1F == NAL_SPS)
    return idr.replace(sps, with_size(sps, *size))


def _status(pid: int, key: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def reset_peak(pid: int) -> bool:
    """Reset the process's peak RSS (VmHWM) to its RSS now (Linux 4.0+); False where that is not allowed."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class _Peak:
    """The server's peak RSS from `start()`: VmHWM after a reset, or else the highest of VmRSS sampled every 5 ms."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.before = _status(pid, "VmRSS") or 0
        self.hwm = reset_peak(pid)
        self.sampled = self.before
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if not self.hwm:
            self._task = asyncio.create_task(self._sample())

    async def _sample(self) -> None:
        for _ in range(int((T + 10) / 0.005)):  # bounded: the case ends well before
            self.sampled = max(self.sampled, _status(self.pid, "VmRSS") or 0)
            await asyncio.sleep(0.005)

    def added_mib(self) -> float:
        if self._task is not None:
            self._task.cancel()
        peak = _status(self.pid, "VmHWM") if self.hwm else self.sampled
        return round(((peak or 0) - self.before) / (1 << 20), 1)


def _ready(msg) -> P.Ready:
    if isinstance(msg, P.Ready):
        return msg
    raise RuntimeError(f"the stream with input was not admitted: {msg}")


# ---------------------------------------------------------------- over the WebSocket


async def _over_ws(server: Served, frames: list[bytes]) -> dict:
    async with connect(server.url, max_size=P.MAX_CHUNK_BYTES, open_timeout=T, compression=None) as ws:
        await ws.send(json.dumps({"type": "start", "prompt": "a red ball", "input": True}))
        errors: list[tuple[float, P.Error]] = []
        chunks = [0]

        async def read() -> None:
            with contextlib.suppress(Exception):
                async for raw in ws:
                    if isinstance(raw, bytes):
                        chunks[0] += 1
                    elif isinstance(msg := P.parse_server(raw), P.Error):
                        errors.append((time.monotonic(), msg))

        _ready(P.parse_server(await asyncio.wait_for(ws.recv(), T)))
        reader = asyncio.create_task(read())
        t0 = time.time() * 1000
        for i, unit in enumerate(frames[:WARM_FRAMES]):  # the camera's first second, in real time
            await ws.send(pack_input(InputHeader.describe([unit], [t0 + 62.5 * i], index=i, pts=i, keyframe=i == 0),
                                     [unit]))
            await asyncio.sleep(1 / 16)
        await asyncio.sleep(SETTLE_S)
        peak = _Peak(server.proc.pid)
        peak.start()
        unit = bomb(frames[0])
        header = InputHeader.describe([unit], [t0 + 62.5 * WARM_FRAMES], index=WARM_FRAMES, pts=WARM_FRAMES,
                                      keyframe=True)
        sent_at = time.monotonic()
        await ws.send(pack_input(header, [unit]))
        for _ in range(int(T / 0.005)):  # bounded: the refusal, or T
            if errors:
                break
            await asyncio.sleep(0.005)
        refused_s = round(errors[0][0] - sent_at, 3) if errors else None
        await asyncio.sleep(AFTER_S)
        added = peak.added_mib()
        going = chunks[0]
        await asyncio.sleep(1.0)
        reader.cancel()
        return {"bomb_bytes": len(unit), "refused_s": refused_s, "rss_added_mib": added,
                "error": f"{errors[0][1].code.value}: {errors[0][1].message}"[:200] if errors else None,
                "stream_goes_on": chunks[0] > going, "peak_from": "VmHWM" if peak.hwm else "sampled VmRSS"}


# ---------------------------------------------------------------- over WHIP


class _Encoded(VideoStreamTrack):
    """Encoded frames at 16 fps (aiortc sends an av.Packet as it is): the camera's, then, once `go` is set, the bomb,
    then the camera's P-frames again for a second (before issue 41 aiortc's jitter buffer handed a frame to its
    decoder only when the next one came, and the refusal waited for the frame after that); then nothing more."""

    def __init__(self, frames: list[bytes], bomb_frame: bytes) -> None:
        super().__init__()
        self.frames, self.bomb = frames, bomb_frame
        self.go = asyncio.Event()
        self.sent = 0
        self.bomb_at: float | None = None  # time.monotonic() when the bomb was handed to aiortc

    async def recv(self) -> av.Packet:
        n = len(self.frames)
        if self.sent < n:
            data = self.frames[self.sent]
        elif self.sent == n:
            await asyncio.wait_for(self.go.wait(), 60)
            data = self.bomb
        elif self.sent < 2 * n:
            data = self.frames[self.sent - n]  # P-frames (the first one: frames[1])
        else:
            await asyncio.sleep(60)  # nothing more
            raise asyncio.CancelledError
        await asyncio.sleep(1 / 16)
        if data is self.bomb:
            self.bomb_at = time.monotonic()
        packet = av.Packet(data)
        packet.pts, packet.time_base = 5625 * self.sent, VIDEO_TIME_BASE
        self.sent += 1
        return packet


async def _over_whip(server: Served, frames: list[bytes]) -> dict:
    aioice.ice.get_host_addresses = lambda use_ipv4, use_ipv6: ["127.0.0.1"]  # loopback only, no STUN
    base = f"http://{HOST}:{server.port}"
    async with connect(server.url, max_size=P.MAX_CHUNK_BYTES, open_timeout=T, compression=None) as ws, \
            aiohttp.ClientSession() as http:
        await ws.send(json.dumps({"type": "start", "prompt": "a red ball", "input": True}))
        ready = _ready(P.parse_server(await asyncio.wait_for(ws.recv(), T)))
        chunks = [0]

        async def read() -> None:
            with contextlib.suppress(Exception):
                async for raw in ws:
                    chunks[0] += isinstance(raw, bytes)

        reader = asyncio.create_task(read())
        track = _Encoded(frames[:WARM_FRAMES], bomb(frames[0]))
        pc = RTCPeerConnection(rtc_configuration())
        try:
            transceiver = pc.addTransceiver(track, direction="sendonly")
            transceiver.setCodecPreferences([c for c in RTCRtpSender.getCapabilities("video").codecs
                                             if c.mimeType.lower() == "video/h264"])
            offer = await complete_local_description(pc, await pc.createOffer(), ("127.0.0.1",), 10)
            async with http.post(f"{base}/whip/{ready.stream_id}?secret={ready.steer_secret}", data=offer,
                                 headers=SDP) as r:
                if r.status != 201:
                    raise RuntimeError(f"WHIP POST: {r.status} {await r.text()}")
                await pc.setRemoteDescription(RTCSessionDescription(await r.text(), "answer"))
            for _ in range(int(T / 0.05)):  # bounded: the camera's frames sent
                if track.sent >= len(track.frames) and pc.connectionState == "connected":
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(SETTLE_S)
            log_before = len(server.log_path.read_bytes())
            peak = _Peak(server.proc.pid)
            peak.start()
            track.go.set()
            refused_at, seen = None, None
            for _ in range(int(T / 0.005)):  # bounded: the session ends, or T
                if track.bomb_at is not None:
                    if pc.connectionState != "connected":
                        refused_at, seen = time.monotonic(), f"the peer connection {pc.connectionState}"
                        break
                    if b"refused" in server.log_path.read_bytes()[log_before:]:
                        refused_at, seen = time.monotonic(), "the server's log"
                        break
                await asyncio.sleep(0.005)
            refused_s = round(refused_at - track.bomb_at, 3) if refused_at is not None else None
            await asyncio.sleep(AFTER_S)
            added = peak.added_mib()
            going = chunks[0]
            await asyncio.sleep(1.0)
            line = next((ln for ln in server.log_path.read_text(errors="replace").splitlines()
                         if "WHIP into stream" in ln and "refused" in ln), None)
            return {"bomb_bytes": len(track.bomb), "refused_s": refused_s, "seen_by": seen, "rss_added_mib": added,
                    "log": line[-200:] if line else None, "stream_goes_on": chunks[0] > going,
                    "peak_from": "VmHWM" if peak.hwm else "sampled VmRSS"}
        finally:
            await pc.close()
            reader.cancel()


# ---------------------------------------------------------------- the case


def resolution_bomb(serve_args: Sequence[str] = ()) -> dict:
    """The resolution bomb over the WebSocket and over WHIP, each on a fresh server (the module docstring)."""
    frames = camera_frames(WARM_FRAMES)
    figures = {"case": "resolution_bomb", "declares": f"{BOMB[0]}x{BOMB[1]}"}
    for path, run in (("ws", _over_ws), ("whip", _over_whip)):
        with limited_server(list(serve_args), 4096) as server:
            figures[path] = asyncio.run(run(server, frames))
        f = figures[path]
        print(f"resolution bomb over {path}: a {f['bomb_bytes']} B IDR declaring {figures['declares']}: refused "
              f"after {f['refused_s']} s, peak RSS +{f['rss_added_mib']} MiB ({f['peak_from']}); the stream goes on: "
              f"{f['stream_goes_on']}", flush=True)
    return figures


def holds(f: dict) -> bool:
    return all(f[path]["refused_s"] is not None and f[path]["refused_s"] < MAX_REFUSAL_S
               and f[path]["rss_added_mib"] < MAX_RSS_MIB for path in ("ws", "whip"))
