"""The HTTP protocol of the lease server, in one place: its paths, its header names, the states a
lease can be in and the event types the server publishes.

Every client builds its paths from here (``lease_server.client``, the async client in
``jupyter_ext``, the worker's watchdog, the CLI); the server mounts its handlers on the same
templates. The labextension's event and state lists are checked against this module by a test
(``tests/test_protocol.py``), and so are the event types the Lua scripts emit.
"""

from __future__ import annotations

import enum
import re
from typing import Annotated, Any, Required, TypedDict
from urllib.parse import quote

API = "/api/v1"
DRAINING = f"{API}/draining"

# ---- headers ---------------------------------------------------------------------------------------

AUTHORIZATION = "Authorization"
LAST_EVENT_ID = "Last-Event-ID"  # SSE: resume the event stream after this id
USER_HEADER = "X-Gpulease-User"  # the Jupyter server extension: whom it acts for


# The roles a token can have. proxy: a trusted front end (the Jupyter server extension under
# JupyterHub) that acts for the logged-in user it names in the USER_HEADER.
ROLES = ("user", "admin", "agent", "proxy")

# The priority classes a request may name, and their rank in the scheduler (higher is served first).
PRIORITIES = {"low": 0, "normal": 1, "high": 2}


def bearer(token: str) -> dict[str, str]:
    return {AUTHORIZATION: f"Bearer {token}"}


# ---- paths -----------------------------------------------------------------------------------------


def _seg(value: str) -> str:
    return quote(str(value), safe="")


LEASES = f"{API}/leases"
BOOKINGS = f"{API}/bookings"
USAGE = f"{API}/usage"
USAGE_SUMMARY = f"{API}/usage/summary"
USAGE_BALANCE = f"{API}/usage/balance"
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


def lease_handoff(lease_id: str) -> str:
    return f"{lease(lease_id)}/handoff"


def lease_grow(lease_id: str) -> str:
    return f"{lease(lease_id)}/grow"


def lease_shrink(lease_id: str) -> str:
    return f"{lease(lease_id)}/shrink"


def lease_keep(lease_id: str) -> str:
    return f"{lease(lease_id)}/keep"


def lease_warm(lease_id: str) -> str:
    return f"{lease(lease_id)}/warm"


def lease_suspend(lease_id: str) -> str:
    return f"{lease(lease_id)}/suspend"


def token(token_id: str) -> str:
    return f"{TOKENS}/{_seg(token_id)}"


def booking(booking_id: str) -> str:
    return f"{BOOKINGS}/{_seg(booking_id)}"


def booking_end(booking_id: str) -> str:
    return f"{booking(booking_id)}/end"


# The bookings' paths of the first releases (/reservations, /reservations/{id}, .../end): served
# through release 0.1.x, each answer with a Deprecation header (RFC 9745), a Sunset header (RFC
# 8594: when they stop answering) and a Link to its successor under BOOKINGS; release REMOVED_IN
# no longer has them.
DEPRECATED_RESERVATIONS = f"{API}/reservations"
DEPRECATED_SINCE = 1795737600  # 2026-11-27T00:00:00Z, the Deprecation header's date (epoch seconds)
SUNSET = 1803859200  # 2027-03-01T00:00:00Z, the Sunset header's date (epoch seconds)
REMOVED_IN = "0.2.0"  # the first release without them


def deprecated_reservation(booking_id: str) -> str:
    return f"{DEPRECATED_RESERVATIONS}/{_seg(booking_id)}"


def deprecated_reservation_end(booking_id: str) -> str:
    return f"{deprecated_reservation(booking_id)}/end"


def policy(pool: str) -> str:
    return f"{POLICIES}/{_seg(pool)}"


def node(name: str) -> str:
    return f"{API}/nodes/{_seg(name)}"


def node_heartbeat(name: str) -> str:
    return f"{node(name)}/heartbeat"


def node_samples(name: str) -> str:
    return f"{node(name)}/samples"


def node_draining(name: str) -> str:
    return f"{node(name)}/draining"


def node_drained(name: str) -> str:
    return f"{node(name)}/drained"


def node_procs(name: str) -> str:
    return f"{node(name)}/procs"


def node_memory(name: str) -> str:
    return f"{node(name)}/memory"


def simulate(name: str) -> str:
    return f"{API}/simulate/{_seg(name)}"


# ---- states ----------------------------------------------------------------------------------------


