"""What runs inside the Ray worker process: one training call, then the process is thrown away.

A :class:`GpuWorker` actor is started ahead of time (imports done, no CUDA context), used for
exactly one call with ``CUDA_VISIBLE_DEVICES`` set to the leased indexes, and then killed by the
caller, so every byte of GPU memory the function took is freed with its process. The exceptions
stay on the same GPUs for the same user, readied by :meth:`GpuWorker.recycle`: a warm cell's worker
(its namespace kept for the notebook's next cell, :mod:`magics.warm`), a sweep's next trial granted
in the same step as the last one's lease ended (``lua/handoff.lua``), and an elastic job's ranks on
the GPUs a resize keeps. While the call
runs, the actor captures stdout/stderr for the notebook to stream, and a watchdog thread follows
the lease on the lease server's event stream: once the lease is released, expired or revoked, the
process exits, so a revoked lease or an orphaned call (its kernel died) stops using the GPU.
"""

from __future__ import annotations

import contextlib
import functools
import json
import linecache
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from lease_server import errors, procs, protocol

from . import fastimport, hostcopy, slices
from .calls import (
    CHECKPOINT_STREAM,
    ELASTIC_STREAM,
    METRICS_STREAM,
    RESIZED,
    Call,
    CellValue,
    Result,
    Where,
    _tls,
    event_client,
    this_machine,
)

WATCHDOG_EXIT_CODE = 75
WATCHDOG_DELAY_S = 0.5  # the watchdog starts following the lease this long into a call
DRIVER_GRACE_S = 2.0  # after the lease ended: the driver's own kill comes first
KILL_AFTER_S = 2.0  # a worker asked to exit that is still there after this gets SIGKILL
NVML_GONE_TIMEOUT_S = 2.0  # how long the driver may take to drop a dead process from a GPU

# Preemption, in the worker process: set when the lease server recalls this call's GPUs
# (preempted, or lent from a booking whose holder now wants them); the hooks run then.
# _NOTICE (what ``preempted()`` reads) is set only after the notice is written and the hooks
# have run: a loop that stops on ``preempted()`` must not return before its checkpoint exists.
_NOTICE = threading.Event()
_RECALL_SEEN = threading.Event()  # the recall was seen once; its thread is _RECALL[0]
_RECALL: list[threading.Thread] = []
_HOOKS: list[Callable[[], Any]] = []
CHECKPOINT_WAIT_S = 60.0  # how long a returning call waits for a checkpoint hook still running


def on_preempt(hook: Callable[[], Any]) -> Callable[[], Any]:
    """Register ``hook() -> state``, called once if this call's GPUs are recalled, during the
    notice period before they are taken. Its return value comes back to the notebook as
    ``gpu_checkpoint``, and ``%%gpu_train --resume`` hands it to the next run as
    ``resume_state``. Usable as a decorator. Runs in another thread than the training loop:
    return a copy of what you need (e.g. ``{k: v.cpu() for k, v in model.state_dict().items()}``)."""
    _HOOKS.append(hook)
    return hook


def preempted() -> bool:
    """True once this call's GPUs are recalled: a training loop may check it and stop early."""
    return _NOTICE.is_set()


# The worker running this process's call (one call per process): where report() sends to.
_ACTIVE: list[GpuWorker] = []
_STEPS: list[int] = []  # how many reports this call made: the step of a report that names none


def report(step: int | None = None, **metrics: Any) -> None:
    """Stream ``metrics`` (numbers, by name) of ``step`` from a call on leased GPUs to the notebook:
    a sweep's table shows each trial's last ones, its record keeps the history, and ``--stop
    median`` compares trials by them. ``step`` defaults to the number of reports before this one.
    A 0-d tensor or a numpy scalar is read with ``.item()``. Outside such a call it does nothing,
    so the same training function also runs on the CPU kernel."""
    if not _ACTIVE:
        return
    if step is None:
        step = len(_STEPS)
    _STEPS.append(step)
    record = {"step": step, "metrics": {str(k): _scalar(v) for k, v in metrics.items()}}
    _ACTIVE[0].push(METRICS_STREAM, json.dumps(record))


# Elastic training: set when the driver resizes the job; every rank then stops at the same step.
_RESIZE = threading.Event()


