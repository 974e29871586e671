"""The node agent's suspended workers: suspended on a suspend's drain, ended or restored later.

``lua/suspend.lua`` ends a warm lease and puts its GPU in draining as a *suspend*, naming the one
process that claimed the lease at this agent. On its drain pass the agent (:meth:`OnHost.drain`):

1. checks the process as a drain would (:func:`claims.refusal`, the same start time and uid);
2. measures its GPU memory (NVML's reading of that pid; on simulated GPUs its resident memory,
   the slices' stand-in) and suspends it (``suspend.py``: the CUDA checkpoint API, or nothing on
   simulated GPUs);
3. on an NVML node, sees NVML list none of it on the GPU;
4. reports the GPU clean with the worker named (``drained.lua``): the worker is recorded in
   ``suspended``, the GPU is free and the waiter granted in the same script.

Anything else (no suspender, not exactly one claimed process still running, a refusal, a failed
checkpoint, NVML still listing it) leaves the entry to the ordinary drain, which ends the process:
the GPU is never lent while the worker is on it. A worker stays suspended until (:meth:`upkeep`)
its lease's warm_max (``until``), until the node's suspended workers hold more host memory than
``suspend_host_budget_gb`` (the owner of the worker that did not fit loses their own oldest, never
another user's), or until its process is gone; each end is
one ``suspend_ended`` event its notebook's next cell reads. :meth:`restore` answers a worker that
claimed a new lease here and asks to be restored: only a process suspended here, for itself.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from .. import errors, procs
from ..leasing.inventory import NodeInventory
from ..store.engine import Engine
from ..store.scripts import Unsuspend
from .claims import Claim, Peer, refusal
from .drain import Draining, drained
from .enforce import Enforcer
from .suspend import Snapshot, Suspender, SuspendFailed, fits, show_bytes

log = logging.getLogger(__name__)


@dataclass
class Probes:
    """What the agent reads of a node's GPUs, where NVML sees them (None: a simulated node)."""

    mem_bytes: Callable[[int, int], int]  # (GPU index, pid) -> its memory there (bytes)
    on_gpu: Callable[[int], list[int]] | None = None  # GPU index -> the pids NVML lists on it
    free_bytes: Callable[[int], int | None] | None = None  # GPU index -> free memory


async def _off_gpu(on_gpu: Callable[[int], Collection[int]], index: int, pid: int, within: float = 0.5) -> bool:
    """Whether NVML stops listing ``pid`` on GPU ``index`` within ``within`` s of its checkpoint (its
    process list may lag the driver by a moment; there is nothing to wait on but the list itself)."""
    deadline = time.monotonic() + within
    while pid in on_gpu(index):
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.05)
    return True


