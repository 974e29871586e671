"""The server's background loops: the sweeper (expiry, dead nodes, abandoned waiters, recalls,
no-show bookings) and the idle-GPU reclaimer. Every replica runs both; the scripts they call are
atomic, so replicas may race freely.

The sweep script answers only counts; what it changed is logged one line each from the event log
it wrote (the entries after the last one before the sweep)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ..aio import cancel_and_wait
from ..protocol import EventType
from ..store.scripts import SweepCounts
from .events import LogQuery, read_log
from .lease import LeaseStore
from .reclaim import Reclaimer

log = logging.getLogger(__name__)

# The most event-log entries read back after one sweep to log what it changed.
LOG_READBACK = 2000


class Reaper:
    def __init__(self, store: LeaseStore) -> None:
        self.store = store
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self.sweep_forever(), name="gpulease-sweeper"),
            asyncio.create_task(Reclaimer(self.store.engine).run_forever(self._stop), name="gpulease-reclaimer"),
        ]

    async def stop(self) -> None:
        self._stop.set()
        for task in self._tasks:
            await cancel_and_wait(task)

    async def sweep_once(self) -> SweepCounts:
        redis, key = self.store.engine.redis, self.store.engine.keys.events
        newest: Any = await redis.xrevrange(key, "+", "-", count=1)
        mark = newest[0][0] if newest else "-"
        done = await self.store.sweep()
        if (
            done.expired
            or done.nodes_down
            or done.waiters_dropped
            or done.recalled
            or done.booking_checks
            or done.shrunk
        ):
            written = await read_log(redis, key, LogQuery(since=mark, limit=LOG_READBACK))
            for ev in written:
                log_sweep_event(ev)
            if len(written) == LOG_READBACK:  # a big sweep: the rest in one line
                log.info(
                    "sweep: %d leases expired, %d nodes down, %d waiters dropped, %d borrowed leases recalled",
                    done.expired,
                    done.nodes_down,
                    done.waiters_dropped,
                    done.recalled,
                )
        return done

    async def sweep_forever(self) -> None:
        interval = self.store.settings.sweep_interval
        while not self._stop.is_set():
            try:
                await self.sweep_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away: keep trying, the state is safe in Redis
                log.warning("sweep failed: %s", exc)
            try:
                await asyncio.wait_for(self._stop.wait(), timeout=interval)
            except TimeoutError:
                pass


def log_sweep_event(ev: dict[str, Any]) -> None:
    """One line for an event-log entry the sweep writes; others (from requests in between) are
    logged where they happen."""
    kind, by = ev.get("type"), ev.get("by")
    if kind in (EventType.EXPIRED, EventType.REVOKED) and by == "server":
        why = "not renewed in time" if kind == EventType.EXPIRED else "its recall notice ran out"
        lease, user, pool, node = (ev.get(k) for k in ("lease", "user", "pool", "node"))
        log.info("%s %s user=%s pool=%s node=%s by=server (%s)", kind, lease, user, pool, node, why)
    elif kind == EventType.SHRUNK and by == "server":
        log.info(
            "shrunk %s user=%s pool=%s node=%s by=server to %s GPU(s), gave back %s (its shrink notice ran out)",
            ev.get("lease"),
            ev.get("user"),
            ev.get("pool"),
            ev.get("node"),
            ev.get("size"),
            ev.get("gpus"),
        )
    elif kind == EventType.NODE_DOWN:
        log.info("node %s down (pool %s): %s", ev.get("node"), ev.get("pool"), ev.get("reason"))
    elif kind == EventType.WAIT_ABANDONED:
        log.info(
            "wait %s abandoned user=%s pool=%s gpus=%s", ev.get("lease"), ev.get("user"), ev.get("pool"), ev.get("gpus")
        )
    elif kind == EventType.BOOKING_NO_SHOW:
        log.info(
            "booking no-show %s owner=%s pool=%s gpus=%s occurrence=%s: its GPUs are free",
            ev.get("reservation"),
            ev.get("owner"),
            ev.get("pool"),
            ev.get("gpus"),
            ev.get("k"),
        )
