"""The GPU board's view of the cluster (``GET /api/v1/cluster``): every node and GPU with its state
and holder, and the counts per pool, read in one go; free GPUs that bookings in force still owe
their holders show as reserved."""

from __future__ import annotations

import asyncio
import bisect
import json
import time
from dataclasses import dataclass, field
from typing import Any

from ..store.engine import Engine
from .bookings import Bookings

YIELD_EVERY = 64  # nodes built between two returns to the event loop: a large inventory's view is
# tens of milliseconds of Python, which no grant should wait behind all at once


async def cluster_view(engine: Engine) -> dict[str, Any]:
    """Every node and GPU with its state (free / leased / down) and holder, and ``as_of_event``: the
    id of the newest event when it was read (every change up to that event is in the view; the
    scripts write a change and its event in one step)."""
    r, k = engine.redis, engine.keys
    async with r.pipeline(transaction=True) as p:
        p.xrevrange(k.events, count=1)
        p.hgetall(k.nodes)
        p.zrange(k.alive, 0, -1, withscores=True)
        p.hgetall(k.free)
        p.hgetall(k.holders)
        p.hgetall(k.leases)
        p.zrange(k.fit, 0, -1)
        p.hgetall(k.last)
        p.hgetall(k.unleased)
        p.hgetall(k.draining)
        p.hgetall(k.sliced)
        p.hgetall(k.suspended)
        got_all = await p.execute()
    newest_event, *got_all = got_all
    nodes_raw, alive, free_raw, holders, leases_raw, fit, newest, unleased, draining, sliced, suspended = got_all
    now = await r.time()  # Redis's clock; not in the MULTI: a Redis Cluster pipeline takes only keyed commands
    now_s = now[0] + now[1] / 1e6
    alive_at = dict(alive)
    up = {m.split("|", 2)[2] for m in fit}
    leases = {lid: json.loads(v) for lid, v in leases_raw.items()}
    # What each lease's own processes use now and their peak, as its node agent measured them
    # (node/memwatch.py: in pools that share their GPUs), MB
    if leases:
        ids = sorted(leases)
        got = await r.hmget(k.lease_util, [f"{lid}|{f}" for lid in ids for f in ("mused", "mpeak")])
        for i, lid in enumerate(ids):
            used, peak = got[2 * i], got[2 * i + 1]
            if used is not None:
                leases[lid]["mem_used_mb"] = int(float(used))
                leases[lid]["mem_peak_mb"] = int(float(peak if peak is not None else used))
    nodes: list[dict[str, Any]] = []
    pools: dict[str, dict[str, int]] = {}
    for i, name in enumerate(sorted(nodes_raw)):
        if i and i % YIELD_EVERY == 0:
            await asyncio.sleep(0)
        inv = json.loads(nodes_raw[name])
        is_up = name in up and alive_at.get(name, -1) / 1000 >= now_s
        free = set(json.loads(free_raw.get(name, "[]")) or [])
        counts = pools.setdefault(
            inv["pool"],
            {
                "gpus": 0,
                "free": 0,
                "leased": 0,
                "down": 0,
                "nodes": 0,
                "reserved": 0,
                "borrowed": 0,
                "draining": 0,
                "warm": 0,
                "sliced": 0,  # GPUs shared by slices
                "slices": 0,  # the live slices on them
            },
        )
        counts["nodes"] += 1
        gpus = []
        for g in inv["gpus"]:
            holder = holders.get(f"{name}/{g['index']}")
            lease = leases.get(holder) if holder else None
            drain = draining.get(f"{name}/{g['index']}")
            shared = sliced.get(f"{name}/{g['index']}") if holder == "~slices" else None
            if shared is not None:
                state = "sliced"  # shared by slices: each holds part of its memory (lua/_lib_slice.lua)
            elif lease is not None and lease.get("warm_since"):
                state = "warm"  # a finished cell's worker kept for its next cell: lent out if someone waits
            elif lease is not None:
                state = "borrowed" if lease.get("borrowed") else "leased"
            elif drain is not None:
                state = "draining"  # not free until its agent sees the old processes gone, up or down
            elif not is_up:
                state = "down"
            elif g["index"] in free:
                state = "free"
            else:
                state = "down"
            counts["gpus"] += 1
            counts[state] += 1
            entry: dict[str, Any] = {**g, "state": state}
            slot = f"{name}/{g['index']}"
            if slot in newest:
                ts, util, mem = newest[slot].split(",")
                entry["sample"] = {"at": int(ts) / 1000, "util": float(util), "mem_used_mb": int(mem)}
            if drain is not None:
                d = json.loads(drain)
                entry["draining"] = {"lease": d["lease"], "user": d.get("user", ""), "state": d.get("state", "")}
                entry["draining"]["since"] = d.get("since", 0) / 1000
                if d.get("abandoned"):  # its agent gave a process up: out of service, for an admin
                    entry["draining"]["abandoned"] = {
                        "pid": d["abandoned"].get("pid"),
                        "why": d["abandoned"].get("why"),
                    }
            if shared is not None:
                entry.update(_slices(json.loads(shared), leases))
                counts["slices"] += len(entry["slices"])
            if slot in unleased:
                # Processes on a GPU that no live lease covers: someone bypasses the service.
                entry["unleased_use"] = json.loads(unleased[slot])
                entry["unleased_use"]["since"] /= 1000
            if lease is not None:
                entry["lease"] = {
                    "id": lease["id"],
                    "user": lease["user"],
                    "label": lease.get("label", ""),
                    "since": lease["created_at"] / 1000,
                    "expires_at": lease["expires_at"] / 1000,
                }
                if lease.get("reclaim_at"):
                    entry["lease"]["idle_warning"] = True
                    entry["lease"]["reclaim_at"] = lease["reclaim_at"] / 1000
                for key in ("notebook", "cell"):  # where the lease comes from: the board names it
                    if lease.get(key):
                        entry["lease"][key] = lease[key]
                if lease.get("resv"):  # the booking it is served from, "reservation" on the wire
                    entry["lease"]["reservation"] = lease["resv"]
                if lease.get("borrowed"):
                    entry["lease"]["borrowed"] = True
                if lease.get("recall_at"):
                    entry["lease"]["recall_at"] = lease["recall_at"] / 1000
                if lease.get("warm_since"):
                    entry["lease"]["warm_since"] = lease["warm_since"] / 1000
                if "mem_used_mb" in lease:
                    entry["lease"]["mem_used_mb"] = lease["mem_used_mb"]
                    entry["lease"]["mem_peak_mb"] = lease["mem_peak_mb"]
                if lease.get("shrink_to"):  # asked to give GPUs back for a waiting request
                    entry["lease"]["shrink_to"] = int(lease["shrink_to"])
                    entry["lease"]["shrink_by"] = lease["shrink_by"] / 1000
            gpus.append(entry)
        last = alive_at.get(name, -1)
        nodes.append(
            {
                "name": name,
                "pool": inv["pool"],
                "source": inv.get("source", ""),
                "isolation": inv.get("isolation", ""),
                "state": "up" if is_up else "down",
                "heartbeat_deadline": last / 1000 if last > 0 else None,
                "gpus": gpus,
            }
        )
        if inv.get("suspend"):  # its agent suspends evicted warm workers to host memory (node/onhost.py)
            nodes[-1]["suspend"] = inv["suspend"]
            nodes[-1]["suspended"] = _suspended(suspended.get(name))
    await _mark_reserved(engine, nodes, pools, int(now_s * 1000))
    cpu_pool = engine.settings.cpu_pool
    for name, counts in pools.items():
        counts["kind"] = "cpu" if name == cpu_pool else "gpu"  # type: ignore[assignment]
        sched = engine.settings.sched_table(name)
        if sched["share"]:  # its GPUs may be sliced: in what unit (a client rounds --gpu-mem auto to it)
            counts["share"] = True  # type: ignore[assignment]
            counts["slice_unit_mb"] = int(sched["slice_unit_mb"])  # type: ignore[call-overload]
    return {
        "now": now_s,
        "as_of_event": newest_event[0][0] if newest_event else "0-0",
        "nodes": nodes,
        "pools": pools,
        "cpu_pool": cpu_pool if cpu_pool in pools else None,
    }


