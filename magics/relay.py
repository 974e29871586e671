"""A sweep's relay: a finished call's worker process kept for its owner's next request on the same
GPUs, handed over by the lease server in the same step as it ends the finished lease."""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
from collections.abc import Callable

from lease_server import errors
from lease_server.client import HeldLease, Lease

from .session import READY_WAIT_S, Session, Worker
from .worker import verify_gone
from .world import World

log = logging.getLogger(__name__)


class Relay:
    """Keeps a finished call's worker process for its owner's next request on the same GPUs: a
    sweep's next trial then starts at once instead of on a fresh process (Ray Tune's
    ``reuse_actors``, with the lease server deciding). Only when the lease server grants that
    request exactly those GPUs in the same step as it ends the finished call's lease
    (``lua/handoff.lua``: nobody else waits in the pool), so no other holder ever meets the process.

    ``next_requests(lease_id)`` names the requests that may get the GPUs (the sweep's queued
    trials; the server gives them to the pool's oldest waiter, which must be one of them). A
    request that will never run here is :meth:`drop`-ped first, which ends a process kept for it
    (seen gone) before its lease can be released; after that no process is handed to it."""

    def __init__(self, sess: Session, next_requests: Callable[[str], list[str]]) -> None:
        self.sess = sess
        self.next_requests = next_requests
        self._lock = threading.Lock()
        self._kept: dict[str, tuple[Worker, str, list[int]]] = {}
        self._closed: set[str] = set()
        self.handed = 0
        self.refused: collections.Counter[str] = collections.Counter()  # why not, by reason

    def pass_on(self, held: HeldLease, world: World) -> str | None:
        """Hand ``held`` and ``world``'s one worker to the next request; its id, or None (then the
        caller ends the worker and releases the lease as usual). Handed on, the worker is no
        longer ``world``'s."""
        import ray

        if len(world.ranks) != 1 or world.pg is not None or world.cpu:
            return None
        rank = world.ranks[0]
        rids = self.next_requests(held.lease.id)
        if not rids:
            return None
        try:
            if not ray.get(rank.worker.handle.recycle.remote(), timeout=READY_WAIT_S):
                return None
        except Exception:  # noqa: BLE001 - the process is not fit for another call: end it
            return None
        indexes = [g["index"] for g in held.lease.gpus]
        with self._lock:  # a drop() of a request waits for this, so it sees the worker kept for it
            rids = [r for r in rids if r not in self._closed][:64]
            if not rids:
                return None
            try:
                new = held.hand_off(rids)
            except errors.GpuLeaseError as exc:
                self.refused[str(exc.message).split(": ", 1)[-1].split(";")[0]] += 1
                log.debug("no handoff of %s: %s", held.lease.id, exc)
                return None
            self._kept[new.id] = (rank.worker, held.lease.node, indexes)
            self.handed += 1
        world.take()
        return new.id

    def claim(self, lease: Lease) -> Worker | None:
        """The worker kept for ``lease`` (its request's id), if its GPUs are exactly the lease's."""
        with self._lock:
            self._closed.add(lease.id)
            kept = self._kept.pop(lease.id, None)
        if kept is None:
            return None
        worker, node, indexes = kept
        if node == lease.node and indexes == [g["index"] for g in lease.gpus]:
            return worker
        self._end(worker, node, indexes)
        return None

    def drop(self, rid: str) -> None:
        """``rid`` will not run here (withdrawn, stopped): end any worker kept for it and see its
        process gone, before anyone releases the lease it may have been handed."""
        with self._lock:
            self._closed.add(rid)
            kept = self._kept.pop(rid, None)
        if kept is not None:
            self._end(*kept)

    def close(self) -> None:
        with self._lock:
            kept, self._kept = list(self._kept.values()), {}
        for k in kept:
            self._end(*k)

    def _end(self, worker: Worker, node: str, indexes: list[int]) -> None:
        import ray

        try:
            where = worker.where(timeout=READY_WAIT_S)
        except Exception:  # noqa: BLE001
            where = None
        with contextlib.suppress(Exception):
            ray.kill(worker.handle, no_restart=True)
        if where is not None:
            if where.machine == self.sess.machine:
                verify_gone(where.pid, [], indexes, where.start)
            else:
                with contextlib.suppress(Exception):
                    ray.get(self.sess.spare(node).handle.reap.remote(where.pid, [], indexes, where.start), timeout=30)
