"""IPython extension of gpulease: ``%load_ext magics``.

``%%gpu_train`` runs a cell on leased GPUs through Ray and brings its results back; ``%gpu_train
fn(...)`` does the same for one call; ``%gpu_lease`` shows and releases leases; ``%gpu_config``
sets session defaults. :func:`run_on_gpus` is the same thing for scripts. Inside a call,
:func:`on_preempt` registers a checkpoint hook and :func:`preempted` says the GPUs are recalled.
"""

from __future__ import annotations

from typing import Any

from .runner import GpuTrainError, GpuTrainTimeout, parse_duration, run_on_gpus, session
from .worker import on_preempt, preempted

__all__ = [
    "GpuTrainError",
    "GpuTrainTimeout",
    "parse_duration",
    "run_on_gpus",
    "session",
    "on_preempt",
    "preempted",
    "load_ipython_extension",
    "unload_ipython_extension",
]


def load_ipython_extension(ip: Any) -> None:
    from .magic import GpuMagics, show_gpu_train_error

    ip.register_magics(GpuMagics(ip))
    ip.set_custom_exc((GpuTrainError,), show_gpu_train_error)
    try:
        # Ray is joined here, in the kernel's main thread (Ray installs signal handlers there);
        # spare workers are then started in the background.
        session().connect_ray()
    except Exception:  # noqa: BLE001 - no server or Ray yet: the first %%gpu_train says what is wrong
        return
    GpuMagics.start_prewarm()


def unload_ipython_extension(ip: Any) -> None:
    session().release_all()
