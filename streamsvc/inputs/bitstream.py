"""What an encoded input frame declares before any decoder sees it, and the pixel cap every input decoder checks
(issue 41): a decoder allocates its pictures at the size the stream declares, so the size is read first.

A pure module: it imports nothing of ours, and PyAV not at all (PyAV has no SPS parser: FFmpeg keeps its own
internal). Every input path checks the cap here: the WebSocket's H.264 (streamsvc/inputs/ws.py), a WebRTC camera's
and a WHIP publisher's H.264 or VP8 (streamsvc/inputs/rtc.py, before aiortc's decoder), the offline file
(streamsvc/inputs/offline.py, its container's size), and the first decoded frame's size after all of them.

The cap: at most `MAX_PIXELS` (1920 x 1080) pixels a frame, and at most `MAX_SIDE` (1920) on either side (a portrait
1080 x 1920 camera passes; a 16 x 129600 frame does not). The largest model takes 832 x 480.

H.264 (ITU-T H.264 (08/2021)): an access unit is Annex-B (NAL units after 00 00 01 or 00 00 00 01 start codes). Its
sequence parameter set (SPS, NAL unit type 7, section 7.3.2.1.1) gives the picture's size in macroblocks
(pic_width_in_mbs_minus1, pic_height_in_map_units_minus1, frame_mbs_only_flag) and its cropping; `parse_sps` reads
it (exp-Golomb codes, with the emulation-prevention bytes removed first, section 7.4.1). What is checked is the
size after cropping, but cropping counts for at most one macroblock on each axis (what an encoder needs to round a
size to whole macroblocks: 1080 lines are coded as 1088): a decoder allocates the coded size, so an SPS of 8192 x
8192 cropped to 16 x 16 is refused as 8176 x 8176. An IDR slice (type 5) or a recovery-point SEI (type 6, payload 6:
x264's intra refresh) starts a group of pictures; a slice with nal_ref_idc 0 is no other frame's reference.

VP8 (RFC 6386 section 9.1): a key frame's first bytes are a frame tag (bit 0 clear), the start code 9d 01 2a, and
its width and height (14 bits each, little-endian; the 2 bits above are a display scale, not the decoded size).
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_SIDE = 1920
"""The longest side, in pixels, of any input frame this server decodes."""
MAX_PIXELS = 1920 * 1080
"""The most pixels an input frame may have (a 1080p camera's)."""

NAL_SLICE, NAL_IDR, NAL_SEI, NAL_SPS = 1, 5, 6, 7
_SEI_RECOVERY_POINT = 6
_HIGH_PROFILES = frozenset({100, 110, 122, 244, 44, 83, 86, 118, 128, 138, 139, 134, 135})  # chroma_format_idc etc.
_VP8_START = b"\x9d\x01\x2a"
MAX_SPS_BYTES = 4096  # of an SPS NAL unit, what is read: its size fields come well before (scaling lists: < 2 KB)
MAX_NAL_UNITS = 1024  # an access unit of more is bad input, not read further (a 1080p frame has tens of slices)


def size_refusal(width: int, height: int, what: str = "a frame") -> str | None:
    """Why a `width` x `height` picture is over the cap (the text a client reads); None when it is within."""
    if width <= MAX_SIDE and height <= MAX_SIDE and width * height <= MAX_PIXELS:
        return None
    return (f"{what} of {width}x{height}: this server decodes input of at most {MAX_PIXELS} pixels a frame "
            f"(1920x1080) and {MAX_SIDE} a side")


# ---------------------------------------------------------------- H.264


class BitstreamError(ValueError):
    """An SPS (or VP8 header) that ends early or holds a value out of its range."""


@dataclass(frozen=True)
class Sps:
    """The size fields of one H.264 sequence parameter set."""

    profile_idc: int
    sps_id: int  # seq_parameter_set_id
    coded_width: int  # pixels: whole macroblocks, before cropping (what a decoder allocates)
    coded_height: int
    width: int  # after the cropping window (what the picture shows)
    height: int
    frame_mbs_only: bool  # False: interlaced (a map unit is two macroblock rows)
    max_num_ref_frames: int

    @property
    def checked_size(self) -> tuple[int, int]:
        """The size the cap is checked on: the cropped size, with cropping counted for at most one macroblock
        (two rows of one when interlaced) on each axis (the module docstring)."""
        rows = 16 * (2 - self.frame_mbs_only)
        return max(self.width, self.coded_width - 16), max(self.height, self.coded_height - rows)


def unescape(nal: bytes) -> bytes:
    """A NAL unit's RBSP: every 00 00 03 loses its 03 (the emulation-prevention byte, section 7.4.1)."""
    if b"\x00\x00\x03" not in nal:
        return nal
    out, i = bytearray(), 0
    while True:
        j = nal.find(b"\x00\x00\x03", i)
        if j < 0:
            out += nal[i:]
            return bytes(out)
        out += nal[i : j + 2]
        i = j + 3


class _Bits:
    """An RBSP read bit by bit, MSB first: u(n), ue(v), se(v) (section 9.1)."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0  # bits read
        self.size = 8 * len(data)

    def u(self, n: int) -> int:
        end = self.pos + n
        if end > self.size:
            raise BitstreamError(f"the SPS ends {end - self.size} bits early")
        first, last = self.pos >> 3, (end + 7) >> 3
        self.pos = end
        return (int.from_bytes(self.data[first:last], "big") >> (8 * last - end)) & ((1 << n) - 1)

    def ue(self) -> int:
        zeros = 0
        while self.u(1) == 0:
            zeros += 1
            if zeros > 31:
                raise BitstreamError("an exp-Golomb code of more than 32 bits")
        return (1 << zeros) - 1 + self.u(zeros)

    def se(self) -> int:
        k = self.ue()
        return (k + 1) // 2 if k % 2 else -(k // 2)


def _ue(bits: _Bits, name: str, most: int) -> int:
    value = bits.ue()
    if value > most:
        raise BitstreamError(f"{name}={value}: at most {most}")
    return value


def _skip_scaling_list(bits: _Bits, size: int) -> None:
    last = nxt = 8
    for _ in range(size):
        if nxt != 0:
            delta = bits.se()
            if not -128 <= delta <= 127:
                raise BitstreamError(f"delta_scale={delta}: out of [-128, 127]")
            nxt = (last + delta + 256) % 256
        last = last if nxt == 0 else nxt


def parse_sps(nal: bytes) -> Sps:
    """The size fields of an SPS NAL unit (its one-byte header first, emulation-prevention bytes still in).
    Raises `BitstreamError` when it is not an SPS, ends early or holds a value out of its range."""
    return _parse_sps(nal)[0]


@dataclass(frozen=True)
class _SizeBits:
    """Where an SPS's size fields lie in its RBSP (for `with_size`)."""

    rbsp: bytes
    size_at: int  # the bit pic_width_in_mbs_minus1 starts at
    direct_at: int  # the bit of direct_8x8_inference_flag
    end_at: int  # the bit after the cropping fields (vui_parameters_present_flag)
    crop_unit: tuple[int, int]  # (CropUnitX, CropUnitY) of a progressive picture of this SPS's chroma format


def _parse_sps(nal: bytes) -> tuple[Sps, _SizeBits]:
    if len(nal) < 4 or nal[0] & 0x1F != NAL_SPS:
        raise BitstreamError("not an SPS NAL unit")
    rbsp = unescape(nal[1:MAX_SPS_BYTES])
    bits = _Bits(rbsp)
    profile = bits.u(8)
    bits.u(16)  # constraint_set flags, reserved bits, level_idc
    sps_id = _ue(bits, "seq_parameter_set_id", 31)
    chroma, separate = 1, False
    if profile in _HIGH_PROFILES:
        chroma = _ue(bits, "chroma_format_idc", 3)
        if chroma == 3:
            separate = bool(bits.u(1))
        _ue(bits, "bit_depth_luma_minus8", 6)
        _ue(bits, "bit_depth_chroma_minus8", 6)
        bits.u(1)  # qpprime_y_zero_transform_bypass_flag
        if bits.u(1):  # seq_scaling_matrix_present_flag
            for i in range(8 if chroma != 3 else 12):
                if bits.u(1):
                    _skip_scaling_list(bits, 16 if i < 6 else 64)
    _ue(bits, "log2_max_frame_num_minus4", 12)
    poc_type = _ue(bits, "pic_order_cnt_type", 2)
    if poc_type == 0:
        _ue(bits, "log2_max_pic_order_cnt_lsb_minus4", 12)
    elif poc_type == 1:
        bits.u(1)  # delta_pic_order_always_zero_flag
        bits.se()  # offset_for_non_ref_pic
        bits.se()  # offset_for_top_to_bottom_field
        for _ in range(_ue(bits, "num_ref_frames_in_pic_order_cnt_cycle", 255)):
            bits.se()
    refs = _ue(bits, "max_num_ref_frames", 16)
    bits.u(1)  # gaps_in_frame_num_value_allowed_flag
    size_at = bits.pos
    mbs_wide = _ue(bits, "pic_width_in_mbs_minus1", 2**16) + 1
    map_units = _ue(bits, "pic_height_in_map_units_minus1", 2**16) + 1
    frame_mbs_only = bool(bits.u(1))
    if not frame_mbs_only:
        bits.u(1)  # mb_adaptive_frame_field_flag
    direct_at = bits.pos
    bits.u(1)  # direct_8x8_inference_flag
    coded_w, coded_h = 16 * mbs_wide, 16 * map_units * (2 - frame_mbs_only)
    left = right = top = bottom = 0
    if bits.u(1):  # frame_cropping_flag
        left, right, top, bottom = (bits.ue() for _ in range(4))
    array_type = 0 if separate else chroma  # ChromaArrayType
    unit_x = 1 if array_type in (0, 3) else 2  # SubWidthC (1 for ChromaArrayType 0)
    unit_y = 2 if array_type == 1 else 1  # SubHeightC; CropUnitY is that times (2 - frame_mbs_only_flag)
    width, height = coded_w - unit_x * (left + right), coded_h - unit_y * (2 - frame_mbs_only) * (top + bottom)
    if width < 1 or height < 1:
        raise BitstreamError(f"a cropping window larger than the {coded_w}x{coded_h} picture")
    sps = Sps(profile, sps_id, coded_w, coded_h, width, height, frame_mbs_only, refs)
    return sps, _SizeBits(rbsp, size_at, direct_at, bits.pos, (unit_x, unit_y))


def with_size(nal: bytes, width: int, height: int) -> bytes:
    """`nal` (an SPS NAL unit) declaring a progressive `width` x `height` picture instead, every other field kept:
    whole macroblocks, cropped to the size (in the chroma format's crop units, so rounded up to them). For tests
    and benchmarks/hostile: a real encoder's SPS that declares any size (a slice of the real size then decodes
    into a picture of the declared one)."""
    _, at = _parse_sps(nal)
    bits = "".join(f"{b:08b}" for b in at.rbsp)
    bits = bits[: bits.rindex("1")]  # without the rbsp_trailing_bits (a stop bit, zeros to a byte)
    ux, uy = at.crop_unit
    w, h = -(-width // ux) * ux, -(-height // uy) * uy
    mbs_w, mbs_h = -(-w // 16), -(-h // 16)
    crop_r, crop_b = (16 * mbs_w - w) // ux, (16 * mbs_h - h) // uy
    crop = "1" + _ue_bits(0) + _ue_bits(crop_r) + _ue_bits(0) + _ue_bits(crop_b) if crop_r or crop_b else "0"
    new = (bits[: at.size_at] + _ue_bits(mbs_w - 1) + _ue_bits(mbs_h - 1) + "1" + bits[at.direct_at] + crop
           + bits[at.end_at :] + "1")
    new += "0" * (-len(new) % 8)
    rbsp = int(new, 2).to_bytes(len(new) // 8, "big")
    out, zeros = bytearray(nal[:1]), 0
    for b in rbsp:  # emulation prevention: no 00 00 0x (x <= 3) in the NAL unit
        if zeros >= 2 and b <= 3:
            out.append(3)
            zeros = 0
        out.append(b)
        zeros = zeros + 1 if b == 0 else 0
    return bytes(out)


def _ue_bits(value: int) -> str:
    code = f"{value + 1:b}"
    return "0" * (len(code) - 1) + code


def nal_units(access_unit: bytes, limit: int = MAX_NAL_UNITS) -> list[bytes]:
    """The NAL units of an Annex-B access unit, without their start codes (trailing zero bytes kept); at most
    `limit` of them (`BitstreamError` beyond)."""
    return [access_unit[start:end] for start, end in _spans(access_unit, limit)]


def _spans(access_unit: bytes, limit: int) -> list[tuple[int, int]]:
    spans, i = [], access_unit.find(b"\x00\x00\x01")
    while i >= 0:
        start = i + 3
        i = access_unit.find(b"\x00\x00\x01", start)
        end = len(access_unit) if i < 0 else i
        if end > start:
            if len(spans) == limit:
                raise BitstreamError(f"an access unit of more than {limit} NAL units")
            spans.append((start, end))
    return spans


def _recovery_point(sei: bytes) -> bool:
    """Whether an SEI NAL unit's first message is a recovery point (payloadType 6, section 7.3.2.3.1)."""
    kind, i = 0, 1
    while i < len(sei) and sei[i] == 0xFF:
        kind, i = kind + 255, i + 1
    return i < len(sei) and kind + sei[i] == _SEI_RECOVERY_POINT


# ---------------------------------------------------------------- any frame


@dataclass(frozen=True)
class FrameInfo:
    """What one encoded frame declares (`inspect`)."""

    size: tuple[int, int] | None  # (width, height) the cap is checked on, when it declares one (an SPS, a VP8 key)
    keyframe: bool  # a decoder can start here: an H.264 IDR or recovery point, a VP8 key frame
    reference: bool  # later frames may depend on it (False: an H.264 frame whose slices all have nal_ref_idc 0)
    error: str | None = None  # a size header that could not be read, too many NAL units: bad input, not decoded


def inspect(frame: bytes) -> FrameInfo:
    """What an encoded frame (an H.264 Annex-B access unit, or a VP8 frame) declares, read without decoding it.
    Every SPS in an access unit counts: the largest one is its size. Data that is neither (no start code at its
    start) declares nothing: not a key frame, a reference."""
    if len(frame) >= 10 and frame[3:6] == _VP8_START and not frame[0] & 1:  # no Annex-B unit starts so (0x9d: F=1)
        width, height = int.from_bytes(frame[6:8], "little") & 0x3FFF, int.from_bytes(frame[8:10], "little") & 0x3FFF
        return FrameInfo((width, height), True, True)
    if not frame.startswith((b"\x00\x00\x01", b"\x00\x00\x00\x01")):
        return FrameInfo(None, False, True)  # a VP8 inter frame, or garbage the decoder will refuse
    try:
        spans = _spans(frame, MAX_NAL_UNITS)
    except BitstreamError as e:
        return FrameInfo(None, False, True, str(e))
    size, keyframe, reference, slices, error = None, False, False, 0, None
    for start, end in spans:
        kind, ref_idc = frame[start] & 0x1F, frame[start] >> 5 & 3
        if kind == NAL_SPS:
            try:
                w, h = parse_sps(frame[start : min(end, start + MAX_SPS_BYTES)]).checked_size
            except BitstreamError as e:
                error = f"an SPS that cannot be read: {e}"
                continue
            if size is None or size_refusal(*size) is None:  # the first one over the cap is the one named
                size = (w, h)
        elif kind in (NAL_SLICE, NAL_IDR):
            slices += 1
            keyframe |= kind == NAL_IDR
            reference |= ref_idc != 0
        elif kind == NAL_SEI:
            keyframe |= _recovery_point(unescape(frame[start : min(end, start + 64)]))
    return FrameInfo(size, keyframe, reference or not slices, error)
