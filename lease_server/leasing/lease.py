"""Leases: acquire, renew, release, revoke and expire GPUs, atomically, in Redis.

:class:`LeaseStore` is the only code that changes lease state; every change is one Lua script
(see ``lua/``), timed by Redis ``TIME`` so that no client clock matters. The HTTP API, the CLI's
admin commands and the benchmarks all go through it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

from redis.asyncio import Redis

from .. import errors
from ..config import Settings
from ..protocol import (  # the lease states: protocol owns them; importable from here too
    PRIORITIES,
    EndCause,
    EndCauseJson,
    GpuJson,
    LeaseJson,
    LeaseState,
)
from ..request import AcquireRequest
from ..store.engine import Engine
from ..store.keys import Keys
from ..store.scripts import (
    Acquire,
    CancelWait,
    Duplicate,
    Ended,
    Granted,
    Handed,
    Handoff,
    LeaseRecord,
    Queued,
    Release,
    Removed,
    Renew,
    Resize,
    Suspend,
    Sweep,
    SweepCounts,
    Warm,
    lease_record,
    no_such_lease,
)
from .inventory import pool_sizes
from .queue import GrantNotifier
from .values import check_gpus, check_seconds, check_text, check_token

log = logging.getLogger(__name__)


# A waiter whose own deadline passed this long ago has lost its server (killed mid-wait).
WAITER_GRACE_MS = 5000


def new_lease_id() -> str:
    return "l-" + secrets.token_hex(8)


def _public_gpu(g: GpuJson) -> GpuJson:
    out = GpuJson(index=int(g["index"]), uuid=g.get("uuid", ""))
    if "node" in g:
        out["node"] = g["node"]
    return out


def public_lease(rec: LeaseRecord, *, with_token: bool, detail: bool = False) -> LeaseJson:
    """The API's view of a lease record (:class:`protocol.LeaseJson`): times in epoch seconds, the
    token only for its owner."""
    out: LeaseJson = {
        "id": rec["id"],
        "user": rec["user"],
        "pool": rec["pool"],
        "node": rec["node"],
        "gpus": [_public_gpu(g) for g in rec["gpus"]],
        "state": LeaseState(rec.get("state", LeaseState.ACTIVE.value)),
        "label": rec.get("label", ""),
        "session": rec.get("session", ""),
        "ttl": rec["ttl_ms"] / 1000,
        "created_at": rec["created_at"] / 1000,
        "renewed_at": rec.get("renewed_at", rec["created_at"]) / 1000,
        "expires_at": rec["expires_at"] / 1000,
        "renewals": int(rec.get("renewals", 0)),
        "waited": rec.get("waited_ms", 0) / 1000,
    }
    if rec.get("reclaim_at"):
        out["warned_at"] = rec["warned_at"] / 1000
        out["reclaim_at"] = rec["reclaim_at"] / 1000
    if rec.get("extensions"):
        out["extensions"] = int(rec["extensions"])
    if rec.get("activity"):
        out["activity"] = rec["activity"]
    if detail and rec.get("idle_evidence"):
        out["idle_evidence"] = rec["idle_evidence"]
    if rec.get("resv"):  # the booking it is served from (both names kept: stored data, wire field)
        out["reservation"] = rec["resv"]
    if rec.get("nodes"):
        out["nodes"] = rec["nodes"]
    for key in ("notebook", "cell"):
        if rec.get(key):
            out[key] = rec[key]
    if rec.get("preemptible"):
        out["preemptible"] = True
    if rec.get("elastic"):
        out["elastic"] = rec["elastic"]
    if "priority" in rec:
        out["priority"] = next((k for k, v in PRIORITIES.items() if v == rec["priority"]), str(rec["priority"]))
    if rec.get("borrowed"):
        out["borrowed"] = True
    if rec.get("recall_at"):
        out["recall_at"] = rec["recall_at"] / 1000
        out["recall_reason"] = rec.get("recall_reason", "")
        if rec.get("recall_code"):
            out["recall_cause"] = EndCauseJson(
                code=EndCause(rec["recall_code"]), by="server", why=rec.get("recall_why", "")
            )
        if rec.get("recall_for"):  # whom its GPUs go to (a warm lease lent out: its notebook names them)
            out["recall_for"] = rec["recall_for"]
            out["recalled_at"] = rec["recalled_at"] / 1000
    if rec.get("ends_by"):  # its holder means to end it by then (a cell's --timeout): estimates count on it
        out["ends_by"] = rec["ends_by"] / 1000
    if rec.get("gpu_mem_mb"):
        # a slice: that much of its one GPU's memory (rounded up to the pool's unit), of gpu_total_mb
        out["gpu_mem_mb"] = int(rec["gpu_mem_mb"])
        out["gpu_total_mb"] = int(rec.get("gpu_total_mb", 0))
    if rec.get("warm_since"):
        # kept for its notebook's next cell: lent out if someone waits, ended at warm_until
        out["warm_since"] = rec["warm_since"] / 1000
        out["warm_until"] = rec["warm_until"] / 1000
    if rec.get("warm_ms"):
        out["warm_gpu_s"] = rec["warm_ms"] / 1000
    if rec.get("shrink_to") and "ended_at" not in rec:
        # asked to give GPUs back for a waiting request: the server shrinks it to shrink_to at shrink_by
        out["shrink_to"] = int(rec["shrink_to"])
        out["shrink_by"] = rec["shrink_by"] / 1000
        out["shrink_reason"] = rec.get("shrink_reason", "")
    if "ended_at" in rec:
        out["ended_at"] = rec["ended_at"] / 1000
        out["end_reason"] = rec.get("end_reason", "")
        out["ended_by"] = rec.get("ended_by", "")
        if rec.get("cause"):
            out["cause"] = rec["cause"]
        if rec.get("mem_peak_mb") is not None:
            out["mem_peak_mb"] = int(rec["mem_peak_mb"])
        if rec.get("over_memory"):
            out["over_memory"] = dict(rec["over_memory"])
    if with_token:
        out["token"] = int(rec["token"])
    return out


# The state a queued request reports once DELETE withdrew it (it never became a lease).
WITHDRAWN = "withdrawn"


def public_withdrawal(w: dict[str, Any]) -> dict[str, Any]:
    """The API's view of a withdrawn request: what it asked for, where it stood, who withdrew it."""
    return {
        "id": w["id"],
        "user": w["user"],
        "pool": w["pool"],
        "gpus": w["gpus"],
        "state": WITHDRAWN,
        "label": w.get("label", ""),
        "session": w.get("session", ""),
        "position": w["position"],
        "enqueued_at": w["enqueued_at"] / 1000,
        "end_reason": w.get("reason", ""),
        "ended_by": w.get("by", ""),
    }


