"""The event log: a Redis stream of every grant, release, expiry, revoke, renew miss, queue and
node change. One reader per server process fans new entries out to live subscribers (SSE)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from ..aio import cancel_and_wait
from ..protocol import CHANGES_EVENT

log = logging.getLogger(__name__)


def parse_entry(entry_id: str, fields: dict[str, str]) -> dict[str, Any]:
    """An event as the API shows it: ``id`` is always the log entry's id (what ``since`` and
    ``Last-Event-ID`` resume from); a booking event's own id is its ``reservation`` (the
    field's name since the first release: readers match on it)."""
    data = json.loads(fields.get("data", "{}"))
    ts = data.pop("ts", None)
    if "id" in data:
        data["reservation"] = data.pop("id")
    return {**data, "id": entry_id, "type": fields.get("type", ""), "ts": ts / 1000 if ts else None}


def for_reader(ev: dict[str, Any], user: str, admin: bool) -> dict[str, Any]:
    """An event as ``user`` may read it: a lease's fencing token only in the events of the reader's
    own leases (an admin's: all). With another's token, a user who also learns a lease id could
    pass the fencing check of a request that the owner check does not guard. (A copy: the stream
    hands the same event to every subscriber.)"""
    if admin or "token" not in ev or ev.get("user") == user:
        return ev
    return {k: v for k, v in ev.items() if k != "token"}


class Fanned(dict[str, Any]):
    """An event the hub hands to every live stream: the same object to all of them, so its text on
    the wire is made once per form (with the fencing token, or without it: for_reader), not once
    per follower (bench/fanout_bench.py: with 3,000 followers, encoding each event for each was most
    of the server's CPU per event)."""

    __slots__ = ("_wire",)

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._wire: dict[bool, str] = {}

    def wire(self, full: bool, make: Any) -> str:
        """The text ``make(event as that reader may read it)`` gives, made once per form."""
        text = self._wire.get(full)
        if text is None:
            text = self._wire[full] = make(self if full else {k: v for k, v in self.items() if k != "token"})
        return text


def full_for(ev: dict[str, Any], user: str, admin: bool) -> bool:
    """Whether ``user`` reads ``ev`` whole, its fencing token included (for_reader)."""
    return admin or "token" not in ev or ev.get("user") == user


# Entries read per XRANGE when filtering: the stream is capped (event_log_max), so a
# filtered read scans at most the whole of it, a page at a time. Small enough that parsing one
# page holds the server's event loop for a few milliseconds only.
FILTER_PAGE = 200


EVENT_PEOPLE = ("user", "owner", "by", "requested_by")  # the fields of an event that name a person


def event_of_user(ev: dict[str, Any], user: str) -> bool:
    """Whether an event is ``user``'s: the lease's holder, the booking's owner, who acted or who
    asked (``GET /events/log?user=``, ``gpulease events --user``)."""
    return any(ev.get(field) == user for field in EVENT_PEOPLE)


@dataclass(frozen=True)
class LogQuery:
    """A read of the event log (``GET /api/v1/events/log``): oldest first after ``since``, or
    newest first (``desc``) before ``before``, down to ``since``; only the entries that pass the
    filters, up to ``limit`` of them."""

    since: str = "-"  # exclusive; "-": from the oldest kept
    limit: int = 100
    lease: str | None = None  # only entries whose ``lease`` field is this id
    before: str | None = None  # exclusive; None: up to the newest
    desc: bool = False
    types: frozenset[str] = frozenset()  # only these types (empty: all)
    user: str | None = None  # only entries of this user (protocol.event_of_user)

    def keeps(self, ev: dict[str, Any]) -> bool:
        if self.lease is not None and ev.get("lease") != self.lease:
            return False
        if self.types and ev.get("type") not in self.types:
            return False
        return self.user is None or event_of_user(ev, self.user)

    @property
    def filtered(self) -> bool:
        return self.lease is not None or bool(self.types) or self.user is not None


