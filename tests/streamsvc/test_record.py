"""Recording: chunks as the viewers get them muxed into MP4 without re-encode, a chapter per prompt, a disk budget."""

import re

import av
import numpy as np
import pytest

from kvcache.units import format_bytes
from streamsvc.engine.encode import StreamDecoder, StreamEncoder, is_idr
from streamsvc.viewers.record import RecordingRefused, RecordingStore
from streamsvc.wire.protocol import Chunk

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


def encoded(sizes: list[int], keyframe_interval: int, fast_at: tuple[int, ...] = ()) -> list[tuple[Chunk, list[bytes]]]:
    """Chunks of `sizes` frames as the output stage makes them: IDRs at chunk starts an interval apart and
    `fast_at` chunks through the fast context (its own PPS), the header's keyframe flag from the first packet."""
    enc = StreamEncoder(W, H, FPS, keyframe_interval=keyframe_interval)
    out, pts = [], 0
    for i, n in enumerate(sizes):
        video = np.zeros((n, H, W, 3), np.uint8)
        for f in range(n):
            video[f, ..., 1] = 3 * (pts + f) % 256
            video[f, 10:18, (pts + f) % (W - 8):(pts + f) % (W - 8) + 8] = (200, 40, 40)
        packets = enc.encode(video, start_index=pts, fast=i in fast_at)
        aus = [bytes(p) for p in packets]
        out.append((Chunk.describe(aus, index=i, pts=pts, prompt_version=0, steps=4, keyframe=packets[0].is_keyframe,
                                   fast=i in fast_at), aus))
        pts += n
    enc.close()
    return out


def nal_units(annexb: bytes) -> list[bytes]:
    return [n.rstrip(b"\x00") for n in annexb.replace(b"\x00\x00\x00\x01", b"\x00\x00\x01").split(b"\x00\x00\x01") if n]


def test_the_tracks_avcc_holds_the_first_keyframes_own_sps_and_pps(tmp_path):
    store = RecordingStore(tmp_path, 1 << 30)
    rec = store.open("s1", FPS, W, H)
    sent = encoded([9, 12], keyframe_interval=32)
    for header, aus in sent:
        rec.add(header, aus, "p")
    rec.close()
    sps, pps = [n for n in nal_units(sent[0][1][0]) if n[0] & 0x1F in (7, 8)]
    with av.open(str(rec.path)) as c:
        avcc = c.streams.video[0].codec_context.extradata
    # ISO/IEC 14496-15 AVCDecoderConfigurationRecord: version 1, the SPS's profile, compatibility and level, 4-byte
    # lengths, one SPS, one PPS. (An encoder opened for the track would put its own here: High profile, not ours.)
    assert avcc[0] == 1 and avcc[1:4] == sps[1:4] and avcc[4] == 0xFF and avcc[5] == 0xE1
    n = int.from_bytes(avcc[6:8], "big")
    assert avcc[8:8 + n] == sps and avcc[8 + n] == 1
    m = int.from_bytes(avcc[9 + n:11 + n], "big")
    assert avcc[11 + n:11 + n + m] == pps


def test_every_idr_is_a_sync_sample_and_the_recording_decodes_to_what_the_viewers_decoded(tmp_path):
    # IDRs at chunk starts 20 frames or more apart (0, 24, 72) and around chunk 3, a fast one (its own x264 context,
    # another PPS; an IDR first, and one at the next normal chunk)
    sent = encoded([12] * 8, keyframe_interval=20, fast_at=(3,))
    store = RecordingStore(tmp_path, 1 << 30)
    rec = store.open("s1", FPS, W, H)
    for (header, aus), prompt in zip(sent, ["a"] * 3 + ["b"] * 5):
        assert rec.add(header, aus, prompt)
    rec.close()
    aus = [au for _, chunk in sent for au in chunk]
    assert len({nal_units(au)[1] for au in aus if is_idr(au)}) == 2  # two PPS: the normal and the fast context's
    viewer = StreamDecoder()
    watched = [frame for au in aus for frame in viewer.decode(au)]
    with av.open(str(rec.path)) as c:
        keyframes = [p.is_keyframe for p in c.demux(video=0) if p.size]
    with av.open(str(rec.path)) as c:
        recorded = [frame.to_ndarray(format="rgb24") for frame in c.decode(video=0)]
    assert keyframes == [is_idr(au) for au in aus] and [i for i, k in enumerate(keyframes) if k] == [0, 24, 36, 48, 72]
    assert len(recorded) == len(watched) == 96
    assert all(np.array_equal(a, b) for a, b in zip(recorded, watched))  # the same pictures: nothing re-encoded


def test_a_recording_stopped_by_the_budget_is_finished_at_once_and_leaves_the_store_consistent(tmp_path):
    sent = chunks(6)
    store = RecordingStore(tmp_path, sum(len(au) for au in sent[0][1]) + sum(len(au) for au in sent[1][1]))
    rec = store.open("s1", FPS, W, H)
    assert [rec.add(header, aus, "p") for header, aus in sent[:3]] == [True, True, False]
    with av.open(str(rec.path)) as c:  # playable before the stream ends and close() comes
        assert len(list(c.decode(video=0))) == 24
    rec.close()  # the server's, at the stream's end: nothing more happens
    assert store.used_bytes == rec.path.stat().st_size + rec.chapters_path.stat().st_size
    # a recording whose first chunk does not fit makes no file and holds nothing
    small = RecordingStore(tmp_path / "small", 100)
    late = small.open("s2", FPS, W, H)
    assert late.add(*sent[0], "p") is False and "stopped at 0.0 s" in late.stopped_reason
    assert not late.path.exists() and not late.chapters_path.exists() and small.used_bytes == 0
    assert small.open("s3", FPS, W, H)  # nothing was counted: the next one may start


