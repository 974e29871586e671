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
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, NamedTuple

from .. import errors
from ..config import UNLEASED_ACTIONS
from ..protocol import EventType
from ..store.engine import Engine
from ..store.scripts import Drained, GpuSample, IdleWarn, Keep, LeaseRecord, Reclaim, Samples, UnleasedHold
from .inventory import pool_sizes
from .lease import live_leases_sliced, read_lease
from .values import check_gpu_sample

log = logging.getLogger(__name__)
SLICE = 100  # leases (or GPUs) judged between two returns to the event loop: ~5 ms at most
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
    unleased_action: str = "flag"  # or "kill": the node agent terminates unleased processes
    unleased_kill_grace_s: float = 10.0  # SIGTERM, then SIGKILL after this long

    @classmethod
    def from_settings(cls, engine: Engine) -> Policy:
        s = engine.settings
        return cls(
            s.reclaim_enabled,
            s.idle_threshold,
            s.idle_timeout,
            s.grace,
            s.min_age,
            s.max_extensions,
            unleased_action=s.unleased_action,
            unleased_kill_grace_s=s.unleased_kill_grace_s,
        )

    def updated(self, changes: object) -> Policy:
        """A copy with ``changes`` applied, every field checked (BadRequest says which is wrong)."""
        if not isinstance(changes, dict):
            raise errors.BadRequest('policy must be a JSON object, e.g. {"idle_timeout": 900}')
        names = {f.name: f for f in fields(self)}
        if "exempt_labels" in changes:
            raise errors.BadRequest(
                "exempt_labels is no longer a policy field: a lease's label is whatever its requester "
                "types, so it exempted anyone who typed it. Exempt users instead (exempt_users), e.g. "
                "a CI's own token's user"
            )
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
            elif kind == "str":
                if not isinstance(value, str):
                    raise errors.BadRequest(f"{key} must be a string, got {value!r}")
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
        if out.unleased_action not in UNLEASED_ACTIONS:
            raise errors.BadRequest(f"unleased_action must be one of {', '.join(UNLEASED_ACTIONS)}")
        if not 0 <= out.unleased_kill_grace_s <= 3600:
            raise errors.BadRequest("unleased_kill_grace_s must be between 0 and 3600 seconds")
        return out


def _without_labels(stored: dict[str, Any]) -> dict[str, Any]:
    """A pool's stored changes without exempt_labels, which a release before this one stored and
    which no longer exempts anything (Policy.updated says why)."""
    return {k: v for k, v in stored.items() if k != "exempt_labels"}


async def policies(engine: Engine) -> dict[str, Policy]:
    """The effective policy of every pool: settings, then the config's [policy.POOL], then the
    admin's run-time changes."""
    base = Policy.from_settings(engine)
    stored = await engine.redis.hgetall(engine.keys.policy)
    out: dict[str, Policy] = {}
    for pool in await pool_sizes(engine):
        # CPU slots report no utilization: idle reclaim would take every long CPU cell. Off unless
        # the config or an admin turns it on for that pool.
        start = base.updated({"enabled": False}) if pool == engine.settings.cpu_pool else base
        pol = start.updated(engine.settings.policy_overrides.get(pool, {}))
        if pool in stored:
            pol = pol.updated(_without_labels(json.loads(stored[pool])))
        out[pool] = pol
    return out


async def set_policy(engine: Engine, pool: str, changes: object, by: str) -> Policy:
    """Change one pool's policy at run time (callers check that ``by`` is an admin)."""
    known = await pool_sizes(engine)
    if pool not in known:
        raise errors.UnknownPool(f"unknown pool {pool!r}; known pools: {', '.join(sorted(known)) or 'none'}")
    current = (await policies(engine))[pool]
    new = current.updated(changes)
    raw = await engine.redis.hget(engine.keys.policy, pool)
    stored = _without_labels(json.loads(raw)) if raw else {}
    assert isinstance(changes, dict)  # checked by updated()
    stored.update(changes)
    await engine.redis.hset(engine.keys.policy, pool, json.dumps(stored))
    await engine.redis.xadd(
        engine.keys.events,
        {
            "type": "policy_changed",
            "data": json.dumps({"pool": pool, "by": by, "changes": changes, "policy": asdict(new)}),
        },
        maxlen=engine.settings.event_log_max,
        approximate=True,
    )
    log.info("policy changed pool=%s by=%s: %s", pool, by, changes)
    return new


