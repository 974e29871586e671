"""A slice of one GPU from the notebook's side: what ``--gpu-mem`` asks for, the size ``--gpu-mem
auto`` picks from the last cell's measured peak, and how a slice's worker is held to its memory.

The lease server promises a slice its memory (docs/slices.md); this holds the worker to it without
changing any GPU setting:

* torch's caching allocator gets a per-process memory fraction of the slice's size over its GPU's
  memory (``torch.cuda.set_per_process_memory_fraction``), set the moment CUDA starts in the
  worker (torch imported later is armed on import), so torch itself stops at the limit with its
  own out-of-memory error;
* where an admin already runs the MPS control daemon on the node, ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``
  caps every CUDA allocation of the process (torch's or not). It is detected, never started.

The node agent enforces the rest (lease_server/node/memwatch.py): a slice over its memory is
warned and then ended, never a neighbour.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from lease_server.sizes import FIT_MARGIN, fitting_mb, show_mb

from .fastimport import when_imported

AUTO = "auto"
MPS_PIPE_DEFAULT = "/tmp/nvidia-mps"  # noqa: S108 - nvidia-cuda-mps-control's default pipe directory
MEM_ENV = "GPULEASE_GPU_MEM_MB"  # a slice's worker: MB of its GPU promised to it
TOTAL_ENV = "GPULEASE_GPU_TOTAL_MB"  # and its GPU's memory


def is_auto(gpu_mem: Any) -> bool:
    """Whether a cell asked ``--gpu-mem auto`` (sized from the notebook's last measured peak)."""
    return isinstance(gpu_mem, str) and gpu_mem.strip().lower() == AUTO


def fraction(slice_mb: int, total_mb: int) -> float | None:
    """The share of its GPU's memory a slice may use (torch's per-process memory fraction), in
    (0, 1]; None when the sizes cannot say (a whole GPU, or a GPU of unknown memory)."""
    if slice_mb <= 0 or total_mb <= 0:
        return None
    return min(1.0, slice_mb / total_mb)


def mps_running(environ: dict[str, str] | None = None) -> bool:
    """Whether an MPS control daemon runs for this process's clients: its control pipe exists in
    ``CUDA_MPS_PIPE_DIRECTORY`` (default /tmp/nvidia-mps)."""
    env = os.environ if environ is None else environ
    pipe_dir = env.get("CUDA_MPS_PIPE_DIRECTORY") or MPS_PIPE_DEFAULT
    return os.path.exists(os.path.join(pipe_dir, "control"))


def mps_limit(slice_mb: int, environ: dict[str, str] | None = None, devices: int = 1) -> dict[str, str]:
    """The environment that has MPS cap the slice's process at ``slice_mb`` on each of its visible
    GPUs (devices 0..devices-1 of the process), where an MPS daemon already runs; else nothing."""
    if slice_mb <= 0 or not mps_running(environ):
        return {}
    return {"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": ",".join(f"{d}={int(slice_mb)}M" for d in range(devices))}


def limit_torch(frac: float, devices: int = 1) -> str:
    """Hold torch in this process to ``frac`` of each of its GPUs (devices 0..devices-1: the
    slices' visible GPUs, one slice on each).

    Returns what was done: "set" (CUDA was up: set now), "armed" (set when CUDA starts, without
    starting it), "on import" (torch not imported yet: armed when it is), or "no CUDA" (torch
    sees no GPU here: nothing to hold)."""
    torch = sys.modules.get("torch")
    if torch is None:
        when_imported("torch", lambda module: _arm(module, frac, devices), key="slice-limit")
        return "on import"
    return _arm(torch, frac, devices)


def _arm(torch: Any, frac: float, devices: int = 1) -> str:
    cuda = getattr(torch, "cuda", None)
    if cuda is None or not cuda.is_available():
        return "no CUDA"

    def apply() -> None:
        for d in range(min(devices, cuda.device_count())):
            cuda.set_per_process_memory_fraction(frac, d)

    if cuda.is_initialized():
        apply()
        return "set"
    lazy = getattr(cuda, "_lazy_call", None)  # run as CUDA starts in this process (torch's own queue)
    if lazy is None:
        apply()
        return "set"
    lazy(apply)
    return "armed"


def hold_to(environ: dict[str, str]) -> dict[str, str]:
    """In a slice's worker, before the call runs: hold the process to its slice (``environ`` holds
    :data:`MEM_ENV` and :data:`TOTAL_ENV`). Returns what it did, for the worker's log:
    {"torch": ..., "mps": "0=10240M" or ""}; empty for a whole-GPU call."""
    slice_mb, total_mb = int(environ.get(MEM_ENV) or 0), int(environ.get(TOTAL_ENV) or 0)
    frac = fraction(slice_mb, total_mb)
    if frac is None:
        return {}
    # k slices: one on each GPU the worker sees
    devices = max(1, len([d for d in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]))
    mps = mps_limit(slice_mb, environ, devices)
    os.environ.update(mps)  # before CUDA starts in this process: its MPS client reads it then
    return {"torch": limit_torch(frac, devices), "mps": mps.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "")}


# ---- --gpu-mem auto ------------------------------------------------------------------------------


def auto_size(
    peak_mb: int | None, unit_mb: int, margin: float = FIT_MARGIN, gpu_mb: int | None = None
) -> tuple[int | None, str]:
    """What ``--gpu-mem auto`` asks for, and why in a few words: a whole GPU (None) while no cell
    of the notebook has a measured peak yet, else the last peak plus ``margin`` (at least one unit),
    rounded up to the pool's unit: (10240, "10 GB: last cell peaked at 7.9 GB + 20 %"); a whole GPU
    again where that is not less than a GPU's memory (``gpu_mb``)."""
    if not peak_mb or peak_mb <= 0:
        return None, "a whole GPU: no cell of this notebook has a measured peak yet"
    mb = fitting_mb(peak_mb, unit_mb, margin)
    if gpu_mb and mb >= gpu_mb:
        return None, f"a whole GPU: last cell peaked at {show_mb(peak_mb)}, + {margin * 100:.0f} % is a GPU's all"
    return mb, f"{show_mb(mb)}: last cell peaked at {show_mb(peak_mb)} + {margin * 100:.0f} %"
