"""Inventory: nodes, their GPUs and pools; registration, heartbeats and the cluster view."""

from __future__ import annotations

import json
import logging
import re
import socket
from dataclasses import asdict, dataclass, field
from typing import Any

from . import errors
from .engine import Engine
from .keys import NAME_RE
from .lease import check_name
from .reservations import Bookings
from .scripts import Register

log = logging.getLogger(__name__)

MAX_GPUS_PER_NODE = 4096
_SIM_RE = re.compile(r"^(\d+)x([A-Za-z0-9][A-Za-z0-9._]*?)(?:-(\d+)GB)?$", re.IGNORECASE)


@dataclass
class Gpu:
    index: int
    uuid: str
    model: str
    memory_mb: int


@dataclass
class NodeInventory:
    node: str
    pool: str
    gpus: list[Gpu]
    source: str = "simulated"  # "nvml" | "simulated"
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        body = {"pool": self.pool, "source": self.source, "gpus": [asdict(g) for g in self.gpus]}
        return json.dumps(body, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_body(cls, node: str, body: object) -> NodeInventory:
        """Validate an inventory sent by an agent over HTTP."""
        check_name("node", node)
        if not isinstance(body, dict):
            raise errors.BadRequest("inventory must be a JSON object {pool, gpus: [...]}")
        pool = check_name("pool", body.get("pool"))
        gpus = body.get("gpus")
        if not isinstance(gpus, list) or not 1 <= len(gpus) <= MAX_GPUS_PER_NODE:
            raise errors.BadRequest(f"gpus must be a list of 1 to {MAX_GPUS_PER_NODE} GPU objects")
        out: list[Gpu] = []
        seen: set[int] = set()
        for g in gpus:
            if not isinstance(g, dict):
                raise errors.BadRequest("each GPU must be an object {index, uuid, model, memory_mb}")
            idx, mem = g.get("index"), g.get("memory_mb", 0)
            if isinstance(idx, bool) or not isinstance(idx, int) or idx < 0 or idx in seen:
                raise errors.BadRequest(f"GPU index must be a distinct integer >= 0, got {idx!r}")
            if isinstance(mem, bool) or not isinstance(mem, int) or mem < 0:
                raise errors.BadRequest(f"memory_mb must be an integer >= 0, got {mem!r}")
            seen.add(idx)
            out.append(Gpu(idx, str(g.get("uuid", ""))[:100], str(g.get("model", ""))[:100], mem))
        source = body.get("source", "simulated")
        if source not in ("nvml", "simulated"):
            raise errors.BadRequest("source must be 'nvml' or 'simulated'")
        return cls(node, pool, sorted(out, key=lambda g: g.index), source)


def default_node_name() -> str:
    name = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:63].strip("-.") or "node"
    return name if NAME_RE.match(name) else "node"


def parse_simulate(
    spec: str, default_node: str | None = None, pool_overrides: dict[str, str] | None = None
) -> list[NodeInventory]:
    """Parse ``4xA100-80GB`` or ``node-a=4xA100-80GB,node-b=2xT4-16GB`` into inventories.

    The pool of a node is its GPU model with memory (``A100-80GB``) unless ``pool_overrides``
    names another one for that node.
    """
    overrides = pool_overrides or {}
    nodes: list[NodeInventory] = []
    for i, part in enumerate(p.strip() for p in spec.split(",") if p.strip()):
        if "=" in part:
            node, gpu_spec = (s.strip() for s in part.split("=", 1))
        else:
            node = default_node or default_node_name()
            node = node if i == 0 else f"{node}-{i}"
            gpu_spec = part
        m = _SIM_RE.match(gpu_spec)
        if not m or not NAME_RE.match(node):
            raise errors.ConfigurationError(
                f"cannot read simulated inventory {part!r}: write COUNTxMODEL[-MEMGB], "
                "e.g. 4xA100-80GB, or NODE=COUNTxMODEL for several nodes"
            )
        count, model, mem_gb = int(m.group(1)), m.group(2), int(m.group(3) or 0)
        if not 1 <= count <= MAX_GPUS_PER_NODE:
            raise errors.ConfigurationError(f"{part!r}: a node has 1 to {MAX_GPUS_PER_NODE} GPUs")
        pool = overrides.get(node) or (f"{model}-{mem_gb}GB" if mem_gb else model)
        gpus = [Gpu(k, f"GPU-sim-{node}-{k}", model, mem_gb * 1024) for k in range(count)]
        nodes.append(NodeInventory(node, pool, gpus, "simulated"))
    if not nodes:
        raise errors.ConfigurationError("empty simulated inventory: e.g. --simulate 4xA100-80GB")
    names = [n.node for n in nodes]
    if len(set(names)) != len(names):
        raise errors.ConfigurationError(f"node names repeat in {spec!r}")
    return nodes


