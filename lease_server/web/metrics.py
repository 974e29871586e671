"""Prometheus metrics: request counts and latency per route, and GPU / queue gauges read from
Redis at scrape time (so every replica reports the same cluster state).

``GET /metrics`` needs no token, so what it costs must not grow with how often it is asked: the
page (one read of the cluster from Redis) is rendered for a request while renders are rare, at
most :data:`FRESH_BURST` in a row and then one per ``metrics_cache_s``. Past that, a request waits
for the next render and shares it with every other request waiting (as does a request that comes
while a render is under way): a scraper every few seconds always reads a fresh page at once; a
flood reads Redis once a second, and each of its connections gets one page a second.

**Usage** (docs/usage.md, "Metrics and Grafana"): counters per pool that only go up, read from the
running totals the scripts keep beside the hourly rollups (``store/rollup.py`` ``total_field``:
every lease ended, whole, as it ended), and gauges of "now" (GPUs held, warm, sampled and busy; the
oldest wait) and of the last 24 hours per user, summed from the rollups. What a page reads stays
small: one field per pool for the counters; for the users, the two newest hours on every render
and the older ones of the window every :data:`USER_REFRESH_MS` (a lease that ends adds its share
to every hour it was held). Labels are bounded: ``pool`` takes the pools' names; ``user`` at most
``metrics_top_users`` users (the top ones) and ``~other``, the
rest summed. No label names a lease.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from ..leasing.board import cluster_view
from ..leasing.queue import queue_view
from ..leasing.reclaim import policies
from ..leasing.usage import fold_pending, rollup_rows
from ..store import rollup
from ..store.engine import Engine
from .limits import Bucket

FRESH_BURST = 5  # renders in a row before the cache serves
USER_WINDOW_H = 24  # the per-user gauges sum the last 24 hours (this hour so far and the 23 before)
USER_REFRESH_MS = 300_000  # the per-user hours older than the two newest are read again this often
# The time-to-GPU histogram's buckets, seconds (each wait is placed by its sketch bucket: within 1 %)
WAIT_BUCKETS_S = (0.1, 1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 14400.0)
# Counters per pool: (name without _total, rollup figure, help)
COUNTERS = (
    ("gpulease_held_gpu_seconds", "held", "GPU-seconds held by leases that ended, warm time excluded"),
    ("gpulease_sampled_gpu_seconds", "sampled", "Of the GPU-seconds held, those of leases the node agent sampled"),
    ("gpulease_used_gpu_seconds", "used", "GPU-seconds busy by the samples (at or above the pool's idle threshold)"),
    ("gpulease_warm_gpu_seconds", "warm", "GPU-seconds kept warm: lendable to whoever waits, not charged as use"),
    (
        "gpulease_reclaimed_gpu_seconds",
        "reclaimed",
        "GPU-seconds (held + warm) of leases the server took back: idle reclaim, a booking's recall, preemption",
    ),
    ("gpulease_evicted_gpu_seconds", "evicted", "GPU-seconds (held + warm) of warm leases lent out to a waiter"),
    ("gpulease_leases_ended", "n", "Leases ended"),
    ("gpulease_warm_cells", "warm_cells", "Cells that started on a warm worker"),
)
# Per-user gauges of the last 24 hours: (name, rollup figure or "wait_s", help)
USER_GAUGES = (
    ("gpulease_user_held_gpu_seconds_24h", "held", "GPU-seconds held (warm excluded)"),
    ("gpulease_user_sampled_gpu_seconds_24h", "sampled", "GPU-seconds held and sampled"),
    ("gpulease_user_used_gpu_seconds_24h", "used", "GPU-seconds busy by the samples"),
    ("gpulease_user_warm_gpu_seconds_24h", "warm", "GPU-seconds kept warm"),
    ("gpulease_user_leases_ended_24h", "n", "Leases ended"),
    ("gpulease_user_wait_seconds_24h", "wait_s", "Seconds waited for a GPU, summed over the leases ended"),
)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class _Families(Collector):
    """The usage families of the latest render (their label values change from render to render:
    a user leaves the top, a pool is added), collected as they are."""

    def __init__(self) -> None:
        self.families: list[Metric] = []

    def collect(self) -> Iterable[Metric]:
        return list(self.families)


class Usage:
    """The usage as a page needs it: per pool, the running totals; per user, the last
    :data:`USER_WINDOW_H` hours of the rollups (see the module's docstring)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._hours: dict[int, dict[str, dict[str, Any]]] = {}  # older hours of the window: user -> row
        self._refreshed_ms = 0  # when they were last all read (Redis's clock)
        self.rows_read = 0  # rollup rows read so far (what a page costs; the tests and bench/ read it)

    async def _rows(self, lo_h: int, hi_h: int) -> list[tuple[int, str, str, dict[str, Any]]]:
        if lo_h >= hi_h:
            return []
        rows = await rollup_rows(self.engine, lo_h * rollup.HOUR_MS, hi_h * rollup.HOUR_MS)
        self.rows_read += len(rows)
        return rows

    async def read(self, now_ms: int, pools: list[str]) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
        """(pool -> its running totals: every lease ended, whole, as the scripts keep them; user ->
        summed rows of the last 24 hours) as of ``now_ms`` (Redis's clock, which the scripts write
        the rows by)."""
        r, k = self.engine.redis, self.engine.keys
        totals: dict[str, dict[str, Any]] = {}
        await fold_pending(self.engine)
        if pools:
            raws: Any = await r.hmget(k.rollup, [rollup.total_field(p) for p in pools])
            for pool, raw in zip(pools, raws, strict=True):
                if raw:
                    totals[pool] = json.loads(raw)
        # the last 24 hours per user. A lease that ends adds its share to every hour it was held
        # (up to 14 days back), so no hour is final: the two newest are read on every call, the
        # older ones kept here and read again every USER_REFRESH_MS.
        now_h = now_ms // rollup.HOUR_MS
        lo, recent = now_h - USER_WINDOW_H + 1, now_h - 1
        if now_ms - self._refreshed_ms >= USER_REFRESH_MS or now_ms < self._refreshed_ms:
            self._hours.clear()
            self._refreshed_ms = now_ms
        for hour in [h for h in self._hours if h < lo or h >= recent]:
            del self._hours[hour]
        missing = [h for h in range(lo, recent) if h not in self._hours]
        if missing:
            got: dict[int, dict[str, dict[str, Any]]] = {h: {} for h in missing}
            for hour, _pool, user, row in await self._rows(missing[0], missing[-1] + 1):
                if hour in got:
                    rollup.add(got[hour].setdefault(user, rollup.empty()), row)
            self._hours.update(got)
        users: dict[str, dict[str, Any]] = {}
        for by_user in self._hours.values():
            for user, row in by_user.items():
                rollup.add(users.setdefault(user, rollup.empty()), row)
        for _hour, _pool, user, row in await self._rows(recent, now_h + 1):
            rollup.add(users.setdefault(user, rollup.empty()), row)
        return totals, users


def top(values: dict[str, float], n: int) -> tuple[list[str], list[str]]:
    """The ``n`` names of the largest values (ties by name) and the rest; ``~other`` is always rest."""
    ranked = sorted((name for name in values if name != rollup.OTHER), key=lambda name: (-values[name], name))
    return ranked[:n], ranked[n:] + ([rollup.OTHER] if rollup.OTHER in values else [])


def wait_buckets(sketch: dict[str, int]) -> list[tuple[str, float]]:
    """The wait sketch (store/rollup.py) as a Prometheus histogram's cumulative buckets, seconds:
    each wait counts under every bound at or above its bucket's value (within 1 % of the wait)."""
    values = [(rollup.bucket_value(b) / 1000, c) for b, c in sketch.items()]
    out = [(floatToGoString(le), float(sum(c for v, c in values if v <= le))) for le in WAIT_BUCKETS_S]
    return out + [("+Inf", float(sum(sketch.values())))]


class Metrics:
    def __init__(
        self,
        engine: Engine,
        cache_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        top_users: int = 20,
        views: Any = None,
    ) -> None:
        """``cache_s``: the least time between two renders once :data:`FRESH_BURST` were had in a
        row; ``top_users``: how many users the per-user series name (the rest are ``~other``);
        ``views``: the server's shared reads of the cluster (board.ClusterViews), else its own."""
        self.engine = engine
        self.views = views
        self.top_users = top_users
        self.usage = Usage(engine)
        self._families = _Families()
        self.renders = 0  # pages rendered (reads of the cluster from Redis)
        self._fresh = Bucket(1 / cache_s, FRESH_BURST, clock)
        self._page = b""
        self._rendering: asyncio.Future[bytes] | None = None
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "gpulease_http_requests", "HTTP requests served", ["method", "route", "status"], registry=self.registry
        )
        self.latency = Histogram(
            "gpulease_http_request_seconds",
            "HTTP request latency",
            ["route"],
            buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 1, 5, 30),
            registry=self.registry,
        )
        self.gpus = Gauge("gpulease_gpus", "GPUs by pool and state", ["pool", "state"], registry=self.registry)
        self.queued = Gauge("gpulease_queue_requests", "Requests waiting, by pool", ["pool"], registry=self.registry)
        self.queued_gpus = Gauge(
            "gpulease_queue_gpus", "GPUs asked for by waiting requests, by pool", ["pool"], registry=self.registry
        )
        # Slices (docs/slices.md): labels are pools and three fixed states, never leases or users.
        self.slices = Gauge("gpulease_slices", "Live slices held, by pool", ["pool"], registry=self.registry)
        self.slice_mem = Gauge(
            "gpulease_slice_memory_mb",
            "Memory of sliced GPUs, by pool and state: leased (promised to live slices), draining (promised "
            "to ended slices whose processes are not seen gone), free (left for another slice)",
            ["pool", "state"],
            registry=self.registry,
        )
        self.nodes = Gauge("gpulease_nodes", "Nodes by pool and state", ["pool", "state"], registry=self.registry)
        self.registry.register(self._families)

    def observe(self, handler: Any, seconds: float) -> None:
        route = type(handler).__name__.removesuffix("Handler").lower()
        self.requests.labels(handler.request.method, route, str(handler.get_status())).inc()
        if route != "eventstream":
            self.latency.labels(route).observe(seconds)

    async def rendered(self) -> bytes:
        """The page for one request: rendered now while renders are rare, else the next render,
        shared (see the module's docstring)."""
        if self._rendering is None:
            self._rendering = asyncio.ensure_future(self._render_once(self._fresh.take("")))
        return await asyncio.shield(self._rendering)

    async def _render_once(self, after: float) -> bytes:
        try:
            if after > 0:
                await asyncio.sleep(after)
                self._fresh.take("")
            self._page = await self.render()
            self.renders += 1
            return self._page
        finally:
            self._rendering = None

    async def render(self) -> bytes:
        """The page as of now: the cluster read from Redis, the request counters of this process."""
        view = await self.views.view() if self.views is not None else await cluster_view(self.engine)
        for pool, counts in view["pools"].items():
            for state in ("free", "leased", "sliced", "down"):
                self.gpus.labels(pool, state).set(counts[state])
            self.slices.labels(pool).set(counts["slices"])
        mem = {(pool, state): 0 for pool in view["pools"] for state in ("leased", "draining", "free")}
        for n in view["nodes"]:
            for g in n["gpus"]:
                if "slice_mem" in g:
                    mem[(n["pool"], "leased")] += sum(s["gpu_mem_mb"] for s in g["slices"])
                    mem[(n["pool"], "draining")] += sum(s["gpu_mem_mb"] for s in g["slices_draining"])
                    mem[(n["pool"], "free")] += g["slice_mem"]["free_mb"]
        for (pool, state), mb in mem.items():
            self.slice_mem.labels(pool, state).set(mb)
        node_counts: dict[tuple[str, str], int] = {}
        for n in view["nodes"]:
            node_counts[(n["pool"], n["state"])] = node_counts.get((n["pool"], n["state"]), 0) + 1
        for pool in view["pools"]:
            for state in ("up", "down"):
                self.nodes.labels(pool, state).set(node_counts.get((pool, state), 0))
        waiting = await queue_view(self.engine.redis, self.engine.keys)
        for pool in view["pools"]:
            ws = [w for w in waiting if w["pool"] == pool]
            self.queued.labels(pool).set(len(ws))
            self.queued_gpus.labels(pool).set(sum(w["gpus"] for w in ws))
        self._families.families = await self.usage_families(view, waiting)
        return generate_latest(self.registry)

    async def usage_families(self, view: dict[str, Any], waiting: list[dict[str, Any]]) -> list[Metric]:
        """The usage series: counters per pool, "now" per pool and user, the last 24 h per user."""
        now_s = float(view["now"])
        pools, users = await self.usage.read(int(now_s * 1000), sorted(view["pools"]))
        names = sorted(set(view["pools"]) | set(pools))
        out: list[Metric] = []
        for name, figure, doc in COUNTERS:
            fam = CounterMetricFamily(name, doc + ", by pool (counted when each lease ends)", labels=["pool"])
            for pool in names:
                fam.add_metric([pool], float(pools[pool][figure]) if pool in pools else 0.0)
            out.append(fam)
        waits = HistogramMetricFamily(
            "gpulease_wait_seconds",
            "Time to GPU: each ended lease's wait from request to grant, by pool (counted when it ends)",
            labels=["pool"],
        )
        for pool in names:
            row = pools.get(pool) or rollup.empty()
            waits.add_metric([pool], wait_buckets(row["wh"]), float(row["wait_ms"]) / 1000)
        out.append(waits)
        out += await self._now(view, waiting, names)
        # the last 24 hours per user: the top users by GPU-seconds held + warm, the rest as ~other
        kept, rest = top({u: float(row["held"]) + float(row["warm"]) for u, row in users.items()}, self.top_users)
        other = rollup.empty()
        for user in rest:
            rollup.add(other, users[user])
        shown = [(u, users[u]) for u in kept] + [(rollup.OTHER, other)]
        for name, figure, doc in USER_GAUGES:
            gauge = GaugeMetricFamily(
                name,
                f"{doc} in the last 24 hours, by user: the top {self.top_users} by GPU-seconds held + warm, "
                "the rest summed as ~other",
                labels=["user"],
            )
            for user, row in shown:
                gauge.add_metric([user], float(row["wait_ms"]) / 1000 if figure == "wait_s" else float(row[figure]))
            out.append(gauge)
        return out

    async def _now(self, view: dict[str, Any], waiting: list[dict[str, Any]], names: list[str]) -> list[Metric]:
        """Gauges of now: GPUs held, warm, sampled and busy per pool, the oldest wait per pool, and
        GPUs held per user (the top users, the rest as ~other)."""
        now_s = float(view["now"])
        fresh_s = 3 * self.engine.settings.sample_interval  # a sample older than this says nothing of now
        pols = await policies(self.engine)
        counts = {pool: dict.fromkeys(("held", "warm", "sampled", "busy"), 0) for pool in names}
        by_user: dict[str, float] = {}
        for node in view["nodes"]:
            pool = node["pool"]
            threshold = pols[pool].idle_threshold if pool in pols else self.engine.settings.idle_threshold
            for g in node["gpus"]:
                state = g["state"]
                if state == "warm":
                    counts[pool]["warm"] += 1
                if state not in ("leased", "borrowed", "sliced"):
                    continue
                counts[pool]["held"] += 1
                sample = g.get("sample")
                if sample and sample["at"] >= now_s - fresh_s:
                    counts[pool]["sampled"] += 1
                    counts[pool]["busy"] += sample["util"] >= threshold
                if "lease" in g:
                    by_user[g["lease"]["user"]] = by_user.get(g["lease"]["user"], 0.0) + 1
                for piece in g.get("slices", []):  # a slice holds its share of the GPU's memory
                    share = piece["gpu_mem_mb"] / g["memory_mb"] if g.get("memory_mb") else 0.0
                    by_user[piece["user"]] = by_user.get(piece["user"], 0.0) + share
        out: list[Metric] = []
        for key, name, doc in (
            ("held", "gpulease_held_gpus", "GPUs held now by live leases (leased, borrowed or sliced), warm excluded"),
            ("warm", "gpulease_warm_gpus", "GPUs kept warm now: lendable to whoever waits"),
            ("sampled", "gpulease_sampled_gpus", "Of the GPUs held now, those with a fresh sample of their node agent"),
            ("busy", "gpulease_busy_gpus", "Of the GPUs held and sampled now, those at or above the idle threshold"),
        ):
            fam = GaugeMetricFamily(name, doc + ", by pool", labels=["pool"])
            for pool in names:
                fam.add_metric([pool], float(counts[pool][key]))
            out.append(fam)
        oldest = GaugeMetricFamily(
            "gpulease_queue_oldest_wait_seconds",
            "How long the request waiting longest has waited so far, by pool (0 when none waits)",
            labels=["pool"],
        )
        for pool in names:
            since = [w["enqueued_at"] for w in waiting if w["pool"] == pool]
            oldest.add_metric([pool], max(0.0, now_s - min(since)) if since else 0.0)
        out.append(oldest)
        kept, rest = top(by_user, self.top_users)
        held = GaugeMetricFamily(
            "gpulease_user_held_gpus",
            f"GPUs held now (warm excluded; a slice counts its share), by user: the top {self.top_users}, "
            "the rest summed as ~other",
            labels=["user"],
        )
        for user in kept:
            held.add_metric([user], by_user[user])
        held.add_metric([rollup.OTHER], sum(by_user[u] for u in rest))
        out.append(held)
        return out
