"""The subset of JSON Schema (OpenAPI 3.1) in which the API's bodies and query parameters are
declared, interpreted here by :func:`conform`: what the document says is exactly what the server
enforces. And the schemas of values that bodies and parameters share (a name, a time, a fencing
token, a GPU count, a lease id, text).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from .. import errors
from ..request import MAX_GPUS_PER_REQUEST, MAX_TEXT, NAME_PATTERN, TEXT_PATTERN, matches, short
from .values import (
    DIGITS_PATTERN,
    EPOCH_HIGH,
    EPOCH_LOW,
    LEASE_ID_PATTERN,
    TIME_PATTERN,
    TOKEN_MAX,
    check_printable,
)


def nullable(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` or null (null means: not given, the default applies)."""
    out = dict(schema)
    if "enum" in out:
        out["enum"] = [*out["enum"], None]
    elif isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    else:
        out = {"anyOf": [schema, {"type": "null"}]}
    return out


def text(description: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {"type": "string", "maxLength": MAX_TEXT, "pattern": TEXT_PATTERN}
    if description:
        out["description"] = description
    return out


# ---- schemas that bodies and parameters share -------------------------------------------------------

NAME = {"type": "string", "pattern": NAME_PATTERN}
TIME = {
    "anyOf": [
        {"type": "number", "minimum": EPOCH_LOW, "maximum": EPOCH_HIGH, "description": "epoch seconds"},
        {
            "type": "string",
            "pattern": TIME_PATTERN,
            "description": "ISO 8601 with a UTC offset, e.g. 2026-11-23T09:00:00+01:00",
        },
    ]
}
TOKEN = {
    "anyOf": [
        {"type": "integer", "minimum": 0, "maximum": TOKEN_MAX},
        {"type": "string", "pattern": DIGITS_PATTERN, "description": "the token's digits"},
    ],
    "description": "The fencing token of the grant",
}
GPUS = {"type": "integer", "minimum": 1, "maximum": MAX_GPUS_PER_REQUEST}
LEASE_ID = {"type": "string", "pattern": LEASE_ID_PATTERN}
VERIFIED_TEXT = (
    "You saw every process that claimed the lease (through its node agent) gone: its GPUs are free at once. "
    "Without it, the GPUs on which a process claimed it drain first (the node agent ends what remains)"
)

# ---- the schema subset -------------------------------------------------------------------------------

_TYPE_WORDS = {
    "integer": "a whole number",
    "number": "a number",
    "string": "a string",
    "boolean": "true or false",
    "array": "a list",
    "object": "an object",
    "null": "null",
}


def _is(kind: str, value: object) -> bool:
    if kind == "null":
        return value is None
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if kind == "string":
        return isinstance(value, str)
    if kind == "array":
        return isinstance(value, list)
    if kind == "object":
        return isinstance(value, dict)
    raise AssertionError(f"unknown JSON type {kind}")


def _allows_integer(schema: Mapping[str, Any]) -> bool:
    kinds = schema.get("type")
    if kinds == "integer" or (isinstance(kinds, list) and "integer" in kinds):
        return True
    return any(_allows_integer(option) for option in schema.get("anyOf", ()))


def normalize(schema: Mapping[str, Any], value: Any) -> Any:
    """JSON Schema counts 2.0 an integer: where one is declared, such a number becomes the int
    the validators expect (an integer written with a fraction is still refused)."""
    if isinstance(value, float) and value.is_integer() and _allows_integer(schema):
        return int(value)
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [normalize(schema["items"], v) for v in value]
    if isinstance(value, dict):
        props, extra = schema.get("properties", {}), schema.get("additionalProperties")
        return {
            k: normalize(props[k], v) if k in props else normalize(extra, v) if isinstance(extra, dict) else v
            for k, v in value.items()
        }
    for option in schema.get("anyOf", ()):
        if isinstance(value, (dict, list)) and option.get("type") in ("object", "array"):
            return normalize(option, value)
    return value


def conform(schema: Mapping[str, Any], value: object, path: str) -> None:
    """Raise BadRequest unless ``value`` is valid by ``schema`` (the subset of JSON Schema used above)."""
    if "anyOf" in schema:
        problems = []
        for option in schema["anyOf"]:
            try:
                conform(option, value, path)
                break
            except errors.BadRequest as exc:
                problems.append(exc.message)
        else:
            kinds = [o.get("type") for o in schema["anyOf"]]
            fitting = [p for p, k in zip(problems, kinds, strict=True) if isinstance(k, str) and _is(k, value)]
            if fitting:
                raise errors.BadRequest(fitting[0])
            words = " or ".join(_TYPE_WORDS.get(str(k), str(k)) for k in kinds)
            raise errors.BadRequest(f"{path} must be {words}, got {short(value)}")
        return
    if "enum" in schema:
        if not any(value == e and type(value) is type(e) for e in schema["enum"]):
            shown = ", ".join("null" if e is None else str(e) for e in schema["enum"])
            raise errors.BadRequest(f"{path} must be one of {shown}, got {short(value)}")
        return
    declared = schema.get("type")
    if declared is not None:
        kinds = [declared] if isinstance(declared, str) else list(declared)
        if not any(_is(k, value) for k in kinds):
            words = " or ".join(_TYPE_WORDS[k] for k in kinds)
            raise errors.BadRequest(f"{path} must be {words}, got {short(value)}")
    if value is None:
        return
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        _bounds(schema, value, path)
    elif isinstance(value, str):
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            raise errors.BadRequest(f"{path} must be a string of at most {schema['maxLength']} characters")
        if "pattern" in schema and not matches(schema["pattern"], value):
            check_printable(path, value)  # the character's code point, rather than the pattern
            raise errors.BadRequest(f"{path} must match {schema['pattern']}, got {short(value)}")
    elif isinstance(value, list):
        lo, hi = schema.get("minItems", 0), schema.get("maxItems")
        if len(value) < lo or (hi is not None and len(value) > hi):
            raise errors.BadRequest(
                f"{path} must be a list of {lo} to {hi if hi is not None else 'any number of'} items"
            )
        if "items" in schema:
            for i, item in enumerate(value):
                conform(schema["items"], item, f"{path}[{i}]")
    elif isinstance(value, dict):
        _object(schema, value, path)


def _bounds(schema: Mapping[str, Any], value: float, path: str) -> None:
    lo, hi = schema.get("minimum"), schema.get("maximum")
    if "exclusiveMinimum" in schema and not value > schema["exclusiveMinimum"]:
        raise errors.BadRequest(f"{path} must be above {schema['exclusiveMinimum']:g}, got {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        if lo is not None and hi is not None:
            raise errors.BadRequest(f"{path} must be between {lo:g} and {hi:g}, got {value!r}")
        raise errors.BadRequest(
            f"{path} must be at least {lo:g}, got {value!r}"
            if lo is not None
            else f"{path} must be at most {hi:g}, got {value!r}"
        )


def _object(schema: Mapping[str, Any], value: dict[str, Any], path: str) -> None:
    props: Mapping[str, Any] = schema.get("properties", {})
    extra = schema.get("additionalProperties", True)
    if extra is False:
        unknown = sorted(k for k in value if k not in props)
        if unknown:
            raise errors.BadRequest(f"unknown field(s) {unknown} in {path}; allowed: {', '.join(props)}")
    names = schema.get("propertyNames")
    if names and "pattern" in names:
        for key in value:
            if not matches(names["pattern"], key):
                raise errors.BadRequest(f"{path} keys must match {names['pattern']}, got {short(key)}")
    if len(value) < schema.get("minProperties", 0):
        raise errors.BadRequest(f"{path} must have at least {schema['minProperties']} entries")
    if "maxProperties" in schema and len(value) > schema["maxProperties"]:
        raise errors.BadRequest(f"{path} must have at most {schema['maxProperties']} entries")
    for key in schema.get("required", ()):
        if key not in value:
            raise errors.BadRequest(f"{path}.{key} is required")
    for key, item in value.items():
        if key in props:
            conform(props[key], item, f"{path}.{key}")
        elif isinstance(extra, dict):
            conform(extra, item, f"{path}.{key}")
