"""The OpenAPI document against the live server: schemathesis runs every phase (coverage, fuzzing,
stateful) with every check, as an admin, against a real server and a real Redis, and nothing may fail.

It catches the document and the server drifting apart both ways: a request valid by the schema that
the server refuses (the schema is looser than the server), an invalid one it accepts (the schema is
stricter, or the server does not check), a status or response the document does not list, a method a
path does not declare answered without a 405 and its Allow header.

Two kinds of answer are the contract and not a disagreement, and are let through by name:

* a 400 for one of the rules a JSON Schema cannot state (``gpus_min`` above ``gpus``, a booking that
  ends before it starts, ...): each is listed in its body's description in the document (``rules``
  in ``lease_server.leasing.bodies``, ``RULES`` of ``lease_server.request``), and the server's message
  names it (RULES below);
* a lease or booking still readable after its DELETE: it ended (state released, revoked, withdrawn,
  cancelled) and stays readable with that state for a while, as the document says. Read back as
  active, it would still fail.

Deterministic: a fixed seed, derandomized generation, no example database, one worker, and no time
limit (a time limit makes the engine cycle until the time is up): what runs is bounded by
max-examples instead.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from typing import Any

import pytest

from lease_server.leasing import bookings, values
from lease_server.leasing.bodies import bodies
from lease_server.protocol import ENDED_STATES

schemathesis = pytest.importorskip("schemathesis")  # the test extra
from schemathesis.engine import events, from_schema  # noqa: E402

SEED = 20260401
MAX_EXAMPLES = 30

# Operation -> what its 400s for rules beyond the schema say (see each body's description).
BOOKING_RULES = (
    r"must be at least 60 s after start",
    r"booking lasts at most",
    r"ends in the past",
    r"occurrences above 1 need repeat",
    r"is not an ISO 8601 time",  # a date that does not exist, e.g. 2031-02-30
)
RULES: dict[str, tuple[str, ...]] = {
    "POST /api/v1/leases": (
        r"gpus_min \(\d+\) must not exceed gpus",
        r"must be a multiple of nodes",
        r"multi-node gang is all or nothing",
        r"a slice \(gpu_mem_mb\) is part of one GPU",
        r"does not share its GPUs, so it takes no slice",
        r"is more than one GPU of pool .* has",
        r"prefer_node names one node for whole GPUs",
    ),
    "POST /api/v1/bookings": BOOKING_RULES,
    "PATCH /api/v1/bookings/{booking_id}": (*BOOKING_RULES, r"nothing to change"),
    "GET /api/v1/bookings": (r"to must be after from", r"is not an ISO 8601 time"),
    # the same operations under their deprecated paths
    "POST /api/v1/reservations": BOOKING_RULES,
    "PATCH /api/v1/reservations/{reservation_id}": (*BOOKING_RULES, r"nothing to change"),
    "GET /api/v1/reservations": (r"to must be after from", r"is not an ISO 8601 time"),
    "GET /api/v1/usage": (r"to must be after from", r"is not an ISO 8601 time"),
    "GET /api/v1/usage/summary": (
        r"to must be after from",
        r"is not an ISO 8601 time",
        r"a summary covers at most",
        r"unknown pool",
        r"unknown user",
    ),
    "GET /api/v1/usage/balance": (r"unknown pool",),
    "GET /api/v1/cluster": (r"unknown pool",),
    "GET /api/v1/estimate": (
        r"name different requests",
        r"does not share its GPUs",
        r"is more than one GPU of pool",
        r"must be a multiple of nodes",  # a gang's shape, checked as the acquire's
        r"a slice \(gpu_mem_mb\) is part of one GPU",
    ),
    "PUT /api/v1/nodes/{node}": (r"distinct integer",),
    "GET /api/v1/events/log": (r"is not a usable event id",),
    "GET /api/v1/events": (r"changes and lease cannot be combined",),
    "PUT /api/v1/simulate/{node}": (r"has no GPU", r"only simulated GPUs can be set", r"uids must list the owner"),
    "POST /api/v1/nodes/{node}/samples": (r"uids must list the owner",),
    "POST /api/v1/tokens": (
        r"acts_for is for proxy tokens only",
        r"node is for agent tokens only",
        r"is not a regular expression",
    ),
}
# What a deleted lease or booking reads as: ended, never active.
ENDED = {*ENDED_STATES, "withdrawn", "cancelled"}


def _json(response: Any) -> Any:
    try:
        return response.json()
    except ValueError:
        return None


def _documented_rule(failure: Any, case: Any, response: Any) -> bool:
    """A refused schema-valid request whose 400 names one of its operation's documented rules."""
    if type(failure).__name__ != "RejectedPositiveData" or response.status_code != 400:
        return False
    body = _json(response)
    message = body.get("message", "") if isinstance(body, dict) else ""
    return any(re.search(rule, message) for rule in RULES.get(case.operation.label, ()))


