"""Using the cluster: status, leases, acquire, release, keep and usage."""

from __future__ import annotations

import contextlib
import difflib
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from .. import errors, protocol
from ..client import Client, HeldLease, Lease
from ..node import claimexec
from ..protocol import escaped
from ..sizes import ordinal, parse_gpu_mem, show_duration
from ._common import (
    Duration,
    ago,
    console,
    err_console,
    fail,
    gpu_places,
    lease_parts,
    one_line,
    resolve_lease,
    server_options,
    short_label,
    shown,
    span,
)


def _table(title: str | None = None) -> Table:
    """A borderless table, a row per line: what fits 80 columns (cells that may be cut say so)."""
    return Table(title=title, box=None, pad_edge=False, title_justify="left", title_style="bold")


def _command_label(command: tuple[str, ...]) -> str:
    """The label of a lease taken for ``command``: its words on one printable line, cut to 120
    characters. A newline or a tab in an argument (``bash -c 'a\nb'``) is a space here: the
    server refuses control characters in a label, which must never fail the command."""
    return " ".join(protocol.plain(" ".join(command)).split())[:120]


@click.command()
@click.option(
    "--wide", is_flag=True, help="Every GPU on a line, every column, nothing cut but long labels (as wide as it takes)"
)
@click.option("--json", "as_json", is_flag=True, help="Print the raw cluster JSON")
@server_options
def status(wide: bool, as_json: bool, url: str | None, token: str | None) -> None:
    """Pools, the leases with their GPUs, and the queue (--wide: every GPU with its holder)."""
    with Client(url, token) as c:
        view = c.cluster()
        view["queue"] = c.queue()
    if as_json:
        click.echo(json.dumps(view, indent=2))
        return
    out = Console(width=100_000) if wide else console  # --wide: lines as long as their content
    now = view["now"]
    # Borderless, as every table here: 10 columns of counts and the pool's whole name fit 80 (with
    # borders, a sliced pool's name was cut to "A100-… (defa…"). Which pool a request without
    # --pool gets goes in the title, where it takes no column.
    default_pool = view.get("default_pool")
    several = len(view["pools"]) > 1 and default_pool in view["pools"]
    pools = _table("Pools" + (f" (default: {escaped(default_pool)})" if several else ""))
    # warm: held between a notebook's cells and lent to whoever waits (a column once there are any)
    counts = (
        "nodes",
        "gpus",
        "free",
        "leased",
        *(("warm",) if any(p.get("warm") for p in view["pools"].values()) else ()),
        # sliced: GPUs shared by slices; slices: the slices on them (columns once there are any)
        *(("sliced", "slices") if any(p.get("sliced") for p in view["pools"].values()) else ()),
        "down",
    )
    for col in ("pool", *counts, "waiting"):
        pools.add_column(col, justify="right" if col != "pool" else "left", no_wrap=True)
    for name, p in sorted(view["pools"].items()):
        waiting = sum(1 for w in view["queue"] if w["pool"] == name)
        pools.add_row(shown(name), *(str(p.get(k, 0)) for k in counts), str(waiting))
    out.print(pools)
    unleased: list[str] = []
    draining: dict[tuple[str, str], list[dict[str, Any]]] = {}  # (node, lease) -> its draining GPUs
    for n in view["nodes"]:
        for g in n["gpus"]:
            if g.get("draining"):
                draining.setdefault((n["name"], g["draining"]["lease"]), []).append(g)
            if g.get("unleased_use"):
                pids = ", ".join(str(pid) for pid in g["unleased_use"].get("pids", []))
                whose = "not its holder's" if g.get("lease") else "no lease holds this GPU"
                unleased.append(f"{n['name']} GPU {g['index']}, pids {pids} ({whose})")
    if wide:
        _gpu_table(view, out)
    else:
        _lease_table(view)
    for n in view["nodes"]:  # a GPU shared by slices: how many, and the memory left for another
        for g in n["gpus"]:
            if g.get("slice_mem"):
                out.print(Text.assemble(("sliced", "blue"), ": ", shown(_sliced_line(n["name"], g))), soft_wrap=True)
    for (node, _), gs in draining.items():
        d, which = gs[0]["draining"], ",".join(str(g["index"]) for g in gs)
        line = f"{node} GPU {which}: {d['user']}'s lease {d['state']} {ago(d['since'], now)} ago, free once clean"
        if d.get("state") == "unleased":
            line = f"{node} GPU {which}: in use by a process no lease covers; free once clean"
        elif d.get("abandoned"):
            line = f"{node} GPU {which}: agent gave up pid {d['abandoned'].get('pid')}: gpulease drain list"
            out.print(Text.assemble(("flagged", "bold red"), ": ", shown(line)), soft_wrap=True)
            continue
        out.print(Text.assemble(("draining", "cyan"), ": ", shown(line)), soft_wrap=True)
    for n in view["nodes"]:
        iso = str(n.get("isolation") or "")
        if n.get("source") == "nvml" and iso.startswith("off"):
            err_console.print(Text.assemble(("GPU isolation", "yellow"), f" of {n['name']}: ", shown(iso[:60])))
    for line in unleased:
        err_console.print(Text.assemble(("unleased use", "bold red"), ": ", shown(line)), soft_wrap=True)
    if view["queue"]:
        q = _table("Queue")
        q.add_column("request", no_wrap=True)
        for col in ("pool", "#", "user", "gpus", "waiting"):
            q.add_column(col, no_wrap=True, justify="right" if col in ("#", "gpus", "waiting") else "left")
        q.add_column("label")
        for w in view["queue"]:
            q.add_row(
                shown(w["id"]),
                shown(w["pool"]),
                str(w["position"]),
                shown(w["user"]),
                str(w["gpus"]),
                ago(w["enqueued_at"], now),
                short_label(w["label"]),
            )
        out.print()
        out.print(q)


