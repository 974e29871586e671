"""The usage ledger and the time-to-GPU estimate.

Every lease that ends writes one ledger entry (``end_lease`` in ``lua/_lib_end.lua``): user, teams,
notebook (the lease's session), cell (its label), pool, GPUs (its final count), seconds held and
waited, GPU-seconds held (``gpu_s``: at each size, for an elastic lease that grew or shrank), mean
utilization and peak memory from the agent's samples, and the GPU-seconds fair share charged.
:func:`report` sums it per user, team or pool over a period; :func:`estimate` uses it, with the
queue, the running leases and the bookings in force, to say how long a request would wait.
:func:`summary` answers the usage page and ``gpulease report`` from the hourly rollups that the
same script keeps beside the ledger (``store/rollup.py``), never from the ledger lines themselves.
"""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

from .. import errors
from ..sizes import ordinal, show_wait
from ..store import rollup
from ..store.engine import Engine
from ..store.scripts import Fold
from .board import cluster_view
from .bookings import Bookings

GROUPS = ("user", "team", "pool", "notebook")
SUMMARY_GROUPS = ("user", "team", "pool")
DEFAULT_TYPICAL_S = 600.0
MAX_SUMMARY_DAYS = rollup.KEEP_DAYS  # the longest range a summary covers: what the rollups keep
NO_TEAM = "(no team)"


LEDGER_SLICE = 1000  # ledger lines read (and decoded) between two returns to the event loop


async def ledger(engine: Engine, lo_ms: int, hi_ms: int, limit: int = 200_000) -> list[dict[str, Any]]:
    """Ledger entries of leases that ended in [lo, hi), oldest first."""
    rows: Any = await engine.redis.xrange(engine.keys.ledger, f"{lo_ms}-0", f"{max(lo_ms, hi_ms - 1)}", count=limit)
    return [json.loads(fields["data"]) for _id, fields in rows]


def _gpu_s(entry: dict[str, Any]) -> float:
    """GPU-seconds an entry held: at each size it had (an elastic lease grows and shrinks; ``gpus``
    is its final count), or, in entries written before leases could change size, held x GPUs."""
    return float(entry.get("gpu_s", entry["held_s"] * entry["gpus"]))


class Summary:
    """Per ``by`` (user, team, pool or notebook), added up one ledger line at a time: calls,
    GPU-hours held and charged, utilization (GPU-time weighted, over the leases the agent sampled),
    peak memory, median wait, revoked calls. Only the waits are kept per line (for the median)."""

    def __init__(self, by: str = "user") -> None:
        self.by = by
        self.calls = 0
        self._groups: dict[str, dict[str, Any]] = {}

    def _keys(self, e: dict[str, Any]) -> list[str]:
        if self.by == "team":
            return [t for t in (e.get("teams") or "").split(",") if t] or ["(no team)"]
        if self.by == "notebook":
            return [e.get("notebook") or e.get("session") or "(none)"]
        return [e[self.by]]

    def add(self, e: dict[str, Any]) -> None:
        self.calls += 1
        gpu_s = _gpu_s(e)
        for key in self._keys(e):
            g = self._groups.get(key)
            if g is None:
                g = self._groups[key] = {
                    "calls": 0, "gpu_s": 0.0, "charged_s": 0.0, "sampled_s": 0.0, "util_s": 0.0,
                    "peak": None, "waits": [], "revoked": 0,
                }  # fmt: skip
            g["calls"] += 1
            g["gpu_s"] += gpu_s
            g["charged_s"] += e.get("charged_gpu_s", 0)
            if e.get("util_mean") is not None:
                g["sampled_s"] += gpu_s
                g["util_s"] += e["util_mean"] * gpu_s
            if e.get("mem_peak_mb") is not None:
                g["peak"] = e["mem_peak_mb"] if g["peak"] is None else max(g["peak"], e["mem_peak_mb"])
            g["waits"].append(e.get("waited_s", 0))
            g["revoked"] += e.get("state") == "revoked"

    def rows(self) -> list[dict[str, Any]]:
        out = []
        for key, g in self._groups.items():
            util = g["util_s"] / g["sampled_s"] if g["sampled_s"] else None
            out.append(
                {
                    self.by: key,
                    "calls": g["calls"],
                    "gpu_hours": round(g["gpu_s"] / 3600, 4),
                    "charged_gpu_hours": round(g["charged_s"] / 3600, 4),
                    "util_mean": None if util is None else round(util, 1),
                    "mem_peak_mb": g["peak"],
                    "wait_p50_s": round(statistics.median(g["waits"]), 3),
                    "revoked": g["revoked"],
                }
            )
        out.sort(key=lambda row: -row["gpu_hours"])
        return out


def summarize(entries: list[dict[str, Any]], by: str = "user") -> list[dict[str, Any]]:
    """:class:`Summary` of ``entries``."""
    acc = Summary(by)
    for e in entries:
        acc.add(e)
    return acc.rows()


