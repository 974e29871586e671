"""``gpulease simulate --trace FILE --gpus N``: load, group into sessions, replay, print and write."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from . import report, workload
from .replay import cluster
from .run import simulate


def load_workload(trace: str, params: workload.SessionParams, max_cell_hours: float | None = None) -> workload.Workload:
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
) -> list[dict[str, Any]]:
    """The whole command; returns the rows it printed."""
    console = console or Console()
    params = params or workload.SessionParams()
    w = load_workload(trace, params, max_cell_hours)
    s = w.summary()
    console.print(
        f"[bold]{w.name}[/]: {s['cells']:,} cells in {s['sessions']:,} sessions of {s['users']} users "
        f"over {s['span_h']:.0f} h, {s['gpu_hours_used']:,.0f} GPU-hours used; "
        f"cluster {gpus} GPUs as nodes of {node_gpus}"
    )
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

        results = simulate(w, nodes, policies, redis_url=redis_url, tick=tick)
    rows = [report.figures(w, r) for r in results]
    console.print(report.table(rows, title=f"{w.name} on {gpus} GPUs"))
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


def session_params(**kw: Any) -> workload.SessionParams:
    return dataclasses.replace(workload.SessionParams(), **{k: v for k, v in kw.items() if v is not None})
