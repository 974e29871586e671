"""Input validation: one owner for what the API and the lease store accept.

Three parts:

* the ``check_*`` validators of single values (a pool name, a GPU count, seconds, text, ...),
  used by the lease store and by the API alike;
* the parsing of query strings and headers (flags, times, request and event ids);
* the declaration of every JSON request body (:data:`Body`) and query parameter (:data:`Param`):
  each field's name, JSON type, bounds, pattern and description, once. ``openapi.py`` generates
  the OpenAPI schemas from them, and the API checks every request against the same declarations
  (unknown fields, types, bounds, patterns, enums, required fields) before anything changes.

The declarations are a small subset of JSON Schema (OpenAPI 3.1), interpreted here by
:func:`conform`: what the document says is exactly what the server enforces. What JSON Schema
cannot say (``gpus_min`` at most ``gpus``, a booking's end after its start, ...) is listed in
each body's ``rules``, which the document shows in the body's description; those are refused
with a 400 as well, by the code that owns them (the lease store, the bookings).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from difflib import get_close_matches
from functools import lru_cache
from typing import Any

from .. import errors
from ..config import PRIORITIES, Settings
from ..protocol import ROLES, UNSAFE_CHARS, EventType
from ..store.keys import NAME_RE

MAX_GPUS_PER_REQUEST = 1024
MAX_TEXT = 200
MAX_NODES = 64
MAX_GPUS_PER_NODE = 4096
MAX_OCCURRENCES = 52
EVENT_LOG_MAX_LIMIT = 10_000  # the largest limit accepted; a page holds at most EVENT_LOG_PAGE_CAP
EVENT_LOG_PAGE_CAP = 1000
# 2000-01-01 .. 2100-01-01: a time outside is a unit mistake (milliseconds, or a duration).
EPOCH_LOW, EPOCH_HIGH = 946684800, 4102444800
USAGE_GROUPS = ("user", "team", "pool", "notebook")
REPEATS = ("none", "weekly")
# Memory sizes (MB) and process ids: far above any real one, and exact through Lua's numbers (a larger
# one would come back from a script as 1.1e+14 and break every reader of the node's samples).
MAX_MB = MAX_PID = 2**31 - 1

# ---- patterns: ECMA-262 and Python read them alike (ASCII classes, anchored at both ends) ------------

NAME_PATTERN = "^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"
OWNER_PATTERN = "^(team:)?[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"
REQUEST_ID_PATTERN = "^[A-Za-z0-9._-]{8,64}$"
# Text a user sends (labels, notes, reasons): anything but protocol.UNSAFE_CHARS.
TEXT_PATTERN = f"^[^{UNSAFE_CHARS}]*$"
# Any lease id the routes accept (ids made by older clients may be shorter than a request id).
LEASE_ID_PATTERN = "^[A-Za-z0-9._-]{1,64}$"
# An event id Redis accepts as an exclusive start: each part below 2**64 - 1, so at most 19 digits.
SINCE_PATTERN = "^(-|[0-9]{1,19}(-[0-9]{1,19})?)$"
DIGITS_PATTERN = "^[0-9]+$"
NUMBER_PATTERN = "^-?[0-9]+(\\.[0-9]+)?([eE][+-]?[0-9]+)?$"
# An ISO 8601 time with a UTC offset, years 2000..2098.
TIME_PATTERN = (
    "^20(0[0-9]|[1-8][0-9]|9[0-8])-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])[T ]([01][0-9]|2[0-3]):[0-5][0-9]"
    "(:[0-5][0-9](\\.[0-9]{1,6})?)?(Z|[+-]([01][0-9]|2[0-3]):?[0-5][0-9])$"
)


@lru_cache(maxsize=64)
def _regex(pattern: str) -> re.Pattern[str]:
    # Python's "$" also matches before a final newline; ECMA-262's does not.
    return re.compile(pattern[:-1] + r"\Z" if pattern.endswith("$") else pattern)


def matches(pattern: str, value: str) -> bool:
    return _regex(pattern).search(value) is not None


assert NAME_RE.pattern == NAME_PATTERN, "keys.NAME_RE and validate.NAME_PATTERN must say the same"
REQUEST_ID_RE = _regex(REQUEST_ID_PATTERN)
UNSAFE_RE = re.compile(f"[{UNSAFE_CHARS}]")
LEASE_ID_RE = _regex(LEASE_ID_PATTERN)

# ---- validators of single values -------------------------------------------------------------------


def unsafe_char(kind: str, value: str) -> str | None:
    """Why ``value`` is refused when it holds a character of :data:`UNSAFE_CHARS` (None: it holds none):
    the field, and the character's code point and place, since the character itself cannot be shown."""
    found = UNSAFE_RE.search(value)
    if found is None:
        return None
    code = ord(found[0])
    what = "a control character" if code <= 0x9F else "a bidi or line-breaking formatting character"
    return (
        f"{kind} holds {what}, U+{code:04X} at position {found.start()}: labels and names take "
        "printable text only (no control, bidi override or isolate characters)"
    )


def check_printable(kind: str, value: object) -> None:
    """Refuse (400) a string holding a control or bidi formatting character, naming its code point."""
    if isinstance(value, str) and (why := unsafe_char(kind, value)) is not None:
        raise errors.BadRequest(why)


def check_name(kind: str, value: object) -> str:
    check_printable(kind, value)
    if not isinstance(value, str) or not matches(NAME_PATTERN, value):
        raise errors.BadRequest(
            f"{kind} must be a name of letters, digits, '.', '_' or '-' (at most 63), got {value!r}"
        )
    return value


def check_text(kind: str, value: object) -> str:
    if value is None:
        return ""
    if not isinstance(value, str) or len(value) > MAX_TEXT:
        raise errors.BadRequest(f"{kind} must be a string of at most {MAX_TEXT} characters")
    check_printable(kind, value)
    return value


