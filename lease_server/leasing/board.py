"""The GPU board's view of the cluster (``GET /api/v1/cluster``): every node and GPU with its state
and holder, and the counts per pool, read in one go; free GPUs that bookings in force still owe
their holders show as reserved."""

from __future__ import annotations

import asyncio
import bisect
import json
import time
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

from ..protocol import BOOKING_EVENTS
from ..store.engine import Engine
from .bookings import Bookings, occurrences
from .events import event_nodes, parse_entry

YIELD_EVERY = 64  # nodes built between two returns to the event loop: a large inventory's view is
# tens of milliseconds of Python, which no grant should wait behind all at once


@dataclass
class _Raw:
    """What the view of some nodes is made of, as read from Redis (every node's, or a few nodes')."""

    newest_event: str
    now_s: float
    nodes_raw: dict[str, str]  # node -> its inventory JSON
    alive_at: dict[str, float]  # node -> heartbeat deadline (ms; -1 known down)
    up: set[str]  # nodes with a fit entry
    free_raw: dict[str, str]
    holders: dict[str, str]  # "node/index" -> lease id (or "~slices")
    leases: dict[str, dict[str, Any]]  # decoded, with their processes' memory where measured
    last: dict[str, str]  # "node/index" -> "ts,util,mem" (the newest sample)
    unleased: dict[str, str]
    draining: dict[str, str]
    sliced: dict[str, str]
    suspended: dict[str, str]


def _event_id(newest: Any) -> str:
    return newest[0][0] if newest else "0-0"


async def _with_memory(engine: Engine, leases: dict[str, dict[str, Any]]) -> None:
    """What each lease's own processes use now and their peak, as its node agent measured them
    (node/memwatch.py: in pools that share their GPUs), MB, put into the leases."""
    if not leases:
        return
    ids = sorted(leases)
    got = await engine.redis.hmget(engine.keys.lease_util, [f"{lid}|{f}" for lid in ids for f in ("mused", "mpeak")])
    for i, lid in enumerate(ids):
        used, peak = got[2 * i], got[2 * i + 1]
        if used is not None:
            leases[lid]["mem_used_mb"] = int(float(used))
            leases[lid]["mem_peak_mb"] = int(float(peak if peak is not None else used))


async def _read_all(engine: Engine) -> _Raw:
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
        got = await p.execute()
    newest_event, nodes_raw, alive, free_raw, holders, leases_raw, fit, last, unleased, draining = got[:10]
    sliced, suspended = got[10:]
    now = await r.time()  # Redis's clock; not in the MULTI: a Redis Cluster pipeline takes only keyed commands
    leases = {lid: json.loads(v) for lid, v in leases_raw.items()}
    await _with_memory(engine, leases)
    return _Raw(
        _event_id(newest_event),
        now[0] + now[1] / 1e6,
        nodes_raw,
        dict(alive),
        {m.split("|", 2)[2] for m in fit},
        free_raw,
        holders,
        leases,
        last,
        unleased,
        draining,
        sliced,
        suspended,
    )


def _new_counts() -> dict[str, int]:
    return {
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
        "unpromised_mb": 0,  # memory of its sliced GPUs (on nodes up) that no slice holds: room for another
    }


def _add_counts(pools: dict[str, dict[str, int]], node: dict[str, Any], sign: int = 1) -> None:
    """Add (sign -1: take away) one node's GPUs, by state, to its pool's counts."""
    counts = pools.setdefault(node["pool"], _new_counts())
    counts["nodes"] += sign
    for g in node["gpus"]:
        counts["gpus"] += sign
        counts[g["state"]] += sign
        counts["slices"] += sign * len(g.get("slices") or ())
        if "slice_mem" in g and node["state"] == "up":
            counts["unpromised_mb"] += sign * g["slice_mem"]["free_mb"]


