"""The OpenAPI 3.1 document of the HTTP API, served at /api/v1/openapi.json."""

from __future__ import annotations

from typing import Any

from . import __version__


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*codes: int) -> dict[str, Any]:
    text = {
        400: "Bad input: the message says what to fix",
        401: "No or unknown API token",
        403: "Not allowed for this user",
        404: "No such lease, pool or node",
        409: "Conflict: stale token, lease ended, or no capacity in time",
        410: "Withdrawn: the queued request was withdrawn (DELETE) before a grant; it will never be granted",
        413: "Body too large",
        422: "No node of the pool could ever serve this request",
        503: "Redis unreachable",
    }
    return {str(c): _json(_ref("Error"), text[c]) for c in codes}


def _op(
    summary: str,
    ok: dict[str, Any],
    *codes: int,
    body: dict[str, Any] | None = None,
    params: list[dict[str, Any]] | None = None,
    public: bool = False,
    ok_code: int = 200,
) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary, "responses": {str(ok_code): ok, **_errors(*codes)}}
    if body is not None:
        op["requestBody"] = {"required": False, "content": {"application/json": {"schema": body}}}
    if params:
        op["parameters"] = params
    if public:
        op["security"] = []
    return op


LEASE_ID = {"name": "lease_id", "in": "path", "required": True, "schema": {"type": "string"}}
# A GPU as a node agent declares it (also part of every GPU in the cluster view).
GPU_PROPS = {
    "index": {"type": "integer"},
    "uuid": {"type": "string"},
    "model": {"type": "string"},
    "memory_mb": {"type": "integer"},
}
LEASE_FILTER = {
    "name": "lease",
    "in": "query",
    "required": False,
    "schema": {"type": "string", "pattern": "^[A-Za-z0-9._-]{1,64}$"},
    "description": "Only events whose `lease` field is this lease (or queued request) id, filtered by the "
    "server; an id of another shape is a 400",
}
RESERVATION_ID = {"name": "reservation_id", "in": "path", "required": True, "schema": {"type": "string"}}
DRY_RUN = {
    "name": "dry_run",
    "in": "query",
    "required": False,
    "schema": {"type": "boolean"},
    "description": "Only check: answer {fits, node} or the 409 clash, and store nothing",
}
TIME = {
    "oneOf": [
        {"type": "number", "description": "epoch seconds"},
        {"type": "string", "description": "ISO 8601 with a UTC offset, e.g. 2026-11-23T09:00:00+01:00"},
    ]
}
POOL = {"name": "pool", "in": "path", "required": True, "schema": {"type": "string"}}
NODE = {"name": "node", "in": "path", "required": True, "schema": {"type": "string"}}


