"""Query parameters and request headers: each declared once (:class:`Param`: what the OpenAPI
document shows, and how the server reads the raw text), and the parsing of flags, integers and
times from a query string.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import errors
from ..request import MAX_GPU_MEM_MB, MAX_NODES, matches
from .schema import GPUS, LEASE_ID, NAME, TIME, VERIFIED_TEXT, conform, text
from .values import (
    DIGITS_PATTERN,
    EVENT_LOG_MAX_LIMIT,
    EVENT_LOG_PAGE_CAP,
    EVENT_TYPES_PATTERN,
    NUMBER_PATTERN,
    SINCE_PATTERN,
    SUMMARY_GROUPS,
    TOKEN_MAX,
    USAGE_GROUPS,
    check_before,
    check_event_types,
    check_lease_id,
    check_name,
    check_since,
    check_text,
    check_time,
)

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


# ---- query parameters and headers ---------------------------------------------------------------------

BOOL_NOTE = " (1/0, yes/no and on/off read the same)"
ALL = Param("all", {"type": "boolean"}, "Everyone's live leases (without their tokens)" + BOOL_NOTE)
DRY_RUN = Param(
    "dry_run", {"type": "boolean"}, "Only check: answer {fits, node} or the 409 clash, and store nothing" + BOOL_NOTE
)
POOL = Param("pool", NAME, "Only this pool", parse=lambda raw: check_name("pool", raw))
CLUSTER_POOL = Param(
    "pool", NAME, "Only this pool's nodes (the counts stay every pool's)", parse=lambda raw: check_name("pool", raw)
)
CLUSTER_AFTER = Param(
    "after",
    NAME,
    "Only the nodes whose names sort after this one: the answer's `next`, for the next page",
    parse=lambda raw: check_name("after", raw),
)
CLUSTER_MAX_NODES = 100_000
CLUSTER_LIMIT = Param(
    "limit",
    {"type": "integer", "minimum": 0, "maximum": CLUSTER_MAX_NODES},
    "At most this many nodes (default: all of them); 0: the counts only",
    parse=lambda raw: parse_int("limit", raw, low=0, high=CLUSTER_MAX_NODES),
)
FROM = Param(
    "from",
    TIME,
    "Start of the window: epoch seconds or ISO 8601 with an offset (of a date that exists)",
    parse=lambda raw: parse_time_arg("from", raw),
)
TO = Param("to", TIME, "End of the window (exclusive)", parse=lambda raw: parse_time_arg("to", raw))
BY = Param("by", {"enum": list(USAGE_GROUPS)}, "How to group (default user)")
SUMMARY_BY = Param(
    "by",
    {"enum": list(SUMMARY_GROUPS)},
    "How to group `groups` (default user); by team a user of two teams counts in both",
)
SUMMARY_ALSO_BY = Param(
    "also_by",
    {"enum": list(SUMMARY_GROUPS)},
    "Also group the same rows this way, in `also` (the usage page's per-pool series beside its per-user ones, "
    "in one request)",
)
SUMMARY_USER = Param(
    "user",
    NAME,
    "Only this user's rows (a user with no usage in the window is a 400 naming those with usage, unless it is "
    "oneself or, to an admin, a user with a token)",
    parse=lambda raw: check_name("user", raw),
)
EST_GPUS = Param("gpus", GPUS, "Default: the queued request's GPUs (with `lease`), else 1")
EST_GPU_MEM = Param(
    "gpu_mem_mb",
    {"type": "integer", "minimum": 1, "maximum": MAX_GPU_MEM_MB},
    "A slice of this many MB on each of `gpus` GPUs (only in a pool that shares). Default: the queued request's "
    "(with `lease`), else whole GPUs",
)
EST_NODES = Param(
    "nodes",
    {"type": "integer", "minimum": 1, "maximum": MAX_NODES},
    "A gang: `gpus` / `nodes` GPUs on each of that many nodes (422 when too few nodes of the pool have that "
    "many). Default: the queued request's (with `lease`), else 1",
)
EST_POOL = Param(
    "pool",
    NAME,
    "Default: the queued request's pool (with `lease`), else the default pool",
    parse=lambda raw: check_name("pool", raw),
)
LEASE = Param(
    "lease",
    LEASE_ID,
    "Only events whose `lease` field is this lease (or queued request) id, filtered by the server",
    parse=lambda raw: check_lease_id("lease", raw),
)
CHANGES = Param(
    "changes",
    {"type": "boolean"},
    "Instead of each event, one `changed` event for many: at once after a quiet spell, then at most one every "
    "0.5 s, with the `types` of the events it stands for, their count (`events`) and the newest one's `id`. For a "
    "view that refetches what it shows (the JupyterLab board). A backlog is not replayed (`since` and "
    "Last-Event-ID are ignored): a reader that reconnects refetches. Not with `lease`" + BOOL_NOTE,
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
        shown = repr(raw) if len(raw) <= 40 else repr(raw[:36] + "...")
        raise errors.BadRequest(f"token must be the integer fencing token of your grant, got {shown}")
    return int(raw)


TOKEN_ARG = Param(
    "token",
    {"type": "integer", "minimum": 0, "maximum": TOKEN_MAX},
    "The fencing token (as the body's `token`)",
    parse=_token_arg,
)
VERIFIED_ARG = Param("verified", {"type": "boolean"}, VERIFIED_TEXT + BOOL_NOTE)
REASON_ARG = Param(
    "reason",
    text(),
    "Why (as the body's `reason`), e.g. kernel shut down",
    parse=lambda raw: check_text("reason", raw),
)
DRAIN_WAIT_MAX = 60  # seconds a node agent's GET /nodes/{node}/draining may wait for a drain
DRAIN_WAIT = Param(
    "wait",
    {"type": "integer", "minimum": 0, "maximum": DRAIN_WAIT_MAX},
    "Seconds to wait, while the node has no draining GPU, for a change on the node (a long-poll): the "
    "answer comes as soon as one happens, else after this long (at most the server's max_wait), with what "
    "drains then (default 0: at once)",
)
