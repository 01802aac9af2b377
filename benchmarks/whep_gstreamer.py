"""A WHEP player that is not ours plays a stream (issue 36): GStreamer's webrtcbin, driven through PyGObject by the
system's Python (Debian 12: python3-gi, gir1.2-gst-plugins-bad-1.0, GStreamer 1.22), following the WHEP draft: a
recvonly H.264 transceiver, every candidate gathered, `POST /whep?prompt=...` as application/sdp, the 201's answer,
frames decoded for a while, `DELETE` on the Location.

    python benchmarks/whep_gstreamer.py [--seconds 5]       # the server in this process, the player a child

The same file, run by the system's Python with `--player URL`, is the player (it needs only gi and the standard
library). Per run: the POST's status, its time, the frames decoded (and their size), the time to the first one, the
DELETE's status. Ends with one JSON line.

What it found: GStreamer 1.22's DTLS serves an RSA certificate, and aiortc as a DTLS client offers ECDSA suites only
("no shared cipher"): a WHEP answer with setup:active fails its DTLS handshake with any webrtcbin player. The
server's answers are setup:passive (streamsvc/transport/webrtc.py, as streamsvc/door/whip.py's).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

SYSTEM_PYTHON = "/usr/bin/python3"


# ---------------------------------------------------------------- the player (system Python, gi)


def play(url: str, seconds: float) -> dict:
    import urllib.error
    import urllib.parse
    import urllib.request

    import gi

    gi.require_version("Gst", "1.0")
    gi.require_version("GstWebRTC", "1.0")
    gi.require_version("GstSdp", "1.0")
    from gi.repository import GLib, Gst, GstSdp, GstWebRTC

    Gst.init(None)
    result = {"status": None, "post_s": None, "frames": 0, "first_frame_s": None, "size": None, "delete": None,
              "error": None}
    pipe = Gst.Pipeline.new("player")
    rtc = Gst.ElementFactory.make("webrtcbin", "rtc")
    rtc.set_property("bundle-policy", GstWebRTC.WebRTCBundlePolicy.MAX_BUNDLE)
    pipe.add(rtc)
    caps = Gst.Caps.from_string("application/x-rtp,media=video,encoding-name=H264,payload=96,clock-rate=90000,"
                                "packetization-mode=(string)1,profile-level-id=(string)42e01f")
    loop = GLib.MainLoop()
    began = time.monotonic()
    location = {}

    def on_frame(_sink, buffer, pad):
        result["frames"] += 1
        if result["first_frame_s"] is None:
            result["first_frame_s"] = round(time.monotonic() - began, 3)
            s = pad.get_current_caps().get_structure(0)
            result["size"] = [s.get_value("width"), s.get_value("height")]

    def on_decoded(_bin, pad):
        if not pad.get_current_caps().to_string().startswith("video/x-raw"):
            return
        sink = Gst.ElementFactory.make("fakesink")
        sink.set_property("signal-handoffs", True)
        sink.set_property("sync", False)
        sink.connect("handoff", on_frame)
        pipe.add(sink)
        sink.sync_state_with_parent()
        pad.link(sink.get_static_pad("sink"))

    def on_pad(_rtc, pad):
        if pad.get_direction() != Gst.PadDirection.SRC:
            return
        decode = Gst.ElementFactory.make("decodebin")
        decode.connect("pad-added", on_decoded)
        pipe.add(decode)
        decode.sync_state_with_parent()
        pad.link(decode.get_static_pad("sink"))

    def post_offer():
        offer = rtc.get_property("local-description").sdp.as_text()
        request = urllib.request.Request(url, data=offer.encode(), method="POST",
                                         headers={"Content-Type": "application/sdp"})
        t0 = time.monotonic()
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                result["status"] = response.status
                location["url"] = urllib.parse.urljoin(url, response.headers["Location"])
                answer = response.read().decode()
        except urllib.error.HTTPError as e:
            result["status"], result["error"] = e.code, e.read().decode()[:300]
            loop.quit()
            return False
        except OSError as e:  # no server there
            result["error"] = str(e)[:300]
            loop.quit()
            return False
        result["post_s"] = round(time.monotonic() - t0, 3)
        _, sdp = GstSdp.SDPMessage.new_from_text(answer)
        rtc.emit("set-remote-description",
                 GstWebRTC.WebRTCSessionDescription.new(GstWebRTC.WebRTCSDPType.ANSWER, sdp), Gst.Promise.new())
        GLib.timeout_add(int(seconds * 1000), loop.quit)  # plays `seconds` from its answer
        return False

    def on_gathering(*_):
        if rtc.get_property("ice-gathering-state") == GstWebRTC.WebRTCICEGatheringState.COMPLETE:
            GLib.idle_add(post_offer)

    def on_offer(promise, _data):
        promise.wait()
        reply = promise.get_reply()
        offer = reply.get_value("offer") if reply is not None and reply.has_field("offer") else None
        if offer is not None and offer.sdp is not None:  # (a second negotiation's comes back empty)
            rtc.emit("set-local-description", offer, Gst.Promise.new())

    def on_negotiation_needed(element):  # (an offer made before this comes back empty in GStreamer 1.22)
        element.emit("create-offer", None, Gst.Promise.new_with_change_func(on_offer, None))

    rtc.connect("pad-added", on_pad)
    rtc.connect("notify::ice-gathering-state", on_gathering)
    rtc.connect("on-negotiation-needed", on_negotiation_needed)
    rtc.emit("add-transceiver", GstWebRTC.WebRTCRTPTransceiverDirection.RECVONLY, caps)
    pipe.set_state(Gst.State.PLAYING)
    GLib.timeout_add(int((seconds + 20) * 1000), loop.quit)  # a bound, whatever happens
    loop.run()
    if "url" in location:
        try:
            with urllib.request.urlopen(urllib.request.Request(location["url"], method="DELETE"), timeout=10) as r:
                result["delete"] = r.status
        except urllib.error.HTTPError as e:
            result["delete"] = e.code
    pipe.set_state(Gst.State.NULL)
    return result


# ---------------------------------------------------------------- the driver (the project's Python)


async def drive(seconds: float) -> dict:
    import asyncio

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from streamsvc.engine.config import EngineConfig
    from streamsvc.viewers.server import Server, ServerConfig

    # the server gathers on this host's addresses and loopback (libnice offers no loopback candidate)
    server = Server(EngineConfig(preset="tiny", device="cpu"), ServerConfig(port=0))
    await server.start()
    try:
        url = f"http://127.0.0.1:{server.port}/whep?prompt=a%20red%20ball%20moving%20right"
        proc = await asyncio.create_subprocess_exec(SYSTEM_PYTHON, __file__, "--player", url, "--seconds",
                                                    str(seconds), stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), seconds + 40)
        lines = out.decode().strip().splitlines()
        result = json.loads(lines[-1]) if lines else {"error": err.decode()[-500:]}
        for _ in range(100):
            if not server.sessions:
                break
            await asyncio.sleep(0.05)
        result["streams_left"] = len(server.sessions)
        return result
    finally:
        await asyncio.wait_for(server.stop(), 30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="how long the player plays")
    parser.add_argument("--player", metavar="URL", help="be the player (the system's Python with gi)")
    args = parser.parse_args()
    if args.player:
        print(json.dumps(play(args.player, args.seconds)))
        return
    import asyncio

    result = asyncio.run(drive(args.seconds))
    print(f"GStreamer WHEP player: POST {result.get('status')} in {result.get('post_s')} s, {result.get('frames')} "
          f"frames {result.get('size')} in {args.seconds:g} s (first after {result.get('first_frame_s')} s), DELETE "
          f"{result.get('delete')}, streams left {result.get('streams_left')}" + (
              f"; error: {result['error']}" if result.get("error") else ""))
    ok = result.get("status") == 201 and result.get("frames", 0) >= 16 * args.seconds * 0.5 and \
        result.get("delete") == 200 and result.get("streams_left") == 0
    print(json.dumps({"benchmark": "whep_gstreamer", "ok": ok, **result}))


if __name__ == "__main__":
    main()