def _build_node(name: str, raw: _Raw) -> dict[str, Any]:
    """One node of the view, with its GPUs' states and holders (reserved marks aside: _mark_reserved)."""
    inv = json.loads(raw.nodes_raw[name])
    is_up = name in raw.up and raw.alive_at.get(name, -1) / 1000 >= raw.now_s
    free = set(json.loads(raw.free_raw.get(name) or "[]") or [])
    leases, holders = raw.leases, raw.holders
    gpus = []
    for g in inv["gpus"]:
        slot = f"{name}/{g['index']}"
        holder = holders.get(slot)
        lease = leases.get(holder) if holder else None
        drain = raw.draining.get(slot)
        shared = raw.sliced.get(slot) if holder == "~slices" else None
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
        entry: dict[str, Any] = {**g, "state": state}
        if slot in raw.last:
            ts, util, mem = raw.last[slot].split(",")
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
        if slot in raw.unleased:
            # Processes on a GPU that no live lease covers: someone bypasses the service.
            entry["unleased_use"] = json.loads(raw.unleased[slot])
            entry["unleased_use"]["since"] /= 1000
        if lease is not None:
            entry["lease"] = _lease_entry(lease)
        gpus.append(entry)
    last = raw.alive_at.get(name, -1)
    node = {
        "name": name,
        "pool": inv["pool"],
        "source": inv.get("source", ""),
        "isolation": inv.get("isolation", ""),
        "state": "up" if is_up else "down",
        "heartbeat_deadline": last / 1000 if last > 0 else None,
        "gpus": gpus,
    }
    if inv.get("suspend"):  # its agent suspends evicted warm workers to host memory (node/onhost.py)
        node["suspend"] = inv["suspend"]
        node["suspended"] = _suspended(raw.suspended.get(name))
    return node


def _lease_entry(lease: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": lease["id"],
        "user": lease["user"],
        "label": lease.get("label", ""),
        "since": lease["created_at"] / 1000,
        "expires_at": lease["expires_at"] / 1000,
        # its deadline is pushed by ttl at each renewal: one nearer than half of it was not renewed in time
        "ttl": lease.get("ttl_ms", 0) / 1000,
    }
    if lease.get("ends_by"):  # its holder means to end it by then (a cell's --timeout)
        out["ends_by"] = lease["ends_by"] / 1000
    if lease.get("reclaim_at"):
        out["idle_warning"] = True
        out["reclaim_at"] = lease["reclaim_at"] / 1000
    for key in ("notebook", "cell"):  # where the lease comes from: the board names it
        if lease.get(key):
            out[key] = lease[key]
    if lease.get("resv"):  # the booking it is served from, "reservation" on the wire
        out["reservation"] = lease["resv"]
    if lease.get("borrowed"):
        out["borrowed"] = True
    if lease.get("recall_at"):
        out["recall_at"] = lease["recall_at"] / 1000
        if lease.get("recall_for"):  # whom its GPUs go to
            out["recall_for"] = lease["recall_for"]
    if lease.get("warm_since"):
        out["warm_since"] = lease["warm_since"] / 1000
    if "mem_used_mb" in lease:
        out["mem_used_mb"] = lease["mem_used_mb"]
        out["mem_peak_mb"] = lease["mem_peak_mb"]
    if lease.get("shrink_to"):  # asked to give GPUs back for a waiting request
        out["shrink_to"] = int(lease["shrink_to"])
        out["shrink_by"] = lease["shrink_by"] / 1000
    return out


def _finish_pools(engine: Engine, pools: dict[str, dict[str, Any]]) -> str | None:
    cpu_pool = engine.settings.cpu_pool
    for name, counts in pools.items():
        counts["kind"] = "cpu" if name == cpu_pool else "gpu"
        sched = engine.settings.sched_table(name)
        if sched["share"]:  # its GPUs may be sliced: in what unit (a client rounds --gpu-mem auto to it)
            counts["share"] = True
            counts["slice_unit_mb"] = int(sched["slice_unit_mb"])  # type: ignore[call-overload]
    return cpu_pool if cpu_pool in pools else None


async def cluster_view(engine: Engine) -> dict[str, Any]:
    """Every node and GPU with its state (free / leased / down) and holder, and ``as_of_event``: the
    id of the newest event when it was read (every change up to that event is in the view; the
    scripts write a change and its event in one step)."""
    raw = await _read_all(engine)
    nodes: list[dict[str, Any]] = []
    pools: dict[str, dict[str, Any]] = {}
    for i, name in enumerate(sorted(raw.nodes_raw)):
        if i and i % YIELD_EVERY == 0:
            await asyncio.sleep(0)
        nodes.append(_build_node(name, raw))
        _add_counts(pools, nodes[-1])
    await _mark_reserved(engine, nodes, pools, int(raw.now_s * 1000))
    cpu_pool = _finish_pools(engine, pools)
    return {"now": raw.now_s, "as_of_event": raw.newest_event, "nodes": nodes, "pools": pools, "cpu_pool": cpu_pool}


