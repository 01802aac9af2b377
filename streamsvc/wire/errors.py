"""How a wire message that pydantic refused is told to its sender: one error code and a message naming the field,
what it allows and what came (streamsvc/wire/protocol.py's parsing, streamsvc/wire/framing.py's). A wire module: it
imports nothing else of ours."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError


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
