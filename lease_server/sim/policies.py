"""The ways teams share GPUs today, as plain event simulations of people's behaviour.

**session**: a notebook takes the most GPUs it may use when it starts and holds them until it stops
(a GPU notebook pod; NotebookOS's "reservation" baseline). A notebook that finds no node with its
GPUs free waits for them (a pending pod), and so does all its work: its whole session moves later.

**calendar**: a person books GPUs in a shared calendar in whole-hour blocks covering their session
(from the hour they start in, or the next free block, to the end of the hour their last cell ends
in), on one node. The GPUs are theirs for the whole block, used or not. When no node has the GPUs
free for the whole session, they take the earliest block that has them and wait until it starts.

**session-held + idle culler**: a notebook takes its GPUs when its first cell runs and holds them
until it has been idle (no cell running) for ``idle`` (JupyterHub's idle culler: 10 min, 60 min);
the culled notebook asks again at its next cell. With real sessions (a session-level trace) the
notebook's CPU-only cells keep it busy too, the GPUs go back at the latest when it stops, and each
cull followed by another cell of the session loses the kernel's state (``culls_felt``). A
notebook that finds no node with its GPUs free waits (a pending pod), served first come first
served, smaller requests backfilled around it.

All three keep a session's cells on one node (a notebook runs on one machine) and do not move a session
once started; the per-cell lease policies are replayed through the real scheduler (``replay.py``).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence

import numpy as np

from .result import Result, intervals
from .workload import Workload

Progress = Callable[[int], None]  # called with the virtual time reached (ms)


def _best_fit(free: list[int], g: int) -> int:
    """The node with the fewest free GPUs that still has ``g`` (-1: none)."""
    best, best_free = -1, 1 << 30
    for i, f in enumerate(free):
        if g <= f < best_free:
            best, best_free = i, f
    return best


def culler(w: Workload, nodes: Sequence[int], idle_s: float, progress: Progress | None = None) -> Result:
    """Session-held GPUs, given back ``idle_s`` after the notebook's last cell ended."""
    t_wall = time.perf_counter()
    cull = int(idle_s * 1000)
    free = list(nodes)
    ready = np.zeros(w.n_cells, dtype=np.int64)
    start = np.zeros(w.n_cells, dtype=np.int64)
    order: list[int] = []
    a_s: list[int] = []
    a_e: list[int] = []
    a_g: list[int] = []
    a_u: list[int] = []
    last = w.first + w.count - 1
    # (time, kind, cell, node): kind 0 = a hold ends (GPUs back), 1 = a cell asks for GPUs
    heap: list[tuple[int, int, int, int]] = [(int(w.start[s]), 1, int(w.first[s]), -1) for s in range(w.n_sessions)]
    heapq.heapify(heap)
    queue: list[int] = []  # cells waiting, first come first served
    for s in range(w.n_sessions):
        ready[w.first[s]] = w.start[s]

    culls = [0, 0]  # culls, culls followed by another cell of the session
    stop_after = w.tail() if w.real_sessions else None
    cpu = w.cpu

    def hold(c: int, node: int, now: int) -> None:
        s = int(w.session[c])
        g, k, cur = int(w.gpus[s]), c, now
        while True:
            start[k] = cur
            order.append(k)
            end = cur + int(w.dur[k])
            # the notebook is busy until ``active``; it is culled once idle for ``cull``
            active, culled = end, -1
            for off, d in cpu[k] if cpu is not None else ():
                if end + off - active > cull:
                    culled = active + cull
                    break
                active = max(active, end + off + d)
            if k == last[s]:
                if culled < 0:
                    if stop_after is None:
                        release, felt = active + cull, False
                    elif end + int(stop_after[s]) - active > cull:
                        release, felt = active + cull, False
                    else:
                        release, felt = end + int(stop_after[s]), None  # the notebook stops
                else:
                    release, felt = culled, True
                if felt is not None:
                    culls[0] += 1
                    culls[1] += felt
                break
            nxt = end + int(w.gap[k + 1])
            ready[k + 1] = nxt
            if culled < 0 and nxt - active > cull:
                culled = active + cull
            if culled >= 0:
                culls[0] += 1
                culls[1] += 1
                release = culled
                heapq.heappush(heap, (nxt, 1, k + 1, -1))
                break
            cur, k = nxt, k + 1
        heapq.heappush(heap, (release, 0, k, node))
        a_s.append(now)
        a_e.append(release)
        a_g.append(g)
        a_u.append(int(w.user[s]))

    def serve(now: int) -> None:
        if not queue:
            return
        most = max(free)
        kept = []
        for c in queue:
            g = int(w.gpus[w.session[c]])
            node = _best_fit(free, g) if g <= most else -1
            if node < 0:
                kept.append(c)
                continue
            free[node] -= g
            most = max(free)
            hold(c, node, now)
        queue[:] = kept

    n = 0
    while heap:
        t, kind, c, node = heapq.heappop(heap)
        if kind == 0:
            free[node] += int(w.gpus[w.session[c]])
        else:
            queue.append(c)
        if not heap or heap[0][0] != t:  # every change at this instant is in: serve the queue
            serve(t)
        n += 1
        if progress is not None and n % 2048 == 0:
            progress(t)
    return Result(
        f"culler-{int(idle_s // 60)}m",
        int(sum(nodes)),
        ready,
        start,
        order=np.asarray(order, dtype=np.int64),
        wall_s=time.perf_counter() - t_wall,
        extra={"culls": culls[0], "culls_felt": culls[1]},
        **intervals(a_s, a_e, a_g, a_u),
    )


