"""Figures of a simulation: one row per policy, per-user shares, as a table, CSV files and a PNG."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from rich.table import Table

from .result import Result
from .workload import HOUR, Workload

COLUMNS = (
    ("policy", "policy"),
    ("gpus", "GPUs"),
    ("gpu_hours_allocated", "GPU-h held"),
    ("gpu_hours_used", "GPU-h used"),
    ("utilization", "util"),
    ("occupancy", "of cluster"),
    ("wait_p50_s", "wait p50"),
    ("wait_p95_s", "p95"),
    ("wait_p99_s", "p99"),
    ("cells_waited_1m", "waited >1 min"),
    ("top_user_share", "top user"),
    ("wall_s", "wall s"),
)


def pct(values: np.ndarray, q: float) -> float:
    """Nearest-rank percentile (q in 0..100), as the benches compute it."""
    if values.size == 0:
        return float("nan")
    xs = np.sort(values)
    k = max(0, min(xs.size - 1, int(np.ceil(q / 100 * xs.size)) - 1))
    return float(xs[k])


def figures(w: Workload, r: Result) -> dict[str, Any]:
    """The row of one policy: GPU-hours allocated and used, utilization (used / allocated), the share
    of the cluster held, time-to-GPU per cell, cells that waited more than a minute."""
    alloc = float(np.sum((r.alloc_end - r.alloc_start).astype(np.float64) * r.alloc_gpus))
    used = w.used_gpu_ms()
    wait_s = r.wait_ms.astype(np.float64) / 1000
    t0 = float(np.min(r.ready)) if r.ready.size else 0.0
    t1 = float(max(np.max(r.alloc_end), np.max(r.start + w.dur))) if r.ready.size else 0.0
    shares = user_shares(w, r)
    return {
        "policy": r.policy,
        "gpus": r.gpus,
        "gpu_hours_allocated": alloc / HOUR,
        "gpu_hours_used": used / HOUR,
        "utilization": used / alloc if alloc else float("nan"),
        "occupancy": alloc / (r.gpus * (t1 - t0)) if t1 > t0 else float("nan"),
        "wait_p50_s": pct(wait_s, 50),
        "wait_p95_s": pct(wait_s, 95),
        "wait_p99_s": pct(wait_s, 99),
        "cells_waited_1m": int(np.sum(wait_s > 60)),
        "cells": int(wait_s.size),
        "top_user_share": max(shares.values()) if shares else float("nan"),
        "span_h": (t1 - t0) / HOUR,
        "wall_s": r.wall_s,
        **{k: v for k, v in r.extra.items() if isinstance(v, (int, float))},
    }


def user_shares(w: Workload, r: Result) -> dict[str, float]:
    """Each user's share of the GPU-time the policy allocated."""
    gpu_ms = (r.alloc_end - r.alloc_start).astype(np.float64) * r.alloc_gpus
    per = np.bincount(r.alloc_user, weights=gpu_ms, minlength=len(w.users))
    total = per.sum()
    return {u: float(per[i] / total) if total else 0.0 for i, u in enumerate(w.users)}


def demand_shares(w: Workload) -> dict[str, float]:
    """Each user's share of the GPU-time their cells actually used."""
    per = np.bincount(w.cell_user, weights=w.dur.astype(np.float64) * w.cell_gpus, minlength=len(w.users))
    total = per.sum()
    return {u: float(per[i] / total) if total else 0.0 for i, u in enumerate(w.users)}


def _fmt_s(seconds: float) -> str:
    if seconds != seconds:
        return "-"
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def table(rows: Sequence[dict[str, Any]], title: str = "") -> Table:
    t = Table(title=title or None)
    for key, head in COLUMNS:
        t.add_column(head, justify="left" if key == "policy" else "right")
    for row in rows:
        cells = []
        for key, _ in COLUMNS:
            v = row[key]
            if key.startswith("wait_"):
                cells.append(_fmt_s(v))
            elif key in ("utilization", "occupancy", "top_user_share"):
                cells.append(f"{v:.1%}")
            elif key.startswith("gpu_hours"):
                cells.append(f"{v:,.0f}")
            elif key == "cells_waited_1m":
                cells.append(f"{v:,} ({v / max(1, row['cells']):.1%})")
            elif key == "wall_s":
                cells.append(f"{v:.1f}")
            else:
                cells.append(str(v))
        t.add_row(*cells)
    return t


