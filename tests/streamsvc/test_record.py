"""Recording: chunks as the viewers get them muxed into MP4 without re-encode, a chapter per prompt, a disk budget."""

import av
import numpy as np
import pytest

from streamsvc.encode import StreamEncoder
from streamsvc.protocol import Chunk
from streamsvc.record import RecordingRefused, RecordingStore

W, H, FPS = 64, 48, 16


def chunks(n: int, frames: int = 12, keyframe_at: tuple[int, ...] = (0,)) -> list[tuple[Chunk, list[bytes]]]:
    """`n` chunks of a moving square, each `frames` frames, encoded as the server does (keyframes on request)."""
    enc = StreamEncoder(W, H, FPS, keyframe_interval=10_000)
    out, pts = [], 0
    for i in range(n):
        video = np.zeros((frames, H, W, 3), np.uint8)
        for f in range(frames):
            x = (pts + f) % (W - 8)
            video[f, 10:18, x:x + 8] = (200, 40, 40)
        packets = enc.encode(video, start_index=pts, keyframe=i in keyframe_at)
        aus = [bytes(p) for p in packets]
        out.append((Chunk.describe(aus, index=i, pts=pts, prompt_version=0, steps=4, keyframe=i in keyframe_at), aus))
        pts += frames
    enc.close()
    return out


def annexb_payloads(path) -> list[bytes]:
    """The MP4's samples with their 4-byte lengths turned back into start codes."""
    units = []
    with av.open(str(path)) as c:
        for packet in c.demux(video=0):
            data, out, i = bytes(packet), b"", 0
            if not data:
                continue
            while i < len(data):
                n = int.from_bytes(data[i:i + 4], "big")
                out += b"\x00\x00\x00\x01" + data[i + 4:i + 4 + n]
                i += 4 + n
            units.append(out)
    return units


def strip_start_codes(au: bytes) -> bytes:
    return au.replace(b"\x00\x00\x00\x01", b"").replace(b"\x00\x00\x01", b"")


def test_a_recording_holds_the_sent_access_units_from_the_first_keyframe_with_a_chapter_per_prompt(tmp_path):
    store = RecordingStore(tmp_path, 1 << 30)
    rec = store.open("s3", FPS, W, H)
    sent = chunks(6, keyframe_at=(2,))
    prompts = ["a red ball", "a red ball", "a red ball", "a blue square", "a blue square", "a green <triangle>"]
    for (header, aus), prompt in zip(sent, prompts):
        assert rec.add(header, aus, prompt)
    rec.close()
    recorded = [au for header, aus in sent[2:] for au in aus]  # chunks before the keyframe chunk are skipped
    with av.open(str(rec.path)) as c:
        frames = list(c.decode(video=0))
        assert (c.streams.video[0].width, c.streams.video[0].height) == (W, H)
        assert [ch["metadata"]["title"] for ch in c.chapters()] == ["a red ball", "a blue square", "a green <triangle>"]
        starts = [float(ch["start"] * ch["time_base"]) for ch in c.chapters()]
    assert len(frames) == len(recorded) == 48
    assert float(frames[0].time) == 0.0 and float(frames[-1].time) == pytest.approx(47 / FPS)
    assert starts == [0.0, 12 / FPS, 36 / FPS]
    # no re-encode: the samples are the access units sent, NAL for NAL
    assert [strip_start_codes(u) for u in annexb_payloads(rec.path)] == [strip_start_codes(u) for u in recorded]
    vtt = rec.chapters_path.read_text()
    assert vtt.startswith("WEBVTT") and "00:00:00.750 --> 00:00:02.250\na blue square" in vtt
    assert "a green &lt;triangle&gt;" in vtt and "00:00:02.250 --> 00:00:03.000" in vtt
    assert store.path(rec.path.name) == rec.path and store.path(rec.chapters_path.name) == rec.chapters_path
    assert store.used_bytes == rec.path.stat().st_size + rec.chapters_path.stat().st_size


def test_the_disk_budget_refuses_a_new_recording_and_stops_one_that_reaches_it(tmp_path):
    sent = chunks(8)
    budget = sum(len(au) for _, aus in sent[:3] for au in aus) + 1  # three chunks fit, not four
    store = RecordingStore(tmp_path, budget)
    rec = store.open("s1", FPS, W, H)
    kept = [rec.add(header, aus, "p") for header, aus in sent]
    assert kept == [True] * 3 + [False] * 5
    assert "--record-max-gib" in rec.stopped_reason and "stopped at 2.2 s" in rec.stopped_reason
    rec.close()
    with av.open(str(rec.path)) as c:
        assert len(list(c.decode(video=0))) == 36  # what was written before the budget ran out plays
    with pytest.raises(RecordingRefused, match="--record-max-gib"):
        store.open("s2", FPS, W, H)
    # a store on the same directory (the next run) counts what is there
    again = RecordingStore(tmp_path, budget)
    assert again.used_bytes == store.used_bytes > 0 and again.path(rec.path.name) == rec.path


def test_recordings_are_found_by_exact_name_only(tmp_path):
    store = RecordingStore(tmp_path / "recs", 1 << 30)
    rec = store.open("s0", FPS, W, H)
    for header, aus in chunks(1):
        rec.add(header, aus, "p")
    rec.close()
    (tmp_path / "secret.mp4").write_bytes(b"x")
    for name in ("../secret.mp4", "..%2Fsecret.mp4", "secret.mp4", rec.recording_id + ".txt", "", ".mp4",
                 rec.recording_id + ".mp4/.."):
        assert store.path(name) is None, name
    second = store.open("s0", FPS, W, H)  # the same stream id within the same second: another id
    assert second.recording_id != rec.recording_id and second.recording_id.startswith("s0-")
    second.close()  # never started (no keyframe came): no file
    assert store.path(second.recording_id + ".mp4") is None
