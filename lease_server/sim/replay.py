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
import dataclasses
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
from ..leasing.inventory import Gpu, NodeInventory
from ..leasing.lease import WAITER_GRACE_MS
from ..store.keys import Keys
from ..store.scripts import Acquire, Code, Common, Release, ScriptCall, Sweep, Warm, declared_keys, source
from .bookings import Booking
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


def _pack(argv: list[Any]) -> bytes:
    return b"".join(_arg(a) for a in argv)


def _command(*parts: object) -> bytes:
    return b"*%d\r\n" % len(parts) + b"".join(_arg(p) for p in parts)


class _Script:
    """One script's EVALSHA, packed once up to the virtual now; per call only its own ARGV is added."""

    def __init__(self, sha: str, keys: list[str], common_tail: list[object], call: type[ScriptCall]) -> None:
        n_args = len(dataclasses.fields(call))  # type: ignore[arg-type]
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


def _int_field(reply_json: bytes, name: bytes) -> int:
    """An integer field of a lease record (cjson output), without decoding the whole record."""
    i = reply_json.index(b'"' + name + b'":') + len(name) + 3
    j = i
    while reply_json[j : j + 1].isdigit():
        j += 1
    return int(reply_json[i:j])


def _str_field(reply_json: bytes, name: bytes) -> str:
    """A string field (without escapes: ids, node names) of a record in cjson output."""
    i = reply_json.index(b'"' + name + b'":"') + len(name) + 4
    return reply_json[i : reply_json.index(b'"', i)].decode()


def _cell_of(lease_id: str) -> int:
    """Cell of a lease id: ``c<cell>`` for its first run, ``c<cell>.<attempt>`` for a re-run."""
    return int(lease_id[1:].split(".", 1)[0])


@dataclass
class ReplaySetup:
    """Where and how to replay: a Redis, a key prefix of its own, the scheduler's settings."""

    redis_url: str
    prefix: str
    settings: Settings = field(default_factory=Settings)
    keep: bool = False  # leave the keys in Redis afterwards (to read the event log)


async def _register(
    setup: ReplaySetup, invs: list[NodeInventory], bookings: Sequence[Booking] = (), now_ms: int = EPOCH_MS
) -> None:
    """Declare the nodes through the inventory module, alive for good (no agent heartbeats here),
    and make the teams' bookings through the bookings module."""
    from redis.asyncio import Redis

    from ..leasing.bookings import Bookings
    from ..leasing.inventory import register
    from ..store.engine import Engine

    r = Redis.from_url(setup.redis_url, decode_responses=True)
    try:
        engine = Engine(r, setup.settings)
        if await r.exists(*engine.keys.all()):
            raise RuntimeError(f"key prefix {setup.prefix!r} is already in use in {setup.redis_url}")
        for inv in invs:
            await register(engine, inv, alive_s=FOREVER_MS / 1000)
        book = Bookings(engine)
        for b in bookings:
            members = setup.settings.teams[b.team]
            body = {
                "pool": POOL,
                "gpus": b.gpus,
                "start": (EPOCH_MS + b.start_ms) / 1000,
                "end": (EPOCH_MS + b.end_ms) / 1000,
                "repeat": "weekly",
                "occurrences": b.occurrences,
                "owner": f"team:{b.team}",
                "note": "simulated team booking",
            }
            await book.create(members[0], body, teams=(b.team,), now_ms=now_ms)
    finally:
        await r.aclose()


def lease(
    w: Workload,
    nodes: Sequence[int],
    setup: ReplaySetup,
    progress: Progress | None = None,
    policy: str = "lease",
    bookings: Sequence[Booking] = (),
    suspend_gpus: int = 1,
    suspend_keep_s: float = 0.0,
) -> Result:
    """Per-cell leases through the real acquire / release scripts and the real queue. With
    ``bookings`` (policy ``lease+booking``; their teams in ``setup.settings.teams``) the teams' bookings
    are made first, each cell's request carries its user's teams, and the replay runs the sweeper
    whenever a recall notice or a booking's no-show check falls due."""
    settings = setup.settings
    keys = Keys(setup.prefix)
    invs = inventories(nodes)
    t0 = int(w.start.min()) if w.n_sessions else 0
    asyncio.run(_register(setup, invs, bookings, EPOCH_MS + t0))
    wire = _Wire(setup.redis_url)
    try:
        return _Replay(w, nodes, wire, keys, settings, policy, bool(bookings), suspend_gpus, suspend_keep_s).run(
            progress
        )
    finally:
        if not setup.keep:
            wire.call([_command("DEL", *keys.all())])
        wire.close()


