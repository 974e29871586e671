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

    def __init__(self, summary: str, remote_traceback: str = "", node: str = "", remote_type: str = "") -> None:
        super().__init__(summary)
        self.summary = summary
        self.remote_traceback = remote_traceback
        self.node = node
        self.remote_type = remote_type

    def render(self) -> str:
        head = f"--- traceback from the worker on node {self.node} ---\n" if self.remote_traceback else ""
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
    ) -> Outcome:
        """Lease, run ``call`` on a single-use worker of the lease's node, stream its output,
        then kill the worker and release the lease, whatever happened. ``on_released`` gets the
        summary (how long the GPUs were held) after the release, on success and on failure.
        ``gpus=0`` runs the call on a CPU worker of the Ray cluster, without a lease;
        ``gpus_min`` makes the request elastic (granted gpus_min..gpus)."""
        d = self.defaults
        gpus = d.gpus if gpus is None else gpus
        pool = pool or d.pool
        timeout = d.timeout if timeout is None else timeout
        wait = d.wait if wait is None else wait
        write = on_output or _write_local
        self.last_checkpoint, self.has_checkpoint = None, False
        self.connect_ray()
        if gpus == 0:
            return self._run_cpu(call, timeout, write, on_released)
        client = self.client()
        lease = client.acquire(
            gpus,
            pool,
            d.ttl,
            wait,
            label[:200],
            session[:200],
            progress=on_queue,
            gpus_min=gpus_min,
            priority=priority,
        )
        held = HeldLease(client, lease)
        held.activity = {"executing": True, "source": "gpu_train"}
        self.held.add(held)
        t0 = time.monotonic()
        worker = None
        result: dict[str, Any] | None = None
        try:
            if on_granted:
                on_granted(held)
            worker = self.take_worker(lease.node)
            env = {
                "CUDA_VISIBLE_DEVICES": lease.cuda_visible_devices,
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
                result["value"], lease.id, lease.node, lease.indexes, time.monotonic() - t0, result.get("peak_memory")
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
                on_released(Outcome(None, lease.id, lease.node, lease.indexes, time.monotonic() - t0, peak))

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
            return Outcome(result["value"], "", "cpu", [], time.monotonic() - t0)
        finally:
            ray.kill(worker, no_restart=True)
            if on_released is not None:
                on_released(Outcome(None, "", "cpu", [], time.monotonic() - t0))

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
    **kwargs: Any,
) -> Any:
    """Call ``fn(*args, **kwargs)`` on a worker holding ``gpus`` leased GPUs and return its value.

    The worker sees only those GPUs (``CUDA_VISIBLE_DEVICES``); the lease is released when the
    call ends, however it ends. Raises :class:`GpuTrainError` with the remote traceback on failure.
    """
    s = session()
    lo, hi = parse_gpus(gpus) if gpus is not None else (None, None)
    outcome = s.run(
        {"kind": "function", "fn": fn, "args": args, "kwargs": kwargs},
        gpus=hi,
        gpus_min=lo,
        priority=priority,
        pool=pool,
        timeout=parse_duration(timeout),
        wait=parse_duration(wait),
        label=label or getattr(fn, "__name__", "call"),
    )
    return outcome.value