def check_seconds(kind: str, value: object, *, low: float, high: float, default: float) -> float:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise errors.BadRequest(f"{kind} must be a number of seconds, got {value!r}")
    if not low <= value <= high:
        raise errors.BadRequest(f"{kind} must be between {low:g} and {high:g} seconds, got {value!r}")
    return float(value)


def check_gpus(value: object, kind: str = "gpus") -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise errors.BadRequest(f"{kind} must be a whole number of GPUs such as 1 or 2, got {value!r}")
    if value < 1:
        raise errors.BadRequest(f"{kind} must be at least 1, got {value}")
    if value > MAX_GPUS_PER_REQUEST:
        raise errors.BadRequest(f"{kind} must be at most {MAX_GPUS_PER_REQUEST}, got {value}")
    return value


def check_nodes(value: object, gpus: int, gpus_min: int) -> int:
    """A gang's node count: gpus must split evenly, and a gang is not elastic."""
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_NODES:
        raise errors.BadRequest(f"nodes must be a whole number from 1 to {MAX_NODES}, got {value!r}")
    if value > 1 and gpus % value:
        raise errors.BadRequest(
            f"gpus ({gpus}) must be a multiple of nodes ({value}): a gang has the same GPUs on every node, "
            f"e.g. gpus={value * max(1, gpus // value)}"
        )
    if value > 1 and gpus_min != gpus:
        raise errors.BadRequest("a multi-node gang is all or nothing: drop gpus_min, or ask for one node")
    return value


def check_priority(value: object) -> int:
    if value is None:
        return PRIORITIES["normal"]
    if not isinstance(value, str) or value not in PRIORITIES:
        raise errors.BadRequest(f"priority must be one of {', '.join(PRIORITIES)}, got {value!r}")
    return PRIORITIES[value]


def check_token(token: object, *, required: bool) -> str:
    """A fencing token (an integer, or its digits as a string); "" when absent and not required."""
    if token is None or token == "":
        if required:
            raise errors.BadRequest("token is required: pass the fencing token of your grant")
        return ""
    if isinstance(token, bool) or not isinstance(token, (int, str)) or not str(token).isdigit():
        raise errors.BadRequest(f"token must be the integer fencing token of your grant, got {token!r}")
    return str(int(token))


def check_request_id(value: object) -> str | None:
    if value is not None and (not isinstance(value, str) or not REQUEST_ID_RE.search(value)):
        raise errors.BadRequest("id must be 8 to 64 letters, digits, '.', '_' or '-' (a random request id)")
    return value


def _request_ids(value: object) -> list[str]:
    if not isinstance(value, list) or not 1 <= len(value) <= 64:
        raise errors.BadRequest("to must be a list of 1 to 64 request ids")
    for v in value:
        check_request_id(v)
    return value


def check_lease_id(kind: str, value: str | None) -> str | None:
    """A lease or request id named in a query string (``?lease=``, ``?id=``)."""
    if value is not None and not LEASE_ID_RE.search(value):
        raise errors.BadRequest(
            f"{kind} must be a lease or request id of 1 to 64 letters, digits, '.', '_' or '-' "
            f"(e.g. l-0123456789abcdef), got {value!r}"
        )
    return value


def check_since(since: str, name: str = "since") -> str:
    """An event id Redis accepts as an exclusive bound: digits, each part below 2**64 - 1 (or '-')."""
    if not matches(SINCE_PATTERN, since):
        raise errors.BadRequest(f"{name} must be an event id like 1700000000000-0 (or '-'), got {since!r}")
    return since


def check_before(before: str) -> str | None:
    """An event id as an exclusive end ('-' or absent: up to the newest)."""
    check_since(before, "before")
    return None if before == "-" else before


_EVENT_TYPE = "(" + "|".join(sorted((t.value for t in EventType), key=len, reverse=True)) + ")"
EVENT_TYPES_PATTERN = f"^{_EVENT_TYPE}(,{_EVENT_TYPE})*$"


def check_event_types(raw: str) -> frozenset[str]:
    """Event types, comma-separated without spaces, each one of ``protocol.EventType``."""
    known = [t.value for t in EventType]
    names = raw.split(",")
    for name in names:
        if name not in known:
            close = get_close_matches(name.strip(), known, n=2)
            hint = f"did you mean {' or '.join(close)}?" if close else "the OpenAPI document lists them"
            if not name:
                raise errors.BadRequest(
                    "type has an empty name (two commas, or one at an end): give event types "
                    "comma-separated, e.g. grant,released"
                )
            raise errors.BadRequest(
                f"type {name[:40]!r} is no event type (comma-separated, e.g. grant,released); {hint}"
            )
    return frozenset(names)


def parse_time(kind: str, value: object) -> int:
    """Epoch seconds (a number) or ISO 8601 with a UTC offset, to UTC milliseconds (the bookings' rule)."""
    if isinstance(value, bool) or value is None:
        raise errors.BadRequest(f"{kind} must be epoch seconds or an ISO 8601 time such as 2026-11-23T09:00:00+01:00")
    if isinstance(value, (int, float)):
        if value != value or not EPOCH_LOW <= value <= EPOCH_HIGH:
            raise errors.BadRequest(f"{kind} must be epoch seconds between 2000 and 2100, got {value!r}")
        return int(round(value * 1000))
    if isinstance(value, str):
        try:
            when = datetime.fromisoformat(value.strip())
        except ValueError:
            raise errors.BadRequest(
                f"{kind} {value!r} is not an ISO 8601 time; write it like 2026-11-23T09:00:00+01:00"
            ) from None
        if when.tzinfo is None:
            raise errors.BadRequest(
                f"{kind} {value!r} has no UTC offset; add one (Z or +01:00): bookings are stored in UTC"
            )
        return parse_time(kind, when.timestamp())
    raise errors.BadRequest(f"{kind} must be epoch seconds or an ISO 8601 string, got {type(value).__name__}")


