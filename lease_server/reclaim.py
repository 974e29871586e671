"""Idle-GPU reclaim: take back GPUs that are leased but unused, without killing real work.

Evidence comes from the GPUs themselves. Node agents sample every GPU (utilization, memory,
processes) into a short rolling window in Redis (lua/samples.lua). A lease is **idle** when

1. every one of its GPUs stayed under the pool's ``idle_threshold`` for the whole
   ``idle_timeout`` (samples covering the window; brief spikes above it reset the clock), and
2. its holder is not visibly working: a holder that reports a running cell (the magic renews
   with ``activity.executing``) *and* holds GPU memory is loading data or stepping through a
   debugger, not forgotten, so it is left alone;

and it is older than ``min_age`` (and than its last "I'm still using it"). An idle lease is
warned (event ``idle_warning``, shown in its notebook cell and on the board); after ``grace``
seconds it is revoked (event ``reclaimed``) unless its owner kept it (``POST .../keep``, at most
``max_extensions`` times) or released it. Warning and reclaim are atomic scripts that check the
lease's fencing token, so racing a release, a renew or a keep can never free a GPU twice.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from . import errors
from .lease import LeaseStore
from .scripts import Code, raise_for

log = logging.getLogger(__name__)
MAX_WINDOW = 240  # samples kept per GPU, whatever the timeout (bounds Redis memory per GPU)


@dataclass
class Policy:
    enabled: bool = True
    idle_threshold: float = 5.0
    idle_timeout: float = 600.0
    grace: float = 120.0
    min_age: float = 120.0
    max_extensions: int = 3
    exempt_users: list[str] = field(default_factory=list)
    exempt_labels: list[str] = field(default_factory=list)

    @classmethod
    def from_settings(cls, store: LeaseStore) -> Policy:
        s = store.settings
        return cls(s.reclaim_enabled, s.idle_threshold, s.idle_timeout, s.grace, s.min_age, s.max_extensions)

    def updated(self, changes: object) -> Policy:
        """A copy with ``changes`` applied, every field checked (BadRequest says which is wrong)."""
        if not isinstance(changes, dict):
            raise errors.BadRequest('policy must be a JSON object, e.g. {"idle_timeout": 900}')
        names = {f.name: f for f in fields(self)}
        unknown = sorted(set(changes) - set(names))
        if unknown:
            raise errors.BadRequest(f"unknown policy field(s) {unknown}; allowed: {', '.join(names)}")
        out = Policy(**asdict(self))
        for key, value in changes.items():
            kind = names[key].type
            if kind == "bool":
                if not isinstance(value, bool):
                    raise errors.BadRequest(f"{key} must be true or false, got {value!r}")
            elif kind in ("float", "int"):
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                    raise errors.BadRequest(f"{key} must be a number, got {value!r}")
                if kind == "int" and value != int(value):
                    raise errors.BadRequest(f"{key} must be a whole number, got {value!r}")
                value = int(value) if kind == "int" else float(value)
            else:
                if not isinstance(value, list) or not all(isinstance(v, str) and len(v) <= 200 for v in value):
                    raise errors.BadRequest(f"{key} must be a list of names, got {value!r}")
            setattr(out, key, value)
        if not 0 <= out.idle_threshold <= 100:
            raise errors.BadRequest(f"idle_threshold is a utilization in %, 0 to 100, got {out.idle_threshold}")
        for key in ("idle_timeout", "grace", "min_age"):
            if not 0 <= getattr(out, key) <= 7 * 86400:
                raise errors.BadRequest(f"{key} must be between 0 and 604800 seconds")
        if out.idle_timeout <= 0:
            raise errors.BadRequest("idle_timeout must be positive")
        if not 0 <= out.max_extensions <= 1000:
            raise errors.BadRequest("max_extensions must be between 0 and 1000")
        return out


async def policies(store: LeaseStore) -> dict[str, Policy]:
    """The effective policy of every pool: settings, then the config's [policy.POOL], then the
    admin's run-time changes."""
    base = Policy.from_settings(store)
    stored = await store.redis.hgetall(store.keys.policy)
    out: dict[str, Policy] = {}
    for pool in await store.pool_sizes():
        pol = base.updated(store.settings.policy_overrides.get(pool, {}))
        if pool in stored:
            pol = pol.updated(json.loads(stored[pool]))
        out[pool] = pol
    return out


