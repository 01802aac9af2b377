"""Third-party libraries' log lines gated like the server's own (issue 41, item 6): the gate's decisions with exact
values, and a flood down each path that makes a library log (aiortc's decoder thread on undecodable frames, aioice,
PyAV and libav, aiohttp's access log), counted at a handler as `streamsvc serve` installs it."""

from __future__ import annotations

import asyncio
import io
import logging
import os
import queue
import threading

import av
import av.logging
import pytest

from streamsvc import library_logs
from streamsvc.library_logs import LibraryLogGate, LineGate, source_of

BOUND = 10  # lines a minute from each library, at most


def test_the_gate_lets_through_per_key_and_per_source_in_any_period():
    gate = LineGate(per_key=2, per_source=3, period_s=60.0)
    a, b, c = ("aiortc.x", "a %s"), ("aiortc.x", "b %s"), ("aiortc.y", "c")
    assert [gate.allow("aiortc", a, t) for t in (0.0, 1.0, 2.0)] == [0, 0, None]  # 2 of a key
    assert gate.allow("aiortc", b, 3.0) == 1  # another key passes, and says 1 line was held back
    assert gate.allow("aiortc", c, 4.0) is None  # 3 of the source already
    assert gate.allow("aioice", ("aioice.ice", "a %s"), 4.0) == 0  # another source has its own count
    assert gate.allow("aiortc", c, 59.0) is None  # sliding: the 3 lines of 0.0, 1.0 and 3.0 are within 60 s
    assert gate.allow("aiortc", c, 60.5) == 2  # the line of 0.0 has left the window: c passes, 2 held back before
    assert gate.allow("aiortc", c, 60.6) is None  # 1.0, 3.0 and 60.5 within 60 s
    assert gate.held_total == {"aiortc": 4}


def test_keys_are_bounded_and_the_idlest_forgotten():
    gate = LineGate(per_key=1, per_source=1000, period_s=60.0, max_keys=4)
    for i in range(100):  # templates that carry input: each a key of its own
        assert gate.allow("aioice", ("aioice.ice", f"candidate {i} is not valid"), float(i) / 100) == 0
    assert len(gate._keys) == 4


def test_which_loggers_are_gated():
    assert [source_of(n) for n in ("aiortc.rtcrtpreceiver", "aioice.ice", "libav.h264", "av.datasets",
                                   "aiohttp.access", "streamsvc.whip", "avalanche", "asyncio")] == \
        ["aiortc", "aioice", "av", "av", "aiohttp", None, None, None]


class _Counted:
    """A handler as `streamsvc serve` has one (the root logger's, with the gate installed): the lines it writes."""

    def __init__(self, gate: LibraryLogGate | None) -> None:
        self.stream = io.StringIO()
        self.handler = logging.StreamHandler(self.stream)
        self.handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        if gate is not None:
            self.handler.addFilter(gate)

    def __enter__(self):
        root = logging.getLogger()
        self._level = root.level
        root.setLevel(logging.INFO)
        root.addHandler(self.handler)
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger().removeHandler(self.handler)
        logging.getLogger().setLevel(self._level)

    def lines(self, name_prefix: str) -> list[str]:
        return [line for line in self.stream.getvalue().splitlines() if line.split(" ", 2)[1].startswith(name_prefix)]


