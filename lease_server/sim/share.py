"""``lease-share``: per-cell leases of GPU slices through the real Lua, with co-tenants slowing each other.

Each GPU cell of a session trace asks for a slice of one GPU's memory: the memory its event used per
GPU (the template's ``vram``, in GB for all its GPUs together, divided by its GPU count), rounded up
by the pool's own ``slice_unit_mb`` in ``acquire.lua``. The pool shares (``share``, ``slice_unit_mb``,
``max_sharers`` of the replay's settings are written where the scripts read them), so the slices are
placed, queued and dispatched by ``_lib_slice.lua`` and dispatch exactly as on a live cluster.

Cells the server cannot lease as one slice:

* a cell whose memory the trace does not give takes whole GPUs (nothing says how much it needs);
* a cell on more than one GPU (``multi``): ``"whole"`` (the default) leases its GPUs whole;
  ``"gang"`` leases one slice on each of its GPUs, all on one node, in one lease (``gpus`` k with
  ``gpu_mem_mb``: ``allocate_slices`` in ``_lib_slice.lua``), as ``%%gpu_train --gpus 2 --gpu-mem``
  does.

Either way a cell makes one request, and runs once it is granted.

The co-tenant model: a GPU on which the running cells' utilisations (the trace's NVML
``gpu_utilizations``, per GPU) add up to ``S`` > 100 % runs each of them ``S / 100`` times slower
for as long as that holds; it is recomputed whenever a cell starts or ends on the GPU. A cell on
several GPUs goes at the pace of its slowest one. A cell's *slowdown* is the time it ran over its
trace duration (1.0 when it was never crowded). Whole GPUs are never shared, so never stretched.

Placement away from busy GPUs (``slice_busy_pct`` of the replay's settings, ``_lib_slice.lua``) sees
what a node agent would report: whenever a shared GPU's running cells change, the replay sends the
real ``samples.lua`` a sample of it (their utilisations added up, at most 100 %) before the
instant's acquires, with a sampling gap so short that the newest sample is the GPU's average (a
live agent averages about its last six, a few seconds apart; here a GPU's tenants hold for minutes).

The replay runs every virtual instant in one pipelined round trip (releases, acquires, then the
event stream for grants from the queue); it is slower than the ``lease`` replay's speculation but
the traces it is meant for (hundreds of cells) take well under a second per probe.
"""

from __future__ import annotations

import heapq
import json
import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..leasing.inventory import Gpu, NodeInventory
from ..store.keys import Keys
from ..store.scripts import Acquire, Code, Common, Release, Samples, declared_keys, source
from .replay import (
    EPOCH_MS,
    FOREVER_MS,
    POOL,
    Progress,
    ReplaySetup,
    _cell_of,
    _command,
    _pack,
    _register,
    _Script,
    _Wire,
)
from .result import Result
from .workload import Workload

GPU_MEM_MB = 40_960  # the simulated GPUs' memory: the trace names no GPU model (an A100-40GB here)
MULTI = ("whole", "gang")

_END, _READY, _SAMPLE = 0, 1, 2


def share_inventories(nodes: Sequence[int], gpu_mem_mb: int = GPU_MEM_MB) -> list[NodeInventory]:
    """The cluster with its GPUs' memory (a slice is placed by it)."""
    return [
        NodeInventory(f"n{i:04d}", POOL, [Gpu(k, f"sim-{i}-{k}", "sim", gpu_mem_mb) for k in range(n)])
        for i, n in enumerate(nodes)
    ]


def slice_plan(w: Workload, multi: str = "whole") -> list[int]:
    """Per cell, the one request it makes: the MB of its slice (of each of its GPUs: a gang), or 0
    for its GPUs whole."""
    if multi not in MULTI:
        raise ValueError(f"multi must be one of {', '.join(MULTI)}, not {multi!r}")
    mem = w.vram_mb
    plan: list[int] = []
    for c, g in enumerate(w.cell_gpus.tolist()):
        mb = int(mem[c]) if mem is not None else 0
        if mb <= 0:
            plan.append(0)  # memory unknown: whole GPUs
        elif g == 1 or multi == "gang":
            plan.append(mb)  # a gang: one lease, a slice of mb on each of its g GPUs of one node
        else:
            plan.append(0)
    return plan


class _Cell:
    """One cell while it holds or waits for its lease: the lease once granted, and its progress once
    running."""

    __slots__ = ("lease", "slots", "rem", "rate", "since", "version")

    def __init__(self) -> None:
        self.lease: tuple[str, list[int], int] | None = None  # (node, GPU indexes, MB or 0) once granted
        self.slots: list[str] = []  # the shared GPUs it runs on ("node/idx"), once running
        self.rem = 0.0  # solo ms of work left
        self.rate = 1.0  # work ms per wall ms (1 / stretch)
        self.since = 0
        self.version = 0