def _lease_table(view: dict[str, Any]) -> None:
    """A line per lease: its full id (to paste into release / keep), holder, GPUs, label cut to fit."""
    now = view["now"]
    by_id: dict[str, dict[str, Any]] = {}
    for n in view["nodes"]:
        for g in n["gpus"]:
            for sl in g.get("slices") or []:  # a slice: its GPU and the memory it holds of it
                lease = {"id": sl["lease"], "user": sl["user"], "label": sl.get("label", ""), "since": sl["since"]}
                if sl.get("warm_since"):  # kept warm for its notebook's next cell: the state column says so
                    lease["warm_since"] = sl["warm_since"]
                row = by_id.setdefault(sl["lease"], {"lease": lease, "parts": {}, "utils": []})
                row["parts"].setdefault(n["name"], []).append(int(g["index"]))  # k slices: each of its GPUs
                row["slice"] = f" {mem_size(sl['gpu_mem_mb'])}/{mem_size(g.get('memory_mb') or 0)}"
            lease = g.get("lease")
            if not lease:
                continue
            row = by_id.setdefault(lease["id"], {"lease": lease, "parts": {}, "utils": []})
            row["parts"].setdefault(n["name"], []).append(int(g["index"]))
            if g.get("sample"):
                row["utils"].append(g["sample"]["util"])
    console.print()
    if not by_id:
        console.print("[bold]Leases[/]: none")
        return
    warned = [r for r in by_id.values() if r["lease"].get("idle_warning")]
    states = bool(warned) or any(r["lease"].get("warm_since") for r in by_id.values())
    table = _table("Leases")
    table.add_column("lease", no_wrap=True)
    table.add_column("user", no_wrap=True)
    # Whole unless a gang's list of nodes is long: then it may be cut to fit.
    table.add_column(
        "GPUs", no_wrap=all(len(gpu_places(r["parts"]) + r.get("slice", "")) <= 24 for r in by_id.values())
    )
    table.add_column("util", no_wrap=True, justify="right")
    table.add_column("held", no_wrap=True, justify="right")
    if states:
        table.add_column("state", no_wrap=True)
    table.add_column("label")  # takes what is left, cut with an ellipsis
    for lid, row in sorted(by_id.items(), key=lambda kv: (kv[1]["lease"].get("since") or 0, kv[0])):
        lease, utils = row["lease"], row["utils"]
        cells: list[Any] = [
            shown(lid),
            shown(lease.get("user", "")),
            one_line(gpu_places(row["parts"]) + row.get("slice", "")),
            f"{sum(utils) / len(utils):.0f}%" if utils else "",
            ago(lease.get("since"), now),
        ]
        if states:
            if lease.get("idle_warning"):
                cells.append(Text("idle", style="magenta"))
            else:
                cells.append(Text("warm", style="cyan") if lease.get("warm_since") else Text("active"))
        cells.append(short_label(lease.get("label", "")))
        table.add_row(*cells)
    console.print(table)
    for r in warned:
        lid = r["lease"]["id"]
        short = lid[:10] if sum(other.startswith(lid[:10]) for other in by_id) == 1 else lid
        left = span(r["lease"]["reclaim_at"] - now)
        console.print(
            Text.assemble((f"{short} idle", "magenta"), f": reclaimed in {left} unless used (gpulease keep {short})"),
        )


