"""A start image's carriers and checks: the data URL (streamsvc/wire/image.py), the decode and its caps
(streamsvc/inputs/image.py), the uploads (streamsvc/door/images.py). The images are drawn and encoded here (PyAV)."""

from __future__ import annotations

import asyncio
import base64
import fractions
import json
import struct
import zlib

import av
import numpy as np
import pytest

from streamsvc.door.access import AccessConfig
from streamsvc.door.images import ImageUploads
from streamsvc.door.routes import HttpRequest
from streamsvc.inputs import image as decode
from streamsvc.wire import image as I
from streamsvc.wire import protocol as P


def drawn(width=128, height=128, centre=(40, 80), half=14, fg=(20, 170, 160), bg=(235, 215, 175)) -> np.ndarray:
    """[H, W, 3] uint8: a teal square on beige (no palette colour of models/scenes.py), off-centre."""
    img = np.empty((height, width, 3), np.uint8)
    img[:] = bg
    x, y = centre
    img[y - half : y + half, x - half : x + half] = fg
    return img


def encode(img: np.ndarray, codec: str = "png", pix: str = "rgb24", **options) -> bytes:
    """An image file of `img` ([H, W, 3] or [H, W, 4] uint8) made by PyAV: png, mjpeg (yuvj420p), libwebp."""
    ctx = av.CodecContext.create(codec, "w")
    ctx.width, ctx.height, ctx.pix_fmt, ctx.time_base = img.shape[1], img.shape[0], pix, fractions.Fraction(1, 1)
    ctx.options = options
    src = "rgba" if img.shape[2] == 4 else "rgb24"
    frame = av.VideoFrame.from_ndarray(img, format=src).reformat(format=pix)
    return b"".join(bytes(p) for p in [*ctx.encode(frame), *ctx.encode(None)])


