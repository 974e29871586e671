"""Usage on /metrics (issue 38 item 5) and the Grafana dashboard in docs/grafana/.

A real lease server on a real Redis: leases held, sampled busy, kept warm, evicted for a waiter
who waited; then the live page's counters, gauges and histogram are checked against what
happened, and every metric that any query of the dashboard names must be on that live page. The
counters' sums (kept in Redis, read an hour at a time) are checked hour by hour against the raw
ledger of three days played through the real scripts under a virtual clock. Real Redis, real
server, no mocks.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from redis import Redis
from redis.asyncio import Redis as AsyncRedis

from lease_server.config import Settings
from lease_server.store import rollup
from lease_server.store.engine import Engine
from lease_server.store.keys import Keys
from lease_server.web.metrics import USER_WINDOW_H, Usage
from tests.api_helpers import API, EventWatcher, http
from tests.test_usage_summary import TEAMS, _ledger, _play

DASHBOARD = Path(__file__).resolve().parents[1] / "docs" / "grafana" / "gpulease.json"
A100 = "A100-80GB"

# ---- PromQL: the metric names an expression reads ------------------------------------------------

_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset"}
_KEYWORDS |= {"inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: strings, label matchers, range and subquery
    selectors and the label lists of by/without/on/ignoring/group_* go; what is left that is not a
    function (a name followed by "("), a keyword or a number is a metric name."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)
    s = re.sub(r"\{[^{}]*\}", " ", s)  # label matchers (after strings, which may hold braces)
    s = re.sub(r"\[[^\]]*\]", " ", s)  # [5m], [$__range], subqueries [1h:5m]
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    names = set()
    for m in re.finditer(r"(?<![\w:.$])([A-Za-z_:][\w:]*)(\s*\()?", s):
        name, call = m.group(1), m.group(2)
        if not call and name.lower() not in _KEYWORDS:
            names.add(name)
    return names


def dashboard_queries(dash: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, expression) of every query: each panel's targets (rows' panels too) and the
    template variables' queries."""
    out: list[tuple[str, str]] = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for p in panels:
            for t in p.get("targets", []):
                if t.get("expr"):
                    out.append((f"panel {p.get('title')!r} {t.get('refId')}", t["expr"]))
            walk(p.get("panels", []))

    walk(dash.get("panels", []))
    for var in dash.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            q = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            inner = re.fullmatch(r"\s*(?:label_values|query_result)\((.*)\)\s*", q, re.S)
            out.append((f"variable {var['name']!r}", inner.group(1).rsplit(",", 1)[0] if inner else q))
    return out


def test_the_name_parser_finds_metrics_and_only_metrics() -> None:
    assert metric_names('sum by (pool) (rate(gpulease_x_total{pool=~"$pool", a="b{c}"}[$__range]))') == {
        "gpulease_x_total"
    }
    assert metric_names(
        "histogram_quantile(0.95, sum by (pool, le) (rate(a_bucket[1h]))) / on (pool) group_left(x) b > bool 3"
    ) == {"a_bucket", "b"}
    assert metric_names("100 * topk(10, c) / 3600 + d offset 1h or vector(0)") == {"c", "d"}


# ---- the live page ----------------------------------------------------------------------------


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(server: Any) -> tuple[set[str], Samples]:
    """The sample names on the live /metrics page (counters with _total, histograms with
    _bucket/_sum/_count), and every sample's value by (name, labels)."""
    with http(server) as anon:
        resp = anon.get("/metrics")
    assert resp.status_code == 200, resp.text
    samples: Samples = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return {name for name, _ in samples}, samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def by_label(samples: Samples, name: str, label: str) -> dict[str, float]:
    return {dict(lb)[label]: v for (n, lb), v in samples.items() if n == name}


@pytest.fixture
def srv(server_factory: Any) -> Any:
    return server_factory(
        simulate="n1=2xA100-80GB,t1=2xT4-16GB",
        metrics_cache_s=0.1,
        scheduling={A100: {"warm_evict_notice": 30}},
    )


