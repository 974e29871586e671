#!/usr/bin/env python
"""The event stream's fan-out: what one event costs the lease server with 3,000 followers (issue 37).

    nice -n 10 .venv/bin/python bench/fanout_bench.py [--followers 3000] [--pairs 40] [--smoke]

A real redis-server and lease server (2 worker processes, as scale_bench.py starts them). Every
follower is a ``GET /api/v1/events`` stream, as a JupyterLab's board and status bar keep one open:
they are spread over 100 users (30 each, within ``max_streams_per_user``) and over the server's
workers by the kernel. Then one user makes ``--pairs`` acquire + release pairs, one at a time, ``--gap-ms``
(50) ms apart; each pair is two events (``grant``, ``released``). Three phases in one run:

base     one follower of every event (the baseline);
every    all the followers read every event (what each Lab's board read until it asked for changes);
changes  all the followers read a stream of changes (``?changes=true``, what the board reads now):
         one ``changed`` for many events, at most one every 0.5 s.

fanout_delivery_p50_ms, fanout_delivery_p99_ms   (every) from the event's time in Redis to its
                        arrival at a follower, over every (event, follower)
fanout_server_cpu_us_per_delivery   (every) the lease server's CPU (both workers: /proc utime +
                        stime) per event delivered to one follower
fanout_server_cpu_ms_per_event      (every) the same per event, all its followers together
fanout_delivered        (every) the (event, follower) arrivals counted; expected: 2 x pairs x followers
changes_server_cpu_ms_per_event     (changes) the server's CPU per event, all followers together
changes_per_follower    (changes) the `changed` events each follower got for the 2 x pairs events
changes_delay_p50_ms, changes_delay_p99_ms   (changes) from the time in Redis of the newest event a
                        `changed` stands for to its arrival at a follower
changes_cpu_ratio       every / changes, server CPU per event

Nothing here asserts: a bench prints. The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, for _common (which adds the repo root)

import _common
from _common import pct, say

API = "/api/v1"
USERS = 100


def cpu_s(pid: int) -> float:
    """A process's CPU time and its children's that it waited for, plus its live children's
    (the server's forked workers), in seconds."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for p in [pid, *_children(pid)]:
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            continue
    return total


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


async def follow(url: str, token: str, marks: dict[str, float], arrivals: list[float], ready: asyncio.Event,
                 opened: list[int], need: int, changes: bool, newest: list[float]) -> None:  # fmt: skip
    """One follower: read the stream; for each grant/released of a marked lease, the delay (ms)
    from the event's time in Redis to now; for each `changed`, the delay from its newest event's
    time (and that time, in newest[0])."""
    import httpx

    headers = {"Authorization": f"Bearer {token}"}
    params = {"changes": "true"} if changes else None
    async with (
        httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=60.0)) as h,
        h.stream("GET", f"{url}{API}/events", headers=headers, params=params) as resp,
    ):
        resp.raise_for_status()
        opened[0] += 1
        if opened[0] >= need:
            ready.set()
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            ev = json.loads(line[5:])
            if ev.get("type") in ("grant", "released") and ev.get("lease") in marks:
                arrivals.append(time.time() * 1000 - ev["ts"] * 1000)
            elif ev.get("type") == "changed" and marks:
                arrivals.append(time.time() * 1000 - ev["ts"] * 1000)
                newest[0] = max(newest[0], ev["ts"])


