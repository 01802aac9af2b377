"""Input video over the WebSocket, end to end (issue 35): the in-process server (tiny preset, CPU) and real clients
over loopback. Every wait is bounded."""

import asyncio
import json

import numpy as np
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from client.viewer import ClientConfig, DecodeMode
from client.ws_client import StreamClient
from streamsvc.wire import protocol as P
from streamsvc.wire.framing import InputHeader, pack_input
from tests.client.servers import running, url

T = 15.0


def camera(w: int = 160, h: int = 96):
    """A moving bar on grey, another size and aspect than the model's (128x128)."""
    def frame(i: int) -> np.ndarray:
        img = np.full((h, w, 3), 90, np.uint8)
        x = (4 * i) % (w - 16)
        img[:, x : x + 16] = (230, 40, 40)
        return img
    return frame


@pytest.fixture
async def server():
    async with running() as s:
        yield s


async def test_chunks_echo_the_capture_times_sent_and_say_when_the_input_went_missing(server):
    c = StreamClient(url(server), ClientConfig(prompt="a blue ball", seed=3, input=camera(), strength=0.9,
                                               decode=DecodeMode.NONE))
    sent: list[float] = []
    now_ms = c.g2g.now_ms

    def recording_now_ms() -> float:  # every capture time the camera stamps
        t = now_ms()
        sent.append(t)
        return t

    c.g2g.now_ms = recording_now_ms
    async with c:
        ready = c.ready
        assert ready.input is True and ready.strength in ready.strengths and ready.input_latency_s == 0.5
        snapped = min(ready.strengths, key=lambda s: (abs(s - 0.9), -s))
        assert ready.strength == snapped
        assert await c.wait_until(lambda: sum(h.input == "frames" for h in c.headers) >= 3, T)
        c.input_paused = True  # the camera stops for 2.5 s
        assert await c.wait_until(lambda: c.headers[-1].input == "missing", T)
        await asyncio.sleep(2.5)
        c.input_paused = False
        n = len(c.headers)
        assert await c.wait_until(lambda: any(h.input == "frames" for h in c.headers[n:]), T)
        stats = server.sessions[ready.stream_id].input.stats()
        play_from = server.sessions[ready.stream_id].input.play_from  # for a transport that paces frames itself
        assert play_from is not None and server.engine.clock() - 15 < play_from < server.engine.clock()
    statuses = [h.input for h in c.headers]
    first_missing = statuses.index("missing")
    assert "frames" in statuses[first_missing:], statuses  # picked up again
    for h in c.headers:
        assert h.strength == snapped
        if h.input == "frames":
            assert len(h.capture_ms) == h.frames
            assert set(h.capture_ms) <= set(sent)  # echoed: each one a capture time the camera sent
            assert h.capture_ms == sorted(h.capture_ms)
        else:
            assert h.input == "missing" and h.capture_ms is None
    steady = c.headers[1]  # a whole chunk of the camera at the stream's rate: one sent frame a frame, in order
    i = sent.index(steady.capture_ms[0])
    assert steady.capture_ms == sent[i : i + steady.frames]
    # every frame decoded (one access unit a frame); each frame of a chunk with input is one received or a repeat
    # (the first chunk's slots before the stream's phase repeat its first frame)
    assert sum(h.frames for h in c.headers if h.input == "frames") <= stats["received"] + stats["repeated"]
    assert stats["received"] <= len(sent)
    assert stats["decode_errors"] == 0 and stats["missing_chunks"] >= 1
    assert c.result().glass_to_glass and c.errors == []