# Event types after which a view is read whole again: a node's inventory or pool may have changed,
# or bookings (their reserved marks span a pool).
WHOLE_AFTER = frozenset({"node_registered", *BOOKING_EVENTS})
MAX_INCREMENT = 256  # events since a view beyond which it is read whole again
MAX_INCREMENT_NODES = 64  # nodes to read again beyond which it is read whole again


def _touched(events: list[dict[str, Any]], where: Mapping[str, AbstractSet[str]]) -> set[str] | None:
    """The nodes the events name, or hold a lease they name (``where``: lease id -> its nodes in the
    view they follow, a gang's all of them); None if one of them calls for a whole read."""
    out: set[str] = set()
    for ev in events:
        if ev.get("type") in WHOLE_AFTER:
            return None
        out |= event_nodes(ev)
        lease = ev.get("lease")
        if isinstance(lease, str) and lease in where:
            out |= where[lease]
    return out


async def _read_nodes(engine: Engine, view: dict[str, Any], names: list[str]) -> _Raw | None:
    """What the view of ``names`` (nodes of ``view``, whose GPUs and pools have not changed) is made
    of now, read as one: None if a change to them came between its two steps (the caller reads
    again, or whole)."""
    r, k = engine.redis, engine.keys
    by_name = {n["name"]: n for n in view["nodes"]}
    slots = [f"{name}/{g['index']}" for name in names for g in by_name[name]["gpus"]]
    fit_members = [
        (name, f"{by_name[name]['pool']}|{c:05d}|{name}")
        for name in names
        for c in range(len(by_name[name]["gpus"]) + 1)
    ]
    async with r.pipeline(transaction=True) as p:
        p.xrevrange(k.events, count=1)
        p.hmget(k.nodes, names)
        p.hmget(k.free, names)
        p.hmget(k.suspended, names)
        for name in names:
            p.zscore(k.alive, name)
        for _, member in fit_members:
            p.zscore(k.fit, member)
        for key in (k.holders, k.last, k.unleased, k.draining, k.sliced):
            p.hmget(key, slots)
        got = await p.execute()
    first, inv, free, suspended = got[0], got[1], got[2], got[3]
    alive = got[4 : 4 + len(names)]
    fit = got[4 + len(names) : 4 + len(names) + len(fit_members)]
    holders, last, unleased, draining, sliced = got[4 + len(names) + len(fit_members) :]
    if any(raw is None for raw in inv):
        return None  # a node gone: read whole
    now = await r.time()

    def present(keys: list[str], values: list[Any]) -> dict[str, Any]:
        return {key: v for key, v in zip(keys, values, strict=True) if v is not None}

    held = present(slots, holders)
    shared = present(slots, sliced)
    ids = {lid for lid in held.values() if lid != "~slices"}
    for ledger in shared.values():
        ids |= set((json.loads(ledger).get("leases") or {}).keys())
    lease_ids = sorted(ids)
    async with r.pipeline(transaction=True) as p:
        p.xrevrange(k.events, count=1)
        if lease_ids:
            p.hmget(k.leases, lease_ids)
        got = await p.execute()
    second = got[0]
    leases = {lid: json.loads(v) for lid, v in zip(lease_ids, got[1] if lease_ids else [], strict=True) if v}
    if _event_id(second) != _event_id(first):
        # Something happened between the two steps: the leases read may not be those held. Read
        # again unless none of it names these nodes or leases.
        between: Any = await r.xrange(k.events, f"({_event_id(first)}", _event_id(second), count=MAX_INCREMENT)
        evs = [parse_entry(i, f) for i, f in between]
        touched = _touched(evs, {lid: {""} for lid in ids})
        if len(evs) >= MAX_INCREMENT or touched is None or touched & set(names) or "" in touched:
            return None
    await _with_memory(engine, leases)
    return _Raw(
        _event_id(first),
        now[0] + now[1] / 1e6,
        present(names, inv),
        {name: float(v) for name, v in zip(names, alive, strict=True) if v is not None},
        {name for (name, _), v in zip(fit_members, fit, strict=True) if v is not None},
        present(names, free),
        held,
        leases,
        present(slots, last),
        present(slots, unleased),
        present(slots, draining),
        shared,
        present(names, suspended),
    )


def _leases_on(node: dict[str, Any]) -> set[str]:
    """The ids of the leases holding the node's GPUs and slices."""
    out = {g["lease"]["id"] for g in node["gpus"] if g.get("lease") is not None}
    for g in node["gpus"]:
        out |= {sl["lease"] for sl in g.get("slices") or ()}
    return out


