"""The usage ledger and the time-to-GPU estimate.

Every lease that ends writes one ledger entry (``end_lease`` in ``lua/_lib_end.lua``): user, teams,
notebook (the lease's session), cell (its label), pool, GPUs (its final count), seconds held and
waited, GPU-seconds held (``gpu_s``: at each size, for an elastic lease that grew or shrank), mean
utilization and peak memory from the agent's samples, and the GPU-seconds fair share charged.
:func:`report` sums it per user, team or pool over a period; :func:`estimate` uses it, with the
queue, the running leases and the bookings in force, to say how long a request would wait.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from typing import Any

from ..store.engine import Engine
from .board import cluster_view
from .bookings import Bookings

GROUPS = ("user", "team", "pool", "notebook")
DEFAULT_TYPICAL_S = 600.0


async def ledger(engine: Engine, lo_ms: int, hi_ms: int, limit: int = 200_000) -> list[dict[str, Any]]:
    """Ledger entries of leases that ended in [lo, hi), oldest first."""
    rows: Any = await engine.redis.xrange(engine.keys.ledger, f"{lo_ms}-0", f"{max(lo_ms, hi_ms - 1)}", count=limit)
    return [json.loads(fields["data"]) for _id, fields in rows]


def _gpu_s(entry: dict[str, Any]) -> float:
    """GPU-seconds an entry held: at each size it had (an elastic lease grows and shrinks; ``gpus``
    is its final count), or, in entries written before leases could change size, held x GPUs."""
    return float(entry.get("gpu_s", entry["held_s"] * entry["gpus"]))


def summarize(entries: list[dict[str, Any]], by: str = "user") -> list[dict[str, Any]]:
    """Per ``by`` (user, team, pool or notebook): calls, GPU-hours held and charged, utilization
    (GPU-time weighted, over the leases the agent sampled), median wait, revoked/preempted calls."""
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in entries:
        if by == "team":
            for team in [t for t in (e.get("teams") or "").split(",") if t] or ["(no team)"]:
                groups[team].append(e)
        elif by == "notebook":
            groups[e.get("notebook") or e.get("session") or "(none)"].append(e)
        else:
            groups[e[by]].append(e)
    out = []
    for key, rows in groups.items():
        gpu_s = sum(_gpu_s(r) for r in rows)
        sampled = [r for r in rows if r.get("util_mean") is not None]
        sampled_gpu_s = sum(_gpu_s(r) for r in sampled)
        util = None
        if sampled_gpu_s:
            util = sum(r["util_mean"] * _gpu_s(r) for r in sampled) / sampled_gpu_s
        peaks = [r["mem_peak_mb"] for r in rows if r.get("mem_peak_mb") is not None]
        out.append(
            {
                by: key,
                "calls": len(rows),
                "gpu_hours": round(gpu_s / 3600, 4),
                "charged_gpu_hours": round(sum(r.get("charged_gpu_s", 0) for r in rows) / 3600, 4),
                "util_mean": None if util is None else round(util, 1),
                "mem_peak_mb": max(peaks) if peaks else None,
                "wait_p50_s": round(statistics.median(r.get("waited_s", 0) for r in rows), 3),
                "revoked": sum(1 for r in rows if r.get("state") == "revoked"),
            }
        )
    out.sort(key=lambda row: -row["gpu_hours"])
    return out


async def typical_duration(engine: Engine, pool: str, sample: int = 200) -> float:
    """Median seconds held of the pool's last ``sample`` ended leases (600 s with no history)."""
    rows: Any = await engine.redis.xrevrange(engine.keys.ledger, count=sample * 4)
    held = [d["held_s"] for d in (json.loads(f["data"]) for _id, f in rows) if d["pool"] == pool][:sample]
    return float(statistics.median(held)) if held else DEFAULT_TYPICAL_S


async def estimate(engine: Engine, pool: str, gpus: int, now_ms: int, lease: str | None = None) -> dict[str, Any]:
    """How long ``gpus`` GPUs of ``pool`` would take to come free, and alternatives free now.

    A simple, explainable model: every running lease ends after the pool's typical duration (one
    already older runs half its age again; one with a fixed end, a recall or an idle reclaim, ends
    then at the latest), GPUs owed to bookings in force stay taken, and the requests queued ahead take
    GPUs first. ``lease`` is the id of the asking request when it is already queued: then only the
    waiters strictly ahead of it count (in arrival order, as GET /queue numbers them), never itself
    or those behind it. Returns seconds, and the reasoning in words."""
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
    free_now = max((sum(1 for g in n["gpus"] if g["state"] == "free") for n in nodes), default=0)
    # When each held GPU is expected back: its lease's start + typical (at least now)
    back: list[float] = []
    firm_ends: list[float] = []
    held = 0
    for n in nodes:
        for g in n["gpus"]:
            if g["state"] == "free":
                back.append(0.0)
            elif g["state"] in ("leased", "borrowed") and "lease" in g:
                held += 1
                # A lease younger than typical ends when typical; an older one has shown it runs
                # long, so expect half its age again (never less than a second).
                age = now_ms / 1000 - g["lease"]["since"]
                expect = max(typical - age, age / 2, 1.0)
                # A recalled or idle-warned lease ends by its deadline whatever its age says.
                firm = [g["lease"][k] for k in ("recall_at", "reclaim_at") if g["lease"].get(k)]
                if firm:
                    end_in = max(0.0, min(firm) - now_ms / 1000)
                    firm_ends.append(end_in)
                    expect = min(expect, max(end_in, 1.0))
                back.append(expect)
    back.sort()
    need = ahead_gpus + gpus
    if need <= len(back):
        wait_s: float | None = back[need - 1]
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
        text = f"{gpus} GPU(s) of {pool} free now"
        wait_s = 0.0
    elif wait_s is None:
        text = f"no GPU of pool {pool} is up"
    elif not ahead:
        # Nothing queued ahead: what it waits for is running leases, not other requests.
        if firm_ends:
            why = f"waiting for a running lease to end (the soonest ends in about {_human(min(firm_ends))})"
        else:
            why = f"waiting for {max(1, gpus - free_now)} GPU(s) held by running calls"
        text = (
            f"nothing queued ahead, {why}: about {_human(wait_s)} for {gpus} GPU(s) of {pool}; "
            f"cells here typically hold GPUs {_human(typical)}"
        )
    else:
        text = (
            f"about {_human(wait_s)} for {gpus} GPU(s) of {pool}: {len(ahead)} request(s) "
            f"({ahead_gpus} GPUs) ahead, cells here typically hold GPUs {_human(typical)}"
        )
    if bookings:
        text += f"; {len(bookings)} booking(s) in force"
    return {
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
        "wait": None if wait_s is None else ("any moment now" if wait_s < 1 else f"about {_human(wait_s)}"),
        "estimate_at": None if wait_s is None else now_ms / 1000 + wait_s,
        "alternatives": alternatives,
        "text": text,
    }


def _human(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