async def test_strength_is_steerable_and_only_for_a_stream_with_input(server):
    async with StreamClient(url(server), ClientConfig(prompt="a red ball", seed=1, input=camera(),
                                                      decode=DecodeMode.NONE)) as c:
        await c.send_raw(P.encode(P.SetStrength(strength=1.0)))
        assert await c.wait_until(lambda: any(a.request == "set_strength" for a in c.acks), T)
        ack = next(a for a in c.acks if a.request == "set_strength")
        assert ack.strength == 1.0
        n = len(c.headers)
        assert await c.wait_until(lambda: any(h.strength == 1.0 for h in c.headers[n:]), T)
    async with StreamClient(url(server), ClientConfig(prompt="a red ball", seed=1, decode=DecodeMode.NONE)) as plain:
        await plain.send_raw(P.encode(P.SetStrength(strength=0.5)))
        assert await plain.wait_until(lambda: plain.server_errors, T)
        err = plain.server_errors[0]
        assert err.code is P.ErrorCode.INVALID_FIELD and err.request == "set_strength" and "input" in err.message
        assert await plain.wait_until(lambda: plain.chunks >= 1, T)
        assert all(h.input == "none" and h.capture_ms is None for h in plain.headers)


async def test_a_model_without_an_encoder_refuses_input_with_the_reason(server, monkeypatch):
    monkeypatch.setattr(server.engine.gen, "encoder", None)
    c = StreamClient(url(server), ClientConfig(prompt="a red ball", seed=1, input=camera()))
    async with c:
        assert c.ready is None
    assert "no encoder" in c.refused_reason and "input" in c.refused_reason
    async with StreamClient(url(server), ClientConfig(prompt="a red ball", seed=1)) as plain:  # without: admitted
        assert plain.ready is not None


async def _start(server, start: dict) -> tuple:
    ws = await connect(url(server), max_size=None, compression=None)
    await ws.send(json.dumps(start))
    ready = P.parse_server(await asyncio.wait_for(ws.recv(), T))
    assert isinstance(ready, P.Ready), ready
    return ws, ready


async def test_the_larger_limit_is_the_input_connections_alone_and_garbage_input_is_counted(server):
    big = b"\x00\x00\x00\x01\x65" + bytes(200_000)  # 200 KB: over the 64 KiB control limit
    ws, ready = await _start(server, {"type": "start", "prompt": "a red ball", "input": True})
    try:
        header = InputHeader.describe([big], [1.0e12], index=0, pts=0, keyframe=True)
        await ws.send(pack_input(header, [big]))  # framed, but not H.264 the decoder can use
        await ws.send(b"SSC1\x00\x00\x00\x02{}")  # not even framed
        errors, chunks = [], 0
        for _ in range(200):
            raw = await asyncio.wait_for(ws.recv(), T)
            if isinstance(raw, bytes):
                chunks += 1
                header, _ = P.unpack_chunk(raw)
                assert header.input == "missing"  # nothing decoded: the stream goes on as text-to-video
            else:
                msg = P.parse_server(raw)
                if isinstance(msg, P.Error):
                    errors.append(msg)
            if chunks >= 2 and errors:
                break
        assert chunks >= 2
        assert [e.code for e in errors] == [P.ErrorCode.BAD_CHUNK] and "missing field" in errors[0].message
        stats = server.sessions[ready.stream_id].input.stats()
        assert stats["decode_errors"] >= 2  # the undecodable access unit and the unframed message
        server.refresh_metrics()
        assert server.metrics.input.labels("decode_errors")._value.get() == stats["decode_errors"]
    finally:
        await ws.close()
    ws, ready = await _start(server, {"type": "start", "prompt": "a red ball"})  # no input: the control limit
    try:
        await ws.send(pack_input(InputHeader.describe([big], [1.0e12], index=0, pts=0, keyframe=True), [big]))
        with pytest.raises(ConnectionClosed):
            for _ in range(200):
                await asyncio.wait_for(ws.recv(), T)
        assert ws.close_code == 1009
    finally:
        await ws.close()