async def read_log(
    redis: Redis, key: str, q: LogQuery, on_page: Callable[[int], Awaitable[None]] | None = None
) -> list[dict[str, Any]]:
    """The entries ``q`` asks for, in its order.

    Redis cannot filter a stream, so a filtered read takes pages of ``FILTER_PAGE`` entries (in the
    order asked) and keeps what passes, until ``limit`` entries passed or the range ends.
    ``on_page(n)`` is awaited after each page of ``n`` entries read: what the read cost (the API
    counts it against the token's budget, web/limits.py)."""
    lo = "-" if q.since in ("-", "", "0") else f"({q.since}"
    hi = "+" if q.before is None else f"({q.before}"
    out: list[dict[str, Any]] = []
    page_size = FILTER_PAGE if q.filtered else q.limit
    while len(out) < q.limit:
        page: Any = await (
            redis.xrevrange(key, hi, lo, count=page_size) if q.desc else redis.xrange(key, lo, hi, count=page_size)
        )
        if on_page is not None:
            await on_page(len(page))
        for entry_id, fields in page:
            ev = parse_entry(entry_id, fields)
            if q.keeps(ev):
                out.append(ev)
                if len(out) == q.limit:
                    break
        if len(page) < page_size or not q.filtered:
            break
        if q.desc:
            hi = f"({page[-1][0]}"
        else:
            lo = f"({page[-1][0]}"
    return out


# A stream of changes (GET /events?changes=true) gets at most one "changed" a CHANGES_EVERY_S.
CHANGES_EVERY_S = 0.5
CHANGED = CHANGES_EVENT  # its type: not an event of the log


class EventHub:
    """Blocks on XREAD for new entries and hands them to the subscribers that want them:

    * every entry, to a subscriber of everything (``gpulease events --follow``, the node watch);
    * a lease's entries, to the subscribers of that lease (a running cell's watchdog): found by
      the entry's ``lease``, so an entry costs one lookup however many cells follow their leases;
    * one ``changed`` entry for many, to the subscribers of changes (every open JupyterLab's board,
      which only refetches): at once for the first entry after a quiet spell, then at most one every
      ``changes_every_s``, naming the types of the entries it stands for and carrying the newest
      one's id. What each entry costs is then one set insertion, not a write to each open Lab.
    """

    def __init__(self, redis: Redis, key: str, changes_every_s: float = CHANGES_EVERY_S) -> None:
        self.redis = redis
        self.key = key
        self.changes_every_s = changes_every_s
        self._subs: set[asyncio.Queue[dict[str, Any] | None]] = set()
        self._by_lease: dict[str, set[asyncio.Queue[dict[str, Any] | None]]] = {}
        self._changes: set[asyncio.Queue[dict[str, Any] | None]] = set()
        self._kind: dict[asyncio.Queue[dict[str, Any] | None], str | None] = {}  # queue -> lease, "" changes, None all
        self._pending: dict[str, Any] | None = None  # the changed entry being gathered
        self._last_changed = -float("inf")  # (loop time)
        self._changed_due: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[None] | None = None
        self._started = asyncio.Event()

    async def subscribe(self, lease: str | None = None, changes: bool = False) -> asyncio.Queue[dict[str, Any] | None]:
        """A queue of every entry added from now on, or only of lease ``lease``'s, or of changes
        (see the class). The hub knows where "now" is before this returns, so nothing added after
        the call is missed."""
        q: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue(maxsize=10_000)
        if changes:
            self._changes.add(q)
            self._kind[q] = ""
        elif lease is not None:
            self._by_lease.setdefault(lease, set()).add(q)
            self._kind[q] = lease
        else:
            self._subs.add(q)
            self._kind[q] = None
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="gpulease-event-hub")
        await self._started.wait()
        return q

    def is_subscribed(self, q: asyncio.Queue[dict[str, Any] | None]) -> bool:
        return q in self._kind

    def unsubscribe(self, q: asyncio.Queue[dict[str, Any] | None]) -> None:
        if q not in self._kind:
            return
        kind = self._kind.pop(q)
        if kind == "":
            self._changes.discard(q)
        elif kind is None:
            self._subs.discard(q)
        else:
            followers = self._by_lease.get(kind)
            if followers is not None:
                followers.discard(q)
                if not followers:
                    del self._by_lease[kind]

    @property
    def followers(self) -> int:
        return len(self._kind)

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        if self._changed_due is not None:
            self._changed_due.cancel()
            self._changed_due = None
        for q in list(self._kind):
            with contextlib.suppress(asyncio.QueueFull):
                q.put_nowait(None)

    def _put(self, q: asyncio.Queue[dict[str, Any] | None], event: dict[str, Any]) -> None:
        try:
            q.put_nowait(event)
        except asyncio.QueueFull:  # a stalled client: drop it rather than grow
            self.unsubscribe(q)

    def _hand_out(self, event: Fanned) -> None:
        for q in list(self._subs):
            self._put(q, event)
        lease = event.get("lease")
        if isinstance(lease, str) and lease in self._by_lease:
            for q in list(self._by_lease[lease]):
                self._put(q, event)
        if self._changes:
            p = self._pending
            if p is None:
                p = self._pending = {"types": set(), "events": 0}
            p["types"].add(event["type"])
            p["events"] += 1
            p["id"], p["ts"] = event["id"], event.get("ts")

    def _schedule_changed(self) -> None:
        """Send the gathered changes now, or when the last ``changed`` is ``changes_every_s`` old."""
        if self._pending is None or self._changed_due is not None:
            return
        loop = asyncio.get_running_loop()
        due = self._last_changed + self.changes_every_s
        if loop.time() >= due:
            self._send_changed()
        else:
            self._changed_due = loop.call_at(due, self._send_changed)

    def _send_changed(self) -> None:
        self._changed_due = None
        p, self._pending = self._pending, None
        if p is None:
            return
        self._last_changed = asyncio.get_running_loop().time()
        event = Fanned(id=p["id"], type=CHANGED, types=sorted(p["types"]), events=p["events"], ts=p["ts"])
        for q in list(self._changes):
            self._put(q, event)

    async def _run(self) -> None:
        # Start after the newest entry by its id, not "$": "$" would skip entries added while a
        # failed read is retried. Block well below the client's socket timeout (redis-py: 5 s).
        last = ""
        while True:
            try:
                if not last:
                    newest: Any = await self.redis.xrevrange(self.key, "+", "-", count=1)
                    last = newest[0][0] if newest else "0-0"
                    self._started.set()
                reply: Any = await self.redis.xread({self.key: last}, block=2000, count=500)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("event hub: read failed (%s); retrying", exc)
                await asyncio.sleep(0.5)
                continue
            for _stream, entries in reply or []:
                for entry_id, fields in entries:
                    last = entry_id
                    self._hand_out(Fanned(parse_entry(entry_id, fields)))  # one object for every stream
            self._schedule_changed()