def check_owner(value: object) -> str:
    if isinstance(value, str) and value.startswith("team:") and NAME_RE.match(value[5:]):
        return value
    if isinstance(value, str) and NAME_RE.match(value):
        return value
    raise errors.BadRequest(f'owner must be a user name or "team:NAME", got {value!r}')


def check_time(kind: str, value: object) -> int:
    """A time in a JSON body: its own message first (parse_time's), then the declared form."""
    ms = parse_time(kind, value)
    if isinstance(value, str) and not matches(TIME_PATTERN, value):
        raise errors.BadRequest(
            f"{kind} {value!r} must be written like 2026-11-23T09:00:00+01:00 (ISO 8601 with a UTC offset, "
            "seconds and fraction optional)"
        )
    return ms


# ---- query strings and headers --------------------------------------------------------------------------

TRUE, FALSE = ("1", "true", "yes", "on", "t", "y"), ("0", "false", "no", "off", "f", "n")


def parse_flag(name: str, raw: str | None, default: bool = False) -> bool:
    """A boolean query argument: true or false (1/0, yes/no and on/off read the same)."""
    if raw is None:
        return default
    low = raw.lower()
    if low not in TRUE + FALSE:
        raise errors.BadRequest(f"{name} must be true or false, got {raw!r}")
    return low in TRUE


def parse_int(name: str, raw: str | None, *, low: int, high: int, default: int | None = None) -> int | None:
    if raw is None:
        return default
    if not matches("^-?[0-9]{1,20}$", raw) or not low <= int(raw) <= high:
        raise errors.BadRequest(f"{name} must be an integer between {low} and {high}, got {raw!r}")
    return int(raw)


def parse_time_arg(name: str, raw: str) -> int:
    """A time in a query string: epoch seconds or ISO 8601 with an offset, to UTC milliseconds."""
    value: object = float(raw) if matches(NUMBER_PATTERN, raw) else raw
    return check_time(name, value)


# ---- declarations -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Field:
    """One field of a JSON body: its JSON Schema (type, bounds, pattern, enum, description) and,
    optionally, the validator of its own whose message the API gives for a bad value (run before the
    schema is checked; the schema is always checked too)."""

    name: str
    schema: dict[str, Any]
    required: bool = False
    check: Callable[[Any], object] | None = None
    missing: str | None = None  # the message when a required field is absent


@dataclass(frozen=True)
class Body:
    """A JSON request body: its fields, and the rules beyond them that JSON Schema cannot say."""

    name: str  # the schema's name under components/schemas
    fields: tuple[Field, ...]
    description: str = ""
    rules: tuple[str, ...] = ()
    noun: str = "the body"  # what the missing-field message says needs them
    what: str = "field"  # what the unknown-field message calls a field ("policy field")

    @property
    def allowed(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    def schema(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "type": "object",
            "additionalProperties": False,
            "properties": {f.name: f.schema for f in self.fields},
        }
        required = [f.name for f in self.fields if f.required]
        if required:
            out["required"] = required
        text = self.description
        if self.rules:
            text += (" " if text else "") + "Also refused with a 400: " + "; ".join(self.rules) + "."
        if text:
            out["description"] = text
        return out

    def check(self, data: Mapping[str, Any]) -> dict[str, Any]:
        """``data`` (a JSON object) checked against the declaration; raises BadRequest naming what to fix."""
        unknown = [k for k in data if k not in self.allowed]
        if unknown:
            raise errors.BadRequest(f"unknown {self.what}(s) {sorted(unknown)}; allowed: {', '.join(self.allowed)}")
        schemas = {f.name: f.schema for f in self.fields}
        data = {k: normalize(schemas[k], v) for k, v in data.items()}
        for f in self.fields:
            if f.name in data:
                if f.check is not None:
                    f.check(data[f.name])
                conform(f.schema, data[f.name], f.name)
        missing = [f for f in self.fields if f.required and f.name not in data]
        if missing:
            if missing[0].missing:
                raise errors.BadRequest(missing[0].missing)
            needed = ", ".join(f.name for f in self.fields if f.required)
            raise errors.BadRequest(
                f"missing field(s) {', '.join(f.name for f in missing)}: {self.noun} needs {needed}"
            )
        return data


@dataclass(frozen=True)
class Param:
    """A query parameter or request header: what the document shows, and how the server reads it
    (``parse``: the raw text to its value, raising BadRequest; by default read by the schema)."""

    name: str
    schema: dict[str, Any]
    description: str = ""
    where: str = "query"
    parse: Callable[[str], Any] | None = None

    def read(self, raw: str | None) -> Any:
        """The value of the raw text given (None when absent), checked against the declaration."""
        if raw is None:
            return None
        if self.parse is not None:
            return self.parse(raw)
        kind = self.schema.get("type")
        if kind == "boolean":
            return parse_flag(self.name, raw)
        if kind == "integer":
            lo, hi = self.schema.get("minimum", -(2**63)), self.schema.get("maximum", 2**63 - 1)
            return parse_int(self.name, raw, low=lo, high=hi)
        conform(self.schema, raw, self.name)
        return raw

    def openapi(self) -> dict[str, Any]:
        out = {"name": self.name, "in": self.where, "required": False, "schema": self.schema}
        if self.description:
            out["description"] = self.description
        return out


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


def _text(description: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {"type": "string", "maxLength": MAX_TEXT, "pattern": TEXT_PATTERN}
    if description:
        out["description"] = description
    return out


NAME = {"type": "string", "pattern": NAME_PATTERN}
# A proxy token's acts_for (web/auth.py check_acts_for reads it the same way).
ACTS_FOR_ENTRY = r"[A-Za-z0-9._*?\[\]!-]{1,64}"
ACTS_FOR_PATTERN = rf"^(re:.+|{ACTS_FOR_ENTRY}(,{ACTS_FOR_ENTRY})*)$"
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
        {"type": "integer", "minimum": 0},
        {"type": "string", "pattern": DIGITS_PATTERN, "description": "the token's digits"},
    ],
    "description": "The fencing token of the grant",
}
GPUS = {"type": "integer", "minimum": 1, "maximum": MAX_GPUS_PER_REQUEST}
GPU_INDEX = {"type": "integer", "minimum": 0, "maximum": MAX_GPUS_PER_NODE - 1}
SAMPLE_PROPS: dict[str, Any] = {
    "util": {"type": "number", "minimum": 0, "maximum": 100, "description": "% utilization (default 0)"},
    "mem_mb": {"type": "integer", "minimum": 0, "maximum": MAX_MB, "description": "memory in use, MB (default 0)"},
    "procs": {
        "type": "array",
        "maxItems": 1000,
        "items": {"type": "integer", "minimum": 0, "maximum": MAX_PID},
        "description": "ids of the processes on the GPU",
    },
}
GPU_SAMPLE = {
    "type": "object",
    "additionalProperties": False,
    "required": ["index"],
    "properties": {"index": GPU_INDEX, **SAMPLE_PROPS},
}
SIMULATED_SAMPLE = {"type": "object", "additionalProperties": False, "properties": SAMPLE_PROPS}
# A process on a GPU no live lease covers that the node agent signalled (unleased_action "kill").
KILLED_PROCESS = {
    "type": "object",
    "additionalProperties": False,
    "required": ["index", "pid", "signal"],
    "properties": {
        "index": GPU_INDEX,
        "pid": {"type": "integer", "minimum": 2, "maximum": MAX_PID},
        "user": {**_text("the process's owner"), "maxLength": 64},
        "signal": {"enum": ["SIGTERM", "SIGKILL"]},
        "grace_s": {"type": "number", "minimum": 0, "maximum": 3600, "description": "SIGTERM: SIGKILL after this"},
        "error": _text("why the signal could not be sent (e.g. permission denied)"),
    },
}
INVENTORY_GPU = {
    "type": "object",
    "additionalProperties": False,
    "required": ["index"],
    "properties": {
        "index": GPU_INDEX,
        "uuid": {"type": "string", "pattern": TEXT_PATTERN, "description": "kept up to 100 characters"},
        "model": {"type": "string", "pattern": TEXT_PATTERN, "description": "kept up to 100 characters"},
        "memory_mb": {"type": "integer", "minimum": 0, "maximum": MAX_MB},
    },
}
SECONDS_IN_A_WEEK = 7 * 86400


