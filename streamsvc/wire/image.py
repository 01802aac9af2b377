"""A stream's start image on the wire: how a viewer hands the server the picture its stream starts from, and the caps.

A wire module: it imports nothing of ours; the client, the player and the server all use it.

The carrier
-----------
``start``'s ``image`` names the picture, in one of two forms:

- a ``data:`` URL, ``data:image/png;base64,...`` (or ``image/jpeg``, ``image/webp``), inline in the ``start``
  itself: for an image of at most ``MAX_INLINE_IMAGE_BYTES`` (45 KiB), so that the ``start`` stays within the control
  message limit (``protocol.MAX_MESSAGE_BYTES``, 64 KiB). One message, no round trip: the model's own frame sizes
  (128x128 for the built-in model) are a few KiB as a PNG.
- the id of an upload: ``POST UPLOAD_PATH`` (``/images``) with the image file as the body (``Content-Type``
  ``image/png``, ``image/jpeg`` or ``image/webp``, at most ``MAX_IMAGE_BYTES``, 4 MiB; behind the access token like
  ``start``) answers ``201`` and ``{"image": ID, "width": W, "height": H, "expires_s": S}``: the image decoded,
  fitted to the model's frame size and kept for S seconds, during which any ``start`` (over the WebSocket) or WHEP
  ``POST /whep?prompt=...&image=ID`` may name it. The id is a capability (128 random bits), like a watch secret.

Why these and not a larger ``start``: the server's WebSocket refuses a message over the control limit at its frame
header (close 1009), before anything reads it, and that limit is fixed per connection at the upgrade. Raising it for
every connection's first message would let each connection hold megabytes while its ``start`` is decided, and
lowering it again under a client that is still sending is not safe. A WHEP ``POST`` has its SDP offer for a body and
only its query besides: it can name an upload, not carry an image. So large images go over HTTP, whose body limit is
per request (413 past it), are decoded once off the event loop, and are refused with a status and a reason before any
stream is opened; small ones need no second request. A binary message in the chunks' framing was the third way: it
has the limit problem of a large ``start`` and a round trip besides (the server must raise the limit first).

What the server does with it: the image must be a PNG, JPEG or WebP (by its bytes; a data URL's media type must
agree) whose header declares at most ``MAX_IMAGE_PIXELS`` (a decompression bomb, a tiny PNG that claims 50000x50000,
is refused from its header, before any pixel is allocated). It is scaled to cover the model's frame and centre-cropped
(transparent pixels over white); the stream's chunk 0 is then that image's one frame, and generation goes on from it
under the prompt. A ``start`` with an image and ``"input": true`` is refused: the stream would have two first frames.
A bad image is answered with ``error`` code ``bad_image`` (a ``start`` refusal: the connection goes on).
"""

from __future__ import annotations

import base64
import binascii
import re

UPLOAD_PATH = "/images"
"""Where an image is uploaded (POST, the file as the body) for a ``start`` or a WHEP POST to name."""
IMAGE_TYPES = ("image/png", "image/jpeg", "image/webp")
"""The media types an image may have (by its bytes, and its data URL's or upload's Content-Type)."""
MAX_IMAGE_BYTES = 4 * 1024 * 1024
"""Largest image file (encoded bytes) an upload takes."""
MAX_INLINE_IMAGE_BYTES = 45 * 1024
"""Largest image file a ``start`` carries inline as a data URL (its base64 and the rest fit the 64 KiB message)."""
MAX_IMAGE_PIXELS = 4096 * 4096
"""Most pixels an image's header may declare (a 12-megapixel photo fits); more is refused before decoding."""
MAX_IMAGE_SIDE = 16384
"""Longest side, in pixels, an image's header may declare."""
UPLOAD_ID = re.compile(r"^[A-Za-z0-9_-]{22}$")
"""An upload's id: 22 URL-safe base64 characters (128 random bits)."""

_DATA_URL = re.compile(r"^data:([^;,]*)((?:;[^;,]*)*),", re.ASCII)
_MAGIC = ((b"\x89PNG\r\n\x1a\n", "image/png"), (b"\xff\xd8\xff", "image/jpeg"))


class ImageError(ValueError):
    """An image that cannot start a stream; the message says why and what would do."""


def sniff(data: bytes) -> str | None:
    """The media type of an image file by its first bytes (PNG, JPEG, WebP), or None."""
    for magic, mime in _MAGIC:
        if data.startswith(magic):
            return mime
    if len(data) >= 12 and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return None


def image_type(data: bytes) -> str:
    """The media type of an image file by its first bytes (`sniff`). ImageError: not a PNG, JPEG or WebP."""
    mime = sniff(data)
    if mime is None:
        raise ImageError(f"not a PNG, JPEG or WebP image (it starts with {bytes(data[:8])!r})")
    return mime


def data_url(data: bytes) -> str:
    """The ``data:`` URL of an image file (its media type from its bytes). ImageError: not a PNG, JPEG or WebP."""
    return f"data:{image_type(data)};base64,{base64.b64encode(data).decode('ascii')}"


def is_data_url(image: str) -> bool:
    """Whether ``start``'s ``image`` is a data URL (else it names an upload)."""
    return image[:5].lower() == "data:"


def parse_data_url(url: str, max_bytes: int = MAX_INLINE_IMAGE_BYTES) -> bytes:
    """The image file a ``data:`` URL carries (base64, of one of IMAGE_TYPES, at most `max_bytes`). ImageError with
    what is wrong: not a data URL, not base64, another media type, bad base64, empty, too large, or bytes that are not
    the image the URL says."""
    m = _DATA_URL.match(url[:300])
    if m is None:
        raise ImageError("the image is not a data: URL (data:image/png;base64,...) nor an upload's id (POST "
                         f"{UPLOAD_PATH})")
    mime, params = m.group(1).strip().lower(), [p.strip().lower() for p in m.group(2).split(";")[1:]]
    if mime not in IMAGE_TYPES:
        raise ImageError(f"the data: URL's media type is {mime or 'missing'!r}; give one of {', '.join(IMAGE_TYPES)}")
    if "base64" not in params:
        raise ImageError("the data: URL is not base64 (data:image/png;base64,...)")
    payload = url[m.end():]
    if len(payload) > (max_bytes + 2) // 3 * 4:
        raise ImageError(f"the image is over {max_bytes} bytes, the most a start carries inline: upload it (POST "
                         f"{UPLOAD_PATH}, up to {MAX_IMAGE_BYTES} bytes) and name its id")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("the data: URL's base64 does not decode (characters outside base64, or cut short)") from None
    if not data:
        raise ImageError("the data: URL carries no bytes")
    if sniff(data) != mime:
        raise ImageError(f"the data: URL says {mime} but its bytes are {sniff(data) or 'no PNG, JPEG or WebP'}")
    return data
