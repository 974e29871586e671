"""Draining: a GPU whose lease the server ended is free only once no process of that lease is on it.

When the holder ends its own call, it verifies its worker gone before it releases (magics). When
the **server** ends a lease (expiry, an admin's revoke, an idle reclaim, a preemption or recall
whose notice ran out, an elastic shrink past its deadline), the old process may still run: the
scripts then put the lease's GPUs in ``draining`` (``lua/_lib_drain.lua``, ``start_drain``) instead of
the free list. The node agent of each node:

1. reads its draining GPUs (:func:`draining_of`), each naming the lease and the processes that
   lease registered there (:func:`register_procs`, sent by the driver before the call runs);
2. finds what of that lease remains on the GPU: on an NVML node, every process NVML lists on
   it (nobody else holds a draining GPU); on a simulated node, the registered pids that still
   run (the same process: its start time is checked);
3. ends what remains, SIGTERM then SIGKILL after ``drain_kill_grace_s``, through a pidfd
   (:class:`lease_server.node.enforce.Enforcer`), and once nothing remains
4. reports the GPUs clean (:func:`drained`, ``lua/drained.lua``): they turn free and the pool's
   queue is served in the same script; one ``drained`` event says how long it took.

An agent that is down reports nothing: its GPUs stay draining, never free. A simulated node's
lease that registered no process has nothing to drain: its GPUs are free at once, as before.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..store.engine import Engine
from ..store.scripts import Drained, LeaseRecord, Procs
from .enforce import Enforcer

log = logging.getLogger(__name__)

MAX_PROCS = 256  # processes one lease may name (a gang's ranks on every node)


@dataclass(frozen=True)
class Draining:
    """One draining GPU of a node, as its agent reads it."""

    index: int
    lease: str
    user: str
    state: str  # how the lease ended: expired, revoked, shrunk
    since_ms: int
    pids: tuple[tuple[int, int], ...]  # (pid, start time in clock ticks since boot; 0 = unknown)

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "lease": self.lease,
            "user": self.user,
            "state": self.state,
            "since": self.since_ms / 1000,
            "pids": [{"pid": p, "start": s} for p, s in self.pids],
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Draining:
        return cls(
            int(d["index"]),
            str(d["lease"]),
            str(d.get("user", "")),
            str(d.get("state", "")),
            int(float(d.get("since", 0)) * 1000),
            tuple((int(p["pid"]), int(p.get("start") or 0)) for p in d.get("pids", [])),
        )


def _entry(index: int, raw: str) -> Draining:
    d = json.loads(raw)
    return Draining(
        index,
        str(d["lease"]),
        str(d.get("user", "")),
        str(d.get("state", "")),
        int(d.get("since", 0)),
        tuple((int(p["pid"]), int(p.get("start") or 0)) for p in d.get("pids") or []),
    )


async def draining_of(engine: Engine, node: str, indexes: list[int]) -> list[Draining]:
    """The draining GPUs among ``indexes`` of ``node``."""
    if not indexes:
        return []
    raws = await engine.redis.hmget(engine.keys.draining, [f"{node}/{i}" for i in indexes])
    return [_entry(i, str(raw)) for i, raw in zip(indexes, raws, strict=True) if raw]


async def drained(engine: Engine, node: str, lease: str, indexes: list[int], killed: int = 0) -> int:
    """Report ``indexes`` of ``node`` clean of ``lease``'s processes; returns the GPUs freed."""
    return await engine.run(Drained(node, lease, json.dumps(sorted(set(indexes))), killed))


async def register_procs(
    engine: Engine, lease_id: str, token: str, user: str, procs: list[dict[str, Any]]
) -> LeaseRecord:
    """The holder names its lease's processes: ``[{node, pid, start, gpus}]``."""
    out = await engine.run(Procs(lease_id, token, user, json.dumps(procs, separators=(",", ":"))))
    return out


# ---- the agent's side ----------------------------------------------------------------------------


def start_ticks(pid: int) -> int | None:
    """Process ``pid``'s start time (clock ticks since boot, /proc/PID/stat field 22); None when it
    is gone or a zombie (exited, not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if rest[0] in ("Z", "X"):
        return None
    return int(rest[19])


def still_runs(pid: int, start: int) -> bool:
    """Whether the registered process (pid, start) runs: the same pid with another start time is
    another process, which is never touched."""
    now = start_ticks(pid)
    return now is not None and (start == 0 or now == start)


class Drainer:
    """One agent's drain work: which processes of a draining GPU remain, ending them (through the
    agent's :class:`Enforcer`, so SIGKILL follows after the grace), and which GPUs are clean."""

    def __init__(self, enforcer: Enforcer, grace_s: float) -> None:
        self.enforcer = enforcer
        self.grace_s = grace_s
        self.killed: dict[tuple[str, str], int] = {}  # (node, lease) -> processes signalled
        # Ended already, by (node, pid, start time): waited for, never signalled twice (a process
        # that ignored SIGTERM gets its SIGKILL from the Enforcer). One that NVML still lists as it
        # exits, its device files closed, is waited for without a warning (warned: said once).
        self.signalled: dict[tuple[str, int, int], None] = {}
        self.warned: dict[tuple[str, int], None] = {}

    def step(
        self,
        node: str,
        entries: list[Draining],
        nvml_procs: Callable[[int], list[int]] | None = None,
        verify: Callable[[int, int], bool] | None = None,
    ) -> list[tuple[str, list[int], int]]:
        """Act on ``node``'s draining GPUs; returns (lease, clean GPU indexes, processes it ended)
        for each lease with GPUs now clean. ``nvml_procs(index)``: the pids NVML lists on that GPU
        (an NVML node); without it the registered pids are what must be gone."""
        clean: dict[str, list[int]] = {}
        for e in entries:
            if nvml_procs is not None:
                remaining = [(pid, 0) for pid in nvml_procs(e.index)]
            else:
                remaining = [(pid, start) for pid, start in e.pids if still_runs(pid, start)]
            if not remaining:
                clean.setdefault(e.lease, []).append(e.index)
                continue
            for pid, _ in remaining:
                if pid <= 1 or pid == os.getpid() or (node, pid) in self.enforcer.pending:
                    continue
                start = start_ticks(pid)
                if start is not None and (node, pid, start) in self.signalled:
                    continue  # ended already (its SIGKILL came after the grace): it is on its way out
                if start is None or (verify is not None and not verify(e.index, pid)):
                    if (node, pid) not in self.warned:  # exiting (a zombie NVML still lists) or not ours to see
                        self.warned[(node, pid)] = None
                        if not any(k[:2] == (node, pid) for k in self.signalled):
                            log.warning("not ending pid %s on %s GPU %s: this agent cannot see it", pid, node, e.index)
                    continue
                self.signalled[(node, pid, start)] = None
                while len(self.signalled) > 10_000:
                    del self.signalled[next(iter(self.signalled))]
                while len(self.warned) > 10_000:
                    del self.warned[next(iter(self.warned))]
                if self.enforcer.terminate(node, e.index, pid, self.grace_s, why="drain") is not None:
                    self.killed[(node, e.lease)] = self.killed.get((node, e.lease), 0) + 1
                    log.warning(
                        "draining %s GPU %s: SIGTERM to pid %s of lease %s (%s)", node, e.index, pid, e.lease, e.state
                    )
        return [(lease, idx, self.killed.pop((node, lease), 0)) for lease, idx in clean.items()]