def test_the_dashboard_reads_only_metrics_the_live_server_exports(srv: Any, redis_sync: Redis) -> None:
    names, page = scrape(srv)  # the counters start now, at zero: nothing ended yet
    assert value(page, "gpulease_held_gpu_seconds_total", pool=A100) == 0
    assert value(page, "gpulease_wait_seconds_count", pool=A100) == 0
    watcher = EventWatcher(srv.url, srv.token("root", "admin")).start()
    alice, bob = srv.client("alice"), srv.client("bob")
    lease = alice.acquire(2, pool=A100)
    with http(srv, "root", "admin") as admin:
        for _ in range(3):  # its node agent sees both GPUs busy
            got = admin.post(
                f"{API}/nodes/n1/samples", json={"gpus": [{"index": g["index"], "util": 90} for g in lease.gpus]}
            )
            assert got.status_code == 200, got.text
    _, page = scrape(srv)
    assert value(page, "gpulease_held_gpus", pool=A100) == 2 and value(page, "gpulease_warm_gpus", pool=A100) == 0
    assert value(page, "gpulease_busy_gpus", pool=A100) <= value(page, "gpulease_sampled_gpus", pool=A100) <= 2
    assert by_label(page, "gpulease_user_held_gpus", "user") == {"alice": 2, "~other": 0}
    assert value(page, "gpulease_held_gpus", pool="T4-16GB") == 0

    alice.warm(lease)  # the cell finished: its GPUs are lendable
    _, page = scrape(srv)
    assert value(page, "gpulease_held_gpus", pool=A100) == 0 and value(page, "gpulease_warm_gpus", pool=A100) == 2
    got: list[Any] = []
    rid = bob.new_request_id()
    t = threading.Thread(target=lambda: got.append(bob.acquire(1, pool=A100, wait=30, request_id=rid)), daemon=True)
    t.start()
    watcher.wait_for(lambda e: e["type"] == "evicting" and e["lease"] == lease.id, 10, "evicting")
    _, page = scrape(srv)  # bob waits for alice's warm GPUs
    assert value(page, "gpulease_queue_requests", pool=A100) == 1
    assert value(page, "gpulease_queue_oldest_wait_seconds", pool=A100) > 0
    assert value(page, "gpulease_queue_oldest_wait_seconds", pool="T4-16GB") == 0
    alice.release(lease, verified=True)
    t.join(10)
    assert got, "bob was not granted"
    bob.release(got[0], verified=True)

    names, page = scrape(srv)
    held = value(page, "gpulease_held_gpu_seconds_total", pool=A100)
    sampled = value(page, "gpulease_sampled_gpu_seconds_total", pool=A100)
    used = value(page, "gpulease_used_gpu_seconds_total", pool=A100)
    warm = value(page, "gpulease_warm_gpu_seconds_total", pool=A100)
    assert held > 0 and warm > 0 and 0 < used <= sampled <= held
    # alice's warm lease was lent out: all of its GPU-seconds, held and warm, count as evicted
    assert value(page, "gpulease_evicted_gpu_seconds_total", pool=A100) == pytest.approx(
        held_and_warm_of(redis_sync, srv, lease.id)
    )
    assert value(page, "gpulease_reclaimed_gpu_seconds_total", pool=A100) == 0
    assert value(page, "gpulease_leases_ended_total", pool=A100) == 2
    assert value(page, "gpulease_leases_ended_total", pool="T4-16GB") == 0
    # time to GPU: alice at once, bob after the eviction (a wait in its bucket and in the sum)
    assert value(page, "gpulease_wait_seconds_count", pool=A100) == 2
    assert value(page, "gpulease_wait_seconds_bucket", pool=A100, le="+Inf") == 2
    assert value(page, "gpulease_wait_seconds_bucket", pool=A100, le="0.1") >= 1  # alice's 0
    assert value(page, "gpulease_wait_seconds_sum", pool=A100) > 0
    assert value(page, "gpulease_held_gpus", pool=A100) == 0 and value(page, "gpulease_warm_gpus", pool=A100) == 0
    per_user = by_label(page, "gpulease_user_held_gpu_seconds_24h", "user")
    assert set(per_user) == {"alice", "bob", "~other"} and per_user["~other"] == 0
    assert per_user["alice"] + per_user["bob"] == pytest.approx(held)
    assert by_label(page, "gpulease_user_leases_ended_24h", "user") == {"alice": 1, "bob": 1, "~other": 0}
    assert by_label(page, "gpulease_user_wait_seconds_24h", "user")["bob"] > 0

    dash = json.loads(DASHBOARD.read_text())
    queries = dashboard_queries(dash)
    assert len(queries) >= 15 and any(v.get("type") == "datasource" for v in dash["templating"]["list"])
    missing = {where: sorted(metric_names(q) - names) for where, q in queries if metric_names(q) - names}
    assert not missing, f"the dashboard reads metrics that the server does not export: {missing}"
    used_names = set().union(*(metric_names(q) for _, q in queries))
    assert {"gpulease_held_gpus", "gpulease_wait_seconds_bucket", "gpulease_user_held_gpu_seconds_24h"} <= used_names
    # ... and the check bites: a name the server lacks is caught
    assert metric_names('sum by (pool) (rate(gpulease_held_gpu_hours_total{pool=~"$pool"}[1h]))') - names