def _ttl(max_ttl: float, what: str) -> Field:
    return Field(
        "ttl",
        nullable({"type": "number", "minimum": 1, "maximum": max_ttl, "description": what}),
        check=lambda v: check_seconds("ttl", v, low=1, high=max_ttl, default=0.0),
    )


def _utilization(value: object) -> object:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and not 0 <= value <= 100:
        raise errors.BadRequest(f"idle_threshold is a utilization in %, 0 to 100, got {value}")
    return value


def check_gpu_sample(g: dict[str, Any], index: object = None) -> dict[str, Any]:
    idx = g.get("index", index)
    util, mem, procs = g.get("util", 0), g.get("mem_mb", 0), g.get("procs", [])
    if isinstance(idx, bool) or not isinstance(idx, int) or idx < 0:
        raise errors.BadRequest(f"index must be a GPU index >= 0, got {idx!r}")
    if isinstance(util, bool) or not isinstance(util, (int, float)) or not 0 <= util <= 100:
        raise errors.BadRequest(f"util must be a utilization between 0 and 100 (%), got {util!r}")
    if isinstance(mem, bool) or not isinstance(mem, int) or mem < 0:
        raise errors.BadRequest(f"mem_mb must be an integer >= 0, got {mem!r}")
    if (
        not isinstance(procs, list)
        or len(procs) > 1000
        or not all(isinstance(p, int) and not isinstance(p, bool) and p >= 0 for p in procs)
    ):
        raise errors.BadRequest(f"procs must be a list of process ids, got {procs!r}")
    return {"index": idx, "util": util, "mem_mb": mem, "procs": procs}


def _simulated_gpus(value: object) -> object:
    """What simulated GPUs report, with the messages of the sample checks (check_gpu_sample)."""

    if isinstance(value, dict):
        for key, sample in value.items():
            if not (isinstance(key, str) and key.isdigit()) or not isinstance(sample, dict):
                raise errors.BadRequest(f"gpus keys are GPU indexes and values objects, got {key!r}: {sample!r}")
            check_gpu_sample(sample, int(key))
    return value


def _names(key: str) -> Callable[[Any], object]:
    def check(value: object) -> object:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise errors.BadRequest(f"{key} must be a list of names, got {value!r}")
        return value

    return check


def _optional(check: Callable[[Any], object]) -> Callable[[Any], object]:
    return lambda v: None if v is None else check(v)


def _owner(value: object) -> object:
    return check_owner(value)


# The fencing token of the caller's own lease, in every body that acts on it.
LEASE_TOKEN = Field(
    "token",
    TOKEN,
    required=True,
    check=lambda v: check_token(v, required=True),
    missing="token is required: pass the fencing token of the lease",
)


