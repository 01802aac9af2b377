"""A start image for a viewer's stream, as its ``start`` names it (the carriers: streamsvc/wire/image.py).

`image_ref` turns an image file into what ``ClientConfig.image`` takes: a ``data:`` URL when it fits inline
(``MAX_INLINE_IMAGE_BYTES``), else the id of an upload (``POST /images`` on the server the viewer connects to, the
access token as a Bearer header), which any number of ``start`` s may name while it is kept. Both check the file
first (a PNG, JPEG or WebP by its bytes, at most ``MAX_IMAGE_BYTES``) and say why not, before anything is sent.
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from urllib.parse import urlsplit

from streamsvc.wire.image import (MAX_IMAGE_BYTES, MAX_INLINE_IMAGE_BYTES, UPLOAD_PATH, ImageError, data_url,
                                  image_type, sniff)


def upload_url(ws_url: str) -> str:
    """Where the server of WebSocket URL `ws_url` takes uploads: ws://h:p/ws -> http://h:p/images."""
    parts = urlsplit(ws_url)
    return f"{'https' if parts.scheme == 'wss' else 'http'}://{parts.netloc}{UPLOAD_PATH}"


def upload(data: bytes, ws_url: str, token: str | None = None, context: ssl.SSLContext | None = None,
           timeout_s: float = 30.0) -> str:
    """Upload an image file to the server of `ws_url`; its id. ImageError with the server's reason when refused."""
    headers = {"Content-Type": sniff(data) or "application/octet-stream"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(upload_url(ws_url), data=data, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s, context=context) as r:
            return json.loads(r.read())["image"]
    except urllib.error.HTTPError as e:
        raise ImageError(f"the server refused the upload ({e.code}): {e.read()[:500].decode(errors='replace').strip()}"
                         ) from None


def check(data: bytes) -> None:
    """ImageError when a server would refuse image file `data` for what the client can see: its type, its size."""
    image_type(data)
    if len(data) > MAX_IMAGE_BYTES:
        raise ImageError(f"the image is {len(data)} bytes; a server takes at most {MAX_IMAGE_BYTES}")


def image_ref(data: bytes, ws_url: str, token: str | None = None, context: ssl.SSLContext | None = None) -> str:
    """What a ``start`` names for image file `data`: its data URL if it fits inline, else an upload's id (uploaded
    now, a blocking HTTP request). ImageError: not a PNG, JPEG or WebP, over the cap, or refused by the server."""
    check(data)
    if len(data) <= MAX_INLINE_IMAGE_BYTES:
        return data_url(data)
    return upload(data, ws_url, token, context)
