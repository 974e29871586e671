#!/usr/bin/env python
"""Performance figures of idle-GPU reclaim (issue 5, Bench section).

    .venv/bin/python bench/reclaim_bench.py [--quick | --smoke]

Starts its own redis-server (in a temporary directory) and its own lease server (a child process
running ``serve`` with simulated nodes, as ``gpulease up`` does), on loopback only, measures, stops
every process it started, and prints one line per figure followed, as the very last line of stdout,
by one JSON object with every figure:

reclaim_to_grant_ms    a 1-GPU pool, its lease left idle (simulated utilization 0), a second user's
                       acquire (wait 60 s) queued behind it; from the end of the grace (the warned
                       lease's reclaim_at, Redis clock) to the waiter's grant (the grant event's
                       Redis timestamp), p50 (p99 as an extra); the client-observed time (the
                       waiter's POST returned, time.time() on the same machine) as extras; several
                       1-GPU pools run rounds at once. For information, the same with a crowd of
                       other live (busy) leases that every pass of the reclaimer walks through
                                                         (target <= one sample interval + 100 ms)
sample_cpu_ms_8gpu     client CPU per sample of an 8-GPU node: NvmlSampler.sample() (pynvml's own
                       wrappers over stand-in NVML entry points: this machine has no GPU, so the
                       driver's time is not in it) + record_samples() as the agent calls it
                                                                                  (target < 2 ms)
window_bytes_per_gpu   Redis MEMORY USAGE of one GPU's full sample window (default settings:
                       sample_interval 5 s, idle_timeout 600 s) + its share of the last / busy_at
                       hashes (the largest share of an 8-, 512- and 1024-GPU fleet) (target < 4096 B)

Nothing here asserts: a bench prints. ``--serve`` (configuration on stdin) is the lease server
child process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import logging
import math
import os
import random
import secrets
import select
import signal
import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, for _common (which adds the repo root)

import _common
from _common import ROOT, pct, proc_cpu_seconds, say, section, settings_for

POOL8 = "A100-80GB"  # pool of the 8-GPU nodes parse_simulate builds from "NAME=8xA100-80GB"

# Part 1: a fast reclaim policy, so that one round (idle window + grace) takes a few seconds.
FAST = {"sample_interval": 0.5, "idle_timeout": 1.5, "grace": 1.0, "min_age": 0.0, "idle_threshold": 5.0}
LEASE_TTL = 120.0  # seconds: leases outlive their round without renewal (reclaim ends them, not expiry)

TARGETS: dict[str, tuple[str, float]] = {
    "reclaim_to_grant_ms": ("<=", FAST["sample_interval"] * 1000 + 100),
    "sample_cpu_ms_8gpu": ("<", 2.0),
    "window_bytes_per_gpu": ("<", 4096.0),
}
verdict = functools.partial(_common.verdict, TARGETS)


def run_async(coro: Any) -> Any:
    """On uvloop when available, as ``gpulease up`` / ``gpulease server`` run (lease_server.web.server.run_loop)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


# ---- the lease server child process ------------------------------------------------------------------


def serve_main() -> None:
    """``--serve``: the lease server with an in-process agent for simulated nodes (as gpulease up)."""
    cfg = json.load(sys.stdin)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    from lease_server.config import Settings
    from lease_server.leasing.inventory import parse_simulate
    from lease_server.web.server import run_loop, serve

    settings = Settings.load(None, **cfg["settings"])
    nodes = parse_simulate(cfg["simulate"])

    def ready(port: int) -> None:
        print(f"PORT {port}", flush=True)

    run_loop(serve(settings, stop=None, on_ready=ready, local_nodes=nodes))


class ServerProcess:
    """This file run with ``--serve`` in its own session (SIGTERM stops it cleanly)."""

    def __init__(
        self, settings: dict[str, Any], simulate: str, logdir: Path, log_name: str = "lease-server.log"
    ) -> None:
        self.cfg = {"settings": settings, "simulate": simulate}
        self.log_path = logdir / log_name
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""

    def start(self, timeout: float = 30.0) -> ServerProcess:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "--serve"],
                env=_common.child_env(),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                start_new_session=True,
                cwd=str(ROOT),
            )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(self.cfg).encode())
        self.proc.stdin.close()
        deadline = time.monotonic() + timeout
        line = b""
        while time.monotonic() < deadline and not line.endswith(b"\n"):
            if self.proc.poll() is not None:
                break
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.2)
            if ready:
                chunk = os.read(self.proc.stdout.fileno(), 256)
                if not chunk:
                    break
                line += chunk
        if not line.startswith(b"PORT "):
            raise RuntimeError(f"lease server did not come up:\n{self.log_path.read_text()[-2000:]}")
        self.url = f"http://127.0.0.1:{int(line.split()[1])}"
        return self

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc else 0

    def stop(self) -> None:
        if self.proc is None:
            return
        _common.stop_session(self.proc, 15)
        if self.proc.stdout:
            self.proc.stdout.close()
        self.proc = None