def _suspended(raw: Any) -> list[dict[str, Any]]:
    """A node's suspended workers, oldest first: whose, which lease they left, their GPU state on host."""
    out = []
    for w in (json.loads(raw) if raw else {}).values():
        entry = {"user": w.get("user", ""), "lease": w.get("lease", ""), "bytes": int(w.get("bytes") or 0)}
        entry["since"] = float(w.get("since") or 0) / 1000
        if w.get("until"):
            entry["until"] = float(w["until"]) / 1000
        out.append(entry)
    return sorted(out, key=lambda e: e["since"])


def _slices(ledger: dict[str, Any], leases: dict[str, Any]) -> dict[str, Any]:
    """A sliced GPU's slices, each with its lease, holder and memory (largest first), the ones still
    draining (memory promised until their processes are gone), and its memory promised in all."""
    out: list[dict[str, Any]] = []
    for lid, mb in (ledger.get("leases") or {}).items():
        lease = leases.get(lid) or {}
        out.append(
            {
                "lease": lid,
                "user": lease.get("user", ""),
                "label": lease.get("label", ""),
                "gpu_mem_mb": int(mb),
                "since": lease.get("created_at", 0) / 1000,
                "expires_at": lease.get("expires_at", 0) / 1000,
            }
        )
        if "mem_used_mb" in lease:  # its processes' memory now and at their peak, as its agent measured it
            out[-1]["mem_used_mb"] = lease["mem_used_mb"]
            out[-1]["mem_peak_mb"] = lease["mem_peak_mb"]
        if lease.get("warm_since"):  # kept for its notebook's next cell: lent out if someone waits
            out[-1]["warm_since"] = lease["warm_since"] / 1000
        if lease.get("recall_at"):  # being evicted (or recalled for a booking): ends then
            out[-1]["recall_at"] = lease["recall_at"] / 1000
    drains = [
        {"lease": lid, "user": d.get("user", ""), "gpu_mem_mb": int(d["mb"]), "since": d.get("since", 0) / 1000}
        for lid, d in (ledger.get("draining") or {}).items()
    ]
    return {
        "slices": sorted(out, key=lambda e: (-e["gpu_mem_mb"], e["lease"])),
        "slices_draining": drains,
        "slice_mem": {
            "total_mb": int(ledger["total_mb"]),
            "used_mb": int(ledger["used_mb"]),
            "free_mb": int(ledger["total_mb"]) - int(ledger["used_mb"]),  # what another slice may still take
        },
    }


