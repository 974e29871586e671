"""The usage summary (GET /api/v1/usage/summary) against the raw ledger.

A known workload is played into a real server's Redis: three days of notebook sessions of four
users through the real scripts under the simulator's virtual clock (policy lease-warm: waits in
the queue, warm leases, warm cells, evictions), and a live lease over HTTP whose GPU the test
samples as its node agent would (busy and idle samples). Every figure the server answers (totals,
each day, each user, team and pool, and their days) is then checked against a computation from
the raw ledger lines, to within 1 %. Real Redis, real server, no mocks.
"""

from __future__ import annotations

import asyncio
import calendar
import csv
import io
import json
import math
import random
import time
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from click.testing import CliRunner
from redis import Redis

from lease_server.cli import main
from lease_server.config import Settings
from lease_server.leasing import usage
from lease_server.leasing.lease import WAITER_GRACE_MS
from lease_server.sim import replay, workload
from lease_server.store import layout, rollup
from lease_server.store.engine import Engine
from lease_server.store.keys import Keys
from lease_server.store.scripts import Sweep
from tests.api_helpers import API, assert_error, http
from tests.conftest import ServerHandle, make_settings

TEAMS = {"vision": ["ann", "bob"], "nlp": ["bob", "cy"]}  # dee has no team; bob counts in both
DAY_MS = 86_400_000


def _workload(seed: int = 7) -> workload.Workload:
    """Three days, four users, two sessions each a day on 1, 2 or 4 GPUs: more than 8 GPUs' worth
    at the busiest hours, so cells wait and warm leases are evicted."""
    rng = random.Random(seed)
    cells = []
    for day in range(3):
        for user in ("ann", "bob", "cy", "dee"):
            for k in range(2):
                t = day * DAY_MS + rng.randint(8, 14) * 3_600_000 + rng.randint(0, 59) * 60_000
                gpus = rng.choice((1, 2, 4))
                for c in range(rng.randint(3, 6)):
                    dur = rng.randint(10, 90) * 60_000
                    cells.append(workload.Cell(t, dur, gpus, f"{user}-{day}-{k}-{c}", user, f"{user}-{day}-{k}"))
                    t += dur + rng.randint(1, 30) * 60_000
    return workload.from_cells(cells, "usage-test")


def _play(redis_url: str, prefix: str) -> None:
    """The workload through the real scripts into ``prefix`` (which must hold no data yet), then a
    sweep at the virtual clock a day after it, which ends the warm leases left: every lease ends
    in virtual time. (A lease ending at the real clock would also drop rollup rows of 2021, over
    400 days old by then, as the scripts drop expired rows: rightly, but not what is checked here.)"""
    settings = Settings(redis_url=redis_url, prefix=prefix, teams=TEAMS)
    setup = replay.ReplaySetup(redis_url, prefix, settings, keep=True)
    replay.lease(_workload(), [4, 4], setup, policy="lease-warm")

    async def sweep() -> None:
        from redis.asyncio import Redis as AsyncRedis

        r = AsyncRedis.from_url(redis_url, decode_responses=True)
        try:
            engine = Engine(r, settings)
            await engine.run(Sweep(500, WAITER_GRACE_MS), replay.EPOCH_MS + 4 * DAY_MS)
            await usage.fold_pending(engine)  # every ledger line in the rollups, as a reader sees them
        finally:
            await r.aclose()

    asyncio.run(sweep())
    assert not Redis.from_url(redis_url).hlen(Keys(prefix).leases), "a lease of the replay is still live"


def _ledger(r: Redis, keys: Keys) -> list[dict[str, Any]]:
    return [json.loads(f["data"]) for _id, f in r.xrange(keys.ledger)]  # type: ignore[union-attr]


def _exact_quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q * len(ordered) - 1e-9)) - 1]


# A share of a ledger line: the line, the share of its lease's time inside a period, and whether
# the lease itself (and its wait, its warm cells) counts there: it does in the period it was granted.
Share = tuple[dict[str, Any], float, bool]


