"""Run a function or a cell on leased GPUs through Ray: the plain, testable core of %%gpu_train.

    from magics import run_on_gpus
    losses = run_on_gpus(train, epochs=3, gpus=2, timeout="1h")

The lease server decides who holds which GPU; Ray only runs the call, on the node of the lease,
in a pre-started single-use worker whose ``CUDA_VISIBLE_DEVICES`` is exactly the leased indexes.

One path serves every kind of call, and :func:`run_call` reads as its steps: **ask** (the kernel's
warm worker, or a lease from the queue: :class:`magics.grant.Grant`, the one place that acquires,
renews and releases), **place** (a :class:`magics.world.World` of workers: one for a one-node call,
one per GPU for a multi-node gang, one CPU worker for ``gpus=0``), **run** (one
:class:`magics.pump.Pump` streams their output), then **keep warm or release** and **bring back**.
Whatever happens (return, error, timeout, Stop, the lease ended by someone else) the world's
workers are killed and seen gone (and, where NVML sees the GPUs, off them) before the lease is
released: the next holder never meets the old process. A failed call's checkpoint travels as the
error's declared ``checkpoint`` field.

Progress reaches the caller through a :class:`UI` (queued -> running -> ended), so the magic only
parses options and renders; :func:`run_cell` is the whole cell loop with a plain dict namespace.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from lease_server import errors, protocol
from lease_server.client import Client, Lease, waited_out
from lease_server.sizes import parse_duration, parse_gpu_mem, show_mb

from . import cellcode, slices
from .calls import Call, CellValue, Result
from .elastic import ElasticRun
from .grant import Cancel, Grant
from .options import Defaults, Options
from .outcomes import (
    UI,
    Checkpoint,
    Ending,
    GpuLeaseEnded,
    GpuTrainError,
    GpuTrainStopped,
    GpuTrainTimeout,
    RecordingUI,
    Running,
    StreamUI,
    Waiting,
    _gb,
    describe_end,
)
from .pump import Pump
from .relay import Relay
from .session import (
    GANG_BUNDLE_SHARE,
    GANG_START_TIMEOUT_S,
    RESOURCE_PREFIX,
    WORKER_START_TIMEOUT_S,
    Session,
    node_resource,
    session,
)
from .warm import WarmWorker, keep_warm, take_warm, warmable
from .warm import current as current_warm
from .world import World

__all__ = [
    "GANG_BUNDLE_SHARE",
    "GANG_START_TIMEOUT_S",
    "RESOURCE_PREFIX",
    "UI",
    "WORKER_START_TIMEOUT_S",
    "CallResult",
    "Cancel",
    "CellResult",
    "Defaults",
    "Ending",
    "GpuLeaseEnded",
    "GpuTrainError",
    "GpuTrainStopped",
    "GpuTrainTimeout",
    "Options",
    "RecordingUI",
    "Running",
    "Session",
    "StreamUI",
    "Waiting",
    "check_gang",
    "check_slice",
    "is_fraction",
    "describe_end",
    "node_resource",
    "parse_duration",
    "parse_gpus",
    "plan_call",
    "run_call",
    "run_cell",
    "run_on_gpus",
    "session",
]


# ---- parsing -------------------------------------------------------------------------------------


def parse_gpus(text: int | float | str) -> tuple[int, int]:
    """ "2" -> (2, 2); "1-4" -> (1, 4): an elastic request; "0" -> (0, 0): a CPU worker."""
    if isinstance(text, int) and not isinstance(text, bool):
        lo = hi = text
    else:
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", str(text))
        if not m:
            raise ValueError(f"--gpus takes a count such as 2, or a range such as 1-4, not {text!r}")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) else lo
    if lo < 0 or hi < lo or (lo == 0 and hi != 0):
        raise ValueError(f"--gpus must be 0 (a CPU worker), N, or MIN-MAX with 1 <= MIN <= MAX; got {text!r}")
    return lo, hi


def check_gang(gpus_min: int | None, gpus: int | None, nodes: int | None) -> None:
    """Refuse a bad ``nodes`` request before anything is leased: ``nodes`` must be >= 1; a gang
    (nodes > 1) needs an exact GPU count (not 0, not a range) that ``nodes`` divides."""
    if nodes is None or nodes == 1:
        return
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise ValueError(f"--nodes must be a whole number >= 1, got {nodes!r}")
    if gpus is None:
        raise ValueError(f"--nodes {nodes} needs --gpus N, a multiple of {nodes} (N/{nodes} GPUs on each node)")
    if gpus == 0:
        raise ValueError("--nodes needs GPUs: a gang runs one process per leased GPU, and --gpus 0 leases none")
    if gpus_min is not None and gpus_min != gpus:
        raise ValueError("--nodes: a multi-node gang is all or nothing; give --gpus a count, not a range")
    if gpus % nodes:
        raise ValueError(f"--gpus {gpus} is not a multiple of --nodes {nodes}: each node gets the same share")


def is_fraction(text: object) -> bool:
    """Whether a --gpus value asks for part of one GPU ("0.25"), not a count or a range."""
    return isinstance(text, float) or (isinstance(text, str) and "." in text and "-" not in text)


def check_slice(
    gpu_mem: str | int | float | None, gpus_min: int | None, gpus: int | None, nodes: int | None, elastic: bool
) -> None:
    """Refuse a slice request that cannot be one before anything is leased: a slice is part of one
    GPU, and ``--gpus k`` k of them on k GPUs of one node (no range, gang or elastic); its size must
    be readable (or ``auto``, which sizes one GPU's slice)."""
    if gpu_mem is None:
        return
    if not slices.is_auto(gpu_mem):
        parse_gpu_mem(gpu_mem)  # ValueError: one line that says what would work
    if gpus_min is not None and gpus_min != gpus:
        raise ValueError(
            f"a slice (--gpu-mem) is part of each GPU of a fixed count, so --gpus {gpus_min}-{gpus} does not go "
            "with it: drop one"
        )
    if slices.is_auto(gpu_mem) and gpus is not None and gpus != 1:
        raise ValueError(f"--gpu-mem auto sizes one GPU's slice, so --gpus {gpus} does not go with it: give a size")
    if (nodes and nodes > 1) or elastic:
        raise ValueError(f"a slice (--gpu-mem) is part of one GPU: drop {'--elastic' if elastic else '--nodes'}")


def check_elastic(opts: Options) -> None:
    """An elastic call needs a range of GPUs on one node and an efficiency threshold in 0..1."""
    lo, hi = opts.gpus_min, opts.gpus
    if lo is None or hi is None or hi <= lo or lo < 1:
        raise ValueError("--elastic needs a range of GPUs to move in, such as --gpus 1-4")
    if opts.nodes and opts.nodes > 1:
        raise ValueError("--elastic runs on one node; leave out --nodes")
    if not 0 <= opts.min_efficiency <= 1:
        raise ValueError(f"--min-efficiency is a fraction from 0 to 1, got {opts.min_efficiency!r}")
    if opts.sizes is not None and (
        not opts.sizes or any(not lo <= s <= hi for s in opts.sizes) or lo not in opts.sizes
    ):
        raise ValueError(f"--sizes must lie in {lo}-{hi} and include the minimum {lo}, got {opts.sizes!r}")


# ---- options and results -------------------------------------------------------------------------


@dataclass
class CallResult:
    value: Any
    ending: Ending
    lease_id: str = ""
    node: str = ""
    gpus: list[int] = field(default_factory=list)
    checkpoint: Any = None
    has_checkpoint: bool = False
    metrics: list[dict[str, Any]] = field(default_factory=list)  # what magics.report(...) sent, in order
    elastic: list[dict[str, Any]] = field(default_factory=list)  # an elastic call's phases (magics.elastic)

    @property
    def held_s(self) -> float:
        return self.ending.held_s


@dataclass
class CellResult:
    """A cell's names (already written into the namespace) and its last expression's value."""

    names: dict[str, Any]
    result: Any
    ending: Ending


# ---- the call ------------------------------------------------------------------------------------


def run_call(
    call: Call,
    options: Options | None = None,
    ui: UI | None = None,
    sess: Session | None = None,
    cancel: Cancel | None = None,
    relay: Relay | None = None,
) -> CallResult:
    """Lease, run ``call`` on single-use workers of the lease's node(s), stream their output,
    then end them, see their processes gone, and release the lease, whatever happened.

    ``gpus=0`` runs on a CPU worker (a CPU slot of the CPU pool when the server declares one);
    ``gpus_min < gpus`` is an elastic request; ``nodes=k`` (k > 1) a multi-node gang whose value
    is rank 0's (``all_ranks``: every rank's, in rank order). ``ui`` sees queued -> running ->
    ended and the output. Raises :class:`GpuTrainError` (the call failed), its subclasses
    :class:`GpuTrainTimeout` and :class:`GpuLeaseEnded`, or :class:`GpuTrainStopped` (Stop);
    each carries the call's last checkpoint (``exc.checkpoint``) if its hook saved one.
    ``cancel`` lets another thread end the call as Stop would (:class:`magics.grant.Cancel`);
    with it the call can run in any thread, once :meth:`Session.connect_ray` ran in the main one.
    ``relay`` (a sweep's :class:`magics.relay.Relay`) lets the call start on the worker of the
    same user's call that just ended on the same GPUs, and hand its own worker on when it ends."""
    sess = sess or session()
    opts = _resolved(options, sess)
    if opts.gpu_mem is not None:
        sess.mem_peak_wanted = True  # this notebook sizes slices: keep each call's measured peak
    run = _Run(sess, opts, ui or StreamUI(), call, cancel, relay)
    run.ask()
    try:
        run.place()
        run.run()
    except GpuTrainError as exc:
        run.failed(exc)
        exc.checkpoint = run.checkpoint()
        raise
    except KeyboardInterrupt:
        run.ending.state = "stopped"
        raise GpuTrainStopped(f"gpu_train stopped; {run.freed()}", run.checkpoint()) from None
    finally:
        run.keep_warm_or_release()
    return run.bring_back()


def _resolved(options: Options | None, sess: Session) -> Options:
    """The call's options with the session's defaults filled in, refused before anything is leased
    if they cannot run."""
    options = options or Options()
    if options.gpu_mem is not None:  # a slice: of one GPU, or of each of --gpus k, whatever the default count
        check_slice(options.gpu_mem, options.gpus_min, options.gpus, options.nodes, options.elastic)
        k = options.gpus if isinstance(options.gpus, int) and options.gpus > 1 else 1
        options = replace(options, gpus=k, gpus_min=k)
    opts = options.resolved(sess.defaults)
    if opts.elastic:
        check_elastic(opts)
    check_gang(opts.gpus_min, opts.gpus, opts.nodes)
    return opts


def _auto_size(sess: Session, opts: Options) -> Options:
    """``--gpu-mem auto``: a whole GPU for the notebook's first GPU cell (or while the pool does
    not share), then a slice of the last cell's measured peak plus a margin, in the pool's unit."""
    if not slices.is_auto(opts.gpu_mem):
        return opts
    try:
        view = sess.client().cluster()
    except errors.GpuLeaseError:
        view = {}
    pool = opts.pool or view.get("default_pool") or ""
    info = (view.get("pools") or {}).get(pool) or {}
    if not info.get("share"):
        return replace(opts, gpu_mem=None, gpu_mem_why=f"a whole GPU: pool {pool} does not share its GPUs")
    sizes = [int(g.get("memory_mb") or 0) for n in view.get("nodes") or [] if n.get("pool") == pool for g in n["gpus"]]
    unit = int(info.get("slice_unit_mb") or 1024)
    mb, why = slices.auto_size(sess.mem_peak_mb, unit, gpu_mb=max(sizes, default=0) or None)
    return replace(opts, gpu_mem=mb, gpu_mem_why=why)


class _Run:
    """One call, step by step: :meth:`ask` (a warm worker, or a lease from the queue),
    :meth:`place` (its world of workers), :meth:`run`, then :meth:`keep_warm_or_release` and
    :meth:`bring_back` (its value, or :meth:`failed` and the error)."""

    def __init__(
        self, sess: Session, opts: Options, ui: UI, call: Call, cancel: Cancel | None, relay: Relay | None
    ) -> None:
        self.sess, self.opts, self.ui, self.call = sess, opts, ui, call
        self.cancel, self.relay = cancel, relay
        self.rid = Client.new_request_id()
        # a slice of a size asked is kept warm as a whole GPU is; an auto-sized cell is not (the
        # next cell's size comes from this one's peak, so it would not fit)
        self.warm_ok = relay is None and cancel is None and warmable(opts, call) and not slices.is_auto(opts.gpu_mem)
        call.keep_ns = self.warm_ok
        self.warm: WarmWorker | None = None
        self.resume: WarmWorker | None = None  # a worker suspended on eviction, restored onto this call's new lease
        self.results: list[Result] = []
        self.elastic: ElasticRun | None = None
        self.user_error = False  # the cell raised: its worker is fine, and may stay warm
        self.auto = False  # --gpu-mem auto: the lease's measured peak sizes the notebook's next cell

    # ---- ask ----------------------------------------------------------------------------------------

    def ask(self) -> None:
        """The kernel's warm worker if it fits, else a lease: queued, shown, withdrawn on Stop."""
        sess, opts, ui = self.sess, self.opts, self.ui
        sess.connect_ray()
        gone, lent = "", None
        if self.call.kind == "cell" and opts.gpus:
            self.warm, gone, lent = take_warm(sess, opts, self.warm_ok)
            if self.warm is not None and self.warm.suspend_state:
                self.resume, self.warm = self.warm, None
        try:
            if self.warm is not None:
                self.grant, self.world = self.warm.grant, self.warm.world
                self.grant.reopen()
                self.call = self.warm.strip(self.call)  # the names the worker holds already stay there
            else:
                cpu_pool = sess.client().request("GET", protocol.INFO).get("cpu_pool") if opts.gpus == 0 else None
                self.auto = slices.is_auto(opts.gpu_mem)
                self.opts = opts = _auto_size(sess, opts)
                # a suspended worker can be restored only on its own node: asked for, where it has the GPUs free
                prefer = self.resume.lease.node if self.resume is not None else ""
                self.grant = Grant.take(sess, opts, ui, cpu_pool, self.rid, self.cancel, self.relay, prefer, lent)
                self.world = self.grant.world()
                gone = self._resume_on(self.grant) or gone
        except KeyboardInterrupt:
            if self.resume is not None:
                self.resume.end("Stop pressed while its cell was queued")
            # Stop may land after the grant arrived and before the call owns it: withdrawing the
            # request id releases such a grant too, so it is never left to expire.
            if self.relay is not None:
                self.relay.drop(self.rid)  # a worker handed to this request ends before its lease is released
            sess.client().withdraw(self.rid, reason="withdrawn: Stop pressed")
            ui.ended(Ending("withdrawn"))
            raise GpuTrainStopped("gpu_train stopped while queued; the request was withdrawn") from None
        except errors.NoCapacity as exc:
            ui.ended(Ending("refused", why=waited_out(exc)))
            raise
        except errors.Withdrawn as exc:  # withdrawn from elsewhere: a kernel shutdown, another terminal
            ui.ended(Ending("withdrawn"))
            raise GpuLeaseEnded(exc.message) from None
        self.pump = Pump(self.grant, self.world, ui, self.cancel)
        self.ending = Ending("failed", cpu=self.grant.cpu or self.grant.lease is None, notes=[gone] if gone else [])

    def _resume_on(self, grant: Grant) -> str:
        """The suspended worker runs this call if the new lease is on its node (a process cannot
        move): restored onto the lease's GPU by its node agent as it claims it. Else it is ended,
        and the line says why the cell starts cold."""
        w, lease = self.resume, grant.lease
        if w is None or lease is None:
            return ""
        if lease.node != w.lease.node:
            self.resume = None
            w.end(f"its next lease is on {lease.node}")
            return f"the worker suspended from {w.where()} ended: this cell's lease is on {lease.node} (a cold start)"
        grant.restore = True
        w.resumed()
        self.call = w.strip(self.call)  # the names the worker holds already stay there
        return ""

    # ---- place and run ------------------------------------------------------------------------------

    def place(self) -> None:
        """Say where it runs, and start its workers (a warm worker is there already; an elastic
        call starts its own ranks, phase by phase)."""
        running = self.grant.running(self.opts)
        if self.warm is not None:
            running.where += f" (warm worker, {time.monotonic() - self.warm.since:.0f}s since the last cell)"
        elif self.resume is not None:
            running.where += f" ({self.resume.resumed_note()})"
        self.ui.running(running)
        for note in self.ending.notes:
            self.ui.notice(note)
        if self.opts.elastic:
            self.elastic = ElasticRun(self.grant, self.world, self.opts, self.ui, self.pump)
        elif self.warm is None:
            lease, relay = self.grant.lease, self.relay
            kept = relay.claim(lease) if relay is not None and lease is not None and not self.grant.cpu else None
            if self.resume is not None:
                kept = self.resume.world.ranks[0].worker
            self.world.start(self.opts, kept)

    def run(self) -> None:
        """Run the call on its world while following the lease, until every rank returned."""
        self.grant.follow(self.world.kill)
        if self.elastic is not None:
            self.results = self.elastic.run(self.call)
        else:
            self.results = self.pump.run(self.call, self.opts.timeout)
        self.ending.state = "released"
        self.ending.peak_memory = _sum_memory(self.results)
        restored = self.results[0].restored if self.results else None
        if restored is not None and self.grant.lease is not None:
            took = f"{restored['ms'] / 1000:.1f}s"
            lease = self.grant.lease
            where = f"{lease.node} GPU {','.join(str(i) for i in lease.indexes)}"
            self.ending.restored = f"restored {show_mb(restored['bytes'] / 2**20)} to {where} in {took}"
        self.ending.crossed = [c.text() for c in self.pump.crossed]

    def failed(self, exc: GpuTrainError) -> None:
        """The call raised (in the cell's code: its worker may stay warm) or was ended."""
        self.user_error = bool(exc.remote_traceback) and not isinstance(exc, (GpuTrainTimeout, GpuLeaseEnded))
        if isinstance(exc, GpuLeaseEnded):
            self.ending.state, self.ending.why = "ended", exc.summary
        elif isinstance(exc, GpuTrainTimeout):
            # the limit, beside the time held
            self.ending.state, self.ending.why = "timeout", f"{self.opts.timeout:g}s" if self.opts.timeout else ""

    def freed(self) -> str:
        return "its GPUs are free" if self.grant.lease is not None and not self.grant.cpu else "its worker is gone"

    def checkpoint(self) -> Checkpoint | None:
        return Checkpoint(self.pump.checkpoint) if self.pump.has_checkpoint else None

    # ---- keep warm or release, and bring back ---------------------------------------------------------

    def keep_warm_or_release(self) -> None:
        """Keep the worker warm for the notebook's next cell, hand it to a sweep's next trial, or
        end it (seen gone) and release the lease; then the closing line (in the background, after
        the value went back, for ``background_release``)."""
        sess, opts, grant, ending, call = self.sess, self.opts, self.grant, self.ending, self.call
        if call.kind == "cell" and self.relay is None and not opts.elastic and not (opts.nodes and opts.nodes > 1):
            # A spare preloads them for the notebook's next cold cell (not while a sweep's
            # trials or an elastic job's ranks run: the imports would take CPU from them).
            sess.note_imports(self.pump.imported)
        clean = ending.state == "released"
        kept = None
        if self.warm_ok and (clean or self.user_error):
            kept = keep_warm(sess, grant, self.world, self.warm or self.resume, opts.gpu_mem)
        later = opts.background_release and clean and kept is None
        if kept is not None:
            ending.warm = True
            kept.crossed(dict(call.inputs), self.results[0].value.names if clean else {})
            assert grant.lease is not None
            ending.where = kept.where()
        else:
            ending.where = grant.where
            if not later:
                grant.finish(self.world, self.relay if clean else None)
        ending.gpus = len(grant.lease.gpus) if grant.lease else 0
        ending.held_s = time.monotonic() - grant.t0
        ending.checkpoint = self.pump.has_checkpoint
        if later:
            # The value goes back now; the workers are ended, seen gone and the lease released
            # in the background (its GPUs are granted again only after that), then the line.
            sess.in_background(lambda: _close(sess, grant, self.world, ending, self.ui))
        else:
            _close(sess, grant, self.world, ending, self.ui, finished=True)

    def bring_back(self) -> CallResult:
        values = [r.value for r in self.results]
        lease, pump = self.grant.lease, self.pump
        return CallResult(
            values if self.opts.all_ranks else values[0],
            self.ending,
            lease.id if lease else "",
            ",".join(lease.parts()) if lease else "cpu",
            lease.indexes if lease else [],
            pump.checkpoint,
            pump.has_checkpoint,
            pump.metrics,
            self.elastic.summary() if self.elastic is not None else [],
        )


def _close(sess: Session, grant: Grant, world: World, ending: Ending, ui: UI, finished: bool = False) -> None:
    """The call's workers are gone and its lease released (``finish`` it unless ``finished``): say how it ended."""
    if not finished:
        try:
            grant.finish(world)
        except Exception:
            if grant.held is not None:  # not seen gone: an unverified release, the node agent makes sure
                grant.held.release()
            raise
    ending.verified, ending.nvml = grant.verified, world.nvml
    ending.handed_to = grant.handed_to
    _note_peak(sess, grant, ending)
    if ending.state == "released" and grant.lease is not None and not grant.cpu:
        ending.hint = _right_size(sess, grant.lease, ending.peak_memory)
    ui.ended(ending)


def _note_peak(sess: Session, grant: Grant, ending: Ending) -> None:
    """Keep the peak GPU memory this call's lease used, for the notebook's next ``--gpu-mem auto``
    cell: the larger of the worker's own reading (NVML and torch, where there is a GPU) and its node
    agent's (the lease's ``mem_peak_mb``: NVML per process, CUDA context included; on simulated
    GPUs the resident memory that stands in for it). A lease no one measured leaves the last peak."""
    lease = grant.lease
    if lease is None or grant.cpu or not sess.mem_peak_wanted:
        return
    peaks = [int(ending.peak_memory / 2**20)] if ending.peak_memory else []
    try:
        rec = sess.client().get(lease.id)
        if rec.get("mem_peak_mb"):
            peaks.append(int(rec["mem_peak_mb"]))
    except errors.GpuLeaseError:
        pass
    if peaks:
        sess.mem_peak_mb = max(peaks)


def _right_size(sess: Session, lease: Lease, peak: int | None) -> str:
    """Advice when NVML measured a peak far below what the lease held: the smallest pool whose GPUs
    would still hold it with room (1.5x), e.g. "peak 9 GB of 80 GB: a T4-16GB would do, --pool T4-16GB"."""
    if not peak:
        return ""
    per_gpu = peak / max(1, len(lease.gpus))
    try:
        view = sess.client().cluster()
    except errors.GpuLeaseError:
        return ""
    # (a lease names its GPUs' indexes; their memory is the board's: the node's inventory)
    held = {(g.get("node", lease.node), int(g["index"])) for g in lease.gpus}
    held_mb = min(
        (
            int(g.get("memory_mb", 0))
            for n in view.get("nodes", [])
            for g in n["gpus"]
            if (n["name"], g["index"]) in held
        ),
        default=0,
    )
    if not held_mb or per_gpu * 4 > held_mb * 2**20:
        return ""
    fits: dict[str, int] = {}
    for node in view.get("nodes", []):
        for g in node.get("gpus", []):
            mb = int(g.get("memory_mb", 0))
            if mb and per_gpu * 1.5 <= mb * 2**20 < held_mb * 2**20 and node["pool"] != lease.pool:
                fits[node["pool"]] = min(mb, fits.get(node["pool"], mb))
    head = f"peak {_gb(peak)} of {len(lease.gpus) * held_mb / 1024:.0f} GB"
    if not fits:
        return f"{head}: a smaller GPU would do"
    pool = min(fits, key=lambda p: fits[p])
    return f"{head}: a {pool} would do, --pool {pool}"


def _sum_memory(results: list[Result]) -> int | None:
    peaks = [r.peak_memory for r in results if r.peak_memory]
    return sum(peaks) if peaks else None


# ---- a cell --------------------------------------------------------------------------------------


def plan_call(source: str, user_ns: dict[str, Any], options: Options, crossed: dict[str, Any] | None = None) -> Call:
    """The cell as a :class:`Call`: the names it reads from ``user_ns`` travel with it, the names
    it assigns (or ``options.outputs``) come back. Raises SyntaxError or ValueError (a name that
    cannot travel, nothing to run, no checkpoint to resume). ``crossed``: the objects a warm worker
    holds already, by name: they crossed once, so they are not pickled again to check them."""
    if not source.strip():
        raise ValueError("nothing to run: %gpu_train fn(args) or a %%gpu_train cell")
    plan = cellcode.plan_cell(source)
    explicit = options.outputs is not None
    outputs = list(options.outputs) if options.outputs is not None else cellcode.pick_outputs(plan.assigns)
    if options.resume and "gpu_checkpoint" not in user_ns:
        raise ValueError(
            "--resume: there is no gpu_checkpoint to resume from; it is set when a call's GPUs are "
            "recalled and its magics.on_preempt hook returns a state"
        )
    extra = {"resume_state": user_ns["gpu_checkpoint"] if options.resume else user_ns.get("resume_state")}
    inputs = cellcode.pick_inputs(plan.reads, {**user_ns, **extra})
    held = crossed or {}
    check_picklable({k: v for k, v in inputs.items() if k not in held or held[k] is not v})
    return Call(
        "cell",
        source=source,
        body=plan.body,
        last_expr=plan.last_expr,
        inputs=inputs,
        outputs=outputs,
        explicit_outputs=explicit,
    )


def run_cell(
    source: str,
    user_ns: dict[str, Any],
    options: Options | None = None,
    ui: UI | None = None,
    sess: Session | None = None,
) -> CellResult:
    """Run a cell's source on leased GPUs with ``user_ns`` as its notebook: the names it reads
    travel, the names it assigns come back into ``user_ns``, and the value of its last expression
    is returned. A checkpoint hook's state lands in ``user_ns["gpu_checkpoint"]``."""
    options = options or Options()
    sess = sess or session()
    warm = current_warm(sess)
    call = plan_call(source, user_ns, options, warm.sent if warm is not None and options.warm else None)
    if not options.label:
        options = replace(options, label=source.strip().splitlines()[0][:120])
    if not options.cell:
        options = replace(options, cell=hashlib.sha1(source.encode()).hexdigest()[:12])
    try:
        out = run_call(call, options, ui, sess)
    except (GpuTrainError, GpuTrainStopped) as exc:
        if exc.checkpoint is not None:
            user_ns["gpu_checkpoint"] = exc.checkpoint.state
        raise
    if out.has_checkpoint:
        user_ns["gpu_checkpoint"] = out.checkpoint
    value: CellValue = out.value
    names = {k: v for k, v in value.names.items() if not cellcode.is_module(v)}
    user_ns.update(names)
    return CellResult(names, value.result, out.ending)


def check_picklable(inputs: dict[str, Any]) -> None:
    """Name the variable that cannot travel to the worker, instead of a deep pickling error."""
    from ray import cloudpickle

    try:
        cloudpickle.dumps(inputs)
        return
    except Exception:  # noqa: BLE001 - find the culprit below
        pass
    for name, value in inputs.items():
        try:
            cloudpickle.dumps(value)
        except Exception as exc:  # noqa: BLE001
            raise ValueError(
                f"the cell reads {name!r}, which cannot be sent to the GPU worker ({type(exc).__name__}: {exc}); "
                "create it inside the cell instead"
            ) from None


def run_on_gpus(
    fn: Callable[..., Any],
    *args: Any,
    gpus: int | float | str | None = None,
    pool: str | None = None,
    timeout: str | float | None = None,
    wait: str | float | None = None,
    label: str = "",
    priority: str | None = None,
    nodes: int | None = None,
    all_ranks: bool = False,
    elastic: bool = False,
    min_efficiency: float = 0.5,
    sizes: tuple[int, ...] | None = None,
    gpu_mem: str | int | float | None = None,
    **kwargs: Any,
) -> Any:
    """Call ``fn(*args, **kwargs)`` on a worker holding ``gpus`` leased GPUs and return its value.

    The worker sees only those GPUs (``CUDA_VISIBLE_DEVICES``); the lease is released when the
    call ends, however it ends. The value comes back the moment ``fn`` returns: the verified
    release (the worker ended and seen gone, then the lease released) follows in the background,
    and the GPUs are granted again only after it (``session().wait_background()`` waits for it).
    Raises :class:`GpuTrainError` with the remote traceback on failure.

    ``nodes=k`` runs a multi-node gang for ``torch.distributed``: ``gpus/k`` GPUs on each of k
    nodes, granted all or nothing, and one process per GPU, each with ``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` set. Every rank calls ``fn``; the value
    returned is rank 0's (``all_ranks=True``: the list of every rank's value, in rank order).
    If any rank fails, every rank is stopped and the error names the rank and its node.

    ``elastic=True`` with ``gpus="MIN-MAX"`` runs one rank per GPU on one node and grows or shrinks
    the gang while it runs (:mod:`magics.elastic`): ``fn`` calls ``magics.elastic.step(samples=n)``
    each step, checkpoints with :func:`magics.on_preempt` and takes ``resume_state=None``, which
    holds the checkpoint when the ranks restart on a new size. ``sizes`` (e.g. ``(1, 2, 4)``) are
    the only gang sizes it may take.

    ``gpu_mem`` leases a slice of one GPU instead (docs/slices.md): "10GB", "10240MB", an int of
    MB, a fraction of one GPU such as 0.25 (``gpus=0.25`` says the same), or "auto" (a whole GPU
    first, then the last call's measured peak + 20 %). The worker is held to it (torch's memory
    fraction; MPS where an admin runs it) and its node agent ends it if it stays over.
    """
    if gpus is not None and is_fraction(gpus):  # gpus=0.25: a quarter of one GPU's memory
        if gpu_mem is not None:
            raise ValueError(f"gpus={gpus!r} already asks for part of one GPU: drop gpu_mem")
        gpu_mem = float(gpus)
        gpus = None
    lo, hi = parse_gpus(gpus) if gpus is not None else (None, None)
    check_gang(lo, hi, nodes)
    check_slice(gpu_mem, lo, hi, nodes, elastic)
    opts = Options(
        gpus=hi,
        gpus_min=lo,
        nodes=nodes,
        pool=pool,
        priority=priority,
        timeout=parse_duration(timeout),
        wait=parse_duration(wait),
        label=label or getattr(fn, "__name__", "call"),
        all_ranks=all_ranks,
        elastic=elastic,
        min_efficiency=min_efficiency,
        sizes=tuple(sorted(set(sizes))) if sizes else None,
        background_release=True,
        gpu_mem=gpu_mem,
    )
    return run_call(Call.function(fn, *args, **kwargs), opts).value
