"""The playback buffer, with hand-computed values.

Most tests run at 4 fps (a frame every 0.25 s) with times that are exact in
binary floating point, so every expected value is exact.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from client.playback import PlaybackBuffer, PlaybackState


def connected(fps: float = 4, at: float = 0.0) -> PlaybackBuffer:
    buf = PlaybackBuffer(fps)
    buf.connect(at)
    return buf


def test_playback_starts_on_the_first_chunk_and_plays_at_fps():
    buf = connected(at=1.0)
    buf.push(4, 0, 1.5)  # frames play at 1.5, 1.75, 2.0, 2.25
    s = buf.stats(2.0)
    assert s.ttff_s == 0.5
    assert s.frames_played == 3 and s.frames_received == 4
    assert s.buffered_s == 0.25 and s.play_s == 0.5 and s.stalls == 0
    assert buf.state is PlaybackState.PLAYING


def test_a_stall_runs_from_the_due_time_to_the_next_arrival():
    buf = connected()
    buf.push(4, 0, 0.5)  # plays 0.5 .. 1.25; frame 5 due at 1.5 finds the buffer empty
    buf.advance(1.75)
    assert buf.state is PlaybackState.STALLED
    buf.push(4, 0, 2.0)  # stall 1.5 -> 2.0; plays on arrival, then 2.25, 2.5, 2.75
    s = buf.stats(3.0)  # the frame due at 3.0 is missing, but a stall of zero length is no stall
    assert (s.stalls, s.stall_s) == (1, 0.5)
    assert s.play_s == 2.0  # 0.5 -> 1.5 and 2.0 -> 3.0
    assert s.frames_played == 8
    assert s.delivered_fps == 8 / 2.5
    assert s.stall_ratio == 0.5 / 2.5


def test_a_frame_arriving_exactly_at_its_due_time_is_not_a_stall():
    buf = connected()
    buf.push(1, 0, 0.0)
    buf.push(1, 0, 0.25)
    s = buf.stats(0.25)
    assert (s.stalls, s.stall_s, s.frames_played) == (0, 0.0, 2)


def test_a_stall_still_going_on_counts_up_to_now():
    buf = connected()
    buf.push(1, 0, 0.0)
    s = buf.stats(1.0)  # stalled since 0.25
    assert (s.stalls, s.stall_s, s.play_s) == (1, 0.75, 0.25)
    assert s.delivered_fps == 1.0
    buf.push(2, 0, 1.5)
    s = buf.stats(1.5)
    assert (s.stalls, s.stall_s) == (1, 1.25)  # still the same stall


def test_after_a_stall_frames_are_due_from_the_arrival():
    buf = connected()
    buf.push(1, 0, 0.0)
    buf.push(3, 0, 0.375)  # stall 0.25 -> 0.375, then frames at 0.375, 0.625, 0.875
    assert buf.stats(0.874).frames_played == 3
    assert buf.stats(0.875).frames_played == 4


def test_pause_freezes_the_playback_clock():
    buf = connected()
    buf.push(8, 0, 0.0)  # plays 0, 0.25, 0.5; the next was due at 0.75
    buf.pause(0.625)
    buf.push(4, 0, 1.0)  # arrives while paused
    s = buf.stats(2.0)
    assert buf.state is PlaybackState.PAUSED
    assert (s.frames_played, s.play_s, s.paused_s, s.stalls) == (3, 0.625, 1.375, 0)
    buf.resume(2.625)  # the next frame had 0.125 s left: due at 2.75
    assert buf.stats(2.7).frames_played == 3
    s = buf.stats(3.0)  # plays 2.75, 3.0
    assert (s.frames_played, s.play_s, s.paused_s, s.buffered_s) == (5, 1.0, 2.0, 7 / 4)
    assert s.freezes == 0  # the gap over the pause is not a freeze


def test_pause_and_resume_are_idempotent():
    buf = connected()
    buf.push(2, 0, 0.0)
    buf.resume(0.1)  # not paused: nothing happens
    buf.pause(0.125)
    buf.pause(0.2)
    buf.resume(0.5)
    buf.resume(0.6)
    assert buf.stats(0.6).paused_s == 0.375


def test_pause_during_a_stall_stops_the_stall_clock():
    buf = connected()
    buf.push(2, 0, 0.0)  # plays 0, 0.25; stalls from 0.5
    buf.pause(1.0)
    buf.push(4, 1, 1.5)  # arrives during the pause
    s = buf.stats(1.75)
    assert (s.stalls, s.stall_s) == (1, 0.5)
    buf.resume(2.0)  # the stall ended with the pause: play at once
    s = buf.stats(2.0)
    assert (s.stalls, s.stall_s, s.play_s, s.paused_s, s.frames_played) == (1, 0.5, 0.5, 1.0, 3)


def test_a_stall_goes_on_after_a_resume_with_an_empty_buffer():
    buf = connected()
    buf.push(1, 0, 0.0)  # stalls from 0.25
    buf.pause(0.5)
    buf.resume(1.0)
    buf.push(1, 0, 1.5)
    s = buf.stats(1.5)
    assert (s.stalls, s.stall_s) == (1, 0.75)  # 0.25 -> 0.5 and 1.0 -> 1.5, one stall


def test_pause_before_the_first_frame():
    buf = connected()
    buf.pause(0.25)
    buf.push(4, 0, 0.5)
    s = buf.stats(1.0)
    assert s.ttff_s == 0.5 and s.frames_played == 0  # available, not played
    buf.resume(1.5)
    s = buf.stats(1.75)
    assert (s.frames_played, s.play_s, s.paused_s) == (2, 0.25, 1.25)


def test_finish_closes_the_books():
    buf = connected()
    buf.push(2, 0, 0.0)
    buf.finish(1.0)  # stalled since 0.5
    s = buf.stats()
    assert (s.stalls, s.stall_s, s.play_s, s.frames_played) == (1, 0.5, 0.5, 2)
    assert buf.state is PlaybackState.ENDED
    assert buf.stats(5.0) == s  # nothing accrues after the end
    with pytest.raises(RuntimeError, match="ended"):
        buf.push(1, 0, 2.0)


def test_finish_while_paused_in_a_stall():
    buf = connected()
    buf.push(1, 0, 0.0)
    buf.pause(0.5)
    buf.push(1, 0, 0.75)
    buf.finish(1.0)
    s = buf.stats()
    assert (s.stalls, s.stall_s, s.paused_s, s.frames_played) == (1, 0.25, 0.5, 1)


# ---------------------------------------------------------------- W3C freezes


def test_a_long_gap_is_a_freeze():
    buf = connected()
    buf.push(8, 0, 0.0)  # renders 0 .. 1.75: 7 gaps of 0.25
    buf.push(1, 0, 3.0)  # gap 1.25; mean of the 8 gaps = 3.0 / 8 = 0.375; 1.25 >= max(1.125, 0.525)
    s = buf.stats()
    assert (s.freezes, s.freeze_s) == (1, 1.25)
    assert (s.stalls, s.stall_s) == (1, 1.0)  # due at 2.0, arrived at 3.0


def test_a_stall_need_not_be_a_freeze():
    buf = connected()
    buf.push(8, 0, 0.0)
    buf.push(1, 0, 2.5)  # gap 0.75; mean = 2.5 / 8 = 0.3125; 0.75 < max(0.9375, 0.4625)
    s = buf.stats()
    assert s.freezes == 0 and (s.stalls, s.stall_s) == (1, 0.5)


def test_freezes_need_five_gaps():
    buf = connected()
    buf.push(2, 0, 0.0)  # one gap
    buf.push(1, 0, 5.0)  # a 4.75 s gap, but only the second
    assert buf.stats().freezes == 0


def test_the_150_ms_rule_at_high_fps():
    # At 64 fps 3 x mean is below mean + 150 ms. With 29 gaps of 1/64 and one of g in the
    # window, g is a freeze when g >= (29/64 + g) / 30 + 0.15, i.e. g >= 4.5/29 + 1/64 = 0.170797...
    for gap, freeze in [(0.1705, False), (0.1711, True)]:
        buf = connected(fps=64)
        buf.push(40, 0, 0.0)  # renders at k/64, the last at 39/64
        buf.push(1, 0, 39 / 64 + gap)
        s = buf.stats()
        assert s.freezes == int(freeze)
        assert s.freeze_s == pytest.approx(gap if freeze else 0.0)


def test_the_freeze_window_is_the_last_30_gaps():
    buf = connected()
    buf.push(6, 0, 0.0)  # 5 gaps of 0.25, renders up to 1.25
    buf.push(1, 0, 5.0)  # gap 3.75: mean (1.25 + 3.75) / 6 = 0.8333; 3.75 >= 2.5: a freeze
    buf.push(29, 0, 5.25)  # renders 5.25 .. 12.25: 29 gaps of 0.25 push the long one out of the window
    buf.advance(12.25)
    # Gap 1.0. Over the last 30 gaps: mean = (29 * 0.25 + 1.0) / 30 = 0.275, and 1.0 >= 0.825: a freeze.
    # Had the 3.75 s gap stayed in the average (mean = (3.75 + 29 * 0.25 + 1.0) / 31 = 0.387), it would not be.
    buf.push(1, 0, 13.25)
    s = buf.stats()
    assert (s.freezes, s.freeze_s) == (2, 4.75)


# ---------------------------------------------------------------- control latency


def test_control_latency_runs_from_send_to_the_first_frame_played_under_the_prompt():
    buf = connected()
    buf.push(4, 0, 0.0)  # v0 at 0 .. 0.75
    buf.prompt_sent_at(0.625)
    buf.prompt_acked(1, 0.6875)
    buf.push(4, 0, 1.0)  # v0 at 1.0 .. 1.75 (arrived just in time)
    buf.push(4, 1, 1.125)  # v1 from 2.0
    assert buf.stats(1.9).control_latencies_s == ()
    assert buf.stats(1.9).prompts_pending == 1
    s = buf.stats(2.0)
    assert s.control_latencies_s == (1.375,) and s.prompts_pending == 0


def test_a_later_version_settles_earlier_prompts():
    buf = connected()
    buf.push(4, 0, 0.0)
    buf.prompt_sent_at(0.25)
    buf.prompt_sent_at(0.5)
    buf.prompt_acked(1, 0.5)
    buf.prompt_acked(2, 0.625)
    buf.push(8, 2, 0.75)  # version 1 never made it to the screen; v2 plays from 1.0
    assert buf.stats(1.0).control_latencies_s == (0.75, 0.5)


def test_a_frame_played_before_the_ack_still_counts():
    buf = connected()
    buf.push(1, 0, 0.0)
    buf.prompt_sent_at(0.125)
    buf.push(4, 3, 0.5)  # plays at once (after a stall)
    buf.prompt_acked(3, 1.0)
    assert buf.stats().control_latencies_s == (0.375,)


def test_prompt_sent_with_a_known_version_and_a_rejected_prompt():
    buf = connected()
    buf.push(1, 0, 0.0)
    buf.prompt_sent_at(0.25)
    buf.prompt_rejected()  # answered by an error
    buf.prompt_sent(1, 0.5)
    buf.push(1, 1, 1.25)
    s = buf.stats()
    assert s.control_latencies_s == (0.75,) and s.prompts_pending == 0
    with pytest.raises(RuntimeError, match="no prompt awaits"):
        buf.prompt_acked(2, 1.5)


# ---------------------------------------------------------------- misuse


def test_misuse_is_refused_with_the_state():
    buf = PlaybackBuffer(4)
    with pytest.raises(RuntimeError, match="playback is new"):
        buf.push(1, 0, 0.0)
    buf.connect(1.0)
    with pytest.raises(RuntimeError, match="playback is waiting"):
        buf.connect(1.0)
    with pytest.raises(ValueError, match="backwards"):
        buf.advance(0.5)
    with pytest.raises(ValueError, match="frames"):
        buf.push(0, 0, 1.0)
    with pytest.raises(ValueError, match="fps"):
        PlaybackBuffer(0)
    assert buf.stats().ttff_s is None and buf.stats().delivered_fps == 0.0


# ---------------------------------------------------------------- invariants


events = st.lists(
    st.tuples(st.sampled_from(["push", "advance", "pause", "resume"]), st.integers(0, 40), st.integers(1, 12)),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(events)
def test_time_and_frames_are_conserved(script):
    """Every second after connect is waiting, playing, stalled or paused; every frame is played or buffered."""
    buf = connected(fps=8)
    now, waiting, last, version = 0.0, 0.0, 0.0, 0
    for action, dt, frames in script:
        now += dt / 16
        if buf.state is PlaybackState.WAITING:
            waiting += now - last
        if action == "push":
            version += frames % 2
            buf.push(frames, version, now)
        else:
            getattr(buf, action)(now)
        last = now
    s = buf.stats(now + 1.0)
    if buf.state is PlaybackState.WAITING:
        waiting += 1.0
    assert s.play_s + s.stall_s + s.paused_s + waiting == pytest.approx(now + 1.0)
    assert s.frames_played + round(s.buffered_s * 8) == s.frames_received
    assert s.frames_played <= s.frames_received
    assert s.freeze_s <= s.play_s + s.stall_s + 1e-9


def test_a_cut_drops_the_frames_buffered_and_not_played_and_the_new_prompt_plays_next():
    buf = connected(fps=4, at=0.0)
    buf.push(8, 0, 1.0)  # plays from 1.0, a frame every 0.25 s
    buf.prompt_sent(1, 1.1)
    assert buf.push(4, 1, 1.3, cut=True) == 6  # 1.0 and 1.25 played: 6 of the old prompt dropped
    s = buf.stats(1.5)  # the new prompt's first frame was due at 1.5
    assert s.control_latencies_s == (pytest.approx(0.4),) and s.stalls == 0
    assert (s.frames_received, s.frames_played, s.buffered_s) == (12, 3, 0.75)
    assert buf.push(4, 1, 1.6) == 0  # a chunk that does not cut drops nothing
