"""The GPU board's view of the cluster (``GET /api/v1/cluster``): every node and GPU with its state
and holder, and the counts per pool, read in one go; free GPUs that bookings in force still owe
their holders show as reserved."""

from __future__ import annotations

import json
from typing import Any

from ..store.engine import Engine
from .bookings import Bookings


async def cluster_view(engine: Engine) -> dict[str, Any]:
    """Every node and GPU with its state (free / leased / down) and holder."""
    r, k = engine.redis, engine.keys
    async with r.pipeline(transaction=True) as p:
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
    for name in sorted(nodes_raw):
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
    return {"now": now_s, "nodes": nodes, "pools": pools, "cpu_pool": cpu_pool if cpu_pool in pools else None}


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