# Kinds of the items of one round trip (what each reply answers).
_REL, _ACQ, _PREDICTED, _MARK, _READ, _SWEEP, _DUE, _WARM, _RESUME, _RESUMED = range(10)
# Kinds of the replay's own timeline, in the order they run within one virtual instant: a cell's
# GPUs are done, a warm lease is given up (evicted, or warm_max), a cell asks for GPUs.
_END, _DROP, _READY = range(3)
# lease-warm: how long a kernel takes from its warm lease's `evicting` to its release (it ends the
# worker and sees it gone; bench/warm_bench.py measures the whole eviction at a few hundred ms).
EVICT_MS = 300
# lease-warm's suspend to host (magics/warm.py, lease_server/node/onhost.py): an evicted one-GPU warm
# worker is suspended, not ended: its GPU is free once its GPU state is in host memory (EVICT_MS plus
# the trace's vram at SUSPEND_GBPS), and its session's next cell restores it (at RESTORE_GBPS, the
# cell holding its new GPU meanwhile) if that cell asks for one GPU, lands on the worker's node and
# comes within warm_max of the worker's last cell. gpusched's published figures (H100) until ours are
# measured on a GPU (tests/gpu/gpu_run.py's suspend step).
SUSPEND_GBPS = 2.5
RESTORE_GBPS = 4.0
SWEEP_LIMIT = 500
WINDOW = 4096  # most commands in one round trip


def _transfer_ms(vram_mb: int, gbps: float) -> int:
    """Milliseconds to move a cell's trace GPU memory (MB per GPU) at ``gbps`` GB/s."""
    return int(vram_mb * 2**20 / (gbps * 1e9) * 1000)


