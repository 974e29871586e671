#!/usr/bin/env python
"""A grant while a booking is in force, in a pool of 1,250 nodes against one of 2 (issue 37).

    nice -n 10 .venv/bin/python bench/booking_bench.py [--pairs 400] [--nodes 1250] [--smoke]

For each size it declares the nodes (8 GPUs each, one pool) straight into its own redis-server, books
4 GPUs of the pool from a minute ago to an hour ahead (in force: every grant in the pool must leave
them free), then makes --pairs acquire (1 GPU, at once) + release pairs through LeaseStore, the
server's own Python path, one at a time. Redis time per script call comes from ``INFO
commandstats`` (FCALL/EVALSHA), reset after the setup.

booked_grant_ratio   Redis us per script call (acquire and release) at --nodes / at 2 nodes
                     (target <= 1.2: a grant must not walk the pool's nodes)
booked_grant_us      (no target) those figures, [2 nodes, --nodes]

Nothing here asserts: a bench prints. The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, for _common (which adds the repo root)

import _common
from _common import json_line, private_redis, register_all, say, script_stats

TARGETS = {"booked_grant_ratio": ("<=", 1.2)}


async def one_size(url: str, nodes: int, pairs: int) -> dict[str, Any]:
    from lease_server.config import Settings
    from lease_server.leasing.bookings import Bookings
    from lease_server.leasing.lease import LeaseStore
    from lease_server.request import AcquireRequest
    from lease_server.store.engine import Engine, connect

    settings = Settings(redis_url=url, prefix="booked")
    r = connect(url)
    engine = Engine(r, settings)
    store = LeaseStore(engine)
    try:
        await register_all(store, ",".join(f"n{i:05d}=8xA100-80GB" for i in range(nodes)))
        await store.start()
        now = time.time()
        await Bookings(engine).create("booker", {"pool": "A100-80GB", "gpus": 4, "start": now - 60, "end": now + 3600})
        await r.config_resetstat()
        t0 = time.perf_counter()
        for i in range(pairs):
            lease = await store.acquire(f"u{i % 50:02d}", AcquireRequest(gpus=1, ttl=600))
            await store.release(lease["id"], lease["user"], token=lease["token"])
        wall_ms = (time.perf_counter() - t0) / pairs * 1000
        stats = script_stats(await r.info("commandstats"))
        return {"us_per_call": stats["usec_per_call"], "pair_ms": wall_ms, "calls": stats["calls"]}
    finally:
        await store.close()
        await r.aclose()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=400)
    ap.add_argument("--nodes", type=int, default=1250, help="the large pool's nodes (8 GPUs each)")
    args = _common.parse_args(ap, pairs=20, nodes=20)
    out: dict[str, Any] = {}
    figs: dict[int, dict[str, Any]] = {}
    for nodes in (2, args.nodes):
        with private_redis(f"booking-bench-{nodes}-") as (redis, _tmp):
            figs[nodes] = asyncio.run(one_size(redis.url, nodes, args.pairs))
        f = figs[nodes]
        say(f"  {nodes:5d} nodes: Redis {f['us_per_call']:6.0f} us per script call, {f['pair_ms']:.2f} ms per pair")
    small, big = figs[2], figs[args.nodes]
    out["booked_grant_ratio"] = big["us_per_call"] / small["us_per_call"]
    out["booked_grant_us"] = [small["us_per_call"], big["us_per_call"]]
    out["pair_ms"] = [small["pair_ms"], big["pair_ms"]]
    k = "booked_grant_ratio"
    say(f"  {k} {out[k]:.2f}  {_common.verdict(TARGETS, k, out[k])}")
    print(json_line(out, first=TARGETS, digits=4), flush=True)


if __name__ == "__main__":
    main()