async def summarize_ledger(
    engine: Engine,
    lo_ms: int,
    hi_ms: int,
    by: str = "user",
    pool: str | None = None,
    on_page: Callable[[int], Awaitable[None]] | None = None,
    user: str | None = None,
) -> Summary:
    """:class:`Summary` of the ledger lines of leases that ended in [lo, hi) (of ``pool`` only, and
    of ``user``'s leases only, if given), read ``LEDGER_SLICE`` at a time: the event loop serves
    others between two reads, and no more than one slice is held at once, however long the range.
    ``on_page(n)`` is awaited after each read of ``n`` lines (the API counts them against the
    token's read budget)."""
    acc = Summary(by)
    start, end = f"{lo_ms}-0", f"{max(lo_ms, hi_ms - 1)}"
    while True:
        rows: Any = await engine.redis.xrange(engine.keys.ledger, start, end, count=LEDGER_SLICE)
        if on_page is not None:
            await on_page(len(rows))
        for _id, fields in rows:
            e = json.loads(fields["data"])
            if (pool is None or e["pool"] == pool) and (user is None or e["user"] == user):
                acc.add(e)
        if len(rows) < LEDGER_SLICE:
            return acc
        start = f"({rows[-1][0]}"


async def typical_duration(engine: Engine, pool: str, sample: int = 200) -> float:
    """Median seconds held of the pool's last ``sample`` ended leases (600 s with no history)."""
    rows: Any = await engine.redis.xrevrange(engine.keys.ledger, count=sample * 4)
    held = [d["held_s"] for d in (json.loads(f["data"]) for _id, f in rows) if d["pool"] == pool][:sample]
    return float(statistics.median(held)) if held else DEFAULT_TYPICAL_S


def _expect_end(since_s: float, firm: list[float], now_s: float, typical: float) -> tuple[float, float | None]:
    """When a running lease (or slice) is expected to end, in seconds from now, and its fixed end
    when it has one. A lease younger than typical ends when typical; an older one has shown it runs
    long, so expect half its age again (never less than a second). A lease with a known end (a
    recall, an eviction, an idle warning, its holder's declared end, a deadline it is not renewed
    past) ends by then at the latest, whatever its age says."""
    age = now_s - since_s
    expect = max(typical - age, age / 2, 1.0)
    if not firm:
        return expect, None
    end_in = max(0.0, min(firm) - now_s)
    return min(expect, max(end_in, 1.0)), end_in


# What ends a lease at a known time, as the estimate's holders name it: a recall (a booking's, a
# preemption's), an idle reclaim, its holder's declared end (a cell's --timeout), its deadline (not
# renewed), a booking's end (a GPU reserved for its holder).
_FIRM = (("recall_at", "recall"), ("reclaim_at", "reclaim"), ("ends_by", "timeout"))


def _firm_ends(lease: dict[str, Any], unrenewed: dict[str, float]) -> list[tuple[float, str]]:
    """The known ends of a lease (or slice) of the view: (epoch seconds, what ends it)."""
    out = [(float(lease[k]), kind) for k, kind in _FIRM if lease.get(k)]
    lid = lease.get("id") or lease.get("lease")
    if lid in unrenewed:
        out.append((unrenewed[lid], "expiry"))
    return out


def _near_expiry(nodes: list[dict[str, Any]], now_s: float) -> list[str]:
    """Leases of the view whose deadline is nearer than half their TTL: the holder of one that is
    renewed (every third of it, as the clients do) would have pushed it further. The view may be
    seconds old, so these are only candidates: :func:`_unrenewed` reads them again."""
    out = []
    for n in nodes:
        for g in n["gpus"]:
            leases = [g["lease"]] if g.get("lease") and g["state"] in ("leased", "borrowed") else []
            leases += g.get("slices") or []
            for lease in leases:
                ttl = float(lease.get("ttl") or 0)
                if ttl and not lease.get("warm_since") and lease["expires_at"] - now_s < ttl / 2:
                    out.append(lease.get("id") or lease["lease"])
    return out


async def _unrenewed(engine: Engine, ids: list[str], now_ms: int) -> dict[str, float]:
    """Of ``ids``, the live leases whose holder has not renewed them in time (read now, not from the
    view): lease id -> its deadline (epoch seconds), by which it ends unless renewed at last."""
    if not ids:
        return {}
    out = {}
    for raw in await engine.redis.hmget(engine.keys.leases, ids):
        if not raw:
            continue
        rec = json.loads(raw)
        ttl_ms = int(rec.get("ttl_ms") or 0)
        if ttl_ms and not rec.get("warm_since") and rec["expires_at"] - now_ms < ttl_ms / 2:
            out[rec["id"]] = rec["expires_at"] / 1000
    return out


