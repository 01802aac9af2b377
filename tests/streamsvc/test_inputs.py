"""InputFrames (streamsvc/inputs/frames.py): crop and scale, resampling to the stream's fps by capture time, the counts,
pause, and the bound on what it holds; on a manual clock."""

from __future__ import annotations

import av
import numpy as np
import pytest

from streamsvc.inputs.frames import FIRST_FRAME_WAIT_S, InputFrames, crop_box, scale_crop, scale_crop_av
from tests.clock import ManualClock
from tests.threads import names, needs_proc, thread_ids

FPS = 16
W, H = 32, 16  # the model's frame size in these tests (2:1)


def frame(value: int, w: int = W, h: int = H) -> np.ndarray:
    return np.full((h, w, 3), value, np.uint8)


def make(clock: ManualClock, **kw) -> InputFrames:
    return InputFrames(W, H, FPS, clock=clock, **kw)


def send(inp: InputFrames, clock: ManualClock, values, capture0: float = 50.0, step: float = 1 / FPS,
         delay: float = 0.01) -> None:
    """Frames `values` captured every `step` s from `capture0` (sender's clock), each arriving `delay` after."""
    start = clock.now
    for i, v in enumerate(values):
        clock.now = start + i * step + delay
        inp.push_frame(frame(v), capture0 + i * step)


def test_frames_at_the_stream_rate_fill_one_slot_each_and_release_the_chunk_at_its_last_frame():
    clock = ManualClock()
    inp = make(clock)
    woken = []
    inp.notify = lambda: woken.append(clock.now)
    assert not inp.released(0, 9)
    send(inp, clock, range(8))
    assert not inp.released(0, 9) and woken == []
    send(inp, clock, [8], capture0=50.0 + 8 / FPS)
    assert woken and inp.released(0, 9)
    taken = inp.take(0, 9)
    assert [int(f[0, 0, 0]) for f in taken.frames] == list(range(9))
    assert taken.capture_ms == pytest.approx([(50.0 + i / FPS) * 1000 for i in range(9)])
    assert taken.frames.shape == (9, H, W, 3) and taken.filled == 9
    assert inp.stats()["dropped"] == 0 and inp.stats()["repeated"] == 0 and inp.held == 0


def test_a_variable_frame_rate_is_resampled_by_capture_time():
    clock = ManualClock()
    inp = make(clock)
    # 12 slots: frames captured at irregular times (a 10 fps stretch, then a burst), each in its capture's slot
    captures = [0.0, 0.1, 0.2, 0.3, 0.5, 0.5625, 0.625, 0.6875]
    for i, t in enumerate(captures):
        clock.now = 1000.0 + t + 0.02
        inp.push_frame(frame(10 + i), 7.0 + t)
    taken = inp.take(0, 12)
    # slots 0..11 at 1/16 s: 0.0->0, 0.1->2, 0.2->3, 0.3->5, 0.5->8, 0.5625->9, 0.625->10, 0.6875->11
    assert [int(f[0, 0, 0]) for f in taken.frames] == [10, 10, 11, 12, 12, 13, 13, 13, 14, 15, 16, 17]
    assert taken.filled == 8
    assert inp.stats()["repeated"] == 4
    # a repeated frame carries the capture time of the frame it shows
    assert taken.capture_ms[1] == pytest.approx(7000.0) and taken.capture_ms[4] == pytest.approx(7200.0)


def test_a_flood_beyond_the_fps_is_dropped_and_counted_and_the_newest_frame_of_a_slot_wins():
    clock = ManualClock()
    inp = make(clock)
    send(inp, clock, range(48), capture0=3.0, step=1 / (4 * FPS), delay=0.0)  # 64 fps for 0.75 s
    taken = inp.take(0, 12)
    s = inp.stats()
    # 13 slots had frames (the last ones, 46 and 47, are slot 12's: still held), the 35 others were replaced
    assert s["received"] == 48 and s["dropped"] == 35 and s["repeated"] == 0 and s["held"] == 1
    # slot k holds the newest of the frames captured in it (to the nearest slot: 4k-2 .. 4k+1)
    assert [int(f[0, 0, 0]) for f in taken.frames][1:4] == [5, 9, 13]


