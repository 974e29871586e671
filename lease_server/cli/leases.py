"""Using the cluster: status, acquire, release, keep, usage and the event log."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import click
from rich.table import Table

from ..client import Client
from ._common import console, err_console, server_options


def _ago(ts: float | None, now: float) -> str:
    if not ts:
        return ""
    secs = int(now - ts)
    return f"{secs // 3600}h{secs % 3600 // 60:02d}m" if secs >= 3600 else f"{secs // 60}m{secs % 60:02d}s"


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the raw cluster JSON")
@server_options
def status(as_json: bool, url: str | None, token: str | None) -> None:
    """Pools, nodes, every GPU with its holder, and the queue."""
    with Client(url, token) as c:
        view = c.cluster()
        view["queue"] = c.queue()
    if as_json:
        click.echo(json.dumps(view, indent=2))
        return
    now = view["now"]
    pools = Table(title="Pools")
    for col in ("pool", "nodes", "gpus", "free", "leased", "down", "waiting"):
        pools.add_column(col, justify="right" if col != "pool" else "left")
    for name, p in sorted(view["pools"].items()):
        waiting = sum(1 for w in view["queue"] if w["pool"] == name)
        default = " (default)" if name == view.get("default_pool") else ""
        pools.add_row(name + default, *(str(p[k]) for k in ("nodes", "gpus", "free", "leased", "down")), str(waiting))
    console.print(pools)
    gpus = Table(title="GPUs")
    for col in ("node", "gpu", "model", "state", "util", "holder", "label", "held", "lease"):
        gpus.add_column(col)
    colors = {"free": "green", "leased": "yellow", "down": "red"}
    unleased = []
    for n in view["nodes"]:
        for g in n["gpus"]:
            lease = g.get("lease") or {}
            state = f"[{colors[g['state']]}]{g['state']}[/]"
            if lease.get("idle_warning"):
                state += f" [magenta]idle: reclaim in {max(0, lease['reclaim_at'] - now):.0f}s[/]"
            if g.get("unleased_use"):
                state += " [bold red]unleased use[/]"
                unleased.append(f"{n['name']} GPU {g['index']}: pids {g['unleased_use']['pids']}")
            util = f"{g['sample']['util']:.0f}%" if g.get("sample") else ""
            gpus.add_row(
                n["name"],
                str(g["index"]),
                g.get("model", ""),
                state,
                util,
                lease.get("user", ""),
                lease.get("label", ""),
                _ago(lease.get("since"), now),
                lease.get("id", ""),
            )
    console.print(gpus)
    for line in unleased:
        err_console.print(f"[bold red]unleased use[/]: {line} (processes on a GPU that no lease holds)")
    if view["queue"]:
        q = Table(title="Queue")
        for col in ("pool", "#", "user", "gpus", "waiting", "label"):
            q.add_column(col)
        for w in view["queue"]:
            q.add_row(w["pool"], str(w["position"]), w["user"], str(w["gpus"]), _ago(w["enqueued_at"], now), w["label"])
        console.print(q)


@click.command(context_settings={"ignore_unknown_options": True})
@click.option("--gpus", default=1, show_default=True, type=int)
@click.option("--pool")
@click.option("--ttl", type=float, help="Seconds the lease lives without renewal")
@click.option("--wait", default=0.0, type=float, help="Seconds to wait in the queue")
@click.option("--label", default="")
@server_options
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def acquire(
    gpus: int,
    pool: str | None,
    ttl: float | None,
    wait: float,
    label: str,
    url: str | None,
    token: str | None,
    command: tuple[str, ...],
) -> None:
    """Lease GPUs. With a COMMAND (after --), run it on them and release when it exits:

    gpulease acquire --gpus 2 --wait 600 -- python train.py
    """
    with Client(url, token) as c:
        if not command:
            lease = c.acquire(gpus, pool, ttl, wait, label)
            click.echo(json.dumps(lease.raw, indent=2))
            err_console.print(
                f"lease {lease.id} expires in {lease.ttl:g}s unless renewed; "
                f"release it with: gpulease release {lease.id}"
            )
            return
        t0 = time.monotonic()
        with console.status(f"asking for {gpus} GPU(s)…") as spinner:

            def progress(position: int | None, elapsed: float) -> None:
                where = f"position {position} in the queue" if position else "being granted"
                spinner.update(f"waiting for {gpus} GPU(s) of {pool or 'the default pool'}: {where}, {elapsed:.0f}s")

            held_cm = c.lease(gpus, pool, ttl, wait, label or " ".join(command)[:200], progress=progress)
            held = held_cm.__enter__()
        err_console.print(
            f"[green]leased[/] {held.node} GPU {held.cuda_visible_devices} "
            f"({held.id}, waited {time.monotonic() - t0:.1f}s)"
        )
        env = {
            **os.environ,
            "CUDA_VISIBLE_DEVICES": held.cuda_visible_devices,
            "GPULEASE_LEASE_ID": held.id,
            "GPULEASE_GPU_UUIDS": ",".join(held.uuids),
        }
        code = 1
        try:
            code = subprocess.call(list(command), env=env)
        except KeyboardInterrupt:
            code = 130
        finally:
            held_cm.__exit__(None, None, None)
            err_console.print(f"released {held.id} after {time.monotonic() - t0:.1f}s")
        sys.exit(code)


@click.command()
@click.argument("lease_id")
@server_options
def release(lease_id: str, url: str | None, token: str | None) -> None:
    """Release a lease (yours; an admin's release of another user's lease revokes it)."""
    with Client(url, token) as c:
        out = c.release(lease_id)
    click.echo(f"{lease_id}: {out['state']}" + ("" if out.get("changed") else " (already)"))


@click.command()
@click.option("--by", type=click.Choice(["user", "team", "pool", "notebook"]), default="user", show_default=True)
@click.option("--days", type=float, default=7, show_default=True, help="The period: this many days back")
@click.option("--json", "as_json", is_flag=True)
@server_options
def usage(by: str, days: float, as_json: bool, url: str | None, token: str | None) -> None:
    """GPU time used per user / team / pool / notebook, from the per-call ledger."""
    now = time.time()
    with Client(url, token) as c:
        out = c.usage(by, now - days * 86400, now + 1)
    if as_json:
        click.echo(json.dumps(out))
        return
    table = Table(by, "calls", "GPU-h", "charged GPU-h", "util %", "peak MiB", "wait p50", "revoked")
    for r in out["rows"]:
        table.add_row(
            str(r[by]),
            str(r["calls"]),
            f"{r['gpu_hours']:.2f}",
            f"{r['charged_gpu_hours']:.2f}",
            "-" if r["util_mean"] is None else f"{r['util_mean']:.0f}",
            "-" if r["mem_peak_mb"] is None else str(r["mem_peak_mb"]),
            f"{r['wait_p50_s']:.1f}s",
            str(r["revoked"]),
        )
    console.print(f"last {days:g} days, {out['calls']} calls")
    console.print(table)


@click.command()
@click.argument("lease_id")
@server_options
def keep(lease_id: str, url: str | None, token: str | None) -> None:
    """Answer an idle warning: "I'm still using it" (resets the idle clock; limited per lease)."""
    with Client(url, token) as c:
        out = c.keep(lease_id)
    click.echo(f"{lease_id}: kept ({out.get('extensions', 0)} extension(s) used)")


@click.group(invoke_without_command=True)
@click.option("--since", default="-", help="Event id to start after")
@click.option("--limit", default=50, show_default=True)
@server_options
@click.pass_context
def events(ctx: click.Context, since: str, limit: int, url: str | None, token: str | None) -> None:
    """Print the event log as JSON lines (``events export``: all of it, for the policy simulator)."""
    if ctx.invoked_subcommand is not None:
        return
    with Client(url, token) as c:
        for ev in c.events(since, limit):
            click.echo(json.dumps(ev))


@events.command("export")
@click.option("-o", "--out", type=click.Path(dir_okay=False, writable=True), help="File to write (default: stdout)")
@click.option("--since", default="-", help="Event id to start after")
@server_options
def events_export(out: str | None, since: str, url: str | None, token: str | None) -> None:
    """Write every event kept in the log as JSON lines: the input of gpulease simulate --trace."""
    n = 0
    with Client(url, token) as c, click.open_file(out or "-", "w") as f:
        while True:
            page = c.events(since, 10_000)
            for ev in page:
                f.write(json.dumps(ev) + "\n")
            n += len(page)
            if len(page) < 10_000:
                break
            since = page[-1]["id"]
    if out:
        err_console.print(f"{n} events written to {out}")
