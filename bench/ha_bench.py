#!/usr/bin/env python
"""Redis failover figures: a primary, a replica and three sentinels on loopback (tests/ha.py),
the lease server on ``redis+sentinel://``.

    .venv/bin/python bench/ha_bench.py [--quick | --smoke]

Prints one line per figure and, as the very last line of stdout, one JSON object:

failover_unavailable_s  from the SIGKILL of the primary to the first grant acknowledged for a request
                        sent after it, with replicas_ack = 1, median of the failovers of the run
                        (target <= 10 s) with the Sentinel settings of docs/deploy.md:
                        down-after-milliseconds 1000, failover-timeout 5000, parallel-syncs 1
double_grants           GPUs held by two clients at once, over that whole run (target 0)
token_reuse             fencing tokens seen twice, or going backwards along a GPU's holders (target 0)
lost_grants             grants acknowledged before a kill and missing after it (target 0)
replicas_ack_cost_ratio acquire+release p50 with replicas_ack = 1 over replicas_ack = 0, one client, the
                        two servers on the same Redis measured in interleaved blocks (target <= 1.5)
ping_p50_ms, lock_p50_ms  the baselines of the same run: a Redis PING, and a bare Redis lock (SET NX PX,
                        then DEL) through the same sentinel-managed client
ack0_lost_grants, ack0_double_grants, ack0_token_reuse
                        the same load with replicas_ack = 0 and min-replicas-to-write 0, one failover,
                        its replica cut off for 0.3 s first: what asynchronous replication alone
                        loses (no target: the trade-off)

Nothing here asserts: a bench prints.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _common
from _common import json_line, pct, say

TARGETS = {
    "failover_unavailable_s": ("<=", 10.0),
    "double_grants": ("<=", 0),
    "token_reuse": ("<=", 0),
    "lost_grants": ("<=", 0),
    "replicas_ack_cost_ratio": ("<=", 1.5),
}


def verdict(name: str, value: float) -> str:
    return _common.verdict(TARGETS, name, value)


def server(group: Any, prefix: str, replicas_ack: int) -> Any:
    from tests.conftest import ServerHandle, make_settings

    settings = make_settings(
        group.url, prefix, replicas_ack=replicas_ack, heartbeat_interval=1.0, heartbeat_timeout=60.0, sweep_interval=0.2
    )
    return ServerHandle(settings, "n1=8xA100-80GB,n2=8xA100-80GB,n3=8xA100-80GB").start()


async def costs(group: Any, blocks: int, per_block: int) -> dict[str, float]:
    """p50 (ms) of acquire+release through LeaseStore with replicas_ack 0 and 1, PING and a bare lock,
    in interleaved blocks on one sentinel-managed client."""
    from lease_server.leasing.inventory import parse_simulate, register
    from lease_server.leasing.lease import LeaseStore
    from lease_server.request import AcquireRequest
    from lease_server.store.engine import Engine, connect

    r = connect(group.url)
    stores = {}
    for ack in (0, 1):
        settings = _common.settings_for(group.url, f"hacost{ack}", replicas_ack=ack, heartbeat_timeout=3600.0)
        engine = Engine(r, settings)
        for inv in parse_simulate("c1=8xA100-80GB"):
            await register(engine, inv, alive_s=3600)
        stores[ack] = LeaseStore(engine)
    times: dict[str, list[float]] = {"ack0": [], "ack1": [], "ping": [], "lock": []}
    for _ in range(blocks):
        for name in times:
            for _ in range(per_block):
                t0 = time.perf_counter()
                if name == "ping":
                    await r.ping()
                elif name == "lock":
                    await r.set("{hacost}:lock", "me", nx=True, px=10_000)
                    await r.delete("{hacost}:lock")
                else:
                    store = stores[int(name[-1])]
                    rec = await store.acquire("bench", AcquireRequest(gpus=1, pool="A100-80GB", ttl=60.0, wait=0.0))
                    await store.release(rec["id"], "bench")
                times[name].append((time.perf_counter() - t0) * 1000)
    await r.aclose()
    return {k: pct(v, 50) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 failovers in 30 s instead of 3 in 60 s")
    args = _common.parse_args(ap)  # --smoke: one failover of each kind, 8 clients, the load 2 s around it
    from lease_server.store.keys import Keys
    from tests.ha import REDIS_SETTINGS, SENTINEL_SETTINGS, SentinelGroup, run_load

    out: dict[str, Any] = {"sentinel": SENTINEL_SETTINGS}
    kills, every = (1, 2.0) if args.smoke else (2, 12.0) if args.quick else (3, 15.0)
    clients = 8 if args.smoke else 32
    with tempfile.TemporaryDirectory(prefix="gpulease-ha-") as tmp:
        group = SentinelGroup(Path(tmp) / "a")
        try:
            say(
                f"ha_bench ({'smoke' if args.smoke else 'quick' if args.quick else 'full'}): "
                "primary + replica + 3 sentinels on loopback, "
                f"{SENTINEL_SETTINGS}"
            )
            with _common.section(out, "cost"):
                c = asyncio.run(costs(group, 1 if args.smoke else 5 if args.quick else 10, 40))
                out.update(
                    ping_p50_ms=round(c["ping"], 3),
                    lock_p50_ms=round(c["lock"], 3),
                    ack0_pair_p50_ms=round(c["ack0"], 3),
                    ack1_pair_p50_ms=round(c["ack1"], 3),
                    replicas_ack_cost_ratio=round(c["ack1"] / c["ack0"], 2),
                )
                say(f"PING p50 {c['ping']:.3f} ms, bare lock p50 {c['lock']:.3f} ms (baselines)")
                say(f"acquire+release p50: replicas_ack=0 {c['ack0']:.3f} ms, replicas_ack=1 {c['ack1']:.3f} ms")
                say(
                    f"replicas_ack_cost_ratio {out['replicas_ack_cost_ratio']} "
                    f"{verdict('replicas_ack_cost_ratio', out['replicas_ack_cost_ratio'])}"
                )
            with _common.section(out, "failover"):
                srv = server(group, "haload", 1)
                try:
                    tokens = [srv.token(f"u{i}") for i in range(clients)]
                    rep = run_load(group, srv.url, tokens, kills, every, 1, Keys("haload"))
                finally:
                    srv.stop()
                med = statistics.median(rep.unavailable_s) if rep.unavailable_s else float("nan")
                out.update(
                    failover_unavailable_s=round(med, 2),
                    failover_unavailable_all_s=[round(u, 2) for u in rep.unavailable_s],
                    failovers=rep.failovers,
                    grants=rep.grants,
                    double_grants=len(rep.double_grants),
                    token_reuse=len(rep.token_reuse),
                    lost_grants=len(rep.lost_grants),
                )
                say(f"replicas_ack=1: {rep.grants} grants by {clients} clients, {rep.failovers} failovers")
                say(
                    f"failover_unavailable_s {med:.2f} (each: {out['failover_unavailable_all_s']}) "
                    f"{verdict('failover_unavailable_s', med)}"
                )
                for name in ("double_grants", "token_reuse", "lost_grants"):
                    say(f"{name} {out[name]} {verdict(name, out[name])}")
        finally:
            group.stop()
        group = SentinelGroup(Path(tmp) / "b", [*REDIS_SETTINGS, "--min-replicas-to-write", "0"])
        try:
            with _common.section(out, "ack0"):
                srv = server(group, "haload0", 0)
                try:
                    tokens = [srv.token(f"u{i}") for i in range(clients)]
                    rep = run_load(group, srv.url, tokens, 1, 2.0 if args.smoke else 10.0, 0, Keys("haload0"))
                finally:
                    srv.stop()
                out.update(
                    ack0_grants=rep.grants,
                    ack0_lost_grants=len(rep.lost_grants),
                    ack0_double_grants=len(rep.double_grants),
                    ack0_token_reuse=len(rep.token_reuse),
                )
                say(
                    f"replicas_ack=0, replica 0.3 s behind at the kill: {rep.grants} grants, "
                    f"{len(rep.lost_grants)} acknowledged grants lost, {len(rep.double_grants)} GPUs held twice, "
                    f"{len(rep.token_reuse)} tokens reused (the fencing epoch)"
                )
        finally:
            group.stop()
    print(json_line(out, first=list(TARGETS)))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