def openapi_document() -> dict[str, Any]:
    num = {"type": "number"}
    schemas: dict[str, Any] = {
        "Error": {
            "type": "object",
            "required": ["code", "message"],
            "properties": {"code": {"type": "string"}, "message": {"type": "string"}, "details": {"type": "object"}},
        },
        "AcquireRequest": {
            "type": "object",
            "required": ["gpus"],
            "additionalProperties": False,
            "properties": {
                "gpus": {"type": "integer", "minimum": 1, "maximum": 1024},
                "gpus_min": {
                    "type": "integer",
                    "minimum": 1,
                    "description": "Elastic request: granted as many as one node has free, from gpus_min to gpus",
                },
                "nodes": {
                    "type": "integer",
                    "minimum": 1,
                    "maximum": 64,
                    "description": "A multi-node gang: gpus / nodes GPUs on each of that many nodes, all or nothing",
                },
                "priority": {
                    "enum": ["low", "normal", "high"],
                    "description": "Priority class (the priority scheduler serves higher classes first; a request "
                    "may preempt only preemptible leases of no higher class)",
                },
                "pool": {"type": "string", "description": "Default: the server's default GPU pool"},
                "ttl": {"type": "number", "minimum": 1, "description": "Seconds the lease lives unless renewed"},
                "wait": {
                    "type": "number",
                    "minimum": 0,
                    "description": "Seconds to wait in the queue (0: fail at once)",
                },
                "label": {"type": "string", "maxLength": 200},
                "session": {"type": "string", "maxLength": 200},
                "notebook": {"type": "string", "maxLength": 200, "description": "For the usage ledger"},
                "cell": {"type": "string", "maxLength": 200, "description": "The cell's hash, for the usage ledger"},
                "id": {
                    "type": "string",
                    "pattern": "^[A-Za-z0-9._-]{8,64}$",
                    "description": "Optional request id chosen by the client: it becomes the lease id, shows "
                    "the request in GET /queue while it waits, and makes a resent POST return the same grant",
                },
            },
        },
        "Gpu": {"type": "object", "properties": {"index": {"type": "integer"}, "uuid": {"type": "string"}}},
        "Lease": {
            "type": "object",
            "required": ["id", "user", "pool", "node", "gpus", "state", "expires_at"],
            "properties": {
                "id": {"type": "string"},
                "token": {"type": "integer", "description": "Fencing token (owner only)"},
                "user": {"type": "string"},
                "pool": {"type": "string"},
                "node": {"type": "string"},
                "gpus": {"type": "array", "items": _ref("Gpu")},
                "state": {"type": "string", "enum": ["active", "released", "expired", "revoked"]},
                "label": {"type": "string"},
                "session": {"type": "string"},
                "ttl": num,
                "created_at": num,
                "renewed_at": num,
                "expires_at": num,
                "renewals": {"type": "integer"},
                "waited": num,
                "ended_at": num,
                "end_reason": {"type": "string"},
                "ended_by": {"type": "string"},
                "changed": {"type": "boolean"},
            },
        },
        "LeaseList": {"type": "object", "properties": {"leases": {"type": "array", "items": _ref("Lease")}}},
        "TokenBody": {"type": "object", "properties": {"token": {"type": "integer"}, "ttl": num}},
        "Cluster": {
            "type": "object",
            "properties": {
                "now": num,
                "default_pool": {"type": ["string", "null"]},
                "pools": {"type": "object", "additionalProperties": {"type": "object"}},
                "nodes": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "name": {"type": "string"},
                            "pool": {"type": "string"},
                            "state": {"type": "string", "enum": ["up", "down"]},
                            "gpus": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "properties": {
                                        **GPU_PROPS,
                                        "state": {"type": "string", "enum": ["free", "leased", "down"]},
                                        "lease": {"type": "object"},
                                    },
                                },
                            },
                        },
                    },
                },
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
        "Event": {"type": "object", "properties": {"id": {"type": "string"}, "type": {"type": "string"}, "ts": num}},
        "Policy": {
            "type": "object",
            "properties": {
                "enabled": {"type": "boolean"},
                "idle_threshold": {"type": "number", "minimum": 0, "maximum": 100, "description": "% utilization"},
                "idle_timeout": {"type": "number", "description": "seconds idle before a warning"},
                "grace": {"type": "number", "description": "seconds from warning to reclaim"},
                "min_age": {"type": "number", "description": "seconds a new lease is never reclaimed"},
                "max_extensions": {"type": "integer"},
                "exempt_users": {"type": "array", "items": {"type": "string"}},
                "exempt_labels": {"type": "array", "items": {"type": "string"}},
            },
        },
        "GpuSample": {
            "type": "object",
            "properties": {
                "index": {"type": "integer"},
                "util": {"type": "number", "minimum": 0, "maximum": 100},
                "mem_mb": {"type": "integer", "minimum": 0},
                "procs": {"type": "array", "items": {"type": "integer"}},
            },
        },
        "Inventory": {
            "type": "object",
            "required": ["pool", "gpus"],
            "properties": {
                "pool": {"type": "string"},
                "source": {"type": "string", "enum": ["nvml", "simulated"]},
                "gpus": {
                    "type": "array",
                    "items": {"type": "object", "properties": GPU_PROPS},
                },
            },
        },
    }
    schemas["ReservationRequest"] = {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "pool": {"type": "string"},
            "gpus": {"type": "integer", "minimum": 1},
            "start": TIME,
            "end": TIME,
            "owner": {"type": "string", "description": 'A user, or "team:NAME" (members share it). Default: you'},
            "note": {"type": "string", "maxLength": 200},
            "repeat": {"enum": ["none", "weekly"], "description": "weekly: every 168 h of UTC"},
            "occurrences": {"type": "integer", "minimum": 1, "maximum": 52},
            "colocate": {"type": "boolean", "description": "All GPUs on one node (for one multi-GPU lease)"},
        },
    }
    schemas["Reservation"] = {
        "type": "object",
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
    }
    paths: dict[str, Any] = {
        "/api/v1/reservations": {
            "post": _op(
                "Book GPUs of a pool for a window (409 names clashing bookings and windows that fit)",
                _json(_ref("Reservation"), "Booked"),
                400,
                401,
                403,
                404,
                409,
                413,
                422,
                body=_ref("ReservationRequest"),
                params=[DRY_RUN],
                ok_code=201,
            ),
            "get": _op(
                "Everyone's bookings with an occurrence in [from, to) (default: the last day to 14 days ahead)",
                _json(
                    {"type": "object", "properties": {"reservations": {"type": "array", "items": _ref("Reservation")}}},
                    "Bookings",
                ),
                400,
                401,
                params=[
                    {"name": "pool", "in": "query", "required": False, "schema": {"type": "string"}},
                    {"name": "from", "in": "query", "required": False, "schema": {"type": "string"}},
                    {"name": "to", "in": "query", "required": False, "schema": {"type": "string"}},
                ],
            ),
        },
        "/api/v1/reservations/{reservation_id}": {
            "get": _op("One booking", _json(_ref("Reservation"), "Booking"), 401, 404, params=[RESERVATION_ID]),
            "patch": _op(
                "Change a booking (owner, team member or admin; fields not given stay)",
                _json(_ref("Reservation"), "Changed"),
                400,
                401,
                403,
                404,
                409,
                422,
                body=_ref("ReservationRequest"),
                params=[RESERVATION_ID, DRY_RUN],
            ),
            "delete": _op(
                "Cancel a booking", _json(_ref("Reservation"), "Cancelled"), 401, 403, 404, params=[RESERVATION_ID]
            ),
        },
        "/api/v1/reservations/{reservation_id}/end": {
            "post": _op(
                "End the occurrence in force now: its GPUs go back to the pool",
                _json(_ref("Reservation"), "Ended"),
                401,
                403,
                404,
                409,
                params=[RESERVATION_ID],
            )
        },
        "/api/v1/usage": {
            "get": _op(
                "The usage ledger summed per user, team, pool or notebook over [from, to) (default: 7 days)",
                _json({"type": "object"}, "Usage"),
                400,
                401,
                params=[
                    {
                        "name": "by",
                        "in": "query",
                        "required": False,
                        "schema": {"enum": ["user", "team", "pool", "notebook"]},
                    },
                    {"name": "pool", "in": "query", "required": False, "schema": {"type": "string"}},
                    {"name": "from", "in": "query", "required": False, "schema": {"type": "string"}},
                    {"name": "to", "in": "query", "required": False, "schema": {"type": "string"}},
                ],
            )
        },
        "/api/v1/estimate": {
            "get": _op(
                "How long a request for gpus GPUs of pool would wait, and other pools free now",
                _json(
                    {"type": "object"},
                    "Estimate: `estimate_s`, `text` (the reasoning in words), `queued_ahead` and "
                    "`queued_gpus_ahead` (requests strictly ahead of the asking one), `position` (its place "
                    "in the queue when `lease` names a queued request, else null), `held_gpus`, `free_now`, "
                    "`alternatives`. With nothing queued ahead, `text` says what it waits for: a running "
                    "lease's fixed end (recall or idle reclaim) when one is known, else the GPUs held by "
                    "running calls",
                ),
                400,
                401,
                404,
                params=[
                    {
                        "name": "pool",
                        "in": "query",
                        "required": False,
                        "schema": {"type": "string"},
                        "description": "Default: the queued request's pool (with `lease`), else the default pool",
                    },
                    {
                        "name": "gpus",
                        "in": "query",
                        "required": False,
                        "schema": {"type": "integer"},
                        "description": "Default: the queued request's GPUs (with `lease`), else 1",
                    },
                    {
                        **LEASE_FILTER,
                        "description": "The asking request's id when it is already queued: only the requests "
                        "ahead of it count, not itself nor those behind it (a 400 for an id of another shape)",
                    },
                    {
                        "name": "id",
                        "in": "query",
                        "required": False,
                        "schema": LEASE_FILTER["schema"],
                        "description": "Same as `lease`",
                    },
                ],
            )
        },
        "/api/v1/leases": {
            "post": _op(
                "Acquire GPUs (waits in the pool's queue up to `wait` seconds; "
                "DELETE /leases/{id} of its `id` withdraws it while it waits)",
                _json(_ref("Lease"), "Granted"),
                400,
                401,
                404,
                409,
                410,
                413,
                422,
                body=_ref("AcquireRequest"),
                ok_code=201,
            ),
            "get": _op(
                "My live leases (?all=true: everyone's, without tokens)",
                _json(_ref("LeaseList"), "Leases"),
                401,
                params=[{"name": "all", "in": "query", "schema": {"type": "boolean"}}],
            ),
        },
        "/api/v1/leases/{lease_id}": {
            "get": _op(
                "One lease, live or recently ended", _json(_ref("Lease"), "The lease"), 401, 404, params=[LEASE_ID]
            ),
            "delete": _op(
                "Release (idempotent; an admin releasing another's lease revokes it), or withdraw a queued request",
                _json(
                    {"oneOf": [_ref("Lease"), _ref("Withdrawal")]},
                    "The ended lease (`changed` is false if it had ended already); or, when `lease_id` is a "
                    "request still waiting in the queue, a Withdrawal: the request left the queue atomically, "
                    "will never be granted, and its waiting POST /leases answers 410 `withdrawn` at once. "
                    "Only its owner or an admin may withdraw it (403 `not_owner`). A request granted just "
                    "before the DELETE is released as any lease. Withdrawing again is a 404: nothing waits.",
                ),
                400,
                401,
                403,
                404,
                409,
                params=[
                    LEASE_ID,
                    {"name": "token", "in": "query", "schema": {"type": "integer"}},
                    {"name": "reason", "in": "query", "schema": {"type": "string", "maxLength": 200}},
                ],
            ),
        },
        "/api/v1/leases/{lease_id}/renew": {
            "post": _op(
                "Renew with the lease's fencing token",
                _json(_ref("Lease"), "Renewed"),
                400,
                401,
                403,
                404,
                409,
                body=_ref("TokenBody"),
                params=[LEASE_ID],
            ),
        },
        "/api/v1/leases/{lease_id}/revoke": {
            "post": _op(
                "Revoke a lease (admin)",
                _json(_ref("Lease"), "Revoked"),
                401,
                403,
                404,
                body={"type": "object", "properties": {"reason": {"type": "string"}}},
                params=[LEASE_ID],
            ),
        },
        "/api/v1/leases/{lease_id}/keep": {
            "post": _op(
                "I'm still using it: reset the idle clock of a warned lease (owner; limited per lease)",
                _json(_ref("Lease"), "Kept"),
                401,
                403,
                404,
                409,
                params=[LEASE_ID],
            )
        },
        "/api/v1/policy": {
            "get": _op("The idle-GPU reclaim policy of every pool", _json({"type": "object"}, "Policies"), 401)
        },
        "/api/v1/policy/{pool}": {
            "get": _op("One pool's reclaim policy", _json(_ref("Policy"), "Policy"), 401, 404, params=[POOL]),
            "put": _op(
                "Change one pool's reclaim policy (admin; fields not given stay)",
                _json(_ref("Policy"), "New policy"),
                400,
                401,
                403,
                404,
                body=_ref("Policy"),
                params=[POOL],
            ),
        },
        "/api/v1/nodes/{node}/samples": {
            "post": _op(
                "Agent: one sample of the node's GPUs (utilization, memory, processes)",
                _json({"type": "object"}, "Recorded"),
                400,
                401,
                403,
                404,
                params=[NODE],
                body={
                    "type": "object",
                    "required": ["gpus"],
                    "properties": {"gpus": {"type": "array", "items": _ref("GpuSample")}},
                },
            )
        },
        "/api/v1/simulate/{node}": {
            "get": _op(
                "What a simulated node's GPUs report (agent/admin)",
                _json({"type": "object"}, "Samples"),
                401,
                403,
                404,
                params=[NODE],
            ),
            "put": _op(
                'Set what simulated GPUs report (admin), e.g. {"gpus": {"0": {"util": 0}}}',
                _json({"type": "object"}, "Set"),
                400,
                401,
                403,
                404,
                params=[NODE],
                body={
                    "type": "object",
                    "properties": {"gpus": {"type": "object", "additionalProperties": _ref("GpuSample")}},
                },
            ),
        },
        "/api/v1/cluster": {
            "get": _op("Nodes and every GPU's state and holder", _json(_ref("Cluster"), "Cluster"), 401)
        },
        "/api/v1/queue": {
            "get": _op(
                "Waiting requests",
                _json(_ref("Queue"), "Queue"),
                400,
                401,
                params=[{"name": "pool", "in": "query", "schema": {"type": "string"}}],
            )
        },
        "/api/v1/events": {
            "get": {
                "summary": "Live event stream (server-sent events); resumes after Last-Event-ID or ?since=; "
                "?lease=ID: only that lease's events",
                "parameters": [{"name": "since", "in": "query", "schema": {"type": "string"}}, LEASE_FILTER],
                "responses": {
                    "200": {
                        "description": "text/event-stream of Event objects",
                        "content": {"text/event-stream": {"schema": {"type": "string"}}},
                    },
                    **_errors(400, 401),
                },
            }
        },
        "/api/v1/events/log": {
            "get": _op(
                "Event log entries after `since` (?lease=ID: only that lease's, up to `limit` of them)",
                _json(
                    {"type": "object", "properties": {"events": {"type": "array", "items": _ref("Event")}}}, "Entries"
                ),
                400,
                401,
                params=[
                    {"name": "since", "in": "query", "schema": {"type": "string"}},
                    {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 10000}},
                    LEASE_FILTER,
                ],
            )
        },
        "/api/v1/nodes/{node}": {
            "put": _op(
                "Declare a node's GPUs (agent/admin)",
                _json({"type": "object"}, "Registered"),
                400,
                401,
                403,
                body=_ref("Inventory"),
                params=[NODE],
            )
        },
        "/api/v1/nodes/{node}/heartbeat": {
            "post": _op("Agent heartbeat", _json({"type": "object"}, "Alive"), 401, 403, 404, params=[NODE])
        },
        "/api/v1/tokens": {
            "post": _op(
                "Create an API token (admin)",
                _json({"type": "object"}, "Token"),
                400,
                401,
                403,
                body={
                    "type": "object",
                    "required": ["user"],
                    "properties": {
                        "user": {"type": "string"},
                        "role": {"type": "string", "enum": ["user", "admin", "agent"]},
                    },
                },
                ok_code=201,
            )
        },
        "/api/v1/info": {
            "get": _op(
                "Server settings clients need: Ray address, default pool, TTLs, pools",
                _json({"type": "object"}, "Info"),
                401,
            )
        },
        "/api/v1/whoami": {"get": _op("The caller's user and role", _json({"type": "object"}, "Identity"), 401)},
        "/api/v1/health": {
            "get": _op("Liveness and Redis reachability", _json({"type": "object"}, "Healthy"), 503, public=True)
        },
        "/api/v1/openapi.json": {"get": _op("This document", _json({"type": "object"}, "OpenAPI 3.1"), public=True)},
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics",
                "security": [],
                "responses": {
                    "200": {
                        "description": "Prometheus text format",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    }
                },
            }
        },
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "gpulease lease server",
            "version": __version__,
            "description": "GPUs leased to notebook cells. All times are Unix epoch seconds.",
        },
        "servers": [{"url": "/"}],
        "security": [{"bearer": []}],
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}, "schemas": schemas},
        "paths": paths,
    }
