"""A WHIP client that is not ours feeds a stream's input (issue 36): Debian's `whip-client` (package
simple-whip-client, GStreamer's webrtcbin) publishes a .y4m rendered from models/scenes.py over loopback
(`filesrc ! y4mdec ! x264enc tune=zerolatency ! rtph264pay`) into a stream opened with input.

The server runs in this process (tiny preset, CPU; ICE on this host's addresses and loopback, see below). A stream is opened with `start` and `"input":
true` over /ws (its steer secret in `ready`); then `whip-client -u http://127.0.0.1:PORT/whip/ID?secret=STEER` runs,
once with -n (every candidate in the offer) and once without (trickle: its PATCHes get 405, and it connects with
the candidates its offer has). Per run: whip-client's exit, the 201's time, the time to the first input frame, the
frames the server's input received and its decode errors, and the chunks that came out restyling input frames
(headers with input "frames"), when the server's start-with-input (issue 35) is in the tree; without it an
InputFrames is attached to the session (as tests/client/test_whip.py does) and only the input's counts are read.

    apt-get install -y simple-whip-client gstreamer1.0-plugins-bad gstreamer1.0-plugins-ugly gstreamer1.0-libav
    python benchmarks/whip_client.py [--seconds 8]

Per run it also reads the stream's pixels (client/pixels.py): the object's velocity in the chunks that restyle input
against the input ball's (+3.0 px a stream frame) and its colour against the prompt's (blue).

Prints a line per run; ends with one JSON line.

Two things stood between Debian 12's whip-client (0.0~git20230131-1, installed in about 21 s) and this server:
- it aborts at start as installed: it links libsoup-2.4, while GStreamer's nice plugin loads libsoup-3 (libnice ->
  gupnp-igd -> gupnp -> gssdp), and GLib refuses both in one process ("libsoup2 symbols detected"). The script builds
  a stand-in libgupnp-igd-1.0.so.4 (IGD_STUB: UPnP port mapping, of no use on loopback) with the system's C compiler
  and puts it first on whip-client's LD_LIBRARY_PATH (--no-igd-stub: as installed);
- DTLS: aiortc as a DTLS client offers ECDSA cipher suites only and GStreamer 1.22's DTLS serves an RSA certificate
  ("no shared cipher"); the server's WHIP answer is therefore setup:passive (streamsvc/door/whip.py).
libnice offers no loopback candidate: the server gathers on this host's addresses too (ICE_ADDRESSES); the media
stays on the host. tests/client/test_whip_client.py runs this script in CI (skipped without whip-client or cc).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import av
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.scenes import Scene, draw  # noqa: E402
from streamsvc.engine.config import EngineConfig  # noqa: E402
from streamsvc.viewers.server import Server, ServerConfig  # noqa: E402
from streamsvc.wire import protocol as P  # noqa: E402
from streamsvc.wire.rtc import WebRtcConfig  # noqa: E402

WIDTH, HEIGHT, FPS = 320, 240, 30
# the server gathers on this host's interfaces as well as loopback: libnice (whip-client's ICE) offers no loopback
# candidate, so the pairs that work are between this host's own addresses (its traffic stays on the host)
ICE_ADDRESSES = ("*", "127.0.0.1")


def render_y4m(path: Path, seconds: float) -> int:
    """A red ball moving right on dark gray, WIDTH x HEIGHT at FPS, as YUV4MPEG2 (I420). Returns its frames."""
    n = int(seconds * FPS)
    xs = (np.arange(n) * 3.0) % WIDTH
    centres = np.stack([xs, np.full(n, HEIGHT / 2)], axis=1)
    frames = draw(centres, [Scene("red", "ball")], HEIGHT, WIDTH, "cpu", which=np.zeros(n, dtype=np.int64)).numpy()
    with av.open(str(path), "w", format="yuv4mpegpipe") as out:
        stream = out.add_stream("rawvideo", rate=FPS)
        stream.width, stream.height, stream.pix_fmt = WIDTH, HEIGHT, "yuv420p"
        for image in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24").reformat(format="yuv420p")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return n


IGD_STUB = r"""
/* A stand-in for libgupnp-igd-1.0.so.4 (UPnP port mapping, of no use on loopback). libnice needs these four symbols;
   with this library first on LD_LIBRARY_PATH nothing in whip-client's process loads libsoup-3 (gupnp-igd -> gupnp ->
   gssdp -> soup3), which GLib refuses beside whip-client's own libsoup-2.4. */
#include <stddef.h>
void *gupnp_simple_igd_thread_new(void) { return NULL; }
unsigned long gupnp_simple_igd_get_type(void) { return 20UL << 2; /* G_TYPE_OBJECT */ }
void gupnp_simple_igd_add_port(void *self, const char *protocol, unsigned int external_port, const char *local_ip,
                               unsigned int local_port, unsigned int lease_duration, const char *description) {}
