"""The wire's error codes (`ErrorCode`, the ``code`` of an ``error`` message; streamsvc/wire/protocol.py re-exports
them), and how a wire message that pydantic refused is told to its sender: one error code and a message naming the
field, what it allows and what came (streamsvc/wire/protocol.py's parsing, streamsvc/wire/framing.py's). A wire
module: it imports nothing else of ours."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ValidationError


class ErrorCode(StrEnum):
    """The ``code`` of an ``error`` message."""

    BAD_JSON = "bad_json"  # not UTF-8, not JSON, or not a JSON object
    UNKNOWN_TYPE = "unknown_type"  # no "type" field, or a type we do not know
    INVALID_FIELD = "invalid_field"  # a field missing, unknown, of the wrong type or out of range
    TOO_LARGE = "too_large"  # the message exceeds MAX_MESSAGE_BYTES (or MAX_CHUNK_BYTES)
    BAD_CHUNK = "bad_chunk"  # a binary chunk message that does not follow the framing
    NOT_STARTED = "not_started"  # a stream command before "start"
    ALREADY_STARTED = "already_started"  # a second "start" on one connection
    REFUSED = "refused"  # admission refused the stream (the message says why)
    UNAUTHORIZED = "unauthorized"  # start without a valid access token; the server closes the socket
    TOO_MANY_STREAMS = "too_many_streams"  # start over this token's or this address's stream limit
    RATE_LIMITED = "rate_limited"  # a control message over the stream's rate; it was dropped, the stream goes on
    INTERNAL = "internal"  # the server failed; the message says what, never a traceback
    # the server ended the stream, the newest, because degradation could no longer keep every stream from stalling
    OVERLOADED = "overloaded"
    NOT_STEERER = "not_steerer"  # a watcher asked for what only the stream's steerer may do; its stream goes on
    # the stream's input video was refused (a frame over the pixel cap, a decoder over its CPU budget: the message
    # says which); nothing more of it is decoded, and the stream goes on without input
    INPUT_REFUSED = "input_refused"
    NOT_FOUND = "not_found"  # watch: no open stream has that id
    # a request the server cannot serve now (the recordings' disk budget is full, no room to resume); the stream goes on
    UNAVAILABLE = "unavailable"
    # a cluster's worker (the GPU replica that ran the stream) was lost; the stream is gone, and a new `start`
    # on a new connection is placed again (on another worker): the one error worth retrying at once
    WORKER_LOST = "worker_lost"
    # the start's image cannot start a stream (not a PNG, JPEG or WebP, over the byte or pixel cap, corrupt, a bad
    # data: URL, an upload unknown or expired: the message says which); no stream was opened, the connection goes on
    BAD_IMAGE = "bad_image"


START_REFUSALS = frozenset({ErrorCode.REFUSED, ErrorCode.UNAUTHORIZED, ErrorCode.TOO_MANY_STREAMS, ErrorCode.NOT_FOUND,
                            ErrorCode.BAD_IMAGE})
"""The codes that answer a ``start`` or ``watch`` the server will not serve: no stream follows."""
RETRYABLE = frozenset({ErrorCode.WORKER_LOST})
"""The codes after which a viewer should reconnect at once: its stream ended through no fault of its own."""


def describe(exc: ValidationError, types: dict[str, type[BaseModel]], model: str | None = None) -> tuple[str, str]:
    """pydantic's errors as one (error code, message) a person can act on: the code is an error code value of
    streamsvc/wire/protocol.py (bad_json, unknown_type, invalid_field). `model`: the type name of a message validated
    on its own model (not through the tagged union, whose errors' locations start with the type)."""
    errors = exc.errors(include_url=False)
    if model is not None:
        errors = [{**e, "loc": (model, *e["loc"])} for e in errors]
    first = errors[0]
    kind = first["type"]
    known = ", ".join(types)
    if kind == "json_invalid":
        return ("bad_json", f"malformed JSON: {first['ctx']['error']}")
    if kind in ("dict_type", "model_type", "model_attributes_type"):
        return ("bad_json", f"expected a JSON object, got {_json_kind(first['input'])}")
    if kind == "union_tag_not_found":
        return ("unknown_type", f"message has no 'type' field; expected one of: {known}")
    if kind == "union_tag_invalid":
        tag = _short(first["input"].get("type") if isinstance(first["input"], dict) else None)
        return ("unknown_type", f"unknown message type {tag}; expected one of: {known}")
    parts = [_describe_field_error(err, types) for err in errors[:3]]
    if len(errors) > 3:
        parts.append(f"and {len(errors) - 3} more")
    return ("invalid_field", "; ".join(parts))


def _describe_field_error(err: Any, types: dict[str, type[BaseModel]]) -> str:
    loc = err["loc"]
    msg_type = _clip(str(loc[0])) if loc else "?"
    model = types.get(msg_type)
    field = str(loc[1]) if len(loc) > 1 else None
    path = _clip(".".join(str(p) for p in loc[1:]))
    where = f"'{msg_type}' message"
    if err["type"] == "extra_forbidden":
        allowed = ", ".join(model.model_fields) if model else "?"
        return f"unknown field '{path}' in {where}; its fields are: {allowed}"
    if err["type"] == "missing":
        return f"missing field '{path}' in {where}"
    if len(loc) <= 1:  # a check on the whole message (e.g. chunk sizes vs frames)
        return f"invalid {where}: {err['msg'].removeprefix('Value error, ')}"
    hint = ""
    if model is not None and field in model.model_fields:
        description = _field_description(model, field)
        if description:
            hint = f"; allowed: {description}"
    got = f"; got {_short(err['input'])}" if "input" in err else ""
    return f"invalid field '{path}' in {where}: {err['msg']}{hint}{got}"


def _field_description(model: type[BaseModel], field: str) -> str | None:
    info = model.model_fields[field]
    if info.description:
        return info.description
    for meta in info.metadata:  # Annotated[..., Field(description=...)] on optional fields
        description = getattr(meta, "description", None)
        if description:
            return description
    annotation = info.annotation
    for arg in getattr(annotation, "__args__", ()):  # X | None where X carries the description
        for meta in getattr(arg, "__metadata__", ()):
            description = getattr(meta, "description", None)
            if description:
                return description + (" or null" if type(None) in annotation.__args__ else "")
    return None


def _short(value: Any, limit: int = 40) -> str:
    """A value for an error message: its repr, cut short."""
    return _clip(repr(value), limit)


def _clip(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _json_kind(value: Any) -> str:
    names = {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)
