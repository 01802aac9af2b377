"""Start images uploaded over HTTP (``POST /images``; the carrier and why: streamsvc/wire/image.py).

An upload's body is an image file (at most `image.MAX_IMAGE_BYTES`: the front refuses a larger body with 413 before
this sees it, `body_limits`), behind the access token when the server has tokens. It is decoded off the event loop
(streamsvc/inputs/image.py, the same checks as an inline image: type, declared size, decode, fit) into one frame at
the model's size, kept under an unguessable id for `ttl_s`, and answered ``201`` with
``{"image": ID, "width": W, "height": H, "expires_s": S}``. Any ``start`` or WHEP POST may name the id until then
(`frame`); it is not used up, so a start refused for room can be sent again. Refusals: 400 (a bad image, with the
reason), 401 (no token), 405 (not a POST), 415 (a Content-Type that is no image type), 503 (the engine not ready,
or `max_uploads` held). How often an address may upload is the front's HTTP rate per address (--http-rate).

Bounded: at most `max_uploads` frames in all (each the model's frame, 1.2 MB at 832x480) and `per_client` per client
address (a new one replaces the address's oldest), each for `ttl_s`; expired ones go at the next request.
"""

from __future__ import annotations

import asyncio
import http
import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from streamsvc.door.access import AccessConfig
from streamsvc.door.entry import Client
from streamsvc.door.routes import HttpReply, HttpRequest, reply, text_reply
from streamsvc.inputs.image import DECODERS, decode_image, decode_start_image
from streamsvc.wire.image import (IMAGE_TYPES, MAX_IMAGE_BYTES, UPLOAD_ID, UPLOAD_PATH, ImageError, is_data_url,
                                  parse_data_url)

MAX_UPLOADS = 64  # uploads kept at once, all addresses together
PER_CLIENT = 4  # uploads kept at once per client address (a fifth replaces its oldest)
TTL_S = 300.0  # how long an upload may be named


@dataclass(frozen=True)
class _Upload:
    frame: np.ndarray  # [H, W, 3] uint8 at the model's size
    address: str
    expires_at: float


class ImageUploads:
    """The uploads of one server (module docstring). `frame_size`: the model's (width, height), None until the engine
    is ready; `token_refusal`: the 401 of a request without the access token (streamsvc/door/routes.py)."""

    def __init__(self, access: AccessConfig, frame_size: Callable[[], tuple[int, int] | None],
                 token_refusal: Callable[[HttpRequest], HttpReply | None], clock: Callable[[], float] = time.monotonic,
                 max_uploads: int = MAX_UPLOADS, per_client: int = PER_CLIENT, ttl_s: float = TTL_S) -> None:
        self.access, self.frame_size, self.token_refusal, self.clock = access, frame_size, token_refusal, clock
        self.max_uploads, self.per_client, self.ttl_s = max_uploads, per_client, ttl_s
        self._uploads: dict[str, _Upload] = {}  # by id, oldest first

    @staticmethod
    def takes(path: str) -> bool:
        return path == UPLOAD_PATH

    @staticmethod
    def body_limits() -> dict[str, int]:
        """The request body the front lets this path have (streamsvc/door/front.py FrontConfig.body_limits)."""
        return {UPLOAD_PATH: MAX_IMAGE_BYTES}

    def table_sizes(self) -> dict[str, int]:
        return {"images.uploads": len(self._uploads)}

    def frame(self, image_id: str) -> np.ndarray | None:
        """A copy of the frame upload `image_id` holds; None for an id unknown or expired."""
        self._expire()
        upload = self._uploads.get(image_id)
        return None if upload is None else upload.frame.copy()

    async def resolve(self, image: str) -> np.ndarray:
        """The frame a ``start``'s ``image`` names: a data URL decoded now (off the event loop), or an upload's.
        ImageError with the reason when it names none that can be used."""
        size = self.frame_size()
        if size is None:
            raise ImageError("the model is not ready yet")
        if is_data_url(image):
            return await asyncio.get_running_loop().run_in_executor(DECODERS, decode_start_image, image, *size)
        if UPLOAD_ID.match(image) is None:
            return parse_data_url(image)  # (raises: neither a data URL nor an upload's id, with the forms)
        frame = self.frame(image)
        if frame is None:
            raise ImageError(f"no upload {image[:6]}... here: uploads are kept {self.ttl_s:g} s (upload it again, "
                             f"POST {UPLOAD_PATH}), and one made on another server is not known here")
        return frame

    async def handle(self, request: HttpRequest) -> HttpReply:
        """An upload's reply (module docstring)."""
        if request.method != "POST":
            return text_reply(http.HTTPStatus.METHOD_NOT_ALLOWED, f"POST an image file to {UPLOAD_PATH} (PNG, JPEG "
                              f"or WebP, at most {MAX_IMAGE_BYTES} bytes) to name it in a start")
        refusal = self.token_refusal(request)
        if refusal is not None:
            return refusal
        ctype = (request.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        if ctype and ctype not in IMAGE_TYPES and ctype != "application/octet-stream":
            return text_reply(http.HTTPStatus.UNSUPPORTED_MEDIA_TYPE, f"an upload is an image file: Content-Type "
                              f"{', '.join(IMAGE_TYPES)} (got {ctype[:60]})")
        size = self.frame_size()
        if size is None:
            return text_reply(http.HTTPStatus.SERVICE_UNAVAILABLE, "the model is not ready yet: try again in a while")
        if not request.body:
            return text_reply(http.HTTPStatus.BAD_REQUEST, "the upload has no body: POST the image file's bytes")
        address = Client.of(request.remote, request.headers, self.access).address
        if self._full(address):
            return self._full_reply()
        width, height = size
        mime = ctype if ctype in IMAGE_TYPES else None
        try:
            frame = await asyncio.get_running_loop().run_in_executor(DECODERS, decode_image, request.body, width,
                                                                     height, mime)
        except ImageError as e:
            return text_reply(http.HTTPStatus.BAD_REQUEST, f"bad image: {e}")
        if self._full(address):  # (others came while it was decoded)
            return self._full_reply()
        mine = [k for k, u in self._uploads.items() if u.address == address]
        for old in mine[: max(0, len(mine) - self.per_client + 1)]:  # the address's oldest make room
            del self._uploads[old]
        image_id = secrets.token_urlsafe(16)
        self._uploads[image_id] = _Upload(frame, address, self.clock() + self.ttl_s)
        body = json.dumps({"image": image_id, "width": width, "height": height, "expires_s": self.ttl_s})
        return reply(http.HTTPStatus.CREATED, body.encode(), "application/json")

    def _full(self, address: str) -> bool:
        """Whether a new upload from `address` finds no room: every upload held, none of them the address's own
        oldest one it would replace."""
        self._expire()
        mine = sum(1 for u in self._uploads.values() if u.address == address)
        return len(self._uploads) - (mine >= self.per_client) >= self.max_uploads

    def _full_reply(self) -> HttpReply:
        return text_reply(http.HTTPStatus.SERVICE_UNAVAILABLE, f"the server holds {self.max_uploads} uploads, its "
                          f"most: try again within {self.ttl_s:g} s, or send a small image inline in start")

    def _expire(self) -> None:
        now = self.clock()
        for key in [k for k, u in self._uploads.items() if u.expires_at <= now]:
            del self._uploads[key]