class LeaseState(enum.StrEnum):
    """A lease's ``state``: active until it ends one of three ways.

    A StrEnum, so ``str()`` and f-strings give the value ("revoked"), as JSON does."""

    ACTIVE = "active"
    RELEASED = "released"
    EXPIRED = "expired"
    REVOKED = "revoked"


ENDED_STATES = frozenset({LeaseState.RELEASED.value, LeaseState.EXPIRED.value, LeaseState.REVOKED.value})


class EndCause(enum.StrEnum):
    """Why a lease ended, in a form a client reads without parsing prose: an ended record's
    ``cause`` is ``{"code": EndCause, "by": who, "why": the plain reason}`` (written by
    ``end_lease`` in ``lua/_lib_end.lua``), and a lease being recalled carries the ``recall_cause``
    it will end with. ``end_reason`` stays the sentence people read."""

    RELEASED = "released"  # its owner released it (why: the reason given, if any)
    HANDED = "handed"  # its owner handed its GPUs to its own next request (a sweep's next trial)
    REVOKED = "revoked"  # an admin revoked it
    EXPIRED = "expired"  # not renewed within its ttl
    WARM_MAX = "warm_max"  # kept warm with no cell for the pool's warm_max
    RECLAIMED = "reclaimed"  # its GPUs were idle and its owner did not keep it after the warning
    RECALLED = "recalled"  # recalled for a booking's holder (a borrowed lease)
    PREEMPTED = "preempted"  # preempted for a request within quota (it ran above quota)
    EVICTED = "evicted"  # a warm lease lent out to a waiting request
    OVER_MEMORY = "over_memory"  # a slice stayed over its memory past its grace: its node agent ended it
    SUSPENDED = "suspended"  # its owner handed back a warm lease with its worker suspended to host memory


# ---- the lease record ------------------------------------------------------------------------------
# What the API answers for a lease, declared once: the server builds it (leasing/lease.py
# public_lease), the OpenAPI document's Lease schema is generated from it (web/openapi.py), and the
# client reads it (client.Lease.raw). Times are epoch seconds. An Annotated string is the field's
# description in the OpenAPI document.


class GpuJson(TypedDict, total=False):
    """One leased GPU."""

    index: Required[int]
    uuid: str
    node: Annotated[str, "The node it is on (a multi-node gang's GPU)"]


class EndCauseJson(TypedDict):
    """Why a lease ended (or will), for programs: end_reason and recall_reason are the sentences for
    people."""

    code: EndCause
    by: Annotated[str, "Who ended it: a user, or server / reclaimer"]
    why: Annotated[str, "The plain reason, without advice; may be empty"]


class ElasticJson(TypedDict):
    """An elastic lease: the fewest and most GPUs it accepts (grow / shrink)."""

    min: int
    max: int


class TokenJson(TypedDict, total=False):
    """An API token as an admin sees it (GET /tokens): never its secret, which only its creation answers."""

    id: Required[Annotated[str, "Short and not secret: gpulease token revoke ID takes it"]]
    user: Required[str]
    role: Required[str]
    created: Required[float]
    expires: Annotated[float, "Refused from then on (absent: valid until revoked)"]
    last_used: Annotated[float, "Its last request, to the minute (absent: never used)"]
    acts_for: Annotated[str, "A proxy token: whom it may act for (names and globs, or re:PATTERN)"]
    node: Annotated[str, "An agent token: the one node it serves (absent: bound to the first it serves)"]


