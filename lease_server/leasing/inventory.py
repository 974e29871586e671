"""Inventory: nodes, their GPUs and pools, declared (``--simulate``) or read from NVML; their
registration and heartbeats; the pools' sizes. The board's view of it all is ``board.py``."""

from __future__ import annotations

import json
import logging
import re
import socket
from dataclasses import asdict, dataclass, field
from typing import Any

from .. import errors
from ..store.engine import Engine
from ..store.keys import NAME_RE
from ..store.scripts import Register
from .values import check_name

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
    # How the agent keeps a lease's workers off other GPUs: "cgroup v1 devices", "cgroup v2 BPF",
    # or why it cannot ("off: not root ..."); "" from an agent that does not say.
    isolation: str = ""
    # How its agent suspends an evicted warm worker's GPU state to host memory (node/suspend.py):
    # "simulated", "cuda", or "" where it cannot (the worker is then ended, as before).
    suspend: str = ""

    def to_json(self) -> str:
        body: dict[str, Any] = {"pool": self.pool, "source": self.source, "gpus": [asdict(g) for g in self.gpus]}
        if self.isolation:
            body["isolation"] = self.isolation
        if self.suspend:
            body["suspend"] = self.suspend
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
        isolation = body.get("isolation", "")
        if not isinstance(isolation, str) or len(isolation) > 200 or not isolation.isprintable():
            raise errors.BadRequest("isolation must be one printable line of at most 200 characters")
        return cls(node, pool, sorted(out, key=lambda g: g.index), source, isolation=isolation)


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


async def register(
    engine: Engine, inv: NodeInventory | None, node: str = "", alive_s: float | None = None, quiet: bool = False
) -> str:
    """Heartbeat of a node agent; with ``inv``, (re)declare its GPUs. Returns up/registered/alive.
    ``quiet``: the caller logs the change itself (the in-process agent of ``gpulease up``)."""
    s = engine.settings
    alive_ms = int((alive_s if alive_s is not None else s.heartbeat_timeout) * 1000)
    name = inv.node if inv else node
    if inv is not None and inv.node in s.pool_overrides:
        inv.pool = s.pool_overrides[inv.node]
    state: str = await engine.run(Register(name, inv.to_json() if inv else "", alive_ms))
    if state != "alive" and not quiet:
        log.info("node %s %s (pool %s)", name, state, inv.pool if inv else "?")
    return state