def png_claiming(width: int, height: int) -> bytes:
    """A decompression bomb: a valid PNG of a few dozen bytes whose header claims width x height."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255**2 / mse)


# ----- the data URL ---------------------------------------------------------------------------------------------


def test_a_data_url_round_trips_and_its_faults_are_named():
    png = encode(drawn())
    url = I.data_url(png)
    assert url.startswith("data:image/png;base64,") and I.is_data_url(url) and not I.is_data_url("AbC")
    assert I.parse_data_url(url) == png
    b64 = base64.b64encode(png).decode()
    cases = {
        "https://example.com/a.png": "not a data: URL",
        f"data:text/plain;base64,{b64}": "media type is 'text/plain'",
        f"data:image/png,{b64}": "not base64",
        "data:image/png;base64,iVBOR***": "base64 does not decode",
        "data:image/png;base64,": "carries no bytes",
        f"data:image/jpeg;base64,{b64}": "says image/jpeg but its bytes are image/png",
        "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n" + bytes(I.MAX_INLINE_IMAGE_BYTES)).decode():
            f"over {I.MAX_INLINE_IMAGE_BYTES} bytes, the most a start carries inline: upload it",
    }
    for bad, why in cases.items():
        with pytest.raises(I.ImageError, match=why.replace("*", r"\*")):
            I.parse_data_url(bad)
    with pytest.raises(I.ImageError, match="not a PNG, JPEG or WebP"):
        I.data_url(b"GIF89a...")


def test_start_takes_an_image_but_not_with_input_video():
    url = I.data_url(encode(drawn()))
    assert P.parse_client(json.dumps({"type": "start", "prompt": "a ball", "image": url})).image == url
    with pytest.raises(P.ProtocolError, match="starts from an image or restyles input video, not both"):
        P.parse_client(json.dumps({"type": "start", "prompt": "a ball", "image": url, "input": True}))
    ready = P.parse_server(json.dumps({"type": "ready", "stream_id": "s0", "fps": 16, "width": 128, "height": 128,
                                       "first_chunk_frames": 1, "chunk_frames": 12, "prompt_version": 0, "steps": 4,
                                       "image": True}))
    assert ready.image is True
    head = P.Chunk.describe([b"\0\0\0\1"], index=0, pts=0, prompt_version=0, steps=4, keyframe=True, input="image")
    assert P.parse_server(P.encode(head)).input == "image"


# ----- the decode -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("codec", "pix", "db"), [("png", "rgb24", 99.0), ("mjpeg", "yuvj420p", 30.0),
                                                  ("libwebp", "yuv420p", 30.0)])
def test_each_type_decodes_to_the_frame_and_its_header_tells_its_size(codec, pix, db):
    img = drawn(160, 96)
    data = encode(img, codec, pix)
    assert decode.declared_size(data, I.sniff(data)) == (160, 96)
    same = decode.decode_image(data, 160, 96)
    assert same.shape == (96, 160, 3) and same.dtype == np.uint8 and psnr(same, img) >= db


def test_webp_lossless_and_extended_headers_tell_their_size():
    img = drawn(100, 60)
    lossless = encode(img, "libwebp", "bgra", lossless="1")
    assert lossless[12:16] == b"VP8L" and decode.declared_size(lossless, "image/webp") == (100, 60)
    extended = lossless[:12] + b"VP8X" + struct.pack("<I", 10) + bytes(4) + (99).to_bytes(3, "little") + \
        (59).to_bytes(3, "little")
    assert decode.declared_size(extended, "image/webp") == (100, 60)
    assert psnr(decode.decode_image(lossless, 100, 60), img) == float("inf")


def test_an_image_covers_the_frame_centre_cropped_and_transparency_is_white():
    wide = np.zeros((64, 256, 3), np.uint8)
    wide[:, :128] = (255, 0, 0)
    wide[:, 128:] = (0, 0, 255)
    wide[:, :64] = wide[:, 192:] = (0, 255, 0)  # the sides a square crop cuts off
    out = decode.decode_image(encode(wide), 128, 128)  # scaled x2 to 512x128, the middle 128 columns kept
    assert out.shape == (128, 128, 3)
    assert (out[:, :60] == (255, 0, 0)).all() and (out[:, 68:] == (0, 0, 255)).all()
    rgba = np.zeros((32, 32, 4), np.uint8)
    rgba[..., :3], rgba[:16, :, 3] = 40, 255  # the top half opaque dark grey, the bottom transparent
    out = decode.decode_image(encode(rgba, "png", "rgba"), 32, 32)
    assert (out[:14] == 40).all() and (out[18:] == 255).all()


def test_a_decompression_bomb_is_refused_from_its_header_before_any_decoder(monkeypatch):
    def no_decoder(*args, **kwargs):
        raise AssertionError("a decoder was made for an image the header check should have refused")

    monkeypatch.setattr(decode.av.CodecContext, "create", no_decoder)
    bomb = png_claiming(50000, 50000)
    assert len(bomb) < 100
    with pytest.raises(I.ImageError, match=r"declares 50000x50000 pixels \(2500.0 megapixels\); this server decodes "
                                           r"at most 16.8 megapixels"):
        decode.decode_image(bomb, 128, 128)
    with pytest.raises(I.ImageError, match="16384 pixels a side"):
        decode.decode_image(png_claiming(20000, 10), 128, 128)
    with pytest.raises(I.ImageError, match="0x10 pixels: it has none"):
        decode.decode_image(png_claiming(0, 10), 128, 128)


def test_ffmpeg_holds_the_same_cap_as_a_second_guard():
    """A cap below what the header declares: refused by the header check, and FFmpeg's max_pixels (set to the same
    cap) refuses it too when asked directly."""
    data = encode(drawn())
    with pytest.raises(I.ImageError, match="declares 128x128 pixels"):
        decode.decode_image(data, 64, 64, max_pixels=100)
    ctx = av.CodecContext.create("png", "r")
    ctx.options = {"max_pixels": "100"}
    with pytest.raises(av.FFmpegError):
        ctx.decode(av.Packet(data))


def test_wrong_types_corrupt_and_cut_short_images_are_refused_with_the_reason():
    png, jpg = encode(drawn()), encode(drawn(), "mjpeg", "yuvj420p")
    cases = {
        b"GIF89a" + bytes(40): "not a PNG, JPEG or WebP image",
        png[:20]: "PNG image's header is cut short",
        png[:60]: "PNG image does not decode",
        png[:40] + bytes(len(png) - 40): "PNG image does not decode",
        jpg[:2] + b"\xff\xda" + bytes(20): "JPEG image's header is cut short",
        b"RIFF\0\0\0\0WEBPVP8Z" + bytes(20): "WEBP image's header is cut short",
    }
    for data, why in cases.items():
        with pytest.raises(I.ImageError, match=why):
            decode.decode_image(data, 128, 128)
    with pytest.raises(I.ImageError, match="sent as image/jpeg but its bytes are image/png"):
        decode.decode_image(png, 128, 128, mime="image/jpeg")


# ----- uploads --------------------------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def uploads(clock=None, size=(128, 128), **kw) -> ImageUploads:
    return ImageUploads(AccessConfig(), lambda: size, lambda request: None, clock or Clock(), **kw)


def post(body: bytes, ctype: str = "image/png", remote: str = "10.0.0.1", method: str = "POST") -> HttpRequest:
    return HttpRequest(method, I.UPLOAD_PATH, {"Content-Type": ctype}, remote, body)


def answer(up: ImageUploads, request: HttpRequest):
    got = asyncio.run(up.handle(request))
    return int(got.status), got.body


def test_an_upload_is_decoded_once_kept_until_it_expires_and_named_by_its_id():
    clock = Clock()
    up = uploads(clock, ttl_s=60.0)
    img = drawn(256, 256)
    status, body = answer(up, post(encode(img, "mjpeg", "yuvj420p"), "image/jpeg"))
    assert status == 201
    got = json.loads(body)
    assert (got["width"], got["height"], got["expires_s"]) == (128, 128, 60.0) and I.UPLOAD_ID.match(got["image"])
    frame = up.frame(got["image"])
    assert frame.shape == (128, 128, 3) and psnr(frame, decode.fit(av.VideoFrame.from_ndarray(img), 128, 128)) > 30
    assert asyncio.run(up.resolve(got["image"])).shape == (128, 128, 3)  # a start naming it
    assert up.frame(got["image"]) is not None  # not used up
    clock.now += 61
    assert up.frame(got["image"]) is None and up.table_sizes() == {"images.uploads": 0}
    with pytest.raises(I.ImageError, match="no upload .* here: uploads are kept 60 s"):
        asyncio.run(up.resolve(got["image"]))


def test_uploads_are_bounded_per_address_and_in_all():
    up = uploads(max_uploads=5, per_client=2)
    png = encode(drawn())
    ids = [json.loads(answer(up, post(png))[1])["image"] for _ in range(3)]
    assert up.frame(ids[0]) is None and all(up.frame(i) is not None for i in ids[1:])  # its oldest replaced
    for n in range(3):
        assert answer(up, post(png, remote=f"10.0.1.{n}"))[0] == 201
    status, body = answer(up, post(png, remote="10.0.2.1"))
    assert status == 503 and b"holds 5 uploads" in body
    assert answer(up, post(png))[0] == 201  # an address at its cap replaces its own oldest, full or not


def test_upload_refusals_say_why():
    up = uploads()
    cases = [
        (post(png_claiming(50000, 50000)), 400, b"bad image: the image declares 50000x50000 pixels"),
        (post(b"\x89PNG\r\n\x1a\n" + bytes(30)), 400, b"bad image: the PNG image's header is cut short"),
        (post(b"hello", "text/plain"), 415, b"an upload is an image file"),
        (post(b""), 400, b"no body"),
        (post(encode(drawn()), method="GET"), 405, b"POST an image file"),
    ]
    for request, status, text in cases:
        got = answer(up, request)
        assert got[0] == status and text in got[1], got
    assert answer(uploads(size=None), post(encode(drawn())))[0] == 503  # the model not ready
    assert ImageUploads.body_limits() == {I.UPLOAD_PATH: I.MAX_IMAGE_BYTES}
    for bad, why in {"AAAA": "not a data: URL .* nor an upload's id", "x" * 22: "no upload xxxxxx... here"}.items():
        with pytest.raises(I.ImageError, match=why):
            asyncio.run(up.resolve(bad))


# ----- the engine's side ----------------------------------------------------------------------------------------


def test_the_warm_up_times_an_image_start_and_one_that_fails_refuses_images_after(monkeypatch):
    from streamsvc.engine.images import NO_ENCODER, PARALLEL, StartImages
    from tests.conftest import tiny_generator

    gen = tiny_generator()
    images = StartImages(gen)
    images.warm_up(gen)
    assert images.refusal is None and images.start_s > 0
    assert StartImages(gen, parallel=True).refusal == PARALLEL and StartImages(None).refusal == NO_ENCODER

    def broken(state, image):
        raise RuntimeError("no graph for one latent frame")

    monkeypatch.setattr(gen, "start_from_image", broken)
    images = StartImages(gen)
    images.warm_up(gen)
    assert images.refusal == ("start images failed on this server at start-up (RuntimeError: no graph for one latent "
                              "frame)")
