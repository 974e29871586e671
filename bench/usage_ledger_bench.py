#!/usr/bin/env python
"""GET /usage's read of the ledger at department size: how long it holds the server's event loop.

    nice -n 10 .venv/bin/python bench/usage_ledger_bench.py [--lines 100000] [--smoke]

A redis-server of its own, one real lease's ledger line copied --lines times (300 users: a week of
a department's ledger is up to event_log_max, 100,000 lines). Then the sum per user of them, read
as GET /usage read it until 2026-11-28 (one XRANGE of the range, decoded at once: ``whole``) and
as it reads it now (``usage.summarize_ledger``, 1,000 lines a read: ``sliced``), each beside a
1 ms ticker on the same event loop (the baseline: what any other request would wait).

usage_whole_stall_ms, usage_sliced_stall_ms   the longest gap between two ticks during the read
usage_whole_ms, usage_sliced_ms               (no target) the read and sum, end to end (without
                                              the token's read budget, which the API adds)

Nothing here asserts: a bench prints. The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, for _common (which adds the repo root)

import _common
from _common import json_line, private_redis, say


async def run(url: str, lines: int) -> dict[str, Any]:
    from lease_server.leasing import usage
    from lease_server.leasing.lease import LeaseStore
    from lease_server.request import AcquireRequest
    from lease_server.store.engine import Engine, connect

    r = connect(url)
    store = LeaseStore(Engine(r, _common.settings_for(url, "usage")))
    eng = store.engine
    out: dict[str, Any] = {}
    try:
        await _common.register_all(store, "n0=8xA100-80GB")
        rec = await store.acquire("alice", AcquireRequest(gpus=1))
        await store.release(rec["id"], "alice")
        line = json.loads((await r.xrange(eng.keys.ledger, "-", "+", count=1))[0][1]["data"])
        for i in range(0, lines, 1000):
            async with r.pipeline(transaction=False) as p:
                for j in range(i, min(lines, i + 1000)):
                    p.xadd(eng.keys.ledger, {"data": json.dumps({**line, "user": f"u{j % 300}", "lease": f"l{j}"})})
                await p.execute()
        now = int(time.time() * 1000)
        lo, hi = now - 86_400_000, now + 60_000
        for name in ("whole", "sliced"):
            gaps: list[float] = []
            stop = asyncio.Event()

            async def ticker(gaps: list[float] = gaps, stop: asyncio.Event = stop) -> None:
                last = time.perf_counter()
                while not stop.is_set():
                    await asyncio.sleep(0.001)
                    t = time.perf_counter()
                    gaps.append(t - last)
                    last = t

            tick = asyncio.create_task(ticker())
            await asyncio.sleep(0.01)
            t0 = time.perf_counter()
            if name == "whole":
                rows = usage.summarize(await usage.ledger(eng, lo, hi), "user")
            else:
                rows = (await usage.summarize_ledger(eng, lo, hi, "user")).rows()
            took = time.perf_counter() - t0
            stop.set()
            await tick
            out[f"usage_{name}_stall_ms"] = max(gaps) * 1000
            out[f"usage_{name}_ms"] = took * 1000
            out[f"usage_{name}_rows"] = len(rows)
            say(f"  {name:6s}: {took * 1000:6.0f} ms for {lines} lines, longest loop stall {max(gaps) * 1000:.0f} ms")
    finally:
        await store.close()
        await r.aclose()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lines", type=int, default=100_000)
    args = _common.parse_args(ap, lines=2000)
    with private_redis("usage-ledger-bench-") as (redis, _tmp):
        out = asyncio.run(run(redis.url, args.lines))
    print(json_line(out, digits=4), flush=True)


if __name__ == "__main__":
    main()