def session(w: Workload, nodes: Sequence[int], progress: Progress | None = None) -> Result:
    """Each notebook holds ``request`` GPUs on one node from when it starts until it stops.

    A pod that finds no node with its GPUs free is pending: pods are served first come first
    served, smaller ones backfilled around a blocked one. A pod that started ``D`` late moves its
    whole session ``D`` later (the person could not run anything meanwhile): its first GPU cell's
    time-to-GPU is ``D`` and the rest of its cells keep their think times. Without real sessions the
    notebook starts at its first cell and stops when its last cell ends.
    """
    t_wall = time.perf_counter()
    free = list(nodes)
    ready = np.zeros(w.n_cells, dtype=np.int64)
    start = np.zeros(w.n_cells, dtype=np.int64)
    opened = w.session_open()
    req = w.session_request()
    nominal = w.nominal_ready()
    last = w.first + w.count - 1
    span = (w.stop if w.stop is not None else nominal[last] + w.dur[last]) - opened
    a_s: list[int] = []
    a_e: list[int] = []
    a_g: list[int] = []
    a_u: list[int] = []
    # (time, kind, session, node): kind 0 = a pod stops (GPUs back), 1 = a pod asks for its GPUs
    heap: list[tuple[int, int, int, int]] = [(int(opened[s]), 1, s, -1) for s in range(w.n_sessions)]
    heapq.heapify(heap)
    pending: list[int] = []
    n = 0

    def run(s: int, node: int, now: int) -> None:
        late = now - int(opened[s])
        f, k = int(w.first[s]), int(w.count[s])
        start[f : f + k] = nominal[f : f + k] + late
        ready[f : f + k] = start[f : f + k]
        ready[f] = nominal[f]
        end = now + int(span[s])
        heapq.heappush(heap, (end, 0, s, node))
        a_s.append(now)
        a_e.append(end)
        a_g.append(int(req[s]))
        a_u.append(int(w.user[s]))

    while heap:
        t, kind, s, node = heapq.heappop(heap)
        if kind == 0:
            free[node] += int(req[s])
        else:
            pending.append(s)
        if pending and (not heap or heap[0][0] != t):
            kept = []
            for p in pending:
                node = _best_fit(free, int(req[p]))
                if node < 0:
                    kept.append(p)
                    continue
                free[node] -= int(req[p])
                run(p, node, t)
            pending[:] = kept
        n += 1
        if progress is not None and n % 2048 == 0:
            progress(t)
    order = np.lexsort((np.arange(w.n_cells), start))
    return Result(
        "session",
        int(sum(nodes)),
        ready,
        start,
        order=order,
        wall_s=time.perf_counter() - t_wall,
        **intervals(a_s, a_e, a_g, a_u),
    )


