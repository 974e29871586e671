"""Slices held to their memory: the node agent measures what each lease's own processes use.

A slice (docs/slices.md) is promised part of one GPU's memory, and its neighbours the rest. Its
worker is held to it by torch's per-process memory fraction (magics/slices.py), which only torch's
allocator obeys; the node agent is what holds every slice to it:

1. every ``slice_check_interval`` it reads the slices of its node's GPUs (the ``sliced`` ledgers)
   and, for each, the processes that claimed the lease on this node (claims.py: named by the kernel,
   never by a user; where the agent keeps a cgroup per lease, the processes in it too);
2. it measures them: on an NVML node each process's memory on the slice's GPU
   (``nvmlDeviceGetComputeRunningProcesses`` ``usedGpuMemory``, CUDA context included); on a
   simulated node there is no GPU memory, so each process's resident memory (``/proc/PID/statm``)
   stands in for it, so the path below runs for real without a GPU;
3. a slice above its memory by more than ``slice_over_pct`` % is warned (event
   ``over_memory_warning``: its cell shows one line); over for ``slice_over_s`` seconds in all
   (each sample over counts, and the time over adds up across pauses under: :meth:`MemWatch.judge`),
   it is ended (``over_memory.lua``: cause ``over_memory``, with the peak and the ``--gpu-mem`` that
   would have held it). Its processes are then ended by the drain (drain.py), which ends only the
   processes the slice claimed, never a neighbour's, and its memory is free once they are gone;
4. what each lease's processes use now and their peak are kept with the lease (``mem_peaks.lua``):
   the board shows them per slice, and the peak goes into its ledger line and ended record
   (``mem_peak_mb``), by which ``--gpu-mem auto`` sizes the notebook's next cell. The whole-GPU
   leases of a pool that shares are measured too, for that peak.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .. import errors, procs
from ..sizes import FIT_MARGIN, fitting_mb, show_mb
from ..store.engine import Engine
from ..store.scripts import MemPeaks, OverMemory

log = logging.getLogger(__name__)
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@dataclass(frozen=True)
class Watched:
    """A live lease with processes on this node: what the agent measures."""

    lease: str
    token: int  # its fencing token: an end is refused once the lease was granted anew
    pool: str
    indexes: tuple[int, ...]  # its GPUs on this node
    limit_mb: int  # a slice: MB promised to it on each of its GPUs; 0: whole GPUs (for the peak only)
    procs: tuple[tuple[int, int, int], ...]  # (pid, start ticks, uid) that claimed it here


async def watched_of(engine: Engine, node: str, indexes: list[int], whole: bool = False) -> list[Watched]:
    """The slices on ``node``'s GPUs ``indexes`` whose processes claimed them on this node (and,
    with ``whole``, the whole-GPU leases there with claimed processes)."""
    if not indexes:
        return []
    slots = [f"{node}/{i}" for i in indexes]
    limits: dict[str, int] = {}
    for raw in await engine.redis.hmget(engine.keys.sliced, slots):
        if raw:  # k slices of one lease (one per GPU, each of the same size): held to it on each GPU
            for lease, mb in (json.loads(raw).get("leases") or {}).items():
                limits[lease] = max(limits.get(lease, 0), int(mb))
    if whole:
        for holder in await engine.redis.hmget(engine.keys.holders, slots):
            if holder and not str(holder).startswith("~"):
                limits.setdefault(str(holder), 0)
    if not limits:
        return []
    ids = sorted(limits)
    out = []
    for lease, raw in zip(ids, await engine.redis.hmget(engine.keys.leases, ids), strict=True):
        if not raw:
            continue
        rec = json.loads(raw)
        procs = tuple(
            (int(p["pid"]), int(p.get("start") or 0), int(p.get("uid", -1)))
            for p in rec.get("procs") or []
            if (p.get("node") or rec.get("node")) == node and p.get("start")
        )
        gpus = tuple(int(g["index"]) for g in rec.get("gpus", []) if (g.get("node") or rec.get("node")) == node)
        if procs and gpus:
            out.append(Watched(lease, int(rec["token"]), str(rec["pool"]), gpus, limits[lease], procs))
    return out


async def node_watch(engine: Engine, node: str) -> tuple[str, list[Watched]]:
    """What a remote agent measures on ``node`` (GET /nodes/{node}/memory): its pool, and its leases
    with claimed processes there (slices and whole GPUs) while its pool shares; none otherwise."""
    raw = await engine.redis.hget(engine.keys.nodes, node)
    if raw is None:
        raise errors.UnknownNode(f"node {node!r} is not registered: PUT /api/v1/nodes/{node} first")
    inv = json.loads(raw)
    pool = str(inv["pool"])
    if not engine.settings.sched_table(pool)["share"]:  # type: ignore[call-overload]
        return pool, []
    return pool, await watched_of(engine, node, [int(g["index"]) for g in inv["gpus"]], whole=True)


def watched_json(w: Watched) -> dict[str, Any]:
    return {
        "lease": w.lease,
        "token": w.token,
        "pool": w.pool,
        "gpus": list(w.indexes),
        "limit_mb": w.limit_mb,
        "procs": [{"pid": pid, "start": start, "uid": uid} for pid, start, uid in w.procs],
    }


def watched_from_json(d: dict[str, Any]) -> Watched:
    procs = tuple((int(p["pid"]), int(p["start"]), int(p["uid"])) for p in d["procs"])
    return Watched(str(d["lease"]), int(d["token"]), str(d["pool"]), tuple(d["gpus"]), int(d["limit_mb"]), procs)


async def agent_report(engine: Engine, node: str, body: dict[str, Any]) -> dict[str, Any]:
    """A remote agent's pass (POST /nodes/{node}/memory): record what each lease uses and its peak,
    and warn or end the slices it found over their memory. Only leases with claimed processes on
    ``node`` count (the server's records, not the report, say each one's token, pool and limit);
    the others are answered as ignored and change nothing."""
    _, watched = await node_watch(engine, node)
    by_id = {w.lease: w for w in watched}
    ignored = sorted({*body.get("measured", {}), *(o["lease"] for o in body.get("over", []))} - set(by_id))
    measured = {k: v for k, v in body.get("measured", {}).items() if k in by_id}
    ended = []
    for o in body.get("over", []):
        w = by_id.get(o["lease"])
        if w is None or not w.limit_mb:  # not watched here, or a whole GPU: nothing to hold it to
            continue
        if len(w.indexes) > 1 and not body.get("per_gpu"):
            continue  # an agent from before limit_mb was per GPU: it added up the k GPUs' memory
        used, peak = int(o["used_mb"]), max(int(o.get("peak_mb", 0)), int(o["used_mb"]))
        if await over_memory(engine, node, w, o["what"], used, peak, float(o.get("over_s", 0))):
            ended.append(w.lease)
    if measured:
        await engine.run(MemPeaks(json.dumps(measured)))
    return {"node": node, "recorded": sorted(measured), "ended": ended, "ignored": ignored}


def running_pids(w: Watched, in_cgroup: Callable[[str], list[int]] | None = None) -> list[int]:
    """The lease's processes that still run: those that claimed it (the same process: its start
    time checked), their descendants, and those in its cgroup, each owned by a claimer's user. A
    child that never claimed the lease (a ``subprocess`` or ``multiprocessing`` worker of the cell)
    is measured with it, and so is a daemon whose parent exited (a double fork): the claimer made
    itself its descendants' subreaper when it claimed (claims.keep_orphans), so they stay below it."""
    pids = [pid for pid, start, _uid in w.procs if procs.start_ticks(pid) == start]
    uids = {uid for _pid, _start, uid in w.procs}
    for pid in [*procs.descendants(pids), *(in_cgroup(w.lease) if in_cgroup is not None else [])]:
        if pid not in pids and procs.uid(pid) in uids:
            pids.append(pid)
    return pids


