"""The ``gpulease`` command line."""

from __future__ import annotations

from typing import Any

import click

from .. import __version__, errors
from . import admin, bookings, drains, events, leases, report, service, simulate
from ._common import fail


def _fail(exc: errors.GpuLeaseError) -> None:
    """A server's refusal as one line naming gpulease commands (not HTTP paths); exit 2 for what
    the caller can fix, 1 for the server's trouble."""
    fail(exc.message, 2 if exc.status < 500 else 1)


class Group(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except errors.GpuLeaseError as exc:
            _fail(exc)


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