def window_length(engine: Engine) -> int:
    """Samples kept per GPU. They are the evidence shown with a warning; the verdict itself reads
    busy_at and covered_since, so a pool with a longer idle_timeout still works (its evidence
    shows the newest samples only)."""
    return min(MAX_WINDOW, math.ceil(engine.settings.idle_timeout / engine.settings.sample_interval) + 4)


# ---- samples -------------------------------------------------------------------------------------


async def record_samples(
    engine: Engine,
    node: str,
    pool: str,
    gpus: list[dict[str, Any]],
    threshold: float | None = None,
    now_ms: int | None = None,
) -> tuple[int, int]:
    """Store one sample of ``node``'s GPUs: [{index, util, mem_mb, procs}]. Returns (recorded,
    GPUs in use by processes that are not their holder's: :func:`foreign_pids`)."""
    slots = [f"{node}/{int(g['index'])}" for g in gpus]
    holders, leases, kept_out, sharers = await _holders_and_leases(engine, slots)
    foreign = foreign_pids(node, gpus, holders, leases, sharers, engine.settings.slice_over_pct / 100)
    if threshold is None:
        pols = await policies(engine)
        threshold = pols[pool].idle_threshold if pool in pols else engine.settings.idle_threshold
    call = Samples(
        now_ms,
        engine.settings.event_log_max,
        window_length(engine),
        threshold,
        node,
        int(engine.settings.sample_interval * 3000),  # a longer gap breaks the coverage
        tuple(
            GpuSample(
                int(g["index"]),
                round(float(g.get("util", 0)), 1),
                int(g.get("mem_mb", 0)),
                json.dumps(pids),
            )
            for g, pids in zip(gpus, foreign, strict=True)
        ),
    )
    out = await engine.samples(call)
    await _hold_or_free(engine, node, gpus, holders, kept_out, foreign)
    return out


async def _hold_or_free(
    engine: Engine,
    node: str,
    gpus: list[dict[str, Any]],
    holders: list[str | None],
    kept_out: list[bool],
    foreign: list[list[int]],
) -> None:
    """A free GPU in use by a process no lease covers is held out of the pool (unleased_hold.lua),
    whatever the pool's unleased_action: nobody is granted a GPU someone already uses. One held so
    whose sample shows no process any more is freed (drained.lua: the queue is served)."""
    hold = [
        int(g["index"]) for g, h, out, f in zip(gpus, holders, kept_out, foreign, strict=True) if not (h or out) and f
    ]
    if hold:
        await engine.run(UnleasedHold(node, json.dumps(hold)))
    clean = [int(g["index"]) for g, out in zip(gpus, kept_out, strict=True) if out and not g.get("procs")]
    if clean:
        await engine.run(Drained(node, "", json.dumps(clean), 0))


class Sharers(NamedTuple):
    """A GPU shared by slices (``~slices``): its live slices' lease ids, the processes of its
    draining slices (the drain's business, not unleased use), and the MB its slices are promised
    together (0: not known)."""

    leases: frozenset[str]
    draining: frozenset[int]
    promised_mb: int = 0