def _within(lines: list[dict[str, Any]], lo: float, hi: float) -> list[Share]:
    """Each line's share of [lo, hi): the part of its time held in it (a lease is spread evenly
    over the time it was held), counted there if it was granted in it."""
    out = []
    for x in lines:
        begin, end = min(x["start"], x["end"]), x["end"]
        share = (min(end, hi) - max(begin, lo)) / (end - begin) if end > begin else float(lo <= end < hi)
        counted = lo <= begin < hi
        if share > 0 or counted:
            out.append((x, max(share, 0.0), counted))
    return out


def _expected(shares: list[Share]) -> dict[str, Any]:
    """The summary's figures, computed from ledger lines alone (independently of store/rollup.py)."""
    counted = [x for x, _, c in shares if c]
    n = len(counted)
    gpu_s = [float(x["gpu_s"]) * w for x, w, _ in shares]
    warm = [float(x.get("warm_gpu_s") or 0) * w for x, w, _ in shares]
    lines = [x for x, _, _ in shares]
    sampled = sum(g for g, x in zip(gpu_s, lines, strict=True) if x.get("busy_frac") is not None)
    used = sum(g * x["busy_frac"] for g, x in zip(gpu_s, lines, strict=True) if x.get("busy_frac") is not None)

    def taken(x: dict[str, Any]) -> str | None:
        how = x.get("recall") or x.get("cause")
        return {"evicted": "e", "suspended": "e", "reclaimed": "r", "recalled": "r", "preempted": "r"}.get(how)

    warm_cells = sum(int(x.get("warm_cells") or 0) for x in counted)
    waits = [float(x["waited_s"]) * 1000 for x in counted]
    return {
        "calls": n,
        "cells": n + warm_cells,
        "warm_cells": warm_cells,
        "warm_cell_share": warm_cells / (n + warm_cells) if n else None,
        "held_gpu_s": sum(gpu_s),
        "sampled_gpu_s": sampled,
        "used_gpu_s": used,
        "util_pct": 100 * used / sampled if sampled else None,
        "warm_gpu_s": sum(warm),
        "reclaimed_gpu_s": sum(g + w for g, w, x in zip(gpu_s, warm, lines, strict=True) if taken(x) == "r"),
        "evicted_gpu_s": sum(g + w for g, w, x in zip(gpu_s, warm, lines, strict=True) if taken(x) == "e"),
        "waits": n,
        "wait_ms_sum": sum(waits),
        "wait_mean_ms": sum(waits) / n if n else None,
        "wait_p50_ms": _exact_quantile(waits, 0.5),
        "wait_p95_ms": _exact_quantile(waits, 0.95),
    }


# what the answer's rounding may add to the 1 %: GPU-seconds to 0.001, util to 0.01 %, shares to
# 1e-4, waits to 0.1 ms (and a wait under 1 ms reads as none)
ROUNDING = {"util_pct": 0.006, "warm_cell_share": 0.0001}


def _agree(got: dict[str, Any], want: dict[str, Any], where: str) -> None:
    """Every figure within 1 % of the ledger's, give or take the answer's rounding."""
    for name, value in want.items():
        have = got[name]
        if value is None:
            assert have is None, f"{where} {name}: {have!r}, expected none"
            continue
        assert have is not None, f"{where} {name}: none, expected {value!r}"
        slack = ROUNDING.get(name, 1.0 if name.startswith("wait_p") else 0.06 if name.startswith("wait") else 0.0006)
        assert math.isclose(have, value, rel_tol=0.01, abs_tol=slack), f"{where} {name}: {have} vs {value} (ledger)"


