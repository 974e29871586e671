#!/usr/bin/env python
"""What one /metrics page costs: time and Redis commands per render, with the usage series.

    nice -n 10 .venv/bin/python bench/metrics_bench.py [--gpus 64] [--users 50] [--ended 400] [--renders 50] [--smoke]

Starts its own redis-server and a lease server with ``--gpus`` simulated GPUs (nodes of 8), lets
``--users`` users end ``--ended`` leases (rollup rows of this hour) and then hold every GPU (one
lease a GPU), stops the server (its leases stay in Redis; no sweeper or agent writes any more) and
renders the page ``--renders`` times in this process through the server's own ``Metrics``, the
Redis commands counted by INFO commandstats (reset just before). Prints one line a figure and, last,
one JSON object: render_ms_p50 (the whole page), usage_ms_p50 (the usage series' share: counters,
gauges, the top users), commands_per_render, rollup_rows_per_render and the series on the page.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402  (puts the repository root on sys.path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=64)
    ap.add_argument("--users", type=int, default=50)
    ap.add_argument("--ended", type=int, default=400)
    ap.add_argument("--renders", type=int, default=50)
    args = _common.parse_args(ap, gpus=8, users=4, ended=10, renders=3)

    from redis import Redis
    from redis.asyncio import Redis as AsyncRedis

    from lease_server.leasing.board import cluster_view
    from lease_server.leasing.queue import queue_view
    from lease_server.node.redis_proc import RedisProcess
    from lease_server.store.engine import Engine
    from lease_server.web.metrics import Metrics
    from tests.conftest import ServerHandle, make_settings

    nodes = ",".join(f"n{i}=8xA100-80GB" for i in range(max(1, args.gpus // 8)))
    with tempfile.TemporaryDirectory() as tmp:
        redis = RedisProcess(Path(tmp)).start()
        try:
            settings = make_settings(redis.url, "bench", metrics_cache_s=0.01)
            server = ServerHandle(settings, nodes).start()
            users = [f"user{i:02d}" for i in range(args.users)]
            clients = [server.client(u) for u in users]
            for k in range(args.ended):
                c = clients[k % len(clients)]
                c.release(c.acquire(1, ttl=600), verified=True)
            for k in range(args.gpus):
                clients[k % len(clients)].acquire(1, ttl=3600)
            server.stop()
            sync = Redis.from_url(redis.url, decode_responses=True)

            async def measure() -> dict[str, float]:
                r = AsyncRedis.from_url(redis.url, decode_responses=True)
                try:
                    metrics = Metrics(Engine(r, settings), top_users=settings.metrics_top_users)
                    page = await metrics.render()  # the first page: the counters start, 22 hours read
                    first_rows = metrics.usage.rows_read
                    sync.config_resetstat()
                    totals, usage_ms = [], []
                    orig = metrics.usage_families

                    async def timed(*a: object) -> object:
                        t = time.perf_counter()
                        try:
                            return await orig(*a)  # type: ignore[arg-type]
                        finally:
                            usage_ms.append((time.perf_counter() - t) * 1000)

                    metrics.usage_families = timed  # type: ignore[method-assign,assignment]
                    rows0 = metrics.usage.rows_read
                    for _ in range(args.renders):
                        t = time.perf_counter()
                        page = await metrics.render()
                        totals.append((time.perf_counter() - t) * 1000)
                    stats = sync.info("commandstats")
                    rows_per_render = (metrics.usage.rows_read - rows0) / args.renders
                    commands = sum(v["calls"] for k, v in stats.items() if k not in ("cmdstat_config", "cmdstat_info"))
                    series = [ln for ln in page.decode().splitlines() if ln and not ln.startswith("#")]
                    # the usage series alone: their Redis commands (the cluster and queue read once before)
                    view = await cluster_view(metrics.engine)
                    waiting = await queue_view(r, metrics.engine.keys)
                    sync.config_resetstat()
                    for _ in range(args.renders):
                        await orig(view, waiting)
                    alone = sync.info("commandstats")
                    usage_commands = sum(
                        v["calls"] for k, v in alone.items() if k not in ("cmdstat_config", "cmdstat_info")
                    )
                    return {
                        "gpus": args.gpus,
                        "users": args.users,
                        "ended_leases": args.ended,
                        "render_ms_p50": round(_common.pct(totals, 50), 2),
                        "render_ms_p99": round(_common.pct(totals, 99), 2),
                        "usage_ms_p50": round(_common.pct(usage_ms, 50), 2),
                        "commands_per_render": round(commands / args.renders, 1),
                        "usage_commands_per_render": round(usage_commands / args.renders, 1),
                        "commands": {k.removeprefix("cmdstat_"): v["calls"] // args.renders for k, v in stats.items()},
                        "rollup_rows_per_render": rows_per_render,
                        "rollup_rows_first_render": first_rows,
                        "series": len(series),
                        "page_bytes": len(page),
                    }
                finally:
                    await r.aclose()

            out = asyncio.run(measure())
            sync.close()
        finally:
            redis.stop()
    for k, v in out.items():
        _common.say(f"{k:26} {v}")
    _common.say(json.dumps(out))


if __name__ == "__main__":
    main()