class _Replay:
    """The replay's state and loop.

    Speed: the driver mirrors how many GPUs each node has free, and the allocation of an acquire
    while nobody is queued (``acquire.lua``'s fast path, or dispatch with the request alone in the
    queue when a booking is in force: best fit, the node with the fewest free GPUs that has enough,
    ties by name) exactly. So while nobody waits, it knows which acquires will be granted at once and
    on which node without asking: it sends every virtual instant up to the first acquire that will
    queue, or the next sweep, in one round trip (up to ``WINDOW`` commands), and checks every reply
    against what it predicted. While someone waits each instant is one round trip, since dispatch's
    choices depend on fair share. The event stream is read only when a grant from the queue or a
    revocation may have happened.
    """

    def __init__(
        self,
        w: Workload,
        nodes: Sequence[int],
        wire: _Wire,
        keys: Keys,
        settings: Settings,
        policy: str,
        booked: bool,
        suspend_gpus: int = 1,
        suspend_keep_s: float = 0.0,
    ) -> None:
        self.w, self.nodes, self.wire, self.keys, self.policy, self.booked = w, nodes, wire, keys, policy, booked

        def keys_of(script: str) -> list[str]:
            return [getattr(keys, k) for k in declared_keys(script)]

        # Common(...).argv() after the virtual now: the same arguments the server sends (epoch 0:
        # the replay's private prefix has its own fencing counter).
        common_tail: list[object] = Common(
            0, settings.event_log_max, settings.fair_share_half_life, int(settings.ended_retention * 1000)
        ).argv()[1:]
        sha = {
            name: wire.call([_command("SCRIPT", "LOAD", source(name))])[0].decode()
            for name in ("acquire", "release", "sweep", "warm")
        }
        # Every call's ARGV comes from the script's wrapper (lease_server.store.scripts): what the server
        # sends, the replay sends, argument for argument.
        self.acq = _Script(sha["acquire"], keys_of("acquire"), common_tail, Acquire)
        self.rel = _Script(sha["release"], keys_of("release"), common_tail, Release)
        self.sweep = _Script(sha["sweep"], keys_of("sweep"), common_tail, Sweep)
        self.warm = _Script(sha["warm"], keys_of("warm"), common_tail, Warm)
        # lease-warm: a finished cell's lease stays warm for its session's next cell (warm.lua)
        self.keep_warm = policy == "lease-warm"
        self.warm_max_ms = int(settings.warm_max * 1000)
        self.lease_of: list[str] = [""] * w.n_cells  # the lease a cell runs under (a warm one: an earlier cell's)
        self.warm_of: dict[int, tuple[str, int, int]] = {}  # session -> (its warm lease, the cell it ran, since)
        self.warm_session: dict[str, int] = {}  # warm lease -> its session
        self.evicting: set[int] = set()  # sessions whose warm lease is being evicted
        self.warm_starts = self.evictions = 0
        self.warm_ms = 0  # GPU-ms kept warm (lendable, not charged as use)
        self.warm_on: dict[str, int] = {}  # node -> its GPUs held by warm leases (allocate's fit counts them)
        # suspend to host (workers of at most suspend_gpus GPUs): session -> (the node its suspended
        # worker is on, until when it is kept, its GPUs)
        self.suspend_gpus = suspend_gpus
        # a what-if (0: what the server does, warm_max ends a suspended worker): warm_max suspends the
        # warm worker instead of ending it, kept until this long after its last cell
        self.suspend_keep_ms = int(suspend_keep_s * 1000)
        self.suspended: dict[int, tuple[str, int, int]] = {}
        self.restore_of: dict[int, str] = {}  # cell -> the node of the suspended worker it would restore
        self.suspends = self.restores = self.suspend_lost = 0
        self.restore_ms = 0  # GPU-ms spent restoring (held by the cells, beyond their trace duration)
        vram = w.vram_mb if w.vram_mb is not None else np.zeros(w.n_cells, dtype=np.int64)
        self.vram_mb = vram.tolist()
        self.sweep_args = _pack(Sweep(SWEEP_LIMIT, WAITER_GRACE_MS).argv())
        n = w.n_cells
        self.users = list(w.users)
        teams = settings.teams if booked else {}
        self.teams = [",".join(sorted(t for t, m in teams.items() if u in m)) for u in w.users]
        self.cell_user = w.cell_user.tolist()
        self.cell_gpus = w.cell_gpus.tolist()
        self.dur = w.dur.tolist()
        self.gap = w.gap.tolist()
        self.session = w.session.tolist()
        is_last = np.zeros(n, dtype=bool)
        is_last[w.first + w.count - 1] = True
        self.last = is_last.tolist()
        self.ready = np.zeros(n, dtype=np.int64)
        self.start = np.full(n, -1, dtype=np.int64)
        self.token = np.zeros(n, dtype=np.int64)
        self.end_at = [-1] * n  # when the running lease of a cell is released (-1: none running)
        self.node_of = [""] * n
        self.attempt = [0] * n
        self.heap: list[tuple[int, int, int]] = [
            (int(t), _READY, int(c)) for t, c in zip(w.start, w.first, strict=True)
        ]
        heapq.heapify(self.heap)
        self.waiting: set[int] = set()
        self.last_id = b"0-0"
        self.next_sweep: int | None = None
        self.calls = self.round_trips = self.sweeps = 0
        self.lost: list[tuple[int, int, int, int]] = []  # revoked runs: start, end, gpus, user
        self.booking_grants = self.borrowed_grants = self.no_shows = 0
        # the mirror of free GPUs per node: by_free[k] = nodes with k free
        self.node_names = [inv.node for inv in inventories(nodes)]
        self.free = {name: size for name, size in zip(self.node_names, nodes, strict=True)}
        self.by_free: list[set[str]] = [set() for _ in range(max(nodes) + 1)]
        for name, size in self.free.items():
            self.by_free[size].add(name)

    # ---- the mirror of free GPUs ----------------------------------------------------------

    def _take(self, node: str, g: int) -> None:
        k = self.free[node]
        self.by_free[k].discard(node)
        self.free[node] = k - g
        self.by_free[k - g].add(node)

    def _give(self, node: str, g: int) -> None:
        k = self.free[node]
        self.by_free[k].discard(node)
        self.free[node] = k + g
        self.by_free[k + g].add(node)

    def _place(self, c: int) -> str | None:
        """Where acquire.lua puts cell ``c`` when nobody waits: the node of its session's suspended
        worker if that has the GPUs free (allocate_preferred), else best fit."""
        g, prefer = self.cell_gpus[c], self.restore_of.get(c)
        if prefer is not None and self.free[prefer] >= g:
            return prefer
        return self._best_fit(g)

    def _best_fit(self, g: int) -> str | None:
        by_free = self.by_free
        if not self.warm_of:
            for k in range(g, len(by_free)):
                if by_free[k]:
                    return min(by_free[k])
            return None
        # allocate() with warm leases in the pool: of the 16 best fits, the fewest free + warm GPUs
        cands: list[tuple[int, str]] = []
        for k in range(g, len(by_free)):
            cands += [(k, name) for name in sorted(by_free[k])[: 16 - len(cands)]]
            if len(cands) == 16:
                break
        if not cands:
            return None
        return min(cands, key=lambda kn: kn[0] + self.warm_on.get(kn[1], 0))[1]

    # ---- commands -------------------------------------------------------------------------

    def _lease_id(self, c: int) -> str:
        a = self.attempt[c]
        return f"c{c}" if a == 0 else f"c{c}.{a}"

    def _acquire_args(self, c: int) -> bytes:
        u, g, w = self.cell_user[c], self.cell_gpus[c], self.w
        label = w.label[c] if c < len(w.label) else ""
        call = Acquire(
            self._lease_id(c),
            self.users[u],
            POOL,
            g,
            ttl_ms=FOREVER_MS,
            wait_ms=FOREVER_MS,
            label=label,
            session=f"s{self.session[c]}",
            teams=self.teams[u],
            max_queued=2**31 - 1,  # a replay models scheduling, not the server's guard against floods
            prefer_node=self.restore_of.get(c, ""),  # (its session's suspended worker's node, as the magic asks)
        )
        return _pack(call.argv())

    def _release_args(self, c: int, lease_id: str = "") -> bytes:
        user = self.users[self.cell_user[c]]
        return _pack(Release(lease_id or self._lease_id(c), "", user, False, "released", "cell returned").argv())

    def _warm_args(self, c: int, lease_id: str, on: bool) -> bytes:
        return _pack(Warm(lease_id, "", self.users[self.cell_user[c]], on).argv())

    def _drop_warm(self, s: int, t: int) -> tuple[str, int]:
        """Session ``s`` gives up its warm lease at ``t``: (the lease, the cell it ran)."""
        lease_id, c0, since = self.warm_of.pop(s)
        del self.warm_session[lease_id]
        self.warm_on[self.node_of[c0]] -= self.cell_gpus[c0]
        self.evicting.discard(s)
        self.warm_ms += (t - since) * self.cell_gpus[c0]
        return lease_id, c0

    def _granted(self, c: int, at: int, node: str, token: int, lease_id: str = "") -> None:
        self.lease_of[c] = lease_id or self._lease_id(c)
        self.start[c] = at
        self.token[c] = token
        self.node_of[c] = node
        extra = 0
        worker_on = self.restore_of.pop(c, None)
        if worker_on is not None:
            if worker_on == node:  # restored onto its new GPU before the cell runs
                extra = _transfer_ms(self.vram_mb[c], RESTORE_GBPS)
                self.restores += 1
                self.restore_ms += extra
            else:  # a process cannot move: ended, the cell starts cold
                self.suspend_lost += 1
        self.end_at[c] = at + self.dur[c] + extra
        heapq.heappush(self.heap, (at + self.dur[c] + extra, _END, c))

    def _suspend_ms(self, c0: int) -> int | None:
        """How long the eviction of cell ``c0``'s warm worker takes if it is suspended (None: ended)."""
        if not self.keep_warm or self.cell_gpus[c0] > self.suspend_gpus:
            return None
        return EVICT_MS + _transfer_ms(self.vram_mb[c0], SUSPEND_GBPS)

    def _take_events(self, entries: list[Any], t: int) -> None:
        for entry_id, fields in entries:
            self.last_id = entry_id
            kind = fields[1]
            if kind == b"grant":
                c = _cell_of(_str_field(fields[3], b"lease"))
                if c in self.waiting:  # else granted at once: its reply told the replay already
                    d = json.loads(fields[3])
                    self.waiting.discard(c)
                    self._take(d["node"], self.cell_gpus[c])
                    self._granted(c, int(d["ts"]) - EPOCH_MS, d["node"], int(d["token"]))
                    self.booking_grants += "reservation" in d
                    self.borrowed_grants += "borrowed" in d
            elif kind == b"revoked":
                d = json.loads(fields[3])
                c = _cell_of(d["lease"])
                if self.end_at[c] < 0:
                    raise RuntimeError(f"lease {d['lease']} was revoked, but the replay has it ended")
                at = int(d["ts"]) - EPOCH_MS
                g = self.cell_gpus[c]
                self.lost.append((int(self.start[c]), at, g, self.cell_user[c]))
                self._give(self.node_of[c], g)
                self.end_at[c] = -1
                self.attempt[c] += 1
                heapq.heappush(self.heap, (at, _READY, c))  # the person runs the cell again at once
            elif kind == b"reservation_no_show":
                self.no_shows += 1
            elif kind == b"evicting":
                d = json.loads(fields[3])
                s = self.warm_session.get(d["lease"])
                if s is not None and s not in self.evicting:
                    self.evicting.add(s)
                    self.evictions += 1
                    at = int(d["ts"]) - EPOCH_MS
                    c0 = self.warm_of[s][1]
                    took = self._suspend_ms(c0)
                    if took is not None:  # off the GPU when its state is on the host; the worker lives on
                        self.suspends += 1
                        until = self.warm_of[s][2] + max(self.warm_max_ms, self.suspend_keep_ms)
                        self.suspended[s] = (self.node_of[c0], until, self.cell_gpus[c0])
                    heapq.heappush(self.heap, (at + (EVICT_MS if took is None else took), _DROP, c0))

    # ---- the loop -------------------------------------------------------------------------

    def run(self, progress: Progress | None) -> Result:
        w, heap = self.w, self.heap
        wire, acq, rel = self.wire, self.acq, self.rel
        gap, last, cell_gpus = self.gap, self.last, self.cell_gpus
        end_at, node_of = self.end_at, self.node_of
        events_key = self.keys.events
        due_cmds = [
            _command("ZRANGE", self.keys.recall, 0, 0, "WITHSCORES"),
            _command("ZRANGE", self.keys.booking_due, 0, 0, "WITHSCORES"),
        ]
        if self.booked:
            self._due(wire.call(due_cmds))
        t_wall = time.perf_counter()
        t_first = int(w.start.min()) if w.n_sessions else 0
        next_progress = 0
        while heap or self.waiting:
            speculate = not self.waiting
            cmds: list[bytes] = []
            plan: list[tuple[int, int, int]] = []  # (kind, cell, virtual ms)
            marked = bool(self.waiting)  # a read after the batch is needed and its start is known
            stop = False
            t = -1
            while not stop:
                if heap:
                    t = heap[0][0]
                    if self.next_sweep is not None and self.next_sweep < t:
                        t = self.next_sweep
                elif self.waiting and self.next_sweep is not None:
                    t = self.next_sweep
                elif self.waiting:
                    raise RuntimeError(f"{len(self.waiting)} cells were never granted (a request no node can hold?)")
                else:
                    break
                releases: list[int] = []
                drops: list[int] = []
                acquires: list[int] = []
                while heap and heap[0][0] == t:
                    _, kind, c = heapq.heappop(heap)
                    if kind == _READY:
                        acquires.append(c)
                    elif kind == _DROP:
                        drops.append(c)
                    elif end_at[c] == t:  # else: revoked meanwhile (a re-run has its own release)
                        releases.append(c)
                now = t + EPOCH_MS
                for c in releases:
                    if self.keep_warm:  # the lease stays, warm, for the session's next cell
                        s, lease_id = self.session[c], self.lease_of[c]
                        cmds.append(self.warm.pack(now, self._warm_args(c, lease_id, True)))
                        plan.append((_WARM, c, t))
                        self.warm_of[s] = (lease_id, c, t)
                        self.warm_session[lease_id] = s
                        self.warm_on[node_of[c]] = self.warm_on.get(node_of[c], 0) + cell_gpus[c]
                        heapq.heappush(heap, (t + self.warm_max_ms - 1, _DROP, c))
                    else:
                        cmds.append(rel.pack(now, self._release_args(c, self.lease_of[c])))
                        plan.append((_REL, c, t))
                        self._give(node_of[c], cell_gpus[c])
                    end_at[c] = -1
                    if not last[c]:
                        # the next cell of the session: ready after its think time (now, if it has none)
                        if gap[c + 1] == 0:
                            acquires.append(c + 1)
                        else:
                            heapq.heappush(heap, (t + gap[c + 1], _READY, c + 1))
                for c in drops:  # evicted (the kernel ended the worker), or warm_max ran out
                    s = self.session[c]
                    if s in self.warm_of and self.warm_of[s][1] == c:
                        since = self.warm_of[s][2]
                        if self.suspend_keep_ms and s not in self.evicting and cell_gpus[c] <= self.suspend_gpus:
                            # the what-if: warm_max suspends the worker to host, kept suspend_keep longer
                            self.suspends += 1
                            self.suspended[s] = (node_of[c], since + self.suspend_keep_ms, cell_gpus[c])
                        lease_id, _ = self._drop_warm(s, t)
                        cmds.append(rel.pack(now, self._release_args(c, lease_id)))
                        plan.append((_REL, c, t))
                        self._give(node_of[c], cell_gpus[c])
                if self.next_sweep is not None and self.next_sweep <= t:
                    if not marked:
                        cmds.append(_command("XREVRANGE", events_key, "+", "-", "COUNT", "1"))
                        plan.append((_MARK, -1, t))
                        marked = True
                    cmds.append(self.sweep.pack(now, self.sweep_args))
                    plan.append((_SWEEP, -1, t))
                    self.next_sweep = None
                    speculate = False  # it may revoke leases, and dispatch
                for c in acquires:
                    if self.attempt[c] == 0:
                        self.ready[c] = t
                    s = self.session[c]
                    sus = self.suspended.pop(s, None)
                    if sus is not None:  # its worker was suspended: restored if this cell fits it
                        if cell_gpus[c] == sus[2] and t <= sus[1]:
                            self.restore_of[c] = sus[0]
                        else:  # other GPUs, or past warm_max: ended, a cold start
                            self.suspend_lost += 1
                    if s in self.warm_of:
                        lease_id, c0, _ = self.warm_of[s]
                        if cell_gpus[c] == cell_gpus[c0] and s not in self.evicting:
                            # The warm lease runs this cell at once (the kernel's warm worker).
                            cmds.append(self.warm.pack(now, self._warm_args(c, lease_id, False)))
                            if speculate:  # nobody waits: nothing can be evicting it
                                self._drop_warm(s, t)
                                self._granted(c, t, node_of[c0], 0, lease_id)
                                self.warm_starts += 1
                                plan.append((_RESUMED, c, t))
                            else:
                                plan.append((_RESUME, c, t))
                            continue
                        # Other GPUs, or being evicted: the kernel ends its warm worker, then asks.
                        lease_id, c0 = self._drop_warm(s, t)
                        cmds.append(rel.pack(now, self._release_args(c0, lease_id)))
                        plan.append((_REL, c0, t))
                        self._give(node_of[c0], cell_gpus[c0])
                    args = self._acquire_args(c)  # (before _granted: its preferred node is this cell's until then)
                    node = self._place(c) if speculate else None
                    if node is not None:
                        self._take(node, cell_gpus[c])
                        self._granted(c, t, node, 0)
                        plan.append((_PREDICTED, c, t))
                    else:
                        if not marked:
                            cmds.append(_command("XREVRANGE", events_key, "+", "-", "COUNT", "1"))
                            plan.append((_MARK, -1, t))
                            marked = True
                        speculate = False  # the rest of this instant depends on dispatch
                        plan.append((_ACQ, c, t))
                    cmds.append(acq.pack(now, args))
                stop = not speculate or len(cmds) >= WINDOW
            if not cmds:
                continue  # only releases of revoked runs were due (or nothing is left)
            if marked:
                cmds.append(_command("XRANGE", events_key, b"(" + self.last_id, "+"))
                plan.append((_READ, -1, t))
            if self.booked:
                cmds.extend(due_cmds)
            replies = wire.call(cmds)
            self.round_trips += 1
            self._answers(plan, replies)
            if self.booked:
                self._due(replies[-2:])
            if progress is not None and t >= next_progress:
                progress(t)
                next_progress = t + 6 * 3_600_000
        wall = time.perf_counter() - t_wall
        if (self.start < 0).any():
            raise RuntimeError(f"{int((self.start < 0).sum())} cells never ran (a replay bug)")
        return self._result(t_first, wall)

    def _answers(self, plan: list[tuple[int, int, int]], replies: list[Any]) -> None:
        for (kind, c, t), reply in zip(plan, replies, strict=False):
            if kind == _PREDICTED:
                self.calls += 1
                if reply[0] != Code.OK or _str_field(reply[1], b"node") != self.node_of[c]:
                    raise RuntimeError(
                        f"acquire of cell {c} at {t} ms answered {reply!r}; the replay predicted a grant on "
                        f"{self.node_of[c]} (its mirror of the free GPUs is out of step)"
                    )
                self.token[c] = _int_field(reply[1], b"token")
                if self.booked:
                    self.booking_grants += b'"resv":' in reply[1]
                    self.borrowed_grants += b'"borrowed":true' in reply[1]
            elif kind == _REL:
                self.calls += 1
                if reply[0] != Code.OK:
                    raise RuntimeError(f"release of cell {c} at {t} ms answered {reply!r}")
            elif kind == _ACQ:
                self.calls += 1
                code = reply[0]
                if code == Code.OK:
                    node = _str_field(reply[1], b"node")
                    self._take(node, self.cell_gpus[c])
                    self._granted(c, t, node, _int_field(reply[1], b"token"))
                    self.booking_grants += b'"resv":' in reply[1]
                    self.borrowed_grants += b'"borrowed":true' in reply[1]
                elif code == Code.QUEUED:
                    self.waiting.add(c)
                else:
                    raise RuntimeError(f"acquire of cell {c} ({self.cell_gpus[c]} GPUs) at {t} ms answered {reply!r}")
            elif kind in (_WARM, _RESUMED):
                self.calls += 1
                if reply[0] != Code.OK:
                    raise RuntimeError(f"warm ({kind == _WARM}) of cell {c}'s lease at {t} ms answered {reply!r}")
            elif kind == _RESUME:
                self.calls += 1
                s = self.session[c]
                if reply[0] == Code.OK:
                    lease_id, c0 = self._drop_warm(s, t)
                    self._granted(c, t, self.node_of[c0], _int_field(reply[1], b"token"), lease_id)
                    self.warm_starts += 1
                elif reply[0] == Code.BUSY:  # evicted in this same instant: end it and ask again
                    self.evicting.add(s)
                    heapq.heappush(self.heap, (t, _READY, c))
                else:
                    raise RuntimeError(f"resuming cell {c}'s warm lease at {t} ms answered {reply!r}")
            elif kind == _MARK:
                if reply:
                    self.last_id = reply[0][0]
            elif kind == _SWEEP:
                self.calls += 1
                self.sweeps += 1
                if max(int(x) for x in reply[1:]) >= SWEEP_LIMIT:
                    self.next_sweep = t  # a full batch: sweep again at the same instant
            elif kind == _READ:
                self._take_events(reply, t)

    def _due(self, replies: list[Any]) -> None:
        """The next instant the sweeper has work: a recall notice running out, a booking check."""
        due = [int(float(r[1])) - EPOCH_MS for r in replies if r]
        if due:
            soonest = min(due)
            self.next_sweep = soonest if self.next_sweep is None else min(self.next_sweep, soonest)

    def _result(self, t_first: int, wall: float) -> Result:
        w = self.w
        n = w.n_cells
        start = self.start
        end = start + w.dur
        span_h = (int(end.max()) - t_first) / 3_600_000 if n else 0.0
        starts, ends = start.tolist(), end.tolist()
        gpus, users = list(self.cell_gpus), list(self.cell_user)
        for s, e, g, u in self.lost:
            starts.append(s)
            ends.append(e)
            gpus.append(g)
            users.append(u)
        lost_gpu_h = sum((e - s) * g for s, e, g, _ in self.lost) / 3_600_000
        extra: dict[str, Any] = {"script_calls": self.calls, "round_trips": self.round_trips, "sim_hours": span_h}
        if self.keep_warm:
            extra.update(
                warm_starts=self.warm_starts,
                warm_start_share=self.warm_starts / n if n else float("nan"),
                evictions=self.evictions,
                warm_gpu_hours=self.warm_ms / 3_600_000,
                suspends=self.suspends,
                restores=self.restores,
                suspend_lost=self.suspend_lost,
                restore_gpu_hours=self.restore_ms / 3_600_000,
                state_kept_share=(self.warm_starts + self.restores) / n if n else float("nan"),
            )
        if self.booked:
            extra.update(
                reruns=len(self.lost),
                lost_gpu_hours=lost_gpu_h,
                booking_grants=self.booking_grants,
                borrowed_grants=self.borrowed_grants,
                sweeps=self.sweeps,
                no_shows=self.no_shows,
            )
        return Result(
            self.policy,
            int(sum(self.nodes)),
            self.ready,
            start,
            order=np.argsort(self.token, kind="stable"),
            wall_s=wall,
            extra=extra,
            **intervals(starts, ends, gpus, users),
        )