def calendar(w: Workload, nodes: Sequence[int], block_s: float = 3600.0, progress: Progress | None = None) -> Result:
    """Whole-hour bookings covering each session, on one node, earliest block first (best fit)."""
    t_wall = time.perf_counter()
    block = int(block_s * 1000)
    caps = np.asarray(nodes, dtype=np.int32)[:, None]
    slots = int(w.span_ms() // block) + 48
    occ = np.zeros((len(nodes), slots), dtype=np.int32)
    ready = np.zeros(w.n_cells, dtype=np.int64)
    start = np.zeros(w.n_cells, dtype=np.int64)
    a_s: list[int] = []
    a_e: list[int] = []
    a_g: list[int] = []
    a_u: list[int] = []
    booked_at = np.zeros(w.n_sessions, dtype=np.int64)
    look = 48  # candidate blocks examined at once
    for s in np.argsort(w.start, kind="stable"):
        f, n, g = int(w.first[s]), int(w.count[s]), int(w.gpus[s])
        r = int(w.start[s])
        span = int(np.sum(w.dur[f : f + n]) + np.sum(w.gap[f + 1 : f + n]))
        k0 = r // block
        n_first = -(-(r + span) // block) - k0  # blocks when starting now, in the current hour
        n_next = max(1, -(-span // block))  # blocks when starting at a block's start
        k = k0
        chosen = -1
        while chosen < 0:
            need = k + look + max(n_first, n_next) + 1
            if need > occ.shape[1]:
                occ = np.concatenate([occ, np.zeros((occ.shape[0], need - occ.shape[1] + 24 * 30), np.int32)], axis=1)
            if k == k0:
                # starting now: the blocks from this hour on must all have room
                peak = occ[:, k0 : k0 + n_first].max(axis=1)
                ok = np.nonzero(peak + g <= caps[:, 0])[0]
                if ok.size:
                    chosen = int(ok[np.argmax(peak[ok])])
                    kb, nb, b = k0, n_first, r
                    break
                k = k0 + 1
                continue
            win = np.lib.stride_tricks.sliding_window_view(occ[:, k : k + look + n_next - 1], n_next, axis=1)
            peak = win.max(axis=2)  # nodes x candidate blocks
            fits = peak + g <= caps
            cols = np.nonzero(fits.any(axis=0))[0]
            if cols.size:
                j = int(cols[0])
                ok = np.nonzero(fits[:, j])[0]
                chosen = int(ok[np.argmax(peak[ok, j])])
                kb, nb, b = k + j, n_next, (k + j) * block
                break
            k += look
        occ[chosen, kb : kb + nb] += g
        booked_at[s] = b
        # the session runs from b with no further wait: its cells keep their think times
        cur = b
        for c in range(f, f + n):
            if c > f:
                cur += int(w.gap[c])
            ready[c] = r if c == f else cur
            start[c] = cur
            cur += int(w.dur[c])
        a_s.append(b)
        a_e.append((kb + nb) * block)
        a_g.append(g)
        a_u.append(int(w.user[s]))
        if progress is not None and s % 512 == 0:
            progress(r)
    order = np.lexsort((np.arange(w.n_cells), start))
    return Result(
        "calendar",
        int(sum(nodes)),
        ready,
        start,
        order=order,
        wall_s=time.perf_counter() - t_wall,
        **intervals(a_s, a_e, a_g, a_u),
    )
