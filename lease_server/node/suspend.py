"""Suspend to host: an evicted warm worker's GPU state goes to host memory, the process lives on.

The node agent is the one long-lived process per node that does it (as in production systems that
checkpoint GPU processes: one privileged helper initialises CUDA once, then suspends and restores
other processes by pid; a ``cuda-checkpoint`` process per call would pay ~2.7 s of ``cuInit``
each time). The lease server only orders it: ``lua/suspend.lua`` ends the warm lease and puts its
GPU in draining as a *suspend*; the agent's drain pass (``drain.py``) suspends the one process that
claimed the lease (never a pid a user sends), sees the GPU clean of it, and reports it: the waiter
is granted then. The worker's next cell claims a new lease at the agent and asks to be restored
(``claims.py``, ``restore``): only a process that is itself suspended here may ask, for itself.

Two implementations of :class:`Suspender`:

* :class:`Simulated`: simulated GPUs have no GPU state; the process and its namespace simply live
  on without a lease. Its "snapshot" is measured as the process's resident memory, the same
  stand-in the slices use on simulated GPUs (``memwatch.resident_mb``), so the host-memory budget
  is exercised on a machine without GPUs.
* :class:`CudaCheckpoint`: the CUDA driver's checkpoint API (``cuCheckpointProcessLock /
  Checkpoint / Restore / Unlock / GetState``, driver >= 570) through ctypes on ``libcuda``. It
  never changes a GPU setting (persistence mode, MIG, compute mode). A restore is attempted only
  when the target GPU's free memory is at least the snapshot plus 10 % (:func:`fits`): a restore
  that runs out of GPU memory leaves the process unrecoverable (NVIDIA/cuda-checkpoint#44).

Scope: one-GPU, one-process workers without NCCL (the lease server refuses the rest; they are
ended as before). Children of the worker are not suspended (only the locked pid is frozen).
"""

from __future__ import annotations

import ctypes
import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

from ..sizes import show_mb

log = logging.getLogger(__name__)

RESTORE_HEADROOM = 1.10  # the target GPU's free memory must be the snapshot's size plus 10 %
LOCK_TIMEOUT_MS = 5000  # a worker whose CUDA calls do not settle within this is ended instead


class SuspendFailed(Exception):
    """The suspender could not suspend (or restore) the process; the message says why."""


@dataclass(frozen=True)
class Snapshot:
    """What one suspend moved to host memory, and how long it took."""

    bytes: int
    ms: float


def fits(size_bytes: int, free_bytes: int | None) -> bool:
    """Whether a snapshot of ``size_bytes`` may be restored onto a GPU with ``free_bytes`` free:
    never try and see (a failed restore loses the process). Unknown free memory: no."""
    return free_bytes is not None and free_bytes >= size_bytes * RESTORE_HEADROOM


def show_bytes(n: int) -> str:
    """A size as a person reads it in a cell's line: "3.2 GB", "512 MB" (as ``sizes.show_mb``)."""
    return show_mb(n / 2**20)


class Suspender(Protocol):
    """Suspends a process's GPU state to host memory and restores it, by pid (the agent's own claims only)."""

    kind: str  # "simulated" | "cuda": what the node's inventory says (``suspend``)

    def suspend(self, pid: int, size_bytes: int) -> Snapshot:
        """Take the process off the GPU (``size_bytes``: its GPU memory as the agent measured it)."""
        ...

    def restore(self, pid: int, pairs: list[tuple[str, str]]) -> float:
        """Put it back, each (old GPU UUID, new GPU UUID) remapped; the milliseconds it took."""
        ...


class Simulated:
    """Simulated GPUs: nothing of the process is on a GPU; suspend and restore only time themselves."""

    kind = "simulated"

    def suspend(self, pid: int, size_bytes: int) -> Snapshot:
        return Snapshot(size_bytes, 0.0)

    def restore(self, pid: int, pairs: list[tuple[str, str]]) -> float:
        return 0.0


# ---- the CUDA driver's checkpoint API ---------------------------------------------------------------

CUDA_SUCCESS = 0
# CUprocessState
PROCESS_STATES = {0: "running", 1: "locked", 2: "checkpointed", 3: "failed"}


class _LockArgs(ctypes.Structure):
    _fields_ = [("timeoutMs", ctypes.c_uint), ("reserved0", ctypes.c_uint), ("reserved1", ctypes.c_uint64 * 7)]


class _Reserved8(ctypes.Structure):  # CUcheckpointCheckpointArgs, CUcheckpointUnlockArgs
    _fields_ = [("reserved", ctypes.c_uint64 * 8)]


class _Uuid(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_ubyte * 16)]


class _GpuPair(ctypes.Structure):
    _fields_ = [("oldUuid", _Uuid), ("newUuid", _Uuid)]