async def _holders_and_leases(
    engine: Engine, slots: list[str]
) -> tuple[list[str | None], dict[str, dict[str, Any]], list[bool], list[Sharers | None]]:
    """Who holds each of ``slots`` ("node/index"), those leases' records (a shared GPU's slices'
    included), which are held out of the pool for unleased use (unleased_hold.lua: judged as the
    free GPUs they are), and, for a GPU shared by slices, its :class:`Sharers`."""
    holders = [None if h is None else str(h) for h in await engine.redis.hmget(engine.keys.holders, slots)]
    kept_out = [False] * len(slots)
    marked = [i for i, h in enumerate(holders) if h == "~"]
    if marked:
        raws = await engine.redis.hmget(engine.keys.draining, [slots[i] for i in marked])
        for i, raw in zip(marked, raws, strict=True):
            if raw and json.loads(raw).get("state") == "unleased":
                holders[i], kept_out[i] = None, True
    sharers: list[Sharers | None] = [None] * len(slots)
    shared = [i for i, h in enumerate(holders) if h == "~slices"]
    if shared:
        raws = await engine.redis.hmget(engine.keys.sliced, [slots[i] for i in shared])
        for i, raw in zip(shared, raws, strict=True):
            if raw:
                led = json.loads(raw)
                pids = {int(p) for d in (led.get("draining") or {}).values() for p in d.get("pids") or []}
                promised = int(led.get("used_mb") or 0)
                sharers[i] = Sharers(frozenset(led.get("leases") or {}), frozenset(pids), promised)
    ids = {h for h in holders if h and not h.startswith("~")}  # "~": draining, "~slices": sliced
    ids |= {lid for sh in sharers if sh for lid in sh.leases}
    ordered = sorted(ids)
    raws = await engine.redis.hmget(engine.keys.leases, ordered) if ordered else []
    return holders, {i: json.loads(r) for i, r in zip(ordered, raws, strict=True) if r}, kept_out, sharers


def foreign_pids(
    node: str,
    gpus: list[dict[str, Any]],
    holders: list[str | None],
    leases: dict[str, dict[str, Any]],
    sharers: list[Sharers | None] | None = None,
    slack: float = 0.05,
) -> list[list[int]]:
    """Per GPU of a sample, the processes on it that are not its holder's: unleased use, judged
    per GPU. A process belongs to the lease it claimed on this node (its agent recorded it:
    lease_server/node/claims.py), else to the one lease whose GPUs it is seen on, if there is only
    one (a child of a worker, a command that ``gpulease acquire`` runs) -- unless the agent named
    its owner (``uids``) and the lease's claims on this node name others: a process of another
    user on someone's leased GPU is theirs, not the lease's. It is covered only on the GPUs of
    that lease: on a free GPU, or on a GPU leased to someone else, it is foreign, whatever
    else it runs on (a cell that rewrote CUDA_VISIBLE_DEVICES to reach more GPUs than its lease's).
    A draining GPU ("~") is the drain's business: nothing on it counts here. On a GPU shared by
    slices ("~slices", with its ``sharers``) a process is covered if one of its slices claimed it,
    if it is a draining slice's, or, having claimed nothing, unless the agent named its owner and
    the slices' claims name others, or the GPU's sample uses more memory than its slices are
    promised (by more than ``slack`` of it): its slices are held to theirs by the agent, so what is
    beyond them is a process no slice answers for (without ``sharers``, nothing on it counts)."""
    claimed: dict[int, str] = {}
    claim_uids: dict[str, set[int]] = {}  # the owners of each lease's claims on this node
    for lid, rec in leases.items():
        for p in rec.get("procs") or []:
            if (p.get("node") or rec.get("node")) == node:
                claimed[int(p["pid"])] = lid
                if isinstance(p.get("uid"), int):
                    claim_uids.setdefault(lid, set()).add(int(p["uid"]))
    seen_in: dict[int, set[str]] = {}
    uid_of: dict[int, int] = {}
    for g, holder in zip(gpus, holders, strict=True):
        for pid, uid in zip(g.get("procs", []), g.get("uids") or [], strict=False):
            if uid >= 0:
                uid_of[int(pid)] = int(uid)
        if holder and not holder.startswith("~"):
            for pid in g.get("procs", []):
                seen_in.setdefault(int(pid), set()).add(holder)
    out: list[list[int]] = []
    for i, (g, holder) in enumerate(zip(gpus, holders, strict=True)):
        shared = sharers[i] if sharers is not None and holder == "~slices" else None
        if shared is not None:
            uids = {u for lid in shared.leases for u in claim_uids.get(lid, ())}
            beyond = bool(shared.promised_mb) and int(g.get("mem_mb") or 0) > shared.promised_mb * (1 + slack)
            out.append(
                [
                    pid
                    for pid in (int(p) for p in g.get("procs", []))
                    if claimed.get(pid) not in shared.leases
                    and pid not in shared.draining
                    and (beyond or (uids and pid in uid_of and uid_of[pid] not in uids))
                ]
            )
            continue
        if holder and holder.startswith("~"):
            out.append([])
            continue
        pids = []
        for pid in (int(p) for p in g.get("procs", [])):
            own = claimed.get(pid)
            if own is None and len(seen_in.get(pid, ())) == 1:
                own = next(iter(seen_in[pid]))
                if pid in uid_of and own in claim_uids and uid_of[pid] not in claim_uids[own]:
                    own = None  # another user's process on this lease's GPUs
            if not holder or own != holder:
                pids.append(pid)
        out.append(pids)
    return out


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