async def test_the_input_is_the_steerers_a_handover_stops_it_and_a_pause_drops_it(server):
    steerer = StreamClient(url(server), ClientConfig(prompt="a red ball", seed=2, input=camera(),
                                                     decode=DecodeMode.NONE))
    async with steerer:
        ready = steerer.ready
        session = server.sessions[ready.stream_id]
        assert await steerer.wait_until(lambda: any(h.input == "frames" for h in steerer.headers), T)
        await steerer.pause()
        assert await steerer.wait_until(lambda: any(a.request == "pause" for a in steerer.acks), T)
        await asyncio.sleep(0.5)
        assert session.input.stats()["paused"] > 0  # frames sent while paused: dropped, counted
        await steerer.resume()
        n = len(steerer.headers)
        assert await steerer.wait_until(lambda: any(h.input == "frames" for h in steerer.headers[n:]), T)
        watcher = StreamClient(url(server), ClientConfig(watch=ready.stream_id, secret=ready.watch_secret,
                                                         decode=DecodeMode.NONE))
        async with watcher:
            await steerer.send_raw(P.encode(P.Handover(to=watcher.ready.viewer_id)))
            assert await steerer.wait_until(lambda: any(e.code is P.ErrorCode.NOT_STEERER
                                                        for e in steerer.server_errors), T)
            assert "input" in next(e for e in steerer.server_errors if e.code is P.ErrorCode.NOT_STEERER).message
            n = len(watcher.headers)
            assert await watcher.wait_until(lambda: any(h.input == "missing" for h in watcher.headers[n:]), T)
            late = len(watcher.headers)
            await asyncio.sleep(1.0)  # the old steerer still sends: none of it is restyled any more
            assert all(h.input == "missing" for h in watcher.headers[late + 1:])
    assert steerer.result().input_sent > 0


async def test_a_flood_of_input_is_dropped_undecoded_beyond_twice_the_fps(server):
    from client.camera import H264Camera

    ws, ready = await _start(server, {"type": "start", "prompt": "a red ball", "input": True})
    try:
        cam, frame = H264Camera(ready.fps), camera()
        t0 = asyncio.get_running_loop().time()
        for i in range(160):  # 10 s of video sent at once
            au, key = cam.encode(frame(i))
            await ws.send(pack_input(InputHeader.describe([au], [1.0e12 + i * 62.5], index=i, pts=i, keyframe=key),
                                     [au]))
        session = server.sessions[ready.stream_id]
        for _ in range(200):  # bounded: until the server has read them all
            if session.input.stats()["received"] >= 160:
                break
            await asyncio.sleep(0.05)
        elapsed = asyncio.get_running_loop().time() - t0
        stats = session.input.stats()
        assert stats["received"] == 160
        # a second's burst and twice the fps since were decoded, the rest dropped undecoded
        assert 160 - (ready.fps + 2 * ready.fps * elapsed) <= stats["flood"] <= 160 - ready.fps
        assert stats["decode_errors"] == 0  # what follows a dropped frame waits for a keyframe: nothing broken decoded
        raw = await asyncio.wait_for(ws.recv(), T)  # the stream goes on
        while not isinstance(raw, bytes):
            raw = await asyncio.wait_for(ws.recv(), T)
    finally:
        await ws.close()


async def test_a_stream_with_input_that_sends_nothing_does_not_close_admission(server):
    # Issue 41: its chunks were let go as text-to-video only at their last slot's time + half the input latency, too
    # late for their viewer: each was late or encoded cheaper, and every start after it was refused ("closed loop").
    quiet = StreamClient(url(server), ClientConfig(prompt="a blue ball", seed=3, input=camera(),
                                                   decode=DecodeMode.NONE))
    quiet.input_paused = True  # its camera never sends a frame
    async with quiet:
        assert quiet.ready is not None and quiet.ready.input is True
        # its first chunk comes once the wait for a camera's first frame is over (5 s), then one every 0.75 s
        assert await quiet.wait_until(lambda: quiet.chunks >= 4, 20.0)
        for i in range(3):  # three more starts, one after another, while it plays
            other = StreamClient(url(server), ClientConfig(prompt="a red ball", seed=i, decode=DecodeMode.NONE))
            async with other:
                assert other.ready is not None, other.refused_reason
                assert await other.wait_until(lambda: other.chunks >= 2, T)
        assert quiet.headers and all(h.input == "missing" for h in quiet.headers)
        assert not server.engine.stats().scheduler.late  # admission open