def lease_share(
    w: Workload,
    nodes: Sequence[int],
    setup: ReplaySetup,
    progress: Progress | None = None,
    *,
    multi: str = "whole",
    gpu_mem_mb: int = GPU_MEM_MB,
) -> Result:
    """Replay ``w`` as slices (see the module's docstring) on ``nodes``; ``setup.settings`` gives the
    pool's ``slice_unit_mb`` and ``max_sharers`` (``share`` is turned on for the replay's pool)."""
    if w.util is None:
        raise ValueError("lease-share needs a session trace with per-cell GPU utilisation (a NotebookOS template)")
    settings = setup.settings
    keys = Keys(setup.prefix)
    invs = share_inventories(nodes, gpu_mem_mb)
    t0 = int(w.start.min()) if w.n_sessions else 0
    _register_shared(setup, invs, EPOCH_MS + t0)
    wire = _Wire(setup.redis_url)
    replay: _ShareReplay | None = None
    try:
        replay = _ShareReplay(w, nodes, wire, keys, settings, slice_plan(w, multi), multi)
        return replay.run(progress)
    finally:
        if not setup.keep:
            sampled = [keys.samples(slot) for slot in replay.sampled] if replay else []
            wire.call([_command("DEL", *keys.all(), *sampled)])
        wire.close()


def _register_shared(setup: ReplaySetup, invs: list[NodeInventory], now_ms: int) -> None:
    import asyncio
    import dataclasses

    from redis import Redis

    asyncio.run(_register(setup, invs, (), now_ms))
    table = dataclasses.replace(setup.settings, share=True).sched_table(POOL)
    r = Redis.from_url(setup.redis_url)
    try:
        r.hset(Keys(setup.prefix).sched, mapping={"*": json.dumps(table), POOL: json.dumps(table)})
    finally:
        r.close()