def _sliced_line(node: str, g: dict[str, Any]) -> str:
    """'box GPU 0: 2 slices, 40G of 80G leased, 40G free' (and what ended slices still hold)."""
    live = g.get("slices") or []
    line = f"{node} GPU {g['index']}: {len(live)} slice{'' if len(live) == 1 else 's'}, "
    return line + _slice_memory(g)


def _slice_memory(g: dict[str, Any]) -> str:
    """'40G of 80G leased, 40G free' of a GPU shared by slices (and what ended slices still hold)."""
    mem = g["slice_mem"]
    leased = sum(sl["gpu_mem_mb"] for sl in g.get("slices") or [])
    line = f"{mem_size(leased)} of {mem_size(mem['total_mb'])} leased, {mem_size(mem['free_mb'])} free"
    held = sum(d["gpu_mem_mb"] for d in g.get("slices_draining") or [])
    return line + (f", {mem_size(held)} draining" if held else "")


def mem_size(mb: int) -> str:
    """GPU memory, short: "10G" for 10240 MB, "1.5G", or "512M" under a GB."""
    if mb >= 1024:
        return f"{mb / 1024:.1f}".removesuffix(".0") + "G"
    return f"{mb}M"


def _gpu_table(view: dict[str, Any], out: Console) -> None:
    """--wide: every GPU on its line with everything known about it, nothing cut but a long label
    (its first 40 columns)."""
    now = view["now"]
    gpus = _table("GPUs")
    for col in ("node", "gpu", "model", "memory", "state", "util", "mem used", "holder", "label", "held", "lease"):
        gpus.add_column(col, no_wrap=True)
    colors = {"free": "green", "leased": "yellow", "warm": "blue", "sliced": "blue", "draining": "cyan", "down": "red"}
    for n in view["nodes"]:
        for g in n["gpus"]:
            lease = g.get("lease") or {}
            state = f"[{colors.get(g['state'], 'white')}]{g['state']}[/]"
            if lease.get("idle_warning"):
                state += f" [magenta]idle: reclaim in {max(0, lease['reclaim_at'] - now):.0f}s[/]"
            if g.get("unleased_use"):
                state += " [bold red]unleased use[/]"
            sample = g.get("sample") or {}
            if g.get("slice_mem"):  # shared by slices: how many, and the memory left (a line each below)
                lease = {"user": f"{len(g.get('slices') or [])} slices", "label": _slice_memory(g)}
            gpus.add_row(
                shown(n["name"]),
                str(g["index"]),
                shown(g.get("model", "")),
                mem_size(g["memory_mb"]) if g.get("memory_mb") else "",
                state,
                f"{sample['util']:.0f}%" if "util" in sample else "",
                mem_size(sample["mem_used_mb"]) if "mem_used_mb" in sample else "",
                shown(lease.get("user", "")),
                short_label(lease.get("label", "")),
                ago(lease.get("since"), now),
                shown(lease.get("id", "")),
            )
    out.print()
    out.print(gpus)