# ---- unleased use: what the node agent does about it --------------------------------------------


async def agent_samples(
    engine: Engine,
    node: str,
    pool: str,
    gpus: list[dict[str, Any]],
    killed: list[dict[str, Any]] | None = None,
    pols: dict[str, Policy] | None = None,
) -> dict[str, Any]:
    """A node agent's sample of ``node``'s GPUs, and the unleased processes it signalled since its
    last one (``killed``: events ``unleased_killed``). The answer says what the agent must do now:
    ``{"recorded", "unleased", "unleased_action", "unleased_kill_grace_s", "kill": [{"index", "pids"}]}``;
    ``kill`` names processes only when the pool's ``unleased_action`` is "kill"."""
    if pols is None:
        pols = await policies(engine)
    pol = pols.get(pool)
    if pol is None:  # its policy could not be read (or the pool is brand new): flag, never kill blind
        pol = replace(Policy.from_settings(engine), unleased_action="flag")
    recorded, unleased = await record_samples(engine, node, pool, gpus, pol.idle_threshold)
    if killed:
        await record_kills(engine, node, pool, killed)
    kill = await unleased_to_kill(engine, node, gpus) if unleased and pol.unleased_action == "kill" else []
    return {
        "recorded": recorded,
        "unleased": unleased,
        "unleased_action": pol.unleased_action,
        "unleased_kill_grace_s": pol.unleased_kill_grace_s,
        "kill": kill,
    }