# ---- 1. end of grace -> waiter granted ---------------------------------------------------------------


def bench_reclaim(
    redis_url: str,
    tmpdir: Path,
    nodes: int,
    rounds: int,
    budget_s: float,
    post_n: int = 0,
    crowd: int = 0,
    prefix: str = "brecl",
) -> dict:
    """``nodes`` 1-GPU nodes, each its own pool, run rounds concurrently: the holder of the node's
    GPU stays idle, a second user queues for it; the holder is warned, reclaimed after the grace, and
    the waiter is granted; the waiter's (idle) lease is the next round's holder.

    ``crowd``: that many other live leases (1 GPU each, on 8-GPU nodes of their own pool, their GPUs
    busy at 90 %) that every pass of the reclaimer also looks at."""
    from lease_server.client import Client
    from tests.api_helpers import EventWatcher

    names = [f"r{i}" for i in range(nodes)]
    crowd_nodes = [f"c{i}" for i in range(math.ceil(crowd / 8))]
    settings = {
        "redis_url": redis_url,
        "prefix": prefix,
        "host": "127.0.0.1",
        "port": 0,
        **FAST,
        "pool_overrides": {**{n: f"pool-{n}" for n in names}, **{c: "crowd" for c in crowd_nodes}},
    }
    simulate = ",".join(
        [f"{n}=1xA100-80GB" for n in names] + ["s8=8xA100-80GB"] + [f"{c}=8xA100-80GB" for c in crowd_nodes]
    )
    users = {"root": "admin", "crowd": "user", **{f"{who}-{n}": "user" for n in names for who in ("ann", "bob")}}
    tokens = run_async(_common.make_tokens(redis_url, prefix, users))
    server = ServerProcess(settings, simulate, tmpdir, f"lease-server-{prefix}.log").start()
    watcher: Any = None
    clients: dict[str, Client] = {}
    try:
        admin = Client(server.url, tokens["root"])
        clients["root"] = admin
        for n in names:  # idle GPUs (0 % is also what an unset simulated GPU reports)
            admin.request("PUT", f"/api/v1/simulate/{n}", json={"gpus": {"0": {"util": 0, "mem_mb": 0, "procs": []}}})
        busy = {str(i): {"util": 90, "mem_mb": 30000, "procs": []} for i in range(8)}
        for c in crowd_nodes:
            admin.request("PUT", f"/api/v1/simulate/{c}", json={"gpus": busy})
        if crowd:
            crowd_client = Client(server.url, tokens["crowd"])
            clients["crowd"] = crowd_client
            for _ in range(crowd):
                crowd_client.request("POST", "/api/v1/leases", json={"gpus": 1, "pool": "crowd", "ttl": LEASE_TTL})
        watcher = EventWatcher(server.url, tokens["root"]).start()
        remote = bench_remote_samples(admin, server.pid, post_n) if post_n else {}

        records: list[dict[str, Any]] = []
        failures: list[str] = []
        lock = threading.Lock()
        t_end = time.monotonic() + budget_s

        def post(c: Client, pool: str, wait: float, lid: str) -> tuple[dict[str, Any], float]:
            body = {"id": lid, "gpus": 1, "pool": pool, "ttl": LEASE_TTL, "wait": wait}
            lease = c.request("POST", "/api/v1/leases", json=body, timeout=wait + 15)
            return lease, time.time()

        def ev(kind: str, lid: str, timeout: float = 10.0) -> dict[str, Any]:
            return watcher.wait_for(lambda e: e["type"] == kind and e.get("lease") == lid, timeout, f"{kind} {lid}")

        def run_node(i: int, node: str) -> None:
            pool = f"pool-{node}"
            mine = [Client(server.url, tokens[f"ann-{node}"]), Client(server.url, tokens[f"bob-{node}"])]
            with lock:
                clients.update({f"ann-{node}": mine[0], f"bob-{node}": mine[1]})
            # Start the nodes a little apart. The reclaimer judges idleness once per sample interval, so
            # their warnings (and so their reclaims) still tend to fall in the same pass: several leases
            # due at once, reclaimed one after the other, as on a real cluster.
            threading.Event().wait(i * FAST["sample_interval"] / max(1, nodes))
            holder_c = mine[0]
            try:
                holder, _ = post(holder_c, pool, 0, "l-" + secrets.token_hex(8))
                for r in range(rounds):
                    if time.monotonic() > t_end:
                        failures.append(f"{node}: time budget reached after {r} rounds")
                        break
                    waiter_c = mine[(r + 1) % 2]
                    lid = "l-" + secrets.token_hex(8)
                    lease, t_return = post(waiter_c, pool, 60, lid)
                    warn = ev("idle_warning", holder["id"])
                    reclaimed = ev("reclaimed", holder["id"])
                    grant = ev("grant", lid)
                    queued = [e for e in watcher.events if e["type"] == "queued" and e.get("lease") == lid]
                    if not queued:
                        failures.append(f"{node} round {r}: the waiter was granted without queueing")
                    else:
                        with lock:
                            records.append(
                                {
                                    "node": node,
                                    "round": r,
                                    "created_at": holder["created_at"],
                                    "warn_ts": warn["ts"],
                                    "reclaim_at": warn["reclaim_at"],
                                    "reclaimed_ts": reclaimed["ts"],
                                    "grant_ts": grant["ts"],
                                    "t_return": t_return,
                                    "waited_s": lease.get("waited", 0),
                                }
                            )
                    holder, holder_c = lease, waiter_c
                holder_c.release(holder["id"], holder["token"])
            except Exception as exc:
                with lock:
                    failures.append(f"{node}: {type(exc).__name__}: {str(exc)[:200]}")

        threads = [
            threading.Thread(target=run_node, args=(i, n), name=f"round-{n}", daemon=True) for i, n in enumerate(names)
        ]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(1.0, t_end - time.monotonic() + 75))  # a stuck acquire waits at most 60 s (+ slack)
        elapsed = time.monotonic() - t0
        if any(t.is_alive() for t in threads):
            failures.append("a round thread did not finish in time")
        stray = [e for e in watcher.events if e["type"] in ("idle_warning", "reclaimed") and e.get("pool") == "crowd"]
        if stray:
            failures.append(f"{len(stray)} warnings/reclaims of the crowd's busy leases")
    finally:
        server.stop()
        for cl in clients.values():
            with contextlib.suppress(Exception):
                cl.close()
    grant_ms = [(r["grant_ts"] - r["reclaim_at"]) * 1000 for r in records]
    client_ms = [(r["t_return"] - r["reclaim_at"]) * 1000 for r in records]
    late_ms = [(r["reclaimed_ts"] - r["reclaim_at"]) * 1000 for r in records]
    deliver_ms = [(r["t_return"] - r["grant_ts"]) * 1000 for r in records]
    warn_after_ms = [(r["warn_ts"] - r["created_at"] - FAST["idle_timeout"]) * 1000 for r in records]
    return {
        "n": len(records),
        "rounds_wanted": rounds * nodes,
        "nodes": nodes,
        "elapsed_s": elapsed,
        "failures": failures,
        "server_p50_ms": pct(grant_ms, 50),
        "server_p99_ms": pct(grant_ms, 99),
        "server_max_ms": max(grant_ms, default=float("nan")),
        "server_min_ms": min(grant_ms, default=float("nan")),
        "client_p50_ms": pct(client_ms, 50),
        "client_p99_ms": pct(client_ms, 99),
        "reclaim_late_p50_ms": pct(late_ms, 50),
        "same_script": all(r["grant_ts"] == r["reclaimed_ts"] for r in records),
        "deliver_p50_ms": pct(deliver_ms, 50),
        "deliver_p99_ms": pct(deliver_ms, 99),
        "warn_after_p50_ms": pct(warn_after_ms, 50),
        "warn_after_max_ms": max(warn_after_ms, default=float("nan")),
        "remote": remote,
        "crowd": crowd,
        "records": records,
    }


