"""``gpulease simulate``: compare sharing policies on a workload, or drive simulated GPUs."""

from __future__ import annotations

from typing import Any

import click

from .. import protocol
from ..client import Client
from ._common import console, server_options


@click.group(invoke_without_command=True)
@click.option(
    "--trace",
    type=click.Path(exists=True, dir_okay=False),
    help="Trace CSV, an events export (.jsonl), or a session workload (NotebookOS .json)",
)
@click.option("--gpus", type=click.IntRange(min=1), help="GPUs of the simulated cluster")
@click.option("--node-gpus", default=8, show_default=True, type=click.IntRange(min=1), help="GPUs per node")
@click.option(
    "--policies",
    help="Any of session, calendar, culler-10m, culler-60m, lease, lease+booking, lease-warm, lease-share  "
    "[default: all but session, lease-warm and lease-share; for a session workload all but calendar, "
    "lease-warm and lease-share]",
)
@click.option("--seed", type=int, help="Seed of the session generator [default: 1]")
@click.option("--think-median", type=float, help="Median think time between cells, s [default: 600]")
@click.option("--users", type=int, help="People the sessions belong to [default: 40]")
@click.option("--max-cell-hours", type=float, help="Leave out cells longer than this (batch runs)")
@click.option("--out", default="simulation", show_default=True, help="Writes OUT.csv, OUT-users.csv, OUT.png")
@click.option("--no-plot", is_flag=True, help="Skip the PNG figure")
@click.option("--redis-url", help="Replay on this Redis (a private redis-server is started otherwise)")
@click.option(
    "--find-min-gpus",
    is_flag=True,
    help="Search the smallest cluster (whole nodes) on which each policy keeps time-to-GPU in bounds",
)
@click.option(
    "--max-wait", default=60.0, show_default=True, type=click.FloatRange(min=0), help="With --find-min-gpus: seconds"
)
@click.option(
    "--quantile",
    default="95",
    show_default=True,
    type=click.Choice(["95", "99"]),
    help="With --find-min-gpus: the time-to-GPU percentile held to --max-wait",
)
@click.option(
    "--like-lease-on",
    type=click.IntRange(min=1),
    help="With --find-min-gpus: hold each policy to what whole-GPU lease gives on this many GPUs "
    "(at --quantile), instead of --max-wait",
)
@click.option(
    "--share-multi",
    default="whole",
    show_default=True,
    type=click.Choice(["whole", "gang"]),
    help="lease-share: a cell on several GPUs leases them whole, or a slice of each in one lease on one "
    "node (gang: %%gpu_train --gpus k --gpu-mem)",
)
@click.pass_context
def simulate(
    ctx: click.Context,
    trace: str | None,
    gpus: int | None,
    node_gpus: int,
    policies: str | None,
    seed: int | None,
    think_median: float | None,
    users: int | None,
    max_cell_hours: float | None,
    out: str,
    no_plot: bool,
    redis_url: str | None,
    find_min_gpus: bool,
    max_wait: float,
    quantile: str,
    like_lease_on: int | None,
    share_multi: str,
) -> None:
    """Compare GPU-sharing policies on a workload (--trace FILE --gpus N), replayed through the real
    scheduler under a virtual clock; find the smallest cluster for each (--trace FILE
    --find-min-gpus); or drive simulated GPUs (simulate util ...)."""
    if ctx.invoked_subcommand is not None:
        return
    if not trace or not (gpus or find_min_gpus):
        raise click.UsageError(
            "gpulease simulate needs --trace FILE and --gpus N, or --trace FILE --find-min-gpus (or a subcommand: util)"
        )
    from ..sim import command as sim_command
    from ..sim import workload
    from ..sim.run import POLICIES, parse_policies

    try:
        if redis_url:
            from ..store.engine import resolve_primary

            redis_url = resolve_primary(redis_url)  # the replay holds one plain connection to the primary
        if policies is None:
            # lease-warm on request (--policies lease,lease-warm): six columns do not fit 80
            skip = ("calendar" if workload.is_session_trace(trace) else "session", "lease-warm", "lease-share")
            policies = ",".join(p for p in POLICIES if p not in skip)
        names = parse_policies(policies)
        params = sim_command.session_params(seed=seed, think_median_s=think_median, users=users)
        if find_min_gpus:
            sim_command.find_min(
                trace,
                names,
                node_gpus=node_gpus,
                wait_s=max_wait,
                quantile=int(quantile),
                params=params,
                max_cell_hours=max_cell_hours,
                redis_url=redis_url,
                console=console,
                like_lease_on=like_lease_on,
                share_multi=share_multi,
            )
            return
        assert gpus is not None
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
            share_multi=share_multi,
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    except RuntimeError as exc:
        raise click.ClickException(str(exc)) from None


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
            c.request("PUT", protocol.simulate(node), json={"gpus": gpus})
            click.echo(f"{node}: " + ", ".join(f"GPU {i} {g['util']:g}%" for i, g in sorted(gpus.items())))
