"""The WebSocket client without a server: its own H.264 decoder (client/decode.py), the rule that playback starts
at the first keyframe chunk (fed through the client's chunk handler; a real encoder makes the chunks), and how the
opening ends on an error that answers the client's watch."""

import asyncio

import av
import pytest

from client.decode import FrameDecoder
from client.viewer import ClientConfig, ClientState, DecodeMode
from client.ws_client import StreamClient
from streamsvc.engine.encode import StreamEncoder
from streamsvc.wire import protocol as P
from tests.streamsvc.test_encode import FPS, H, W, encode_chunks


@pytest.fixture(scope="module")
def chunks() -> list[tuple[P.Chunk, list[bytes]]]:
    """Three chunks of 12 frames: a keyframe chunk, one mid-GOP, and one that starts with a requested IDR."""
    enc = StreamEncoder(W, H, FPS)
    packets = encode_chunks(enc, [12, 12])
    enc.request_keyframe()
    packets += encode_chunks(enc, [12], start=24)
    enc.close()
    out = []
    for i, chunk in enumerate(packets):
        units = [bytes(p) for p in chunk]
        out.append((P.Chunk.describe(units, index=i, pts=12 * i, prompt_version=0, steps=4,
                                     keyframe=chunk[0].is_keyframe), units))
    assert [h.keyframe for h, _ in out] == [True, False, True]
    return out


def test_the_decoder_gives_each_access_unit_its_frame_at_once_without_converting_it(chunks):
    dec = FrameDecoder()
    for header, units in chunks:
        for au in units:
            frames = dec.decode(au)
            assert len(frames) == 1 and isinstance(frames[0], av.VideoFrame)
            assert (frames[0].width, frames[0].height, frames[0].format.name) == (W, H, "yuv420p")
    dec.close()
    with pytest.raises(RuntimeError, match="closed"):
        dec.decode(chunks[0][1][0])


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def watcher(decode: DecodeMode, width: int = W) -> StreamClient:
    """A watcher's client as open() leaves it after `ready` (no socket: the chunk handler is fed directly)."""
    clock = _Clock()
    c = StreamClient("ws://127.0.0.1:1/ws", ClientConfig(watch="s3", secret="w4tch", stats_every_s=0, decode=decode),
                     clock=clock)
    c.ready = P.Ready(stream_id="s3", fps=FPS, width=width, height=H, first_chunk_frames=12, chunk_frames=12,
                      prompt_version=0, steps=4, role="watch", viewer_id="v1")
    c._connected_at = clock()
    c._buffer = c._new_buffer()
    if decode is not DecodeMode.NONE:
        c._decoder = FrameDecoder()
    return c


@pytest.mark.parametrize("decode", [DecodeMode.INLINE, DecodeMode.NONE])
async def test_chunks_before_the_first_keyframe_chunk_are_not_played(chunks, decode):
    c = watcher(decode)
    mid_gop = chunks[1]
    await c._on_chunk(P.pack_chunk(*mid_gop))
    await c._on_chunk(P.pack_chunk(*mid_gop))
    assert c.frames_decoded == 0 and c.stats().ttff_s is None and c.chunks == 2
    assert c.errors == ["chunk 1 came before any keyframe chunk: it and any more such are not played"]  # once
    c.clock.t += 0.5
    await c._on_chunk(P.pack_chunk(*chunks[2]))  # the keyframe it waited for
    assert c.frames_decoded == 12 and c.bad_frames == 0 and c.stats().ttff_s == 0.5 and len(c.errors) == 1


async def test_frames_of_another_size_than_ready_said_are_counted_bad(chunks):
    c = watcher(DecodeMode.INLINE, width=W + 16)
    await c._on_chunk(P.pack_chunk(*chunks[0]))
    assert c.frames_decoded == 12 and c.bad_frames == 12


@pytest.mark.parametrize("decode", [DecodeMode.INLINE, DecodeMode.NONE])
async def test_the_frame_tap_gets_each_played_chunks_header_and_decoded_frames(chunks, decode):
    c = watcher(decode)
    tapped = []
    c.frame_tap = lambda header, frames: tapped.append((header.index, len(frames), {f.width for f in frames}))
    await c._on_chunk(P.pack_chunk(*chunks[1]))  # before any keyframe: not played, not tapped
    for chunk in (chunks[0], chunks[2]):
        await c._on_chunk(P.pack_chunk(*chunk))
    # without decoding there are no frames to give
    assert tapped == ([(0, 12, {W}), (2, 12, {W})] if decode is DecodeMode.INLINE else [])
    assert c.frames_decoded == 24 and c.pixels is None  # (it needs no verify_pixels)


