"""``gpulease report``: a week's GPU use as text (80 columns), JSON or CSV, from the hourly
rollups (GET /api/v1/usage/summary). docs/usage.md shows how an admin mails it weekly from cron."""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
from typing import Any

import click

from ..client import Client
from ._common import server_options

FIGURES = (
    "calls",
    "cells",
    "warm_cells",
    "warm_cell_share",
    "held_gpu_s",
    "sampled_gpu_s",
    "used_gpu_s",
    "util_pct",
    "warm_gpu_s",
    "reclaimed_gpu_s",
    "evicted_gpu_s",
    "waits",
    "wait_ms_sum",
    "wait_mean_ms",
    "wait_p50_ms",
    "wait_p95_ms",
)
# name 15, then each figure one column wider than its title: 77 columns
WIDTHS = (15, 6, 7, 7, 5, 7, 8, 9, 8, 5)
TITLES = ("", "calls", "held h", "used h", "util", "warm h", "taken h", "wait p50", "p95", "warm")


def _hours(s: float) -> str:
    return f"{s / 3600:.1f}"


def _wait(ms: float | None) -> str:
    if ms is None:
        return "-"
    if ms < 1000:
        return f"{ms:.0f} ms"
    if ms < 90_000:
        return f"{ms / 1000:.0f} s"
    if ms < 5_400_000:
        return f"{ms / 60_000:.0f} min"
    return f"{ms / 3_600_000:.1f} h"


def _row(cells: tuple[str, ...]) -> str:
    return f"{cells[0]:<{WIDTHS[0]}}" + "".join(f"{c:>{w}}" for c, w in zip(cells[1:], WIDTHS[1:], strict=True))


def _head(name: str) -> str:
    return _row((name, *TITLES[1:]))


def _line(name: str, f: dict[str, Any]) -> str:
    """One row of 77 columns: a name (cut to 14), then the figures."""
    name = name if len(name) <= 14 else name[:13] + "~"
    util = "-" if f["util_pct"] is None else f"{f['util_pct']:.0f}%"
    share = "-" if f["warm_cell_share"] is None else f"{100 * f['warm_cell_share']:.0f}%"
    taken = f["reclaimed_gpu_s"] + f["evicted_gpu_s"]
    return _row(
        (
            name,
            str(f["calls"]),
            _hours(f["held_gpu_s"]),
            _hours(f["used_gpu_s"]) if f["sampled_gpu_s"] else "-",  # nothing sampled: not measured, not 0
            util,
            _hours(f["warm_gpu_s"]),
            _hours(taken),
            _wait(f["wait_p50_ms"]),
            _wait(f["wait_p95_ms"]),
            share,
        )
    )


def text(out: dict[str, Any]) -> list[str]:
    """The report as lines of at most 80 columns."""
    days = out["days"]
    scope = f"{out['user']}'s usage" if out.get("user") else "GPU usage"
    pool = f", pool {out['pool']}" if out.get("pool") else ""
    lines = [
        f"{scope} {days[0]} .. {days[-1]} (UTC, {len(days)} days{pool}), by {out['by']}",
        "",
        _head(out["by"]),
    ]
    lines += [_line(g["key"], g["total"]) for g in out["groups"]]
    lines += ["-" * 77, _line("total", out["total"]), "", _head("day")]
    lines += [_line(d["day"], d) for d in out["daily"]]
    lines += [
        "",
        "held: GPU-hours held (warm time apart); used: busy by the GPU samples",
        "(-: none sampled); util: used / sampled; warm h: kept warm, lendable;",
        "taken: reclaimed + evicted; warm: share of cells that started warm.",
        "GPU time counts in the hours it was held (UTC days), once the lease ends.",
    ]
    if not out["groups"]:
        lines.insert(2, "no lease ended in this period (gpulease usage --days 30 looks further back)")
    return lines


def to_csv(out: dict[str, Any]) -> str:
    """One row per group per day and per group in total (day "total"), then the overall ones
    (key "(all)")."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow([out["by"], "day", *FIGURES])
    for key, total, daily in [(g["key"], g["total"], g["daily"]) for g in out["groups"]] + [
        ("(all)", out["total"], out["daily"])
    ]:
        for d in daily:
            w.writerow([key, d["day"], *("" if d[f] is None else d[f] for f in FIGURES)])
        w.writerow([key, "total", *("" if total[f] is None else total[f] for f in FIGURES)])
    return buf.getvalue()


def _day(value: str) -> dt.datetime:
    try:
        return dt.datetime.strptime(value, "%Y-%m-%d").replace(tzinfo=dt.UTC)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a day like 2026-11-23") from None


@click.command()
@click.option("--by", type=click.Choice(["user", "team", "pool"]), default="user", show_default=True)
@click.option("--days", type=click.IntRange(1, 400), default=7, show_default=True, help="How many days")
@click.option(
    "--until",
    "until",
    help="The day after the last one (UTC, e.g. 2026-11-23); default: tomorrow, so that the last day is today "
    "so far, as in the Usage tab's ranges",
)
@click.option("--pool", help="Only this pool")
@click.option("--user", help="Only this user")
@click.option("--json", "as_json", is_flag=True, help="The server's answer as JSON (docs/usage.md)")
@click.option("--csv", "as_csv", is_flag=True, help="CSV: a row per group and day, and per group in total")
@server_options
def report(
    by: str,
    days: int,
    until: str | None,
    pool: str | None,
    user: str | None,
    as_json: bool,
    as_csv: bool,
    url: str | None,
    token: str | None,
) -> None:
    """GPU use per user, team or pool over a week (or --days): held, used, warm, taken back and
    waits, in total and per day, from the server's hourly rollups."""
    if as_json and as_csv:
        raise click.UsageError("--json and --csv clash: pick one")
    # whole UTC days: up to the start of tomorrow by default (7 days: six whole days and today so
    # far, as the Usage tab's "7 days"), not 7 x 24 h back from now, which cut both ends
    today = dt.datetime.now(dt.UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    end = _day(until) if until else today + dt.timedelta(days=1)
    start = end - dt.timedelta(days=days)
    with Client(url, token) as c:
        out = c.usage_summary(by, start.timestamp(), end.timestamp(), pool, user)
    if as_json:
        click.echo(json.dumps(out))
    elif as_csv:
        click.echo(to_csv(out), nl=False)
    else:
        click.echo("\n".join(text(out)))