def _resize_body(name: str, verb: str, what: str) -> Body:
    """A grow or shrink request: the lease's token and how many GPUs to ``verb``."""
    return Body(
        name,
        (
            LEASE_TOKEN,
            Field(
                "gpus",
                {**GPUS, "description": f"How many GPUs to {verb} {what}"},
                required=True,
                check=check_gpus,
                missing=f'gpus is required: how many GPUs to {verb}, e.g. {{"token": 7, "gpus": 1}}',
            ),
            Field(
                "size",
                nullable(
                    {
                        **GPUS,
                        "description": "Optional: the GPUs you saw the lease hold. Given, a resent request is "
                        "harmless (a lease already changed answers as done; another size is refused)",
                    }
                ),
                check=lambda v: None if v is None else check_gpus(v, "size"),
            ),
        ),
    )


@dataclass(frozen=True)
class Bodies:
    """Every JSON request body of the API, for one server's settings (its TTL and wait limits)."""

    acquire: Body
    release: Body
    renew: Body
    revoke: Body
    handoff: Body
    grow: Body
    shrink: Body
    booking: Body
    booking_change: Body
    policy: Body
    inventory: Body
    samples: Body
    simulate: Body
    token: Body
    procs: Body
    drained: Body
    warm: Body

    def all(self) -> list[Body]:
        return [getattr(self, name) for name in self.__dataclass_fields__]


def bodies(settings: Settings | None = None) -> Bodies:
    if settings is None:
        settings = Settings()
    return _bodies(settings.max_ttl, settings.max_wait, settings.default_ttl)