async def read_lease(engine: Engine, lease_id: str) -> LeaseRecord:
    """A live or recently ended lease record."""
    raw: Any = await engine.redis.hget(engine.keys.leases, lease_id)
    if raw is None:
        raw = await engine.redis.hget(engine.keys.ended, lease_id)
    if raw is None:
        raise no_such_lease(lease_id)
    return lease_record(raw)


async def live_leases(engine: Engine) -> list[LeaseRecord]:
    return [lease_record(v) for v in await engine.redis.hvals(engine.keys.leases)]


LEASE_SLICE = 200  # leases read and decoded between two returns to the event loop


async def live_leases_sliced(engine: Engine) -> list[LeaseRecord]:
    """Every live lease, for a background loop: decoded a slice at a time with the event loop let go
    between slices. At 10,000 GPUs (6,500 leases) decoding them all at once held a server's loop
    ~100 ms, and every request in flight waited behind it. (One HVALS still reads them: the ACL
    user of docs/deploy.md may run HVALS, not HSCAN.)"""
    raws: Any = await engine.redis.hvals(engine.keys.leases)
    out: list[LeaseRecord] = []
    for at in range(0, len(raws), LEASE_SLICE):
        if at:
            await asyncio.sleep(0)
        out.extend(lease_record(raw) for raw in raws[at : at + LEASE_SLICE])
    return out


