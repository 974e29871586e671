"""What a call asks for: one call's :class:`Options` (what ``%%gpu_train``, ``%%gpu_sweep``,
``run_on_gpus`` and ``gpu_map`` ask of :func:`magics.runner.run_call`) and the kernel's
:class:`Defaults` they fall back on (``%gpu_config``). Plain data, below every module that reads it."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

WARM_OFF = ("0", "off", "false", "no")
SPARES_DEFAULT = 2  # one for the next call, one for the call after it while the first is replaced
SPARES_MAX = 8


def _spares_from_env() -> int:
    """GPULEASE_SPARES in a kernelspec's env: how many started workers a kernel keeps ready per node
    (0 to 8; default 2). Each is a process of a GB or so: an admin of a small machine lowers it."""
    raw = os.environ.get("GPULEASE_SPARES", "").strip()
    if not raw:
        return SPARES_DEFAULT
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if not 0 <= value <= SPARES_MAX:
        raise ValueError(f"GPULEASE_SPARES={raw!r}: give a whole number from 0 to {SPARES_MAX} (default 2)")
    return value


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
    # %%gpu_train cells keep their worker warm for the next cell (%gpu_config --warm off; an admin
    # may turn it off for a kernelspec with GPULEASE_WARM=off in its env)
    warm: bool = field(default_factory=lambda: os.environ.get("GPULEASE_WARM", "on").lower() not in WARM_OFF)
    # started workers kept ready per node, so a cold cell pays no process start (%gpu_config --spares;
    # GPULEASE_SPARES in a kernelspec's env)
    spares: int = field(default_factory=_spares_from_env)


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
    cell: str = ""  # the cell's number in its notebook (the magic sends it), else a hash of its source
    all_ranks: bool = False  # a gang's value: every rank's (else rank 0's)
    outputs: list[str] | None = None  # a cell's names to bring back (None: all it assigns)
    resume: bool = False  # a cell reads gpu_checkpoint as resume_state
    elastic: bool = False  # grow and shrink between gpus_min and gpus while it runs (magics.elastic)
    min_efficiency: float = 0.5  # an elastic call grows again only while growth pays this much
    sizes: tuple[int, ...] | None = None  # the sizes an elastic call may take (None: every one)
    # A one-node cell's worker stays warm on its lease for the notebook's next cell (magics.warm);
    # fresh: this cell starts on a new worker (and, with warm, leaves that one warm).
    warm: bool = False
    fresh: bool = False
    # The value goes back the moment the function returns; the verified release (workers ended,
    # seen gone, then the lease released) runs in the background, and the GPUs are granted again
    # only after it. run_on_gpus does; a cell's line waits for it.
    background_release: bool = False
    # A slice of one GPU (docs/slices.md): "10GB", "10240MB", an int of MB, a fraction of one GPU
    # (0.25), or "auto" (magics.slices.auto_size: a whole GPU first, then the last cell's peak and a
    # margin). gpu_mem_why: the reason auto gave for the size it picked (said in the cell's line).
    gpu_mem: str | int | float | None = None
    gpu_mem_why: str = ""

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
