"""The OpenAPI 3.1 document of the HTTP API, served at /api/v1/openapi.json.

Request bodies and query parameters are not written here: they are generated from their one
declaration, against which the server also checks every request: the acquire request in
:mod:`lease_server.request`, the other bodies in :mod:`lease_server.leasing.bodies`, the query
parameters in :mod:`lease_server.leasing.params`.
Every status an operation can answer is listed: the operation's own, plus those any request may
get (a bad ``X-Gpulease-User`` or token, a body over the limit, Redis away, a path parameter of the
wrong shape).
"""

from __future__ import annotations

import enum
import typing
from typing import Annotated, Any, NotRequired, Required, get_args, get_origin, get_type_hints, is_typeddict

from .. import __version__, protocol
from ..config import Settings
from ..leasing import bodies as request_bodies
from ..leasing import params
from ..leasing.bodies import Bodies, Body
from ..leasing.params import Param
from ..leasing.schema import NAME
from ..leasing.values import LEASE_ID_PATTERN
from ..protocol import ENDED_STATES, EndCauseJson, GpuJson, LeaseJson, TokenJson
from ..request import AcquireRequest, Request

# What the board says of a GPU (lease_server/leasing/inventory.py).
GPU_STATES = ["free", "leased", "warm", "reserved", "borrowed", "draining", "sliced", "down"]


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def schema_of_record(record: type, refs: dict[type, str] | None = None) -> dict[str, Any]:
    """The JSON schema of a record declared as a TypedDict in :mod:`lease_server.protocol`: its
    fields, which of them are required, its docstring and each Annotated field's description.
    A record named in ``refs`` is a reference to that component, any other one is written inline."""
    refs = refs or {}
    hints = get_type_hints(record, include_extras=True)
    props = {name: _schema_of(t, refs) for name, t in hints.items()}
    out: dict[str, Any] = {"type": "object", "description": " ".join((record.__doc__ or "").split())}
    # (read from the hints: with postponed annotations, __required_keys__ cannot see Required[...])
    total = getattr(record, "__total__", True)
    required = [n for n, t in hints.items() if _required(get_origin(t), total)]
    if required:
        out["required"] = required
    out["properties"] = props
    return out


def _required(origin: Any, total: bool) -> bool:
    return origin is Required or (total and origin is not NotRequired)


def _schema_of(t: Any, refs: dict[type, str]) -> dict[str, Any]:
    origin, args = get_origin(t), get_args(t)
    if origin in (Required, NotRequired):
        return _schema_of(args[0], refs)
    if origin is Annotated:
        return {**_schema_of(args[0], refs), "description": " ".join(str(args[1]).split())}
    if t in refs:
        return _ref(refs[t])
    if is_typeddict(t):
        return schema_of_record(t, refs)
    if isinstance(t, type) and issubclass(t, enum.Enum):
        return {"type": "string", "enum": [m.value for m in t]}
    if origin is list:
        return {"type": "array", "items": _schema_of(args[0], refs)}
    if origin is dict or t is typing.Any:
        return {"type": "object"}
    simple = {str: "string", int: "integer", float: "number", bool: "boolean"}
    if t in simple:
        return {"type": simple[t]}
    raise TypeError(f"no JSON schema for {t!r}: add it to openapi._schema_of")


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


ERRORS = {
    400: "Bad input: the message says what to fix",
    401: "No, unknown, revoked or expired API token",
    403: "Not allowed for this user (or X-Gpulease-User sent without a proxy token, a proxy token without it or "
    "for a user it may not act for, or an agent token on another node's route)",
    404: "No such lease, booking, pool or node (or a path parameter of another shape)",
    409: "Conflict: stale token, lease ended, booking clash, or no capacity in time",
    410: "Withdrawn: the queued request was withdrawn (DELETE) before a grant; it will never be granted",
    413: "Body too large (over max_body_bytes): answered before the body is read, and the connection closed",
    422: "No node of the pool could ever serve this request",
    429: "A per-user or per-token limit is reached (queued requests, event streams, event log reads at once, "
    "log entries or stream connections per second): the message gives the count and what to do, Retry-After "
    "when to retry",
    503: "Redis unreachable, failing over, loading or short of replicas: resend after Retry-After (nothing changed)",
}
# What any request may get: a malformed X-Gpulease-User (400), no token (401), X-Gpulease-User without
# a proxy token or a proxy token without it (403), a body over the limit (413), Redis away (503).
AUTHENTICATED = (400, 401, 403, 413, 503)
PUBLIC = (413, 503)


