"""Run a function or a cell on leased GPUs through Ray: the plain, testable core of %%gpu_train.

    from magics import run_on_gpus
    losses = run_on_gpus(train, epochs=3, gpus=2, timeout="1h")

The lease server decides who holds which GPU; Ray only runs the call, on the node of the lease,
in a pre-started single-use worker whose ``CUDA_VISIBLE_DEVICES`` is exactly the leased indexes.

One path serves every kind of call. :func:`run_call` takes the lease (:class:`_Grant`: the one
place that acquires, renews and releases), starts a *world* of workers (one worker for a one-node
call, one per GPU for a multi-node gang, one CPU worker for ``gpus=0``), pumps their output with
one :class:`_Pump`, and whatever happens (return, error, timeout, Stop, the lease ended by someone
else) kills the workers, waits until their processes are gone (and, where NVML sees the GPUs, off
them), and only then releases the lease: the next holder never meets the old process.

Progress reaches the caller through a :class:`UI` (queued -> running -> ended), so the magic only
parses options and renders; :func:`run_cell` is the whole cell loop with a plain dict namespace.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import logging
import os
import re
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from lease_server import errors
from lease_server.client import Client, HeldLease, Lease

from . import cellcode
from .calls import CHECKPOINT_STREAM, Call, CellValue, Result, Where, this_machine
from .worker import GpuWorker, verify_gone

log = logging.getLogger(__name__)
RESOURCE_PREFIX = "gpulease_node_"
SPARES_PER_NODE = 2  # one for the next call, one for the call after it while the first is replaced
GANG_START_TIMEOUT_S = 60.0  # placing a gang's bundles and starting its rank processes
GANG_BUNDLE_SHARE = 0.001  # of a node's gpulease_node_<node> resource, per rank
ESTIMATE_EVERY_S = 10.0  # how often a waiting cell asks the server again how long it may take
END_STATES = ("released", "revoked", "expired")
POLL_S = 0.5  # the pump wakes at least this often (deadline, idle warnings, a lost lease)


def node_resource(node: str) -> str:
    """The Ray custom resource that marks the Ray node serving lease-server node ``node``."""
    return RESOURCE_PREFIX + node


# ---- parsing -------------------------------------------------------------------------------------

_DURATION = re.compile(r"^\s*(?:(\d+(?:\.\d+)?)h)?\s*(?:(\d+(?:\.\d+)?)m)?\s*(?:(\d+(?:\.\d+)?)s?)?\s*$")


def parse_gpus(text: int | str) -> tuple[int, int]:
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


def parse_duration(text: str | float | int | None) -> float | None:
    """'90', '90s', '10m', '1h30m' -> seconds. None stays None."""
    if text is None:
        return None
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        seconds = float(text)
    else:
        m = _DURATION.match(str(text))
        if not m or not any(m.groups()):
            raise ValueError(f"cannot read duration {text!r}: write e.g. 90, 90s, 10m or 1h30m")
        h, mins, s = (float(g) if g else 0.0 for g in m.groups())
        seconds = h * 3600 + mins * 60 + s
    if seconds <= 0:
        raise ValueError(f"a duration must be positive, got {text!r}")
    return seconds


# ---- how a call can end, as the notebook shows it ------------------------------------------------


class GpuTrainError(Exception):
    """The call failed on the worker (or the worker died). Shown as the remote traceback, once."""

    def __init__(
        self,
        summary: str,
        remote_traceback: str = "",
        node: str = "",
        remote_type: str = "",
        rank: int | None = None,
    ) -> None:
        super().__init__(summary)
        self.summary = summary
        self.remote_traceback = remote_traceback
        self.node = node
        self.remote_type = remote_type
        self.rank = rank  # the failing rank of a multi-node gang (None for a one-node call)

    def render(self) -> str:
        if not self.remote_traceback:
            return f"{type(self).__name__}: {self.summary}"
        who = f"rank {self.rank} on node {self.node}" if self.rank is not None else f"the worker on node {self.node}"
        return f"--- traceback from {who} ---\n{self.remote_traceback.rstrip()}"

    def _render_traceback_(self) -> list[str]:  # IPython shows these lines instead of local frames
        return self.render().splitlines()


class GpuTrainTimeout(GpuTrainError):
    """The call ran past ``--timeout``: it was stopped and its GPUs released."""


class GpuLeaseEnded(GpuTrainError):
    """Someone else ended the lease while the call ran (the board, an admin, the idle reclaimer, a
    preemption). An expected event: one line naming who and why, no traceback."""


class GpuTrainStopped(KeyboardInterrupt):
    """Stop (a kernel interrupt) ended the call: the request was withdrawn or the GPUs released.
    Still a KeyboardInterrupt, so code around the call stops as it would on any interrupt."""

    def __init__(self, summary: str) -> None:
        super().__init__(summary)
        self.summary = summary

    def _render_traceback_(self) -> list[str]:
        return [f"KeyboardInterrupt: {self.summary}"]


# ---- what a caller sees --------------------------------------------------------------------------


@dataclass
class Waiting:
    request: str
    gpus: str  # "2", "1-4"
    pool: str
    position: int | None  # None: leaving the queue (being granted)
    elapsed_s: float
    estimate: str = ""  # the server's latest estimate, e.g. "about 40 s more"


@dataclass
class Running:
    lease_id: str
    where: str  # "box GPU 0,1", "n1 GPU 0,1 + n2 GPU 0,1", "a CPU worker"
    gpus: int
    waited_s: float
    note: str = ""  # elastic size, borrowed or preemptible


@dataclass
class Ending:
    """How the call ended, once its workers are gone and its lease is released."""

    state: str  # released | failed | timeout | stopped | withdrawn | ended | refused
    where: str = ""
    gpus: int = 0
    held_s: float = 0.0
    verified: bool = False  # every worker process was seen gone before the release
    nvml: bool = False  # and NVML saw none of them on the GPUs
    peak_memory: int | None = None
    why: str = ""  # who ended the lease, and why (state "ended")
    hint: str = ""  # right-sizing advice for next time
    checkpoint: bool = False
    cpu: bool = False

    def line(self) -> str:
        """One line for the notebook, at most 80 columns where the names allow."""
        if self.state == "withdrawn":
            return "gpu_train: stopped while queued; the request was withdrawn"
        if self.state == "refused":
            return f"gpu_train: {self.why}"
        if self.cpu:
            what = f"ran on {self.where} for {self.held_s:.1f}s"
        else:
            what = f"held {self.where} for {self.held_s:.1f}s"
        freed = "GPU memory freed" if self.verified else "worker not seen to exit"
        released = "released" if self.cpu else f"released; {freed}"
        head = {
            "released": f"gpu_train: {what}",
            "failed": f"gpu_train: failed after {self.held_s:.1f}s on {self.where}",
            "timeout": f"gpu_train: stopped by --timeout after {self.held_s:.1f}s on {self.where}",
            "stopped": f"gpu_train: stopped after {self.held_s:.1f}s on {self.where}",
            "ended": f"gpu_train: {self.why}",
        }[self.state]
        tail = "" if self.state == "ended" and self.cpu else f"; {released}"
        mem = f"; peak {_gb(self.peak_memory)}" if self.peak_memory and not self.hint else ""
        saved = " (checkpoint saved: %%gpu_train --resume)" if self.checkpoint else ""
        hint = f"\n  {self.hint}" if self.hint else ""
        return f"{head}{tail}{mem}{saved}{hint}"


class UI(Protocol):
    """Where a call reports its progress. Each method is called from the calling thread."""

    def waiting(self, w: Waiting) -> None: ...
    def running(self, r: Running) -> None: ...
    def notice(self, text: str) -> None: ...
    def output(self, stream: str, text: str) -> None: ...
    def ended(self, e: Ending) -> None: ...


class StreamUI:
    """For scripts (:func:`run_on_gpus`): the worker's output to this process's streams, the
    ending line and notices to stderr; no queue progress."""

    def __init__(self, quiet: bool = True) -> None:
        self.quiet = quiet

    def waiting(self, w: Waiting) -> None:
        pass

    def running(self, r: Running) -> None:
        pass

    def notice(self, text: str) -> None:
        sys.stderr.write(f"gpu_train: {text}\n")

    def output(self, stream: str, text: str) -> None:
        target = sys.stderr if stream == "stderr" else sys.stdout
        target.write(text)
        target.flush()

    def ended(self, e: Ending) -> None:
        if not self.quiet:
            sys.stderr.write(e.line() + "\n")


# ---- options and results -------------------------------------------------------------------------


@dataclass
class Defaults:
    """Session defaults, changed with %gpu_config."""

    gpus: int = 1
    pool: str | None = None
    timeout: float | None = None
    wait: float = 3600.0
    url: str | None = None
    token: str | None = None
    ttl: float | None = None


@dataclass
class Options:
    """One call's options; None takes the session default."""

    gpus: int | None = None
    gpus_min: int | None = None  # < gpus: elastic, granted gpus_min..gpus
    nodes: int | None = None  # > 1: a multi-node gang
    pool: str | None = None
    priority: str | None = None
    timeout: float | None = None
    wait: float | None = None
    label: str = ""
    session: str = ""  # the kernel (its leases are released when it shuts down)
    notebook: str = ""
    cell: str = ""  # a hash of the cell's source, for the usage ledger
    all_ranks: bool = False  # a gang's value: every rank's (else rank 0's)
    outputs: list[str] | None = None  # a cell's names to bring back (None: all it assigns)
    resume: bool = False  # a cell reads gpu_checkpoint as resume_state

    def resolved(self, d: Defaults) -> Options:
        gpus = d.gpus if self.gpus is None else self.gpus
        return replace(
            self,
            gpus=gpus,
            gpus_min=gpus if self.gpus_min is None else self.gpus_min,
            pool=self.pool or d.pool,
            timeout=d.timeout if self.timeout is None else self.timeout,
            wait=d.wait if self.wait is None else self.wait,
        )


