"""Input validation: one owner for what the API and the lease store accept.

* the ``check_*`` validators of single values (a pool name, a GPU count, seconds, text, ...),
  used by the lease store and by the API alike (they lived in lease.py);
* the parsing of query strings and headers (flags, times, request and event ids), which lived in
  api.py.
"""

from __future__ import annotations

import re
from functools import lru_cache

from . import errors
from .config import PRIORITIES
from .keys import NAME_RE

MAX_GPUS_PER_REQUEST = 1024
MAX_TEXT = 200
MAX_NODES = 64
MAX_GPUS_PER_NODE = 4096
MAX_OCCURRENCES = 52
EVENT_LOG_MAX_LIMIT = 10_000
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
# Any lease id the routes accept (ids made by older clients may be shorter than a request id).
LEASE_ID_PATTERN = "^[A-Za-z0-9._-]{1,64}$"
# An event id Redis accepts as an exclusive start: each part below 2**64 - 1, so at most 19 digits.
SINCE_PATTERN = "^(-|[0-9]{1,19}(-[0-9]{1,19})?)$"
DIGITS_PATTERN = "^[0-9]+$"
NUMBER_PATTERN = "^-?[0-9]+(\\.[0-9]+)?([eE][+-]?[0-9]+)?$"
# An ISO 8601 time with a UTC offset, 2001..2098 (inside EPOCH_LOW..EPOCH_HIGH whatever the offset).
TIME_PATTERN = (
    "^20(0[1-9]|[1-8][0-9]|9[0-8])-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])[T ]([01][0-9]|2[0-3]):[0-5][0-9]"
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
LEASE_ID_RE = _regex(LEASE_ID_PATTERN)

# ---- validators of single values -------------------------------------------------------------------


def check_name(kind: str, value: object) -> str:
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


def check_lease_id(kind: str, value: str | None) -> str | None:
    """A lease or request id named in a query string (``?lease=``, ``?id=``)."""
    if value is not None and not LEASE_ID_RE.search(value):
        raise errors.BadRequest(
            f"{kind} must be a lease or request id of 1 to 64 letters, digits, '.', '_' or '-' "
            f"(e.g. l-0123456789abcdef), got {value!r}"
        )
    return value


def check_since(since: str) -> str:
    """An event id Redis accepts as an exclusive start: digits, each part below 2**64 - 1 (or '-')."""
    if not matches(SINCE_PATTERN, since):
        raise errors.BadRequest(f"since must be an event id like 1700000000000-0 (or '-'), got {since!r}")
    return since


def parse_time(kind: str, value: object) -> int:
    """Epoch seconds (a number) or ISO 8601 with a UTC offset, to UTC milliseconds (the bookings' rule)."""
    from .reservations import parse_time as booking_time  # reservations imports this module

    return booking_time(kind, value)


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
