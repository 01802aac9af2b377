"""What an encoded frame declares before it is decoded (streamsvc/inputs/bitstream.py, issue 41): the SPS reader on real
SPS from PyAV's libx264 at several sizes, profiles and with cropping, on an SPS written bit by bit here, the pixel cap,
and what `inspect` reads of H.264 and VP8 frames."""

from __future__ import annotations

from fractions import Fraction

import av
import numpy as np
import pytest

from streamsvc.inputs import bitstream as B


def x264(width: int, height: int, frames: int = 2, **options) -> list[bytes]:
    """`frames` access units of libx264 (ultrafast, no B-frames unless `options` say) at width x height."""
    codec = av.CodecContext.create("libx264", "w")
    codec.width, codec.height, codec.pix_fmt, codec.time_base = width, height, "yuv420p", Fraction(1, 16)
    codec.options = {"preset": "ultrafast", "tune": "zerolatency", **options}
    out = []
    for i in range(frames):
        frame = av.VideoFrame.from_ndarray(np.full((height, width, 3), 7 * i % 256, np.uint8), format="rgb24")
        frame.pts = i
        out += [bytes(p) for p in codec.encode(frame)]
    return out + [bytes(p) for p in codec.encode(None)]


def sps_of(access_unit: bytes) -> bytes:
    return next(u for u in B.nal_units(access_unit) if u[0] & 0x1F == B.NAL_SPS)


@pytest.mark.parametrize("width, height, options, coded", [
    (64, 48, {}, (64, 48)),
    (160, 96, {}, (160, 96)),
    (100, 70, {}, (112, 80)),  # cropped on both axes
    (1920, 1080, {}, (1920, 1088)),  # 1080 lines coded as 68 macroblock rows, cropped by 8
    (1080, 1920, {}, (1088, 1920)),  # a portrait camera
    (320, 240, {"profile": "high", "x264-params": "cqm=jvt"}, (320, 240)),  # high profile, scaling lists
    (176, 144, {"x264-params": "interlaced=1"}, (176, 160)),  # frame_mbs_only_flag 0: map units of 32 rows
    (130, 66, {"preset": "medium"}, (144, 80)),  # high profile, 3 reference frames
])
def test_the_size_of_real_sps_from_libx264(width, height, options, coded):
    sps = B.parse_sps(sps_of(x264(width, height, 1, **options)[0]))
    assert (sps.width, sps.height) == (width, height)
    assert (sps.coded_width, sps.coded_height) == coded
    assert sps.checked_size == (width, height)
    assert B.inspect(x264(width, height, 1, **options)[0]).size == (width, height)


