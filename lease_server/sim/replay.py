"""Replay a workload through the real scheduler: the lease server's own Lua scripts on a real Redis,
under a virtual clock.

Every state-changing script takes the virtual "now" as ``ARGV[1]`` (``""`` = Redis ``TIME`` in
production), so the allocation, queue, fair share and dispatch code that runs here is exactly the
code that serves a live cluster. Each cell is an ``acquire`` (waiting as long as it takes) when it
becomes ready and a ``release`` when its GPUs have been busy for its duration; the next cell of its
session becomes ready after its think time. A cell granted from the queue is learnt from the
``grant`` entry that dispatch writes to the event stream.

Speed: all calls of one virtual instant go to Redis in one pipeline (one round trip), the commands
are packed once per script (the keys and constant arguments never change) and sent over a plain
socket with the ``hiredis`` reply parser; the event stream is read only while someone is queued.
"""

from __future__ import annotations

import asyncio
import heapq
import json
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import hiredis
import numpy as np

from ..config import Settings
from ..inventory import Gpu, NodeInventory
from ..keys import Keys
from ..scripts import Code, source
from .result import Result, intervals
from .workload import Workload

# The virtual clock starts here: 2021-06-01T00:00:00Z, the first day of the NotebookOS June trace.
EPOCH_MS = 1_622_505_600_000
FOREVER_MS = 10 * 365 * 86_400_000  # a lease ttl / wait / node heartbeat that never runs out
POOL = "sim"

Progress = Callable[[int], None]


def cluster(gpus: int, node_gpus: int = 8) -> list[int]:
    """``gpus`` GPUs as nodes of ``node_gpus`` (the last node takes the remainder)."""
    if gpus < 1 or node_gpus < 1:
        raise ValueError("a cluster needs at least one GPU and nodes of at least one GPU")
    full, rest = divmod(gpus, node_gpus)
    return [node_gpus] * full + ([rest] if rest else [])


def inventories(nodes: Sequence[int], pool: str = POOL) -> list[NodeInventory]:
    return [
        NodeInventory(f"n{i:04d}", pool, [Gpu(k, f"sim-{i}-{k}", "sim", 0) for k in range(n)])
        for i, n in enumerate(nodes)
    ]


def _arg(value: object) -> bytes:
    b = value if isinstance(value, bytes) else str(value).encode()
    return b"$%d\r\n%s\r\n" % (len(b), b)


def _command(*parts: object) -> bytes:
    return b"*%d\r\n" % len(parts) + b"".join(_arg(p) for p in parts)


class _Script:
    """One script's EVALSHA, packed once up to the virtual now; per call only its own ARGV is added."""

    def __init__(self, sha: str, keys: list[str], common_tail: list[object], n_args: int) -> None:
        self.head = (
            b"*%d\r\n" % (3 + len(keys) + 1 + len(common_tail) + n_args)
            + _arg(b"EVALSHA")
            + _arg(sha)
            + _arg(len(keys))
            + b"".join(_arg(k) for k in keys)
        )
        self.tail = b"".join(_arg(x) for x in common_tail)
        self.n_args = n_args

    def pack(self, now: int, args: bytes) -> bytes:
        """``args``: this call's own ARGV, already packed (``n_args`` items)."""
        return self.head + _arg(now) + self.tail + args


class _Wire:
    """A plain connection to Redis: send a batch of packed commands, read that many replies."""

    def __init__(self, url: str) -> None:
        u = urlparse(url)
        self.sock = socket.create_connection((u.hostname or "127.0.0.1", u.port or 6379))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.reader = hiredis.Reader()
        db = (u.path or "/0").lstrip("/") or "0"
        if u.password:
            self.call([_command("AUTH", *([u.username] if u.username else []), u.password)])
        if db != "0":
            self.call([_command("SELECT", db)])

    def call(self, commands: list[bytes]) -> list[Any]:
        self.sock.sendall(b"".join(commands))
        out: list[Any] = []
        reader, n = self.reader, len(commands)
        while len(out) < n:
            reply = reader.gets()
            if reply is False:
                data = self.sock.recv(1 << 20)
                if not data:
                    raise ConnectionError("redis closed the connection during a replay")
                reader.feed(data)
                continue
            if isinstance(reply, hiredis.ReplyError):
                raise RuntimeError(f"redis refused a replay command: {reply}")
            out.append(reply)
        return out

    def close(self) -> None:
        self.sock.close()