@click.command("leases")
@click.option("--all", "everyone", is_flag=True, help="Everyone's, not only yours")
@click.option("--json", "as_json", is_flag=True, help="Print the raw lease records")
@server_options
def leases_cmd(everyone: bool, as_json: bool, url: str | None, token: str | None) -> None:
    """Your leases (--all: everyone's) and queued requests, with the ids release and keep take."""
    with Client(url, token) as c:
        rows = c.leases(everyone=everyone)
        me = c.whoami()["user"]
        waiting = [w for w in c.queue() if everyone or w["user"] == me]
    if as_json:
        click.echo(json.dumps({"leases": rows, "waiting": waiting}, indent=2))
        return
    if not rows and not waiting:
        click.echo(
            "no leases"
            + ("" if everyone else f" of {me}")
            + ("" if everyone else " (gpulease leases --all: everyone's)")
        )
        return
    now = time.time()
    table = _table()
    table.add_column("lease", no_wrap=True)
    if everyone:
        table.add_column("user", no_wrap=True)
    table.add_column("state", no_wrap=True)
    places = [gpu_places(lease_parts(r)) for r in rows] + [f"{w['gpus']}x {w['pool']}" for w in waiting]
    table.add_column("GPUs", no_wrap=all(len(p) <= 24 for p in places))  # a long gang's may be cut
    table.add_column("held", no_wrap=True, justify="right")
    table.add_column("expires", no_wrap=True, justify="right")
    table.add_column("label")
    for r in rows:
        if r.get("idle_warning") or r.get("reclaim_at"):
            state = Text("idle", style="magenta")
        elif r.get("warm_since") and r["state"] == "active":  # between a notebook's cells, lendable
            state = Text("warm", style="cyan")
        else:
            state = Text(r["state"])
        cells: list[Any] = [shown(r["id"]), *([shown(r["user"])] if everyone else []), state]
        cells += [
            one_line(f"{gpu_places(lease_parts(r))}"),
            ago(r.get("created_at"), now),
            "in " + span(r["expires_at"] - now) if r.get("expires_at") else "",
            short_label(r.get("label", "")),
        ]
        table.add_row(*cells)
    for w in waiting:
        cells = [
            shown(w["id"]),
            *([shown(w["user"])] if everyone else []),
            Text(f"queued #{w['position']}", style="cyan"),
        ]
        cells += [one_line(f"{w['gpus']}x {w['pool']}"), "", "", short_label(w.get("label", ""))]
        table.add_row(*cells)
    console.print(table)


