"""The HTTP protocol of the lease server, in one place: its paths, its header names, the states a
lease can be in and the event types the server publishes.

Every client builds its paths from here (``lease_server.client``, the async client in
``jupyter_ext``, the worker's watchdog, the CLI); the server mounts its handlers on the same
templates. The labextension's event and state lists are checked against this module by a test
(``tests/test_protocol.py``), and so are the event types the Lua scripts emit.
"""

from __future__ import annotations

import enum
from urllib.parse import quote

API = "/api/v1"

# ---- headers ---------------------------------------------------------------------------------------

AUTHORIZATION = "Authorization"
LAST_EVENT_ID = "Last-Event-ID"  # SSE: resume the event stream after this id
USER_HEADER = "X-Gpulease-User"  # the Jupyter server extension: whom it acts for


def bearer(token: str) -> dict[str, str]:
    return {AUTHORIZATION: f"Bearer {token}"}


# ---- paths -----------------------------------------------------------------------------------------


def _seg(value: str) -> str:
    return quote(str(value), safe="")


LEASES = f"{API}/leases"
RESERVATIONS = f"{API}/reservations"
USAGE = f"{API}/usage"
ESTIMATE = f"{API}/estimate"
POLICIES = f"{API}/policy"
CLUSTER = f"{API}/cluster"
QUEUE = f"{API}/queue"
EVENTS = f"{API}/events"
EVENT_LOG = f"{API}/events/log"
TOKENS = f"{API}/tokens"
WHOAMI = f"{API}/whoami"
INFO = f"{API}/info"
HEALTH = f"{API}/health"
OPENAPI = f"{API}/openapi.json"


def lease(lease_id: str) -> str:
    return f"{LEASES}/{_seg(lease_id)}"


def lease_renew(lease_id: str) -> str:
    return f"{lease(lease_id)}/renew"


def lease_revoke(lease_id: str) -> str:
    return f"{lease(lease_id)}/revoke"


def lease_keep(lease_id: str) -> str:
    return f"{lease(lease_id)}/keep"


def reservation(booking_id: str) -> str:
    return f"{RESERVATIONS}/{_seg(booking_id)}"


def reservation_end(booking_id: str) -> str:
    return f"{reservation(booking_id)}/end"


def policy(pool: str) -> str:
    return f"{POLICIES}/{_seg(pool)}"


def node(name: str) -> str:
    return f"{API}/nodes/{_seg(name)}"


def node_heartbeat(name: str) -> str:
    return f"{node(name)}/heartbeat"


def node_samples(name: str) -> str:
    return f"{node(name)}/samples"


def simulate(name: str) -> str:
    return f"{API}/simulate/{_seg(name)}"


# ---- states ----------------------------------------------------------------------------------------


class LeaseState(str, enum.Enum):
    """A lease's ``state``: active until it ends one of three ways."""

    ACTIVE = "active"
    RELEASED = "released"
    EXPIRED = "expired"
    REVOKED = "revoked"


ENDED_STATES = frozenset({LeaseState.RELEASED.value, LeaseState.EXPIRED.value, LeaseState.REVOKED.value})