def _token(reply_json: bytes) -> int:
    """The fencing token of a lease record (cjson output), without decoding the whole record."""
    i = reply_json.index(b'"token":') + 8
    j = i
    while reply_json[j : j + 1].isdigit():
        j += 1
    return int(reply_json[i:j])


@dataclass
class ReplaySetup:
    """Where and how to replay: a Redis, a key prefix of its own, the scheduler's settings."""

    redis_url: str
    prefix: str
    settings: Settings = field(default_factory=Settings)
    keep: bool = False  # leave the keys in Redis afterwards (to read the event log)


async def _register(setup: ReplaySetup, invs: list[NodeInventory]) -> None:
    """Declare the nodes through the inventory module, alive for good (no agent heartbeats here)."""
    from redis.asyncio import Redis

    from ..inventory import register
    from ..lease import LeaseStore

    r = Redis.from_url(setup.redis_url, decode_responses=True)
    try:
        store = LeaseStore(r, setup.settings)
        if await r.exists(*store.keys.all()):
            raise RuntimeError(f"key prefix {setup.prefix!r} is already in use in {setup.redis_url}")
        for inv in invs:
            await register(store, inv, alive_s=FOREVER_MS / 1000)
    finally:
        await r.aclose()


def lease(
    w: Workload,
    nodes: Sequence[int],
    setup: ReplaySetup,
    progress: Progress | None = None,
    policy: str = "lease",
) -> Result:
    """Per-cell leases through the real acquire / release scripts and the real queue."""
    settings = setup.settings
    keys = Keys(setup.prefix)
    core = keys.core()
    invs = inventories(nodes)
    asyncio.run(_register(setup, invs))
    wire = _Wire(setup.redis_url)
    try:
        return _run(w, nodes, wire, keys, core, settings, progress, policy)
    finally:
        if not setup.keep:
            wire.call([_command("DEL", *keys.all())])
        wire.close()