class _Holders:
    """Who holds the pool's GPUs, per user, as a waiting request hears it: GPUs (and slices) held,
    and the soonest known end of their leases (booked GPUs: the booking's end)."""

    def __init__(self) -> None:
        self.by_user: dict[str, dict[str, Any]] = {}

    def add(self, user: str, what: str, expect: float, firm: list[tuple[float, str]], now_s: float) -> None:
        h = self.by_user.setdefault(user, {"user": user, "gpus": 0, "slices": 0, "booked": 0, "expect_s": expect})
        h[what] += 1
        h["expect_s"] = min(h["expect_s"], expect)
        if firm:
            at, kind = min(firm)
            if h.get("ends_at") is None or at < h["ends_at"]:
                h["ends_at"], h["end"] = at, kind
                h["ends_in"] = round(max(0.0, at - now_s), 1)

    def rows(self, asker: str | None, limit: int = 8) -> list[dict[str, Any]]:
        """The holders, the soonest known end first, then the soonest expected; ``limit`` of them."""
        rows = sorted(
            self.by_user.values(),
            key=lambda h: (h.get("ends_in") is None, h.get("ends_in") or 0.0, h["expect_s"], h["user"]),
        )
        out = []
        for h in rows[:limit]:
            row = {k: v for k, v in h.items() if v or k in ("user", "gpus")}
            row["expect_s"] = round(h["expect_s"], 1)
            if asker is not None and h["user"] == asker:
                row["mine"] = True
            out.append(row)
        return out


# A warm GPU (a finished cell's worker kept for its next cell) is lent the moment someone waits:
# its worker is evicted (or suspended) first, which takes a few seconds.
WARM_BACK_S = 2.0


class _Gpu:
    """One GPU of the pool as the estimate sees it: when it is expected whole again (``back``), and
    for a slice, its memory free now and the slices' memory as it comes back: (seconds, MB)."""

    __slots__ = ("size", "back", "room", "sharers", "frees")

    def __init__(self, size: int, back: float, room: int, sharers: int, frees: list[tuple[float, int]]) -> None:
        self.size, self.back, self.room, self.sharers, self.frees = size, back, room, sharers, frees

    def fits_at(self, mb: int, max_sharers: int) -> float:
        """The first time a slice of ``mb`` fits here (seconds from now; inf: not within view)."""
        room, sharers = self.room, self.sharers
        if room >= mb and sharers < max_sharers:
            return 0.0
        for at, freed in sorted(self.frees):
            room, sharers = room + freed, sharers - 1
            if room >= mb and sharers < max_sharers:
                return at
        return math.inf

    def take(self, at: float, mb: int, typical: float) -> None:
        """A slice of ``mb`` placed here at ``at``, held for ``typical``: its memory is promised till then."""
        self.room -= mb
        self.sharers += 1
        self.frees.append((at + typical, mb))
        self.back = max(self.back, at + typical)


def _pool_gpus(
    nodes: list[dict[str, Any]],
    now_s: float,
    typical: float,
    unrenewed: dict[str, float] | None = None,
    holders: _Holders | None = None,
) -> tuple[list[_Gpu], list[float], int]:
    """Each GPU of the up nodes that could serve the pool, with when it comes back; the fixed ends
    seen (recalls, idle reclaims, evictions, declared ends, deadlines not renewed, bookings' ends)
    and how many GPUs running leases hold (a sliced GPU counts once). ``unrenewed``: lease id -> the
    deadline of a lease its holder does not renew (:func:`_unrenewed`). A GPU out of service (down,
    an abandoned drain) never comes back within the estimate's view; one reserved for a booking in
    force, at the booking's end. ``holders`` hears who holds each GPU (:class:`_Holders`)."""
    unrenewed = unrenewed or {}
    gpus: list[_Gpu] = []
    firm_ends: list[float] = []
    held = 0
    for n in nodes:
        for g in n["gpus"]:
            size = int(g.get("memory_mb") or 0)
            state = g["state"]
            if state == "free":
                gpus.append(_Gpu(size, 0.0, size, 0, []))
            elif state == "warm":
                gpus.append(_Gpu(size, WARM_BACK_S, 0, 1, [(WARM_BACK_S, size)]))
            elif state in ("leased", "borrowed") and "lease" in g:
                held += 1
                lease = g["lease"]
                firm = _firm_ends(lease, unrenewed)
                back, fixed = _expect_end(lease["since"], [at for at, _ in firm], now_s, typical)
                if fixed is not None:
                    firm_ends.append(fixed)
                if holders is not None:
                    holders.add(lease["user"], "gpus", back, firm, now_s)
                gpus.append(_Gpu(size, back, 0, 1, [(back, size)]))
            elif state == "sliced":
                held += 1
                frees = []
                for sl in g.get("slices", []):
                    if sl.get("warm_since"):
                        frees.append((WARM_BACK_S, sl["gpu_mem_mb"]))
                        continue
                    firm = _firm_ends(sl, unrenewed)
                    end, fixed = _expect_end(sl["since"], [at for at, _ in firm], now_s, typical)
                    if fixed is not None:
                        firm_ends.append(fixed)
                    if holders is not None:
                        holders.add(sl["user"], "slices", end, firm, now_s)
                    frees.append((end, sl["gpu_mem_mb"]))
                # a draining slice's memory comes back once its agent sees its processes gone
                frees += [(1.0, d["gpu_mem_mb"]) for d in g.get("slices_draining", [])]
                room = int(g["slice_mem"]["free_mb"]) if "slice_mem" in g else 0
                back = max((at for at, _mb in frees), default=0.0)
                gpus.append(_Gpu(size, back, room, len(frees), frees))
            elif state == "reserved" and (g.get("reservation") or {}).get("end"):
                # owed to a booking in force: its holder's until the booking ends
                r = g["reservation"]
                end_in = max(1.0, r["end"] - now_s)
                firm_ends.append(end_in)
                if holders is not None and r.get("owner"):
                    holders.add(r["owner"], "booked", end_in, [(r["end"], "booking")], now_s)
                gpus.append(_Gpu(size, end_in, 0, 1, [(end_in, size)]))
            elif state == "draining" and not g.get("draining", {}).get("abandoned"):
                gpus.append(_Gpu(size, 1.0, 0, 1, [(1.0, size)]))
    return gpus, firm_ends, held