class _ShareReplay:
    def __init__(
        self,
        w: Workload,
        nodes: Sequence[int],
        wire: _Wire,
        keys: Keys,
        settings: Any,
        plan: list[int],
        multi: str,
    ) -> None:
        self.w, self.nodes, self.wire, self.keys, self.plan, self.multi = w, nodes, wire, keys, plan, multi
        common_tail: list[object] = Common(
            0, settings.event_log_max, settings.fair_share_half_life, int(settings.ended_retention * 1000)
        ).argv()[1:]

        def script(name: str, call: Any) -> _Script:
            sha = wire.call([_command("SCRIPT", "LOAD", source(name))])[0].decode()
            return _Script(sha, [getattr(keys, k) for k in declared_keys(name)], common_tail, call)

        self.acq = script("acquire", Acquire)
        self.rel = script("release", Release)
        self.samples_sha = wire.call([_command("SCRIPT", "LOAD", source("samples"))])[0].decode()
        self.event_log_max = settings.event_log_max
        self.resample: set[str] = set()  # shared GPUs whose running cells changed since the last sample
        self.sampled: set[str] = set()  # every GPU sampled (their sample lists are dropped at the end)
        n = w.n_cells
        self.users = list(w.users)
        self.cell_user = w.cell_user.tolist()
        self.cell_gpus = w.cell_gpus.tolist()
        self.util = [float(u) for u in w.util.tolist()]  # type: ignore[union-attr]
        self.dur = w.dur.tolist()
        self.gap = w.gap.tolist()
        self.session = w.session.tolist()
        is_last = np.zeros(n, dtype=bool)
        is_last[w.first + w.count - 1] = True
        self.last = is_last.tolist()
        self.ready = np.zeros(n, dtype=np.int64)
        self.start = np.full(n, -1, dtype=np.int64)
        self.end = np.full(n, -1, dtype=np.int64)
        self.token = np.zeros(n, dtype=np.int64)
        self.heap: list[tuple[int, int, int, int]] = [
            (int(t), _READY, int(c), 0) for t, c in zip(w.start, w.first, strict=True)
        ]
        heapq.heapify(self.heap)
        self.cells: dict[int, _Cell] = {}  # cells holding or waiting for their lease
        self.waiting: set[str] = set()  # lease ids queued
        self.on_gpu: dict[str, set[int]] = {}  # shared GPU -> the running cells on it
        self.last_id = b"0-0"
        self.calls = self.round_trips = 0
        # allocations: one interval per lease, its size in GPUs (a slice: its fraction)
        self.a_s: list[int] = []
        self.a_e: list[int] = []
        self.a_g: list[float] = []
        self.a_u: list[int] = []
        self.granted_at: dict[int, int] = {}  # cell -> when its lease was granted
        self.sliced_cells = sum(1 for mb in plan if mb > 0)
        self.peak_sharers = 0

    # ---- requests ----------------------------------------------------------------------

    def _acquire(self, c: int, mb: int) -> bytes:
        u = self.cell_user[c]
        call = Acquire(
            f"c{c}",
            self.users[u],
            POOL,
            self.cell_gpus[c],  # whole GPUs, one slice (1 GPU) or a gang of slices, one on each
            ttl_ms=FOREVER_MS,
            wait_ms=FOREVER_MS,
            label=self.w.label[c] if c < len(self.w.label) else "",
            session=f"s{self.session[c]}",
            max_queued=2**31 - 1,
            gpu_mem_mb=mb,
        )
        return self.acq.pack(self._now, _pack(call.argv()))

    def _release(self, c: int) -> bytes:
        user = self.users[self.cell_user[c]]
        return self.rel.pack(self._now, _pack(Release(f"c{c}", "", user, False, "released", "cell returned").argv()))

    def _sample(self, slot: str) -> bytes:
        """What a node agent reports of shared GPU ``slot`` now: its running cells' utilisation."""
        node, idx = slot.split("/")
        util = min(100.0, sum(self.util[c] for c in self.on_gpu.get(slot, ())))
        call = Samples(self._now, self.event_log_max, 1, 5.0, node, 0, ())
        keys = [getattr(self.keys, name) for name in Samples.FIXED_KEYS] + [self.keys.samples(slot)]
        self.sampled.add(slot)
        # gap 0.001 ms: the newest sample is the average (see the module's docstring)
        argv = [*call.argv()[:5], 0.001, idx, round(util, 1), 0, "[]"]
        return _command("EVALSHA", self.samples_sha, len(keys), *keys, *argv)

    # ---- the co-tenant model -----------------------------------------------------------

    def _stretch(self, slot: str) -> float:
        s = sum(self.util[c] for c in self.on_gpu.get(slot, ()))
        return max(1.0, s / 100.0)

    def _repace(self, cells: set[int], t: int) -> None:
        """Cells whose GPUs changed tenants at ``t``: bank their progress, new rate, new end."""
        for c in cells:
            st = self.cells[c]
            st.rem -= (t - st.since) * st.rate
            st.since = t
            stretch = max((self._stretch(s) for s in st.slots), default=1.0)
            st.rate = 1.0 / stretch
            st.version += 1
            end = t + max(0, math.ceil(st.rem / st.rate - 1e-6))
            heapq.heappush(self.heap, (end, _END, c, st.version))

    def _run(self, c: int, node: str, idx: list[int], mb: int, at: int, t: int) -> set[int]:
        """Cell ``c`` was granted ``idx`` of ``node`` (``mb`` of each, or whole) at ``at``: it starts
        at ``t``; returns the cells to repace."""
        st = self.cells[c]
        st.lease = (node, idx, mb)
        self.granted_at[c] = at
        self.start[c] = t
        st.rem, st.since, st.rate = float(self.dur[c]), t, 1.0
        touched = {c}
        for i in idx if mb else ():  # (a gang of slices: one on each of its GPUs)
            slot = f"{node}/{i}"
            st.slots.append(slot)
            self.resample.add(slot)
            on = self.on_gpu.setdefault(slot, set())
            on.add(c)
            self.peak_sharers = max(self.peak_sharers, len(on))
            touched |= on
        return touched

    # ---- the loop ----------------------------------------------------------------------

    def run(self, progress: Progress | None) -> Result:
        heap = self.heap
        t_wall = time.perf_counter()
        t_first = int(self.w.start.min()) if self.w.n_sessions else 0
        next_progress = 0
        while heap:
            t = heap[0][0]
            self._now = t + EPOCH_MS
            ends: list[int] = []
            asks: list[int] = []
            while heap and heap[0][0] == t:
                _, kind, c, version = heapq.heappop(heap)
                if kind == _READY:
                    asks.append(c)
                elif c in self.cells and self.cells[c].version == version and self.start[c] >= 0:
                    ends.append(c)
            if not ends and not asks:
                continue
            cmds: list[bytes] = []
            plan: list[tuple[int, int]] = []  # (kind, cell) of each command but the XRANGE
            touched: set[int] = set()
            for c in ends:
                st = self.cells.pop(c)
                self.end[c] = t
                for slot in st.slots:
                    self.on_gpu[slot].discard(c)
                    touched |= self.on_gpu[slot]
                    self.resample.add(slot)
                assert st.lease is not None
                _node, idx, mb = st.lease
                cmds.append(self._release(c))
                plan.append((_END, c))
                self.a_s.append(self.granted_at.pop(c))
                self.a_e.append(t)
                self.a_g.append(mb / self._total * len(idx) if mb else len(idx))  # (k slices: k fractions)
                self.a_u.append(self.cell_user[c])
                if not self.last[c]:
                    if self.gap[c + 1] == 0:
                        asks.append(c + 1)
                    else:
                        heapq.heappush(heap, (t + self.gap[c + 1], _READY, c + 1, 0))
            for slot in sorted(self.resample):  # what the agents saw change, before the acquires
                cmds.append(self._sample(slot))
                plan.append((_SAMPLE, -1))
            self.resample.clear()
            for c in asks:
                self.ready[c] = t
                self.cells[c] = _Cell()
                cmds.append(self._acquire(c, self.plan[c]))
                plan.append((_READY, c))
            cmds.append(_command("XRANGE", self.keys.events, b"(" + self.last_id, "+"))
            replies = self.wire.call(cmds)
            self.round_trips += 1
            self.calls += len(cmds) - 1
            started: list[tuple[int, str, list[int], int, int]] = []  # (cell, node, GPU indexes, MB or 0, granted)
            for (kind, c), reply in zip(plan, replies, strict=False):
                if kind == _END:
                    if reply[0] != Code.OK:
                        raise RuntimeError(f"release of c{c} at {t} ms answered {reply!r}")
                    continue
                if kind == _SAMPLE:
                    continue
                if reply[0] == Code.OK:
                    rec = json.loads(reply[1])
                    self.token[c] = max(self.token[c], int(rec["token"]))
                    self._note_total(rec)
                    idx = [int(g["index"]) for g in rec["gpus"]]
                    started.append((c, rec["node"], idx, int(rec.get("gpu_mem_mb") or 0), t))
                elif reply[0] == Code.QUEUED:
                    self.waiting.add(f"c{c}")
                else:
                    raise RuntimeError(
                        f"acquire c{c} ({self.cell_gpus[c]} GPUs, slice {self.plan[c]} MB) at {t} ms answered {reply!r}"
                    )
            for entry_id, fields in replies[-1]:
                self.last_id = entry_id
                if fields[1] != b"grant":
                    continue
                d = json.loads(fields[3])
                lid = d["lease"]
                if lid not in self.waiting:
                    continue  # granted at once: its reply said so
                self.waiting.discard(lid)
                c = _cell_of(lid)
                at = int(d["ts"]) - EPOCH_MS
                self.token[c] = max(self.token[c], int(d["token"]))
                started.append((c, d["node"], [int(i) for i in d["gpus"]], int(d.get("gpu_mem_mb") or 0), at))
            for c, node, idx, mb, at in started:
                touched |= self._run(c, node, idx, mb, at, t)
            touched = {c for c in touched if c in self.cells and self.start[c] >= 0}
            self._repace(touched, t)
            if progress is not None and t >= next_progress:
                progress(t)
                next_progress = t + 6 * 3_600_000
        wall = time.perf_counter() - t_wall
        if (self.end < 0).any():
            raise RuntimeError(f"{int((self.end < 0).sum())} cells never ran (a replay bug)")
        return self._result(t_first, wall)

    _total = GPU_MEM_MB

    def _note_total(self, rec: dict[str, Any]) -> None:
        if rec.get("gpu_total_mb"):
            self._total = int(rec["gpu_total_mb"])

    def _result(self, t_first: int, wall: float) -> Result:
        w = self.w
        ran = (self.end - self.start).astype(np.float64)
        slowdown = ran / w.dur.astype(np.float64)
        sliced = np.asarray([mb > 0 for mb in self.plan], dtype=bool)
        span_h = (int(self.end.max()) - t_first) / 3_600_000 if w.n_cells else 0.0

        def q(x: np.ndarray, p: float) -> float:
            from .report import pct

            return pct(x, p) if x.size else float("nan")

        extra: dict[str, Any] = {
            "script_calls": self.calls,
            "round_trips": self.round_trips,
            "sim_hours": span_h,
            "slowdown_p50": q(slowdown, 50),
            "slowdown_p95": q(slowdown, 95),
            "slowdown_p99": q(slowdown, 99),
            "slowdown_max": float(slowdown.max()) if slowdown.size else float("nan"),
            "slowed_cells": int(np.sum(slowdown > 1.0 + 1e-9)),
            "sliced_cells": int(sliced.sum()),
            "whole_cells": int((~sliced).sum()),
            "peak_sharers": self.peak_sharers,
            "multi_gpu": self.multi,
            "slowdown": slowdown,
            "end": self.end.copy(),
        }
        return Result(
            "lease-share",
            int(sum(self.nodes)),
            self.ready,
            self.start,
            alloc_start=np.asarray(self.a_s, dtype=np.int64),
            alloc_end=np.asarray(self.a_e, dtype=np.int64),
            alloc_gpus=np.asarray(self.a_g, dtype=np.float64),
            alloc_user=np.asarray(self.a_u, dtype=np.int64),
            order=np.argsort(self.token, kind="stable"),
            wall_s=wall,
            extra=extra,
        )
