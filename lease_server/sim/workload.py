"""Workloads for the policy simulator: cells grouped into notebook sessions.

A *cell* is one GPU-busy interval of a notebook (a ``%%gpu_train`` call): it needs ``gpus`` GPUs on
one node for ``dur`` ms. A *session* is one person's notebook over part of a working day: its cells
run one after the other, separated by think time. Replays are closed-loop: a cell becomes ready
``gap`` ms after the previous cell of its session ended, so a cell that waited for GPUs delays the
rest of its session, as it delays the person.

Sources:

* a Tiresias-format trace (``job_id,num_gpu,submit_time,...,duration``, minutes), e.g. the NotebookOS
  June 2021 trace: each row is a cell; the trace has no sessions, so :func:`sessionize` groups the
  rows into sessions (seeded), keeping every arrival, duration and GPU count of the trace;
* the server's own event log (``gpulease events export``, JSON lines): one cell per ended lease;
* a NotebookOS workload template (JSON with ``sessions``, e.g. ``adobe_sensei_june_1-2_2021.json``):
  real sessions, each with its start and stop, the most GPUs it asked for and its cells (GPU cells
  with their per-GPU utilization, CPU-only cells), read by :func:`load_sessions` as they are;
* :func:`generate`: synthetic sessions drawn from the statistics :func:`fit` measures on a workload.
"""

from __future__ import annotations

import csv
import json
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

MIN = 60_000  # ms
HOUR = 3_600_000


@dataclass(frozen=True)
class SessionParams:
    """How :func:`sessionize` groups a trace's cells into notebook sessions.

    A cell may join an open session of the same GPU count whose last cell ended before it arrived,
    at most ``think_max_s`` before, and which started at most ``day_max_s`` before (a working day).
    Each cell draws the think time its person would like (log-normal, median ``think_median_s``,
    shape ``think_sigma``) and joins the session whose gap comes closest to it; with no such session
    it opens a new one. Sessions belong to ``users`` people, drawn with Zipf weights (exponent
    ``zipf``): a few heavy users, many light ones.
    """

    think_median_s: float = 600.0
    think_sigma: float = 1.0
    think_max_s: float = 4 * 3600.0
    day_max_s: float = 10 * 3600.0
    users: int = 40
    zipf: float = 1.0
    seed: int = 1


@dataclass
class Workload:
    """Sessions and their cells, as parallel numpy arrays (times in ms from the workload's start).

    Cells are stored session by session, in order: the cells of session ``s`` are
    ``first[s] : first[s] + count[s]``. ``gap[c]`` is the think time before cell ``c`` (0 for a
    session's first cell, which is ready at ``start[s]``).
    """

    name: str
    users: list[str]
    start: np.ndarray  # per session: ready time of its first cell (ms)
    user: np.ndarray  # per session: index into users
    gpus: np.ndarray  # per session: GPUs every cell of it asks for
    first: np.ndarray  # per session: index of its first cell
    count: np.ndarray  # per session: number of cells
    dur: np.ndarray  # per cell: GPU-busy time (ms)
    gap: np.ndarray  # per cell: think time before it (ms)
    session: np.ndarray  # per cell: its session
    label: list[str] = field(default_factory=list)  # per cell: where it came from (trace job id)
    # Real sessions (a session-level trace) also know when the notebook was open, what it asked for
    # and what else it ran; traces of cells alone leave these None.
    open: np.ndarray | None = None  # per session: the notebook starts (ms, <= start)
    stop: np.ndarray | None = None  # per session: the notebook stops when nothing waited (ms)
    request: np.ndarray | None = None  # per session: the GPUs its pod asks for (>= gpus)
    util: np.ndarray | None = None  # per cell: mean GPU utilization while it ran (NVML %)
    vram_mb: np.ndarray | None = None  # per cell: GPU memory it used per GPU (MB; 0: not in the trace)
    cpu: list[list[tuple[int, int]]] | None = None  # per cell: CPU-only cells after it (offset from its end, ms)
    dropped: int = 0  # sessions of the source without any GPU cell (left out)

    @property
    def real_sessions(self) -> bool:
        return self.stop is not None

    def session_open(self) -> np.ndarray:
        """Per session: when the notebook starts (its first cell's ready time when unknown)."""
        return self.start if self.open is None else self.open

    def session_request(self) -> np.ndarray:
        return self.gpus if self.request is None else self.request

    def tail(self) -> np.ndarray:
        """Per session: from the end of its last cell to the notebook's stop (0 when unknown)."""
        if self.stop is None:
            return np.zeros(self.n_sessions, dtype=np.int64)
        last = self.first + self.count - 1
        return self.stop - (self.nominal_ready()[last] + self.dur[last])

    @property
    def n_cells(self) -> int:
        return int(self.dur.size)

    @property
    def n_sessions(self) -> int:
        return int(self.start.size)

    @property
    def cell_gpus(self) -> np.ndarray:
        return self.gpus[self.session]

    @property
    def cell_user(self) -> np.ndarray:
        return self.user[self.session]

    def nominal_ready(self) -> np.ndarray:
        """Per cell: when it is ready if no cell of its session ever waits (the trace's arrivals)."""
        if not self.n_cells:
            return np.zeros(0, dtype=np.int64)
        dx = np.cumsum(self.dur) - self.dur  # durations of the cells before, globally
        gc = np.cumsum(self.gap)  # think times up to and including this cell, globally
        f = self.first[self.session]
        return self.start[self.session] + (dx - dx[f]) + (gc - gc[f])

    def used_gpu_ms(self) -> float:
        return float(np.sum(self.dur.astype(np.float64) * self.cell_gpus))

    def span_ms(self) -> int:
        """From the first arrival to the end of the last cell when nothing ever waits."""
        ready = self.nominal_ready()
        return int(np.max(ready + self.dur)) if self.n_cells else 0

    def summary(self) -> dict[str, Any]:
        per = self.count.astype(np.float64)
        gaps = self.gap[self.gap > 0] if self.n_cells else self.gap
        return {
            "cells": self.n_cells,
            "sessions": self.n_sessions,
            "users": len(self.users),
            "cells_per_session_mean": round(float(per.mean()), 2) if per.size else 0.0,
            "think_s_median": round(float(np.median(gaps)) / 1000, 1) if gaps.size else 0.0,
            "gpu_hours_used": round(self.used_gpu_ms() / HOUR, 1),
            "span_h": round(self.span_ms() / HOUR, 1),
        }