async def estimate(
    engine: Engine,
    pool: str,
    gpus: int,
    now_ms: int,
    lease: str | None = None,
    gpu_mem_mb: int = 0,
    view: dict[str, Any] | None = None,
    asker: str | None = None,
) -> dict[str, Any]:
    """How long ``gpus`` GPUs of ``pool`` (or, with ``gpu_mem_mb``, slices of that much memory on
    ``gpus`` GPUs) would take to come free, and alternatives free now.

    A simple, explainable model: every running lease or slice ends after the pool's typical duration
    (one already older runs half its age again; one with a known end ends then at the latest: a
    recall, an eviction, an idle reclaim, the end its holder declared (a cell's --timeout), or the
    deadline of a lease its holder no longer renews), a warm GPU is lent at once, GPUs owed to
    bookings in force stay taken until the booking ends, and the requests queued ahead take GPUs
    (or memory) first: a queued slice counts as its share of a GPU. ``holders``: who holds the
    pool's GPUs, per user, the soonest known end first (``mine`` for ``asker``'s own). ``lease`` is
    the id of the asking request when it is already queued: then only the waiters strictly ahead of
    it count (in arrival order, as GET /queue numbers them), never itself or those behind it.
    Returns seconds, and the reasoning in words. ``view``: the cluster as ``cluster_view`` reads it
    (the server's shared one), else read here."""
    if view is None:
        view = await cluster_view(engine)
    typical = await typical_duration(engine, pool)
    queued: Any = await engine.redis.zrangebylex(engine.keys.queue, f"[{pool}|", f"({pool}|~")
    waiters = []
    if queued:
        ids = [m.rsplit("|", 1)[1] for m in queued]
        waiters = [json.loads(w) for w in await engine.redis.hmget(engine.keys.waiters, ids) if w]
    mine = next((i for i, w in enumerate(waiters) if w["id"] == lease), None) if lease else None
    ahead = waiters if mine is None else waiters[:mine]
    ahead_gpus = sum(w["gpus"] for w in ahead)
    nodes = [n for n in view["nodes"] if n["pool"] == pool and n["state"] == "up"]
    now_s = now_ms / 1000
    unrenewed = await _unrenewed(engine, _near_expiry(nodes, now_s), now_ms)
    holders = _Holders()
    pool_gpus, firm_ends, held = _pool_gpus(nodes, now_s, typical, unrenewed, holders)
    size = max((g.size for g in pool_gpus), default=0)
    max_sharers = int(engine.settings.sched_table(pool)["max_sharers"])  # type: ignore[call-overload]
    what = f"{gpus} GPU(s) of {pool}"
    if gpu_mem_mb and size and gpu_mem_mb > size:
        raise errors.BadRequest(
            f"a slice of {gpu_mem_mb} MB is more than one GPU of pool {pool!r} has ({size} MB): ask for at most "
            f"{size} MB, or for whole GPUs (drop gpu_mem_mb)",
            pool=pool,
            gpu_mem_mb=gpu_mem_mb,
            largest_mb=size,
        )
    if gpu_mem_mb:
        what = f"a {_mem(gpu_mem_mb)} slice of {pool}" if gpus == 1 else f"{gpus} slices of {_mem(gpu_mem_mb)}"
        # The waiters ahead take their slices (or whole GPUs) first, each where it fits soonest.
        for w in ahead:
            mb = int(w.get("gpu_mem_mb") or 0) or size
            for _ in range(int(w["gpus"])):
                best = min(pool_gpus, key=lambda g: g.fits_at(mb, max_sharers if mb < size else 1), default=None)
                at = best.fits_at(mb, max_sharers if mb < size else 1) if best else math.inf
                if best is None or at == math.inf:
                    break
                best.take(at, mb, typical)
        fits = sorted(g.fits_at(gpu_mem_mb, max_sharers) for g in pool_gpus)
        free_now = sum(1 for at in fits if at == 0.0)
        wait_s: float | None = fits[gpus - 1] if len(fits) >= gpus and fits[gpus - 1] < math.inf else None
        if wait_s is None and fits:
            wait_s = typical * 2  # every GPU is promised past what the view shows: a round of cells
    else:
        back = sorted(g.back for g in pool_gpus)
        free_now = max((sum(1 for g in n["gpus"] if g["state"] == "free") for n in nodes), default=0)
        # A queued slice takes its share of a GPU, not a whole one.
        need = math.ceil(
            sum(w["gpus"] * (min(1.0, w["gpu_mem_mb"] / size) if w.get("gpu_mem_mb") and size else 1.0) for w in ahead)
            + gpus
            - 1e-9
        )
        if need <= len(back):
            wait_s = back[need - 1]
        elif back:
            rounds = need / max(1, len(back))
            wait_s = back[-1] + typical * max(0.0, rounds - 1)
        else:
            wait_s = None
    alternatives = []
    for other in sorted(view["pools"]):
        if other == pool:
            continue
        most = max(
            (sum(1 for g in n["gpus"] if g["state"] == "free") for n in view["nodes"] if n["pool"] == other),
            default=0,
        )
        if most >= gpus:
            alternatives.append({"pool": other, "free": most, "text": f"{most} x {other} free now"})
    bookings = (await Bookings(engine).in_force(now_ms)).get(pool, [])
    if free_now >= gpus and not ahead:
        text = f"{what} free now" if not gpu_mem_mb else f"{what} fits now"
        wait_s = 0.0
    elif wait_s is None:
        text = f"no GPU of pool {pool} is up"
    elif not ahead:
        # Nothing queued ahead: what it waits for is running leases, not other requests.
        if firm_ends:
            why = f"waiting for a running lease to end (the soonest ends in about {show_wait(min(firm_ends))})"
        elif gpu_mem_mb:
            why = "waiting for memory held by running calls"
        else:
            why = f"waiting for {max(1, gpus - free_now)} GPU(s) held by running calls"
        text = (
            f"nothing queued ahead, {why}: about {show_wait(wait_s)} for {what}; "
            f"cells here typically hold GPUs {show_wait(typical)}"
        )
    else:
        text = (
            f"about {show_wait(wait_s)} for {what}: {len(ahead)} request(s) "
            f"({ahead_gpus} GPUs) ahead, cells here typically hold GPUs {show_wait(typical)}"
        )
    if bookings:
        text += f"; {len(bookings)} booking(s) in force"
    out = {
        "pool": pool,
        "gpus": gpus,
        "free_now": free_now,
        "position": None if mine is None else mine + 1,
        "queued_ahead": len(ahead),
        "queued_gpus_ahead": ahead_gpus,
        "held_gpus": held,
        "typical_s": typical,
        "estimate_s": wait_s,
        # the wait in a few words, for a client's own line ("about 40 s"; null when no GPU is up)
        "wait": None if wait_s is None else ("any moment now" if wait_s < 1 else f"about {show_wait(wait_s)}"),
        "estimate_at": None if wait_s is None else now_s + wait_s,
        "alternatives": alternatives,
        "holders": holders.rows(asker),
        "text": text,
    }
    if gpu_mem_mb:
        out["gpu_mem_mb"] = gpu_mem_mb
    return out


