#!/usr/bin/env python
"""Another user's grant latency while hostile clients work on the lease server (issue 33, item 5).

    .venv/bin/python bench/hostile_bench.py [--quick] [--quiet-s 10] [--hostile-s 12]

Starts its own redis-server and ``gpulease server`` (default settings: the defaults must hold),
declares simulated nodes and seeds the event log with 20,000 entries and the usage rollups with a
week of hourly rows (100,800: 600 users; --quick: 3,360) straight into Redis, then measures one
user's grant (POST /leases for 1 GPU, then DELETE it, one after the other on one kept-alive
connection) in the pool of 16 GPUs, first quiet; then a **booking flood**: another user (mallory)
books one GPU of that pool for one minute every two minutes from an hour ahead, one POST after
another, until the server refuses her at ``booking_max_per_owner`` (her bookings are read by no
grant until they begin); the grant again, quiet but beside her bookings; then with every hostile
client of findings 5 and 7 of issue 33 and of issue 49 at once, run by a second process (this file
with ``--hostile``):

* slow 60 MB bodies: connections that declare a 60 MB body (with a valid token, and without one)
  and send it a few KB at a time, reconnecting when the server closes them;
* a chunked body trickled a byte at a time (the body timeout ends it), again and again;
* unfinished headers: 200 connections sending a request head a byte every 2 s;
* 300 idle connections that never send anything;
* event log pages at the cap (limit=1000, from the start of the log) on 4 connections of one token,
  each asking again as soon as answered, 429 or not;
* a stream reconnect storm: 4 connections of that token opening GET /events with since= (a
  backlog read each) and hanging up at once, again and again;
* /metrics hammered on 4 kept-alive connections;
* the usage summary: 2 connections of a third user's token (eve: a read budget of its own, not
  the one mallory's log pages spend) looping GET /usage/summary (the default week: every seeded
  row), each asking again as soon as answered, 429 or not.

(Not among them: a request loop no limit paces, such as mallory asking for one more booking at
her cap again and again on one connection: ~800 refusals a second that took the hostile grant's
p50 from ~1.4 to ~2.2 ms here, as a loop of any unpaced request would. A per-user request rate is
not capped yet.)

Printed: the grant p50/p99 quiet, beside the bookings and hostile, the flood's figures, the hostile
clients' answers by kind, the server's RSS before, at its peak during and after the hostile phase;
the last line is one JSON object:

hostile_grant_p99_ratio   the grant's p99 with the hostile clients (and mallory's bookings) / quiet,
                          same run (target <= 2)
booked_grant_p99_ratio    (no target) the grant's p99 beside mallory's bookings / quiet
quiet_grant_p99_ms, booked_grant_p99_ms, hostile_grant_p99_ms, server_rss_growth_mb (peak during
the hostile phase minus before it), flood_bookings (mallory's bookings when refused),
flood_refusal (the refusal's status and code), flood_s, summary_rows, and the rest.

--quick (about 15 s of measuring: quiet 1.5 s, beside the bookings 1.5 s, hostile 3 s, fewer
seeded rows) shows that it runs and what it prints; its ratios are noisy, read a full run's.

The hostile process runs at nice 19: on a machine with few cores its own CPU (hundreds of
connections, thousands of requests) would otherwise be taken from the server by the kernel and
counted against it; at nice 19 the ratio measures what the server does with hostile requests.
It still counts where the cores are busy with other work: the load average is printed at start.
A bench prints, it does not assert. HOSTILE_ONLY=<name part> (e.g. "metrics", "60 MB", "summary")
runs only the hostile clients of that name, to see which one costs what (mallory's bookings stay);
HOSTILE_SKIP=<name part> runs all the others.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402  (puts the repository root on sys.path)

ROOT = _common.ROOT
SPEC = "h1=8xA100-80GB,h2=8xA100-80GB"
PREFIX = "hostile"
SEED_EVENTS = 20_000
POOL = "A100-80GB"
SUMMARY_USERS, SUMMARY_USERS_QUICK = 600, 20  # x 168 hours of rows
FLOOD_START_S = 3600  # mallory's first booking begins an hour ahead, one a minute long every 2 minutes
TARGETS = {"hostile_grant_p99_ratio": ("<=", 2.0)}


# ---- a small HTTP/1.1 client on asyncio streams ----------------------------------------------------------


def request(method: str, path: str, token: str | None = None, body: bytes | None = None, **headers: str) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: gpulease"]
    if token:
        lines.append(f"Authorization: Bearer {token}")
    if body is not None:
        lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    lines += [f"{k.replace('_', '-')}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b"")


async def answer(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """Status and body of one answer (Content-Length framed; chunked bodies are drained)."""
    top = await reader.readuntil(b"\r\n\r\n")
    lines = top.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:] if h)}
    if "content-length" in headers:
        return status, await reader.readexactly(int(headers["content-length"]))
    if headers.get("transfer-encoding") == "chunked":
        out = b""
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            out += await reader.readexactly(size + 2)
            if size == 0:
                return status, out
    return status, b""


# ---- the victim: one user's grants ----------------------------------------------------------------------


async def grants(host: str, port: int, token: str, seconds: float) -> list[float]:
    """Acquire + release pairs, one after another, for ``seconds``: each pair's latency (s)."""
    reader, writer = await asyncio.open_connection(host, port)
    out: list[float] = []
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            t0 = time.perf_counter()
            writer.write(request("POST", "/api/v1/leases", token, json.dumps({"gpus": 1, "ttl": 60}).encode()))
            status, body = await answer(reader)
            if status != 201:
                raise RuntimeError(f"acquire answered {status}: {body[:300]!r}")
            lease = json.loads(body)
            release = json.dumps({"token": lease["token"]}).encode()
            writer.write(request("DELETE", f"/api/v1/leases/{lease['id']}", token, release))
            status, body = await answer(reader)
            if status != 200:
                raise RuntimeError(f"release answered {status}: {body[:300]!r}")
            out.append(time.perf_counter() - t0)
    finally:
        writer.close()
    return out


