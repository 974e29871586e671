"""Prometheus metrics: request counts and latency per route, and GPU / queue gauges read from
Redis at scrape time (so every replica reports the same cluster state).

``GET /metrics`` needs no token, so what it costs must not grow with how often it is asked: the
page (one read of the cluster from Redis) is rendered for a request while renders are rare, at
most :data:`FRESH_BURST` in a row and then one per ``metrics_cache_s``. Past that, a request waits
for the next render and shares it with every other request waiting (as does a request that comes
while a render is under way): a scraper every few seconds always reads a fresh page at once; a
flood reads Redis once a second, and each of its connections gets one page a second.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..leasing.board import cluster_view
from ..leasing.queue import queue_view
from ..store.engine import Engine
from .limits import Bucket

FRESH_BURST = 5  # renders in a row before the cache serves

CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    def __init__(self, engine: Engine, cache_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        """``cache_s``: the least time between two renders once :data:`FRESH_BURST` were had in a row."""
        self.engine = engine
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
        view = await cluster_view(self.engine)
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
        return generate_latest(self.registry)