def _check(answer: dict[str, Any], lines: list[dict[str, Any]], by: str) -> int:
    """The answer's totals, days, groups and their days against ``lines``; returns figures checked."""
    lo, hi = answer["from"] * 1000, answer["to"] * 1000
    day_lo = {d["day"]: _day_start(d["day"]) for d in answer["daily"]}
    checked = 0

    def key_of(x: dict[str, Any]) -> list[str]:
        if by == "team":  # the line's teams, else the server's [teams] (the replay's lines name none)
            named = [t for t in (x.get("teams") or "").split(",") if t]
            return named or sorted(t for t, members in TEAMS.items() if x["user"] in members) or ["(no team)"]
        return [x[by]]

    def in_day(mine: list[dict[str, Any]], day: str) -> list[Share]:
        return _within(mine, max(lo, day_lo[day]), min(hi, day_lo[day] + DAY_MS))

    _agree(answer["total"], _expected(_within(lines, lo, hi)), "total")
    for d in answer["daily"]:
        _agree(d, _expected(in_day(lines, d["day"])), f"day {d['day']}")
        checked += 1
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for x, _, _ in _within(lines, lo, hi):
        for k in key_of(x):
            groups[k].append(x)
    assert sorted(g["key"] for g in answer["groups"]) == sorted(groups), answer["groups"]
    for g in answer["groups"]:
        mine = groups[g["key"]]
        _agree(g["total"], _expected(_within(mine, lo, hi)), f"{by} {g['key']}")
        assert [d["day"] for d in g["daily"]] == answer["days"]
        for d in g["daily"]:
            _agree(d, _expected(in_day(mine, d["day"])), f"{by} {g['key']} {d['day']}")
            checked += 1
    return checked + 1


def _day_start(day: str) -> int:
    return calendar.timegm(time.strptime(day, "%Y-%m-%d")) * 1000


def _day(ms: int) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(ms / 1000))