def _mem(mb: int) -> str:
    return f"{mb / 1024:g} GB" if mb % 1024 == 0 else f"{mb} MB"


# ---- the summary of the hourly rollups (GET /api/v1/usage/summary, gpulease report) ------------------


def summary_window(lo_ms: int | None, hi_ms: int | None, now_ms: int) -> tuple[int, int]:
    """The hours a summary covers: [from, to) widened to whole hours (the rollups' grain); default
    the last 7 days up to the end of this hour. A range that is empty or longer than
    :data:`MAX_SUMMARY_DAYS` is a 400 that says what would work."""
    hi = hi_ms if hi_ms is not None else now_ms
    lo = lo_ms if lo_ms is not None else hi - 7 * rollup.DAY_MS
    if hi <= lo:
        raise errors.BadRequest(
            f"to must be after from (from {iso(lo)}, to {iso(hi)}): e.g. from={iso(hi - 7 * rollup.DAY_MS)}"
        )
    lo_h, hi_h = lo // rollup.HOUR_MS, -(-hi // rollup.HOUR_MS)
    if hi_h - lo_h > MAX_SUMMARY_DAYS * 24:
        raise errors.BadRequest(
            f"from {iso(lo)} to {iso(hi)} spans {(hi - lo) / rollup.DAY_MS:.0f} days; a summary covers at most "
            f"{MAX_SUMMARY_DAYS} days (what the rollups keep): e.g. from={iso(hi - MAX_SUMMARY_DAYS * rollup.DAY_MS)}"
        )
    return lo_h * rollup.HOUR_MS, hi_h * rollup.HOUR_MS


