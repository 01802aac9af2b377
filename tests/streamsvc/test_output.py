"""The output stage (streamsvc/engine/output.py): chunks of each stream encoded in order on worker threads (the
encoders in this process, or in one encoder process per worker), a closed stream's queued chunks dropped,
an encoder failure reported for its stream only."""

import threading
import time

import numpy as np
import pytest
import torch

from streamsvc.engine.encode import EncoderSpec, StreamDecoder
from streamsvc.engine.output import OutputStage


class Sink:
    def __init__(self):
        self.lock = threading.Lock()
        self.chunks, self.failed = [], []

    def on_chunk(self, out, stream):
        with self.lock:
            self.chunks.append((stream.stream_id, out))

    def on_failed(self, stream, message):
        with self.lock:
            self.failed.append((stream.stream_id, message))

    def wait(self, n, timeout=10.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if len(self.chunks) + len(self.failed) >= n:
                    return
            time.sleep(0.01)
        raise AssertionError(f"{len(self.chunks)} chunks and {len(self.failed)} failures after {timeout} s")


def frames(value: int, n: int = 4) -> torch.Tensor:
    return torch.full((n, 32, 32, 3), value, dtype=torch.uint8)


SPEC = EncoderSpec(32, 32, 16)


def submit(stage, stream, pixels, index=0, first_frame=0):
    """A chunk of `pixels` for `stream`, keyframe first, at prompt version 0 and 4 steps."""
    stage.submit(stream, pixels, index=index, first_frame=first_frame, prompt_version=0, steps=4,
                 keyframe=index == 0, started_at=time.monotonic())
WHERE = pytest.mark.parametrize("processes", [False, True], ids=["threads", "processes"])


@WHERE
def test_chunks_of_each_stream_come_out_in_order_and_decode(processes):
    sink = Sink()
    stage = OutputStage(torch.device("cpu"), 2, sink.on_chunk, sink.on_failed, processes=processes)
    streams = [stage.open(sid, SPEC) for sid in ("a", "b", "c")]
    try:
        for i in range(4):
            for j, s in enumerate(streams):
                submit(stage, s, frames(40 * j + 10 * i), index=i, first_frame=4 * i)
        sink.wait(12)
    finally:
        stage.stop()
    assert not sink.failed and stage.chunks == 12 and stage.encode_seconds > 0
    for j, s in enumerate(streams):
        mine = [out for sid, out in sink.chunks if sid == s.stream_id]
        assert [out.header.index for out in mine] == [0, 1, 2, 3]
        dec = StreamDecoder()
        decoded = [f for out in mine for au in out.access_units for f in dec.decode(au)]
        assert len(decoded) == 16
        # flat frames of known values survive H.264 closely: each chunk is its stream's own
        assert [int(np.median(decoded[4 * i])) for i in range(4)] == [pytest.approx(40 * j + 10 * i, abs=3) for i in range(4)]


@WHERE
def test_a_closed_stream_is_dropped_and_a_failure_ends_only_its_stream(processes):
    sink = Sink()
    stage = OutputStage(torch.device("cpu"), 1, sink.on_chunk, sink.on_failed, processes=processes)
    good, gone, bad = (stage.open(sid, SPEC) for sid in ("good", "gone", "bad"))
    try:
        stage.close(gone)  # closed before its chunk is encoded: nothing comes out for it
        submit(stage, gone, frames(1))
        submit(stage, bad, frames(1)[..., :2])
        submit(stage, good, frames(1))
        sink.wait(2)
    finally:
        stage.stop()
    assert [sid for sid, _ in sink.chunks] == ["good"]
    assert [sid for sid, _ in sink.failed] == ["bad"] and "encoding failed" in sink.failed[0][1] and bad.closed


@WHERE
def test_the_stage_counts_its_streams_and_encoders_and_none_is_left_once_they_close(processes):
    """Its tables (the server's table_sizes): a stream is counted from its open until its worker has closed it, and
    its x264 encoder (in an encoder process: made at its first chunk, as the process says in each answer) as long."""
    sink = Sink()
    stage = OutputStage(torch.device("cpu"), 2, sink.on_chunk, sink.on_failed, processes=processes)
    streams = [stage.open(sid, SPEC) for sid in ("a", "b", "c")]
    try:
        for s in streams[:2]:
            submit(stage, s, frames(1))
        sink.wait(2)
        assert stage.table_sizes() == {"output.streams": 3, "output.encoders": 3 if not processes else 2}
        for s in streams:
            stage.close(s)
        deadline = time.monotonic() + 10
        while stage.table_sizes() != {"output.streams": 0, "output.encoders": 0} and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stage.table_sizes() == {"output.streams": 0, "output.encoders": 0}
    finally:
        stage.stop()


def test_a_dead_encoder_process_fails_its_streams_and_the_next_ones_get_a_new_one():
    sink = Sink()
    stage = OutputStage(torch.device("cpu"), 1, sink.on_chunk, sink.on_failed, processes=True)
    stream = stage.open("a", SPEC)
    try:
        submit(stage, stream, frames(1))
        sink.wait(1)
        host = stage._hosts[0]
        host._proc.kill()
        host._proc.wait(5)
        submit(stage, stream, frames(2), index=1, first_frame=4)
        sink.wait(2)
        later = stage.open("b", SPEC)  # a stream opened after the failure gets a new encoder process
        submit(stage, later, frames(3))
        sink.wait(3)
    finally:
        stage.stop()
    assert [sid for sid, _ in sink.chunks] == ["a", "b"]
    assert sink.failed == [("a", sink.failed[0][1])] and "encoder process is gone" in sink.failed[0][1]
    assert not host.alive and stage._hosts[0] is not host and not stage._hosts[0].alive  # stopped with the stage


@WHERE
def test_a_chunk_short_of_its_deadline_is_encoded_cheaper_and_one_with_time_to_spare_never(processes):
    sink = Sink()
    stage = OutputStage(torch.device("cpu"), 1, sink.on_chunk, sink.on_failed, processes=processes)
    stream = stage.open("a", SPEC)
    now = time.monotonic()
    limits = [None, now + 60.0, now - 0.05, now - 0.05, now + 60.0]  # no limit, spare, short, short, spare
    try:
        for i, encode_by in enumerate(limits):
            stage.submit(stream, frames(40 * i + 20), index=i, first_frame=4 * i, prompt_version=0, steps=4,
                         keyframe=i == 0, started_at=now, encode_by=encode_by)
        sink.wait(len(limits))
    finally:
        stage.stop()
    outs = [out for _, out in sink.chunks]
    assert [o.fast for o in outs] == [False, False, True, True, False]
    assert [o.header.encode for o in outs] == ["normal", "normal", "fast", "fast", "normal"]
    # switching encoders starts with an IDR both ways; staying does not
    assert [o.header.keyframe for o in outs] == [True, False, True, False, True]
    assert stage.fast_chunks == 2 and all(o.encode_s > 0 for o in outs)
    dec = StreamDecoder()
    decoded = [f for o in outs for au in o.access_units for f in dec.decode(au)]
    assert len(decoded) == 20
    means = [float(np.mean(decoded[4 * i + 3])) for i in range(5)]
    assert means == pytest.approx([20, 60, 100, 140, 180], abs=3)  # every chunk shows its own frames