@dataclass(frozen=True)
class Cell:
    """One cell before grouping: arrival and duration in ms."""

    arrival: int
    dur: int
    gpus: int
    label: str = ""
    user: str = ""
    session: str = ""


def load_trace(path: str | Path) -> list[Cell]:
    """Rows of a Tiresias-format CSV (``num_gpu``, ``submit_time`` and ``duration`` in minutes)."""
    cells = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            dur = max(1, int(float(row["duration"])))
            cells.append(
                Cell(
                    int(float(row["submit_time"])) * MIN, dur * MIN, max(1, int(row["num_gpu"])), row.get("job_id", "")
                )
            )
    return cells


def load_events(path: str | Path) -> list[Cell]:
    """Cells from the server's event log (JSON lines of ``gpulease events export``): each lease that
    was granted and ended is one cell, ready when it was asked for (grant time minus its wait)."""
    grants: dict[str, dict[str, Any]] = {}
    cells = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            ev = json.loads(line)
            kind, lid = ev.get("type"), ev.get("lease")
            if kind == "grant" and lid:
                grants[lid] = ev
            elif kind in ("released", "expired", "revoked") and lid in grants:
                g = grants.pop(lid)
                t0 = int(round(g["ts"] * 1000))
                held = max(1, int(round(ev["ts"] * 1000)) - t0)
                cells.append(
                    Cell(
                        t0 - int(g.get("waited_ms", 0)),
                        held,
                        max(1, len(g.get("gpus", [])) or 1),
                        lid,
                        str(g.get("user", "")),
                        str(g.get("session", "")),
                    )
                )
    if not cells:
        raise ValueError(f"{path}: no granted and ended lease in this event log")
    base = min(c.arrival for c in cells)
    return [Cell(c.arrival - base, c.dur, c.gpus, c.label, c.user, c.session) for c in cells]


def load(path: str | Path) -> list[Cell]:
    """A trace CSV, or an event log export (``.jsonl`` / ``.json``)."""
    p = Path(path)
    if p.suffix in (".jsonl", ".json", ".ndjson"):
        return load_events(p)
    return load_trace(p)