def iso(ms: int) -> str:
    """UTC milliseconds as a time the from/to parameters take back (2026-11-23T09:00:00Z)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ms / 1000))


def _day(ms: int) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(ms / 1000))


FOLD_BATCH = 500  # ledger lines one fold script reads (it blocks Redis while it runs: a few ms)


async def fold_pending(engine: Engine) -> int:
    """Fold the ledger lines written since the last sweep into the hourly rollups (the sweep does
    it every half second; a reader does it first, so that it sees every lease that has ended).
    Returns the lines read; almost always none or a few."""
    total = 0
    while True:
        got = await engine.run(Fold(FOLD_BATCH))
        total += got
        if got < FOLD_BATCH:
            return total


ROLLUP_SLICE = 200  # rollup rows read, decoded and summed between two returns to the event loop (~3 ms)

Row = tuple[int, str, str, dict[str, Any]]  # (hour, pool, user, row)


async def user_pools(engine: Engine, user: str) -> set[str]:
    """The pools ``user`` ever held a lease in: every lease's end writes its pool's fair-share
    record of its user (``usage``, "pool|user"; never deleted), so these are the pools that can hold
    a rollup row of theirs. One scan of that hash (pools x users fields, not hours)."""
    pools: set[str] = set()
    async for name, _raw in engine.redis.hscan_iter(engine.keys.usage, match=f"*|{user}", count=1000):
        pools.add(str(name).rsplit("|", 1)[0])
    return pools


async def rollup_slices(
    engine: Engine,
    lo_ms: int,
    hi_ms: int,
    *,
    user: str | None = None,
    pools: set[str] | None = None,
    on_read: Callable[[int], Awaitable[None]] | None = None,
) -> AsyncIterator[list[Row]]:
    """The rollup rows of the hours in [lo, hi) (hour-aligned), as (hour, pool, user, row), at most
    :data:`ROLLUP_SLICE` at a time (the lines not yet folded are folded first): each slice one read
    of the index from where the last ended and one of the rows, so the event loop serves others
    between two, however many rows the window holds.

    With ``user``, only that user's rows in ``pools`` (default: the pools they ever held a lease
    in, :func:`user_pools`): their names are known (each hour of the window in each pool), so no
    other user's row, nor its name in the index, is read; what it costs is the window's hours x
    pools, whatever the number of users. ``on_read(n)`` is awaited after each read of ``n`` rows
    (names asked for, found or not): the API counts them against the token's read budget."""
    await fold_pending(engine)
    keys = engine.keys
    lo_h, hi_h = lo_ms // rollup.HOUR_MS, hi_ms // rollup.HOUR_MS
    if user is not None:
        if pools is None:
            pools = await user_pools(engine, user)
        in_order = sorted(pools, key=lambda p: p + "|")  # as the index orders them
        names = [rollup.field(h, p, user) for h in range(lo_h, hi_h) for p in in_order]
        for i in range(0, len(names), ROLLUP_SLICE):
            chunk = names[i : i + ROLLUP_SLICE]
            raws: Any = await engine.redis.hmget(keys.rollup, chunk)
            if on_read is not None:
                await on_read(len(chunk))
            found = _parsed(chunk, raws)
            if found:
                yield found
        return
    start, end = f"[{rollup.hour_name(lo_h)}|", f"({rollup.hour_name(hi_h)}|"
    while True:
        listed: Any = await engine.redis.zrangebylex(keys.rollup_idx, start, end, start=0, num=ROLLUP_SLICE)
        chunk = list(listed)
        if not chunk:
            return
        raws = await engine.redis.hmget(keys.rollup, chunk)
        if on_read is not None:
            await on_read(len(chunk))
        found = _parsed(chunk, raws)
        if found:
            yield found
        if len(chunk) < ROLLUP_SLICE:
            return
        start = f"({chunk[-1]}"


def _parsed(names: list[str], raws: list[str | None]) -> list[Row]:
    out = []
    for name, raw in zip(names, raws, strict=True):
        if raw:
            hour, pool, user = rollup.parse_field(name)
            out.append((hour, pool, user, json.loads(raw)))
    return out


async def rollup_rows(engine: Engine, lo_ms: int, hi_ms: int) -> list[Row]:
    """Every rollup row of the hours in [lo, hi) (hour-aligned), as :func:`rollup_slices` reads them."""
    return [row async for part in rollup_slices(engine, lo_ms, hi_ms) for row in part]