class Resize(BaseException):  # noqa: N818 - not an error: the runner's signal, like KeyboardInterrupt
    """Raised by :func:`elastic_step` in every rank once the runner resizes the job, after rank 0's
    checkpoint hooks ran. A BaseException, so that ``except Exception`` in a training loop lets it
    through; the worker turns it into a normal return, and the runner restarts the ranks on the new
    size with the checkpoint as ``resume_state``."""


def elastic_step(samples: int = 1) -> None:
    """One training step of an elastic job is done (``samples``: what this rank processed in it).
    Rank 0's steps tell the runner the job's throughput; when the runner resizes the job, every
    rank stops here at the same step (agreed with an all-reduce when ``torch.distributed`` is
    initialized), rank 0's :func:`on_preempt` hooks take the checkpoint, and :class:`Resize` unwinds
    the loop. Outside an elastic call it does nothing."""
    if not _ACTIVE or os.environ.get("GPULEASE_ELASTIC") != "1":
        return
    _hold_group()
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        _ACTIVE[0].push(ELASTIC_STREAM, json.dumps({"samples": samples, "t": time.time()}))
    stop = _RESIZE.is_set()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        stop = _agree(stop)
    if not stop:
        return
    if rank == 0:
        _checkpoint(_ACTIVE[0])
    raise Resize


# The loop's default process group, held until its call has returned (see _hold_group).
_GROUPS: list[Any] = []