void gupnp_simple_igd_remove_port_local(void *self, const char *protocol, const char *local_ip,
                                        unsigned int local_port) {}
"""


def build_igd_stub(folder: Path) -> Path | None:
    """libgupnp-igd-1.0.so.4 without UPnP (IGD_STUB), built with the system's C compiler; None without one."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    source = folder / "igd_stub.c"
    source.write_text(IGD_STUB)
    subprocess.run([cc, "-shared", "-fPIC", "-Wl,-soname,libgupnp-igd-1.0.so.4", "-o",
                    str(folder / "libgupnp-igd-1.0.so.4"), str(source)], check=True, timeout=60)
    return folder


def pipeline(y4m: Path) -> str:
    return (f"filesrc location={y4m} ! y4mdec ! clocksync ! videoconvert ! queue ! "
            "x264enc tune=zerolatency speed-preset=ultrafast key-int-max=30 bitrate=600 ! "
            "video/x-h264,profile=constrained-baseline ! rtph264pay config-interval=-1 pt=96 ! queue ! "
            "application/x-rtp,media=video,encoding-name=H264,payload=96")


async def open_stream(server: Server, strength: float = 0.3):
    """A stream with input over /ws: (its id, steer secret, the socket, the chunks it gets: header and access units)."""
    from websockets.asyncio.client import connect

    ws = await connect(f"ws://127.0.0.1:{server.port}/ws", max_size=P.MAX_CHUNK_BYTES)
    await ws.send(json.dumps({"type": "start", "prompt": "a blue ball", "input": True, "strength": strength}))
    ready = None
    for _ in range(20):
        msg = json.loads(await asyncio.wait_for(ws.recv(), 30))
        if msg["type"] in ("ready", "error"):
            ready = msg
            break
    if ready is None or ready["type"] != "ready":
        raise SystemExit(f"the stream did not open: {ready}")
    headers: list = []

    async def read() -> None:
        async for raw in ws:
            if isinstance(raw, bytes):
                headers.append(P.unpack_chunk(raw))  # (header, access units)

    reader = asyncio.create_task(read())
    print(f"stream {ready['stream_id']}: input {ready.get('input')}, strength {ready.get('strength')} of "
          f"{ready.get('strengths')}")
    return ready["stream_id"], ready["steer_secret"], ws, headers, reader


def motion_of(chunks: list) -> dict:
    """Read the stream's pixels (client/pixels.py): the object's median velocity (px per frame, model space) in the
    chunks restyling input and in the others, and the colour it shows in the restyled ones. The input's red ball
    moves right 3 px a frame at 30 fps: centre-cropped to 240x240, scaled to 128 and resampled to 16 fps, that is
    +3.0 px a stream frame; the prompt ("a blue ball") asks for no motion."""
    from client import pixels

    decoder = av.CodecContext.create("h264", "r")
    by_kind: dict[str, list] = {"frames": [], "other": []}
    colours: list[str] = []
    for header, units in chunks:
        readings = []
        for unit in units:
            for frame in decoder.decode(av.Packet(unit)):
                readings.append(pixels.read_frame(frame.to_ndarray(format="rgb24")))
        kind = "frames" if getattr(header, "input", "none") == "frames" else "other"
        v = pixels.velocity(readings, header.width if hasattr(header, "width") else 128, 128) if readings else None
        if v is not None:
            by_kind[kind].append(v[0])
        if kind == "frames":
            colours += [r.colour for r in readings if r.colour is not None]
    median = lambda xs: round(float(np.median(xs)), 2) if xs else None  # noqa: E731
    return {"dx_per_frame_restyled": median(by_kind["frames"]), "dx_per_frame_other": median(by_kind["other"]),
            "expected_dx_per_frame": round(3 * 30 / 16 * 128 / 240, 2),
            "restyled_colour": max(set(colours), key=colours.count) if colours else None}