def _read_as_ended(failure: Any, response: Any) -> bool:
    """A lease or booking read back after its DELETE, in its final state."""
    if type(failure).__name__ != "UseAfterFree":
        return False
    body = _json(response)
    return isinstance(body, dict) and body.get("state") in ENDED


def test_declared_limits_agree_with_their_owners() -> None:
    """The few constants values.py and bodies.py cannot import (their importers own them) say the same."""
    from lease_server.leasing import usage
    from lease_server.leasing.reclaim import Policy

    # (A booking's time bounds live in values.py alone now, with parse_time: nothing to compare.)
    assert values.MAX_OCCURRENCES == bookings.MAX_OCCURRENCES
    assert values.REPEATS == bookings.REPEATS
    assert values.USAGE_GROUPS == usage.GROUPS
    assert values.SUMMARY_GROUPS == usage.SUMMARY_GROUPS
    assert set(bodies().booking.allowed) == set(bookings.FIELDS)
    assert bodies().policy.allowed == tuple(Policy.__dataclass_fields__)


@pytest.mark.timeout(600)
def test_server_and_openapi_document_agree(server_factory: Any) -> None:
    # max_wait bounds how long a generated acquire may block in the queue, and a long-poll of a
    # node's drains (GET /nodes/{node}/draining?wait=): half a second, well inside the 1 s in which
    # generated requests are answered here.
    # refusal_hold_s 0: generated requests that the edge refuses (a body with a bad token, a burst
    # of log reads) are answered at once, not held a second each as a hostile client's are.
    server = server_factory(max_wait=0.5, refusal_hold_s=0.0)
    config = schemathesis.Config.from_dict(
        {
            "seed": SEED,
            "headers": {"Authorization": f"Bearer {server.token('root', 'admin')}"},
            "workers": 1,
            "request-timeout": 15,
            # On a loaded CI machine (this test ran 5x slower there) a read can outlast its timeout,
            # and after two such, schemathesis tightens that operation's timeout to 1 s, which then
            # fails every read of it: retry a timed-out request (twice) before calling it an error.
            # The slowest answers are printed below, to tell a slow machine from a slow server.
            "request-retries": 2,
            "generation": {"max-examples": MAX_EXAMPLES, "deterministic": True, "database": "none"},
            "phases": {
                "examples": {"enabled": True},
                "coverage": {"enabled": True},
                "fuzzing": {"enabled": True},
                "stateful": {"enabled": True, "max-steps": 10},
            },
            "checks": {
                # 410 (a withdrawn request), 413 (over the body limit) and 422 (no node could ever serve
                # it) answer requests the schema cannot know to be hopeless: they are documented.
                "positive_data_acceptance": {
                    "expected-statuses": ["2xx", "401", "403", "404", "409", "410", "413", "422", "5xx"]
                },
                "negative_data_rejection": {
                    "expected-statuses": ["400", "401", "403", "404", "405", "409", "413", "422", "5xx"]
                },
            },
            # The event stream never ends: read what arrives in three seconds, then hang up.
            "operations": [{"include-path": "/api/v1/events", "include-method": "GET", "request-timeout": 3}],
        }
    )
    schema = schemathesis.openapi.from_url(f"{server.url}/api/v1/openapi.json", config=config)

    @schema.hook
    def filter_failure(ctx: Any, failure: Any, case: Any, response: Any) -> bool:
        return not (_documented_rule(failure, case, response) or _read_as_ended(failure, response))

    t0 = time.monotonic()
    failures: list[str] = []
    errors: list[str] = []
    calls: Counter[str] = Counter()
    slowest: list[tuple[float, str]] = []
    for event in from_schema(schema).execute():
        if isinstance(event, (events.ScenarioFinished, events.FuzzScenarioFinished)):
            recorder = event.recorder
            for interaction in recorder.interactions.values():
                calls[interaction.request.method] += 1
                if interaction.response is not None:
                    took = interaction.response.elapsed
                    slowest.append((took, f"{took:6.2f} s {interaction.request.method} {interaction.request.uri}"))
            for case_id, checks in recorder.checks.items():
                for check in checks:
                    if check.failure_info is not None:
                        case = recorder.cases[case_id].value
                        failure = check.failure_info.failure
                        failures.append(
                            f"{case.operation.label} [{check.name}] {failure.title}: {failure.message}\n"
                            f"{check.failure_info.code_sample}"
                        )
        elif isinstance(event, events.NonFatalError):
            errors.append(f"{event.label}: {event.info.title}: {event.info.message}")
        elif isinstance(event, events.FatalError):
            errors.append(f"fatal: {event.exception!r}")
    elapsed = time.monotonic() - t0
    print(f"schemathesis: {sum(calls.values())} requests ({dict(calls)}) in {elapsed:.0f} s; slowest:")
    print("\n".join(line[:200] for _, line in sorted(slowest, reverse=True)[:15]))
    assert sum(calls.values()) > 500, f"too few requests to mean anything: {dict(calls)}"
    unique = sorted(set(failures))
    assert not errors, "\n".join(errors)
    assert not unique, f"{len(unique)} disagreement(s):\n\n" + "\n\n".join(unique[:30])
