"""``gpulease drain``: the GPUs whose lease the server ended and that are not clean yet (admin).

A draining GPU is free once its node agent has ended what remains of the lease there. One whose
agent gave a process up (it could not or must not end it: ``drain_abandoned``) stays out of
service, flagged here, until the process ends or an admin who has looked clears it.
"""

from __future__ import annotations

import time

import click

from .. import errors
from ..client import Client
from ..protocol import escaped
from ._common import ago, fail, index_list, server_options


@click.group()
def drain() -> None:
    """Draining GPUs: list them, clear one an agent gave up on (admin)."""


@drain.command("list")
@click.option("--json", "as_json", is_flag=True, help="The server's answer as JSON")
@server_options
def drain_list(as_json: bool, url: str | None, token: str | None) -> None:
    """Every draining GPU: whose lease, since when, and any process its agent gave up."""
    with Client(url, token) as c:
        rows = c.draining()
    if as_json:
        import json

        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        click.echo("no GPU is draining")
        return
    now = time.time()
    for r in rows:
        who = f"{escaped(str(r['node']))} GPU {r['index']}: {escaped(str(r.get('user') or '?'))}'s lease"
        state = escaped(str(r.get("state") or "ended"))
        gone = r.get("abandoned")
        if r.get("state") == "unleased":
            click.echo(
                f"{escaped(str(r['node']))} GPU {r['index']}: a process no lease covers uses it, "
                f"{ago(r.get('since'), now)}; free once clean"
            )
        elif gone:
            click.echo(f"{who} {state} {ago(r.get('since'), now)} ago; agent gave up pid {gone.get('pid')}")
            click.echo(f"  {escaped(str(gone.get('why', '')))[:76]}")
        else:
            click.echo(f"{who} {state} {ago(r.get('since'), now)} ago, free once clean")
    if any(r.get("abandoned") for r in rows):
        click.echo("once you have checked the process: gpulease drain clear NODE [GPU...]")


@drain.command("clear")
@click.argument("node")
@click.argument("gpus", nargs=-1, type=int)
@server_options
def drain_clear(node: str, gpus: tuple[int, ...], url: str | None, token: str | None) -> None:
    """Declare draining GPUs of NODE clean (all of its draining GPUs without GPU indexes): they
    turn free and the queue is served. Check first that nothing of the old lease runs there."""
    with Client(url, token) as c:
        try:
            rows = [r for r in c.draining() if r["node"] == node and (not gpus or r["index"] in gpus)]
        except errors.Forbidden:
            fail("only an admin clears draining GPUs: use an admin token (gpulease up writes one)")
        if not rows:
            fail(f"no GPU of {node} is draining: gpulease drain list shows those that are")
        freed = c.clear_drain(node, sorted({int(r["index"]) for r in rows}))
    n = len(rows)
    click.echo(
        f"{node} GPU {index_list([int(r['index']) for r in rows])}: cleared ({n} GPU{'s' if n != 1 else ''}, "
        f"{freed} free now)"
    )
