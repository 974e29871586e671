"""IPython extension of gpulease: ``%load_ext magics``.

``%%gpu_train`` runs a cell on leased GPUs through Ray and brings its results back; ``%gpu_train
fn(...)`` does the same for one call; ``%%gpu_sweep`` runs a cell once per configuration, each
trial its own lease request; ``%gpu_lease`` shows and releases leases; ``%gpu_config`` sets
session defaults. :func:`run_on_gpus` and :func:`gpu_map` are the same things for scripts. Inside
a call, :func:`report` streams metrics, :func:`on_preempt` registers a checkpoint hook and
:func:`preempted` says the GPUs are recalled.
"""

from __future__ import annotations

from .fastimport import defer_slow_imports

defer_slow_imports()  # before anything imports ray (and with it jsonschema): see magics/fastimport.py

from typing import Any

from . import elastic
from .calls import Call
from .runner import (
    CellResult,
    GpuLeaseEnded,
    GpuTrainError,
    GpuTrainStopped,
    GpuTrainTimeout,
    Options,
    RecordingUI,
    parse_duration,
    run_call,
    run_cell,
    run_on_gpus,
    session,
)
from .space import grid, sample
from .sweep import SweepResults, Trial, gpu_map
from .worker import on_preempt, preempted, report

__all__ = [
    "Call",
    "CellResult",
    "GpuLeaseEnded",
    "GpuTrainError",
    "GpuTrainStopped",
    "GpuTrainTimeout",
    "Options",
    "RecordingUI",
    "run_call",
    "run_cell",
    "parse_duration",
    "run_on_gpus",
    "session",
    "gpu_map",
    "grid",
    "sample",
    "SweepResults",
    "Trial",
    "report",
    "on_preempt",
    "preempted",
    "elastic",
    "load_ipython_extension",
    "unload_ipython_extension",
]


def load_ipython_extension(ip: Any) -> None:
    from .magic import GpuMagics, close_live_cells

    ip.register_magics(GpuMagics(ip))
    _on_kernel_shutdown(ip, close_live_cells)
    _say_ends_once(ip)
    try:
        # Ray is joined here, in the kernel's main thread (Ray installs signal handlers there);
        # spare workers are then started in the background.
        session().connect_ray()
    except Exception:  # noqa: BLE001 - no server or Ray yet: the first %%gpu_train says what is wrong
        return
    GpuMagics.start_prewarm()


def _say_ends_once(ip: Any) -> None:
    """A cell ended by Stop, --timeout or someone else says so in its own line: IPython shows the
    exception that stops the cells after it no more (outcomes.said_once). Left as it is where
    another extension already handles exceptions its own way (one handler per shell)."""
    from .outcomes import EXPECTED_ENDS, said_once

    if not getattr(ip, "custom_exceptions", None):
        ip.set_custom_exc(EXPECTED_ENDS, said_once)


def _on_kernel_shutdown(ip: Any, hook: Any) -> None:
    """Run ``hook`` when the kernel is asked to shut down or restart, before it goes: the control
    thread handles that request while a cell may still be queued in the main thread, and only
    then can the cell's line still be updated."""
    kernel = getattr(ip, "kernel", None)
    if kernel is None or getattr(kernel, "_gpulease_hooked", False):
        return
    original = kernel.do_shutdown

    def do_shutdown(restart: bool) -> Any:
        try:
            hook()
        except Exception:  # noqa: BLE001 - never block a shutdown; the TTL is the backstop
            pass
        _flush_iopub(kernel)
        return original(restart)

    kernel.do_shutdown = do_shutdown
    kernel._gpulease_hooked = True


def _flush_iopub(kernel: Any, timeout: float = 10.0) -> None:
    """Wait (at most ``timeout``) until the kernel's IOPub thread has sent what is queued for it:
    the cells' last lines. ipykernel stops that thread at exit without draining its queue, and a
    loaded machine can leave a line written just before a shutdown unsent: the cell would go on
    saying it waits for a kernel that is gone."""
    import threading

    io_thread = getattr(getattr(kernel, "iopub_socket", None), "io_thread", None)
    if io_thread is None or not hasattr(io_thread, "schedule"):
        return
    sent = threading.Event()
    try:
        # The socket's own linger (1 s in ipykernel) is how long its close waits for what it has
        # taken but not yet written; a loaded machine can need longer.
        io_thread.socket.linger = int(timeout * 1000)
        io_thread.schedule(sent.set)  # runs after every send queued before it, in order
    except Exception:  # noqa: BLE001 - a closed thread: nothing left to wait for
        return
    sent.wait(timeout)


def unload_ipython_extension(ip: Any) -> None:
    session().release_all()
