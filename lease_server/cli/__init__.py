"""The ``gpulease`` command line."""

from __future__ import annotations

from typing import Any

import click

from .. import __version__, errors
from ..client import waited_out
from . import admin, bookings, drains, events, leases, report, service, simulate
from ._common import fail


def _fail(exc: errors.GpuLeaseError) -> None:
    """A server's refusal as one line naming gpulease commands (not HTTP paths); exit 2 for what
    the caller can fix, 1 for the server's trouble."""
    fail(waited_out(exc), 2 if exc.status < 500 else 1)  # a wait in acquire's --wait, not seconds


# click >= 8.2 shows a group's help, when it is named without a subcommand, by raising this UsageError
_HELP: tuple[type[BaseException], ...] = tuple(
    e for e in (getattr(click.exceptions, "NoArgsIsHelpError", None),) if isinstance(e, type)
)


class Group(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except errors.GpuLeaseError as exc:
            _fail(exc)
        except _HELP:
            raise  # a group named alone (gpulease token): click shows its help, as it should
        except click.ClickException as exc:
            # click prints its errors on one line however long; these are wrapped to the terminal
            # as every other error of the CLI is (a usage error still shows the usage first)
            if isinstance(exc, click.UsageError) and exc.ctx is not None:
                hint = ""
                if exc.ctx.command.get_help_option(exc.ctx) is not None:
                    hint = f"Try '{exc.ctx.command_path} {exc.ctx.help_option_names[0]}' for help.\n"
                click.echo(f"{exc.ctx.get_usage()}\n{hint}", err=True)
            fail(exc.format_message(), exc.exit_code)


@click.group(cls=Group)
@click.version_option(__version__)
def main() -> None:
    """gpulease: GPUs leased to notebook cells, for exactly as long as the cell trains."""


for _command in (
    service.up,
    service.server,
    service.agent,
    leases.status,
    leases.leases_cmd,
    leases.acquire,
    leases.release,
    leases.usage,
    report.report,
    leases.keep,
    events.events,
    bookings.book,
    bookings.bookings,
    bookings.unbook,
    *bookings.DEPRECATED,
    admin.revoke,
    admin.reclaim,
    admin.policy,
    admin.kernel,
    admin.token,
    admin.migrate,
    drains.drain,
    simulate.simulate,
):
    main.add_command(_command)

# What `gpulease --help` lists: a line each that is not cut off (click would cut the docstring's
# first sentence at the terminal's width); `gpulease COMMAND --help` gives the whole docstring.
_SHORT = {
    "up": "Run everything on this machine (Redis, server, agent, Ray, Lab).",
    "server": "Run the HTTP lease server against an existing Redis.",
    "agent": "Declare this node's GPUs to the lease server and keep it alive.",
    "status": "Pools, the leases with their GPUs, and the queue.",
    "leases": "Your leases and queued requests (--all: everyone's).",
    "acquire": "Lease GPUs, and run a command on them.",
    "release": "Release a lease, or withdraw a queued request.",
    "usage": "GPU time per user, team, pool or notebook, from the ledger.",
    "report": "A week's GPU use per user, team or pool, day by day.",
    "keep": "Answer an idle warning: I'm still using it.",
    "events": "The event log, a line each (--follow for what comes).",
    "book": "Book GPUs of a pool for a time window (lent out while unused).",
    "bookings": "Everyone's bookings from now on, a line each.",
    "unbook": "Cancel a booking, or end it early (--end).",
    "revoke": "Revoke anyone's lease (admin).",
    "reclaim": "Idle-GPU reclaim: explain a decision.",
    "policy": "Idle-GPU reclaim policy per pool.",
    "kernel": "The CPU-only Jupyter kernel with the %%gpu_train magics.",
    "token": "API tokens: create, list, revoke (admin).",
    "migrate": "Move the data in Redis to this release's layout.",
    "drain": "Draining GPUs: list them, clear one an agent gave up on (admin).",
    "simulate": "Compare GPU-sharing policies on a workload.",
}
for _name, _line in _SHORT.items():
    main.commands[_name].short_help = _line