@lru_cache(maxsize=8)
def _bodies(max_ttl: float, max_wait: float, default_ttl: float) -> Bodies:
    reason = Field(
        "reason",
        nullable(_text("Why (shown to the lease's owner and in the event log)")),
        check=_optional(lambda v: check_text("reason", v)),
    )
    booking_fields = (
        Field("pool", NAME, required=True, check=lambda v: check_name("pool", v)),
        Field("gpus", GPUS, required=True, check=check_gpus),
        Field("start", TIME, required=True, check=lambda v: check_time("start", v)),
        Field("end", TIME, required=True, check=lambda v: check_time("end", v)),
        Field(
            "owner",
            nullable(
                {
                    "type": "string",
                    "pattern": OWNER_PATTERN,
                    "description": 'A user, or "team:NAME" (members share it). Default: you',
                }
            ),
            check=_optional(_owner),
        ),
        Field("note", nullable(_text()), check=lambda v: check_text("note", v)),
        Field("repeat", nullable({"enum": list(REPEATS), "description": "weekly: every 168 h of UTC (default none)"})),
        Field(
            "occurrences",
            nullable(
                {
                    "type": "integer",
                    "minimum": 1,
                    "maximum": MAX_OCCURRENCES,
                    "description": "How many weeks (repeat weekly; default 4)",
                }
            ),
        ),
        Field("colocate", {"type": "boolean", "description": "All GPUs on one node (for one multi-GPU lease)"}),
    )
    booking_rules = (
        "end at least 60 s after start, and at most the server's max_booking_days later (7 days when weekly)",
        "a new booking's last occurrence must end in the future",
        'occurrences above 1 need repeat "weekly"',
        "an ISO 8601 time must name a real date (no February 30)",
    )
    return Bodies(
        acquire=Body(
            "AcquireRequest",
            (
                Field(
                    "gpus",
                    {**GPUS, "description": "GPUs to lease (all on one node unless nodes is above 1)"},
                    required=True,
                    check=check_gpus,
                    missing='gpus is required, e.g. {"gpus": 1}',
                ),
                Field(
                    "gpus_min",
                    nullable(
                        {
                            **GPUS,
                            "description": "Elastic request: granted as many as one node has free, "
                            "from gpus_min to gpus",
                        }
                    ),
                    check=_optional(lambda v: check_gpus(v, "gpus_min")),
                ),
                Field(
                    "nodes",
                    nullable(
                        {
                            "type": "integer",
                            "minimum": 1,
                            "maximum": MAX_NODES,
                            "description": "A multi-node gang: gpus / nodes GPUs on each of that many nodes, "
                            "all or nothing",
                        }
                    ),
                ),
                Field(
                    "pool",
                    nullable({**NAME, "description": "Default: the server's default GPU pool"}),
                    check=_optional(lambda v: check_name("pool", v)),
                ),
                _ttl(max_ttl, f"Seconds the lease lives unless renewed (default {default_ttl:g})"),
                Field(
                    "wait",
                    nullable(
                        {
                            "type": "number",
                            "minimum": 0,
                            "maximum": max_wait,
                            "description": "Seconds to wait in the queue (0, the default: fail at once)",
                        }
                    ),
                    check=lambda v: check_seconds("wait", v, low=0, high=max_wait, default=0.0),
                ),
                Field("label", nullable(_text()), check=lambda v: check_text("label", v)),
                Field("session", nullable(_text()), check=lambda v: check_text("session", v)),
                Field("notebook", nullable(_text("For the usage ledger")), check=lambda v: check_text("notebook", v)),
                Field(
                    "cell",
                    nullable(_text("The cell: its number in the notebook (In [4] sends 4), else a hash of its source")),
                    check=lambda v: check_text("cell", v),
                ),
                Field(
                    "id",
                    nullable(
                        {
                            "type": "string",
                            "pattern": REQUEST_ID_PATTERN,
                            "description": "Optional request id chosen by the client: it becomes the lease id, "
                            "shows the request in GET /queue while it waits, and makes a resent POST return the "
                            "same grant",
                        }
                    ),
                    check=check_request_id,
                ),
                Field(
                    "priority",
                    nullable(
                        {
                            "enum": list(PRIORITIES),
                            "description": "Priority class (the priority scheduler serves higher classes first; "
                            "a request may preempt only preemptible leases of no higher class)",
                        }
                    ),
                    check=check_priority,
                ),
            ),
            rules=(
                "gpus_min above gpus",
                "nodes above 1 with gpus not a multiple of nodes, or with a gpus_min other than gpus",
            ),
        ),
        release=Body(
            "ReleaseRequest",
            (
                Field(
                    "token",
                    nullable(TOKEN),
                    check=lambda v: check_token(v, required=False),
                ),
                reason,
                Field("verified", {"type": "boolean", "description": VERIFIED_TEXT}),
            ),
            description="Optional; the same fields may be given in the query string (the body wins)",
        ),
        renew=Body(
            "RenewRequest",
            (
                Field(
                    "token",
                    TOKEN,
                    required=True,
                    check=lambda v: check_token(v, required=True),
                    missing="token is required: pass the fencing token of your grant",
                ),
                _ttl(max_ttl, "Seconds from now (default: the lease's own ttl)"),
                Field(
                    "activity",
                    nullable(
                        {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {
                                "executing": {"type": "boolean", "description": "A cell is running"},
                                "source": {
                                    "type": "string",
                                    "pattern": TEXT_PATTERN,
                                    "description": "Who reports it (kept to 40 characters)",
                                },
                            },
                            "description": "What the holder is doing: a signal for the idle-GPU reclaimer",
                        }
                    ),
                ),
            ),
        ),
        revoke=Body("RevokeRequest", (reason,)),
        handoff=Body(
            "HandoffRequest",
            (
                Field(
                    "token",
                    TOKEN,
                    required=True,
                    check=lambda v: check_token(v, required=True),
                    missing="token is required: pass the fencing token of the lease you hand over",
                ),
                Field(
                    "to",
                    {
                        "type": "array",
                        "minItems": 1,
                        "maxItems": 64,
                        "items": {"type": "string", "pattern": REQUEST_ID_PATTERN},
                        "description": "Ids of your queued requests that may get the lease's GPUs: the pool's "
                        "oldest waiter must be one of them",
                    },
                    required=True,
                    check=_request_ids,
                    missing="to is required: the ids of your queued requests that may get these GPUs",
                ),
            ),
        ),
        warm=Body(
            "WarmRequest",
            (
                LEASE_TOKEN,
                Field(
                    "warm",
                    {
                        "type": "boolean",
                        "description": "true: keep the lease warm (its worker stays; its GPUs are lent to "
                        "whoever would otherwise wait); false: run a cell on it again",
                    },
                    required=True,
                    missing="warm is required: true to keep the lease warm, false to use it again, e.g. "
                    '{"token": 7, "warm": true}',
                ),
            ),
        ),
        grow=_resize_body("GrowRequest", "add", "to your elastic lease, up to the gpus it asked for at most"),
        shrink=_resize_body("ShrinkRequest", "give back", "(at least one stays: to give back all, release)"),
        booking=Body(
            "BookingRequest",
            booking_fields,
            rules=booking_rules,
            noun="a booking",
        ),
        booking_change=Body(
            "BookingChange",
            tuple(Field(f.name, f.schema, check=f.check) for f in booking_fields),
            description="Fields not given stay",
            rules=("an empty change", *booking_rules[:1], *booking_rules[2:]),
        ),
        policy=Body(
            "Policy",
            (
                Field("enabled", {"type": "boolean"}),
                Field(
                    "idle_threshold",
                    {"type": "number", "minimum": 0, "maximum": 100, "description": "% utilization"},
                    check=_utilization,
                ),
                Field(
                    "idle_timeout",
                    {
                        "type": "number",
                        "exclusiveMinimum": 0,
                        "maximum": SECONDS_IN_A_WEEK,
                        "description": "seconds idle before a warning",
                    },
                ),
                Field(
                    "grace",
                    {
                        "type": "number",
                        "minimum": 0,
                        "maximum": SECONDS_IN_A_WEEK,
                        "description": "seconds from warning to reclaim",
                    },
                ),
                Field(
                    "min_age",
                    {
                        "type": "number",
                        "minimum": 0,
                        "maximum": SECONDS_IN_A_WEEK,
                        "description": "seconds a new lease is never reclaimed",
                    },
                ),
                Field("max_extensions", {"type": "integer", "minimum": 0, "maximum": 1000}),
                Field("exempt_users", {"type": "array", "items": _text()}, check=_names("exempt_users")),
                Field("exempt_labels", {"type": "array", "items": _text()}, check=_names("exempt_labels")),
                Field(
                    "unleased_action",
                    {
                        "enum": ["flag", "kill"],
                        "description": "a process on a GPU no live lease covers: flag it, or its node agent kills it",
                    },
                ),
                Field(
                    "unleased_kill_grace_s",
                    {
                        "type": "number",
                        "minimum": 0,
                        "maximum": 3600,
                        "description": "seconds from SIGTERM to SIGKILL (unleased_action kill)",
                    },
                ),
            ),
            description="Fields not given stay",
            what="policy field",
        ),
        inventory=Body(
            "Inventory",
            (
                Field(
                    "pool",
                    NAME,
                    required=True,
                    check=lambda v: check_name("pool", v),
                    missing="pool must be a name of letters, digits, '.', '_' or '-': the pool of the node's GPUs",
                ),
                Field("source", {"enum": ["nvml", "simulated"], "description": "Default: simulated"}),
                Field(
                    "gpus",
                    {"type": "array", "minItems": 1, "maxItems": MAX_GPUS_PER_NODE, "items": INVENTORY_GPU},
                    required=True,
                ),
                Field(
                    "isolation",
                    {
                        "type": "string",
                        "maxLength": 200,
                        "pattern": "^[^\\x00-\\x1f\\x7f]*$",
                        "description": "How the agent keeps leases' workers off other GPUs, or why it cannot",
                    },
                ),
            ),
            rules=("two GPUs with the same index",),
        ),
        samples=Body(
            "Samples",
            (
                Field(
                    "gpus",
                    {"type": "array", "minItems": 1, "maxItems": MAX_GPUS_PER_NODE, "items": GPU_SAMPLE},
                    required=True,
                ),
                Field(
                    "killed",
                    {
                        "type": "array",
                        "maxItems": 1000,
                        "items": KILLED_PROCESS,
                        "description": "unleased processes the agent signalled since its last sample",
                    },
                ),
            ),
        ),
        simulate=Body(
            "SimulatedSamples",
            (
                Field(
                    "gpus",
                    {
                        "type": "object",
                        "minProperties": 1,
                        "propertyNames": {"pattern": "^[0-9]{1,4}$"},
                        "additionalProperties": SIMULATED_SAMPLE,
                        "description": 'GPU index -> what it reports, e.g. {"0": {"util": 95}}',
                    },
                    required=True,
                    missing='body must be {"gpus": {"0": {"util": 95, "mem_mb": 1000, "procs": [123]}}}',
                    check=_simulated_gpus,
                ),
            ),
            rules=("a GPU the node does not have", "a node whose GPUs are real (NVML)"),
        ),
        token=Body(
            "TokenRequest",
            (
                Field(
                    "user",
                    {**NAME, "description": "Whom the token is for"},
                    required=True,
                    check=lambda v: check_name("user", v),
                    missing="user must be a name of letters, digits, '.', '_' or '-': whom the token is for",
                ),
                Field("role", {"enum": list(ROLES), "description": "Default: user"}),
                Field(
                    "expires_in",
                    {
                        "type": "number",
                        "exclusiveMinimum": 0,
                        "maximum": 10 * 365 * 86400,
                        "description": "Seconds until it is refused (default: valid until revoked)",
                    },
                ),
                Field(
                    "acts_for",
                    {
                        "type": "string",
                        "maxLength": 1024,
                        "pattern": ACTS_FOR_PATTERN,
                        "description": "A proxy token: whom it may act for, names and globs separated by commas "
                        "('alice,bob', 'lab-*', '*') or 're:PATTERN' (a regular expression matched against the "
                        "whole name); default '*'. Never a name that holds an admin, agent or proxy token",
                    },
                ),
                Field(
                    "node",
                    {
                        **NAME,
                        "description": "An agent token: the one node it serves (default: the first node it serves)",
                    },
                ),
            ),
            rules=(
                "acts_for with a role other than proxy",
                "node with a role other than agent",
                "acts_for 're:PATTERN' that is not a regular expression",
            ),
        ),
        procs=Body(
            "ClaimRecord",
            (
                Field("lease", LEASE_ID, required=True, missing="lease is required: the lease the process claimed"),
                Field(
                    "fence",
                    {"type": "integer", "minimum": 0, "description": "The lease's fencing token"},
                    required=True,
                    missing="fence is required: the lease's fencing token, as the claim gave it",
                ),
                Field(
                    "token",
                    {"type": "string", "minLength": 1, "maxLength": 200, "description": "The claim's API token"},
                    required=True,
                    missing="token is required: the API token the claim carried (it names the lease's owner)",
                ),
                Field("user", {**NAME, "description": "The user a proxy token acts for"}),
                Field(
                    "pid",
                    {"type": "integer", "minimum": 2, "maximum": MAX_PID, "description": "As the kernel named it"},
                    required=True,
                    missing="pid is required: the claiming process, as SO_PEERCRED named it",
                ),
                Field(
                    "start",
                    {"type": "integer", "minimum": 1, "maximum": 2**53 - 1, "description": "Its start time (ticks)"},
                    required=True,
                    missing="start is required: the process's start time (/proc/PID/stat field 22)",
                ),
                Field(
                    "uid",
                    {"type": "integer", "minimum": 0, "maximum": 2**32 - 1, "description": "Its owner"},
                    required=True,
                    missing="uid is required: the claiming process's uid, as SO_PEERCRED named it",
                ),
                Field(
                    "gpus",
                    {"type": "array", "maxItems": MAX_GPUS_PER_NODE, "items": GPU_INDEX},
                ),
            ),
            rules=("a node the lease does not hold GPUs on", "a GPU of that node the lease does not hold"),
        ),
        drained=Body(
            "DrainedRequest",
            (
                Field(
                    "lease",
                    {
                        "type": "string",
                        "pattern": "^([A-Za-z0-9._-]{1,64})?$",
                        "description": 'The lease whose processes are gone; "": whichever (an admin clearing)',
                    },
                    required=True,
                    missing="lease is required: the lease whose processes are gone from these GPUs",
                ),
                Field(
                    "gpus",
                    {"type": "array", "minItems": 1, "maxItems": MAX_GPUS_PER_NODE, "items": GPU_INDEX},
                    required=True,
                    missing='gpus is required: the indexes now clean, e.g. {"lease": "l-1", "gpus": [0]}',
                ),
                Field("killed", {"type": "integer", "minimum": 0, "maximum": 10000, "description": "Processes ended"}),
                Field(
                    "abandoned",
                    {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["pid", "why"],
                        "properties": {
                            "pid": {"type": "integer", "minimum": 1, "maximum": MAX_PID},
                            "why": {"type": "string", "maxLength": 200},
                        },
                        "description": "A process the agent gives up: the GPUs stay out of service, flagged",
                    },
                ),
            ),
        ),
    )


