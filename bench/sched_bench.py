#!/usr/bin/env python
"""Performance figures of the scheduler (issue 6, Bench section; issue 13, section 3: fairness per window).

    .venv/bin/python bench/sched_bench.py [--quick | --smoke] [--seed N]

Starts its own redis-server, drives the real Lua scripts through LeaseStore.run (the path the HTTP
API takes, minus HTTP), prints one line per figure and, as the very last line, one JSON object:

decision_p99_ms      1,000 requests of 100 users queued for a full 128-GPU pool (16 nodes x 8); each
                     release of a held GPU runs dispatch, which orders the queue by fair share and
                     grants the next waiter. p99 of that release's round trip (the scheduling
                     decision and the grant, in one script), over 500 releases. Baselines measured in
                     the same run: PING, and the same release with nobody queued. (target <= 5 ms)
fairness_deviation   a generated day of notebook work (seeded: 24 users, cells arriving as a Poisson
                     process with log-normal durations, median 10 min, 1 or 2 GPUs) on 16 GPUs (two
                     nodes of 8), 1.6x over-subscribed, replayed through the fair_share scheduler
                     under a virtual clock, and measured per window (lease_server/sim/fairness.py):
                     in each 10-minute window, the max-min fair division of the GPU-time delivered
                     in it among the users with demand in it (GPUs running or queued, a user's share
                     capped by that demand); the deviation is sum |received - fair| / sum fair over
                     users and windows, the GPU-time-weighted mean of |received - fair| / fair.
                     (target <= 0.10)
fairness_deviation_fifo       the same day under fifo, for reference.
fairness_deviation_sweep_day  a day of 12 interactive users (as above, 1.0x) and one more who
                     submits a sweep of 64 one-GPU trials at once an hour in (median 15 min each),
                     under fair_share (target <= 0.10); ..._sweep_day_fifo: under fifo.
fairness_locked*     the part of each deviation locked in by grants that ran through a whole window
                     with more than their user's fair share of it: no decision taken during that
                     window could have undone it (without preemption a grant keeps its GPUs).
fairness_whole_day*  the figure reported as fairness_deviation before: each user's GPU-time over
                     the whole day against a whole-day max-min share of it, the largest relative
                     deviation among users; it ignores when demand arrives.

Run time: about 15 s (the replays of the two days under two schedulers, about 2 s each).

Nothing here asserts: a bench prints.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import _common  # noqa: E402
from bench._common import announce, json_line, pct, private_redis, say, section, settings_for  # noqa: E402

TARGETS = {
    "decision_p99_ms": ("<=", 5.0),
    "fairness_deviation": ("<=", 0.10),
    "fairness_deviation_sweep_day": ("<=", 0.10),
}
POOL = "A100-80GB"


def verdict(name: str, value: float) -> str:
    return _common.verdict(TARGETS, name, value)


async def _store(url: str, prefix: str, simulate: str, **kw: Any) -> Any:
    from redis.asyncio import Redis

    from lease_server.leasing.inventory import parse_simulate, register
    from lease_server.leasing.lease import LeaseStore
    from lease_server.store.engine import Engine

    r = Redis.from_url(url, decode_responses=True)
    st = LeaseStore(Engine(r, settings_for(url, prefix, heartbeat_timeout=30 * 86400, heartbeat_interval=10, **kw)))
    await st.publish_scheduling()
    for inv in parse_simulate(simulate):
        await register(st.engine, inv)
    return st


def _acquire(lid: str, user: str, gpus: int, wait_ms: int) -> Any:
    from lease_server.store.scripts import Acquire

    return Acquire(lid, user, POOL, gpus, 86_400_000, wait_ms)


def _release(lid: str, user: str) -> Any:
    from lease_server.store.scripts import Release

    return Release(lid, "", user, False, "released", "done")


async def decision(url: str, out: dict[str, Any], n_releases: int) -> None:
    from lease_server.store.scripts import Code

    nodes = ",".join(f"n{i:02d}=8x{POOL}" for i in range(16))
    st = await _store(url, "sb:d", nodes)
    users = [f"u{i:03d}" for i in range(100)]
    held = []
    for i in range(128):
        lid = f"l-held-{i:04d}"
        code, _ = await st.engine.raw(_acquire(lid, users[i % 100], 1, 0))
        assert code is Code.OK, code
        held.append((lid, users[i % 100]))
    # Past use differs between users, so the fair-share order is not arrival order.
    for i in range(1000):
        user = users[(i * 37) % 100]
        code, _ = await st.engine.raw(_acquire(f"l-wait-{i:05d}", user, 1, 3_600_000))
        assert code is Code.QUEUED, code
    pings, rels = [], []
    for _ in range(200):
        t0 = time.perf_counter()
        await st.redis.ping()
        pings.append(time.perf_counter() - t0)
    info0 = await st.redis.info("commandstats")
    for lid, user in held[:n_releases] if n_releases <= len(held) else held:
        t0 = time.perf_counter()
        await st.engine.raw(_release(lid, user))
        rels.append(time.perf_counter() - t0)
    # More releases than held GPUs: release the leases granted from the queue, oldest first.
    granted = sorted(k for k in await st.redis.hkeys(st.keys.leases) if k.startswith("l-wait-"))
    for lid in granted[: max(0, n_releases - len(rels))]:
        user = json.loads(await st.redis.hget(st.keys.leases, lid))["user"]
        t0 = time.perf_counter()
        await st.engine.raw(_release(lid, user))
        rels.append(time.perf_counter() - t0)
    info1 = await st.redis.info("commandstats")
    queued_left = await st.redis.zcard(st.keys.queue)
    # Baseline: the same release with nobody waiting.
    empty = await _store(url, "sb:e", nodes)
    base = []
    for i in range(min(200, n_releases)):
        lid = f"l-b-{i:04d}"
        await empty.engine.raw(_acquire(lid, "u000", 1, 0))
        t0 = time.perf_counter()
        await empty.engine.raw(_release(lid, "u000"))
        base.append(time.perf_counter() - t0)
    ev0, ev1 = _common.script_stats(info0), _common.script_stats(info1)
    calls = ev1.get("calls", 0) - ev0.get("calls", 0)
    redis_us = (ev1.get("usec", 0) - ev0.get("usec", 0)) / calls if calls else float("nan")
    p50, p99 = pct(rels, 50) * 1000, pct(rels, 99) * 1000
    say(
        f"[decision] release + dispatch with {1000} queued requests of 100 users, 128 GPUs: p50 {p50:.2f} ms, "
        f"p99 {p99:.2f} ms {verdict('decision_p99_ms', p99)} (n={len(rels)}; Redis {redis_us:.0f} us per script; "
        f"{queued_left} still queued at the end)"
    )
    say(
        f"           baselines: PING p50 {pct(pings, 50) * 1000:.3f} ms; the same release with nobody queued "
        f"p50 {pct(base, 50) * 1000:.3f} ms, p99 {pct(base, 99) * 1000:.3f} ms"
    )
    out.update(
        decision_p99_ms=round(p99, 3),
        decision_p50_ms=round(p50, 3),
        decision_redis_us=round(redis_us, 1),
        ping_p50_ms=round(pct(pings, 50) * 1000, 3),
        release_empty_queue_p50_ms=round(pct(base, 50) * 1000, 3),
        release_empty_queue_p99_ms=round(pct(base, 99) * 1000, 3),
    )
    for s in (st, empty):
        await s.redis.aclose()


Cell = tuple[int, str, int, int]  # (arrival ms from the day's start, user, GPUs, duration ms)
Run = tuple[str, int, int, int | None, int]  # (user, GPUs, asked ms, granted ms or None, ended ms)
DAY_MS = 8 * 3_600_000
WINDOW_MS = 600_000


def generate_day(seed: int, users: int = 24, gpus: int = 16, load: float = 1.6) -> list[Cell]:
    """(arrival ms, user, gpus, duration ms) of one 8-hour working day, sorted by arrival."""
    rng = random.Random(seed)
    horizon = DAY_MS
    median_s, sigma = 600.0, 0.8
    mean_s = median_s * math.exp(sigma**2 / 2)
    weights = [1.0 / (i + 1) ** 0.6 for i in range(users)]  # some people train much more than others
    total_w = sum(weights)
    # Demand rate so that GPU-seconds asked = load x capacity.
    mean_gpus = 1.5
    rate_per_s = load * gpus / (mean_s * mean_gpus)
    cells = []
    for u in range(users):
        lam = rate_per_s * weights[u] / total_w
        t = rng.expovariate(lam)
        while t * 1000 < horizon:
            dur = min(4 * 3600.0, rng.lognormvariate(math.log(median_s), sigma))
            cells.append((int(t * 1000), f"user{u:02d}", rng.choice((1, 2)), int(dur * 1000)))
            t += rng.expovariate(lam)
    cells.sort()
    return cells


def generate_sweep_day(seed: int, trials: int = 64, at_h: float = 1.0) -> list[Cell]:
    """A day of 12 interactive users (as :func:`generate_day`, 1.0x the GPU-time of 16 GPUs) and one
    more, ``sweep``, who submits ``trials`` one-GPU trials at once ``at_h`` hours into the day
    (log-normal durations, median 15 min, sigma 0.5, at most 2 h: about 1.1 h of the whole pool)."""
    cells = generate_day(seed, users=12, load=1.0)
    rng = random.Random(seed + 1)
    for _ in range(trials):
        dur = min(2 * 3600.0, rng.lognormvariate(math.log(900.0), 0.5))
        cells.append((int(at_h * 3_600_000), "sweep", 1, int(dur * 1000)))
    cells.sort()
    return cells


async def replay_day(url: str, prefix: str, cells: list[Cell], scheduler: str) -> list[Run]:
    """Replay through the real scripts under a virtual clock; one run per cell, times in ms from the
    day's start and cut at its end (a cell never granted: granted None, ended at the day's end)."""
    from lease_server.store.scripts import Code

    st = await _store(url, prefix, "a=8xA100-80GB,b=8xA100-80GB", scheduling={POOL: {"scheduler": scheduler}})
    t0 = int(time.time() * 1000)
    horizon = t0 + DAY_MS
    lids = [f"l-c-{i:05d}" for i in range(len(cells))]
    index = {lid: i for i, lid in enumerate(lids)}
    ends: dict[str, int] = {}
    started: dict[str, int] = {}
    i, now = 0, t0
    while True:
        now = min([t0 + cells[i][0]] if i < len(cells) else [horizon])
        now = min([now, *ends.values(), horizon])
        if now >= horizon:
            break
        for lid in [lid for lid, e in ends.items() if e <= now]:
            del ends[lid]
            await st.engine.raw(_release(lid, cells[index[lid]][1]), now_ms=now)
        while i < len(cells) and t0 + cells[i][0] <= now:
            _a, user, g, _d = cells[i]
            code, _ = await st.engine.raw(_acquire(lids[i], user, g, 86_400_000), now_ms=now)
            assert code in (Code.OK, Code.QUEUED), code
            i += 1
        for lid in await st.redis.hkeys(st.keys.leases):
            if lid not in ends:
                ends[lid] = now + cells[index[lid]][3]
                started[lid] = now
    await st.redis.aclose()
    runs: list[Run] = []
    for lid, (arrival, user, g, d) in zip(lids, cells, strict=True):
        s = started.get(lid)
        end = DAY_MS if s is None else min(s - t0 + d, DAY_MS)
        runs.append((user, g, arrival, None if s is None else s - t0, end))
    return runs


def windowed(runs: list[Run]) -> Any:
    """The per-window fairness (lease_server/sim/fairness.py) of a replayed day: demand from each
    cell's arrival to its end, GPU-time received from its grant to its end, 10-minute windows."""
    from lease_server.sim.fairness import windowed_fairness

    demand = [(u, a, e, g) for u, g, a, _s, e in runs]
    received = [(u, s, e, g) for u, g, _a, s, e in runs if s is not None]
    return windowed_fairness(demand, received, 0, DAY_MS, WINDOW_MS)