async def set_policy(store: LeaseStore, pool: str, changes: object, by: str) -> Policy:
    """Change one pool's policy at run time (callers check that ``by`` is an admin)."""
    known = await store.pool_sizes()
    if pool not in known:
        raise errors.UnknownPool(f"unknown pool {pool!r}; known pools: {', '.join(sorted(known)) or 'none'}")
    current = (await policies(store))[pool]
    new = current.updated(changes)
    raw = await store.redis.hget(store.keys.policy, pool)
    stored = json.loads(raw) if raw else {}
    assert isinstance(changes, dict)  # checked by updated()
    stored.update(changes)
    await store.redis.hset(store.keys.policy, pool, json.dumps(stored))
    await store.redis.xadd(
        store.keys.events,
        {
            "type": "policy_changed",
            "data": json.dumps({"pool": pool, "by": by, "changes": changes, "policy": asdict(new)}),
        },
        maxlen=store.settings.event_log_max,
        approximate=True,
    )
    log.info("policy of pool %s changed by %s: %s", pool, by, changes)
    return new


def window_length(store: LeaseStore, pols: dict[str, Policy] | None = None) -> int:
    longest = max([p.idle_timeout for p in (pols or {}).values()] + [store.settings.idle_timeout])
    return min(MAX_WINDOW, math.ceil(longest / store.settings.sample_interval) + 4)


# ---- samples -------------------------------------------------------------------------------------


async def record_samples(
    store: LeaseStore,
    node: str,
    pool: str,
    gpus: list[dict[str, Any]],
    threshold: float | None = None,
    now_ms: int | None = None,
) -> tuple[int, int]:
    """Store one sample of ``node``'s GPUs: [{index, util, mem_mb, procs}]. Returns (recorded,
    GPUs in use by processes that no live lease covers)."""
    k = store.keys
    if threshold is None:
        pols = await policies(store)
        threshold = pols[pool].idle_threshold if pool in pols else store.settings.idle_threshold
    args: list[Any] = [
        "" if now_ms is None else now_ms,
        store.settings.event_log_max,
        window_length(store),
        threshold,
        node,
    ]
    keys = [k.last, k.busy_at, k.holders, k.unleased, k.events]
    for g in gpus:
        keys.append(k.samples(f"{node}/{g['index']}"))
        args += [
            int(g["index"]),
            round(float(g.get("util", 0)), 1),
            int(g.get("mem_mb", 0)),
            json.dumps([int(p) for p in g.get("procs", [])]),
        ]
    recorded, unleased = await store.scripts.call_raw("samples", keys, args)
    return int(recorded), int(unleased)


def check_samples_body(body: object) -> list[dict[str, Any]]:
    """Validate an agent's POST .../samples body: {"gpus": [{index, util, mem_mb, procs}]}."""
    gpus = body.get("gpus") if isinstance(body, dict) else None
    if not isinstance(gpus, list) or not 1 <= len(gpus) <= 4096:
        raise errors.BadRequest('samples must be {"gpus": [{"index", "util", "mem_mb", "procs"}, ...]}')
    out = []
    for g in gpus:
        if not isinstance(g, dict):
            raise errors.BadRequest("each sample must be an object {index, util, mem_mb, procs}")
        out.append(check_gpu_sample(g))
    return out


def check_gpu_sample(g: dict[str, Any], index: object = None) -> dict[str, Any]:
    idx = g.get("index", index)
    util, mem, procs = g.get("util", 0), g.get("mem_mb", 0), g.get("procs", [])
    if isinstance(idx, bool) or not isinstance(idx, int) or idx < 0:
        raise errors.BadRequest(f"index must be a GPU index >= 0, got {idx!r}")
    if isinstance(util, bool) or not isinstance(util, (int, float)) or not 0 <= util <= 100:
        raise errors.BadRequest(f"util must be a utilization between 0 and 100 (%), got {util!r}")
    if isinstance(mem, bool) or not isinstance(mem, int) or mem < 0:
        raise errors.BadRequest(f"mem_mb must be an integer >= 0, got {mem!r}")
    if (
        not isinstance(procs, list)
        or len(procs) > 1000
        or not all(isinstance(p, int) and not isinstance(p, bool) and p >= 0 for p in procs)
    ):
        raise errors.BadRequest(f"procs must be a list of process ids, got {procs!r}")
    return {"index": idx, "util": util, "mem_mb": mem, "procs": procs}


async def simulated_sample(store: LeaseStore, node: str, indexes: list[int]) -> list[dict[str, Any]]:
    """What the simulated GPUs of ``node`` report now (set with gpulease simulate util)."""
    raws = await store.redis.hmget(store.keys.sim, [f"{node}/{i}" for i in indexes])
    out = []
    for i, raw in zip(indexes, raws, strict=True):
        g = json.loads(raw) if raw else {}
        out.append({"index": i, "util": g.get("util", 0), "mem_mb": g.get("mem_mb", 0), "procs": g.get("procs", [])})
    return out


