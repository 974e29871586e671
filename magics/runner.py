"""Run a function or a cell on leased GPUs through Ray: the plain, testable core of %%gpu_train.

    from magics import run_on_gpus
    losses = run_on_gpus(train, epochs=3, gpus=2, timeout="1h")

The lease server decides who holds which GPU; Ray only runs the call, on the node of the lease,
in a pre-started single-use worker whose ``CUDA_VISIBLE_DEVICES`` is exactly the leased indexes.
The lease is released the moment the call returns, fails, times out or is interrupted.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lease_server import errors
from lease_server.client import Client, HeldLease

from .worker import CHECKPOINT_STREAM, WATCHDOG_EXIT_CODE, GpuWorker

log = logging.getLogger(__name__)
RESOURCE_PREFIX = "gpulease_node_"
SPARES_PER_NODE = 2  # one for the next call, one for the call after it while the first is replaced
GANG_START_TIMEOUT_S = 60.0  # placing a gang's bundles and starting its rank processes
GANG_BUNDLE_SHARE = 0.001  # of a node's gpulease_node_<node> resource, per rank


def node_resource(node: str) -> str:
    """The Ray custom resource that marks the Ray node serving lease-server node ``node``."""
    return RESOURCE_PREFIX + node


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
        who = f"rank {self.rank} on node {self.node}" if self.rank is not None else f"the worker on node {self.node}"
        head = f"--- traceback from {who} ---\n" if self.remote_traceback else ""
        return f"{head}{self.remote_traceback}{self.summary}"


class GpuTrainTimeout(GpuTrainError):
    pass


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
class Outcome:
    value: Any
    lease_id: str
    node: str
    gpus: list[int]
    held_s: float
    peak_memory: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class Session:
    """Per-process state: the lease client, the Ray connection, spare workers, live leases."""

    def __init__(self) -> None:
        self.defaults = Defaults()
        self._client: Client | None = None
        self._lock = threading.RLock()
        self._pinned: bool | None = None
        self._spares: dict[str, deque[Any]] = {}
        self.held: set[HeldLease] = set()
        self._actor_cls: Any = None
        self._resources: set[str] = set()
        # What the last call's checkpoint hook returned when its GPUs were recalled (or None).
        self.last_checkpoint: Any = None
        self.has_checkpoint = False
        # A multi-node gang: how long Ray may take to place every rank and start its process.
        self.gang_start_timeout = GANG_START_TIMEOUT_S
        atexit.register(self.release_all)

    # ---- connections -------------------------------------------------------------------------

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

    def _new_worker(self, node: str) -> Any:

        opts: dict[str, Any] = {"num_cpus": 0, "max_concurrency": 4, "max_restarts": 0}
        if self._pinned:
            res = node_resource(node)
            if res not in self._resources and res not in self._refresh_resources():
                raise errors.ConfigurationError(
                    f"no Ray node serves lease-server node {node!r}: start Ray there with "
                    f"--resources '{{\"{res}\": 1000}}'"
                )
            opts["resources"] = {res: 0.001}
        return self._actor_cls.options(**opts).remote()

    def prewarm(self, nodes: list[str]) -> None:
        """Start spare workers on ``nodes`` now, so that a call later costs no process start."""
        self.connect_ray()
        with self._lock:
            for node in nodes:
                spares = self._spares.setdefault(node, deque())
                while len(spares) < SPARES_PER_NODE:
                    spares.append(self._new_worker(node))

    def take_worker(self, node: str) -> Any:
        """A pre-started worker on ``node`` (or a new one if none is left)."""
        with self._lock:
            spares = self._spares.setdefault(node, deque())
            return spares.popleft() if spares else self._new_worker(node)

    def replenish(self, node: str) -> None:
        """Start the spare that replaces the one just used, in the background: starting a
        process costs a second or two of CPU, which must not compete with the call itself."""

        def start() -> None:
            try:
                with self._lock:
                    spares = self._spares.setdefault(node, deque())
                    if len(spares) < SPARES_PER_NODE:
                        spares.append(self._new_worker(node))
            except Exception as exc:  # noqa: BLE001 - the next call starts one itself
                log.warning("could not start a spare worker on %s: %s", node, exc)

        threading.Thread(target=start, name="gpulease-spare", daemon=True).start()

    def release_all(self) -> None:
        """Kernel shutdown: give back every lease this process holds."""
        for held in list(self.held):
            try:
                held.release()
            except Exception as exc:  # noqa: BLE001 - best effort at exit; the TTL is the backstop
                log.warning("could not release %s at exit: %s", held.id, exc)
        self.held.clear()

    # ---- the call ----------------------------------------------------------------------------

    def run(
        self,
        call: dict[str, Any],
        *,
        gpus: int | None = None,
        pool: str | None = None,
        timeout: float | None = None,
        wait: float | None = None,
        label: str = "",
        session: str = "",
        on_queue: Callable[[int | None, float], None] | None = None,
        on_output: Callable[[str, str], None] | None = None,
        on_granted: Callable[[HeldLease], None] | None = None,
        on_released: Callable[[Outcome], None] | None = None,
        gpus_min: int | None = None,
        priority: str | None = None,
        nodes: int | None = None,
        all_ranks: bool = False,
        notebook: str = "",
        cell: str = "",
    ) -> Outcome:
        """Lease, run ``call`` on a single-use worker of the lease's node, stream its output,
        then kill the worker and release the lease, whatever happened. ``on_released`` gets the
        summary (how long the GPUs were held) after the release, on success and on failure.
        ``gpus=0`` runs the call on a CPU worker of the Ray cluster, without a lease;
        ``gpus_min`` makes the request elastic (granted gpus_min..gpus).

        ``nodes=k`` (k > 1) runs a multi-node gang: ``gpus/k`` GPUs on each of k nodes, all or
        nothing, one process per GPU (see :meth:`_run_gang`). The value is rank 0's, or with
        ``all_ranks`` the list of every rank's value in rank order."""
        d = self.defaults
        gpus = d.gpus if gpus is None else gpus
        pool = pool or d.pool
        timeout = d.timeout if timeout is None else timeout
        wait = d.wait if wait is None else wait
        write = on_output or _write_local
        self.last_checkpoint, self.has_checkpoint = None, False
        # For the usage ledger: which notebook, and which cell (its hash), the lease is for.
        self._call_meta = {"notebook": notebook, "cell": cell}
        self.connect_ray()
        cpu = False
        if gpus == 0:
            if nodes is not None and nodes > 1:
                raise ValueError("nodes > 1 needs GPUs: a gang runs one process per leased GPU")
            cpu_pool = self.client().request("GET", "/api/v1/info").get("cpu_pool")
            if not cpu_pool:
                return self._run_cpu(call, timeout, write, on_released)
            # The CPU pool: one CPU slot leased like a GPU (queue, fair share, ledger).
            gpus, pool, gpus_min, cpu = 1, cpu_pool, None, True
        if nodes is not None and nodes > 1:
            return self._run_gang(
                call,
                gpus=gpus,
                nodes=nodes,
                pool=pool,
                timeout=timeout,
                wait=wait,
                label=label,
                session=session,
                on_queue=on_queue,
                write=write,
                on_granted=on_granted,
                on_released=on_released,
                gpus_min=gpus_min,
                priority=priority,
                all_ranks=all_ranks,
            )
        client = self.client()
        lease, held = self._take_lease(gpus, pool, wait, label, session, on_queue, gpus_min=gpus_min, priority=priority)
        t0 = time.monotonic()
        worker = None
        result: dict[str, Any] | None = None
        try:
            if on_granted:
                on_granted(held)
            worker = self.take_worker(lease.node)
            env = {
                "CUDA_VISIBLE_DEVICES": "" if cpu else lease.cuda_visible_devices,
                "GPULEASE_LEASE_ID": lease.id,
                "GPULEASE_GPU_UUIDS": ",".join(lease.uuids),
                "GPULEASE_NODE": lease.node,
            }
            watch = {"url": client.url, "token": client.token, "id": lease.id}
            result = self._drive(worker, call, env, watch, timeout, write, lease, held)
            assert result is not None
            if not result["ok"]:
                raise GpuTrainError(
                    f"{result['type']}: {result['message']} (on {lease.node}, GPU {lease.cuda_visible_devices})",
                    remote_traceback=result["traceback"],
                    node=lease.node,
                    remote_type=result["type"],
                )
            return Outcome(
                result["value"],
                lease.id,
                lease.node,
                lease.indexes,
                time.monotonic() - t0,
                result.get("peak_memory"),
                extra={"cpu": cpu},
            )
        finally:
            if worker is not None:
                import ray

                ray.kill(worker, no_restart=True)  # single use: its process, and GPU memory, go now
            held.release()
            self.held.discard(held)
            if worker is not None:
                self.replenish(lease.node)
            if on_released is not None:
                peak = result.get("peak_memory") if result else None
                on_released(
                    Outcome(None, lease.id, lease.node, lease.indexes, time.monotonic() - t0, peak, extra={"cpu": cpu})
                )

    # ---- multi-node gangs ------------------------------------------------------------------------

    def _run_gang(
        self,
        call: dict[str, Any],
        *,
        gpus: int,
        nodes: int,
        pool: str | None,
        timeout: float | None,
        wait: float,
        label: str,
        session: str,
        on_queue: Callable[[int | None, float], None] | None,
        write: Callable[[str, str], None],
        on_granted: Callable[[HeldLease], None] | None,
        on_released: Callable[[Outcome], None] | None,
        gpus_min: int | None,
        priority: str | None,
        all_ranks: bool,
    ) -> Outcome:
        """A multi-node gang: ``gpus/nodes`` GPUs on each of ``nodes`` nodes, one process per GPU.

        The lease server grants every node's share at once or nothing (one lease). A Ray placement
        group then reserves one bundle per rank on the leased nodes, all or nothing: if Ray cannot
        place every bundle within ``gang_start_timeout`` no rank starts and the lease is released.
        Each rank is a fresh single-use worker (spares are not in the placement group) that sees
        its node's leased GPUs and the ``torch.distributed`` variables ``RANK``, ``WORLD_SIZE``,
        ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` (rank 0's node IP
        and a port free there). Ranks are numbered node by node in the lease's node order. Every
        rank runs the same call; its output is streamed prefixed with ``[rank N]``. If one rank
        fails (raises, or its process dies) every rank is killed and the error names that rank
        and its node. Whatever happens, every rank is killed, the placement group removed and the
        lease released before this returns."""
        import ray
        from ray.util import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if gpus_min is not None and gpus_min != gpus:
            raise ValueError("a multi-node gang is all or nothing: ask for a GPU count, not a range")
        client = self.client()
        lease, held = self._take_lease(gpus, pool, wait, label, session, on_queue, priority=priority, nodes=nodes)
        t0 = time.monotonic()
        parts = lease.parts()
        order = [n for n in lease.nodes if n in parts] + [n for n in parts if n not in lease.nodes]
        ranks = [(node, local) for node in order for local in range(len(parts[node]))]
        world = len(ranks)
        where = " + ".join(f"{n} (GPU {','.join(map(str, parts[n]))})" for n in order)
        pg: Any = None
        workers: list[Any] = []
        results: dict[int, dict[str, Any]] = {}

        def gang_outcome(value: Any) -> Outcome:
            return Outcome(
                value,
                lease.id,
                ",".join(order),
                lease.indexes,
                time.monotonic() - t0,
                _sum_memory(results.values()),
                extra={"parts": parts, "world_size": world, "where": where},
            )

        try:
            if on_granted:
                on_granted(held)
            shares = [self._gang_share(node) for node, _ in ranks]
            pg = placement_group(
                [share or {"CPU": GANG_BUNDLE_SHARE} for share in shares], strategy="PACK", name=f"gpulease-{lease.id}"
            )
            if not pg.wait(self.gang_start_timeout):
                raise GpuTrainError(
                    f"Ray could not place all {world} ranks on {', '.join(order)} within "
                    f"{self.gang_start_timeout:g}s; no rank was started and the GPUs were released",
                    node=",".join(order),
                )
            for i in range(world):
                strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)
                opts: dict[str, Any] = {
                    "num_cpus": 0,
                    "max_concurrency": 4,
                    "max_restarts": 0,
                    "scheduling_strategy": strategy,
                }
                if shares[i]:
                    opts["resources"] = shares[i]
                workers.append(self._actor_cls.options(**opts).remote())
            master = self._start_ranks(workers, ranks)
            watch = {"url": client.url, "token": client.token, "id": lease.id}
            envs = []
            for rank, (node, local) in enumerate(ranks):
                envs.append(
                    {
                        "CUDA_VISIBLE_DEVICES": ",".join(map(str, parts[node])),
                        "GPULEASE_LEASE_ID": lease.id,
                        "GPULEASE_GPU_UUIDS": ",".join(
                            g.get("uuid", "") for g in lease.gpus if g.get("node", lease.node) == node
                        ),
                        "GPULEASE_NODE": node,
                        "RANK": str(rank),
                        "LOCAL_RANK": str(local),
                        "WORLD_SIZE": str(world),
                        "LOCAL_WORLD_SIZE": str(len(parts[node])),
                        "MASTER_ADDR": str(master["ip"]),
                        "MASTER_PORT": str(master["port"]),
                    }
                )
            results = self._drive_gang(workers, ranks, call, envs, watch, timeout, write, lease, held)
            values = [results[r]["value"] for r in range(world)]
            return gang_outcome(values if all_ranks else values[0])
        finally:
            for w in workers:
                try:
                    ray.kill(w, no_restart=True)
                except Exception:  # noqa: BLE001 - already gone
                    pass
            if pg is not None:
                try:
                    remove_placement_group(pg)
                except Exception as exc:  # noqa: BLE001 - Ray removes it with this driver anyway
                    log.warning("could not remove placement group of %s: %s", lease.id, exc)
            held.release()
            self.held.discard(held)
            if on_released is not None:
                on_released(gang_outcome(None))

    def _gang_share(self, node: str) -> dict[str, float]:
        """What one rank's bundle takes of ``node``'s Ray resource ({} if Ray nodes are not pinned)."""
        if not self._pinned:
            return {}
        res = node_resource(node)
        if res not in self._resources and res not in self._refresh_resources():
            raise errors.ConfigurationError(
                f"no Ray node serves lease-server node {node!r}: start Ray there with --resources '{{\"{res}\": 1000}}'"
            )
        return {res: GANG_BUNDLE_SHARE}

    def _start_ranks(self, workers: list[Any], ranks: list[tuple[str, int]]) -> dict[str, Any]:
        """Wait until every rank's process is up (none runs the call before all are); return rank
        0's endpoint (its node IP and a free port) for MASTER_ADDR / MASTER_PORT."""
        import ray

        deadline = time.monotonic() + self.gang_start_timeout
        refs = [w.ready.remote() for w in workers] + [workers[0].endpoint.remote()]
        owner = list(range(len(workers))) + [0]
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                late = sorted({owner[refs.index(r)] for r in pending})
                raise GpuTrainError(
                    f"rank(s) {', '.join(map(str, late))} did not start within {self.gang_start_timeout:g}s; "
                    "no rank ran the call and the GPUs were released",
                    node=ranks[late[0]][0],
                    rank=late[0],
                )
            rank = owner[refs.index(ready[0])]
            try:
                ray.get(ready[0])
            except ray.exceptions.RayError as exc:
                raise GpuTrainError(
                    f"rank {rank} on node {ranks[rank][0]} could not start: {_first_line(exc)}; "
                    "no rank ran the call and the GPUs were released",
                    node=ranks[rank][0],
                    rank=rank,
                ) from None
        return ray.get(refs[-1])  # type: ignore[no-any-return]

    def _drive_gang(
        self,
        workers: list[Any],
        ranks: list[tuple[str, int]],
        call: dict[str, Any],
        envs: list[dict[str, str]],
        watch: dict[str, Any],
        timeout: float | None,
        write: Callable[[str, str], None],
        lease: Any,
        held: HeldLease,
    ) -> dict[int, dict[str, Any]]:
        """Start the call on every rank, stream their output until all have returned, and return
        each rank's result. The first rank to fail raises (the caller then kills every rank)."""
        import ray

        out = _RankWriter(write)
        result_refs = {w.run.remote(call, envs[r], watch): r for r, w in enumerate(workers)}
        out_refs = {w.read_output.remote(0.5): r for r, w in enumerate(workers)}
        drained: set[int] = set()
        results: dict[int, dict[str, Any]] = {}
        deadline = None if timeout is None else time.monotonic() + timeout

        def read(ref: Any, rank: int) -> None:
            try:
                chunks, done = ray.get(ref)
            except ray.exceptions.RayError:
                chunks, done = [], True
            self._emit_rank(rank, chunks, out)
            if done:
                drained.add(rank)
            else:
                out_refs[workers[rank].read_output.remote(0.5)] = rank

        def drain() -> None:
            """What the ranks printed and we have not shown yet (bounded: a rank may be gone)."""
            for ref, rank in list(out_refs.items()):
                out_refs.pop(ref)
                try:
                    chunks, done = ray.get(ref, timeout=2)
                    self._emit_rank(rank, chunks, out)
                    if not done:
                        chunks, _ = ray.get(workers[rank].read_output.remote(0), timeout=2)
                        self._emit_rank(rank, chunks, out)
                except Exception:  # noqa: BLE001 - the rank is gone; nothing more to show
                    pass
            out.flush()

        try:
            while len(results) < len(workers):
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                ready, _ = ray.wait([*result_refs, *out_refs], num_returns=1, timeout=remaining)
                if not ready:
                    raise GpuTrainTimeout(
                        f"stopped after --timeout {timeout:g}s; every rank was stopped and the GPUs were released. "
                        "Raise --timeout, or save checkpoints and resume.",
                        node=",".join(dict.fromkeys(n for n, _ in ranks)),
                    )
                for ref in ready:
                    if ref in out_refs:
                        read(ref, out_refs.pop(ref))
                        continue
                    rank = result_refs.pop(ref)
                    node = ranks[rank][0]
                    try:
                        result = self._collect(ref, lease, held)
                    except GpuTrainError as exc:
                        drain()
                        raise GpuTrainError(
                            f"rank {rank} on node {node}: {exc.summary}; every rank was stopped",
                            node=node,
                            rank=rank,
                        ) from None
                    if not result["ok"]:
                        drain()
                        raise GpuTrainError(
                            f"{result['type']}: {result['message']} (rank {rank} on {node}, GPU "
                            f"{envs[rank]['CUDA_VISIBLE_DEVICES']}; every rank was stopped)",
                            remote_traceback=result["traceback"],
                            node=node,
                            remote_type=result["type"],
                            rank=rank,
                        )
                    results[rank] = result
            drain()
        finally:
            out.flush()
        return results

    def _emit_rank(self, rank: int, chunks: list[tuple[str, str]], out: _RankWriter) -> None:
        """A rank's output, prefixed line by line; rank 0's checkpoint state is kept as for one node."""
        import base64

        from ray import cloudpickle

        for stream, text in chunks:
            if stream == CHECKPOINT_STREAM:
                if rank == 0:
                    self.last_checkpoint = cloudpickle.loads(base64.b64decode(text))
                    self.has_checkpoint = True
            else:
                out.write(rank, stream, text)

    def _take_lease(
        self,
        gpus: int,
        pool: str | None,
        wait: float,
        label: str,
        session: str,
        on_queue: Callable[[int | None, float], None] | None,
        **kw: Any,
    ) -> tuple[Any, HeldLease]:
        """Acquire (waiting in the queue with progress) and keep the lease renewed, marked busy."""
        client = self.client()
        kw.update(getattr(self, "_call_meta", {}))
        lease = client.acquire(gpus, pool, self.defaults.ttl, wait, label[:200], session[:200], progress=on_queue, **kw)
        held = HeldLease(client, lease)
        held.activity = {"executing": True, "source": "gpu_train"}
        self.held.add(held)
        return lease, held

    def _drive(
        self,
        worker: Any,
        call: dict[str, Any],
        env: dict[str, str],
        watch: dict[str, Any],
        timeout: float | None,
        write: Callable[[str, str], None],
        lease: Any,
        held: HeldLease | None,
    ) -> dict[str, Any]:
        """Start the call on ``worker``, stream its output until it ends, and return its result."""
        import ray

        warned_at = None
        result: dict[str, Any] | None = None
        node = lease.node if lease is not None else "a CPU worker"
        result_ref = worker.run.remote(call, env, watch)
        out_ref = worker.read_output.remote(0.5)
        drained = False
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _ = ray.wait([result_ref, out_ref], num_returns=1, timeout=remaining)
            if not ready:
                raise GpuTrainTimeout(
                    f"stopped after --timeout {timeout:g}s; the GPUs were released. "
                    "Raise --timeout, or save checkpoints and resume.",
                    node=node,
                )
            reclaim_at = held.lease.raw.get("reclaim_at") if held is not None else None
            if reclaim_at and reclaim_at != warned_at:
                warned_at = reclaim_at
                write(
                    "stderr",
                    f"gpu_train: the lease server sees these GPUs idle; they will be reclaimed in "
                    f"{max(0, reclaim_at - time.time()):.0f}s unless they get busy. To keep them: "
                    f"'gpulease keep {lease.id}' or 'Still using it' on the GPU board.\n",
                )
            if out_ref in ready:
                try:
                    chunks, done = ray.get(out_ref)
                except ray.exceptions.RayActorError:
                    chunks, done = [], True
                self._emit(chunks, write)
                drained = done
                out_ref = None if done else worker.read_output.remote(0.5)
            if result_ref in ready or out_ref is None:
                result = self._collect(result_ref, lease, held)
                # Drain what the worker printed after our last read (if it had not said it was done).
                # What the worker printed last: the read still in flight holds some of it,
                # and a final read takes the rest unless the worker already said it was done.
                try:
                    if out_ref is not None:
                        chunks, drained = ray.get(out_ref, timeout=5)
                        self._emit(chunks, write)
                    if not drained:
                        chunks, _ = ray.get(worker.read_output.remote(0), timeout=5)
                        self._emit(chunks, write)
                except Exception:  # noqa: BLE001 - the worker is gone; nothing more to show
                    pass
                break
        assert result is not None
        return result

    def _run_cpu(
        self,
        call: dict[str, Any],
        timeout: float | None,
        write: Callable[[str, str], None],
        on_released: Callable[[Outcome], None] | None,
    ) -> Outcome:
        """``--gpus 0``: a single-use worker that takes one CPU of the Ray cluster, no lease."""
        import ray

        t0 = time.monotonic()
        worker = self._actor_cls.options(num_cpus=1, max_concurrency=4, max_restarts=0).remote()
        try:
            result = self._drive(worker, call, {"CUDA_VISIBLE_DEVICES": ""}, {}, timeout, write, None, None)
            if not result["ok"]:
                raise GpuTrainError(
                    f"{result['type']}: {result['message']} (on a CPU worker)",
                    remote_traceback=result["traceback"],
                    node="cpu",
                    remote_type=result["type"],
                )
            return Outcome(result["value"], "", "cpu", [], time.monotonic() - t0, extra={"cpu": True})
        finally:
            ray.kill(worker, no_restart=True)
            if on_released is not None:
                on_released(Outcome(None, "", "cpu", [], time.monotonic() - t0, extra={"cpu": True}))

    def _emit(self, chunks: list[tuple[str, str]], write: Callable[[str, str], None]) -> None:
        """Write the worker's output; keep the state a checkpoint hook sent along with it."""
        import base64

        from ray import cloudpickle

        for stream, text in chunks:
            if stream == CHECKPOINT_STREAM:
                self.last_checkpoint = cloudpickle.loads(base64.b64decode(text))
                self.has_checkpoint = True
        _emit([c for c in chunks if c[0] != CHECKPOINT_STREAM], write)

    def _collect(self, result_ref: Any, lease: Any, held: HeldLease | None) -> dict[str, Any]:
        import ray

        node = lease.node if lease is not None else "cpu"
        try:
            return ray.get(result_ref)  # type: ignore[no-any-return]
        except ray.exceptions.RayActorError as exc:
            why = self._lease_end_reason(lease.id) if lease is not None else None
            if why:
                saved = "; the checkpoint hook's state is in gpu_checkpoint" if self.has_checkpoint else ""
                raise GpuTrainError(f"the worker was stopped because its lease {why}{saved}", node=node) from None
            code = ""
            if WATCHDOG_EXIT_CODE and str(WATCHDOG_EXIT_CODE) in str(exc):
                code = " (watchdog)"
            raise GpuTrainError(f"the worker process died{code}: {_first_line(exc)}", node=node) from None
        except ray.exceptions.RayError as exc:
            raise GpuTrainError(f"Ray could not run the call: {_first_line(exc)}", node=node) from None

    def _lease_end_reason(self, lease_id: str) -> str | None:
        try:
            rec = self.client().get(lease_id)
        except errors.GpuLeaseError:
            return None
        if rec.get("state") in ("revoked", "expired"):
            return f"was {rec['state']}: {rec.get('end_reason', '')}"
        return None