def event_nodes(ev: dict[str, Any]) -> set[str]:
    """The nodes an event names: its ``node``, a gang's ``nodes`` and the nodes of its ``parts``."""
    out: set[str] = set()
    if isinstance(ev.get("node"), str):
        out.add(ev["node"])
    for node in ev.get("nodes") or ():
        if isinstance(node, str):
            out.add(node)
    for part in ev.get("parts") or ():
        if isinstance(part, dict) and isinstance(part.get("node"), str):
            out.add(part["node"])
    return out


class NodeWatch:
    """Wakes what waits on a node (a node agent's long-poll of its draining GPUs) when an event
    names that node. One subscriber of the hub for every waiter of the process, so an event costs a
    lookup by node, not a queue per waiting agent: 1,250 idle agents cost nothing between events.
    A waiter re-reads the state it waits on after each wake-up; the events only say when to."""

    def __init__(self, hub: EventHub) -> None:
        self.hub = hub
        self._waiters: dict[str, set[asyncio.Event]] = {}
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    async def watch(self, node: str) -> asyncio.Event:
        """An event set at the next change on ``node`` from now on (unwatch it when done)."""
        async with self._lock:
            if self._task is None or self._task.done():
                q = await self.hub.subscribe()  # before the caller's read: no change falls in between
                self._task = asyncio.create_task(self._run(q), name="gpulease-node-watch")
        woken = asyncio.Event()
        self._waiters.setdefault(node, set()).add(woken)
        return woken

    def unwatch(self, node: str, woken: asyncio.Event) -> None:
        waiters = self._waiters.get(node)
        if waiters is not None:
            waiters.discard(woken)
            if not waiters:
                del self._waiters[node]

    async def _run(self, q: asyncio.Queue[dict[str, Any] | None]) -> None:
        try:
            while self.hub.is_subscribed(q):
                try:
                    ev = await asyncio.wait_for(q.get(), timeout=5.0)  # (and look whether the hub dropped us)
                except TimeoutError:
                    continue
                if ev is None:
                    break
                for node in event_nodes(ev):
                    for woken in self._waiters.get(node, ()):
                        woken.set()
        finally:
            self.hub.unsubscribe(q)
            # Stopped or dropped: every waiter re-reads now (the next watch() subscribes again).
            for waiters in self._waiters.values():
                for woken in waiters:
                    woken.set()