async def set_simulated(store: LeaseStore, node: str, gpus: dict[int, dict[str, Any]]) -> None:
    raw = await store.redis.hget(store.keys.nodes, node)
    if raw is None:
        raise errors.UnknownNode(f"node {node!r} is not registered")
    inv = json.loads(raw)
    if inv.get("source") != "simulated":
        raise errors.BadRequest(f"node {node!r} reports real GPUs through NVML; only simulated GPUs can be set")
    present = {g["index"] for g in inv["gpus"]}
    missing = sorted(set(gpus) - present)
    if missing:
        raise errors.BadRequest(f"node {node!r} has no GPU {missing}; it has {sorted(present)}")
    await store.redis.hset(store.keys.sim, mapping={f"{node}/{i}": json.dumps(v) for i, v in gpus.items()})


# ---- the verdict ---------------------------------------------------------------------------------


def parse_window(raw: list[str]) -> list[tuple[float, float, int]]:
    """Stored "ts_ms,util,mem_mb" entries as (ts seconds, util %, mem MB)."""
    out = []
    for item in raw:
        ts, util, mem = item.split(",")
        out.append((int(ts) / 1000, float(util), int(mem)))
    return out


def idle_verdict(
    lease: dict[str, Any],
    windows: dict[int, list[tuple[float, float, int]]],
    policy: Policy,
    now_ms: int,
    sample_interval: float,
) -> tuple[bool, dict[str, Any]]:
    """Is ``lease`` idle now? Returns (idle, evidence). Pure: the tests drive it directly too.

    ``windows``: per leased GPU index, its samples (ts seconds, util %, mem MB), oldest first.
    """
    now_s = now_ms / 1000
    clock_from = max(lease["created_at"] + policy.min_age * 1000, lease.get("kept_at") or 0) / 1000
    since = now_s - policy.idle_timeout
    evidence: dict[str, Any] = {
        "threshold": policy.idle_threshold,
        "idle_timeout": policy.idle_timeout,
        "activity": lease.get("activity"),
        "gpus": {},
    }
    if lease["user"] in policy.exempt_users or (lease.get("label") and lease["label"] in policy.exempt_labels):
        return False, {**evidence, "why": "exempt"}
    if clock_from > since:
        return False, {**evidence, "why": "too young (min_age or a recent keep)"}
    for idx, samples in windows.items():
        recent = [s for s in samples if s[0] >= since - sample_interval]
        evidence["gpus"][str(idx)] = [[round(ts, 1), util, mem] for ts, util, mem in samples[-60:]]
        # Coverage: samples reach back to the start of the window and are current.
        if not recent or recent[0][0] > since + 2 * sample_interval or recent[-1][0] < now_s - 3 * sample_interval:
            return False, {**evidence, "why": f"not enough samples for GPU {idx}"}
        busy = [s for s in recent if s[1] >= policy.idle_threshold]
        if busy:
            return False, {**evidence, "why": f"GPU {idx} was busy at {busy[-1][0]}"}
    activity = lease.get("activity") or {}
    holds_memory = any(w and w[-1][2] > 0 for w in windows.values())
    if activity.get("executing") and holds_memory:
        return False, {**evidence, "why": "a running cell holds GPU memory"}
    last_busy = max((s[0] for w in windows.values() for s in w if s[1] >= policy.idle_threshold), default=None)
    first = min((w[0][0] for w in windows.values() if w), default=now_s)
    evidence["idle_s"] = round(now_s - max(clock_from, last_busy if last_busy is not None else first), 1)
    evidence["why"] = "idle"
    return True, evidence


