"""Prometheus metrics: request counts and latency per route, and GPU / queue gauges read from
Redis at scrape time (so every replica reports the same cluster state)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..leasing.board import cluster_view
from ..leasing.queue import queue_view
from ..store.engine import Engine

CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
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
        self.nodes = Gauge("gpulease_nodes", "Nodes by pool and state", ["pool", "state"], registry=self.registry)

    def observe(self, handler: Any, seconds: float) -> None:
        route = type(handler).__name__.removesuffix("Handler").lower()
        self.requests.labels(handler.request.method, route, str(handler.get_status())).inc()
        if route != "eventstream":
            self.latency.labels(route).observe(seconds)

    async def render(self) -> bytes:
        view = await cluster_view(self.engine)
        for pool, counts in view["pools"].items():
            for state in ("free", "leased", "down"):
                self.gpus.labels(pool, state).set(counts[state])
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