def test_deleting_old_recordings_frees_the_budget_of_the_running_store(tmp_path):
    sent = chunks(2)
    store = RecordingStore(tmp_path, sum(len(au) for au in sent[0][1]) + 1)  # one chunk fits, not with its index
    old = store.open("s1", FPS, W, H)
    assert [old.add(header, aus, "p") for header, aus in sent] == [True, False]
    used = store.used_bytes
    assert used > store.max_bytes
    refusal = f"recordings use {format_bytes(used)} of their {format_bytes(store.max_bytes)} (--record-max-gib);"
    with pytest.raises(RecordingRefused, match=re.escape(refusal)):
        store.open("s2", FPS, W, H)
    old.path.unlink()
    old.chapters_path.unlink()  # what the refusal tells the operator to do; no restart
    assert store.used_bytes == 0
    assert store.open("s2", FPS, W, H).recording_id.startswith("s2-")
    assert store.path(old.path.name) is None


def test_names_and_ids_are_checked_exactly(tmp_path):
    store = RecordingStore(tmp_path, 1 << 30)
    rec = store.open("s0", FPS, W, H)
    rec.add(*chunks(1)[0], "p")
    rec.close()
    assert store.path(rec.path.name) == rec.path
    assert store.path(rec.path.name + "\n") is None and store.path(" " + rec.path.name) is None
    with pytest.raises(ValueError, match="letters, digits"):
        store.open("../s0", FPS, W, H)
    with pytest.raises(ValueError, match="budget > 0"):
        RecordingStore(tmp_path, 0)


def test_a_recordings_link_carries_a_secret_of_its_own_and_is_found_only_with_it(tmp_path):
    store = RecordingStore(tmp_path, 1 << 30)
    rec, other = store.open("s0", FPS, W, H), store.open("s0", FPS, W, H)
    for r in (rec, other):
        r.add(*chunks(1)[0], "p")
    # ID-SECRET: the stream id and a UTC time, then 128 random bits in hex, different for every recording
    assert re.fullmatch(r"s0-\d{8}T\d{6}-[0-9a-f]{32}", rec.name) and rec.name == f"{rec.recording_id}-{rec.secret}"
    assert len(rec.secret) * 4 >= 128 and rec.secret != other.secret and rec.path.name == rec.name + ".mp4"
    assert store.in_progress(rec.name + ".mp4") and store.in_progress(rec.name + ".vtt")
    rid = rec.recording_id
    wrong = [rid + ".mp4", f"{rid}-{other.secret}.mp4", f"{rid}-{'0' * 32}.mp4", f"{rid}-{rec.secret.upper()}.mp4",
             f"{rid}-{rec.secret[:-1]}.mp4", f"{rid}-{rec.secret}0.mp4", f"{rid}-{rec.secret}.vtt.mp4"]
    for name in wrong:  # not even "in progress": nothing tells that the recording exists
        assert not store.in_progress(name) and store.path(name) is None, name
    rec.close()
    other.close()
    assert store.path(rec.name + ".mp4") == rec.path and store.path(rec.name + ".vtt") == rec.chapters_path
    for name in wrong:
        assert store.path(name) is None, name
    # a file of an earlier version's naming (ID.mp4, no secret) counts against the budget and is never served
    legacy = tmp_path / "s9-20250101T000000.mp4"
    legacy.write_bytes(b"x" * 1000)
    again = RecordingStore(tmp_path, 1 << 30)  # the next run finds the recordings by their links, from their names
    assert again.path(legacy.name) is None and again.used_bytes == store.used_bytes >= 1000 + rec.path.stat().st_size
    assert again.path(rec.name + ".mp4") == rec.path and again.path(f"{rec.recording_id}-{other.secret}.mp4") is None


def test_a_recording_deleted_from_the_directory_is_forgotten_and_those_written_or_kept_are_not(tmp_path):
    """Over a long run the store knows the recordings the directory holds and those being written, no more: one
    deleted by the operator leaves no entry behind (its link finds nothing, as before)."""
    store = RecordingStore(tmp_path, 1 << 30)
    done = []
    for i in range(3):
        rec = store.open(f"s{i}", FPS, W, H)
        rec.add(*chunks(1)[0], "p")
        rec.close()
        done.append(rec)
    writing = store.open("s9", FPS, W, H)  # no file yet: it waits for its first keyframe
    assert store.table_sizes() == {"recordings.active": 1, "recordings.known": 4}
    for rec in done[:2]:
        rec.path.unlink()
        rec.chapters_path.unlink()
    assert store.path(done[0].path.name) is None  # (a request scans the directory)
    assert store.table_sizes() == {"recordings.active": 1, "recordings.known": 2}
    assert store.path(done[2].path.name) == done[2].path  # the one kept is still served
    writing.add(*chunks(1)[0], "p")
    assert store.in_progress(writing.name + ".mp4")
    writing.close()
    assert store.path(writing.path.name) == writing.path
    assert store.table_sizes() == {"recordings.active": 0, "recordings.known": 2}