def figures(row: dict[str, Any]) -> dict[str, Any]:
    """A summed row (store/rollup.py) as the summary's figures (the OpenAPI UsageFigures)."""
    n, warm_cells = int(row["n"]), int(row["warm_cells"])
    cells = n + warm_cells
    return {
        "calls": n,
        "cells": cells,
        "warm_cells": warm_cells,
        "warm_cell_share": round(warm_cells / cells, 4) if cells else None,
        "held_gpu_s": round(row["held"], 3),
        "sampled_gpu_s": round(row["sampled"], 3),
        "used_gpu_s": round(row["used"], 3),
        "util_pct": round(100 * row["used"] / row["sampled"], 2) if row["sampled"] else None,
        "warm_gpu_s": round(row["warm"], 3),
        "reclaimed_gpu_s": round(row["reclaimed"], 3),
        "evicted_gpu_s": round(row["evicted"], 3),
        "waits": n,
        "wait_ms_sum": round(row["wait_ms"], 1),
        "wait_mean_ms": round(row["wait_ms"] / n, 1) if n else None,
        "wait_p50_ms": _rounded(rollup.quantile(row["wh"], 0.5)),
        "wait_p95_ms": _rounded(rollup.quantile(row["wh"], 0.95)),
    }


def _rounded(v: float | None) -> float | None:
    return None if v is None else round(v, 1)


def summarize_rollups(
    rows: list[Row],
    lo_ms: int,
    hi_ms: int,
    by: str,
    teams_of: Any = None,
    also_by: str | None = None,
) -> dict[str, Any]:
    """Per-day series and totals, overall and per ``by`` (user, team or pool), of rollup rows.
    ``teams_of(user)``: the teams of a user whose rows name none (the server's settings).
    ``also_by``: the same rows grouped a second way too, in ``also`` (one read of the rows for both)."""
    return summarize_days(sum_days(rows), lo_ms, hi_ms, by, teams_of, also_by)


DaySums = dict[tuple[int, str, str], dict[str, Any]]  # (day, pool, user) -> its hours summed