def _run(
    w: Workload,
    nodes: Sequence[int],
    wire: _Wire,
    keys: Keys,
    core: list[str],
    settings: Settings,
    progress: Progress | None,
    policy: str,
) -> Result:
    common_tail: list[object] = [
        settings.event_log_max,
        settings.fair_share_half_life,
        int(settings.ended_retention * 1000),
    ]
    sha = {name: wire.call([_command("SCRIPT", "LOAD", source(name))])[0].decode() for name in ("acquire", "release")}
    # acquire's ARGV after the common four: id, user, pool, gpus, ttl, wait, label, session[, teams]
    acquire_extra = [b""] if "ARGV[13]" in source("acquire") else []
    acq = _Script(sha["acquire"], core, common_tail, 8 + len(acquire_extra))
    rel = _Script(sha["release"], core, common_tail, 7)
    events_key = keys.events

    n = w.n_cells
    user_b = [u.encode() for u in w.users]
    cell_user = w.cell_user.tolist()
    cell_gpus = w.cell_gpus.tolist()
    dur = w.dur.tolist()
    gap = w.gap.tolist()
    session = w.session.tolist()
    is_last = np.zeros(n, dtype=bool)
    is_last[w.first + w.count - 1] = True
    last = is_last.tolist()
    pool_b, ttl_b, wait_b = _arg(POOL), _arg(FOREVER_MS), _arg(FOREVER_MS)
    extra_b = b"".join(_arg(x) for x in acquire_extra)
    release_tail = _arg(b"") + b"%s" + _arg(b"0") + _arg(b"released") + _arg(b"cell returned") + _arg(b"")

    def acquire_args(c: int) -> bytes:
        return (
            _arg(b"c%d" % c)
            + _arg(user_b[cell_user[c]])
            + pool_b
            + _arg(cell_gpus[c])
            + ttl_b
            + wait_b
            + _arg(w.label[c] if c < len(w.label) else "")
            + _arg(b"s%d" % session[c])
            + extra_b
        )

    def release_args(c: int) -> bytes:
        return _arg(b"c%d" % c) + release_tail % _arg(user_b[cell_user[c]])

    ready = np.zeros(n, dtype=np.int64)
    start = np.full(n, -1, dtype=np.int64)
    token = np.zeros(n, dtype=np.int64)
    heap: list[tuple[int, int, int]] = [(int(t), 1, int(c)) for t, c in zip(w.start, w.first, strict=True)]
    heapq.heapify(heap)
    waiting: set[int] = set()
    last_id = b"0-0"
    calls = batches = 0
    t_wall = time.perf_counter()
    t_first = int(w.start.min()) if w.n_sessions else 0
    t = t_first

    def take_grants(entries: list[Any], now: int) -> None:
        nonlocal last_id
        for entry_id, fields in entries:
            last_id = entry_id
            if fields[1] != b"grant":
                continue
            d = json.loads(fields[3])
            lid = d["lease"]
            c = int(lid[1:])
            if c in waiting:
                waiting.discard(c)
                at = int(d["ts"]) - EPOCH_MS
                start[c] = at
                token[c] = int(d["token"])
                heapq.heappush(heap, (at + dur[c], 0, c))

    while heap:
        t = heap[0][0]
        releases: list[int] = []
        acquires: list[int] = []
        while heap and heap[0][0] == t:
            _, kind, c = heapq.heappop(heap)
            (releases if kind == 0 else acquires).append(c)
        now = t + EPOCH_MS
        cmds: list[bytes] = []
        read_before = not waiting
        if read_before:
            cmds.append(_command("XREVRANGE", events_key, "+", "-", "COUNT", "1"))
        for c in releases:
            cmds.append(rel.pack(now, release_args(c)))
            if not last[c]:
                # the next cell of the session: ready after its think time (now, if it has none)
                if gap[c + 1] == 0:
                    acquires.append(c + 1)
                else:
                    heapq.heappush(heap, (t + gap[c + 1], 1, c + 1))
        for c in acquires:
            ready[c] = t
            cmds.append(acq.pack(now, acquire_args(c)))
        if not read_before:
            cmds.append(_command("XRANGE", events_key, b"(" + last_id, "+"))
        replies = wire.call(cmds)
        calls += len(releases) + len(acquires)
        batches += 1
        k = 0
        if read_before:
            newest = replies[0]
            if newest:
                last_id = newest[0][0]
            k = 1
        for c in releases:
            if replies[k][0] != Code.OK:
                raise RuntimeError(f"release of cell {c} at {t} ms answered {replies[k]!r}")
            k += 1
        queued = False
        for c in acquires:
            code = replies[k][0]
            if code == Code.OK:
                start[c] = t
                token[c] = _token(replies[k][1])
                heapq.heappush(heap, (t + dur[c], 0, c))
            elif code == Code.QUEUED:
                waiting.add(c)
                queued = True
            else:
                raise RuntimeError(f"acquire of cell {c} ({cell_gpus[c]} GPUs) at {t} ms answered {replies[k]!r}")
            k += 1
        if not read_before:
            take_grants(replies[k], t)
        elif queued:
            # someone queued in this batch; a later call of the same batch may already have served them
            take_grants(wire.call([_command("XRANGE", events_key, b"(" + last_id, "+")])[0], t)
        if progress is not None and batches % 1024 == 0:
            progress(t)
    if waiting:
        raise RuntimeError(f"{len(waiting)} cells were never granted (a request no node can hold?)")
    wall = time.perf_counter() - t_wall
    end = start + w.dur
    span_h = (int(end.max()) - t_first) / 3_600_000 if n else 0.0
    return Result(
        policy,
        int(sum(nodes)),
        ready,
        start,
        order=np.argsort(token, kind="stable"),
        wall_s=wall,
        extra={"script_calls": calls, "round_trips": batches, "sim_hours": span_h},
        **intervals(start.tolist(), end.tolist(), cell_gpus, cell_user),
    )