def _hold_group() -> None:
    """Keep the loop's default process group referenced from here until the call has returned.

    A loop that ends with ``dist.destroy_process_group()`` while its DDP model is still alive
    leaves the model's C++ Reducer as the group's last owner: the Reducer is then freed as the
    function returns, with the GIL held, and ``~ProcessGroupGloo`` joins gloo's worker threads
    under it. A worker thread that is just letting go of the last collective (whose tensor's
    Python object it now owns) waits for the GIL: both wait forever. Dropped from here instead
    (``_release_groups``), the group is freed by torch's Python handle, which lets go of the GIL
    first."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return
    pg = dist.group.WORLD
    if pg is not None and not any(g is pg for g in _GROUPS):
        _GROUPS.append(pg)


def _release_groups() -> None:
    _GROUPS.clear()  # the last reference to a destroyed group: torch frees it without the GIL


def _guard_destroy(dist: Any) -> None:
    """Make ``dist.destroy_process_group`` hold the group it destroys until the call has returned
    (see :func:`_hold_group`), so that any loop, elastic or not (a multi-node gang's), is safe
    from the same deadlock. Idempotent."""
    original = dist.destroy_process_group
    if getattr(original, "_gpulease_holds", False):
        return

    @functools.wraps(original)
    def destroy_process_group(group: Any = None, *args: Any, **kwargs: Any) -> Any:
        pg = group if group is not None else dist.group.WORLD
        if pg is not None and not any(g is pg for g in _GROUPS):
            _GROUPS.append(pg)
        return original(group, *args, **kwargs)

    destroy_process_group._gpulease_holds = True  # type: ignore[attr-defined]
    dist.destroy_process_group = destroy_process_group


def guard_process_groups() -> None:
    """Guards ``torch.distributed`` (:func:`_guard_destroy`) now if it is imported already, else the
    moment it is, before any ``from torch.distributed import destroy_process_group`` can bind the
    original. A worker process installs it at its start; importing torch is the call's own business."""
    fastimport.when_imported("torch.distributed", _guard_destroy, key="process-group-guard")


def _agree(flag: bool) -> bool:
    """Any rank's flag, on every rank: a MAX all-reduce of one number, when the loop runs under
    ``torch.distributed`` (else this rank's own flag: a loop without collectives has no lockstep)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return flag
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    t = torch.tensor([1 if flag else 0])
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _checkpoint(worker: GpuWorker) -> None:
    import base64

    from ray import cloudpickle

    for hook in list(_HOOKS):
        try:
            state = hook()
            worker.push(CHECKPOINT_STREAM, base64.b64encode(cloudpickle.dumps(state)).decode())
        except Exception as exc:  # noqa: BLE001 - the resize goes on from the last checkpoint
            worker.push("stderr", f"gpu_train: the checkpoint hook failed: {type(exc).__name__}: {exc}\n")


def _scalar(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    item = getattr(value, "item", None)
    if callable(item):
        try:
            return item()
        except Exception:  # noqa: BLE001 - not a one-element array: shown as text below
            pass
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)


class _Capture:
    """A file-like sink for sys.stdout / sys.stderr that the driver drains with read_output."""

    def __init__(self, worker: GpuWorker, stream: str) -> None:
        self.worker, self.stream = worker, stream

    def write(self, text: str) -> int:
        if text:
            with self.worker._cond:
                self.worker._chunks.append((self.stream, text))
                self.worker._cond.notify_all()
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:  # tqdm then draws its bar with carriage returns, as in a terminal
        return False

    @property
    def encoding(self) -> str:
        return "utf-8"


class GpuWorker:
    """Plain class; magics.runner turns it into a threaded Ray actor (max_concurrency > 1)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._chunks: list[tuple[str, str]] = []
        self._done = False
        self._done_event = threading.Event()
        self._used = False
        self._gen = 0  # which call this is: a watchdog of an earlier call stops following its lease
        self._ns: dict[str, Any] | None = None  # a warm cell's namespace, kept for the notebook's next cell
        # Imports done while the spare waits, not on the call's clock (pynvml: ~15 ms).
        import httpx  # noqa: F401

        _tls()  # the watchdog's TLS context, made while the spare waits

        _nvml_here()  # pynvml imported and NVML probed now, not on the call's clock
        import lease_server.node.claims  # noqa: F401 - the claim of each call's lease, loaded now

        guard_process_groups()  # a DDP loop that destroys its process group cannot hang its return
        self._boot_modules = {name.partition(".")[0] for name in sys.modules}  # (what calls import is the rest)

    def ready(self) -> Where:
        """Where this process lives (the driver watches its pid to know when it is gone)."""
        import ray

        start = procs.start_ticks("self") or 0  # 0: /proc cannot say
        return Where(os.getpid(), this_machine(), ray.get_runtime_context().get_node_id(), start)

    def reap(self, pid: int, uuids: list[str], indexes: list[int], start: int = 0) -> dict[str, Any]:
        """Run by a spare worker on the node of a finished call: wait until the call's process
        ``pid`` (started at ``start``) has exited (SIGKILL after a grace) and, where NVML sees the
        GPUs, until no process of it remains on them. See :func:`verify_gone`."""
        return verify_gone(pid, uuids, indexes, start)

    def endpoint(self) -> dict[str, Any]:
        """The IP of this process's Ray node and a TCP port free on it now: a multi-node gang's
        rank 0 answers this, and every rank gets it as ``MASTER_ADDR`` / ``MASTER_PORT``."""
        import socket

        import ray

        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = int(s.getsockname()[1])
        return {"ip": ray.util.get_node_ip_address(), "port": port, "pid": os.getpid()}

    def push(self, stream: str, text: str) -> None:
        with self._cond:
            self._chunks.append((stream, text))
            self._cond.notify_all()

    def recycle(self, warm: bool = False) -> bool:
        """Ready this process for one more call of the same user on the same GPUs (a sweep's next
        trial, handed the GPUs in the same step as this call's lease ended): forget this call's
        output, hooks and watchdog, free what Python and torch's caching allocator still hold, and
        reset torch's peak-memory counters so the next call's peak is its own. ``warm``: the
        notebook's next cell runs here with what this one left, so nothing is freed (a full
        garbage collection of a process holding torch alone takes tens of milliseconds, which
        every warm cell's closing would pay). False while a call still runs (then the caller
        ends the process as usual)."""
        with self._cond:
            if not self._done:
                return False
            self._used = self._done = False
            self._chunks = []
            self._gen += 1
        self._done_event = threading.Event()
        _ACTIVE.clear()
        _STEPS.clear()
        _HOOKS.clear()
        _RECALL.clear()
        _RECALL_SEEN.clear()
        _NOTICE.clear()
        _RESIZE.clear()
        import gc

        if not warm:
            gc.collect()
        torch = sys.modules.get("torch")
        with contextlib.suppress(Exception):  # an elastic rank's next phase sets up its own group
            if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
        with contextlib.suppress(Exception):
            if torch is not None and torch.cuda.is_initialized():
                if not warm:
                    torch.cuda.empty_cache()
                for i in range(torch.cuda.device_count()):
                    torch.cuda.reset_peak_memory_stats(i)
        return True

    def preload(self, names: list[str]) -> list[str]:
        """Import what this notebook's earlier GPU cells imported (torch, say), while this spare
        waits: a cold cell on it then pays only for its own work. Returns what imported."""
        import importlib

        done = []
        for name in names:
            try:
                importlib.import_module(name)
                done.append(name)
            except Exception:  # noqa: BLE001 - the cell imports it itself, and says why if it fails
                pass
        return done

    def imported(self) -> list[str]:
        """The installed packages (top-level names) imported since this process started."""
        out = []
        for name in {n.partition(".")[0] for n in list(sys.modules)} - self._boot_modules:
            path = getattr(sys.modules.get(name), "__file__", None) or ""
            installed = "site-packages" in path or "dist-packages" in path
            if installed and name.isidentifier() and not name.startswith("_"):
                out.append(name)
        return sorted(out)

    def ask_resize(self) -> None:
        """The runner resizes the job: stop at the next :func:`elastic_step`."""
        _RESIZE.set()

    def read_output(self, wait_s: float = 0.5) -> tuple[list[tuple[str, str]], bool]:
        """Output written since the last call, waiting up to ``wait_s`` for some (a long poll)."""
        with self._cond:
            if not self._chunks and not self._done:
                self._cond.wait(wait_s)
            chunks, self._chunks = self._chunks, []
            return chunks, self._done

    def run(self, call: Call, env: dict[str, str], watch: dict[str, Any]) -> Result:
        """Run one call with ``env`` set. ``watch`` ({url, token, id}) names the lease whose end
        stops this process. Never raises: failures come back as a Result."""
        if self._used:
            return Result(False, error_type="RuntimeError", message="internal: a single-use worker ran twice")
        self._used = True
        _ACTIVE[:] = [self]
        os.environ.update(env)
        try:
            # before the cell's code: a forced end of the lease then ends this process; a worker
            # suspended on eviction is restored onto the lease's GPU first (lease_server/node/onhost.py)
            restored = _claim(watch, env)
        except (NotRestored, Unclaimed) as exc:
            return Result(False, error_type=type(exc).__name__, message=str(exc), pid=os.getpid())
        slices.hold_to(env)  # a slice: torch (and MPS, where it runs) held to its memory before CUDA starts
        _STEPS.clear()
        if watch.get("url"):
            threading.Thread(
                target=_watchdog, args=(watch, self, self._gen), name="gpulease-watchdog", daemon=True
            ).start()
        old = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _Capture(self, "stdout"), _Capture(self, "stderr")  # type: ignore[assignment]
        t0 = time.monotonic()
        try:
            if call.keep_ns and self._ns is None:
                self._ns = _namespace()
            value = hostcopy.pack(_execute(call, self._ns if call.keep_ns else None))
            return Result(
                True,
                value,
                seconds=time.monotonic() - t0,
                peak_memory=_peak_memory(),
                pid=os.getpid(),
                imported=self.imported(),
                restored=restored,
            )
        except Resize:
            return Result(True, RESIZED, seconds=time.monotonic() - t0, peak_memory=_peak_memory(), pid=os.getpid())
        except BaseException as exc:  # noqa: BLE001 - everything goes back to the notebook
            return Result(
                False,
                error_type=type(exc).__name__,
                message=str(exc),
                traceback=_user_traceback(exc),
                seconds=time.monotonic() - t0,
                peak_memory=_peak_memory(),
                pid=os.getpid(),
            )
        finally:
            for t in _RECALL:  # a checkpoint being taken goes back with this call's output
                t.join(CHECKPOINT_WAIT_S)
            _release_groups()  # the call's frames are gone: no Reducer owns its group any more
            sys.stdout.flush()
            sys.stdout, sys.stderr = old
            with self._cond:
                self._done = True
                self._cond.notify_all()
            self._done_event.set()


CELL_FILENAME = "<gpu_train cell>"


def _user_traceback(exc: BaseException) -> str:
    """The traceback from the user's code down, without this module's own frames."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _namespace() -> dict[str, Any]:
    return {"__name__": "__main__", "__builtins__": __builtins__}


def _execute(call: Call, ns: dict[str, Any] | None = None) -> Any:
    """Run the call; a cell in ``ns`` (a warm worker's namespace, kept) or a fresh one."""
    if call.kind == "function":
        assert call.fn is not None
        return call.fn(*call.args, **call.kwargs)
    source = call.source
    # Register the source so that tracebacks show the cell's lines.
    linecache.cache[CELL_FILENAME] = (len(source), None, source.splitlines(True), CELL_FILENAME)
    if ns is None:
        ns = _namespace()
    ns.update(call.inputs)
    exec(compile(call.body, CELL_FILENAME, "exec"), ns)  # noqa: S102 - the user's own cell
    result = eval(compile(call.last_expr, CELL_FILENAME, "eval"), ns) if call.last_expr else None  # noqa: S307
    missing = [n for n in call.outputs if n not in ns]
    if call.explicit_outputs and missing:
        raise NameError(f"--out names {', '.join(missing)}, which the cell never set")
    return CellValue({n: ns[n] for n in call.outputs if n in ns}, result)


_NVML: list[bool] = []  # [whether NVML works here], found once per process while the spare waits


def _nvml_here() -> bool:
    if not _NVML:
        try:
            import pynvml

            pynvml.nvmlInit()
            pynvml.nvmlShutdown()
            _NVML.append(True)
        except Exception:  # noqa: BLE001 - no driver: no GPU readings in this process
            _NVML.append(False)
    return _NVML[0]


def _peak_memory() -> int | None:
    """Peak GPU memory of this process in bytes, where NVML can tell (None without a GPU).

    NVML reads what the process holds now, at the end of the call; torch's caching allocator
    tells how much more it held at its peak (given back since, e.g. by ``torch.cuda.empty_cache``)."""
    if not _nvml_here():
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")]
        total = 0
        for d in visible:
            if d.startswith("MIG-"):  # a MIG instance: its own handle lists its processes
                handle = pynvml.nvmlDeviceGetHandleByUUID(d)
            elif d.isdigit():
                handle = pynvml.nvmlDeviceGetHandleByIndex(int(d))
            else:
                continue
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid == os.getpid() and proc.usedGpuMemory:
                    total += int(proc.usedGpuMemory)
        return total + _torch_given_back() if total else total
    except Exception:
        return None
    finally:
        pynvml.nvmlShutdown()


def _torch_given_back() -> int:
    """Bytes torch's caching allocator held at its peak beyond what it holds now, over this
    process's visible GPUs: 0 unless the call used torch on CUDA and then returned memory to the
    driver. On an H100, a call that took 4 GiB, freed it with ``empty_cache`` and kept 1 GiB showed
    NVML 1.6 GiB at its end (context included) against torch's 4 GiB peak reserved."""
    torch = sys.modules.get("torch")
    try:
        if torch is None or not torch.cuda.is_initialized():
            return 0
        return sum(
            max(0, int(torch.cuda.max_memory_reserved(i)) - int(torch.cuda.memory_reserved(i)))
            for i in range(torch.cuda.device_count())
        )
    except Exception:  # noqa: BLE001 - no reading: NVML's alone stands
        return 0


def _recalled(worker: GpuWorker, rec: dict[str, Any]) -> None:
    """The lease server recalls this call's GPUs: tell the notebook, run the checkpoint hooks,
    then let ``preempted()`` say so."""
    try:
        _notify_and_checkpoint(worker, rec)
    finally:
        _NOTICE.set()


def _notify_and_checkpoint(worker: GpuWorker, rec: dict[str, Any]) -> None:
    from .outcomes import fit80

    left = max(0.0, rec["recall_at"] - time.time())
    # the server's reason ends with its own "save your work: the GPUs go back in N s", said here
    # as the time left from now, on a line of its own
    why = str(rec.get("recall_reason") or "").split("; save your work", 1)[0]
    why = why if why.startswith("recalled") else f"recalled ({why})" if why else "recalled"
    then = "running the checkpoint hook" if _HOOKS else "magics.on_preempt(fn) would have checkpointed"
    worker.push("stderr", fit80(f"gpu_train: these GPUs are {why}") + f"\n  {left:.0f}s left: {then}\n")
    _checkpoint(worker)


_CLAIMED: set[tuple[str, str]] = set()  # (lease, node) this process claimed: a warm cell's next call skips it


class Unclaimed(Exception):
    """The node agent did not tie this worker to its lease, where running untied is not safe."""


class NotRestored(Exception):
    """This worker was suspended and its node agent did not restore it (the message says why)."""


def _claim(watch: dict[str, Any], env: dict[str, str]) -> dict[str, Any] | None:
    """Tie this process to the call's lease at its node agent (lease_server/node/claims.py): the
    kernel names this process to the agent, so only it, never a pid anyone sends, is ended if the
    server ends the lease. Without an agent to answer (a lease server without one on this host),
    the worker's watchdog is what stops it. ``watch["restore"]``: this worker was suspended on
    eviction; the agent restores it onto the lease's GPU with the claim. Returns what the restore
    measured ({bytes, ms}); raises NotRestored if it was refused."""
    node, lease_id = env.get("GPULEASE_NODE", ""), str(watch.get("id") or "")
    # the lease's indexes on this node (CUDA_VISIBLE_DEVICES names a MIG instance by its UUID)
    indexes = env.get("GPULEASE_GPU_INDEXES") or env.get("CUDA_VISIBLE_DEVICES", "")
    gpus = [int(i) for i in indexes.split(",") if i.strip().isdigit()]
    restore = bool(watch.get("restore"))
    if not (watch.get("instance") and node and lease_id and gpus) or (lease_id, node) in _CLAIMED:
        if restore:
            raise NotRestored(f"no node agent of {node or 'this node'} to restore it")
        return None
    from lease_server.node import claims

    try:
        answer = claims.claim(
            watch["instance"], node, lease_id, int(watch["fence"]), watch["token"], watch.get("user") or "", gpus,
            restore=restore,
        )  # fmt: skip
        _CLAIMED.add((lease_id, node))
        return answer.get("restored")
    except (claims.ClaimRefused, OSError) as exc:
        if restore:
            raise NotRestored(str(exc)) from None
        # Refused (another account's process holds the claim socket, or the agent will not tie
        # this process to the lease), or a slice whose agent does not answer: nothing would end
        # this worker with its lease, or hold it to its memory. The cell does not run.
        if isinstance(exc, claims.ClaimRefused):
            raise Unclaimed(
                f"not run: the node agent of {node} did not tie this worker to lease {lease_id} ({exc}); "
                f"check that the agent of {node} runs (as root) and that the kernel runs as the lease's owner"
            ) from None
        if int(env.get(slices.MEM_ENV) or 0):
            raise Unclaimed(
                f"not run: a slice is held to its memory by the node agent of {node}, which did not answer "
                f"({exc}); check that it runs"
            ) from None
        if sys.__stderr__ is not None:
            sys.__stderr__.write(
                f"gpulease: lease {lease_id}: the node agent of {node} did not tie this worker to it: {exc}\n"
            )
        return None


def _watchdog(watch: dict[str, Any], worker: GpuWorker | None = None, gen: int = 0) -> None:
    """Exit this process as soon as its lease has ended (released from elsewhere, expired or
    revoked): follow the lease's own events (``GET /api/v1/events?lease=ID``, filtered on the
    server), and check the lease itself whenever the stream (re)connects so that nothing between
    is missed. Our own driver kills this worker before it releases the lease, so a release seen
    here always came from somewhere else (the GPU board, another terminal). Once the worker is
    recycled for a next call (``gen`` is behind), this lease is no longer the process's: it stops."""
    import httpx

    def moved_on() -> bool:
        return worker is not None and worker._gen != gen

    url, lease_id = watch["url"], watch["id"]
    # A backstop (the driver follows the lease too): a call that ends within this never pays for it.
    if worker is not None and worker._done_event.wait(WATCHDOG_DELAY_S):
        return
    from lease_server.client import ServerGuard, up_socket

    headers = protocol.bearer(watch["token"])
    if watch.get("user"):
        headers[protocol.USER_HEADER] = watch["user"]
    uds = up_socket(url, watch["token"])
    http = event_client(url, headers, ServerGuard(url, watch["token"], allowed=watch.get("server_uids"), uds=uds))

    def ended() -> str | None:
        try:
            r = http.get(protocol.lease(lease_id))
        except (httpx.TransportError, errors.GpuLeaseError):  # (refused unsent: ServerGuard)
            return None
        if r.status_code == 404:
            return "gone"
        rec = r.json()
        if rec.get("recall_at") and worker is not None and not _RECALL_SEEN.is_set():
            _RECALL_SEEN.set()
            t = threading.Thread(target=_recalled, args=(worker, rec), name="gpulease-checkpoint", daemon=True)
            _RECALL.append(t)
            t.start()
        state = rec.get("state")
        return state if state in protocol.ENDED_STATES else None

    def check() -> None:
        if moved_on():
            raise _MovedOn
        why = ended()
        if moved_on():  # handed to the next call while we asked
            raise _MovedOn
        if why is not None:
            # The driver follows the lease too and ends this worker through Ray at once (quietly);
            # exiting here is the backstop for a driver that cannot (its kernel hangs or is gone).
            time.sleep(DRIVER_GRACE_S)
            if moved_on():
                raise _MovedOn
            _die(lease_id, why)

    try:
        while True:
            try:
                with http.stream("GET", protocol.EVENTS, params={"lease": lease_id}) as s:
                    check()
                    for line in s.iter_lines():
                        if line.startswith("data:"):
                            check()
            except (httpx.HTTPError, errors.GpuLeaseError):  # away, or another user's listener there
                pass
            check()
            time.sleep(1.0)  # lease server unreachable: the TTL still bounds how long we may run
    except _MovedOn:
        http.close()


class _MovedOn(Exception):
    """The worker was recycled for its next call: this watchdog's lease is not the process's now."""


def _die(lease_id: str, why: str) -> None:
    if sys.__stderr__ is not None:
        sys.__stderr__.write(f"gpulease: lease {lease_id} is {why}; stopping this worker\n")
    os._exit(WATCHDOG_EXIT_CODE)


# ---- verified release: is the call's process gone, and off its GPUs? ------------------------------


def wait_exit(pid: int, timeout: float = KILL_AFTER_S * 3, kill_after: float = KILL_AFTER_S, start: int = 0) -> bool:
    """Block until process ``pid`` (not our child) has exited; SIGKILL it after ``kill_after``.
    True once it is gone (:func:`lease_server.procs.end`: through a pidfd, readable the moment the
    process exits). ``start``: its start time (``Where.start``, 0: unknown); a process under that
    pid that started at another time is another process, which took the pid of one that is gone:
    never signalled."""
    return procs.end(pid, kill_after, timeout, start=start or None, first=None)


def gpu_pids(uuids: list[str], indexes: list[int]) -> set[int] | None:
    """The pids NVML sees on these GPUs (by UUID where NVML knows it, else by index); None where
    NVML cannot tell (no driver, or simulated GPUs)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no NVML here
        return None
    try:
        pids: set[int] = set()
        for i, idx in enumerate(indexes):
            uuid = uuids[i] if i < len(uuids) else ""
            try:
                handle = pynvml.nvmlDeviceGetHandleByUUID(uuid) if uuid and not uuid.startswith("GPU-sim") else None
            except pynvml.NVMLError:
                handle = None
            if handle is None:
                if uuid.startswith("GPU-sim"):
                    return None
                handle = pynvml.nvmlDeviceGetHandleByIndex(int(idx))
            for get in (pynvml.nvmlDeviceGetComputeRunningProcesses, pynvml.nvmlDeviceGetGraphicsRunningProcesses):
                pids.update(int(p.pid) for p in get(handle))
        return pids
    except Exception:  # noqa: BLE001 - a reading we cannot trust is no reading
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


def verify_gone(pid: int, uuids: list[str], indexes: list[int], start: int = 0) -> dict[str, Any]:
    """Wait until ``pid`` (started at ``start``, where known) has exited and, where NVML sees the
    GPUs, is on none of them.

    Returns {"gone": bool, "nvml": bool (NVML checked the GPUs), "ms": time taken}."""
    t0 = time.monotonic()
    gone = wait_exit(pid, start=start)
    nvml = False
    if gone and indexes:
        deadline = time.monotonic() + NVML_GONE_TIMEOUT_S
        while True:
            seen = gpu_pids(uuids, indexes)
            if seen is None:
                break
            nvml = True
            if pid not in seen:
                break
            if time.monotonic() > deadline:
                gone = False
                break
            time.sleep(0.005)
    return {"gone": gone, "nvml": nvml, "ms": (time.monotonic() - t0) * 1000}