def bench_remote_samples(admin: Any, server_pid: int, n: int) -> dict[str, float]:
    """For information: the remote agent's path (gpulease agent): POST /api/v1/nodes/s8/samples with
    an 8-GPU body. Client CPU per POST (this thread), and the lease server's CPU per POST (its
    process, less its CPU over as long a quiet period: its own agent and reclaimer keep running)."""
    rng = random.Random(3)
    bodies = [
        {
            "gpus": [
                {"index": i, "util": rng.randint(0, 100), "mem_mb": rng.randint(0, 81920), "procs": [4000 + i]}
                for i in range(8)
            ]
        }
        for _ in range(64)
    ]
    for b in bodies[:20]:  # warm-up
        admin.request("POST", "/api/v1/nodes/s8/samples", json=b)
    q0, w0 = proc_cpu_seconds(server_pid), time.perf_counter()
    threading.Event().wait(1.0)
    quiet = (proc_cpu_seconds(server_pid) - q0) / (time.perf_counter() - w0)  # CPU-s per s of the idle server
    s0, c0, w0 = proc_cpu_seconds(server_pid), time.thread_time(), time.perf_counter()
    for i in range(n):
        admin.request("POST", "/api/v1/nodes/s8/samples", json=bodies[i % len(bodies)])
    c1, w1, s1 = time.thread_time(), time.perf_counter(), proc_cpu_seconds(server_pid)
    server_cpu = max(0.0, (s1 - s0) - quiet * (w1 - w0))
    return {
        "n": n,
        "client_cpu_ms": (c1 - c0) / n * 1e3,
        "server_cpu_ms": server_cpu / n * 1e3,
        "wall_ms": (w1 - w0) / n * 1e3,
    }