class OnHost:
    """One agent's suspended workers, for the nodes it serves that can suspend."""

    def __init__(
        self,
        engine: Engine,
        suspenders: dict[str, Suspender],
        enforcer: Enforcer,
        budget_bytes: int,
        grace_s: float,
        probes: dict[str, Probes],
        inventories: list[NodeInventory],
    ) -> None:
        self.engine, self.suspenders, self.enforcer = engine, suspenders, enforcer
        self.budget_bytes, self.grace_s, self.probes = budget_bytes, grace_s, probes
        self.uuids = {(inv.node, g.index): g.uuid for inv in inventories for g in inv.gpus}
        self.done: dict[tuple[str, int, int], Snapshot] = {}  # (node, pid, start) suspended, not yet reported
        self.ending: dict[tuple[str, int, int], float] = {}  # signalled to end -> when

    # ---- a suspend's drain ---------------------------------------------------------------------------

    async def drain(self, node: str, entries: list[Draining]) -> list[Draining]:
        """Suspend the workers of ``node``'s suspend drains; the entries left to the ordinary drain."""
        suspender = self.suspenders.get(node)
        rest = []
        for e in entries:
            if e.state != "suspend" or suspender is None or not await self._suspend(node, e, suspender):
                rest.append(e)
        return rest

    async def _suspend(self, node: str, e: Draining, suspender: Suspender) -> bool:
        running = [p for p in e.pids if p.start and procs.start_ticks(p.pid) == p.start]
        if len(running) != 1 or len(e.pids) != 1:
            return False  # gone (the drain finds it clean) or several: ended as before
        p = running[0]
        why = refusal(p.pid)
        if why is None and p.uid >= 0 and procs.uid(p.pid) != p.uid:
            why = "its owner changed since it claimed the lease"
        if why is not None:
            log.warning("not suspending pid %s of lease %s: %s", p.pid, e.lease, why)
            return False
        key = (node, p.pid, p.start)
        snap = self.done.get(key)
        if snap is None:
            probes = self.probes[node]
            try:
                size = probes.mem_bytes(e.index, p.pid)
                snap = await asyncio.to_thread(suspender.suspend, p.pid, size)
            except (SuspendFailed, OSError) as exc:
                log.warning("suspending pid %s of lease %s failed (%s): it is ended instead", p.pid, e.lease, exc)
                return False
            if probes.on_gpu is not None and not await _off_gpu(probes.on_gpu, e.index, p.pid):
                log.warning("pid %s of lease %s still on GPU %s after its checkpoint: ended", p.pid, e.lease, e.index)
                return False
            self.done[key] = snap
        worker = {"pid": p.pid, "start": p.start, "uid": p.uid, "bytes": snap.bytes, "ms": round(snap.ms, 1)}
        await drained(self.engine, node, e.lease, [e.index], 0, json.dumps(worker))  # (Redis away: retried)
        self.done.pop(key, None)
        log.info("pid %s of lease %s suspended to host: %s in %.0f ms", p.pid, e.lease, show_bytes(snap.bytes), snap.ms)
        return True

    # ---- keeping them ---------------------------------------------------------------------------------

    async def entries(self, node: str) -> dict[str, dict[str, Any]]:
        raw = await self.engine.redis.hget(self.engine.keys.suspended, node)
        return json.loads(raw) if raw else {}

    async def upkeep(self, node: str, now_ms: float | None = None) -> None:
        """End the suspended workers of ``node`` past warm_max, or over the host-memory budget;
        forget those whose process is gone. Over the budget, the worker that did not fit pays: the
        newest one's owner loses their own oldest (that worker itself when it is their only one),
        never another user's worker that was there first."""
        now_ms = time.time() * 1000 if now_ms is None else now_ms
        workers = sorted((await self.entries(node)).values(), key=lambda w: w.get("since", 0))
        kept = []
        for w in workers:
            pid, start = int(w["pid"]), int(w.get("start") or 0)
            if not start or procs.start_ticks(pid) != start:
                await self._unsuspend(node, pid, "ended", "its worker process exited")
            elif w.get("until") and now_ms >= float(w["until"]):
                await self._drop(node, w, "kept suspended past warm_max with no cell")
            else:
                kept.append(w)
        held = sum(int(w.get("bytes") or 0) for w in kept)
        while kept and held > self.budget_bytes:
            owner = kept[-1].get("user")
            victim = next(w for w in kept if w.get("user") == owner)
            kept.remove(victim)
            held -= int(victim.get("bytes") or 0)
            full = f"the host memory for suspended workers on {node} ({show_bytes(self.budget_bytes)}) was full"
            await self._drop(node, victim, full)

    async def _drop(self, node: str, w: dict[str, Any], why: str) -> None:
        self._end(node, w, why)
        await self._unsuspend(node, int(w["pid"]), "ended", why)

    def _end(self, node: str, w: dict[str, Any], why: str) -> None:
        pid, start = int(w["pid"]), int(w["start"])
        refused = refusal(pid)
        if refused is None and int(w.get("uid", -1)) >= 0 and procs.uid(pid) != int(w["uid"]):
            refused = "its owner changed since it claimed the lease"
        if refused is not None:
            log.warning("suspended pid %s on %s not ended (%s): %s", pid, node, why, refused)
            return
        self.enforcer.terminate(node, int(w.get("gpu", 0)), pid, self.grace_s, why="suspended", start=start)
        log.info("suspended pid %s on %s ended: %s", pid, node, why)

    async def _unsuspend(self, node: str, pid: int, what: str, detail: str) -> dict[str, Any] | None:
        got: dict[str, Any] | None = await self.engine.run(Unsuspend(node, pid, what, detail))
        return got

    # ---- restoring --------------------------------------------------------------------------------------

    async def check(self, claim: Claim, peer: Peer, user: str) -> dict[str, Any]:
        """The suspended worker ``peer`` is, if it may be restored onto ``claim`` of ``user``: the
        same process (start time, uid) suspended here from a lease of that same user, onto one GPU.
        Raises :class:`errors.Conflict` saying why not."""
        node = claim.node
        w = (await self.entries(node)).get(str(peer.pid))
        if w is None or int(w.get("start") or 0) != peer.start or int(w.get("uid", -1)) != peer.uid:
            raise errors.Conflict(f"pid {peer.pid} is not a worker suspended on {node}")
        if w.get("user") != user:
            raise errors.Conflict(f"pid {peer.pid} was suspended from a lease of {w.get('user')}, not of {user}")
        if len(claim.gpus) != 1:
            raise errors.Conflict("a suspended worker is restored onto one GPU")
        return w

    async def restore(self, claim: Claim, peer: Peer, user: str) -> dict[str, Any]:
        """The worker ``peer`` claimed ``claim.lease`` of ``user`` (recorded) and asks to be restored
        onto its GPU: ``{"restored": {bytes, ms}}``; raises :class:`errors.Conflict` saying why not
        (a worker that could not be restored is ended)."""
        node = claim.node
        w = await self.check(claim, peer, user)
        suspender, probes, gpu = self.suspenders[node], self.probes[node], claim.gpus[0]
        size = int(w.get("bytes") or 0)
        if probes.free_bytes is not None and not fits(size, probes.free_bytes(gpu)):
            why = f"{node} GPU {gpu} has less than {show_bytes(int(size * 1.1))} free"
            self._end(node, w, why)
            await self._unsuspend(node, peer.pid, "ended", why)
            raise errors.Conflict(f"not restored: {why}")
        pairs = [(self.uuids.get((node, int(w.get("gpu", 0))), ""), self.uuids.get((node, gpu), ""))]
        try:
            ms = await asyncio.to_thread(suspender.restore, peer.pid, pairs)
        except (SuspendFailed, ValueError) as exc:
            self._end(node, w, str(exc))
            await self._unsuspend(node, peer.pid, "ended", f"its restore failed: {exc}")
            raise errors.Conflict(f"not restored: {exc}") from None
        detail = {"lease": claim.lease, "gpus": [gpu], "ms": round(ms, 1)}
        await self._unsuspend(node, peer.pid, "restored", json.dumps(detail))
        log.info("pid %s restored onto %s GPU %s for lease %s in %.0f ms", peer.pid, node, gpu, claim.lease, ms)
        return {"restored": {"bytes": size, "ms": round(ms, 1)}}
