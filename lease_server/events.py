"""The event log: a Redis stream of every grant, release, expiry, revoke, renew miss, queue and
node change. One reader per server process fans new entries out to live subscribers (SSE)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

from redis.asyncio import Redis

from .aio import cancel_and_wait

log = logging.getLogger(__name__)


def parse_entry(entry_id: str, fields: dict[str, str]) -> dict[str, Any]:
    """An event as the API shows it: ``id`` is always the log entry's id (what ``since`` and
    ``Last-Event-ID`` resume from); a booking event's own id is its ``reservation``."""
    data = json.loads(fields.get("data", "{}"))
    ts = data.pop("ts", None)
    if "id" in data:
        data["reservation"] = data.pop("id")
    return {**data, "id": entry_id, "type": fields.get("type", ""), "ts": ts / 1000 if ts else None}


# Entries read per XRANGE when filtering by lease: the stream is capped (event_log_max), so a
# filtered read scans at most the whole of it, a page at a time.
FILTER_PAGE = 1000


async def read_log(
    redis: Redis, key: str, since: str = "-", limit: int = 100, lease: str | None = None
) -> list[dict[str, Any]]:
    """Entries after ``since`` (exclusive; "-" for the oldest kept), oldest first.

    With ``lease``, only entries whose ``lease`` field is that id: up to ``limit`` of them, however
    many other entries lie between (Redis cannot filter a stream, so pages are read and filtered).
    """
    lo = "-" if since in ("-", "", "0") else f"({since}"
    if lease is None:
        entries: Any = await redis.xrange(key, lo, "+", count=limit)
        return [parse_entry(i, f) for i, f in entries]
    out: list[dict[str, Any]] = []
    while len(out) < limit:
        page: Any = await redis.xrange(key, lo, "+", count=FILTER_PAGE)
        for entry_id, fields in page:
            ev = parse_entry(entry_id, fields)
            if ev.get("lease") == lease:
                out.append(ev)
                if len(out) == limit:
                    break
        if len(page) < FILTER_PAGE:
            break
        lo = f"({page[-1][0]}"
    return out


class EventHub:
    """Blocks on XREAD for new entries and hands them to every subscriber's queue."""

    def __init__(self, redis: Redis, key: str) -> None:
        self.redis = redis
        self.key = key
        self._subs: set[asyncio.Queue[dict[str, Any] | None]] = set()
        self._task: asyncio.Task[None] | None = None
        self._started = asyncio.Event()

    async def subscribe(self) -> asyncio.Queue[dict[str, Any] | None]:
        """A queue of every entry added from now on (the hub knows where "now" is before this
        returns, so nothing added after the call is missed)."""
        q: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue(maxsize=10_000)
        self._subs.add(q)
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="gpulease-event-hub")
        await self._started.wait()
        return q

    def is_subscribed(self, q: asyncio.Queue[dict[str, Any] | None]) -> bool:
        return q in self._subs

    def unsubscribe(self, q: asyncio.Queue[dict[str, Any] | None]) -> None:
        self._subs.discard(q)

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        for q in self._subs:
            with contextlib.suppress(asyncio.QueueFull):
                q.put_nowait(None)

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
                    event = parse_entry(entry_id, fields)
                    for q in list(self._subs):
                        try:
                            q.put_nowait(event)
                        except asyncio.QueueFull:  # a stalled client: drop it rather than grow
                            self._subs.discard(q)
