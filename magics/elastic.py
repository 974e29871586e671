"""Elastic training: a job that grows while growing pays, and shrinks rather than stops.

    %%gpu_train --gpus 1-4 --elastic
    state = resume_state or {"step": 0, "model": init()}
    magics.on_preempt(lambda: {"step": state["step"], "model": copy(state["model"])})
    while state["step"] < 1000:
        train_one_step(state)                # on this rank's GPU; torch.distributed if you like
        state["step"] += 1
        magics.elastic.step(samples=batch)   # what this rank processed in the step

The call starts on what the pool has free (at least the minimum) as a gang of ranks, one per GPU,
each with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ... (the multi-node gang's variables). Rank 0's
:func:`step` calls tell the runner the job's throughput T at each size n. The runner then:

* **grows** by one GPU when the pool has one free on the lease's node and nobody waits for it: the
  first growth is a probe, and each later one needs the measured scaling efficiency of the last,
  ``s = (T_new - T_old) / (T_old / n_old)`` per GPU added (1: perfect, 0: no gain), to be at least
  ``min_efficiency`` (0.5). A growth whose ``s`` falls short is undone, and the job stays there.
  (The throughput scaling efficiency of AdaptDL and of Or, Zhang and Freedman, MLSys 2020.)
* **shrinks** when the lease server asks (someone waits for the pool and the job holds more than
  its minimum: a ``shrink_notice`` with a deadline), instead of being recalled whole.

A resize is: every rank stops at the same :func:`step` (agreed with an all-reduce under
``torch.distributed``), rank 0's :func:`magics.on_preempt` hooks take the checkpoint, the processes
end (seen gone), the lease grows or shrinks on the server (``POST /leases/{id}/grow|shrink``), and
new ranks start on the new size with the checkpoint as ``resume_state``. Ranks that do not reach a
:func:`step` before a shrink's deadline are ended, and the job goes on from its last checkpoint.

The cell shows one line per resize (the size, and the measured ``s``); :attr:`CallResult.elastic`
has every phase (size, seconds, throughput, efficiency); the ledger charges each size's
GPU-seconds.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import statistics
import threading
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from lease_server import errors
from lease_server.client import Lease

from .calls import RESIZED, Call
from .grant import Grant
from .options import Options
from .outcomes import UI, GpuLeaseEnded, GpuTrainError
from .session import Worker
from .worker import Resize, elastic_step
from .world import Rank, World

if TYPE_CHECKING:
    from .calls import Result
    from .pump import Pump

__all__ = ["DEFAULT_MIN_EFFICIENCY", "Phase", "Resize", "efficiency", "step"]

log = logging.getLogger(__name__)
step = elastic_step
DEFAULT_MIN_EFFICIENCY = 0.5
WARM_STEPS = 2  # steps after a (re)start that are not measured: process group set-up, first batch
MEASURE_STEPS = 4  # steps measured at each size (at least MEASURE_MIN_S long)
MEASURE_MIN_S = 0.3
WATCH_EVERY_S = 0.25  # how often the runner looks at the lease (a shrink notice) and the pool
STOP_GRACE_S = 5.0  # after a shrink's deadline: how long the ranks may still take to stop


def efficiency(n_old: int, t_old: float, n_new: int, t_new: float) -> float:
    """Throughput scaling efficiency of growing from ``n_old`` to ``n_new`` workers: the throughput
    gained per worker added, as a fraction of what one worker gave at ``n_old``."""
    if n_new <= n_old or t_old <= 0:
        raise ValueError("efficiency is defined for a growth, from a measured throughput")
    return (t_new - t_old) / ((n_new - n_old) * t_old / n_old)


@dataclass
class Phase:
    """One stretch of an elastic call at one size."""

    size: int
    seconds: float = 0.0
    throughput: float | None = None  # samples/s over the whole gang, measured after warm-up
    efficiency: float | None = None  # s of the growth that led to this size
    why: str = ""  # why the call left this size
    start_s: float = 0.0  # from the phase's start to rank 0's first step (processes, placement)
    stop_s: float = 0.0  # from the resize asked to the ranks ended and the lease resized


class _Controller:
    """Watches one phase: rank 0's steps (throughput), the lease (a shrink notice) and the pool
    (free GPUs, waiters); decides the next size and asks the ranks to stop for it."""

    def __init__(self, run: ElasticRun, size: int) -> None:
        self.run, self.size = run, size
        self.steps: list[tuple[float, int]] = []  # (time, samples) of rank 0's steps
        self.target: int | None = None
        self.why = ""
        self.forced = False  # the ranks missed a shrink's deadline and were ended
        self.t0 = time.monotonic()
        self.asked_at: float | None = None
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._measured = False
        self._thread = threading.Thread(target=self._watch, name="gpulease-elastic", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        self._thread.join(timeout=5)

    def on_step(self, record: dict[str, Any]) -> None:
        if not self.steps:
            self.run.phases[-1].start_s = time.monotonic() - self.t0
        with self._lock:
            self.steps.append((float(record["t"]), int(record.get("samples", 1))))
            if self._measured or len(self.steps) < WARM_STEPS + MEASURE_STEPS + 1:
                return
            window = self.steps[WARM_STEPS:]
            span = window[-1][0] - window[0][0]
            if span < MEASURE_MIN_S:
                return
            self._measured = True
            # Rank 0's samples per second, times the ranks (each processes as much per step): the
            # median step, so that one step slowed by something else on the node (a process
            # starting, a collection) does not read as the size not paying.
            steps = sorted(b[0] - a[0] for a, b in itertools.pairwise(window))
            per_step = statistics.fmean(s for _, s in window[1:])
            throughput = per_step / max(statistics.median(steps), 1e-9) * self.size
        self.run.measured(self.size, throughput)
        self._maybe_grow()

    def _maybe_grow(self) -> None:
        target, why = self.run.next_size(self.size)
        if target is not None:
            self._ask(target, why)

    def _ask(self, target: int, why: str) -> None:

        with self._lock:
            if self.target is not None:
                return
            self.target, self.why = target, why
            self.asked_at = time.monotonic()
        for rank in self.run.world.ranks:
            with contextlib.suppress(Exception):
                rank.worker.handle.ask_resize.remote()

    def _watch(self) -> None:
        client = self.run.sess.client()
        lease_id = self.run.lease.id
        while not self._done.wait(WATCH_EVERY_S):
            try:
                rec = client.get(lease_id)
            except errors.GpuLeaseError:
                continue
            to = rec.get("shrink_to")
            if to and int(to) < self.size:
                self._ask(self.run.fit(int(to)), "someone waits: the server asked")
                by = float(rec.get("shrink_by") or 0)
                if by and time.time() > by + STOP_GRACE_S and not self._done.is_set():
                    self._force()
                    return
            elif self._measured and self.target is None:
                self._maybe_grow()  # GPUs may have freed up since the measurement

    def _force(self) -> None:
        """The ranks did not stop by the shrink's deadline (no step() reached): end them, so that
        none runs on a GPU the lease no longer holds; the job restarts from its last checkpoint."""
        self.forced = True
        self.run.world.kill()


class ElasticRun:
    """The elastic loop of one call on its grant and world: run the ranks, resize, repeat until the
    function returns. See the module."""

    def __init__(self, grant: Grant, world: World, opts: Options, ui: UI, pump: Pump) -> None:
        assert grant.lease is not None and opts.gpus is not None and opts.gpus_min is not None
        self.grant, self.world, self.opts, self.ui, self.pump = grant, world, opts, ui, pump
        self.sess = grant.sess
        self.lo, self.hi = opts.gpus_min, opts.gpus
        self.sizes = sorted(opts.sizes) if opts.sizes else list(range(self.lo, self.hi + 1))
        self.min_efficiency = opts.min_efficiency
        self.ceiling = self.hi
        self.throughput: dict[int, float] = {}
        self.phases: list[Phase] = []
        self.state: Any = None
        self.has_state = False
        self._grew_from: int | None = None
        self._down_from: int | None = None  # the size a probe down came from
        self._kept: dict[int, Worker] = {}  # GPU index -> the rank process that stays on it

    # -- decisions -------------------------------------------------------------------------------

    @property
    def lease(self) -> Lease:
        """The call's lease: the grant's one copy (a resize updates it there)."""
        lease = self.grant.lease
        assert lease is not None
        return lease

    def measured(self, size: int, throughput: float) -> None:
        self.throughput[size] = throughput
        phase = self.phases[-1]
        phase.throughput = throughput
        prev = self._grew_from
        if prev is not None and prev in self.throughput and prev < size:
            phase.efficiency = efficiency(prev, self.throughput[prev], size, throughput)

    def next_size(self, size: int) -> tuple[int | None, str]:
        """After a measurement at ``size``: probe down from a start above the minimum, undo a
        growth that did not pay, or grow if it may."""
        target = self._probe_down(size)
        if target is not None:
            return target[0], target[1]
        s = self.phases[-1].efficiency
        if s is not None and s < self.min_efficiency and self._grew_from is not None:
            self.ceiling = self._grew_from
            return self._grew_from, f"s = {s:.2f} < {self.min_efficiency:g}: did not pay"
        bigger = [n for n in self.sizes if size < n <= min(self.ceiling, self.hi)]
        if bigger and self._room(size, bigger[0] - size):
            first = self._grew_from is None and len(self.phases) == 1
            return bigger[0], "free, nobody waits" + ("; a probe" if first else "")
        return None, ""

    def _probe_down(self, size: int) -> tuple[int, str] | None:
        """A call that started above its minimum (it got what was free) first checks that its size
        pays: it halves, measures, and goes back up if the GPUs it gave back gave at least
        ``min_efficiency`` each; else it halves again, down to the minimum, then grows one at a time."""
        down_from, self._down_from = self._down_from, None
        if down_from is not None:
            s = efficiency(size, self.throughput[size], down_from, self.throughput[down_from])
            if s >= self.min_efficiency:
                return down_from, f"s = {s:.2f} from {size} to {down_from}: back up"
            self.ceiling = min(self.ceiling, down_from - 1)
            why = f"s = {s:.2f} from {size} to {down_from}"
        elif len(self.phases) == 1 and size > self.lo:
            why = "a probe down from the start"
        else:
            return None
        half = self.fit(max(self.lo, size // 2))
        if half >= size:
            return None
        self._down_from = size
        return half, why

    def fit(self, size: int) -> int:
        """The largest allowed size at most ``size`` (at least the minimum)."""
        return max([n for n in self.sizes if n <= size] or [self.lo])

    def _room(self, size: int, more: int) -> bool:
        """``more`` GPUs free on the lease's node, and nobody waiting in its pool."""
        client = self.sess.client()
        try:
            if client.queue(self.lease.pool):
                return False
            for node in client.cluster().get("nodes", []):
                if node.get("name") == self.lease.node:
                    return sum(1 for g in node.get("gpus", []) if g.get("state") == "free") >= more
        except errors.GpuLeaseError:
            return False
        return False

    # -- the loop --------------------------------------------------------------------------------

    def run(self, call: Call) -> list[Result]:
        try:
            return self._loop(call)
        except BaseException:
            self.close()  # a kept process must not outlive the call (Stop, an error, a resize refused)
            raise

    def _loop(self, call: Call) -> list[Result]:
        size = len(self.lease.gpus)
        if size not in self.sizes:  # granted what was free: down to an allowed size first
            self._resize(size, self.fit(size), f"sizes {','.join(map(str, self.sizes))} only")
        while True:
            size = len(self.lease.gpus)
            self.phases.append(Phase(size))
            t0 = time.monotonic()
            ctl = _Controller(self, size)
            self.pump.on_elastic = ctl.on_step
            self._start_ranks()
            ctl.start()
            try:
                results = self.pump.run(self._with_state(call), self.opts.timeout)
            except GpuTrainError:
                if not (ctl.forced or self._taken_back(size)):
                    raise
                ctl.forced = True
                results = []
            finally:
                ctl.stop()
                self.phases[-1].seconds = time.monotonic() - t0
            if results and not any(r.value == RESIZED for r in results):
                if len(self.phases) > 1:
                    self.ui.notice(self.summary_line())
                return results
            if self.pump.has_checkpoint:
                self.state, self.has_state = self.pump.checkpoint, True
            target = ctl.target if ctl.target is not None else size
            self.phases[-1].why = ctl.why
            self._keep_ranks(target if results else 0)
            self._resize(size, target, ctl.why)
            if ctl.asked_at is not None:
                self.phases[-1].stop_s = time.monotonic() - ctl.asked_at

    def _taken_back(self, size: int) -> bool:
        """Whether the server took GPUs of this phase back (a shrink notice ran out): the node agent
        then ends the ranks on them (draining), and the phase ends as a forced resize, not as a
        crash of the job."""
        try:
            rec = self.sess.client().get(self.lease.id)
        except errors.GpuLeaseError:
            return False
        return rec.get("state") == "active" and len(rec.get("gpus", [])) < size

    def _start_ranks(self) -> None:
        """One rank per leased GPU, in index order: the process that stayed on that GPU through the
        resize (recycled), else a pre-started spare. Each rank sees exactly its own GPU (``cuda:0``,
        ``LOCAL_RANK=0``), so that a process keeps its device across resizes."""
        sess, lease, world = self.sess, self.lease, self.world
        gpus = sorted(lease.gpus, key=lambda g: int(g["index"]))
        ranks = []
        for r, g in enumerate(gpus):
            worker = self._kept.pop(int(g["index"]), None) or sess.take_worker(lease.node, replenish=False)
            rank = world.rank(lease.node, r, worker, gpus=[g])
            rank.env.update(
                GPULEASE_ELASTIC="1",
                RANK=str(r),
                LOCAL_RANK="0",
                WORLD_SIZE=str(len(gpus)),
                LOCAL_WORLD_SIZE=str(len(gpus)),
            )
            ranks.append(rank)
        self._end(list(self._kept.values()))  # a kept process whose GPU the lease no longer has
        self._kept = {}
        world.ranks = ranks
        master = world.wait_started()
        for rank in ranks:
            rank.env.update(MASTER_ADDR=str(master["ip"]), MASTER_PORT=str(master["port"]))

    def _keep_ranks(self, target: int) -> None:
        """After the ranks stopped for a resize to ``target``: keep (recycled) the processes on the
        GPUs the lease keeps (a shrink gives back its highest indexes), end the others and see them
        gone before the lease changes."""
        import ray

        stay = target
        leave: list[Rank] = []
        for rank in self.world.take():
            idx = rank.indexes[0]
            ok = False
            if rank.local < stay:
                with contextlib.suppress(Exception):
                    ok = bool(ray.get(rank.worker.handle.recycle.remote(), timeout=5))
            if ok:
                self._kept[idx] = rank.worker
            else:
                leave.append(rank)
        if leave:
            self.world.end(leave)
        for _ in leave:  # a spare for a later growth, started while the job runs on fewer GPUs
            self.sess.replenish(self.lease.node)

    def _end(self, workers: list[Worker]) -> None:
        """End processes kept for a phase that will not use them (seen gone, as any rank)."""
        if workers:
            self.world.end([Rank(self.lease.node, 0, {}, w) for w in workers])

    def _update(self, lease: Lease) -> None:
        """The lease changed on the server (a resize): the grant and the world see it."""
        self.grant.update(lease)
        self.world.lease = lease

    def close(self) -> None:
        """End any process kept for a next phase that will not come (an error, Stop)."""
        kept, self._kept = list(self._kept.values()), {}
        self._end(kept)

    def _with_state(self, call: Call) -> Call:
        """The call as its ranks start it now: after a resize, with the checkpoint as
        ``resume_state`` (a keyword argument of a function; a name in a cell)."""
        if not self.has_state:
            return call
        if call.kind == "function":
            return replace(call, kwargs={**call.kwargs, "resume_state": self.state})
        return replace(call, inputs={**call.inputs, "resume_state": self.state})

    def _resize(self, size: int, target: int, why: str) -> None:
        client = self.sess.client()
        # What the lease holds now: the server shrinks it itself once a shrink notice runs out.
        self._update(Lease.from_json(client.get(self.lease.id)))
        if self.lease.state != "active":
            raise GpuLeaseEnded(f"the lease ended during a resize ({self.lease.raw.get('end_reason', '')})")
        now = len(self.lease.gpus)
        try:
            if target > now:
                self._update(client.grow(self.lease, target - now))
                self._grew_from = now
            elif target < now:
                self._update(client.shrink(self.lease, now - target))
                self._grew_from = None
            elif now < size:
                self._grew_from = None
        except errors.LeaseEnded as exc:
            raise GpuLeaseEnded(exc.message) from None
        except errors.Conflict as exc:  # the pool changed meanwhile: go on at this size
            self.ui.notice(f"elastic: stays at {now} GPU{'s' if now != 1 else ''}: {exc.message}")
        s = self.phases[-1].efficiency if self.phases else None
        eff = f"; s = {s:.2f}" if s is not None and "s =" not in why else ""
        if len(self.lease.gpus) != size:
            self.ui.notice(f"elastic: {size} -> {len(self.lease.gpus)} GPUs ({why}{eff})")

    def summary_line(self) -> str:
        """One line: the sizes it took, and the efficiency measured at each growth."""
        sizes = " -> ".join(str(p.size) for p in self.phases)
        effs = ", ".join(f"{p.efficiency:.2f}" for p in self.phases if p.efficiency is not None)
        line = f"elastic: sizes {sizes}" + (f"; s {effs}" if effs else "")
        return line if len(line) <= 70 else line[:67] + "..."

    def summary(self) -> list[dict[str, Any]]:
        return [
            {
                "size": p.size,
                "seconds": p.seconds,
                "throughput": p.throughput,
                "efficiency": p.efficiency,
                "why": p.why,
                "start_s": p.start_s,
                "stop_s": p.stop_s,
            }
            for p in self.phases
        ]