class BitWriter:
    def __init__(self) -> None:
        self.bits = ""

    def u(self, n: int, value: int) -> BitWriter:
        self.bits += format(value, f"0{n}b") if n else ""
        return self

    def ue(self, value: int) -> BitWriter:
        code = format(value + 1, "b")
        self.bits += "0" * (len(code) - 1) + code
        return self

    def nal(self, header: int) -> bytes:
        bits = self.bits + "1"  # rbsp_stop_one_bit, then zeros to a byte
        bits += "0" * (-len(bits) % 8)
        rbsp = int(bits, 2).to_bytes(len(bits) // 8, "big")
        out, zeros = bytearray([header]), 0
        for b in rbsp:
            if zeros >= 2 and b <= 3:
                out.append(3)
                zeros = 0
            out.append(b)
            zeros = zeros + 1 if b == 0 else 0
        return bytes(out)


def handmade_sps(mbs_wide: int, map_units: int, crop: tuple[int, int, int, int] | None = None) -> bytes:
    """A baseline SPS written field by field (ITU-T H.264 7.3.2.1.1)."""
    w = BitWriter().u(8, 66).u(8, 0xC0).u(8, 40).ue(0)  # profile, constraint flags, level 4.0, sps id 0
    w.ue(0).ue(2).ue(1).u(1, 0)  # log2_max_frame_num_minus4, poc type 2, 1 reference frame, no gaps
    w.ue(mbs_wide - 1).ue(map_units - 1).u(1, 1).u(1, 1)  # size, frame_mbs_only, direct_8x8_inference
    w.u(1, crop is not None)
    for c in crop or ():
        w.ue(c)
    return w.u(1, 0).nal(0x67)  # no VUI; nal_ref_idc 3, type 7


def test_a_handmade_8192x8192_sps_and_emulation_prevention_bytes():
    nal = handmade_sps(512, 512)
    sps = B.parse_sps(nal)
    assert (sps.width, sps.height, sps.coded_width, sps.coded_height) == (8192, 8192, 8192, 8192)
    assert B.inspect(b"\x00\x00\x00\x01" + nal).size == (8192, 8192)
    assert B.size_refusal(*sps.checked_size) is not None and "8192x8192" in B.size_refusal(*sps.checked_size)
    nal = handmade_sps(4096, 4096)  # ue(4095): runs of 24 zero bits, so the NAL unit holds 00 00 03
    assert b"\x00\x00\x03" in nal
    assert B.parse_sps(nal).checked_size == (65536, 65536)
    real = B.with_size(sps_of(x264(64, 48, 1)[0]), 8192, 8192)  # libx264's SPS declaring 8192x8192: escaped too
    assert b"\x00\x00\x03" in real and B.parse_sps(real).checked_size == (8192, 8192)


def test_cropping_counts_for_at_most_a_macroblock_so_a_huge_picture_cropped_small_is_refused():
    sps = B.parse_sps(handmade_sps(512, 512, crop=(0, 4088, 0, 4088)))  # 8192x8192 coded, shown as 16x16
    assert (sps.width, sps.height) == (16, 16)
    assert sps.checked_size == (8176, 8176) and B.size_refusal(*sps.checked_size) is not None
    sps = B.parse_sps(handmade_sps(120, 68, crop=(0, 0, 0, 4)))  # 1920x1088 cropped to 1080: within the cap
    assert sps.checked_size == (1920, 1080) and B.size_refusal(1920, 1080) is None


def test_with_size_makes_a_real_sps_declare_another_size_and_a_decoder_believes_it():
    idr = x264(64, 48, 1)[0]
    sps = sps_of(idr)
    for width, height in ((8192, 8192), (1920, 1080), (8192, 4096)):
        parsed = B.parse_sps(B.with_size(sps, width, height))
        assert (parsed.width, parsed.height) == (width, height)
    bomb = idr.replace(sps, B.with_size(sps, 512, 384))  # small enough to decode here
    frames = av.CodecContext.create("h264", "r").decode(av.Packet(bomb))
    assert [(f.width, f.height) for f in frames] == [(512, 384)]  # the decoder allocates what the SPS declares


@pytest.mark.parametrize("nal, why", [
    (b"\x67\x42", "not an SPS"),
    (b"\x68\x42\xc0\x28\xff", "not an SPS"),  # a PPS
    (BitWriter().u(8, 66).u(16, 0).nal(0x67), "ends"),  # cut after the level
    (BitWriter().u(8, 66).u(16, 0).ue(32).nal(0x67), "seq_parameter_set_id=32"),
    (BitWriter().u(8, 66).u(16, 0).u(40, 0).nal(0x67), "exp-Golomb"),  # 40 zero bits: no code ends
])
def test_a_broken_sps_is_an_error_not_a_size(nal, why):
    with pytest.raises(B.BitstreamError, match=why):
        B.parse_sps(nal)
    info = B.inspect(b"\x00\x00\x00\x01" + nal + b"\x00\x00\x01\x65\x88")
    assert info.size is None and (info.error is not None) == (nal[0] & 0x1F == B.NAL_SPS)


def test_the_cap_is_1920x1080_pixels_and_1920_a_side():
    assert B.size_refusal(1920, 1080) is None and B.size_refusal(1080, 1920) is None
    assert B.size_refusal(1440, 1440) is None  # 2073600 pixels: the cap exactly
    assert B.size_refusal(1440, 1441) is not None
    assert B.size_refusal(1921, 100) is not None and B.size_refusal(16, 4096) is not None
    assert "1920x1080" in B.size_refusal(8192, 8192)


def test_inspect_reads_key_frames_references_and_vp8():
    idr, p = x264(64, 48, 2)[:2]
    assert B.inspect(idr) == B.FrameInfo((64, 48), True, True)
    assert B.inspect(p) == B.FrameInfo(None, False, True)
    units = B.nal_units(p)
    unreferenced = b"".join(b"\x00\x00\x00\x01" + bytes([u[0] & 0x9F]) + u[1:] for u in units)  # nal_ref_idc 0
    assert B.inspect(unreferenced) == B.FrameInfo(None, False, False)
    # a VP8 key frame: frame tag (bit 0 clear), start code, 14-bit width and height (RFC 6386 9.1)
    key = bytes([0x10, 0x02, 0x00]) + b"\x9d\x01\x2a" + (8192).to_bytes(2, "little") + (4096 | 0x4000).to_bytes(
        2, "little") + bytes(20)
    assert B.inspect(key) == B.FrameInfo((8192, 4096), True, True)
    assert B.inspect(bytes([0x31, 0x02, 0x00]) + bytes(20)) == B.FrameInfo(None, False, True)  # VP8 inter frame
    flood = b"\x00\x00\x01\x09" * (B.MAX_NAL_UNITS + 1)  # more NAL units than any frame has: bad, not read on
    assert B.inspect(flood).error is not None