def held_and_warm_of(redis_sync: Redis, srv: Any, lease_id: str) -> float:
    """GPU-seconds held + warm of a lease, from its ledger line."""
    lines = _ledger(redis_sync, Keys(srv.settings.prefix))
    (line,) = [x for x in lines if x["lease"] == lease_id]
    return float(line["gpu_s"]) + float(line.get("warm_gpu_s") or 0)


def test_user_labels_are_bounded_and_the_rest_is_other(server_factory: Any) -> None:
    srv = server_factory(simulate="n1=4xA100-80GB,n2=4xA100-80GB", metrics_cache_s=0.1, metrics_top_users=2)
    scrape(srv)  # the counters start now
    sizes = {"ann": 3, "bob": 2, "cy": 1, "dee": 1, "eve": 1}
    leases = {user: srv.client(user).acquire(n, pool=A100) for user, n in sizes.items()}
    _, page = scrape(srv)
    now = by_label(page, "gpulease_user_held_gpus", "user")
    assert now == {"ann": 3, "bob": 2, "~other": 3}  # the top 2 by GPUs held, then the other three
    for user, lease in leases.items():
        srv.client(user).release(lease, verified=True)
    _, page = scrape(srv)
    assert by_label(page, "gpulease_user_held_gpus", "user") == {"~other": 0}  # nobody holds a GPU now
    for name in (
        "gpulease_user_held_gpu_seconds_24h",
        "gpulease_user_leases_ended_24h",
        "gpulease_user_wait_seconds_24h",
    ):
        got = by_label(page, name, "user")
        assert len(got) == 3 and "~other" in got, (name, got)
    ended = by_label(page, "gpulease_user_leases_ended_24h", "user")
    assert sum(ended.values()) == 5 and ended["~other"] == 3  # nobody is lost to the bound
    held = by_label(page, "gpulease_user_held_gpu_seconds_24h", "user")
    assert sum(held.values()) == pytest.approx(value(page, "gpulease_held_gpu_seconds_total", pool=A100))


def test_no_user_is_named_where_users_see_only_their_own_usage(server_factory: Any) -> None:
    """/metrics needs no token: with usage_own_rows_only every user is ~other there."""
    srv = server_factory(simulate="n1=2xA100-80GB", metrics_cache_s=0.1, usage_own_rows_only=True)
    alice = srv.client("alice")
    alice.release(alice.acquire(1), verified=True)
    alice.acquire(1)
    _, page = scrape(srv)
    assert by_label(page, "gpulease_user_held_gpus", "user") == {"~other": 1}
    assert by_label(page, "gpulease_user_leases_ended_24h", "user") == {"~other": 1}
    assert value(page, "gpulease_held_gpus", pool=A100) == 1


# ---- the counters and the 24-hour gauges against the raw ledger -----------------------------------