def lease_nodes(view: dict[str, Any]) -> dict[str, frozenset[str]]:
    """Lease id -> the nodes of ``view`` it holds GPUs or slices on (a gang's all of them)."""
    where: dict[str, set[str]] = {}
    for n in view["nodes"]:
        for lid in _leases_on(n):
            where.setdefault(lid, set()).add(n["name"])
    return {lid: frozenset(nodes) for lid, nodes in where.items()}


def node_index(view: dict[str, Any]) -> dict[str, int]:
    return {n["name"]: i for i, n in enumerate(view["nodes"])}


async def refreshed_view(
    engine: Engine,
    view: dict[str, Any],
    where: dict[str, frozenset[str]] | None = None,
    index: dict[str, int] | None = None,
) -> dict[str, Any] | None:
    """``view`` brought up to date by reading again only the nodes that the events since it name
    (or on which a lease they name is): a few keys, however large the cluster. None where it must
    be read whole: too many events or nodes, a node registered or changed, a booking event, a
    booking in force now or at the view (reserved marks span a pool), or changes that keep coming
    between the read's two steps. The result holds every event up to its ``as_of_event``.
    ``where`` (:func:`lease_nodes`) and ``index`` (:func:`node_index`) of ``view``, if the caller
    keeps them (a snapshot does), spare a walk of the whole view."""
    if any(c.get("reserved") for c in view["pools"].values()):
        return None
    r, k = engine.redis, engine.keys
    where = lease_nodes(view) if where is None else where
    index = node_index(view) if index is None else index
    known = index.keys()
    names: set[str] = set()
    seen = view["as_of_event"]  # every event up to here is looked at
    for _ in range(4):
        since: Any = await r.xrange(k.events, f"({seen}", "+", count=MAX_INCREMENT)
        evs = [parse_entry(i, f) for i, f in since]
        touched = _touched(evs, where)
        if len(evs) >= MAX_INCREMENT or touched is None:
            return None
        names |= touched
        seen = evs[-1]["id"] if evs else seen
        if not names <= known or len(names) > MAX_INCREMENT_NODES:
            return None
        raw = await _read_nodes(engine, view, sorted(names)) if names else None
        if names and raw is None:
            continue  # a change between its two steps: again
        if raw is not None and raw.newest_event != seen:
            # events after the look above and before the read: what they touched must be in it
            later: Any = await r.xrange(k.events, f"({seen}", raw.newest_event, count=MAX_INCREMENT)
            evs = [parse_entry(i, f) for i, f in later]
            touched = _touched(evs, where)
            if len(evs) >= MAX_INCREMENT or touched is None:
                return None
            seen = raw.newest_event
            if not touched <= names:
                names |= touched
                continue
        now = await r.time()
        if await Bookings(engine).in_force(now[0] * 1000 + now[1] // 1000):
            return None
        nodes = list(view["nodes"])
        pools = {name: dict(counts) for name, counts in view["pools"].items()}
        for name in sorted(names):
            assert raw is not None
            old = nodes[index[name]]
            new = _build_node(name, raw)
            if new["pool"] != old["pool"] or len(new["gpus"]) != len(old["gpus"]):
                return None
            _add_counts(pools, old, -1)
            _add_counts(pools, new)
            nodes[index[name]] = new
        return {
            "now": now[0] + now[1] / 1e6,
            "as_of_event": seen,
            "nodes": nodes,
            "pools": pools,
            "cpu_pool": view["cpu_pool"],
            "changed": sorted(index[name] for name in names),
        }
    return None


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
                "ttl": lease.get("ttl_ms", 0) / 1000,
            }
        )
        if lease.get("ends_by"):
            out[-1]["ends_by"] = lease["ends_by"] / 1000
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
                # when the occurrence in force ends (the GPU is the pool's again then)
                ends = [e for _k, s, e in occurrences(r, now_ms, now_ms + 1) if s <= now_ms < e]
                if ends:
                    g["reservation"]["end"] = ends[0] / 1000
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
    _by_user: dict[str, dict[str, int]] | None = None  # user -> lease id -> GPUs (or slices) of it here
    _where: dict[str, frozenset[str]] | None = None  # lease id -> its nodes (lease_nodes)
    _index: dict[str, int] | None = None  # node -> its place in the view (node_index)

    def where(self) -> dict[str, frozenset[str]]:
        if self._where is None:
            self._where = lease_nodes(self.view)
        return self._where

    def index(self) -> dict[str, int]:
        if self._index is None:
            self._index = node_index(self.view)
        return self._index

    @classmethod
    def following(cls, prev: Snapshot, view: dict[str, Any], changed: list[int], at: float) -> Snapshot:
        """The snapshot of ``view``: ``prev``'s view with the nodes at ``changed`` read again (the
        same nodes in the same order), keeping what ``prev`` made of the others."""
        snap = cls(view, at, list(prev._nodes_json), prev._by_pool)
        snap._index = prev._index  # the same nodes in the same order
        for i in changed:
            if snap._nodes_json:
                snap._nodes_json[i] = None
        if prev._by_user is not None:
            by_user = dict(prev._by_user)  # (copied on write: prev's stays as it was)
            olds = [prev.view["nodes"][i] for i in changed]
            news = [view["nodes"][i] for i in changed]
            for n in olds + news:
                for g in n["gpus"]:
                    users = [g["lease"]["user"]] if g.get("lease") is not None else []
                    for u in users + [sl["user"] for sl in g.get("slices") or ()]:
                        if u in by_user and by_user[u] is prev._by_user.get(u):
                            by_user[u] = dict(by_user[u])
            for n in olds:
                _count_leases(by_user, n, -1)
            for n in news:
                _count_leases(by_user, n, 1)
            snap._by_user = by_user
        if prev._where is not None:
            where = dict(prev._where)
            for i in changed:
                name = view["nodes"][i]["name"]
                gone, held = _leases_on(prev.view["nodes"][i]), _leases_on(view["nodes"][i])
                for lid in gone - held:
                    rest = where.get(lid, frozenset()) - {name}
                    if rest:
                        where[lid] = rest
                    else:
                        where.pop(lid, None)
                for lid in held - gone:
                    where[lid] = where.get(lid, frozenset()) | {name}
            snap._where = where
        return snap

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
            by_user: dict[str, dict[str, int]] = {}
            for n in self.view["nodes"]:
                _count_leases(by_user, n, 1)
            self._by_user = by_user
        return sorted(self._by_user.get(user, ()))

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