class Reclaimer:
    """Runs in every server process; warnings and reclaims are atomic, so replicas can race."""

    def __init__(self, store: LeaseStore) -> None:
        self.store = store

    async def tick(self, now_ms: int | None = None) -> tuple[int, int, float]:
        """One pass over live leases. Returns (warned, reclaimed, seconds until the next due reclaim)."""
        store, k = self.store, self.store.keys
        if now_ms is None:
            t = await store.redis.time()
            now_ms = t[0] * 1000 + t[1] // 1000
        pols = await policies(store)
        warned = reclaimed = 0
        next_due = math.inf
        for lease in await store.live_leases():
            pol = pols.get(lease["pool"])
            if pol is None or not pol.enabled:
                continue
            if lease.get("reclaim_at"):
                slots = [f"{lease['node']}/{g['index']}" for g in lease["gpus"]]
                busy = await store.redis.hmget(k.busy_at, slots)
                if any(b is not None and int(b) >= lease["warned_at"] for b in busy):
                    # Used again during the grace: the warning lapses by itself.
                    await store.run("keep", [lease["id"], lease["user"], "1", pol.max_extensions, "auto"])
                    continue
                if lease["reclaim_at"] <= now_ms:
                    evidence = await self._evidence(lease, pol, now_ms)
                    if await self._run("reclaim", lease, [json.dumps(evidence)], now_ms):
                        reclaimed += 1
                else:
                    next_due = min(next_due, (lease["reclaim_at"] - now_ms) / 1000)
                continue
            slots = [f"{lease['node']}/{g['index']}" for g in lease["gpus"]]
            busy = await store.redis.hmget(k.busy_at, slots)
            cutoff = now_ms - pol.idle_timeout * 1000
            if any(b is not None and int(b) >= cutoff for b in busy):
                continue  # cheap check first: some GPU was busy inside the window
            idle, evidence = idle_verdict(
                lease, await self._windows(lease), pol, now_ms, store.settings.sample_interval
            )
            if idle:
                if await self._run("idle_warn", lease, [int(pol.grace * 1000), json.dumps(evidence)], now_ms):
                    warned += 1
                    log.info(
                        "idle warning %s user=%s: idle %.0fs, reclaim in %.0fs",
                        lease["id"],
                        lease["user"],
                        evidence["idle_s"],
                        pol.grace,
                    )
                    next_due = min(next_due, pol.grace)
        return warned, reclaimed, next_due

    async def _windows(self, lease: dict[str, Any]) -> dict[int, list[tuple[float, float, int]]]:
        k = self.store.keys
        async with self.store.redis.pipeline(transaction=False) as p:
            for g in lease["gpus"]:
                p.lrange(k.samples(f"{lease['node']}/{g['index']}"), 0, -1)
            raws = await p.execute()
        return {int(g["index"]): parse_window(raw) for g, raw in zip(lease["gpus"], raws, strict=True)}

    async def _evidence(self, lease: dict[str, Any], pol: Policy, now_ms: int) -> dict[str, Any]:
        """The warning's evidence, brought up to now: the samples since, and how long idle."""
        evidence = dict(lease.get("idle_evidence") or {})
        windows = await self._windows(lease)
        evidence["gpus"] = {str(i): [[round(t, 1), u, m] for t, u, m in w[-60:]] for i, w in windows.items()}
        evidence["idle_s"] = round(evidence.get("idle_s", 0) + (now_ms - lease.get("warned_at", now_ms)) / 1000, 1)
        evidence["warned_at"] = lease.get("warned_at", 0) / 1000
        busy = [
            t
            for w in windows.values()
            for t, u, _ in w
            if u >= pol.idle_threshold and t * 1000 >= lease.get("warned_at", 0)
        ]
        evidence["busy_during_grace"] = bool(busy)  # used again during the grace but not kept
        return evidence

    async def _run(self, script: str, lease: dict[str, Any], extra: list[Any], now_ms: int | None) -> bool:
        code, rest = await self.store.run(script, [lease["id"], str(lease["token"]), *extra])
        if code is Code.OK:
            if script == "reclaim":
                log.info("reclaimed %s user=%s pool=%s", lease["id"], lease["user"], lease["pool"])
            return True
        if code in (Code.NO_SUCH, Code.STALE, Code.ENDED, Code.NOT_DUE):
            return False  # released, renewed into a new grant, already warned or kept: fine
        raise_for(code, lease["id"])
        return False

    async def run_forever(self, stop: asyncio.Event) -> None:
        interval = self.store.settings.sample_interval
        while not stop.is_set():
            wait = interval
            try:
                _, _, next_due = await self.tick()
                wait = max(0.01, min(interval, next_due))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away: state is safe there; try again next tick
                log.warning("reclaim pass failed: %s", exc)
            try:
                await asyncio.wait_for(stop.wait(), timeout=wait)
            except TimeoutError:
                pass


async def keep(store: LeaseStore, lease_id: str, user: str, admin: bool) -> dict[str, Any]:
    """ "I'm still using it": reset the idle clock (limited per lease)."""
    rec = await store.get(lease_id)
    pol = (await policies(store)).get(rec["pool"], Policy.from_settings(store))
    code, rest = await store.run("keep", [lease_id, user, "1" if admin else "0", pol.max_extensions, ""])
    if code is Code.OK:
        return dict(json.loads(rest[0]))
    if code is Code.LIMIT:
        raise errors.Conflict(
            f"lease {lease_id} was already kept {rest[0]} times, the most pool {rec['pool']} allows; "
            "use the GPUs, or release them and acquire again when you need them",
            extensions=int(rest[0]),
        )
    if code is Code.ENDED:
        raise errors.LeaseEnded(f"lease {lease_id} has ended ({json.loads(rest[0]).get('end_reason', '')})")
    raise_for(code, lease_id)
    raise AssertionError("unreachable")
