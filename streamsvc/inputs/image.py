"""A start image on the server: its bytes checked and decoded into one frame at the model's size (the carrier and the
caps: streamsvc/wire/image.py).

`decode_image` does it all, in this order, each step refusing with an `ImageError` that says why:
- the type by the bytes (PNG, JPEG, WebP: `image.image_type`), and where the bytes came with one, that it agrees;
- the size the file's header declares, read here from the bytes (PNG's IHDR, JPEG's SOFn, WebP's VP8/VP8L/VP8X
  header) and checked against the pixel cap before any decoder sees the file: a decompression bomb (a small file that
  declares 50000x50000) costs a few dozen bytes read;
- the decode, by PyAV (FFmpeg's png, mjpeg and webp decoders, already the server's H.264 decoder's library), with
  FFmpeg's own ``max_pixels`` set to the cap as well, so a header this reader got wrong still cannot allocate more;
- the fit: scaled to cover the model's frame and centre-cropped (sws_scale's area filter), an alpha channel composited
  over white; an image of the frame's size is only converted to RGB.

`decode_start_image` takes what ``start`` carries (a data URL, through `image.parse_data_url`); uploads are decoded at
their POST (streamsvc/door/images.py). Both run in `DECODERS`, off the event loop (PyAV releases the GIL).
"""

from __future__ import annotations

import struct
from concurrent.futures import ThreadPoolExecutor

import av
import numpy as np

from streamsvc.wire.image import MAX_IMAGE_PIXELS, MAX_IMAGE_SIDE, ImageError, image_type, parse_data_url

DECODERS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="image-decode")
"""Where start images are decoded: two at a time at most, whatever comes (each holds at most the cap's pixels)."""
_CODECS = {"image/png": "png", "image/jpeg": "mjpeg", "image/webp": "webp"}
_JPEG_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}  # start-of-frame markers (not DHT, JPG, DAC)


def declared_size(data: bytes, mime: str) -> tuple[int, int]:
    """(width, height) that an image file's header declares, read from its bytes. ImageError when the header is cut
    short or declares none."""
    short = ImageError(f"the {mime.split('/')[1].upper()} image's header is cut short or malformed: not an image file")
    if mime == "image/png":
        if len(data) < 24 or data[12:16] != b"IHDR":
            raise short
        return struct.unpack(">II", data[16:24])
    if mime == "image/jpeg":
        return _jpeg_size(data, short)
    if len(data) < 30:  # WebP: RIFF, size, WEBP, then its first chunk
        raise short
    kind = data[12:16]
    if kind == b"VP8 " and data[23:26] == b"\x9d\x01\x2a":
        w, h = struct.unpack("<HH", data[26:30])
        return w & 0x3FFF, h & 0x3FFF
    if kind == b"VP8L" and data[20] == 0x2F:
        bits = int.from_bytes(data[21:25], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if kind == b"VP8X":
        return int.from_bytes(data[24:27], "little") + 1, int.from_bytes(data[27:30], "little") + 1
    raise short


def _jpeg_size(data: bytes, short: ImageError) -> tuple[int, int]:
    """A JPEG's frame size, from the first start-of-frame segment (the segments before it skipped by their length)."""
    i = 2
    while i + 4 <= len(data):
        if data[i] != 0xFF:
            raise short
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in (0x01, *range(0xD0, 0xD8)):  # TEM, RSTn: no length
            i += 2
            continue
        if marker in (0xD9, 0xDA):  # EOI, or SOS before any frame header
            raise short
        length = struct.unpack(">H", data[i + 2 : i + 4])[0]
        if marker in _JPEG_SOF:
            if length < 7 or i + 9 > len(data):
                raise short
            h, w = struct.unpack(">HH", data[i + 5 : i + 9])
            return w, h
        i += 2 + length
    raise short


def check_size(width: int, height: int, max_pixels: int = MAX_IMAGE_PIXELS) -> None:
    """ImageError for a declared size that is empty or over the caps."""
    if width < 1 or height < 1:
        raise ImageError(f"the image declares {width}x{height} pixels: it has none")
    if width * height > max_pixels or max(width, height) > MAX_IMAGE_SIDE:
        raise ImageError(f"the image declares {width}x{height} pixels ({width * height / 1e6:.1f} megapixels); this "
                         f"server decodes at most {max_pixels / 1e6:.1f} megapixels and {MAX_IMAGE_SIDE} pixels a "
                         "side: scale it down (the stream's frame is far smaller)")


def decode_image(data: bytes, width: int, height: int, mime: str | None = None,
                 max_pixels: int = MAX_IMAGE_PIXELS) -> np.ndarray:
    """An image file as the model's frame: [height, width, 3] uint8 RGB (see the module docstring). `mime`: the type
    it came labelled with (a data URL's, an upload's Content-Type), which its bytes must agree with. ImageError with
    the reason when it cannot."""
    kind = image_type(data)
    if mime is not None and mime != kind:
        raise ImageError(f"the image was sent as {mime} but its bytes are {kind}")
    w, h = declared_size(data, kind)
    check_size(w, h, max_pixels)
    ctx = av.CodecContext.create(_CODECS[kind], "r")
    ctx.options = {"max_pixels": str(max_pixels)}  # FFmpeg's own cap on what it allocates (a second guard)
    ctx.thread_count = 1
    try:
        frames = list(ctx.decode(av.Packet(bytes(data))))
        if not frames:
            frames = list(ctx.decode(None))
    except (av.FFmpegError, ValueError) as e:
        raise ImageError(f"the {kind.split('/')[1].upper()} image does not decode (corrupt, cut short, or a kind "
                         f"FFmpeg cannot read, such as an animated WebP): {e}") from None
    if not frames:
        raise ImageError(f"the {kind.split('/')[1].upper()} image decodes to no picture (cut short?)")
    frame = frames[0]
    check_size(frame.width, frame.height, max_pixels)
    return fit(frame, width, height)


def fit(frame: av.VideoFrame, width: int, height: int) -> np.ndarray:
    """`frame` scaled to cover width x height and centre-cropped to it, as [height, width, 3] uint8 RGB; transparent
    pixels over white."""
    scale = max(width / frame.width, height / frame.height)
    sw, sh = max(width, round(frame.width * scale)), max(height, round(frame.height * scale))
    fmt = frame.format
    alpha = fmt.has_palette or any(c.is_alpha for c in fmt.components)
    out = frame.reformat(width=sw, height=sh, format="rgba" if alpha else "rgb24",
                         interpolation="AREA" if scale < 1 else "BICUBIC").to_ndarray()
    x0, y0 = (sw - width) // 2, (sh - height) // 2
    out = out[y0 : y0 + height, x0 : x0 + width]
    if alpha:
        a = out[..., 3:4].astype(np.float32) / 255.0
        out = np.rint(out[..., :3] * a + 255.0 * (1.0 - a)).astype(np.uint8)
    return np.ascontiguousarray(out)


def decode_start_image(image: str, width: int, height: int) -> np.ndarray:
    """A ``start``'s inline image (a data URL) as the model's frame. ImageError with the reason when it cannot."""
    data = parse_data_url(image)
    return decode_image(data, width, height)