class LeaseJson(TypedDict, total=False):
    """A lease, live (state active) or ended (released, expired or revoked); an ended lease stays
    readable for the server's ended_retention, with ended_at, end_reason, ended_by and cause."""

    id: Required[str]
    user: Required[str]
    pool: Required[str]
    node: Required[str]
    gpus: Required[list[GpuJson]]
    state: Required[LeaseState]
    expires_at: Required[float]
    token: Annotated[int, "Fencing token (owner only)"]
    label: str
    session: str
    notebook: Annotated[str, "The notebook the lease's cell ran in"]
    cell: Annotated[str, "The cell it ran for"]
    ttl: float
    created_at: float
    renewed_at: float
    renewals: int
    waited: Annotated[float, "Seconds its request waited in the queue"]
    activity: Annotated[dict[str, Any], "What its holder said it is doing at its last renew"]
    warned_at: Annotated[float, "Idle: warned then, reclaimed at reclaim_at unless kept"]
    reclaim_at: float
    extensions: Annotated[int, "Times its owner kept it after an idle warning"]
    idle_evidence: Annotated[dict[str, Any], "The samples an idle reclaim went by (detail view)"]
    reservation: Annotated[str, "The booking it is served from"]
    borrowed: Annotated[bool, "Taken from booked capacity: recalled with notice when the holder asks"]
    nodes: Annotated[list[str], "A multi-node gang's nodes"]
    preemptible: bool
    priority: str
    elastic: ElasticJson
    recall_at: Annotated[float, "Being recalled: its GPUs go back then"]
    recall_reason: str
    recall_cause: Annotated[EndCauseJson, "Why it will end (a lease being recalled)"]
    recall_for: Annotated[str, "Being recalled: the user whose request its GPUs go to"]
    recalled_at: Annotated[float, "Being recalled: since then (recall_at is when its GPUs go back)"]
    ends_by: Annotated[float, "Its holder means to end it by then (a cell's --timeout; not enforced)"]
    warm_since: Annotated[
        float, "Kept warm for its notebook's next cell since then (POST .../warm): lent out if someone waits"
    ]
    warm_until: Annotated[float, "A warm lease ends then (the pool's warm_max)"]
    warm_gpu_s: Annotated[float, "GPU-seconds it was kept warm, charged apart from use"]
    shrink_to: Annotated[
        int,
        "Asked to give GPUs back for a waiting request: the size the server shrinks it to at shrink_by "
        "(its highest-indexed GPUs go) unless its owner shrinks first",
    ]
    shrink_by: float
    shrink_reason: str
    gpu_mem_mb: Annotated[
        int, "A slice: MB of its one GPU's memory promised to it (what it asked for, rounded up to the pool's unit)"
    ]
    gpu_total_mb: Annotated[int, "A slice: the memory of its GPU, in MB"]
    mem_peak_mb: Annotated[
        int,
        "An ended lease: the most GPU memory it used, in MB, as its node agent measured it (a slice: its "
        "own processes, CUDA context included; on simulated GPUs their resident memory)",
    ]
    over_memory: Annotated[
        dict[str, float],
        "A slice its node agent ended for using more than it was promised: used_mb, limit_mb, peak_mb, "
        "fit_mb (the --gpu-mem that would have held the peak) and over_s",
    ]
    ended_at: float
    end_reason: str
    ended_by: str
    cause: Annotated[EndCauseJson, "Why it ended (an ended lease)"]
    changed: Annotated[bool, "A release or revoke: false when it had ended already"]


# The reason the GPU board's Release button gives (jupyter_ext): a cell says "released from the board".
BOARD_RELEASE_REASON = "released from the board"


# ---- events ----------------------------------------------------------------------------------------


