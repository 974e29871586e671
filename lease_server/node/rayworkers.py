"""How gpulease's Ray workers start: the PYTHONPATH they get, and how a kernel knows that a Ray
node gives it to them already.

A worker's PYTHONPATH leads with ``magics/_boot``, whose sitecustomize defers at the worker's start
what ``import ray`` need not pay (``magics/fastimport.py``), then the kernel's own. A kernel can
hand it to each worker in a Ray runtime environment, but then Ray starts every worker through its
``setup_worker.py``, which imports all of Ray once more before it runs the worker: a worker's start
cost 3.3 CPU-seconds instead of 0.8 (measured on 2 cores, Ray 2.60). So ``gpulease up`` starts its
Ray head with that PYTHONPATH already in the raylet's environment, and marks the node with
:func:`boot_resource`; a kernel whose workers would get the same PYTHONPATH starts them there
without a runtime environment (``magics.session``), and any other node gets one as before.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

BOOT_DIR = str(Path(__file__).resolve().parents[2] / "magics" / "_boot")
BOOT_PREFIX = "gpulease_boot_"


def worker_pythonpath(base: str | None = None) -> str:
    """The PYTHONPATH of a kernel's Ray workers: ``magics/_boot`` first, then ``base`` (default: this
    process's PYTHONPATH)."""
    rest = os.environ.get("PYTHONPATH", "") if base is None else base
    return os.pathsep.join(p for p in (BOOT_DIR, rest) if p)


def with_worker_pythonpath(env: dict[str, str] | None) -> dict[str, str]:
    """A copy of ``env`` (default: this process's environment) whose PYTHONPATH is the workers':
    for the Ray head's processes and anything else that imports Ray the way a worker does."""
    out = dict(os.environ if env is None else env)
    out["PYTHONPATH"] = worker_pythonpath(out.get("PYTHONPATH", ""))
    return out


def boot_resource(pythonpath: str) -> str:
    """The Ray resource of a node whose raylet starts workers with ``pythonpath`` already: a
    kernel that would give its workers the same needs no runtime environment there."""
    return BOOT_PREFIX + hashlib.sha256(pythonpath.encode()).hexdigest()[:16]
