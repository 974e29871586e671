"""Bookings: book GPUs ahead, list everyone's, cancel or end one.

The commands' names of earlier releases (reserve, reservations, unreserve) still run, hidden from
the help, each with a line saying which command replaces it."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import click
from rich.console import Console
from rich.table import Column, Table
from rich.text import Text

from .. import errors
from ..client import Client
from ._common import console, err_console, one_line, print_error, resolve_booking, server_options


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
def book(
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
            out = c.book(pool, gpus, when(start), when(end), dry_run=dry_run, **extra)
        except errors.BookingClash as exc:
            print_error(exc.message, prefix="clash")
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
@click.option(
    "--days", type=click.FloatRange(0, 365, min_open=True), default=14, show_default=True, help="How far ahead to list"
)
@click.option("--wide", is_flag=True, help="Notes in full (as wide as they take)")
@click.option("--json", "as_json", is_flag=True, help="Print the raw booking records")
@server_options
def bookings(pool: str | None, days: float, wide: bool, as_json: bool, url: str | None, token: str | None) -> None:
    """Everyone's bookings from now on, a line each (each weekly occurrence on its own line)."""
    now = time.time()
    with Client(url, token) as c:
        rows = c.bookings(pool, now, now + days * 86400)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        console.print("no bookings")
        return
    # The state column only when some occurrence is not simply upcoming (then a blank one is), so
    # that at 80 columns the note keeps room.
    states = wide or any(inst["state"] != "upcoming" for r in rows for inst in r["instances"])
    table = Table(
        Column("id", no_wrap=True),
        Column("owner", no_wrap=True),
        Column("GPUs", no_wrap=True),
        Column("when", no_wrap=True),
        *([Column("state", no_wrap=True)] if states else []),
        Column("note"),  # takes what is left, cut with an ellipsis (--wide: all of it)
        box=None,
        pad_edge=False,
    )
    for r in rows:
        for inst in r["instances"]:
            start, end = time.localtime(inst["start"]), time.localtime(inst["end"])
            same_day = start[:3] == end[:3]
            when = f"{_when(inst['start'])}-{time.strftime('%H:%M', end) if same_day else _when(inst['end'])}"
            state = inst["state"] if wide or inst["state"] != "upcoming" else ""
            table.add_row(
                r["id"],
                r["owner"],
                f"{r['gpus']}x {r['pool']}",
                when,
                *([Text(state, style="green" if state == "active" else "")] if states else []),
                Text(r["note"]) if wide else one_line(r["note"]),
            )
    (Console(width=100_000) if wide else console).print(table)


@click.command()
@click.argument("booking_id")
@click.option("--end", "end_now", is_flag=True, help="End the occurrence in force now instead of cancelling")
@server_options
def unbook(booking_id: str, end_now: bool, url: str | None, token: str | None) -> None:
    """Cancel a booking (or, with --end, give back the GPUs of the occurrence in force now).
    BOOKING_ID may be any unique start of the id (gpulease bookings lists them)."""
    with Client(url, token) as c:
        booking_id = resolve_booking(c, booking_id)
        out = c.end_booking(booking_id) if end_now else c.cancel_booking(booking_id)
    click.echo(f"{booking_id}: {'ended now' if end_now else out['state']}")


def _renamed(command: click.Command, old: str) -> click.Command:
    """``command`` under its name of earlier releases: hidden, and saying what to run instead."""
    successor = command.name

    def run(**kwargs: Any) -> Any:
        err_console.print(f"gpulease {old} is deprecated: use gpulease {successor}")
        assert command.callback is not None
        return command.callback(**kwargs)

    return click.Command(
        old, params=command.params, callback=run, help=f"Deprecated: gpulease {successor}.", hidden=True
    )


DEPRECATED = (_renamed(book, "reserve"), _renamed(bookings, "reservations"), _renamed(unbook, "unreserve"))