class EventType(enum.StrEnum):
    """Every ``type`` of entry the server adds to its event log (``GET /events``, ``/events/log``).

    Most come from the Lua scripts' ``emit()`` (``lua/*.lua``); ``unleased_use*`` from
    ``samples.lua``'s own XADD; ``policy_changed`` and ``unleased_killed`` from Python
    (``reclaim.set_policy``, ``reclaim.record_kills``).
    ``tests/test_protocol.py`` finds every type the sources publish and fails on one missing here.
    """

    # leases
    QUEUED = "queued"  # a request joined the queue (acquire.lua)
    GRANT = "grant"  # GPUs granted to a request, at once or from the queue (_lib_schedule.lua dispatch)
    RELEASED = "released"  # a lease ended by its owner (_lib_end.lua end_lease, the lease's new state)
    EXPIRED = "expired"  # a lease not renewed within its ttl (end_lease: sweep, a late renew)
    REVOKED = "revoked"  # a lease ended by an admin, idle reclaim, a recall or a preemption (end_lease)
    RENEW_MISS = "renew_miss"  # a renewal came after the lease's deadline: it expired (renew.lua)
    # elastic leases change size; the token stays
    GROWN = "grown"  # the owner added GPUs to an elastic lease on its node (resize.lua)
    DRAINED = "drained"  # GPUs the server took back are clean: no process of their lease is on them (drained.lua)
    # its node agent cannot end a process on them: they stay out of service for an admin (drain_abandon.lua)
    DRAIN_ABANDONED = "drain_abandoned"
    # free GPUs a process no lease covers uses: out of the pool until clean (unleased_hold.lua)
    UNLEASED_HELD = "unleased_held"
    SHRUNK = "shrunk"  # a lease gave GPUs back: its owner (resize.lua), or the server when a shrink notice ran out
    # an elastic lease above its minimum is asked to give GPUs back for a waiting request by shrink_by,
    # else the server shrinks it to shrink_to (_lib_schedule.lua ask_to_shrink; sweep.lua)
    SHRINK_NOTICE = "shrink_notice"
    # queued requests that leave the queue without a grant (cancel_wait.lua: 'wait_' .. reason)
    WAIT_TIMEOUT = "wait_timeout"  # its wait ran out (LeaseStore.acquire)
    WAIT_CANCELLED = "wait_cancelled"  # its client went away, or it was withdrawn (DELETE; release.lua)
    WAIT_ABANDONED = "wait_abandoned"  # past its deadline, its client gone: the sweep dropped it (sweep.lua)
    # recalls: the lease keeps its GPUs until recall_at, then it is revoked (_lib_recall.lua recall)
    PREEMPT_NOTICE = "preempt_notice"  # a preemptible lease above quota is preempted for a request within it
    BORROW_RECALLED = "borrow_recalled"  # a lease borrowed from a booking's GPUs is recalled for the booking
    # warm leases: a finished cell's worker kept for the notebook's next cell (warm.lua); lendable
    WARM = "warm"  # a lease was kept warm: it runs nothing, and whoever would otherwise wait evicts it
    RESUMED = "resumed"  # a warm lease runs a cell again
    EVICTING = "evicting"  # a warm lease evicted for a waiter: revoked at recall_at (_lib_recall.lua recall)
    # suspend to host (suspend.lua, drained.lua, unsuspend.lua): an evicted warm lease's worker lives
    # on off the GPU (bytes of GPU state to host, ms), restored onto its notebook's next lease, or ended
    SUSPENDED = "suspended"
    RESTORED = "restored"
    SUSPEND_ENDED = "suspend_ended"
    # idle reclaim
    IDLE_WARNING = "idle_warning"  # a lease's GPUs have been idle: reclaimed at reclaim_at (idle_warn.lua)
    IDLE_CLEARED = "idle_cleared"  # a warned lease's GPUs got busy again (keep.lua)
    IDLE_KEPT = "idle_kept"  # a warned lease's owner kept it ("Still using it"; keep.lua)
    RECLAIMED = "reclaimed"  # a warned lease was taken back (reclaim.lua; a "revoked" follows)
    # nodes and GPUs
    NODE_REGISTERED = "node_registered"  # a node agent registered a new node, or a changed inventory (register.lua)
    NODE_UP = "node_up"  # a node that was down heartbeats again (register.lua)
    NODE_DOWN = "node_down"  # a node missed its heartbeats: its GPUs are down (_lib.lua)
    UNLEASED_USE = "unleased_use"  # processes on a GPU that no lease holds (samples.lua)
    UNLEASED_USE_ENDED = "unleased_use_ended"  # that GPU is clear again (samples.lua)
    # its node agent sent SIGTERM (or, after the grace, SIGKILL) to such a process: the pool's
    # unleased_action is "kill" (reclaim.record_kills)
    UNLEASED_KILLED = "unleased_killed"
    # slices held to their memory (lease_server/node/memwatch.py; over_memory.lua): a slice's
    # processes use more than it was promised (its cell says so), and then, still over past the
    # grace, its node agent ended it (a "revoked" follows)
    OVER_MEMORY_WARNING = "over_memory_warning"
    OVER_MEMORY = "over_memory"
    # bookings (their values keep the word of the first release: the event log stores them, and
    # readers of the live feed and of exports match on them)
    BOOKING_CREATED = "reservation_created"  # a booking was made (book.lua)
    BOOKING_CHANGED = "reservation_changed"  # a booking was changed (book.lua)
    BOOKING_CANCELLED = "reservation_cancelled"  # a booking was cancelled (unbook.lua)
    BOOKING_ENDED = "reservation_ended"  # a booking's current occurrence was ended early (unbook.lua)
    BOOKING_NO_SHOW = "reservation_no_show"  # a booking's occurrence unused by its deadline: GPUs freed (sweep.lua)
    # a lease served from a booking goes on as an ordinary lease (quota, recall): its occurrence
    # ended, was ended, or the booking was cancelled (_lib_end.lua leave_booking)
    BOOKING_LEASE_FREED = "booking_lease_freed"
    # policy
    POLICY_CHANGED = "policy_changed"  # an admin changed a pool's idle reclaim policy (reclaim.set_policy)
    # multi_user: a node agent was asked to tie a process of another account to a lease (drain.record_claim)
    CLAIM_REFUSED = "claim_refused"


