"""The WebSocket's input decoder (streamsvc/inputs/ws.py `Upstream`, issue 41): a resolution bomb refused before it
is decoded, with an error the client reads and its decoder dropped; a flood dropped by whole groups of pictures,
read from the NAL units and not from what the header claims. A fake viewer; real libx264 access units."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from streamsvc.inputs import bitstream as B
from streamsvc.inputs.frames import InputFrames
from streamsvc.inputs.ws import Upstream
from streamsvc.wire import protocol as P
from streamsvc.wire.framing import InputHeader, pack_input
from tests.streamsvc.test_bitstream import x264
from tests.streamsvc.test_input_gate import bomb


def upstream(fps: int = 16) -> tuple[Upstream, list]:
    sent: list = []
    session = SimpleNamespace(input=InputFrames(128, 128, fps), fps=fps, stream_id="s1")
    viewer = SimpleNamespace(session=session, send=sent.append, stream_id="s1")
    session.steerer = viewer
    return Upstream(viewer), sent


def message(index: int, units: list[bytes], keyframe: bool) -> bytes:
    capture = [1.0e12 + (index + i) * 62.5 for i in range(len(units))]
    return pack_input(InputHeader.describe(units, capture, index=index, pts=index, keyframe=keyframe), units)


@pytest.fixture(scope="module")
def gop() -> list[bytes]:
    return x264(160, 96, 60, **{"x264-params": "keyint=40:min-keyint=40:scenecut=0"})


async def test_an_idr_whose_sps_declares_8192x8192_is_refused_before_it_is_decoded_and_the_decoder_goes(gop):
    up, sent = upstream()
    await up.receive(message(0, [gop[0]], keyframe=True))  # a real 160x96 IDR: decoded
    assert up.frames_in == 1 and up._decoder is not None
    t0 = time.perf_counter()
    await up.receive(message(1, [bomb(gop[0])], keyframe=True))
    assert time.perf_counter() - t0 < 0.1  # never decoded (an 8192x8192 picture: 96 MiB, and 0.2 s to decode)
    assert up.frames_in == 1 and up._decoder is None  # the decoder and its pictures dropped
    errors = [m for m in sent if isinstance(m, P.Error)]
    assert [e.code for e in errors] == [P.ErrorCode.INPUT_REFUSED]
    assert "8192x8192" in errors[0].message and "1920x1080" in errors[0].message
    assert "goes on without input" in errors[0].message
    P.parse_server(P.encode(errors[0]))  # a message every client parses
    for i in range(2, 5):  # later input is dropped unread, and not answered again
        await up.receive(message(i, [gop[i - 1]], keyframe=False))
    assert up.dropped_messages == 3 and up.frames_in == 1 and len(sent) == 1
    assert up.frames.stats()["received"] == 1


async def test_a_decoded_frame_over_the_cap_is_refused_too(gop, monkeypatch):
    import streamsvc.inputs.gate as G

    monkeypatch.setattr(G, "inspect", lambda frame: B.FrameInfo(None, True, True))  # a size no header declared
    up, sent = upstream()
    big = x264(1936, 1088, 1)[0]  # over 1920 wide
    await up.receive(message(0, [big], keyframe=True))
    assert up.frames_in == 0 and up._decoder is None and up.frames.stats()["received"] == 0
    assert [m.code for m in sent] == [P.ErrorCode.INPUT_REFUSED] and "1936x1088" in sent[0].message


async def test_after_a_dropped_reference_frame_its_group_waits_for_a_real_idr_whatever_the_header_claims(gop):
    up, _ = upstream(fps=16)  # decodes 32 frames a second, bursts of 16
    for i in range(24):  # an IDR and 23 P-frames at once, each claiming to be a keyframe
        await up.receive(message(i, [gop[i]], keyframe=True))
    assert up.frames_in == 16
    await asyncio.sleep(0.6)  # the bucket refills (19 tokens), but the group lost a reference frame
    for i in range(24, 40):
        await up.receive(message(i, [gop[i]], keyframe=True))
    stats = up.frames.stats()
    assert up.frames_in == 16 and stats["flood"] == 24 and stats["decode_errors"] == 0
    await up.receive(message(40, [gop[40]], keyframe=False))  # the next IDR (its header says it is not)
    assert up.frames_in == 17 and up.gate.counts.gop == 24


async def test_a_message_of_many_frames_is_admitted_frame_by_frame(gop):
    up, _ = upstream(fps=16)
    await up.receive(message(0, gop[:20], keyframe=True))  # 20 frames in one message: the burst's 16 decoded
    assert up.frames_in == 16 and up.frames.stats()["flood"] == 4


async def test_a_decoder_over_its_cpu_budget_refuses_the_input_with_the_reason(gop):
    up, sent = upstream(fps=16)
    up.gate.max_load, up.gate.sustain_s = 1e-6, 1  # any decoding is over this budget, after a second of it
    for i in range(40):  # 2.5 s of the camera at 16 fps, bounded
        await up.receive(message(i, [gop[i]], keyframe=i == 0))
        if sent:
            break
        await asyncio.sleep(1 / 16)
    assert [m.code for m in sent] == [P.ErrorCode.INPUT_REFUSED] and "CPU-seconds a second" in sent[0].message
    assert 0 < up.frames_in < 40 and up._decoder is None  # a second of frames decoded, then refused


async def test_closing_drops_the_decoder_and_nothing_is_decoded_after(gop):
    """The connection's end releases its decoder at once (not at a garbage collection: issue 46), and a message that
    was still on its way makes none again."""
    up, sent = upstream()
    await up.receive(message(0, [gop[0]], keyframe=True))
    assert up.frames_in == 1 and up._decoder is not None
    up.close()
    assert up._decoder is None
    await up.receive(message(1, [gop[1]], keyframe=False))
    assert up.frames_in == 1 and up._decoder is None and not sent