async def _mark_reserved(
    engine: Engine, nodes: list[dict[str, Any]], pools: dict[str, dict[str, int]], now_ms: int
) -> None:
    """Show as "reserved" the free GPUs that bookings in force still owe their holders: on an
    all-on-one-node booking's node first, then anywhere in its pool."""
    for pool, bookings in (await Bookings(engine).in_force(now_ms)).items():
        free = [(n, g) for n in nodes if n["pool"] == pool for g in n["gpus"] if g["state"] == "free"]
        for r in sorted(bookings, key=lambda r: (not r.get("colocate"), r["start"])):
            owed = max(0, r["gpus"] - int(r.get("held", 0)))
            ordered = sorted(free, key=lambda ng: ng[0]["name"] != r.get("node"))
            for n, g in ordered[:owed]:
                g["state"] = "reserved"
                g["reservation"] = {"id": r["id"], "owner": r["owner"], "note": r.get("note", "")}
                free.remove((n, g))
                pools[pool]["free"] -= 1
                pools[pool]["reserved"] += 1


# ---- one view for every reader (GET /cluster, the estimate, /metrics) -------------------------------------


def _event_key(event_id: str) -> tuple[int, int]:
    ms, _, seq = event_id.partition("-")
    return int(ms), int(seq or 0)


