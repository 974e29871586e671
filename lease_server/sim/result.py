"""What one policy did with one workload: when each cell got its GPUs, and which GPU-time was allocated."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Result:
    """The outcome of replaying a workload under one policy (times in ms from the workload's start).

    ``ready[c]`` is when cell ``c`` asked for GPUs (closed loop: it moves when earlier cells of its
    session waited), ``start[c]`` when it got them. Allocations are the GPU-time the policy gave
    away, used or not: one interval per lease (per cell), per calendar booking, or per culled hold.
    ``order`` lists the cells in the order their GPUs were granted.
    """

    policy: str
    gpus: int
    ready: np.ndarray
    start: np.ndarray
    alloc_start: np.ndarray
    alloc_end: np.ndarray
    alloc_gpus: np.ndarray
    alloc_user: np.ndarray
    order: np.ndarray
    wall_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def wait_ms(self) -> np.ndarray:
        return self.start - self.ready


def intervals(starts: list[int], ends: list[int], gpus: list[int], users: list[int]) -> dict[str, Any]:
    """The allocation arrays of a :class:`Result`, from lists."""
    return {
        "alloc_start": np.asarray(starts, dtype=np.int64),
        "alloc_end": np.asarray(ends, dtype=np.int64),
        "alloc_gpus": np.asarray(gpus, dtype=np.int64),
        "alloc_user": np.asarray(users, dtype=np.int64),
    }