async def phase(
    url: str,
    tokens: dict[str, str],
    followers: int,
    pairs: int,
    server_pid: int,
    changes: bool = False,
    gap_s: float = 0.05,
) -> dict[str, Any]:
    marks: dict[str, float] = {}
    arrivals: list[float] = []
    ready, opened = asyncio.Event(), [0]
    users = [f"u{i:03d}" for i in range(USERS)]
    newest = [[0.0] for _ in range(followers)]
    tasks = [
        asyncio.create_task(
            follow(url, tokens[users[i % USERS]], marks, arrivals, ready, opened, followers, changes, newest[i])
        )
        for i in range(followers)
    ]
    await asyncio.wait_for(ready.wait(), 300)
    await asyncio.sleep(1.0)  # (the streams' greetings and backlogs read before the clock starts)
    from lease_server.client import Client

    c = Client(url, tokens["worker"])
    cpu0, t0 = cpu_s(server_pid), time.perf_counter()
    try:
        last = 0.0
        for _ in range(pairs):
            rid = c.new_request_id()
            marks[rid] = time.time()
            lease = await asyncio.to_thread(c.acquire, 1, None, None, 0, "fanout", "", None, request_id=rid)
            last = time.time()  # (the release's event comes after this)
            await asyncio.to_thread(c.release, lease)
            await asyncio.sleep(gap_s)
        want = 2 * pairs * followers
        deadline = time.monotonic() + 120

        def done() -> bool:
            if changes:  # every follower has a `changed` that stands for the last release
                return all(n[0] >= last for n in newest)
            return len(arrivals) >= want

        while not done() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # (the followers' reads: counted, nothing to wait on)
    finally:
        c.close()
    cpu = cpu_s(server_pid) - cpu0
    wall = time.perf_counter() - t0
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    events = 2 * pairs
    delivered = len(arrivals)
    return {
        "followers": followers,
        "delivered": delivered,
        "expected": 2 * pairs * followers,
        "delivery_p50_ms": round(pct(arrivals, 50), 1) if arrivals else None,
        "delivery_p99_ms": round(pct(arrivals, 99), 1) if arrivals else None,
        "server_cpu_s": round(cpu, 3),
        "server_cpu_ms_per_event": round(1000 * cpu / events, 2),
        "server_cpu_us_per_delivery": round(1e6 * cpu / max(1, delivered), 1),
        "wall_s": round(wall, 2),
        "events_per_s": round(events / wall, 1),
        "server_cpu_per_s": round(cpu / wall, 2),
        "per_follower": round(delivered / followers, 2),
        "all_current": all(n[0] >= last for n in newest) if changes else delivered >= 2 * pairs * followers,
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    from lease_bench import ServerProcess

    from lease_server.leasing.inventory import parse_simulate

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # 3,000 streams: a file each, here and there
    out: dict[str, Any] = {}
    with _common.private_redis("gpulease-fanout-") as (redis, tmp):
        prefix = "fanout"
        roles = {"worker": "user", "agent-n1": "agent", **{f"u{i:03d}": "user" for i in range(USERS)}}
        tokens = await _common.make_tokens(redis.url, prefix, roles)
        server = ServerProcess(
            redis.url, prefix, 2, tmp, env={"GPULEASE_MAX_CONNECTIONS": str(args.followers * 2 + 100)}
        ).start()
        try:
            from lease_server.client import Client

            agent = Client(server.url, tokens["agent-n1"])
            agent.request("PUT", f"{API}/nodes/n1", json=json.loads(parse_simulate("n1=8xA100-80GB")[0].to_json()))
            beat = asyncio.create_task(_heartbeats(agent))
            assert server.proc is not None
            for name, n, changes in (("base", 1, False), ("fanout", args.followers, False),
                                     ("changes", args.followers, True)):  # fmt: skip
                got = await phase(server.url, tokens, n, args.pairs, server.proc.pid, changes, args.gap_ms / 1000)
                what = "`changed` events" if changes else "deliveries"
                say(
                    f"{name}: {n} follower(s): {got['delivered']} {what} ({got['per_follower']} each) for "
                    f"{2 * args.pairs} events; delay p50 {got['delivery_p50_ms']} ms, p99 {got['delivery_p99_ms']} ms; "
                    f"server CPU {got['server_cpu_ms_per_event']} ms an event ({got['events_per_s']} events/s, "
                    f"{got['server_cpu_per_s']} s of CPU a second); all current: {got['all_current']}"
                )
                out[name] = got
            beat.cancel()
            agent.close()
        finally:
            server.stop()
    f = out["fanout"]
    return {
        "fanout_followers": f["followers"],
        "fanout_delivered": f["delivered"],
        "fanout_expected": f["expected"],
        "fanout_delivery_p50_ms": f["delivery_p50_ms"],
        "fanout_delivery_p99_ms": f["delivery_p99_ms"],
        "fanout_server_cpu_ms_per_event": f["server_cpu_ms_per_event"],
        "fanout_server_cpu_us_per_delivery": f["server_cpu_us_per_delivery"],
        "base_delivery_p99_ms": out["base"]["delivery_p99_ms"],
        "base_server_cpu_ms_per_event": out["base"]["server_cpu_ms_per_event"],
        "changes_server_cpu_ms_per_event": out["changes"]["server_cpu_ms_per_event"],
        "changes_per_follower": out["changes"]["per_follower"],
        "changes_delay_p50_ms": out["changes"]["delivery_p50_ms"],
        "changes_delay_p99_ms": out["changes"]["delivery_p99_ms"],
        "changes_all_current": out["changes"]["all_current"],
        "changes_cpu_ratio": round(
            f["server_cpu_ms_per_event"] / max(1e-9, out["changes"]["server_cpu_ms_per_event"]), 1
        ),
    }


async def _heartbeats(agent: Any) -> None:
    while True:
        await asyncio.to_thread(agent.request, "POST", f"{API}/nodes/n1/heartbeat")
        await asyncio.sleep(2.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--followers", type=int, default=3000)
    ap.add_argument("--pairs", type=int, default=40)
    ap.add_argument("--gap-ms", type=float, default=50.0, help="pause between two pairs (ms)")
    args = _common.parse_args(ap, followers=20, pairs=3, gap_ms=0.0)
    print(_common.json_line(asyncio.run(main_async(args))))


if __name__ == "__main__":
    main()