# ---- the booking flood --------------------------------------------------------------------------------


def flood_body(i: int) -> bytes:
    """Mallory's i-th booking: 1 GPU for a minute, two minutes after the one before."""
    start = time.time() + FLOOD_START_S + i * 120
    return json.dumps({"pool": POOL, "gpus": 1, "start": start, "end": start + 60, "note": f"flood {i}"}).encode()


async def flood(host: str, port: int, token: str) -> tuple[int, int, str]:
    """Book until refused: (bookings made, the refusal's status, its code)."""
    reader, writer = await asyncio.open_connection(host, port)
    made = 0
    try:
        while True:
            writer.write(request("POST", "/api/v1/bookings", token, flood_body(made)))
            status, body = await answer(reader)
            if status != 201:
                return made, status, str(json.loads(body).get("code", "")) if body else ""
            made += 1
    finally:
        writer.close()


# ---- the hostile clients (run in a process of their own: --hostile) ---------------------------------------


class Hostile:
    def __init__(self, host: str, port: int, token: str, summary_token: str) -> None:
        self.host, self.port, self.token, self.summary_token = host, port, token, summary_token
        self.counts: collections.Counter[str] = collections.Counter()
        self.stop = asyncio.Event()

    async def forever(self, name: str, once: Any) -> None:
        """Run ``once`` again and again until stopped; a connection the server closes is opened anew."""
        while not self.stop.is_set():
            try:
                await once()
            except (ConnectionError, asyncio.IncompleteReadError, OSError):
                self.counts[f"{name}: closed by the server"] += 1
                await asyncio.sleep(0.05)  # the next try, as a client's reconnect would

    async def big_body(self, auth: bool) -> None:
        reader, writer = await asyncio.open_connection(self.host, self.port)
        got = asyncio.ensure_future(answer(reader))
        try:
            head = request("POST", "/api/v1/leases", self.token if auth else None)[:-2]
            writer.write(head + b"Content-Type: application/json\r\nContent-Length: 60000000\r\n\r\n")
            name = "60 MB body" + (" (token)" if auth else " (no token)")
            while not self.stop.is_set() and not got.done():
                writer.write(b"x" * 4096)
                with contextlib.suppress(ConnectionError):
                    await writer.drain()
                await asyncio.wait([got], timeout=0.1)
            if got.done():
                status, _ = got.result()
                self.counts[f"{name}: {status}"] += 1
        finally:
            got.cancel()
            writer.close()

    async def trickle_chunked(self) -> None:
        reader, writer = await asyncio.open_connection(self.host, self.port)
        try:
            writer.write(request("POST", "/api/v1/leases", self.token, None, Transfer_Encoding="chunked"))
            while not self.stop.is_set():
                writer.write(b"1\r\nx\r\n")
                await writer.drain()
                await asyncio.sleep(0.5)
                if reader.at_eof():
                    raise ConnectionError
        finally:
            writer.close()

    async def slow_head(self) -> None:
        reader, writer = await asyncio.open_connection(self.host, self.port)
        try:
            for byte in b"GET /api/v1/health HTTP/1.1\r\nHost: gpulease\r\nX-Slow: " + b"x" * 10_000:
                if self.stop.is_set():
                    return
                writer.write(bytes([byte]))
                await writer.drain()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(reader.read(1), 2.0)
                if reader.at_eof():
                    raise ConnectionError
        finally:
            writer.close()

    async def idle(self) -> None:
        reader, writer = await asyncio.open_connection(self.host, self.port)
        try:
            read = asyncio.ensure_future(reader.read(1))
            stop = asyncio.ensure_future(self.stop.wait())
            await asyncio.wait([read, stop], return_when=asyncio.FIRST_COMPLETED)
            stop.cancel()
            if read.done():
                raise ConnectionError
            read.cancel()
        finally:
            writer.close()

    async def loop_requests(self, name: str, path: str, token: str | None, count_asked: bool = False) -> None:
        reader, writer = await asyncio.open_connection(self.host, self.port)
        try:
            while not self.stop.is_set():
                if count_asked:  # (an answer the server paces may not come before the phase ends)
                    self.counts[f"{name}: asked"] += 1
                writer.write(request("GET", path, token))
                status, _ = await answer(reader)
                self.counts[f"{name}: {status}"] += 1
        finally:
            writer.close()

    async def stream_storm(self) -> None:
        reader, writer = await asyncio.open_connection(self.host, self.port)
        try:
            writer.write(request("GET", "/api/v1/events?since=0-0", self.token))
            top = await reader.readuntil(b"\r\n\r\n")
            self.counts[f"stream reconnect: {int(top.split()[1])}"] += 1
        finally:
            writer.close()

    async def run(self, seconds: float) -> dict[str, int]:
        only = os.environ.get("HOSTILE_ONLY", "")
        tasks = []
        for auth in (True, False):
            tasks += [self.forever("60 MB body", lambda a=auth: self.big_body(a)) for _ in range(2)]
        tasks += [self.forever("chunked trickle", self.trickle_chunked) for _ in range(2)]
        tasks += [self.forever("unfinished head", self.slow_head) for _ in range(200)]
        tasks += [self.forever("idle", self.idle) for _ in range(300)]
        page = "/api/v1/events/log?limit=1000"
        tasks += [self.forever("log page", lambda: self.loop_requests("log page", page, self.token)) for _ in range(4)]
        tasks += [self.forever("stream reconnect", self.stream_storm) for _ in range(4)]
        tasks += [self.forever("metrics", lambda: self.loop_requests("metrics", "/metrics", None)) for _ in range(4)]
        summary = "/api/v1/usage/summary"
        tasks += [
            self.forever(
                "usage summary", lambda: self.loop_requests("usage summary", summary, self.summary_token, True)
            )
            for _ in range(2)
        ]
        if only:
            tasks = [t for t in tasks if only in t.cr_frame.f_locals.get("name", "")]
        skip = os.environ.get("HOSTILE_SKIP", "")
        if skip:
            for t in [t for t in tasks if skip in t.cr_frame.f_locals.get("name", "")]:
                t.close()
                tasks.remove(t)
        running = [asyncio.ensure_future(t) for t in tasks]
        await asyncio.sleep(seconds)
        self.stop.set()
        await asyncio.wait(running, timeout=5)
        for t in running:
            t.cancel()
        return dict(self.counts)