# ---- 2. CPU per 8-GPU sample --------------------------------------------------------------------------


class FakeNvmlEntryPoints:
    """Stand-ins for the NVML C entry points behind pynvml's own wrappers: pynvml's Python code runs
    as on a GPU machine (ctypes structs, byref, the two-call process-list protocol, friendly
    objects), only the driver call is replaced. One compute process per busy GPU."""

    def __init__(self, gpus: int, seed: int = 1) -> None:
        import pynvml

        self.nvml = pynvml
        rng = random.Random(seed)
        self.gpus = gpus
        self.tick = 0
        self.util = [[rng.choice((0, 0, 0, rng.randint(1, 100))) for _ in range(gpus)] for _ in range(97)]
        self.used = [rng.randint(0, 80 * 1024) * 1024 * 1024 for _ in range(gpus)]
        self.pids = [[10_000 + i] if i % 2 == 0 else [] for i in range(gpus)]

    def get(self, name: str) -> Any:
        return getattr(self, name)

    def nvmlDeviceGetUtilizationRates(self, handle: int, ref: Any) -> int:  # noqa: N802
        self.tick += 1
        ref._obj.gpu = self.util[self.tick % 97][handle]
        ref._obj.memory = 0
        return 0

    def nvmlDeviceGetMemoryInfo(self, handle: int, ref: Any) -> int:  # noqa: N802
        ref._obj.total, ref._obj.used = 80 * 1024**3, self.used[handle]
        ref._obj.free = ref._obj.total - ref._obj.used
        return 0

    def nvmlDeviceGetComputeRunningProcesses_v3(self, handle: int, count_ref: Any, procs: Any) -> int:  # noqa: N802
        pids = self.pids[handle]
        if procs is None:
            count_ref._obj.value = len(pids)
            return 0 if not pids else self.nvml.NVML_ERROR_INSUFFICIENT_SIZE
        for i, pid in enumerate(pids):
            procs[i].pid, procs[i].usedGpuMemory = pid, self.used[handle]
        count_ref._obj.value = len(pids)
        return 0


def sampling_module(gpus: int, util: Callable[..., Any], mem: Callable[..., Any], procs: Callable[..., Any]) -> Any:
    """A module-like object with what NvmlSampler calls: ``gpus`` handles 0.., and these three
    sampling functions."""
    import pynvml

    return types.SimpleNamespace(
        NVMLError=pynvml.NVMLError,
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: gpus,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetUtilizationRates=util,
        nvmlDeviceGetMemoryInfo=mem,
        nvmlDeviceGetComputeRunningProcesses=procs,
    )


@contextlib.contextmanager
def pynvml_over_fakes(gpus: int) -> Iterator[Any]:
    """A module-like object for NvmlSampler: pynvml's real sampling functions over fake entry points."""
    import pynvml

    fakes = FakeNvmlEntryPoints(gpus)
    saved = pynvml._nvmlGetFunctionPointer
    pynvml._nvmlGetFunctionPointer = fakes.get
    try:
        yield sampling_module(
            gpus,
            pynvml.nvmlDeviceGetUtilizationRates,
            pynvml.nvmlDeviceGetMemoryInfo,
            pynvml.nvmlDeviceGetComputeRunningProcesses,
        )
    finally:
        pynvml._nvmlGetFunctionPointer = saved


def nvml_like_sampling(gpus: int) -> Any:
    """The tests' kind of stand-in (tests/test_inventory.py): Python functions shaped like pynvml's
    that return pynvml's real ctypes structs and friendly process objects."""
    import pynvml

    used = [(i * 9 % 80) * 1024**3 for i in range(gpus)]

    def nvmlDeviceGetUtilizationRates(handle):  # noqa: ANN001, ANN202, N802
        rates = pynvml.c_nvmlUtilization_t()
        rates.gpu, rates.memory = (handle * 37) % 101, 0
        return rates

    def nvmlDeviceGetMemoryInfo(handle, version=None):  # noqa: ANN001, ANN202, N802
        mem = pynvml.c_nvmlMemory_t()
        mem.total, mem.used = 80 * 1024**3, used[handle]
        return mem

    def nvmlDeviceGetComputeRunningProcesses(handle):  # noqa: ANN001, ANN202, N802
        if handle % 2:
            return []
        info = pynvml.c_nvmlProcessInfo_v3_t()
        info.pid, info.usedGpuMemory = 10_000 + handle, used[handle]
        return [pynvml.nvmlStructToFriendlyObject(info)]

    return sampling_module(
        gpus, nvmlDeviceGetUtilizationRates, nvmlDeviceGetMemoryInfo, nvmlDeviceGetComputeRunningProcesses
    )