def user_table(w: Workload, results: Sequence[Result], top: int = 8) -> Table:
    """The heaviest users: their share of the GPU-time used, and of the GPU-time each policy gave them."""
    demand = demand_shares(w)
    heavy = sorted(demand, key=lambda u: -demand[u])[:top]
    shares = [user_shares(w, r) for r in results]
    t = Table(title=f"per-user share of GPU-time (top {len(heavy)} of {len(w.users)} users)")
    t.add_column("user")
    t.add_column("used", justify="right")
    for r in results:
        t.add_column(r.policy, justify="right")
    for u in heavy:
        t.add_row(u, f"{demand[u]:.1%}", *[f"{s[u]:.1%}" for s in shares])
    return t


def write_csv(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    keys: list[str] = []
    for row in rows:
        keys += [k for k in row if k not in keys]
    with open(path, "w", newline="") as f:
        out = csv.DictWriter(f, fieldnames=keys)
        out.writeheader()
        for row in rows:
            out.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})


def write_user_csv(path: Path, w: Workload, results: Sequence[Result]) -> None:
    demand = demand_shares(w)
    shares = [user_shares(w, r) for r in results]
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["user", "used_share", *[f"{r.policy}_share" for r in results]])
        for u in w.users:
            out.writerow([u, f"{demand[u]:.6g}", *[f"{s[u]:.6g}" for s in shares]])


def busy_per_bin(starts: np.ndarray, ends: np.ndarray, weights: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """GPU-ms inside each bin [edges[i], edges[i+1]) of intervals [start, end) holding ``weights`` GPUs."""

    def integral(x: np.ndarray, points: np.ndarray, order: np.ndarray) -> np.ndarray:
        p, wt = points[order], weights[order].astype(np.float64)
        cw = np.concatenate(([0.0], np.cumsum(wt)))
        cpw = np.concatenate(([0.0], np.cumsum(wt * p)))
        k = np.searchsorted(p, x, side="right")
        return x * cw[k] - cpw[k]

    x = edges.astype(np.float64)
    f = integral(x, starts.astype(np.float64), np.argsort(starts)) - integral(
        x, ends.astype(np.float64), np.argsort(ends)
    )
    return np.diff(f)


def plot(path: Path, w: Workload, results: Sequence[Result], title: str = "", bin_h: float = 6.0) -> None:
    """Utilization (used / allocated GPU-time) over time per policy, and the CDF of time-to-GPU."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError("the figure needs matplotlib: pip install 'gpulease[sim]' (or pass --no-plot)") from exc
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    t_end = max(float(max(np.max(r.alloc_end), np.max(r.start + w.dur))) for r in results)
    edges = np.arange(0.0, t_end + bin_h * HOUR, bin_h * HOUR)
    mid_days = (edges[:-1] + edges[1:]) / 2 / (24 * HOUR)
    for r in results:
        alloc = busy_per_bin(r.alloc_start, r.alloc_end, r.alloc_gpus, edges)
        used = busy_per_bin(r.start, r.start + w.dur, w.cell_gpus, edges)
        with np.errstate(invalid="ignore", divide="ignore"):
            util = np.where(alloc > 0, used / alloc, np.nan)
        ax1.plot(mid_days, util * 100, label=r.policy, lw=1.2)
        wait = np.sort(r.wait_ms.astype(np.float64) / 1000)
        frac = np.arange(1, wait.size + 1) / max(1, wait.size)
        ax2.step(np.maximum(wait, 0.1), frac, where="post", label=r.policy)
    ax1.set_xlabel("day")
    ax1.set_ylabel(f"utilization, % of allocated GPU-time used ({bin_h:g} h bins)")
    ax1.set_ylim(0, 105)
    ax1.legend(fontsize=8)
    ax2.set_xscale("log")
    ax2.set_xlabel("time to GPU per cell, s (0 plotted at 0.1 s)")
    ax2.set_ylabel("fraction of cells")
    ax2.set_ylim(0, 1.01)
    ax2.grid(True, which="both", alpha=0.3)
    ax2.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
