"""The wait queue: waking blocked requests when they are granted, and the queue's public view.

Queued requests live in Redis (``queue`` and ``waiters``, see keys.py) and are served inside the
Lua scripts. A server process that blocks an HTTP request on a queued waiter does not poll: the
script that grants it publishes the waiter id on the ``grants`` channel, and one subscription per
process sets the matching :class:`asyncio.Event`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

from redis.asyncio import Redis

from ..aio import cancel_and_wait
from ..store.keys import Keys

log = logging.getLogger(__name__)


class GrantNotifier:
    """One pub/sub subscription per process, fanned out to the coroutines waiting for a grant."""

    def __init__(self, redis: Redis, channel: str) -> None:
        self.redis = redis
        self.channel = channel
        # Several coroutines may wait on one id (a client resending its request): each has its own.
        self._events: dict[str, set[asyncio.Event]] = {}
        self._task: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()

    def expect(self, waiter_id: str) -> asyncio.Event:
        ev = asyncio.Event()
        self._events.setdefault(waiter_id, set()).add(ev)
        return ev

    def forget(self, waiter_id: str, ev: asyncio.Event) -> None:
        waiting = self._events.get(waiter_id)
        if waiting is not None:
            waiting.discard(ev)
            if not waiting:
                del self._events[waiter_id]

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._listen(), name="gpulease-grant-notifier")
            await asyncio.wait_for(self._ready.wait(), timeout=10)

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    async def _listen(self) -> None:
        while True:
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.channel)
                self._ready.set()
                # Whatever was published while we were not subscribed is lost: wake every waiter
                # so that each checks Redis itself.
                for waiting in list(self._events.values()):
                    for ev in list(waiting):
                        ev.set()
                while True:
                    # A bounded read, well inside the client's socket timeout, so an idle channel
                    # does not look like a dropped connection.
                    msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if msg and msg.get("type") == "message":
                        for ev in list(self._events.get(msg["data"], ())):
                            ev.set()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # connection lost: resubscribe after a short pause
                log.warning("grant notifier lost its subscription (%s); resubscribing", exc)
                await asyncio.sleep(0.5)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()


async def queue_view(redis: Redis, keys: Keys, pool: str | None = None) -> list[dict[str, Any]]:
    """Waiters in FIFO order per pool, with their 1-based position (approximate under fair share)."""
    lo, hi = ("-", "+") if pool is None else (f"[{pool}|", f"({pool}|~")
    members: Any = await redis.zrangebylex(keys.queue, lo, hi)
    if not members:
        return []
    ids = [m.rsplit("|", 1)[1] for m in members]
    raws = await redis.hmget(keys.waiters, ids)
    out: list[dict[str, Any]] = []
    positions: dict[str, int] = {}
    for raw in raws:
        if raw is None:
            continue
        w = json.loads(raw)
        positions[w["pool"]] = positions.get(w["pool"], 0) + 1
        out.append(
            {
                "id": w["id"],
                "user": w["user"],
                "pool": w["pool"],
                "gpus": w["gpus"],
                "label": w.get("label", ""),
                "position": positions[w["pool"]],
                "enqueued_at": w["enqueued_at"] / 1000,
                "deadline": w["deadline"] / 1000,
            }
        )
    return out