async def pool_sizes(engine: Engine) -> dict[str, dict[str, int]]:
    """{pool: {"nodes": n, "gpus": total, "largest": biggest node}} from the sizes index."""
    pools: dict[str, dict[str, int]] = {}
    members: Any = await engine.redis.zrange(engine.keys.sizes, 0, -1)
    for member in members:
        pool, total, _node = member.split("|", 2)
        p = pools.setdefault(pool, {"nodes": 0, "gpus": 0, "largest": 0})
        p["nodes"] += 1
        p["gpus"] += int(total)
        p["largest"] = max(p["largest"], int(total))
    return pools


async def register(engine: Engine, inv: NodeInventory | None, node: str = "", alive_s: float | None = None) -> str:
    """Heartbeat of a node agent; with ``inv``, (re)declare its GPUs. Returns up/registered/alive."""
    s = engine.settings
    alive_ms = int((alive_s if alive_s is not None else s.heartbeat_timeout) * 1000)
    name = inv.node if inv else node
    if inv is not None and inv.node in s.pool_overrides:
        inv.pool = s.pool_overrides[inv.node]
    state: str = await engine.run(Register(name, inv.to_json() if inv else "", alive_ms))
    if state != "alive":
        log.info("node %s %s (pool %s)", name, state, inv.pool if inv else "?")
    return state


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
        nodes_raw, alive, free_raw, holders, leases_raw, fit, newest, unleased, draining = await p.execute()
    now = await r.time()  # Redis's clock; not in the MULTI: a Redis Cluster pipeline takes only keyed commands
    now_s = now[0] + now[1] / 1e6
    alive_at = dict(alive)
    up = {m.split("|", 2)[2] for m in fit}
    leases = {lid: json.loads(v) for lid, v in leases_raw.items()}
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
            },
        )
        counts["nodes"] += 1
        gpus = []
        for g in inv["gpus"]:
            holder = holders.get(f"{name}/{g['index']}")
            lease = leases.get(holder) if holder else None
            drain = draining.get(f"{name}/{g['index']}")
            if lease is not None and lease.get("warm_since"):
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
                if lease.get("resv"):
                    entry["lease"]["reservation"] = lease["resv"]
                if lease.get("borrowed"):
                    entry["lease"]["borrowed"] = True
                if lease.get("recall_at"):
                    entry["lease"]["recall_at"] = lease["recall_at"] / 1000
                if lease.get("warm_since"):
                    entry["lease"]["warm_since"] = lease["warm_since"] / 1000
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
                "state": "up" if is_up else "down",
                "heartbeat_deadline": last / 1000 if last > 0 else None,
                "gpus": gpus,
            }
        )
    await _mark_reserved(engine, nodes, pools, int(now_s * 1000))
    cpu_pool = engine.settings.cpu_pool
    for name, counts in pools.items():
        counts["kind"] = "cpu" if name == cpu_pool else "gpu"  # type: ignore[assignment]
    return {"now": now_s, "nodes": nodes, "pools": pools, "cpu_pool": cpu_pool if cpu_pool in pools else None}


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
