"""The chunks a stream keeps for watchers who join, and where a newcomer starts; a viewer's buffer as the stream's
model counts it; a stream's secrets. (Prompts are coalesced by the scheduler:
tests/streamsvc/scheduling/test_planner.py, and through a running server in tests/client/test_e2e_access.py.)"""

from types import SimpleNamespace

from streamsvc.viewers.session import GOP_CHUNKS, Role, Session, Viewer
from streamsvc.wire import protocol as P

# ---------------------------------------------------------------- watchers join at a kept keyframe


def chunk(index: int, keyframe: bool, frames: int = 12) -> SimpleNamespace:
    """A ChunkOut as fan_out sees it: its header."""
    return SimpleNamespace(header=SimpleNamespace(index=index, pts=index * frames, frames=frames, keyframe=keyframe))


def fed(keyframes: list[int], n: int) -> Session:
    """A session that fanned out chunks 0..n-1, `keyframes` among them."""
    session = Session("s0", 16, "a red ball")
    for i in range(n):
        session.fan_out(chunk(i, i in keyframes))
    session.chunks_sent = n
    return session


def joined(session: Session, buffered_frames: float | None) -> list[int]:
    viewer = Viewer("v1", session, Role.WATCH)
    assert session.join(viewer, buffered_frames)
    return [viewer.outbox.get_nowait().header.index for _ in range(viewer.outbox.qsize())]


def test_the_stream_keeps_its_last_two_keyframe_intervals_for_newcomers():
    assert [c.header.index for c in fed([0, 3, 6], 8).gop] == [3, 4, 5, 6, 7]
    assert [c.header.index for c in fed([0, 3], 5).gop] == [0, 1, 2, 3, 4]
    assert [c.header.index for c in fed([0, 7], GOP_CHUNKS + 3).gop] == [7, 8, 9, 10]  # 0 is too far back
    assert fed([0], GOP_CHUNKS + 1).gop == []  # no keyframe within reach: a newcomer waits for one


def test_a_newcomer_starts_at_the_latest_keyframe_that_does_not_put_it_ahead_of_the_stream_s_viewers():
    session = fed([0, 3, 6], 8)  # 96 frames sent in chunks of 12; keyframe chunks start at frames 36 and 72
    assert joined(session, 12) == [6, 7]  # 12 frames buffered and a chunk more: chunk 6 (72) gives it exactly 24
    assert joined(session, 13) == [3, 4, 5, 6, 7]  # chunk 6 would give 24 < 25: it starts at 3 (60 frames)
    assert joined(session, 90) == [3, 4, 5, 6, 7]  # none far enough back: the earliest kept
    assert joined(session, None) == [6, 7]  # without the stream's buffer: the latest


def test_a_newcomer_with_no_keyframe_kept_waits_for_the_next_keyframe_chunk():
    session = fed([0], GOP_CHUNKS + 1)
    viewer = Viewer("v1", session, Role.WATCH)
    assert not session.join(viewer, 12.0) and viewer.keyframe_wanted
    session.fan_out(chunk(GOP_CHUNKS + 1, False))
    assert viewer.outbox.empty()
    assert session.fan_out(chunk(GOP_CHUNKS + 2, True)) == [viewer]  # its first


def test_a_viewer_s_report_counts_the_frames_queued_for_it_that_have_not_reached_it():
    session = fed([0, 3], 5)  # 60 frames sent
    viewer = Viewer("v1", session, Role.WATCH)
    session.join(viewer, None)  # from chunk 3: frames 36..59 queued for it
    assert (viewer.first_pts, viewer.queued_end) == (36, 60)
    # it played 6 and holds 6: the second chunk is still on its way, and the model counts it
    assert viewer.buffered_frames(P.Stats(buffered_s=6 / 16, frames_played=6)) == 18
    # all of it arrived: its report as it is (never less)
    assert viewer.buffered_frames(P.Stats(buffered_s=18 / 16, frames_played=6)) == 18
    viewer.rtc = object()  # over WebRTC the track's own queue is reported apart: the report as it is
    assert viewer.buffered_frames(P.Stats(buffered_s=6 / 16, frames_played=6)) == 6
    assert Viewer("v2", session, Role.WATCH).buffered_frames(P.Stats(buffered_s=0.5, frames_played=0)) == 8


def test_a_stream_has_a_watch_and_a_steer_secret_of_128_bits_each_that_differ_between_streams():
    import base64

    sessions = [Session(f"s{i}", fps=16, prompt="p") for i in range(50)]
    secrets = [s.watch_secret for s in sessions] + [s.steer_secret for s in sessions]
    assert len(set(secrets)) == 100
    assert all(len(base64.urlsafe_b64decode(x + "=" * (-len(x) % 4))) >= 16 for x in secrets)
    assert "watch_secret" not in repr(sessions[0]) and sessions[0].watch_secret not in repr(sessions[0])  # not in logs
    a, b = sessions[:2]
    assert a.may_watch(a.watch_secret) and a.may_steer(a.steer_secret)
    for wrong in (None, "", b.watch_secret, a.steer_secret, a.watch_secret[:-1], a.watch_secret + "x", "é" * 22):
        assert not a.may_watch(wrong), wrong
    for wrong in (None, "", b.steer_secret, a.watch_secret):
        assert not a.may_steer(wrong), wrong


# ---------------------------------------------------------------- WebRTC viewers' queue reports


def test_a_webrtc_viewer_that_left_reports_no_queue_and_leaves_no_entry_behind():
    """A track still sends what it had queued after its viewer left (until its peer connection closes): its report
    must not bring back its entry, which would stay for the stream's life and hold the stream's model at a queue
    nobody plays."""
    from streamsvc.viewers.server import TrackReports

    reported = []
    engine = SimpleNamespace(observe_buffer=lambda sid, frames, grace_s=0.0: reported.append(frames))
    session = Session("s0", 16, "a red ball")
    staying, leaving = Viewer("v0", session, Role.STEER), Viewer("v1", session, Role.WATCH)
    for v in (staying, leaving):
        session.join(v)
    TrackReports(engine, staying).observe_buffer("s0", 20.0)
    TrackReports(engine, leaving).observe_buffer("s0", 4.0)
    assert session.track_queues == {"v0": 20.0, "v1": 4.0} and reported == [20.0, 4.0]  # the lowest of the two
    session.leave(leaving, now=1.0)
    session.track_queues.pop(leaving.viewer_id)  # (what Streams.leave does)
    TrackReports(engine, leaving).observe_buffer("s0", 3.0)  # a frame its track still had
    assert session.track_queues == {"v0": 20.0} and reported == [20.0, 4.0]
    TrackReports(engine, staying).observe_buffer("s0", 18.0)
    assert reported[-1] == 18.0  # the model follows the viewer that stays