@click.command(context_settings={"ignore_unknown_options": True})
@click.option("--gpus", default=1, show_default=True, type=int)
@click.option("--pool")
@click.option("--ttl", type=Duration(), help="How long the lease lives without renewal: 600, 10m, 1h")
@click.option("--wait", default="0", type=Duration(allow_zero=True), help="How long to wait in the queue: 30, 30s, 10m")
@click.option("--label", default="")
@click.option(
    "--nodes",
    type=int,
    help="K > 1: a gang of GPUS/K GPUs on each of K nodes, all or nothing (no COMMAND: it runs here)",
)
@click.option(
    "--gpu-mem",
    help="A slice of one GPU instead: 10GB, 10240MB or a fraction such as 0.25 (pools that share their GPUs)",
)
@click.option(
    "--json", "as_json", is_flag=True, help="No COMMAND: print the lease as JSON (as when stdout is not a terminal)"
)
@server_options
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def acquire(
    gpus: int,
    pool: str | None,
    ttl: float | None,
    wait: float,
    label: str,
    nodes: int | None,
    gpu_mem: str | None,
    as_json: bool,
    url: str | None,
    token: str | None,
    command: tuple[str, ...],
) -> None:
    """Lease GPUs. With a COMMAND (after --), run it on them and release when it exits:

    gpulease acquire --gpus 2 --wait 600 -- python train.py

    If the lease ends first (revoked, expired), its node agent (on this host) stops the command.
    """
    if command and command[0].startswith("-"):  # a mistyped option, not a program (unknown options pass through)
        known = [o for param in click.get_current_context().command.params for o in param.opts if o.startswith("--")]
        close = difflib.get_close_matches(command[0].split("=", 1)[0], known, n=1)
        raise click.UsageError(
            f"no such option: {command[0]}"
            + (f" (did you mean {close[0]}?)" if close else "")
            + ".\nA COMMAND to run goes after --: gpulease acquire --gpus 1 -- python train.py"
        )
    if command and nodes is not None and nodes > 1:
        fail(
            f"a COMMAND runs on this machine only, not on {nodes} nodes: lease the gang without one "
            f"(gpulease acquire --gpus {gpus} --nodes {nodes}), or run it with %%gpu_train --nodes {nodes}"
        )
    if gpu_mem is not None:
        try:
            parse_gpu_mem(gpu_mem)
        except ValueError as exc:
            raise click.UsageError(f"--gpu-mem: {exc}") from None
        if (nodes or 1) > 1:
            raise click.UsageError(
                "--gpu-mem is a slice of each GPU, on one node (--gpus k: k GPUs): drop --nodes, or drop --gpu-mem"
            )
    if command:
        unrunnable = _unrunnable(command[0])
        if unrunnable:  # as a shell says it, and before any GPU is taken (or waited for)
            why, code = unrunnable
            if code == 127 and command[0].isdigit():  # `gpulease acquire 2`: a count, not a program
                why += f"; to lease {command[0]} GPUs: gpulease acquire --gpus {command[0]}"
            fail(why, code, prefix="gpulease")
    with Client(url, token) as c:
        if not command:
            lease = _acquire_waiting(c, gpus, pool, wait, ttl=ttl, label=label, nodes=nodes, gpu_mem=gpu_mem)
            if as_json or not sys.stdout.isatty():  # for a script: lease=$(gpulease acquire ...)
                click.echo(json.dumps(lease.raw, indent=2))
            else:  # for a person: where, and the id that release takes
                console.print(f"[green]leased[/] {gpu_places(lease_parts(lease.raw))} ({lease.id})")
            if lease.gpu_mem_mb:
                each = "each of " if len(lease.gpus) > 1 else ""  # k slices: one on each of k GPUs
                indexes = ",".join(str(i) for i in lease.indexes)
                err_console.print(f"a slice of {lease.gpu_mem_mb} MB of {each}{lease.node} GPU {indexes}")
            mine = _claim_of(c, lease)  # so that the lease's GPUs know whose processes are its (claimexec.py)
            if mine is not None:
                claimexec.claim_here(mine, "this user")
            longer = " (--ttl 1h for longer)" if ttl is None else ""
            err_console.print(f"lease {lease.id} expires in {span(lease.ttl)} unless renewed{longer}")
            err_console.print(f"release it with: gpulease release {lease.id}")
            return
        t0 = time.monotonic()
        lease = _acquire_waiting(c, gpus, pool, wait, ttl=ttl, label=label or _command_label(command), gpu_mem=gpu_mem)
        held = HeldLease(c, lease)  # renewed while the command runs
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
        argv = list(command)
        mine = _claim_of(c, held.lease)
        if mine is not None:  # the command claims the lease at the node agent, then runs (claimexec.py)
            # -P: never a module of the current directory (a json.py there would run first, with
            # the claim's token at hand)
            env[claimexec.CLAIM_ENV] = json.dumps(mine)
            argv = [sys.executable, "-P", "-m", claimexec.__name__, *argv]
        code, failed, ended = 1, "", None
        try:
            code = subprocess.call(argv, env=env)
            if code < 0:  # ended by a signal: as a shell reports it
                code = 128 - code
        except KeyboardInterrupt:
            code = 130
        except OSError as exc:  # gone since the check above, or not an executable after all
            code = 127 if isinstance(exc, FileNotFoundError) else 126
            failed = f"{command[0]}: {'command not found' if code == 127 else exc.strerror or exc}"
        finally:
            ended = held.release()
            took = f"{time.monotonic() - t0:.1f}s"
            if held.unreleased:
                err_console.print(f"[yellow]not released[/] {held.id} after {took}: {held.unreleased}")
                err_console.print(f"  it expires in {span(held.ttl)}, or: gpulease release {held.id}")
            elif ended is None:
                err_console.print(f"released {held.id} after {took}")
            else:  # the server ended it first (revoked, expired, reclaimed): the node agent ends the command
                err_console.print(f"[red]lease {held.id} ended[/] after {took}: {ended}")
        if failed:
            fail(failed, code, prefix="gpulease")
        sys.exit(code)


def _claim_of(c: Client, lease: Lease) -> dict[str, Any] | None:
    """What a process of this host claims ``lease`` with at its node agent (claimexec.py); None
    for a gang (its processes run on each node, not here) or a server that names no instance."""
    if len(lease.parts()) != 1:
        return None
    try:
        instance = str(c.request("GET", protocol.INFO).get("instance") or "")
    except errors.GpuLeaseError:
        return None
    if not instance or not c.token:
        return None
    user = {k.lower(): v for k, v in c.headers.items()}.get(protocol.USER_HEADER.lower(), "")
    return json.loads(claimexec.claim_env(instance, lease.node, lease.id, lease.token, c.token, user, lease.indexes))