def _op(
    summary: str,
    ok: dict[str, Any],
    *codes: int,
    body: Body | type[Request] | None = None,
    params: list[dict[str, Any]] | tuple[Param, ...] = (),
    public: bool = False,
    ok_code: int = 200,
    more: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One operation: its answer, every error status it can give, its body and parameters."""
    statuses = sorted({*codes, *(PUBLIC if public else AUTHENTICATED)})
    if any(isinstance(p, dict) and p.get("in") == "path" for p in params):
        statuses = sorted({*statuses, 404})  # a path parameter that matches no route
    responses = {str(ok_code): ok, **(more or {}), **{str(c): _json(_ref("Error"), ERRORS[c]) for c in statuses}}
    op: dict[str, Any] = {"summary": summary, "responses": responses}
    if isinstance(body, Body):
        required = any(f.required for f in body.fields)  # else an empty body is a valid one
        op["requestBody"] = {"required": required, "content": {"application/json": {"schema": _ref(body.name)}}}
    elif body is not None:  # a typed request (lease_server.request): its schema is named after its class
        schema = _ref(body.__name__)
        op["requestBody"] = {"required": body.body_required(), "content": {"application/json": {"schema": schema}}}
    if params:
        op["parameters"] = [p.openapi() if isinstance(p, Param) else p for p in params]
    if public:
        op["security"] = []
    return op


def _path(name: str, schema: dict[str, Any], description: str = "") -> dict[str, Any]:
    out = {"name": name, "in": "path", "required": True, "schema": schema}
    if description:
        out["description"] = description
    return out


# The route's shape for ids (a lease id, or a request id of an older client).
LEASE_ID = _path("lease_id", {"type": "string", "pattern": LEASE_ID_PATTERN})
BOOKING_ID = _path("booking_id", NAME, "A booking id, e.g. r-1a2b3c4d5e6f")
RESERVATION_ID = _path("reservation_id", NAME, "A booking id, e.g. r-1a2b3c4d5e6f")  # deprecated paths
POOL = _path("pool", NAME)
NODE = _path("node", NAME)
TOKEN_ID = _path("token_id", {"type": "string", "pattern": "^[0-9a-f]{12}$"}, "A token's id (GET /tokens lists them)")
NUM = {"type": "number"}
# A GPU as a node agent declares it (also part of every GPU in the cluster view).
GPU_PROPS = {
    "index": {"type": "integer"},
    "uuid": {"type": "string"},
    "model": {"type": "string"},
    "memory_mb": {"type": "integer"},
}
ENDED = ", ".join(sorted(ENDED_STATES))


def _usage_schemas() -> dict[str, Any]:
    """What GET /usage/summary answers (docs/usage.md): figures, per day and in total."""
    num: dict[str, Any] = {"type": "number"}
    opt_num: dict[str, Any] = {"type": ["number", "null"]}
    count: dict[str, Any] = {"type": "integer"}
    figures: dict[str, tuple[dict[str, Any], str]] = {
        "calls": (count, "Leases that ended (each one's first cell)"),
        "cells": (count, "Cells run: calls + warm_cells"),
        "warm_cells": (count, "Cells that started on a warm worker"),
        "warm_cell_share": (opt_num, "warm_cells / cells (null: no cell)"),
        "held_gpu_s": (num, "GPU-seconds held, warm time excluded"),
        "sampled_gpu_s": (num, "Of held_gpu_s, those of leases the node agents sampled"),
        "used_gpu_s": (num, "GPU-seconds busy by the samples (idle: sampled_gpu_s - used_gpu_s)"),
        "util_pct": (opt_num, "100 x used_gpu_s / sampled_gpu_s (null: nothing sampled)"),
        "warm_gpu_s": (num, "GPU-seconds kept warm: lendable, not charged as use"),
        "reclaimed_gpu_s": (num, "GPU-seconds (held + warm) of leases taken back in use: reclaim, recall, preemption"),
        "evicted_gpu_s": (num, "GPU-seconds (held + warm) of warm leases lent out to a waiting request"),
        "waits": (count, "Waits counted (one per call; no wait counts as 0 ms)"),
        "wait_ms_sum": (num, "Their sum, ms"),
        "wait_mean_ms": (opt_num, "wait_ms_sum / waits (null: none)"),
        "wait_p50_ms": (opt_num, "Median wait, ms, within 1 % (null: none)"),
        "wait_p95_ms": (opt_num, "95th percentile wait, ms, within 1 % (null: none)"),
    }
    props = {name: {**schema, "description": text} for name, (schema, text) in figures.items()}
    day = {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$", "description": "A UTC day"}
    return {
        "UsageFigures": {
            "type": "object",
            "description": "Usage of the leases that ended in a period (every figure always present)",
            "required": list(figures),
            "properties": props,
        },
        "UsageDay": {
            "description": "One UTC day's figures",
            "allOf": [_ref("UsageFigures"), {"type": "object", "required": ["day"], "properties": {"day": day}}],
        },
        "UsageGroup": {
            "type": "object",
            "description": "One user, team or pool: its total and its day-by-day series (one entry per day of `days`)",
            "required": ["key", "total", "daily"],
            "properties": {
                "key": {"type": "string", "description": "The user, team ((no team) for none) or pool"},
                "total": _ref("UsageFigures"),
                "daily": {"type": "array", "items": _ref("UsageDay")},
            },
        },
        "UsageBalance": {
            "type": "object",
            "description": "The calling user's balance, a pool each",
            "required": ["user", "teams", "pools"],
            "properties": {
                "user": {"type": "string"},
                "teams": {"type": "array", "items": {"type": "string"}},
                "pools": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": [
                            "pool",
                            "quota",
                            "held",
                            "left",
                            "scheduler",
                            "fair_share",
                            "next_wait_s",
                            "next_wait",
                            "text",
                        ],
                        "properties": {
                            "pool": {"type": "string"},
                            "quota": {"type": ["integer", "null"], "description": "GPUs at once (null: no quota)"},
                            "held": {"type": "number", "description": "GPUs held now (a slice: its fraction)"},
                            "left": {"type": ["number", "null"], "description": "quota - held (null: no quota)"},
                            "scheduler": {"type": "string"},
                            "fair_share": {
                                "type": "object",
                                "required": ["rank", "of", "usage_gpu_s"],
                                "description": "rank 1 of `of`: the least recent use, served first among waiters",
                                "properties": {
                                    "rank": {"type": "integer"},
                                    "of": {"type": "integer"},
                                    "usage_gpu_s": {"type": "number", "description": "Decayed GPU-seconds"},
                                },
                            },
                            "next_wait_s": {"type": ["number", "null"], "description": "A 1-GPU cell's wait now"},
                            "next_wait": {"type": ["string", "null"], "description": "The same in words"},
                            "text": {
                                "type": "string",
                                "description": "The balance in a short line, e.g. 1 of 4 GPUs yours, 3 left; 3rd of "
                                "9 in fair share; next cell: about 40 s",
                            },
                        },
                    },
                },
            },
        },
        "UsageSummary": {
            "type": "object",
            "description": "GET /usage/summary: the window, its totals and day-by-day series, overall and per group "
            "(largest held + warm first). A lease's GPU time is spread over the hours it was held; the lease, its "
            "wait and warm cells count in the hour it was granted; a lease still held is in no row yet",
            "required": ["from", "to", "by", "pool", "user", "scope", "days", "total", "daily", "groups"],
            "properties": {
                "from": {"type": "number", "description": "Start (epoch seconds, on the hour)"},
                "to": {"type": "number", "description": "End, exclusive (epoch seconds, on the hour)"},
                "by": {"type": "string", "enum": ["user", "team", "pool"]},
                "pool": {"type": ["string", "null"], "description": "The pool asked for (null: all)"},
                "user": {"type": ["string", "null"], "description": "The user whose rows these are (null: all)"},
                "scope": {
                    "type": "string",
                    "enum": ["all", "own"],
                    "description": "own: the server shows this user only their own rows (usage_own_rows_only)",
                },
                "days": {"type": "array", "items": day, "description": "The UTC days the window touches, in order"},
                "total": _ref("UsageFigures"),
                "daily": {"type": "array", "items": _ref("UsageDay")},
                "groups": {"type": "array", "items": _ref("UsageGroup")},
                "also": {
                    "type": "object",
                    "description": "Only with `also_by`: the same rows grouped that way",
                    "required": ["by", "groups"],
                    "properties": {
                        "by": {"type": "string", "enum": ["user", "team", "pool"]},
                        "groups": {"type": "array", "items": _ref("UsageGroup")},
                    },
                },
            },
        },
    }


def _response_schemas() -> dict[str, Any]:
    num = NUM
    return {
        "Error": {
            "type": "object",
            "required": ["code", "message"],
            "properties": {"code": {"type": "string"}, "message": {"type": "string"}, "details": {"type": "object"}},
        },
        "Gpu": schema_of_record(GpuJson),
        **_usage_schemas(),
        "Token": schema_of_record(TokenJson),
        "NewToken": {
            "description": "A token just made: the Token, and its secret (shown this once, stored only hashed)",
            "allOf": [
                _ref("Token"),
                {"type": "object", "required": ["token"], "properties": {"token": {"type": "string"}}},
            ],
        },
        "Lease": schema_of_record(LeaseJson, {GpuJson: "Gpu", EndCauseJson: "EndCause"}),
        "EndCause": schema_of_record(EndCauseJson),
        "EndedLease": {
            "description": "What a release or revoke answers: the lease, ended (`changed` is false when it had "
            "ended already); or the withdrawn request, when the id named a request still waiting in the queue",
            "oneOf": [_ref("Lease"), _ref("Withdrawal")],
        },
        "LeaseList": {"type": "object", "properties": {"leases": {"type": "array", "items": _ref("Lease")}}},
        "Cluster": {
            "type": "object",
            "properties": {
                "now": num,
                "as_of_event": {
                    "type": "string",
                    "description": "The id of the newest event this view holds (GET /events?since= resumes there)",
                },
                "nodes_total": {"type": "integer", "description": "The nodes of the pool asked (all: every node)"},
                "next": {
                    "type": ["string", "null"],
                    "description": "Pass as `after` for the next page of nodes; null on the last (and with limit 0)",
                },
                "default_pool": {"type": ["string", "null"]},
                "cpu_pool": {"type": ["string", "null"], "description": "The pool of CPU slots, if one is registered"},
                "pools": {"type": "object", "additionalProperties": _ref("PoolCounts")},
                "nodes": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "name": {"type": "string"},
                            "pool": {"type": "string"},
                            "source": {"type": "string", "description": "Where its GPUs come from: nvml, simulated"},
                            "isolation": {"type": "string"},
                            "state": {"type": "string", "enum": ["up", "down"]},
                            "suspend": {
                                "type": "string",
                                "description": "How its agent suspends evicted warm workers to host memory "
                                "(simulated, cuda); absent: they are ended",
                            },
                            "suspended": {
                                "type": "array",
                                "description": "Its suspended workers (suspended · on host), oldest first: user, "
                                "lease (the one they left), bytes (GPU state on host), since, until (ended then)",
                                "items": {"type": "object"},
                            },
                            "heartbeat_deadline": {"type": ["number", "null"]},
                            "gpus": {"type": "array", "items": _ref("BoardGpu")},
                        },
                    },
                },
            },
        },
        "PoolCounts": {
            "type": "object",
            "description": "A pool's GPUs counted by state (a GPU shared by slices counts as sliced), its "
            "live slices, the memory of its sliced GPUs on nodes up that no slice holds (unpromised_mb, MB), "
            "and, where its GPUs may be sliced (share), the unit a slice is rounded up to",
            "properties": {
                **{c: {"type": "integer"} for c in ("gpus", "nodes", "slices", "unpromised_mb", *GPU_STATES)},
                "kind": {"type": "string", "enum": ["gpu", "cpu"]},
                "share": {"type": "boolean"},
                "slice_unit_mb": {"type": "integer"},
            },
        },
        "BoardGpu": {
            "type": "object",
            "description": "A GPU on the board: as its agent declares it, its state and who holds it",
            "properties": {
                **GPU_PROPS,
                "state": {"type": "string", "enum": GPU_STATES},
                "lease": _ref("BoardHolder"),
                "reservation": {
                    "type": "object",
                    "description": "The booking a reserved GPU is held back for",
                    "properties": {
                        "id": {"type": "string"},
                        "owner": {"type": "string"},
                        "note": {"type": "string"},
                        "end": {**num, "description": "When the booking's occurrence in force ends"},
                    },
                },
                "sample": {
                    "type": "object",
                    "description": "Its node agent's newest sample",
                    "properties": {"at": num, "util": num, "mem_used_mb": {"type": "integer"}},
                },
                "draining": {
                    "type": "object",
                    "description": "The server ended its lease: free once its agent sees that lease's processes gone",
                    "properties": {
                        "lease": {"type": "string"},
                        "user": {"type": "string"},
                        "state": {"type": "string"},
                        "since": num,
                        "abandoned": {
                            "type": "object",
                            "properties": {"pid": {"type": ["integer", "null"]}, "why": {"type": ["string", "null"]}},
                        },
                    },
                },
                "unleased_use": {
                    "type": "object",
                    "description": "Processes on it that no live lease covers",
                    "properties": {"pids": {"type": "array", "items": {"type": "integer"}}, "since": num},
                },
                "slices": {
                    "type": "array",
                    "description": "A sliced GPU's live slices, largest first",
                    "items": _ref("Slice"),
                },
                "slices_draining": {
                    "type": "array",
                    "description": "A sliced GPU's slices that the server ended: their memory stays promised "
                    "until their processes are gone",
                    "items": {
                        "type": "object",
                        "properties": {
                            "lease": {"type": "string"},
                            "user": {"type": "string"},
                            "gpu_mem_mb": {"type": "integer"},
                            "since": num,
                        },
                    },
                },
                "slice_mem": {
                    "type": "object",
                    "description": "A sliced GPU's memory: its size, what its slices (live and draining) are "
                    "promised, and what is left for another slice",
                    "properties": {
                        "total_mb": {"type": "integer"},
                        "used_mb": {"type": "integer"},
                        "free_mb": {"type": "integer"},
                    },
                },
            },
        },
        "BoardHolder": {
            "type": "object",
            "description": "The lease that holds a GPU whole",
            "properties": {
                "id": {"type": "string"},
                "user": {"type": "string"},
                "label": {"type": "string"},
                "since": num,
                "expires_at": num,
                "ttl": {**num, "description": "Each renewal pushes expires_at this far"},
                "ends_by": {**num, "description": "Its holder means to end it by then (a cell's --timeout)"},
                "idle_warning": {"type": "boolean"},
                "reclaim_at": num,
                "notebook": {"type": "string"},
                "cell": {"type": "string"},
                "reservation": {"type": "string", "description": "The booking it is served from"},
                "borrowed": {"type": "boolean"},
                "recall_at": num,
                "recall_for": {"type": "string", "description": "Being recalled: whose request its GPUs go to"},
                "warm_since": num,
                "mem_used_mb": {
                    "type": "integer",
                    "description": "Its processes' GPU memory now, as its node agent measured it (pools that share)",
                },
                "mem_peak_mb": {"type": "integer", "description": "... and at their peak"},
                "shrink_to": {"type": "integer"},
                "shrink_by": num,
            },
        },
        "Slice": {
            "type": "object",
            "description": "A slice of a GPU: its lease, holder and the memory it is promised; what its processes "
            "use now and at their peak, once its node agent measured them; since when it is warm (its worker "
            "kept for its notebook's next cell, lent out if someone waits), and when it is taken back if it is "
            "being evicted or recalled",
            "properties": {
                "lease": {"type": "string"},
                "user": {"type": "string"},
                "label": {"type": "string"},
                "gpu_mem_mb": {"type": "integer"},
                "since": num,
                "expires_at": num,
                "ttl": num,
                "ends_by": num,
                "mem_used_mb": {"type": "integer"},
                "mem_peak_mb": {"type": "integer"},
                "warm_since": num,
                "recall_at": num,
            },
        },
        "Queue": {"type": "object", "properties": {"waiting": {"type": "array", "items": {"type": "object"}}}},
        "Withdrawal": {
            "type": "object",
            "required": ["id", "user", "pool", "gpus", "state", "changed"],
            "properties": {
                "id": {"type": "string"},
                "user": {"type": "string"},
                "pool": {"type": "string"},
                "gpus": {"type": "integer"},
                "state": {"type": "string", "enum": ["withdrawn"]},
                "label": {"type": "string"},
                "session": {"type": "string"},
                "position": {"type": "integer", "description": "Its place in the pool's queue when withdrawn"},
                "enqueued_at": num,
                "end_reason": {"type": "string"},
                "ended_by": {"type": "string"},
                "changed": {"type": "boolean"},
            },
        },
        "Event": {
            "type": "object",
            "required": ["id", "type"],
            "properties": {
                "id": {"type": "string", "description": "The log entry's id: resume after it with since"},
                "type": {"type": "string"},
                "ts": {"type": ["number", "null"], "description": "When (epoch seconds); null if not recorded"},
                "reservation": {"type": "string", "description": "A booking event's booking id"},
            },
        },
        "Booking": {
            "type": "object",
            "description": "A booking; a cancelled one stays readable (state cancelled) for a while",
            "properties": {
                "id": {"type": "string"},
                "owner": {"type": "string"},
                "pool": {"type": "string"},
                "gpus": {"type": "integer"},
                "start": num,
                "end": num,
                "repeat": {"type": "string"},
                "occurrences": {"type": "integer"},
                "colocate": {"type": "boolean"},
                "node": {"type": "string"},
                "note": {"type": "string"},
                "state": {"enum": ["active", "cancelled"]},
                "held": {"type": "integer", "description": "GPUs its holders lease from it now"},
                "mine": {"type": "boolean", "description": "The caller may change it"},
                "instances": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "k": {"type": "integer"},
                            "start": num,
                            "end": num,
                            "state": {"enum": ["upcoming", "active", "released", "past"]},
                            "used": {"type": "boolean"},
                        },
                    },
                },
            },
        },
        "ServerSentEvent": {
            "type": "object",
            "description": "One event of the stream (OpenAPI 3.1: the schema describes each event)",
            "properties": {
                "event": {"type": "string"},
                "id": {"type": "string"},
                "data": {"type": "string", "contentMediaType": "application/json", "contentSchema": _ref("Event")},
                "retry": {"type": "integer"},
            },
        },
        "BookingCheck": {
            "type": "object",
            "description": "The answer of a dry run: whether the booking fits, and on which node (colocate)",
            "properties": {"fits": {"type": "boolean"}, "node": {"type": ["string", "null"]}},
        },
    }


def _booking_paths(bodies: Bodies, base: str, id_param: dict[str, Any], listed_as: str) -> dict[str, Any]:
    """The bookings' operations under ``base`` (its id parameter ``id_param``, GET's list ``listed_as``)."""
    one = "{" + id_param["name"] + "}"
    return {
        base: {
            "post": _op(
                "Book GPUs of a pool for a window (409 names clashing bookings and windows that fit)",
                _json(_ref("Booking"), "Booked"),
                403,
                404,
                409,
                422,
                body=bodies.booking,
                params=(params.DRY_RUN,),
                ok_code=201,
                more={"200": _json(_ref("BookingCheck"), "dry_run: it fits")},
            ),
            "get": _op(
                "Everyone's bookings with an occurrence in [from, to) (default: the last day to 14 days ahead; "
                "to after from, at most 366 days later)",
                _json(
                    {"type": "object", "properties": {listed_as: {"type": "array", "items": _ref("Booking")}}},
                    "Bookings",
                ),
                params=(params.POOL, params.FROM, params.TO),
            ),
        },
        f"{base}/{one}": {
            "get": _op("One booking", _json(_ref("Booking"), "Booking"), params=[id_param]),
            "patch": _op(
                "Change a booking (owner, team member or admin; fields not given stay)",
                _json({"anyOf": [_ref("Booking"), _ref("BookingCheck")]}, "Changed (dry_run: it fits)"),
                409,
                422,
                body=bodies.booking_change,
                params=[id_param, params.DRY_RUN.openapi()],
            ),
            "delete": _op("Cancel a booking", _json(_ref("Booking"), "Cancelled"), params=[id_param]),
        },
        f"{base}/{one}/end": {
            "post": _op(
                "End the occurrence in force now: its GPUs go back to the pool",
                _json(_ref("Booking"), "Ended"),
                409,
                params=[id_param],
            )
        },
    }


# RFC 9745: a deprecated resource's answers carry Deprecation (a Structured Field Date, "@" and
# epoch seconds: since when), RFC 8594's Sunset (an HTTP-date: when it stops answering) and, here,
# a Link to the path that succeeds it.
DEPRECATION_HEADERS = {
    "Deprecation": {
        "description": "RFC 9745: this path is deprecated since this date (a Structured Field Date)",
        "schema": {"type": "string", "pattern": "^@-?[0-9]+$"},
    },
    "Sunset": {
        "description": "RFC 8594: this path stops answering at this date (an HTTP-date); release "
        f"{protocol.REMOVED_IN} no longer has it",
        "schema": {"type": "string"},
    },
    "Link": {
        "description": 'The path that replaces it: <PATH>; rel="successor-version"',
        "schema": {"type": "string"},
    },
}


def _deprecated(paths: dict[str, Any], successor: str) -> dict[str, Any]:
    """``paths`` marked deprecated, every answer with the headers that name ``successor``."""
    for item in paths.values():
        for op in item.values():
            op["deprecated"] = True
            op["summary"] = f"Deprecated (gone in release {protocol.REMOVED_IN}), use {successor}: {op['summary']}"
            for response in op["responses"].values():
                response["headers"] = DEPRECATION_HEADERS
    return paths


def openapi_document(settings: Settings | None = None) -> dict[str, Any]:
    """The document; request bounds that are settings (max_ttl, max_wait) are ``settings``' own."""
    bodies = request_bodies.bodies(settings)
    schemas = _response_schemas()
    schemas[AcquireRequest.__name__] = AcquireRequest.schema(settings or Settings())
    for body in bodies.all():
        schemas[body.name] = body.schema()
    schemas["PoolPolicy"] = {
        "type": "object",
        "description": "A pool's reclaim policy in force",
        "properties": {"pool": {"type": "string"}, **schemas[bodies.policy.name]["properties"]},
    }
    v = params
    paths: dict[str, Any] = {
        **_booking_paths(bodies, "/api/v1/bookings", BOOKING_ID, "bookings"),
        # The paths of the first releases: the same operations, until release protocol.REMOVED_IN (deprecated).
        **_deprecated(
            _booking_paths(bodies, "/api/v1/reservations", RESERVATION_ID, "reservations"), "/api/v1/bookings"
        ),
        "/api/v1/usage": {
            "get": _op(
                "The usage ledger summed per user, team, pool or notebook over [from, to) (default: 7 days; "
                "to after from). With the server's usage_own_rows_only, a user who is not an admin gets the "
                'sums of their own leases only (scope "own")',
                _json({"type": "object"}, "Usage"),
                params=(v.BY, v.POOL, v.FROM, v.TO),
            )
        },
        "/api/v1/usage/summary": {
            "get": _op(
                "Per-day series and totals of GPU use over [from, to), overall and per user, team or pool, from the "
                "hourly rollups (default: the last 7 days). The window is widened to whole hours; days are UTC. "
                "With the server's usage_own_rows_only, a user who is not an admin gets only their own rows (and "
                "a 403 for another user's), and reads only those. 400: to not after from, a window over 400 days, "
                "an unknown pool or user (the message names what would work). The rows read count against the "
                "token's read budget, as GET /usage's lines do: 429 (with Retry-After) past it",
                _json(_ref("UsageSummary"), "UsageSummary"),
                429,
                params=(v.SUMMARY_BY, v.SUMMARY_ALSO_BY, v.POOL, v.SUMMARY_USER, v.FROM, v.TO),
            )
        },
        "/api/v1/usage/balance": {
            "get": _op(
                "The calling user's balance per pool (all pools, or `pool`): GPUs held now against their quota, "
                "their place in fair share and how long a 1-GPU cell would wait now; 400 for an unknown pool",
                _json(_ref("UsageBalance"), "UsageBalance"),
                params=(v.POOL,),
            )
        },
        "/api/v1/estimate": {
            "get": _op(
                "How long a request for gpus GPUs of pool would wait, and other pools free now",
                _json(
                    {"type": "object"},
                    'Estimate: `estimate_s`, `wait` (it in a few words: "about 40 s", "any moment now"; '
                    "null when no GPU of the pool is up), `text` (the reasoning in words), `queued_ahead` and "
                    "`queued_gpus_ahead` (requests strictly ahead of the asking one), `position` (its place "
                    "in the queue when `lease` names a queued request, else null), `held_gpus`, `free_now`, "
                    "`alternatives`. With nothing queued ahead, `text` says what it waits for: a running "
                    "lease's fixed end (recall or idle reclaim) when one is known, else the GPUs held by "
                    "running calls. A lease's known end bounds when it is expected back: a recall, an idle "
                    "reclaim, the end its holder declared (`ends_within` at the acquire, a cell's --timeout), "
                    "the deadline of a lease its holder no longer renews (nearer than half its ttl); a GPU "
                    "reserved for a booking in force is back at the booking's end. `holders`: who holds the "
                    "pool's GPUs, per user (`gpus`, `slices`, `booked`; `ends_in` seconds and `ends_at` of "
                    "their soonest known end, `end` what ends it: recall, reclaim, timeout, expiry or "
                    "booking; `expect_s`; `mine` for the asker's own), known ends first. "
                    "For a slice (`gpu_mem_mb`), `free_now` counts the GPUs it fits on now, "
                    "and the answer repeats `gpu_mem_mb`; a queued slice counts as its share of a GPU. 422 for "
                    "more GPUs than any node of the pool has (as the acquire answers)",
                ),
                400,
                404,
                422,
                params=(v.EST_POOL, v.EST_GPUS, v.EST_NODES, v.EST_GPU_MEM, v.EST_LEASE, v.EST_ID),
            )
        },
        "/api/v1/leases": {
            "post": _op(
                "Acquire GPUs (waits in the pool's queue up to `wait` seconds; "
                "DELETE /leases/{id} of its `id` withdraws it while it waits). 403: priority high from a "
                "user the server's high_priority setting does not name",
                _json(_ref("Lease"), "Granted"),
                403,
                404,
                409,
                410,
                422,
                429,
                body=AcquireRequest,
                ok_code=201,
            ),
            "get": _op(
                "My live leases (?all=true: everyone's, without tokens)",
                _json(_ref("LeaseList"), "Leases"),
                params=(v.ALL,),
            ),
        },
        "/api/v1/leases/{lease_id}": {
            "get": _op(
                "One lease, live or recently ended: a released, expired or revoked lease stays readable, "
                "with its final state, for the server's ended_retention",
                _json(_ref("Lease"), "The lease"),
                params=[LEASE_ID],
            ),
            "delete": _op(
                "Release (idempotent; an admin releasing another's lease revokes it), or withdraw a queued request",
                _json(
                    _ref("EndedLease"),
                    "The ended lease (`changed` is false if it had ended already; it stays readable with GET); "
                    "or, when `lease_id` is a request still waiting in the queue, a Withdrawal: the request left "
                    "the queue atomically, will never be granted, and its waiting POST /leases answers 410 "
                    "`withdrawn` at once. Only its owner or an admin may withdraw it (403 `not_owner`). A request "
                    "granted just before the DELETE is released as any lease. Withdrawing again is a 404: "
                    "nothing waits.",
                ),
                409,
                body=bodies.release,
                params=[LEASE_ID, v.TOKEN_ARG.openapi(), v.REASON_ARG.openapi(), v.VERIFIED_ARG.openapi()],
            ),
        },
        "/api/v1/leases/{lease_id}/renew": {
            "post": _op(
                "Renew with the lease's fencing token",
                _json(_ref("Lease"), "Renewed"),
                409,
                body=bodies.renew,
                params=[LEASE_ID],
            ),
        },
        "/api/v1/leases/{lease_id}/revoke": {
            "post": _op(
                "Revoke a lease, or withdraw a queued request (admin)",
                _json(_ref("EndedLease"), "Revoked (`changed` is false if it had ended already)"),
                body=bodies.revoke,
                params=[LEASE_ID],
            ),
        },
        "/api/v1/leases/{lease_id}/handoff": {
            "post": _op(
                "Hand your lease's GPUs to your own next queued request in one step (a sweep's next "
                "trial); refused (409, nothing changes) unless releasing could not have given them to "
                "anyone else: every waiter of the pool is yours and its oldest is one of those named",
                _json(
                    {
                        "type": "object",
                        "properties": {"ended": _ref("EndedLease"), "lease": _ref("Lease")},
                        "required": ["ended", "lease"],
                    },
                    "Handed over: the ended lease and the request's new lease",
                ),
                409,
                body=bodies.handoff,
                params=[LEASE_ID],
            ),
        },
        "/api/v1/leases/{lease_id}/grow": {
            "post": _op(
                "Add GPUs to your elastic lease (acquired with gpus_min below gpus), on its node, all or none, "
                "up to the gpus it asked for; the token stays. Refused (409 `conflict` with the reason, nothing "
                "changes) when anyone waits in the pool, a booking is in force there, the node lacks the free "
                "GPUs, the lease is a booking's, borrowed, preemptible, recalled or asked to shrink, or it would "
                "take you above your quota",
                _json(_ref("Lease"), "Grown: the lease with its new GPUs (the lowest free indexes of its node)"),
                409,
                body=bodies.grow,
                params=[LEASE_ID],
            ),
        },
        "/api/v1/leases/{lease_id}/shrink": {
            "post": _op(
                "Give back some GPUs of your lease (its highest-indexed ones); at least one stays: to give back "
                "all, release. The queue is served at once; the token stays. A lease asked to shrink "
                "(shrink_to, shrink_by) for a waiting request is shrunk by the server at shrink_by otherwise",
                _json(_ref("Lease"), "Shrunk: the lease with the GPUs it kept"),
                409,
                body=bodies.shrink,
                params=[LEASE_ID],
            ),
        },
        "/api/v1/leases/{lease_id}/warm": {
            "post": _op(
                "Keep your one-node lease warm between cells (warm: true): its worker stays, its GPUs are lent to "
                "whoever would otherwise wait (the lease is evicted: event evicting, revoked after the pool's "
                "warm_evict_notice), and it ends warm_max after it went warm. warm: false runs a cell on it "
                "again; refused (409) once it is being evicted",
                _json(_ref("Lease"), "The lease, warm or running again"),
                409,
                body=bodies.warm,
                params=[LEASE_ID],
            ),
        },
        "/api/v1/leases/{lease_id}/suspend": {
            "post": _op(
                "Hand back your warm one-GPU lease with its worker suspended, not ended: the lease ends "
                "(cause suspended), its GPU drains while the node agent moves the worker's GPU state to host "
                "memory (event suspended, with bytes and ms), then it is free. The worker restores onto your "
                "next lease of that node (event restored) or ends at warm_max or over the node's host-memory "
                "budget (event suspend_ended). Refused (409) where the node cannot suspend: release instead",
                _json(_ref("Lease"), "The ended lease"),
                409,
                body=bodies.suspend,
                params=[LEASE_ID],
            ),
        },
        "/api/v1/leases/{lease_id}/keep": {
            "post": _op(
                "I'm still using it: reset the idle clock of a warned lease (owner; limited per lease)",
                _json(_ref("Lease"), "Kept"),
                409,
                params=[LEASE_ID],
            )
        },
        "/api/v1/policy": {
            "get": _op("The idle-GPU reclaim policy of every pool", _json({"type": "object"}, "Policies"))
        },
        "/api/v1/policy/{pool}": {
            "get": _op("One pool's reclaim policy", _json(_ref("PoolPolicy"), "Policy"), params=[POOL]),
            "put": _op(
                "Change one pool's reclaim policy (admin; fields not given stay)",
                _json(_ref("PoolPolicy"), "New policy"),
                body=bodies.policy,
                params=[POOL],
            ),
        },
        "/api/v1/nodes/{node}/samples": {
            "post": _op(
                "Agent: one sample of the node's GPUs (utilization, memory, processes)",
                _json({"type": "object"}, "Recorded"),
                params=[NODE],
                body=bodies.samples,
            )
        },
        "/api/v1/simulate/{node}": {
            "get": _op(
                "What a simulated node's GPUs report (agent/admin)",
                _json({"type": "object"}, "Samples"),
                params=[NODE],
            ),
            "put": _op(
                'Set what simulated GPUs report (admin), e.g. {"gpus": {"0": {"util": 0}}}',
                _json({"type": "object"}, "Set"),
                params=[NODE],
                body=bodies.simulate,
            ),
        },
        "/api/v1/cluster": {
            "get": _op(
                "Nodes and every GPU's state and holder, and every pool's counts; a page of the nodes with `pool`, "
                "`after` and `limit`. Every reader of one server shares one view of the cluster, at most 1 s old "
                "and never older than the newest event when the request came (GPU samples and heartbeats: at most "
                "5 s old). 400: an unknown pool (the message names the pools)",
                _json(_ref("Cluster"), "Cluster"),
                400,
                params=(v.CLUSTER_POOL, v.CLUSTER_AFTER, v.CLUSTER_LIMIT),
            )
        },
        "/api/v1/queue": {"get": _op("Waiting requests", _json(_ref("Queue"), "Queue"), params=(v.POOL,))},
        "/api/v1/events": {
            "get": _op(
                "Live event stream (server-sent events); resumes after Last-Event-ID or ?since=; "
                "?lease=ID: only that lease's events; ?changes=true: one `changed` event for many (at most one "
                "every 0.5 s), for a view that refetches. 400: lease and changes together",
                {
                    "description": "text/event-stream: each event's `event` is its type, `id` its id, `data` "
                    "the Event as JSON",
                    "content": {"text/event-stream": {"schema": _ref("ServerSentEvent")}},
                },
                429,
                params=(v.SINCE, v.LAST_EVENT_ID, v.LEASE, v.CHANGES),
            )
        },
        "/api/v1/events/log": {
            "get": _op(
                "Event log entries: oldest first after `since`, or newest first (order=desc) before `before`; "
                "filtered by the server (lease, type, user), up to `limit` that pass",
                _json(
                    {
                        "type": "object",
                        "properties": {
                            "events": {"type": "array", "items": _ref("Event")},
                            "limit": {"type": "integer", "description": "The limit served (at most the page cap)"},
                            "note": {"type": "string", "description": "Why the limit served is not the one asked"},
                        },
                    },
                    "Entries",
                ),
                429,
                params=(v.SINCE, v.LIMIT, v.LEASE, v.BEFORE, v.ORDER, v.EVENT_TYPES, v.EVENT_USER),
            )
        },
        "/api/v1/nodes/{node}": {
            "put": _op(
                "Declare a node's GPUs (agent/admin)",
                _json({"type": "object"}, "Registered"),
                body=bodies.inventory,
                params=[NODE],
            )
        },
        "/api/v1/nodes/{node}/heartbeat": {
            "post": _op("Agent heartbeat", _json({"type": "object"}, "Alive"), params=[NODE])
        },
        "/api/v1/nodes/{node}/draining": {
            "get": _op(
                "Agent: the node's draining GPUs, each with the lease the server ended and its processes; with "
                "`wait`, a long-poll that answers once the node has any (or at the end of the wait)",
                _json({"type": "object"}, "Draining GPUs"),
                params=[NODE, params.DRAIN_WAIT.openapi()],
            )
        },
        "/api/v1/nodes/{node}/drained": {
            "post": _op(
                "Agent: these GPUs are clean of the lease's processes; they turn free and the queue is served",
                _json({"type": "object"}, "Freed"),
                params=[NODE],
                body=bodies.drained,
            )
        },
        "/api/v1/nodes/{node}/procs": {
            "post": _op(
                "Agent: record a process that claimed a lease through the agent's claim socket (the kernel named "
                "it: pid, uid); the claim's API token must name the lease's owner. If the server ends the lease, "
                "the agent ends these processes before the GPUs are granted again. Agent tokens only",
                _json({"type": "object"}, "Recorded"),
                409,
                params=[NODE],
                body=bodies.procs,
            )
        },
        "/api/v1/nodes/{node}/memory": {
            "get": _op(
                "Agent: what to measure on the node: its leases with claimed processes there (slices and, while "
                "its pool shares, whole GPUs), and the server's rule (over_pct for over_s; every check_interval_s)",
                _json({"type": "object"}, "The leases to measure"),
                params=[NODE],
            ),
            "post": _op(
                "Agent: what each lease's processes use now and their peak, and the slices over their memory: "
                "warned, or ended (cause over_memory). Only leases with processes claimed on the node count; the "
                "others are answered as ignored",
                _json({"type": "object"}, "Recorded, ended and ignored leases"),
                params=[NODE],
                body=bodies.memory,
            ),
        },
        "/api/v1/draining": {
            "get": _op(
                "Admin: every draining GPU, with the processes its agent gave up (abandoned: flagged, out of "
                'service until the process ends or an admin clears it: POST /nodes/{node}/drained with lease "")',
                _json({"type": "object"}, "Draining GPUs"),
            )
        },
        "/api/v1/tokens": {
            "get": _op(
                "Every API token: id, user, role, created, expires, last used, scope (admin)",
                _json(
                    {"type": "object", "properties": {"tokens": {"type": "array", "items": _ref("Token")}}}, "Tokens"
                ),
            ),
            "post": _op(
                "Create an API token (admin), optionally expiring; a proxy token's acts_for, an agent token's node",
                _json(_ref("NewToken"), "The token, with its secret"),
                body=bodies.token,
                ok_code=201,
            ),
        },
        "/api/v1/tokens/{token_id}": {
            "delete": _op(
                "Revoke a token (admin): refused from the next request on",
                _json(
                    {"allOf": [_ref("Token"), {"type": "object", "properties": {"revoked": {"type": "boolean"}}}]},
                    "Revoked",
                ),
                404,
                params=[TOKEN_ID],
            )
        },
        "/api/v1/info": {
            "get": _op(
                "Server settings clients need: Ray address, default pool, TTLs, pools",
                _json({"type": "object"}, "Info"),
            )
        },
        "/api/v1/whoami": {"get": _op("The caller's user and role", _json({"type": "object"}, "Identity"))},
        "/api/v1/health": {
            "get": _op("Liveness and Redis reachability", _json({"type": "object"}, "Healthy"), public=True)
        },
        "/api/v1/openapi.json": {"get": _op("This document", _json({"type": "object"}, "OpenAPI 3.1"), public=True)},
        "/metrics": {
            "get": _op(
                "Prometheus metrics (under a flood of requests, rendered at most once a second: the rest get "
                "the last page)",
                {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}},
                public=True,
            )
        },
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "gpulease lease server",
            "version": __version__,
            "description": "GPUs leased to notebook cells. All times are Unix epoch seconds. Every JSON body is "
            "checked against its schema here: an unknown field, a value of another type, out of bounds or of "
            "another shape is a 400 that says what to fix. Rules a schema cannot state are listed in the "
            "body's description; a request breaking one is a 400 too. A method a path does not list is a "
            "405 with an Allow header.",
        },
        "servers": [{"url": "/"}],
        "security": [{"bearer": []}],
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}, "schemas": schemas},
        "paths": paths,
    }