async def unleased_to_kill(engine: Engine, node: str, gpus: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The processes of this sample that are foreign on their GPU (:func:`foreign_pids`): on a GPU no
    live lease holds, or on one leased to another lease than theirs: [{"index", "pids"}].

    Read after samples.lua flagged them: a GPU counts only while it is still flagged, and who
    holds it is read again (a lease granted since to the process's own lease covers it)."""
    slots = [f"{node}/{int(g['index'])}" for g in gpus]
    flagged = await engine.redis.hmget(engine.keys.unleased, slots)
    holders, leases, _, sharers = await _holders_and_leases(engine, slots)
    out = []
    slack = engine.settings.slice_over_pct / 100
    for g, flag, pids in zip(gpus, flagged, foreign_pids(node, gpus, holders, leases, sharers, slack), strict=True):
        if flag and pids:
            out.append({"index": int(g["index"]), "pids": pids})
    return out


async def record_kills(engine: Engine, node: str, pool: str, killed: list[dict[str, Any]]) -> None:
    """One ``unleased_killed`` event per signal a node agent sent (or failed to send)."""
    t = await engine.redis.time()
    ts = t[0] * 1000 + t[1] // 1000
    async with engine.redis.pipeline(transaction=False) as p:
        for k in killed[:1000]:
            data = {
                "node": node,
                "pool": pool,
                "gpu": int(k["index"]),
                "pid": int(k["pid"]),
                "user": str(k.get("user") or ""),
                "signal": str(k["signal"]),
                "ts": ts,
            }
            if "grace_s" in k:
                data["grace_s"] = float(k["grace_s"])
            if k.get("error"):
                data["error"] = str(k["error"])[:200]
            log.warning(
                "unleased process %s: node=%s gpu=%s pid=%s user=%s%s",
                data["signal"],
                node,
                data["gpu"],
                data["pid"],
                data["user"],
                f" failed: {data['error']}" if "error" in data else "",
            )
            p.xadd(
                engine.keys.events,
                {"type": EventType.UNLEASED_KILLED, "data": json.dumps(data)},
                maxlen=engine.settings.event_log_max,
                approximate=True,
            )
        await p.execute()


async def simulated_sample(engine: Engine, node: str, indexes: list[int]) -> list[dict[str, Any]]:
    """What the simulated GPUs of ``node`` report now (set with gpulease simulate util)."""
    raws = await engine.redis.hmget(engine.keys.sim, [f"{node}/{i}" for i in indexes])
    out = []
    for i, raw in zip(indexes, raws, strict=True):
        g = json.loads(raw) if raw else {}
        out.append({"index": i, "util": g.get("util", 0), "mem_mb": g.get("mem_mb", 0), "procs": g.get("procs", [])})
    return out


async def set_simulated(engine: Engine, node: str, gpus: dict[int, dict[str, Any]]) -> None:
    raw = await engine.redis.hget(engine.keys.nodes, node)
    if raw is None:
        raise errors.UnknownNode(f"node {node!r} is not registered")
    inv = json.loads(raw)
    if inv.get("source") != "simulated":
        raise errors.BadRequest(f"node {node!r} reports real GPUs through NVML; only simulated GPUs can be set")
    present = {g["index"] for g in inv["gpus"]}
    missing = sorted(set(gpus) - present)
    if missing:
        raise errors.BadRequest(f"node {node!r} has no GPU {missing}; it has {sorted(present)}")
    await engine.redis.hset(engine.keys.sim, mapping={f"{node}/{i}": json.dumps(v) for i, v in gpus.items()})


# ---- the verdict ---------------------------------------------------------------------------------


def parse_window(raw: list[str]) -> list[tuple[float, float, int]]:
    """Stored "ts_ms,util,mem_mb" entries as (ts seconds, util %, mem MB)."""
    out = []
    for item in raw:
        ts, util, mem = item.split(",")
        out.append((int(ts) / 1000, float(util), int(mem)))
    return out


@dataclass
class GpuState:
    """What the samples say about one GPU, in seconds (None: never seen)."""

    covered_since: float | None  # sampled without a gap since then
    busy_at: float | None  # the newest sample at or above the threshold
    last_at: float | None  # the newest sample
    last_mem_mb: int = 0
    window: list[tuple[float, float, int]] = field(default_factory=list)  # evidence only


def idle_verdict(
    lease: LeaseRecord,
    gpus: dict[int, GpuState],
    policy: Policy,
    now_ms: int,
    sample_interval: float,
) -> tuple[bool, dict[str, Any]]:
    """Is ``lease`` idle now? Returns (idle, evidence). Pure: the tests drive it directly too."""
    now_s = now_ms / 1000
    clock_from = max(lease["created_at"] + policy.min_age * 1000, lease.get("kept_at") or 0) / 1000
    since = now_s - policy.idle_timeout
    evidence: dict[str, Any] = {
        "threshold": policy.idle_threshold,
        "idle_timeout": policy.idle_timeout,
        "activity": lease.get("activity"),
        "gpus": {str(i): [[round(t, 1), u, m] for t, u, m in g.window[-60:]] for i, g in gpus.items()},
    }
    if lease["user"] in policy.exempt_users:
        return False, {**evidence, "why": "exempt"}
    if clock_from > since:
        return False, {**evidence, "why": "too young (min_age or a recent keep)"}
    for idx, g in gpus.items():
        if g.last_at is None or g.last_at < now_s - 3 * sample_interval:
            return False, {**evidence, "why": f"no current sample of GPU {idx}"}
        if g.covered_since is None or g.covered_since > since:
            return False, {**evidence, "why": f"not enough samples for GPU {idx} (sampled since {g.covered_since})"}
        if g.busy_at is not None and g.busy_at >= since:
            return False, {**evidence, "why": f"GPU {idx} was busy at {g.busy_at}"}
    activity = lease.get("activity") or {}
    if activity.get("executing") and any(g.last_mem_mb > 0 for g in gpus.values()):
        return False, {**evidence, "why": "a running cell holds GPU memory"}
    last_busy = max((g.busy_at for g in gpus.values() if g.busy_at is not None), default=None)
    covered = min((g.covered_since for g in gpus.values() if g.covered_since is not None), default=now_s)
    evidence["idle_s"] = round(now_s - max(clock_from, last_busy if last_busy is not None else covered), 1)
    evidence["why"] = "idle"
    return True, evidence


class Reclaimer:
    """Runs in every server process; warnings and reclaims are atomic, so replicas can race."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def tick(self, now_ms: int | None = None) -> tuple[int, int, float]:
        """One pass over live leases: due reclaims first, then warnings.
        Returns (warned, reclaimed, seconds until the next due reclaim)."""
        engine = self.engine
        if now_ms is None:
            t = await engine.redis.time()
            now_ms = t[0] * 1000 + t[1] // 1000
        pols = await policies(engine)
        off = Policy(enabled=False)
        # Multi-node gangs are not judged idle (their GPUs share indexes across nodes): left out.
        # Read a slice at a time, and the loop let go between slices below too: a pass over
        # thousands of leases must not hold up the requests this process serves meanwhile.
        leases = [
            lease
            for lease in await live_leases_sliced(engine)
            if pols.get(lease["pool"], off).enabled and not lease.get("nodes")
        ]
        warned = reclaimed = 0
        next_due = math.inf

        def is_due(lease: LeaseRecord) -> bool:
            return bool(lease.get("reclaim_at")) and lease["reclaim_at"] <= now_ms

        # One round trip for the sample summary of every leased GPU.
        states = await self._states([f"{lease['node']}/{g['index']}" for lease in leases for g in lease["gpus"]])
        for lease in filter(is_due, leases):
            pol = pols[lease["pool"]]
            if self._busy_since(lease, states, lease["warned_at"]):
                await self._clear(lease, pol)
            elif await self.engine.run(
                Reclaim(lease["id"], str(lease["token"]), json.dumps(await self._evidence(lease, pol, now_ms)))
            ):
                log.info("reclaimed %s user=%s pool=%s", lease["id"], lease["user"], lease["pool"])
                reclaimed += 1
        for i, lease in enumerate(leases):
            if i and i % SLICE == 0:
                await asyncio.sleep(0)
            if is_due(lease):
                continue
            pol = pols[lease["pool"]]
            if lease.get("reclaim_at"):
                if self._busy_since(lease, states, lease["warned_at"]):
                    await self._clear(lease, pol)  # used again during the grace: the warning lapses
                else:
                    next_due = min(next_due, (lease["reclaim_at"] - now_ms) / 1000)
                continue
            if self._busy_since(lease, states, now_ms - pol.idle_timeout * 1000):
                continue  # the cheap check first: some GPU was busy inside the window
            gpus = {int(g["index"]): states[f"{lease['node']}/{g['index']}"] for g in lease["gpus"]}
            idle, _ = idle_verdict(lease, gpus, pol, now_ms, engine.settings.sample_interval)
            if not idle:
                continue
            await self._fill_windows(lease, gpus)
            _, evidence = idle_verdict(lease, gpus, pol, now_ms, engine.settings.sample_interval)
            warn = IdleWarn(lease["id"], str(lease["token"]), int(pol.grace * 1000), json.dumps(evidence))
            if await self.engine.run(warn):
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

    async def _states(self, slots: list[str]) -> dict[str, GpuState]:
        if not slots:
            return {}
        k = self.engine.keys
        out = {}
        for at in range(0, len(slots), 5 * SLICE):  # a slice at a time, the loop let go between
            if at:
                await asyncio.sleep(0)
            part = slots[at : at + 5 * SLICE]
            async with self.engine.redis.pipeline(transaction=False) as p:
                p.hmget(k.covered_since, part)
                p.hmget(k.busy_at, part)
                p.hmget(k.last, part)
                covered, busy, last = await p.execute()
            for slot, c, b, newest in zip(part, covered, busy, last, strict=True):
                last_at, mem = None, 0
                if newest:
                    ts, _util, m = newest.split(",")
                    last_at, mem = int(ts) / 1000, int(m)
                out[slot] = GpuState(int(c) / 1000 if c else None, int(b) / 1000 if b else None, last_at, mem)
        return out

    @staticmethod
    def _busy_since(lease: LeaseRecord, states: dict[str, GpuState], since_ms: float) -> bool:
        for g in lease["gpus"]:
            st = states.get(f"{lease['node']}/{g['index']}")
            if st is not None and st.busy_at is not None and st.busy_at * 1000 >= since_ms:
                return True
        return False

    async def _clear(self, lease: LeaseRecord, pol: Policy) -> None:
        kept = await self.engine.run(Keep(lease["id"], lease["user"], True, pol.max_extensions, auto=True))
        # Cleared now (not kept by its owner first: that counts an extension).
        if kept.get("kept_at") != lease.get("kept_at") and kept.get("extensions") == lease.get("extensions"):
            log.info(
                "idle cleared %s user=%s pool=%s: its GPUs are busy again", lease["id"], lease["user"], lease["pool"]
            )

    async def _fill_windows(self, lease: LeaseRecord, gpus: dict[int, GpuState]) -> None:
        k = self.engine.keys
        async with self.engine.redis.pipeline(transaction=False) as p:
            for idx in gpus:
                p.lrange(k.samples(f"{lease['node']}/{idx}"), -60, -1)
            raws = await p.execute()
        for st, raw in zip(gpus.values(), raws, strict=True):
            st.window = parse_window(raw)

    async def _evidence(self, lease: LeaseRecord, pol: Policy, now_ms: int) -> dict[str, Any]:
        """The warning's evidence, brought up to now: the samples since, and how long idle."""
        evidence = dict(lease.get("idle_evidence") or {})
        gpus = {int(g["index"]): GpuState(None, None, None) for g in lease["gpus"]}
        await self._fill_windows(lease, gpus)
        windows = {i: g.window for i, g in gpus.items()}
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

    async def run_forever(self, stop: asyncio.Event) -> None:
        interval = self.engine.settings.sample_interval
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


async def keep(engine: Engine, lease_id: str, user: str, admin: bool) -> LeaseRecord:
    """ "I'm still using it": reset the idle clock (limited per lease)."""
    rec = await read_lease(engine, lease_id)
    pol = (await policies(engine)).get(rec["pool"], Policy.from_settings(engine))
    kept = await engine.run(Keep(lease_id, user, admin, pol.max_extensions))
    log.info(
        "idle kept %s user=%s by=%s extensions=%s/%s",
        lease_id,
        kept.get("user"),
        user,
        kept.get("extensions"),
        pol.max_extensions,
    )
    return kept