def _acquire_waiting(c: Client, gpus: int, pool: str | None, wait: float, **request: Any) -> Lease:
    """``c.acquire``, showing on stderr where a queued request stands (a spinner on a terminal, a
    line per change of place otherwise); Ctrl-C withdraws it and says so in one line (exit 130)."""
    t0 = time.monotonic()
    last: list[int | None] = [None]
    named = {"pool": pool}

    def what() -> str:  # as a queued cell's line says it: "1 GPU of A100-80GB"
        return f"{gpus} GPU{'s' if gpus != 1 else ''} of {named['pool'] or 'the default pool'}"

    with err_console.status(f"asking for {what()}…") as spinner:

        def progress(position: int | None, elapsed: float) -> None:
            if position and not named["pool"]:  # the server's default pool: asked once, while queued
                with contextlib.suppress(errors.GpuLeaseError):
                    named["pool"] = c.cluster().get("default_pool") or None
            where = f"{ordinal(position)} in line" if position else "being granted"
            spinner.update(f"queued for {what()}: {where}, {elapsed:.0f}s of --wait {show_duration(wait)}")
            if not err_console.is_terminal and position and position != last[0]:
                err_console.print(f"queued for {what()}: {where}")
                last[0] = position  # (a moment without a place, None, does not print it again)

        rid = c.new_request_id()
        try:
            return c.acquire(gpus, pool, wait=wait, progress=progress, request_id=rid, **request)
        except KeyboardInterrupt:
            spinner.stop()
            # (a queued request is withdrawn by acquire itself; one without --wait may have been
            # granted while its answer was on the way: withdrawing its id releases that grant)
            c.withdraw(rid, reason="withdrawn: Ctrl-C")
            err_console.print(f"withdrawn after {time.monotonic() - t0:.0f}s: no GPU was taken")
            sys.exit(130)


def _unrunnable(program: str) -> tuple[str, int] | None:
    """Why a shell could not run ``program``, with its exit status (127: not found, 126: found but
    not executable); None if it can."""
    if shutil.which(program):
        return None
    if os.sep in program and os.path.exists(program):
        why = "Is a directory" if os.path.isdir(program) else "Permission denied"
        return f"{program}: {why}", 126
    return f"{program}: command not found", 127


@click.command()
@click.argument("lease_id")
@server_options
def release(lease_id: str, url: str | None, token: str | None) -> None:
    """Release a lease (yours; an admin's release of another user's lease revokes it), or withdraw
    a queued request. LEASE_ID may be any unique start of the id (gpulease leases lists them)."""
    with Client(url, token) as c:
        lease_id = resolve_lease(c, lease_id)
        out = c.release(lease_id)
    click.echo(f"{lease_id}: {out['state']}" + ("" if out.get("changed") else " (already)"))


@click.command()
@click.option("--by", type=click.Choice(["user", "team", "pool", "notebook"]), default="user", show_default=True)
@click.option("--days", type=float, default=7, show_default=True, help="The period: this many days back")
@click.option("--json", "as_json", is_flag=True)
@server_options
def usage(by: str, days: float, as_json: bool, url: str | None, token: str | None) -> None:
    """GPU time used per user / team / pool / notebook, from the per-call ledger. "charged" is
    the GPU-hours fair share counts: idle time weighted by the pool's idle_weight."""
    now = time.time()
    with Client(url, token) as c:
        out = c.usage(by, now - days * 86400, now + 1)
    if as_json:
        click.echo(json.dumps(out))
        return
    if not out["rows"]:
        click.echo(f"no lease ended in the last {days:g} days (--days 30 looks further back)")
        return
    # 80 columns: short headers that never wrap, numbers right-aligned, and a long notebook path
    # folded onto a second line rather than cut short
    table = _table()
    table.add_column(by, overflow="fold")
    for head in ("calls", "GPU-h", "charged", "util %", "peak MiB", "wait p50", "revoked"):
        table.add_column(head, justify="right", no_wrap=True)
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
    console.print(f"last {days:g} days, {out['calls']} call{'' if out['calls'] == 1 else 's'}")
    console.print(table)


@click.command()
@click.argument("lease_id")
@server_options
def keep(lease_id: str, url: str | None, token: str | None) -> None:
    """Answer an idle warning: "I'm still using it" (resets the idle clock; limited per lease).
    LEASE_ID may be any unique start of the id."""
    with Client(url, token) as c:
        lease_id = resolve_lease(c, lease_id)
        out = c.keep(lease_id)
    click.echo(f"{lease_id}: kept ({out.get('extensions', 0)} extension(s) used)")
