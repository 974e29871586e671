"""Figures of a simulation: one row per policy, per-user shares, as a table, CSV files and a PNG."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from rich import box
from rich.table import Table

from .result import Result
from .workload import HOUR, Workload
from .workload import MIN as MIN_MS

ROWS = (  # the figures the table shows, one line each (policies are its columns: it fits 80 columns)
    ("gpus", "GPUs"),
    ("gpu_hours_allocated", "GPU-h held"),
    ("gpu_hours_used", "GPU-h used"),
    ("utilization", "utilization"),
    ("busy_util", "GPU busy (NVML)"),
    ("occupancy", "of the cluster"),
    ("peak_gpus", "peak GPUs held"),
    ("wait_p50_s", "wait p50"),
    ("wait_p95_s", "wait p95"),
    ("wait_p99_s", "wait p99"),
    ("cells_waited_1m", "waited > 1 min"),
    ("slowdown_p95", "slowdown p95"),
    ("culls_felt", "culled kernels"),
    ("saved_gpu_hours", "GPU-h saved"),
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


SAVED_WINDOW_H = 17.5  # the NotebookOS paper's "GPU hours saved in 17.5 hours"


def peak_held(r: Result) -> int:
    """The most GPUs the policy held at once."""
    if not r.alloc_start.size:
        return 0
    t = np.concatenate([r.alloc_start, r.alloc_end])
    d = np.concatenate([r.alloc_gpus, -r.alloc_gpus])
    order = np.lexsort((d, t))  # at one instant, releases before grants
    return int(np.max(np.cumsum(d[order])))


def held_before(r: Result, end_ms: float) -> float:
    """GPU-hours held in ``[0, end_ms)``."""
    lo = np.minimum(r.alloc_start, end_ms)
    hi = np.minimum(r.alloc_end, end_ms)
    return float(np.sum((hi - lo).astype(np.float64) * r.alloc_gpus)) / HOUR


def figures(w: Workload, r: Result) -> dict[str, Any]:
    """The row of one policy: GPU-hours allocated and used, utilization (used / allocated), the share
    of the cluster held, the most GPUs held at once, time-to-GPU per cell, cells that waited more
    than a minute; culls (only the culler policies cull). With per-cell utilization (a session
    trace) also ``busy_util``: the GPUs' own mean utilization over all the GPU-time held."""
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
        "wait_max_s": float(wait_s.max()) if wait_s.size else float("nan"),
        "cells_waited_1m": int(np.sum(wait_s > 60)),
        "cells": int(wait_s.size),
        "peak_gpus": peak_held(r),
        "culls": 0,
        "culls_felt": 0,
        "gpu_hours_window": held_before(r, SAVED_WINDOW_H * HOUR),
        "busy_util": (
            float(np.sum(w.util * w.dur * w.cell_gpus) / 100 / alloc) if w.util is not None and alloc else float("nan")
        ),
        "top_user_share": max(shares.values()) if shares else float("nan"),
        "span_h": (t1 - t0) / HOUR,
        "wall_s": r.wall_s,
        **{k: v for k, v in r.extra.items() if isinstance(v, (int, float))},
    }


def add_savings(rows: Sequence[dict[str, Any]]) -> None:
    """``saved_gpu_hours``: GPU-hours held in the first ``SAVED_WINDOW_H`` hours by the ``session``
    policy (notebooks that hold their GPUs all their life) minus by this policy; NaN without it."""
    base = next((r["gpu_hours_window"] for r in rows if r["policy"] == "session"), float("nan"))
    for row in rows:
        row["saved_gpu_hours"] = base - row["gpu_hours_window"]


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


def _cell(key: str, row: dict[str, Any]) -> str:
    v = row.get(key, float("nan"))
    if isinstance(v, float) and v != v:
        return "-"
    if key.startswith("wait_"):
        return _fmt_s(v)
    if key in ("utilization", "occupancy", "top_user_share", "busy_util"):
        return f"{v:.1%}"
    if key.startswith("gpu_hours") or key == "saved_gpu_hours":
        return f"{v:,.0f}"
    if key == "cells_waited_1m":
        return f"{v:,} ({v / max(1, row['cells']):.0%})"
    if key == "wall_s":
        return f"{v:.1f}"
    if key.startswith("slowdown"):
        return f"{v:.2f}x"
    return f"{v:,}" if isinstance(v, int) else str(v)


def table(rows: Sequence[dict[str, Any]], title: str = "") -> Table:
    """One column per policy, one line per figure (lines that say nothing for any policy left out:
    NVML utilization without a session trace, culls and savings without those policies)."""
    t = Table(title=title or None, box=box.SIMPLE_HEAD, pad_edge=False)
    t.add_column("")
    for row in rows:
        t.add_column(row["policy"], justify="right", no_wrap=True)
    for key, head in ROWS:
        cells = [_cell(key, row) for row in rows]
        if key in ("busy_util", "saved_gpu_hours", "slowdown_p95") and all(c == "-" for c in cells):
            continue
        if key == "culls_felt" and not any(row["policy"].startswith("culler") for row in rows):
            continue
        t.add_row(head, *cells)
    return t