def hostile_main(host: str, port: int, token: str, summary_token: str, seconds: float) -> None:
    os.nice(19)  # see the module's docstring: the load generator's own CPU must not be what is measured
    counts = asyncio.run(Hostile(host, port, token, summary_token).run(seconds))
    print(json.dumps(counts), flush=True)


# ---- the run ----------------------------------------------------------------------------------------------


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


async def seed(redis_url: str, summary_users: int) -> tuple[dict[str, str], int]:
    """Nodes, tokens, the event log, and a week of hourly usage rows of ``summary_users`` users
    (what GET /usage/summary reads by default); returns the tokens and the rows written."""
    from lease_server.leasing.lease import LeaseStore
    from lease_server.store import rollup
    from lease_server.store.engine import Engine, connect
    from lease_server.store.keys import Keys

    r = connect(redis_url)
    try:
        await _common.register_all(LeaseStore(Engine(r, _common.settings_for(redis_url, PREFIX))), SPEC)
        pipe = r.pipeline(transaction=False)
        for i in range(SEED_EVENTS):
            data = {"ts": 1_700_000_000_000 + i, "lease": f"l-seed{i:07d}", "user": "seed", "pool": "A100-80GB"}
            pipe.xadd(Keys(PREFIX).events, {"type": "grant", "data": json.dumps(data)})
        await pipe.execute()
        keys, now_h = Keys(PREFIX), int(time.time() * 1000) // rollup.HOUR_MS
        rows = 0
        for hour in range(now_h - 7 * 24, now_h):
            pipe = r.pipeline(transaction=False)
            names = [rollup.field(hour, POOL, f"u{u:04d}") for u in range(summary_users)]
            row = json.dumps({**rollup.empty(), "n": 2, "held": 5400.0, "sampled": 5400.0, "used": 3600.0})
            pipe.hset(keys.rollup, mapping=dict.fromkeys(names, row))
            pipe.zadd(keys.rollup_idx, dict.fromkeys(names, 0))
            await pipe.execute()
            rows += len(names)
    finally:
        await r.aclose()
    tokens = await _common.make_tokens(redis_url, PREFIX, {"ann": "user", "mallory": "user", "eve": "user"})
    return tokens, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="short phases and fewer seeded rows (about a minute)")
    ap.add_argument("--quiet-s", type=float, default=None, help="each quiet phase (default 10 s; --quick 1.5)")
    ap.add_argument("--hostile-s", type=float, default=None, help="the hostile phase (default 12 s; --quick 3)")
    ap.add_argument("--hostile", nargs=4, metavar=("HOST", "PORT", "TOKEN", "SUMMARY_TOKEN"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quiet_s is None:
        args.quiet_s = 1.5 if args.quick else 10.0
    if args.hostile_s is None:
        args.hostile_s = 3.0 if args.quick else 12.0
    if args.hostile:
        hostile_main(args.hostile[0], int(args.hostile[1]), args.hostile[2], args.hostile[3], args.hostile_s)
        return
    out: dict[str, Any] = {}
    from lease_server.node.redis_proc import free_port

    with _common.private_redis("gpulease-hostile-") as (redis, tmp):
        _common.announce(out, "hostile_bench", args.quick, redis)
        tokens, summary_rows = asyncio.run(seed(redis.url, SUMMARY_USERS_QUICK if args.quick else SUMMARY_USERS))
        port = free_port()
        log_path = tmp / "server.log"
        with open(log_path, "wb") as log:
            server = subprocess.Popen(
                [sys.executable, "-m", "lease_server.cli", "server", "--redis-url", redis.url, "--port", str(port)],
                env=_common.child_env(GPULEASE_PREFIX=PREFIX),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=str(ROOT),
            )
        hostile: subprocess.Popen[str] | None = None
        try:
            deadline = time.monotonic() + 30
            while "listening on" not in log_path.read_text(errors="replace"):
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"lease server did not start:\n{log_path.read_text()[-2000:]}")
                time.sleep(0.05)  # a starting process: no event to wait on
            host = "127.0.0.1"
            asyncio.run(grants(host, port, tokens["ann"], 1.0))  # warm up
            quiet = asyncio.run(grants(host, port, tokens["ann"], args.quiet_s))
            t0 = time.monotonic()
            flood_made, flood_status, flood_code = asyncio.run(flood(host, port, tokens["mallory"]))
            flood_s = time.monotonic() - t0
            booked = asyncio.run(grants(host, port, tokens["ann"], args.quiet_s))
            rss_before = rss_mb(server.pid)
            hostile = subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--hostile",
                    host,
                    str(port),
                    tokens["mallory"],
                    tokens["eve"],
                    "--hostile-s",
                    str(args.hostile_s + 4),
                ],
                stdout=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
            peak = [rss_before]

            async def hostile_phase() -> list[float]:
                async def watch() -> None:
                    while True:
                        peak.append(rss_mb(server.pid))
                        await asyncio.sleep(0.25)

                watcher = asyncio.ensure_future(watch())
                await asyncio.sleep(2.0)  # the hostile clients connect
                try:
                    return await grants(host, port, tokens["ann"], args.hostile_s)
                finally:
                    watcher.cancel()

            loud = asyncio.run(hostile_phase())
            stdout, _ = hostile.communicate(timeout=30)
            counts = json.loads(stdout.strip().splitlines()[-1]) if stdout.strip() else {}
            rss_after = rss_mb(server.pid)
        finally:
            if hostile is not None and hostile.poll() is None:
                _common.stop_session(hostile, 5)  # type: ignore[arg-type]
            _common.stop_session(server, 10)  # type: ignore[arg-type]
            refusals = [ln for ln in log_path.read_text(errors="replace").splitlines() if "max_connections" in ln]

    q50, q99 = _common.pct(quiet, 50) * 1000, _common.pct(quiet, 99) * 1000
    b50, b99 = _common.pct(booked, 50) * 1000, _common.pct(booked, 99) * 1000
    h50, h99 = _common.pct(loud, 50) * 1000, _common.pct(loud, 99) * 1000
    ratio = h99 / q99
    _common.say(f"quiet grant (acquire + release) p50 {q50:.2f} ms, p99 {q99:.2f} ms over {len(quiet)} grants")
    _common.say(
        f"booking flood: mallory made {flood_made} bookings of pool {POOL} in {flood_s:.1f} s, then was refused "
        f"{flood_status} {flood_code}"
    )
    _common.say(
        f"grant beside her bookings p50 {b50:.2f} ms, p99 {b99:.2f} ms over {len(booked)} grants "
        f"(booked_grant_p99_ratio {b99 / q99:.2f})"
    )
    _common.say(f"usage rows a summary reads (the default week): {summary_rows}")
    _common.say(f"hostile grant p50 {h50:.2f} ms, p99 {h99:.2f} ms over {len(loud)} grants")
    for name, n in sorted(counts.items()):
        _common.say(f"  hostile {name}: {n}")
    _common.say(f"server connection-cap lines in its log: {len(refusals)}")
    _common.say(
        f"server RSS {rss_before:.1f} MB before, {max(peak):.1f} MB at most during, {rss_after:.1f} MB after the "
        "hostile clients"
    )
    _common.say(f"hostile_grant_p99_ratio {ratio:.2f} " + _common.verdict(TARGETS, "hostile_grant_p99_ratio", ratio))
    out.update(
        {
            "hostile_grant_p99_ratio": round(ratio, 2),
            "booked_grant_p99_ratio": round(b99 / q99, 2),
            "quiet_grant_p99_ms": round(q99, 2),
            "booked_grant_p99_ms": round(b99, 2),
            "hostile_grant_p99_ms": round(h99, 2),
            "quiet_grant_p50_ms": round(q50, 2),
            "hostile_grant_p50_ms": round(h50, 2),
            "quiet_grants": len(quiet),
            "hostile_grants": len(loud),
            "server_rss_growth_mb": round(max(peak) - rss_before, 1),
            "server_rss_mb": round(rss_before, 1),
            "hostile_answers": counts,
            "flood_bookings": flood_made,
            "flood_refusal": f"{flood_status} {flood_code}",
            "flood_s": round(flood_s, 2),
            "summary_rows": summary_rows,
            "quick": args.quick,
        }
    )
    print(_common.json_line(out, first=TARGETS), flush=True)


if __name__ == "__main__":
    main()