def _undecodable_frames(n: int) -> None:
    """aiortc's own decoder thread (aiortc.rtcrtpreceiver.decoder_worker) fed `n` H.264 frames it cannot decode, as
    a WHIP publisher's RTP would."""
    from aiortc.jitterbuffer import JitterFrame
    from aiortc.rtcrtpparameters import RTCRtpCodecParameters
    from aiortc.rtcrtpreceiver import decoder_worker

    codec = RTCRtpCodecParameters(mimeType="video/H264", clockRate=90000, payloadType=96,
                                  parameters={"packetization-mode": "1"})
    loop = asyncio.new_event_loop()
    try:
        frames: queue.Queue = queue.Queue()
        for i in range(n):
            frames.put((codec, JitterFrame(data=b"\x00\x00\x00\x01\x41" + os.urandom(64), timestamp=i * 3000)))
        frames.put(None)
        error = threading.Event()
        worker = threading.Thread(target=decoder_worker, args=(loop, frames, asyncio.Queue(), error))
        worker.start()
        worker.join(60)
        assert not worker.is_alive() and error.is_set()
        loop.run_until_complete(asyncio.sleep(0.01))  # what the thread handed the loop (the end of its track)
    finally:
        loop.close()


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "ungated"])
def test_a_flood_down_each_library_path_writes_at_most_ten_lines_a_minute_from_each(gated):
    gate = LibraryLogGate() if gated else None
    flood = 300
    with _Counted(gate) as out:
        _undecodable_frames(flood)  # aiortc: a WARNING per frame its decoder thread cannot decode
        ice = logging.getLogger("aioice.ice")  # aioice: its lines as Connection.__log_info makes them
        for i in range(flood):
            ice.info("%s " + "Check %s %s -> %s", f"Connection({i % 7})", f"pair {i}", "State.WAITING",
                     "State.IN_PROGRESS")
            ice.info("%s " + f'Remote candidate "host{i}.invalid" is not valid: no', f"Connection({i % 7})")
        access = logging.getLogger("aiohttp.access")
        for i in range(flood):
            access.info('%s [%s] "%s" %s %s', "127.0.0.1", "now", f"GET /healthz?{i} HTTP/1.1", 200, 2)
        previous = av.logging.get_level()
        av.logging.set_level(av.logging.ERROR)  # PyAV's bridge on: libav's errors as Python lines ("libav.h264")
        try:
            for i in range(flood):
                av.logging.log(av.logging.ERROR, "h264", f"no frame! ({i})")
        finally:
            av.logging.set_level(previous)
    written = {source: len(out.lines(source)) for source in ("aiortc", "aioice", "aiohttp", "libav")}
    if not gated:  # what the flood writes without the gate
        assert written["aiortc"] >= flood - 1 and written["aioice"] == 2 * flood and written["aiohttp"] == flood
        assert written["libav"] == flood
        return
    assert all(1 <= n <= BOUND for n in written.values()), written
    assert gate.gate.held_total["aiortc"] >= flood - 1 - BOUND
    held = [line for line in out.lines("aioice") if "held back" in line]
    assert held and "more lines from aioice held back" in held[0]


def test_a_record_filtered_by_two_handlers_is_decided_once():
    gate = LibraryLogGate(LineGate(per_key=1, per_source=1, period_s=60.0))
    first, second = _Counted(gate), _Counted(gate)
    with first, second:
        for i in range(5):
            logging.getLogger("aiortc.rtcpeerconnection").warning("line %d", i)
    assert len(first.lines("aiortc")) == len(second.lines("aiortc")) == 1


def test_libav_writes_nothing_of_a_flood_of_undecodable_packets_once_installed(capfd):
    root = logging.getLogger()
    handler = logging.StreamHandler(io.StringIO())
    root.addHandler(handler)
    try:
        gate = library_logs.install()
        assert gate in handler.filters and library_logs.install() is gate  # once per process
        assert av.logging.get_level() is None or av.logging.get_level() <= av.logging.ERROR
        decoder = av.CodecContext.create("h264", "r")
        for _ in range(200):
            try:
                decoder.decode(av.Packet(b"\x00\x00\x00\x01\x41" + os.urandom(64)))
            except av.FFmpegError:
                pass
        out, err = capfd.readouterr()
        assert err == "" and handler.stream.getvalue() == ""  # neither on stderr nor through PyAV's bridge
    finally:
        root.removeHandler(handler)
        for h in (*root.handlers, logging.lastResort):  # other tests' handlers stay as they were
            if h is not None:
                h.removeFilter(gate)
