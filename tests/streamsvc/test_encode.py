from fractions import Fraction

import av
import numpy as np
import pytest

from streamsvc.engine.encode import (
    NAL_IDR,
    NAL_PPS,
    NAL_SLICE,
    NAL_SPS,
    RTP_TIME_BASE,
    StreamDecoder,
    StreamEncoder,
    is_idr,
    nal_unit_types,
    rtp_pts,
)
from tests.threads import names, needs_proc, thread_ids

W, H, FPS = 64, 48, 16


def moving_frames(n: int, start: int = 0, width: int = W, height: int = H) -> np.ndarray:
    """[n, H, W, 3] uint8: smooth gradients and a bright square that move with the frame index."""
    y, x = np.mgrid[0:height, 0:width]
    frames = np.empty((n, height, width, 3), np.uint8)
    for i, t in enumerate(range(start, start + n)):
        frames[i, ..., 0] = (4 * x + 3 * t) % 256
        frames[i, ..., 1] = (4 * y + 2 * t) % 256
        frames[i, ..., 2] = 128
        cx = (4 * t) % (width - 8)
        frames[i, 8:24, cx : cx + 8] = 255
    return frames


def encode_chunks(encoder: StreamEncoder, sizes: list[int], start: int = 0) -> list[list[av.Packet]]:
    chunks = []
    for n in sizes:
        chunks.append(encoder.encode(moving_frames(n, start), start_index=start))
        start += n
    return chunks


@pytest.fixture
def encoder():
    enc = StreamEncoder(W, H, FPS)
    yield enc
    enc.close()


