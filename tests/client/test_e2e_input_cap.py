"""The pixel cap on the WebSocket's input, end to end (issue 41): the in-process server (tiny preset, CPU) and a raw
client over loopback. An IDR whose SPS declares 8192x8192 is refused at once with an `error` the client reads, never
decoded, and the stream goes on as text-to-video. Every wait is bounded."""

import asyncio
import json
import time

from websockets.asyncio.client import connect

from streamsvc.wire import protocol as P
from streamsvc.wire.framing import InputHeader, pack_input
from tests.client.servers import running, url
from tests.streamsvc.test_bitstream import x264
from tests.streamsvc.test_input_gate import bomb

T = 15.0


async def test_an_idr_that_declares_8192x8192_is_refused_at_once_and_the_stream_goes_on():
    idr = x264(160, 96, 1)[0]
    async with running() as server:
        ws = await connect(url(server), max_size=None, compression=None)
        try:
            await ws.send(json.dumps({"type": "start", "prompt": "a red ball", "input": True}))
            ready = P.parse_server(await asyncio.wait_for(ws.recv(), T))
            assert isinstance(ready, P.Ready) and ready.input, ready
            session = server.sessions[ready.stream_id]
            units = [idr, bomb(idr)]
            for i, unit in enumerate(units):  # a real 160x96 IDR, then the bomb
                header = InputHeader.describe([unit], [1.0e12 + 62.5 * i], index=i, pts=i, keyframe=True)
                await ws.send(pack_input(header, [unit]))
            sent_at = time.monotonic()
            errors, chunks, refused_after = [], 0, None
            while time.monotonic() < sent_at + T:  # bounded: until the refusal and two chunks after it
                raw = await asyncio.wait_for(ws.recv(), T)
                if isinstance(raw, bytes):
                    chunks += refused_after is not None
                else:
                    msg = P.parse_server(raw)
                    if isinstance(msg, P.Error):
                        errors.append(msg)
                        refused_after = refused_after or time.monotonic() - sent_at
                if chunks >= 2:
                    break
            assert [e.code for e in errors] == [P.ErrorCode.INPUT_REFUSED], errors
            assert "8192x8192" in errors[0].message and "1920x1080" in errors[0].message
            assert refused_after < 1.0
            for i in range(2, 6):  # more input after the refusal: dropped unread, not answered
                await ws.send(pack_input(InputHeader.describe([idr], [1.0e12 + 62.5 * i], index=i, pts=i,
                                                              keyframe=True), [idr]))
            for _ in range(3):  # the stream goes on: chunks keep coming, with no more errors
                raw = await asyncio.wait_for(ws.recv(), T)
                while not isinstance(raw, bytes):
                    assert not isinstance(P.parse_server(raw), P.Error), raw
                    raw = await asyncio.wait_for(ws.recv(), T)
            assert session.input.stats()["received"] == 1  # the first IDR alone was ever decoded
            assert not session.closed
        finally:
            await ws.close()