async def one_run(server: Server, y4m: Path, seconds: float, trickle: bool, stub: Path | None,
                  strength: float) -> dict:
    stream_id, steer, ws, headers, reader = await open_stream(server, strength)
    session = server.sessions[stream_id]
    url = f"http://127.0.0.1:{server.port}/whip/{stream_id}?secret={steer}"
    args = ["whip-client", "-u", url, "-V", pipeline(y4m), "-l", "4", "-o"] + ([] if trickle else ["-n"])
    started = time.monotonic()
    env = dict(os.environ)
    if stub is not None:
        env["LD_LIBRARY_PATH"] = f"{stub}{os.pathsep}{env.get('LD_LIBRARY_PATH', '')}"
    proc = await asyncio.create_subprocess_exec(*args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                                                env=env)
    first_frame = created = None
    log_lines: list[str] = []

    async def read_log() -> None:
        async for line in proc.stdout:
            log_lines.append(line.decode(errors="replace").rstrip())

    log_task = asyncio.create_task(read_log())
    for _ in range(int((seconds + 10) / 0.05)):
        if created is None and server.whep.whip.publishers.get(stream_id) is not None:
            created = time.monotonic() - started
        if first_frame is None and session.input.stats()["received"] > 0:
            first_frame = time.monotonic() - started
        if proc.returncode is not None or time.monotonic() - started > seconds + 10:
            break
        await asyncio.sleep(0.05)
    if proc.returncode is None:
        proc.send_signal(signal.SIGINT)
        try:
            await asyncio.wait_for(proc.wait(), 5)
        except TimeoutError:
            proc.kill()
            await proc.wait()
    await asyncio.wait_for(log_task, 5)
    stats = session.input.stats()
    restyled = sum(1 for h, _ in headers if getattr(h, "input", "none") == "frames")
    follow = motion_of(headers)
    await ws.close()
    reader.cancel()
    patches = sum("405" in line for line in log_lines)
    return {"trickle": trickle, "exit": proc.returncode, "created_s": created, "first_input_frame_s": first_frame,
            "input_received": stats["received"], "decode_errors": stats["decode_errors"], "chunks": len(headers),
            "chunks_restyling_input": restyled, "patch_405_lines": patches, **follow,
            "log_tail": log_lines[-8:]}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="length of the .y4m and of each run")
    parser.add_argument("--strength", type=float, default=0.3, help="the stream's input strength (snapped by the "
                        "server to the schedule's; 1: text-to-video)")
    parser.add_argument("--weights", default="builtin", help="the model's weights: builtin (default: the built-in "
                        "model, whose input adapter follows an input video) or a model file")
    parser.add_argument("--no-igd-stub", action="store_true", help="run whip-client as installed (on Debian 12 it "
                        "aborts: libsoup-2.4 and libsoup-3 in one process) instead of with the UPnP stub first")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if shutil.which("whip-client") is None:
        print("whip-client is missing: apt-get install -y simple-whip-client gstreamer1.0-plugins-bad "
              "gstreamer1.0-plugins-ugly gstreamer1.0-libav")
        print(json.dumps({"benchmark": "whip_client", "ok": False, "reason": "whip-client missing"}))
        return
    with tempfile.TemporaryDirectory() as tmp:
        y4m = Path(tmp) / "red_ball.y4m"
        frames = render_y4m(y4m, args.seconds)
        print(f"rendered {frames} frames {WIDTH}x{HEIGHT} at {FPS} fps into {y4m.name} ({y4m.stat().st_size >> 10} KiB)")
        server = Server(EngineConfig(preset="tiny", device="cpu", weights=args.weights),
                        ServerConfig(port=0, webrtc=WebRtcConfig(ice_addresses=ICE_ADDRESSES)))
        await server.start()
        try:
            stub = None if args.no_igd_stub else build_igd_stub(Path(tmp))
            print(f"whip-client runs {'with the UPnP stub first on LD_LIBRARY_PATH' if stub else 'as installed'}")
            runs = [await one_run(server, y4m, args.seconds, trickle, stub, args.strength) for trickle in (False, True)]
        finally:
            await asyncio.wait_for(server.stop(), 30)
    for run in runs:
        print(f"whip-client {'(trickle)' if run['trickle'] else '-n'}: 201 after {run['created_s']} s, first input "
              f"frame after {run['first_input_frame_s']} s, {run['input_received']} frames into the input, "
              f"{run['decode_errors']} decode errors, {run['chunks']} chunks ({run['chunks_restyling_input']} "
              f"restyling input), exit {run['exit']}; the object moves {run['dx_per_frame_restyled']} px a frame in "
              f"the restyled chunks ({run['restyled_colour']}), {run['dx_per_frame_other']} in the others (the input: "
              f"{run['expected_dx_per_frame']})")
        for line in run["log_tail"]:
            print("    |", line[:160])
    ok = all(r["input_received"] >= 0.5 * frames and r["decode_errors"] == 0 and r["exit"] == 0 for r in runs)
    # Debian 12's whip-client links libsoup-2.4, and webrtcbin's libnice pulls libsoup-3 in (gupnp-igd): GLib aborts
    clash = any("libsoup2 symbols detected" in line for r in runs for line in r["log_tail"])
    if clash:
        print("whip-client aborted at start: it links libsoup-2.4 and GStreamer's nice/webrtc plugins load libsoup-3 "
              "(libnice -> gupnp-igd -> gssdp); GLib refuses both in one process. A whip-client built against "
              "libsoup-3 (upstream's later commits), or another WHIP encoder (OBS, GStreamer's whipclientsink), runs.")
    print(json.dumps({"benchmark": "whip_client", "ok": ok, "y4m_frames": frames,
                      "reason": "whip-client aborts: libsoup2 and libsoup3 in one process" if clash else None,
                      "runs": [{k: v for k, v in r.items() if k != "log_tail"} for r in runs]}))


if __name__ == "__main__":
    asyncio.run(main())
