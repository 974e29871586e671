"""The kernel's connections: the lease client, the Ray connection, the spare workers.

Nothing about a particular call lives here: its lease is a :class:`magics.grant.Grant`, its
processes a :class:`magics.world.World`, a warm cell's worker is :mod:`magics.warm`'s.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lease_server import errors, protocol
from lease_server.client import Client, HeldLease
from lease_server.node import rayauth, rayworkers

from .calls import Where, this_machine
from .options import Defaults
from .worker import GpuWorker

log = logging.getLogger(__name__)
RESOURCE_PREFIX = "gpulease_node_"
GANG_START_TIMEOUT_S = 60.0  # placing a gang's bundles and starting its rank processes
# starting a one-node call's worker process (a spare is up already): Ray may be unable to place it
# (its node gone from Ray, or its gpulease_node_<node> resource held by someone else)
WORKER_START_TIMEOUT_S = 120.0
GANG_BUNDLE_SHARE = 0.001  # of a node's gpulease_node_<node> resource, per rank
READY_WAIT_S = 5.0  # how long ending a worker waits to learn a starting one's pid


def node_resource(node: str) -> str:
    """The Ray custom resource that marks the Ray node serving lease-server node ``node``."""
    return RESOURCE_PREFIX + node


@dataclass
class Worker:
    """A started worker actor and the reference that resolves to where its process lives."""

    handle: Any
    ready_ref: Any

    preloaded: Any = None  # resolves once it imported what earlier GPU cells imported

    def where(self, timeout: float = 60.0) -> Where:
        import ray

        return ray.get(self.ready_ref, timeout=timeout)  # type: ignore[no-any-return]


BOOT_DIR = rayworkers.BOOT_DIR
worker_pythonpath = rayworkers.worker_pythonpath


class Session:
    """Per-process connections: the lease client, the Ray connection, the spare workers. Leases
    held right now are tracked only so that a kernel shutdown can give them back."""

    def __init__(self) -> None:
        self.defaults = Defaults()
        self._client: Client | None = None
        self._instance: str | None = None
        self._lock = threading.RLock()
        self._pinned: bool | None = None
        self._spares: dict[str, deque[Worker]] = {}
        self._spare_count: dict[str, int] = {}  # spares kept per node, where not defaults.spares
        self._actor_cls: Any = None
        self._resources: set[str] = set()
        self._booted: tuple[set[str], bool] | None = None  # see _boots
        self._worker_pythonpath = worker_pythonpath()
        self.machine = this_machine()
        self.held: set[HeldLease] = set()
        self.waiting: set[str] = set()  # request ids queued right now
        # What outlives a call and ends before the kernel gives its leases back (a warm worker,
        # magics.warm): each is called with the reason at every release_all.
        self.before_release: list[Callable[[str], None]] = []
        self.preload: set[str] = set()  # installed packages earlier GPU cells imported: spares import them
        # --gpu-mem auto: the last measured peak GPU memory (MB) of this kernel's calls, kept once a
        # call asked for a slice (runner._note_peak)
        self.mem_peak_mb: int | None = None
        self.mem_peak_wanted = False
        self._background: set[threading.Thread] = set()  # releases running after their call returned
        # A multi-node gang: how long Ray may take to place every rank and start its process.
        self.gang_start_timeout = GANG_START_TIMEOUT_S
        self.worker_start_timeout = WORKER_START_TIMEOUT_S  # a one-node call's worker
        atexit.register(self.release_all)

    def client(self) -> Client:
        with self._lock:
            if self._client is None:
                self._client = Client(self.defaults.url, self.defaults.token, notebook=True)
            return self._client

    def reset_client(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
            self._client = None
            self._instance = None

    def instance(self) -> str:
        """The lease server's deployment id (GET /info, asked once): it names the node agents'
        claim sockets, where a worker ties itself to its lease (lease_server/node/claims.py)."""
        if self._instance is None:
            self._instance = str(self.client().request("GET", protocol.INFO).get("instance") or "")
        return self._instance

    def connect_ray(self) -> None:
        """Join the Ray cluster that the lease server names; start nothing of our own."""
        import ray

        # Ray tells notebook users to install ipywidgets for a prettier repr; that is noise here.
        logging.getLogger("ray.widgets.util").setLevel(logging.WARNING)
        with self._lock:
            if self._actor_cls is not None and ray.is_initialized():
                return
            if not ray.is_initialized():
                info = self.client().request("GET", protocol.INFO)
                address = info.get("ray_address") or os.environ.get("RAY_ADDRESS")
                if not address:
                    raise errors.ConfigurationError(
                        "the lease server names no Ray cluster: start it with 'gpulease up' (which starts "
                        "a Ray head) or 'gpulease server --ray-address HOST:PORT'"
                    )
                _probe_ray(address)
                if info.get("ray_address") and info.get("ray_auth_token"):
                    # The cluster the lease server names runs with token authentication: join
                    # with the token it hands out with the address (lease_server/node/rayauth.py).
                    rayauth.use_token(info["ray_auth_token"])
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
        self._booted = None
        return self._resources

    def _boots(self, node: str | None) -> bool:
        """Whether the Ray node of ``node`` (None: every node) starts workers with this kernel's
        worker PYTHONPATH already (lease_server/node/rayworkers.py), so that they need no runtime
        environment: a worker then starts for a quarter of the CPU."""
        import ray

        if self._booted is None:
            mark = rayworkers.boot_resource(self._worker_pythonpath)
            alive = [n.get("Resources") or {} for n in ray.nodes() if n.get("Alive")]
            self._booted = (
                {r for res in alive if mark in res for r in res if r.startswith(RESOURCE_PREFIX)},
                bool(alive) and all(mark in res for res in alive),
            )
        nodes, everywhere = self._booted
        return everywhere or (node is not None and self._pinned is True and node_resource(node) in nodes)

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

    def new_worker(self, node: str | None, **opts: Any) -> Worker:
        """Start a worker: on ``node``'s Ray node, or (node None) anywhere with ``opts``."""
        merged: dict[str, Any] = {"num_cpus": 0, "max_concurrency": 4, "max_restarts": 0, **opts}
        if node is not None and "resources" not in merged:
            share = self.node_share(node)
            if share:
                merged["resources"] = share
        if not self._boots(node):
            merged["runtime_env"] = {"env_vars": {"PYTHONPATH": self._worker_pythonpath}}
        handle = self._actor_cls.options(**merged).remote()
        worker = Worker(handle, handle.ready.remote())
        if self.preload:
            worker.preloaded = handle.preload.remote(sorted(self.preload))
        return worker

    def in_background(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` (a call's verified release) in a thread of its own; :meth:`wait_background`
        and a kernel shutdown wait for it."""

        def run() -> None:
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - the TTL and the node agent are the backstop
                log.warning("a release in the background failed: %s", exc)
            finally:
                with self._lock:
                    self._background.discard(threading.current_thread())

        t = threading.Thread(target=run, name="gpulease-release", daemon=True)
        with self._lock:
            self._background.add(t)
        t.start()

    def wait_background(self, timeout: float = 30.0) -> None:
        """Until every release started in the background is done."""
        with self._lock:
            threads = list(self._background)
        for t in threads:
            t.join(timeout)

    def note_imports(self, names: list[str]) -> None:
        """A GPU cell imported these installed packages: every spare imports them now, and every
        spare started later at its start, so the next cold cell pays only for its own work."""
        new = set(names) - self.preload
        if not new:
            return
        with self._lock:
            self.preload |= new
            for spares in self._spares.values():
                for worker in spares:
                    worker.preloaded = worker.handle.preload.remote(sorted(self.preload))

    def prewarm(self, nodes: list[str]) -> None:
        """Start spare workers on ``nodes`` now, so that a call later costs no process start."""
        self.connect_ray()
        with self._lock:
            for node in nodes:
                spares = self._spares.setdefault(node, deque())
                while len(spares) < self.spares_for(node):
                    spares.append(self.new_worker(node))

    def prewarm_to(self, node: str, count: int) -> None:
        """Have at least ``count`` pre-started workers on ``node`` now, without raising how many
        the session keeps replacing (:meth:`set_spares`): for a burst, such as a sweep's first trials."""
        self.connect_ray()
        with self._lock:
            spares = self._spares.setdefault(node, deque())
            while len(spares) < count:
                spares.append(self.new_worker(node))

    def spare_nodes(self) -> list[str]:
        """The nodes this session keeps spare workers on (those it prewarmed or took one from)."""
        with self._lock:
            return list(self._spares)

    def spares_for(self, node: str) -> int:
        """How many pre-started workers this session keeps on ``node``."""
        return self._spare_count.get(node, self.defaults.spares)

    def set_spares(self, node: str, count: int) -> int:
        """Keep ``count`` pre-started workers on ``node`` from now on, starting the missing ones
        now and ending any beyond it; returns the count it replaces. A sweep raises it while its
        trials start side by side (each needs a fresh process), then puts it back."""
        import ray

        self.connect_ray()
        with self._lock:
            old = self.spares_for(node)
            self._spare_count[node] = count
            spares = self._spares.setdefault(node, deque())
            while len(spares) > count:
                with contextlib.suppress(Exception):
                    ray.kill(spares.pop().handle, no_restart=True)
            while len(spares) < count:
                spares.append(self.new_worker(node))
        return old

    def take_worker(self, node: str, replenish: bool = True) -> Worker:
        """A pre-started worker on ``node`` (or a new one if none is left); a replacement starts
        in the background unless ``replenish`` is False (an elastic gang, whose processes live on
        through its resizes: starting replacements would only take CPU from it)."""
        with self._lock:
            spares = self._spares.setdefault(node, deque())
            worker = spares.popleft() if spares else self.new_worker(node)
        if replenish:
            self.replenish(node)
        return worker

    def spare(self, node: str) -> Worker:
        """A live worker on ``node`` to run a short helper task on (it stays a spare)."""
        with self._lock:
            spares = self._spares.setdefault(node, deque())
            if not spares:
                spares.append(self.new_worker(node))
            return spares[0]

    def replenish(self, node: str) -> None:
        """Start the spare that replaces the one just taken, in the background: starting a
        process costs a second or two of CPU, which must not compete with the call itself."""

        def start() -> None:
            try:
                with self._lock:
                    if len(self._spares.setdefault(node, deque())) >= self.spares_for(node):
                        return
                # Asking Ray for the actor takes a round trip to its control plane: not under the
                # lock, which the next call's take_worker needs (a sweep takes several at once).
                worker = self.new_worker(node)
                with self._lock:
                    self._spares.setdefault(node, deque()).append(worker)
            except Exception as exc:  # noqa: BLE001 - the next call starts one itself
                log.warning("could not start a spare worker on %s: %s", node, exc)

        threading.Thread(target=start, name="gpulease-spare", daemon=True).start()

    def release_all(self, reason: str = "kernel shut down") -> None:
        """Kernel shutdown: withdraw every queued request and give back every lease held."""
        for end in list(self.before_release):
            with contextlib.suppress(Exception):
                end(reason)
        self.wait_background()
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


def _probe_ray(address: str, timeout: float = 3.0) -> None:
    """Fail in seconds, with the next step, when the Ray head does not answer: ``ray.init`` would
    retry for minutes and hold the kernel (it runs while the kernel starts)."""
    import socket

    host, _, port = address.rpartition(":")
    if not port.isdigit() or "/" in host:  # "auto", ray://...: Ray's own lookup, not a plain head
        return
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout):
            return
    except (OSError, ValueError) as exc:
        raise errors.ConfigurationError(
            f"the Ray head at {address} does not answer ({exc}): restart 'gpulease up', or ask your admin "
            "to restart Ray on the head node"
        ) from None