@dataclass
class CallResult:
    value: Any
    ending: Ending
    lease_id: str = ""
    node: str = ""
    gpus: list[int] = field(default_factory=list)
    checkpoint: Any = None
    has_checkpoint: bool = False

    @property
    def held_s(self) -> float:
        return self.ending.held_s


@dataclass
class CellResult:
    """A cell's names (already written into the namespace) and its last expression's value."""

    names: dict[str, Any]
    result: Any
    ending: Ending


# ---- the session: connections only ---------------------------------------------------------------


@dataclass
class _Worker:
    """A started worker actor and the reference that resolves to where its process lives."""

    handle: Any
    ready_ref: Any

    def where(self, timeout: float = 60.0) -> Where:
        import ray

        return ray.get(self.ready_ref, timeout=timeout)  # type: ignore[no-any-return]


class Session:
    """Per-process connections: the lease client, the Ray connection, the spare workers. Leases
    held right now are tracked only so that a kernel shutdown can give them back."""

    def __init__(self) -> None:
        self.defaults = Defaults()
        self._client: Client | None = None
        self._lock = threading.RLock()
        self._pinned: bool | None = None
        self._spares: dict[str, deque[_Worker]] = {}
        self._actor_cls: Any = None
        self._resources: set[str] = set()
        self.machine = this_machine()
        self.held: set[HeldLease] = set()
        self.waiting: set[str] = set()  # request ids queued right now
        # A multi-node gang: how long Ray may take to place every rank and start its process.
        self.gang_start_timeout = GANG_START_TIMEOUT_S
        atexit.register(self.release_all)

    def client(self) -> Client:
        with self._lock:
            if self._client is None:
                self._client = Client(self.defaults.url, self.defaults.token)
            return self._client

    def reset_client(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
            self._client = None

    def connect_ray(self) -> None:
        """Join the Ray cluster that the lease server names; start nothing of our own."""
        import ray

        # Ray tells notebook users to install ipywidgets for a prettier repr; that is noise here.
        logging.getLogger("ray.widgets.util").setLevel(logging.WARNING)
        with self._lock:
            if self._actor_cls is not None and ray.is_initialized():
                return
            if not ray.is_initialized():
                address = self.client().request("GET", "/api/v1/info").get("ray_address") or os.environ.get(
                    "RAY_ADDRESS"
                )
                if not address:
                    raise errors.ConfigurationError(
                        "the lease server names no Ray cluster: start it with 'gpulease up' (which starts "
                        "a Ray head) or 'gpulease server --ray-address HOST:PORT'"
                    )
                ray.init(
                    address=address,
                    namespace="gpulease",
                    log_to_driver=False,
                    logging_level=logging.WARNING,
                    configure_logging=False,
                )
            self._actor_cls = ray.remote(GpuWorker)
            self._pinned = any(k.startswith(RESOURCE_PREFIX) for k in self._refresh_resources())

    def _refresh_resources(self) -> set[str]:
        import ray

        self._resources = set(ray.cluster_resources())
        return self._resources

    def node_share(self, node: str) -> dict[str, float]:
        """What one worker takes of ``node``'s Ray resource ({} if Ray nodes are not pinned)."""
        if not self._pinned:
            return {}
        res = node_resource(node)
        if res not in self._resources and res not in self._refresh_resources():
            raise errors.ConfigurationError(
                f"no Ray node serves lease-server node {node!r}: start Ray there with --resources '{{\"{res}\": 1000}}'"
            )
        return {res: GANG_BUNDLE_SHARE}

    def new_worker(self, node: str | None, **opts: Any) -> _Worker:
        """Start a worker: on ``node``'s Ray node, or (node None) anywhere with ``opts``."""
        merged: dict[str, Any] = {"num_cpus": 0, "max_concurrency": 4, "max_restarts": 0, **opts}
        if node is not None and "resources" not in merged:
            share = self.node_share(node)
            if share:
                merged["resources"] = share
        handle = self._actor_cls.options(**merged).remote()
        return _Worker(handle, handle.ready.remote())

    def prewarm(self, nodes: list[str]) -> None:
        """Start spare workers on ``nodes`` now, so that a call later costs no process start."""
        self.connect_ray()
        with self._lock:
            for node in nodes:
                spares = self._spares.setdefault(node, deque())
                while len(spares) < SPARES_PER_NODE:
                    spares.append(self.new_worker(node))

    def take_worker(self, node: str) -> _Worker:
        """A pre-started worker on ``node`` (or a new one if none is left); a replacement starts
        in the background."""
        with self._lock:
            spares = self._spares.setdefault(node, deque())
            worker = spares.popleft() if spares else self.new_worker(node)
        self._replenish(node)
        return worker

    def spare(self, node: str) -> _Worker:
        """A live worker on ``node`` to run a short helper task on (it stays a spare)."""
        with self._lock:
            spares = self._spares.setdefault(node, deque())
            if not spares:
                spares.append(self.new_worker(node))
            return spares[0]

    def _replenish(self, node: str) -> None:
        """Start the spare that replaces the one just taken, in the background: starting a
        process costs a second or two of CPU, which must not compete with the call itself."""

        def start() -> None:
            try:
                with self._lock:
                    spares = self._spares.setdefault(node, deque())
                    if len(spares) < SPARES_PER_NODE:
                        spares.append(self.new_worker(node))
            except Exception as exc:  # noqa: BLE001 - the next call starts one itself
                log.warning("could not start a spare worker on %s: %s", node, exc)

        threading.Thread(target=start, name="gpulease-spare", daemon=True).start()

    def release_all(self, reason: str = "kernel shut down") -> None:
        """Kernel shutdown: withdraw every queued request and give back every lease held."""
        client = self._client
        for rid in list(self.waiting):
            with contextlib.suppress(Exception):
                if client is not None:
                    client.withdraw(rid, reason=reason)
        self.waiting.clear()
        for held in list(self.held):
            try:
                held.release()
            except Exception as exc:  # noqa: BLE001 - best effort at exit; the TTL is the backstop
                log.warning("could not release %s at exit: %s", held.id, exc)
        self.held.clear()


_session: Session | None = None


def session() -> Session:
    global _session
    if _session is None:
        _session = Session()
    return _session


# ---- the lease: taken, renewed and released in one place -----------------------------------------


@dataclass
class _Rank:
    node: str
    local: int
    env: dict[str, str]
    worker: _Worker


class _Grant:
    """A call's lease (or, for a CPU call without a CPU pool, none) from the request to the
    verified release. ``finish`` kills the workers, waits until their processes are gone, and only
    then releases the lease."""

    def __init__(self, sess: Session, lease: Lease | None, waited_s: float = 0.0, cpu: bool = False) -> None:
        self.sess = sess
        self.lease = lease
        self.cpu = cpu
        self.waited_s = waited_s
        self.t0 = time.monotonic()
        self.held: HeldLease | None = None
        self.ranks: list[_Rank] = []
        self.pg: Any = None
        self.verified = False
        self.nvml = False
        self._finished = False
        self._releasing = threading.Event()
        self.ended_elsewhere = threading.Event()
        self._follower: Any = None
        if lease is not None:
            self.held = HeldLease(sess.client(), lease)
            self.held.activity = {"executing": True, "source": "gpu_train"}
            sess.held.add(self.held)

    @classmethod
    def take(cls, sess: Session, opts: Options, ui: UI, cpu_pool: str | None) -> _Grant:
        """Acquire, showing the queue; Stop or any error while queued withdraws the request."""
        assert opts.gpus is not None and opts.wait is not None
        if opts.gpus == 0 and not cpu_pool:
            return cls(sess, None, cpu=True)
        cpu = opts.gpus == 0
        gpus, gpus_min, pool = (1, 1, cpu_pool) if cpu else (opts.gpus, opts.gpus_min, opts.pool)
        client = sess.client()
        rid = Client.new_request_id()
        asked = f"{gpus_min}-{gpus}" if gpus_min != gpus else str(gpus)
        estimate = {"text": "", "at": -ESTIMATE_EVERY_S}

        def progress(position: int | None, elapsed: float) -> None:
            if position and elapsed - estimate["at"] >= ESTIMATE_EVERY_S:  # type: ignore[operator]
                estimate["at"] = elapsed
                try:
                    est = client.estimate(gpus, pool, request=rid)
                    alts = "; ".join(f"{a['text']} (--pool {a['pool']})" for a in est.get("alternatives", [])[:1])
                    estimate["text"] = est["text"] + (f"; {alts}" if alts else "")
                except errors.GpuLeaseError:
                    estimate["text"] = ""
            ui.waiting(Waiting(rid, asked, pool or "", position, elapsed, str(estimate["text"])))

        sess.waiting.add(rid)
        t0 = time.monotonic()
        try:
            lease = client.acquire(
                gpus,
                pool,
                sess.defaults.ttl,
                opts.wait,
                opts.label[:200],
                opts.session[:200],
                progress=progress,
                gpus_min=gpus_min,
                priority=opts.priority,
                nodes=opts.nodes,
                notebook=opts.notebook,
                cell=opts.cell,
                request_id=rid,
            )
        finally:
            sess.waiting.discard(rid)
        waited = lease.raw.get("waited_ms")
        return cls(sess, lease, waited / 1000 if waited is not None else time.monotonic() - t0, cpu=cpu)

    @property
    def where(self) -> str:
        if self.lease is None:
            return "a CPU worker"
        if self.cpu:
            return f"a CPU slot of {self.lease.node}"
        parts = self.lease.parts()
        n = len(self.lease.gpus)
        gpus = f"{n} GPU{'s' if n != 1 else ''}"
        return f"{gpus} on " + " + ".join(f"{node} (GPU {','.join(map(str, i))})" for node, i in parts.items())

    def running(self, opts: Options) -> Running:
        if self.lease is None:
            return Running("", "a CPU worker", 0, 0.0)
        lease = self.lease
        note = ""
        if opts.gpus_min != opts.gpus and not self.cpu:
            note = f"{len(lease.gpus)} of {opts.gpus_min}-{opts.gpus} asked"
        if lease.borrowed:
            note = _join(note, "borrowed from a booking: recalled with notice if its holder asks")
        elif lease.raw.get("preemptible"):
            note = _join(note, "above your quota: preemptible, recalled with notice for someone within theirs")
        where = (
            "a CPU slot of " + lease.node
            if self.cpu
            else " + ".join(f"{node} GPU {','.join(map(str, i))}" for node, i in lease.parts().items())
        )
        return Running(lease.id, where, 0 if self.cpu else len(lease.gpus), self.waited_s, note)

    def env(self, node: str) -> dict[str, str]:
        """What a worker on ``node`` sees: exactly the GPUs leased there, in NVML's order."""
        if self.lease is None or self.cpu:
            base = {"CUDA_VISIBLE_DEVICES": ""}
            return base if self.lease is None else {**base, "GPULEASE_LEASE_ID": self.lease.id, "GPULEASE_NODE": node}
        mine = [g for g in self.lease.gpus if g.get("node", self.lease.node) == node]
        return {
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",  # CUDA's indexes = NVML's = the lease's
            "CUDA_VISIBLE_DEVICES": ",".join(str(g["index"]) for g in mine),
            "GPULEASE_LEASE_ID": self.lease.id,
            "GPULEASE_GPU_UUIDS": ",".join(g.get("uuid", "") for g in mine),
            "GPULEASE_NODE": node,
        }

    def watch(self) -> dict[str, Any]:
        """What a worker's watchdog follows: this lease, on the lease server."""
        if self.lease is None:
            return {}
        client = self.sess.client()
        return {"url": client.url, "token": client.token, "id": self.lease.id}

    def follow(self) -> None:
        """Follow this lease's own events (``GET /api/v1/events?lease=ID``) while the call runs:
        once someone else ends it (the board, an admin, the reclaimer, a preemption), end the
        workers through Ray at once, so the GPUs' next holder never meets them."""
        if self.lease is None:
            return
        import httpx

        client = self.sess.client()
        http = httpx.Client(
            base_url=client.url,
            headers=client.headers,
            timeout=httpx.Timeout(5, read=None),
        )
        lease_id = self.lease.id

        def run() -> None:
            try:
                with http.stream("GET", "/api/v1/events", params={"lease": lease_id}) as s:
                    if self._is_over():  # ended before we subscribed
                        self._ended()
                        return
                    for line in s.iter_lines():
                        if self._releasing.is_set():
                            return
                        if line.startswith("event:") and line.split(":", 1)[1].strip() in END_STATES:
                            self._ended()
                            return
            except Exception:  # noqa: BLE001 - closed by finish(), or the server is away: the renewal backs up
                pass

        self._follower = http
        threading.Thread(target=run, name=f"gpulease-follow-{lease_id}", daemon=True).start()

    def _is_over(self) -> bool:
        try:
            assert self.lease is not None
            return self.sess.client().get(self.lease.id).get("state") in END_STATES
        except errors.GpuLeaseError:
            return False

    def _ended(self) -> None:
        if self._releasing.is_set():
            return
        self.ended_elsewhere.set()
        import ray

        for rank in list(self.ranks):
            with contextlib.suppress(Exception):
                ray.kill(rank.worker.handle, no_restart=True)

    def ended_by(self) -> str | None:
        """Who ended this lease and why, if it was not us ("revoked by alice: maintenance")."""
        if self.lease is None:
            return None
        try:
            rec = self.sess.client().get(self.lease.id)
        except errors.GpuLeaseError:
            return None
        return describe_end(rec, self.lease.user)

    def finish(self) -> None:
        """Kill every worker, wait until each process is gone, remove the placement group, then
        release the lease. Idempotent, and carried through a second Stop press."""
        if self._finished:
            return
        while True:
            try:
                self._finish()
                break
            except KeyboardInterrupt:  # Stop pressed again during cleanup: finish it anyway
                continue
        self._finished = True

    def _finish(self) -> None:
        import ray

        self._releasing.set()
        if self._follower is not None:
            with contextlib.suppress(Exception):
                self._follower.close()
            self._follower = None

        wheres: list[tuple[_Rank, Where | None]] = []
        for rank in self.ranks:
            try:
                where = rank.worker.where(timeout=0) if _is_ready(rank.worker.ready_ref) else None
            except Exception:  # noqa: BLE001 - it never started: nothing of it can hold a GPU
                where = None
            wheres.append((rank, where))
            with contextlib.suppress(Exception):
                ray.kill(rank.worker.handle, no_restart=True)
        self.verified = all(w is not None for _, w in wheres) or not wheres
        nvml = True
        for rank, where in wheres:
            if where is None:
                continue
            indexes = [int(i) for i in rank.env.get("CUDA_VISIBLE_DEVICES", "").split(",") if i]
            uuids = [u for u in rank.env.get("GPULEASE_GPU_UUIDS", "").split(",") if u]
            seen = self._verify(rank.node, where, uuids, indexes)
            log.debug("worker %s on %s: %s", where.pid, rank.node, seen)
            self.verified = self.verified and seen["gone"]
            nvml = nvml and seen["nvml"]
        self.nvml = nvml and bool(wheres) and not self.cpu
        self.ranks = []
        if self.pg is not None:
            from ray.util import remove_placement_group

            try:
                remove_placement_group(self.pg)
            except Exception as exc:  # noqa: BLE001 - Ray removes it with this driver anyway
                log.warning("could not remove a placement group: %s", exc)
            self.pg = None
        if self.held is not None:
            self.held.release()
            self.sess.held.discard(self.held)

    def _verify(self, node: str, where: Where, uuids: list[str], indexes: list[int]) -> dict[str, Any]:
        """Is the process gone (and off its GPUs)? Watched from here when it shares our process
        table, else by a spare worker on its node."""
        if where.machine == self.sess.machine:
            return verify_gone(where.pid, uuids, indexes)
        import ray

        try:
            reaper = self.sess.spare(node)
            return ray.get(reaper.handle.reap.remote(where.pid, uuids, indexes), timeout=30)  # type: ignore[no-any-return]
        except Exception as exc:  # noqa: BLE001 - say so in the closing line; the lease is still released
            log.warning("could not verify that worker %s on %s exited: %s", where.pid, node, exc)
            return {"gone": False, "nvml": False}


def _is_ready(ref: Any) -> bool:
    import ray

    ready, _ = ray.wait([ref], timeout=0)
    return bool(ready)


def describe_end(rec: dict[str, Any], me: str) -> str | None:
    """One line of who ended a lease and why, from its ended record; None while it is live."""
    state = rec.get("state")
    if state not in ("released", "revoked", "expired"):
        return None
    by = rec.get("ended_by") or ""
    who = "you" if by == me else by
    reason = (rec.get("end_reason") or "").split("; save your work")[0]
    if state == "released":
        if reason == "released from the board":
            return f"released from the board by {who}"
        if not reason or reason == "released by its owner":
            return f"released by {who} (gpulease release or %gpu_lease release)"
        return f"released by {who}: {reason}"
    if state == "expired":
        return f"expired: {reason} (was the kernel paused or cut off?)"
    if reason.startswith("reclaimed"):
        return reason.replace(" and the owner did not keep it within the grace period", " after a warning")
    if by == "server":  # a recall ran out: a preemption, or a booking whose holder asked
        return reason.replace("recalled for", "preempted for", 1) if reason.startswith("recalled") else reason
    return f"revoked by {who}: {reason}" if reason else f"revoked by {who}"


def _join(a: str, b: str) -> str:
    return f"{a}; {b}" if a else b


# ---- starting the world of workers ---------------------------------------------------------------


def _start_world(sess: Session, grant: _Grant, opts: Options) -> None:
    """One worker for a one-node or CPU call; one per GPU in a placement group for a gang."""
    lease = grant.lease
    if lease is None:
        grant.ranks = [_Rank("cpu", 0, grant.env("cpu"), sess.new_worker(None, num_cpus=1))]
        return
    if not (opts.nodes and opts.nodes > 1):
        grant.ranks = [_Rank(lease.node, 0, grant.env(lease.node), sess.take_worker(lease.node))]
        return
    _start_gang(sess, grant)


def _start_gang(sess: Session, grant: _Grant) -> None:
    """A multi-node gang: one rank per leased GPU, numbered node by node in the lease's order.
    A Ray placement group reserves a bundle per rank on the leased nodes, all or nothing; if Ray
    cannot place (or start) every rank within ``gang_start_timeout``, none runs the call. Every
    rank sees its node's leased GPUs and the ``torch.distributed`` variables."""
    from ray.util import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    lease = grant.lease
    assert lease is not None
    parts = lease.parts()
    order = [n for n in lease.nodes if n in parts] + [n for n in parts if n not in lease.nodes]
    places = [(node, local) for node in order for local in range(len(parts[node]))]
    shares = [sess.node_share(node) for node, _ in places]
    grant.pg = placement_group(
        [share or {"CPU": GANG_BUNDLE_SHARE} for share in shares], strategy="PACK", name=f"gpulease-{lease.id}"
    )
    if not grant.pg.wait(sess.gang_start_timeout):
        raise GpuTrainError(
            f"Ray could not place all {len(places)} ranks on {', '.join(order)} within "
            f"{sess.gang_start_timeout:g}s; no rank was started",
            node=",".join(order),
        )
    for i, (node, local) in enumerate(places):
        strategy = PlacementGroupSchedulingStrategy(grant.pg, placement_group_bundle_index=i)
        worker = sess.new_worker(None, scheduling_strategy=strategy, **({"resources": shares[i]} if shares[i] else {}))
        grant.ranks.append(_Rank(node, local, grant.env(node), worker))
    master = _wait_ranks_started(sess, grant.ranks)
    world = len(places)
    for rank, r in enumerate(grant.ranks):
        r.env.update(
            RANK=str(rank),
            LOCAL_RANK=str(r.local),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(len(parts[r.node])),
            MASTER_ADDR=str(master["ip"]),
            MASTER_PORT=str(master["port"]),
        )


def _wait_ranks_started(sess: Session, ranks: list[_Rank]) -> dict[str, Any]:
    """Wait until every rank's process is up (none runs the call before all are); return rank
    0's endpoint (its node IP and a free port) for MASTER_ADDR / MASTER_PORT."""
    import ray

    deadline = time.monotonic() + sess.gang_start_timeout
    refs = [r.worker.ready_ref for r in ranks] + [ranks[0].worker.handle.endpoint.remote()]
    owner = list(range(len(ranks))) + [0]
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            late = sorted({owner[refs.index(r)] for r in pending})
            raise GpuTrainError(
                f"rank(s) {', '.join(map(str, late))} did not start within {sess.gang_start_timeout:g}s; "
                "no rank ran the call",
                node=ranks[late[0]].node,
                rank=late[0],
            )
        rank = owner[refs.index(ready[0])]
        try:
            ray.get(ready[0])
        except ray.exceptions.RayError as exc:
            raise GpuTrainError(
                f"rank {rank} on node {ranks[rank].node} could not start: {_first_line(exc)}; no rank ran the call",
                node=ranks[rank].node,
                rank=rank,
            ) from None
    return ray.get(refs[-1])  # type: ignore[no-any-return]


# ---- one output pump for 1..N workers ------------------------------------------------------------


class _Pump:
    """Starts the call on every rank and streams their output until all have returned. A world
    of one writes output as is; a gang's lines are prefixed ``[rank N]``. The first rank to fail
    raises; the caller then ends every rank."""

    def __init__(self, grant: _Grant, ui: UI) -> None:
        self.grant = grant
        self.ui = ui
        self.checkpoint: Any = None
        self.has_checkpoint = False
        self._warned_at: Any = None

    def run(self, call: Call, timeout: float | None) -> list[Result]:
        import ray

        ranks = self.grant.ranks
        multi = len(ranks) > 1
        writer = _RankWriter(self.ui.output) if multi else None
        watch = self.grant.watch()
        result_refs = {r.worker.handle.run.remote(call, r.env, watch): i for i, r in enumerate(ranks)}
        out_refs = {r.worker.handle.read_output.remote(POLL_S): i for i, r in enumerate(ranks)}
        results: dict[int, Result] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while len(results) < len(ranks):
                wait_s = POLL_S if deadline is None else max(0.0, min(POLL_S, deadline - time.monotonic()))
                ready, _ = ray.wait([*result_refs, *out_refs], num_returns=1, timeout=wait_s)
                if deadline is not None and time.monotonic() >= deadline and not ready:
                    every = "; every rank was stopped" if multi else ""
                    raise GpuTrainTimeout(f"stopped after --timeout {timeout:g}s{every}", node=self._nodes())
                self._check_lease()
                for ref in ready:
                    if ref in out_refs:
                        i = out_refs.pop(ref)
                        try:
                            chunks, done = ray.get(ref)
                        except ray.exceptions.RayError:
                            chunks, done = [], True
                        self._emit(i, chunks, writer)
                        if not done:
                            out_refs[ranks[i].worker.handle.read_output.remote(POLL_S)] = i
                        continue
                    i = result_refs.pop(ref)
                    result = self._collect(ref, i, multi)
                    if not result.ok:
                        self._drain(out_refs, writer)
                        rank = f"rank {i} on {ranks[i].node}" if multi else ranks[i].node
                        gpus = ranks[i].env.get("CUDA_VISIBLE_DEVICES", "")
                        raise GpuTrainError(
                            f"{result.error_type}: {result.message} (on {rank}"
                            + (f", GPU {gpus}" if gpus else "")
                            + ("; every rank was stopped)" if multi else ")"),
                            remote_traceback=result.traceback,
                            node=ranks[i].node,
                            remote_type=result.error_type,
                            rank=i if multi else None,
                        )
                    results[i] = result
            self._drain(out_refs, writer)
        finally:
            if writer is not None:
                writer.flush()
        return [results[i] for i in range(len(ranks))]

    def _nodes(self) -> str:
        return ",".join(dict.fromkeys(r.node for r in self.grant.ranks))

    def _check_lease(self) -> None:
        held = self.grant.held
        if held is None:
            return
        if held.lost is not None or self.grant.ended_elsewhere.is_set():  # someone else ended it
            raise GpuLeaseEnded(self.grant.ended_by() or f"the lease ended: {held.lost}", node=self._nodes())
        reclaim_at = held.lease.raw.get("reclaim_at")
        if reclaim_at and reclaim_at != self._warned_at:
            self._warned_at = reclaim_at
            self.ui.notice(
                f"these GPUs look idle: reclaimed in {max(0, reclaim_at - time.time()):.0f}s unless they get "
                f"busy; to keep them: gpulease keep {held.lease.id}"
            )

    def _collect(self, ref: Any, i: int, multi: bool) -> Result:
        import ray

        node = self.grant.ranks[i].node
        try:
            return ray.get(ref)  # type: ignore[no-any-return]
        except ray.exceptions.RayActorError:
            why = self.grant.ended_by()
            if why:
                raise GpuLeaseEnded(why, node=node) from None
            who = f"rank {i} on {node}" if multi else f"on {node}"
            raise GpuTrainError(
                f"the worker process {who} exited unexpectedly (os._exit, a crash, or the OOM killer)"
                + ("; every rank was stopped" if multi else ""),
                node=node,
                rank=i if multi else None,
            ) from None
        except ray.exceptions.RayError as exc:
            raise GpuTrainError(f"Ray could not run the call: {_first_line(exc)}", node=node) from None

    def _emit(self, i: int, chunks: list[tuple[str, str]], writer: _RankWriter | None) -> None:
        import base64

        from ray import cloudpickle

        for stream, text in chunks:
            if stream == CHECKPOINT_STREAM:
                if i == 0:  # rank 0's state, as for one node
                    self.checkpoint = cloudpickle.loads(base64.b64decode(text))
                    self.has_checkpoint = True
        plain = [c for c in chunks if c[0] != CHECKPOINT_STREAM]
        if writer is not None:
            for stream, text in plain:
                writer.write(i, stream, text)
        else:
            for stream, text in _merge(plain):
                self.ui.output(stream, text)

    def _drain(self, out_refs: dict[Any, int], writer: _RankWriter | None) -> None:
        """What the ranks printed and we have not shown yet (bounded: a rank may be gone)."""
        import ray

        for ref, i in list(out_refs.items()):
            out_refs.pop(ref)
            try:
                chunks, done = ray.get(ref, timeout=2)
                self._emit(i, chunks, writer)
                if not done:
                    chunks, _ = ray.get(self.grant.ranks[i].worker.handle.read_output.remote(0), timeout=2)
                    self._emit(i, chunks, writer)
            except Exception:  # noqa: BLE001 - the rank is gone; nothing more to show
                pass


def _merge(chunks: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Join consecutive pieces of one stream (print writes several)."""
    merged: list[tuple[str, str]] = []
    for stream, text in chunks:
        if merged and merged[-1][0] == stream:
            merged[-1] = (stream, merged[-1][1] + text)
        else:
            merged.append((stream, text))
    return merged


class _RankWriter:
    """Writes the ranks' output with each line prefixed ``[rank N] ``. A line is shown once it
    is complete (or at the end), so that two ranks' pieces of a line never mix."""

    def __init__(self, write: Callable[[str, str], None]) -> None:
        self._write = write
        self._partial: dict[tuple[int, str], str] = {}

    def write(self, rank: int, stream: str, text: str) -> None:
        key = (rank, stream)
        lines = (self._partial.pop(key, "") + text).splitlines(keepends=True)
        if lines and not lines[-1].endswith(("\n", "\r")):
            self._partial[key] = lines.pop()
        if lines:
            self._write(stream, "".join(f"[rank {rank}] {line}" for line in lines))

    def flush(self) -> None:
        for (rank, stream), text in sorted(self._partial.items()):
            self._write(stream, f"[rank {rank}] {text}\n")
        self._partial.clear()


# ---- the call ------------------------------------------------------------------------------------


def run_call(
    call: Call, options: Options | None = None, ui: UI | None = None, sess: Session | None = None
) -> CallResult:
    """Lease, run ``call`` on single-use workers of the lease's node(s), stream their output,
    then end them, see their processes gone, and release the lease, whatever happened.

    ``gpus=0`` runs on a CPU worker (a CPU slot of the CPU pool when the server declares one);
    ``gpus_min < gpus`` is an elastic request; ``nodes=k`` (k > 1) a multi-node gang whose value
    is rank 0's (``all_ranks``: every rank's, in rank order). ``ui`` sees queued -> running ->
    ended and the output. Raises :class:`GpuTrainError` (the call failed), its subclasses
    :class:`GpuTrainTimeout` and :class:`GpuLeaseEnded`, or :class:`GpuTrainStopped` (Stop)."""
    sess = sess or session()
    ui = ui or StreamUI()
    opts = (options or Options()).resolved(sess.defaults)
    assert opts.gpus is not None
    check_gang(opts.gpus_min, opts.gpus, opts.nodes)
    sess.connect_ray()
    cpu_pool = sess.client().request("GET", "/api/v1/info").get("cpu_pool") if opts.gpus == 0 else None
    try:
        grant = _Grant.take(sess, opts, ui, cpu_pool)
    except KeyboardInterrupt:
        ui.ended(Ending("withdrawn"))
        raise GpuTrainStopped("stopped while queued; the request was withdrawn") from None
    except errors.NoCapacity as exc:
        ui.ended(Ending("refused", why=exc.message))
        raise
    pump = _Pump(grant, ui)
    ending = Ending("failed", cpu=grant.cpu or grant.lease is None)
    try:
        try:
            ui.running(grant.running(opts))
            _start_world(sess, grant, opts)
            grant.follow()
            results = pump.run(call, opts.timeout)
            ending.state = "released"
            ending.peak_memory = _sum_memory(results)
        except KeyboardInterrupt:
            ending.state = "stopped"
            freed = "its GPUs are free" if grant.lease is not None and not grant.cpu else "its worker is gone"
            raise GpuTrainStopped(f"gpu_train stopped; {freed}") from None
        except GpuLeaseEnded as exc:
            ending.state, ending.why = "ended", exc.summary
            raise
        except GpuTrainTimeout:
            ending.state = "timeout"
            raise
        finally:
            grant.finish()
            ending.where = grant.where
            ending.gpus = len(grant.lease.gpus) if grant.lease else 0
            ending.held_s = time.monotonic() - grant.t0
            ending.verified, ending.nvml = grant.verified, grant.nvml
            ending.checkpoint = pump.has_checkpoint
            if ending.state == "released" and grant.lease is not None and not grant.cpu:
                ending.hint = _right_size(sess, grant.lease, ending.peak_memory)
            ui.ended(ending)
    except BaseException as exc:
        # The checkpoint hook's state travels with the error (the magic keeps it as gpu_checkpoint).
        if pump.has_checkpoint:
            exc.checkpoint = pump.checkpoint  # type: ignore[attr-defined]
        raise
    values = [r.value for r in results]
    lease = grant.lease
    return CallResult(
        values if opts.all_ranks else values[0],
        ending,
        lease.id if lease else "",
        ",".join(lease.parts()) if lease else "cpu",
        lease.indexes if lease else [],
        pump.checkpoint,
        pump.has_checkpoint,
    )


def _right_size(sess: Session, lease: Lease, peak: int | None) -> str:
    """Advice when NVML measured a peak far below what the lease held: the smallest pool whose GPUs
    would still hold it with room (1.5x), e.g. "peak 9 GB of 80 GB: a T4-16GB would do, --pool T4-16GB"."""
    if not peak:
        return ""
    per_gpu = peak / max(1, len(lease.gpus))
    held_mb = min((int(g.get("memory_mb", 0)) for g in lease.gpus), default=0)
    if not held_mb or per_gpu * 4 > held_mb * 2**20:
        return ""
    try:
        view = sess.client().cluster()
    except errors.GpuLeaseError:
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


def _gb(n: int | None) -> str:
    return f"{(n or 0) / 1e9:.1f} GB"


def _sum_memory(results: list[Result]) -> int | None:
    peaks = [r.peak_memory for r in results if r.peak_memory]
    return sum(peaks) if peaks else None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


# ---- a cell --------------------------------------------------------------------------------------


def plan_call(source: str, user_ns: dict[str, Any], options: Options) -> Call:
    """The cell as a :class:`Call`: the names it reads from ``user_ns`` travel with it, the names
    it assigns (or ``options.outputs``) come back. Raises SyntaxError or ValueError (a name that
    cannot travel, nothing to run, no checkpoint to resume)."""
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
    check_picklable(inputs)
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
    call = plan_call(source, user_ns, options)
    if not options.label:
        options = replace(options, label=source.strip().splitlines()[0][:120])
    if not options.cell:
        options = replace(options, cell=hashlib.sha1(source.encode()).hexdigest()[:12])
    try:
        out = run_call(call, options, ui, sess)
    except BaseException as exc:
        if hasattr(exc, "checkpoint"):
            user_ns["gpu_checkpoint"] = exc.checkpoint
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
    gpus: int | str | None = None,
    pool: str | None = None,
    timeout: str | float | None = None,
    wait: str | float | None = None,
    label: str = "",
    priority: str | None = None,
    nodes: int | None = None,
    all_ranks: bool = False,
    **kwargs: Any,
) -> Any:
    """Call ``fn(*args, **kwargs)`` on a worker holding ``gpus`` leased GPUs and return its value.

    The worker sees only those GPUs (``CUDA_VISIBLE_DEVICES``); the lease is released when the
    call ends, however it ends. Raises :class:`GpuTrainError` with the remote traceback on failure.

    ``nodes=k`` runs a multi-node gang for ``torch.distributed``: ``gpus/k`` GPUs on each of k
    nodes, granted all or nothing, and one process per GPU, each with ``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` set. Every rank calls ``fn``; the value
    returned is rank 0's (``all_ranks=True``: the list of every rank's value, in rank order).
    If any rank fails, every rank is stopped and the error names the rank and its node.
    """
    lo, hi = parse_gpus(gpus) if gpus is not None else (None, None)
    check_gang(lo, hi, nodes)
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
    )
    return run_call(Call.function(fn, *args, **kwargs), opts).value
