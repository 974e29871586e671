"""Every JSON request body of the API but the acquire request (``lease_server.request``, a typed
object): each field's name, JSON type, bounds, pattern and description, declared once
(:class:`Body`, :class:`Field`). ``web/openapi.py`` generates the OpenAPI schemas from them, and the
API checks every request against the same declarations (unknown fields, types, bounds, patterns,
enums, required fields; :mod:`.schema` interprets them) before anything changes.

What JSON Schema cannot say (a booking's end after its start, ...) is listed in each body's
``rules``, which the document shows in the body's description; those are refused with a 400 as
well, by the code that owns them (the lease store, the bookings).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from .. import errors
from ..config import Settings
from ..protocol import ROLES
from ..request import REQUEST_ID_PATTERN, TEXT_PATTERN
from .schema import (
    GPUS,
    LEASE_ID,
    NAME,
    TIME,
    TOKEN,
    VERIFIED_TEXT,
    conform,
    normalize,
    nullable,
    text,
)
from .values import (
    MAX_GPUS_PER_NODE,
    MAX_MB,
    MAX_OCCURRENCES,
    MAX_PID,
    OWNER_PATTERN,
    REPEATS,
    check_gpu_sample,
    check_gpus,
    check_name,
    check_owner,
    check_seconds,
    check_text,
    check_time,
    check_token,
    request_ids,
)

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


# A proxy token's acts_for (web/auth.py check_acts_for reads it the same way).
ACTS_FOR_ENTRY = r"[A-Za-z0-9._*?\[\]!-]{1,64}"
ACTS_FOR_PATTERN = rf"^(re:.+|{ACTS_FOR_ENTRY}(,{ACTS_FOR_ENTRY})*)$"
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
    "uids": {
        "type": "array",
        "maxItems": 1000,
        "items": {"type": "integer", "minimum": -1, "maximum": 2**32 - 1},
        "description": "the owner (uid) of each of procs, in their order; -1 where the agent could not tell",
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
        "user": {**text("the process's owner"), "maxLength": 64},
        "signal": {"enum": ["SIGTERM", "SIGKILL"]},
        "grace_s": {"type": "number", "minimum": 0, "maximum": 3600, "description": "SIGTERM: SIGKILL after this"},
        "error": text("why the signal could not be sent (e.g. permission denied)"),
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
    """Every JSON request body of the API but the acquire request, for one server's settings (its
    TTL limit)."""

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
    memory: Body
    warm: Body
    suspend: Body

    def all(self) -> list[Body]:
        return [getattr(self, name) for name in self.__dataclass_fields__]


def bodies(settings: Settings | None = None) -> Bodies:
    if settings is None:
        settings = Settings()
    return _bodies(settings.max_ttl)


@lru_cache(maxsize=8)
def _bodies(max_ttl: float) -> Bodies:
    reason = Field(
        "reason",
        nullable(text("Why (shown to the lease's owner and in the event log)")),
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
        Field("note", nullable(text()), check=lambda v: check_text("note", v)),
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
                    check=request_ids,
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
        suspend=Body(
            "SuspendRequest",
            (LEASE_TOKEN,),
            description="Hand back your warm one-GPU lease with its worker suspended to host memory",
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
                Field("exempt_users", {"type": "array", "items": text()}, check=_names("exempt_users")),
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
            rules=("uids that are not one per process of procs",),
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
            rules=(
                "a GPU the node does not have",
                "a node whose GPUs are real (NVML)",
                "uids that are not one per process of procs",
            ),
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
                Field(
                    "account",
                    {
                        "type": "string",
                        "maxLength": 32,
                        "description": "The claiming process's unix account, as its host names it (multi_user)",
                    },
                ),
            ),
            rules=(
                "a node the lease does not hold GPUs on",
                "a GPU of that node the lease does not hold",
                "under multi_user, an account other than the lease owner's",
            ),
        ),
        memory=Body(
            "MemoryReport",
            (
                Field(
                    "measured",
                    {
                        "type": "object",
                        "maxProperties": 10000,
                        "propertyNames": LEASE_ID,
                        "additionalProperties": {
                            "type": "array",
                            "minItems": 2,
                            "maxItems": 2,
                            "items": {"type": "integer", "minimum": 0, "maximum": MAX_MB},
                        },
                        "description": "Lease id -> [MB its processes use now, their peak], as the agent measured",
                    },
                ),
                Field(
                    "over",
                    {
                        "type": "array",
                        "maxItems": 1000,
                        "items": {
                            "type": "object",
                            "additionalProperties": False,
                            "required": ["lease", "what", "used_mb"],
                            "properties": {
                                "lease": LEASE_ID,
                                "what": {"enum": ["warn", "end"], "description": "warn: just went over; end"},
                                "used_mb": {"type": "integer", "minimum": 0, "maximum": MAX_MB},
                                "peak_mb": {"type": "integer", "minimum": 0, "maximum": MAX_MB},
                                "over_s": {"type": "number", "minimum": 0, "maximum": 86400},
                            },
                        },
                        "description": "Slices over their memory: warned, or ended (still over after the grace)",
                    },
                ),
                Field(
                    "per_gpu",
                    {
                        "type": "boolean",
                        "description": "The agent measured each lease on its most used GPU, against limit_mb per GPU "
                        "(agents before it added up a lease's GPUs: their reports of leases of several GPUs are "
                        "not acted on)",
                    },
                ),
            ),
            description="A remote node agent's pass over its node's leases' memory (GET /nodes/{node}/memory)",
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