def whole_day(cells: list[Cell], runs: list[Run]) -> tuple[float, str]:
    """The figure this bench used to report as fairness_deviation: each user's GPU-time within the
    day against the max-min fair share of the GPU-time delivered given each user's whole-day demand
    (all the GPU-time of their cells); the largest relative deviation among users, and that user."""
    from lease_server.sim.fairness import max_min_fair

    demand: dict[str, float] = defaultdict(float)
    got: dict[str, float] = defaultdict(float)
    for (_a, user, g, d), (_u, _g, _asked, s, e) in zip(cells, runs, strict=True):
        demand[user] += g * d / 1000
        if s is not None:
            got[user] += g * (e - s) / 1000
    fair = max_min_fair(demand, sum(got.values()))
    devs = {u: abs(got.get(u, 0.0) - fair[u]) / fair[u] for u in fair if fair[u] > 0}
    worst = max(devs, key=lambda u: devs[u])
    return devs[worst], worst


def wait_p95_min(runs: list[Run], user: str | None = None, not_user: str | None = None) -> float:
    """p95 time to GPU (minutes) of the cells of ``user`` (or of everyone but ``not_user``); a cell
    never granted waited until the day's end."""
    waits = [
        ((s if s is not None else DAY_MS) - a) / 60_000
        for u, _g, a, s, _e in runs
        if (user is None or u == user) and u != not_user
    ]
    return pct(waits, 95)