def cpu_per_call_ms(fn: Any, n: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    c0 = time.thread_time()
    for _ in range(n):
        fn()
    return (time.thread_time() - c0) / n * 1e3


def bench_nvml(n: int) -> dict[str, Any]:
    from lease_server.node.agent import NvmlSampler

    with pynvml_over_fakes(8) as nv:
        sampler = NvmlSampler(nv)
        first = sampler.sample()
        wrapped = cpu_per_call_ms(sampler.sample, n, 200)
        sampler.close()
    sampler = NvmlSampler(nvml_like_sampling(8))
    like = cpu_per_call_ms(sampler.sample, n, 200)
    sampler.close()
    return {"pynvml_wrappers_ms": wrapped, "nvml_like_ms": like, "example": first}


SCRIPT_INNER = {"time", "rpush", "ltrim", "hset", "hexists", "hdel", "xadd"}  # called by samples.lua


async def bench_record(redis_url: str, redis_pid: int, n: int, warmup: int) -> dict[str, Any]:
    """record_samples() of one 8-GPU node, as the in-process agent calls it (threshold looked up
    through policies() on every call) and with the threshold passed in, in alternating blocks:
    client CPU (this thread) and wall per call, Redis-side time per call (INFO commandstats: the
    script, and every command the client sent) and redis-server CPU per call."""
    from redis.asyncio import Redis

    from lease_server.leasing.lease import LeaseStore
    from lease_server.leasing.reclaim import policies, record_samples
    from lease_server.node.agent import NvmlSampler
    from lease_server.store.engine import Engine

    r = Redis.from_url(redis_url, decode_responses=True)
    store = LeaseStore(Engine(r, settings_for(redis_url, "bsamp")))
    modes: dict[str, Any] = {}
    try:
        await _common.register_all(store, f"g8=8x{POOL8},h8=8x{POOL8}")  # two nodes: pool_sizes() has a little to read
        with pynvml_over_fakes(8) as nv:
            sampler = NvmlSampler(nv)
            samples = [sampler.sample() for _ in range(97)]
        threshold = (await policies(store.engine))[POOL8].idle_threshold
        acc: dict[str, dict[str, Any]] = {
            mode: {"cpu": 0.0, "wall": 0.0, "redis_cpu": 0.0, "n": 0, "script_us": 0.0, "sent_us": 0.0, "calls": {}}
            for mode in ("agent", "threshold_passed")
        }
        thresholds = {"agent": None, "threshold_passed": threshold}
        for thr in thresholds.values():
            for i in range(warmup):
                await record_samples(store.engine, "g8", POOL8, samples[i % 97], thr)
        block = 100  # alternate the two modes block by block, so that drift of the machine hits both alike
        i = 0
        while acc["agent"]["n"] < n:
            for mode, thr in thresholds.items():
                a = acc[mode]
                await r.config_resetstat()  # our private redis-server: its command stats are ours alone
                rc0, c0, w0 = proc_cpu_seconds(redis_pid), time.thread_time(), time.perf_counter()
                for _ in range(block):
                    await record_samples(store.engine, "g8", POOL8, samples[i % 97], thr)
                    i += 1
                c1, w1, rc1 = time.thread_time(), time.perf_counter(), proc_cpu_seconds(redis_pid)
                stats: Any = await r.info("commandstats")
                a["cpu"] += c1 - c0
                a["wall"] += w1 - w0
                a["redis_cpu"] += rc1 - rc0
                a["n"] += block
                for key, v in stats.items():
                    cmd = key.removeprefix("cmdstat_")
                    if cmd in ("info", "config|resetstat"):
                        continue
                    a["calls"][cmd] = a["calls"].get(cmd, 0) + int(v["calls"])
                    if cmd in ("evalsha", "fcall"):
                        a["script_us"] += float(v["usec"])
                    if cmd not in SCRIPT_INNER:  # sent by the client (the script's own calls are in fcall/evalsha)
                        a["sent_us"] += float(v["usec"])
        for mode, a in acc.items():
            m = a["n"]
            modes[mode] = {
                "client_cpu_ms": a["cpu"] / m * 1e3,
                "wall_ms": a["wall"] / m * 1e3,
                "script_us": a["script_us"] / m,
                "redis_cmd_us": a["sent_us"] / m,
                "redis_cpu_us": a["redis_cpu"] / m * 1e6,
                "commands_per_sample": {k: round(v / m, 2) for k, v in sorted(a["calls"].items())},
            }
        modes["n"] = acc["agent"]["n"]
    finally:
        await store.close()
        await r.aclose()
    return modes


# ---- 3. Redis memory per GPU ---------------------------------------------------------------------------


async def bench_window(redis_url: str, script_n: int) -> dict[str, Any]:
    """One GPU's full window under the default settings, plus its share of the last / busy_at hashes
    (8 GPUs; a 512-GPU fleet, the most a listpack hash holds by default; a 1024-GPU fleet, hashtable).
    For information: samples.lua's Redis time at each fleet size, and a window at MAX_WINDOW entries."""
    from redis.asyncio import Redis

    from lease_server.leasing.lease import LeaseStore
    from lease_server.leasing.reclaim import MAX_WINDOW, record_samples, window_length
    from lease_server.store.engine import Engine

    r = Redis.from_url(redis_url, decode_responses=True)
    rng = random.Random(11)
    out: dict[str, Any] = {}

    def nvml_like_sample(busy: bool) -> list[dict[str, Any]]:
        # What NvmlSampler reports: integer utilization, memory in MB, compute pids.
        return [
            {
                "index": i,
                "util": rng.randint(5, 100) if busy or rng.random() < 0.6 else rng.choice((0, 0, 1, 3)),
                "mem_mb": rng.randint(1000, 81000),
                "procs": [rng.randint(1000, 4_000_000)],
            }
            for i in range(8)
        ]

    async def fill(store: LeaseStore, node: str, count: int) -> None:
        base = int(time.time() * 1000)
        step = int(store.settings.sample_interval * 1000)
        for j in range(count):
            await record_samples(store.engine, node, POOL8, nvml_like_sample(j == 0), 5.0, base + j * step)

    async def mem(key: str) -> int:
        return int(await r.memory_usage(key, samples=0) or 0)

    try:
        store = LeaseStore(Engine(r, settings_for(redis_url, "bwin")))
        k = store.keys
        wl = window_length(store)
        nodes = await _common.register_all(store, ",".join(f"f{i:03d}=8x{POOL8}" for i in range(128)))
        await fill(store, "f000", wl + 10)
        lens = [await r.llen(k.samples(f"f000/{i}")) for i in range(8)]
        lists = [await mem(k.samples(f"f000/{i}")) for i in range(8)]
        example = (await r.lrange(k.samples("f000/0"), -1, -1))[0]

        async def share() -> tuple[float, int, str]:
            # Every per-GPU hash the samples keep: last, busy_at and covered_since.
            per = 0.0
            for key in (k.last, k.busy_at, k.covered_since):
                per += (await mem(key)) / max(1, await r.hlen(key))
            n_last = await r.hlen(k.last)
            return per, n_last, str(await r.object("encoding", k.last))

        async def script_us() -> float:
            samples = [nvml_like_sample(False) for _ in range(16)]
            await r.config_resetstat()
            for j in range(script_n):
                await record_samples(store.engine, "f000", POOL8, samples[j % 16], 5.0)
            stats: Any = await r.info("commandstats")
            return _common.script_stats(stats)["usec_per_call"]

        shares: dict[int, dict[str, Any]] = {}
        for gpus in (8, 512, 1024):
            for inv in nodes[1 : gpus // 8]:
                if not await r.hexists(k.last, f"{inv.node}/0"):
                    await fill(store, inv.node, 1)  # every GPU of the fleet in last and busy_at
            per, n_last, enc = await share()
            shares[gpus] = {"bytes": per, "gpus": n_last, "encoding": enc, "script_us": await script_us()}
        out.update(
            window_length=wl,
            sample_interval=store.settings.sample_interval,
            idle_timeout=store.settings.idle_timeout,
            llen=lens,
            list_bytes=sum(lists) / len(lists),
            list_encoding=await r.object("encoding", k.samples("f000/0")),
            example_entry=example,
            shares=shares,
        )
        out["share"] = max(v["bytes"] for v in shares.values())
        out["bytes_per_gpu"] = out["list_bytes"] + out["share"]
        # For information: the longest window any setting can make (MAX_WINDOW entries).
        big = LeaseStore(Engine(r, settings_for(redis_url, "bwinmax", idle_timeout=3600)))
        await _common.register_all(big, f"m0=8x{POOL8}")
        await fill(big, "m0", MAX_WINDOW + 10)
        out["max_window"] = window_length(big)
        out["max_window_list_bytes"] = sum([await mem(big.keys.samples(f"m0/{i}")) for i in range(8)]) / 8
        out["max_window_encoding"] = await r.object("encoding", big.keys.samples("m0/0"))
    finally:
        await r.aclose()
    return out


# ---- the run -----------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="shorter run (under ~45 s)")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = _common.parse_args(ap)
    if args.serve:
        serve_main()
        return

    q = args.quick or args.smoke
    p: dict[str, Any] = {
        "nodes": 2 if q else 5,
        "rounds_per_node": 2 if q else 6,  # >= 4 rounds (quick), >= 10 (full)
        "round_budget_s": 25.0 if q else 60.0,
        "post_n": 100 if q else 300,
        "crowd": 160 if q else 400,
        "crowd_nodes": 2 if q else 4,
        "crowd_rounds": 2 if q else 3,
        "nvml_n": 2000 if q else 10000,
        "record_n": 500 if q else 3000,
        "record_warmup": 50 if q else 200,
        "script_n": 200 if q else 500,
    }
    if args.smoke:  # each part once, tiny
        p.update(nodes=1, rounds_per_node=1, post_n=10, crowd=20, crowd_nodes=1, crowd_rounds=1)
        p.update(nvml_n=100, record_n=50, record_warmup=10, script_n=20)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # -> leaving the with below stops our processes
    t_start = time.monotonic()
    out: dict[str, Any] = {}
    remote: dict[str, Any] = {}
    with _common.private_redis("reclaim-bench-") as (redis, tmpdir):
        assert redis.proc is not None
        url = redis.url
        _common.announce(out, "reclaim bench", q, redis)

        with section(out, "1"):
            si = FAST["sample_interval"]
            rc = bench_reclaim(url, tmpdir, p["nodes"], p["rounds_per_node"], p["round_budget_s"], p["post_n"])
            out.update(
                reclaim_to_grant_ms=round(rc["server_p50_ms"], 2),
                reclaim_to_grant_p99_ms=round(rc["server_p99_ms"], 2),
                reclaim_to_grant_client_p50_ms=round(rc["client_p50_ms"], 2),
                reclaim_to_grant_client_p99_ms=round(rc["client_p99_ms"], 2),
                reclaim_rounds=rc["n"],
                reclaim_sample_interval_s=si,
                idle_warning_after_timeout_p50_ms=round(rc["warn_after_p50_ms"], 1),
            )
            say(
                f"[1] end of grace (reclaim_at) -> waiter granted, server clock (grant event ts): "
                f"p50 {rc['server_p50_ms']:.1f} ms {verdict('reclaim_to_grant_ms', rc['server_p50_ms'])}, "
                f"p99 {rc['server_p99_ms']:.1f} ms {verdict('reclaim_to_grant_ms', rc['server_p99_ms'])}"
            )
            say(
                f"    sample interval {si:g} s (target = {si * 1000:.0f} + 100 ms), idle_timeout "
                f"{FAST['idle_timeout']:g} s, grace {FAST['grace']:g} s, min_age 0; {rc['n']} rounds "
                f"(of {rc['rounds_wanted']}) on {rc['nodes']} 1-GPU pools at once, {rc['elapsed_s']:.1f} s; "
                f"min {rc['server_min_ms']:.1f} ms, max {rc['server_max_ms']:.1f} ms"
            )
            say(
                f"    client-observed (the waiter's acquire returned): p50 {rc['client_p50_ms']:.1f} ms, "
                f"p99 {rc['client_p99_ms']:.1f} ms; of which grant event -> HTTP reply p50 "
                f"{rc['deliver_p50_ms']:.1f} ms (p99 {rc['deliver_p99_ms']:.1f}); reclaim and grant in one script: "
                f"{rc['same_script']}"
            )
            say(
                f"    (info) idle warning after created_at + idle_timeout: p50 {rc['warn_after_p50_ms']:.0f} ms, "
                f"max {rc['warn_after_max_ms']:.0f} ms (the reclaimer's pass every sample interval)"
            )
            if rc["failures"]:
                say(f"    failures: {rc['failures'][:5]}")
                out["reclaim_failures"] = rc["failures"][:10]
            remote = rc["remote"]

        with section(out, "1 (crowd)"):
            cr = bench_reclaim(
                url, tmpdir, p["crowd_nodes"], p["crowd_rounds"], p["round_budget_s"], crowd=p["crowd"], prefix="bcrowd"
            )
            out.update(
                reclaim_to_grant_crowd_p50_ms=round(cr["server_p50_ms"], 2),
                reclaim_to_grant_crowd_p99_ms=round(cr["server_p99_ms"], 2),
                reclaim_crowd_live_leases=cr["crowd"],
            )
            say(
                f"[1] (info) the same with {cr['crowd']} other live leases (busy GPUs) in the reclaimer's pass: "
                f"server clock p50 {cr['server_p50_ms']:.1f} ms, p99 {cr['server_p99_ms']:.1f} ms "
                f"{verdict('reclaim_to_grant_ms', cr['server_p99_ms'])}; "
                f"client-observed p50 {cr['client_p50_ms']:.1f} ms, "
                f"p99 {cr['client_p99_ms']:.1f} ms ({cr['n']} rounds on {cr['nodes']} pools, {cr['elapsed_s']:.1f} s)"
            )
            if cr["failures"]:
                say(f"    failures: {cr['failures'][:5]}")
                out["reclaim_crowd_failures"] = cr["failures"][:10]

        with section(out, "2"):
            nv = bench_nvml(p["nvml_n"])
            rec = run_async(bench_record(url, redis.proc.pid, p["record_n"], p["record_warmup"]))
            ag, tp = rec["agent"], rec["threshold_passed"]
            total = nv["pynvml_wrappers_ms"] + ag["client_cpu_ms"]
            out.update(
                sample_cpu_ms_8gpu=round(total, 4),
                nvml_sample_cpu_ms_8gpu=round(nv["pynvml_wrappers_ms"], 4),
                nvml_like_sample_cpu_ms_8gpu=round(nv["nvml_like_ms"], 4),
                record_samples_cpu_ms=round(ag["client_cpu_ms"], 4),
                record_samples_cpu_ms_threshold_passed=round(tp["client_cpu_ms"], 4),
                samples_script_redis_us=round(ag["script_us"], 1),
                record_samples_redis_us_total=round(ag["redis_cmd_us"], 1),
            )
            say(
                f"[2a] NvmlSampler.sample(), 8 GPUs, n={p['nvml_n']}: {nv['pynvml_wrappers_ms']:.4f} ms CPU "
                f"through pynvml's own wrappers ({nv['nvml_like_ms']:.4f} ms with the tests' nvml_like stand-in). "
                "NO GPU HERE: NVML entry points are stand-ins, the driver's time is not included"
            )
            say(
                f"[2b] record_samples(), 8 GPUs, as the agent calls it, n={rec['n']}: client CPU "
                f"{ag['client_cpu_ms']:.4f} ms, wall {ag['wall_ms']:.3f} ms; Redis: samples.lua "
                f"{ag['script_us']:.1f} us per call (INFO commandstats fcall/evalsha), every command the client sent "
                f"{ag['redis_cmd_us']:.1f} us, redis-server CPU {ag['redis_cpu_us']:.0f} us per sample; "
                f"commands per sample {ag['commands_per_sample']}"
            )
            say(
                f"     with the threshold passed in (no policies() lookup): client CPU {tp['client_cpu_ms']:.4f} ms, "
                f"wall {tp['wall_ms']:.3f} ms, Redis (samples.lua only) {tp['redis_cmd_us']:.1f} us"
            )
            if remote:
                out.update(
                    remote_post_client_cpu_ms=round(remote["client_cpu_ms"], 3),
                    remote_post_server_cpu_ms=round(remote["server_cpu_ms"], 3),
                )
                say(
                    f"     (info) remote agent path (gpulease agent), POST /nodes/s8/samples, 8 GPUs, over HTTP, "
                    f"n={remote['n']}: client (httpx) CPU {remote['client_cpu_ms']:.3f} ms, lease server CPU "
                    f"{remote['server_cpu_ms']:.3f} ms, wall {remote['wall_ms']:.2f} ms per sample"
                )
            say(
                f"[2] sample_cpu_ms_8gpu = NVML {nv['pynvml_wrappers_ms']:.4f} + record_samples "
                f"{ag['client_cpu_ms']:.4f} = {total:.4f} ms client CPU per 8-GPU sample "
                f"{verdict('sample_cpu_ms_8gpu', total)}"
            )

        with section(out, "3"):
            w = run_async(bench_window(url, p["script_n"]))
            sh = w["shares"]
            out.update(
                window_bytes_per_gpu=round(w["bytes_per_gpu"], 1),
                window_length=w["window_length"],
                window_list_bytes=round(w["list_bytes"], 1),
                window_hash_share_bytes=round(w["share"], 1),
                max_window_list_bytes=round(w["max_window_list_bytes"], 1),
                samples_script_redis_us_by_fleet={str(g): round(v["script_us"], 1) for g, v in sh.items()},
            )
            say(
                f"[3] one GPU's window: {w['window_length']} entries (window_length with sample_interval "
                f"{w['sample_interval']:g} s, idle_timeout {w['idle_timeout']:g} s; LLEN {w['llen'][0]}, "
                f"{w['list_encoding']}, e.g. {w['example_entry']!r}): list {w['list_bytes']:.0f} B + its share of "
                f"last/busy_at/covered_since {w['share']:.0f} B = {w['bytes_per_gpu']:.0f} B per GPU "
                f"{verdict('window_bytes_per_gpu', w['bytes_per_gpu'])}"
            )
            say(
                "    last/busy_at/covered_since share by fleet size: "
                + ", ".join(f"{g} GPUs {v['bytes']:.0f} B ({v['encoding']})" for g, v in sh.items())
                + "; (info) samples.lua Redis time per 8-GPU sample: "
                + ", ".join(f"{g} GPUs {v['script_us']:.0f} us" for g, v in sh.items())
            )
            big = w["max_window_list_bytes"] + w["share"]
            say(
                f"    (info) at MAX_WINDOW = {w['max_window']} entries (a server idle_timeout >= "
                f"{(w['max_window'] - 4) * w['sample_interval']:g} s): list {w['max_window_list_bytes']:.0f} B "
                f"({w['max_window_encoding']}), {big:.0f} B per GPU {verdict('window_bytes_per_gpu', big)}"
            )
    out["loadavg_end"] = round(os.getloadavg()[0], 2)
    out["quick"] = q
    out["elapsed_s"] = round(time.monotonic() - t_start, 1)
    say(_common.json_line(out, first=TARGETS))  # a figure whose part failed is null


if __name__ == "__main__":
    main()
