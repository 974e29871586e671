"""The ``gpulease`` command line."""

from __future__ import annotations

import asyncio
import getpass
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Column, Table

from .. import __version__, errors
from ..client import DEFAULT_HOME, Client

console = Console()
err_console = Console(stderr=True)


def _fail(exc: errors.GpuLeaseError) -> None:
    err_console.print(f"[bold red]error[/]: {exc.message}")
    sys.exit(2 if exc.status < 500 else 1)


class Group(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except errors.GpuLeaseError as exc:
            _fail(exc)


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def server_options(fn: Any) -> Any:
    """--url and --token of the lease server (default: GPULEASE_URL / GPULEASE_TOKEN, else the
    files gpulease up writes)."""
    fn = click.option("--token", envvar="GPULEASE_TOKEN", help="API token")(fn)
    return click.option("--url", envvar="GPULEASE_URL", help="Lease server URL")(fn)


@click.group(cls=Group)
@click.version_option(__version__)
def main() -> None:
    """gpulease: GPUs leased to notebook cells, for exactly as long as the cell trains."""


# ---- running the service -----------------------------------------------------------------------


def _inventories(simulate: str | None, node: str | None, pool: str | None, cpu_slots: int = 0) -> list[Any]:
    from ..agent import nvml_inventory
    from ..inventory import parse_simulate

    if simulate:
        invs = parse_simulate(simulate, default_node=node)
        if pool:
            for inv in invs:
                inv.pool = pool
    else:
        invs = [nvml_inventory(node, pool)]
    if cpu_slots:
        # CPU slots for %%gpu_train --gpus 0: a node of their own in the CPU pool, on this machine.
        invs += parse_simulate(f"{invs[0].node}-cpu={cpu_slots}xCPU")
    return invs


CPU_SLOTS_HELP = "Also declare this many CPU slots (pool CPU) for %%gpu_train --gpus 0 (default: none)"


def _local_user() -> str:
    name = re.sub(r"[^A-Za-z0-9._-]", "-", getpass.getuser()) or "user"
    return name[:63]


def _write_private(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    os.chmod(path, 0o600)


async def _ensure_token(redis_url: str, prefix: str, token_file: Path, user: str) -> str:
    """Reuse the token in ``token_file`` if Redis still knows it, else create an admin token."""
    from redis.asyncio import Redis

    from ..auth import create_token, hash_token
    from ..keys import Keys

    r = Redis.from_url(redis_url, decode_responses=True)
    try:
        keys = Keys(prefix)
        if token_file.exists():
            token = token_file.read_text().strip()
            if token and await r.hexists(keys.tokens, hash_token(token)):
                return token
        token = await create_token(r, keys, user, "admin")
        _write_private(token_file, token)
        return token
    finally:
        await r.aclose()


def _tool(name: str) -> str:
    """A console script of this environment first (the one whose packages we import), else PATH's."""
    here = Path(sys.executable).with_name(name)
    return str(here) if here.exists() else (shutil.which(name) or str(here))


def _start_ray(data_dir: Path, nodes: list[Any]) -> tuple[subprocess.Popen[bytes] | None, str]:
    ray = _tool("ray")
    if not Path(ray).exists():
        err_console.print("[yellow]ray is not installed: %%gpu_train will not run (pip install ray)[/]")
        return None, ""
    from ..redis_proc import free_port

    port = free_port()
    log = open(data_dir / "ray.log", "ab")
    proc = subprocess.Popen(
        [
            ray,
            "start",
            "--head",
            f"--port={port}",
            "--block",
            "--disable-usage-stats",
            "--include-dashboard=false",
            "--num-gpus=0",
            # Every lease-server node this machine serves is a Ray resource, so that a call is
            # placed on the Ray node of its lease (magics.runner.node_resource).
            "--resources=" + json.dumps({f"gpulease_node_{n.node}": 1000 for n in nodes}),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    return proc, f"127.0.0.1:{port}"


def _wait_for_ray(address: str, timeout: float = 180.0) -> None:
    """Connect one throw-away driver, so that "gpulease is up" means a notebook's first
    %%gpu_train finds a Ray head that accepts drivers (its first connection can take ~10 s)."""
    code = (
        "import logging, ray; "
        f"ray.init(address={address!r}, log_to_driver=False, logging_level=logging.ERROR, configure_logging=False); "
        "ray.shutdown()"
    )
    with console.status("waiting for the Ray head…"):
        try:
            done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            err_console.print(f"[yellow]the Ray head at {address} did not accept a driver within {timeout:g}s[/]")
            return
    if done.returncode != 0:
        tail = (done.stderr or "").strip().splitlines()[-1:] or ["no output"]
        err_console.print(f"[yellow]the Ray head at {address} refused a driver: {tail[0]}[/]")


def _start_lab(data_dir: Path, port: int, env: dict[str, str]) -> subprocess.Popen[bytes] | None:
    jupyter = _tool("jupyter")
    try:
        import jupyterlab  # noqa: F401
    except ImportError:
        err_console.print("[yellow]JupyterLab is not installed: pip install 'gpulease[lab]' to get it[/]")
        return None
    from ..kernelspec import install

    install(prefix=sys.prefix)  # the CPU-only "Python 3 (gpulease)" kernel, beside this JupyterLab
    log = open(data_dir / "jupyterlab.log", "ab")
    return subprocess.Popen(
        [
            jupyter,
            "lab",
            "--no-browser",
            f"--port={port}",
            "--ip=127.0.0.1",
            f"--IdentityProvider.token={env['GPULEASE_LAB_TOKEN']}",
            *(["--allow-root"] if os.geteuid() == 0 else []),  # containers often run as root
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
    )


def _stop(proc: subprocess.Popen[bytes] | None, name: str) -> None:
    """SIGTERM the leader (Ray's `start --block` then stops its own children in order), then
    SIGKILL whatever is left in its process group."""
    if proc is None:
        return
    if proc.poll() is None:
        proc.terminate()
        try:
            # Ray drains for up to 30 s when workers of dead drivers linger; nothing it holds
            # needs saving, so a short grace then SIGKILL is enough.
            proc.wait(8)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    err_console.print(f"stopped {name}")


@main.command()
@click.option(
    "--simulate",
    metavar="SPEC",
    help="Declare GPUs instead of reading NVML: 4xA100-80GB or node-a=4xA100-80GB,node-b=2xT4-16GB",
)
@click.option("--port", default=8470, show_default=True, help="Port of the lease server (127.0.0.1)")
@click.option(
    "--data-dir",
    type=click.Path(path_type=Path),
    default=DEFAULT_HOME,
    show_default=True,
    help="Redis AOF, token, logs",
)
@click.option("--ray/--no-ray", default=True, show_default=True, help="Start a local Ray head")
@click.option("--lab/--no-lab", default=True, show_default=True, help="Start JupyterLab (if installed)")
@click.option("--lab-port", default=8888, show_default=True)
@click.option("--cpu-slots", type=click.IntRange(0, 1024), default=0, help=CPU_SLOTS_HELP)
@click.option("--config", type=click.Path(exists=True), help="TOML settings file")
@click.option("-v", "--verbose", is_flag=True)
def up(
    simulate: str | None,
    cpu_slots: int,
    port: int,
    data_dir: Path,
    ray: bool,
    lab: bool,
    lab_port: int,
    config: str | None,
    verbose: bool,
) -> None:
    """Run everything on this machine: Redis (AOF), lease server, node agent, Ray head, JupyterLab."""
    import secrets

    from ..config import Settings
    from ..redis_proc import RedisProcess
    from ..server import serve

    _setup_logging(verbose)
    data_dir = data_dir.expanduser().resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    nodes = _inventories(simulate, None, None, cpu_slots)
    redis_proc = RedisProcess(data_dir / "redis").start()
    ray_proc = lab_proc = None
    try:
        settings = Settings.load(config, redis_url=redis_proc.url, port=port, host="127.0.0.1")
        token = asyncio.run(_ensure_token(settings.redis_url, settings.prefix, data_dir / "token", _local_user()))
        url = f"http://127.0.0.1:{port}"
        (data_dir / "url").write_text(url + "\n")
        if ray:
            ray_proc, settings.ray_address = _start_ray(data_dir, nodes)
            (data_dir / "ray_address").write_text(settings.ray_address + "\n")
            if ray_proc is not None:
                _wait_for_ray(settings.ray_address)
        lab_url = ""
        if lab:
            env = {
                **os.environ,
                "GPULEASE_URL": url,
                "GPULEASE_TOKEN": token,
                "GPULEASE_LAB_TOKEN": secrets.token_hex(16),
            }
            if settings.ray_address:
                env["RAY_ADDRESS"] = settings.ray_address
            lab_proc = _start_lab(data_dir, lab_port, env)
            if lab_proc is not None:
                lab_url = f"http://127.0.0.1:{lab_port}/lab?token={env['GPULEASE_LAB_TOKEN']}"

        def ready(bound: int) -> None:
            gpus = sum(len(n.gpus) for n in nodes)
            console.print(
                f"[bold green]gpulease is up[/]: {gpus} GPU(s) in {', '.join(sorted({n.pool for n in nodes}))}"
            )
            console.print(f"  lease server  {url}")
            console.print(f"  token         {token}   (also in {data_dir / 'token'}, mode 0600)")
            console.print(f"  redis         {redis_proc.url}   (AOF in {data_dir / 'redis'})")
            if settings.ray_address:
                console.print(f"  ray head      {settings.ray_address}")
            if lab_url:
                console.print(f"  jupyterlab    {lab_url}")
            console.print("Ctrl-C stops everything.")

        from ..server import run_loop

        run_loop(serve(settings, stop=None, on_ready=ready, local_nodes=nodes))
    finally:
        _stop(lab_proc, "jupyterlab")
        _stop(ray_proc, "ray head")
        redis_proc.stop()
        err_console.print("stopped redis; gpulease is down")


@main.command()
@click.option("--redis-url", envvar="GPULEASE_REDIS_URL", default="redis://127.0.0.1:6379/0", show_default=True)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8470, show_default=True)
@click.option("--workers", default=1, show_default=True, help="Processes sharing the port")
@click.option("--config", type=click.Path(exists=True), help="TOML settings file")
@click.option("--ray-address", default=None, help="Ray cluster the clients should use")
@click.option("-v", "--verbose", is_flag=True)
def server(
    redis_url: str, host: str, port: int, workers: int, config: str | None, ray_address: str | None, verbose: bool
) -> None:
    """Run the HTTP lease server against an existing Redis (any number of replicas)."""
    from ..config import Settings
    from ..server import run

    _setup_logging(verbose)
    settings = Settings.load(config, redis_url=redis_url, host=host, port=port, ray_address=ray_address)
    run(settings, workers)


@main.command()
@click.option("--simulate", metavar="SPEC", help="Declared GPUs instead of NVML, e.g. 4xA100-80GB")
@click.option("--node", help="Node name (default: host name)")
@click.option("--pool", help="Pool of this node (default: GPU model and memory)")
@click.option("--url", envvar="GPULEASE_URL")
@click.option("--token", envvar="GPULEASE_TOKEN", help="An agent or admin token")
@click.option("--interval", default=2.0, show_default=True, help="Heartbeat period, seconds")
@click.option("--cpu-slots", type=click.IntRange(0, 1024), default=0, help=CPU_SLOTS_HELP)
@click.option("-v", "--verbose", is_flag=True)
def agent(
    simulate: str | None,
    cpu_slots: int,
    node: str | None,
    pool: str | None,
    url: str | None,
    token: str | None,
    interval: float,
    verbose: bool,
) -> None:
    """Declare this node's GPUs to the lease server and keep it alive."""
    from ..agent import run_remote

    _setup_logging(verbose)
    invs = _inventories(simulate, node, pool, cpu_slots)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with Client(url, token) as client:
        try:
            run_remote(client, invs, interval, stop)
        except KeyboardInterrupt:
            pass


# ---- using it ------------------------------------------------------------------------------------


def _ago(ts: float | None, now: float) -> str:
    if not ts:
        return ""
    secs = int(now - ts)
    return f"{secs // 3600}h{secs % 3600 // 60:02d}m" if secs >= 3600 else f"{secs // 60}m{secs % 60:02d}s"


@main.command()
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


@main.command(context_settings={"ignore_unknown_options": True})
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


@main.command()
@click.argument("lease_id")
@server_options
def release(lease_id: str, url: str | None, token: str | None) -> None:
    """Release a lease (yours; an admin's release of another user's lease revokes it)."""
    with Client(url, token) as c:
        out = c.release(lease_id)
    click.echo(f"{lease_id}: {out['state']}" + ("" if out.get("changed") else " (already)"))


def _when(ts: float) -> str:
    return time.strftime("%a %d %b %H:%M", time.localtime(ts))


@main.command()
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


@main.command()
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


@main.command()
@click.argument("reservation_id")
@click.option("--end", "end_now", is_flag=True, help="End the occurrence in force now instead of cancelling")
@server_options
def unreserve(reservation_id: str, end_now: bool, url: str | None, token: str | None) -> None:
    """Cancel a booking (or, with --end, give back the GPUs of the occurrence in force now)."""
    with Client(url, token) as c:
        out = c.end_reservation(reservation_id) if end_now else c.cancel_reservation(reservation_id)
    click.echo(f"{reservation_id}: {'ended now' if end_now else out['state']}")


@main.command()
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


@main.command()
@click.argument("lease_id")
@server_options
def keep(lease_id: str, url: str | None, token: str | None) -> None:
    """Answer an idle warning: "I'm still using it" (resets the idle clock; limited per lease)."""
    with Client(url, token) as c:
        out = c.keep(lease_id)
    click.echo(f"{lease_id}: kept ({out.get('extensions', 0)} extension(s) used)")


@main.command()
@click.argument("lease_id")
@click.option("--reason", default="")
@server_options
def revoke(lease_id: str, reason: str, url: str | None, token: str | None) -> None:
    """Revoke anyone's lease (admin)."""
    with Client(url, token) as c:
        out = c.revoke(lease_id, reason)
    click.echo(f"{lease_id}: {out['state']}")


@main.group(invoke_without_command=True)
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


@main.group(invoke_without_command=True)
@click.option("--trace", type=click.Path(exists=True, dir_okay=False), help="Trace CSV, or an events export (.jsonl)")
@click.option("--gpus", type=click.IntRange(min=1), help="GPUs of the simulated cluster")
@click.option("--node-gpus", default=8, show_default=True, type=click.IntRange(min=1), help="GPUs per node")
@click.option(
    "--policies",
    default="calendar,culler-10m,culler-60m,lease,lease+resv",
    show_default=True,
    help="Any of calendar, culler-10m, culler-60m, lease, lease+resv",
)
@click.option("--seed", type=int, help="Seed of the session generator [default: 1]")
@click.option("--think-median", type=float, help="Median think time between cells, s [default: 600]")
@click.option("--users", type=int, help="People the sessions belong to [default: 40]")
@click.option("--max-cell-hours", type=float, help="Leave out cells longer than this (batch runs)")
@click.option("--out", default="simulation", show_default=True, help="Writes OUT.csv, OUT-users.csv, OUT.png")
@click.option("--no-plot", is_flag=True, help="Skip the PNG figure")
@click.option("--redis-url", help="Replay on this Redis (a private redis-server is started otherwise)")
@click.pass_context
def simulate(
    ctx: click.Context,
    trace: str | None,
    gpus: int | None,
    node_gpus: int,
    policies: str,
    seed: int | None,
    think_median: float | None,
    users: int | None,
    max_cell_hours: float | None,
    out: str,
    no_plot: bool,
    redis_url: str | None,
) -> None:
    """Compare GPU-sharing policies on a workload (--trace FILE --gpus N), replayed through the real
    scheduler under a virtual clock; or drive simulated GPUs (simulate util ...)."""
    if ctx.invoked_subcommand is not None:
        return
    if not trace or not gpus:
        raise click.UsageError("gpulease simulate needs --trace FILE and --gpus N (or a subcommand: util)")
    from ..sim import command as sim_command
    from ..sim.run import parse_policies

    try:
        names = parse_policies(policies)
        params = sim_command.session_params(seed=seed, think_median_s=think_median, users=users)
        sim_command.run(
            trace,
            gpus,
            names,
            node_gpus=node_gpus,
            params=params,
            max_cell_hours=max_cell_hours,
            out=out,
            plot=not no_plot,
            redis_url=redis_url,
            console=console,
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None


@simulate.command("util")
@click.argument("settings", nargs=-1, required=True, metavar="NODE:GPU=UTIL[,MEM_MB[,PID...]]...")
@server_options
def simulate_util(settings: tuple[str, ...], url: str | None, token: str | None) -> None:
    """Set what simulated GPUs report, e.g.: gpulease simulate util node-a:0=0 node-a:1=95,30000,4242

    UTIL is the utilization in %, MEM_MB the memory in use, PIDs the processes on the GPU.
    """
    by_node: dict[str, dict[str, dict[str, Any]]] = {}
    for item in settings:
        try:
            target, _, value = item.partition("=")
            node, _, idx = target.rpartition(":")
            parts = value.split(",")
            gpu = {
                "util": float(parts[0]),
                "mem_mb": int(parts[1]) if len(parts) > 1 else 0,
                "procs": [int(p) for p in parts[2:]],
            }
            if not node or not idx.isdigit():
                raise ValueError(item)
        except ValueError:
            raise click.UsageError(
                f"cannot read {item!r}: write NODE:GPU=UTIL[,MEM_MB[,PID...]], e.g. node-a:0=95"
            ) from None
        by_node.setdefault(node, {})[idx] = gpu
    with Client(url, token) as c:
        for node, gpus in by_node.items():
            c.request("PUT", f"/api/v1/simulate/{node}", json={"gpus": gpus})
            click.echo(f"{node}: " + ", ".join(f"GPU {i} {g['util']:g}%" for i, g in sorted(gpus.items())))


@main.group()
def reclaim() -> None:
    """Idle-GPU reclaim: explain a decision."""


def sparkline(values: list[float], top: float = 100.0) -> str:
    bars = "▁▂▃▄▅▆▇█"
    return "".join(bars[min(len(bars) - 1, int(v / top * (len(bars) - 1) + 0.5))] for v in values)


@reclaim.command("explain")
@click.argument("lease_id")
@server_options
def reclaim_explain(lease_id: str, url: str | None, token: str | None) -> None:
    """Why a lease was warned or reclaimed: the policy, the holder's activity, the samples."""
    with Client(url, token) as c:
        lease = c.get(lease_id)
    ev = lease.get("idle_evidence")
    if not ev:
        click.echo(f"lease {lease_id} ({lease['state']}) was never judged idle.")
        return
    state = lease["state"]
    verdict = (
        "reclaimed"
        if state == "revoked" and lease.get("end_reason", "").startswith("reclaimed")
        else (
            "warned: reclaim at " + time.strftime("%H:%M:%S", time.localtime(lease["reclaim_at"]))
            if lease.get("reclaim_at")
            else state
        )
    )
    console.print(f"[bold]{lease_id}[/] of {lease['user']} on {lease['node']} ({lease['pool']}): {verdict}")
    console.print(
        f"  idle for {ev.get('idle_s', 0):.0f}s under {ev.get('threshold')}% "
        f"(policy: idle_timeout {ev.get('idle_timeout')}s); holder activity: {ev.get('activity') or 'none reported'}"
    )
    table = Table()
    for col in ("GPU", "samples", "util min/mean/max %", "mem MB (last)", "utilization over the window"):
        table.add_column(col)
    for idx, samples in sorted(ev.get("gpus", {}).items()):
        utils = [s[1] for s in samples] or [0.0]
        table.add_row(
            idx,
            str(len(samples)),
            f"{min(utils):.0f} / {sum(utils) / len(utils):.1f} / {max(utils):.0f}",
            str(samples[-1][2] if samples else 0),
            sparkline(utils),
        )
    console.print(table)


@main.group()
def policy() -> None:
    """Reclaim policy per pool."""


@policy.command("show")
@server_options
def policy_show(url: str | None, token: str | None) -> None:
    """Every pool's idle-GPU reclaim policy."""
    with Client(url, token) as c:
        click.echo(json.dumps(c.request("GET", "/api/v1/policy")["policies"], indent=2))


@policy.command("set")
@click.argument("pool")
@click.argument("changes", nargs=-1, required=True, metavar="KEY=VALUE...")
@server_options
def policy_set(pool: str, changes: tuple[str, ...], url: str | None, token: str | None) -> None:
    """Change a pool's policy (admin), e.g.: gpulease policy set A100-80GB idle_timeout=900 grace=300"""
    body: dict[str, Any] = {}
    for item in changes:
        key, sep, value = item.partition("=")
        if not sep:
            raise click.UsageError(f"cannot read {item!r}: write KEY=VALUE")
        try:
            body[key] = json.loads(value)
        except json.JSONDecodeError:
            body[key] = [v for v in value.split(",") if v] if key.startswith("exempt") else value
    with Client(url, token) as c:
        click.echo(json.dumps(c.request("PUT", f"/api/v1/policy/{pool}", json=body), indent=2))


@main.group()
def kernel() -> None:
    """The CPU-only Jupyter kernel with the %%gpu_train magics."""


@kernel.command("install")
@click.option("--user", is_flag=True, help="Install for this user only (~/.local/share/jupyter)")
@click.option("--prefix", default=None, help="Install under this prefix (e.g. a virtualenv: sys.prefix)")
def kernel_install(user: bool, prefix: str | None) -> None:
    """Install the kernelspec "Python 3 (gpulease)": no GPU visible, magics preloaded."""
    from ..kernelspec import DISPLAY_NAME, install

    path = install(user=user, prefix=prefix)
    click.echo(f"installed kernel {DISPLAY_NAME!r} in {path}")


@main.group()
def token() -> None:
    """API tokens."""


@token.command("create")
@click.argument("name")
@click.option("--admin", is_flag=True, help="Admin role: may revoke others' leases and create tokens")
@click.option("--agent", "agent_role", is_flag=True, help="Agent role: may register nodes")
@click.option(
    "--proxy",
    "proxy_role",
    is_flag=True,
    help="Proxy role: a trusted front end (the Jupyter extension under JupyterHub) acting for its users",
)
@click.option("--redis-url", envvar="GPULEASE_REDIS_URL", help="Write straight into this Redis (bootstrap)")
@click.option("--prefix", default="gpulease", show_default=True)
@click.option("--url", envvar="GPULEASE_URL")
@click.option("--token", "admin_token", envvar="GPULEASE_TOKEN")
def token_create(
    name: str,
    admin: bool,
    agent_role: bool,
    proxy_role: bool,
    redis_url: str | None,
    prefix: str,
    url: str | None,
    admin_token: str | None,
) -> None:
    """Create a token for user NAME and print it (it is stored only hashed)."""
    if admin + agent_role + proxy_role > 1:
        raise click.UsageError("--admin, --agent and --proxy clash: a token has one role")
    role = "admin" if admin else "agent" if agent_role else "proxy" if proxy_role else "user"
    if redis_url:
        from redis.asyncio import Redis

        from ..auth import create_token
        from ..keys import Keys

        async def make() -> str:
            r = Redis.from_url(redis_url, decode_responses=True)
            try:
                return await create_token(r, Keys(prefix), name, role)
            finally:
                await r.aclose()

        click.echo(asyncio.run(make()))
        return
    with Client(url, admin_token) as c:
        click.echo(c.request("POST", "/api/v1/tokens", json={"user": name, "role": role})["token"])