@dataclass
class Snapshot:
    """One read of the cluster (``cluster_view``'s answer, never changed once read), with each node
    as JSON made at its first use, so that a page of nodes costs its own size to send."""

    view: dict[str, Any]
    at: float  # time.monotonic() just before the read
    _nodes_json: list[str | None] = field(default_factory=list)
    _by_pool: dict[str, list[int]] | None = None
    _by_user: dict[str, list[str]] | None = None

    def now(self) -> float:
        """The lease server's clock now: Redis's at the read, moved on by this process's clock."""
        return float(self.view["now"]) + time.monotonic() - self.at

    def node_json(self, i: int) -> str:
        if not self._nodes_json:
            self._nodes_json = [None] * len(self.view["nodes"])
        text = self._nodes_json[i]
        if text is None:
            text = self._nodes_json[i] = json.dumps(self.view["nodes"][i], separators=(",", ":"))
        return text

    def lease_ids_of(self, user: str) -> list[str]:
        """The ids of ``user``'s live leases: those holding a GPU or a slice in this view (every
        live lease does, and its grant's event is in the view before any reader asks after it).
        Every user's are gathered at the first ask, once per snapshot."""
        if self._by_user is None:
            by_user: dict[str, set[str]] = {}
            for n in self.view["nodes"]:
                for g in n["gpus"]:
                    lease = g.get("lease")
                    if lease is not None:
                        by_user.setdefault(lease["user"], set()).add(lease["id"])
                    for sl in g.get("slices") or ():
                        by_user.setdefault(sl["user"], set()).add(sl["lease"])
            self._by_user = {u: sorted(ids) for u, ids in by_user.items()}
        return self._by_user.get(user, [])

    def of_pool(self, pool: str | None) -> list[int]:
        """The indexes of the nodes of ``pool`` (every node: None), in name order."""
        if pool is None:
            return list(range(len(self.view["nodes"])))
        if self._by_pool is None:
            self._by_pool = {}
            for i, n in enumerate(self.view["nodes"]):
                self._by_pool.setdefault(n["pool"], []).append(i)
        return self._by_pool.get(pool, [])

    def page(self, pool: str | None = None, after: str | None = None, limit: int | None = None, **more: Any) -> str:
        """The view as GET /cluster answers it, as JSON text: the counts of every pool, and the nodes
        of ``pool`` (default all) whose names sort after ``after``, at most ``limit`` of them (default
        all; 0: none, the counts only). ``nodes_total`` counts the pool's nodes, ``next`` names the
        node to pass as ``after`` for the next page (null on the last, and with ``limit`` 0). ``more``: other
        fields."""
        chosen = self.of_pool(pool)
        start = 0
        if after is not None:
            names = [self.view["nodes"][i]["name"] for i in chosen]
            start = bisect.bisect_right(names, after)
        end = len(chosen) if limit is None else min(len(chosen), start + limit)
        head = {
            "now": round(self.now(), 3),
            "as_of_event": self.view["as_of_event"],
            "pools": self.view["pools"],
            "cpu_pool": self.view["cpu_pool"],
            "nodes_total": len(chosen),
            "next": self.view["nodes"][chosen[end - 1]]["name"] if start < end < len(chosen) else None,
            **more,
        }
        nodes = ",".join(self.node_json(i) for i in chosen[start:end])
        return json.dumps(head, separators=(",", ":"))[:-1] + ',"nodes":[' + nodes + "]}"


class ClusterViews:
    """The cluster as every reader of this server process sees it, read once for all of them.

    Every Lab's board refetches GET /cluster after each event that may change it. With thousands of
    Labs open on 10,000 GPUs, one read and encoding of the whole inventory per request would be
    thousands of 2 MB answers after every grant. Readers share one :class:`Snapshot` instead:

    * a reader gets a snapshot that holds every event up to the newest one when it asked (that id is
      read first, and a snapshot is read with its own newest event in one step), so a board that
      refetches after an event always sees it;
    * a snapshot is kept at most ``max_age_s``: what changes without an event (utilization
      samples, heartbeats, a booking coming into force) shows within it;
    * one read at a time, and the next starts no sooner than twice the last one's time after it
      ended (at most ``max_gap_s``): reading takes at most a third of the process however many
      ask, and whoever asks meanwhile waits for that next read and shares it.
    """

    def __init__(self, engine: Engine, max_age_s: float = 1.0, max_gap_s: float = 1.0) -> None:
        self.engine, self.max_age_s, self.max_gap_s = engine, max_age_s, max_gap_s
        self.reads = 0  # snapshots read (for tests and benches)
        self._snap: Snapshot | None = None
        self._reading: asyncio.Future[Snapshot] | None = None
        self._next_at = 0.0

    async def get(self) -> Snapshot:
        newest: Any = await self.engine.redis.xrevrange(self.engine.keys.events, count=1)
        want = _event_key(newest[0][0]) if newest else (0, 0)
        while True:
            snap = self._snap
            fresh = snap is not None and time.monotonic() - snap.at < self.max_age_s
            if snap is not None and fresh and _event_key(snap.view["as_of_event"]) >= want:
                return snap
            await asyncio.shield(self._next_read())

    async def view(self) -> dict[str, Any]:
        """The shared view itself (read only: every reader has the same object)."""
        return (await self.get()).view

    def _next_read(self) -> asyncio.Future[Snapshot]:
        if self._reading is None:
            self._reading = asyncio.ensure_future(self._read())
            # its waiters may all be gone (clients that hung up): its error is then nobody's
            self._reading.add_done_callback(lambda f: f.cancelled() or f.exception())
        return self._reading

    async def _read(self) -> Snapshot:
        try:
            delay = self._next_at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            t0 = time.monotonic()
            snap = Snapshot(await cluster_view(self.engine), t0)
            self._snap = snap
            self.reads += 1
            took = time.monotonic() - t0
            self._next_at = time.monotonic() + min(self.max_gap_s, 2 * took)
            return snap
        finally:
            self._reading = None