def slowdown_line(row: dict[str, Any]) -> str:
    """What sharing GPUs cost ``lease-share``'s cells in run time (co-tenants over 100 % busy)."""
    return (
        f"{row['policy']} on {row['gpus']} GPUs: slowdown from sharing p50 {row['slowdown_p50']:.2f}x, "
        f"p95 {row['slowdown_p95']:.2f}x, worst {row['slowdown_max']:.2f}x; {row['slowed_cells']:,} of "
        f"{row['cells']:,} cells stretched, {row['sliced_cells']:,} on slices, {row['whole_cells']:,} on whole GPUs"
    )


def min_table(found: Sequence[Any], title: str = "") -> Table:
    """One row per policy: the smallest cluster found, and the policy's figures on it."""
    t = Table(title=title or None, box=box.SIMPLE_HEAD, pad_edge=False)
    for head in ("policy", "nodes", "GPUs", "util", "peak", "p50", "p95", "p99", "worst", "probes"):
        t.add_column(head, justify="left" if head == "policy" else "right", no_wrap=head == "policy")
    for m in found:
        r = m.row
        t.add_row(
            m.policy,
            str(m.nodes),
            str(m.gpus),
            f"{r['utilization']:.0%}",
            str(r["peak_gpus"]),
            *(_fmt_s(r[k]) for k in ("wait_p50_s", "wait_p95_s", "wait_p99_s", "wait_max_s")),
            str(m.probes),
        )
    return t


def user_table(w: Workload, results: Sequence[Result], top: int = 8) -> Table:
    """The heaviest users: their share of the GPU-time used, and of the GPU-time each policy gave them."""
    demand = demand_shares(w)
    heavy = sorted(demand, key=lambda u: -demand[u])[:top]
    shares = [user_shares(w, r) for r in results]
    title = f"per-user share of GPU-time (top {len(heavy)} of {len(w.users)} users)"
    t = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False)
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
    """Utilization (used / allocated GPU-time) over time per policy, the CDF of time-to-GPU, and the
    GPUs each policy held over time against the GPUs its cells used."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError("the figure needs matplotlib: pip install 'gpulease[sim]' (or pass --no-plot)") from exc
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(19, 4.5))
    t_end = max(float(max(np.max(r.alloc_end), np.max(r.start + w.dur))) for r in results)
    span_days = t_end / (24 * HOUR)
    if span_days < 4:  # a short workload: finer bins, and hours on the axis
        bin_h = min(bin_h, 1.0)
    edges = np.arange(0.0, t_end + bin_h * HOUR, bin_h * HOUR)
    unit, per = ("hour", HOUR) if span_days < 4 else ("day", 24 * HOUR)
    mid = (edges[:-1] + edges[1:]) / 2 / per
    fine = np.arange(0.0, t_end + 10 * MIN_MS, 10 * MIN_MS)  # held vs used: 10-minute means
    fine_mid = (fine[:-1] + fine[1:]) / 2 / per
    for i, r in enumerate(results):
        alloc = busy_per_bin(r.alloc_start, r.alloc_end, r.alloc_gpus, edges)
        used = busy_per_bin(r.start, r.start + w.dur, w.cell_gpus, edges)
        with np.errstate(invalid="ignore", divide="ignore"):
            util = np.where(alloc > 0, used / alloc, np.nan)
        (line,) = ax1.plot(mid, util * 100, label=r.policy, lw=1.2)
        wait = np.sort(r.wait_ms.astype(np.float64) / 1000)
        frac = np.arange(1, wait.size + 1) / max(1, wait.size)
        ax2.step(np.maximum(wait, 0.1), frac, where="post", label=r.policy)
        held = busy_per_bin(r.alloc_start, r.alloc_end, r.alloc_gpus, fine) / (10 * MIN_MS)
        ax3.plot(fine_mid, held, lw=1.0, color=line.get_color(), label=f"{r.policy} held")
        if i == 0:
            busy = busy_per_bin(r.start, r.start + w.dur, w.cell_gpus, fine) / (10 * MIN_MS)
            ax3.fill_between(fine_mid, busy, color="0.8", label="used by cells", step="mid")
    ax1.set_xlabel(unit)
    ax1.set_ylabel(f"utilization, % of allocated GPU-time used ({bin_h:g} h bins)")
    ax1.set_ylim(0, 105)
    ax1.legend(fontsize=8)
    ax2.set_xscale("log")
    ax2.set_xlabel("time to GPU per cell, s (0 plotted at 0.1 s)")
    ax2.set_ylabel("fraction of cells")
    ax2.set_ylim(0, 1.01)
    ax2.grid(True, which="both", alpha=0.3)
    ax2.legend(fontsize=8)
    ax3.set_xlabel(unit)
    ax3.set_ylabel("GPUs (10-minute means)")
    ax3.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