def resident_mb(pid: int) -> int:
    """A process's resident memory in MB (0 once it is gone): the simulation's stand-in for the GPU
    memory a process uses."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE // (1024 * 1024)
    except (OSError, IndexError, ValueError):
        return 0


# While a slice is under its memory, each second under takes this much off its time over: a slice
# over for more than a quarter of the time (1 / (1 + UNDER_DRAIN)), in whatever bursts, piles time
# over up and is ended; one that spikes over for one sample in five or fewer never is.
UNDER_DRAIN = 1 / 3


@dataclass
class MemWatch:
    """One agent's judgement of one node's leases' memory over time: how long each was over (net
    of its time under since), warned, and their peaks."""

    over_pct: float = 5.0
    over_s: float = 2.0
    clock: Callable[[], float] = time.monotonic
    over_for: dict[str, float] = field(default_factory=dict)  # seconds over, less UNDER_DRAIN of those under
    last_at: dict[str, float] = field(default_factory=dict)  # when it was last judged
    under_since: dict[str, float] = field(default_factory=dict)  # seen under since (its samples), once warned
    warned: set[str] = field(default_factory=set)
    unmeasured: set[str] = field(default_factory=set)  # said once: NVML cannot read its memory
    ended: set[str] = field(default_factory=set)
    peak: dict[str, int] = field(default_factory=dict)

    def judge(self, w: Watched, used_mb: int) -> str | None:
        """ "warn" (it just went over), "end" (over for longer than ``over_s`` in all) or None.

        Each sample stands for the time since the one before it (at most ``over_s``: an agent that
        stalled does not count its stall): a sample over adds that time to the slice's time over, a
        sample under takes UNDER_DRAIN of it off (never below nothing). So a burst shorter than one
        check counts as soon as a sample sees it, and bursts with pauses between add up whatever
        the pauses' length: over for more than a quarter of the time, a slice is ended (40 % is
        enough to fail a neighbour's allocation). A spike over one sample in five or fewer drains
        away before the next and is never ended. Its warning is said once, and again only after
        ``over_s`` of samples under."""
        self.peak[w.lease] = max(self.peak.get(w.lease, 0), used_mb)
        if not w.limit_mb or w.lease in self.ended:
            return None
        lease, now = w.lease, self.clock()
        prev = self.last_at.get(lease)
        self.last_at[lease] = now
        step = 0.0 if prev is None else min(now - prev, self.over_s or math.inf)
        if used_mb <= w.limit_mb * (1 + self.over_pct / 100):
            left = self.over_for.get(lease, 0.0) - step * UNDER_DRAIN
            if left > 0:
                self.over_for[lease] = left
            else:
                self.over_for.pop(lease, None)
            if lease in self.warned and now - self.under_since.setdefault(lease, now) >= self.over_s:
                self.warned.discard(lease)  # a new overrun is said again
                self.under_since.pop(lease, None)
            return None
        self.under_since.pop(lease, None)
        self.over_for[lease] = self.over_for.get(lease, 0.0) + step
        if lease not in self.warned:
            self.warned.add(lease)
            return "warn"
        if self.over_for[lease] > self.over_s:
            self.ended.add(lease)
            return "end"
        return None

    def forget(self, live: set[str]) -> None:
        """Drop what it knows of leases that are no longer watched (ended)."""
        for table in (self.over_for, self.last_at, self.under_since, self.peak):
            for lease in [k for k in table if k not in live]:
                del table[lease]
        self.warned &= live
        self.ended &= live
        self.unmeasured &= live


def judge_pass(
    watched: list[Watched],
    watch: MemWatch,
    measure: Callable[[Watched, list[int]], int | None],
    in_cgroup: Callable[[str], list[int]] | None = None,
) -> tuple[dict[str, list[int]], list[tuple[Watched, str, int]]]:
    """One pass over ``watched``: measure each lease's running processes (``measure(w, pids)``:
    MB, None when it cannot say) and judge it. Returns (lease -> [MB now, peak], the verdicts
    [(lease, "warn" or "end", MB now)]). Talks to nobody: the caller tells the server."""
    measured: dict[str, list[int]] = {}
    verdicts: list[tuple[Watched, str, int]] = []
    for w in watched:
        pids = running_pids(w, in_cgroup)
        used = measure(w, pids) if pids else None
        if used is None:
            if pids and w.limit_mb and w.lease not in watch.unmeasured:
                watch.unmeasured.add(w.lease)
                log.warning("slice %s: its memory cannot be read here (NVML names no figure): not held to it", w.lease)
            continue
        verdict = watch.judge(w, used)
        measured[w.lease] = [used, watch.peak[w.lease]]
        if verdict is not None:
            verdicts.append((w, verdict, used))
    watch.forget({w.lease for w in watched})
    return measured, verdicts


async def watch_pass(
    engine: Engine,
    node: str,
    indexes: list[int],
    watch: MemWatch,
    measure: Callable[[Watched, list[int]], int | None],
    in_cgroup: Callable[[str], list[int]] | None = None,
    whole: bool = False,
) -> list[str]:
    """One pass over ``node``'s slices (and, with ``whole``, its whole-GPU leases), by the agent in
    the server: measure, warn or end the slices over their memory, and record rising peaks.
    Returns the leases it ended. (A remote agent does the same over HTTP: GET and POST
    /nodes/{node}/memory.)"""
    watched = await watched_of(engine, node, indexes, whole)
    measured, verdicts = judge_pass(watched, watch, measure, in_cgroup)
    ended = []
    for w, what, used in verdicts:
        over_s = watch.over_for.get(w.lease, 0.0)
        if await over_memory(engine, node, w, what, used, watch.peak.get(w.lease, used), over_s):
            ended.append(w.lease)
    if measured:  # what each uses now and its peak: the board shows them, the ledger keeps the peak
        await engine.run(MemPeaks(json.dumps(measured)))
    return ended


async def over_memory(engine: Engine, node: str, w: Watched, what: str, used: int, peak: int, over_s: float) -> bool:
    """Tell the lease server that slice ``w`` is over its memory: warn, or end it (cause
    ``over_memory``, with the ``--gpu-mem`` that would have held its peak, in its pool's unit).
    Whether it ended it now."""
    unit = int(engine.settings.sched_table(w.pool)["slice_unit_mb"])  # type: ignore[call-overload]
    fit = fitting_mb(peak, unit, FIT_MARGIN)
    grace = engine.settings.slice_over_s
    why = f"used {show_mb(used)} of its {show_mb(w.limit_mb)} slice for over {grace:g}s"
    reason = f"ended by the node agent: it {why}"
    got = await engine.run(
        OverMemory(
            w.lease, str(w.token), node, what, used, w.limit_mb, peak, fit, round(over_s, 2), reason, f"it {why}"
        )
    )
    if what == "warn":
        log.warning("slice %s on %s uses %s MB of its %s MB", w.lease, node, used, w.limit_mb)
        return False
    if got is not None:
        log.warning("slice %s on %s ended: %s MB of its %s MB for %.1fs", w.lease, node, used, w.limit_mb, over_s)
    return got is not None