def test_another_resolution_and_aspect_is_centre_cropped_then_scaled():
    # a 4:3 640x480 frame into 2:1: the middle 480 rows' centre 240 rows (crop top and bottom), then scaled
    assert crop_box(640, 480, W, H) == (0, 80, 640, 320)
    assert crop_box(200, 100, W, H) == (0, 0, 200, 100)
    assert crop_box(300, 100, W, H) == (50, 0, 200, 100)  # wider: the sides go
    img = np.zeros((480, 640, 3), np.uint8)
    img[:80] = 255  # top band: cropped away
    img[400:] = 255  # bottom band: cropped away
    img[80:400, :320] = (200, 0, 0)  # left half red, right half green
    img[80:400, 320:] = (0, 200, 0)
    out = scale_crop(img, W, H)
    assert out.shape == (H, W, 3)
    assert out[:, : W // 2 - 1, 0].min() >= 190 and out[:, : W // 2 - 1, 1].max() <= 10  # no white band, red left
    assert out[:, W // 2 + 1 :, 1].min() >= 190
    # the same through a YUV av.VideoFrame
    out_av = scale_crop_av(av.VideoFrame.from_ndarray(img, format="rgb24").reformat(format="yuv420p"), W, H)
    assert out_av.shape == (H, W, 3)
    assert np.abs(out_av[2:-2, 2 : W // 2 - 2].astype(int) - (200, 0, 0)).max() < 24
    # and through InputFrames
    clock = ManualClock()
    inp = make(clock)
    inp.push_frame(img, 1.0)
    inp.push_av(av.VideoFrame.from_ndarray(np.zeros((7, 5, 3), np.uint8), format="rgb24"), 1.0 + 1 / FPS)
    taken = inp.take(0, 2)
    assert taken.frames.shape == (2, H, W, 3)


def test_an_input_that_stops_for_seconds_is_missing_then_picked_up_again():
    clock = ManualClock()
    inp = make(clock)
    send(inp, clock, range(9), capture0=100.0)
    assert inp.take(0, 9) is not None
    # the input stops: chunk [9, 21) gets nothing; it is missing once its last slot's time + the wait has passed
    due = inp.missing_at(9, 12, 0.2)
    assert due == pytest.approx(1000.0 + 0.01 + 21 / FPS + 0.2)
    assert not inp.released(9, 12)
    clock.now = due
    assert inp.take(9, 12) is None
    assert inp.take(21, 12) is None  # seconds more of nothing
    # 3 s after it stopped the sender goes on (same clock): frames land in the slots of their capture time
    clock.now = 1000.0 + 3.0
    send(inp, clock, range(200, 224), capture0=100.0 + 3.0)  # slots 48 .. 71
    # a late frame for a slot already taken is dropped
    inp.push_frame(frame(7), 100.0 + 20 / FPS)
    taken = inp.take(33, 12)  # slots 33..44: nothing came for them
    assert taken is None
    taken = inp.take(45, 12)  # 45..47 empty, 48.. filled: the empty first slots repeat the chunk's first frame
    assert [int(f[0, 0, 0]) for f in taken.frames] == [200, 200, 200] + list(range(200, 209))
    s = inp.stats()
    assert s["missing_chunks"] == 3 and s["late"] == 1 and s["repeated"] == 3


def test_paused_frames_are_dropped_and_resume_reanchors():
    clock = ManualClock()
    inp = make(clock)
    send(inp, clock, range(3))
    inp.pause()
    send(inp, clock, range(5), capture0=60.0)
    assert inp.stats()["paused"] == 5 and inp.stats()["dropped"] == 5 and inp.held == 0
    clock.now += 30.0  # parked for a while
    inp.resume()
    send(inp, clock, range(50, 59), capture0=90.0)
    taken = inp.take(0, 9)  # the first free slot is 0 (nothing was taken): the resumed frames start there
    assert [int(f[0, 0, 0]) for f in taken.frames] == list(range(50, 59))


def test_memory_is_bounded_whatever_the_sender_does():
    clock = ManualClock()
    inp = make(clock, max_frames=16)
    # a sender far ahead of real time: capture times 10x faster than they arrive
    for i in range(200):
        clock.now = 1000.0 + i / FPS
        inp.push_frame(frame(i % 250), 5.0 + i * 10 / FPS)
        assert inp.held <= 16
    s = inp.stats()
    assert s["received"] == 200 and s["dropped"] >= 200 - 16
    # garbage frames: counted as decode errors, nothing held
    inp.push_frame(np.zeros((4, 4), np.uint8), 1.0)
    inp.push_frame(np.zeros((4, 4, 3), np.float32), 1.0)
    inp.push_frame(frame(1), float("nan"))
    assert inp.stats()["decode_errors"] == 3


def test_a_jump_of_the_senders_clock_reanchors_at_the_free_slot():
    clock = ManualClock()
    inp = make(clock)
    send(inp, clock, range(4), capture0=10.0)
    clock.now += 1 / FPS
    inp.push_frame(frame(98), 1e6)  # one frame off: a straggler, dropped (far ahead)
    inp.push_frame(frame(99), 1e6 + 0.01)  # two in a row: a new sender, another clock: by its arrival, the next slot
    taken = inp.take(0, 5)
    assert [int(f[0, 0, 0]) for f in taken.frames] == [0, 1, 2, 3, 99]
    assert inp.stats()["reanchors"] == 2


def test_the_first_frame_goes_to_the_streams_phase_and_the_slots_before_repeat_it():
    clock = ManualClock()
    inp = make(clock, phase=4)
    send(inp, clock, range(5))  # frames 0..4 captured at the stream's rate: slots 4..8
    assert inp.released(0, 9)  # released by its 5th frame, 4 frames earlier than at phase 0
    taken = inp.take(0, 9)
    assert [int(f[0, 0, 0]) for f in taken.frames] == [0, 0, 0, 0, 0, 1, 2, 3, 4]
    assert taken.capture_ms[-1] - taken.capture_ms[0] == pytest.approx(4 / FPS * 1000)
    assert inp.stats()["repeated"] == 4
    send(inp, clock, range(5, 17), capture0=50.0 + 5 / FPS)  # later ones follow their capture times
    assert [int(f[0, 0, 0]) for f in inp.take(9, 12).frames] == list(range(5, 17))
    with pytest.raises(ValueError):
        make(clock, phase=64)


def test_a_camera_whose_first_frame_comes_late_still_gives_the_first_chunk():
    # a WebRTC camera's first frame comes after offer/answer, ICE, DTLS and a keyframe: 1.5 s after the start here
    clock = ManualClock()
    inp = make(clock)
    start = clock.now
    assert inp.missing_at(0, 9, 0.25) == pytest.approx(start + FIRST_FRAME_WAIT_S + 9 / FPS + 0.25)
    clock.now = start + 1.5
    send(inp, clock, range(9), capture0=300.0)
    assert inp.released(0, 9)
    taken = inp.take(0, 9)
    assert taken is not None and [int(f[0, 0, 0]) for f in taken.frames] == list(range(9))
    # from the first frame on, a chunk with nothing is missing by the slots' own times, with no first-frame wait
    assert inp.missing_at(9, 12, 0.25) == pytest.approx(start + 1.5 + 0.01 + 21 / FPS + 0.25)


def test_a_chunk_is_let_go_by_its_viewers_deadline_but_never_before_the_camera_is_known_to_be_quiet():
    clock = ManualClock()
    inp = make(clock)
    send(inp, clock, range(9), capture0=100.0)  # slots 0..8, the origin 1000.01
    assert inp.take(0, 9) is not None
    origin = 1000.0 + 0.01
    nominal = origin + 21 / FPS + 0.25  # chunk [9, 21): its last slot's time + the wait, as before issue 41
    assert inp.missing_at(9, 12, 0.25) == pytest.approx(nominal)
    assert inp.missing_at(9, 12, 0.25, release_by=nominal + 1.0) == pytest.approx(nominal)  # no later than that
    # its viewer's deadline comes first: let go by then, once the camera has been quiet (no frame for slot 9, due
    # at origin + 9/16, by `wait_s` after it)
    assert inp.missing_at(9, 12, 0.25, release_by=origin + 1.0) == pytest.approx(origin + 1.0)
    assert inp.missing_at(9, 12, 0.25, release_by=origin) == pytest.approx(origin + 9 / FPS + 0.25)
    # a camera still sending (frames for slots 9..14 came): not before its next frame is overdue by the wait
    send(inp, clock, range(9, 15), capture0=100.0 + 9 / FPS)
    assert inp.missing_at(9, 12, 0.25, release_by=origin) == pytest.approx(origin + 15 / FPS + 0.25)
    assert inp.missing_at(9, 12, 0.25, release_by=origin) > clock.now


def test_a_camera_that_never_sends_lets_the_stream_start_without_input():
    clock = ManualClock()
    inp = make(clock)
    clock.now = inp.missing_at(0, 9, 0.25)
    assert not inp.released(0, 9) and inp.take(0, 9) is None
    assert inp.stats()["missing_chunks"] == 1


@needs_proc
def test_close_ends_the_threads_of_the_streams_swscale_context():
    """The stream's scaler is kept from frame to frame, not past the stream (a closed stream's objects can sit in a
    reference cycle until a rare full garbage collection: issue 46)."""
    clock = ManualClock()
    inp = make(clock)
    before = thread_ids()
    inp.push_av(av.VideoFrame.from_ndarray(np.zeros((48, 64, 3), np.uint8), format="rgb24"), 1.0)
    assert inp.held == 1
    started = thread_ids() - before
    if not started:
        pytest.skip("swscale started no threads here (one core)")
    inp.close()
    assert not started & thread_ids(), f"still running after close: {names(started & thread_ids())}"
