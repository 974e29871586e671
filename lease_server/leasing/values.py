"""Single values the API takes, each checked with a message that says what to fix: names, text,
seconds, GPU counts, fencing tokens, request and lease ids, event ids and types, times, owners,
one GPU sample.

Used by the lease store, the bookings, the inventory and the web layer alike; the JSON bodies
(:mod:`.bodies`) and query parameters (:mod:`.params`) call them for the fields whose message is
their own. The bounds and patterns of the acquire request are ``lease_server.request``'s.
"""

from __future__ import annotations

from datetime import datetime
from difflib import get_close_matches
from typing import Any

from .. import errors
from ..protocol import EventType
from ..request import (
    MAX_GPUS_PER_REQUEST,
    MAX_TEXT,
    NAME_MESSAGE,
    NAME_PATTERN,
    REQUEST_ID_PATTERN,
    TEXT_MESSAGE,
    matches,
    regex,
    unsafe_char,
)
from ..store.keys import NAME_RE

MAX_GPUS_PER_NODE = 4096
MAX_OCCURRENCES = 52
EVENT_LOG_MAX_LIMIT = 10_000  # the largest limit accepted; a page holds at most EVENT_LOG_PAGE_CAP
EVENT_LOG_PAGE_CAP = 1000
# 2000-01-01 .. 2100-01-01: a time outside is a unit mistake (milliseconds, or a duration).
EPOCH_LOW, EPOCH_HIGH = 946684800, 4102444800
USAGE_GROUPS = ("user", "team", "pool", "notebook")
SUMMARY_GROUPS = ("user", "team", "pool")  # (leasing/usage.py owns them)
REPEATS = ("none", "weekly")
# Memory sizes (MB) and process ids: far above any real one, and exact through Lua's numbers (a larger
# one would come back from a script as 1.1e+14 and break every reader of the node's samples).
MAX_MB = MAX_PID = 2**31 - 1

# ---- patterns: ECMA-262 and Python read them alike (ASCII classes, anchored at both ends) ------------

OWNER_PATTERN = "^(team:)?[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"
# Any lease id the routes accept (ids made by older clients may be shorter than a request id).
LEASE_ID_PATTERN = "^[A-Za-z0-9._-]{1,64}$"
# An event id Redis accepts as an exclusive start: each part below 2**64 - 1, so at most 19 digits.
SINCE_PATTERN = "^(-|[0-9]{1,19}(-[0-9]{1,19})?)$"
# A fencing token's digits: epoch x 10^9 + a count (lua/_lib_schedule.lua next_token), well
# within 19 digits; a longer string is no token of ours, refused before anything reads it.
DIGITS_PATTERN = "^[0-9]{1,19}$"
TOKEN_MAX = 10**19 - 1
NUMBER_PATTERN = "^-?[0-9]+(\\.[0-9]+)?([eE][+-]?[0-9]+)?$"
# An ISO 8601 time with a UTC offset, years 2000..2098.
TIME_PATTERN = (
    "^20(0[0-9]|[1-8][0-9]|9[0-8])-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])[T ]([01][0-9]|2[0-3]):[0-5][0-9]"
    "(:[0-5][0-9](\\.[0-9]{1,6})?)?(Z|[+-]([01][0-9]|2[0-3]):?[0-5][0-9])$"
)


assert NAME_RE.pattern == NAME_PATTERN, "keys.NAME_RE and request.NAME_PATTERN must say the same"
REQUEST_ID_RE = regex(REQUEST_ID_PATTERN)
LEASE_ID_RE = regex(LEASE_ID_PATTERN)

# ---- validators of single values -------------------------------------------------------------------


def check_printable(kind: str, value: object) -> None:
    """Refuse (400) a string holding a control or bidi formatting character, naming its code point."""
    if isinstance(value, str) and (why := unsafe_char(kind, value)) is not None:
        raise errors.BadRequest(why)


def check_name(kind: str, value: object) -> str:
    check_printable(kind, value)
    if not isinstance(value, str) or not matches(NAME_PATTERN, value):
        raise errors.BadRequest(f"{kind} {NAME_MESSAGE}, got {value!r}")
    return value


def check_text(kind: str, value: object) -> str:
    if value is None:
        return ""
    if not isinstance(value, str) or len(value) > MAX_TEXT:
        raise errors.BadRequest(f"{kind} {TEXT_MESSAGE}")
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


def check_token(token: object, *, required: bool) -> str:
    """A fencing token (an integer, or its digits as a string); "" when absent and not required."""
    if token is None or token == "":
        if required:
            raise errors.BadRequest("token is required: pass the fencing token of your grant")
        return ""
    if (
        isinstance(token, bool)
        or not isinstance(token, (int, str))
        or (isinstance(token, int) and not 0 <= token <= TOKEN_MAX)
        or (isinstance(token, str) and not matches(DIGITS_PATTERN, token))
    ):
        shown = repr(token) if len(repr(token)) <= 40 else repr(token)[:37] + "..."
        raise errors.BadRequest(f"token must be the integer fencing token of your grant, got {shown}")
    return str(int(token))


def check_request_id(value: object) -> str | None:
    if value is not None and (not isinstance(value, str) or not REQUEST_ID_RE.search(value)):
        raise errors.BadRequest("id must be 8 to 64 letters, digits, '.', '_' or '-' (a random request id)")
    return value


def request_ids(value: object) -> list[str]:
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
    out = {"index": idx, "util": util, "mem_mb": mem, "procs": procs}
    if "uids" in g:
        uids = g["uids"]
        if (
            not isinstance(uids, list)
            or len(uids) != len(procs)
            or not all(isinstance(u, int) and not isinstance(u, bool) and -1 <= u < 2**32 for u in uids)
        ):
            raise errors.BadRequest("uids must list the owner (uid, or -1) of each of procs, in their order")
        out["uids"] = uids
    return out
