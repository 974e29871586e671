"""The server's background loops: the sweeper (expiry, dead nodes, abandoned waiters, recalls,
no-show bookings) and the idle-GPU reclaimer. Every replica runs both; the scripts they call are
atomic, so replicas may race freely."""

from __future__ import annotations

import asyncio
import logging

from .aio import cancel_and_wait
from .lease import LeaseStore
from .reclaim import Reclaimer
from .scripts import SweepCounts

log = logging.getLogger(__name__)


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
        done = await self.store.sweep()
        if done.expired or done.nodes_down or done.waiters_dropped or done.recalled:
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
