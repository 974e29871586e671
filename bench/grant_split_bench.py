#!/usr/bin/env python
"""What taking work out of a grant's atomic step would win: the acquire+release pair with parts of
its scripts left out, against the same pair whole and a bare redis-py Lock (issue 37).

    .venv/bin/python bench/grant_split_bench.py [--rounds 11]

Issue 37 proposes to move fair share, the recall index, the ledger line and the ended record out of
the grant's and the release's scripts (settled later, in batches) to bring ``lease_over_lock_ratio``
to 1.6. This bench measures that proposal before anyone builds it. It loads variants of the real
Functions library into a private redis-server, each with some of that work cut out of the text (the
cut is what the redesign would move; the batch that would settle it later is not added, so each
saving is an upper bound):

  whole        the library as it ships
  usage        without fair-share usage (touch_usage: on the grant and the release)
  victims      without the recall index (index_victim: a ZADD on the grant, a ZREM on the release)
  ledger       without the ledger line (its JSON and its XADD, on the release)
  ended        without the ended record (its HSET and ZADD, on the release)
  deferred     without all four: the atomic step the redesign leaves
  replies      functions that do no work at all and answer what the whole library answered for one
               pair (the same lease and ended record): LeaseStore's pair with scripts that cost
               nothing, the floor of any design of them
  floor        a function that returns at once, called with the same keys and arguments, raw

and measures each two ways, in rounds that visit every variant in turn (so that whatever the machine
does meanwhile falls on all alike):

  script_us    Redis's own time per script (INFO commandstats), 1,000 pairs sent in pipelines, so
               that the client's waits do not enter it
  pair ratio   the pair through LeaseStore, one call at a time as in bench/lease_bench.py, p50 over
               the p50 of a bare Lock's acquire+release, in blocks interleaved with every variant's
               (the Lock's p50 over all of them: one Lock, measured alike throughout)

Figures (the last line of stdout is one JSON object with all of them):

lease_over_lock_ratio       the whole library's pair over the Lock        (issue 37's target <= 1.6)
deferred_over_lock_ratio    the same with the four parts left out: the best the redesign could reach
deferred_saving_share       the share of the scripts' Redis time the four parts are
replies_over_lock_ratio     the pair with scripts that do nothing: what no redesign of them gets below
script_budget_us            what a ratio of 1.6 leaves each of the two scripts of the pair:
                            (1.6 x Lock p50 - the replies pair's p50) / 2
script_share_us             what each script adds to the pair today: {whole, deferred}, the pair's
                            p50 above the replies pair's, / 2 (its time in Redis and the client's
                            wait for it)
floor_over_lock_ratio       the calling convention alone (two FCALLs that do nothing) over the Lock

A variant whose text cut no longer matches the library (the Lua changed) fails this bench loudly
rather than measuring something else. Nothing here asserts: a bench prints.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, for _common (which adds the repo root)

import _common
from _common import json_line, private_redis, register_all, say

BLOCK = 100
PIPELINED_PAIRS = 1000
LEDGER_XADD = "redis.call('XADD', K_LEDGER, 'MAXLEN', '~', EVENT_MAX, '*', 'data', cjson.encode(line))"
ENDED_WRITES = ("redis.call('HSET', K_ENDED, lease.id, ended_json)", "redis.call('ZADD', K_ENDED_AT, NOW, lease.id)")


def _stub(name: str) -> Callable[[str], str]:
    """The library with helper ``name`` returning at once (its callers use no value it returns)."""

    def cut(code: str) -> str:
        head = f"local function {name}("
        if code.count(head) != 1:
            raise SystemExit(f"grant_split_bench: the library no longer defines {name} once; update this bench")
        at = code.index(")", code.index(head)) + 1
        return code[:at] + "\n  do return end\n" + code[at:]

    return cut


def _drop(*texts: str) -> Callable[[str], str]:
    def cut(code: str) -> str:
        for text in texts:
            if code.count(text) != 1:
                raise SystemExit(f"grant_split_bench: {text!r} is not in the library once; update this bench")
            code = code.replace(text, "")
        return code

    return cut


CUTS: dict[str, list[Callable[[str], str]]] = {
    "whole": [],
    "usage": [_stub("touch_usage")],
    "victims": [_stub("index_victim")],
    "ledger": [_drop(LEDGER_XADD)],
    "ended": [_drop(*ENDED_WRITES)],
}
CUTS["deferred"] = [cut for name in ("usage", "victims", "ledger", "ended") for cut in CUTS[name]]


async def run(url: str, rounds: int) -> dict[str, Any]:
    from lease_bench import FLOOR_LIBRARY, _empty_calls, _raw_calls, simulate_spec

    from lease_server.leasing.lease import LeaseStore
    from lease_server.request import AcquireRequest
    from lease_server.store.engine import Engine, connect
    from lease_server.store.scripts import library

    r = connect(url)
    store = LeaseStore(Engine(r, _common.settings_for(url, "bsplit")))
    try:
        await register_all(store, simulate_spec("s", 1))
        await store.engine.scripts.load()
        lib_name, code = library()
        texts = {}
        for name, cuts in CUTS.items():
            text = code
            for cut in cuts:
                text = cut(text)
            texts[name] = text
        floor = await _empty_calls(r, store)
        make_raw = _raw_calls(r, store)
        acquire, release = await make_raw()
        granted, ended = await r.execute_command(*acquire), await r.execute_command(*release)
        texts["replies"] = f"#!lua name={lib_name}\n" + "".join(
            f"redis.register_function('{lib_name}_{script}', function() return {{0, [==[{reply[1]}]==]}} end)\n"
            for script, reply in (("acquire", granted), ("release", ended))
        )
        lock = r.lock("bsplit:bare-lock", timeout=60, blocking=False)
        pc = time.perf_counter

        async def pair() -> float:
            t0 = pc()
            rec = await store.acquire("alice", AcquireRequest(gpus=1))
            await store.release(rec["id"], "alice")
            return pc() - t0

        async def empty_pair() -> float:
            t0 = pc()
            for call in floor:
                await r.execute_command(*call)
            return pc() - t0

        async def lock_pair() -> float:
            t0 = pc()
            if not await lock.acquire():
                raise RuntimeError("the bare lock was not free")
            await lock.release()
            return pc() - t0

        async def pipelined(pairs: int) -> float:
            """Redis's us per script over ``pairs`` pairs, built first and then sent in pipelines of
            250 pairs."""
            batches = []
            for _ in range(max(1, pairs // 250)):
                batch: list[tuple[Any, ...]] = []
                for _ in range(min(pairs, 250)):
                    batch += await make_raw()
                batches.append(batch)
            await r.config_resetstat()
            for batch in batches:
                pipe = r.pipeline(transaction=False)
                for call in batch:
                    pipe.execute_command(*call)
                for reply in await pipe.execute():
                    if int(reply[0]) != 0:
                        raise RuntimeError(f"a pipelined call was refused: {reply!r}")
            row = (await r.info("commandstats"))["cmdstat_fcall"]
            return float(row["usec"]) / int(row["calls"])

        variants = [*CUTS, "replies", "floor"]
        pairs: dict[str, list[float]] = {v: [] for v in variants}
        locks: dict[str, list[float]] = {v: [] for v in variants}
        script_us: dict[str, list[float]] = {v: [] for v in CUTS}
        for k in range(rounds):
            for v in variants[k % len(variants) :] + variants[: k % len(variants)]:  # each first in turn
                one = empty_pair if v == "floor" else pair
                if v != "floor":
                    await r.execute_command("FUNCTION", "LOAD", "REPLACE", texts[v])
                if v in CUTS:
                    await pipelined(100)  # warm: a variant's first calls after a load
                    script_us[v].append(await pipelined(PIPELINED_PAIRS))
                for _ in range(20):
                    await one()
                    await lock_pair()
                for _ in range(BLOCK):
                    pairs[v].append(await one())
                for _ in range(BLOCK):
                    locks[v].append(await lock_pair())
        await r.execute_command("FUNCTION", "LOAD", "REPLACE", code)  # as it ships, whatever comes next
        await r.execute_command("FUNCTION", "DELETE", FLOOR_LIBRARY)
    finally:
        await store.close()
        await r.aclose()
    lock_p50 = statistics.median([x for v in variants for x in locks[v]])  # one Lock for all: less noise
    ratio = {v: statistics.median(pairs[v]) / lock_p50 for v in variants}
    us = {v: statistics.median(script_us[v]) for v in CUTS}
    return {
        "ratio": ratio,
        "script_us": us,
        "pair_p50_us": {v: statistics.median(pairs[v]) * 1e6 for v in variants},
        "lock_p50_us": lock_p50 * 1e6,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=11, help="rounds over every variant (default 11)")
    args = ap.parse_args()
    t0 = time.monotonic()
    with private_redis("gpulease-split-") as (redis, _):
        got = asyncio.run(run(redis.url, args.rounds))
    ratio, us, whole = got["ratio"], got["script_us"], got["script_us"]["whole"]
    say(f"grant split bench: {args.rounds} rounds, {BLOCK} pairs per variant per round")
    say(f"  bare Lock acquire+release p50 {got['lock_p50_us']:.0f} us")
    say("  variant     Redis us/script  saved   pair p50 us  pair/Lock")
    for v in [*CUTS, "replies", "floor"]:
        script = f"{us[v]:10.1f}     {1 - us[v] / whole:6.1%}" if v in us else f"{'-':>10}     {'':>6}"
        say(f"  {v:10s} {script}   {got['pair_p50_us'][v]:9.0f}    {ratio[v]:6.2f}")
    saving = 1 - us["deferred"] / whole
    pair_us, lock_us = got["pair_p50_us"], got["lock_p50_us"]
    budget = (1.6 * lock_us - pair_us["replies"]) / 2
    share = {v: (pair_us[v] - pair_us["replies"]) / 2 for v in ("whole", "deferred")}
    say(f"  the four parts the redesign would move are {saving:.0%} of the scripts' Redis time.")
    say(f"  Pair over Lock: whole {ratio['whole']:.2f}, without them {ratio['deferred']:.2f} (the batch that")
    say(f"  settles them later not counted), scripts that cost nothing {ratio['replies']:.2f}; target 1.6.")
    say(f"  1.6 leaves each script {budget:.0f} us of the pair; each adds {share['whole']:.0f} us today,")
    say(f"  {share['deferred']:.0f} us without the four parts (time in Redis, and the client's wait for it).")
    out = {
        "lease_over_lock_ratio": ratio["whole"],
        "deferred_over_lock_ratio": ratio["deferred"],
        "deferred_saving_share": saving,
        "replies_over_lock_ratio": ratio["replies"],
        "floor_over_lock_ratio": ratio["floor"],
        "script_budget_us": budget,
        "script_share_us": share,
        "script_us": us,
        "pair_over_lock": ratio,
        "lock_pair_p50_us": got["lock_p50_us"],
        "rounds": args.rounds,
        "elapsed_s": round(time.monotonic() - t0, 1),
    }
    say(json_line(out, digits=3))


if __name__ == "__main__":
    main()
