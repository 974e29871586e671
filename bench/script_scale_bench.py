#!/usr/bin/env python
"""What a grant's, a release's and a recall's scripts cost in Redis at 10,000 GPUs against 16, alone
(issue 37).

    nice -n 10 .venv/bin/python bench/script_scale_bench.py [--pairs 2000] [--nodes 1250] [--smoke]

``scale_bench.py`` measures the scripts inside a whole deployment's traffic (HTTP, agents, the load
generator) on the same cores, where single runs move by 1.3-1.8x. This bench measures the scripts
alone: two redis-servers of its own, one with 2 nodes and one with --nodes nodes (8 GPUs each, one
pool), each with 7 GPUs per node leased in 1-GPU leases of 500 users (best fit packs them: 7 of
every 8 nodes full, the rest empty); then acquire (1 GPU, at once) + release pairs through the
server's own script calls (``Engine.run``), one at a time, in blocks of 100 that alternate between
the two sizes, so that whatever the machine does meanwhile falls on both alike. Redis's time per
call comes from its slow log at threshold 0 (per call, by function). Then the same with a tenth of
the leases warm (a pool with warm leases chooses among 16 best-fit candidates and their warm GPUs,
where a pool of 2 nodes has 2). Then the recall: each pool filled to its last GPU, a tenth of the
leases warm, and rounds of a 1-GPU request that waits, which no free GPU can serve: its acquire
recalls (evicts, with notice) a warm lease. Each round then puts the pool back as it was (the
request withdrawn, the recalled lease released, a new warm lease on its GPU), so every round's
recall chooses from the same pool.

script_acquire_ratio, script_release_ratio   median Redis us per acquire / per release at --nodes
                     over at 2 nodes                                         (target <= 1.2 each)
script_acquire_ratio_warm, script_release_ratio_warm   the same with warm leases in the pool
                                                                             (target <= 1.2 each)
script_recall_ratio  median Redis us per acquire that recalls a warm lease at --nodes over at 2 nodes
                                                                             (target <= 1.5)
script_us            (no target) the medians, {variant: {script: [2 nodes, --nodes]}}

Nothing here asserts: a bench prints. The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, for _common (which adds the repo root)

import _common
from _common import json_line, private_redis, register_all, say

TARGETS = {
    "script_acquire_ratio": ("<=", 1.2),
    "script_release_ratio": ("<=", 1.2),
    "script_acquire_ratio_warm": ("<=", 1.2),
    "script_release_ratio_warm": ("<=", 1.2),
    "script_recall_ratio": ("<=", 1.5),
}
BLOCK = 100
USERS = 500


class Size:
    """One redis-server with ``nodes`` nodes, filled, and its engine."""

    def __init__(self, url: str, nodes: int) -> None:
        self.url, self.nodes = url, nodes
        self.us: dict[str, list[float]] = {"acquire": [], "release": [], "recall": []}
        self.count = 0

    async def prepare(self, warm: bool, full: bool = False) -> None:
        """7 GPUs per node leased (``full``: all 8), a tenth of the leases warm if ``warm``."""
        from lease_server.leasing.lease import LeaseStore
        from lease_server.store.engine import Engine, connect
        from lease_server.store.scripts import Acquire, Warm

        self.r = connect(self.url)
        self.store = LeaseStore(Engine(self.r, _common.settings_for(self.url, "scripts")))
        self.engine = self.store.engine
        await register_all(self.store, ",".join(f"n{i:05d}=8xA100-80GB" for i in range(self.nodes)))
        self.pool = await self.store.default_pool()
        for i in range(self.nodes * (8 if full else 7)):
            await self.engine.run(Acquire(f"fill-{i}", f"u{i % USERS:03d}", self.pool, 1, 3_600_000, 0))
            if warm and i % 10 == 0:
                await self.engine.run(Warm(f"fill-{i}", "", f"u{i % USERS:03d}", True))
        await self.r.execute_command("CONFIG", "SET", "slowlog-max-len", "10000")
        if not full:
            await self.block(BLOCK, keep=False)  # warm-up

    async def recall_block(self, n: int, keep: bool = True) -> None:
        """n rounds of an acquire that recalls a warm lease; each round leaves the pool as it found it."""
        from lease_server.store.scripts import Acquire, Queued, Release, Warm

        for _ in range(n):
            self.count += 1
            lid, user = f"recall-{self.count}", f"u{self.count % USERS:03d}"
            await self.r.execute_command("CONFIG", "SET", "slowlog-log-slower-than", "0")
            await self.r.execute_command("SLOWLOG", "RESET")
            got = await self.engine.run(Acquire(lid, user, self.pool, 1, 600_000, 60_000))
            log = await self.r.slowlog_get(128)
            await self.r.execute_command("CONFIG", "SET", "slowlog-log-slower-than", "10000")
            recalled = await self.r.zrange(self.store.keys.recall, 0, -1)
            if not isinstance(got, Queued) or len(recalled) != 1:
                raise RuntimeError(f"the request was to wait and recall one warm lease: {got}, recalled {recalled}")
            await self.engine.run(Release(lid, "", user, False, "released", "withdrawn", "", "", True))
            victim = json.loads(await self.r.hget(self.store.keys.leases, recalled[0]))
            await self.engine.run(Release(victim["id"], "", victim["user"], False, "released", "evicted", "", "", True))
            fresh = f"refill-{self.count}"
            await self.engine.run(Acquire(fresh, victim["user"], self.pool, 1, 3_600_000, 0))
            await self.engine.run(Warm(fresh, "", victim["user"], True))
            if keep:
                for e in log:
                    cmd = e["command"] if isinstance(e["command"], str) else e["command"].decode()
                    parts = cmd.split(" ", 2)
                    if parts[0] == "FCALL" and parts[1].endswith("_acquire"):
                        self.us["recall"].append(float(e["duration"]))

    async def block(self, n: int, keep: bool = True) -> None:
        from lease_server.store.scripts import Acquire, Release

        await self.r.execute_command("CONFIG", "SET", "slowlog-log-slower-than", "0")
        await self.r.execute_command("SLOWLOG", "RESET")
        for _ in range(n):
            self.count += 1
            lid, user = f"pair-{self.count}", f"u{self.count % USERS:03d}"
            await self.engine.run(Acquire(lid, user, self.pool, 1, 600_000, 0))
            await self.engine.run(Release(lid, "", user, False, "released", "released by its owner", "", "", True))
        got = await self.r.slowlog_get(10000)
        await self.r.execute_command("CONFIG", "SET", "slowlog-log-slower-than", "10000")
        if not keep:
            return
        for e in got:
            cmd = e["command"] if isinstance(e["command"], str) else e["command"].decode()
            parts = cmd.split(" ", 2)
            if parts[0] == "FCALL" and parts[1].endswith(("_acquire", "_release")):
                self.us["acquire" if parts[1].endswith("_acquire") else "release"].append(float(e["duration"]))

    async def close(self) -> None:
        await self.store.close()
        await self.r.aclose()


async def variant(small_url: str, big_url: str, nodes: int, pairs: int, warm: bool) -> dict[str, list[float]]:
    small, big = Size(small_url, 2), Size(big_url, nodes)
    try:
        await small.prepare(warm)
        await big.prepare(warm)
        for _ in range(max(1, pairs // BLOCK)):
            await small.block(BLOCK)
            await big.block(BLOCK)
        return {s: [statistics.median(small.us[s]), statistics.median(big.us[s])] for s in ("acquire", "release")}
    finally:
        await small.close()
        await big.close()


async def recall_variant(small_url: str, big_url: str, nodes: int, rounds: int) -> list[float]:
    small, big = Size(small_url, 2), Size(big_url, nodes)
    try:
        await small.prepare(True, full=True)
        await big.prepare(True, full=True)
        await small.recall_block(BLOCK // 4, keep=False)  # warm-up
        await big.recall_block(BLOCK // 4, keep=False)
        for _ in range(max(1, rounds // BLOCK)):
            await small.recall_block(BLOCK)
            await big.recall_block(BLOCK)
        return [statistics.median(small.us["recall"]), statistics.median(big.us["recall"])]
    finally:
        await small.close()
        await big.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=2000)
    ap.add_argument("--nodes", type=int, default=1250, help="the large pool's nodes (8 GPUs each)")
    args = _common.parse_args(ap, pairs=100, nodes=20)
    out: dict[str, Any] = {"script_us": {}}
    for warm in (False, True):
        name = "warm" if warm else "plain"
        with private_redis("script-scale-small-") as (r_small, _), private_redis("script-scale-big-") as (r_big, _):
            us = asyncio.run(variant(r_small.url, r_big.url, args.nodes, args.pairs, warm))
        out["script_us"][name] = us
        for script in ("acquire", "release"):
            k = f"script_{script}_ratio" + ("_warm" if warm else "")
            out[k] = us[script][1] / us[script][0]
            say(
                f"  {name:5s} {script:7s} Redis {us[script][0]:6.1f} us at 2 nodes, {us[script][1]:6.1f} us at "
                f"{args.nodes} nodes: {k} {out[k]:.2f}  {_common.verdict(TARGETS, k, out[k])}"
            )
    with private_redis("script-scale-small-") as (r_small, _), private_redis("script-scale-big-") as (r_big, _):
        us = asyncio.run(recall_variant(r_small.url, r_big.url, args.nodes, max(BLOCK, args.pairs // 4)))
    out["script_us"]["recall"] = {"acquire": us}
    out["script_recall_ratio"] = us[1] / us[0]
    say(
        f"  recall  acquire Redis {us[0]:6.1f} us at 2 nodes, {us[1]:6.1f} us at {args.nodes} nodes: "
        f"script_recall_ratio {out['script_recall_ratio']:.2f}  "
        f"{_common.verdict(TARGETS, 'script_recall_ratio', out['script_recall_ratio'])}"
    )
    print(json_line(out, first=TARGETS, digits=4), flush=True)


if __name__ == "__main__":
    main()