# The groups below are plain strings (a type read off the wire is a str): the labextension's lists
# in labextension/src/model.ts must equal them (tests/test_protocol.py), and every type is in
# exactly one group, so a new type is a decision about who watches it.

# After these the GPU board may have changed: the board refetches (model.ts BOARD_EVENTS).
BOARD_EVENTS = frozenset(
    e.value
    for e in (
        EventType.GRANT,
        EventType.RELEASED,
        EventType.EXPIRED,
        EventType.REVOKED,
        EventType.QUEUED,
        EventType.WAIT_TIMEOUT,
        EventType.WAIT_CANCELLED,
        EventType.WAIT_ABANDONED,
        EventType.NODE_REGISTERED,
        EventType.NODE_UP,
        EventType.NODE_DOWN,
        EventType.IDLE_WARNING,
        EventType.IDLE_CLEARED,
        EventType.IDLE_KEPT,
        EventType.RECLAIMED,
        EventType.UNLEASED_USE,
        EventType.UNLEASED_USE_ENDED,
        EventType.PREEMPT_NOTICE,
        EventType.BORROW_RECALLED,
        EventType.GROWN,
        EventType.SHRUNK,
        EventType.SHRINK_NOTICE,
        EventType.DRAINED,
        EventType.DRAIN_ABANDONED,
        EventType.UNLEASED_HELD,
        EventType.WARM,
        EventType.RESUMED,
        EventType.EVICTING,
        EventType.SUSPENDED,
        EventType.RESTORED,
        EventType.SUSPEND_ENDED,
    )
)

# What a stream of changes (GET /events?changes=true) sends for many events: not an event of the
# log, and in no group below (model.ts CHANGES_EVENT; lease_server/leasing/events.py EventHub).
CHANGES_EVENT = "changed"

# After these bookings changed: the calendar and My bookings refetch, the board too (model.ts
# BOOKING_EVENTS).
BOOKING_EVENTS = frozenset(
    e.value
    for e in (
        EventType.BOOKING_CREATED,
        EventType.BOOKING_CHANGED,
        EventType.BOOKING_CANCELLED,
        EventType.BOOKING_ENDED,
        EventType.BOOKING_NO_SHOW,
    )
)

# In the log only: nothing any view shows changes with them.
LOG_ONLY_EVENTS = frozenset(
    e.value
    for e in (
        EventType.RENEW_MISS,
        EventType.POLICY_CHANGED,
        EventType.UNLEASED_KILLED,
        EventType.OVER_MEMORY_WARNING,
        EventType.OVER_MEMORY,
        EventType.BOOKING_LEASE_FREED,
        EventType.CLAIM_REFUSED,
    )
)

# A lease's own stream ends with one of these: the type is the lease's new state.
ENDED_EVENTS = frozenset(e.value for e in (EventType.RELEASED, EventType.EXPIRED, EventType.REVOKED))

# A lease was recalled: it keeps its GPUs until its recall_at, then it is revoked.
RECALL_EVENTS = frozenset(e.value for e in (EventType.PREEMPT_NOTICE, EventType.BORROW_RECALLED, EventType.EVICTING))

# A live lease's GPUs changed, its token did not: whoever runs on it reads its GPUs again (GET).
RESIZE_EVENTS = frozenset(e.value for e in (EventType.GROWN, EventType.SHRUNK))


# ---- text ------------------------------------------------------------------------------------------

# What no label or name may hold (the server refuses it with a 400 naming the code point): control
# characters (C0, DEL, C1: an escape sequence in a label would reach the terminal of an admin running
# gpulease status), the characters that make text read other than it is stored (bidi marks,
# embeddings, overrides and isolates: "Trojan Source") and line or paragraph separators. A regular
# expression character range, read alike by Python and ECMA-262 (the OpenAPI document's patterns).
UNSAFE_CHARS = "\\x00-\\x1f\\x7f-\\x9f\\u061c\\u200e\\u200f\\u2028-\\u202e\\u2066-\\u2069"
_UNSAFE = re.compile(f"[{UNSAFE_CHARS}]")


def escaped(text: object) -> str:
    """``text`` with each unsafe character written as its escape (``\\x1b``, ``\\u202e``): how a
    terminal shows text stored before the server refused them, so it cannot act on the terminal."""
    return _UNSAFE.sub(lambda m: m[0].encode("unicode_escape").decode("ascii"), str(text))


def plain(text: str) -> str:
    """``text`` with each unsafe character turned into a space: a label a client derives from what
    it does not control (a cell's first line) is one the server takes."""
    return _UNSAFE.sub(" ", text)