class LeaseStore:
    """Lease state in Redis. One instance per server process; safe to share between coroutines."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.redis: Redis = engine.redis
        self.settings: Settings = engine.settings
        self.keys: Keys = engine.keys
        self.notifier = GrantNotifier(engine.redis, self.keys.grants)
        self._default_pool: tuple[float, str] | None = None

    async def start(self) -> None:
        await self.publish_scheduling()
        await self.notifier.start()

    async def publish_scheduling(self) -> None:
        """Write the configured scheduling of every pool where dispatch (Lua) reads it."""
        s = self.settings
        tables: dict[Any, Any] = {pool: json.dumps(s.sched_table(pool)) for pool in ["*", *s.scheduling]}
        await self.redis.hset(self.keys.sched, mapping=tables)

    async def close(self) -> None:
        await self.notifier.stop()

    # ---- pools -------------------------------------------------------------------------------

    async def pool_sizes(self) -> dict[str, dict[str, int]]:
        return await pool_sizes(self.engine)

    async def default_pool(self) -> str:
        """The configured default pool, else the pool with the most GPUs (cached for 5 s)."""
        if self.settings.default_pool:
            return self.settings.default_pool
        cached = self._default_pool
        if cached and cached[0] > time.monotonic():
            return cached[1]
        pools = await self.pool_sizes()
        if not pools:
            raise errors.UnknownPool(
                "no GPU node is registered yet: start a node agent "
                "(gpulease agent, or gpulease up --simulate 1xA100-80GB)"
            )
        gpu_pools = [p for p in pools if p != self.settings.cpu_pool]
        if not gpu_pools:
            raise errors.UnknownPool(
                f"only CPU slots (pool {self.settings.cpu_pool}) are registered: start a node agent on a GPU node"
            )
        name = sorted(gpu_pools, key=lambda p: (-pools[p]["gpus"], p))[0]
        self._default_pool = (time.monotonic() + 5.0, name)
        return name

    # ---- leases ------------------------------------------------------------------------------

    async def acquire(
        self,
        user: str,
        request: AcquireRequest,
        *,
        on_queued: Callable[[int], Awaitable[None] | None] | None = None,
        teams: tuple[str, ...] | list[str] = (),
    ) -> LeaseRecord:
        """Grant ``request.gpus`` GPUs on one node of its pool, waiting up to ``request.wait``
        seconds in its queue. ``request.id`` becomes the lease id (default: a fresh one).

        The request is held to its declaration (``AcquireRequest``) and this server's settings
        (max_ttl, max_wait) before anything changes: a request built in Python meets the rules an
        HTTP one does.

        Returns the lease record. Raises :class:`errors.NoCapacity` when nothing was free in time,
        :class:`errors.Unsatisfiable` when no node of the pool is big enough, and
        :class:`errors.BadRequest` for a request its declaration refuses.
        """
        s = self.settings
        request.check(s)
        n, n_min, prio = request.gpus, request.least, PRIORITIES[request.priority]
        ttl_s = s.default_ttl if request.ttl is None else request.ttl
        wait_s = request.wait
        # Taken before the waiter's own deadline is set in Redis (by the script below), so that a
        # waiter gone at this deadline + WAITER_GRACE_MS can only have been swept, not withdrawn.
        deadline = time.monotonic() + wait_s
        pool_s = request.pool if request.pool is not None else await self.default_pool()
        lid = request.id or new_lease_id()
        waiter = self.notifier.expect(lid) if wait_s > 0 else None
        try:
            call = Acquire(
                lid,
                user,
                pool_s,
                n,
                int(ttl_s * 1000),
                int(wait_s * 1000),
                teams=",".join(teams),
                priority=prio,
                gpus_min=n_min,
                nodes=request.nodes,
                max_queued=s.max_queued_per_user,
                gpu_mem_mb=request.gpu_mem_mb or 0,
                prefer_node=request.prefer_node or "",
                ends_within_ms=int(request.ends_within * 1000) if request.ends_within else 0,
                **{name: getattr(request, name) for name in Acquire.TEXT},
            )
            try:
                got = await self.engine.run(call)
            except errors.UnknownPool:
                known = ", ".join(sorted(await self.pool_sizes())) or "none registered"
                raise errors.UnknownPool(f"unknown pool {pool_s!r}; known pools: {known}", pool=pool_s) from None
            if isinstance(got, Granted):
                rec = got.lease
                log.info(
                    "grant %s user=%s pool=%s node=%s gpus=%s",
                    lid,
                    user,
                    pool_s,
                    rec["node"],
                    [g["index"] for g in rec["gpus"]],
                )
                return rec
            if isinstance(got, Duplicate):
                # A retried request (same id, same user) whose grant already happened: return it,
                # so a client may safely resend a POST whose answer it lost.
                raw = await self.redis.hget(self.keys.leases, lid)
                if raw and (dup := lease_record(raw))["user"] == user:
                    return dup
                raise errors.Conflict(f"request id {lid!r} is already in use; send a new id, or none")
            assert isinstance(got, Queued) and waiter is not None
            position = got.position
            log.info("queued %s user=%s pool=%s gpus=%d position=%d", lid, user, pool_s, n, position)
            if on_queued is not None:
                maybe = on_queued(position)
                if maybe is not None:
                    await maybe
            return await self._wait_for_grant(user, lid, pool_s, n, wait_s, waiter, deadline)
        finally:
            if waiter is not None:
                self.notifier.forget(lid, waiter)

    async def _wait_for_grant(
        self, user: str, lid: str, pool: str, n: int, wait_s: float, waiter: asyncio.Event, deadline: float
    ) -> LeaseRecord:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                # The grant (or a withdrawal) is published on the grants channel; the periodic
                # check below is only a safety net for a pub/sub connection that dropped the message.
                await asyncio.wait_for(waiter.wait(), timeout=min(remaining, 5.0))
            except TimeoutError:
                pass
            waiter.clear()
            rec = await self._settled_in_time(lid, pool, n, wait_s, deadline)
            if rec is not None:
                log.info(
                    "grant %s user=%s pool=%s node=%s gpus=%s from the queue after %.1fs",
                    lid,
                    user,
                    pool,
                    rec["node"],
                    [g["index"] for g in rec["gpus"]],
                    rec.get("waited_ms", 0) / 1000,
                )
                return rec
        try:
            return await self.cancel_wait(user, lid, pool, n, wait_s, reason="timeout")
        except errors.NoSuchLease:
            # Withdrawn, swept, or granted and ended, just as the wait ran out: say which.
            rec = await self._settled_in_time(lid, pool, n, wait_s, deadline)
            if rec is not None:
                return rec
            raise

    async def _settled_in_time(self, lid: str, pool: str, n: int, wait_s: float, deadline: float) -> LeaseRecord | None:
        """:meth:`_settled`, except that a request gone from the queue without a grant after its
        own deadline timed out: the sweeper removes a waiter WAITER_GRACE_MS past its deadline (its
        server presumed dead), and a server whose loop was starved that long is only late, so its
        caller hears what it would have heard on time (no GPU within the wait), not of a DELETE
        that nobody sent."""
        try:
            return await self._settled(lid)
        except errors.Withdrawn:
            if time.monotonic() < deadline:
                raise
            log.info("wait %s timed out and was swept before its server saw the deadline", lid)
            raise errors.NoCapacity(
                f"{n} GPU{' was' if n == 1 else 's were'} not free in pool {pool!r} within {wait_s:g}s; "
                "pass a longer wait (seconds) or ask for fewer GPUs",
                pool=pool,
                gpus=n,
                wait_s=wait_s,
            ) from None

    async def _settled(self, lid: str) -> LeaseRecord | None:
        """What became of a queued request: its lease once granted, None while it still waits.

        Raises :class:`errors.Withdrawn` when it left the queue without a grant, and
        :class:`errors.LeaseEnded` when it was granted and already ended (released by its owner
        before this request saw the grant). The three keys are read in one MULTI: read one by one,
        a grant landing between the reads would look like a withdrawal.
        """
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hget(self.keys.leases, lid)
            pipe.hget(self.keys.waiters, lid)  # not HEXISTS: redis-py's cluster MULTI cannot decode it
            pipe.hget(self.keys.ended, lid)
            raw, queued, ended = await pipe.execute()
        if raw:
            return lease_record(raw)
        if queued:
            return None
        if ended:
            e = json.loads(ended)
            raise errors.LeaseEnded(
                f"request {lid} was granted and then {e['state']} ({e.get('end_reason', '')}) before this "
                "request saw the grant; send a new request",
                state=e["state"],
            )
        log.info("wait %s withdrawn", lid)
        raise errors.Withdrawn(
            f"request {lid} was withdrawn from the queue (DELETE /api/v1/leases/{lid}) before any GPU was "
            "granted to it; it will never be granted: send a new request to queue again",
            id=lid,
        )

    async def cancel_wait(
        self, user: str, lid: str, pool: str = "", n: int = 0, wait_s: float = 0.0, *, reason: str = "cancelled"
    ) -> LeaseRecord:
        """Leave the queue. A grant that raced ahead is returned (the caller now holds it).
        Only the request's own user may cancel it."""
        got = await self.engine.run(CancelWait(lid, reason, user))
        if isinstance(got, Granted):
            return got.lease
        assert isinstance(got, Removed)
        log.info("wait %s %s after %.1fs", lid, reason, wait_s)
        raise errors.NoCapacity(
            f"{n} GPU{' was' if n == 1 else 's were'} not free in pool {pool!r} within {wait_s:g}s "
            f"(position {got.position} in the queue); pass a longer wait (seconds) or ask for fewer GPUs",
            pool=pool,
            position=got.position,
            gpus=n,
            wait_s=wait_s,
        )

    async def renew(
        self,
        lease_id: str,
        token: object,
        user: str,
        *,
        admin: bool = False,
        ttl: object = None,
        activity: object = None,
    ) -> LeaseRecord:
        """Extend a live lease by ``ttl`` seconds from now (default: its own ttl).

        ``activity`` ({"executing": bool}) is what the holder is doing: a signal of the idle score.
        """
        tok = self._token(token, required=True)
        # 0 = the lease's own ttl (decided in the script: one round trip per renewal)
        ttl_s = check_seconds("ttl", ttl, low=1, high=self.settings.max_ttl, default=0.0)
        act = ""
        if activity is not None:
            if (
                not isinstance(activity, dict)
                or not isinstance(activity.get("executing", False), bool)
                or any(k not in ("executing", "source") for k in activity)
            ):
                raise errors.BadRequest('activity must be {"executing": true|false, "source"?: "..."}')
            act = json.dumps(
                {"executing": bool(activity.get("executing")), "source": str(activity.get("source", ""))[:40]}
            )
        rec = await self.engine.run(Renew(lease_id, tok, user, admin, int(ttl_s * 1000), act))
        return rec

    async def release(
        self,
        lease_id: str,
        user: str,
        *,
        admin: bool = False,
        token: object = None,
        revoke: bool | None = False,
        reason: str = "",
        verified: bool = False,
    ) -> tuple[LeaseRecord | dict[str, Any], bool]:
        """End a lease. Returns (record, changed): releasing an ended lease changes nothing.

        ``revoke=None`` decides in the script: an admin ending another user's lease revokes it
        (with ``reason``), anyone ending their own releases it. One round trip either way.

        A request still queued under ``lease_id`` is withdrawn instead (owner or admin): it leaves
        the queue, its blocked POST is woken with :class:`errors.Withdrawn`, and the record
        returned is the waiter's, with state ``"withdrawn"`` (see :func:`public_withdrawal`).

        ``verified``: the caller saw every process the lease named gone; without it the GPUs on
        which it named one drain (lease_server/node/drain.py) before they are free.
        """
        tok = self._token(token, required=False)
        if revoke and not admin:
            raise errors.Forbidden("only an admin can revoke another user's lease")
        why = check_text("reason", reason)
        if revoke is None:
            state, because, if_revoked = "auto", why or "released by its owner", why or f"revoked by admin {user}"
        elif revoke:
            state, because, if_revoked = LeaseState.REVOKED.value, why or f"revoked by admin {user}", ""
        else:
            state, because, if_revoked = LeaseState.RELEASED.value, why or "released by its owner", ""
        got = await self.engine.run(Release(lease_id, tok, user, admin, state, because, if_revoked, why, verified))
        if isinstance(got, Ended):
            if got.changed:
                log.info("%s %s user=%s by=%s", got.record["state"], lease_id, got.record["user"], user)
            return got.record, got.changed
        assert isinstance(got, Removed) and got.waiter is not None
        w = got.waiter
        log.info("withdrawn %s user=%s by=%s position=%s", lease_id, w["user"], user, got.position)
        return {**w, "state": WITHDRAWN, "position": got.position}, True

    async def handoff(self, lease_id: str, user: str, token: object, to: list[str]) -> Handed:
        """End the owner's lease ``lease_id`` and grant its GPUs, in the same step, to the pool's
        oldest waiter, which must be one of the owner's requests ``to``, so that the process on them
        can serve that request too (a sweep's next trial). Refused with 409, changing nothing,
        unless releasing could not have given the GPUs to anyone else (see ``lua/handoff.lua``).
        The request's blocked POST gets the new lease."""
        tok = self._token(token, required=True)
        got: Handed = await self.engine.run(Handoff(lease_id, tok, user, ",".join(to)))
        log.info("handed %s -> %s user=%s", lease_id, got.lease["id"], user)
        return got

    async def resize(
        self, lease_id: str, user: str, token: object, gpus: object, size: object = None, *, grow: bool
    ) -> LeaseRecord:
        """Grow (``grow``) or shrink the owner's lease by ``gpus`` GPUs, on its node. A grow adds
        the lowest free indexes, all or none, up to the elastic maximum it asked for; refused with
        409, changing nothing, when that would delay anyone (someone waits in the pool, a booking
        is in force) or the node lacks them. A shrink gives back the highest indexes (at least one
        stays: to give back all, release) and serves the queue at once. See ``lua/resize.lua``.
        Returns the lease; its token stays."""
        tok = self._token(token, required=True)
        n = check_gpus(gpus)
        seen = None if size is None else check_gpus(size, "size")
        rec: LeaseRecord = await self.engine.run(Resize(lease_id, tok, user, n if grow else -n, seen))
        log.info("%s %s user=%s by %d to %d GPU(s)", "grown" if grow else "shrunk", lease_id, user, n, len(rec["gpus"]))
        return rec

    async def warm(self, lease_id: str, user: str, token: object, on: bool) -> LeaseRecord:
        """Keep the owner's one-node lease warm between cells (``on``): lendable, evicted for
        anyone who would otherwise wait, ended warm_max after; or run a cell on it again (not
        ``on``), refused with 409 once it is being evicted. See ``lua/warm.lua``."""
        tok = self._token(token, required=True)
        rec: LeaseRecord = await self.engine.run(Warm(lease_id, tok, user, bool(on)))
        log.info("%s %s user=%s", "warm" if on else "resumed", lease_id, user)
        return rec

    async def suspend(self, lease_id: str, user: str, token: object) -> LeaseRecord:
        """End the owner's warm one-GPU lease with its worker suspended off the GPU, not ended: its
        GPU drains as a suspend (the node agent suspends the one process that claimed it, then the
        GPU is free), and the worker waits in host memory for its notebook's next cell. Refused
        (409) where the node cannot suspend: release instead. See ``lua/suspend.lua``."""
        tok = self._token(token, required=True)
        rec: LeaseRecord = await self.engine.run(Suspend(lease_id, tok, user))
        log.info("suspending %s user=%s", lease_id, user)
        return rec

    _token = staticmethod(check_token)

    async def get(self, lease_id: str) -> LeaseRecord:
        """A live or recently ended lease record."""
        return await read_lease(self.engine, lease_id)

    async def live_leases(self) -> list[LeaseRecord]:
        return await live_leases(self.engine)

    async def sweep(self, limit: int = 500, now_ms: int | None = None) -> SweepCounts:
        """Expire, mark down, drop abandoned waiters, trim, revoke recalled borrowed leases, release
        no-show bookings; repeat while a batch was full. Returns what was done, summed."""
        totals = SweepCounts()
        while True:
            counts: SweepCounts = await self.engine.run(Sweep(limit, WAITER_GRACE_MS), now_ms)
            totals = totals.plus(counts)
            if max(counts) < limit:
                return totals