def test_one_packet_per_frame_on_the_90khz_clock(encoder):
    chunks = encode_chunks(encoder, [9, 12, 12])
    packets = [p for chunk in chunks for p in chunk]
    assert [len(c) for c in chunks] == [9, 12, 12]
    assert [p.pts for p in packets] == [i * 90000 // FPS for i in range(33)]  # 5625 ticks a frame at 16 fps
    assert all(p.dts == p.pts and p.duration == 5625 and p.time_base == Fraction(1, 90000) for p in packets)
    assert encoder.next_index == 33


def test_packets_are_annex_b_access_units_with_headers_on_the_first_keyframe(encoder):
    (chunk,) = encode_chunks(encoder, [4])
    first = bytes(chunk[0])
    assert first.startswith(b"\x00\x00\x00\x01")
    types = nal_unit_types(first)
    assert types[:2] == [NAL_SPS, NAL_PPS] and NAL_IDR in types
    assert chunk[0].is_keyframe
    assert [nal_unit_types(bytes(p)) for p in chunk[1:]] == [[NAL_SLICE]] * 3  # no B-frames, no extra NALs


def test_keyframe_on_request_carries_sps_pps(encoder):
    encode_chunks(encoder, [12])
    encoder.request_keyframe()
    after_request, after_that = encode_chunks(encoder, [12, 12], start=12)
    assert [p.is_keyframe for p in after_request] == [True] + [False] * 11
    assert nal_unit_types(bytes(after_request[0]))[:2] == [NAL_SPS, NAL_PPS]
    assert not any(p.is_keyframe for p in after_that)  # the request is used up
    forced = encoder.encode(moving_frames(3, 36), start_index=36, keyframe=True)
    assert [p.is_keyframe for p in forced] == [True, False, False]


def test_keyframes_come_at_the_first_chunk_start_an_interval_after_the_last_keyframe():
    enc = StreamEncoder(W, H, FPS, keyframe_interval=8)
    assert StreamEncoder(W, H, FPS).keyframe_interval == 2 * FPS  # 2 s by default
    first = [p.is_keyframe for chunk in encode_chunks(enc, [6, 6, 6, 6]) for p in chunk]
    assert [i for i, k in enumerate(first) if k] == [0, 12]  # never mid-chunk: 8 and 20 are not chunk starts
    enc.request_keyframe()  # at frame 24
    later = [p.is_keyframe for chunk in encode_chunks(enc, [6, 6, 6], start=24) for p in chunk]
    assert [24 + i for i, k in enumerate(later) if k] == [24, 36]
    enc.close()


def test_every_keyframe_repeats_sps_pps():
    enc = StreamEncoder(W, H, FPS, keyframe_interval=5)
    keyframes = [bytes(p) for chunk in encode_chunks(enc, [3, 3, 3, 3]) for p in chunk if p.is_keyframe]
    assert len(keyframes) == 2  # frames 0 and 6
    assert all(nal_unit_types(k)[:2] == [NAL_SPS, NAL_PPS] and is_idr(k) for k in keyframes)


def test_a_late_joiner_decodes_from_a_keyframe_alone(encoder):
    early = encode_chunks(encoder, [12, 12])
    encoder.request_keyframe()  # a viewer joins
    late = encode_chunks(encoder, [12, 12], start=24)

    everyone = StreamDecoder()
    for chunk in early:
        for packet in chunk:
            assert len(everyone.decode(bytes(packet))) == 1
    reference = [f for chunk in late for p in chunk for f in everyone.decode(bytes(p))]

    joiner = StreamDecoder()
    assert joiner.waiting_for_keyframe
    # It gets packets from mid-GOP first: they are skipped until the keyframe.
    assert [joiner.decode(bytes(p)) for p in early[1][5:]] == [[]] * 7
    joined = []
    for chunk in late:
        for packet in chunk:
            frames = joiner.decode(bytes(packet))
            assert len(frames) == 1  # each access unit decodes at once: no decoder delay
            joined.extend(frames)
    assert not joiner.waiting_for_keyframe
    assert len(joined) == 24
    # After an IDR nothing refers to earlier frames: the joiner sees exactly what everyone sees.
    assert all(np.array_equal(a, b) for a, b in zip(joined, reference, strict=True))
    source = moving_frames(24, 24).astype(np.int16)
    error = np.abs(np.stack(joined).astype(np.int16) - source).mean()
    assert joined[0].shape == (H, W, 3) and joined[0].dtype == np.uint8
    assert error < 8, f"mean abs error {error:.1f} of 255"


def test_an_encoder_that_buffers_still_returns_every_chunk_at_once():
    # Frame threads make libx264 hold frames back; the encoder drains itself after each chunk.
    enc = StreamEncoder(W, H, FPS, options={"x264-params": "sliced-threads=0:threads=4"})
    chunks = encode_chunks(enc, [12, 12, 12])
    assert [len(c) for c in chunks] == [12, 12, 12]
    assert [p.pts for c in chunks for p in c] == [rtp_pts(i, FPS) for i in range(36)]
    assert all(c[0].is_keyframe for c in chunks)  # a drained encoder restarts on an IDR
    decoder = StreamDecoder()
    assert sum(len(decoder.decode(bytes(p))) for c in chunks for p in c) == 36
    enc.close()


def test_packets_feed_aiortc_unchanged(encoder):
    h264 = pytest.importorskip("aiortc.codecs.h264")
    (chunk,) = encode_chunks(encoder, [3])
    for packet in chunk:
        payloads, timestamp = h264.H264Encoder().pack(packet)
        assert payloads and timestamp == packet.pts


def test_rtp_pts():
    assert rtp_pts(0, 16) == 0 and rtp_pts(1, 16) == 5625 and rtp_pts(30, 30) == 90000
    assert RTP_TIME_BASE == Fraction(1, 90000)


def test_nal_unit_types():
    data = b"\x00\x00\x00\x01\x67ab\x00\x00\x01\x68c\x00\x00\x01\x65" + b"x" * 5
    assert nal_unit_types(data) == [7, 8, 5]
    assert nal_unit_types(b"") == [] and nal_unit_types(b"\x00\x00\x01") == []
    assert is_idr(data) and not is_idr(b"\x00\x00\x01\x41")


def test_bad_input_is_refused_with_the_expected_shape(encoder):
    with pytest.raises(ValueError, match=r"\[N, 48, 64, 3\]"):
        encoder.encode(np.zeros((2, 64, 48, 3), np.uint8), start_index=0)
    with pytest.raises(ValueError, match="uint8"):
        encoder.encode(np.zeros((2, H, W, 3), np.float32), start_index=0)
    assert encoder.encode(np.zeros((0, H, W, 3), np.uint8), start_index=0) == []
    encoder.encode(moving_frames(2), start_index=0)
    with pytest.raises(ValueError, match="goes back"):
        encoder.encode(moving_frames(2), start_index=1)
    with pytest.raises(ValueError, match="even"):
        StreamEncoder(65, 48, FPS)
    encoder.close()
    encoder.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        encoder.encode(moving_frames(1), start_index=2)


@needs_proc
def test_closing_an_encoder_or_a_decoder_ends_the_threads_its_swscale_context_started():
    """A stream's encoder and decoder leave no thread behind once closed, whoever still refers to them (a stream's
    objects can sit in a reference cycle until a rare full garbage collection: issue 46)."""
    before = thread_ids()
    encoder, decoder = StreamEncoder(W, H, FPS), StreamDecoder()
    for packet in encode_chunks(encoder, [4])[0]:
        assert len(decoder.decode(bytes(packet))) == 1
    started = thread_ids() - before
    if not started:
        pytest.skip("swscale started no threads here (one core)")
    encoder.close()
    decoder.close()
    assert not started & thread_ids(), f"still running after close: {names(started & thread_ids())}"


MEMORY_PROBE = """
import sys
from streamsvc.engine.heap import memory_giver
def rss_mb():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) // 1024
blocks = [bytearray(64 * 1024) for _ in range(1024)]  # 64 MiB under glibc's mmap threshold: on its heap
pin = bytearray(64 * 1024)  # above them: the heap's top stays in use, so free() alone returns nothing
del blocks
freed = rss_mb()
memory_giver()()
print(freed, rss_mb())
"""


@needs_proc
def test_the_memory_giver_returns_freed_pages_that_glibc_keeps():
    """What the encoder process does after closing an encoder: freed memory in the middle of the heap goes back to
    the system (without it, its RSS crept up under churn and stayed up after every stream closed: issue 46)."""
    import subprocess
    import sys

    from streamsvc.engine.heap import memory_giver

    if memory_giver() is None:
        pytest.skip("no malloc_trim in this C library")
    out = subprocess.run([sys.executable, "-c", MEMORY_PROBE], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    freed, given_back = map(int, out.stdout.split())
    assert freed - given_back >= 48, (freed, given_back)  # most of the 64 MiB


def test_the_encoder_process_trims_after_each_close_and_not_after_chunks(monkeypatch):
    """A closed encoder's freed heap goes back to the system once the close is answered; chunks, fast or not,
    trim nothing (the trims after fast chunks once tried did not stop the growth the mmap threshold did)."""
    import threading
    from dataclasses import asdict
    from multiprocessing import Pipe

    from streamsvc.engine import encode as E

    trims = []
    monkeypatch.setattr(E, "memory_giver", lambda: lambda: trims.append(1))
    monkeypatch.setattr(E.signal, "signal", lambda *_: None)  # the process's main loop, run on a thread here
    ours, theirs = Pipe()
    worker = threading.Thread(target=E._encoder_main, args=(theirs,), daemon=True)
    worker.start()
    spec = asdict(E.EncoderSpec(W, H, 16))

    def ask(msg):
        ours.send(msg)
        assert ours.poll(30), "no reply"
        return ours.recv()

    try:
        for i, fast in enumerate([False, True, True, False]):
            reply = ask(("encode", "s", spec, moving_frames(4, start=4 * i), 4 * i, i == 0, fast))
            assert reply[0] == "ok" and len(reply[1]) == 4, reply
        assert trims == []
        assert ask(("close", "s"))[0] == "closed"
        assert len(trims) == 1
        assert ask(("close", "unknown"))[0] == "closed"
        assert len(trims) == 1  # nothing was closed
    finally:
        ours.send(None)
        worker.join(10)
    assert not worker.is_alive()


@needs_proc
def test_the_encoder_process_does_not_grow_while_its_streams_come_and_go():
    """Eight streams open at a time, the oldest closing and a new one opening each round (viewers reconnect), fast
    chunks among the normal ones: the encoder process's RSS stays where eight open encoders put it. Without the
    fixed mmap threshold the first close moved x264's frame buffers onto the heap, resident in full: 84 to 112 MB
    at 256x256 in the first rounds (a 30-minute soak: about 1 MB a minute)."""
    from streamsvc.engine.encode import EncoderProcess, EncoderSpec
    from streamsvc.engine.heap import memory_giver
    from streamsvc.metrics import read_process

    def rss_mb() -> int:
        return read_process(host.pid).rss_bytes >> 20

    if memory_giver() is None:
        pytest.skip("not glibc")
    size, rounds = 256, 24
    rng = np.random.default_rng(0)
    spec = EncoderSpec(size, size, 24)
    host = EncoderProcess()
    live: dict[str, int] = {}

    def chunks(stream_id: str) -> None:
        for _ in range(2):
            index = live[stream_id]
            frames = rng.integers(0, 255, (12, size, size, 3), dtype=np.uint8)
            host.encode(stream_id, spec, frames, start_index=index, keyframe=False, fast=index % 36 == 12)
            live[stream_id] = index + 12

    try:
        for n in range(8):
            live[f"s{n}"] = 0
            chunks(f"s{n}")
        opened = rss_mb()
        for n in range(8, 8 + rounds):
            oldest = next(iter(live))
            host.close_stream(oldest)
            del live[oldest]
            live[f"s{n}"] = 0
            for stream_id in list(live):
                chunks(stream_id)
        churned = rss_mb()
        assert host.encoders == 8
    finally:
        host.stop()
    assert churned - opened < 12, (opened, churned)