@pytest.mark.timeout(300)
def test_the_summary_agrees_with_the_raw_ledger(
    redis_server: Any, redis_sync: Redis, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The server reads, sums and answers 7 rows at a time (usage.rollup_slices): every figure must
    # come out the same across the slices' boundaries as from the whole window at once.
    monkeypatch.setattr(usage, "ROLLUP_SLICE", 7)
    keys = Keys(prefix)
    _play(redis_server.url, prefix)  # (into a prefix with no data: the replay refuses any other)
    redis_sync.set(keys.layout, layout.LAYOUT)
    settings = make_settings(redis_server.url, prefix, reclaim_enabled=False, teams=TEAMS)
    server = ServerHandle(settings, "n1=2xA100-80GB").start()
    try:
        _check_replayed(server, keys, redis_sync)
    finally:
        server.stop()


def test_a_sampled_lease_s_use_agrees_with_its_ledger_line(server_factory: Any, redis_sync: Redis) -> None:
    """A live lease whose GPU is sampled busy three times and idle once, as its node agent reports."""
    server = server_factory(simulate="n1=2xA100-80GB", teams=TEAMS)
    with http(server, "cy") as cy, http(server, "root", "admin") as admin:
        got = cy.post(f"{API}/leases", json={"gpus": 1, "pool": "A100-80GB", "label": "live"})
        assert got.status_code == 201, got.text
        lease = got.json()
        index = lease["gpus"][0]["index"]
        for util in (90, 95, 80, 0):
            sent = admin.post(f"{API}/nodes/n1/samples", json={"gpus": [{"index": index, "util": util}]})
            assert sent.status_code == 200, sent.text
        assert cy.delete(f"{API}/leases/{lease['id']}", params={"verified": "true"}).status_code == 200
        lines = _ledger(redis_sync, Keys(server.settings.prefix))
        (live,) = [x for x in lines if x["lease"] == lease["id"]]
        assert live["busy_frac"] > 0.5  # (the agent's own samples of the idle GPU may add idle ones)
        body = cy.get(f"{API}/usage/summary", params={"pool": "A100-80GB", "by": "team"}).json()
        assert body["total"]["calls"] == 1 and body["total"]["util_pct"] == pytest.approx(100 * live["busy_frac"])
        assert [g["key"] for g in body["groups"]] == ["nlp"]
        _check(body, lines, "team")


def test_the_rollups_fold_each_line_once_and_a_reader_never_sees_them_behind(
    server_factory: Any, redis_sync: Redis
) -> None:
    """A release writes its ledger line only; the rows are folded in batches (each sweep, and a
    reader first), so a summary right after the release counts it. A line without the fold mark,
    as a server of the previous release writes it on the same Redis after rolling it up itself
    (a rolling upgrade), is never added a second time."""
    server = server_factory(simulate="n1=2xA100-80GB", teams=TEAMS)
    keys = Keys(server.settings.prefix)
    with http(server, "cy") as cy:
        for _ in range(3):
            lease = cy.post(f"{API}/leases", json={"gpus": 1, "pool": "A100-80GB"}).json()
            assert cy.delete(f"{API}/leases/{lease['id']}", params={"verified": "true"}).status_code == 200
        lines = _ledger(redis_sync, keys)
        assert len(lines) == 3 and all(x["fold"] == 1 for x in lines)
        body = cy.get(f"{API}/usage/summary", params={"pool": "A100-80GB"}).json()
        assert body["total"]["calls"] == 3
        older = {k: v for k, v in lines[0].items() if k != "fold"} | {"lease": "l-from-an-older-release"}
        newest = redis_sync.xadd(keys.ledger, {"data": json.dumps(older)})
        body = cy.get(f"{API}/usage/summary", params={"pool": "A100-80GB"}).json()
        assert body["total"]["calls"] == 3
        assert redis_sync.get(keys.rollup_at) == newest


def _check_replayed(server: ServerHandle, keys: Keys, redis_sync: Redis) -> None:
    with http(server, "cy") as cy:
        lines = _ledger(redis_sync, keys)
        # what the workload must have produced for the check to mean something
        assert len(lines) > 50
        assert any(x["waited_s"] > 0 for x in lines), "no cell waited"
        assert any(_day(x["start"]) != _day(x["end"]) for x in lines), "no lease held over midnight"
        assert any(x["end"] // 3_600_000 - x["start"] // 3_600_000 == 1 for x in lines), "none over an hour's end"
        assert any(x.get("warm_cells") for x in lines), "no cell started warm"
        assert any(x.get("recall") == "evicted" or x.get("cause") in ("evicted", "suspended") for x in lines), (
            "no eviction"
        )

        checked = 0
        start = replay.EPOCH_MS // 1000
        alone: dict[str, Any] = {}
        for by in ("user", "team", "pool"):
            answer = cy.get(f"{API}/usage/summary", params={"from": start, "to": start + 4 * 86400, "by": by})
            assert answer.status_code == 200, answer.text
            body = answer.json()
            assert body["scope"] == "all" and len(body["days"]) == 4 and body["total"]["calls"] > 30
            assert "also" not in body
            checked += _check(body, lines, by)
            alone[by] = body
        # also_by: a second grouping of the same rows in one answer (the usage page's per-pool series)
        for by, also in (("user", "pool"), ("team", "user"), ("pool", "team")):
            params = {"from": start, "to": start + 4 * 86400, "by": by, "also_by": also}
            body = cy.get(f"{API}/usage/summary", params=params).json()
            assert body["groups"] == alone[by]["groups"] and body["also"] == {
                "by": also,
                "groups": alone[also]["groups"],
            }
        refused = cy.get(f"{API}/usage/summary", params={"also_by": "notebook"})
        assert refused.status_code == 400 and "also_by" in refused.json()["message"], refused.text
        # one pool, one user
        body = cy.get(
            f"{API}/usage/summary", params={"from": start, "to": start + 4 * 86400, "pool": "sim", "user": "bob"}
        ).json()
        assert {g["key"] for g in body["groups"]} == {"bob"} and body["user"] == "bob"
        checked += _check(body, [x for x in lines if x["user"] == "bob" and x["pool"] == "sim"], "user")
        assert checked > 40

    # gpulease report: the same figures for those days, as text of 80 columns, JSON and CSV
    def report(*args: str) -> str:
        done = CliRunner().invoke(
            main,
            [
                "report",
                "--until",
                "2021-06-05",
                "--days",
                "4",
                *args,
                "--url",
                server.url,
                "--token",
                server.token("cy"),
            ],
        )
        assert done.exit_code == 0, done.output
        return done.output

    as_json = json.loads(report("--json", "--by", "team"))
    assert as_json["days"] == ["2021-06-01", "2021-06-02", "2021-06-03", "2021-06-04"]
    _check(as_json, lines, "team")
    shown = report().splitlines()
    assert max(len(line) for line in shown) <= 80, shown
    assert shown[0] == "GPU usage 2021-06-01 .. 2021-06-04 (UTC, 4 days), by user"
    total = next(line for line in shown if line.startswith("total "))
    assert total.split()[1] == str(as_json["total"]["calls"])
    rows = list(csv.DictReader(io.StringIO(report("--csv", "--by", "pool"))))
    assert len(rows) == 2 * 5 and {r["pool"] for r in rows} == {"sim", "(all)"}
    sim_total = next(r for r in rows if r["pool"] == "sim" and r["day"] == "total")
    assert int(sim_total["calls"]) == as_json["total"]["calls"]
    # without --until: whole UTC days, today the last (7 x 24 h back from now cut both ends)
    done = CliRunner().invoke(main, ["report", "--json", "--url", server.url, "--token", server.token("cy")])
    days = json.loads(done.output)["days"]
    today = datetime.now(UTC).date()
    assert days == [str(today - timedelta(days=6 - i)) for i in range(7)], days


def test_bad_windows_pools_and_users_are_refused_naming_what_works(server_factory: Any, redis_sync: Redis) -> None:
    server = server_factory(simulate="n1=2xA100-80GB", teams=TEAMS)
    with http(server, "ann") as ann:
        s = f"{API}/usage/summary"
        assert_error(
            ann.get(s, params={"from": 1_700_000_000, "to": 1_600_000_000}),
            400,
            "bad_request",
            "to must be after from",
            "e.g. from=",
        )
        assert_error(
            ann.get(s, params={"from": 1_600_000_000, "to": 1_700_000_000}),
            400,
            "bad_request",
            "at most 400 days",
            "e.g. from=",
        )
        assert_error(ann.get(s, params={"pool": "H100"}), 400, "bad_request", "unknown pool 'H100'", "A100-80GB")
        assert_error(ann.get(s, params={"user": "zed"}), 400, "bad_request", "unknown user 'zed'", "widen")
        assert_error(ann.get(s, params={"by": "colour"}), 400, "bad_request")
        # a user with no usage asks for their own (an admin for anyone's with a token): an empty
        # summary, every day present; to another user, that name is as unknown as any
        with http(server, "bob") as bob, http(server, "root", "admin") as admin:
            assert_error(ann.get(s, params={"user": "bob"}), 400, "bad_request", "unknown user 'bob'")
            for who in (bob, admin):
                body = who.get(s, params={"user": "bob"}).json()
                assert (
                    body["total"]["calls"] == 0
                    and body["groups"] == []
                    and len(body["daily"]) == len(body["days"]) >= 7
                )
        assert body["total"]["wait_p50_ms"] is None and body["total"]["util_pct"] is None


def test_own_rows_only_shows_a_user_their_own_usage(server_factory: Any) -> None:
    server = server_factory(simulate="n1=2xA100-80GB", usage_own_rows_only=True)
    with http(server, "ann") as ann, http(server, "bob") as bob, http(server, "root", "admin") as admin:
        for who in (ann, bob):
            lease = who.post(f"{API}/leases", json={"gpus": 1, "pool": "A100-80GB"}).json()
            assert who.delete(f"{API}/leases/{lease['id']}", params={"verified": "true"}).status_code == 200
        mine = ann.get(f"{API}/usage/summary", params={"by": "pool"}).json()
        assert mine["scope"] == "own" and mine["user"] == "ann" and mine["total"]["calls"] == 1
        assert_error(ann.get(f"{API}/usage/summary", params={"user": "bob"}), 403, "forbidden", "user=ann")
        team = admin.get(f"{API}/usage/summary").json()
        assert team["scope"] == "all" and {g["key"] for g in team["groups"]} == {"ann", "bob"}
        # The ledger's sums (GET /usage) hold to the same setting, whatever they are grouped by.
        for by in ("user", "pool", "notebook"):
            got = ann.get(f"{API}/usage", params={"by": by}).json()
            assert got["scope"] == "own" and got["calls"] == 1, (by, got)
        assert [r["user"] for r in ann.get(f"{API}/usage", params={"by": "user"}).json()["rows"]] == ["ann"]
        all_rows = admin.get(f"{API}/usage", params={"by": "user"}).json()
        assert all_rows["scope"] == "all" and {r["user"] for r in all_rows["rows"]} == {"ann", "bob"}


def _seed_rows(r: Redis, keys: Keys, hours: range, pools: tuple[str, ...], users: int) -> int:
    """Rollup rows of ``users`` other users (one lease each an hour) in each hour and pool, written
    as the scripts write them (the row and its name in the index). Returns how many."""
    row = json.dumps({**rollup.empty(), "n": 1, "held": 60.0, "wh": {"0": 1}})
    names = [rollup.field(h, pool, f"u{u:03d}") for h in hours for pool in pools for u in range(users)]
    with r.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.hset(keys.rollup, name, row)
            pipe.zadd(keys.rollup_idx, {name: 0})
        pipe.execute()
    return len(names)


def test_own_rows_only_reads_only_the_caller_s_rows(server_factory: Any, redis_sync: Redis) -> None:
    """Issue 49 (6): with usage_own_rows_only a user's summary read every row of its window and
    dropped the others' (1.7 s of the server's loop a request over 100,000 rows). Now it reads
    their own rows only, by name: each hour of the window in each pool they ever held a lease in,
    however many rows other users have; nothing of another user is in the answer."""
    server = server_factory(simulate="n1=2xA100-80GB,t1=1xT4-16GB", usage_own_rows_only=True)
    keys = Keys(server.settings.prefix)
    with http(server, "ann") as ann, http(server, "root", "admin") as admin:
        lease = ann.post(f"{API}/leases", json={"gpus": 1, "pool": "A100-80GB"}).json()
        assert ann.delete(f"{API}/leases/{lease['id']}", params={"verified": "true"}).status_code == 200
        now_h = int(time.time() * 1000) // rollup.HOUR_MS
        others = _seed_rows(redis_sync, keys, range(now_h - 19, now_h + 1), ("A100-80GB", "T4-16GB"), 50)
        for by in ("user", "pool", "team"):
            mine = ann.get(f"{API}/usage/summary", params={"by": by}).json()
            assert mine["scope"] == "own" and mine["total"]["calls"] == 1, (by, mine["total"])
            assert sum(d["calls"] for d in mine["daily"]) == 1
        assert [g["key"] for g in ann.get(f"{API}/usage/summary").json()["groups"]] == ["ann"]
        t4 = ann.get(f"{API}/usage/summary", params={"pool": "T4-16GB"}).json()  # others' pool: none of hers
        assert t4["total"]["calls"] == 0 and t4["groups"] == []
        team = admin.get(f"{API}/usage/summary").json()  # an admin reads them all
        assert team["scope"] == "all" and team["total"]["calls"] == others + 1

    async def read(user: str | None) -> tuple[list[usage.Row], int]:
        from lease_server.store.engine import connect

        r = connect(server.settings.redis_url)
        counted: list[int] = []

        async def on_read(n: int) -> None:
            counted.append(n)

        try:
            lo, hi = usage.summary_window(None, None, int(time.time() * 1000))
            got = [
                row
                async for part in usage.rollup_slices(Engine(r, server.settings), lo, hi, user=user, on_read=on_read)
                for row in part
            ]
            return got, sum(counted) * rollup.HOUR_MS // (hi - lo)
        finally:
            await r.aclose()

    rows, per_hour = asyncio.run(read("ann"))
    # One name an hour (her one pool), found once; none of the 2,000 others' read
    assert [(pool, user) for _h, pool, user, _row in rows] == [("A100-80GB", "ann")] and per_hour == 1
    rows, _ = asyncio.run(read(None))
    assert len(rows) == others + 1


def test_a_user_looping_the_summary_is_throttled_as_get_usage_is(server_factory: Any) -> None:
    """Issue 49 (6): GET /usage/summary had no limit (two connections looping it took another
    user's /whoami from 1.7 ms to 22 ms p50). It is now under the token's read budget of GET /usage
    and the event log: a request costs at least MIN_READ_COST rows, and on an empty bucket the next
    is a 429 that says when to retry; another token reads meanwhile."""
    from lease_server.web.limits import MIN_READ_COST

    burst = 5 * MIN_READ_COST
    srv = server_factory(simulate="n1=2xA100-80GB", log_read_burst=burst, log_read_rate=1)
    with http(srv, "alice") as alice, http(srv, "bob") as bob:
        answers = [alice.get(f"{API}/usage/summary") for _ in range(burst // MIN_READ_COST + 1)]
        assert [a.status_code for a in answers] == [200] * (burst // MIN_READ_COST) + [429]
        refused = assert_error(answers[-1], 429, "too_many", "GET /usage/summary", "retry in", "from=, to=")
        assert int(answers[-1].headers["Retry-After"]) >= 1 and refused["details"]["retry_after"] >= 1
        assert_error(alice.get(f"{API}/usage"), 429, "too_many", "GET /usage", "retry in")  # one budget
        assert bob.get(f"{API}/usage/summary").status_code == 200


def test_migrate_builds_the_rollups_the_scripts_write(redis_server: Any, redis_sync: Redis, prefix: str) -> None:
    """Layout 3 had no rollups: gpulease migrate sums them from the ledger, to what the scripts keep."""
    keys = Keys(prefix)
    _play(redis_server.url, prefix)
    redis_sync.set(keys.layout, 3)
    written = redis_sync.hgetall(keys.rollup)
    totals = {name for name in written if name.startswith(rollup.TOTAL)}
    assert len(written) > 20 and redis_sync.zcard(keys.rollup_idx) == len(written) - len(totals)
    # each pool's running totals (what /metrics counts): every lease ended, whole
    lines = _ledger(redis_sync, keys)
    assert totals == {rollup.total_field(pool) for pool in {x["pool"] for x in lines}}
    for pool in {x["pool"] for x in lines}:
        mine = [x for x in lines if x["pool"] == pool]
        t = json.loads(written[rollup.total_field(pool)])
        assert t["n"] == len(mine) and math.isclose(t["held"], sum(x["gpu_s"] for x in mine), rel_tol=1e-9)
    redis_sync.delete(keys.rollup, keys.rollup_idx)  # what a layout-3 release left

    async def run() -> tuple[int | None, list[str]]:
        from redis.asyncio import Redis as AsyncRedis

        r = AsyncRedis.from_url(redis_server.url, decode_responses=True)
        try:
            return await layout.migrate(r, keys, dry_run=False)
        finally:
            await r.aclose()

    found, changes = asyncio.run(run())
    assert found == 3 and any("hourly rollups" in c for c in changes), changes
    built = redis_sync.hgetall(keys.rollup)
    assert sorted(built) == sorted(written) and redis_sync.zcard(keys.rollup_idx) == len(built) - len(totals)
    for name, raw in written.items():
        a, b = json.loads(raw), json.loads(built[name])
        assert a["wh"] == b["wh"] and a.get("teams") == b.get("teams"), name
        for f in rollup.FIGURES:
            assert math.isclose(a[f], b[f], rel_tol=1e-9, abs_tol=1e-6), (name, f, a[f], b[f])


def test_the_balance_says_quota_left_fair_share_place_and_next_wait(server_factory: Any) -> None:
    server = server_factory(simulate="n1=2xA100-80GB", quota_per_user=4)
    with http(server, "ann") as ann, http(server, "bob") as bob, http(server, "cy") as cy:
        done = bob.post(f"{API}/leases", json={"gpus": 1, "pool": "A100-80GB"}).json()
        assert bob.delete(f"{API}/leases/{done['id']}", params={"verified": "true"}).status_code == 200
        held = ann.post(f"{API}/leases", json={"gpus": 1, "pool": "A100-80GB"})
        assert held.status_code == 201, held.text
        (mine,) = ann.get(f"{API}/usage/balance").json()["pools"]
        # ann holds a GPU now: behind bob, who holds none (a GPU held counts as the time it would add)
        assert (mine["quota"], mine["held"], mine["left"]) == (4, 1, 3)
        assert mine["fair_share"]["rank"] == 2 and mine["fair_share"]["of"] == 2
        assert mine["text"] == "1 of 4 GPUs yours, 3 left; 2nd of 2 in fair share; next cell: now"
        (bobs,) = bob.get(f"{API}/usage/balance", params={"pool": "A100-80GB"}).json()["pools"]
        assert bobs["fair_share"]["rank"] == 1 and bobs["held"] == 0 and bobs["left"] == 4
        (new,) = cy.get(f"{API}/usage/balance").json()["pools"]
        assert new["fair_share"] == {"rank": 1, "of": 3, "usage_gpu_s": 0.0}
        assert_error(ann.get(f"{API}/usage/balance", params={"pool": "H100"}), 400, "bad_request", "A100-80GB")


def test_get_usage_reads_the_ledger_a_slice_at_a_time_and_sums_the_same(
    server_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GET /usage sums the ledger a slice at a time (usage.summarize_ledger: the loop serves others
    between two reads, and each read counts against the token's budget): across slice boundaries,
    and with a pool, the rows are those of the whole range summed at once."""
    from lease_server.store.engine import Engine, connect

    srv = server_factory("a1=2xA100-80GB,t1=1xT4-16GB")
    alice, bob = srv.client("alice"), srv.client("bob")
    for i in range(4):
        alice.release(alice.acquire(1, "A100-80GB", ttl=60, label=f"a{i}"))
        bob.release(bob.acquire(1, "T4-16GB" if i % 2 else "A100-80GB", ttl=60))
    monkeypatch.setattr(usage, "LEDGER_SLICE", 3)
    now = int(time.time() * 1000)

    async def main_() -> None:
        r = connect(srv.settings.redis_url)
        engine = Engine(r, srv.settings)
        try:
            everything = await usage.ledger(engine, now - 3_600_000, now + 60_000)
            assert len(everything) == 8
            for by in ("user", "pool", "team", "notebook"):
                pages: list[int] = []

                async def page(n: int, pages: list[int] = pages) -> None:
                    pages.append(n)

                acc = await usage.summarize_ledger(engine, now - 3_600_000, now + 60_000, by, on_page=page)
                assert acc.rows() == usage.summarize(everything, by) and acc.calls == 8
                assert pages == [3, 3, 2]  # three reads of at most 3 lines
            t4 = await usage.summarize_ledger(engine, now - 3_600_000, now + 60_000, "user", pool="T4-16GB")
            assert t4.calls == 2 and [row["user"] for row in t4.rows()] == ["bob"]
        finally:
            await r.aclose()

    asyncio.run(main_())
    got = alice.request("GET", "/api/v1/usage")  # (the server's own slices)
    rows = {row["user"]: row for row in got["rows"]}
    assert got["calls"] == 8 and rows["alice"]["calls"] == 4 and rows["bob"]["calls"] == 4
