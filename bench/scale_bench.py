#!/usr/bin/env python
"""What a step costs as the cluster grows: 10,000 GPUs against 16, over the real HTTP API (issue 37).

    nice -n 10 .venv/bin/python bench/scale_bench.py [--quick | --smoke] [--gpus 10000] [--base 16]

For each size (the baseline first, then the large one) it starts its own redis-server and its own
lease server (2 worker processes, on a free loopback port), registers the simulated nodes (8 GPUs
each, in up to 8 pools) through ``PUT /nodes/{node}`` with one agent token per node, and runs their
agents as light asyncio clients in this process at the real rates: a heartbeat every 2 s, a sample
every 5 s, and the drain channel (``GET /nodes/{node}/draining``: a long-poll where the server
declares ``wait``, else a poll every 0.5 s, as the agent did before). Then, all over HTTP:

fill      every pool leased full with leases of 1, 2, 4 and 8 GPUs (100 users), then about 10% of
          the GPUs released again (holes), and a tenth of the leases turned warm, plus one whole
          node per pool
churn     acquire (1 GPU, at once) + release pairs, and renewals
board     one whole GET /cluster; then rounds of one change, each refetched by --followers boards
recall    rounds of one 8-GPU request per pool that no node can serve: it evicts warm leases
          (``evicting``); the sweep ends them after the pool's notice and the request is granted.
          As many requests at each size (--rounds x 8): the one pool of 16 GPUs gets 8 times the
          rounds of the 8 pools of 10,000
drain     leases whose process claimed them are revoked; their agent sees the drain and reports
          it clean (``drained``)
idle      nothing happens for a while: what each idle agent sends, per node and minute
open      ~1,000 waiting 8-GPU requests (12 users, a sweep each; scaled with the size) and 1-GPU
          requests arriving open-loop at 100/s (Poisson, fixed seed), each released at once (the
          16-GPU baseline: 10/s; its fill leaves its free GPUs on the node held for the blocked
          head, so its 1-GPU requests wait out their 5 s there: the p99 target is absolute, and
          the baseline's open-loop figures are shown, not compared)

Redis time per script call comes from the slow log (``slowlog-log-slower-than 0``): it records
each command's execution time, as ``INFO commandstats`` does, but per call and with its function
name, where commandstats lumps every FCALL together (its figure per phase is printed beside).
Figures (the last line of stdout is one JSON object with all of them):

scale_acquire_ratio   Redis us per acquire (churn: granted at once) at the large size / baseline
                                                                                  (target <= 1.2)
scale_release_ratio   the same for release                                        (target <= 1.2)
scale_recall_ratio    the same for an acquire that evicts (recall phase)          (target <= 1.5)
scale_acquire_ratio_quiet, scale_release_ratio_quiet   (no target of their own) the same pairs with
                      the agents' heartbeats and samples paused (quiet phase): the scripts' own
                      cost, without 1,250 agents' traffic competing for the cores
scale_renew_ratio, scale_warm_ratio, scale_drained_ratio   (no target) renew, warm, drained
scale_grant_p99_ms    POST latency p99 of the open-loop grants at the large size, counted from each
                      request's scheduled send time                               (target <= 20)
scale_probe_p99_ms    (no target) the baseline of the grant's p99: GET /whoami (authenticated, no
                      script) arriving open-loop at the same rate in the same window, timed the same
                      way; scale_grant_over_probe_p99 is the grant's p99 over it
scale_idle_agent_rpm  drain-channel requests per idle node per minute at the large size: what an
                      agent sends beyond its heartbeats and samples               (target <= 2)
idle_agent_total_rpm  (no target) all of an idle agent's requests per minute, heartbeats and
                      samples included (30 + 12 at the real rates)
drain_reach_ms        (no target) p50 from a revoke's answer to its node's agent reporting it clean
redis_bytes_per_gpu   (no target) Redis memory of the registered, empty inventory per GPU
redis_bytes_per_lease (no target) Redis memory the fill added per live lease (its events and
                      ledger lines included)
server_cpu_us_per_grant  (no target) the lease server's CPU per churn pair (both workers), the
                      agents' requests meanwhile included; ..._quiet: the same in the quiet phase
board_full_cpu_ms_per_change, board_page_cpu_ms_per_change, board_mine_cpu_ms_per_change
                      (no target) with --followers boards open, the server's CPU for one change and
                      every board's refetch: of the whole inventory, of the board's first page of 64
                      nodes, and of its user's own leases (GET /leases) (board phase)

Nothing here asserts: a bench prints. Absolute times move 2-3x between machines and with what else
runs; the ratios are measured in one run.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import json
import random
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, for _common (which adds the repo root)

import _common
from _common import pct, say, section

TARGETS = {
    "scale_acquire_ratio": ("<=", 1.2),
    "scale_release_ratio": ("<=", 1.2),
    "scale_recall_ratio": ("<=", 1.5),
    "scale_grant_p99_ms": ("<=", 20.0),
    "scale_idle_agent_rpm": ("<=", 2.0),
}
verdict = functools.partial(_common.verdict, TARGETS)

API = "/api/v1"
# What fills a node: each pattern has a 1-GPU lease, released later as the node's hole
PATTERNS = ([4, 2, 1, 1], [2, 2, 2, 1, 1], [4, 1, 1, 1, 1], [2, 2, 1, 1, 1, 1], [2, 1, 1, 1, 1, 1, 1], [1] * 8)
LEASE_TTL = 3000  # s: the fill's leases outlive the run (renewals are measured, not needed)
SWEEP_USERS = 12  # users whose queued sweeps make the waiting requests of the open phase
USERS = 100
SEED = 37
FN = re.compile(r"^gpulease_[0-9a-f]+_(\w+)$")


# ---- HTTP --------------------------------------------------------------------------------------------


class Http:
    """One aiohttp session for every client of this process (agents and users)."""

    def __init__(self, url: str) -> None:
        import aiohttp

        self.url = url
        self.session = aiohttp.ClientSession(
            # (kept-alive connections closed before the server's http_idle_timeout of 20 s closes them)
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=10),
            timeout=aiohttp.ClientTimeout(total=120),
        )

    async def call(
        self,
        method: str,
        path: str,
        token: str,
        body: Any = None,
        params: dict[str, str] | None = None,
        raw_size: bool = False,
    ) -> tuple[int, Any]:
        """(status, the answer's JSON); ``raw_size``: (status, its size in bytes), not parsed."""
        hdrs = {"Authorization": f"Bearer {token}"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            hdrs["Content-Type"] = "application/json"
        import aiohttp

        try:
            async with self.session.request(method, self.url + path, data=data, headers=hdrs, params=params) as resp:
                raw = await resp.read()
                if raw_size:
                    return resp.status, len(raw)
                return resp.status, (json.loads(raw) if raw else None)
        except (aiohttp.ClientError, TimeoutError) as exc:  # counted as a failure by the caller
            return 0, {"code": type(exc).__name__, "message": str(exc)}

    async def close(self) -> None:
        await self.session.close()


async def gather_limited(n: int, coros: list[Any]) -> list[Any]:
    """Run ``coros`` with at most ``n`` at once; their results in order (an exception as a value)."""
    sem = asyncio.Semaphore(n)

    async def one(c: Any) -> Any:
        async with sem:
            return await c

    return await asyncio.gather(*(one(c) for c in coros), return_exceptions=True)


# ---- the node agents, as light clients ---------------------------------------------------------------


class Agents:
    """Every simulated node's agent: heartbeats, samples and the drain channel, at the real rates."""

    def __init__(self, http: Http, nodes: dict[str, dict[str, Any]], tokens: dict[str, str], long_poll: bool) -> None:
        self.http, self.nodes, self.tokens, self.long_poll = http, nodes, tokens, long_poll
        self.counts: collections.Counter[str] = collections.Counter()
        self.samples: dict[str, Any] = {}
        self.cleaned: dict[str, float] = {}  # lease -> when its agent's drained report was answered
        self.errors: collections.Counter[str] = collections.Counter()
        self.tasks: list[asyncio.Task[None]] = []
        self.poll_s = 0.5  # the drain poll period where the server has no long-poll
        self.slow = 1.0  # heartbeats and samples this many times less often than the real agent's
        self.go = asyncio.Event()  # cleared: heartbeats and samples pause (the quiet phase)
        self.go.set()

    def start(self) -> None:
        rng = random.Random(SEED)
        for node in self.nodes:
            phase = rng.random()
            self.tasks += [
                asyncio.create_task(self._every(node, "heartbeat", 2.0 * self.slow, phase * 2.0 * self.slow)),
                asyncio.create_task(self._every(node, "samples", 5.0 * self.slow, phase * 5.0 * self.slow)),
                asyncio.create_task(self._drain(node, phase * 0.5)),
            ]

    async def stop(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def _every(self, node: str, kind: str, period: float, phase: float) -> None:
        await asyncio.sleep(phase)
        path = f"{API}/nodes/{node}/{kind}"
        nxt = time.monotonic()
        while True:
            if not self.go.is_set():
                await self.go.wait()
                nxt = max(nxt, time.monotonic())
            try:
                body = {"gpus": self.samples[node]} if kind == "samples" else None
                status, _ = await self.http.call("POST", path, self.tokens[node], body)
                self.counts[kind] += 1
                if status != 200:
                    self.errors[f"{kind} {status}"] += 1
            except Exception as exc:  # the server is overloaded: the next period tries again
                self.errors[f"{kind} {type(exc).__name__}"] += 1
            nxt += period
            await asyncio.sleep(max(0.0, nxt - time.monotonic()))

    async def _drain(self, node: str, phase: float) -> None:
        await asyncio.sleep(phase * self.poll_s / 0.5)
        path = f"{API}/nodes/{node}/draining"
        while True:
            t0 = time.monotonic()
            entries: list[dict[str, Any]] = []
            try:
                params = {"wait": "40"} if self.long_poll else None
                status, got = await self.http.call("GET", path, self.tokens[node], params=params)
                self.counts["draining"] += 1
                if status == 200:
                    entries = got["draining"]
                else:
                    self.errors[f"draining {status}"] += 1
            except Exception as exc:
                self.errors[f"draining {type(exc).__name__}"] += 1
            by_lease: dict[str, list[int]] = collections.defaultdict(list)
            for e in entries:
                by_lease[e["lease"]].append(e["index"])
            for lease, gpus in by_lease.items():  # the processes it would end here are already gone
                status, _ = await self.http.call(
                    "POST",
                    f"{API}/nodes/{node}/drained",
                    self.tokens[node],
                    {"lease": lease, "gpus": gpus, "killed": 0},
                )
                self.counts["drained"] += 1
                if status == 200:
                    self.cleaned.setdefault(lease, time.monotonic())
            if not self.long_poll or entries:
                await asyncio.sleep(max(0.0, (0.5 if entries else self.poll_s) - (time.monotonic() - t0)))


# ---- Redis's side ------------------------------------------------------------------------------------


async def slowlog_reset(r: Any) -> None:
    await r.slowlog_reset()
    await r.config_resetstat()


async def slowlog_read(r: Any) -> dict[str, list[float]]:
    """{script: [us per call, ...]} from the slow log since the last reset, and commandstats'
    FCALL figure under "~fcall" (its mean over every script)."""
    out: dict[str, list[float]] = collections.defaultdict(list)
    for e in await r.slowlog_get(-1):
        cmd = e["command"]
        parts = (cmd.decode(errors="replace") if isinstance(cmd, bytes) else cmd).split(" ", 2)
        if parts[0].upper() == "FCALL" and len(parts) > 1:
            m = FN.match(parts[1])
            if m:
                out[m.group(1)].append(float(e["duration"]))
    stats = _common.script_stats(await r.info("commandstats"))
    out["~fcall"] = [stats["usec_per_call"]]
    await slowlog_reset(r)
    return out


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


# ---- one size ----------------------------------------------------------------------------------------


class Size:
    """One cluster size, from its own redis-server and lease server to its figures."""

    def __init__(self, gpus: int, p: dict[str, Any], redis_url: str, logdir: Path) -> None:
        self.gpus, self.p, self.redis_url, self.logdir = gpus, p, redis_url, logdir
        self.n_nodes = max(1, gpus // 8)
        self.n_pools = max(1, min(8, self.n_nodes // 2))  # a pool of at least two nodes
        self.pools = [f"pool{i}" for i in range(self.n_pools)]
        self.nodes = {f"n{i:05d}": {"pool": self.pools[i % self.n_pools]} for i in range(self.n_nodes)}
        self.rng = random.Random(SEED)
        self.leases: dict[str, dict[str, Any]] = {}  # id -> lease JSON (+ "_user")
        self.fig: dict[str, Any] = {"gpus": self.n_nodes * 8, "nodes": self.n_nodes, "pools": self.n_pools}
        self.us: dict[str, list[float]] = collections.defaultdict(list)  # "phase:script" -> us per call

    def _take(self, phase: str, got: dict[str, list[float]]) -> None:
        for name, xs in got.items():
            self.us[f"{phase}:{name}"] += xs

    async def run(self) -> dict[str, Any]:
        from lease_bench import ServerProcess
        from redis.asyncio import Redis

        from lease_server.store.keys import Keys

        prefix = "scale"
        keys = self.keys = Keys(prefix)
        r = Redis.from_url(self.redis_url, decode_responses=True, socket_timeout=120)
        await r.config_set("slowlog-max-len", 200_000)
        await r.config_set("slowlog-log-slower-than", 0)  # every command, with its execution time
        mem0 = int((await r.info("memory"))["used_memory"])
        users = {f"u{i:03d}": "user" for i in range(USERS)}
        agents_of = {f"agent-{n}": "agent" for n in self.nodes}
        tokens = await _common.make_tokens(self.redis_url, prefix, {"admin": "admin", **users, **agents_of})
        self.tok = tokens
        node_tok = {n: tokens[f"agent-{n}"] for n in self.nodes}
        server = ServerProcess(
            self.redis_url,
            prefix,
            2,
            self.logdir,
            env={
                "GPULEASE_MAX_CONNECTIONS": "8000",
                "GPULEASE_MAX_QUEUED_PER_USER": "4096",
                # heartbeats --agent-slow times rarer: the timeout as many times longer
                "GPULEASE_HEARTBEAT_INTERVAL": str(2.0 * self.p["agent_slow"]),
                "GPULEASE_HEARTBEAT_TIMEOUT": str(10.0 * self.p["agent_slow"]),
            },
        ).start()
        http = Http(server.url)
        self.http = http
        agents: Agents | None = None
        try:
            # the drain channel: a long-poll where the server declares one (GET .../draining?wait=)
            _, doc = await http.call("GET", f"{API}/openapi.json", tokens["admin"])
            get = (doc.get("paths", {}).get(f"{API}/nodes/{{node}}/draining") or {}).get("get", {})
            long_poll = any(prm.get("name") == "wait" for prm in get.get("parameters", []))
            self.fig["agent_drain"] = "long-poll" if long_poll else "poll every 0.5 s"
            await self._register(http, node_tok)
            await r.slowlog_reset()
            mem_nodes = int((await r.info("memory"))["used_memory"])
            self.fig["redis_bytes_per_gpu"] = (mem_nodes - mem0) / (self.n_nodes * 8)
            agents = Agents(http, self.nodes, node_tok, long_poll)
            agents.samples = self.samples
            agents.poll_s = self.p["poll_s"]
            agents.slow = self.p["agent_slow"]
            if not long_poll:
                self.fig["agent_drain"] = f"poll every {agents.poll_s:g} s"
            agents.start()
            self.agents = agents

            with section(self.fig, "fill", timed=True):
                await self._fill(http)
            await r.slowlog_reset()
            mem_fill = int((await r.info("memory"))["used_memory"])
            self.fig["live_leases"] = await r.hlen(keys.leases)
            self.fig["redis_bytes_per_lease"] = (mem_fill - mem_nodes) / max(1, self.fig["live_leases"])
            self.fig["events_len"] = await r.xlen(keys.events)
            await slowlog_reset(r)
            with section(self.fig, "warm", timed=True):
                await self._warm(http)
            self._take("warm", await slowlog_read(r))
            with section(self.fig, "churn", timed=True):
                pids = server.pids()
                cpu0 = sum(_common.proc_cpu_seconds(p) for p in pids)
                pairs = await self._churn(http)
                self._take("churn", await slowlog_read(r))
                cpu1 = sum(_common.proc_cpu_seconds(p) for p in pids)
                self.fig["server_cpu_us_per_grant"] = (cpu1 - cpu0) / max(1, pairs) * 1e6
                await self._renew(http)
                self._take("renew", await slowlog_read(r))
            with section(self.fig, "quiet", timed=True):
                # The same pairs with the agents' heartbeats and samples paused: what the scripts
                # themselves cost at this size, without 1,250 agents' traffic on the same 2 cores
                # (which descheduled Redis mid-script and counted against the large size alone).
                agents.go.clear()
                await asyncio.sleep(1.0)  # (the requests in flight answered)
                await slowlog_reset(r)
                cpu0 = sum(_common.proc_cpu_seconds(p) for p in pids)
                pairs = await self._churn(http, "quiet_pairs_ok")
                cpu1 = sum(_common.proc_cpu_seconds(p) for p in pids)
                self.fig["server_cpu_us_per_grant_quiet"] = (cpu1 - cpu0) / max(1, pairs) * 1e6
                self._take("quiet", await slowlog_read(r))
                agents.go.set()
            with section(self.fig, "board", timed=True):
                await self._board(http, server)
            with section(self.fig, "recall", timed=True):
                await self._recall(http, r)
            with section(self.fig, "drain", timed=True):
                await slowlog_reset(r)
                await self._drain(http, agents)
                self._take("drain", await slowlog_read(r))
            with section(self.fig, "idle", timed=True):
                c0 = dict(agents.counts)
                t0 = time.monotonic()
                await asyncio.sleep(self.p["idle_s"])
                dt_min = (time.monotonic() - t0) / 60
                c1 = dict(agents.counts)
                per = {k: (c1.get(k, 0) - c0.get(k, 0)) / self.n_nodes / dt_min for k in c1}
                self.fig["idle_agent_rpm"] = per.get("draining", 0.0) + per.get("drained", 0.0)
                self.fig["idle_agent_total_rpm"] = sum(per.values())
                self.fig["idle_agent_rpm_by_kind"] = {k: round(v, 2) for k, v in per.items()}
            with section(self.fig, "open", timed=True):
                await slowlog_reset(r)
                await self._open(http, r)
                self._take("open", await slowlog_read(r))
            self.fig["agent_errors"] = dict(agents.errors)
        finally:
            if agents is not None:
                await agents.stop()
            await http.close()
            server.stop()
            await r.aclose()
        for key, xs in sorted(self.us.items()):
            self.fig.setdefault("redis_us", {})[key] = {"n": len(xs), "mean": round(mean(xs), 1)}
        return self.fig

    async def _register(self, http: Http, node_tok: dict[str, str]) -> None:
        from lease_server.leasing.inventory import parse_simulate

        async def one(node: str) -> None:
            inv = json.loads(parse_simulate(f"{node}=8xA100-80GB")[0].to_json())
            inv["pool"] = self.nodes[node]["pool"]
            status, got = await http.call("PUT", f"{API}/nodes/{node}", node_tok[node], inv)
            if status != 200:
                raise RuntimeError(f"PUT /nodes/{node}: {status} {got}")
            status, got = await http.call("GET", f"{API}/simulate/{node}", node_tok[node])
            if status != 200:
                raise RuntimeError(f"GET /simulate/{node}: {status} {got}")
            self.samples[node] = got["gpus"]

        self.samples: dict[str, Any] = {}
        t0 = time.monotonic()
        for res in await gather_limited(32, [one(n) for n in self.nodes]):
            if isinstance(res, BaseException):
                raise res
        self.fig["register_s"] = time.monotonic() - t0

    def _user(self, first: int = SWEEP_USERS) -> str:
        return f"u{self.rng.randrange(first, USERS):03d}"

    async def _acquire(self, http: Http, user: str, pool: str, gpus: int, wait: float = 0) -> tuple[int, Any]:
        body = {"gpus": gpus, "pool": pool, "ttl": LEASE_TTL, "wait": wait}
        status, got = await http.call("POST", f"{API}/leases", self.tok[user], body)
        if status == 201:
            got["_user"] = user
            self.leases[got["id"]] = got
        return status, got

    async def _release(self, http: Http, lease: dict[str, Any]) -> int:
        self.leases.pop(lease["id"], None)
        status, _ = await http.call(
            "DELETE", f"{API}/leases/{lease['id']}", self.tok[lease["_user"]], params={"token": str(lease["token"])}
        )
        return status

    async def _fill(self, http: Http) -> None:
        """Every pool leased full; then one whole node per pool kept for the recall rounds, and on
        every other node one 1-GPU lease released (a hole: 1 free GPU per node)."""
        per_pool: dict[str, list[int]] = {}
        per_pool_nodes: collections.Counter[str] = collections.Counter(info["pool"] for info in self.nodes.values())
        for pool, count in per_pool_nodes.items():
            per_pool[pool] = [8] + [s for _ in range(count - 1) for s in self.rng.choice(PATTERNS)]
            per_pool[pool].sort(reverse=True)  # largest first: best fit packs them node by node

        async def pool_fill(pool: str) -> int:
            sizes, failed = per_pool[pool], 0
            for i in range(0, len(sizes), 4):
                res = await asyncio.gather(*(self._acquire(http, self._user(), pool, s) for s in sizes[i : i + 4]))
                failed += sum(1 for status, _ in res if status != 201)
            return failed

        failed = sum(await asyncio.gather(*(pool_fill(p) for p in self.pools)))
        by_node: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
        for lease in self.leases.values():
            by_node[lease["node"]].append(lease)
        self.whole: list[dict[str, Any]] = []  # one 8-GPU lease per pool: warm for the first recall round
        holes: list[dict[str, Any]] = []
        for pool in self.pools:
            mine = sorted(n for n in by_node if self.nodes[n]["pool"] == pool)
            eights = [n for n in mine if len(by_node[n]) == 1 and len(by_node[n][0]["gpus"]) == 8]
            keep = eights[0] if eights else None
            if keep:
                self.whole.append(by_node[keep][0])
            for n in mine:
                ones = [x for x in by_node[n] if len(x["gpus"]) == 1]
                if n != keep and ones:
                    holes.append(ones[0])
        await gather_limited(16, [self._release(http, lease) for lease in holes])
        self.fig["fill_failed"] = failed
        self.fig["free_gpus"] = len(holes)

    async def _warm(self, http: Http) -> None:
        """A tenth of the leases warm, and in every pool one whole node (for the first recall round)."""
        chosen = list(self.whole)
        rest = [lease for lease in self.leases.values() if lease not in chosen]
        chosen += self.rng.sample(rest, len(rest) // 10)
        res = await gather_limited(16, [self._warm_one(http, lease) for lease in chosen])
        self.fig["warm_failed"] = sum(1 for x in res if x is not True)

    async def _warm_one(self, http: Http, lease: dict[str, Any]) -> bool:
        status, _ = await http.call(
            "POST",
            f"{API}/leases/{lease['id']}/warm",
            self.tok[lease["_user"]],
            {"token": lease["token"], "warm": True},
        )
        if status == 200:
            lease["_warm"] = True
        return status == 200

    async def _churn(self, http: Http, name: str = "churn_pairs_ok") -> int:
        async def pair() -> bool:
            status, got = await self._acquire(http, self._user(), self.rng.choice(self.pools), 1)
            if status != 201:
                return False
            return await self._release(http, got) == 200

        # One pair at a time: every acquire finds a free GPU (the baseline has one), so both sizes
        # measure the same thing, a grant, not a refusal.
        res = await gather_limited(1, [pair() for _ in range(self.p["pairs"])])
        ok = sum(1 for x in res if x is True)
        self.fig[name] = ok
        return ok

    async def _renew(self, http: Http) -> None:
        live = [x for x in self.leases.values() if not x.get("_warm")]
        picks = [self.rng.choice(live) for _ in range(self.p["renews"])]

        async def one(lease: dict[str, Any]) -> int:
            status, _ = await http.call(
                "POST",
                f"{API}/leases/{lease['id']}/renew",
                self.tok[lease["_user"]],
                {"token": lease["token"], "ttl": LEASE_TTL},
            )
            return status

        res = await gather_limited(8, [one(x) for x in picks])
        self.fig["renew_ok"] = sum(1 for x in res if x == 200)

    async def _board(self, http: Http, server: Any) -> None:
        """The board at this size. One whole GET /cluster (its time and size); then rounds of one
        change (a 1-GPU grant and its release, two events) each followed by every follower's
        refetch, as every open Lab's board does after an event: of the whole inventory (what the
        board asked before it paged), and of the board's first page (``limit=64``). The server's CPU
        per round (both workers) is what a change costs with that many boards open."""
        admin = self.tok["admin"]
        took, size = [], 0
        for _ in range(3):
            t0 = time.monotonic()
            status, size = await http.call("GET", f"{API}/cluster", admin, raw_size=True)
            took.append((time.monotonic() - t0) * 1000)
            if status != 200:
                raise RuntimeError(f"GET /cluster: {status}")
        self.fig["board_get_ms"] = pct(took, 50)
        self.fig["board_bytes"] = size
        followers, rounds = self.p["followers"], self.p["board_rounds"]
        tokens = [self.tok[f"u{i % USERS:03d}"] for i in range(followers)]
        pids = server.pids()
        for name, path, params in (
            ("full", "cluster", None),
            ("page", "cluster", {"limit": "64"}),
            ("mine", "leases", None),  # each board's own leases, which it refetches with the page
        ):
            cpu0 = sum(_common.proc_cpu_seconds(p) for p in pids)
            walls, sizes = [], []
            for _ in range(rounds):
                status, lease = await self._acquire(http, self._user(), self.rng.choice(self.pools), 1)
                if status == 201:
                    await self._release(http, lease)
                t0 = time.monotonic()
                calls = [http.call("GET", f"{API}/{path}", tok, params=params, raw_size=True) for tok in tokens]
                res = await gather_limited(followers, calls)
                walls.append((time.monotonic() - t0) * 1000)
                sizes += [got for x in res if isinstance(x, tuple) and x[0] == 200 for got in [x[1]]]
            cpu1 = sum(_common.proc_cpu_seconds(p) for p in pids)
            self.fig[f"board_{name}_cpu_ms_per_change"] = (cpu1 - cpu0) / rounds * 1000
            self.fig[f"board_{name}_all_answered_ms"] = pct(walls, 50)
            self.fig[f"board_{name}_bytes"] = int(pct(sizes, 50)) if sizes else None
            self.fig[f"board_{name}_failed"] = followers * rounds - len(sizes)

    async def _recall(self, http: Http, r: Any) -> None:
        """Rounds of one 8-GPU request per pool, which only evicting warm leases can serve."""
        waited: list[float] = []
        statuses: collections.Counter[int] = collections.Counter()
        # as many requests at each size: a round asks once per pool
        rounds = self.p.get("recall_rounds") or self.p["rounds"] * max(1, 8 // len(self.pools))
        for rnd in range(rounds):
            await slowlog_reset(r)
            t0 = time.monotonic()
            res = await asyncio.gather(*(self._acquire(http, self._user(), pool, 8, wait=30) for pool in self.pools))
            waited.append(time.monotonic() - t0)
            for status, _ in res:
                statuses[status] += 1
            got = await slowlog_read(r)
            self._take("recall", got)
            # Free the node again and lease it whole, warm, for the next round.
            for status, lease in res:
                if status == 201:
                    await self._release(http, lease)
            for pool in self.pools:
                if rnd + 1 < rounds:
                    status, lease = await self._acquire(http, self._user(), pool, 8)
                    if status == 201:
                        await self._warm_one(http, lease)
                else:  # after the last round the node is filled as the others are: one GPU free
                    for gpus in (4, 2, 1):
                        await self._acquire(http, self._user(), pool, gpus)
            await r.slowlog_reset()
            await r.config_resetstat()
        self.fig["recall_wait_s_p50"] = pct(waited, 50)
        self.fig["recall_statuses"] = {str(k): v for k, v in statuses.items()}

    async def _drain(self, http: Http, agents: Agents) -> None:
        live = [x for x in self.leases.values() if not x.get("_warm")]
        picks = self.rng.sample(live, min(self.p["drains"], len(live)))
        reach: list[float] = []

        async def one(i: int, lease: dict[str, Any]) -> None:
            claim = {
                "lease": lease["id"],
                "fence": lease["token"],
                "token": self.tok[lease["_user"]],
                "pid": 400000 + i,
                "start": 1,
                "uid": 1000,
                "gpus": [g["index"] for g in lease["gpus"]],
            }
            status, got = await http.call(
                "POST", f"{API}/nodes/{lease['node']}/procs", agents.tokens[lease["node"]], claim
            )
            if status != 200:
                raise RuntimeError(f"claim: {status} {got}")
            status, got = await http.call(
                "POST", f"{API}/leases/{lease['id']}/revoke", self.tok["admin"], {"reason": "bench"}
            )
            if status != 200:
                raise RuntimeError(f"revoke: {status} {got}")
            self.leases.pop(lease["id"], None)
            t0 = time.monotonic()
            while lease["id"] not in agents.cleaned and time.monotonic() - t0 < 30:
                await asyncio.sleep(0.005)
            if lease["id"] in agents.cleaned:
                reach.append(agents.cleaned[lease["id"]] - t0)

        res = await gather_limited(8, [one(i, x) for i, x in enumerate(picks)])
        errs = [x for x in res if isinstance(x, BaseException)]
        if errs:
            raise errs[0]
        for lease in picks:  # the pools as full as before, for the phases that follow
            await self._acquire(http, self._user(), lease["pool"], len(lease["gpus"]))
        self.fig["drains"] = len(reach)
        self.fig["drain_reach_ms"] = pct(reach, 50) * 1e3
        self.fig["drain_reach_p99_ms"] = pct(reach, 99) * 1e3

    async def _open(self, http: Http, r: Any) -> None:
        """~1,000 waiting 8-GPU requests (scaled to the size), 1-GPU requests arriving open-loop."""
        n_wait = max(2, round(1000 * self.n_nodes * 8 / 10_000))
        waiters = [
            asyncio.create_task(
                self._acquire(http, f"u{i % SWEEP_USERS:03d}", self.pools[i % self.n_pools], 8, wait=600)
            )
            for i in range(n_wait)
        ]
        await asyncio.sleep(self.p.get("queue_s", 2.0))
        self.fig["queued"] = await r.zcard(self.keys.queue)
        await slowlog_reset(r)
        # The baseline's two nodes: its free GPUs end up on the node held for the blocked head, where
        # no 1-GPU request may go (they time out: shown, not compared); the large size gets the full
        # rate.
        rate, dur = (self.p["rate"] if self.n_nodes * 8 >= 1000 else 10.0), self.p["open_s"]
        rng = random.Random(SEED)
        lat: list[float] = []
        statuses: collections.Counter[int] = collections.Counter()
        pc = time.perf_counter

        async def one(t_sched: float) -> None:
            status, got = await self._acquire(
                http, self._user(), rng.choice(self.pools), 1, wait=self.p.get("open_wait_s", 5)
            )
            lat.append(pc() - t_sched)
            statuses[status] += 1
            if status == 201:
                await self._release(http, got)

        # The baseline in the same window: GET /whoami (authenticated, one token lookup, no script)
        # arriving open-loop at the same rate, timed the same way. What it takes is what any request
        # takes on this machine under this load (the server's loop, the agents' traffic, this
        # process's own loop): the part of the grant's tail that no grant could avoid.
        probe_lat: list[float] = []
        user0 = self._user()

        async def probe(t_sched: float) -> None:
            await http.call("GET", f"{API}/whoami", self.tok[user0])
            probe_lat.append(pc() - t_sched)

        tasks = []
        start = pc()
        arrivals = []
        for kind, seed in ((one, SEED), (probe, SEED + 1)):
            t, r_k = start, random.Random(seed)
            while True:
                t += r_k.expovariate(rate)
                if t >= start + dur:
                    break
                arrivals.append((t, kind))
        for t, kind in sorted(arrivals, key=lambda a: a[0]):
            await asyncio.sleep(max(0.0, t - pc()))
            tasks.append(asyncio.create_task(kind(t)))
        await asyncio.gather(*tasks, return_exceptions=True)
        for w in waiters:
            w.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
        self.fig["open_rate"] = rate
        self.fig["open_n"] = len(lat)
        self.fig["open_statuses"] = {str(k): v for k, v in statuses.items()}
        self.fig["grant_p50_ms"] = pct(lat, 50) * 1e3
        self.fig["grant_p99_ms"] = pct(lat, 99) * 1e3
        self.fig["probe_p50_ms"] = pct(probe_lat, 50) * 1e3
        self.fig["probe_p99_ms"] = pct(probe_lat, 99) * 1e3


async def run_size(gpus: int, p: dict[str, Any]) -> dict[str, Any]:
    with _common.private_redis(f"scale-bench-{gpus}-") as (redis, tmpdir):
        say(f"  [{gpus} GPUs] redis-server pid {redis.proc.pid if redis.proc else '?'} on {redis.url}")
        size = Size(gpus, p, redis.url, tmpdir)
        return await size.run()


def script_us(fig: dict[str, Any], key: str) -> float:
    row = fig.get("redis_us", {}).get(key)
    return float(row["mean"]) if row and row["n"] else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="shorter phases (about two minutes)")
    ap.add_argument("--gpus", type=int, default=10_000, help="the large size (GPUs, 8 per node)")
    ap.add_argument("--base", type=int, default=16, help="the baseline size (GPUs)")
    ap.add_argument(
        "--poll-s",
        type=float,
        default=0.5,
        help="where the server has no long-poll: the agents' drain poll period (0.5 s, the old agent's; "
        "at 10,000 GPUs that is 2,500 requests a second, more than a 2-core machine serves beside the rest)",
    )
    ap.add_argument(
        "--agent-slow",
        type=float,
        default=1.0,
        help="heartbeats and samples this many times rarer than the real agent's (2 s, 5 s), and the "
        "heartbeat timeout as many times longer: 1,250 nodes at the real rates send 875 requests a "
        "second, which a loaded 2-core machine may not serve beside the rest",
    )
    ap.add_argument(
        "--followers", type=int, default=100, help="open boards that refetch GET /cluster after each change"
    )
    args = _common.parse_args(ap, gpus=128, followers=5)
    q = args.quick or args.smoke
    p = {
        "pairs": 200 if q else 600,
        "renews": 200 if q else 600,
        "rounds": 2 if q else 5,
        "drains": 10 if q else 40,
        "idle_s": 10.0 if q else 30.0,
        "open_s": 8.0 if q else 20.0,
        "rate": 100.0,
        "poll_s": args.poll_s,
        "followers": args.followers,
        "board_rounds": 2 if q else 5,
        "agent_slow": args.agent_slow,
    }
    if args.smoke:  # each phase once, tiny
        p.update(pairs=20, renews=20, rounds=1, drains=2, idle_s=2.0, open_s=1.0, rate=20.0, board_rounds=1)
        p.update(recall_rounds=1, queue_s=0.5, open_wait_s=1)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t_start = time.monotonic()
    out: dict[str, Any] = {}
    import os

    load = os.getloadavg()
    say(
        f"scale bench ({'smoke' if args.smoke else 'quick' if q else 'full'}): {args.gpus} GPUs against {args.base}, "
        f"agents x{args.agent_slow:g} slower, {os.cpu_count()} cores, "
        f"load average {_common.load_text(load)} at start"
    )
    out["loadavg_start"] = round(load[0], 2)
    figs: dict[int, dict[str, Any]] = {}
    for gpus in (args.base, args.gpus):
        with section(out, f"size {gpus}"):
            figs[gpus] = asyncio.run(run_size(gpus, p))
            f = figs[gpus]
            say(
                f"  [{gpus} GPUs] {f['nodes']} nodes in {f['pools']} pools, {f.get('live_leases')} leases, "
                f"agents' drain channel: {f.get('agent_drain')}; phases (s): {f.get('section_s')}"
            )
            for key, row in sorted(f.get("redis_us", {}).items()):
                if not key.endswith("~fcall") and row["n"] >= 1:
                    say(f"    redis us/call {key:28s} {row['mean']:9.1f}  (n={row['n']})")
            if f.get("failed"):
                say(f"    FAILED parts: {f['failed']}")
    base, big = figs.get(args.base, {}), figs.get(args.gpus, {})

    def ratio(key: str) -> float:
        return script_us(big, key) / script_us(base, key)

    out["scale_acquire_ratio"] = ratio("churn:acquire")
    out["scale_release_ratio"] = ratio("churn:release")
    out["scale_recall_ratio"] = ratio("recall:acquire")
    out["scale_acquire_ratio_quiet"] = ratio("quiet:acquire")
    out["scale_release_ratio_quiet"] = ratio("quiet:release")
    out["scale_grant_p99_ms"] = big.get("grant_p99_ms", float("nan"))
    out["scale_probe_p99_ms"] = big.get("probe_p99_ms", float("nan"))
    out["scale_grant_over_probe_p99"] = out["scale_grant_p99_ms"] / out["scale_probe_p99_ms"]
    out["scale_idle_agent_rpm"] = big.get("idle_agent_rpm", float("nan"))
    out["scale_renew_ratio"] = ratio("renew:renew")
    out["scale_warm_ratio"] = ratio("warm:warm")
    out["scale_drained_ratio"] = ratio("drain:drained")
    for name in (
        "churn:acquire",
        "churn:release",
        "recall:acquire",
        "renew:renew",
        "warm:warm",
        "drain:drained",
        "open:acquire",
        "recall:sweep",
    ):
        out[f"redis_us_{name.replace(':', '_')}"] = [script_us(base, name), script_us(big, name)]
    for key in (
        "grant_p50_ms",
        "grant_p99_ms",
        "idle_agent_rpm",
        "idle_agent_total_rpm",
        "drain_reach_ms",
        "redis_bytes_per_gpu",
        "redis_bytes_per_lease",
        "server_cpu_us_per_grant",
        "server_cpu_us_per_grant_quiet",
        "board_get_ms",
        "board_bytes",
        "board_full_cpu_ms_per_change",
        "board_full_all_answered_ms",
        "board_full_bytes",
        "board_page_cpu_ms_per_change",
        "board_page_all_answered_ms",
        "board_page_bytes",
        "board_mine_cpu_ms_per_change",
        "board_mine_all_answered_ms",
        "queued",
        "open_statuses",
        "agent_drain",
    ):
        out[key] = [base.get(key), big.get(key)]
    say("")
    say(f"scale bench: {args.gpus} GPUs / {args.base} GPUs, Redis time per script call (slow log):")
    for name in ("acquire", "release", "recall"):
        k = f"scale_{name}_ratio"
        say(f"  {k:24s} {out[k]:7.2f}  {verdict(k, out[k])}")
    for name in ("acquire", "release"):
        k = f"scale_{name}_ratio_quiet"
        say(f"  {k:24s} {out[k]:7.2f}  (the same, agents paused: the scripts' own cost)")
    for name in ("renew", "warm", "drained"):
        k = f"scale_{name}_ratio"
        say(f"  {k:24s} {out[k]:7.2f}  (no target)")
    nan = float("nan")
    g99, rpm = out["scale_grant_p99_ms"], out["scale_idle_agent_rpm"]
    say(
        f"  scale_grant_p99_ms       {g99:7.1f}  {verdict('scale_grant_p99_ms', g99)}  (p50 "
        f"{big.get('grant_p50_ms', nan):.1f} ms at {big.get('open_rate', nan):g}/s, {big.get('queued')} waiting; "
        f"baseline p99 {base.get('grant_p99_ms', nan):.1f} ms at {base.get('open_rate', nan):g}/s)"
    )
    say(
        f"  scale_probe_p99_ms       {out['scale_probe_p99_ms']:7.1f}  (no target: GET /whoami, open loop at the same "
        f"rate in the same window; p50 {big.get('probe_p50_ms', nan):.1f} ms; grant p99 / this "
        f"{out['scale_grant_over_probe_p99']:.2f})"
    )
    total_rpm = big.get("idle_agent_total_rpm", nan)
    say(f"  scale_idle_agent_rpm     {rpm:7.2f}  {verdict('scale_idle_agent_rpm', rpm)}  (all: {total_rpm:.1f}/min)")
    reach, reach0 = big.get("drain_reach_ms", nan), base.get("drain_reach_ms", nan)
    say(f"  drain reaches the agent  {reach:7.1f} ms p50 (baseline {reach0:.1f})")
    say(
        f"  board, {args.followers} open: one change costs the server "
        f"{big.get('board_full_cpu_ms_per_change', nan):.0f} ms of CPU (whole inventory to each; "
        f"{big.get('board_full_bytes') or 0:,} B), {big.get('board_page_cpu_ms_per_change', nan):.0f} ms "
        f"(first page; {big.get('board_page_bytes') or 0:,} B), {big.get('board_mine_cpu_ms_per_change', nan):.0f} ms "
        f"(each user's leases); baseline "
        f"{base.get('board_full_cpu_ms_per_change', nan):.0f} / {base.get('board_page_cpu_ms_per_change', nan):.0f} ms"
    )
    per_gpu, per_lease = big.get("redis_bytes_per_gpu", nan), big.get("redis_bytes_per_lease", nan)
    say(f"  redis memory             {per_gpu:7.0f} B per GPU, {per_lease:.0f} B per live lease")
    out["wall_s"] = round(time.monotonic() - t_start, 1)
    out["sizes"] = {str(k): v for k, v in figs.items()}
    print(_common.json_line(out, first=TARGETS, digits=4), flush=True)


if __name__ == "__main__":
    main()