class _RestoreArgs(ctypes.Structure):
    _fields_ = [
        ("gpuPairs", ctypes.POINTER(_GpuPair)),
        ("gpuPairsCount", ctypes.c_uint),
        ("reserved", ctypes.c_char * (52 - ctypes.sizeof(ctypes.c_void_p))),
        ("reserved1", ctypes.c_uint64),
    ]


def uuid_bytes(uuid: str) -> bytes:
    """NVML's "GPU-xxxxxxxx-xxxx-..." (or the bare hex) as the 16 bytes of a CUuuid."""
    text = uuid.removeprefix("GPU-").replace("-", "")
    raw = bytes.fromhex(text)
    if len(raw) != 16:
        raise ValueError(f"not a GPU UUID: {uuid!r}")
    return raw


def restore_args(pairs: list[tuple[str, str]]) -> tuple[_RestoreArgs, Any]:
    """The restore's arguments remapping each (old, new) GPU UUID; the pair array is returned too
    (it must outlive the call)."""
    arr = (_GpuPair * max(1, len(pairs)))()
    for i, (old, new) in enumerate(pairs):
        arr[i].oldUuid.bytes[:] = list(uuid_bytes(old))
        arr[i].newUuid.bytes[:] = list(uuid_bytes(new))
    args = _RestoreArgs()
    if pairs and any(o != n for o, n in pairs):
        args.gpuPairs = ctypes.cast(arr, ctypes.POINTER(_GpuPair))
        args.gpuPairsCount = len(pairs)
    return args, arr


class CudaCheckpoint:
    """The driver's checkpoint API through ctypes on libcuda, initialised once (``cuInit``)."""

    kind = "cuda"

    def __init__(self, lib: Any) -> None:
        self.lib = lib

    @classmethod
    def probe(cls, libname: str = "libcuda.so.1") -> CudaCheckpoint | str:
        """The suspender, or why this node has none (no driver, a driver without the API, cuInit refused)."""
        try:
            lib = ctypes.CDLL(libname)
        except OSError as exc:
            return f"no CUDA driver ({exc})"
        for name in ("cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint", "cuCheckpointProcessRestore",
                     "cuCheckpointProcessUnlock", "cuCheckpointProcessGetState"):  # fmt: skip
            if not hasattr(lib, name):
                return f"the CUDA driver has no {name} (driver 570 or later has it)"
        rc = lib.cuInit(0)
        if rc != CUDA_SUCCESS:
            return f"cuInit failed (CUresult {rc})"
        return cls(lib)

    def _call(self, name: str, pid: int, args: Any) -> None:
        rc = getattr(self.lib, name)(ctypes.c_int(pid), ctypes.byref(args) if args is not None else None)
        if rc != CUDA_SUCCESS:
            raise SuspendFailed(f"{name}({pid}) answered CUresult {rc}")

    def state(self, pid: int) -> str:
        out = ctypes.c_int(-1)
        rc = self.lib.cuCheckpointProcessGetState(ctypes.c_int(pid), ctypes.byref(out))
        if rc != CUDA_SUCCESS:
            raise SuspendFailed(f"cuCheckpointProcessGetState({pid}) answered CUresult {rc}")
        return PROCESS_STATES.get(out.value, f"unknown ({out.value})")

    def suspend(self, pid: int, size_bytes: int) -> Snapshot:
        t0 = time.monotonic()
        lock = _LockArgs()
        lock.timeoutMs = LOCK_TIMEOUT_MS
        self._call("cuCheckpointProcessLock", pid, lock)
        try:
            self._call("cuCheckpointProcessCheckpoint", pid, _Reserved8())
        except SuspendFailed:
            # still locked, its GPU state in place: unlock it so the drain can end it cleanly
            try:
                self._call("cuCheckpointProcessUnlock", pid, _Reserved8())
            except SuspendFailed as exc:
                log.warning("pid %s stays locked after a failed checkpoint: %s", pid, exc)
            raise
        return Snapshot(size_bytes, (time.monotonic() - t0) * 1000)

    def restore(self, pid: int, pairs: list[tuple[str, str]]) -> float:
        t0 = time.monotonic()
        args, _keep = restore_args(pairs)
        self._call("cuCheckpointProcessRestore", pid, args)
        self._call("cuCheckpointProcessUnlock", pid, _Reserved8())
        return (time.monotonic() - t0) * 1000


def detect(mode: str, nvml_node: bool) -> Suspender | str:
    """This node's suspender (``mode`` the ``suspend`` setting), or why it has none."""
    if mode == "off":
        return "off (suspend = off)"
    if not nvml_node:
        return Simulated()
    return CudaCheckpoint.probe()