# ---- query parameters and headers ---------------------------------------------------------------------

BOOL_NOTE = " (1/0, yes/no and on/off read the same)"
ALL = Param("all", {"type": "boolean"}, "Everyone's live leases (without their tokens)" + BOOL_NOTE)
DRY_RUN = Param(
    "dry_run", {"type": "boolean"}, "Only check: answer {fits, node} or the 409 clash, and store nothing" + BOOL_NOTE
)
POOL = Param("pool", NAME, "Only this pool", parse=lambda raw: check_name("pool", raw))
FROM = Param(
    "from",
    TIME,
    "Start of the window: epoch seconds or ISO 8601 with an offset (of a date that exists)",
    parse=lambda raw: parse_time_arg("from", raw),
)
TO = Param("to", TIME, "End of the window (exclusive)", parse=lambda raw: parse_time_arg("to", raw))
BY = Param("by", {"enum": list(USAGE_GROUPS)}, "How to group (default user)")
EST_GPUS = Param("gpus", GPUS, "Default: the queued request's GPUs (with `lease`), else 1")
EST_POOL = Param(
    "pool",
    NAME,
    "Default: the queued request's pool (with `lease`), else the default pool",
    parse=lambda raw: check_name("pool", raw),
)
LEASE_ID = {"type": "string", "pattern": LEASE_ID_PATTERN}
LEASE = Param(
    "lease",
    LEASE_ID,
    "Only events whose `lease` field is this lease (or queued request) id, filtered by the server",
    parse=lambda raw: check_lease_id("lease", raw),
)
EST_LEASE = Param(
    "lease",
    LEASE_ID,
    "The asking request's id when it is already queued: only the requests ahead of it count, not itself "
    "nor those behind it",
    parse=lambda raw: check_lease_id("lease", raw),
)
EST_ID = Param(
    "id", LEASE_ID, "Same as `lease` (give one, or both the same)", parse=lambda raw: check_lease_id("id", raw)
)
SINCE = Param(
    "since",
    {"type": "string", "pattern": SINCE_PATTERN},
    "Entries after this event id ('-': from the start)",
    parse=check_since,
)
BEFORE = Param(
    "before",
    {"type": "string", "pattern": SINCE_PATTERN},
    "Only entries before this event id (exclusive; '-': up to the newest)",
    parse=check_before,
)
ORDER = Param(
    "order",
    {"enum": ["asc", "desc"]},
    "asc (default): oldest first, from `since` on; desc: newest first, from `before` (or the newest) back to "
    "`since`. `limit` counts from where the read starts",
)
EVENT_TYPES = Param(
    "type",
    {"type": "string", "pattern": EVENT_TYPES_PATTERN},
    "Only these event types, comma-separated (e.g. grant,released)",
    parse=check_event_types,
)
EVENT_USER = Param(
    "user",
    NAME,
    "Only this user's events: the lease's holder, the booking's owner, who acted or who asked",
    parse=lambda raw: check_name("user", raw),
)
LAST_EVENT_ID = Param(
    "Last-Event-ID",
    {"type": "string", "pattern": SINCE_PATTERN},
    "Resume after this event id (wins over ?since=)",
    "header",
    parse=check_since,
)
LIMIT = Param(
    "limit",
    {"type": "integer", "minimum": 1, "maximum": EVENT_LOG_MAX_LIMIT},
    f"At most this many (default 100); a page holds at most {EVENT_LOG_PAGE_CAP} (the page cap): a larger "
    "limit is served as the cap, and the answer's limit and note say so",
)


