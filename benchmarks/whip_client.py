"""A WHIP client that is not ours feeds a stream's input (issue 36): Debian's `whip-client` (package
simple-whip-client, GStreamer's webrtcbin) publishes a .y4m rendered from models/scenes.py over loopback
(`filesrc ! y4mdec ! x264enc tune=zerolatency ! rtph264pay`) into a stream opened with input.

The server runs in this process (tiny preset, CPU, ICE on 127.0.0.1). A stream is opened with `start` and `"input":
true` over /ws (its steer secret in `ready`); then `whip-client -u http://127.0.0.1:PORT/whip/ID?secret=STEER` runs,
once with -n (every candidate in the offer) and once without (trickle: its PATCHes get 405, and it connects with
the candidates its offer has). Per run: whip-client's exit, the 201's time, the time to the first input frame, the
frames the server's input received and its decode errors, and the chunks that came out restyling input frames
(headers with input "frames"), when the server's start-with-input (issue 35) is in the tree; without it an
InputFrames is attached to the session (as tests/client/test_whip.py does) and only the input's counts are read.

    apt-get install -y simple-whip-client gstreamer1.0-plugins-bad gstreamer1.0-plugins-ugly gstreamer1.0-libav
    python benchmarks/whip_client.py [--seconds 8]

Prints a line per run; ends with one JSON line.

On Debian 12 (bookworm) the packaged whip-client (0.0~git20230131-1, installed in about 21 s) aborts at start:
it links libsoup-2.4 while GStreamer's nice plugin (libnice -> gupnp-igd -> gssdp) loads libsoup-3, and GLib refuses
both in one process ("libsoup2 symbols detected"). The script says so; CI uses an aiortc publisher instead
(tests/client/test_whip.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import av
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.scenes import Scene, draw  # noqa: E402
from streamsvc import protocol as P  # noqa: E402
from streamsvc.engine import EngineConfig  # noqa: E402
from streamsvc.inputs import InputFrames  # noqa: E402
from streamsvc.rtc import WebRtcConfig  # noqa: E402
from streamsvc.server import Server, ServerConfig  # noqa: E402

WIDTH, HEIGHT, FPS = 320, 240, 30


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


def pipeline(y4m: Path) -> str:
    return (f"filesrc location={y4m} ! y4mdec ! clocksync ! videoconvert ! queue ! "
            "x264enc tune=zerolatency speed-preset=ultrafast key-int-max=30 bitrate=600 ! "
            "video/x-h264,profile=constrained-baseline ! rtph264pay config-interval=-1 pt=96 ! queue ! "
            "application/x-rtp,media=video,encoding-name=H264,payload=96")


async def open_stream(server: Server):
    """A stream with input over /ws: (its id, steer secret, the socket, the chunk headers it gets)."""
    from websockets.asyncio.client import connect

    ws = await connect(f"ws://127.0.0.1:{server.port}/ws", max_size=P.MAX_CHUNK_BYTES)
    await ws.send(json.dumps({"type": "start", "prompt": "a blue ball", "input": True}))
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
                headers.append(P.unpack_chunk(raw)[0])

    reader = asyncio.create_task(read())
    return ready["stream_id"], ready["steer_secret"], ws, headers, reader


async def one_run(server: Server, y4m: Path, seconds: float, trickle: bool) -> dict:
    stream_id, steer, ws, headers, reader = await open_stream(server)
    session = server.sessions[stream_id]
    attached = getattr(session, "input", None) is None
    if attached:  # the server's start-with-input (issue 35) not in this tree: the benchmark attaches one
        gen = server.engine.gen
        session.input = InputFrames(gen.model_cfg.width, gen.model_cfg.height, session.fps)
    url = f"http://127.0.0.1:{server.port}/whip/{stream_id}?secret={steer}"
    args = ["whip-client", "-u", url, "-V", pipeline(y4m), "-l", "4", "-o"] + ([] if trickle else ["-n"])
    started = time.monotonic()
    proc = await asyncio.create_subprocess_exec(*args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
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
    restyled = sum(1 for h in headers if getattr(h, "input", "none") == "frames")
    await ws.close()
    reader.cancel()
    patches = sum("405" in line for line in log_lines)
    return {"trickle": trickle, "exit": proc.returncode, "created_s": created, "first_input_frame_s": first_frame,
            "input_received": stats["received"], "decode_errors": stats["decode_errors"], "chunks": len(headers),
            "chunks_restyling_input": None if attached else restyled, "patch_405_lines": patches,
            "log_tail": log_lines[-6:]}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="length of the .y4m and of each run")
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
        server = Server(EngineConfig(preset="tiny", device="cpu"),
                        ServerConfig(port=0, webrtc=WebRtcConfig(ice_addresses=("127.0.0.1",))))
        await server.start()
        try:
            runs = [await one_run(server, y4m, args.seconds, trickle) for trickle in (False, True)]
        finally:
            await asyncio.wait_for(server.stop(), 30)
    for run in runs:
        print(f"whip-client {'(trickle)' if run['trickle'] else '-n'}: 201 after {run['created_s']} s, first input "
              f"frame after {run['first_input_frame_s']} s, {run['input_received']} frames into the input, "
              f"{run['decode_errors']} decode errors, {run['chunks']} chunks ({run['chunks_restyling_input']} "
              f"restyling input), exit {run['exit']}")
        for line in run["log_tail"]:
            print("    |", line[:160])
    ok = all(r["input_received"] >= 0.5 * frames and r["decode_errors"] == 0 for r in runs)
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
