"""Bookings: reserve GPUs ahead, list everyone's, cancel or end one."""

from __future__ import annotations

import sys
import time
from typing import Any

import click
from rich.table import Column, Table

from .. import errors
from ..client import Client
from ._common import console, err_console, server_options


def _when(ts: float) -> str:
    return time.strftime("%a %d %b %H:%M", time.localtime(ts))


@click.command()
@click.argument("pool")
@click.argument("gpus", type=int)
@click.argument("start")
@click.argument("end")
@click.option("--note", default="", help="What it is for (shown in the calendar)")
@click.option("--owner", default=None, help='Book for "team:NAME" (a member) or another user (admin)')
@click.option("--weekly", type=click.IntRange(1, 52), default=None, help="Repeat every week, this many times")
@click.option("--colocate", is_flag=True, help="All GPUs on one node (for one multi-GPU lease)")
@click.option("--dry-run", is_flag=True, help="Only check whether it fits")
@server_options
def reserve(
    pool: str,
    gpus: int,
    start: str,
    end: str,
    note: str,
    owner: str | None,
    weekly: int | None,
    colocate: bool,
    dry_run: bool,
    url: str | None,
    token: str | None,
) -> None:
    """Book GPUS GPUs of POOL from START to END (ISO 8601 with an offset, e.g. 2026-11-23T09:00+01:00,
    or epoch seconds). During the window your leases are served from it first; unused, it is lent."""
    extra: dict[str, Any] = {"note": note, "colocate": colocate}
    if owner:
        extra["owner"] = owner
    if weekly:
        extra.update(repeat="weekly", occurrences=weekly)

    def when(text: str) -> float | str:
        try:
            return float(text)
        except ValueError:
            return text

    with Client(url, token) as c:
        try:
            out = c.reserve(pool, gpus, when(start), when(end), dry_run=dry_run, **extra)
        except errors.ReservationClash as exc:
            err_console.print(f"[red]clash:[/red] {exc.message}")
            for s in exc.details.get("suggestions") or []:  # type: ignore[attr-defined]
                err_console.print(f"  fits: {_when(s['start'])} - {_when(s['end'])}")
            sys.exit(1)
    if dry_run:
        click.echo(f"fits{' on node ' + out['node'] if out.get('node') else ''}")
        return
    click.echo(
        f"{out['id']}: {out['gpus']} x {out['pool']} {_when(out['start'])} - {_when(out['end'])}"
        + (f", weekly x{out['occurrences']}" if out["repeat"] == "weekly" else "")
    )


@click.command()
@click.option("--pool", default=None)
@click.option("--days", type=float, default=14, show_default=True, help="How far ahead to list")
@server_options
def reservations(pool: str | None, days: float, url: str | None, token: str | None) -> None:
    """Everyone's bookings from now on (each weekly occurrence on its own line)."""
    now = time.time()
    with Client(url, token) as c:
        rows = c.reservations(pool, now, now + days * 86400)
    table = Table(
        Column("id", no_wrap=True),
        Column("owner", no_wrap=True),
        Column("pool", no_wrap=True),
        Column("GPUs", no_wrap=True, justify="right"),
        Column("when", no_wrap=True),
        Column("state", no_wrap=True),
        Column("note"),
        box=None,  # fits 80 columns: a booking per line, the note wraps
        pad_edge=False,
    )
    for r in rows:
        for inst in r["instances"]:
            start, end = time.localtime(inst["start"]), time.localtime(inst["end"])
            same_day = start[:3] == end[:3]
            when = f"{_when(inst['start'])}-{time.strftime('%H:%M', end) if same_day else _when(inst['end'])}"
            table.add_row(r["id"], r["owner"], r["pool"], str(r["gpus"]), when, inst["state"], r["note"])
    console.print(table if rows else "no bookings")


@click.command()
@click.argument("reservation_id")
@click.option("--end", "end_now", is_flag=True, help="End the occurrence in force now instead of cancelling")
@server_options
def unreserve(reservation_id: str, end_now: bool, url: str | None, token: str | None) -> None:
    """Cancel a booking (or, with --end, give back the GPUs of the occurrence in force now)."""
    with Client(url, token) as c:
        out = c.end_reservation(reservation_id) if end_now else c.cancel_reservation(reservation_id)
    click.echo(f"{reservation_id}: {'ended now' if end_now else out['state']}")