def _token_arg(raw: str) -> int:
    if not matches(DIGITS_PATTERN, raw):
        raise errors.BadRequest(f"token must be the integer fencing token of your grant, got {raw!r}")
    return int(raw)


TOKEN_ARG = Param(
    "token", {"type": "integer", "minimum": 0}, "The fencing token (as the body's `token`)", parse=_token_arg
)
VERIFIED_TEXT = (
    "You saw every process that claimed the lease (through its node agent) gone: its GPUs are free at once. "
    "Without it, the GPUs on which a process claimed it drain first (the node agent ends what remains)"
)
VERIFIED_ARG = Param("verified", {"type": "boolean"}, VERIFIED_TEXT + BOOL_NOTE)
REASON_ARG = Param(
    "reason",
    _text(),
    "Why (as the body's `reason`), e.g. kernel shut down",
    parse=lambda raw: check_text("reason", raw),
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


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


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
            raise errors.BadRequest(f"{path} must be {words}, got {_short(value)}")
        return
    if "enum" in schema:
        if not any(value == e and type(value) is type(e) for e in schema["enum"]):
            shown = ", ".join("null" if e is None else str(e) for e in schema["enum"])
            raise errors.BadRequest(f"{path} must be one of {shown}, got {_short(value)}")
        return
    declared = schema.get("type")
    if declared is not None:
        kinds = [declared] if isinstance(declared, str) else list(declared)
        if not any(_is(k, value) for k in kinds):
            words = " or ".join(_TYPE_WORDS[k] for k in kinds)
            raise errors.BadRequest(f"{path} must be {words}, got {_short(value)}")
    if value is None:
        return
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        _bounds(schema, value, path)
    elif isinstance(value, str):
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            raise errors.BadRequest(f"{path} must be a string of at most {schema['maxLength']} characters")
        if "pattern" in schema and not matches(schema["pattern"], value):
            check_printable(path, value)  # the character's code point, rather than the pattern
            raise errors.BadRequest(f"{path} must match {schema['pattern']}, got {_short(value)}")
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
                raise errors.BadRequest(f"{path} keys must match {names['pattern']}, got {_short(key)}")
    if len(value) < schema.get("minProperties", 0):
        raise errors.BadRequest(f"{path} must have at least {schema['minProperties']} entries")
    for key in schema.get("required", ()):
        if key not in value:
            raise errors.BadRequest(f"{path}.{key} is required")
    for key, item in value.items():
        if key in props:
            conform(props[key], item, f"{path}.{key}")
        elif isinstance(extra, dict):
            conform(extra, item, f"{path}.{key}")