def _emit(chunks: list[tuple[str, str]], write: Callable[[str, str], None]) -> None:
    """Write captured output, joining consecutive pieces of one stream (print writes several)."""
    merged: list[tuple[str, str]] = []
    for stream, text in chunks:
        if merged and merged[-1][0] == stream:
            merged[-1] = (stream, merged[-1][1] + text)
        else:
            merged.append((stream, text))
    for stream, text in merged:
        write(stream, text)


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


def _sum_memory(results: Any) -> int | None:
    peaks = [r.get("peak_memory") for r in results if r.get("peak_memory")]
    return sum(peaks) if peaks else None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _write_local(stream: str, text: str) -> None:
    target = sys.stderr if stream == "stderr" else sys.stdout
    target.write(text)
    target.flush()


_session: Session | None = None


def session() -> Session:
    global _session
    if _session is None:
        _session = Session()
    return _session


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
    s = session()
    lo, hi = parse_gpus(gpus) if gpus is not None else (None, None)
    check_gang(lo, hi, nodes)
    outcome = s.run(
        {"kind": "function", "fn": fn, "args": args, "kwargs": kwargs},
        gpus=hi,
        gpus_min=lo,
        priority=priority,
        nodes=nodes,
        all_ranks=all_ranks,
        pool=pool,
        timeout=parse_duration(timeout),
        wait=parse_duration(wait),
        label=label or getattr(fn, "__name__", "call"),
    )
    return outcome.value