def test_counters_are_the_ledger_s_totals_and_user_gauges_its_last_24_hours(
    redis_server: Any, redis_sync: Redis, prefix: str
) -> None:
    """Three days played through the real scripts (virtual clock), then read as a page would at
    each hour of them: the counters are each pool's totals of every lease ended, as in the ledger;
    the per-user gauges are the ledger's last 24 hours (each lease's share of them, as the rollups
    spread it); a read within the refresh reads only the two newest hours."""
    _play(redis_server.url, prefix)
    lines = _ledger(redis_sync, Keys(prefix))
    assert len(lines) > 50
    first_h = min(int(x["start"]) for x in lines) // rollup.HOUR_MS - 2
    last_h = max(int(x["end"]) for x in lines) // rollup.HOUR_MS + 2
    pools_of = sorted({x["pool"] for x in lines})

    def window(hour: int) -> dict[str, float]:
        """GPU-seconds held per user in the 24 hours up to ``hour`` (each lease spread evenly)."""
        lo, hi = (hour - USER_WINDOW_H + 1) * rollup.HOUR_MS, (hour + 1) * rollup.HOUR_MS
        out: dict[str, float] = defaultdict(float)
        for x in lines:
            begin, end = int(x["start"]), int(x["end"])
            share = (min(end, hi) - max(begin, lo)) / (end - begin) if end > begin else float(lo <= end < hi)
            if share > 0:
                out[x["user"]] += float(x["gpu_s"]) * share
        return out

    async def run() -> None:
        r = AsyncRedis.from_url(redis_server.url, decode_responses=True)
        try:
            usage = Usage(Engine(r, Settings(redis_url=redis_server.url, prefix=prefix, teams=TEAMS)))
            for hour in range(first_h, last_h + 1, 5):
                pools, users = await usage.read(hour * rollup.HOUR_MS + 1_800_000, pools_of)
                for pool in pools_of:
                    mine = [x for x in lines if x["pool"] == pool]
                    row = pools[pool]
                    assert row["n"] == len(mine) and sum(row["wh"].values()) == len(mine)
                    for f, want in (
                        ("held", sum(float(x["gpu_s"]) for x in mine)),
                        ("warm", sum(float(x.get("warm_gpu_s") or 0) for x in mine)),
                        ("wait_ms", sum(float(x["waited_s"]) * 1000 for x in mine)),
                        ("evicted", sum(float(x["gpu_s"]) + float(x.get("warm_gpu_s") or 0)
                                        for x in mine if rollup.taken(x) == "evicted")),
                    ):  # fmt: skip
                        # (JSON of 14 significant digits, as the scripts' cjson writes it)
                        assert row[f] == pytest.approx(want, rel=1e-9, abs=1e-6), (hour, pool, f)
                want_users = window(hour)
                assert {u for u, row in users.items() if row["held"] > 1e-9} == {
                    u for u, v in want_users.items() if v > 1e-9
                }, hour
                for user, row in users.items():
                    assert row["held"] == pytest.approx(want_users.get(user, 0.0), rel=1e-9, abs=1e-6), (hour, user)
            # within the refresh, a read reads only the two newest hours' rows
            busiest = max(range(first_h, last_h), key=lambda h: sum(1 for x in lines if x["start"] // 3_600_000 == h))
            at = busiest * rollup.HOUR_MS + 1_800_000
            await usage.read(at, pools_of)
            before = usage.rows_read
            await usage.read(at + 60_000, pools_of)
            newest = await rollup_rows_in(r, prefix, busiest - 1, busiest)
            assert usage.rows_read - before == newest
        finally:
            await r.aclose()

    asyncio.run(run())


async def rollup_rows_in(r: Any, prefix: str, lo_h: int, hi_h: int) -> int:
    """How many rollup rows the hours [lo_h, hi_h] have."""
    keys = Keys(prefix)
    return len(await r.zrangebylex(keys.rollup_idx, f"[{rollup.hour_name(lo_h)}|", f"({rollup.hour_name(hi_h + 1)}|"))


def test_samples_while_a_lease_is_warm_are_not_its_use(srv: Any, redis_sync: Redis) -> None:
    """A cell busy on its GPUs, then kept warm (its GPUs idle, the worker waiting for the next
    cell), then busy again: the warm time's idle samples are not held-idle time. They made its
    busy share, its used GPU-seconds and its fair-share charge look like a notebook sitting on
    GPUs it did not use."""
    alice = srv.client("alice")
    lease = alice.acquire(1, pool=A100)

    def sampled(util: int, times: int) -> None:
        with http(srv, "root", "admin") as admin:
            for _ in range(times):
                body = {"gpus": [{"index": g["index"], "util": util} for g in lease.gpus]}
                assert admin.post(f"{API}/nodes/n1/samples", json=body).status_code == 200

    sampled(95, 3)
    alice.warm(lease)
    sampled(0, 6)  # kept warm: nobody runs anything on it
    alice.warm(lease, on=False)  # the next cell runs on it
    sampled(95, 1)
    alice.release(lease)
    (line,) = [x for x in _ledger(redis_sync, Keys(srv.settings.prefix)) if x["lease"] == lease.id]
    assert line["busy_frac"] == 1.0 and float(line.get("warm_gpu_s") or 0) > 0, line