def is_session_trace(path: str | Path) -> bool:
    """Whether ``path`` is a session-level workload: one JSON object with a list of ``sessions``
    (an events export is JSON lines, one object per line)."""
    p = Path(path)
    if p.suffix != ".json":
        return False
    with open(p, "rb") as f:
        if not f.read(256).lstrip().startswith(b"{"):
            return False
    try:
        with open(p) as f:
            doc = json.load(f)
    except ValueError:
        return False
    return isinstance(doc, dict) and isinstance(doc.get("sessions"), list)


TICK_MS = 60_000  # one tick of a NotebookOS workload template


def load_sessions(path: str | Path, tick_ms: int = TICK_MS) -> Workload:
    """A NotebookOS workload template: ``sessions``, each with ``start_tick``, ``stop_tick``,
    ``max_resource_request.gpus`` and ``trainings`` (``start_tick``, ``duration_in_ticks``, ``gpus``,
    ``gpu_utilizations``). The sessions and cells are the trace's own: nothing is grouped or drawn.
    Each session is its own user (the template names no people). Trainings without GPUs are CPU-only
    cells: they keep the notebook busy (the culler sees them) but ask for no GPU. Sessions that never
    use a GPU are left out (counted in ``dropped``)."""
    p = Path(path)
    try:
        with open(p) as f:
            doc = json.load(f)
        raw = doc["sessions"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{p.name}: not a session workload (a JSON object with 'sessions'): {exc}") from None
    sessions = []
    for n, s in enumerate(raw):
        try:
            t_open, t_stop = int(s["start_tick"]) * tick_ms, int(s["stop_tick"]) * tick_ms
            request = int((s.get("max_resource_request") or {}).get("gpus", 0))
            runs = sorted(
                (
                    int(t["start_tick"]) * tick_ms,
                    max(1, int(t["duration_in_ticks"])) * tick_ms,
                    int(t.get("gpus", 0)),
                    [float(u["utilization"]) for u in t.get("gpu_utilizations") or []],
                    float(t.get("vram") or 0.0),
                )
                for t in s.get("trainings") or []
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{p.name}: session {n} cannot be read ({exc!r} missing or malformed)") from None
        sessions.append((t_open, t_stop, request, str(s.get("id") or n), runs))
    sessions.sort(key=lambda x: (x[0], x[3]))
    kept = [x for x in sessions if any(r[2] > 0 for r in x[4])]
    if not kept:
        raise ValueError(f"{p.name}: no session runs a GPU cell")
    ns = len(kept)
    start, user, gpus, first, count = (np.zeros(ns, dtype=np.int64) for _ in range(5))
    s_open, s_stop, s_req = (np.zeros(ns, dtype=np.int64) for _ in range(3))
    dur: list[int] = []
    gap: list[int] = []
    session: list[int] = []
    util: list[float] = []
    vram_mb: list[int] = []
    cpu: list[list[tuple[int, int]]] = []
    label: list[str] = []
    for si, (t_open, t_stop, request, sid, runs) in enumerate(kept):
        gpu_runs = [r for r in runs if r[2] > 0]
        g = max(r[2] for r in gpu_runs)
        start[si], user[si], gpus[si], first[si], count[si] = gpu_runs[0][0], si, g, len(dur), len(gpu_runs)
        s_open[si], s_req[si] = min(t_open, gpu_runs[0][0]), max(request, g)
        prev_end = None
        k = 0
        for t0, d, rg, us, vram in runs:
            if rg == 0:
                if prev_end is not None:  # CPU work after a GPU cell: the culler sees it
                    cpu[-1].append((t0 - prev_end, d))
                continue
            dur.append(d)
            gap.append(0 if prev_end is None else max(0, t0 - prev_end))
            session.append(si)
            util.append(sum(us) / len(us) if us else 100.0)
            vram_mb.append(math.ceil(vram * 1024 / rg) if vram > 0 else 0)  # GB of all its GPUs -> MB per GPU
            cpu.append([])
            label.append(f"{sid[:8]}/{k}")
            prev_end = t0 + d
            k += 1
        s_stop[si] = max(t_stop, prev_end or t_stop, max(t0 + d for t0, d, _, _, _ in runs))
    users = [f"s{si:02d}-{x[3][:4]}" for si, x in enumerate(kept)]
    return Workload(
        p.name,
        users,
        start,
        user,
        gpus,
        first,
        count,
        np.asarray(dur, dtype=np.int64),
        np.asarray(gap, dtype=np.int64),
        np.asarray(session, dtype=np.int64),
        label,
        open=s_open,
        stop=s_stop,
        request=s_req,
        util=np.asarray(util, dtype=np.float64),
        vram_mb=np.asarray(vram_mb, dtype=np.int64),
        cpu=cpu,
        dropped=len(sessions) - ns,
    )


def window(w: Workload, hours: float) -> Workload:
    """The part of a session workload that starts in its first ``hours`` (live-replay slices):
    sessions opened before then, their cells that start before then, cut at the window's end."""
    end = int(hours * HOUR)
    ready = w.nominal_ready()
    cells: list[Cell] = []
    for s in range(w.n_sessions):
        if w.session_open()[s] >= end:
            continue
        for c in range(int(w.first[s]), int(w.first[s] + w.count[s])):
            if ready[c] < end:
                d = int(min(w.dur[c], end - ready[c]))
                cells.append(Cell(int(ready[c]), d, int(w.gpus[s]), w.label[c], w.users[int(w.user[s])], f"s{s}"))
    return from_cells(cells, name=f"{w.name} (first {hours:g} h)")


def _zipf_users(n: int, exponent: float) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1) ** exponent
    return w / w.sum()


def sessionize(cells: Sequence[Cell], params: SessionParams = SessionParams(), name: str = "trace") -> Workload:
    """Group cells into sessions (see :class:`SessionParams`). Cells that carry a user (an event log)
    keep it and are grouped only with that user's cells (and with their own session label, if any)."""
    rng = random.Random(params.seed)
    order = sorted(range(len(cells)), key=lambda i: (cells[i].arrival, i))
    think, day = int(params.think_max_s * 1000), int(params.day_max_s * 1000)
    mu = math.log(params.think_median_s * 1000)
    # open sessions per (gpus, user, session label): lists of [last_end, start, session index]
    open_: dict[tuple[int, str, str], list[list[int]]] = {}
    members: list[list[int]] = []
    for i in order:
        c = cells[i]
        key = (c.gpus, c.user, c.session)
        lst = open_.setdefault(key, [])
        if lst and lst[0][0] + think < c.arrival:
            lst[:] = [o for o in lst if o[0] + think >= c.arrival]  # idle too long: that session is over
        want = c.arrival - rng.lognormvariate(mu, params.think_sigma)  # when the chosen session should have ended
        best, best_d = None, 0.0
        for o in lst:
            if o[0] <= c.arrival and c.arrival - o[1] <= day:
                d = abs(o[0] - want)
                if best is None or d < best_d:
                    best, best_d = o, d
        if best is not None:
            members[best[2]].append(i)
            best[0] = c.arrival + c.dur
            lst.sort()
        else:
            lst.append([c.arrival + c.dur, c.arrival, len(members)])
            lst.sort()
            members.append([i])
    named = sorted({c.user for c in cells if c.user})
    n_users = len(named) if named else params.users
    users = named or [f"u{k:02d}" for k in range(n_users)]
    weights = _zipf_users(n_users, params.zipf)
    urng = np.random.default_rng(params.seed)
    drawn = urng.choice(n_users, size=len(members), p=weights)
    return _build(name, cells, members, users, drawn, {u: k for k, u in enumerate(users)} if named else None)


def _build(
    name: str,
    cells: Sequence[Cell],
    members: list[list[int]],
    users: list[str],
    drawn: np.ndarray,
    user_index: dict[str, int] | None,
) -> Workload:
    members.sort(key=lambda m: (cells[m[0]].arrival, m[0]))
    ns, nc = len(members), sum(len(m) for m in members)
    start = np.empty(ns, dtype=np.int64)
    user = np.empty(ns, dtype=np.int64)
    gpus = np.empty(ns, dtype=np.int64)
    first = np.empty(ns, dtype=np.int64)
    count = np.empty(ns, dtype=np.int64)
    dur = np.empty(nc, dtype=np.int64)
    gap = np.zeros(nc, dtype=np.int64)
    session = np.empty(nc, dtype=np.int64)
    label: list[str] = []
    k = 0
    for s, m in enumerate(members):
        c0 = cells[m[0]]
        start[s], gpus[s], first[s], count[s] = c0.arrival, c0.gpus, k, len(m)
        user[s] = user_index[c0.user] if user_index is not None else int(drawn[s])
        prev_end = None
        for i in m:
            c = cells[i]
            dur[k] = c.dur
            gap[k] = 0 if prev_end is None else c.arrival - prev_end
            session[k] = s
            label.append(c.label)
            prev_end = c.arrival + c.dur
            k += 1
    return Workload(name, users, start, user, gpus, first, count, dur, gap, session, label)


def from_cells(cells: Iterable[Cell], name: str = "cells") -> Workload:
    """A workload whose sessions are given by the cells' ``session`` labels (hand-made traces, tests):
    cells of one session must not overlap; users are the cells' ``user`` names."""
    cells = list(cells)
    by: dict[str, list[int]] = {}
    for i, c in enumerate(cells):
        by.setdefault(c.session or f"cell{i}", []).append(i)
    members = [sorted(m, key=lambda i: cells[i].arrival) for m in by.values()]
    for m in members:
        for a, b in zip(m, m[1:], strict=False):
            if cells[b].arrival < cells[a].arrival + cells[a].dur:
                raise ValueError(f"cells {cells[a].label or a} and {cells[b].label or b} of one session overlap")
            if cells[b].gpus != cells[a].gpus:
                raise ValueError(f"session {cells[a].session!r} asks for different GPU counts")
    users = sorted({c.user or "user" for c in cells})
    index = {u: k for k, u in enumerate(users)}
    cells2 = [c if c.user else Cell(c.arrival, c.dur, c.gpus, c.label, "user", c.session) for c in cells]
    return _build(name, cells2, members, users, np.zeros(len(members), dtype=np.int64), index)


# ---- a generator fitted to a workload ---------------------------------------------------------------


@dataclass
class Fitted:
    """Empirical statistics of a sessionized workload, enough to draw new sessions like its own."""

    sessions_per_hour: np.ndarray  # 24 mean session arrival rates, by hour of the day
    gpus_p: dict[int, float]  # probability of a session's GPU count
    cells_per_session: dict[int, np.ndarray]  # by GPU count: observed cells per session
    durations: dict[int, np.ndarray]  # by GPU count: observed cell durations (ms)
    gaps: np.ndarray  # observed think times within sessions (ms)
    users: int
    zipf: float


def fit(w: Workload, params: SessionParams = SessionParams()) -> Fitted:
    """Measure what :func:`generate` draws from: session arrivals by hour of day, GPU counts, cells per
    session and cell durations (per GPU count), think times."""
    days = max(1.0, w.span_ms() / (24 * HOUR))
    hours = (w.start // HOUR) % 24
    rate = np.bincount(hours, minlength=24) / days
    gpus_vals, gpus_n = np.unique(w.gpus, return_counts=True)
    cg = w.cell_gpus
    inner = (
        w.gap[np.concatenate([np.arange(f + 1, f + n) for f, n in zip(w.first, w.count, strict=True)])]
        if (w.n_cells)
        else np.zeros(0, dtype=np.int64)
    )
    return Fitted(
        sessions_per_hour=rate,
        gpus_p={int(g): float(n) / w.n_sessions for g, n in zip(gpus_vals, gpus_n, strict=True)},
        cells_per_session={int(g): w.count[w.gpus == g] for g in gpus_vals},
        durations={int(g): w.dur[cg == g] for g in gpus_vals},
        gaps=inner,
        users=len(w.users),
        zipf=params.zipf,
    )


def generate(f: Fitted, days: float, seed: int = 1, name: str = "synthetic") -> Workload:
    """Sessions of ``days`` days drawn from ``f``: Poisson arrivals at the fitted hourly rates, each
    session's GPU count, cell count, cell durations and think times resampled from the fitted data."""
    rng = np.random.default_rng(seed)
    cells: list[Cell] = []
    members: list[list[int]] = []
    gpu_keys = sorted(f.gpus_p)
    gpu_p = np.array([f.gpus_p[g] for g in gpu_keys])
    for h in range(int(days * 24)):
        for _ in range(rng.poisson(f.sessions_per_hour[h % 24])):
            g = int(gpu_keys[rng.choice(len(gpu_keys), p=gpu_p)])
            n = int(rng.choice(f.cells_per_session[g]))
            t = h * HOUR + int(rng.integers(0, HOUR // MIN)) * MIN
            m = []
            for k in range(n):
                if k:
                    t += int(rng.choice(f.gaps)) if f.gaps.size else 0
                d = int(rng.choice(f.durations[g]))
                m.append(len(cells))
                cells.append(Cell(t, d, g, f"s{len(members)}c{k}"))
                t += d
            members.append(m)
    users = [f"u{k:02d}" for k in range(f.users)]
    drawn = rng.choice(f.users, size=len(members), p=_zipf_users(f.users, f.zipf))
    return _build(name, cells, members, users, drawn, None)