def sum_days(rows: list[Row], into: DaySums | None = None) -> DaySums:
    """Add hourly rollup rows into their (day, pool, user) sums (``into``, or new ones): a month is
    ~12,000 hourly rows and ~1,500 of these, so a summary read a slice at a time keeps only these."""
    by_day: DaySums = {} if into is None else into
    for hour, pool, user, row in rows:
        at = (hour // 24, pool, user)
        acc = by_day.get(at)
        if acc is None:
            acc = by_day[at] = rollup.empty()
            acc["teams"] = ""
        rollup.add(acc, row)
        if row.get("teams"):
            acc["teams"] = row["teams"]
    return by_day


def summarize_days(
    by_day: DaySums, lo_ms: int, hi_ms: int, by: str, teams_of: Any = None, also_by: str | None = None
) -> dict[str, Any]:
    """:func:`summarize_rollups` of rows already summed per day (:func:`sum_days`): each (day, pool,
    user) is added to its day, the total, its group and its group's day."""
    out: dict[str, Any] = {}
    for _ in _summarize_steps(by_day, lo_ms, hi_ms, by, teams_of, also_by, out):
        pass
    return out


async def summarize_days_sliced(
    by_day: DaySums, lo_ms: int, hi_ms: int, by: str, teams_of: Any = None, also_by: str | None = None
) -> dict[str, Any]:
    """:func:`summarize_days`, with the event loop let go every :data:`ROLLUP_SLICE` rows' worth of
    work (600 users over a week: ~0.2 s of sums and figures, which no other request waits behind)."""
    out: dict[str, Any] = {}
    for _ in _summarize_steps(by_day, lo_ms, hi_ms, by, teams_of, also_by, out):
        await asyncio.sleep(0)
    return out


def _summarize_steps(
    by_day: DaySums,
    lo_ms: int,
    hi_ms: int,
    by: str,
    teams_of: Any,
    also_by: str | None,
    out: dict[str, Any],
) -> Iterator[None]:
    """The work of :func:`summarize_days` into ``out``, yielding between steps of about
    :data:`ROLLUP_SLICE` additions."""
    days = [_day(d * rollup.DAY_MS) for d in range(lo_ms // rollup.DAY_MS, -(-hi_ms // rollup.DAY_MS))]
    total, daily = rollup.empty(), {d: rollup.empty() for d in days}
    groupings = [by] if also_by is None else [by, also_by]
    groups: list[dict[str, tuple[dict[str, Any], dict[str, dict[str, Any]]]]] = [{} for _ in groupings]
    step = max(1, ROLLUP_SLICE // (2 + 2 * len(groupings)))  # (day, pool, user) sums per step
    for i, ((day_n, pool, user), row) in enumerate(by_day.items(), 1):
        day = _day(day_n * rollup.DAY_MS)
        rollup.add(total, row)
        rollup.add(daily[day], row)
        for grouping, into in zip(groupings, groups, strict=True):
            for key in _group_keys(grouping, pool, user, row, teams_of):
                if key not in into:
                    into[key] = (rollup.empty(), {d: rollup.empty() for d in days})
                g_total, g_daily = into[key]
                rollup.add(g_total, row)
                rollup.add(g_daily[day], row)
        if i % step == 0:
            yield
    out.update(
        {
            "from": lo_ms / 1000,
            "to": hi_ms / 1000,
            "by": by,
            "days": days,
            "total": figures(total),
            "daily": [{"day": d, **figures(daily[d])} for d in days],
        }
    )
    listed: list[list[dict[str, Any]]] = []
    for into in groups:
        listed.append([])
        yield from _ordered_groups(into, days, listed[-1], max(1, ROLLUP_SLICE // (1 + len(days))))
    out["groups"] = listed[0]
    if also_by is not None:
        out["also"] = {"by": also_by, "groups": listed[1]}


def _group_keys(by: str, pool: str, user: str, row: dict[str, Any], teams_of: Any) -> list[str]:
    """The groups a (day, pool, user) row counts in: its pool, its user, or each of its user's teams."""
    if by == "team":
        named = [t for t in (row.get("teams") or "").split(",") if t]
        if not named and teams_of is not None:
            named = list(teams_of(user))
        return named or [NO_TEAM]
    return [pool if by == "pool" else user]


def _ordered_groups(
    groups: dict[str, tuple[dict[str, Any], dict[str, dict[str, Any]]]],
    days: list[str],
    into: list[dict[str, Any]],
    step: int,
) -> Iterator[None]:
    """The groups as the answer lists them (largest held + warm first), appended to ``into``,
    yielding after every ``step`` of them."""
    ordered = sorted(groups.items(), key=lambda kv: (-kv[1][0]["held"] - kv[1][0]["warm"], kv[0]))
    for i, (key, (g_total, g_daily)) in enumerate(ordered, 1):
        into.append({"key": key, "total": figures(g_total), "daily": [{"day": d, **figures(g_daily[d])} for d in days]})
        if i % step == 0:
            yield


# ---- a user's balance (GET /api/v1/usage/balance, %gpu_lease) -------------------------------------------


def _standing(raw: str, now_ms: int, half_life_s: float) -> float:
    """A usage record's fair-share standing now, as decayed_usage in lua/_lib.lua computes it: the
    decayed GPU-seconds, the time of the GPUs running since, and each GPU running now counted as
    the GPU-time it would add if held on."""
    u = json.loads(raw)
    dt_ms = max(0, now_ms - int(u["t"]))
    r = float(u.get("r", 0))
    return float(u["v"]) * 0.5 ** (dt_ms / (half_life_s * 1000)) + r * dt_ms / 1000 + r * half_life_s / math.log(2)


async def balance(engine: Engine, user: str, teams: tuple[str, ...], pools: list[str], now_ms: int) -> dict[str, Any]:
    """What ``user`` has left in each of ``pools``: quota (GPUs at once) and held now, their place in
    fair share (1st: the least recent use, served first among waiters) and how long their next
    one-GPU cell would wait (:func:`estimate`), with a line in words per pool."""
    keys, settings = engine.keys, engine.settings
    out = []
    for pool in pools:
        sched = settings.sched_table(pool)
        quotas: dict[str, int] = sched["quota"]  # type: ignore[assignment]
        quota = quotas.get(user, quotas.get("*"))
        h = await engine.redis.hmget(keys.held_by, [f"{pool}|{user}", f"{pool}|{user}|m"])  # type: ignore[misc]
        held = int(h[0] or 0) + int(h[1] or 0) / 1000
        mine, others = 0.0, []
        async for field, raw in engine.redis.hscan_iter(keys.usage, match=f"{pool}|*"):
            who = field.split("|", 1)[1]
            value = _standing(raw, now_ms, settings.fair_share_half_life)
            if who == user:
                mine = value
            else:
                others.append(value)
        rank = 1 + sum(1 for v in others if v < mine)
        of = len(others) + 1
        est = await estimate(engine, pool, 1, now_ms)
        left = None if not quota else max(0.0, quota - held)
        # (a short line: %gpu_lease shows it indented under the pool's, within 80 columns)
        words = [
            f"{held:g} of {quota} GPUs yours, {left:g} left"
            if quota
            else f"{held:g} GPU{'' if held == 1 else 's'} yours (no quota)"
        ]
        if sched["scheduler"] == "fair_share":
            words.append(f"{ordinal(rank)} of {of} in fair share")
        if est["wait"] is not None:
            words.append(f"next cell: {est['wait']}" if est["estimate_s"] else "next cell: now")
        out.append(
            {
                "pool": pool,
                "quota": quota,
                "held": held,
                "left": left,
                "scheduler": sched["scheduler"],
                "fair_share": {"rank": rank, "of": of, "usage_gpu_s": round(mine, 3)},
                "next_wait_s": est["estimate_s"],
                "next_wait": est["wait"],
                "text": "; ".join(words),  # without the pool's name: the answer's pool says it
            }
        )
    return {"user": user, "teams": list(teams), "pools": out}