async def fairness(url: str, out: dict[str, Any], seed: int) -> None:
    capacity = 16 * DAY_MS / 1000
    days = {"": generate_day(seed), "_sweep_day": generate_sweep_day(seed)}
    for day, cells in days.items():
        asked = sum(g * d / 1000 for _a, _u, g, d in cells)
        users = len({u for _a, u, _g, _d in cells})
        what = (
            f"generated day (seed {seed}): {len(cells)} cells of {users} users"
            if not day
            else f"sweep day (seed {seed}): {len(cells) - 64} cells of {users - 1} interactive users and one "
            "sweep of 64 one-GPU trials at 1 h"
        )
        say(
            f"[fairness{day.replace('_', ' ')}] {what}, {asked / capacity:.2f}x the GPU-time of 16 GPUs over 8 h; "
            f"{WINDOW_MS // 60_000}-minute windows"
        )
        for scheduler in ("fair_share", "fifo"):
            t = time.perf_counter()
            runs = await replay_day(url, f"sb:f{day}:{scheduler}", cells, scheduler)
            wf = windowed(runs)
            suffix = day + ("_fifo" if scheduler == "fifo" else "")
            key = "fairness_deviation" + suffix
            dev, locked = wf.deviation, wf.locked_deviation
            worst = max(wf.windows, key=lambda w: w.misallocated)
            by_user = wf.by_user()
            short = min(by_user, key=lambda u: by_user[u][0] - by_user[u][1])
            got, fair = by_user[short]
            old, old_user = whole_day(cells, runs)
            delivered = sum(w.delivered for w in wf.windows) / 1000
            waits = (
                f"wait p95: sweep {wait_p95_min(runs, user='sweep'):.0f} min, others "
                f"{wait_p95_min(runs, not_user='sweep'):.0f} min"
                if day
                else f"wait p95 {wait_p95_min(runs):.0f} min"
            )
            say(
                f"           {scheduler:10s}: per-window deviation {dev:.3f}"
                + (f" {verdict(key, dev)}" if key in TARGETS else "")
                + f", of which {locked:.3f} locked in by grants spanning a whole window; worst window at "
                f"{worst.start / 3_600_000:.1f} h ({worst.deviation:.2f}); most short-changed {short} "
                f"({got / 3_600_000:.1f} GPU-h of a fair {fair / 3_600_000:.1f}); old whole-day figure {old:.3f} "
                f"({old_user}); {waits}; delivered {delivered / capacity:.0%} of capacity; "
                f"replayed in {time.perf_counter() - t:.1f} s"
            )
            out[key] = round(dev, 4)
            out["fairness_locked" + suffix] = round(locked, 4)
            out["fairness_whole_day" + suffix] = round(old, 4)
    out["fairness_seed"] = seed


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer samples")
    ap.add_argument("--seed", type=int, default=7, help="seed of the generated day of work")
    args = _common.parse_args(ap)
    out: dict[str, Any] = {"quick": args.quick or args.smoke}
    t0 = time.monotonic()
    with private_redis("gpulease-sched-bench-") as (redis, _tmp):
        announce(out, "sched bench", args.quick, redis)
        with section(out, "decision"):
            await decision(redis.url, out, 50 if args.smoke else 200 if args.quick else 500)
        with section(out, "fairness"):
            await fairness(redis.url, out, args.seed)
    out["elapsed_s"] = round(time.monotonic() - t0, 1)
    say(json_line(out, first=("decision_p99_ms", "fairness_deviation", "fairness_deviation_sweep_day")))


if __name__ == "__main__":
    asyncio.run(main())
