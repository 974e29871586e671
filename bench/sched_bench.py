#!/usr/bin/env python
"""Performance figures of the scheduler (issue 6, Bench section).

    .venv/bin/python bench/sched_bench.py [--quick] [--seed N]

Starts its own redis-server, drives the real Lua scripts through LeaseStore.run (the path the HTTP
API takes, minus HTTP), prints one line per figure and, as the very last line, one JSON object:

decision_p99_ms      1,000 requests of 100 users queued for a full 128-GPU pool (16 nodes x 8); each
                     release of a held GPU runs dispatch, which orders the queue by fair share and
                     grants the next waiter. p99 of that release's round trip (the scheduling
                     decision and the grant, in one script), over 500 releases. Baselines measured in
                     the same run: PING, and the same release with nobody queued. (target <= 5 ms)
fairness_deviation   a generated day of notebook work (seeded: 24 users, cells arriving as a Poisson
                     process with log-normal durations, median 10 min, 1 or 2 GPUs) on 16 GPUs,
                     1.6x over-subscribed, replayed through the fair_share scheduler under a virtual
                     clock. Each user's GPU-time against the max-min fair share of the GPU-time
                     delivered given each user's demand (water-filling): the largest relative
                     deviation among users. Printed with the seed; the same for fifo, for reference.

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

TARGETS = {"decision_p99_ms": ("<=", 5.0)}
POOL = "A100-80GB"


def verdict(name: str, value: float) -> str:
    return _common.verdict(TARGETS, name, value)


async def _store(url: str, prefix: str, simulate: str, **kw: Any) -> Any:
    from redis.asyncio import Redis

    from lease_server.engine import Engine
    from lease_server.inventory import parse_simulate, register
    from lease_server.lease import LeaseStore

    r = Redis.from_url(url, decode_responses=True)
    st = LeaseStore(Engine(r, settings_for(url, prefix, heartbeat_timeout=30 * 86400, heartbeat_interval=10, **kw)))
    await st.publish_scheduling()
    for inv in parse_simulate(simulate):
        await register(st.engine, inv)
    return st


def _acquire(lid: str, user: str, gpus: int, wait_ms: int) -> Any:
    from lease_server.scripts import Acquire

    return Acquire(lid, user, POOL, gpus, 86_400_000, wait_ms)


def _release(lid: str, user: str) -> Any:
    from lease_server.scripts import Release

    return Release(lid, "", user, False, "released", "done")


async def decision(url: str, out: dict[str, Any], quick: bool) -> None:
    from lease_server.scripts import Code

    n_releases = 200 if quick else 500
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
    ev0, ev1 = info0.get("cmdstat_evalsha", {}), info1.get("cmdstat_evalsha", {})
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


def generate_day(seed: int, users: int = 24, gpus: int = 16, load: float = 1.6) -> list[tuple[int, str, int, int]]:
    """(arrival ms, user, gpus, duration ms) of one 8-hour working day, sorted by arrival."""
    rng = random.Random(seed)
    horizon = 8 * 3_600_000
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


def max_min_fair(demand: dict[str, float], capacity: float) -> dict[str, float]:
    """Water-filling: every user gets min(demand, level), the level set so the shares sum to capacity."""
    share: dict[str, float] = {}
    left, users = capacity, sorted(demand, key=lambda u: demand[u])
    while users:
        level = left / len(users)
        u = users[0]
        if demand[u] <= level:
            share[u] = demand[u]
            left -= demand[u]
            users.pop(0)
        else:
            for v in users:
                share[v] = level
            break
    return share


async def replay_day(url: str, prefix: str, cells: list[tuple[int, str, int, int]], scheduler: str) -> dict[str, float]:
    """Replay through the real scripts under a virtual clock; GPU-seconds per user within the day."""
    from lease_server.scripts import Code

    st = await _store(url, prefix, "a=8xA100-80GB,b=8xA100-80GB", scheduling={POOL: {"scheduler": scheduler}})
    t0 = int(time.time() * 1000)
    horizon = t0 + 8 * 3_600_000
    dur = {f"l-c-{i:05d}": d for i, (_a, _u, _g, d) in enumerate(cells)}
    user_of = {f"l-c-{i:05d}": u for i, (_a, u, _g, _d) in enumerate(cells)}
    ends: dict[str, int] = {}
    started: dict[str, int] = {}
    i, now = 0, t0
    while True:
        nxt = min([t0 + cells[i][0]] if i < len(cells) else [] + [], default=horizon)
        nxt = min([nxt, *ends.values(), horizon])
        now = nxt
        if now >= horizon:
            break
        for lid in [lid for lid, e in ends.items() if e <= now]:
            del ends[lid]
            await st.engine.raw(_release(lid, user_of[lid]), now_ms=now)
        while i < len(cells) and t0 + cells[i][0] <= now:
            _a, user, g, _d = cells[i]
            code, _ = await st.engine.raw(_acquire(f"l-c-{i:05d}", user, g, 86_400_000), now_ms=now)
            assert code in (Code.OK, Code.QUEUED), code
            i += 1
        for lid in await st.redis.hkeys(st.keys.leases):
            if lid not in ends:
                ends[lid] = now + dur[lid]
                started[lid] = now
    got: dict[str, float] = defaultdict(float)
    for lid, s in started.items():
        end = min(s + dur[lid], horizon)
        gpus = cells[int(lid.rsplit("-", 1)[1])][2]
        got[user_of[lid]] += (end - s) / 1000 * gpus
    await st.redis.aclose()
    return got


async def fairness(url: str, out: dict[str, Any], seed: int) -> None:
    cells = generate_day(seed)
    demand: dict[str, float] = defaultdict(float)
    for _a, user, g, d in cells:
        demand[user] += g * d / 1000
    capacity = 16 * 8 * 3600.0
    say(
        f"[fairness] generated day (seed {seed}): {len(cells)} cells of {len(demand)} users, "
        f"{sum(demand.values()) / capacity:.2f}x the GPU-time of 16 GPUs over 8 h"
    )
    for scheduler in ("fair_share", "fifo"):
        t = time.perf_counter()
        got = await replay_day(url, f"sb:f:{scheduler}", cells, scheduler)
        delivered = sum(got.values())
        fair = max_min_fair({u: demand[u] for u in demand}, delivered)
        devs = {u: abs(got.get(u, 0.0) - fair[u]) / fair[u] for u in fair if fair[u] > 0}
        worst = max(devs, key=lambda u: devs[u])
        mean_dev = sum(devs.values()) / len(devs)
        say(
            f"           {scheduler:10s}: largest deviation from the max-min fair share {devs[worst]:.1%} ({worst}: "
            f"{got.get(worst, 0) / 3600:.1f} GPU-h for a fair {fair[worst] / 3600:.1f}), mean {mean_dev:.1%}; "
            f"GPU-time delivered {delivered / capacity:.0%} of capacity; replayed in {time.perf_counter() - t:.1f} s"
        )
        if scheduler == "fair_share":
            out.update(fairness_deviation=round(devs[worst], 4), fairness_mean_deviation=round(mean_dev, 4))
        else:
            out.update(fifo_fairness_deviation=round(devs[worst], 4), fifo_mean_deviation=round(mean_dev, 4))
    out["fairness_seed"] = seed


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer samples")
    ap.add_argument("--seed", type=int, default=7, help="seed of the generated day of work")
    args = ap.parse_args()
    out: dict[str, Any] = {"quick": args.quick}
    t0 = time.monotonic()
    with private_redis("gpulease-sched-bench-") as (redis, _tmp):
        announce(out, "sched bench", args.quick, redis)
        with section(out, "decision"):
            await decision(redis.url, out, args.quick)
        with section(out, "fairness"):
            await fairness(redis.url, out, args.seed)
    out["elapsed_s"] = round(time.monotonic() - t0, 1)
    say(json_line(out, first=("decision_p99_ms", "fairness_deviation")))


if __name__ == "__main__":
    asyncio.run(main())