def _count_leases(by_user: dict[str, dict[str, int]], node: dict[str, Any], sign: int) -> None:
    """Add (sign -1: take away) the leases holding the node's GPUs and slices to ``by_user``."""
    for g in node["gpus"]:
        held = [(g["lease"]["user"], g["lease"]["id"])] if g.get("lease") is not None else []
        held += [(sl["user"], sl["lease"]) for sl in g.get("slices") or ()]
        for user, lid in held:
            ids = by_user.setdefault(user, {})
            ids[lid] = ids.get(lid, 0) + sign
            if ids[lid] <= 0:
                del ids[lid]
                if not ids:
                    del by_user[user]


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
      ask, and whoever asks meanwhile waits for that next read and shares it;
    * a read is of the whole cluster at most every ``whole_every_s`` (and whenever
      :func:`refreshed_view` cannot do with less); in between, only the nodes that the events since
      the last snapshot name are read again (a grant: its node), so that a change costs what it
      touched, not the cluster. What changes without an event (samples, heartbeats) shows within
      ``whole_every_s``, as often as the node agents send samples.
    """

    def __init__(
        self, engine: Engine, max_age_s: float = 1.0, max_gap_s: float = 1.0, whole_every_s: float = 5.0
    ) -> None:
        self.engine, self.max_age_s, self.max_gap_s = engine, max_age_s, max_gap_s
        self.whole_every_s = whole_every_s
        self.reads = 0  # snapshots read (for tests and benches)
        self.whole_reads = 0  # of which of the whole cluster
        self._whole_at = -float("inf")
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
            prev, view = self._snap, None
            if prev is not None and t0 - self._whole_at < self.whole_every_s:
                view = await refreshed_view(self.engine, prev.view, prev.where(), prev.index())
            if prev is not None and view is not None:
                snap = Snapshot.following(prev, view, view.pop("changed"), t0)
            else:
                snap = Snapshot(await cluster_view(self.engine), t0)
                self._whole_at = t0
                self.whole_reads += 1
            self._snap = snap
            self.reads += 1
            took = time.monotonic() - t0
            self._next_at = time.monotonic() + min(self.max_gap_s, 2 * took)
            return snap
        finally:
            self._reading = None