class _Socket:
    """What `_await_ready` reads: the server's messages, then the end of the connection after a long wait."""

    def __init__(self, *messages) -> None:
        self.messages = [P.encode(m) for m in messages]

    async def __aiter__(self):
        for m in self.messages:
            yield m
        await asyncio.sleep(30)  # a server that keeps the socket open: the client must not wait for it


@pytest.mark.parametrize("error, refused", [
    (P.Error(code=P.ErrorCode.UNAVAILABLE, request="watch", message="no watching here now"),
     True),
    (P.Error(code=P.ErrorCode.NOT_FOUND, request="watch", message="no open stream 's3' here"), True),
    (P.Error(code=P.ErrorCode.RATE_LIMITED, request="set_prompt", message="an error about something else"), False),
])
async def test_an_error_that_answers_the_watch_ends_the_opening(error, refused):
    c = StreamClient("ws://127.0.0.1:1/ws", ClientConfig(watch="s3", secret="w4tch"))
    c._ws = _Socket(error)
    if refused:
        assert await asyncio.wait_for(c._await_ready(), 1.0) is False
        assert c.state is ClientState.REFUSED and c.refused_reason == error.message
    else:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(c._await_ready(), 0.2)
        assert c.refused_reason is None
    assert c.server_errors == [error]


async def test_the_camera_stops_once_the_server_refused_its_input():
    """After `input_refused` the client sends no more input (the server reads none of it): the stream goes on."""
    import numpy as np

    frame = np.zeros((H, W, 3), np.uint8)
    c = StreamClient("ws://127.0.0.1:1/ws", ClientConfig(prompt="a ball", input=lambda i: frame))
    c.ready = P.Ready(stream_id="s0", fps=FPS, width=W, height=H, first_chunk_frames=9, chunk_frames=12,
                      prompt_version=0, steps=4)
    sent: list[bytes] = []

    async def send(data):
        sent.append(data)
        if len(sent) == 3:  # the server's refusal comes in while the camera sends
            c._on_error(P.Error(code=P.ErrorCode.INPUT_REFUSED, message="input refused: 8192x8192"))

    c._send = send
    await asyncio.wait_for(c._send_input(), 5.0)  # returns: no more input (it paced 1 s at most otherwise)
    assert len(sent) == 3 and c.input_sent == 3
    assert c.input_refused == "input refused: 8192x8192" and c.errors == ["input_refused: input refused: 8192x8192"]


@pytest.mark.parametrize("code, placed_again", [(P.ErrorCode.REFUSED, True), (P.ErrorCode.UNAUTHORIZED, False)])
async def test_a_re_placement_admission_refused_is_tried_again_and_no_other_refusal(code, placed_again):
    """After `worker_lost` the client starts over on a new connection; a cluster places the stream on a worker whose
    admission may refuse it for a moment (its closed loop). A scripted server: its first stream is lost, the next
    start refused with `code`, the one after admitted."""
    from websockets.asyncio.server import serve

    starts = []
    ready = P.Ready(stream_id="s0", fps=FPS, width=W, height=H, first_chunk_frames=12, chunk_frames=12,
                    prompt_version=0, steps=4)

    async def handler(ws):
        starts.append(P.parse_client(await ws.recv()))
        if len(starts) == 2:
            await ws.send(P.encode(P.Error(code=code, request="start", message="closed loop: stream s1 was late")))
            await ws.wait_closed()
            return
        await ws.send(P.encode(ready))
        if len(starts) == 1:
            await ws.send(P.encode(P.Error(code=P.ErrorCode.WORKER_LOST, message="the worker was lost")))
            await ws.send(P.encode(P.Closed(reason="worker lost")))
        async for raw in ws:  # until the client's close
            if isinstance(P.parse_client(raw), P.Close):
                await ws.send(P.encode(P.Closed(reason="closed by client")))

    async with serve(handler, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        c = StreamClient(f"ws://127.0.0.1:{port}/ws", ClientConfig(prompt="a ball", stats_every_s=0,
                                                                     decode=DecodeMode.NONE))
        result = await asyncio.wait_for(c.run(3.0), 20)
    assert result.worker_lost == 1
    assert any("closed loop" in e for e in result.errors)
    if placed_again:
        assert len(starts) == 3 and result.reconnects == 1 and result.refused_reason is None
    else:
        assert len(starts) == 2 and result.reconnects == 0
