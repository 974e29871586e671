"""``gpulease simulate --trace FILE --gpus N``: load, group into sessions, replay, print and write."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from . import report, workload
from .replay import cluster
from .run import private_redis, simulate


def load_workload(trace: str, params: workload.SessionParams, max_cell_hours: float | None = None) -> workload.Workload:
    """A session trace as it is; cells of a CSV trace or an events export grouped into sessions."""
    if workload.is_session_trace(trace):
        if max_cell_hours is not None:
            raise ValueError("--max-cell-hours applies to traces of cells; a session trace is replayed whole")
        return workload.load_sessions(trace)
    cells = workload.load(trace)
    if max_cell_hours is not None:
        cells = [c for c in cells if c.dur <= max_cell_hours * workload.HOUR]
        if not cells:
            raise ValueError(f"no cell of {trace} is shorter than {max_cell_hours:g} h")
    return workload.sessionize(cells, params, name=Path(trace).name)


def run(
    trace: str,
    gpus: int,
    policies: list[str],
    *,
    node_gpus: int = 8,
    params: workload.SessionParams | None = None,
    max_cell_hours: float | None = None,
    out: str | None = "simulation",
    plot: bool = True,
    redis_url: str | None = None,
    console: Console | None = None,
    share_multi: str = "whole",
) -> list[dict[str, Any]]:
    """The whole command; returns the rows it printed."""
    console = console or Console()
    params = params or workload.SessionParams()
    w = load_workload(trace, params, max_cell_hours)
    console.print(describe(w) + f"; cluster {gpus} GPUs as nodes of {node_gpus}")
    nodes = cluster(gpus, node_gpus)
    span = max(1, w.span_ms())
    with Progress(
        TextColumn("{task.description:<11}"),
        BarColumn(),
        TextColumn("{task.fields[at]}"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as bar:
        tasks = {p: bar.add_task(p, total=span, at="") for p in policies}

        def tick(policy: str, t: int) -> None:
            if t < 0:
                bar.update(tasks[policy], completed=span, at="done")
            else:
                bar.update(tasks[policy], completed=min(t, span), at=f"day {t / 86_400_000:.1f}")

        results = simulate(w, nodes, policies, redis_url=redis_url, tick=tick, share_multi=share_multi)
    rows = [report.figures(w, r) for r in results]
    report.add_savings(rows)
    console.print(report.table(rows, title=f"{w.name} on {gpus} GPUs"))
    for row in rows:
        if "slowdown_p95" in row:
            console.print(report.slowdown_line(row))
    if "session" in policies:
        console.print(
            f"saved: GPU-hours the session policy holds in the first {report.SAVED_WINDOW_H:g} h "
            "minus what each policy holds then"
        )
    console.print(report.user_table(w, results))
    if out:
        base = Path(out)
        report.write_csv(base.with_name(base.name + ".csv"), rows)
        report.write_user_csv(base.with_name(base.name + "-users.csv"), w, results)
        written = [base.name + ".csv", base.name + "-users.csv"]
        if plot:
            png = base.with_name(base.name + ".png")
            report.plot(png, w, results, title=f"{w.name} on {gpus} GPUs ({node_gpus} per node)")
            written.append(png.name)
        console.print(f"wrote {', '.join(str(base.parent / n) for n in written)}")
    return rows


def describe(w: workload.Workload) -> str:
    s = w.summary()
    kind = "real sessions" if w.real_sessions else "sessions"
    dropped = f" ({w.dropped} without GPU cells left out)" if w.dropped else ""
    return (
        f"[bold]{w.name}[/]: {s['cells']:,} GPU cells in {s['sessions']:,} {kind}{dropped} of {s['users']} users "
        f"over {s['span_h']:.0f} h, {s['gpu_hours_used']:,.0f} GPU-hours used"
    )


@dataclasses.dataclass
class MinCluster:
    """The smallest cluster (in whole nodes) on which a policy keeps p95 time-to-GPU within a target."""

    policy: str
    nodes: int
    gpus: int
    row: dict[str, Any]  # the policy's figures on that cluster
    probes: int


def find_min_nodes(
    w: workload.Workload,
    policy: str,
    *,
    node_gpus: int = 8,
    wait_s: float = 60.0,
    quantile: int = 95,
    redis_url: str | None = None,
    on_probe: Callable[[str, int, dict[str, Any]], None] | None = None,
    share_multi: str = "whole",
) -> MinCluster:
    """Search the fewest nodes of ``node_gpus`` on which ``policy`` keeps time-to-GPU per cell at
    its ``quantile`` (95 or 99; 100: the longest wait) at most ``wait_s``; each probe is a full
    replay. Doubling from the fewest nodes that can hold the biggest request, then bisection. One
    node per session is always enough (no session ever shares a node), so the search ends there at
    the latest. Assumes more nodes never make the percentile worse."""
    lo = max(1, -(-int(w.session_request().max()) // node_gpus))
    hi_cap = max(lo, w.n_sessions)
    probes = 0
    seen: dict[int, dict[str, Any]] = {}

    def ok(n: int) -> bool:
        nonlocal probes
        if n not in seen:
            (r,) = simulate(
                w, cluster(n * node_gpus, node_gpus), [policy], redis_url=redis_url, share_multi=share_multi
            )
            seen[n] = report.figures(w, r)
            probes += 1
            if on_probe:
                on_probe(policy, n, seen[n])
        return bool(seen[n][key] <= wait_s)

    key = "wait_max_s" if quantile == 100 else f"wait_p{quantile}_s"

    n = lo
    while not ok(n):
        if n >= hi_cap:
            raise RuntimeError(f"{policy}: p{quantile} time-to-GPU stays over {wait_s:g} s with a node per session")
        lo, n = n + 1, min(hi_cap, 2 * n)
    hi = n  # passes; everything below lo failed
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return MinCluster(policy, hi, hi * node_gpus, seen[hi], probes)


def find_min(
    trace: str,
    policies: list[str],
    *,
    node_gpus: int = 8,
    wait_s: float = 60.0,
    quantile: int = 95,
    params: workload.SessionParams | None = None,
    max_cell_hours: float | None = None,
    redis_url: str | None = None,
    console: Console | None = None,
    like_lease_on: int | None = None,
    share_multi: str = "whole",
) -> list[MinCluster]:
    """``gpulease simulate --find-min-gpus``: the search for each policy, and its table. With
    ``like_lease_on`` the bound is not ``wait_s`` but what whole-GPU ``lease`` gives at the same
    percentile on that many GPUs."""
    console = console or Console()
    w = load_workload(trace, params or workload.SessionParams(), max_cell_hours)
    found = []
    with contextlib.ExitStack() as stack:
        url = redis_url or stack.enter_context(private_redis())
        if like_lease_on is not None:
            base = baseline(w, like_lease_on, node_gpus=node_gpus, redis_url=url)
            wait_s = base[f"wait_p{quantile}_s"]
            console.print(f"lease (whole GPUs) on {like_lease_on} GPUs: p{quantile} time-to-GPU {wait_s:g} s")
        want = f"p{quantile} time-to-GPU <= {wait_s:g} s"
        console.print(describe(w) + f"; searching in nodes of {node_gpus} for {want}")
        for p in policies:
            with console.status(f"{p}: replaying") as st:

                def probe(policy: str, n: int, row: dict[str, Any], _st: Any = st) -> None:
                    v = row[f"wait_p{quantile}_s"]
                    _st.update(f"{policy}: {n} nodes, p{quantile} {v:.0f} s ({'ok' if v <= wait_s else 'too slow'})")

                found.append(
                    find_min_nodes(
                        w,
                        p,
                        node_gpus=node_gpus,
                        wait_s=wait_s,
                        quantile=quantile,
                        redis_url=url,
                        on_probe=probe,
                        share_multi=share_multi,
                    )
                )
    console.print(report.min_table(found, title=f"smallest cluster with {want}"))
    for m in found:
        if "slowdown_p95" in m.row:
            console.print(report.slowdown_line(m.row))
    return found


def baseline(w: workload.Workload, gpus: int, *, node_gpus: int = 8, redis_url: str | None = None) -> dict[str, Any]:
    """Whole-GPU ``lease`` on ``gpus`` GPUs: the figures a sharing policy is held to."""
    (r,) = simulate(w, cluster(gpus, node_gpus), ["lease"], redis_url=redis_url)
    return report.figures(w, r)


def session_params(**kw: Any) -> workload.SessionParams:
    return dataclasses.replace(workload.SessionParams(), **{k: v for k, v in kw.items() if v is not None})
