"""What one input decoder may cost (streamsvc/inputs/gate.py, issue 41): the pixel cap before decoding, the rate with
whole groups of pictures dropped, the decoder's CPU budget. Real libx264 access units, exact counts."""

from __future__ import annotations

import pytest

from streamsvc.inputs import bitstream as B
from streamsvc.inputs.gate import InputGate, Verdict
from tests.streamsvc.test_bitstream import sps_of, x264


@pytest.fixture(scope="module")
def gop() -> list[bytes]:
    """An IDR and 9 P-frames (64x48), then the next IDR and 4 P-frames."""
    return x264(64, 48, 15, **{"x264-params": "keyint=10:min-keyint=10:scenecut=0"})


def unreferenced(au: bytes) -> bytes:
    """The access unit with every NAL unit's nal_ref_idc set to 0 (a frame no other refers to)."""
    return b"".join(b"\x00\x00\x00\x01" + bytes([u[0] & 0x9F]) + u[1:] for u in B.nal_units(au))


def bomb(idr: bytes, width: int = 8192, height: int = 8192) -> bytes:
    sps = sps_of(idr)
    return idr.replace(sps, B.with_size(sps, width, height))


def test_a_frame_that_declares_a_size_over_the_cap_refuses_the_input_before_it_is_decoded(gop):
    gate = InputGate(rate=32, burst=16, now=0.0)
    assert gate.admit(gop[0], 0.0) is Verdict.DECODE
    assert gate.admit(bomb(gop[0]), 0.1) is Verdict.REFUSE
    assert "8192x8192" in gate.refused and "1920x1080" in gate.refused
    assert [gate.admit(au, 0.2) for au in gop[:3]] == [Verdict.DROP] * 3  # nothing after it is decoded
    assert gate.counts.after_refusal == 3 and gate.counts.decoded == 1
    assert not gate.keyframe_wanted(5.0)
    portrait = InputGate(rate=32, burst=16, now=0.0)  # within the cap, on its side: decoded
    assert portrait.admit(bomb(gop[0], 1080, 1920), 0.0) is Verdict.DECODE and portrait.refused is None


def test_a_decoded_frame_over_the_cap_refuses_the_input_too():
    gate = InputGate(rate=32, burst=16, now=0.0)
    assert gate.decoded_size(1920, 1080) and gate.refused is None
    assert not gate.decoded_size(3840, 2160) and "3840x2160" in gate.refused


def test_over_the_rate_a_reference_frame_goes_with_its_group_of_pictures_until_the_next_idr(gop):
    gate = InputGate(rate=2, burst=3, now=0.0)
    verdicts = [gate.admit(au, 0.0) for au in gop[:10]]  # a whole GOP at once: 3 tokens
    assert verdicts == [Verdict.DECODE] * 3 + [Verdict.DROP] * 7
    assert gate.waiting_for_keyframe and gate.counts.gop == 7
    assert gate.keyframe_wanted(0.0) and not gate.keyframe_wanted(0.5) and gate.keyframe_wanted(1.0)
    assert gate.admit(gop[3], 10.0) is Verdict.DROP  # tokens again, but a P-frame without its reference: dropped
    assert [gate.admit(au, 10.0) for au in gop[10:13]] == [Verdict.DECODE] * 3  # the next IDR starts over
    assert not gate.waiting_for_keyframe and not gate.keyframe_wanted(20.0)
    assert gate.counts == type(gate.counts)(decoded=6, dropped=8, gop=8, keyframe_requests=2)


def test_over_the_rate_a_frame_no_other_refers_to_is_dropped_alone(gop):
    gate = InputGate(rate=2, burst=2, now=0.0)
    assert [gate.admit(au, 0.0) for au in gop[:2]] == [Verdict.DECODE] * 2
    assert gate.admit(unreferenced(gop[2]), 0.0) is Verdict.DROP  # over the rate, but nothing depends on it
    assert not gate.waiting_for_keyframe
    assert gate.admit(gop[3], 0.5) is Verdict.DECODE  # a token later: the group goes on
    assert gate.counts.alone == 1 and gate.counts.gop == 0


def test_an_sps_that_cannot_be_read_is_bad_input_and_its_group_waits_for_a_key_frame(gop):
    gate = InputGate(rate=32, burst=16, now=0.0)
    broken = gop[0].replace(sps_of(gop[0]), b"\x67\x42\xc0")
    assert gate.admit(broken, 0.0) is Verdict.BAD and gate.refused is None
    assert gate.admit(gop[1], 0.0) is Verdict.DROP
    assert gate.admit(gop[10], 0.0) is Verdict.DECODE


def test_a_decoder_over_its_cpu_budget_for_three_seconds_refuses_the_input():
    gate = InputGate(rate=32, burst=16, now=0.0, max_load=0.5, sustain_s=3)
    for i in range(200):  # 0.4 CPU-s a second (20 frames of 20 ms) for 10 s: under the budget
        assert gate.decode_time(0.02, i * 0.05)
    heavy = InputGate(rate=32, burst=16, now=0.0, max_load=0.5, sustain_s=3)
    i = 0
    while heavy.decode_time(0.05, i / 20):  # 1 CPU-s a second
        i += 1
        assert i < 200
    assert i == 60 and "1.00 CPU-seconds a second over 3 s" in heavy.refused  # refused 3 s in
    bursty = InputGate(rate=32, burst=16, now=0.0, max_load=0.5, sustain_s=3)
    for start in (0.0, 10.0, 20.0):  # 2 heavy seconds, then quiet: averaged over 3 s it stays under
        for i in range(20):
            assert bursty.decode_time(0.05, start + i * 0.05)
    assert bursty.decode_time(0.0, 40.0) and bursty.refused is None
